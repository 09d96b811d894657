//! The leader's lease (docs/replicas.md, "One planner"): one key in a JetStream key-value
//! bucket whose entries expire `lease_ms` after they were written. A replica becomes leader by
//! creating the key (which fails while another holds it) and stays leader by updating it at its
//! revision every heartbeat; a leader that stops (killed, cut off from NATS) lets it expire, and
//! the first replica to create it next leads.
//!
//! A leader acts only until `lease_ms − heartbeat_ms` after the moment it sent its last
//! successful renewal: the server's copy cannot expire before that moment plus `lease_ms`, so
//! an old leader has stopped acting before a new one can take the key, and no decision is acted
//! on twice.

use async_nats::jetstream::kv::Store;
use std::time::{Duration, Instant};

/// The key holding the leader's name.
const KEY: &str = "leader";

/// What this replica knows of the lease.
#[derive(Debug, Clone, Default)]
pub struct Lease {
    /// The key's revision this replica wrote last, while it holds the lease.
    revision: Option<u64>,
    /// When it sent that write.
    renewed: Option<Instant>,
    /// The leader's name, as last read (this replica's own while it leads).
    pub leader: Option<String>,
    /// How many times this replica took the lease.
    pub taken: u64,
}

impl Lease {
    /// Whether this replica may act as leader at `now`: it holds the lease and renewed it
    /// within `lease − margin`.
    pub fn acts(&self, now: Instant, lease: Duration, margin: Duration) -> bool {
        self.revision.is_some() && self.renewed.is_some_and(|r| now.duration_since(r) < lease.saturating_sub(margin))
    }

    /// One turn: renew the lease if held, else try to take it; otherwise learn who holds it.
    /// False when the bucket could not be read at all (it may be gone).
    pub async fn step(&mut self, kv: &Store, me: &str) -> bool {
        let sent = Instant::now();
        if let Some(rev) = self.revision {
            match kv.update(KEY, me.to_string().into(), rev).await {
                Ok(r) => {
                    self.held(r, sent, me);
                    return true;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cluster: lost the leader's lease");
                    self.revision = None;
                    self.renewed = None;
                }
            }
        }
        match kv.create(KEY, me.to_string().into()).await {
            Ok(r) => {
                self.taken += 1;
                tracing::info!(replica = me, "cluster: this replica leads");
                self.held(r, sent, me);
                true
            }
            Err(_) => match kv.get(KEY).await {
                Ok(v) => {
                    self.leader = v.map(|v| String::from_utf8_lossy(&v).into_owned());
                    true
                }
                Err(_) => {
                    self.leader = None;
                    false
                }
            },
        }
    }

    /// Forgets the lease (NATS unreachable): this replica stops acting at once.
    pub fn drop_held(&mut self) {
        self.revision = None;
        self.renewed = None;
    }

    fn held(&mut self, revision: u64, sent: Instant, me: &str) {
        self.revision = Some(revision);
        self.renewed = Some(sent);
        self.leader = Some(me.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_stops_acting_a_margin_before_its_lease_can_expire() {
        let t0 = Instant::now();
        let mut l = Lease::default();
        let (lease, margin) = (Duration::from_secs(5), Duration::from_secs(1));
        assert!(!l.acts(t0, lease, margin), "never took it");
        l.held(3, t0, "a");
        assert!(l.acts(t0 + Duration::from_millis(3_900), lease, margin));
        assert!(!l.acts(t0 + Duration::from_millis(4_000), lease, margin), "the margin before the server's expiry");
        l.drop_held();
        assert!(!l.acts(t0, lease, margin));
    }
}
