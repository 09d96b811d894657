//! Which headers cross the gateway: a message's end-to-end headers are passed on, its hop-by-hop
//! ones (RFC 9110 section 7.6.1, those its `Connection` header names, and the few the gateway
//! writes itself) stay behind. One rule for requests sent to workers and responses sent to
//! clients.

/// Whether a header named `name` crosses the gateway: not hop-by-hop, and not named by the
/// message's own `Connection` header (`connection`, its value).
pub fn forwarded(name: &[u8], connection: Option<&[u8]>) -> bool {
    !hop_by_hop(name) && !connection.is_some_and(|list| super::list_has(list, name))
}

/// Whether header `name` (any case) describes one hop and is never forwarded, besides those a
/// `Connection` header names: the hop-by-hop headers of RFC 9110 section 7.6.1 and their legacy
/// kin. `Host` and `Content-Length` are the gateway's to write; the proxy credentials are the
/// gateway's to read, never a worker's. The names' lengths are nearly all distinct, so the
/// length picks the one or two to compare: this runs for every header of every request and
/// response.
fn hop_by_hop(name: &[u8]) -> bool {
    let is = |h: &[u8]| name.eq_ignore_ascii_case(h);
    match name.len() {
        2 => is(b"te"),
        4 => is(b"host"),
        6 => is(b"expect"),
        7 => is(b"trailer") || is(b"upgrade"),
        10 => is(b"connection") || is(b"keep-alive"),
        14 => is(b"content-length"),
        16 => is(b"proxy-connection"),
        17 => is(b"transfer-encoding"),
        18 => is(b"proxy-authenticate"),
        19 => is(b"proxy-authorization"),
        _ => false,
    }
}

/// The `Connection` value to look each header up in: `None` when it names no header beyond
/// `keep-alive` and `close` (the usual case), so the per-header lookup is skipped.
pub fn naming(connection: Option<&[u8]>) -> Option<&[u8]> {
    connection.filter(|c| super::names_headers(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOP_BY_HOP: &[&str] = &[
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
        "expect",
    ];

    #[test]
    fn the_hop_by_hop_check_knows_exactly_the_listed_names() {
        for h in HOP_BY_HOP {
            assert!(hop_by_hop(h.as_bytes()) && hop_by_hop(h.to_ascii_uppercase().as_bytes()), "{h}");
        }
        for other in ["content-type", "x-request-id", "authorization", "tea", "hosts", "date", "", "connectio"] {
            assert!(!hop_by_hop(other.as_bytes()), "{other}");
        }
    }
}
