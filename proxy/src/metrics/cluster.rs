//! Replica metrics (`kvgate_cluster_*`, docs/replicas.md): the peers this replica hears, how
//! late their load reaches it, what it failed to publish, its leadership and the admin
//! requests it forwarded. Registered whether or not `cluster:` is set (zero without it).

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Seconds from a peer publishing its load to this replica applying it.
const LAG_BUCKETS: &[f64] = &[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

/// The replica series.
#[derive(Clone)]
pub struct ClusterMetrics {
    /// `kvgate_cluster_peers`: peers heard from within `peer_timeout_ms`.
    pub peers: IntGauge,
    /// `kvgate_cluster_connected`: 1 while connected to NATS.
    pub connected: IntGauge,
    /// `kvgate_cluster_leader`: 1 while this replica holds the leader's lease.
    pub leader: IntGauge,
    /// `kvgate_cluster_lag_seconds`: from a peer publishing its load to this replica applying
    /// it (the replicas' clocks are compared: a histogram across hosts includes their offset).
    pub lag: Histogram,
    /// `kvgate_cluster_publish_failures_total`: load, affinity or lease messages that could
    /// not be handed to NATS.
    pub publish_failures: IntCounter,
    /// `kvgate_cluster_resyncs_total`: full exchanges of state after (re)connecting to NATS.
    pub resyncs: IntCounter,
    /// `kvgate_cluster_peers_expired_total`: peers dropped for silence, their bookings with
    /// them.
    pub expired: IntCounter,
    /// `kvgate_cluster_forwarded_total{what,outcome}`: admin requests this replica asked its
    /// peers to answer (`what`: `request`, `migrate`; `outcome`: `answered`, `not_found`).
    pub forwarded: IntCounterVec,
    /// `kvgate_cluster_affinity_dropped_total`: stored responses not shared because the
    /// outbox to NATS was full.
    pub affinity_dropped: IntCounter,
    /// `kvgate_cluster_decisions_dropped_total`: approximate mode's decisions not shared
    /// because the outbox to NATS was full.
    pub decisions_dropped: IntCounter,
    /// `kvgate_cluster_decisions_applied_total`: peers' approximate-mode decisions recorded in
    /// this replica's predicted cache.
    pub decisions_applied: IntCounter,
    /// `kvgate_cluster_peer_chains`: prompt chains the peers have booked and not released, as
    /// this replica holds them.
    pub peer_chains: IntGauge,
    /// `kvgate_cluster_chains_dropped_total`: booked chains not shared because the outbox to
    /// NATS was full.
    pub chains_dropped: IntCounter,
}

impl ClusterMetrics {
    /// Creates and registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let lag = Histogram::with_opts(
            HistogramOpts::new("kvgate_cluster_lag_seconds", "From a peer publishing its bookings to this replica applying them.")
                .buckets(LAG_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        registry.register(Box::new(lag.clone())).expect("unique metric");
        let forwarded = IntCounterVec::new(
            Opts::new("kvgate_cluster_forwarded_total", "Admin requests asked of the peers, by what and how it ended."),
            &["what", "outcome"],
        )
        .expect("valid metric");
        registry.register(Box::new(forwarded.clone())).expect("unique metric");
        Self {
            peers: gauge("kvgate_cluster_peers", "Peers heard from within peer_timeout_ms."),
            connected: gauge("kvgate_cluster_connected", "1 while connected to NATS."),
            leader: gauge("kvgate_cluster_leader", "1 while this replica holds the leader's lease."),
            lag,
            publish_failures: counter("kvgate_cluster_publish_failures_total", "Messages that could not be handed to NATS."),
            resyncs: counter("kvgate_cluster_resyncs_total", "Full exchanges of state after (re)connecting to NATS."),
            expired: counter("kvgate_cluster_peers_expired_total", "Peers dropped for silence, with their bookings."),
            forwarded,
            affinity_dropped: counter("kvgate_cluster_affinity_dropped_total", "Stored responses not shared: the outbox to NATS was full."),
            decisions_dropped: counter("kvgate_cluster_decisions_dropped_total", "Approximate mode's decisions not shared: the outbox to NATS was full."),
            decisions_applied: counter(
                "kvgate_cluster_decisions_applied_total",
                "Peers' approximate-mode decisions recorded in this replica's predicted cache.",
            ),
            peer_chains: gauge("kvgate_cluster_peer_chains", "Prompt chains the peers booked and have not released, as this replica holds them."),
            chains_dropped: counter("kvgate_cluster_chains_dropped_total", "Booked prompt chains not shared: the outbox to NATS was full."),
        }
    }
}
