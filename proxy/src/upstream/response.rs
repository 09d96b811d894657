//! A worker's HTTP/1.1 response, read straight off its connection: the head parsed once
//! (`httparse`, no header maps), the body handed on as its bytes arrive, framed by
//! `Content-Length`, chunked coding ([`crate::h1::chunked`]) or the connection's close
//! (RFC 9112 §6.3). Pingora's HTTP/1 client built two header maps per response and kept its
//! own read state around them; this is the part of a request's CPU that was its engine's, not
//! the gateway's.
//!
//! Every read is cancel-safe: the only await is one read into the buffer, and decoding happens
//! after it, so a read dropped by a `select!` or polled once and abandoned loses no byte.

use crate::h1::body::Framing;
use crate::h1::chunked::ChunkError;
use crate::h1::response_head::{MAX_RESPONSE_HEADERS, ReceivedHead, ReceivedHeadError, parse_received};
use crate::h1::spare::{READ_SIZE, ReadBuffer};
use bytes::Bytes;
use std::future::Future;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::TcpStream;

/// Largest response head accepted (status line and headers).
pub const MAX_HEAD: usize = 64 * 1024;
/// Why a worker's response could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ResponseError {
    /// Reading the connection failed.
    #[error("reading the response: {0}")]
    Io(#[from] std::io::Error),
    /// The worker closed the connection before the response was complete.
    #[error("the worker closed the connection {0}")]
    Closed(&'static str),
    /// The head is not valid HTTP/1.x.
    #[error("malformed response head: {0}")]
    Head(String),
    /// The head is over [`MAX_HEAD`] bytes or [`MAX_RESPONSE_HEADERS`] headers.
    #[error("response head over {MAX_HEAD} bytes or {MAX_RESPONSE_HEADERS} headers")]
    HeadTooLarge,
    /// The chunked body is malformed.
    #[error("chunked body: {0}")]
    Chunked(#[from] ChunkError),
}

impl From<ReceivedHeadError> for ResponseError {
    fn from(e: ReceivedHeadError) -> Self {
        match e {
            ReceivedHeadError::Malformed(why) => Self::Head(why),
            ReceivedHeadError::TooManyHeaders => Self::HeadTooLarge,
        }
    }
}

/// A response whose head has arrived, and its connection (a worker's socket; tests read from
/// in-memory pipes).
#[derive(Debug)]
pub struct WorkerResponse<S = TcpStream> {
    stream: S,
    // Before `buf`: fields drop in order, and the head shares the buffer's memory, which can
    // only go back to the spares once the head is gone.
    head: ReceivedHead,
    /// Bytes read and not yet handed on.
    buf: ReadBuffer,
    /// The last read of the socket left room in `buf`: the socket was empty after it.
    drained: bool,
}

impl<S: AsyncRead + Unpin> WorkerResponse<S> {
    /// Reads the head of the response to the request just sent on `stream` (`head_request`:
    /// it was a `HEAD`, so no body follows). Interim `1xx` answers are skipped.
    pub async fn read(mut stream: S, head_request: bool) -> Result<Self, ResponseError> {
        let mut buf = ReadBuffer::take();
        let mut drained = false;
        loop {
            if let Some(parsed) = parse_received(&mut buf, head_request)? {
                if (100..200).contains(&parsed.status) && parsed.status != 101 {
                    continue;
                }
                return Ok(Self { stream, buf, head: parsed, drained });
            }
            if buf.len() >= MAX_HEAD {
                return Err(ResponseError::HeadTooLarge);
            }
            let n;
            (n, drained) = read_more(&mut stream, &mut buf).await?;
            if n == 0 {
                return Err(ResponseError::Closed("before the response head"));
            }
        }
    }

    /// The status code.
    pub fn status(&self) -> u16 {
        self.head.status
    }

    /// The headers as they came: names (ASCII, any case) and values.
    pub fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        let raw = &self.head.raw;
        self.head.headers.iter().map(|&[ns, ne, vs, ve]| (&raw[ns as usize..ne as usize], &raw[vs as usize..ve as usize]))
    }

    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers().find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes())).map(|(_, v)| v)
    }

    /// Whether the body is framed by its `Content-Length` (not by chunked coding, nor the
    /// connection's close, nor absent because of the status).
    pub fn framed_by_length(&self) -> bool {
        self.head.by_length
    }

    /// Whether the whole body has been handed on.
    pub fn is_done(&self) -> bool {
        self.head.body.is_done()
    }

    /// The next run of body bytes if it needs no wait: bytes already read, the end, or a read
    /// of the socket, unless the last read found the socket empty (it left room in the
    /// buffer), when another now would almost surely find nothing and only cost a system call
    /// before the bytes in hand go out. `None`: nothing now.
    pub fn read_body_now(&mut self) -> Option<Result<Option<Bytes>, ResponseError>> {
        match self.head.body.take(&mut self.buf) {
            Ok(Some(data)) => return Some(Ok(Some(data))),
            Err(e) => return Some(Err(e.into())),
            Ok(None) if self.is_done() => return Some(Ok(None)),
            Ok(None) if self.drained => return None,
            Ok(None) => {}
        }
        // Polled once: a read that is not ready consumes nothing (the parse state lives in
        // `self`, not in the future), so dropping it loses no data.
        let read = std::pin::pin!(self.read_body());
        match read.poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
            std::task::Poll::Ready(r) => Some(r),
            std::task::Poll::Pending => None,
        }
    }

    /// The next run of body bytes, as soon as any have arrived; `None` once the body is
    /// complete.
    pub async fn read_body(&mut self) -> Result<Option<Bytes>, ResponseError> {
        loop {
            if let Some(data) = self.head.body.take(&mut self.buf)? {
                return Ok(Some(data));
            }
            if self.is_done() {
                return Ok(None);
            }
            let n;
            (n, self.drained) = read_more(&mut self.stream, &mut self.buf).await?;
            if n == 0 {
                return match self.head.body {
                    Framing::UntilClose => {
                        self.head.body = Framing::Done;
                        Ok(None)
                    }
                    _ => Err(ResponseError::Closed("before the end of the body")),
                };
            }
        }
    }

    /// The connection, when it can carry another request: the body was read whole, the worker
    /// did not ask to close, and it sent nothing past the response.
    pub fn into_reusable(self) -> Option<S> {
        (self.is_done() && self.head.keep_alive && self.buf.is_empty()).then_some(self.stream)
    }
}

/// One read into `buf` after making room: the bytes read, and whether the read left room, so
/// took everything the socket held at that moment (the socket is empty after it).
async fn read_more<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut ReadBuffer) -> std::io::Result<(usize, bool)> {
    buf.reserve(READ_SIZE);
    let room = buf.capacity() - buf.len();
    let n = stream.read_buf(&mut **buf).await?;
    Ok((n, n < room))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A response read from `wire`, written in pieces of `step` bytes by a peer that then
    /// keeps the connection open (`close`: closes it).
    async fn respond(wire: &'static [u8], step: usize, close: bool) -> Result<(u16, Vec<u8>, bool), ResponseError> {
        let (ours, mut theirs) = tokio::io::duplex(64);
        tokio::spawn(async move {
            for piece in wire.chunks(step) {
                if theirs.write_all(piece).await.is_err() {
                    return;
                }
            }
            if !close {
                std::future::pending::<()>().await;
            }
        });
        let mut r = WorkerResponse::read(ours, false).await?;
        let mut body = Vec::new();
        while let Some(b) = r.read_body().await? {
            body.extend_from_slice(&b);
        }
        let status = r.status();
        Ok((status, body, r.into_reusable().is_some()))
    }

    #[tokio::test]
    async fn a_length_framed_body_is_read_whole_and_the_connection_kept() {
        let wire = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}";
        for step in [1, 7, 4096] {
            assert_eq!(respond(wire, step, false).await.unwrap(), (200, b"{\"ok\":true}".to_vec(), true), "step {step}");
        }
    }

    #[tokio::test]
    async fn a_status_under_100_or_a_coding_in_http10_is_refused() {
        // The h1_response fuzz target's find: httparse reads `020` as 20, hyper refuses it.
        let wire = b"HTTP/1.1 020 OK\r\nContent-Length: 0\r\n\r\n";
        assert!(matches!(respond(wire, 4096, false).await, Err(ResponseError::Head(_))));
        // And a transfer coding in an HTTP/1.0 response: faulty framing (RFC 9112 §6.1).
        let wire = b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        assert!(matches!(respond(wire, 4096, false).await, Err(ResponseError::Head(_))));
    }

    #[tokio::test]
    async fn a_chunked_body_is_decoded_and_the_connection_kept() {
        let wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n2\r\nx\n\r\n0\r\n\r\n";
        for step in [1, 5, 4096] {
            assert_eq!(respond(wire, step, false).await.unwrap(), (200, b"data: x\n".to_vec(), true), "step {step}");
        }
    }

    #[tokio::test]
    async fn a_body_without_length_runs_to_the_close_and_the_connection_is_not_kept() {
        assert_eq!(respond(b"HTTP/1.1 200 OK\r\n\r\nall of it", 3, true).await.unwrap(), (200, b"all of it".to_vec(), false));
    }

    #[tokio::test]
    async fn the_worker_asking_to_close_is_respected() {
        let (_, _, kept) = respond(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", 64, false).await.unwrap();
        assert!(!kept);
        let (_, _, kept) = respond(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 64, false).await.unwrap();
        assert!(!kept, "HTTP/1.0 closes unless asked not to");
        let (_, _, kept) = respond(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", 64, false).await.unwrap();
        assert!(kept);
    }

    #[tokio::test]
    async fn interim_answers_are_skipped_and_bodiless_statuses_end_at_once() {
        assert_eq!(
            respond(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx", 64, false).await.unwrap(),
            (200, b"x".to_vec(), true)
        );
        assert_eq!(respond(b"HTTP/1.1 204 No Content\r\n\r\n", 64, false).await.unwrap(), (204, vec![], true));
    }

    #[tokio::test]
    async fn a_body_cut_short_is_an_error_not_a_short_answer() {
        assert!(matches!(respond(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", 64, true).await, Err(ResponseError::Closed(_))));
        assert!(matches!(respond(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", 64, true).await, Err(ResponseError::Closed(_))));
        assert!(matches!(respond(b"HTTP/1.1 200 O", 64, true).await, Err(ResponseError::Closed(_))));
    }

    #[tokio::test]
    async fn malformed_or_ambiguous_heads_are_refused_or_not_reused() {
        assert!(matches!(respond(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", 64, true).await, Err(ResponseError::Head(_))));
        assert!(matches!(respond(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 64, true).await, Err(ResponseError::Head(_))));
        assert!(matches!(respond(b"HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\n", 64, true).await, Err(ResponseError::Head(_))));
        assert!(matches!(respond(b"NOT HTTP\r\n\r\n", 64, true).await, Err(ResponseError::Head(_))));
        // Framed two ways: read as chunked, never reused.
        let both = b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nz\r\n0\r\n\r\n";
        assert_eq!(respond(both, 64, false).await.unwrap(), (200, b"z".to_vec(), false));
    }

    #[tokio::test]
    async fn headers_are_kept_as_they_came() {
        let (ours, mut theirs) = tokio::io::duplex(4096);
        theirs.write_all(b"HTTP/1.1 200 OK\r\nX-Request-Id: r1\r\ncontent-type: text/event-stream\r\nContent-Length: 0\r\n\r\n").await.unwrap();
        let r = WorkerResponse::read(ours, false).await.unwrap();
        let names: Vec<&[u8]> = r.headers().map(|(n, _)| n).collect();
        assert_eq!(names, [&b"X-Request-Id"[..], b"content-type", b"Content-Length"]);
        assert_eq!(r.header("x-request-id"), Some(&b"r1"[..]));
        assert!(r.is_done());
    }

    #[tokio::test]
    async fn a_head_with_many_headers_is_read_and_one_with_too_many_refused() {
        let head = |n: usize| {
            let mut h = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n".to_vec();
            (0..n).for_each(|i| h.extend_from_slice(format!("X-H{i}: v\r\n").as_bytes()));
            h.extend_from_slice(b"\r\n");
            h
        };
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        theirs.write_all(&head(100)).await.unwrap();
        let r = WorkerResponse::read(ours, false).await.unwrap();
        assert_eq!((r.headers().count(), r.header("x-h99")), (101, Some(&b"v"[..])));
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        theirs.write_all(&head(MAX_RESPONSE_HEADERS)).await.unwrap();
        assert!(matches!(WorkerResponse::read(ours, false).await, Err(ResponseError::HeadTooLarge)));
    }

    #[tokio::test]
    async fn a_head_that_never_ends_is_refused_once_over_its_cap() {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let _ = theirs.write_all(b"HTTP/1.1 200 OK\r\n").await;
            let line = b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
            while theirs.write_all(line).await.is_ok() {}
        });
        assert!(matches!(WorkerResponse::read(ours, false).await, Err(ResponseError::HeadTooLarge)));
    }

    /// Gathering what already arrived never waits, and skips the socket once a read found it
    /// empty: the bytes in hand go out first, the rest on the next read.
    #[tokio::test]
    async fn reading_now_takes_what_is_in_hand_and_spares_an_empty_socket() {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        theirs.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n2\r\ncd\r\n").await.unwrap();
        let mut r = WorkerResponse::read(ours, false).await.unwrap();
        assert!(r.drained, "a short read leaves the socket empty");
        assert_eq!(r.read_body_now().unwrap().unwrap().as_deref(), Some(&b"ab"[..]), "in hand");
        assert_eq!(r.read_body_now().unwrap().unwrap().as_deref(), Some(&b"cd"[..]), "in hand");
        theirs.write_all(b"2\r\nef\r\n").await.unwrap();
        assert!(r.read_body_now().is_none(), "the socket is not read again right after it was found empty");
        assert_eq!(r.read_body().await.unwrap().as_deref(), Some(&b"ef"[..]), "the next read takes it");
        // Not known empty: reading now reads the socket, and finds nothing without waiting.
        r.drained = false;
        assert!(r.read_body_now().is_none());
        theirs.write_all(b"0\r\n\r\n").await.unwrap();
        assert_eq!(r.read_body().await.unwrap(), None);
        assert!(matches!(r.read_body_now(), Some(Ok(None))), "the end is in hand");
    }
}
