//! Replicas of one deployment acting as one router over NATS (docs/replicas.md). This module
//! holds what the rest of the gateway reads of the cluster ([`Cluster`]: whether this replica
//! may act as leader, the peers, the outbox of stored responses to share) and the pieces the
//! cluster task (`tasks::cluster`) runs: the messages ([`wire`]), the peers and their bookings
//! ([`members`]), the leader's lease ([`lease`]), the stored responses' keys ([`affinity`]) and
//! the tenants' usage ([`tenants`]).
//!
//! Nothing here is on the request path: a request reads the ledger, where the task has summed
//! the peers' bookings, and at most hands a stored response to a bounded outbox without
//! waiting. Without `cluster:` the handle is empty and every check is one branch.

pub mod affinity;
pub mod chains;
pub mod lease;
pub mod members;
pub mod tenants;
pub mod wire;

use crate::config::cluster::Cluster as ClusterConfig;
use crate::metrics::cluster::ClusterMetrics;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Stored responses waiting to be shared; past this many, new ones are dropped and counted
/// (each replica still keeps its own).
const AFFINITY_OUTBOX: usize = 4_096;

/// Approximate mode's routing decisions waiting to be shared; past this many, new ones are
/// dropped and counted.
const DECISIONS_OUTBOX: usize = 4_096;

/// This replica's part in its deployment; empty without `cluster:`.
#[derive(Clone, Default)]
pub struct Cluster {
    shared: Option<Arc<Shared>>,
}

/// A replica's cluster state, shared by its cluster task, its admin API and its requests.
pub struct Shared {
    /// The `cluster` section as read at start.
    pub cfg: ClusterConfig,
    /// This replica's name.
    pub replica: String,
    /// This process's instance id.
    pub instance: String,
    /// Subjects and buckets of the deployment.
    pub subjects: wire::Subjects,
    /// `kvgate_cluster_*`.
    pub metrics: ClusterMetrics,
    /// The NATS client, once the task made it.
    pub client: Mutex<Option<async_nats::Client>>,
    /// The peers and their bookings.
    pub members: Mutex<members::Members>,
    /// The leader's lease as this replica knows it.
    pub lease: Mutex<lease::Lease>,
    /// Another process publishes under this replica's name (said once in the log).
    pub name_clash: std::sync::atomic::AtomicBool,
    outbox: mpsc::Sender<(String, String)>,
    /// The outbox's other end, held by the cluster task while it runs.
    pub inbox: tokio::sync::Mutex<mpsc::Receiver<(String, String)>>,
    decisions: mpsc::Sender<wire::Decision>,
    /// The booked chains to share ([`chains::Sink`]'s outbox).
    pub chains: mpsc::Sender<chains::Op>,
    /// Their other end, held by the cluster task while it runs.
    pub chains_inbox: tokio::sync::Mutex<mpsc::Receiver<chains::Op>>,
    /// The peers' chains applied to the ledgers.
    pub held_chains: Mutex<chains::Held>,
    /// Approximate mode's decisions to share, held by the cluster task while it runs.
    pub decisions_inbox: tokio::sync::Mutex<mpsc::Receiver<wire::Decision>>,
}

impl Cluster {
    /// The cluster of `cfg` (`None`: none) for the process `instance`.
    pub fn new(cfg: Option<&ClusterConfig>, instance: &str, metrics: &ClusterMetrics) -> Self {
        let Some(cfg) = cfg else { return Self::default() };
        let replica = cfg.replica.clone().unwrap_or_else(|| default_name(instance));
        let (outbox, inbox) = mpsc::channel(AFFINITY_OUTBOX);
        let (decisions, decisions_inbox) = mpsc::channel(DECISIONS_OUTBOX);
        let (chains, chains_inbox) = mpsc::channel(chains::OUTBOX);
        let shared = Shared {
            subjects: wire::Subjects::of(&cfg.deployment),
            cfg: cfg.clone(),
            replica,
            instance: instance.to_string(),
            metrics: metrics.clone(),
            client: Mutex::new(None),
            members: Mutex::default(),
            lease: Mutex::default(),
            name_clash: std::sync::atomic::AtomicBool::new(false),
            outbox,
            inbox: tokio::sync::Mutex::new(inbox),
            decisions,
            decisions_inbox: tokio::sync::Mutex::new(decisions_inbox),
            chains,
            chains_inbox: tokio::sync::Mutex::new(chains_inbox),
            held_chains: Mutex::default(),
        };
        Self { shared: Some(Arc::new(shared)) }
    }

    /// The shared state, when `cluster:` is set.
    pub fn shared(&self) -> Option<&Arc<Shared>> {
        self.shared.as_ref()
    }

    /// Whether this replica runs the deployment's fleet-wide decisions (the planner, the
    /// rescheduler): always alone; in a cluster, while it holds the leader's lease.
    pub fn acts(&self) -> bool {
        self.shared.as_ref().is_none_or(|s| s.acts(Instant::now()))
    }

    /// Shares that `worker` stored response `id` with the peers, without waiting: a full
    /// outbox drops it, counted.
    pub fn share_response(&self, id: &str, worker: &impl std::fmt::Display) {
        if let Some(s) = &self.shared
            && s.outbox.try_send((id.to_string(), worker.to_string())).is_err()
        {
            s.metrics.affinity_dropped.inc();
        }
    }

    /// Shares approximate mode's decision that `worker` of `model` took on a prompt of block
    /// hashes `chain` with the peers, without waiting: a full outbox drops it, counted.
    pub fn share_decision(&self, model: &str, worker: &impl std::fmt::Display, chain: &[u64]) {
        if let Some(s) = &self.shared {
            let d = wire::Decision { model: model.to_string(), worker: worker.to_string(), chain: chain.to_vec() };
            if s.decisions.try_send(d).is_err() {
                s.metrics.decisions_dropped.inc();
            }
        }
    }

    /// `GET /cluster`'s answer.
    pub fn view(&self) -> serde_json::Value {
        let Some(s) = &self.shared else { return serde_json::json!({"enabled": false}) };
        let now = Instant::now();
        let lease = s.lease.lock().clone();
        serde_json::json!({
            "enabled": true,
            "deployment": s.cfg.deployment,
            "replica": s.replica,
            "instance": s.instance,
            "connected": s.metrics.connected.get() == 1,
            "leader": lease.leader,
            "leads": s.acts(now),
            "peers": s.members.lock().views(now),
        })
    }
}

impl Shared {
    /// Whether this replica holds the leader's lease at `now`, with a heartbeat to spare.
    pub fn acts(&self, now: Instant) -> bool {
        self.lease.lock().acts(now, Duration::from_millis(self.cfg.lease_ms), Duration::from_millis(self.cfg.heartbeat_ms))
    }

    /// The NATS client, once made.
    pub fn client(&self) -> Option<async_nats::Client> {
        self.client.lock().clone()
    }
}

/// A replica's name when none is configured: the host's name and the process's instance id.
fn default_name(instance: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host: String = host.trim().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_').take(40).collect();
    if host.is_empty() { instance.to_string() } else { format!("{host}-{instance}") }
}
