//! OpenAI Responses streams move too (docs/migration.md "OpenAI Responses
//! streams"): a movable `/v1/responses` stream that its worker would not store is sent to the
//! worker as the chat request that renders and samples as it, and the gateway makes vLLM's
//! Responses events of the chat events. A stream moved by the admin or by its worker's death is
//! the unmoved one: byte for byte on vllm-sim (ids and timestamps aside); on real vLLM the same
//! text, status and usage ([`essence`]). The unmoved stream says what the worker's own
//! `/v1/responses` says. A stream the worker would store goes as it is, pinned `stored`.

use super::messages::{nothing, record, stream};
use super::{bookings_are_zero, pair, sim};
use kvgate_tests::cluster::{Cluster, GatewayOpts, wait_until};
use kvgate_tests::target::unique_text;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// The events of a Responses stream (`event: <type>` + `data: <json>`), each checked to name
/// its own type, numbered from 0 without a gap, with exactly one `response.completed`, last.
fn events(raw: &str) -> Vec<Value> {
    let ev = super::messages::events(raw);
    for (i, e) in ev.iter().enumerate() {
        assert_eq!(e["sequence_number"].as_u64(), Some(i as u64), "sequence numbers continue: {e}");
    }
    let completed: Vec<usize> = ev.iter().enumerate().filter(|(_, e)| e["type"] == "response.completed").map(|(i, _)| i).collect();
    assert_eq!(completed, vec![ev.len() - 1], "one response.completed, last: {raw}");
    ev
}

/// `raw` with what each run makes afresh written as placeholders: the response and item ids
/// (random in vLLM) and the creation time.
fn normalised(raw: &str) -> String {
    let ev = events(raw);
    let mut out = raw.to_string();
    let response = &ev[0]["response"];
    out = out.replace(&format!("\"{}\"", response["id"].as_str().unwrap()), "\"RESP\"");
    out = out.replace(&format!("\"created_at\":{}", response["created_at"]), "\"created_at\":0");
    for e in &ev {
        if let Some(id) = e["item"]["id"].as_str().or(e["item_id"].as_str()) {
            out = out.replace(&format!("\"{id}\""), "\"ITEM\"");
        }
    }
    out
}

/// What a Responses client reassembles: the text of the deltas, and the final response (ids
/// and time written as placeholders) with its status and usage. The prompt's cache counts
/// (`input_tokens_details`) are left out: vLLM's Responses endpoint always reports them, its
/// chat endpoint (which a translated stream goes through) only with
/// `--enable-prompt-tokens-details`, and the suite's servers run without it
/// (docs/migration.md, "Known differences").
pub(super) fn essence(raw: &str) -> Value {
    let ev = events(&normalised(raw));
    let text: String = ev.iter().filter(|e| e["type"] == "response.output_text.delta").filter_map(|e| e["delta"].as_str()).collect();
    let done = &ev.last().unwrap()["response"];
    let mut usage = done["usage"].clone();
    usage.as_object_mut().map(|u| u.remove("input_tokens_details"));
    json!({"text": text, "status": done["status"], "output": done["output"], "usage": usage, "incomplete": done["incomplete_details"]})
}

fn request(model: &str, max: u64) -> Value {
    json!({"model": model, "max_output_tokens": max, "temperature": 0, "stream": true, "store": false, "instructions": "You answer briefly.",
           "input": [{"role": "user", "content": unique_text(30)}, {"role": "assistant", "content": "Sure."},
                     {"role": "user", "content": [{"type": "input_text", "text": unique_text(10)}]}]})
}

/// Until the gateway has read a worker's model card (before, the model may be a Harmony model
/// and its Responses streams stay put).
pub(super) async fn cards_read(c: &Cluster, model: &str) {
    let read = wait_until(Duration::from_secs(20), || async {
        let v: Value = c.http.get(c.url("/v1/models")).send().await.unwrap().json().await.unwrap();
        v["data"].as_array().is_some_and(|d| d.iter().any(|m| m["id"] == model && m["owned_by"] != "kvgate"))
    })
    .await;
    assert!(read.is_some(), "the gateway read the workers' model cards");
}

#[tokio::test]
async fn a_responses_stream_moved_by_the_admin_is_the_unmoved_stream() {
    let (c, real) = pair(GatewayOpts::default()).await;
    let (model, max) = if real { (std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into()), 480) } else { ("sim-model".into(), 48) };
    let worker = match std::env::var("KVGATE_TARGET_URL") {
        Ok(u) if real => u,
        _ => c.sims[0].url(),
    };
    cards_read(&c, &model).await;
    let body = request(&model, max);
    let direct = stream(&c.http, &format!("{}/v1/responses", worker.trim_end_matches('/')), &body, "resp-direct", 0, nothing).await;
    let unmoved = stream(&c.http, &c.url("/v1/responses"), &body, "resp-ref", 0, nothing).await;
    assert_eq!(essence(&unmoved), essence(&direct), "through the gateway vs the worker's own /v1/responses");
    assert!(record(&c, "resp-ref").await["pinned"].is_null(), "a Responses stream nothing stores may move");
    let answer = Arc::new(parking_lot::Mutex::new(None));
    let order = |_serving: String| {
        let (http, url, answer) = (c.http.clone(), c.admin("/migrate"), answer.clone());
        async move {
            let r = http.post(url).json(&json!({"request_id": "resp-mv"})).send().await.unwrap();
            *answer.lock() = Some((r.status().as_u16(), r.json::<Value>().await.unwrap()));
        }
    };
    // After created, in_progress, the item and part added, and four deltas.
    let moved = stream(&c.http, &c.url("/v1/responses"), &body, "resp-mv", 8, order).await;
    let (status, report) = answer.lock().clone().expect("the move was ordered");
    assert_eq!((status, report["how"].as_str()), (200, Some("continuation")), "{report}");
    assert!(report["generated"].as_u64().is_some_and(|g| g >= 1), "moved mid-way: {report}");
    if real {
        assert_eq!(essence(&moved), essence(&unmoved), "moved vs unmoved");
    } else {
        assert_eq!(normalised(&moved), normalised(&unmoved), "moved vs unmoved, byte for byte");
    }
    assert_eq!(record(&c, "resp-mv").await["moves"], 1);
    bookings_are_zero(&c).await;
}

#[tokio::test]
async fn a_responses_stream_whose_worker_dies_is_the_unmoved_stream() {
    let c = Cluster::sims(2, sim(1.0), GatewayOpts::default()).await;
    cards_read(&c, "sim-model").await;
    let body = request("sim-model", 60);
    let unmoved = stream(&c.http, &c.url("/v1/responses"), &body, "ref", 0, nothing).await;
    let crash = |serving: String| {
        let victim = c.sims.iter().position(|s| s.url().trim_end_matches('/') == serving.trim_end_matches('/')).expect("a known worker");
        c.sims[victim].crash();
        async {}
    };
    let failed_over = stream(&c.http, &c.url("/v1/responses"), &body, "killed", 10, crash).await;
    assert_eq!(normalised(&failed_over), normalised(&unmoved), "failed over vs unmoved");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_migrations_total", &[("reason", "failover"), ("outcome", "ok")]), 1.0);
    bookings_are_zero(&c).await;
}

#[tokio::test]
async fn a_responses_stream_its_worker_stores_stays_there_and_says_why() {
    let c = Cluster::sims(2, sim(50.0), GatewayOpts::default()).await;
    cards_read(&c, "sim-model").await;
    let mut body = request("sim-model", 8);
    body.as_object_mut().unwrap().remove("store");
    let raw = stream(&c.http, &c.url("/v1/responses"), &body, "stored", 0, nothing).await;
    assert!(events(&raw).len() > 3);
    assert_eq!(record(&c, "stored").await["pinned"], "stored");
}
