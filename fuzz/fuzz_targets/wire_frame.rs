//! cargo-fuzz target: `coordinator::fuzzing::wire_frame` (see there for the input
//! format and the invariants checked).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| coordinator::fuzzing::wire_frame(data));
