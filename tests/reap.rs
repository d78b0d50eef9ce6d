//! Nothing a run starts outlives it (docs/development.md): what a killed run leaves behind
//! is removed by `scripts/dev-cluster.sh reap`, an owned cluster stops when its owner dies,
//! and `die_with_parent` children die with the thread that spawned them. Nothing whose owner
//! is alive is touched: these tests run inside the suite's own run (`scripts/test.sh`) and
//! beside other runs on the machine.
//!
//! Needs root, the cgroup v1 pids and memory hierarchies and `ip netns` (like the node
//! agent's tests); without root the tests say so and pass without checking anything.

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use clusterip_test_support::{
    control_plane, die_with_parent, die_with_parent_tokio, netns_name, owned_temp_dir, proc_start_time, process_alive,
    repo_root, wait_for, wait_until, wait_within, ControlPlane,
};

/// Tests that start clusters or whole runs take turns (2 cores; bounded load).
static HEAVY: Mutex<()> = Mutex::new(());

const PIDS_ROOT: &str = "/sys/fs/cgroup/pids";
const MEMORY_ROOT: &str = "/sys/fs/cgroup/memory";
const SIGKILL: i32 = 9;

fn heavy() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|e| e.into_inner())
}

fn is_root() -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"));
    if !root {
        eprintln!("reap tests: not root; nothing checked (scripts/test.sh runs as root)");
    }
    root
}

/// Wait for a child with a deadline.
fn wait_child(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    wait_for(what, limit, || child.try_wait().expect("try_wait"))
}

/// The identity of a live process (pid, start time).
fn ident(pid: u32) -> (u32, u64) {
    (pid, proc_start_time(pid).unwrap_or_else(|| panic!("process {pid} is not running")))
}

fn read_pid(path: &Path) -> u32 {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The cgroup v1 path of `pid` in the hierarchy of `controller` ("/..." inside it).
fn cgroup_of(controller: &str, pid: u32) -> String {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("read /proc/<pid>/cgroup");
    text.lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            ctrls.split(',').any(|c| c == controller).then(|| path.to_string())
        })
        .unwrap_or_else(|| panic!("no {controller} cgroup for {pid}"))
}

/// Every task in a cgroup directory and below.
fn cgroup_tree_procs(dir: &Path, out: &mut Vec<u32>) {
    if let Ok(text) = fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    }
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                cgroup_tree_procs(&e.path(), out);
            }
        }
    }
}

fn port_registry() -> PathBuf {
    std::env::temp_dir().join("clusterip-dev-cluster.ports")
}

fn registry_mentions(dir: &Path) -> bool {
    let text = fs::read_to_string(port_registry()).unwrap_or_default();
    text.lines().any(|l| l.split_whitespace().next() == Some(&*dir.to_string_lossy()))
}

fn netns_exists(name: &str) -> bool {
    Path::new("/run/netns").join(name).exists()
}

fn sh(args: &[&str]) {
    let out = die_with_parent(&mut Command::new(args[0])).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// `scripts/dev-cluster.sh reap`, once, bounded; its output.
fn reap() -> String {
    let mut child = die_with_parent(&mut Command::new(repo_root().join("scripts/dev-cluster.sh")))
        .arg("reap")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run dev-cluster.sh reap");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = wait_child(&mut child, Duration::from_secs(300), "dev-cluster.sh reap ends");
    let output = reader.join().unwrap();
    eprintln!("--- reap ({status}):\n{output}---");
    assert!(status.success(), "reap failed: {output}");
    output
}

/// `dev-cluster.sh up` of a cluster in `dir` owned by process `owner`.
fn up_owned(dir: &Path, owner: u32, watchdog: bool) {
    let status = die_with_parent(&mut Command::new(repo_root().join("scripts/dev-cluster.sh")))
        .arg("up")
        .env("CLUSTERIP_CLUSTER_DIR", dir)
        .env("CLUSTERIP_CONTROLLER", "0")
        .env("CLUSTERIP_OWNER_PID", owner.to_string())
        .env("CLUSTERIP_PACKAGES_ENSURED", "1")
        .env("CLUSTERIP_WATCHDOG", if watchdog { "1" } else { "0" })
        .stdout(Stdio::null())
        .status()
        .expect("run dev-cluster.sh up");
    assert!(status.success(), "dev-cluster.sh up in {} failed", dir.display());
}

fn sleeper() -> Child {
    die_with_parent(Command::new("sleep").arg("600")).stdin(Stdio::null()).spawn().expect("spawn sleep")
}

/// A pid that no process has now (a child that ran and was waited for).
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().expect("spawn true");
    let pid = c.id();
    c.wait().expect("wait true");
    assert!(proc_start_time(pid).is_none());
    pid
}

#[test]
fn die_with_parent_child_dies_with_the_spawning_thread() {
    // std: the child of a thread that has ended gets SIGKILL.
    let mut child = std::thread::spawn(sleeper).join().unwrap();
    let status = wait_child(&mut child, Duration::from_secs(30), "child of an ended thread is killed");
    assert_eq!(status.signal(), Some(SIGKILL), "{status}");

    // While the spawning thread lives, so does the child.
    let mut alive = sleeper();
    // Time is the subject: still alive 200 ms on.
    std::thread::sleep(Duration::from_millis(200));
    assert!(alive.try_wait().unwrap().is_none(), "child died while its thread lives");
    alive.kill().unwrap();
    alive.wait().unwrap();

    // tokio: spawned on a current-thread runtime's thread, gone once that thread ends.
    let pid = std::thread::spawn(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let child = die_with_parent_tokio(tokio::process::Command::new("sleep").arg("600")).spawn().unwrap();
            child.id().unwrap()
        })
    })
    .join()
    .unwrap();
    wait_until("tokio child of an ended thread is killed", Duration::from_secs(30), || proc_start_time(pid).is_none());
}

/// A cluster whose owner is SIGKILLed is stopped by its watchdog, without a reap.
#[test]
fn owned_cluster_stops_when_its_owner_is_killed() {
    if !is_root() {
        return;
    }
    let _g = heavy();
    let mut owner = sleeper();
    let dir = std::env::temp_dir().join(format!("clusterip-reapwd-{}", std::process::id()));
    up_owned(&dir, owner.id(), true);
    let procs: Vec<(u32, u64)> =
        ["etcd.pid", "kube-apiserver.pid", "watchdog.pid"].iter().map(|f| ident(read_pid(&dir.join(f)))).collect();
    assert!(registry_mentions(&dir));

    owner.kill().unwrap();
    owner.wait().unwrap();
    wait_until("the watchdog stops the cluster of a killed owner", Duration::from_secs(120), || {
        !dir.exists() && procs.iter().all(|&(p, s)| !process_alive(p, s))
    });
    assert!(!registry_mentions(&dir), "port registry still names {}", dir.display());
}

/// `reap` removes everything whose owner is gone — a cluster without a watchdog, a network
/// namespace and the processes inside, a data directory, a memory cap, a run cgroup and its
/// processes — and nothing whose owner is alive or that has no owner.
#[test]
fn reap_removes_what_dead_owners_left_and_nothing_else() {
    if !is_root() {
        return;
    }
    let _g = heavy();
    let me = std::process::id();
    let tmp = std::env::temp_dir();

    // A cluster whose owner will die, with no watchdog: only the reap stops it.
    let mut owner = sleeper();
    let cluster = tmp.join(format!("clusterip-reapdead-{me}"));
    up_owned(&cluster, owner.id(), false);
    let cluster_procs: Vec<(u32, u64)> =
        ["etcd.pid", "kube-apiserver.pid"].iter().map(|f| ident(read_pid(&cluster.join(f)))).collect();
    assert!(!cluster.join("watchdog.pid").exists());

    let dead = dead_pid();
    // A namespace of a dead process with a process inside, and one of ours.
    let dead_ns = format!("cip{dead}xreaptest");
    sh(&["ip", "netns", "add", &dead_ns]);
    let mut in_ns = die_with_parent(Command::new("ip").args(["netns", "exec", &dead_ns, "sleep", "600"])).spawn().unwrap();
    let live_ns = netns_name("reaplive");
    sh(&["ip", "netns", "add", &live_ns]);
    wait_until("sleep runs in the namespace", Duration::from_secs(30), || {
        fs::read_link(format!("/proc/{}/ns/net", in_ns.id())).ok() != fs::read_link("/proc/self/ns/net").ok()
    });

    // Data directories: a dead owner, a live one (ours), none.
    let dead_dir = tmp.join(format!("clusterip-reapdeaddir-{me}"));
    fs::create_dir_all(&dead_dir).unwrap();
    fs::write(dead_dir.join("owner"), format!("{dead} 1\n")).unwrap();
    let live_dir = owned_temp_dir("reaplive");
    let ownerless = tmp.join(format!("clusterip-reapnoowner-{me}"));
    fs::create_dir_all(&ownerless).unwrap();

    // A memory cap and a run cgroup of the dead process, each with a process in it.
    let cap = PathBuf::from(format!("{MEMORY_ROOT}{}", cgroup_of("memory", me).trim_end_matches('/')))
        .join(format!("clusterip-cap-{dead}-1"));
    fs::create_dir(&cap).unwrap();
    let mut capped = sleeper();
    fs::write(cap.join("cgroup.procs"), capped.id().to_string()).unwrap();
    let mine = cgroup_of("pids", me);
    let mine = mine.trim_end_matches('/');
    let run_parent = if mine.contains("/clusterip/") && mine.rsplit('/').next().unwrap().starts_with("run-") {
        PathBuf::from(format!("{PIDS_ROOT}{mine}"))
    } else {
        PathBuf::from(format!("{PIDS_ROOT}{mine}/clusterip"))
    };
    fs::create_dir_all(&run_parent).unwrap();
    let run = run_parent.join(format!("run-{dead}-1"));
    fs::create_dir(&run).unwrap();
    let mut in_run = sleeper();
    fs::write(run.join("cgroup.procs"), in_run.id().to_string()).unwrap();

    owner.kill().unwrap();
    owner.wait().unwrap();
    reap();

    // Gone: everything of the dead owners.
    assert!(!cluster.exists(), "cluster dir {} left", cluster.display());
    for &(p, s) in &cluster_procs {
        assert!(!process_alive(p, s), "cluster process {p} left");
    }
    assert!(!registry_mentions(&cluster), "port registry still names {}", cluster.display());
    assert!(!netns_exists(&dead_ns), "netns {dead_ns} left");
    assert_eq!(wait_child(&mut in_ns, Duration::from_secs(10), "process in the netns killed").signal(), Some(SIGKILL));
    assert!(!dead_dir.exists(), "{} left", dead_dir.display());
    assert!(!cap.exists(), "{} left", cap.display());
    assert_eq!(wait_child(&mut capped, Duration::from_secs(10), "process in the cap killed").signal(), Some(SIGKILL));
    assert!(!run.exists(), "{} left", run.display());
    assert_eq!(wait_child(&mut in_run, Duration::from_secs(10), "process in the run killed").signal(), Some(SIGKILL));

    // Kept: what has a live owner or none.
    assert!(netns_exists(&live_ns), "netns {live_ns} of a live process removed");
    assert!(live_dir.exists(), "{} of a live process removed", live_dir.display());
    assert!(ownerless.exists(), "{} without an owner removed", ownerless.display());
    assert!(Path::new(&format!("{PIDS_ROOT}{mine}")).exists());

    sh(&["ip", "netns", "delete", &live_ns]);
    fs::remove_dir_all(&live_dir).unwrap();
    fs::remove_dir_all(&ownerless).unwrap();
}

/// `scripts/test.sh` SIGKILLed part-way (as the OOM killer would: that one pid), once its
/// cluster is up and a test binary runs; then one `reap` leaves no process, network
/// namespace, cgroup, data directory or cluster of that run.
#[test]
fn sigkilled_test_run_is_reaped() {
    if !is_root() {
        return;
    }
    let _g = heavy();
    let work = owned_temp_dir("reaptest");
    let ready = work.join("victim.ready");
    let log_path = work.join("inner-run.log");
    let log = fs::File::create(&log_path).unwrap();
    let mut inner = die_with_parent(&mut Command::new(repo_root().join("scripts/test.sh")))
        .args(["--test", "reap", "--", "--ignored", "--exact", "victim_of_reap_test", "--nocapture"])
        .env("CLUSTERIP_REAP_VICTIM_READY", &ready)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start scripts/test.sh");
    let inner_pid = inner.id();
    let log_tail = || {
        let text = fs::read_to_string(&log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    };

    // Compiling (only the reap test; more when sources changed), the run's cluster and the
    // victim's setup: generous, as a deadline only.
    let victim_ready = wait_within(Duration::from_secs(1800), Duration::from_millis(200), || {
        if ready.exists() {
            return Some(());
        }
        if let Some(status) = inner.try_wait().unwrap() {
            panic!("inner scripts/test.sh ended ({status}) before the victim was ready:\n{}", log_tail());
        }
        None
    });
    assert!(victim_ready.is_some(), "victim not ready in 30 min:\n{}", log_tail());
    let info: std::collections::HashMap<String, String> = fs::read_to_string(&ready)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
    let get = |k: &str| info.get(k).unwrap_or_else(|| panic!("{k} missing from {}", ready.display())).clone();

    // What the run has now: its cgroup (and every process in it), clusters, namespace, dirs.
    let cgroup = PathBuf::from(format!("{PIDS_ROOT}{}", cgroup_of("pids", inner_pid)));
    let cg_name = cgroup.file_name().unwrap().to_string_lossy().into_owned();
    assert!(cg_name.starts_with(&format!("run-{inner_pid}-")), "test.sh is in {}", cgroup.display());
    let mut pids = Vec::new();
    cgroup_tree_procs(&cgroup, &mut pids);
    let procs: Vec<(u32, u64)> = pids.iter().filter_map(|&p| Some((p, proc_start_time(p)?))).collect();
    let victim: u32 = get("pid").parse().unwrap();
    for p in [victim, get("orphan").parse().unwrap(), get("netns_pid").parse().unwrap()] {
        assert!(pids.contains(&p), "process {p} of the run is not in its cgroup {}", cgroup.display());
    }
    let clusters: Vec<PathBuf> = [get("cluster"), get("private_cluster")].iter().map(PathBuf::from).collect();
    for c in &clusters {
        for f in ["etcd.pid", "kube-apiserver.pid"] {
            assert!(pids.contains(&read_pid(&c.join(f))), "{}/{f} is not in the run's cgroup", c.display());
        }
    }
    let (netns, data_dir, cap) = (get("netns"), PathBuf::from(get("dir")), PathBuf::from(get("cap")));
    assert!(netns_exists(&netns) && data_dir.exists() && cap.exists());
    eprintln!("reap test: run {cg_name}: {} processes; killing scripts/test.sh ({inner_pid})", procs.len());

    inner.kill().unwrap(); // SIGKILL, that pid only
    let status = inner.wait().unwrap();
    assert_eq!(status.signal(), Some(SIGKILL));

    reap();

    assert!(!cgroup.exists(), "cgroup {} left", cgroup.display());
    let left: Vec<u32> = procs.iter().filter(|&&(p, s)| process_alive(p, s)).map(|&(p, _)| p).collect();
    assert!(left.is_empty(), "processes of the run left: {left:?}");
    assert!(!netns_exists(&netns), "netns {netns} left");
    assert!(!data_dir.exists(), "{} left", data_dir.display());
    assert!(!cap.exists(), "memory cgroup {} left", cap.display());
    for c in &clusters {
        assert!(!c.exists(), "cluster {} left", c.display());
        assert!(!registry_mentions(c), "port registry still names {}", c.display());
    }
    // Ours (a live owner) is still there.
    assert!(work.exists());
    fs::remove_dir_all(&work).unwrap();
}

/// Run by `sigkilled_test_run_is_reaped` inside a `scripts/test.sh` that it then kills:
/// sets up one of each kind of thing a run leaves behind, says so, and waits to be killed.
/// Does nothing unless CLUSTERIP_REAP_VICTIM_READY names the file to write.
#[test]
#[ignore = "run by sigkilled_test_run_is_reaped"]
#[allow(clippy::zombie_processes)] // (left running on purpose: the reap is what ends them)
fn victim_of_reap_test() {
    let Ok(ready) = std::env::var("CLUSTERIP_REAP_VICTIM_READY") else {
        eprintln!("victim_of_reap_test: CLUSTERIP_REAP_VICTIM_READY unset; nothing to do");
        return;
    };
    let me = std::process::id();
    // The run's cluster (scripts/test.sh's), and a private one owned by this process.
    let cluster = control_plane();
    let private = ControlPlane::private("reapvictim");
    // A network namespace with a process inside that left the process tree (setsid).
    let netns = netns_name("victim");
    sh(&["ip", "netns", "add", &netns]);
    let netns_child = Command::new("setsid").args(["ip", "netns", "exec", &netns, "sleep", "3600"]).spawn().unwrap();
    // An orphan that escaped the session, and a child that dies with this process anyway.
    let orphan = Command::new("setsid").args(["sleep", "3600"]).stdin(Stdio::null()).spawn().unwrap();
    let _child = sleeper();
    // A data directory and a memory cap (run-capped.sh, with a process under it).
    let dir = owned_temp_dir("reapvictim");
    let cap_file = dir.join("cap");
    let _capped = Command::new(repo_root().join("scripts/lib/run-capped.sh"))
        .args(["256", "--", "sh", "-c", "echo \"$CLUSTERIP_CAP_CGROUP\" > \"$0.tmp\" && mv \"$0.tmp\" \"$0\"; exec sleep 3600"])
        .arg(&cap_file)
        .spawn()
        .unwrap();
    wait_until("run-capped.sh started", Duration::from_secs(60), || cap_file.exists());
    let cap = fs::read_to_string(&cap_file).unwrap();
    wait_until("the setsid'd processes have exec'd", Duration::from_secs(30), || {
        fs::read_link(format!("/proc/{}/ns/net", netns_child.id())).ok() != fs::read_link("/proc/self/ns/net").ok()
    });

    let text = format!(
        "pid={me}\ncluster={}\nprivate_cluster={}\nnetns={netns}\nnetns_pid={}\norphan={}\ndir={}\ncap={}\n",
        cluster.dir().display(),
        private.dir().display(),
        netns_child.id(),
        orphan.id(),
        dir.display(),
        cap.trim()
    );
    fs::write(format!("{ready}.tmp"), text).unwrap();
    fs::rename(format!("{ready}.tmp"), &ready).unwrap();
    // Killed from outside long before this ends (time is the subject: it waits to be killed).
    std::thread::sleep(Duration::from_secs(900));
    panic!("victim_of_reap_test: not killed within 15 min");
}
