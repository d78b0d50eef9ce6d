// Stamps the commit the binary is built from into `CLUSTERIP_BUILD_COMMIT` (for `--version`
// and the `*_build_info` metric): the environment variable `CLUSTERIP_COMMIT` when set
// (image builds: the build context holds no `.git`; scripts/build-images.sh passes it as a
// build argument), else `git rev-parse --short HEAD` when the source is a git checkout,
// else "unknown". agent/build.rs is this file too.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-env-changed=CLUSTERIP_COMMIT");
    let from_env = std::env::var("CLUSTERIP_COMMIT").ok().map(|c| c.trim().to_string()).filter(|c| !c.is_empty());
    let commit = from_env.or_else(|| {
        // Rebuild when HEAD moves: HEAD itself, the branch it names, and packed refs.
        for path in ["HEAD", "packed-refs"] {
            if let Some(p) = git(&["rev-parse", "--git-path", path]) {
                println!("cargo:rerun-if-changed={p}");
            }
        }
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            if let Some(p) = git(&["rev-parse", "--git-path", &branch]) {
                if Path::new(&p).exists() {
                    println!("cargo:rerun-if-changed={p}");
                }
            }
        }
        git(&["rev-parse", "--short", "HEAD"])
    });
    println!("cargo:rustc-env=CLUSTERIP_BUILD_COMMIT={}", commit.as_deref().unwrap_or("unknown"));
}
