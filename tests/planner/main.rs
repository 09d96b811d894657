//! The planner end to end (issue #35): a gateway whose model's workers are vllm-sim processes
//! the `local` connector starts from a command template, under load that rises and falls.

use kvgate_tests::cluster::{Cluster, TempDir, wait_until};
use kvgate_tests::prom::Metrics;
use kvgate_tests::sse;
use kvgate_tests::target::unique_text;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// The vllm-sim binary beside this test's (built by `cargo test --workspace --all-targets`;
/// built here when this test runs alone).
fn sim_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let bin = exe.parent().and_then(Path::parent).expect("target dir").join("vllm-sim");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let ok = std::process::Command::new(cargo).args(["build", "-p", "vllm-sim", "--bin", "vllm-sim"]).status().is_ok_and(|s| s.success());
        assert!(ok && bin.exists(), "vllm-sim must be built: cargo build -p vllm-sim ({})", bin.display());
    }
    bin
}

/// A free port with `span` free ports above it, and as many 1000 higher (the KV ports).
fn port_base(span: u16) -> u16 {
    loop {
        let p = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let base = 20000 + p % 20000;
        let free = |q: u16| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok();
        if (base..base + span).all(|q| free(q) && free(q + 1000)) {
            return base;
        }
    }
}

/// The gateway config: one model, no configured workers (or `workers`), a planner with the
/// local connector starting vllm-sim.
fn planner_yaml(dir: &Path, planner: &str, workers: &str, mode: &str) -> String {
    let sim = sim_binary();
    let kv = r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{kv_port}","topic":"kv"}"#;
    let command =
        format!("{} --port {{port}} --served-model-name {{model}} --num-gpu-blocks-override 200 --max-model-len 2048 --kv-events-config '{kv}'", sim.display());
    format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nthreads: 2\nload:\n  interval_ms: 100\nhealth:\n  interval_ms: 100\n  timeout_ms: 1000\n  unhealthy_threshold: 2\n  healthy_threshold: 1\n\
         models:\n  - name: sim-model\n    tokenizer: builtin\n    routing:\n      mode: {mode}\n    planner:\n      enabled: true\n      log: {log}\n{planner}      connector:\n        kind: local\n        command: \"{command}\"\n        ports_from: {ports}\n        log_dir: {logs}\n        ready_timeout_s: 30\n        stop_timeout_s: 10\n    workers: {workers}\n",
        log = dir.join("planner.jsonl").display(),
        logs = dir.join("workers").display(),
        ports = port_base(8),
        command = command.replace('"', "\\\""),
    )
}

/// The decision log's lines.
fn log_lines(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("planner.jsonl")).unwrap_or_default().lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

/// Workers of the model in routing now, from `GET /workers`.
async fn workers(c: &Cluster) -> Vec<Value> {
    let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
    v["models"][0]["workers"].as_array().cloned().unwrap_or_default()
}

/// Streams from `clients` loops until `stop`; returns each request's (status, completion
/// tokens, done).
fn load(c: &Cluster, clients: usize, max_tokens: u64, stop: Arc<AtomicBool>, sent: Arc<AtomicUsize>) -> Vec<tokio::task::JoinHandle<Vec<(u16, u64, bool)>>> {
    (0..clients)
        .map(|_| {
            let (http, url, stop, sent) = (c.http.clone(), c.url("/v1/completions"), stop.clone(), sent.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    sent.fetch_add(1, Ordering::Relaxed);
                    let body = json!({"model": "sim-model", "prompt": unique_text(120), "max_tokens": max_tokens, "ignore_eos": true, "stream": true,
                                      "stream_options": {"include_usage": true}});
                    let (status, _, s) = sse::stream(&http, &url, &body).await;
                    let tokens = s.essence()["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                    out.push((status, tokens, s.done));
                }
                out
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_local_connector_scales_sims_one_to_three_and_back_without_a_failed_request() {
    let dir = TempDir::new();
    let planner = "      metric_pulling_interval_s: 0.25\n      adjustment_interval_s: 2\n      min_gpu_budget: 1\n      max_gpu_budget: 3\n      decode_kv_scale_up_threshold: 0.6\n      decode_kv_scale_down_threshold: 0.2\n      new_decode_worker_grace_period: 1\n      drain_timeout_s: 30\n";
    let c = Cluster::front_yaml(planner_yaml(&dir.0, planner, "[]", "kv")).await;
    // Below its minimum, the planner starts one worker with no load at all.
    let one = wait_until(Duration::from_secs(30), || async { workers(&c).await.len() == 1 }).await;
    assert!(one.is_some(), "the first worker joined: {:?}", log_lines(&dir.0));
    let w = &workers(&c).await[0];
    assert!(w["origin"].as_str().is_some_and(|o| o.starts_with("planner:sim-model-")), "{w}");

    // Ramp up: 12 streams of ~400 tokens each fill one sim's 200 blocks several times over.
    let (stop_high, stop_low, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let mut clients = load(&c, 10, 250, stop_high.clone(), sent.clone());
    clients.extend(load(&c, 2, 250, stop_low.clone(), sent.clone()));
    let three = wait_until(Duration::from_secs(40), || async { workers(&c).await.len() == 3 }).await;
    assert!(three.is_some(), "scaled to the budget of 3: {:?}", log_lines(&dir.0));
    // Every worker the planner started follows its KV events, found through /kv_event_sources.
    let all_followed = wait_until(Duration::from_secs(10), || async {
        let m = c.gateway_metrics().await;
        workers(&c).await.iter().all(|w| m.sum("kvgate_kv_index_blocks", &[("source", &format!("{}#0", w["url"].as_str().unwrap()))]) > 0.0)
    })
    .await;
    assert!(all_followed.is_some(), "kv_events: auto subscribed every started worker");
    // Ramp down to 2 light streams: back to 1 worker, one at a time, streams moved off the
    // workers removed.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop_high.store(true, Ordering::Relaxed);
    let back = wait_until(Duration::from_secs(60), || async { workers(&c).await.len() == 1 }).await;
    assert!(back.is_some(), "scaled back to 1: {:?}", log_lines(&dir.0));
    stop_low.store(true, Ordering::Relaxed);
    let mut results = Vec::new();
    for h in clients {
        results.extend(h.await.unwrap());
    }
    assert!(results.len() >= 12, "{} requests", results.len());
    let failed: Vec<_> = results.iter().filter(|(status, tokens, done)| *status != 200 || *tokens != 250 || !done).collect();
    assert!(failed.is_empty(), "every stream whole: {} of {} failed: {:?}", failed.len(), results.len(), &failed[..failed.len().min(5)]);

    // The decisions went up then down, one worker per interval, never back up (no oscillation).
    let changes: Vec<String> =
        log_lines(&dir.0).iter().filter(|l| l["event"] == "change" && l["ok"] == true).map(|l| l["change"].as_str().unwrap().to_string()).collect();
    assert_eq!(changes, ["up", "up", "up", "down", "down"], "1 (min budget) → 3 → 1: {:?}", log_lines(&dir.0));
    for l in log_lines(&dir.0).iter().filter(|l| l["event"] != "pull") {
        eprintln!("{l}");
    }
    let m: Metrics = c.gateway_metrics().await;
    eprintln!("requests: {}, moved by scale-downs: {}", results.len(), m.sum("kvgate_planner_moved_requests_total", &[("result", "ok")]));
    assert_eq!(m.sum("kvgate_planner_workers", &[("state", "actual")]), 1.0);
    assert_eq!(m.sum("kvgate_planner_changes_failed_total", &[]), 0.0);
    assert!(m.sum("kvgate_planner_decisions_total", &[("change", "down"), ("reason", "under_threshold")]) >= 2.0);
}
