//! Tenants' usage shared between replicas, so that a tenant's limits and its fair share hold
//! for the deployment, not per replica. Each replica publishes, per tenant, what its own
//! requests used since its last message (requests, input and output tokens, tokens served)
//! and how many it has in flight; its peers charge the usage to their buckets, add the tokens
//! served to the tenant's fair-share counter, and count the requests in flight against
//! `max_concurrent`.
//!
//! The drift: a peer's usage reaches a replica one publish interval later at most, plus the
//! NATS hop, so replicas admitting a tenant's requests at the same moment may together pass its
//! limit by what the others admit in that time. Usage published while NATS is down is lost to
//! the peers (each replica then holds the tenant to its limit on what it sees itself).

use crate::tenants::Table;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// One replica's tenants' usage since its last message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TenantsMessage {
    /// The sender's replica name.
    pub replica: String,
    /// The sender's process: a replica restarted under the same name counts afresh.
    pub instance: String,
    /// Per tenant.
    pub tenants: Vec<TenantUsage>,
}

/// What one replica's requests of one tenant used since its last message, and hold now.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TenantUsage {
    /// The tenant.
    pub name: String,
    /// Requests admitted.
    pub requests: i64,
    /// Prompt tokens charged (negative after a correction).
    pub input_tokens: i64,
    /// Output tokens charged (negative after a correction).
    pub output_tokens: i64,
    /// Tokens served (the fair-share counter's growth).
    pub served: u64,
    /// Requests in flight now.
    pub in_flight: u32,
}

/// What this replica last told its peers, per tenant: the totals the next deltas start from.
#[derive(Debug, Default)]
pub struct Outgoing {
    last: HashMap<String, [u64; 5]>,
}

impl Outgoing {
    /// Each tenant's usage since the last call; every tenant when `whole` (a heartbeat, which
    /// also refreshes the requests in flight), else only those whose figures changed.
    pub fn usage(&mut self, table: &Table, whole: bool) -> Vec<TenantUsage> {
        let mut out = Vec::new();
        for t in &table.all {
            let a = &t.account;
            let (requests, input, output) = a.totals();
            let now = [requests, input, output, a.fair().served(), u64::from(a.in_flight())];
            let before = self.last.insert(t.name.clone(), now).unwrap_or_default();
            if !whole && now == before {
                continue;
            }
            let delta = |i: usize| now[i].cast_signed().wrapping_sub(before[i].cast_signed());
            out.push(TenantUsage {
                name: t.name.clone(),
                requests: delta(0),
                input_tokens: delta(1),
                output_tokens: delta(2),
                served: now[3].saturating_sub(before[3]),
                in_flight: a.in_flight(),
            });
        }
        out
    }
}

/// The peers' requests in flight per tenant, as they last said.
#[derive(Debug, Default)]
pub struct PeerTenants {
    /// Per peer: its process, when it last spoke, its tenants' requests in flight.
    peers: HashMap<String, (String, Instant, HashMap<String, u32>)>,
}

impl PeerTenants {
    /// Applies a peer's message: its usage charged to the tenants' accounts, its requests in
    /// flight counted.
    pub fn apply(&mut self, m: TenantsMessage, table: &Table, now: Instant) {
        let entry = self.peers.entry(m.replica).or_insert_with(|| (m.instance.clone(), now, HashMap::new()));
        if entry.0 != m.instance {
            *entry = (m.instance, now, HashMap::new());
        }
        entry.1 = now;
        for u in m.tenants {
            let Some(t) = table.all.iter().find(|t| t.name == u.name) else { continue };
            t.account.charge_peer(u.requests, u.input_tokens, u.output_tokens);
            t.account.fair().serve_peer(u.served);
            entry.2.insert(u.name, u.in_flight);
        }
        self.set_sums(table);
    }

    /// Forgets the peers silent for `timeout` (their requests in flight with them).
    pub fn expire(&mut self, table: &Table, timeout: Duration, now: Instant) {
        let before = self.peers.len();
        self.peers.retain(|_, (_, seen, _)| now.duration_since(*seen) < timeout);
        if self.peers.len() != before {
            self.set_sums(table);
        }
    }

    fn set_sums(&self, table: &Table) {
        for t in &table.all {
            let n = self.peers.values().filter_map(|(_, _, m)| m.get(&t.name)).sum();
            t.account.set_peer_in_flight(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tenants::Tenants;

    fn table() -> std::sync::Arc<Table> {
        let t: Tenants = serde_yaml::from_str("list: [{name: a, requests_per_minute: 10, max_concurrent: 2}]").unwrap();
        let r = crate::tenants::Registry::default();
        r.apply(Some(&t));
        r.table().unwrap()
    }

    #[test]
    fn what_one_replica_used_is_charged_at_the_other_and_its_requests_in_flight_count() {
        let (here, there) = (table(), table());
        let mut out = Outgoing::default();
        assert!(out.usage(&here, false).is_empty(), "nothing used yet");
        assert_eq!(out.usage(&here, true).len(), 2, "a heartbeat reports every tenant (`default` too)");
        let held = here.all[0].account.admit(5).unwrap();
        let msg = TenantsMessage { replica: "r1".into(), instance: "i1".into(), tenants: out.usage(&here, false) };
        assert_eq!((msg.tenants[0].requests, msg.tenants[0].input_tokens, msg.tenants[0].in_flight), (1, 5, 1));
        let mut peers = PeerTenants::default();
        let now = Instant::now();
        peers.apply(msg, &there, now);
        let a = &there.all[0].account;
        assert_eq!(a.snapshot().requests.unwrap().remaining, 9);
        assert_eq!(a.snapshot().concurrent, (1, 2));
        let _one = a.admit(1).unwrap();
        assert_eq!(a.admit(1).unwrap_err().dimension, kvgate_filters::tenant::Dimension::Concurrent);
        peers.expire(&there, Duration::from_secs(3), now + Duration::from_secs(4));
        assert_eq!(a.snapshot().concurrent, (1, 2), "a silent peer's requests leave the count");
        drop(held);
    }
}
