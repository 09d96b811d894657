//! The migration tracker following whatever a worker streams back, cut anywhere, for a chat or
//! completion request: it never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, stream)) = data.split_first() else { return };
    let chat = flags & 1 == 1;
    let body: &[u8] =
        if chat { br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"# } else { br#"{"model":"m","stream":true,"prompt":"hi"}"# };
    let step = usize::from(flags >> 1).max(1);
    let cuts: Vec<usize> = (1..stream.len()).step_by(step).collect();
    kvgate::fuzzing::migration_tracker(chat, body, stream, &cuts);
});
