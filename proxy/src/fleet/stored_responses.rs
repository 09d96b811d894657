//! Where each stored response lives. With vLLM's response store on
//! (`VLLM_ENABLE_RESPONSES_API_STORE=1`), a response is kept by the worker that made it, and
//! only that worker can continue it (`previous_response_id`), return it
//! (`GET /v1/responses/{id}`) or cancel it. The gateway remembers which worker made each
//! response it relayed, by the worker's URL (so the memory is carried across reloads, as the
//! workers are), up to a bound, forgetting the oldest first.
//!
//! Response ids are the clients' (sent as `request_id`) or the gateway's own, so the map is
//! sharded by the id's hash with a seeded hasher: no client can fill one shard.

use crate::config::UpstreamUrl;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

/// Shards of the map (each its own lock).
const SHARDS: usize = 16;

/// Response id → the URL of the worker that stored it, bounded.
pub struct StoredResponses {
    shards: [Mutex<Shard>; SHARDS],
    hasher: foldhash::quality::RandomState,
    per_shard: usize,
}

/// One shard: the map and the order ids came in, oldest first.
#[derive(Default)]
struct Shard {
    home: HashMap<Box<str>, UpstreamUrl, foldhash::quality::RandomState>,
    order: VecDeque<Box<str>>,
}

impl StoredResponses {
    /// A map keeping up to about `capacity` ids (at least one per shard).
    pub fn new(capacity: usize) -> Self {
        Self { shards: std::array::from_fn(|_| Mutex::default()), hasher: Default::default(), per_shard: capacity.div_ceil(SHARDS).max(1) }
    }

    fn shard(&self, id: &str) -> &Mutex<Shard> {
        &self.shards[self.hasher.hash_one(id) as usize % SHARDS]
    }

    /// Remembers that `worker` stored response `id`, forgetting the oldest id of its shard when
    /// the shard is full.
    pub fn remember(&self, id: &str, worker: &UpstreamUrl) {
        let mut s = self.shard(id).lock();
        if s.home.insert(id.into(), worker.clone()).is_none() {
            s.order.push_back(id.into());
        }
        while s.order.len() > self.per_shard {
            if let Some(old) = s.order.pop_front() {
                s.home.remove(&old);
            }
        }
    }

    /// The worker that stored `id`, if the gateway relayed it and still remembers it.
    pub fn home_of(&self, id: &str) -> Option<UpstreamUrl> {
        self.shard(id).lock().home.get(id).cloned()
    }

    /// Ids remembered now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().home.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_find_their_worker_and_the_oldest_are_forgotten() {
        let a = UpstreamUrl::parse("http://a:1").unwrap();
        let b = UpstreamUrl::parse("http://b:1").unwrap();
        let m = StoredResponses::new(SHARDS * 2);
        m.remember("resp_1", &a);
        m.remember("resp_2", &b);
        assert_eq!(m.home_of("resp_1"), Some(a.clone()));
        assert_eq!(m.home_of("resp_2"), Some(b.clone()));
        assert_eq!(m.home_of("resp_3"), None);
        m.remember("resp_1", &b);
        assert_eq!(m.home_of("resp_1"), Some(b.clone()), "a later answer under the same id wins");
        for i in 0..10_000 {
            m.remember(&format!("resp_x{i}"), &a);
        }
        assert!(m.len() <= SHARDS * 2, "bounded: {}", m.len());
        assert_eq!(m.home_of("resp_x9999"), Some(a), "the newest is kept");
    }
}
