//! What no router can beat on a trace: each request's time to first token with its prompt's
//! whole shared prefix already cached and nothing ahead of it (the *floor*), and what a
//! clairvoyant router gets when it knows every worker's cache and queue exactly and no decode
//! shares a prefill's steps (the *oracle*). Both use vllm-sim's own step model and token
//! budget, so they are the bounds of the fleet `compare` starts, not of some other machine.
//!
//! A router's TTFT percentiles read against these say how much of a figure is the trace's own
//! prefill and how much is routing: on #39's Mooncake replay every router measured ends near
//! 1.1 s at p90, and the floor's p90 (a 16k prompt computed alone) is 760 ms.
//!
//! The oracle sends each request to the worker where its prefill would end first (FCFS per
//! worker, unbounded caches that hold every prefix computed there). It is a greedy, not an
//! optimum, but it has what no real router has: exact knowledge and steps free of decodes.

use crate::percentile;
use crate::trace::{TRACE_BLOCK, TraceRequest};
use std::collections::HashMap;
use std::time::Duration;
use vllm_sim::timing::{StepShape, TimingModel};

/// The engine constants the bounds are computed with.
#[derive(Debug, Clone, Copy)]
pub struct Engine {
    /// vllm-sim's step-time model.
    pub timing: TimingModel,
    /// Tokens one step computes at most (`--max-num-batched-tokens`).
    pub chunk_tokens: usize,
    /// KV block size: a cached prefix counts in whole blocks.
    pub block_size: usize,
    /// Wall time = simulated time / `time_scale`.
    pub time_scale: f64,
}

impl Engine {
    /// The time, ms of wall time, to prefill `new` tokens on top of `cached` ones alone: one
    /// step per chunk, each carrying only that chunk.
    pub fn prefill_ms(&self, cached: usize, new: usize) -> f64 {
        let chunk = self.chunk_tokens.max(1);
        let (mut ctx, mut left, mut ms) = (cached, new, 0.0);
        while left > 0 {
            let c = left.min(chunk);
            let mut s = StepShape::default();
            s.add_prefill(ctx, c);
            ms += self.timing.step_ms(&s);
            ctx += c;
            left -= c;
        }
        ms / self.time_scale
    }

    /// Tokens of a `len`-token prompt a cache holding `shared` of its leading tokens saves:
    /// whole blocks, and never the last token (vLLM computes it to sample the first output).
    fn reusable(&self, shared: usize, len: usize) -> usize {
        let bs = self.block_size.max(1);
        (shared.min(len.saturating_sub(1)) / bs) * bs
    }
}

/// Prefixes of trace prompts, as a trie of hash-id blocks: for each chain of ids, the most
/// tokens of its last block any prompt put there (a prompt's last block may be partial).
#[derive(Debug, Default)]
struct Prefixes {
    nodes: HashMap<(usize, u64), (usize, usize)>,
}

impl Prefixes {
    /// Leading tokens of `ids` (a prompt of `len` tokens) already held.
    fn shared(&self, ids: &[u64], len: usize) -> usize {
        let mut parent = 0;
        let mut tokens = 0;
        for (i, &id) in ids.iter().enumerate() {
            let Some(&(node, held)) = self.nodes.get(&(parent, id)) else { break };
            let mine = block_len(i, len);
            tokens += held.min(mine);
            if held < mine {
                break;
            }
            parent = node;
        }
        tokens
    }

    /// Records the prompt `ids` of `len` tokens.
    fn insert(&mut self, ids: &[u64], len: usize) {
        let mut parent = 0;
        for (i, &id) in ids.iter().enumerate() {
            let next = self.nodes.len() + 1;
            let entry = self.nodes.entry((parent, id)).or_insert((next, 0));
            entry.1 = entry.1.max(block_len(i, len));
            parent = entry.0;
        }
    }
}

/// Tokens of block `i` of a `len`-token prompt.
fn block_len(i: usize, len: usize) -> usize {
    len.saturating_sub(i * TRACE_BLOCK).min(TRACE_BLOCK)
}

/// The ids and length of `r` as replayed, its prompt cut to `max_isl` tokens.
fn replayed(r: &TraceRequest, max_isl: usize) -> (&[u64], usize) {
    let len = r.input_length.min(max_isl);
    (&r.hash_ids[..len.div_ceil(TRACE_BLOCK).min(r.hash_ids.len())], len)
}

/// Each request's floor, ms: its prefill alone with every prefix an earlier request of the
/// trace computed already cached.
pub fn floor_ms(requests: &[TraceRequest], max_isl: usize, engine: &Engine) -> Vec<f64> {
    let mut seen = Prefixes::default();
    requests
        .iter()
        .map(|r| {
            let (ids, len) = replayed(r, max_isl);
            let cached = engine.reusable(seen.shared(ids, len), len);
            seen.insert(ids, len);
            engine.prefill_ms(cached, len - cached)
        })
        .collect()
}

/// Each request's time to first token under the oracle on `workers` workers, ms, with arrivals
/// `speedup` times faster than the trace's.
pub fn oracle_ms(requests: &[TraceRequest], max_isl: usize, engine: &Engine, workers: usize, speedup: f64) -> Vec<f64> {
    let speedup = if speedup > 0.0 { speedup } else { 1.0 };
    let mut caches: Vec<Prefixes> = (0..workers.max(1)).map(|_| Prefixes::default()).collect();
    let mut free_at = vec![0.0f64; caches.len()];
    requests
        .iter()
        .map(|r| {
            let at = r.timestamp as f64 / speedup;
            let (ids, len) = replayed(r, max_isl);
            let done = |w: usize| {
                let cached = engine.reusable(caches[w].shared(ids, len), len);
                free_at[w].max(at) + engine.prefill_ms(cached, len - cached)
            };
            let (w, end) = (0..caches.len()).map(|w| (w, done(w))).fold((0, f64::INFINITY), |best, x| if x.1 < best.1 { x } else { best });
            free_at[w] = end;
            caches[w].insert(ids, len);
            end - at
        })
        .collect()
}

/// The line `compare` adds to its notes for a trace workload.
pub fn note(requests: &[TraceRequest], max_isl: usize, engine: &Engine, workers: usize, speedup: f64) -> String {
    // The percentiles `compare` reports the routers' TTFT with.
    let ps = |v: &[f64]| {
        let mut d: Vec<Duration> = v.iter().map(|ms| Duration::from_secs_f64(ms.max(0.0) / 1000.0)).collect();
        let [p50, p90, p99] = [0.5, 0.9, 0.99].map(|p| percentile(&mut d, p).as_millis());
        format!("{p50} / {p90} / {p99} ms")
    };
    let floor = floor_ms(requests, max_isl, engine);
    let oracle = oracle_ms(requests, max_isl, engine, workers, speedup);
    format!(
        "TTFT bounds from vllm-sim's step model (benches/src/trace_floor.rs), p50 / p90 / p99: floor (each prompt alone, every earlier prefix cached) {}; oracle (exact knowledge, FCFS, no decode in its steps, {workers} workers) {}.",
        ps(&floor),
        ps(&oracle)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> Engine {
        Engine { timing: TimingModel::default(), chunk_tokens: 8192, block_size: 16, time_scale: 1.0 }
    }

    fn req(at: u64, len: usize, ids: &[u64]) -> TraceRequest {
        TraceRequest { timestamp: at, input_length: len, output_length: 1, hash_ids: ids.to_vec() }
    }

    #[test]
    fn a_prefill_is_one_step_per_chunk() {
        let e = engine();
        let one = e.prefill_ms(0, 8192);
        let t = e.timing;
        assert!((one - (t.step_overhead_ms + t.prefill_ms_per_token * 8192.0 + t.prefill_attn_ms_per_pair * 8192.0 * 4096.0)).abs() < 1e-9);
        // The second chunk attends over the first.
        let two = e.prefill_ms(0, 16_384);
        assert!(two > 2.0 * one, "{two} {one}");
        assert!((Engine { time_scale: 2.0, ..e }.prefill_ms(0, 8192) - one / 2.0).abs() < 1e-9);
        // 16k alone: the 760 ms #39's analysis quotes.
        assert!((two - 760.0).abs() < 1.0, "{two}");
    }

    #[test]
    fn the_floor_caches_every_earlier_prefix_in_whole_blocks_but_the_last_token() {
        let trace = [
            req(0, 1024, &[1, 2]),
            req(1, 1024, &[1, 2]),      // all of it: computes its last block (of 16) only
            req(2, 1000, &[1, 3]),      // the first 512 tokens
            req(3, 700, &[1, 3]),       // 512 + 188 of block 3's 488: its whole prompt
            req(4, 512 + 300, &[9, 3]), // a different first block shares nothing
        ];
        let e = engine();
        let f = floor_ms(&trace, usize::MAX, &e);
        assert!((f[0] - e.prefill_ms(0, 1024)).abs() < 1e-9);
        assert!((f[1] - e.prefill_ms(1008, 16)).abs() < 1e-9);
        assert!((f[2] - e.prefill_ms(512, 488)).abs() < 1e-9);
        assert!((f[3] - e.prefill_ms(688, 12)).abs() < 1e-9);
        assert!((f[4] - e.prefill_ms(0, 812)).abs() < 1e-9);
        // A cut prompt keeps its prefix: cut to 512 tokens, request 1 finds it all cached.
        let cut = floor_ms(&trace[..2], 512, &e);
        assert!((cut[1] - e.prefill_ms(496, 16)).abs() < 1e-9);
    }

    #[test]
    fn the_oracle_queues_only_when_every_worker_is_busy_and_follows_the_cache() {
        let e = engine();
        let long = e.prefill_ms(0, 8192);
        // Two at once on two workers: neither waits. Three at once on two: the third waits.
        let ids = |k: u64| (k * 100..k * 100 + 16).collect::<Vec<u64>>();
        let trace: Vec<TraceRequest> = (0..3).map(|k| req(0, 8192, &ids(k))).collect();
        let two = oracle_ms(&trace, usize::MAX, &e, 2, 1.0);
        assert!((two[0] - long).abs() < 1e-9 && (two[1] - long).abs() < 1e-9);
        assert!((two[2] - 2.0 * long).abs() < 1e-9, "{two:?}");
        // A repeat goes where its prefix is and computes one block.
        let again = [req(0, 8192, &ids(1)), req(0, 8192, &ids(2)), req(10_000, 8192, &ids(2))];
        let o = oracle_ms(&again, usize::MAX, &e, 2, 1.0);
        assert!((o[2] - e.prefill_ms(8176, 16)).abs() < 1e-9, "{o:?}");
        // Arrivals compressed by the speedup: 10 s at 10× is 1 s, still after both finish.
        let fast = oracle_ms(&again, usize::MAX, &e, 2, 10.0);
        assert!((fast[2] - o[2]).abs() < 1e-9);
    }
}
