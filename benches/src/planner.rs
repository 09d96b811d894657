//! `kvgate-bench planner`: the planner (Dynamo's design) with the `local` connector starting
//! vllm-sim processes, on release binaries.
//! - `ramp`: closed-loop streaming clients in steps up and down; the planner scales the fleet
//!   from nothing to its minimum, up with the load and back. Reports every request's outcome
//!   and draws load, KV utilisation and workers over time from the planner's decision log.
//! - `drain`: the same streams on two workers, then a scale-down, once by migration and once by
//!   waiting: the time from the decision to the worker's exit, the longest pause a client saw
//!   between two tokens, and failures.

use crate::cluster::{LISTEN_ANY, spawn_kvgate, wait_ok};
use crate::load::client;
use crate::{Rng, percentile};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `vllm-sim` binary.
    pub sim_bin: PathBuf,
    /// The `kvgate` binary.
    pub kvgate_bin: PathBuf,
    /// Where the decision logs, reports and plots go.
    pub out: PathBuf,
    /// vllm-sim's `--time-scale`.
    pub time_scale: f64,
    /// vllm-sim's KV capacity in blocks (of 16 tokens).
    pub gpu_blocks: usize,
    /// Prompt tokens per stream.
    pub prompt_tokens: usize,
    /// Output tokens per stream.
    pub output_tokens: usize,
    /// ramp: streaming clients in each step.
    pub steps: Vec<usize>,
    /// ramp: seconds per step.
    pub step_s: f64,
    /// The planner's `adjustment_interval_s` (Dynamo's default of 30 s makes a long run).
    pub interval_s: f64,
    /// The planner's `max_gpu_budget` (one GPU per worker).
    pub max_workers: u32,
    /// drain: streams running when the scale-down comes.
    pub drain_streams: usize,
    /// drain: output tokens of those streams.
    pub drain_tokens: usize,
}

/// A running gateway with a planner.
struct Gateway {
    child: std::process::Child,
    url: String,
    admin: String,
    config: PathBuf,
    http: reqwest::Client,
}

impl Gateway {
    /// Starts kvgate with `planner` (lines of the planner section, connector excluded),
    /// routing `mode`, vllm-sim workers of `gpu_blocks` blocks.
    async fn start(o: &Options, planner: &str, log: &Path, mode: &str, gpu_blocks: usize) -> Result<Self, String> {
        let config = o.out.join(format!("kvgate-planner-{}.yaml", std::process::id()));
        std::fs::write(&config, Self::yaml(o, planner, log, mode, gpu_blocks)).map_err(|e| e.to_string())?;
        let (child, at) = spawn_kvgate(&o.kvgate_bin, &config).await?;
        let http = reqwest::Client::builder().pool_max_idle_per_host(256).build().map_err(|e| e.to_string())?;
        let gw = Self { child, url: at.url, admin: at.admin, config, http };
        // /health says 503 until a worker is healthy, and the planner starts with none.
        wait_ok(&gw.http, &format!("{}/metrics", gw.admin), Duration::from_secs(30)).await?;
        Ok(gw)
    }

    fn yaml(o: &Options, planner: &str, log: &Path, mode: &str, gpu_blocks: usize) -> String {
        // The sims' ports (and their KV ports, 1000 up): below the kernel's ephemeral range, so
        // no socket the system places on its own takes one between the connector's check and the
        // worker's bind; a benchmark runs alone, so nothing else binds there.
        let base = 21_000;
        let kv = r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{kv_port}","topic":""}"#;
        let command = format!(
            "{} --port {{port}} --served-model-name {{model}} --time-scale {} --num-gpu-blocks-override {} --max-model-len 4096 --max-num-seqs 512 --kv-events-config '{kv}'",
            o.sim_bin.display(),
            o.time_scale,
            gpu_blocks
        );
        let planner: String = planner.lines().flat_map(|l| ["      ", l.trim(), "\n"]).collect();
        format!(
            "{LISTEN_ANY}load:\n  interval_ms: 100\nhealth:\n  interval_ms: 200\nmodels:\n  - name: sim-model\n    tokenizer: builtin\n    routing:\n      mode: {mode}\n    planner:\n      enabled: true\n      log: {}\n{planner}      connector:\n        kind: local\n        command: \"{}\"\n        ports_from: {base}\n        ready_timeout_s: 60\n    workers: []\n",
            log.display(),
            command.replace('"', "\\\"")
        )
    }

    /// Workers in routing now.
    async fn workers(&self) -> usize {
        let v: Value = match self.http.get(format!("{}/workers", self.admin)).send().await {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        v["models"][0]["workers"].as_array().map_or(0, Vec::len)
    }

    async fn wait_workers(&self, n: usize, limit: Duration) -> Result<(), String> {
        let start = Instant::now();
        while self.workers().await != n {
            if start.elapsed() > limit {
                return Err(format!("the planner did not reach {n} workers within {limit:?} (at {})", self.workers().await));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }
}

impl Drop for Gateway {
    /// SIGTERM, so its connector stops the workers it started; also when a run fails half-way.
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// Streaming clients, each sending its next request when the last ended, until `stop`.
fn clients(
    gw: &Gateway,
    n: usize,
    o: &Options,
    tokens: usize,
    stop: &Arc<AtomicBool>,
    seed: u64,
    t0: Instant,
) -> Vec<tokio::task::JoinHandle<Vec<(Duration, client::Sample)>>> {
    (0..n)
        .map(|i| {
            let (http, url, stop) = (gw.http.clone(), format!("{}/v1/completions", gw.url), stop.clone());
            let mut rng = Rng(0x5eed ^ (seed * 1000 + i as u64).wrapping_mul(kvgate_kv::hash::PHI));
            let prompt_tokens = o.prompt_tokens;
            tokio::spawn(async move {
                let mut out = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let prompt: Vec<u32> = (0..prompt_tokens).map(|_| 100 + (rng.next_u64() % 3000) as u32).collect();
                    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": tokens, "ignore_eos": true, "stream": true,
                                      "stream_options": {"include_usage": true}});
                    let at = t0.elapsed();
                    out.push((at, client::send(&http, &url, &body, Instant::now()).await));
                }
                out
            })
        })
        .collect()
}

/// A request that did not come back whole.
fn failed(s: &client::Sample, tokens: usize) -> bool {
    !s.ok() || s.output_tokens != tokens as u64
}

/// What the ramp did.
#[derive(Debug, Clone, Default)]
pub struct Ramp {
    /// Requests sent, and those that failed or came back short.
    pub requests: usize,
    /// Failed.
    pub failed: usize,
    /// The fleet changes in order (`up` / `down`), and whether each succeeded.
    pub changes: Vec<(String, bool)>,
    /// Most workers in routing at once.
    pub peak: u64,
    /// Whether a scale-up followed a scale-down (oscillation).
    pub oscillated: bool,
    /// TTFT p50 / p99 and ITL p99, ms.
    pub ttft_ms: (f64, f64),
    /// ITL p99, ms.
    pub itl_p99_ms: f64,
    /// The decision log.
    pub log: PathBuf,
    /// The plot.
    pub plot: PathBuf,
}

/// The ramp: steps of clients, then back to the minimum.
pub async fn ramp(o: &Options) -> Result<Ramp, String> {
    std::fs::create_dir_all(&o.out).map_err(|e| e.to_string())?;
    let log = o.out.join("planner-ramp.jsonl");
    let _ = std::fs::remove_file(&log);
    let planner = format!("metric_pulling_interval_s: 1\nadjustment_interval_s: {}\nmax_gpu_budget: {}\ndrain_timeout_s: 120", o.interval_s, o.max_workers);
    let gw = Gateway::start(o, &planner, &log, "kv", o.gpu_blocks).await?;
    let t0 = Instant::now();
    gw.wait_workers(1, Duration::from_secs(60)).await?;
    let mut steps_at = Vec::new();
    let mut all = Vec::new();
    let mut running: Vec<(Arc<AtomicBool>, Vec<_>)> = Vec::new();
    for (i, &n) in o.steps.iter().enumerate() {
        steps_at.push((t0.elapsed().as_secs_f64(), n));
        // Grow or shrink the set of clients to `n` (a stopped client finishes its stream).
        let now: usize = running.iter().map(|(_, h)| h.len()).sum();
        if n > now {
            let stop = Arc::new(AtomicBool::new(false));
            running.push((stop.clone(), clients(&gw, n - now, o, o.output_tokens, &stop, i as u64, t0)));
        }
        let mut over = now.saturating_sub(n);
        while over > 0 {
            let (stop, handles) = running.pop().expect("clients to stop");
            stop.store(true, Ordering::Relaxed);
            over = over.saturating_sub(handles.len());
            for h in handles {
                all.extend(h.await.map_err(|e| e.to_string())?);
            }
            let now: usize = running.iter().map(|(_, h)| h.len()).sum();
            if now < n {
                let stop = Arc::new(AtomicBool::new(false));
                running.push((stop.clone(), clients(&gw, n - now, o, o.output_tokens, &stop, 100 + i as u64, t0)));
            }
        }
        tokio::time::sleep(Duration::from_secs_f64(o.step_s)).await;
    }
    for (stop, handles) in running {
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            all.extend(h.await.map_err(|e| e.to_string())?);
        }
    }
    steps_at.push((t0.elapsed().as_secs_f64(), 0));
    #[allow(clippy::cast_sign_loss, reason = "a configured interval: positive")]
    let limit = Duration::from_secs(30 * o.interval_s as u64 + 60);
    gw.wait_workers(1, limit).await?;
    tokio::time::sleep(Duration::from_secs_f64(o.interval_s)).await;
    drop(gw); // stops it (see `Drop`)
    let lines = read_log(&log)?;
    let plot = o.out.join("planner-ramp.svg");
    std::fs::write(&plot, svg(&lines, &steps_at)).map_err(|e| e.to_string())?;
    let changes: Vec<(String, bool)> =
        lines.iter().filter(|l| l["event"] == "change").map(|l| (l["change"].as_str().unwrap_or("").to_string(), l["ok"] == true)).collect();
    let oscillated = changes.iter().skip_while(|(c, _)| c == "up").any(|(c, _)| c == "up");
    let peak = lines.iter().filter(|l| l["event"] == "pull").filter_map(|l| l["workers"].as_u64()).max().unwrap_or(0);
    let ok: Vec<&client::Sample> = all.iter().map(|(_, s)| s).filter(|s| s.ok()).collect();
    let mut ttft: Vec<Duration> = ok.iter().filter_map(|s| s.ttft).collect();
    let mut itl: Vec<Duration> = ok.iter().flat_map(|s| s.itl.iter().copied()).collect();
    let ms = |v: &mut Vec<Duration>, p| if v.is_empty() { 0.0 } else { percentile(v, p).as_secs_f64() * 1e3 };
    Ok(Ramp {
        requests: all.len(),
        failed: all.iter().filter(|(_, s)| failed(s, o.output_tokens)).count(),
        changes,
        peak,
        oscillated,
        ttft_ms: (ms(&mut ttft, 0.5), ms(&mut ttft, 0.99)),
        itl_p99_ms: ms(&mut itl, 0.99),
        log,
        plot,
    })
}

/// What one scale-down did.
#[derive(Debug, Clone, Default)]
pub struct Drain {
    /// `migrate` or `wait`.
    pub mode: String,
    /// Streams, and those that failed or came back short.
    pub streams: usize,
    /// Failed.
    pub failed: usize,
    /// From the decision to the worker's exit, s.
    pub decision_to_exit_s: f64,
    /// From leaving routing until no request was left on it, s.
    pub drained_s: f64,
    /// Streams moved away.
    pub moved: u64,
    /// The longest gap between two tokens any client saw, ms.
    pub max_gap_ms: f64,
    /// ITL p99 over all streams, ms.
    pub itl_p99_ms: f64,
}

/// Two workers, `drain_streams` long streams over them, then a scale-down to one (`mode`:
/// `migrate` or `wait`).
pub async fn drain(o: &Options, mode: &str) -> Result<Drain, String> {
    std::fs::create_dir_all(&o.out).map_err(|e| e.to_string())?;
    let log = o.out.join(format!("planner-drain-{mode}.jsonl"));
    let _ = std::fs::remove_file(&log);
    // Scale-down below 0.9 KV use (any light load), never up; two workers to start with.
    let rules = |min: u32| {
        format!(
            "metric_pulling_interval_s: 0.5\nadjustment_interval_s: 2\nmin_gpu_budget: {min}\nmax_gpu_budget: 2\ndecode_kv_scale_up_threshold: 0.99\ndecode_kv_scale_down_threshold: 0.9\nnew_decode_worker_grace_period: 0\ndrain: {mode}\ndrain_timeout_s: 600"
        )
    };
    // Round robin puts half the streams on the worker removed (the question is how it is
    // emptied, not where requests go), and each worker has room for all of them (no
    // preemption muddies the gaps).
    let room = o.drain_streams * (o.prompt_tokens + o.drain_tokens) / 16 * 5 / 4;
    let gw = Gateway::start(o, &rules(2), &log, "round_robin", room.max(o.gpu_blocks)).await?;
    gw.wait_workers(2, Duration::from_secs(60)).await?;
    let one_each: Vec<_> = (0..o.drain_streams)
        .map(|i| {
            let (http, url) = (gw.http.clone(), format!("{}/v1/completions", gw.url));
            let mut rng = Rng(0xd4a1 ^ (i as u64 + 1).wrapping_mul(kvgate_kv::hash::PHI));
            let prompt: Vec<u32> = (0..o.prompt_tokens).map(|_| 100 + (rng.next_u64() % 3000) as u32).collect();
            let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": o.drain_tokens, "ignore_eos": true, "stream": true,
                              "stream_options": {"include_usage": true}});
            tokio::spawn(async move { client::send(&http, &url, &body, Instant::now()).await })
        })
        .collect();
    crate::reschedule::wait_running(&gw.http, &gw.admin, o.drain_streams).await?;
    // The operator lowers the minimum: the next interval removes a worker.
    let text = std::fs::read_to_string(&gw.config).map_err(|e| e.to_string())?.replace("min_gpu_budget: 2", "min_gpu_budget: 1");
    std::fs::write(&gw.config, text).map_err(|e| e.to_string())?;
    let r = gw.http.post(format!("{}/reload", gw.admin)).send().await.map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("reload refused: {}", r.text().await.unwrap_or_default()));
    }
    let mut samples = Vec::new();
    for h in one_each {
        samples.push(h.await.map_err(|e| e.to_string())?);
    }
    gw.wait_workers(1, Duration::from_secs(600)).await?;
    let lines = wait_for_change(&log, Duration::from_secs(600)).await?;
    drop(gw); // stops it (see `Drop`)
    let change = lines.iter().find(|l| l["event"] == "change" && l["change"] == "down").cloned().unwrap_or(Value::Null);
    let decision = lines.iter().filter(|l| l["event"] == "decision" && l["change"] == "down").map(|l| l["t"].as_f64().unwrap_or(0.0)).next().unwrap_or(0.0);
    let mut itl: Vec<Duration> = samples.iter().flat_map(|s| s.itl.iter().copied()).collect();
    let max_gap = itl.iter().max().copied().unwrap_or_default();
    Ok(Drain {
        mode: mode.into(),
        streams: samples.len(),
        failed: samples.iter().filter(|s| failed(s, o.drain_tokens)).count(),
        decision_to_exit_s: change["t"].as_f64().unwrap_or(0.0) - decision,
        drained_s: change["drained_s"].as_f64().unwrap_or(0.0),
        moved: change["moved"].as_u64().unwrap_or(0),
        max_gap_ms: max_gap.as_secs_f64() * 1e3,
        itl_p99_ms: if itl.is_empty() { 0.0 } else { percentile(&mut itl, 0.99).as_secs_f64() * 1e3 },
    })
}

/// The log once its scale-down change is written.
async fn wait_for_change(log: &Path, limit: Duration) -> Result<Vec<Value>, String> {
    let start = Instant::now();
    loop {
        let lines = read_log(log)?;
        if lines.iter().any(|l| l["event"] == "change" && l["change"] == "down") {
            return Ok(lines);
        }
        if start.elapsed() > limit {
            return Err("no scale-down was logged".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The decision log's lines.
pub fn read_log(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines().map(|l| serde_json::from_str(l).map_err(|e| format!("{}: {e}", path.display()))).collect()
}

/// Load (clients), average KV utilisation and workers over time, from the decision log's pulls
/// and the client steps (`steps`: (seconds from the start, clients)).
pub fn svg(lines: &[Value], steps: &[(f64, usize)]) -> String {
    const W: f64 = 900.0;
    const H: f64 = 420.0;
    const L: f64 = 60.0;
    const B: f64 = 50.0;
    let pulls: Vec<&Value> = lines.iter().filter(|l| l["event"] == "pull").collect();
    let t0 = pulls.first().and_then(|p| p["t"].as_f64()).unwrap_or(0.0);
    let span = pulls.last().and_then(|p| p["t"].as_f64()).map_or(1.0, |t| (t - t0).max(1.0));
    let max_workers = pulls.iter().filter_map(|p| p["workers"].as_f64()).fold(1.0, f64::max);
    let max_clients = steps.iter().map(|s| s.1 as f64).fold(1.0, f64::max);
    let x = |t: f64| L + (t / span) * (W - L - 20.0);
    let y = |frac: f64| H - B - frac.clamp(0.0, 1.05) * (H - B - 30.0);
    let line = |pts: Vec<(f64, f64)>, color: &str, dash: &str| {
        let p: Vec<String> = pts.iter().map(|(a, b)| format!("{:.1},{:.1}", a, b)).collect();
        format!("<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" {dash} points=\"{}\"/>\n", p.join(" "))
    };
    let kv: Vec<(f64, f64)> = pulls.iter().filter_map(|p| Some((x(p["t"].as_f64()? - t0), y(p["kv_usage"].as_f64()?)))).collect();
    let mut workers = Vec::new();
    for p in &pulls {
        let (Some(t), Some(n)) = (p["t"].as_f64(), p["workers"].as_f64()) else { continue };
        if let Some(&(_, prev)) = workers.last() {
            workers.push((x(t - t0), prev));
        }
        workers.push((x(t - t0), y(n / max_workers)));
    }
    // The client steps are timed from the bench's start, close to the first pull.
    let mut load = Vec::new();
    for (i, &(t, n)) in steps.iter().enumerate() {
        if i > 0 {
            load.push((x(t), load.last().map_or(y(0.0), |p: &(f64, f64)| p.1)));
        }
        load.push((x(t), y(n as f64 / max_clients)));
    }
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{L}\" y=\"18\">kvgate planner: clients (grey, max {max_clients}), average KV use (blue, 0–1), workers (red, max {max_workers})</text>\n\
         <line x1=\"{L}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<text x=\"{}\" y=\"{}\">time, s (0–{span:.0})</text>\n",
        H - B,
        W - 20.0,
        H - B,
        W / 2.0,
        H - 15.0
    );
    out.push_str(&line(load, "#999", "stroke-dasharray=\"4 3\""));
    out.push_str(&line(kv, "#1f77b4", ""));
    out.push_str(&line(workers, "#d62728", ""));
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plot_draws_every_series_from_a_log() {
        let lines: Vec<Value> =
            (0..10).map(|i| json!({"event": "pull", "t": 100.0 + f64::from(i), "kv_usage": f64::from(i) / 10.0, "workers": 1 + i / 4})).collect();
        let svg = svg(&lines, &[(0.0, 2), (4.0, 8), (8.0, 0)]);
        assert_eq!(svg.matches("<polyline").count(), 3, "{svg}");
        assert!(!svg.contains("NaN"));
    }
}
