//! The shipped CRDs: `crds/crds.yaml` is what `clusterip crds` prints now, and the real
//! kube-apiserver accepts it (server-side dry run: validated, nothing installed).

use std::process::Command;

use clusterip_test_support::control_plane;

#[test]
fn crds_yaml_is_current() {
    let out = Command::new(env!("CARGO_BIN_EXE_clusterip")).arg("crds").output().expect("run clusterip crds");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/crds/crds.yaml")).expect("crds/crds.yaml");
    assert!(
        String::from_utf8_lossy(&out.stdout) == committed,
        "crds/crds.yaml is stale: regenerate with `cargo run -- crds > crds/crds.yaml`"
    );
    for name in ["ipaddresses.networking.k8s.io", "servicecidrs.networking.k8s.io", "jsonPath: .spec.parentRef"] {
        assert!(committed.contains(name), "{name} missing");
    }
}

#[test]
fn the_apiserver_accepts_the_crds() {
    let cp = control_plane();
    let out = cp
        .kubectl()
        .args(["apply", "--dry-run=server", "-f", concat!(env!("CARGO_MANIFEST_DIR"), "/crds/crds.yaml")])
        .output()
        .expect("run kubectl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.matches("created (server dry run)").count() + stdout.matches("configured (server dry run)").count(), 2, "{stdout}");
}
