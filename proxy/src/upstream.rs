//! Talking HTTP/1.1 to workers over Pingora's connector (keep-alive pools): one exchange —
//! connect (from the pool when possible), send a request, read the response header — shared by
//! the request path's legs and the background probes (health, worker metrics), plus the header
//! rules for what crosses the gateway.
//!
//! Pingora's own proxy pipeline cannot forward a body over 64 KiB that was read before the
//! upstream was chosen (docs/pingora.md, "Why a manual upstream leg"), so inference
//! requests are sent by hand through here.

use crate::error::{LegError, LegErrorKind};
use crate::fleet::Worker;
use crate::gateway::Gateway;
use bytes::{Bytes, BytesMut};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::client::HttpSession;
use pingora::upstreams::peer::HttpPeer;
use std::time::Duration;

/// Headers that describe one hop and are never forwarded.
const HOP_BY_HOP: &[&str] =
    &["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length", "expect"];

/// An upstream connection whose response header has arrived.
pub struct Exchange {
    /// The session (dropping it closes the connection; see [`release`]).
    pub session: HttpSession,
    /// The response header.
    pub header: ResponseHeader,
    /// Where it goes (for releasing to the pool).
    pub peer: HttpPeer,
}

/// The worker request header for a client's request: the client's headers minus hop-by-hop
/// ones, with the worker's `Host`, the body's length and the request id.
pub fn request_header(client: &RequestHeader, worker: &Worker, path: &str, body_len: usize, request_id: &str) -> pingora::Result<RequestHeader> {
    let mut h = RequestHeader::build("POST", path.as_bytes(), Some(client.headers.len() + 3))?;
    for (name, value) in client.headers.iter() {
        if !HOP_BY_HOP.contains(&name.as_str()) && name.as_str() != "x-request-id" {
            h.append_header(name.clone(), value.clone())?;
        }
    }
    h.insert_header("host", worker.host_header.as_str())?;
    h.insert_header("content-length", body_len.to_string())?;
    h.insert_header("x-request-id", request_id)?;
    if !h.headers.contains_key("content-type") {
        h.insert_header("content-type", "application/json")?;
    }
    Ok(h)
}

/// Copies a worker's response header for the client (hop-by-hop headers dropped; Pingora frames
/// the body itself: chunked for streams, Content-Length when the worker gave one), with the
/// request id and the worker that answered (`x-kvgate-worker`).
pub fn client_response_header(up: &ResponseHeader, request_id: &str, worker: &str) -> pingora::Result<ResponseHeader> {
    let mut h = ResponseHeader::build(up.status, Some(up.headers.len() + 2))?;
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
    h.insert_header("x-kvgate-worker", worker)?;
    Ok(h)
}

/// Sends `header` (and `body`, if any) to `worker` and reads the response header. A pooled
/// connection the worker closed meanwhile processed nothing, so one fresh connection is tried
/// before giving up.
pub async fn exchange(gw: &Gateway, worker: &Worker, header: &RequestHeader, body: Option<&Bytes>) -> Result<Exchange, LegError> {
    let cfg = gw.config();
    let addr = worker.addr().await.map_err(|e| LegError::new(LegErrorKind::Resolve, &worker.url, e.to_string()).with_source(e))?;
    let mut peer = HttpPeer::new(addr, false, String::new());
    let connect = Duration::from_millis(cfg.timeouts.connect_ms);
    peer.options.connection_timeout = Some(connect);
    peer.options.total_connection_timeout = Some(connect);
    peer.options.idle_timeout = Some(Duration::from_millis(cfg.timeouts.upstream_idle_ms));
    let mut fresh_try = 0;
    loop {
        let (mut up, reused) =
            gw.connector.get_http_session(&peer).await.map_err(|e| LegError::new(LegErrorKind::Connect, &worker.url, e.to_string()).with_source(*e))?;
        let sent = async {
            up.write_request_header(Box::new(header.clone())).await?;
            if let Some(b) = body {
                up.write_request_body(b.clone(), true).await?;
            }
            up.finish_request_body().await
        }
        .await;
        let failed = match sent {
            Err(e) => LegError::new(LegErrorKind::Send, &worker.url, e.to_string()).with_source(*e),
            Ok(_) => match up.read_response_header().await {
                Ok(()) => match up.response_header().cloned() {
                    Some(header) => return Ok(Exchange { session: up, header, peer }),
                    None => LegError::new(LegErrorKind::Response, &worker.url, "no response header"),
                },
                Err(e) => LegError::new(LegErrorKind::Response, &worker.url, e.to_string()).with_source(*e),
            },
        };
        if !(reused && fresh_try == 0) {
            return Err(failed);
        }
        fresh_try += 1;
    }
}

/// `GET path` on `worker` within `timeout`: the status and up to `max_body` bytes of body. The
/// connection goes back to the pool when the body was read whole.
pub async fn get(gw: &Gateway, worker: &Worker, path: &str, timeout: Duration, max_body: usize) -> Result<(u16, Bytes), LegError> {
    let attempt = async {
        let mut h = RequestHeader::build("GET", path.as_bytes(), Some(2)).map_err(|e| LegError::new(LegErrorKind::Send, &worker.url, e.to_string()))?;
        h.insert_header("host", worker.host_header.as_str()).map_err(|e| LegError::new(LegErrorKind::Send, &worker.url, e.to_string()))?;
        h.insert_header("user-agent", "kvgate").map_err(|e| LegError::new(LegErrorKind::Send, &worker.url, e.to_string()))?;
        let mut ex = exchange(gw, worker, &h, None).await?;
        let status = ex.header.status.as_u16();
        let mut body = BytesMut::new();
        loop {
            match ex.session.read_response_body().await {
                Ok(Some(chunk)) if body.len() + chunk.len() <= max_body => body.extend_from_slice(&chunk),
                Ok(Some(_)) => return Err(LegError::new(LegErrorKind::Response, &worker.url, format!("{path}: body over {max_body} bytes"))),
                Ok(None) => break,
                Err(e) => return Err(LegError::new(LegErrorKind::BeforeFirstByte, &worker.url, e.to_string()).with_source(*e)),
            }
        }
        release(gw, ex).await;
        Ok((status, body.freeze()))
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .unwrap_or_else(|_| Err(LegError::new(LegErrorKind::FirstByteTimeout, &worker.url, format!("{path}: no answer within {timeout:?}"))))
}

/// Returns a finished connection to the keep-alive pool.
pub async fn release(gw: &Gateway, ex: Exchange) {
    let idle = Duration::from_millis(gw.config().timeouts.upstream_idle_ms);
    gw.connector.release_http_session(ex.session, &ex.peer, Some(idle)).await;
}
