//! Prefill/decode disaggregation end to end: kvgate in front of vllm-sim prefill workers
//! (`kv_producer`) and decode workers (`kv_consumer`) speaking vLLM's `kv_transfer_params`
//! protocol, and in front of two real vLLM servers sharing KV through vLLM's `ExampleConnector`
//! (when the real-vLLM suite names them).

use super::test_sim_config;
use kvgate_tests::cluster::{Cluster, GatewayOpts, WorkerEntry, gateway_yaml_workers, wait_until};
use kvgate_tests::sse;
use kvgate_tests::target::unique_text;
use serde_json::{Value, json};
use std::time::Duration;
use vllm_sim::config::KvTransferConfig;
use vllm_sim::{SimConfig, SimServer};

/// A sim with a NIXL connector in `role` (none: an aggregated worker).
fn sim_as(role: Option<&str>) -> SimConfig {
    let kv_transfer = match role {
        Some(r) => KvTransferConfig::parse(&json!({"kv_connector": "NixlConnector", "kv_role": r}).to_string()).expect("valid"),
        None => KvTransferConfig::default(),
    };
    SimConfig { time_scale: 20.0, kv_transfer, ..test_sim_config() }
}

/// The gateway config's YAML with `roles[i]` set on worker `i` (None: the default, both).
fn with_roles(yaml: String, urls: &[String], roles: &[Option<&str>]) -> String {
    urls.iter().zip(roles).fold(yaml, |y, (u, r)| match r {
        Some(r) => y.replace(&format!("      - url: {u}\n"), &format!("      - url: {u}\n        role: {r}\n")),
        None => y,
    })
}

/// Sims made from `configs` behind a kv-routing gateway subscribed to their events, worker `i`
/// in `roles[i]`; `model_extra` goes into the model's section.
async fn fleet(configs: Vec<SimConfig>, roles: &[Option<&str>], model_extra: &str) -> Cluster {
    fleet_routed("kv", configs, roles, model_extra).await
}

/// [`fleet`] with routing mode `mode`.
async fn fleet_routed(mode: &str, configs: Vec<SimConfig>, roles: &[Option<&str>], model_extra: &str) -> Cluster {
    let mut sims = Vec::new();
    for cfg in configs {
        sims.push(SimServer::start(cfg).await.expect("sim starts"));
    }
    let entries: Vec<WorkerEntry> = sims
        .iter()
        .map(|s| WorkerEntry { url: s.url(), kv_events: s.kv_event_endpoints().into_iter().next(), replay: s.replay_endpoints().into_iter().next() })
        .collect();
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let opts = GatewayOpts { mode: mode.into(), model_extra: model_extra.into(), ..GatewayOpts::default() };
    let mut c = Cluster::front_yaml(with_roles(gateway_yaml_workers(&entries, &opts), &urls, roles)).await;
    c.sims = sims;
    c
}

/// Posts `body` to `url`; a stream's content is the text of its events' choices.
async fn ask(http: &reqwest::Client, url: &str, body: &Value) -> (u16, String, Option<String>) {
    let r = http.post(url).json(body).send().await.expect("sent");
    let status = r.status().as_u16();
    let worker = r.headers().get("x-kvgate-worker").map(|v| v.to_str().unwrap_or("").to_string());
    let text = r.text().await.expect("body");
    if body["stream"] == true && status == 200 {
        let e = sse::parse(&text).essence();
        return (status, e["text"].as_str().unwrap_or_default().to_string(), worker);
    }
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let c = &v["choices"][0];
    (status, c["message"]["content"].as_str().or(c["text"].as_str()).unwrap_or_default().to_string(), worker)
}

fn source(m: &kvgate_tests::prom::Metrics, source: &str) -> f64 {
    m.sum("vllm:prompt_tokens_by_source_total", &[("source", source)])
}

#[tokio::test]
async fn two_legs_give_the_aggregated_answer_with_the_prompt_transferred() {
    let roles = [Some("prefill"), Some("prefill"), Some("decode"), Some("decode")];
    let configs = vec![sim_as(Some("kv_producer")), sim_as(Some("kv_producer")), sim_as(Some("kv_consumer")), sim_as(Some("kv_consumer"))];
    let c = fleet(configs, &roles, "").await;
    let reference = SimServer::start(sim_as(None)).await.expect("sim starts");
    let decode_urls: Vec<String> = c.sims[2..].iter().map(|s| s.url()).collect();
    let mut asked = 0;
    for (path, stream) in [("/v1/chat/completions", false), ("/v1/chat/completions", true), ("/v1/completions", false), ("/v1/completions", true)] {
        let text = unique_text(300);
        let mut body = if path.ends_with("chat/completions") {
            json!({"model": "sim-model", "messages": [{"role": "user", "content": text}], "max_tokens": 24, "stream": stream})
        } else {
            json!({"model": "sim-model", "prompt": text, "max_tokens": 24, "stream": stream})
        };
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let want = ask(&c.http, &format!("{}{path}", reference.url()), &body).await;
        let got = ask(&c.http, &c.url(path), &body).await;
        asked += 1;
        assert_eq!((got.0, &got.1), (200, &want.1), "{path} stream={stream}: the same answer as aggregated serving");
        assert!(got.2.as_ref().is_some_and(|w| decode_urls.contains(w)), "answered by a decode worker: {:?}", got.2);
    }
    let prefill: f64 = futures_util::future::join_all((0..2).map(|i| c.sim_metrics(i))).await.iter().map(|m| source(m, "local_compute")).sum();
    let decode = futures_util::future::join_all((2..4).map(|i| c.sim_metrics(i))).await;
    let transferred: f64 = decode.iter().map(|m| source(m, "external_kv_transfer")).sum();
    let computed: f64 = decode.iter().map(|m| source(m, "local_compute")).sum();
    assert!(prefill >= 4.0 * 300.0, "the prefill workers computed the prompts: {prefill}");
    assert!(transferred >= 4.0 * 280.0, "the decode workers received the prompts: {transferred}");
    assert!(computed <= 4.0 * 16.0, "and computed at most a partial block each: {computed}");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_disagg_requests_total", &[("path", "disaggregated")]), f64::from(asked));
    assert_eq!(m.sum("kvgate_disagg_prefill_leg_seconds_count", &[]), f64::from(asked));
    assert_eq!(m.sum("kvgate_disagg_decode_first_token_seconds_count", &[]), 2.0, "one per stream");
    for role in ["prefill", "decode"] {
        assert_eq!(m.sum("kvgate_disagg_decisions_total", &[("role", role)]), f64::from(asked), "{role} decisions");
    }
    let workers: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
    let shown: Vec<&str> = workers["models"][0]["workers"].as_array().unwrap().iter().filter_map(|w| w["role"].as_str()).collect();
    assert_eq!(shown, ["prefill", "prefill", "decode", "decode"], "GET /workers shows the roles");
    // The prefill workers hold nothing once the decode workers pulled.
    for i in 0..2 {
        let held = wait_until(Duration::from_secs(5), || async { c.sim_metrics(i).await.sum("vllm:kv_cache_usage_perc", &[]) == 0.0 }).await;
        assert!(held.is_some(), "prefill worker {i} freed the transferred blocks");
    }
}

#[tokio::test]
async fn a_client_leaving_during_the_prefill_leg_cancels_it_and_no_decode_leg_starts() {
    // A slow prefill (3 ms per token, unscaled) in chunks of 8 tokens, so that it runs for
    // seconds in engine steps of about 25 ms (an abort takes effect between steps, as in
    // vLLM): the client leaves while it runs.
    let slow = |role| {
        let mut s = sim_as(Some(role));
        s.time_scale = 1.0;
        s.timing.prefill_ms_per_token = 3.0;
        s.max_num_batched_tokens = 8;
        s.max_num_seqs = 8;
        s
    };
    let c = fleet(vec![slow("kv_producer"), slow("kv_consumer")], &[Some("prefill"), Some("decode")], "").await;
    // Each try: the client leaves mid-prefill and the prefill worker must have aborted it
    // within a second (its prefill takes 1.5 s), within 100 ms in at least one of three tries:
    // the time measured includes the sim's step (up to 25 ms) and the polling of its metrics,
    // which a loaded 2-core machine can delay in any one try.
    let mut times = Vec::new();
    for _ in 0..3 {
        let body = json!({"model": "sim-model", "prompt": unique_text(500), "max_tokens": 8, "stream": true});
        let client = tokio::spawn(c.http.post(c.url("/v1/completions")).json(&body).send());
        let running = wait_until(Duration::from_secs(5), || async { c.sim_metrics(0).await.sum("vllm:num_requests_running", &[]) >= 1.0 }).await;
        assert!(running.is_some(), "the prefill leg runs");
        client.abort();
        let left = std::time::Instant::now();
        let stopped = wait_until(Duration::from_secs(1), || async { c.sim_metrics(0).await.sum("vllm:num_requests_running", &[]) == 0.0 }).await;
        times.push(left.elapsed());
        assert!(stopped.is_some(), "the prefill leg was aborted");
        if times.last().is_some_and(|t| *t < Duration::from_millis(100)) {
            break;
        }
    }
    eprintln!("the prefill leg ended {times:?} after the client left");
    assert!(times.iter().any(|t| *t < Duration::from_millis(100)), "within 100 ms: {times:?}");
    let tries = times.len() as f64;
    // Had they not been aborted, they would have finished meanwhile; no decode leg started.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(c.sim_metrics(0).await.sum("vllm:request_success_total", &[]), 0.0, "no prefill leg finished");
    assert_eq!(c.sim_metrics(1).await.sum("vllm:prompt_tokens_total", &[]), 0.0, "no decode leg started");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_frontend_model_cancellation_total", &[]), tries);
    assert_eq!(m.sum("kvgate_disagg_requests_total", &[]), 0.0, "a cancelled request ran neither way");
}

#[tokio::test]
async fn fallbacks_serve_aggregated_on_a_decode_worker_and_are_counted() {
    let mut failing = sim_as(Some("kv_producer"));
    failing.faults.error_rate = 1.0;
    let roles = [Some("prefill"), Some("decode")];
    let c = fleet(vec![failing, sim_as(Some("kv_consumer"))], &roles, "disaggregation:\n  min_prefill_tokens: 100\n").await;
    let decode = c.sims[1].url();
    let ask_with = |prompt: String| json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4});
    // Short: aggregated at once.
    let (s, _, w) = ask(&c.http, &c.url("/v1/completions"), &ask_with("a short one".into())).await;
    assert_eq!((s, w.as_deref()), (200, Some(decode.as_str())));
    // Long, but the prefill worker fails: aggregated after it.
    let (s, _, w) = ask(&c.http, &c.url("/v1/completions"), &ask_with(unique_text(400))).await;
    assert_eq!((s, w.as_deref()), (200, Some(decode.as_str())));
    // Its own kv_transfer_params: the client runs the legs.
    let mut own = ask_with(unique_text(400));
    own["kv_transfer_params"] = json!({"do_remote_decode": false, "do_remote_prefill": false});
    assert_eq!(ask(&c.http, &c.url("/v1/completions"), &own).await.0, 200);
    // Several choices: the decode worker would not have the others' prefill.
    let mut two = ask_with(unique_text(400));
    two["n"] = json!(2);
    assert_eq!(ask(&c.http, &c.url("/v1/completions"), &two).await.0, 200);
    // Another endpoint.
    let (s, _, _) = ask(&c.http, &c.url("/v1/responses"), &json!({"model": "sim-model", "input": unique_text(400), "max_output_tokens": 4})).await;
    assert_eq!(s, 200);
    let m = c.gateway_metrics().await;
    let reason = |r| m.sum("kvgate_disagg_requests_total", &[("path", "aggregated"), ("reason", r)]);
    assert_eq!((reason("short_prompt"), reason("prefill_failed"), reason("client_params"), reason("endpoint"), reason("fields")), (1.0, 1.0, 1.0, 1.0, 1.0));
    // No prefill worker: it is taken out of the fleet.
    c.sims[0].crash();
    let out = wait_until(Duration::from_secs(5), || async { c.gateway_metrics().await.sum("kvgate_worker_healthy", &[]) == 1.0 }).await;
    assert!(out.is_some(), "the prefill worker is seen down");
    let (s, _, w) = ask(&c.http, &c.url("/v1/completions"), &ask_with(unique_text(400))).await;
    assert_eq!((s, w.as_deref()), (200, Some(decode.as_str())));
    assert_eq!(c.gateway_metrics().await.sum("kvgate_disagg_requests_total", &[("reason", "no_prefill_worker")]), 1.0);
}

/// Real vLLM: two servers started with vLLM's `ExampleConnector` (shared storage; NIXL is not
/// installed here), named by `KVGATE_PD_URLS` (prefill,decode) in the real-vLLM suite. The
/// connector matches prompts by content and returns no parameters: the decode server loads what
/// the prefill server stored, and its `external_kv_transfer` tokens show it.
#[tokio::test]
async fn real_vllm_two_legs_through_a_cpu_kv_connector() {
    let Ok(urls) = std::env::var("KVGATE_PD_URLS") else { return };
    let urls: Vec<String> = urls.split(',').map(str::to_string).collect();
    let model = std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into());
    let entries: Vec<WorkerEntry> = urls.iter().map(|u| WorkerEntry { url: u.clone(), kv_events: None, replay: None }).collect();
    let opts = GatewayOpts { mode: "round_robin".into(), ..GatewayOpts::real_vllm(&model) };
    let c = Cluster::front_yaml(with_roles(gateway_yaml_workers(&entries, &opts), &urls, &[Some("prefill"), Some("decode")])).await;
    let metrics = |u: String| {
        let http = c.http.clone();
        async move { kvgate_tests::prom::Metrics::parse(&http.get(format!("{u}/metrics")).send().await.expect("up").text().await.expect("text")) }
    };
    for (path, stream) in [("/v1/chat/completions", false), ("/v1/chat/completions", true), ("/v1/completions", true)] {
        let mut body = transferable(&c.http, &urls[1], &model, path, stream).await;
        let before = source(&metrics(urls[1].clone()).await, "external_kv_transfer");
        let got = ask(&c.http, &c.url(path), &body).await;
        assert_eq!(got.0, 200, "{path}: {got:?}");
        assert_eq!(got.2.as_deref(), Some(urls[1].as_str()), "answered by the decode server");
        // vLLM counts a request's prompt sources a little after its answer.
        let loaded = wait_until(Duration::from_secs(10), || async { source(&metrics(urls[1].clone()).await, "external_kv_transfer") - before >= 64.0 }).await;
        assert!(loaded.is_some(), "{path}: the decode server loaded the prompt's KV (external_kv_transfer was {before})");
        // The same request served aggregated by the prefill server (its prefix cache holds the
        // KV it computed and stored) answers the same tokens.
        body["stream"] = json!(false);
        let want = ask(&c.http, &format!("{}{path}", urls[0]), &body).await;
        assert_eq!(got.1, want.1, "{path} stream={stream}: the same answer as aggregated serving");
    }
    assert_eq!(c.gateway_metrics().await.sum("kvgate_disagg_requests_total", &[("path", "disaggregated")]), 3.0);
}

/// A request `ExampleConnector` transfers: its prompt is not one token past a whole number of
/// 32-token blocks (the connector stores `(n - 1) / 32` blocks and looks up `(n - 2) / 32`, so
/// such a prompt is stored but never found). Counted by the server's own `/tokenize`.
async fn transferable(http: &reqwest::Client, server: &str, model: &str, path: &str, stream: bool) -> Value {
    let mut text = unique_text(220);
    loop {
        let (body, probe) = if path.ends_with("chat/completions") {
            let messages = json!([{"role": "user", "content": text}]);
            (json!({"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, "stream": stream}), json!({"model": model, "messages": messages}))
        } else {
            (json!({"model": model, "prompt": text, "max_tokens": 12, "temperature": 0, "stream": stream}), json!({"model": model, "prompt": text}))
        };
        let counted: Value = http.post(format!("{server}/tokenize")).json(&probe).send().await.expect("tokenize").json().await.expect("json");
        if counted["count"].as_u64().is_some_and(|n| n % 32 != 1) {
            return body;
        }
        text.push_str(" cache");
    }
}

#[tokio::test]
async fn every_prefill_worker_busy_runs_the_request_aggregated_instead_of_refusing_it() {
    // One prefill worker, busy once it holds any prefill (its own thresholds); a slow prefill
    // keeps the first request there while the second arrives.
    let mut slow = sim_as(Some("kv_producer"));
    slow.time_scale = 1.0;
    slow.timing.prefill_ms_per_token = 6.0;
    let extra = "disaggregation:\n  prefill_shedding: {active_prefill_tokens_threshold: 0}\n";
    let c = fleet(vec![slow, sim_as(Some("kv_consumer"))], &[Some("prefill"), Some("decode")], extra).await;
    let body = |t: String| json!({"model": "sim-model", "prompt": t, "max_tokens": 4});
    let first = tokio::spawn({
        let (http, url, b) = (c.http.clone(), c.url("/v1/completions"), body(unique_text(300)));
        async move { http.post(url).json(&b).send().await.map(|r| r.status().as_u16()) }
    });
    let booked = wait_until(Duration::from_secs(5), || async {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        v["models"][0]["workers"][0]["booked_prefill_tokens"].as_u64().unwrap_or(0) > 0
    })
    .await;
    assert!(booked.is_some(), "the first request's prefill is booked");
    let (s, _, w) = ask(&c.http, &c.url("/v1/completions"), &body(unique_text(300))).await;
    assert_eq!((s, w.as_deref()), (200, Some(c.sims[1].url().as_str())), "served aggregated by the decode worker, not refused");
    assert_eq!(first.await.unwrap().unwrap(), 200);
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_disagg_requests_total", &[("reason", "prefill_busy")]), 1.0);
    assert_eq!(m.sum("kvgate_disagg_requests_total", &[("path", "disaggregated")]), 1.0);
    assert_eq!(m.sum("kvgate_frontend_model_rejection_total", &[]), 0.0, "no 503");
}

#[tokio::test]
async fn a_decode_worker_killed_mid_stream_hands_its_streams_to_another_decode_worker() {
    let slow = |role| SimConfig { time_scale: 1.0, ..sim_as(Some(role)) };
    let roles = [Some("prefill"), Some("decode"), Some("decode")];
    let c = fleet(vec![slow("kv_producer"), slow("kv_consumer"), slow("kv_consumer")], &roles, "").await;
    let reference = SimServer::start(SimConfig { time_scale: 20.0, ..sim_as(None) }).await.expect("sim starts");
    let bodies: Vec<Value> = (0..6)
        .map(|i| json!({"model": "sim-model", "prompt": format!("pd failover {i} {}", unique_text(40)), "max_tokens": 40, "ignore_eos": true, "stream": true}))
        .collect();
    let mut want = Vec::new();
    for b in &bodies {
        want.push(ask(&c.http, &format!("{}/v1/completions", reference.url()), b).await);
    }
    let running: Vec<_> = bodies
        .iter()
        .map(|b| {
            let (http, url, b) = (c.http.clone(), c.url("/v1/completions"), b.clone());
            tokio::spawn(async move { ask(&http, &url, &b).await })
        })
        .collect();
    // The decode worker carrying the most streams, once they stream.
    let victim = std::cell::Cell::new(None);
    wait_until(Duration::from_secs(10), || async {
        victim.set(c.busiest_streaming_sim(3).await);
        victim.get().is_some()
    })
    .await
    .expect("the streams are streaming");
    c.sims[victim.get().unwrap()].crash();
    for (i, h) in running.into_iter().enumerate() {
        let got = h.await.unwrap();
        assert_eq!((got.0, &got.1), (200, &want[i].1), "stream {i} is whole and as aggregated serving gives it");
    }
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_migrations_total", &[("reason", "failover"), ("outcome", "ok")]) >= 1.0, "streams moved");
    assert_eq!(m.sum("kvgate_migrations_total", &[("outcome", "failed")]), 0.0);
    // The prefill worker saw each request's prefill leg and nothing else: no continuation.
    let p = c.sim_metrics(0).await;
    assert_eq!(p.sum("vllm:request_success_total", &[]), bodies.len() as f64, "one prefill leg per request");
}

#[tokio::test]
async fn a_decode_leg_resent_elsewhere_goes_without_the_spent_transfer_parameters() {
    // The first decode worker fails every request (a 500 before any byte): the retry goes to
    // the second, whose connector fails a pull rather than recompute, and must get the
    // client's own request, computed there, not parameters a first decode worker may have
    // used up.
    let mut failing = sim_as(Some("kv_consumer"));
    failing.faults.error_rate = 1.0;
    let strict = |mut s: SimConfig| {
        s.kv_transfer.kv_load_failure_policy = "fail".into();
        s
    };
    let roles = [Some("prefill"), Some("decode"), Some("decode")];
    // Random placement: each request's decode leg goes to the failing worker first half the time.
    let c = fleet_routed("random", vec![sim_as(Some("kv_producer")), strict(failing), strict(sim_as(Some("kv_consumer")))], &roles, "").await;
    let reference = SimServer::start(sim_as(None)).await.expect("sim starts");
    let mut served = 0;
    while served < 16 && (served < 4 || c.gateway_metrics().await.sum("kvgate_retries_total", &[]) < 2.0) {
        let body = json!({"model": "sim-model", "prompt": unique_text(200), "max_tokens": 12, "stream": true});
        let want = ask(&c.http, &format!("{}/v1/completions", reference.url()), &body).await;
        let got = ask(&c.http, &c.url("/v1/completions"), &body).await;
        assert_eq!((got.0, &got.1, got.2.as_deref()), (200, &want.1, Some(c.sims[2].url().as_str())), "served whole by the healthy decode worker");
        served += 1;
    }
    let m = c.gateway_metrics().await;
    let retried = m.sum("kvgate_retries_total", &[]);
    assert!(retried >= 2.0, "some requests went to the failing decode worker first");
    let d = c.sim_metrics(2).await;
    assert!(source(&d, "local_compute") >= retried * 150.0, "the retried ones were computed on the second decode worker");
    assert_eq!(d.sum("vllm:request_success_total", &[("finished_reason", "error")]), 0.0, "no failed pull");
}

#[tokio::test]
async fn with_every_decode_worker_busy_no_prefill_leg_is_spent_on_a_refused_request() {
    // Busy once any KV is in use there: a long stream keeps the decode worker busy.
    let mut slow = sim_as(Some("kv_consumer"));
    slow.time_scale = 1.0;
    let extra = "shedding:\n  active_decode_blocks_threshold: 0.0\ndisaggregation:\n  prefill_shedding: {active_prefill_tokens_threshold: 100000}\n";
    let c = fleet(vec![sim_as(Some("kv_producer")), slow], &[Some("prefill"), Some("decode")], extra).await;
    let long = json!({"model": "sim-model", "prompt": unique_text(100), "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let first = c.http.post(c.url("/v1/completions")).json(&long).send().await.unwrap();
    assert_eq!(first.status().as_u16(), 200);
    let busy = wait_until(Duration::from_secs(5), || async {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        v["models"][0]["workers"][1]["booked_blocks"].as_u64().unwrap_or(0) > 0
    })
    .await;
    assert!(busy.is_some(), "the decode worker holds the stream's blocks");
    let (s, _, _) = ask(&c.http, &c.url("/v1/completions"), &json!({"model": "sim-model", "prompt": unique_text(100), "max_tokens": 4})).await;
    assert_eq!(s, 503, "seed 000's refusal");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_disagg_requests_total", &[("reason", "decode_busy")]), 1.0);
    assert_eq!(c.sim_metrics(0).await.sum("vllm:request_success_total", &[]), 1.0, "only the first request's prefill leg ran");
    drop(first);
}
