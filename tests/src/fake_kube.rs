//! A fake Kubernetes API server for the planner's `kubernetes` connector: no API server runs on
//! the test machines, so this one speaks the real paths and JSON of the calls the connector
//! makes, and plays the controllers' part with in-process vllm-sim "pods":
//! - `GET`/`PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale` (`autoscaling/v1`
//!   Scale; a merge patch of `spec.replicas` starts or removes pods, the lowest
//!   `controller.kubernetes.io/pod-deletion-cost` first, as a ReplicaSet does);
//! - `PATCH /api/v1/namespaces/{ns}/pods/{name}` (annotations);
//! - `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`: a list with its
//!   resourceVersion, and with `watch=true` a stream of watch events from the resourceVersion
//!   asked for; a watch can be dropped, or answered 410 Gone (an `ERROR` event with an
//!   `Expired` Status) once the history it asks for is forgotten.
//!
//! Every request is recorded (method, path and query, body) for the tests to check.

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::broadcast;
use vllm_sim::{SimConfig, SimServer};

/// One pod: a simulator, its readiness, its deletion cost.
struct Pod {
    name: String,
    sim: SimServer,
    ready: bool,
    cost: i64,
}

struct Inner {
    replicas: u32,
    pods: Vec<Pod>,
    next_pod: u32,
    rv: u64,
    /// Watch events kept for watches that resume: (resourceVersion, event).
    history: Vec<(u64, Value)>,
    /// History before this resourceVersion is forgotten (a resume from before it gets 410).
    forgotten_before: u64,
}

/// The fake API server.
#[derive(Clone)]
pub struct FakeKube {
    inner: Arc<tokio::sync::Mutex<Inner>>,
    log: Arc<Mutex<Vec<(String, String, String)>>>,
    events: broadcast::Sender<Option<Value>>,
    sim: SimConfig,
    /// Its base URL.
    pub url: String,
}

/// Namespace, deployment and label of the fake's one workload.
pub const NS: &str = "test";
/// The Deployment's name.
pub const DEPLOYMENT: &str = "vllm";

impl FakeKube {
    /// A server whose Deployment runs `replicas` pods of `sim`.
    pub async fn start(sim: SimConfig, replicas: u32) -> Self {
        let inner = Inner { replicas: 0, pods: Vec::new(), next_pod: 0, rv: 100, history: Vec::new(), forgotten_before: 0 };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let (events, _) = broadcast::channel(1024);
        let me = Self { inner: Arc::new(tokio::sync::Mutex::new(inner)), log: Arc::default(), events, sim, url };
        me.set_replicas(replicas).await;
        let app = Router::new()
            .route("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", get(scale).patch(scale))
            .route("/api/v1/namespaces/{ns}/pods/{name}", axum::routing::patch(pod))
            .route("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", get(slices))
            .fallback(|m: Method, u: Uri| async move { (StatusCode::NOT_FOUND, format!("fake kube: no {m} {u}")) })
            .with_state(me.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
        me
    }

    /// A kubeconfig naming this server, written to `path`.
    pub fn kubeconfig(&self, path: &std::path::Path) {
        let kc = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\nusers:\n- name: tester\n  user:\n    token: fake-token\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: tester\n    namespace: {NS}\ncurrent-context: fake\n",
            self.url
        );
        std::fs::write(path, kc).expect("write kubeconfig");
    }

    /// Every request so far: (method, path?query, body).
    pub fn requests(&self) -> Vec<(String, String, String)> {
        self.log.lock().clone()
    }

    /// The Deployment's replicas.
    pub async fn replicas(&self) -> u32 {
        self.inner.lock().await.replicas
    }

    /// The pods' names.
    pub async fn pods(&self) -> Vec<String> {
        self.inner.lock().await.pods.iter().map(|p| p.name.clone()).collect()
    }

    /// Sets a pod's readiness (an EndpointSlice change).
    pub async fn set_ready(&self, pod: &str, ready: bool) {
        let mut g = self.inner.lock().await;
        if let Some(p) = g.pods.iter_mut().find(|p| p.name == pod) {
            p.ready = ready;
        }
        self.publish(&mut g);
    }

    /// Ends every watch in progress (as an API server does at its timeout or on restart).
    pub fn drop_watches(&self) {
        let _ = self.events.send(None);
    }

    /// Forgets the watch history so far: a watch resumed from before now gets 410 Gone.
    pub async fn forget_history(&self) {
        let mut g = self.inner.lock().await;
        g.forgotten_before = g.rv + 1;
        g.history.clear();
    }

    async fn set_replicas(&self, n: u32) {
        let mut g = self.inner.lock().await;
        g.replicas = n;
        while (g.pods.len() as u32) < n {
            let sim = SimServer::start(self.sim.clone()).await.expect("pod sim starts");
            let name = format!("{DEPLOYMENT}-{}", g.next_pod);
            g.next_pod += 1;
            g.pods.push(Pod { name, sim, ready: true, cost: 0 });
        }
        while g.pods.len() as u32 > n {
            // A ReplicaSet removes the pod with the lowest deletion cost first.
            let i = g.pods.iter().enumerate().min_by_key(|(i, p)| (p.cost, std::cmp::Reverse(*i))).map(|(i, _)| i).expect("a pod");
            let p = g.pods.remove(i);
            tokio::spawn(p.sim.shutdown());
        }
        self.publish(&mut g);
    }

    /// The slices now: one per pod (each pod's simulator listens on a port of its own).
    fn slices_now(g: &Inner) -> Vec<Value> {
        g.pods
            .iter()
            .map(|p| {
                let addr = p.sim.url();
                let (ip, port) =
                    addr.trim_start_matches("http://").rsplit_once(':').map(|(h, p)| (h.to_string(), p.parse::<u16>().unwrap_or(0))).unwrap_or_default();
                json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                       "metadata": {"name": format!("{}-slice", p.name), "namespace": NS, "resourceVersion": g.rv.to_string(),
                                    "labels": {"kubernetes.io/service-name": DEPLOYMENT}},
                       "endpoints": [{"addresses": [ip], "conditions": {"ready": p.ready, "serving": p.ready, "terminating": false},
                                      "targetRef": {"kind": "Pod", "name": p.name, "namespace": NS}}],
                       "ports": [{"name": "metrics", "port": 1, "protocol": "TCP"}, {"name": "http", "port": port, "protocol": "TCP"}]})
            })
            .collect()
    }

    /// Records the change as watch events: every pod's slice added (new to the watchers) or
    /// modified, and the slices of pods that are gone deleted.
    fn publish(&self, g: &mut Inner) {
        let known = g.known_slices();
        g.rv += 1;
        let now = Self::slices_now(g);
        let names: Vec<String> = now.iter().filter_map(|s| s["metadata"]["name"].as_str().map(str::to_string)).collect();
        let mut out = Vec::new();
        for (s, name) in now.into_iter().zip(&names) {
            let t = if known.contains(name) { "MODIFIED" } else { "ADDED" };
            out.push(json!({"type": t, "object": s}));
        }
        for n in known.into_iter().filter(|n| !names.contains(n)) {
            let s = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4", "endpoints": [],
                           "metadata": {"name": n, "namespace": NS, "resourceVersion": g.rv.to_string(), "labels": {"kubernetes.io/service-name": DEPLOYMENT}}});
            out.push(json!({"type": "DELETED", "object": s}));
        }
        for e in out {
            g.history.push((g.rv, e.clone()));
            let _ = self.events.send(Some(e));
        }
    }
}

impl Inner {
    /// Slices a watcher has been told about and not told deleted.
    fn known_slices(&self) -> Vec<String> {
        let mut live: Vec<String> = Vec::new();
        for (_, e) in &self.history {
            let Some(n) = e["object"]["metadata"]["name"].as_str() else { continue };
            if e["type"] == "DELETED" {
                live.retain(|x| x != n);
            } else if !live.iter().any(|x| x == n) {
                live.push(n.to_string());
            }
        }
        live
    }
}

fn record(k: &FakeKube, m: &Method, uri: &Uri, body: &[u8]) {
    k.log.lock().push((m.to_string(), uri.to_string(), String::from_utf8_lossy(body).into_owned()));
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (status, [("content-type", "application/json")], v.to_string()).into_response()
}

async fn scale(State(k): State<FakeKube>, Path((ns, name)): Path<(String, String)>, m: Method, uri: Uri, body: Bytes) -> Response {
    record(&k, &m, &uri, &body);
    if ns != NS || name != DEPLOYMENT {
        return json_response(StatusCode::NOT_FOUND, &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}));
    }
    if m == Method::PATCH {
        let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let Some(n) = patch["spec"]["replicas"].as_u64() else {
            return json_response(StatusCode::UNPROCESSABLE_ENTITY, &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 422}));
        };
        k.set_replicas(n as u32).await;
    }
    let n = k.replicas().await;
    json_response(
        StatusCode::OK,
        &json!({"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": DEPLOYMENT, "namespace": NS},
                "spec": {"replicas": n}, "status": {"replicas": n, "selector": "app=vllm"}}),
    )
}

async fn pod(State(k): State<FakeKube>, Path((_, name)): Path<(String, String)>, m: Method, uri: Uri, body: Bytes) -> Response {
    record(&k, &m, &uri, &body);
    let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut g = k.inner.lock().await;
    let Some(p) = g.pods.iter_mut().find(|p| p.name == name) else {
        return json_response(StatusCode::NOT_FOUND, &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}));
    };
    if let Some(c) = patch["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"].as_str().and_then(|c| c.parse().ok()) {
        p.cost = c;
    }
    json_response(StatusCode::OK, &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}}))
}

async fn slices(State(k): State<FakeKube>, m: Method, uri: Uri) -> Response {
    record(&k, &m, &uri, b"");
    // The parameters read here (watch, resourceVersion) need no percent-decoding.
    let q: HashMap<&str, &str> = uri.query().unwrap_or("").split('&').filter_map(|kv| kv.split_once('=')).collect();
    let g = k.inner.lock().await;
    if q.get("watch").is_none_or(|w| *w != "true" && *w != "1") {
        let list = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList", "metadata": {"resourceVersion": g.rv.to_string()},
                          "items": FakeKube::slices_now(&g)});
        return json_response(StatusCode::OK, &list);
    }
    let from: u64 = q.get("resourceVersion").and_then(|r| r.parse().ok()).unwrap_or(0);
    if from < g.forgotten_before {
        let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "message": format!("too old resource version: {from}"), "reason": "Expired", "code": 410}});
        return (StatusCode::OK, [("content-type", "application/json")], format!("{gone}\n")).into_response();
    }
    // Subscribed under the lock that publishing holds: nothing falls between the backlog and
    // the live events.
    let backlog: Vec<Value> = g.history.iter().filter(|(rv, _)| *rv > from).map(|(_, e)| e.clone()).collect();
    let rx = k.events.subscribe();
    drop(g);
    let first = futures_util::stream::iter(backlog.into_iter().map(|e| Ok::<_, std::io::Error>(Bytes::from(format!("{e}\n")))));
    let live = futures_util::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(Some(e)) => return Some((Ok(Bytes::from(format!("{e}\n"))), rx)),
                // drop_watches: the watch ends.
                Ok(None) | Err(broadcast::error::RecvError::Closed) => return None,
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
            }
        }
    });
    Response::builder().status(200).header("content-type", "application/json").body(Body::from_stream(first.chain(live))).expect("response")
}

use futures_util::StreamExt;
