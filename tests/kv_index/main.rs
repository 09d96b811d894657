//! The KV index fed by a live target's events (vllm-sim by default, real vLLM under
//! tests/real-vllm/run-suite.sh): after a request, the index reports the prompt's full blocks
//! for that worker; after /reset_prefix_cache, none.

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
