//! `clusterip controller --config FILE`: the file's fields reach the controller as its flags,
//! the command line overrides them, and a bad file is refused before anything starts, with
//! every bad field named.

use std::process::Command;

fn controller(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_clusterip")).arg("controller").args(args).env_remove("KUBECONFIG").output().expect("run clusterip");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn file(dir: &tempfile::TempDir, text: &str) -> String {
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, text).expect("write the configuration file");
    path.to_str().expect("a UTF-8 path").to_string()
}

const HEAD: &str = "apiVersion: clusterip.allocator/v1alpha1\nkind: ControllerConfiguration\n";

#[test]
fn fields_reach_the_controller_and_flags_override_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The first thing the controller reads is the webhook client CA: the error names it.
    let path = file(&dir, &format!("{HEAD}tlsCertFile: /nonexistent/from-file.crt\ntlsPrivateKeyFile: /nonexistent/from-file.key\nclientCaFile: /nonexistent/from-file-ca.crt\ninFlightLimit: 1m30s\nserviceCidr: [198.18.0.0/24]\n"));
    let (code, err) = controller(&["--config", &path]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/from-file-ca.crt"), "the file's clientCaFile did not reach the controller: {err}");
    let (code, err) = controller(&["--config", &path, "--client-ca-file", "/nonexistent/from-flag-ca.crt"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/from-flag-ca.crt") && !err.contains("from-file-ca.crt"), "the flag did not override the field: {err}");
}

#[test]
fn a_bad_file_is_refused_with_every_bad_field_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = file(&dir, &format!("{HEAD}inFlightLimit: 90 seconds\nserviceCIDRs: [10.96.0.0/12]\nleaderElect: maybe\nbackend: bitmap\n"));
    let (code, err) = controller(&["--config", &path]);
    assert_eq!(code, 2, "{err}");
    for want in [
        &format!("configuration file {path}:") as &str,
        "field \"inFlightLimit\" (--in-flight-limit): invalid value '90 seconds'",
        "field \"serviceCIDRs\": unknown",
        "field \"leaderElect\" (--leader-elect)",
        "field \"backend\" (--backend): invalid value 'bitmap'",
    ] {
        assert!(err.contains(want), "{want:?} missing from:\n{err}");
    }
    let path = file(&dir, "apiVersion: clusterip.allocator/v1\nkind: AgentConfiguration\n");
    let (code, err) = controller(&["--config", &path]);
    assert_eq!(code, 2);
    assert!(err.contains("this version reads clusterip.allocator/v1alpha1") && err.contains("this command reads kind ControllerConfiguration"), "{err}");
}
