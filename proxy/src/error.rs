//! The gateway's errors, typed so that behaviour is decided by kind, not by comparing strings.
//!
//! - [`LegError`]: one upstream leg failed. It carries its [`LegErrorKind`], whether another
//!   worker may be tried ([`LegError::retryable`]) and its source, as `pingora-error` does.
//! - [`GatewayError`]: why a request got an error answer instead of a worker's response. Every
//!   variant maps to one client-facing error built by the constructors in `http/errors.rs`
//!   ([`GatewayError::client_error`]), so status codes and OpenAI error types are decided in
//!   one place.

use crate::downstream::errors::ClientError;
use std::fmt;

/// What went wrong on an upstream leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegErrorKind {
    /// The worker's host name did not resolve.
    Resolve,
    /// The TCP connection was refused or timed out (also a health signal).
    Connect,
    /// Writing the request failed.
    Send,
    /// The response header did not arrive or did not parse; or a stream resent after its head
    /// went out was answered with a status below 500 other than 200 (final).
    Response,
    /// The worker answered 5xx before anything reached the client.
    Status5xx,
    /// No response header or first body byte within `timeouts.first_byte_ms`.
    FirstByteTimeout,
    /// The connection failed after the header and before the first body byte.
    BeforeFirstByte,
    /// The worker failed after part of the response reached the client.
    Midstream,
    /// The worker went silent mid-response past `timeouts.upstream_read_idle_ms`.
    Stalled,
}

impl LegErrorKind {
    /// The `kind` label of `kvgate_upstream_errors_total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Resolve => "resolve",
            Self::Connect => "connect",
            Self::Send => "send",
            Self::Response => "response",
            Self::Status5xx => "status_5xx",
            Self::FirstByteTimeout => "first_byte_timeout",
            Self::BeforeFirstByte => "before_first_byte",
            // One label for both: the series operators already alert on.
            Self::Midstream | Self::Stalled => "midstream",
        }
    }
}

/// One failed upstream leg.
#[derive(Debug, thiserror::Error)]
#[error("{worker}: {kind:?}: {detail}")]
pub(crate) struct LegError {
    /// What failed.
    pub kind: LegErrorKind,
    /// Whether the request may go to another worker: nothing reached the client and the
    /// failure says nothing about the request itself.
    pub retryable: bool,
    /// The worker's URL.
    pub worker: String,
    /// Human-readable detail (for logs and the final 502's message).
    pub detail: String,
    /// The underlying error, if any.
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl LegError {
    /// An error of `kind` at `worker`; retryable unless the kind says otherwise.
    pub(crate) fn new(kind: LegErrorKind, worker: impl fmt::Display, detail: impl Into<String>) -> Self {
        let retryable = !matches!(kind, LegErrorKind::Midstream | LegErrorKind::Stalled);
        Self { kind, retryable, worker: worker.to_string(), detail: detail.into(), source: None }
    }

    /// The same error with its source attached.
    pub(crate) fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// The same error, not to be retried elsewhere.
    pub(crate) fn final_(mut self) -> Self {
        self.retryable = false;
        self
    }
}

/// Why a request was answered by the gateway itself with an error.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GatewayError {
    /// Shutting down: new requests are refused.
    #[error("draining")]
    Draining,
    /// The request body or one of its fields is unusable.
    #[error("bad request: {message}")]
    BadRequest { message: String, param: Option<&'static str> },
    /// The body is over `max_body_bytes`.
    #[error("body over {0} bytes")]
    TooLarge(u64),
    /// The body did not arrive within `timeouts.request_body_ms`.
    #[error("body timeout")]
    BodyTimeout,
    /// No such model.
    #[error("unknown model {name:?}")]
    UnknownModel { name: String, served: Vec<String> },
    /// The client has `per_client.max_concurrent` requests in flight already.
    #[error("client over its {0} concurrent requests")]
    ClientLimit(u32),
    /// The router queue is full.
    #[error("queue of {0} full")]
    QueueFull(String),
    /// A request of a higher priority band took the request's place in a full router queue.
    #[error("shed from the queue of {0} for a higher band")]
    QueueShed(String),
    /// No tenant: a missing (`true`) or unknown key where keys are required.
    #[error("no valid API key (missing: {0})")]
    Unauthorized(bool),
    /// A tenant's limit refused the request.
    #[error("tenant {} over its {} limit", .0.0, .0.1.dimension.label())]
    RateLimited(Box<(String, kvgate_filters::tenant::Exceeded)>),
    /// The request waited in the router queue past `routing.queue_max_wait_ms`.
    #[error("queue wait of {0} timed out")]
    QueueTimeout(String),
    /// Every worker is over a busy threshold (Dynamo's load shedding).
    #[error("all workers of {0} busy")]
    AllBusy(String),
    /// The model has no healthy worker left to try.
    #[error("no healthy worker for {0}")]
    NoHealthyWorker(String),
    /// Every worker that could take the request is paused by a fleet operation: the request
    /// waits for `/resume` (phase 2), so this reaches a client only when that wait is over.
    #[error("every worker of {0} is paused")]
    Paused(String),
    /// The request waited for a paused model's `/resume` past `routing.queue_max_wait_ms`.
    #[error("{0} stayed paused past the queue's wait")]
    PausedTooLong(String),
    /// A plugin refused the request.
    #[error("plugin rejected with {status}: {message}")]
    PluginRejected { status: u16, message: String },
    /// The worker did not start responding within `timeouts.first_byte_ms`.
    #[error("first byte timeout at {model}")]
    UpstreamTimeout { model: String, leg: LegError },
    /// Every attempt failed before a response started.
    #[error("every attempt at {model} failed: {leg}")]
    UpstreamFailed { model: String, leg: LegError },
    /// The worker's response header could not be passed on.
    #[error("unusable worker response: {0}")]
    BadUpstreamResponse(String),
    /// The stored response a request refers to was made by a worker no longer in the fleet.
    #[error("stored response {id} was on {worker}, which has left the fleet")]
    StoredResponseGone { id: String, worker: String },
}

impl GatewayError {
    /// The answer to a request whose last leg to a worker of `model` failed: a worker that sent
    /// no header in time is a 504, any other failure a 502.
    pub(crate) fn from_leg(model: &str, leg: LegError) -> Self {
        let model = model.to_string();
        match leg.kind {
            LegErrorKind::FirstByteTimeout => Self::UpstreamTimeout { model, leg },
            _ => Self::UpstreamFailed { model, leg },
        }
    }

    /// The answer the client gets.
    pub(crate) fn client_error(&self) -> ClientError {
        match self {
            Self::Draining => ClientError::draining(),
            Self::BadRequest { message, param } => ClientError::bad_request(message.clone(), *param),
            Self::TooLarge(limit) => ClientError::too_large(*limit),
            Self::BodyTimeout => ClientError::body_timeout(),
            Self::UnknownModel { name, served } => ClientError::unknown_model(name, served),
            Self::ClientLimit(max) => ClientError::client_limit(*max),
            Self::QueueFull(model) | Self::QueueShed(model) => ClientError::queue_full(model),
            Self::Unauthorized(missing) => ClientError::invalid_key(*missing),
            Self::RateLimited(r) => ClientError::rate_limited(&r.0, &r.1),
            Self::QueueTimeout(model) => ClientError::queue_timeout(model),
            Self::AllBusy(_) => ClientError::all_busy(),
            Self::NoHealthyWorker(model) => ClientError::no_healthy_worker(model),
            Self::Paused(model) | Self::PausedTooLong(model) => ClientError::paused(model),
            Self::PluginRejected { status, message } => ClientError::rejected(*status, message.clone()),
            Self::UpstreamTimeout { model, .. } => ClientError::upstream_timeout(model),
            Self::UpstreamFailed { model, leg } => ClientError::upstream_failed(model, &format!("{}: {}", leg.worker, leg.detail)),
            Self::BadUpstreamResponse(detail) => ClientError::bad_upstream_response(detail),
            Self::StoredResponseGone { id, worker } => ClientError::stored_response_gone(id, worker),
        }
    }

    /// The HTTP status of the answer.
    pub(crate) fn status(&self) -> u16 {
        self.client_error().status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryability_is_decided_by_kind() {
        assert!(LegError::new(LegErrorKind::Connect, "w", "refused").retryable);
        assert!(LegError::new(LegErrorKind::Status5xx, "w", "500").retryable);
        assert!(!LegError::new(LegErrorKind::Midstream, "w", "reset").retryable);
        assert!(!LegError::new(LegErrorKind::Connect, "w", "refused").final_().retryable);
    }

    #[test]
    fn the_source_is_kept() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = LegError::new(LegErrorKind::Connect, "http://w:1", "connect").with_source(io);
        assert!(std::error::Error::source(&e).is_some());
        assert!(e.to_string().contains("http://w:1"));
    }

    #[test]
    fn every_gateway_error_has_one_client_answer() {
        let leg = || LegError::new(LegErrorKind::Connect, "http://w:1", "refused");
        let cases = [
            (GatewayError::Draining, 503),
            (GatewayError::BadRequest { message: "x".into(), param: None }, 400),
            (GatewayError::TooLarge(10), 413),
            (GatewayError::BodyTimeout, 408),
            (GatewayError::UnknownModel { name: "a".into(), served: vec!["b".into()] }, 404),
            (GatewayError::QueueFull("m".into()), 429),
            (GatewayError::QueueShed("m".into()), 429),
            (GatewayError::Unauthorized(true), 401),
            (GatewayError::QueueTimeout("m".into()), 503),
            (GatewayError::AllBusy("m".into()), 503),
            (GatewayError::NoHealthyWorker("m".into()), 503),
            (GatewayError::Paused("m".into()), 503),
            (GatewayError::PausedTooLong("m".into()), 503),
            (GatewayError::PluginRejected { status: 429, message: "slow down".into() }, 429),
            (GatewayError::UpstreamTimeout { model: "m".into(), leg: leg() }, 504),
            (GatewayError::UpstreamFailed { model: "m".into(), leg: leg() }, 502),
            (GatewayError::BadUpstreamResponse("bad header".into()), 502),
        ];
        for (e, status) in cases {
            assert_eq!(e.status(), status, "{e}");
        }
        assert!(GatewayError::UpstreamFailed { model: "m".into(), leg: leg() }.client_error().message.contains("refused"));
    }
}
