//! Client request framing, kvgate against hyper's server on the same bytes. Where both read a
//! request they must read the same one (method, target, body), and kvgate must not read a
//! request hyper refused: a request one side frames differently is the request-smuggling
//! class. kvgate refusing what hyper reads is allowed (it is the stricter of the two, by
//! design: docs/fuzzing.md lists where).
//!
//! One difference is by choice and taken out of the input: kvgate passes on a target holding
//! characters outside RFC 3986 (`` ` ``, `{`, `|`, `"`, …, and UTF-8 past ASCII), as nginx and
//! vLLM's own server do, where hyper's `Uri` refuses them. Those
//! bytes are replaced by `a` everywhere before both parsers read the input, so the comparison
//! stays about framing; they never change where a request ends.
#![no_main]

use kvgate_fuzz::{block_on, hyper_requests};
use libfuzzer_sys::fuzz_target;

/// Visible bytes a request line may carry that hyper's URI parser refuses.
fn outside_rfc3986(b: u8) -> bool {
    matches!(b, b'"' | b'<' | b'>' | b'\\' | b'^' | b'`' | b'{' | b'|' | b'}') || b >= 0x80
}

fuzz_target!(|data: &[u8]| {
    let data: Vec<u8> = data.iter().map(|&b| if outside_rfc3986(b) { b'a' } else { b }).collect();
    let data = data.as_slice();
    let (ours, our_stop) = block_on(kvgate::fuzzing::client_requests(data));
    let (theirs, their_stop) = block_on(hyper_requests(data));
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a, b, "request {i} framed differently (kvgate stop: {our_stop:?}, hyper stop: {their_stop:?})");
    }
    assert!(ours.len() <= theirs.len(), "kvgate read {} requests, hyper {} (hyper stopped on {their_stop:?}): {:?}", ours.len(), theirs.len(), ours.last());
});
