//! `kvgate-bench`'s load generator: sends a [`Workload`] to any OpenAI-compatible endpoint,
//! open loop (requests leave at their scheduled times whatever the answers) or as closed-loop
//! sessions (chat completions or Anthropic Messages), measures each request from the client's side, and summarizes the run with
//! the workers' own prefix-cache counters read before and after.

pub mod client;
pub mod report;
pub mod workload;

use client::Sample;
use kvgate_tests::prom::Metrics;
use report::{Report, Slo};
use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use workload::{Api, Session, Workload};

/// Most requests in flight at once (a bound on the generator's own memory and sockets).
pub const MAX_IN_FLIGHT: usize = 4096;

/// One run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Name in the report.
    pub label: String,
    /// Base URL of the target (`http://host:port`).
    pub url: String,
    /// `model` of every request.
    pub model: String,
    /// Base URLs of the workers behind it, for their prefix-cache counters (may be empty).
    pub worker_urls: Vec<String>,
    /// The SLO goodput is counted against.
    pub slo: Slo,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// The API sessions are sent as (open-loop workloads carry their own paths).
    pub api: Api,
    /// Base URLs each request is sent to one of, at random (an L4 balancer in front of
    /// replicas); `url` when unset.
    pub spread: Option<Arc<Spread>>,
}

/// Base URLs requests are spread over at random, one draw per request, as an L4 load balancer
/// in front of gateway replicas does; a target taken out ([`Spread::remove`], a balancer's
/// health check failing it) gets no more. Failed requests are counted per target.
#[derive(Debug, Default)]
pub struct Spread {
    urls: parking_lot::RwLock<Vec<String>>,
    draws: std::sync::atomic::AtomicU64,
    failed: parking_lot::Mutex<std::collections::BTreeMap<String, usize>>,
}

impl Spread {
    /// Over `urls`.
    pub fn new(urls: Vec<String>) -> Arc<Self> {
        Arc::new(Self { urls: parking_lot::RwLock::new(urls), ..Self::default() })
    }

    /// The next request's target.
    pub fn pick(&self) -> String {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        let urls = self.urls.read();
        urls[(kvgate_kv::hash::mix(n ^ 0x5eed) % urls.len().max(1) as u64) as usize].clone()
    }

    /// Takes `url` out.
    pub fn remove(&self, url: &str) {
        self.urls.write().retain(|u| u != url);
    }

    /// A request sent to `url` failed.
    pub fn failed_at(&self, url: &str) {
        *self.failed.lock().entry(url.to_string()).or_default() += 1;
    }

    /// Failed requests per target.
    pub fn failures(&self) -> std::collections::BTreeMap<String, usize> {
        self.failed.lock().clone()
    }
}

impl RunOptions {
    /// The base URL of the next request.
    fn base(&self) -> String {
        self.spread.as_ref().map_or_else(|| self.url.clone(), |s| s.pick())
    }

    fn record(&self, base: &str, ok: bool) {
        if let (Some(s), false) = (&self.spread, ok) {
            s.failed_at(base);
        }
    }
}

/// Sums `vllm:prefix_cache_hits_total` and `vllm:prefix_cache_queries_total` over `urls`.
pub async fn prefix_cache_counters(http: &reqwest::Client, urls: &[String]) -> Option<(f64, f64)> {
    worker_counters(http, urls).await.map(|c| (c.hits, c.queries))
}

/// The workers' counters a run reads before and after, summed over the workers.
#[derive(Debug, Clone, Copy, Default)]
struct WorkerCounters {
    /// `vllm:prefix_cache_hits_total`.
    hits: f64,
    /// `vllm:prefix_cache_queries_total`.
    queries: f64,
    /// `vllm_sim:engine_lag_seconds_total` (0 on a real vLLM, which has no such metric).
    lag_s: f64,
}

async fn worker_counters(http: &reqwest::Client, urls: &[String]) -> Option<WorkerCounters> {
    let mut total = WorkerCounters::default();
    for u in urls {
        let m = Metrics::parse(&http.get(format!("{u}/metrics")).send().await.ok()?.text().await.ok()?);
        total.hits += m.sum("vllm:prefix_cache_hits_total", &[]);
        total.queries += m.sum("vllm:prefix_cache_queries_total", &[]);
        total.lag_s += m.sum("vllm_sim:engine_lag_seconds_total", &[]);
    }
    Some(total)
}

struct Progress {
    total: usize,
    done: AtomicUsize,
    failed: AtomicUsize,
    on: bool,
}

impl Progress {
    fn tick(&self, ok: bool) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if !ok {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        if self.on && (done.is_multiple_of(10) || done == self.total) {
            let width = 30;
            let filled = done * width / self.total.max(1);
            eprint!("\r[{}{}] {done}/{} done, {} failed ", "#".repeat(filled), ".".repeat(width - filled), self.total, self.failed.load(Ordering::Relaxed));
            let _ = std::io::stderr().flush();
            if done == self.total {
                eprintln!();
            }
        }
    }
}

/// Runs `workload` against `o.url` and summarizes it.
pub async fn run(o: &RunOptions, workload: &Workload) -> Report {
    let http = reqwest::Client::builder().pool_max_idle_per_host(1024).build().unwrap_or_default();
    let before = worker_counters(&http, &o.worker_urls).await;
    let progress = Arc::new(Progress { total: workload.len(), done: AtomicUsize::new(0), failed: AtomicUsize::new(0), on: o.progress });
    let limit = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    let start = Instant::now();
    let samples: Vec<Sample> = match workload {
        Workload::Open(jobs) => {
            let mut tasks = Vec::with_capacity(jobs.len());
            for job in jobs {
                let due = start + job.at;
                tokio::time::sleep_until(due.into()).await;
                let Ok(permit) = limit.clone().acquire_owned().await else { break };
                let base = o.base();
                let (http, url, progress, o) = (http.clone(), format!("{base}{}", job.path), progress.clone(), o.clone());
                let mut body = job.body.clone();
                body["model"] = o.model.clone().into();
                tasks.push(tokio::spawn(async move {
                    let mut s = client::send(&http, &url, &body, due).await;
                    s.due = due - start;
                    o.record(&base, s.ok());
                    progress.tick(s.ok());
                    drop(permit);
                    s
                }));
            }
            let mut out = Vec::with_capacity(tasks.len());
            for t in tasks {
                if let Ok(s) = t.await {
                    out.push(s);
                }
            }
            out
        }
        Workload::Sessions(sessions) => {
            let tasks: Vec<_> = sessions
                .iter()
                .cloned()
                .map(|session| {
                    let (http, o, progress) = (http.clone(), o.clone(), progress.clone());
                    tokio::spawn(async move { converse(&http, &o, session, start, &progress).await })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                if let Ok(s) = t.await {
                    out.extend(s);
                }
            }
            out
        }
    };
    let duration = start.elapsed();
    let after = worker_counters(&http, &o.worker_urls).await;
    let hit_rate = match (before, after) {
        (Some(b), Some(a)) if a.queries > b.queries => Some((a.hits - b.hits) / (a.queries - b.queries)),
        _ => None,
    };
    let mut report = report::summarize(&o.label, &samples, duration, o.slo, hit_rate);
    report.sim_lag_s = before.zip(after).map(|(b, a)| (a.lag_s - b.lag_s).max(0.0));
    report
}

/// One session: each turn carries the whole history so far, sent as `o.api`.
async fn converse(http: &reqwest::Client, o: &RunOptions, s: Session, start: Instant, progress: &Progress) -> Vec<Sample> {
    tokio::time::sleep_until((start + s.start).into()).await;
    let mut answers: Vec<String> = Vec::with_capacity(s.turns.len());
    let mut out = Vec::with_capacity(s.turns.len());
    for i in 0..s.turns.len() {
        if i > 0 {
            tokio::time::sleep(s.think).await;
        }
        let mut body = s.request(o.api, &s.history(&answers));
        body["model"] = o.model.clone().into();
        let sent = Instant::now();
        let base = o.base();
        let mut sample = client::send(http, &format!("{base}{}", o.api.path()), &body, sent).await;
        sample.due = sent - start;
        o.record(&base, sample.ok());
        progress.tick(sample.ok());
        answers.push(std::mem::take(&mut sample.text));
        let failed = !sample.ok();
        let due = sample.due;
        out.push(sample);
        if failed {
            // A conversation does not go on past a failed turn; its remaining turns count as
            // failed too, so every target is judged on the same number of requests. They are
            // recorded as due with the turn that failed.
            for _ in i + 1..s.turns.len() {
                progress.tick(false);
                out.push(Sample { error: Some("not sent: an earlier turn of the session failed".into()), due, ..Sample::default() });
            }
            break;
        }
    }
    out
}
