//! The life of an inference request, as documented phases over one [`RequestState`] (as
//! Pingora's `ProxyHttp` phases over a per-request `CTX`); docs/architecture.md draws it:
//!
//! 1. [`admit`]: draining, the body (capped), the fields routing reads, the model → the state,
//!    registered in the in-flight registry;
//!    then [`limit`]: the tenant's limits, once the prompt is tokenized;
//! 2. [`queue`]: the router queue, while every worker is past the queue threshold (tenants
//!    served fairly within priority bands);
//! 3. [`place`]: shedding (busy workers), then routing (built-in mode or plugin) → a worker,
//!    a route receipt and the booking moved onto it; on a model with prefill workers,
//!    [`disaggregate`] first runs the prefill leg there, and the placement then picks the
//!    decode worker;
//!    then [`hold`]: with `routing.prefill_gate`, a long streamed prompt waits for the long
//!    prompt ahead on its worker to begin its last step or produce its first token;
//! 4. [`leg`]: one upstream attempt, up to its first body byte under one deadline;
//! 5. [`relay`]: the response streamed to the client while watching for a disconnect; a
//!    stream whose worker fails or that an operator moves continues elsewhere ([`migrate`],
//!    one more leg, followed by [`track`]);
//! 6. [`record`]: metrics, logs and the registry's final status.
//!
//! [`serve`] runs them; the loop over attempts before the first byte is explicit in
//! [`serve_attempts`] (a retry, or a move ordered while waiting, is one more turn of it; the
//! request's [`attempts::Attempts`] keep where it went).

pub mod admit;
pub mod attempts;
pub mod disaggregate;
pub mod fields;
pub mod hold;
pub mod kv_inputs;
pub mod leg;
pub mod limit;
pub mod migrate;
pub mod outcome;
pub mod parsed;
pub mod pd;
pub mod place;
pub mod prompt;
pub mod queue;
pub mod record;
pub mod relay;
pub mod state;
pub mod stored;
pub mod tenancy;
pub mod track;
pub mod view;

use crate::downstream::conn::ClientConn;
use crate::downstream::io::respond_error;
pub use crate::endpoint::Endpoint;
use crate::error::{GatewayError, LegError};
use crate::gateway::Gateway;
use crate::move_order::{MoveOrder, MoveRefused, MoveReport};
use kvgate_filters::cancel::RequestContext;
use leg::Step;
use outcome::Outcome;
use place::Among;
use relay::Relayed;
pub use state::RequestState;
use std::sync::Arc;
use std::time::Instant;

/// Serves one request end to end. Returns true when the client connection must be aborted
/// (the response was cut by a failing worker).
pub async fn serve(gw: &Arc<Gateway>, session: &mut ClientConn, endpoint: Endpoint) -> bool {
    let start = Instant::now();
    // The request's id lives in its cancellation context, shared, never copied.
    let ctx = RequestContext::new(admit::request_id(session));
    // Counted for draining from the first byte, before the model is known.
    let _counted = gw.track();
    // Counted for its client before its body is read: a client over its limit costs no more.
    let _slot = match gw.client_limits.acquire(session, &gw.config().per_client) {
        Ok(slot) => slot,
        Err(over) => {
            gw.metrics.client_limited.inc();
            let outcome = Outcome::Refused(GatewayError::ClientLimit(over.0));
            respond(session, &outcome, ctx.id(), endpoint).await;
            record::refused_early(gw, endpoint, &outcome);
            return false;
        }
    };
    let mut req = match admit::admit(gw, session, endpoint, ctx.clone(), start).await {
        Ok(req) => req,
        Err(outcome) => {
            respond(session, &outcome, ctx.id(), endpoint).await;
            record::refused_early(gw, endpoint, &outcome);
            return false;
        }
    };
    let outcome = run(gw, session, &mut req).await;
    respond(session, &outcome, ctx.id(), endpoint).await;
    record::finished(gw, &mut req, &outcome);
    matches!(outcome, Outcome::Truncated(_))
}

/// The phases after admission.
async fn run(gw: &Arc<Gateway>, session: &mut ClientConn, req: &mut RequestState) -> Outcome {
    let model = req.model.clone();
    let gauge = &model.metrics(&gw.metrics).requests_in_flight;
    gauge.inc();
    prompt::tokenize(gw, req).await;
    if let Some(t) = &req.trace {
        t.phase("kvgate.admit", req.start, Vec::new);
    }
    let admitted = match limit::admit(gw, req) {
        Ok(()) => queue::wait(gw, session, req).await,
        Err(outcome) => Err(outcome),
    };
    let outcome = match admitted {
        Err(outcome) => outcome,
        Ok(()) => {
            limit::serving(req);
            prompt::prepare_kv(req);
            match disaggregate::run(gw, session, req).await {
                Ok(()) => serve_attempts(gw, session, req).await,
                Err(outcome) => outcome,
            }
        }
    };
    gauge.dec();
    outcome
}

/// Place → leg → relay, once per attempt, until a leg answers or no retry is allowed. A move
/// ordered while the worker has not answered yet, or a stream's first token has not come,
/// resends the request where the order says (the worker's copy is dropped with the leg); so
/// does a worker failing before that first token, as a retry. A stream whose head went out and
/// that no worker then answers is cut: no error answer can follow its head.
async fn serve_attempts(gw: &Arc<Gateway>, session: &mut ClientConn, req: &mut RequestState) -> Outcome {
    match attempt_loop(gw, session, req).await {
        Outcome::Refused(e) if session.head_sent() => {
            tracing::warn!(request_id = req.id(), error = %e, "no worker answered the stream after its head went out; cutting it");
            Outcome::Truncated(200)
        }
        outcome => outcome,
    }
}

/// The loop of [`serve_attempts`].
async fn attempt_loop(gw: &Arc<Gateway>, session: &mut ClientConn, req: &mut RequestState) -> Outcome {
    let max = req.cfg.retries.max_attempts.max(1) as usize;
    let mut last: Option<LegError> = None;
    let mut order: Option<MoveOrder> = None;
    while req.attempts.count() < max || order.is_some() {
        let worker = match next_worker(gw, session, req, order.take()).await {
            Placed::On(w) => w,
            Placed::Again => continue,
            // No untried worker left: the answer below says why the tried ones failed.
            Placed::NoneLeft => break,
            Placed::Over(outcome) => return outcome,
        };
        let tried = req.attempts.count();
        let may_retry = tried < max && tried < req.model.answering_workers();
        match turn(gw, session, req, &worker, may_retry).await {
            Turn::Over(outcome) => return outcome,
            Turn::Retry(e) => last = Some(e),
            Turn::Move(o) => order = Some(o),
        }
    }
    match last {
        Some(leg) => Outcome::Refused(GatewayError::from_leg(req.model_name(), leg)),
        None => Outcome::Refused(GatewayError::NoHealthyWorker(req.model_name().to_string())),
    }
}

/// Where the next attempt goes.
enum Placed {
    /// This worker (placed, booked).
    On(Arc<crate::fleet::Worker>),
    /// Nowhere yet: look again (an order was refused, or a pause ended).
    Again,
    /// No untried worker is left.
    NoneLeft,
    /// The request ends.
    Over(Outcome),
}

/// Places the next attempt: where `order` says, or as the routing mode says (a retry after
/// the first attempt).
async fn next_worker(gw: &Arc<Gateway>, session: &mut ClientConn, req: &mut RequestState, order: Option<MoveOrder>) -> Placed {
    if req.attempts.count() > 0 {
        req.pd.decode_leg_spent();
    }
    if let Some(o) = order {
        return reroute(gw, req, o).map_or(Placed::Again, Placed::On);
    }
    if req.attempts.count() > 0 {
        gw.metrics.retries.with_label_values(&[req.model_name()]).inc();
    }
    match place::place(gw, req) {
        Ok(w) => Placed::On(w),
        Err(GatewayError::NoHealthyWorker(_)) => Placed::NoneLeft,
        // Paused since the request passed phase 2: it waits there again. A wait that had
        // nothing to wait for would only spin: the pause is the answer then.
        Err(GatewayError::Paused(m)) => match queue::wait_resumed(gw, session, req).await {
            Ok(true) => Placed::Again,
            Ok(false) => Placed::Over(Outcome::Refused(GatewayError::Paused(m))),
            Err(outcome) => Placed::Over(outcome),
        },
        Err(e) => Placed::Over(Outcome::Refused(e)),
    }
}

/// What one attempt led to.
enum Turn {
    /// The request is over.
    Over(Outcome),
    /// The leg failed and another worker may take the request.
    Retry(LegError),
    /// An order moves the request before its first byte.
    Move(MoveOrder),
}

/// One attempt on `worker`: its leg and, once the worker answers, the relay. A leg's end, and
/// a stream's before its first byte, go through [`leg::LegEnd::step`].
async fn turn(gw: &Arc<Gateway>, session: &mut ClientConn, req: &mut RequestState, worker: &Arc<crate::fleet::Worker>, may_retry: bool) -> Turn {
    if let Err(outcome) = hold::hold(gw, session, req).await {
        return Turn::Over(outcome);
    }
    let out = leg::Outbound::original(req);
    let mut end = leg::run(session, req, worker, &out, may_retry).await;
    loop {
        match end.step(gw, session, req, worker) {
            Step::Relay(leg) => {
                stored::answered(gw, req.stored.as_ref(), &leg.worker, leg.ex.status);
                match relay::relay(gw, session, req, leg).await {
                    Relayed::Done(outcome) => return Turn::Over(outcome),
                    Relayed::Ended(before_first_byte) => end = before_first_byte,
                }
            }
            Step::Retry(e) => return Turn::Retry(e),
            Step::Refuse(e) => return Turn::Over(Outcome::Refused(GatewayError::from_leg(req.model_name(), e))),
            Step::Move(o) => return Turn::Move(o),
            Step::ClientGone => return Turn::Over(record::cancelled(gw, req)),
        }
    }
}

/// Places a request an order moved before its first byte: on the aimed worker, else on the
/// routing mode's choice among the others. `None` (the order refused) when no worker takes
/// it; the caller then places it as a retry.
fn reroute(gw: &Gateway, req: &mut RequestState, o: MoveOrder) -> Option<Arc<crate::fleet::Worker>> {
    let leaving = req.attempts.current().map(|i| req.model.workers[i].clone());
    let from = leaving.as_ref().map_or_else(String::new, |w| w.label.clone());
    let (from_idx, to) = place::adopt_for_move(gw, req, leaving.as_ref(), o.to.as_ref());
    let placed = match to {
        Some(t) => place::place_among(gw, req, Among::Only(t)),
        None => place::place_among(gw, req, Among::Except(&from_idx.into_iter().collect::<Vec<_>>())),
    };
    let reason = o.reason;
    let counted = |outcome: &str| gw.metrics.migrations.with_label_values(&[req.model_name(), reason.label(), outcome]).inc();
    match placed {
        Ok(w) => {
            counted("ok");
            req.entry().moved();
            if let Some(t) = &req.trace {
                t.moving(&from, &w.label, reason.label());
            }
            o.answer(Ok(MoveReport { from, to: w.label.clone(), how: "resend", generated: 0 }));
            Some(w)
        }
        Err(e) => {
            counted("failed");
            o.answer(Err(MoveRefused::Failed(e.to_string())));
            // Nothing is running for it now: it is placed again as a retry would be.
            req.attempts.forget_current();
            None
        }
    }
}

/// Answers a refusal, in the Anthropic API's error shape on its endpoints; other outcomes were
/// answered (or cut) by the relay.
async fn respond(session: &mut ClientConn, outcome: &Outcome, rid: &str, endpoint: Endpoint) {
    let Outcome::Refused(e) = outcome else { return };
    let ce = e.client_error();
    let ce = if endpoint.anthropic_errors() { ce.anthropic() } else { ce };
    if matches!(e, GatewayError::Draining) {
        // The connection writes `Connection: close` itself.
        session.close_after();
    }
    respond_error(session, &ce, &[("x-request-id", rid.to_string())]).await;
}

#[cfg(test)]
mod tests;
