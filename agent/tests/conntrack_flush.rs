//! Issue 30's conntrack fork storm, against the real agent, kernel and kube-apiserver: a
//! UDP Service with hundreds of externalIPs loses an endpoint. The agent must delete the
//! UDP entries DNATed to that endpoint for every one of its VIPs — and only those — without
//! starting a `conntrack` process (the `conntrack` first on the agent's PATH is a script
//! that notes each run in a file, then runs the real one). Before, the agent ran one
//! `conntrack -D` per VIP × removed endpoint, one after another, inside the sync loop.
//! The second test: a Service over `--max-service-addresses` keeps its ClusterIP only, and
//! externalIPs outside `--external-ip-cidrs` are not programmed.

mod common;

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;

use clusterip_agent::conntrack::ctnetlink::{Socket, Tuple, IPPROTO_TCP, IPPROTO_UDP};
use clusterip_agent::model::IpFamily;
use common::*;
use serde_json::json;

const SYNC: Duration = Duration::from_secs(60);

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `conntrack` that appends its arguments to `<dir>/conntrack.runs`, then runs the real one.
fn conntrack_spy() -> (TempDir, PathBuf, String) {
    let dir = TempDir(std::env::temp_dir().join(short_name("clusterip-conntrack-spy-")));
    std::fs::create_dir_all(&dir.0).expect("temp dir");
    let path = std::env::var("PATH").unwrap_or_default();
    let real = std::env::split_paths(&path).map(|d| d.join("conntrack")).find(|p| p.is_file());
    let runs = dir.0.join("conntrack.runs");
    let exec = real.map_or("exit 1".to_string(), |r| format!("exec '{}' \"$@\"", r.display()));
    let script = dir.0.join("conntrack");
    std::fs::write(&script, format!("#!/bin/sh\necho \"$*\" >> '{}'\n{exec}\n", runs.display())).expect("write the spy");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let agent_path = format!("{}:{path}", dir.0.display());
    (dir, runs, agent_path)
}

fn external_ip(i: usize) -> String {
    format!("198.18.{}.{}", 100 + i / 250, i % 250 + 1)
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

/// The node's IPv4 conntrack entries by kind: (protocol, destination port, reply source).
fn entries(ns: &Netns) -> HashMap<(u8, u16, IpAddr), usize> {
    let file = std::fs::File::open(format!("/run/netns/{}", ns.name)).expect("netns");
    let mut s = Socket::open(Some(&file)).expect("ctnetlink socket");
    let mut out = HashMap::new();
    s.dump_all(IpFamily::V4, |e| *out.entry((e.proto, e.orig.dport, e.reply.src)).or_insert(0) += 1).expect("dump");
    out
}

#[test]
fn a_udp_service_with_many_external_ips_loses_an_endpoint_without_a_conntrack_process() {
    let (_dir, runs, path) = conntrack_spy();
    let rt = runtime();
    let kns = KubeNs::new(rt);
    let topo = Topology::new(0);
    let proxy = short_name("c");
    let n = 600;
    let ext: Vec<String> = (0..n).map(external_ip).collect();
    let svc = kns.service(&proxy, "dns", json!({"ports": [{"port": 53, "protocol": "UDP", "targetPort": UDP_PORT}], "externalIPs": ext}));
    let (ep0, ep1) = (Topology::backend_ip(0), Topology::backend_ip(1));
    let udp = |s: &mut Slice| {
        s.protocol = "UDP";
        s.port = UDP_PORT;
    };
    kns.slice("dns", &[Ep::ready(&ep0), Ep::ready(&ep1)], udp);
    let flags = ["--metrics-bind-address", "127.0.0.1:0"];
    let agent = Agent::start_with_env(&topo.node.name, &KubeNs::kubeconfig(), &proxy, &flags, &[("PATH", path.as_str())]);
    let last = format!("{} . udp . 53", ext[n - 1]);
    wait_for("the externalIPs to be programmed", SYNC, || {
        ns_try(&topo.node.name, &["nft", "list", "map", "ip", "clusterip", "service-ips"]).filter(|m| m.contains(&last)).map(|_| ())
    });

    // For every VIP (the ClusterIP and the 600 externalIPs), flows DNATed to ep0 (to be
    // flushed), and flows the flush must keep: DNATed to ep1, TCP, another port.
    let vips: Vec<IpAddr> = std::iter::once(cluster_ip(&svc, false)).chain(ext.iter().cloned()).map(|v| ip(&v)).collect();
    let client = ip("198.18.1.2");
    let mut flows = Vec::new();
    for (i, vip) in vips.iter().enumerate() {
        let i = i as u16;
        for (proto, base, dport, ep) in [(IPPROTO_UDP, 10000, 53, &ep0), (IPPROTO_UDP, 20000, 53, &ep1), (IPPROTO_TCP, 30000, 53, &ep0), (IPPROTO_UDP, 40000, 54, &ep0)] {
            let orig = Tuple { src: client, dst: *vip, sport: base + i, dport };
            let reply = Tuple { src: ip(ep), dst: client, sport: UDP_PORT, dport: base + i };
            flows.push((proto, orig, reply));
        }
    }
    let file = std::fs::File::open(format!("/run/netns/{}", topo.node.name)).expect("netns");
    let created = Socket::open(Some(&file)).expect("ctnetlink socket").create(&flows, 600).expect("create conntrack entries");
    assert_eq!(created, flows.len());
    let v = vips.len();
    let (udp0, udp1, tcp0, other0) = ((IPPROTO_UDP, 53, ip(&ep0)), (IPPROTO_UDP, 53, ip(&ep1)), (IPPROTO_TCP, 53, ip(&ep0)), (IPPROTO_UDP, 54, ip(&ep0)));
    assert_eq!(entries(&topo.node).get(&udp0), Some(&v));

    kns.slice("dns", &[Ep::ready(&ep1)], udp);
    wait_for("the entries DNATed to the removed endpoint to be deleted", SYNC, || (!entries(&topo.node).contains_key(&udp0)).then_some(()));
    let left = entries(&topo.node);
    for (kind, what) in [(udp1, "UDP to the remaining endpoint"), (tcp0, "TCP"), (other0, "UDP to another port")] {
        assert_eq!(left.get(&kind), Some(&v), "{what}: {left:?}");
    }
    let spawned = std::fs::read_to_string(&runs).unwrap_or_default();
    assert!(spawned.is_empty(), "the agent ran conntrack {} times, e.g. `conntrack {}`", spawned.lines().count(), spawned.lines().next().unwrap_or(""));
    assert_eq!(agent.metric("clusterip_agent_conntrack_flush_failures_total"), Some(0.0));
    agent.assert_no_sync_failures();
}

#[test]
fn a_service_over_the_address_limit_keeps_its_cluster_ip_and_external_ips_are_allow_listed() {
    let rt = runtime();
    let kns = KubeNs::new(rt);
    let topo = Topology::new(0);
    let proxy = short_name("l");
    // 1 ClusterIP + 1100 externalIPs > the default limit (1024).
    let big_ext: Vec<String> = (0..1100).map(external_ip).collect();
    let big = kns.service(&proxy, "big", json!({"ports": [{"port": 53, "protocol": "UDP"}], "externalIPs": big_ext}));
    let small = kns.service(&proxy, "small", json!({"ports": [{"port": 53, "protocol": "UDP"}], "externalIPs": ["198.18.100.1", "198.18.200.1"]}));
    let flags = ["--metrics-bind-address", "127.0.0.1:0", "--external-ip-cidrs", "198.18.96.0/19,fd00:96::/64"];
    let agent = Agent::start(&topo.node.name, &KubeNs::kubeconfig(), &proxy, &flags);
    let small_vip = format!("{} . udp . 53", cluster_ip(&small, false));
    let map = wait_for("both Services to be programmed", SYNC, || {
        let m = ns_try(&topo.node.name, &["nft", "list", "map", "ip", "clusterip", "no-endpoint-services"])?;
        m.contains(&small_vip).then_some(m)
    });
    assert!(map.contains(&format!("{} . udp . 53", cluster_ip(&big, false))), "the big Service's ClusterIP is programmed: {map}");
    assert!(!map.contains("198.18.104.1 . udp"), "but none of its externalIPs");
    assert!(map.contains("198.18.100.1 . udp . 53"), "an allowed externalIP is programmed");
    assert!(!map.contains("198.18.200.1"), "an externalIP outside --external-ip-cidrs is not");
    assert_eq!(agent.metric("clusterip_agent_services_over_address_limit"), Some(1.0));
    assert_eq!(agent.metric("clusterip_agent_external_ips_ignored"), Some(1.0));
    assert!(agent.log().contains("over --max-service-addresses"), "the cut is logged");
    agent.assert_no_sync_failures();
}
