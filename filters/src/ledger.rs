//! The booking ledger: the load each worker carries from requests in flight, as the gateway
//! booked it. One ledger per model serves every routing mode, shedding and the router queue.
//!
//! Per worker it counts requests in flight, prefill tokens (released when the request's first
//! token arrives), the predicted moment the worker will have computed the prefill booked on it
//! (so booked prefill decays with predicted progress instead of staying whole until a first
//! token; see [`Ledger::prefill_backlog`]), where it is in its engine step ([`step_phase`])
//! and active KV blocks. Prompt blocks are kept as the booked chains themselves
//! ([`booked_prefixes`]), so a prefix shared by several requests counts once
//! (`assume_kv_reuse`) and "how much of this request is already active here" is one
//! [`Ledger::overlap`]. Modes that do not tokenize book an estimate instead (`private_blocks`,
//! never shared).
//!
//! With output tracking on, a streamed request also books the blocks its output fills: one each
//! time `prompt_tokens + generated_tokens` crosses a block boundary. Output blocks belong to
//! one request only, so with the client's expected output length (`nvext.agent_hints.osl`)
//! each weighs `max(0, 1 − generated / osl)`: a request near its end is about to free them.
//! Prompt blocks always count in full, because another request may share them (Dynamo decays
//! those too when they look private at the moment, which undercounts a prefix shared later).
//!
//! The per-worker counters are a [`WorkerCounters`] each, owned by the worker rather than by
//! the ledger: a model rebuilt on reload gets a new ledger over the same counters, so requests
//! still running on the old one stay counted, and a server that serves several models carries
//! the load of all of them. The booked chains are per ledger (per model).
//!
//! Every booking is a [`Booking`] guard: completion, error, cancellation or a panic drop it,
//! and dropping releases exactly what it booked, so totals return to zero when load stops. A
//! booking can move to another worker ([`Booking::move_to`]), as a request that is retried or
//! migrated does; the totals stay exact. As a safety net, [`Ledger::expire`] releases the load
//! of bookings older than a limit (a request that never ends, or a guard leaked by a bug); the
//! request itself stays counted until its guard drops, whose release of the rest does nothing.

pub mod booked_prefixes;
pub mod decayed_mean;
pub mod load_rate;
pub mod peers;
pub mod prefill_gate;
pub mod step_phase;

use crate::route::Candidate;
use kvgate_kv::hash::BlockHash;
use kvgate_kv::index::{Matches, WorkerId};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the gateway books per request (the `routing` switches of a model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tracking {
    /// Requests sharing a prefix on one worker share its blocks: count them once.
    pub assume_kv_reuse: bool,
    /// Book prompt blocks as decode load at all (off for prefill-only workers).
    pub active_blocks: bool,
    /// Book the blocks a streamed request's output fills as it is generated.
    pub output_blocks: bool,
    /// Tokens per KV block.
    pub block_size: u32,
}

impl Default for Tracking {
    fn default() -> Self {
        Self { assume_kv_reuse: true, active_blocks: true, output_blocks: false, block_size: 16 }
    }
}

/// What the gateway has booked on one worker, across every ledger (model) that books on it.
#[derive(Debug, Default)]
pub struct WorkerCounters {
    requests: AtomicU32,
    /// Requests booked with prefill outstanding (no first token yet).
    prefilling: AtomicU32,
    prefill: AtomicU64,
    /// Prefill tokens booked on it since its prefill queue was last empty: vLLM packs them into
    /// steps of a whole chunk each, so their sum says how much room the last of them leaves in
    /// its last step for the next prompt (the candidate's `queued_since_idle`).
    queued_since_idle: AtomicU64,
    /// Chain blocks booked without dedup (used when `assume_kv_reuse` is off).
    raw_blocks: AtomicU64,
    /// Estimated blocks of requests booked without a chain.
    private_blocks: AtomicU64,
    /// Output blocks the open bookings hold on average over their lives
    /// ([`Footprint::output_estimate`]).
    reserved_blocks: AtomicU64,
    /// Weighted output blocks, in thousandths of a block. Signed: a release may subtract a
    /// contribution before a concurrent update has added it.
    output_milli: AtomicI64,
    /// When the prefill booked on it is predicted done, µs on [`clock_us`]'s clock.
    prefill_done_at: AtomicU64,
    /// Predicted prefill time booked on it per second.
    prefill_load: load_rate::LoadRate,
    /// Where it is in its engine step.
    step_phase: step_phase::StepPhase,
    /// Σ 1 / expected output tokens over the requests decoding there (first token delivered,
    /// not ended), in millionths: how much their times per output token grow per ms a step of
    /// theirs stalls (the candidate's `decode_sensitivity`).
    sensitivity_micro: AtomicU64,
    /// What the other replicas of the deployment booked on it (zero without replicas).
    peers: peers::PeerLoad,
    /// Long prompts sent to it one at a time ([`prefill_gate`]).
    gate: Arc<prefill_gate::PrefillGate>,
}

impl WorkerCounters {
    /// What the other replicas of the deployment booked on this worker: the cluster sets it,
    /// the ledger adds it to its own bookings.
    pub fn peers(&self) -> &peers::PeerLoad {
        &self.peers
    }

    /// [`Ledger::prefill_backlog_at`] of this worker with `prefill` tokens booked (read by the
    /// caller, who may need them too): nothing left once no prefill is booked.
    fn prefill_backlog_at(&self, prefill: u64, now: u64) -> Duration {
        if prefill == 0 {
            return Duration::ZERO;
        }
        Duration::from_micros(self.prefill_done_at.load(Ordering::Relaxed).saturating_sub(now))
    }
}

/// The peers' predicted prefill backlog on `l` as of `now`: it queues after this replica's.
fn peer_backlog(l: &WorkerCounters, now: u64) -> Duration {
    Duration::from_secs_f64(l.peers.prefill_backlog_ms(now) / 1000.0)
}

/// Microseconds since the first call in this process: the ledger's clock for predicted
/// progress (monotonic, and fits an atomic).
pub fn clock_us() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// Per-worker load booked by the gateway for one model.
pub struct Ledger {
    booked: booked_prefixes::BookedPrefixes,
    /// The chains the replica's peers booked on this model's workers (credit only: their blocks
    /// reach this replica as the peers' load).
    peer_booked: booked_prefixes::BookedPrefixes,
    /// How many chains `peer_booked` holds: none, and placements skip it.
    peer_chains: AtomicU64,
    /// Where this replica's booked chains go to reach its peers (set once, with replicas).
    sink: std::sync::OnceLock<Arc<dyn peers::ChainSink>>,
    workers: Box<[Arc<WorkerCounters>]>,
    tracking: Tracking,
    next_id: AtomicU64,
    /// Bookings not yet released, by id, with when they were booked ([`clock_us`]), sharded
    /// by id so that requests on different threads rarely take the same lock.
    live: Box<[LiveShard]>,
    expired: AtomicU64,
    /// Prefills booked with a predicted time on any of its workers, as a decayed rate (one
    /// second per booking).
    arrivals: load_rate::LoadRate,
    /// Output tokens of the model's finished streams, a decayed mean: what a request without
    /// a hint is expected to generate (the `time` cost's decode terms).
    output: decayed_mean::DecayedMean,
    /// Time to first token of the model's finished streams, ms, a decayed mean.
    ttft: decayed_mean::DecayedMean,
    /// Time per output token of the model's finished streams (their mean gap between tokens),
    /// ms, a decayed mean.
    tpot: decayed_mean::DecayedMean,
}

/// Shards of a ledger's live bookings.
const LIVE_SHARDS: usize = 16;

/// One shard of a ledger's live bookings: id to when it was booked and what releases it.
type LiveShard = Mutex<HashMap<u64, (u64, Arc<Release>), kvgate_kv::hash::BuildIdHasher>>;

/// What a booking holds, released once (by the guard or by expiry).
struct Release {
    worker: WorkerId,
    /// The key its chain is shared with the replica's peers under (0: no chain).
    chain_key: u64,
    prefill: u64,
    /// Its prompt's chain as booked (none unless reuse is assumed and the chain is not empty).
    chain: Option<Arc<[BlockHash]>>,
    /// Blocks counted in `raw_blocks`.
    raw_blocks: u64,
    private_blocks: u64,
    /// Blocks counted in `reserved_blocks`.
    reserved_blocks: u64,
    prompt_tokens: u64,
    expected_output: Option<u64>,
    /// Output tokens it is expected to generate, hinted or estimated (0: unknown).
    output_estimate: u64,
    /// 1 / its expected output tokens, in millionths (0: not known): what it adds to the
    /// worker's `sensitivity_micro` while it decodes.
    sensitivity_micro: u64,
    output: Mutex<Output>,
    prefill_released: AtomicBool,
    /// When its prefill was predicted done ([`clock_us`]), and the predicted time it takes, µs.
    prefill_due: (u64, u64),
    released: AtomicBool,
    /// The request count is released by the guard only (never by expiry).
    counted: AtomicBool,
}

impl Release {
    /// Counts it as decoding on its worker `l` (`true`: its first token arrived) or no longer
    /// (`false`: it ended), once each. Under its output lock, so that a release racing the
    /// first token (expiry) can neither miss the count nor take it twice.
    fn count_decoding(&self, l: &WorkerCounters, decoding: bool) {
        if self.sensitivity_micro == 0 {
            return;
        }
        let mut o = self.output.lock();
        if decoding && !o.closed && !o.decoding {
            o.decoding = true;
            l.sensitivity_micro.fetch_add(self.sensitivity_micro, Ordering::Relaxed);
        } else if !decoding && o.decoding {
            o.decoding = false;
            l.sensitivity_micro.fetch_sub(self.sensitivity_micro, Ordering::Relaxed);
        }
    }
}

/// A booking's output so far; behind a mutex shared only by its stream and a release.
#[derive(Default)]
struct Output {
    generated: u64,
    /// What it adds to the worker's `output_milli` now.
    milli: i64,
    /// Decoding: its first token arrived and it has not ended (it counts in the worker's
    /// `sensitivity_micro`).
    decoding: bool,
    closed: bool,
}

/// What one request puts on a worker.
#[derive(Debug, Clone, Default)]
pub struct Footprint {
    /// Prompt tokens the worker must compute (not cached there).
    pub prefill_tokens: u64,
    /// The prompt's chained block hashes (empty when the prompt was not tokenized).
    pub chain: Vec<BlockHash>,
    /// Blocks booked without a chain: an estimate, never shared with another request.
    pub private_blocks: u64,
    /// Prompt length in tokens (where output blocks start).
    pub prompt_tokens: u64,
    /// Expected output tokens (`nvext.agent_hints.osl`), if the client said: output blocks
    /// tracked as generated are weighted by what is left of it.
    pub expected_output: Option<u64>,
    /// Output tokens the request is expected to generate, hinted or estimated (0: unknown).
    /// The blocks half of them fill, what the request holds on average over its life, are
    /// reserved on the worker until it ends ([`Ledger::expected_blocks`]).
    pub output_estimate: u64,
    /// Predicted time the worker takes to compute this prefill once it starts (0: not
    /// predicted; the routing mode's cost says, see `route::time`).
    pub prefill_time: Duration,
}

impl Ledger {
    /// A ledger over fresh counters for `workers` workers.
    pub fn new(workers: usize, tracking: Tracking) -> Arc<Self> {
        Self::over((0..workers.max(1)).map(|_| Arc::default()).collect(), tracking)
    }

    /// A ledger over the workers' own counters, indexed in this order.
    pub fn over(workers: Vec<Arc<WorkerCounters>>, tracking: Tracking) -> Arc<Self> {
        let workers: Box<[Arc<WorkerCounters>]> = if workers.is_empty() { vec![Arc::default()].into() } else { workers.into() };
        Arc::new(Self {
            booked: booked_prefixes::BookedPrefixes::new(workers.len()),
            peer_booked: booked_prefixes::BookedPrefixes::new(workers.len()),
            peer_chains: AtomicU64::new(0),
            sink: std::sync::OnceLock::new(),
            workers,
            tracking,
            next_id: AtomicU64::new(1),
            live: (0..LIVE_SHARDS).map(|_| Mutex::default()).collect(),
            expired: AtomicU64::new(0),
            arrivals: load_rate::LoadRate::default(),
            output: decayed_mean::DecayedMean::at_least(0.0),
            ttft: decayed_mean::DecayedMean::at_least(0.0),
            tpot: decayed_mean::DecayedMean::at_least(1e-3),
        })
    }

    /// Releases bookings older than `max_age`; returns how many.
    pub fn expire(&self, max_age: Duration) -> usize {
        let now = clock_us();
        let max_age = u64::try_from(max_age.as_micros()).unwrap_or(u64::MAX);
        let mut old: Vec<Arc<Release>> = Vec::new();
        for shard in &self.live {
            shard.lock().retain(|_, (t, r)| {
                let keep = now.saturating_sub(*t) <= max_age;
                if !keep {
                    old.push(r.clone());
                }
                keep
            });
        }
        for r in &old {
            self.release(r);
        }
        self.expired.fetch_add(old.len() as u64, Ordering::Relaxed);
        old.len()
    }

    /// Bookings released by expiry so far.
    pub fn expired_count(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    fn worker(&self, w: WorkerId) -> Option<&WorkerCounters> {
        self.workers.get(w as usize).map(|c| &**c)
    }

    /// Releases the request count of `r`, once (its guard does, never expiry).
    fn uncount(&self, r: &Release) {
        if r.counted.swap(false, Ordering::AcqRel)
            && let Some(l) = self.worker(r.worker)
        {
            l.requests.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Releases `r`'s prefill tokens, once. `computed`: its first token arrived, so the worker
    /// is exactly as far as that token says and the prediction for whatever was booked after
    /// it moves by the same error; otherwise (cancelled, failed) its predicted time is taken
    /// out of what is left.
    fn release_prefill(&self, r: &Release, computed: bool) {
        if r.prefill_released.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(l) = self.worker(r.worker) else { return };
        if computed {
            r.count_decoding(l, true);
        }
        l.prefill.fetch_sub(r.prefill, Ordering::Relaxed);
        let now = clock_us();
        if r.prefill > 0 && l.prefilling.fetch_sub(1, Ordering::Relaxed) == 1 {
            // Nothing left to prefill: no prediction error may carry over to the next booking.
            l.prefill_done_at.store(now, Ordering::Relaxed);
            return;
        }
        if !computed {
            // Never computed (or computed elsewhere): its tokens no longer fill the queue's steps.
            let _ = l.queued_since_idle.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| Some(q.saturating_sub(r.prefill)));
        }
        let (due, time) = r.prefill_due;
        if time == 0 {
            return;
        }
        let _ = l.prefill_done_at.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |at| {
            let at = if computed { (at + now).saturating_sub(due) } else { at.saturating_sub(time.min(due.saturating_sub(now))) };
            Some(at.max(now))
        });
    }

    fn release(&self, r: &Release) {
        if r.released.swap(true, Ordering::AcqRel) {
            return;
        }
        self.release_prefill(r, false);
        {
            let mut o = r.output.lock();
            o.closed = true;
            self.add_output(r.worker, -std::mem::take(&mut o.milli));
        }
        if let Some(l) = self.worker(r.worker) {
            r.count_decoding(l, false);
            l.raw_blocks.fetch_sub(r.raw_blocks, Ordering::Relaxed);
            l.private_blocks.fetch_sub(r.private_blocks, Ordering::Relaxed);
            l.reserved_blocks.fetch_sub(r.reserved_blocks, Ordering::Relaxed);
        }
        if let Some(chain) = &r.chain {
            self.booked.remove(r.worker, chain);
            if let Some(sink) = self.sink.get() {
                sink.released(r.chain_key, r.worker);
            }
        }
    }

    fn add_output(&self, w: WorkerId, milli: i64) {
        if let Some(l) = self.worker(w) {
            l.output_milli.fetch_add(milli, Ordering::Relaxed);
        }
    }

    /// Blocks that `output` tokens fill after a prompt of `prompt_tokens`: the prompt's partial
    /// last block (its chain holds full blocks only) and every block the output starts.
    fn output_blocks(&self, prompt_tokens: u64, output: u64) -> u64 {
        if output == 0 {
            return 0;
        }
        let bs = u64::from(self.tracking.block_size.max(1));
        (prompt_tokens + output).div_ceil(bs) - prompt_tokens / bs
    }

    /// `generated` more output tokens of the booking `r`: rebook its output blocks.
    fn output_grew(&self, r: &Release, generated: u64) {
        let bs = u64::from(self.tracking.block_size.max(1));
        let mut o = r.output.lock();
        if o.closed {
            return;
        }
        o.generated += generated;
        let blocks = (r.prompt_tokens + o.generated) / bs - r.prompt_tokens / bs;
        let weight = match r.expected_output {
            Some(osl) if osl > 0 => (1.0 - o.generated as f64 / osl as f64).max(0.0),
            _ => 1.0,
        };
        let milli = (blocks as f64 * weight * 1000.0).round() as i64;
        self.add_output(r.worker, milli - o.milli);
        o.milli = milli;
    }

    /// What this tracks.
    pub fn tracking(&self) -> Tracking {
        self.tracking
    }

    /// Requests booked on `w`, by this replica and its peers.
    pub fn requests(&self, w: WorkerId) -> u32 {
        self.worker(w).map_or(0, |l| l.requests.load(Ordering::Relaxed) + l.peers.requests())
    }

    /// Prefill tokens booked on `w` since its running engine step began: they share its next
    /// step ([`step_phase`]).
    pub fn next_step_tokens(&self, w: WorkerId) -> u64 {
        self.worker(w).map_or(0, |l| l.step_phase.next_step_tokens())
    }

    /// Time since `w` last delivered a token at `now` on [`clock_us`]'s clock, ms; `None`
    /// before its first.
    pub fn since_step_ms_at(&self, w: WorkerId, now: u64) -> Option<f64> {
        self.worker(w)?.step_phase.since_step_ms(now)
    }

    /// What the gateway has timed of `w`'s engine steps ([`step_phase::StepLengths`]); `None`
    /// before two step boundaries.
    pub fn step_lengths(&self, w: WorkerId) -> Option<step_phase::StepLengths> {
        self.worker(w)?.step_phase.lengths()
    }

    /// `w` delivered a token: an engine step of it ended now.
    pub fn step_ended(&self, w: WorkerId) {
        if let Some(l) = self.worker(w)
            && l.step_phase.step_ended(clock_us())
        {
            l.gate.step_began();
        }
    }

    /// Requests booked on `w` whose prefill is outstanding (no first token yet).
    pub fn prefilling(&self, w: WorkerId) -> u32 {
        self.worker(w).map_or(0, |l| l.prefilling.load(Ordering::Relaxed) + l.peers.prefilling())
    }

    /// Long prompts held at `w`'s prefill gate ([`prefill_gate`]).
    pub fn gate_waiting(&self, w: WorkerId) -> usize {
        self.worker(w).map_or(0, |l| l.gate.waiting())
    }

    /// Prefill tokens booked on `w` and not started decoding.
    pub fn prefill_tokens(&self, w: WorkerId) -> u64 {
        self.worker(w).map_or(0, |l| l.prefill.load(Ordering::Relaxed) + l.peers.prefill_tokens())
    }

    /// Predicted time until `w` has computed the prefill booked on it: each booking adds its
    /// predicted prefill time after whatever was predicted ahead of it, and the clock runs it
    /// down; zero once no booked prefill is left (every booking saw its first token).
    pub fn prefill_backlog(&self, w: WorkerId) -> Duration {
        self.prefill_backlog_at(w, clock_us())
    }

    /// [`Ledger::prefill_backlog`] as of `now` on [`clock_us`]'s clock (one clock read serves
    /// every worker of a decision).
    pub fn prefill_backlog_at(&self, w: WorkerId, now: u64) -> Duration {
        self.worker(w).map_or(Duration::ZERO, |l| l.prefill_backlog_at(l.prefill.load(Ordering::Relaxed), now) + peer_backlog(l, now))
    }

    /// How busy the prefill booked on `w` keeps it, as of `now` on [`clock_us`]'s clock: its
    /// predicted prefill time booked per second over the last few seconds (0.5: half the time).
    pub fn prefill_load_at(&self, w: WorkerId, now: u64) -> f64 {
        self.worker(w).map_or(0.0, |l| l.prefill_load.at(now) + l.peers.prefill_load())
    }

    /// A stream of the model finished: `tokens` output tokens, and its time to first token and
    /// per output token, ms, where measured (several tokens streamed from one worker).
    pub fn stream_finished(&self, tokens: u64, times: Option<(f64, f64)>) {
        // About the last fifty streams.
        self.output.observe(tokens as f64, 0.02);
        if let Some((ttft, tpot)) = times.filter(|&(a, b)| a.is_finite() && b.is_finite() && a >= 0.0 && b > 0.0) {
            self.ttft.observe(ttft, 0.02);
            self.tpot.observe(tpot, 0.02);
        }
    }

    /// How many ms of time to first token one ms of time per output token is worth to the
    /// model's requests: their recent mean time to first token over their mean time per output
    /// token (`None` before a stream was timed). A TPOT excess then weighs as much as a TTFT
    /// excess of the same relative size, as latency objectives' violations do.
    pub fn tpot_weight(&self) -> Option<f64> {
        Some(self.ttft.get()? / self.tpot.get()?)
    }

    /// How many ms of time to first token one ms of end-to-end time is worth to the model's
    /// requests: their recent mean time to first token over their mean end to end (the first
    /// token, then each further token of the mean output at the mean time per output token;
    /// `None` before a stream was timed).
    pub fn e2e_weight(&self) -> Option<f64> {
        let ttft = self.ttft.get()?;
        let e2e = ttft + (self.output.get()? - 1.0).max(0.0) * self.tpot.get()?;
        (e2e > 0.0).then(|| ttft / e2e)
    }

    /// The output tokens of the model's streams, on average of the recent ones (`None` before
    /// the first finished).
    pub fn mean_output(&self) -> Option<f64> {
        self.output.get()
    }

    /// Prefills booked per second per worker of this ledger as of `now` (µs on [`clock_us`]),
    /// averaged over [`load_rate::WINDOW_S`].
    pub fn arrivals_per_worker_at(&self, now: u64) -> f64 {
        self.arrivals.at(now) / self.workers.len() as f64
    }

    /// Worker `w` as a routing candidate, as far as its bookings tell, as of `now` on
    /// [`clock_us`]'s clock (one clock read serves every worker of a decision): requests in
    /// flight, the prefill booked and its predicted backlog and load, where the worker is in its
    /// engine step, its active blocks and how sensitive its decoding requests are to a stall.
    /// Its cache, what it reports and its health are the caller's to add.
    pub fn candidate(&self, w: WorkerId, now: u64) -> Candidate {
        let Some(l) = self.worker(w) else { return Candidate { id: u32::from(w), ..Candidate::default() } };
        let prefill = l.prefill.load(Ordering::Relaxed);
        let p = &l.peers;
        Candidate {
            id: u32::from(w),
            in_flight: l.requests.load(Ordering::Relaxed) + p.requests(),
            active_prefill_tokens: prefill + p.prefill_tokens(),
            queued_since_idle: if prefill > 0 { l.queued_since_idle.load(Ordering::Relaxed) } else { 0 },
            prefilling: l.prefilling.load(Ordering::Relaxed) + p.prefilling(),
            next_step_tokens: l.step_phase.next_step_tokens(),
            since_step_ms: l.step_phase.since_step_ms(now),
            prefill_backlog_ms: (l.prefill_backlog_at(prefill, now) + peer_backlog(l, now)).as_secs_f64() * 1000.0,
            prefill_load: l.prefill_load.at(now) + p.prefill_load(),
            active_blocks: self.active_blocks(w),
            decode_sensitivity: l.sensitivity_micro.load(Ordering::Relaxed) as f64 / 1e6 + p.decode_sensitivity(),
            ..Candidate::default()
        }
    }

    /// What this replica itself booked on `w` as of `now` on [`clock_us`]'s clock, without its
    /// peers': what it publishes to them (docs/replicas.md).
    pub fn own(&self, w: WorkerId, now: u64) -> peers::OwnLoad {
        let Some(l) = self.worker(w) else { return peers::OwnLoad::default() };
        let prefill = l.prefill.load(Ordering::Relaxed);
        let (prompt, tracked) = self.prompt_and_output_blocks(w, l);
        peers::OwnLoad {
            requests: l.requests.load(Ordering::Relaxed),
            prefilling: l.prefilling.load(Ordering::Relaxed),
            prefill_tokens: prefill,
            active_blocks: prompt + tracked,
            expected_blocks: prompt + l.reserved_blocks.load(Ordering::Relaxed).max(tracked),
            decode_sensitivity: l.sensitivity_micro.load(Ordering::Relaxed) as f64 / 1e6,
            prefill_backlog_ms: l.prefill_backlog_at(prefill, now).as_secs_f64() * 1000.0,
            prefill_load: l.prefill_load.at(now),
        }
    }

    /// Blocks booked on `w`: distinct prompt blocks (or all of them when shared prefixes are
    /// not assumed to be reused), estimated blocks of untokenized requests, and weighted output
    /// blocks, rounded.
    pub fn active_blocks(&self, w: WorkerId) -> u64 {
        let Some(l) = self.worker(w) else { return 0 };
        let (prompt, output) = self.prompt_and_output_blocks(w, l);
        prompt + output + l.peers.active_blocks()
    }

    /// Blocks `w` is expected to hold while the requests booked there run: their prompt blocks
    /// and the output blocks each holds on average over its life (half its expected output; or
    /// the output blocks tracked so far, where more). What load shedding compares with the
    /// worker's capacity. The KV in use now understates a worker whose streams were just
    /// admitted, and admitting more there ends in a queue on the worker; each stream's whole
    /// final size overstates it, as streams on a worker are at different stages and one ending
    /// frees the blocks another grows into.
    pub fn expected_blocks(&self, w: WorkerId) -> u64 {
        let Some(l) = self.worker(w) else { return 0 };
        let (prompt, tracked) = self.prompt_and_output_blocks(w, l);
        prompt + l.reserved_blocks.load(Ordering::Relaxed).max(tracked) + l.peers.expected_blocks()
    }

    /// `w`'s booked prompt blocks (distinct ones, or all of them when shared prefixes are not
    /// assumed to be reused, plus estimated ones) and its tracked output blocks, rounded.
    fn prompt_and_output_blocks(&self, w: WorkerId, l: &WorkerCounters) -> (u64, u64) {
        let chained = if self.tracking.assume_kv_reuse { self.booked.distinct_blocks(w) } else { l.raw_blocks.load(Ordering::Relaxed) };
        let output = u64::try_from(l.output_milli.load(Ordering::Relaxed)).unwrap_or(0);
        (chained + l.private_blocks.load(Ordering::Relaxed), (output + 500) / 1000)
    }

    /// How many leading blocks of `chain` are already booked, per worker, by this replica or
    /// one of its peers.
    pub fn overlap(&self, chain: &[BlockHash]) -> Matches {
        if !self.tracking.assume_kv_reuse {
            return Matches::default();
        }
        if self.peer_chains.load(Ordering::Relaxed) == 0 {
            return self.booked.overlap(chain);
        }
        let mut best = vec![0u32; self.workers.len()];
        self.booked.overlap_into(chain, &mut best);
        self.peer_booked.overlap_into(chain, &mut best);
        Matches { scores: best.iter().enumerate().filter(|&(_, &b)| b > 0).map(|(w, &b)| (w as WorkerId, b)).collect() }
    }

    /// Sends every chain this ledger books from now on, and its release, to `sink` (the
    /// replica's peers); false when a sink was set already.
    pub fn share_chains(&self, sink: Arc<dyn peers::ChainSink>) -> bool {
        self.sink.set(sink).is_ok()
    }

    /// A peer booked `chain` on `w`: it counts for [`Ledger::overlap`] until
    /// [`Ledger::remove_peer_chain`].
    pub fn add_peer_chain(&self, w: WorkerId, chain: &Arc<[BlockHash]>) {
        if self.tracking.assume_kv_reuse && !chain.is_empty() && self.worker(w).is_some() {
            self.peer_booked.add(w, chain);
            self.peer_chains.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A peer released its booking of `chain` on `w`.
    pub fn remove_peer_chain(&self, w: WorkerId, chain: &[BlockHash]) {
        if self.peer_booked.remove(w, chain) {
            self.peer_chains.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Books `load` on `w`, until the returned guard drops.
    pub fn book(self: &Arc<Self>, w: WorkerId, load: Footprint) -> Booking {
        self.book_at(w, load, clock_us())
    }

    /// [`Ledger::book`] as of `now` on [`clock_us`]'s clock: a read taken just before (a
    /// routing decision's own), so that the worker's step and prefill timing stay in order.
    pub fn book_at(self: &Arc<Self>, w: WorkerId, load: Footprint, now: u64) -> Booking {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let release = self.reserve_live(id, w, load, now);
        Booking { ledger: self.clone(), id, release, pass: None }
    }

    fn live_shard(&self, id: u64) -> &LiveShard {
        &self.live[id as usize % LIVE_SHARDS]
    }

    /// [`Ledger::reserve`], with the booking `id` recorded as live (for expiry) as of `now`.
    fn reserve_live(&self, id: u64, w: WorkerId, load: Footprint, now: u64) -> Arc<Release> {
        let release = self.reserve(w, load, now);
        self.live_shard(id).lock().insert(id, (now, release.clone()));
        release
    }

    /// Adds `load` to `w`'s counters as of `now` and returns what releasing it takes.
    fn reserve(&self, w: WorkerId, load: Footprint, now: u64) -> Arc<Release> {
        let Footprint { prefill_tokens, chain, private_blocks, prompt_tokens, expected_output, output_estimate, prefill_time } = load;
        let chain = if self.tracking.active_blocks { chain } else { Vec::new() };
        let raw_blocks = chain.len() as u64;
        let reserved_blocks = if self.tracking.active_blocks { self.output_blocks(prompt_tokens, output_estimate.div_ceil(2)) } else { 0 };
        let time = if prefill_tokens > 0 { prefill_time.as_micros() as u64 } else { 0 };
        let mut due = 0;
        if let Some(l) = self.worker(w) {
            // Whether the prefill booked before is predicted done: the worker's queue has run dry
            // even if its last first token has not reached the gateway yet.
            let mut drained = true;
            if time > 0 {
                let before = l.prefill_done_at.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |at| Some(at.max(now) + time));
                l.prefill_load.add(time, now);
                self.arrivals.add(1_000_000, now);
                let before = before.unwrap_or(now);
                drained = before <= now;
                due = before.max(now) + time;
            }
            let running = l.requests.fetch_add(1, Ordering::Relaxed);
            // On an idle worker it starts a step at once instead of waiting for the next.
            if running == 0 {
                l.step_phase.starts(prefill_tokens, now);
            }
            if prefill_tokens > 0 {
                // The first prefill booked on an empty queue starts its steps afresh. Two bookings
                // racing onto an empty queue may lose one's tokens from the sum: an estimate of
                // where the queue's last step stands tolerates that, and it never blocks.
                if l.prefilling.fetch_add(1, Ordering::Relaxed) == 0 || drained {
                    l.queued_since_idle.store(prefill_tokens, Ordering::Relaxed);
                } else {
                    l.queued_since_idle.fetch_add(prefill_tokens, Ordering::Relaxed);
                }
                if running > 0 {
                    l.step_phase.booked(prefill_tokens, now);
                }
            }
            l.prefill.fetch_add(prefill_tokens, Ordering::Relaxed);
            l.raw_blocks.fetch_add(raw_blocks, Ordering::Relaxed);
            l.private_blocks.fetch_add(private_blocks, Ordering::Relaxed);
            l.reserved_blocks.fetch_add(reserved_blocks, Ordering::Relaxed);
        }
        // Without reuse assumed, no two requests share blocks: the count per request
        // (`raw_blocks`) is all there is to book.
        let chain: Option<Arc<[BlockHash]>> = (self.tracking.assume_kv_reuse && !chain.is_empty()).then(|| chain.into());
        // Unique in the process: the key a peer knows the chain by until it is released.
        static CHAIN_KEYS: AtomicU64 = AtomicU64::new(1);
        let chain_key = if chain.is_some() { CHAIN_KEYS.fetch_add(1, Ordering::Relaxed) } else { 0 };
        if let Some(chain) = &chain {
            self.booked.add(w, chain);
            if let Some(sink) = self.sink.get() {
                sink.booked(chain_key, w, chain);
            }
        }
        Arc::new(Release {
            worker: w,
            chain_key,
            prefill: prefill_tokens,
            chain,
            raw_blocks,
            private_blocks,
            reserved_blocks,
            prompt_tokens,
            expected_output,
            output_estimate,
            sensitivity_micro: 1_000_000u64.checked_div(output_estimate).unwrap_or(0),
            output: Mutex::new(Output::default()),
            prefill_released: AtomicBool::new(false),
            prefill_due: (due, time),
            released: AtomicBool::new(false),
            counted: AtomicBool::new(true),
        })
    }
}

/// One request's booking; released on drop.
pub struct Booking {
    ledger: Arc<Ledger>,
    id: u64,
    release: Arc<Release>,
    /// Its pass through the worker's prefill gate, held until its first token.
    pass: Option<prefill_gate::GatePass>,
}

impl Booking {
    /// The request's prefill is over: its prefill load is gone. `first_token`: a streamed
    /// first token says when (the worker's predicted backlog is re-anchored on it); an answer
    /// that arrives whole (unary, an error) says nothing about when its prefill ended, so its
    /// predicted time is only taken out of what is left.
    pub fn prefill_done(&mut self, first_token: bool) {
        self.ledger.release_prefill(&self.release, first_token);
        self.pass = None;
    }

    /// Enters its worker's prefill gate ([`prefill_gate`]); `None` for a worker the ledger
    /// does not know.
    ///
    /// `shelters`: the next long prompt waits for this one's last step; `steps`: the engine
    /// steps its prefill takes.
    pub fn enter_gate(&self, shelters: bool, steps: u64) -> Option<prefill_gate::Entry> {
        self.ledger.worker(self.release.worker).map(|l| l.gate.enter(shelters, steps))
    }

    /// Holds `pass` until its prefill is over (its first token, a move or its end).
    pub fn hold(&mut self, pass: prefill_gate::GatePass) {
        self.pass = Some(pass);
    }

    /// Output tokens it is expected to generate, hinted or estimated (0: unknown).
    pub fn output_estimate(&self) -> u64 {
        self.release.output_estimate
    }

    /// Prompt tokens booked for its worker to compute.
    pub fn prefill_tokens(&self) -> u64 {
        self.release.prefill
    }

    /// The predicted time its prefill takes once it starts (zero: not predicted).
    pub fn prefill_time(&self) -> Duration {
        Duration::from_micros(self.release.prefill_due.1)
    }

    /// Whether [`Booking::generated`] does anything (output blocks are tracked).
    pub fn tracks_output(&self) -> bool {
        self.ledger.tracking.output_blocks && self.ledger.tracking.active_blocks
    }

    /// The request generated `tokens` more output tokens (no-op unless output blocks are
    /// tracked).
    pub fn generated(&self, tokens: u64) {
        if self.tracks_output() && tokens > 0 {
            self.ledger.output_grew(&self.release, tokens);
        }
    }

    /// The worker it is booked on.
    pub fn worker(&self) -> WorkerId {
        self.release.worker
    }

    /// Moves the booking to worker `to` with a new footprint (a retry elsewhere, or a migrated
    /// request whose continuation the destination must prefill): what it held on its old worker
    /// is released and `load` is booked on `to`, under the same guard (booked afresh if expiry
    /// had released it).
    pub fn move_to(&mut self, to: WorkerId, load: Footprint) {
        self.pass = None;
        let next = self.ledger.reserve_live(self.id, to, load, clock_us());
        let old = std::mem::replace(&mut self.release, next);
        self.ledger.release(&old);
        self.ledger.uncount(&old);
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.ledger.live_shard(self.id).lock().remove(&self.id);
        self.ledger.release(&self.release);
        self.ledger.uncount(&self.release);
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;

    fn prompt(prefill_tokens: u64, chain: Vec<BlockHash>) -> Footprint {
        Footprint { prefill_tokens, prompt_tokens: prefill_tokens, chain, ..Footprint::default() }
    }

    fn with_output(block_size: u32) -> Arc<Ledger> {
        Ledger::new(1, Tracking { output_blocks: true, block_size, ..Tracking::default() })
    }

    #[test]
    fn a_gate_pass_goes_with_its_bookings_first_token_or_its_move() {
        let s = Ledger::new(2, Tracking::default());
        let long = || prompt(4096, Vec::new());
        let mut a = s.book(0, long());
        let Some(prefill_gate::Entry::Pass(p)) = a.enter_gate(true, 1) else { panic!("the first long prompt goes at once") };
        a.hold(p);
        let mut b = s.book(0, long());
        let Some(prefill_gate::Entry::Wait(mut rx)) = b.enter_gate(true, 1) else { panic!("the next waits") };
        assert_eq!((s.gate_waiting(0), s.gate_waiting(1)), (1, 0));
        a.prefill_done(true);
        b.hold(rx.try_recv().expect("the first token hands the pass over"));
        let c = s.book(0, long());
        let Some(prefill_gate::Entry::Wait(mut rx)) = c.enter_gate(true, 1) else { panic!("the next waits") };
        b.move_to(1, long());
        assert!(rx.try_recv().is_ok(), "a move elsewhere hands it over too");
        assert_eq!(s.gate_waiting(0), 0);
    }

    #[test]
    fn a_candidate_is_what_the_ledger_reports_one_by_one() {
        let s = Ledger::new(2, Tracking::default());
        let now = clock_us();
        assert_eq!(s.candidate(1, now), Candidate { id: 1, ..Candidate::default() });
        let _a = s.book(1, Footprint { prefill_tokens: 40, prefill_time: Duration::from_millis(3), ..prompt(40, vec![1, 2, 3]) });
        let _b = s.book(1, prompt(8, vec![1, 2, 4, 5]));
        s.step_ended(1);
        let now = clock_us();
        let c = s.candidate(1, now);
        assert_eq!((c.id, c.in_flight, c.active_prefill_tokens, c.prefilling), (1, 2, 48, 2));
        assert_eq!((c.active_blocks, c.next_step_tokens, c.since_step_ms), (s.active_blocks(1), s.next_step_tokens(1), s.since_step_ms_at(1, now)));
        assert_eq!(c.active_blocks, 5, "blocks 1 and 2 count once");
        assert_eq!(c.prefill_backlog_ms, s.prefill_backlog_at(1, now).as_secs_f64() * 1000.0);
        assert!(c.prefill_backlog_ms > 0.0 && c.prefill_load > 0.0 && c.prefill_load == s.prefill_load_at(1, now));
        assert_eq!(s.candidate(9, now), Candidate { id: 9, ..Candidate::default() }, "no such worker: nothing booked");
    }

    #[test]
    fn the_peers_load_adds_to_every_view_but_what_this_replica_publishes() {
        let counters: Vec<Arc<WorkerCounters>> = vec![Arc::default()];
        let s = Ledger::over(counters.clone(), Tracking::default());
        let _a = s.book(0, Footprint { prefill_tokens: 40, prefill_time: Duration::from_millis(3), ..prompt(40, vec![1, 2, 3]) });
        let now = clock_us();
        let own = s.own(0, now);
        assert_eq!((own.requests, own.prefilling, own.prefill_tokens, own.active_blocks), (1, 1, 40, 3));
        let theirs = peers::OwnLoad {
            requests: 4,
            prefilling: 2,
            prefill_tokens: 1000,
            active_blocks: 70,
            expected_blocks: 90,
            decode_sensitivity: 0.5,
            prefill_backlog_ms: 200.0,
            prefill_load: 0.3,
        };
        counters[0].peers().set(&theirs, now);
        let c = s.candidate(0, now);
        assert_eq!((c.in_flight, c.prefilling, c.active_prefill_tokens, c.active_blocks), (5, 3, 1040, 73));
        assert_eq!((s.requests(0), s.prefilling(0), s.prefill_tokens(0), s.active_blocks(0)), (5, 3, 1040, 73));
        assert_eq!(s.expected_blocks(0), own.expected_blocks + 90);
        assert!(c.prefill_backlog_ms >= 200.0 && (c.decode_sensitivity - 0.5).abs() < 1e-9);
        assert!((c.prefill_load - (own.prefill_load + 0.3)).abs() < 1e-9);
        assert_eq!(s.own(0, now), own, "what it publishes is its own only");
    }

    #[test]
    fn a_peers_chain_counts_as_booked_until_released_and_its_own_go_to_the_sink() {
        #[derive(Default)]
        struct Seen(Mutex<Vec<(u64, WorkerId, bool)>>);
        impl peers::ChainSink for Seen {
            fn booked(&self, key: u64, w: WorkerId, _: &Arc<[BlockHash]>) {
                self.0.lock().push((key, w, true));
            }
            fn released(&self, key: u64, w: WorkerId) {
                self.0.lock().push((key, w, false));
            }
        }
        let s = Ledger::new(2, Tracking::default());
        let theirs: Arc<[BlockHash]> = vec![1, 2, 3].into();
        s.add_peer_chain(1, &theirs);
        let own = s.book(0, prompt(16, vec![1, 2]));
        assert_eq!((s.overlap(&[1, 2, 3, 4]).get(0), s.overlap(&[1, 2, 3, 4]).get(1)), (2, 3), "own and peers' bookings both count");
        assert_eq!(s.active_blocks(1), 0, "a peer's blocks reach this replica as its load, not here");
        s.remove_peer_chain(1, &theirs);
        s.remove_peer_chain(1, &theirs);
        assert_eq!(s.overlap(&[1, 2, 3]).get(1), 0);
        drop(own);
        let seen = Arc::new(Seen::default());
        assert!(s.share_chains(seen.clone()));
        assert!(!s.share_chains(seen.clone()), "set once");
        let b = s.book(1, prompt(16, vec![7, 8]));
        drop(b);
        let _unchained = s.book(0, prompt(16, Vec::new()));
        let got = seen.0.lock().clone();
        assert_eq!(got.len(), 2, "a chain booked and released, nothing for a request without one: {got:?}");
        assert_eq!((got[0].1, got[0].2, got[1].1, got[1].2), (1, true, 1, false));
        assert_eq!(got[0].0, got[1].0, "under one key");
    }

    #[test]
    fn output_blocks_are_booked_at_each_block_boundary() {
        let s = with_output(4);
        // 6 prompt tokens: the first output block boundary is at token 8, i.e. 2 generated.
        let b = s.book(0, Footprint { prefill_tokens: 6, prompt_tokens: 6, chain: vec![1], ..Footprint::default() });
        assert_eq!(s.active_blocks(0), 1);
        b.generated(1);
        assert_eq!(s.active_blocks(0), 1);
        b.generated(1);
        assert_eq!(s.active_blocks(0), 2, "token 8 fills a block");
        b.generated(8);
        assert_eq!(s.active_blocks(0), 4);
        drop(b);
        assert_eq!(s.active_blocks(0), 0);
    }

    #[test]
    fn expected_output_reserves_its_mid_life_blocks_until_the_request_ends() {
        let s = Ledger::new(1, Tracking { block_size: 16, ..Tracking::default() });
        // 20 prompt tokens: one full block chained; the partial one and half of 256 output
        // tokens fill ceil(148 / 16) - 1 = 9 more.
        let footprint = Footprint { prefill_tokens: 20, prompt_tokens: 20, chain: vec![7], output_estimate: 256, ..Footprint::default() };
        let a = s.book(0, footprint.clone());
        assert_eq!((s.active_blocks(0), s.expected_blocks(0)), (1, 10), "in use now: the prompt; on average: 10");
        let b = s.book(0, footprint);
        assert_eq!(s.expected_blocks(0), 19, "the shared prompt block counts once, each output apart");
        drop(a);
        assert_eq!(s.expected_blocks(0), 10);
        drop(b);
        assert_eq!(s.expected_blocks(0), 0);
        let unknown = s.book(0, Footprint { prompt_tokens: 20, chain: vec![7], ..Footprint::default() });
        assert_eq!(s.expected_blocks(0), 1, "no expected output: nothing reserved");
        drop(unknown);
    }

    #[test]
    fn tracked_output_counts_where_it_passes_the_reservation() {
        let s = with_output(4);
        let b = s.book(0, Footprint { prompt_tokens: 4, chain: vec![1], output_estimate: 16, ..Footprint::default() });
        assert_eq!(s.expected_blocks(0), 3);
        b.generated(20);
        assert_eq!((s.active_blocks(0), s.expected_blocks(0)), (6, 6), "a stream past its estimate holds what it filled");
        drop(b);
        assert_eq!(s.expected_blocks(0), 0);
    }

    #[test]
    fn with_an_expected_length_output_blocks_decay_toward_its_end() {
        let s = with_output(1);
        let b = s.book(0, Footprint { expected_output: Some(100), ..Footprint::default() });
        b.generated(50);
        assert_eq!(s.active_blocks(0), 25, "50 blocks weigh 1 - 50/100 each");
        b.generated(30);
        assert_eq!(s.active_blocks(0), 16, "80 blocks at 0.2");
        b.generated(40);
        assert_eq!(s.active_blocks(0), 0, "past the expected length they weigh nothing");
        drop(b);
        assert_eq!(s.active_blocks(0), 0);
    }

    #[test]
    fn output_is_not_tracked_unless_asked_and_prompt_blocks_can_be_off() {
        let s = Ledger::new(1, Tracking::default());
        let b = s.book(0, prompt(0, vec![1, 2]));
        b.generated(1000);
        assert_eq!(s.active_blocks(0), 2);
        let s = Ledger::new(1, Tracking { active_blocks: false, output_blocks: true, ..Tracking::default() });
        let b = s.book(0, prompt(32, vec![1, 2]));
        b.generated(1000);
        assert_eq!((s.prefill_tokens(0), s.active_blocks(0)), (32, 0));
    }

    #[test]
    fn output_after_expiry_books_nothing() {
        let s = with_output(1);
        let b = s.book(0, prompt(0, vec![]));
        b.generated(10);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.expire(Duration::from_millis(1)), 1);
        assert_eq!(s.active_blocks(0), 0);
        b.generated(10);
        drop(b);
        assert_eq!(s.active_blocks(0), 0);
    }

    #[test]
    fn requests_count_as_decoding_from_their_first_token_to_their_end() {
        let s = Ledger::new(1, Tracking::default());
        let sensitivity = || s.candidate(0, clock_us()).decode_sensitivity;
        let short = |tokens| Footprint { prefill_tokens: 10, prompt_tokens: 10, output_estimate: tokens, ..Footprint::default() };
        let mut a = s.book(0, short(8));
        let mut b = s.book(0, short(1000));
        assert!(sensitivity().abs() < 1e-12, "prefilling: nothing of theirs decodes yet");
        a.prefill_done(true);
        b.prefill_done(true);
        assert!((sensitivity() - (1.0 / 8.0 + 1.0 / 1000.0)).abs() < 1e-6, "{}", sensitivity());
        drop(a);
        assert!((sensitivity() - 1.0 / 1000.0).abs() < 1e-6);
        // A whole answer (unary) never decoded in steps a stall could reach; an unknown length
        // counts nothing.
        let mut unary = s.book(0, short(8));
        unary.prefill_done(false);
        let mut unknown = s.book(0, short(0));
        unknown.prefill_done(true);
        assert!((sensitivity() - 1.0 / 1000.0).abs() < 1e-6);
        drop((b, unary, unknown));
        assert!(sensitivity().abs() < 1e-12);
    }

    #[test]
    fn expiry_racing_a_first_token_leaves_no_decoding_count() {
        let s = Ledger::new(1, Tracking::default());
        let mut b = s.book(0, Footprint { prefill_tokens: 10, prompt_tokens: 10, output_estimate: 4, ..Footprint::default() });
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.expire(Duration::from_millis(1)), 1);
        b.prefill_done(true);
        assert!(s.candidate(0, clock_us()).decode_sensitivity.abs() < 1e-12, "released first: the first token adds nothing");
        drop(b);
        let mut b = s.book(0, Footprint { prefill_tokens: 10, prompt_tokens: 10, output_estimate: 4, ..Footprint::default() });
        b.prefill_done(true);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.expire(Duration::from_millis(1)), 1);
        assert!(s.candidate(0, clock_us()).decode_sensitivity.abs() < 1e-12, "expiry takes the count back");
        drop(b);
        assert!(s.candidate(0, clock_us()).decode_sensitivity.abs() < 1e-12);
    }

    #[test]
    fn concurrent_streams_and_expiry_leave_exactly_zero() {
        let s = with_output(2);
        std::thread::scope(|sc| {
            for t in 0..4u64 {
                let s = s.clone();
                sc.spawn(move || {
                    for i in 0..300u64 {
                        let b = s.book(
                            0,
                            Footprint {
                                prefill_tokens: 5,
                                prompt_tokens: 5,
                                chain: vec![t * 1000 + i + 1],
                                expected_output: (i % 2 == 0).then_some(40),
                                ..Footprint::default()
                            },
                        );
                        for _ in 0..(i % 50) {
                            b.generated(1);
                        }
                    }
                });
            }
            let s = s.clone();
            sc.spawn(move || {
                for _ in 0..200 {
                    s.expire(Duration::ZERO);
                }
            });
        });
        assert_eq!((s.prefill_tokens(0), s.active_blocks(0)), (0, 0));
    }

    #[test]
    fn shared_prefixes_count_once_and_everything_returns_to_zero() {
        let s = Ledger::new(2, Tracking::default());
        let a = s.book(0, prompt(100, vec![1, 2, 3]));
        let mut b = s.book(0, prompt(50, vec![1, 2, 4, 5]));
        assert_eq!(s.prefill_tokens(0), 150);
        assert_eq!(s.active_blocks(0), 5, "blocks 1 and 2 shared");
        assert_eq!(s.overlap(&[1, 2, 4, 9]).get(0), 3);
        b.prefill_done(true);
        b.prefill_done(true);
        assert_eq!(s.prefill_tokens(0), 100);
        drop(a);
        assert_eq!(s.active_blocks(0), 4);
        drop(b);
        assert_eq!((s.prefill_tokens(0), s.active_blocks(0)), (0, 0));
    }

    #[test]
    fn without_reuse_every_booking_counts_in_full() {
        let s = Ledger::new(1, Tracking { assume_kv_reuse: false, ..Tracking::default() });
        let a = s.book(0, prompt(10, vec![1, 2]));
        let b = s.book(0, prompt(10, vec![1, 2]));
        assert_eq!(s.active_blocks(0), 4);
        assert_eq!(s.overlap(&[1, 2]).get(0), 0);
        drop((a, b));
        assert_eq!(s.active_blocks(0), 0);
    }

    #[test]
    fn expiry_releases_old_bookings_exactly_once() {
        let s = Ledger::new(1, Tracking::default());
        let b = s.book(0, prompt(40, vec![1, 2]));
        assert_eq!(s.expire(Duration::from_secs(3600)), 0);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.expire(Duration::from_millis(1)), 1);
        assert_eq!((s.prefill_tokens(0), s.active_blocks(0)), (0, 0));
        assert_eq!(s.requests(0), 1, "the request itself stays counted until it ends");
        drop(b); // the guard's release is now a no-op: nothing goes negative
        assert_eq!((s.requests(0), s.prefill_tokens(0), s.active_blocks(0)), (0, 0, 0));
        assert_eq!(s.expired_count(), 1);
    }

    #[test]
    fn a_panic_releases_the_booking() {
        let s = Ledger::new(1, Tracking::default());
        let s2 = s.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _b = s2.book(0, prompt(77, vec![7, 8]));
            panic!("handler failed");
        }));
        assert!(r.is_err());
        assert_eq!((s.prefill_tokens(0), s.active_blocks(0)), (0, 0));
    }
    #[test]
    fn in_flight_and_private_blocks_are_counted_and_released() {
        let s = Ledger::new(2, Tracking::default());
        let a = s.book(1, Footprint { prefill_tokens: 40, private_blocks: 3, ..Footprint::default() });
        let b = s.book(1, Footprint { prefill_tokens: 8, private_blocks: 3, ..Footprint::default() });
        assert_eq!((s.requests(1), s.prefill_tokens(1), s.active_blocks(1)), (2, 48, 6), "estimates are never shared");
        assert_eq!(s.requests(0), 0);
        drop((a, b));
        assert_eq!((s.requests(1), s.prefill_tokens(1), s.active_blocks(1)), (0, 0, 0));
    }

    #[test]
    fn a_booking_moves_between_workers_and_everything_returns_to_zero() {
        let s = Ledger::new(2, Tracking { output_blocks: true, block_size: 2, ..Tracking::default() });
        let mut b = s.book(0, Footprint { prefill_tokens: 30, prompt_tokens: 30, chain: vec![1, 2, 3], ..Footprint::default() });
        let other = s.book(1, prompt(10, vec![1, 2]));
        b.prefill_done(true);
        b.generated(4);
        assert_eq!((s.requests(0), s.prefill_tokens(0), s.active_blocks(0)), (1, 0, 5));
        // The continuation (prompt + generated) is prefilled on worker 1, which shares 2 blocks.
        b.move_to(1, Footprint { prefill_tokens: 14, prompt_tokens: 34, chain: vec![1, 2, 3, 4], ..Footprint::default() });
        assert_eq!(b.worker(), 1);
        assert_eq!((s.requests(0), s.prefill_tokens(0), s.active_blocks(0)), (0, 0, 0), "nothing left behind");
        assert_eq!((s.requests(1), s.prefill_tokens(1), s.active_blocks(1)), (2, 24, 4), "blocks 1 and 2 shared");
        b.generated(2);
        assert_eq!(s.active_blocks(1), 5, "output restarts at the continuation's end");
        drop(b);
        drop(other);
        for w in 0..2 {
            assert_eq!((s.requests(w), s.prefill_tokens(w), s.active_blocks(w)), (0, 0, 0));
        }
    }

    #[test]
    fn moves_racing_expiry_and_drops_leave_exactly_zero() {
        let s = Ledger::new(2, Tracking { output_blocks: true, block_size: 2, ..Tracking::default() });
        std::thread::scope(|sc| {
            for t in 0..4u64 {
                let s = s.clone();
                sc.spawn(move || {
                    for i in 0..200u64 {
                        let mut b =
                            s.book((i % 2) as u16, Footprint { prefill_tokens: 7, prompt_tokens: 7, chain: vec![t * 1000 + i + 1], ..Footprint::default() });
                        b.generated(3);
                        b.move_to(
                            ((i + 1) % 2) as u16,
                            Footprint { prefill_tokens: 10, prompt_tokens: 10, chain: vec![t * 1000 + i + 1, 7], ..Footprint::default() },
                        );
                        b.generated(5);
                    }
                });
            }
            let s = s.clone();
            sc.spawn(move || {
                for _ in 0..200 {
                    s.expire(Duration::ZERO);
                }
            });
        });
        for w in 0..2 {
            assert_eq!((s.requests(w), s.prefill_tokens(w), s.active_blocks(w)), (0, 0, 0));
        }
    }

    #[test]
    fn ledgers_over_the_same_counters_add_up_and_survive_a_rebuild() {
        let counters: Vec<Arc<WorkerCounters>> = (0..2).map(|_| Arc::default()).collect();
        let old = Ledger::over(counters.clone(), Tracking::default());
        let running = old.book(1, prompt(100, vec![1, 2]));
        // The model is rebuilt (a reload): a new ledger over the same workers' counters.
        let new = Ledger::over(counters.clone(), Tracking::default());
        assert_eq!((new.requests(1), new.prefill_tokens(1)), (1, 100), "the running request still counts");
        let other = new.book(1, Footprint { prefill_tokens: 10, private_blocks: 1, ..Footprint::default() });
        assert_eq!((old.requests(1), old.prefill_tokens(1)), (2, 110));
        drop(running);
        drop(other);
        assert_eq!((new.requests(1), new.prefill_tokens(1), new.active_blocks(1)), (0, 0, 0));
    }

    #[test]
    fn a_move_after_expiry_books_afresh() {
        let s = Ledger::new(2, Tracking::default());
        let mut b = s.book(0, prompt(10, vec![1]));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(s.expire(Duration::from_millis(1)), 1);
        b.move_to(1, prompt(20, vec![1, 2]));
        assert_eq!((s.requests(0), s.requests(1), s.prefill_tokens(1)), (0, 1, 20));
        drop(b);
        assert_eq!((s.requests(1), s.prefill_tokens(1), s.active_blocks(1)), (0, 0, 0));
    }

    #[test]
    fn booked_prefill_time_is_the_workers_prefill_load() {
        let s = Ledger::new(2, Tracking::default());
        let fp = |ms| Footprint { prefill_tokens: 1000, prefill_time: Duration::from_millis(ms), ..Footprint::default() };
        let (_a, _b) = (s.book(0, fp(500)), s.book(0, fp(500)));
        // A second of prefill over the five-second window; nothing on the other worker, and
        // nothing counts for a booking whose prefill is cached (no time predicted).
        let _c = s.book(1, Footprint { prefill_tokens: 0, prefill_time: Duration::from_millis(900), ..Footprint::default() });
        let now = clock_us();
        let rho = s.prefill_load_at(0, now);
        assert!((rho - 1.0 / load_rate::WINDOW_S).abs() < 0.01, "{rho}");
        assert_eq!(s.prefill_load_at(1, now), 0.0);
        assert_eq!(s.prefill_load_at(9, now), 0.0);
    }

    #[test]
    fn prefill_bookings_are_the_models_arrival_rate() {
        let s = Ledger::new(2, Tracking::default());
        let fp = |tokens| Footprint { prefill_tokens: tokens, prefill_time: Duration::from_millis(10), ..Footprint::default() };
        let (_a, _b, _c) = (s.book(0, fp(100)), s.book(1, fp(100)), s.book(1, fp(0)));
        // Two prefills (a cached prompt is none) over the five-second window, over two workers.
        let rate = s.arrivals_per_worker_at(clock_us());
        assert!((rate - 2.0 / load_rate::WINDOW_S / 2.0).abs() < 0.01, "{rate}");
    }

    #[test]
    fn booked_prefill_backlog_follows_predicted_progress_and_first_tokens() {
        let s = Ledger::new(1, Tracking::default());
        let second = Duration::from_secs(1);
        let fp = |t| Footprint { prefill_tokens: 1000, prefill_time: t, ..Footprint::default() };
        let mut a = s.book(0, fp(second));
        let b = s.book(0, fp(second));
        let backlog = s.prefill_backlog(0);
        assert!(backlog > Duration::from_millis(1900) && backlog <= 2 * second, "{backlog:?}");
        // `a` was due in 1 s and produced its first token now: `b` moves up by as much.
        a.prefill_done(true);
        let backlog = s.prefill_backlog(0);
        assert!(backlog > Duration::from_millis(900) && backlog <= second, "{backlog:?}");
        // Cancelled before its first token: nothing is left.
        drop(b);
        assert_eq!(s.prefill_backlog(0), Duration::ZERO);
        // Time runs a backlog down.
        let _c = s.book(0, fp(Duration::from_millis(40)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(s.prefill_backlog(0) <= Duration::from_millis(21), "{:?}", s.prefill_backlog(0));
    }

    #[test]
    fn the_prefill_queued_since_a_worker_was_idle_adds_up_until_its_queue_empties() {
        let s = Ledger::new(1, Tracking::default());
        let fp = |tokens| Footprint { prefill_tokens: tokens, prefill_time: Duration::from_secs(100), ..Footprint::default() };
        let queued = |s: &Ledger| s.candidate(0, clock_us()).queued_since_idle;
        let mut a = s.book(0, fp(16_384));
        let mut b = s.book(0, fp(3_000));
        assert_eq!(queued(&s), 19_384);
        // The first prompt's first token: the second still stands where the two packed it.
        a.prefill_done(true);
        assert_eq!(queued(&s), 19_384);
        // One cancelled before its first token no longer fills the queue's steps.
        let c = s.book(0, fp(1_000));
        assert_eq!(queued(&s), 20_384);
        drop(c);
        assert_eq!(queued(&s), 19_384);
        // Nothing left to prefill, then a new queue: its steps start afresh.
        b.prefill_done(true);
        assert_eq!(queued(&s), 0);
        let _d = s.book(0, fp(500));
        assert_eq!(queued(&s), 500);
        // A request with nothing to prefill queues nothing.
        let _e = s.book(0, fp(0));
        assert_eq!(queued(&s), 500);
        // A queue predicted done has run dry in the engine even before its first token reaches
        // the gateway: the next prompt starts its steps afresh.
        let t = Ledger::new(1, Tracking::default());
        let _f = t.book(0, Footprint { prefill_tokens: 2_000, prefill_time: Duration::from_millis(1), ..Footprint::default() });
        std::thread::sleep(Duration::from_millis(5));
        let _g = t.book(0, fp(700));
        assert_eq!(queued(&t), 700);
    }

    #[test]
    fn a_cancelled_booking_takes_only_its_own_time_out_of_the_backlog() {
        let s = Ledger::new(1, Tracking::default());
        let fp = |ms| Footprint { prefill_tokens: 10, prefill_time: Duration::from_millis(ms), ..Footprint::default() };
        let _a = s.book(0, fp(500));
        let b = s.book(0, fp(300));
        drop(b);
        let left = s.prefill_backlog(0);
        assert!(left > Duration::from_millis(450) && left <= Duration::from_millis(500), "{left:?}");
    }

    #[test]
    fn no_prediction_error_outlives_the_last_prefill() {
        let s = Ledger::new(1, Tracking::default());
        let fp = |ms| Footprint { prefill_tokens: 10, prefill_time: Duration::from_millis(ms), ..Footprint::default() };
        // Booked for 500 ms, answered whole at once (a unary answer or an error): nothing left.
        let mut a = s.book(0, fp(500));
        a.prefill_done(false);
        assert_eq!(s.prefill_backlog(0), Duration::ZERO);
        // The next booking starts from now, not from the first one's predicted end.
        let _b = s.book(0, fp(100));
        let left = s.prefill_backlog(0);
        assert!(left > Duration::from_millis(90) && left <= Duration::from_millis(100), "{left:?}");
    }

    #[test]
    fn the_end_to_end_rate_is_the_mean_first_token_over_the_mean_whole_answer() {
        let s = Ledger::new(1, Tracking::default());
        assert_eq!(s.e2e_weight(), None, "nothing timed yet");
        // 11 tokens: the first after 100 ms, ten more 10 ms apart, 200 ms in all.
        s.stream_finished(11, Some((100.0, 10.0)));
        assert!((s.e2e_weight().unwrap() - 0.5).abs() < 1e-9, "{:?}", s.e2e_weight());
    }
}
