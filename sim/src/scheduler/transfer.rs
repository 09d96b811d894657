//! The data of prefill/decode disaggregation the scheduler keeps and hands out: a held prefill
//! leg, where a decode leg's KV lies, what a prefill leg's reply carries, how a pull ended (the
//! scheduling itself: `pd.rs`).

use crate::kv_cache::BlockId;

/// A held prefill leg.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) blocks: Vec<BlockId>,
    pub(super) num_computed: usize,
    pub(super) num_cached_tokens: usize,
}

/// Where a decode leg's prompt KV lies: the prefill worker's reply, as the decode leg carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePrefill {
    /// `remote_engine_id`.
    pub engine_id: String,
    /// `remote_request_id`: the prefill worker's internal id of the held request.
    pub request_id: String,
    /// `remote_host`.
    pub host: String,
    /// `remote_port`.
    pub port: u16,
    /// `remote_block_ids[0]`: the held blocks (one KV cache group).
    pub block_ids: Vec<BlockId>,
}

/// What a prefill leg's reply tells the decode worker, once its blocks are held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldKv {
    /// The held blocks, in order (`remote_block_ids`, one KV cache group).
    pub block_ids: Vec<BlockId>,
    /// Tokens whose KV they hold (`remote_num_tokens`: vLLM's `num_computed_tokens`).
    pub num_tokens: usize,
    /// Prompt tokens that were prefix-cache hits here (`remote_prefill_cached_tokens`).
    pub num_cached_tokens: usize,
}

/// How a decode leg's pull ended, the failure policy applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    /// The KV arrived.
    Loaded,
    /// The pull failed; the prompt is computed here (`kv_load_failure_policy: "recompute"`).
    Recompute,
    /// The pull failed; the request fails (`kv_load_failure_policy: "fail"`).
    Fail,
}
