//! The flat index: a lock-free table from chained block hash to worker bitset, read without
//! locks by any number of router threads, written by event tasks one at a time.
//!
//! Because every worker's blocks are prefix-closed (removal cascades, inserts need a held
//! parent), "worker w holds the first k blocks of this chain" is monotone in k, and
//! `find_matches` is a multi-worker binary search: it splits the candidate set at the midpoint
//! into workers that hold that block and workers that do not, and recurses on both halves.
//! A 512-block chain costs about log2(512) ≈ 9 lookups per group of workers with distinct match
//! lengths, instead of 512 lookups.
//!
//! Writers keep per-worker bookkeeping (reference count, parent, first child, next sibling per
//! held block) behind the writer mutex; readers never touch it. The table grows by rebuilding
//! into a fresh one and swapping it in (`ArcSwap`), so readers always see a complete table.

use super::table::{MAX_WORDS, Table};
use super::{IndexError, KvIndex, Matches, WorkerId};
use crate::hash::BlockHash;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Keys are already hashes: use them as is.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type IdMap<V> = HashMap<BlockHash, V, BuildHasherDefault<IdHasher>>;

/// Per held block: 16 bytes. Removal cascades through `children` counts: a block with held
/// children is rare to evict (vLLM frees a request's blocks last-first, so leaves go first), so
/// its descendants are found by scanning the worker's blocks instead of keeping child lists.
#[derive(Debug, Clone, Copy)]
struct Meta {
    refs: u32,
    children: u32,
    parent: BlockHash,
}

#[derive(Default)]
struct Writer {
    workers: Vec<IdMap<Meta>>,
    /// Slots with a key (live or dead).
    used: usize,
    /// Slots with a non-empty set.
    live: usize,
    /// Scratch space for cascades.
    doomed: std::collections::HashSet<BlockHash, BuildHasherDefault<IdHasher>>,
}

/// The concurrent index.
pub struct FlatIndex {
    table: ArcSwap<Table>,
    writer: Mutex<Writer>,
    counts: Box<[AtomicUsize]>,
    max_workers: usize,
}

const MAX_LOAD: f64 = 0.7;

impl FlatIndex {
    /// An index for up to `max_workers` (≤ 256) workers, sized for `expected_blocks` distinct
    /// blocks (it grows beyond that).
    pub fn new(max_workers: usize, expected_blocks: usize) -> Self {
        assert!((1..=64 * MAX_WORDS).contains(&max_workers), "1..=256 workers per index");
        let words = max_workers.div_ceil(64);
        let cap = ((expected_blocks as f64 / MAX_LOAD) as usize + 1).next_power_of_two();
        Self {
            table: ArcSwap::from_pointee(Table::new(cap, words)),
            writer: Mutex::new(Writer { workers: (0..max_workers).map(|_| IdMap::default()).collect(), used: 0, live: 0, doomed: Default::default() }),
            counts: (0..max_workers).map(|_| AtomicUsize::new(0)).collect(),
            max_workers,
        }
    }

    /// Approximate bytes used: the table plus the writers' per-(block, worker) bookkeeping.
    pub fn memory_bytes(&self) -> usize {
        let w = self.writer.lock();
        // hashbrown: (key + value) per bucket plus one control byte, at most 7/8 full.
        let per_entry = std::mem::size_of::<(BlockHash, Meta)>() + 1;
        let maps: usize = w.workers.iter().map(|m| m.capacity() * per_entry * 8 / 7).sum();
        self.table.load().memory_bytes() + maps
    }

    /// Distinct blocks held by any worker.
    pub fn live_blocks(&self) -> usize {
        self.writer.lock().live
    }

    fn check(&self, worker: WorkerId) -> Result<usize, IndexError> {
        let w = worker as usize;
        if w < self.max_workers { Ok(w) } else { Err(IndexError::WorkerOutOfRange(worker)) }
    }

    /// Adds `w` to `block`'s set, growing the table if needed.
    fn table_add(&self, wr: &mut Writer, block: BlockHash, w: usize) {
        loop {
            let t = self.table.load();
            if (wr.used + 1) as f64 > t.capacity() as f64 * MAX_LOAD {
                drop(t);
                self.rebuild(wr);
                continue;
            }
            let Some((slot, fresh)) = t.slot_for(block) else {
                drop(t);
                self.rebuild(wr);
                continue;
            };
            if fresh {
                wr.used += 1;
            }
            if t.set_bit(slot, w) {
                wr.live += 1;
            }
            return;
        }
    }

    fn table_remove(&self, wr: &mut Writer, block: BlockHash, w: usize) {
        let t = self.table.load();
        if let Some(slot) = t.find(block)
            && t.clear_bit(slot, w)
        {
            wr.live -= 1;
        }
    }

    /// Copies live entries into a table sized for twice their number and swaps it in.
    fn rebuild(&self, wr: &mut Writer) {
        let old = self.table.load_full();
        let cap = (((wr.live.max(1) * 2) as f64 / MAX_LOAD) as usize).next_power_of_two().max(old.capacity().min(1 << 16));
        let fresh = Table::new(cap, old.words());
        let mut live = 0;
        for (k, bits) in old.live() {
            fresh.put(k, &bits);
            live += 1;
        }
        wr.used = live;
        wr.live = live;
        self.table.store(Arc::new(fresh));
    }

    fn drop_subtree(&self, wr: &mut Writer, w: usize, root: BlockHash) -> usize {
        let meta = wr.workers[w].remove(&root).expect("caller checked");
        if meta.parent != 0
            && let Some(p) = wr.workers[w].get_mut(&meta.parent)
        {
            p.children = p.children.saturating_sub(1);
        }
        self.table_remove(wr, root, w);
        if meta.children == 0 {
            return 1;
        }
        // Rare: the block still has held descendants. Find them level by level.
        let mut doomed = std::mem::take(&mut wr.doomed);
        doomed.clear();
        doomed.insert(root);
        let mut found = vec![root];
        while !found.is_empty() {
            let level: Vec<BlockHash> = wr.workers[w].iter().filter(|(_, m)| doomed.contains(&m.parent)).map(|(&b, _)| b).collect();
            for &b in &level {
                doomed.insert(b);
            }
            for &b in &level {
                wr.workers[w].remove(&b);
                self.table_remove(wr, b, w);
            }
            found = level;
        }
        let removed = doomed.len();
        wr.doomed = doomed;
        removed
    }

    /// Workers in `set` hold `chain[lo]`; find each one's match length in `lo+1..=hi`.
    /// Monomorphized per bitset width so 64-worker indexes work on single words.
    fn search<const N: usize>(t: &Table, chain: &[BlockHash], lo: usize, hi: usize, set: [u64; N], out: &mut Vec<(WorkerId, u32)>) {
        if set.iter().all(|&x| x == 0) {
            return;
        }
        if hi - lo == 1 {
            for (wi, &word) in set.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let b = bits.trailing_zeros() as usize;
                    out.push(((wi * 64 + b) as WorkerId, (lo + 1) as u32));
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
        Self::search(t, chain, mid, hi, holds, out);
        Self::search(t, chain, lo, mid, lacks, out);
    }

    fn search_from<const N: usize>(t: &Table, chain: &[BlockHash], out: &mut Vec<(WorkerId, u32)>) {
        let s0 = t.get_n::<N>(chain[0]);
        Self::search(t, chain, 0, chain.len(), s0, out);
    }
}

impl KvIndex for FlatIndex {
    fn insert(&self, worker: WorkerId, parent: Option<BlockHash>, blocks: &[BlockHash]) -> Result<(), IndexError> {
        let w = self.check(worker)?;
        let mut wr = self.writer.lock();
        if let Some(p) = parent
            && !wr.workers[w].contains_key(&p)
        {
            return Err(IndexError::UnknownParent(p));
        }
        let mut prev = parent.unwrap_or(0);
        let mut added = 0;
        for &b in blocks {
            match wr.workers[w].get_mut(&b) {
                Some(m) => m.refs += 1,
                None => {
                    if prev != 0
                        && let Some(p) = wr.workers[w].get_mut(&prev)
                    {
                        p.children += 1;
                    }
                    wr.workers[w].insert(b, Meta { refs: 1, children: 0, parent: prev });
                    self.table_add(&mut wr, b, w);
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
        let mut wr = self.writer.lock();
        let mut first_err = None;
        let mut removed = 0;
        for &b in blocks {
            match wr.workers[w].get_mut(&b) {
                None => {
                    first_err.get_or_insert(IndexError::NotFound(b));
                }
                Some(m) if m.refs > 1 => m.refs -= 1,
                Some(_) => removed += self.drop_subtree(&mut wr, w, b),
            }
        }
        self.counts[w].fetch_sub(removed, Ordering::Relaxed);
        first_err.map_or(Ok(()), Err)
    }

    fn clear(&self, worker: WorkerId) {
        let Ok(w) = self.check(worker) else { return };
        let mut wr = self.writer.lock();
        let blocks: Vec<BlockHash> = wr.workers[w].drain().map(|(b, _)| b).collect();
        for b in blocks {
            self.table_remove(&mut wr, b, w);
        }
        self.counts[w].store(0, Ordering::Relaxed);
    }

    fn find_matches(&self, chain: &[BlockHash]) -> Matches {
        let mut scores = Vec::new();
        if let Some(&first) = chain.first() {
            let _ = first;
            let t = self.table.load();
            match t.words() {
                1 => Self::search_from::<1>(&t, chain, &mut scores),
                2 => Self::search_from::<2>(&t, chain, &mut scores),
                _ => Self::search_from::<MAX_WORDS>(&t, chain, &mut scores),
            }
            scores.sort_unstable();
        }
        Matches { scores }
    }

    fn block_count(&self, worker: WorkerId) -> usize {
        self.counts.get(worker as usize).map_or(0, |c| c.load(Ordering::Relaxed))
    }
}
