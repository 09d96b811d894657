//! KV index benchmarks, release mode:
//! 1. `find_matches` latency for an 8,192-token prompt (block size 16 → 512 blocks) over an
//!    index of 1M blocks, with 8, 64 and 256 workers: p50/p99 of single calls, and the same
//!    query on the reference tree as the baseline;
//! 2. event ingestion: block operations per second on one core (stores of 16-block chains and
//!    their removals, as event tasks apply them);
//! 3. memory per (block, worker).
//!
//!   cargo build --release -p kvgate-bench && taskset -c 0 target/release/kv-index

use kvgate_bench::{Rng, percentile as pct};
use kvgate_kv::hash::{DEFAULT_SEED, Hasher};
use kvgate_kv::index::{FlatIndex, KvIndex, ReferenceTree};
use std::time::Instant;

/// Fills `idx` with ~`total_blocks` blocks spread over `workers`: conversations that share
/// system prompts (a tree with fan-out), each worker holding a share, plus the query prompt's
/// chain held in part by every worker so the search has real work to do.
fn fill(idx: &dyn KvIndex, workers: usize, total_blocks: usize, query: &[u64], rng: &mut Rng) -> usize {
    let h = Hasher::new(16, DEFAULT_SEED);
    let mut inserted = 0;
    let prefixes: Vec<Vec<u64>> = (0..64).map(|p| h.chain(None, &(0..16 * 32).map(|t| t + p * 100_000).collect::<Vec<u32>>())).collect();
    let mut conv = 0u32;
    while inserted < total_blocks {
        let w = (rng.next_u64() % workers as u64) as u16;
        let prefix = &prefixes[(rng.next_u64() % 64) as usize];
        let plen = 1 + (rng.next_u64() % prefix.len() as u64) as usize;
        idx.insert(w, None, &prefix[..plen]).expect("insert");
        let tail_tokens: Vec<u32> = (0..16 * 48).map(|t| t + conv * 1000 + 7_000_000).collect();
        let tail = h.chain(Some(prefix[plen - 1]), &tail_tokens);
        idx.insert(w, Some(prefix[plen - 1]), &tail).expect("insert");
        inserted += tail.len();
        conv += 1;
    }
    // Every worker holds a different-length prefix of the query chain.
    for w in 0..workers {
        let n = 1 + (rng.next_u64() % query.len() as u64) as usize;
        idx.insert(w as u16, None, &query[..n]).expect("insert");
    }
    inserted
}

fn main() {
    let h = Hasher::new(16, DEFAULT_SEED);
    let prompt: Vec<u32> = (0..8192u32).map(|i| i.wrapping_mul(2_654_435_761) % 100_000).collect();
    let query = h.chain(None, &prompt);
    assert_eq!(query.len(), 512);

    println!("## find_matches: 8,192-token prompt (512 blocks), index of ~1M blocks\n");
    println!("| workers | index | p50 | p99 | mean | reference tree p50 (same query) | speed-up p50 |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for workers in [8usize, 64, 256] {
        let flat = FlatIndex::new(workers, 1 << 20);
        let blocks = fill(&flat, workers, 1 << 20, &query, &mut Rng(workers as u64));
        let reference = ReferenceTree::new();
        fill(&reference, workers, 1 << 16, &query, &mut Rng(workers as u64 + 1));
        for _ in 0..2000 {
            std::hint::black_box(flat.find_matches(&query));
        }
        let mut lat = Vec::with_capacity(100_000);
        let t0 = Instant::now();
        for _ in 0..100_000 {
            let s = Instant::now();
            let m = flat.find_matches(std::hint::black_box(&query));
            lat.push(s.elapsed());
            std::hint::black_box(m);
        }
        let mean = t0.elapsed() / 100_000;
        let mut rlat = Vec::with_capacity(200);
        for _ in 0..200 {
            let s = Instant::now();
            std::hint::black_box(reference.find_matches(&query));
            rlat.push(s.elapsed());
        }
        let (p50, p99, r50) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99), pct(&mut rlat, 0.5));
        println!(
            "| {workers} | flat, {blocks} blocks | {:.2} µs | {:.2} µs | {:.2} µs | {:.1} µs | {:.0}× |",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            mean.as_secs_f64() * 1e6,
            r50.as_secs_f64() * 1e6,
            r50.as_secs_f64() / p50.as_secs_f64()
        );
    }

    println!("\n## Ingestion: block operations per second, one thread\n");
    println!("| workers | stores (blocks/s) | removes (blocks/s) | store+remove mix (block-ops/s) | reference tree mix (block-ops/s) |");
    println!("|---:|---:|---:|---:|---:|");
    for workers in [8usize, 64] {
        let chains: Vec<Vec<u64>> = (0..20_000u32).map(|c| h.chain(None, &(0..256).map(|t| t + c * 1000).collect::<Vec<u32>>())).collect();
        let flat = FlatIndex::new(workers, 1 << 20);
        let t = Instant::now();
        let mut ops = 0usize;
        for (i, c) in chains.iter().enumerate() {
            flat.insert((i % workers) as u16, None, c).unwrap();
            ops += c.len();
        }
        let store_rate = ops as f64 / t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut rops = 0usize;
        for (i, c) in chains.iter().enumerate() {
            // vLLM removes one hash per event, deepest first.
            for b in c.iter().rev() {
                flat.remove((i % workers) as u16, std::slice::from_ref(b)).unwrap();
                rops += 1;
            }
        }
        let remove_rate = rops as f64 / t.elapsed().as_secs_f64();
        let mix = |idx: &dyn KvIndex, n: usize| {
            let t = Instant::now();
            let mut ops = 0;
            for (i, c) in chains.iter().take(n).enumerate() {
                let w = (i % workers) as u16;
                idx.insert(w, None, c).unwrap();
                ops += c.len();
                if i >= 1000 {
                    let old = &chains[i - 1000];
                    for b in old.iter().rev() {
                        idx.remove(((i - 1000) % workers) as u16, std::slice::from_ref(b)).unwrap();
                        ops += 1;
                    }
                }
            }
            ops as f64 / t.elapsed().as_secs_f64()
        };
        let flat2 = FlatIndex::new(workers, 1 << 18);
        let mix_rate = mix(&flat2, chains.len());
        let reference_rate = mix(&ReferenceTree::new(), 4000);
        println!("| {workers} | {:.1} M | {:.1} M | {:.1} M | {:.1} M |", store_rate / 1e6, remove_rate / 1e6, mix_rate / 1e6, reference_rate / 1e6);
    }

    println!("\n## Memory per (block, worker)\n");
    println!("| workers | (block, worker) pairs | distinct blocks | bytes | bytes per (block, worker) |");
    println!("|---:|---:|---:|---:|---:|");
    for workers in [8usize, 64] {
        let flat = FlatIndex::new(workers, 1 << 20);
        fill(&flat, workers, 1 << 20, &query, &mut Rng(99));
        let pairs: usize = (0..workers as u16).map(|w| flat.block_count(w)).sum();
        let bytes = flat.memory_bytes();
        println!("| {workers} | {pairs} | {} | {} MiB | {:.1} |", flat.live_blocks(), bytes >> 20, bytes as f64 / pairs as f64);
    }
}
