//! The flat index: a lock-free table from chained block hash to worker bitset, read without
//! locks by any number of router threads, written by event tasks one at a time.
//!
//! Because every worker's blocks are prefix-closed (removal cascades, inserts need a held
//! parent), "worker w holds the first k blocks of this chain" is monotone in k, and
//! `find_matches` is a multi-worker binary search: it splits the candidate set at the midpoint
//! into workers that hold that block and workers that do not, and recurses on both halves.
//! A 512-block chain costs about log2(512) ≈ 9 lookups per group of workers with distinct match
//! lengths, instead of 512 lookups. Lengths go into a per-call array indexed by worker and are
//! read out in worker order, so the result needs no sort.
//!
//! Writers keep per-worker bookkeeping (reference count, held-children count and parent per
//! held block, 16 bytes: see `blocks.rs`) behind the writer mutex; readers never touch it. The
//! table grows by rebuilding into a fresh one and swapping it in (`ArcSwap`), so readers always
//! see a complete table; the rebuild also rewrites the bookkeeping's parent slots.
//!
//! Memory: the table has any number of slots (not a power of two) and is rebuilt at 80% full
//! into one 50% full, and each worker's map runs between 57% and 85% full. With one bitset word
//! (≤ 64 workers) a slot is 16 bytes and a map entry 16, so a growing index costs 20–32 bytes
//! of table per block (shared by the workers holding it) plus 19–28 bytes per (block, worker):
//! at most ~60 bytes per (block, worker). Dead slots (blocks nobody holds any more) take room
//! until the next rebuild, and a rebuild does not shrink a table below 65,536 slots.
//!
//! Writers never load the `ArcSwap` (they keep their own `Arc` of the current table), and a
//! removed leaf's parent is not looked up at once (see `Writer::pending`).

use super::blocks::{BlockMap, Entry, NO_PARENT};
use super::table::{MAX_WORDS, Table};
use super::{IndexError, KvIndex, Matches, WorkerId};
use crate::hash::BlockHash;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Highest load of the shared table (slots with a key, live or dead) before a rebuild.
const MAX_LOAD: f64 = 0.8;
/// A rebuilt table is sized for its live blocks at `MAX_LOAD / GROWTH` (50%), so a growing
/// table runs between 50% and 80% full; a new one is sized the same way for the expected blocks.
const GROWTH: f64 = 1.6;
/// A rebuild never shrinks a table below this many slots (or its old size, if smaller), so a
/// small index that churns is not rebuilt over and over.
const SHRINK_FLOOR: usize = 1 << 16;

/// Slots for a table sized for `blocks`.
#[allow(clippy::cast_sign_loss, reason = "a count times positive constants: not negative")]
fn slots_for(blocks: usize) -> usize {
    (blocks.max(1) as f64 * GROWTH / MAX_LOAD).ceil() as usize
}

/// Slots with a key a table of `cap` slots holds before a rebuild.
#[allow(clippy::cast_sign_loss, reason = "a count times positive constants: not negative")]
fn max_used(cap: usize) -> usize {
    (cap as f64 * MAX_LOAD) as usize
}

/// References past `u16::MAX` per (worker, block).
type Spill = HashMap<(usize, BlockHash), u64>;

/// Everything behind the writer mutex.
struct Writer {
    /// The current table (the one readers load from the `ArcSwap`), without the swap's cost.
    table: Arc<Table>,
    /// Rebuild before claiming more slots than this (`capacity × MAX_LOAD`).
    max_used: usize,
    /// Slots with a key (live or dead).
    used: usize,
    /// Slots with a non-empty set.
    live: usize,
    /// Per worker, the blocks it holds (16 bytes each; parents as table slots).
    workers: Vec<BlockMap>,
    /// References beyond `u16::MAX` (see [`Entry`]); almost always empty.
    spill: Spill,
    /// Per worker, the table slot of a block whose `children` count is one too high, or
    /// `NO_PARENT`. Dropping a leaf decrements its parent's count; doing that at once would
    /// look the parent up through the table (a cache miss, then another in the map), so it is
    /// deferred: when the parent itself goes next (the usual order), it is applied to the entry
    /// in hand; any other time, it is applied before another is deferred, before a cascade,
    /// and slots are rewritten by a rebuild.
    pending: Vec<u32>,
    /// Scratch space for cascades (table slots).
    doomed: HashSet<u32>,
}

/// One more reference to worker `w`'s entry `e`.
fn add_ref(e: &mut Entry, spill: &mut Spill, w: usize) {
    if e.refs < u16::MAX {
        e.refs += 1;
    } else {
        *spill.entry((w, e.key())).or_insert(0) += 1;
    }
}

/// One reference fewer to worker `w`'s entry `e`, which has more than one.
fn drop_ref(e: &mut Entry, spill: &mut Spill, w: usize) {
    if e.refs == u16::MAX
        && let Some(extra) = spill.get_mut(&(w, e.key()))
    {
        *extra -= 1;
        if *extra == 0 {
            spill.remove(&(w, e.key()));
        }
    } else {
        e.refs -= 1;
    }
}

impl Writer {
    fn new(table: Arc<Table>, max_workers: usize) -> Self {
        Self {
            max_used: max_used(table.capacity()),
            table,
            used: 0,
            live: 0,
            workers: (0..max_workers).map(|_| BlockMap::default()).collect(),
            spill: Spill::default(),
            pending: vec![NO_PARENT; max_workers],
            doomed: HashSet::default(),
        }
    }

    /// Adds `w` to `block`'s set, rebuilding the table first if it is full. Returns the
    /// block's slot and whether the table was rebuilt (slots the caller holds are then stale).
    fn table_add(&mut self, swap: &ArcSwap<Table>, block: BlockHash, w: usize) -> (u32, bool) {
        let mut rebuilt = false;
        loop {
            let claimed = if self.used < self.max_used { self.table.slot_for(block) } else { self.table.find(block).map(|s| (s, false)) };
            let Some((slot, fresh)) = claimed else {
                self.rebuild(swap);
                rebuilt = true;
                continue;
            };
            if fresh {
                self.used += 1;
                self.live += 1;
                self.table.set_first_bit(slot, w);
            } else if self.table.set_bit(slot, w) {
                self.live += 1;
            }
            return (slot as u32, rebuilt);
        }
    }

    /// Removes `w` from `block`'s set (the worker holds it); returns its slot.
    fn table_remove(&mut self, block: BlockHash, w: usize) -> u32 {
        let slot = self.table.find(block).expect("a held block is in the table");
        if self.table.clear_bit(slot, w) {
            self.live -= 1;
        }
        slot as u32
    }

    /// Copies live entries into a table sized for them at `MAX_LOAD / GROWTH`, rewrites the
    /// workers' parent slots to the new table, and swaps it in.
    fn rebuild(&mut self, swap: &ArcSwap<Table>) {
        let old = &self.table;
        let cap = slots_for(self.live).max(old.capacity().min(SHRINK_FLOOR));
        let fresh = Table::new(cap, old.words());
        let mut moved = vec![NO_PARENT; old.capacity()];
        let mut live = 0;
        for (slot, k, bits) in old.live() {
            moved[slot] = fresh.put(k, &bits).expect("a rebuilt table has room") as u32;
            live += 1;
        }
        let parents = self.workers.iter_mut().flat_map(BlockMap::iter_mut).map(|e| &mut e.parent);
        for p in parents.chain(self.pending.iter_mut()).filter(|p| **p != NO_PARENT) {
            *p = moved[*p as usize];
            debug_assert_ne!(*p, NO_PARENT, "a held block's parent is live");
        }
        self.used = live;
        self.live = live;
        self.max_used = max_used(cap);
        self.table = Arc::new(fresh);
        swap.store(self.table.clone());
    }

    /// Forgets a dropped entry's spilled references.
    fn forget(&mut self, w: usize, e: &Entry) {
        if e.refs == u16::MAX {
            self.spill.remove(&(w, e.key()));
        }
    }

    /// Applies worker `w`'s deferred child-count decrement, if any (see `pending`).
    fn settle(&mut self, w: usize) {
        let slot = std::mem::replace(&mut self.pending[w], NO_PARENT);
        if slot != NO_PARENT
            && let Some(p) = self.workers[w].get_mut(self.table.key_at(slot as usize))
            && p.children != u16::MAX
        {
            p.children -= 1;
        }
    }

    /// Drops worker `w`'s block in map slot `at` and everything it holds below it; returns how
    /// many blocks went.
    fn drop_subtree(&mut self, w: usize, at: usize) -> usize {
        let mut e = self.workers[w].remove_at(at);
        self.forget(w, &e);
        let root_slot = self.table_remove(e.key(), w);
        if self.pending[w] == root_slot {
            // The usual case: vLLM frees a request's blocks last-first, so the previous removal
            // was this block's child.
            self.pending[w] = NO_PARENT;
            if e.children != u16::MAX {
                e.children -= 1;
            }
        }
        let removed = if e.children == 0 { 1 } else { self.drop_descendants(w, root_slot) };
        if e.parent != NO_PARENT {
            self.settle(w);
            self.pending[w] = e.parent;
        }
        removed
    }

    /// Rare: a dropped block still has (or, with a saturated count, may have) held
    /// descendants. Finds them level by level; returns how many blocks went, the root included.
    fn drop_descendants(&mut self, w: usize, root_slot: u32) -> usize {
        // A deferred decrement may be for a block about to go.
        self.settle(w);
        let mut doomed = std::mem::take(&mut self.doomed);
        doomed.clear();
        doomed.insert(root_slot);
        let mut removed = 1;
        loop {
            let level: Vec<BlockHash> = self.workers[w].iter().filter(|e| doomed.contains(&e.parent)).map(Entry::key).collect();
            if level.is_empty() {
                break;
            }
            for b in level {
                let e = self.workers[w].remove(b).expect("just seen");
                self.forget(w, &e);
                doomed.insert(self.table_remove(b, w));
                removed += 1;
            }
        }
        self.doomed = doomed;
        removed
    }
}

/// The concurrent index.
pub struct FlatIndex {
    table: ArcSwap<Table>,
    writer: Mutex<Writer>,
    counts: Box<[AtomicUsize]>,
    max_workers: usize,
}

impl FlatIndex {
    /// An index for up to `max_workers` (≤ 256) workers, sized for `expected_blocks` distinct
    /// blocks (it grows beyond that).
    pub fn new(max_workers: usize, expected_blocks: usize) -> Self {
        assert!((1..=64 * MAX_WORDS).contains(&max_workers), "1..=256 workers per index");
        let table = Arc::new(Table::new(slots_for(expected_blocks), max_workers.div_ceil(64)));
        debug_assert!([1, 2, MAX_WORDS].contains(&table.words()));
        Self {
            table: ArcSwap::new(table.clone()),
            writer: Mutex::new(Writer::new(table, max_workers)),
            counts: (0..max_workers).map(|_| AtomicUsize::new(0)).collect(),
            max_workers,
        }
    }

    /// Bytes used: the shared table plus the writers' per-(block, worker) bookkeeping.
    pub fn memory_bytes(&self) -> usize {
        let w = self.writer.lock();
        let maps: usize = w.workers.iter().map(BlockMap::memory_bytes).sum();
        // hashbrown: (key + value) per bucket plus one control byte, at most 7/8 full.
        let spill = w.spill.capacity() * (std::mem::size_of::<((usize, BlockHash), u64)>() + 1) * 8 / 7;
        w.table.memory_bytes() + maps + spill
    }

    /// Workers (ids) it has room for.
    pub fn max_workers(&self) -> usize {
        self.max_workers
    }

    /// Shared-table slots (for tests and diagnostics).
    pub fn table_capacity(&self) -> usize {
        self.writer.lock().table.capacity()
    }

    /// Distinct blocks held by any worker.
    pub fn live_blocks(&self) -> usize {
        self.writer.lock().live
    }

    fn check(&self, worker: WorkerId) -> Result<usize, IndexError> {
        let w = worker as usize;
        if w < self.max_workers { Ok(w) } else { Err(IndexError::WorkerOutOfRange(worker)) }
    }

    /// Workers in `set` hold `chain[lo]`; find each one's match length in `lo+1..=hi` and write
    /// it to `lens` (indexed by bitset word, then bit). Monomorphized per bitset width so
    /// 64-worker indexes work on single words.
    fn search<const N: usize>(t: &Table, chain: &[BlockHash], lo: usize, hi: usize, set: [u64; N], lens: &mut [[u32; 64]; N]) {
        if set.iter().all(|&x| x == 0) {
            return;
        }
        if hi - lo == 1 {
            for (word, lens) in set.iter().zip(lens.iter_mut()) {
                let mut bits = *word;
                while bits != 0 {
                    lens[bits.trailing_zeros() as usize] = (lo + 1) as u32;
                    bits &= bits - 1;
                }
            }
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let at = t.get_n::<N>(chain[mid]);
        let mut holds = [0u64; N];
        let mut lacks = [0u64; N];
        for i in 0..N {
            holds[i] = set[i] & at[i];
            lacks[i] = set[i] & !at[i];
        }
        Self::search(t, chain, mid, hi, holds, lens);
        Self::search(t, chain, lo, mid, lacks, lens);
    }

    /// The scores, in worker order (the workers holding the first block, in bit order: no sort).
    fn search_from<const N: usize>(t: &Table, chain: &[BlockHash]) -> Vec<(WorkerId, u32)> {
        let s0 = t.get_n::<N>(chain[0]);
        let mut lens = [[0u32; 64]; N];
        Self::search(t, chain, 0, chain.len(), s0, &mut lens);
        let mut out = Vec::with_capacity(s0.iter().map(|w| w.count_ones() as usize).sum());
        for (wi, (word, lens)) in s0.iter().zip(&lens).enumerate() {
            let mut bits = *word;
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                out.push(((wi * 64 + b) as WorkerId, lens[b]));
                bits &= bits - 1;
            }
        }
        out
    }
}

impl KvIndex for FlatIndex {
    fn insert(&self, worker: WorkerId, parent: Option<BlockHash>, blocks: &[BlockHash]) -> Result<(), IndexError> {
        let w = self.check(worker)?;
        let mut guard = self.writer.lock();
        let wr = &mut *guard;
        if let Some(p) = parent
            && !wr.workers[w].contains(p)
        {
            return Err(IndexError::UnknownParent(p));
        }
        let mut prev = parent.unwrap_or(0);
        // `prev`'s slot in the current table, when known.
        let mut prev_slot = None;
        let mut added = 0;
        for &b in blocks {
            match wr.workers[w].find(b) {
                Ok(i) => {
                    add_ref(wr.workers[w].at(i), &mut wr.spill, w);
                    prev_slot = None;
                }
                Err(at) => {
                    if prev != 0
                        && let Some(p) = wr.workers[w].get_mut(prev)
                        && p.children != u16::MAX
                    {
                        p.children += 1;
                    }
                    let (slot, rebuilt) = wr.table_add(&self.table, b, w);
                    let parent = match prev_slot {
                        _ if prev == 0 => NO_PARENT,
                        Some(s) if !rebuilt => s,
                        _ => wr.table.find(prev).expect("a held parent is in the table") as u32,
                    };
                    // Neither the count nor a rebuild moved entries: `at` still stands.
                    wr.workers[w].insert_at(at, b, parent);
                    prev_slot = Some(slot);
                    added += 1;
                }
            }
            prev = b;
        }
        self.counts[w].fetch_add(added, Ordering::Relaxed);
        Ok(())
    }

    fn remove(&self, worker: WorkerId, blocks: &[BlockHash]) -> Result<(), IndexError> {
        let w = self.check(worker)?;
        let mut guard = self.writer.lock();
        let wr = &mut *guard;
        let mut first_err = None;
        let mut removed = 0;
        for &b in blocks {
            match wr.workers[w].find(b) {
                Err(_) => {
                    first_err.get_or_insert(IndexError::NotFound(b));
                }
                Ok(i) if wr.workers[w].at(i).refs > 1 => drop_ref(wr.workers[w].at(i), &mut wr.spill, w),
                Ok(i) => removed += wr.drop_subtree(w, i),
            }
        }
        self.counts[w].fetch_sub(removed, Ordering::Relaxed);
        first_err.map_or(Ok(()), Err)
    }

    fn clear(&self, worker: WorkerId) {
        let Ok(w) = self.check(worker) else { return };
        let mut guard = self.writer.lock();
        let wr = &mut *guard;
        let blocks: Vec<BlockHash> = wr.workers[w].iter().map(Entry::key).collect();
        wr.workers[w].clear();
        wr.pending[w] = NO_PARENT;
        for b in blocks {
            wr.table_remove(b, w);
        }
        if !wr.spill.is_empty() {
            wr.spill.retain(|&(sw, _), _| sw != w);
        }
        self.counts[w].store(0, Ordering::Relaxed);
    }

    fn find_matches(&self, chain: &[BlockHash]) -> Matches {
        if chain.is_empty() {
            return Matches::default();
        }
        let t = self.table.load();
        let scores = match t.words() {
            1 => Self::search_from::<1>(&t, chain),
            2 => Self::search_from::<2>(&t, chain),
            _ => Self::search_from::<MAX_WORDS>(&t, chain),
        };
        Matches { scores }
    }

    fn block_count(&self, worker: WorkerId) -> usize {
        self.counts.get(worker as usize).map_or(0, |c| c.load(Ordering::Relaxed))
    }
}
