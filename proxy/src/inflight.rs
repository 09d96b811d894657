//! The in-flight registry: every model-scoped request (inference, tokenize, detokenize) past
//! admission, by request id, with what
//! the rescheduling WIT world's `running` record needs (worker, tokens so far, phase, age,
//! priority), its cancellation context (so code outside the request's task can act on it),
//! and its route receipt. A bounded number of finished requests is kept for
//! `GET /requests/{id}`.
//!
//! An entry is registered by [`RequestRegistry::register`] and removed when the returned
//! [`Registered`] guard drops: on success, error, cancellation or a panic alike.

use crate::fleet::Worker;
use crate::move_order::Mailbox;
use crate::receipt::RouteReceipt;
use kvgate_filters::cancel::RequestContext;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

/// Finished requests kept for `GET /requests/{id}`.
pub const FINISHED_KEPT: usize = 1024;

/// Shards of the live map, so requests on different threads rarely share a lock.
const SHARDS: usize = 16;

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Held in the router queue.
    Queued = 0,
    /// Sent to a worker, no token yet (Llumnix's "waiting").
    Waiting = 1,
    /// Streaming tokens from its worker (Llumnix's "running").
    Running = 2,
    /// Done (only seen in the finished list).
    Finished = 3,
}

impl Phase {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Queued,
            1 => Self::Waiting,
            2 => Self::Running,
            _ => Self::Finished,
        }
    }

    /// Name for the admin API.
    pub fn name(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Waiting => "waiting",
            Self::Running => "running",
            Self::Finished => "finished",
        }
    }
}

/// One request as the rest of the gateway sees it.
pub struct RequestEntry {
    /// The model it addressed.
    pub model: Arc<str>,
    /// Endpoint label (`chat_completions`, `completions`).
    pub endpoint: &'static str,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// Router-queue priority jump in seconds (`nvext.agent_hints.priority`).
    pub priority: f64,
    /// When it arrived.
    pub started: Instant,
    /// Its cancellation context.
    pub ctx: Arc<RequestContext>,
    phase: AtomicU8,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    status: AtomicU64,
    finished_after_us: AtomicU64,
    worker: Mutex<Option<Arc<Worker>>>,
    /// Every placement decision taken for it.
    pub receipt: Mutex<RouteReceipt>,
    /// Orders to move it to another worker.
    pub mailbox: Mailbox,
    pinned: Mutex<Option<&'static str>>,
    moves: AtomicU64,
}

impl RequestEntry {
    /// A new entry in the queued phase, for a request that arrived at `started`.
    pub fn new(model: Arc<str>, endpoint: &'static str, stream: bool, priority: f64, ctx: Arc<RequestContext>, started: Instant) -> Self {
        Self {
            model,
            endpoint,
            stream,
            priority,
            started,
            ctx,
            phase: AtomicU8::new(Phase::Queued as u8),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            status: AtomicU64::new(0),
            finished_after_us: AtomicU64::new(0),
            worker: Mutex::new(None),
            receipt: Mutex::new(RouteReceipt::default()),
            mailbox: Mailbox::default(),
            pinned: Mutex::new(None),
            moves: AtomicU64::new(0),
        }
    }

    /// Request id (the client's `X-Request-Id` or a generated one): its cancellation
    /// context's.
    pub fn id(&self) -> &str {
        self.ctx.id()
    }

    /// Why it cannot move to another worker (a `PinReason` label), if it cannot.
    pub fn pinned(&self) -> Option<&'static str> {
        *self.pinned.lock()
    }

    /// It cannot move, for `reason`.
    pub fn pin(&self, reason: &'static str) {
        *self.pinned.lock() = Some(reason);
    }

    /// Moves done so far (continuations and resends).
    pub fn moves(&self) -> u64 {
        self.moves.load(Ordering::Relaxed)
    }

    /// One more move.
    pub fn moved(&self) {
        self.moves.fetch_add(1, Ordering::Relaxed);
    }

    /// Its phase now.
    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Relaxed))
    }

    /// Moves it to `p`.
    pub fn set_phase(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::Relaxed);
    }

    /// It was sent to `w`, with a prompt of `prompt_tokens` tokens (0 when not tokenized).
    pub fn placed(&self, w: &Arc<Worker>, prompt_tokens: u64) {
        *self.worker.lock() = Some(w.clone());
        self.prompt_tokens.store(prompt_tokens, Ordering::Relaxed);
        self.set_phase(Phase::Waiting);
    }

    /// The worker serving it now.
    pub fn worker(&self) -> Option<Arc<Worker>> {
        self.worker.lock().clone()
    }

    /// `n` more tokens were streamed to the client.
    pub fn generated(&self, n: u64) {
        self.generated_tokens.fetch_add(n, Ordering::Relaxed);
    }

    /// Prompt plus generated tokens so far.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens.load(Ordering::Relaxed) + self.generated_tokens.load(Ordering::Relaxed)
    }

    /// Tokens generated so far.
    pub fn generated_tokens(&self) -> u64 {
        self.generated_tokens.load(Ordering::Relaxed)
    }

    /// Final HTTP status (499 for a client that left), once finished.
    pub fn status(&self) -> Option<u16> {
        match self.status.load(Ordering::Relaxed) {
            0 => None,
            s => Some(s as u16),
        }
    }

    /// Time since arrival, or its whole duration once finished.
    pub fn age(&self) -> std::time::Duration {
        match self.finished_after_us.load(Ordering::Relaxed) {
            0 => self.started.elapsed(),
            us => std::time::Duration::from_micros(us),
        }
    }

    /// The admin API's view: what the rescheduling world's `running` record holds, and more.
    pub fn to_json(&self, with_receipt: bool) -> serde_json::Value {
        // The wall-clock arrival, worked out here from the monotonic one: the admin API is the
        // only reader, and a second clock read per request is not free.
        let started_at = SystemTime::now().checked_sub(self.started.elapsed()).unwrap_or(SystemTime::UNIX_EPOCH);
        let since_epoch = started_at.duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let mut v = serde_json::json!({
            "id": self.id(), "model": &*self.model, "endpoint": self.endpoint, "stream": self.stream,
            "phase": self.phase().name(), "worker": self.worker().map(|w| w.label.clone()),
            "tokens": self.tokens(), "generated_tokens": self.generated_tokens(),
            "age_ms": self.age().as_millis() as u64, "priority": self.priority, "started_at": since_epoch,
            "status": self.status(), "moves": self.moves(), "pinned": self.pinned(),
        });
        if with_receipt {
            let r = self.receipt.lock();
            v["route_receipt"] = r.to_json();
            if let Some(t) = &r.tenant {
                v["tenant"] = t.as_str().into();
            }
            if let Some(q) = &r.queued {
                v["queue"] = q.to_json();
            }
        }
        v
    }

    fn finish(&self, status: u16, took: Duration) {
        self.status.store(u64::from(status), Ordering::Relaxed);
        self.finished_after_us.store((took.as_micros() as u64).max(1), Ordering::Relaxed);
        self.set_phase(Phase::Finished);
    }
}

/// One shard of the live map: registration key → entry.
type Shard = Mutex<HashMap<u64, Arc<RequestEntry>, kvgate_kv::hash::BuildIdHasher>>;

/// Every request in flight, and the last [`FINISHED_KEPT`] finished ones.
pub struct RequestRegistry {
    shards: Box<[Shard]>,
    next: AtomicU64,
    finished: Mutex<VecDeque<Arc<RequestEntry>>>,
    keep: usize,
}

impl Default for RequestRegistry {
    fn default() -> Self {
        Self::with_capacity(FINISHED_KEPT)
    }
}

impl RequestRegistry {
    /// A registry keeping `keep` finished requests.
    pub fn with_capacity(keep: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::default())).collect(),
            next: AtomicU64::new(0),
            finished: Mutex::new(VecDeque::with_capacity(keep)),
            keep,
        }
    }

    /// Registers `entry` until the guard drops.
    pub fn register(self: &Arc<Self>, entry: RequestEntry) -> Registered {
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(entry);
        self.shards[key as usize % SHARDS].lock().insert(key, entry.clone());
        Registered { registry: self.clone(), key, entry, ended: None }
    }

    /// Requests in flight.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether none is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every request in flight, oldest first.
    pub fn snapshot(&self) -> Vec<Arc<RequestEntry>> {
        let mut all: Vec<Arc<RequestEntry>> = self.shards.iter().flat_map(|s| s.lock().values().cloned().collect::<Vec<_>>()).collect();
        all.sort_by_key(|e| e.started);
        all
    }

    /// A request by id: in flight first, else the newest finished one with that id.
    pub fn find(&self, id: &str) -> Option<Arc<RequestEntry>> {
        let live = self.shards.iter().find_map(|s| s.lock().values().find(|e| e.id() == id).cloned());
        live.or_else(|| self.finished.lock().iter().rev().find(|e| e.id() == id).cloned())
    }

    /// Finished requests kept, oldest first.
    pub fn finished(&self) -> Vec<Arc<RequestEntry>> {
        self.finished.lock().iter().cloned().collect()
    }

    fn remove(&self, key: u64, entry: &Arc<RequestEntry>) {
        self.shards[key as usize % SHARDS].lock().remove(&key);
        if self.keep == 0 {
            return;
        }
        let evicted = {
            let mut f = self.finished.lock();
            let evicted = if f.len() == self.keep { f.pop_front() } else { None };
            f.push_back(entry.clone());
            evicted
        };
        // Dropped outside the lock: the last reference frees the entry's receipt and context,
        // often allocated by another thread, while another thread may be waiting to finish.
        drop(evicted);
    }
}

/// A request's registration; dropping it moves the entry to the finished list.
pub struct Registered {
    registry: Arc<RequestRegistry>,
    key: u64,
    entry: Arc<RequestEntry>,
    /// The final status and how long the request took, once recorded.
    ended: Option<(u16, Duration)>,
}

impl Registered {
    /// The entry.
    pub fn entry(&self) -> &Arc<RequestEntry> {
        &self.entry
    }

    /// The final status, and how long the request took since it arrived, to record when the
    /// guard drops (500 and the time until the drop if never set: a panic).
    pub fn set_status(&mut self, status: u16, took: Duration) {
        self.ended = Some((status, took));
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.entry.mailbox.close();
        let (status, took) = self.ended.unwrap_or_else(|| (500, self.entry.started.elapsed()));
        self.entry.finish(status, took);
        self.registry.remove(self.key, &self.entry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str) -> RequestEntry {
        RequestEntry::new("m".into(), "completions", true, 0.0, RequestContext::new(id), Instant::now())
    }

    #[test]
    fn entries_leave_on_drop_and_are_kept_finished() {
        let r = Arc::new(RequestRegistry::with_capacity(2));
        let mut a = r.register(entry("a"));
        let b = r.register(entry("b"));
        assert_eq!(r.len(), 2);
        assert_eq!(r.find("a").unwrap().phase(), Phase::Queued);
        a.set_status(200, Duration::from_millis(1));
        drop(a);
        assert_eq!(r.len(), 1);
        let done = r.find("a").unwrap();
        assert_eq!((done.phase(), done.status()), (Phase::Finished, Some(200)));
        drop(b);
        drop(r.register(entry("c")));
        assert!(r.is_empty());
        let kept: Vec<String> = r.finished().iter().map(|e| e.id().to_string()).collect();
        assert_eq!(kept, ["b", "c"], "bounded: the oldest finished entry goes");
        assert!(r.find("a").is_none());
    }

    #[test]
    fn a_panic_unregisters_the_request() {
        let r = Arc::new(RequestRegistry::default());
        let r2 = r.clone();
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let g = r2.register(entry("p"));
            g.entry().set_phase(Phase::Running);
            panic!("request task failed");
        }));
        assert!(res.is_err());
        assert!(r.is_empty());
        assert_eq!(r.find("p").unwrap().status(), Some(500));
    }

    #[test]
    fn tokens_so_far_add_prompt_and_output() {
        let r = Arc::new(RequestRegistry::default());
        let g = r.register(entry("t"));
        let w = Arc::new(Worker::new(crate::config::UpstreamUrl::parse("http://127.0.0.1:1").unwrap()));
        g.entry().placed(&w, 100);
        g.entry().generated(3);
        g.entry().generated(2);
        assert_eq!((g.entry().tokens(), g.entry().phase()), (105, Phase::Waiting));
        assert!(Arc::ptr_eq(&g.entry().worker().unwrap(), &w));
    }
}
