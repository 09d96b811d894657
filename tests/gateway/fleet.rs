//! What the gateway answers for the fleet as a whole (#34): `/v1/models` from the workers' own
//! model cards, requests naming a LoRA adapter placed only on workers that list it, and vLLM's
//! control endpoints as fleet operations on the admin listener.

use super::post;
use kvgate_tests::cluster::{Cluster, GatewayOpts, wait_until};
use serde_json::{Value, json};
use std::time::Duration;

/// Until the gateway's `/v1/models` lists `id` (cards are read on the first load poll);
/// returns that card.
pub async fn card(c: &Cluster, id: &str) -> Value {
    for _ in 0..600 {
        let listed: Option<Value> = async { c.http.get(c.url("/v1/models")).send().await.ok()?.json().await.ok() }.await;
        // The gateway's own minimal card stands in until a worker's was read.
        if let Some(card) = listed.as_ref().and_then(|v| v["data"].as_array()?.iter().find(|m| m["id"] == id).cloned())
            && card.get("owned_by") != Some(&json!("kvgate"))
        {
            return card;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the gateway's /v1/models never listed the workers' card of {id}");
}

/// Two real vLLM servers, the second serving a LoRA adapter (tests/real-vllm/run-suite.sh names
/// it in KVGATE_TARGET_LORA): the gateway lists the adapter with its parent as vLLM does, sends
/// it only to the second server with the same answer as direct, and pauses, resumes and resets
/// both servers as one fleet.
#[tokio::test]
async fn a_real_fleet_serves_its_adapter_and_obeys_fleet_operations() {
    let (Ok(url), Ok(url2), Ok(lora)) = (std::env::var("KVGATE_TARGET_URL"), std::env::var("KVGATE_TARGET_URL_2"), std::env::var("KVGATE_TARGET_LORA")) else {
        eprintln!("KVGATE_TARGET_URL_2 / KVGATE_TARGET_LORA not set: runs under tests/real-vllm/run-suite.sh");
        return;
    };
    let model = std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into());
    let c = Cluster::front(&[url.clone(), url2.clone()], GatewayOpts { model: model.clone(), ..Default::default() }).await;
    let direct: Value = c.http.get(format!("{url2}/v1/models")).send().await.unwrap().json().await.unwrap();
    let want = direct["data"].as_array().unwrap().iter().find(|m| m["id"] == lora.as_str()).cloned().expect("the second server lists the adapter");
    let got = card(&c, &lora).await;
    assert_eq!((got["parent"].clone(), got["root"].clone()), (want["parent"].clone(), want["root"].clone()), "{got}");
    let base = card(&c, &model).await;
    assert!(base["max_model_len"].as_u64().is_some() && base["root"].is_string(), "the workers' own card: {base}");

    let body = json!({"model": lora, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0});
    let (_, want) = post(&c.http, &format!("{url2}/v1/completions"), &body).await;
    for _ in 0..4 {
        let r = c.http.post(c.url("/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!((r.status().as_u16(), r.headers()["x-kvgate-worker"].to_str().unwrap()), (200, url2.as_str()));
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["choices"][0]["text"], want["choices"][0]["text"], "{v}");
    }

    // Paused: a request waits in the gateway, and finishes once the fleet resumes.
    let (s, v) = post(&c.http, &c.admin("/pause"), &json!({})).await;
    assert_eq!(s, 200, "{v}");
    assert!(v["results"].as_array().unwrap().iter().all(|r| r["body"]["status"] == "paused"), "{v}");
    let waiting = tokio::spawn({
        let (http, u) = (c.http.clone(), c.url("/v1/completions"));
        let body = json!({"model": model, "prompt": "Paused, then", "max_tokens": 4, "temperature": 0});
        async move { post(&http, &u, &body).await }
    });
    let queued = wait_until(Duration::from_secs(10), || async { c.gateway_metrics().await.sum("kvgate_queued_requests", &[]) >= 1.0 }).await;
    assert!(queued.is_some(), "the request waits in the gateway while paused");
    let (s, v) = post(&c.http, &c.admin("/resume"), &json!({})).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = waiting.await.unwrap();
    assert_eq!(s, 200, "{v}");
    let (s, v) = post(&c.http, &c.admin(&format!("/reset_prefix_cache?model={model}")), &json!({})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["results"].as_array().unwrap().len(), 2, "{v}");
}

/// One streamed chat completion; `Err` says what went wrong for the client (a status other than
/// 200, a broken body, a stream without its finish reason or `[DONE]`).
async fn one_stream(http: &reqwest::Client, url: &str, n: usize) -> Result<(), String> {
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": format!("pause test {n}")}], "max_tokens": 12, "stream": true});
    let r = http.post(url).json(&body).send().await.map_err(|e| format!("send: {e}"))?;
    let status = r.status().as_u16();
    let text = r.text().await.map_err(|e| format!("body: {e}"))?;
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    let s = kvgate_tests::sse::parse(&text);
    let finished = s.events.iter().any(|e| !e["choices"][0]["finish_reason"].is_null());
    if s.done && finished { Ok(()) } else { Err(format!("stream cut: {text}")) }
}

/// An RL trainer's pause → (weights updated) → resume, under streaming load: requests that
/// arrive while the fleet is paused wait in the gateway, those in flight freeze on their
/// worker (`mode=keep`) and continue, and no client sees an error.
#[tokio::test]
async fn pausing_the_fleet_under_streaming_load_costs_clients_no_error() {
    let c = Cluster::sims(2, super::sim(20.0), GatewayOpts::default()).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let clients: Vec<_> = (0..8)
        .map(|k| {
            let (http, url, stop, done) = (c.http.clone(), c.url("/v1/chat/completions"), stop.clone(), done.clone());
            tokio::spawn(async move {
                let mut errors = Vec::new();
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    if let Err(e) = one_stream(&http, &url, k * 10_000 + n).await {
                        errors.push(e);
                    }
                    n += 1;
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                errors
            })
        })
        .collect();
    let count = || done.load(std::sync::atomic::Ordering::SeqCst);
    assert!(wait_until(Duration::from_secs(20), || async { count() >= 16 }).await.is_some(), "load runs");
    let (s, v) = post(&c.http, &c.admin("/pause"), &json!({})).await;
    eprintln!("pause: {s} {v}");
    let results = v["results"].as_array().cloned().unwrap_or_default();
    assert_eq!(results.len(), 2, "{v}");
    assert!(s == 200 || results.iter().all(|r| r["status"] == 404), "the workers paused, or have no /pause: {v}");
    // New requests queue in the gateway; nothing more finishes once the ones in flight have.
    let held = wait_until(Duration::from_secs(20), || async { c.gateway_metrics().await.sum("kvgate_queued_requests", &[]) >= 8.0 }).await;
    assert!(held.is_some(), "every client's next request waits while paused");
    let before = count();
    let (s, v) = post(&c.http, &c.admin("/resume"), &json!({})).await;
    assert!(s == 200 || v["results"].as_array().unwrap().iter().all(|r| r["status"] == 404), "{v}");
    assert!(wait_until(Duration::from_secs(20), || async { count() >= before + 16 }).await.is_some(), "load resumes");
    eprintln!("resume: {s} {v}; {before} streams before, {} after", count());
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut errors = Vec::new();
    for cl in clients {
        errors.extend(cl.await.unwrap());
    }
    assert!(errors.is_empty(), "{} client errors: {:?}", errors.len(), &errors[..errors.len().min(3)]);
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_queued_requests", &[]), 0.0);
    assert!(m.sum("kvgate_queue_wait_seconds_count", &[]) >= 8.0, "the held requests were counted as queued");
}
