//! One attempt at a worker: connect (from the keep-alive pool when possible), send the request
//! with the client's original body, and wait for the response header while watching the client.
//!
//! Pingora's proxy pipeline cannot forward a body over 64 KiB that was read before choosing the
//! upstream (notes/pingora.md §1.3), so inference requests take this "manual leg" instead.

use super::client::client_closed;
use crate::fleet::Worker;
use crate::gateway::Gateway;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::client::HttpSession;
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;
use std::time::Duration;

/// Headers that describe one hop and are never forwarded.
const HOP_BY_HOP: &[&str] =
    &["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length", "expect"];

/// A connected upstream whose response header has arrived.
pub struct Upstream {
    /// The session (dropping it closes the connection; see [`release`]).
    pub session: HttpSession,
    /// The response header.
    pub header: ResponseHeader,
    /// Where it goes (for releasing to the pool).
    pub peer: HttpPeer,
}

/// How an attempt ended.
pub enum Attempt {
    /// The worker answered; the response can be streamed.
    Responded(Box<Upstream>),
    /// Nothing reached the client and another worker may be tried.
    Retry { kind: &'static str, detail: String },
    /// The worker did not start responding within `first_byte_ms`.
    TimedOut,
    /// The client went away while we waited.
    ClientGone,
}

/// What the attempt sends.
pub struct Outgoing<'a> {
    /// Path and query.
    pub path: &'a str,
    /// Body, sent as is.
    pub body: &'a Bytes,
    /// Request id to propagate.
    pub request_id: &'a str,
}

/// Builds the upstream request header from the client's.
fn request_header(client: &RequestHeader, worker: &Worker, out: &Outgoing<'_>) -> pingora::Result<RequestHeader> {
    let mut h = RequestHeader::build("POST", out.path.as_bytes(), Some(client.headers.len() + 3))?;
    for (name, value) in client.headers.iter() {
        if !HOP_BY_HOP.contains(&name.as_str()) && name.as_str() != "x-request-id" {
            h.append_header(name.clone(), value.clone())?;
        }
    }
    h.insert_header("host", worker.host_header.as_str())?;
    h.insert_header("content-length", out.body.len().to_string())?;
    h.insert_header("x-request-id", out.request_id)?;
    if !h.headers.contains_key("content-type") {
        h.insert_header("content-type", "application/json")?;
    }
    Ok(h)
}

/// Runs one attempt against `worker`.
pub async fn attempt(gw: &Gateway, session: &mut Session, worker: &Worker, out: &Outgoing<'_>) -> Attempt {
    let cfg = gw.config();
    let addr = match worker.addr().await {
        Ok(a) => a,
        Err(e) => return Attempt::Retry { kind: "resolve", detail: format!("{}: {e}", worker.url) },
    };
    let mut peer = HttpPeer::new(addr, false, String::new());
    let connect = Duration::from_millis(cfg.timeouts.connect_ms);
    peer.options.connection_timeout = Some(connect);
    peer.options.total_connection_timeout = Some(connect);
    peer.options.idle_timeout = Some(Duration::from_millis(cfg.timeouts.upstream_idle_ms));
    let header = match request_header(session.req_header(), worker, out) {
        Ok(h) => h,
        Err(e) => return Attempt::Retry { kind: "request", detail: e.to_string() },
    };
    // A pooled connection may have been closed by the worker meanwhile; nothing was processed
    // then, so one fresh connection is tried before giving up on this worker.
    for fresh_try in 0..2 {
        let (mut up, reused) = match gw.connector.get_http_session(&peer).await {
            Ok(s) => s,
            Err(e) => return Attempt::Retry { kind: "connect", detail: format!("{}: {e}", worker.url) },
        };
        let sent = async {
            up.write_request_header(Box::new(header.clone())).await?;
            up.write_request_body(out.body.clone(), true).await?;
            up.finish_request_body().await
        }
        .await;
        if let Err(e) = sent {
            if reused && fresh_try == 0 {
                continue;
            }
            return Attempt::Retry { kind: "send", detail: format!("{}: {e}", worker.url) };
        }
        let first_byte = cfg.timeouts.first_byte_ms;
        let wait = async {
            if first_byte == 0 {
                std::future::pending::<()>().await;
            } else {
                tokio::time::sleep(Duration::from_millis(first_byte)).await;
            }
        };
        let r = tokio::select! {
            r = up.read_response_header() => r,
            _ = client_closed(session) => return Attempt::ClientGone,
            _ = wait => return Attempt::TimedOut,
        };
        if let Err(e) = r {
            if reused && fresh_try == 0 {
                continue;
            }
            return Attempt::Retry { kind: "response", detail: format!("{}: {e}", worker.url) };
        }
        let Some(header) = up.response_header().cloned() else {
            return Attempt::Retry { kind: "response", detail: format!("{}: no response header", worker.url) };
        };
        return Attempt::Responded(Box::new(Upstream { session: up, header, peer }));
    }
    Attempt::Retry { kind: "send", detail: format!("{}: connection closed", worker.url) }
}

/// Copies a worker's response header for the client (hop-by-hop headers dropped; Pingora frames
/// the body itself: chunked for streams, Content-Length when the worker gave one).
pub fn client_response_header(up: &ResponseHeader, request_id: &str) -> pingora::Result<ResponseHeader> {
    let mut h = ResponseHeader::build(up.status, Some(up.headers.len() + 1))?;
    for (name, value) in up.headers.iter() {
        let n = name.as_str();
        if n == "content-length" || !HOP_BY_HOP.contains(&n) {
            h.append_header(name.clone(), value.clone())?;
        }
    }
    if !h.headers.contains_key("content-length") {
        h.insert_header("transfer-encoding", "chunked")?;
    }
    h.insert_header("x-request-id", request_id)?;
    Ok(h)
}

/// Returns a finished connection to the keep-alive pool.
pub async fn release(gw: &Gateway, up: Box<Upstream>) {
    let up = *up;
    let idle = Duration::from_millis(gw.config().timeouts.upstream_idle_ms);
    gw.connector.release_http_session(up.session, &up.peer, Some(idle)).await;
}
