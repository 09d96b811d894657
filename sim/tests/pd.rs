//! Prefill/decode disaggregation between in-process simulators, driven as a P/D proxy drives
//! real vLLM with NixlConnector: a prefill leg (`do_remote_decode`, `max_tokens: 1`, unary)
//! to a producer, then the original request with the prefill worker's `kv_transfer_params` to
//! a consumer, which pulls the blocks over the prefill worker's side channel.

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

use serde_json::{Value, json};
use std::time::{Duration, Instant};
use vllm_sim::config::KvTransferConfig;
use vllm_sim::kv_connector::http_request;
use vllm_sim::{SimConfig, SimServer};

const PROMPT: &str =
    "Prefill and decode run on different workers; the decode worker pulls the prompt's KV cache blocks from the prefill worker before it generates.";

fn kv(role: &str, extra: &Value) -> KvTransferConfig {
    let json = json!({"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra});
    KvTransferConfig::parse(&json.to_string()).expect("a valid config")
}

async fn sim(kv_transfer: KvTransferConfig) -> SimServer {
    SimServer::start(SimConfig { time_scale: 50.0, num_gpu_blocks: 512, max_model_len: 2048, kv_transfer, ..SimConfig::default() }).await.expect("starts")
}

async fn call(s: &SimServer, method: hyper::Method, path: &str, body: Option<&Value>) -> (u16, String) {
    let a = s.addr();
    let (status, bytes) = http_request(method, "127.0.0.1", a.port(), path, body).await.expect("reachable");
    (status.as_u16(), String::from_utf8_lossy(&bytes).into_owned())
}

async fn post(s: &SimServer, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = call(s, hyper::Method::POST, path, Some(body)).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A series of `/metrics`, by name and a label it must carry (`""`: any).
async fn metric(s: &SimServer, name: &str, label: &str) -> f64 {
    let (_, text) = call(s, hyper::Method::GET, "/metrics", None).await;
    let line = text.lines().find(|l| l.starts_with(&format!("{name}{{")) && l.contains(label)).unwrap_or_else(|| panic!("no {name} {label} in\n{text}"));
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a number")
}

/// Waits (polling) until `f` holds; false after 5 s.
async fn eventually<F: AsyncFn() -> bool>(f: F) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

fn completion(max_tokens: u64) -> Value {
    json!({"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": true, "return_token_ids": true})
}

/// The proxy's prefill leg: the request with vLLM's prefill parameters, unary, one token.
fn prefill_leg(mut body: Value) -> Value {
    body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                                        "remote_block_ids": null, "remote_host": null, "remote_port": null});
    body["stream"] = json!(false);
    body["max_tokens"] = json!(1);
    body
}

fn decode_leg(mut body: Value, params: &Value) -> Value {
    body["kv_transfer_params"] = params.clone();
    body
}

fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"].as_array().expect("token_ids").iter().filter_map(Value::as_u64).collect()
}

#[tokio::test]
async fn a_prefill_leg_answers_nixls_kv_transfer_params_and_holds_its_blocks() {
    let p = sim(kv("kv_producer", &json!({}))).await;
    let (s, v) = post(&p, "/v1/completions", &prefill_leg(completion(16))).await;
    assert_eq!(s, 200, "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 1);
    let kv = &v["kv_transfer_params"];
    assert_eq!((kv["do_remote_prefill"].as_bool(), kv["do_remote_decode"].as_bool()), (Some(true), Some(false)));
    let blocks = kv["remote_block_ids"].as_array().expect("a list per KV cache group");
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].as_array().unwrap().len() as u64, prompt_tokens.div_ceil(16), "the prompt's blocks");
    assert_eq!(kv["remote_engine_id"], p.config().kv_transfer.engine_id());
    assert!(kv["remote_request_id"].as_str().is_some_and(|r| !r.is_empty()));
    assert_eq!((kv["remote_host"].as_str(), kv["remote_port"].as_u64()), (Some("127.0.0.1"), Some(u64::from(p.addr().port()))));
    assert_eq!((kv["tp_size"].as_u64(), kv["dcp_size"].as_u64(), kv["pp_size"].as_u64()), (Some(1), Some(1), Some(1)));
    assert_eq!((kv["remote_num_tokens"].as_u64(), kv["transfer_mode"].as_str()), (Some(prompt_tokens), Some("pull")));
    assert_eq!(kv["remote_prefill_cached_tokens"], 0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let expiry = kv["remote_blocks_expiry_time"].as_f64().unwrap();
    assert!(expiry > now && expiry < now + 30.0 / 50.0 + 1.0, "the 30 s lease, scaled by time_scale: {expiry} vs {now}");
    assert_eq!(metric(&p, "vllm_sim:kv_held_requests", "").await, 1.0);
    assert!(metric(&p, "vllm:kv_cache_usage_perc", "").await > 0.0, "held blocks count as used KV");

    // The same prompt again: its prefix-cache hits are reported for the decode worker.
    let (_, v) = post(&p, "/v1/completions", &prefill_leg(completion(16))).await;
    assert_eq!(v["kv_transfer_params"]["remote_prefill_cached_tokens"].as_u64(), Some((prompt_tokens - 1) / 16 * 16));
    // A plain request to a producer is served as ever.
    let (_, v) = post(&p, "/v1/completions", &completion(4)).await;
    assert_eq!((v["kv_transfer_params"].clone(), ids(&v).len()), (Value::Null, 4));
}

#[tokio::test]
async fn a_decode_leg_pulls_the_blocks_and_answers_as_aggregated_serving() {
    let p = sim(kv("kv_producer", &json!({}))).await;
    let d = sim(kv("kv_consumer", &json!({}))).await;
    let agg = sim(KvTransferConfig::default()).await;
    let (_, want) = post(&agg, "/v1/completions", &completion(24)).await;
    let prompt_tokens = want["usage"]["prompt_tokens"].as_u64().unwrap();

    let (_, pre) = post(&p, "/v1/completions", &prefill_leg(completion(24))).await;
    assert_eq!(ids(&pre)[0], ids(&want)[0], "the prefill leg's one token is the answer's first");
    let params = pre["kv_transfer_params"].clone();
    let (s, got) = post(&d, "/v1/completions", &decode_leg(completion(24), &params)).await;
    assert_eq!(s, 200, "{got}");
    assert_eq!(ids(&got), ids(&want), "the whole answer, from its first token");
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
    assert_eq!(got["usage"], want["usage"]);
    assert_eq!(got["kv_transfer_params"], Value::Null, "a decode leg's response carries none, as vLLM's");

    // The prefill worker freed the pulled blocks; a second pull finds nothing.
    assert_eq!(metric(&p, "vllm_sim:kv_held_requests", "").await, 0.0);
    assert_eq!(metric(&p, "vllm:kv_cache_usage_perc", "").await, 0.0);
    let again = json!({"remote_engine_id": params["remote_engine_id"], "remote_request_id": params["remote_request_id"], "remote_block_ids": params["remote_block_ids"]});
    let (s, v) = post(&p, "/kv_transfer/pull", &again).await;
    assert_eq!((s, v["error"]["type"].as_str()), (404, Some("NotFoundError")), "{v}");

    // The decode worker computed only the prompt's last token (vLLM recomputes it for logits).
    let by = |source: &'static str| metric(&d, "vllm:prompt_tokens_by_source_total", source);
    assert_eq!(by("source=\"external_kv_transfer\"").await, prompt_tokens as f64);
    assert_eq!(by("source=\"local_compute\"").await, 1.0);
    assert_eq!(by("source=\"local_cache_hit\"").await, 0.0);
    assert_eq!(metric(&d, "vllm:prompt_tokens_total", "").await, prompt_tokens as f64);
    assert_eq!(metric(&p, "vllm:prompt_tokens_by_source_total", "source=\"local_compute\"").await, prompt_tokens as f64);

    // The pulled blocks are in the decode worker's prefix cache under the prompt's hashes.
    let hits_before = metric(&d, "vllm:prefix_cache_hits_total", "").await;
    post(&d, "/v1/completions", &completion(2)).await;
    assert_eq!(metric(&d, "vllm:prefix_cache_hits_total", "").await - hits_before, ((prompt_tokens - 1) / 16 * 16) as f64);
}

#[tokio::test]
async fn a_streaming_chat_decode_leg_works() {
    let p = sim(kv("kv_both", &json!({}))).await;
    let d = sim(kv("kv_both", &json!({}))).await;
    let chat = json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "ignore_eos": true});
    let (_, want) = post(&d, "/v1/chat/completions", &chat).await;
    let (_, pre) = post(&p, "/v1/chat/completions", &prefill_leg(chat.clone())).await;
    assert_eq!(pre["kv_transfer_params"]["do_remote_prefill"], true, "{pre}");
    let mut body = decode_leg(chat, &pre["kv_transfer_params"]);
    body["stream"] = json!(true);
    let (s, sse) = call(&d, hyper::Method::POST, "/v1/chat/completions", Some(&body)).await;
    assert_eq!(s, 200, "{sse}");
    let text: String = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(text, want["choices"][0]["message"]["content"].as_str().unwrap());
    assert!(sse.ends_with("data: [DONE]\n\n"));
    // The decode worker served the same prompt before: it pulls only the blocks it lacks.
    let prompt = want["usage"]["prompt_tokens"].as_u64().unwrap();
    let local = (prompt - 1) / 16 * 16;
    assert_eq!(metric(&d, "vllm:prompt_tokens_by_source_total", "source=\"external_kv_transfer\"").await, (prompt - local) as f64);
    assert_eq!(metric(&d, "vllm:prompt_tokens_by_source_total", "source=\"local_cache_hit\"").await, local as f64);
    assert_eq!(metric(&p, "vllm_sim:kv_held_requests", "").await, 0.0);
}

#[tokio::test]
async fn unpulled_blocks_are_freed_when_the_lease_ends_and_the_decode_leg_recomputes() {
    // A 5 s lease at time_scale 50: 0.1 s of wall time.
    let p = sim(kv("kv_producer", &json!({"kv_lease_duration": 5}))).await;
    let d = sim(kv("kv_consumer", &json!({}))).await;
    let (_, pre) = post(&p, "/v1/completions", &prefill_leg(completion(8))).await;
    assert_eq!(metric(&p, "vllm_sim:kv_held_requests", "").await, 1.0);
    assert!(eventually(async || metric(&p, "vllm_sim:kv_held_requests", "").await == 0.0).await, "the lease ends");
    assert_eq!(metric(&p, "vllm:kv_cache_usage_perc", "").await, 0.0);

    // The pull finds the blocks gone: kv_load_failure_policy "recompute" (the default).
    let (s, got) = post(&d, "/v1/completions", &decode_leg(completion(8), &pre["kv_transfer_params"])).await;
    assert_eq!(s, 200, "{got}");
    let (_, want) = post(&p, "/v1/completions", &completion(8)).await;
    assert_eq!(ids(&got), ids(&want));
    let prompt_tokens = got["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(metric(&d, "vllm:prompt_tokens_by_source_total", "source=\"local_compute\"").await, prompt_tokens);
    assert_eq!(metric(&d, "vllm:prompt_tokens_by_source_total", "source=\"external_kv_transfer\"").await, 0.0);
}

#[tokio::test]
async fn a_failed_pull_fails_the_request_under_the_fail_policy() {
    let d = SimServer::start(SimConfig {
        time_scale: 50.0,
        kv_transfer: KvTransferConfig::parse(r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"fail"}"#).unwrap(),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    // A prefill worker that is gone: a port nobody listens on (a privileged one, which no test
    // binds, so it stays refused).
    let closed = 1;
    let params = json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1, 2, 3, 4, 5, 6]], "remote_engine_id": "gone",
                        "remote_request_id": "cmpl-x-0-12345678", "remote_host": "127.0.0.1", "remote_port": closed, "tp_size": 1});
    let (s, v) = post(&d, "/v1/completions", &decode_leg(completion(8), &params)).await;
    assert_eq!((s, v["error"]["message"].as_str(), v["error"]["code"].as_u64()), (500, Some("Internal server error"), Some(500)), "{v}");
    let mut body = decode_leg(completion(8), &params);
    body["stream"] = json!(true);
    let (s, sse) = call(&d, hyper::Method::POST, "/v1/completions", Some(&body)).await;
    assert_eq!(s, 200);
    assert!(sse.starts_with("data: {\"error\":{\"message\":\"Internal server error\""), "{sse}");
    assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
    assert_eq!(metric(&d, "vllm:request_success_total", "finished_reason=\"error\"").await, 2.0);
    assert_eq!((metric(&d, "vllm:kv_cache_usage_perc", "").await, metric(&d, "vllm:num_requests_waiting", "").await), (0.0, 0.0));
}

#[tokio::test]
async fn a_server_without_a_connector_ignores_kv_transfer_params() {
    let s = sim(KvTransferConfig::default()).await;
    let (_, want) = post(&s, "/v1/completions", &completion(6)).await;
    let (st, pre) = post(&s, "/v1/completions", &prefill_leg(completion(6))).await;
    assert_eq!((st, pre["kv_transfer_params"].clone(), ids(&pre).len()), (200, Value::Null, 1));
    let bogus = json!({"do_remote_prefill": true, "remote_block_ids": [[1]], "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 1});
    let (_, got) = post(&s, "/v1/completions", &decode_leg(completion(6), &bogus)).await;
    assert_eq!((ids(&got), got["kv_transfer_params"].clone()), (ids(&want), Value::Null));
    assert_eq!(metric(&s, "vllm:prompt_tokens_by_source_total", "source=\"external_kv_transfer\"").await, 0.0);
    let (st, _) = post(&s, "/kv_transfer/pull", &json!({})).await;
    assert_eq!(st, 404, "no side channel without a producer role");
    let (st, v) = post(&s, "/v1/completions", &json!({"prompt": "x", "kv_transfer_params": "yes"})).await;
    assert_eq!(st, 400, "{v}");
}

#[tokio::test]
async fn a_decode_leg_aborted_before_its_pull_frees_the_prefill_workers_blocks() {
    // A lease far longer than the test, so only the notification can free the blocks.
    let p = sim(kv("kv_producer", &json!({"kv_lease_duration": 10_000}))).await;
    let d = sim(kv("kv_consumer", &json!({}))).await;
    let (_, pre) = post(&p, "/v1/completions", &prefill_leg(completion(8))).await;
    assert_eq!(metric(&p, "vllm_sim:kv_held_requests", "").await, 1.0);
    // Paused (mode=wait), the decode worker queues the request without admitting it.
    let (s, _) = call(&d, hyper::Method::POST, "/pause?mode=wait&clear_cache=false", None).await;
    assert_eq!(s, 200);
    let port = d.addr().port();
    let body = decode_leg(completion(8), &pre["kv_transfer_params"]);
    let client = tokio::spawn(async move { http_request(hyper::Method::POST, "127.0.0.1", port, "/v1/completions", Some(&body)).await });
    assert!(eventually(async || metric(&d, "vllm:num_requests_waiting", "").await == 1.0).await, "queued");
    client.abort(); // the client goes away
    assert!(eventually(async || metric(&d, "vllm:num_requests_waiting", "").await == 0.0).await, "aborted");
    assert!(eventually(async || metric(&p, "vllm_sim:kv_held_requests", "").await == 0.0).await, "the prefill worker was told to free them");
    assert_eq!(metric(&p, "vllm:kv_cache_usage_perc", "").await, 0.0);
}
