//! Where a request of a model that disaggregates prefill from decode is in its two legs, and
//! how each leg's placement sees the workers (the legs themselves: `disaggregate.rs`).

use bytes::Bytes;
use kvgate_filters::route::Candidate;
use std::time::Instant;

/// The leg a placement is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegRole {
    /// The leg whose worker answers the client: an aggregated request's only leg, or a
    /// disaggregated request's decode leg. It is one of the request's attempts.
    Answer,
    /// A disaggregated request's prefill leg: prefill workers only. It is not where the
    /// request runs, so it is no attempt: the decode leg's retries are its own.
    Prefill,
}

/// Where a request is in its two legs.
#[derive(Debug, Default)]
pub struct Pd {
    /// The decode leg's body: the request plus the transfer parameters the prefill worker
    /// returned (`None`: aggregated, or the parameters were null and the request goes as is).
    pub decode_body: Option<Bytes>,
    /// A prefill worker computed the prompt: the decode placement prices it as present on
    /// every decode worker, and the first token calibrates no prefill speed.
    pub transferred: bool,
    /// When the prefill leg answered (the decode leg's first token is timed from it).
    pub prefilled_at: Option<Instant>,
}

impl Pd {
    /// The decode leg was sent once: a resend (a retry, a move before the first byte, a
    /// migrated stream's continuation) goes without the transfer parameters, which name
    /// blocks the first decode worker may have pulled (the prefill worker then frees them) or
    /// aborted, and is priced as the prompt computed where it goes.
    pub fn decode_leg_spent(&mut self) {
        self.decode_body = None;
        self.transferred = false;
    }

    /// A candidate as this leg's placement sees it: a prefill worker carries no decode load
    /// (as in Dynamo's KV router), and once a prefill worker computed the prompt every decode worker will hold
    /// it (its `prompt_blocks` are transferred, not computed), so only the decode load tells them
    /// apart.
    pub fn candidate(&self, role: LegRole, mut c: Candidate, prompt_blocks: Option<u32>) -> Candidate {
        if role == LegRole::Prefill {
            c.active_blocks = 0;
        } else if self.transferred {
            c.overlap_blocks = prompt_blocks.unwrap_or(c.overlap_blocks);
        }
        c
    }
}
