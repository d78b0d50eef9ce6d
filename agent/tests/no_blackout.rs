//! No VIP blackout while the agent rebuilds its rules or restarts: a client namespace keeps
//! opening connections to several VIPs while (a) a failed sync forces a full rebuild and
//! (b) the agent process is killed (SIGKILL) and started again; not one connection may
//! fail. Many more Services than the probed ones make the ruleset big (10 endpoints each,
//! addresses nobody answers on: they are only rules).
//!
//! Size: `CLUSTERIP_BLACKOUT_SERVICES` (default 1000), transaction bound of the agent
//! `CLUSTERIP_BLACKOUT_MAX_OPS` (default 2000: at the default size an old-style rebuild
//! spans several transactions, as 10k Services do with the agent's default bound of 50 000).
//! `scripts/bench-agent-blackout.sh` runs it at 10k and prints the figures (lines
//! `RESULT …` on stderr).

mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;

use common::*;

/// Deadline for one programming step (a full sync at 10k on a loaded machine included).
const SYNC: Duration = Duration::from_secs(600);
/// Timeout of one probe connection (connect + answer): generous, a loaded machine only makes
/// a passing connection slower; a VIP without rules fails (host unreachable) or hangs.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// Services probed (with real backends).
const PROBED: usize = 4;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A filler endpoint address: 198.18.128.0/17, where nothing answers.
fn filler_ip(j: usize) -> String {
    let n = j % (1 << 15);
    format!("198.18.{}.{}", 128 + (n >> 8), n & 255)
}

fn slice_obj(ns: &str, svc: &str, ips: &[String]) -> EndpointSlice {
    let eps: Vec<serde_json::Value> =
        ips.iter().map(|ip| serde_json::json!({"addresses": [ip], "conditions": {"ready": true}, "nodeName": "elsewhere"})).collect();
    serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{svc}-1"), "namespace": ns, "labels": {
            "kubernetes.io/service-name": svc, "endpointslice.kubernetes.io/managed-by": "clusterip-agent-tests"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": TCP_PORT, "protocol": "TCP"}],
        "endpoints": eps,
    }))
    .expect("slice json")
}

/// Create Service `name` (labelled for `proxy`) and its slice with `ips`; the ClusterIP.
async fn create(client: &kube::Client, ns: &str, proxy: &str, name: &str, ips: &[String]) -> String {
    let svcs: Api<Service> = Api::namespaced(client.clone(), ns);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let svc: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"service.kubernetes.io/service-proxy-name": proxy}},
        "spec": {"ports": [{"name": "http", "port": 80, "targetPort": TCP_PORT}]}
    }))
    .expect("svc json");
    let mut stored = None;
    for attempt in 0..5 {
        match svcs.create(&PostParams::default(), &svc).await {
            Ok(s) => {
                stored = Some(s);
                break;
            }
            Err(e) if attempt == 4 => panic!("create service {name}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    let stored = stored.expect("created");
    let pp = PatchParams::apply("clusterip-agent-tests").force();
    for attempt in 0..5 {
        match slices.patch(&format!("{name}-1"), &pp, &Patch::Apply(&slice_obj(ns, name, ips))).await {
            Ok(_) => break,
            Err(e) if attempt == 4 => panic!("apply slice of {name}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    cluster_ip(&stored, false)
}

/// `total` Services: `PROBED` with the topology's backends (their VIPs returned), spread
/// among fillers `f<i>` of 10 unreachable endpoints each.
fn load(kns: &KubeNs, proxy: &str, total: usize, backends: usize) -> (Vec<String>, Vec<(String, String)>) {
    let start = Instant::now();
    let real: Vec<String> = (0..backends).map(Topology::backend_ip).collect();
    let every = (total / PROBED).max(1);
    let (client, ns) = (kns.client.clone(), kns.name.clone());
    let made: Vec<(bool, String, String)> = kns.rt.block_on(
        futures::stream::iter(0..total)
            .map(|i| {
                let (client, ns, real) = (client.clone(), ns.clone(), real.clone());
                async move {
                    let probed = i % every == every / 2 && i / every < PROBED;
                    let (name, ips) = if probed {
                        (format!("p{}", i / every), real)
                    } else {
                        (format!("f{i}"), (0..10).map(|j| filler_ip(i * 10 + j)).collect())
                    };
                    let vip = create(&client, &ns, proxy, &name, &ips).await;
                    (probed, name, vip)
                }
            })
            .buffer_unordered(32)
            .collect(),
    );
    eprintln!("RESULT blackout_load services={total} seconds={:.1}", start.elapsed().as_secs_f64());
    let probes: Vec<String> = made.iter().filter(|m| m.0).map(|m| m.2.clone()).collect();
    assert_eq!(probes.len(), PROBED, "probed Services created");
    let fillers = made.into_iter().filter(|m| !m.0).map(|m| (m.1, m.2)).collect();
    (probes, fillers)
}

/// Threads in the client namespace, each connecting to one VIP over and over until
/// stopped; every connection that does not bring a backend's name back is a failure.
struct Probes {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Probes {
    fn start(client_ns: &str, vips: &[String]) -> Probes {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let t0 = Instant::now();
        let threads = vips
            .iter()
            .map(|vip| {
                let addr: SocketAddr = sa(vip, 80);
                let (stop, ok, failures, path) = (stop.clone(), ok.clone(), failures.clone(), format!("/run/netns/{client_ns}"));
                std::thread::spawn(move || {
                    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
                    // SAFETY: setns on this thread only, with a valid namespace fd.
                    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                    assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
                    while !stop.load(Ordering::Relaxed) {
                        let at = t0.elapsed();
                        let r = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT).and_then(|mut s| {
                            s.set_read_timeout(Some(PROBE_TIMEOUT))?;
                            let mut out = String::new();
                            s.read_to_string(&mut out)?;
                            Ok(out)
                        });
                        match r {
                            Ok(name) if name.trim().starts_with('b') => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(other) => failures.lock().unwrap_or_else(|p| p.into_inner()).push(format!("{addr} at {at:?}: answer {other:?}")),
                            Err(e) => failures.lock().unwrap_or_else(|p| p.into_inner()).push(format!("{addr} at {at:?}: {e}")),
                        }
                    }
                })
            })
            .collect();
        Probes { stop, ok, failures, threads }
    }

    fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    fn failures(&self) -> Vec<String> {
        self.failures.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Wait until `n` more connections succeeded than `since` (the probes ran meanwhile).
    fn wait_more(&self, since: u64, n: u64) {
        wait_for("the probes to make connections", SYNC, || (self.ok() >= since + n).then_some(()));
    }

    fn stop(mut self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        (self.ok(), self.failures())
    }
}

impl Drop for Probes {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// `elapsed_ms` of the `n`-th (0-based) "sync done" line with `full=true` in `log`.
fn full_sync_ms(log: &str, n: usize) -> Option<u64> {
    let line = log.lines().filter(|l| l.contains("sync done") && l.contains("full=true")).nth(n)?;
    line.split_whitespace().find_map(|w| w.strip_prefix("elapsed_ms="))?.parse().ok()
}

fn full_syncs(agent: &Agent) -> usize {
    agent.log_count(&["sync done", "full=true"])
}

#[test]
fn vips_keep_answering_through_a_forced_rebuild_and_an_agent_restart() {
    let total = env_usize("CLUSTERIP_BLACKOUT_SERVICES", 1000).max(PROBED + 2);
    let max_ops = env_usize("CLUSTERIP_BLACKOUT_MAX_OPS", 2000).to_string();
    let rt = runtime();
    let kns = KubeNs::new(rt);
    let topo = Topology::new(3);
    let proxy = short_name("nb");
    let (vips, fillers) = load(&kns, &proxy, total, 3);
    let node = topo.node.name.clone();
    let flags = ["--max-ops-per-transaction", max_ops.as_str(), "--sync-period", "1h", "--verify-period", "0"];
    let mut agent = Agent::start(&node, &KubeNs::kubeconfig(), &proxy, &flags);
    wait_for("the first sync", SYNC, || (full_syncs(&agent) >= 1).then_some(()));
    for vip in &vips {
        wait_for(&format!("{vip} to answer"), SYNC, || topo.tcp_get(sa(vip, 80), Duration::from_secs(2)).ok());
    }
    let probes = Probes::start(&topo.client.name, &vips);
    probes.wait_more(0, 20);

    // (a) A sync fails (an element the agent will delete was deleted behind its back: the
    // kernel refuses the transaction), so the next one rebuilds everything.
    let (victim, victim_vip) = &fillers[0];
    ns_sh(&node, &["nft", "delete", "element", "ip", "clusterip", "service-ips", &format!("{{ {victim_vip} . tcp . 80 }}")]);
    let api: Api<Service> = Api::namespaced(kns.client.clone(), &kns.name);
    kns.rt.block_on(api.delete(victim, &DeleteParams::default())).expect("delete the victim Service");
    let before = probes.ok();
    wait_for("a failed sync", SYNC, || (agent.log_count(&["sync failed"]) >= 1).then_some(()));
    wait_for("the rebuild after it", SYNC, || (full_syncs(&agent) >= 2).then_some(()));
    probes.wait_more(before, 20);
    let log = agent.log();
    let rebuild_ms = full_sync_ms(&log, 1);

    // (b) The agent is killed and started again; a Service deleted meanwhile must go too.
    let (gone, _) = &fillers[1];
    let before = probes.ok();
    let killed = Instant::now();
    agent.kill();
    drop(agent);
    kns.rt.block_on(api.delete(gone, &DeleteParams::default())).expect("delete a Service while the agent is down");
    let agent = Agent::start(&node, &KubeNs::kubeconfig(), &proxy, &flags);
    wait_for("the restarted agent's first sync", SYNC, || (full_syncs(&agent) >= 1).then_some(()));
    let restart = killed.elapsed();
    probes.wait_more(before, 20);
    let gone_chain = format!("svc-{}/{gone}/tcp/http", kns.name);
    wait_for("the chain of the Service deleted while the agent was down to go", SYNC, || {
        (!ns_sh(&node, &["nft", "-j", "list", "chains", "ip"]).contains(&gone_chain)).then_some(())
    });
    let first_ms = full_sync_ms(&agent.log(), 0);
    let (ok, failures) = probes.stop();

    eprintln!(
        "RESULT blackout services={total} max_ops={max_ops} connections_ok={ok} connections_failed={} rebuild_ms={} restart_first_sync_ms={} restart_kill_to_synced_s={:.2}",
        failures.len(),
        rebuild_ms.map_or("?".into(), |v| v.to_string()),
        first_ms.map_or("?".into(), |v| v.to_string()),
        restart.as_secs_f64()
    );
    assert!(failures.is_empty(), "{} of {} connections failed, first ones: {:?}", failures.len(), ok as usize + failures.len(), &failures[..failures.len().min(10)]);
    let log = agent.log();
    assert!(log.contains("adopting the table"), "the restarted agent adopted the table:\n{log}");
    assert!(!log.contains("sync failed"), "the restarted agent's syncs all succeeded:\n{log}");
}

#[test]
fn iptables_mode_keeps_vips_through_a_restart_and_removes_chains_of_services_gone_meanwhile() {
    let total = env_usize("CLUSTERIP_BLACKOUT_IPTABLES_SERVICES", 200).max(PROBED + 2);
    let rt = runtime();
    let kns = KubeNs::new(rt);
    let topo = Topology::new(3);
    let proxy = short_name("ni");
    let (vips, fillers) = load(&kns, &proxy, total, 3);
    let node = topo.node.name.clone();
    let flags = ["--mode", "iptables", "--sync-period", "1h", "--verify-period", "0"];
    let mut agent = Agent::start(&node, &KubeNs::kubeconfig(), &proxy, &flags);
    wait_for("the first sync", SYNC, || (full_syncs(&agent) >= 1).then_some(()));
    for vip in &vips {
        wait_for(&format!("{vip} to answer"), SYNC, || topo.tcp_get(sa(vip, 80), Duration::from_secs(2)).ok());
    }
    // The chains of the Service that will be deleted while the agent is down.
    let (gone, gone_vip) = &fillers[0];
    let save = ns_sh(&node, &["iptables-save", "-t", "nat"]);
    let gone_chains: Vec<String> = save
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES") && l.contains(&format!("-d {gone_vip}/32")))
        .filter_map(|l| l.split_whitespace().last().map(str::to_string))
        .collect();
    assert_eq!(gone_chains.len(), 1, "one KUBE-SVC chain for {gone}:\n{save}");

    let probes = Probes::start(&topo.client.name, &vips);
    probes.wait_more(0, 20);
    let before = probes.ok();
    agent.kill();
    drop(agent);
    let api: Api<Service> = Api::namespaced(kns.client.clone(), &kns.name);
    kns.rt.block_on(api.delete(gone, &DeleteParams::default())).expect("delete a Service while the agent is down");
    let agent = Agent::start(&node, &KubeNs::kubeconfig(), &proxy, &flags);
    wait_for("the restarted agent's first sync", SYNC, || (full_syncs(&agent) >= 1).then_some(()));
    probes.wait_more(before, 20);
    let (ok, failures) = probes.stop();
    eprintln!("RESULT blackout_iptables services={total} connections_ok={ok} connections_failed={}", failures.len());
    assert!(failures.is_empty(), "{} of {} connections failed, first ones: {:?}", failures.len(), ok as usize + failures.len(), &failures[..failures.len().min(10)]);
    let save = ns_sh(&node, &["iptables-save", "-t", "nat"]);
    for c in &gone_chains {
        assert!(!save.contains(c.as_str()), "chain {c} of {gone}, deleted while the agent was down, is still there");
    }
    agent.assert_no_sync_failures();
}
