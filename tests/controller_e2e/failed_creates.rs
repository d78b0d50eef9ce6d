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

/// A replica stopped (SIGTERM) with an answer the kube-apiserver never recorded — a later
/// mutating webhook refused the create, as a request cut between the apiserver and us ends —
/// releases it before it exits (docs/operations.md, "Shutdown"). Before, the answer was
/// abandoned: the etcd backend's map held the address until the leader's repair pass
/// released it on its third pass (minutes), and the ipaddress backend's block Lease was not
/// given back (a pick in flight) but left for another replica to take over after the lease
/// duration. The range is a /28 of slice 0 that no other test uses.
async fn a_stopping_replica_releases_an_answer_never_recorded(backend: &str, range: &str) {
    use clusterip::cidr::ServiceCidr;
    use clusterip::store::AllocationStore;
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use k8s_openapi::api::coordination::v1::Lease;
    use std::time::Duration;
    let cp = control_plane();
    let cidr = ServiceCidr::parse(range).expect("range");
    let mut wh = Webhook::start_with(&cp, backend, Slice(0), |h| {
        h.ranges = vec![range.to_string()];
        // The address history on (in `default`, the harness's controller namespace): the
        // release is noted there as the replica's decision.
        h.flags(&["--in-flight-limit", "20s", "--apiserver-request-timeout", "5s", "--address-history-chunks", "64"]);
    })
    .await;
    let api = wh.services();

    // A mutating webhook after ours (configurations are called in name order) that cannot be
    // reached, for Services labelled refuse=yes: the create fails after our answer, before
    // the apiserver's own allocation records anything.
    let refusing = format!("{}-zz-refuse", wh.name);
    let config: MutatingWebhookConfiguration = serde_json::from_value(serde_json::json!({
        "metadata": {"name": refusing},
        "webhooks": [{"name": "refuse.clusterip.test", "clientConfig": {"url": "https://127.0.0.1:1/refuse"},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["services"], "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {"clusterip.allocator/e2e": wh.name}},
            "objectSelector": {"matchLabels": {"refuse": "yes"}},
            "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 5}]
    }))
    .expect("refusing configuration");
    let configs: Api<MutatingWebhookConfiguration> = Api::all(wh.client.clone());
    configs.create(&PostParams::default(), &config).await.expect("register the refusing webhook");
    let mut refused = service("refused", |_| {});
    refused.metadata.labels = Some([("refuse".to_string(), "yes".to_string())].into());
    let (api_ref, refused_ref) = (&api, &refused);
    // Until the apiserver has loaded the configuration, the create succeeds: undone and tried again.
    clusterip_test_support::eventually_ok("a create refused by the webhook after ours", Duration::from_secs(60), Duration::from_millis(500), move || async move {
        match api_ref.create(&PostParams::default(), refused_ref).await {
            Err(kube::Error::Api(e)) if e.message.contains("refuse.clusterip.test") => Ok(()),
            Ok(_) => {
                api_ref.delete("refused", &DeleteParams::default()).await.map_err(|e| format!("delete the created one: {e}"))?;
                Err("created: the refusing webhook is not loaded yet".to_string())
            }
            Err(e) => Err(format!("create failed otherwise: {e}")),
        }
    })
    .await;
    let answered = wh.children[0].log().matches("assigned ClusterIPs service=services/").count();
    assert!(answered >= 1, "no answer in the replica's log:\n{}", wh.children[0].log());

    // What the answer holds until the replica stops.
    let leases: Api<Lease> = Api::namespaced(wh.client.clone(), "default");
    async fn held(wh: &Webhook, cp: &clusterip_test_support::ControlPlane, backend: &str, cidr: &ServiceCidr, leases: &Api<Lease>) -> usize {
        match backend {
            "etcd" => {
                let store = wh.records_of(cp, vec![cidr.clone()]).await.expect("open the records");
                let held = store.allocated().await.expect("read the map");
                let _ = store.close().await;
                held.len()
            }
            _ => block_leases(leases, cidr).await.len(),
        }
    }
    assert!(held(&wh, &cp, backend, &cidr, &leases).await >= 1, "the answer of the refused create holds nothing before the replica stops");

    wh.children[0].signal(libc::SIGTERM);
    let status = tokio::task::block_in_place(|| wh.children[0].wait_exit(Duration::from_secs(60)));
    let log = wh.children[0].log();
    assert!(status.is_some_and(|s| s.success()), "the replica did not stop cleanly within 60 s: {status:?}\n{log}");
    assert_eq!(held(&wh, &cp, backend, &cidr, &leases).await, 0, "the refused create's address is still held after the replica stopped ({backend}):\n{log}");
    assert!(log.contains("answers settled"), "the replica did not settle its answers before exit:\n{log}");
    let _ = configs.delete(&refusing, &DeleteParams::default()).await;

    // `clusterip explain` tells the release as the stopped replica's decision, written
    // before it exited: the answer was never recorded, so it ends no holding.
    let answered: Vec<&str> = log.lines().filter(|l| l.contains("assigned ClusterIPs") && l.contains("/refused")).filter_map(|l| l.split("ips=").nth(1)).filter_map(|t| t.split_whitespace().next()).collect();
    let ip = *answered.last().unwrap_or_else(|| panic!("no answer for the refused create in the log:\n{log}"));
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_clusterip"))
        .args(["explain", ip, "--backend", "ipaddress", "--service-cidr", range, "--namespace", "default", "-o", "json", "--kubeconfig"])
        .arg(cp.kubeconfig())
        .output()
        .await
        .expect("run clusterip explain");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("explain printed no JSON ({e}): {}", String::from_utf8_lossy(&out.stderr)));
    let decisions = json["decisions"].as_array().cloned().unwrap_or_default();
    assert!(
        decisions.iter().any(|d| d["decision"] == "never-recorded" && d["by"] == "replica-0" && d["parent"].as_str().is_some_and(|p| p.ends_with("/refused"))),
        "no never-recorded decision of replica-0 for {ip}: {json:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_a_stopping_replica_releases_an_answer_never_recorded() {
    a_stopping_replica_releases_an_answer_never_recorded("etcd", "198.19.0.32/28").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_a_stopping_replica_releases_an_answer_never_recorded() {
    a_stopping_replica_releases_an_answer_never_recorded("ipaddress", "198.19.0.48/28").await;
}
