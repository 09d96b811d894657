//! vLLM's development endpoints on vllm-sim (`/pause`, `/resume`, `/is_paused`, `/sleep`,
//! `/wake_up`, `/is_sleeping`, `/reset_prefix_cache`), behaving and answering as a real vLLM 0.32
//! did: absent without dev mode; `abort` ends requests with `finish_reason: "abort"`, `wait`
//! answers once they finished, `keep` freezes them; requests arriving while paused queue.

use kvgate_tests::Target;
use kvgate_tests::cluster::wait_until;
use kvgate_tests::sse;
use kvgate_tests::target::test_sim_config;
use serde_json::{Value, json};
use std::time::Duration;
use vllm_sim::SimConfig;

/// A sim whose streams take seconds (so they are in flight while the test pauses).
async fn slow_sim() -> Target {
    Target::sim(SimConfig { time_scale: 1.0, ..test_sim_config() }).await
}

/// A long stream of completions; returns the response after its first chunk arrived, and that chunk.
async fn start_stream(t: &Target, body: Value) -> (reqwest::Response, Vec<u8>) {
    let mut r = t.http.post(format!("{}/v1/completions", t.url)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().expect("a first chunk").to_vec();
    (r, first)
}

/// Reads the rest of a stream; returns everything read, the first chunk included.
async fn finish_stream(mut r: reqwest::Response, mut raw: Vec<u8>) -> sse::SseBody {
    while let Some(c) = r.chunk().await.unwrap() {
        raw.extend_from_slice(&c);
    }
    sse::parse(&String::from_utf8(raw).unwrap())
}

/// The engine's waiting gauge.
async fn waiting(t: &Target) -> f64 {
    t.metrics().await.sum("vllm:num_requests_waiting", &[])
}

fn long(max_tokens: u32) -> Value {
    json!({"prompt": "the cache router", "max_tokens": max_tokens, "ignore_eos": true, "stream": true, "return_token_ids": true})
}

#[tokio::test]
async fn the_dev_endpoints_exist_only_in_dev_mode() {
    let t = Target::sim(SimConfig { dev_mode: false, ..test_sim_config() }).await;
    for path in ["/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache"] {
        assert_eq!(t.post(path, &json!({})).await, (404, json!({"detail": "Not Found"})), "{path}");
    }
    for path in ["/is_paused", "/is_sleeping"] {
        assert_eq!(t.get(path).await.0, 404, "{path}");
    }
    let t = Target::sim(test_sim_config()).await;
    assert_eq!(t.get("/is_paused").await, (200, r#"{"is_paused":false}"#.into()));
    assert_eq!(t.post("/is_paused", &json!({})).await.0, 405);
    let (s, v) = t.post("/pause?mode=bogus", &json!({})).await;
    assert_eq!((s, &v["error"]["param"], &v["error"]["type"]), (400, &json!("query.mode"), &json!("Bad Request")), "{v}");
    let (s, v) = t.post("/sleep?level=3", &json!({})).await;
    assert_eq!((s, &v["error"]["param"]), (400, &json!("query.level")), "{v}");
}

#[tokio::test]
async fn pause_abort_ends_every_request_and_new_ones_queue_until_resume() {
    let t = slow_sim().await;
    let (stream, first) = start_stream(&t, long(2000)).await;
    let unary = {
        let (http, url) = (t.http.clone(), format!("{}/v1/completions", t.url));
        tokio::spawn(async move { http.post(url).json(&json!({"prompt": "a unary one", "max_tokens": 2000, "ignore_eos": true})).send().await.unwrap() })
    };
    assert!(wait_until(Duration::from_secs(10), || async { t.metrics().await.sum("vllm:num_requests_running", &[]) == 2.0 }).await.is_some());
    assert_eq!(t.post("/pause", &json!({})).await, (200, json!({"status": "paused"})));
    // The stream ends with an empty abort chunk and [DONE]; the unary answer is a 200 cut short.
    let body = finish_stream(stream, first).await;
    let last = body.events.last().unwrap();
    assert_eq!((&last["choices"][0]["finish_reason"], &last["choices"][0]["text"]), (&json!("abort"), &json!("")), "{last}");
    assert!(body.done);
    let r = unary.await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "abort", "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 2000);
    assert_eq!(t.get("/is_paused").await.1, r#"{"is_paused":true}"#);
    assert_eq!(t.get("/is_sleeping").await.1, r#"{"is_sleeping":true}"#, "vLLM counts a paused engine as sleeping");
    // A request arriving while paused neither fails nor runs: it queues until the resume.
    let queued = {
        let (http, url) = (t.http.clone(), format!("{}/v1/completions", t.url));
        tokio::spawn(async move { http.post(url).json(&json!({"prompt": "while paused", "max_tokens": 3})).send().await.unwrap() })
    };
    assert!(wait_until(Duration::from_secs(10), || async { waiting(&t).await == 1.0 }).await.is_some(), "queued");
    assert!(!queued.is_finished());
    assert_eq!(t.post("/resume", &json!({})).await, (200, json!({"status": "resumed"})));
    let r = queued.await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["choices"][0]["finish_reason"], "length");
    assert_eq!(t.get("/is_paused").await.1, r#"{"is_paused":false}"#);
}

#[tokio::test]
async fn pause_wait_answers_once_running_requests_finished() {
    let t = slow_sim().await;
    let (stream, first) = start_stream(&t, long(60)).await;
    assert_eq!(t.post("/pause?mode=wait", &json!({})).await, (200, json!({"status": "paused"})));
    // By the time the pause answered, the stream had all its tokens.
    let body = finish_stream(stream, first).await;
    assert_eq!(body.essence()["finish"], "length");
    assert_eq!(body.essence()["ids"].as_array().unwrap().len(), 60);
    assert_eq!(t.post("/resume", &json!({})).await.0, 200);
}

#[tokio::test]
async fn pause_keep_freezes_requests_and_the_resume_continues_them_unchanged() {
    // The reference: the same stream, never paused, on a server of the same seed.
    let reference = finish_stream_of(&slow_sim().await, long(300)).await;
    let t = slow_sim().await;
    let (mut stream, mut raw) = start_stream(&t, long(300)).await;
    assert_eq!(t.post("/pause?mode=keep", &json!({})).await, (200, json!({"status": "paused"})));
    // Frozen: what was in flight drains, then nothing more comes while paused.
    while let Ok(Some(c)) = tokio::time::timeout(Duration::from_millis(300), stream.chunk()).await.map(|r| r.unwrap()) {
        raw.extend_from_slice(&c);
    }
    assert!(!String::from_utf8_lossy(&raw).contains("[DONE]"), "the stream did not finish while frozen");
    assert_eq!(t.post("/resume", &json!({})).await.0, 200);
    let body = finish_stream(stream, raw).await;
    assert_eq!(body.essence(), reference.essence(), "the same tokens as without the pause (the cache was dropped: it recomputed)");
}

async fn finish_stream_of(t: &Target, body: Value) -> sse::SseBody {
    let (r, first) = start_stream(t, body).await;
    finish_stream(r, first).await
}

#[tokio::test]
async fn sleep_and_wake_up_answer_as_vllm() {
    let t = Target::sim(test_sim_config()).await;
    assert_eq!(t.post("/sleep", &json!({})).await, (200, json!({"status": "sleeping", "level": 1})));
    assert_eq!(t.get("/is_sleeping").await.1, r#"{"is_sleeping":true}"#);
    assert_eq!(t.post("/wake_up?tags=weights", &json!({})).await, (200, json!({"status": "sleeping", "tags": ["weights"]})));
    assert_eq!(t.post("/wake_up?tags=kv_cache", &json!({})).await, (200, json!({"status": "awake", "tags": ["kv_cache"]})));
    assert_eq!(t.get("/is_sleeping").await.1, r#"{"is_sleeping":false}"#);
    let (s, v) = t.post("/v1/completions", &json!({"prompt": "awake", "max_tokens": 2})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(t.post("/sleep?level=0", &json!({})).await, (200, json!({"status": "sleeping", "level": 0})));
    assert_eq!(t.post("/wake_up", &json!({})).await, (200, json!({"status": "awake", "tags": null})));
    assert_eq!(t.get("/is_paused").await.1, r#"{"is_paused":false}"#);
}

#[tokio::test]
async fn reset_prefix_cache_refuses_while_blocks_are_held_unless_running_requests_may_be_preempted() {
    let t = slow_sim().await;
    let (stream, first) = start_stream(&t, long(200)).await;
    assert_eq!(t.post("/reset_prefix_cache", &json!({})).await, (200, json!({"success": false})));
    assert_eq!(t.post("/reset_prefix_cache?reset_running_requests=true", &json!({})).await, (200, json!({"success": true})));
    let body = finish_stream(stream, first).await;
    assert_eq!(
        (body.essence()["finish"].clone(), body.essence()["ids"].as_array().unwrap().len()),
        (json!("length"), 200),
        "the preempted request recomputed and finished"
    );
    assert_eq!(t.post("/reset_mm_cache", &json!({})).await, (200, Value::String(String::new())));
}
