//! What routing can and cannot win on a trace, for the whole request: the first token, the
//! time per output token and the end. The *floor*: each request alone, every prefix an earlier
//! request computed already cached and nothing ahead of it or beside it in a batch, which no
//! router beats. The *oracles*: what a clairvoyant router gets, one that knows every
//! worker's cache and queue exactly, on workers that schedule as vLLM does (FCFS, steps of at
//! most `max_num_batched_tokens`, decodes in every step; [`Worker`]). All of it runs on
//! vllm-sim's own step model and flags, so the figures are those of the fleet `compare`
//! starts. The oracles are references, not bounds, and optimistic ones: a prefix counts as
//! cached from when its request is placed (vllm-sim finds only computed blocks), caches never
//! evict, and neither `max_num_seqs` nor KV capacity limits a worker.
//!
//! A router's percentiles read against these say how much of a figure is the trace's own
//! work, how much the engine's scheduling and how much routing. Three oracles, because vLLM's
//! scheduler lets a prompt arriving mid-prefill fill the room left in the last step of the
//! prompt ahead, which lengthens that step by the newcomer's chunk and delays the first token
//! ahead by as much: [`Oracle::Greedy`] takes the worker where its own first token comes first,
//! [`Oracle::Considerate`] adds the delay it puts on the first tokens already queued there;
//! and because a router tuned for the first token is not the one that ends requests first,
//! [`Oracle::Finishing`] takes the worker where the request's own last token comes first. All
//! are greedy, not optimal, and their caches never evict.

use crate::load::report::Quantiles;
use crate::trace::{TRACE_BLOCK, TraceRequest};
use std::collections::HashMap;
use vllm_sim::timing::{StepShape, TimingModel};

/// The engine constants the floor and the oracles are computed with.
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
    /// The time, ms of wall time, to prefill `new` tokens on top of `cached` ones alone: a
    /// worker with nothing else to run ([`Worker`]), one step per chunk.
    pub fn prefill_ms(&self, cached: usize, new: usize) -> f64 {
        self.alone(cached, new, 0).first
    }

    /// When a request with `cached` tokens of its prompt cached, `new` to compute and `decode`
    /// output tokens after the first gets its first and its last token, ms of wall time, on a
    /// worker running nothing else.
    fn alone(&self, cached: usize, new: usize, decode: usize) -> Times {
        let mut alone = Worker::default();
        let mut done = [Times::default()];
        alone.arrive(0.0, Job { request: 0, ctx: cached, left: new, decode });
        alone.finish_all(self, &mut done);
        done[0]
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

/// When a request got its first and its last token, ms from an origin.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Times {
    /// The first token.
    pub first: f64,
    /// The last token (the first, for a one-token answer).
    pub last: f64,
}

/// What one request got, ms: time to first token, mean time per output token after the first
/// (`None` for a one-token answer), and end to end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// Time to first token.
    pub ttft: f64,
    /// Mean gap between output tokens, as `compare` reports a request's TPOT.
    pub tpot: Option<f64>,
    /// Arrival to last token.
    pub e2e: f64,
}

impl Outcome {
    /// The outcome of a request that arrived at `at`, decoded `decode` tokens after its first
    /// and got its tokens at `t`.
    fn of(at: f64, t: Times, decode: usize) -> Self {
        let tpot = (decode > 0).then(|| (t.last - t.first) / decode as f64);
        Self { ttft: t.first - at, tpot, e2e: t.last - at }
    }
}

/// Output tokens `r` decodes after its first, as replayed with outputs cut to `max_osl`.
fn decodes(r: &TraceRequest, max_osl: usize) -> usize {
    r.output_length.min(max_osl).saturating_sub(1)
}

/// Each request's floor: its prefill alone with every prefix an earlier request of the trace
/// computed already cached, then its decode alone, one token a step.
pub fn floor(requests: &[TraceRequest], (max_isl, max_osl): (usize, usize), engine: &Engine) -> Vec<Outcome> {
    let mut seen = Prefixes::default();
    requests
        .iter()
        .map(|r| {
            let (ids, len) = replayed(r, max_isl);
            let cached = engine.reusable(seen.shared(ids, len), len);
            seen.insert(ids, len);
            let decode = decodes(r, max_osl);
            Outcome::of(0.0, engine.alone(cached, (len - cached).max(1), decode), decode)
        })
        .collect()
}

/// How the oracle chooses a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Oracle {
    /// Where the request's own first token comes first.
    Greedy,
    /// Where its own first token plus the delay it puts on the first tokens of the requests
    /// already there (by taking the room in their last step) is least.
    Considerate,
    /// Where the request's own last token comes first.
    Finishing,
}

/// A request on a worker: the tokens of its prompt computed (or cached) so far and those left,
/// then the output tokens it has still to decode.
#[derive(Debug, Clone, Copy)]
struct Job {
    request: usize,
    ctx: usize,
    left: usize,
    decode: usize,
}

/// One worker as vLLM (and vllm-sim) schedules: its requests in the order they came, each step
/// giving every one in turn what it needs (the rest of its prompt, or one token to decode) out
/// of a budget of `chunk_tokens`, a step formed when the previous one ends. So a prompt
/// arriving while a step runs waits for the next one, fills whatever room the requests ahead
/// leave in it, and lengthens that step for every one of them.
#[derive(Debug, Clone, Default)]
struct Worker {
    running: Vec<Job>,
    /// When the last step formed ends (the worker is idle after it if nothing runs).
    step_end: f64,
}

impl Worker {
    /// Runs every step that starts by `t`, recording tokens in `done`.
    fn run_until(&mut self, t: f64, engine: &Engine, done: &mut [Times]) {
        // A step starting at `t` exactly is formed with what arrives at `t`.
        while !self.running.is_empty() && self.step_end < t {
            self.step(engine, done);
        }
    }

    /// Runs steps until every prompt queued now has its first token (decodes go on after).
    fn prefill_all(&mut self, engine: &Engine, done: &mut [Times]) {
        while self.running.iter().any(|j| j.left > 0) {
            self.step(engine, done);
        }
    }

    /// Runs steps until every request queued now has its last token.
    fn finish_all(&mut self, engine: &Engine, done: &mut [Times]) {
        while !self.running.is_empty() {
            self.step(engine, done);
        }
    }

    /// Runs steps until request `r`, queued here, has its last token.
    fn finish(&mut self, r: usize, engine: &Engine, done: &mut [Times]) {
        while self.running.iter().any(|j| j.request == r) {
            self.step(engine, done);
        }
    }

    fn step(&mut self, engine: &Engine, done: &mut [Times]) {
        let mut budget = engine.chunk_tokens.max(1);
        let mut shape = StepShape::default();
        let (mut first, mut last) = (Vec::new(), Vec::new());
        for job in &mut self.running {
            if budget == 0 {
                break;
            }
            if job.left > 0 {
                let n = job.left.min(budget);
                shape.add_prefill(job.ctx, n);
                job.ctx += n;
                job.left -= n;
                budget -= n;
                if job.left == 0 {
                    first.push(job.request);
                    if job.decode == 0 {
                        last.push(job.request);
                    }
                }
            } else {
                job.ctx += 1;
                shape.add_decode(job.ctx);
                job.decode = job.decode.saturating_sub(1);
                budget -= 1;
                if job.decode == 0 {
                    last.push(job.request);
                }
            }
        }
        self.step_end += engine.timing.step_ms(&shape) / engine.time_scale;
        for r in first {
            done[r].first = self.step_end;
        }
        for r in last {
            done[r].last = self.step_end;
        }
        self.running.retain(|j| j.left > 0 || j.decode > 0);
    }

    /// Queues `job` arriving at `t` (steps up to `t` already run).
    fn arrive(&mut self, t: f64, job: Job) {
        if self.running.is_empty() {
            self.step_end = self.step_end.max(t);
        }
        self.running.push(job);
    }

    /// What `job` arriving at `t` would cost here under `how`: when its first token comes, plus
    /// (considerate) how much later the first tokens of the prompts already queued come, or
    /// (finishing) when its last token comes.
    fn cost(&self, t: f64, job: Job, how: Oracle, engine: &Engine, scratch: &mut [Times]) -> f64 {
        let mut with = self.clone();
        with.arrive(t, job);
        if how == Oracle::Finishing {
            with.finish(job.request, engine, scratch);
            return scratch[job.request].last;
        }
        with.prefill_all(engine, scratch);
        let own = scratch[job.request].first;
        let queued: Vec<usize> = self.running.iter().filter(|j| j.left > 0).map(|j| j.request).collect();
        if how == Oracle::Greedy || queued.is_empty() {
            return own;
        }
        let later: f64 = queued.iter().map(|&r| scratch[r].first).sum();
        let mut without = self.clone();
        without.prefill_all(engine, scratch);
        own + later - queued.iter().map(|&r| scratch[r].first).sum::<f64>()
    }
}

/// What each request gets when a router that knows every worker's cache and queue exactly
/// places it (`how`) on one of `workers` workers that schedule as vLLM does ([`Worker`]), each
/// request decoding its output (cut to `max_osl`) after its first token; arrivals `speedup`
/// times faster than the trace's. A prefix counts as cached on a worker from when a request
/// bringing it is placed there, and caches never evict.
pub fn oracle(requests: &[TraceRequest], (max_isl, max_osl): (usize, usize), engine: &Engine, workers: usize, speedup: f64, how: Oracle) -> Vec<Outcome> {
    let speedup = if speedup > 0.0 { speedup } else { 1.0 };
    let mut fleet: Vec<(Worker, Prefixes)> = (0..workers.max(1)).map(|_| Default::default()).collect();
    let mut done = vec![Times::default(); requests.len()];
    let mut scratch = vec![Times::default(); requests.len()];
    let at: Vec<f64> = requests.iter().map(|r| r.timestamp as f64 / speedup).collect();
    for (i, r) in requests.iter().enumerate() {
        let (ids, len) = replayed(r, max_isl);
        let job = |cache: &Prefixes| {
            let cached = engine.reusable(cache.shared(ids, len), len);
            // An empty prompt still computes a token to answer.
            Job { request: i, ctx: cached, left: (len - cached).max(1), decode: decodes(r, max_osl) }
        };
        let mut best: Option<(usize, f64, Job)> = None;
        for (w, (worker, cache)) in fleet.iter_mut().enumerate() {
            worker.run_until(at[i], engine, &mut done);
            let here = job(cache);
            let c = worker.cost(at[i], here, how, engine, &mut scratch);
            if best.is_none_or(|(_, least, _)| c < least) {
                best = Some((w, c, here));
            }
        }
        let (w, _, here) = best.expect("at least one worker");
        let (worker, cache) = &mut fleet[w];
        worker.arrive(at[i], here);
        cache.insert(ids, len);
    }
    for (worker, _) in &mut fleet {
        worker.finish_all(engine, &mut done);
    }
    requests.iter().zip(done.iter().zip(&at)).map(|(r, (&t, &a))| Outcome::of(a, t, decodes(r, max_osl))).collect()
}

/// The figures `compare` holds a router to, ms: TTFT p50 / p90 / p99, TPOT p90, end to end p90
/// / p99.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures(pub [f64; 6]);

impl Figures {
    /// Their names, in order.
    pub const NAMES: [&'static str; 6] = ["TTFT p50", "TTFT p90", "TTFT p99", "TPOT p90", "E2E p90", "E2E p99"];

    /// Of a reference's outcomes.
    pub fn of(outcomes: &[Outcome]) -> Self {
        let q = |f: &dyn Fn(&Outcome) -> Option<f64>| Quantiles::of(&mut outcomes.iter().filter_map(f).collect::<Vec<f64>>());
        Self::from_quantiles(&q(&|o| Some(o.ttft)), &q(&|o| o.tpot), &q(&|o| Some(o.e2e)))
    }

    /// Of a router's measured quantiles.
    pub fn from_quantiles(ttft: &Quantiles, tpot: &Quantiles, e2e: &Quantiles) -> Self {
        Self([ttft.p50, ttft.p90, ttft.p99, tpot.p90, e2e.p90, e2e.p99])
    }

    /// Each figure's least over `all` (`None` when empty).
    pub fn best(all: impl IntoIterator<Item = Figures>) -> Option<Self> {
        all.into_iter().reduce(|a, b| Self(std::array::from_fn(|i| a.0[i].min(b.0[i]))))
    }

    /// Each of these over `reference`'s: how far a router is from it (1 = level).
    pub fn over(&self, reference: &Figures) -> [f64; 6] {
        std::array::from_fn(|i| if reference.0[i] > 0.0 { self.0[i] / reference.0[i] } else { f64::NAN })
    }
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [t50, t90, t99, tpot, e90, e99] = self.0;
        write!(f, "TTFT {t50:.0} / {t90:.0} / {t99:.0} ms, TPOT p90 {tpot:.1} ms, E2E p90 / p99 {:.2} / {:.2} s", e90 / 1000.0, e99 / 1000.0)
    }
}

/// A trace's references on a fleet: the floor and the three clairvoyant routers.
#[derive(Debug, Clone, PartialEq)]
pub struct References {
    /// Each request alone, every earlier prefix cached.
    pub floor: Figures,
    /// The clairvoyant routers, named, in [`Oracle`] order.
    pub clairvoyant: Vec<(&'static str, Figures)>,
}

impl References {
    /// The references of `requests` on `workers` workers of `engine`, replayed `speedup` times
    /// faster with prompts and outputs cut to `cut`.
    pub fn of(requests: &[TraceRequest], cut: (usize, usize), engine: &Engine, workers: usize, speedup: f64) -> Self {
        let workers = workers.max(1);
        let of = |how| Figures::of(&oracle(requests, cut, engine, workers, speedup, how));
        Self {
            floor: Figures::of(&floor(requests, cut, engine)),
            clairvoyant: vec![
                ("earliest own first token", of(Oracle::Greedy)),
                ("least own first token plus imposed delay", of(Oracle::Considerate)),
                ("earliest own last token", of(Oracle::Finishing)),
            ],
        }
    }

    /// Each figure's best among the clairvoyant routers.
    pub fn best_clairvoyant(&self) -> Option<Figures> {
        Figures::best(self.clairvoyant.iter().map(|(_, f)| *f))
    }

    /// The line `compare` adds to its notes.
    pub fn note(&self, workers: usize) -> String {
        let oracles = self.clairvoyant.iter().map(|(name, f)| format!("{name} {f}")).collect::<Vec<_>>().join("; ");
        format!(
            "References from vllm-sim's step model (benches/src/trace_floor.rs): the floor (each request alone, every earlier prefix cached) {}; \
             clairvoyant routers on {workers} workers scheduling as vLLM does (references, not bounds): {oracles}.",
            self.floor
        )
    }

    /// How far `measured` is from the best clairvoyant figure of each kind, as a line of notes.
    pub fn distance(&self, label: &str, measured: &Figures) -> Option<String> {
        let best = self.best_clairvoyant()?;
        let parts: Vec<String> = Figures::NAMES.iter().zip(measured.over(&best)).map(|(name, r)| format!("{name} {r:.2}x")).collect();
        Some(format!("{label}: over the best clairvoyant reference: {}", parts.join(", ")))
    }
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

    const WHOLE: (usize, usize) = (usize::MAX, usize::MAX);

    fn ttfts(v: &[Outcome]) -> Vec<f64> {
        v.iter().map(|o| o.ttft).collect()
    }

    fn floor_ms(trace: &[TraceRequest], max_isl: usize, e: &Engine) -> Vec<f64> {
        ttfts(&floor(trace, (max_isl, usize::MAX), e))
    }

    fn oracle_ms(trace: &[TraceRequest], cut: (usize, usize), e: &Engine, workers: usize, speedup: f64, how: Oracle) -> Vec<f64> {
        ttfts(&oracle(trace, cut, e, workers, speedup, how))
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
        // 16k alone: the 760 ms the latency-objective analysis quotes.
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
        let two = oracle_ms(&trace, (usize::MAX, usize::MAX), &e, 2, 1.0, Oracle::Greedy);
        assert!((two[0] - long).abs() < 1e-9 && (two[1] - long).abs() < 1e-9);
        assert!((two[2] - 2.0 * long).abs() < 1e-9, "{two:?}");
        // A repeat goes where its prefix is and computes one block.
        let again = [req(0, 8192, &ids(1)), req(0, 8192, &ids(2)), req(10_000, 8192, &ids(2))];
        let o = oracle_ms(&again, (usize::MAX, usize::MAX), &e, 2, 1.0, Oracle::Greedy);
        assert!((o[2] - e.prefill_ms(8176, 16)).abs() < 1e-9, "{o:?}");
        // Arrivals compressed by the speedup: 10 s at 10× is 1 s, still after both finish.
        let fast = oracle_ms(&again, (usize::MAX, usize::MAX), &e, 2, 10.0, Oracle::Greedy);
        assert!((fast[2] - o[2]).abs() < 1e-9);
    }

    #[test]
    fn a_prompt_arriving_mid_prefill_fills_the_last_step_and_only_the_considerate_oracle_avoids_it() {
        let e = engine();
        let ids = |k: u64, n: u64| (k * 100..k * 100 + n).collect::<Vec<u64>>();
        // A: 8,200 tokens, a full step then 8. C, 100 ms later, goes to the idle worker. B, at
        // 200 ms, finishes first by filling A's last step, which delays A's first token by a
        // whole chunk; waiting for C's worker costs B less than that.
        let a = 8200;
        let trace = [req(0, a, &ids(1, 17)), req(100, 8192, &ids(2, 16)), req(200, 8192, &ids(3, 16))];
        let alone = e.prefill_ms(0, a);
        let greedy = oracle_ms(&trace, (usize::MAX, usize::MAX), &e, 2, 1.0, Oracle::Greedy);
        assert!(greedy[0] > alone + 250.0, "B took the room in A's last step: {greedy:?} against {alone}");
        let considerate = oracle_ms(&trace, (usize::MAX, usize::MAX), &e, 2, 1.0, Oracle::Considerate);
        assert!((considerate[0] - alone).abs() < 1e-9, "{considerate:?} against {alone}, greedy {greedy:?}");
        assert!(considerate[2] > greedy[2], "B pays for it: {considerate:?} {greedy:?}");
        let refs = References::of(&trace, WHOLE, &e, 0, 0.0);
        assert!(refs.note(1).starts_with("References from"), "no workers or speed-up: one worker, real time");
    }

    #[test]
    fn a_routers_distance_is_each_figure_over_the_best_clairvoyant_one() {
        let refs = References {
            floor: Figures([1.0; 6]),
            clairvoyant: vec![("a", Figures([100.0, 200.0, 300.0, 10.0, 1000.0, 2000.0])), ("b", Figures([50.0, 400.0, 300.0, 20.0, 500.0, 4000.0]))],
        };
        assert_eq!(refs.best_clairvoyant(), Some(Figures([50.0, 200.0, 300.0, 10.0, 500.0, 2000.0])));
        let line = refs.distance("r", &Figures([100.0, 200.0, 600.0, 15.0, 500.0, 3000.0])).unwrap();
        assert_eq!(
            line,
            "r: over the best clairvoyant reference: TTFT p50 2.00x, TTFT p90 1.00x, TTFT p99 2.00x, TPOT p90 1.50x, E2E p90 1.00x, E2E p99 1.50x"
        );
        assert_eq!(References { floor: Figures([0.0; 6]), clairvoyant: Vec::new() }.distance("r", &Figures([1.0; 6])), None);
    }

    #[test]
    fn a_requests_floor_is_its_prefill_then_one_decode_step_per_token_alone() {
        let e = engine();
        let mut r = req(0, 1024, &[1, 2]);
        r.output_length = 11;
        let [o] = floor(&[r.clone()], WHOLE, &e)[..] else { panic!("one outcome") };
        assert!((o.ttft - e.prefill_ms(0, 1024)).abs() < 1e-9);
        let step = |ctx: usize| {
            let mut s = StepShape::default();
            s.add_decode(ctx);
            e.timing.step_ms(&s)
        };
        let decode: f64 = (1025..1035).map(step).sum();
        assert!((o.e2e - o.ttft - decode).abs() < 1e-9, "{o:?} against {decode}");
        assert!((o.tpot.unwrap() - decode / 10.0).abs() < 1e-9);
        // Cut to one output token: no TPOT, the end is the first token.
        let [one] = floor(&[r], (usize::MAX, 1), &e)[..] else { panic!("one outcome") };
        assert_eq!((one.tpot, one.e2e), (None, one.ttft));
    }

    #[test]
    fn the_finishing_oracle_prices_the_decode_the_first_token_oracles_ignore() {
        let e = engine();
        // Thirty long-context decodes: the next step soon, every step slow. Against an idle
        // worker whose current step ends later.
        let decoding = Worker { running: (0..30).map(|r| Job { request: r, ctx: 20_000, left: 0, decode: 1000 }).collect(), step_end: 50.0 };
        let idle = Worker { running: Vec::new(), step_end: 100.0 };
        let x = Job { request: 30, ctx: 0, left: 16, decode: 49 };
        let mut scratch = vec![Times::default(); 31];
        let cost = |w: &Worker, how, scratch: &mut [Times]| w.cost(0.0, x, how, &e, scratch);
        assert!(cost(&decoding, Oracle::Greedy, &mut scratch) < cost(&idle, Oracle::Greedy, &mut scratch), "its first token comes first among the decodes");
        assert!(
            cost(&idle, Oracle::Finishing, &mut scratch) < cost(&decoding, Oracle::Finishing, &mut scratch),
            "its last token comes first on the idle worker"
        );
        assert!(cost(&idle, Oracle::Finishing, &mut scratch) > cost(&idle, Oracle::Greedy, &mut scratch));
    }
}
