//! Worker response framing, kvgate's reader against hyper's client on the same bytes (the
//! first byte picks GET or HEAD). Where both read a response they must read the same status
//! and body; kvgate must not read one hyper refuses (it may refuse more).
#![no_main]

use kvgate_fuzz::{block_on, hyper_response};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&first, bytes)) = data.split_first() else { return };
    let head = first & 1 == 1;
    let ours = block_on(kvgate::fuzzing::worker_response(bytes, head));
    let theirs = block_on(hyper_response(bytes, head));
    match (&ours, &theirs) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "the response was read differently"),
        (Ok(a), Err(e)) => panic!("kvgate read {a:?} where hyper refused: {e}"),
        _ => {}
    }
});
