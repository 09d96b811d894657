//! The `kubernetes` connector against `FakeKube` (tests/src/fake_kube.rs): no Kubernetes API
//! server runs on these machines, so a fake that speaks the real paths and JSON stands in for
//! it, its pods in-process vllm-sim servers.

use super::{log_lines, workers};
use kvgate_tests::cluster::{Cluster, TempDir, wait_until};
use kvgate_tests::fake_kube::{FakeKube, NS};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;

fn yaml(dir: &Path, kubeconfig: &Path, rules: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nthreads: 2\nload:\n  interval_ms: 100\nhealth:\n  interval_ms: 100\n  timeout_ms: 1000\n  unhealthy_threshold: 2\n  healthy_threshold: 1\n\
         models:\n  - name: sim-model\n    tokenizer: builtin\n    routing:\n      mode: kv\n    planner:\n      enabled: true\n      log: {log}\n{rules}      connector:\n        kind: kubernetes\n        kubeconfig: {kc}\n        workload: Deployment/vllm\n        selector: kubernetes.io/service-name=vllm\n        ready_timeout_s: 30\n    workers: []\n",
        log = dir.join("planner.jsonl").display(),
        kc = kubeconfig.display(),
    )
}

fn rules(mode: &str, min: u32) -> String {
    format!(
        "      mode: {mode}\n      metric_pulling_interval_s: 0.1\n      adjustment_interval_s: 0.5\n      min_gpu_budget: {min}\n      max_gpu_budget: 3\n      decode_kv_scale_up_threshold: 0.99\n      decode_kv_scale_down_threshold: 0.9\n      new_decode_worker_grace_period: 0\n"
    )
}

async fn origins(c: &Cluster) -> Vec<String> {
    let mut o: Vec<String> = workers(c).await.iter().filter_map(|w| w["origin"].as_str().map(str::to_string)).collect();
    o.sort();
    o
}

async fn reload(c: &Cluster, text: String) {
    std::fs::write(&c.config_path, text).unwrap();
    let r = c.http.post(c.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kubernetes_connector_scales_the_deployment_and_follows_its_endpoint_slices() {
    let dir = TempDir::new();
    let kube = FakeKube::start(kvgate_tests::target::test_sim_config(), 1).await;
    let kc = dir.0.join("kubeconfig");
    kube.kubeconfig(&kc);
    let c = Cluster::front_yaml(yaml(&dir.0, &kc, &rules("act", 2))).await;

    // The running pod is discovered and joins routing; below the minimum of 2, the planner
    // PATCHes the scale subresource and the new pod joins once its endpoint is ready.
    let two = wait_until(Duration::from_secs(30), || async { origins(&c).await == ["kubernetes:vllm-0", "kubernetes:vllm-1"] }).await;
    assert!(two.is_some(), "{:?} {:?}", origins(&c).await, log_lines(&dir.0));
    let reqs = kube.requests();
    assert!(
        reqs.iter().any(|(m, p, b)| m == "GET" && p.starts_with(&format!("/apis/apps/v1/namespaces/{NS}/deployments/vllm/scale")) && b.is_empty()),
        "{reqs:?}"
    );
    let patch = reqs.iter().find(|(m, p, _)| m == "PATCH" && p.contains("/deployments/vllm/scale")).expect("a scale PATCH");
    assert_eq!(serde_json::from_str::<Value>(&patch.2).unwrap(), json!({"spec": {"replicas": 2}}));
    assert!(
        reqs.iter()
            .any(|(_, p, _)| p.contains("endpointslices") && p.contains("watch=true") && p.contains("labelSelector=kubernetes.io%2Fservice-name%3Dvllm")),
        "{reqs:?}"
    );

    // kv_events: auto: both discovered pods' events are indexed.
    let indexed = wait_until(Duration::from_secs(20), || async {
        let body = json!({"model": "sim-model", "prompt": kvgate_tests::target::unique_text(80), "max_tokens": 2});
        let _ = c.http.post(c.url("/v1/completions")).json(&body).send().await;
        let m = c.gateway_metrics().await;
        workers(&c).await.iter().all(|w| m.sum("kvgate_kv_index_blocks", &[("source", &format!("{}#0", w["url"].as_str().unwrap()))]) > 0.0)
    })
    .await;
    assert!(indexed.is_some(), "every discovered worker's KV events are followed");

    // Observe only from here: what the slices say reaches routing without the planner acting.
    reload(&c, yaml(&dir.0, &kc, &rules("observe_only", 2))).await;
    kube.set_ready("vllm-0", false).await;
    let not_ready = wait_until(Duration::from_secs(10), || async { origins(&c).await == ["kubernetes:vllm-1"] }).await;
    assert!(not_ready.is_some(), "a pod not ready leaves routing: {:?}", origins(&c).await);
    // A watch that ends is resumed from where it was.
    kube.drop_watches();
    tokio::time::sleep(Duration::from_millis(300)).await;
    kube.set_ready("vllm-0", true).await;
    let back = wait_until(Duration::from_secs(15), || async { origins(&c).await.len() == 2 }).await;
    assert!(back.is_some(), "the resumed watch saw the pod come back: {:?}", origins(&c).await);
    // A watch whose history is gone gets 410 and lists again.
    let lists = || kube.requests().iter().filter(|(_, p, _)| p.contains("endpointslices") && !p.contains("watch=true")).count();
    let (watches, listed) = (kube.requests().iter().filter(|(_, p, _)| p.contains("watch=true")).count(), lists());
    assert!(watches >= 2, "the dropped watch was resumed");
    kube.forget_history().await;
    kube.drop_watches();
    tokio::time::sleep(Duration::from_millis(300)).await;
    kube.set_ready("vllm-1", false).await;
    let relisted = wait_until(Duration::from_secs(20), || async { origins(&c).await == ["kubernetes:vllm-0"] }).await;
    assert!(relisted.is_some(), "after a 410 the list and new watch still follow: {:?}", origins(&c).await);
    assert!(lists() > listed, "the 410 made the watcher list again");
    kube.set_ready("vllm-1", true).await;
    assert!(wait_until(Duration::from_secs(15), || async { origins(&c).await.len() == 2 }).await.is_some());

    // Act with a minimum of 1 on an idle fleet: one replica goes, the drained pod marked to go
    // first, and it leaves routing.
    reload(&c, yaml(&dir.0, &kc, &rules("act", 1))).await;
    let one = wait_until(Duration::from_secs(30), || async { workers(&c).await.len() == 1 && kube.replicas().await == 1 }).await;
    assert!(one.is_some(), "{:?} {:?}", origins(&c).await, log_lines(&dir.0));
    let reqs = kube.requests();
    let down = reqs.iter().rev().find(|(m, p, _)| m == "PATCH" && p.contains("/scale")).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&down.2).unwrap(), json!({"spec": {"replicas": 1}}));
    let marked = reqs.iter().find(|(m, p, _)| m == "PATCH" && p.starts_with(&format!("/api/v1/namespaces/{NS}/pods/"))).expect("the victim pod marked");
    let victim = marked.1.rsplit('/').next().unwrap().split('?').next().unwrap().to_string();
    assert!(marked.2.contains("pod-deletion-cost"), "{marked:?}");
    assert!(!kube.pods().await.contains(&victim), "the ReplicaSet removed the marked pod {victim}");
    assert_eq!(origins(&c).await, [format!("kubernetes:{}", kube.pods().await[0])]);
    let logged = wait_until(Duration::from_secs(10), || async { log_lines(&dir.0).iter().any(|l| l["event"] == "change" && l["change"] == "down") }).await;
    assert!(logged.is_some(), "{:?}", log_lines(&dir.0));
    let change = log_lines(&dir.0).into_iter().find(|l| l["event"] == "change" && l["change"] == "down").unwrap();
    assert_eq!(change["ok"], true, "{change}");
}

/// The decisions a planner's log holds that it acted on.
fn acted(dir: &Path) -> usize {
    log_lines(dir).iter().filter(|l| l["event"] == "decision" && l["acted"] == true).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn among_replicas_only_the_leader_scales_and_its_successor_does_not_scale_again() {
    let dir = TempDir::new();
    let kube = FakeKube::start(kvgate_tests::target::test_sim_config(), 1).await;
    let kc = dir.0.join("kubeconfig");
    kube.kubeconfig(&kc);
    let nats = kvgate_tests::nats::NatsServer::start();
    let mut gws = Vec::new();
    let mut dirs = Vec::new();
    for i in 0..3 {
        let d = dir.0.join(format!("r{i}"));
        std::fs::create_dir_all(&d).unwrap();
        let cluster = format!("cluster:\n  nats_url: {}\n  replica: r{i}\n  heartbeat_ms: 200\n  peer_timeout_ms: 600\n  lease_ms: 800\n", nats.url());
        gws.push(Cluster::front_yaml(format!("{cluster}{}", yaml(&d, &kc, &rules("act", 2)))).await);
        dirs.push(d);
    }
    let scale_ups = || kube.requests().iter().filter(|(m, p, _)| m == "PATCH" && p.contains("/deployments/vllm/scale")).count();
    // Below the minimum of 2: one replica scales, and every replica routes to both pods.
    for c in &gws {
        let two = wait_until(Duration::from_secs(30), || async { origins(c).await.len() == 2 }).await;
        assert!(two.is_some(), "{:?}", origins(c).await);
    }
    assert_eq!(scale_ups(), 1, "one scale-up for one decision: {:?}", kube.requests());
    let lead = |c: &Cluster| {
        let (http, url) = (c.http.clone(), c.admin("/cluster"));
        async move { http.get(url).send().await.unwrap().json::<Value>().await.unwrap()["leads"] == true }
    };
    let mut leader = None;
    for (i, c) in gws.iter().enumerate() {
        if lead(c).await {
            leader = Some(i);
        }
    }
    let leader = leader.expect("one replica leads");
    for (i, d) in dirs.iter().enumerate() {
        assert_eq!(acted(d) > 0, i == leader, "only the leader's planner acts, the others observe (replica {i}): {:?}", log_lines(d));
    }
    let mut gone = gws.remove(leader);
    dirs.remove(leader);
    gone.stop_gateway(kvgate::Stop::Fast).await;
    // A successor leads and decides, on the fleet the first one scaled: nothing more to start.
    let next = wait_until(Duration::from_secs(10), || async { dirs.iter().any(|d| acted(d) >= 3) }).await;
    assert!(next.is_some(), "a successor's planner acts");
    assert_eq!(scale_ups(), 1, "the successor did not scale again: {:?}", kube.requests());
    assert_eq!(kube.replicas().await, 2);
}
