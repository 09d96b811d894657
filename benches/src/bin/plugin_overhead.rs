//! What a WebAssembly routing policy adds to a decision: one call into a plugin
//! with 64 candidate workers, against the built-in `kv` cost choosing among the same 64 in the
//! same run. Three plugins: `hostile` in its well-behaved mode (pins the highest id: the bare
//! cost of a call: copying the request and 64 records in, the answer out), and the
//! session-affinity example with and without its header (rendezvous hashing over 64 workers;
//! kvgate's kv cost over 64 workers). Release build, one pinned core.
//!
//!   cargo build --release -p kvgate-bench && taskset -c 0 target/release/plugin-overhead

use kvgate_filters::route::{Candidate, KvParams, KvPolicy, Policy, RequestSummary};
use kvgate_plugins::sandbox::Limits;
use kvgate_plugins::{PluginSlot, PluginSpec, route};
use kvgate_tests::guests;
use std::hint::black_box;
use std::time::{Duration, Instant};

const WORKERS: u32 = 64;
const ROUNDS: usize = 50_000;

fn measure(mut f: impl FnMut()) -> Vec<Duration> {
    for _ in 0..2_000 {
        f();
    }
    (0..ROUNDS)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect()
}

fn us(v: &mut [Duration], p: f64) -> f64 {
    kvgate_bench::percentile(v, p).as_secs_f64() * 1e6
}

fn main() {
    let mut rng = kvgate_bench::Rng(0x5eed);
    let cands: Vec<Candidate> = (0..WORKERS)
        .map(|id| Candidate {
            id,
            in_flight: (rng.next_u64() % 8) as u32,
            overlap_blocks: (rng.next_u64() % 512) as u32,
            active_overlap_blocks: (rng.next_u64() % 64) as u32,
            active_prefill_tokens: rng.next_u64() % 16_000,
            active_blocks: rng.next_u64() % 4_000,
            total_blocks: 8_192,
            kv_usage: (rng.next_u64() % 1000) as f64 / 1000.0,
            waiting: (rng.next_u64() % 4) as u32,
            busy: false,
            healthy: true,
            ..Candidate::default()
        })
        .collect();
    let with_session = vec![("x-session-id".to_string(), "user-42".to_string())];
    let req = |headers| RequestSummary {
        model: "m",
        endpoint: "chat_completions",
        request_id: "kvg-0123456789abcdef",
        prompt_tokens: 8192,
        prompt_blocks: 512,
        block_size: 16,
        fleet_overlap_blocks: 0,
        fleet_active_overlap_blocks: 0,
        fleet_prefill_load: 0.0,
        arrivals_per_worker_s: 0.0,
        expected_output_tokens: 0.0,
        mean_output_tokens: 0.0,
        tpot_weight: 0.0,
        e2e_weight: 0.0,
        slo: Default::default(),
        headers,
        nvext: None,
    };
    let (bare, session) = (req(&[]), req(&with_session));
    let kv = KvPolicy::new(KvParams::default());
    let load = |crate_name: &str, config: &str| {
        let spec = PluginSpec {
            name: crate_name.into(),
            path: guests::path(crate_name),
            sha256: None,
            config: config.into(),
            headers: vec!["x-session-id".into()],
            limits: Limits::default(),
        };
        PluginSlot::load(spec).expect("plugin loads").current()
    };
    let pin = load("hostile", "mode = pin-last");
    let affinity = load("session-affinity", "header = x-session-id");

    let mut base = measure(|| {
        black_box(kv.choose(black_box(&bare), black_box(&cands)));
    });
    let mut call = measure(|| {
        black_box(route(&pin, black_box(&bare), black_box(&cands), &kv));
    });
    let mut sticky = measure(|| {
        black_box(route(&affinity, black_box(&session), black_box(&cands), &kv));
    });
    let mut cost = measure(|| {
        black_box(route(&affinity, black_box(&bare), black_box(&cands), &kv));
    });
    let (b50, b99) = (us(&mut base, 0.5), us(&mut base, 0.99));
    println!("| decision over {WORKERS} candidates ({ROUNDS} calls) | p50 | p99 | added p50 | added p99 |");
    println!("|---|---:|---:|---:|---:|");
    println!("| built-in kv (baseline) | {b50:.2} µs | {b99:.2} µs | | |");
    for (name, v) in [
        ("plugin, bare call (pin-last)", &mut call),
        ("plugin, session-affinity, header present", &mut sticky),
        ("plugin, session-affinity, kv-cost fallback in the guest", &mut cost),
    ] {
        let (p50, p99) = (us(v, 0.5), us(v, 0.99));
        println!("| {name} | {p50:.2} µs | {p99:.2} µs | {:+.2} µs | {:+.2} µs |", p50 - b50, p99 - b99);
    }
}
