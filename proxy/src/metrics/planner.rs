//! The planner's metrics (`kvgate_planner_*`): what each pull observed, the workers wanted and
//! running, every decision by reason, and how long each change took.

use prometheus::{GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// Seconds a change may take: from a sim's start to a real engine's load and warm-up.
const CHANGE_BUCKETS: &[f64] = &[0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0];

/// The planner's series, by model.
#[derive(Clone)]
pub struct PlannerMetrics {
    /// `kvgate_planner_kv_usage{model}`: the last pull's average KV utilisation.
    pub kv_usage: GaugeVec,
    /// `kvgate_planner_queue{model}`: the last pull's waiting requests (router queue + the
    /// workers' `vllm:num_requests_waiting`) per worker.
    pub queue: GaugeVec,
    /// `kvgate_planner_workers{model,state}`: `desired` and `actual` workers.
    pub workers: IntGaugeVec,
    /// `kvgate_planner_decisions_total{model,kind,change,reason}`.
    pub decisions: IntCounterVec,
    /// `kvgate_planner_change_seconds{model,change}`: from the decision to the new worker in
    /// routing (`up`), or to the victim's exit (`down`).
    pub change_seconds: HistogramVec,
    /// `kvgate_planner_changes_failed_total{model,change}`.
    pub changes_failed: IntCounterVec,
    /// `kvgate_planner_moved_requests_total{model,result}`: the victims' requests a scale-down
    /// moved (`ok`) or could not move (`failed`; they finished in place or were cut).
    pub moved: IntCounterVec,
    /// `kvgate_planner_worker_exits_total{model}`: workers that exited without being stopped.
    pub worker_exits: IntCounterVec,
}

impl PlannerMetrics {
    /// Creates and registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let reg = |c: Box<dyn prometheus::core::Collector>| registry.register(c).expect("unique metric");
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            reg(Box::new(c.clone()));
            c
        };
        let fgauge = |name: &str, help: &str| {
            let g = GaugeVec::new(Opts::new(name, help), &["model"]).expect("valid metric");
            reg(Box::new(g.clone()));
            g
        };
        let workers =
            IntGaugeVec::new(Opts::new("kvgate_planner_workers", "Workers the planner wants (desired) and has in routing (actual)."), &["model", "state"])
                .expect("valid metric");
        reg(Box::new(workers.clone()));
        let change_seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvgate_planner_change_seconds",
                "Time a fleet change took: decision to the new worker in routing (up) or to the removed worker's exit (down).",
            )
            .buckets(CHANGE_BUCKETS.to_vec()),
            &["model", "change"],
        )
        .expect("valid metric");
        reg(Box::new(change_seconds.clone()));
        Self {
            kv_usage: fgauge("kvgate_planner_kv_usage", "Average KV-cache utilisation of the model's workers at the planner's last pull."),
            queue: fgauge("kvgate_planner_queue", "Requests waiting (router queue and the workers' own queues) per worker at the planner's last pull."),
            workers,
            decisions: counter(
                "kvgate_planner_decisions_total",
                "Planner decisions by worker kind, change and reason.",
                &["model", "kind", "change", "reason"],
            ),
            change_seconds,
            changes_failed: counter(
                "kvgate_planner_changes_failed_total",
                "Fleet changes that failed (a worker that did not start or answer in time).",
                &["model", "change"],
            ),
            moved: counter(
                "kvgate_planner_moved_requests_total",
                "Requests of a removed worker that a scale-down moved (ok) or could not move (failed).",
                &["model", "result"],
            ),
            worker_exits: counter(
                "kvgate_planner_worker_exits_total",
                "Planner-started workers that exited without being stopped (reaped and replaced).",
                &["model"],
            ),
        }
    }
}
