#![no_main]
// Target `range_allocation`: see clusterip::fuzzing::range_allocation and docs/reliability.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = clusterip::fuzzing::range_allocation(data);
});
