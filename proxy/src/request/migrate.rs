//! Moving a running stream to another worker by continuation (docs/migration.md), as one more
//! leg of the request: the old leg is gone (dropped, so vLLM aborts it), and the destination
//! gets a `/v1/completions` request whose prompt is the prompt ids plus the ids generated so far,
//! asking for what remains with the same sampling parameters. Its events are re-wrapped by the
//! request's tracker, so the client sees one stream.
//!
//! The destination is chosen by the request's routing mode over the *whole* continuation
//! prompt (kv mode prefers the worker that already holds most of it), among healthy workers
//! other than the one it leaves, in the fleet in force (a worker added by a reload since the
//! request arrived is a destination too); an operator may aim at one worker. The booking moves with the
//! request. Each request moves at most `migration.limit` times; at most
//! `migration.max_concurrent` moves run at once.

use super::leg::{self, Leg, Outbound, Step};
use super::place::{self, Among};
use super::{RequestState, record};
use crate::downstream::conn::ClientConn;
use crate::fleet::Worker;
use crate::gateway::Gateway;
use crate::move_order::{MoveOrder, MoveReason, MoveRefused, MoveReport};
use crate::upstream::{self, Outgoing};
use bytes::Bytes;
use kvgate_filters::migrate::{ClientShape, Continuation, ContinuationError, PinReason};
use serde_json::Value;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// A move that went ahead.
pub enum Moved {
    /// The stream continues on this leg.
    Leg(Box<Leg>, MoveReport),
    /// Every token had been generated already: the stream only needs its end.
    Finished,
}

/// A move that did not.
pub enum NotMoved {
    /// The client left meanwhile.
    ClientGone,
    /// Not movable, or no destination took it.
    Refused(MoveRefused),
}

/// An ordered move waiting for its destination to be warmed up.
pub struct Warming {
    /// The order, carried out once the warm-up is over.
    pub order: MoveOrder,
    /// The warm-up request.
    pub done: Pin<Box<dyn Future<Output = ()> + Send>>,
}

/// Longest wait for a warm-up; the move goes ahead after it either way.
const WARM_UP_LIMIT: Duration = Duration::from_secs(30);

/// Prefills the destination with a running stream's context (prompt + generated ids so far,
/// `max_tokens: 1`) while the stream goes on on its worker, so the move that follows finds the
/// context in the destination's prefix cache and recomputes only the tokens generated since:
/// the client's pause shrinks from a whole prefill to about one step (docs/migration.md).
/// The order comes back (`Err`) when there is nothing to warm (no ids yet).
pub fn warm_up(req: &RequestState, session: &ClientConn, to: &Arc<Worker>, order: MoveOrder) -> Result<Warming, MoveOrder> {
    let Some(r) = req.track.as_ref().map(|t| &t.record).filter(|r| !r.prompt_ids.is_empty()) else { return Err(order) };
    let ids = r.context_ids();
    let model = req.view.model.clone().unwrap_or_else(|| req.model_name().to_string());
    let body = Bytes::from(serde_json::json!({"model": model, "prompt": ids, "max_tokens": 1, "add_special_tokens": false}).to_string());
    let Ok(wire) = crate::h1::request_head::write_forwarded(
        session.req(),
        to.host_header.as_bytes(),
        "POST",
        "/v1/completions",
        &body,
        &format!("{}-warm", req.id()),
        req.passed(None),
    ) else {
        return Err(order);
    };
    let (cfg, to) = (req.cfg.clone(), to.clone());
    let done = Box::pin(async move {
        let warm = async {
            let Ok(mut ex) = upstream::exchange(&cfg, &to, Outgoing::Leg(&wire), None).await else { return };
            while let Ok(Some(_)) = ex.response.read_body().await {}
            upstream::release(ex);
        };
        let _ = tokio::time::timeout(WARM_UP_LIMIT, warm).await;
    });
    Ok(Warming { order, done })
}

/// Whether `req` may move now; why not otherwise. Checked before an ordered move drops the
/// leg it would leave.
pub fn may_move(req: &RequestState) -> Result<(), MoveRefused> {
    match &req.track {
        Some(t) if t.done() || t.record.finished => return Err(MoveRefused::NotNow("finished")),
        Some(t) if t.movable() && !t.record.prompt_ids.is_empty() => {}
        Some(t) if t.movable() => return Err(MoveRefused::NotNow("no event from its worker yet")),
        _ => return Err(MoveRefused::Pinned(req.entry().pinned().unwrap_or("not_movable"))),
    }
    if req.entry().moves() >= u64::from(req.cfg.migration.limit) {
        return Err(MoveRefused::NotNow("migration.limit reached"));
    }
    if too_long(req) {
        return Err(MoveRefused::Pinned(PinReason::ContextTooLong.label()));
    }
    Ok(())
}

/// Whether the continuation (prompt + generated + one more token) would exceed the shortest
/// context among the workers that reported theirs (`/v1/models`).
fn too_long(req: &RequestState) -> bool {
    let Some(limit) = req.model.shortest_context() else { return false };
    req.track.as_ref().is_some_and(|t| t.record.prompt_ids.len() + t.record.generated_ids.len() + 1 > limit as usize)
}

/// Continues `req`'s stream elsewhere; `source` is the worker it leaves, `to` a destination an
/// operator chose.
pub async fn continue_stream(
    gw: &Gateway,
    session: &mut ClientConn,
    req: &mut RequestState,
    reason: MoveReason,
    source: usize,
    to: Option<Arc<Worker>>,
) -> Result<Moved, NotMoved> {
    let model = req.model_name().to_string();
    let count = |outcome: &str| gw.metrics.migrations.with_label_values(&[model.as_str(), reason.label(), outcome]).inc();
    // A continuation is computed where it goes: no transferred prompt to price.
    req.pd.decode_leg_spent();
    let (body, ids, generated) = match prepared(gw, req) {
        Ok(c) => c,
        Err((outcome, result)) => {
            count(outcome);
            return result;
        }
    };
    let _permit = gw.migrations.acquire().await.map_err(|_| NotMoved::Refused(MoveRefused::NotNow("shutting down")))?;
    req.entry().moved();
    let leaving = req.model.workers[source].clone();
    if let Some(t) = &req.trace {
        t.moving(&leaving.label, to.as_ref().map_or("(routed)", |w| w.label.as_str()), reason.label());
    }
    let (source, to) = place::adopt_for_move(gw, req, Some(&leaving), to.as_ref());
    if let Some(kv) = req.model.kv.clone() {
        // A continuation's prompt (the prompt and the ids generated) is salted as the first was.
        req.kv = Some(req.kv_inputs(&kv, &ids, req.kv.as_ref().and_then(|k| k.salt)));
    }
    let request_id = format!("{}-m{}", req.id(), req.entry().moves()).into();
    let out = Outbound { method: "POST", path: "/v1/completions", body: &body, request_id, orders: false, head_first: false };
    let leg = match destination(gw, session, req, &out, source, to, ids.len()).await {
        Ok(leg) => leg,
        Err(not) => {
            count("failed");
            return Err(not);
        }
    };
    count("ok");
    if let Some(t) = req.track.as_mut() {
        t.continuing();
    }
    let report = MoveReport { from: leaving.label.clone(), to: leg.worker.label.clone(), how: "continuation", generated };
    tracing::info!(request_id = req.id(), from = report.from.as_str(), to = report.to.as_str(), reason = reason.label(), generated, "stream moved");
    Ok(Moved::Leg(leg, report))
}

/// The continuation's body, its prompt ids and how many were generated; or, when there is
/// none to send, the move's `kvgate_migrations_total` outcome and its result.
type Prepared = Result<(Bytes, Vec<u32>, usize), (&'static str, Result<Moved, NotMoved>)>;

/// The continuation, if the stream may and needs to move.
fn prepared(gw: &Gateway, req: &mut RequestState) -> Prepared {
    // Every token was generated (and maybe `[DONE]` sent): only the end is missing.
    if req.track.as_ref().is_some_and(|t| t.done() || t.record.finished) {
        return Err(("finished", Ok(Moved::Finished)));
    }
    if let Err(why) = may_move(req) {
        if why == MoveRefused::Pinned(PinReason::ContextTooLong.label()) {
            record::pinned(gw, req.entry(), req.model_name(), PinReason::ContextTooLong);
        }
        let outcome = if matches!(why, MoveRefused::Pinned(_)) { "pinned" } else { "limit" };
        return Err((outcome, Err(NotMoved::Refused(why))));
    }
    match continuation(req) {
        Ok(c) => Ok(c),
        Err(ContinuationError::Finished) => Err(("finished", Ok(Moved::Finished))),
        // `may_move` refused a context that does not fit, and the rollback only shortens it.
        Err(e @ ContinuationError::TooLong { .. }) => Err(("failed", Err(NotMoved::Refused(MoveRefused::Failed(e.to_string()))))),
    }
}

/// The continuation's body, its prompt ids (prompt + generated), and how many were generated.
fn continuation(req: &mut RequestState) -> Result<(Bytes, Vec<u32>, usize), ContinuationError> {
    let name = req.model_name().to_string();
    let max_model_len = req.model.shortest_context();
    let Some(track) = req.track.as_mut() else { return Err(ContinuationError::Finished) };
    // Tokens whose text the client has not seen are generated again by the destination.
    track.record.roll_back_unseen();
    // Parsed at admission already, so it parses again.
    let original: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
    let model = original.get("model").and_then(Value::as_str).unwrap_or(&name).to_string();
    let r = &track.record;
    let c =
        Continuation { original: &original, chat: track.shape == ClientShape::Chat, prompt_ids: &r.prompt_ids, generated_ids: &r.generated_ids, max_model_len };
    let body = c.request(&model)?;
    let ids = r.context_ids();
    Ok((Bytes::from(body.to_string()), ids, r.generated_ids.len()))
}

/// Places and sends the continuation until a worker answers it: the aimed worker first (if
/// any), then the routing mode's choice among the others, each worker at most once.
async fn destination(
    gw: &Gateway,
    session: &mut ClientConn,
    req: &mut RequestState,
    out: &Outbound<'_>,
    source: Option<usize>,
    mut to: Option<usize>,
    prompt: usize,
) -> Result<Box<Leg>, NotMoved> {
    let mut left_out: Vec<usize> = source.into_iter().collect();
    loop {
        let among = match to.take() {
            Some(t) => Among::Only(t),
            None => Among::Except(&left_out),
        };
        let aimed = matches!(among, Among::Only(_));
        let worker = match place::place_among(gw, req, among) {
            Ok(w) => w,
            Err(_) if aimed => continue,
            Err(e) => return Err(NotMoved::Refused(MoveRefused::Failed(e.to_string()))),
        };
        let Some(idx) = req.attempts.current() else { return Err(NotMoved::Refused(MoveRefused::Failed("no placement".into()))) };
        // The registry counts the client's prompt, not the continuation's (which holds the
        // generated tokens it counts already).
        let prompt_len = req.track.as_ref().map_or(0, |t| t.record.prompt_ids.len() as u64);
        req.entry().placed(&worker, prompt_len);
        count_recomputed(gw, req, idx, prompt);
        let end = leg::run(session, req, &worker, out, true).await;
        match end.step(gw, session, req, &worker) {
            Step::Relay(leg) => return Ok(leg),
            Step::ClientGone => return Err(NotMoved::ClientGone),
            // A continuation the worker refuses (e.g. longer than its context) fails the same
            // way elsewhere.
            Step::Refuse(e) => return Err(NotMoved::Refused(MoveRefused::Failed(e.to_string()))),
            // A continuation's leg takes no orders: it is one already.
            Step::Move(order) => order.answer(Err(MoveRefused::NotNow("already moving"))),
            Step::Retry(_) => {}
        }
        left_out.push(idx);
    }
}

/// Counts the continuation prompt tokens worker `idx` does not hold (kv mode: its cached
/// leading blocks; otherwise the whole prompt).
fn count_recomputed(gw: &Gateway, req: &RequestState, idx: usize, prompt: usize) {
    let cached_blocks = req.kv.as_ref().zip(req.model.kv.as_ref()).map_or(0, |(inputs, kv)| {
        kv.rank_ids.get(idx).map_or(0, |ranks| ranks.iter().map(|&r| inputs.cached.get(r as usize).copied().unwrap_or(0)).max().unwrap_or(0))
    });
    let cached = (cached_blocks as usize * req.model.cfg.block_size as usize).min(prompt);
    gw.metrics.migration_recomputed.with_label_values(&[req.model_name()]).inc_by((prompt - cached) as u64);
}
