//! Moving running streams (docs/migration.md): a stream moved mid-way by
//! `POST /migrate` or by failover is identical to the same request unmoved (text, token ids,
//! finish, usage, one `[DONE]`), bookings return to 0, and requests that cannot move say why.
//!
//! The identity tests run on two in-process vllm-sim workers (deterministic: the next token is
//! a function of the context) and, under tests/real-vllm/run-suite.sh, on two real vLLM servers
//! (`KVGATE_TARGET_URL`, `KVGATE_TARGET_URL_2`; greedy sampling). The real-vLLM kill test runs
//! only when `KVGATE_TARGET_PID_2` names the second server's process group (the suite starts
//! each server in its own).

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

mod messages;
mod responses;

use futures_util::StreamExt;
use kvgate_tests::cluster::{Cluster, GatewayOpts, wait_until};
use kvgate_tests::sse;
use kvgate_tests::target::{test_sim_config, unique_text};
use serde_json::{Value, json};
use std::time::Duration;
use vllm_sim::SimConfig;

fn sim(time_scale: f64) -> SimConfig {
    SimConfig { time_scale, ..test_sim_config() }
}

/// Two workers: the real-vLLM pair when the environment names one, else two simulators.
async fn pair(opts: GatewayOpts) -> (Cluster, bool) {
    match (std::env::var("KVGATE_TARGET_URL"), std::env::var("KVGATE_TARGET_URL_2")) {
        (Ok(a), Ok(b)) => {
            let model = std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into());
            let real = GatewayOpts::real_vllm(&model);
            (Cluster::front(&[a, b], GatewayOpts { model, health_timeout: real.health_timeout, ..opts }).await, true)
        }
        _ => (Cluster::sims(2, sim(1.0), opts).await, false),
    }
}

/// What must be identical between a moved and an unmoved stream: what the client reassembles
/// (`SseBody::essence`) and the stream's object; every event carries the same id, created and
/// object.
fn essence(b: &sse::SseBody) -> Value {
    let first = b.events.first().map(|e| (e["id"].clone(), e["created"].clone(), e["object"].clone()));
    let (id, created, object) = first.unwrap_or_default();
    for e in &b.events {
        assert_eq!((&e["id"], &e["created"], &e["object"]), (&id, &created, &object), "one id, created and shape for the whole stream: {e}");
    }
    let mut v = b.essence();
    v["object"] = object;
    v
}

/// Streams `body` to `path` as request `id`, ordering a move after `after` events when given
/// (aimed at the other worker when `aim`, which warms it up first). Returns the parsed body and
/// the move's answer.
async fn run_aimed(c: &Cluster, path: &str, body: &Value, id: &str, after: Option<usize>, aim: bool) -> (sse::SseBody, Option<(u16, Value)>) {
    let r = c.http.post(c.url(path)).header("x-request-id", id).json(body).send().await.expect("sent");
    assert_eq!(r.status(), 200);
    let serving = r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let mut order = json!({"request_id": id});
    if aim {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        let other = v["models"][0]["workers"].as_array().unwrap().iter().map(|w| w["url"].as_str().unwrap().to_string()).find(|u| *u != serving);
        order["to"] = json!(other.expect("another worker"));
    }
    let mut raw = Vec::new();
    let mut s = r.bytes_stream();
    let mut answer = None;
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("the stream is never cut"));
        let events = raw.windows(2).filter(|w| w == b"\n\n").count();
        if answer.is_none() && after.is_some_and(|n| events >= n) {
            let r = c.http.post(c.admin("/migrate")).json(&order).send().await.unwrap();
            answer = Some((r.status().as_u16(), r.json::<Value>().await.unwrap()));
        }
    }
    (sse::parse(&String::from_utf8(raw).unwrap()), answer)
}

async fn run(c: &Cluster, path: &str, body: &Value, id: &str, after: Option<usize>) -> (sse::SseBody, Option<(u16, Value)>) {
    run_aimed(c, path, body, id, after, false).await
}

async fn bookings_are_zero(c: &Cluster) {
    let zero = wait_until(Duration::from_secs(5), || async {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        v["models"][0]["workers"].as_array().unwrap().iter().all(|w| w["in_flight"] == 0 && w["booked_prefill_tokens"] == 0 && w["booked_blocks"] == 0)
    })
    .await;
    assert!(zero.is_some(), "bookings return to 0");
}

/// A stream moved after a few events equals the unmoved one, for each request shape.
async fn moved_equals_unmoved(c: &Cluster, real: bool) {
    // The tiny real model makes 160 tokens in a quarter of a second: a stream that short may end
    // before the admin's order reaches it (rightly refused, 409 "the request ended"). An aimed
    // move also warms the destination first (a prefill there) while the stream goes on. So real
    // streams run long enough for both.
    let max = if real { 480 } else { 48 };
    // The warm-up is a prefill on the other server, which shares the 2 cores with this stream's:
    // seen to take up to 4 s there, while 1,500 tokens take about as long.
    let warmed_max = if real { 1900 } else { 48 };
    let cases = [
        ("/v1/completions", json!({"prompt": unique_text(40), "max_tokens": max, "temperature": 0, "ignore_eos": true, "stream": true})),
        (
            "/v1/completions",
            json!({"prompt": unique_text(40), "max_tokens": max, "temperature": 0, "ignore_eos": true, "stream": true,
                   "return_token_ids": true, "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": unique_text(30)}], "max_tokens": max, "temperature": 0, "ignore_eos": true,
                   "stream": true, "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": unique_text(30)}], "max_completion_tokens": max, "temperature": 0,
                   "ignore_eos": true, "stream": true, "return_token_ids": true}),
        ),
    ];
    let model = if real { std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into()) } else { "sim-model".into() };
    let mut moved_ok = 0;
    for (i, (path, mut body)) in cases.into_iter().enumerate() {
        body["model"] = json!(model);
        let max = if i % 2 == 1 { warmed_max } else { max };
        let key = if body.get("max_tokens").is_some() { "max_tokens" } else { "max_completion_tokens" };
        body[key] = json!(max);
        let (reference, _) = run(c, path, &body, &format!("ref-{i}"), None).await;
        // Odd cases name the destination, which is warmed up before the move.
        let (moved, answer) = run_aimed(c, path, &body, &format!("mv-{i}"), Some(4), i % 2 == 1).await;
        let (status, report) = answer.expect("the move was ordered");
        // On real vLLM the warm-up is a prefill on the other server, which shares 2 cores with
        // this stream's: it can outlast the stream, which then rightly ends where it is (409).
        // The stream must still be whole; the moved-stream checks need a move.
        if real && i % 2 == 1 && status == 409 && report.to_string().contains("warmed up") {
            eprintln!("{path} case {i}: the stream ended during the warm-up; not moved: {report}");
            assert_eq!(essence(&moved), essence(&reference), "{path} case {i}: unmoved, as the reference");
            continue;
        }
        moved_ok += 1;
        assert_eq!(status, 200, "{path} {report}");
        assert_eq!(report["how"], "continuation", "{report}");
        // `generated` counts the tokens whose text the client saw: a model that streams tokens
        // without text (pieces of one character, as real vLLM's tiny model may for a whole
        // stream) moves with none, and its ids are generated again. Text in the events seen
        // before the move was ordered means it moved mid-way.
        let text = |e: &Value| e["choices"][0]["text"].as_str().or_else(|| e["choices"][0]["delta"]["content"].as_str()).unwrap_or_default().is_empty();
        let had_text = moved.events.iter().take(4).any(|e| !text(e));
        if had_text && report["generated"].as_u64().unwrap_or(0) < 1 {
            // Seen once in CI (sims, chat with usage), not reproduced since: say all there is.
            let record: Value = c.http.get(c.admin(&format!("/requests/mv-{i}"))).send().await.unwrap().json().await.unwrap();
            panic!("moved mid-way: {report}\nrecord: {record}\nstream: {}", moved.raw);
        }
        assert_ne!(report["from"], report["to"]);
        let (want, got) = (essence(&reference), essence(&moved));
        assert_eq!(got, want, "{path} case {i}: moved vs unmoved");
        let ids = got["ids"].as_array().map_or(0, Vec::len);
        if body.get("return_token_ids").is_some() {
            assert_eq!(ids, usize::try_from(max).unwrap(), "every token id, once");
        } else {
            assert_eq!(ids, 0, "no ids the client did not ask for: {}", moved.raw);
            assert!(!moved.raw.contains("prompt_token_ids"), "{}", moved.raw);
        }
        if body.get("stream_options").is_some() {
            assert_eq!(got["usage"]["completion_tokens"], max, "{got}");
        }
        // The record is written just after the last byte went out.
        let finished = || async {
            let v: Value = c.http.get(c.admin(&format!("/requests/mv-{i}"))).send().await.unwrap().json().await.unwrap();
            (v["status"] == 200).then_some(v)
        };
        wait_until(Duration::from_secs(2), || async { finished().await.is_some() }).await.expect("recorded as finished");
        let v = finished().await.unwrap();
        assert_eq!(v["moves"], 1, "{v}");
        assert_eq!(v["route_receipt"].as_array().map(Vec::len), Some(2), "two placements: {v}");
    }
    bookings_are_zero(c).await;
    let m = c.gateway_metrics().await;
    assert!(moved_ok >= 2, "the unaimed moves happen everywhere");
    assert_eq!(m.sum("kvgate_migrations_total", &[("reason", "admin"), ("outcome", "ok")]), f64::from(moved_ok));
    assert!(m.has("kvgate_migration_pause_seconds_count"));
}

#[tokio::test]
async fn a_stream_moved_by_the_admin_is_identical_to_the_unmoved_one() {
    let (c, real) = pair(GatewayOpts::default()).await;
    moved_equals_unmoved(&c, real).await;
}

#[tokio::test]
async fn moves_that_cannot_happen_say_why() {
    let c = Cluster::sims(2, sim(1.0), GatewayOpts::default()).await;
    let migrate = |body: Value| {
        let (http, url) = (c.http.clone(), c.admin("/migrate"));
        async move {
            let r = http.post(url).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (s, v) = migrate(json!({"request_id": "nobody"})).await;
    assert_eq!(s, 404, "{v}");
    let (s, v) = migrate(json!({"id": "x"})).await;
    assert_eq!(s, 400, "{v}");
    // A stream with two choices is pinned, and says so.
    let r = c
        .http
        .post(c.url("/v1/completions"))
        .header("x-request-id", "two")
        .json(&json!({"prompt": "hi", "n": 2, "max_tokens": 40, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut s2 = r.bytes_stream();
    s2.next().await.unwrap().unwrap();
    let (s, v) = migrate(json!({"request_id": "two"})).await;
    assert_eq!(s, 409, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("pinned to its worker: n"), "{v}");
    let (s, v) = migrate(json!({"request_id": "two", "to": "http://127.0.0.1:1"})).await;
    assert!(s == 409 || s == 400, "{v}");
    while s2.next().await.is_some() {}
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_migration_pinned_total", &[("reason", "n")]), 1.0);
    // A finished request cannot move.
    let (s, v) = migrate(json!({"request_id": "two"})).await;
    assert_eq!(s, 409, "{v}");
}

/// Streams `bodies` at once; returns their essences in order.
fn streams(c: &Cluster, bodies: &[Value]) -> Vec<tokio::task::JoinHandle<Value>> {
    bodies
        .iter()
        .map(|body| {
            let (http, url, body) = (c.http.clone(), c.url("/v1/completions"), body.clone());
            tokio::spawn(async move {
                let (status, _, b) = sse::stream(&http, &url, &body).await;
                assert_eq!(status, 200);
                essence(&b)
            })
        })
        .collect()
}

#[tokio::test]
async fn a_worker_killed_mid_stream_loses_no_stream() {
    let opts = GatewayOpts { mode: "kv".into(), ..GatewayOpts::default() };
    let c = Cluster::sims_with_events(4, sim(1.0), opts).await;
    // The same requests undisturbed first (the simulators are deterministic), then again with
    // the worker carrying most of them killed while they stream.
    let bodies: Vec<Value> = (0..16)
        .map(|i| {
            json!({"prompt": format!("failover {i} {}", unique_text(20)), "max_tokens": 40, "ignore_eos": true, "stream": true, "temperature": 0,
                   "stream_options": {"include_usage": true}})
        })
        .collect();
    let mut want = Vec::new();
    for h in streams(&c, &bodies) {
        want.push(h.await.unwrap());
    }
    let running = streams(&c, &bodies);
    // The victim is the worker carrying the most of the second run's streams once half of them
    // stream (the first run's token counts cannot tell that: they include its own tokens; half,
    // so a slow machine where the first streams end before the last start still gets there).
    let victim = std::cell::Cell::new(None);
    wait_until(Duration::from_secs(5), || async {
        victim.set(c.busiest_streaming_sim(bodies.len() / 2).await);
        victim.get().is_some()
    })
    .await
    .expect("the streams are streaming");
    c.sims[victim.get().unwrap()].crash();
    for (i, h) in running.into_iter().enumerate() {
        assert_eq!(h.await.unwrap(), want[i], "stream {i} is identical to the undisturbed run");
    }
    bookings_are_zero(&c).await;
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_migrations_total", &[("reason", "failover"), ("outcome", "ok")]) >= 1.0, "streams moved");
    assert_eq!(m.sum("kvgate_migrations_total", &[("outcome", "failed")]), 0.0);
}

#[tokio::test]
async fn with_migration_off_a_dying_worker_cuts_its_streams() {
    let opts = GatewayOpts { extra: "migration:\n  limit: 0\n".into(), ..GatewayOpts::default() };
    let c = Cluster::sims(1, sim(1.0), opts).await;
    let r = c.http.post(c.url("/v1/completions")).json(&json!({"prompt": "hi", "max_tokens": 200, "ignore_eos": true, "stream": true})).send().await.unwrap();
    let mut s = r.bytes_stream();
    s.next().await.unwrap().unwrap();
    c.sims[0].crash();
    let mut cut = false;
    while let Some(chunk) = s.next().await {
        if chunk.is_err() {
            cut = true;
        }
    }
    assert!(cut, "the client sees an error, not a clean end");
}

#[tokio::test]
async fn a_real_vllm_server_killed_mid_stream_loses_no_stream() {
    let (Ok(pid), Ok(second)) = (std::env::var("KVGATE_TARGET_PID_2"), std::env::var("KVGATE_TARGET_URL_2")) else {
        eprintln!("KVGATE_TARGET_PID_2 not set: the real-vLLM kill test runs under tests/real-vllm/run-suite.sh");
        return;
    };
    let (first, model) = (std::env::var("KVGATE_TARGET_URL").expect("a pair"), std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into()));
    // The gateway starts with the second server only, so that all three streams run there; the
    // first joins (a reload) while they stream. (With both from the start, round robin over
    // streams sent together could put two of one API on the server killed.)
    let opts = GatewayOpts::real_vllm(&model);
    let c = Cluster::front(std::slice::from_ref(&second), opts.clone()).await;
    responses::cards_read(&c, &model).await;
    // A completion, a Messages and a Responses stream, each 3,900 tokens (over ten seconds on
    // CPU), so all still stream when the server is killed. Messages and Responses have no
    // `ignore_eos`: a prompt is kept only if its unmoved stream runs to its token limit (some
    // end early, and a stream that ended before the kill proves nothing).
    let mut kill = KillRun { c: &c, bodies: Vec::new(), want: Vec::new() };
    for i in 0..3 {
        kill.add_long_stream(&model, i).await;
    }
    // Kill once the gateway shows all three generating. Should this machine stall the gateway
    // or the test for the whole window (seen for up to 17 s before run.sh pinned vLLM to its own
    // cores), the streams end whole, unkilled, and the test tries again, up to three times.
    let mut tries = 0;
    let handles = loop {
        tries += 1;
        let (handles, streaming) = kill.all_streaming(&first, &second, &opts, tries).await;
        if streaming.is_ok() {
            break handles;
        }
        for (i, h) in handles {
            assert_eq!(whole(h.await.unwrap()), whole(kill.want[i].clone()), "stream {i} ({}), unkilled", kill.bodies[i].0);
        }
        assert!(tries < 3, "the second server's three streams were never seen running together: {}", streaming.unwrap_err());
    };
    // The whole server dies, as when its machine does: its process group, engine core and
    // worker included. Killing only the API server leaves its engine finishing the three
    // streams for nobody, a core busy for the tests after this one.
    let killed = std::process::Command::new("kill").args(["-9", "--", &format!("-{pid}")]).status().unwrap();
    assert!(killed.success());
    for (i, h) in handles {
        let got = h.await.unwrap();
        // Reported, not asserted (see `whole`): how often the text stays identical too.
        eprintln!("kill test: stream {i} ({}) text identical to unmoved: {}", kill.bodies[i].0, got == kill.want[i]);
        assert_eq!(whole(got), whole(kill.want[i].clone()), "stream {i} ({})", kill.bodies[i].0);
    }
    // Each continued on the first server: a second placement.
    for i in 0..3 {
        let v: Value = c.http.get(c.admin(&format!("/requests/kill-{tries}-{i}"))).send().await.unwrap().json().await.unwrap();
        let legs = v["route_receipt"].as_array().cloned().unwrap_or_default();
        let url = |l: &Value| l["chosen"]["url"].as_str().unwrap_or_default().to_string();
        assert!(legs.len() >= 2 && same_url(&url(&legs[0]), &second) && !same_url(&url(&legs[1]), &second), "stream {i} ({}) moved: {v}", kill.bodies[i].0);
    }
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_migrations_total", &[("reason", "failover"), ("outcome", "ok")]) >= 3.0);
    bookings_are_zero(&c).await;
}

fn same_url(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

/// What must match between a stream killed mid-way and the same stream unmoved when both are
/// this long: everything but the text (`text` → whether there was any, token ids → how many).
/// Real vLLM's greedy output is not batch-invariant: over thousands of near-random tokens
/// (the tiny model), a stream run beside others can pick another token than the same stream
/// run alone, moved or not. Exact identity is shown on vllm-sim and on shorter real streams.
fn whole(mut v: Value) -> Value {
    match &mut v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                *x = match (k.as_str(), &*x) {
                    ("text", Value::String(t)) => json!(!t.is_empty()),
                    ("ids", Value::Array(a)) => json!(a.len()),
                    _ => whole(x.take()),
                };
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| *x = whole(x.take())),
        _ => {}
    }
    v
}

/// Each kill-test stream's length: most of the real servers' `--max-model-len` (4,096).
const KILL_TOKENS: u32 = 3900;

/// The kill test's streams: each body and its unmoved outcome.
struct KillRun<'a> {
    c: &'a Cluster,
    bodies: Vec<(&'static str, Value)>,
    want: Vec<Value>,
}

impl KillRun<'_> {
    /// Adds stream `i` (0: completions, 1: Messages, 2: Responses), trying prompts until its
    /// unmoved run reaches the token limit.
    async fn add_long_stream(&mut self, model: &str, i: usize) {
        for attempt in 0..8 {
            let prompt = format!("kill {i} {attempt} {}", unique_text(12));
            let body = match i {
                0 => (
                    "/v1/completions",
                    json!({"model": model, "prompt": prompt, "max_tokens": KILL_TOKENS, "temperature": 0, "ignore_eos": true,
                       "stream": true, "return_token_ids": true, "stream_options": {"include_usage": true}}),
                ),
                1 => (
                    "/v1/messages",
                    json!({"model": model, "max_tokens": KILL_TOKENS, "temperature": 0, "stream": true, "system": "Be brief.",
                       "messages": [{"role": "user", "content": prompt}]}),
                ),
                _ => (
                    "/v1/responses",
                    json!({"model": model, "max_output_tokens": KILL_TOKENS, "temperature": 0, "stream": true, "store": false,
                       "instructions": "Be brief.", "input": prompt}),
                ),
            };
            self.bodies.push(body);
            let want = self.run(i, format!("ref-{i}-{attempt}")).await;
            let full = want["end"]["delta"]["stop_reason"] == "max_tokens" || want["status"] == "incomplete" || i == 0;
            if full {
                self.want.push(want);
                return;
            }
            self.bodies.pop();
        }
        panic!("no prompt of 8 made stream {i} run to its token limit");
    }

    /// Try `t`: starts the three streams on the second server (the gateway's only worker),
    /// adds the first, and waits until the gateway shows all three generating (`Err`: the last
    /// registry seen, once they ended first).
    async fn all_streaming(
        &self,
        first: &str,
        second: &str,
        opts: &GatewayOpts,
        t: usize,
    ) -> (Vec<(usize, tokio::task::JoinHandle<Value>)>, Result<(), Value>) {
        let c = self.c;
        let reload = |urls: Vec<String>| async move {
            std::fs::write(&c.config_path, kvgate_tests::cluster::gateway_yaml(&urls, opts)).unwrap();
            // Applied now, not when the file watch notices (seconds on a loaded machine).
            let r = c.http.post(c.admin("/reload")).send().await.unwrap();
            assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
            workers_listed(c, urls.len()).await;
        };
        if t > 1 {
            reload(vec![second.to_string()]).await;
        }
        let handles: Vec<_> = (0..3).map(|i| (i, tokio::spawn(self.run(i, format!("kill-{t}-{i}"))))).collect();
        for i in 0..3 {
            let placed = wait_until(Duration::from_secs(60), || async {
                let Ok(r) = c.http.get(c.admin(&format!("/requests/kill-{t}-{i}"))).send().await else { return false };
                r.json::<Value>().await.is_ok_and(|v| v["worker"].is_string())
            })
            .await;
            assert!(placed.is_some(), "stream {i} placed");
        }
        reload(vec![first.to_string(), second.to_string()]).await;
        let last = std::sync::Mutex::new(Value::Null);
        let seen = wait_until(Duration::from_secs(90), || async {
            let Ok(r) = c.http.get(c.admin("/requests")).send().await else { return false };
            let v: Value = r.json().await.unwrap_or(Value::Null);
            let running = |r: &&Value| r["phase"] == "running" && r["generated_tokens"].as_u64().unwrap_or(0) >= 5;
            let (n, all_running) = v["requests"].as_array().map_or((0, 0), |a| (a.len(), a.iter().filter(running).count()));
            *last.lock().unwrap() = v;
            // Ended before being seen together: a missed try.
            all_running == 3 || n == 0
        })
        .await;
        let v = std::mem::take(&mut *last.lock().unwrap());
        let ok = seen.is_some() && v["requests"].as_array().is_some_and(|a| !a.is_empty());
        (handles, if ok { Ok(()) } else { Err(v) })
    }

    /// Runs stream `i` under `id`; what the client reassembled.
    fn run(&self, i: usize, id: String) -> impl std::future::Future<Output = Value> + Send + 'static {
        let (http, (path, b)) = (self.c.http.clone(), self.bodies[i].clone());
        let url = self.c.url(path);
        async move {
            let r = http.post(url).header("x-request-id", &id).json(&b).send().await.expect("sent");
            let status = r.status();
            let raw = r.text().await.expect("the stream is never cut");
            assert_eq!(status, 200, "{id}: {raw}");
            match path {
                "/v1/messages" => messages::essence(&raw),
                "/v1/responses" => responses::essence(&raw),
                _ => essence(&sse::parse(&raw)),
            }
        }
    }
}

#[tokio::test]
async fn the_rescheduler_moves_streams_and_they_stay_identical() {
    // binpacking_mitigation with a tiny SLO: a worker with a stream violates it, an idle one
    // takes the stream; each cycle moves it again until migration.limit (3).
    let extra =
        "rescheduling:\n  enable_rescheduling: true\n  rescheduling_policies: binpacking_mitigation\n  rescheduling_interval_ms: 100\n  tpot_slo: 0.001\n";
    let c = Cluster::sims(2, sim(1.0), GatewayOpts { extra: extra.into(), ..GatewayOpts::default() }).await;
    let body = json!({"prompt": unique_text(30), "max_tokens": 60, "temperature": 0, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}, "return_token_ids": true});
    let (_, _, first) = sse::stream(&c.http, &c.url("/v1/completions"), &body).await;
    let want = essence(&first);
    let m = c.gateway_metrics().await;
    let moved = m.sum("kvgate_migrations_total", &[("reason", "binpacking_mitigation"), ("outcome", "ok")]);
    assert!(moved >= 1.0, "the rescheduler moved the stream");
    // Identity: the same request, unmoved, on a gateway without the rescheduler.
    let plain = Cluster::sims(2, sim(4.0), GatewayOpts::default()).await;
    let (_, _, reference) = sse::stream(&plain.http, &plain.url("/v1/completions"), &body).await;
    assert_eq!(want, essence(&reference), "moved by the rescheduler vs never moved");
    bookings_are_zero(&c).await;
    let v: Value = c.http.get(c.admin("/rescheduling")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["enabled"], true, "{v}");
    assert!(v["last_cycle"]["models"][0]["model"] == "sim-model", "{v}");
}

#[tokio::test]
async fn decode_load_can_read_routings_tpot_predictor() {
    // kv mode: the rescheduler's predicted TPOT is routing's step predictor. An idle,
    // uncalibrated worker's prior step is 6 ms; one decoding a stream steps longer. With
    // tpot_slo 6.02 ms and
    // decode_load on predicted_tpot_ratio (threshold 1.0), the worker running the stream is a
    // source and the idle one a destination, so the stream moves, whole.
    let extra = "rescheduling:\n  enable_rescheduling: true\n  rescheduling_policies: decode_load\n  rescheduling_interval_ms: 100\n  \
                 rescheduling_decode_load_metric: predicted_tpot_ratio\n  tpot_slo: 6.02\n";
    let opts = GatewayOpts { mode: "kv".into(), extra: extra.into(), ..GatewayOpts::default() };
    let c = Cluster::sims_with_events(2, sim(1.0), opts).await;
    let body = json!({"prompt": unique_text(30), "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}, "return_token_ids": true});
    let (_, _, first) = sse::stream(&c.http, &c.url("/v1/completions"), &body).await;
    let m = c.gateway_metrics().await;
    let moved = m.sum("kvgate_migrations_total", &[("reason", "decode_load"), ("outcome", "ok")]);
    assert!(moved >= 1.0, "the loaded worker's predicted TPOT made it a source");
    let plain = Cluster::sims(2, sim(4.0), GatewayOpts::default()).await;
    let (_, _, reference) = sse::stream(&plain.http, &plain.url("/v1/completions"), &body).await;
    assert_eq!(essence(&first), essence(&reference), "moved by predicted TPOT vs never moved");
    bookings_are_zero(&c).await;
}

async fn workers_listed(c: &Cluster, n: usize) {
    // Generous: on a loaded machine the file watch can take seconds to notice an edit.
    wait_until(Duration::from_secs(20), || async {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        v["models"][0]["workers"].as_array().unwrap().len() == n
    })
    .await
    .expect("reload applied");
}

#[tokio::test]
async fn a_stream_moves_to_a_worker_added_after_it_started() {
    // Scale-up: the new worker is a destination for streams placed before it existed.
    let c = Cluster::sims(2, sim(1.0), GatewayOpts::default()).await;
    std::fs::write(&c.config_path, kvgate_tests::cluster::gateway_yaml(&[c.sims[0].url()], &GatewayOpts::default())).unwrap();
    workers_listed(&c, 1).await;
    let body = json!({"prompt": unique_text(30), "max_tokens": 60, "temperature": 0, "ignore_eos": true, "stream": true, "return_token_ids": true});
    let (reference, _) = run(&c, "/v1/completions", &body, "before", None).await;
    let r = c.http.post(c.url("/v1/completions")).header("x-request-id", "grow").json(&body).send().await.unwrap();
    let mut s = r.bytes_stream();
    let mut raw = Vec::from(s.next().await.unwrap().unwrap().as_ref());
    // The new worker listed first: the reload renumbers the fleet under the running stream.
    std::fs::write(&c.config_path, kvgate_tests::cluster::gateway_yaml(&[c.sims[1].url(), c.sims[0].url()], &GatewayOpts::default())).unwrap();
    workers_listed(&c, 2).await;
    let r = c.http.post(c.admin("/migrate")).json(&json!({"request_id": "grow", "to": c.sims[1].url()})).send().await.unwrap();
    let (status, report) = (r.status().as_u16(), r.json::<Value>().await.unwrap());
    let workers: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
    assert_eq!(status, 200, "{report} {workers} {}", c.sims[1].url());
    assert_eq!(report["to"].as_str().map(|t| t.trim_end_matches('/')), Some(c.sims[1].url().trim_end_matches('/')));
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("never cut"));
    }
    assert_eq!(essence(&sse::parse(&String::from_utf8(raw).unwrap())), essence(&reference));
    assert!(c.sim_metrics(1).await.sum("vllm:request_success_total", &[]) >= 1.0, "the new worker finished it");
    bookings_are_zero(&c).await;
    // The receipt names each leg's worker as the fleet was when it was placed.
    let v: Value = c.http.get(c.admin("/requests/grow")).send().await.unwrap().json().await.unwrap();
    let chosen: Vec<String> = v["route_receipt"].as_array().unwrap().iter().map(|l| l["chosen"]["url"].as_str().unwrap_or_default().to_string()).collect();
    assert!(chosen.len() == 2 && same_url(&chosen[0], &c.sims[0].url()) && same_url(&chosen[1], &c.sims[1].url()), "{v}");
}

#[tokio::test]
async fn a_webassembly_rescheduling_policy_moves_streams_the_same_way() {
    // plugins/examples/load-balance: a worker at or over the threshold is a source, one under
    // it a destination; the KV usage of a worker running one stream is just over 0.
    let wasm = kvgate_tests::guests::path("load-balance");
    let extra = format!(
        "load:\n  interval_ms: 50\nrescheduling:\n  enable_rescheduling: true\n  rescheduling_policies: \"\"\n  rescheduling_interval_ms: 100\n  plugin:\n    name: lb\n    path: {}\n    config: \"threshold = 0.0001\\nrule = num_req\\norder = sr\\nvalue = 1\\n\"\n",
        wasm.display()
    );
    let c = Cluster::sims(2, sim(1.0), GatewayOpts { extra, ..GatewayOpts::default() }).await;
    let body = json!({"prompt": unique_text(30), "max_tokens": 120, "temperature": 0, "ignore_eos": true, "stream": true, "return_token_ids": true});
    let (_, _, moved) = sse::stream(&c.http, &c.url("/v1/completions"), &body).await;
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_migrations_total", &[("reason", "plugin"), ("outcome", "ok")]) >= 1.0, "the plugin's pair was executed");
    let plain = Cluster::sims(2, sim(4.0), GatewayOpts::default()).await;
    let (_, _, reference) = sse::stream(&plain.http, &plain.url("/v1/completions"), &body).await;
    assert_eq!(essence(&moved), essence(&reference));
    bookings_are_zero(&c).await;
}

#[tokio::test]
async fn a_request_still_waiting_for_its_first_token_moves_by_resend() {
    let c = Cluster::sims(2, sim(4.0), GatewayOpts::default()).await;
    for s in &c.sims {
        s.faults().set(vllm_sim::faults::FaultConfig { first_token_delay_ms: 1500.0, ..Default::default() }).unwrap();
    }
    let body = json!({"prompt": unique_text(20), "max_tokens": 8, "temperature": 0, "ignore_eos": true, "stream": true});
    let (http, url) = (c.http.clone(), c.url("/v1/completions"));
    let b = body.clone();
    let (head_tx, head_rx) = tokio::sync::oneshot::channel();
    let client = tokio::spawn(async move {
        let r = http.post(url).header("x-request-id", "early").json(&b).send().await.unwrap();
        let worker = r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        let _ = head_tx.send(());
        (worker, sse::parse(&r.text().await.unwrap()))
    });
    // The order goes once the client holds the head: an order that arrives while the worker's
    // header is still on its way (a loaded machine) reroutes the request before any head, and
    // the head then names the second worker.
    tokio::time::timeout(Duration::from_secs(3), head_rx).await.expect("the head comes before the first token").unwrap();
    let from = wait_until(Duration::from_secs(3), || async {
        // A poll that fails in transport (a loaded machine) is just tried again.
        let Ok(r) = c.http.get(c.admin("/requests/early")).send().await else { return false };
        r.json::<Value>().await.unwrap_or(Value::Null)["phase"] == "waiting"
    })
    .await;
    assert!(from.is_some(), "the request is waiting for its first token");
    let r = c.http.post(c.admin("/migrate")).json(&json!({"request_id": "early"})).send().await.unwrap();
    let (status, report) = (r.status().as_u16(), r.json::<Value>().await.unwrap());
    assert_eq!((status, report["how"].clone()), (200, json!("resend")), "{report}");
    let (worker, moved) = client.await.unwrap();
    assert_ne!(report["from"], report["to"]);
    assert!(moved.done && moved.events.len() == 8, "{}", moved.raw);
    // The route receipt, once the request is recorded as finished: every placement, and how
    // its leg ended.
    let finished = || async {
        let v: Value = c.http.get(c.admin("/requests/early")).send().await.ok()?.json().await.ok()?;
        (v["status"] == 200).then_some(v)
    };
    wait_until(Duration::from_secs(2), || async { finished().await.is_some() }).await.expect("recorded as finished");
    let placements = finished().await.unwrap()["route_receipt"].clone();
    let url = |p: &Value| p["chosen"]["url"].as_str().unwrap_or_default().to_string();
    let legs = placements.as_array().expect("placements");
    // The stream's head went out at once, from the worker it started on.
    assert_eq!(worker, url(&legs[0]), "the head names the worker the stream started on: {placements}");
    // The order moved it from the worker it was waiting on to another, by resending it. (On a
    // loaded machine a leg may also fail before its first token and be retried unseen; the
    // receipt then shows that leg, and the order's `from` is where the retry went.)
    let moved_at = legs.iter().rposition(|p| p["outcome"] == "moved").expect("a leg ended by the move");
    assert_eq!(report["from"].as_str().unwrap(), url(&legs[moved_at]), "{placements}");
    assert_eq!(report["to"].as_str().unwrap(), url(&legs[moved_at + 1]), "{placements}");
    bookings_are_zero(&c).await;
}

/// A move's destination that answers 5xx is passed over for the next one, even with
/// `retries.on_5xx` off (the client has its head: no error answer can reach it), and its
/// failure is counted as any leg's. The stream ends whole.
#[tokio::test]
async fn a_destination_answering_5xx_is_passed_over() {
    let extra = "retries:\n  on_5xx: false\n".to_string();
    let c = Cluster::sims(3, sim(1.0), GatewayOpts { extra, ..GatewayOpts::default() }).await;
    let body = json!({"prompt": unique_text(20), "max_tokens": 60, "temperature": 0, "ignore_eos": true, "stream": true, "return_token_ids": true});
    let (reference, _) = run(&c, "/v1/completions", &body, "ref", None).await;
    let r = c.http.post(c.url("/v1/completions")).header("x-request-id", "aimed").json(&body).send().await.unwrap();
    let serving = r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let others: Vec<usize> = (0..3).filter(|&i| !same_url(&c.sims[i].url(), &serving)).collect();
    let (failing, last) = (others[0], others[1]);
    c.sims[failing].faults().set(vllm_sim::faults::FaultConfig { error_rate: 1.0, ..Default::default() }).unwrap();
    let mut s = r.bytes_stream();
    let mut raw = Vec::from(s.next().await.unwrap().unwrap().as_ref());
    let r = c.http.post(c.admin("/migrate")).json(&json!({"request_id": "aimed", "to": c.sims[failing].url()})).send().await.unwrap();
    let (status, report) = (r.status().as_u16(), r.json::<Value>().await.unwrap());
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("never cut"));
    }
    assert_eq!(status, 200, "{report}");
    assert!(same_url(report["to"].as_str().unwrap_or_default(), &c.sims[last].url()), "passed over to the third worker: {report}");
    assert_eq!(essence(&sse::parse(&String::from_utf8(raw).unwrap())), essence(&reference));
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_upstream_errors_total", &[("kind", "status_5xx")]) >= 1.0, "the destination's 5xx is counted");
    let v: Value = c.http.get(c.admin("/requests/aimed")).send().await.unwrap().json().await.unwrap();
    let outcomes: Vec<&str> = v["route_receipt"].as_array().unwrap().iter().filter_map(|l| l["outcome"].as_str()).collect();
    assert!(outcomes.contains(&"status_5xx"), "the receipt says how the destination's leg ended: {v}");
    bookings_are_zero(&c).await;
}

#[tokio::test]
async fn a_stalled_worker_fails_over() {
    // A worker that stops sending past timeouts.upstream_read_idle_ms: its stream continues on
    // the other worker.
    let extra = "timeouts:\n  upstream_read_idle_ms: 300\n".to_string();
    let c = Cluster::sims(2, sim(1.0), GatewayOpts { extra, ..GatewayOpts::default() }).await;
    let body = json!({"prompt": unique_text(20), "max_tokens": 60, "temperature": 0, "ignore_eos": true, "stream": true, "return_token_ids": true});
    let (reference, _) = run(&c, "/v1/completions", &body, "ref", None).await;
    let r = c.http.post(c.url("/v1/completions")).header("x-request-id", "stall").json(&body).send().await.unwrap();
    let serving = r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let stalled = c.sims.iter().position(|s| s.url().trim_end_matches('/') == serving.trim_end_matches('/')).expect("a known worker");
    // Freeze the serving worker's engine: its stream stops mid-way, its connection stays open.
    let mut s = r.bytes_stream();
    let mut raw = Vec::from(s.next().await.unwrap().unwrap().as_ref());
    c.sims[stalled].faults().set(vllm_sim::faults::FaultConfig { stall: true, ..Default::default() }).unwrap();
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("never cut"));
    }
    c.sims[stalled].faults().set(vllm_sim::faults::FaultConfig::default()).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    assert_eq!(essence(&sse::parse(&raw)), essence(&reference));
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_migrations_total", &[("reason", "failover"), ("outcome", "ok")]) >= 1.0);
}

#[tokio::test]
async fn a_stream_too_long_for_a_workers_context_stays_put_and_says_why() {
    // One worker serves 4,096 tokens of context, the other 96: a 120-token stream cannot move.
    let mut small = sim(1.0);
    small.max_model_len = 96;
    let (a, b) = (vllm_sim::SimServer::start(sim(1.0)).await.unwrap(), vllm_sim::SimServer::start(small).await.unwrap());
    let extra = "load:\n  interval_ms: 50\n".to_string();
    let mut c = Cluster::front(&[a.url(), b.url()], GatewayOpts { extra, ..GatewayOpts::default() }).await;
    c.sims = vec![a, b];
    wait_until(Duration::from_secs(3), || async { c.sim_metrics(1).await.has("vllm:num_requests_running") }).await;
    // The small worker's context is known once its /v1/models was read.
    let known = wait_until(Duration::from_secs(10), || async {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        v["models"][0]["workers"][1]["max_model_len"] == 96
    })
    .await;
    assert!(known.is_some(), "the gateway read the small worker's context length");
    let body = json!({"prompt": (0..100).map(|i| 100 + i).collect::<Vec<u32>>(), "max_tokens": 60, "ignore_eos": true, "stream": true});
    let r = c.http.post(c.url("/v1/completions")).header("x-request-id", "long").json(&body).send().await.unwrap();
    let mut s = r.bytes_stream();
    s.next().await.unwrap().unwrap();
    let r = c.http.post(c.admin("/migrate")).json(&json!({"request_id": "long"})).send().await.unwrap();
    let (status, v) = (r.status().as_u16(), r.json::<Value>().await.unwrap());
    assert_eq!(status, 409, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("context_too_long"), "{v}");
    let mut raw = Vec::new();
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("the stream goes on where it was"));
    }
    assert!(sse::parse(&String::from_utf8(raw).unwrap()).done);
}

#[tokio::test]
async fn a_worker_error_answer_to_a_stream_passes_unchanged() {
    // A streamed request the worker refuses (too long for its context) gets the worker's JSON
    // error, not a cut connection or a failover.
    let c = Cluster::sims(2, sim(4.0), GatewayOpts::default()).await;
    let body = json!({"prompt": (0..10).map(|i| 100 + i).collect::<Vec<u32>>(), "max_tokens": 5000, "stream": true});
    let r = c.http.post(c.url("/v1/completions")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.expect("a JSON error body");
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("max_model_len")), "{v}");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_migrations_total", &[]), 0.0, "no move was tried");
}
