#![no_main]
// Target `admission`: see clusterip::fuzzing::admission and docs/reliability.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = clusterip::fuzzing::admission(data);
});
