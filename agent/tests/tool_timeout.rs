//! A hung dataplane tool: the agent kills it at `--tool-timeout`, counts the sync as failed,
//! retries with backoff, and programs the rules once the tool works again. The `nft` the
//! agent finds first on its PATH is a script that hangs (`exec sleep 3600`) while a marker
//! file exists, and runs the real `nft` otherwise.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;

use common::*;
use serde_json::json;

const SYNC: Duration = Duration::from_secs(60);

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn real_nft() -> PathBuf {
    let path = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join("nft")).find(|p| p.is_file()).expect("nft on PATH")
}

/// Processes whose parent is `pid` and whose command line starts with `prefix`.
fn children(pid: u32, prefix: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    dir.filter_map(|e| e.ok())
        .filter(|e| {
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let cmdline = std::fs::read_to_string(e.path().join("cmdline")).unwrap_or_default().replace('\0', " ");
            let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()));
            ppid == Some(pid) && cmdline.starts_with(prefix)
        })
        .count()
}

#[test]
fn a_hung_nft_is_killed_the_sync_retried_and_the_rules_programmed_once_it_works() {
    let dir = TempDir(std::env::temp_dir().join(short_name("clusterip-tool-timeout-")));
    std::fs::create_dir_all(&dir.0).expect("temp dir");
    let script = dir.0.join("nft");
    let marker = dir.0.join("hang");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nif [ -e '{}' ]; then exec sleep 3600; fi\nexec '{}' \"$@\"\n", marker.display(), real_nft().display()),
    )
    .expect("write the nft script");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::write(&marker, "").expect("marker");

    let rt = runtime();
    let kns = KubeNs::new(rt);
    let topo = Topology::new(1);
    let proxy = short_name("t");
    let svc = kns.service(&proxy, "web", json!({"ports": [{"port": 80, "targetPort": TCP_PORT}]}));
    kns.slice("web", &[Ep::ready(&Topology::backend_ip(0))], |_| {});
    let path = format!("{}:{}", dir.0.display(), std::env::var("PATH").unwrap_or_default());
    // The backoff after failures is capped by the sync period.
    let flags = ["--tool-timeout", "1s", "--sync-period", "3s"];
    let agent = Agent::start_with_env(&topo.node.name, &KubeNs::kubeconfig(), &proxy, &flags, &[("PATH", path.as_str())]);

    wait_for("two syncs failed by the timeout", SYNC, || (agent.log_count(&["sync failed", "was killed"]) >= 2).then_some(()));
    // Killed tools are reaped: at most the one of the sync in flight is there.
    let hung = children(agent.pid(), "sleep 3600");
    assert!(hung <= 1, "{hung} hung tools left under the agent");

    std::fs::remove_file(&marker).expect("remove the marker");
    let addr = sa(&cluster_ip(&svc, false), 80);
    let who = wait_for("the VIP to answer once nft works", SYNC, || topo.tcp_get(addr, Duration::from_secs(2)).ok());
    assert_eq!(who, "b0");
    assert!(agent.log().contains("sync done"), "a sync succeeded after the failures");
}
