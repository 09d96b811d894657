//! The HTTP face of the gateway: one Pingora `ServerApp` per listener role. Pingora accepts
//! connections and hands each over; the gateway serves its requests in turn on its own HTTP/1.1
//! connection (`downstream::conn`): local answers here, model-scoped paths by the request phases
//! (`crate::request`).
//!
//! Neither Pingora's proxy pipeline (`ProxyHttp`) nor its HTTP/1 server session is used. The
//! gateway never used the pipeline's upstream phase (docs/architecture.md, "Why a manual
//! upstream leg"), and the session's header maps, its per-request boxed future and its
//! per-request connection hand-back cost more CPU than the gateway's own phases
//! (docs/architecture.md, "The hot path's allocations").

pub mod admin;
pub mod asks;
pub mod fleet_ops;
pub mod forward;
pub mod local;
pub mod migrate;

use crate::downstream::conn::ClientConn;
use crate::downstream::errors::ClientError;
use crate::downstream::io::respond_error;
use crate::endpoint::{Endpoint, PathKind};
use crate::gateway::Gateway;
use crate::h1::request_head::HeadError;
use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::Stream;
use pingora::server::ShutdownWatch;
use prometheus::IntGauge;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tokio::sync::Notify;

/// Shards of the stop signal. Every connection waiting for its next request registers with one;
/// a single `Notify` would put one lock shared by all threads on every request (Pingora's proxy
/// shards its own the same way).
const STOP_SHARDS: usize = 16;

/// Which listener a service answers on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The OpenAI API for clients.
    Public,
    /// Admin endpoints (loopback by default).
    Admin,
}

impl Role {
    /// The listener's name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Role::Public => "public",
            Role::Admin => "admin",
        }
    }
}

/// The gateway's HTTP application for one listener.
pub struct GatewayApp {
    /// Shared state.
    pub gw: Arc<Gateway>,
    /// Which listener.
    pub role: Role,
    /// Set when Pingora stops the service: connections waiting for their next request close.
    stopping: AtomicBool,
    /// Wakes the connections waiting for their next request when the service stops; one per
    /// thread (modulo [`STOP_SHARDS`]).
    stopped: [Notify; STOP_SHARDS],
    /// Client connections open on this listener (`kvgate_client_connections`).
    open: IntGauge,
}

/// This thread's shard of [`GatewayApp::stopped`].
fn stop_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STOP_SHARDS;
    }
    SHARD.with(|s| *s)
}

impl GatewayApp {
    /// The application for `role`'s listener.
    pub fn new(gw: Arc<Gateway>, role: Role) -> Self {
        let open = gw.metrics.client_connections.with_label_values(&[role.name()]);
        Self { gw, role, stopping: AtomicBool::new(false), stopped: std::array::from_fn(|_| Notify::new()), open }
    }

    /// Reads the next request's head. False: there is none to serve (the client closed or was
    /// idle past `timeouts.client_idle_ms`, the service is stopping, or the request was refused
    /// here and the connection closed).
    async fn read_request(&self, session: &mut ClientConn) -> bool {
        let stopping = async {
            let woken = self.stopped[stop_shard()].notified();
            if !self.stopping.load(Ordering::Acquire) {
                woken.await
            }
        };
        // At least a second, as before: 0 would drop every connection before its first request
        // (and every response before its first byte).
        let timeouts = &self.gw.config().timeouts;
        let idle = std::time::Duration::from_millis(timeouts.client_idle_ms.max(1000));
        session.set_write_limit(Some(std::time::Duration::from_millis(timeouts.client_write_ms.max(1000))));
        let read = tokio::select! {
            // Biased: a request already buffered is served before a stop is noticed.
            biased;
            r = session.read_request(idle) => r,
            () = stopping => return false,
        };
        let refusal = match read {
            Ok(true) if !session.req().method_is("CONNECT") => return true,
            Ok(true) => {
                self.gw.metrics.refused_connections.with_label_values(&["connect"]).inc();
                ClientError::method_not_allowed("CONNECT", "a tunnel")
            }
            Ok(false) => return false,
            // Not the request itself: it may carry credentials.
            Err(HeadError::Malformed(why)) => {
                tracing::debug!(why, "malformed request head refused");
                self.gw.metrics.refused_connections.with_label_values(&["malformed"]).inc();
                ClientError::bad_request(format!("malformed HTTP request: {why}"), None)
            }
            Err(HeadError::TooLarge) => {
                self.gw.metrics.refused_connections.with_label_values(&["malformed"]).inc();
                ClientError::header_too_large()
            }
            // A broken connection: nobody to answer.
            Err(HeadError::Io(e)) => {
                tracing::debug!(error = %e, "client connection failed before a request");
                return false;
            }
        };
        // The request's framing cannot be trusted: answer and close.
        session.close_after();
        respond_error(session, &refusal, &[]).await;
        session.shutdown().await;
        false
    }

    /// Answers a public-listener request (docs/endpoints.md): served endpoints through the
    /// request phases, local paths here, control paths refused. True when the client connection
    /// must be closed (the response was cut by a failing worker).
    async fn public(&self, session: &mut ClientConn) -> bool {
        let path = session.req().path();
        let refusal = match PathKind::of(path) {
            PathKind::Served(ep) if ep.post_only() && !session.req().method_is("POST") => {
                let e = ClientError::method_not_allowed(session.req().method(), path);
                if ep.anthropic_errors() { e.anthropic() } else { e }
            }
            // A HEAD response carries no body whatever its length says, which the worker
            // side does not read; vLLM's routes answer HEAD 405 themselves.
            PathKind::Served(Endpoint::Passthrough) if session.req().method_is("HEAD") => ClientError::method_not_allowed("HEAD", path),
            PathKind::Served(Endpoint::Passthrough) if !self.gw.config().passthrough.passes(path) => {
                self.gw.metrics.refused_paths.with_label_values(&["not_passed_through"]).inc();
                ClientError::not_passed_through(path)
            }
            PathKind::Served(ep) => return crate::request::serve(&self.gw, session, ep).await,
            PathKind::Control => {
                self.gw.metrics.refused_paths.with_label_values(&["control"]).inc();
                ClientError::control_path(path)
            }
            PathKind::Local if !session.req().method_is("GET") => ClientError::method_not_allowed(session.req().method(), path),
            PathKind::Local => {
                match path {
                    "/v1/models" => local::models(&self.gw, session).await,
                    "/health" => local::health(&self.gw, session).await,
                    _ => local::metrics(&self.gw, session).await,
                }
                return false;
            }
        };
        respond_error(session, &refusal, &[]).await;
        false
    }
}

impl GatewayApp {
    /// Serves one request. False when the connection cannot carry another.
    async fn serve_one(self: &Arc<Self>, session: &mut ClientConn, shutdown: &ShutdownWatch) -> bool {
        if !self.read_request(session).await {
            return false;
        }
        if *shutdown.borrow() {
            // The server is stopping: this connection serves no further request.
            session.close_after();
        }
        // A request's work is boxed on its own: the connection's future, which lives as long as
        // the client stays, then holds only what waiting for a head needs, not the much larger
        // state of a request in flight (docs/hardening.md "Memory per connection").
        let abort = match self.role {
            Role::Public => Box::pin(self.public(session)).await,
            Role::Admin => {
                let (method, path) = (session.req().method().to_string(), session.req().path().to_string());
                Box::pin(admin::serve(&self.gw, session, &method, &path)).await;
                false
            }
        };
        // A response cut by a failing worker: closing the connection is how the client learns
        // it is incomplete.
        !abort && session.reusable()
    }
}

/// Counts a client connection in [`GatewayApp::open`] while it lives.
struct OpenConnection<'a>(&'a IntGauge);

impl<'a> OpenConnection<'a> {
    fn new(open: &'a IntGauge) -> Self {
        open.inc();
        Self(open)
    }
}

impl Drop for OpenConnection<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[async_trait]
impl ServerApp for GatewayApp {
    /// Serves the connection's requests in turn, until it cannot carry another: one task and
    /// one boxed future per connection, not per request.
    async fn process_new(self: &Arc<Self>, stream: Stream, shutdown: &ShutdownWatch) -> Option<Stream> {
        let _open = OpenConnection::new(&self.open);
        if usize::try_from(self.open.get()).unwrap_or(0) > self.gw.config().max_connections {
            // Past the cap: closed before a byte is read or a buffer allocated.
            self.gw.metrics.refused_connections.with_label_values(&["max_connections"]).inc();
            return None;
        }
        let mut session = ClientConn::new(stream);
        while self.serve_one(&mut session, shutdown).await {}
        session.shutdown().await;
        session.linger().await;
        None
    }

    async fn cleanup(&self) {
        self.stopping.store(true, Ordering::Release);
        self.stopped.iter().for_each(Notify::notify_waiters);
    }
}
