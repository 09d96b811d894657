//! The paged KV cache: a fixed pool of blocks with reference counts, an LRU free queue and a
//! prefix-cache map from block hash to block, modelled on vLLM v1's `BlockPool`.
//!
//! Behaviours copied from vLLM because routers and tests depend on them:
//! - block 0 is the reserved "null" block, so `num_gpu_blocks - 1` are usable and
//!   `usage = 1 - free / (num_gpu_blocks - 1)`; cached blocks with no reference count as free;
//! - freed blocks go to the tail of the free queue and allocation takes from the head; callers
//!   free a request's blocks last-first, so its tail blocks are evicted before its shared prefix;
//! - a cached block is only evicted when its slot is reused, which is the only time
//!   `BlockRemoved` is emitted (one event per hash); finishing a request emits nothing;
//! - two blocks may hold the same hash (two identical prompts computed in the same step): both
//!   emit `BlockStored`, lookups use the first, and evicting either emits `BlockRemoved`.
//!
//! The pool does not know about requests; the scheduler owns which blocks a request holds.

use crate::block_hash::BlockHash;
use crate::events::{BlockKeys, KvEvent};
use std::collections::HashMap;

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: BlockId = BlockId::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    prev: BlockId,
    next: BlockId,
    in_free_queue: bool,
}

/// The block pool. Single-threaded: one pool per engine (DP rank).
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: BlockId,
    tail: BlockId,
    num_free: usize,
    cached: HashMap<BlockHash, Vec<BlockId>>,
    enable_caching: bool,
    block_size: usize,
    events: Vec<KvEvent>,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (including the null block), all free.
    pub fn new(num_gpu_blocks: usize, block_size: usize, enable_caching: bool) -> Self {
        assert!(num_gpu_blocks >= 2, "validated by SimConfig");
        let n = num_gpu_blocks as BlockId;
        let mut blocks: Vec<Block> = (0..n)
            .map(|i| Block { ref_cnt: 0, hash: None, prev: if i > 1 { i - 1 } else { NIL }, next: if i + 1 < n { i + 1 } else { NIL }, in_free_queue: i > 0 })
            .collect();
        blocks[0].next = NIL;
        blocks[0].ref_cnt = 1; // the null block is never handed out
        Self { blocks, head: 1, tail: n - 1, num_free: num_gpu_blocks - 1, cached: HashMap::new(), enable_caching, block_size, events: Vec::new() }
    }

    /// Blocks usable by requests (all but the null block).
    pub fn num_usable(&self) -> usize {
        self.blocks.len() - 1
    }

    /// Blocks in the free queue (including cached blocks nobody references).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// `vllm:kv_cache_usage_perc`.
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.num_usable() as f64
    }

    /// Reference count of a block (tests and admission math).
    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    /// Number of distinct hashes currently in the prefix cache.
    pub fn num_cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// The cached block holding `hash`, if prefix caching is on and the hash is cached.
    pub fn lookup(&self, hash: &BlockHash) -> Option<BlockId> {
        if !self.enable_caching {
            return None;
        }
        self.cached.get(hash).and_then(|ids| ids.first().copied())
    }

    /// Takes a reference on each block, pulling unreferenced ones out of the free queue.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if self.blocks[id as usize].ref_cnt == 0 && self.blocks[id as usize].in_free_queue {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Takes `n` blocks from the head of the free queue, evicting their cached hashes.
    /// Returns `None` (and takes nothing) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            self.evict_hash(id);
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Drops one reference on each block, in the given order; blocks reaching zero go to the
    /// tail of the free queue (still cached).
    pub fn free<'a>(&mut self, ids: impl IntoIterator<Item = &'a BlockId>) {
        for &id in ids {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_cnt > 0, "double free of block {id}");
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
            if b.ref_cnt == 0 {
                self.push_tail(id);
            }
        }
    }

    /// Records that `ids` now hold full blocks with `hashes` (same length) and emits one
    /// `BlockStored` covering them. `parent` is the hash of the block before the first one;
    /// `keys` the blocks' LoRA adapter and extra hash keys, published with them.
    pub fn cache_full_blocks(&mut self, ids: &[BlockId], hashes: &[BlockHash], parent: Option<&BlockHash>, token_ids: &[u32], keys: BlockKeys) {
        if !self.enable_caching || ids.is_empty() {
            return;
        }
        debug_assert_eq!(ids.len(), hashes.len());
        debug_assert_eq!(token_ids.len(), ids.len() * self.block_size);
        for (&id, hash) in ids.iter().zip(hashes) {
            self.blocks[id as usize].hash = Some(*hash);
            self.cached.entry(*hash).or_default().push(id);
        }
        self.events.push(KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent.copied(),
            token_ids: token_ids.to_vec(),
            block_size: self.block_size as u32,
            keys,
        });
    }

    /// Drops every cached hash, as `POST /reset_prefix_cache` does. Like vLLM, refuses (returns
    /// false, changes nothing) while any block is still referenced by a request.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != self.num_usable() {
            return false;
        }
        for b in self.blocks.iter_mut() {
            b.hash = None;
        }
        self.cached.clear();
        if self.enable_caching {
            self.events.push(KvEvent::AllBlocksCleared);
        }
        true
    }

    /// Takes the events produced since the last call (one engine step's worth).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn evict_hash(&mut self, id: BlockId) {
        let Some(hash) = self.blocks[id as usize].hash.take() else { return };
        if let Some(ids) = self.cached.get_mut(&hash) {
            ids.retain(|&b| b != id);
            if ids.is_empty() {
                self.cached.remove(&hash);
            }
        }
        self.events.push(KvEvent::BlockRemoved { block_hashes: vec![hash] });
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            debug_assert!(b.in_free_queue);
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free_queue = false;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, id: BlockId) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
            b.in_free_queue = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;
    use crate::block_hash::hash_block;

    fn h(i: u32) -> BlockHash {
        hash_block(None, &[i, i, i, i])
    }

    #[test]
    fn null_block_is_reserved_and_usage_counts_cached_as_free() {
        let mut p = BlockPool::new(5, 4, true);
        assert_eq!(p.num_usable(), 4);
        assert_eq!(p.usage(), 0.0);
        let ids = p.allocate(2).unwrap();
        assert!(!ids.contains(&0));
        assert_eq!(p.usage(), 0.5);
        p.cache_full_blocks(&ids, &[h(1), h(2)], None, &[1, 1, 1, 1, 2, 2, 2, 2], BlockKeys::default());
        p.free(ids.iter().rev());
        assert_eq!(p.usage(), 0.0, "cached but unreferenced blocks are free");
        assert_eq!(p.lookup(&h(1)), Some(ids[0]));
        assert!(p.allocate(5).is_none());
    }

    #[test]
    fn eviction_takes_lru_head_and_request_tail_first() {
        let mut p = BlockPool::new(5, 4, true);
        let a = p.allocate(4).unwrap();
        p.cache_full_blocks(&a, &[h(1), h(2), h(3), h(4)], None, &[0; 16], BlockKeys::default());
        p.take_events();
        // Freed last-first, as the scheduler does: block of h(4) becomes the LRU head.
        p.free(a.iter().rev());
        let got = p.allocate(1).unwrap();
        assert_eq!(got, vec![a[3]]);
        let ev = p.take_events();
        assert_eq!(ev, vec![KvEvent::BlockRemoved { block_hashes: vec![h(4)] }]);
        assert_eq!(p.lookup(&h(4)), None);
        assert_eq!(p.lookup(&h(1)), Some(a[0]));
    }

    #[test]
    fn touching_a_cached_block_protects_it_from_eviction() {
        let mut p = BlockPool::new(4, 4, true);
        let a = p.allocate(3).unwrap();
        p.cache_full_blocks(&a, &[h(1), h(2), h(3)], None, &[0; 12], BlockKeys::default());
        p.free(a.iter().rev());
        p.touch(&[a[2]]); // LRU head is now pulled out
        assert_eq!(p.num_free(), 2);
        let got = p.allocate(2).unwrap();
        assert!(!got.contains(&a[2]));
        assert_eq!(p.ref_cnt(a[2]), 1);
    }

    #[test]
    fn duplicate_hashes_are_kept_like_vllm() {
        let mut p = BlockPool::new(4, 4, true);
        let a = p.allocate(1).unwrap();
        let b = p.allocate(1).unwrap();
        p.cache_full_blocks(&a, &[h(7)], None, &[7; 4], BlockKeys::default());
        p.cache_full_blocks(&b, &[h(7)], None, &[7; 4], BlockKeys::default());
        assert_eq!(p.take_events().len(), 2);
        p.free(&a);
        p.free(&b);
        // Evicting `a` emits a removal even though `b` still holds the hash.
        let _ = p.allocate(2).unwrap();
        let ev = p.take_events();
        assert_eq!(ev.len(), 1, "only a's slot was reused so far: {ev:?}");
        assert_eq!(p.lookup(&h(7)), Some(b[0]));
    }

    #[test]
    fn reset_refuses_while_blocks_are_in_use() {
        let mut p = BlockPool::new(4, 4, true);
        let a = p.allocate(1).unwrap();
        p.cache_full_blocks(&a, &[h(1)], None, &[1; 4], BlockKeys::default());
        assert!(!p.reset_prefix_cache());
        p.free(&a);
        p.take_events();
        assert!(p.reset_prefix_cache());
        assert_eq!(p.take_events(), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(p.lookup(&h(1)), None);
    }

    #[test]
    fn caching_disabled_never_hits_or_emits() {
        let mut p = BlockPool::new(4, 4, false);
        let a = p.allocate(1).unwrap();
        p.cache_full_blocks(&a, &[h(1)], None, &[1; 4], BlockKeys::default());
        assert_eq!(p.lookup(&h(1)), None);
        assert!(p.take_events().is_empty());
    }
}
