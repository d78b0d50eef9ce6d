//! `clusterip-agent --version` names the commit it was built from (build.rs:
//! `CLUSTERIP_COMMIT`, else git, else "unknown"), as `clusterip_agent_build_info` does.

use std::process::Command;

#[test]
fn version_names_the_commit() {
    let out = Command::new(env!("CARGO_BIN_EXE_clusterip-agent")).arg("--version").output().expect("run clusterip-agent");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let (version, commit) = (clusterip_agent::metrics::VERSION, clusterip_agent::metrics::COMMIT);
    assert_eq!(text.trim(), format!("clusterip-agent {version} (commit {commit})"));
    clusterip_test_support::assert_commit_stamp(commit);
}
