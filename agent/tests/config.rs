//! `clusterip-agent --config FILE` (AgentConfiguration): the file's fields reach the agent as
//! its flags, the command line overrides them, and a bad file is refused before anything
//! starts, every bad field named.

use std::path::PathBuf;
use std::process::Command;

fn agent(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_clusterip-agent")).args(args).env_remove("KUBECONFIG").env_remove("NODE_NAME").output().expect("run clusterip-agent");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A configuration file of this test, removed on drop.
struct File(PathBuf);

impl File {
    fn new(name: &str, text: &str) -> File {
        let path = std::env::temp_dir().join(format!("cip-agent-config-{}-{name}.yaml", std::process::id()));
        std::fs::write(&path, text).expect("write the configuration file");
        File(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 path")
    }
}

impl Drop for File {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const HEAD: &str = "apiVersion: clusterip.allocator/v1alpha1\nkind: AgentConfiguration\n";

#[test]
fn fields_reach_the_agent_and_flags_override_them() {
    // The first thing the agent reads is its kubeconfig: the error names the one it used.
    let f = File::new("good", &format!("{HEAD}kubeconfig: /nonexistent/from-file.kubeconfig\nminSyncPeriod: 1m30s\nclusterCidr: [198.18.0.0/16, fd00::/64]\n"));
    let (code, err) = agent(&["--config", f.path()]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/from-file.kubeconfig"), "the file's kubeconfig did not reach the agent: {err}");
    let (code, err) = agent(&["--config", f.path(), "--kubeconfig", "/nonexistent/from-flag.kubeconfig"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/from-flag.kubeconfig") && !err.contains("from-file"), "the flag did not override the field: {err}");
}

#[test]
fn a_bad_file_is_refused_with_every_bad_field_named() {
    let f = File::new("bad", &format!("{HEAD}minSyncPeriod: soon\nmode: ipvs\nproxyMode: nftables\nmasqueradeAll: sometimes\n"));
    let (code, err) = agent(&["--config", f.path()]);
    assert_eq!(code, 2, "{err}");
    for want in [
        "field \"minSyncPeriod\" (--min-sync-period): invalid value 'soon'",
        "field \"mode\" (--mode): invalid value 'ipvs'",
        "field \"proxyMode\": unknown",
        "field \"masqueradeAll\" (--masquerade-all): a switch takes true or false",
    ] {
        assert!(err.contains(want), "{want:?} missing from:\n{err}");
    }
    let f = File::new("kind", "apiVersion: clusterip.allocator/v1alpha1\nkind: ControllerConfiguration\n");
    let (code, err) = agent(&["--config", f.path()]);
    assert_eq!(code, 2);
    assert!(err.contains("this command reads kind AgentConfiguration"), "{err}");
}
