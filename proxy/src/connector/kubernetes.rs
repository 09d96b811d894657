//! The `kubernetes` connector: the planner scales a Deployment or StatefulSet through its
//! `scale` subresource (GET, then a merge PATCH of `spec.replicas`), and the workers are what
//! the EndpointSlices matching `selector` list as ready (pod address, the port named
//! `port_name`), followed with a watch that resumes from its resourceVersion and lists again
//! when that is gone (kube-rs's watcher: a watch that ends is restarted, a 410 relists).
//!
//! Which pod a scale-down removes is the controller's choice: a StatefulSet removes its highest
//! ordinal (so only that one is offered as the victim); for a Deployment the victim is marked
//! with `controller.kubernetes.io/pod-deletion-cost` first, so the ReplicaSet removes it. The
//! RBAC it needs is in deploy/kubernetes/rbac/rbac.yaml.

use super::{Connector, ConnectorError, Managed};
use crate::config::{KubernetesConnector, Origin, UpstreamUrl, WorkloadKind};
use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use parking_lot::RwLock;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

/// How long a call to the API server may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between two attempts to build the client (no credentials yet, API server down).
const RETRY: Duration = Duration::from_secs(5);

/// The `kubernetes` connector.
pub struct Kubernetes {
    cfg: KubernetesConnector,
    client: Arc<OnceCell<(kube::Client, String)>>,
    ready: Arc<RwLock<Vec<Managed>>>,
    /// Bumped at every change of `ready`.
    changed: tokio::sync::watch::Sender<u64>,
    watch: tokio::task::JoinHandle<()>,
}

impl Kubernetes {
    /// A connector for `cfg` (checked by the config); starts following the EndpointSlices at
    /// once. Must be called within the runtime.
    pub fn new(cfg: KubernetesConnector) -> Self {
        let client = Arc::new(OnceCell::new());
        let ready = Arc::new(RwLock::new(Vec::new()));
        let changed = tokio::sync::watch::Sender::new(0);
        let watch = tokio::spawn(follow(cfg.clone(), client.clone(), ready.clone(), changed.clone()));
        Self { cfg, client, ready, changed, watch }
    }

    async fn client(&self) -> Result<(kube::Client, String), ConnectorError> {
        let t0 = Instant::now();
        loop {
            if let Some(c) = self.client.get() {
                return Ok(c.clone());
            }
            if t0.elapsed() > CALL_TIMEOUT {
                return Err(ConnectorError::Cluster("no client: the kubeconfig or in-cluster credentials do not work (see the log)".into()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Adds `delta` replicas to the workload; returns the new count.
    async fn scale(&self, delta: i32) -> Result<i32, ConnectorError> {
        let (client, ns) = self.client().await?;
        let (kind, name) = self.cfg.workload().map_err(ConnectorError::Cluster)?;
        let call = async {
            match kind {
                WorkloadKind::Deployment => scale_by(Api::<Deployment>::namespaced(client, &ns), name, delta).await,
                WorkloadKind::StatefulSet => scale_by(Api::<StatefulSet>::namespaced(client, &ns), name, delta).await,
            }
        };
        tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .map_err(|_| ConnectorError::Cluster("the scale call timed out".into()))?
            .map_err(|e| ConnectorError::Cluster(e.to_string()))
    }

    /// Waits until `done` holds for the ready workers, or the ready timeout.
    async fn wait(&self, what: &str, mut done: impl FnMut(&[Managed]) -> bool) -> Result<Vec<Managed>, ConnectorError> {
        let mut rx = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + self.ready_timeout();
        loop {
            let now = self.ready.read().clone();
            if done(&now) {
                return Ok(now);
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return Err(ConnectorError::Timeout(format!("{what} within {:?}", self.ready_timeout())));
            }
        }
    }
}

impl Drop for Kubernetes {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

async fn scale_by<K>(api: Api<K>, name: &str, delta: i32) -> Result<i32, kube::Error>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let now = api.get_scale(name).await?.spec.and_then(|s| s.replicas).unwrap_or(0);
    let next = (now + delta).max(0);
    api.patch_scale(name, &PatchParams::default(), &Patch::Merge(serde_json::json!({"spec": {"replicas": next}}))).await?;
    Ok(next)
}

#[async_trait::async_trait]
impl Connector for Kubernetes {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    /// One more replica; returns the worker that appears ready in the EndpointSlices.
    async fn add(&self) -> Result<Managed, ConnectorError> {
        let before: Vec<UpstreamUrl> = self.ready.read().iter().map(|m| m.url.clone()).collect();
        let n = self.scale(1).await?;
        tracing::info!(workload = %self.cfg.workload, replicas = n, "planner: scaled up");
        let now = self.wait("no new ready endpoint appeared", |now| now.iter().any(|m| !before.contains(&m.url))).await?;
        Ok(now.into_iter().find(|m| !before.contains(&m.url)).expect("checked by wait"))
    }

    /// One replica fewer, the pod of `name` marked to go first; returns once its endpoint left.
    async fn remove(&self, name: &str) -> Result<(), ConnectorError> {
        let m = self.ready.read().iter().find(|m| m.name == name).cloned().ok_or_else(|| ConnectorError::Unknown(name.to_string()))?;
        if let Ok((WorkloadKind::Deployment, _)) = self.cfg.workload() {
            let (client, ns) = self.client().await?;
            let mark = serde_json::json!({"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": i32::MIN.to_string()}}});
            let (pods, params, patch) = (Api::<Pod>::namespaced(client, &ns), PatchParams::default(), Patch::Merge(mark));
            match tokio::time::timeout(CALL_TIMEOUT, pods.patch(name, &params, &patch)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(pod = name, error = %e, "planner: cannot mark the pod to go first; the ReplicaSet picks the pod to remove"),
                Err(_) => tracing::warn!(pod = name, "planner: marking the pod to go first timed out"),
            }
        }
        let n = self.scale(-1).await?;
        tracing::info!(workload = %self.cfg.workload, replicas = n, pod = name, "planner: scaled down");
        self.wait("the removed worker's endpoint did not leave", |now| !now.iter().any(|x| x.url == m.url)).await.map(|_| ())
    }

    fn list(&self) -> Vec<Managed> {
        self.ready.read().clone()
    }

    fn reap(&self) -> Vec<Managed> {
        // The workload's controller replaces pods that die; their endpoints leave on their own.
        Vec::new()
    }

    fn discovers(&self) -> bool {
        true
    }

    fn can_remove(&self, name: &str) -> bool {
        match self.cfg.workload() {
            Ok((WorkloadKind::StatefulSet, _)) => {
                let ordinal = |n: &str| n.rsplit_once('-').and_then(|(_, o)| o.parse::<u32>().ok());
                let highest = self.ready.read().iter().filter_map(|m| ordinal(&m.name)).max();
                ordinal(name).is_some() && ordinal(name) == highest
            }
            _ => true,
        }
    }

    fn ready_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.cfg.ready_timeout_s)
    }
}

/// Builds the client (again after a failure), then follows the EndpointSlices forever.
async fn follow(
    cfg: KubernetesConnector,
    cell: Arc<OnceCell<(kube::Client, String)>>,
    ready: Arc<RwLock<Vec<Managed>>>,
    changed: tokio::sync::watch::Sender<u64>,
) {
    let (client, ns) = loop {
        match connect(&cfg).await {
            Ok(c) => break c,
            Err(e) => {
                tracing::error!(error = %e, "planner: cannot reach the Kubernetes API; trying again");
                tokio::time::sleep(RETRY).await;
            }
        }
    };
    let _ = cell.set((client.clone(), ns.clone()));
    let api: Api<EndpointSlice> = Api::namespaced(client, &ns);
    let (store, writer) = reflector::store();
    let events = reflector(writer, watcher(api, watcher::Config::default().labels(&cfg.selector))).default_backoff();
    futures_util::pin_mut!(events);
    while let Some(ev) = events.next().await {
        if let Err(e) = ev {
            tracing::warn!(error = %e, "planner: the EndpointSlice watch failed; it is resumed");
            continue;
        }
        let slices: Vec<Arc<EndpointSlice>> = store.state();
        let now = workers(&slices, &cfg);
        let differs = *ready.read() != now;
        if differs {
            tracing::info!(workers = ?now.iter().map(|m| m.url.to_string()).collect::<Vec<_>>(), "planner: EndpointSlices changed");
            *ready.write() = now;
            changed.send_modify(|n| *n += 1);
        }
    }
}

/// A client from the kubeconfig named, or inferred (in-cluster, `$KUBECONFIG`,
/// `~/.kube/config`), and the namespace to use.
async fn connect(cfg: &KubernetesConnector) -> Result<(kube::Client, String), String> {
    let config = match &cfg.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| format!("{}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await.map_err(|e| e.to_string())?
        }
        None => kube::Config::infer().await.map_err(|e| e.to_string())?,
    };
    let ns = cfg.namespace.clone().unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config).map_err(|e| e.to_string())?;
    Ok((client, ns))
}

/// The ready workers the slices list: each ready, not terminating endpoint's first address
/// with the port named `port_name`, named by its pod; sorted by name.
pub fn workers(slices: &[Arc<EndpointSlice>], cfg: &KubernetesConnector) -> Vec<Managed> {
    let mut out: Vec<Managed> = Vec::new();
    for s in slices {
        let Some(port) = s.ports.iter().flatten().find(|p| p.name.as_deref() == Some(cfg.port_name.as_str())).and_then(|p| p.port) else { continue };
        for e in &s.endpoints {
            let c = e.conditions.as_ref();
            // The API: an unknown readiness is to be read as ready.
            let ready = c.and_then(|c| c.ready).unwrap_or(true) && !c.and_then(|c| c.terminating).unwrap_or(false);
            let Some(addr) = e.addresses.first().filter(|_| ready) else { continue };
            let host = if addr.contains(':') { format!("[{addr}]") } else { addr.clone() };
            let Ok(url) = UpstreamUrl::parse(&format!("http://{host}:{port}")) else { continue };
            let name = e.target_ref.as_ref().and_then(|r| r.name.clone()).unwrap_or_else(|| addr.clone());
            if !out.iter().any(|m| m.url == url) {
                out.push(Managed { name: name.clone(), url, gpus: Vec::new(), kv_events: cfg.kv_events, origin: Origin::Kubernetes(name) });
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_endpoints_with_the_named_port_are_the_workers() {
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "vllm-abc"}, "addressType": "IPv4",
            "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.2"], "conditions": {"ready": true}, "targetRef": {"kind": "Pod", "name": "vllm-1"}},
                {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "vllm-0"}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": false}, "targetRef": {"kind": "Pod", "name": "vllm-2"}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": true, "terminating": true}, "targetRef": {"kind": "Pod", "name": "vllm-3"}}
            ]
        }))
        .unwrap();
        let cfg: KubernetesConnector = serde_yaml::from_str("{workload: StatefulSet/vllm, selector: app=vllm}").unwrap();
        let w = workers(&[Arc::new(slice)], &cfg);
        let got: Vec<(String, String)> = w.iter().map(|m| (m.name.clone(), m.url.to_string())).collect();
        assert_eq!(got, [("vllm-0".to_string(), "http://10.0.0.1:8000".to_string()), ("vllm-1".into(), "http://10.0.0.2:8000".into())]);
        assert_eq!(w[0].origin.label(), "kubernetes:vllm-0");
    }
}
