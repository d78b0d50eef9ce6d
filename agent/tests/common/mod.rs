//! Agent fixtures for the agent's network-namespace tests and benches: a node/client/backend
//! topology, responders answering with their own name, the agent process, and the
//! Kubernetes objects (Services without selectors, EndpointSlices written by the test).
//! What is not the agent's — namespaces ([`Netns`]) and their setup commands, waiting,
//! addresses, child-process guards — comes from `clusterip-test-support`
//! (`tests/support/`), re-exported here.
//!
//! Nothing a test starts outlives it: network namespaces are named
//! `cip<pid>x<seq><tag>` (pid = this test process; `scripts/dev-cluster.sh reap` deletes
//! those whose process is gone, should a run be killed before its drops ran), and every
//! long-running process spawned here (the agent) gets `PR_SET_PDEATHSIG(SIGKILL)`
//! ([`command`]). Short setup commands (`ip`, `nft`, `sysctl`) end on their own and are
//! spawned plainly ([`sh`]).
//!
//! Topology (all in namespaces created here, removed on drop even when a test fails):
//!
//! ```text
//!   client ns                 node ns (rules)                      backend ns b0..bN
//!   eth0 198.18.1.2/24  ───  c0 198.18.1.1/24
//!        fd00:1::2/64            fd00:1::1/64
//!                            br0 198.18.2.1/24, fd00:2::1/64  ───  eth0 198.18.2.(10+i)/24
//!                                                                       fd00:2::(10+i)/64
//! ```
//! Client and backends are in different subnets so replies go back through the node (and
//! its conntrack), as they would through a real node.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;

#[allow(unused_imports)] // each test binary uses some
pub use clusterip_test_support::{die_with_parent, in_netns, ip, ns_sh, ns_try, sa, sh, short_name, wait_for, wait_ok, wait_within, Netns};

pub const TCP_PORT: u16 = 8080;
pub const UDP_PORT: u16 = 5353;

/// A command whose process is killed when the calling thread (the test's) exits: spawn it
/// from the test's own thread, not from a helper thread that ends before it.
pub fn command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    die_with_parent(&mut cmd);
    cmd
}

/// TCP/UDP responders in a backend namespace answering with `name`; stopped on drop.
pub struct Responder {
    stop: Arc<AtomicBool>,
    tcp_fd: i32,
    threads: Vec<std::thread::JoinHandle<()>>,
    _tcp: Arc<TcpListener>,
}

impl Responder {
    pub fn start(ns: &str, name: &str) -> Responder {
        let (tcp, udp) = in_netns(ns, || {
            let tcp = TcpListener::bind((std::net::Ipv6Addr::UNSPECIFIED, TCP_PORT)).expect("bind tcp");
            let udp = UdpSocket::bind((std::net::Ipv6Addr::UNSPECIFIED, UDP_PORT)).expect("bind udp");
            (tcp, udp)
        });
        let stop = Arc::new(AtomicBool::new(false));
        let tcp = Arc::new(tcp);
        let tcp_fd = tcp.as_raw_fd();
        let mut threads = Vec::new();
        {
            let (tcp, stop, name) = (tcp.clone(), stop.clone(), name.to_string());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match tcp.accept() {
                        Ok((mut s, _)) => {
                            let _ = s.write_all(format!("{name}\n").as_bytes());
                        }
                        Err(_) => {
                            if stop.load(Ordering::Relaxed) {
                                break;
                            }
                        }
                    }
                }
            }));
        }
        {
            let (stop, name) = (stop.clone(), name.to_string());
            udp.set_read_timeout(Some(Duration::from_millis(100))).expect("udp timeout");
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((_, from)) = udp.recv_from(&mut buf) {
                        let _ = udp.send_to(format!("{name}\n").as_bytes(), from);
                    }
                }
            }));
        }
        Responder { stop, tcp_fd, threads, _tcp: tcp }
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // SAFETY: shutting down our own listening socket wakes the blocked accept().
        unsafe { libc::shutdown(self.tcp_fd, libc::SHUT_RDWR) };
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The node, client and backend namespaces, wired up, with responders running.
pub struct Topology {
    pub responders: Vec<Responder>,
    pub backends: Vec<Netns>,
    pub client: Netns,
    pub node: Netns,
}

impl Topology {
    pub const NODE_IP: &'static str = "198.18.1.1";
    pub const NODE_IP6: &'static str = "fd00:1::1";

    pub fn new(backends: usize) -> Topology {
        let node = Netns::new("node");
        let client = Netns::new("client");
        let n = node.name.as_str();
        for (k, v) in [("net.ipv4.ip_forward", "1"), ("net.ipv6.conf.all.forwarding", "1")] {
            ns_sh(n, &["sysctl", "-qw", &format!("{k}={v}")]);
        }
        sh(&["ip", "-n", n, "link", "add", "c0", "type", "veth", "peer", "name", "eth0", "netns", &client.name]);
        ns_sh(n, &["ip", "addr", "add", "198.18.1.1/24", "dev", "c0"]);
        ns_sh(n, &["ip", "addr", "add", "fd00:1::1/64", "dev", "c0", "nodad"]);
        ns_sh(n, &["ip", "link", "set", "c0", "up"]);
        let c = client.name.as_str();
        ns_sh(c, &["ip", "addr", "add", "198.18.1.2/24", "dev", "eth0"]);
        ns_sh(c, &["ip", "addr", "add", "fd00:1::2/64", "dev", "eth0", "nodad"]);
        ns_sh(c, &["ip", "link", "set", "eth0", "up"]);
        ns_sh(c, &["ip", "route", "add", "default", "via", "198.18.1.1"]);
        ns_sh(c, &["ip", "-6", "route", "add", "default", "via", "fd00:1::1"]);
        ns_sh(n, &["ip", "link", "add", "br0", "type", "bridge"]);
        ns_sh(n, &["ip", "addr", "add", "198.18.2.1/24", "dev", "br0"]);
        ns_sh(n, &["ip", "addr", "add", "fd00:2::1/64", "dev", "br0", "nodad"]);
        ns_sh(n, &["ip", "link", "set", "br0", "up"]);
        // Service VIPs are routed towards the backends, so that traffic to a VIP without
        // endpoints reaches the forward hook (where it is rejected), as on a real node.
        ns_sh(n, &["ip", "route", "add", "198.19.0.0/16", "dev", "br0"]);
        ns_sh(n, &["ip", "-6", "route", "add", "fd00:10:96::/112", "dev", "br0"]);
        let mut bs = Vec::new();
        let mut responders = Vec::new();
        for i in 0..backends {
            let b = Netns::new(&format!("b{i}"));
            let veth = format!("b{i}");
            sh(&["ip", "-n", n, "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &b.name]);
            ns_sh(n, &["ip", "link", "set", &veth, "master", "br0"]);
            // What kubelet does for pods on a bridge (hairpin-veth): with br_netfilter loaded
            // (bridge-nf-call-iptables=1), a pod's connection DNATed back to itself leaves
            // through the port it came in on.
            ns_sh(n, &["ip", "link", "set", &veth, "type", "bridge_slave", "hairpin", "on"]);
            ns_sh(n, &["ip", "link", "set", &veth, "up"]);
            ns_sh(&b.name, &["ip", "addr", "add", &format!("{}/24", Self::backend_ip(i)), "dev", "eth0"]);
            ns_sh(&b.name, &["ip", "addr", "add", &format!("{}/64", Self::backend_ip6(i)), "dev", "eth0", "nodad"]);
            ns_sh(&b.name, &["ip", "link", "set", "eth0", "up"]);
            ns_sh(&b.name, &["ip", "route", "add", "default", "via", "198.18.2.1"]);
            ns_sh(&b.name, &["ip", "-6", "route", "add", "default", "via", "fd00:2::1"]);
            responders.push(Responder::start(&b.name, &format!("b{i}")));
            bs.push(b);
        }
        Topology { responders, backends: bs, client, node }
    }

    pub fn backend_ip(i: usize) -> String {
        format!("198.18.2.{}", 10 + i)
    }

    pub fn backend_ip6(i: usize) -> String {
        format!("fd00:2::{}", 10 + i)
    }

    /// One TCP request from the client namespace: the backend's name, or the error.
    pub fn tcp_get(&self, addr: SocketAddr, timeout: Duration) -> std::io::Result<String> {
        tcp_get_in(&self.client.name, addr, timeout)
    }

    /// `nft list table <family> clusterip` in the node namespace ("" if absent).
    pub fn nft_table(&self, family: &str) -> String {
        ns_try(&self.node.name, &["nft", "list", "table", family, "clusterip"]).unwrap_or_default()
    }
}

/// One TCP request from namespace `ns`: the answer, or the error.
pub fn tcp_get_in(ns: &str, addr: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    {
        in_netns(ns, || {
            let mut s = TcpStream::connect_timeout(&addr, timeout)?;
            s.set_read_timeout(Some(timeout))?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out.trim().to_string())
        })
    }
}

impl Topology {
    /// A UDP client in the client namespace on source port `src_port`.
    pub fn udp_client(&self, v6: bool, src_port: u16) -> UdpClient {
        let bind: SocketAddr = if v6 { (std::net::Ipv6Addr::UNSPECIFIED, src_port).into() } else { ([0, 0, 0, 0], src_port).into() };
        let sock = in_netns(&self.client.name, || UdpSocket::bind(bind)).unwrap_or_else(|e| panic!("bind udp {bind} in the client namespace: {e}"));
        UdpClient { sock }
    }
}

/// A UDP socket bound once to a source port and kept for the test: asking again from the
/// same port reuses it. (Binding the port anew after closing the previous socket can fail
/// with EADDRINUSE: a child forked meanwhile by another test thread holds a copy of the
/// socket until it execs.)
pub struct UdpClient {
    sock: UdpSocket,
}

impl UdpClient {
    /// One request to `addr`: the answer (the backend's name), or the error.
    pub fn ask(&self, addr: SocketAddr, timeout: Duration) -> std::io::Result<String> {
        let mut buf = [0u8; 128];
        // Late answers to earlier requests (that timed out) are not this one's.
        self.sock.set_nonblocking(true)?;
        while self.sock.recv_from(&mut buf).is_ok() {}
        self.sock.set_nonblocking(false)?;
        self.sock.set_read_timeout(Some(timeout))?;
        self.sock.send_to(b"who\n", addr)?;
        let (n, _) = self.sock.recv_from(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
    }
}

/// The agent running against the node namespace; killed on drop.
pub struct Agent {
    child: Child,
    pub node_name: String,
    pub proxy_name: String,
    log: std::path::PathBuf,
}

impl Agent {
    pub fn start(node_ns: &str, kubeconfig: &std::path::Path, proxy_name: &str, extra: &[&str]) -> Agent {
        Self::start_with_env(node_ns, kubeconfig, proxy_name, extra, &[])
    }

    /// [`Agent::start`] with extra environment variables.
    pub fn start_with_env(node_ns: &str, kubeconfig: &std::path::Path, proxy_name: &str, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        let node_name = format!("node-{proxy_name}");
        // Spawned from the test's thread with PDEATHSIG: a killed test run kills its agents.
        // CLUSTERIP_AGENT_BIN runs another build (an older commit's, to see a test fail on it).
        let bin = std::env::var("CLUSTERIP_AGENT_BIN").ok().filter(|b| !b.is_empty()).unwrap_or_else(|| env!("CARGO_BIN_EXE_clusterip-agent").to_string());
        let mut cmd = command(bin);
        cmd.args(["--netns", node_ns, "--node-name", &node_name, "--service-proxy-name", proxy_name]).arg("--kubeconfig").arg(kubeconfig);
        if !extra.contains(&"--min-sync-period") {
            cmd.args(["--min-sync-period", "100ms"]);
        }
        for flag in ["--healthz-bind-address", "--metrics-bind-address"] {
            if !extra.contains(&flag) {
                cmd.args([flag, ""]);
            }
        }
        cmd.args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .envs(env.iter().copied())
            .stdin(Stdio::null());
        let log = std::env::temp_dir().join(format!("clusterip-agent-test-{proxy_name}.log"));
        let file = std::fs::File::create(&log).expect("agent log file");
        cmd.stderr(file);
        let child = cmd.spawn().expect("start clusterip-agent");
        Agent { child, node_name, proxy_name: proxy_name.to_string(), log }
    }

    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The address the agent logged for `what` ("healthz", "metrics") once it listens: give
    /// it `127.0.0.1:0` and it binds a free port itself (no window in which another process
    /// could take a port the test picked).
    pub fn listening_addr(&self, what: &str) -> SocketAddr {
        let needle = format!("{what} listening");
        wait_for(&format!("the agent to log `{needle}`"), Duration::from_secs(60), || {
            let log = self.log();
            let line = log.lines().find(|l| l.contains(&needle))?;
            let value = line.split_whitespace().find_map(|w| w.strip_prefix("addr="))?;
            Some(value.parse().unwrap_or_else(|e| panic!("address in {line:?}: {e}")))
        })
    }

    /// The agent's `/metrics` text (started with `--metrics-bind-address 127.0.0.1:0`).
    pub fn metrics(&self) -> String {
        let addr = self.listening_addr("metrics");
        let t = Duration::from_secs(10);
        let mut s = TcpStream::connect_timeout(&addr, t).unwrap_or_else(|e| panic!("connect to /metrics at {addr}: {e}"));
        s.set_read_timeout(Some(t)).expect("read timeout");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").expect("ask for /metrics");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read /metrics");
        out
    }

    /// A sample of the agent's `/metrics` (the full name with labels, if any), or None.
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.metrics().lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// Number of log lines containing every one of `needles`.
    pub fn log_count(&self, needles: &[&str]) -> usize {
        self.log().lines().filter(|l| needles.iter().all(|n| l.contains(n))).count()
    }

    /// Stop the agent (SIGSTOP) until the guard is dropped (SIGCONT): lets a test observe
    /// a state the agent would repair, without racing it.
    pub fn pause(&self) -> Paused<'_> {
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGSTOP) };
        // Wait until it is stopped (state T in /proc/<pid>/stat).
        let stat = format!("/proc/{}/stat", self.child.id());
        wait_for("the agent to stop", Duration::from_secs(60), || {
            let s = std::fs::read_to_string(&stat).ok()?;
            let state = s.rsplit_once(')')?.1.split_whitespace().next()?.to_string();
            (state == "T").then_some(())
        });
        Paused { agent: self }
    }

    /// The agent synced, and every sync it ran so far succeeded. (The rules are in the
    /// kernel before the sync's "sync done" line is written: wait for the line.)
    pub fn assert_no_sync_failures(&self) {
        wait_for("the agent to log a finished sync", Duration::from_secs(60), || self.log().contains("sync done").then_some(()));
        let log = self.log();
        assert!(!log.contains("sync failed"), "a sync failed:\n{log}");
    }

    /// The agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kill the agent (SIGKILL: no shutdown path runs) and reap it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn stop(&mut self) {
        // SAFETY: signalling our own child process by its pid (SIGCONT in case it is paused).
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
            libc::kill(self.child.id() as i32, libc::SIGCONT);
        }
        if wait_within(Duration::from_secs(30), Duration::from_millis(20), || self.child.try_wait().ok().flatten()).is_some() {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The agent stopped by [`Agent::pause`]; continued on drop.
pub struct Paused<'a> {
    agent: &'a Agent,
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(self.agent.child.id() as i32, libc::SIGCONT) };
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.stop();
        }
        if std::thread::panicking() {
            eprintln!("--- agent log ---\n{}", self.log());
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A Kubernetes namespace for one test, with its objects deleted on drop.
pub struct KubeNs {
    pub name: String,
    pub client: kube::Client,
    pub rt: Arc<tokio::runtime::Runtime>,
}

/// One endpoint to write into an EndpointSlice.
#[derive(Clone, Debug)]
pub struct Ep {
    pub ip: String,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    pub node: Option<String>,
}

impl Ep {
    pub fn ready(ip: &str) -> Ep {
        Ep { ip: ip.into(), ready: Some(true), serving: Some(true), terminating: Some(false), node: Some("elsewhere".into()) }
    }
}

/// An EndpointSlice's shape beside its endpoints: by default the Service's slice
/// `<service>-1`, IPv4, one unnamed TCP port [`TCP_PORT`].
#[derive(Clone, Debug)]
pub struct Slice {
    pub name: String,
    pub family: &'static str,
    pub port_name: &'static str,
    pub protocol: &'static str,
    pub port: u16,
}

impl Slice {
    fn of(svc: &str) -> Slice {
        Slice { name: format!("{svc}-1"), family: "IPv4", port_name: "", protocol: "TCP", port: TCP_PORT }
    }
}

impl KubeNs {
    pub fn new(rt: Arc<tokio::runtime::Runtime>) -> KubeNs {
        let cp = clusterip_test_support::control_plane();
        let client = rt.block_on(cp.client());
        let name = clusterip_test_support::unique_name("agent-test");
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).expect("ns");
        rt.block_on(Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns)).expect("create namespace");
        KubeNs { name, client, rt }
    }

    pub fn kubeconfig() -> std::path::PathBuf {
        clusterip_test_support::control_plane().kubeconfig()
    }

    /// Create a Service without selector, labelled for `proxy_name`; returns it as stored.
    pub fn service(&self, proxy_name: &str, name: &str, spec: serde_json::Value) -> Service {
        let svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"service.kubernetes.io/service-proxy-name": proxy_name}},
            "spec": spec,
        }))
        .expect("service json");
        let api: Api<Service> = Api::namespaced(self.client.clone(), &self.name);
        self.rt.block_on(api.create(&PostParams::default(), &svc)).expect("create service")
    }

    /// Write (create or replace) an EndpointSlice of Service `svc` with endpoints `eps`:
    /// the [`Slice`] defaults, changed by `tweak`.
    pub fn slice(&self, svc: &str, eps: &[Ep], tweak: impl FnOnce(&mut Slice)) {
        let mut shape = Slice::of(svc);
        tweak(&mut shape);
        let Slice { name: slice, family, port_name, protocol, port } = shape;
        let slice = slice.as_str();
        let endpoints: Vec<serde_json::Value> = eps
            .iter()
            .map(|e| {
                let mut cond = serde_json::Map::new();
                for (k, v) in [("ready", e.ready), ("serving", e.serving), ("terminating", e.terminating)] {
                    if let Some(v) = v {
                        cond.insert(k.into(), v.into());
                    }
                }
                let mut ep = serde_json::json!({"addresses": [e.ip], "conditions": cond});
                if let Some(n) = &e.node {
                    ep["nodeName"] = n.clone().into();
                }
                ep
            })
            .collect();
        let obj: EndpointSlice = serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": slice, "namespace": self.name, "labels": {
                "kubernetes.io/service-name": svc, "endpointslice.kubernetes.io/managed-by": "clusterip-agent-tests"}},
            "addressType": family,
            "ports": [{"name": port_name, "port": port, "protocol": protocol}],
            "endpoints": endpoints,
        }))
        .expect("slice json");
        let api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), &self.name);
        self.rt
            .block_on(api.patch(slice, &PatchParams::apply("clusterip-agent-tests").force(), &Patch::Apply(&obj)))
            .expect("apply endpointslice");
    }
}

impl Drop for KubeNs {
    fn drop(&mut self) {
        let svcs: Api<Service> = Api::namespaced(self.client.clone(), &self.name);
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), &self.name);
        let nss: Api<Namespace> = Api::all(self.client.clone());
        let name = self.name.clone();
        self.rt.block_on(async move {
            let lp = Default::default();
            let dp = DeleteParams::default();
            let _ = svcs.delete_collection(&dp, &lp).await;
            let _ = slices.delete_collection(&dp, &lp).await;
            let _ = nss.delete(&name, &dp).await;
        });
    }
}

/// A runtime for the kube client calls of one test.
pub fn runtime() -> Arc<tokio::runtime::Runtime> {
    Arc::new(tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime"))
}

/// The first ClusterIP of the family of `v6`.
pub fn cluster_ip(svc: &Service, v6: bool) -> String {
    let ips = svc.spec.as_ref().and_then(|s| s.cluster_ips.clone()).unwrap_or_default();
    ips.into_iter().find(|ip| ip.contains(':') == v6).unwrap_or_else(|| panic!("no ClusterIP of that family in {svc:?}"))
}
