#![no_main]
// Target `ruleset`: see clusterip_agent::fuzzing::ruleset and docs/reliability.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = clusterip_agent::fuzzing::ruleset(data);
});
