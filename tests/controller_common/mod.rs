//! A `clusterip controller` process for integration tests (included with `mod
//! controller_common;`).
//!
//! The controller binds port 0 for its webhook and metrics endpoints and the test reads the
//! ports it got from its "clusterip controller started" log line: no port is picked by the
//! test, so no other process can take one between a test's choice and the controller's bind.
//! The process dies with the test (PR_SET_PDEATHSIG) and is killed when dropped.
//!
//! Every controller's webhook demands a client certificate: [`client_auth_args`] gives the
//! flags that accept the one the dev cluster's kube-apiserver presents to webhooks
//! ([`apiserver_client_cert`], through its AdmissionConfiguration, scripts/dev-cluster.sh).

#![allow(dead_code)]

pub mod admission_client;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use clusterip_test_support::poll::POLL;
use clusterip_test_support::{die_with_parent, local_get, owned_temp_dir, wait_ok, wait_within, within, ControlPlane};

/// `--client-ca-file` and `--allowed-client-names` accepting the kube-apiserver's client
/// certificate for webhooks (and nothing else).
pub fn client_auth_args(cp: &ControlPlane) -> Vec<String> {
    vec![
        "--client-ca-file".into(),
        cp.var("CLUSTERIP_WEBHOOK_CLIENT_CA").into(),
        "--allowed-client-names".into(),
        cp.var("CLUSTERIP_WEBHOOK_CLIENT_NAME").into(),
    ]
}

/// What every test controller is started with: `backend` over `ranges`, etcd records under
/// `/clusterip-test/<name>`, the leader Lease `<namespace>/<name>` with identity `identity`,
/// the dev PKI's webhook serving certificate. Tests add their own flags (client
/// authentication, timings) to it.
pub fn controller_args(cp: &ControlPlane, backend: &str, ranges: &str, name: &str, namespace: &str, identity: &str, kubeconfig: &std::path::Path) -> Vec<String> {
    let pki = cp.dir().join("pki");
    [
        "--backend",
        backend,
        "--service-cidr",
        ranges,
        "--etcd-endpoints",
        &cp.etcd_endpoints().join(","),
        "--etcd-prefix",
        &format!("/clusterip-test/{name}"),
        "--kubeconfig",
        &kubeconfig.display().to_string(),
        "--leader-elect-namespace",
        namespace,
        "--leader-elect-lease-name",
        name,
        "--leader-elect-identity",
        identity,
        "--tls-cert-file",
        &pki.join("webhook.crt").display().to_string(),
        "--tls-private-key-file",
        &pki.join("webhook.key").display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// (certificate, key) the kube-apiserver presents to webhooks: what a test posting to the
/// webhook directly presents too.
pub fn apiserver_client_cert(cp: &ControlPlane) -> (PathBuf, PathBuf) {
    let pki = cp.dir().join("pki");
    (pki.join("apiserver-webhook-client.crt"), pki.join("apiserver-webhook-client.key"))
}

/// What the controller logs once it has bound its ports.
const STARTED: &str = "clusterip controller started";

pub struct Controller {
    child: Child,
    pub webhook_port: u16,
    pub metrics_port: u16,
    /// The kubelet's probes: /healthz, /livez, /readyz.
    pub health_port: u16,
    dir: PathBuf,
}

impl Controller {
    /// `clusterip controller` with `args` (everything but the three bind addresses, which
    /// are 127.0.0.1:0), once it has bound its ports (not yet ready: see [`wait_ready`]).
    pub fn start<I, S>(args: I) -> Controller
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let dir = owned_temp_dir("controller");
        std::fs::create_dir_all(&dir).expect("controller log directory");
        let log = dir.join("controller.log");
        let file = std::fs::File::create(&log).expect("controller log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_clusterip"));
        cmd.arg("controller")
            .args(args)
            .args(["--webhook-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0", "--health-probe-bind-address", "127.0.0.1:0"])
            .env("RUST_LOG", "warn,clusterip::cli::controller=info,clusterip::controller::leader=info,clusterip_serve=debug,clusterip::store::etcd=info,clusterip::store::ipaddress::blocks=debug,clusterip::webhook::admission=debug,clusterip::repair=info")
            .env("NO_COLOR", "1")
            // Tests' controllers share the namespace `default` and keep no address history
            // unless a test asks (`--address-history-chunks`, which overrides this).
            .env("CLUSTERIP_ADDRESS_HISTORY_CHUNKS", "0")
            .stdout(Stdio::null())
            .stderr(file);
        let child = die_with_parent(&mut cmd).spawn().expect("start clusterip controller");
        let mut c = Controller { child, webhook_port: 0, metrics_port: 0, health_port: 0, dir };
        let line = wait_ok("the controller to start (its start-up line)", Duration::from_secs(180), POLL, || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| l.contains(STARTED)) {
                return Ok(line.to_string());
            }
            if let Ok(Some(status)) = c.child.try_wait() {
                panic!("the controller exited ({status}) before it started:\n{text}");
            }
            Err(format!("its log:\n{text}"))
        });
        c.webhook_port = port_of(&line, "webhook=");
        c.metrics_port = port_of(&line, "metrics=");
        c.health_port = port_of(&line, "health=");
        c
    }

    /// What the controller logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("controller.log")).unwrap_or_default()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Send a signal (e.g. `libc::SIGTERM`).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid; it is not reaped before `wait_exit`/`kill`.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(rc, 0, "kill({}, {sig}): {}", self.child.id(), std::io::Error::last_os_error());
    }

    /// The exit status once the process has exited, or None if it still runs after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        wait_within(limit, POLL, || self.child.try_wait().ok().flatten())
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Wait until GET /readyz on the health-probe port answers 200.
    pub async fn wait_ready(&self) {
        let port = self.health_port;
        let ready = within(Duration::from_secs(120), Duration::from_millis(100), move || async move { matches!(local_get(port, "/readyz").await, Some((200, _))).then_some(()) }).await;
        assert!(ready.is_some(), "controller not ready within 120s:\n{}", self.log());
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.kill();
        // A failing test shows what each of its controllers said last, and what its servers
        // decided about connections (a refusal, a close), from anywhere in the log; the whole
        // log is kept under the target directory (the controller's own directory goes).
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- the last {} lines of controller {} (pid {}) ---", tail.len(), self.dir.display(), self.child.id());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
            let decisions: Vec<&str> = log.lines().filter(|l| l.contains("clusterip_serve") && !l.contains("connection ended with an error")).take(40).collect();
            eprintln!("--- its servers' connection decisions ({} shown) ---", decisions.len());
            for line in decisions {
                eprintln!("{line}");
            }
            let kept = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("failed-controllers");
            let name = self.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "controller".into());
            if std::fs::create_dir_all(&kept).is_ok() && std::fs::write(kept.join(format!("{name}.log")), &log).is_ok() {
                eprintln!("--- the whole log: {} ---", kept.join(format!("{name}.log")).display());
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A series' value in `/metrics` text (None when the series is absent).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
}

/// The port of `key=<ip>:<port>` in a log line.
fn port_of(line: &str, key: &str) -> u16 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .and_then(|addr| addr.rsplit_once(':'))
        .and_then(|(_, port)| port.trim_matches(|c: char| !c.is_ascii_digit()).parse().ok())
        .unwrap_or_else(|| panic!("no {key} in the controller's start-up line: {line}"))
}
