//! Test support shared by the integration tests of the workspace: a real control plane
//! (etcd + kube-apiserver, started by `scripts/dev-cluster.sh`) on demand.
//!
//! - With `CLUSTERIP_TEST_CLUSTER=<state dir>` set (what `scripts/test.sh` does), the cluster
//!   described by `<state dir>/env` is reused and never stopped by the tests.
//! - Otherwise the first caller in a test binary starts a private cluster in a temporary
//!   directory, and it is stopped with `dev-cluster.sh down` when the test binary exits
//!   (normally or after failed tests), through an `atexit` hook.
//!
//! Nothing a test starts outlives it (docs/development.md, "Nothing a run starts outlives
//! it"): private clusters are owned by the test process (`CLUSTERIP_OWNER_PID`: their
//! watchdog stops them when the process is gone, killed included, and
//! `scripts/dev-cluster.sh reap` removes what is left); processes a test spawns should go
//! through [`die_with_parent`]; network namespaces are named [`netns_name`]
//! (`cip<pid>x<suffix>`) and scratch directories come from [`owned_temp_dir`], so that a
//! reap finds those whose process is gone.
//!
//! The one home of what the test binaries (controller and agent) and the benches share:
//! waiting ([`poll`]), addresses and a plain HTTP GET ([`net`]), a hostile tenant's
//! connections ([`attack`]), a network path that breaks on demand ([`faulty`]), fuzz corpus replay
//! ([`fuzz`]), network namespaces and their setup commands ([`netns`]), and child-process
//! guards ([`die_with_parent`]).

pub mod attack;
pub mod faulty;
pub mod fuzz;
pub mod inject;
pub mod net;
pub mod netns;
pub mod poll;

pub use net::{http_get, ip, local_get, sa};
pub use netns::{in_netns, ns_sh, ns_try, sh, short_name, Netns};
pub use poll::{eventually, eventually_ok, eventually_some, wait_for, wait_ok, wait_until, wait_within, within};

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
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

/// Check the commit a binary was stamped with (`--version`, `*_build_info`; build.rs): with
/// `CLUSTERIP_COMMIT` unset and the source a git checkout, it is a short hash of HEAD or of
/// one of its ancestors — HEAD when it was built; a commit made while the suite runs moves
/// HEAD on, so comparing with HEAD itself would race.
pub fn assert_commit_stamp(stamp: &str) {
    if std::env::var("CLUSTERIP_COMMIT").is_ok() {
        return;
    }
    let git = |args: &[&str]| Command::new("git").args(args).current_dir(repo_root()).output();
    if !git(&["rev-parse", "--git-dir"]).is_ok_and(|o| o.status.success()) {
        return;
    }
    assert!(stamp.len() >= 7 && stamp.bytes().all(|b| b.is_ascii_hexdigit()), "a short commit hash: {stamp:?}");
    let ancestor = git(&["merge-base", "--is-ancestor", stamp, "HEAD"]).expect("run git merge-base");
    assert!(ancestor.status.success(), "{stamp} is HEAD or one of its ancestors");
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
    let status = owned_up(&dir).status().expect("run scripts/dev-cluster.sh");
    assert!(status.success(), "scripts/dev-cluster.sh up failed ({status})");
    ControlPlane::read(&dir).expect("cluster env written by dev-cluster.sh")
}

/// `dev-cluster.sh up` for a private cluster in `dir`, owned by this test process (stopped
/// by its watchdog when the process is gone, however it ended), without a controller (tests
/// that want one start their own) and without installing packages (not from inside a test:
/// scripts/test.sh does that first; a missing tool is named instead).
fn owned_up(dir: &Path) -> Command {
    let mut cmd = Command::new(repo_root().join("scripts/dev-cluster.sh"));
    cmd.arg("up")
        .env("CLUSTERIP_CLUSTER_DIR", dir)
        .env("CLUSTERIP_CONTROLLER", "0")
        .env("CLUSTERIP_OWNER_PID", std::process::id().to_string())
        .env("CLUSTERIP_PACKAGES_ENSURED", "1");
    cmd
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
    /// stopped and removed when the value is dropped, failed test included. Without
    /// kube-controller-manager unless `env` asks for it (`("CLUSTERIP_KCM", "1")`): these
    /// tests break etcd or an apiserver, and one more process per cluster only loads the
    /// machine.
    pub fn private(tag: &str) -> ControlPlane {
        Self::private_with(tag, &[])
    }

    /// [`private`](Self::private) with `scripts/dev-cluster.sh` settings of its own, e.g.
    /// `("CLUSTERIP_APISERVER_SERVICE_CIDRS", "198.19.144.0/28")`.
    pub fn private_with(tag: &str, env: &[(&str, &str)]) -> ControlPlane {
        let dir = std::env::temp_dir().join(format!("clusterip-{tag}-{}", std::process::id()));
        let mut up = owned_up(&dir);
        up.env("CLUSTERIP_KCM", "0").envs(env.iter().copied());
        let status = up.stdout(std::process::Stdio::null()).status().expect("run scripts/dev-cluster.sh");
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
        self.start_with(component, &[]);
    }

    /// [`start`](Self::start) with `scripts/dev-cluster.sh` settings of its own, e.g.
    /// `("CLUSTERIP_APISERVER_2_ETCD_SERVERS", "http://127.0.0.1:<a proxy's port>")` for
    /// "kube-apiserver-2" (read each time it starts).
    pub fn start_with(&self, component: &str, env: &[(&str, &str)]) {
        let status = self.script().args(["start", component]).envs(env.iter().copied()).status().expect("dev-cluster.sh start");
        assert!(status.success(), "starting {component} failed");
    }

    /// The pid of a running component ("etcd", "etcd-2", "kube-apiserver-2", …), from its pid
    /// file; `None` when it has none (stopped, or not part of this cluster).
    pub fn pid(&self, component: &str) -> Option<u32> {
        std::fs::read_to_string(self.dir.join(format!("{component}.pid"))).ok()?.trim().parse().ok()
    }

    /// Send `signal` (SIGKILL, SIGSTOP, SIGCONT, …) to a running component, for fault tests
    /// that do what `stop` does not: crash it, or freeze it. The pid file names the process
    /// `scripts/dev-cluster.sh` started (`start` replaces a killed one; `down` reaps them all).
    pub fn signal(&self, component: &str, signal: libc::c_int) {
        let pid = self.pid(component).unwrap_or_else(|| panic!("{component} has no pid file in {}", self.dir.display()));
        // SAFETY: kill(2) with a pid from our own cluster's pid file.
        let rc = unsafe { libc::kill(pid as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({pid}, {signal}) for {component}: {}", std::io::Error::last_os_error());
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

    /// A value from the cluster's env file, if it has one (`CLUSTERIP_KCM_URL` only when
    /// kube-controller-manager runs).
    pub fn var_opt(&self, key: &str) -> Option<&str> {
        self.env.get(key).map(String::as_str)
    }

    /// A value from the cluster's env file (see `scripts/dev-cluster.sh`).
    pub fn var(&self, key: &str) -> &str {
        self.env.get(key).map(String::as_str).unwrap_or_else(|| panic!("{key} missing from cluster env"))
    }

    /// A kube client with cluster-admin rights.
    pub async fn client(&self) -> kube::Client {
        self.client_from(&self.kubeconfig()).await
    }

    /// A kube client with cluster-admin rights through the kubeconfig at `path` (with
    /// `CLUSTERIP_APISERVERS=2`, `var("KUBECONFIG_2")` reaches the second apiserver).
    pub async fn client_from(&self, path: &Path) -> kube::Client {
        let kubeconfig = kube::config::Kubeconfig::read_from(path).expect("read kubeconfig");
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

/// Makes the process `cmd` spawns die (SIGKILL) when its parent goes away, so nothing a test
/// starts outlives it, even when the test process is killed: `PR_SET_PDEATHSIG(SIGKILL)` is
/// set in the child between fork and exec, and the child checks `getppid()` afterwards (if
/// the parent already died in between, the child exits instead of running the program).
///
/// Caveat: the kernel sends the signal when the *thread* that spawned the child exits, not
/// the process. Spawn from a thread that outlives the child: the test's own thread (the child
/// then dies when the test function returns; fine for what the test owns), or a thread kept
/// for the purpose; not from `tokio::task::spawn_blocking` (its threads exit after being idle
/// ~10 s) nor from a short-lived helper thread, and not inside a `OnceLock` initialiser
/// shared by tests running on other threads. The signal is not sent on `exec` of the parent.
///
/// ```no_run
/// let mut cmd = std::process::Command::new("sleep");
/// let child = clusterip_test_support::die_with_parent(cmd.arg("600")).spawn().unwrap();
/// # drop(child);
/// ```
pub fn die_with_parent(cmd: &mut std::process::Command) -> &mut std::process::Command {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec the closure calls only async-signal-safe functions
    // (prctl, getppid) and allocates nothing on the success path.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl: then nobody will send the signal.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        })
    }
}

/// [`die_with_parent`] for `tokio::process::Command`. The same caveat: the signal comes when
/// the spawning thread exits. Spawning from an async task on a runtime worker thread ties the
/// child to that worker (for `#[tokio::test]`'s current-thread runtime: the test's thread), so
/// it dies at the latest when the runtime shuts down; never spawn from `spawn_blocking`.
pub fn die_with_parent_tokio(cmd: &mut tokio::process::Command) -> &mut tokio::process::Command {
    die_with_parent(cmd.as_std_mut());
    cmd
}

/// The name of a network namespace owned by this test process: `cip<pid>x<suffix>` (suffix:
/// letters and digits). `scripts/dev-cluster.sh reap` deletes `cip<pid>x*` namespaces whose
/// pid is gone, after killing the processes inside, should the test die before removing it.
pub fn netns_name(suffix: &str) -> String {
    assert!(suffix.chars().all(|c| c.is_ascii_alphanumeric()), "netns suffix {suffix:?}: letters and digits only");
    format!("cip{}x{suffix}", std::process::id())
}

/// A new scratch directory `$TMPDIR/clusterip-<tag>-<pid>-<n>` with an `owner` file naming
/// this test process (pid and start time), so that `scripts/dev-cluster.sh reap` removes it
/// once the process is gone. The test removes it itself when done (or leaves it to the reap).
pub fn owned_temp_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("clusterip-{tag}-{pid}-{}", N.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let start = proc_start_time(pid).expect("own start time");
    std::fs::write(dir.join("owner"), format!("{pid} {start}\n")).expect("write owner file");
    dir
}

/// The start time of a live process (field 22 of `/proc/<pid>/stat`, clock ticks since
/// boot); `None` when there is no such process or it is a zombie. A pid with the start time
/// it had names one process, even after the pid is reused.
pub fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 2 (comm) is in parentheses and may contain spaces: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state), fields[19] field 22 (starttime).
    if matches!(fields.first(), Some(&"Z") | Some(&"X") | Some(&"x")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Whether the process `pid` started at `start` (see [`proc_start_time`]) still runs.
pub fn process_alive(pid: u32, start: u64) -> bool {
    proc_start_time(pid) == Some(start)
}

/// Run `cleanup` to completion from a `Drop` (which cannot await): on a thread of its own
/// with a runtime of its own, waited for, so a test that fails still leaves nothing behind
/// for the next run. Errors inside are the cleanup's to ignore.
pub fn block_on_drop<F>(cleanup: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let _ = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(cleanup);
    })
    .join();
}

/// Make `ip` free in the apiserver before a test takes it statically: a Service holding it
/// that `is_leftover` recognises (an earlier run of the same test that died before cleaning
/// up) is deleted; anyone else holding it fails the test, naming the holder.
pub async fn free_leftover(client: &kube::Client, ip: &str, is_leftover: impl Fn(&k8s_openapi::api::networking::v1::ParentReference) -> bool) {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::networking::v1::IPAddress;
    use kube::api::{Api, DeleteParams};
    let (addrs, is_leftover) = (&Api::<IPAddress>::all(client.clone()), &is_leftover);
    eventually_ok(&format!("{ip} is free"), std::time::Duration::from_secs(60), std::time::Duration::from_millis(100), move || async move {
        let Some(rec) = addrs.get_opt(ip).await.expect("read IPAddress") else { return Ok(()) };
        let p = rec.spec.parent_ref;
        let ns = p.namespace.clone().unwrap_or_default();
        assert!(p.resource == "services" && is_leftover(&p), "{ip} is held by {}/{ns}/{}, not by an earlier run of this test", p.resource, p.name);
        let _ = Api::<Service>::namespaced(client.clone(), &ns).delete(&p.name, &DeleteParams::default()).await;
        Err(format!("still held after deleting the leftover {ns}/{}", p.name))
    })
    .await
}
