//! kvgate end to end: a real gateway in front of real sockets. Tests that take their
//! worker from `Target::start()` run on vllm-sim by default and on real vLLM under
//! tests/real-vllm/run-suite.sh; the others need several or fault-injected workers and always
//! use in-process simulators.

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

use futures_util::StreamExt;
use kvgate::Stop;
use kvgate_tests::Target;
use kvgate_tests::cluster::{Cluster, GatewayOpts, wait_until};
use kvgate_tests::sse;
use kvgate_tests::target::{test_sim_config, unique_text};
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use vllm_sim::SimConfig;

mod disagg;
mod drop_in;
mod fleet;
mod listeners;
mod openapi;
mod tls;

fn sim(time_scale: f64) -> SimConfig {
    SimConfig { time_scale, ..test_sim_config() }
}

fn error_shape(status: u16, want: u16, v: &Value) {
    assert_eq!(status, want, "{v}");
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some(), "{v}");
    assert_eq!(e["code"].as_u64(), Some(u64::from(want)), "{v}");
}

async fn post(http: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = http.post(url).json(body).send().await.expect("sent");
    let s = r.status().as_u16();
    let t = r.text().await.expect("body");
    (s, serde_json::from_str(&t).unwrap_or(Value::String(t)))
}

/// What must be identical between a direct and a proxied response.
fn essence(v: &Value) -> Value {
    let c = &v["choices"][0];
    json!({"text": c["text"], "message": c["message"]["content"], "token_ids": c["token_ids"],
           "finish": c["finish_reason"], "usage": v["usage"]})
}

/// A stream's essence (`SseBody::essence`), and its number of events when `count`. Count them
/// only against the simulator: real vLLM merges the deltas of a request whose engine got ahead
/// of its API server (`RequestOutputCollector` in vllm/v1/engine/output_processor.py), so how
/// many events carry the same tokens depends on timing, direct or through the gateway.
fn stream_essence(b: &sse::SseBody, count: bool) -> Value {
    let mut v = b.essence();
    if count {
        v["n"] = json!(b.events.len());
    }
    v
}

#[tokio::test]
async fn responses_are_identical_direct_and_through_the_gateway() {
    let t = Target::start().await;
    let count = !t.external;
    let c = Cluster::front(std::slice::from_ref(&t.url), GatewayOpts { model: t.model.clone(), ..Default::default() }).await;
    let prompt = unique_text(20);
    let msgs = json!([{"role": "user", "content": unique_text(12)}]);
    let cases = [
        ("/v1/completions", json!({"model": t.model, "prompt": prompt, "max_tokens": 8, "ignore_eos": true, "temperature": 0, "return_token_ids": true})),
        ("/v1/chat/completions", json!({"model": t.model, "messages": msgs, "max_tokens": 8, "ignore_eos": true, "temperature": 0, "return_token_ids": true})),
    ];
    for (path, body) in &cases {
        let (s1, direct) = post(&t.http, &format!("{}{path}", t.url), body).await;
        let (s2, via) = post(&c.http, &c.url(path), body).await;
        assert_eq!((s1, s2), (200, 200), "{direct} / {via}");
        assert_eq!(essence(&direct), essence(&via), "unary {path}");
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        sbody["stream_options"] = json!({"include_usage": true});
        let (_, _, d) = sse::stream(&t.http, &format!("{}{path}", t.url), &sbody).await;
        let (s, ctype, v) = sse::stream(&c.http, &c.url(path), &sbody).await;
        assert_eq!(s, 200);
        assert!(ctype.starts_with("text/event-stream"), "{ctype}");
        assert_eq!(stream_essence(&d, count), stream_essence(&v, count), "stream {path}");
        assert!(v.done);
    }
    // curl, an independent client, sees the same stream.
    let mut sbody = cases[0].1.clone();
    sbody["stream"] = json!(true);
    let out = tokio::process::Command::new("curl")
        .args(["-sN", "-H", "content-type: application/json", "-d", &sbody.to_string(), &c.url("/v1/completions")])
        .output()
        .await
        .expect("curl runs");
    let via_curl = sse::parse(&String::from_utf8(out.stdout).expect("utf-8"));
    let (_, _, direct) = sse::stream(&t.http, &format!("{}/v1/completions", t.url), &sbody).await;
    assert_eq!(stream_essence(&via_curl, count), stream_essence(&direct, count));
}

#[tokio::test]
async fn streams_are_forwarded_chunk_by_chunk() {
    // 40 tokens at ~6.7 ms per step: a buffering proxy would deliver them in one burst at the end.
    let c = Cluster::sims(1, sim(1.0), GatewayOpts::default()).await;
    let r =
        c.http.post(c.url("/v1/completions")).json(&json!({"prompt": "the cache", "max_tokens": 40, "ignore_eos": true, "stream": true})).send().await.unwrap();
    let mut s = r.bytes_stream();
    let mut arrivals = Vec::new();
    while let Some(chunk) = s.next().await {
        let chunk = chunk.unwrap();
        let n = chunk.windows(6).filter(|w| w == b"data: ").count();
        arrivals.extend(std::iter::repeat_n(Instant::now(), n));
    }
    assert!(arrivals.len() >= 41);
    let spread = arrivals[arrivals.len() - 2].duration_since(arrivals[0]);
    assert!(spread > Duration::from_millis(150), "tokens arrived in a burst ({spread:?}): the stream was buffered");
}

#[tokio::test]
async fn a_one_mib_prompt_works() {
    let big = SimConfig { max_model_len: 1_000_000, num_gpu_blocks: 70_000, time_scale: 100_000.0, ..test_sim_config() };
    let c = Cluster::sims(1, big, GatewayOpts::default()).await;
    let mut text = unique_text(200_000);
    text.truncate(1 << 20);
    let text = text.trim_end().to_string();
    assert!(text.len() > 1_000_000);
    let (s, v) = post(&c.http, &c.url("/v1/chat/completions"), &json!({"messages": [{"role": "user", "content": text}], "max_tokens": 3})).await;
    assert_eq!(s, 200, "{v}");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 100_000);
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

async fn cancellations(c: &Cluster, endpoint: &str, kind: &str) -> f64 {
    c.gateway_metrics().await.sum("kvgate_frontend_model_cancellation_total", &[("model", "sim-model"), ("endpoint", endpoint), ("request_type", kind)])
}

#[tokio::test]
async fn a_disconnect_mid_stream_aborts_the_worker_request_within_100ms() {
    let c = Cluster::sims(1, sim(1.0), GatewayOpts::default()).await;
    let r = c
        .http
        .post(c.url("/v1/completions"))
        .json(&json!({"prompt": unique_text(30), "max_tokens": 2000, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut s = r.bytes_stream();
    let mut seen = 0;
    while seen < 3 {
        s.next().await.unwrap().unwrap();
        seen += 1;
    }
    drop(s);
    let took = wait_until(Duration::from_secs(2), || async { c.sim_metrics(0).await.sum("vllm_sim:aborted_requests_total", &[]) == 1.0 }).await;
    let took = took.expect("worker never aborted the request");
    // At once, not when the generation would end (seconds later); the bound is loose for a loaded
    // machine, and the latency itself is a benchmark figure.
    assert!(took < Duration::from_millis(500), "worker aborted {took:?} after the disconnect");
    wait_until(Duration::from_secs(1), || async { cancellations(&c, "completions", "stream").await == 1.0 }).await.expect("metric");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(cancellations(&c, "completions", "stream").await, 1.0, "counted exactly once");
    assert_eq!(c.sim_metrics(0).await.sum("vllm:num_requests_running", &[]), 0.0);
}

/// A client still sending a body the gateway refused (413) reads the refusal whole: the
/// gateway drains what keeps arriving for a moment before closing, as closing on unread bytes
/// would reset the connection and could discard the answer before the client reads it.
#[tokio::test]
async fn a_refused_body_still_arriving_does_not_reset_the_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = Cluster::sims(1, sim(4.0), GatewayOpts { extra: "max_body_bytes: 64KiB\n".into(), ..Default::default() }).await;
    for _ in 0..3 {
        let client = tokio::net::TcpStream::connect(c.gw().listen.to_string().replace("0.0.0.0", "127.0.0.1")).await.unwrap();
        let (mut rd, mut wr) = client.into_split();
        let body = vec![b'x'; 2 << 20];
        let sender = tokio::spawn(async move {
            let head = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
            let _ = wr.write_all(head.as_bytes()).await;
            // Slowly enough that the answer is out while the body is still coming.
            for piece in body.chunks(64 << 10) {
                wr.write_all(piece).await?;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok::<(), std::io::Error>(())
        });
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut answer)).await.expect("the gateway closes after its answer");
        let text = String::from_utf8_lossy(&answer);
        assert!(read.is_ok(), "the connection was reset ({read:?}) after {} bytes of answer: {text}", answer.len());
        assert!(text.starts_with("HTTP/1.1 413"), "{text}");
        assert!(text.contains("\"error\""), "the OpenAI-shaped body arrived whole: {text}");
        // The gateway closed its side and drained: the client's sending met no reset.
        sender.await.unwrap().expect("the rest of the body was taken, not reset");
    }
}

/// A client that stops reading mid-stream (a hung app, a stalled proxy) holds no worker slot
/// past `timeouts.client_write_ms`: it is taken as gone and the worker's request is aborted.
#[tokio::test]
async fn a_client_that_stops_reading_is_taken_as_gone_after_client_write_ms() {
    use tokio::io::AsyncWriteExt;
    let long = SimConfig { max_model_len: 100_000, num_gpu_blocks: 10_000, time_scale: 20.0, ..test_sim_config() };
    let c = Cluster::sims(1, long, GatewayOpts { extra: "timeouts:\n  client_write_ms: 1000\n".into(), ..Default::default() }).await;
    // A small receive window, never read: the gateway's writes stall once it and the
    // gateway's send buffer are full, long before the 60,000 tokens are out.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut client = sock.connect(c.gw().listen.to_string().replace("0.0.0.0", "127.0.0.1").parse().unwrap()).await.unwrap();
    let body = json!({"prompt": unique_text(30), "max_tokens": 60_000, "ignore_eos": true, "stream": true}).to_string();
    let head = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    client.write_all(format!("{head}{body}").as_bytes()).await.unwrap();
    let start = Instant::now();
    // The kernel's buffers take about a fifth of the stream before the gateway's writes stall
    // (about 4 s here), however fast the machine generates: the bound leaves room for a slow
    // one, and the stream is long enough to still be running then.
    let took = wait_until(Duration::from_secs(40), || async { c.sim_metrics(0).await.sum("vllm_sim:aborted_requests_total", &[]) == 1.0 }).await;
    if took.is_none() {
        let m = c.sim_metrics(0).await;
        let (running, tokens) = (m.sum("vllm:num_requests_running", &[]), m.sum("vllm:generation_tokens_total", &[]));
        panic!("the worker's request was never aborted ({running} running, {tokens} tokens generated): a client that stopped reading held it");
    }
    assert!(start.elapsed() >= Duration::from_millis(1000), "aborted before the write limit: {:?}", start.elapsed());
    wait_until(Duration::from_secs(1), || async { cancellations(&c, "completions", "stream").await == 1.0 }).await.expect("counted as a cancellation");
    assert_eq!(c.sim_metrics(0).await.sum("vllm:num_requests_running", &[]), 0.0);
    drop(client);
}

#[tokio::test]
async fn a_disconnect_during_a_long_prefill_aborts_the_worker_request_within_100ms() {
    // A long prefill is many short chunked steps (64-token budget, ~17 ms each, ~50 steps);
    // like vLLM, the engine drops an aborted request at the next step boundary.
    let slow_prefill = SimConfig { time_scale: 0.5, max_num_batched_tokens: 64, ..test_sim_config() };
    let c = Cluster::sims(1, slow_prefill, GatewayOpts::default()).await;
    let prompt = unique_text(1200);
    let (http, url) = (c.http.clone(), c.url("/v1/chat/completions"));
    let req = tokio::spawn(async move { http.post(url).json(&json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 5})).send().await });
    wait_until(Duration::from_secs(5), || async { c.sim_metrics(0).await.sum("vllm:num_requests_running", &[]) == 1.0 })
        .await
        .expect("request reached the worker");
    req.abort(); // the client goes away before any byte of the response
    let took = wait_until(Duration::from_secs(2), || async { c.sim_metrics(0).await.sum("vllm_sim:aborted_requests_total", &[]) == 1.0 })
        .await
        .expect("worker never aborted the request");
    // At once, not when the generation would end (seconds later); the bound is loose for a loaded
    // machine, and the latency itself is a benchmark figure.
    assert!(took < Duration::from_millis(500), "worker aborted {took:?} after the disconnect");
    wait_until(Duration::from_secs(1), || async { cancellations(&c, "chat_completions", "unary").await == 1.0 }).await.expect("metric");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(cancellations(&c, "chat_completions", "unary").await, 1.0, "counted exactly once");
}

#[tokio::test]
async fn bad_requests_get_openai_shaped_errors() {
    let c = Cluster::sims(1, sim(10.0), GatewayOpts { extra: "max_body_bytes: 64KiB".into(), ..Default::default() }).await;
    let raw = |body: &'static str| {
        let http = c.http.clone();
        let url = c.url("/v1/completions");
        async move {
            let r = http.post(url).header("content-type", "application/json").body(body).send().await.unwrap();
            let s = r.status().as_u16();
            (s, r.json::<Value>().await.unwrap())
        }
    };
    let (s, v) = raw("{\"model\": \"sim-model\", \"prompt\": ").await;
    error_shape(s, 400, &v);
    let (s, v) = raw("[1, 2]").await;
    error_shape(s, 400, &v);
    let (s, v) = post(&c.http, &c.url("/v1/completions"), &json!({"model": 5, "prompt": "x"})).await;
    error_shape(s, 400, &v);
    let (s, v) = post(&c.http, &c.url("/v1/chat/completions"), &json!({"model": "sim-model", "stream": "yes", "messages": []})).await;
    error_shape(s, 400, &v);
    let (s, v) = post(&c.http, &c.url("/v1/completions"), &json!({"model": "gpt-17", "prompt": "x"})).await;
    error_shape(s, 404, &v);
    assert_eq!(v["error"]["param"], "model");
    let (s, v) = post(&c.http, &c.url("/v1/completions"), &json!({"model": "sim-model", "prompt": "x".repeat(100_000)})).await;
    error_shape(s, 413, &v);
    let r = c.http.get(c.url("/v1/completions")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    // An unknown path passes through: the worker's own 404, as a client of vLLM gets it.
    let r = c.http.get(c.url("/v2/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let direct = c.http.get(format!("{}/v2/nothing", c.sims[0].url())).send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), direct.text().await.unwrap());
    // Worker errors pass through untouched (vLLM's own 400 for max_tokens: 0).
    let (s, v) = post(&c.http, &c.url("/v1/completions"), &json!({"model": "sim-model", "prompt": "x", "max_tokens": 0})).await;
    error_shape(s, 400, &v);
    // After all that, the gateway still serves.
    let (s, _) = post(&c.http, &c.url("/v1/completions"), &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, 200);
}

#[tokio::test]
async fn no_healthy_worker_is_a_clear_503() {
    // A privileged port no test binds: it refuses connections for the whole test.
    let c = Cluster::front(&["http://127.0.0.1:1".to_string()], GatewayOpts::default()).await;
    wait_until(Duration::from_secs(3), || async {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        v["models"][0]["workers"][0]["healthy"] == json!(false)
    })
    .await
    .expect("health check marks the worker down");
    let (s, v) = post(&c.http, &c.url("/v1/completions"), &json!({"prompt": "x"})).await;
    error_shape(s, 503, &v);
    assert!(v["error"]["message"].as_str().unwrap().contains("No healthy worker"), "{v}");
    let r = c.http.get(c.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 503, "gateway health reflects the fleet");
}

#[tokio::test]
async fn a_broken_reload_keeps_the_old_config_serving() {
    let c = Cluster::sims(1, sim(10.0), GatewayOpts::default()).await;
    let good = std::fs::read_to_string(&c.config_path).unwrap();
    std::fs::write(&c.config_path, good.replace("mode: round_robin", "mode: cleverest")).unwrap();
    let r = c.http.post(c.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("kvgate.yaml:") && msg.contains("cleverest"), "error names file, line and value: {msg}");
    // The file watcher sees the same bad file; both are rejected.
    wait_until(Duration::from_secs(10), || async { c.gateway_metrics().await.sum("kvgate_config_reloads_total", &[("result", "rejected")]) >= 2.0 })
        .await
        .expect("file watch reload attempted and rejected");
    let (s, _) = post(&c.http, &c.url("/v1/completions"), &json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(s, 200, "still serving with the old config");
    let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["models"][0]["routing"], "round_robin");
}

#[tokio::test]
async fn a_reload_that_removes_a_worker_lets_its_streams_finish() {
    let c = Cluster::sims(2, sim(1.0), GatewayOpts::default()).await;
    let r = c
        .http
        .post(c.url("/v1/completions"))
        .json(&json!({"prompt": unique_text(10), "max_tokens": 150, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut s = r.bytes_stream();
    let mut raw = Vec::from(s.next().await.unwrap().unwrap().as_ref());
    let busy = if c.sim_metrics(0).await.sum("vllm:num_requests_running", &[]) == 1.0 { 0 } else { 1 };
    let keep = 1 - busy;
    // Rewrite the config without the busy worker; the file watcher applies it.
    let yaml = kvgate_tests::cluster::gateway_yaml(&[c.sims[keep].url()], &GatewayOpts::default());
    std::fs::write(&c.config_path, yaml).unwrap();
    wait_until(Duration::from_secs(10), || async {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        v["models"][0]["workers"].as_array().unwrap().len() == 1
    })
    .await
    .expect("reload applied");
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("stream continues after the reload"));
    }
    let body = sse::parse(&String::from_utf8(raw).unwrap());
    assert!(body.done, "the in-flight stream on the removed worker completed");
    assert_eq!(body.events.len(), 150);
    for _ in 0..4 {
        let (s, _) = post(&c.http, &c.url("/v1/completions"), &json!({"prompt": "x", "max_tokens": 1})).await;
        assert_eq!(s, 200);
    }
    let removed = c.sim_metrics(busy).await.sum("vllm:request_success_total", &[]);
    let kept = c.sim_metrics(keep).await.sum("vllm:request_success_total", &[]);
    assert_eq!(removed, 1.0, "only the old stream ran on the removed worker");
    assert_eq!(kept, 4.0, "new requests go to the remaining worker");
}

#[tokio::test]
async fn a_killed_worker_is_routed_around_and_unstarted_requests_are_retried() {
    // ~200 ms prefills, so requests are still waiting for their first byte when worker 0 dies.
    let c = Cluster::sims(2, sim(0.05), GatewayOpts::default()).await;
    let mut reqs = Vec::new();
    for _ in 0..4 {
        let (http, url) = (c.http.clone(), c.url("/v1/completions"));
        let prompt = unique_text(150);
        reqs.push(tokio::spawn(async move { post(&http, &url, &json!({"prompt": prompt, "max_tokens": 3, "ignore_eos": true})).await }));
    }
    wait_until(Duration::from_secs(3), || async { c.sim_metrics(0).await.sum("vllm:num_requests_running", &[]) >= 1.0 }).await.expect("worker 0 got requests");
    let killed_at = Instant::now();
    c.sims[0].crash();
    for r in reqs {
        let (s, v) = r.await.unwrap();
        assert_eq!(s, 200, "retried on the surviving worker: {v}");
        assert_eq!(v["usage"]["completion_tokens"], 3);
    }
    let down = wait_until(Duration::from_secs(2), || async {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        v["models"][0]["workers"][0]["healthy"] == json!(false)
    })
    .await
    .expect("marked unhealthy");
    assert!(killed_at.elapsed() < Duration::from_millis(100) + Duration::from_secs(2), "{down:?}");
    for _ in 0..6 {
        let (s, _) = post(&c.http, &c.url("/v1/completions"), &json!({"prompt": "x", "max_tokens": 1})).await;
        assert_eq!(s, 200);
    }
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_retries_total", &[]) >= 1.0);
}

#[tokio::test]
async fn a_worker_5xx_before_the_first_byte_is_retried_elsewhere() {
    let c = Cluster::sims(2, sim(10.0), GatewayOpts::default()).await;
    c.sims[0].faults().set(vllm_sim::faults::FaultConfig { error_rate: 1.0, ..Default::default() }).unwrap();
    for _ in 0..6 {
        let (s, v) = post(&c.http, &c.url("/v1/completions"), &json!({"prompt": "x", "max_tokens": 2})).await;
        assert_eq!(s, 200, "{v}");
    }
    assert!(c.gateway_metrics().await.sum("kvgate_upstream_errors_total", &[("kind", "status_5xx")]) >= 3.0);
}

#[tokio::test]
async fn a_streams_head_goes_out_before_its_first_token() {
    // As from vLLM itself: the client has its 200 while the worker is still prefilling.
    let c = Cluster::sims(1, sim(10.0), GatewayOpts::default()).await;
    c.sims[0].faults().set(vllm_sim::faults::FaultConfig { first_token_delay_ms: 2500.0, ..Default::default() }).unwrap();
    let start = Instant::now();
    let r = c.http.post(c.url("/v1/completions")).json(&json!({"prompt": unique_text(8), "max_tokens": 4, "stream": true})).send().await.unwrap();
    let head = start.elapsed();
    assert_eq!(r.status(), 200);
    let body = sse::parse(&r.text().await.unwrap());
    let all = start.elapsed();
    assert!(body.done && body.events.len() == 4, "{}", body.raw);
    assert!(all >= Duration::from_millis(2500), "the first token waited {all:?}");
    assert!(head < Duration::from_millis(1500), "the head came at {head:?}, the stream ended at {all:?}");
}

#[tokio::test]
async fn a_worker_silent_past_the_first_byte_deadline_after_the_head_is_replaced_unseen() {
    // The head goes out at once; the slow worker's first token does not come within
    // timeouts.first_byte_ms, so the request is resent to the other worker, whose stream the
    // client reads as its own.
    let extra = "timeouts:\n  first_byte_ms: 400\n".to_string();
    let c = Cluster::sims(2, sim(10.0), GatewayOpts { extra, ..GatewayOpts::default() }).await;
    c.sims[0].faults().set(vllm_sim::faults::FaultConfig { first_token_delay_ms: 5000.0, ..Default::default() }).unwrap();
    let slow = c.sims[0].url().trim_end_matches('/').to_string();
    let mut started_on_slow = 0;
    for _ in 0..6 {
        let body = json!({"prompt": unique_text(8), "max_tokens": 4, "stream": true, "ignore_eos": true});
        let start = Instant::now();
        let r = c.http.post(c.url("/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let worker = r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().trim_end_matches('/').to_string();
        let stream = sse::parse(&r.text().await.expect("never cut"));
        assert!(stream.done && stream.events.len() == 4, "{}", stream.raw);
        assert!(start.elapsed() < Duration::from_millis(4000), "resent well before the slow worker's first token");
        started_on_slow += usize::from(worker == slow);
    }
    assert!(started_on_slow > 0, "some stream started on the slow worker");
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_upstream_errors_total", &[("kind", "before_first_byte")]) >= started_on_slow as f64);
}

#[tokio::test]
async fn a_stream_no_worker_answers_after_its_head_is_cut_not_ended() {
    // The only worker sends its head and then nothing within timeouts.first_byte_ms: no other
    // worker can take the stream, and no error status can follow the 200, so the body is cut
    // (the client sees a failed read), never ended as if complete.
    let extra = "timeouts:\n  first_byte_ms: 300\n".to_string();
    let c = Cluster::sims(1, sim(10.0), GatewayOpts { extra, ..GatewayOpts::default() }).await;
    c.sims[0].faults().set(vllm_sim::faults::FaultConfig { first_token_delay_ms: 5000.0, ..Default::default() }).unwrap();
    let r = c.http.post(c.url("/v1/completions")).json(&json!({"prompt": unique_text(8), "max_tokens": 4, "stream": true})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.is_err(), "the stream is cut, not ended cleanly");
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_upstream_errors_total", &[("kind", "before_first_byte")]) >= 1.0);
}

#[tokio::test]
async fn sigterm_drains_in_flight_streams_and_refuses_new_requests() {
    let mut c = Cluster::sims(1, sim(1.0), GatewayOpts::default()).await;
    let r = c.http.post(c.url("/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 100, "ignore_eos": true, "stream": true})).send().await.unwrap();
    let mut s = r.bytes_stream();
    let mut raw = Vec::from(s.next().await.unwrap().unwrap().as_ref());
    c.gw().request_stop(Stop::Drain);
    wait_until(Duration::from_secs(2), || async { c.http.get(c.url("/health")).send().await.map(|r| r.status() == 503).unwrap_or(false) })
        .await
        .expect("draining is visible");
    let (s503, v) = post(&c.http, &c.url("/v1/completions"), &json!({"prompt": "x", "max_tokens": 1})).await;
    error_shape(s503, 503, &v);
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("stream survives the drain"));
    }
    let body = sse::parse(&String::from_utf8(raw).unwrap());
    assert!(body.done && body.events.len() == 100, "the in-flight stream finished");
    c.stop_gateway(Stop::Drain).await;
}

#[tokio::test]
async fn a_disconnect_through_the_gateway_frees_the_worker() {
    // Runs on real vLLM too: its num_requests_running drops once the gateway closes the leg.
    let t = Target::start().await;
    let c = Cluster::front(std::slice::from_ref(&t.url), GatewayOpts { model: t.model.clone(), ..Default::default() }).await;
    let ids = t.tokenize(&unique_text(8)).await;
    let r = c
        .http
        .post(c.url("/v1/completions"))
        .json(&json!({"model": t.model, "prompt": ids, "max_tokens": 1500, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut s = r.bytes_stream();
    for _ in 0..3 {
        s.next().await.unwrap().unwrap();
    }
    assert_eq!(t.metrics().await.sum("vllm:num_requests_running", &[]), 1.0);
    drop(s);
    let took = wait_until(Duration::from_secs(2), || async { t.metrics().await.sum("vllm:num_requests_running", &[]) == 0.0 })
        .await
        .expect("the worker still runs the request 2 s after the client left");
    eprintln!("worker freed {took:?} after the disconnect");
    assert!(took < Duration::from_millis(500), "worker freed {took:?} after the disconnect");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_frontend_model_cancellation_total", &[("endpoint", "completions"), ("request_type", "stream")]), 1.0);
}

#[tokio::test]
async fn x_request_id_is_honoured_and_propagated() {
    let c = Cluster::sims(1, sim(10.0), GatewayOpts::default()).await;
    let r = c.http.post(c.url("/v1/completions")).header("X-Request-Id", "trace-abc-123").json(&json!({"prompt": "x", "max_tokens": 1})).send().await.unwrap();
    assert_eq!(r.headers().get("x-request-id").unwrap(), "trace-abc-123");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["id"], "cmpl-trace-abc-123", "the worker saw the same id");
    // Without one, the gateway makes one and the worker uses it too.
    let r = c.http.post(c.url("/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 1})).send().await.unwrap();
    let rid = r.headers().get("x-request-id").unwrap().to_str().unwrap().to_string();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["id"], format!("cmpl-{rid}"));
    // A request is recorded just after its last byte went out.
    let counted = wait_until(Duration::from_secs(2), || async {
        c.gateway_metrics().await.sum("kvgate_requests_total", &[("model", "sim-model"), ("endpoint", "completions"), ("status", "200")]) == 2.0
    })
    .await;
    assert!(counted.is_some(), "both requests counted");
    let m = c.gateway_metrics().await;
    assert!(m.has("kvgate_request_duration_seconds_bucket"));
    assert!(m.has("kvgate_requests_in_flight"));
}

#[tokio::test]
async fn expect_100_continue_gets_the_go_ahead_at_once() {
    // curl asks before sending large bodies and waits up to 1 s for "100 Continue".
    let c = Cluster::sims(1, sim(10.0), GatewayOpts::default()).await;
    let body = json!({"prompt": unique_text(2_000), "max_tokens": 1}).to_string();
    assert!(body.len() > 10_000);
    let path = std::env::temp_dir().join(format!("kvgate-expect-{}.json", std::process::id()));
    std::fs::write(&path, &body).unwrap();
    // Twice at most: a loaded 2-core machine can stall curl's own start for most of a second,
    // which is not the gateway making it wait.
    let mut tries = Vec::new();
    for _ in 0..2 {
        let start = Instant::now();
        let out = tokio::process::Command::new("curl")
            .args(["-s", "-v", "-o", "/dev/null", "-w", "%{http_code}", "-H", "content-type: application/json", "-H", "Expect: 100-continue"])
            .arg("--data-binary")
            .arg(format!("@{}", path.display()))
            .arg(c.url("/v1/completions"))
            .output()
            .await
            .expect("curl runs");
        let took = start.elapsed();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
        assert!(String::from_utf8_lossy(&out.stderr).contains("HTTP/1.1 100 Continue"), "the go-ahead came");
        tries.push(took);
        if took < Duration::from_millis(900) {
            break;
        }
    }
    let _ = std::fs::remove_file(&path);
    assert!(tries.iter().any(|t| *t < Duration::from_millis(900)), "curl waited for 100 Continue: {tries:?}");
}

#[tokio::test]
async fn the_admin_listener_shows_requests_in_flight_and_why_they_went_where_they_did() {
    // Slow enough that a stream is still running while we look.
    let c = Cluster::sims(2, sim(1.0), GatewayOpts::default()).await;
    let r = c
        .http
        .post(c.url("/v1/completions"))
        .header("x-request-id", "receipt-1")
        .json(&json!({"prompt": unique_text(50), "max_tokens": 40, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let worker = r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).map(str::to_owned).expect("x-kvgate-worker names the worker");
    assert!(c.sims.iter().any(|s| s.url().trim_end_matches('/') == worker.trim_end_matches('/')), "{worker} is one of the workers");
    let mut body = r.bytes_stream();
    let _first = body.next().await.expect("a first chunk").unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    let running = loop {
        let v: Value = c.http.get(c.admin("/requests")).send().await.unwrap().json().await.unwrap();
        let entry = v["requests"].as_array().and_then(|l| l.iter().find(|e| e["id"] == "receipt-1").cloned());
        if let Some(e) = entry.filter(|e| e["phase"] == "running") {
            break e;
        }
        assert!(Instant::now() < deadline, "receipt-1 never listed as running: {v}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(running["worker"], worker.as_str());
    assert_eq!(running["model"], "sim-model");
    assert!(running["tokens"].as_u64().unwrap() >= 1);
    while body.next().await.is_some() {}
    // The registry records the end just after the last byte went out.
    let finished = || async { c.http.get(c.admin("/requests/receipt-1")).send().await.unwrap().json::<Value>().await.unwrap() };
    wait_until(Duration::from_secs(2), || async { finished().await["status"] == 200 }).await;
    let v = finished().await;
    assert_eq!(v["status"], 200, "{v}");
    assert_eq!(v["phase"], "finished");
    let receipt = &v["route_receipt"][0];
    assert_eq!(receipt["chosen"]["url"], worker.as_str(), "{v}");
    assert_eq!(receipt["candidates"].as_array().map(Vec::len), Some(2), "both workers were considered: {v}");
    assert_eq!(receipt["outcome"], "ok");
    let (status, e) = {
        let r = c.http.get(c.admin("/requests/no-such-request")).send().await.unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    };
    error_shape(status, 404, &e);
    let now: Value = c.http.get(c.admin("/requests")).send().await.unwrap().json().await.unwrap();
    assert_eq!(now["in_flight"], 0, "{now}");
}

/// Sends raw bytes on a fresh connection; returns everything the gateway wrote until it closed
/// the connection (or 5 s passed).
async fn raw_exchange(c: &Cluster, bytes: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = c.url("").trim_start_matches("http://").trim_end_matches('/').to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await.expect("the gateway closes the connection").unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn malformed_http_and_connect_get_an_openai_shaped_error_and_a_closed_connection() {
    let c = Cluster::sims(1, sim(10.0), GatewayOpts::default()).await;
    let body = |out: &str| serde_json::from_str::<Value>(out.split_once("\r\n\r\n").map_or("", |(_, b)| b)).unwrap_or(Value::Null);
    let out = raw_exchange(&c, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer sk-secret\r\nBad Header Without Colon\r\n\r\n").await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    error_shape(400, 400, &body(&out));
    assert!(!out.contains("sk-secret"), "the request is not echoed back: {out}");
    let out = raw_exchange(&c, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n").await;
    assert!(out.starts_with("HTTP/1.1 405"), "{out}");
    error_shape(405, 405, &body(&out));
    let metrics = c.http.get(c.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for reason in ["malformed", "connect"] {
        assert!(metrics.contains(&format!("kvgate_refused_connections_total{{reason=\"{reason}\"}} 1")), "{metrics}");
    }
    // Well-formed requests share one kept-alive connection.
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let addr = c.url("").trim_start_matches("http://").trim_end_matches('/').to_string();
    let mut s = tokio::io::BufReader::new(tokio::net::TcpStream::connect(addr).await.unwrap());
    let post = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 33\r\n\r\n{}",
        r#"{"prompt":"hello","max_tokens":1}"#
    );
    for request in ["GET /health HTTP/1.1\r\nHost: gw\r\n\r\n", &post, "GET /health HTTP/1.1\r\nHost: gw\r\n\r\n", &post] {
        s.get_mut().write_all(request.as_bytes()).await.unwrap();
        let (mut status, mut len, mut line) = (String::new(), 0usize, String::new());
        s.read_line(&mut status).await.unwrap();
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        while {
            line.clear();
            s.read_line(&mut line).await.unwrap() > 2
        } {
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; len];
        s.read_exact(&mut body).await.unwrap();
    }
}

/// A worker that answers every probe with 200 and every completion with one SSE body of
/// `events`, framed by Content-Length (as a buffering proxy in front of a server would).
async fn length_framed_stream_worker(events: &'static str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut have = Vec::new();
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    have.extend_from_slice(&buf[..n]);
                    let Some(head_end) = have.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
                    let head = String::from_utf8_lossy(&have[..head_end]).to_ascii_lowercase();
                    let len = head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse().unwrap());
                    if have.len() < head_end + 4 + len {
                        continue;
                    }
                    have.drain(..head_end + 4 + len);
                    let (kind, body) = if head.starts_with("post") { ("text/event-stream", events) } else { ("application/json", "{}") };
                    let answer = format!("HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n\r\n{body}", body.len());
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

#[tokio::test]
async fn a_followed_stream_the_worker_framed_by_length_goes_out_chunked_and_whole() {
    // The gateway asked for token ids and strips them, so the worker's length is not the
    // client's: relaying it would leave the client waiting for bytes that never come.
    const EVENTS: &str = concat!(
        "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" a\",\"token_ids\":[11],\"finish_reason\":null}],\"prompt_token_ids\":[1,2,3]}\n\n",
        "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" b\",\"token_ids\":[12],\"finish_reason\":\"length\"}]}\n\n",
        "data: [DONE]\n\n"
    );
    let c = Cluster::front(&[length_framed_stream_worker(EVENTS).await], GatewayOpts::default()).await;
    let r = tokio::time::timeout(Duration::from_secs(5), async {
        let r = c.http.post(c.url("/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 2, "stream": true})).send().await.unwrap();
        let chunked = r.headers().get("transfer-encoding").map(|v| v.to_str().unwrap().to_string());
        (chunked, r.text().await.unwrap())
    })
    .await
    .expect("the client gets the whole stream, not a length the body does not have");
    assert_eq!(r.0.as_deref(), Some("chunked"));
    let body = sse::parse(&r.1);
    assert!(body.done, "{}", r.1);
    assert_eq!(body.essence()["text"], " a b", "{}", r.1);
    assert!(!r.1.contains("token_ids"), "ids the client did not ask for are stripped: {}", r.1);
}
