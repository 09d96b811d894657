//! The HTTP face of the gateway: one Pingora `ProxyHttp` implementation per listener role.
//! Every request is answered inside `request_filter`: local answers here, model-scoped paths
//! by the request phases (`crate::request`); Pingora's own upstream phase is never used.

pub mod admin;
pub mod local;
pub mod migrate;

use crate::downstream::errors::ClientError;
use crate::gateway::Gateway;
use crate::request::Endpoint;
use async_trait::async_trait;
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use std::sync::Arc;

/// Which listener a service answers on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The OpenAI API for clients.
    Public,
    /// Admin endpoints (loopback by default).
    Admin,
}

/// The Pingora service logic.
pub struct GatewayService {
    /// Shared state.
    pub gw: Arc<Gateway>,
    /// Which listener.
    pub role: Role,
}

/// Raised to make Pingora drop a client connection without finishing the response.
fn abort_connection() -> Box<Error> {
    Error::explain(ErrorType::InternalError, "worker failed mid-response; closing the client connection")
}

#[async_trait]
impl ProxyHttp for GatewayService {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    fn init_downstream_modules(&self, _modules: &mut pingora::modules::http::HttpModules) {
        // No response compression: it would buffer SSE.
    }

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut Self::CTX) -> Result<Box<HttpPeer>> {
        Err(Error::explain(ErrorType::InternalError, "every route is answered in request_filter"))
    }

    async fn request_filter(&self, session: &mut Session, _ctx: &mut Self::CTX) -> Result<bool> {
        let method = session.req_header().method.as_str().to_string();
        let path = session.req_header().uri.path().to_string();
        let abort = match self.role {
            Role::Public => self.public(session, &method, &path).await,
            Role::Admin => {
                admin::serve(&self.gw, session, &method, &path).await;
                false
            }
        };
        if abort { Err(abort_connection()) } else { Ok(true) }
    }

    async fn fail_to_proxy(&self, _session: &mut Session, _e: &Error, _ctx: &mut Self::CTX) -> FailToProxy {
        // Only reached through `abort_connection`: the response already started, so nothing
        // more may be written; the connection is closed.
        FailToProxy { error_code: 0, can_reuse_downstream: false }
    }

    fn suppress_error_log(&self, _session: &Session, _ctx: &Self::CTX, _error: &Error) -> bool {
        true
    }
}

impl GatewayService {
    async fn public(&self, session: &mut Session, method: &str, path: &str) -> bool {
        match (method, Endpoint::from_path(path), path) {
            ("POST", Some(ep), _) => return crate::request::serve(&self.gw, session, ep).await,
            (_, Some(_), _) => crate::downstream::io::respond_error(session, &ClientError::method_not_allowed(method, path), &[]).await,
            ("GET", None, "/v1/models") => local::models(&self.gw, session).await,
            ("GET", None, "/health") => local::health(&self.gw, session).await,
            ("GET", None, "/metrics") => local::metrics(&self.gw, session).await,
            (_, None, "/v1/models" | "/health" | "/metrics") => {
                crate::downstream::io::respond_error(session, &ClientError::method_not_allowed(method, path), &[]).await
            }
            _ => crate::downstream::io::respond_error(session, &ClientError::not_found(path), &[]).await,
        }
        false
    }
}
