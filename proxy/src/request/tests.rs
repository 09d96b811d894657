//! The phases driven end to end on a Pingora session over an in-memory pipe (the client side
//! is a raw HTTP/1.1 writer and reader), against fake upstreams on loopback whose behaviour
//! each test scripts: an answer, a 5xx, a connection closed before the header, silence, a slow
//! stream.

use super::*;
use crate::config::load::load_str;
use crate::inflight::Phase;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::TcpListener;

/// What a fake worker does with each request it reads.
#[derive(Clone, Copy)]
enum Script {
    /// 200 with a small JSON body.
    Answer,
    /// 500 with a JSON error.
    Fail500,
    /// Close the connection without answering.
    Close,
    /// Read the request and say nothing.
    Silent,
    /// A chunked SSE stream of `n` token events, 20 ms apart.
    Stream(usize),
    /// A stream whose first chunk is half an event, the rest 300 ms later.
    HalfEventFirst,
    /// A stream's head, then the connection closed before any event.
    HeadThenClose,
}

/// A fake worker on an ephemeral port; counts the requests it read and the connections it
/// accepted.
struct FakeWorker {
    url: String,
    requests: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
}

async fn fake_worker(script: Script) -> FakeWorker {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let requests = Arc::new(AtomicUsize::new(0));
    let connections = Arc::new(AtomicUsize::new(0));
    let (count, accepted) = (requests.clone(), connections.clone());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::SeqCst);
            let count = count.clone();
            tokio::spawn(async move {
                while read_request(&mut sock).await {
                    count.fetch_add(1, Ordering::SeqCst);
                    if !answer(&mut sock, script).await {
                        return;
                    }
                }
            });
        }
    });
    FakeWorker { url, requests, connections }
}

/// Reads one request (header and Content-Length body); false at EOF.
async fn read_request(sock: &mut tokio::net::TcpStream) -> bool {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if sock.read(&mut byte).await.unwrap_or(0) == 0 {
            return false;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let len: usize = head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse().unwrap_or(0));
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body).await.is_ok()
}

/// Answers per the script; false when the connection must end.
async fn answer(sock: &mut tokio::net::TcpStream, script: Script) -> bool {
    let unary = |status: &str, body: &str| format!("HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    match script {
        Script::Answer => sock.write_all(unary("200 OK", r#"{"choices":[{"text":"hi"}]}"#).as_bytes()).await.is_ok(),
        Script::Fail500 => sock.write_all(unary("500 Internal Server Error", r#"{"error":"boom"}"#).as_bytes()).await.is_ok(),
        Script::Close => false,
        Script::Silent => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            false
        }
        Script::Stream(n) => {
            let _ = sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").await;
            for i in 0..n {
                let event = format!("data: {{\"choices\":[{{\"text\":\"t{i}\"}}]}}\n\n");
                if sock.write_all(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes()).await.is_err() {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            sock.write_all(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n").await.is_ok()
        }
        Script::HeadThenClose => {
            let _ = sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            false
        }
        Script::HalfEventFirst => {
            let (first, rest) = ("data: {\"choices\"", ":[{\"text\":\"t0\"}]}\n\n");
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            let _ = sock.write_all(format!("{head}{:x}\r\n{first}\r\n", first.len()).as_bytes()).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            sock.write_all(format!("{:x}\r\n{rest}\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n", rest.len()).as_bytes()).await.is_ok()
        }
    }
}

/// A gateway (no server, no background tasks) in front of `workers`; `extra` is top-level
/// config, `round_robin` picks that routing mode (else the default).
fn gateway(workers: &[&FakeWorker], extra: &str, round_robin: bool) -> Arc<Gateway> {
    let list: String = workers.iter().flat_map(|w| ["      - url: ", w.url.as_str(), "\n"]).collect();
    let routing = if round_robin { "    routing:\n      mode: round_robin\n" } else { "" };
    let yaml = format!("{extra}models:\n  - name: m\n{routing}    workers:\n{list}");
    Gateway::new(load_str(&yaml, "test", Vec::new()).unwrap(), None).unwrap()
}

/// A client connection: the gateway's session and the client's end of the pipe.
async fn client(request: &str) -> (ClientConn, DuplexStream) {
    let (mut client, server) = tokio::io::duplex(1 << 20);
    client.write_all(request.as_bytes()).await.unwrap();
    let mut session = ClientConn::new(Box::new(server));
    assert!(session.read_request(std::time::Duration::from_secs(5)).await.unwrap());
    (session, client)
}

fn post(body: &str) -> String {
    post_with_id(body, "")
}

/// A request with an `x-request-id` (none when empty).
fn post_with_id(body: &str, id: &str) -> String {
    let id = if id.is_empty() { String::new() } else { format!("x-request-id: {id}\r\n") };
    format!("POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n{id}content-length: {}\r\n\r\n{body}", body.len())
}

/// Serves one request; returns whether the connection was aborted and what the client read.
async fn serve_one(gw: &Arc<Gateway>, request: &str) -> (bool, String) {
    let (mut session, mut client) = client(request).await;
    let aborted = serve(gw, &mut session, Endpoint::Completions).await;
    session.shutdown().await;
    drop(session);
    let mut out = Vec::new();
    let _ = client.read_to_end(&mut out).await;
    (aborted, String::from_utf8_lossy(&out).into_owned())
}

fn status_of(response: &str) -> u16 {
    response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// The registry is empty and every booking of model `m` returned to zero.
fn assert_clean(gw: &Gateway) {
    assert!(gw.requests.is_empty(), "registry cleaned up");
    let m = gw.fleet().model("m").cloned().unwrap();
    for i in 0..m.workers.len() as u16 {
        assert_eq!((m.ledger.requests(i), m.ledger.prefill_tokens(i), m.ledger.active_blocks(i)), (0, 0, 0), "worker {i}'s bookings");
    }
}

#[tokio::test]
async fn admission_errors_are_answered_before_any_worker() {
    let w = fake_worker(Script::Answer).await;
    let gw = gateway(&[&w], "max_body_bytes: 1024\n", false);
    let cases = [
        (post("{not json"), 400, "Invalid request body"),
        (post(r#"{"model":"nope","prompt":"x"}"#), 404, "does not exist"),
        (post(&format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(2000))), 413, "exceeds"),
    ];
    for (req, status, text) in cases {
        let (aborted, resp) = serve_one(&gw, &req).await;
        assert!(!aborted);
        assert_eq!(status_of(&resp), status, "{resp}");
        assert!(resp.contains(text) && resp.contains(r#""error":"#), "{resp}");
    }
    // A chunked body whose framing breaks: a 400 that says why, and the connection ends.
    let bad_chunks = "POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{\"a\":1}\r\n0\r\n\r\n";
    let (_, resp) = serve_one(&gw, bad_chunks).await;
    assert_eq!(status_of(&resp), 400, "{resp}");
    assert!(resp.contains("Malformed request body") && resp.to_ascii_lowercase().contains("connection: close"), "{resp}");
    gw.start_draining();
    let (_, resp) = serve_one(&gw, &post(r#"{"model":"m","prompt":"x"}"#)).await;
    assert_eq!(status_of(&resp), 503);
    assert!(resp.to_ascii_lowercase().contains("connection: close"), "{resp}");
    assert_eq!(w.requests.load(Ordering::SeqCst), 0, "no worker saw any of them");
    assert!(gw.requests.finished().is_empty(), "refused before admission: never registered");
    assert_clean(&gw);
}

#[tokio::test]
async fn success_names_the_worker_and_leaves_nothing_behind() {
    let w = fake_worker(Script::Answer).await;
    let gw = gateway(&[&w], "", false);
    let (aborted, resp) = serve_one(&gw, &post_with_id(r#"{"model":"m","prompt":"x"}"#, "req-1")).await;
    assert!(!aborted);
    assert_eq!(status_of(&resp), 200, "{resp}");
    assert!(resp.contains(&format!("x-kvgate-worker: {}", shown(&gw, &w.url))) && !resp.contains(&w.url), "named, its address not shown: {resp}");
    assert!(resp.ends_with(r#"{"choices":[{"text":"hi"}]}"#), "{resp}");
    assert_clean(&gw);
    let done = gw.requests.find("req-1").expect("kept as finished");
    assert_eq!((done.phase(), done.status()), (Phase::Finished, Some(200)));
    let receipt = done.to_json(true)["route_receipt"].clone();
    assert_eq!(receipt[0]["chosen"]["url"], w.url.as_str());
    assert_eq!(receipt[0]["outcome"], "ok");
}

/// A finished leg's connection goes back to its worker's pool (`upstream::release` takes it
/// only when Pingora's `reuse` is ready at once), and the next request rides it.
#[tokio::test]
async fn a_finished_leg_returns_its_connection_and_the_next_reuses_it() {
    let w = fake_worker(Script::Answer).await;
    let gw = gateway(&[&w], "", false);
    let worker = gw.fleet().model("m").cloned().unwrap().workers[0].clone();
    for _ in 0..3 {
        let (_, resp) = serve_one(&gw, &post(r#"{"model":"m","prompt":"x"}"#)).await;
        assert_eq!(status_of(&resp), 200, "{resp}");
        assert_eq!(worker.idle.len(), 1, "the connection is back in the pool");
    }
    assert_eq!(w.requests.load(Ordering::SeqCst), 3);
    assert_eq!(w.connections.load(Ordering::SeqCst), 1, "one connection served all three");
}

#[tokio::test]
async fn a_retryable_leg_error_goes_to_another_worker() {
    let closing = fake_worker(Script::Close).await;
    let good = fake_worker(Script::Answer).await;
    let gw = gateway(&[&closing, &good], "", true);
    for _ in 0..4 {
        let (_, resp) = serve_one(&gw, &post(r#"{"model":"m","prompt":"x"}"#)).await;
        assert_eq!(status_of(&resp), 200, "{resp}");
    }
    assert!(closing.requests.load(Ordering::SeqCst) >= 1, "round robin tried the closing worker");
    let retried = gw.requests.finished().into_iter().find(|e| e.receipt.lock().placements.len() == 2).expect("one request was retried");
    let r = retried.to_json(true)["route_receipt"].clone();
    assert_eq!(r[0]["outcome"], "response");
    assert_eq!((r[1]["outcome"].as_str(), r[1]["excluded"][0]["reason"].as_str()), (Some("ok"), Some("tried")));
    assert_clean(&gw);
}

#[tokio::test]
async fn a_5xx_is_retried_only_when_another_worker_may_answer() {
    let failing = fake_worker(Script::Fail500).await;
    let gw = gateway(&[&failing], "", false);
    let (_, resp) = serve_one(&gw, &post(r#"{"model":"m","prompt":"x"}"#)).await;
    assert_eq!(status_of(&resp), 500, "the only worker's 5xx is passed on: {resp}");
    let good = fake_worker(Script::Answer).await;
    let gw = gateway(&[&failing, &good], "", true);
    for _ in 0..4 {
        let (_, resp) = serve_one(&gw, &post(r#"{"model":"m","prompt":"x"}"#)).await;
        assert_eq!(status_of(&resp), 200, "{resp}");
    }
    assert_clean(&gw);
}

#[tokio::test]
async fn a_final_leg_error_is_not_retried() {
    let silent = fake_worker(Script::Silent).await;
    let other = fake_worker(Script::Answer).await;
    let gw = gateway(&[&silent, &other], "timeouts:\n  first_byte_ms: 100\n", true);
    let mut timeouts = 0;
    for _ in 0..2 {
        let (_, resp) = serve_one(&gw, &post(r#"{"model":"m","prompt":"x"}"#)).await;
        timeouts += usize::from(status_of(&resp) == 504);
    }
    assert_eq!(timeouts, 1, "the silent worker's request got 504");
    assert_eq!(other.requests.load(Ordering::SeqCst), 1, "and was not sent to the other worker");
    assert_clean(&gw);
}

#[tokio::test]
async fn every_attempt_failing_is_a_502_and_the_registry_is_cleaned_up() {
    let a = fake_worker(Script::Close).await;
    let b = fake_worker(Script::Close).await;
    let gw = gateway(&[&a, &b], "", false);
    let (_, resp) = serve_one(&gw, &post_with_id(r#"{"model":"m","prompt":"x"}"#, "bad-1")).await;
    assert_eq!(status_of(&resp), 502, "{resp}");
    assert!(resp.contains("upstream_error"), "{resp}");
    assert_clean(&gw);
    assert_eq!(gw.requests.find("bad-1").unwrap().status(), Some(502));
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_is_cleaned_up() {
    let w = fake_worker(Script::Stream(200)).await;
    let gw = gateway(&[&w], "", false);
    let body = r#"{"model":"m","prompt":"x","stream":true}"#;
    let (mut session, mut client) = client(&post_with_id(body, "gone-1")).await;
    let gw2 = gw.clone();
    let served = tokio::spawn(async move { serve(&gw2, &mut session, Endpoint::Completions).await });
    // Read until a few token events arrived, then hang up.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(5).filter(|w| w == b"data:").count() < 3 {
        let n = client.read(&mut buf).await.unwrap();
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    let live = gw.requests.find("gone-1").unwrap();
    assert_eq!(live.phase(), Phase::Running);
    assert!(live.generated_tokens() >= 1);
    assert_eq!(gw.requests.snapshot().len(), 1);
    drop(client);
    tokio::time::timeout(Duration::from_secs(5), served).await.expect("the request ends at once").unwrap();
    assert_clean(&gw);
    assert_eq!(gw.requests.find("gone-1").unwrap().status(), Some(499));
    assert!(live.ctx.is_killed(), "its context was cancelled");
}

/// A stream's head leaves in one send with the first bytes that came with the worker's head;
/// when those are half an event, the head goes at once rather than wait for the rest.
#[tokio::test]
async fn a_stream_whose_first_bytes_are_half_an_event_gets_its_head_at_once() {
    let w = fake_worker(Script::HalfEventFirst).await;
    let gw = gateway(&[&w], "", false);
    let body = r#"{"model":"m","prompt":"x","stream":true}"#;
    let (mut session, mut client) = client(&post(body)).await;
    let gw2 = gw.clone();
    let served = tokio::spawn(async move { serve(&gw2, &mut session, Endpoint::Completions).await });
    let mut buf = [0u8; 4096];
    let n = tokio::time::timeout(Duration::from_millis(200), client.read(&mut buf)).await.expect("the head came before the rest of the event").unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(head.starts_with("HTTP/1.1 200 ") && head.ends_with("\r\n\r\n") && !head.contains("data:"), "the head alone: {head}");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest)).await.unwrap().unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("data: {\"choices\":[{\"text\":\"t0\"}]}\n\n") && rest.contains("data: [DONE]"), "{rest}");
    served.await.unwrap();
    assert_clean(&gw);
}

/// Serves one stream request through `gw` and returns whether the connection was to be cut,
/// and what the client read.
async fn stream_through(gw: &Arc<Gateway>) -> (bool, String) {
    let (mut session, mut client) = client(&post(r#"{"model":"m","prompt":"x","stream":true}"#)).await;
    let gw2 = gw.clone();
    let served = tokio::spawn(async move {
        let cut = serve(&gw2, &mut session, Endpoint::Completions).await;
        drop(session);
        cut
    });
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut out)).await.expect("the request ends").unwrap();
    (served.await.unwrap(), String::from_utf8_lossy(&out).into_owned())
}

/// A worker that sends a stream's head and fails before its first token: the head has gone to
/// the client, and the request is resent to the other worker, whose stream follows it.
#[tokio::test]
async fn a_stream_whose_worker_fails_after_its_head_continues_on_another() {
    let (bad, good) = (fake_worker(Script::HeadThenClose).await, fake_worker(Script::Stream(2)).await);
    let gw = gateway(&[&bad, &good], "", true);
    for _ in 0..2 {
        let (cut, out) = stream_through(&gw).await;
        assert!(!cut, "{out}");
        assert_eq!(out.matches("HTTP/1.1 200").count(), 1, "one head: {out}");
        assert!(out.contains("t0") && out.contains("t1") && out.contains("data: [DONE]") && out.ends_with("0\r\n\r\n"), "{out}");
    }
    assert!(bad.requests.load(Ordering::SeqCst) >= 1, "a stream started on the failing worker");
    assert_clean(&gw);
}

/// A stream resent after its head went out, answered with an error status by the last worker
/// there is: no error answer can follow the 200, so the stream is cut, never ended cleanly.
#[tokio::test]
async fn a_resent_stream_answered_with_an_error_is_cut() {
    let (bad, failing) = (fake_worker(Script::HeadThenClose).await, fake_worker(Script::Fail500).await);
    let gw = gateway(&[&bad, &failing], "", true);
    let mut resent = 0;
    for _ in 0..2 {
        let (cut, out) = stream_through(&gw).await;
        if out.starts_with("HTTP/1.1 200") {
            resent += 1;
            assert!(cut, "the connection is cut: {out}");
            assert_eq!(out.matches("HTTP/1.1").count(), 1, "no second answer after the head: {out}");
            assert!(!out.ends_with("0\r\n\r\n"), "not ended as complete: {out}");
        }
    }
    assert!(resent >= 1, "a stream started on the worker that sends its head");
    assert_clean(&gw);
}

/// Every request's future is copied when Pingora boxes it, and again where each phase's
/// future is built: rare paths (moves, probes, fresh connects) are boxed so they do not grow
/// it (docs/architecture.md, "Future sizes"). It was 12 KB before they were.
#[tokio::test]
async fn the_request_future_stays_small() {
    let w = fake_worker(Script::Stream(1)).await;
    let gw = gateway(&[&w], "", true);
    let (mut session, _client) = client(&post("{}")).await;
    let f = serve(&gw, &mut session, Endpoint::Completions);
    let size = std::mem::size_of_val(&f);
    assert!(size <= 8 * 1024, "the request future is {size} bytes");
    f.await;
}

/// Polls `f` every millisecond until it holds (at most 5 s).
async fn until(mut f: impl FnMut() -> bool) {
    for _ in 0..5000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("condition never held");
}

/// A paused fleet holds new requests in phase 2, and `/resume`'s signal releases them to the
/// workers; a pause outlasting the queue's wait is a 503 that says so.
#[tokio::test]
async fn requests_arriving_while_paused_wait_for_resume() {
    let w = fake_worker(Script::Answer).await;
    let gw = gateway(&[&w], "", false);
    let worker = gw.fleet().model("m").cloned().unwrap().workers[0].clone();
    worker.set_paused(true);
    let gw2 = gw.clone();
    let held = tokio::spawn(async move { serve_one(&gw2, &post(r#"{"model":"m","prompt":"x"}"#)).await });
    let queued = gw.metrics.queued.with_label_values(&["m"]);
    until(|| queued.get() == 1).await;
    assert_eq!(w.requests.load(Ordering::SeqCst), 0, "nothing reaches a paused worker");
    worker.set_paused(false);
    gw.resumed.send_modify(|n| *n += 1);
    let (_, resp) = held.await.unwrap();
    assert_eq!(status_of(&resp), 200, "{resp}");
    assert_eq!(queued.get(), 0);
    assert_clean(&gw);

    let short = Gateway::new(
        load_str(&format!("models:\n  - name: m\n    routing:\n      queue_max_wait_ms: 30\n    workers:\n      - url: {}\n", w.url), "test", Vec::new())
            .unwrap(),
        None,
    )
    .unwrap();
    short.fleet().model("m").unwrap().workers[0].set_paused(true);
    let (_, resp) = serve_one(&short, &post(r#"{"model":"m","prompt":"x"}"#)).await;
    assert_eq!(status_of(&resp), 503, "{resp}");
    assert!(resp.contains("paused by an operator"), "{resp}");
    assert_clean(&short);
}

/// Whether a request waits for a pause is the placement's own question: a worker that is out
/// for another reason (unhealthy here) neither holds the request nor lets it through, so the
/// request waits for the paused one and then goes there.
#[tokio::test]
async fn a_request_waits_for_a_pause_exactly_when_its_placement_is_held_by_one() {
    let (paused, sick) = (fake_worker(Script::Answer).await, fake_worker(Script::Answer).await);
    let gw = gateway(&[&paused, &sick], "", false);
    let workers = gw.fleet().model("m").cloned().unwrap().workers.clone();
    workers[0].set_paused(true);
    workers[1].observe_health(false, 1, 1);
    let gw2 = gw.clone();
    let held = tokio::spawn(async move { serve_one(&gw2, &post(r#"{"model":"m","prompt":"x"}"#)).await });
    let queued = gw.metrics.queued.with_label_values(&["m"]);
    until(|| queued.get() == 1).await;
    workers[0].set_paused(false);
    gw.resumed.send_modify(|n| *n += 1);
    let (_, resp) = held.await.unwrap();
    assert_eq!(status_of(&resp), 200, "{resp}");
    assert_eq!((paused.requests.load(Ordering::SeqCst), sick.requests.load(Ordering::SeqCst)), (1, 0));
    assert_clean(&gw);
}

/// A request naming a LoRA adapter goes only to the workers whose model cards list it; a name
/// no worker lists is an unknown model.
#[tokio::test]
async fn adapter_requests_reach_only_the_workers_that_have_the_adapter() {
    let (plain, lora) = (fake_worker(Script::Answer).await, fake_worker(Script::Answer).await);
    let gw = gateway(&[&plain, &lora], "", true);
    let cards = br#"{"data":[{"id":"m","max_model_len":64},{"id":"sql","parent":"m","root":"/lora/sql"}]}"#;
    gw.fleet().model("m").unwrap().workers[1].set_cards(crate::fleet::ModelCards::parse(cards).unwrap());
    for _ in 0..4 {
        let (_, resp) = serve_one(&gw, &post(r#"{"model":"sql","prompt":"x"}"#)).await;
        assert_eq!(status_of(&resp), 200, "{resp}");
        assert!(resp.contains(&format!("x-kvgate-worker: {}", shown(&gw, &lora.url))), "{resp}");
    }
    assert_eq!(plain.requests.load(Ordering::SeqCst), 0);
    let (_, resp) = serve_one(&gw, &post(r#"{"model":"other-adapter","prompt":"x"}"#)).await;
    assert_eq!(status_of(&resp), 404, "{resp}");
    let r = gw.requests.finished().into_iter().next().unwrap().to_json(true)["route_receipt"].clone();
    assert_eq!(r[0]["excluded"][0]["reason"], "no_adapter", "{r}");
    assert_clean(&gw);
}

/// A request whose stored response lives on a paused worker waits for that worker, though
/// another is free (it could not serve the request), and is served there on resume.
#[tokio::test]
async fn a_request_for_a_paused_workers_stored_response_waits_for_it() {
    let (home, other) = (fake_worker(Script::Answer).await, fake_worker(Script::Answer).await);
    let gw = gateway(&[&home, &other], "", true);
    let worker = gw.fleet().model("m").cloned().unwrap().workers[0].clone();
    gw.stored_responses.remember("resp_0123456789abcdef", &worker.url);
    worker.set_paused(true);
    let body = r#"{"model":"m","input":"again","previous_response_id":"resp_0123456789abcdef"}"#;
    let request = format!("POST /v1/responses HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    let gw2 = gw.clone();
    let held = tokio::spawn(async move {
        let (mut session, mut client) = client(&request).await;
        serve(&gw2, &mut session, Endpoint::Responses).await;
        session.shutdown().await;
        drop(session);
        let mut out = Vec::new();
        let _ = client.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    });
    let queued = gw.metrics.queued.with_label_values(&["m"]);
    until(|| queued.get() == 1).await;
    worker.set_paused(false);
    gw.resumed.send_modify(|n| *n += 1);
    let resp = held.await.unwrap();
    assert_eq!(status_of(&resp), 200, "{resp}");
    assert!(resp.contains(&format!("x-kvgate-worker: {}", shown(&gw, &home.url))), "{resp}");
    assert_eq!(other.requests.load(Ordering::SeqCst), 0);
}

/// The name `x-kvgate-worker` shows for the worker at `url` (`worker_header: name`, the default).
fn shown(gw: &Gateway, url: &str) -> String {
    let fleet = gw.fleet();
    let w = fleet.all_workers().into_iter().find(|(_, w)| w.label == url.trim_end_matches('/')).expect("a worker at that URL").1;
    assert!(w.name.starts_with("w-"), "{}", w.name);
    w.name.clone()
}

/// A worker that answers each request with a stream only once the test adds a permit to the
/// returned semaphore (one per request, in the order they came).
async fn worker_awaiting_first_tokens() -> (FakeWorker, Arc<tokio::sync::Semaphore>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (requests, connections) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let permits = Arc::new(tokio::sync::Semaphore::new(0));
    let (count, first_tokens) = (requests.clone(), permits.clone());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let (count, first_tokens) = (count.clone(), first_tokens.clone());
            tokio::spawn(async move {
                while read_request(&mut sock).await {
                    count.fetch_add(1, Ordering::SeqCst);
                    first_tokens.acquire().await.unwrap().forget();
                    if !answer(&mut sock, Script::Stream(2)).await {
                        return;
                    }
                }
            });
        }
    });
    (FakeWorker { url, requests, connections }, permits)
}

/// With `prefill_gate`, a long streamed prompt waits at the gateway while the long prompt sent
/// ahead of it to the same worker has no first token, and is sent when that token comes; a
/// short prompt is sent at once.
#[tokio::test]
async fn a_long_prompt_waits_for_the_prompt_ahead_on_its_worker() {
    let (w, first_tokens) = worker_awaiting_first_tokens().await;
    let routing = "    routing:\n      mode: kv\n      kv_events: false\n      prefill_gate: true\n";
    let yaml = format!("models:\n  - name: m\n{routing}    workers:\n      - url: {}\n", w.url);
    let gw = Gateway::new(load_str(&yaml, "test", Vec::new()).unwrap(), None).unwrap();
    let ledger = gw.fleet().model("m").unwrap().ledger.clone();
    let stream = |tokens: u32, first: u32| {
        let ids: Vec<String> = (first..first + tokens).map(|t| t.to_string()).collect();
        post(&format!(r#"{{"model":"m","prompt":[{}],"stream":true,"max_tokens":64}}"#, ids.join(",")))
    };
    let send = |request: String| {
        let gw = gw.clone();
        tokio::spawn(async move { serve_one(&gw, &request).await })
    };
    let a = send(stream(2048, 1));
    until(|| w.requests.load(Ordering::SeqCst) == 1).await;
    let b = send(stream(2048, 10_000));
    until(|| ledger.gate_waiting(0) == 1).await;
    let short = send(stream(16, 20_000));
    until(|| w.requests.load(Ordering::SeqCst) == 2).await;
    assert_eq!(ledger.gate_waiting(0), 1, "the long prompt is still held; the short one went");
    first_tokens.add_permits(1);
    until(|| w.requests.load(Ordering::SeqCst) == 3).await;
    assert_eq!(ledger.gate_waiting(0), 0);
    first_tokens.add_permits(2);
    for r in [a, b, short] {
        let (aborted, out) = r.await.unwrap();
        assert!(!aborted && status_of(&out) == 200, "{out}");
    }
    assert_clean(&gw);
}
