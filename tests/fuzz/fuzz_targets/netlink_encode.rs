#![no_main]
// Target `netlink_encode`: see clusterip_agent::fuzzing::netlink_encode and docs/reliability.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = clusterip_agent::fuzzing::netlink_encode(data);
});
