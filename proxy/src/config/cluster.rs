//! The `cluster` section: replicas of one deployment acting as one router over NATS
//! (docs/replicas.md). Absent, the gateway runs alone, exactly as without it. Read at start:
//! a reload that changes it is refused.

use serde::Deserialize;

/// How this replica finds its peers and what it shares with them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// The NATS server (`nats://host:4222`; several, comma-separated, for a NATS cluster).
    pub nats_url: String,
    /// The deployment's name: replicas with the same name share their state (it prefixes
    /// every subject and bucket). Letters, digits, '-' and '_'.
    #[serde(default = "default_deployment")]
    pub deployment: String,
    /// This replica's name among its peers (unset: the host name and the process's instance
    /// id). Must differ between replicas.
    #[serde(default)]
    pub replica: Option<String>,
    /// How often this replica looks for changes in its own bookings and publishes them, ms.
    #[serde(default = "default_publish_interval_ms")]
    pub publish_interval_ms: u64,
    /// How often this replica publishes all of its bookings and its liveness, ms.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A peer not heard from for this long is gone: its bookings leave every view, ms.
    #[serde(default = "default_peer_timeout_ms")]
    pub peer_timeout_ms: u64,
    /// The leader's lease: a leader that has not renewed it for this long loses it and
    /// another replica takes over (the planner and the rescheduler run on the leader only), ms.
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
    /// How long a stored response's worker is remembered in the shared bucket, s.
    #[serde(default = "default_affinity_ttl_s")]
    pub affinity_ttl_s: u64,
    /// How long an admin request forwarded to the peers (`GET /requests/{id}`,
    /// `POST /migrate` for a request held elsewhere) waits for their answers, ms.
    #[serde(default = "default_forward_timeout_ms")]
    pub forward_timeout_ms: u64,
}

fn default_deployment() -> String {
    "kvgate".into()
}

fn default_publish_interval_ms() -> u64 {
    5
}

fn default_heartbeat_ms() -> u64 {
    1_000
}

fn default_peer_timeout_ms() -> u64 {
    3_000
}

fn default_lease_ms() -> u64 {
    5_000
}

fn default_affinity_ttl_s() -> u64 {
    3_600
}

fn default_forward_timeout_ms() -> u64 {
    1_000
}

impl Cluster {
    /// The NATS servers `nats_url` names.
    pub fn servers(&self) -> Vec<&str> {
        self.nats_url.split(',').map(str::trim).filter(|s| !s.is_empty()).collect()
    }

    /// Checks names and ranges.
    pub fn validate(&self) -> Result<(), String> {
        let token = |s: &str| !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if self.nats_url.trim().is_empty() {
            return Err("nats_url must name a NATS server (nats://host:4222)".into());
        }
        for url in self.servers() {
            url.parse::<async_nats::ServerAddr>().map_err(|e| format!("nats_url: {url:?}: {e}"))?;
        }
        if !token(&self.deployment) {
            return Err(format!("deployment {:?} must be 1 to 64 letters, digits, '-' or '_'", self.deployment));
        }
        if let Some(r) = &self.replica
            && !token(r)
        {
            return Err(format!("replica {r:?} must be 1 to 64 letters, digits, '-' or '_'"));
        }
        if !(1..=1_000).contains(&self.publish_interval_ms) {
            return Err("publish_interval_ms must be within 1..=1000".into());
        }
        if self.heartbeat_ms < self.publish_interval_ms || self.heartbeat_ms > 60_000 {
            return Err("heartbeat_ms must be at least publish_interval_ms and at most 60000".into());
        }
        if self.peer_timeout_ms < 2 * self.heartbeat_ms {
            return Err("peer_timeout_ms must be at least twice heartbeat_ms (a peer is not dropped for one late heartbeat)".into());
        }
        if self.lease_ms < 2 * self.heartbeat_ms {
            return Err("lease_ms must be at least twice heartbeat_ms (the leader renews it every heartbeat)".into());
        }
        if self.affinity_ttl_s == 0 || self.forward_timeout_ms == 0 {
            return Err("affinity_ttl_s and forward_timeout_ms must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Cluster {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn defaults_hold_and_bad_values_are_named() {
        let c = parse("nats_url: nats://127.0.0.1:4222");
        assert_eq!((c.deployment.as_str(), c.publish_interval_ms, c.heartbeat_ms, c.peer_timeout_ms, c.lease_ms), ("kvgate", 5, 1_000, 3_000, 5_000));
        c.validate().unwrap();
        let bad = |y: &str, want: &str| {
            let e = parse(y).validate().unwrap_err();
            assert!(e.contains(want), "{e}");
        };
        bad("nats_url: nats://x\ndeployment: a.b", "deployment");
        bad("nats_url: nats://x\nreplica: 'a b'", "replica");
        bad("nats_url: nats://x\npeer_timeout_ms: 1500", "peer_timeout_ms");
        bad("nats_url: nats://x\nlease_ms: 1000", "lease_ms");
        bad("nats_url: ' '", "nats_url");
        bad("nats_url: 'nats://a:b:c'", "nats_url");
        assert!(serde_yaml::from_str::<Cluster>("nats_url: x\nbogus: 1").is_err(), "unknown keys are refused");
    }
}
