//! The Service reconciler: an address a Service got without our webhook is recorded,
//! reported in Kubernetes' words and released; a stored legacy-form address is the one it
//! spells.

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use clusterip_test_support::{block_on_drop, control_plane, eventually_ok, eventually_some, free_leftover, unique_name};

use crate::harness::*;

/// The Service reconciler (on the leader) records an address in our range that a Service got
/// without our webhook (here: a namespace the webhook does not select), says so with a
/// Warning Event in Kubernetes' words, and releases it when the Service goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn service_reconciler_records_reports_and_releases() {
    use clusterip::store::AllocationStore;
    use k8s_openapi::api::events::v1::Event;
    let cp = control_plane();
    let slice = Slice(8);
    let wh = Webhook::start(&cp, "etcd", slice).await;
    let api: Api<Service> = Api::namespaced(wh.client.clone(), "default");
    let name = unique_name("unrecorded");
    let ip = slice.v4_static(123);
    free_leftover(&wh.client, &ip.to_string(), |p| p.name.starts_with("unrecorded-")).await;
    let _cleanup = DeleteOnDrop(api.clone(), name.clone());
    api.create(&PostParams::default(), &service(&name, |s| s.cluster_ip = Some(ip.to_string()))).await.expect("create outside the webhook's namespaces");
    let store = wh.records(&cp).await;
    let events: Api<Event> = Api::namespaced(wh.client.clone(), "default");
    // Whichever finds the missing record first reports it, in stock Kubernetes' words for
    // its kind of check: the Service reconciler (as kube-apiserver's IPAddress repair,
    // `Cluster IP [IPv4]: <ip> …`) or, when its watch lags behind a repair pass, the repair
    // pass over the allocation map (as the legacy bitmap repair, `Cluster IP [IPv4]:<ip> …`).
    let wanted = [format!("Cluster IP [IPv4]: {ip} is not allocated; repairing"), format!("Cluster IP [IPv4]:{ip} is not allocated; repairing")];
    let (store, events, name, wanted, wh) = (&store, &events, &name, &wanted, &wh);
    eventually_ok("the address is recorded and the Event reported", Duration::from_secs(120), Duration::from_millis(200), move || async move {
        let recorded = store.has(ip).await.unwrap_or(false);
        let listed = events.list(&ListParams::default()).await.expect("list events");
        let reported = listed.items.iter().any(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
                && e.reason.as_deref() == Some("ClusterIPNotAllocated")
                && e.type_.as_deref() == Some("Warning")
                && e.note.as_ref().is_some_and(|n| wanted.contains(n))
        });
        if recorded && reported {
            return Ok(());
        }
        let about: Vec<String> =
            listed.items.iter().filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())).map(|e| format!("{:?} {:?} {:?} by {:?}", e.type_, e.reason, e.note, e.reporting_controller)).collect();
        Err(format!("recorded={recorded}, event reported={reported}; Events about the Service: {about:?}; the controller's log:\n{}", wh.children[0].log()))
    })
    .await;
    api.delete(name, &DeleteParams::default()).await.expect("delete");
    eventually_some(&format!("{ip} is no longer recorded after its Service was deleted"), Duration::from_secs(120), Duration::from_millis(200), move || async move {
        (!store.has(ip).await.unwrap_or(true)).then_some(())
    })
    .await;
}

/// A Service stored before the apiserver validated addresses strictly (written here straight
/// into the apiserver's etcd: `clusterIP` with leading zeros) holds the address its text
/// spells, as Kubernetes reads it: the controller records that address and posts no
/// `ClusterIPNotValid` (it did until 2026-11-26; stock does not).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stored_legacy_form_address_is_the_address_it_spells() {
    use clusterip::store::AllocationStore;
    use k8s_openapi::api::events::v1::Event;
    let cp = control_plane();
    let slice = Slice(22);
    let wh = Webhook::start(&cp, "etcd", slice).await;
    let api: Api<Service> = Api::namespaced(wh.client.clone(), "default");
    let name = unique_name("legacy");
    let ip = slice.v4_static(77);
    free_leftover(&wh.client, &ip.to_string(), |p| p.name.starts_with("legacy-")).await;
    let IpAddr::V4(v4) = ip else { unreachable!("v4_static is IPv4") };
    let [a, b, c, d] = v4.octets();
    let legacy = format!("{a}.{b}.0{c}.00{d}");
    let svc = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "uid": uuid_for(&name), "creationTimestamp": "2030-01-01T00:00:00Z"},
        "spec": {"clusterIP": legacy, "clusterIPs": [legacy], "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "type": "ClusterIP",
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}], "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"},
        "status": {"loadBalancer": {}}
    });
    let mut etcd = etcd_client::Client::connect(cp.etcd_endpoints(), None).await.expect("connect to etcd");
    etcd.put(format!("/registry/services/specs/default/{name}"), svc.to_string(), None).await.expect("write a Service into the apiserver's etcd");
    let _cleanup = DeleteOnDrop(api.clone(), name.clone());
    let store = wh.records(&cp).await;
    let events: Api<Event> = Api::namespaced(wh.client.clone(), "default");
    let ours = |e: &Event| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str()) && e.reporting_controller.as_deref().is_some_and(|c| c.starts_with("clusterip"));
    let (store, events, ours, legacy, wh) = (&store, &events, &ours, &legacy, &wh);
    eventually_ok(&format!("{legacy} is recorded as {ip}"), Duration::from_secs(120), Duration::from_millis(200), move || async move {
        let listed = events.list(&ListParams::default()).await.expect("list events");
        let mine: Vec<String> = listed.items.iter().filter(|e| ours(e)).map(|e| format!("{:?} {:?}", e.reason, e.note)).collect();
        assert!(!mine.iter().any(|e| e.contains("ClusterIPNotValid")), "{legacy} reported as not valid: {mine:?}");
        // Recorded (by the Service reconciler or a repair pass) under the address it spells,
        // and that said so in stock's words.
        if store.has(ip).await.unwrap_or(false) && mine.iter().any(|e| e.contains("ClusterIPNotAllocated") && e.contains(&ip.to_string())) {
            return Ok(());
        }
        Err(format!("our Events: {mine:?}; the controller's log:\n{}", wh.children[0].log()))
    })
    .await;
}

/// A made-up uid for an object written straight into etcd (the apiserver serves it as is).
fn uuid_for(name: &str) -> String {
    let h = name.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    format!("00000000-0000-4000-8000-{:012x}", h & 0xffff_ffff_ffff)
}

/// Deletes the Service (namespace, name) when dropped: a failed test leaves no address held.
struct DeleteOnDrop(Api<Service>, String);

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        let (api, name) = (self.0.clone(), self.1.clone());
        block_on_drop(async move {
            let _ = api.delete(&name, &DeleteParams::default()).await;
        });
    }
}
