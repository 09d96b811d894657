//! Between placement and the leg: a long prompt waits at the gateway until the long prompt sent
//! ahead of it to the same worker has begun its last engine step, or produced its first token
//! (`routing.prefill_gate`). Sent at once, it would ride in that one's last step and delay its
//! first token by the room it fills; held, it starts about when it would have without that room
//! (the ledger's `prefill_gate` module says why). A prompt ahead whose expected output is too
//! short to carry that room in its decode lets the next go at once. Only streams pass the gate:
//! their first token says when the prefill ended.

use super::RequestState;
use super::outcome::Outcome;
use crate::downstream::closed::client_closed;
use crate::downstream::conn::ClientConn;
use crate::gateway::Gateway;
use crate::receipt::GateWait;
use kvgate_filters::ledger::prefill_gate::{Entry, GatePass};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Uncached prompt tokens from which a prompt passes the gate: below it, the room it could
/// fill in the step ahead costs that prompt less than the step a hold costs this one.
const GATED_TOKENS: u64 = 512;

/// The longest a prompt is held beyond the prefill predicted ahead of it and its own (a first
/// token lost on the way must not hold the worker's line for long).
const HOLD_SLACK: Duration = Duration::from_millis(50);

/// Holds `req` at its worker's gate when it must; `Err` when the client leaves meanwhile.
pub async fn hold(gw: &Arc<Gateway>, session: &mut ClientConn, req: &mut RequestState) -> Result<(), Outcome> {
    if !req.model.cfg.routing.prefill_gate || !req.stream {
        return Ok(());
    }
    let Some(b) = req.attempts.booking() else { return Ok(()) };
    if b.prefill_tokens() < GATED_TOKENS || b.prefill_time().is_zero() {
        return Ok(());
    }
    let shelters = keeps_last_step(req, b.output_estimate());
    let steps = chunks(req, b.worker(), b.prefill_tokens());
    let limit = req.model.ledger.prefill_backlog(b.worker()) + HOLD_SLACK;
    let began = Instant::now();
    let pass = match b.enter_gate(shelters, steps) {
        None => return Ok(()),
        Some(Entry::Pass(p)) => Some(p),
        Some(Entry::Wait(rx)) => wait_for_pass(gw, session, req, rx, limit).await?,
    };
    let wait = GateWait { waited: began.elapsed(), passed: pass.is_some(), keeps_last_step: shelters };
    gw.metrics.gate_wait.with_label_values(&[req.model_name()]).observe(wait.waited.as_secs_f64());
    if let Some(p) = req.entry().receipt.lock().placements.last_mut() {
        p.gate = Some(wait);
    }
    if let (Some(p), Some(b)) = (pass, req.attempts.booking_mut()) {
        b.hold(p);
    }
    Ok(())
}

/// Waits for the pass, at most `limit`; `None` when the wait ran out.
async fn wait_for_pass(
    gw: &Arc<Gateway>,
    session: &mut ClientConn,
    req: &RequestState,
    mut rx: oneshot::Receiver<GatePass>,
    limit: Duration,
) -> Result<Option<GatePass>, Outcome> {
    tokio::select! {
        p = &mut rx => Ok(p.ok()),
        () = tokio::time::sleep(limit) => {
            // A pass sent as the wait ran out is taken, not dropped: dropping it would let the
            // next prompt go while this one is on its way.
            rx.close();
            Ok(rx.try_recv().ok())
        }
        _ = client_closed(session) => Err(super::record::cancelled(gw, req)),
    }
}

/// The engine steps `tokens` of prefill take on worker `w`, in the `time` cost's step budget
/// for the requests decoding there.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss, reason = "a step count from token counts")]
fn chunks(req: &RequestState, w: u16, tokens: u64) -> u64 {
    let Some(priors) = req.model.time_priors() else { return 1 };
    let ledger = &req.model.ledger;
    let budget = priors.step_budget(f64::from(ledger.requests(w).saturating_sub(ledger.prefilling(w))));
    (tokens as f64 / budget).ceil() as u64
}

/// Whether the next long prompt on the worker waits for this one's last step: its expected
/// output, less the first token, is more tokens than a ms of TPOT is worth in TTFT. Keeping its
/// last step to itself moves that step's room from its first token into its decode, spread over
/// its output: worth it when the TTFT saved outweighs the TPOT added, at the rate the `time`
/// cost prices a stall (what a ms of TPOT is worth in TTFT).
fn keeps_last_step(req: &RequestState, expected_output: u64) -> bool {
    #[allow(clippy::cast_precision_loss, reason = "a token count")]
    let decode_steps = expected_output.saturating_sub(1) as f64;
    decode_steps > req.tpot_weight()
}
