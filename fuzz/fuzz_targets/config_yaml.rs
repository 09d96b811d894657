//! Configuration files: loaded or refused with a line and column, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        kvgate::fuzzing::config(text);
    }
});
