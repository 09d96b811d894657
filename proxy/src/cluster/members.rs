//! The peers this replica hears and what each booked per worker: applied from their
//! [`LoadMessage`]s, summed per worker for the ledger ([`Members::sum`]), dropped with their
//! bookings once silent for `peer_timeout_ms` ([`Members::expire`]).

use super::wire::LoadMessage;
use kvgate_filters::ledger::peers::OwnLoad;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// One peer.
#[derive(Debug)]
struct Peer {
    instance: String,
    admin: String,
    last_seen: Instant,
    /// Per worker URL: its bookings there and when they arrived (the backlog runs down from
    /// then).
    loads: HashMap<String, (OwnLoad, Instant)>,
}

/// A peer as `GET /cluster` shows it.
#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub struct PeerView {
    /// Its replica name.
    pub replica: String,
    /// Its admin listener.
    pub admin: String,
    /// Since its last message, ms.
    pub last_seen_ms: u64,
    /// Requests it has in flight, over every worker.
    pub requests: u64,
}

/// The peers heard from, by replica name.
#[derive(Debug, Default)]
pub struct Members {
    peers: HashMap<String, Peer>,
}

impl Members {
    /// Applies a peer's message received at `now`; returns the worker URLs whose sums it
    /// changed.
    pub fn apply(&mut self, m: LoadMessage, now: Instant) -> HashSet<String> {
        let peer =
            self.peers.entry(m.replica).or_insert_with(|| Peer { instance: m.instance.clone(), admin: String::new(), last_seen: now, loads: HashMap::new() });
        let mut changed = HashSet::new();
        if peer.instance != m.instance || m.full {
            // A new process under the name, or a whole picture: what is absent is idle.
            changed.extend(peer.loads.drain().map(|(url, _)| url));
            peer.instance = m.instance;
        }
        peer.last_seen = now;
        peer.admin = m.admin;
        for w in m.workers {
            changed.insert(w.url.clone());
            if w.load == OwnLoad::default() {
                peer.loads.remove(&w.url);
            } else {
                peer.loads.insert(w.url, (w.load, now));
            }
        }
        changed
    }

    /// Drops the peers not heard from within `timeout` of `now`; returns how many, and the
    /// worker URLs they booked on.
    pub fn expire(&mut self, timeout: Duration, now: Instant) -> (usize, HashSet<String>) {
        let gone: Vec<String> = self.peers.iter().filter(|(_, p)| now.duration_since(p.last_seen) > timeout).map(|(n, _)| n.clone()).collect();
        let mut urls = HashSet::new();
        for name in &gone {
            if let Some(p) = self.peers.remove(name) {
                urls.extend(p.loads.into_keys());
            }
        }
        (gone.len(), urls)
    }

    /// What the peers booked on the worker at `url`, summed, as of `now`.
    pub fn sum(&self, url: &str, now: Instant) -> OwnLoad {
        let mut sum = OwnLoad::default();
        for p in self.peers.values() {
            if let Some((load, at)) = p.loads.get(url) {
                let mut o = *load;
                o.prefill_backlog_ms = (o.prefill_backlog_ms - now.duration_since(*at).as_secs_f64() * 1000.0).max(0.0);
                sum.add(&o);
            }
        }
        sum
    }

    /// Every worker URL some peer books on.
    pub fn urls(&self) -> HashSet<String> {
        self.peers.values().flat_map(|p| p.loads.keys().cloned()).collect()
    }

    /// Whether `replica` is a peer heard from.
    pub fn contains(&self, replica: &str) -> bool {
        self.peers.contains_key(replica)
    }

    /// How many peers.
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// The peers as `GET /cluster` shows them, by name.
    pub fn views(&self, now: Instant) -> Vec<PeerView> {
        let mut v: Vec<PeerView> = self
            .peers
            .iter()
            .map(|(name, p)| PeerView {
                replica: name.clone(),
                admin: p.admin.clone(),
                last_seen_ms: now.duration_since(p.last_seen).as_millis() as u64,
                requests: p.loads.values().map(|(l, _)| u64::from(l.requests)).sum(),
            })
            .collect();
        v.sort_by(|a, b| a.replica.cmp(&b.replica));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::wire::WorkerLoad;

    fn msg(replica: &str, instance: &str, full: bool, loads: &[(&str, u32)]) -> LoadMessage {
        let workers = loads
            .iter()
            .map(|&(url, requests)| WorkerLoad { url: url.into(), load: OwnLoad { requests, prefill_tokens: u64::from(requests) * 100, ..OwnLoad::default() } })
            .collect();
        LoadMessage { replica: replica.into(), instance: instance.into(), full, sent_us: 0, admin: String::new(), workers }
    }

    #[test]
    fn a_workers_load_is_the_sum_over_peers_and_leaves_with_a_silent_peer() {
        let t0 = Instant::now();
        let mut m = Members::default();
        m.apply(msg("a", "1", true, &[("w1", 2), ("w2", 1)]), t0);
        m.apply(msg("b", "1", true, &[("w1", 3)]), t0);
        assert_eq!((m.sum("w1", t0).requests, m.sum("w2", t0).requests, m.sum("w1", t0).prefill_tokens), (5, 1, 500));
        // A delta changes only what it names; an idle entry leaves.
        let changed = m.apply(msg("a", "1", false, &[("w2", 0)]), t0);
        assert_eq!(changed, HashSet::from(["w2".to_string()]));
        assert_eq!((m.sum("w1", t0).requests, m.sum("w2", t0).requests), (5, 0));
        // A full picture replaces the peer's whole; a new process under the name too.
        m.apply(msg("b", "2", false, &[("w2", 4)]), t0);
        assert_eq!((m.sum("w1", t0).requests, m.sum("w2", t0).requests), (2, 4));
        // b falls silent.
        let later = t0 + Duration::from_secs(2);
        m.apply(msg("a", "1", false, &[]), later);
        let (gone, urls) = m.expire(Duration::from_secs(1), later);
        assert_eq!((gone, urls), (1, HashSet::from(["w2".to_string()])));
        assert_eq!((m.sum("w1", later).requests, m.sum("w2", later).requests, m.len()), (2, 0, 1));
    }

    #[test]
    fn a_peers_backlog_runs_down_from_its_arrival() {
        let t0 = Instant::now();
        let mut m = Members::default();
        let mut one = msg("a", "1", true, &[("w", 1)]);
        one.workers[0].load.prefill_backlog_ms = 100.0;
        m.apply(one, t0);
        let b = m.sum("w", t0 + Duration::from_millis(30)).prefill_backlog_ms;
        assert!((b - 70.0).abs() < 1e-6, "{b}");
        assert!(m.sum("w", t0 + Duration::from_secs(1)).prefill_backlog_ms.abs() < 1e-12);
    }
}
