//! A gateway in front of workers, for end-to-end tests: in-process vllm-sim workers (or any
//! URLs) on ephemeral ports, a kvgate started from a YAML file in a fresh temp directory (so
//! reload tests can rewrite it), and helpers to read both sides' metrics.

use crate::prom::Metrics;
use kvgate::{GatewayHandle, Stop};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use vllm_sim::{SimConfig, SimServer};

/// Knobs of the generated gateway config.
#[derive(Debug, Clone)]
pub struct GatewayOpts {
    /// Model name.
    pub model: String,
    /// `routing.mode`.
    pub mode: String,
    /// Extra top-level YAML (e.g. `max_body_bytes: 64KiB`).
    pub extra: String,
    /// `health.interval_ms`.
    pub health_interval_ms: u64,
    /// `health.timeout_ms` and `health.unhealthy_threshold`: quick to judge by default (fault
    /// tests kill workers, whose refused probes fail at once), yet two failed probes of a second,
    /// so a loaded host that delays one round of probes marks no worker down; lenient for real
    /// vLLM ([`GatewayOpts::real_vllm`]).
    pub health_timeout: (u64, u32),
    /// Extra YAML inside the model's `routing:` section (e.g. `temperature: 0.5`).
    pub routing_extra: String,
    /// Extra YAML at the model level (e.g. a `shedding:` section).
    pub model_extra: String,
}

impl Default for GatewayOpts {
    fn default() -> Self {
        Self {
            model: "sim-model".into(),
            mode: "round_robin".into(),
            extra: String::new(),
            health_interval_ms: 100,
            health_timeout: (1_000, 2),
            routing_extra: String::new(),
            model_extra: String::new(),
        }
    }
}

impl GatewayOpts {
    /// For real vLLM serving `model`: health judged leniently, as a real server on shared cores
    /// can take seconds to answer `/health` while it computes.
    pub fn real_vllm(model: &str) -> Self {
        Self { model: model.into(), health_timeout: (5000, 3), ..Self::default() }
    }
}

/// A worker entry: URL and, optionally, its KV event and replay endpoints.
#[derive(Debug, Clone)]
pub struct WorkerEntry {
    /// Base URL.
    pub url: String,
    /// PUB endpoint.
    pub kv_events: Option<String>,
    /// Replay endpoint.
    pub replay: Option<String>,
}

/// The YAML of a gateway serving `urls`.
pub fn gateway_yaml(urls: &[String], o: &GatewayOpts) -> String {
    let entries: Vec<WorkerEntry> = urls.iter().map(|u| WorkerEntry { url: u.clone(), kv_events: None, replay: None }).collect();
    gateway_yaml_workers(&entries, o)
}

/// The YAML of a gateway serving `workers`. Its responses name their worker by URL
/// (`worker_header: url`, not the default): the tests tell workers apart by address.
pub fn gateway_yaml_workers(workers_in: &[WorkerEntry], o: &GatewayOpts) -> String {
    let mut workers = String::new();
    for w in workers_in {
        let _ = writeln!(workers, "      - url: {}", w.url);
        if let Some(k) = &w.kv_events {
            let _ = writeln!(workers, "        kv_events: {k}");
        }
        if let Some(r) = &w.replay {
            let _ = writeln!(workers, "        replay: {r}");
        }
    }
    format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nthreads: 2\nworker_header: url\n{extra}\nhealth:\n  interval_ms: {hi}\n  timeout_ms: {ht}\n  unhealthy_threshold: {hu}\n  healthy_threshold: 1\nshutdown:\n  drain_timeout_s: 30\nmodels:\n  - name: {model}\n    routing:\n      mode: {mode}\n{routing_extra}{model_extra}    workers:\n{workers}",
        model_extra = o.model_extra.lines().flat_map(|l| ["    ", l, "\n"]).collect::<String>(),
        routing_extra = o.routing_extra.lines().flat_map(|l| ["      ", l, "\n"]).collect::<String>(),
        extra = o.extra,
        hi = o.health_interval_ms,
        ht = o.health_timeout.0,
        hu = o.health_timeout.1,
        model = o.model,
        mode = o.mode,
    )
}

/// A temp directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh directory.
    pub fn new() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!("kvgate-test-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }
}

impl Default for TempDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Workers + gateway.
pub struct Cluster {
    /// In-process simulated workers (empty when fronting external URLs only).
    pub sims: Vec<SimServer>,
    /// The gateway (None after a shutdown test took it).
    pub gw: Option<GatewayHandle>,
    /// The config file the gateway reloads from.
    pub config_path: PathBuf,
    /// HTTP client.
    pub http: reqwest::Client,
    _dir: TempDir,
}

impl Cluster {
    /// `n` simulators made from `sim`, behind a gateway.
    pub async fn sims(n: usize, sim: SimConfig, opts: GatewayOpts) -> Cluster {
        let mut sims = Vec::new();
        for _ in 0..n {
            sims.push(SimServer::start(sim.clone()).await.expect("sim starts"));
        }
        let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
        let mut c = Cluster::front(&urls, opts).await;
        c.sims = sims;
        c
    }

    /// `n` simulators with KV events behind a gateway that subscribes to them.
    pub async fn sims_with_events(n: usize, sim: SimConfig, opts: GatewayOpts) -> Cluster {
        let mut sims = Vec::new();
        for _ in 0..n {
            sims.push(SimServer::start(sim.clone()).await.expect("sim starts"));
        }
        let workers: Vec<WorkerEntry> = sims
            .iter()
            .map(|s| WorkerEntry { url: s.url(), kv_events: s.kv_event_endpoints().into_iter().next(), replay: s.replay_endpoints().into_iter().next() })
            .collect();
        let mut c = Cluster::front_yaml(gateway_yaml_workers(&workers, &opts)).await;
        c.sims = sims;
        c
    }

    /// A gateway in front of existing worker URLs.
    pub async fn front(urls: &[String], opts: GatewayOpts) -> Cluster {
        Cluster::front_yaml(gateway_yaml(urls, &opts)).await
    }

    /// A gateway from a YAML text.
    pub async fn front_yaml(yaml: String) -> Cluster {
        crate::logs::capture();
        let dir = TempDir::new();
        let path = dir.0.join("kvgate.yaml");
        std::fs::write(&path, yaml).expect("write config");
        let cfg = kvgate::config::load::load_file(&path).expect("valid test config");
        let p = path.clone();
        let gw = tokio::task::spawn_blocking(move || GatewayHandle::spawn(cfg, Some(p))).await.expect("join").expect("gateway starts");
        Cluster { sims: Vec::new(), gw: Some(gw), config_path: path, http: reqwest::Client::new(), _dir: dir }
    }

    /// The gateway handle.
    pub fn gw(&self) -> &GatewayHandle {
        self.gw.as_ref().expect("gateway running")
    }

    /// Public URL + path.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.gw().url())
    }

    /// Admin URL + path.
    pub fn admin(&self, path: &str) -> String {
        format!("{}{path}", self.gw().admin_url())
    }

    /// The gateway's metrics.
    pub async fn gateway_metrics(&self) -> Metrics {
        Metrics::parse(&self.http.get(self.admin("/metrics")).send().await.expect("admin up").text().await.expect("text"))
    }

    /// Worker `i`'s metrics.
    pub async fn sim_metrics(&self, i: usize) -> Metrics {
        let url = format!("{}/metrics", self.sims[i].url());
        Metrics::parse(&self.http.get(url).send().await.expect("sim up").text().await.expect("text"))
    }

    /// The index of the sim carrying the most streams that have generated two tokens or more,
    /// once at least `streams` of them do (`None` before; the admin listener's `/requests`).
    pub async fn busiest_streaming_sim(&self, streams: usize) -> Option<usize> {
        let v: serde_json::Value = self.http.get(self.admin("/requests")).send().await.ok()?.json().await.ok()?;
        let on: Vec<&str> = v["requests"]
            .as_array()?
            .iter()
            .filter(|r| r["phase"] == "running" && r["generated_tokens"].as_u64().unwrap_or(0) >= 2)
            .filter_map(|r| r["worker"].as_str())
            .collect();
        if on.len() < streams {
            return None;
        }
        let busiest = on.iter().max_by_key(|w| on.iter().filter(|x| x == w).count())?;
        self.sims.iter().position(|s| s.url() == *busiest)
    }

    /// Stops the gateway (drain or fast) on a blocking thread and waits.
    pub async fn stop_gateway(&mut self, how: Stop) {
        if let Some(gw) = self.gw.take() {
            tokio::task::spawn_blocking(move || gw.shutdown(how)).await.expect("join");
        }
    }
}

/// Polls `f` every 5 ms until it returns true or `limit` passes; returns the time it took.
pub async fn wait_until<F, Fut>(limit: Duration, mut f: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}
