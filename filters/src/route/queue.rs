//! The router queue: when every worker is past `queue_threshold` of its prefill capacity,
//! requests wait here instead of piling onto workers, and are released one by one, highest key
//! first, as capacity frees (the caller re-checks load and calls [`RouterQueue::release`]).
//!
//! Order (Dynamo's FCFS with a priority jump): `key = priority_jump − arrival_seconds`, so a
//! request with `priority_jump = N` is served as if it had arrived N seconds earlier. The
//! jump comes from `nvext.agent_hints.priority` (≥ 0), else `latency_sensitivity`.
//! Bounded: a full queue refuses at once, and a request waiting past `max_wait` gives up.

use parking_lot::Mutex;
use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueError {
    /// The queue holds `max_len` requests already.
    Full,
    /// The request waited `max_wait` without being released.
    TimedOut,
}

struct Entry {
    key: f64,
    seq: u64,
    tx: oneshot::Sender<()>,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == CmpOrdering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> CmpOrdering {
        // Higher key first; among equal keys, the earlier arrival.
        self.key.total_cmp(&o.key).then(o.seq.cmp(&self.seq))
    }
}

/// One model's queue.
pub struct RouterQueue {
    heap: Mutex<BinaryHeap<Entry>>,
    epoch: Instant,
    seq: std::sync::atomic::AtomicU64,
    /// Requests actually waiting (abandoned heap entries excluded).
    waiting: Arc<std::sync::atomic::AtomicUsize>,
    /// Set when the queue is replaced: later arrivals pass straight through.
    closed: std::sync::atomic::AtomicBool,
    max_len: usize,
    max_wait: Duration,
}

impl RouterQueue {
    /// A queue holding at most `max_len` requests, each for at most `max_wait`.
    pub fn new(max_len: usize, max_wait: Duration) -> Self {
        Self {
            heap: Mutex::new(BinaryHeap::new()),
            epoch: Instant::now(),
            seq: Default::default(),
            waiting: Default::default(),
            closed: Default::default(),
            max_len,
            max_wait,
        }
    }

    /// Requests waiting (not counting ones that gave up or whose client left).
    pub fn len(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits until released. Dropping the future (client gone) abandons the place.
    pub async fn wait(&self, priority_jump: f64) -> Result<Duration, QueueError> {
        let start = Instant::now();
        let (tx, rx) = oneshot::channel();
        let _waiting = {
            let mut h = self.heap.lock();
            if self.closed.load(std::sync::atomic::Ordering::Acquire) {
                return Ok(Duration::ZERO);
            }
            if self.len() >= self.max_len {
                return Err(QueueError::Full);
            }
            // Drop abandoned entries first if they are the ones filling the heap.
            if h.len() >= self.max_len {
                let live: Vec<Entry> = h.drain().filter(|e| !e.tx.is_closed()).collect();
                *h = live.into();
            }
            let key = priority_jump.max(0.0) - self.epoch.elapsed().as_secs_f64();
            h.push(Entry { key, seq: self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed), tx });
            Waiting::new(self.waiting.clone())
        };
        match tokio::time::timeout(self.max_wait, rx).await {
            Ok(Ok(())) => Ok(start.elapsed()),
            _ => Err(QueueError::TimedOut),
        }
    }

    /// Releases everybody and lets later arrivals through (the queue is being replaced).
    pub fn release_all(&self) {
        let mut h = self.heap.lock();
        self.closed.store(true, std::sync::atomic::Ordering::Release);
        while let Some(e) = h.pop() {
            let _ = e.tx.send(());
        }
    }

    /// Releases the highest-keyed waiting request (skipping abandoned ones). Returns false when
    /// nobody was waiting.
    pub fn release(&self) -> bool {
        let mut h = self.heap.lock();
        while let Some(e) = h.pop() {
            if e.tx.send(()).is_ok() {
                return true;
            }
        }
        false
    }
}

/// Counts a waiter while it waits, whatever way it stops waiting.
struct Waiting(Arc<std::sync::atomic::AtomicUsize>);

impl Waiting {
    fn new(c: Arc<std::sync::atomic::AtomicUsize>) -> Self {
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self(c)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn higher_priority_overtakes_and_bounds_hold() {
        let q = Arc::new(RouterQueue::new(3, Duration::from_secs(5)));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, jump) in [("low1", 0.0), ("low2", 0.0), ("high", 10.0)] {
            let (q, order) = (q.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                q.wait(jump).await.unwrap();
                order.lock().push(name);
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(q.wait(0.0).await, Err(QueueError::Full));
        for _ in 0..3 {
            assert!(q.release());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock(), vec!["high", "low1", "low2"]);
        assert!(!q.release());
    }

    #[tokio::test]
    async fn waits_are_bounded_and_abandoned_places_are_skipped() {
        let q = Arc::new(RouterQueue::new(8, Duration::from_millis(50)));
        assert_eq!(q.wait(0.0).await, Err(QueueError::TimedOut));
        let q2 = q.clone();
        let gone = tokio::spawn(async move { q2.wait(0.0).await });
        tokio::time::sleep(Duration::from_millis(5)).await;
        gone.abort();
        let _ = gone.await;
        assert_eq!(q.len(), 0, "abandoned places do not count");
        assert!(!q.release(), "the abandoned and the timed-out places are skipped");
    }
}
