//! KV-event batches as vLLM publishes them (msgpack; block hashes as integers or bytes):
//! decoded or refused, never a panic or an unbounded allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvgate_kv::event::decode_batch(data);
});
