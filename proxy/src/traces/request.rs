//! One request's trace while it runs: its root span (a child of the client's `traceparent`,
//! when it sent one) and the spans of its phases. Phases that end where they begin (admission,
//! the queue, a placement) are recorded whole; a leg stays open until it ends, the next leg
//! begins, or the request ends, and a move until the leg it moves to begins.

use crate::h1::request_head::RequestHead;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Span, Tracer};
use parking_lot::Mutex;
use std::time::{Instant, SystemTime};

/// A request's spans. A request the sampler left out keeps its root's context only, to pass
/// on (unsampled) to its workers, and makes no other span.
pub struct RequestTrace {
    tracer: Tracer,
    /// The context holding the root span: the parent of every other.
    root: Context,
    /// Whether the root span records (the request is sampled).
    recording: bool,
    /// Legs and moves not ended yet.
    open: Mutex<Vec<(Part, Span)>>,
}

/// What an open span stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Leg,
    Move,
}

/// The client's request head, read for `traceparent` and `tracestate`.
struct Head<'a>(&'a RequestHead);

impl Extractor for Head<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.header(key).and_then(|v| std::str::from_utf8(v).ok())
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

/// The W3C `traceparent` naming the span of `sc`.
fn traceparent(sc: &opentelemetry::trace::SpanContext) -> String {
    format!("00-{:032x}-{:016x}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8())
}

/// When `at` was, on the wall clock.
fn wall(at: Instant) -> SystemTime {
    SystemTime::now().checked_sub(at.elapsed()).unwrap_or_else(SystemTime::now)
}

impl RequestTrace {
    /// The root span of a request that arrived at `arrived`, under the client's trace when
    /// its `traceparent` is valid.
    pub(super) fn start(tracer: &Tracer, client: &RequestHead, arrived: Instant) -> Self {
        let parent = TraceContextPropagator::new().extract(&Head(client));
        let root = tracer.span_builder("kvgate.request").with_kind(SpanKind::Server).with_start_time(wall(arrived)).start_with_context(tracer, &parent);
        let recording = root.is_recording();
        Self { tracer: tracer.clone(), root: parent.with_span(root), recording, open: Mutex::new(Vec::new()) }
    }

    /// Adds the attributes `attrs` makes to the request's own span (made only when sampled).
    pub fn describe(&self, attrs: impl FnOnce() -> Vec<KeyValue>) {
        if !self.recording {
            return;
        }
        let span = self.root.span();
        for kv in attrs() {
            span.set_attribute(kv);
        }
    }

    /// A phase that began at `began` and ends now, with the attributes `attrs` makes.
    pub fn phase(&self, name: &'static str, began: Instant, attrs: impl FnOnce() -> Vec<KeyValue>) {
        if !self.recording {
            return;
        }
        let mut span = self.child(name, SpanKind::Internal, wall(began), attrs());
        span.end();
    }

    /// A leg to `worker` begins (`kind`: `attempt`, `continuation`, `prefill`): the `traceparent`
    /// it carries, naming its span. Ends the legs and moves still open.
    pub fn leg(&self, kind: &'static str, worker: &str, attempt: usize) -> String {
        if !self.recording {
            return traceparent(&self.root.span().span_context().clone());
        }
        let attrs = vec![
            KeyValue::new("kvgate.leg", kind),
            KeyValue::new("server.address", worker.to_string()),
            KeyValue::new("kvgate.attempt", i64::try_from(attempt).unwrap_or(i64::MAX)),
        ];
        let span = self.child("kvgate.leg", SpanKind::Client, SystemTime::now(), attrs);
        let header = traceparent(span.span_context());
        let mut open = self.open.lock();
        for (_, mut s) in open.drain(..) {
            s.end();
        }
        open.push((Part::Leg, span));
        header
    }

    /// The open leg ended with `outcome` (`answered` legs stay open until their answer ends).
    pub fn leg_ended(&self, outcome: &'static str, failed: bool) {
        let mut open = self.open.lock();
        let Some(i) = open.iter().rposition(|(p, _)| *p == Part::Leg) else { return };
        let (_, mut span) = open.remove(i);
        span.set_attribute(KeyValue::new("kvgate.leg.outcome", outcome));
        if failed {
            span.set_status(Status::error(outcome));
        }
        span.end();
    }

    /// The request moves from worker `from` to `to`; the move's span ends when the next leg
    /// begins.
    pub fn moving(&self, from: &str, to: &str, how: &'static str) {
        if !self.recording {
            return;
        }
        let attrs =
            vec![KeyValue::new("kvgate.move.from", from.to_string()), KeyValue::new("kvgate.move.to", to.to_string()), KeyValue::new("kvgate.move.how", how)];
        let span = self.child("kvgate.move", SpanKind::Internal, SystemTime::now(), attrs);
        self.open.lock().push((Part::Move, span));
    }

    /// The request ended with HTTP `status`: its open spans and its own end now.
    pub fn finish(self, status: u16, error: Option<&str>) {
        for (_, mut s) in self.open.lock().drain(..) {
            s.end();
        }
        let span = self.root.span();
        span.set_attribute(KeyValue::new("http.response.status_code", i64::from(status)));
        if let Some(e) = error {
            span.set_status(Status::error(e.to_string()));
        }
        span.end();
    }

    fn child(&self, name: &'static str, kind: SpanKind, start: SystemTime, attrs: Vec<KeyValue>) -> Span {
        self.tracer.span_builder(name).with_kind(kind).with_start_time(start).with_attributes(attrs).start_with_context(&self.tracer, &self.root)
    }
}
