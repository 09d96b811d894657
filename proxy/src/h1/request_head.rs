//! Request heads, both ways. A client's ([`RequestHead`]): parsed once with `httparse` into
//! offsets over its bytes (no header maps), with the checks that refuse a head the gateway could
//! misread (RFC 9112's target forms, no fragment, the size caps); the connection that reads it
//! is `downstream::conn`. And the requests the gateway writes to workers: a client's request
//! passed on ([`write_forwarded`]) and its own ([`write_own`]).

// Parses bytes from outside: a narrowing cast here could truncate a peer's value.
#![deny(clippy::cast_possible_truncation)]

use bytes::Bytes;
use std::mem::MaybeUninit;

/// Largest request head accepted (request line and headers).
pub const MAX_HEAD: usize = 64 * 1024;
/// Most headers a request may carry.
pub const MAX_HEADERS: usize = 128;

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

    /// Its list of header offsets, for the next head to reuse (the head itself is done with).
    pub fn into_header_list(self) -> Vec<[u32; 4]> {
        self.headers
    }

    /// The head [`parse_request`] found, holding the bytes it was parsed from.
    pub fn with_raw(self, raw: Bytes) -> Self {
        Self { raw, ..self }
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
    pub fn connection_has(&self, token: &[u8]) -> bool {
        crate::h1::connection_has(self.headers(), token)
    }
}

/// Parses a request head at the front of `buf`: the head with offsets (its `raw` left empty)
/// and its length, or `None` while it is incomplete. `spare` holds the header offsets: a
/// connection's last head's list, reused (it is taken into the head, and left as it was while
/// the head is incomplete).
pub fn parse_request(buf: &[u8], spare: &mut Vec<[u32; 4]>) -> Result<Option<(RequestHead, usize)>, HeadError> {
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

/// A client's request written out for a worker whose `Host` is `host`: its head (the client's
/// headers minus hop-by-hop ones, with the worker's `Host`, the body's length and the request
/// id) and its body, in one buffer so that it goes out in one write. Written straight from the
/// client's header: building a Pingora header first costs two header maps and a copy of every
/// name and value per request (docs/architecture.md, "The hot path's allocations"). What else
/// is kept or replaced, [`Passed`] says.
pub fn write_forwarded(
    client: &RequestHead,
    host: &[u8],
    method: &str,
    path: &str,
    body: &[u8],
    request_id: &str,
    passed: Passed<'_>,
) -> Result<Vec<u8>, Unwritable> {
    check_path(path)?;
    if request_id.bytes().any(super::splits_head) {
        return Err(Unwritable("the request id"));
    }
    if method.is_empty() || !method.bytes().all(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c)) {
        return Err(Unwritable("the request method"));
    }
    let mut w = Vec::with_capacity(256 + body.len());
    put_request_line(&mut w, method, path);
    let mut typed = false;
    let connection = super::hop::naming(client.header("connection"));
    let own_trace = passed.traceparent.is_some();
    for (name, value) in client.headers() {
        if super::hop::forwarded(name, connection)
            && !name.eq_ignore_ascii_case(b"x-request-id")
            && (passed.keep_key || !is_key(name))
            && !(own_trace && name.eq_ignore_ascii_case(b"traceparent"))
        {
            typed |= name.eq_ignore_ascii_case(b"content-type");
            line(&mut w, name, value);
        }
    }
    if !typed {
        line(&mut w, b"Content-Type", b"application/json");
    }
    line(&mut w, b"Host", host);
    // A bodiless GET or DELETE goes out as the client sent it, without a length.
    if !body.is_empty() || !matches!(method, "GET" | "DELETE" | "OPTIONS") {
        super::put_content_length(&mut w, body.len() as u64);
    }
    line(&mut w, b"X-Request-Id", request_id.as_bytes());
    if let Some(t) = passed.traceparent {
        line(&mut w, b"traceparent", t.as_bytes());
    }
    w.extend_from_slice(b"\r\n");
    w.extend_from_slice(body);
    Ok(w)
}

/// What a forwarded request keeps of the client's headers, or replaces.
#[derive(Debug, Clone, Copy, Default)]
pub struct Passed<'a> {
    /// Keep the client's API key (`Authorization`, `x-api-key`); else it stays at the gateway.
    pub keep_key: bool,
    /// The leg's own `traceparent` (W3C), in place of the client's; `tracestate` is passed on.
    pub traceparent: Option<&'a str>,
}

/// Whether header `name` carries a client's API key.
fn is_key(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"authorization") || name.eq_ignore_ascii_case(b"x-api-key")
}

/// A request to a worker that could not be written: the part that held a byte HTTP/1.1 forbids.
#[derive(Debug, thiserror::Error)]
#[error("{0} holds a byte HTTP/1.1 forbids there (NUL, CR, LF, or a space in the path)")]
pub struct Unwritable(&'static str);

/// A request target fit for the wire: not empty, no space, no byte that would split the head.
fn check_path(path: &str) -> Result<(), Unwritable> {
    if path.is_empty() || path.bytes().any(|c| c == b' ' || super::splits_head(c)) {
        return Err(Unwritable("the request path"));
    }
    Ok(())
}

/// Appends one `name: value` header line.
fn line(w: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    w.extend_from_slice(name);
    w.extend_from_slice(b": ");
    w.extend_from_slice(value);
    w.extend_from_slice(b"\r\n");
}

/// A request the gateway makes of a worker (whose `Host` is `host`) on its own account (a
/// probe, a fleet operation): `method path`, with `body` as JSON when given.
pub fn write_own(host: &[u8], method: &str, path: &str, body: Option<&[u8]>, keep_alive: bool) -> Result<Vec<u8>, Unwritable> {
    check_path(path)?;
    let mut w = Vec::with_capacity(128 + path.len() + body.map_or(0, <[u8]>::len));
    put_request_line(&mut w, method, path);
    line(&mut w, b"Host", host);
    line(&mut w, b"User-Agent", b"kvgate");
    if !keep_alive {
        line(&mut w, b"Connection", b"close");
    }
    match body {
        Some(b) => {
            line(&mut w, b"Content-Type", b"application/json");
            super::put_content_length(&mut w, b.len() as u64);
            w.extend_from_slice(b"\r\n");
            w.extend_from_slice(b);
        }
        // A bodiless POST still says so: some servers wait for a length otherwise.
        None if method != "GET" => {
            super::put_content_length(&mut w, 0);
            w.extend_from_slice(b"\r\n");
        }
        None => w.extend_from_slice(b"\r\n"),
    }
    Ok(w)
}

/// Appends a request line, `method target HTTP/1.1`.
fn put_request_line(w: &mut Vec<u8>, method: &str, target: &str) {
    w.extend_from_slice(method.as_bytes());
    w.push(b' ');
    w.extend_from_slice(target.as_bytes());
    w.extend_from_slice(b" HTTP/1.1\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The client's key kept or not, its trace context passed on as it came.
    fn keep(keep_key: bool) -> Passed<'static> {
        Passed { keep_key, traceparent: None }
    }

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

    const HOST: &[u8] = b"10.0.0.7:8000";

    fn client(headers: &[(&str, &str)]) -> RequestHead {
        let lines: String = headers.iter().flat_map(|&(n, v)| [n, ": ", v, "\r\n"]).collect();
        RequestHead::parse(format!("POST /v1/completions HTTP/1.1\r\n{lines}\r\n").into()).unwrap()
    }

    #[test]
    fn a_worker_request_keeps_end_to_end_headers_and_replaces_the_hop_by_hop_ones() {
        let c = client(&[
            ("Authorization", "Bearer k"),
            ("Connection", "keep-alive"),
            ("Keep-Alive", "timeout=5"),
            ("Host", "gateway.example"),
            ("Content-Length", "999"),
            ("Transfer-Encoding", "chunked"),
            ("X-Request-Id", "from-client"),
            ("X-Trace", "t1"),
        ]);
        let wire = write_forwarded(&c, HOST, "POST", "/v1/completions", b"{}", "req-1", keep(true)).unwrap();
        let text = String::from_utf8(wire).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert_eq!(body, "{}");
        let mut lines = head.split("\r\n");
        assert_eq!(lines.next(), Some("POST /v1/completions HTTP/1.1"));
        let mut got: Vec<&str> = lines.collect();
        got.sort_unstable();
        let want =
            ["Authorization: Bearer k", "Content-Length: 2", "Content-Type: application/json", "Host: 10.0.0.7:8000", "X-Request-Id: req-1", "X-Trace: t1"];
        assert_eq!(got, want, "{head}");
    }

    #[test]
    fn the_client_content_type_is_kept_and_not_doubled() {
        let c = client(&[("content-type", "application/json; charset=utf-8")]);
        let text = String::from_utf8(write_forwarded(&c, HOST, "POST", "/v1/chat/completions", b"{}", "r", keep(true)).unwrap()).unwrap();
        assert_eq!(text.matches("ontent-").count(), 2, "content-type and content-length once each: {text}");
        assert!(text.contains("content-type: application/json; charset=utf-8\r\n"), "{text}");
    }

    #[test]
    fn headers_a_connection_header_names_and_other_hop_by_hop_ones_stay_behind() {
        let c = client(&[
            ("Connection", "keep-alive, X-Hop, x-other"),
            ("X-Hop", "1"),
            ("X-Other", "2"),
            ("Proxy-Authorization", "Basic c2VjcmV0"),
            ("Expect", "100-continue"),
            ("TE", "trailers"),
            ("Trailer", "X-T"),
            ("Upgrade", "websocket"),
            ("Proxy-Connection", "keep-alive"),
            ("Accept", "a"),
            ("Accept", "b"),
        ]);
        let text = String::from_utf8(write_forwarded(&c, HOST, "POST", "/v1/completions", b"{}", "r", keep(true)).unwrap()).unwrap();
        let names: Vec<&str> = text.split("\r\n").skip(1).take_while(|l| !l.is_empty()).filter_map(|l| l.split_once(':')).map(|(n, _)| n).collect();
        assert_eq!(names, ["Accept", "Accept", "Content-Type", "Host", "Content-Length", "X-Request-Id"], "{text}");
        assert!(text.find("Accept: a").unwrap() < text.find("Accept: b").unwrap(), "repeated headers keep their order");
    }

    #[test]
    fn the_clients_api_key_stays_at_the_gateway_unless_it_is_kept() {
        let c = client(&[("Authorization", "Bearer sk-secret"), ("X-Api-Key", "sk-secret"), ("x-trace", "t")]);
        let dropped = String::from_utf8(write_forwarded(&c, HOST, "POST", "/v1/completions", b"{}", "r", keep(false)).unwrap()).unwrap();
        assert!(!dropped.contains("sk-secret") && dropped.contains("x-trace: t"), "{dropped}");
        let kept = String::from_utf8(write_forwarded(&c, HOST, "POST", "/v1/completions", b"{}", "r", keep(true)).unwrap()).unwrap();
        assert!(kept.contains("Authorization: Bearer sk-secret") && kept.contains("X-Api-Key: sk-secret"), "{kept}");
    }

    #[test]
    fn a_legs_own_traceparent_replaces_the_clients_and_tracestate_passes_on() {
        let c = client(&[("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("tracestate", "vendor=x")]);
        let own = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01";
        let passed = Passed { keep_key: false, traceparent: Some(own) };
        let text = String::from_utf8(write_forwarded(&c, HOST, "POST", "/v1/completions", b"{}", "r", passed).unwrap()).unwrap();
        assert_eq!(text.matches("traceparent").count(), 1, "{text}");
        assert!(text.contains(&format!("traceparent: {own}\r\n")) && text.contains("tracestate: vendor=x\r\n"), "{text}");
        let untraced = String::from_utf8(write_forwarded(&c, HOST, "POST", "/v1/completions", b"{}", "r", keep(false)).unwrap()).unwrap();
        assert!(untraced.contains("b7ad6b7169203331"), "without tracing the client's trace goes on as it came: {untraced}");
    }

    #[test]
    fn header_names_go_out_as_the_client_wrote_them() {
        let c = client(&[("x-trace", "t")]);
        let text = String::from_utf8(write_forwarded(&c, HOST, "POST", "/v1/completions", b"{}", "r", keep(true)).unwrap()).unwrap();
        assert!(text.contains("\r\nx-trace: t\r\n"), "{text}");
    }

    #[test]
    fn a_request_id_or_path_that_would_split_the_head_is_refused() {
        let c = client(&[]);
        let refused = |path: &str, id: &str| write_forwarded(&c, HOST, "POST", path, b"{}", id, keep(true)).is_err();
        assert!(refused("/v1/completions", "a\r\nX-Evil: 1"));
        assert!(refused("/v1/completions", "a\0b"));
        assert!(refused("/v1/x y", "r"));
        assert!(refused("/v1/x\n", "r"));
        assert!(!refused("/v1/completions", "r-1"));
    }
}
