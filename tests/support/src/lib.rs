//! Test support shared by the integration tests of the workspace: a real control plane
//! (etcd + kube-apiserver, started by `scripts/dev-cluster.sh`) on demand.
//!
//! - With `CLUSTERIP_TEST_CLUSTER=<state dir>` set (what `scripts/test.sh` does), the cluster
//!   described by `<state dir>/env` is reused and never stopped by the tests.
//! - Otherwise the first caller in a test binary starts a private cluster in a temporary
//!   directory, and it is stopped with `dev-cluster.sh down` when the test binary exits
//!   (normally or after failed tests), through an `atexit` hook.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

/// A running control plane: where its kubeconfig is and how to reach its parts.
#[derive(Debug)]
pub struct ControlPlane {
    dir: PathBuf,
    env: HashMap<String, String>,
    /// Stopped (and its directory removed) when dropped: true only for `private()` ones.
    stop_on_drop: bool,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if self.stop_on_drop {
            let _ = self.script().arg("down").status();
        }
    }
}

static SHARED: OnceLock<Arc<ControlPlane>> = OnceLock::new();
static OWNED_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The repository root (the workspace root), found from this crate's manifest directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root")
}

/// The control plane of this test binary, started on first use.
pub fn control_plane() -> Arc<ControlPlane> {
    SHARED.get_or_init(|| Arc::new(start_or_reuse())).clone()
}

fn start_or_reuse() -> ControlPlane {
    if let Ok(dir) = std::env::var("CLUSTERIP_TEST_CLUSTER") {
        let dir = PathBuf::from(dir);
        return ControlPlane::read(&dir).unwrap_or_else(|e| panic!("CLUSTERIP_TEST_CLUSTER={}: {e}", dir.display()));
    }
    let dir = std::env::temp_dir().join(format!("clusterip-test-cluster-{}", std::process::id()));
    eprintln!("test-support: starting a private control plane in {}", dir.display());
    *OWNED_DIR.lock().expect("lock") = Some(dir.clone());
    // SAFETY: registering a plain extern "C" function with no captured state.
    unsafe { libc::atexit(stop_owned_cluster) };
    let status = Command::new(repo_root().join("scripts/dev-cluster.sh"))
        .arg("up")
        .env("CLUSTERIP_CLUSTER_DIR", &dir)
        .env("CLUSTERIP_CONTROLLER", "0")
        .status()
        .expect("run scripts/dev-cluster.sh");
    assert!(status.success(), "scripts/dev-cluster.sh up failed ({status})");
    ControlPlane::read(&dir).expect("cluster env written by dev-cluster.sh")
}

extern "C" fn stop_owned_cluster() {
    let dir = OWNED_DIR.lock().ok().and_then(|mut d| d.take());
    if let Some(dir) = dir {
        let _ = Command::new(repo_root().join("scripts/dev-cluster.sh"))
            .arg("down")
            .env("CLUSTERIP_CLUSTER_DIR", &dir)
            .status();
    }
}

impl ControlPlane {
    fn read(dir: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(dir.join("env")).map_err(|e| format!("read env: {e}"))?;
        let env = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        Ok(Self { dir: dir.to_path_buf(), env, stop_on_drop: false })
    }

    /// A control plane of its own for a test that breaks it (stops etcd, say): started now,
    /// stopped and removed when the value is dropped, failed test included.
    pub fn private(tag: &str) -> ControlPlane {
        let dir = std::env::temp_dir().join(format!("clusterip-{tag}-{}", std::process::id()));
        let status = Command::new(repo_root().join("scripts/dev-cluster.sh"))
            .arg("up")
            .env("CLUSTERIP_CLUSTER_DIR", &dir)
            // Tests that want a controller start their own.
            .env("CLUSTERIP_CONTROLLER", "0")
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run scripts/dev-cluster.sh");
        let mut cp = ControlPlane::read(&dir).unwrap_or_else(|e| {
            let _ = Command::new(repo_root().join("scripts/dev-cluster.sh")).arg("down").env("CLUSTERIP_CLUSTER_DIR", &dir).status();
            panic!("private control plane in {}: {e}", dir.display())
        });
        cp.stop_on_drop = true;
        assert!(status.success(), "scripts/dev-cluster.sh up failed ({status})");
        cp
    }

    fn script(&self) -> Command {
        let mut cmd = Command::new(repo_root().join("scripts/dev-cluster.sh"));
        cmd.env("CLUSTERIP_CLUSTER_DIR", &self.dir);
        cmd
    }

    /// Stop one component ("etcd", "kube-apiserver"), keeping its state.
    pub fn stop(&self, component: &str) {
        let status = self.script().args(["stop", component]).status().expect("dev-cluster.sh stop");
        assert!(status.success(), "stopping {component} failed");
    }

    /// Start a stopped component again and wait until it is ready.
    pub fn start(&self, component: &str) {
        let status = self.script().args(["start", component]).status().expect("dev-cluster.sh start");
        assert!(status.success(), "starting {component} failed");
    }

    /// The cluster's state directory (`.cluster/` or a temporary one).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the admin kubeconfig.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// etcd client endpoints (plain HTTP on loopback).
    pub fn etcd_endpoints(&self) -> Vec<String> {
        self.var("CLUSTERIP_ETCD_ENDPOINTS").split(',').map(str::to_string).collect()
    }

    /// A value from the cluster's env file (see `scripts/dev-cluster.sh`).
    pub fn var(&self, key: &str) -> &str {
        self.env.get(key).map(String::as_str).unwrap_or_else(|| panic!("{key} missing from cluster env"))
    }

    /// A kube client with cluster-admin rights.
    pub async fn client(&self) -> kube::Client {
        let kubeconfig = kube::config::Kubeconfig::read_from(self.kubeconfig()).expect("read kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .expect("kubeconfig to config");
        kube::Client::try_from(config).expect("kube client")
    }

    /// `kubectl` with this cluster's kubeconfig (the harness-built kubectl when present).
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(kubectl_path());
        cmd.env("KUBECONFIG", self.kubeconfig());
        cmd
    }
}

/// The kubectl matching the apiserver, as built by the harness; `kubectl` on PATH otherwise.
pub fn kubectl_path() -> PathBuf {
    let out = Command::new(repo_root().join("scripts/lib/build-go-binaries.sh")).arg("print-dirs").output();
    if let Ok(out) = out {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(dir) = line.strip_prefix("K8S_BIN=") {
                let p = Path::new(dir).join("kubectl");
                if p.exists() {
                    return p;
                }
            }
        }
    }
    PathBuf::from("kubectl")
}

/// A name unique to this test process, for objects a test creates (`prefix-<pid>-<n>`).
pub fn unique_name(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}
