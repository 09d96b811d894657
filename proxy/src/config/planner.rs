//! A model's `planner` section (issue #35): seed 002's knobs under their own names (dashes
//! become underscores), with its defaults. Off by default.

use kvgate_filters::plan::PlanParams;
use serde::Deserialize;

/// Whether the planner changes the fleet or only records what it would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanMode {
    /// Scale the fleet.
    #[default]
    Act,
    /// Decide and record, change nothing (the seed's `--no-operation`).
    ObserveOnly,
}

/// The planner of one model.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Planner {
    /// Whether the model's fleet is planned.
    pub enabled: bool,
    /// `act` or `observe_only`.
    pub mode: PlanMode,
    /// `--metric-pulling-interval`, seconds.
    pub metric_pulling_interval_s: f64,
    /// `--adjustment-interval`, seconds.
    pub adjustment_interval_s: f64,
    /// `--min-gpu-budget`.
    pub min_gpu_budget: u32,
    /// `--max-gpu-budget`.
    pub max_gpu_budget: u32,
    /// `--decode-engine-num-gpu`.
    pub decode_engine_num_gpu: u32,
    /// `--prefill-engine-num-gpu`.
    pub prefill_engine_num_gpu: u32,
    /// `--decode-kv-scale-up-threshold`.
    pub decode_kv_scale_up_threshold: f64,
    /// `--decode-kv-scale-down-threshold`.
    pub decode_kv_scale_down_threshold: f64,
    /// `--prefill-queue-scale-up-threshold`.
    pub prefill_queue_scale_up_threshold: f64,
    /// `--prefill-queue-scale-down-threshold`.
    pub prefill_queue_scale_down_threshold: f64,
    /// `NEW_DECODE_WORKER_GRACE_PERIOD`, adjustment intervals.
    pub new_decode_worker_grace_period: u32,
}

impl Default for Planner {
    fn default() -> Self {
        let p = PlanParams::default();
        Self {
            enabled: false,
            mode: PlanMode::Act,
            metric_pulling_interval_s: p.metric_pulling_interval_s,
            adjustment_interval_s: p.adjustment_interval_s,
            min_gpu_budget: p.min_gpu_budget,
            max_gpu_budget: p.max_gpu_budget,
            decode_engine_num_gpu: p.decode_engine_num_gpu,
            prefill_engine_num_gpu: p.prefill_engine_num_gpu,
            decode_kv_scale_up_threshold: p.decode_kv_scale_up_threshold,
            decode_kv_scale_down_threshold: p.decode_kv_scale_down_threshold,
            prefill_queue_scale_up_threshold: p.prefill_queue_scale_up_threshold,
            prefill_queue_scale_down_threshold: p.prefill_queue_scale_down_threshold,
            new_decode_worker_grace_period: p.new_decode_worker_grace_period,
        }
    }
}

impl Planner {
    /// The decision rules' parameters.
    pub fn params(&self) -> PlanParams {
        PlanParams {
            metric_pulling_interval_s: self.metric_pulling_interval_s,
            adjustment_interval_s: self.adjustment_interval_s,
            min_gpu_budget: self.min_gpu_budget,
            max_gpu_budget: self.max_gpu_budget,
            decode_engine_num_gpu: self.decode_engine_num_gpu,
            prefill_engine_num_gpu: self.prefill_engine_num_gpu,
            decode_kv_scale_up_threshold: self.decode_kv_scale_up_threshold,
            decode_kv_scale_down_threshold: self.decode_kv_scale_down_threshold,
            prefill_queue_scale_up_threshold: self.prefill_queue_scale_up_threshold,
            prefill_queue_scale_down_threshold: self.prefill_queue_scale_down_threshold,
            new_decode_worker_grace_period: self.new_decode_worker_grace_period,
        }
    }

    /// Intervals positive, each threshold pair ordered, budgets that fit one engine.
    pub fn validate(&self) -> Result<(), String> {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.metric_pulling_interval_s) || !positive(self.adjustment_interval_s) {
            return Err("metric_pulling_interval_s and adjustment_interval_s must be positive".into());
        }
        if self.metric_pulling_interval_s > self.adjustment_interval_s {
            return Err("metric_pulling_interval_s must not exceed adjustment_interval_s".into());
        }
        let ordered = |down: f64, up: f64| down.is_finite() && up.is_finite() && 0.0 <= down && down < up;
        if !ordered(self.decode_kv_scale_down_threshold, self.decode_kv_scale_up_threshold) {
            return Err("decode_kv_scale_down_threshold must be >= 0 and below decode_kv_scale_up_threshold".into());
        }
        if !ordered(self.prefill_queue_scale_down_threshold, self.prefill_queue_scale_up_threshold) {
            return Err("prefill_queue_scale_down_threshold must be >= 0 and below prefill_queue_scale_up_threshold".into());
        }
        if self.decode_engine_num_gpu == 0 || self.prefill_engine_num_gpu == 0 {
            return Err("decode_engine_num_gpu and prefill_engine_num_gpu must be at least 1".into());
        }
        if self.min_gpu_budget > self.max_gpu_budget || self.max_gpu_budget < self.decode_engine_num_gpu {
            return Err("min_gpu_budget must not exceed max_gpu_budget, which must fit one decode engine".into());
        }
        if self.enabled {
            // Refused rather than accepted and ignored: an operator must not believe the fleet
            // is planned.
            return Err("enabled: the planner's decision rules are built but the task that acts on them is not yet (issue #35)".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_seeds_and_valid() {
        let p = Planner::default();
        assert_eq!(p.params(), PlanParams::default());
        assert_eq!(p.mode, PlanMode::Act);
        assert_eq!(p.validate(), Ok(()));
    }

    #[test]
    fn inconsistent_knobs_are_refused() {
        let bad = [
            Planner { adjustment_interval_s: 0.0, ..Planner::default() },
            Planner { metric_pulling_interval_s: 60.0, ..Planner::default() },
            Planner { decode_kv_scale_down_threshold: 0.95, ..Planner::default() },
            Planner { prefill_queue_scale_up_threshold: 0.1, ..Planner::default() },
            Planner { decode_engine_num_gpu: 0, ..Planner::default() },
            Planner { min_gpu_budget: 9, ..Planner::default() },
            Planner { decode_engine_num_gpu: 16, ..Planner::default() },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?}");
        }
    }

    #[test]
    fn enabling_it_before_its_task_exists_is_an_error_not_a_silent_no_op() {
        let e = Planner { enabled: true, ..Planner::default() }.validate().unwrap_err();
        assert!(e.contains("#35"), "{e}");
    }
}
