//! Property tests: random interleavings of inserts, removes, clears and queries give identical
//! answers on the flat index and the reference tree; a multi-threaded stress test.

use super::*;
use crate::hash::{DEFAULT_SEED, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// xorshift64*: deterministic cases from a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Chains that share prefixes: a small alphabet and tree-shaped token sequences.
fn chains(rng: &mut Rng, n: usize, bs: usize) -> Vec<Vec<BlockHash>> {
    let h = Hasher::new(bs, DEFAULT_SEED);
    let mut seqs: Vec<Vec<u32>> = Vec::new();
    for _ in 0..n {
        let mut t: Vec<u32> = if !seqs.is_empty() && rng.below(3) > 0 {
            let base = &seqs[rng.below(seqs.len())];
            let keep = rng.below(base.len() / bs + 1) * bs;
            base[..keep].to_vec()
        } else {
            Vec::new()
        };
        let extra = (1 + rng.below(6)) * bs;
        t.extend((0..extra).map(|_| rng.below(3) as u32));
        seqs.push(t);
    }
    seqs.iter().map(|t| h.chain(None, t)).collect()
}

enum Op {
    Insert(WorkerId, Option<BlockHash>, Vec<BlockHash>),
    Remove(WorkerId, Vec<BlockHash>),
    Clear(WorkerId),
}

fn random_op(rng: &mut Rng, cs: &[Vec<BlockHash>], workers: usize) -> Op {
    let w = rng.below(workers) as WorkerId;
    let c = &cs[rng.below(cs.len())];
    match rng.below(20) {
        0 => Op::Clear(w),
        1..=6 => {
            let k = rng.below(c.len());
            let n = 1 + rng.below(2);
            Op::Remove(w, c[k..(k + n).min(c.len())].to_vec())
        }
        _ => {
            // Mostly valid inserts (from the start, or continuing from a random point), some
            // with a parent the worker may not hold.
            let k = if rng.below(2) == 0 { 0 } else { rng.below(c.len()) };
            let n = 1 + rng.below(c.len() - k);
            let parent = if k == 0 { None } else { Some(c[k - 1]) };
            Op::Insert(w, parent, c[k..k + n].to_vec())
        }
    }
}

fn apply(idx: &dyn KvIndex, op: &Op) -> Result<(), IndexError> {
    match op {
        Op::Insert(w, p, b) => idx.insert(*w, *p, b),
        Op::Remove(w, b) => idx.remove(*w, b),
        Op::Clear(w) => {
            idx.clear(*w);
            Ok(())
        }
    }
}

#[test]
fn flat_index_matches_the_reference_on_random_interleavings() {
    for case in 0..300u64 {
        let mut rng = Rng(crate::hash::PHI ^ case.wrapping_mul(0x1000_0001));
        let workers = [1, 3, 8, 70, 200][case as usize % 5];
        let cs = chains(&mut rng, 12, 2 + (case as usize % 3));
        let reference = ReferenceTree::new();
        // A tiny initial table forces rebuilds along the way.
        let flat = FlatIndex::new(workers, 4);
        for step in 0..250 {
            let op = random_op(&mut rng, &cs, workers);
            let (r, f) = (apply(&reference, &op), apply(&flat, &op));
            assert_eq!(r, f, "case {case} step {step}: results differ");
            let q = &cs[rng.below(cs.len())];
            assert_eq!(reference.find_matches(q), flat.find_matches(q), "case {case} step {step}: find_matches differ");
            let w = rng.below(workers) as WorkerId;
            assert_eq!(reference.block_count(w), flat.block_count(w), "case {case} step {step}: block counts differ");
        }
        for q in &cs {
            assert_eq!(reference.find_matches(q), flat.find_matches(q), "case {case}: final state differs");
        }
    }
}

#[test]
fn semantics_refcount_cascade_and_unknown_parent() {
    for idx in [&ReferenceTree::new() as &dyn KvIndex, &FlatIndex::new(4, 16)] {
        let (a, b, c, d) = (10, 11, 12, 13);
        assert_eq!(idx.insert(0, Some(a), &[b]), Err(IndexError::UnknownParent(a)));
        idx.insert(0, None, &[a, b, c]).unwrap();
        idx.insert(0, Some(a), &[b]).unwrap(); // b stored twice (vLLM duplicate)
        idx.insert(1, None, &[a, d]).unwrap();
        assert_eq!(idx.find_matches(&[a, b, c]), Matches { scores: vec![(0, 3), (1, 1)] });
        idx.remove(0, &[b]).unwrap(); // one of two references
        assert_eq!(idx.find_matches(&[a, b, c]).get(0), 3);
        idx.remove(0, &[b]).unwrap(); // last reference: b and c go
        assert_eq!(idx.find_matches(&[a, b, c]).get(0), 1);
        assert_eq!(idx.block_count(0), 1);
        assert_eq!(idx.remove(0, &[c]), Err(IndexError::NotFound(c)));
        idx.clear(1);
        assert_eq!(idx.find_matches(&[a, d]), Matches { scores: vec![(0, 1)] });
        assert_eq!(idx.find_matches(&[]), Matches::default());
    }
    assert_eq!(FlatIndex::new(4, 16).insert(9, None, &[1]), Err(IndexError::WorkerOutOfRange(9)));
}

#[test]
fn readers_and_writers_concurrently_stay_consistent() {
    let mut rng = Rng(42);
    let cs = Arc::new(chains(&mut rng, 40, 4));
    let workers = 64;
    let flat = Arc::new(FlatIndex::new(workers, 8));
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for r in 0..3 {
        let (flat, cs, stop) = (flat.clone(), cs.clone(), stop.clone());
        readers.push(std::thread::spawn(move || {
            let mut rng = Rng(1000 + r);
            let mut queries = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let q = &cs[rng.below(cs.len())];
                let m = flat.find_matches(q);
                for &(w, n) in &m.scores {
                    assert!((w as usize) < workers && n >= 1 && n as usize <= q.len(), "bad score {w}:{n}");
                }
                assert!(m.scores.windows(2).all(|p| p[0].0 < p[1].0), "sorted, no duplicates");
                queries += 1;
            }
            queries
        }));
    }
    // Two writers (each owns half of the workers, as one event task owns a worker), mirrored
    // into one reference so the final state can be compared.
    let reference = Arc::new(ReferenceTree::new());
    let mut writers = Vec::new();
    for half in 0..2u64 {
        let (flat, cs, reference) = (flat.clone(), cs.clone(), reference.clone());
        writers.push(std::thread::spawn(move || {
            let mut rng = Rng(7 + half);
            for _ in 0..20_000 {
                let mut op = random_op(&mut rng, &cs, workers / 2);
                let shift = |w: WorkerId| w * 2 + half as WorkerId;
                op = match op {
                    Op::Insert(w, p, b) => Op::Insert(shift(w), p, b),
                    Op::Remove(w, b) => Op::Remove(shift(w), b),
                    Op::Clear(w) => Op::Clear(shift(w)),
                };
                assert_eq!(apply(flat.as_ref(), &op), apply(reference.as_ref(), &op));
            }
        }));
    }
    for w in writers {
        w.join().expect("writer ok");
    }
    stop.store(true, Ordering::Relaxed);
    let total: u64 = readers.into_iter().map(|r| r.join().expect("reader ok")).sum();
    assert!(total > 0);
    for q in cs.iter() {
        assert_eq!(flat.find_matches(q), reference.find_matches(q));
    }
    for w in 0..workers as WorkerId {
        assert_eq!(flat.block_count(w), reference.block_count(w));
    }
}

#[test]
fn growth_across_rebuilds_keeps_answers_and_parents() {
    // Starts at the smallest table and grows through many sizes (not powers of two). Parents
    // are kept as table slots, so cascades after rebuilds check that they were rewritten.
    let workers = 8;
    let flat = FlatIndex::new(workers, 1);
    let reference = ReferenceTree::new();
    let h = Hasher::new(4, DEFAULT_SEED);
    let mut caps = vec![flat.table_capacity()];
    let mut chains: Vec<(WorkerId, Vec<BlockHash>)> = Vec::new();
    for c in 0..600u32 {
        let w = (c as usize % workers) as WorkerId;
        // The first 8 blocks are shared by a group of chains of the same worker.
        let tokens: Vec<u32> = (0..256).map(|t| if t < 32 { c / 64 * 64 + u32::from(w) } else { c * 1000 + t }).collect();
        let chain = h.chain(None, &tokens);
        for idx in [&flat as &dyn KvIndex, &reference] {
            idx.insert(w, None, &chain[..8]).unwrap();
            idx.insert(w, Some(chain[7]), &chain[8..]).unwrap();
        }
        if caps.last() != Some(&flat.table_capacity()) {
            caps.push(flat.table_capacity());
            // Just rebuilt: cut an older chain in the middle (a cascade over its tail).
            if let Some((ow, old)) = chains.get(chains.len() / 2) {
                assert_eq!(flat.remove(*ow, &old[30..31]), reference.remove(*ow, &old[30..31]));
            }
        }
        // Drop the chain's leaf: its parent's child count is settled later, possibly after a
        // rebuild has moved the parent to another slot.
        assert_eq!(flat.remove(w, &chain[63..]), reference.remove(w, &chain[63..]));
        chains.push((w, chain));
    }
    assert!(caps.len() >= 6, "rebuilt several times: {caps:?}");
    assert!(caps.iter().any(|c| !c.is_power_of_two()), "{caps:?}");
    let load = flat.live_blocks() as f64 / flat.table_capacity() as f64;
    assert!((0.5..=0.8).contains(&load), "load {load}");
    for (_, c) in &chains {
        assert_eq!(flat.find_matches(c), reference.find_matches(c));
    }
    // Cascades from the shared prefixes' last blocks, then from the roots: every descendant
    // must be found through its (rewritten) parent slot.
    for (w, c) in chains.iter().step_by(3) {
        assert_eq!(flat.remove(*w, &c[40..41]), reference.remove(*w, &c[40..41]));
        assert_eq!(flat.block_count(*w), reference.block_count(*w));
    }
    for (w, c) in &chains {
        assert_eq!(flat.remove(*w, &c[8..9]), reference.remove(*w, &c[8..9]));
        assert_eq!(flat.block_count(*w), reference.block_count(*w));
    }
    for (w, c) in &chains {
        assert_eq!(flat.find_matches(c), reference.find_matches(c));
        remove_all_refs(&flat, &reference, *w, c[0]);
    }
    assert_eq!(flat.live_blocks(), 0);
}

/// Removes every reference to `b` from both indexes.
fn remove_all_refs(flat: &FlatIndex, reference: &ReferenceTree, w: WorkerId, b: BlockHash) {
    while reference.block_count(w) > 0 && reference.remove(w, &[b]).is_ok() {
        flat.remove(w, &[b]).unwrap();
        assert_eq!(flat.block_count(w), reference.block_count(w));
    }
    assert_eq!(flat.block_count(w), reference.block_count(w));
}

#[test]
fn memory_stays_under_64_bytes_per_block_worker_while_growing() {
    let workers = 8;
    let flat = FlatIndex::new(workers, 1);
    let mut pairs = 0;
    for c in 0..6000u64 {
        let chain: Vec<BlockHash> = (0..32).map(|i| crate::hash::mix((c << 8) | i).max(1)).collect();
        flat.insert((c % workers as u64) as WorkerId, None, &chain).unwrap();
        pairs += chain.len();
        if pairs >= 16_000 {
            let per_pair = flat.memory_bytes() as f64 / pairs as f64;
            assert!(per_pair <= 64.0, "{pairs} pairs: {per_pair:.1} bytes each");
        }
    }
}

#[test]
fn reference_counts_past_u16_stay_exact() {
    let (a, b) = (10, 11);
    let n = u16::MAX as usize + 4465;
    for idx in [&ReferenceTree::new() as &dyn KvIndex, &FlatIndex::new(2, 16)] {
        idx.insert(1, None, &[a]).unwrap();
        for _ in 0..n {
            idx.insert(1, Some(a), &[b]).unwrap();
        }
        for _ in 1..n {
            idx.remove(1, &[b]).unwrap();
        }
        assert_eq!(idx.find_matches(&[a, b]).get(1), 2, "one reference left");
        idx.remove(1, &[b]).unwrap();
        assert_eq!(idx.find_matches(&[a, b]).get(1), 1);
        idx.remove(1, &[a]).unwrap();
        // References past the limit are forgotten with the block (clear, cascade): counting up
        // to the limit again and back down drops it.
        let forgets: [fn(&dyn KvIndex); 2] = [|i| i.clear(1), |i| i.remove(1, &[10]).unwrap()];
        for forget in forgets {
            idx.insert(1, None, &[a]).unwrap();
            idx.insert(1, Some(a), &vec![b; n]).unwrap();
            forget(idx);
            assert_eq!(idx.block_count(1), 0);
            idx.insert(1, None, &[a]).unwrap();
            idx.insert(1, Some(a), &vec![b; u16::MAX as usize]).unwrap();
            for _ in 0..u16::MAX {
                idx.remove(1, &[b]).unwrap();
            }
            assert_eq!(idx.find_matches(&[a, b]).get(1), 1);
            idx.remove(1, &[a]).unwrap();
            assert_eq!(idx.block_count(1), 0);
        }
    }
}

#[test]
fn held_children_counts_past_u16_still_cascade() {
    let flat = FlatIndex::new(2, 16);
    let p = 1;
    let kids: Vec<BlockHash> = (0..70_000).map(|i| 1_000_000 + i).collect();
    // `p` with 70,000 children (its count stuck at the 16-bit limit), a grandchild under child
    // `holder`, then every child but the last removed.
    let all_but_one_child_gone = |holder: usize| {
        flat.insert(0, None, &[p]).unwrap();
        for &k in &kids {
            flat.insert(0, Some(p), &[k]).unwrap();
        }
        flat.insert(0, Some(kids[holder]), &[7]).unwrap();
        for &k in &kids[..kids.len() - 1] {
            flat.remove(0, &[k]).unwrap();
        }
    };
    // The count stuck at its limit: removing all but one child (one with a grandchild) leaves
    // `p` looking for children when it goes.
    all_but_one_child_gone(5);
    assert_eq!(flat.block_count(0), 2);
    assert_eq!(flat.find_matches(&[p, kids[69_999]]).get(0), 2);
    flat.remove(0, &[p]).unwrap();
    assert_eq!((flat.block_count(0), flat.live_blocks()), (0, 0));
    assert_eq!(flat.find_matches(&[p, kids[69_999]]), Matches::default());
    // Same with the last child still holding a grandchild.
    all_but_one_child_gone(69_999);
    flat.remove(0, &[p]).unwrap();
    assert_eq!((flat.block_count(0), flat.live_blocks()), (0, 0));
}
