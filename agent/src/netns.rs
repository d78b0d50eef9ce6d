//! Running the dataplane tools (`nft`, `conntrack`, `iptables-restore`) in a network
//! namespace. With `--netns` the agent itself stays in its own namespace (where it can
//! reach the API server) and only its child processes enter the node namespace.
//!
//! Every tool is started with `PR_SET_PDEATHSIG(SIGKILL)`, so that an `nft` or `conntrack`
//! still running when the agent dies (killed, OOM) dies with it instead of outliving it.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

/// Errors running a dataplane tool.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("cannot open network namespace {path}: {source}")]
    OpenNetns { path: PathBuf, source: std::io::Error },
    #[error("cannot run {program}: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("{program} failed ({status}): {stderr}")]
    Failed { program: String, status: String, stderr: String },
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

/// Where to run the tools: this process's namespace, or a named one.
#[derive(Debug, Clone, Default)]
pub struct Executor {
    netns: Option<Arc<File>>,
}

impl Executor {
    /// Run in the agent's own network namespace.
    pub fn host() -> Self {
        Executor { netns: None }
    }

    /// Run in a namespace given by name (`/run/netns/<name>`) or path.
    pub fn in_netns(name_or_path: &str) -> Result<Self, ExecError> {
        let path = if name_or_path.contains('/') {
            PathBuf::from(name_or_path)
        } else {
            Path::new("/run/netns").join(name_or_path)
        };
        let file = File::open(&path).map_err(|source| ExecError::OpenNetns { path, source })?;
        Ok(Executor { netns: Some(Arc::new(file)) })
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

    /// Run `program args` with `input` on stdin; error with its stderr when it fails.
    pub fn run(&self, program: &str, args: &[&str], input: Option<&[u8]>) -> Result<String, ExecError> {
        let mut cmd = self.command(program);
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() });
        let spawn_err = |source| ExecError::Spawn { program: program.to_string(), source };
        let mut child = cmd.spawn().map_err(spawn_err)?;
        let stdin = child.stdin.take();
        // Feed stdin from another thread while this one drains stdout/stderr, so that a tool
        // writing a lot of output before it has read all its input cannot deadlock us.
        let out = std::thread::scope(|s| {
            if let (Some(data), Some(mut stdin)) = (input, stdin) {
                s.spawn(move || {
                    // A write error shows up as the tool's failure below.
                    let _ = stdin.write_all(data);
                });
            }
            child.wait_with_output()
        })
        .map_err(spawn_err)?;
        if !out.status.success() {
            let mut stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            if stderr.len() > 4000 {
                let mut cut = 4000;
                while !stderr.is_char_boundary(cut) {
                    cut -= 1;
                }
                stderr.truncate(cut);
                stderr.push('…');
            }
            return Err(ExecError::Failed { program: program.to_string(), status: out.status.to_string(), stderr });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
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
    fn executor_commands_die_with_the_agent() {
        let mut child = std::thread::spawn(|| Executor::host().command("sleep").arg("60").spawn().expect("spawn sleep"))
            .join()
            .expect("spawning thread");
        let status = child.wait().expect("wait");
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }
}
