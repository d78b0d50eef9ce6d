//! The nftables dataplane's sync logic against the [`FakeKernel`]: fast, no root. The
//! kernel tests (`agent/tests/nftables_apply.rs`) check the same paths against `nft` and
//! the kernel; these check what the agent decides (which operations, which way they go,
//! what the table holds after each sync) in milliseconds.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use super::fake::FakeKernel;
use super::ops::{Expr, Key, SetName, Value, Verdict};
use super::render::{RenderOptions, SERVICE_IPS};
use super::NftablesProxier;
use crate::locks::lock;
use crate::model::service::ServicePort;
use crate::model::state::DesiredPort;
use crate::model::topology::Categorized;
use crate::model::{Endpoint, IpFamily, NamespacedName, Protocol};
use crate::proxier::{Proxier, SyncBatch, SyncReport};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

/// A dual-stack Service `name` with one TCP port and `n` endpoints per family.
fn service(name: &str, idx: u32, n: usize, tweak: impl Fn(&mut ServicePort)) -> (NamespacedName, Vec<DesiredPort>) {
    let mut sp = ServicePort::cluster_ip("ns", name, "p", Protocol::Tcp, ip(&format!("198.19.0.{idx}")), 80);
    sp.cluster_ips.push(ip(&format!("fd00:10:96::{idx:x}")));
    tweak(&mut sp);
    let eps = |prefix: &str| -> Vec<Endpoint> { (0..n).map(|i| Endpoint::ready(ip(&format!("{prefix}{}", 10 + i)), 8080)).collect() };
    let cat = |cluster: Vec<Endpoint>| Categorized { has_any: !cluster.is_empty(), cluster, local: vec![] };
    (NamespacedName::new("ns", name), vec![DesiredPort { v4: cat(eps("198.18.2.")), v6: cat(eps("fd00:2::")), port: sp }])
}

fn proxier() -> (NftablesProxier, Arc<Mutex<FakeKernel>>) {
    let kernel = Arc::new(Mutex::new(FakeKernel::new()));
    (NftablesProxier::with_fake(kernel.clone(), RenderOptions::default(), 50_000).with_netlink(true), kernel)
}

/// Sync, then check that the fake kernel holds what the mirror says.
fn sync_ok(p: &mut NftablesProxier, full: bool, services: Vec<(NamespacedName, Vec<DesiredPort>)>) -> SyncReport {
    let r = p.sync(&SyncBatch { full, services }).unwrap_or_else(|e| panic!("sync failed: {e}"));
    let diffs = p.verify().expect("verify");
    assert!(diffs.is_empty(), "the fake kernel differs from the mirror: {diffs:?}");
    r
}

/// Where the ClusterIP of Service `idx` (v4, port 80) goes.
fn vip_verdict(kernel: &Mutex<FakeKernel>, idx: u32) -> Option<Value> {
    let k = lock(kernel);
    let t = k.table(IpFamily::V4).expect("table");
    t.element(SetName::Named(SERVICE_IPS), &Key::AddrProtoPort(ip(&format!("198.19.0.{idx}")), Protocol::Tcp, 80)).cloned().flatten()
}

#[test]
fn a_cold_start_goes_through_nft_then_endpoint_changes_are_netlink_batches() {
    let (mut p, kernel) = proxier();
    let r = sync_ok(&mut p, true, vec![service("a", 1, 3, |_| {}), service("b", 2, 1, |_| {})]);
    assert_eq!((r.transactions, r.netlink_transactions), (1, 0), "a cold start creates the tables: nft");
    assert_eq!(vip_verdict(&kernel, 1), Some(Value::Verdict(Verdict::Goto("svc-ns/a/tcp/p".into()))));
    let rules = lock(&kernel).table(IpFamily::V4).expect("table").chains["svc-ns/a/tcp/p"].clone();
    assert!(matches!(rules[..], [ref r] if matches!(r.0[..], [Expr::L4Proto(Protocol::Tcp), Expr::DnatNumgenMap { modulus: 3, .. }])), "{rules:?}");
    // An endpoint count change and a new Service without affinity: netlink, one batch each.
    for change in [service("a", 1, 5, |_| {}), service("c", 3, 2, |_| {})] {
        let r = sync_ok(&mut p, false, vec![change]);
        assert_eq!((r.transactions, r.netlink_transactions), (1, 1), "{r:?}");
    }
    // Affinity creates sets: nft.
    let r = sync_ok(&mut p, false, vec![service("b", 2, 2, |s| s.affinity_timeout = Some(30))]);
    assert_eq!((r.transactions, r.netlink_transactions), (1, 0), "{r:?}");
    assert!(lock(&kernel).table(IpFamily::V6).expect("table").sets.keys().any(|s| s.starts_with("aff-30-ns/b/")));
}

#[test]
fn a_removed_service_is_flushed_then_its_chains_deleted_at_the_next_sync() {
    let (mut p, kernel) = proxier();
    sync_ok(&mut p, true, vec![service("a", 1, 2, |_| {}), service("b", 2, 2, |_| {})]);
    let r = sync_ok(&mut p, false, vec![(NamespacedName::new("ns", "a"), vec![])]);
    assert!(r.cleanup_pending, "emptied chains wait for the next sync");
    assert_eq!(vip_verdict(&kernel, 1), None, "the VIP is gone at once");
    assert!(lock(&kernel).table(IpFamily::V4).expect("table").chains["svc-ns/a/tcp/p"].is_empty());
    let r = sync_ok(&mut p, false, vec![]);
    assert!(!r.cleanup_pending);
    assert!(!lock(&kernel).table(IpFamily::V4).expect("table").chains.contains_key("svc-ns/a/tcp/p"));
    assert_eq!(vip_verdict(&kernel, 2), Some(Value::Verdict(Verdict::Goto("svc-ns/b/tcp/p".into()))));
}

#[test]
fn drift_is_detected_and_repaired_by_adopting_the_table_in_one_transaction() {
    let (mut p, kernel) = proxier();
    let all = || vec![service("a", 1, 3, |_| {}), service("b", 2, 2, |s| s.affinity_timeout = Some(30))];
    sync_ok(&mut p, true, all());
    let affinity_sets = |k: &FakeKernel| -> Vec<String> { k.table(IpFamily::V4).expect("table").sets.keys().filter(|s| s.starts_with("aff-")).cloned().collect() };
    let before = affinity_sets(&lock(&kernel));
    // Behind the agent's back: a stray chain, and the VIP of "a" deleted.
    lock(&kernel).tamper(IpFamily::V4, |t| {
        t.chains.insert("stray".into(), vec![]);
        if let Some(s) = t.sets.get_mut(SERVICE_IPS) {
            s.elements.clear();
        }
    });
    let diffs = p.verify().expect("verify");
    assert!(diffs.iter().any(|d| d == "unexpected chain stray"), "{diffs:?}");
    let applied = lock(&kernel).applied.len();
    let r = sync_ok(&mut p, true, all());
    assert_eq!((r.transactions, r.netlink_transactions), (1, 0), "the rebuild is one nft transaction");
    assert_eq!(lock(&kernel).applied.len(), applied + 1);
    assert_eq!(vip_verdict(&kernel, 1), Some(Value::Verdict(Verdict::Goto("svc-ns/a/tcp/p".into()))));
    assert_eq!(affinity_sets(&lock(&kernel)), before, "affinity sets are kept (with their entries)");
    // The stray chain was flushed by the adoption and goes at the next sync.
    sync_ok(&mut p, false, vec![]);
    assert!(!lock(&kernel).table(IpFamily::V4).expect("table").chains.contains_key("stray"));
}

#[test]
fn a_refused_transaction_fails_the_sync_and_the_next_one_rebuilds() {
    let (mut p, kernel) = proxier();
    sync_ok(&mut p, true, vec![service("a", 1, 3, |_| {})]);
    // Behind the agent's back: slot 2 is gone, so the delta's delete of it is refused.
    lock(&kernel).tamper(IpFamily::V4, |t| {
        if let Some(s) = t.sets.get_mut("endpoint-dnat-tcp-0") {
            s.elements.remove(&Key::Slot(2));
        }
    });
    let before = lock(&kernel).table(IpFamily::V4).cloned();
    let changed = || vec![service("a", 1, 2, |_| {})];
    assert!(p.sync(&SyncBatch { full: false, services: changed() }).is_err(), "the fake kernel refuses the batch");
    assert_eq!(lock(&kernel).table(IpFamily::V4).cloned(), before, "all or nothing");
    let r = sync_ok(&mut p, true, changed());
    assert_eq!(r.netlink_transactions, 0, "a rebuild goes through nft");
}

#[test]
fn cleanup_removes_both_tables() {
    let (mut p, kernel) = proxier();
    sync_ok(&mut p, true, vec![service("a", 1, 2, |_| {})]);
    p.cleanup().expect("cleanup");
    assert!(lock(&kernel).table(IpFamily::V4).is_none() && lock(&kernel).table(IpFamily::V6).is_none());
}
