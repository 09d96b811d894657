//! Phase 4, one upstream leg: send the client's body to the chosen worker and wait for the
//! response header and the first body byte, under one deadline (`timeouts.first_byte_ms`),
//! while watching the client. The client's header waits for the worker's first body bytes:
//! vLLM sends a stream's 200 at once and its first token after the prefill, so a worker that
//! dies before its first token can still be replaced without the client noticing.
//!
//! Every failure is a typed [`LegError`] whose kind decides what happens next: retryable kinds
//! go to another worker, the rest end the request.

use super::RequestState;
use crate::error::{LegError, LegErrorKind};
use crate::fleet::Worker;
use crate::gateway::Gateway;
use crate::http::client::client_closed;
use crate::upstream::{self, Exchange};
use bytes::Bytes;
use pingora::proxy::Session;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
}

/// Runs one leg to `worker`. `may_retry`: another worker may still be tried, so a 5xx is
/// turned into a retryable error (when `retries.on_5xx`) instead of being passed on.
pub async fn run(gw: &Gateway, session: &mut Session, req: &RequestState, worker: &Arc<Worker>, may_retry: bool) -> LegEnd {
    let cfg = gw.config();
    let header = match upstream::request_header(session.req_header(), worker, req.endpoint.path(), req.body.len(), req.id()) {
        Ok(h) => h,
        Err(e) => return LegEnd::Failed(LegError::new(LegErrorKind::Send, &worker.url, e.to_string()).final_()),
    };
    let got_header = AtomicBool::new(false);
    let answer = first_bytes(gw, worker, &header, &req.body, &got_header, may_retry && cfg.retries.on_5xx);
    let first_byte = cfg.timeouts.first_byte_ms;
    let bounded = async {
        if first_byte == 0 {
            return answer.await;
        }
        let limit = Duration::from_millis(first_byte);
        tokio::time::timeout(limit, answer).await.unwrap_or_else(|_| {
            // Without a header the worker is not answering at all: the client gets 504. After
            // one, the request was accepted but stalled: another worker may serve it.
            Err(match got_header.load(Ordering::Relaxed) {
                true => LegError::new(LegErrorKind::BeforeFirstByte, &worker.url, "no first byte within timeouts.first_byte_ms"),
                false => LegError::new(LegErrorKind::FirstByteTimeout, &worker.url, "no response within timeouts.first_byte_ms").final_(),
            })
        })
    };
    let r = tokio::select! {
        biased;
        r = bounded => r,
        _ = client_closed(session) => return LegEnd::ClientGone,
    };
    match r {
        Ok(leg) => LegEnd::Answered(Box::new(leg)),
        Err(e) => {
            if e.kind == LegErrorKind::Connect {
                // A refused connection is a health signal; don't wait for the next probe.
                worker.observe_health(false, cfg.health.unhealthy_threshold, cfg.health.healthy_threshold);
            }
            LegEnd::Failed(e)
        }
    }
}

/// The exchange and the first body read.
async fn first_bytes(
    gw: &Gateway,
    worker: &Arc<Worker>,
    header: &pingora::http::RequestHeader,
    body: &Bytes,
    got_header: &AtomicBool,
    retry_5xx: bool,
) -> Result<Leg, LegError> {
    let mut ex = upstream::exchange(gw, worker, header, Some(body)).await?;
    got_header.store(true, Ordering::Relaxed);
    let status = ex.header.status.as_u16();
    if retry_5xx && status >= 500 {
        // Dropping `ex` closes that connection.
        return Err(LegError::new(LegErrorKind::Status5xx, &worker.url, format!("answered {status}")));
    }
    match ex.session.read_response_body().await {
        Ok(first) => Ok(Leg { ex, first, worker: worker.clone() }),
        Err(e) => Err(LegError::new(LegErrorKind::BeforeFirstByte, &worker.url, e.to_string()).with_source(*e)),
    }
}
