//! Client request framing, kvgate against hyper's server on the same bytes. Where both read a
//! request they must read the same one (method, target, body), and kvgate must not read a
//! request hyper refused: a request one side frames differently is the request-smuggling
//! class. kvgate refusing what hyper reads is allowed (it is the stricter of the two, by
//! design: docs/fuzzing.md lists where).
#![no_main]

use kvgate_fuzz::{block_on, hyper_requests};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (ours, our_stop) = block_on(kvgate::fuzzing::client_requests(data));
    let (theirs, their_stop) = block_on(hyper_requests(data));
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a, b, "request {i} framed differently (kvgate stop: {our_stop:?}, hyper stop: {their_stop:?})");
    }
    assert!(ours.len() <= theirs.len(), "kvgate read {} requests, hyper {} (hyper stopped on {their_stop:?}): {:?}", ours.len(), theirs.len(), ours.last());
});
