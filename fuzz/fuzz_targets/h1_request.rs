//! Client request framing, kvgate against hyper's server on the same bytes. Where both read a
//! request they must read the same one (method, target, body), and kvgate must not read a
//! request hyper refused: a request one side frames differently is the request-smuggling
//! class. kvgate refusing what hyper reads is allowed (it is the stricter of the two, by
//! design: docs/fuzzing.md lists where).
//!
//! One difference is by choice and taken out of the input: kvgate passes on a target holding
//! characters outside RFC 3986 (`` ` ``, `{`, `|`, `"`, …, and UTF-8 past ASCII), as nginx and
//! vLLM's own server do, where hyper's `Uri` refuses them. Those bytes are replaced by `a` in
//! the targets of request lines only (any line shaped `method target HTTP/…`, the method any
//! token), so header names and values, chunk lines and bodies keep every byte and are compared
//! as they are.
#![no_main]

use kvgate_fuzz::{block_on, hyper_requests};
use libfuzzer_sys::fuzz_target;

/// Visible bytes a request line may carry that hyper's URI parser refuses.
fn outside_rfc3986(b: u8) -> bool {
    matches!(b, b'"' | b'<' | b'>' | b'\\' | b'^' | b'`' | b'{' | b'|' | b'}') || b >= 0x80
}

/// A byte of an RFC 9110 token, what a method is made of (`tTE` is a method as much as `GET`).
fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `data` with the bytes hyper's `Uri` refuses replaced in the target of every line shaped
/// like a request line: a method (a token), one space, the target, one space, `HTTP/`. A body
/// or header line that happens to have that shape is changed alike for both parsers, so
/// framing is compared all the same.
fn targets_within_rfc3986(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len());
    for line in data.split_inclusive(|&b| b == b'\n') {
        let method = line.iter().take_while(|&&b| tchar(b)).count();
        let rest = &line[method..];
        let target = rest.strip_prefix(b" ").and_then(|t| t.windows(6).position(|w| w == b" HTTP/").map(|end| method + 1..method + 1 + end));
        match target {
            Some(range) if method > 0 => {
                out.extend_from_slice(&line[..range.start]);
                out.extend(line[range.clone()].iter().map(|&b| if outside_rfc3986(b) { b'a' } else { b }));
                out.extend_from_slice(&line[range.end..]);
            }
            _ => out.extend_from_slice(line),
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let data = targets_within_rfc3986(data);
    let data = data.as_slice();
    let (ours, our_stop) = block_on(kvgate::fuzzing::client_requests(data));
    let (theirs, their_stop) = block_on(hyper_requests(data));
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a, b, "request {i} framed differently (kvgate stop: {our_stop:?}, hyper stop: {their_stop:?})");
    }
    assert!(ours.len() <= theirs.len(), "kvgate read {} requests, hyper {} (hyper stopped on {their_stop:?}): {:?}", ours.len(), theirs.len(), ours.last());
});
