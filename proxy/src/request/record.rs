//! Phase 6, the record: metrics, logs and the registry's final status for every way a request
//! ends, and the events on the way (a cancelled request, a failed leg) counted once each.

use super::RequestState;
use super::outcome::Outcome;
use crate::endpoint::Endpoint;
use crate::error::{GatewayError, LegError};
use crate::fleet::Worker;
use crate::gateway::Gateway;
use crate::inflight::RequestEntry;
use crate::move_order::MoveRefused;
use kvgate_filters::migrate::PinReason;

/// A request refused before it was admitted (no model known yet): a body that is not JSON or
/// names no served model is counted under `model=""`; draining, size and time limits are not.
pub fn refused_early(gw: &Gateway, endpoint: Endpoint, outcome: &Outcome) {
    if let Outcome::Refused(e @ (GatewayError::BadRequest { .. } | GatewayError::UnknownModel { .. } | GatewayError::ClientLimit(_))) = outcome {
        let status = e.status().to_string();
        gw.metrics.requests.with_label_values(&["", endpoint.label(), status.as_str()]).inc();
    }
}

/// An admitted request ended.
pub fn finished(gw: &Gateway, req: &mut RequestState, outcome: &Outcome) {
    super::limit::settle(gw, req);
    let status = outcome.status();
    if let Some(t) = req.trace.take() {
        let error = match outcome {
            Outcome::Refused(e) => Some(e.to_string()),
            Outcome::Truncated(_) => Some("the stream was cut: no worker could continue it".to_string()),
            _ => None,
        };
        t.finish(status, error.as_deref());
    }
    let elapsed = req.start.elapsed();
    req.registered.set_status(status, elapsed);
    let (name, endpoint) = (req.model_name(), req.endpoint.label());
    let m = &req.model.metrics(&gw.metrics).endpoints[req.endpoint.index()];
    if status == 200 {
        m.ok.inc();
    } else {
        gw.metrics.requests.with_label_values(&[name, endpoint, status.to_string().as_str()]).inc();
    }
    m.duration.observe(elapsed.as_secs_f64());
    if req.stream && matches!(outcome, Outcome::Served(200)) {
        // What a request of this model generates and how long it waits for its first token and
        // each after it: routing's decode terms and the exchange rate its stall term prices at.
        let tokens = req.entry().generated_tokens();
        let times = req.ttft.filter(|_| tokens > 1).map(|ttft| {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
            (ms(ttft), ms(elapsed.saturating_sub(ttft)) / (tokens - 1) as f64)
        });
        req.model.ledger.stream_finished(tokens, times);
    }
    if let Outcome::Refused(e) = outcome {
        tracing::debug!(request_id = req.id(), model = name, endpoint, status, error = %e, "request refused");
    }
    tracing::debug!(
        request_id = req.id(),
        model = name,
        endpoint,
        status,
        stream = req.stream,
        elapsed_ms = elapsed.as_millis() as u64,
        ttft_ms = req.ttft.map(|t| t.as_millis() as u64),
        worker = req.attempts.current(),
        predicted_ttft_ms = req.attempts.predicted().map(|p| p.ttft_ms().round()),
        "request done"
    );
}

/// The client went away: kill the request's context and count the cancellation once per
/// request, however many signals arrive.
pub fn cancelled(gw: &Gateway, req: &RequestState) -> Outcome {
    if req.ctx.kill() {
        let kind = if req.stream { "stream" } else { "unary" };
        let (model, endpoint) = (req.model_name(), req.endpoint.label());
        gw.metrics.cancellations.with_label_values(&[model, endpoint, kind]).inc();
        tracing::info!(request_id = req.id(), model, endpoint, "client disconnected; upstream request cancelled");
    }
    Outcome::Cancelled
}

/// A leg to `worker` failed.
pub fn leg_failed(gw: &Gateway, req: &RequestState, worker: &Worker, e: &LegError) {
    gw.metrics.upstream_errors.with_label_values(&[req.model_name(), worker.label.as_str(), e.kind.label()]).inc();
    tracing::warn!(request_id = req.id(), worker = %worker.url, kind = e.kind.label(), retryable = e.retryable, detail = e.detail.as_str(), "upstream leg failed");
}

/// The request cannot move to another worker, for `reason`: shown in the registry, a pending
/// move order refused, and counted (`kvgate_migration_pinned_total`).
pub fn pinned(gw: &Gateway, entry: &RequestEntry, model: &str, reason: PinReason) {
    entry.pin(reason.label());
    entry.mailbox.refuse_pending(MoveRefused::Pinned(reason.label()));
    gw.metrics.migration_pinned.with_label_values(&[model, reason.label()]).inc();
}
