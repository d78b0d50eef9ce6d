//! One conformance suite, run unchanged against both backends: the etcd allocation map (real
//! etcd of the test control plane; with and without the controller's address pool) and
//! IPAddress objects (its real kube-apiserver).
//!
//! Each test takes its own range from 198.18.0.0/15 and, for etcd, its own key prefix, so
//! tests run side by side and re-runs against a reused cluster start clean.

mod store_common;

use std::collections::BTreeSet;
use std::net::IpAddr;

use clusterip::alloc::AllocError;
use clusterip::cidr::{Family, ServiceCidr};
use clusterip::store::{ParentRef, StoreError};

use store_common::{run_allocators, Backend, Fixture};

/// Generate one #[tokio::test] per backend for a suite function.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod etcd { $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::$name(super::Backend::Etcd).await } )* }
        mod etcd_pooled { $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::$name(super::Backend::EtcdPooled).await } )* }
        mod ipaddress { $( #[tokio::test(flavor = "multi_thread", worker_threads = 4)] async fn $name() { super::$name(super::Backend::IpAddress).await } )* }
    };
}

conformance!(
    dynamic_band_first_then_static,
    static_allocation_and_errors,
    exhaustion_and_release,
    ipv6_and_two_ranges,
    restart_sees_the_same_state,
    eight_processes_no_duplicates,
    owners_release_only_their_own,
);

fn parent(name: &str) -> ParentRef {
    ParentRef::service("default", name)
}

fn in_band(cidr: &ServiceCidr, ip: IpAddr) -> bool {
    cidr.dynamic_band().map(|b| b.first <= ip && ip <= b.last).unwrap_or(false)
}

async fn dynamic_band_first_then_static(backend: Backend) {
    // 198.18.1.0/27: 30 usable, static band = the first 16, dynamic band = the other 14.
    let fx = Fixture::new(backend, &["198.18.1.0/27"]).await;
    let store = fx.open().await;
    let cidr = &store.ranges()[0];
    let mut seen = BTreeSet::new();
    for i in 0..14 {
        let ip = store.allocate_next(Family::IPv4, Some(&parent(&format!("d{i}")))).await.expect("dynamic band has room");
        assert!(in_band(cidr, ip), "{ip} is not in the dynamic band of {cidr}");
        assert!(seen.insert(ip), "{ip} handed out twice");
    }
    // The dynamic band is full: the static band is used only now.
    let ip = store.allocate_next(Family::IPv4, Some(&parent("s"))).await.expect("static band has room");
    assert!(!in_band(cidr, ip) && cidr.contains(ip), "{ip} should come from the static band");
    fx.cleanup(store).await;
}

async fn static_allocation_and_errors(backend: Backend) {
    let fx = Fixture::new(backend, &["198.18.2.0/24"]).await;
    let store = fx.open().await;
    let ip: IpAddr = "198.18.2.10".parse().unwrap();
    store.allocate(ip, Some(&parent("web"))).await.expect("static allocation");
    assert!(store.has(ip).await.unwrap());
    let err = store.allocate(ip, Some(&parent("other"))).await.expect_err("second owner");
    assert!(matches!(err, StoreError::Alloc(AllocError::Allocated)), "{err}");
    assert_eq!(err.to_string(), "provided IP is already allocated");
    for outside in ["198.18.3.1", "198.18.2.0", "198.18.2.255"] {
        let err = store.allocate(outside.parse().unwrap(), None).await.expect_err("outside the range");
        assert_eq!(
            err.to_string(),
            format!("the provided IP ({outside}) is not in the valid range. The range of valid IPs is 198.18.2.0/24")
        );
    }
    assert_eq!(store.allocated().await.unwrap(), vec![ip]);
    fx.cleanup(store).await;
}

/// An owner other than a Service is recorded with the address; only a release on its behalf
/// frees it, across a restart; a Service's address carries no owner record.
async fn owners_release_only_their_own(backend: Backend) {
    let fx = Fixture::new(backend, &["198.18.6.0/28"]).await;
    let store = fx.open().await;
    let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: "edge".into() };
    let other = ParentRef { name: "other".into(), ..gateway.clone() };
    let owned: IpAddr = "198.18.6.3".parse().unwrap();
    store.allocate(owned, Some(&gateway)).await.expect("owned static");
    let chosen = store.allocate_next(Family::IPv4, Some(&gateway)).await.expect("owned dynamic");
    // (The dynamic pick may land anywhere in this small range: take another address.)
    let service: IpAddr = ["198.18.6.4", "198.18.6.5"].iter().map(|t| t.parse().unwrap()).find(|ip| *ip != chosen).unwrap();
    store.allocate(service, Some(&parent("web"))).await.expect("a Service's");
    assert_eq!(store.owner(owned).await.expect("owner"), Some(gateway.clone()));
    assert_eq!(store.owner(chosen).await.expect("owner"), Some(gateway.clone()));
    assert_eq!(store.owner(service).await.expect("owner"), None);
    // Durable: another process sees the same owners.
    drop(store);
    let store = fx.open().await;
    assert_eq!(store.owner(owned).await.expect("owner after a restart"), Some(gateway.clone()));
    for ip in [owned, chosen] {
        let err = store.release(ip).await.expect_err("an unowned release of an owned address");
        assert!(matches!(&err, StoreError::NotOwner { owner, .. } if *owner == gateway), "{err}");
        let err = store.release_owned(ip, &other).await.expect_err("another owner's release");
        assert!(matches!(&err, StoreError::NotOwner { .. }), "{err}");
        assert!(store.has(ip).await.unwrap(), "{ip} released by a release that was refused");
        store.release_owned(ip, &gateway).await.expect("the owner's release");
        assert!(!store.has(ip).await.unwrap());
        assert_eq!(store.owner(ip).await.expect("owner"), None);
    }
    store.release(service).await.expect("a Service's address: an unowned release");
    assert!(!store.has(service).await.unwrap());
    fx.cleanup(store).await;
}

async fn exhaustion_and_release(backend: Backend) {
    // /28: 14 usable, no static band (raw size 16).
    let fx = Fixture::new(backend, &["198.18.3.0/28"]).await;
    let store = fx.open().await;
    let mut got = BTreeSet::new();
    for i in 0..14 {
        got.insert(store.allocate_next(Family::IPv4, Some(&parent(&format!("e{i}")))).await.expect("room left"));
    }
    assert_eq!(got.len(), 14);
    let err = store.allocate_next(Family::IPv4, None).await.expect_err("full");
    assert_eq!(err.to_string(), "range is full");
    let freed: IpAddr = "198.18.3.7".parse().unwrap();
    store.release(freed).await.expect("release");
    assert!(!store.has(freed).await.unwrap());
    // Releasing again, or an address outside every range, is a no-op.
    store.release(freed).await.expect("second release is a no-op");
    store.release("203.0.113.9".parse().unwrap()).await.expect("out-of-range release is a no-op");
    let again = store.allocate_next(Family::IPv4, Some(&parent("again"))).await.expect("the freed address");
    assert_eq!(again, freed);
    fx.cleanup(store).await;
}

async fn ipv6_and_two_ranges(backend: Backend) {
    let fx = Fixture::new(backend, &["198.18.4.0/30", "fd00:18:4::/124"]).await;
    let store = fx.open().await;
    // The all-ones IPv6 address is usable (taken first: a dynamic pick from this /124 could
    // otherwise land on it).
    let last: IpAddr = "fd00:18:4::f".parse().unwrap();
    store.allocate(last, Some(&parent("last"))).await.expect("IPv6 all-ones address is usable");
    let v6 = store.allocate_next(Family::IPv6, Some(&parent("v6"))).await.expect("IPv6 address");
    assert!(store.ranges()[1].contains(v6) && v6 != last, "{v6}");
    // IPv4 /30: two usable addresses, then full — the IPv6 range does not help.
    store.allocate_next(Family::IPv4, None).await.expect("1st");
    store.allocate_next(Family::IPv4, None).await.expect("2nd");
    assert_eq!(store.allocate_next(Family::IPv4, None).await.expect_err("full").to_string(), "range is full");
    fx.cleanup(store).await;
}

async fn restart_sees_the_same_state(backend: Backend) {
    let fx = Fixture::new(backend, &["198.18.5.0/24"]).await;
    let store = fx.open().await;
    let mut mine = Vec::new();
    for i in 0..20 {
        mine.push(store.allocate_next(Family::IPv4, Some(&parent(&format!("r{i}")))).await.expect("allocate"));
    }
    store.allocate("198.18.5.3".parse().unwrap(), Some(&parent("static"))).await.expect("static");
    mine.push("198.18.5.3".parse().unwrap());
    store.release(mine[0]).await.expect("release");
    let released = mine.remove(0);
    drop(store);
    // A new store (a new process would be the same: nothing is shared but the backend).
    let reopened = fx.open().await;
    mine.sort();
    assert_eq!(reopened.allocated().await.unwrap(), mine);
    assert!(!reopened.has(released).await.unwrap());
    fx.cleanup(reopened).await;
}

async fn eight_processes_no_duplicates(backend: Backend) {
    let cidr = match backend {
        Backend::Etcd | Backend::EtcdPooled => "198.18.64.0/18",
        Backend::IpAddress => "198.18.128.0/18",
    };
    let fx = Fixture::new(backend, &[cidr]).await;
    let runs = run_allocators(&fx, 8, 2000, 16, None);
    let mut all = BTreeSet::new();
    for run in &runs {
        assert!(run.success, "an allocator process failed: {}", run.stderr);
        assert_eq!(run.ips.len(), 2000, "process gave {} addresses", run.ips.len());
        for ip in &run.ips {
            assert!(all.insert(*ip), "{ip} handed out twice");
        }
    }
    assert_eq!(all.len(), 16_000);
    // Every allocation is visible to a new reader.
    let store = fx.open().await;
    let recorded: BTreeSet<IpAddr> = store.allocated().await.unwrap().into_iter().collect();
    assert_eq!(recorded, all);
    fx.cleanup(store).await;
}

/// More owned allocations at once than etcd takes operations in one transaction (its
/// `--max-txn-ops`, 128 by default; each owned allocation writes an owner key): every one is
/// answered, once, with its owner recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_more_owned_allocations_at_once_than_one_transaction_takes() {
    let fx = Fixture::new(Backend::Etcd, &["198.18.7.0/24"]).await;
    let store: std::sync::Arc<dyn clusterip::store::AllocationStore> = fx.open().await.into();
    let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: "edge".into() };
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (store, gateway) = (store.clone(), gateway.clone());
            tokio::spawn(async move { store.allocate_next(Family::IPv4, Some(&gateway)).await })
        })
        .collect();
    let mut got = BTreeSet::new();
    for t in tasks {
        let ip = t.await.expect("task").expect("an owned allocation");
        assert!(got.insert(ip), "{ip} answered twice");
    }
    assert_eq!(got.len(), 200);
    let owners = store.owners().await.expect("owners");
    assert_eq!(owners.len(), 200, "every owned allocation recorded its owner");
    assert!(owners.iter().all(|(ip, o)| got.contains(ip) && *o == gateway));
}
