//! KV-aware routing against round_robin on a shared-prefix workload, end to end with release
//! binaries: 4 `vllm-sim` processes (real time, KV events over ZeroMQ) behind one `kvgate`
//! process per routing setting, each on a fresh set of workers. Reports the workers' own prefix
//! cache hit rate (`vllm:prefix_cache_hits_total / queries_total`) and the client's mean and p90
//! time to the (single-token) answer, all measured in the same run.
//!
//! The workload: `groups` prefixes of `prefix_blocks` blocks, `per_group` requests each (prefix
//! plus a 4-block unique suffix), interleaved in a fixed shuffled order, `concurrency` in flight.
//! With `num_gpu_blocks` small enough that one worker cannot hold every prefix, round_robin
//! makes every cache churn, while kv routing gives each prefix a home.
//!
//!   cargo build --release -p kvgate -p vllm-sim -p kvgate-bench
//!   target/release/routing-hit-rate

use clap::Parser;
use kvgate_bench::cluster::{self, Procs, SimOptions};
use kvgate_bench::load::prefix_cache_counters;
use kvgate_tests::prom::Metrics;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Path of the kvgate binary.
    #[arg(long, default_value = "target/release/kvgate")]
    kvgate_bin: String,
    /// Path of the vllm-sim binary.
    #[arg(long, default_value = "target/release/vllm-sim")]
    sim_bin: String,
    /// Shared prefixes.
    #[arg(long, default_value_t = 24)]
    groups: u32,
    /// Requests per prefix.
    #[arg(long, default_value_t = 16)]
    per_group: u32,
    /// Blocks (16 tokens) per prefix.
    #[arg(long, default_value_t = 128)]
    prefix_blocks: usize,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 1536)]
    num_gpu_blocks: usize,
    /// Requests in flight.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Routing settings to compare, `;`-separated lines of a model's `routing:` section each.
    #[arg(long, value_delimiter = ',', default_value = "mode: round_robin,mode: kv,mode: kv;overlap_score_weight: 2")]
    settings: Vec<String>,
}

const BS: usize = 16;

fn prompt(g: u32, i: u32, prefix_blocks: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..(prefix_blocks * BS) as u32).map(|t| (g * 7919 + t * 31) % 4000 + 10).collect();
    p.extend((0..(4 * BS) as u32).map(|t| (g * 131 + i * 977 + t * 13) % 4000 + 10));
    p
}

struct Outcome {
    hit_rate: f64,
    mean_ms: f64,
    p90_ms: f64,
    wall_s: f64,
    events: f64,
}

async fn run(args: &Args, setting: &str) -> Outcome {
    let http = reqwest::Client::new();
    let mut procs = Procs::default();
    let sims = SimOptions {
        bin: args.sim_bin.clone().into(),
        model: "sim-model".into(),
        args: vec!["--num-gpu-blocks-override".into(), args.num_gpu_blocks.to_string(), "--max-model-len".into(), "8192".into()],
        env: Vec::new(),
    };
    let workers = cluster::start_sims(&mut procs, &sims, 4).await.expect("vllm-sim workers start");
    let sim_urls: Vec<String> = workers.iter().map(|w| w.url.clone()).collect();
    // kv settings wait until every worker's events reach the gateway: kv must not route blind.
    let routing = setting.replace(';', "\n");
    let gw = cluster::start_kvgate(&mut procs, Path::new(&args.kvgate_bin), ("sim-model", &routing, ""), &workers, None).await.expect("kvgate starts");
    let base = gw.url.clone();

    let (hits_before, queries_before) = prefix_cache_counters(&http, &sim_urls).await.expect("worker metrics");
    let mut jobs: Vec<Vec<u32>> = (0..args.per_group).flat_map(|i| (0..args.groups).map(move |g| prompt(g, i, args.prefix_blocks))).collect();
    let mut x: u64 = 0x2545_f491;
    for i in (1..jobs.len()).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        jobs.swap(i, (x >> 33) as usize % (i + 1));
    }
    let sem = Arc::new(tokio::sync::Semaphore::new(args.concurrency));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for p in jobs {
        let permit = sem.clone().acquire_owned().await.expect("semaphore");
        let (http, url) = (http.clone(), format!("{base}/v1/completions"));
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = http.post(url).json(&serde_json::json!({"model": "sim-model", "prompt": p, "max_tokens": 1})).send().await.expect("request");
            assert!(r.status().is_success(), "status {}", r.status());
            r.bytes().await.expect("body");
            drop(permit);
            t.elapsed().as_secs_f64() * 1000.0
        }));
    }
    let mut lat: Vec<f64> = Vec::new();
    for t in tasks {
        lat.push(t.await.expect("task"));
    }
    let wall_s = started.elapsed().as_secs_f64();
    let (hits_after, queries_after) = prefix_cache_counters(&http, &sim_urls).await.expect("worker metrics");
    let admin_metrics = http.get(format!("{}/metrics", gw.admin)).send().await.expect("metrics").text().await.expect("metrics body");
    let events = Metrics::parse(&admin_metrics).sum("kvgate_kv_events_total", &[("result", "applied")]);
    drop(procs);
    lat.sort_by(f64::total_cmp);
    let (hits, queries) = (hits_after - hits_before, queries_after - queries_before);
    Outcome {
        hit_rate: hits / queries.max(1.0),
        mean_ms: lat.iter().sum::<f64>() / lat.len().max(1) as f64,
        p90_ms: lat.get(lat.len() * 9 / 10).copied().unwrap_or(0.0),
        wall_s,
        events,
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    println!(
        "workload: {} prefixes x {} requests, prefix {} tokens + 64, {} in flight, 4 workers x {} KV blocks",
        args.groups,
        args.per_group,
        args.prefix_blocks * BS,
        args.concurrency,
        args.num_gpu_blocks
    );
    let mut baseline: Option<Outcome> = None;
    for s in &args.settings {
        let o = run(&args, s).await;
        let ratio =
            baseline.as_ref().map_or(String::new(), |b| format!("  (TTFT {:.2}x, hit rate {:+.3} vs first)", o.mean_ms / b.mean_ms, o.hit_rate - b.hit_rate));
        println!(
            "{s:<40} hit rate {:.3}  mean {:.1} ms  p90 {:.1} ms  wall {:.1} s  kv events applied {}{ratio}",
            o.hit_rate, o.mean_ms, o.p90_ms, o.wall_s, o.events
        );
        if baseline.is_none() {
            baseline = Some(o);
        }
    }
}
