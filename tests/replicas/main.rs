//! Several kvgate replicas acting as one router over a real `nats-server` (docs/replicas.md):
//! shared bookings, their removal with a silent replica, stored responses found from another
//! replica, admin requests answered by the replica holding the request, one leader and its
//! successor, a NATS restart, and a request path that never waits for NATS.

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the gateway reports as floats")]

use futures_util::StreamExt;
use kvgate_tests::cluster::{Cluster, GatewayOpts, wait_until};
use kvgate_tests::nats::NatsServer;
use kvgate_tests::target::{test_sim_config, unique_text};
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use vllm_sim::{SimConfig, SimServer};

/// Replicas of one deployment in front of the same simulators.
struct Replicas {
    nats: NatsServer,
    _sims: Vec<SimServer>,
    gws: Vec<Cluster>,
}

/// The `cluster` section of replica `name`, with timings short enough for a test.
fn cluster_yaml(nats: &str, name: &str) -> String {
    format!("cluster:\n  nats_url: {nats}\n  deployment: test\n  replica: {name}\n  heartbeat_ms: 200\n  peer_timeout_ms: 600\n  lease_ms: 800\n")
}

async fn replicas(n: usize, workers: usize, sim: SimConfig) -> Replicas {
    replicas_with(n, workers, sim, GatewayOpts::default()).await
}

/// [`replicas`] whose gateways are configured as `base` says, besides their `cluster` section.
async fn replicas_with(n: usize, workers: usize, sim: SimConfig, base: GatewayOpts) -> Replicas {
    let mut sims = Vec::new();
    for _ in 0..workers {
        sims.push(SimServer::start(sim.clone()).await.expect("sim starts"));
    }
    let urls: Vec<String> = sims.iter().map(SimServer::url).collect();
    replicas_over(n, sims, &urls, base).await
}

/// `n` replicas configured as `base` says in front of `urls` (served by `sims`, or real vLLM).
async fn replicas_over(n: usize, sims: Vec<SimServer>, urls: &[String], base: GatewayOpts) -> Replicas {
    let nats = NatsServer::start();
    let mut gws = Vec::new();
    for i in 0..n {
        let opts = GatewayOpts { extra: format!("{}\n{}", base.extra, cluster_yaml(&nats.url(), &format!("r{i}"))), ..base.clone() };
        gws.push(Cluster::front(urls, opts).await);
    }
    let r = Replicas { nats, _sims: sims, gws };
    for g in &r.gws {
        let formed = wait_until(Duration::from_secs(10), || async { peers(g).await.len() == n - 1 }).await;
        assert!(formed.is_some(), "replica {} sees its {} peers: {}", g.gw().admin_url(), n - 1, cluster(g).await);
    }
    r
}

/// The replicas that say they lead, by index.
async fn leaders(gws: &[Cluster]) -> Vec<usize> {
    let mut v = Vec::new();
    for (i, g) in gws.iter().enumerate() {
        if cluster(g).await["leads"] == true {
            v.push(i);
        }
    }
    v
}

fn sim(time_scale: f64) -> SimConfig {
    SimConfig { time_scale, ..test_sim_config() }
}

async fn get(g: &Cluster, path: &str) -> Value {
    g.http.get(g.admin(path)).send().await.expect("admin up").json().await.expect("json")
}

async fn cluster(g: &Cluster) -> Value {
    get(g, "/cluster").await
}

async fn peers(g: &Cluster) -> Vec<Value> {
    cluster(g).await["peers"].as_array().cloned().unwrap_or_default()
}

/// Requests in flight on each worker as replica `g` sees them (its own and its peers').
async fn in_flight(g: &Cluster) -> Vec<u64> {
    get(g, "/workers").await["models"][0]["workers"].as_array().expect("workers").iter().map(|w| w["in_flight"].as_u64().unwrap_or(0)).collect()
}

/// A stream through `g`, opened and read to its first chunk; the rest is the caller's.
async fn open_stream(g: &Cluster, id: String, tokens: u32) -> reqwest::Response {
    let body = json!({"model": "sim-model", "prompt": unique_text(20), "max_tokens": tokens, "ignore_eos": true, "stream": true, "return_token_ids": true});
    let r = g.http.post(g.url("/v1/completions")).header("x-request-id", id.as_str()).json(&body).send().await.expect("sent");
    assert_eq!(r.status(), 200);
    r
}

async fn drain(r: reqwest::Response) -> String {
    let mut s = r.bytes_stream();
    let mut raw = Vec::new();
    while let Some(c) = s.next().await {
        raw.extend_from_slice(&c.expect("never cut"));
    }
    String::from_utf8(raw).expect("utf-8")
}

#[tokio::test]
async fn each_replica_sees_the_others_bookings_and_they_return_to_zero() {
    let r = replicas(2, 2, sim(1.0)).await;
    let streams: Vec<_> = futures_util::future::join_all((0..4).map(|i| open_stream(&r.gws[0], format!("s{i}"), 150))).await;
    let seen = wait_until(Duration::from_secs(5), || async { in_flight(&r.gws[1]).await.iter().sum::<u64>() == 4 }).await;
    assert!(seen.is_some(), "replica 1 sees replica 0's four streams: {:?}", in_flight(&r.gws[1]).await);
    assert_eq!(in_flight(&r.gws[1]).await, in_flight(&r.gws[0]).await, "both views agree");
    let w: Value = get(&r.gws[1], "/workers").await;
    let peer: u64 = w["models"][0]["workers"].as_array().unwrap().iter().map(|w| w["peer_in_flight"].as_u64().unwrap()).sum();
    assert_eq!(peer, 4, "all of them the peer's: {w}");
    for s in streams {
        drain(s).await;
    }
    let zero = wait_until(Duration::from_secs(5), || async { in_flight(&r.gws[1]).await.iter().all(|&n| n == 0) }).await;
    assert!(zero.is_some(), "views return to zero: {:?}", in_flight(&r.gws[1]).await);
    assert!(in_flight(&r.gws[0]).await.iter().all(|&n| n == 0));
}

#[tokio::test]
async fn a_silent_replicas_bookings_leave_the_others_views_within_the_peer_timeout() {
    let mut r = replicas(2, 2, sim(1.0)).await;
    let streams: Vec<_> = futures_util::future::join_all((0..3).map(|i| open_stream(&r.gws[0], format!("s{i}"), 400))).await;
    let seen = wait_until(Duration::from_secs(5), || async { in_flight(&r.gws[1]).await.iter().sum::<u64>() == 3 }).await;
    assert!(seen.is_some(), "{:?}", in_flight(&r.gws[1]).await);
    // Replica 0 stops without a word (its streams are cut with it).
    let stopped = Instant::now();
    let mut gone = r.gws.remove(0);
    gone.stop_gateway(kvgate::Stop::Fast).await;
    drop(streams);
    let left = wait_until(Duration::from_secs(5), || async { in_flight(&r.gws[0]).await.iter().all(|&n| n == 0) }).await;
    let took = stopped.elapsed();
    assert!(left.is_some(), "its bookings leave: {:?}", in_flight(&r.gws[0]).await);
    // peer_timeout_ms (600) and one tick of the survivor's check, with room for a slow machine.
    assert!(took < Duration::from_millis(600 + 1_000), "took {took:?}");
    assert!(peers(&r.gws[0]).await.is_empty());
    let m = r.gws[0].gateway_metrics().await;
    assert!(m.sum("kvgate_cluster_peers_expired_total", &[]) >= 1.0);
}

/// The real-vLLM pair when the environment names one (tests/real-vllm/run-suite.sh, its servers
/// started with VLLM_ENABLE_RESPONSES_API_STORE=1), else three simulators storing responses;
/// and the model they serve.
async fn storing_replicas() -> (Replicas, String) {
    match (std::env::var("KVGATE_TARGET_URL"), std::env::var("KVGATE_TARGET_URL_2")) {
        (Ok(a), Ok(b)) => {
            let model = std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into());
            (replicas_over(2, Vec::new(), &[a, b], GatewayOpts::real_vllm(&model)).await, model)
        }
        _ => (replicas(2, 3, SimConfig { responses_store: true, ..test_sim_config() }).await, "sim-model".into()),
    }
}

#[tokio::test]
async fn a_stored_responses_next_turn_lands_on_its_worker_from_any_replica() {
    let (r, model) = storing_replicas().await;
    let worker = |resp: &reqwest::Response| resp.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    for turn in 0..6 {
        let (a, b) = (&r.gws[turn % 2], &r.gws[(turn + 1) % 2]);
        let first = a.http.post(a.url("/v1/responses")).json(&json!({"model": model, "input": unique_text(8), "max_output_tokens": 2})).send().await.unwrap();
        assert_eq!(first.status(), 200);
        let home = worker(&first);
        let v: Value = first.json().await.unwrap();
        let id = v["id"].as_str().expect("a response id").to_string();
        // Shared through the bucket: the other replica learns it within moments, and then
        // sends the next turn there whatever its own round robin would say.
        let knows = wait_until(Duration::from_secs(5), || async {
            let v = get(b, &format!("/responses/{id}")).await;
            v["worker"].as_str().is_some_and(|w| w.trim_end_matches('/') == home.trim_end_matches('/'))
        })
        .await;
        assert!(knows.is_some_and(|t| t < Duration::from_secs(1)), "turn {turn}: replica b learned where {id} lives within a second ({knows:?})");
        let body = json!({"model": model, "input": "and then?", "previous_response_id": id, "max_output_tokens": 2});
        let next = b.http.post(b.url("/v1/responses")).json(&body).send().await.unwrap();
        assert_eq!((next.status().as_u16(), worker(&next)), (200, home.clone()), "turn {turn}");
    }
}

#[tokio::test]
async fn any_replica_answers_for_a_request_another_holds_and_moves_it() {
    let r = replicas(2, 2, sim(1.0)).await;
    let s = open_stream(&r.gws[0], "held-by-0".into(), 120).await;
    let v = get(&r.gws[1], "/requests/held-by-0").await;
    assert_eq!(v["id"], "held-by-0", "{v}");
    assert!(v["route_receipt"].is_array(), "the holder's receipt: {v}");
    let missing = r.gws[1].http.get(r.gws[1].admin("/requests/nowhere")).send().await.unwrap();
    assert_eq!(missing.status(), 404);
    let moved = r.gws[1].http.post(r.gws[1].admin("/migrate")).json(&json!({"request_id": "held-by-0"})).send().await.unwrap();
    let (status, report) = (moved.status().as_u16(), moved.json::<Value>().await.unwrap());
    assert_eq!(status, 200, "{report}");
    assert_ne!(report["from"], report["to"], "{report}");
    let text = drain(s).await;
    assert!(text.trim_end().ends_with("data: [DONE]"), "the moved stream ends whole");
    let m = r.gws[1].gateway_metrics().await;
    assert_eq!(m.sum("kvgate_cluster_forwarded_total", &[("what", "migrate"), ("outcome", "answered")]), 1.0);
}

#[tokio::test]
async fn one_replica_leads_and_another_takes_over_when_it_stops() {
    let mut r = replicas(3, 1, sim(4.0)).await;
    let one = wait_until(Duration::from_secs(5), || async { leaders(&r.gws).await.len() == 1 }).await;
    assert!(one.is_some(), "exactly one leader: {:?}", leaders(&r.gws).await);
    let first = leaders(&r.gws).await[0];
    for _ in 0..5 {
        assert_eq!(leaders(&r.gws).await, vec![first], "never two");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut gone = r.gws.remove(first);
    let stopped = Instant::now();
    gone.stop_gateway(kvgate::Stop::Fast).await;
    let next = wait_until(Duration::from_secs(10), || async { leaders(&r.gws).await.len() == 1 }).await;
    assert!(next.is_some(), "a successor leads");
    // lease_ms (800) after its last renewal, and a heartbeat (200) to notice.
    assert!(stopped.elapsed() < Duration::from_millis(800 + 200 + 2_000), "took {:?}", stopped.elapsed());
    let name = cluster(&r.gws[leaders(&r.gws).await[0]]).await["replica"].clone();
    for g in &r.gws {
        let seen = wait_until(Duration::from_secs(3), || async { cluster(g).await["leader"] == name }).await;
        assert!(seen.is_some(), "every replica names the new leader {name}");
    }
}

#[tokio::test]
async fn after_nats_restarts_the_replicas_resync_and_serve_throughout() {
    let mut r = replicas(2, 2, sim(1.0)).await;
    r.nats.kill();
    // Requests keep being served while NATS is gone.
    for i in 0..5 {
        let g = &r.gws[i % 2];
        let resp = g.http.post(g.url("/v1/completions")).json(&json!({"model": "sim-model", "prompt": unique_text(5), "max_tokens": 2})).send().await.unwrap();
        assert_eq!(resp.status(), 200);
    }
    r.nats.restart();
    for g in &r.gws {
        let back = wait_until(Duration::from_secs(10), || async {
            g.gateway_metrics().await.sum("kvgate_cluster_resyncs_total", &[]) >= 1.0 && peers(g).await.len() == 1
        })
        .await;
        assert!(back.is_some(), "resynced: {}", cluster(g).await);
    }
    let streams: Vec<_> = futures_util::future::join_all((0..2).map(|i| open_stream(&r.gws[0], format!("after{i}"), 150))).await;
    let seen = wait_until(Duration::from_secs(5), || async { in_flight(&r.gws[1]).await.iter().sum::<u64>() == 2 }).await;
    assert!(seen.is_some(), "views converge again: {:?}", in_flight(&r.gws[1]).await);
    for s in streams {
        drain(s).await;
    }
}

#[tokio::test]
async fn the_request_path_never_waits_for_a_silent_nats() {
    let r = replicas(2, 2, sim(50.0)).await;
    let g = &r.gws[0];
    let time_requests = || async {
        let mut took = Vec::new();
        for _ in 0..20 {
            let t = Instant::now();
            let resp =
                g.http.post(g.url("/v1/completions")).json(&json!({"model": "sim-model", "prompt": unique_text(5), "max_tokens": 1})).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            took.push(t.elapsed());
        }
        took.sort();
        took[took.len() / 2]
    };
    let before = time_requests().await;
    r.nats.freeze();
    // Held silent past a heartbeat, so every publish and renewal meets it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = time_requests().await;
    r.nats.thaw();
    assert!(during < before * 3 + Duration::from_millis(20), "median {during:?} with NATS silent, {before:?} before");
}

#[tokio::test]
async fn approximate_mode_learns_the_peers_routing_decisions() {
    let base = GatewayOpts { mode: "kv".into(), routing_extra: "kv_events: false".into(), ..GatewayOpts::default() };
    let r = replicas_with(2, 4, sim(8.0), base).await;
    let (a, b) = (&r.gws[0], &r.gws[1]);
    let worker = |resp: &reqwest::Response| resp.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    for k in 0..6u32 {
        // A prompt of its own: 16 blocks no other prompt shares.
        let prompt: Vec<u32> = (0..256).map(|t| 100 + k * 256 + t).collect();
        let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1});
        let first = a.http.post(a.url("/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!(first.status(), 200);
        let home = worker(&first);
        let learned =
            wait_until(Duration::from_secs(5), || async { b.gateway_metrics().await.sum("kvgate_cluster_decisions_applied_total", &[]) >= f64::from(k + 1) })
                .await;
        assert!(learned.is_some(), "replica b recorded replica a's decision {k}");
        let again = b.http.post(b.url("/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!(worker(&again), home, "prompt {k}: replica b predicts the cache replica a filled");
    }
}

#[tokio::test]
async fn a_replica_that_starts_late_gets_its_peers_bookings_at_once() {
    // Heartbeats 10 s apart: what the late replica learns sooner, its peer sent on its hello.
    let nats = NatsServer::start();
    let mut sims = Vec::new();
    for _ in 0..2 {
        sims.push(SimServer::start(sim(1.0)).await.expect("sim starts"));
    }
    let urls: Vec<String> = sims.iter().map(SimServer::url).collect();
    let slow = |name: &str| GatewayOpts {
        extra: format!(
            "cluster:\n  nats_url: {}\n  deployment: test\n  replica: {name}\n  heartbeat_ms: 10000\n  peer_timeout_ms: 30000\n  lease_ms: 20000\n",
            nats.url()
        ),
        ..GatewayOpts::default()
    };
    let a = Cluster::front(&urls, slow("a")).await;
    let up = wait_until(Duration::from_secs(5), || async { cluster(&a).await["connected"] == true }).await;
    assert!(up.is_some(), "{}", cluster(&a).await);
    let streams: Vec<_> = futures_util::future::join_all((0..3).map(|i| open_stream(&a, format!("early{i}"), 400))).await;
    let b = Cluster::front(&urls, slow("b")).await;
    let seen = wait_until(Duration::from_secs(5), || async { in_flight(&b).await.iter().sum::<u64>() == 3 }).await;
    assert!(seen.is_some(), "the late replica sees its peer's three streams before a heartbeat: {:?}", in_flight(&b).await);
    drop(streams);
}

#[tokio::test]
async fn a_prefix_a_peers_request_is_computing_counts_as_booked() {
    let base = GatewayOpts { mode: "kv".into(), routing_extra: "kv_events: false".into(), ..GatewayOpts::default() };
    let r = replicas_with(2, 3, sim(1.0), base).await;
    let (a, b) = (&r.gws[0], &r.gws[1]);
    let chains = |g: &Cluster| {
        let (http, url) = (g.http.clone(), g.admin("/metrics"));
        async move { kvgate_tests::prom::Metrics::parse(&http.get(url).send().await.unwrap().text().await.unwrap()).sum("kvgate_cluster_peer_chains", &[]) }
    };
    let prompt: Vec<u32> = (0..512).map(|t| 200 + t).collect();
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 400, "ignore_eos": true, "stream": true});
    let running = a.http.post(a.url("/v1/completions")).json(&body).send().await.unwrap();
    let home = running.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let shared = wait_until(Duration::from_secs(5), || async { chains(b).await >= 1.0 }).await;
    assert!(shared.is_some(), "replica b holds replica a's booked chain");
    let probe = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1});
    let done = b.http.post(b.url("/v1/completions")).header("x-request-id", "probe").json(&probe).send().await.unwrap();
    assert_eq!(done.status(), 200);
    let v = get(b, "/requests/probe").await;
    let candidates = v["route_receipt"][0]["candidates"].as_array().cloned().unwrap_or_default();
    let at_home =
        candidates.iter().find(|c| c["url"].as_str().is_some_and(|u| u.trim_end_matches('/') == home.trim_end_matches('/'))).cloned().unwrap_or_default();
    assert_eq!(at_home["active_overlap_blocks"], 32, "the 32 blocks replica a's request books on {home} count on replica b: {v}");
    drain(running).await;
    let released = wait_until(Duration::from_secs(5), || async { chains(b).await == 0.0 }).await;
    assert!(released.is_some(), "released with the request");
}

/// Two replicas hold a tenant to one limit: its requests, sent to each in turn, are refused at
/// the total one replica alone refuses at (20 a minute; one more may have refilled while the
/// test ran), and not at twice it.
#[tokio::test]
async fn a_tenants_limit_holds_across_replicas() {
    let key = "sk-shared-tenant";
    let digest = kvgate::config::tenants::to_hex(&kvgate::config::tenants::digest_of(key.as_bytes()));
    let extra = format!("tenants:\n  require_key: true\n  list:\n    - name: shared\n      keys_sha256: [{digest}]\n      requests_per_minute: 20\n");
    let r = replicas_with(2, 1, sim(1.0), GatewayOpts { extra, ..GatewayOpts::default() }).await;
    let body = json!({"model": "sim-model", "prompt": unique_text(8), "max_tokens": 16, "ignore_eos": true});
    let (mut admitted, mut per_replica) = (0, [0; 2]);
    for i in 0..60 {
        let g = &r.gws[i % 2];
        let resp = g.http.post(g.url("/v1/completions")).bearer_auth(key).json(&body).send().await.expect("sent");
        match resp.status().as_u16() {
            200 => {
                admitted += 1;
                per_replica[i % 2] += 1;
            }
            429 => break,
            s => panic!("status {s}: {}", resp.text().await.unwrap_or_default()),
        }
    }
    assert!((20..=21).contains(&admitted), "admitted {admitted} ({per_replica:?}) against a limit of 20 a minute");
    assert!(per_replica.iter().all(|&n| n >= 9), "{per_replica:?}");
    // Each replica's view: what it used itself, the limit nearly spent by both.
    for g in &r.gws {
        let t = get(g, "/tenants").await;
        let remaining = t["tenants"][0]["limits"]["requests_per_minute"]["remaining"].as_u64().unwrap();
        assert!(remaining <= 1, "{t}");
    }
}
