//! The churn soak: Service create/update/delete churn at a steady rate through the webhook,
//! for each backend in turn (etcd, then ipaddress), with the node agent programming the VIPs
//! into a network namespace; invariants checked all along; the resident memory of every
//! component sampled. Ignored (it runs for minutes, as root): `scripts/soak.sh [MINUTES]` runs
//! it, after installing what it needs (nftables, iproute2) and building the agent; by hand,
//! as root: `cargo build -p clusterip-agent && SOAK_MINUTES=2 cargo test --test soak --
//! --ignored --nocapture`.
//!
//! Per backend: a private control plane (`scripts/dev-cluster.sh up` through
//! [`ControlPlane::private_with`]: etcd, kube-apiserver, kube-controller-manager, and the
//! clusterip controller of this build with its webhooks registered, backend
//! `CLUSTERIP_BACKEND`), the agent (`clusterip-agent --netns`) programming a node namespace, a
//! client namespace routed through it, and a backend namespace with a TCP responder (all in
//! 198.18.70.0/23). Four probe Services (selectorless, an EndpointSlice to the responder) stay
//! all along; churned Services get no endpoints. The churn: `SOAK_RATE` operations per second
//! (default 10) over a working set of up to `SOAK_SERVICES` Services (default 200): creates
//! (every 5th PreferDualStack), deletes, label updates, ClusterIP → ExternalName and back.
//!
//! Every `SOAK_CHECK_S` seconds (default 30), and once after the churn:
//! - unique addresses: no address on two Services (one list of all Services);
//! - every Service's address recorded: an IPAddress named by it whose parentRef is that
//!   Service (a miss is read again, Service and IPAddress, before it counts), and `clusterip
//!   repair -o json` (dry run) reports no missing-record, wrong-reference or duplicate;
//! - the probe VIPs answer from the client namespace (connect + the responder's reply);
//! - the resident memory (VmRSS, and RssAnon: etcd's VmRSS includes its mapped database file)
//!   of etcd, kube-apiserver, the controller and the agent, every 10 s.
//!
//! After the churn: `clusterip repair --fix` (etcd: `--release-leaks-now`), then a dry run must
//! find the records consistent (exit 0) within 120 s: no leak after repair. Prints the RESULT
//! lines (`RESULT soak …`, `RESULT soak_rss …` per component) and fails on any violation or
//! failed operation. A part that cannot work fails the run at once, with the reason: a tool
//! missing, the agent's first sync failing, a probe VIP not answering, a component dying.
//!
//! Env: `SOAK_MINUTES` (default 10), `SOAK_BACKENDS` (default "etcd ipaddress"), `SOAK_RATE`,
//! `SOAK_SERVICES`, `SOAK_CHECK_S`, `SOAK_LOG_DIR` (default target/soak/<time>-<pid>),
//! `CLUSTERIP_AGENT_BIN` (default: the `clusterip-agent` beside this build's `clusterip`).
//! Nothing outlives it: the control planes are owned by the test process (their watchdog
//! stops them), the namespaces are `cip<pid>x…` ([`Netns`]), the agent dies with the test.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use clusterip_test_support::{die_with_parent, die_with_parent_tokio, in_netns, ns_sh, ns_try, proc_start_time, process_alive, repo_root, sh, wait_within, within, ControlPlane, Netns};
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::{IPAddress, ParentReference};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The Kubernetes namespace of the probe and churned Services.
const NS: &str = "soak";
/// The responder's address in the backend namespace, and its port (the probes' targetPort).
const BACKEND_IP: &str = "198.18.71.2";
const RESPONDER_PORT: u16 = 8080;
/// The components whose memory is sampled and whose death fails the run, in RESULT order.
const COMPONENTS: [&str; 4] = ["etcd", "kube-apiserver", "clusterip-controller", "agent"];
/// How long the agent may take for its first sync, and to program a probe Service.
const SYNC: Duration = Duration::from_secs(60);

/// The soak's settings, from the environment.
struct Settings {
    minutes: u64,
    backends: Vec<String>,
    rate: u32,
    services: usize,
    check_every: Duration,
    logs: PathBuf,
}

impl Settings {
    fn from_env() -> Settings {
        fn whole<T: FromStr + PartialOrd + From<u8>>(key: &str, default: T) -> T {
            match std::env::var(key) {
                Err(_) => default,
                Ok(v) => v.parse().ok().filter(|n| *n >= T::from(1)).unwrap_or_else(|| panic!("soak: {key}={v:?}: a whole number ≥ 1")),
            }
        }
        let backends: Vec<String> = std::env::var("SOAK_BACKENDS").unwrap_or_else(|_| "etcd ipaddress".into()).split_whitespace().map(str::to_string).collect();
        for b in &backends {
            assert!(b == "etcd" || b == "ipaddress", "soak: SOAK_BACKENDS: {b:?} is not a backend (etcd, ipaddress)");
        }
        let logs = std::env::var_os("SOAK_LOG_DIR").map(PathBuf::from).unwrap_or_else(|| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
            repo_root().join("target/soak").join(format!("{now}-{}", std::process::id()))
        });
        std::fs::create_dir_all(&logs).unwrap_or_else(|e| panic!("soak: create {}: {e}", logs.display()));
        Settings {
            minutes: whole("SOAK_MINUTES", 10u64),
            backends,
            rate: whole("SOAK_RATE", 10u32),
            services: whole::<u32>("SOAK_SERVICES", 200) as usize,
            check_every: Duration::from_secs(whole("SOAK_CHECK_S", 30u64)),
            logs,
        }
    }
}

fn say(what: &str) {
    eprintln!("soak: {what}");
}

/// Append a line to a log file of the run.
fn append(path: &Path, line: &str) {
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap_or_else(|e| panic!("soak: open {}: {e}", path.display()));
    writeln!(f, "{line}").unwrap_or_else(|e| panic!("soak: write {}: {e}", path.display()));
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The invariants broken in one backend's run, each also a line of `<logs>/violations`.
struct Violations {
    found: Vec<String>,
    file: PathBuf,
}

impl Violations {
    fn add(&mut self, what: String) {
        say(&format!("VIOLATION: {what}"));
        append(&self.file, &what);
        self.found.push(what);
    }
}

/// What the soak needs of the machine, checked before anything starts: root (network
/// namespaces), `ip`, and `nft`, through which the agent programs the node.
fn preflight() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "soak: must run as root (network namespaces)");
    for (tool, arg, package) in [("ip", "-V", "iproute2"), ("nft", "--version", "nftables")] {
        let ok = Command::new(tool).arg(arg).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        assert!(ok, "soak: `{tool}` is missing: install {package} (scripts/soak.sh does: scripts/lib/ensure-packages.sh); the agent cannot program the node without it");
    }
    let agent = std::env::var_os("CLUSTERIP_AGENT_BIN")
        .filter(|b| !b.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_BIN_EXE_clusterip")).with_file_name("clusterip-agent"));
    assert!(agent.is_file(), "soak: no agent binary at {}: build it first (cargo build -p clusterip-agent, with --release for a release test build), or run scripts/soak.sh, which does", agent.display());
    agent
}

/// The node namespace (where the agent programs the rules), a client namespace routed
/// through it, and the backend namespace whose responder the probe Services' EndpointSlice
/// names; all deleted on drop.
struct Namespaces {
    node: Netns,
    client: Netns,
    backend: Netns,
}

impl Namespaces {
    fn new() -> Namespaces {
        let (node, client, backend) = (Netns::new("node"), Netns::new("client"), Netns::new("backend"));
        let (n, c, b) = (node.name.as_str(), client.name.as_str(), backend.name.as_str());
        ns_sh(n, &["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        sh(&["ip", "-n", n, "link", "add", "c0", "type", "veth", "peer", "name", "eth0", "netns", c]);
        ns_sh(n, &["ip", "addr", "add", "198.18.70.1/24", "dev", "c0"]);
        ns_sh(n, &["ip", "link", "set", "c0", "up"]);
        ns_sh(c, &["ip", "addr", "add", "198.18.70.2/24", "dev", "eth0"]);
        ns_sh(c, &["ip", "link", "set", "eth0", "up"]);
        ns_sh(c, &["ip", "route", "add", "default", "via", "198.18.70.1"]);
        sh(&["ip", "-n", n, "link", "add", "b0", "type", "veth", "peer", "name", "eth0", "netns", b]);
        ns_sh(n, &["ip", "addr", "add", "198.18.71.1/24", "dev", "b0"]);
        ns_sh(n, &["ip", "link", "set", "b0", "up"]);
        ns_sh(b, &["ip", "addr", "add", &format!("{BACKEND_IP}/24"), "dev", "eth0"]);
        ns_sh(b, &["ip", "link", "set", "eth0", "up"]);
        ns_sh(b, &["ip", "route", "add", "default", "via", "198.18.71.1"]);
        // VIPs are routed towards the backends, as on a node (the agent's rules DNAT them).
        ns_sh(n, &["ip", "route", "add", "198.19.0.0/16", "dev", "b0"]);
        Namespaces { node, client, backend }
    }
}

/// The backend the probe Services' EndpointSlices name: a TCP listener in the backend
/// namespace that answers every connection with "soak" and closes it. Stopped on drop.
struct Responder(tokio::task::JoinHandle<()>);

impl Responder {
    fn start(ns: &str) -> Responder {
        let listener = in_netns(ns, || {
            let l = std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, RESPONDER_PORT))?;
            l.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(l)
        })
        .unwrap_or_else(|e| panic!("soak: responder listening on :{RESPONDER_PORT} in {ns}: {e}"));
        let listener = tokio::net::TcpListener::from_std(listener).expect("soak: the responder's listener on the runtime");
        Responder(tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((mut conn, _)) => {
                        let _ = conn.write_all(b"soak\n").await;
                    }
                    Err(e) => say(&format!("responder: accept: {e}")),
                }
            }
        }))
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Whether the responder answers through `vip`:80 from namespace `ns`: connect, and its
/// reply within 5 s. The socket is made in `ns` and used on this runtime.
async fn probe(ns: &str, vip: IpAddr) -> Result<(), String> {
    let socket = in_netns(ns, || if vip.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }).map_err(|e| format!("socket: {e}"))?;
    let answer = tokio::time::timeout(Duration::from_secs(5), async {
        let mut conn = socket.connect(SocketAddr::new(vip, 80)).await?;
        let mut buf = Vec::new();
        conn.read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    })
    .await;
    match answer {
        Err(_) => Err("no answer within 5 s".into()),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(buf)) if buf.starts_with(b"soak") => Ok(()),
        Ok(Ok(buf)) => Err(format!("answered {:?}", String::from_utf8_lossy(&buf))),
    }
}

/// The node agent (`clusterip-agent --netns`) programming the node namespace, its log in
/// the run's log directory; stopped on drop (TERM; KILL after 30 s). Spawned from the test's
/// thread with PDEATHSIG: a killed test kills it.
struct Agent {
    child: Child,
    start: u64,
    log: PathBuf,
}

impl Agent {
    fn start(bin: &Path, node_ns: &str, kubeconfig: &Path, log: PathBuf) -> Agent {
        let file = std::fs::File::create(&log).unwrap_or_else(|e| panic!("soak: create {}: {e}", log.display()));
        let mut cmd = Command::new(bin);
        die_with_parent(&mut cmd)
            .args(["--netns", node_ns, "--node-name", "soak-node", "--healthz-bind-address", "", "--metrics-bind-address", "", "--min-sync-period", "100ms"])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("soak: the agent's log file"))
            .stderr(file);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("soak: start {}: {e}", bin.display()));
        let start = proc_start_time(child.id()).unwrap_or_else(|| panic!("soak: the agent (pid {}) exited at once; its log:\n{}", child.id(), std::fs::read_to_string(&log).unwrap_or_default()));
        Agent { child, start, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Why the agent cannot program the node, if it cannot: it exited, or a sync failed
    /// (nft missing, a kernel without nf_tables, …).
    fn trouble(&self) -> Option<String> {
        let log = self.log();
        if !process_alive(self.child.id(), self.start) {
            return Some(format!("the agent exited; its log ends:\n{}", tail(&log, 20)));
        }
        log.lines().find(|l| l.contains("sync failed")).map(|l| format!("a sync failed: {l}"))
    }

    /// Wait for the agent's first sync ("sync done"); fail at once, with the reason, when it
    /// cannot sync.
    async fn first_sync(&self) {
        let outcome = within(SYNC, Duration::from_millis(100), move || async move {
            match self.trouble() {
                Some(why) => Some(Err(why)),
                None => self.log().contains("sync done").then_some(Ok(())),
            }
        })
        .await;
        match outcome {
            Some(Ok(())) => {}
            Some(Err(why)) => panic!("soak: the agent cannot program the node: {why}"),
            None => panic!("soak: the agent did not finish a sync within {SYNC:?}; its log ends:\n{}", tail(&self.log(), 20)),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        if wait_within(Duration::from_secs(30), Duration::from_millis(20), || self.child.try_wait().ok().flatten()).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A process of the run, by pid and start time (a reused pid is not it).
struct Process {
    name: &'static str,
    pid: u32,
    start: u64,
}

impl Process {
    fn of(name: &'static str, pid: u32) -> Process {
        let start = proc_start_time(pid).unwrap_or_else(|| panic!("soak: {name} (pid {pid}) is not running"));
        Process { name, pid, start }
    }

    /// VmRSS and, of it, RssAnon (KiB); 0 when gone. etcd's RSS also counts the pages of
    /// its database file it has mapped (RssFile), which grow with the history it keeps
    /// until compaction.
    fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        let field = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok()).unwrap_or(0);
        (field("VmRSS:"), field("RssAnon:"))
    }
}

/// The cluster's component logs, copied into the run's log directory on drop (before the
/// cluster's directory goes with it), however the run ends.
struct KeepLogs {
    from: PathBuf,
    to: PathBuf,
    backend: String,
}

impl Drop for KeepLogs {
    fn drop(&mut self) {
        for c in ["etcd", "kube-apiserver", "clusterip-controller"] {
            let _ = std::fs::copy(self.from.join(format!("{c}.log")), self.to.join(format!("{}.{c}.log", self.backend)));
        }
    }
}

/// The churned Services: the working set, and of each whether it is of type ClusterIP now
/// (or ExternalName); operations done and failed.
struct Churn {
    names: Vec<String>,
    cluster_ip: HashMap<String, bool>,
    seq: u64,
    ops: u64,
    errors: u64,
    rng: SmallRng,
}

impl Churn {
    /// One create, delete, label update or type change; failures go to `errors_log`.
    async fn op(&mut self, api: &Api<Service>, target: usize, errors_log: &Path, t0: Instant) {
        let n = self.names.len();
        let mut r = if n < target / 2 || n == 0 { 0 } else { self.rng.gen_range(0..100) };
        if n >= target && r < 35 {
            r = 40;
        }
        let (what, name, result) = if r < 35 {
            self.seq += 1;
            let name = format!("s{}", self.seq);
            let mut spec = json!({"ports": [{"port": 80}]});
            if self.seq.is_multiple_of(5) {
                spec["ipFamilyPolicy"] = "PreferDualStack".into();
            }
            let svc: Service = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).expect("a Service");
            let result = api.create(&PostParams::default(), &svc).await.map(drop);
            if result.is_ok() {
                self.names.push(name.clone());
                self.cluster_ip.insert(name.clone(), true);
            }
            ("create", name, result)
        } else {
            let i = self.rng.gen_range(0..n);
            let name = self.names[i].clone();
            if r < 65 {
                let result = api.delete(&name, &DeleteParams::default()).await.map(drop);
                if result.is_ok() {
                    self.names.swap_remove(i);
                    self.cluster_ip.remove(&name);
                }
                ("delete", name, result)
            } else if r < 82 {
                let result = merge(api, &name, json!({"metadata": {"labels": {"soak": self.seq.to_string()}}})).await;
                ("update-label", name, result)
            } else if self.cluster_ip.get(&name).copied().unwrap_or(true) {
                let result = merge(api, &name, json!({"spec": {"type": "ExternalName", "externalName": "soak.example"}})).await;
                if result.is_ok() {
                    self.cluster_ip.insert(name.clone(), false);
                }
                ("to-externalname", name, result)
            } else {
                let result = merge(api, &name, json!({"spec": {"type": "ClusterIP", "externalName": null}})).await;
                if result.is_ok() {
                    self.cluster_ip.insert(name.clone(), true);
                }
                ("to-clusterip", name, result)
            }
        };
        self.ops += 1;
        if let Err(e) = result {
            self.errors += 1;
            let code = match &e {
                kube::Error::Api(s) => format!("{:03}", s.code),
                _ => "000".into(),
            };
            append(errors_log, &format!("{} {what} {name} HTTP {code}: {e}", t0.elapsed().as_secs()));
        }
    }
}

/// A JSON merge patch of Service `name`.
async fn merge(api: &Api<Service>, name: &str, patch: Value) -> kube::Result<()> {
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map(drop)
}

/// The addresses of a Service (`spec.clusterIPs`, without "None").
fn addresses(svc: &Service) -> Vec<String> {
    svc.spec.as_ref().and_then(|s| s.cluster_ips.clone()).unwrap_or_default().into_iter().filter(|ip| ip != "None").collect()
}

/// Whether an IPAddress's parentRef names the Service `ns/name`.
fn names_service(p: &ParentReference, ns: &str, name: &str) -> bool {
    p.resource == "services" && p.namespace.as_deref() == Some(ns) && p.name == name
}

/// One backend's run: its cluster, its checks, its log files.
struct Phase<'a> {
    backend: &'a str,
    client: kube::Client,
    cp: &'a ControlPlane,
    logs: &'a Path,
    client_ns: &'a str,
    probes: Vec<IpAddr>,
    violations: Violations,
}

impl Phase<'_> {
    fn file(&self, what: &str) -> PathBuf {
        self.logs.join(format!("{}.{what}", self.backend))
    }

    /// `clusterip repair` against this backend's records, with `extra` flags: exit code,
    /// stdout and stderr.
    async fn repair(&self, extra: &[&str]) -> (i32, String, String) {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_clusterip"));
        cmd.args(["repair", "--backend", self.backend, "--service-cidr", self.cp.var("CLUSTERIP_SERVICE_CIDRS")]).arg("--kubeconfig").arg(self.cp.kubeconfig());
        if self.backend == "etcd" {
            cmd.args(["--etcd-endpoints", &self.cp.etcd_endpoints().join(",")]);
        }
        let out = die_with_parent_tokio(cmd.args(extra).kill_on_drop(true)).output().await.expect("soak: run clusterip repair");
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// The invariants, once; whether the check ran through (a check cut short by a failed
    /// read counts as a violation, not as a check).
    async fn check(&mut self) -> bool {
        let services = match Api::<Service>::all(self.client.clone()).list(&ListParams::default()).await {
            Ok(l) => l.items,
            Err(e) => {
                self.violations.add(format!("listing Services: {e}"));
                return false;
            }
        };
        let records = match Api::<IPAddress>::all(self.client.clone()).list(&ListParams::default()).await {
            Ok(l) => l.items,
            Err(e) => {
                self.violations.add(format!("listing IPAddresses: {e}"));
                return false;
            }
        };
        // No address on two Services.
        let mut holders: BTreeMap<String, usize> = BTreeMap::new();
        for ip in services.iter().flat_map(addresses) {
            *holders.entry(ip).or_default() += 1;
        }
        let dup: Vec<&str> = holders.iter().filter(|(_, n)| **n > 1).map(|(ip, _)| ip.as_str()).collect();
        if !dup.is_empty() {
            self.violations.add(format!("addresses on two Services: {}", dup.join(" ")));
        }
        // Every address recorded by an IPAddress naming its Service (a miss read again).
        let by_name: HashMap<&str, &ParentReference> = records.iter().filter_map(|r| Some((r.metadata.name.as_deref()?, &r.spec.parent_ref))).collect();
        let mut misses = Vec::new();
        for svc in &services {
            let (ns, name) = (svc.metadata.namespace.clone().unwrap_or_default(), svc.metadata.name.clone().unwrap_or_default());
            for ip in addresses(svc) {
                if !by_name.get(ip.as_str()).is_some_and(|p| names_service(p, &ns, &name)) {
                    misses.push((ns.clone(), name.clone(), ip));
                }
            }
        }
        for (ns, name, ip) in misses {
            let again = Api::<Service>::namespaced(self.client.clone(), &ns).get_opt(&name).await;
            if !matches!(&again, Ok(Some(svc)) if addresses(svc).contains(&ip)) {
                continue;
            }
            let record = Api::<IPAddress>::all(self.client.clone()).get_opt(&ip).await;
            if !matches!(&record, Ok(Some(r)) if names_service(&r.spec.parent_ref, &ns, &name)) {
                self.violations.add(format!("{ns}/{name} holds {ip}, which no IPAddress records for it"));
            }
        }
        // The repair pass finds no missing record, wrong reference or duplicate (leaks are
        // tolerated: an address assigned by the webhook, its Service not yet stored).
        let (rc, out, err) = self.repair(&["-o", "json"]).await;
        let _ = std::fs::write(self.file("repair.json"), &out);
        if rc != 0 && rc != 1 {
            self.violations.add(format!("clusterip repair failed (exit {rc}): {}", tail(&err, 1)));
            return false;
        }
        let report: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("soak: clusterip repair -o json printed no JSON ({e}): {out}"));
        let found: Vec<String> = report["findings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f["kind"] != "leak")
            .map(|f| format!("{} {} {}", f["kind"].as_str().unwrap_or("?"), f["address"].as_str().unwrap_or("?"), f["owner"].as_str().unwrap_or("?")))
            .collect();
        if !found.is_empty() {
            self.violations.add(format!("repair found: {}", found.join(";")));
        }
        // The probe VIPs answer.
        for vip in self.probes.clone() {
            if let Err(why) = probe(self.client_ns, vip).await {
                self.violations.add(format!("probe VIP {vip} does not answer from the client namespace: {why}"));
            }
        }
        true
    }
}

/// The probe Services `probe-0` … `probe-3` (selectorless, port 80 to the responder's 8080)
/// and their EndpointSlices; their VIPs.
async fn create_probes(client: &kube::Client) -> Vec<IpAddr> {
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    let mut vips = Vec::new();
    for i in 0..4 {
        let name = format!("probe-{i}");
        let svc: Service = serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"ports": [{"port": 80, "targetPort": RESPONDER_PORT}]}})).expect("a Service");
        let svc = services.create(&PostParams::default(), &svc).await.unwrap_or_else(|e| panic!("soak: creating {name}: {e}"));
        let vip = svc.spec.and_then(|s| s.cluster_ip).unwrap_or_else(|| panic!("soak: {name} was created without a ClusterIP"));
        vips.push(vip.parse().unwrap_or_else(|e| panic!("soak: {name}'s ClusterIP {vip:?}: {e}")));
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"port": RESPONDER_PORT, "protocol": "TCP"}],
            "endpoints": [{"addresses": [BACKEND_IP], "conditions": {"ready": true}}],
        }))
        .expect("an EndpointSlice");
        slices.create(&PostParams::default(), &slice).await.unwrap_or_else(|e| panic!("soak: creating {name}'s EndpointSlice: {e}"));
    }
    vips
}

/// A kube client for the churn: each request answered within 30 s or failed.
async fn client(cp: &ControlPlane) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(cp.kubeconfig()).expect("soak: read the kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.expect("soak: kubeconfig to config");
    config.read_timeout = Some(Duration::from_secs(30));
    config.write_timeout = Some(Duration::from_secs(30));
    kube::Client::try_from(config).expect("soak: kube client")
}

/// One backend: cluster, node, probes, churn, checks, repair; its RESULT lines. The
/// violations found.
async fn soak_backend(s: &Settings, agent_bin: &Path, backend: &str, seed: u64) -> Vec<String> {
    say(&format!("{backend}: starting a control plane"));
    let cp = ControlPlane::private_with(
        &format!("soak-{backend}"),
        &[("CLUSTERIP_CONTROLLER", "1"), ("CLUSTERIP_CONTROLLER_BIN", env!("CARGO_BIN_EXE_clusterip")), ("CLUSTERIP_BACKEND", backend), ("CLUSTERIP_KCM", "1")],
    );
    let _keep = KeepLogs { from: cp.dir().to_path_buf(), to: s.logs.clone(), backend: backend.into() };
    let client = client(&cp).await;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).expect("a Namespace");
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.unwrap_or_else(|e| panic!("soak: {backend}: creating the namespace: {e}"));

    let net = Namespaces::new();
    let _responder = Responder::start(&net.backend.name);
    let agent = Agent::start(agent_bin, &net.node.name, &cp.kubeconfig(), s.logs.join(format!("{backend}.agent.log")));
    agent.first_sync().await;
    let probes = create_probes(&client).await;
    for &vip in &probes {
        let last = RefCell::new(String::new());
        let (agent, last_ref, client_ns) = (&agent, &last, net.client.name.as_str());
        let answered = within(SYNC, Duration::from_millis(250), move || async move {
            if let Some(why) = agent.trouble() {
                return Some(Err(why));
            }
            match probe(client_ns, vip).await {
                Ok(()) => Some(Ok(())),
                Err(why) => {
                    *last_ref.borrow_mut() = why;
                    None
                }
            }
        })
        .await;
        match answered {
            Some(Ok(())) => {}
            Some(Err(why)) => panic!("soak: {backend}: the agent cannot program the node: {why}"),
            None => panic!(
                "soak: {backend}: probe VIP {vip} not answering {SYNC:?} after its creation ({}); the node's table:\n{}\nthe agent's log ends:\n{}",
                last.borrow(),
                ns_try(&net.node.name, &["nft", "list", "table", "ip", "clusterip"]).unwrap_or_else(|| "(none)".into()),
                tail(&agent.log(), 20)
            ),
        }
    }
    say(&format!("{backend}: probes answer ({}); churning for {} min at {} ops/s", probes.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(" "), s.minutes, s.rate));

    let processes: Vec<Process> = COMPONENTS
        .iter()
        .map(|&c| Process::of(c, if c == "agent" { agent.child.id() } else { cp.pid(c).unwrap_or_else(|| panic!("soak: {backend}: {c} has no pid file")) }))
        .collect();
    let rss_file = s.logs.join(format!("{backend}.rss"));
    let mut samples: Vec<Vec<(u64, u64)>> = Vec::new();
    let t0 = Instant::now();
    let mut sample = || {
        let row: Vec<(u64, u64)> = processes.iter().map(Process::rss_kib).collect();
        append(&rss_file, &format!("{} {}", t0.elapsed().as_secs(), row.iter().map(|(r, a)| format!("{r} {a}")).collect::<Vec<_>>().join(" ")));
        samples.push(row);
    };
    sample();

    let mut phase = Phase { backend, client: client.clone(), cp: &cp, logs: &s.logs, client_ns: &net.client.name, probes, violations: Violations { found: Vec::new(), file: s.logs.join("violations") } };
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let mut churn = Churn { names: Vec::new(), cluster_ip: HashMap::new(), seq: 0, ops: 0, errors: 0, rng: SmallRng::seed_from_u64(seed) };
    let errors_log = phase.file("errors");
    let mut checks = 0u64;
    let end = t0 + Duration::from_secs(s.minutes * 60);
    let (mut next_check, mut next_rss) = (t0 + s.check_every, t0 + Duration::from_secs(10));
    while Instant::now() < end {
        churn.op(&services, s.services, &errors_log, t0).await;
        for p in &processes {
            if !process_alive(p.pid, p.start) {
                let log = if p.name == "agent" { agent.log() } else { std::fs::read_to_string(cp.dir().join(format!("{}.log", p.name))).unwrap_or_default() };
                panic!("soak: {backend}: {} (pid {}) died; its log ends:\n{}", p.name, p.pid, tail(&log, 20));
            }
        }
        if Instant::now() >= next_rss {
            sample();
            next_rss = Instant::now() + Duration::from_secs(10);
        }
        if Instant::now() >= next_check {
            checks += u64::from(phase.check().await);
            next_check = Instant::now() + s.check_every;
        }
        // A steady rate (time is the subject here, not a condition): operation k is due at
        // t0 + k/rate; behind schedule, the next goes at once.
        tokio::time::sleep_until((t0 + Duration::from_secs_f64(churn.ops as f64 / f64::from(s.rate))).into()).await;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    sample();
    say(&format!("{backend}: churn done ({} operations, {} failed, {} Services left); final check and repair", churn.ops, churn.errors, churn.names.len()));
    checks += u64::from(phase.check().await);

    // Repair, then no leak: a dry run finds the records consistent within 120 s.
    let mut fix = vec!["--fix", "--grace-period", "0s"];
    if backend == "etcd" {
        fix.push("--release-leaks-now");
    }
    let (rc, out, err) = phase.repair(&fix).await;
    let _ = std::fs::write(phase.file("repair-fix.txt"), format!("{out}{err}"));
    if rc != 0 && rc != 1 {
        phase.violations.add(format!("{backend}: clusterip repair --fix failed (exit {rc}): {}", tail(&err, 1)));
    }
    let last = RefCell::new(String::new());
    let (phase_ref, last_ref) = (&phase, &last);
    let consistent = within(Duration::from_secs(120), Duration::from_secs(2), move || async move {
        let (rc, out, err) = phase_ref.repair(&[]).await;
        let _ = std::fs::write(phase_ref.file("repair-after.txt"), format!("{out}{err}"));
        *last_ref.borrow_mut() = format!("{out}{err}");
        (rc == 0).then_some(())
    })
    .await
    .is_some();
    if !consistent {
        let seen = tail(&last.borrow(), 3).replace('\n', " ");
        phase.violations.add(format!("{backend}: records not consistent 120 s after repair --fix: {seen}"));
    }
    let services_at_end = match services.list(&ListParams::default()).await {
        Ok(l) => l.items.len(),
        Err(e) => {
            phase.violations.add(format!("{backend}: listing the Services at the end: {e}"));
            0
        }
    };
    let controller_log = std::fs::read_to_string(cp.dir().join("clusterip-controller.log")).unwrap_or_default();
    let panics = controller_log.lines().chain(agent.log().lines()).filter(|l| l.contains("panicked")).count();
    if panics > 0 {
        phase.violations.add(format!("{backend}: {panics} panic(s) in the controller's or the agent's log"));
    }
    if churn.errors > 0 {
        phase.violations.add(format!("{backend}: {} operations failed (see {})", churn.errors, errors_log.display()));
    }
    println!(
        "RESULT soak backend={backend} minutes={} operations={} failed={} ops_per_s={:.2} checks={checks} services_at_end={services_at_end} repair_consistent={} violations={}",
        s.minutes,
        churn.ops,
        churn.errors,
        churn.ops as f64 / elapsed,
        u8::from(consistent),
        phase.violations.found.len()
    );
    let mib = |kib: u64| kib as f64 / 1024.0;
    let (first, last) = (&samples[0], &samples[samples.len() - 1]);
    for (i, c) in COMPONENTS.iter().enumerate() {
        let max = samples.iter().map(|row| row[i].0).max().unwrap_or(0);
        println!(
            "RESULT soak_rss backend={backend} component={c} start_mib={:.1} end_mib={:.1} max_mib={:.1} anon_start_mib={:.1} anon_end_mib={:.1}",
            mib(first[i].0),
            mib(last[i].0),
            mib(max),
            mib(first[i].1),
            mib(last[i].1)
        );
    }
    phase.violations.found
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "a soak of minutes, as root: scripts/soak.sh [MINUTES]"]
async fn churn_soak() {
    let s = Settings::from_env();
    let agent_bin = preflight();
    let seed = std::env::var("SOAK_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    say(&format!("logs in {}; churn seed {seed} (SOAK_SEED)", s.logs.display()));
    let mut violations = Vec::new();
    for backend in &s.backends {
        violations.extend(soak_backend(&s, &agent_bin, backend, seed).await);
    }
    assert!(violations.is_empty(), "soak: FAILED; {} violation(s) (in {}):\n{}", violations.len(), s.logs.join("violations").display(), violations.join("\n"));
    say(&format!("passed; logs in {}", s.logs.display()));
}
