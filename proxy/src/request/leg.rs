//! Phase 4, one upstream leg: send the client's body to the chosen worker and wait for its
//! answer, under one deadline (`timeouts.first_byte_ms`, from the moment the request was sent,
//! covering the header and the first body byte), while watching the client.
//!
//! A unary answer is waited for up to its first body bytes. A stream's 200 is answered as
//! soon as its header is in (vLLM sends it at once and its first token after the prefill), so
//! the client gets its head at once, as from vLLM itself; the relay waits for the first token
//! under what is left of the deadline, and a worker that fails before it is replaced by
//! resending the request, which the client does not see (docs/migration.md, "Before the first
//! token").
//!
//! Every failure is a typed [`LegError`] whose kind decides what happens next: retryable kinds
//! go to another worker, the rest end the request. [`LegEnd::step`] is that rule, the one the
//! attempt loop and a move's destination both follow.

use super::{RequestState, record};
use crate::config::Config;
use crate::downstream::closed::client_closed;
use crate::downstream::conn::ClientConn;
use crate::error::{LegError, LegErrorKind};
use crate::fleet::Worker;
use crate::gateway::Gateway;
use crate::move_order::MoveOrder;
use crate::receipt::LegOutcome;
use crate::upstream::{self, Exchange, Outgoing};
use bytes::Bytes;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A leg that answered: the worker's response header and, unless it is a stream still in its
/// prefill, the first body bytes.
pub struct Leg {
    /// The connection and the response header.
    pub ex: Exchange,
    /// The first body bytes.
    pub first: First,
    /// The worker that answered.
    pub worker: Arc<Worker>,
}

/// A leg's first body bytes, as the leg left them.
pub enum First {
    /// Read (`None`: the body was empty).
    Read(Option<Bytes>),
    /// A stream's first token is not there yet: the relay reads it, by `deadline` when there is
    /// one (what is left of `timeouts.first_byte_ms`).
    Awaited {
        /// When the first byte is overdue.
        deadline: Option<Instant>,
    },
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

/// What follows a leg's end.
pub enum Step {
    /// Relay the worker's answer.
    Relay(Box<Leg>),
    /// Try another worker: nothing of this leg reached the client, and the failure says
    /// nothing about the request (counted).
    Retry(LegError),
    /// Give up: another worker would fail the same way (counted).
    Refuse(LegError),
    /// Send the request where the order says.
    Move(MoveOrder),
    /// The client left.
    ClientGone,
}

impl LegEnd {
    /// The one rule for what follows a leg's end, for the attempt loop and a move's
    /// destination alike; the placement's receipt records how the leg ended, and a failure is
    /// counted. A leg answered with another status than 200 once the client has its head (a
    /// resent stream, a continuation) cannot be passed on: it is a failure, retryable on a 5xx.
    pub fn step(self, gw: &Gateway, session: &ClientConn, req: &RequestState, worker: &Worker) -> Step {
        let end = match self {
            Self::Answered(leg) if session.head_sent() && leg.ex.status != 200 => Self::Failed(answered_after_head(&leg)),
            end => end,
        };
        let ended = |outcome| req.entry().receipt.lock().leg_ended(outcome);
        let traced = |outcome: &'static str, failed: bool| {
            if let Some(t) = &req.trace {
                t.leg_ended(outcome, failed);
            }
        };
        match end {
            Self::Answered(leg) => {
                ended(LegOutcome::Answered);
                Step::Relay(leg)
            }
            Self::Reroute(order) => {
                ended(LegOutcome::Moved);
                traced("moved", false);
                Step::Move(order)
            }
            Self::ClientGone => Step::ClientGone,
            Self::Failed(e) => {
                ended(LegOutcome::Failed(e.kind));
                traced(e.kind.label(), true);
                record::leg_failed(gw, req, worker, &e);
                if e.retryable { Step::Retry(e) } else { Step::Refuse(e) }
            }
        }
    }
}

/// The failure a leg answered with `status` (not 200) is, once the client has a 200 head.
fn answered_after_head(leg: &Leg) -> LegError {
    let status = leg.ex.status;
    let detail = format!("answered {status} after the client's 200 head went out");
    match status {
        500.. => LegError::new(LegErrorKind::Status5xx, &leg.worker.url, detail),
        // Another worker would refuse the same request the same way.
        _ => LegError::new(LegErrorKind::Response, &leg.worker.url, detail).final_(),
    }
}

/// What a leg sends.
pub struct Outbound<'a> {
    /// The method.
    pub method: &'a str,
    /// The worker's request target (path and query).
    pub path: &'a str,
    /// The body.
    pub body: &'a Bytes,
    /// The `X-Request-Id` the worker sees (a continuation's differs from the original's, so a
    /// worker that still holds the aborted original never sees the id twice).
    pub request_id: std::borrow::Cow<'a, str>,
    /// Whether a move order ends the wait (a first placement; a continuation is already one).
    pub orders: bool,
    /// Whether a stream's 200 is answered at its header, before its first token ([`First`]).
    /// The client's own request is; a continuation, whose client has its head already, waits
    /// for its first bytes, so that a destination that fails before them is passed over.
    pub head_first: bool,
}

impl<'a> Outbound<'a> {
    /// The client's request, as admitted (a disaggregated request's decode leg: with the
    /// transfer parameters its prefill leg returned).
    pub fn original(req: &'a RequestState) -> Self {
        let body = req.pd.decode_body.as_ref().unwrap_or(&req.body);
        Self { method: &req.forward.method, path: &req.forward.target, body, request_id: req.id().into(), orders: true, head_first: req.stream }
    }
}

/// Runs one leg to `worker`. `may_retry`: another worker may still be tried, so a 5xx is
/// turned into a retryable error (when `retries.on_5xx`) instead of being passed on.
pub async fn run(session: &mut ClientConn, req: &RequestState, worker: &Arc<Worker>, out: &Outbound<'_>, may_retry: bool) -> LegEnd {
    let cfg = &req.cfg;
    let kind = if out.orders { "attempt" } else { "continuation" };
    let traceparent = req.trace.as_ref().map(|t| t.leg(kind, &worker.label, req.attempts.count()));
    let wire = match crate::h1::request_head::write_forwarded(
        session.req(),
        worker.host_header.as_bytes(),
        out.method,
        out.path,
        out.body,
        &out.request_id,
        req.passed(traceparent.as_deref()),
    ) {
        Ok(w) => w,
        // Built from the client's own headers: another worker would fail the same way.
        Err(e) => return LegEnd::Failed(LegError::new(LegErrorKind::Send, &worker.url, e.to_string()).final_()),
    };
    let first_byte = (cfg.timeouts.first_byte_ms > 0).then(|| Duration::from_millis(cfg.timeouts.first_byte_ms));
    let answer = first_bytes(cfg, worker, &wire, first_byte, may_retry && cfg.retries.on_5xx, out.head_first);
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
/// worker took the request and stalled). A stream's 200 (`stream`) returns with its header,
/// and its first bytes if they came with it.
async fn first_bytes(cfg: &Config, worker: &Arc<Worker>, wire: &[u8], first_byte: Option<Duration>, retry_5xx: bool, stream: bool) -> Result<Leg, LegError> {
    let mut ex = upstream::exchange(cfg, worker, Outgoing::Leg(wire), first_byte).await?;
    let status = ex.status;
    if retry_5xx && status >= 500 {
        // Dropping `ex` closes that connection.
        return Err(LegError::new(LegErrorKind::Status5xx, &worker.url, format!("answered {status}")));
    }
    let first = if stream && status == 200 {
        match ex.response.read_body_now() {
            Some(read) => read.map(First::Read),
            None => Ok(First::Awaited { deadline: first_byte.map(|limit| ex.sent_at + limit) }),
        }
    } else {
        let read = ex.response.read_body();
        let read = match first_byte {
            Some(limit) => match tokio::time::timeout_at((ex.sent_at + limit).into(), read).await {
                Ok(r) => r,
                Err(_) => return Err(LegError::new(LegErrorKind::BeforeFirstByte, &worker.url, "no first byte within timeouts.first_byte_ms")),
            },
            None => read.await,
        };
        read.map(First::Read)
    };
    match first {
        Ok(first) => Ok(Leg { ex, first, worker: worker.clone() }),
        Err(e) => Err(LegError::new(LegErrorKind::BeforeFirstByte, &worker.url, e.to_string()).with_source(e)),
    }
}
