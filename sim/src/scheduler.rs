//! The engine core: vLLM v1's scheduler over the paged KV cache, without the GPU.
//!
//! One call to [`Scheduler::schedule`] plans a step exactly as vLLM's `Scheduler.schedule` does:
//! - a token budget of `max_num_batched_tokens` per step;
//! - running requests first, in order, each taking the tokens it has not computed yet (one for a
//!   decode, the next chunk of a long prompt: chunked prefill), capped by the remaining budget;
//! - when a running request cannot get its blocks, the *last* running request is preempted
//!   (recompute: its blocks are freed and it goes back to the front of the waiting queue);
//! - if nothing was preempted, waiting requests are admitted in order while there are seats
//!   (`max_num_seqs`) and budget, after looking up their prompt's full blocks in the prefix
//!   cache (at most `num_tokens - 1` tokens can hit, so the last token is always computed); a
//!   request of a LoRA adapter that would make more than `max_loras` adapters run is skipped
//!   (it keeps its place) and the ones behind it are tried.
//!
//! [`Scheduler::update`] then applies the step's outcome: computed tokens advance, requests
//! whose whole context is computed get a new token from the [`Sampler`], finished ones free
//! their blocks last-block-first. KV events accumulate in the block pool for the caller to
//! publish once per step, as vLLM publishes one batch per step.
//!
//! Paused ([`PauseState`], vLLM's `/pause` and `/sleep`), waiting requests are not admitted
//! (`PausedNew`) or nothing is scheduled at all (`PausedAll`).
//!
//! Prefill/decode disaggregation ([`KvTransfer`], `pd.rs`): a prefill leg's blocks are held
//! after it finishes, until a decode worker pulls them or the lease ends; a decode leg is given
//! blocks for its whole prompt at admission, waits outside the queue while the engine pulls the
//! prompt's KV, then runs with all but the last prompt token computed, as vLLM's scheduler does
//! with an async KV load.
//!
//! Time, channels and HTTP are not this module's business (see `engine`).

use crate::block_hash::{BlockHash, ExtraKey, hash_block_with};
use crate::events::{BlockKeys, KvEvent};
use crate::kv_cache::{BlockId, BlockPool};
use crate::lora::LoraRequest;
use crate::sampler::{ContextHash, Sampler};
use crate::timing::StepShape;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// Engine-internal request id.
pub type ReqId = u64;

/// Limits of one engine, as vLLM's scheduler and cache configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool, including the reserved null block.
    pub num_gpu_blocks: usize,
    /// Maximum running sequences.
    pub max_num_seqs: usize,
    /// Token budget per step.
    pub max_num_batched_tokens: usize,
    /// Longest context a request may reach.
    pub max_model_len: usize,
    /// Prefix caching on/off.
    pub enable_prefix_caching: bool,
    /// Parent of every prompt's first block (vLLM's `NONE_HASH`, from `PYTHONHASHSEED`).
    pub hash_root: BlockHash,
    /// Most distinct LoRA adapters in the running batch (`--max-loras`): a waiting request
    /// of another adapter is skipped, as vLLM skips it, while that many run.
    pub max_loras: usize,
}

/// A request as handed to the engine.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// Id chosen by the caller, unique per engine.
    pub id: ReqId,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Maximum tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// EOS is suppressed until this many tokens were generated.
    pub min_tokens: usize,
    /// Never stop on EOS.
    pub ignore_eos: bool,
    /// Seed of the context hash (the simulator seed).
    pub seed: u64,
    /// The request's `cache_salt` (non-empty): hashed into its first block, as vLLM does, so
    /// it shares cached blocks only with requests of the same salt.
    pub cache_salt: Option<String>,
    /// The LoRA adapter it runs with: its blocks are hashed in the adapter's own space.
    pub lora: Option<Arc<LoraRequest>>,
    /// Its part in prefill/decode disaggregation (none: aggregated serving).
    pub kv: KvTransfer,
}

/// What the KV connector does with a request: vLLM's `kv_transfer_params`, as the engine
/// understood them.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum KvTransfer {
    /// Aggregated serving.
    #[default]
    None,
    /// A prefill leg (`do_remote_decode`): when it finishes, its blocks are held for a decode
    /// worker instead of being freed.
    Hold,
    /// A decode leg (`do_remote_prefill`): its prompt's KV is pulled from a prefill worker.
    Pull(Arc<RemotePrefill>),
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS was sampled.
    Stop,
    /// `max_tokens` or `max_model_len` was reached.
    Length,
    /// The engine aborted it (`/pause` or `/sleep` in `abort` mode); its last output carries
    /// no token.
    Abort,
    /// It failed in the engine (a KV pull failed under `kv_load_failure_policy: "fail"`); its
    /// last output carries no token.
    Error,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// vLLM's scheduler pause states (`/pause`, `/sleep`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PauseState {
    /// Scheduling as usual.
    #[default]
    Unpaused,
    /// Running requests go on; waiting ones (new, or preempted) are not admitted.
    PausedNew,
    /// Nothing is scheduled: running requests are frozen.
    PausedAll,
}

/// One generated token, or the end of an aborted request (no token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenOutput {
    /// The request it belongs to.
    pub id: ReqId,
    /// The token id (EOS included when the request stopped on it).
    pub token: u32,
    /// Set on the request's last token.
    pub finish: Option<FinishReason>,
    /// True for the request's first generated token.
    pub first: bool,
    /// Prompt tokens served from the prefix cache at first scheduling.
    pub num_cached_tokens: usize,
    /// Prompt length.
    pub num_prompt_tokens: usize,
    /// Prompt tokens whose KV was pulled from a prefill worker.
    pub num_external_tokens: usize,
}

impl TokenOutput {
    /// The generated token ids it carries: one, or none for an abort or an error.
    pub fn ids(&self) -> &[u32] {
        if matches!(self.finish, Some(FinishReason::Abort | FinishReason::Error)) { &[] } else { std::slice::from_ref(&self.token) }
    }
}

/// A planned step.
#[derive(Debug, Default)]
pub struct Step {
    /// (request, tokens computed for it in this step).
    pub scheduled: Vec<(ReqId, usize)>,
    /// What the step contains, for the timing model.
    pub shape: StepShape,
    /// Requests preempted while planning.
    pub preempted: Vec<ReqId>,
    /// KV pulls to start: decode legs admitted in this step, waiting for their prompt's KV.
    pub loads: Vec<LoadStart>,
}

/// A decode leg's pull, for the engine to run.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadStart {
    /// The request waiting for it.
    pub id: ReqId,
    /// Where the KV lies.
    pub remote: Arc<RemotePrefill>,
    /// The prefill worker's blocks to read (those not already in the local prefix cache), or
    /// `None` when its `remote_block_ids` do not cover the prompt.
    pub blocks: Option<Vec<BlockId>>,
}

/// Counters the caller turns into `vllm:*` metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerCounters {
    /// `vllm:prefix_cache_queries` (tokens looked up).
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits` (tokens found).
    pub prefix_cache_hits: u64,
    /// `vllm:num_preemptions`.
    pub preemptions: u64,
}

#[derive(Debug)]
struct Request {
    tokens: Vec<u32>,
    num_prompt: usize,
    max_tokens: usize,
    min_tokens: usize,
    ignore_eos: bool,
    ctx: ContextHash,
    num_computed: usize,
    blocks: Vec<BlockId>,
    block_hashes: Vec<BlockHash>,
    /// How many of `blocks` are registered in the prefix cache.
    num_cached_blocks: usize,
    num_cached_tokens: Option<usize>,
    cache_salt: Option<String>,
    lora: Option<Arc<LoraRequest>>,
    kv: KvTransfer,
    load: Load,
    /// Prompt tokens pulled from a prefill worker.
    num_external: usize,
}

/// Where a decode leg's KV pull stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    /// None to do (or done, or given up).
    None,
    /// Admitted when it leaves the queue: blocks first, then the pull.
    Pending,
    /// Holding its blocks, out of the queue, until the engine reports the pull.
    Loading,
}

impl Request {
    fn num_output(&self) -> usize {
        self.tokens.len() - self.num_prompt
    }

    /// vLLM's extra hash keys of the request's block `index`, in its order: the adapter on
    /// every block, the salt on block 0.
    fn extra_keys(&self, index: usize) -> Vec<ExtraKey<'_>> {
        let lora = self.lora.as_deref().map(|l| ExtraKey::Lora { name: &l.name, path: &l.path });
        let salt = self.cache_salt.as_deref().filter(|_| index == 0).map(ExtraKey::CacheSalt);
        lora.into_iter().chain(salt).collect()
    }

    fn lora_id(&self) -> Option<u32> {
        self.lora.as_ref().map(|l| l.id)
    }

    /// Extends `block_hashes` to cover the first `n` full blocks.
    fn ensure_hashes(&mut self, n: usize, bs: usize, root: &BlockHash) {
        while self.block_hashes.len() < n {
            let i = self.block_hashes.len();
            let h = hash_block_with(self.block_hashes.last().unwrap_or(root), &self.tokens[i * bs..(i + 1) * bs], &self.extra_keys(i));
            self.block_hashes.push(h);
        }
    }

    /// What the `BlockStored` of blocks `from..to` says about their extra keys.
    fn block_keys(&self, from: usize, to: usize) -> BlockKeys {
        let extra_keys: Vec<Option<Vec<String>>> = (from..to)
            .map(|i| {
                let keys = self.extra_keys(i);
                (!keys.is_empty()).then(|| keys.iter().map(|k| k.event_value().to_owned()).collect())
            })
            .collect();
        BlockKeys {
            lora: self.lora.as_ref().map(|l| (l.id, l.name.clone())),
            extra_keys: if extra_keys.iter().all(Option::is_none) { Vec::new() } else { extra_keys },
        }
    }
}

/// The scheduler and its block pool.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    sampler: Sampler,
    requests: HashMap<ReqId, Request>,
    waiting: VecDeque<ReqId>,
    running: Vec<ReqId>,
    counters: SchedulerCounters,
    pause: PauseState,
    /// Decode legs waiting for their KV pull (vLLM's `WAITING_FOR_REMOTE_KVS`).
    loading: Vec<ReqId>,
    /// Finished prefill legs whose blocks wait for a decode worker.
    held: HashMap<ReqId, transfer::Held>,
}

mod pd;
mod transfer;
pub use transfer::{HeldKv, LoadOutcome, RemotePrefill};

fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl Scheduler {
    /// An idle engine with an empty cache.
    pub fn new(cfg: SchedulerConfig, sampler: Sampler) -> Self {
        Self {
            pool: BlockPool::new(cfg.num_gpu_blocks, cfg.block_size, cfg.enable_prefix_caching),
            cfg,
            sampler,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            counters: SchedulerCounters::default(),
            pause: PauseState::Unpaused,
            loading: Vec::new(),
            held: HashMap::new(),
        }
    }

    /// Queues a request at the back of the waiting queue.
    pub fn add(&mut self, r: NewRequest) {
        debug_assert!(!r.prompt.is_empty() && r.max_tokens >= 1);
        let bs = self.cfg.block_size;
        let ctx = ContextHash::new(r.seed).extend(&r.prompt);
        let mut req = Request {
            num_prompt: r.prompt.len(),
            tokens: r.prompt,
            max_tokens: r.max_tokens,
            min_tokens: r.min_tokens,
            ignore_eos: r.ignore_eos,
            ctx,
            num_computed: 0,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            num_cached_blocks: 0,
            num_cached_tokens: None,
            cache_salt: r.cache_salt,
            lora: r.lora,
            load: if matches!(r.kv, KvTransfer::Pull(_)) { Load::Pending } else { Load::None },
            kv: r.kv,
            num_external: 0,
        };
        if self.cfg.enable_prefix_caching {
            req.ensure_hashes(req.tokens.len() / bs, bs, &self.cfg.hash_root);
        }
        self.requests.insert(r.id, req);
        self.waiting.push_back(r.id);
    }

    /// Removes a request wherever it is, freeing its blocks. Returns false if unknown.
    pub fn abort(&mut self, id: ReqId) -> bool {
        let Some(req) = self.requests.remove(&id) else { return false };
        self.pool.free(req.blocks.iter().rev());
        if let Some(pos) = self.running.iter().position(|&r| r == id) {
            self.running.remove(pos);
        } else if let Some(pos) = self.waiting.iter().position(|&r| r == id) {
            self.waiting.remove(pos);
        } else {
            self.loading.retain(|&r| r != id);
        }
        true
    }

    /// Plans one step.
    pub fn schedule(&mut self) -> Step {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut step = Step::default();
        if self.pause == PauseState::PausedAll {
            return step;
        }

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let req = &self.requests[&id];
            let n = (req.tokens.len() - req.num_computed).min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let mut ok = false;
            loop {
                if self.allocate(id, n, &[]) {
                    ok = true;
                    break;
                }
                let Some(victim) = self.running.pop() else { break };
                self.preempt(victim);
                step.preempted.push(victim);
                if victim == id {
                    break;
                }
            }
            if !ok {
                break;
            }
            self.record(&mut step, id, n);
            budget -= n;
            i += 1;
        }

        if step.preempted.is_empty() && self.pause == PauseState::Unpaused {
            let mut loras: HashSet<u32> = self.running.iter().filter_map(|id| self.requests[id].lora_id()).collect();
            // Requests skipped for their adapter keep their place at the front of the queue.
            let mut at = 0;
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.get(at) else { break };
                if let Some(l) = self.requests[&id].lora_id()
                    && loras.len() >= self.cfg.max_loras
                    && !loras.contains(&l)
                {
                    at += 1;
                    continue;
                }
                if self.requests[&id].load == Load::Pending {
                    // A decode leg takes its blocks now and waits for its KV out of the queue.
                    if !self.start_load(id, &mut step) {
                        break;
                    }
                    self.waiting.remove(at);
                    continue;
                }
                let hits = self.cached_prefix(id);
                let req = &self.requests[&id];
                let num_tokens = req.tokens.len();
                let n = (num_tokens - req.num_computed - hits.len() * bs).min(budget);
                let queried = req.blocks.is_empty();
                if !self.allocate(id, n, &hits) {
                    break;
                }
                if queried {
                    // A decode leg back from its pull was looked up when it was admitted.
                    self.counters.prefix_cache_queries += num_tokens as u64;
                    self.counters.prefix_cache_hits += (hits.len() * bs) as u64;
                }
                let req = self.requests.get_mut(&id).expect("waiting ids are live");
                req.num_cached_tokens.get_or_insert(hits.len() * bs);
                loras.extend(req.lora_id());
                self.waiting.remove(at);
                self.running.push(id);
                self.record(&mut step, id, n);
                budget -= n;
            }
        }
        step
    }

    /// Applies a finished step: advances computed tokens, samples, finishes requests.
    pub fn update(&mut self, step: &Step) -> Vec<TokenOutput> {
        let mut out = Vec::new();
        let mut finished = Vec::new();
        for &(id, n) in &step.scheduled {
            let Some(req) = self.requests.get_mut(&id) else { continue };
            req.num_computed += n;
            if req.num_computed < req.tokens.len() {
                continue; // a prefill chunk that did not reach the end of the context
            }
            let num_out = req.num_output();
            let allow_eos = !req.ignore_eos && num_out >= req.min_tokens;
            let tok = self.sampler.next(req.ctx, allow_eos);
            req.tokens.push(tok);
            req.ctx = req.ctx.push(tok);
            let finish = if allow_eos && Some(tok) == self.sampler.eos() {
                Some(FinishReason::Stop)
            } else if num_out + 1 >= req.max_tokens || req.tokens.len() >= self.cfg.max_model_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            out.push(TokenOutput {
                id,
                token: tok,
                finish,
                first: num_out == 0,
                num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
                num_prompt_tokens: req.num_prompt,
                num_external_tokens: req.num_external,
            });
            if finish.is_some() {
                finished.push(id);
            }
        }
        for id in finished {
            if self.requests[&id].kv == KvTransfer::Hold {
                self.hold(id);
            } else {
                self.abort(id);
            }
        }
        out
    }

    /// Drops the prefix cache if no block is in use (vLLM semantics); with `reset_running`,
    /// running requests are preempted first (they recompute later), so it succeeds.
    pub fn reset_prefix_cache(&mut self, reset_running: bool) -> bool {
        if reset_running {
            // Last first, each to the front of the queue: they come back in their order.
            while let Some(id) = self.running.pop() {
                self.preempt(id);
            }
        }
        self.pool.reset_prefix_cache()
    }

    /// Sets the pause state (`/pause`, `/resume`).
    pub fn set_pause(&mut self, pause: PauseState) {
        self.pause = pause;
    }

    /// The pause state.
    pub fn pause_state(&self) -> PauseState {
        self.pause
    }

    /// Aborts every request, running or waiting (`/pause?mode=abort`); returns their outputs,
    /// each finished with [`FinishReason::Abort`], for the caller to deliver.
    pub fn abort_all(&mut self) -> Vec<TokenOutput> {
        let ids: Vec<ReqId> = self.running.iter().chain(&self.waiting).chain(&self.loading).copied().collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let req = &self.requests[&id];
            out.push(TokenOutput {
                id,
                token: 0,
                finish: Some(FinishReason::Abort),
                first: req.num_output() == 0,
                num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
                num_prompt_tokens: req.num_prompt,
                num_external_tokens: req.num_external,
            });
            self.abort(id);
        }
        out
    }

    /// Whether requests are running (a pause in `wait` mode completes when none is).
    pub fn has_running(&self) -> bool {
        !self.running.is_empty()
    }

    /// KV events produced since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Requests in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting (new, preempted, or waiting for their KV pull, as vLLM counts them).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.loading.len()
    }

    /// Whether there is anything to do (paused: only running requests, and while
    /// `PausedAll` nothing).
    pub fn has_work(&self) -> bool {
        match self.pause {
            PauseState::Unpaused => !self.running.is_empty() || !self.waiting.is_empty(),
            PauseState::PausedNew => !self.running.is_empty(),
            PauseState::PausedAll => false,
        }
    }

    /// KV cache usage in [0, 1].
    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Cumulative counters.
    pub fn counters(&self) -> SchedulerCounters {
        self.counters
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Read access to the pool (tests and invariants).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The blocks a request currently holds (tests).
    pub fn blocks_of(&self, id: ReqId) -> Option<&[BlockId]> {
        self.requests.get(&id).map(|r| r.blocks.as_slice())
    }

    fn record(&self, step: &mut Step, id: ReqId, n: usize) {
        let req = &self.requests[&id];
        let is_decode = n == 1 && req.num_output() > 0 && req.num_computed + 1 == req.tokens.len();
        if is_decode {
            step.shape.add_decode(req.tokens.len());
        } else {
            step.shape.add_prefill(req.num_computed, n);
        }
        step.scheduled.push((id, n));
    }

    /// The longest run of the request's leading full blocks present in the cache (none for a
    /// request that already holds blocks: a decode leg back from its pull).
    fn cached_prefix(&self, id: ReqId) -> Vec<BlockId> {
        let req = &self.requests[&id];
        if !self.cfg.enable_prefix_caching || req.num_computed > 0 || !req.blocks.is_empty() {
            return Vec::new();
        }
        let max_blocks = (req.tokens.len() - 1) / self.cfg.block_size;
        req.block_hashes.iter().take(max_blocks).map_while(|h| self.pool.lookup(h)).collect()
    }

    /// Gives the request blocks for `n` more tokens (after taking `hits` from the cache) and
    /// registers its newly full blocks. All or nothing.
    fn allocate(&mut self, id: ReqId, n: usize, hits: &[BlockId]) -> bool {
        let bs = self.cfg.block_size;
        let req = self.requests.get_mut(&id).expect("scheduled ids are live");
        let computed = req.num_computed + hits.len() * bs;
        let need = ceil_div(computed + n, bs);
        let new_blocks = need.saturating_sub(req.blocks.len() + hits.len());
        let revived = hits.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        if new_blocks + revived > self.pool.num_free() {
            return false;
        }
        self.pool.touch(hits);
        req.blocks.extend_from_slice(hits);
        req.num_cached_blocks += hits.len();
        req.num_computed = computed;
        let fresh = self.pool.allocate(new_blocks).expect("checked above");
        req.blocks.extend(fresh);
        if req.load != Load::Pending {
            // A decode leg's blocks are cached once its KV arrived (vLLM's delay_cache_blocks).
            self.cache_full_blocks(id, computed + n);
        }
        true
    }

    /// Registers the request's blocks that the first `upto` tokens fill, emitting their
    /// `BlockStored`.
    fn cache_full_blocks(&mut self, id: ReqId, upto: usize) {
        let (bs, root) = (self.cfg.block_size, self.cfg.hash_root);
        let req = self.requests.get_mut(&id).expect("scheduled ids are live");
        let full = upto.min(req.tokens.len()) / bs;
        let from = req.num_cached_blocks;
        if full > from {
            if self.cfg.enable_prefix_caching {
                req.ensure_hashes(full, bs, &root);
                let parent = from.checked_sub(1).map(|p| req.block_hashes[p]);
                let keys = req.block_keys(from, full);
                self.pool.cache_full_blocks(&req.blocks[from..full], &req.block_hashes[from..full], parent.as_ref(), &req.tokens[from * bs..full * bs], keys);
            }
            req.num_cached_blocks = full;
        }
    }

    fn preempt(&mut self, id: ReqId) {
        let req = self.requests.get_mut(&id).expect("running ids are live");
        self.pool.free(req.blocks.iter().rev());
        req.blocks.clear();
        req.num_computed = 0;
        req.num_cached_blocks = 0;
        self.waiting.push_front(id);
        self.counters.preemptions += 1;
    }
}

#[cfg(test)]
mod tests;
