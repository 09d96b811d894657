//! Concurrent requests per client (`per_client`): a client, known by its address or by a
//! header (an API key), may have at most `max_concurrent` inference requests in the gateway at
//! once; one more is answered 429 with `Retry-After` before its body is read
//! (`kvgate_client_limited_total`). Off by default: behind a load balancer every client
//! shares its address, and only the operator knows which header names a client.
//!
//! Counts live in sharded maps, an entry only while its client has a request in flight, so
//! memory is bounded by the requests in flight, not by the clients ever seen. Header values are
//! hashed with a per-process random key and never kept or logged.

use crate::config::PerClient;
use crate::downstream::conn::ClientConn;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};

/// Shards of the counts: requests of different clients rarely meet on one lock.
const SHARDS: usize = 16;

/// The requests in flight per client.
#[derive(Debug, Default)]
pub struct ClientLimits {
    shards: [Mutex<HashMap<u64, u32>>; SHARDS],
    keys: RandomState,
}

/// The client has as many requests in flight as `per_client.max_concurrent` (the value held)
/// allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverLimit(pub u32);

/// One request's place in its client's count, given back on drop.
#[derive(Debug)]
pub struct ClientSlot<'a> {
    limits: &'a ClientLimits,
    key: u64,
}

impl ClientLimits {
    /// A place for one more request of `session`'s client under `cfg` (`None` when the limit
    /// is off), or [`OverLimit`] when the client has `max_concurrent` in flight already.
    pub fn acquire(&self, session: &ClientConn, cfg: &PerClient) -> Result<Option<ClientSlot<'_>>, OverLimit> {
        if cfg.max_concurrent == 0 {
            return Ok(None);
        }
        let key = self.key(session, cfg);
        let mut shard = self.shard(key).lock();
        let n = shard.entry(key).or_insert(0);
        if *n >= cfg.max_concurrent {
            return Err(OverLimit(cfg.max_concurrent));
        }
        *n += 1;
        Ok(Some(ClientSlot { limits: self, key }))
    }

    /// Clients with a request in flight now.
    pub fn clients(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    fn key(&self, session: &ClientConn, cfg: &PerClient) -> u64 {
        match cfg.header.as_deref().and_then(|name| session.req().header(name)).filter(|v| !v.is_empty()) {
            // Tagged apart from addresses, so no header value can share an address's count.
            Some(v) => self.keys.hash_one((1u8, v)),
            None => self.keys.hash_one((0u8, session.peer_ip())),
        }
    }

    #[allow(clippy::cast_possible_truncation, reason = "the key is a hash: any of its bits pick a shard as well")]
    fn shard(&self, key: u64) -> &Mutex<HashMap<u64, u32>> {
        &self.shards[(key as usize) % SHARDS]
    }
}

impl Drop for ClientSlot<'_> {
    fn drop(&mut self) {
        let mut shard = self.limits.shard(self.key).lock();
        if let Some(n) = shard.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                shard.remove(&self.key);
            }
        }
    }
}
