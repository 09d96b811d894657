//! A response head the gateway writes to its client: status line, header lines (checked so
//! that none can split the head) and `Date`, written into the connection's buffer in one pass.
//! Framing (`Content-Length`, `Transfer-Encoding`, `Connection`) is the connection's to add,
//! since it alone knows the client's version and what the body will be.

use super::spare::HeadLines;

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
