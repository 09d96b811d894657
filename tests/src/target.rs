//! The server under test.
//!
//! Without environment variables, [`Target::start`] starts an in-process vllm-sim on ephemeral
//! ports with KV events and replay on, so tests are parallel-safe. With `KVGATE_TARGET_URL`
//! set, tests run against that server instead; `KVGATE_TARGET_MODEL`, `KVGATE_TARGET_ZMQ` and
//! `KVGATE_TARGET_REPLAY` describe it (tests/real-vllm/run-suite.sh sets them for real vLLM).

use serde_json::Value;
use std::time::Duration;
use vllm_sim::{KvEventsConfig, SimConfig, SimServer};

/// A vLLM-compatible server to test.
pub struct Target {
    /// `http://host:port`.
    pub url: String,
    /// Served model name.
    pub model: String,
    /// KV events PUB endpoint.
    pub zmq: Option<String>,
    /// KV events replay ROUTER endpoint.
    pub replay: Option<String>,
    /// Topic the server publishes under.
    pub topic: String,
    /// True when the target is real vLLM (or any external server).
    pub external: bool,
    /// HTTP client.
    pub http: reqwest::Client,
    /// The in-process simulator, running while the target lives (`None` for an external one).
    sim: Option<SimServer>,
}

/// The sim configuration tests use by default: events on, replay on, fast-ish time.
pub fn test_sim_config() -> SimConfig {
    SimConfig {
        model: "sim-model".into(),
        block_size: 16,
        num_gpu_blocks: 4096,
        max_model_len: 4096,
        time_scale: 4.0,
        kv_events: KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: "tcp://127.0.0.1:0".replace("127.0.0.1", "*"),
            replay_endpoint: Some("tcp://*:0".into()),
            topic: "kv".into(),
            ..KvEventsConfig::default()
        },
        ..SimConfig::default()
    }
}

impl Target {
    /// The target named by the environment, or a fresh in-process simulator.
    pub async fn start() -> Target {
        match std::env::var("KVGATE_TARGET_URL") {
            Ok(url) => Target {
                url: url.trim_end_matches('/').to_string(),
                model: std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into()),
                zmq: std::env::var("KVGATE_TARGET_ZMQ").ok(),
                replay: std::env::var("KVGATE_TARGET_REPLAY").ok(),
                topic: std::env::var("KVGATE_TARGET_TOPIC").unwrap_or_else(|_| "kv".into()),
                external: true,
                http: client(),
                sim: None,
            },
            Err(_) => Self::sim(test_sim_config()).await,
        }
    }

    /// An in-process simulator with `cfg`.
    pub async fn sim(cfg: SimConfig) -> Target {
        let topic = cfg.kv_events.topic.clone();
        let model = cfg.model_name().to_string();
        let sim = SimServer::start(cfg).await.expect("vllm-sim starts");
        Target {
            url: sim.url(),
            model,
            zmq: sim.kv_event_endpoints().into_iter().next(),
            replay: sim.replay_endpoints().into_iter().next(),
            topic,
            external: false,
            http: client(),
            sim: Some(sim),
        }
    }

    /// The in-process simulator, if that is what runs.
    pub fn sim_server(&self) -> Option<&SimServer> {
        self.sim.as_ref()
    }

    /// POSTs JSON and returns (status, parsed body).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.url)).json(body).send().await.expect("request sent");
        let status = r.status().as_u16();
        let text = r.text().await.expect("body read");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// POSTs raw bytes as JSON content.
    pub async fn post_raw(&self, path: &str, body: &'static [u8]) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.url)).header("content-type", "application/json").body(body).send().await.expect("request sent");
        let status = r.status().as_u16();
        let text = r.text().await.expect("body read");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// GETs a path and returns (status, text).
    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self.http.get(format!("{}{path}", self.url)).send().await.expect("request sent");
        (r.status().as_u16(), r.text().await.expect("body read"))
    }

    /// Token ids of `text` as the server tokenizes a completion prompt.
    pub async fn tokenize(&self, text: &str) -> Vec<u32> {
        let (s, v) = self.post("/tokenize", &serde_json::json!({"model": self.model, "prompt": text})).await;
        assert_eq!(s, 200, "{v}");
        v["tokens"].as_array().expect("tokens").iter().map(|t| t.as_u64().expect("id") as u32).collect()
    }

    /// Current metrics.
    pub async fn metrics(&self) -> crate::prom::Metrics {
        let (s, text) = self.get("/metrics").await;
        assert_eq!(s, 200);
        crate::prom::Metrics::parse(&text)
    }

    /// The engine's KV block size, from `vllm:cache_config_info`.
    pub async fn block_size(&self) -> usize {
        let m = self.metrics().await;
        m.info_label("vllm:cache_config_info", "block_size").and_then(|b| b.parse().ok()).expect("block_size label")
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("http client")
}

/// A prompt text unlikely to share a first block with any other test's prompt.
pub fn unique_text(words: usize) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    const VOCAB: [&str; 16] = [
        "the", "cache", "router", "block", "prefix", "token", "worker", "request", "stream", "model", "server", "proxy", "latency", "decode", "prefill",
        "system",
    ];
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mut x = nanos ^ N.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed) ^ u64::from(std::process::id()) << 32;
    (0..words)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            VOCAB[(x % 16) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}
