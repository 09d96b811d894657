//! vllm-sim beyond conformance: the properties later kvgate tests rely on (deterministic
//! continuation, fault injection, DP ranks, event encodings, preemption, admission control,
//! abort during prefill, the timing model, the Responses store, LoRA adapters, the development
//! endpoints). In-process servers on ephemeral ports.

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

mod control;
mod dialects;
mod lora;

use futures_util::StreamExt;
use kvgate_tests::Target;
use kvgate_tests::events::{Batch, Event, EventSub};
use kvgate_tests::target::{test_sim_config, unique_text};
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use vllm_sim::faults::FaultConfig;

fn ids_of(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[tokio::test]
async fn continuation_on_another_worker_yields_the_same_tokens() {
    let a = Target::sim(test_sim_config()).await;
    let b = Target::sim(test_sim_config()).await;
    let prompt = a.tokenize(&unique_text(40)).await;
    let full_req = json!({"prompt": prompt, "max_tokens": 30, "ignore_eos": true, "return_token_ids": true});
    let (s, full) = a.post("/v1/completions", &full_req).await;
    assert_eq!(s, 200, "{full}");
    let full = ids_of(&full);
    assert_eq!(full.len(), 30);
    // Migrate after 11 tokens: prompt + generated so far, remaining budget, other server.
    let mut cont_prompt: Vec<u64> = prompt.iter().map(|&t| u64::from(t)).collect();
    cont_prompt.extend_from_slice(&full[..11]);
    let (s, rest) = b.post("/v1/completions", &json!({"prompt": cont_prompt, "max_tokens": 19, "ignore_eos": true, "return_token_ids": true})).await;
    assert_eq!(s, 200, "{rest}");
    assert_eq!(ids_of(&rest), full[11..].to_vec());
}

#[tokio::test]
async fn generated_text_is_real_tokens_of_the_tokenizer() {
    let t = Target::sim(test_sim_config()).await;
    let (_, v) = t.post("/v1/completions", &json!({"prompt": "the cache", "max_tokens": 12, "ignore_eos": true, "return_token_ids": true})).await;
    let ids = ids_of(&v);
    let (_, d) = t.post("/detokenize", &json!({"tokens": ids})).await;
    assert_eq!(d["prompt"], v["choices"][0]["text"], "text is the detokenized token ids");
}

#[tokio::test]
async fn injected_500s_and_runtime_fault_changes() {
    let t = Target::sim(test_sim_config()).await;
    let (s, v) = t.post("/sim/faults", &json!({"error_rate": 1.0})).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = t.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, 500);
    assert_eq!(v["error"]["code"], 500);
    let (s, _) = t.post("/sim/faults", &json!({"error_rate": 7})).await;
    assert_eq!(s, 400, "invalid knobs are refused");
    let (s, _) = t.post("/sim/faults", &json!({})).await;
    assert_eq!(s, 200);
    let (s, _) = t.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, 200);
}

#[tokio::test]
async fn hang_fault_never_answers() {
    let mut cfg = test_sim_config();
    cfg.faults = FaultConfig { hang_rate: 1.0, ..Default::default() };
    let t = Target::sim(cfg).await;
    let r = tokio::time::timeout(
        Duration::from_millis(500),
        t.http.post(format!("{}/v1/completions", t.url)).json(&json!({"prompt": "x", "max_tokens": 1})).send(),
    )
    .await;
    assert!(r.is_err(), "a hung request gets no response");
    let (s, _) = t.get("/health").await;
    assert_eq!(s, 200, "the server itself stays up");
}

#[tokio::test]
async fn slow_first_token_delays_ttft() {
    let mut cfg = test_sim_config();
    cfg.faults = FaultConfig { first_token_delay_ms: 300.0, ..Default::default() };
    let t = Target::sim(cfg).await;
    let start = Instant::now();
    let (s, _) = t.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, 200);
    assert!(start.elapsed() >= Duration::from_millis(300));
}

#[tokio::test]
async fn crash_after_tokens_cuts_streams_and_stops_serving() {
    let mut cfg = test_sim_config();
    cfg.faults = FaultConfig { crash_after_tokens: Some(20), ..Default::default() };
    let t = Target::sim(cfg).await;
    let r = t
        .http
        .post(format!("{}/v1/completions", t.url))
        .json(&json!({"prompt": "the cache", "max_tokens": 100, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    let mut raw = Vec::new();
    let mut errored = false;
    while let Some(c) = body.next().await {
        match c {
            Ok(b) => raw.extend_from_slice(&b),
            Err(_) => {
                errored = true;
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&raw);
    assert!(errored || !text.contains("[DONE]"), "the stream is cut, not completed");
    let chunks = text.matches("data: {").count();
    assert!((1..=21).contains(&chunks), "about 20 tokens went out before the crash: {chunks}");
    t.sim_server().unwrap().stopped().await;
    assert!(t.sim_server().unwrap().faults().is_crashed());
    let after = t.http.get(format!("{}/health", t.url)).send().await;
    assert!(after.is_err(), "nothing is served after a crash");
}

#[tokio::test]
async fn crash_at_time_stops_the_server() {
    let mut cfg = test_sim_config();
    cfg.faults = FaultConfig { crash_after_secs: Some(0.2), ..Default::default() };
    let t = Target::sim(cfg).await;
    tokio::time::timeout(Duration::from_secs(5), t.sim_server().unwrap().stopped()).await.expect("crashed on time");
    assert!(t.http.get(format!("{}/health", t.url)).send().await.is_err());
}

#[tokio::test]
async fn dp_ranks_publish_on_their_own_ports_and_header_pins_rank() {
    let mut cfg = test_sim_config();
    cfg.data_parallel_size = 2;
    let t = Target::sim(cfg).await;
    let eps = t.sim_server().unwrap().kv_event_endpoints();
    assert_eq!(eps.len(), 2);
    assert_ne!(eps[0], eps[1]);
    let mut sub1 = EventSub::connect(&eps[1], "kv").await;
    let prompt = t.tokenize(&unique_text(60)).await;
    // Subscriptions propagate asynchronously: retry until rank 1's stream delivers.
    let deadline = Instant::now() + Duration::from_secs(10);
    let batch = loop {
        assert!(Instant::now() < deadline, "no event from rank 1");
        let r = t
            .http
            .post(format!("{}/v1/completions", t.url))
            .header("X-data-parallel-rank", "1")
            .json(&json!({"prompt": prompt, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        if let Some(b) = sub1.next(Duration::from_millis(300)).await {
            break b;
        }
    };
    assert_eq!(batch.rank, Some(1));
    let m = t.metrics().await;
    assert!(m.sum("vllm:prompt_tokens_total", &[("engine", "1")]) > 0.0);
    assert_eq!(m.sum("vllm:prompt_tokens_total", &[("engine", "0")]), 0.0);
    let (s, v) = t.post("/kv_event_sources", &json!({})).await;
    assert_eq!(s, 405, "{v}");
    let (_, src) = t.get("/kv_event_sources").await;
    let src: Value = serde_json::from_str(&src).unwrap();
    assert_eq!(src["1"]["endpoint"], eps[1].as_str());
    let r = t.http.post(format!("{}/v1/completions", t.url)).header("X-data-parallel-rank", "7").json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 400);
}

/// The first event batch `t` publishes for a fresh prompt (the request is resent until the
/// subscription is live, so no event is missed to the subscribe race).
async fn first_batch_after_a_request(t: &Target) -> Batch {
    let mut sub = EventSub::connect(t.zmq.as_deref().unwrap(), "kv").await;
    let prompt = t.tokenize(&unique_text(60)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < deadline);
        let (s, _) = t.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1})).await;
        assert_eq!(s, 200);
        if let Some(b) = sub.next(Duration::from_millis(300)).await {
            return b;
        }
    }
}

#[tokio::test]
async fn array_event_format_option() {
    let mut cfg = test_sim_config();
    cfg.kv_events_format = vllm_sim::events::EventFormat::Array;
    let t = Target::sim(cfg).await;
    let b = first_batch_after_a_request(&t).await;
    // [fixarray 3][f64 ts][array of events][event = array16 header 0xdc]
    let ev_start = 1 + 9 + 1;
    assert_eq!(b.payload[ev_start], 0xdc, "legacy events are positional arrays");
    assert!(matches!(b.events[0], Event::Stored { .. }));
}

#[tokio::test]
async fn full_byte_block_hash_option() {
    // What VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 does to vLLM: 32-byte digests as msgpack bin,
    // whose last 8 bytes are the ints the default mode publishes.
    use vllm_sim::block_hash::hash_block;
    let mut cfg = test_sim_config();
    cfg.kv_events_hash_format = vllm_sim::events::HashFormat::Bytes;
    let t = Target::sim(cfg).await;
    let b = first_batch_after_a_request(&t).await;
    let Event::Stored { hashes, parent, tokens, .. } = &b.events[0] else { panic!("{:?}", b.events) };
    assert_eq!(*parent, None);
    let mut want = Vec::new();
    let mut prev = None;
    for block in tokens.chunks(16) {
        let h = hash_block(prev.as_ref(), block);
        want.push(h);
        prev = Some(h);
    }
    assert_eq!(*hashes, want.iter().map(|h| h.wire_id()).collect::<Vec<_>>(), "the bin's last 8 bytes are the int form");
    for h in &want {
        let mut bin = vec![0xc4, 0x20];
        bin.extend_from_slice(&h.0);
        assert!(b.payload.windows(34).any(|w| w == bin.as_slice()), "each digest is a 32-byte msgpack bin");
    }
}

#[tokio::test]
async fn preemption_under_kv_pressure_completes_every_request() {
    let mut cfg = test_sim_config();
    cfg.num_gpu_blocks = 64; // 63 usable blocks of 16 tokens
    cfg.max_model_len = 1000;
    cfg.time_scale = 50.0;
    let t = Target::sim(cfg).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let prompt = t.tokenize(&unique_text(100)).await;
        let (http, url) = (t.http.clone(), t.url.clone());
        tasks.push(tokio::spawn(async move {
            let v: Value = http
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": prompt, "max_tokens": 200, "ignore_eos": true}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v["usage"]["completion_tokens"].as_u64()
        }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), Some(200));
    }
    let m = t.metrics().await;
    assert!(m.sum("vllm:num_preemptions_total", &[]) > 0.0, "8 × ~300-token sequences cannot fit in 1008 tokens");
    assert_eq!(m.sum("vllm:kv_cache_usage_perc", &[]), 0.0);
}

#[tokio::test]
async fn admission_control_answers_503_like_vllm() {
    let mut cfg = test_sim_config();
    cfg.max_num_seqs = 1;
    cfg.max_num_queued_reqs = Some(1);
    cfg.time_scale = 1.0;
    let t = Target::sim(cfg).await;
    let mut pending = Vec::new();
    for _ in 0..2 {
        let (http, url) = (t.http.clone(), t.url.clone());
        pending.push(tokio::spawn(async move {
            http.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 200, "ignore_eos": true})).send().await
        }));
    }
    // Wait until one runs and one waits.
    let deadline = Instant::now() + Duration::from_secs(5);
    while t.metrics().await.sum("vllm:num_requests_waiting", &[]) < 1.0 {
        assert!(Instant::now() < deadline, "second request never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (s, v) = t.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, 503, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("busy"));
    for p in pending {
        p.abort();
    }
}

#[tokio::test]
async fn disconnect_during_prefill_aborts_a_unary_request() {
    let mut cfg = test_sim_config();
    cfg.time_scale = 0.05; // a 2k-token prefill takes ~1.8 s of wall time
    let t = Target::sim(cfg).await;
    let prompt: Vec<u32> = t.tokenize(&unique_text(3000)).await.into_iter().take(2000).collect();
    let (http, url) = (t.http.clone(), t.url.clone());
    let req = tokio::spawn(async move { http.post(format!("{url}/v1/completions")).json(&json!({"prompt": prompt, "max_tokens": 5})).send().await });
    let deadline = Instant::now() + Duration::from_secs(5);
    while t.metrics().await.sum("vllm:num_requests_running", &[]) < 1.0 {
        assert!(Instant::now() < deadline, "request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    req.abort(); // the client disconnects while the prompt is still being prefilled
    let gone = Instant::now();
    loop {
        let m = t.metrics().await;
        if m.sum("vllm_sim:aborted_requests_total", &[]) == 1.0 {
            assert_eq!(m.sum("vllm:num_requests_running", &[]), 0.0);
            break;
        }
        // Generous for a loaded machine: the abort takes one step, milliseconds when idle.
        assert!(gone.elapsed() < Duration::from_secs(3), "not aborted 3 s after the disconnect");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Once the in-flight step finishes its blocks are released: nothing leaks.
    let freed = kvgate_tests::cluster::wait_until(Duration::from_secs(5), || async { t.metrics().await.sum("vllm:kv_cache_usage_perc", &[]) == 0.0 }).await;
    assert!(freed.is_some(), "the aborted request's blocks are freed");
}

#[tokio::test]
async fn long_prompts_take_longer_to_first_token() {
    let mut cfg = test_sim_config();
    cfg.time_scale = 1.0;
    let t = Target::sim(cfg).await;
    let long: Vec<u32> = t.tokenize(&unique_text(6000)).await.into_iter().take(4000).collect();
    let ttft = |prompt: Value| {
        let (http, url) = (t.http.clone(), t.url.clone());
        async move {
            let start = Instant::now();
            let r = http.post(format!("{url}/v1/completions")).json(&json!({"prompt": prompt, "max_tokens": 1})).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
            start.elapsed()
        }
    };
    let short = ttft(json!("the cache")).await;
    let long = ttft(json!(long)).await;
    // Default model: ~6 ms overhead vs ~150 ms for a 4k-token prefill.
    assert!(long > short * 5, "short {short:?} long {long:?}");
    assert!(long > Duration::from_millis(100), "{long:?}");
}

#[tokio::test]
async fn continue_final_message_continues_the_assistant_turn() {
    let t = Target::sim(test_sim_config()).await;
    let msgs = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]);
    let (s, cont) = t.post("/tokenize", &json!({"messages": msgs, "continue_final_message": true, "add_generation_prompt": false})).await;
    assert_eq!(s, 200, "{cont}");
    let (_, closed) = t.post("/tokenize", &json!({"messages": msgs, "add_generation_prompt": false})).await;
    let c = cont["count"].as_u64().unwrap();
    assert!(c < closed["count"].as_u64().unwrap(), "the final message is left open");
    let (_, text) = t.post("/detokenize", &json!({"tokens": cont["tokens"]})).await;
    assert!(text["prompt"].as_str().unwrap().ends_with("The answer is"), "{text}");
}
