//! Talking HTTP/1.1 to workers: one exchange — connect (from a keep-alive pool when possible),
//! send a request, read the response header — shared by the request path's legs and the
//! background probes (health, worker metrics), plus the header rules for what crosses the
//! gateway.
//!
//! Pingora's own proxy pipeline cannot forward a body over 64 KiB that was read before the
//! upstream was chosen (docs/pingora.md, "Why a manual upstream leg"), so inference
//! requests are sent by hand through here. Their keep-alive connections wait in each worker's
//! own [`pool::IdlePool`]; the probes use Pingora's pool.

pub mod pool;

use crate::config::Config;
use crate::error::{LegError, LegErrorKind};
use crate::fleet::Worker;
use crate::gateway::Gateway;
use bytes::{Bytes, BytesMut};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::Stream;
use pingora::protocols::http::client::HttpSession;
use pingora::protocols::http::v1::client::{HttpSession as Http1Session, http_req_header_to_wire};
use pingora::upstreams::peer::HttpPeer;
use pool::IdlePool;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Headers that describe one hop and are never forwarded.
const HOP_BY_HOP: &[&str] =
    &["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length", "expect"];

/// An upstream connection whose response header has arrived.
pub struct Exchange {
    /// The session (dropping it closes the connection; see [`release`]). Boxed: an
    /// exchange moves through every phase of a request (docs/architecture.md, "Future sizes").
    pub session: Box<HttpSession>,
    /// The response header.
    pub header: ResponseHeader,
    /// When the request was sent (the start of the first-byte deadline).
    pub sent_at: Instant,
    /// The keep-alive pool it returns to.
    pub home: Home,
}

/// The keep-alive pool a connection returns to.
pub enum Home {
    /// A request leg's: its worker's own.
    Worker(Arc<IdlePool>),
    /// A probe's: Pingora's pool, keyed by the peer.
    Probes(Box<HttpPeer>),
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

/// Which pool a connection comes from: the request legs' (each worker's own [`IdlePool`]), or
/// the probes' (Pingora's connector, which holds nothing else): a probe never rides on a
/// connection a request opened, or a worker that stopped accepting connections would still
/// look healthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// Request legs.
    Requests,
    /// Health and metrics probes.
    Probes,
}

/// Sends `header` (and `body`, if any) to `worker` and reads the response header, waiting at
/// most `header_timeout` after the request was sent. A pooled connection that fails before any
/// response header was most likely closed by the worker while idle, so one fresh connection is
/// tried before giving up (the request may then run twice if the worker had in fact taken it).
pub async fn exchange(
    gw: &Gateway,
    cfg: &Config,
    worker: &Worker,
    header: &RequestHeader,
    body: Option<&Bytes>,
    pool: Pool,
    header_timeout: Option<Duration>,
) -> Result<Exchange, LegError> {
    let addr = worker.addr().await.map_err(|e| LegError::new(LegErrorKind::Resolve, &worker.url, e.to_string()).with_source(e))?;
    let mut peer = HttpPeer::new(addr, false, String::new());
    let connect_limit = Duration::from_millis(cfg.timeouts.connect_ms);
    peer.options.connection_timeout = Some(connect_limit);
    peer.options.total_connection_timeout = Some(connect_limit);
    peer.options.idle_timeout = Some(Duration::from_millis(cfg.timeouts.upstream_idle_ms));
    let mut fresh_try = 0;
    loop {
        let (up, reused) = connect(gw, worker, &peer, pool, fresh_try > 0).await?;
        let (mut up, sent) = send(up, &peer, header, body).await;
        let failed = match sent {
            Err(e) => LegError::new(LegErrorKind::Send, &worker.url, e.to_string()).with_source(*e),
            Ok(_) => {
                let sent_at = Instant::now();
                let read = up.read_response_header();
                let r = match header_timeout {
                    Some(limit) => match tokio::time::timeout(limit, read).await {
                        Ok(r) => r,
                        // Not a broken connection: the worker is not answering. Final (504).
                        Err(_) => {
                            return Err(LegError::new(LegErrorKind::FirstByteTimeout, &worker.url, "no response header within timeouts.first_byte_ms").final_());
                        }
                    },
                    None => read.await,
                };
                match r.map(|()| up.response_header().cloned()) {
                    Ok(Some(header)) => {
                        let home = match pool {
                            Pool::Requests => Home::Worker(worker.idle.clone()),
                            Pool::Probes => Home::Probes(Box::new(peer)),
                        };
                        return Ok(Exchange { session: up, header, sent_at, home });
                    }
                    Ok(None) => LegError::new(LegErrorKind::Response, &worker.url, "no response header"),
                    Err(e) => LegError::new(LegErrorKind::Response, &worker.url, e.to_string()).with_source(*e),
                }
            }
        };
        if !(reused && fresh_try == 0) {
            return Err(failed);
        }
        fresh_try += 1;
    }
}

/// A connection before its request is sent: a request leg's bare stream, or a probe's session
/// from Pingora's pool.
enum Conn {
    Stream(Stream),
    Session(Box<HttpSession>),
}

/// A connection to `worker`: an idle one from the pool `pool` names unless `fresh`, else a new
/// one. Returns whether it was reused.
async fn connect(gw: &Gateway, worker: &Worker, peer: &HttpPeer, pool: Pool, fresh: bool) -> Result<(Conn, bool), LegError> {
    let failed = |e: Box<pingora::Error>| LegError::new(LegErrorKind::Connect, &worker.url, e.to_string()).with_source(*e);
    match pool {
        // Boxed (probes only): Pingora's connect future is large, and inline it would grow
        // every request's future (docs/architecture.md, "Future sizes").
        Pool::Probes => Box::pin(gw.connector.get_http_session(peer)).await.map(|(s, reused)| (Conn::Session(Box::new(s)), reused)).map_err(failed),
        Pool::Requests => {
            let idle = peer.options.idle_timeout.unwrap_or_default();
            let pooled = if fresh { None } else { worker.idle.take(idle) };
            let (stream, reused) = match pooled {
                Some(s) => (s, true),
                // Boxed: with keep-alive a new connection is rare, and its future is large.
                None => (Box::pin(gw.transport.new_stream(peer)).await.map_err(failed)?, false),
            };
            Ok((Conn::Stream(stream), reused))
        }
    }
}

/// Sends the request. A request leg's goes out in one write (header and body together):
/// Pingora's HTTP/1 client flushes the header on its own, which costs a second `send` per
/// request, and on loopback a send carries the receiver's network processing too. The
/// session that reads the response is then made over the same connection.
async fn send(conn: Conn, peer: &HttpPeer, header: &RequestHeader, body: Option<&Bytes>) -> (Box<HttpSession>, pingora::Result<()>) {
    use tokio::io::AsyncWriteExt;
    let mut stream = match conn {
        Conn::Stream(stream) => stream,
        // Probes only (no body); boxed as in `connect`.
        Conn::Session(mut up) => {
            let sent = Box::pin(async {
                up.write_request_header(Box::new(header.clone())).await?;
                if let Some(b) = body {
                    up.write_request_body(b.clone(), true).await?;
                }
                up.finish_request_body().await
            })
            .await
            .map(|_| ());
            return (up, sent);
        }
    };
    // Request legs always carry a body. The session below never sees the request it answers, so
    // a bodiless request that depends on it (HEAD framing, the request's own `Connection: close`)
    // must go through Pingora's write path, as probes do.
    debug_assert!(body.is_some(), "a request leg without a body");
    let session = |stream| Box::new(HttpSession::H1(Http1Session::new_with_options(stream, peer)));
    let Some(mut wire) = http_req_header_to_wire(header) else {
        let e = pingora::Error::explain(pingora::ErrorType::InvalidHTTPHeader, "request header cannot be written");
        return (session(stream), Err(e));
    };
    if let Some(body) = body {
        wire.extend_from_slice(body);
    }
    let written = match stream.write_all(&wire).await {
        Ok(()) => stream.flush().await,
        Err(e) => Err(e),
    };
    (session(stream), written.map_err(|e| pingora::Error::because(pingora::ErrorType::WriteError, "writing the request", e)))
}

/// Why a probe got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The exchange failed.
    #[error(transparent)]
    Exchange(#[from] LegError),
    /// No complete answer within the probe's timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The body was over the cap.
    #[error("body over {0} bytes")]
    TooLarge(usize),
    /// The body broke off.
    #[error("body: {0}")]
    Body(String),
}

/// `GET path` on `worker` within `timeout`, over the probes' pool: the status and up to
/// `max_body` bytes of body. `keep_alive: false` asks for a fresh connection every time
/// (`Connection: close`); otherwise the connection goes back to the probes' pool when the body
/// was read whole.
pub async fn get(gw: &Gateway, worker: &Worker, path: &str, timeout: Duration, max_body: usize, keep_alive: bool) -> Result<(u16, Bytes), ProbeError> {
    let attempt = async {
        let bad = |e: Box<pingora::Error>| ProbeError::Exchange(LegError::new(LegErrorKind::Send, &worker.url, e.to_string()));
        let mut h = RequestHeader::build("GET", path.as_bytes(), Some(3)).map_err(bad)?;
        h.insert_header("host", worker.host_header.as_str()).map_err(bad)?;
        h.insert_header("user-agent", "kvgate").map_err(bad)?;
        if !keep_alive {
            h.insert_header("connection", "close").map_err(bad)?;
        }
        let cfg = gw.config();
        let mut ex = exchange(gw, &cfg, worker, &h, None, Pool::Probes, None).await?;
        let status = ex.header.status.as_u16();
        let mut body = BytesMut::new();
        loop {
            match ex.session.read_response_body().await {
                Ok(Some(chunk)) if body.len() + chunk.len() <= max_body => body.extend_from_slice(&chunk),
                Ok(Some(_)) => return Err(ProbeError::TooLarge(max_body)),
                Ok(None) => break,
                Err(e) => return Err(ProbeError::Body(e.to_string())),
            }
        }
        if keep_alive {
            release_probe(gw, ex, Duration::from_millis(cfg.timeouts.upstream_idle_ms)).await;
        }
        Ok((status, body.freeze()))
    };
    tokio::time::timeout(timeout, attempt).await.unwrap_or(Err(ProbeError::Timeout(timeout)))
}

/// Returns a request leg's finished connection to its worker's keep-alive pool; one the worker
/// asked to close, or whose body was not read whole, is closed instead. Synchronous: on the
/// request path an `async` release would carry Pingora's shutdown future inside every
/// request's future (docs/architecture.md, "Future sizes").
pub fn release(ex: Exchange) {
    let (Home::Worker(home), HttpSession::H1(mut h1)) = (ex.home, *ex.session) else { return };
    h1.respect_keepalive();
    // `reuse` is ready at once when the connection may be kept; otherwise it would shut the
    // connection down, which dropping it does as well (plain TCP).
    let mut reuse = std::pin::pin!(h1.reuse());
    if let Poll::Ready(Some(stream)) = reuse.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        home.put(stream);
    }
}

/// Returns a probe's finished connection to Pingora's pool (the probes' own), idle for at most
/// `idle`.
async fn release_probe(gw: &Gateway, ex: Exchange, idle: Duration) {
    if let Home::Probes(peer) = ex.home {
        gw.connector.release_http_session(*ex.session, &*peer, Some(idle)).await
    }
}
