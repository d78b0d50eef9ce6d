//! `clusterip range`: the JSON contract other tools read, and bad input.

use std::process::Command;

fn clusterip(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_clusterip")).args(args).output().expect("run clusterip")
}

#[test]
fn json_has_exactly_the_documented_keys() {
    let out = clusterip(&["range", "fd00:10:96::/112", "-o", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let mut keys: Vec<&str> = v.as_object().expect("object").keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["cidr", "dynamic", "family", "first", "last", "offset", "size", "static"]);
    assert_eq!(v["cidr"], "fd00:10:96::/112");
    assert_eq!(v["family"], "IPv6");
    assert_eq!(v["size"], 65535);
    assert_eq!(v["first"], "fd00:10:96::1");
    assert_eq!(v["last"], "fd00:10:96::ffff");
    assert_eq!(v["offset"], 256);
    assert_eq!(v["static"], serde_json::json!({"first": "fd00:10:96::1", "last": "fd00:10:96::100", "size": 256}));
    assert_eq!(v["dynamic"], serde_json::json!({"first": "fd00:10:96::101", "last": "fd00:10:96::ffff", "size": 65279}));
}

#[test]
fn bad_input_is_one_line_and_a_non_zero_exit() {
    for (bad, says) in [
        ("010.96.0.0/12", "leading zero"),
        ("10.96.0.1/12", "canonical form is 10.96.0.0/12"),
        ("::ffff:10.96.0.0/108", "IPv4-mapped"),
        ("10.96.0.0/40", "0 to 32"),
        ("fd00::/48", "shortest allowed prefix length for service CIDR is 64, got 48"),
        ("not-a-cidr", "expected ADDRESS/PREFIX"),
    ] {
        let out = clusterip(&["range", bad]);
        assert!(!out.status.success(), "{bad} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim_end().lines().count(), 1, "{bad}: {err}");
        assert!(err.contains(says), "{bad}: {err}");
        assert!(!err.contains("panicked"), "{bad}: {err}");
    }
}

/// `--version` names the commit (build.rs: `CLUSTERIP_COMMIT`, else git, else "unknown"),
/// the same as the `clusterip_build_info` metric.
#[test]
fn version_names_the_commit() {
    let out = clusterip(&["--version"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.trim(), format!("clusterip {} (commit {})", clusterip::metrics::VERSION, clusterip::metrics::COMMIT));
    clusterip_test_support::assert_commit_stamp(clusterip::metrics::COMMIT);
}
