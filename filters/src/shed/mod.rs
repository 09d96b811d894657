//! Load shedding (Dynamo's request rejection): a worker is busy when its load crosses a
//! configured threshold, a worker with several DP ranks only when all its ranks are; busy
//! workers get no new requests in any routing mode, and when every worker of a model is busy
//! the request is refused with HTTP 503 and [`REJECTION_BODY`].
//!
//! A rank is busy when any configured threshold is crossed (OR):
//! - `active_decode_blocks_threshold` (fraction): KV blocks in use over its total, taking the
//!   larger of the gateway's own bookings and the usage the worker reports
//!   (`vllm:kv_cache_usage_perc`), so a low estimate never hides a worker that is really full;
//! - `active_prefill_tokens_threshold`: prefill tokens booked on it;
//! - `active_prefill_tokens_threshold_frac`: prefill tokens booked over its
//!   `max_num_batched_tokens`.

use serde::{Deserialize, Serialize};

/// The body of the 503 sent when every worker is busy, exactly as Dynamo's load shedding specifies.
pub const REJECTION_BODY: &str =
    r#"{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":503}"#;

/// Busy thresholds of a model (all optional; none set = never busy).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Thresholds {
    /// Fraction (0..=1) of KV blocks in use.
    #[serde(alias = "active-decode-blocks-threshold")]
    pub active_decode_blocks_threshold: Option<f64>,
    /// Booked prefill tokens.
    #[serde(alias = "active-prefill-tokens-threshold")]
    pub active_prefill_tokens_threshold: Option<u64>,
    /// Booked prefill tokens as a fraction of `max_num_batched_tokens`.
    #[serde(alias = "active-prefill-tokens-threshold-frac")]
    pub active_prefill_tokens_threshold_frac: Option<f64>,
}

impl Thresholds {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(t) = self.active_decode_blocks_threshold
            && !(t.is_finite() && (0.0..=1.0).contains(&t))
        {
            return Err(format!("active_decode_blocks_threshold must be within [0, 1], got {t}"));
        }
        if let Some(f) = self.active_prefill_tokens_threshold_frac
            && !(f.is_finite() && f >= 0.0)
        {
            return Err(format!("active_prefill_tokens_threshold_frac must be >= 0, got {f}"));
        }
        Ok(())
    }

    /// Whether any threshold is set.
    pub fn enabled(&self) -> bool {
        self.active_decode_blocks_threshold.is_some() || self.active_prefill_tokens_threshold.is_some() || self.active_prefill_tokens_threshold_frac.is_some()
    }
}

/// One DP rank's load, as routing sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankLoad {
    /// Prefill tokens booked by the gateway.
    pub booked_prefill_tokens: u64,
    /// KV blocks booked by the gateway.
    pub booked_blocks: u64,
    /// The rank's KV capacity in blocks (0 = unknown).
    pub total_blocks: u64,
    /// `vllm:kv_cache_usage_perc` as last polled (None = not polled yet).
    pub reported_kv_usage: Option<f64>,
    /// The rank's `max_num_batched_tokens` (0 = unknown: the fraction check is off).
    pub max_num_batched_tokens: u64,
}

/// Whether one rank is busy under `t`.
pub fn rank_busy(t: &Thresholds, r: &RankLoad) -> bool {
    let decode = t.active_decode_blocks_threshold.is_some_and(|th| {
        let booked = if r.total_blocks > 0 { r.booked_blocks as f64 / r.total_blocks as f64 } else { 0.0 };
        booked.max(r.reported_kv_usage.unwrap_or(0.0)) > th
    });
    let prefill = t.active_prefill_tokens_threshold.is_some_and(|th| r.booked_prefill_tokens > th);
    let frac = t
        .active_prefill_tokens_threshold_frac
        .is_some_and(|f| r.max_num_batched_tokens > 0 && r.booked_prefill_tokens as f64 > f * r.max_num_batched_tokens as f64);
    decode || prefill || frac
}

/// Whether a worker is busy: all its ranks are (a worker with no rank data is not busy).
pub fn worker_busy(t: &Thresholds, ranks: &[RankLoad]) -> bool {
    t.enabled() && !ranks.is_empty() && ranks.iter().all(|r| rank_busy(t, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(prefill: u64, blocks: u64, total: u64, usage: Option<f64>) -> RankLoad {
        RankLoad { booked_prefill_tokens: prefill, booked_blocks: blocks, total_blocks: total, reported_kv_usage: usage, max_num_batched_tokens: 8192 }
    }

    #[test]
    fn thresholds_or_combine_and_reported_usage_counts() {
        let t = Thresholds { active_decode_blocks_threshold: Some(0.85), active_prefill_tokens_threshold: Some(10_000), ..Default::default() };
        assert!(!rank_busy(&t, &load(5_000, 100, 1000, Some(0.2))));
        assert!(rank_busy(&t, &load(12_000, 100, 1000, Some(0.2))), "prefill over");
        assert!(rank_busy(&t, &load(0, 870, 1000, None)), "booked blocks over");
        assert!(rank_busy(&t, &load(0, 10, 1000, Some(0.99))), "the worker's own 99% is not hidden by a low estimate");
        let f = Thresholds { active_prefill_tokens_threshold_frac: Some(0.5), ..Default::default() };
        assert!(rank_busy(&f, &load(5_000, 0, 0, None)));
        assert!(!rank_busy(&f, &RankLoad { max_num_batched_tokens: 0, ..load(5_000, 0, 0, None) }), "unknown budget: frac off");
        assert!(!rank_busy(&Thresholds::default(), &load(1 << 40, 1 << 40, 1, Some(1.0))), "no threshold, never busy");
    }

    #[test]
    fn a_dp_worker_is_busy_only_if_all_ranks_are() {
        let t = Thresholds { active_prefill_tokens_threshold: Some(100), ..Default::default() };
        assert!(!worker_busy(&t, &[load(500, 0, 0, None), load(50, 0, 0, None)]));
        assert!(worker_busy(&t, &[load(500, 0, 0, None), load(150, 0, 0, None)]));
        assert!(!worker_busy(&t, &[]));
    }

    #[test]
    fn validation_and_exact_body() {
        assert!(Thresholds { active_decode_blocks_threshold: Some(1.5), ..Default::default() }.validate().is_err());
        let v: serde_json::Value = serde_json::from_str(REJECTION_BODY).unwrap();
        assert_eq!(v["code"], 503);
        assert_eq!(v["type"], "service_unavailable");
    }
}
