//! How an HTTP/1.1 message body is framed (RFC 9112 §6), and taking its bytes out of a read
//! buffer as they arrive: the same for a client's request and a worker's response.

use super::chunked::{ChunkError, Chunked};
use bytes::{Bytes, BytesMut};

/// A body's framing, and how much of it is left.
#[derive(Debug)]
pub enum Framing {
    /// This many bytes are still to come.
    Length(u64),
    /// Chunked coding.
    Chunked(Chunked),
    /// Until the peer closes the connection (responses only).
    UntilClose,
    /// Nothing more.
    Done,
}

impl Framing {
    /// Whether the whole body has been taken.
    pub fn is_done(&self) -> bool {
        matches!(self, Framing::Done)
    }

    /// Takes the body bytes `buf` holds (framing removed), leaving anything past the body's end
    /// in it; `None` when it holds none.
    pub fn take(&mut self, buf: &mut BytesMut) -> Result<Option<Bytes>, ChunkError> {
        let data = match self {
            Framing::Length(left) => {
                let n = super::take_len(buf.len(), *left);
                *left -= n as u64;
                let data = (n > 0).then(|| buf.split_to(n).freeze());
                if *left == 0 {
                    *self = Framing::Done;
                }
                data
            }
            Framing::Chunked(c) => {
                let data = c.next(buf)?;
                if c.is_done() {
                    *self = Framing::Done;
                }
                data
            }
            Framing::UntilClose => (!buf.is_empty()).then(|| buf.split().freeze()),
            Framing::Done => None,
        };
        Ok(data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_length_body_stops_at_its_length_and_leaves_the_rest() {
        let mut f = Framing::Length(3);
        let mut buf = BytesMut::from(&b"abcNEXT"[..]);
        assert_eq!(f.take(&mut buf).unwrap().as_deref(), Some(&b"abc"[..]));
        assert!(f.is_done());
        assert_eq!(f.take(&mut buf).unwrap(), None);
        assert_eq!(&buf[..], b"NEXT");
    }

    #[test]
    fn a_body_until_close_takes_everything() {
        let mut f = Framing::UntilClose;
        let mut buf = BytesMut::from(&b"all"[..]);
        assert_eq!(f.take(&mut buf).unwrap().as_deref(), Some(&b"all"[..]));
        assert_eq!(f.take(&mut buf).unwrap(), None);
        assert!(!f.is_done());
    }
}
