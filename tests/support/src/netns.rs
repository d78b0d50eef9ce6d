//! Network namespaces for tests, and the short commands that set them up. A namespace is
//! named by [`netns_name`](crate::netns_name) (`cip<pid>x<seq><tag>`: `scripts/dev-cluster.sh
//! reap` deletes those whose process is gone) and deleted when its [`Netns`] is dropped.
//!
//! Setup commands (`ip`, `nft`, `sysctl`) end on their own and are spawned plainly:
//! `posix_spawn` rather than `fork` + `pre_exec`, which keeps short the window in which a
//! child still holds copies of the test's sockets (until its `exec`). Long-running
//! processes go through [`die_with_parent`](crate::die_with_parent).

use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A short name unique in this run, `{prefix}{pid}x{seq}`, for names with a length limit
/// (interface and proxy names, label values). [`unique_name`](crate::unique_name) is the
/// readable one for API objects.
pub fn short_name(prefix: &str) -> String {
    format!("{prefix}{}x{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed))
}

/// Run a command; panic with its output if it fails (test setup only).
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(out.status.success(), "{args:?} failed: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run a command in a namespace (`ip netns exec`).
pub fn ns_sh(ns: &str, args: &[&str]) -> String {
    let mut v = vec!["ip", "netns", "exec", ns];
    v.extend_from_slice(args);
    sh(&v)
}

/// Like [`ns_sh`], returning None on failure.
pub fn ns_try(ns: &str, args: &[&str]) -> Option<String> {
    let out = Command::new("ip").args(["netns", "exec", ns]).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A network namespace of this test process, with its loopback up; deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// A new namespace `cip<pid>x<seq><tag>` (tag: letters and digits).
    pub fn new(tag: &str) -> Netns {
        let name = crate::netns_name(&format!("{}{tag}", SEQ.fetch_add(1, Ordering::Relaxed)));
        sh(&["ip", "netns", "add", &name]);
        let ns = Netns { name };
        ns_sh(&ns.name, &["ip", "link", "set", "lo", "up"]);
        ns
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// Run `f` on a thread that entered namespace `ns` (sockets made there stay there).
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::scope(|s| {
        s.spawn(|| {
            let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            // SAFETY: setns on this thread only, with a valid namespace fd.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap_or_else(|_| panic!("thread in {ns} panicked"))
    })
}
