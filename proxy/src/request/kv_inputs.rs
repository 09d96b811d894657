//! The KV routing inputs of one request, computed once before its first placement: the prompt's
//! tokens (as the worker will see them), their chained block hashes (keyed by the body's
//! `cache_salt` and the LoRA adapter it names, as vLLM keys them), and per worker the leading blocks already cached there and
//! already booked there by requests in flight.

use super::RequestState;
use crate::endpoint::Endpoint;
use crate::gateway::Gateway;
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

/// Fills `req.kv` when the model routes on the KV cache. A Messages or Responses prompt that
/// cannot be rendered exactly is placed by load alone (no prefix), and counted
/// (`kvgate_render_fallback_total{endpoint,reason}`).
pub async fn prepare(gw: &Gateway, req: &mut RequestState) {
    let (Some(kv), Some(body)) = (req.model.kv.clone(), req.parsed.take()) else { return };
    let salt = salt(&body.fields);
    let tokens = match req.endpoint {
        Endpoint::Messages | Endpoint::Responses => super::prompt::dialect_tokens(body.fields, req.endpoint, &kv).await.unwrap_or_else(|reason| {
            gw.metrics.render_fallback.with_label_values(&[req.endpoint.label(), reason]).inc();
            Vec::new()
        }),
        ep => super::prompt::tokens(body, ep == Endpoint::Chat, kv.tokenizer.as_ref(), kv.max_tokens()).await.unwrap_or_default(),
    };
    req.kv = Some(inputs(req, &kv, &tokens, salt));
}

/// The digest of a body's `cache_salt`: vLLM hashes a non-empty string salt into the first
/// block (and refuses any other value, so routing need not care which worker gets it).
fn salt(fields: &serde_json::Value) -> Option<u64> {
    fields.get("cache_salt").and_then(serde_json::Value::as_str).filter(|s| !s.is_empty()).map(kvgate_kv::hash::salt_digest)
}

/// The inputs for a prompt whose tokens are known (a continuation's: prompt + generated ids),
/// salted as the request's first inputs were.
pub fn from_tokens(req: &RequestState, kv: &KvRouting, tokens: &[u32]) -> KvInputs {
    inputs(req, kv, tokens, req.kv.as_ref().and_then(|k| k.salt))
}

fn inputs(req: &RequestState, kv: &KvRouting, tokens: &[u32], salt: Option<u64>) -> KvInputs {
    let t0 = Instant::now();
    let adapter = crate::fleet::Fleet::adapter(&req.model, req.view.model.as_deref());
    let chain = kv.chain_for(tokens, salt, adapter);
    // The blocks cost at weight 0 is pure load balancing: the cache is not consulted.
    let cached = if req.model.cfg.routing.uses_cache() { kv.cached(&chain).to_dense(kv.rank_count()) } else { vec![0; kv.rank_count()] };
    let booked = req.model.ledger.overlap(&chain).to_dense(req.model.workers.len());
    KvInputs { tokens: tokens.len(), chain, cached, booked, lookup_time: t0.elapsed(), salt }
}
