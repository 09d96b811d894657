//! Talking HTTP/1.1 to workers: one exchange — connect (from a keep-alive pool when possible),
//! send a request, read the response head — shared by the request path's legs and the
//! background probes (health, worker metrics), and the client's head made from a worker's
//! answer. The heads themselves are written and parsed in `crate::h1`.
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
use crate::h1::hop::{forwarded, naming};
use crate::h1::request_head::Unwritable;
use crate::h1::response_head::{BadHeader as ClientBadHeader, ResponseHead};
use bytes::{Bytes, BytesMut};
use pool::IdlePool;
use response::WorkerResponse;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

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
    /// A request leg's whole request ([`crate::h1::request_head::write_forwarded`]), over its worker's legs' pool.
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
pub fn probe_wire(worker: &Worker, path: &str, keep_alive: bool) -> Result<Vec<u8>, Unwritable> {
    crate::h1::request_head::write_own(worker.host_header.as_bytes(), "GET", path, None, keep_alive)
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
    let wire = crate::h1::request_head::write_own(worker.host_header.as_bytes(), method, path, body, false)
        .map_err(|e| ProbeError::Exchange(LegError::new(LegErrorKind::Send, &worker.url, e.to_string())))?;
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

    use crate::config::UpstreamUrl;

    fn worker() -> Worker {
        Worker::new(UpstreamUrl::parse("http://10.0.0.7:8000").unwrap())
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
}
