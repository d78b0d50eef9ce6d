//! What the webhook answers: dynamic, static, dual-stack and family-upgrade requests get
//! addresses of our ranges; duplicates, addresses outside them and malformed ones are refused
//! in Kubernetes' words; headless, ExternalName and dry runs as stock; a delete releases.

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Service, ServicePort};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

use clusterip_test_support::{control_plane, eventually_some};

use crate::harness::*;

async fn admission_cases(backend: &str, slice: Slice) {
    // Static addresses of the slice's static band.
    let (st, dry_ip) = (slice.v4_static(77).to_string(), slice.v4_static(88).to_string());
    let (st, dry_ip) = (st.as_str(), dry_ip.as_str());
    let cp = control_plane();
    let wh = Webhook::start(&cp, backend, slice).await;
    let api = wh.services();

    // Dynamic: from our dynamic band, patched in with families and policy.
    let svc = api.create(&PostParams::default(), &service("dynamic", |_| {})).await.expect("dynamic");
    let got = ips(&svc);
    assert_eq!(got.len(), 1);
    assert!(wh.in_dynamic_band(got[0]), "{} is not in our dynamic band", got[0]);
    let spec = svc.spec.clone().unwrap_or_default();
    assert_eq!(spec.ip_families, Some(vec!["IPv4".to_string()]));
    assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
    // The address is recorded as the IPAddress named by it, with the Service as parentRef.
    let out = cp.kubectl().args(["get", "ipaddresses", &got[0].to_string(), "-o", "jsonpath={.spec.parentRef.resource}/{.spec.parentRef.namespace}/{.spec.parentRef.name}"]).output().expect("kubectl");
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("services/{}/dynamic", wh.namespace), "{}", String::from_utf8_lossy(&out.stderr));

    // A Service whose status carries a condition set with a zero lastTransitionTime (the
    // apiserver stores and sends it as null) can still be updated: stock allows it, and our
    // webhook read such a review as malformed before (Kubernetes' e2e "should complete a
    // service status lifecycle" failed on it).
    let condition = json!({"status": {"conditions": [{"type": "StatusUpdate", "status": "True", "reason": "E2E", "message": "Set from e2e test", "lastTransitionTime": null}]}});
    // (Untyped: k8s-openapi's Service cannot read that condition back either.)
    let untyped: Api<kube::api::DynamicObject> = Api::namespaced_with(wh.client.clone(), &wh.namespace, &kube::api::ApiResource::erase::<Service>(&()));
    let pp = kube::api::PatchParams::default();
    untyped.patch_status("dynamic", &pp, &kube::api::Patch::Merge(&condition)).await.expect("set a status condition");
    let labelled = untyped.patch("dynamic", &pp, &kube::api::Patch::Merge(&json!({"metadata": {"labels": {"patched": "yes"}}}))).await;
    let labelled = labelled.unwrap_or_else(|e| panic!("an update of a Service with a null condition time was refused: {e}"));
    assert_eq!(labelled.metadata.labels.as_ref().and_then(|l| l.get("patched")).map(String::as_str), Some("yes"));
    assert!(labelled.data["status"]["conditions"][0]["lastTransitionTime"].is_null(), "{:?}", labelled.data);

    // Static: honoured (an address of our static band).
    let svc = api.create(&PostParams::default(), &service("static", |s| s.cluster_ip = Some(st.into()))).await.expect("static");
    assert_eq!(ips(&svc), vec![st.parse::<IpAddr>().unwrap()]);

    // Duplicate: the address the previous Service holds.
    expect_422(&api, &service("dup", |s| s.cluster_ip = Some(st.into())), &format!("failed to allocate IP {st}: provided IP is already allocated")).await;
    // Outside our ranges, though inside the apiserver's.
    expect_422(
        &api,
        &service("out", |s| s.cluster_ip = Some("198.19.200.5".into())),
        "spec.clusterIPs: Invalid value: [\"198.19.200.5\"]: failed to allocate IP 198.19.200.5: the provided network does not match the current range",
    )
    .await;
    // Malformed: named.
    expect_422(&api, &service("bad", |s| s.cluster_ip = Some("198.19.010.5".into())), "198.19.010.5").await;

    // Nothing a user sets beyond the spec steers admission: the annotation earlier versions
    // trusted (and added to every Service), naming an address outside our ranges, does not
    // get it past us.
    let mut annotated = service("annotated", |s| s.cluster_ip = Some("198.19.200.9".into()));
    annotated.metadata.annotations = Some([("clusterip.allocator/reserved".to_string(), "198.19.200.9".to_string())].into());
    expect_422(&api, &annotated, "failed to allocate IP 198.19.200.9: the provided network does not match the current range").await;

    // A family upgrade on UPDATE gets its second address from our ranges, and keeps the first.
    let single = api.create(&PostParams::default(), &service("upgrade", |_| {})).await.expect("single-stack");
    let first = ips(&single)[0];
    let patch = kube::api::Patch::Merge(json!({"spec": {"ipFamilyPolicy": "RequireDualStack"}}));
    let dual = api.patch("upgrade", &kube::api::PatchParams::default(), &patch).await.expect("upgrade to RequireDualStack");
    let got = ips(&dual);
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0], first);
    assert!(got[1].is_ipv6() && wh.in_dynamic_band(got[1]), "the added address {} is not from our range {}", got[1], slice.v6());

    // Headless and ExternalName: untouched.
    let svc = api.create(&PostParams::default(), &service("headless", |s| s.cluster_ip = Some("None".into()))).await.expect("headless");
    assert_eq!(svc.spec.and_then(|s| s.cluster_ip).as_deref(), Some("None"));
    let svc = api
        .create(&PostParams::default(), &service("external", |s| {
            s.type_ = Some("ExternalName".into());
            s.external_name = Some("example.invalid".into());
            s.ports = None;
        }))
        .await
        .expect("ExternalName");
    assert_eq!(svc.spec.and_then(|s| s.cluster_ip), None);
    // ExternalName turned into a ClusterIP Service: the UPDATE gets one of our addresses.
    let mut changed = api.get("external").await.expect("get ExternalName Service");
    if let Some(spec) = changed.spec.as_mut() {
        spec.type_ = Some("ClusterIP".into());
        spec.external_name = None;
        spec.ports = Some(vec![ServicePort { port: 80, ..Default::default() }]);
    }
    let svc = api.replace("external", &PostParams::default(), &changed).await.expect("ExternalName to ClusterIP");
    let got = ips(&svc);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(wh.in_dynamic_band(got[0]), "{} is not in our dynamic band", got[0]);

    // Dual-stack: one address per family, both ours.
    let svc = api
        .create(&PostParams::default(), &service("dual", |s| s.ip_family_policy = Some("RequireDualStack".into())))
        .await
        .expect("dual-stack");
    let got = ips(&svc);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got.iter().all(|ip| wh.in_dynamic_band(*ip)), "{got:?}");
    assert!(got[0].is_ipv4() && got[1].is_ipv6());

    // Dry-run reserves nothing: the same static address twice in dry-run both pass.
    let dry = PostParams { dry_run: true, ..Default::default() };
    api.create(&dry, &service("dry1", |s| s.cluster_ip = Some(dry_ip.into()))).await.expect("dry-run 1");
    api.create(&dry, &service("dry2", |s| s.cluster_ip = Some(dry_ip.into()))).await.expect("dry-run 2");
    api.create(&PostParams::default(), &service("real88", |s| s.cluster_ip = Some(dry_ip.into()))).await.expect("after dry-runs the address is free");

    // Delete releases: the address of a deleted Service can be requested again once the
    // leader's Service reconciler has seen the delete.
    api.delete("static", &DeleteParams::default()).await.expect("delete");
    let api = &api;
    let svc = eventually_some(&format!("{st} is released after its Service's deletion"), Duration::from_secs(120), Duration::from_millis(100), move || async move {
        match api.create(&PostParams::default(), &service("static-again", |s| s.cluster_ip = Some(st.into()))).await {
            Ok(svc) => Some(svc),
            Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains("already allocated") => None,
            Err(e) => panic!("unexpected error: {e}"),
        }
    })
    .await;
    assert_eq!(ips(&svc), vec![st.parse::<IpAddr>().unwrap()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_admission() {
    admission_cases("etcd", Slice(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_admission() {
    admission_cases("ipaddress", Slice(2)).await;
}
