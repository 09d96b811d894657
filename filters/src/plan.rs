//! The planner's decisions (Dynamo's planner design): from the load it pulls every
//! `metric_pulling_interval_s`, once per `adjustment_interval_s`, whether to add or remove one
//! decode (or aggregated) worker and one prefill worker. Pure: no clocks, no I/O. The caller
//! pulls, feeds [`Planner::observe`], calls [`Planner::adjust`] at each interval's end and acts
//! (or, in observe-only mode, only records) what it returns.
//!
//! The load, as Dynamo's planner defines it:
//! - decode / aggregated workers: the average KV-cache utilisation (0–1) over the interval;
//! - prefill workers: the *queue utilisation*, for kvgate the requests waiting for a prefill
//!   (the router queue plus the workers' `vllm:num_requests_waiting`) per prefill worker,
//!   averaged over the interval.
//!
//! Dynamo's rules, each a [`Reason`] when it holds a change back: at most one worker of each
//! kind per interval; nothing is pulled or decided while a change is under way; the GPU budget
//! (`min_gpu_budget` ≤ GPUs of each kind, all GPUs ≤ `max_gpu_budget`); no decode scale-down
//! for `new_decode_worker_grace_period` intervals after a decode worker was added; no prefill
//! scale-up when the queue's trend in this interval brings it under the threshold within
//! [`PREFILL_QUEUE_BUFFER_PERIOD`] intervals.

/// Intervals over which the prefill queue's trend is extrapolated (Dynamo's
/// `NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD`).
pub const PREFILL_QUEUE_BUFFER_PERIOD: f64 = 3.0;

/// Whether the planner changes the fleet or only records what it would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanMode {
    /// Scale the fleet.
    #[default]
    Act,
    /// Decide and record, change nothing (Dynamo's `--no-operation`).
    ObserveOnly,
}

/// A model's planner settings: Dynamo's knobs under their own names (dashes become
/// underscores), with its defaults; a model's `planner` config section.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlanParams {
    /// Whether the model's fleet is planned (off by default).
    pub enabled: bool,
    /// `act` or `observe_only`.
    pub mode: PlanMode,
    /// Seconds between pulls.
    pub metric_pulling_interval_s: f64,
    /// Seconds between decisions.
    pub adjustment_interval_s: f64,
    /// Fewest GPUs for the decode workers, and for the prefill workers when there are any.
    pub min_gpu_budget: u32,
    /// Most GPUs for all workers together.
    pub max_gpu_budget: u32,
    /// GPUs one decode engine takes.
    pub decode_engine_num_gpu: u32,
    /// GPUs one prefill engine takes.
    pub prefill_engine_num_gpu: u32,
    /// Average KV utilisation over which a decode worker is added.
    pub decode_kv_scale_up_threshold: f64,
    /// Average KV utilisation under which a decode worker is removed.
    pub decode_kv_scale_down_threshold: f64,
    /// Queue utilisation over which a prefill worker is added.
    pub prefill_queue_scale_up_threshold: f64,
    /// Queue utilisation under which a prefill worker is removed.
    pub prefill_queue_scale_down_threshold: f64,
    /// Intervals after a decode worker was added during which none is removed.
    pub new_decode_worker_grace_period: u32,
}

impl Default for PlanParams {
    fn default() -> Self {
        Self {
            enabled: false,
            mode: PlanMode::Act,
            metric_pulling_interval_s: 1.0,
            adjustment_interval_s: 30.0,
            min_gpu_budget: 1,
            max_gpu_budget: 8,
            decode_engine_num_gpu: 1,
            prefill_engine_num_gpu: 1,
            decode_kv_scale_up_threshold: 0.9,
            decode_kv_scale_down_threshold: 0.5,
            prefill_queue_scale_up_threshold: 0.5,
            prefill_queue_scale_down_threshold: 0.2,
            new_decode_worker_grace_period: 3,
        }
    }
}

/// One pull: the load now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pull {
    /// Average KV utilisation of the decode workers (0–1).
    pub decode_kv: f64,
    /// Requests waiting for a prefill, per prefill worker (`None`: no prefill workers).
    pub prefill_queue: Option<f64>,
}

/// The workers of each kind now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Workers {
    /// Decode (or aggregated) workers.
    pub decode: u32,
    /// Prefill workers.
    pub prefill: u32,
}

/// A change for one kind of worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Add one.
    Up,
    /// Remove one.
    Down,
    /// None.
    Hold,
}

/// Why a change was made or held back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Load over the scale-up threshold.
    OverThreshold,
    /// Load under the scale-down threshold.
    UnderThreshold,
    /// Load between the thresholds.
    WithinThresholds,
    /// Nothing was pulled in the interval.
    NoData,
    /// Adding one would pass `max_gpu_budget`.
    MaxBudget,
    /// Removing one would go under `min_gpu_budget`.
    MinBudget,
    /// A decode worker was added within `new_decode_worker_grace_period` intervals.
    GracePeriod,
    /// The queue's trend brings it under the threshold within the buffer period.
    QueueDraining,
    /// Fewer workers than `min_gpu_budget` asks for (a fleet that starts empty, or lost one):
    /// one is added whatever the load.
    BelowMinBudget,
}

impl Reason {
    /// The label in metrics and the decision log.
    pub fn label(self) -> &'static str {
        match self {
            Self::OverThreshold => "over_threshold",
            Self::UnderThreshold => "under_threshold",
            Self::WithinThresholds => "within_thresholds",
            Self::NoData => "no_data",
            Self::MaxBudget => "max_budget",
            Self::MinBudget => "min_budget",
            Self::GracePeriod => "grace_period",
            Self::QueueDraining => "queue_draining",
            Self::BelowMinBudget => "below_min_budget",
        }
    }
}

/// One interval's decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The decode workers' change and why.
    pub decode: (Change, Reason),
    /// The prefill workers' change and why (`None`: no prefill workers).
    pub prefill: Option<(Change, Reason)>,
    /// The interval's average decode KV utilisation.
    pub decode_kv: f64,
    /// The interval's average prefill queue utilisation.
    pub prefill_queue: Option<f64>,
}

/// The planner's state between decisions.
#[derive(Debug, Clone, Default)]
pub struct Planner {
    params: PlanParams,
    pulls: Vec<Pull>,
    /// Intervals left in the grace period after a decode worker was added.
    grace_left: u32,
}

impl Planner {
    /// A planner with `params`.
    pub fn new(params: PlanParams) -> Self {
        Self { params, pulls: Vec::new(), grace_left: 0 }
    }

    /// Records a pull; ignored while a change is under way (`adjusting`), as Dynamo's planner
    /// blocks pulling then.
    pub fn observe(&mut self, pull: Pull, adjusting: bool) {
        if !adjusting {
            self.pulls.push(pull);
        }
    }

    /// The decision at an interval's end for the fleet `now`; `None` while a change is under
    /// way. Starts the next interval.
    pub fn adjust(&mut self, now: Workers, adjusting: bool) -> Option<Decision> {
        if adjusting {
            return None;
        }
        let pulls = std::mem::take(&mut self.pulls);
        let decode_kv = mean(pulls.iter().map(|p| p.decode_kv));
        let queues: Vec<f64> = pulls.iter().filter_map(|p| p.prefill_queue).collect();
        let prefill_queue = (now.prefill > 0 && !queues.is_empty()).then(|| mean(queues.iter().copied()).unwrap_or(0.0));
        let decode = self.decode_change(now, decode_kv);
        let prefill = (now.prefill > 0).then(|| self.prefill_change(now, &queues, decode.0));
        self.grace_left = match decode.0 {
            Change::Up => self.params.new_decode_worker_grace_period,
            _ => self.grace_left.saturating_sub(1),
        };
        Some(Decision { decode, prefill, decode_kv: decode_kv.unwrap_or(0.0), prefill_queue })
    }

    fn gpus(&self, w: Workers) -> u32 {
        w.decode * self.params.decode_engine_num_gpu + w.prefill * self.params.prefill_engine_num_gpu
    }

    fn decode_change(&self, now: Workers, kv: Option<f64>) -> (Change, Reason) {
        let p = &self.params;
        if now.decode * p.decode_engine_num_gpu < p.min_gpu_budget.max(1) && self.gpus(now) + p.decode_engine_num_gpu <= p.max_gpu_budget {
            return (Change::Up, Reason::BelowMinBudget);
        }
        let Some(kv) = kv else { return (Change::Hold, Reason::NoData) };
        if kv > p.decode_kv_scale_up_threshold {
            if self.gpus(now) + p.decode_engine_num_gpu > p.max_gpu_budget {
                return (Change::Hold, Reason::MaxBudget);
            }
            return (Change::Up, Reason::OverThreshold);
        }
        if kv < p.decode_kv_scale_down_threshold {
            if self.grace_left > 0 {
                return (Change::Hold, Reason::GracePeriod);
            }
            if now.decode.saturating_sub(1) * p.decode_engine_num_gpu < p.min_gpu_budget.max(1) {
                return (Change::Hold, Reason::MinBudget);
            }
            return (Change::Down, Reason::UnderThreshold);
        }
        (Change::Hold, Reason::WithinThresholds)
    }

    /// `decode`: this interval's decode change, which the budget counts first.
    fn prefill_change(&self, now: Workers, queues: &[f64], decode: Change) -> (Change, Reason) {
        let p = &self.params;
        let Some(q) = mean(queues.iter().copied()) else { return (Change::Hold, Reason::NoData) };
        if q > p.prefill_queue_scale_up_threshold {
            if draining_below(queues, p.prefill_queue_scale_up_threshold) {
                return (Change::Hold, Reason::QueueDraining);
            }
            let decode_gpus = if decode == Change::Up { p.decode_engine_num_gpu } else { 0 };
            if self.gpus(now) + decode_gpus + p.prefill_engine_num_gpu > p.max_gpu_budget {
                return (Change::Hold, Reason::MaxBudget);
            }
            return (Change::Up, Reason::OverThreshold);
        }
        if q < p.prefill_queue_scale_down_threshold {
            if now.prefill.saturating_sub(1) * p.prefill_engine_num_gpu < p.min_gpu_budget.max(1) {
                return (Change::Hold, Reason::MinBudget);
            }
            return (Change::Down, Reason::UnderThreshold);
        }
        (Change::Hold, Reason::WithinThresholds)
    }
}

/// Whether the queue's linear trend over this interval's pulls takes it under `threshold`
/// within [`PREFILL_QUEUE_BUFFER_PERIOD`] more intervals of as many pulls.
fn draining_below(queues: &[f64], threshold: f64) -> bool {
    let (Some(first), Some(last)) = (queues.first(), queues.last()) else { return false };
    if queues.len() < 2 {
        return false;
    }
    let per_pull = (last - first) / (queues.len() - 1) as f64;
    last + per_pull * queues.len() as f64 * PREFILL_QUEUE_BUFFER_PERIOD < threshold
}

fn mean(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| sum / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_only(d: u32) -> Workers {
        Workers { decode: d, prefill: 0 }
    }

    fn interval(p: &mut Planner, kv: f64, queue: Option<f64>) {
        for _ in 0..30 {
            p.observe(Pull { decode_kv: kv, prefill_queue: queue }, false);
        }
    }

    #[test]
    fn decode_workers_follow_the_kv_thresholds_one_at_a_time() {
        let mut p = Planner::new(PlanParams { new_decode_worker_grace_period: 0, ..PlanParams::default() });
        interval(&mut p, 0.95, None);
        assert_eq!(p.adjust(decode_only(2), false).unwrap().decode, (Change::Up, Reason::OverThreshold));
        interval(&mut p, 0.7, None);
        assert_eq!(p.adjust(decode_only(3), false).unwrap().decode, (Change::Hold, Reason::WithinThresholds));
        interval(&mut p, 0.2, None);
        assert_eq!(p.adjust(decode_only(3), false).unwrap().decode, (Change::Down, Reason::UnderThreshold));
        assert_eq!(p.adjust(decode_only(3), false).unwrap().decode, (Change::Hold, Reason::NoData), "a new interval starts empty");
    }

    #[test]
    fn a_fleet_under_its_minimum_grows_whatever_the_load() {
        let mut p = Planner::new(PlanParams { min_gpu_budget: 2, ..PlanParams::default() });
        assert_eq!(p.adjust(decode_only(0), false).unwrap().decode, (Change::Up, Reason::BelowMinBudget), "no data needed");
        interval(&mut p, 0.1, None);
        assert_eq!(p.adjust(decode_only(1), false).unwrap().decode, (Change::Up, Reason::BelowMinBudget), "even when idle");
        interval(&mut p, 0.1, None);
        assert_eq!(p.adjust(decode_only(2), false).unwrap().decode.0, Change::Hold, "at the minimum (and in the grace period)");
    }

    #[test]
    fn the_interval_average_decides_not_the_last_pull() {
        let mut p = Planner::new(PlanParams::default());
        for kv in [1.0, 1.0, 0.1, 0.1] {
            p.observe(Pull { decode_kv: kv, prefill_queue: None }, false);
        }
        let d = p.adjust(decode_only(2), false).unwrap();
        assert_eq!((d.decode, d.decode_kv), ((Change::Hold, Reason::WithinThresholds), 0.55));
    }

    #[test]
    fn budgets_count_gpus_per_engine() {
        let params = PlanParams { decode_engine_num_gpu: 2, prefill_engine_num_gpu: 1, max_gpu_budget: 8, min_gpu_budget: 2, ..PlanParams::default() };
        let mut p = Planner::new(params);
        interval(&mut p, 0.95, None);
        // 3 decode engines × 2 + 1 prefill = 7 GPUs; one more decode engine makes 9 > 8.
        let d = p.adjust(Workers { decode: 3, prefill: 1 }, false).unwrap();
        assert_eq!(d.decode, (Change::Hold, Reason::MaxBudget));
        interval(&mut p, 0.95, None);
        assert_eq!(p.adjust(decode_only(3), false).unwrap().decode, (Change::Up, Reason::OverThreshold), "3 × 2 + 2 = 8 fits");
        let mut p = Planner::new(PlanParams { new_decode_worker_grace_period: 0, ..params });
        interval(&mut p, 0.1, None);
        assert_eq!(p.adjust(decode_only(1), false).unwrap().decode, (Change::Hold, Reason::MinBudget), "1 engine of 2 GPUs is the minimum");
    }

    #[test]
    fn no_decode_scale_down_during_the_grace_period() {
        let mut p = Planner::new(PlanParams::default());
        interval(&mut p, 0.95, None);
        assert_eq!(p.adjust(decode_only(1), false).unwrap().decode.0, Change::Up);
        for _ in 0..3 {
            interval(&mut p, 0.1, None);
            assert_eq!(p.adjust(decode_only(2), false).unwrap().decode, (Change::Hold, Reason::GracePeriod));
        }
        interval(&mut p, 0.1, None);
        assert_eq!(p.adjust(decode_only(2), false).unwrap().decode, (Change::Down, Reason::UnderThreshold));
    }

    #[test]
    fn nothing_is_pulled_or_decided_while_a_change_is_under_way() {
        let mut p = Planner::new(PlanParams::default());
        p.observe(Pull { decode_kv: 0.95, prefill_queue: None }, true);
        assert_eq!(p.adjust(decode_only(1), true), None);
        assert_eq!(p.adjust(decode_only(1), false).unwrap().decode, (Change::Hold, Reason::NoData), "the pull made while adjusting was dropped");
    }

    #[test]
    fn prefill_workers_follow_the_queue_unless_it_is_draining() {
        let mut p = Planner::new(PlanParams::default());
        let w = Workers { decode: 1, prefill: 1 };
        interval(&mut p, 0.7, Some(2.0));
        assert_eq!(p.adjust(w, false).unwrap().prefill, Some((Change::Up, Reason::OverThreshold)));
        // Over the threshold on average, but falling fast: 3.0 → 0.1 in one interval.
        for i in 0..30 {
            p.observe(Pull { decode_kv: 0.7, prefill_queue: Some(3.0 - 0.1 * f64::from(i)) }, false);
        }
        assert_eq!(p.adjust(w, false).unwrap().prefill, Some((Change::Hold, Reason::QueueDraining)));
        interval(&mut p, 0.7, Some(0.1));
        assert_eq!(p.adjust(Workers { decode: 1, prefill: 2 }, false).unwrap().prefill, Some((Change::Down, Reason::UnderThreshold)));
        interval(&mut p, 0.7, Some(0.1));
        assert_eq!(p.adjust(w, false).unwrap().prefill, Some((Change::Hold, Reason::MinBudget)));
    }

    #[test]
    fn a_decode_and_a_prefill_worker_share_the_budget() {
        let mut p = Planner::new(PlanParams { max_gpu_budget: 3, ..PlanParams::default() });
        interval(&mut p, 0.95, Some(2.0));
        let d = p.adjust(Workers { decode: 1, prefill: 1 }, false).unwrap();
        assert_eq!((d.decode, d.prefill), ((Change::Up, Reason::OverThreshold), Some((Change::Hold, Reason::MaxBudget))));
    }

    #[test]
    fn without_prefill_workers_there_is_no_prefill_decision() {
        let mut p = Planner::new(PlanParams::default());
        interval(&mut p, 0.7, Some(5.0));
        let d = p.adjust(decode_only(1), false).unwrap();
        assert_eq!((d.prefill, d.prefill_queue), (None, None));
    }
}
