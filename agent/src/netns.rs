//! Running the dataplane tools (`nft`, `conntrack`, `iptables-restore`) in a network
//! namespace. With `--netns` the agent itself stays in its own namespace (where it can
//! reach the API server) and only its child processes enter the node namespace.
//!
//! Every tool is started with `PR_SET_PDEATHSIG(SIGKILL)`, so that an `nft` or `conntrack`
//! still running when the agent dies (killed, OOM) dies with it instead of outliving it.
//!
//! Every tool runs with a timeout (`--tool-timeout`, default [`DEFAULT_TOOL_TIMEOUT`]): one
//! that has not exited by then is killed (SIGKILL) and reaped, and the run fails with
//! [`ExecError::Timeout`] — a sync that needed it fails and is retried with backoff, instead
//! of a hung `nft` stopping the sync loop for good.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a tool may run before it is killed. A full `nft -f` of 50k Services took ~10 s
/// here, a listing of a 13k-Service table 4.2 s; a loaded machine is several times slower.
pub const DEFAULT_TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// Errors running a dataplane tool.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("cannot open network namespace {path}: {source}")]
    OpenNetns { path: PathBuf, source: std::io::Error },
    #[error("cannot run {program}: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("{program} failed ({status}): {stderr}")]
    Failed { program: String, status: String, stderr: String },
    #[error("{program} did not finish within {timeout:?} and was killed")]
    Timeout { program: String, timeout: Duration },
    #[error("{program} not run: an earlier run of it in this sync hung")]
    Skipped { program: String },
}

/// Make the process `cmd` starts die (SIGKILL) when its parent does: `PR_SET_PDEATHSIG` in
/// the child before `exec`, then a check that the parent is still the one that forked it
/// (had it died before the `prctl`, the signal would never come; the child exits instead).
///
/// The kernel sends the signal when the *thread* that spawned the child exits, not only
/// the process: spawn from a thread that outlives the child (the agent runs its tools from
/// the sync thread, or from the main thread for `--cleanup`, and waits for each of them).
pub fn die_with_parent(cmd: &mut Command) -> &mut Command {
    die_with_parent_by(cmd, libc::SIGKILL)
}

/// [`die_with_parent`] with another signal: SIGTERM for a child that must clean up after
/// itself (a wrapper that stops its own child and removes its cgroup).
pub fn die_with_parent_by(cmd: &mut Command, signal: libc::c_int) -> &mut Command {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl(2), getppid(2) and _exit(2) are async-signal-safe; the closure runs in
    // the forked child only and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(127);
            }
            Ok(())
        })
    }
}

/// Where to run the tools (this process's namespace, or a named one), and how long each
/// may take.
#[derive(Debug, Clone)]
pub struct Executor {
    netns: Option<Arc<File>>,
    timeout: Duration,
}

impl Default for Executor {
    fn default() -> Self {
        Executor::host()
    }
}

impl Executor {
    /// Run in the agent's own network namespace.
    pub fn host() -> Self {
        Executor { netns: None, timeout: DEFAULT_TOOL_TIMEOUT }
    }

    /// Kill a tool still running after `timeout` (at least 1 ms).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Run in a namespace given by name (`/run/netns/<name>`) or path.
    pub fn in_netns(name_or_path: &str) -> Result<Self, ExecError> {
        let path = if name_or_path.contains('/') {
            PathBuf::from(name_or_path)
        } else {
            Path::new("/run/netns").join(name_or_path)
        };
        let file = File::open(&path).map_err(|source| ExecError::OpenNetns { path, source })?;
        Ok(Executor { netns: Some(Arc::new(file)), timeout: DEFAULT_TOOL_TIMEOUT })
    }

    /// The namespace file, when not the agent's own namespace.
    pub fn netns_file(&self) -> Option<Arc<File>> {
        self.netns.clone()
    }

    /// A command that will run in the chosen namespace, and die with the agent
    /// ([`die_with_parent`]).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        die_with_parent(&mut cmd);
        if let Some(f) = &self.netns {
            let fd = f.as_raw_fd();
            // SAFETY: setns(2) is async-signal-safe; it runs in the forked child only and
            // touches no memory of the parent.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd
    }

    /// Run `program args` with `input` on stdin; error with its stderr when it fails, or
    /// when it is still running after the timeout (it is killed then).
    pub fn run(&self, program: &str, args: &[&str], input: Option<&[u8]>) -> Result<String, ExecError> {
        let mut cmd = self.command(program);
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() });
        let spawn_err = |source| ExecError::Spawn { program: program.to_string(), source };
        let mut child = cmd.spawn().map_err(spawn_err)?;
        let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
        // Feed stdin and drain stdout/stderr from threads of their own while this one waits
        // for the exit (or the deadline): a tool writing a lot before it has read all its
        // input cannot deadlock us, and a killed tool closes its pipes, which ends them all.
        let (status, out, err) = std::thread::scope(|s| {
            if let (Some(data), Some(mut stdin)) = (input, stdin) {
                s.spawn(move || {
                    // A write error shows up as the tool's failure below.
                    let _ = stdin.write_all(data);
                });
            }
            let out = s.spawn(move || read_all(stdout));
            let err = s.spawn(move || read_all(stderr));
            let status = match wait_until(&mut child, Instant::now() + self.timeout) {
                Ok(Some(status)) => Ok(status),
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    Err(ExecError::Timeout { program: program.to_string(), timeout: self.timeout })
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    Err(spawn_err(e))
                }
            };
            (status, out.join().unwrap_or_default(), err.join().unwrap_or_default())
        });
        let status = status?;
        if !status.success() {
            let mut stderr = String::from_utf8_lossy(&err).into_owned();
            if stderr.len() > 4000 {
                let mut cut = 4000;
                while !stderr.is_char_boundary(cut) {
                    cut -= 1;
                }
                stderr.truncate(cut);
                stderr.push('…');
            }
            return Err(ExecError::Failed { program: program.to_string(), status: status.to_string(), stderr });
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }
}

fn read_all(pipe: Option<impl std::io::Read>) -> Vec<u8> {
    let mut v = Vec::new();
    if let Some(mut p) = pipe {
        // A read error (the tool killed) leaves what was read.
        let _ = p.read_to_end(&mut v);
    }
    v
}

/// Wait for `child` to exit until `deadline`: its status, or None at the deadline. Sleeps in
/// `poll` on a pidfd (woken by the exit itself); without pidfds (Linux < 5.3), polls
/// `try_wait` every few milliseconds.
fn wait_until(child: &mut Child, deadline: Instant) -> std::io::Result<Option<ExitStatus>> {
    // SAFETY: pidfd_open(2) on our own child's pid; the descriptor is owned right away.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id() as libc::pid_t, 0) };
    let pidfd = (raw >= 0).then(|| {
        // SAFETY: a fresh descriptor nobody else owns.
        unsafe { OwnedFd::from_raw_fd(raw as libc::c_int) }
    });
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        match &pidfd {
            Some(fd) => {
                let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
                // SAFETY: one live pollfd. EINTR and the rest: the loop checks again.
                unsafe { libc::poll(&mut p, 1, ms) };
            }
            None => std::thread::sleep(left.min(Duration::from_millis(2))),
        }
    }
}

/// Run `f` on a short-lived thread that entered the network namespace of `netns` (setns
/// changes only the calling thread): for sockets that must be made in that namespace (they
/// stay in it whatever thread uses them later). Err when the namespace cannot be entered.
pub fn on_thread_in<T: Send>(netns: &File, f: impl FnOnce() -> T + Send) -> std::io::Result<T> {
    let fd = netns.as_raw_fd();
    std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: plain syscall on a valid descriptor; affects this thread only.
            if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("network namespace thread panicked")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn a_tool_dies_with_the_thread_that_started_it() {
        // Started from a thread that then ends without waiting: the kernel kills the child.
        // (Without the death signal, `sleep` would exit normally after 60 s.)
        let mut child = std::thread::spawn(|| {
            let mut cmd = Command::new("sleep");
            cmd.arg("60");
            die_with_parent(&mut cmd);
            cmd.spawn().expect("spawn sleep")
        })
        .join()
        .expect("spawning thread");
        let status = child.wait().expect("wait");
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }

    #[test]
    fn a_hung_tool_is_killed_at_the_timeout_and_the_run_fails() {
        // `sleep` stands for a hung nft: it reads nothing of its input and never exits by
        // itself within the test's lifetime.
        let exec = Executor::host().with_timeout(Duration::from_millis(300));
        let input = vec![b'x'; 1 << 20];
        let err = exec.run("sleep", &["3600"], Some(&input)).expect_err("must time out");
        assert!(matches!(&err, ExecError::Timeout { program, .. } if program == "sleep"), "{err}");
        // The tool was killed and reaped: no `sleep 3600` child of ours is left.
        let me = std::process::id().to_string();
        let children = std::fs::read_dir("/proc").expect("/proc").filter_map(|e| e.ok()).filter(|e| {
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let cmdline = std::fs::read_to_string(e.path().join("cmdline")).unwrap_or_default();
            let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1).map(str::to_string));
            ppid.as_deref() == Some(me.as_str()) && cmdline.starts_with("sleep\u{0}3600")
        });
        assert_eq!(children.count(), 0, "the hung tool is gone");
        // A tool that finishes in time is unaffected: output and failures as before.
        assert_eq!(exec.run("cat", &[], Some(b"hello")).expect("cat"), "hello");
        assert!(matches!(exec.run("false", &[], None), Err(ExecError::Failed { .. })));
    }

    #[test]
    fn executor_commands_die_with_the_agent() {
        let mut child = std::thread::spawn(|| Executor::host().command("sleep").arg("60").spawn().expect("spawn sleep"))
            .join()
            .expect("spawning thread");
        let status = child.wait().expect("wait");
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }
}
