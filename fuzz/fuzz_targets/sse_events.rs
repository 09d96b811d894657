//! Counting token events in a worker's SSE stream: the count does not depend on where the
//! stream is cut into body chunks (while no line is longer than the counter's carry).
#![no_main]

use kvgate::sse::SseEventCounter;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, stream)) = data.split_first() else { return };
    let whole = SseEventCounter::default().feed(stream);
    let at = (usize::from(cut) * stream.len()) / 256;
    let mut split = SseEventCounter::default();
    let parts = split.feed(&stream[..at]) + split.feed(&stream[at..]);
    if stream.split(|&b| b == b'\n').all(|l| l.len() < 4096) {
        assert_eq!(whole, parts, "cut at {at}");
    }
});
