//! The etcd backend's address pool under a pause: a pooled address the replica lost is
//! never handed out.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use kube::api::{ListParams, PostParams};

use clusterip_test_support::{control_plane, eventually_ok};

use crate::harness::*;

/// The etcd backend's address pool under a pause: replica 0 is stopped (SIGSTOP) past its
/// etcd lease, so its pool key expires and the repair pass (on replica 1, the leader by
/// then) releases the addresses it pooled; replica 1 then fills the range — a /26, 62
/// addresses — so those addresses now belong to Services. Replica 0, resumed, must answer
/// "range is full": an address from the pool it lost would be a second owner (the apiserver
/// would refuse it as already allocated, and the test would see that 422).
///
/// Two things stop it, and this test shows their sum, not each: the resumed replica's
/// keep-alive finds the lease gone and drops the pool, and every hand-out checks that the
/// lease has more than the margin left (`live_lease`, unit-tested in etcd_pool.rs). With the
/// second disabled this test still passed (2026-11-26): the first came before any request
/// reached the resumed replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_paused_replica_never_hands_out_a_pooled_address_it_lost() {
    use clusterip::store::etcd::pool::{decode_pool, pool_member};
    use std::collections::BTreeMap;
    let _one_at_a_time = BURST.lock().await;
    let cp = control_plane();
    let slice = Slice(16);
    let range = "198.19.128.0/26";
    let wh = Webhook::start_with(&cp, "etcd", slice, |h| {
        h.replicas(2);
        h.ranges = vec![range.to_string()];
        h.flags(&["--repair-interval", "1s"]);
    })
    .await;
    let api = wh.services();
    let etcd = etcd_client::Client::connect(cp.etcd_endpoints(), None).await.expect("connect to etcd");
    let prefix = format!("/clusterip-test/{}/", wh.name);
    // Each replica's pooled addresses, by its member name (its pool keys are
    // `<range key>/pool/<member>/<chunk>`).
    let pools = || {
        let (mut etcd, prefix) = (etcd.clone(), prefix.clone());
        async move {
            let resp = etcd.get(prefix.as_str(), Some(etcd_client::GetOptions::new().with_prefix())).await.expect("read the controller's keys");
            let mut by_member = BTreeMap::<String, BTreeSet<IpAddr>>::new();
            for kv in resp.kvs() {
                let Some((_, name)) = kv.key_str().ok().and_then(|k| k.split_once("/pool/")) else { continue };
                by_member.entry(pool_member(name).to_string()).or_default().extend(decode_pool(kv.value()));
            }
            by_member
        }
    };
    // Both replicas pool addresses once they run (a /26's dynamic band of 46 gives each 5).
    let pools = &pools;
    let before = eventually_ok("two filled pools appear", Duration::from_secs(60), Duration::from_millis(200), move || async move {
        let p = pools().await;
        if p.len() == 2 && p.values().all(|a| !a.is_empty()) {
            Ok(p)
        } else {
            Err(format!("{p:?}"))
        }
    })
    .await;

    wh.route_only(&[1]).await;
    wh.children[0].signal(libc::SIGSTOP);
    // Replica 0's pool keys go with its lease (30 s): the member that disappears is replica 0.
    let paused = &before;
    let lost: BTreeSet<IpAddr> = eventually_ok("a pool key expires after the pause", Duration::from_secs(180), Duration::from_millis(500), move || async move {
        let now = pools().await;
        match paused.iter().find(|(k, _)| !now.contains_key(*k)) {
            Some((_, addrs)) => Ok(addrs.clone()),
            None => Err(format!("{now:?}")),
        }
    })
    .await;
    // The repair pass releases them (unowned records, after three passes).
    let (wh, cp, lost) = (&wh, &cp, &lost);
    eventually_ok("the paused replica's pooled addresses are released", Duration::from_secs(180), Duration::from_millis(500), move || async move {
        let store = wh.records(cp).await;
        use clusterip::store::AllocationStore;
        let mut held = Vec::new();
        for ip in lost {
            if store.has(*ip).await.expect("read the records") {
                held.push(*ip);
            }
        }
        if held.is_empty() {
            Ok(())
        } else {
            Err(format!("{held:?} still held"))
        }
    })
    .await;
    // Replica 1 fills the range.
    let mut filled = 0;
    loop {
        match api.create(&PostParams::default(), &service(&format!("fill-{filled}"), |_| {})).await {
            Ok(_) => filled += 1,
            Err(kube::Error::Api(s)) if s.code == 500 && s.message.contains("range is full") => break,
            Err(e) => panic!("filling the range through replica 1: {e}"),
        }
        assert!(filled <= 62, "more than a /26's 62 addresses given");
    }
    let held: BTreeSet<IpAddr> = api.list(&ListParams::default()).await.expect("list Services").items.iter().flat_map(ips).collect();
    let reused: Vec<_> = lost.iter().filter(|ip| held.contains(ip)).collect();
    assert_eq!(reused.len(), lost.len(), "the paused replica's lost pool {lost:?} was not all given to Services ({filled} created): the test proves nothing");

    wh.children[0].signal(libc::SIGCONT);
    wh.route_only(&[0]).await;
    for i in 0..10 {
        match api.create(&PostParams::default(), &service(&format!("after-{i}"), |_| {})).await {
            Err(kube::Error::Api(s)) if s.code == 500 && s.message.contains("range is full") => {}
            other => panic!("the resumed replica answered something other than 'range is full' in a full range (an address from the pool it lost?): {other:?}"),
        }
    }
    wh.route_only(&[0, 1]).await;
    eprintln!("paused replica: {} pooled addresses lost and given to Services through replica 1; 10 creates through the resumed replica all refused as full", lost.len());
}
