//! When an address is held, as stock Kubernetes holds it, and (etcd backend) the records
//! following the Services.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Service, ServicePort};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::Client;
use serde_json::json;

use clusterip_test_support::{control_plane, eventually_ok, eventually_some, within, ControlPlane};

use crate::harness::*;

/// Stock Kubernetes' own race after a delete: the kube-apiserver's IPAddress repair
/// controller reads Services and IPAddresses from two caches, and when the deletion of a
/// just-deleted Service's IPAddress reaches its cache before the Service's own deletion does,
/// it creates the IPAddress again for the Service it still sees (a Warning
/// `ClusterIPNotAllocated` on that Service, reported by `ipallocator-repair-controller`), and
/// deletes it as leaked 60 s later. Meanwhile stock refuses a create of that address as
/// "already allocated", as our webhook does. Whether that is why `ip` is held: such an Event
/// for `service` naming `ip` (looked for up to 10 s: Events are written asynchronously).
async fn stock_repair_holds(client: &Client, namespace: &str, service: &str, ip: IpAddr) -> bool {
    use k8s_openapi::api::events::v1::Event;
    let events = &Api::<Event>::namespaced(client.clone(), namespace);
    within(Duration::from_secs(10), Duration::from_millis(200), move || async move {
        let found = events.list(&ListParams::default()).await.map(|l| {
            l.items.iter().any(|e| {
                e.reason.as_deref() == Some("ClusterIPNotAllocated")
                    && e.reporting_controller.as_deref() == Some("ipallocator-repair-controller")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(service)
                    && e.note.as_deref().is_some_and(|n| n.contains(&ip.to_string()))
            })
        });
        found.unwrap_or(false).then_some(())
    })
    .await
    .is_some()
}

/// Wait until no IPAddress records `ip` (read from storage).
async fn wait_unrecorded(client: &Client, ip: IpAddr, limit: Duration) {
    use k8s_openapi::api::networking::v1::IPAddress;
    let addrs = &Api::<IPAddress>::all(client.clone());
    eventually_some(&format!("{ip} is no longer recorded"), limit, Duration::from_millis(200), move || async move {
        addrs.get_opt(&ip.to_string()).await.expect("read IPAddress").is_none().then_some(())
    })
    .await
}

/// When an address is held, as stock Kubernetes holds it: from the moment a Service holding
/// it is stored until the moment it no longer holds it. Requests that fail after our webhook
/// answered hold nothing a retry trips over; delete, ExternalName and a new request of the
/// same address follow each other at once.
async fn lifecycle_cases(backend: &str, slice: Slice) {
    let cp = control_plane();
    // A short in-flight limit, so an answered address whose request failed comes back
    // within the test. The limit must exceed the kube-apiserver's request timeout, which the
    // controller cannot read: the dev apiserver keeps Kubernetes' 60 s, and the test states
    // the bound its own requests meet (a Service create on a quiet cluster: well under 5 s),
    // as an operator states the cluster's.
    let wh = Webhook::start_with(&cp, backend, slice, |h| {
        h.flags(&["--in-flight-limit", "20s", "--apiserver-request-timeout", "5s"])
    })
    .await;
    let api = wh.services();
    let create = |svc: Service| {
        let api = api.clone();
        async move { api.create(&PostParams::default(), &svc).await }
    };
    let with_ip = |name: &str, ip: IpAddr| service(name, |s| s.cluster_ip = Some(ip.to_string()));
    // A request our webhook admits and the apiserver's validation then refuses (port 0).
    let failing = |name: &str, ip: Option<IpAddr>| {
        service(name, |s| {
            s.cluster_ip = ip.map(|ip| ip.to_string());
            s.ports = Some(vec![ServicePort { port: 0, ..Default::default() }]);
        })
    };
    let expect_invalid_port = |r: Result<Service, kube::Error>| match r {
        Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains("spec.ports[0].port") => {}
        other => panic!("expected the apiserver's 422 on spec.ports[0].port, got {other:?}"),
    };

    // 1. A failed create, retried at once by the same Service and by another one.
    let a = slice.v4_static(11);
    expect_invalid_port(create(failing("retried", Some(a))).await);
    let svc = create(with_ip("retried", a)).await.expect("the same Service, retried with the same address");
    assert_eq!(ips(&svc), vec![a]);
    let b = slice.v4_static(12);
    expect_invalid_port(create(failing("failed-first", Some(b))).await);
    let svc = create(with_ip("another", b)).await.expect("another Service, asking for the address a failed create asked for");
    assert_eq!(ips(&svc), vec![b]);

    // 2. Delete, then create again with the same address: 20 times in a row, at once.
    let c = slice.v4_static(13);
    // A create right after a delete, refused only for the stock race `stock_repair_holds`
    // describes (then stock refuses it too): the test waits that out and creates again.
    let create_after_delete = |name: &'static str, previous: &'static str, what: String| {
        let (create, client, ns) = (create, wh.client.clone(), wh.namespace.clone());
        async move {
            match create(with_ip(name, c)).await {
                Ok(svc) => svc,
                Err(kube::Error::Api(e)) if e.code == 422 && e.message.contains("provided IP is already allocated") => {
                    assert!(stock_repair_holds(&client, &ns, previous, c).await, "{what}: create with {c} refused, and not for the kube-apiserver's own repair race: {e:?}");
                    eprintln!("{what}: the kube-apiserver's repair controller re-created {c} for the deleted {previous}; waiting for it to clean up");
                    wait_unrecorded(&client, c, Duration::from_secs(120)).await;
                    create(with_ip(name, c)).await.unwrap_or_else(|e| panic!("{what}: create with {c} once the apiserver released it: {e}"))
                }
                Err(e) => panic!("{what}: create with {c}: {e}"),
            }
        }
    };
    for round in 0..20 {
        let svc = create_after_delete("again", "again", format!("round {round}")).await;
        assert_eq!(ips(&svc), vec![c]);
        api.delete("again", &DeleteParams::default()).await.unwrap_or_else(|e| panic!("round {round}: delete: {e}"));
    }
    // A deleted Service's address is free for any Service at once.
    let svc = create_after_delete("successor", "again", "another Service, right after the delete".into()).await;
    assert_eq!(ips(&svc), vec![c]);

    // 3. ClusterIP → ExternalName → ClusterIP, with the old address and then with a new one;
    //    the address given up is free for another Service at once.
    let (d, e) = (slice.v4_static(14), slice.v4_static(15));
    create(with_ip("flip", d)).await.expect("ClusterIP Service");
    let to_external = kube::api::Patch::Merge(json!({"spec": {"type": "ExternalName", "externalName": "example.invalid"}}));
    let to_cluster_ip = |ip: IpAddr| kube::api::Patch::Merge(json!({"spec": {"type": "ClusterIP", "externalName": null, "clusterIP": ip.to_string(), "ports": [{"port": 80}]}}));
    let pp = kube::api::PatchParams::default();
    api.patch("flip", &pp, &to_external).await.expect("to ExternalName");
    let svc = api.patch("flip", &pp, &to_cluster_ip(d)).await.expect("back to ClusterIP with the old address");
    assert_eq!(ips(&svc), vec![d]);
    api.patch("flip", &pp, &to_external).await.expect("to ExternalName again");
    let svc = create(with_ip("taker", d)).await.expect("another Service takes the address given up");
    assert_eq!(ips(&svc), vec![d]);
    let svc = api.patch("flip", &pp, &to_cluster_ip(e)).await.expect("back to ClusterIP with a new address");
    assert_eq!(ips(&svc), vec![e]);

    if backend == "etcd" {
        etcd_records_follow_the_services(&cp, &wh, slice, [a, b, c, d, e]).await;
    }
}

/// The etcd backend's records end up as the Services are: the addresses held recorded,
/// what was given up or never stored released (an answered dynamic address included, after
/// the in-flight limit), and an address with a recorded owner other than a Service neither
/// taken by a Service nor released by the repair pass or by anyone but its owner.
async fn etcd_records_follow_the_services(cp: &ControlPlane, wh: &Webhook, slice: Slice, held: [IpAddr; 5]) {
    use clusterip::repair::{Repairer, Target};
    use clusterip::store::{AllocationStore, ParentRef, StoreError};
    use std::sync::Arc;
    let store: Arc<dyn AllocationStore> = Arc::new(wh.records(cp).await);
    let api = wh.services();
    let static_band: BTreeSet<IpAddr> = (1..=128).map(|n| slice.v4_static(n)).collect();
    let recorded_static = || async { store.allocated().await.expect("allocated").into_iter().filter(|ip| static_band.contains(ip)).collect::<BTreeSet<_>>() };
    // Held now: a (retried), b (another), c (successor), d (taker), e (flip).
    let want: BTreeSet<IpAddr> = held.into_iter().collect();
    let (recorded, wanted) = (&recorded_static, &want);
    eventually_ok(&format!("the static band's records are the addresses the Services hold {want:?}"), Duration::from_secs(120), Duration::from_millis(250), move || async move {
        let got = recorded().await;
        if got == *wanted {
            Ok(())
        } else {
            Err(format!("{got:?}"))
        }
    })
    .await;

    // A dynamic address answered for a create that then fails is released as soon as the
    // apiserver releases its own record of it, as stock frees it: nothing is left recorded.
    let before: BTreeSet<IpAddr> = store.allocated().await.expect("allocated").into_iter().collect();
    let released_before = released_by_apiserver(&wh.children[0]).await;
    let failed = service("failed-dynamic", |s| s.ports = Some(vec![ServicePort { port: 0, ..Default::default() }]));
    assert!(api.create(&PostParams::default(), &failed).await.is_err(), "a create with port 0 succeeded");
    wait_released(&wh.children[0], released_before + 1, "the failed create's address released").await;
    let now: BTreeSet<IpAddr> = store.allocated().await.expect("allocated").into_iter().collect();
    assert!(now.is_subset(&before), "recorded after the failed create: {:?}", now.difference(&before).collect::<Vec<_>>());
    // The in-flight limit (20 s here) passes — time is the subject, hence the sleep — and the
    // addresses stored Services hold are still recorded.
    tokio::time::sleep(Duration::from_secs(25)).await;
    assert_eq!(recorded_static().await, want, "an address a stored Service holds was released");

    // An owner other than a Service.
    let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: "edge".into() };
    let f = slice.v4_static(16);
    store.allocate(f, Some(&gateway)).await.expect("record an address for a Gateway");
    assert_eq!(store.owner(f).await.expect("owner"), Some(gateway.clone()));
    expect_422(&api, &service("squatter", |s| s.cluster_ip = Some(f.to_string())), &format!("failed to allocate IP {f}: provided IP is already allocated")).await;
    let client = cp.client().await;
    let mut repairer = Repairer::new(client, Target::Etcd(store.clone()));
    for pass in 0..4 {
        repairer.run_once(true, true, None).await.unwrap_or_else(|e| panic!("repair pass {pass}: {e}"));
        assert!(store.has(f).await.expect("has"), "repair pass {pass} released the Gateway's address");
    }
    let other = ParentRef { name: "other".into(), ..gateway.clone() };
    assert!(matches!(store.release(f).await, Err(StoreError::NotOwner { .. })), "an unowned release took the Gateway's address");
    assert!(matches!(store.release_owned(f, &other).await, Err(StoreError::NotOwner { .. })), "another owner released the Gateway's address");
    assert!(store.has(f).await.expect("has"));
    store.release_owned(f, &gateway).await.expect("the owner releases");
    assert!(!store.has(f).await.expect("has"));
    assert_eq!(store.owner(f).await.expect("owner"), None);
    let svc = api.create(&PostParams::default(), &service("after-gateway", |s| s.cluster_ip = Some(f.to_string()))).await.expect("the address, once its owner released it");
    assert_eq!(ips(&svc), vec![f]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_address_lifecycle() {
    lifecycle_cases("etcd", Slice(11)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_address_lifecycle() {
    lifecycle_cases("ipaddress", Slice(12)).await;
}
