//! The scheduler's side of prefill/decode disaggregation, as vLLM's scheduler drives
//! NixlConnector (`vllm/v1/core/sched/scheduler.py`, and `request_finished`,
//! `get_num_new_matched_tokens` and `update_state_after_alloc` in
//! `vllm/distributed/kv_transfer/kv_connector/v1/nixl/`):
//!
//! - prefill leg: a finished request's blocks are not freed but *held* (they stay referenced,
//!   so they count as used KV) until [`Scheduler::release_held`] (the decode worker pulled
//!   them, or the engine's lease on them ran out);
//! - decode leg: at admission the request looks up its prompt in the local prefix cache, takes
//!   blocks for the whole prompt without caching them, and leaves the queue while the engine
//!   pulls the rest ([`Step::loads`]); [`Scheduler::finish_load`] then marks all but the last
//!   prompt token computed (vLLM recomputes that one to get logits), caches the full blocks
//!   (their `BlockStored` go out as after any computation) and queues the request at the front.

use super::transfer::{Held, HeldKv, LoadOutcome, RemotePrefill};
use super::{FinishReason, KvTransfer, Load, LoadStart, ReqId, Scheduler, Step, TokenOutput};

impl Scheduler {
    /// Admits a decode leg: blocks for its whole prompt (local prefix hits first), and a pull
    /// of the rest in `step`. False (nothing taken) when the blocks do not fit.
    pub(super) fn start_load(&mut self, id: ReqId, step: &mut Step) -> bool {
        let bs = self.cfg.block_size;
        let hits = self.cached_prefix(id);
        let num_tokens = self.requests[&id].tokens.len();
        let external = num_tokens - hits.len() * bs;
        if !self.allocate(id, external, &hits) {
            return false;
        }
        self.counters.prefix_cache_queries += num_tokens as u64;
        self.counters.prefix_cache_hits += (hits.len() * bs) as u64;
        let req = self.requests.get_mut(&id).expect("waiting ids are live");
        let KvTransfer::Pull(remote) = &req.kv else { unreachable!("only pulls are Pending") };
        let needed = num_tokens.div_ceil(bs);
        let blocks = (remote.block_ids.len() >= needed).then(|| remote.block_ids[hits.len()..needed].to_vec());
        step.loads.push(LoadStart { id, remote: remote.clone(), blocks });
        req.load = Load::Loading;
        req.num_external = external;
        self.loading.push(id);
        true
    }

    /// Ends a decode leg's pull. On success all but the last prompt token count as computed
    /// and the full blocks are cached; under `Recompute` the prompt past the local hits is
    /// computed here; either way the request goes to the front of the queue. Under `Fail` it is
    /// removed and its last output (finished with [`FinishReason::Error`]) returned. `None`
    /// also when the request is gone (aborted during the pull).
    pub fn finish_load(&mut self, id: ReqId, outcome: LoadOutcome) -> Option<TokenOutput> {
        let pos = self.loading.iter().position(|&r| r == id)?;
        self.loading.remove(pos);
        if outcome == LoadOutcome::Fail {
            let req = &self.requests[&id];
            let out = TokenOutput {
                id,
                token: 0,
                finish: Some(FinishReason::Error),
                first: true,
                num_cached_tokens: req.num_computed,
                num_prompt_tokens: req.num_prompt,
                num_external_tokens: 0,
            };
            self.abort(id);
            return Some(out);
        }
        let req = self.requests.get_mut(&id).expect("loading ids are live");
        if outcome == LoadOutcome::Loaded {
            // vLLM's _update_waiting_for_remote_kv: a fully loaded prompt still computes its
            // last token, for the logits of the first output.
            let loaded = (req.blocks.len() * self.cfg.block_size).min(req.tokens.len());
            req.num_computed = loaded.min(req.tokens.len() - 1);
        } else {
            req.num_external = 0;
        }
        req.load = Load::None;
        req.num_cached_tokens = Some(req.num_computed);
        let computed = req.num_computed;
        self.cache_full_blocks(id, computed);
        self.waiting.push_front(id);
        None
    }

    /// Keeps a finished prefill leg's blocks for a decode worker.
    pub(super) fn hold(&mut self, id: ReqId) {
        let Some(req) = self.requests.remove(&id) else { return };
        self.running.retain(|&r| r != id);
        let held = Held { num_computed: req.num_computed, num_cached_tokens: req.num_cached_tokens.unwrap_or(0), blocks: req.blocks };
        self.held.insert(id, held);
    }

    /// What a held prefill leg offers a decode worker (`None`: not held).
    pub fn held(&self, id: ReqId) -> Option<HeldKv> {
        self.held.get(&id).map(|h| HeldKv { block_ids: h.blocks.clone(), num_tokens: h.num_computed, num_cached_tokens: h.num_cached_tokens })
    }

    /// Frees a held prefill leg's blocks (last first, as a finished request's); returns how
    /// many, or `None` if it was not held.
    pub fn release_held(&mut self, id: ReqId) -> Option<usize> {
        let h = self.held.remove(&id)?;
        self.pool.free(h.blocks.iter().rev());
        Some(h.blocks.len())
    }

    /// The prefill worker a decode leg still waiting for admission would pull from: if it is
    /// aborted now, vLLM's connector still tells that worker to free the blocks.
    pub fn pending_pull(&self, id: ReqId) -> Option<std::sync::Arc<RemotePrefill>> {
        let req = self.requests.get(&id).filter(|r| r.load == Load::Pending)?;
        match &req.kv {
            KvTransfer::Pull(r) => Some(r.clone()),
            _ => None,
        }
    }

    /// [`Scheduler::pending_pull`] of every waiting request.
    pub fn pending_pulls(&self) -> Vec<std::sync::Arc<RemotePrefill>> {
        self.waiting.iter().filter_map(|&id| self.pending_pull(id)).collect()
    }

    /// Prefill legs holding blocks.
    pub fn num_held(&self) -> usize {
        self.held.len()
    }
}
