//! `kvgate-bench soak`: many concurrent SSE streams through kvgate for a long time, with a churn
//! of faults injected on purpose: clients that cancel mid-stream, workers killed
//! (SIGKILL) and started again on the same ports, and config reloads that change a value. The
//! gateway's resident memory and descriptors, the streams finished, cancelled and failed, and
//! its bookings are sampled at a fixed interval; at the end the load stops and every booking
//! must be back to 0.
//!
//! A failed stream is one the client did not cancel that did not end with all its tokens. The
//! streams running on a worker when it is killed are the injected failures the gateway may not
//! hide: they move by continuation when they can, else they are cut. A failure more than
//! a few seconds away from any kill is the gateway's.

use crate::cluster::{LISTEN_ANY, Procs, SimOptions, SimWorker, metric_sum, sim_command, spawn_kvgate, start_sims, wait_ok};
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
    /// Where the config and the samples go.
    pub out: PathBuf,
    /// How long the load runs.
    pub duration: Duration,
    /// Concurrent streams (closed loop: each sends its next when the last ended).
    pub streams: usize,
    /// Workers.
    pub workers: usize,
    /// Output tokens per stream.
    pub tokens: usize,
    /// vllm-sim's `--time-scale`.
    pub time_scale: f64,
    /// Time between samples.
    pub sample_every: Duration,
    /// Time between worker kills (0: none).
    pub kill_every: Duration,
    /// Time between config reloads (0: none).
    pub reload_every: Duration,
    /// Share of streams the client cancels at a random point.
    pub cancel_share: f64,
}

/// One sample.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    /// Seconds since the load started.
    pub at_s: f64,
    /// kvgate's resident memory (KiB).
    pub rss_kib: u64,
    /// kvgate's open descriptors.
    pub fds: usize,
    /// Streams finished whole so far.
    pub ok: u64,
    /// Streams the clients cancelled so far.
    pub cancelled: u64,
    /// Failed streams so far, within 5 s of a kill.
    pub failed_at_kills: u64,
    /// Failed streams so far, away from any kill.
    pub failed_other: u64,
    /// Requests the gateway has booked on workers now.
    pub bookings: f64,
    /// Worker kills so far.
    pub kills: u64,
    /// Config reloads so far.
    pub reloads: u64,
}

impl Sample {
    /// The header of [`Sample::row`]'s table.
    pub const HEAD: &'static str = "| at | RSS | fds | whole streams | cancelled | failed at kills | failed otherwise | bookings | kills | reloads |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

    /// The sample as a Markdown table row.
    pub fn row(&self) -> String {
        format!(
            "| {:.0} s | {:.1} MiB | {} | {} | {} | {} | {} | {} | {} | {} |",
            self.at_s,
            self.rss_kib as f64 / 1024.0,
            self.fds,
            self.ok,
            self.cancelled,
            self.failed_at_kills,
            self.failed_other,
            self.bookings,
            self.kills,
            self.reloads
        )
    }
}

/// What a run found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The samples, in order.
    pub samples: Vec<Sample>,
    /// Bookings once the load stopped and settled.
    pub final_bookings: f64,
    /// Requests still in flight in the gateway at the end.
    pub final_in_flight: f64,
    /// A few failure reasons away from kills.
    pub other_errors: Vec<String>,
    /// Time to first token p50 / p99 of the whole streams (ms).
    pub ttft_ms: (f64, f64),
}

#[derive(Default)]
struct Counters {
    ok: AtomicU64,
    cancelled: AtomicU64,
    failed_at_kills: AtomicU64,
    failed_other: AtomicU64,
    kills: AtomicU64,
    reloads: AtomicU64,
    /// Milliseconds since the start at the last kill.
    last_kill_ms: AtomicU64,
}

/// Runs the soak.
pub async fn run(o: &Options) -> Result<Report, String> {
    std::fs::create_dir_all(&o.out).map_err(|e| e.to_string())?;
    let mut procs = Procs::default();
    let sims = SimOptions {
        bin: o.sim_bin.clone(),
        model: "sim-model".into(),
        args: vec!["--time-scale".into(), o.time_scale.to_string(), "--max-num-seqs".into(), "4096".into()],
        env: Vec::new(),
    };
    let workers = start_sims(&mut procs, &sims, o.workers).await?;
    let config = o.out.join("soak.yaml");
    std::fs::write(&config, yaml(&workers, 60_000)).map_err(|e| e.to_string())?;
    let (mut gw, at) = spawn_kvgate(&o.kvgate_bin, &config).await?;
    let (url, admin) = (at.url, at.admin);
    let http = reqwest::Client::builder().pool_max_idle_per_host(o.streams).build().map_err(|e| e.to_string())?;
    let ready = wait_ok(&http, &format!("{url}/health"), Duration::from_secs(30)).await;
    if let Err(e) = ready {
        let _ = gw.kill();
        return Err(e);
    }
    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let ttfts = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let errors = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..o.streams)
        .map(|i| {
            tokio::spawn(client_loop(
                i,
                o.clone(),
                http.clone(),
                format!("{url}/v1/completions"),
                counters.clone(),
                stop.clone(),
                t0,
                ttfts.clone(),
                errors.clone(),
            ))
        })
        .collect();
    let mut samples = Vec::new();
    let (mut next_sample, mut next_kill, mut next_reload) = (o.sample_every, o.kill_every, o.reload_every);
    let mut rng = Rng::seeded(7);
    let pid = gw.id();
    while t0.elapsed() < o.duration {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = t0.elapsed();
        if !o.kill_every.is_zero() && now >= next_kill {
            next_kill += o.kill_every;
            let k = (rng.next_u64() % workers.len() as u64) as usize;
            counters.last_kill_ms.store(now.as_millis() as u64, Ordering::Relaxed);
            let _ = procs.0[k].kill();
            let _ = procs.0[k].wait();
            counters.kills.fetch_add(1, Ordering::Relaxed);
            // Back on the same ports a moment later, as a restarted pod would be.
            tokio::time::sleep(Duration::from_secs(2)).await;
            procs.0[k] = sim_command(&sims, k + 1, workers[k].ports).spawn().map_err(|e| e.to_string())?;
        }
        if !o.reload_every.is_zero() && now >= next_reload {
            next_reload += o.reload_every;
            let n = counters.reloads.fetch_add(1, Ordering::Relaxed) + 1;
            std::fs::write(&config, yaml(&workers, 60_000 + n)).map_err(|e| e.to_string())?;
            let _ = http.post(format!("{admin}/reload")).send().await;
        }
        if now >= next_sample {
            next_sample += o.sample_every;
            samples.push(sample(&http, &admin, pid, &counters, now).await);
            println!("{}", samples.last().expect("just pushed").row());
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    // Cancelled streams' bookings go when the gateway sees each close.
    let settle = Instant::now();
    let mut last = sample(&http, &admin, pid, &counters, t0.elapsed()).await;
    while last.bookings > 0.0 && settle.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        last = sample(&http, &admin, pid, &counters, t0.elapsed()).await;
    }
    let in_flight = metric_sum(&http, &admin, "kvgate_requests_in_flight").await;
    samples.push(last.clone());
    let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
    let _ = gw.wait();
    let lines: Vec<String> = samples.iter().map(|s| serde_json::to_string(s).unwrap_or_default()).collect();
    let _ = std::fs::write(o.out.join("soak-samples.jsonl"), lines.join("\n") + "\n");
    let mut t = ttfts.lock().clone();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let ttft_ms = if t.is_empty() { (f64::NAN, f64::NAN) } else { (ms(percentile(&mut t, 0.5)), ms(percentile(&mut t, 0.99))) };
    let other_errors = errors.lock().iter().take(10).cloned().collect();
    Ok(Report { samples, final_bookings: last.bookings, final_in_flight: in_flight, other_errors, ttft_ms })
}

fn yaml(workers: &[SimWorker], write_ms: u64) -> String {
    let list = workers.iter().fold(String::new(), |mut s, w| {
        let _ = write!(s, "      - url: {}\n        kv_events: {}\n        replay: {}\n", w.url, w.kv_events, w.replay);
        s
    });
    // `client_write_ms` changes on every reload so each one applies a new config.
    format!(
        "{LISTEN_ANY}max_connections: 100000\nhealth:\n  interval_ms: 500\ntimeouts:\n  client_write_ms: {write_ms}\nmodels:\n  - name: sim-model\n    tokenizer: builtin\n    workers:\n{list}"
    )
}

#[allow(clippy::too_many_arguments)]
async fn client_loop(
    i: usize,
    o: Options,
    http: reqwest::Client,
    url: String,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    t0: Instant,
    ttfts: Arc<parking_lot::Mutex<Vec<Duration>>>,
    errors: Arc<parking_lot::Mutex<Vec<String>>>,
) {
    let mut rng = Rng::stream(11, i as u64);
    // Started over a second, not all at once.
    tokio::time::sleep(Duration::from_millis(rng.next_u64() % 1000)).await;
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let body = json!({"model": "sim-model", "prompt": format!("soak client {i} turn {n}: tell a long story"), "max_tokens": o.tokens, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
        let cancel = (rng.next_u64() % 10_000) as f64 / 10_000.0 < o.cancel_share;
        let send = client::send(&http, &url, &body, Instant::now());
        let sample = if cancel {
            let after = Duration::from_millis(100 + rng.next_u64() % 3000);
            match tokio::time::timeout(after, send).await {
                Ok(s) => s,
                Err(_) => {
                    counters.cancelled.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
        } else {
            send.await
        };
        if sample.ok() && sample.output_tokens as usize == o.tokens {
            counters.ok.fetch_add(1, Ordering::Relaxed);
            if let Some(t) = sample.ttft {
                ttfts.lock().push(t);
            }
            continue;
        }
        let now_ms = t0.elapsed().as_millis() as u64;
        let last_kill = counters.last_kill_ms.load(Ordering::Relaxed);
        let killed = counters.kills.load(Ordering::Relaxed) > 0 && now_ms.saturating_sub(last_kill) < 5_000 + (sample.e2e.as_millis() as u64);
        if killed {
            counters.failed_at_kills.fetch_add(1, Ordering::Relaxed);
        } else {
            counters.failed_other.fetch_add(1, Ordering::Relaxed);
            errors.lock().push(format!("status {} tokens {}: {}", sample.status, sample.output_tokens, sample.error.unwrap_or_default()));
        }
        // A failed request (a refused one above all) is not retried in a tight loop.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn sample(http: &reqwest::Client, admin: &str, pid: u32, c: &Counters, at: Duration) -> Sample {
    Sample {
        at_s: at.as_secs_f64(),
        rss_kib: procfs::rss_kib(pid),
        fds: procfs::fds(pid),
        ok: c.ok.load(Ordering::Relaxed),
        cancelled: c.cancelled.load(Ordering::Relaxed),
        failed_at_kills: c.failed_at_kills.load(Ordering::Relaxed),
        failed_other: c.failed_other.load(Ordering::Relaxed),
        bookings: metric_sum(http, admin, "kvgate_worker_requests_in_flight").await,
        kills: c.kills.load(Ordering::Relaxed),
        reloads: c.reloads.load(Ordering::Relaxed),
    }
}
