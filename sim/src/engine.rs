//! One engine (DP rank) as a tokio task: it owns a [`Scheduler`], runs steps back to back while
//! there is work, sleeps each step's simulated duration (divided by `time_scale`), then delivers
//! the step's tokens to the requests' channels, publishes the step's KV events as one batch, and
//! updates its metrics.
//!
//! Commands (add, abort, reset prefix cache, pause, resume) are applied between steps, as vLLM's
//! engine core does; the events a command causes (AllBlocksCleared) go out with the next step's
//! batch. A pause ([`PauseMode`]) aborts, drains or freezes what runs, and new requests queue
//! until the resume. A request whose receiver is gone is aborted at the next delivery, so a client that
//! disconnects frees its blocks within one step even if nobody sent an abort.
//!
//! Prefill/decode disaggregation: a prefill leg's held blocks are leased (`kv_lease_duration`,
//! scaled by `time_scale`) and freed when a decode worker pulls them ([`EngineHandle::release_held`])
//! or when the lease ends; a decode leg's pull runs as a task of its own (the transfer time of
//! the timing model, then the prefill worker's side channel) and comes back as a command, so
//! the engine goes on stepping meanwhile, as vLLM's does during an async KV load.
//!
//! Steps are paced against a virtual clock: each step starts when the previous one was due to
//! end, so the 1 ms timer resolution does not accumulate error, and at most 2 ms of lag is
//! caught up after the engine falls behind wall time; the rest is counted as lag
//! (`vllm_sim:engine_lag_seconds_total`), so a benchmark can tell a host that ran the simulator
//! late from a slow routing choice.

use crate::faults::Faults;
use crate::kv_cache::BlockId;
use crate::metrics::EngineMetrics;
use crate::publisher::PublisherHandle;
use crate::scheduler::{FinishReason, HeldKv, LoadOutcome, LoadStart, NewRequest, PauseState, ReqId, Scheduler, TokenOutput};
use crate::timing::TimingModel;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// A token delivered to the HTTP layer, tagged with the choice it belongs to.
#[derive(Debug, Clone, Copy)]
pub struct Delivery {
    /// Choice index within the HTTP request.
    pub choice: usize,
    /// The engine's output.
    pub out: TokenOutput,
}

/// Where a prefill leg's held blocks get reported: its internal request id (what a decode
/// worker names in its pull, `remote_request_id`) and the channel the report goes on.
#[derive(Debug)]
pub struct HoldReply {
    /// The request's internal id.
    pub request_id: String,
    /// Gets the report once the request finished and its blocks are held (dropped unsent when
    /// they are not: an aborted request).
    pub tx: oneshot::Sender<HeldReport>,
}

/// A finished prefill leg whose blocks wait for a decode worker.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldReport {
    /// What the blocks hold.
    pub kv: HeldKv,
    /// When the lease ends, in Unix seconds (`remote_blocks_expiry_time`).
    pub expiry_unix: f64,
}

/// Why a pull found nothing to release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseError {
    /// No such request holds blocks here (unknown, already pulled, or its lease ended).
    NotHeld,
    /// Blocks named in the pull that the request does not hold.
    NotItsBlocks(Vec<BlockId>),
    /// The engine stopped.
    Stopped,
}

/// The engine's side of P/D: the lease on held blocks and the failure policy of pulls.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvParams {
    /// Tokens per block (the transfer time is per token).
    pub block_size: usize,
    /// Lease on held blocks, seconds of simulated time.
    pub lease_secs: f64,
    /// A failed pull fails the request (else its prompt is recomputed).
    pub fail_on_load_error: bool,
}

enum Cmd {
    Add { req: NewRequest, choice: usize, tx: mpsc::UnboundedSender<Delivery>, arrival: Instant, hold: Option<HoldReply> },
    KvLoaded { id: ReqId, result: Result<usize, String> },
    Release { request_id: String, blocks: Vec<BlockId>, reply: oneshot::Sender<Result<usize, ReleaseError>> },
    Abort(ReqId),
    Reset { running: bool, reply: oneshot::Sender<bool> },
    Pause { mode: PauseMode, clear_cache: bool, reply: oneshot::Sender<()> },
    Resume(oneshot::Sender<()>),
}

/// How `/pause` (and `/sleep`) treat requests in flight, as vLLM's `PauseMode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// Abort every request (running or waiting) now: each ends with `finish_reason: "abort"`.
    Abort,
    /// Let running requests finish; the pause completes when none runs.
    Wait,
    /// Freeze running requests where they are; they go on after `/resume`.
    Keep,
}

/// The HTTP layer's handle on one engine.
#[derive(Debug)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Cmd>,
    rank: u32,
    next_id: AtomicU64,
    in_flight: AtomicI64,
    /// The engine's metrics.
    pub metrics: Arc<EngineMetrics>,
    /// Its KV event publisher, if events are on.
    pub publisher: Option<PublisherHandle>,
    paused: AtomicBool,
}

impl EngineHandle {
    /// DP rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// A fresh request id for this engine.
    pub fn next_id(&self) -> ReqId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Requests submitted and not yet finished or aborted (for DP load balancing).
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Queues a request; tokens arrive on `tx`, and a held prefill leg's report on `hold`.
    /// Returns false if the engine has stopped.
    pub fn submit(&self, req: NewRequest, choice: usize, tx: mpsc::UnboundedSender<Delivery>, hold: Option<HoldReply>) -> bool {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let ok = self.tx.send(Cmd::Add { req, choice, tx, arrival: Instant::now(), hold }).is_ok();
        if !ok {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        ok
    }

    /// Frees the blocks a finished prefill leg holds for a decode worker that read `blocks` of
    /// them (NIXL's completion notification); returns how many blocks were freed.
    pub async fn release_held(&self, request_id: String, blocks: Vec<BlockId>) -> Result<usize, ReleaseError> {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Cmd::Release { request_id, blocks, reply: tx }).is_err() {
            return Err(ReleaseError::Stopped);
        }
        rx.await.unwrap_or(Err(ReleaseError::Stopped))
    }

    /// Aborts a request (a no-op if it already finished).
    pub fn abort(&self, id: ReqId) {
        let _ = self.tx.send(Cmd::Abort(id));
    }

    /// Drops the prefix cache; false if blocks are in use (as vLLM; `reset_running` preempts
    /// running requests first) or the engine stopped.
    pub async fn reset_prefix_cache(&self, reset_running: bool) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Cmd::Reset { running: reset_running, reply: tx }).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Pauses scheduling as vLLM's `pause_scheduler`; returns when the pause is complete (in
    /// `wait` mode, once no request runs), the prefix cache dropped first when `clear_cache`.
    /// New requests queue until [`EngineHandle::resume`]. False if the engine stopped.
    pub async fn pause(&self, mode: PauseMode, clear_cache: bool) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Cmd::Pause { mode, clear_cache, reply: tx }).is_err() {
            return false;
        }
        self.paused.store(true, Ordering::Relaxed);
        rx.await.is_ok()
    }

    /// Resumes scheduling (queued requests start); a pause still waiting completes.
    pub async fn resume(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Cmd::Resume(tx)).is_err() {
            return false;
        }
        let ok = rx.await.is_ok();
        self.paused.store(false, Ordering::Relaxed);
        ok
    }

    /// Whether the engine is paused.
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }
}

/// Pacing and accounting parameters of an engine task.
pub struct EngineParams {
    /// Step-time model.
    pub timing: TimingModel,
    /// Wall time = simulated time / time_scale.
    pub time_scale: f64,
    /// Shared fault state (token counter for crash-after-tokens).
    pub faults: Arc<Faults>,
    /// Cancelled when the server stops.
    pub stop: CancellationToken,
    /// Prefill/decode disaggregation.
    pub kv: KvParams,
}

/// Spawns the engine task and returns its handle.
pub fn spawn(sched: Scheduler, rank: u32, publisher: Option<PublisherHandle>, params: EngineParams) -> Arc<EngineHandle> {
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = Arc::new(EngineHandle {
        tx,
        rank,
        next_id: AtomicU64::new(1),
        in_flight: AtomicI64::new(0),
        metrics: Arc::new(EngineMetrics::default()),
        publisher,
        paused: AtomicBool::new(false),
    });
    let task = EngineTask { sched, live: HashMap::new(), handle: handle.clone(), params, pausing: Vec::new(), leases: HashMap::new() };
    tokio::spawn(task.run(rx));
    handle
}

struct Live {
    tx: mpsc::UnboundedSender<Delivery>,
    choice: usize,
    arrival: Instant,
    scheduled: bool,
    last: Instant,
    hold: Option<HoldReply>,
}

struct EngineTask {
    sched: Scheduler,
    live: HashMap<ReqId, Live>,
    handle: Arc<EngineHandle>,
    params: EngineParams,
    /// Pauses not complete yet (`wait` mode with requests running): their replies and whether
    /// they clear the cache.
    pausing: Vec<(oneshot::Sender<()>, bool)>,
    /// Held prefill legs by internal request id: the engine's id and when the lease ends.
    leases: HashMap<String, (ReqId, Instant)>,
}

/// Sleeps until `t`, or forever.
async fn sleep_until_some(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

impl EngineTask {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        let stop = self.params.stop.clone();
        let mut clock = Instant::now();
        loop {
            self.expire_leases();
            if !self.sched.has_work() {
                self.refresh_gauges();
                tokio::select! {
                    cmd = rx.recv() => match cmd {
                        Some(c) => self.apply(c),
                        None => return,
                    },
                    _ = sleep_until_some(self.next_lease_end()) => {},
                    _ = stop.cancelled() => return,
                }
                clock = Instant::now();
            }
            while let Ok(c) = rx.try_recv() {
                self.apply(c);
            }
            if stop.is_cancelled() {
                return;
            }
            while self.params.faults.stalled() {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {},
                    _ = stop.cancelled() => return,
                }
                clock = Instant::now();
            }
            let mut step = self.sched.schedule();
            self.start_loads(std::mem::take(&mut step.loads));
            if step.scheduled.is_empty() {
                // Nothing to compute until a pull ends or blocks are freed: wait for news.
                self.flush_events();
                self.refresh_gauges();
                tokio::select! {
                    cmd = rx.recv() => match cmd { Some(c) => self.apply(c), None => return },
                    _ = sleep_until_some(self.next_lease_end()) => {},
                    _ = stop.cancelled() => return,
                }
                clock = Instant::now();
                continue;
            }
            let now = Instant::now();
            for &(id, _) in &step.scheduled {
                if let Some(l) = self.live.get_mut(&id)
                    && !l.scheduled
                {
                    l.scheduled = true;
                    self.handle.metrics.queue_time.observe(now.duration_since(l.arrival).as_secs_f64());
                }
            }
            let sim_ms = self.params.timing.step_ms(&step.shape);
            let end = clock + Duration::from_secs_f64(sim_ms / 1000.0 / self.params.time_scale);
            if end > now + Duration::from_millis(1) {
                tokio::select! {
                    _ = tokio::time::sleep_until(end.into()) => {},
                    _ = stop.cancelled() => return,
                }
            } else {
                tokio::task::yield_now().await;
            }
            let outs = self.sched.update(&step);
            self.deliver(outs);
            self.finish_pause();
            self.flush_events();
            self.refresh_gauges();
            self.handle.metrics.steps.add(1);
            let now = Instant::now();
            let caught_up_to = now.checked_sub(Duration::from_millis(2)).unwrap_or(now);
            if caught_up_to > end {
                let lost = u64::try_from(caught_up_to.duration_since(end).as_micros()).unwrap_or(u64::MAX);
                self.handle.metrics.lag_us.add(lost);
            }
            clock = end.max(caught_up_to);
        }
    }

    fn apply(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Add { req, choice, tx, arrival, hold } => {
                let id = req.id;
                self.sched.add(req);
                self.live.insert(id, Live { tx, choice, arrival, scheduled: false, last: arrival, hold });
            }
            Cmd::KvLoaded { id, result } => self.end_load(id, result),
            Cmd::Release { request_id, blocks, reply } => {
                let _ = reply.send(self.release(&request_id, &blocks));
            }
            Cmd::Abort(id) => self.abort(id),
            Cmd::Reset { running, reply } => {
                // Like vLLM, AllBlocksCleared goes out with the next step's batch, not now.
                let _ = reply.send(self.sched.reset_prefix_cache(running));
            }
            Cmd::Pause { mode, clear_cache, reply } => {
                if mode == PauseMode::Abort {
                    self.sched.pending_pulls().into_iter().for_each(|r| self.free_remote(r));
                    let aborted = self.sched.abort_all();
                    self.end_aborted(aborted);
                }
                self.sched.set_pause(if mode == PauseMode::Keep { PauseState::PausedAll } else { PauseState::PausedNew });
                self.pausing.push((reply, clear_cache));
                self.finish_pause();
            }
            Cmd::Resume(reply) => {
                self.sched.set_pause(PauseState::Unpaused);
                // A pause still waiting for its requests is over too.
                self.pausing.drain(..).for_each(|(r, _)| {
                    let _ = r.send(());
                });
                let _ = reply.send(());
            }
        }
    }

    /// Completes the pending pauses once nothing runs (at once unless `wait` mode found requests
    /// running), dropping the prefix cache first if one asked, as vLLM's `_finish_pause` does
    /// (running requests, frozen by `keep`, are preempted to recompute after the resume).
    fn finish_pause(&mut self) {
        if self.pausing.is_empty() || (self.sched.pause_state() == PauseState::PausedNew && self.sched.has_running()) {
            return;
        }
        if self.pausing.iter().any(|(_, clear)| *clear) && !self.sched.reset_prefix_cache(true) {
            tracing::warn!(rank = self.handle.rank, "pause: the prefix cache could not be reset");
        }
        for (r, _) in self.pausing.drain(..) {
            let _ = r.send(());
        }
    }

    /// Tells the clients of aborted requests: one last output with `finish_reason: "abort"`.
    fn end_aborted(&mut self, aborted: Vec<TokenOutput>) {
        for out in aborted {
            if let Some(l) = self.live.remove(&out.id) {
                let _ = l.tx.send(Delivery { choice: l.choice, out });
                self.handle.in_flight.fetch_sub(1, Ordering::Relaxed);
                self.handle.metrics.aborted.add(1);
            }
        }
    }

    fn abort(&mut self, id: ReqId) {
        if let Some(remote) = self.sched.pending_pull(id) {
            self.free_remote(remote);
        }
        if self.sched.abort(id) {
            self.live.remove(&id);
            self.handle.in_flight.fetch_sub(1, Ordering::Relaxed);
            // vLLM does not count client aborts in request_success; the sim's own counter does.
            self.handle.metrics.aborted.add(1);
        }
    }

    /// Starts the pulls of decode legs admitted in this step: each waits the transfer time of
    /// the blocks it reads, then pulls them, and reports back as [`Cmd::KvLoaded`].
    fn start_loads(&self, loads: Vec<LoadStart>) {
        for load in loads {
            let n = load.blocks.as_ref().map_or(0, Vec::len);
            let ms = self.params.timing.kv_transfer_ms(n, self.params.kv.block_size);
            let wait = Duration::from_secs_f64(ms / 1000.0 / self.params.time_scale);
            let tx = self.handle.tx.clone();
            let stop = self.params.stop.clone();
            tokio::spawn(async move {
                let pull = async {
                    tokio::time::sleep(wait).await;
                    match &load.blocks {
                        Some(b) => crate::kv_connector::pull(&load.remote, b).await,
                        None => Err("remote_block_ids do not cover the prompt".into()),
                    }
                };
                tokio::select! {
                    result = pull => { let _ = tx.send(Cmd::KvLoaded { id: load.id, result }); }
                    _ = stop.cancelled() => {}
                }
            });
        }
    }

    /// Tells a prefill worker to free the blocks of a decode leg aborted before its pull (a
    /// pull of no blocks), as vLLM's connector notifies it rather than leave them to the lease.
    fn free_remote(&self, remote: Arc<crate::scheduler::RemotePrefill>) {
        let stop = self.params.stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                r = crate::kv_connector::pull(&remote, &[]) => {
                    if let Err(e) = r {
                        tracing::debug!(request_id = %remote.request_id, error = %e, "freeing an aborted decode leg's remote blocks failed");
                    }
                }
                _ = stop.cancelled() => {}
            }
        });
    }

    /// A decode leg's pull ended: the failure policy decides what a failure does.
    fn end_load(&mut self, id: ReqId, result: Result<usize, String>) {
        let outcome = match &result {
            Ok(_) => LoadOutcome::Loaded,
            Err(_) if self.params.kv.fail_on_load_error => LoadOutcome::Fail,
            Err(_) => LoadOutcome::Recompute,
        };
        if let Err(why) = result {
            tracing::warn!(rank = self.handle.rank, id, error = %why, ?outcome, "KV pull from the prefill worker failed");
        }
        if let Some(out) = self.sched.finish_load(id, outcome)
            && let Some(l) = self.live.remove(&out.id)
        {
            let _ = l.tx.send(Delivery { choice: l.choice, out });
            self.handle.in_flight.fetch_sub(1, Ordering::Relaxed);
            self.handle.metrics.success_error.add(1);
        }
    }

    /// A decode worker's pull of a held prefill leg: frees its blocks.
    fn release(&mut self, request_id: &str, blocks: &[BlockId]) -> Result<usize, ReleaseError> {
        let &(id, _) = self.leases.get(request_id).ok_or(ReleaseError::NotHeld)?;
        let held = self.sched.held(id).ok_or(ReleaseError::NotHeld)?;
        let foreign: Vec<BlockId> = blocks.iter().copied().filter(|b| !held.block_ids.contains(b)).collect();
        if !foreign.is_empty() {
            return Err(ReleaseError::NotItsBlocks(foreign));
        }
        self.leases.remove(request_id);
        self.sched.release_held(id).ok_or(ReleaseError::NotHeld)
    }

    /// Frees the blocks of held prefill legs whose lease ended.
    fn expire_leases(&mut self) {
        let now = Instant::now();
        let sched = &mut self.sched;
        self.leases.retain(|rid, &mut (id, end)| {
            if end > now {
                return true;
            }
            if let Some(n) = sched.release_held(id) {
                tracing::info!(request_id = %rid, blocks = n, "KV lease expired: held blocks freed");
            }
            false
        });
    }

    fn next_lease_end(&self) -> Option<Instant> {
        self.leases.values().map(|&(_, end)| end).min()
    }

    /// Leases a prefill leg's blocks if the scheduler held them, and reports them.
    fn lease(&mut self, id: ReqId, hold: HoldReply) {
        let Some(kv) = self.sched.held(id) else { return };
        let secs = self.params.kv.lease_secs / self.params.time_scale;
        self.leases.insert(hold.request_id, (id, Instant::now() + Duration::from_secs_f64(secs)));
        let now_unix = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let _ = hold.tx.send(HeldReport { kv, expiry_unix: now_unix + secs });
    }

    fn deliver(&mut self, outs: Vec<TokenOutput>) {
        let now = Instant::now();
        let n = outs.len() as u64;
        let mut gone = Vec::new();
        for out in outs {
            let m = &self.handle.metrics;
            let Some(l) = self.live.get_mut(&out.id) else { continue };
            m.generation_tokens.add(1);
            if out.first {
                m.ttft.observe(now.duration_since(l.arrival).as_secs_f64());
                m.count_prompt(&out);
            } else {
                m.itl.observe(now.duration_since(l.last).as_secs_f64());
            }
            l.last = now;
            if let Some(reason) = out.finish {
                m.e2e.observe(now.duration_since(l.arrival).as_secs_f64());
                match reason {
                    FinishReason::Stop => m.success_stop.add(1),
                    FinishReason::Length => m.success_length.add(1),
                    FinishReason::Error => m.success_error.add(1),
                    FinishReason::Abort => {}
                }
            }
            let hold = if out.finish.is_some() { l.hold.take() } else { None };
            let sent = l.tx.send(Delivery { choice: l.choice, out }).is_ok();
            if let Some(h) = hold {
                self.lease(out.id, h);
            }
            if out.finish.is_some() {
                self.live.remove(&out.id);
                self.handle.in_flight.fetch_sub(1, Ordering::Relaxed);
            } else if !sent {
                gone.push(out.id);
            }
        }
        for id in gone {
            self.abort(id);
        }
        self.params.faults.on_tokens(n);
    }

    fn flush_events(&mut self) {
        let events = self.sched.take_events();
        if events.is_empty() {
            return;
        }
        let Some(p) = &self.handle.publisher else { return };
        let ts = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        if p.publish((ts, events)) {
            self.handle.metrics.event_batches.add(1);
        } else {
            self.handle.metrics.event_batches_dropped.add(1);
        }
    }

    fn refresh_gauges(&self) {
        let m = &self.handle.metrics;
        m.running.set(self.sched.num_running() as f64);
        m.waiting.set(self.sched.num_waiting() as f64);
        m.kv_usage.set(self.sched.kv_usage());
        m.held_requests.set(self.sched.num_held() as f64);
        let c = self.sched.counters();
        m.prefix_queries.store(c.prefix_cache_queries);
        m.prefix_hits.store(c.prefix_cache_hits);
        m.preemptions.store(c.preemptions);
    }
}
