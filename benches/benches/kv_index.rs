//! Criterion micro-benchmarks of the KV index: `find_matches` for an 8,192-token prompt on the
//! flat index (8 and 64 workers, ~1M blocks) and on the reference tree, and block hashing of the
//! prompt. The latency percentiles are in `src/bin/kv_index.rs` (criterion reports means).
//!
//!   cargo bench -p kvgate-bench --bench kv_index

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{Criterion, criterion_group, criterion_main};
use kvgate_kv::hash::{DEFAULT_SEED, Hasher};
use kvgate_kv::index::{FlatIndex, KvIndex, ReferenceTree};
use std::hint::black_box;

fn fill(idx: &dyn KvIndex, workers: usize, blocks: usize, query: &[u64]) {
    let h = Hasher::new(16, DEFAULT_SEED);
    let mut n = 0;
    let mut conv = 0u32;
    while n < blocks {
        let toks: Vec<u32> = (0..16 * 64).map(|t| t + conv * 2000).collect();
        let chain = h.chain(None, &toks);
        idx.insert((conv as usize % workers) as u16, None, &chain).unwrap();
        n += chain.len();
        conv += 1;
    }
    for w in 0..workers {
        idx.insert(w as u16, None, &query[..=(w * 7) % query.len()]).unwrap();
    }
}

fn bench(c: &mut Criterion) {
    let h = Hasher::new(16, DEFAULT_SEED);
    let prompt: Vec<u32> = (0..8192u32).map(|i| i.wrapping_mul(2_654_435_761) % 100_000).collect();
    let query = h.chain(None, &prompt);
    c.bench_function("hash 8192-token prompt (512 blocks)", |b| b.iter(|| h.chain(None, black_box(&prompt))));
    for workers in [8usize, 64] {
        let flat = FlatIndex::new(workers, 1 << 20);
        fill(&flat, workers, 1 << 20, &query);
        c.bench_function(&format!("flat find_matches 512 blocks, {workers} workers, 1M blocks"), |b| b.iter(|| flat.find_matches(black_box(&query))));
    }
    let reference = ReferenceTree::new();
    fill(&reference, 64, 1 << 16, &query);
    c.bench_function("reference find_matches 512 blocks, 64 workers, 64k blocks", |b| b.iter(|| reference.find_matches(black_box(&query))));
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
