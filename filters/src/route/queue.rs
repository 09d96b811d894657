//! The router queue: when every worker is past `queue_threshold` of its prefill capacity,
//! requests wait here instead of piling onto workers, and are released one by one as capacity
//! frees (the caller re-checks load and calls [`RouterQueue::release`]).
//!
//! Order, in three levels:
//! - **bands**: a request's tenant's `priority`; a higher band is always served first, and a
//!   full queue makes room for an arrival by shedding a waiter of a lower band (the newest of
//!   the most-served tenant there);
//! - **tenants** within a band: the one with the smallest Virtual Token Counter
//!   ([`FairShare`]) goes first, so backlogged tenants are served tokens in proportion to their
//!   weights whatever rate each sends at; without tenants every request is in one flow;
//! - **requests** of one tenant (Dynamo's FCFS with a priority jump): `key = priority_jump −
//!   arrival_seconds`, so a request with `priority_jump = N` is served as if it had arrived N
//!   seconds earlier. The jump comes from `nvext.agent_hints.priority` (≥ 0), else
//!   `latency_sensitivity`.
//!
//! Bounded: a full queue makes room for an arrival by shedding the newest request of a lower
//! band, else of a tenant of its own band that has been served more than the arrival's, and
//! otherwise refuses it at once; a request waiting past its ticket's `max_wait` gives up.

use crate::tenant::FairShare;
use parking_lot::Mutex;
use std::cmp::Ordering as CmpOrdering;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueError {
    /// The queue holds `max_len` requests already, none of a lower band.
    Full,
    /// The request waited its `max_wait` without being released.
    TimedOut,
    /// A request of a higher band took its place in a full queue.
    Shed,
}

/// How a request waits.
#[derive(Debug, Clone)]
pub struct Ticket {
    /// Seconds of head start among its tenant's requests.
    pub priority_jump: f64,
    /// Its tenant's priority band (higher first).
    pub band: u8,
    /// Its tenant's share; `None` waits in the one flow of requests without a tenant.
    pub share: Option<Arc<FairShare>>,
    /// The longest it waits.
    pub max_wait: Duration,
}

struct Entry {
    key: f64,
    seq: u64,
    tx: oneshot::Sender<Result<(), QueueError>>,
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

/// One tenant's requests in one band.
struct Flow {
    share: Option<Arc<FairShare>>,
    /// What VTC's lift added to the tenant's counter in this queue.
    lift: f64,
    /// Its requests actually waiting.
    live: Arc<AtomicUsize>,
    heap: BinaryHeap<Entry>,
}

impl Flow {
    fn counter(&self) -> f64 {
        self.share.as_ref().map_or(0.0, |s| s.virtual_tokens()) + self.lift
    }

    fn is(&self, share: Option<&Arc<FairShare>>) -> bool {
        match (&self.share, share) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        }
    }

    fn waiting(&self) -> bool {
        self.live.load(Ordering::Relaxed) > 0
    }

    /// Pops its next request still waiting and releases it with `r`.
    fn send_next(&mut self, r: Result<(), QueueError>) -> bool {
        while let Some(e) = self.heap.pop() {
            if e.tx.send(r).is_ok() {
                return true;
            }
        }
        false
    }

    /// Sheds its newest waiting request.
    fn shed_newest(&mut self) -> bool {
        let mut entries = std::mem::take(&mut self.heap).into_sorted_vec();
        let mut shed = false;
        // Sorted ascending: the lowest key (the newest, least favoured) first.
        while !entries.is_empty() && !shed {
            shed = entries.remove(0).tx.send(Err(QueueError::Shed)).is_ok();
        }
        self.heap = entries.into();
        shed
    }
}

/// One model's queue.
pub struct RouterQueue {
    bands: Mutex<BTreeMap<u8, Vec<Flow>>>,
    epoch: Instant,
    seq: AtomicU64,
    /// Requests actually waiting (abandoned heap entries excluded).
    waiting: Arc<AtomicUsize>,
    /// Set when the queue is replaced: later arrivals pass straight through.
    closed: AtomicBool,
    max_len: usize,
    /// Tokens of head start a tenant that starts waiting again keeps over those already waiting.
    credit: f64,
}

impl RouterQueue {
    /// A queue holding at most `max_len` requests, where a tenant that starts waiting again is
    /// lifted to `credit` tokens below the least-served tenant waiting (VTC's lift, less a
    /// bounded head start: a light tenant's burst of up to `credit` tokens goes before a
    /// flooding one's backlog, and idle time earns no more than that).
    pub fn new(max_len: usize, credit: f64) -> Self {
        Self {
            bands: Mutex::new(BTreeMap::new()),
            epoch: Instant::now(),
            seq: Default::default(),
            waiting: Default::default(),
            closed: Default::default(),
            max_len,
            credit: credit.max(0.0),
        }
    }

    /// Requests waiting (not counting ones that gave up or whose client left).
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits until released. Dropping the future (client gone) abandons the place.
    pub async fn wait(&self, t: Ticket) -> Result<Duration, QueueError> {
        let start = Instant::now();
        let (tx, rx) = oneshot::channel();
        let _waiting = {
            let mut bands = self.bands.lock();
            if self.closed.load(Ordering::Acquire) {
                return Ok(Duration::ZERO);
            }
            if self.len() >= self.max_len && !shed_below(&mut bands, t.band) && !shed_heavier(&mut bands, t.band, t.share.as_ref()) {
                return Err(QueueError::Full);
            }
            let flows = bands.entry(t.band).or_default();
            let i = join(flows, t.share.as_ref(), self.credit);
            let flow = &mut flows[i];
            // Abandoned entries are dropped once they are as many as the queue may hold.
            if flow.heap.len() >= self.max_len {
                let live: Vec<Entry> = flow.heap.drain().filter(|e| !e.tx.is_closed()).collect();
                flow.heap = live.into();
            }
            let key = t.priority_jump.max(0.0) - self.epoch.elapsed().as_secs_f64();
            flow.heap.push(Entry { key, seq: self.seq.fetch_add(1, Ordering::Relaxed), tx });
            (Waiting::new(self.waiting.clone()), Waiting::new(flow.live.clone()))
        };
        match tokio::time::timeout(t.max_wait, rx).await {
            Ok(Ok(Ok(()))) => Ok(start.elapsed()),
            Ok(Ok(Err(e))) => Err(e),
            _ => Err(QueueError::TimedOut),
        }
    }

    /// Each flow of band `band` that has requests waiting: its tenant's counter as the queue
    /// orders by it (lift included), how many of its requests wait, and whether it is `share`'s.
    pub fn standing(&self, band: u8, share: Option<&Arc<FairShare>>) -> Vec<(f64, usize, bool)> {
        let bands = self.bands.lock();
        let Some(flows) = bands.get(&band) else { return Vec::new() };
        flows.iter().filter(|f| f.waiting() || f.is(share)).map(|f| (f.counter(), f.live.load(Ordering::Relaxed), f.is(share))).collect()
    }

    /// Releases everybody and lets later arrivals through (the queue is being replaced).
    pub fn release_all(&self) {
        let mut bands = self.bands.lock();
        self.closed.store(true, Ordering::Release);
        for flow in bands.values_mut().flatten() {
            while flow.send_next(Ok(())) {}
        }
    }

    /// Releases the next waiting request: the highest band's least-served tenant's first.
    /// Returns false when nobody was waiting.
    pub fn release(&self) -> bool {
        let mut bands = self.bands.lock();
        for flows in bands.values_mut().rev() {
            loop {
                // Among equal counters (a tenant lifted to another's), the lighter backlog first.
                let next = flows
                    .iter_mut()
                    .filter(|f| f.waiting() && !f.heap.is_empty())
                    .min_by(|a, b| a.counter().total_cmp(&b.counter()).then(a.live.load(Ordering::Relaxed).cmp(&b.live.load(Ordering::Relaxed))));
                let Some(flow) = next else { break };
                if flow.send_next(Ok(())) {
                    return true;
                }
            }
        }
        false
    }
}

/// The flow of `share` among `flows` (made when new). A tenant that starts waiting is lifted
/// to `credit` below the smallest counter of those already waiting (VTC's lift, with a bounded
/// head start).
fn join(flows: &mut Vec<Flow>, share: Option<&Arc<FairShare>>, credit: f64) -> usize {
    let i = match flows.iter().position(|f| f.is(share)) {
        Some(i) => i,
        None => {
            flows.push(Flow { share: share.cloned(), lift: 0.0, live: Default::default(), heap: BinaryHeap::new() });
            flows.len() - 1
        }
    };
    if !flows[i].waiting() {
        let least = flows.iter().filter(|f| f.waiting()).map(Flow::counter).min_by(f64::total_cmp);
        if let Some(floor) = least.map(|l| l - credit) {
            let own = flows[i].counter();
            if floor > own {
                flows[i].lift += floor - own;
            }
        }
    }
    i
}

/// Sheds one waiter of the lowest band below `band` that has any (the newest request of its
/// most-served tenant). False when there is none.
fn shed_below(bands: &mut BTreeMap<u8, Vec<Flow>>, band: u8) -> bool {
    for (_, flows) in bands.range_mut(..band) {
        let mut order: Vec<usize> = (0..flows.len()).filter(|&i| flows[i].waiting()).collect();
        order.sort_by(|&a, &b| flows[b].counter().total_cmp(&flows[a].counter()));
        if order.into_iter().any(|i| flows[i].shed_newest()) {
            return true;
        }
    }
    false
}

/// Sheds the newest waiter of the most-served tenant of `band` when it has been served more
/// than the arriving tenant (`share`): a full queue keeps the requests of those who got least.
/// False when the arriving tenant is the most served.
fn shed_heavier(bands: &mut BTreeMap<u8, Vec<Flow>>, band: u8, share: Option<&Arc<FairShare>>) -> bool {
    let Some(flows) = bands.get_mut(&band) else { return false };
    // The arrival's counter as it stands, before any lift: what it has actually been served.
    let mine = flows.iter().find(|f| f.is(share)).map_or_else(|| share.map_or(0.0, |s| s.virtual_tokens()), Flow::counter);
    let heaviest = flows.iter_mut().filter(|f| f.waiting() && !f.is(share)).max_by(|a, b| a.counter().total_cmp(&b.counter()));
    heaviest.is_some_and(|f| f.counter() > mine && f.shed_newest())
}

/// Counts a waiter while it waits, whatever way it stops waiting.
struct Waiting(Arc<AtomicUsize>);

impl Waiting {
    fn new(c: Arc<AtomicUsize>) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        Self(c)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn ticket(jump: f64) -> Ticket {
        Ticket { priority_jump: jump, band: 0, share: None, max_wait: Duration::from_secs(5) }
    }

    /// Waits for `n` releases to land (each released waiter pushes its name).
    async fn release_each(q: &RouterQueue, order: &Mutex<Vec<String>>, n: usize) {
        for k in 1..=n {
            assert!(q.release());
            while order.lock().len() < k {
                tokio::task::yield_now().await;
            }
        }
    }

    /// Queues `name`; it pushes its name once its wait ends.
    fn enqueue(q: &Arc<RouterQueue>, order: &Arc<Mutex<Vec<String>>>, name: &str, t: Ticket) -> tokio::task::JoinHandle<Result<Duration, QueueError>> {
        let (q, order, name) = (q.clone(), order.clone(), name.to_string());
        tokio::spawn(async move {
            let r = q.wait(t).await;
            order.lock().push(name);
            r
        })
    }

    async fn settle(q: &RouterQueue, n: usize) {
        while q.len() < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn higher_priority_overtakes_and_bounds_hold() {
        let q = Arc::new(RouterQueue::new(3, 0.0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (i, (name, jump)) in [("low1", 0.0), ("low2", 0.0), ("high", 10.0)].into_iter().enumerate() {
            tasks.push(enqueue(&q, &order, name, ticket(jump)));
            settle(&q, i + 1).await;
        }
        assert_eq!(q.wait(ticket(0.0)).await, Err(QueueError::Full));
        release_each(&q, &order, 3).await;
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert_eq!(*order.lock(), vec!["high", "low1", "low2"]);
        assert!(!q.release());
    }

    #[tokio::test]
    async fn waits_are_bounded_and_abandoned_places_are_skipped() {
        let q = Arc::new(RouterQueue::new(8, 0.0));
        let short = Ticket { max_wait: Duration::from_millis(20), ..ticket(0.0) };
        assert_eq!(q.wait(short).await, Err(QueueError::TimedOut));
        let q2 = q.clone();
        let gone = tokio::spawn(async move { q2.wait(ticket(0.0)).await });
        settle(&q, 1).await;
        gone.abort();
        let _ = gone.await;
        assert_eq!(q.len(), 0, "abandoned places do not count");
        assert!(!q.release(), "the abandoned and the timed-out places are skipped");
    }

    #[tokio::test]
    async fn tenants_are_served_by_their_counters_and_a_newcomer_is_lifted_not_credited() {
        let q = Arc::new(RouterQueue::new(16, 0.0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let (a, b) = (Arc::new(FairShare::new(1.0)), Arc::new(FairShare::new(1.0)));
        // A has been served 1,000 tokens while B was idle.
        a.serve(1_000);
        let t = |s: &Arc<FairShare>| Ticket { share: Some(s.clone()), ..ticket(0.0) };
        let mut tasks = vec![enqueue(&q, &order, "a1", t(&a))];
        settle(&q, 1).await;
        tasks.push(enqueue(&q, &order, "b1", t(&b)));
        settle(&q, 2).await;
        tasks.push(enqueue(&q, &order, "b2", t(&b)));
        settle(&q, 3).await;
        // B was lifted to A's counter on arrival: a tie, which the first flow (A) wins; then
        // A has been served more and B goes next.
        release_each(&q, &order, 1).await;
        a.serve(100);
        release_each(&q, &order, 2).await;
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert_eq!(*order.lock(), vec!["a1", "b1", "b2"]);
    }

    #[tokio::test]
    async fn a_tenant_back_from_idle_keeps_only_its_credit_as_a_head_start() {
        let q = Arc::new(RouterQueue::new(16, 500.0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let (a, b) = (Arc::new(FairShare::new(1.0)), Arc::new(FairShare::new(1.0)));
        a.serve(10_000);
        let t = |s: &Arc<FairShare>| Ticket { share: Some(s.clone()), ..ticket(0.0) };
        let a1 = enqueue(&q, &order, "a1", t(&a));
        settle(&q, 1).await;
        // B was idle while A was served 10,000 tokens: it is lifted to 9,500, not left at 0.
        let b1 = enqueue(&q, &order, "b1", t(&b));
        settle(&q, 2).await;
        let standing = q.standing(0, Some(&b));
        assert!(standing.iter().any(|&(c, _, own)| own && (c - 9_500.0).abs() < 1e-9), "{standing:?}");
        release_each(&q, &order, 1).await;
        assert_eq!(order.lock()[0], "b1", "inside its credit, B goes first");
        // B is served 600 tokens: past A's counter now, so A goes next.
        b.serve(600);
        let b3 = enqueue(&q, &order, "b3", t(&b));
        settle(&q, 2).await;
        release_each(&q, &order, 2).await;
        assert_eq!(order.lock()[1], "a1");
        for h in [a1, b1, b3] {
            h.await.unwrap().unwrap();
        }
    }

    #[tokio::test]
    async fn a_full_queue_sheds_the_most_served_tenant_for_one_served_less() {
        let q = Arc::new(RouterQueue::new(2, 0.0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let (heavy, light) = (Arc::new(FairShare::new(1.0)), Arc::new(FairShare::new(1.0)));
        let t = |s: &Arc<FairShare>| Ticket { share: Some(s.clone()), ..ticket(0.0) };
        let h1 = enqueue(&q, &order, "h1", t(&heavy));
        settle(&q, 1).await;
        let h2 = enqueue(&q, &order, "h2", t(&heavy));
        settle(&q, 2).await;
        // The heavy tenant is served while its requests wait; the light one arrives to a full
        // queue and takes the place of its newest.
        heavy.serve(5_000);
        assert_eq!(q.wait(t(&heavy)).await, Err(QueueError::Full), "the most served is refused, not shed for itself");
        let l1 = enqueue(&q, &order, "l1", t(&light));
        assert_eq!(h2.await.unwrap(), Err(QueueError::Shed));
        settle(&q, 2).await;
        assert!(q.release() && q.release());
        l1.await.unwrap().unwrap();
        h1.await.unwrap().unwrap();
        assert_eq!(order.lock()[0], "h2");
    }

    #[tokio::test]
    async fn a_higher_band_goes_first_and_sheds_a_lower_one_from_a_full_queue() {
        let q = Arc::new(RouterQueue::new(2, 0.0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let low1 = enqueue(&q, &order, "low1", ticket(0.0));
        settle(&q, 1).await;
        let low2 = enqueue(&q, &order, "low2", ticket(0.0));
        settle(&q, 2).await;
        let high = enqueue(&q, &order, "high", Ticket { band: 1, ..ticket(0.0) });
        assert_eq!(low2.await.unwrap(), Err(QueueError::Shed), "the newest low request made room");
        settle(&q, 2).await;
        assert_eq!(q.wait(ticket(0.0)).await, Err(QueueError::Full), "nothing below the lowest band to shed");
        assert!(q.release());
        high.await.unwrap().unwrap();
        assert!(q.release());
        low1.await.unwrap().unwrap();
        let order = order.lock().clone();
        assert_eq!(order, ["low2", "high", "low1"]);
    }
}
