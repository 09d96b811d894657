//! The KV index fed by a live target's events (vllm-sim by default, real vLLM under
//! tests/real-vllm/run-suite.sh): after a request, the index reports the prompt's full blocks
//! for that worker; after /reset_prefix_cache, none.

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

use kvgate_kv::hash::{DEFAULT_SEED, Hasher};
use kvgate_kv::index::{FlatIndex, KvIndex};
use kvgate_kv::metrics::KvMetrics;
use kvgate_kv::subscriber::{Source, run};
use kvgate_tests::Target;
use kvgate_tests::target::unique_text;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

async fn wait(mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test]
async fn the_index_reports_a_requests_full_blocks_then_none_after_reset() {
    let t = Target::start().await;
    let bs = t.block_size().await;
    let hasher = Hasher::new(bs, DEFAULT_SEED);
    let index = Arc::new(FlatIndex::new(4, 1024));
    let src = Source {
        endpoint: t.zmq.clone().expect("target publishes events"),
        replay: t.replay.clone(),
        topic: t.topic.clone(),
        worker: 1,
        hasher,
        label: "target".into(),
    };
    let task = tokio::spawn(run(src, index.clone(), KvMetrics::new(&prometheus::Registry::new())));
    // Subscriptions propagate asynchronously: repeat a warm-up until its blocks are indexed.
    let start = Instant::now();
    loop {
        let warm = t.tokenize(&unique_text(bs * 2)).await;
        let (s, _) = t.post("/v1/completions", &json!({"model": t.model, "prompt": warm, "max_tokens": 1})).await;
        assert_eq!(s, 200);
        let chain = hasher.chain(None, &warm);
        if wait(|| index.find_matches(&chain).get(1) as usize == chain.len()).await {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no events indexed");
    }
    let mut ids = t.tokenize(&unique_text(bs * 6)).await;
    ids.truncate(bs * 4 + 5);
    let chain = hasher.chain(None, &ids);
    assert_eq!(chain.len(), 4);
    let (s, v) = t.post("/v1/completions", &json!({"model": t.model, "prompt": ids, "max_tokens": 1})).await;
    assert_eq!(s, 200, "{v}");
    assert!(wait(|| index.find_matches(&chain).get(1) == 4).await, "the prompt's 4 full blocks are indexed");
    // Reset (the event goes out with the next engine step, so give it one).
    let deadline = Instant::now() + Duration::from_secs(10);
    while t.metrics().await.sum("vllm:num_requests_running", &[]) > 0.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (s, _) = t.post("/reset_prefix_cache", &json!({})).await;
    assert_eq!(s, 200);
    let (s, _) = t.post("/v1/completions", &json!({"model": t.model, "prompt": "the", "max_tokens": 1})).await;
    assert_eq!(s, 200);
    assert!(wait(|| index.find_matches(&chain).get(1) == 0).await, "nothing after /reset_prefix_cache");
    assert_eq!(index.block_count(1), 0);
    task.abort();
}

/// kvgate in front of workers that publish vLLM's full 32-byte block hashes
/// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`, as vllm-router's `kv_aware` documents): the
/// gateway reduces them to the same 64-bit ids, so stores apply, evictions find the blocks they
/// remove, and a prompt cached on one worker is routed to it.
#[tokio::test]
async fn full_byte_block_hashes_index_evict_and_route_like_int_ones() {
    use kvgate_tests::cluster::{Cluster, GatewayOpts, wait_until};
    use vllm_sim::SimConfig;
    use vllm_sim::events::HashFormat;

    // 159 usable blocks of 16 tokens: a few 40-block prompts evict earlier ones.
    let sim = SimConfig { kv_events_hash_format: HashFormat::Bytes, num_gpu_blocks: 160, max_model_len: 2048, ..kvgate_tests::target::test_sim_config() };
    let c = Cluster::sims_with_events(2, sim, GatewayOpts { mode: "kv".into(), ..Default::default() }).await;
    let prompt = |seed: u32| -> Vec<u32> { (0..40 * 16).map(|t| (seed * 7919 + t * 31) % 4000 + 10).collect() };
    let direct = |i: usize, p: Vec<u32>| {
        let (http, url) = (c.http.clone(), format!("{}/v1/completions", c.sims[i].url()));
        async move {
            let r = http.post(url).json(&json!({"model": "sim-model", "prompt": p, "max_tokens": 1})).send().await.unwrap();
            assert_eq!(r.status(), 200);
        }
    };
    let applied = |ty: &'static str| {
        let c = &c;
        async move { c.gateway_metrics().await.sum("kvgate_kv_events_total", &[("type", ty), ("result", "applied")]) }
    };
    // Subscriptions come up in the background: probe both workers until both streams apply.
    let ready = wait_until(Duration::from_secs(15), || async {
        for i in 0..2 {
            direct(i, prompt(1000 + i as u32)).await;
        }
        let m = c.gateway_metrics().await;
        let sources: std::collections::HashSet<_> = m
            .samples
            .iter()
            .filter(|s| s.name == "kvgate_kv_events_total" && s.labels.get("result").is_some_and(|r| r == "applied"))
            .filter_map(|s| s.labels.get("source").cloned())
            .collect();
        sources.len() == 2
    })
    .await;
    assert!(ready.is_some(), "the gateway applies full-byte events from both workers");

    // A prompt cached on worker 1 only goes to worker 1.
    let blocks = || async { c.gateway_metrics().await.sum("kvgate_kv_index_blocks", &[]) };
    let before = blocks().await;
    let hot = prompt(7);
    direct(1, hot.clone()).await;
    let indexed = wait_until(Duration::from_secs(10), || async { blocks().await >= before + 40.0 }).await;
    assert!(indexed.is_some(), "the hot prompt's 40 blocks are indexed");
    for _ in 0..3 {
        let r = c.http.post(c.url("/v1/completions")).json(&json!({"model": "sim-model", "prompt": hot, "max_tokens": 1})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()), Some(c.sims[1].url().as_str()));
    }

    // Evictions on worker 0 name 32-byte digests the gateway must recognise.
    for seed in 20..26 {
        direct(0, prompt(seed)).await;
    }
    let evicted = wait_until(Duration::from_secs(10), || async { applied("removed").await >= 40.0 }).await;
    assert!(evicted.is_some(), "removals applied");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_kv_unknown_removals_total", &[]), 0.0, "every removed digest matched a stored one");
    assert_eq!(m.sum("kvgate_kv_batches_malformed_total", &[]), 0.0);
    assert_eq!(m.sum("kvgate_kv_events_total", &[("result", "ignored")]), 0.0);
}
