//! A tenant looping creates that the kube-apiserver refuses after our answer pins nothing.

use k8s_openapi::api::core::v1::ServicePort;
use kube::api::{Api, DeleteParams, PostParams};

use clusterip_test_support::control_plane;

use crate::harness::*;

/// A tenant looping creates that the kube-apiserver refuses after our answer (`port: 0`
/// fails its validation) pins no address (docs/reliability.md, "Tenants"): on a range of 30
/// addresses, six rounds of ten failing creates — twice the range — each round's addresses
/// released once the apiserver has released its own records of them (counted in
/// `clusterip_webhook_released_addresses_total{reason="apiserver_released"}`), and a valid
/// create after every round gets an address. Stock Kubernetes frees a failed create's
/// address at once; before, each held its address here for the in-flight limit (90 s) and
/// the range was full after 30.
async fn failed_creates_pin_nothing(backend: &str, slice: Slice) {
    let cp = control_plane();
    let small = format!("198.19.{}.0/27", 8 * slice.0 as u32);
    let wh = Webhook::start_with(&cp, backend, slice, |h| h.ranges = vec![small.clone(), slice.v6()]).await;
    let api = wh.services();
    let mut failed = 0;
    for round in 0..6 {
        for i in 0..10 {
            let invalid = service(&format!("invalid-{round}-{i}"), |s| s.ports = Some(vec![ServicePort { port: 0, ..Default::default() }]));
            match api.create(&PostParams::default(), &invalid).await {
                Err(kube::Error::Api(e)) if e.code == 422 && e.message.contains("spec.ports[0].port") => failed += 1,
                Err(kube::Error::Api(e)) if e.message.contains("already allocated") => {
                    let ip = e.message.split('"').nth(3).and_then(|s| s.parse().ok()).expect("the refused address in the message");
                    panic!("round {round}: a dynamic answer refused as taken ({}); {}", e.message, who_holds(&wh.client, ip).await)
                }
                other => panic!("round {round}: expected the apiserver's 422 on spec.ports[0].port, got {other:?}"),
            }
        }
        wait_released(&wh.children[0], failed, &format!("round {round}: the addresses of {failed} failed creates released")).await;
        let name = format!("valid-{round}");
        let svc = api.create(&PostParams::default(), &service(&name, |_| {})).await.unwrap_or_else(|e| panic!("round {round}: a valid create after {failed} failed ones: {e}"));
        assert!(ips(&svc).iter().all(|ip| ip.is_ipv4() && clusterip::cidr::ServiceCidr::parse(&small).expect("range").contains(*ip)), "{svc:?}");
        api.delete(&name, &DeleteParams::default()).await.expect("delete the valid Service");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_failed_creates_pin_nothing() {
    failed_creates_pin_nothing("etcd", Slice(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_failed_creates_pin_nothing() {
    failed_creates_pin_nothing("ipaddress", Slice(14)).await;
}

/// An IPAddress deleted under a live Service — the kube-apiserver's repair deleting and
/// recreating a record its informers judge wrong (a lagging apiserver's, in
/// `lagging_cache`), or a delete by hand — is no failed create: the webhook keeps the
/// address it answered (it reads that the Service holds it) instead of releasing it to the
/// next create while the Service still has it.
async fn a_deleted_record_of_a_live_service_is_not_released(backend: &str, slice: Slice) {
    use k8s_openapi::api::networking::v1::IPAddress;
    let cp = control_plane();
    let wh = Webhook::start(&cp, backend, slice).await;
    let api = wh.services();
    let svc = api.create(&PostParams::default(), &service("live", |_| {})).await.expect("create");
    let ip = ips(&svc)[0];
    let records: Api<IPAddress> = Api::all(wh.client.clone());
    let records = &records;
    clusterip_test_support::eventually("the Service's IPAddress", std::time::Duration::from_secs(30), || async move { records.get_opt(&ip.to_string()).await.ok().flatten().is_some() }).await;
    records.delete(&ip.to_string(), &DeleteParams::default()).await.expect("delete the IPAddress by hand");
    let c = &wh.children[0];
    clusterip_test_support::eventually("the webhook keeps the address (its log)", std::time::Duration::from_secs(30), || async move { c.log().contains("while its Service still holds it; kept") }).await;
    assert_eq!(released_by_apiserver(c).await, 0, "the address of a live Service was released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_a_deleted_record_of_a_live_service_is_not_released() {
    a_deleted_record_of_a_live_service_is_not_released("etcd", Slice(31)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_a_deleted_record_of_a_live_service_is_not_released() {
    a_deleted_record_of_a_live_service_is_not_released("ipaddress", Slice(15)).await;
}
