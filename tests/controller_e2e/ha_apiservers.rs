//! HA control plane: two kube-apiservers on one etcd, one restarted mid-burst.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, ListParams, PostParams};

use clusterip_test_support::{eventually_ok, eventually_some, ControlPlane};

use crate::harness::*;

/// One create of the HA burst: through which apiserver (1 or 2), when it ended, what came back.
struct HaCreate {
    via: usize,
    name: String,
    ended: Instant,
    result: Result<Service, kube::Error>,
}

/// Creates through one apiserver, up to four at a time and at most ten started a second (load
/// shaping, so that a slow restart does not use up the range), until `stop` or `cap`
/// creates; `acked` counts the acknowledged ones as they come.
fn ha_creator(
    via: usize,
    api: Api<Service>,
    cap: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    acked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> tokio::task::JoinHandle<Vec<HaCreate>> {
    use futures::StreamExt;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let tick = std::sync::Arc::new(tokio::sync::Mutex::new(tick));
        futures::stream::iter(0..cap)
            .take_while(move |_| futures::future::ready(!stop.load(std::sync::atomic::Ordering::SeqCst)))
            .then(move |n| {
                let tick = tick.clone();
                async move {
                    tick.lock().await.tick().await;
                    n
                }
            })
            .map(|n| {
                let (api, acked) = (api.clone(), acked.clone());
                async move {
                    let name = format!("ha{via}-{n}");
                    let result = api.create(&PostParams::default(), &service(&name, |_| {})).await;
                    if result.is_ok() {
                        acked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    HaCreate { via, name, ended: Instant::now(), result }
                }
            })
            .buffer_unordered(4)
            .collect()
            .await
    })
}

/// HA control plane (issue 20): two kube-apiservers on one etcd (a private control plane
/// with `CLUSTERIP_APISERVERS=2`), our webhook registered once — both apiservers read that
/// configuration and call it — and two controller replicas behind the proxy, replica-0
/// talking to the first apiserver and replica-1 to the second (as replicas reaching the
/// `kubernetes` Service would spread). Creates go through both apiservers at once while the
/// webhook assigns; the first apiserver (replica-0's, and the one the registration was made
/// through) is restarted mid-burst.
///
/// Checked: every acknowledged create has an address of our range, no address twice (also
/// among Services whose create answer was lost in the restart), every one is stored with
/// that address and recorded (an IPAddress with the Service as parentRef; etcd backend: in
/// our allocation map too), every create through the second apiserver succeeded (during the
/// restart included), and both apiservers serve creates after it.
async fn ha_apiservers_one_restarted_mid_burst(backend: &str, slice: Slice, tag: &str) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    let _one_at_a_time = BURST.lock().await;
    let cp = ControlPlane::private_with(tag, &[("CLUSTERIP_APISERVERS", "2")]);
    let kubeconfig_2 = std::path::PathBuf::from(cp.var("KUBECONFIG_2"));
    let mut wh = Webhook::register(&cp, Harness::new(&cp, backend, slice, |h| h.kubeconfigs = vec![cp.kubeconfig(), kubeconfig_2.clone()])).await;
    wh.wait_registered().await;
    let client_2 = cp.client_from(&kubeconfig_2).await;
    let apis = [wh.services(), Api::<Service>::namespaced(client_2.clone(), &wh.namespace)];
    wh.wait_called_through(&apis[1]).await;

    // At most 900 creates per apiserver: 1800 fit in the slice's dynamic band (1919).
    let stop = Arc::new(AtomicBool::new(false));
    let acked = [Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0))];
    let creators: Vec<_> = (0..2).map(|i| ha_creator(i + 1, apis[i].clone(), 900, stop.clone(), acked[i].clone())).collect();
    let counts = &acked;
    eventually_some("the burst makes progress (100 creates acknowledged)", Duration::from_secs(120), Duration::from_millis(20), move || async move {
        (counts[0].load(Ordering::SeqCst) + counts[1].load(Ordering::SeqCst) >= 100).then_some(())
    })
    .await;

    // The fault: the first apiserver is stopped (SIGTERM, its graceful shutdown) and started
    // again with the same flags, mid-burst.
    let fault_from = Instant::now();
    cp.stop("kube-apiserver");
    cp.start("kube-apiserver");
    let fault_to = Instant::now();
    // Both apiservers serve creates afterwards: 20 more acknowledged through each.
    let after = [acked[0].load(Ordering::SeqCst), acked[1].load(Ordering::SeqCst)];
    let (tasks, after) = (&creators, &after);
    eventually_ok("creates succeed through both apiservers after the restart (20 more each)", Duration::from_secs(180), Duration::from_millis(50), move || async move {
        if (0..2).all(|i| counts[i].load(Ordering::SeqCst) >= after[i] + 20) {
            return Ok(());
        }
        let cap_reached = (0..2).any(|i| tasks[i].is_finished());
        assert!(!cap_reached, "a creator reached its cap before both apiservers served again; acked {:?} (at the restart {after:?})", counts);
        Err(format!("acked {counts:?}, at the restart {after:?}"))
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut creates = Vec::new();
    for c in creators {
        creates.extend(c.await.expect("creator task"));
    }

    // What callers were told.
    let ours = [clusterip::cidr::ServiceCidr::parse(&slice.v4()).expect("v4 slice"), clusterip::cidr::ServiceCidr::parse(&slice.v6()).expect("v6 slice")];
    let mut acknowledged = std::collections::BTreeMap::new();
    let mut errors = [Vec::new(), Vec::new()];
    for c in &creates {
        match &c.result {
            Ok(svc) => {
                let got = ips(svc);
                assert_eq!(got.len(), 1, "{}: {got:?}", c.name);
                // (Our dynamic band: the webhook chose it, not the apiserver's own allocator.)
                assert!(wh.in_dynamic_band(got[0]), "{} got {}, outside our dynamic band", c.name, got[0]);
                assert!(acknowledged.insert(got[0], c.name.clone()).is_none(), "{} handed out twice", got[0]);
            }
            Err(e) => {
                // (Marked when it ended before the restarted apiserver reported ready.)
                let starting = if c.via == 1 && c.ended < fault_to { ", before it was ready again" } else { "" };
                errors[c.via - 1].push(format!("{} ({:.1} s after the restart began{starting}): {e}", c.name, c.ended.saturating_duration_since(fault_from).as_secs_f64()))
            }
        }
    }
    assert!(errors[1].is_empty(), "creates through the surviving apiserver failed: {:#?}", errors[1]);
    // Through the restarted apiserver a create may fail in transport (it is down), or —
    // admitted by us just as it began to shut down — be refused by the apiserver's own
    // allocator, whose loopback request to itself finds its port closed (`failed to allocate
    // IP …: Post "https://127.0.0.1:<its port>/apis/networking.k8s.io/v1/ipaddresses": …
    // connection refused`; stock Kubernetes fails the same way without any webhook) — or,
    // while it starts again and before it reports ready, be refused by that allocator because
    // it has not loaded the ServiceCIDRs yet (`the provided network does not match the current
    // range` for an address inside its own range; stock answers a static address so too).
    // Never refused by our webhook, and never for an address already allocated.
    let own_port = cp.var("CLUSTERIP_APISERVER").rsplit(':').next().unwrap_or_default().to_string();
    for e in &errors[0] {
        let apiserver_loopback = e.contains("/apis/networking.k8s.io/v1/ipaddresses") && e.contains(&format!("127.0.0.1:{own_port}"));
        let apiserver_starting = e.contains("before it was ready again") && e.contains("the provided network does not match the current range");
        assert!(!e.contains("denied the request") && !e.contains("already allocated"), "a create through the restarted apiserver was refused by the webhook or as a duplicate: {e}");
        assert!(!e.contains("422") || apiserver_loopback || apiserver_starting, "a create through the restarted apiserver was refused, neither cut nor failed by its own shutdown or start-up: {e}");
    }

    // What is stored: every acknowledged Service with its address, and nothing twice among
    // all Services (those whose answer was lost in the restart included).
    let stored = apis[1].list(&ListParams::default()).await.expect("list Services");
    let mut held = std::collections::BTreeMap::new();
    for svc in &stored.items {
        let name = svc.metadata.name.clone().unwrap_or_default();
        for ip in ips(svc) {
            assert!(ours.iter().any(|r| r.contains(ip)), "stored {name} holds {ip}, outside our ranges");
            if let Some(other) = held.insert(ip, name.clone()) {
                panic!("{ip} held by both {other} and {name}");
            }
        }
    }
    for (ip, name) in &acknowledged {
        assert_eq!(held.get(ip), Some(name), "acknowledged {name} with {ip} is not stored with it");
    }
    // Recorded: the IPAddress named by the address, parentRef the Service (both backends).
    let ipaddresses: Api<k8s_openapi::api::networking::v1::IPAddress> = Api::all(client_2.clone());
    for (ip, name) in &acknowledged {
        let rec = ipaddresses.get_opt(&ip.to_string()).await.expect("read IPAddress");
        let parent = rec.map(|r| r.spec.parent_ref);
        assert!(
            parent.as_ref().is_some_and(|p| p.resource == "services" && p.namespace.as_deref() == Some(wh.namespace.as_str()) && &p.name == name),
            "{ip} of {name}: IPAddress parentRef {parent:?}"
        );
    }
    let mut leaked = String::from("n/a");
    if backend == "etcd" {
        use clusterip::store::AllocationStore;
        let store = wh.records(&cp).await;
        let recorded: BTreeSet<IpAddr> = store.allocated().await.expect("records").into_iter().collect();
        let lost: Vec<_> = acknowledged.keys().filter(|ip| !recorded.contains(ip)).collect();
        assert!(lost.is_empty(), "{} acknowledged addresses missing from the allocation map: {:?}", lost.len(), &lost[..lost.len().min(5)]);
        leaked = (recorded.len() - recorded.iter().filter(|ip| held.contains_key(ip)).count()).to_string();
    }
    eprintln!(
        "RESULT {backend}: restart of kube-apiserver took {:.1} s; {} creates acknowledged ({} through apiserver 1, {} through apiserver 2), {} failed through the restarted one, 0 through the other; {} Services stored, 0 duplicates, 0 lost; in the allocation map without a Service: {leaked}",
        (fault_to - fault_from).as_secs_f64(),
        acknowledged.len(),
        creates.iter().filter(|c| c.via == 1 && c.result.is_ok()).count(),
        creates.iter().filter(|c| c.via == 2 && c.result.is_ok()).count(),
        errors[0].len(),
        held.len(),
    );
    if let Some(e) = errors[0].first() {
        eprintln!("  e.g. {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_ha_apiservers_one_restarted_mid_burst() {
    ha_apiservers_one_restarted_mid_burst("etcd", Slice(19), "ha-etcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_ha_apiservers_one_restarted_mid_burst() {
    ha_apiservers_one_restarted_mid_burst("ipaddress", Slice(20), "ha-ipaddress").await;
}
