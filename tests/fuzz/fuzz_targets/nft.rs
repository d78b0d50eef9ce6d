#![no_main]
// Target `nft`: see clusterip_agent::fuzzing::nft and docs/reliability.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = clusterip_agent::fuzzing::nft(data);
});
