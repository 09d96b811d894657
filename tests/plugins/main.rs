//! WebAssembly policies: the host's limits against hostile guests, the rescheduling example on
//! Llumnix's example cluster, loading errors, and the gateway routing through a plugin that is
//! hot-swapped under load.

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

use kvgate_filters::route::{Candidate, Decision, RequestSummary, RoundRobin};
use kvgate_plugins::sandbox::Limits;
use kvgate_plugins::{ClusterView, PluginSlot, PluginSpec, ReloadOutcome, ReschedulingPlugin, SelectOrder, SelectRule, WorkerLoad, component, route};
use kvgate_tests::cluster::{Cluster, GatewayOpts, TempDir, wait_until};
use kvgate_tests::guests;
use kvgate_tests::target::test_sim_config;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn spec(name: &str, path: PathBuf, config: &str) -> PluginSpec {
    PluginSpec { name: name.into(), path, sha256: None, config: config.into(), headers: vec!["x-session-id".into()], limits: Limits::default() }
}

fn hostile(mode: &str) -> PluginSlot {
    PluginSlot::load(spec(mode, guests::path("hostile"), &format!("mode = {mode}"))).unwrap()
}

fn candidates(n: u32) -> Vec<Candidate> {
    (0..n).map(|id| Candidate { id, healthy: true, total_blocks: 1000, ..Default::default() }).collect()
}

fn request<'a>(headers: &'a [(String, String)]) -> RequestSummary<'a> {
    RequestSummary {
        model: "m",
        endpoint: "completions",
        request_id: "r1",
        prompt_tokens: 64,
        prompt_blocks: 4,
        block_size: 16,
        fleet_overlap_blocks: 0,
        fleet_active_overlap_blocks: 0,
        fleet_prefill_load: 0.0,
        arrivals_per_worker_s: 0.0,
        expected_output_tokens: 0.0,
        mean_output_tokens: 0.0,
        tpot_weight: 0.0,
        e2e_weight: 0.0,
        slo: Default::default(),
        headers,
        nvext: None,
    }
}

#[test]
fn the_rescheduling_example_pairs_the_seeds_cluster_as_the_seed_says() {
    let spec = spec("lb", guests::path("load-balance"), "threshold = 0.7\nrule = token\norder = sr\nvalue = 1024\n");
    let plugin = ReschedulingPlugin::new(component::compile(&spec).unwrap()).unwrap();
    let loads = [0.9, 0.3, 0.8, 0.2, 0.4];
    let view = ClusterView {
        model: "m".into(),
        workers: loads.iter().enumerate().map(|(i, &load)| WorkerLoad { id: i as u32, load, healthy: true, ..Default::default() }).collect(),
    };
    let pairs = plugin.reschedule(&view).unwrap();
    let by_load: Vec<(f64, f64)> = pairs.iter().map(|m| (loads[m.source as usize], loads[m.destination as usize])).collect();
    assert_eq!(by_load, vec![(0.9, 0.2), (0.8, 0.3)]);
    assert!(pairs.iter().all(|m| m.rule == SelectRule::Token && m.order == SelectOrder::Sr && m.value == 1024.0));
    // A bad config is refused at load, with the guest's own message.
    let bad = self::spec("lb", guests::path("load-balance"), "order = sideways");
    let e = ReschedulingPlugin::new(component::compile(&bad).unwrap()).err().unwrap();
    assert!(e.message.contains("sideways"), "{e}");
}

#[test]
fn hostile_plugins_are_bounded_and_every_request_still_gets_a_worker() {
    let cands = candidates(4);
    let no_headers = Vec::new();
    let req = request(&no_headers);
    let fallback = RoundRobin::default();
    for (mode, kind) in
        [("loop", "timeout"), ("trap", "trap"), ("hog", "memory"), ("bad-index", "invalid"), ("bad-scores", "invalid"), ("bad-status", "invalid")]
    {
        let slot = hostile(mode);
        let plugin = slot.current();
        for _ in 0..3 {
            let t = Instant::now();
            let routed = route(&plugin, &req, &cands, &fallback);
            let took = t.elapsed();
            assert_eq!(routed.failure.as_ref().map(|f| f.kind()), Some(kind), "{mode}: {:?}", routed.failure);
            assert!(matches!(routed.decision, Decision::Worker(i) if i < 4), "{mode}: the fallback answers");
            assert!(took < Duration::from_millis(500), "{mode}: bounded, took {took:?}");
        }
    }
    // A well-behaved answer is used as is, a rejection too.
    let pin = hostile("pin-last").current();
    assert_eq!(route(&pin, &req, &cands, &fallback).decision, Decision::Worker(3));
    let reject = hostile("reject").current();
    assert_eq!(route(&reject, &req, &cands, &fallback).decision, Decision::Reject { status: 429, message: "tenant over quota".into() });
}

#[test]
fn a_plugin_that_keeps_failing_is_skipped_then_tried_again() {
    let mut s = spec("loop", guests::path("hostile"), "mode = loop");
    s.limits.timeout_ms = 2;
    let plugin = PluginSlot::load(s).unwrap().current();
    let (req, cands) = (request(&[]), candidates(2));
    for _ in 0..kvgate_plugins::routing::TRIP_AFTER {
        assert_eq!(plugin.choose(&req, &cands).unwrap_err().kind(), "timeout");
    }
    let t = Instant::now();
    let skipped = plugin.choose(&req, &cands).unwrap_err();
    assert_eq!(skipped.kind(), "skipped");
    // The kind says it was not called; the bound (far under a call's 2 ms deadline on an idle
    // machine, loose for a loaded one) catches a skip that waits.
    assert!(t.elapsed() < Duration::from_millis(50), "a skipped plugin costs nothing: {:?}", t.elapsed());
    assert_eq!(plugin.skipped_for(), Some(Duration::from_secs(1)));
    // After the first skip period it is called again (and, still looping, fails again).
    std::thread::sleep(Duration::from_millis(1050));
    assert_eq!(plugin.choose(&req, &cands).unwrap_err().kind(), "timeout");
}

#[test]
fn the_timeout_is_the_configured_deadline() {
    let mut s = spec("loop", guests::path("hostile"), "mode = loop");
    s.limits.timeout_ms = 20;
    let plugin = PluginSlot::load(s).unwrap().current();
    let t = Instant::now();
    let err = plugin.choose(&request(&[]), &candidates(2)).unwrap_err();
    let took = t.elapsed();
    assert_eq!(err.kind(), "timeout");
    assert!(took >= Duration::from_millis(19) && took < Duration::from_secs(1), "{took:?}");
}

#[test]
fn modules_that_cannot_serve_are_refused_with_the_reason() {
    let e = PluginSlot::load(spec("f", guests::path("forbidden"), "")).err().unwrap();
    assert!(e.message.contains("imports wasi:") && e.message.contains("grants plugins no imports"), "{e}");
    let e = PluginSlot::load(spec("i", guests::path("hostile"), "mode = init-error")).err().unwrap();
    assert!(e.message.contains("refusing to start"), "{e}");
    let e = PluginSlot::load(spec("r", guests::path("load-balance"), "")).err().unwrap();
    assert!(e.message.contains("rescheduling policy"), "{e}");
    let dir = TempDir::new();
    let junk = dir.0.join("junk.wasm");
    std::fs::write(&junk, b"not wasm at all").unwrap();
    let e = PluginSlot::load(spec("j", junk, "")).err().unwrap();
    assert!(e.message.contains("not a valid WebAssembly component"), "{e}");
    let e = PluginSlot::load(spec("m", dir.0.join("missing.wasm"), "")).err().unwrap();
    assert!(e.message.contains("cannot read"), "{e}");
    let mut pinned = spec("p", guests::path("hostile"), "");
    pinned.sha256 = Some("0".repeat(64));
    let e = PluginSlot::load(pinned).err().unwrap();
    assert!(e.message.contains("but the config pins"), "{e}");
}

/// Replaces `dst` by `src` atomically (write aside, rename), as a deploy would.
fn install(src: &Path, dst: &Path) {
    let tmp = dst.with_extension("tmp");
    std::fs::copy(src, &tmp).unwrap();
    std::fs::rename(&tmp, dst).unwrap();
}

#[test]
fn a_swap_keeps_requests_on_the_module_they_started_with_and_a_bad_module_changes_nothing() {
    let dir = TempDir::new();
    let file = dir.0.join("policy.wasm");
    install(&guests::path("hostile"), &file);
    let slot = PluginSlot::load(spec("p", file.clone(), "")).unwrap();
    let old = slot.current();
    assert_eq!(slot.reload().unwrap(), ReloadOutcome::Unchanged);
    install(&guests::path("session-affinity"), &file);
    assert!(matches!(slot.reload().unwrap(), ReloadOutcome::Swapped { .. }));
    let cands = candidates(4);
    assert_eq!(old.choose(&request(&[]), &cands).unwrap(), Some(Decision::Worker(3)), "the old module still answers its holders");
    let new = slot.current();
    assert_ne!(new.sha256(), old.sha256());
    install(&guests::path("forbidden"), &file);
    assert!(slot.reload().is_err());
    assert_eq!(slot.current().sha256(), new.sha256(), "the serving module stays");
}

fn session_counts(m: &[f64], before: &[f64]) -> Vec<f64> {
    m.iter().zip(before).map(|(a, b)| a - b).collect()
}

async fn served_per_worker(c: &Cluster) -> Vec<f64> {
    let mut v = Vec::new();
    for i in 0..c.sims.len() {
        v.push(c.sim_metrics(i).await.sum("vllm:request_success_total", &[]));
    }
    v
}

async fn complete(c: &Cluster, session: Option<&str>) -> u16 {
    let mut r = c.http.post(c.url("/v1/completions")).json(&json!({"prompt": "hello there", "max_tokens": 2}));
    if let Some(s) = session {
        r = r.header("x-session-id", s);
    }
    r.send().await.map(|r| r.status().as_u16()).unwrap_or(0)
}

fn plugin_yaml(path: &Path, config: &str) -> String {
    let config: String = config.lines().flat_map(|l| ["      ", l, "\n"]).collect();
    format!("plugins:\n  - name: policy\n    path: {}\n    headers: [x-session-id]\n    config: |\n{config}", path.display())
}

#[tokio::test]
async fn requests_go_where_the_plugin_says_and_a_hot_swap_under_load_fails_none() {
    let dir = TempDir::new();
    let file = dir.0.join("policy.wasm");
    install(&guests::path("session-affinity"), &file);
    let opts = GatewayOpts {
        mode: "plugin".into(),
        routing_extra: "plugin: policy\nfallback: round_robin".into(),
        extra: plugin_yaml(&file, "header = x-session-id\nweight = 1.0"),
        ..Default::default()
    };
    let c = Cluster::sims(4, test_sim_config(), opts).await;
    // Each session sticks to one worker; sessions spread over several.
    let mut homes = std::collections::HashSet::new();
    for s in 0..6 {
        let before = served_per_worker(&c).await;
        for _ in 0..5 {
            assert_eq!(complete(&c, Some(&format!("session-{s}"))).await, 200);
        }
        let d = session_counts(&served_per_worker(&c).await, &before);
        let home: Vec<usize> = (0..4).filter(|&i| d[i] > 0.0).collect();
        assert_eq!(home.len(), 1, "session-{s} stayed on one worker: {d:?}");
        assert_eq!(d[home[0]], 5.0);
        homes.insert(home[0]);
    }
    assert!(homes.len() >= 2, "sessions spread over workers: {homes:?}");

    // Swap in a policy that pins everything to the last worker while a load runs.
    let load = {
        let (http, url) = (c.http.clone(), c.url("/v1/completions"));
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(1500) {
                let mut batch = Vec::new();
                for i in 0..8 {
                    let (http, url) = (http.clone(), url.clone());
                    batch.push(tokio::spawn(async move {
                        let r = http.post(url).header("x-session-id", format!("load-{i}")).json(&json!({"prompt": "load", "max_tokens": 3})).send().await;
                        r.map(|r| r.status().as_u16()).unwrap_or(0)
                    }));
                }
                for b in batch {
                    statuses.push(b.await.unwrap());
                }
            }
            statuses
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    install(&guests::path("hostile"), &file); // its default: every request to the highest id
    let swapped =
        wait_until(Duration::from_secs(5), || async { c.gateway_metrics().await.sum("kvgate_plugin_reloads_total", &[("result", "ok")]) >= 1.0 }).await;
    assert!(swapped.is_some(), "the file change was picked up");
    let statuses = load.await.unwrap();
    assert!(statuses.len() > 20 && statuses.iter().all(|&s| s == 200), "zero failed requests across the swap: {statuses:?}");
    let before = served_per_worker(&c).await;
    for s in 0..5 {
        assert_eq!(complete(&c, Some(&format!("session-{s}"))).await, 200);
    }
    let d = session_counts(&served_per_worker(&c).await, &before);
    assert_eq!(d, vec![0.0, 0.0, 0.0, 5.0], "the new module decides");

    // A bad module through POST /plugins/reload: refused, the pinning one keeps serving.
    install(&guests::path("forbidden"), &file);
    let r = c.http.post(c.admin("/plugins/reload")).send().await.unwrap();
    assert_eq!(r.status(), 422);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["plugins"][0]["status"], "rejected", "{body}");
    assert!(body["plugins"][0]["error"].as_str().unwrap().contains("imports"), "{body}");
    let before = served_per_worker(&c).await;
    assert_eq!(complete(&c, None).await, 200);
    assert_eq!(session_counts(&served_per_worker(&c).await, &before), vec![0.0, 0.0, 0.0, 1.0]);
    // And a good one through the same endpoint.
    install(&guests::path("session-affinity"), &file);
    let r = c.http.post(c.admin("/plugins/reload")).send().await.unwrap();
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["plugins"][0]["status"] == "reloaded" || body["plugins"][0]["status"] == "unchanged", "{body}");
}

#[tokio::test]
async fn a_failing_plugin_in_the_gateway_falls_back_and_is_counted() {
    let dir = TempDir::new();
    for (mode, kind) in [("trap", "trap"), ("loop", "timeout"), ("bad-index", "invalid")] {
        let file = dir.0.join(format!("{mode}.wasm"));
        install(&guests::path("hostile"), &file);
        let opts = GatewayOpts {
            mode: "plugin".into(),
            routing_extra: "plugin: policy\nfallback: round_robin".into(),
            extra: plugin_yaml(&file, &format!("mode = {mode}")),
            ..Default::default()
        };
        let c = Cluster::sims(2, test_sim_config(), opts).await;
        for _ in 0..6 {
            assert_eq!(complete(&c, Some("s")).await, 200, "{mode}: the fallback serves");
        }
        let m = c.gateway_metrics().await;
        // Five failures in a row trip the breaker: the sixth request skips the plugin.
        assert_eq!(m.sum("kvgate_plugin_failures_total", &[("plugin", "policy"), ("kind", kind)]), 5.0, "{mode}");
        assert_eq!(m.sum("kvgate_plugin_failures_total", &[("plugin", "policy"), ("kind", "skipped")]), 1.0, "{mode}");
        let per = served_per_worker(&c).await;
        assert_eq!(per, vec![3.0, 3.0], "{mode}: round_robin, the fallback, spread them");
    }
}

#[tokio::test]
async fn a_config_naming_a_bad_plugin_is_refused_and_the_old_config_stays() {
    let dir = TempDir::new();
    let file = dir.0.join("policy.wasm");
    install(&guests::path("hostile"), &file);
    let opts = GatewayOpts { mode: "plugin".into(), routing_extra: "plugin: policy".into(), extra: plugin_yaml(&file, ""), ..Default::default() };
    let c = Cluster::sims(2, test_sim_config(), opts).await;
    let yaml = std::fs::read_to_string(&c.config_path).unwrap();
    std::fs::write(&c.config_path, yaml.replace("policy.wasm", "missing.wasm")).unwrap();
    let r = c.http.post(c.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let body = r.text().await.unwrap();
    assert!(body.contains("missing.wasm") && body.contains("cannot read"), "{body}");
    let before = served_per_worker(&c).await;
    assert_eq!(complete(&c, None).await, 200);
    assert_eq!(session_counts(&served_per_worker(&c).await, &before), vec![0.0, 1.0], "the old plugin still pins");
    // A changed config blob reaches the plugin's init on reload: now it rejects.
    let with_config = yaml.replace("    config: |\n", "    config: |\n      mode = reject\n");
    assert_ne!(with_config, yaml);
    std::fs::write(&c.config_path, with_config).unwrap();
    assert_eq!(c.http.post(c.admin("/reload")).send().await.unwrap().status(), 200);
    let r = c.http.post(c.url("/v1/completions")).json(&json!({"prompt": "hi", "max_tokens": 1})).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["message"], "tenant over quota", "{body}");
}
