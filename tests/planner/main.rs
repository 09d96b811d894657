//! The planner end to end: a gateway whose model's workers are vllm-sim processes
//! the `local` connector starts from a command template, under load that rises and falls.

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

mod kubernetes;

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

/// The gateway config: one model, no configured workers (or `workers`), a planner with the
/// local connector starting vllm-sim.
fn planner_yaml(dir: &Path, planner: &str, workers: &str, mode: &str) -> String {
    let sim = sim_binary();
    let kv = r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{kv_port}","topic":"kv"}"#;
    let command =
        format!("{} --port {{port}} --served-model-name {{model}} --num-gpu-blocks-override 200 --max-model-len 2048 --kv-events-config '{kv}'", sim.display());
    format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nthreads: 2\nload:\n  interval_ms: 100\nhealth:\n  interval_ms: 100\n  timeout_ms: 1000\n  unhealthy_threshold: 2\n  healthy_threshold: 1\n\
         models:\n  - name: sim-model\n    tokenizer: builtin\n    routing:\n      mode: {mode}\n    planner:\n      enabled: true\n      log: {log}\n{planner}      connector:\n        kind: local\n        command: \"{command}\"\n        ports_from: {ports}\n        kv_ports_from: {kv_ports}\n        log_dir: {logs}\n        ready_timeout_s: 30\n        stop_timeout_s: 10\n    workers: {workers}\n",
        log = dir.join("planner.jsonl").display(),
        logs = dir.join("workers").display(),
        ports = kvgate_tests::ports::reserved_run(8),
        kv_ports = kvgate_tests::ports::reserved_run(8),
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
fn load(c: &Cluster, clients: usize, max_tokens: u64, stop: &Arc<AtomicBool>, sent: &Arc<AtomicUsize>) -> Vec<tokio::task::JoinHandle<Vec<(u16, u64, bool)>>> {
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
    let mut clients = load(&c, 10, 250, &stop_high, &sent);
    clients.extend(load(&c, 2, 250, &stop_low, &sent));
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
    let back = wait_until(Duration::from_secs(60), || async {
        workers(&c).await.len() == 1 && log_lines(&dir.0).iter().filter(|l| l["event"] == "change" && l["change"] == "down").count() == 2
    })
    .await;
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

/// Real vLLM (tests/real-vllm/run-suite.sh, which sets `KVGATE_VLLM_RUN` to its `run.sh`): the
/// local connector starts a real vLLM server from the template; it joins routing with its KV
/// events found through `/kv_event_sources`; streams run on it; a scale-down moves them to
/// the configured server and stops it, its whole process group gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_vllm_worker_started_by_the_local_connector_joins_and_leaves_cleanly() {
    let (Ok(run), Ok(first)) = (std::env::var("KVGATE_VLLM_RUN"), std::env::var("KVGATE_TARGET_URL")) else {
        eprintln!("KVGATE_VLLM_RUN not set: the real-vLLM planner test runs under tests/real-vllm/run-suite.sh");
        return;
    };
    let model = std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into());
    let tokenizer = std::env::var("KVGATE_TARGET_TOKENIZER").expect("KVGATE_TARGET_TOKENIZER names the tiny model's tokenizer");
    let zmq = std::env::var("KVGATE_TARGET_ZMQ").expect("KVGATE_TARGET_ZMQ names the first server's KV events");
    let dir = TempDir::new();
    // Below the ephemeral range, as the suite picks its own (vLLM binds its KV port late).
    let ports = kvgate_tests::ports::reserved_run(4);
    let kv_ports = kvgate_tests::ports::reserved_run(4);
    let rules = |min: u32| {
        format!(
            "      metric_pulling_interval_s: 0.5\n      adjustment_interval_s: 2\n      min_gpu_budget: {min}\n      max_gpu_budget: 2\n      decode_kv_scale_up_threshold: 0.99\n      decode_kv_scale_down_threshold: 0.9\n      new_decode_worker_grace_period: 0\n      drain_timeout_s: 120\n"
        )
    };
    // Health checks patient enough for this host, where both servers share one core with the
    // four streams: with three failed 5 s checks in a row allowed, the gateway twice took the
    // first server for dead in the suite (while it went on streaming), and the streams had
    // nowhere to go when the started worker stopped. What this test checks is the planner.
    let yaml = |min: u32| {
        format!(
            "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nthreads: 2\nload:\n  interval_ms: 200\nhealth:\n  interval_ms: 500\n  timeout_ms: 20000\n  unhealthy_threshold: 6\n  healthy_threshold: 1\n\
             models:\n  - name: {model}\n    tokenizer: {tokenizer}\n    block_size: 32\n    routing:\n      mode: kv\n    planner:\n      enabled: true\n      log: {log}\n{rules}      connector:\n        kind: local\n        command: \"bash {run} {{port}} {{kv_port}}\"\n        ports_from: {ports}\n        kv_ports_from: {kv}\n        log_dir: {logs}\n        ready_timeout_s: 300\n        stop_timeout_s: 30\n    workers:\n      - url: {first}\n        kv_events: {zmq}\n",
            log = dir.0.join("planner.jsonl").display(),
            logs = dir.0.join("workers").display(),
            kv = kv_ports,
            rules = rules(min),
        )
    };
    let c = Cluster::front_yaml(yaml(2)).await;
    // Below its minimum of 2: the planner starts one real vLLM (a minute or two on 2 cores).
    let joined = wait_until(Duration::from_secs(300), || async { workers(&c).await.len() == 2 }).await;
    let logs = || {
        std::fs::read_dir(dir.0.join("workers"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(joined.is_some(), "the started vLLM joined: {:?}\n{}", log_lines(&dir.0), logs());
    let started = workers(&c).await.into_iter().find(|w| w["origin"].as_str().is_some_and(|o| o.starts_with("planner:"))).expect("a planner worker");
    let url = started["url"].as_str().unwrap().to_string();
    // Its events, found through /kv_event_sources: what it caches of requests sent to it
    // directly is indexed (sent until then: events published before the subscriber connected
    // are not seen).
    let source = format!("{url}#0");
    let indexed = wait_until(Duration::from_secs(60), || async {
        let body = json!({"model": model, "prompt": unique_text(60), "max_tokens": 1});
        let _ = c.http.post(format!("{url}/v1/completions")).json(&body).send().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        c.gateway_metrics().await.sum("kvgate_kv_index_blocks", &[("source", &source)]) > 0.0
    })
    .await;
    assert!(indexed.is_some(), "kv_events: auto subscribed the started vLLM");

    // Streams on both (round robin over placement by load), then the minimum drops to 1.
    let streams: Vec<_> = (0..4)
        .map(|i| {
            let (http, u) = (c.http.clone(), c.url("/v1/completions"));
            let body = json!({"model": model, "prompt": format!("{i} {}", unique_text(40)), "max_tokens": 2000, "ignore_eos": true, "temperature": 0,
                              "stream": true, "stream_options": {"include_usage": true}});
            tokio::spawn(async move { sse::stream(&http, &u, &body).await })
        })
        .collect();
    let on_it = wait_until(Duration::from_secs(60), || async {
        let v: Value = c.http.get(c.admin("/requests")).send().await.unwrap().json().await.unwrap();
        v["requests"].as_array().is_some_and(|r| r.iter().any(|e| e["worker"].as_str() == Some(url.as_str()) && e["phase"] == "running"))
    })
    .await;
    assert!(on_it.is_some(), "a stream runs on the started worker");
    std::fs::write(&c.config_path, yaml(1)).unwrap();
    assert_eq!(c.http.post(c.admin("/reload")).send().await.unwrap().status(), 200);
    let left = wait_until(Duration::from_secs(180), || async { log_lines(&dir.0).iter().any(|l| l["event"] == "change" && l["change"] == "down") }).await;
    assert!(left.is_some(), "scaled down: {:?}", log_lines(&dir.0));
    for s in streams {
        let (status, _, body) = s.await.unwrap();
        assert_eq!(status, 200);
        assert!(body.done, "every stream ends with [DONE]");
        assert_eq!(body.essence()["usage"]["completion_tokens"], 2000, "no stream cut short");
    }
    let change = log_lines(&dir.0).into_iter().find(|l| l["event"] == "change" && l["change"] == "down").unwrap();
    eprintln!("scale-down of the real vLLM worker: {change}");
    assert_eq!(change["ok"], true, "{change}");
    assert!(change["moved"].as_u64().unwrap() >= 1, "its stream moved off it: {change}");
    assert_eq!(change["left_behind"], 0, "{change}");
    assert_eq!(workers(&c).await.len(), 1);
    // Stopped: nothing answers on its port any more.
    assert!(c.http.get(format!("{url}/health")).timeout(Duration::from_secs(2)).send().await.is_err(), "the worker exited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_only_decides_and_records_but_starts_nothing() {
    let dir = TempDir::new();
    let sim = vllm_sim::SimServer::start(kvgate_tests::target::test_sim_config()).await.expect("sim starts");
    let planner = "      mode: observe_only\n      metric_pulling_interval_s: 0.1\n      adjustment_interval_s: 0.5\n      min_gpu_budget: 2\n";
    let c = Cluster::front_yaml(planner_yaml(&dir.0, planner, &format!("\n      - url: {}", sim.url()), "round_robin")).await;
    let decided = wait_until(Duration::from_secs(20), || async { log_lines(&dir.0).iter().filter(|l| l["event"] == "decision").count() >= 3 }).await;
    assert!(decided.is_some(), "decisions are made: {:?}", log_lines(&dir.0));
    let lines = log_lines(&dir.0);
    let decisions: Vec<&Value> = lines.iter().filter(|l| l["event"] == "decision").collect();
    assert!(decisions.iter().all(|d| d["acted"] == false && d["change"] == "up" && d["reason"] == "below_min_budget"), "{decisions:?}");
    assert!(!lines.iter().any(|l| l["event"] == "change"), "nothing was started: {lines:?}");
    assert_eq!(workers(&c).await.len(), 1);
    let status: Value = c.http.get(c.admin("/planner")).send().await.unwrap().json().await.unwrap();
    assert_eq!(status["planners"][0]["mode"], "observe_only", "{status}");
    assert_eq!(status["planners"][0]["started_workers"], json!([]), "{status}");
    assert!(c.gateway_metrics().await.sum("kvgate_planner_decisions_total", &[("change", "up"), ("reason", "below_min_budget")]) >= 3.0);
}

/// `kv_events: auto` on a configured worker: its publisher is read from `/kv_event_sources`,
/// and read again when the worker comes back after a restart with another publisher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_auto_follows_a_worker_that_restarts_with_another_publisher() {
    // The worker comes back on its HTTP address, so that address (and the first publisher's, so
    // the second's differs) is reserved below the ephemeral range, where nothing else binds
    // between the stop and the restart.
    let ports = kvgate_tests::ports::reserved_run(2);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], ports));
    let mut cfg = vllm_sim::SimConfig { listen: addr, ..kvgate_tests::target::test_sim_config() };
    cfg.kv_events.endpoint = format!("tcp://*:{}", ports + 1);
    let first = vllm_sim::SimServer::start(cfg).await.expect("sim starts");
    let url = first.url();
    let yaml = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nthreads: 2\nhealth:\n  interval_ms: 100\n  timeout_ms: 500\n  unhealthy_threshold: 1\n  healthy_threshold: 1\n\
         models:\n  - name: sim-model\n    tokenizer: builtin\n    routing:\n      mode: kv\n    workers:\n      - url: {url}\n        kv_events: auto\n"
    );
    let c = Cluster::front_yaml(yaml).await;
    let source = format!("{url}#0");
    let indexed = |c: &Cluster| {
        let (http, u, source) = (c.http.clone(), c.url("/v1/completions"), source.clone());
        let admin = c.admin("/metrics");
        async move {
            let body = json!({"model": "sim-model", "prompt": unique_text(80), "max_tokens": 1});
            let _ = http.post(&u).json(&body).send().await;
            let m = Metrics::parse(&http.get(&admin).send().await.unwrap().text().await.unwrap());
            m.sum("kvgate_kv_events_total", &[("source", &source), ("result", "applied")])
        }
    };
    let before = wait_until(Duration::from_secs(10), || async { indexed(&c).await > 0.0 }).await;
    assert!(before.is_some(), "the publisher named by /kv_event_sources is followed");
    let old_endpoint = first.kv_event_endpoints()[0].clone();
    first.shutdown().await;
    // A restart takes a while: the gateway sees the worker down first.
    let down = wait_until(Duration::from_secs(10), || async {
        let v: Value = c.http.get(c.admin("/workers")).send().await.unwrap().json().await.unwrap();
        v["models"][0]["workers"][0]["healthy"] == false
    })
    .await;
    assert!(down.is_some(), "the stopped worker was seen unhealthy");
    // The same HTTP address, a new publisher port.
    let second = vllm_sim::SimServer::start(vllm_sim::SimConfig { listen: addr, ..kvgate_tests::target::test_sim_config() }).await.expect("sim restarts");
    assert_ne!(second.kv_event_endpoints()[0], old_endpoint, "the restarted worker publishes elsewhere");
    let applied = indexed(&c).await;
    let after = wait_until(Duration::from_secs(15), || async { indexed(&c).await > applied }).await;
    assert!(after.is_some(), "events of the restarted worker's new publisher are applied");
}

/// A planner worker that crashes is reaped, leaves routing and is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_planner_worker_is_reaped_and_replaced() {
    let dir = TempDir::new();
    let planner = "      metric_pulling_interval_s: 0.1\n      adjustment_interval_s: 0.5\n";
    let c = Cluster::front_yaml(planner_yaml(&dir.0, planner, "[]", "round_robin")).await;
    assert!(wait_until(Duration::from_secs(30), || async { workers(&c).await.len() == 1 }).await.is_some());
    let first = workers(&c).await[0]["url"].as_str().unwrap().to_string();
    // vllm-sim's fault injection: it exits with an error at its next generated token.
    let r = c.http.post(format!("{first}/sim/faults")).json(&json!({"crash_after_tokens": 1})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body = json!({"model": "sim-model", "prompt": "crash", "max_tokens": 4});
    let _ = c.http.post(format!("{first}/v1/completions")).json(&body).send().await;
    // The replacement may take the port the crashed one freed: it is told apart by its start.
    let replaced = wait_until(Duration::from_secs(30), || async {
        let ups = log_lines(&dir.0).iter().filter(|l| l["event"] == "change" && l["change"] == "up" && l["ok"] == true).count();
        let now = workers(&c).await;
        ups == 2 && now.len() == 1 && now[0]["healthy"] == true
    })
    .await;
    assert!(replaced.is_some(), "{:?} {:?}", workers(&c).await, log_lines(&dir.0));
    let lines = log_lines(&dir.0);
    assert!(lines.iter().any(|l| l["event"] == "exit" && l["url"].as_str() == Some(first.as_str())), "{lines:?}");
    assert_eq!(c.gateway_metrics().await.sum("kvgate_planner_worker_exits_total", &[]), 1.0);
}
