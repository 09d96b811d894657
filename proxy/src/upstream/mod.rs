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
use pingora::protocols::http::v1::client::HttpSession as Http1Session;
use pingora::upstreams::peer::HttpPeer;
use pool::IdlePool;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Headers that describe one hop and are never forwarded (besides those a `Connection` header
/// names). `Host` and `Content-Length` are the gateway's to write; the proxy credentials are
/// the gateway's to read, never a worker's.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "proxy-authenticate",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
    "expect",
];

/// Whether a header named `name` crosses the gateway: not hop-by-hop, and not named by the
/// message's own `Connection` header (`connection`, its value).
fn forwarded(name: &[u8], connection: Option<&[u8]>) -> bool {
    let named = |list: &[u8]| list.split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(name));
    !HOP_BY_HOP.iter().any(|h| h.as_bytes().eq_ignore_ascii_case(name)) && !connection.is_some_and(named)
}

/// An upstream connection whose response header has arrived.
pub struct Exchange {
    /// The session (dropping it closes the connection; see [`release`]). Boxed: an
    /// exchange moves through every phase of a request (docs/architecture.md, "Future sizes").
    pub session: Box<HttpSession>,
    /// The response status (the whole header stays in the session: copying it out costs two
    /// header maps per request).
    pub status: u16,
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

/// A worker request written out for the wire: its head (the client's headers minus hop-by-hop
/// ones, with the worker's `Host`, the body's length and the request id) and its body, in one
/// buffer so that it goes out in one write. Written straight from the client's header: building
/// a Pingora header first costs two header maps and a copy of every name and value per request
/// (docs/architecture.md, "The hot path's allocations").
pub fn request_wire(client: &RequestHeader, worker: &Worker, path: &str, body: &[u8], request_id: &str) -> Result<Vec<u8>, BadHeader> {
    if path.is_empty() || path.bytes().any(|c| c == b' ' || forbidden(c)) {
        return Err(BadHeader("the request path"));
    }
    if request_id.bytes().any(forbidden) {
        return Err(BadHeader("the request id"));
    }
    let mut w = Vec::with_capacity(256 + body.len());
    w.extend_from_slice(b"POST ");
    w.extend_from_slice(path.as_bytes());
    w.extend_from_slice(b" HTTP/1.1\r\n");
    let mut typed = false;
    let connection = client.headers.get("connection").map(|v| v.as_bytes());
    let mut forward = |name: &[u8], value: &[u8]| {
        if forwarded(name, connection) && !name.eq_ignore_ascii_case(b"x-request-id") {
            typed |= name.eq_ignore_ascii_case(b"content-type");
            line(&mut w, name, value);
        }
    };
    if client.has_case() {
        client.case_header_iter().for_each(|(n, v)| forward(n.as_slice(), v.as_bytes()));
    } else {
        client.headers.iter().for_each(|(n, v)| forward(n.as_str().as_bytes(), v.as_bytes()));
    }
    if !typed {
        line(&mut w, b"Content-Type", b"application/json");
    }
    line(&mut w, b"Host", worker.host_header.as_bytes());
    line(&mut w, b"Content-Length", body.len().to_string().as_bytes());
    line(&mut w, b"X-Request-Id", request_id.as_bytes());
    w.extend_from_slice(b"\r\n");
    w.extend_from_slice(body);
    Ok(w)
}

/// A worker request that could not be written: the part that held a byte HTTP/1.1 forbids.
#[derive(Debug, thiserror::Error)]
#[error("{0} holds a byte HTTP/1.1 forbids there (NUL, CR, LF, or a space in the path)")]
pub struct BadHeader(&'static str);

/// Whether no header value (nor request target) may carry byte `c`.
fn forbidden(c: u8) -> bool {
    matches!(c, 0 | b'\r' | b'\n')
}

/// Appends one `name: value` header line.
fn line(w: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    w.extend_from_slice(name);
    w.extend_from_slice(b": ");
    w.extend_from_slice(value);
    w.extend_from_slice(b"\r\n");
}

/// The client's response header for a worker's answer: the worker's headers minus hop-by-hop
/// ones (Pingora frames the body itself: chunked for streams, Content-Length when the worker
/// gave one and `rewritten` is false), with the request id and the worker that answered
/// (`x-kvgate-worker`). A body the gateway may rewrite (a followed stream: ids stripped,
/// continued on another worker) always goes out chunked, since the worker's length would no
/// longer be its length. Built without a case map: names go out in their usual capitalisation
/// (Pingora titles known ones).
pub fn client_response_header(ex: &Exchange, request_id: &str, worker: &str, rewritten: bool) -> pingora::Result<ResponseHeader> {
    let Some(up) = ex.session.response_header() else {
        return pingora::Error::e_explain(pingora::ErrorType::InvalidHTTPHeader, "no response header");
    };
    let mut h = ResponseHeader::build_no_case(up.status, Some(up.headers.len() + 3))?;
    let connection = up.headers.get("connection").map(|v| v.as_bytes());
    for (name, value) in up.headers.iter() {
        let n = name.as_str();
        if (n == "content-length" && !rewritten) || forwarded(n.as_bytes(), connection) {
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

/// What an exchange sends; it also decides the pool the connection comes from.
#[derive(Clone, Copy)]
pub enum Outgoing<'a> {
    /// A request leg's whole request ([`request_wire`]), over its worker's own [`IdlePool`].
    Leg(&'a [u8]),
    /// A health or metrics probe's bodiless request, over the probes' pool (Pingora's
    /// connector, which holds nothing else): a probe never rides on a connection a request
    /// opened, or a worker that stopped accepting connections would still look healthy.
    Probe(&'a RequestHeader),
}

/// Sends `out` to `worker` and reads the response header, waiting at
/// most `header_timeout` after the request was sent. A pooled connection that fails before any
/// response header was most likely closed by the worker while idle, so one fresh connection is
/// tried before giving up (the request may then run twice if the worker had in fact taken it).
pub async fn exchange(gw: &Gateway, cfg: &Config, worker: &Worker, out: Outgoing<'_>, header_timeout: Option<Duration>) -> Result<Exchange, LegError> {
    let addr = worker.addr().await.map_err(|e| LegError::new(LegErrorKind::Resolve, &worker.url, e.to_string()).with_source(e))?;
    let mut peer = HttpPeer::new(addr, false, String::new());
    let connect_limit = Duration::from_millis(cfg.timeouts.connect_ms);
    peer.options.connection_timeout = Some(connect_limit);
    peer.options.total_connection_timeout = Some(connect_limit);
    peer.options.idle_timeout = Some(Duration::from_millis(cfg.timeouts.upstream_idle_ms));
    let mut fresh_try = 0;
    loop {
        let (mut up, sent, reused) = match out {
            Outgoing::Leg(wire) => {
                let (stream, reused) = connect_leg(gw, worker, &peer, fresh_try > 0).await?;
                let (up, sent) = send_leg(stream, &peer, wire).await;
                (up, sent, reused)
            }
            Outgoing::Probe(header) => {
                let (up, reused) = connect_probe(gw, worker, &peer).await?;
                let (up, sent) = send_probe(up, header).await;
                (up, sent, reused)
            }
        };
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
                match r.map(|()| up.response_header().map(|h| h.status.as_u16())) {
                    Ok(Some(status)) => {
                        let home = match out {
                            Outgoing::Leg(_) => Home::Worker(worker.idle.clone()),
                            Outgoing::Probe(_) => Home::Probes(Box::new(peer)),
                        };
                        return Ok(Exchange { session: up, status, sent_at, home });
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

/// A connect error as a leg error.
fn connect_failed(worker: &Worker, e: Box<pingora::Error>) -> LegError {
    LegError::new(LegErrorKind::Connect, &worker.url, e.to_string()).with_source(*e)
}

/// A request leg's connection to `worker`: an idle one from its pool unless `fresh`, else a new
/// one. Returns whether it was reused.
async fn connect_leg(gw: &Gateway, worker: &Worker, peer: &HttpPeer, fresh: bool) -> Result<(Stream, bool), LegError> {
    let idle = peer.options.idle_timeout.unwrap_or_default();
    match if fresh { None } else { worker.idle.take(idle) } {
        Some(s) => Ok((s, true)),
        // Boxed: with keep-alive a new connection is rare, and its future is large
        // (docs/architecture.md, "Future sizes").
        None => Ok((Box::pin(gw.transport.new_stream(peer)).await.map_err(|e| connect_failed(worker, e))?, false)),
    }
}

/// A probe's connection, from the probes' pool. Boxed: Pingora's connect future is large, and
/// inline it would grow every request's future.
async fn connect_probe(gw: &Gateway, worker: &Worker, peer: &HttpPeer) -> Result<(Box<HttpSession>, bool), LegError> {
    Box::pin(gw.connector.get_http_session(peer)).await.map(|(s, reused)| (Box::new(s), reused)).map_err(|e| connect_failed(worker, e))
}

/// Sends a request leg in one write (header and body together): Pingora's HTTP/1 client
/// flushes the header on its own, which costs a second `send` per request, and on loopback a
/// send carries the receiver's network processing too. The session that reads the response is
/// then made over the same connection; it never sees the request, which is why legs are always
/// `POST`s with a body (no HEAD framing, no `Connection: close` of their own).
async fn send_leg(mut stream: Stream, peer: &HttpPeer, wire: &[u8]) -> (Box<HttpSession>, pingora::Result<()>) {
    use tokio::io::AsyncWriteExt;
    let written = match stream.write_all(wire).await {
        Ok(()) => stream.flush().await,
        Err(e) => Err(e),
    };
    let session = Box::new(HttpSession::H1(Http1Session::new_with_options(stream, peer)));
    (session, written.map_err(|e| pingora::Error::because(pingora::ErrorType::WriteError, "writing the request", e)))
}

/// Sends a probe's bodiless request through Pingora's HTTP/1 client. Boxed as in
/// [`connect_probe`].
async fn send_probe(mut up: Box<HttpSession>, header: &RequestHeader) -> (Box<HttpSession>, pingora::Result<()>) {
    let sent = Box::pin(async {
        up.write_request_header(Box::new(header.clone())).await?;
        up.finish_request_body().await
    })
    .await
    .map(|_| ());
    (up, sent)
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
        let mut ex = exchange(gw, &cfg, worker, Outgoing::Probe(&h), None).await?;
        let status = ex.status;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::UpstreamUrl;

    fn worker() -> Worker {
        Worker::new(UpstreamUrl::parse("http://10.0.0.7:8000").unwrap())
    }

    fn client(headers: &[(&str, &str)]) -> RequestHeader {
        let mut h = RequestHeader::build("POST", b"/v1/completions", None).unwrap();
        for (n, v) in headers {
            h.append_header(n.to_string(), *v).unwrap();
        }
        h
    }

    #[test]
    fn a_worker_request_keeps_end_to_end_headers_and_replaces_the_hop_by_hop_ones() {
        let c = client(&[
            ("Authorization", "Bearer k"),
            ("Connection", "keep-alive"),
            ("Keep-Alive", "timeout=5"),
            ("Host", "gateway.example"),
            ("Content-Length", "999"),
            ("Transfer-Encoding", "chunked"),
            ("X-Request-Id", "from-client"),
            ("X-Trace", "t1"),
        ]);
        let wire = request_wire(&c, &worker(), "/v1/completions", b"{}", "req-1").unwrap();
        let text = String::from_utf8(wire).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert_eq!(body, "{}");
        let mut lines = head.split("\r\n");
        assert_eq!(lines.next(), Some("POST /v1/completions HTTP/1.1"));
        let mut got: Vec<&str> = lines.collect();
        got.sort();
        let want =
            ["Authorization: Bearer k", "Content-Length: 2", "Content-Type: application/json", "Host: 10.0.0.7:8000", "X-Request-Id: req-1", "X-Trace: t1"];
        assert_eq!(got, want, "{head}");
    }

    #[test]
    fn the_client_content_type_is_kept_and_not_doubled() {
        let c = client(&[("content-type", "application/json; charset=utf-8")]);
        let text = String::from_utf8(request_wire(&c, &worker(), "/v1/chat/completions", b"{}", "r").unwrap()).unwrap();
        assert_eq!(text.matches("ontent-").count(), 2, "content-type and content-length once each: {text}");
        assert!(text.contains("content-type: application/json; charset=utf-8\r\n"), "{text}");
    }

    #[test]
    fn headers_a_connection_header_names_and_other_hop_by_hop_ones_stay_behind() {
        let c = client(&[
            ("Connection", "keep-alive, X-Hop, x-other"),
            ("X-Hop", "1"),
            ("X-Other", "2"),
            ("Proxy-Authorization", "Basic c2VjcmV0"),
            ("Expect", "100-continue"),
            ("TE", "trailers"),
            ("Trailer", "X-T"),
            ("Upgrade", "websocket"),
            ("Proxy-Connection", "keep-alive"),
            ("Accept", "a"),
            ("Accept", "b"),
        ]);
        let text = String::from_utf8(request_wire(&c, &worker(), "/v1/completions", b"{}", "r").unwrap()).unwrap();
        let names: Vec<&str> = text.split("\r\n").skip(1).take_while(|l| !l.is_empty()).filter_map(|l| l.split_once(':')).map(|(n, _)| n).collect();
        assert_eq!(names, ["Accept", "Accept", "Content-Type", "Host", "Content-Length", "X-Request-Id"], "{text}");
        assert!(text.find("Accept: a").unwrap() < text.find("Accept: b").unwrap(), "repeated headers keep their order");
    }

    #[test]
    fn a_header_without_recorded_case_goes_out_as_parsed() {
        let mut c = RequestHeader::build_no_case("POST", b"/v1/completions", None).unwrap();
        c.append_header("x-trace", "t").unwrap();
        let text = String::from_utf8(request_wire(&c, &worker(), "/v1/completions", b"{}", "r").unwrap()).unwrap();
        assert!(text.contains("\r\nx-trace: t\r\n"), "{text}");
    }

    #[test]
    fn a_request_id_or_path_that_would_split_the_head_is_refused() {
        let c = client(&[]);
        let refused = |path: &str, id: &str| request_wire(&c, &worker(), path, b"{}", id).is_err();
        assert!(refused("/v1/completions", "a\r\nX-Evil: 1"));
        assert!(refused("/v1/completions", "a\0b"));
        assert!(refused("/v1/x y", "r"));
        assert!(refused("/v1/x\n", "r"));
        assert!(!refused("/v1/completions", "r-1"));
    }
}
