//! A tenant looping creates that the kube-apiserver refuses after our answer pins nothing.

use k8s_openapi::api::core::v1::ServicePort;
use kube::api::{DeleteParams, PostParams};

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
