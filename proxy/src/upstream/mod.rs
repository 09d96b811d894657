//! Talking HTTP/1.1 to workers: one exchange — connect (from a keep-alive pool when possible),
//! send a request, read the response head — shared by the request path's legs and the
//! background probes (health, worker metrics), plus the header rules for what crosses the
//! gateway.
//!
//! The gateway writes its requests and reads the responses itself ([`response`]): Pingora's
//! proxy pipeline cannot forward a body over 64 KiB that was read before the upstream was
//! chosen (docs/pingora.md, "Why a manual upstream leg"), and its HTTP/1 client built header
//! maps for every response. Connections wait in each worker's own keep-alive pools
//! ([`pool::IdlePool`]): one for request legs, one for probes.

// Parses bytes from outside: a narrowing cast here could truncate a peer's value.
#![deny(clippy::cast_possible_truncation)]

pub mod pool;
pub mod response;

use crate::config::Config;
use crate::error::{LegError, LegErrorKind};
use crate::fleet::Worker;
use crate::h1::request_head::RequestHead;
use crate::h1::response_head::{BadHeader as ClientBadHeader, ResponseHead};
use bytes::{Bytes, BytesMut};
use pool::IdlePool;
use response::WorkerResponse;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Whether a header named `name` crosses the gateway: not hop-by-hop, and not named by the
/// message's own `Connection` header (`connection`, its value).
fn forwarded(name: &[u8], connection: Option<&[u8]>) -> bool {
    !hop_by_hop(name) && !connection.is_some_and(|list| crate::h1::list_has(list, name))
}

/// Whether header `name` (any case) describes one hop and is never forwarded, besides those a
/// `Connection` header names: the hop-by-hop headers of RFC 9110 section 7.6.1 and their legacy
/// kin. `Host` and `Content-Length` are the gateway's to write; the proxy credentials are the
/// gateway's to read, never a worker's. The names' lengths are nearly all distinct, so the
/// length picks the one or two to compare: this runs for every header of every request and
/// response.
fn hop_by_hop(name: &[u8]) -> bool {
    let is = |h: &[u8]| name.eq_ignore_ascii_case(h);
    match name.len() {
        2 => is(b"te"),
        4 => is(b"host"),
        6 => is(b"expect"),
        7 => is(b"trailer") || is(b"upgrade"),
        10 => is(b"connection") || is(b"keep-alive"),
        14 => is(b"content-length"),
        16 => is(b"proxy-connection"),
        17 => is(b"transfer-encoding"),
        18 => is(b"proxy-authenticate"),
        19 => is(b"proxy-authorization"),
        _ => false,
    }
}

/// The `Connection` value to look each header up in: `None` when it names no header beyond
/// `keep-alive` and `close` (the usual case), so the per-header lookup is skipped.
fn naming(connection: Option<&[u8]>) -> Option<&[u8]> {
    connection.filter(|c| crate::h1::names_headers(c))
}

/// An upstream connection whose response head has arrived.
pub struct Exchange {
    /// The response (dropping it closes the connection; see [`release`]).
    pub response: WorkerResponse,
    /// The response status.
    pub status: u16,
    /// When the request was sent (the start of the first-byte deadline).
    pub sent_at: Instant,
    /// The keep-alive pool the connection returns to.
    pub home: Arc<IdlePool>,
}

/// A worker request written out for the wire: its head (the client's headers minus hop-by-hop
/// ones, with the worker's `Host`, the body's length and the request id) and its body, in one
/// buffer so that it goes out in one write. Written straight from the client's header: building
/// a Pingora header first costs two header maps and a copy of every name and value per request
/// (docs/architecture.md, "The hot path's allocations").
pub fn request_wire(client: &RequestHead, worker: &Worker, method: &str, path: &str, body: &[u8], request_id: &str) -> Result<Vec<u8>, BadHeader> {
    check_path(path)?;
    if request_id.bytes().any(forbidden) {
        return Err(BadHeader("the request id"));
    }
    if method.is_empty() || !method.bytes().all(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c)) {
        return Err(BadHeader("the request method"));
    }
    let mut w = Vec::with_capacity(256 + body.len());
    crate::h1::put_request_line(&mut w, method, path);
    let mut typed = false;
    let connection = naming(client.header("connection"));
    for (name, value) in client.headers() {
        if forwarded(name, connection) && !name.eq_ignore_ascii_case(b"x-request-id") {
            typed |= name.eq_ignore_ascii_case(b"content-type");
            line(&mut w, name, value);
        }
    }
    if !typed {
        line(&mut w, b"Content-Type", b"application/json");
    }
    line(&mut w, b"Host", worker.host_header.as_bytes());
    // A bodiless GET or DELETE goes out as the client sent it, without a length.
    if !body.is_empty() || !matches!(method, "GET" | "DELETE" | "OPTIONS") {
        crate::h1::put_content_length(&mut w, body.len() as u64);
    }
    line(&mut w, b"X-Request-Id", request_id.as_bytes());
    w.extend_from_slice(b"\r\n");
    w.extend_from_slice(body);
    Ok(w)
}

/// A worker request that could not be written: the part that held a byte HTTP/1.1 forbids.
#[derive(Debug, thiserror::Error)]
#[error("{0} holds a byte HTTP/1.1 forbids there (NUL, CR, LF, or a space in the path)")]
pub struct BadHeader(&'static str);

/// A request target fit for the wire: not empty, no space, no byte that would split the head.
fn check_path(path: &str) -> Result<(), BadHeader> {
    if path.is_empty() || path.bytes().any(|c| c == b' ' || forbidden(c)) {
        return Err(BadHeader("the request path"));
    }
    Ok(())
}

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

/// The client's response head for a worker's answer: the worker's headers minus hop-by-hop
/// ones (the client's connection frames the body itself: chunked for streams, the worker's
/// `Content-Length` when it framed the body by it and `rewritten` is false), with the request id
/// and the worker that answered (`x-kvgate-worker`) in place of any the worker sent. A body the gateway may rewrite (a followed
/// stream: ids stripped, continued on another worker) always goes out chunked, since the
/// worker's length would no longer be its length. Names go out as the worker wrote them.
pub fn client_response_header(
    ex: &Exchange,
    request_id: &str,
    worker: &Worker,
    shown: crate::config::WorkerHeader,
    rewritten: bool,
) -> Result<ResponseHead, ClientBadHeader> {
    let up = &ex.response;
    let mut h = ResponseHead::new(up.status());
    let connection = naming(up.header("connection"));
    for (name, value) in up.headers() {
        if name.eq_ignore_ascii_case(b"content-length") {
            if !rewritten && up.framed_by_length() {
                let n = crate::h1::content_length(value);
                h.length(n.ok_or_else(|| ClientBadHeader("content-length".into()))?);
            }
        } else if forwarded(name, connection) && !name.eq_ignore_ascii_case(b"x-request-id") && !name.eq_ignore_ascii_case(b"x-kvgate-worker") {
            // Parsed by httparse from the worker's head: no byte in it can split the client's.
            h.parsed_header(name, value);
        }
    }
    h.header(b"x-request-id", request_id.as_bytes())?;
    match shown {
        // A worker's URL is checked when it is configured (`UpstreamUrl::parse`): no byte in it
        // can split the head.
        crate::config::WorkerHeader::Url => {
            h.parsed_header(b"x-kvgate-worker", worker.label.as_bytes());
        }
        // A name comes from the config or a connector: checked here.
        crate::config::WorkerHeader::Name if !worker.name.is_empty() => {
            h.header(b"x-kvgate-worker", worker.name.as_bytes())?;
        }
        _ => {}
    }
    Ok(h)
}

/// What an exchange sends; it also decides the pool the connection comes from.
#[derive(Clone, Copy)]
pub enum Outgoing<'a> {
    /// A request leg's whole request ([`request_wire`]), over its worker's legs' pool.
    Leg(&'a [u8]),
    /// A request the gateway makes on its own account (a health or metrics probe, a fleet
    /// operation), over its worker's probes' pool (`reuse`) or a fresh connection: a probe never rides on a connection a request
    /// opened, or a worker that stopped accepting connections would still look healthy.
    Probe {
        /// The request.
        wire: &'a [u8],
        /// Whether an idle connection may carry it.
        reuse: bool,
    },
}

impl Outgoing<'_> {
    fn wire(&self) -> &[u8] {
        match self {
            Outgoing::Leg(w) | Outgoing::Probe { wire: w, .. } => w,
        }
    }

    fn pool<'w>(&self, worker: &'w Worker) -> &'w Arc<IdlePool> {
        match self {
            Outgoing::Leg(_) => &worker.idle,
            Outgoing::Probe { .. } => &worker.probe_idle,
        }
    }

    fn reuses(&self) -> bool {
        !matches!(self, Outgoing::Probe { reuse: false, .. })
    }
}

/// Sends `out` to `worker` and reads the response head, waiting at most `header_timeout`
/// after the request was sent. A pooled connection that fails before any response byte was
/// most likely closed by the worker while idle, so one fresh connection is tried before giving
/// up (the request may then run twice if the worker had in fact taken it).
pub async fn exchange(cfg: &Config, worker: &Worker, out: Outgoing<'_>, header_timeout: Option<Duration>) -> Result<Exchange, LegError> {
    let addr = worker.addr().await.map_err(|e| LegError::new(LegErrorKind::Resolve, &worker.url, e.to_string()).with_source(e))?;
    let connect_limit = Duration::from_millis(cfg.timeouts.connect_ms);
    let idle = Duration::from_millis(cfg.timeouts.upstream_idle_ms);
    let home = out.pool(worker);
    let mut fresh_try = 0;
    loop {
        let (stream, reused) = connect(worker, addr, connect_limit, home, idle, fresh_try > 0 || !out.reuses()).await?;
        let failed = match send(stream, out.wire()).await {
            Err(e) => LegError::new(LegErrorKind::Send, &worker.url, e.to_string()).with_source(e),
            Ok(stream) => {
                let sent_at = Instant::now();
                let read = WorkerResponse::read(stream, false);
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
                match r {
                    Ok(response) => return Ok(Exchange { status: response.status(), response, sent_at, home: home.clone() }),
                    Err(e) => LegError::new(LegErrorKind::Response, &worker.url, e.to_string()).with_source(e),
                }
            }
        };
        if !(reused && fresh_try == 0) {
            return Err(failed);
        }
        fresh_try += 1;
    }
}

/// A connection to `worker`: an idle one from `pool` unless `fresh`, else a new one to `addr`
/// within `limit`. Returns whether it was reused. A plain tokio stream: the gateway reads and
/// writes it in whole pieces through its own buffers, so Pingora's buffered, timed stream would
/// only add a layer per read and write.
async fn connect(worker: &Worker, addr: SocketAddr, limit: Duration, pool: &IdlePool, idle: Duration, fresh: bool) -> Result<(TcpStream, bool), LegError> {
    if let Some(s) = if fresh { None } else { pool.take(idle) } {
        return Ok((s, true));
    }
    let stream = match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(LegError::new(LegErrorKind::Connect, &worker.url, format!("connecting to {addr}: {e}")).with_source(e)),
        Err(_) => {
            return Err(LegError::new(LegErrorKind::Connect, &worker.url, format!("connecting to {addr}: no answer within timeouts.connect_ms ({limit:?})")));
        }
    };
    // Requests go out in one write each: Nagle's delay would only hold back the next one.
    stream.set_nodelay(true).map_err(|e| LegError::new(LegErrorKind::Connect, &worker.url, e.to_string()).with_source(e))?;
    Ok((stream, false))
}

/// Sends a request in one write (head and body together): a second send per request would
/// carry the receiver's network processing again on loopback.
async fn send(mut stream: TcpStream, wire: &[u8]) -> std::io::Result<TcpStream> {
    use tokio::io::AsyncWriteExt;
    stream.write_all(wire).await?;
    stream.flush().await?;
    Ok(stream)
}

/// A probe's `GET path` for the wire; `keep_alive: false` asks the worker to close after it.
pub fn probe_wire(worker: &Worker, path: &str, keep_alive: bool) -> Result<Vec<u8>, BadHeader> {
    control_wire(worker, "GET", path, None, keep_alive)
}

/// A request the gateway makes of a worker on its own account (a probe, a fleet operation):
/// `method path`, with `body` as JSON when given.
fn control_wire(worker: &Worker, method: &str, path: &str, body: Option<&[u8]>, keep_alive: bool) -> Result<Vec<u8>, BadHeader> {
    check_path(path)?;
    let mut w = Vec::with_capacity(128 + path.len() + body.map_or(0, <[u8]>::len));
    crate::h1::put_request_line(&mut w, method, path);
    line(&mut w, b"Host", worker.host_header.as_bytes());
    line(&mut w, b"User-Agent", b"kvgate");
    if !keep_alive {
        line(&mut w, b"Connection", b"close");
    }
    match body {
        Some(b) => {
            line(&mut w, b"Content-Type", b"application/json");
            line(&mut w, b"Content-Length", b.len().to_string().as_bytes());
            w.extend_from_slice(b"\r\n");
            w.extend_from_slice(b);
        }
        // A bodiless POST still says so: some servers wait for a length otherwise.
        None if method != "GET" => {
            line(&mut w, b"Content-Length", b"0");
            w.extend_from_slice(b"\r\n");
        }
        None => w.extend_from_slice(b"\r\n"),
    }
    Ok(w)
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

/// `GET path` on `worker` within `timeout`, over its probes' pool: the status and up to
/// `max_body` bytes of body. `keep_alive: false` asks for a fresh connection every time
/// (`Connection: close`); otherwise the connection goes back to the probes' pool when the body
/// was read whole.
pub async fn get(cfg: &Config, worker: &Worker, path: &str, timeout: Duration, max_body: usize, keep_alive: bool) -> Result<(u16, Bytes), ProbeError> {
    let wire = probe_wire(worker, path, keep_alive).map_err(|e| ProbeError::Exchange(LegError::new(LegErrorKind::Send, &worker.url, e.to_string())))?;
    probe(cfg, worker, &wire, keep_alive, timeout, max_body).await
}

/// `method path` with a JSON `body` on `worker` within `timeout`, on a fresh connection that
/// closes after it (fleet operations are rare, and one must never reuse a connection a pause
/// or a sleep may have left in a strange state): the status and up to `max_body` bytes.
pub async fn call(
    cfg: &Config,
    worker: &Worker,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    timeout: Duration,
    max_body: usize,
) -> Result<(u16, Bytes), ProbeError> {
    let wire =
        control_wire(worker, method, path, body, false).map_err(|e| ProbeError::Exchange(LegError::new(LegErrorKind::Send, &worker.url, e.to_string())))?;
    probe(cfg, worker, &wire, false, timeout, max_body).await
}

/// Sends `wire` over the probes' pool (`reuse`) or a fresh connection and reads the answer.
async fn probe(cfg: &Config, worker: &Worker, wire: &[u8], reuse: bool, timeout: Duration, max_body: usize) -> Result<(u16, Bytes), ProbeError> {
    whole_answer(cfg, worker, Outgoing::Probe { wire, reuse }, timeout, max_body).await
}

/// Sends `out` to `worker` and reads its whole answer within `timeout`: the status and up to
/// `max_body` bytes of body. The connection goes back to its pool when the body was read whole.
pub async fn whole_answer(cfg: &Config, worker: &Worker, out: Outgoing<'_>, timeout: Duration, max_body: usize) -> Result<(u16, Bytes), ProbeError> {
    let attempt = async {
        let mut ex = exchange(cfg, worker, out, None).await?;
        let mut body = BytesMut::new();
        loop {
            match ex.response.read_body().await {
                Ok(Some(chunk)) if body.len() + chunk.len() <= max_body => body.extend_from_slice(&chunk),
                Ok(Some(_)) => return Err(ProbeError::TooLarge(max_body)),
                Ok(None) => break,
                Err(e) => return Err(ProbeError::Body(e.to_string())),
            }
        }
        let status = ex.status;
        release(ex);
        Ok((status, body.freeze()))
    };
    tokio::time::timeout(timeout, attempt).await.unwrap_or(Err(ProbeError::Timeout(timeout)))
}

/// Returns a finished connection to the keep-alive pool it came from; one the worker asked to
/// close, or whose body was not read whole, is closed instead. Synchronous, so that it costs
/// a request's future nothing (docs/architecture.md, "Future sizes").
pub fn release(ex: Exchange) {
    if let Some(stream) = ex.response.into_reusable() {
        ex.home.put(stream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn the_hop_by_hop_check_knows_exactly_the_listed_names() {
        for h in HOP_BY_HOP {
            assert!(hop_by_hop(h.as_bytes()) && hop_by_hop(h.to_ascii_uppercase().as_bytes()), "{h}");
        }
        for other in ["content-type", "x-request-id", "authorization", "tea", "hosts", "date", "", "connectio"] {
            assert!(!hop_by_hop(other.as_bytes()), "{other}");
        }
    }
    use crate::config::UpstreamUrl;

    fn worker() -> Worker {
        Worker::new(UpstreamUrl::parse("http://10.0.0.7:8000").unwrap())
    }

    fn client(headers: &[(&str, &str)]) -> RequestHead {
        let lines: String = headers.iter().flat_map(|&(n, v)| [n, ": ", v, "\r\n"]).collect();
        RequestHead::parse(format!("POST /v1/completions HTTP/1.1\r\n{lines}\r\n").into()).unwrap()
    }

    /// The client's head for a worker answer `wire`, `rewritten` or not.
    async fn client_head(wire: &'static [u8], rewritten: bool) -> ResponseHead {
        use tokio::io::AsyncWriteExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ours = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (mut theirs, _) = l.accept().await.unwrap();
        theirs.write_all(wire).await.unwrap();
        let response = WorkerResponse::read(ours, false).await.unwrap();
        let ex = Exchange { status: response.status(), response, sent_at: Instant::now(), home: Arc::default() };
        client_response_header(&ex, "gw-id", &worker(), crate::config::WorkerHeader::Url, rewritten).unwrap()
    }

    #[tokio::test]
    async fn the_client_head_keeps_the_workers_end_to_end_headers_and_states_who_answered() {
        let wire = b"HTTP/1.1 200 OK\r\nServer: uvicorn\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nX-Request-Id: worker-id\r\ncontent-type: application/json\r\nContent-Length: 2\r\n\r\nok";
        let h = client_head(wire, false).await;
        let text = String::from_utf8(h.lines().to_vec()).unwrap();
        assert_eq!(text, "Server: uvicorn\r\ncontent-type: application/json\r\nx-request-id: gw-id\r\nx-kvgate-worker: http://10.0.0.7:8000\r\n");
        assert_eq!((h.status(), h.body_length()), (200, Some(2)));
        // A body the gateway may rewrite goes out chunked: the worker's length is not kept.
        assert_eq!(client_head(wire, true).await.body_length(), None);
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(client_head(chunked, false).await.body_length(), None);
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
        let wire = request_wire(&c, &worker(), "POST", "/v1/completions", b"{}", "req-1").unwrap();
        let text = String::from_utf8(wire).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert_eq!(body, "{}");
        let mut lines = head.split("\r\n");
        assert_eq!(lines.next(), Some("POST /v1/completions HTTP/1.1"));
        let mut got: Vec<&str> = lines.collect();
        got.sort_unstable();
        let want =
            ["Authorization: Bearer k", "Content-Length: 2", "Content-Type: application/json", "Host: 10.0.0.7:8000", "X-Request-Id: req-1", "X-Trace: t1"];
        assert_eq!(got, want, "{head}");
    }

    #[test]
    fn the_client_content_type_is_kept_and_not_doubled() {
        let c = client(&[("content-type", "application/json; charset=utf-8")]);
        let text = String::from_utf8(request_wire(&c, &worker(), "POST", "/v1/chat/completions", b"{}", "r").unwrap()).unwrap();
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
        let text = String::from_utf8(request_wire(&c, &worker(), "POST", "/v1/completions", b"{}", "r").unwrap()).unwrap();
        let names: Vec<&str> = text.split("\r\n").skip(1).take_while(|l| !l.is_empty()).filter_map(|l| l.split_once(':')).map(|(n, _)| n).collect();
        assert_eq!(names, ["Accept", "Accept", "Content-Type", "Host", "Content-Length", "X-Request-Id"], "{text}");
        assert!(text.find("Accept: a").unwrap() < text.find("Accept: b").unwrap(), "repeated headers keep their order");
    }

    #[test]
    fn header_names_go_out_as_the_client_wrote_them() {
        let c = client(&[("x-trace", "t")]);
        let text = String::from_utf8(request_wire(&c, &worker(), "POST", "/v1/completions", b"{}", "r").unwrap()).unwrap();
        assert!(text.contains("\r\nx-trace: t\r\n"), "{text}");
    }

    #[test]
    fn a_request_id_or_path_that_would_split_the_head_is_refused() {
        let c = client(&[]);
        let refused = |path: &str, id: &str| request_wire(&c, &worker(), "POST", path, b"{}", id).is_err();
        assert!(refused("/v1/completions", "a\r\nX-Evil: 1"));
        assert!(refused("/v1/completions", "a\0b"));
        assert!(refused("/v1/x y", "r"));
        assert!(refused("/v1/x\n", "r"));
        assert!(!refused("/v1/completions", "r-1"));
    }
}
