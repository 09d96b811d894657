//! `kvgate demo`: the gateway in front of simulated vLLM workers in one process, for a first
//! look and for pointing curl or an OpenAI SDK at. Starts `workers` in-process vllm-sim servers
//! (KV events on, the tokenizer shipped with the repository), a gateway in front of them in the
//! chosen routing mode, prints where to connect, and a status line whenever traffic changes
//! (requests, the workers' prefix-cache hit rate, per-worker load), until Ctrl-C.

use crate::config::Config;
use crate::server::GatewayHandle;
use std::fmt::Write as _;
use std::time::Duration;
use vllm_sim::config::KvEventsConfig;
use vllm_sim::{SimConfig, SimServer};

/// The model name the demo serves.
pub const MODEL: &str = "kvgate-demo";

/// What to start.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Simulated workers.
    pub workers: usize,
    /// `routing.mode`.
    pub mode: String,
    /// Public port (0 = any free one).
    pub port: u16,
    /// Admin port (0 = any free one).
    pub admin_port: u16,
    /// Simulated time runs this many times faster than wall time.
    pub time_scale: f64,
}

/// A worker as the gateway's config names it.
struct Worker {
    url: String,
    kv_events: String,
    replay: String,
}

/// The gateway configuration for `workers`, as YAML (validated like any file).
fn config_yaml(o: &DemoOptions, workers: &[Worker]) -> String {
    let mut y = format!(
        "listen: 127.0.0.1:{}\nadmin_listen: 127.0.0.1:{}\nhealth:\n  interval_ms: 1000\nmodels:\n  - name: {MODEL}\n    tokenizer: builtin\n    routing:\n      mode: {}\n    workers:\n",
        o.port, o.admin_port, o.mode
    );
    for w in workers {
        let _ = writeln!(y, "      - url: {}\n        kv_events: {}\n        replay: {}", w.url, w.kv_events, w.replay);
    }
    y
}

/// Runs the demo until Ctrl-C; returns the process exit code.
pub fn run(o: &DemoOptions) -> i32 {
    if o.workers == 0 || o.workers > 64 {
        eprintln!("kvgate demo: --workers must be within 1..=64");
        return 2;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().thread_name("vllm-sim").build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvgate demo: cannot start the runtime: {e}");
            return 1;
        }
    };
    let sims: Vec<SimServer> = match rt.block_on(start_workers(o)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvgate demo: cannot start the simulated workers: {e}");
            return 1;
        }
    };
    let workers: Vec<Worker> = sims
        .iter()
        .map(|s| Worker {
            url: s.url(),
            kv_events: s.kv_event_endpoints().first().cloned().unwrap_or_default(),
            replay: s.replay_endpoints().first().cloned().unwrap_or_default(),
        })
        .collect();
    let yaml = config_yaml(o, &workers);
    let cfg: Config = match crate::config::load::load_str(&yaml, "<demo>", Vec::<(String, String)>::new()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvgate demo: {e}");
            return 2;
        }
    };
    let gw = match GatewayHandle::spawn(cfg, None) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("kvgate demo: the gateway did not start: {e} (--port 0 / --admin-port 0: any free port)");
            return 1;
        }
    };
    let url = gw.url();
    println!("kvgate demo: {} simulated vLLM workers (vllm-sim), routing {}", sims.len(), o.mode);
    println!("  API:     {url}/v1   (model \"{MODEL}\")");
    println!("  admin:   {0}/metrics  {0}/workers  {0}/requests", gw.admin_url());
    println!("  try:     curl -N {url}/v1/chat/completions -H 'content-type: application/json' \\");
    println!("             -d '{{\"model\":\"{MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}],\"max_tokens\":20,\"stream\":true}}'");
    println!("  Ctrl-C stops it.");
    let gateway = gw.gateway.clone();
    rt.spawn(async move {
        let mut last = String::new();
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let line = status(&gateway).await;
            if line != last {
                println!("{line}");
                last = line;
            }
        }
    });
    gw.wait();
    rt.block_on(async {
        for s in sims {
            s.shutdown().await;
        }
    });
    0
}

async fn start_workers(o: &DemoOptions) -> Result<Vec<SimServer>, vllm_sim::SimError> {
    let mut sims = Vec::with_capacity(o.workers);
    for i in 0..o.workers {
        let cfg = SimConfig {
            model: MODEL.into(),
            time_scale: o.time_scale,
            seed: i as u64 + 1,
            kv_events: KvEventsConfig {
                enable_kv_cache_events: true,
                endpoint: "tcp://*:0".into(),
                replay_endpoint: Some("tcp://*:0".into()),
                topic: "kv".into(),
                ..KvEventsConfig::default()
            },
            ..SimConfig::default()
        };
        sims.push(SimServer::start(cfg).await?);
    }
    Ok(sims)
}

/// One status line: requests served, hit rate across workers, each worker's requests running
/// and KV usage.
async fn status(gw: &crate::gateway::Gateway) -> String {
    let served: f64 = gw
        .metrics
        .registry()
        .gather()
        .iter()
        .filter(|f| f.name() == "kvgate_requests_total")
        .flat_map(|f| f.get_metric())
        .map(|m| m.get_counter().get_value())
        .sum();
    let (mut hits, mut queries) = (0.0, 0.0);
    let mut load = Vec::new();
    for (_, w) in gw.fleet().all_workers() {
        let body =
            crate::upstream::get(&gw.config(), &w, "/metrics", std::time::Duration::from_secs(2), 8 << 20, true).await.map(|(_, b)| b).unwrap_or_default();
        let text = String::from_utf8_lossy(&body);
        let value = |name: &str| -> f64 { text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum() };
        hits += value("vllm:prefix_cache_hits_total");
        queries += value("vllm:prefix_cache_queries_total");
        load.push(format!("{:.0}r/{:.0}%", value("vllm:num_requests_running"), value("vllm:kv_cache_usage_perc") * 100.0));
    }
    let rate = if queries > 0.0 { format!("{:.2}", hits / queries) } else { "-".into() };
    format!("requests {served:.0} | prefix-cache hit rate {rate} | workers (running/KV used) {}", load.join(" "))
}
