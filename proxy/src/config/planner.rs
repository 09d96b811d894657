//! A model's `planner` section (issue #35): [`PlanParams`], seed 002's knobs with its
//! defaults, checked here.

pub use kvgate_filters::plan::{PlanMode, PlanParams as Planner};

/// Intervals positive, each threshold pair ordered, budgets that fit one engine.
pub fn validate(p: &Planner) -> Result<(), String> {
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if !positive(p.metric_pulling_interval_s) || !positive(p.adjustment_interval_s) {
        return Err("metric_pulling_interval_s and adjustment_interval_s must be positive".into());
    }
    if p.metric_pulling_interval_s > p.adjustment_interval_s {
        return Err("metric_pulling_interval_s must not exceed adjustment_interval_s".into());
    }
    let ordered = |down: f64, up: f64| down.is_finite() && up.is_finite() && 0.0 <= down && down < up;
    if !ordered(p.decode_kv_scale_down_threshold, p.decode_kv_scale_up_threshold) {
        return Err("decode_kv_scale_down_threshold must be >= 0 and below decode_kv_scale_up_threshold".into());
    }
    if !ordered(p.prefill_queue_scale_down_threshold, p.prefill_queue_scale_up_threshold) {
        return Err("prefill_queue_scale_down_threshold must be >= 0 and below prefill_queue_scale_up_threshold".into());
    }
    if p.decode_engine_num_gpu == 0 || p.prefill_engine_num_gpu == 0 {
        return Err("decode_engine_num_gpu and prefill_engine_num_gpu must be at least 1".into());
    }
    if p.min_gpu_budget > p.max_gpu_budget || p.max_gpu_budget < p.decode_engine_num_gpu {
        return Err("min_gpu_budget must not exceed max_gpu_budget, which must fit one decode engine".into());
    }
    if p.enabled {
        // Refused rather than accepted and ignored: an operator must not believe the fleet is
        // planned.
        return Err("enabled: the planner's decision rules are built but the task that acts on them is not yet (issue #35)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_seeds_and_valid() {
        let p = Planner::default();
        assert_eq!((p.enabled, p.mode, p.adjustment_interval_s, p.max_gpu_budget, p.new_decode_worker_grace_period), (false, PlanMode::Act, 30.0, 8, 3));
        assert_eq!(validate(&p), Ok(()));
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
            assert!(validate(&p).is_err(), "{p:?}");
        }
    }

    #[test]
    fn enabling_it_before_its_task_exists_is_an_error_not_a_silent_no_op() {
        let e = validate(&Planner { enabled: true, ..Planner::default() }).unwrap_err();
        assert!(e.contains("#35"), "{e}");
    }
}
