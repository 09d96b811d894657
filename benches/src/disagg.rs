//! `kvgate-bench disagg`: a prefill-heavy workload through kvgate in front of the same
//! number of vllm-sim workers, once aggregated (every worker prefills and decodes) and once
//! disaggregated (half the workers `role: prefill` with a `kv_producer` connector, half
//! `role: decode` with a `kv_consumer`), each case on a fresh gateway and fresh workers, the
//! same arrivals in both.
//!
//! On an aggregated worker a long prompt's prefill chunks share engine steps with the running
//! decodes, so every stream there waits the length of a chunk for its next token; on a decode
//! worker nothing but decodes runs, and the prompt's KV arrives by transfer (vllm-sim's timing
//! model prices the pull per token). The figures per case: inter-token latency (what
//! disaggregation buys), time to first token (what the second leg and the transfer cost, split
//! by the gateway's `kvgate_disagg_*` histograms), end to end, and failures.

use crate::cluster::{LISTEN_ANY, Procs, SimOptions, SimWorker, spawn_kvgate, start_sims, wait_ok};
use crate::load::client::{self, Sample};
use crate::{Rng, percentile};
use serde_json::json;
use std::fmt::Write as _;
use std::path::PathBuf;
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
    /// Workers in each case (the disaggregated case splits them in halves).
    pub workers: usize,
    /// Prompt tokens per request (unique prompts: no prefix is shared).
    pub prompt_tokens: usize,
    /// Output tokens per stream.
    pub output_tokens: usize,
    /// Arrivals per second (Poisson).
    pub rate: f64,
    /// How long arrivals run.
    pub duration: Duration,
    /// vllm-sim's `--time-scale`.
    pub time_scale: f64,
    /// Extra vllm-sim arguments of every worker.
    pub sim_args: Vec<String>,
}

/// One case's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Case {
    /// `aggregated` or `2P+2D` (as many of each as the split gives).
    pub name: String,
    /// Requests sent.
    pub sent: usize,
    /// Whole streams.
    pub ok: usize,
    /// Failed or short streams.
    pub failed: usize,
    /// TTFT p50 / p90 / p99, ms.
    pub ttft_ms: [f64; 3],
    /// Inter-token latency p50 / p90 / p99 over every gap of every stream, ms.
    pub itl_ms: [f64; 3],
    /// End to end p50 / p90 / p99, ms.
    pub e2e_ms: [f64; 3],
    /// Mean prefill leg as the gateway timed it, ms (disaggregated only).
    pub prefill_leg_ms: Option<f64>,
    /// Mean time from the prefill leg's answer to the decode leg's first token, ms.
    pub decode_first_token_ms: Option<f64>,
    /// Requests the gateway ran aggregated on the disaggregated fleet.
    pub fallbacks: f64,
    /// A few failure reasons.
    pub failures: Vec<String>,
}

impl Case {
    /// The header of [`Case::row`]'s table.
    pub const HEAD: &'static str = "| fleet | sent | ok | failed | ITL p50 | ITL p90 | ITL p99 | TTFT p50 | TTFT p90 | TTFT p99 | e2e p50 | e2e p99 | prefill leg | transfer + 1st decode token | fallbacks |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

    /// The case as a Markdown table row.
    pub fn row(&self) -> String {
        let opt = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.0} ms"));
        format!(
            "| {} | {} | {} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms | {} | {} | {} |",
            self.name,
            self.sent,
            self.ok,
            self.failed,
            self.itl_ms[0],
            self.itl_ms[1],
            self.itl_ms[2],
            self.ttft_ms[0],
            self.ttft_ms[1],
            self.ttft_ms[2],
            self.e2e_ms[0],
            self.e2e_ms[2],
            opt(self.prefill_leg_ms),
            opt(self.decode_first_token_ms),
            self.fallbacks
        )
    }
}

/// Runs the aggregated case, then the disaggregated one.
pub async fn run(o: &Options) -> Result<Vec<Case>, String> {
    std::fs::create_dir_all(&o.out).map_err(|e| e.to_string())?;
    let mut cases = Vec::new();
    for split in [false, true] {
        let case = run_case(o, split).await?;
        println!("{}", case.row());
        cases.push(case);
    }
    Ok(cases)
}

async fn run_case(o: &Options, split: bool) -> Result<Case, String> {
    let mut procs = Procs::default();
    let base = SimOptions { bin: o.sim_bin.clone(), model: "sim-model".into(), args: sim_args(o, None), env: Vec::new() };
    let (workers, roles, name) = if split {
        let p = o.workers / 2;
        let d = o.workers - p;
        let prefill = start_sims(&mut procs, &SimOptions { args: sim_args(o, Some("kv_producer")), ..base.clone() }, p).await?;
        let decode = start_sims(&mut procs, &SimOptions { args: sim_args(o, Some("kv_consumer")), ..base.clone() }, d).await?;
        let roles = [vec!["prefill"; p], vec!["decode"; d]].concat();
        ([prefill, decode].concat(), roles, format!("{p}P+{d}D"))
    } else {
        (start_sims(&mut procs, &base, o.workers).await?, vec!["both"; o.workers], "aggregated".to_string())
    };
    let config = o.out.join(format!("disagg-{name}.yaml"));
    std::fs::write(&config, yaml(&workers, &roles)).map_err(|e| e.to_string())?;
    let (mut gw, at) = spawn_kvgate(&o.kvgate_bin, &config).await?;
    let (url, admin) = (at.url, at.admin);
    let http = reqwest::Client::new();
    if let Err(e) = wait_ok(&http, &format!("{url}/health"), Duration::from_secs(30)).await {
        let _ = gw.kill();
        return Err(e);
    }
    let samples = arrivals(o, &http, &format!("{url}/v1/completions")).await;
    let scraped = match http.get(format!("{admin}/metrics")).send().await {
        Ok(r) => r.text().await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    // Stopped before any early return: a failed scrape must not leave it running.
    let _ = std::process::Command::new("kill").arg("-TERM").arg(gw.id().to_string()).status();
    let _ = gw.wait();
    let metrics = kvgate_tests::prom::Metrics::parse(&scraped?);
    drop(procs);
    let mean_ms = |h: &str| {
        let (sum, n) = (metrics.sum(&format!("{h}_sum"), &[]), metrics.sum(&format!("{h}_count"), &[]));
        (n > 0.0).then(|| sum / n * 1000.0)
    };
    let whole = |s: &&Sample| s.ok() && s.output_tokens as usize == o.output_tokens;
    let ok: Vec<&Sample> = samples.iter().filter(whole).collect();
    let pct =
        |mut v: Vec<Duration>| -> [f64; 3] { [0.5, 0.9, 0.99].map(|p| if v.is_empty() { f64::NAN } else { percentile(&mut v, p).as_secs_f64() * 1000.0 }) };
    Ok(Case {
        name,
        sent: samples.len(),
        ok: ok.len(),
        failed: samples.len() - ok.len(),
        ttft_ms: pct(ok.iter().filter_map(|s| s.ttft).collect()),
        itl_ms: pct(ok.iter().flat_map(|s| s.itl.iter().copied()).collect()),
        e2e_ms: pct(ok.iter().map(|s| s.e2e).collect()),
        prefill_leg_ms: mean_ms("kvgate_disagg_prefill_leg_seconds"),
        decode_first_token_ms: mean_ms("kvgate_disagg_decode_first_token_seconds"),
        // + 0.0: a sum of nothing is -0.
        fallbacks: metrics.sum("kvgate_disagg_requests_total", &[("path", "aggregated")]) + 0.0,
        failures: samples
            .iter()
            .filter(|s| !whole(s))
            .take(10)
            .map(|s| format!("status {} tokens {}: {}", s.status, s.output_tokens, s.error.clone().unwrap_or_default()))
            .collect(),
    })
}

/// Every worker's arguments: the time scale and the extras, and a KV connector in `role`.
fn sim_args(o: &Options, role: Option<&str>) -> Vec<String> {
    let mut a = vec!["--time-scale".to_string(), o.time_scale.to_string(), "--max-model-len".into(), (o.prompt_tokens + o.output_tokens + 64).to_string()];
    a.extend(o.sim_args.iter().cloned());
    if let Some(r) = role {
        a.push("--kv-transfer-config".into());
        a.push(json!({"kv_connector": "NixlConnector", "kv_role": r}).to_string());
    }
    a
}

/// The gateway's config: kv routing at defaults, worker `i` in `roles[i]`.
fn yaml(workers: &[SimWorker], roles: &[&str]) -> String {
    let list = workers.iter().zip(roles).fold(String::new(), |mut s, (w, r)| {
        let _ = write!(s, "      - url: {}\n        kv_events: {}\n        replay: {}\n        role: {r}\n", w.url, w.kv_events, w.replay);
        s
    });
    format!("{LISTEN_ANY}health:\n  interval_ms: 500\nmodels:\n  - name: sim-model\n    tokenizer: builtin\n    routing:\n      mode: kv\n    workers:\n{list}")
}

/// Sends the workload: Poisson arrivals at `rate` for `duration`, each a unique prompt of
/// `prompt_tokens` token ids (seeded, so both cases send the same requests at the same times).
async fn arrivals(o: &Options, http: &reqwest::Client, url: &str) -> Vec<Sample> {
    let mut rng = Rng::seeded(38);
    let start = Instant::now();
    let mut due = Duration::ZERO;
    let mut tasks = Vec::new();
    let mut n = 0u64;
    while due < o.duration {
        let prompt: Vec<u32> = (0..o.prompt_tokens).map(|_| 10 + (rng.next_u64() % 900) as u32).collect();
        let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": o.output_tokens, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
        let at = start + due;
        tokio::time::sleep_until(at.into()).await;
        let (http, url) = (http.clone(), url.to_string());
        tasks.push(tokio::spawn(async move { client::send(&http, &url, &body, at).await }));
        n += 1;
        // Exponential gaps: -ln(U) / rate.
        let u = ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        due += Duration::from_secs_f64(-u.ln() / o.rate);
    }
    let mut out = Vec::with_capacity(n as usize);
    for t in tasks {
        out.push(t.await.unwrap_or_default());
    }
    out
}
