//! HTTP/1.1 wire pieces both sides of the gateway share: body framing and chunked coding, read
//! as they arrive.
//! The client side's connection is `downstream::conn`, the workers' responses
//! `upstream::response`; both parse heads with `httparse` and build no header maps.

pub mod body;
pub mod chunked;
pub mod spare;

/// Whether a comma-separated header value (`Connection: keep-alive, X-Hop`) lists `token`, in
/// any case.
pub fn list_has(list: &[u8], token: &[u8]) -> bool {
    list.split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
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
    fn a_connection_value_names_headers_only_beyond_keep_alive_and_close() {
        assert!(!names_headers(b"keep-alive"));
        assert!(!names_headers(b"Close"));
        assert!(!names_headers(b" keep-alive , close "));
        assert!(names_headers(b"keep-alive, X-Hop"));
        assert!(names_headers(b"upgrade"));
    }
}
