//! Phase 2, the router queue: while every worker of the model is past the queue threshold, the
//! request waits (highest priority first) until capacity frees, the queue refuses it (full →
//! 429, waited too long → 503), or the client leaves.

use super::{Outcome, RequestState};
use crate::downstream::closed::client_closed;
use crate::downstream::conn::ClientConn;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use kvgate_filters::route::QueueError;
use std::sync::Arc;

/// Waits in the queue when it must; `Err` when the request ends here.
pub async fn wait(gw: &Arc<Gateway>, session: &mut ClientConn, req: &RequestState) -> Result<(), Outcome> {
    let model = &req.model;
    let Some(queue) = model.queue.as_ref() else { return Ok(()) };
    if !req.endpoint.infers() || (model.queue_free_workers() > 0 && queue.is_empty()) {
        return Ok(());
    }
    let name = req.model_name();
    let depth = gw.metrics.queued.with_label_values(&[name]);
    depth.inc();
    let r = tokio::select! {
        r = queue.wait(req.view.priority_jump()) => Some(r),
        _ = client_closed(session) => None,
    };
    depth.dec();
    match r {
        None => Err(super::record::cancelled(gw, req)),
        Some(Ok(waited)) => {
            gw.metrics.queue_wait.with_label_values(&[name]).observe(waited.as_secs_f64());
            Ok(())
        }
        Some(Err(QueueError::Full)) => {
            gw.metrics.rejected.with_label_values(&[name, "queue_full"]).inc();
            Err(Outcome::Refused(GatewayError::QueueFull(name.to_string())))
        }
        Some(Err(QueueError::TimedOut)) => {
            gw.metrics.rejected.with_label_values(&[name, "queue_timeout"]).inc();
            Err(Outcome::Refused(GatewayError::QueueTimeout(name.to_string())))
        }
    }
}
