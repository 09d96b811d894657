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
use crate::h1::spare::{HeadLines, ReadBuffer, WriteBuffer, take_write_buffer};
use crate::idle_timer::IdleTimer;
use bytes::{Buf, Bytes};
use pingora::protocols::Stream;
use std::mem::MaybeUninit;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest request head accepted (request line and headers).
pub const MAX_HEAD: usize = 64 * 1024;
/// Most headers a request may carry.
pub const MAX_HEADERS: usize = 128;
/// How long [`ClientConn::linger`] keeps reading after the answer went out.
pub const LINGER: Duration = Duration::from_secs(2);
/// Bodies larger than this are written from their own buffer instead of copied behind the
/// chunk framing.
const COPY_LIMIT: usize = 16 * 1024;

/// Why no request could be read.
#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    /// The connection failed or closed mid-head: nobody to answer.
    #[error("the client connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// Not valid HTTP/1.x, or framed in a way that cannot be trusted: answer 400 and close.
    #[error("malformed HTTP request: {0}")]
    Malformed(&'static str),
    /// Over [`MAX_HEAD`] bytes or [`MAX_HEADERS`] headers: answer 431 and close.
    #[error("request head over {MAX_HEAD} bytes or {MAX_HEADERS} headers")]
    TooLarge,
}

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

/// A request's head: method, target, version and headers, as bytes with offsets.
#[derive(Debug, Default)]
pub struct RequestHead {
    raw: Bytes,
    method: [u32; 2],
    target: [u32; 2],
    /// The target's path (see [`Self::path`]).
    path: [u32; 2],
    /// HTTP/1.`minor`.
    minor: u8,
    headers: Vec<[u32; 4]>,
}

impl RequestHead {
    fn part(&self, [s, e]: [u32; 2]) -> &str {
        // Method and target are tokens and URI characters: ASCII, checked by httparse.
        std::str::from_utf8(&self.raw[s as usize..e as usize]).unwrap_or_default()
    }

    /// Parses a whole request head (request line, headers and the blank line).
    pub fn parse(raw: Bytes) -> Result<Self, HeadError> {
        match parse_request(&raw, &mut Vec::new())? {
            Some((head, len)) if len == raw.len() => Ok(Self { raw, ..head }),
            _ => Err(HeadError::Malformed("not one whole request head")),
        }
    }

    /// The method, as sent.
    pub fn method(&self) -> &str {
        self.part(self.method)
    }

    /// Whether the method is `m` (compared as bytes: cheaper than [`Self::method`]'s text,
    /// for the checks every request makes).
    pub fn method_is(&self, m: &str) -> bool {
        let [s, e] = self.method;
        &self.raw[s as usize..e as usize] == m.as_bytes()
    }

    /// The request target, as sent.
    pub fn target(&self) -> &str {
        self.part(self.target)
    }

    /// The target's path: without the query, and without scheme and authority when the target
    /// is in absolute form.
    pub fn path(&self) -> &str {
        if self.path == [0, 0] { "/" } else { self.part(self.path) }
    }

    /// The target in origin form, as a worker is sent it: the path and query, without scheme
    /// and authority (absolute form). A target never holds a fragment: it is refused.
    pub fn origin_target(&self) -> &str {
        if self.path == [0, 0] {
            return "/";
        }
        let [_, end] = self.target;
        let t = &self.raw[self.path[0] as usize..end as usize];
        // The head was checked to be text when it was parsed.
        std::str::from_utf8(t).unwrap_or("/")
    }

    /// Whether the request is HTTP/1.0.
    pub fn is_http10(&self) -> bool {
        self.minor == 0
    }

    /// The headers as they came: names (any case) and values.
    pub fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.headers.iter().map(|&[ns, ne, vs, ve]| (&self.raw[ns as usize..ne as usize], &self.raw[vs as usize..ve as usize]))
    }

    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers().find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes())).map(|(_, v)| v)
    }

    /// The first value of header `name` as text, when it is visible ASCII.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Whether the `Connection` headers list `token`.
    fn connection_has(&self, token: &[u8]) -> bool {
        crate::h1::connection_has(self.headers(), token)
    }
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

/// A response head to write: status, headers, and the body's length when known (chunked
/// coding otherwise). Framing headers (`Content-Length`, `Transfer-Encoding`, `Connection`) are
/// the connection's to write.
#[derive(Debug)]
pub struct ResponseHead {
    status: u16,
    lines: HeadLines,
    length: Option<u64>,
    dated: bool,
}

/// A header value or name that would split the head (CR, LF or NUL), or a name that is empty.
#[derive(Debug, thiserror::Error)]
#[error("header {0:?} holds a byte HTTP/1.1 forbids there")]
pub struct BadHeader(pub String);

impl ResponseHead {
    /// A head with `status`.
    pub fn new(status: u16) -> Self {
        Self { status, lines: HeadLines::take(), length: None, dated: false }
    }

    /// Adds a header line.
    pub fn header(&mut self, name: &[u8], value: &[u8]) -> Result<&mut Self, BadHeader> {
        // Plain loops: these are short (an id, a worker's label), where memchr's set-up costs
        // more than the scan.
        let splits = |b: &[u8]| b.iter().any(|&c| matches!(c, 0 | b'\r' | b'\n'));
        if name.is_empty() || splits(name) || name.iter().any(|&c| c == b':' || c == b' ') || splits(value) {
            return Err(BadHeader(String::from_utf8_lossy(name).into_owned()));
        }
        Ok(self.line(name, value))
    }

    /// Adds a header line checked already, without checking it again: one a peer sent and
    /// `httparse` accepted (a token name; a value without CR, LF, NUL or other control bytes),
    /// or one made of parts validated when they were configured.
    pub fn parsed_header(&mut self, name: &[u8], value: &[u8]) -> &mut Self {
        self.line(name, value)
    }

    fn line(&mut self, name: &[u8], value: &[u8]) -> &mut Self {
        self.dated |= name.eq_ignore_ascii_case(b"date");
        self.lines.extend_from_slice(name);
        self.lines.extend_from_slice(b": ");
        self.lines.extend_from_slice(value);
        self.lines.extend_from_slice(b"\r\n");
        self
    }

    /// The body's length: sent with `Content-Length` instead of chunked.
    pub fn length(&mut self, n: u64) -> &mut Self {
        self.length = Some(n);
        self
    }

    /// The status.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// The body's length, when it was given.
    pub fn body_length(&self) -> Option<u64> {
        self.length
    }

    /// The header lines added so far, as they will go out.
    pub fn lines(&self) -> &[u8] {
        &self.lines
    }
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
        let spare = std::mem::take(&mut self.head).headers;
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
                    self.start(RequestHead { raw, ..head })?;
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
        let bodiless = self.head_only || head.status == 204 || head.status == 304 || (100..200).contains(&head.status);
        self.out = match head.length {
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
        w.extend_from_slice(b"HTTP/1.1 ");
        crate::h1::put_decimal(w, u64::from(head.status));
        w.push(b' ');
        w.extend_from_slice(reason(head.status).as_bytes());
        w.extend_from_slice(b"\r\n");
        w.extend_from_slice(&head.lines);
        if !head.dated {
            w.extend_from_slice(b"Date: ");
            w.extend_from_slice(pingora::protocols::http::date::get_cached_date().as_bytes());
            w.extend_from_slice(b"\r\n");
        }
        match (head.length, self.out) {
            // No length on a 1xx or 204 (RFC 9110 §8.6); a HEAD answer may state the GET's.
            (Some(n), _) if !(head.status == 204 || (100..200).contains(&head.status)) && (!self.head_only || n > 0) => {
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

/// Parses a request head at the front of `buf`: the head with offsets (its `raw` left empty)
/// and its length, or `None` while it is incomplete. `spare` holds the header offsets: a
/// connection's last head's list, reused (it is taken into the head, and left as it was while
/// the head is incomplete).
fn parse_request(buf: &[u8], spare: &mut Vec<[u32; 4]>) -> Result<Option<(RequestHead, usize)>, HeadError> {
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut r = httparse::Request::new(&mut []);
    let len = match r.parse_with_uninit_headers(buf, &mut slots) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(_) => return Err(HeadError::Malformed("not a valid HTTP/1.x request head")),
    };
    let span = |s: &[u8]| crate::h1::span(buf, s);
    let (Some(method), Some(target), Some(minor)) = (r.method, r.path, r.version) else {
        return Err(HeadError::Malformed("an incomplete request line"));
    };
    if !target_form_ok(method, target) {
        return Err(HeadError::Malformed("a request target that is neither a path nor an http(s) URL"));
    }
    spare.clear();
    spare.extend(crate::h1::header_spans(buf, r.headers));
    let headers = std::mem::take(spare);
    // [0, 0] stands for the root: an absolute target with no path has none to point at.
    let path = match path_of(target) {
        "" => [0, 0],
        p => span(p.as_bytes()),
    };
    Ok(Some((RequestHead { raw: Bytes::new(), method: span(method.as_bytes()), target: span(target.as_bytes()), path, minor, headers }, len)))
}

/// Whether `target` has one of the forms a request may use here (RFC 9112 §3.2): a path
/// (origin form), an `http`/`https` URL (absolute form), `*` for `OPTIONS`, or CONNECT's. Anything else
/// (`%/v1/…`, a bare word) is refused rather than passed on to a worker that would read it
/// otherwise; found by the `h1_request` fuzz target against hyper (docs/fuzzing.md).
///
/// A fragment (`#…`) is never part of a request target. hyper drops it, a worker's server
/// may keep it in the path: the gateway would route on one path and the worker serve another,
/// so a target holding `#` is refused.
fn target_form_ok(method: &str, target: &str) -> bool {
    let absolute = |scheme: &str| target.len() > scheme.len() && target.as_bytes()[..scheme.len()].eq_ignore_ascii_case(scheme.as_bytes());
    if target.as_bytes().contains(&b'#') {
        return false;
    }
    // CONNECT's authority form is let through to be refused with its own answer (405).
    target.starts_with('/') || absolute("http://") || absolute("https://") || (target == "*" && method == "OPTIONS") || method == "CONNECT"
}

/// The path in a request target: without the query, and without scheme and authority in
/// absolute form (`http://host/p` is `/p`; `http://host` is empty: the root).
fn path_of(t: &str) -> &str {
    // Origin form (`/p`), the usual one, skips the search for a scheme: a substring search
    // costs more than the rest of this.
    let scheme = if t.starts_with('/') { None } else { t.find("://") };
    let t = match scheme {
        Some(i) => t[i + 3..].find('/').map_or("", |j| &t[i + 3 + j..]),
        None => t,
    };
    // No `#` to cut at: a target holding one was refused (`target_form_ok`).
    t.split('?').next().unwrap_or(t)
}

/// The reason phrase for `status`.
fn reason(status: u16) -> &'static str {
    pingora::http::StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("Unknown")
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_target_that_is_neither_a_path_nor_a_url_is_refused() {
        // The h1_request fuzz target's find: hyper refuses `%/v1/…`, kvgate passed it on.
        let mut spare = Vec::new();
        for bad in ["%/v1/chat/completions", "v1/models", "*", "ftp://x/y", "http:/x", "/v1/models#x", "/v1!#/completions"] {
            let head = format!("GET {bad} HTTP/1.1\r\nHost: x\r\n\r\n");
            assert!(matches!(parse_request(head.as_bytes(), &mut spare), Err(HeadError::Malformed(_))), "{bad}");
        }
        for good in ["/v1/models", "http://gw/v1/models", "HTTPS://gw", "/"] {
            let head = format!("GET {good} HTTP/1.1\r\nHost: x\r\n\r\n");
            assert!(matches!(parse_request(head.as_bytes(), &mut spare), Ok(Some(_))), "{good}");
        }
        assert!(matches!(parse_request(b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", &mut spare), Ok(Some(_))));
    }
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
        (0..=MAX_HEADERS).for_each(|i| head.extend_from_slice(format!("X-{i}: v\r\n").as_bytes()));
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

    #[allow(clippy::cast_possible_truncation, reason = "random test data: bytes and indices are the low bits of a hash sequence")]
    #[test]
    fn random_heads_never_panic() {
        let mut next = kvgate_kv::hash::sequence(3);
        let pieces: [&[u8]; 10] =
            [b"GET ", b"POST ", b"/v1/x", b"http://h", b" HTTP/1.1", b"\r\n", b"Content-Length: 5", b"Transfer-Encoding: chunked", b": ", b"\xff"];
        for _ in 0..5000 {
            let mut raw = Vec::new();
            (0..next() % 12).for_each(|_| raw.extend_from_slice(pieces[(next() % pieces.len() as u64) as usize]));
            if next().is_multiple_of(2) {
                raw.extend_from_slice(b"\r\n\r\n");
            }
            if let Ok(h) = RequestHead::parse(Bytes::from(raw)) {
                let _ = (h.method(), h.target(), h.path(), h.headers().count(), h.header("content-length"));
            }
        }
    }

    #[test]
    fn paths_come_out_of_every_target_form() {
        let parsed = |t: &str| {
            let raw = format!("GET {t} HTTP/1.1\r\n\r\n");
            let (h, _) = parse_request(raw.as_bytes(), &mut Vec::new()).unwrap().unwrap();
            RequestHead { raw: Bytes::from(raw), ..h }
        };
        let head = |t: &str| parsed(t).path().to_string();
        assert_eq!(head("/v1/models"), "/v1/models");
        assert_eq!(head("/v1/models?a=b"), "/v1/models");
        assert_eq!(head("http://gw:8080/v1/completions?x"), "/v1/completions");
        assert_eq!(head("http://gw:8080"), "/");
        let (options, _) = parse_request(b"OPTIONS * HTTP/1.1\r\n\r\n", &mut Vec::new()).unwrap().unwrap();
        let options = RequestHead { raw: Bytes::from_static(b"OPTIONS * HTTP/1.1\r\n\r\n"), ..options };
        assert_eq!(options.path(), "*");
        let origin = |t: &str| parsed(t).origin_target().to_string();
        assert_eq!(origin("/v1/models?a=b"), "/v1/models?a=b");
        assert_eq!(origin("http://gw:8080/v1/completions?x"), "/v1/completions?x");
        assert_eq!(origin("http://gw:8080"), "/");
    }

    #[test]
    fn header_lines_that_would_split_the_head_are_refused() {
        let mut h = ResponseHead::new(200);
        assert!(h.header(b"X-A", b"ok").is_ok());
        assert!(h.header(b"X-B", b"a\r\nX-Evil: 1").is_err());
        assert!(h.header(b"X C", b"v").is_err());
        assert!(h.header(b"", b"v").is_err());
    }
}
