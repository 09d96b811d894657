//! A client's HTTP/1.1 connection, served by the gateway itself: request heads parsed once with
//! `httparse` (no header maps), bodies framed by `Content-Length` or chunked coding, responses
//! written straight into one buffer (a unary answer leaves in one send, head and body
//! together), keep-alive and pipelining. Pingora accepts the connection and hands it over
//! (`http::GatewayApp`); its HTTP/1 server session cost more CPU per request than the
//! gateway's own phases.
//!
//! Reads are cancel-safe (one read into the buffer is the only await; parsing follows it), so
//! [`ClientConn::closed`] can race a worker in a `select!` and lose no pipelined byte.

use crate::h1::body::Framing;
use crate::h1::chunked::{ChunkError, Chunked};
use crate::h1::request_head::{HeadError, MAX_HEAD, RequestHead, parse_request};
use crate::h1::response_head::ResponseHead;
use crate::h1::spare::{ReadBuffer, WriteBuffer, take_write_buffer};
use crate::idle_timer::IdleTimer;
use bytes::{Buf, Bytes};
use pingora::protocols::Stream;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long [`ClientConn::linger`] keeps reading after the answer went out.
pub const LINGER: Duration = Duration::from_secs(2);
/// Bodies larger than this are written from their own buffer instead of copied behind the
/// chunk framing.
const COPY_LIMIT: usize = 16 * 1024;

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyReadError {
    /// The connection failed or closed mid-body.
    #[error("reading the request body: {0}")]
    Io(#[from] std::io::Error),
    /// The client closed the connection mid-body.
    #[error("the client closed the connection mid-body")]
    Closed,
    /// The chunked body is malformed.
    #[error("chunked request body: {0}")]
    Chunked(#[from] ChunkError),
}

/// How the response body is framed, once its head is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyOut {
    /// No head written yet.
    NotStarted,
    /// This many bytes are still owed.
    Length(u64),
    /// Chunked coding.
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client of a response of unknown length).
    UntilClose,
    /// Complete.
    Done,
}

/// The client's connection.
pub struct ClientConn {
    stream: Stream,
    /// Bytes read and not yet taken: no buffer while the client sends nothing.
    rbuf: ReadBuffer,
    head: RequestHead,
    body: Framing,
    continue_owed: bool,
    /// Bytes gathered for the next send: taken only when a response is written.
    wbuf: Option<WriteBuffer>,
    out: BodyOut,
    head_only: bool,
    keep_alive: bool,
    write_limit: Option<Duration>,
    idle_timer: IdleTimer,
}

impl std::fmt::Debug for ClientConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConn").field("head", &self.head).field("out", &self.out).field("keep_alive", &self.keep_alive).finish_non_exhaustive()
    }
}

impl ClientConn {
    /// A connection over `stream`, no request read yet.
    pub fn new(stream: Stream) -> Self {
        Self {
            stream,
            rbuf: ReadBuffer::none(),
            head: RequestHead::default(),
            body: Framing::Done,
            continue_owed: false,
            wbuf: None,
            out: BodyOut::Done,
            head_only: false,
            keep_alive: true,
            write_limit: None,
            idle_timer: IdleTimer::default(),
        }
    }

    /// Bounds each write to the client: a client that accepts none of a write's bytes for
    /// this long is taken as gone (the write fails with `TimedOut`), so a reader that stopped
    /// reading cannot hold a worker's stream and its slot forever. `None`: no bound.
    pub fn set_write_limit(&mut self, limit: Option<Duration>) {
        self.write_limit = limit;
    }

    /// The current request's head.
    pub fn req(&self) -> &RequestHead {
        &self.head
    }

    /// The client's IP address (none for a Unix socket or when the kernel cannot say).
    pub fn peer_ip(&self) -> Option<std::net::IpAddr> {
        self.stream.get_socket_digest()?.peer_addr()?.as_inet().map(std::net::SocketAddr::ip)
    }

    /// Whether bytes of a next request have arrived already (a pipelining client).
    pub fn has_buffered(&self) -> bool {
        !self.rbuf.is_empty()
    }

    /// Reads the next request's head, waiting at most `idle` for it to arrive whole. `Ok(false)`:
    /// the client closed the connection between requests, or was idle that long.
    pub async fn read_request(&mut self, idle: Duration) -> Result<bool, HeadError> {
        // A head that is refused still gets an answer (and then the connection closes).
        (self.out, self.head_only, self.body) = (BodyOut::NotStarted, false, Framing::Done);
        // The last head shares the read buffer: let it go first, so the buffer is this
        // connection's alone again and the next read reuses it instead of allocating another.
        // Its list of header offsets is kept for the next head.
        let spare = std::mem::take(&mut self.head).into_header_list();
        // One timer per connection, moved later for each request. Taken out while the read
        // borrows the connection.
        let mut timer = std::mem::take(&mut self.idle_timer);
        let read = tokio::select! {
            biased;
            r = self.read_head(spare) => r,
            () = timer.arm(idle) => Ok(false),
        };
        self.idle_timer = timer;
        read
    }

    /// Reads and parses the next head; `spare` is a list to hold its header offsets.
    async fn read_head(&mut self, mut spare: Vec<[u32; 4]>) -> Result<bool, HeadError> {
        loop {
            if !self.rbuf.is_empty() {
                if let Some((head, len)) = parse_request(&self.rbuf, &mut spare)? {
                    // Copied out rather than split off: a head that shared the read buffer
                    // would keep all 16 KiB of it while the request lives, and a client that
                    // then sends its body slowly would hold it the whole time.
                    let raw = Bytes::copy_from_slice(&self.rbuf[..len]);
                    self.rbuf.advance(len);
                    self.start(head.with_raw(raw))?;
                    return Ok(true);
                }
                if self.rbuf.len() >= MAX_HEAD {
                    return Err(HeadError::TooLarge);
                }
            }
            if self.fill().await? == 0 {
                return if self.rbuf.is_empty() { Ok(false) } else { Err(HeadError::Io(std::io::ErrorKind::UnexpectedEof.into())) };
            }
        }
    }

    /// Sets up the request's body framing and the response's state.
    fn start(&mut self, head: RequestHead) -> Result<(), HeadError> {
        let mut length: Option<u64> = None;
        let mut coding: Option<&[u8]> = None;
        for (n, v) in head.headers() {
            if n.eq_ignore_ascii_case(b"transfer-encoding") {
                if coding.is_some() {
                    return Err(HeadError::Malformed("more than one Transfer-Encoding header"));
                }
                coding = Some(v);
            } else if n.eq_ignore_ascii_case(b"content-length") {
                let parsed = crate::h1::content_length(v);
                match (parsed, length) {
                    (None, _) => return Err(HeadError::Malformed("invalid Content-Length")),
                    (Some(a), Some(b)) if a != b => return Err(HeadError::Malformed("conflicting Content-Length headers")),
                    (Some(a), _) => length = Some(a),
                }
            }
        }
        // A request framed two ways is how requests are smuggled past proxies: refused. So is
        // chunked coding from an HTTP/1.0 client, which has none (RFC 9112 §6.1).
        if coding.is_some() && head.is_http10() {
            return Err(HeadError::Malformed("Transfer-Encoding in an HTTP/1.0 request"));
        }
        self.body = match (coding, length) {
            (Some(_), Some(_)) => return Err(HeadError::Malformed("both Transfer-Encoding and Content-Length")),
            (Some(c), None) if c.trim_ascii().eq_ignore_ascii_case(b"chunked") => Framing::Chunked(Chunked::default()),
            (Some(_), None) => return Err(HeadError::Malformed("a Transfer-Encoding other than chunked")),
            (None, Some(n)) if n > 0 => Framing::Length(n),
            (None, _) => Framing::Done,
        };
        self.continue_owed =
            !self.body.is_done() && !head.is_http10() && head.header("expect").is_some_and(|v| v.trim_ascii().eq_ignore_ascii_case(b"100-continue"));
        self.keep_alive = if head.is_http10() { head.connection_has(b"keep-alive") } else { !head.connection_has(b"close") };
        self.head_only = head.method_is("HEAD");
        self.out = BodyOut::NotStarted;
        self.wbuf = None;
        self.head = head;
        Ok(())
    }

    /// Whether the client asked for `100 Continue` before sending its body and has not had it.
    pub fn expects_continue(&self) -> bool {
        self.continue_owed
    }

    /// Sends `100 Continue`.
    pub async fn write_continue(&mut self) -> std::io::Result<()> {
        self.continue_owed = false;
        self.out_buf().extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
        self.flush().await
    }

    /// The next run of request body bytes; `None` once the body is complete.
    pub async fn read_body(&mut self) -> Result<Option<Bytes>, BodyReadError> {
        loop {
            if let Some(data) = self.body.take(&mut self.rbuf)? {
                return Ok(Some(data));
            }
            if self.body.is_done() {
                return Ok(None);
            }
            if self.fill().await? == 0 {
                return Err(BodyReadError::Closed);
            }
        }
    }

    /// Whether the request body was read whole (or there was none).
    pub fn body_read(&self) -> bool {
        self.body.is_done()
    }

    /// Whether the connection may carry another request after this one, as far as the request
    /// said (the fuzz targets stop where a server would).
    #[cfg(feature = "fuzzing")]
    pub fn keeps_alive(&self) -> bool {
        self.keep_alive
    }

    /// The connection will close after this response.
    pub fn close_after(&mut self) {
        self.keep_alive = false;
    }

    /// Writes the response head. A chunked (or bodiless) response's head goes out at once; one
    /// with a length waits for its body, so a unary answer leaves in one send. A worker's
    /// answer, whose first body bytes are in hand, uses [`Self::queue_head`] instead.
    pub async fn write_head(&mut self, head: &ResponseHead) -> std::io::Result<()> {
        self.queue_head(head)?;
        if matches!(self.out, BodyOut::Chunked | BodyOut::Done) { self.flush().await } else { Ok(()) }
    }

    /// Buffers the response head to leave with the next body write, whatever the framing: for a
    /// caller that has the body's first bytes in hand (a stream whose first event arrived), so
    /// the head and the first token go out in one send. A caller whose first body write may
    /// not come at once calls [`Self::flush_queued`] instead of leaving the client waiting.
    pub fn queue_head(&mut self, head: &ResponseHead) -> std::io::Result<()> {
        if self.out != BodyOut::NotStarted {
            return Err(std::io::Error::other("the response head was written already"));
        }
        // Answered before its body was read (413, 408): the unread rest would be taken for the
        // next request, so the connection ends after this answer, and says so.
        if !self.body.is_done() {
            self.keep_alive = false;
        }
        let status = head.status();
        let bodiless = self.head_only || status == 204 || status == 304 || (100..200).contains(&status);
        self.out = match head.body_length() {
            _ if bodiless => BodyOut::Done,
            Some(0) => BodyOut::Done,
            Some(n) => BodyOut::Length(n),
            None if self.head.is_http10() => {
                self.keep_alive = false;
                BodyOut::UntilClose
            }
            None => BodyOut::Chunked,
        };
        let w = self.wbuf.get_or_insert_with(take_write_buffer);
        head.put_start(w);
        match (head.body_length(), self.out) {
            // No length on a 1xx or 204 (RFC 9110 §8.6); a HEAD answer may state the GET's.
            (Some(n), _) if !(status == 204 || (100..200).contains(&status)) && (!self.head_only || n > 0) => {
                crate::h1::put_content_length(w, n);
            }
            (None, BodyOut::Chunked) => w.extend_from_slice(b"Transfer-Encoding: chunked\r\n"),
            _ => {}
        }
        match (self.keep_alive, self.head.is_http10()) {
            (false, _) => w.extend_from_slice(b"Connection: close\r\n"),
            (true, true) => w.extend_from_slice(b"Connection: keep-alive\r\n"),
            (true, false) => {}
        }
        w.extend_from_slice(b"\r\n");
        Ok(())
    }

    /// Whether this request's response head was written or queued: once it was, no other
    /// answer can be given to the request.
    pub fn head_sent(&self) -> bool {
        self.out != BodyOut::NotStarted
    }

    /// Sends whatever is buffered (a queued head); nothing when nothing is.
    pub async fn flush_queued(&mut self) -> std::io::Result<()> {
        if self.wbuf.as_ref().is_none_or(|w| w.is_empty()) { Ok(()) } else { self.flush().await }
    }

    /// Writes body bytes (`end`: the last ones). Bytes past a declared length are an error, and
    /// a body that ends short of it leaves the connection to be closed.
    pub async fn write_body(&mut self, data: Bytes, end: bool) -> std::io::Result<()> {
        let mut own: Option<Bytes> = None;
        match self.out {
            BodyOut::NotStarted => return Err(std::io::Error::other("body before the response head")),
            BodyOut::Done => {
                if !data.is_empty() && !self.head_only {
                    return Err(std::io::Error::other("body past the end of the response"));
                }
            }
            BodyOut::Length(left) => {
                if data.len() as u64 > left {
                    self.keep_alive = false;
                    return Err(std::io::Error::other("body longer than its Content-Length"));
                }
                let left = left - data.len() as u64;
                self.out = if left == 0 { BodyOut::Done } else { BodyOut::Length(left) };
                if end && left > 0 {
                    self.keep_alive = false;
                }
                own = Some(data);
            }
            BodyOut::UntilClose => {
                if end {
                    self.out = BodyOut::Done;
                }
                own = Some(data);
            }
            BodyOut::Chunked => {
                if !data.is_empty() {
                    crate::h1::put_hex(self.out_buf(), data.len() as u64);
                    self.out_buf().extend_from_slice(b"\r\n");
                    if data.len() > COPY_LIMIT {
                        self.flush().await?;
                        self.send(&data).await?;
                    } else {
                        self.out_buf().extend_from_slice(&data);
                    }
                    self.out_buf().extend_from_slice(b"\r\n");
                }
                if end {
                    self.out_buf().extend_from_slice(b"0\r\n\r\n");
                    self.out = BodyOut::Done;
                }
            }
        }
        if let Some(d) = own.filter(|d| !d.is_empty()) {
            if d.len() > COPY_LIMIT {
                self.flush().await?;
                self.send(&d).await?;
            } else {
                self.out_buf().extend_from_slice(&d);
            }
        }
        self.flush().await
    }

    /// The buffer the next send gathers in, taken when the first bytes are written.
    fn out_buf(&mut self) -> &mut WriteBuffer {
        self.wbuf.get_or_insert_with(take_write_buffer)
    }

    /// Writes out whatever is buffered. The buffer goes back to the thread's spares after the
    /// send, so a connection between responses holds none.
    async fn flush(&mut self) -> std::io::Result<()> {
        match self.wbuf.take() {
            Some(wbuf) => self.send(&wbuf).await,
            None => Ok(()),
        }
    }

    /// Reads what the client sends next into the read buffer; 0 when it closed. A connection
    /// whose client sends nothing holds no read buffer: each try borrows one of the
    /// thread's spares and, when the socket has nothing yet, gives it back before waiting
    /// (an unfinished head keeps only its own bytes meanwhile), as nginx does with its header
    /// buffer. A failed try changes nothing in the socket, so the next one starts afresh.
    async fn fill(&mut self) -> std::io::Result<usize> {
        let (stream, rbuf) = (&mut self.stream, &mut self.rbuf);
        std::future::poll_fn(|cx| {
            rbuf.ready();
            let read = std::pin::pin!(stream.read_buf(&mut **rbuf)).poll(cx);
            if read.is_pending() {
                rbuf.wait();
            }
            read
        })
        .await
    }

    /// Writes `data` whole and flushes, within the write limit.
    async fn send(&mut self, data: &[u8]) -> std::io::Result<()> {
        let write = async {
            self.stream.write_all(data).await?;
            self.stream.flush().await
        };
        match self.write_limit {
            None => write.await,
            // The write is polled first: one that completes at once never arms the timer.
            Some(limit) => tokio::time::timeout(limit, write).await.unwrap_or_else(|_| {
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the client accepted none of the response for timeouts.client_write_ms"))
            }),
        }
    }

    /// Completes when the client has gone away (FIN or reset). Bytes it sends meanwhile (a
    /// pipelined request) are kept for later; once any are, it can no longer tell, and waits
    /// forever. Empty lines are not a request: clients may send a CRLF after a body, and the
    /// next request's parse skips them anyway (RFC 9112 section 2.2), so they are dropped
    /// rather than taken as a reason to stop watching. Call only after the request body was read.
    pub async fn closed(&mut self) {
        loop {
            let blank = self.rbuf.iter().take_while(|b| matches!(b, b'\r' | b'\n')).count();
            let _ = self.rbuf.split_to(blank);
            if !self.rbuf.is_empty() || !self.body.is_done() {
                return std::future::pending().await;
            }
            match self.fill().await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }

    /// Whether the connection can carry the next request: the response was complete, the
    /// request body read whole, and neither side asked to close.
    pub fn reusable(&self) -> bool {
        self.keep_alive && self.out == BodyOut::Done && self.body.is_done() && self.wbuf.as_ref().is_none_or(|w| w.is_empty())
    }

    /// Closes the connection's sending side, after writing what is buffered.
    pub async fn shutdown(&mut self) {
        let _ = self.flush().await;
        let _ = self.stream.shutdown().await;
    }

    /// After [`shutdown`](Self::shutdown) on a connection whose request body was not read
    /// (an early 413 or 408): reads and drops what the client still sends, for at most
    /// [`LINGER`], so the close does not meet unread bytes. Closing on unread bytes resets
    /// the connection, and a reset can make the client discard the answer before reading it.
    pub async fn linger(&mut self) {
        if self.body.is_done() {
            return;
        }
        let drain = async {
            loop {
                self.rbuf.clear();
                if !matches!(self.fill().await, Ok(n) if n > 0) {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(LINGER, drain).await;
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use tokio::io::DuplexStream;

    fn conn() -> (ClientConn, DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(1 << 20);
        (ClientConn::new(Box::new(ours)), theirs)
    }

    async fn send(peer: &mut DuplexStream, bytes: &[u8]) {
        peer.write_all(bytes).await.unwrap();
    }

    /// What the peer has received so far.
    async fn received(peer: &mut DuplexStream) -> String {
        let mut buf = vec![0; 1 << 16];
        let n = tokio::time::timeout(Duration::from_secs(1), peer.read(&mut buf)).await.unwrap().unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    const IDLE: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn a_request_with_a_length_body_is_read_and_answered_in_one_send() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: g\r\nX-Trace: A\r\nContent-Length: 5\r\n\r\nhello").await;
        assert!(c.read_request(IDLE).await.unwrap());
        assert_eq!((c.req().method(), c.req().target(), c.req().path()), ("POST", "/v1/completions?x=1", "/v1/completions"));
        assert_eq!(c.req().origin_target(), "/v1/completions?x=1");
        assert_eq!(c.req().header("x-trace"), Some(&b"A"[..]));
        assert_eq!(c.read_body().await.unwrap().as_deref(), Some(&b"hello"[..]));
        assert_eq!(c.read_body().await.unwrap(), None);
        let mut h = ResponseHead::new(200);
        h.header(b"Content-Type", b"application/json").unwrap().length(2);
        c.write_head(&h).await.unwrap();
        c.write_body(Bytes::from_static(b"{}"), true).await.unwrap();
        let got = received(&mut peer).await;
        assert!(got.starts_with("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: "), "{got}");
        assert!(got.ends_with("\r\nContent-Length: 2\r\n\r\n{}"), "{got}");
        assert!(c.reusable());
    }

    #[tokio::test]
    async fn a_queued_head_leaves_with_the_first_event_or_alone_when_flushed() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        c.queue_head(&ResponseHead::new(200)).unwrap();
        assert!(c.queue_head(&ResponseHead::new(200)).is_err(), "one head per response");
        c.write_body(Bytes::from_static(b"data: 1\n\n"), false).await.unwrap();
        let got = received(&mut peer).await;
        assert!(got.starts_with("HTTP/1.1 200 OK\r\n") && got.ends_with("Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n"), "one send: {got}");
        c.write_body(Bytes::from_static(b""), true).await.unwrap();
        assert_eq!(received(&mut peer).await, "0\r\n\r\n");
        // Nothing to write yet: flushing sends the head alone, and again sends nothing.
        send(&mut peer, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        c.queue_head(&ResponseHead::new(200)).unwrap();
        c.flush_queued().await.unwrap();
        assert!(received(&mut peer).await.ends_with("Transfer-Encoding: chunked\r\n\r\n"));
        c.flush_queued().await.unwrap();
        c.write_body(Bytes::from_static(b"data: [DONE]\n\n"), true).await.unwrap();
        assert_eq!(received(&mut peer).await, "e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
    }

    #[tokio::test]
    async fn a_chunked_body_in_and_a_chunked_stream_out() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        let mut body = Vec::new();
        while let Some(b) = c.read_body().await.unwrap() {
            body.extend_from_slice(&b);
        }
        assert_eq!(body, b"abcde");
        c.write_head(&ResponseHead::new(200)).await.unwrap();
        assert!(received(&mut peer).await.ends_with("Transfer-Encoding: chunked\r\n\r\n"), "the head goes out before the first token");
        c.write_body(Bytes::from_static(b"data: 1\n\n"), false).await.unwrap();
        c.write_body(Bytes::from_static(b"data: [DONE]\n\n"), true).await.unwrap();
        let got = received(&mut peer).await;
        assert_eq!(got, "9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
        assert!(c.reusable());
    }

    #[tokio::test]
    async fn pipelined_requests_are_served_in_turn() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"GET /health HTTP/1.1\r\n\r\nPOST /a HTTP/1.1\r\nContent-Length: 1\r\n\r\nxGET /b HTTP/1.1\r\n\r\n").await;
        for (path, body) in [("/health", None), ("/a", Some(&b"x"[..])), ("/b", None)] {
            assert!(c.read_request(IDLE).await.unwrap());
            assert_eq!(c.req().path(), path);
            assert_eq!(c.read_body().await.unwrap().as_deref(), body);
            let mut h = ResponseHead::new(204);
            c.write_head(h.length(0)).await.unwrap();
            assert!(c.reusable(), "{path}");
        }
        drop(peer);
        assert!(!c.read_request(IDLE).await.unwrap(), "a close between requests is no error");
    }

    #[tokio::test]
    async fn requests_framed_so_they_could_be_smuggled_are_refused() {
        for head in [
            &b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: -3\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"NOT HTTP AT ALL\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            let (mut c, mut peer) = conn();
            send(&mut peer, head).await;
            assert!(matches!(c.read_request(IDLE).await, Err(HeadError::Malformed(_))), "{}", String::from_utf8_lossy(head));
        }
    }

    #[tokio::test]
    async fn an_oversized_head_is_refused() {
        let (mut c, mut peer) = conn();
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        (0..=crate::h1::request_head::MAX_HEADERS).for_each(|i| head.extend_from_slice(format!("X-{i}: v\r\n").as_bytes()));
        head.extend_from_slice(b"\r\n");
        send(&mut peer, &head).await;
        assert!(matches!(c.read_request(IDLE).await, Err(HeadError::TooLarge)));
        let (mut c, mut peer) = conn();
        send(&mut peer, b"GET / HTTP/1.1\r\nX-Long: ").await;
        send(&mut peer, &vec![b'a'; MAX_HEAD]).await;
        assert!(matches!(c.read_request(IDLE).await, Err(HeadError::TooLarge)));
    }

    #[tokio::test]
    async fn http10_and_connection_close_end_the_connection() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"GET /health HTTP/1.0\r\n\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        c.write_head(&ResponseHead::new(200)).await.unwrap();
        c.write_body(Bytes::from_static(b"ok"), true).await.unwrap();
        let got = received(&mut peer).await;
        assert!(got.contains("Connection: close\r\n") && !got.contains("chunked") && got.ends_with("\r\n\r\nok"), "{got}");
        assert!(!c.reusable());
        let (mut c, mut peer) = conn();
        send(&mut peer, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        let mut h = ResponseHead::new(200);
        c.write_head(h.length(0)).await.unwrap();
        assert!(received(&mut peer).await.contains("Connection: close\r\n"));
        assert!(!c.reusable());
    }

    #[tokio::test]
    async fn an_answer_before_the_body_was_read_closes_the_connection_and_says_so() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"POST / HTTP/1.1\r\nContent-Length: 100000\r\n\r\npartial").await;
        assert!(c.read_request(IDLE).await.unwrap());
        let mut h = ResponseHead::new(413);
        c.write_head(h.length(2)).await.unwrap();
        c.write_body(Bytes::from_static(b"no"), true).await.unwrap();
        assert!(received(&mut peer).await.contains("Connection: close\r\n"));
        assert!(!c.reusable());
    }

    #[tokio::test]
    async fn expect_continue_is_owed_until_sent() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        assert!(c.expects_continue());
        c.write_continue().await.unwrap();
        assert_eq!(received(&mut peer).await, "HTTP/1.1 100 Continue\r\n\r\n");
        send(&mut peer, b"ok").await;
        assert_eq!(c.read_body().await.unwrap().as_deref(), Some(&b"ok"[..]));
    }

    #[tokio::test]
    async fn a_body_cut_short_or_overlong_leaves_the_connection_unusable() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc").await;
        assert!(c.read_request(IDLE).await.unwrap());
        assert_eq!(c.read_body().await.unwrap().as_deref(), Some(&b"abc"[..]));
        drop(peer);
        assert!(matches!(c.read_body().await, Err(BodyReadError::Closed)));
        let (mut c, mut peer) = conn();
        send(&mut peer, b"GET / HTTP/1.1\r\n\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        let mut h = ResponseHead::new(200);
        c.write_head(h.length(4)).await.unwrap();
        assert!(c.write_body(Bytes::from_static(b"toolong"), true).await.is_err());
        assert!(!c.reusable());
        let (mut c, mut peer) = conn();
        send(&mut peer, b"GET / HTTP/1.1\r\n\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        let mut h = ResponseHead::new(200);
        c.write_head(h.length(4)).await.unwrap();
        c.write_body(Bytes::from_static(b"ab"), true).await.unwrap();
        assert!(!c.reusable(), "a short body can only be told by closing");
    }

    #[tokio::test]
    async fn a_client_leaving_is_noticed_and_pipelined_bytes_are_kept() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"GET /a HTTP/1.1\r\n\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        send(&mut peer, b"GET /b HTTP/1.1\r\n\r\n").await;
        assert!(tokio::time::timeout(Duration::from_millis(50), c.closed()).await.is_err(), "a pipelined request is not a close");
        let mut h = ResponseHead::new(204);
        c.write_head(h.length(0)).await.unwrap();
        assert!(c.read_request(IDLE).await.unwrap());
        assert_eq!(c.req().path(), "/b");
        drop(peer);
        tokio::time::timeout(Duration::from_secs(1), c.closed()).await.expect("the close is seen");
    }

    #[tokio::test]
    async fn a_blank_line_after_a_body_does_not_hide_the_client_leaving() {
        let (mut c, mut peer) = conn();
        send(&mut peer, b"POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi\r\n").await;
        assert!(c.read_request(IDLE).await.unwrap());
        assert_eq!(c.read_body().await.unwrap().as_deref(), Some(&b"hi"[..]));
        assert_eq!(c.read_body().await.unwrap(), None);
        drop(peer);
        tokio::time::timeout(Duration::from_secs(1), c.closed()).await.expect("the close is seen past the CRLF");
    }
}
