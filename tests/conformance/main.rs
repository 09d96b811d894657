//! vLLM conformance suite: API shapes, SSE framing, errors, metrics names and KV events on the
//! wire. It runs against an in-process vllm-sim by default and, unchanged, against real vLLM
//! (tests/real-vllm/run-suite.sh). Nothing here depends on which one answers: token ids come
//! from the target's own /tokenize, the block size from its /metrics.

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

mod dialects;

use kvgate_tests::Target;
use kvgate_tests::events::{Event, EventSub, replay};
use kvgate_tests::sse;
use kvgate_tests::target::unique_text;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn assert_error_shape(status: u16, v: &Value, want_status: u16) {
    assert_eq!(status, want_status, "{v}");
    let e = &v["error"];
    assert!(e["message"].is_string(), "error.message: {v}");
    assert!(e["type"].is_string(), "error.type: {v}");
    assert!(e.get("param").is_some(), "error.param present: {v}");
    assert_eq!(e["code"].as_u64(), Some(u64::from(want_status)), "error.code: {v}");
}

#[tokio::test]
async fn health_and_models() {
    let t = Target::start().await;
    let (s, body) = t.get("/health").await;
    assert_eq!((s, body.as_str()), (200, ""));
    let (s, body) = t.get("/v1/models").await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    let m = &v["data"][0];
    assert_eq!(m["id"], t.model.as_str());
    assert_eq!(m["object"], "model");
    assert_eq!(m["owned_by"], "vllm");
    assert!(m["max_model_len"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn completion_unary_shape_and_usage() {
    let t = Target::start().await;
    let text = unique_text(12);
    let n_prompt = t.tokenize(&text).await.len();
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": text, "max_tokens": 5, "ignore_eos": true})).await;
    assert_eq!(s, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], t.model.as_str());
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert!(c["text"].is_string());
    assert_eq!(c["finish_reason"], "length");
    assert!(c.get("logprobs").is_some());
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(n_prompt as u64));
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"].as_u64(), Some(n_prompt as u64 + 5));
}

#[tokio::test]
async fn token_id_prompts_single_and_batch_with_return_token_ids() {
    let t = Target::start().await;
    let a = t.tokenize(&unique_text(10)).await;
    let b = t.tokenize(&unique_text(7)).await;
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": a, "max_tokens": 3, "ignore_eos": true, "return_token_ids": true})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["prompt_token_ids"], json!(a));
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 3);
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(a.len() as u64));

    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": [a, b], "max_tokens": 2, "ignore_eos": true})).await;
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut idx: Vec<u64> = choices.iter().map(|c| c["index"].as_u64().unwrap()).collect();
    idx.sort_unstable();
    assert_eq!(idx, vec![0, 1]);
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some((a.len() + b.len()) as u64));
    assert_eq!(v["usage"]["completion_tokens"], 4);
}

#[tokio::test]
async fn completion_stream_framing_usage_and_token_ids() {
    let t = Target::start().await;
    let ids = t.tokenize(&unique_text(9)).await;
    let body = json!({"model": t.model, "prompt": ids, "max_tokens": 4, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}, "return_token_ids": true});
    let (s, ctype, b) = sse::stream(&t.http, &format!("{}/v1/completions", t.url), &body).await;
    assert_eq!(s, 200, "{}", b.raw);
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    assert!(b.done, "stream ends with data: [DONE]");
    assert!(b.raw.ends_with("data: [DONE]\n\n"));
    let (usage, tokens): (Vec<&Value>, Vec<&Value>) = b.events.iter().partition(|e| e["choices"].as_array().is_some_and(|c| c.is_empty()));
    assert_eq!(usage.len(), 1, "exactly one usage chunk");
    assert_eq!(usage[0]["usage"]["completion_tokens"], 4);
    assert_eq!(usage[0]["usage"]["prompt_tokens"].as_u64(), Some(ids.len() as u64));
    let id = tokens[0]["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-"));
    let mut generated = Vec::new();
    for (i, e) in tokens.iter().enumerate() {
        assert_eq!(e["id"], id, "same id in every chunk");
        assert_eq!(e["object"], "text_completion");
        let c = &e["choices"][0];
        if i == 0 {
            assert_eq!(c["prompt_token_ids"], json!(ids));
        }
        generated.extend(c["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()));
        let last = i == tokens.len() - 1;
        assert_eq!(c["finish_reason"].is_null(), !last, "finish_reason only on the last token chunk: {e}");
    }
    assert_eq!(generated.len(), 4);
    assert_eq!(tokens.last().unwrap()["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn chat_stream_starts_with_role_chunk() {
    let t = Target::start().await;
    let body = json!({"model": t.model, "messages": [{"role": "user", "content": unique_text(6)}], "max_tokens": 3,
                      "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    let (s, _, b) = sse::stream(&t.http, &format!("{}/v1/chat/completions", t.url), &body).await;
    assert_eq!(s, 200, "{}", b.raw);
    assert!(b.done);
    let first = &b.events[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert!(first["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["choices"][0]["delta"]["content"], "");
    let content: Vec<&Value> = b.events[1..].iter().filter(|e| !e["choices"].as_array().unwrap().is_empty()).collect();
    assert_eq!(content.len(), 3, "one chunk per token");
    assert!(content.iter().all(|e| e["choices"][0]["delta"].get("role").is_none()));
    assert_eq!(content[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(b.events.last().unwrap()["usage"]["completion_tokens"], 3);
}

/// kvgate's output-block tracking counts generated tokens from the stream's events; that count
/// must match the worker's own `completion_tokens` on both endpoints.
#[tokio::test]
async fn stream_events_count_the_generated_tokens() {
    use kvgate::sse::SseEventCounter;
    let t = Target::start().await;
    let usage = json!({"include_usage": true});
    let bodies = [
        ("/v1/completions", json!({"model": t.model, "prompt": unique_text(7), "max_tokens": 24, "ignore_eos": true, "stream": true, "stream_options": usage})),
        (
            "/v1/chat/completions",
            json!({"model": t.model, "messages": [{"role": "user", "content": unique_text(7)}], "max_tokens": 24, "ignore_eos": true, "stream": true, "stream_options": usage}),
        ),
    ];
    for (path, body) in bodies {
        let (s, _, b) = sse::stream(&t.http, &format!("{}{path}", t.url), &body).await;
        assert_eq!(s, 200, "{}", b.raw);
        let counted = SseEventCounter::default().feed(b.raw.as_bytes());
        assert_eq!(Some(counted), b.events.last().unwrap()["usage"]["completion_tokens"].as_u64(), "{path}: {}", b.raw);
    }
}

#[tokio::test]
async fn chat_unary_shape_and_template_tokens() {
    let t = Target::start().await;
    let msgs = json!([{"role": "user", "content": unique_text(5)}]);
    let (s, tk) = t.post("/tokenize", &json!({"model": t.model, "messages": msgs})).await;
    assert_eq!(s, 200, "{tk}");
    let (s, v) = t
        .post("/v1/chat/completions", &json!({"model": t.model, "messages": msgs, "max_completion_tokens": 2, "ignore_eos": true, "return_token_ids": true}))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["content"].is_string());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(v["usage"]["prompt_tokens"], tk["count"]);
    assert_eq!(v["prompt_token_ids"], tk["tokens"], "chat prompt tokenizes like chat-form /tokenize");
}

#[tokio::test]
async fn x_request_id_becomes_the_response_id() {
    let t = Target::start().await;
    let r = t
        .http
        .post(format!("{}/v1/completions", t.url))
        .header("X-Request-Id", "conformance-42")
        .json(&json!({"model": t.model, "prompt": "the cache", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["id"], "cmpl-conformance-42");
}

#[tokio::test]
async fn errors_have_vllm_shape_and_status() {
    let t = Target::start().await;
    let (s, v) = t.post("/v1/completions", &json!({"model": "no-such-model", "prompt": "x"})).await;
    assert_error_shape(s, &v, 404);
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["param"], "model");

    let (s, v) = t.post_raw("/v1/completions", b"{\"model\": \"x\", \"prompt\": ").await;
    assert_error_shape(s, &v, 400);
    let (s, v) = t.post_raw("/v1/chat/completions", b"[1,2,3]").await;
    assert_error_shape(s, &v, 400);
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": 5})).await;
    assert_error_shape(s, &v, 400);
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": "x", "max_tokens": 0})).await;
    assert_error_shape(s, &v, 400);
    assert_eq!(v["error"]["type"], "BadRequestError");
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": "x", "stream_options": {"include_usage": true}})).await;
    assert_error_shape(s, &v, 400);
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": [99_999_999]})).await;
    assert_error_shape(s, &v, 400);
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": ""})).await;
    assert_error_shape(s, &v, 400);
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": "x", "max_tokens": 100_000_000})).await;
    assert_error_shape(s, &v, 400);
    let long: Vec<u32> = t.tokenize(&unique_text(8)).await.into_iter().cycle().take(200_000).collect();
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": long, "max_tokens": 1})).await;
    assert_error_shape(s, &v, 400);
    let (s, v) = t
        .post(
            "/v1/chat/completions",
            &json!({"model": t.model, "messages": [{"role": "user", "content": "x"}], "continue_final_message": true, "add_generation_prompt": true}),
        )
        .await;
    assert_error_shape(s, &v, 400);
    let (s, body) = t.get("/v1/no-such-route").await;
    assert_eq!(s, 404, "{body}");
}

#[tokio::test]
async fn tokenize_detokenize_roundtrip() {
    let t = Target::start().await;
    let text = unique_text(11);
    let ids = t.tokenize(&text).await;
    let (s, v) = t.post("/detokenize", &json!({"model": t.model, "tokens": ids})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["prompt"].as_str().unwrap().trim(), text);
    let (s, v) = t.post("/tokenize", &json!({"model": t.model, "prompt": text})).await;
    assert_eq!(s, 200);
    assert_eq!(v["count"].as_u64(), Some(ids.len() as u64));
    assert!(v["max_model_len"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn metrics_use_vllm_names_and_labels() {
    let t = Target::start().await;
    let (s, _) = t.post("/v1/completions", &json!({"model": t.model, "prompt": unique_text(4), "max_tokens": 2})).await;
    assert_eq!(s, 200);
    let m = t.metrics().await;
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:cache_config_info",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ] {
        assert!(m.has(name), "missing {name}");
        let s = m.samples.iter().find(|s| s.name == name).unwrap();
        if name != "vllm:cache_config_info" {
            // vLLM's info gauge carries the cache config and the engine, not the model name.
            assert_eq!(s.labels.get("model_name").map(String::as_str), Some(t.model.as_str()), "{name} model_name label");
        }
        assert!(s.labels.contains_key("engine"), "{name} engine label");
    }
    assert!(m.info_label("vllm:cache_config_info", "num_gpu_blocks").unwrap().parse::<u64>().unwrap() > 0);
    assert!(t.block_size().await > 0);
    assert!(m.sum("vllm:generation_tokens_total", &[]) >= 2.0);
}

/// Waits until the SUB socket receives something (ZMQ subscriptions propagate asynchronously).
async fn ready_sub(t: &Target) -> EventSub {
    let mut sub = EventSub::connect(t.zmq.as_deref().expect("target publishes KV events"), &t.topic).await;
    let bs = t.block_size().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < deadline, "no KV event arrived within 30 s");
        let ids: Vec<u32> = t.tokenize(&unique_text(bs * 2)).await;
        let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": ids, "max_tokens": 1})).await;
        assert_eq!(s, 200, "{v}");
        if sub.next(Duration::from_millis(500)).await.is_some() {
            while sub.next(Duration::from_millis(200)).await.is_some() {}
            return sub;
        }
    }
}

#[tokio::test]
async fn kv_events_carry_the_prompt_blocks_and_prefix_cache_hits() {
    let t = Target::start().await;
    let mut sub = ready_sub(&t).await;
    let bs = t.block_size().await;
    let mut ids = t.tokenize(&unique_text(bs * 6)).await;
    ids.truncate(bs * 4 + 3); // 4 full blocks and a partial one
    assert_eq!(ids.len(), bs * 4 + 3);
    let before = t.metrics().await;
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": ids, "max_tokens": 1})).await;
    assert_eq!(s, 200, "{v}");

    // Find the stored events that chain from the root through our 4 blocks.
    let full = ids[..bs * 4].to_vec();
    let batches = sub
        .collect_until(Duration::from_secs(5), |bs_| {
            let toks: Vec<u32> = bs_
                .iter()
                .flat_map(|b| &b.events)
                .flat_map(|e| match e {
                    Event::Stored { tokens, .. } => tokens.clone(),
                    _ => vec![],
                })
                .collect();
            toks.windows(full.len()).any(|w| w == full.as_slice())
        })
        .await;
    for b in &batches {
        assert_eq!(b.topic, t.topic.as_bytes(), "topic frame");
        assert!(b.ts > 1.0e9, "ts is a unix time");
        assert_eq!(b.rank, Some(0));
    }
    let mut ours: Vec<(Vec<u64>, Option<u64>, Vec<u32>)> = Vec::new();
    for e in batches.iter().flat_map(|b| &b.events) {
        if let Event::Stored { hashes, parent, tokens, block_size } = e {
            assert_eq!(*block_size as usize, bs);
            assert_eq!(tokens.len(), hashes.len() * bs, "token_ids cover exactly the stored blocks");
            if full.windows(tokens.len()).any(|w| w == tokens.as_slice()) {
                ours.push((hashes.clone(), *parent, tokens.clone()));
            }
        }
    }
    let stored: Vec<u32> = ours.iter().flat_map(|(_, _, t)| t.clone()).collect();
    assert_eq!(stored, full, "stored blocks' token_ids equal the prompt's full blocks");
    assert_eq!(ours[0].1, None, "the first block has no parent");
    let all_hashes: Vec<u64> = ours.iter().flat_map(|(h, _, _)| h.clone()).collect();
    for w in ours.windows(2) {
        let prev_last = *w[0].0.last().unwrap();
        assert_eq!(w[1].1, Some(prev_last), "events chain through parent_block_hash");
    }
    assert_eq!(all_hashes.len(), 4);

    // The same prompt again hits the prefix cache for its 4 full blocks.
    let (s, _) = t.post("/v1/completions", &json!({"model": t.model, "prompt": ids, "max_tokens": 1})).await;
    assert_eq!(s, 200);
    let after = t.metrics().await;
    let hits = after.sum("vllm:prefix_cache_hits_total", &[]) - before.sum("vllm:prefix_cache_hits_total", &[]);
    let queries = after.sum("vllm:prefix_cache_queries_total", &[]) - before.sum("vllm:prefix_cache_queries_total", &[]);
    assert!(hits >= (bs * 4) as f64, "second request hits its 4 blocks: hits {hits}");
    assert!(queries >= (2 * ids.len()) as f64, "queries count prompt tokens: {queries}");
}

#[tokio::test]
async fn replay_returns_buffered_batches_then_end_marker() {
    let t = Target::start().await;
    let _sub = ready_sub(&t).await; // makes sure at least one batch was published
    let got = replay(t.replay.as_deref().expect("target has a replay endpoint"), 0).await;
    assert!(!got.is_empty(), "replay from seq 0 returns the buffered batches");
    for w in got.windows(2) {
        assert_eq!(w[1].seq, w[0].seq + 1, "replayed seqs are consecutive");
    }
    assert!(got.iter().all(|b| b.topic == t.topic.as_bytes()));
    let last = got.last().unwrap().seq;
    let tail = replay(t.replay.as_deref().unwrap(), last).await;
    assert_eq!(tail.first().map(|b| b.seq), Some(last), "replay starts at the requested seq");
}

#[tokio::test]
async fn reset_prefix_cache_publishes_all_blocks_cleared() {
    let t = Target::start().await;
    let mut sub = ready_sub(&t).await;
    // Let in-flight work drain so no block is referenced (vLLM refuses to reset otherwise).
    let deadline = Instant::now() + Duration::from_secs(10);
    while t.metrics().await.sum("vllm:num_requests_running", &[]) > 0.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (s, v) = t.post("/reset_prefix_cache", &json!({})).await;
    assert_eq!(s, 200, "{v}");
    // vLLM publishes the event with the next engine step's batch: give it a step.
    let (s, _) = t.post("/v1/completions", &json!({"model": t.model, "prompt": "the", "max_tokens": 1})).await;
    assert_eq!(s, 200);
    let batches = sub.collect_until(Duration::from_secs(5), |b| b.iter().flat_map(|b| &b.events).any(|e| *e == Event::Cleared)).await;
    assert!(batches.iter().flat_map(|b| &b.events).any(|e| *e == Event::Cleared), "AllBlocksCleared published");
}

#[tokio::test]
async fn client_disconnect_mid_stream_aborts_the_request() {
    use futures_util::StreamExt;
    let t = Target::start().await;
    let ids = t.tokenize(&unique_text(8)).await;
    let length_before = t.metrics().await.sum("vllm:request_success_total", &[("finished_reason", "length")]);
    let r = t
        .http
        .post(format!("{}/v1/completions", t.url))
        .json(&json!({"model": t.model, "prompt": ids, "max_tokens": 2000, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut seen = 0;
    while seen < 200 {
        let chunk = body.next().await.expect("stream open").expect("chunk");
        seen += chunk.len();
    }
    assert_eq!(t.metrics().await.sum("vllm:num_requests_running", &[]), 1.0, "the request is running");
    drop(body); // the client goes away mid-stream
    let gone = Instant::now();
    while t.metrics().await.sum("vllm:num_requests_running", &[]) > 0.0 {
        // 2000 tokens take ~3 s on either target; an abort frees the seat well before.
        assert!(gone.elapsed() < Duration::from_millis(1500), "request still running 1.5 s after the disconnect");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let m = t.metrics().await;
    assert_eq!(m.sum("vllm:request_success_total", &[("finished_reason", "length")]), length_before, "the request was aborted, not completed");
    if !t.external {
        assert_eq!(m.sum("vllm_sim:aborted_requests_total", &[]), 1.0);
    }
}
