//! The KV routing inputs of one request, computed once before its first placement: the prompt's
//! tokens (as the worker will see them), their chained block hashes (keyed by the body's
//! `cache_salt` and the LoRA adapter it names, as vLLM keys them), and per worker the leading blocks already cached there and
//! already booked there by requests in flight.

use crate::fleet::Model;
use crate::kv_routing::KvRouting;
use kvgate_kv::hash::BlockHash;
use std::time::{Duration, Instant};

/// What kv routing knows about a request's prompt.
#[derive(Debug, Clone, Default)]
pub struct KvInputs {
    /// Prompt tokens routing counted (up to the routing prefix).
    pub tokens: usize,
    /// Chained block hashes of the prompt's leading full blocks.
    pub chain: Vec<BlockHash>,
    /// Cached leading blocks per DP rank (dense over the index's rank ids).
    pub cached: Vec<u32>,
    /// Leading blocks already booked by requests in flight, per worker (dense).
    pub booked: Vec<u32>,
    /// Time spent hashing and looking up (part of the decision time).
    pub lookup_time: Duration,
    /// The digest of the body's `cache_salt`, mixed into the first block as vLLM mixes it; kept
    /// for a continuation's inputs (its body carries the same salt).
    pub salt: Option<u64>,
}

impl KvInputs {
    /// The inputs for a prompt of `tokens` on `model` (the LoRA `adapter` it names keys its
    /// blocks, as vLLM keys them), salted by `salt` (see [`KvInputs::salt_of`]).
    pub fn of(model: &Model, kv: &KvRouting, adapter: Option<&str>, tokens: &[u32], salt: Option<u64>) -> Self {
        let t0 = Instant::now();
        let chain = kv.chain_for(tokens, salt, adapter);
        let (cached, booked) = Self::overlaps(model, kv, &chain);
        Self { tokens: tokens.len(), chain, cached, booked, lookup_time: t0.elapsed(), salt }
    }

    /// The same prompt's inputs on a rebuilt `model` (a reload since the request arrived)
    /// whose blocks are hashed as before: the chain carries over and the overlaps are looked
    /// up again there.
    pub fn rebased(self, model: &Model, kv: &KvRouting) -> Self {
        let (cached, booked) = Self::overlaps(model, kv, &self.chain);
        Self { cached, booked, ..self }
    }

    /// Per rank, the leading blocks of `chain` cached; per worker, those booked.
    fn overlaps(model: &Model, kv: &KvRouting, chain: &[BlockHash]) -> (Vec<u32>, Vec<u32>) {
        // The blocks cost at weight 0 is pure load balancing: the cache is not consulted.
        let cached = if model.cfg.routing.uses_cache() { kv.cached(chain).to_dense(kv.rank_count()) } else { vec![0; kv.rank_count()] };
        (cached, model.ledger.overlap(chain).to_dense(model.workers.len()))
    }

    /// The digest of a body's `cache_salt`: vLLM hashes a non-empty string salt into the first
    /// block (and refuses any other value, so routing need not care which worker gets it).
    pub fn salt_of(fields: &serde_json::Value) -> Option<u64> {
        fields.get("cache_salt").and_then(serde_json::Value::as_str).filter(|s| !s.is_empty()).map(kvgate_kv::hash::salt_digest)
    }
}

/// A prompt's token ids (as the worker will see them, or a fallback's pseudo-tokens) and its
/// `cache_salt`'s digest: what the KV inputs are made of.
pub struct PromptTokens {
    /// The ids.
    pub tokens: Vec<u32>,
    /// The salt's digest, when the request has one.
    pub salt: Option<u64>,
    /// Whether the ids are the whole prompt, as the worker counts it (not cut at routing's
    /// limit, and not the first of a batch of prompts).
    pub whole: bool,
}
