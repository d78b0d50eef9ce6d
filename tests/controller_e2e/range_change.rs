//! Changing `--service-cidr` in a rolling update through controllers, both backends:
//! replicas of the old range and of the wider new one side by side behind the webhook, with
//! Gateway-owned addresses and Services being created throughout (issue 32, "Changing
//! `--service-cidr`"; the etcd backend's store-level cases, a shrink among them, are in
//! tests/range_change.rs): a widen, a shrink, and a move (an add, then a shrink).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use clusterip::cidr::ServiceCidr;
use clusterip::alloc::AllocError;
use clusterip::store::{AllocationStore, ParentRef, StoreError};
use clusterip_test_support::{control_plane, eventually};

use crate::harness::*;

fn gateway(i: usize) -> ParentRef {
    ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: format!("edge-{i}") }
}

/// The Gateways' addresses recorded as a Gateway controller would: an IPAddress object
/// naming the Gateway (both backends), and for the etcd backend first an owner record in the
/// controllers' map, as `clusterip allocate --parent` writes it.
async fn record_gateways(wh: &Webhook, cp: &clusterip_test_support::ControlPlane, backend: &str, gateways: &BTreeMap<IpAddr, ParentRef>) {
    if backend == "etcd" {
        let records = wh.records(cp).await;
        for (ip, parent) in gateways {
            match records.allocate(*ip, Some(parent)).await {
                Ok(()) | Err(StoreError::Alloc(AllocError::Allocated)) => {}
                Err(e) => panic!("record Gateway address {ip} in the map: {e}"),
            }
        }
        let _ = records.close().await;
    }
    let ipaddresses: Api<IPAddress> = Api::all(wh.client.clone());
    for (ip, parent) in gateways {
        let obj = clusterip::k8s::ipaddress::build(*ip, parent.into(), "gateway-controller.example");
        match ipaddresses.create(&PostParams::default(), &obj).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {} // left by an earlier run: the same owner
            Err(e) => panic!("record Gateway address {ip}: {e}"),
        }
    }
}

/// Block Leases short enough for a test (D = 12 s, M = 6 s), with the apiserver's request
/// timeout below M as the controller requires, and an in-flight limit of 20 s: a stopped
/// replica settles its answers (a create cut by the proxy's route change among them)
/// within the 60 s [`stop`] allows.
const BLOCK_FLAGS: [&str; 8] = ["--address-block-lease-duration", "12s", "--address-block-margin", "6s", "--apiserver-request-timeout", "5s", "--in-flight-limit", "20s"];

/// Every IPAddress object: its address and `<resource>/<name>` of its parentRef.
async fn records(ipaddresses: &Api<IPAddress>) -> BTreeMap<IpAddr, String> {
    let list = ipaddresses.list(&ListParams::default()).await.expect("list IPAddresses");
    list.items.iter().filter_map(|o| Some((o.metadata.name.as_deref()?.parse().ok()?, format!("{}/{}", o.spec.parent_ref.resource, o.spec.parent_ref.name)))).collect()
}

/// Delete the Gateways' IPAddress objects (cluster-scoped: the harness does not).
async fn remove_gateways(ipaddresses: &Api<IPAddress>, gateways: &BTreeMap<IpAddr, ParentRef>) {
    for ip in gateways.keys() {
        let _ = ipaddresses.delete(&ip.to_string(), &DeleteParams::default()).await;
    }
}

/// Stop replica `k` as a rollout does (SIGTERM) and wait for a clean exit.
fn stop(wh: &mut Webhook, k: usize) {
    wh.children[k].signal(libc::SIGTERM);
    let status = tokio::task::block_in_place(|| wh.children[k].wait_exit(Duration::from_secs(60)));
    assert!(status.is_some_and(|s| s.success()), "replica {k} did not stop cleanly within 60 s: {status:?}\n{}", wh.children[k].log());
}

/// The IPv4 range keys (`<prefix>/<cidr>`) of the etcd backend's map under `prefix`.
async fn v4_keys(cp: &clusterip_test_support::ControlPlane, prefix: &str) -> BTreeSet<String> {
    let mut etcd = etcd_client::Client::connect(cp.etcd_endpoints(), None).await.expect("etcd");
    let resp = etcd.get(prefix, Some(etcd_client::GetOptions::new().with_prefix().with_keys_only())).await.expect("list keys");
    resp.kvs()
        .iter()
        .filter_map(|kv| kv.key_str().ok())
        .filter(|k| k.strip_prefix(&format!("{prefix}/")).and_then(|rest| ServiceCidr::parse(rest).ok()).is_some_and(|c| c.family() == clusterip::cidr::Family::IPv4))
        .map(str::to_string)
        .collect()
}

/// What a create returned, by the Service's name.
type Created = Vec<(String, Result<k8s_openapi::api::core::v1::Service, kube::Error>)>;

/// Services `svc-<i>` created one after another on a task of their own, each kept.
struct Load {
    done: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<Created>,
}

impl Load {
    fn start(api: Api<k8s_openapi::api::core::v1::Service>, creates: usize) -> Load {
        let done = Arc::new(AtomicUsize::new(0));
        let counted = done.clone();
        let task = tokio::spawn(async move {
            let mut results = Vec::new();
            for i in 0..creates {
                let r = api.create(&PostParams::default(), &service(&format!("svc-{i}"), |_| {})).await;
                results.push((format!("svc-{i}"), r));
                counted.fetch_add(1, Ordering::SeqCst);
            }
            results
        });
        Load { done, task }
    }

    /// Creates answered so far.
    fn done(&self) -> usize {
        self.done.load(Ordering::SeqCst)
    }

    async fn reached(&self, what: &str, n: usize) {
        let done = &self.done;
        eventually(what, Duration::from_secs(300), move || async move { done.load(Ordering::SeqCst) >= n }).await;
    }

    async fn results(self) -> Created {
        self.task.await.expect("the load task")
    }
}

/// The rolling update of replicas 0 and 1 to two replicas of `ranges`, paced by the load: at
/// a fifth of the creates the first new replica joins the routes; at two fifths replica 0
/// leaves them and stops (SIGTERM, as a Deployment's rollout); at three fifths the second
/// new replica joins and replica 1 leaves and stops. Returns the new replicas.
async fn roll(wh: &mut Webhook, cp: &clusterip_test_support::ControlPlane, load: &Load, creates: usize, ranges: &[String]) -> (usize, usize) {
    let step = creates / 5;
    load.reached("the first fifth of the creates", step).await;
    let a = wh.add_replica(cp, ranges).await;
    wh.route_only(&[0, 1, a]).await;
    load.reached("the second fifth", 2 * step).await;
    wh.route_only(&[1, a]).await;
    stop(wh, 0);
    load.reached("the third fifth", 3 * step).await;
    let b = wh.add_replica(cp, ranges).await;
    wh.route_only(&[a, b]).await;
    stop(wh, 1);
    (a, b)
}

/// Every create succeeded but for requests the harness's proxy had in flight on a connection
/// it cut when the routes changed (`Webhook::route_only`; four changes, the apiserver reports
/// "failed calling webhook …" with its transport's words: "EOF", "http2: client connection
/// force closed via ClientConn.Close", …), which is the proxy's doing, not a refusal — at most
/// two per route change. Returns how many it cut.
fn proxy_cuts(results: &Created, creates: usize, during: &str) -> usize {
    let cut = |e: &kube::Error| {
        matches!(e, kube::Error::Api(s) if s.code == 500 && s.message.contains("failed calling webhook")
            && ["EOF", "broken pipe", "connection reset", "client connection force closed", "client connection lost"].iter().any(|t| s.message.contains(t)))
    };
    let failed: Vec<String> = results.iter().filter_map(|(n, r)| r.as_ref().err().filter(|e| !cut(e)).map(|e| format!("{n}: {e}"))).collect();
    assert!(failed.is_empty(), "{} of {creates} creates failed{during}: {:?}", failed.len(), &failed[..failed.len().min(10)]);
    let cuts = results.iter().filter(|(_, r)| r.is_err()).count();
    assert!(cuts <= 8, "{cuts} creates lost to the proxy's cuts: more than two per route change");
    cuts
}

/// A widen /22 → /21 as a rolling update: two replicas of the /22 (half of the slice's /21)
/// with 50 Gateway-owned addresses in its dynamic band (ipaddress backend: IPAddress
/// objects naming the Gateway, as a Gateway controller writes them; etcd backend: owner
/// records in the map, as `clusterip allocate --parent` writes them, and their IPAddress
/// objects), then, while `creates`
/// Services are created one after another (`CLUSTERIP_RANGE_CHANGE_CREATES`, default 300):
/// a /21 replica joins the routes, the /22 replicas leave them and stop one by one (SIGTERM,
/// as a Deployment's rollout), a second /21 replica joins. Expected: every create succeeds,
/// no address is given twice, none is a Gateway's, each Service's address is recorded for
/// it, the Gateways' records are untouched, and nothing of the /22 is left behind: its block
/// Leases gone (given back at shutdown, or deleted by a /21 replica after D), or one map key
/// only (the /22's, whose value now names the /21).
async fn rolling_widen(backend: &str, slice: Slice) {
    let creates: usize = std::env::var("CLUSTERIP_RANGE_CHANGE_CREATES").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    let cp = control_plane();
    let base = 8 * u32::from(slice.0);
    let (old, new) = (ServiceCidr::parse(&format!("198.19.{base}.0/22")).expect("old range"), ServiceCidr::parse(&slice.v4()).expect("new range"));
    let mut wh = Webhook::start_with(&cp, backend, slice, |h| {
        h.replicas(2);
        h.ranges = vec![old.to_string(), slice.v6()];
        h.flags(&BLOCK_FLAGS);
    })
    .await;
    let client = wh.client.clone();
    let ipaddresses: Api<IPAddress> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");

    // 50 Gateway addresses in the /22's dynamic band (its static band is the first 64).
    let gateways: BTreeMap<IpAddr, ParentRef> = (0..50).map(|i| (old.ip_at(600 + i as u64).expect("an address of the /22"), gateway(i))).collect();
    record_gateways(&wh, &cp, backend, &gateways).await;

    // The load: creates one after another, each Service kept.
    let load = Load::start(wh.services(), creates);
    roll(&mut wh, &cp, &load, creates, &[new.to_string(), slice.v6()]).await;
    let results = load.results().await;
    let cuts = proxy_cuts(&results, creates, "");
    let mut owners: BTreeMap<IpAddr, Vec<String>> = BTreeMap::new();
    for (name, r) in &results {
        let Ok(svc) = r else { continue };
        for ip in ips(svc).into_iter().filter(|ip| ip.is_ipv4()) {
            owners.entry(ip).or_default().push(name.clone());
        }
    }
    let twice: Vec<_> = owners.iter().filter(|(_, o)| o.len() > 1).collect();
    let on_gateway: Vec<_> = owners.keys().filter(|ip| gateways.contains_key(ip)).collect();
    let outside: Vec<_> = owners.keys().filter(|ip| !new.contains(**ip)).collect();
    println!("RESULT rolling widen /22 -> /21 ({backend}): {} Services, {} duplicate addresses, {} on a Gateway address, {} outside the /21, {cuts} creates lost to the proxy's cuts", owners.len(), twice.len(), on_gateway.len(), outside.len());
    assert!(twice.is_empty(), "addresses given twice: {twice:?}");
    assert!(on_gateway.is_empty(), "Services on Gateway addresses: {on_gateway:?}");
    assert!(outside.is_empty(), "addresses outside the /21: {outside:?}");
    assert_eq!(owners.len(), creates - cuts);

    // Each Service's address is recorded for it; the Gateways' records are untouched.
    let records = records(&ipaddresses).await;
    for (ip, names) in &owners {
        assert_eq!(records.get(ip), Some(&format!("services/{}", names[0])), "the record of {ip}");
    }
    for (ip, parent) in &gateways {
        assert_eq!(records.get(ip), Some(&format!("gateways/{}", parent.name)), "the Gateway record of {ip}");
    }

    if backend == "ipaddress" {
        // The /22's block Leases go: given back by the stopped replicas, or deleted by a /21
        // replica once unchanged for D (12 s).
        let leases = &leases;
        let old = &old;
        eventually("the old range's block Leases gone", Duration::from_secs(90), move || async move { block_leases(leases, old).await.is_empty() }).await;
        let held: BTreeSet<String> = block_leases(leases, &new).await.into_iter().collect();
        assert!(!held.is_empty(), "the /21 replicas hold no block");
    } else {
        // One map for the range, under the /22's key; the Gateways' owners read through it.
        let prefix = wh.etcd_prefix();
        assert_eq!(v4_keys(&cp, &prefix).await, BTreeSet::from([format!("{prefix}/{old}")]), "the IPv4 range keys under {prefix}");
        let records = wh.records_of(&cp, vec![new.clone()]).await.expect("open the /21's records");
        for (ip, parent) in &gateways {
            assert_eq!(records.owner(*ip).await.expect("read an owner").as_ref(), Some(parent), "the owner of {ip} through the /21");
        }
        let _ = records.close().await;
    }

    remove_gateways(&ipaddresses, &gateways).await;
}

/// A shrink /21 → /22 (the slice's lower half) as the runbook has it (docs/operations.md,
/// "Changing the service range"): two replicas of the /21 with 20 Gateway addresses in the
/// kept half and 100 Services anywhere; the part removed is freed first (the Services there
/// deleted, until a store of the /22 opens — etcd — or no IPAddress is left there); then the
/// rolling update, with no creates meanwhile (an old replica could still answer in the
/// removed part): a /22 replica joins and takes the routes, the /21 replicas stop, a second
/// /22 replica joins. Expected: the /22 replicas start (the etcd backend refuses to start
/// while the removed part holds an address), 100 more creates all land in the /22, each
/// once and none on a Gateway, the kept Services and the Gateways keep their records, and
/// nothing of the /21 is left: no block Lease naming it (ipaddress), one IPv4 map key (etcd).
async fn rolling_shrink(backend: &str, slice: Slice) {
    let cp = control_plane();
    let base = 8 * u32::from(slice.0);
    let (old, new) = (ServiceCidr::parse(&slice.v4()).expect("old range"), ServiceCidr::parse(&format!("198.19.{base}.0/22")).expect("new range"));
    let mut wh = Webhook::start_with(&cp, backend, slice, |h| {
        h.replicas(2);
        h.ranges = vec![old.to_string(), slice.v6()];
        h.flags(&BLOCK_FLAGS);
    })
    .await;
    let api = wh.services();
    let ipaddresses: Api<IPAddress> = Api::all(wh.client.clone());
    let gateways: BTreeMap<IpAddr, ParentRef> = (0..20).map(|i| (new.ip_at(600 + i as u64).expect("an address of the /22"), gateway(i))).collect();
    record_gateways(&wh, &cp, backend, &gateways).await;

    // 100 Services from the /21; those in the half to remove are deleted.
    let mut kept: BTreeMap<IpAddr, String> = BTreeMap::new();
    for i in 0..100 {
        let name = format!("before-{i}");
        let svc = api.create(&PostParams::default(), &service(&name, |_| {})).await.unwrap_or_else(|e| panic!("create {name}: {e}"));
        let ip = ips(&svc).into_iter().find(|ip| ip.is_ipv4()).expect("an IPv4 address");
        if new.contains(ip) {
            kept.insert(ip, name);
        } else {
            api.delete(&name, &DeleteParams::default()).await.expect("delete a Service of the removed half");
        }
    }
    // Freed: the removed half holds nothing the new range's replicas would count.
    let (ipaddresses, old_c, new_c) = (&ipaddresses, &old, &new);
    eventually("no IPAddress left in the removed half", Duration::from_secs(120), move || async move {
        let list = ipaddresses.list(&ListParams::default()).await.expect("list IPAddresses");
        !list.items.iter().filter_map(|o| o.metadata.name.as_deref()?.parse::<IpAddr>().ok()).any(|ip| old_c.contains(ip) && !new_c.contains(ip))
    })
    .await;
    if backend == "etcd" {
        let (wh, cp) = (&wh, &cp);
        let store = clusterip_test_support::eventually_ok("a store of the /22 opens (the removed half released in the map)", Duration::from_secs(120), Duration::from_millis(500), move || async move {
            wh.records_of(cp, vec![new_c.clone()]).await
        })
        .await;
        let _ = store.close().await;
    }

    // The rolling update, no creates meanwhile.
    let new_ranges = vec![new.to_string(), slice.v6()];
    let a = wh.add_replica(&cp, &new_ranges).await;
    wh.route_only(&[a]).await;
    stop(&mut wh, 0);
    stop(&mut wh, 1);
    let b = wh.add_replica(&cp, &new_ranges).await;
    wh.route_only(&[a, b]).await;

    // 100 more, all in the /22.
    let mut owners: BTreeMap<IpAddr, String> = kept.clone();
    for i in 0..100 {
        let name = format!("after-{i}");
        let svc = api.create(&PostParams::default(), &service(&name, |_| {})).await.unwrap_or_else(|e| panic!("create {name} after the shrink: {e}"));
        let ip = ips(&svc).into_iter().find(|ip| ip.is_ipv4()).expect("an IPv4 address");
        assert!(new.contains(ip), "{name} got {ip}, outside the /22");
        assert!(!gateways.contains_key(&ip), "{name} got the Gateway address {ip}");
        if let Some(other) = owners.insert(ip, name.clone()) {
            panic!("{ip} given to {other} and {name}");
        }
    }
    let records = records(ipaddresses).await;
    for (ip, name) in &owners {
        assert_eq!(records.get(ip), Some(&format!("services/{name}")), "the record of {ip}");
    }
    for (ip, parent) in &gateways {
        assert_eq!(records.get(ip), Some(&format!("gateways/{}", parent.name)), "the Gateway record of {ip}");
    }
    if backend == "ipaddress" {
        let leases: Api<Lease> = Api::namespaced(wh.client.clone(), "default");
        let leases = &leases;
        eventually("the /21's block Leases gone", Duration::from_secs(90), move || async move { block_leases(leases, old_c).await.is_empty() }).await;
    } else {
        let prefix = wh.etcd_prefix();
        assert_eq!(v4_keys(&cp, &prefix).await.len(), 1, "one IPv4 range key under {prefix}");
    }
    println!("RESULT rolling shrink /21 -> /22 ({backend}): {} Services kept, 100 created after, 0 duplicate addresses, 0 outside the /22, 0 on a Gateway address", kept.len());
    remove_gateways(ipaddresses, &gateways).await;
}

/// A move A → B (the slice's lower and upper /22, sharing no address) as the runbook has it
/// (docs/operations.md, "Changing the service range"), on a control plane of its own (every
/// slice of the shared one is taken): two replicas of A hold 40 Services; **add** B, first
/// (`B,A`), as a rolling update while `creates` Services are created one after another
/// (`CLUSTERIP_RANGE_CHANGE_CREATES`, default 300, a fifth per step of the rollout); the
/// Services in A are re-created (they get B); **remove** A as a shrink (a rolling update to
/// `B` with no creates meanwhile); 60 more creates. Expected: every create succeeds, no
/// address is given twice at any step, creates answered by a `B,A` replica land in B, the
/// last 60 in B, each Service's address is recorded for it, and nothing of A is left in use:
/// no block Lease naming it (ipaddress; deleted by a B replica after D), its map empty
/// before A is removed (etcd; the key itself stays, as docs/operations.md says).
async fn rolling_move(backend: &str) {
    let creates: usize = std::env::var("CLUSTERIP_RANGE_CHANGE_CREATES").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    let cp = clusterip_test_support::ControlPlane::private(&format!("range-move-{backend}"));
    let slice = Slice(5);
    let base = 8 * u32::from(slice.0);
    let a_range = ServiceCidr::parse(&format!("198.19.{base}.0/22")).expect("A");
    let b_range = ServiceCidr::parse(&format!("198.19.{}.0/22", base + 4)).expect("B");
    let mut wh = Webhook::start_with(&cp, backend, slice, |h| {
        h.replicas(2);
        h.ranges = vec![a_range.to_string(), slice.v6()];
        h.flags(&BLOCK_FLAGS);
    })
    .await;
    let api = wh.services();
    let ipaddresses: Api<IPAddress> = Api::all(wh.client.clone());
    let v4 = |svc: &k8s_openapi::api::core::v1::Service| ips(svc).into_iter().find(|ip| ip.is_ipv4()).expect("an IPv4 address");

    // Every live Service by IPv4 address: a second Service on one is a failure at once.
    let mut owners: BTreeMap<IpAddr, String> = BTreeMap::new();
    let own = |owners: &mut BTreeMap<IpAddr, String>, ip: IpAddr, name: &str| {
        if let Some(other) = owners.insert(ip, name.to_string()) {
            panic!("{ip} given to {other} and {name}");
        }
    };
    for i in 0..40 {
        let name = format!("a-{i}");
        let svc = api.create(&PostParams::default(), &service(&name, |_| {})).await.unwrap_or_else(|e| panic!("create {name}: {e}"));
        assert!(a_range.contains(v4(&svc)), "{name} got {} outside A", v4(&svc));
        own(&mut owners, v4(&svc), &name);
    }

    // Add B, first, while Services are created.
    let load = Load::start(api.clone(), creates);
    let (n1, n2) = roll(&mut wh, &cp, &load, creates, &[b_range.to_string(), a_range.to_string(), slice.v6()]).await;
    let only_new_from = load.done();
    let results = load.results().await;
    let cuts = proxy_cuts(&results, creates, " during the add");
    for (i, (name, r)) in results.iter().enumerate() {
        let Ok(svc) = r else { continue };
        let ip = v4(svc);
        assert!(a_range.contains(ip) || b_range.contains(ip), "{name} got {ip}, in neither range");
        // Once only `B,A` replicas answer, everything comes from B (it has room).
        assert!(i < only_new_from || b_range.contains(ip), "{name}, answered by a B,A replica, got {ip} in A");
        own(&mut owners, ip, name);
    }

    // The Services in A are re-created: they get B.
    let in_a: Vec<(IpAddr, String)> = owners.iter().filter(|(ip, _)| a_range.contains(**ip)).map(|(ip, n)| (*ip, n.clone())).collect();
    for (ip, name) in &in_a {
        api.delete(name, &DeleteParams::default()).await.unwrap_or_else(|e| panic!("delete {name}: {e}"));
        owners.remove(ip);
    }
    for (_, name) in &in_a {
        let svc = api.create(&PostParams::default(), &service(name, |_| {})).await.unwrap_or_else(|e| panic!("re-create {name}: {e}"));
        assert!(b_range.contains(v4(&svc)), "{name}, re-created, got {} outside B", v4(&svc));
        own(&mut owners, v4(&svc), name);
    }
    let (ipaddresses_ref, a_ref) = (&ipaddresses, &a_range);
    eventually("no IPAddress left in A", Duration::from_secs(120), move || async move {
        let list = ipaddresses_ref.list(&ListParams::default()).await.expect("list IPAddresses");
        !list.items.iter().filter_map(|o| o.metadata.name.as_deref()?.parse::<IpAddr>().ok()).any(|ip| a_ref.contains(ip))
    })
    .await;
    if backend == "etcd" {
        // Released in A's map too (the leader's Service reconciler, a `B,A` replica) before A
        // is removed: no replica of `B` alone will ever touch that map again.
        let (wh, cp) = (&wh, &cp);
        clusterip_test_support::eventually_ok("A's map holds nothing", Duration::from_secs(120), Duration::from_millis(500), move || async move {
            let store = wh.records_of(cp, vec![a_ref.clone()]).await.map_err(|e| format!("open A's records: {e}"))?;
            let left = store.allocated().await.map_err(|e| format!("read A's map: {e}"));
            let _ = store.close().await;
            match left? {
                left if left.is_empty() => Ok(()),
                left => Err(format!("A's map holds {left:?}")),
            }
        })
        .await;
    }

    // Remove A: a rolling update to `B`, no creates meanwhile.
    let moved = vec![b_range.to_string(), slice.v6()];
    let m1 = wh.add_replica(&cp, &moved).await;
    wh.route_only(&[m1]).await;
    stop(&mut wh, n1);
    stop(&mut wh, n2);
    let m2 = wh.add_replica(&cp, &moved).await;
    wh.route_only(&[m1, m2]).await;
    for i in 0..60 {
        let name = format!("b-{i}");
        let svc = api.create(&PostParams::default(), &service(&name, |_| {})).await.unwrap_or_else(|e| panic!("create {name} after the move: {e}"));
        assert!(b_range.contains(v4(&svc)), "{name} got {} outside B", v4(&svc));
        own(&mut owners, v4(&svc), &name);
    }

    let records = records(&ipaddresses).await;
    for (ip, name) in &owners {
        assert_eq!(records.get(ip), Some(&format!("services/{name}")), "the record of {ip}");
    }
    if backend == "ipaddress" {
        let leases: Api<Lease> = Api::namespaced(wh.client.clone(), "default");
        let leases = &leases;
        eventually("A's block Leases gone", Duration::from_secs(90), move || async move { block_leases(leases, a_ref).await.is_empty() }).await;
    } else {
        // A's key stays behind, empty (docs/operations.md), beside B's.
        let prefix = wh.etcd_prefix();
        assert_eq!(v4_keys(&cp, &prefix).await, BTreeSet::from([format!("{prefix}/{a_range}"), format!("{prefix}/{b_range}")]), "the IPv4 range keys under {prefix}");
        let store = wh.records_of(&cp, vec![a_range.clone()]).await.expect("open A's records");
        assert_eq!(store.allocated().await.expect("read A's map"), Vec::<IpAddr>::new(), "A's map after the move");
        let _ = store.close().await;
    }
    println!("RESULT rolling move /22 A -> /22 B ({backend}): {} Services, {} re-created out of A, {cuts} creates lost to the proxy's cuts, 0 duplicate addresses", owners.len(), in_a.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_rolling_widen_gives_nothing_twice_and_leaves_nothing_behind() {
    rolling_widen("ipaddress", Slice(26)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_rolling_widen_gives_nothing_twice_and_leaves_nothing_behind() {
    rolling_widen("etcd", Slice(27)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_rolling_shrink_with_the_removed_part_freed_first() {
    rolling_shrink("ipaddress", Slice(29)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_rolling_shrink_with_the_removed_part_freed_first() {
    rolling_shrink("etcd", Slice(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_rolling_move_to_a_new_range() {
    rolling_move("ipaddress").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_rolling_move_to_a_new_range() {
    rolling_move("etcd").await;
}
