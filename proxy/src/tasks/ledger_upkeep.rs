//! Booking upkeep, every `health.interval_ms`: bookings older than `routing.booking_max_age_s`
//! are released (a request that never ends, or a leaked guard), and the ledger gauges
//! (`kvgate_worker_requests_in_flight`, `kvgate_worker_active_prefill_tokens`,
//! `kvgate_worker_active_blocks`) and, for the `time` cost, each worker's calibration
//! (`kvgate_worker_prefill_factor`, `kvgate_worker_step_factor`) are refreshed.

use crate::gateway::Gateway;
use std::sync::Arc;
use std::time::Duration;

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    // Gauges are i64: a count past i64::MAX (never in practice) shows as the largest.
    let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    loop {
        let every = Duration::from_millis(gw.config().health.interval_ms);
        let fleet = gw.fleet();
        for m in fleet.models.values() {
            let expired = m.ledger.expire(Duration::from_secs(m.cfg.routing.booking_max_age_s));
            if expired > 0 {
                tracing::warn!(model = %m.cfg.name, expired, "bookings older than routing.booking_max_age_s released (requests still running, or a leak)");
            }
            for (i, w) in m.workers.iter().enumerate() {
                let labels = [m.cfg.name.as_str(), w.label.as_str()];
                let id = i as u16;
                gw.metrics.worker_in_flight.with_label_values(&labels).set(i64::from(m.ledger.requests(id)));
                gw.metrics.active_prefill.with_label_values(&labels).set(gauge(m.ledger.prefill_tokens(id)));
                gw.metrics.active_blocks.with_label_values(&labels).set(gauge(m.ledger.active_blocks(id)));
                if m.time_priors().is_some() {
                    gw.metrics.prefill_factor.with_label_values(&labels).set(w.calibration.prefill());
                    gw.metrics.step_factor.with_label_values(&labels).set(w.calibration.step());
                }
            }
        }
        drop(fleet);
        tokio::time::sleep(every).await;
    }
}
