//! Approximate mode, as Dynamo's KV router has it, for workers that publish no KV events: the
//! router records its own routing decisions as if the chosen worker had cached the request's
//! blocks, and forgets them after a TTL (default 120 s). When the index grows past
//! `max_tree_size` blocks (default 2^20) it is pruned to `prune_target_ratio × max_tree_size`
//! (default 0.8), earliest-expiring first and, among equal expiries, deepest first (a prefix
//! outlives its continuations).
//!
//! Built on the [`ReferenceTree`]; a min-heap of expiries is lazily cleaned (stale entries are
//! skipped when popped; the heap is rebuilt when it grows 50× past the live entries).

use crate::hash::BlockHash;
use crate::index::{KvIndex, Matches, ReferenceTree, WorkerId};
use parking_lot::Mutex;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant};

/// Approximate-mode limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ApproxConfig {
    /// How long a recorded decision is believed.
    pub ttl: Duration,
    /// Most blocks (worker × block) kept before pruning.
    pub max_tree_size: usize,
    /// Pruning target as a fraction of `max_tree_size`.
    pub prune_target_ratio: f64,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self { ttl: Duration::from_secs(120), max_tree_size: 1 << 20, prune_target_ratio: 0.8 }
    }
}

type Entry = Reverse<(Instant, Reverse<u32>, WorkerId, BlockHash)>;

#[derive(Default)]
struct Expiries {
    due: HashMap<(WorkerId, BlockHash), Instant>,
    heap: BinaryHeap<Entry>,
}

/// An index fed by routing decisions.
pub struct ApproxIndex {
    tree: ReferenceTree,
    exp: Mutex<Expiries>,
    cfg: ApproxConfig,
}

impl ApproxIndex {
    /// An empty index.
    pub fn new(cfg: ApproxConfig) -> Self {
        Self { tree: ReferenceTree::new(), exp: Mutex::new(Expiries::default()), cfg }
    }

    /// Records that `worker` was chosen for a request with block `chain`, at `now`.
    pub fn record(&self, worker: WorkerId, chain: &[BlockHash], now: Instant) {
        let mut exp = self.exp.lock();
        self.expire_locked(&mut exp, now);
        let have = self.tree.find_matches(chain).get(worker) as usize;
        if have < chain.len() {
            let parent = have.checked_sub(1).map(|i| chain[i]);
            // Cannot fail: the parent is held (it is within the matched prefix).
            let _ = self.tree.insert(worker, parent, &chain[have..]);
        }
        let due = now + self.cfg.ttl;
        for (depth, &b) in chain.iter().enumerate() {
            exp.due.insert((worker, b), due);
            exp.heap.push(Reverse((due, Reverse(depth as u32), worker, b)));
        }
        if exp.due.len() > self.cfg.max_tree_size {
            #[allow(clippy::cast_sign_loss, reason = "a size times a ratio of it (0.8): not negative")]
            let target = (self.cfg.max_tree_size as f64 * self.cfg.prune_target_ratio) as usize;
            self.pop_until(&mut exp, |e| e.due.len() <= target);
        }
        if exp.heap.len() > 50 * exp.due.len().max(1024) {
            let Expiries { due, heap } = &mut *exp;
            let live: Vec<Entry> = heap.drain().filter(|Reverse((t, _, w, b))| due.get(&(*w, *b)) == Some(t)).collect();
            *heap = live.into();
        }
    }

    /// Drops everything whose TTL passed by `now`.
    pub fn expire(&self, now: Instant) {
        let mut exp = self.exp.lock();
        self.expire_locked(&mut exp, now);
    }

    /// (worker, block) entries held.
    pub fn size(&self) -> usize {
        self.exp.lock().due.len()
    }

    /// Matched leading blocks per worker (after expiring what is due).
    pub fn find_matches(&self, chain: &[BlockHash], now: Instant) -> Matches {
        self.expire(now);
        self.tree.find_matches(chain)
    }

    /// Forgets a worker.
    pub fn clear(&self, worker: WorkerId) {
        let mut exp = self.exp.lock();
        exp.due.retain(|(w, _), _| *w != worker);
        self.tree.clear(worker);
    }

    fn expire_locked(&self, exp: &mut Expiries, now: Instant) {
        while let Some(Reverse((t, _, _, _))) = exp.heap.peek() {
            if *t > now {
                break;
            }
            self.pop_one(exp);
        }
    }

    fn pop_until(&self, exp: &mut Expiries, done: impl Fn(&Expiries) -> bool) {
        while !done(exp) && !exp.heap.is_empty() {
            self.pop_one(exp);
        }
    }

    /// Removes the earliest entry if it is current; removing a block also drops the worker's
    /// blocks below it (the tree cascades), whose entries are then forgotten too.
    fn pop_one(&self, exp: &mut Expiries) {
        let Some(Reverse((t, _, w, b))) = exp.heap.pop() else { return };
        if exp.due.get(&(w, b)) != Some(&t) {
            return; // refreshed or already gone
        }
        exp.due.remove(&(w, b));
        for gone in self.tree.remove_all(w, b) {
            exp.due.remove(&(w, gone));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(ttl_s: u64, max: usize) -> ApproxConfig {
        ApproxConfig { ttl: Duration::from_secs(ttl_s), max_tree_size: max, prune_target_ratio: 0.8 }
    }

    #[test]
    fn decisions_are_believed_until_the_ttl() {
        let idx = ApproxIndex::new(cfg(120, 1000));
        let t0 = Instant::now();
        idx.record(3, &[1, 2, 3], t0);
        assert_eq!(idx.find_matches(&[1, 2, 3, 4], t0 + Duration::from_secs(60)).get(3), 3);
        // A second decision refreshes the shared prefix.
        idx.record(3, &[1, 2, 9], t0 + Duration::from_secs(100));
        let later = t0 + Duration::from_secs(150);
        assert_eq!(idx.find_matches(&[1, 2, 3], later).get(3), 2, "block 3 expired, the refreshed prefix stays");
        assert_eq!(idx.find_matches(&[1, 2, 9], later).get(3), 3);
        assert_eq!(idx.find_matches(&[1, 2, 9], t0 + Duration::from_secs(221)).get(3), 0);
        assert_eq!(idx.size(), 0);
    }

    #[test]
    fn pruning_keeps_the_target_and_drops_deepest_first() {
        let idx = ApproxIndex::new(cfg(120, 10));
        let t0 = Instant::now();
        idx.record(0, &[1, 2, 3, 4, 5, 6], t0);
        idx.record(1, &[1, 2, 3, 4, 5, 6], t0); // 12 entries > 10 → prune to 8
        assert!(idx.size() <= 8, "{}", idx.size());
        // Same expiry everywhere: the deepest blocks went first, prefixes survive.
        let m = idx.find_matches(&[1, 2, 3, 4, 5, 6], t0);
        assert!(m.get(0) >= 3 && m.get(1) >= 3, "{m:?}");
        assert!(m.get(0) + m.get(1) <= 8);
    }

    #[test]
    fn clearing_a_worker_forgets_it() {
        let idx = ApproxIndex::new(ApproxConfig::default());
        let t0 = Instant::now();
        idx.record(0, &[1, 2], t0);
        idx.record(1, &[1, 2], t0);
        idx.clear(0);
        let m = idx.find_matches(&[1, 2], t0);
        assert_eq!((m.get(0), m.get(1)), (0, 2));
        assert_eq!(idx.size(), 2);
    }
}
