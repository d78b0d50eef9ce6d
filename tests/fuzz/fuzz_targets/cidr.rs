#![no_main]
// Target `cidr`: see clusterip::fuzzing::cidr and docs/reliability.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = clusterip::fuzzing::cidr(data);
});
