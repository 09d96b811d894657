//! The `time` cost of `kv` mode: a worker costs the time the request would wait there for its
//! first token, predicted from what the gateway knows (the worker's KV cache, the prefill
//! booked on it, its running requests) and calibrated by what it measures (each worker's
//! time to first token and inter-token latency). Milliseconds price a cached prefix, a queue
//! and a busy decode batch in one unit, so one default serves short chat and 16k-token
//! documents alike (docs/routing.md, "The time cost").
//!
//! ```text
//! cost      = ttft + slowdown + behind + duplicate (+ ahead, v · (decode + imposed), off by default)
//! decode    = shared · step + out · Δ                          its own tokens, one step each, in the batch it joins
//! imposed   = in_flight · Δ · shared                           the step time it adds to the requests decoding there
//! shared    = min(out, remaining)                              the steps it shares with the batch there now
//! Δ         = k · (seq + ctx · (prompt + out/2))               one more sequence and its context in every step
//! out       = the request's expected output tokens (0: unknown, no decode terms)
//! remaining = mean_out / 2 (what the requests there have left, on average)
//! mean_out  = the model's recent mean output tokens
//! k         = the worker's calibrated step over its prior (1 until measured)
//! behind    = prefill · (prefilling + arriving) / (1 − ρ)          the requests that share its step or queue behind it
//! arriving  = prefills booked per second per worker · join          those booked before its step begins
//! ahead     = a · min(new, ⌈q / b⌉ · b − q)                        the first token ahead, whose last step it fills
//! q         = prefill booked since the worker's queue was last empty  (`price_shared_step`)
//! b         = chunk_tokens less one per decoding request, at least half of it
//!             (`ahead` is priced with `price_queue` on; q counts this replica's bookings only)
//! duplicate = a · evicting / (1 − ρ)                               a second copy of a prefix another worker holds
//! evicting  = cold + max(0, hot − room) + min(hot, room) · held     the copy's blocks that cost a recompute
//! copy      = fleet_cached − cached;  hot: its part requests in flight share;  cold = copy − hot
//! room      = free tokens in its KV cache less its booked prefill and this prompt's own new tokens
//! held      = the fraction of its KV cache its blocks fill (room 0 and held 1 when unknown)
//! ρ         = the candidates' mean prefill utilisation (≤ 0.75)
//! slowdown = prefill · (w · Σ_j 1/out_j + v · decoding) · share      its chunks stall the running decodes
//! v        = the model's mean TTFT / mean E2E                           what a ms of E2E is worth in TTFT
//! decoding = in_flight − prefilling                                    the requests decoding there
//! share    = ((1 − ρ) / (1 − ρ_w))²                                 more often where prefill keeps it busier
//! ρ_w      = the worker's own prefill utilisation (its `prefill_load`)
//! out_j    = the expected output of each request decoding there (first token sent, not ended)
//! w        = ms of TTFT a ms of TPOT is worth: slo ttft/tpot, else the model's mean TTFT / mean TPOT
//! ttft     = join + wait + prefill + steps · step
//! join    = max(0, running − since_last_token) (0 unless stepping)  the running step's rest
//! running = min(running_step, 2 · step)        the running step's predicted length (`step` if unknown)
//! wait    = max(min(prefill_backlog, a · active_prefill_tokens),  the prefill booked ahead,
//!               a · next_step_tokens)        (0 unless stepping)  at least what shares its step
//! stepping = requests running there and a token within the last two steps
//! prefill = a · new · (1 + (cached + new/2) / attention_tokens)    GEMMs + attention over the context
//! steps   = ⌈(active_prefill_tokens + new) / chunk_tokens⌉          chunked prefill: one engine step per chunk
//! step    = step_overhead + seq · in_flight + ctx · booked context tokens
//! a       = ms_per_prefill_token
//! ```
//! `new` is the prompt minus its cached prefix: the longer of the prefix in the worker's KV
//! cache and the prefix booked on it by requests in flight (being computed now, so in its cache
//! by the time this request is scheduled behind them). Each step of a chunked prefill also
//! carries the worker's running decodes, so a busy decode batch slows a prefill there.
//!
//! `join` and `next_step_tokens` come from the worker's step phase (the ledger's
//! `step_phase`): vLLM adds a request to its batch only between engine steps, so on a worker
//! with requests running a new one first waits for the running step to end (its predicted
//! length, `Candidate::running_step_ms`, minus the time since the gateway last relayed a token
//! from it), then shares the next step with every
//! prefill booked there since that token. Without `join`, a worker that has just finished a
//! request looks the least loaded at the moment a newcomer would wait a whole step there, and
//! load-aware choices among equally cached workers lose to round robin.
//!
//! `behind` and `duplicate` are prefill time the request puts on others: its own prefill delays
//! the requests that queue behind it here, and a copy of a prefix is computed again later by
//! someone whose block it evicted. On a fleet whose prefill keeps it busy a fraction ρ of the
//! time, such work delays not only the requests waiting now but those that arrive before the
//! queue next empties: a busy period serves `1 / (1 − ρ)` times the work that started it (an
//! M/M/1 queue). ρ is the candidates' mean predicted prefill time booked per second (the
//! ledger's `prefill_load`), capped at [`MAX_RHO`]. The fleet's, not each worker's: a
//! per-worker ρ lags its bookings by seconds, and the cost then chased the worker booked least
//! lately, moving requests off the workers caching their prefix.
//!
//! `duplicate` prices what the fleet's caches lose when a prefix another worker already holds
//! (`fleet_cached`, the longest cached prefix among the candidates) is computed again here:
//! once a cache is full, every block of the second copy evicts a block some later request would
//! have found, so the copy costs about its own prefill again, later, to someone else. Without
//! it, requests leave the worker holding their prefix as soon as its queue is a little longer,
//! and on a cache-bound fleet the copies halve what the caches hold (docs/routing.md).
//!
//! A hot prefix, one that requests in flight share now (`fleet_active_overlap_blocks`, from
//! the booked load), is the exception where a cache has free room
//! (`Candidate::cache_room_blocks`): more of its requests are coming, a copy gives each of them
//! another worker to choose among, and the copy evicts nothing now. Its part within the room is
//! priced only as likely to evict as the cache is full already. A prefix nobody is using now (a
//! conversation's history between its turns) keeps the full price even in an empty cache: at
//! most its own conversation gains from a copy, and on a busy fleet computing it twice costs the
//! compute of a cache miss.
//!
//! `decode` and `imposed` (`price_decode`, off by default for now) price what the choice
//! costs every token after the first: a
//! worker whose batch is large, or whose running requests attend over long contexts, steps
//! slower, and the request joining it both waits those steps and lengthens them for everyone
//! there. Agents wait for the whole answer, so a choice that wins the first token by a prefix
//! hit can lose the request on a crowded worker; with these terms the cost is the time the
//! request and its neighbours lose overall. A worker's batch is what it is now only while the
//! requests in it last (`remaining`); after that it is whoever arrives, alike on every worker,
//! so only the steps shared with the batch there now tell workers apart. The weight grows with
//! the expected output up to that, so a short answer still goes where its prefix is and a long
//! one leaves a crowded batch. Both are end-to-end time, so they are priced as the stall's
//! end-to-end part is, at `v` (a ms of end to end is worth the model's mean TTFT over its mean
//! end to end in TTFT): counted in full, a long answer's seconds of decode outweighed any first
//! token, and the median TTFT doubled; at `v` they decide among workers whose first tokens are
//! close and leave the first token where it is best.
//!
//! Priors ([`TimePriors::default`]) are Llama-3.1-8B on one H100 under vLLM (about 28k prefill
//! tokens/s, 6 ms per step, KV reads of 128 KiB per context token at 3 TB/s). The gateway
//! corrects `a` and `step` per worker from the TTFT and ITL it observes (the `Candidate`'s
//! `ms_per_prefill_token` and `step_ms`, when set, are the calibrated values), so other
//! models and hardware need no hand-set constants.

use super::{Candidate, RequestSummary};

/// The highest prefill utilisation `behind` and `duplicate` believe (a factor of 4). ρ is
/// predicted from booked time, not measured, and a fleet booked past its capacity would
/// otherwise price a queue that never empties.
pub const MAX_RHO: f64 = 0.75;

/// How many requests a prefill queue at utilisation `rho` serves before it empties, per
/// request waiting now: `1 / (1 − ρ)`.
pub fn busy_period(rho: f64) -> f64 {
    1.0 / (1.0 - rho.clamp(0.0, MAX_RHO))
}

/// vLLM's default `max_num_batched_tokens` for its OpenAI server on a data-centre GPU: the
/// prefill budget of one engine step where the operator has not said the workers' own.
pub const DEFAULT_CHUNK_TOKENS: u64 = 8192;

/// The model's prior constants, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimePriors {
    /// Prefill time per new token (the GEMMs), ms.
    pub ms_per_prefill_token: f64,
    /// Context length at which a new token's attention costs as much as its GEMMs.
    pub attention_tokens: f64,
    /// Fixed time of one engine step, ms.
    pub step_overhead_ms: f64,
    /// Step time per running sequence, ms.
    pub step_ms_per_seq: f64,
    /// Step time per context token the running sequences attend over, ms.
    pub step_ms_per_ctx_token: f64,
    /// Prefill tokens per engine step (vLLM's `max_num_batched_tokens`).
    pub chunk_tokens: f64,
}

impl Default for TimePriors {
    fn default() -> Self {
        Self {
            ms_per_prefill_token: 0.035,
            attention_tokens: 27_000.0,
            step_overhead_ms: 6.0,
            step_ms_per_seq: 0.03,
            step_ms_per_ctx_token: 4.0e-5,
            chunk_tokens: DEFAULT_CHUNK_TOKENS as f64,
        }
    }
}

/// One candidate's predicted time to first token, by term (ms).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Prediction {
    /// Tokens it would compute (not cached, not being computed).
    pub new_tokens: f64,
    /// Waiting for the prefill booked ahead of it.
    pub wait_ms: f64,
    /// Its own prefill.
    pub prefill_ms: f64,
    /// The running decodes carried by the steps until its first token.
    pub steps_ms: f64,
    /// Waiting for the engine step running there now to end (vLLM adds requests to the batch
    /// between steps): a step minus the time since its last token, when it has requests
    /// running.
    pub join_ms: f64,
    /// How long its own prefill keeps the worker busy once started (its prefill and its own
    /// steps): what it adds to the worker's prefill backlog.
    pub own_ms: f64,
    /// What its prefill costs the requests decoding there: each of their steps stalls while
    /// its chunks run, which adds its prefill time over their output length to their time per
    /// output token; summed, and priced at what a ms of time per output token is worth in time
    /// to first token (`RequestSummary::tpot_weight`). A stall costs a short answer far more
    /// than a long one: one chunk in its few steps multiplies its time per output token.
    pub slowdown_ms: f64,
    /// What the stall weighed there against the fleet (`share`; 1 when not priced by it).
    pub stall_share: f64,
    /// What its prefill costs the requests that will queue behind it there: those queued now
    /// and those that arrive before the queue empties (`1 / (1 − ρ)` per queued one), each
    /// waiting its prefill time longer.
    pub behind_ms: f64,
    /// What its prefill delays the first token of the prompt queued last there, whose last
    /// step it fills (`ahead`; 0 when not priced).
    pub ahead_ms: f64,
    /// What a second copy of a prefix another worker holds costs the fleet's caches: its
    /// prefill time, paid again later by the requests whose blocks it evicts.
    pub duplicate_ms: f64,
    /// The prefill time per token it was predicted with (the worker's calibrated figure, or
    /// the prior), ms: what its first token calibrates.
    pub ms_per_prefill_token: f64,
    /// Its own decode: its expected output tokens, one engine step each, in the batch it
    /// joins there.
    pub decode_ms: f64,
    /// What its decode costs the requests decoding there: each step of theirs it overlaps is
    /// longer by its sequence and context.
    pub imposed_ms: f64,
    /// What a ms of `decode_ms` and `imposed_ms` is worth in time to first token: `v`, the
    /// model's mean TTFT over its mean end to end (`RequestSummary::e2e_weight`), the rate the
    /// stall's end-to-end part is priced at (0 before a stream was timed).
    pub decode_weight: f64,
    /// Its predicted time per output token there, what a `tpot_ms` objective is held to
    /// ([`TimePriors::tpot_of`]) with its own sequence and context added (Δ): the worker's
    /// measured step, whose gaps already hold the stalls of the prefill chunks it runs; before
    /// any is measured, the prior step over the share of time prefill leaves to decoding. That
    /// share is the fleet's, not the worker's recent one: where prompts arrive while it decodes
    /// is routing's own later choice (the `slowdown` term steers them off short answers).
    pub tpot_ms: f64,
}

impl Prediction {
    /// Predicted time to first token, ms.
    pub fn ttft_ms(&self) -> f64 {
        self.join_ms + self.wait_ms + self.prefill_ms + self.steps_ms
    }

    /// The cost: its time to first token and its decode, plus the time it takes from other
    /// requests (those running there, those queuing behind it, those a duplicated prefix
    /// evicts), ms.
    pub fn cost_ms(&self) -> f64 {
        self.ttft_ms() + self.slowdown_ms + self.behind_ms + self.ahead_ms + self.duplicate_ms + self.decode_weight * (self.decode_ms + self.imposed_ms)
    }
}

/// Which of the `time` cost's optional terms are priced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pricing {
    /// A prefix being computed on the worker for a request in flight counts as cached.
    pub credit_booked: bool,
    /// The stall its prefill causes the decodes running there (`slowdown`).
    pub slowdown: bool,
    /// The delay its prefill causes the requests that will queue behind it (`behind`).
    pub queue: bool,
    /// A second copy of a prefix another worker holds (`duplicate`).
    pub duplicates: bool,
    /// Its decode there and the step time it adds to the decodes running there (`decode`,
    /// `imposed`).
    pub decode: bool,
    /// The stall weighs more on a worker prefill keeps busier than the fleet's mean (`share`):
    /// its decodes are stalled more often already, and without it long prompts pile onto the
    /// workers where only long answers decode, whose stalled answers then make the end-to-end
    /// tail.
    pub stall_share: bool,
    /// The stall is priced in the stalled requests' end to end as well (`v · decoding`): a
    /// long answer's time per output token barely moves for one stall, but its stalls add up
    /// to the end-to-end tail.
    pub stall_e2e: bool,
    /// The delay to the first token queued ahead: the room left in that one's last step, which
    /// the request's first chunk fills (`ahead`).
    pub shared_step: bool,
}

impl Default for Pricing {
    fn default() -> Self {
        // `decode` is off until it wins the first token too. `slowdown`, priced in the stalled
        // requests' time per output token, wins TPOT and goodput at the same TTFT.
        Self { credit_booked: true, slowdown: true, queue: true, duplicates: true, decode: false, stall_share: true, stall_e2e: true, shared_step: false }
    }
}

impl TimePriors {
    /// The uncalibrated decode step time of a worker carrying `c`'s booked load, ms.
    pub fn step_ms(&self, c: &Candidate, block_size: u32) -> f64 {
        let ctx = c.active_blocks as f64 * f64::from(block_size.max(1));
        self.step_overhead_ms + self.step_ms_per_seq * f64::from(c.in_flight) + self.step_ms_per_ctx_token * ctx
    }

    /// `c`'s decode step time, ms: its calibrated figure once measured, else the prior for its
    /// booked load.
    pub fn step_of(&self, c: &Candidate, block_size: u32) -> f64 {
        if c.step_ms > 0.0 { c.step_ms } else { self.step_ms(c, block_size) }
    }

    /// `c`'s time per output token, ms, where prefill keeps workers busy a share `rho` of the
    /// time: its measured step once measured (the gaps between its tokens, which already hold
    /// the stalls its prefill chunks cause), else its prior step over the share of time prefill
    /// leaves to decoding (`1 − ρ`, ρ at most [`MAX_RHO`]). The one time-per-output-token
    /// predictor: routing's objectives read it with the fleet's `rho` ([`Prediction::tpot_ms`]),
    /// the rescheduler's view of a loaded worker with the worker's own.
    pub fn tpot_of(&self, c: &Candidate, block_size: u32, rho: f64) -> f64 {
        per_output_token(self.step_of(c, block_size), c, rho)
    }

    /// Prefill tokens one engine step takes on a worker where `decoding` requests decode: the
    /// chunk less a token for each of them, at least half of it (`b`, module doc).
    pub fn step_budget(&self, decoding: f64) -> f64 {
        let chunk = self.chunk_tokens.max(1.0);
        (chunk - decoding).max(chunk / 2.0)
    }

    /// `c`'s prefill time per uncached token, ms: its calibrated figure once measured, else the
    /// prior.
    pub fn ms_per_prefill_token(&self, c: &Candidate) -> f64 {
        if c.ms_per_prefill_token > 0.0 { c.ms_per_prefill_token } else { self.ms_per_prefill_token }
    }

    /// Predicted time to first token of `req` on `c`, and the terms `pricing` adds to it.
    #[inline]
    pub fn predict(&self, req: &RequestSummary<'_>, c: &Candidate, pricing: Pricing) -> Prediction {
        let bs = f64::from(req.block_size.max(1));
        let prompt = f64::from(req.prompt_tokens);
        let reused = if pricing.credit_booked { c.overlap_blocks.max(c.active_overlap_blocks) } else { c.overlap_blocks };
        let cached = (f64::from(reused) * bs).min(prompt);
        let new = prompt - cached;
        let a = self.ms_per_prefill_token(c);
        let queued = c.active_prefill_tokens as f64;
        let prefill_ms = a * new * (1.0 + (cached + new / 2.0) / self.attention_tokens);
        let step = self.step_of(c, req.block_size);
        let chunk = self.chunk_tokens.max(1.0);
        let steps = ((queued + new) / chunk).ceil().max(1.0);
        // A worker stepping now (requests running, a token within two steps) takes it when its
        // running step ends, together with the prefill booked since that step began (still
        // booked: a cancelled one is not); an idle one starts a step for it at once.
        let stepping = c.since_step_ms.filter(|&since| c.in_flight > 0 && since <= 2.0 * step);
        // The running step's length, within the window that counts as stepping.
        let running = c.running_step_ms.map_or(step, |l| l.min(2.0 * step));
        let join_ms = stepping.map_or(0.0, |since| (running - since).max(0.0));
        let next_step = if stepping.is_some() { c.next_step_tokens.min(c.active_prefill_tokens) as f64 } else { 0.0 };
        let wait_ms = c.prefill_backlog_ms.min(a * queued).max(a * next_step);
        let own_ms = prefill_ms + (new / chunk).ceil().max(1.0) * step;
        let share = if pricing.stall_share { (decoding_share(req.fleet_prefill_load) / decoding_share(c.prefill_load)).powi(2) } else { 1.0 };
        let stalled_e2e = if pricing.stall_e2e { decoding(c) * req.e2e_weight } else { 0.0 };
        let slowdown_ms = if pricing.slowdown { prefill_ms * (req.tpot_weight * c.decode_sensitivity + stalled_e2e) * share } else { 0.0 };
        // Prefill put on a busy fleet delays more than the requests waiting now (module doc).
        let busy = busy_period(req.fleet_prefill_load);
        let arriving = req.arrivals_per_worker_s * join_ms / 1000.0;
        let behind_ms = if pricing.queue { prefill_ms * (f64::from(c.prefilling) + arriving) * busy } else { 0.0 };
        // Its first chunk rides in the last step of the prompt queued last, unless that step is
        // the one running now.
        let ahead_ms = if pricing.queue && pricing.shared_step && wait_ms > join_ms { a * room_taken(c, new, self.step_budget(decoding(c))) } else { 0.0 };
        let duplicate_ms = if pricing.duplicates { a * evicting_tokens(req, c, prompt, bs) * busy } else { 0.0 };
        let delta = self.added_step_ms(req, c, prompt);
        let (decode_ms, imposed_ms) = if pricing.decode { decode_terms(req, c, step, delta) } else { (0.0, 0.0) };
        let tpot_ms = per_output_token(step, c, req.fleet_prefill_load) + delta;
        Prediction {
            new_tokens: new,
            wait_ms,
            prefill_ms,
            steps_ms: steps * step,
            join_ms,
            own_ms,
            slowdown_ms,
            stall_share: share,
            behind_ms,
            ahead_ms,
            duplicate_ms,
            ms_per_prefill_token: a,
            decode_ms,
            imposed_ms,
            decode_weight: req.e2e_weight,
            tpot_ms,
        }
    }

    /// `Δ` (module doc): what `req`'s sequence and context add to each step of `c`, scaled by
    /// `c`'s measured step over the prior's for its load (how much slower or faster than the
    /// prior its every step is).
    #[inline]
    fn added_step_ms(&self, req: &RequestSummary<'_>, c: &Candidate, prompt: f64) -> f64 {
        let prior = self.step_ms(c, req.block_size);
        let k = if c.step_ms > 0.0 && prior > 0.0 { c.step_ms / prior } else { 1.0 };
        k * (self.step_ms_per_seq + self.step_ms_per_ctx_token * (prompt + req.expected_output_tokens.max(0.0) / 2.0))
    }
}

/// `c`'s step of `step` ms ([`TimePriors::step_of`]) as a time per output token where prefill
/// keeps workers busy a share `rho` of the time ([`TimePriors::tpot_of`]): a measured step as it
/// is, the prior over [`decoding_share`]. `predict` passes the step it already has.
#[inline]
fn per_output_token(step: f64, c: &Candidate, rho: f64) -> f64 {
    if c.step_ms > 0.0 { step } else { step / decoding_share(rho) }
}

/// The share of a worker's time prefill at utilisation `rho` leaves to decoding: `1 − ρ`, ρ at
/// most [`MAX_RHO`].
#[inline]
fn decoding_share(rho: f64) -> f64 {
    1.0 - rho.clamp(0.0, MAX_RHO)
}

/// `decode` and `imposed` (module doc) of `req` on `c`, whose step is `step` ms now and which
/// adds `delta` ms to each.
#[inline]
fn decode_terms(req: &RequestSummary<'_>, c: &Candidate, step: f64, delta: f64) -> (f64, f64) {
    let out = req.expected_output_tokens;
    if out <= 0.0 {
        return (0.0, 0.0);
    }
    let remaining = if req.mean_output_tokens > 0.0 { req.mean_output_tokens / 2.0 } else { out };
    let shared = out.min(remaining);
    (shared * step + out * delta, f64::from(c.in_flight) * delta * shared)
}

/// The requests decoding on `c` (`decoding`, module doc): those in flight with their first
/// token out.
#[inline]
fn decoding(c: &Candidate) -> f64 {
    f64::from(c.in_flight.saturating_sub(c.prefilling))
}

/// How many of `new` prefill tokens fill the last step of the prompt queued last on `c`
/// (`ahead`, module doc): steps of `budget` tokens hold the queue's prompts back to back from
/// when it was last empty.
#[inline]
fn room_taken(c: &Candidate, new: f64, budget: f64) -> f64 {
    let queued = c.queued_since_idle as f64;
    if queued <= 0.0 {
        return 0.0;
    }
    ((queued / budget).ceil() * budget - queued).min(new)
}

/// The tokens of the copy of a prefix that `c` would make (`duplicate`, module doc) that cost a
/// recompute, `prompt` tokens long in blocks of `bs`.
#[inline]
fn evicting_tokens(req: &RequestSummary<'_>, c: &Candidate, prompt: f64, bs: f64) -> f64 {
    // What this worker's cache holds against the best one's (blocks in its cache only: a
    // prefix merely being computed here is no copy yet).
    let cached_tokens = |blocks: u32| (f64::from(blocks) * bs).min(prompt);
    let (best, here) = (cached_tokens(req.fleet_overlap_blocks), cached_tokens(c.overlap_blocks));
    let copy = (best - here).max(0.0);
    // The copy's part that requests in flight share now (a hot prefix), beyond the free room in
    // this worker's cache, evicts now; within it, as the cache fills (as likely as it is full
    // already). The rest is priced in full.
    let hot = (cached_tokens(req.fleet_overlap_blocks.min(req.fleet_active_overlap_blocks)) - here).max(0.0);
    // The room left once the prefill booked there and this request's own new tokens are stored:
    // the events report them only after they are computed.
    let own = prompt - best;
    let free = c.cache_room_blocks.map_or(0.0, |b| b as f64 * bs);
    let held_fraction = if c.total_blocks > 0 { 1.0 - (free / (c.total_blocks as f64 * bs)).min(1.0) } else { 1.0 };
    let room = (free - c.active_prefill_tokens as f64 - own).max(0.0);
    copy - hot + (hot - room).max(0.0) + hot.min(room) * held_fraction
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;

    /// The priced terms the tests below were written for: credit, slowdown, no queue, no
    /// duplicates, no decode.
    const ON: Pricing = Pricing {
        credit_booked: true,
        slowdown: true,
        queue: false,
        duplicates: false,
        decode: false,
        stall_share: false,
        stall_e2e: false,
        shared_step: false,
    };

    fn req(tokens: u32) -> RequestSummary<'static> {
        RequestSummary { prompt_tokens: tokens, prompt_blocks: tokens / 16, block_size: 16, ..Default::default() }
    }

    #[test]
    fn a_second_copy_of_a_prefix_another_worker_holds_costs_its_prefill() {
        let p = TimePriors::default();
        let pricing = Pricing::default();
        // 4096 tokens, 3072 of them cached on the best worker.
        let r = RequestSummary { fleet_overlap_blocks: 192, ..req(4096) };
        let holder = p.predict(&r, &Candidate { overlap_blocks: 192, ..Default::default() }, pricing);
        let cold = p.predict(&r, &Candidate::default(), pricing);
        assert_eq!(holder.duplicate_ms, 0.0);
        assert!((cold.duplicate_ms - 0.035 * 3072.0).abs() < 1e-9, "{cold:?}");
        // A worker holding part of it copies only the rest.
        let part = p.predict(&r, &Candidate { overlap_blocks: 64, ..Default::default() }, pricing);
        assert!((part.duplicate_ms - 0.035 * 2048.0).abs() < 1e-9, "{part:?}");
        // A cache of 768 blocks (12,288 tokens). A prefix nobody is using now costs its full
        // copy even there.
        let cache = |free| Candidate { total_blocks: 768, cache_room_blocks: Some(free), ..Default::default() };
        assert!((p.predict(&r, &cache(768), pricing).duplicate_ms - 0.035 * 3072.0).abs() < 1e-9);
        // A hot one (requests in flight share all of it). Empty, the cache takes the copy
        // without evicting anything.
        let hot = RequestSummary { fleet_active_overlap_blocks: 192, ..r.clone() };
        assert_eq!(p.predict(&hot, &cache(768), pricing).duplicate_ms, 0.0);
        // A third free (4,096 tokens), less the prompt's own 1,024 new tokens: the copy fits
        // and evicts as likely as the cache is full (2/3).
        let fits = p.predict(&hot, &cache(256), pricing);
        assert!((fits.duplicate_ms - 0.035 * 3072.0 * (2.0 / 3.0)).abs() < 1e-9, "{fits:?}");
        // 1,024 tokens of prefill booked there take their room first: a third of the copy
        // evicts now.
        let booked = p.predict(&hot, &Candidate { active_prefill_tokens: 1024, ..cache(256) }, pricing);
        assert!((booked.duplicate_ms - 0.035 * (1024.0 + 2048.0 * (2.0 / 3.0))).abs() < 1e-9, "{booked:?}");
        // Requests in flight share half of it: the other half is priced in full.
        let half = p.predict(&RequestSummary { fleet_active_overlap_blocks: 96, ..r.clone() }, &cache(768), pricing);
        assert!((half.duplicate_ms - 0.035 * 1536.0).abs() < 1e-9, "{half:?}");
        // A worker holding part of the hot prefix copies the rest; the prompt's clamp holds.
        let part = p.predict(&hot, &Candidate { overlap_blocks: 64, ..cache(768) }, pricing);
        assert_eq!(part.duplicate_ms, 0.0, "{part:?}");
        // Room unknown (approximate mode, or no capacity reported): taken as full.
        let unknown = p.predict(&hot, &Candidate { total_blocks: 768, ..Default::default() }, pricing);
        assert!((unknown.duplicate_ms - 0.035 * 3072.0).abs() < 1e-9, "{unknown:?}");
        // Nobody holds anything: nothing is a copy.
        assert_eq!(p.predict(&req(4096), &Candidate::default(), pricing).duplicate_ms, 0.0);
        assert_eq!(p.predict(&r, &Candidate::default(), Pricing { duplicates: false, ..pricing }).duplicate_ms, 0.0);
    }

    #[test]
    fn decode_terms_price_the_batch_it_joins_and_what_it_adds_to_it() {
        let p = TimePriors::default();
        let pricing = Pricing { decode: true, ..Pricing::default() };
        let c = Candidate { in_flight: 10, ..Default::default() };
        let r = RequestSummary { expected_output_tokens: 100.0, mean_output_tokens: 100.0, ..req(1000) };
        let got = p.predict(&r, &c, pricing);
        let step = 6.0 + 0.03 * 10.0;
        let delta = 0.03 + 4.0e-5 * (1000.0 + 50.0);
        assert!((got.decode_ms - (50.0 * step + 100.0 * delta)).abs() < 1e-9, "the batch there now for the 50 steps it has left: {got:?}");
        assert!((got.imposed_ms - 10.0 * delta * 50.0).abs() < 1e-9, "each running request loses delta for the 50 steps it has left");
        // Priced at what a ms of end to end is worth in TTFT, and not before one was measured.
        assert_eq!(got.decode_weight, 0.0);
        assert!((got.cost_ms() - got.ttft_ms() - got.behind_ms - got.duplicate_ms).abs() < 1e-9);
        let weighed = p.predict(&RequestSummary { e2e_weight: 0.05, ..r.clone() }, &c, pricing);
        assert_eq!((weighed.decode_ms, weighed.imposed_ms), (got.decode_ms, got.imposed_ms));
        let rest = weighed.ttft_ms() + weighed.behind_ms + weighed.duplicate_ms + weighed.slowdown_ms;
        assert!((weighed.cost_ms() - rest - 0.05 * (got.decode_ms + got.imposed_ms)).abs() < 1e-9, "{weighed:?}");
        // A worker measured twice as slow as the prior steps twice as long, this request's
        // share too.
        let slow = p.predict(&r, &Candidate { step_ms: 2.0 * step, ..c.clone() }, pricing);
        assert!((slow.decode_ms - 2.0 * (50.0 * step + 100.0 * delta)).abs() < 1e-9, "{slow:?}");
        // A request shorter than what the others have left overlaps them only for its own.
        let short = p.predict(&RequestSummary { expected_output_tokens: 20.0, ..r.clone() }, &c, pricing);
        assert!((short.imposed_ms - 10.0 * (0.03 + 4.0e-5 * 1010.0) * 20.0).abs() < 1e-9, "{short:?}");
        // Unknown output, or the terms off: nothing priced.
        assert_eq!((p.predict(&req(1000), &c, pricing).decode_ms, p.predict(&req(1000), &c, pricing).imposed_ms), (0.0, 0.0));
        let off = p.predict(&r, &c, Pricing { decode: false, ..pricing });
        assert_eq!((off.decode_ms, off.imposed_ms), (0.0, 0.0));
    }

    #[test]
    fn a_prefill_is_charged_to_the_requests_waiting_behind_it() {
        let p = TimePriors::default();
        let pricing = Pricing::default();
        let busy = p.predict(&req(4096), &Candidate { prefilling: 3, ..Default::default() }, pricing);
        assert!(busy.prefill_ms > 0.0 && (busy.behind_ms - 3.0 * busy.prefill_ms).abs() < 1e-9, "{busy:?}");
        // A fleet whose prefill keeps it half busy: as many again arrive before the queue
        // empties. Past MAX_RHO the factor stops growing.
        let cand = Candidate { prefilling: 3, ..Default::default() };
        let half = p.predict(&RequestSummary { fleet_prefill_load: 0.5, ..req(4096) }, &cand, pricing);
        assert!((half.behind_ms - 2.0 * busy.behind_ms).abs() < 1e-9, "{half:?}");
        let over = p.predict(&RequestSummary { fleet_prefill_load: 3.0, ..req(4096) }, &cand, pricing);
        assert!((over.behind_ms - 4.0 * busy.behind_ms).abs() < 1e-9, "{over:?}");
        // A copy's recompute lands on the same busy fleet.
        let copy = RequestSummary { fleet_overlap_blocks: 192, fleet_prefill_load: 0.5, ..req(4096) };
        let cold = p.predict(&copy, &Candidate::default(), pricing);
        assert!((cold.duplicate_ms - 2.0 * 0.035 * 3072.0).abs() < 1e-9, "{cold:?}");
        // Nobody waiting there: nobody to delay.
        assert_eq!(p.predict(&req(4096), &Candidate::default(), pricing).behind_ms, 0.0);
        let off = Pricing { queue: false, ..pricing };
        assert_eq!(p.predict(&req(4096), &Candidate { prefilling: 3, ..Default::default() }, off).behind_ms, 0.0);
    }

    #[test]
    fn those_arriving_before_the_running_step_ends_share_the_next_one() {
        let p = TimePriors::default();
        let pricing = Pricing::default();
        // Ten prefills a second per worker; this one's running step ends in 100 ms.
        let r = RequestSummary { arrivals_per_worker_s: 10.0, ..req(4096) };
        let c = Candidate { prefilling: 2, in_flight: 8, since_step_ms: Some(0.0), step_ms: 100.0, ..Default::default() };
        let x = p.predict(&r, &c, pricing);
        assert_eq!(x.join_ms, 100.0);
        assert!((x.behind_ms - x.prefill_ms * 3.0).abs() < 1e-9, "{x:?}");
        // About to step: nobody else arrives before it.
        let due = p.predict(&r, &Candidate { since_step_ms: Some(100.0), ..c }, pricing);
        assert!((due.behind_ms - due.prefill_ms * 2.0).abs() < 1e-9, "{due:?}");
    }

    #[test]
    fn a_prompt_delays_the_first_token_ahead_by_the_room_it_fills_in_that_ones_last_step() {
        let p = TimePriors { chunk_tokens: 8192.0, ..TimePriors::default() };
        let pricing = Pricing { shared_step: true, ..Pricing::default() };
        // A 16k prompt queued on an otherwise idle worker: its last step holds 0 of 8,192.
        let queued =
            |q: u64| Candidate { prefilling: 1, in_flight: 1, active_prefill_tokens: q, queued_since_idle: q, prefill_backlog_ms: 500.0, ..Default::default() };
        let full = p.predict(&req(16384), &queued(16384), pricing);
        assert_eq!(full.ahead_ms, 0.0);
        // One of 10,000 tokens leaves 6,384 tokens of room: a long prompt fills it, a short
        // one only its own length.
        let long = p.predict(&req(16384), &queued(10_000), pricing);
        assert!((long.ahead_ms - 6384.0 * long.ms_per_prefill_token).abs() < 1e-9, "{long:?}");
        let unpriced = p.predict(&req(16384), &queued(10_000), Pricing::default());
        assert!((long.cost_ms() - unpriced.cost_ms() - long.ahead_ms).abs() < 1e-9, "{long:?}");
        let short = p.predict(&req(1024), &queued(10_000), pricing);
        assert!((short.ahead_ms - 1024.0 * short.ms_per_prefill_token).abs() < 1e-9, "{short:?}");
        // Decoding requests take a token each of every step's budget.
        let decoding = p.predict(&req(16384), &Candidate { in_flight: 101, ..queued(10_000) }, pricing);
        assert!((decoding.ahead_ms - (2.0 * 8092.0 - 10_000.0) * decoding.ms_per_prefill_token).abs() < 1e-9, "{decoding:?}");
        // Nothing queued, or the last step ahead already running: nobody to delay.
        assert_eq!(p.predict(&req(16384), &Candidate::default(), pricing).ahead_ms, 0.0);
        let running = Candidate { since_step_ms: Some(0.0), running_step_ms: Some(400.0), step_ms: 400.0, prefill_backlog_ms: 300.0, ..queued(10_000) };
        assert_eq!(p.predict(&req(16384), &running, pricing).ahead_ms, 0.0);
        assert_eq!(unpriced.ahead_ms, 0.0);
        // A delay to others is priced with the queue, or not at all.
        assert_eq!(p.predict(&req(16384), &queued(10_000), Pricing { queue: false, ..pricing }).ahead_ms, 0.0);
    }

    #[test]
    fn an_idle_worker_predicts_the_prefill_of_what_it_lacks() {
        let p = TimePriors::default();
        let cold = p.predict(&req(4096), &Candidate::default(), ON);
        // 4k tokens ≈ 160 ms on the priors' H100 (docs/routing.md), plus one 6 ms step.
        assert!((140.0..200.0).contains(&cold.ttft_ms()), "{cold:?}");
        let warm = p.predict(&req(4096), &Candidate { overlap_blocks: 192, ..Default::default() }, ON);
        assert_eq!(warm.new_tokens, 1024.0);
        assert!(warm.ttft_ms() < cold.ttft_ms() / 3.0, "{warm:?}");
    }

    #[test]
    fn attention_makes_long_contexts_cost_more_than_linear() {
        let p = TimePriors::default();
        let t = |n: u32| p.predict(&req(n), &Candidate::default(), ON).prefill_ms;
        assert!(t(16_384) > 4.0 * t(4096) * 1.1);
    }

    #[test]
    fn a_prefix_being_computed_counts_only_with_credit() {
        let p = TimePriors::default();
        let c = Candidate { active_overlap_blocks: 100, ..Default::default() };
        assert_eq!(p.predict(&req(1600), &c, ON).new_tokens, 0.0);
        assert_eq!(p.predict(&req(1600), &c, Pricing { credit_booked: false, ..ON }).new_tokens, 1600.0);
    }

    #[test]
    fn the_wait_is_the_smaller_of_the_decayed_backlog_and_the_booked_tokens() {
        let p = TimePriors::default();
        let booked = Candidate { active_prefill_tokens: 10_000, prefill_backlog_ms: 50.0, ..Default::default() };
        assert_eq!(p.predict(&req(16), &booked, ON).wait_ms, 50.0);
        let fresh = Candidate { active_prefill_tokens: 1000, prefill_backlog_ms: 5000.0, ..Default::default() };
        assert!((p.predict(&req(16), &fresh, ON).wait_ms - 35.0).abs() < 1e-9);
    }

    #[test]
    fn a_busy_worker_is_joined_when_its_running_step_ends() {
        let p = TimePriors::default();
        let c = |since: Option<f64>, in_flight: u32| Candidate { since_step_ms: since, in_flight, step_ms: 100.0, ..Default::default() };
        let just_stepped = p.predict(&req(256), &c(Some(10.0), 40), ON);
        let about_to_step = p.predict(&req(256), &c(Some(95.0), 40), ON);
        assert_eq!(just_stepped.join_ms, 90.0);
        assert_eq!(about_to_step.join_ms, 5.0);
        assert!(about_to_step.ttft_ms() < just_stepped.ttft_ms());
        assert_eq!(p.predict(&req(256), &c(Some(150.0), 40), ON).join_ms, 0.0, "overdue: due now");
        assert_eq!(p.predict(&req(256), &c(Some(10.0), 0), ON).join_ms, 0.0, "idle: a step starts for it");
        assert_eq!(p.predict(&req(256), &c(None, 40), ON).join_ms, 0.0, "no token seen yet");
        // A running step carrying prefill is longer than the mean step; at most two steps count.
        let long = Candidate { running_step_ms: Some(150.0), ..c(Some(10.0), 40) };
        assert_eq!(p.predict(&req(256), &long, ON).join_ms, 140.0);
        let absurd = Candidate { running_step_ms: Some(5_000.0), ..c(Some(10.0), 40) };
        assert_eq!(p.predict(&req(256), &absurd, ON).join_ms, 190.0);
    }

    #[test]
    fn prefills_booked_since_the_last_step_share_the_next_one() {
        let p = TimePriors::default();
        // Their predicted backlog has decayed (predicted as if they started at once), yet they
        // have not: they run with this request in the next step.
        let c = Candidate {
            active_prefill_tokens: 1000,
            next_step_tokens: 1000,
            prefill_backlog_ms: 0.0,
            in_flight: 3,
            since_step_ms: Some(2.0),
            step_ms: 100.0,
            ..Default::default()
        };
        assert!((p.predict(&req(16), &c, ON).wait_ms - 35.0).abs() < 1e-9);
        let none = Candidate { next_step_tokens: 0, ..c };
        assert_eq!(p.predict(&req(16), &none, ON).wait_ms, 0.0);
        // Released since (a client gone before its first token): no longer waited for.
        let released = Candidate { active_prefill_tokens: 0, ..c };
        assert_eq!(p.predict(&req(16), &released, ON).wait_ms, 0.0);
        // A worker not stepping (no token for many steps: idle, or answering unary requests).
        let quiet = Candidate { since_step_ms: Some(1000.0), ..c };
        assert_eq!(p.predict(&req(16), &quiet, ON).wait_ms, 0.0);
    }

    #[test]
    fn measured_figures_replace_the_priors() {
        let p = TimePriors::default();
        let c = Candidate { ms_per_prefill_token: 0.1, step_ms: 30.0, ..Default::default() };
        let x = p.predict(&req(1000), &c, ON);
        assert!((x.prefill_ms - 0.1 * 1000.0 * (1.0 + 500.0 / 27_000.0)).abs() < 1e-9);
        assert_eq!(x.steps_ms, 30.0);
    }

    #[test]
    fn a_busy_decode_batch_slows_the_steps() {
        let p = TimePriors::default();
        let idle = p.predict(&req(20_000), &Candidate::default(), ON);
        // 64 decoding, each expected to generate 128 tokens.
        let running = Candidate { in_flight: 64, active_blocks: 64 * 128, decode_sensitivity: 64.0 / 128.0, ..Default::default() };
        // A ms of TPOT worth 16 of TTFT.
        let r = RequestSummary { tpot_weight: 16.0, ..req(20_000) };
        let busy = p.predict(&r, &running, ON);
        assert_eq!(idle.prefill_ms, busy.prefill_ms);
        assert!(busy.steps_ms > idle.steps_ms * 1.5, "{idle:?} {busy:?}");
        // Its prefill stalls the 64 running decodes: each one's TPOT grows by its prefill time
        // / 128, worth 16 / 128 of it in TTFT.
        assert!((busy.slowdown_ms - 8.0 * busy.prefill_ms).abs() < 1e-6, "{busy:?}");
        assert_eq!(idle.slowdown_ms, 0.0);
        // One short answer decoding there (8 tokens) weighs 16 long ones.
        let short = p.predict(&r, &Candidate { in_flight: 1, decode_sensitivity: 1.0 / 8.0, ..Default::default() }, ON);
        assert!((short.slowdown_ms - 2.0 * short.prefill_ms).abs() < 1e-6, "{short:?}");
        // Nothing measured yet: no exchange rate, no price.
        assert_eq!(p.predict(&req(20_000), &running, ON).slowdown_ms, 0.0);
    }

    #[test]
    fn a_stall_weighs_more_where_prefill_keeps_the_worker_busier_than_the_fleet() {
        let p = TimePriors::default();
        let share = Pricing { stall_share: true, ..ON };
        let r = RequestSummary { tpot_weight: 16.0, fleet_prefill_load: 0.5, ..req(8_000) };
        let decoding = |load| Candidate { in_flight: 4, decode_sensitivity: 4.0 / 100.0, prefill_load: load, ..Default::default() };
        let plain = p.predict(&r, &decoding(0.5), ON).slowdown_ms;
        assert!((p.predict(&r, &decoding(0.5), share).slowdown_ms - plain).abs() < 1e-9, "at the fleet's mean: unchanged");
        // Busy three quarters of the time against the fleet's half: each stall weighs (0.5 / 0.25)².
        assert!((p.predict(&r, &decoding(0.75), share).slowdown_ms - 4.0 * plain).abs() < 1e-6);
        assert!(p.predict(&r, &decoding(0.0), share).slowdown_ms < plain, "an idle worker's decodes are rarely stalled");
    }

    #[test]
    fn the_stall_counts_every_decoding_requests_end_to_end_at_its_weight() {
        let p = TimePriors::default();
        let e2e = Pricing { stall_e2e: true, ..ON };
        let r = RequestSummary { tpot_weight: 16.0, e2e_weight: 0.1, ..req(8_000) };
        // Ten in flight, two of them still prefilling: eight decode and are stalled.
        let c = Candidate { in_flight: 10, prefilling: 2, decode_sensitivity: 8.0 / 400.0, ..Default::default() };
        let x = p.predict(&r, &c, e2e);
        assert!((x.slowdown_ms - x.prefill_ms * (16.0 * 8.0 / 400.0 + 0.8)).abs() < 1e-6, "{x:?}");
    }
}
