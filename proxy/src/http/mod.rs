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
use crate::gateway::Gateway;
use crate::request::Endpoint;
use async_trait::async_trait;
use bytes::Bytes;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::http::Method;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::Notify;

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
    /// Wakes the connections waiting for their next request when the service stops.
    stopped: Notify,
}

impl GatewayApp {
    /// The application for `role`'s listener.
    pub fn new(gw: Arc<Gateway>, role: Role) -> Self {
        Self { gw, role, stopping: AtomicBool::new(false), stopped: Notify::new() }
    }

    /// Reads the next request's header. False: there is none to serve (the client closed, the
    /// service is stopping, or the request was refused here and the connection closed).
    async fn read_request(&self, session: &mut ServerSession) -> bool {
        let stopping = async {
            let woken = self.stopped.notified();
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
            Ok(true) if session.req_header().method != Method::CONNECT => return true,
            Ok(true) => ClientError::method_not_allowed("CONNECT", "a tunnel"),
            Ok(false) => return false,
            Err(e) if e.etype == pingora::ErrorType::InvalidHTTPHeader => ClientError::bad_request(format!("malformed HTTP request: {e}"), None),
            // A broken connection: nobody to answer.
            Err(_) => {
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

    /// Answers a public-listener request. True when the client connection must be closed (the
    /// response was cut by a failing worker).
    async fn public(&self, session: &mut ServerSession) -> bool {
        let header = session.req_header();
        let (method, endpoint) = (header.method.clone(), Endpoint::from_path(header.uri.path()));
        let respond_error = crate::downstream::io::respond_error;
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
        self.stopped.notify_waiters();
    }
}
