//! `kvgate-bench overload`: closed-loop streaming clients at a multiple of the fleet's
//! capacity, through kvgate with and without load shedding, each case on a fresh gateway and
//! fresh vllm-sim workers. The fleet's capacity is the streams its workers' KV caches hold
//! (`streams_per_worker` whole streams each, as a memory-bound vLLM is); past it a worker
//! queues new streams and preempts running ones, and first tokens wait.
//! With shedding set, the gateway answers the excess with Dynamo's load-shedding 503 before it
//! reaches a worker, so the streams it accepts keep their first-token time. A refused client
//! waits a moment (`backoff`) and sends again, as the 503's `Retry-After` asks.
//!
//! Counted per case: answers by kind (200 whole, 503, 429, any other status, cut or short
//! streams, client timeouts), TTFT of the accepted streams, the gateway's peak resident memory
//! and descriptors, and its bookings once the load stopped (must be 0).

use crate::cluster::{LISTEN_ANY, Procs, SimOptions, SimWorker, metric_sum, spawn_kvgate, start_sims, wait_ok};
use crate::load::client;
use crate::procfs;
use crate::{Rng, percentile};
use serde_json::json;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `vllm-sim` binary.
    pub sim_bin: PathBuf,
    /// The `kvgate` binary.
    pub kvgate_bin: PathBuf,
    /// Where the configs go.
    pub out: PathBuf,
    /// Workers.
    pub workers: usize,
    /// Whole streams each worker's KV cache holds: the fleet's capacity is `workers` times this.
    pub streams_per_worker: usize,
    /// Load per case, as multiples of the capacity (e.g. 0.5 and 3).
    pub factors: Vec<f64>,
    /// How long each case's load runs.
    pub duration: Duration,
    /// Output tokens per stream.
    pub tokens: usize,
    /// vllm-sim's `--time-scale`.
    pub time_scale: f64,
    /// The shedding section for the shedding cases (YAML lines under `shedding:`).
    pub shedding: String,
    /// Extra lines of the model's routing section (YAML lines under `routing:`; empty: defaults).
    pub routing: String,
    /// A client's wait after a refusal before it sends again.
    pub backoff: Duration,
    /// A request with no answer by then counts as a timeout.
    pub timeout: Duration,
}

/// One case's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Case {
    /// Load as a multiple of capacity.
    pub factor: f64,
    /// Whether the gateway sheds.
    pub shedding: bool,
    /// Concurrent clients.
    pub clients: usize,
    /// Streams that ended whole (200, every token).
    pub whole: u64,
    /// 503 answers.
    pub shed: u64,
    /// 429 answers.
    pub limited: u64,
    /// Any other status, or a 200 stream cut short or broken.
    pub failed: u64,
    /// Requests with no answer within the client's timeout.
    pub timeouts: u64,
    /// TTFT of the whole streams, p50 / p90 / p99 (ms).
    pub ttft_ms: [f64; 3],
    /// The gateway's peak resident memory (MiB).
    pub peak_rss_mib: f64,
    /// The gateway's peak open descriptors.
    pub peak_fds: usize,
    /// Bookings left once the load stopped and settled (must be 0).
    pub bookings_after: f64,
    /// A few failure reasons.
    pub failures: Vec<String>,
}

impl Case {
    /// The header of [`Case::row`]'s table.
    pub const HEAD: &'static str = "| load | shedding | clients | whole | 503 | 429 | other failures | timeouts | TTFT p50 | TTFT p90 | TTFT p99 | peak RSS | peak fds | bookings after |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

    /// The case as a Markdown table row.
    pub fn row(&self) -> String {
        format!(
            "| {}× | {} | {} | {} | {} | {} | {} | {} | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} MiB | {} | {} |",
            self.factor,
            if self.shedding { "on" } else { "off" },
            self.clients,
            self.whole,
            self.shed,
            self.limited,
            self.failed,
            self.timeouts,
            self.ttft_ms[0],
            self.ttft_ms[1],
            self.ttft_ms[2],
            self.peak_rss_mib,
            self.peak_fds,
            self.bookings_after
        )
    }
}

#[derive(Default)]
struct Counters {
    whole: AtomicU64,
    shed: AtomicU64,
    limited: AtomicU64,
    failed: AtomicU64,
    timeouts: AtomicU64,
}

/// Runs every case: each factor without shedding, then with it.
pub async fn run(o: &Options) -> Result<Vec<Case>, String> {
    std::fs::create_dir_all(&o.out).map_err(|e| e.to_string())?;
    let mut cases = Vec::new();
    for &factor in &o.factors {
        for shedding in [false, true] {
            let case = run_case(o, factor, shedding).await?;
            println!("{}", case.row());
            cases.push(case);
        }
    }
    Ok(cases)
}

async fn run_case(o: &Options, factor: f64, shedding: bool) -> Result<Case, String> {
    let mut procs = Procs::default();
    // Each worker's KV cache holds `streams_per_worker` whole streams (a prompt of under 16
    // tokens and the output), and its batch could take more: memory binds first, as on a GPU,
    // and KV use is what the shedding threshold reads. One block more is the engine's own
    // (vLLM's null block, never given to a sequence).
    let blocks = o.streams_per_worker * (16 + o.tokens).div_ceil(16) + 1;
    let sims = SimOptions {
        bin: o.sim_bin.clone(),
        model: "sim-model".into(),
        args: [
            "--time-scale",
            &o.time_scale.to_string(),
            "--max-num-seqs",
            "256",
            "--num-gpu-blocks-override",
            &blocks.to_string(),
            "--max-model-len",
            &(16 * (blocks - 1)).min(32_768).to_string(),
        ]
        .map(String::from)
        .to_vec(),
        env: Vec::new(),
    };
    let workers = start_sims(&mut procs, &sims, o.workers).await?;
    let config = o.out.join(format!("overload-{factor}-{}.yaml", if shedding { "shed" } else { "plain" }));
    std::fs::write(&config, yaml(&workers, &o.routing, shedding.then_some(o.shedding.as_str()))).map_err(|e| e.to_string())?;
    let (mut gw, at) = spawn_kvgate(&o.kvgate_bin, &config).await?;
    let (url, admin) = (at.url, at.admin);
    #[allow(clippy::cast_sign_loss, reason = "clamped to 1 or more")]
    let clients = ((o.workers * o.streams_per_worker) as f64 * factor).round().max(1.0) as usize;
    let http = reqwest::Client::builder().pool_max_idle_per_host(clients).build().map_err(|e| e.to_string())?;
    if let Err(e) = wait_ok(&http, &format!("{url}/health"), Duration::from_secs(30)).await {
        let _ = gw.kill();
        return Err(e);
    }
    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let ttfts = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let failures = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let shared = (counters.clone(), stop.clone(), ttfts.clone(), failures.clone());
            tokio::spawn(client_loop(i, o.clone(), http.clone(), format!("{url}/v1/completions"), shared))
        })
        .collect();
    let pid = gw.id();
    let (mut peak_rss, mut peak_fds) = (0u64, 0usize);
    let t0 = Instant::now();
    while t0.elapsed() < o.duration {
        tokio::time::sleep(Duration::from_millis(500)).await;
        peak_rss = peak_rss.max(procfs::rss_kib(pid));
        peak_fds = peak_fds.max(procfs::fds(pid));
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let settle = Instant::now();
    let mut bookings = metric_sum(&http, &admin, "kvgate_worker_requests_in_flight").await;
    while bookings != 0.0 && settle.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        bookings = metric_sum(&http, &admin, "kvgate_worker_requests_in_flight").await;
    }
    let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
    let _ = gw.wait();
    let mut t = ttfts.lock().clone();
    let mut ms = |p: f64| if t.is_empty() { f64::NAN } else { percentile(&mut t, p).as_secs_f64() * 1000.0 };
    let ttft_ms = [ms(0.5), ms(0.9), ms(0.99)];
    let c = &counters;
    Ok(Case {
        factor,
        shedding,
        clients,
        whole: c.whole.load(Ordering::Relaxed),
        shed: c.shed.load(Ordering::Relaxed),
        limited: c.limited.load(Ordering::Relaxed),
        failed: c.failed.load(Ordering::Relaxed),
        timeouts: c.timeouts.load(Ordering::Relaxed),
        ttft_ms,
        peak_rss_mib: peak_rss as f64 / 1024.0,
        peak_fds,
        bookings_after: bookings,
        failures: failures.lock().iter().take(10).cloned().collect(),
    })
}

fn yaml(workers: &[SimWorker], routing: &str, shedding: Option<&str>) -> String {
    let list = workers.iter().fold(String::new(), |mut s, w| {
        let _ = write!(s, "      - url: {}\n        kv_events: {}\n        replay: {}\n", w.url, w.kv_events, w.replay);
        s
    });
    let section = |name: &str, body: &str| format!("    {name}:\n{}\n", body.lines().map(|l| format!("      {}", l.trim())).collect::<Vec<_>>().join("\n"));
    let shedding = shedding.map(|s| section("shedding", s)).unwrap_or_default();
    let routing = if routing.trim().is_empty() { String::new() } else { section("routing", routing) };
    format!("{LISTEN_ANY}health:\n  interval_ms: 500\nmodels:\n  - name: sim-model\n    tokenizer: builtin\n{routing}{shedding}    workers:\n{list}")
}

type Shared = (Arc<Counters>, Arc<AtomicBool>, Arc<parking_lot::Mutex<Vec<Duration>>>, Arc<parking_lot::Mutex<Vec<String>>>);

async fn client_loop(i: usize, o: Options, http: reqwest::Client, url: String, (counters, stop, ttfts, failures): Shared) {
    let mut rng = Rng::stream(13, i as u64);
    // Started over a second, not all at once.
    tokio::time::sleep(Duration::from_millis(rng.next_u64() % 1000)).await;
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let body = json!({"model": "sim-model", "prompt": format!("overload client {i} turn {n}: tell a long story"), "max_tokens": o.tokens, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
        let Ok(s) = tokio::time::timeout(o.timeout, client::send(&http, &url, &body, Instant::now())).await else {
            counters.timeouts.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        match s.status {
            200 if s.ok() && s.output_tokens as usize == o.tokens => {
                counters.whole.fetch_add(1, Ordering::Relaxed);
                ttfts.lock().push(s.ttft.unwrap_or_default());
                continue;
            }
            503 => counters.shed.fetch_add(1, Ordering::Relaxed),
            429 => counters.limited.fetch_add(1, Ordering::Relaxed),
            _ => {
                failures.lock().push(format!("status {} tokens {}: {}", s.status, s.output_tokens, s.error.unwrap_or_default()));
                counters.failed.fetch_add(1, Ordering::Relaxed)
            }
        };
        tokio::time::sleep(o.backoff).await;
    }
}
