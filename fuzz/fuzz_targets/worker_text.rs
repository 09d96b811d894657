//! What a worker answers the gateway's own polls with: its Prometheus `/metrics` text and its
//! `GET /kv_event_sources` JSON. Read or refused, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvgate::fuzzing::kv_event_sources(data);
    if let Ok(text) = std::str::from_utf8(data) {
        kvgate::fuzzing::worker_metrics(text);
    }
});
