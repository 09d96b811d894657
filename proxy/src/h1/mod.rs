//! HTTP/1.1 on the wire, for both sides of the gateway, as hyper's `proto/h1/role.rs` keeps it
//! for both roles: request heads ([`request_head`]: a client's parsed, a worker's written),
//! response heads ([`response_head`]: a worker's parsed, a client's written), which headers
//! cross the gateway ([`hop`]), body framing and chunked coding read as they arrive, and the
//! small readers and writers every head uses (`Connection` lists, lengths). The connections keep
//! only I/O and pooling: the client side's is `downstream::conn`, the workers'
//! `upstream::response` and its pool. Heads are parsed with `httparse` into offsets; no header
//! maps are built.

// Parses bytes from outside: a narrowing cast here could truncate a peer's value.
#![deny(clippy::cast_possible_truncation)]

pub mod body;
pub mod chunked;
pub mod hop;
pub mod request_head;
pub mod response_head;
pub mod spare;

/// Whether a comma-separated header value (`Connection: keep-alive, X-Hop`) lists `token`, in
/// any case.
pub fn list_has(list: &[u8], token: &[u8]) -> bool {
    list.split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// Whether the `Connection` headers among `headers` (name, value; names in any case) list
/// `token`: the one reading of `Connection` for request and response heads alike.
pub fn connection_has<'a>(headers: impl IntoIterator<Item = (&'a [u8], &'a [u8])>, token: &[u8]) -> bool {
    headers.into_iter().filter(|(n, _)| n.eq_ignore_ascii_case(b"connection")).any(|(_, v)| list_has(v, token))
}

/// Whether byte `c` would split a head if written into a header name or value or a request
/// target (NUL, CR, LF): what the gateway checks before writing anything it did not parse.
pub fn splits_head(c: u8) -> bool {
    matches!(c, 0 | b'\r' | b'\n')
}

/// A `Content-Length` value: decimal digits only (no sign, no spaces inside), else `None`.
pub fn content_length(v: &[u8]) -> Option<u64> {
    // Read off the bytes: it runs on every request and response head (no UTF-8 pass, no str parse).
    let digits = v.trim_ascii();
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &b| if b.is_ascii_digit() { n.checked_mul(10)?.checked_add(u64::from(b - b'0')) } else { None })
}

/// Appends `n` in decimal: a status, a `Content-Length`, written per response without
/// formatting machinery or an allocation.
pub fn put_decimal(w: &mut Vec<u8>, n: u64) {
    put_digits(w, n, 10);
}

/// Appends a `Content-Length: n` header line.
pub fn put_content_length(w: &mut Vec<u8>, n: u64) {
    w.extend_from_slice(b"Content-Length: ");
    put_decimal(w, n);
    w.extend_from_slice(b"\r\n");
}

/// Appends `n` in lower-case hexadecimal: a chunk's size.
pub fn put_hex(w: &mut Vec<u8>, n: u64) {
    put_digits(w, n, 16);
}

/// Appends `n`'s digits in `base` (at most 16), most significant first.
fn put_digits(w: &mut Vec<u8>, mut n: u64, base: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[usize::try_from(n % base).expect("a remainder below the base")];
        n /= base;
        if n == 0 {
            break;
        }
    }
    w.extend_from_slice(&digits[at..]);
}

/// Where `part` lies in `buf`, the bytes `httparse` parsed it from: its start and end offsets.
pub fn span(buf: &[u8], part: &[u8]) -> [u32; 2] {
    // Heads are read under a cap of 64 KiB (`MAX_HEAD`), so their offsets fit a u32.
    let offset = |n: usize| u32::try_from(n).expect("a head offset under the head cap");
    let at = part.as_ptr() as usize - buf.as_ptr() as usize;
    [offset(at), offset(at + part.len())]
}

/// How many of the `have` bytes buffered belong to a body with `left` bytes to go: the
/// smaller of the two. `left` comes from a peer's framing and may exceed what a `usize` holds.
pub fn take_len(have: usize, left: u64) -> usize {
    usize::try_from(left).map_or(have, |left| left.min(have))
}

/// Each header's name and value as offsets into `buf`, the bytes `httparse` parsed them from:
/// name start and end, value start and end. Heads keep these instead of copies.
pub fn header_spans<'a>(buf: &'a [u8], headers: &'a [httparse::Header<'a>]) -> impl Iterator<Item = [u32; 4]> + 'a {
    headers.iter().map(move |h| {
        let ([ns, ne], [vs, ve]) = (span(buf, h.name.as_bytes()), span(buf, h.value));
        [ns, ne, vs, ve]
    })
}

/// Whether a `Connection` value names any header besides `keep-alive` and `close` (which are
/// hop-by-hop anyway): only then must each header be looked up in it.
pub fn names_headers(connection: &[u8]) -> bool {
    connection
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .any(|t| !t.is_empty() && !t.eq_ignore_ascii_case(b"keep-alive") && !t.eq_ignore_ascii_case(b"close"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_lengths_are_digits_only_and_never_overflow() {
        assert_eq!(content_length(b"0"), Some(0));
        assert_eq!(content_length(b" 42 "), Some(42));
        assert_eq!(content_length(b"18446744073709551615"), Some(u64::MAX));
        for bad in [&b""[..], b" ", b"+1", b"-1", b"1 2", b"0x10", b"18446744073709551616", b"1,1", b"\xff"] {
            assert_eq!(content_length(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn numbers_are_written_as_format_writes_them() {
        for n in [0, 1, 9, 10, 15, 16, 99, 100, 200, 404, 65_535, 1 << 40, u64::MAX] {
            let (mut d, mut h) = (Vec::new(), Vec::new());
            put_decimal(&mut d, n);
            put_hex(&mut h, n);
            assert_eq!((d, h), (n.to_string().into_bytes(), format!("{n:x}").into_bytes()));
        }
    }

    #[test]
    fn a_connection_value_names_headers_only_beyond_keep_alive_and_close() {
        assert!(!names_headers(b"keep-alive"));
        assert!(!names_headers(b"Close"));
        assert!(!names_headers(b" keep-alive , close "));
        assert!(names_headers(b"keep-alive, X-Hop"));
        assert!(names_headers(b"upgrade"));
    }
}
