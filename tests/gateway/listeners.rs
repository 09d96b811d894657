//! Listeners: each server a test starts binds once and is reached as itself. A gateway binds
//! its sockets before it serves, so an address another program holds fails its start, and its
//! readiness asks `/health` for its own instance id; kvgate writes no byte a request did not
//! ask for.

use super::post;
use kvgate::GatewayHandle;
use kvgate_tests::cluster::{Cluster, GatewayOpts};
use kvgate_tests::target::test_sim_config;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use vllm_sim::SimConfig;
use zeromq::Socket;

fn config(worker: &str) -> kvgate::config::Config {
    let yaml = format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nthreads: 1\nmodels:\n  - name: sim-model\n    workers:\n      - url: {worker}\n");
    kvgate::config::load::load_str(&yaml, "<test>", Vec::<(String, String)>::new()).expect("valid")
}

async fn spawn(cfg: kvgate::config::Config) -> std::io::Result<GatewayHandle> {
    kvgate_tests::logs::capture();
    tokio::task::spawn_blocking(move || GatewayHandle::spawn(cfg, None)).await.expect("join")
}

/// An address another socket holds fails the start and names the address. The hazard it
/// guards against: a simulator's KV-event PUB socket greets every connection first (ZMTP's
/// signature), so a gateway that served "on" a port such a socket held, or a readiness check
/// that took it for the gateway, hands an HTTP client bytes it never asked for (hyper's
/// `UnexpectedMessage`).
#[tokio::test(flavor = "multi_thread")]
async fn an_address_another_socket_holds_fails_the_start() {
    let mut zmq = zeromq::PubSocket::new();
    let ep = zmq.bind("tcp://0.0.0.0:0").await.expect("bind");
    let port: u16 = ep.to_string().rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port");
    // The socket speaks before any request: an HTTP client there reads bytes it never asked for.
    let mut raw = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut greeting = [0u8; 10];
    raw.read_exact(&mut greeting).expect("ZMTP greets first");
    assert_eq!((greeting[0], greeting[9]), (0xff, 0x7f), "ZMTP signature: {greeting:?}");

    let mut cfg = config("http://127.0.0.1:1");
    cfg.listen.set_port(port);
    let e = spawn(cfg).await.expect_err("the address is taken");
    assert!(e.to_string().contains(&format!("cannot listen on 127.0.0.1:{port} (listen)")), "{e}");
}

/// One address for both listeners fails the start. Handed to Pingora to bind, it would give one
/// descriptor to both services, and the second to close it would abort the process ("IO Safety
/// violation: owned file descriptor already closed").
#[tokio::test(flavor = "multi_thread")]
async fn one_address_for_both_listeners_fails_the_start() {
    let port = kvgate_tests::ports::reserved_run(1);
    let mut cfg = config("http://127.0.0.1:1");
    cfg.listen.set_port(port);
    cfg.admin_listen.set_port(port);
    let e = spawn(cfg).await.expect_err("one address cannot be bound twice");
    assert!(e.to_string().contains("(admin_listen)"), "{e}");
}

/// Two gateways and four simulators started at once in one process: every socket has a port
/// of its own, each gateway's `/health` names its own instance, and each client reaches the
/// servers it meant to.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_and_their_sims_each_reach_their_own() {
    let sim = |model: &str| SimConfig { model: model.into(), ..test_sim_config() };
    let (a, b) = tokio::join!(Cluster::sims_with_events(2, sim("model-a"), opts("model-a")), Cluster::sims_with_events(2, sim("model-b"), opts("model-b")));
    let mut ports = HashSet::new();
    for c in [&a, &b] {
        assert!(ports.insert(c.gw().listen.port()) && ports.insert(c.gw().admin.port()), "a gateway port repeats: {ports:?}");
        for s in &c.sims {
            let endpoints = [s.url()].into_iter().chain(s.kv_event_endpoints()).chain(s.replay_endpoints());
            for e in endpoints {
                let port: u16 = e.rsplit(':').next().and_then(|p| p.trim_end_matches('/').parse().ok()).expect("a port");
                assert!(ports.insert(port), "{e} repeats a port: {ports:?}");
            }
        }
    }
    let health = |c: &Cluster, url: String| {
        let http = c.http.clone();
        async move { http.get(url).send().await.expect("health").json::<Value>().await.expect("json")["instance"].as_str().map(str::to_owned) }
    };
    for c in [&a, &b] {
        let me = c.gw().gateway.instance().to_string();
        assert_eq!(health(c, c.url("/health")).await.as_deref(), Some(me.as_str()));
        assert_eq!(health(c, c.admin("/health")).await.as_deref(), Some(me.as_str()));
    }
    assert_ne!(a.gw().gateway.instance(), b.gw().gateway.instance());
    for (c, model) in [(&a, "model-a"), (&b, "model-b")] {
        let mine: HashSet<String> = c.sims.iter().map(|s| s.url().trim_end_matches('/').to_string()).collect();
        for _ in 0..4 {
            let r = c.http.post(c.url("/v1/completions")).json(&json!({"model": model, "prompt": "hello", "max_tokens": 2})).send().await.expect("sent");
            assert_eq!(r.status(), 200);
            let worker = r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().trim_end_matches('/').to_string();
            assert!(mine.contains(&worker), "{model} answered by {worker}, not one of {mine:?}");
            let v: Value = r.json().await.expect("json");
            assert_eq!(v["model"], model, "{v}");
        }
        let other = if model == "model-a" { "model-b" } else { "model-a" };
        let (s, _) = post(&c.http, &c.url("/v1/completions"), &json!({"model": other, "prompt": "hello", "max_tokens": 1})).await;
        assert_eq!(s, 404, "a gateway serves only its own model");
    }
}

fn opts(model: &str) -> GatewayOpts {
    GatewayOpts { model: model.into(), ..GatewayOpts::default() }
}

/// Reads one HTTP/1.1 response (head, then a `content-length` or chunked body) from `s`.
fn read_response(s: &mut TcpStream) -> (String, Vec<u8>) {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).expect("a response head");
        buf.push(byte[0]);
    }
    let head = String::from_utf8(buf).expect("ASCII head");
    let lower = head.to_ascii_lowercase();
    let mut body = Vec::new();
    if let Some(n) = lower.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|n| n.trim().parse::<usize>().ok()) {
        body.resize(n, 0);
        s.read_exact(&mut body).expect("the body");
    } else if lower.contains("transfer-encoding: chunked") {
        while !body.ends_with(b"\r\n0\r\n\r\n") && body != b"0\r\n\r\n" {
            s.read_exact(&mut byte).expect("a chunk");
            body.push(byte[0]);
        }
    }
    (head, body)
}

/// Nothing arrives within a short wait (the connection is idle and open, or closed).
fn quiet(s: &mut TcpStream) -> Result<(), Vec<u8>> {
    s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let mut extra = [0u8; 256];
    let r = match s.read(&mut extra) {
        Ok(0) => Ok(()),
        Ok(n) => Err(extra[..n].to_vec()),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => Ok(()),
        Err(e) => panic!("read: {e}"),
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    r
}

/// On a raw socket: no byte before the first request, exactly one response per request (whole
/// answers, errors, a stream), none after the last.
#[tokio::test(flavor = "multi_thread")]
async fn kvgate_writes_nothing_a_request_did_not_ask_for() {
    let c = Cluster::sims(1, test_sim_config(), GatewayOpts::default()).await;
    let addr = c.gw().listen;
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(quiet(&mut s), Ok(()), "bytes before any request");
        let body = |v: Value| v.to_string();
        let requests = [
            ("GET", "/health", String::new()),
            ("POST", "/v1/completions", body(json!({"model": "sim-model", "prompt": "hi", "max_tokens": 2}))),
            ("POST", "/v1/completions", "{not json".to_string()),
            ("GET", "/no/such/path", String::new()),
            ("POST", "/v1/completions", body(json!({"model": "sim-model", "prompt": "hi", "max_tokens": 3, "stream": true}))),
            ("GET", "/v1/models", String::new()),
        ];
        for (method, path, body) in &requests {
            let req = format!("{method} {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
            s.write_all(req.as_bytes()).expect("send");
            let (head, body) = read_response(&mut s);
            assert!(head.starts_with("HTTP/1.1 "), "{head}");
            if head.to_ascii_lowercase().contains("text/event-stream") {
                assert!(String::from_utf8_lossy(&body).contains("data: [DONE]"), "the stream ends whole");
            }
            assert_eq!(quiet(&mut s), Ok(()), "bytes after the answer to {method} {path} ({head})");
        }
    })
    .await
    .expect("raw client");
}
