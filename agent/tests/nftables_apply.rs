//! The nftables dataplane against the real kernel (in a namespace of its own), without
//! a cluster: every rendered transaction must be accepted by nft, the kernel must match
//! the mirror after each sync, and drift must be detected.

mod common;


use clusterip_agent::model::service::ServicePort;
use clusterip_agent::model::state::DesiredPort;
use clusterip_agent::model::topology::Categorized;
use clusterip_agent::model::{Endpoint, NamespacedName, Protocol};
use clusterip_agent::netns::Executor;
use clusterip_agent::nftables::render::RenderOptions;
use clusterip_agent::nftables::NftablesProxier;
use clusterip_agent::proxier::{Proxier, SyncBatch};
use common::{ip, ns_sh, sa, Netns, Topology, UDP_PORT};

fn eps(prefix: &str, n: usize) -> Vec<Endpoint> {
    (0..n).map(|i| Endpoint::ready(ip(&format!("{prefix}{}", 10 + i)), 8080)).collect()
}

/// A Service `name` with one port of `proto`, dual-stack, `n` endpoints per family.
fn service(name: &str, idx: u32, proto: Protocol, n: usize, tweak: impl Fn(&mut ServicePort)) -> (NamespacedName, Vec<DesiredPort>) {
    let mut sp = ServicePort::cluster_ip("ns", name, "p", proto, ip(&format!("198.19.{}.{}", idx / 250, idx % 250 + 1)), 80);
    sp.cluster_ips.push(ip(&format!("fd00:10:96::{:x}", idx + 1)));
    tweak(&mut sp);
    let v4 = eps("198.18.2.", n);
    let v6 = eps("fd00:2::", n);
    let mk = |cluster: Vec<Endpoint>| {
        let has_any = !cluster.is_empty();
        let local = if sp.uses_local_endpoints() { cluster.iter().take(1).cloned().collect() } else { vec![] };
        Categorized { cluster: if sp.uses_cluster_endpoints() { cluster } else { vec![] }, local, has_any }
    };
    let d = DesiredPort { v4: mk(v4), v6: mk(v6), port: sp.clone() };
    (NamespacedName::new("ns", name), vec![d])
}

fn sync_ok(p: &mut NftablesProxier, batch: SyncBatch) -> clusterip_agent::proxier::SyncReport {
    let r = p.sync(&batch).unwrap_or_else(|e| panic!("sync failed: {e}"));
    let diffs = p.verify().expect("verify");
    assert!(diffs.is_empty(), "kernel differs from the mirror: {diffs:?}");
    r
}

#[test]
fn every_kind_of_change_applies_and_matches_the_mirror() {
    let ns = Netns::new("apply");
    let exec = Executor::in_netns(&ns.name).expect("netns");
    let mut p = NftablesProxier::new(exec, RenderOptions::default(), 50_000);
    let all = |n: usize| {
        vec![
            service("plain", 1, Protocol::Tcp, n, |_| {}),
            service("udp", 2, Protocol::Udp, n, |_| {}),
            service("sctp", 3, Protocol::Sctp, n, |_| {}),
            service("sticky", 4, Protocol::Tcp, n, |s| s.affinity_timeout = Some(60)),
            service("np", 5, Protocol::Tcp, n, |s| {
                s.node_port = Some(30005);
                s.external_ips = vec![ip("198.18.9.9"), ip("fd00:9::9")];
            }),
            service("lb", 6, Protocol::Tcp, n, |s| {
                s.node_port = Some(30006);
                s.load_balancer_ips = vec![ip("198.18.8.8")];
                s.load_balancer_source_ranges = vec!["198.18.5.0/24".parse().expect("net")];
                s.external_policy_local = true;
            }),
            service("local", 7, Protocol::Tcp, n, |s| s.internal_policy_local = true),
        ]
    };
    let r = sync_ok(&mut p, SyncBatch { full: true, services: all(3) });
    assert_eq!(r.transactions, 1);
    assert!(r.chains > 14 && r.elements > 20, "{r:?}");
    // More endpoints (slot ranges grow), fewer, none, back again; then everything goes.
    for n in [5, 2, 1, 0, 4] {
        let r = sync_ok(&mut p, SyncBatch { full: false, services: all(n) });
        assert!(r.operations > 0, "a change with n={n} sent nothing");
    }
    // Nothing changed: nothing sent.
    let r = sync_ok(&mut p, SyncBatch { full: false, services: all(4) });
    assert_eq!(r.operations, 0);
    assert_eq!(r.transactions, 0);
    // Affinity turned off, then the service deleted; the stale chains go at the next sync.
    sync_ok(&mut p, SyncBatch { full: false, services: vec![service("sticky", 4, Protocol::Tcp, 4, |_| {})] });
    let r = sync_ok(&mut p, SyncBatch { full: true, services: vec![service("plain", 1, Protocol::Tcp, 2, |_| {})] });
    assert!(r.operations > 0);
    let listing = ns_sh(&ns.name, &["nft", "list", "table", "ip", "clusterip"]);
    assert!(!listing.contains("set aff-"), "affinity sets are deleted at once:\n{listing}");
    assert!(listing.contains("chain svc-ns/np/tcp/p {\n\t}"), "removed chains are flushed first:\n{listing}");
    sync_ok(&mut p, SyncBatch { full: false, services: vec![service("plain", 1, Protocol::Tcp, 3, |_| {})] });
    let listing = ns_sh(&ns.name, &["nft", "list", "table", "ip", "clusterip"]);
    assert!(!listing.contains("chain svc-ns/np"), "stale chains deleted:\n{listing}");
}

#[test]
fn huge_first_sync_is_split_into_bounded_transactions() {
    let ns = Netns::new("apply");
    let exec = Executor::in_netns(&ns.name).expect("netns");
    let mut p = NftablesProxier::new(exec, RenderOptions::default(), 200);
    let services: Vec<_> = (0..60).map(|i| service(&format!("s{i}"), 10 + i, Protocol::Tcp, 5, |_| {})).collect();
    let r = sync_ok(&mut p, SyncBatch { full: true, services });
    assert!(r.transactions >= 4 && r.transactions <= r.operations / 200 + 1, "{r:?}");
    let listing = ns_sh(&ns.name, &["nft", "list", "table", "ip", "clusterip"]);
    assert_eq!(listing.matches("chain svc-ns/s").count(), 60);
}

#[test]
fn a_new_agent_adopts_the_table_in_one_transaction_keeps_affinity_and_removes_what_is_gone() {
    let ns = Netns::new("apply");
    let exec = Executor::in_netns(&ns.name).expect("netns");
    // A first agent programs 60 Services, one with ClientIP affinity; small transactions.
    let services = |n: u32| -> Vec<_> {
        let mut v: Vec<_> = (0..n).map(|i| service(&format!("s{i}"), 10 + i, Protocol::Tcp, 5, |_| {})).collect();
        v.push(service("sticky", 4, Protocol::Tcp, 2, |s| s.affinity_timeout = Some(600)));
        v
    };
    let mut first = NftablesProxier::new(exec.clone(), RenderOptions::default(), 200);
    sync_ok(&mut first, SyncBatch { full: true, services: services(60) });
    drop(first);
    // A client was sent to an endpoint: its affinity entry is in the kernel.
    let aff = "aff-600-ns/sticky/tcp/p__198.18.2.10/8080";
    ns_sh(&ns.name, &["nft", "add", "element", "ip", "clusterip", aff, "{ 198.18.1.2 }"]);

    // A second agent (a restart) starts with an empty mirror; s59 was deleted meanwhile.
    let mut second = NftablesProxier::new(exec, RenderOptions::default(), 200);
    let r = sync_ok(&mut second, SyncBatch { full: true, services: services(59) });
    assert_eq!(r.transactions, 1, "the table in the kernel is rebuilt in one transaction, whatever the bound: {r:?}");
    assert!(r.cleanup_pending, "the chain of s59 waits for the next sync: {r:?}");
    let listing = ns_sh(&ns.name, &["nft", "list", "table", "ip", "clusterip"]);
    assert!(listing.contains("198.18.1.2"), "the affinity entry survived the rebuild:\n{listing}");
    assert!(!listing.contains("198.19.0.70 . tcp . 80"), "s59's VIP is gone:\n{listing}");
    let r = sync_ok(&mut second, SyncBatch { full: false, services: vec![] });
    assert!(!r.cleanup_pending, "{r:?}");
    let listing = ns_sh(&ns.name, &["nft", "list", "table", "ip", "clusterip"]);
    assert!(!listing.contains("chain svc-ns/s59/"), "s59's chain deleted:\n{listing}");
    assert_eq!(listing.matches("chain svc-ns/s").count(), 60, "s0..s58 and sticky");

    // Something the agent never made in its table (an older version's set, say) goes too.
    ns_sh(&ns.name, &["nft", "add", "set", "ip", "clusterip", "leftover", "{ type ipv4_addr; }"]);
    let mut third = NftablesProxier::new(Executor::in_netns(&ns.name).expect("netns"), RenderOptions::default(), 200);
    sync_ok(&mut third, SyncBatch { full: true, services: services(59) });
    assert!(!ns_sh(&ns.name, &["nft", "list", "table", "ip", "clusterip"]).contains("leftover"));
}

#[test]
fn drift_is_detected_and_rebuilt() {
    let ns = Netns::new("apply");
    let exec = Executor::in_netns(&ns.name).expect("netns");
    let mut p = NftablesProxier::new(exec, RenderOptions::default(), 50_000);
    let services = vec![service("a", 1, Protocol::Tcp, 3, |_| {})];
    sync_ok(&mut p, SyncBatch { full: true, services: services.clone() });
    ns_sh(&ns.name, &["nft", "delete", "element", "ip", "clusterip", "service-ips", "{ 198.19.0.2 . tcp . 80 }"]);
    let diffs = p.verify().expect("verify");
    assert_eq!(diffs, vec!["map/set service-ips has 0 elements, expected 1".to_string()]);
    sync_ok(&mut p, SyncBatch { full: true, services: services.clone() });
    ns_sh(&ns.name, &["nft", "delete", "table", "ip6", "clusterip"]);
    assert!(!p.verify().expect("verify").is_empty());
    sync_ok(&mut p, SyncBatch { full: true, services });
    p.cleanup().expect("cleanup");
    assert_eq!(ns_sh(&ns.name, &["nft", "list", "ruleset"]), "");
}

/// Both tables as comparable text: each map and set with its elements sorted (element
/// order in a listing depends on the kernel's hashing, not on what was programmed), each
/// chain with its rules' expressions in order.
fn table_state(ns: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut out = std::collections::BTreeMap::new();
    for fam in ["ip", "ip6"] {
        let json = ns_sh(ns, &["nft", "-j", "list", "table", fam, "clusterip"]);
        let v: serde_json::Value = serde_json::from_str(&json).expect("nft -j output");
        for item in v["nftables"].as_array().expect("nftables array") {
            if let Some(s) = item.get("map").or_else(|| item.get("set")) {
                let name = format!("{fam} set {}", s["name"].as_str().expect("name"));
                let mut elems: Vec<String> = s.get("elem").and_then(|e| e.as_array()).map_or(vec![], |a| a.iter().map(|e| e.to_string()).collect());
                elems.sort();
                out.insert(name, elems);
            } else if let Some(c) = item.get("chain") {
                out.entry(format!("{fam} chain {}", c["name"].as_str().expect("name"))).or_default();
            } else if let Some(r) = item.get("rule") {
                let chain = format!("{fam} chain {}", r["chain"].as_str().expect("chain"));
                out.entry(chain).or_default().push(r["expr"].to_string());
            }
        }
    }
    out
}

/// Move every endpoint of a Service to another port (an element-only change, or a rule
/// change for a single endpoint).
fn with_port(mut svc: (NamespacedName, Vec<DesiredPort>), port: u16) -> (NamespacedName, Vec<DesiredPort>) {
    for d in &mut svc.1 {
        for c in [&mut d.v4, &mut d.v6] {
            for e in c.cluster.iter_mut().chain(c.local.iter_mut()) {
                e.port = port;
            }
        }
    }
    svc
}

#[test]
fn netlink_batches_program_what_nft_would() {
    let (na, nb) = (Netns::new("netlink"), Netns::new("nft"));
    let mut ours = NftablesProxier::new(Executor::in_netns(&na.name).expect("netns"), RenderOptions::default(), 50_000).with_netlink(true);
    let mut nft = NftablesProxier::new(Executor::in_netns(&nb.name).expect("netns"), RenderOptions::default(), 50_000).with_netlink(false);
    let kinds = || {
        vec![
            service("plain", 1, Protocol::Tcp, 3, |_| {}),
            service("udp", 2, Protocol::Udp, 2, |_| {}),
            service("sctp", 3, Protocol::Sctp, 4, |_| {}),
            service("np", 5, Protocol::Tcp, 3, |s| {
                s.node_port = Some(30005);
                s.external_ips = vec![ip("198.18.9.9"), ip("fd00:9::9")];
            }),
            service("lb", 6, Protocol::Tcp, 2, |s| {
                s.node_port = Some(30006);
                s.load_balancer_ips = vec![ip("198.18.8.8")];
                s.load_balancer_source_ranges = vec!["198.18.5.0/24".parse().expect("net")];
                s.external_policy_local = true;
            }),
            service("local", 7, Protocol::Tcp, 2, |s| s.internal_policy_local = true),
            service("sticky", 8, Protocol::Tcp, 2, |s| s.affinity_timeout = Some(60)),
        ]
    };
    for p in [&mut ours, &mut nft] {
        let r = sync_ok(p, SyncBatch { full: true, services: kinds() });
        assert_eq!(r.netlink_transactions, 0, "a cold start creates the table: nft");
    }
    assert_eq!(table_state(&na.name), table_state(&nb.name));
    // (change, whether netlink can write it)
    let mut changes: Vec<((NamespacedName, Vec<DesiredPort>), bool)> =
        kinds().into_iter().map(|s| (with_port(s.clone(), 8081), s.0.name != "sticky")).collect();
    // Local endpoints (hairpin elements) and a moved ClusterIP (service-ips element replaced).
    let mut local = with_port(service("plain", 1, Protocol::Tcp, 3, |_| {}), 8082);
    for e in &mut local.1[0].v4.cluster {
        e.is_local = true;
    }
    changes.push((local, true));
    changes.push((service("plain", 1, Protocol::Tcp, 3, |s| s.cluster_ips = vec![ip("198.19.3.3"), ip("fd00:10:96::3:3")]), true));
    // Endpoint counts: 3 → 5 (a bigger slot range), 1 (a plain dnat rule), 0 (reject), 2.
    for n in [5, 1, 0, 2] {
        changes.push((service("plain", 1, Protocol::Tcp, n, |_| {}), true));
    }
    // A new Service (new chains), then gone (chains flushed, deleted at the next sync).
    changes.push((service("new", 9, Protocol::Udp, 2, |s| s.node_port = Some(30009)), true));
    changes.push(((NamespacedName::new("ns", "new"), vec![]), true));
    changes.push((service("plain", 1, Protocol::Tcp, 3, |_| {}), true));
    for (svc, netlink) in changes {
        let name = svc.0.clone();
        let a = sync_ok(&mut ours, SyncBatch { full: false, services: vec![svc.clone()] });
        let b = sync_ok(&mut nft, SyncBatch { full: false, services: vec![svc] });
        assert!(a.operations > 0 && a.operations == b.operations, "{name:?}: {a:?} vs {b:?}");
        assert_eq!((a.transactions, a.netlink_transactions, b.netlink_transactions), (1, usize::from(netlink), 0), "{name:?}");
        assert_eq!(table_state(&na.name), table_state(&nb.name), "after changing {name:?}");
    }
    let listing = ns_sh(&na.name, &["nft", "list", "table", "ip", "clusterip"]);
    assert!(!listing.contains("svc-ns/new"), "the removed Service's chains were deleted:\n{listing}");
}

#[test]
fn a_big_netlink_batch_of_many_messages_is_applied_whole() {
    let (na, nb) = (Netns::new("netlink"), Netns::new("nft"));
    let mut ours = NftablesProxier::new(Executor::in_netns(&na.name).expect("netns"), RenderOptions::default(), 50_000).with_netlink(true);
    let mut nft = NftablesProxier::new(Executor::in_netns(&nb.name).expect("netns"), RenderOptions::default(), 50_000).with_netlink(false);
    let all = |port: u16| -> Vec<_> { (0..300).map(|i| with_port(service(&format!("s{i}"), 10 + i, Protocol::Tcp, 3, |_| {}), port)).collect() };
    for p in [&mut ours, &mut nft] {
        sync_ok(p, SyncBatch { full: true, services: all(8080) });
    }
    // 300 Services × 3 slots × 2 families, deleted and re-added: 3600 element operations.
    let a = sync_ok(&mut ours, SyncBatch { full: false, services: all(8081) });
    let b = sync_ok(&mut nft, SyncBatch { full: false, services: all(8081) });
    assert_eq!((a.operations, a.transactions, a.netlink_transactions), (3600, 1, 1), "{a:?}");
    assert_eq!(b.netlink_transactions, 0);
    assert_eq!(table_state(&na.name), table_state(&nb.name));
}

#[test]
fn a_rejected_netlink_batch_changes_nothing_and_the_next_sync_rebuilds() {
    let ns = Netns::new("apply");
    let mut p = NftablesProxier::new(Executor::in_netns(&ns.name).expect("netns"), RenderOptions::default(), 50_000).with_netlink(true);
    let services = || vec![service("a", 1, Protocol::Tcp, 3, |_| {}), service("b", 2, Protocol::Tcp, 3, |_| {})];
    sync_ok(&mut p, SyncBatch { full: true, services: services() });
    // Behind the agent's back: slot 0 of "a" (v4) is gone, so deleting it fails (ENOENT).
    ns_sh(&ns.name, &["nft", "delete", "element", "ip", "clusterip", "endpoint-dnat-tcp-0", "{ 0 }"]);
    let before = ns_sh(&ns.name, &["nft", "-j", "list", "map", "ip", "clusterip", "endpoint-dnat-tcp-0"]);
    let changed = vec![with_port(service("a", 1, Protocol::Tcp, 3, |_| {}), 8081), with_port(service("b", 2, Protocol::Tcp, 3, |_| {}), 8081)];
    let err = p.sync(&SyncBatch { full: false, services: changed.clone() }).expect_err("the kernel refuses the batch");
    assert!(err.to_string().contains("rejected"), "{err}");
    assert_eq!(ns_sh(&ns.name, &["nft", "-j", "list", "map", "ip", "clusterip", "endpoint-dnat-tcp-0"]), before, "all or nothing");
    // The retry (a full sync, as the loop does after a failure) rebuilds the tables.
    let r = sync_ok(&mut p, SyncBatch { full: true, services: changed });
    assert_eq!(r.netlink_transactions, 0, "a rebuild goes through nft");
    assert!(ns_sh(&ns.name, &["nft", "list", "map", "ip", "clusterip", "endpoint-dnat-tcp-0"]).contains(". 8081"));
}

/// The UDP conntrack entries in `ns` from client source port `sport`.
fn udp_entries(ns: &str, sport: u16) -> Vec<String> {
    // `conntrack -L` exits 0 with the entries on stdout (the count goes to stderr).
    let out = ns_sh(ns, &["conntrack", "-L", "-p", "udp", "--sport", &sport.to_string()]);
    out.lines().filter(|l| l.contains(&format!("sport={sport} "))).map(str::to_string).collect()
}

#[test]
fn udp_entries_from_before_the_endpoints_are_flushed_and_fresh_dnat_entries_kept() {
    use clusterip_agent::conntrack::ConntrackCleaner;
    let topo = Topology::new(1);
    let exec = Executor::in_netns(&topo.node.name).expect("netns");
    let mut p = NftablesProxier::new(exec.clone(), RenderOptions::default(), 50_000);
    let mut cleaner = ConntrackCleaner::default();
    // The tables exist (conntrack is on in the node namespace), the DNS Service is not
    // programmed yet: the client's packets to its VIP are routed unchanged (towards br0,
    // where nobody answers) and leave a conntrack entry that was never DNATed.
    let other = service("other", 1, Protocol::Tcp, 1, |_| {});
    let first = SyncBatch { full: true, services: vec![other] };
    p.sync(&first).expect("first sync");
    cleaner.plan(&first);
    let (vip, stale_port, fresh_port) = ("198.19.0.53", 40100, 40101);
    let addr = sa(vip, 53);
    let (stale_client, fresh_client) = (topo.udp_client(false, stale_port), topo.udp_client(false, fresh_port));
    assert!(stale_client.ask(addr, std::time::Duration::from_millis(300)).is_err(), "no DNS Service yet");
    let stale = udp_entries(&topo.node.name, stale_port);
    assert!(stale.len() == 1 && stale[0].contains(&format!("src={vip} dst=198.18.1.2 sport=53")), "an entry that was not DNATed: {stale:?}");

    // The Service and its endpoint are committed; a new flow is DNATed to the endpoint
    // before the agent runs its flushes (what a client can do at any time).
    let sp = ServicePort::cluster_ip("ns", "dns", "dns", Protocol::Udp, ip(vip), 53);
    let ep = Endpoint::ready(ip(&Topology::backend_ip(0)), UDP_PORT);
    let dns = (NamespacedName::new("ns", "dns"), vec![DesiredPort { port: sp, v4: Categorized { cluster: vec![ep], local: vec![], has_any: true }, v6: Categorized::default() }]);
    let second = SyncBatch { full: false, services: vec![dns] };
    p.sync(&second).expect("second sync");
    let flushes = cleaner.plan(&second);
    let t = std::time::Duration::from_secs(10);
    assert_eq!(fresh_client.ask(addr, t).expect("answer through the new rules"), "b0");
    // One flush round as the agent's flusher runs it: a ctnetlink dump, filtered, deletes.
    let mut round = clusterip_agent::conntrack::flusher::netlink_round(exec.netns_file());
    let done = round(&flushes).expect("flush round");
    assert_eq!(done.deleted, 1, "{done:?}");

    // The stale entry is gone (its flow now reaches the endpoint), the fresh one kept.
    assert_eq!(udp_entries(&topo.node.name, stale_port), Vec::<String>::new(), "the entry from before the endpoints was flushed");
    let fresh = udp_entries(&topo.node.name, fresh_port);
    assert!(fresh.len() == 1 && fresh[0].contains(&format!("src={} ", Topology::backend_ip(0))), "the DNATed flow kept its entry: {fresh:?}");
    assert_eq!(stale_client.ask(addr, t).expect("the old flow reaches the endpoint now"), "b0");
}
