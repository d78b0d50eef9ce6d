//! The leader killed during a burst of creates: no collision, no lost record, the other
//! replica takes the Lease over.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use kube::api::{Api, PostParams};

use clusterip_test_support::{control_plane, eventually_some};

use crate::harness::*;

async fn leader_killed_during_a_burst(backend: &str, slice: Slice) {
    use k8s_openapi::api::coordination::v1::Lease;
    let _one_at_a_time = BURST.lock().await;
    let cp = control_plane();
    let mut wh = Webhook::start_with(&cp, backend, slice, |h| h.replicas(2)).await;
    let leases: Api<Lease> = Api::namespaced(wh.client.clone(), "default");
    let holder = |l: Option<Lease>| l.and_then(|l| l.spec).and_then(|s| s.holder_identity);
    let leader = wh.leader().await;
    let leader_index: usize = leader.trim_start_matches("replica-").parse().expect("replica identity");

    // A burst of creates; the leader is killed once a third of them are done.
    let api = wh.services();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ok = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let burst = tokio::spawn({
        let (api, done, ok) = (api.clone(), done.clone(), ok.clone());
        async move {
            futures::future::join_all((0..300).map(|i| {
                let (api, done, ok) = (api.clone(), done.clone(), ok.clone());
                async move {
                    let r = api.create(&PostParams::default(), &service(&format!("burst-{i}"), |_| {})).await;
                    if r.is_ok() {
                        ok.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    r
                }
            }))
            .await
        }
    });
    let started = &done;
    eventually_some("the burst makes progress (100 creates done)", Duration::from_secs(120), Duration::from_millis(10), move || async move {
        (started.load(std::sync::atomic::Ordering::Relaxed) >= 100).then_some(())
    })
    .await;
    let (ok_before, done_before) = (ok.load(std::sync::atomic::Ordering::SeqCst), done.load(std::sync::atomic::Ordering::SeqCst));
    wh.children[leader_index].kill();
    let results = burst.await.expect("burst task");

    let mut seen = BTreeSet::new();
    let mut failed = 0;
    for r in &results {
        match r {
            Ok(svc) => {
                for ip in ips(svc) {
                    assert!(seen.insert(ip), "{ip} assigned twice");
                }
            }
            // Requests in flight on the killed replica fail (failurePolicy Fail); never a 422.
            Err(kube::Error::Api(s)) => {
                assert_ne!(s.code, 422, "a collision or bad answer: {s:?}");
                failed += 1;
            }
            Err(e) => panic!("unexpected client error: {e}"),
        }
    }
    // Before the kill both replicas answer; after it, requests in flight on (or on a
    // connection to) the killed replica fail, how many depends on timing — but not a 422.
    assert!(ok_before * 10 >= done_before * 9, "only {ok_before} of the {done_before} creates before the kill succeeded");
    eprintln!("leader kill: {ok_before}/{done_before} succeeded before it; {} of 300 in all, {failed} failed", seen.len());

    // The other replica takes the Lease over and serves.
    let survivor = format!("replica-{}", 1 - leader_index);
    let (leases, name, survivor) = (&leases, &wh.name, &survivor);
    eventually_some(&format!("{survivor} takes the Lease over"), Duration::from_secs(180), Duration::from_millis(200), move || async move {
        (holder(leases.get_opt(name).await.expect("read lease")).as_deref() == Some(survivor.as_str())).then_some(())
    })
    .await;
    let after = api.create(&PostParams::default(), &service("after-failover", |_| {})).await.expect("create after failover");
    assert!(!seen.contains(&ips(&after)[0]), "a new Service got an address already in use");

    // No lost record: every address handed out is recorded — by the kube-apiserver as an
    // IPAddress (both backends), and in our etcd map (etcd backend).
    let ipaddresses: Api<k8s_openapi::api::networking::v1::IPAddress> = Api::all(wh.client.clone());
    for ip in &seen {
        assert!(ipaddresses.get_opt(&ip.to_string()).await.expect("read IPAddress").is_some(), "{ip} has no IPAddress");
    }
    if backend != "etcd" {
        return;
    }
    let store = wh.records(&cp).await;
    use clusterip::store::AllocationStore;
    let recorded: BTreeSet<IpAddr> = store.allocated().await.expect("records").into_iter().collect();
    let lost: Vec<_> = seen.difference(&recorded).collect();
    assert!(lost.is_empty(), "addresses of live Services missing from the records: {lost:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_leader_killed_during_a_burst() {
    leader_killed_during_a_burst("etcd", Slice(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_leader_killed_during_a_burst() {
    leader_killed_during_a_burst("ipaddress", Slice(6)).await;
}
