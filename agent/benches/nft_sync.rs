//! Side-by-side sync benchmark: clusterip-agent (nftables) and kube-proxy (nftables mode),
//! both fed by the same dev kube-apiserver and the same objects, each programming a
//! network namespace of its own. Run by `scripts/bench-agent.sh`.
//!
//! For each size N (cumulative: the objects of the smaller sizes are kept): N Services ×
//! E endpoints (one EndpointSlice each) are loaded; each proxy is started in a fresh
//! namespace and the duration of its first full sync is read from its own log (ours:
//! "sync done … elapsed_ms", kube-proxy: "SyncProxyRules complete … elapsed"). At the size
//! given by --change-at, one EndpointSlice is then changed and the next (partial) sync is
//! timed the same way. Peak memory is VmHWM of each process.
//!
//! kube-proxy runs with `--oom-score-adj=0` (its default, -999, would make the kernel kill
//! anything else first when the machine runs out of memory). With `--run-capped SCRIPT
//! --mem-cap-mib N` each proxy runs as `SCRIPT N -- command…` (scripts/lib/run-capped.sh:
//! a memory cgroup of its own); peak memory is then read from the proxy itself (the
//! descendant running the proxy's binary), not from the wrapper.
//!
//! Nothing outlives the bench: its namespaces are named `cip<pid>x…` (what
//! `scripts/dev-cluster.sh reap` removes once this process is gone), every child gets
//! `PR_SET_PDEATHSIG(SIGKILL)`, and stopping a proxy signals the wrapper and the proxy.
//!
//! Arguments: --kubeconfig PATH --agent PATH [--kube-proxy PATH] [--sizes 1000,10000]
//! [--endpoints 10] [--change-at 10000] [--timeout-s 1800] [--run-capped SCRIPT --mem-cap-mib N]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;

const NS: &str = "clusterip-bench";

struct Opts {
    kubeconfig: String,
    agent: String,
    kube_proxy: Option<String>,
    sizes: Vec<usize>,
    endpoints: usize,
    change_at: usize,
    timeout: Duration,
    /// `run-capped.sh` and its limit in MiB, to run each proxy in a memory cgroup.
    capped: Option<(String, u64)>,
}

fn parse_args() -> Result<Opts, String> {
    let mut args = std::env::args().skip(1);
    let mut o = Opts {
        kubeconfig: String::new(),
        agent: String::new(),
        kube_proxy: None,
        sizes: vec![1000, 10000],
        endpoints: 10,
        change_at: 10000,
        timeout: Duration::from_secs(1800),
        capped: None,
    };
    let (mut run_capped, mut cap_mib) = (None, None);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--kubeconfig" => o.kubeconfig = val()?,
            "--agent" => o.agent = val()?,
            "--kube-proxy" => o.kube_proxy = Some(val()?).filter(|s| !s.is_empty()),
            "--sizes" => o.sizes = val()?.split(',').map(|s| s.trim().parse().map_err(|e| format!("--sizes: {e}"))).collect::<Result<_, _>>()?,
            "--endpoints" => o.endpoints = val()?.parse().map_err(|e| format!("--endpoints: {e}"))?,
            "--change-at" => o.change_at = val()?.parse().map_err(|e| format!("--change-at: {e}"))?,
            "--timeout-s" => o.timeout = Duration::from_secs(val()?.parse().map_err(|e| format!("--timeout-s: {e}"))?),
            "--run-capped" => run_capped = Some(val()?).filter(|s| !s.is_empty()),
            "--mem-cap-mib" => cap_mib = Some(val()?.parse::<u64>().map_err(|e| format!("--mem-cap-mib: {e}"))?),
            "--bench" => {}
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if o.kubeconfig.is_empty() || o.agent.is_empty() {
        return Err("--kubeconfig and --agent are required".into());
    }
    o.capped = match (run_capped, cap_mib) {
        (Some(script), Some(mib)) => Some((script, mib)),
        (None, _) => None,
        (Some(_), None) => return Err("--run-capped needs --mem-cap-mib".into()),
    };
    Ok(o)
}

/// A command whose process dies with this one (`PR_SET_PDEATHSIG`; spawn from the main
/// thread, which outlives every child).
fn command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    clusterip_agent::netns::die_with_parent(&mut cmd);
    cmd
}

/// A network namespace named `cip<pid>x<tag>`, deleted on drop.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Netns {
        let name = format!("cip{}x{tag}", std::process::id());
        let _ = command("ip").args(["netns", "del", &name]).stderr(Stdio::null()).status();
        let ok = command("ip").args(["netns", "add", &name]).status().map(|s| s.success()).unwrap_or(false);
        assert!(ok, "ip netns add {name}");
        let _ = command("ip").args(["netns", "exec", &name, "ip", "link", "set", "lo", "up"]).status();
        Netns(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = command("ip").args(["netns", "del", &self.0]).status();
    }
}

/// The parent pid of each process (from /proc/<pid>/stat).
fn parents() -> Vec<(u32, u32)> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return vec![] };
    dir.filter_map(|e| {
        let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
        Some((pid, ppid))
    })
    .collect()
}

/// `root` and its descendants, parents first.
fn tree(root: u32) -> Vec<u32> {
    let all = parents();
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(all.iter().filter(|(_, pp)| *pp == p).map(|(pid, _)| *pid));
        i += 1;
    }
    out
}

/// A child process whose stderr+stdout lines arrive on a channel; killed on drop, with its
/// descendants (a memory-capping wrapper may run the proxy as its own child).
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// File name of the binary whose memory is measured (the proxy, maybe under a wrapper).
    exe: String,
}

/// `program args…`, under `run-capped.sh <MiB> --` when capping; the file name of the
/// proxy's binary for [`Proc::peak_rss_mib`].
fn proxy_command(o: &Opts, program: &str, args: &[String], exe: &str) -> (Command, String) {
    let cmd = match &o.capped {
        Some((script, mib)) => {
            // The wrapper gets SIGTERM when this process dies: it then stops the proxy and
            // removes its cgroup (SIGKILL would leave both behind).
            let mut c = Command::new(script);
            clusterip_agent::netns::die_with_parent_by(&mut c, libc::SIGTERM);
            c.arg(mib.to_string()).arg("--").arg(program).args(args);
            c
        }
        None => {
            let mut c = command(program);
            c.args(args);
            c
        }
    };
    let exe = std::path::Path::new(exe).file_name().map_or(exe.to_string(), |n| n.to_string_lossy().into_owned());
    (cmd, exe)
}

impl Proc {
    fn spawn((mut cmd, exe): (Command, String), log: Option<std::path::PathBuf>) -> Proc {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let (tx, rx) = mpsc::channel();
        for pipe in [child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>), child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>)]
            .into_iter()
            .flatten()
        {
            let tx = tx.clone();
            let mut log = log.as_ref().and_then(|p| std::fs::OpenOptions::new().create(true).append(true).open(p).ok());
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    if let Some(f) = log.as_mut() {
                        use std::io::Write;
                        let _ = writeln!(f, "{line}");
                    }
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Proc { child, lines: rx, exe }
    }

    /// The pid running the measured binary: the child, or one of its descendants.
    fn measured_pid(&self) -> Option<u32> {
        tree(self.child.id()).into_iter().find(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe"))
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .is_some_and(|n| n == self.exe || n.strip_suffix(" (deleted)") == Some(&self.exe))
        })
    }

    /// Wait for a line matching `f` (which extracts a value).
    fn wait_line<T>(&mut self, timeout: Duration, mut f: impl FnMut(&str) -> Option<T>) -> Option<T> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Some(v) = f(&l) {
                        return Some(v);
                    }
                }
                Err(_) => return None,
            }
        }
    }

    fn peak_rss_mib(&self) -> Option<f64> {
        let pid = self.measured_pid()?;
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let kb: f64 = s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb / 1024.0)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // The child and whatever it started (taken before the child exits, when they would
        // be reparented away).
        let pids = tree(self.child.id());
        let signal = |sig: i32| {
            for pid in &pids {
                // SAFETY: signalling our own child and its descendants by pid.
                unsafe { libc::kill(*pid as i32, sig) };
            }
        };
        let alive = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(')').map(|(_, rest)| !rest.trim_start().starts_with('Z')))
                .unwrap_or(false)
        };
        signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let child_done = matches!(self.child.try_wait(), Ok(Some(_)));
            if child_done && !pids[1..].iter().any(|p| alive(*p)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        signal(libc::SIGKILL);
        let _ = self.child.wait();
    }
}

/// Go duration text ("1m2.5s", "350.2ms") in seconds.
fn go_duration(s: &str) -> Option<f64> {
    let mut total = 0.0;
    let mut rest = s.trim().trim_matches('"');
    while !rest.is_empty() {
        let n = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let v: f64 = rest[..n].parse().ok()?;
        rest = &rest[n..];
        let (mult, len) = if rest.starts_with("ms") {
            (1e-3, 2)
        } else if rest.starts_with("µs") {
            (1e-6, "µs".len())
        } else if rest.starts_with("us") {
            (1e-6, 2)
        } else if rest.starts_with("ns") {
            (1e-9, 2)
        } else if rest.starts_with('h') {
            (3600.0, 1)
        } else if rest.starts_with('m') {
            (60.0, 1)
        } else if rest.starts_with('s') {
            (1.0, 1)
        } else {
            return None;
        };
        total += v * mult;
        rest = &rest[len..];
    }
    Some(total)
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let i = line.find(key)? + key.len();
    let rest = &line[i..];
    let end = if let Some(r) = rest.strip_prefix('"') { r.find('"').map(|e| e + 2)? } else { rest.find(' ').unwrap_or(rest.len()) };
    Some(&rest[..end])
}

/// Forward connections made to 127.0.0.1:<port> inside `ns` to `target` (the apiserver on
/// the host's loopback), so that kube-proxy, which has no --netns, can run inside `ns`.
fn forwarder(ns: &str, target: String) -> u16 {
    let path = format!("/run/netns/{ns}");
    let listener = std::thread::scope(|s| {
        s.spawn(|| {
            let f = std::fs::File::open(&path).expect("netns");
            // SAFETY: setns on this short-lived thread only.
            assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
            TcpListener::bind("127.0.0.1:0").expect("bind in netns")
        })
        .join()
        .expect("bind thread")
    });
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for c in listener.incoming().map_while(Result::ok) {
            let Ok(up) = TcpStream::connect(&target) else { continue };
            let (mut a, mut b) = (c.try_clone().expect("clone"), up.try_clone().expect("clone"));
            let (mut c2, mut up2) = (c, up);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut a, &mut up2);
                let _ = up2.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut b, &mut c2);
                let _ = c2.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    port
}

fn endpoint_ip(i: usize) -> String {
    // 198.18.0.0/15 minus the first /24s: plenty of distinct addresses, reused modulo.
    let n = 1024 + (i % 120_000);
    format!("198.{}.{}.{}", 18 + (n >> 16), (n >> 8) & 255, n & 255)
}

fn slice_obj(i: usize, endpoints: usize, generation: usize) -> EndpointSlice {
    let eps: Vec<serde_json::Value> = (0..endpoints)
        .map(|j| serde_json::json!({"addresses": [endpoint_ip(i * endpoints + j + generation * 7)], "conditions": {"ready": true}, "nodeName": "elsewhere"}))
        .collect();
    serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("s{i}-1"), "namespace": NS,
            "labels": {"kubernetes.io/service-name": format!("s{i}"), "endpointslice.kubernetes.io/managed-by": "clusterip-bench"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    }))
    .expect("slice json")
}

async fn load(client: &kube::Client, from: usize, to: usize, endpoints: usize) {
    let svcs: Api<Service> = Api::namespaced(client.clone(), NS);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    let start = Instant::now();
    futures::stream::iter(from..to)
        .map(|i| {
            let (svcs, slices) = (svcs.clone(), slices.clone());
            async move {
                let svc: Service = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": format!("s{i}")},
                    "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
                }))
                .expect("svc json");
                for attempt in 0..5 {
                    match svcs.create(&PostParams::default(), &svc).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(e)) if e.code == 409 => break,
                        Err(e) if attempt == 4 => panic!("create service s{i}: {e}"),
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
                let pp = PatchParams::apply("clusterip-bench").force();
                for attempt in 0..5 {
                    match slices.patch(&format!("s{i}-1"), &pp, &Patch::Apply(&slice_obj(i, endpoints, 0))).await {
                        Ok(_) => break,
                        Err(e) if attempt == 4 => panic!("apply slice s{i}: {e}"),
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
    eprintln!("bench: loaded Services {from}..{to} in {:.1}s", start.elapsed().as_secs_f64());
}

async fn change_one(client: &kube::Client, i: usize, endpoints: usize, generation: usize) {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    slices
        .patch(&format!("s{i}-1"), &PatchParams::apply("clusterip-bench").force(), &Patch::Apply(&slice_obj(i, endpoints, generation)))
        .await
        .expect("change one slice");
}

#[derive(Default, Debug)]
struct Measure {
    full_s: Option<f64>,
    change_s: Option<f64>,
    peak_mib: Option<f64>,
}

/// A "sync done" line's duration in seconds (`elapsed_us`, or `elapsed_ms` from older agents).
fn elapsed_s(l: &str) -> Option<f64> {
    match field(l, "elapsed_us=").and_then(|us| us.parse::<f64>().ok()) {
        Some(us) => Some(us / 1e6),
        None => field(l, "elapsed_ms=")?.parse::<f64>().ok().map(|ms| ms / 1000.0),
    }
}

fn run_ours(o: &Opts, rt: &tokio::runtime::Runtime, client: &kube::Client, n: usize, change: bool) -> Measure {
    let ns = Netns::new("benchours");
    let args: Vec<String> = ["--netns", &ns.0, "--kubeconfig", &o.kubeconfig, "--node-name", "bench-node"]
        .into_iter()
        .chain(["--healthz-bind-address", "", "--metrics-bind-address", "", "--sync-period", "1h", "--min-sync-period", "1s"])
        .map(str::to_string)
        .collect();
    let (mut cmd, exe) = proxy_command(o, &o.agent, &args, &o.agent);
    cmd.env("NO_COLOR", "1").env("RUST_LOG", "info");
    let mut p = Proc::spawn((cmd, exe), Some(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("clusterip-bench-ours-{n}.log"))));
    let mut m = Measure::default();
    let services = n + 1; // + default/kubernetes
    m.full_s = p.wait_line(o.timeout, |l| {
        if l.contains("sync done") && l.contains("full=true") {
            let svc: usize = field(l, "services=")?.parse().ok()?;
            if svc >= services {
                return elapsed_s(l);
            }
        }
        None
    });
    if change && m.full_s.is_some() {
        rt.block_on(change_one(client, n / 2, o.endpoints, 1));
        m.change_s = p.wait_line(Duration::from_secs(60), |l| {
            (l.contains("sync done") && l.contains("full=false")).then(|| elapsed_s(l)).flatten()
        });
        rt.block_on(change_one(client, n / 2, o.endpoints, 0));
    }
    m.peak_mib = p.peak_rss_mib();
    let listing = command("ip").args(["netns", "exec", &ns.0, "nft", "list", "map", "ip", "clusterip", "service-ips"]).output();
    if let Ok(out) = listing {
        let elems = String::from_utf8_lossy(&out.stdout).matches("goto").count();
        eprintln!("bench: ours programmed {elems} service-ips elements for {n} Services");
    }
    m
}

fn run_kube_proxy(o: &Opts, kp: &str, rt: &tokio::runtime::Runtime, client: &kube::Client, n: usize, change: bool, server: &str) -> Measure {
    let ns = Netns::new("benchkp");
    let port = forwarder(&ns.0, server.to_string());
    let kc_text = std::fs::read_to_string(&o.kubeconfig).expect("kubeconfig");
    let kc_path = std::env::temp_dir().join(format!("clusterip-bench-kp-{}.kubeconfig", std::process::id()));
    let rewritten: String = kc_text
        .lines()
        .map(|l| if l.trim_start().starts_with("server:") { format!("    server: https://127.0.0.1:{port}") } else { l.to_string() })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&kc_path, rewritten).expect("write kubeconfig");
    let args: Vec<String> = ["netns", "exec", &ns.0, kp, "--proxy-mode=nftables", "--hostname-override=bench-node", "--v=2"]
        .into_iter()
        .map(str::to_string)
        .chain([format!("--kubeconfig={}", kc_path.display())])
        .chain(
            ["--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0"]
                .into_iter()
                .map(str::to_string),
        )
        .chain(["--healthz-bind-address=127.0.0.1:10256", "--metrics-bind-address=127.0.0.1:10249"].into_iter().map(str::to_string))
        // kube-proxy's default -999 would make the kernel pick anything else first when
        // the machine runs out of memory.
        .chain(["--oom-score-adj=0".to_string()])
        .collect();
    let p = proxy_command(o, "ip", &args, kp);
    let mut p = Proc::spawn(p, Some(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("clusterip-bench-kube-proxy-{n}.log"))));
    let mut m = Measure::default();
    let complete = |l: &str| -> Option<f64> {
        if l.contains("SyncProxyRules complete") && l.contains("ipFamily=\"IPv4\"") {
            return go_duration(field(l, "elapsed=")?);
        }
        None
    };
    // The first complete IPv4 sync after initialisation is the full one.
    m.full_s = p.wait_line(o.timeout, |l| {
        if l.contains("Not syncing") {
            return None;
        }
        complete(l)
    });
    if change && m.full_s.is_some() {
        // Let any follow-up sync run first, then change one slice.
        let _ = p.wait_line(Duration::from_secs(3), |_| None::<()>);
        rt.block_on(change_one(client, n / 2, o.endpoints, 1));
        m.change_s = p.wait_line(Duration::from_secs(600), complete);
        rt.block_on(change_one(client, n / 2, o.endpoints, 0));
    }
    m.peak_mib = p.peak_rss_mib();
    drop(p);
    let _ = std::fs::remove_file(&kc_path);
    m
}

fn fmt(v: Option<f64>) -> String {
    v.map_or("NA".into(), |v| format!("{v:.4}"))
}

fn ratio(kp: Option<f64>, ours: Option<f64>) -> String {
    match (kp, ours) {
        (Some(k), Some(o)) if o > 0.0 => format!("{:.1}", k / o),
        _ => "NA".into(),
    }
}

fn main() {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("nft_sync bench: {e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let client = rt.block_on(async {
        let kc = kube::config::Kubeconfig::read_from(&o.kubeconfig).expect("kubeconfig");
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await.expect("config");
        kube::Client::try_from(cfg).expect("client")
    });
    let server = std::fs::read_to_string(&o.kubeconfig)
        .ok()
        .and_then(|t| t.lines().find_map(|l| l.trim().strip_prefix("server:").map(|s| s.trim().trim_start_matches("https://").to_string())))
        .expect("server in kubeconfig");
    rt.block_on(async {
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": NS}})).expect("ns");
        let _ = Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await;
        let node: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": "bench-node"},
            "status": {"addresses": [{"type": "InternalIP", "address": "198.18.1.1"}]}}))
        .expect("node");
        let _ = Api::<Node>::all(client.clone()).create(&PostParams::default(), &node).await;
    });
    let mut loaded = 0;
    let mut results: BTreeMap<usize, (Measure, Measure)> = BTreeMap::new();
    for &n in &o.sizes {
        if n > loaded {
            rt.block_on(load(&client, loaded, n, o.endpoints));
            loaded = n;
        }
        let change = n == o.change_at;
        let ours = run_ours(&o, &rt, &client, n, change);
        eprintln!("bench: ours at {n}: {ours:?}");
        let kp = match &o.kube_proxy {
            Some(kp) => run_kube_proxy(&o, kp, &rt, &client, n, change, &server),
            None => Measure::default(),
        };
        eprintln!("bench: kube-proxy at {n}: {kp:?}");
        println!("RESULT full_sync_{n}x{} ours_s={} kube_proxy_s={} ratio={}", o.endpoints, fmt(ours.full_s), fmt(kp.full_s), ratio(kp.full_s, ours.full_s));
        if change {
            println!("RESULT one_change_at_{n} ours_s={} kube_proxy_s={} ratio={}", fmt(ours.change_s), fmt(kp.change_s), ratio(kp.change_s, ours.change_s));
        }
        println!(
            "RESULT peak_memory_{n} ours_mib={} kube_proxy_mib={} ratio={}",
            fmt(ours.peak_mib),
            fmt(kp.peak_mib),
            ratio(kp.peak_mib, ours.peak_mib)
        );
        results.insert(n, (ours, kp));
    }
    if o.kube_proxy.is_none() {
        println!("NOTE kube-proxy not measured (no --kube-proxy binary)");
    }
}
