//! Phase 5, the relay: the worker's response header goes to the client (with the request id and
//! the worker that answered), then its body chunk by chunk as it arrives, while watching for a
//! client disconnect (the worker connection is then dropped, not pooled, so vLLM aborts) and a
//! worker that stalls past `timeouts.upstream_read_idle_ms` or dies (the client's response is
//! cut, never ended cleanly). The first chunk ends the request's prefill on the worker; streamed
//! token events are counted for the registry and output-block bookings.

use super::leg::Leg;
use super::{Outcome, RequestState, record};
use crate::downstream::closed::client_closed;
use crate::error::{GatewayError, LegError, LegErrorKind};
use crate::gateway::Gateway;
use crate::inflight::Phase;
use crate::sse::SseEventCounter;
use crate::upstream::{self, Exchange};
use bytes::{Bytes, BytesMut};
use pingora::proxy::Session;
use prometheus::Histogram;
use std::time::{Duration, Instant};

/// Relays an answered leg to the client.
pub async fn relay(gw: &Gateway, session: &mut Session, req: &mut RequestState, leg: Box<Leg>) -> Outcome {
    let Leg { mut ex, first, worker } = *leg;
    let status = ex.header.status.as_u16();
    // Approximate mode learns from requests the worker took on (2xx).
    if (200..300).contains(&status)
        && let (Some(kv), Some(inputs), Some(idx)) = (&req.model.kv, &req.kv, req.tried.last().copied())
    {
        kv.record_decision(idx, &inputs.chain);
    }
    let header = match upstream::client_response_header(&ex.header, req.id(), &worker.label) {
        Ok(h) => h,
        Err(e) => return Outcome::Refused(GatewayError::BadUpstreamResponse(e.to_string())),
    };
    if session.write_response_header(Box::new(header), false).await.is_err() {
        return record::cancelled(gw, req);
    }
    let mut progress = Progress::new(gw, req, status);
    let idle = Duration::from_millis(req.cfg.timeouts.upstream_read_idle_ms);
    let keep = Duration::from_millis(req.cfg.timeouts.upstream_idle_ms);
    let mut pending = Some(Ok(first));
    loop {
        let chunk = match pending.take() {
            Some(c) => c,
            None => match next_chunk(session, &mut ex, &worker.url, idle).await {
                Some(c) => c,
                None => return record::cancelled(gw, req),
            },
        };
        match chunk {
            Ok(Some(bytes)) => {
                let (bytes, after) = coalesce(&mut ex, bytes, &worker.url);
                pending = after;
                progress.chunk(req, &bytes);
                // When the worker's body is complete, end the client's in the same write.
                let end = ex.session.response_done();
                if session.write_response_body(Some(bytes), end).await.is_err() {
                    return record::cancelled(gw, req);
                }
                if end {
                    upstream::release(gw, ex, keep).await;
                    return Outcome::Served(status);
                }
            }
            Ok(None) => break,
            Err(e) => {
                record::leg_failed(gw, req, &worker, &e);
                return Outcome::Truncated(status);
            }
        }
    }
    if session.write_response_body(None, true).await.is_err() {
        return record::cancelled(gw, req);
    }
    upstream::release(gw, ex, keep).await;
    Outcome::Served(status)
}

/// Most bytes gathered into one client write.
const MAX_COALESCED: usize = 64 * 1024;

/// Appends every body chunk the worker has already delivered, without waiting for more, so
/// chunks that arrived together (vLLM flushes several SSE events at once under load) go to the
/// client in one write instead of one write (and one syscall) each. Nothing waits for data that
/// has not arrived, so no token is delayed. Returns the bytes to write and what stopped the
/// gathering early (the end of the body or a failure), to be handled after the write.
fn coalesce(ex: &mut Exchange, first: Bytes, worker: &crate::config::UpstreamUrl) -> (Bytes, Option<Result<Option<Bytes>, LegError>>) {
    let mut gathered: Option<BytesMut> = None;
    let mut after = None;
    while !ex.session.response_done() && gathered.as_ref().map_or(first.len(), BytesMut::len) < MAX_COALESCED {
        match ready_now(ex.session.read_response_body()) {
            None => break,
            Some(Ok(Some(more))) => gathered.get_or_insert_with(|| BytesMut::from(&first[..])).extend_from_slice(&more),
            Some(Ok(None)) => {
                after = Some(Ok(None));
                break;
            }
            Some(Err(e)) => {
                after = Some(Err(LegError::new(LegErrorKind::Midstream, worker, e.to_string()).with_source(*e)));
                break;
            }
        }
    }
    (gathered.map_or(first, BytesMut::freeze), after)
}

/// Polls `f` once: its output if it is ready now. A read that is not ready consumed nothing
/// (Pingora's body reader keeps its parse state in the session, not in the future), so
/// dropping it loses no data.
fn ready_now<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

/// The next body chunk, a stall or failure as a [`LegError`], or `None` when the client left.
async fn next_chunk(session: &mut Session, ex: &mut Exchange, worker: &crate::config::UpstreamUrl, idle: Duration) -> Option<Result<Option<Bytes>, LegError>> {
    tokio::select! {
        biased;
        r = tokio::time::timeout(idle, ex.session.read_response_body()) => Some(match r {
            Ok(Ok(chunk)) => Ok(chunk),
            Ok(Err(e)) => Err(LegError::new(LegErrorKind::Midstream, worker, e.to_string()).with_source(*e)),
            Err(_) => Err(LegError::new(LegErrorKind::Stalled, worker, "worker stalled past timeouts.upstream_read_idle_ms")),
        }),
        _ = client_closed(session) => None,
    }
}

/// What each chunk means for the request: prefill done, tokens generated, TTFT and ITL.
struct Progress {
    ttft: Option<Histogram>,
    itl: Option<Histogram>,
    start: Instant,
    last: Option<Instant>,
    events: Option<SseEventCounter>,
}

impl Progress {
    fn new(gw: &Gateway, req: &RequestState, status: u16) -> Self {
        let timed = req.stream && status == 200;
        let m = &req.model.metrics(&gw.metrics).endpoints[req.endpoint.index()];
        Self {
            ttft: timed.then(|| m.ttft.clone()),
            itl: timed.then(|| m.itl.clone()),
            start: req.start,
            last: None,
            events: req.stream.then(SseEventCounter::default),
        }
    }

    fn chunk(&mut self, req: &mut RequestState, bytes: &[u8]) {
        let now = Instant::now();
        if self.last.is_none() {
            // The first token ends the request's prefill on the worker.
            if let Some(b) = req.booking.as_mut() {
                b.prefill_done();
            }
            req.entry().set_phase(Phase::Running);
        }
        if let Some(counter) = self.events.as_mut() {
            let n = counter.feed(bytes);
            req.entry().generated(n);
            // Output blocks are booked in kv mode only, where prompt blocks are real.
            if let (Some(b), Some(_)) = (req.booking.as_ref(), &req.kv) {
                b.generated(n);
            }
        }
        match (self.last, &self.ttft, &self.itl) {
            (None, Some(ttft), _) => ttft.observe(now.duration_since(self.start).as_secs_f64()),
            (Some(prev), _, Some(itl)) => itl.observe(now.duration_since(prev).as_secs_f64()),
            _ => {}
        }
        self.last = Some(now);
    }
}
