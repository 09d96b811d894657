//! What the planner saw and did: one JSON line per pull, decision, change and worker exit in
//! `planner.log` (what `kvgate-bench planner-plot` draws), and the `kvgate_planner_*` metrics.
//!
//! Lines: `{"t": <unix seconds>, "model": …, "event": "pull" | "decision" | "change" | "exit", …}`.

use super::change::{Kind, Outcome};
use crate::connector::Managed;
use crate::metrics::Metrics;
use crate::metrics::planner::PlannerMetrics;
use kvgate_filters::plan::{Change, Decision, Pull};
use serde_json::{Value, json};
use std::io::Write;
use std::path::Path;

/// Writes one model's log lines and metrics.
pub struct Recorder {
    model: String,
    log: Option<std::fs::File>,
    metrics: ModelSeries,
}

/// The model's series, resolved once.
struct ModelSeries {
    kv_usage: prometheus::Gauge,
    queue: prometheus::Gauge,
    desired: prometheus::IntGauge,
    actual: prometheus::IntGauge,
    all: PlannerMetrics,
}

impl Recorder {
    /// A recorder for `model`, appending to `log` when set (a log that cannot be opened is
    /// reported and skipped: the planner still runs).
    pub fn new(model: &str, log: Option<&Path>, metrics: &Metrics) -> Self {
        let log = log.and_then(|p| match std::fs::OpenOptions::new().create(true).append(true).open(p) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::error!(path = %p.display(), error = %e, "planner: cannot open the decision log; decisions are kept in metrics only");
                None
            }
        });
        let m = &metrics.planner;
        let metrics = ModelSeries {
            kv_usage: m.kv_usage.with_label_values(&[model]),
            queue: m.queue.with_label_values(&[model]),
            desired: m.workers.with_label_values(&[model, "desired"]),
            actual: m.workers.with_label_values(&[model, "actual"]),
            all: m.clone(),
        };
        Self { model: model.to_string(), log, metrics }
    }

    /// A pull (`held`: taken while a change was under way, so not counted, as Dynamo's planner
    /// blocks pulling then).
    pub fn pull(&mut self, p: &Pull, workers: u32, held: bool) {
        self.metrics.kv_usage.set(p.decode_kv);
        self.metrics.queue.set(p.prefill_queue.unwrap_or(0.0));
        self.line("pull", json!({"kv_usage": p.decode_kv, "queue": p.prefill_queue, "workers": workers, "held": held}));
    }

    /// A decision (`acted`: carried out, not only observed).
    pub fn decision(&mut self, d: &Decision, workers: u32, desired: u32, acted: bool) {
        let (change, reason) = d.decode;
        self.metrics.all.decisions.with_label_values(&[&self.model, "decode", change_label(change), reason.label()]).inc();
        if let Some((c, r)) = d.prefill {
            self.metrics.all.decisions.with_label_values(&[&self.model, "prefill", change_label(c), r.label()]).inc();
        }
        tracing::info!(model = %self.model, change = change_label(change), reason = reason.label(), kv_usage = d.decode_kv, workers, acted, "planner: decision");
        self.line(
            "decision",
            json!({"kind": "decode", "change": change_label(change), "reason": reason.label(), "kv_usage": d.decode_kv, "queue": d.prefill_queue,
                   "workers": workers, "desired": desired, "acted": acted}),
        );
    }

    /// A change that ended.
    pub fn change(&mut self, o: &Outcome) {
        let kind = match o.kind {
            Kind::Up => "up",
            Kind::Down => "down",
        };
        match &o.error {
            None => self.metrics.all.change_seconds.with_label_values(&[&self.model, kind]).observe(o.took.as_secs_f64()),
            Some(e) => {
                self.metrics.all.changes_failed.with_label_values(&[&self.model, kind]).inc();
                tracing::error!(model = %self.model, change = kind, worker = ?o.worker, error = %e, "planner: change failed");
            }
        }
        tracing::info!(model = %self.model, change = kind, worker = ?o.worker, took_s = o.took.as_secs_f64(), moved = o.moved.0, "planner: change done");
        self.line(
            "change",
            json!({"change": kind, "worker": o.worker, "took_s": o.took.as_secs_f64(), "drained_s": o.drained_in.as_secs_f64(),
                   "moved": o.moved.0, "move_failed": o.moved.1, "left_behind": o.left_behind, "ok": o.error.is_none(), "error": o.error}),
        );
    }

    /// A worker that exited without being stopped.
    pub fn exit(&mut self, m: &Managed) {
        self.metrics.all.worker_exits.with_label_values(&[&self.model]).inc();
        self.line("exit", json!({"worker": m.name, "url": m.url.to_string()}));
    }

    /// The workers wanted and in routing now.
    pub fn workers(&self, actual: u32, desired: u32) {
        self.metrics.actual.set(i64::from(actual));
        self.metrics.desired.set(i64::from(desired));
    }

    fn line(&mut self, event: &str, mut v: Value) {
        let Some(f) = &mut self.log else { return };
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        if let Value::Object(o) = &mut v {
            o.insert("t".into(), json!(t));
            o.insert("model".into(), json!(self.model));
            o.insert("event".into(), json!(event));
        }
        let mut line = v.to_string();
        line.push('\n');
        if let Err(e) = f.write_all(line.as_bytes()) {
            tracing::error!(error = %e, "planner: cannot write the decision log; it is no longer written");
            self.log = None;
        }
    }
}

/// `up`, `down` or `hold`.
pub fn change_label(c: Change) -> &'static str {
    match c {
        Change::Up => "up",
        Change::Down => "down",
        Change::Hold => "hold",
    }
}
