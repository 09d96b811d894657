//! A served model: its config, its workers (a worker's id is its index), its routing policy,
//! its booking ledger and its router queue, and the per-worker views routing and shedding
//! take of them.

use super::Worker;
use crate::config::{ModelConfig, Role};
use crate::kv_routing::KvRouting;
use crate::metrics::{Metrics, ModelMetrics};
use kvgate_filters::ledger::{Ledger, Tracking};
use kvgate_filters::route::time::TimePriors;
use kvgate_filters::route::{Candidate, Cost, Policy};
use kvgate_filters::shed::{RankLoad, Thresholds, worker_busy};
use std::sync::{Arc, OnceLock};

/// A served model.
#[derive(Clone)]
pub struct Model {
    /// The model's config section.
    pub cfg: ModelConfig,
    /// Its name (`cfg.name`), shared with its requests' registry entries instead of copied.
    pub name: Arc<str>,
    /// Workers; a worker's id is its index here. Shared with the route receipts of the
    /// model's requests, which name workers by id.
    pub workers: Arc<[Arc<Worker>]>,
    /// Selection policy (baseline modes).
    pub policy: Arc<dyn Policy>,
    /// The WebAssembly policy in front of `policy`/`kv`, when `routing.mode` is `plugin`.
    pub plugin: Option<Arc<kvgate_plugins::PluginSlot>>,
    /// KV routing state, when `routing.mode` (or a plugin's fallback) is `kv`.
    pub kv: Option<Arc<KvRouting>>,
    /// The router queue, when the model has one ([`crate::config::Routing::router_queue_threshold`]).
    pub queue: Option<Arc<kvgate_filters::route::RouterQueue>>,
    /// What requests in flight have booked on each worker (every routing mode, shedding and
    /// the queue read it).
    pub ledger: Arc<Ledger>,
    /// Its per-request metric series, resolved on first use.
    pub metrics: OnceLock<ModelMetrics>,
}

impl Model {
    /// Its metric series.
    pub fn metrics(&self, m: &Metrics) -> &ModelMetrics {
        self.metrics.get_or_init(|| {
            let labels: Vec<String> = self.workers.iter().map(|w| w.label.clone()).collect();
            ModelMetrics::new(m, &self.cfg.name, &labels)
        })
    }

    /// The ledger a model's config asks for, over its workers' counters.
    pub fn new_ledger(m: &ModelConfig, workers: &[Arc<Worker>]) -> Arc<Ledger> {
        let r = &m.routing;
        let tracking = Tracking {
            assume_kv_reuse: r.assume_kv_reuse,
            active_blocks: r.track_active_blocks,
            output_blocks: r.track_output_blocks,
            block_size: m.block_size,
        };
        Ledger::over(workers.iter().map(|w| w.booked.clone()).collect(), tracking)
    }

    /// Whether worker `i` is past the queue threshold: its booked prefill over the threshold
    /// ([`crate::config::Routing::router_queue_threshold`]) times its prefill budget, or its KV
    /// cache fully booked (the blocks its requests hold and are expected to fill, against the
    /// blocks it reports). A request sent to
    /// a full worker would wait inside it, behind whoever came first; held in the router queue,
    /// it goes to the first worker with room, in the queue's order (bands, tenants' fair shares,
    /// priority).
    pub fn queue_busy(&self, i: usize) -> bool {
        self.cfg
            .routing
            .router_queue_threshold()
            .is_some_and(|q| self.ledger.prefill_tokens(i as u16) as f64 > q * self.cfg.shedding.prefill_budget() as f64 || self.kv_fully_booked(i))
    }

    /// Whether worker `i`'s reported KV blocks are all booked (never, before it reported them).
    fn kv_fully_booked(&self, i: usize) -> bool {
        let total = self.workers[i].reported_summary().total_blocks;
        total > 0 && self.ledger.expected_blocks(i as u16) >= total
    }

    /// Whether the model is, or may be, a Harmony model (gpt-oss), whose Responses vLLM renders
    /// with Harmony rather than the chat template: until a worker's model card is read, it may
    /// be; then it is when the card's `root` (the weights' path or Hub id) names gpt-oss.
    pub fn may_be_harmony(&self) -> bool {
        let cards: Vec<_> = self.workers.iter().filter_map(|w| w.cards()).collect();
        cards.is_empty()
            || cards.iter().filter_map(|c| c.card(&self.cfg.name)).any(|card| {
                let root = card.get("root").and_then(serde_json::Value::as_str).unwrap_or("").to_ascii_lowercase();
                root.contains("gpt-oss") || root.contains("gpt_oss")
            })
    }

    /// The shortest context length (`max_model_len`) among the workers that reported theirs:
    /// what a continuation sent to any of them must fit.
    pub fn shortest_context(&self) -> Option<u32> {
        self.workers.iter().filter_map(|w| w.max_model_len()).min()
    }

    /// Worker `i`'s role (prefill/decode disaggregation).
    pub fn role(&self, i: usize) -> Role {
        self.cfg.workers.get(i).map_or(Role::Both, |w| w.role)
    }

    /// Workers that serve answers (all but the prefill workers).
    pub fn answering_workers(&self) -> usize {
        (0..self.workers.len()).filter(|&i| self.role(i).answers()).count()
    }

    /// Whether some worker is a prefill worker, so requests may run in two legs.
    pub fn disaggregates(&self) -> bool {
        self.cfg.workers.iter().any(|w| w.role == Role::Prefill)
    }

    /// How many requests the router queue may release now: one per healthy worker that would
    /// carry a request's prefill ([`Model::prefill_carriers`]) and is not past the queue
    /// threshold; every waiter when no such worker is healthy, since waiting cannot help them
    /// and placement answers them (a fallback, or the error of a fleet that is down).
    pub fn queue_releases(&self) -> usize {
        let mut carriers = self.prefill_carriers().peekable();
        if carriers.peek().is_none() {
            return usize::MAX;
        }
        carriers.filter(|&i| !self.queue_busy(i)).count()
    }

    /// Whether a request may pass the router queue: some worker that would carry its prefill
    /// has room, or none is healthy ([`Model::queue_releases`]). Looks no further than the
    /// first with room: every request of a model with a queue asks.
    pub fn queue_has_room(&self) -> bool {
        let mut carriers = self.prefill_carriers().peekable();
        carriers.peek().is_none() || carriers.any(|i| !self.queue_busy(i))
    }

    /// The healthy workers a request's prefill would run on: the prefill workers when the model
    /// disaggregates and one of them is up, else the workers that answer (a request runs
    /// aggregated on a decode worker while no prefill worker is up).
    fn prefill_carriers(&self) -> impl Iterator<Item = usize> + '_ {
        let healthy = |i: usize| self.workers[i].is_healthy();
        let split = self.disaggregates() && (0..self.workers.len()).any(|i| self.role(i) == Role::Prefill && healthy(i));
        (0..self.workers.len()).filter(move |&i| (self.role(i) == Role::Prefill) == split && healthy(i))
    }

    /// Whether worker `i` is over a busy threshold. Per DP rank: the worker's reported KV usage
    /// and capacity, and the bookings spread evenly over the ranks (vLLM balances its ranks).
    /// The booked blocks include what its requests' output is expected to fill
    /// ([`kvgate_filters::ledger::Ledger::expected_blocks`]).
    pub fn busy(&self, i: usize, t: &Thresholds) -> bool {
        let w = &self.workers[i];
        let (prefill, blocks) = (self.ledger.prefill_tokens(i as u16), self.ledger.expected_blocks(i as u16));
        let reported = w.reported();
        let dp = self.cfg.workers.get(i).map_or(1, |c| c.dp_size.max(1)) as usize;
        let ranks: Vec<RankLoad> = (0..dp)
            .map(|r| {
                let rep = reported.get(r).copied();
                RankLoad {
                    booked_prefill_tokens: prefill / dp as u64,
                    booked_blocks: blocks / dp as u64,
                    total_blocks: rep.map_or(0, |x| x.total_blocks),
                    reported_kv_usage: rep.map(|x| x.kv_usage),
                    max_num_batched_tokens: self.cfg.shedding.max_num_batched_tokens.unwrap_or(0),
                }
            })
            .collect();
        worker_busy(t, &ranks)
    }

    /// Worker `i` as a routing candidate without prefix knowledge: its booked load, what it
    /// reports about itself (summed over DP ranks; usage of the fullest), health and busy state,
    /// as of `now` on the ledger's clock (`ledger::clock_us`).
    pub fn candidate(&self, i: usize, busy: bool, now: u64) -> Candidate {
        let w = &self.workers[i];
        let id = i as u16;
        let ranks = w.reported_summary();
        let mut c = Candidate {
            total_blocks: ranks.total_blocks,
            kv_usage: ranks.kv_usage,
            waiting: ranks.waiting,
            healthy: w.is_healthy(),
            busy,
            ..self.ledger.candidate(id, now)
        };
        if let Some(priors) = self.time_priors() {
            let k = &w.calibration;
            if k.has_prefill() {
                c.ms_per_prefill_token = k.prefill() * priors.ms_per_prefill_token;
            }
            if k.has_step() {
                c.step_ms = k.step() * priors.step_ms(&c, self.cfg.block_size);
            }
            // One phase per worker: data-parallel ranks step independently, so their tokens
            // interleave and no step can be timed.
            if let Some(l) = self.ledger.step_lengths(id).filter(|_| ranks.ranks <= 1) {
                let a = priors.ms_per_prefill_token(&c);
                // A step computes at most one chunk of prefill (the rest of a long prompt runs in
                // the steps after it).
                let chunk = priors.chunk_tokens.max(1.0);
                let extra = (l.running_tokens as f64).min(chunk) - l.mean_tokens.min(chunk);
                // A step is at least its decodes: a miscalibrated `a` never predicts one near 0.
                c.running_step_ms = Some((l.mean_ms + a * extra).max(l.mean_ms / 4.0));
            }
        }
        c
    }

    /// The `time` cost's priors, when this model routes by it.
    pub fn time_priors(&self) -> Option<TimePriors> {
        let p = self.kv.as_ref()?.policy.params();
        (p.cost == Cost::Time).then_some(p.priors)
    }

    /// Worker `i`'s time per output token, ms, for `c` (its [`Model::candidate`]): the `time`
    /// cost's predictor (its measured step, else its prior step stretched by the prefill booked
    /// there) where the model routes by it (so the rescheduler and routing agree on what a
    /// loaded worker is), else the inter-token latency measured there while it has
    /// requests running.
    pub fn predicted_tpot_ms(&self, i: usize, c: &Candidate) -> Option<f64> {
        match self.time_priors() {
            Some(p) => Some(p.tpot_of(c, self.cfg.block_size, c.prefill_load)),
            None => (c.in_flight > 0).then(|| self.workers.get(i)?.itl_ms()).flatten(),
        }
    }
}
