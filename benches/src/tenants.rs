//! `kvgate-bench tenants`: many users on one fleet (docs/tenants.md). Each case runs on a
//! fresh gateway and fresh vllm-sim workers, whose KV caches hold `streams_per_worker` streams
//! each (memory binds first, as on a GPU), behind the router queue.
//!
//! - `alone`: tenant B's steady load, nobody else: B's own latency.
//! - `fifo`: B's load while tenant A floods at `a_rps`, through the gateway without tenants
//!   (today's queue, first come first served).
//! - `fair`: the same load with tenants: fair queuing between A and B.
//! - `weights`: tenants C (weight 1) and D (weight 3) both flooding: the tokens each is served
//!   while both are backlogged, from the gateway's own counters (`GET /tenants`) between the end
//!   of the warm-up and the end of the load.
//!
//! Arrivals are open-loop (Poisson, each tenant its own stream); no client retries, so what a
//! tenant is refused is counted, not hidden.

use crate::cluster::{LISTEN_ANY, Procs, SimOptions, SimWorker, spawn_kvgate, start_sims, wait_ok};
use crate::load::client;
use crate::{Rng, percentile};
use serde_json::{Value, json};
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
    /// Workers.
    pub workers: usize,
    /// Whole streams each worker's KV cache holds.
    pub streams_per_worker: usize,
    /// Prompt tokens per request (one word each in vllm-sim's tokenizer, no shared prefix).
    pub prompt_tokens: usize,
    /// Output tokens per request.
    pub output_tokens: usize,
    /// vllm-sim's `--time-scale`.
    pub time_scale: f64,
    /// Seconds of load per case.
    pub seconds: f64,
    /// Seconds at the start of each case left out of the figures.
    pub warmup: f64,
    /// B's steady rate, requests per second.
    pub b_rps: f64,
    /// A's flood, requests per second.
    pub a_rps: f64,
    /// C's and D's flood each, requests per second.
    pub weights_rps: f64,
    /// The model's `routing.queue_threshold`.
    pub queue_threshold: f64,
    /// Cases to run.
    pub cases: Vec<String>,
    /// A request with no answer by then counts as a timeout.
    pub timeout: Duration,
}

/// One tenant's figures in one case.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TenantFigures {
    /// The tenant.
    pub name: String,
    /// Requests sent after the warm-up.
    pub sent: u64,
    /// Streams that ended whole.
    pub whole: u64,
    /// 429 answers.
    pub limited: u64,
    /// 503 answers.
    pub unavailable: u64,
    /// Anything else (another status, a cut stream, a timeout).
    pub failed: u64,
    /// TTFT of the whole streams, p50 / p90 / p99 (ms).
    pub ttft_ms: [f64; 3],
    /// Tokens the gateway served it between the warm-up and the end of the load (its fair-share
    /// counter's growth; `None` without tenants).
    pub served_tokens: Option<u64>,
    /// Its first few refusals and failures, as the client saw them.
    pub errors: Vec<String>,
    /// Its three slowest first tokens: TTFT (ms) and request id.
    pub slowest: Vec<(f64, String)>,
    /// The route receipts (`GET /requests/{id}`) of its first few requests whose first token
    /// took over a second, read as each ended.
    pub receipts: Vec<Value>,
}

/// One case.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Case {
    /// `alone`, `fifo`, `fair`, `weights`.
    pub name: String,
    /// Its tenants.
    pub tenants: Vec<TenantFigures>,
}

impl Case {
    /// The header of [`Case::rows`].
    pub const HEAD: &'static str = "| case | tenant | sent | whole | 429 | 503 | other | TTFT p50 | TTFT p90 | TTFT p99 | served tokens |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

    /// One Markdown row per tenant.
    pub fn rows(&self) -> String {
        self.tenants.iter().fold(String::new(), |mut s, t| {
            let served = t.served_tokens.map_or("–".into(), |n| n.to_string());
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {:.0} ms | {:.0} ms | {:.0} ms | {served} |",
                self.name, t.name, t.sent, t.whole, t.limited, t.unavailable, t.failed, t.ttft_ms[0], t.ttft_ms[1], t.ttft_ms[2]
            );
            s
        })
    }

    /// A tenant's figures.
    pub fn tenant(&self, name: &str) -> Option<&TenantFigures> {
        self.tenants.iter().find(|t| t.name == name)
    }
}

/// A tenant's load: its name, weight, rate.
struct Load {
    name: &'static str,
    weight: f64,
    rps: f64,
}

/// Runs the cases in order.
pub async fn run(o: &Options) -> Result<Vec<Case>, String> {
    std::fs::create_dir_all(&o.out).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for name in &o.cases {
        let (loads, with_tenants) = match name.as_str() {
            "alone" => (vec![Load { name: "b", weight: 1.0, rps: o.b_rps }], true),
            "fifo" => (vec![Load { name: "a", weight: 1.0, rps: o.a_rps }, Load { name: "b", weight: 1.0, rps: o.b_rps }], false),
            "fair" => (vec![Load { name: "a", weight: 1.0, rps: o.a_rps }, Load { name: "b", weight: 1.0, rps: o.b_rps }], true),
            "weights" => (vec![Load { name: "c", weight: 1.0, rps: o.weights_rps }, Load { name: "d", weight: 3.0, rps: o.weights_rps }], true),
            other => return Err(format!("unknown case {other:?} (alone, fifo, fair, weights)")),
        };
        let case = run_case(o, name, &loads, with_tenants).await?;
        print!("{}", case.rows());
        out.push(case);
    }
    Ok(out)
}

fn key(tenant: &str) -> String {
    format!("sk-bench-{tenant}")
}

async fn run_case(o: &Options, name: &str, loads: &[Load], with_tenants: bool) -> Result<Case, String> {
    let mut procs = Procs::default();
    let blocks = o.streams_per_worker * (o.prompt_tokens + o.output_tokens).div_ceil(16) + 1;
    let sims = SimOptions {
        bin: o.sim_bin.clone(),
        model: "sim-model".into(),
        args: [
            "--time-scale",
            &o.time_scale.to_string(),
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
    let config = o.out.join(format!("tenants-{name}.yaml"));
    std::fs::write(&config, yaml(&workers, loads, with_tenants, o.queue_threshold)).map_err(|e| e.to_string())?;
    let (mut gw, at) = spawn_kvgate(&o.kvgate_bin, &config).await?;
    let http = reqwest::Client::new();
    if let Err(e) = wait_ok(&http, &format!("{}/health", at.url), Duration::from_secs(30)).await {
        let _ = gw.kill();
        return Err(e);
    }
    let start = Instant::now();
    let warm = start + Duration::from_secs_f64(o.warmup);
    let end = start + Duration::from_secs_f64(o.seconds);
    let gens: Vec<_> = loads
        .iter()
        .enumerate()
        .map(|(i, l)| tokio::spawn(generate(o.clone(), (at.url.clone(), at.admin.clone()), l.name, l.rps, i as u64, (warm, end))))
        .collect();
    tokio::time::sleep_until(warm.into()).await;
    let before = served(&http, &at.admin).await;
    tokio::time::sleep_until(end.into()).await;
    let after = served(&http, &at.admin).await;
    let mut tenants = Vec::new();
    for (g, l) in gens.into_iter().zip(loads) {
        let mut t = g.await.map_err(|e| e.to_string())?;
        t.served_tokens = with_tenants.then(|| after.get(l.name).copied().unwrap_or(0).saturating_sub(before.get(l.name).copied().unwrap_or(0)));
        tenants.push(t);
    }
    let _ = std::process::Command::new("kill").arg("-TERM").arg(gw.id().to_string()).status();
    let _ = gw.wait();
    drop(procs);
    Ok(Case { name: name.to_string(), tenants })
}

/// Each tenant's fair-share counter (tokens served), from `GET /tenants`.
async fn served(http: &reqwest::Client, admin: &str) -> std::collections::HashMap<String, u64> {
    let Ok(r) = http.get(format!("{admin}/tenants")).send().await else { return Default::default() };
    let v: Value = r.json().await.unwrap_or_default();
    v["tenants"].as_array().into_iter().flatten().filter_map(|t| Some((t["name"].as_str()?.to_string(), t["fair_share"]["served_tokens"].as_u64()?))).collect()
}

/// One tenant's open-loop arrivals until `end`; figures from those sent after `warm`.
async fn generate(o: Options, (url, admin): (String, String), tenant: &'static str, rps: f64, seed: u64, (warm, end): (Instant, Instant)) -> TenantFigures {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Ok(v) = format!("Bearer {}", key(tenant)).parse() {
        headers.insert(reqwest::header::AUTHORIZATION, v);
    }
    let http = reqwest::Client::builder().default_headers(headers).build().unwrap_or_default();
    let mut rng = Rng::stream(0x7e4a, seed);
    let mut next = Instant::now();
    let mut tasks = Vec::new();
    let mut n = 0u64;
    while next < end {
        tokio::time::sleep_until(next.into()).await;
        n += 1;
        let words = prompt(&mut rng, o.prompt_tokens);
        let body = json!({"model": "sim-model", "prompt": format!("{tenant} {n} {words}"), "max_tokens": o.output_tokens, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
        let (http, url, admin, timeout, counted) = (http.clone(), format!("{url}/v1/completions"), admin.clone(), o.timeout, next >= warm);
        let id = format!("{tenant}-{n}");
        tasks.push(tokio::spawn(async move {
            let header = [("x-request-id", id.as_str())];
            let answer = tokio::time::timeout(timeout, client::send_with(&http, &url, &body, Instant::now(), &header)).await.ok();
            // The receipt of a slow first token, read at once: the gateway keeps a bounded
            // number of finished requests.
            let slow = answer.as_ref().and_then(|s| s.ttft).is_some_and(|t| t > Duration::from_secs(1));
            let receipt = match slow {
                true => match http.get(format!("{admin}/requests/{id}")).send().await {
                    Ok(r) => r.json::<Value>().await.ok(),
                    Err(_) => None,
                },
                false => None,
            };
            (counted, id.clone(), answer, receipt)
        }));
        // Exponential gaps: a Poisson arrival process at `rps`.
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        next += Duration::from_secs_f64(-(1.0 - u).ln() / rps);
    }
    let mut f = TenantFigures { name: tenant.to_string(), ..TenantFigures::default() };
    let mut ttfts = Vec::new();
    for t in tasks {
        let Ok((true, id, answer, receipt)) = t.await else { continue };
        f.sent += 1;
        if let Some(r) = receipt.filter(|_| f.receipts.len() < 3) {
            f.receipts.push(r);
        }
        match answer {
            Some(s) if s.status == 200 && s.ok() && s.output_tokens as usize == o.output_tokens => {
                f.whole += 1;
                ttfts.push(s.ttft.unwrap_or_default());
                f.slowest.push((s.ttft.unwrap_or_default().as_secs_f64() * 1000.0, id));
            }
            Some(s) => {
                match s.status {
                    429 => f.limited += 1,
                    503 => f.unavailable += 1,
                    _ => f.failed += 1,
                }
                if f.errors.len() < 3 {
                    f.errors.push(format!("{id}: {}", s.error.unwrap_or_default()));
                }
            }
            None => f.failed += 1,
        }
    }
    let mut ms = |p: f64| if ttfts.is_empty() { f64::NAN } else { percentile(&mut ttfts, p).as_secs_f64() * 1000.0 };
    f.ttft_ms = [ms(0.5), ms(0.9), ms(0.99)];
    f.slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
    f.slowest.truncate(3);
    f
}

/// `n` words that are one token each in vllm-sim's tokenizer, drawn at random (no two prompts
/// share a prefix beyond their first words).
fn prompt(rng: &mut Rng, n: usize) -> String {
    const WORDS: [&str; 16] = [
        "the", "cache", "router", "block", "prefix", "token", "worker", "request", "stream", "model", "server", "proxy", "latency", "decode", "prefill",
        "system",
    ];
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[(rng.next_u64() % 16) as usize]);
    }
    s
}

fn yaml(workers: &[SimWorker], loads: &[Load], with_tenants: bool, queue_threshold: f64) -> String {
    let list = workers.iter().fold(String::new(), |mut s, w| {
        let _ = write!(s, "      - url: {}\n        kv_events: {}\n        replay: {}\n", w.url, w.kv_events, w.replay);
        s
    });
    let tenants = if with_tenants {
        let mut t = String::from("tenants:\n  list:\n");
        for l in loads {
            let digest = kvgate::config::tenants::to_hex(&kvgate::config::tenants::digest_of(key(l.name).as_bytes()));
            let _ = write!(t, "    - name: {}\n      keys_sha256: [{digest}]\n      weight: {}\n", l.name, l.weight);
        }
        t
    } else {
        String::new()
    };
    format!(
        "{LISTEN_ANY}health:\n  interval_ms: 500\n{tenants}models:\n  - name: sim-model\n    tokenizer: builtin\n    routing:\n      queue_threshold: {queue_threshold}\n    shedding:\n      max_num_batched_tokens: 8192\n    workers:\n{list}"
    )
}
