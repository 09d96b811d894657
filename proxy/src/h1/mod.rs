//! HTTP/1.1 wire pieces both sides of the gateway share: body framing and chunked coding, read
//! as they arrive.
//! The client side's connection is `downstream::conn`, the workers' responses
//! `upstream::response`; both parse heads with `httparse` and build no header maps.

pub mod body;
pub mod chunked;

/// Whether a comma-separated header value (`Connection: keep-alive, X-Hop`) lists `token`, in
/// any case.
pub fn list_has(list: &[u8], token: &[u8]) -> bool {
    list.split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// A `Content-Length` value: decimal digits only (no sign, no spaces inside), else `None`.
pub fn content_length(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok().map(str::trim).filter(|s| s.bytes().all(|b| b.is_ascii_digit())).and_then(|s| s.parse().ok())
}
