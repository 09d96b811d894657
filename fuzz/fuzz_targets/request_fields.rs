//! The one-pass reader of a request body's routing fields and prompt ids against serde_json
//! (the promise in proxy/src/request/fields.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvgate::fuzzing::request_fields(data));
