//! The HTTP face of the gateway: one Pingora `HttpServerApp` per listener role. Pingora accepts
//! connections, parses each request's header and keeps the connection alive between requests;
//! everything in between is the gateway's: local answers here, model-scoped paths by the request
//! phases (`crate::request`).
//!
//! Pingora's proxy pipeline (`ProxyHttp`) is not used. The gateway never used its upstream
//! phase (docs/architecture.md, "Why a manual upstream leg"), and its per-request session (cache,
//! compression and module state) and its boxed phase futures cost more CPU than the gateway's
//! own phases (docs/architecture.md, "The hot path's allocations").

pub mod admin;
pub mod local;
pub mod migrate;

use crate::downstream::errors::ClientError;
use crate::downstream::io::respond_error;
use crate::gateway::Gateway;
use crate::request::Endpoint;
use async_trait::async_trait;
use bytes::Bytes;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::http::Method;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
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
        Self { gw, role, stopping: AtomicBool::new(false), stopped: std::array::from_fn(|_| Notify::new()) }
    }

    /// Reads the next request's header. False: there is none to serve (the client closed, the
    /// service is stopping, or the request was refused here and the connection closed).
    async fn read_request(&self, session: &mut ServerSession) -> bool {
        let stopping = async {
            let woken = self.stopped[stop_shard()].notified();
            if !self.stopping.load(Ordering::Acquire) {
                woken.await
            }
        };
        let read = tokio::select! {
            // Biased: a request already buffered is served before a stop is noticed.
            biased;
            r = session.read_request() => r,
            () = stopping => return false,
        };
        let refusal = match read {
            Ok(true) if session.req_header().method != Method::CONNECT => {
                self.bound_idle(session);
                return true;
            }
            Ok(true) => {
                self.gw.metrics.refused_connections.with_label_values(&["connect"]).inc();
                ClientError::method_not_allowed("CONNECT", "a tunnel")
            }
            Ok(false) => return false,
            // Not `e` itself: Pingora's parse error quotes the raw request, credentials included.
            Err(e) if e.etype == pingora::ErrorType::InvalidHTTPHeader => {
                tracing::debug!(error = e.etype.as_str(), "malformed request header refused");
                self.gw.metrics.refused_connections.with_label_values(&["malformed"]).inc();
                ClientError::bad_request("malformed HTTP request header", None)
            }
            // A broken connection: nobody to answer.
            Err(e) => {
                tracing::debug!(error = e.etype.as_str(), "client connection failed before a request");
                session.shutdown().await;
                return false;
            }
        };
        // The request's framing cannot be trusted: answer and close.
        let mut header = ServerSession::generate_error(refusal.status);
        let body = Bytes::from(refusal.body());
        if header.insert_header("content-type", "application/json").is_ok() && header.set_content_length(body.len()).is_ok() {
            let _ = session.write_error_response(header, body).await;
        }
        session.shutdown().await;
        false
    }

    /// Bounds how long a kept-alive connection waits for its next request: Pingora keeps an
    /// HTTP/1.1 connection with no `Keep-Alive` timeout open without limit.
    fn bound_idle(&self, session: &mut ServerSession) {
        if session.get_keepalive() == Some(0) {
            let ms = self.gw.config().timeouts.client_idle_ms;
            session.set_keepalive(Some(ms.div_ceil(1000).max(1)));
        }
    }

    /// Answers a public-listener request. True when the client connection must be closed (the
    /// response was cut by a failing worker).
    async fn public(&self, session: &mut ServerSession) -> bool {
        let header = session.req_header();
        let (method, endpoint) = (header.method.clone(), Endpoint::from_path(header.uri.path()));
        match (method == Method::POST, endpoint) {
            (true, Some(ep)) => return crate::request::serve(&self.gw, session, ep).await,
            (false, Some(_)) => {
                let e = ClientError::method_not_allowed(method.as_str(), session.req_header().uri.path());
                respond_error(session, &e, &[]).await
            }
            (_, None) => {
                let path = session.req_header().uri.path().to_string();
                match (method.as_str(), path.as_str()) {
                    ("GET", "/v1/models") => local::models(&self.gw, session).await,
                    ("GET", "/health") => local::health(&self.gw, session).await,
                    ("GET", "/metrics") => local::metrics(&self.gw, session).await,
                    (m, "/v1/models" | "/health" | "/metrics") => respond_error(session, &ClientError::method_not_allowed(m, &path), &[]).await,
                    _ => respond_error(session, &ClientError::not_found(&path), &[]).await,
                }
            }
        }
        false
    }
}

#[async_trait]
impl HttpServerApp for GatewayApp {
    async fn process_new_http(self: &Arc<Self>, mut session: ServerSession, shutdown: &ShutdownWatch) -> Option<ReusedHttpStream> {
        if !self.read_request(&mut session).await {
            return None;
        }
        if *shutdown.borrow() {
            // The server is stopping: this connection serves no further request.
            session.set_keepalive(None);
        }
        let abort = match self.role {
            Role::Public => self.public(&mut session).await,
            Role::Admin => {
                let header = session.req_header();
                let (method, path) = (header.method.clone(), header.uri.path().to_string());
                admin::serve(&self.gw, &mut session, method.as_str(), &path).await;
                false
            }
        };
        if abort {
            // The response already started and was cut: closing the connection is how the client
            // learns it is incomplete.
            return None;
        }
        let settings = HttpPersistentSettings::for_session(&session);
        session.finish().await.ok().flatten().map(|s| ReusedHttpStream::from_reusable_stream(s, settings))
    }

    async fn http_cleanup(&self) {
        self.stopping.store(true, Ordering::Release);
        self.stopped.iter().for_each(Notify::notify_waiters);
    }
}
