//! LoRA adapters on vllm-sim as vLLM 0.32 serves them (`--lora-modules`, `/v1/models`, runtime
//! load and unload behind `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): the answers are the ones a real
//! server gave (tests/real-vllm/setup.sh's adapter), and the KV events carry the adapter.

use kvgate_tests::Target;
use kvgate_tests::events::EventSub;
use kvgate_tests::target::{test_sim_config, unique_text};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use vllm_sim::SimConfig;
use vllm_sim::lora::LoraModule;

/// A directory that looks like an adapter to vLLM (it holds an `adapter_config.json`), removed
/// when dropped.
struct AdapterDir(PathBuf);

impl AdapterDir {
    fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!("vllm-sim-lora-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("adapter_config.json"), r#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}"#).unwrap();
        Self(dir)
    }

    fn path(&self) -> String {
        self.0.to_string_lossy().into_owned()
    }
}

impl Drop for AdapterDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn with_lora(modules: Vec<LoraModule>) -> SimConfig {
    SimConfig { enable_lora: true, lora_modules: modules, max_loras: 2, ..test_sim_config() }
}

fn module(name: &str, dir: &AdapterDir, base: Option<&str>) -> LoraModule {
    LoraModule { name: name.into(), path: dir.path(), base_model_name: base.map(str::to_owned), is_3d_lora_weight: false }
}

/// POSTs JSON; returns the status, the content type and the body's text.
async fn post_text(t: &Target, path: &str, body: &Value) -> (u16, Option<String>, String) {
    let r = t.http.post(format!("{}{path}", t.url)).json(body).send().await.unwrap();
    let ct = r.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned());
    (r.status().as_u16(), ct, r.text().await.unwrap())
}

#[tokio::test]
async fn lora_modules_are_listed_served_and_published_as_in_vllm() {
    let (sql, chat) = (AdapterDir::new("sql"), AdapterDir::new("chat"));
    let t = Target::sim(with_lora(vec![module("sql", &sql, None), module("chat", &chat, Some("sim-model"))])).await;
    let (s, models) = t.get("/v1/models").await;
    assert_eq!(s, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    let cards = models["data"].as_array().unwrap();
    assert_eq!(cards.iter().map(|c| c["id"].as_str().unwrap()).collect::<Vec<_>>(), ["sim-model", "sql", "chat"]);
    assert_eq!((&cards[0]["root"], &cards[0]["parent"], &cards[0]["max_model_len"]), (&json!("sim-model"), &Value::Null, &json!(4096)));
    assert_eq!((&cards[1]["root"], &cards[1]["parent"], &cards[1]["max_model_len"]), (&json!(sql.path()), &json!("sim-model"), &Value::Null));
    assert_eq!(cards[1]["owned_by"], "vllm");
    // A request naming an adapter is served under its name; an unknown model is vLLM's 404.
    let (s, v) = t.post("/v1/completions", &json!({"model": "sql", "prompt": "the cache", "max_tokens": 2})).await;
    assert_eq!((s, &v["model"]), (200, &json!("sql")), "{v}");
    let (s, v) = t.post("/v1/chat/completions", &json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})).await;
    assert_eq!((s, &v["model"]), (200, &json!("chat")), "{v}");
    let (s, v) = t.post("/v1/completions", &json!({"model": "nope", "prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, 404);
    assert_eq!(
        v["error"],
        json!({"message": "The model `nope` does not exist. Valid aliases: sim-model.", "type": "NotFoundError", "param": "model", "code": 404})
    );
    // Its blocks are stored under the adapter: lora_id, lora_name, the name first in extra_keys
    // (the salt after it on the first block), and kvgate's decoder reads the salt alone.
    let mut sub = EventSub::connect(t.zmq.as_deref().unwrap(), "kv").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let batch = loop {
        assert!(Instant::now() < deadline, "no event batch");
        // A fresh prompt each time: a cached one would store nothing new.
        let prompt = t.tokenize(&unique_text(40)).await;
        let (s, v) = t.post("/v1/completions", &json!({"model": "sql", "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})).await;
        assert_eq!(s, 200, "{v}");
        if let Some(b) = sub.next(Duration::from_millis(300)).await {
            break b;
        }
    };
    let raw = rmpv::decode::read_value(&mut batch.payload.as_slice()).unwrap();
    let field = |k: &str| raw[1][0].as_map().unwrap().iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v.clone()).unwrap();
    assert_eq!((field("lora_id"), field("lora_name")), (rmpv::Value::from(1), rmpv::Value::from("sql")));
    let keys = field("extra_keys");
    assert_eq!(keys[0], rmpv::Value::Array(vec!["sql".into(), "tenant-a".into()]));
    assert_eq!(keys[1], rmpv::Value::Array(vec!["sql".into()]));
    let decoded = kvgate_kv::event::decode_batch(&batch.payload).unwrap();
    let kvgate_kv::event::Event::Stored(stored) = &decoded.events[0] else { panic!("{decoded:?}") };
    assert_eq!(stored.lora_name.as_deref(), Some("sql"));
    assert_eq!(stored.extras[0], Some(kvgate_kv::hash::salt_digest("tenant-a")));
    assert!(stored.extras[1..].iter().all(Option::is_none));
}

#[tokio::test]
async fn a_lora_module_without_an_adapter_or_without_enable_lora_stops_the_start() {
    let empty = std::env::temp_dir();
    let bad = LoraModule {
        name: "x".into(),
        path: empty.join("no-such-adapter-dir").to_string_lossy().into_owned(),
        base_model_name: None,
        is_3d_lora_weight: false,
    };
    let e = vllm_sim::SimServer::start(with_lora(vec![bad])).await.err().expect("refused");
    assert!(e.to_string().contains("Loading lora x failed: No adapter found for"), "{e}");
    let dir = AdapterDir::new("off");
    let off = SimConfig { enable_lora: false, ..with_lora(vec![module("x", &dir, None)]) };
    let e = vllm_sim::SimServer::start(off).await.err().expect("refused");
    assert!(e.to_string().contains("--enable-lora"), "{e}");
}

#[tokio::test]
async fn runtime_loading_exists_only_when_vllm_allows_it_and_answers_as_vllm() {
    let dir = AdapterDir::new("rt");
    // Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist.
    let t = Target::sim(with_lora(Vec::new())).await;
    let load = json!({"lora_name": "sql", "lora_path": dir.path()});
    let (s, v) = t.post("/v1/load_lora_adapter", &load).await;
    assert_eq!((s, v), (404, json!({"detail": "Not Found"})));
    let t = Target::sim(SimConfig { runtime_lora_updating: true, ..with_lora(Vec::new()) }).await;
    assert_eq!(post_text(&t, "/v1/load_lora_adapter", &load).await, (200, None, "Success: LoRA adapter 'sql' added successfully.".into()));
    let refusals = [
        (
            load.clone(),
            400,
            "InvalidUserInput",
            "The lora adapter 'sql' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.",
        ),
        (
            json!({"lora_name": "sim-model", "lora_path": dir.path()}),
            400,
            "InvalidUserInput",
            "The lora adapter 'sim-model' conflicts with a served base model.",
        ),
        (json!({"lora_name": "", "lora_path": dir.path()}), 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."),
        (json!({"lora_name": "x", "lora_path": "/nonexistent/x"}), 404, "NotFoundError", "Loading lora x failed: No adapter found for /nonexistent/x"),
        (
            json!({"lora_name": "x"}),
            400,
            "Bad Request",
            "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', 'msg': 'Field required', 'input': '<dict of 1 items>'}",
        ),
    ];
    for (body, status, kind, message) in refusals {
        let (s, v) = t.post("/v1/load_lora_adapter", &body).await;
        assert_eq!(
            (s, v["error"]["type"].as_str(), v["error"]["message"].as_str(), v["error"]["code"].as_u64()),
            (status, Some(kind), Some(message), Some(u64::from(status))),
            "{body}"
        );
    }
    // Loaded in place: same name, served.
    let (s, _) = t.post("/v1/load_lora_adapter", &json!({"lora_name": "sql", "lora_path": dir.path(), "load_inplace": true})).await;
    assert_eq!(s, 200);
    let (s, v) = t.post("/v1/completions", &json!({"model": "sql", "prompt": "x", "max_tokens": 1})).await;
    assert_eq!((s, &v["model"]), (200, &json!("sql")), "{v}");
    let (_, models) = t.get("/v1/models").await;
    assert!(models.contains("\"id\":\"sql\""), "{models}");
    assert_eq!(
        post_text(&t, "/v1/unload_lora_adapter", &json!({"lora_name": "sql"})).await,
        (200, None, "Success: LoRA adapter 'sql' removed successfully.".into())
    );
    let (s, v) = t.post("/v1/unload_lora_adapter", &json!({"lora_name": "sql"})).await;
    assert_eq!((s, &v["error"]["message"]), (404, &json!("The lora adapter 'sql' cannot be found.")));
    let (s, v) = t.post("/v1/unload_lora_adapter", &json!({"lora_name": ""})).await;
    assert_eq!((s, &v["error"]["message"]), (400, &json!("'lora_name' needs to be provided to unload a LoRA adapter.")));
    let (s, _) = t.post("/v1/completions", &json!({"model": "sql", "prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, 404, "an unloaded adapter is an unknown model");
    let r = t.http.get(format!("{}/v1/load_lora_adapter", t.url)).send().await.unwrap();
    assert_eq!(r.status(), 405);
    // Allowed, but LoRA not enabled: the engine refuses, a 500.
    let t = Target::sim(SimConfig { runtime_lora_updating: true, enable_lora: false, ..test_sim_config() }).await;
    let (s, v) = t.post("/v1/load_lora_adapter", &load).await;
    assert_eq!((s, &v["error"]["type"]), (500, &json!("InternalServerError")), "{v}");
}
