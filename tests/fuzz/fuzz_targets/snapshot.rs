#![no_main]
// Target `snapshot`: see clusterip::fuzzing::snapshot and docs/reliability.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = clusterip::fuzzing::snapshot(data);
});
