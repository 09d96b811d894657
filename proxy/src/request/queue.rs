//! Phase 2, the router queue: while every worker of the model is past the queue threshold, the
//! request waits until capacity frees (a higher tenant band first, the least-served tenant of
//! a band next, the highest priority of a tenant's requests first), the queue refuses it (full
//! → 429, shed for a higher band → 429, waited too long → 503), or the client leaves. How long
//! it waited, in which band and for which tenant, goes to its route receipt. While every worker that could take it is
//! paused by a fleet operation (`POST /pause` on the admin listener), it first waits for
//! `/resume`, whether or not the model has a queue: an RL trainer's pause → weight update →
//! resume costs clients time, not errors.

use super::RequestState;
use super::outcome::Outcome;
use crate::downstream::closed::client_closed;
use crate::downstream::conn::ClientConn;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::receipt::{QueueEnd, Queued};
use kvgate_filters::route::{QueueError, Ticket};
use std::sync::Arc;

/// Waits in the queue when it must; `Err` when the request ends here.
pub async fn wait(gw: &Arc<Gateway>, session: &mut ClientConn, req: &RequestState) -> Result<(), Outcome> {
    wait_resumed(gw, session, req).await?;
    let model = &req.model;
    let Some(queue) = model.queue.as_ref() else { return Ok(()) };
    if !req.endpoint.infers() || (queue.is_empty() && model.queue_has_room()) {
        return Ok(());
    }
    let name = req.model_name();
    let depth = gw.metrics.queued.with_label_values(&[name]);
    depth.inc();
    let began = std::time::Instant::now();
    let ticket = ticket(req);
    let (band, share) = (ticket.band, ticket.share.clone());
    let r = tokio::select! {
        r = queue.wait(ticket) => Some(r),
        _ = client_closed(session) => None,
    };
    depth.dec();
    let tenant = req.tenant.as_ref().map(|t| t.tenant.name.as_str());
    let ended = match r {
        None => QueueEnd::ClientLeft,
        Some(Ok(_)) => QueueEnd::Released,
        Some(Err(e)) => QueueEnd::Refused(e),
    };
    let standing = if share.is_some() { queue.standing(band, share.as_ref()) } else { Vec::new() };
    req.entry().receipt.lock().queued = Some(Queued { waited: began.elapsed(), band, tenant: tenant.map(str::to_owned), ended, standing });
    if let Some(t) = tenant {
        gw.metrics.tenants.queue_wait.with_label_values(&[t]).observe(began.elapsed().as_secs_f64());
    }
    if let Some(t) = &req.trace {
        let ended = ended.label();
        t.phase("kvgate.queue", began, || {
            vec![opentelemetry::KeyValue::new("kvgate.queue.band", i64::from(band)), opentelemetry::KeyValue::new("kvgate.queue.ended", ended)]
        });
    }
    match r {
        None => Err(super::record::cancelled(gw, req)),
        Some(Ok(waited)) => {
            gw.metrics.queue_wait.with_label_values(&[name]).observe(waited.as_secs_f64());
            Ok(())
        }
        Some(Err(QueueError::Shed)) => {
            gw.metrics.rejected.with_label_values(&[name, "queue_shed"]).inc();
            Err(Outcome::Refused(GatewayError::QueueShed(name.to_string())))
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

/// How `req` waits: its tenant's band, share and band's wait (else the model's).
fn ticket(req: &RequestState) -> Ticket {
    let tenant = req.tenant.as_ref().map(|t| &t.tenant);
    let model_wait = std::time::Duration::from_millis(req.model.cfg.routing.queue_max_wait_ms);
    Ticket {
        priority_jump: req.view.priority_jump(),
        band: tenant.map_or(0, |t| t.band),
        share: tenant.map(|t| t.account.fair().clone()),
        max_wait: tenant.and_then(|t| t.max_wait).unwrap_or(model_wait),
    }
}

/// Waits while every worker that could take `req` (healthy, serving its adapter, not tried
/// yet; its stored response's worker only, when it refers to one) is paused, until one is
/// resumed, the wait passes `routing.queue_max_wait_ms` (503), more than
/// `routing.queue_max_len` requests wait (429), or the client leaves. `Ok(false)` at once when
/// nothing that could take it is paused.
pub async fn wait_resumed(gw: &Arc<Gateway>, session: &mut ClientConn, req: &RequestState) -> Result<bool, Outcome> {
    let held = || super::place::held_by_pause(gw, req);
    if !held() {
        return Ok(false);
    }
    let name = req.model_name();
    let routing = &req.model.cfg.routing;
    let depth = gw.metrics.queued.with_label_values(&[name]);
    if depth.get() >= i64::try_from(routing.queue_max_len).unwrap_or(i64::MAX) {
        gw.metrics.rejected.with_label_values(&[name, "queue_full"]).inc();
        return Err(Outcome::Refused(GatewayError::QueueFull(name.to_string())));
    }
    depth.inc();
    let began = std::time::Instant::now();
    let mut resumed = gw.resumed.subscribe();
    let limit = tokio::time::sleep(std::time::Duration::from_millis(routing.queue_max_wait_ms));
    tokio::pin!(limit);
    let r = loop {
        if !held() {
            break Ok(true);
        }
        tokio::select! {
            _ = resumed.changed() => {}
            // A worker may also come back by turning healthy or by a reload: looked at again
            // twice a second.
            () = tokio::time::sleep(RECHECK) => {}
            () = &mut limit => break Err(Outcome::Refused(GatewayError::PausedTooLong(name.to_string()))),
            _ = client_closed(session) => break Err(super::record::cancelled(gw, req)),
        }
    };
    depth.dec();
    match &r {
        Ok(_) => gw.metrics.queue_wait.with_label_values(&[name]).observe(began.elapsed().as_secs_f64()),
        Err(Outcome::Refused(_)) => gw.metrics.rejected.with_label_values(&[name, "paused"]).inc(),
        Err(_) => {}
    }
    r
}

/// How often a request waiting for a paused model looks again without being woken.
const RECHECK: std::time::Duration = std::time::Duration::from_millis(500);
