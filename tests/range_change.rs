//! Changing `--service-cidr` in a rolling update, etcd backend, against a real etcd: replicas
//! of the old and the new range run side by side (each an `EtcdStore` with an address pool,
//! as the controller opens it), Gateway-owned addresses recorded under the old range stay
//! held under the new one, nothing is given twice, no map key is left behind, and a shrink
//! whose removed part still holds an address is refused. A /26 → /25 keeps it under a
//! second. The same change through controllers, both backends:
//! `tests/controller_e2e/range_change.rs` (docs/reliability.md, "Changing the service range").

mod store_common;

use std::collections::BTreeSet;
use std::net::IpAddr;

use clusterip::cidr::{Family, ServiceCidr};
use clusterip::store::etcd::{EtcdConfig, EtcdStore};
use clusterip::store::{AllocationStore, ParentRef, StoreError};
use store_common::{Backend, Fixture};

fn gateway(i: usize) -> ParentRef {
    ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: format!("edge-{i}") }
}

fn cidr(s: &str) -> ServiceCidr {
    ServiceCidr::parse(s).expect("test CIDR")
}

async fn open(fx: &Fixture, range: &str, pool: usize) -> Result<EtcdStore, StoreError> {
    let cfg = EtcdConfig { pool_size: pool, ..fx.etcd_config() };
    EtcdStore::open(&cfg, vec![cidr(range)]).await
}

/// `n` dynamic Service addresses from `store`, one request after another.
async fn services(store: &EtcdStore, n: usize) -> Vec<IpAddr> {
    let mut got = Vec::new();
    for i in 0..n {
        match store.allocate_next(Family::IPv4, None).await {
            Ok(ip) => got.push(ip),
            Err(e) => panic!("Service {i} of {n} from {:?}: {e}", store.ranges()),
        }
    }
    got
}

/// The range keys (`<prefix>/<cidr>`, not the owner, pool and claim keys below them) stored
/// under the fixture's prefix.
async fn range_keys(fx: &Fixture) -> BTreeSet<String> {
    let mut client = etcd_client::Client::connect(fx.cp.etcd_endpoints(), None).await.expect("etcd");
    let resp = client.get(fx.prefix.clone(), Some(etcd_client::GetOptions::new().with_prefix().with_keys_only())).await.expect("list keys");
    resp.kvs()
        .iter()
        .filter_map(|kv| kv.key_str().ok())
        .filter(|k| k.strip_prefix(&format!("{}/", fx.prefix)).is_some_and(|rest| ServiceCidr::parse(rest).is_ok()))
        .map(str::to_string)
        .collect()
}

async fn cleanup(fx: &Fixture) {
    let mut client = etcd_client::Client::connect(fx.cp.etcd_endpoints(), None).await.expect("etcd");
    let _ = client.delete(fx.prefix.clone(), Some(etcd_client::DeleteOptions::new().with_prefix())).await;
}

/// /26 → /25 while both run: 20 Gateways and 5 Services under the old range, then 50 Services
/// from a replica of the new range while the old one hands out 15 more, then the old one
/// stops and a second replica of the new range hands out 10.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_widened_range_in_a_rolling_update_gives_nothing_twice_and_leaves_nothing_behind() {
    let fx = Fixture::new(Backend::Etcd, &["198.18.250.0/26"]).await;
    let old = open(&fx, "198.18.250.0/26", 64).await.expect("open a replica of the old range");
    let mut gateways = BTreeSet::new();
    for i in 0..20 {
        let ip = old.allocate_next(Family::IPv4, Some(&gateway(i))).await.expect("an address for a Gateway");
        assert!(gateways.insert(ip), "{ip} given to two Gateways");
    }
    let mut svc = services(&old, 5).await;

    // The rolling update: a replica of the widened range starts while the old one serves.
    let new = open(&fx, "198.18.250.0/25", 64).await.expect("open a replica of the widened range beside the old one");
    let (from_old, from_new) = tokio::join!(services(&old, 15), services(&new, 50));
    svc.extend(from_old);
    svc.extend(from_new);
    old.close().await.expect("the old replica returns its pool");
    drop(old);
    let second = open(&fx, "198.18.250.0/25", 64).await.expect("open a second replica of the widened range");
    svc.extend(services(&second, 10).await);

    let unique: BTreeSet<IpAddr> = svc.iter().copied().collect();
    let on_gateway: Vec<&IpAddr> = svc.iter().filter(|ip| gateways.contains(ip)).collect();
    println!(
        "RESULT widen /26 -> /25: {} Services, {} duplicate addresses, {} on a Gateway address, range keys {:?}",
        svc.len(),
        svc.len() - unique.len(),
        on_gateway.len(),
        range_keys(&fx).await
    );
    assert_eq!(svc.len(), unique.len(), "an address given to two Services");
    assert!(on_gateway.is_empty(), "Services given Gateway addresses: {on_gateway:?}");
    // The Gateways' owner records are read, and honoured, through the widened range.
    let owners: BTreeSet<IpAddr> = second.owners().await.expect("owner records").into_iter().map(|(ip, _)| ip).collect();
    assert_eq!(owners, gateways, "the widened range reads every Gateway's owner record");
    let gw = *gateways.iter().next().expect("a Gateway address");
    let refused = second.release(gw).await;
    assert!(refused.is_err(), "an unowned release of Gateway address {gw} through the widened range must be refused: {refused:?}");
    assert!(second.has(gw).await.expect("has"), "{gw} is still held");
    // One map for the range, the one both replicas of the widened range use.
    let keys = range_keys(&fx).await;
    let used: BTreeSet<String> = second.keys().into_iter().chain(new.keys()).collect();
    assert_eq!(keys, used, "a map key no replica uses is left behind");
    assert_eq!(keys.len(), 1, "one map for one range: {keys:?}");
    second.close().await.expect("close");
    new.close().await.expect("close");
    cleanup(&fx).await;
}

/// A shrink (/25 → /26) starts when the removed half holds nothing, and is refused, naming the
/// address and the range, while it holds one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_shrink_is_refused_while_the_removed_part_holds_an_address() {
    let fx = Fixture::new(Backend::Etcd, &["198.18.251.0/25"]).await;
    let wide = open(&fx, "198.18.251.0/25", 0).await.expect("open the /25");
    let kept: IpAddr = "198.18.251.40".parse().expect("ip");
    wide.allocate(kept, Some(&gateway(0))).await.expect("a Gateway address in the half that stays");
    let narrow = open(&fx, "198.18.251.0/26", 0).await.expect("a shrink with nothing in the removed half starts");
    assert!(narrow.has(kept).await.expect("has"), "the narrowed range still holds {kept}");
    assert_eq!(narrow.owners().await.expect("owners"), vec![(kept, gateway(0))]);
    drop(narrow);

    let removed: IpAddr = "198.18.251.100".parse().expect("ip");
    wide.allocate(removed, Some(&gateway(1))).await.expect("a Gateway address in the upper half");
    match open(&fx, "198.18.251.0/26", 0).await {
        Ok(_) => panic!("a shrink that drops {removed} (held by a Gateway) must be refused"),
        Err(e) => {
            let text = e.to_string();
            println!("RESULT shrink refused: {text}");
            assert!(text.contains("198.18.251.100") && text.contains("198.18.251.0/26") && text.contains("198.18.251.0/25"), "the error names the address and both ranges: {text}");
        }
    }
    cleanup(&fx).await;
}
