//! Phase 5, the relay: the worker's response header goes to the client (with the request id and
//! the worker that answered), then its body chunk by chunk as it arrives, while watching for a
//! client disconnect (the worker connection is then dropped, not pooled, so vLLM aborts) and a
//! worker that stalls past `timeouts.upstream_read_idle_ms` or dies (the client's response is
//! cut, never ended cleanly). The first chunk ends the request's prefill on the worker; streamed
//! token events are counted for the registry and output-block bookings.
//!
//! A stream's head goes out before its first token ([`First::Awaited`]); until that token, a
//! worker that fails or stalls past `timeouts.first_byte_ms`, or a move order, sends the request
//! back to the attempts ([`Relayed::Ended`]), which resend it: the client has seen nothing of
//! the body, so the next worker's stream continues it unseen.
//!
//! A Messages stream its worker was sent as chat (`track::follow`) is answered in the Anthropic
//! API: what the tracker passes on (or the gateway adds at a stream's end) goes through the
//! request's `Reply` (Anthropic or Responses events), and so does an error answer's body.

use super::leg::{First, Leg, LegEnd};
use super::migrate::{self, Moved, NotMoved, Warming};
use super::outcome::Outcome;
use super::track::Tracker;
use super::{RequestState, record};
use crate::downstream::closed::client_closed;
use crate::downstream::conn::ClientConn;
use crate::error::{GatewayError, LegError, LegErrorKind};
use crate::fleet::Worker;
use crate::gateway::Gateway;
use crate::h1::response_head::ResponseHead;
use crate::idle_timer::IdleTimer;
use crate::inflight::Phase;
use crate::move_order::{Mailbox, MoveOrder, MoveReason, MoveRefused, MoveReport};
use crate::or_never::or_never;
use crate::sse::SseEventCounter;
use crate::upstream::{self, Exchange};
use bytes::{Bytes, BytesMut};
use prometheus::Histogram;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How relaying ended.
pub enum Relayed {
    /// The request is over.
    Done(Outcome),
    /// The leg ended before the stream's first byte (the worker failed or stalled, or a move
    /// was ordered): nothing of the body reached the client, so the attempts may send the
    /// request again, as [`LegEnd::step`] says.
    Ended(LegEnd),
}

/// Relays an answered leg to the client; a stream whose worker fails (or that an operator
/// moves) continues on another worker when it may (`migrate`).
pub async fn relay(gw: &Gateway, session: &mut ClientConn, req: &mut RequestState, leg: Box<Leg>) -> Relayed {
    let status = leg.ex.status;
    // Approximate mode learns from requests the worker took on (2xx); a stream whose first
    // token is still to come, once it comes (a worker failing before it may be replaced).
    if (200..300).contains(&status) && matches!(leg.first, First::Read(_)) {
        record_decision(gw, req);
    }
    // Only a stream that started is followed: an error answer passes as the worker sent it, or
    // reshaped for a client of another API.
    if status != 200 {
        req.track = None;
        if let Some(reply) = req.reply.as_mut() {
            reply.error_status();
        }
    }
    if !session.head_sent() {
        let rewritten = req.track.is_some() || req.reply.is_some();
        let header = match upstream::client_response_header(&leg.ex, req.id(), &leg.worker, req.cfg.worker_header, rewritten) {
            Ok(h) => h,
            Err(e) => return Relayed::Done(Outcome::Refused(GatewayError::BadUpstreamResponse(e.to_string()))),
        };
        if send_head(session, &header, &leg.first).await.is_err() {
            return Relayed::Done(record::cancelled(gw, req));
        }
    }
    relay_legs(gw, session, req, leg, status).await
}

/// Tells approximate kv mode that the worker serving `req` took it on, and the deployment's
/// other replicas with it.
fn record_decision(gw: &Gateway, req: &RequestState) {
    if let (Some(kv), Some(inputs), Some(idx)) = (&req.model.kv, &req.kv, req.attempts.current())
        && kv.record_decision(idx, &inputs.chain)
    {
        gw.cluster.share_decision(&req.model.name, &req.model.workers[idx].url, &inputs.chain);
    }
}

/// Writes the client's response head: queued to leave with the first body bytes when they are
/// in hand (one send), at once when a stream's first token is still awaited.
async fn send_head(session: &mut ClientConn, header: &ResponseHead, first: &First) -> std::io::Result<()> {
    session.queue_head(header)?;
    match first {
        First::Read(_) => Ok(()),
        First::Awaited { .. } => session.flush_queued().await,
    }
}

/// Relays the body of `leg`, then of each leg a move continues the stream on.
async fn relay_legs(gw: &Gateway, session: &mut ClientConn, req: &mut RequestState, mut leg: Box<Leg>, status: u16) -> Relayed {
    let mut progress = Progress::new(gw, req, status, leg.ex.sent_at);
    let mut warming: Option<Warming> = None;
    loop {
        let source = req.attempts.current().unwrap_or(0);
        let end = body(gw, session, req, &mut progress, *leg, &mut warming).await;
        if let Some(w) = warming.take() {
            w.order.answer(Err(MoveRefused::NotNow("the stream ended or its worker failed while the destination warmed up")));
        }
        let (reason, order) = match end {
            BodyEnd::Done(outcome) => return Relayed::Done(outcome),
            BodyEnd::BeforeFirstByte(end) => return Relayed::Ended(end),
            BodyEnd::Failed => (MoveReason::Failover, None),
            BodyEnd::Ordered(order) => (order.reason, Some(order)),
        };
        let to = order.as_ref().and_then(|o| o.to.clone());
        // Boxed: a move is rare and its futures are large; inline, they would grow every
        // request's future (docs/architecture.md, "Future sizes").
        let moved = Box::pin(migrate::continue_stream(gw, session, req, reason, source, to)).await;
        match Box::pin(settle(gw, session, req, moved, order, status)).await {
            Ok(next) => {
                progress.new_leg();
                leg = next;
            }
            Err(outcome) => return Relayed::Done(outcome),
        }
    }
}

/// What a move gave: the next leg, or how the request ends. The order (if one asked for the
/// move) gets its answer.
async fn settle(
    gw: &Gateway,
    session: &mut ClientConn,
    req: &mut RequestState,
    moved: Result<Moved, NotMoved>,
    order: Option<MoveOrder>,
    status: u16,
) -> Result<Box<Leg>, Outcome> {
    let answer = |r: Result<MoveReport, MoveRefused>| {
        if let Some(o) = order {
            o.answer(r);
        }
    };
    let end = match moved {
        Ok(Moved::Leg(next, report)) => {
            answer(Ok(report));
            return Ok(next);
        }
        Ok(Moved::Finished) => {
            answer(Err(MoveRefused::NotNow("finished")));
            // The chat request a Messages or Responses stream is sent as asks for usage.
            let usage = req.view.include_usage() || req.reply.is_some();
            req.track.as_ref().map(|t| t.synthetic_end(usage)).unwrap_or_default()
        }
        Err(NotMoved::ClientGone) => {
            answer(Err(MoveRefused::NotNow("the client left")));
            return Err(record::cancelled(gw, req));
        }
        Err(NotMoved::Refused(why)) => {
            answer(Err(why));
            // The worker's own error event, when it sent one, ends the stream as it would have.
            let Some(ev) = req.track.as_mut().and_then(Tracker::take_withheld) else { return Err(Outcome::Truncated(status)) };
            Bytes::from([&ev[..], b"data: [DONE]\n\n"].concat())
        }
    };
    let end = translate(req, end, true);
    if session.write_body(end, true).await.is_err() {
        return Err(record::cancelled(gw, req));
    }
    Err(Outcome::Served(status))
}

/// The client's bytes for `bytes` of the worker's answer (`end`: its last): the same, or turned
/// back into the client's API when its worker was asked in another.
fn translate(req: &mut RequestState, bytes: Bytes, end: bool) -> Bytes {
    match req.reply.as_mut() {
        Some(reply) => reply.answer(&bytes, end).into(),
        None => bytes,
    }
}

/// How relaying one leg's body ended.
enum BodyEnd {
    /// The request is over.
    Done(Outcome),
    /// The worker failed mid-stream (counted already); the stream may continue elsewhere.
    Failed,
    /// An operator ordered a move (checked: the request may move).
    Ordered(MoveOrder),
    /// The leg ended before the stream's first byte: the worker failed or stalled, or a move
    /// was ordered.
    BeforeFirstByte(LegEnd),
}

/// The leg whose body is being relayed, and where reading it stands.
struct Reading {
    ex: Exchange,
    worker: Arc<Worker>,
    /// What stopped the last gathering of chunks early (the body's end or a failure), still
    /// to be handled; or the first bytes the leg read.
    pending: Option<Result<Option<Bytes>, LegError>>,
    /// A stream's first token, while awaited: it has the first-byte deadline instead of the
    /// idle limit.
    awaited: Option<Awaited>,
    /// The limit on the worker's silence between two chunks.
    idle: Duration,
    /// One timer per leg, moved later before each read.
    stall: IdleTimer,
}

impl Reading {
    fn new(leg: Leg, idle: Duration) -> Self {
        let Leg { ex, first, worker } = leg;
        let (pending, awaited) = match first {
            First::Read(first) => (Some(Ok(first)), None),
            First::Awaited { deadline } => (None, Some(Awaited { deadline })),
        };
        Self { ex, worker, pending, awaited, idle, stall: IdleTimer::default() }
    }

    /// How long the next read may wait: while a stream's first token is awaited, until the
    /// first-byte deadline, or without a limit when there is none (long prefills are
    /// legitimate); else the idle limit.
    fn wait_limit(&self) -> Option<Duration> {
        match self.awaited {
            Some(Awaited { deadline: Some(deadline) }) => Some(deadline.saturating_duration_since(Instant::now())),
            Some(Awaited { deadline: None }) => None,
            None => Some(self.idle),
        }
    }
}

/// Relays one leg's body until it ends, fails or is moved.
async fn body(gw: &Gateway, session: &mut ClientConn, req: &mut RequestState, progress: &mut Progress, leg: Leg, warming: &mut Option<Warming>) -> BodyEnd {
    let mut r = Reading::new(leg, Duration::from_millis(req.cfg.timeouts.upstream_read_idle_ms));
    loop {
        let chunk = match r.pending.take() {
            Some(c) => c,
            None => {
                let mailbox = orders(req, r.awaited.is_some(), warming.as_ref());
                let next = next_chunk(session, &mut r, warming, mailbox).await;
                match waited(gw, session, req, &mut r, next, warming) {
                    Waited::Chunk(c) => c,
                    Waited::Again => continue,
                    Waited::End(end) => return end,
                }
            }
        };
        let failure = match chunk {
            Ok(body) => match deliver(gw, session, req, progress, &mut r, body).await {
                Delivered::More => continue,
                Delivered::Complete => {
                    let status = r.ex.status;
                    upstream::release(r.ex);
                    return BodyEnd::Done(Outcome::Served(status));
                }
                Delivered::ClientGone => return BodyEnd::Done(record::cancelled(gw, req)),
                Delivered::Failed(detail) => LegError::new(LegErrorKind::Midstream, &r.worker.url, detail),
            },
            Err(e) => e,
        };
        record::leg_failed(gw, req, &r.worker, &failure);
        return BodyEnd::Failed;
    }
}

/// A stream's first token, still awaited: by `deadline` when there is one.
#[derive(Clone, Copy)]
struct Awaited {
    deadline: Option<Instant>,
}

/// What a wait for the next chunk leads to.
enum Waited {
    /// A chunk (or the end of the body, or a failure) to deliver.
    Chunk(Result<Option<Bytes>, LegError>),
    /// Nothing to deliver yet (an order was taken or refused): wait again.
    Again,
    /// Relaying this leg is over.
    End(BodyEnd),
}

/// Acts on what the wait for the next chunk gave. While a stream's first token is awaited, a
/// failure or a move order sends the request back to the attempts; the first chunk ends that
/// wait and records the routing decision.
fn waited(gw: &Gateway, session: &ClientConn, req: &mut RequestState, r: &mut Reading, next: Next, warming: &mut Option<Warming>) -> Waited {
    let (worker, awaited) = (&r.worker, &mut r.awaited);
    match next {
        Next::Chunk(Err(e)) if awaited.is_some() => Waited::End(BodyEnd::BeforeFirstByte(LegEnd::Failed(no_first_byte(worker, e)))),
        Next::Order(o) if awaited.is_some() => elsewhere(worker, o).map_or(Waited::Again, |o| Waited::End(BodyEnd::BeforeFirstByte(LegEnd::Reroute(o)))),
        Next::Chunk(c) => {
            if awaited.take().is_some() {
                record_decision(gw, req);
            }
            Waited::Chunk(c)
        }
        Next::ClientGone => Waited::End(BodyEnd::Done(record::cancelled(gw, req))),
        Next::Warmed => warming.take().and_then(|w| ready_to_move(req, w.order)).map_or(Waited::Again, |o| Waited::End(BodyEnd::Ordered(o))),
        Next::Order(o) => match accept(session, req, worker, o) {
            Accepted::Move(order) => Waited::End(BodyEnd::Ordered(order)),
            Accepted::Warming(w) => {
                *warming = Some(w);
                Waited::Again
            }
            Accepted::Refused => Waited::Again,
        },
    }
}

/// How delivering a chunk to the client went.
enum Delivered {
    /// Written; the body goes on.
    More,
    /// Written, and the worker's body (so the client's response) is complete.
    Complete,
    /// The client could not be written to (counted as a cancellation by the caller).
    ClientGone,
    /// Written, but the worker reported an error in the stream (or cut it before `[DONE]`).
    Failed(String),
}

/// Writes a body chunk (`None`: the body's end) to the client, with every chunk the worker has
/// delivered since (what stopped that gathering early is left in `r.pending`); then records
/// what the tokens mean for the request.
async fn deliver(gw: &Gateway, session: &mut ClientConn, req: &mut RequestState, progress: &mut Progress, r: &mut Reading, body: Option<Bytes>) -> Delivered {
    let (bytes, end) = match body {
        Some(bytes) => {
            let (bytes, after) = coalesce(&mut r.ex, bytes, &r.worker.url);
            r.pending = after;
            (bytes, r.ex.response.is_done())
        }
        None => (Bytes::new(), true),
    };
    // Handed on, not shared: once written, nothing holds the read buffer, which can then be
    // reused for the next response (h1::spare).
    let (out, failure) = follow(gw, req, bytes, end);
    // When the worker's body is complete, end the client's in the same write.
    let end = end && failure.is_none();
    // The tokens go out first: what they mean for the request (its phase, bookings, TTFT / ITL,
    // calibration) is recorded after the write, timed before it.
    let counted = (!out.is_empty()).then(|| (out.clone(), Instant::now()));
    let written = if !out.is_empty() || end {
        session.write_body(out, end).await
    } else {
        // Nothing to write yet (an event cut in two): the queued head, if any, goes now, so the
        // client sees the status while the stream goes on.
        session.flush_queued().await
    };
    if let Some((out, ready_at)) = counted {
        progress.chunk(gw, req, &out, ready_at);
    }
    match (written, failure) {
        (Err(_), _) => Delivered::ClientGone,
        (Ok(()), Some(detail)) => Delivered::Failed(detail),
        (Ok(()), None) if end => Delivered::Complete,
        (Ok(()), None) => Delivered::More,
    }
}

/// The request's mailbox, when a move order may end the wait for the next chunk: while a
/// stream's first token is awaited (the request is then resent), or while a stream that may
/// move is not already warming a destination.
fn orders<'a>(req: &'a RequestState, awaited: bool, warming: Option<&Warming>) -> Option<&'a Mailbox> {
    let movable = req.track.as_ref().is_some_and(Tracker::movable) && warming.is_none();
    (awaited || movable).then(|| &req.entry().mailbox)
}

/// A worker that failed, or stalled past the first-byte deadline, before the stream's first
/// byte: a retryable leg error.
fn no_first_byte(worker: &Worker, e: LegError) -> LegError {
    let detail = match e.kind {
        LegErrorKind::Stalled => "no first byte within timeouts.first_byte_ms".to_string(),
        _ => e.detail.clone(),
    };
    let mut first = LegError::new(LegErrorKind::BeforeFirstByte, &worker.url, detail);
    first.source = e.source;
    first
}

/// A move order, unless it aims at the worker the request is on already (then answered, and
/// `None`).
fn elsewhere(worker: &Arc<Worker>, o: MoveOrder) -> Option<MoveOrder> {
    if o.to.as_ref().is_some_and(|t| Arc::ptr_eq(t, worker)) {
        o.answer(Err(MoveRefused::NotNow("the request is on that worker already")));
        return None;
    }
    Some(o)
}

/// What became of a move order read mid-stream.
enum Accepted {
    /// Move now.
    Move(MoveOrder),
    /// Warm the destination first; the stream goes on meanwhile.
    Warming(Warming),
    /// Answered with a refusal; the stream goes on.
    Refused,
}

/// Takes a move order read mid-stream: refused if the stream may not move or is on that worker
/// already; aimed at a worker, that worker is warmed first.
fn accept(session: &ClientConn, req: &RequestState, worker: &Arc<Worker>, o: MoveOrder) -> Accepted {
    let Some(o) = elsewhere(worker, o).and_then(|o| ready_to_move(req, o)) else { return Accepted::Refused };
    match o.to.clone() {
        Some(to) => match migrate::warm_up(req, session, &to, o) {
            Ok(w) => Accepted::Warming(w),
            Err(o) => Accepted::Move(o),
        },
        None => Accepted::Move(o),
    }
}

/// The order if the stream may move now (checked when it arrives, and again after a warm-up:
/// the stream may have finished or been pinned meanwhile); otherwise the order is answered and
/// `None`.
fn ready_to_move(req: &RequestState, order: MoveOrder) -> Option<MoveOrder> {
    match migrate::may_move(req) {
        Ok(()) => Some(order),
        Err(why) => {
            order.answer(Err(why));
            None
        }
    }
}

/// Passes a chunk through the stream's tracker, if it has one, and then through the request's
/// translation back into the client's API, if any: the bytes for the client, and the error the
/// worker reported in the stream, if any.
fn follow(gw: &Gateway, req: &mut RequestState, bytes: Bytes, end: bool) -> (Bytes, Option<String>) {
    let (out, failure) = track(gw, req, bytes, end);
    // A leg that failed is not the answer's end: the stream continues elsewhere, or is ended by
    // `settle`.
    let last = end && failure.is_none();
    (translate(req, out, last), failure)
}

/// [`follow`]'s first half: the tracker's part.
fn track(gw: &Gateway, req: &mut RequestState, bytes: Bytes, end: bool) -> (Bytes, Option<String>) {
    let Some(t) = req.track.as_mut().filter(|t| !t.passes_through()) else { return (bytes, None) };
    let mut fed = t.feed(&bytes);
    if end && fed.failure.is_none() {
        if t.movable() && !t.done() {
            // vLLM always ends a stream with `[DONE]`: a body that ends before it was cut.
            fed.failure = Some("the worker ended the stream before [DONE]".into());
        } else {
            let rest = t.finish();
            if !rest.is_empty() {
                fed.out = [fed.out, rest].concat().into();
            }
        }
    }
    if let Some(reason) = fed.pinned {
        record::pinned(gw, req.entry(), req.model_name(), reason);
    }
    (fed.out, fed.failure)
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
    while !ex.response.is_done() && gathered.as_ref().map_or(first.len(), BytesMut::len) < MAX_COALESCED {
        match ex.response.read_body_now() {
            None => break,
            Some(Ok(Some(more))) => gathered.get_or_insert_with(|| BytesMut::from(&first[..])).extend_from_slice(&more),
            Some(Ok(None)) => {
                after = Some(Ok(None));
                break;
            }
            Some(Err(e)) => {
                after = Some(Err(LegError::new(LegErrorKind::Midstream, worker, e.to_string()).with_source(e)));
                break;
            }
        }
    }
    (gathered.map_or(first, BytesMut::freeze), after)
}

/// What the wait for the next body chunk gave.
enum Next {
    /// A chunk, the end, or a stall or failure as a [`LegError`].
    Chunk(Result<Option<Bytes>, LegError>),
    /// The client left.
    ClientGone,
    /// A move was ordered.
    Order(MoveOrder),
    /// The destination of the pending move is warm.
    Warmed,
}

/// Waits for the next body chunk, the client leaving, or (with `orders`: a stream that may move,
/// or whose first token is awaited) a move order.
async fn next_chunk(session: &mut ClientConn, r: &mut Reading, warming: &mut Option<Warming>, orders: Option<&Mailbox>) -> Next {
    let limit = r.wait_limit();
    let Reading { ex, worker, stall, .. } = r;
    let worker = &worker.url;
    let warm = or_never(warming.as_mut().map(|w| &mut w.done));
    let stalled = or_never(limit.map(|limit| stall.arm(limit)));
    // The client leaving, orders and a finished warm-up are looked at before the worker's next
    // chunk: a worker that always has the next chunk ready (a fast model, a gateway behind)
    // would otherwise keep a departed client's request running, or an order waiting, until the
    // stream ended. All are rare, and a pending one costs a poll.
    tokio::select! {
        biased;
        _ = client_closed(session) => Next::ClientGone,
        o = or_never(orders.map(Mailbox::next)) => Next::Order(o),
        () = warm => Next::Warmed,
        r = ex.response.read_body() => Next::Chunk(r.map_err(|e| LegError::new(LegErrorKind::Midstream, worker, e.to_string()).with_source(e))),
        () = stalled => Next::Chunk(Err(LegError::new(LegErrorKind::Stalled, worker, "worker stalled past timeouts.upstream_read_idle_ms"))),
    }
}

/// What each chunk means for the request: prefill done, tokens generated, TTFT and ITL.
struct Progress {
    ttft: Option<Histogram>,
    itl: Option<Histogram>,
    start: Instant,
    /// When the first leg's request went to its worker (its TTFT calibrates that worker).
    sent: Instant,
    last: Option<Instant>,
    events: Option<SseEventCounter>,
    /// The next chunk is a new leg's first (after a move).
    fresh_leg: bool,
}

impl Progress {
    fn new(gw: &Gateway, req: &RequestState, status: u16, sent: Instant) -> Self {
        let timed = req.stream && status == 200;
        let m = &req.model.metrics(&gw.metrics).endpoints[req.endpoint.index()];
        Self {
            ttft: timed.then(|| m.ttft.clone()),
            itl: timed.then(|| m.itl.clone()),
            start: req.start,
            sent,
            last: None,
            events: req.stream.then(SseEventCounter::default),
            fresh_leg: true,
        }
    }

    /// The stream moved: the next chunk comes from a new worker.
    fn new_leg(&mut self) {
        self.fresh_leg = true;
    }

    /// Records a chunk the client was sent, ready to write at `now` (read from the worker and
    /// cut into whole events).
    fn chunk(&mut self, gw: &Gateway, req: &mut RequestState, bytes: &[u8], now: Instant) {
        let fresh = std::mem::take(&mut self.fresh_leg);
        // The gap before a moved stream's first event is the move's pause, not the new
        // worker's inter-token latency.
        let moved_in = fresh && self.last.is_some();
        if fresh {
            // The first token ends the request's prefill on the worker.
            if let Some(b) = req.attempts.booking_mut() {
                b.prefill_done(self.ttft.is_some());
            }
            req.entry().set_phase(Phase::Running);
            if let Some(prev) = self.last {
                gw.metrics.migration_pause.with_label_values(&[req.model_name()]).observe(now.duration_since(prev).as_secs_f64());
            }
        }
        // A streamed token marks the end of an engine step there (an error body or a unary
        // answer does not).
        if self.ttft.is_some()
            && let Some((i, _)) = req.serving()
        {
            req.model.ledger.step_ended(i as u16);
        }
        if let Some(t) = req.tenant.as_mut() {
            t.scan(bytes);
        }
        let mut events = 1;
        if let Some(counter) = self.events.as_mut() {
            let n = counter.feed(bytes);
            events = n.max(1);
            req.entry().generated(n);
            if let Some(t) = req.tenant.as_mut() {
                t.streamed(n);
            }
            // Output blocks are booked in kv mode only, where prompt blocks are real.
            if let (Some(b), Some(_)) = (req.attempts.booking(), &req.kv) {
                b.generated(n);
            }
        }
        match (self.last, &self.ttft, &self.itl) {
            (None, Some(ttft), _) => {
                let took = now.duration_since(self.start);
                ttft.observe(took.as_secs_f64());
                req.ttft = Some(took);
                super::disaggregate::first_token(gw, req, now);
                calibrate_prefill(req, now.duration_since(self.sent));
            }
            (Some(prev), _, Some(itl)) if !moved_in => {
                itl.observe(now.duration_since(prev).as_secs_f64());
                if let Some((i, w)) = req.serving() {
                    // The rescheduler's TPOT predictor reads it per worker.
                    w.observe_itl(now.duration_since(prev));
                    // A read can carry several events (coalesced, or vLLM's --stream-interval):
                    // a step is the gap per event.
                    calibrate_step(req, i, w, now.duration_since(prev) / events as u32);
                }
            }
            _ => {}
        }
        self.last = Some(now);
    }
}

/// The `time` cost learns the worker's prefill speed from a stream's first token on the
/// worker it was placed on (docs/routing.md, "The time cost").
fn calibrate_prefill(req: &RequestState, ttft: std::time::Duration) {
    // A decode leg's first token waited for a KV transfer, not a prefill.
    if req.pd.transferred {
        return;
    }
    let (Some(p), Some((_, w)), Some(priors)) = (req.attempts.predicted(), req.serving(), req.model.time_priors()) else { return };
    let factor_then = p.ms_per_prefill_token / priors.ms_per_prefill_token;
    w.calibration.observe_prefill(ttft.as_secs_f64() * 1000.0 - p.join_ms, p.wait_ms + p.prefill_ms, p.steps_ms, factor_then);
}

/// The `time` cost learns the worker's step time from each inter-token gap, against what its
/// priors predict for the load booked there now (`w`, worker `i` of the model).
fn calibrate_step(req: &RequestState, i: usize, w: &Worker, gap: std::time::Duration) {
    let Some(priors) = req.model.time_priors() else { return };
    let id = i as u16;
    let load =
        kvgate_filters::route::Candidate { in_flight: req.model.ledger.requests(id), active_blocks: req.model.ledger.active_blocks(id), ..Default::default() };
    w.calibration.observe_step(gap.as_secs_f64() * 1000.0, priors.step_ms(&load, req.model.cfg.block_size));
}
