//! Prompt chains booked in flight, shared between replicas (docs/replicas.md, "Prefixes in
//! flight"): each ledger hands the chains it books and releases to a [`Sink`], which queues
//! them for the cluster task without waiting; the task publishes them in batches, and applies
//! the peers' to each model's ledger ([`Held`]), so that a prefix a request of any replica is
//! computing counts as cached for the requests sharing it, as it does within one replica.

use super::wire::ChainOp;
use kvgate_filters::ledger::Ledger;
use kvgate_filters::ledger::peers::ChainSink;
use kvgate_kv::hash::BlockHash;
use kvgate_kv::index::WorkerId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Bookings and releases waiting to be shared; past this many, new ones are dropped and
/// counted (a release dropped leaves the chain with the peers until it ages out).
pub const OUTBOX: usize = 16_384;

/// A booking or release waiting to be shared.
#[derive(Debug)]
pub struct Op {
    /// The booking's key.
    pub key: u64,
    /// The model's name.
    pub model: Arc<str>,
    /// The worker's URL.
    pub worker: Arc<str>,
    /// The chain, when booked.
    pub chain: Option<Arc<[BlockHash]>>,
}

impl Op {
    /// As it goes on the wire.
    pub fn wire(&self) -> ChainOp {
        ChainOp { key: self.key, model: self.model.to_string(), worker: self.worker.to_string(), chain: self.chain.as_ref().map(|c| c.to_vec()) }
    }
}

/// One model's ledger's [`ChainSink`]: its workers' URLs, and the outbox.
pub struct Sink {
    /// The model's name.
    pub model: Arc<str>,
    /// Each worker's URL, by its index in the model.
    pub workers: Vec<Arc<str>>,
    /// The outbox.
    pub outbox: mpsc::Sender<Op>,
    /// Counts what a full outbox drops.
    pub dropped: prometheus::IntCounter,
}

impl Sink {
    fn send(&self, key: u64, w: WorkerId, chain: Option<&Arc<[BlockHash]>>) {
        let Some(worker) = self.workers.get(usize::from(w)) else { return };
        let op = Op { key, model: self.model.clone(), worker: worker.clone(), chain: chain.cloned() };
        if self.outbox.try_send(op).is_err() {
            self.dropped.inc();
        }
    }
}

impl ChainSink for Sink {
    fn booked(&self, key: u64, w: WorkerId, chain: &Arc<[BlockHash]>) {
        self.send(key, w, Some(chain));
    }

    fn released(&self, key: u64, w: WorkerId) {
        self.send(key, w, None);
    }
}

/// A peer's chain as applied: where, and since when.
struct Applied {
    ledger: Arc<Ledger>,
    worker: WorkerId,
    chain: Arc<[BlockHash]>,
    since: Instant,
}

/// The peers' chains this replica applied, by replica and key. Kept by the cluster's shared
/// state, so that a restarted cluster task still releases what it applied.
#[derive(Default)]
pub struct Held {
    chains: HashMap<(String, u64), Applied>,
    /// Each replica's process, and when its chains were first heard of.
    first: HashMap<String, (String, Instant)>,
}

impl Held {
    /// Applies `op` from `replica`: a booking to `ledger`'s worker `worker`, or the release of
    /// one applied before.
    pub fn apply(&mut self, (replica, instance): (&str, &str), op: ChainOp, target: Option<(Arc<Ledger>, WorkerId)>) {
        let known = self.first.get(replica).map(|(i, _)| i.as_str());
        if known.is_some_and(|i| i != instance) {
            // The replica restarted: what its previous process booked ended with it.
            self.forget(replica);
        }
        self.first.entry(replica.to_string()).or_insert_with(|| (instance.to_string(), Instant::now()));
        match op.chain {
            Some(chain) => {
                let Some((ledger, worker)) = target else { return };
                let chain: Arc<[BlockHash]> = chain.into();
                ledger.add_peer_chain(worker, &chain);
                if let Some(old) = self.chains.insert((replica.to_string(), op.key), Applied { ledger, worker, chain, since: Instant::now() }) {
                    old.ledger.remove_peer_chain(old.worker, &old.chain);
                }
            }
            None => {
                if let Some(a) = self.chains.remove(&(replica.to_string(), op.key)) {
                    a.ledger.remove_peer_chain(a.worker, &a.chain);
                }
            }
        }
    }

    /// Releases the chains of replicas `alive` no longer names (heard of for longer than
    /// `grace`, so a replica whose chains came before its first load message is not taken
    /// for gone), and those held longer than `max_age` (a release that never came).
    pub fn sweep(&mut self, alive: &dyn Fn(&str) -> bool, grace: Duration, max_age: Duration) {
        let now = Instant::now();
        let gone: Vec<String> = self.first.iter().filter(|(r, (_, t))| !alive(r) && now.duration_since(*t) > grace).map(|(r, _)| r.clone()).collect();
        for r in &gone {
            self.first.remove(r);
        }
        self.chains.retain(|(r, _), a| {
            let keep = !gone.contains(r) && now.duration_since(a.since) <= max_age;
            if !keep {
                a.ledger.remove_peer_chain(a.worker, &a.chain);
            }
            keep
        });
    }

    /// Releases every chain of `replica`.
    fn forget(&mut self, replica: &str) {
        self.first.remove(replica);
        self.chains.retain(|(r, _), a| {
            let keep = r != replica;
            if !keep {
                a.ledger.remove_peer_chain(a.worker, &a.chain);
            }
            keep
        });
    }

    /// How many chains are held.
    pub fn len(&self) -> usize {
        self.chains.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_filters::ledger::Tracking;

    #[test]
    fn a_peer_restarted_under_its_name_takes_its_old_chains_with_it() {
        let ledger = Ledger::new(2, Tracking::default());
        let mut held = Held::default();
        let add = |key| ChainOp { key, model: "m".into(), worker: "w".into(), chain: Some(vec![1, 2, 3]) };
        held.apply(("a", "1"), add(1), Some((ledger.clone(), 1)));
        assert_eq!(ledger.overlap(&[1, 2, 3]).get(1), 3);
        held.apply(("a", "2"), add(7), Some((ledger.clone(), 0)));
        assert_eq!(ledger.overlap(&[1, 2, 3]).get(1), 0, "the old process's chain went with it");
        assert_eq!((ledger.overlap(&[1, 2, 3]).get(0), held.len()), (3, 1));
        held.apply(("a", "2"), ChainOp { chain: None, ..add(7) }, None);
        assert!(held.is_empty());
        assert_eq!(ledger.overlap(&[1, 2, 3]).get(0), 0, "released");
    }
}
