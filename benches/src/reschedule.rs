//! `kvgate-bench reschedule`: what the rescheduler (Llumnix's `decode_load` policy) does for a
//! fleet whose load is skewed. A burst of long decodes lands on the first workers of a fleet
//! that then scales out (more workers are added by a config reload, as a planner would):
//! without the rescheduler the old workers keep their whole batch until it ends and the new
//! ones idle; with it, streams move to the new workers by continuation. Both runs use the same
//! release binaries, workers and workload; per-request TTFT and TPOT are measured by the
//! client, the migration pause by the gateway (`kvgate_migration_pause_seconds`).

use crate::cluster::{LISTEN_ANY, Procs, SimOptions, SimWorker, spawn_kvgate, start_sims, wait_ok};
use crate::load::client;
use crate::{Rng, percentile};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `vllm-sim` binary.
    pub sim_bin: PathBuf,
    /// The `kvgate` binary.
    pub kvgate_bin: PathBuf,
    /// Workers at the start (the burst lands on them).
    pub initial: usize,
    /// Workers after the scale-out.
    pub total: usize,
    /// Streams in the burst.
    pub requests: usize,
    /// Prompt tokens per stream.
    pub prompt_tokens: usize,
    /// Output tokens per stream.
    pub output_tokens: usize,
    /// vllm-sim's `--time-scale`.
    pub time_scale: f64,
    /// vllm-sim's KV capacity in blocks (of 16 tokens).
    pub gpu_blocks: usize,
    /// Lines of the `rescheduling` section for the run with the rescheduler.
    pub rescheduling: String,
}

/// One run's figures.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    /// Streams that completed.
    pub ok: usize,
    /// TTFT p50 / p99, ms.
    pub ttft_ms: (f64, f64),
    /// Per-request TPOT (mean inter-token gap) p50 / p99, ms.
    pub tpot_ms: (f64, f64),
    /// Moves done.
    pub moves: f64,
    /// Migration pause p50 / p99, ms (from the gateway's histogram).
    pub pause_ms: (f64, f64),
}

/// Runs the burst without and with the rescheduler; returns both runs' figures.
pub async fn run(o: &Options) -> Result<(Figures, Figures), String> {
    let mut procs = Procs::default();
    let sim = SimOptions {
        bin: o.sim_bin.clone(),
        model: "sim-model".into(),
        args: ["--time-scale", &o.time_scale.to_string(), "--num-gpu-blocks-override", &o.gpu_blocks.to_string(), "--max-num-seqs", "512"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        env: Vec::new(),
    };
    let workers = start_sims(&mut procs, &sim, o.total).await?;
    let off = burst(o, &workers, "", 1).await?;
    let on = burst(o, &workers, &o.rescheduling, 2).await?;
    Ok((off, on))
}

fn config(workers: &[SimWorker], rescheduling: &str) -> String {
    let list: String = workers.iter().flat_map(|w| ["      - url: ", w.url.as_str(), "\n"]).collect();
    let resched: String = rescheduling.lines().flat_map(|l| ["  ", l.trim(), "\n"]).collect();
    let section = if resched.is_empty() { String::new() } else { format!("rescheduling:\n{resched}") };
    format!(
        "{LISTEN_ANY}load:\n  interval_ms: 100\nhealth:\n  interval_ms: 200\n{section}models:\n  - name: sim-model\n    routing:\n      mode: round_robin\n    workers:\n{list}"
    )
}

/// One run: a gateway over the first workers, the burst, the scale-out, the figures.
async fn burst(o: &Options, workers: &[SimWorker], rescheduling: &str, seed: u64) -> Result<Figures, String> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(o.requests).build().map_err(|e| e.to_string())?;
    let path = std::env::temp_dir().join(format!("kvgate-resched-{}-{seed}.yaml", std::process::id()));
    std::fs::write(&path, config(&workers[..o.initial], rescheduling)).map_err(|e| e.to_string())?;
    let mut procs = Procs::default();
    let (gw, at) = spawn_kvgate(&o.kvgate_bin, &path).await?;
    procs.0.push(gw);
    let (url, admin) = (at.url, at.admin);
    wait_ok(&http, &format!("{url}/health"), Duration::from_secs(30)).await?;
    let mut rng = Rng(0x5eed ^ seed.wrapping_mul(kvgate_kv::hash::PHI));
    let started = Instant::now();
    let tasks: Vec<_> = (0..o.requests)
        .map(|_| {
            let prompt: Vec<u32> = (0..o.prompt_tokens).map(|_| 100 + (rng.next_u64() % 3000) as u32).collect();
            let body = serde_json::json!({"model": "sim-model", "prompt": prompt, "max_tokens": o.output_tokens, "ignore_eos": true,
                                          "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
            let (http, url) = (http.clone(), format!("{url}/v1/completions"));
            tokio::spawn(async move { client::send(&http, &url, &body, started).await })
        })
        .collect();
    // Scale out once every stream is running on the first workers.
    wait_running(&http, &admin, o.requests).await?;
    std::fs::write(&path, config(workers, rescheduling)).map_err(|e| e.to_string())?;
    let reload = http.post(format!("{admin}/reload")).send().await.map_err(|e| e.to_string())?;
    if !reload.status().is_success() {
        return Err(format!("reload failed: {}", reload.text().await.unwrap_or_default()));
    }
    let mut samples = Vec::with_capacity(tasks.len());
    for t in tasks {
        samples.push(t.await.map_err(|e| e.to_string())?);
    }
    let metrics = http.get(format!("{admin}/metrics")).send().await.map_err(|e| e.to_string())?.text().await.map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&path);
    drop(procs);
    for w in workers {
        idle(&http, &w.url).await;
    }
    Ok(figures(&samples, &metrics))
}

/// Waits until `n` requests are running (streaming) on the gateway whose admin URL is `admin`.
pub async fn wait_running(http: &reqwest::Client, admin: &str, n: usize) -> Result<(), String> {
    let start = Instant::now();
    loop {
        let v: serde_json::Value = http.get(format!("{admin}/requests")).send().await.map_err(|e| e.to_string())?.json().await.map_err(|e| e.to_string())?;
        let running = v["requests"].as_array().map_or(0, |r| r.iter().filter(|e| e["phase"] == "running").count());
        if running >= n {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(120) {
            return Err(format!("only {running} of {n} streams started"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until a worker runs nothing (the next run starts from the same state).
async fn idle(http: &reqwest::Client, url: &str) {
    for _ in 0..600 {
        let Ok(r) = http.get(format!("{url}/metrics")).send().await else { return };
        let m = kvgate_tests::prom::Metrics::parse(&r.text().await.unwrap_or_default());
        if m.sum("vllm:num_requests_running", &[]) == 0.0 && m.sum("vllm:num_requests_waiting", &[]) == 0.0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn figures(samples: &[client::Sample], metrics: &str) -> Figures {
    let ok: Vec<&client::Sample> = samples.iter().filter(|s| s.ok()).collect();
    let mut ttft: Vec<Duration> = ok.iter().filter_map(|s| s.ttft).collect();
    let mut tpot: Vec<Duration> = ok.iter().filter(|s| !s.itl.is_empty()).map(|s| s.itl.iter().sum::<Duration>() / s.itl.len() as u32).collect();
    let m = kvgate_tests::prom::Metrics::parse(metrics);
    let pct = |v: &mut Vec<Duration>, p| if v.is_empty() { 0.0 } else { ms(percentile(v, p)) };
    Figures {
        ok: ok.len(),
        ttft_ms: (pct(&mut ttft, 0.5), pct(&mut ttft, 0.99)),
        tpot_ms: (pct(&mut tpot, 0.5), pct(&mut tpot, 0.99)),
        moves: m.sum("kvgate_migrations_total", &[("outcome", "ok")]),
        pause_ms: (histogram_quantile(&m, "kvgate_migration_pause_seconds", 0.5) * 1e3, histogram_quantile(&m, "kvgate_migration_pause_seconds", 0.99) * 1e3),
    }
}

/// The `q` quantile of a Prometheus histogram (linear within the bucket, as PromQL's
/// `histogram_quantile`); 0 when it has no samples.
pub fn histogram_quantile(m: &kvgate_tests::prom::Metrics, name: &str, q: f64) -> f64 {
    let bucket = format!("{name}_bucket");
    let mut buckets: Vec<(f64, f64)> = m
        .samples
        .iter()
        .filter(|s| s.name == bucket)
        .filter_map(|s| {
            let le = s.labels.get("le")?;
            let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((bound, s.value))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Sum over label sets per bound.
    #[allow(clippy::float_cmp, reason = "bounds parsed from `le` labels: one bound's text gives one value")]
    buckets.dedup_by(|b, a| {
        if a.0 == b.0 {
            a.1 += b.1;
            true
        } else {
            false
        }
    });
    let Some(&(_, total)) = buckets.last() else { return 0.0 };
    if total == 0.0 {
        return 0.0;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(bound, count) in &buckets {
        if count >= rank {
            if bound.is_infinite() {
                return prev.0;
            }
            let within = if count > prev.1 { (rank - prev.1) / (count - prev.1) } else { 0.0 };
            return prev.0 + (bound - prev.0) * within;
        }
        prev = (bound, count);
    }
    prev.0
}

/// The simulator's time for one prefill of `tokens` new tokens (its default timing model,
/// `sim/src/timing.rs`), ms of wall time at `time_scale`.
pub fn sim_prefill_ms(tokens: usize, time_scale: f64) -> f64 {
    let mut step = vllm_sim::timing::StepShape::default();
    step.add_prefill(0, tokens);
    vllm_sim::timing::TimingModel::default().step_ms(&step) / time_scale
}
