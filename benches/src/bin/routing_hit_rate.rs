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
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Distinct free ports: every probe listener stays open until all are chosen, so none repeats.
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port")).collect();
    held.iter().map(|l| l.local_addr().expect("bound").port()).collect()
}

/// Child processes killed on drop.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn prompt(g: u32, i: u32, prefix_blocks: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..(prefix_blocks * BS) as u32).map(|t| (g * 7919 + t * 31) % 4000 + 10).collect();
    p.extend((0..(4 * BS) as u32).map(|t| (g * 131 + i * 977 + t * 13) % 4000 + 10));
    p
}

async fn wait_ok(http: &reqwest::Client, url: &str) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if http.get(url).send().await.is_ok_and(|r| r.status().is_success()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{url} did not come up");
}

/// One scrape of a Prometheus `/metrics` page.
async fn scrape(http: &reqwest::Client, url: &str) -> String {
    http.get(url).send().await.expect("metrics").text().await.expect("metrics body")
}

/// The sample lines of `name` whose label set contains `label` (`""` for all).
fn samples<'a>(text: &'a str, name: &'a str, label: &'a str) -> impl Iterator<Item = &'a str> {
    text.lines().filter(move |l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(label))
}

/// Sum of the samples of `name` whose label set contains `label`.
fn sum(text: &str, name: &str, label: &str) -> f64 {
    samples(text, name, label).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

const APPLIED: &str = r#"result="applied""#;

/// Event sources (workers) the gateway has applied events from.
fn sources_with_events(text: &str) -> usize {
    let sources: std::collections::HashSet<&str> =
        samples(text, "kvgate_kv_events_total", APPLIED).filter_map(|l| l.split("source=\"").nth(1)?.split('"').next()).collect();
    sources.len()
}

/// (prefix cache hits, queries) summed over the workers, one scrape each.
async fn fleet_hits_and_queries(http: &reqwest::Client, urls: &[String]) -> (f64, f64) {
    let mut total = (0.0, 0.0);
    for u in urls {
        let text = scrape(http, &format!("{u}/metrics")).await;
        total.0 += sum(&text, "vllm:prefix_cache_hits_total", "");
        total.1 += sum(&text, "vllm:prefix_cache_queries_total", "");
    }
    total
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
    let mut procs = Procs(Vec::new());
    let mut workers = String::new();
    let mut sim_urls = Vec::new();
    let ports = free_ports(14);
    for w in 0..4 {
        let (port, ev, rp) = (ports[3 * w], ports[3 * w + 1], ports[3 * w + 2]);
        // As in vLLM, a `*` endpoint binds; without it the engine would connect.
        let kv = format!(
            r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{ev}","replay_endpoint":"tcp://*:{rp}","topic":"kv-events"}}"#
        );
        procs.0.push(
            Command::new(&args.sim_bin)
                .args(["--model", "sim-model", "--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--num-gpu-blocks-override", &args.num_gpu_blocks.to_string(), "--max-model-len", "8192"])
                .args(["--kv-events-config", &kv])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("vllm-sim starts"),
        );
        let url = format!("http://127.0.0.1:{port}");
        workers.push_str(&format!("      - url: {url}\n        kv_events: tcp://127.0.0.1:{ev}\n        replay: tcp://127.0.0.1:{rp}\n"));
        sim_urls.push(url);
    }
    for u in &sim_urls {
        wait_ok(&http, &format!("{u}/health")).await;
    }
    let (gw, admin) = (ports[12], ports[13]);
    let routing: String = setting.split(';').map(|l| format!("      {}\n", l.trim())).collect();
    let config = format!(
        "listen: 127.0.0.1:{gw}\nadmin_listen: 127.0.0.1:{admin}\nmodels:\n  - name: sim-model\n    routing:\n{routing}    workers:\n{workers}"
    );
    let path = std::env::temp_dir().join(format!("kvgate-hit-rate-{}-{gw}.yaml", std::process::id()));
    std::fs::write(&path, config).expect("config written");
    procs.0.push(
        Command::new(&args.kvgate_bin).arg("--config").arg(&path).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("kvgate starts"),
    );
    let base = format!("http://127.0.0.1:{gw}");
    wait_ok(&http, &format!("{base}/health")).await;
    let _ = std::fs::remove_file(&path);
    // kv settings: every worker's events must reach the gateway before measuring, or kv would
    // route blind. A probe per worker, sent directly, makes each publish.
    if setting.contains("mode: kv") && !setting.contains("kv_events: false") {
        let metrics = format!("http://127.0.0.1:{admin}/metrics");
        let start = Instant::now();
        while sources_with_events(&scrape(&http, &metrics).await) < sim_urls.len() {
            assert!(start.elapsed() < Duration::from_secs(30), "the gateway gets no KV events from some workers");
            for u in &sim_urls {
                let _ = http.post(format!("{u}/v1/completions")).json(&serde_json::json!({"model": "sim-model", "prompt": prompt(9999, 0, 2), "max_tokens": 1})).send().await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    let (hits_before, queries_before) = fleet_hits_and_queries(&http, &sim_urls).await;
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
    let (hits_after, queries_after) = fleet_hits_and_queries(&http, &sim_urls).await;
    let events = sum(&scrape(&http, &format!("http://127.0.0.1:{admin}/metrics")).await, "kvgate_kv_events_total", APPLIED);
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
        let ratio = baseline.as_ref().map_or(String::new(), |b| format!("  (TTFT {:.2}x, hit rate {:+.3} vs first)", o.mean_ms / b.mean_ms, o.hit_rate - b.hit_rate));
        println!("{s:<40} hit rate {:.3}  mean {:.1} ms  p90 {:.1} ms  wall {:.1} s  kv events applied {}{ratio}", o.hit_rate, o.mean_ms, o.p90_ms, o.wall_s, o.events);
        if baseline.is_none() {
            baseline = Some(o);
        }
    }
}
