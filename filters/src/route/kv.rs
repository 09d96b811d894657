//! `kv` mode: a KV-cache-aware cost per worker, lowest wins. Two costs: `time` (the default;
//! predicted time to first token, see [`super::time`]) and `blocks`, Dynamo's KV router cost in KV
//! blocks, unchanged:
//!
//! ```text
//! prefill_blocks = (active_prefill_tokens + prompt_tokens − overlap_blocks · block_size) / block_size
//! decode_blocks  = active_blocks + (prompt_blocks − active_overlap_blocks)
//! cost           = overlap_score_weight · prefill_blocks + decode_blocks          (lower is better)
//! ```
//! `overlap_blocks` are the prompt's leading blocks already in the worker's KV cache;
//! `active_overlap_blocks` those already booked on it by requests in flight, so a shared prefix
//! is counted once in its decode load. `overlap_score_weight = 0` ignores the cache (pure load
//! balancing); `track_active_blocks = false` drops the decode term (prefill-only workers).
//!
//! Under the `time` cost, a worker whose predicted time to first token is past the trade bound
//! (`ttft_trade_ratio` of the least any worker offers, at least `ttft_trade_floor_ms` more) is
//! not chosen, however much its other terms say it saves others.
//!
//! Temperature 0: the lowest cost; ties go to the worker with fewer requests in flight, then
//! uniformly at random (no fixed order, so equal workers share traffic). Under the `time` cost a
//! cost at most `tie_steps` times the cheapest worker's decode step above the least ties with it.
//! Temperature T > 0: softmax over costs normalized by their range,
//! `p ∝ exp(−(cost / (max − min)) / T)`; equal costs give a uniform choice.

use super::time::{Prediction, Pricing, TimePriors};
use super::{Candidate, Decision, Policy, RequestSummary};
use std::sync::atomic::AtomicU64;

/// Which cost `kv` mode minimizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cost {
    /// Predicted time to first token ([`super::time`]).
    #[default]
    Time,
    /// The Dynamo KV router's: `overlap_score_weight · prefill_blocks + decode_blocks`.
    Blocks,
}

impl Cost {
    /// Its config name.
    pub fn name(self) -> &'static str {
        match self {
            Cost::Time => "time",
            Cost::Blocks => "blocks",
        }
    }
}

/// One candidate's cost and the terms it is made of.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Terms {
    /// The `blocks` cost's terms.
    Blocks {
        /// Prefill blocks (booked + uncached prompt).
        prefill_blocks: f64,
        /// Decode blocks (booked + the prompt's new ones).
        decode_blocks: f64,
    },
    /// The `time` cost's prediction.
    Time(Prediction),
}

impl Terms {
    /// The predicted time to first token (`time` cost only).
    pub fn ttft_ms(&self) -> Option<f64> {
        match self {
            Terms::Time(p) => Some(p.ttft_ms()),
            Terms::Blocks { .. } => None,
        }
    }
}

/// Parameters of the cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvParams {
    /// Which cost.
    pub cost: Cost,
    /// The `time` cost's priors.
    pub priors: TimePriors,
    /// `time`: which optional terms are priced.
    pub pricing: Pricing,
    /// Weight of the prefill term (0 = ignore the cache).
    pub overlap_score_weight: f64,
    /// Softmax temperature (0 = argmin).
    pub temperature: f64,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Count decode load at all (`false` for prefill-only workers: cost = weighted prefill).
    pub track_active_blocks: bool,
    /// `time`: the most predicted time to first token a request gives up for what it saves
    /// others, as a share of the least among the candidates (0: no bound).
    pub ttft_trade_ratio: f64,
    /// `time`: the bound's least slack, ms.
    pub ttft_trade_floor_ms: f64,
    /// `time`: costs at most this many times the cheapest worker's decode step above the least
    /// are taken as equal, and the fewest requests in flight decides among them (0: only equal
    /// costs tie).
    pub tie_steps: f64,
}

impl Default for KvParams {
    fn default() -> Self {
        Self {
            cost: Cost::default(),
            priors: TimePriors::default(),
            pricing: Pricing::default(),
            overlap_score_weight: 1.0,
            temperature: 0.0,
            block_size: 16,
            track_active_blocks: true,
            ttft_trade_ratio: 0.5,
            ttft_trade_floor_ms: 200.0,
            tie_steps: 0.2,
        }
    }
}

/// The policy.
#[derive(Debug)]
pub struct KvPolicy {
    params: KvParams,
    rng: AtomicU64,
}

impl KvPolicy {
    /// A policy with `params`.
    pub fn new(params: KvParams) -> Self {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1);
        Self { params, rng: AtomicU64::new(seed | 1) }
    }

    /// The parameters.
    pub fn params(&self) -> KvParams {
        self.params
    }

    /// One candidate's cost (lower is better) and its terms.
    pub fn cost(&self, req: &RequestSummary<'_>, c: &Candidate) -> (f64, Terms) {
        self.priced(&self.sized(req), c)
    }

    /// `req` with this model's block size, which the `time` cost reads from it.
    fn sized<'a>(&self, req: &RequestSummary<'a>) -> RequestSummary<'a> {
        RequestSummary { block_size: self.params.block_size, ..*req }
    }

    /// [`Self::cost`] for a request already [`Self::sized`]: `choose` sizes it once, not per
    /// candidate.
    #[inline]
    fn priced(&self, req: &RequestSummary<'_>, c: &Candidate) -> (f64, Terms) {
        match self.params.cost {
            Cost::Blocks => {
                let (prefill_blocks, decode_blocks, cost) = self.blocks_cost(req, c);
                (cost, Terms::Blocks { prefill_blocks, decode_blocks })
            }
            Cost::Time => {
                let p = self.params.priors.predict(req, c, self.params.pricing);
                (p.cost_ms(), Terms::Time(p))
            }
        }
    }

    /// (prefill_blocks, decode_blocks, cost) of one candidate under the Dynamo KV router's cost.
    pub fn blocks_cost(&self, req: &RequestSummary<'_>, c: &Candidate) -> (f64, f64, f64) {
        let bs = f64::from(self.params.block_size.max(1));
        let cached_tokens = (f64::from(c.overlap_blocks) * bs).min(f64::from(req.prompt_tokens));
        let prefill_tokens = c.active_prefill_tokens as f64 + f64::from(req.prompt_tokens) - cached_tokens;
        let prefill_blocks = prefill_tokens / bs;
        let new_blocks = req.prompt_blocks.saturating_sub(c.active_overlap_blocks);
        let decode_blocks = if self.params.track_active_blocks { c.active_blocks as f64 + f64::from(new_blocks) } else { 0.0 };
        (prefill_blocks, decode_blocks, self.params.overlap_score_weight * prefill_blocks + decode_blocks)
    }

    fn uniform(&self) -> f64 {
        let z = kvgate_kv::hash::next_shared(&self.rng);
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Policy for KvPolicy {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn choose(&self, req: &RequestSummary<'_>, candidates: &[Candidate]) -> Decision {
        let req = &self.sized(&req.among(candidates));
        let debug = tracing::enabled!(tracing::Level::DEBUG);
        // Both columns in one allocation: it runs on every request. A cost without a predicted
        // time to first token (`blocks`) has −∞ there, which no bound rules out.
        let n = candidates.len();
        let mut priced = vec![0.0; 2 * n];
        let (costs, ttfts) = priced.split_at_mut(n);
        for ((c, cost), ttft) in candidates.iter().zip(costs.iter_mut()).zip(ttfts.iter_mut()) {
            let (k, t) = self.held_cost(req, c, debug);
            *cost = k;
            *ttft = t.unwrap_or(f64::NEG_INFINITY);
        }
        self.bound_trades(req, costs, ttfts);
        match self.params.temperature {
            t if t > 0.0 => self.sample(costs, t).unwrap_or_else(|| self.cheapest(candidates, costs)),
            _ => self.cheapest(candidates, costs),
        }
    }
}

impl KvPolicy {
    /// One candidate's cost, with its predicted miss of the request's objectives added when
    /// any are set, and its predicted time to first token (`time` cost; `None` for `blocks`).
    fn held_cost(&self, req: &RequestSummary<'_>, c: &Candidate, debug: bool) -> (f64, Option<f64>) {
        let (cost, terms) = self.priced(req, c);
        if debug {
            tracing::debug!(request_id = req.request_id, worker = c.id, overlap = c.overlap_blocks, ?terms, cost, "kv routing");
        }
        match terms {
            Terms::Time(p) if req.slo.is_set() => (cost + req.slo.excess_ms(p.ttft_ms(), p.tpot_ms, req.tpot_weight), terms.ttft_ms()),
            _ => (cost, terms.ttft_ms()),
        }
    }

    /// Rules out (at an infinite cost) each worker whose predicted time to first token is past
    /// what the request may give up for others: `ttft_trade_ratio` of the least any worker
    /// offers, and at least `ttft_trade_floor_ms`. The stall, queue and copy terms price time
    /// other requests lose; summed, they can outweigh seconds of the request's own wait, and
    /// those trades make the first-token tail. A TTFT objective the request holds widens the
    /// bound to it: a worker meeting both of its objectives is never ruled out for its TPOT.
    fn bound_trades(&self, req: &RequestSummary<'_>, costs: &mut [f64], ttfts: &[f64]) {
        let Some(limit) = self.ttft_limit(req, ttfts.iter().copied().filter(|t| t.is_finite())) else {
            return;
        };
        for (cost, &ttft) in costs.iter_mut().zip(ttfts) {
            if ttft > limit {
                *cost = f64::INFINITY;
            }
        }
    }

    /// The latest predicted time to first token a worker may offer `req` and still be chosen,
    /// given the candidates' predicted `ttfts` (`None`: no bound); never under the request's
    /// TTFT objective.
    pub fn ttft_limit(&self, req: &RequestSummary<'_>, ttfts: impl IntoIterator<Item = f64>) -> Option<f64> {
        if self.params.ttft_trade_ratio <= 0.0 || self.params.cost != Cost::Time {
            return None;
        }
        let least = ttfts.into_iter().fold(f64::INFINITY, f64::min);
        let limit = least + (least * self.params.ttft_trade_ratio).max(self.params.ttft_trade_floor_ms);
        Some(req.slo.ttft_ms.map_or(limit, |bound| limit.max(bound)))
    }

    /// A softmax draw over the normalised costs at temperature `t`; `None` when every cost is
    /// the same.
    fn sample(&self, costs: &[f64], t: f64) -> Option<Decision> {
        // A cost that is not finite (a prediction gone wrong, or a worker past the trade bound)
        // is never drawn.
        let (min, max) = costs.iter().filter(|c| c.is_finite()).fold((f64::MAX, f64::MIN), |(lo, hi), &c| (lo.min(c), hi.max(c)));
        let range = max - min;
        if range <= 0.0 {
            return None;
        }
        let weights: Vec<f64> = costs.iter().map(|&c| if c.is_finite() { (-((c - min) / range) / t).exp() } else { 0.0 }).collect();
        let mut x = self.uniform() * weights.iter().sum::<f64>();
        for (i, w) in weights.iter().enumerate() {
            x -= w;
            if x <= 0.0 {
                return Some(Decision::Worker(i));
            }
        }
        Some(Decision::Worker(weights.len() - 1))
    }

    /// The cheapest candidate; among the costs that tie with the least ([`Self::tie_slack`])
    /// the one with the fewest requests in flight, and among those a uniform pick (no
    /// allocation: it runs on every request).
    fn cheapest(&self, candidates: &[Candidate], costs: &[f64]) -> Decision {
        let (at, best) = costs.iter().copied().enumerate().fold((0, f64::MAX), |m, (i, c)| if c < m.1 { (i, c) } else { m });
        let slack = self.tie_slack(candidates.get(at));
        let tied = |i: &usize| costs[*i] <= best + slack;
        // The fewest requests in flight among the tied costs, and how many tied costs have it.
        let (least, n) = (0..costs.len()).filter(tied).fold((u32::MAX, 0usize), |(least, n), i| match candidates[i].in_flight {
            f if f < least => (f, 1),
            f if f == least => (least, n + 1),
            _ => (least, n),
        });
        let pool = || (0..costs.len()).filter(tied).filter(|&i| candidates[i].in_flight == least);
        let n = n.max(1);
        #[allow(clippy::cast_sign_loss, reason = "a uniform draw in [0, 1) times a count: not negative")]
        let k = (self.uniform() * n as f64) as usize % n;
        Decision::Worker(pool().nth(k).unwrap_or(0))
    }

    /// How far above the least cost a cost still ties with it: `tie_steps` of the `cheapest`
    /// worker's decode step under the `time` cost. The prediction places a request at a step
    /// boundary it can only estimate to within a part of a step, so costs closer than that are
    /// not told apart; among them the worker with the fewest requests in flight gives the
    /// request, and every request it joins, the smaller batch.
    fn tie_slack(&self, cheapest: Option<&Candidate>) -> f64 {
        match cheapest {
            Some(c) if self.params.cost == Cost::Time && self.params.tie_steps > 0.0 => {
                (self.params.tie_steps * self.params.priors.step_of(c, self.params.block_size)).max(1e-9)
            }
            _ => 1e-9,
        }
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;
    use crate::route::Slo;

    fn req(tokens: u32) -> RequestSummary<'static> {
        RequestSummary {
            model: "m",
            endpoint: "completions",
            request_id: "r",
            prompt_tokens: tokens,
            prompt_blocks: tokens / 16,
            block_size: 16,
            ..Default::default()
        }
    }

    /// The Dynamo KV router's cost.
    fn blocks() -> KvParams {
        KvParams { cost: Cost::Blocks, ..KvParams::default() }
    }

    fn cand(id: u32, overlap: u32, prefill: u64, active: u64) -> Candidate {
        Candidate { id, overlap_blocks: overlap, active_prefill_tokens: prefill, active_blocks: active, ..Default::default() }
    }

    #[test]
    fn costs_within_a_fifth_of_a_step_go_to_the_worker_with_fewer_requests_in_flight() {
        let r = req(1024);
        // Both workers step every 40 ms (measured); worker 1 holds more of the prompt, so it
        // is cheaper, but it runs five requests against worker 0's one.
        let c = |id, overlap, in_flight| Candidate { step_ms: 40.0, in_flight, ..cand(id, overlap, 0, 0) };
        let time = |tie_steps| KvPolicy::new(KvParams { tie_steps, ..KvParams::default() });
        let costs = |p: &KvPolicy, cs: &[Candidate]| cs.iter().map(|c| p.cost(&r, c).0).collect::<Vec<_>>();
        let near = [c(0, 60, 1), c(1, 62, 5)];
        let gap = costs(&time(0.0), &near);
        assert!(gap[1] < gap[0] && gap[0] - gap[1] < 8.0, "{gap:?}");
        assert_eq!(time(0.0).choose(&r, &near), Decision::Worker(1), "only equal costs tie");
        assert_eq!(KvParams::default().tie_steps, 0.2, "a fifth of a step by default");
        assert_eq!(time(0.2).choose(&r, &near), Decision::Worker(0), "within a fifth of a step: fewer in flight");
        // Further apart than a fifth of a step, the cheaper worker wins whatever it runs.
        let far = [c(0, 0, 1), c(1, 62, 5)];
        let gap = costs(&time(0.0), &far);
        assert!(gap[0] - gap[1] > 8.0, "{gap:?}");
        assert_eq!(time(0.2).choose(&r, &far), Decision::Worker(1));
        // A worker ruled out (an infinite cost) never ties, and the `blocks` cost ties only
        // equal costs.
        assert_eq!(time(0.2).cheapest(&near, &[10.0, f64::INFINITY]), Decision::Worker(0));
        let blocks = KvPolicy::new(KvParams { block_size: 1, ..blocks() });
        let by_blocks = [Candidate { in_flight: 5, ..cand(0, 0, 100, 0) }, Candidate { in_flight: 1, ..cand(1, 0, 101, 0) }];
        assert_eq!(blocks.choose(&RequestSummary { prompt_tokens: 0, prompt_blocks: 0, ..req(0) }, &by_blocks), Decision::Worker(0));
    }

    #[test]
    fn matches_the_seed_example() {
        // The Dynamo KV router guide's example: worker costs 18, 10, 11 → worker 2 (index 1).
        // Build candidates whose terms are (prefill 8, decode 10), (5, 5), (2, 9) for a 0-block
        // request.
        let p = KvPolicy::new(KvParams { block_size: 1, ..blocks() });
        let r = RequestSummary { prompt_tokens: 0, prompt_blocks: 0, ..req(0) };
        let c = [cand(1, 0, 8, 10), cand(2, 0, 5, 5), cand(3, 0, 2, 9)];
        let costs: Vec<f64> = c.iter().map(|c| p.cost(&r, c).0).collect();
        assert_eq!(costs, vec![18.0, 10.0, 11.0]);
        assert_eq!(p.choose(&r, &c), Decision::Worker(1));
    }

    #[test]
    fn cached_prefix_wins_until_its_worker_is_loaded() {
        let p = KvPolicy::new(blocks());
        let r = req(1024); // 64 blocks
        // Worker 0 holds 60 of them.
        assert_eq!(p.choose(&r, &[cand(0, 60, 0, 0), cand(1, 0, 0, 0)]), Decision::Worker(0));
        // Loaded with 4,000 prefill tokens and 200 active blocks, it loses.
        assert_eq!(p.choose(&r, &[cand(0, 60, 4000, 200), cand(1, 0, 0, 0)]), Decision::Worker(1));
    }

    #[test]
    fn a_long_answer_leaves_a_crowded_batch_holding_its_prefix_and_a_short_one_stays() {
        // Worker 0 holds the whole 2,048-token prompt but decodes 24 requests over 2k-token
        // contexts (a step of 8.7 ms against 6 ms); worker 1 is idle and holds nothing.
        let p = KvPolicy::new(KvParams { pricing: Pricing { decode: true, ..Pricing::default() }, ..KvParams::default() });
        let crowded = Candidate { id: 0, overlap_blocks: 128, in_flight: 24, active_blocks: 24 * 128, ..Default::default() };
        let idle = Candidate { id: 1, ..Default::default() };
        // A ms of end to end worth half a ms of first token (`v`: the model's mean TTFT over
        // its mean end to end).
        let asking = |out: f64| RequestSummary { expected_output_tokens: out, mean_output_tokens: 200.0, e2e_weight: 0.5, ..req(2048) };
        assert_eq!(p.choose(&asking(16.0), &[crowded.clone(), idle.clone()]), Decision::Worker(0), "a short answer goes where its prefix is");
        assert_eq!(p.choose(&asking(1000.0), &[crowded.clone(), idle.clone()]), Decision::Worker(1), "a long one leaves the crowded batch");
        // Where the end to end is worth far less than the first token, the long one stays too.
        let cheap = RequestSummary { e2e_weight: 0.05, ..asking(1000.0) };
        assert_eq!(p.choose(&cheap, &[crowded.clone(), idle.clone()]), Decision::Worker(0), "its decode is worth less than the prefill it saves");
        assert_eq!(p.choose(&asking(0.0), &[crowded.clone(), idle.clone()]), Decision::Worker(0), "an unknown length prices no decode");
        let off = KvPolicy::new(KvParams::default());
        assert_eq!(off.choose(&asking(1000.0), &[crowded, idle]), Decision::Worker(0), "price_decode off (the default for now) is #14's cost");
    }

    #[test]
    fn objectives_price_each_predicted_miss_in_the_cost() {
        // Worker 0 holds the prompt but steps in ~8.8 ms with this request added; worker 1 is
        // idle (~6.1 ms) but must prefill all 2,048 tokens, and copy a prefix worker 0 holds:
        // ~150 ms dearer.
        let p = KvPolicy::new(KvParams::default());
        let crowded = Candidate { id: 0, overlap_blocks: 128, in_flight: 24, active_blocks: 24 * 128, ..Default::default() };
        let idle = Candidate { id: 1, ..Default::default() };
        let both = [crowded, idle];
        // `tpot_weight`: what a ms of TPOT is worth in TTFT (the bounds' ratio when both are set).
        let with =
            |ttft: Option<f64>, tpot: Option<f64>, tpot_weight: f64| RequestSummary { slo: Slo { ttft_ms: ttft, tpot_ms: tpot }, tpot_weight, ..req(2048) };
        assert_eq!(p.choose(&with(None, None, 0.0), &both), Decision::Worker(0), "no objective: the cheapest, where the prefix is");
        assert_eq!(p.choose(&with(None, Some(8.0), 1000.0), &both), Decision::Worker(1), "0.8 ms over 8 ms a token, at 1,000 ms each");
        assert_eq!(p.choose(&with(None, Some(8.0), 20.0), &both), Decision::Worker(0), "at 20 ms each, less than the prefill it saves");
        assert_eq!(p.choose(&with(Some(1000.0), Some(10.0), 100.0), &both), Decision::Worker(0), "both met everywhere: the cheapest");
        assert_eq!(p.choose(&with(None, Some(5.0), 1000.0), &both), Decision::Worker(1), "neither meets 5 ms: the one missing it least");
        assert_eq!(p.choose(&with(Some(50.0), Some(8.0), 50.0 / 8.0), &both), Decision::Worker(0), "a 10% TPOT miss over a 60% TTFT miss");
        // The penalty is the excess in ms of TTFT.
        let slo = Slo { ttft_ms: Some(50.0), tpot_ms: Some(8.0) };
        assert!((slo.excess_ms(80.0, 9.0, 6.25) - (30.0 + 6.25)).abs() < 1e-9);
    }

    #[test]
    fn weight_zero_is_pure_load_balancing() {
        let p = KvPolicy::new(KvParams { overlap_score_weight: 0.0, ..blocks() });
        let r = req(1024);
        assert_eq!(p.choose(&r, &[cand(0, 64, 0, 10), cand(1, 0, 0, 5)]), Decision::Worker(1));
    }

    #[test]
    fn without_active_block_tracking_only_prefill_counts() {
        let p = KvPolicy::new(KvParams { track_active_blocks: false, ..blocks() });
        let r = req(1024);
        assert_eq!(p.blocks_cost(&r, &cand(0, 0, 0, 500)).1, 0.0);
        // 500 active blocks would lose without the switch; prefill alone decides.
        assert_eq!(p.choose(&r, &[cand(0, 32, 0, 500), cand(1, 0, 0, 0)]), Decision::Worker(0));
    }

    #[test]
    fn ties_spread_over_equal_workers() {
        let p = KvPolicy::new(blocks());
        let mut seen = [0; 3];
        for _ in 0..300 {
            let Decision::Worker(i) = p.choose(&req(160), &[cand(0, 0, 0, 0), cand(1, 0, 0, 0), cand(2, 0, 0, 0)]) else { panic!() };
            seen[i] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
        // Fewer requests in flight breaks a cost tie first.
        let mut c = [cand(0, 0, 0, 0), cand(1, 0, 0, 0)];
        c[0].in_flight = 3;
        assert_eq!(p.choose(&req(160), &c), Decision::Worker(1));
    }

    #[test]
    fn temperature_samples_cheaper_workers_more_often() {
        let p = KvPolicy::new(KvParams { temperature: 0.5, ..blocks() });
        let c = [cand(0, 60, 0, 0), cand(1, 0, 0, 0)];
        let mut n0 = 0;
        for _ in 0..2000 {
            if p.choose(&req(1024), &c) == Decision::Worker(0) {
                n0 += 1;
            }
        }
        // Normalized costs 0 and 1 → p0 = 1 / (1 + e^-2) ≈ 0.88.
        assert!((1600..1900).contains(&n0), "{n0}");
    }

    #[test]
    fn time_prefers_the_cached_worker_while_its_queue_is_comparable() {
        let p = KvPolicy::new(KvParams::default());
        let r = req(4096);
        // Worker 0 holds 3,072 of the prompt's tokens and has a little more queued.
        let cached = Candidate { overlap_blocks: 192, active_prefill_tokens: 2000, prefill_backlog_ms: 70.0, ..cand(0, 192, 2000, 0) };
        let cold = Candidate { prefill_backlog_ms: 52.0, ..cand(1, 0, 1500, 0) };
        assert_eq!(p.choose(&r, &[cached.clone(), cold.clone()]), Decision::Worker(0));
        // A queue far longer than the prefill the cache saves sends it to the cold worker.
        let swamped = Candidate { active_prefill_tokens: 40_000, prefill_backlog_ms: 1400.0, ..cached };
        assert_eq!(p.choose(&r, &[swamped, cold]), Decision::Worker(1));
    }

    #[test]
    fn time_spreads_a_hot_prefix_once_its_worker_is_saturated() {
        // 60 requests sharing an 8,192-token prefix that worker 0 caches, each with 512 new
        // tokens. Each choice is booked the way the gateway books it (its new tokens and its
        // predicted prefill time on the chosen worker; the prefix then counts as being computed
        // there).
        let p = KvPolicy::new(KvParams::default());
        let r = req(8192 + 512);
        let mut c: Vec<Candidate> = (0..4).map(|i| cand(i, if i == 0 { 512 } else { 0 }, 0, 0)).collect();
        let mut chosen = [0; 4];
        for _ in 0..60 {
            let Decision::Worker(i) = p.choose(&r, &c) else { panic!() };
            let (_, Terms::Time(t)) = p.cost(&r, &c[i]) else { panic!() };
            chosen[i] += 1;
            c[i].in_flight += 1;
            c[i].prefilling += 1;
            #[allow(clippy::cast_sign_loss, reason = "a predicted token count: not negative")]
            let new_tokens = t.new_tokens as u64;
            c[i].active_prefill_tokens += new_tokens;
            c[i].prefill_backlog_ms += t.own_ms;
            // The shared prefix is booked there now; each request's own 512 tokens differ.
            c[i].active_overlap_blocks = 512;
            c[i].active_blocks += u64::from(r.prompt_blocks);
        }
        assert!(chosen[0] >= 20, "the cached worker takes the first requests: {chosen:?}");
        assert!(chosen.iter().all(|&n| n > 0), "then the prefix spreads: {chosen:?}");
        // Cache-greedy routing would have sent all 60 to worker 0; balance without the cache,
        // 15 each.
    }

    #[test]
    fn temperature_applies_to_the_time_cost_too() {
        let p = KvPolicy::new(KvParams { temperature: 0.5, ..KvParams::default() });
        let c = [cand(0, 60, 0, 0), cand(1, 0, 0, 0)];
        let n0 = (0..2000).filter(|_| p.choose(&req(1024), &c) == Decision::Worker(0)).count();
        assert!((1600..1900).contains(&n0), "{n0}");
    }

    #[test]
    fn near_saturation_a_prefix_stays_where_it_is_cached_but_an_idle_worker_takes_it() {
        let p = KvPolicy::new(KvParams::default());
        let myopic = KvPolicy::new(KvParams { pricing: Pricing { queue: false, duplicates: false, ..Pricing::default() }, ..KvParams::default() });
        let r = req(4096);
        // Both workers have 10 requests queued; the cached one a longer wait.
        let cached = Candidate { prefilling: 10, prefill_backlog_ms: 300.0, ..cand(0, 192, 20_000, 0) };
        let cold = Candidate { prefilling: 10, prefill_backlog_ms: 100.0, ..cand(1, 0, 20_000, 0) };
        assert_eq!(myopic.choose(&r, &[cached.clone(), cold.clone()]), Decision::Worker(1), "its own TTFT alone says move");
        assert_eq!(p.choose(&r, &[cached.clone(), cold]), Decision::Worker(0), "computing the prefix again delays the 10 queued there");
        let idle = cand(1, 0, 0, 0);
        assert_eq!(p.choose(&r, &[cached, idle]), Decision::Worker(1));
    }

    #[test]
    fn a_prefix_is_not_copied_to_a_worker_only_a_little_less_busy() {
        let p = KvPolicy::new(KvParams::default());
        let copying = KvPolicy::new(KvParams { pricing: Pricing { duplicates: false, ..Pricing::default() }, ..KvParams::default() });
        let r = req(4096);
        // Nothing queued anywhere; the worker holding 3,072 of the 4,096 tokens has 40 ms more
        // prefill booked than an empty one. Its own TTFT alone says copy the prefix over (the
        // copy is ~110 ms of prefill against the 40 ms wait plus ~36 ms for the rest); the caches
        // would then hold it twice.
        let holder = Candidate { prefill_backlog_ms: 40.0, ..cand(0, 192, 2_000, 0) };
        let empty = cand(1, 0, 0, 0);
        assert_eq!(copying.choose(&r, &[holder.clone(), empty.clone()]), Decision::Worker(0), "even without the price, a short wait keeps it");
        let long = Candidate { prefill_backlog_ms: 120.0, ..cand(0, 192, 6_000, 0) };
        assert_eq!(copying.choose(&r, &[long.clone(), empty.clone()]), Decision::Worker(1), "its own TTFT alone: copy it");
        assert_eq!(p.choose(&r, &[long.clone(), empty.clone()]), Decision::Worker(0), "the copy's price keeps it where it is cached");
        // A hot prefix (requests in flight on the holder share it) copied into an empty cache
        // (its events hold nothing of its 16,384 blocks) evicts nothing: its own TTFT decides
        // again. A full cache keeps the price, and so does a prefix nobody is using now.
        let room = |free| Candidate { total_blocks: 16_384, cache_room_blocks: Some(free), ..empty.clone() };
        let shared = Candidate { active_overlap_blocks: 192, ..long.clone() };
        assert_eq!(p.choose(&r, &[shared.clone(), room(16_384)]), Decision::Worker(1), "a hot prefix's copy into free room evicts nothing");
        assert_eq!(p.choose(&r, &[shared, room(0)]), Decision::Worker(0), "a copy into a full cache evicts");
        assert_eq!(p.choose(&r, &[long.clone(), room(16_384)]), Decision::Worker(0), "nobody is using the prefix now");
        // A wait longer than a prefill there plus the copy's price sends it elsewhere anyway.
        let swamped = Candidate { prefill_backlog_ms: 600.0, ..cand(0, 192, 30_000, 0) };
        assert_eq!(p.choose(&r, &[swamped, empty]), Decision::Worker(1));
    }

    #[test]
    fn a_request_gives_up_at_most_its_bound_of_first_token_for_the_stall_it_saves() {
        let unbounded = KvPolicy::new(KvParams { ttft_trade_ratio: 0.0, ..KvParams::default() });
        let bounded = KvPolicy::new(KvParams::default());
        let r = RequestSummary { tpot_weight: 20.0, ..req(16_384) };
        // An idle worker whose prefill would stall eight short answers, and one whose prefill
        // backlog is a full second longer but where nothing decodes.
        let stalling = Candidate { in_flight: 8, decode_sensitivity: 8.0 / 20.0, ..cand(0, 0, 0, 0) };
        let queued = Candidate { prefill_backlog_ms: 1000.0, prefilling: 1, ..cand(1, 0, 16_384, 0) };
        let c = [stalling, queued];
        assert_eq!(unbounded.choose(&r, &c), Decision::Worker(1), "the stall priced past a second of its own wait");
        assert_eq!(bounded.choose(&r, &c), Decision::Worker(0), "a second is more than half of its least first token");
        // Within the bound the trade stands: half a second more than its least is allowed.
        let near = Candidate { prefill_backlog_ms: 300.0, prefilling: 1, ..cand(1, 0, 16_384, 0) };
        assert_eq!(bounded.choose(&r, &[c[0].clone(), near]), Decision::Worker(1));
        // A TTFT objective widens the bound to itself, and a draw at a temperature never takes
        // a worker past the bound.
        let held = RequestSummary { slo: Slo { ttft_ms: Some(5000.0), tpot_ms: None }, ..r.clone() };
        assert_eq!(bounded.choose(&held, &c), Decision::Worker(1), "within its own objective the trade stands");
        let warm = KvPolicy::new(KvParams { temperature: 1.0, ..KvParams::default() });
        assert!((0..200).all(|_| warm.choose(&r, &c) == Decision::Worker(0)));
    }
}
