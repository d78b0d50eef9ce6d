//! The agent in nftables mode, fed by the dev kube-apiserver, programming a node network
//! namespace; traffic from a client namespace to backend namespaces (see `common`).

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// Timeout of one request that must succeed (connect + answer): generous, a loaded machine
/// only makes passing requests slower. Requests that must fail use their own short timeout.
const T: Duration = Duration::from_secs(10);
/// Deadline for the agent to program a change (watch, sync, kernel), on a loaded machine.
const SYNC: Duration = Duration::from_secs(60);

struct Setup {
    kns: KubeNs,
    agent: Agent,
    topo: Topology,
}

fn setup(backends: usize, extra: &[&str]) -> Setup {
    setup_then(backends, extra, |_| {})
}

/// `setup`, running `before_agent` on the topology before the agent starts.
fn setup_then(backends: usize, extra: &[&str], before_agent: impl FnOnce(&Topology)) -> Setup {
    let rt = runtime();
    let kns = KubeNs::new(rt);
    let topo = Topology::new(backends);
    before_agent(&topo);
    let proxy = short_name("p");
    let agent = Agent::start(&topo.node.name, &KubeNs::kubeconfig(), &proxy, extra);
    Setup { kns, agent, topo }
}

fn counts(topo: &Topology, addr: std::net::SocketAddr, n: usize) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for _ in 0..n {
        let who = topo.tcp_get(addr, T).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        *m.entry(who).or_insert(0) += 1;
    }
    m
}

/// Wait until a TCP request to `addr` is answered.
fn wait_reachable(topo: &Topology, addr: std::net::SocketAddr) -> String {
    wait_for(&format!("{addr} to answer"), SYNC, || topo.tcp_get(addr, Duration::from_millis(500)).ok())
}

#[test]
fn vip_reaches_only_ready_endpoints_and_follows_changes() {
    let s = setup(4, &[]);
    let svc = s.kns.service(&s.agent.proxy_name, "web", json!({"ports": [{"name": "http", "port": 80, "targetPort": TCP_PORT}]}));
    let vip = cluster_ip(&svc, false);
    let mut eps: Vec<Ep> = (0..4).map(|i| Ep::ready(&Topology::backend_ip(i))).collect();
    eps[3].ready = Some(false);
    eps[3].serving = Some(false);
    s.kns.slice("web", &eps, |s| s.port_name = "http");
    let addr = sa(&vip, 80);
    wait_reachable(&s.topo, addr);

    let c = counts(&s.topo, addr, 90);
    assert!(!c.contains_key("b3"), "not-ready endpoint got traffic: {c:?}");
    for b in ["b0", "b1", "b2"] {
        // Binomial(90, 1/3): mean 30, P(< 10) is about 1e-6.
        assert!(c.get(b).copied().unwrap_or(0) >= 10, "{b} got too little of the traffic: {c:?}");
    }

    // b1 turns not-ready, b2 is removed: after the next sync they get no new connections.
    eps[1].ready = Some(false);
    eps.remove(2);
    s.kns.slice("web", &eps, |s| s.port_name = "http");
    let b1 = Topology::backend_ip(1);
    let b2 = Topology::backend_ip(2);
    wait_for("rules without b1 and b2", SYNC, || {
        let t = s.topo.nft_table("ip");
        (!t.contains(&b1) && !t.contains(&b2)).then_some(())
    });
    let c = counts(&s.topo, addr, 30);
    assert_eq!(c.keys().cloned().collect::<Vec<_>>(), vec!["b0".to_string()], "only b0 is ready now: {c:?}");
    s.agent.assert_no_sync_failures();
}

#[test]
fn service_without_endpoints_is_rejected_not_blackholed() {
    let s = setup(1, &[]);
    let svc = s.kns.service(&s.agent.proxy_name, "empty", json!({"ports": [{"port": 81, "targetPort": TCP_PORT}]}));
    let vip = cluster_ip(&svc, false);
    s.kns.slice("empty", &[], |_| {});
    wait_for("the no-endpoint entry", SYNC, || s.topo.nft_table("ip").contains(&format!("{vip} . tcp . 81 : goto reject-chain")).then_some(()));
    // Refused (a TCP reset) is the reject; a black hole would end in TimedOut instead. The
    // error kind says which, however long the machine takes to deliver it.
    let err = s.topo.tcp_get(sa(&vip, 81), T).expect_err("must not connect");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");

    // An endpoint appears: the same VIP answers.
    s.kns.slice("empty", &[Ep::ready(&Topology::backend_ip(0))], |_| {});
    assert_eq!(wait_reachable(&s.topo, sa(&vip, 81)), "b0");
    s.agent.assert_no_sync_failures();
}

#[test]
fn ipv6_vip_works() {
    let s = setup(2, &[]);
    let svc = s.kns.service(
        &s.agent.proxy_name,
        "web6",
        json!({"ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv6"], "ports": [{"port": 80, "targetPort": TCP_PORT}]}),
    );
    let vip = cluster_ip(&svc, true);
    let eps: Vec<Ep> = (0..2).map(|i| Ep::ready(&Topology::backend_ip6(i))).collect();
    s.kns.slice("web6", &eps, |s| s.family = "IPv6");
    let addr = sa(&vip, 80);
    wait_reachable(&s.topo, addr);
    let c = counts(&s.topo, addr, 40);
    assert!(c.keys().all(|k| k == "b0" || k == "b1"), "{c:?}");
    assert_eq!(c.len(), 2, "both IPv6 endpoints used: {c:?}");
    assert!(s.topo.nft_table("ip6").contains("table ip6 clusterip"));
    s.agent.assert_no_sync_failures();
}

#[test]
fn node_port_reaches_the_service() {
    let s = setup(2, &[]);
    let svc = s.kns.service(&s.agent.proxy_name, "np", json!({"type": "NodePort", "ports": [{"port": 80, "targetPort": TCP_PORT}]}));
    let node_port = svc.spec.as_ref().and_then(|s| s.ports.as_ref()).and_then(|p| p[0].node_port).expect("nodePort allocated");
    let node_port = u16::try_from(node_port).expect("port");
    let eps: Vec<Ep> = (0..2).map(|i| Ep::ready(&Topology::backend_ip(i))).collect();
    s.kns.slice("np", &eps, |_| {});
    let who = wait_reachable(&s.topo, sa(Topology::NODE_IP, node_port));
    assert!(who == "b0" || who == "b1", "{who}");
    s.agent.assert_no_sync_failures();
}

#[test]
fn local_policy_without_local_endpoint_drops() {
    let s = setup(2, &[]);
    let svc = s.kns.service(
        &s.agent.proxy_name,
        "loc",
        json!({"internalTrafficPolicy": "Local", "ports": [{"port": 80, "targetPort": TCP_PORT}]}),
    );
    let vip = cluster_ip(&svc, false);
    s.kns.slice("loc", &[Ep::ready(&Topology::backend_ip(0))], |_| {});
    wait_for("the drop entry", SYNC, || s.topo.nft_table("ip").contains(&format!("{vip} . tcp . 80 : drop")).then_some(()));
    let start = Instant::now();
    let err = s.topo.tcp_get(sa(&vip, 80), Duration::from_millis(1500)).expect_err("must be dropped");
    assert!(
        matches!(err.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock),
        "dropped (timeout), not refused: {err:?}"
    );
    assert!(start.elapsed() >= Duration::from_millis(1400));

    // A local endpoint appears: only it is used.
    let mut local = Ep::ready(&Topology::backend_ip(1));
    local.node = Some(s.agent.node_name.clone());
    s.kns.slice("loc", &[Ep::ready(&Topology::backend_ip(0)), local], |_| {});
    wait_reachable(&s.topo, sa(&vip, 80));
    let c = counts(&s.topo, sa(&vip, 80), 20);
    assert_eq!(c.get("b1"), Some(&20), "{c:?}");
    s.agent.assert_no_sync_failures();
}

#[test]
fn terminating_endpoints_are_used_when_none_is_ready() {
    let s = setup(2, &[]);
    let svc = s.kns.service(&s.agent.proxy_name, "term", json!({"ports": [{"port": 80, "targetPort": TCP_PORT}]}));
    let vip = cluster_ip(&svc, false);
    let mut term = Ep::ready(&Topology::backend_ip(0));
    term.ready = Some(false);
    term.terminating = Some(true);
    let mut gone = Ep::ready(&Topology::backend_ip(1));
    gone.ready = Some(false);
    gone.serving = Some(false);
    gone.terminating = Some(true);
    s.kns.slice("term", &[term, gone], |_| {});
    wait_reachable(&s.topo, sa(&vip, 80));
    let c = counts(&s.topo, sa(&vip, 80), 20);
    assert_eq!(c.get("b0"), Some(&20), "only the serving terminating endpoint: {c:?}");
    s.agent.assert_no_sync_failures();
}

#[test]
fn client_ip_affinity_sticks_then_expires() {
    const TIMEOUT_S: u64 = 2;
    let s = setup(3, &[]);
    let svc = s.kns.service(
        &s.agent.proxy_name,
        "sticky",
        json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": TIMEOUT_S}},
               "ports": [{"port": 80, "targetPort": TCP_PORT}]}),
    );
    let vip = cluster_ip(&svc, false);
    let eps: Vec<Ep> = (0..3).map(|i| Ep::ready(&Topology::backend_ip(i))).collect();
    s.kns.slice("sticky", &eps, |_| {});
    let addr = sa(&vip, 80);
    wait_reachable(&s.topo, addr);

    // What affinity promises: a connection made within the timeout of the client's previous
    // one goes to the same endpoint (each new connection refreshes the client's entry).
    // The time between the two connections' first packets is at most "after this one" −
    // "before the previous one"; only pairs within the timeout (minus 200 ms for the
    // kernel's timer) are judged — on a stalled machine a later pair may legitimately move,
    // and is skipped. 29 judged pairs: without affinity (a random choice among 3) each
    // passes with probability 1/3.
    let within = Duration::from_secs(TIMEOUT_S) - Duration::from_millis(200);
    let (mut judged, mut skipped) = (0, 0);
    let mut prev: Option<(Instant, String)> = None;
    // (Connections one after the other, no pause: each takes its own time.)
    wait_ok(&format!("29 connection pairs within {within:?} of each other"), Duration::from_secs(300), Duration::ZERO, || {
        let before = Instant::now();
        let who = s.topo.tcp_get(addr, T).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        let after = Instant::now();
        if let Some((prev_before, prev_who)) = &prev {
            if after.duration_since(*prev_before) < within {
                assert_eq!(&who, prev_who, "a connection {:?} after the previous one moved to another endpoint", after.duration_since(*prev_before));
                judged += 1;
            } else {
                skipped += 1;
            }
        }
        prev = Some((before, who));
        if judged >= 29 {
            Ok(())
        } else {
            Err(format!("only {judged} judged ({skipped} further apart)"))
        }
    });

    // The client's entry exists after a connection, then expires once it stops connecting.
    let has_client_entry = || s.topo.nft_table("ip").lines().any(|l| l.contains("elements = { 198.18.1.2"));
    wait_for("the client's affinity entry right after a connection", Duration::from_secs(300), || {
        let before = Instant::now();
        s.topo.tcp_get(addr, T).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        if has_client_entry() {
            return Some(());
        }
        // Missing while the timeout cannot have passed: affinity is broken.
        assert!(before.elapsed() >= within, "no affinity entry for the client right after its connection:\n{}", s.topo.nft_table("ip"));
        None
    });
    wait_for("the affinity entry to expire", SYNC, || (!has_client_entry()).then_some(()));
    s.agent.assert_no_sync_failures();
}

#[test]
fn udp_conntrack_entries_of_removed_endpoints_are_flushed() {
    let s = setup(2, &[]);
    let svc = s.kns.service(&s.agent.proxy_name, "dns", json!({"ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": UDP_PORT}]}));
    let vip = cluster_ip(&svc, false);
    let eps: Vec<Ep> = (0..2).map(|i| Ep::ready(&Topology::backend_ip(i))).collect();
    s.kns.slice("dns", &eps, |s| { s.port_name = "dns"; s.protocol = "UDP"; s.port = UDP_PORT });
    let addr = sa(&vip, 53);
    // One socket, one source port, for the whole test: the same 5-tuple throughout.
    let client = s.topo.udp_client(false, 40053);
    let first = wait_for("a UDP answer", SYNC, || client.ask(addr, Duration::from_millis(300)).ok());
    // Same 5-tuple: conntrack keeps it on the same backend.
    for _ in 0..5 {
        assert_eq!(client.ask(addr, T).expect("udp answer"), first);
    }
    // Remove that endpoint (its responder keeps running): the flow must move.
    let keep: Vec<Ep> = eps.into_iter().filter(|e| !e.ip.ends_with(if first == "b0" { ".10" } else { ".11" })).collect();
    assert_eq!(keep.len(), 1);
    s.kns.slice("dns", &keep, |s| { s.port_name = "dns"; s.protocol = "UDP"; s.port = UDP_PORT });
    let other = if first == "b0" { "b1" } else { "b0" };
    wait_for("the UDP flow to move to the remaining endpoint", SYNC, || {
        (client.ask(addr, Duration::from_millis(300)).ok()? == other).then_some(())
    });
    s.agent.assert_no_sync_failures();
}

#[test]
fn rules_changed_behind_our_back_are_repaired() {
    let s = setup(1, &["--sync-period", "2s", "--verify-period", "1s"]);
    let svc = s.kns.service(&s.agent.proxy_name, "drift", json!({"ports": [{"port": 80, "targetPort": TCP_PORT}]}));
    let vip = cluster_ip(&svc, false);
    s.kns.slice("drift", &[Ep::ready(&Topology::backend_ip(0))], |_| {});
    wait_reachable(&s.topo, sa(&vip, 80));
    let drift = "rules changed behind our back";
    let drift_before = s.agent.log_count(&[drift]);
    {
        // The agent repairs within about a second: keep it stopped while the test checks
        // that the flush did break the VIP (otherwise "repaired" would prove nothing).
        let _paused = s.agent.pause();
        ns_sh(&s.topo.node.name, &["nft", "flush", "chain", "ip", "clusterip", "services"]);
        assert!(s.topo.tcp_get(sa(&vip, 80), Duration::from_millis(500)).is_err(), "the flush broke the VIP");
    }
    assert_eq!(wait_reachable(&s.topo, sa(&vip, 80)), "b0", "repaired by the full resync");
    assert!(s.agent.log_count(&[drift]) > drift_before, "the repair came from drift detection:\n{}", s.agent.log());
    s.agent.assert_no_sync_failures();
}

#[test]
fn cleanup_leaves_the_namespace_as_found() {
    // The ruleset as found is taken before the agent starts (its first sync, which creates
    // the tables, may come at any time after).
    let mut before_nft = String::new();
    let mut s = setup_then(1, &[], |topo| before_nft = ns_sh(&topo.node.name, &["nft", "list", "ruleset"]));
    let ns = s.topo.node.name.clone();
    let svc = s.kns.service(&s.agent.proxy_name, "c", json!({"ports": [{"port": 80, "targetPort": TCP_PORT}]}));
    let vip = cluster_ip(&svc, false);
    s.kns.slice("c", &[Ep::ready(&Topology::backend_ip(0))], |_| {});
    wait_reachable(&s.topo, sa(&vip, 80));
    s.agent.assert_no_sync_failures();
    s.agent.stop();
    assert!(s.topo.nft_table("ip").contains("clusterip"), "rules stay after the agent stops");
    let out = command(env!("CARGO_BIN_EXE_clusterip-agent"))
        .args(["--cleanup", "--netns", &ns])
        .output()
        .expect("run --cleanup");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(ns_sh(&ns, &["nft", "list", "ruleset"]), before_nft);
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, T).ok()?;
    s.set_read_timeout(Some(T)).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n")?.1.to_string();
    Some((code, body))
}

#[test]
fn healthz_livez_and_metrics() {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{DeleteParams, PostParams};
    // Port 0: the agent binds free ports itself and logs them (a port picked by the test
    // could be taken by another process before the agent binds it). A sync period longer
    // than the test: its only full sync is the first one.
    let s = setup(1, &["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0", "--sync-period", "1h"]);
    let (hp, mp) = (s.agent.listening_addr("healthz"), s.agent.listening_addr("metrics"));
    let svc = s.kns.service(&s.agent.proxy_name, "h", json!({"ports": [{"port": 80, "targetPort": TCP_PORT}]}));
    let vip = cluster_ip(&svc, false);
    s.kns.slice("h", &[Ep::ready(&Topology::backend_ip(0))], |_| {});
    wait_reachable(&s.topo, sa(&vip, 80));

    let (code, body) = wait_for("/livez", SYNC, || http_get(hp, "/livez"));
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"healthy\":true"), "{body}");
    // No Node object for this node: not eligible for load-balancer traffic.
    let (code, body) = http_get(hp, "/healthz").expect("/healthz");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"nodeEligible\":false"), "{body}");

    let rt = s.kns.rt.clone();
    let nodes: kube::Api<Node> = kube::Api::all(s.kns.client.clone());
    let node: Node = serde_json::from_value(json!({"metadata": {"name": s.agent.node_name}})).expect("node");
    rt.block_on(nodes.create(&PostParams::default(), &node)).expect("create node");
    let healthy = wait_for("/healthz 200 once the Node exists", SYNC, || http_get(hp, "/healthz").filter(|(c, _)| *c == 200));
    rt.block_on(nodes.delete(&s.agent.node_name, &DeleteParams::default())).expect("delete node");
    assert!(healthy.1.contains("\"nodeEligible\":true"), "{}", healthy.1);

    // The metrics of a sync are set before its "sync done" line is logged.
    wait_for("the first full sync's log line", SYNC, || (s.agent.log_count(&["sync done", "full=true"]) > 0).then_some(()));
    let (code, metrics) = http_get(mp, "/metrics").expect("/metrics");
    assert_eq!(code, 200);
    assert!(metrics.contains("clusterip_agent_sync_full_proxy_rules_duration_seconds_count 1\n"), "{metrics}");
    assert_eq!(s.agent.log_count(&["sync done", "full=true"]), 1, "one full sync (the sync period is 1 h):\n{}", s.agent.log());
    assert!(metrics.contains("clusterip_agent_sync_proxy_rules_failures_total 0"), "{metrics}");
    let rules_line = metrics.lines().find(|l| l.starts_with("clusterip_agent_sync_proxy_rules_programmed{kind=\"chains\"}")).expect("rule count");
    let chains: f64 = rules_line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("value");
    assert!(chains >= 15.0, "{rules_line}");
    assert_eq!(http_get(mp, "/nope").map(|r| r.0), Some(404));
    s.agent.assert_no_sync_failures();
}

#[test]
fn external_ip_reaches_the_service() {
    let s = setup(2, &[]);
    s.kns.service(
        &s.agent.proxy_name,
        "ext",
        json!({"externalIPs": ["198.18.9.9"], "ports": [{"port": 80, "targetPort": TCP_PORT}]}),
    );
    let eps: Vec<Ep> = (0..2).map(|i| Ep::ready(&Topology::backend_ip(i))).collect();
    s.kns.slice("ext", &eps, |_| {});
    let who = wait_reachable(&s.topo, sa("198.18.9.9", 80));
    assert!(who == "b0" || who == "b1", "{who}");
    s.agent.assert_no_sync_failures();
}

#[test]
fn hairpin_a_backend_reaching_itself_through_the_vip() {
    let s = setup(1, &[]);
    let svc = s.kns.service(&s.agent.proxy_name, "hp", json!({"ports": [{"port": 80, "targetPort": TCP_PORT}]}));
    let vip = cluster_ip(&svc, false);
    // The only endpoint is on this node: the backend connecting to the VIP lands on itself,
    // which works only if the connection is masqueraded (hairpin).
    let mut ep = Ep::ready(&Topology::backend_ip(0));
    ep.node = Some(s.agent.node_name.clone());
    s.kns.slice("hp", &[ep], |_| {});
    wait_reachable(&s.topo, sa(&vip, 80));
    let b0 = s.topo.backends[0].name.clone();
    let who = wait_for("the backend to reach itself through the VIP", SYNC, || {
        tcp_get_in(&b0, sa(&vip, 80), Duration::from_millis(500)).ok()
    });
    assert_eq!(who, "b0");
    s.agent.assert_no_sync_failures();
}

#[test]
fn load_balancer_source_ranges_are_enforced() {
    use k8s_openapi::api::core::v1::Service;
    use kube::api::{Patch, PatchParams};
    let s = setup(1, &[]);
    s.kns.service(
        &s.agent.proxy_name,
        "lb",
        json!({"type": "LoadBalancer", "loadBalancerSourceRanges": ["198.18.1.0/24"], "ports": [{"port": 80, "targetPort": TCP_PORT}]}),
    );
    s.kns.slice("lb", &[Ep::ready(&Topology::backend_ip(0))], |_| {});
    let api: kube::Api<Service> = kube::Api::namespaced(s.kns.client.clone(), &s.kns.name);
    let status = json!({"status": {"loadBalancer": {"ingress": [{"ip": "198.18.8.8"}]}}});
    s.kns.rt.block_on(api.patch_status("lb", &PatchParams::default(), &Patch::Merge(&status))).expect("set LB status");
    // The client (198.18.1.2) is inside the allowed range.
    assert_eq!(wait_reachable(&s.topo, sa("198.18.8.8", 80)), "b0");
    // Narrow the ranges to exclude it: its new connections are dropped.
    let spec = json!({"spec": {"loadBalancerSourceRanges": ["198.18.7.0/24"]}});
    s.kns.rt.block_on(api.patch("lb", &PatchParams::default(), &Patch::Merge(&spec))).expect("narrow ranges");
    wait_for("the firewall rule with the new range", SYNC, || s.topo.nft_table("ip").contains("198.18.7.0/24").then_some(()));
    let err = s.topo.tcp_get(sa("198.18.8.8", 80), Duration::from_millis(1500)).expect_err("dropped");
    assert!(matches!(err.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock), "{err:?}");
    s.agent.assert_no_sync_failures();
}

/// GET http://addr/ from namespace `ns`, as a load balancer's check does (one request, then
/// the connection closed): (status, headers+body, header names lower-cased — HTTP's names
/// are case-insensitive).
fn http_get_in(ns: &str, addr: std::net::SocketAddr) -> Option<(u16, String)> {
    in_netns(ns, || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
        s.set_read_timeout(Some(T)).ok()?;
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
        let out = format!("{}\r\n\r\n{body}", head.to_ascii_lowercase());
        Some((out.split_whitespace().nth(1)?.parse().ok()?, out))
    })
}

#[test]
fn health_check_node_port_reports_local_endpoints() {
    let s = setup(2, &[]);
    let svc = s.kns.service(
        &s.agent.proxy_name,
        "hc",
        json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "ports": [{"port": 80, "targetPort": TCP_PORT}]}),
    );
    let hc = svc.spec.as_ref().and_then(|s| s.health_check_node_port).expect("healthCheckNodePort allocated");
    let addr = sa(Topology::NODE_IP, u16::try_from(hc).expect("port"));
    let mut local = Ep::ready(&Topology::backend_ip(0));
    local.node = Some(s.agent.node_name.clone());
    s.kns.slice("hc", &[local, Ep::ready(&Topology::backend_ip(1))], |_| {});
    let (code, text) = wait_for("the health check node port", SYNC, || http_get_in(&s.topo.client.name, addr).filter(|r| r.0 == 200));
    assert_eq!(code, 200);
    assert!(text.contains("x-load-balancing-endpoint-weight: 1"), "{text}");
    assert!(text.contains("\"localEndpoints\":1"), "{text}");
    // No local endpoint any more: 503, so load balancers skip this node.
    s.kns.slice("hc", &[Ep::ready(&Topology::backend_ip(1))], |_| {});
    let (_, text) = wait_for("503 without local endpoints", SYNC, || http_get_in(&s.topo.client.name, addr).filter(|r| r.0 == 503));
    assert!(text.contains("\"localEndpoints\":0"), "{text}");
    s.agent.assert_no_sync_failures();
}

#[test]
fn health_check_node_port_that_cannot_be_opened_is_reported_then_retried() {
    let s = setup(1, &["--sync-period", "2s"]);
    // Hold a port in the node namespace, then give it to a Service as its health-check
    // node port (another test may hold a candidate in the apiserver: try the next).
    let api: kube::Api<k8s_openapi::api::core::v1::Service> = kube::Api::namespaced(s.kns.client.clone(), &s.kns.name);
    let start = 30000 + (std::process::id() % 2000) as u16;
    let mut held = None;
    for port in (start..32768).chain(30000..start).take(200) {
        let listener = in_netns(&s.topo.node.name, || std::net::TcpListener::bind(("0.0.0.0", port))).expect("bind in the fresh node namespace");
        let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(json!({
            "metadata": {"name": "hcfail", "labels": {"service.kubernetes.io/service-proxy-name": s.agent.proxy_name}},
            "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": port, "ports": [{"port": 80, "targetPort": TCP_PORT}]},
        }))
        .expect("service json");
        if s.kns.rt.block_on(api.create(&kube::api::PostParams::default(), &svc)).is_ok() {
            held = Some((port, listener));
            break;
        }
    }
    let (port, listener) = held.expect("a free health-check node port");
    let events: kube::Api<k8s_openapi::api::events::v1::Event> = kube::Api::namespaced(s.kns.client.clone(), &s.kns.name);
    let ev = wait_for("the FailedToStartServiceHealthcheck Event", SYNC, || {
        let list = s.kns.rt.block_on(events.list(&Default::default())).ok()?;
        list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("FailedToStartServiceHealthcheck") && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("hcfail")
        })
    });
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    let note = ev.note.unwrap_or_default();
    assert!(note.contains(&format!("on port {port}")) && note.contains("hcfail"), "{note}");
    assert_eq!(ev.regarding.as_ref().and_then(|r| r.kind.as_deref()), Some("Service"));
    // Once the port is free, a later sync opens it (503: no local endpoint).
    drop(listener);
    let addr = sa(Topology::NODE_IP, port);
    let (code, _) = wait_for("the health check node port after the retry", SYNC, || http_get_in(&s.topo.client.name, addr));
    assert_eq!(code, 503);
    s.agent.assert_no_sync_failures();
}
