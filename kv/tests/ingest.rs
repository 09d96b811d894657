//! Event ingestion end to end against vllm-sim workers on real ZMQ sockets: the index follows
//! the worker's cache; a gap is repaired by replay; an engine restart and an unknown parent
//! clear the worker and resync.

use kvgate_kv::hash::{DEFAULT_SEED, Hasher};
use kvgate_kv::index::{FlatIndex, KvIndex};
use kvgate_kv::metrics::KvMetrics;
use kvgate_kv::subscriber::{Source, run};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vllm_sim::faults::FaultConfig;
use vllm_sim::{KvEventsConfig, SimConfig, SimServer};

const BS: usize = 16;

fn sim_config(pub_port: u16, replay_port: u16) -> SimConfig {
    SimConfig {
        block_size: BS,
        num_gpu_blocks: 4096,
        max_model_len: 4096,
        time_scale: 20.0,
        kv_events: KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: format!("tcp://*:{pub_port}"),
            replay_endpoint: Some(format!("tcp://*:{replay_port}")),
            topic: "kv".into(),
            ..KvEventsConfig::default()
        },
        ..SimConfig::default()
    }
}

/// A port below the kernel's ephemeral range (which the kernel never assigns on its own) and
/// free now, for a socket that must be bound at a port named up front: an engine restarted on
/// the endpoints it had, a subscriber that binds. Each is handed out once per process, from a
/// run of 100 that starts at an offset of the process id.
fn reserved_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let floor = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok().and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok());
    let base = 12_000 + u16::try_from(std::process::id() % 64).expect("below 64") * 100;
    assert!(floor.unwrap_or(32_768) > u32::from(base) + 100, "the ephemeral range starts at {floor:?}: no reserved ports below it");
    std::iter::from_fn(|| Some(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)))
        .take_while(|&n| n < 100)
        .map(|n| base + n)
        .find(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        .expect("a free port among this process's reserved ones")
}

struct Fixture {
    sim: Option<SimServer>,
    index: Arc<FlatIndex>,
    registry: prometheus::Registry,
    task: tokio::task::JoinHandle<()>,
    http: reqwest::Client,
    hasher: Hasher,
    ports: (u16, u16),
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn fixture(with_replay: bool) -> Fixture {
    let ports = (reserved_port(), reserved_port());
    let sim = SimServer::start(sim_config(ports.0, ports.1)).await.expect("sim starts");
    let index = Arc::new(FlatIndex::new(8, 1024));
    let registry = prometheus::Registry::new();
    let metrics = KvMetrics::new(&registry);
    let hasher = Hasher::new(BS, DEFAULT_SEED);
    let src = Source {
        endpoint: format!("tcp://127.0.0.1:{}", ports.0),
        replay: with_replay.then(|| format!("tcp://127.0.0.1:{}", ports.1)),
        topic: "kv".into(),
        worker: 0,
        hasher,
        label: "w0".into(),
    };
    let task = tokio::spawn(run(src, index.clone(), metrics));
    Fixture { sim: Some(sim), index, registry, task, http: reqwest::Client::new(), hasher, ports }
}

impl Fixture {
    async fn complete(&self, prompt: &[u32]) {
        let url = format!("{}/v1/completions", self.sim.as_ref().unwrap().url());
        let r = self.http.post(url).json(&serde_json::json!({"prompt": prompt, "max_tokens": 1})).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }

    fn matched(&self, prompt: &[u32]) -> u32 {
        self.index.find_matches(&self.hasher.chain(None, prompt)).get(0)
    }

    async fn wait_matched(&self, prompt: &[u32], want: u32) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if self.matched(prompt) == want {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    fn counter(&self, name: &str, label: (&str, &str)) -> f64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric().to_vec())
            .filter(|m| m.get_label().iter().any(|l| l.name() == label.0 && l.value() == label.1))
            .map(|m| m.get_counter().get_value())
            .sum()
    }

    /// Sends a warm-up prompt until the subscriber has seen it (ZMQ subscriptions are async).
    async fn warm_up(&self) {
        let start = Instant::now();
        loop {
            let p = prompt(9000 + start.elapsed().as_millis() as u32 % 500, 2);
            self.complete(&p).await;
            if self.wait_short(&p, 2).await {
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(15), "subscriber never received events");
        }
    }

    async fn wait_short(&self, p: &[u32], want: u32) -> bool {
        for _ in 0..50 {
            if self.matched(p) == want {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }
}

/// `blocks` full blocks plus 3 tokens, distinct per `seed`.
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS + 3) as u32).map(|i| (seed * 131 + i * 7) % 4000 + 10).collect()
}

#[tokio::test]
async fn the_index_follows_the_workers_cache() {
    let f = fixture(true).await;
    f.warm_up().await;
    let p = prompt(1, 5);
    f.complete(&p).await;
    assert!(f.wait_matched(&p, 5).await, "the prompt's 5 full blocks are indexed");
    // Reset the worker's cache: AllBlocksCleared (published with the next step) empties it.
    let url = format!("{}/reset_prefix_cache", f.sim.as_ref().unwrap().url());
    f.http.post(url).send().await.unwrap();
    f.complete(&prompt(2, 0)).await;
    assert!(f.wait_matched(&p, 0).await, "cleared");
}

#[tokio::test]
async fn a_gap_is_repaired_by_replay() {
    let f = fixture(true).await;
    f.warm_up().await;
    f.sim.as_ref().unwrap().faults().set(FaultConfig { drop_kv_batches: 1, ..Default::default() }).unwrap();
    let lost = prompt(3, 4);
    f.complete(&lost).await; // its BlockStored batch never reaches the subscriber
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(f.matched(&lost), 0, "the dropped batch is not seen live");
    f.complete(&prompt(4, 2)).await; // the next batch reveals the gap
    assert!(f.wait_matched(&lost, 4).await, "replay filled the gap");
    assert!(f.counter("kvgate_kv_gaps_total", ("source", "w0")) >= 1.0);
    assert!(f.counter("kvgate_kv_replays_total", ("result", "ok")) >= 1.0);
}

#[tokio::test]
async fn an_engine_restart_clears_the_worker_and_resyncs() {
    let mut f = fixture(true).await;
    f.warm_up().await;
    let before = prompt(5, 3);
    f.complete(&before).await;
    assert!(f.wait_matched(&before, 3).await);
    // The worker dies and comes back empty on the same endpoints.
    f.sim.take().unwrap().shutdown().await;
    let down = Instant::now();
    f.sim = loop {
        // The old sockets may take a moment to close: the ports are ours (reserved), so retry.
        match SimServer::start(sim_config(f.ports.0, f.ports.1)).await {
            Ok(s) => break Some(s),
            Err(_) if down.elapsed() < Duration::from_secs(10) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("the engine did not come back on its endpoints: {e}"),
        }
    };
    let after = prompt(6, 2);
    let start = Instant::now();
    loop {
        f.complete(&after).await;
        if f.wait_short(&after, 2).await {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "events from the restarted engine never arrived");
    }
    assert_eq!(f.matched(&before), 0, "blocks of the dead engine are gone");
    let resyncs = f.counter("kvgate_kv_resyncs_total", ("reason", "restart")) + f.counter("kvgate_kv_resyncs_total", ("reason", "disconnect"));
    assert!(resyncs >= 1.0);
}

#[tokio::test]
async fn an_unknown_parent_clears_the_worker() {
    let f = fixture(false).await; // no replay: a gap cannot be repaired
    f.warm_up().await;
    let kept = prompt(7, 2);
    f.complete(&kept).await;
    assert!(f.wait_matched(&kept, 2).await);
    f.sim.as_ref().unwrap().faults().set(FaultConfig { drop_kv_batches: 1, ..Default::default() }).unwrap();
    let parent = prompt(8, 2);
    f.complete(&parent).await; // lost
    // A continuation of the lost prompt: its BlockStored names a parent we never saw.
    let mut child = parent[..2 * BS].to_vec();
    child.extend(prompt(9, 2));
    f.complete(&child).await;
    let start = Instant::now();
    while f.counter("kvgate_kv_resyncs_total", ("reason", "unknown_parent")) < 1.0 {
        assert!(start.elapsed() < Duration::from_secs(10), "no resync");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(f.matched(&kept), 0, "the worker's state was dropped");
    assert_eq!(f.index.block_count(0), 0);
}

#[tokio::test]
async fn bind_mode_receives_from_an_engine_that_connects() {
    // vLLM can be told to connect its PUB to the router: the subscriber binds.
    let port = reserved_port();
    let index = Arc::new(FlatIndex::new(4, 64));
    let hasher = Hasher::new(BS, DEFAULT_SEED);
    let src = Source { endpoint: format!("tcp://*:{port}"), replay: None, topic: "".into(), worker: 2, hasher, label: "bound".into() };
    let task = tokio::spawn(run(src, index.clone(), KvMetrics::new(&prometheus::Registry::new())));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut cfg = sim_config(0, 0);
    cfg.kv_events.endpoint = format!("tcp://127.0.0.1:{port}");
    cfg.kv_events.replay_endpoint = None;
    let sim = SimServer::start(cfg).await.expect("sim starts");
    let http = reqwest::Client::new();
    let start = Instant::now();
    let p = prompt(11, 3);
    loop {
        let r = http.post(format!("{}/v1/completions", sim.url())).json(&serde_json::json!({"prompt": p, "max_tokens": 1})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
        if index.find_matches(&hasher.chain(None, &p)).get(2) == 3 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no events over the engine-initiated connection");
        // The first batch may precede the subscription; a fresh prompt publishes again.
        let _ = http.post(format!("{}/reset_prefix_cache", sim.url())).send().await;
    }
    task.abort();
}
