//! ServiceCIDR objects: their finalizer and Ready condition (beside kube-controller-manager
//! too), and the ranges the controller follows from them.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use clusterip_test_support::{block_on_drop, control_plane, eventually_ok, eventually_some, unique_name};

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn servicecidr_finalizer_ready_and_terminating() {
    use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
    let cp = control_plane();
    let wh = Webhook::start(&cp, "etcd", Slice(7)).await;
    let cidrs: Api<ServiceCIDR> = Api::all(wh.client.clone());
    let addrs: Api<IPAddress> = Api::all(wh.client.clone());
    let name = unique_name("cidr");
    let sc: ServiceCIDR = serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": ["198.18.250.0/24"]}})).unwrap();
    cidrs.create(&PostParams::default(), &sc).await.expect("create ServiceCIDR");

    let ready = |sc: &ServiceCIDR| {
        sc.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|c| c.iter().find(|c| c.type_ == "Ready")).map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    };
    let has_finalizer = |sc: &ServiceCIDR| sc.metadata.finalizers.iter().flatten().any(|f| f == "networking.k8s.io/service-cidr-finalizer");
    type Check = Box<dyn Fn(&Option<ServiceCIDR>) -> bool + Send>;
    let poll = |what: &'static str, f: Check| {
        let cidrs = cidrs.clone();
        let name = name.clone();
        async move {
            let (cidrs, name, f) = (&cidrs, &name, &f);
            eventually_ok(&format!("the ServiceCIDR becomes {what}"), Duration::from_secs(60), Duration::from_millis(200), move || async move {
                let got = cidrs.get_opt(name).await.expect("get ServiceCIDR");
                if f(&got) {
                    Ok(got)
                } else {
                    Err(format!("{got:?}"))
                }
            })
            .await
        }
    };
    poll("ready with the finalizer", Box::new(move |sc| sc.as_ref().map(|sc| has_finalizer(sc) && ready(sc).map(|r| r.0 == "True").unwrap_or(false)).unwrap_or(false))).await;

    // An address only this ServiceCIDR covers keeps it from going away.
    let ip: IPAddress = serde_json::from_value(json!({"metadata": {"name": "198.18.250.10"}, "spec": {"parentRef": {"group": "", "resource": "services", "namespace": "default", "name": "holder"}}})).unwrap();
    let _ = addrs.delete("198.18.250.10", &DeleteParams::default()).await;
    addrs.create(&PostParams::default(), &ip).await.expect("create IPAddress");
    cidrs.delete(&name, &DeleteParams::default()).await.expect("delete ServiceCIDR");
    let got = poll("Terminating", Box::new(move |sc| sc.as_ref().and_then(ready).map(|r| r.0 == "False" && r.1 == "Terminating").unwrap_or(false))).await;
    let got = got.expect("still there");
    assert!(has_finalizer(&got), "finalizer removed while an address depends on the ServiceCIDR");
    assert!(ready(&got).unwrap().2.contains("There are still IPAddresses referencing the ServiceCIDR"));
    // Which address keeps it, and whose, in a Warning Event on the ServiceCIDR (the Ready
    // condition keeps Kubernetes' words).
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(wh.client.clone(), "default");
    let (events, name_ref) = (&events, &name);
    let note = eventually_ok("a ServiceCIDRInUse Event naming the address", Duration::from_secs(60), Duration::from_millis(200), move || async move {
        let list = events.list(&ListParams::default()).await.expect("list Events");
        list.items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("ServiceCIDRInUse") && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name_ref.as_str()))
            .and_then(|e| e.note)
            .ok_or_else(|| "none yet".to_string())
    })
    .await;
    let expected = "Deletion waits for 1 address(es) only this ServiceCIDR covers: 198.18.250.10 (services/default/holder); delete or re-create their Services in another range (clusterip what-if delete-cidr lists them all)";
    assert_eq!(note, expected);
    // The same in a condition of ours beside Ready, which keeps Kubernetes' words.
    let in_use = |sc: &ServiceCIDR| {
        sc.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|c| c.iter().find(|c| c.type_ == "clusterip.allocator/InUse")).map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    };
    let got = poll("InUse", Box::new(move |sc| sc.as_ref().and_then(in_use).is_some())).await.expect("still there");
    assert_eq!(in_use(&got), Some(("True".to_string(), "AddressesInUse".to_string(), expected.to_string())));
    assert!(ready(&got).unwrap().2.contains("There are still IPAddresses referencing the ServiceCIDR"), "Ready's message changed: {got:?}");

    // Once the address is gone, the finalizer goes and so does the ServiceCIDR.
    addrs.delete("198.18.250.10", &DeleteParams::default()).await.expect("delete IPAddress");
    poll("deleted", Box::new(|sc| sc.is_none())).await;
}

/// Beside kube-controller-manager, as in a real control plane: its service-cidr-controller and
/// our ServiceCIDR reconciler write the same finalizer and the same Ready condition (status,
/// no reason, message), and each compares before it writes, so once a ServiceCIDR has settled
/// neither rewrites it. Checked on one ServiceCIDR that kube-controller-manager settled before
/// our controller started and one created while both run: the resourceVersion of each stays
/// unchanged for `CLUSTERIP_SERVICECIDR_SETTLE_SECONDS` (default 60; docs/fidelity.md records
/// a 10-minute run). Then deleting one ends with its finalizer removed and the object gone.
///
/// On a control plane of its own: on the shared one, the leading controllers of other tests
/// reconcile every ServiceCIDR too, and one of them may settle the first before
/// kube-controller-manager does (which then, finding the object as it wants it, writes
/// nothing: seen in a soak as "kube-controller-manager did not write the Ready condition"),
/// or start leading later and apply the same condition as a manager of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn servicecidr_settles_beside_kube_controller_manager() {
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    if std::env::var("CLUSTERIP_KCM").as_deref() == Ok("0") {
        eprintln!("CLUSTERIP_KCM=0: no kube-controller-manager to settle beside");
        return;
    }
    let cp = clusterip_test_support::ControlPlane::private_with("servicecidr-settle", &[("CLUSTERIP_KCM", "1")]);
    assert!(cp.var_opt("CLUSTERIP_KCM_URL").is_some(), "the control plane runs no kube-controller-manager (CLUSTERIP_KCM_URL missing from its env)");
    let hold = Duration::from_secs(std::env::var("CLUSTERIP_SERVICECIDR_SETTLE_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(60));
    let client = cp.client().await;
    let cidrs: Api<ServiceCIDR> = Api::all(client.clone());
    let create = |prefix: &'static str| {
        let cidrs = cidrs.clone();
        async move {
            let name = unique_name("settle");
            let sc: ServiceCIDR = serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": [prefix]}})).unwrap();
            cidrs.create(&PostParams::default(), &sc).await.expect("create ServiceCIDR");
            name
        }
    };
    // Settled as kube-controller-manager leaves it: its finalizer, Ready=True without a reason.
    let settled = |sc: &ServiceCIDR| {
        let ready = sc.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
        sc.metadata.finalizers.iter().flatten().any(|f| f == "networking.k8s.io/service-cidr-finalizer")
            && ready.is_some_and(|c| c.status == "True" && c.reason.is_empty() && c.message == "Kubernetes Service CIDR is ready")
    };
    let wait_settled = |name: String| {
        let cidrs = cidrs.clone();
        async move {
            let (cidrs, name) = (&cidrs, &name);
            let what = format!("ServiceCIDR {name} is settled (finalizer, Ready=True with kube-controller-manager's message and no reason)");
            eventually_ok(&what, Duration::from_secs(60), Duration::from_millis(200), move || async move {
                let got = cidrs.get(name).await.expect("get ServiceCIDR");
                if settled(&got) {
                    Ok(got)
                } else {
                    Err(format!("{:?} {:?}", got.metadata.finalizers, got.status))
                }
            })
            .await
        }
    };
    let first = create("198.18.251.0/24").await;
    let _cleanup_first = ServiceCidrOnDrop(cidrs.clone(), first.clone());
    let before = wait_settled(first.clone()).await;
    let managers = |sc: &ServiceCIDR| sc.metadata.managed_fields.iter().flatten().filter_map(|m| m.manager.clone()).collect::<Vec<_>>();
    assert!(managers(&before).iter().any(|m| m == "service-cidr-controller"), "kube-controller-manager did not write the Ready condition: managers {:?}", managers(&before));

    // Our controller, leading (its reconcilers run only on the leader), then one more.
    let wh = Webhook::start(&cp, "etcd", Slice(21)).await;
    wh.leader().await;
    let second = create("198.18.252.0/24").await;
    let _cleanup_second = ServiceCidrOnDrop(cidrs.clone(), second.clone());
    wait_settled(second.clone()).await;

    // Settled: from here on nobody writes either of them.
    let mut versions = Vec::new();
    for name in [&first, &second] {
        versions.push((name.clone(), cidrs.get(name).await.expect("get ServiceCIDR")));
    }
    // Time is the subject here ("unchanged for `hold`"): every second until it has passed.
    let until = Instant::now() + hold;
    while Instant::now() < until {
        for (name, then) in &versions {
            let now = cidrs.get(name).await.expect("get ServiceCIDR");
            assert_eq!(
                now.metadata.resource_version, then.metadata.resource_version,
                "ServiceCIDR {name} rewritten after it settled (a condition or finalizer fight):\nthen: {:?}\n{:?}\nnow: {:?}\n{:?}",
                then.metadata.managed_fields, then.status, now.metadata.managed_fields, now.status
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    eprintln!("ServiceCIDRs {first} and {second} unchanged for {}s beside kube-controller-manager", hold.as_secs());

    // A deletion with no address depending on it completes (grace period 10 s); both go, so
    // that no later test finds them (stock's dry-run answers depend on which ServiceCIDRs exist).
    for name in [&second, &first] {
        cidrs.delete(name, &DeleteParams::default()).await.expect("delete ServiceCIDR");
    }
    let (cidrs, names) = (&cidrs, &[&second, &first]);
    eventually_ok("both ServiceCIDRs are gone after their deletion", Duration::from_secs(60), Duration::from_millis(200), move || async move {
        for name in names {
            if let Some(sc) = cidrs.get_opt(name).await.expect("get ServiceCIDR") {
                return Err(format!("ServiceCIDR {name} still there: {:?} {:?}", sc.metadata.finalizers, sc.status));
            }
        }
        Ok(())
    })
    .await;
}

/// `--use-servicecidrs` on the controller (the ipaddress backend's address blocks): a
/// ServiceCIDR object created while it runs is followed as the kube-apiserver's own allocator
/// follows it — an address requested in its range is admitted (before: refused as "the
/// provided network does not match the current range", which is what Kubernetes' e2e
/// "Service CIDRs should create Services and serve on different Service CIDRs" found), new
/// addresses come from it once the `--service-cidr` range is full, and once it is being
/// deleted neither happens. Then, its Services gone, the ServiceCIDR goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_follows_servicecidr_objects() {
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    let cp = control_plane();
    let slice = Slice(24);
    let flag_range = clusterip::cidr::ServiceCidr::parse("198.19.192.0/28").expect("range");
    let wh = Webhook::start_with(&cp, "ipaddress", slice, |h| {
        h.ranges = vec![flag_range.to_string()];
        h.flags(&["--use-servicecidrs"]);
    })
    .await;
    let api = wh.services();
    // Named to sort before the cluster's own "kubernetes" ServiceCIDR (198.19.0.0/16, which
    // the controller follows too): objects' ranges are tried by name, after --service-cidr.
    let name = format!("a-{}", unique_name("cidr"));
    let cidrs: Api<ServiceCIDR> = Api::all(wh.client.clone());
    let extra = clusterip::cidr::ServiceCidr::parse("198.18.236.0/28").expect("range");
    let sc: ServiceCIDR = serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": [extra.to_string()]}})).expect("ServiceCIDR");
    let requested: IpAddr = "198.18.236.5".parse().expect("ip");
    expect_422(&api, &service("early", |s| s.cluster_ip = Some(requested.to_string())), "denied the request: Service \"early\" is invalid: spec.clusterIPs: Invalid value: [\"198.18.236.5\"]: failed to allocate IP 198.18.236.5: the provided network does not match the current range").await;
    cidrs.create(&PostParams::default(), &sc).await.expect("create ServiceCIDR");
    let _cleanup = ServiceCidrOnDrop(cidrs.clone(), name.clone());

    // The requested address, once both the apiserver and the controller follow the object.
    let svc = eventually_some("a Service with an address of the new ServiceCIDR is admitted", Duration::from_secs(60), Duration::from_millis(250), || {
        let api = api.clone();
        async move { api.create(&PostParams::default(), &service("requested", |s| s.cluster_ip = Some(requested.to_string()))).await.ok() }
    })
    .await;
    assert_eq!(ips(&svc), vec![requested]);

    // New addresses: the --service-cidr range first, then the ServiceCIDR's.
    let mut got = Vec::new();
    for i in 0..(flag_range.size() + extra.size() - 1) {
        let svc = api.create(&PostParams::default(), &service(&format!("dyn-{i}"), |_| {})).await.unwrap_or_else(|e| panic!("create {i}: {e}"));
        got.extend(ips(&svc));
    }
    let n = flag_range.size() as usize;
    assert!(got[..n].iter().all(|ip| flag_range.contains(*ip)), "left --service-cidr before it was full: {got:?}");
    assert!(got[n..].iter().all(|ip| extra.contains(*ip)), "not from the ServiceCIDR once --service-cidr was full: {got:?}");
    let unique: BTreeSet<IpAddr> = got.iter().copied().chain([requested]).collect();
    assert_eq!(unique.len(), got.len() + 1, "an address given twice: {got:?}");

    // Being deleted (its addresses in use keep it, Ready=False): nothing new from it.
    cidrs.delete(&name, &DeleteParams::default()).await.expect("delete ServiceCIDR");
    api.delete("requested", &DeleteParams::default()).await.expect("delete a Service");
    eventually_some("a requested address of a ServiceCIDR being deleted is refused", Duration::from_secs(60), Duration::from_millis(250), || {
        let api = api.clone();
        async move {
            match api.create(&PostParams::default(), &service("late", |s| s.cluster_ip = Some(requested.to_string()))).await {
                // Ours ("denied the request"), not only the apiserver's own allocator's.
                Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains("denied the request") => {
                    assert!(s.message.contains("the provided network does not match the current range"), "{s:?}");
                    Some(())
                }
                Err(_) => None,
                Ok(_) => {
                    let _ = api.delete("late", &DeleteParams::default()).await;
                    None
                }
            }
        }
    })
    .await;
    // Its Services gone, so is the ServiceCIDR (our reconciler removes the finalizer).
    api.delete_collection(&DeleteParams::default(), &ListParams::default()).await.expect("delete the Services");
    eventually_some("the ServiceCIDR is gone", Duration::from_secs(90), Duration::from_millis(250), || {
        let cidrs = cidrs.clone();
        let name = name.clone();
        async move { cidrs.get_opt(&name).await.ok().filter(Option::is_none).map(|_| ()) }
    })
    .await;
}

/// Deletes a ServiceCIDR when dropped (finalizers run their course in the cluster).
struct ServiceCidrOnDrop(Api<k8s_openapi::api::networking::v1::ServiceCIDR>, String);

impl Drop for ServiceCidrOnDrop {
    fn drop(&mut self) {
        let (api, name) = (self.0.clone(), self.1.clone());
        block_on_drop(async move {
            let _ = api.delete(&name, &DeleteParams::default()).await;
        });
    }
}

/// The webhook's ServiceCIDR check through the real apiserver (registered here for the
/// test's own ServiceCIDRs only, by label, with failurePolicy Fail so that a call that does
/// not happen fails the test): a ServiceCIDR over a Node's pod CIDR is refused with
/// Kubernetes' 422 and the reason; one elsewhere is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_servicecidr_over_a_nodes_pod_cidr_is_refused() {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    let cp = control_plane();
    let client = cp.client().await;
    let name = unique_name("cidr-check");
    let mut args = crate::controller_common::client_auth_args(&cp);
    args.extend(crate::controller_common::controller_args(&cp, "etcd", "198.18.173.0/24", &name, "default", "check-0", &cp.kubeconfig()));
    let child = crate::controller_common::Controller::start(args);
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(std::fs::read(cp.dir().join("pki/ca.crt")).expect("dev CA"));
    let cfg: ValidatingWebhookConfiguration = serde_json::from_value(json!({"metadata": {"name": name}, "webhooks": [{
        "name": "validate-servicecidr.clusterip.allocator",
        "clientConfig": {"url": format!("https://127.0.0.1:{}/validate-servicecidr", child.webhook_port), "caBundle": ca},
        "rules": [{"apiGroups": ["networking.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["servicecidrs"], "scope": "Cluster"}],
        "objectSelector": {"matchLabels": {"clusterip.allocator/e2e": name}},
        "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 10}]}))
    .expect("configuration");
    let configs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    configs.create(&PostParams::default(), &cfg).await.expect("register the ServiceCIDR check");
    let node_name = format!("{name}-node");
    let node: Node = serde_json::from_value(json!({"metadata": {"name": node_name}, "spec": {"podCIDR": "198.18.174.0/24", "podCIDRs": ["198.18.174.0/24"]}})).expect("Node");
    let nodes: Api<Node> = Api::all(client.clone());
    nodes.create(&PostParams::default(), &node).await.expect("create a Node");
    let cidrs: Api<ServiceCIDR> = Api::all(client.clone());
    struct Cleanup(kube::Client, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let (client, name) = (self.0.clone(), self.1.clone());
            block_on_drop(async move {
                let dp = DeleteParams::default();
                let _ = Api::<ValidatingWebhookConfiguration>::all(client.clone()).delete(&name, &dp).await;
                let _ = Api::<Node>::all(client.clone()).delete(&format!("{name}-node"), &dp).await;
                for which in ["over-pods", "elsewhere"] {
                    let _ = Api::<ServiceCIDR>::all(client.clone()).delete(&format!("{name}-{which}"), &dp).await;
                }
            });
        }
    }
    let _cleanup = Cleanup(client.clone(), name.clone());
    let sc = |which: &str, range: &str| -> ServiceCIDR {
        serde_json::from_value(json!({"metadata": {"name": format!("{name}-{which}"), "labels": {"clusterip.allocator/e2e": name}}, "spec": {"cidrs": [range]}})).expect("ServiceCIDR")
    };
    // The apiserver picks the configuration up asynchronously: until the create is refused.
    let (cidrs_ref, over) = (&cidrs, sc("over-pods", "198.18.174.0/23"));
    let over_ref = &over;
    let refused = eventually_ok("the apiserver calls the ServiceCIDR check", Duration::from_secs(60), Duration::from_millis(200), move || async move {
        match cidrs_ref.create(&PostParams { dry_run: true, ..Default::default() }, over_ref).await {
            Err(kube::Error::Api(s)) => Ok(s),
            Ok(_) => Err("admitted".to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    assert_eq!((refused.code, refused.reason.as_str()), (422, "Invalid"), "{refused:?}");
    assert!(
        refused.message.contains(&format!(r#"spec.cidrs[0]: Invalid value: "198.18.174.0/23": overlaps the pod CIDR 198.18.174.0/24 of Node {node_name} (a Service address there would also be a pod's or a node's)"#)),
        "{}",
        refused.message
    );
    assert!(cidrs.get_opt(&format!("{name}-over-pods")).await.expect("get").is_none());
    cidrs.create(&PostParams::default(), &sc("elsewhere", "198.18.176.0/24")).await.expect("a ServiceCIDR elsewhere is created");
    drop(child);
}
