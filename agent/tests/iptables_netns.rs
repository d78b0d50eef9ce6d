//! The agent in iptables mode (`--mode iptables`), fed by the dev kube-apiserver,
//! programming a node network namespace.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use serde_json::json;

/// Deadline for the agent to program a change, on a loaded machine.
const SYNC: Duration = Duration::from_secs(60);
/// Timeout of one request that must succeed (a loaded machine only makes it slower).
const T: Duration = Duration::from_secs(10);

#[test]
fn iptables_mode_spreads_rejects_follows_changes_and_cleans_up() {
    let rt = runtime();
    let kns = KubeNs::new(rt);
    let topo = Topology::new(3);
    let ns = topo.node.name.clone();
    let proxy = short_name("i");
    let mut agent = Agent::start(&ns, &KubeNs::kubeconfig(), &proxy, &["--mode", "iptables"]);

    let svc = kns.service(&proxy, "web", json!({"ports": [{"port": 80, "targetPort": TCP_PORT}]}));
    let vip = cluster_ip(&svc, false);
    let mut eps: Vec<Ep> = (0..3).map(|i| Ep::ready(&Topology::backend_ip(i))).collect();
    kns.slice("web", &eps, |_| {});
    let empty = kns.service(&proxy, "empty", json!({"ports": [{"port": 81, "targetPort": TCP_PORT}]}));
    let empty_vip = cluster_ip(&empty, false);
    kns.slice("empty", &[], |_| {});

    let addr = sa(&vip, 80);
    wait_for("the VIP to answer", SYNC, || topo.tcp_get(addr, Duration::from_millis(500)).ok());
    let mut c: HashMap<String, usize> = HashMap::new();
    for _ in 0..60 {
        *c.entry(topo.tcp_get(addr, T).expect("connect")).or_insert(0) += 1;
    }
    for b in ["b0", "b1", "b2"] {
        // Binomial(60, 1/3): mean 20; P(< 5) is about 1e-5.
        assert!(c.get(b).copied().unwrap_or(0) >= 5, "{b}: {c:?}");
    }
    let save = ns_sh(&ns, &["iptables-save", "-t", "nat"]);
    assert!(save.contains("--probability 0.3333333"), "{save}");

    wait_for("the no-endpoint reject rule", SYNC, || {
        ns_sh(&ns, &["iptables-save", "-t", "filter"]).contains(&format!("-d {empty_vip}/32")).then_some(())
    });
    let err = topo.tcp_get(sa(&empty_vip, 81), T).expect_err("rejected");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");

    // b2 removed: no new connections to it after the next sync.
    eps.truncate(2);
    kns.slice("web", &eps, |_| {});
    let b2 = Topology::backend_ip(2);
    wait_for("b2's rules to go", SYNC, || (!ns_sh(&ns, &["iptables-save", "-t", "nat"]).contains(&b2)).then_some(()));
    for _ in 0..20 {
        assert_ne!(topo.tcp_get(addr, T).expect("connect"), "b2");
    }
    agent.assert_no_sync_failures();
    agent.stop();

    // Other components' KUBE- chains stay: the kubelet's canaries and its KUBE-FIREWALL (still
    // jumped to from INPUT); a jump of kube-proxy's own to KUBE-SERVICES goes with the chain.
    for cmd in [
        &["iptables", "-t", "nat", "-N", "KUBE-KUBELET-CANARY"][..],
        &["iptables", "-t", "filter", "-N", "KUBE-KUBELET-CANARY"],
        &["iptables", "-t", "filter", "-N", "KUBE-FIREWALL"],
        &["iptables", "-t", "filter", "-A", "INPUT", "-j", "KUBE-FIREWALL"],
        &["iptables", "-t", "nat", "-A", "OUTPUT", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"],
    ] {
        ns_sh(&ns, cmd);
    }
    let out = command(env!("CARGO_BIN_EXE_clusterip-agent"))
        .args(["--cleanup", "--netns", &ns])
        .output()
        .expect("run --cleanup");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let nat = ns_sh(&ns, &["iptables-save", "-t", "nat"]);
    let kube: Vec<&str> = nat.lines().filter(|l| l.contains("KUBE-")).collect();
    assert_eq!(kube, [":KUBE-KUBELET-CANARY - [0:0]"], "{nat}");
    assert!(!nat.lines().any(|l| l.starts_with("-A ")), "no nat rule left:\n{nat}");
    let filter = ns_sh(&ns, &["iptables-save", "-t", "filter"]);
    let kube: Vec<&str> = filter.lines().filter(|l| l.contains("KUBE-")).collect();
    assert_eq!(kube, [":KUBE-FIREWALL - [0:0]", ":KUBE-KUBELET-CANARY - [0:0]", "-A INPUT -j KUBE-FIREWALL"], "{filter}");
}
