//! Clusters of release binaries for benchmarks: `vllm-sim` workers with KV events, a `kvgate`
//! in front of them, and other routers when installed; every process is killed when its
//! [`Procs`] drops. Our own binaries bind port 0 and write the ports they got to a file
//! (`--ports-file`), so no port is guessed free and bound later by another process.

use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Distinct ports for third-party servers (peer routers, nginx), which cannot bind port 0 and
/// say which port they got: from below the kernel's ephemeral range, so neither the benchmark's
/// own connections nor any port-0 bind takes one before the peer binds it.
pub fn ports_for_peers(n: usize) -> Vec<u16> {
    (0..n).map(|_| kvgate_tests::ports::reserved_run(1)).collect()
}

/// A fresh path for a `--ports-file` in the temporary directory.
fn ports_file_path(what: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!("kvgate-bench-{}-{what}-{}.ports.json", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

/// Waits for the `--ports-file` a child writes once its sockets are bound, and reads it; an
/// error when the child exits first or `limit` passes.
pub async fn read_ports_file(child: &mut Child, path: &Path, limit: Duration) -> Result<Value, String> {
    let start = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            let _ = std::fs::remove_file(path);
            return serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()));
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("the process exited ({status}) before binding its ports"));
        }
        if start.elapsed() > limit {
            return Err(format!("{} was not written within {limit:?}", path.display()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The port of an address or URL (`host:port`, `http://host:port`, `tcp://host:port`).
fn port_of(addr: &str) -> Result<u16, String> {
    addr.trim_end_matches('/').rsplit(':').next().and_then(|p| p.parse().ok()).ok_or_else(|| format!("no port in {addr}"))
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
    /// The ports it bound (HTTP, KV events, replay), to start it again where it was with
    /// [`sim_command`], as a restarted pod comes back on its own ports.
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

/// The command that runs one worker on `ports` (HTTP, KV events, replay; 0: any), seeded
/// `seed`; run again with the ports it bound, it brings the same worker back where it was.
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

/// Starts `n` workers on ports of the system's choosing and waits until they are healthy.
pub async fn start_sims(procs: &mut Procs, o: &SimOptions, n: usize) -> Result<Vec<SimWorker>, String> {
    let http = reqwest::Client::new();
    let mut workers = Vec::with_capacity(n);
    for w in 0..n {
        let file = ports_file_path("sim");
        let mut child = sim_command(o, w + 1, [0; 3]).arg("--ports-file").arg(&file).spawn().map_err(|e| format!("{}: {e}", o.bin.display()))?;
        let bound = read_ports_file(&mut child, &file, Duration::from_secs(30)).await;
        procs.0.push(child);
        let bound = bound?;
        let first =
            |key: &str| bound[key].get(0).and_then(Value::as_str).map(str::to_owned).ok_or_else(|| format!("vllm-sim wrote no {key} endpoint: {bound}"));
        let (url, kv_events, replay) = (bound["url"].as_str().unwrap_or_default().to_string(), first("kv_events")?, first("replay")?);
        let ports = [port_of(&url)?, port_of(&kv_events)?, port_of(&replay)?];
        workers.push(SimWorker { url, kv_events, replay, ports });
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
/// discarded), and returns once it has bound its listeners (the config's `listen` and
/// `admin_listen` are best port 0) and answers `/health` as itself (any status: a planner's
/// gateway starts with no worker).
pub async fn spawn_kvgate(bin: &Path, config: &Path) -> Result<(Child, Kvgate), String> {
    spawn_kvgate_logged(bin, config, None).await
}

/// [`spawn_kvgate`], its output written to `log` when given, at the level `KVGATE_LOG` names in
/// the benchmark's own environment (warnings only when unset): `KVGATE_LOG=warn,kvgate=debug`
/// keeps each routing decision's terms and each request's measured TTFT, joined by request id.
pub async fn spawn_kvgate_logged(bin: &Path, config: &Path, log: Option<&Path>) -> Result<(Child, Kvgate), String> {
    let file = ports_file_path("kvgate");
    let (out, err, level) = match log {
        Some(path) => {
            let f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let level = std::env::var("KVGATE_LOG").unwrap_or_else(|_| "warn".into());
            (Stdio::from(f.try_clone().map_err(|e| e.to_string())?), Stdio::from(f), level)
        }
        None => (Stdio::null(), Stdio::null(), "warn".into()),
    };
    let mut child = Command::new(bin)
        .arg("--config")
        .arg(config)
        .arg("--ports-file")
        .arg(&file)
        .env("KVGATE_LOG", level)
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    let ready = async {
        let bound = read_ports_file(&mut child, &file, Duration::from_secs(30)).await?;
        let addr =
            |key: &str| bound[key].as_str().map(|a| format!("http://127.0.0.1:{}", port_of(a).unwrap_or(0))).ok_or_else(|| format!("no {key} in {bound}"));
        let gw = Kvgate { url: addr("listen")?, admin: addr("admin_listen")? };
        let instance = bound["instance"].as_str().unwrap_or_default().to_string();
        wait_answering(&gw.admin, &instance).await?;
        Ok::<_, String>(gw)
    };
    match ready.await {
        Ok(gw) => Ok((child, gw)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

/// Waits until `/health` at `base` names `instance`.
async fn wait_answering(base: &str, instance: &str) -> Result<(), String> {
    let http = reqwest::Client::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if let Ok(r) = http.get(format!("{base}/health")).send().await
            && r.json::<Value>().await.is_ok_and(|v| v["instance"] == instance)
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("{base} did not answer as kvgate instance {instance}"))
}

/// Starts `kvgate` serving `model` with `routing` (lines of the model's `routing:` section) and
/// `extra_model` (more lines of the model's entry) in front of `workers`, its output to `log`
/// ([`spawn_kvgate_logged`]); returns once it is healthy and, in kv mode with events, has
/// applied events from every worker.
pub async fn start_kvgate(procs: &mut Procs, bin: &Path, model: (&str, &str, &str), workers: &[SimWorker], log: Option<&Path>) -> Result<Kvgate, String> {
    let (child, gw) = spawn_kvgate_for(bin, "", model, workers, log).await?;
    procs.0.push(child);
    Ok(gw)
}

/// [`start_kvgate`] with `top` (more top-level lines of its config, e.g. a `cluster:`
/// section), its process handed back rather than kept in a [`Procs`] (a benchmark that kills
/// it).
pub async fn spawn_kvgate_for(
    bin: &Path,
    top: &str,
    (model, routing, extra_model): (&str, &str, &str),
    workers: &[SimWorker],
    log: Option<&Path>,
) -> Result<(Child, Kvgate), String> {
    let http = reqwest::Client::new();
    let mut list = String::new();
    for w in workers {
        let _ = write!(list, "      - url: {}\n        kv_events: {}\n        replay: {}\n", w.url, w.kv_events, w.replay);
    }
    let routing: String = routing.lines().flat_map(|l| ["      ", l.trim(), "\n"]).collect();
    let extra: String = extra_model.lines().flat_map(|l| ["    ", l, "\n"]).collect();
    let config = format!("{LISTEN_ANY}{top}models:\n  - name: {model}\n    routing:\n{routing}{extra}    workers:\n{list}");
    // kvgate watches its config file, and one removed under it is an error in its log: a
    // logged run keeps the config beside the log (what each target ran with), an unlogged one
    // removes it from the temporary directory once started.
    let path = log.map_or_else(|| ports_file_path("config").with_extension("yaml"), |l| l.with_extension("yaml"));
    std::fs::write(&path, config).map_err(|e| format!("{}: {e}", path.display()))?;
    let started = spawn_kvgate_logged(bin, &path, log).await;
    if log.is_none() {
        let _ = std::fs::remove_file(&path);
    }
    let (mut child, gw) = started?;
    let ready = async {
        wait_ok(&http, &format!("{}/health", gw.url), Duration::from_secs(30)).await?;
        if routing.contains("mode: kv") && !routing.contains("kv_events: false") {
            wait_for_events(&http, &format!("{}/metrics", gw.admin), model, workers).await?;
        }
        Ok::<_, String>(())
    };
    if let Err(e) = ready.await {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    Ok((child, gw))
}

/// The listener lines of a benchmark's kvgate config: both on loopback, ports of the system's
/// choosing (read back by [`spawn_kvgate`]).
pub const LISTEN_ANY: &str = "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n";

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
