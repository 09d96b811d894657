//! Prefill/decode disaggregation metrics (`kvgate_disagg_*`): how each request ran (in
//! two legs, or aggregated and why), and its time to first token split into the prefill leg
//! and the decode leg's first token (the KV transfer and one decode step).

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

/// Seconds a prefill leg or a decode leg's first token may take: a short prompt's
/// milliseconds to a long document's prefill behind a queue.
const LEG_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// The disaggregation series, by model.
#[derive(Clone)]
pub struct DisaggMetrics {
    /// `kvgate_disagg_requests_total{model,path,reason}`: requests of a model with prefill
    /// workers, by how they ran: `path` `disaggregated` (reason `prefilled`) or `aggregated`
    /// (reason: `short_prompt`, `endpoint`, `client_params`, `not_json`, `no_prefill_worker`,
    /// `prefill_busy`, `prefill_failed`).
    pub requests: IntCounterVec,
    /// `kvgate_disagg_decisions_total{model,role}`: placements on a model with prefill
    /// workers, by the chosen worker's role (a prefill leg's are `prefill`).
    pub decisions: IntCounterVec,
    /// `kvgate_disagg_prefill_leg_seconds{model}`: from sending the prefill leg to its
    /// answer with the transfer parameters.
    pub prefill_leg: HistogramVec,
    /// `kvgate_disagg_decode_first_token_seconds{model}`: from the prefill leg's answer to
    /// the decode leg's first streamed token (placement, the KV pull, the first decode step).
    pub decode_first_token: HistogramVec,
}

impl DisaggMetrics {
    /// Creates and registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let hist = |name: &str, help: &str| {
            let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(LEG_BUCKETS.to_vec()), &["model"]).expect("valid metric");
            registry.register(Box::new(h.clone())).expect("unique metric");
            h
        };
        let requests = IntCounterVec::new(
            Opts::new("kvgate_disagg_requests_total", "Requests of a model with prefill workers: run in two legs (disaggregated) or aggregated, by reason."),
            &["model", "path", "reason"],
        )
        .expect("valid metric");
        registry.register(Box::new(requests.clone())).expect("unique metric");
        let decisions = IntCounterVec::new(
            Opts::new("kvgate_disagg_decisions_total", "Placements on a model with prefill workers, by the chosen worker's role."),
            &["model", "role"],
        )
        .expect("valid metric");
        registry.register(Box::new(decisions.clone())).expect("unique metric");
        Self {
            requests,
            decisions,
            prefill_leg: hist(
                "kvgate_disagg_prefill_leg_seconds",
                "Prefill leg: from its request to the prefill worker's answer with the KV transfer parameters.",
            ),
            decode_first_token: hist(
                "kvgate_disagg_decode_first_token_seconds",
                "From the prefill leg's answer to the decode leg's first streamed token (KV transfer and first decode step).",
            ),
        }
    }
}
