//! The prompt prefixes booked on each worker by requests in flight: how many leading blocks of
//! a prompt some booking there shares (the `time` cost credits a prefix being computed there,
//! docs/routing.md), and how many distinct blocks a worker's bookings hold.
//!
//! The booked chains of every worker form one radix tree: a node is a run of blocks some
//! bookings share (a slice of one of their chains, not a copy), its children the ways they part
//! after it, and each node says per worker how many of its bookings pass through it and where
//! the others end inside it. A chained block hash stands for its whole prefix, so where a chain
//! parts from a node's run is found by binary search. A booking, its release and a lookup each
//! walk one path: a node per point where the bookings along it part or end (a system prompt, a
//! document, a conversation; a release merges what no longer parts) and O(log L) block
//! comparisons per node, whatever the prompt's length L. One mutex covers the tree: lookups
//! and bookings alike hold it for one walk. Keeping every booked block in a hash
//! table instead cost a few cache misses per block, which a long prompt on a busy gateway paid
//! on every booking and release.

use kvgate_kv::hash::{BlockHash, BuildIdHasher};
use kvgate_kv::index::{Matches, WorkerId};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Per worker, the chains booked there and the distinct blocks they hold.
pub struct BookedPrefixes {
    tree: Mutex<Tree>,
    /// Per worker, the distinct blocks of its bookings (read without the lock).
    distinct: Box<[AtomicU64]>,
}

/// Index of a node in [`Tree::nodes`].
type NodeId = u32;

/// The root: no blocks, its children the chains' first blocks.
const ROOT: NodeId = 0;

/// The tree, its nodes in a slab.
struct Tree {
    nodes: Vec<Node>,
    free: Vec<NodeId>,
}

/// A run of blocks, `chain[start..end]`, that the bookings through it share (some booking
/// holds all of it; `chain` is any of theirs, kept alive while the node lives).
struct Node {
    chain: Arc<[BlockHash]>,
    start: usize,
    end: usize,
    /// By the first block of their run (this node's `chain[end]`, their `chain[start]`).
    children: HashMap<BlockHash, NodeId, BuildIdHasher>,
    /// Per worker with bookings here.
    stakes: Vec<Stake>,
}

/// One worker's bookings in a node.
#[derive(Debug, Clone, Default, PartialEq)]
struct Stake {
    worker: WorkerId,
    /// Bookings that go on into a child.
    through: u32,
    /// Bookings that end in this node: (their length, how many), their lengths in
    /// `start + 1..=end`.
    ends: Vec<(usize, u32)>,
}

impl Stake {
    /// The most blocks of this node's chain one of these bookings holds.
    fn reach(&self, end: usize) -> usize {
        if self.through > 0 { end } else { self.ends.iter().map(|&(e, _)| e).max().unwrap_or(0) }
    }

    fn is_empty(&self) -> bool {
        self.through == 0 && self.ends.is_empty()
    }

    fn add_end(&mut self, len: usize) {
        match self.ends.iter_mut().find(|(e, _)| *e == len) {
            Some((_, n)) => *n += 1,
            None => self.ends.push((len, 1)),
        }
    }

    /// Whether a booking of length `len` ends here.
    fn ends_at(&self, len: usize) -> bool {
        self.ends.iter().any(|&(e, _)| e == len)
    }

    /// Takes one booking of length `len` out, if one ends here.
    fn take_end(&mut self, len: usize) {
        let Some(i) = self.ends.iter().position(|&(e, _)| e == len) else { return };
        self.ends[i].1 -= 1;
        if self.ends[i].1 == 0 {
            self.ends.swap_remove(i);
        }
    }
}

/// How many blocks from `from` on `a` and `b` share (`a[from] == b[from]` is known).
fn shared_from(a: &[BlockHash], b: &[BlockHash], from: usize) -> usize {
    let n = a.len().min(b.len());
    if from >= n {
        return 0;
    }
    if a[n - 1] == b[n - 1] {
        return n - from;
    }
    // a[lo] == b[lo] and a[hi] != b[hi]: the chains part somewhere in (lo, hi].
    let (mut lo, mut hi) = (from, n - 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if a[mid] == b[mid] { lo = mid } else { hi = mid }
    }
    hi - from
}

impl Node {
    /// A slot of the slab with no node in it.
    fn vacant() -> Self {
        Self { chain: Arc::from([]), start: 0, end: 0, children: HashMap::default(), stakes: Vec::new() }
    }

    fn child(&self, first: BlockHash) -> Option<NodeId> {
        self.children.get(&first).copied()
    }

    fn stake(&self, w: WorkerId) -> Option<&Stake> {
        self.stakes.iter().find(|s| s.worker == w)
    }

    fn stake_mut(&mut self, w: WorkerId) -> &mut Stake {
        match self.stakes.iter().position(|s| s.worker == w) {
            Some(i) => &mut self.stakes[i],
            None => {
                self.stakes.push(Stake { worker: w, ..Stake::default() });
                self.stakes.last_mut().expect("just pushed")
            }
        }
    }

    /// How far `chain` (entering here: `chain[start] == self.chain[start]`) follows this
    /// node's run: the position where it parts or ends.
    fn follow(&self, chain: &[BlockHash]) -> usize {
        self.start + shared_from(&self.chain[..self.end], chain, self.start)
    }
}

/// One step of a walk down `chain`'s path: the node entered and how far the chain follows it.
struct Step {
    node: NodeId,
    parent: NodeId,
    at: usize,
}

impl Tree {
    fn new() -> Self {
        Self { nodes: vec![Node::vacant()], free: Vec::new() }
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// The nodes `chain` (not empty) passes, from the root's child down to the node where it
    /// parts from the tree or ends.
    fn walk(&self, chain: &[BlockHash]) -> Vec<Step> {
        let mut path = Vec::new();
        self.visit(chain, |s| path.push(s));
        path
    }

    /// [`Tree::walk`] step by step, without keeping the path (a lookup keeps nothing).
    fn visit(&self, chain: &[BlockHash], mut step: impl FnMut(Step)) {
        let (mut parent, mut pos) = (ROOT, 0);
        while let Some(node) = chain.get(pos).and_then(|&b| self.node(parent).child(b)) {
            let at = self.node(node).follow(chain);
            step(Step { node, parent, at });
            if at < self.node(node).end {
                break;
            }
            (parent, pos) = (node, at);
        }
    }

    /// The most leading blocks of `chain` one of `w`'s bookings holds, along `path` (its walk).
    fn best(&self, path: &[Step], w: WorkerId) -> usize {
        path.iter().filter_map(|s| self.node(s.node).stake(w).map(|k| s.at.min(k.reach(self.node(s.node).end)))).max().unwrap_or(0)
    }

    /// Cuts `id`'s run at `at` (inside it): the blocks from `at` on become a child of it,
    /// with its children and the bookings that reach past `at`.
    fn split(&mut self, id: NodeId, at: usize) {
        let node = self.node_mut(id);
        let mut lower = Node { chain: node.chain.clone(), start: at, end: node.end, children: std::mem::take(&mut node.children), stakes: Vec::new() };
        for s in &mut node.stakes {
            let (below, here): (Vec<_>, Vec<_>) = s.ends.iter().partition(|&&(e, _)| e > at);
            let down = Stake { worker: s.worker, through: s.through, ends: below };
            s.through += down.ends.iter().map(|&(_, n)| n).sum::<u32>();
            s.ends = here;
            if !down.is_empty() {
                lower.stakes.push(down);
            }
        }
        node.end = at;
        // A run nobody holds past `at` cannot be left (`tidy` ends a leaf at its longest
        // booking, and a node with children has bookings through it); if one were, it would
        // have no children either, and there would be nothing to move down.
        debug_assert!(!lower.stakes.is_empty(), "a run past every booking");
        if lower.stakes.is_empty() {
            node.children = lower.children;
            return;
        }
        let key = node.chain[at];
        let lower = self.alloc(lower);
        self.node_mut(id).children.insert(key, lower);
        // The bookings that ended inside the run stay above: below, all may go on into one
        // child.
        self.tidy(lower);
    }

    /// Adds a leaf for `chain[from..]` (booked once, by `w`) under `parent`.
    fn leaf(&mut self, parent: NodeId, chain: &Arc<[BlockHash]>, from: usize, w: WorkerId) {
        let stakes = vec![Stake { worker: w, through: 0, ends: vec![(chain.len(), 1)] }];
        let id = self.alloc(Node { chain: chain.clone(), start: from, end: chain.len(), children: HashMap::default(), stakes });
        self.node_mut(parent).children.insert(chain[from], id);
    }

    /// Books `chain` (not empty) on `w`; returns how many of its blocks `w` held already.
    fn add(&mut self, chain: &Arc<[BlockHash]>, w: WorkerId) -> usize {
        let path = self.walk(chain);
        let held = self.best(&path, w);
        let len = chain.len();
        // Every node passed whole carries the booking on.
        let (last, passed) = path.split_last().map_or((None, &path[..]), |(l, p)| (Some(l), p));
        for s in passed {
            self.node_mut(s.node).stake_mut(w).through += 1;
        }
        match last {
            None => self.leaf(ROOT, chain, 0, w),
            // It ends inside (or at the end of) the last node's run.
            Some(s) if s.at == len => self.node_mut(s.node).stake_mut(w).add_end(len),
            Some(s) => {
                if s.at < self.node(s.node).end {
                    self.split(s.node, s.at);
                }
                self.node_mut(s.node).stake_mut(w).through += 1;
                self.leaf(s.node, chain, s.at, w);
            }
        }
        held
    }

    /// Releases one booking of `chain` (not empty) on `w`; `None` if there is none, else how
    /// many of its blocks `w`'s other bookings still hold.
    fn remove(&mut self, chain: &[BlockHash], w: WorkerId) -> Option<usize> {
        let path = self.walk(chain);
        let (last, passed) = path.split_last()?;
        let booked = last.at == chain.len()
            && self.node(last.node).stake(w).is_some_and(|k| k.ends_at(chain.len()))
            && passed.iter().all(|s| self.node(s.node).stake(w).is_some_and(|k| k.through > 0));
        if !booked {
            return None;
        }
        self.node_mut(last.node).stake_mut(w).take_end(chain.len());
        for s in passed {
            self.node_mut(s.node).stake_mut(w).through -= 1;
        }
        // Deepest first: a node nobody books any more has no children either.
        for s in path.iter().rev() {
            let node = self.node_mut(s.node);
            node.stakes.retain(|k| !k.is_empty());
            if node.stakes.is_empty() {
                let first = node.chain[node.start];
                *node = Node::vacant();
                self.free.push(s.node);
                self.node_mut(s.parent).children.remove(&first);
            } else {
                self.tidy(s.node);
            }
        }
        Some(self.best(&self.walk(chain), w))
    }

    /// Keeps a path as short as its branches: a node whose bookings all go on into its one
    /// child takes the child's run, and a leaf ends where its longest booking does. Without it
    /// a prompt booked while others that shared part of it came and went would be left
    /// split at every point they parted, and its lookups would walk all those nodes.
    fn tidy(&mut self, id: NodeId) {
        loop {
            let node = self.node(id);
            let single = node.children.values().next().copied().filter(|_| node.children.len() == 1);
            match single {
                Some(child) if node.stakes.iter().all(|k| k.ends.is_empty()) => {
                    let c = std::mem::replace(self.node_mut(child), Node::vacant());
                    self.free.push(child);
                    let node = self.node_mut(id);
                    (node.chain, node.end, node.stakes, node.children) = (c.chain, c.end, c.stakes, c.children);
                }
                None => {
                    let reach = node.stakes.iter().map(|k| k.reach(node.end)).max().unwrap_or(node.end);
                    self.node_mut(id).end = reach;
                    return;
                }
                Some(_) => return,
            }
        }
    }

    /// Per worker, the most leading blocks of `chain` (not empty) one of its bookings holds,
    /// into `best` (indexed by worker).
    fn overlap(&self, chain: &[BlockHash], best: &mut [u32]) {
        self.visit(chain, |s| {
            let node = self.node(s.node);
            for k in &node.stakes {
                if let Some(b) = best.get_mut(k.worker as usize) {
                    *b = (*b).max(s.at.min(k.reach(node.end)) as u32);
                }
            }
        });
    }
}

impl BookedPrefixes {
    /// Nothing booked on `workers` workers.
    pub fn new(workers: usize) -> Self {
        Self { tree: Mutex::new(Tree::new()), distinct: (0..workers).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Books `chain` on `w` (an empty chain, or an unknown worker, books nothing).
    pub fn add(&self, w: WorkerId, chain: &Arc<[BlockHash]>) {
        let Some(distinct) = self.distinct.get(w as usize).filter(|_| !chain.is_empty()) else { return };
        let held = self.tree.lock().add(chain, w);
        distinct.fetch_add((chain.len() - held) as u64, Ordering::Relaxed);
    }

    /// Releases one booking of `chain` on `w`; nothing if there is none. Whether there was.
    pub fn remove(&self, w: WorkerId, chain: &[BlockHash]) -> bool {
        let Some(distinct) = self.distinct.get(w as usize).filter(|_| !chain.is_empty()) else { return false };
        let Some(held) = self.tree.lock().remove(chain, w) else { return false };
        distinct.fetch_sub((chain.len() - held) as u64, Ordering::Relaxed);
        true
    }

    /// Per worker, the most leading blocks of `chain` one of its bookings shares (workers
    /// sharing none left out).
    pub fn overlap(&self, chain: &[BlockHash]) -> Matches {
        if chain.is_empty() {
            return Matches::default();
        }
        let mut best = vec![0u32; self.distinct.len()];
        self.overlap_into(chain, &mut best);
        Matches { scores: best.iter().enumerate().filter(|&(_, &b)| b > 0).map(|(w, &b)| (w as WorkerId, b)).collect() }
    }

    /// [`BookedPrefixes::overlap`] into `best` (one slot per worker), raising a slot only
    /// where this tree's bookings share more: several trees' overlaps merge into one.
    pub fn overlap_into(&self, chain: &[BlockHash], best: &mut [u32]) {
        if !chain.is_empty() {
            self.tree.lock().overlap(chain, best);
        }
    }

    /// Distinct blocks booked on `w`.
    pub fn distinct_blocks(&self, w: WorkerId) -> u64 {
        self.distinct.get(w as usize).map_or(0, |d| d.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_kv::hash::Hasher;
    use std::collections::HashSet;

    fn chain(h: &Hasher, tokens: &[u32]) -> Arc<[BlockHash]> {
        h.chain(None, tokens).into()
    }

    #[test]
    fn shared_prefixes_are_found_and_counted_once() {
        let h = Hasher::new(1, 7);
        let b = BookedPrefixes::new(3);
        let doc = chain(&h, &[1, 2, 3, 4, 5, 6]);
        let q1 = chain(&h, &[1, 2, 3, 4, 5, 6, 7, 8]);
        let q2 = chain(&h, &[1, 2, 3, 4, 9]);
        b.add(1, &doc);
        b.add(1, &q1);
        b.add(1, &q2);
        b.add(2, &q2);
        assert_eq!(b.distinct_blocks(1), 9, "6 + 2 + 1 blocks");
        assert_eq!(b.distinct_blocks(2), 5);
        let m = b.overlap(&h.chain(None, &[1, 2, 3, 4, 5, 6, 7, 0]));
        assert_eq!(m.scores, vec![(1, 7), (2, 4)]);
        assert_eq!(b.overlap(&h.chain(None, &[9, 2])).scores, vec![]);
        b.remove(1, &q1);
        assert_eq!(b.distinct_blocks(1), 7);
        assert_eq!(b.overlap(&q1).get(1), 6);
        // Bookings of equal chains are alike: releasing one releases any one of them.
        b.remove(1, &chain(&h, &[1, 2, 3, 4, 9]));
        assert_eq!(b.distinct_blocks(1), 6);
        b.remove(1, &q2);
        assert_eq!(b.distinct_blocks(1), 6, "none of it left to release");
        b.remove(1, &doc);
        assert_eq!(b.distinct_blocks(1), 0);
        assert!(b.overlap(&q1).scores.iter().all(|&(w, _)| w == 2));
        b.remove(9, &q2);
        b.add(9, &q2);
        assert_eq!(b.distinct_blocks(9), 0, "an unknown worker books nothing");
    }

    /// Random bookings and releases against a set of every booked block per worker.
    #[test]
    fn agrees_with_every_block_counted() {
        // Short chains of three tokens share prefixes all the time; long ones of two part deep.
        agrees_with_every_block_counted_over(3, 12, 11);
        agrees_with_every_block_counted_over(2, 40, 12);
    }

    fn agrees_with_every_block_counted_over(tokens: u64, longest: u64, seed: u64) {
        let h = Hasher::new(1, 3);
        let mut next = kvgate_kv::hash::sequence(seed);
        let b = BookedPrefixes::new(4);
        let mut live: Vec<(WorkerId, Arc<[BlockHash]>)> = Vec::new();
        for step in 0..4_000 {
            if live.len() > 40 || (!live.is_empty() && next().is_multiple_of(3)) {
                let (w, c) = live.swap_remove(next() as usize % live.len());
                b.remove(w, &c);
            } else {
                // Few distinct tokens at each position, so prefixes are shared often.
                let len = 1 + (next() % longest) as usize;
                let tokens: Vec<u32> = (0..len).map(|_| (next() % tokens) as u32).collect();
                let w = (next() % 4) as WorkerId;
                let c = chain(&h, &tokens);
                b.add(w, &c);
                live.push((w, c));
            }
            if next().is_multiple_of(7) {
                // Releasing a chain that may not be booked there releases nothing.
                let len = 1 + (next() % longest) as usize;
                let c = chain(&h, &(0..len).map(|_| (next() % tokens) as u32).collect::<Vec<_>>());
                let w = (next() % 4) as WorkerId;
                if let Some(i) = live.iter().position(|(x, k)| *x == w && **k == *c) {
                    live.swap_remove(i);
                }
                b.remove(w, &c);
            }
            let tree = b.tree.lock();
            assert_eq!(tree.nodes.len() - tree.free.len() - 1, tree.live_nodes(), "step {step}: every node is reachable");
            drop(tree);
            let query: Vec<u32> = (0..=next() % longest).map(|_| (next() % tokens) as u32).collect();
            let q = h.chain(None, &query);
            let m = b.overlap(&q);
            for w in 0..4 {
                let mine: Vec<&Arc<[BlockHash]>> = live.iter().filter(|(x, _)| *x == w).map(|(_, c)| c).collect();
                let set: HashSet<BlockHash> = mine.iter().flat_map(|c| c.iter().copied()).collect();
                assert_eq!(b.distinct_blocks(w), set.len() as u64, "step {step}, worker {w}");
                let best = mine.iter().map(|c| c.iter().zip(&q).take_while(|(a, b)| a == b).count()).max().unwrap_or(0);
                assert_eq!(m.get(w), best as u32, "step {step}, worker {w}");
            }
        }
        for (w, c) in live.drain(..) {
            b.remove(w, &c);
        }
        let tree = b.tree.lock();
        assert_eq!(tree.nodes.len() - tree.free.len(), 1, "only the root is left");
        assert!(tree.nodes[0].children.is_empty());
        assert!((0..4).all(|w| b.distinct_blocks(w) == 0));
    }

    impl Tree {
        /// Nodes reachable from the root, the root left out; checks what every node keeps.
        fn live_nodes(&self) -> usize {
            let mut stack = vec![ROOT];
            let mut n = 0;
            while let Some(id) = stack.pop() {
                let node = self.node(id);
                if id != ROOT {
                    assert!(!node.stakes.is_empty(), "a node nobody books is pruned");
                    assert!(node.stakes.iter().any(|k| k.reach(node.end) == node.end), "some booking reaches its end");
                    let passing = node.children.len() == 1 && node.stakes.iter().all(|k| k.ends.is_empty());
                    assert!(!passing, "a node whose bookings all go on into one child is merged with it");
                }
                for k in node.stakes.iter().filter(|_| id != ROOT) {
                    let below: u32 = node
                        .children
                        .values()
                        .filter_map(|&c| self.node(c).stake(k.worker))
                        .map(|s| s.through + s.ends.iter().map(|&(_, n)| n).sum::<u32>())
                        .sum();
                    assert_eq!(k.through, below, "worker {}'s bookings through a node are those below it", k.worker);
                    assert!(k.ends.iter().all(|&(e, n)| e > node.start && e <= node.end && n > 0));
                }
                for (&k, &c) in &node.children {
                    assert_eq!(self.node(c).chain[self.node(c).start], k);
                    assert_eq!(self.node(c).start, node.end);
                    stack.push(c);
                    n += 1;
                }
            }
            n
        }
    }

    #[test]
    fn a_run_nobody_holds_any_more_is_cut_back() {
        let h = Hasher::new(1, 5);
        let b = BookedPrefixes::new(3);
        let c10 = chain(&h, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        let c5: Arc<[BlockHash]> = c10[..5].into();
        b.add(0, &c10);
        b.add(1, &c5);
        b.remove(0, &c10);
        // Only the first five blocks are held now; a chain parting at the eighth shares five.
        let parting = chain(&h, &[1, 2, 3, 4, 5, 6, 7, 0, 0]);
        b.add(2, &parting);
        assert_eq!((b.distinct_blocks(0), b.distinct_blocks(1), b.distinct_blocks(2)), (0, 5, 9));
        assert_eq!(b.overlap(&c10).scores, vec![(1, 5), (2, 7)]);
        let tree = b.tree.lock();
        assert_eq!(tree.live_nodes(), 2, "the five shared blocks, then the rest of the parting chain");
    }

    #[test]
    fn a_path_stays_as_short_as_its_branches() {
        let h = Hasher::new(1, 9);
        let b = BookedPrefixes::new(1);
        let x: Vec<u32> = (0..1_000).collect();
        let long = chain(&h, &x);
        b.add(0, &long);
        // Chains that share the first i blocks and then part, booked and released.
        for i in 1..1_000 {
            let mut other = x[..i].to_vec();
            other.push(5_000);
            let c = chain(&h, &other);
            b.add(0, &c);
            assert_eq!(b.overlap(&c).get(0), i as u32 + 1);
            b.remove(0, &c);
        }
        assert_eq!(b.distinct_blocks(0), 1_000);
        assert_eq!(b.tree.lock().live_nodes(), 1, "one node, not one per point where others parted");
        assert_eq!(b.overlap(&long).get(0), 1_000);
    }
}
