//! Worker selection. Every routing mode — `round_robin`, `random`, `kv` here, WebAssembly
//! policies later — implements [`Policy`] over the same inputs: a [`RequestSummary`] and one
//! [`Candidate`] per eligible worker; the per-worker booked load comes from the model's
//! [`crate::ledger::Ledger`]. The caller has already removed workers that are unhealthy, busy,
//! or already tried for this request.

mod kv;
mod policy;
mod queue;
mod random;
mod round_robin;
mod slo;
pub mod time;

pub use kv::{Cost, KvParams, KvPolicy, Terms};
pub use policy::{Candidate, Decision, Policy, RequestSummary};
pub use queue::{QueueError, RouterQueue, Ticket};
pub use random::Random;
pub use round_robin::RoundRobin;
pub use slo::Slo;

/// Built-in routing modes selectable by name in the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Cycle through workers.
    RoundRobin,
    /// Uniformly random worker.
    Random,
    /// KV-cache aware: the lowest cost (`time`: predicted time to first token; `blocks`:
    /// the Dynamo KV router's `overlap_score_weight · prefill_blocks + decode_blocks`).
    Kv,
    /// A WebAssembly policy decides, with a built-in mode as its fallback.
    Plugin,
}

impl Mode {
    /// A fresh built-in policy for this mode. `Plugin` has none of its own: it gets round
    /// robin, and the gateway puts the plugin in front of its configured fallback.
    pub fn policy(self) -> Box<dyn Policy> {
        match self {
            Mode::RoundRobin | Mode::Plugin => Box::new(RoundRobin::default()),
            Mode::Random => Box::new(Random::default()),
            Mode::Kv => Box::new(KvPolicy::new(KvParams::default())),
        }
    }
}
