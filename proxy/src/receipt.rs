//! The route receipt: every placement decision a request got — the candidates considered with
//! their inputs (and, for `kv`, their cost terms), the plugin's answer or why the fallback
//! decided, the workers left out and why, the chosen worker, and how its leg ended. Kept with
//! the request in the in-flight registry, so `GET /requests/{id}` answers "why did this request
//! go there?" while it runs and after it finished.

use crate::error::LegErrorKind;
use crate::fleet::Worker;
use kvgate_filters::route::{Candidate, KvParams, KvPolicy, RequestSummary, Slo, Terms};
use serde_json::{Value, json};
use std::sync::Arc;

/// Why a worker was not a candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exclusion {
    /// Failing health checks.
    Unhealthy,
    /// Over a busy threshold while others were not.
    Busy,
    /// Already tried by this request (or the worker a stream is moving away from).
    Tried,
    /// A move aimed at another worker.
    NotTheTarget,
    /// Its model cards do not list the LoRA adapter the request names.
    NoAdapter,
    /// Paused by a fleet operation.
    Paused,
    /// Its role does not serve this leg (a prefill worker for an answer, or a decode worker
    /// for a prefill leg).
    Role,
}

impl Exclusion {
    fn name(self) -> &'static str {
        match self {
            Self::Unhealthy => "unhealthy",
            Self::Busy => "busy",
            Self::Tried => "tried",
            Self::NotTheTarget => "not_the_target",
            Self::NoAdapter => "no_adapter",
            Self::Paused => "paused",
            Self::Role => "role",
        }
    }
}

/// Who took the decision.
#[derive(Debug, Clone, PartialEq)]
pub enum DecidedBy {
    /// A built-in mode (`round_robin`, `random`, `kv`).
    Builtin(&'static str),
    /// A WebAssembly plugin.
    Plugin(String),
    /// The plugin failed and its fallback mode decided.
    Fallback { plugin: String, mode: &'static str, failure: String },
    /// One worker only could take it (the worker holding its stored response, or the one a move
    /// was aimed at): nothing was asked.
    Pinned,
}

/// One placement.
#[derive(Debug, Clone)]
pub struct Placement {
    /// 1 for the first attempt.
    pub attempt: u32,
    /// Who decided.
    pub decided_by: DecidedBy,
    /// The model's workers when it was decided: the ids below index them (a reload between
    /// two placements of one request renumbers the fleet).
    pub workers: Arc<[Arc<Worker>]>,
    /// The candidates as routing saw them.
    pub candidates: Vec<Candidate>,
    /// Workers left out, by id.
    pub excluded: Vec<(u32, Exclusion)>,
    /// The chosen worker's id, if a worker was chosen.
    pub chosen: Option<u32>,
    /// The `kv` cost's parameters, when the kv cost was in play (to show its terms).
    pub kv: Option<KvParams>,
    /// Prompt tokens and full blocks routing saw.
    pub prompt: (u32, u32),
    /// What routing expected of the request's output.
    pub output: OutputOutlook,
    /// The request's latency objectives (the `time` cost priced each worker's predicted miss of
    /// them).
    pub slo: Slo,
    /// Its pass through the chosen worker's prefill gate, when it went through one.
    pub gate: Option<GateWait>,
    /// How the leg to the chosen worker ended.
    pub outcome: Option<LegOutcome>,
}

/// How a long prompt passed its worker's prefill gate (`routing.prefill_gate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateWait {
    /// How long it was held.
    pub waited: std::time::Duration,
    /// Whether it got its pass (else it went when its wait ran out, or the gate held no pass
    /// for it).
    pub passed: bool,
    /// Whether the next long prompt waits for its last step or first token (its expected output
    /// carries the room of its last step).
    pub keeps_last_step: bool,
}

impl GateWait {
    fn to_json(self) -> Value {
        json!({"waited_ms": self.waited.as_secs_f64() * 1000.0, "passed": self.passed, "keeps_last_step": self.keeps_last_step})
    }
}

/// How a placement's leg ended, as its receipt shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegOutcome {
    /// The worker answered, and its answer went to the client (`ok`).
    Answered,
    /// A move order sent the request elsewhere before its first byte (`moved`).
    Moved,
    /// A prefill leg computed the prompt's KV for the decode leg (`prefilled`).
    Prefilled,
    /// A prefill leg failed; the request was served aggregated (`prefill_failed`).
    PrefillFailed,
    /// The leg failed (its error kind's label, as `kvgate_upstream_errors_total` counts it).
    Failed(LegErrorKind),
}

impl LegOutcome {
    /// The receipt's `outcome` value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Answered => "ok",
            Self::Moved => "moved",
            Self::Prefilled => "prefilled",
            Self::PrefillFailed => "prefill_failed",
            Self::Failed(kind) => kind.label(),
        }
    }
}

/// What routing expected of a request's output when it placed it: what the `time` cost's
/// decode and slowdown terms read (0: unknown).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OutputOutlook {
    /// Output tokens expected of the request.
    pub expected_tokens: f64,
    /// The model's recent mean output tokens.
    pub mean_tokens: f64,
    /// What a ms of time per output token weighed, in ms of time to first token.
    pub tpot_weight: f64,
    /// What a ms of end to end weighed, in ms of time to first token.
    pub e2e_weight: f64,
}

impl OutputOutlook {
    /// The outlook `summary` carries.
    pub fn of(summary: &RequestSummary<'_>) -> Self {
        Self {
            expected_tokens: summary.expected_output_tokens,
            mean_tokens: summary.mean_output_tokens,
            tpot_weight: summary.tpot_weight,
            e2e_weight: summary.e2e_weight,
        }
    }
}

/// A request's wait in the router queue, before its first placement.
#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    /// How long it waited.
    pub waited: std::time::Duration,
    /// Its priority band.
    pub band: u8,
    /// Its tenant, when the gateway has tenants.
    pub tenant: Option<String>,
    /// How the wait ended.
    pub ended: QueueEnd,
    /// When it ended, each tenant of its band with requests waiting (and its own): counter
    /// (tokens served over weight, as the queue orders by it), requests waiting, whether it is
    /// the request's tenant.
    pub standing: Vec<(f64, usize, bool)>,
}

/// How a wait in the router queue ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueEnd {
    /// Released to be placed.
    Released,
    /// Refused by the queue.
    Refused(kvgate_filters::route::QueueError),
    /// The client left.
    ClientLeft,
}

impl QueueEnd {
    /// Its name in receipts and spans.
    pub fn label(self) -> &'static str {
        use kvgate_filters::route::QueueError;
        match self {
            Self::ClientLeft => "client_left",
            Self::Released => "released",
            Self::Refused(QueueError::Full) => "full",
            Self::Refused(QueueError::TimedOut) => "timed_out",
            Self::Refused(QueueError::Shed) => "shed_for_a_higher_band",
        }
    }
}

impl Queued {
    /// JSON for the admin API.
    pub fn to_json(&self) -> Value {
        let ended = self.ended.label();
        json!({
            "why": "every worker was past routing.queue_threshold",
            "waited_ms": self.waited.as_secs_f64() * 1000.0,
            "band": self.band,
            "tenant": self.tenant,
            "ended": ended,
            "band_standing": self.standing.iter().map(|(c, n, own)| json!({"counter": c, "waiting": n, "own": own})).collect::<Vec<_>>(),
        })
    }
}

/// Every placement of one request.
#[derive(Debug, Clone, Default)]
pub struct RouteReceipt {
    /// Its tenant, when the gateway has tenants.
    pub tenant: Option<String>,
    /// Its wait in the router queue, when it had to wait.
    pub queued: Option<Queued>,
    /// In attempt order.
    pub placements: Vec<Placement>,
}

impl RouteReceipt {
    /// Records how the last placement's leg ended.
    pub fn leg_ended(&mut self, outcome: LegOutcome) {
        if let Some(p) = self.placements.last_mut() {
            p.outcome = Some(outcome);
        }
    }

    /// JSON for the admin API, worker ids resolved to URLs.
    pub fn to_json(&self) -> Value {
        Value::Array(self.placements.iter().map(Placement::to_json).collect())
    }
}

impl Placement {
    fn to_json(&self) -> Value {
        let url = |id: u32| self.workers.get(id as usize).map(|w| w.label.clone());
        let policy = self.kv.map(KvPolicy::new);
        let req = RequestSummary {
            prompt_tokens: self.prompt.0,
            prompt_blocks: self.prompt.1,
            expected_output_tokens: self.output.expected_tokens,
            mean_output_tokens: self.output.mean_tokens,
            tpot_weight: self.output.tpot_weight,
            e2e_weight: self.output.e2e_weight,
            slo: self.slo,
            ..RequestSummary::default()
        }
        .among(&self.candidates);
        // Each candidate priced once: its terms and the trade bound below read the same prediction.
        let priced: Vec<Option<(f64, Terms)>> = self.candidates.iter().map(|c| policy.as_ref().map(|p| p.cost(&req, c))).collect();
        let candidates: Vec<Value> = self
            .candidates
            .iter()
            .zip(&priced)
            .map(|(c, priced)| {
                let mut v = json!({
                    "worker": c.id, "url": url(c.id), "in_flight": c.in_flight, "overlap_blocks": c.overlap_blocks,
                    "active_overlap_blocks": c.active_overlap_blocks, "active_prefill_tokens": c.active_prefill_tokens,
                    "active_blocks": c.active_blocks, "kv_usage": c.kv_usage, "waiting": c.waiting, "busy": c.busy,
                });
                if let Some((cost, terms)) = priced {
                    match terms {
                        Terms::Blocks { prefill_blocks, decode_blocks } => {
                            v["prefill_blocks"] = json!(prefill_blocks);
                            v["decode_blocks"] = json!(decode_blocks);
                        }
                        Terms::Time(t) => {
                            v["prefill_backlog_ms"] = json!(c.prefill_backlog_ms);
                            v["prefill_load"] = json!(c.prefill_load);
                            v["new_tokens"] = json!(t.new_tokens);
                            v["wait_ms"] = json!(t.wait_ms);
                            v["prefill_ms"] = json!(t.prefill_ms);
                            v["steps_ms"] = json!(t.steps_ms);
                            v["join_ms"] = json!(t.join_ms);
                            v["running_step_ms"] = json!(c.running_step_ms);
                            v["next_step_tokens"] = json!(c.next_step_tokens);
                            v["total_blocks"] = json!(c.total_blocks);
                            v["cache_room_blocks"] = json!(c.cache_room_blocks);
                            v["duplicate_ms"] = json!(t.duplicate_ms);
                            v["slowdown_ms"] = json!(t.slowdown_ms);
                            v["stall_share"] = json!(t.stall_share);
                            v["ttft_ms"] = json!(t.ttft_ms());
                            v["decode_sensitivity"] = json!(c.decode_sensitivity);
                            v["behind_ms"] = json!(t.behind_ms);
                            v["ahead_ms"] = json!(t.ahead_ms);
                            v["decode_ms"] = json!(t.decode_ms);
                            v["imposed_ms"] = json!(t.imposed_ms);
                            v["decode_weight"] = json!(t.decode_weight);
                            v["tpot_ms"] = json!(t.tpot_ms);
                            if self.slo.is_set() {
                                v["slo_violation"] = json!(self.slo.violation(t.ttft_ms(), t.tpot_ms));
                            }
                        }
                    }
                    v["cost"] = json!(*cost);
                }
                v
            })
            .collect();
        // The trade bound the choice was made under: a candidate whose `ttft_ms` is past it was
        // not chosen, whatever its cost.
        let kv_decided = match &self.decided_by {
            DecidedBy::Builtin(mode) | DecidedBy::Fallback { mode, .. } => *mode == "kv",
            DecidedBy::Plugin(_) | DecidedBy::Pinned => false,
        };
        let ttfts = priced.iter().flatten().filter_map(|(_, terms)| terms.ttft_ms());
        let ttft_limit = policy.as_ref().filter(|_| kv_decided).and_then(|p| p.ttft_limit(&req, ttfts));
        let excluded: Vec<Value> = self.excluded.iter().map(|(id, why)| json!({"worker": id, "url": url(*id), "reason": why.name()})).collect();
        let decided_by = match &self.decided_by {
            DecidedBy::Builtin(mode) => json!({"mode": mode}),
            DecidedBy::Plugin(name) => json!({"plugin": name}),
            DecidedBy::Fallback { plugin, mode, failure } => json!({"plugin": plugin, "fallback": mode, "failure": failure}),
            DecidedBy::Pinned => json!({"pinned": true}),
        };
        json!({
            "attempt": self.attempt, "decided_by": decided_by, "prompt_tokens": self.prompt.0, "prompt_blocks": self.prompt.1,
            "expected_output_tokens": self.output.expected_tokens, "mean_output_tokens": self.output.mean_tokens,
            "tpot_weight": self.output.tpot_weight, "e2e_weight": self.output.e2e_weight, "ttft_limit_ms": ttft_limit,
            "candidates": candidates, "excluded": excluded,
            "chosen": self.chosen.map(|id| json!({"worker": id, "url": url(id)})), "prefill_gate": self.gate.map(GateWait::to_json),
            "outcome": self.outcome.map(LegOutcome::label),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receipt_explains_the_choice_with_cost_terms_and_exclusions() {
        let w = |p: u16| Arc::new(Worker::new(crate::config::UpstreamUrl::parse(&format!("http://127.0.0.1:{p}")).unwrap()));
        let mut r = RouteReceipt::default();
        r.placements.push(Placement {
            attempt: 1,
            workers: Arc::from(vec![w(1), w(2), w(3)]),
            decided_by: DecidedBy::Builtin("kv"),
            candidates: vec![
                Candidate { id: 0, overlap_blocks: 4, ..Candidate::default() },
                Candidate { id: 2, active_prefill_tokens: 64, ..Candidate::default() },
            ],
            excluded: vec![(1, Exclusion::Unhealthy)],
            chosen: Some(0),
            kv: Some(KvParams { block_size: 16, cost: kvgate_filters::route::Cost::Blocks, ..KvParams::default() }),
            prompt: (64, 4),
            output: OutputOutlook { expected_tokens: 64.0, mean_tokens: 200.0, tpot_weight: 12.5, e2e_weight: 0.05 },
            slo: Slo::default(),
            gate: None,
            outcome: None,
        });
        r.leg_ended(LegOutcome::Answered);
        let v = r.to_json();
        assert_eq!(v[0]["chosen"]["url"], "http://127.0.0.1:1");
        assert_eq!(v[0]["excluded"][0]["reason"], "unhealthy");
        assert_eq!((v[0]["expected_output_tokens"].as_f64(), v[0]["mean_output_tokens"].as_f64()), (Some(64.0), Some(200.0)));
        assert_eq!(v[0]["tpot_weight"], 12.5, "what a ms of TPOT weighed");
        assert_eq!(v[0]["candidates"][0]["cost"], 4.0, "cached prompt: only its 4 decode blocks");
        assert_eq!(v[0]["candidates"][1]["cost"], 12.0, "8 prefill blocks (64 booked + 64 new) + 4 decode");
        assert_eq!(v[0]["outcome"], "ok");
        assert_eq!(v[0]["e2e_weight"], 0.05, "what a ms of end to end weighed");
        assert!(v[0]["ttft_limit_ms"].is_null(), "the blocks cost has no trade bound");
        // Under the time cost, each candidate's predicted TTFT beside the bound it was chosen under.
        r.placements[0].kv = Some(KvParams { block_size: 16, ..KvParams::default() });
        let v = r.to_json();
        let least = (0..2).map(|i| v[0]["candidates"][i]["ttft_ms"].as_f64().unwrap()).fold(f64::INFINITY, f64::min);
        assert!((v[0]["ttft_limit_ms"].as_f64().unwrap() - (least + (least * 0.5).max(200.0))).abs() < 1e-9, "{v}");
        assert_eq!(v[0]["candidates"][0]["stall_share"], 1.0, "an idle fleet: no worker busier than the rest");
    }
}
