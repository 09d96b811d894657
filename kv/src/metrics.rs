//! Prometheus metrics of event ingestion and the index, registered in the gateway's registry.

use crate::applier::Counts;
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// Ingestion and index metrics, labelled by event source (`worker url` + `#rank`).
#[derive(Clone)]
pub struct KvMetrics {
    /// `kvgate_kv_events_total{source,type,result}` (result: applied | ignored).
    pub events: IntCounterVec,
    /// `kvgate_kv_batches_malformed_total{source}`.
    pub malformed: IntCounterVec,
    /// `kvgate_kv_gaps_total{source}`.
    pub gaps: IntCounterVec,
    /// `kvgate_kv_replays_total{source,result}`.
    pub replays: IntCounterVec,
    /// `kvgate_kv_resyncs_total{source,reason}` (reason: restart | unknown_parent | disconnect).
    pub resyncs: IntCounterVec,
    /// `kvgate_kv_unknown_removals_total{source}`.
    pub unknown_removals: IntCounterVec,
    /// `kvgate_kv_index_blocks{source}`: blocks the index holds for the source.
    pub blocks: IntGaugeVec,
    /// `kvgate_kv_event_lag_seconds{source}`: now minus the last applied batch's timestamp.
    pub lag: GaugeVec,
}

impl KvMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let c = |name: &str, help: &str, labels: &[&str]| {
            let v = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            let _ = registry.register(Box::new(v.clone()));
            v
        };
        let blocks = IntGaugeVec::new(Opts::new("kvgate_kv_index_blocks", "Blocks the KV index holds per event source."), &["source"]).expect("valid");
        let _ = registry.register(Box::new(blocks.clone()));
        let lag = GaugeVec::new(Opts::new("kvgate_kv_event_lag_seconds", "Age of the last applied KV event batch."), &["source"]).expect("valid");
        let _ = registry.register(Box::new(lag.clone()));
        Self {
            events: c("kvgate_kv_events_total", "KV events by type and outcome.", &["source", "type", "result"]),
            malformed: c("kvgate_kv_batches_malformed_total", "KV event messages that did not decode (skipped).", &["source"]),
            gaps: c("kvgate_kv_gaps_total", "Sequence gaps in a KV event stream.", &["source"]),
            replays: c("kvgate_kv_replays_total", "Replay requests to a worker's replay socket.", &["source", "result"]),
            resyncs: c("kvgate_kv_resyncs_total", "Times a worker's index state was dropped and rebuilt.", &["source", "reason"]),
            unknown_removals: c("kvgate_kv_unknown_removals_total", "Removals of blocks the index did not hold.", &["source"]),
            blocks,
            lag,
        }
    }

    /// Adds the difference between two snapshots of an applier's counters.
    pub fn record(&self, source: &str, before: &Counts, after: &Counts) {
        let d = |a: u64, b: u64| b.saturating_sub(a);
        for (i, ty) in ["stored", "removed", "cleared"].iter().enumerate() {
            let n = d(before.applied[i], after.applied[i]);
            if n > 0 {
                self.events.with_label_values(&[source, ty, "applied"]).inc_by(n);
            }
        }
        let ignored = d(before.ignored + before.block_size_mismatch, after.ignored + after.block_size_mismatch);
        if ignored > 0 {
            self.events.with_label_values(&[source, "any", "ignored"]).inc_by(ignored);
        }
        for (counter, n) in [
            (&self.malformed, d(before.malformed, after.malformed)),
            (&self.gaps, d(before.gaps, after.gaps)),
            (&self.unknown_removals, d(before.unknown_removals, after.unknown_removals)),
        ] {
            if n > 0 {
                counter.with_label_values(&[source]).inc_by(n);
            }
        }
        for (reason, n) in [("restart", d(before.restarts, after.restarts)), ("unknown_parent", d(before.unknown_parents, after.unknown_parents))] {
            if n > 0 {
                self.resyncs.with_label_values(&[source, reason]).inc_by(n);
            }
        }
    }
}
