//! What replicas say to each other, and on which subjects: JSON messages on core NATS
//! subjects under `kvgate.<deployment>.` (docs/replicas.md, "On the wire").

use kvgate_filters::ledger::peers::OwnLoad;
use serde::{Deserialize, Serialize};

/// The subjects and buckets of one deployment.
#[derive(Debug, Clone)]
pub struct Subjects {
    /// Every replica's own bookings ([`LoadMessage`]).
    pub load: String,
    /// A replica that (re)joins asks its peers to publish all their bookings at once.
    pub hello: String,
    /// Admin requests forwarded to the replica that holds the request ([`Ask`]).
    pub ask: String,
    /// Approximate mode's routing decisions ([`Decisions`]).
    pub decisions: String,
    /// The prompt chains each replica books and releases ([`Chains`]).
    pub chains: String,
    /// Each replica's tenants' usage (`super::tenants::TenantsMessage`).
    pub tenants: String,
    /// The key-value bucket of stored responses' workers.
    pub affinity_bucket: String,
    /// The key-value bucket holding the leader's lease.
    pub lease_bucket: String,
}

impl Subjects {
    /// The subjects of deployment `d` (a validated name: letters, digits, '-', '_').
    pub fn of(d: &str) -> Self {
        Self {
            load: format!("kvgate.{d}.load"),
            hello: format!("kvgate.{d}.hello"),
            ask: format!("kvgate.{d}.ask"),
            decisions: format!("kvgate.{d}.decisions"),
            chains: format!("kvgate.{d}.chains"),
            tenants: format!("kvgate.{d}.tenants"),
            affinity_bucket: format!("kvgate_{d}_responses"),
            lease_bucket: format!("kvgate_{d}_leader"),
        }
    }
}

/// One replica's own bookings, on the workers whose figures changed (`full`: on every worker
/// it books on; those absent are idle). Sent when they change and, whole, every heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LoadMessage {
    /// The sender's replica name.
    pub replica: String,
    /// The sender's process (fresh at every start): a replica restarted under the same name
    /// replaces what its previous process booked.
    pub instance: String,
    /// Every worker it books on, not only those that changed.
    pub full: bool,
    /// When it was sent, µs since the Unix epoch (the lag metric).
    pub sent_us: u64,
    /// Its admin listener, for `GET /cluster`.
    #[serde(default)]
    pub admin: String,
    /// Per worker, by URL.
    pub workers: Vec<WorkerLoad>,
}

/// What one replica booked on the worker at `url`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WorkerLoad {
    /// The worker's URL as configured (`http://host:port`).
    pub url: String,
    /// What the sender booked there.
    #[serde(flatten)]
    pub load: OwnLoad,
}

/// Approximate mode's routing decisions of one replica, as they were made: its peers record
/// them in their own predicted caches.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Decisions {
    /// The sender's replica name.
    pub replica: String,
    /// The decisions, oldest first.
    pub decisions: Vec<Decision>,
}

/// One routing decision: `worker` of `model` took on a prompt of block hashes `chain`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Decision {
    /// The model's name.
    pub model: String,
    /// The worker's URL.
    pub worker: String,
    /// The prompt's chained block hashes.
    pub chain: Vec<u64>,
}

/// Prompt chains one replica booked on workers, and released, in the order it did: its peers
/// count a prefix a request in flight is computing as cached for the requests sharing it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Chains {
    /// The sender's replica name.
    pub replica: String,
    /// The sender's process: a replica restarted under the same name books afresh.
    #[serde(default)]
    pub instance: String,
    /// Bookings and releases, oldest first.
    pub ops: Vec<ChainOp>,
}

/// A chain booked (`chain` given) or released (`chain` absent) on `worker` of `model`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChainOp {
    /// The booking's key, unique in the sender's process.
    pub key: u64,
    /// The model's name.
    pub model: String,
    /// The worker's URL.
    pub worker: String,
    /// The prompt's chained block hashes, when booked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain: Option<Vec<u64>>,
}

/// An admin request asked of every peer: the one holding the request answers it, the others
/// answer 404.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Ask {
    /// The asking replica (it ignores its own ask).
    pub from: String,
    /// `request` (`GET /requests/{id}`) or `migrate` (`POST /migrate`).
    pub what: String,
    /// The request's id.
    pub id: String,
    /// The admin request's body (`migrate`'s).
    #[serde(default)]
    pub body: String,
}

/// A peer's answer to an [`Ask`]: the admin answer it would give itself.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// The answer's JSON body.
    pub body: String,
    /// Who answered.
    pub replica: String,
}

/// Microseconds since the Unix epoch, now.
pub fn unix_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_load_message_round_trips_and_small_drifts_are_not_news() {
        let l = OwnLoad {
            requests: 3,
            prefilling: 1,
            prefill_tokens: 900,
            active_blocks: 12,
            expected_blocks: 20,
            decode_sensitivity: 0.25,
            prefill_backlog_ms: 40.0,
            prefill_load: 0.5,
        };
        let m = LoadMessage {
            replica: "a".into(),
            instance: "i".into(),
            full: true,
            sent_us: 7,
            admin: "127.0.0.1:1".into(),
            workers: vec![WorkerLoad { url: "http://w:1".into(), load: l }],
        };
        let back: LoadMessage = serde_json::from_slice(&serde_json::to_vec(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        assert!(!l.differs(&OwnLoad { prefill_backlog_ms: 10.0, prefill_load: 0.505, ..l }), "the backlog runs down by itself");
        assert!(l.differs(&OwnLoad { requests: 4, ..l }));
        assert_eq!(Subjects::of("prod").load, "kvgate.prod.load");
    }
}
