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
    // Built from a git checkout: the stamp is a commit of this history — HEAD when it was
    // built, or an ancestor of HEAD now (a commit made while the suite runs moves HEAD on,
    // so comparing with HEAD itself would race).
    let in_git = Command::new("git").args(["rev-parse", "--git-dir"]).current_dir(env!("CARGO_MANIFEST_DIR")).output();
    if let (Ok(g), Err(_)) = (in_git, std::env::var("CLUSTERIP_COMMIT")) {
        if g.status.success() {
            let stamp = commit;
            assert!(stamp.len() >= 7 && stamp.bytes().all(|b| b.is_ascii_hexdigit()), "a short commit hash: {stamp:?}");
            let ancestor = Command::new("git")
                .args(["merge-base", "--is-ancestor", stamp, "HEAD"])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("run git merge-base");
            assert!(ancestor.success(), "{stamp} is HEAD or one of its ancestors");
        }
    }
}
