//! Response heads, both ways. The head the gateway writes to its client ([`ResponseHead`]):
//! status line, header lines (checked so that none can split the head) and `Date`, written into
//! the connection's buffer in one pass; framing (`Content-Length`, `Transfer-Encoding`,
//! `Connection`) is the connection's to add, since it alone knows the client's version and what
//! the body will be. And the head a worker sends ([`parse_received`]): parsed once into offsets,
//! with what it says about the body's framing (RFC 9112 §6.3) and the connection's reuse.

// Parses bytes from outside: a narrowing cast here could truncate a peer's value.
#![deny(clippy::cast_possible_truncation)]

use super::body::Framing;
use super::chunked::Chunked;
use super::spare::{HeadLines, HeaderSpans};
use bytes::{Bytes, BytesMut};

/// Most headers a worker's response head may carry.
pub const MAX_RESPONSE_HEADERS: usize = 256;
/// Header slots parsed into on the stack first: a worker's answer carries a handful, and every
/// slot is initialised per parse.
const FEW_HEADERS: usize = 16;

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
        let splits = |b: &[u8]| b.iter().copied().any(super::splits_head);
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

    /// Appends the status line and the header lines, with `Date` unless one was added; the
    /// framing headers and the blank line are the connection's to write.
    pub fn put_start(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(b"HTTP/1.1 ");
        super::put_decimal(w, u64::from(self.status));
        w.push(b' ');
        w.extend_from_slice(reason(self.status).as_bytes());
        w.extend_from_slice(b"\r\n");
        w.extend_from_slice(&self.lines);
        if !self.dated {
            w.extend_from_slice(b"Date: ");
            w.extend_from_slice(pingora::protocols::http::date::get_cached_date().as_bytes());
            w.extend_from_slice(b"\r\n");
        }
    }
}

/// The reason phrase for `status`.
fn reason(status: u16) -> &'static str {
    pingora::http::StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("Unknown")
}

/// A response head a worker sent, parsed, and what it says about the body and the connection.
#[derive(Debug)]
pub struct ReceivedHead {
    /// The head as it came (status line and headers).
    pub raw: Bytes,
    /// Each header's name and value as offsets into `raw`.
    pub headers: HeaderSpans,
    /// The status code.
    pub status: u16,
    /// The rest of the body: the reader advances it as the body arrives.
    pub body: Framing,
    /// The body is framed by `Content-Length`.
    pub by_length: bool,
    /// Whether the connection may carry another request once the body is read.
    pub keep_alive: bool,
}

/// Why a response head was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReceivedHeadError {
    /// Not valid HTTP/1.x, or framed in a way that cannot be trusted.
    #[error("malformed response head: {0}")]
    Malformed(String),
    /// More than [`MAX_RESPONSE_HEADERS`] headers.
    #[error("response head over {MAX_RESPONSE_HEADERS} headers")]
    TooManyHeaders,
}

/// Parses the response head at the front of `buf` (`head_request`: the request was a `HEAD`,
/// so no body follows) and takes it off; `None` while it is incomplete.
pub fn parse_received(buf: &mut BytesMut, head_request: bool) -> Result<Option<ReceivedHead>, ReceivedHeadError> {
    let mut few = [httparse::EMPTY_HEADER; FEW_HEADERS];
    let parsed = match parse_into(buf, &mut few, head_request) {
        Err(ReceivedHeadError::TooManyHeaders) => parse_into(buf, &mut vec![httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS], head_request),
        parsed => parsed,
    };
    Ok(parsed?.map(|(len, p)| ReceivedHead { raw: buf.split_to(len).freeze(), ..p }))
}

/// [`parse_received`] with `slots` for the headers, leaving the head in `buf` (`raw` is empty):
/// its length and what it says. [`ReceivedHeadError::TooManyHeaders`] when the slots are too few.
fn parse_into<'b>(buf: &'b [u8], slots: &mut [httparse::Header<'b>], head_request: bool) -> Result<Option<(usize, ReceivedHead)>, ReceivedHeadError> {
    let mut r = httparse::Response::new(slots);
    let len = match r.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(ReceivedHeadError::TooManyHeaders),
        Err(e) => return Err(ReceivedHeadError::Malformed(e.to_string())),
    };
    let status = r.code.unwrap_or(0);
    // Three digits, 100 to 999 (RFC 9110 §15): `020` is not a status, as hyper also says
    // (the `h1_response` fuzz target's find, docs/fuzzing.md).
    if status < 100 {
        return Err(ReceivedHeadError::Malformed(format!("status code {status:03} out of range")));
    }
    let mut headers = HeaderSpans::take();
    headers.extend(super::header_spans(buf, r.headers));
    let http10 = r.version == Some(0);
    let (framing, by_length, close) = framing(r.headers, status, head_request, http10)?;
    let keep_alive = !close && if http10 { connection_has(r.headers, b"keep-alive") } else { !connection_has(r.headers, b"close") };
    let keep_alive = keep_alive && !matches!(framing, Framing::UntilClose) && status != 101;
    Ok(Some((len, ReceivedHead { raw: Bytes::new(), headers, status, body: framing, by_length, keep_alive })))
}

/// How the body is framed (RFC 9112 §6.3), whether by its `Content-Length`, and whether the
/// connection must close after it (a message framed two ways is read by its transfer coding,
/// and never trusted for reuse). HTTP/1.0 has no transfer codings: an HTTP/1.0 response that
/// names one has faulty framing (RFC 9112 §6.1) and is refused, as hyper does (the
/// `h1_response` fuzz target's find, docs/fuzzing.md).
fn framing(headers: &[httparse::Header<'_>], status: u16, head_request: bool, http10: bool) -> Result<(Framing, bool, bool), ReceivedHeadError> {
    if head_request || (100..200).contains(&status) || status == 204 || status == 304 {
        return Ok((Framing::Done, false, false));
    }
    let mut length: Option<u64> = None;
    let mut coding: Option<&[u8]> = None;
    for h in headers {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            coding = Some(h.value);
        } else if h.name.eq_ignore_ascii_case("content-length") {
            let n = super::content_length(h.value);
            match (n, length) {
                (None, _) => return Err(ReceivedHeadError::Malformed("invalid Content-Length".into())),
                (Some(n), Some(before)) if n != before => return Err(ReceivedHeadError::Malformed("conflicting Content-Length headers".into())),
                (Some(n), _) => length = Some(n),
            }
        }
    }
    if http10 && coding.is_some() {
        return Err(ReceivedHeadError::Malformed("Transfer-Encoding in an HTTP/1.0 response".into()));
    }
    Ok(match (coding, length) {
        (Some(c), _) => {
            let chunked = c.rsplit(|&b| b == b',').next().is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            (if chunked { Framing::Chunked(Chunked::default()) } else { Framing::UntilClose }, false, length.is_some())
        }
        (None, Some(0)) => (Framing::Done, true, false),
        (None, Some(n)) => (Framing::Length(n), true, false),
        (None, None) => (Framing::UntilClose, false, false),
    })
}

/// Whether a `Connection` header lists `token`.
fn connection_has(headers: &[httparse::Header<'_>], token: &[u8]) -> bool {
    super::connection_has(headers.iter().map(|h| (h.name.as_bytes(), h.value)), token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lines_that_would_split_the_head_are_refused() {
        let mut h = ResponseHead::new(200);
        assert!(h.header(b"X-A", b"ok").is_ok());
        assert!(h.header(b"X-B", b"a\r\nX-Evil: 1").is_err());
        assert!(h.header(b"X C", b"v").is_err());
        assert!(h.header(b"", b"v").is_err());
    }
}
