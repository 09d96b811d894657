//! Per-model state of `kv` routing: the tokenizer, the KV index (fed by the workers' events, or
//! by our own decisions in approximate mode), the cost policy, and the index id of every
//! worker's DP rank. What is booked on each worker is in the model's ledger.
//!
//! Built with the fleet on each (re)load; the event subscribers run as a background task
//! (`tasks::kv_subscribers`), keyed by this state, so a reload replaces them.

use crate::config::{ModelConfig, UpstreamUrl};
use kvgate_filters::route::time::{Pricing, TimePriors};
use kvgate_filters::route::{Candidate, Cost, KvParams, KvPolicy};
use kvgate_kv::approx::{ApproxConfig, ApproxIndex};
use kvgate_kv::hash::{BlockHash, DEFAULT_SEED, Hasher};
use kvgate_kv::index::{FlatIndex, KvIndex, Matches, WorkerId};
use kvgate_kv::subscriber::{Source, rank_endpoint};
use kvgate_tokenize::{ModelTokenizer, SegmentCache};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where cached-prefix knowledge comes from.
pub enum Cache {
    /// Workers' KV events.
    Events(Arc<FlatIndex>),
    /// Our own routing decisions (approximate mode).
    Approx(ApproxIndex),
}

/// KV routing state of one model.
pub struct KvRouting {
    /// Block hasher (the model's block size).
    pub hasher: Hasher,
    /// The model's tokenizer with its segment cache, if configured.
    pub tokenizer: Option<Arc<SegmentCache>>,
    /// How vLLM converts Anthropic Messages requests for this model's chat template (probed
    /// once, as vLLM probes it at start-up).
    pub messages: kvgate_tokenize::dialect::messages::MessagesOptions,
    /// Cached prefixes per DP rank.
    pub cache: Cache,
    /// Index ids of each worker's DP ranks (the index counts ranks, not workers).
    pub rank_ids: Vec<Vec<WorkerId>>,
    /// One past the highest index id ever handed out (ids of removed workers below it may be
    /// reused only once none is left above).
    next_id: WorkerId,
    /// Event sources to subscribe to (events mode), of the workers whose endpoints are
    /// configured; `kv_events: auto` workers' are found at run time (`tasks::kv_subscribers`).
    pub sources: Vec<Source>,
    /// The cost policy.
    pub policy: KvPolicy,
    /// Most leading blocks hashed per prompt.
    pub max_prefix_blocks: usize,
}

/// Index ids an events index has room for: one bitset word, so a fleet that grows (the
/// planner, discovery) keeps its index without costing lookups anything.
const INDEX_IDS: usize = 64;

impl KvRouting {
    /// Builds the state for a model (loads its tokenizer: an error rejects the config).
    pub fn build(m: &ModelConfig) -> Result<Self, String> {
        let tokenizer = load_tokenizer(m)?;
        let ranks: usize = m.workers.iter().map(|w| w.dp_size as usize).sum();
        let r = &m.routing;
        let cache = if r.kv_events {
            Cache::Events(Arc::new(FlatIndex::new(ranks.clamp(INDEX_IDS, 256), 1 << 16)))
        } else {
            Cache::Approx(ApproxIndex::new(ApproxConfig {
                ttl: Duration::from_secs_f64(r.ttl_secs),
                max_tree_size: r.max_tree_size,
                prune_target_ratio: r.prune_target_ratio,
            }))
        };
        let mut next: WorkerId = 0;
        let rank_ids = m
            .workers
            .iter()
            .map(|w| {
                (0..w.dp_size)
                    .map(|_| {
                        next += 1;
                        next - 1
                    })
                    .collect()
            })
            .collect();
        Self::assemble(m, tokenizer, cache, rank_ids, next)
    }

    /// The state for `m` when only its workers changed since `old` was built for
    /// `old_workers`: the tokenizer and the events index are kept, and so is every remaining
    /// worker's index id (what the index knows of its cache); a removed worker's blocks are
    /// forgotten, and a new worker gets an id never used before while there is one (a removed
    /// worker's subscriber may still be stopping). `None` where it cannot be kept (approximate
    /// mode, or no room in the index): build afresh.
    pub fn regroup(old: &KvRouting, old_workers: &[crate::config::WorkerConfig], m: &ModelConfig) -> Option<Self> {
        let Cache::Events(index) = &old.cache else { return None };
        let was: std::collections::HashMap<&UpstreamUrl, (&Vec<WorkerId>, u32)> =
            old_workers.iter().zip(&old.rank_ids).map(|(w, ids)| (&w.url, (ids, w.dp_size))).collect();
        let kept: Vec<Option<&Vec<WorkerId>>> = m.workers.iter().map(|w| was.get(&w.url).filter(|(_, dp)| *dp == w.dp_size).map(|(ids, _)| *ids)).collect();
        let in_use: std::collections::HashSet<WorkerId> = kept.iter().flatten().flat_map(|ids| ids.iter().copied()).collect();
        for &id in old.rank_ids.iter().flatten().filter(|id| !in_use.contains(id)) {
            index.clear(id);
        }
        let mut next = old.next_id;
        let mut reusable = (0..old.next_id).filter(|id| !in_use.contains(id));
        let mut rank_ids = Vec::with_capacity(m.workers.len());
        for (w, kept) in m.workers.iter().zip(kept) {
            if let Some(ids) = kept {
                rank_ids.push(ids.clone());
                continue;
            }
            let mut ids = Vec::new();
            for _ in 0..w.dp_size {
                let id = if (next as usize) < index.max_workers() {
                    next += 1;
                    next - 1
                } else {
                    let id = reusable.next()?;
                    index.clear(id);
                    id
                };
                ids.push(id);
            }
            rank_ids.push(ids);
        }
        Self::assemble(m, old.tokenizer.clone(), Cache::Events(index.clone()), rank_ids, next).ok()
    }

    fn assemble(m: &ModelConfig, tokenizer: Option<Arc<SegmentCache>>, cache: Cache, rank_ids: Vec<Vec<WorkerId>>, next_id: WorkerId) -> Result<Self, String> {
        let r = &m.routing;
        let hasher = Hasher::new(m.block_size as usize, DEFAULT_SEED);
        let messages = tokenizer.as_ref().map(|t| kvgate_tokenize::dialect::messages::MessagesOptions::for_tokenizer(t.tokenizer())).unwrap_or_default();
        let mut sources = Vec::new();
        // A cost that never consults the cache needs no subscribers either.
        if r.kv_events && r.uses_cache() {
            for (w, ids) in m.workers.iter().zip(&rank_ids) {
                let Some(crate::config::KvEvents::At(ep)) = &w.kv_events else { continue };
                for (rank, &id) in (0u32..).zip(ids) {
                    sources.push(Source {
                        endpoint: rank_endpoint(&ep.0, rank)?,
                        replay: w.replay.as_ref().map(|e| rank_endpoint(&e.0, rank)).transpose()?,
                        topic: String::new(),
                        worker: id,
                        hasher,
                        label: source_label(&w.url, rank),
                    });
                }
            }
        }
        #[allow(clippy::float_cmp, reason = "a weight read from the config, compared with its default as written, not computed")]
        let weight_set = r.overlap_score_weight != 1.0;
        if r.cost == Cost::Time && weight_set {
            tracing::warn!(model = %m.name, weight = r.overlap_score_weight, "routing.overlap_score_weight applies to cost: blocks only; the time cost (the default) ignores it");
        }
        Ok(Self {
            hasher,
            tokenizer,
            messages,
            cache,
            rank_ids,
            next_id,
            sources,
            policy: KvPolicy::new(KvParams {
                cost: r.cost,
                priors: TimePriors { chunk_tokens: m.shedding.prefill_budget() as f64, ..TimePriors::default() },
                pricing: Pricing {
                    credit_booked: r.credit_in_flight_prefix,
                    slowdown: r.price_slowdown,
                    queue: r.price_queue,
                    duplicates: r.price_duplicates,
                    decode: r.price_decode,
                    stall_share: r.price_stall_share,
                    stall_e2e: r.price_stall_e2e,
                    shared_step: r.price_shared_step,
                },
                overlap_score_weight: r.overlap_score_weight,
                temperature: r.temperature,
                block_size: m.block_size,
                track_active_blocks: r.track_active_blocks,
                ttft_trade_ratio: r.ttft_trade_ratio,
                ttft_trade_floor_ms: r.ttft_trade_floor_ms,
                tie_steps: r.tie_steps,
            }),
            max_prefix_blocks: r.max_prefix_blocks,
        })
    }

    /// Most leading tokens routing uses.
    pub fn max_tokens(&self) -> usize {
        self.max_prefix_blocks * self.hasher.block_size()
    }

    /// The chained hashes routing looks up for `tokens`.
    pub fn chain(&self, tokens: &[u32]) -> Vec<BlockHash> {
        self.hasher.chain_prefix(tokens, self.max_prefix_blocks)
    }

    /// [`KvRouting::chain`] for a request with a `cache_salt` ([`salt_digest`](kvgate_kv::hash::salt_digest)
    /// of it) or naming a LoRA `adapter`, keyed as vLLM keys their blocks: the salt is mixed
    /// into the first block's hash only (and so, through the chain, into every block), the
    /// adapter into every block (its own hash space, as the workers' events are hashed with
    /// their `lora_name`). A salted or adapted prompt matches only blocks cached under the same
    /// salt and adapter.
    pub fn chain_for(&self, tokens: &[u32], salt: Option<u64>, adapter: Option<&str>) -> Vec<BlockHash> {
        self.hasher.with_lora(adapter).chain_prefix_with(tokens, self.max_prefix_blocks, &[salt])
    }

    /// Cached leading blocks per index id.
    pub fn cached(&self, chain: &[BlockHash]) -> Matches {
        match &self.cache {
            Cache::Events(idx) => idx.find_matches(chain),
            Cache::Approx(a) => a.find_matches(chain, Instant::now()),
        }
    }

    /// One past the highest index id in use (for [`Matches::to_dense`]; ids of removed workers
    /// leave gaps).
    pub fn rank_count(&self) -> usize {
        self.rank_ids.iter().flatten().max().map_or(0, |&id| id as usize + 1)
    }

    /// Adds prefix knowledge to worker `c.id`'s candidate: its best overlap over its DP ranks
    /// (`cached`, dense per index id) and the prompt blocks already booked on it (`booked`,
    /// dense per worker), and the room left in its KV cache when its events and its capacity
    /// are known.
    pub fn with_prefix(&self, mut c: Candidate, cached: &[u32], booked: &[u32]) -> Candidate {
        let worker = c.id as usize;
        c.overlap_blocks = self.rank_ids[worker].iter().map(|&s| cached.get(s as usize).copied().unwrap_or(0)).max().unwrap_or(0);
        c.active_overlap_blocks = booked.get(worker).copied().unwrap_or(0);
        if c.total_blocks > 0 && matches!(self.cache, Cache::Events(_)) {
            // An index that missed events (a restart without replay) under-counts: the blocks
            // the worker reports in use are held whatever the index knows.
            #[allow(clippy::cast_sign_loss, reason = "a usage clamped to 0..=1 times a block count: not negative")]
            let in_use = (c.kv_usage.clamp(0.0, 1.0) * c.total_blocks as f64) as u64;
            let held = (self.cached_blocks(worker) as u64).max(in_use);
            c.cache_room_blocks = Some(c.total_blocks.saturating_sub(held));
        }
        c
    }

    /// Approximate mode: remember that `worker` will now cache `chain`; whether it did (false
    /// with KV events, which say it themselves).
    pub fn record_decision(&self, worker: usize, chain: &[BlockHash]) -> bool {
        if let Cache::Approx(a) = &self.cache
            && let Some(&rank) = self.rank_ids.get(worker).and_then(|r| r.first())
        {
            a.record(rank, chain, Instant::now());
            return true;
        }
        false
    }

    /// Forgets every block `worker` holds (all ranks): its prefix cache was reset or dropped
    /// (a fleet operation's `/reset_prefix_cache` or `/sleep`).
    pub fn forget_worker(&self, worker: usize) {
        for &rank in self.rank_ids.get(worker).into_iter().flatten() {
            match &self.cache {
                Cache::Events(idx) => idx.clear(rank),
                Cache::Approx(a) => a.clear(rank),
            }
        }
    }

    /// Blocks the event index holds for a worker (all ranks).
    pub fn cached_blocks(&self, worker: usize) -> usize {
        match &self.cache {
            Cache::Events(idx) => self.rank_ids[worker].iter().map(|&s| idx.block_count(s)).sum(),
            Cache::Approx(_) => 0,
        }
    }
}

/// A model's tokenizer with its segment cache, if configured.
fn load_tokenizer(m: &ModelConfig) -> Result<Option<Arc<SegmentCache>>, String> {
    let Some(p) = &m.tokenizer else { return Ok(None) };
    // `builtin`: the small tokenizer shipped with the repository (vllm-sim's).
    let tok = if p.as_os_str() == "builtin" { ModelTokenizer::builtin() } else { ModelTokenizer::load(p).map_err(|e| format!("model {:?}: {e}", m.name))? };
    let cache = SegmentCache::new(tok, kvgate_tokenize::segmented::DEFAULT_CAPACITY);
    if !cache.enabled(false) {
        tracing::warn!(model = %m.name, "this tokenizer cannot be tokenized by segments exactly; every prompt is tokenized in full");
    }
    Ok(Some(Arc::new(cache)))
}

/// Metrics/log label of a worker's DP rank.
pub fn source_label(url: &UpstreamUrl, rank: u32) -> String {
    format!("{url}#{rank}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_kv::hash::salt_digest;

    fn routing(kv_events: bool) -> KvRouting {
        let yaml = format!(
            "models:\n  - name: m\n    routing:\n      mode: kv\n      kv_events: {kv_events}\n    workers:\n      - url: http://a:1\n        kv_events: tcp://127.0.0.1:5557\n"
        );
        let cfg = crate::config::load::load_str(&yaml, "t", Vec::<(String, String)>::new()).unwrap();
        KvRouting::build(&cfg.models[0]).unwrap()
    }

    #[test]
    fn a_salted_prompt_matches_only_blocks_cached_under_its_salt() {
        let kv = routing(true);
        let Cache::Events(idx) = &kv.cache else { panic!("events mode") };
        let tokens: Vec<u32> = (0..16 * 4).collect();
        let salt = Some(salt_digest("tenant-a"));
        assert_eq!(kv.chain_for(&tokens, None, None), kv.chain(&tokens));
        idx.insert(0, None, &kv.chain(&tokens)).unwrap();
        assert_eq!(kv.cached(&kv.chain(&tokens)).get(0), 4);
        assert_eq!(kv.cached(&kv.chain_for(&tokens, salt, None)).get(0), 0, "an unsalted prefix is no hit for a salted prompt");
        idx.insert(0, None, &kv.chain_for(&tokens, salt, None)).unwrap();
        assert_eq!(kv.cached(&kv.chain_for(&tokens, salt, None)).get(0), 4);
        assert_eq!(kv.cached(&kv.chain_for(&tokens, Some(salt_digest("tenant-b")), None)).get(0), 0);
        // An adapter's blocks are its own: the base model's prefix is no hit for it.
        assert_eq!(kv.cached(&kv.chain_for(&tokens, salt, Some("sql"))).get(0), 0);
        idx.insert(0, None, &kv.hasher.with_lora(Some("sql")).chain_with(None, &tokens, &[salt])).unwrap();
        assert_eq!(kv.cached(&kv.chain_for(&tokens, salt, Some("sql"))).get(0), 4, "keyed as the applier keys an adapter's stored blocks");
    }

    #[test]
    fn the_room_is_the_capacity_less_what_the_worker_holds() {
        let kv = routing(true);
        let Cache::Events(idx) = &kv.cache else { panic!("events mode") };
        let chain = kv.hasher.chain(None, &(0..16 * 100).collect::<Vec<u32>>());
        idx.insert(0, None, &chain).unwrap();
        let with = |c: Candidate| kv.with_prefix(c, &[0], &[0]).cache_room_blocks;
        assert_eq!(with(Candidate { total_blocks: 1000, ..Default::default() }), Some(900), "100 blocks held by events");
        // The blocks it reports in use count even where the index knows fewer.
        assert_eq!(with(Candidate { total_blocks: 1000, kv_usage: 0.5, ..Default::default() }), Some(500));
        assert_eq!(with(Candidate { total_blocks: 50, ..Default::default() }), Some(0), "never below zero");
        assert_eq!(with(Candidate::default()), None, "no capacity reported: unknown");
        // Approximate mode knows no worker's cache content: unknown.
        let approx = routing(false);
        assert_eq!(approx.with_prefix(Candidate { total_blocks: 1000, ..Default::default() }, &[0], &[0]).cache_room_blocks, None);
    }
}
