//! What the gateway answers for the fleet as a whole: `/v1/models` from the workers' own
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
    let c = Cluster::front(&[url.clone(), url2.clone()], GatewayOpts::real_vllm(&model)).await;
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
    // Streams in flight freeze on their paused workers (`mode=keep`); a new request waits in
    // the gateway.
    for sim in &c.sims {
        let v: Value = c.http.get(format!("{}/is_paused", sim.url())).send().await.unwrap().json().await.unwrap();
        assert_eq!(v["is_paused"], true, "{v}");
    }
    let late = tokio::spawn({
        let (http, url) = (c.http.clone(), c.url("/v1/chat/completions"));
        async move { one_stream(&http, &url, 999_999).await }
    });
    let held = wait_until(Duration::from_secs(20), || async { c.gateway_metrics().await.sum("kvgate_queued_requests", &[]) >= 1.0 }).await;
    assert!(held.is_some(), "a request arriving while paused waits in the gateway");
    let before = count();
    let (s, v) = post(&c.http, &c.admin("/resume"), &json!({})).await;
    assert!(s == 200 || v["results"].as_array().unwrap().iter().all(|r| r["status"] == 404), "{v}");
    assert!(wait_until(Duration::from_secs(20), || async { count() >= before + 16 }).await.is_some(), "load resumes");
    eprintln!("resume: {s} {v}; {before} streams before, {} after", count());
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut errors: Vec<String> = late.await.unwrap().err().into_iter().collect();
    for cl in clients {
        errors.extend(cl.await.unwrap());
    }
    assert!(errors.is_empty(), "{} client errors: {:?}", errors.len(), &errors[..errors.len().min(3)]);
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_queued_requests", &[]), 0.0);
    assert!(m.sum("kvgate_queue_wait_seconds_count", &[]) >= 1.0, "the held request was counted as queued");
}

/// Two simulators, only the second serving adapter `sql`: the gateway lists the workers' cards
/// (the adapter with its `parent`), sends every request naming the adapter to the second, base
/// requests to both, and an adapter no worker has is an unknown model.
#[tokio::test]
async fn adapter_requests_land_only_on_workers_with_the_adapter() {
    let plain = vllm_sim::SimServer::start(super::sim(50.0)).await.unwrap();
    // The simulator, like vLLM, loads only a folder holding an adapter_config.json.
    let dir = kvgate_tests::cluster::TempDir::new();
    std::fs::write(dir.0.join("adapter_config.json"), r#"{"r": 8, "peft_type": "LORA"}"#).unwrap();
    let path = dir.0.display().to_string();
    let modules = vllm_sim::lora::parse_lora_modules(&[format!("sql={path}")]).unwrap();
    let lora = vllm_sim::SimServer::start(vllm_sim::SimConfig { enable_lora: true, lora_modules: modules, ..super::sim(50.0) }).await.unwrap();
    let mut c = Cluster::front(&[plain.url(), lora.url()], GatewayOpts::default()).await;
    let adapter = card(&c, "sql").await;
    assert_eq!((adapter["parent"].as_str(), adapter["root"].as_str()), (Some("sim-model"), Some(path.as_str())), "{adapter}");
    assert_eq!(card(&c, "sim-model").await["max_model_len"], 4096);
    let mut seen = std::collections::HashSet::new();
    for (n, model) in ["sql"; 6].iter().chain(&["sim-model"; 4]).enumerate() {
        let body = json!({"model": model, "prompt": format!("adapter test {n}"), "max_tokens": 2});
        let r = c.http.post(c.url("/v1/completions")).json(&body).send().await.unwrap();
        let worker = r.headers()["x-kvgate-worker"].to_str().unwrap().to_string();
        assert_eq!(r.status(), 200);
        if *model == "sql" {
            assert_eq!(worker, lora.url(), "request {n}");
        } else {
            seen.insert(worker);
        }
    }
    assert_eq!(seen.len(), 2, "base requests use both workers");
    let (s, v) = post(&c.http, &c.url("/v1/completions"), &json!({"model": "nope", "prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, 404, "{v}");
    c.sims = vec![plain, lora];
}

/// With an admin token, every admin endpoint but `/metrics` and `/health` answers 401 without
/// it or with a wrong one (counted), and works with it.
#[tokio::test]
async fn the_admin_token_guards_every_admin_endpoint_but_metrics_and_health() {
    let sim = vllm_sim::SimServer::start(kvgate_tests::target::test_sim_config()).await.expect("sim starts");
    let dir = kvgate_tests::cluster::TempDir::new();
    let token_file = dir.0.join("admin-token");
    std::fs::write(&token_file, "t0ken-for-tests\n").unwrap();
    let opts = GatewayOpts { extra: format!("admin_token_file: {}", token_file.display()), ..GatewayOpts::default() };
    let c = Cluster::front(&[sim.url()], opts).await;
    let guarded: &[(&str, &str)] = &[
        ("GET", "/workers"),
        ("GET", "/requests"),
        ("GET", "/requests/abc"),
        ("POST", "/reload"),
        ("POST", "/migrate"),
        ("GET", "/rescheduling"),
        ("GET", "/planner"),
        ("GET", "/busy_threshold"),
        ("POST", "/busy_threshold"),
        ("GET", "/plugins"),
        ("POST", "/plugins/reload"),
        ("POST", "/pause"),
        ("POST", "/reset_prefix_cache"),
        ("GET", "/no-such-path"),
    ];
    let send = |m: &str, p: &str, auth: Option<&str>| {
        let mut r = c.http.request(m.parse().unwrap(), c.admin(p));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        async move { r.send().await.unwrap() }
    };
    for (m, p) in guarded {
        for auth in [None, Some("Bearer wrong"), Some("Bearer t0ken-for-tests-"), Some("t0ken-for-tests")] {
            let r = send(m, p, auth).await;
            assert_eq!(r.status(), 401, "{m} {p} with {auth:?}");
            assert_eq!(r.headers().get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["type"], "authentication_error", "{v}");
            assert!(!v.to_string().contains("t0ken-for-tests"), "the token is never echoed");
        }
    }
    for p in ["/metrics", "/health"] {
        assert_eq!(send("GET", p, None).await.status(), 200, "{p} stays open");
    }
    let ok = send("GET", "/workers", Some("Bearer t0ken-for-tests")).await;
    assert_eq!(ok.status(), 200);
    assert_eq!(send("POST", "/reload", Some("Bearer t0ken-for-tests")).await.status(), 200);
    let refused = c.gateway_metrics().await.sum("kvgate_admin_unauthorized_total", &[]);
    assert_eq!(refused, (guarded.len() * 4) as f64);
}

/// `x-kvgate-worker` names the worker without its address by default; `url` and `off` as
/// asked.
#[tokio::test]
async fn the_worker_header_hides_addresses_by_default() {
    let sim = vllm_sim::SimServer::start(kvgate_tests::target::test_sim_config()).await.expect("sim starts");
    let yaml = |header: &str, name: &str| {
        format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{header}models:\n  - name: sim-model\n    workers:\n      - url: {}\n{name}", sim.url())
    };
    let body = json!({"model": "sim-model", "prompt": "hello", "max_tokens": 2});
    let header = |c: &Cluster| {
        let (http, url) = (c.http.clone(), c.url("/v1/completions"));
        let body = body.clone();
        async move {
            let r = http.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.headers().get("x-kvgate-worker").map(|v| v.to_str().unwrap().to_string())
        }
    };
    let default = Cluster::front_yaml(yaml("", "")).await;
    let shown = header(&default).await.expect("a worker header");
    assert!(shown.starts_with("w-") && !shown.contains("127.0.0.1"), "{shown}");
    assert_eq!(header(&default).await.as_deref(), Some(shown.as_str()), "stable");
    let named = Cluster::front_yaml(yaml("", "        name: gpu-node-7\n")).await;
    assert_eq!(header(&named).await.as_deref(), Some("gpu-node-7"));
    let url = Cluster::front_yaml(yaml("worker_header: url\n", "")).await;
    assert_eq!(header(&url).await, Some(sim.url()));
    let off = Cluster::front_yaml(yaml("worker_header: off\n", "")).await;
    assert_eq!(header(&off).await, None);
}

/// Past `max_connections`, a new client connection is closed at once and counted; one that
/// closes makes room.
#[tokio::test]
async fn connections_past_the_cap_are_closed_and_counted() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = vllm_sim::SimServer::start(kvgate_tests::target::test_sim_config()).await.expect("sim starts");
    let c = Cluster::front(&[sim.url()], GatewayOpts { extra: "max_connections: 2".into(), ..GatewayOpts::default() }).await;
    let addr = c.gw().listen;
    let open = |n: f64| {
        let c = &c;
        async move { c.gateway_metrics().await.sum("kvgate_client_connections", &[("listener", "public")]) == n }
    };
    // The harness's own probes have closed: the count starts from nothing.
    assert!(wait_until(Duration::from_secs(10), || open(0.0)).await.is_some(), "no client connection left open");
    // Two slow clients, each with half a request head.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        held.push(s);
    }
    assert!(wait_until(Duration::from_secs(10), || open(2.0)).await.is_some(), "both slow clients are counted");
    let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), third.read(&mut buf)).await.expect("closed, not left hanging").unwrap_or(0);
    assert_eq!(n, 0, "the third connection is closed without an answer");
    let refused = c.gateway_metrics().await.sum("kvgate_refused_connections_total", &[("reason", "max_connections")]);
    assert_eq!(refused, 1.0);
    drop(held.pop());
    let freed = wait_until(Duration::from_secs(5), || async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        if s.write_all(req).await.is_err() {
            return false;
        }
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut out)).await;
        out.starts_with(b"HTTP/1.1 200")
    })
    .await;
    assert!(freed.is_some(), "a closed connection makes room for the next");
}

/// `per_client.max_concurrent`: a client with that many requests in flight gets 429 with
/// `Retry-After` for the next, counted; one ending makes room; clients told apart by an API-key
/// header count apart.
#[tokio::test]
async fn a_client_over_its_concurrent_requests_gets_429() {
    let sim = vllm_sim::SimServer::start(super::sim(1.0)).await.expect("sim starts");
    let extra = "per_client:\n  max_concurrent: 2\n  header: x-api-key\n";
    let c = Cluster::front(&[sim.url()], GatewayOpts { extra: extra.into(), ..GatewayOpts::default() }).await;
    let long = json!({"model": "sim-model", "prompt": "a long answer", "max_tokens": 400, "stream": true, "ignore_eos": true});
    let send = |key: &'static str| c.http.post(c.url("/v1/completions")).header("x-api-key", key).json(&long).send();
    let first = send("alice").await.unwrap();
    let second = send("alice").await.unwrap();
    assert_eq!((first.status().as_u16(), second.status().as_u16()), (200, 200));
    let third = send("alice").await.unwrap();
    assert_eq!(third.status().as_u16(), 429);
    assert_eq!(third.headers()["retry-after"], "1");
    let body: Value = third.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_exceeded", "{body}");
    // Another key is another client.
    let other = send("bob").await.unwrap();
    assert_eq!(other.status().as_u16(), 200);
    drop(other);
    // A stream the client drops gives its place back.
    drop(first);
    let again = wait_until(Duration::from_secs(10), || async {
        let r = c
            .http
            .post(c.url("/v1/completions"))
            .header("x-api-key", "alice")
            .json(&json!({"model": "sim-model", "prompt": "x", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        r.status().as_u16() == 200
    })
    .await;
    assert!(again.is_some(), "the dropped stream's place came back");
    let m = c.gateway_metrics().await;
    // The third, and any retry above that came before the dropped stream's place was given back.
    assert!(m.sum("kvgate_client_limited_total", &[]) >= 1.0);
    drop(second);
}
