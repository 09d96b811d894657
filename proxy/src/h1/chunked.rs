//! Decoding a worker's `Transfer-Encoding: chunked` body (RFC 9112 §7.1) as its bytes arrive:
//! framing is consumed, data is handed on the moment any of it is buffered, so a token event
//! never waits for the rest of its chunk. Strict where leniency would let two parsers disagree
//! about where a body ends: a size line is hex digits, optional extensions and CRLF; data ends
//! in CRLF. Bounded: size lines, extensions and trailers have length caps.

use bytes::{Buf, Bytes, BytesMut};

/// Longest size line (digits and extensions) accepted.
const MAX_SIZE_LINE: usize = 4096;
/// Most trailer bytes accepted after the last chunk.
const MAX_TRAILERS: usize = 16 * 1024;

/// Why a chunked body could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// A size line that is not hex digits (with optional extensions) and CRLF.
    #[error("malformed chunk size line")]
    SizeLine,
    /// A chunk size over 2^60 bytes.
    #[error("chunk size out of range")]
    TooLarge,
    /// A size line or the trailers over their caps.
    #[error("chunk framing over its length cap")]
    Overlong,
    /// Chunk data not followed by CRLF.
    #[error("chunk data not followed by CRLF")]
    DataEnd,
    /// A trailer line that is not `name: value` and CRLF.
    #[error("malformed trailer line")]
    Trailer,
}

/// Where the decoder is in the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// In a size line: the size so far, its digit count, what part of the line it is in, and
    /// the line's length so far.
    Size { size: u64, digits: u8, part: Part, len: usize },
    /// The size line's CR was read; its LF comes next.
    SizeLf { size: u64 },
    /// This many data bytes of the current chunk are still to come.
    Data(u64),
    /// The CRLF after a chunk's data: `true` once its CR was read.
    DataEnd(bool),
    /// After the last chunk: trailer lines until an empty one. `line` is the current line's
    /// length, `cr` whether its CR was read, `name` whether it is still in the field name,
    /// `total` the trailer bytes so far.
    Trailers { line: usize, cr: bool, name: bool, total: usize },
    /// The body ended.
    Done,
}

/// The parts of a size line after its digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// Hex digits.
    Digits,
    /// Whitespace after them (only whitespace or `;` may follow).
    Space,
    /// Extensions, from the first `;` to the CR: skipped, never read.
    Extensions,
}

/// A chunked body's decoder.
#[derive(Debug, Clone)]
pub struct Chunked {
    state: State,
}

impl Default for Chunked {
    fn default() -> Self {
        Self { state: State::Size { size: 0, digits: 0, part: Part::Digits, len: 0 } }
    }
}

impl Chunked {
    /// Whether the whole body (last chunk and trailers) was decoded.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Consumes framing from the front of `buf` and returns the next run of data it holds;
    /// `None` when `buf` holds no more data (more must be read, or the body is done). Bytes
    /// after the body's end stay in `buf`.
    pub fn next(&mut self, buf: &mut BytesMut) -> Result<Option<Bytes>, ChunkError> {
        loop {
            if let State::Data(left) = self.state {
                if buf.is_empty() {
                    return Ok(None);
                }
                let n = super::take_len(buf.len(), left);
                self.state = if n as u64 == left { State::DataEnd(false) } else { State::Data(left - n as u64) };
                return Ok(Some(buf.split_to(n).freeze()));
            }
            if self.state == State::Done || buf.is_empty() {
                return Ok(None);
            }
            let b = buf[0];
            buf.advance(1);
            self.state = self.step(b)?;
        }
    }

    /// The state after framing byte `b`.
    fn step(&self, b: u8) -> Result<State, ChunkError> {
        Ok(match self.state {
            State::Size { len, .. } if len >= MAX_SIZE_LINE => return Err(ChunkError::Overlong),
            State::Size { size, digits, part: Part::Digits, len } if b.is_ascii_hexdigit() => {
                if digits >= 15 {
                    return Err(ChunkError::TooLarge);
                }
                let d = u64::from((b as char).to_digit(16).expect("a hex digit"));
                State::Size { size: size << 4 | d, digits: digits + 1, part: Part::Digits, len: len + 1 }
            }
            State::Size { digits: 0, .. } => return Err(ChunkError::SizeLine),
            State::Size { size, .. } if b == b'\r' => State::SizeLf { size },
            State::Size { size, digits, part: Part::Digits | Part::Space, len } if b == b' ' || b == b'\t' => {
                State::Size { size, digits, part: Part::Space, len: len + 1 }
            }
            State::Size { size, digits, part, len } if b == b';' || (part == Part::Extensions && b != b'\n') => {
                State::Size { size, digits, part: Part::Extensions, len: len + 1 }
            }
            State::SizeLf { size: 0 } if b == b'\n' => State::Trailers { line: 0, cr: false, name: true, total: 0 },
            State::SizeLf { size } if b == b'\n' => State::Data(size),
            State::Size { .. } | State::SizeLf { .. } => return Err(ChunkError::SizeLine),
            State::DataEnd(false) if b == b'\r' => State::DataEnd(true),
            State::DataEnd(true) if b == b'\n' => State::Size { size: 0, digits: 0, part: Part::Digits, len: 0 },
            State::DataEnd(_) => return Err(ChunkError::DataEnd),
            State::Trailers { total, .. } if total >= MAX_TRAILERS => return Err(ChunkError::Overlong),
            State::Trailers { line, total, name, cr } => Self::trailer(line, cr, name, total, b)?, // `next` hands data on itself and stops at the end.
            State::Data(_) | State::Done => self.state,
        })
    }
}

impl Chunked {
    /// The state after trailer byte `b`. Trailer lines are field lines as a head's are, each
    /// ending in CRLF: a bare CR or LF, a line without a name and colon, or a control byte is
    /// refused rather than guessed at, since a parser that ends the trailers elsewhere would
    /// take what follows for another message (found by the `h1_response` fuzz target against
    /// hyper, docs/fuzzing.md).
    fn trailer(line: usize, cr: bool, name: bool, total: usize, b: u8) -> Result<State, ChunkError> {
        let total = total + 1;
        Ok(match b {
            b'\n' if cr && line == 0 => State::Done,
            b'\n' if cr && !name => State::Trailers { line: 0, cr: false, name: true, total },
            _ if cr => return Err(ChunkError::Trailer),
            b'\r' if line == 0 || !name => State::Trailers { line, cr: true, name, total },
            b':' if name && line > 0 => State::Trailers { line: line + 1, cr: false, name: false, total },
            _ if name && is_tchar(b) => State::Trailers { line: line + 1, cr: false, name, total },
            b'\t' | b' '..=b'~' | 0x80..=0xff if !name => State::Trailers { line: line + 1, cr: false, name, total },
            _ => return Err(ChunkError::Trailer),
        })
    }
}

/// A field-name character (RFC 9110 §5.6.2 `tchar`).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `wire` fed in pieces of `step` bytes: the data, and what was left after the end.
    fn decode(wire: &[u8], step: usize) -> Result<(Vec<u8>, bool, Vec<u8>), ChunkError> {
        let (mut c, mut buf, mut out) = (Chunked::default(), BytesMut::new(), Vec::new());
        for piece in wire.chunks(step.max(1)) {
            buf.extend_from_slice(piece);
            while let Some(data) = c.next(&mut buf)? {
                out.extend_from_slice(&data);
            }
        }
        Ok((out, c.is_done(), buf.to_vec()))
    }

    #[test]
    fn a_body_decodes_the_same_however_it_is_split() {
        let wire = b"5\r\nhello\r\n7;name=\"v\"\r\n, world\r\n0\r\n\r\nNEXT";
        for step in 1..wire.len() {
            let (data, done, rest) = decode(wire, step).unwrap();
            assert_eq!((data.as_slice(), done, rest.as_slice()), (&b"hello, world"[..], true, &b"NEXT"[..]), "step {step}");
        }
    }

    #[test]
    fn trailers_are_field_lines_ending_in_crlf() {
        let good = b"1\r\na\r\n0\r\nx-checksum: abc\r\nx-b:\r\n\r\nNEXT";
        assert_eq!(decode(good, 1).unwrap(), (b"a".to_vec(), true, b"NEXT".to_vec()));
        // The fuzz target's find: a bare CR in a trailer and bare-LF line ends, which hyper refuses.
        let found = b"0\r\ndath: \r=y;x\r3\n\nabc\r\n0\r\n\r\n";
        assert_eq!(decode(found, 1), Err(ChunkError::Trailer));
        for bad in [&b"0\r\nx: 1\n\r\n"[..], b"0\r\n: 1\r\n\r\n", b"0\r\nno colon\r\n\r\n", b"0\r\n x: 1\r\n\r\n", b"0\r\nx: \x01\r\n\r\n", b"0\r\n\n"] {
            assert_eq!(decode(bad, 1), Err(ChunkError::Trailer), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn data_is_handed_on_before_its_chunk_is_complete() {
        let (mut c, mut buf) = (Chunked::default(), BytesMut::from(&b"a\r\ndata: "[..]));
        assert_eq!(c.next(&mut buf).unwrap().as_deref(), Some(&b"data: "[..]));
        assert_eq!(c.next(&mut buf).unwrap(), None);
        assert!(!c.is_done());
    }

    #[test]
    fn trailers_are_read_and_dropped() {
        let (data, done, rest) = decode(b"3\r\nabc\r\n0\r\nX-Checksum: 1\r\nX-Other: 2\r\n\r\n", 64).unwrap();
        assert_eq!((data.as_slice(), done, rest.as_slice()), (&b"abc"[..], true, &b""[..]));
    }

    #[test]
    fn an_unfinished_body_is_not_done() {
        let (data, done, _) = decode(b"3\r\nabc\r\n", 64).unwrap();
        assert_eq!((data.as_slice(), done), (&b"abc"[..], false));
        assert!(!decode(b"0\r\n", 64).unwrap().1);
    }

    #[test]
    fn malformed_framing_is_refused() {
        let err = |wire: &[u8]| decode(wire, 64).unwrap_err();
        assert_eq!(err(b"\r\n"), ChunkError::SizeLine);
        assert_eq!(err(b"x\r\n"), ChunkError::SizeLine);
        assert_eq!(err(b"-1\r\n"), ChunkError::SizeLine);
        assert_eq!(err(b"3\nabc"), ChunkError::SizeLine);
        assert_eq!(err(b"3 4\r\n"), ChunkError::SizeLine);
        assert_eq!(err(b"3\r\nabcd\r\n"), ChunkError::DataEnd);
        assert_eq!(err(b"3\r\nabc\n"), ChunkError::DataEnd);
        assert_eq!(err(b"ffffffffffffffff\r\n"), ChunkError::TooLarge);
        assert_eq!(err(&[b'1', b';'].iter().copied().chain(std::iter::repeat_n(b'x', MAX_SIZE_LINE)).collect::<Vec<u8>>()), ChunkError::Overlong);
        let mut trailers = b"0\r\n".to_vec();
        trailers.extend(std::iter::repeat_n(b'x', MAX_TRAILERS + 1));
        assert_eq!(err(&trailers), ChunkError::Overlong);
    }

    #[allow(clippy::cast_possible_truncation, reason = "random test data: bytes and indices are the low bits of a hash sequence")]
    #[test]
    fn any_body_encoded_in_any_chunks_decodes_to_itself_however_it_arrives() {
        let mut next = kvgate_kv::hash::sequence(7);
        for _ in 0..500 {
            let body: Vec<u8> = (0..next() % 3000).map(|_| next() as u8).collect();
            let mut wire = Vec::new();
            let mut rest = &body[..];
            while !rest.is_empty() {
                let n = ((next() % 700) as usize + 1).min(rest.len());
                let ext = if next().is_multiple_of(4) { ";k=v" } else { "" };
                wire.extend_from_slice(format!("{n:x}{ext}\r\n").as_bytes());
                wire.extend_from_slice(&rest[..n]);
                wire.extend_from_slice(b"\r\n");
                rest = &rest[n..];
            }
            wire.extend_from_slice(b"0\r\n\r\n");
            let step = (next() % 97) as usize + 1;
            let (data, done, left) = decode(&wire, step).unwrap();
            assert!(data == body && done && left.is_empty(), "step {step}");
        }
    }

    #[allow(clippy::cast_possible_truncation, reason = "random test data: bytes and indices are the low bits of a hash sequence")]
    #[test]
    fn random_bytes_never_panic_and_never_yield_more_than_they_hold() {
        let mut next = kvgate_kv::hash::sequence(11);
        for _ in 0..5000 {
            let alphabet = b"0123456789abcdefX;= \r\n\t";
            let wire: Vec<u8> =
                (0..next() % 64).map(|_| if next().is_multiple_of(3) { next() as u8 } else { alphabet[(next() % alphabet.len() as u64) as usize] }).collect();
            if let Ok((data, _, _)) = decode(&wire, (next() % 8) as usize + 1) {
                assert!(data.len() <= wire.len());
            }
        }
    }

    #[test]
    fn sizes_are_hex_in_either_case() {
        let mut wire = b"1A\r\n".to_vec();
        wire.extend([b'z'; 26]);
        wire.extend_from_slice(b"\r\n0\r\n\r\n");
        let (data, done, _) = decode(&wire, 5).unwrap();
        assert_eq!((data.len(), done), (26, true));
        assert!(!decode(b"1a\r\n", 64).unwrap().1);
    }
}
