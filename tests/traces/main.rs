//! Request traces (`tracing:`): a request's spans continue the client's `traceparent`, hold a
//! span per phase under the request's own, and carry their context to the worker, so that a
//! real vLLM started with `--otlp-traces-endpoint` puts its spans under kvgate's leg (under
//! tests/real-vllm/run-suite.sh, which starts that vLLM and the receiver both export to); a
//! moved stream shows both its legs and the move; sampling follows `sample_ratio` and the
//! client's decision.

use futures_util::StreamExt;
use kvgate_tests::cluster::{Cluster, GatewayOpts};
use kvgate_tests::otlp::{Received, Receiver};
use kvgate_tests::target::{test_sim_config, unique_text};
use serde_json::{Value, json};
use std::time::Duration;

/// How long spans may take to arrive (the batch processor exports every few seconds).
const ARRIVAL: Duration = Duration::from_secs(20);

fn tracing_yaml(r: &Receiver, ratio: f64) -> String {
    format!("tracing:\n  otlp_endpoint: {}\n  sample_ratio: {ratio}\n", r.url)
}

/// A gateway exporting to `r`: in front of the real vLLM the environment names, else of two
/// simulators. The model's name, and whether it is real.
async fn gateway(r: &Receiver, ratio: f64) -> (Cluster, String, bool) {
    let extra = tracing_yaml(r, ratio);
    match std::env::var("KVGATE_TARGET_URL") {
        Ok(url) => {
            let model = std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into());
            let real = GatewayOpts::real_vllm(&model);
            (
                Cluster::front(&[url], GatewayOpts { model: model.clone(), extra, health_timeout: real.health_timeout, ..GatewayOpts::default() }).await,
                model,
                true,
            )
        }
        Err(_) => (Cluster::sims(2, test_sim_config(), GatewayOpts { extra, ..GatewayOpts::default() }).await, "sim-model".into(), false),
    }
}

/// A fresh W3C trace id and span id (the "client's" span).
fn client_ids(tag: u64) -> (String, String) {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    (format!("{:032x}", nanos ^ u128::from(tag) << 64), format!("{:016x}", tag.wrapping_mul(kvgate_kv::hash::PHI) | 1))
}

fn named<'a>(spans: &'a [Received], name: &str) -> Vec<&'a Received> {
    spans.iter().filter(|s| s.name == name).collect()
}

fn one<'a>(spans: &'a [Received], name: &str) -> &'a Received {
    let found = named(spans, name);
    assert_eq!(found.len(), 1, "one {name} span: {spans:#?}");
    found[0]
}

#[tokio::test]
async fn a_requests_spans_continue_the_clients_trace_into_the_worker() {
    let receiver = Receiver::start().await;
    let (c, model, real) = gateway(&receiver, 1.0).await;
    let (trace_id, parent) = client_ids(1);
    let body = json!({"model": model, "messages": [{"role": "user", "content": unique_text(12)}], "max_tokens": 8, "temperature": 0});
    let r = c.http.post(c.url("/v1/chat/completions")).header("traceparent", format!("00-{trace_id}-{parent}-01")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let _: Value = r.json().await.unwrap();
    // On real vLLM, its own span is under the leg; the receiver then has both services'.
    let worker_span = |s: &[Received]| s.iter().any(|x| x.service != "kvgate");
    let spans = receiver.trace(&trace_id, ARRIVAL, |s| !named(s, "kvgate.request").is_empty() && (!real || worker_span(s))).await;
    let root = one(&spans, "kvgate.request");
    assert_eq!(root.parent_span_id, parent, "the request's span is a child of the client's");
    assert_eq!(root.service, "kvgate");
    assert_eq!(root.attributes["gen_ai.request.model"], json!(model));
    assert_eq!(root.attributes["http.response.status_code"], json!(200));
    for phase in ["kvgate.admit", "kvgate.place", "kvgate.leg"] {
        assert_eq!(one(&spans, phase).parent_span_id, root.span_id, "{phase} is under the request's span");
    }
    let place = one(&spans, "kvgate.place");
    let leg = one(&spans, "kvgate.leg");
    assert_eq!(place.attributes["kvgate.worker"], leg.attributes["server.address"], "the leg goes where the placement chose");
    assert_eq!(leg.attributes["kvgate.leg"], json!("attempt"));
    if real {
        let vllm: Vec<&Received> = spans.iter().filter(|s| s.service != "kvgate").collect();
        assert!(!vllm.is_empty(), "vLLM's spans arrived under the same trace: {spans:#?}");
        assert!(vllm.iter().any(|s| s.parent_span_id == leg.span_id), "vLLM's span is a child of kvgate's leg: {vllm:#?} leg {leg:?}");
    }
}

#[tokio::test]
async fn a_moved_stream_shows_both_legs_and_the_move() {
    if std::env::var("KVGATE_TARGET_URL").is_ok() {
        eprintln!("one real vLLM: moves are traced on the simulators");
    }
    let receiver = Receiver::start().await;
    let extra = tracing_yaml(&receiver, 1.0);
    let c = Cluster::sims(2, test_sim_config(), GatewayOpts { extra, ..GatewayOpts::default() }).await;
    let (trace_id, parent) = client_ids(2);
    let body = json!({"model": "sim-model", "prompt": unique_text(20), "max_tokens": 48, "temperature": 0, "ignore_eos": true, "stream": true});
    let r = c
        .http
        .post(c.url("/v1/completions"))
        .header("x-request-id", "traced-move")
        .header("traceparent", format!("00-{trace_id}-{parent}-01"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut raw = Vec::new();
    let mut s = r.bytes_stream();
    let mut moved = None;
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("the stream is never cut"));
        if moved.is_none() && raw.windows(2).filter(|w| w == b"\n\n").count() >= 4 {
            let a = c.http.post(c.admin("/migrate")).json(&json!({"request_id": "traced-move"})).send().await.unwrap();
            moved = Some(a.status().as_u16());
        }
    }
    assert_eq!(moved, Some(200), "the stream moved");
    assert!(String::from_utf8(raw).unwrap().contains("[DONE]"));
    let spans = receiver.trace(&trace_id, ARRIVAL, |s| !named(s, "kvgate.request").is_empty()).await;
    let root = one(&spans, "kvgate.request");
    let legs = named(&spans, "kvgate.leg");
    assert_eq!(legs.len(), 2, "both legs: {spans:#?}");
    let mut kinds: Vec<String> = legs.iter().map(|l| l.attributes["kvgate.leg"].as_str().unwrap_or_default().to_string()).collect();
    kinds.sort();
    assert_eq!(kinds, ["attempt", "continuation"]);
    assert_ne!(legs[0].attributes["server.address"], legs[1].attributes["server.address"], "the legs ran on two workers");
    let mv = one(&spans, "kvgate.move");
    for s in legs.iter().copied().chain([mv]) {
        assert_eq!(s.parent_span_id, root.span_id);
    }
    assert_eq!(mv.attributes["kvgate.move.how"], json!("admin"));
}

#[tokio::test]
async fn sampling_follows_the_ratio_and_the_clients_decision() {
    let receiver = Receiver::start().await;
    if receiver.is_shared() {
        eprintln!("the suite's receiver is shared: sampling is checked on the simulators' run");
        return;
    }
    let (c, model, _) = gateway(&receiver, 0.0).await;
    let body = json!({"model": model, "prompt": unique_text(8), "max_tokens": 4});
    // Unsampled by the ratio: no span; sampled by the client: traced all the same.
    let (unsampled, _) = client_ids(3);
    let (sampled, parent) = client_ids(4);
    let r = c.http.post(c.url("/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = c.http.post(c.url("/v1/completions")).header("traceparent", format!("00-{unsampled}-{parent}-00")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = c.http.post(c.url("/v1/completions")).header("traceparent", format!("00-{sampled}-{parent}-01")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let spans = receiver.trace(&sampled, ARRIVAL, |s| !named(s, "kvgate.request").is_empty()).await;
    assert_eq!(one(&spans, "kvgate.request").parent_span_id, parent);
    assert!(receiver.spans().iter().all(|s| s.trace_id == sampled), "only the client-sampled request was traced: {:#?}", receiver.spans());
}
