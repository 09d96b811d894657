//! Phase 4, one upstream leg: send the client's body to the chosen worker and wait for the
//! response header and the first body byte, under one deadline (`timeouts.first_byte_ms`,
//! from the moment the request was sent), while watching the client. The client's header waits for the worker's first body bytes:
//! vLLM sends a stream's 200 at once and its first token after the prefill, so a worker that
//! dies before its first token can still be replaced without the client noticing.
//!
//! Every failure is a typed [`LegError`] whose kind decides what happens next: retryable kinds
//! go to another worker, the rest end the request.

use super::RequestState;
use crate::config::Config;
use crate::downstream::closed::client_closed;
use crate::downstream::conn::ClientConn;
use crate::error::{LegError, LegErrorKind};
use crate::fleet::Worker;
use crate::move_order::MoveOrder;
use crate::upstream::{self, Exchange, Outgoing};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

/// A leg that answered: the worker's response header and first body bytes.
pub struct Leg {
    /// The connection and the response header.
    pub ex: Exchange,
    /// The first body bytes (`None`: the body was empty).
    pub first: Option<Bytes>,
    /// The worker that answered.
    pub worker: Arc<Worker>,
}

/// How a leg ended.
pub enum LegEnd {
    /// The worker answered; the response can be relayed.
    Answered(Box<Leg>),
    /// The leg failed before anything reached the client.
    Failed(LegError),
    /// The client went away meanwhile.
    ClientGone,
    /// An order moved the request before its first byte: it is sent elsewhere (the leg, and
    /// with it the worker's copy of the request, is dropped).
    Reroute(MoveOrder),
}

/// What a leg sends.
pub struct Outbound<'a> {
    /// The worker's path.
    pub path: &'static str,
    /// The body.
    pub body: &'a Bytes,
    /// The `X-Request-Id` the worker sees (a continuation's differs from the original's, so a
    /// worker that still holds the aborted original never sees the id twice).
    pub request_id: std::borrow::Cow<'a, str>,
    /// Whether a move order ends the wait (a first placement; a continuation is already one).
    pub orders: bool,
}

impl<'a> Outbound<'a> {
    /// The client's request, as admitted.
    pub fn original(req: &'a RequestState) -> Self {
        Self { path: req.endpoint.path(), body: &req.body, request_id: req.id().into(), orders: true }
    }
}

/// Runs one leg to `worker`. `may_retry`: another worker may still be tried, so a 5xx is
/// turned into a retryable error (when `retries.on_5xx`) instead of being passed on.
pub async fn run(session: &mut ClientConn, req: &RequestState, worker: &Arc<Worker>, out: &Outbound<'_>, may_retry: bool) -> LegEnd {
    let cfg = &req.cfg;
    let wire = match upstream::request_wire(session.req(), worker, out.path, out.body, &out.request_id) {
        Ok(w) => w,
        // Built from the client's own headers: another worker would fail the same way.
        Err(e) => return LegEnd::Failed(LegError::new(LegErrorKind::Send, &worker.url, e.to_string()).final_()),
    };
    let first_byte = (cfg.timeouts.first_byte_ms > 0).then(|| Duration::from_millis(cfg.timeouts.first_byte_ms));
    let answer = first_bytes(cfg, worker, &wire, first_byte, may_retry && cfg.retries.on_5xx);
    let mailbox = &req.entry().mailbox;
    let r = tokio::select! {
        biased;
        r = answer => r,
        _ = client_closed(session) => return LegEnd::ClientGone,
        order = mailbox.next(), if out.orders => return LegEnd::Reroute(order),
    };
    match r {
        Ok(leg) => LegEnd::Answered(Box::new(leg)),
        Err(e) => {
            if e.kind == LegErrorKind::Connect {
                // A refused connection is a health signal: count it now, not at the next probe.
                worker.observe_health(false, cfg.health.unhealthy_threshold, cfg.health.healthy_threshold);
            }
            LegEnd::Failed(e)
        }
    }
}

/// The exchange and the first body read. The first-byte deadline starts when the request was
/// sent (connecting has its own timeout) and covers the header and the first body bytes: no
/// header in time is a final 504; a header without a first byte in time is retryable (the
/// worker took the request and stalled).
async fn first_bytes(cfg: &Config, worker: &Arc<Worker>, wire: &[u8], first_byte: Option<Duration>, retry_5xx: bool) -> Result<Leg, LegError> {
    let mut ex = upstream::exchange(cfg, worker, Outgoing::Leg(wire), first_byte).await?;
    let status = ex.status;
    if retry_5xx && status >= 500 {
        // Dropping `ex` closes that connection.
        return Err(LegError::new(LegErrorKind::Status5xx, &worker.url, format!("answered {status}")));
    }
    let read = ex.response.read_body();
    let first = match first_byte {
        Some(limit) => match tokio::time::timeout_at((ex.sent_at + limit).into(), read).await {
            Ok(r) => r,
            Err(_) => return Err(LegError::new(LegErrorKind::BeforeFirstByte, &worker.url, "no first byte within timeouts.first_byte_ms")),
        },
        None => read.await,
    };
    match first {
        Ok(first) => Ok(Leg { ex, first, worker: worker.clone() }),
        Err(e) => Err(LegError::new(LegErrorKind::BeforeFirstByte, &worker.url, e.to_string()).with_source(e)),
    }
}
