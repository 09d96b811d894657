//! Clusters of release binaries for benchmarks: `vllm-sim` workers with KV events, a `kvgate`
//! in front of them, and other routers when installed; every process is killed when its
//! [`Procs`] drops, and every port is a free one chosen up front.

use std::fmt::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Distinct free ports: every probe listener stays open until all are chosen, so none repeats.
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port")).collect();
    held.iter().map(|l| l.local_addr().expect("bound").port()).collect()
}

/// Child processes, killed on drop.
#[derive(Default)]
pub struct Procs(pub Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits until `url` answers 2xx; an error after `limit`.
pub async fn wait_ok(http: &reqwest::Client, url: &str, limit: Duration) -> Result<(), String> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if http.get(url).send().await.is_ok_and(|r| r.status().is_success()) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("{url} did not come up within {limit:?}"))
}

/// A simulated worker process.
#[derive(Debug, Clone)]
pub struct SimWorker {
    /// `http://127.0.0.1:port`.
    pub url: String,
    /// Its KV event PUB endpoint.
    pub kv_events: String,
    /// Its replay endpoint.
    pub replay: String,
    /// Its ports (HTTP, KV events, replay), to start it again with [`sim_command`].
    pub ports: [u16; 3],
}

/// How to run the simulated workers.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// The `vllm-sim` binary.
    pub bin: PathBuf,
    /// Served model name.
    pub model: String,
    /// Extra command-line arguments for every worker (e.g. `--time-scale 10`).
    pub args: Vec<String>,
    /// Environment variables of every worker (e.g. `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    pub env: Vec<(String, String)>,
}

/// The command that runs one worker on `ports` (HTTP, KV events, replay), seeded `seed`; run
/// again, it brings the same worker back on the same ports.
pub fn sim_command(o: &SimOptions, seed: usize, [port, ev, rp]: [u16; 3]) -> Command {
    // As in vLLM, a `*` endpoint binds; without it the engine would connect. The topic is
    // vLLM's default, "": vllm-router's static event sources subscribe to exactly that.
    let kv = format!(r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{ev}","replay_endpoint":"tcp://*:{rp}","topic":""}}"#);
    let mut c = Command::new(&o.bin);
    c.args(["--model", &o.model, "--host", "127.0.0.1", "--port", &port.to_string(), "--seed", &seed.to_string()])
        .args(["--kv-events-config", &kv])
        .args(&o.args)
        .envs(o.env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

/// Starts `n` workers and waits until they are healthy.
pub async fn start_sims(procs: &mut Procs, o: &SimOptions, n: usize) -> Result<Vec<SimWorker>, String> {
    let http = reqwest::Client::new();
    let ports = free_ports(3 * n);
    let mut workers = Vec::with_capacity(n);
    for w in 0..n {
        let (port, ev, rp) = (ports[3 * w], ports[3 * w + 1], ports[3 * w + 2]);
        let child = sim_command(o, w + 1, [port, ev, rp]).spawn().map_err(|e| format!("{}: {e}", o.bin.display()))?;
        procs.0.push(child);
        workers.push(SimWorker {
            url: format!("http://127.0.0.1:{port}"),
            kv_events: format!("tcp://127.0.0.1:{ev}"),
            replay: format!("tcp://127.0.0.1:{rp}"),
            ports: [port, ev, rp],
        });
    }
    for w in &workers {
        wait_ok(&http, &format!("{}/health", w.url), Duration::from_secs(30)).await?;
    }
    Ok(workers)
}

/// A running kvgate.
#[derive(Debug, Clone)]
pub struct Kvgate {
    /// Public base URL.
    pub url: String,
    /// Admin base URL (`/metrics`).
    pub admin: String,
}

/// Starts the `kvgate` binary `bin` on the config file `config`, quiet (warnings only, output
/// discarded).
pub fn spawn_kvgate(bin: &Path, config: &Path) -> Result<Child, String> {
    Command::new(bin)
        .arg("--config")
        .arg(config)
        .env("KVGATE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{}: {e}", bin.display()))
}

/// Starts `kvgate` with `routing` (lines of a model's `routing:` section) in front of
/// `workers`; returns once it is healthy and, in kv mode with events, has applied events from
/// every worker.
pub async fn start_kvgate(procs: &mut Procs, bin: &Path, model: &str, routing: &str, workers: &[SimWorker], extra_model: &str) -> Result<Kvgate, String> {
    let http = reqwest::Client::new();
    let ports = free_ports(2);
    let mut list = String::new();
    for w in workers {
        let _ = write!(list, "      - url: {}\n        kv_events: {}\n        replay: {}\n", w.url, w.kv_events, w.replay);
    }
    let routing: String = routing.lines().flat_map(|l| ["      ", l.trim(), "\n"]).collect();
    let extra: String = extra_model.lines().flat_map(|l| ["    ", l, "\n"]).collect();
    let config = format!(
        "listen: 127.0.0.1:{}\nadmin_listen: 127.0.0.1:{}\nmodels:\n  - name: {model}\n    routing:\n{routing}{extra}    workers:\n{list}",
        ports[0], ports[1]
    );
    let path = std::env::temp_dir().join(format!("kvgate-bench-{}-{}.yaml", std::process::id(), ports[0]));
    std::fs::write(&path, config).map_err(|e| e.to_string())?;
    procs.0.push(spawn_kvgate(bin, &path)?);
    let url = format!("http://127.0.0.1:{}", ports[0]);
    let admin = format!("http://127.0.0.1:{}", ports[1]);
    let up = wait_ok(&http, &format!("{url}/health"), Duration::from_secs(30)).await;
    let _ = std::fs::remove_file(&path);
    up?;
    if routing.contains("mode: kv") && !routing.contains("kv_events: false") {
        wait_for_events(&http, &format!("{admin}/metrics"), model, workers).await?;
    }
    Ok(Kvgate { url, admin })
}

/// Waits until the gateway has applied KV events from every worker (a probe request per worker,
/// sent directly, makes each publish), so kv routing does not start blind.
async fn wait_for_events(http: &reqwest::Client, admin_metrics: &str, model: &str, workers: &[SimWorker]) -> Result<(), String> {
    let start = Instant::now();
    loop {
        let text = http.get(admin_metrics).send().await.map_err(|e| e.to_string())?.text().await.map_err(|e| e.to_string())?;
        let m = kvgate_tests::prom::Metrics::parse(&text);
        let sources: std::collections::HashSet<&str> = m
            .samples
            .iter()
            .filter(|s| s.name == "kvgate_kv_events_total" && s.labels.get("result").is_some_and(|r| r == "applied"))
            .filter_map(|s| s.labels.get("source").map(String::as_str))
            .collect();
        if sources.len() >= workers.len() {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(format!("the gateway got KV events from {} of {} workers", sources.len(), workers.len()));
        }
        for w in workers {
            let probe = serde_json::json!({"model": model, "prompt": (0..64).map(|t| t + 7).collect::<Vec<u32>>(), "max_tokens": 1});
            let _ = http.post(format!("{}/v1/completions", w.url)).json(&probe).send().await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `bin` if it can be run (on `PATH` or a path), for optional peers.
pub fn which(bin: &str) -> Option<PathBuf> {
    if bin.contains('/') {
        return Path::new(bin).exists().then(|| PathBuf::from(bin));
    }
    std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(bin)).find(|f| f.is_file()))
}

/// The sum of a metric's samples on the admin listener's `/metrics` (NaN when unreadable).
pub async fn metric_sum(http: &reqwest::Client, admin: &str, name: &str) -> f64 {
    let Ok(r) = http.get(format!("{admin}/metrics")).send().await else { return f64::NAN };
    let text = r.text().await.unwrap_or_default();
    text.lines().filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' '])).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}
