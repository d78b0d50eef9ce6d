//! Startup, readiness and recovery of the allocation store (issue 20), against real etcd and
//! kube-apiserver processes:
//!
//! - `/readyz` of a real controller reports the store unavailable while etcd (etcd backend)
//!   or the kube-apiserver (ipaddress backend) is stopped, with the reason, and recovers once
//!   it is back (each on a control plane of its own, which it breaks);
//! - recording what the cluster already holds (the controller's start) takes a handful of
//!   etcd transactions, not one per address, and none when everything is recorded;
//! - a claim left behind in etcd (answered, or addressed to a replica that is gone) does not
//!   block a pooled address;
//! - a corrupt allocation map fails closed (typed error, no write over it, `/readyz` 503,
//!   `clusterip_allocator_unreadable_records`), and `clusterip repair --rebuild` brings it
//!   back with every owned and pooled address still allocated; a corrupt owner record keeps
//!   its address allocated and refuses releases until it is readable again.
//!
//! Addresses: slice 14 of the controller tests' ranges (198.19.112.0/21,
//! fd00:10:96::7000/117), 198.18.44.0/24 and 198.18.45.0/24.

mod controller_common;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use clusterip::cidr::{Family, ServiceCidr};
use clusterip::store::etcd::{owner_key, range_key, EtcdConfig, EtcdStore};
use clusterip::store::etcd::pool::{claim_key, decode_pool, pool_member, pool_prefix};
use clusterip::store::{record_missing, AllocationStore, ParentRef, StoreError};
use clusterip_test_support::{control_plane, eventually_ok, eventually_some, local_get, unique_name, ControlPlane};
use controller_common::{client_auth_args, controller_args, metric, Controller};
use etcd_client::GetOptions;

const SLICE_V4: &str = "198.19.112.0/21";
const SLICE_V6: &str = "fd00:10:96::7000/117";

/// GET `path` on the controller's metrics port: (status code, body).
async fn get(port: u16, path: &str) -> (u16, String) {
    local_get(port, path).await.unwrap_or((0, String::new()))
}

/// Poll `/readyz` until `want(code, body)`; the last answer.
async fn readyz_until(ctl: &Controller, what: &str, limit: Duration, want: impl Fn(u16, &str) -> bool) -> (u16, String) {
    let (port, want) = (ctl.metrics_port, &want);
    eventually_ok(&format!("/readyz: {what}"), limit, Duration::from_millis(200), move || async move {
        let (code, body) = get(port, "/readyz").await;
        if want(code, &body) {
            Ok((code, body))
        } else {
            Err(format!("last answer {code} {body:?}\n{}", ctl.log()))
        }
    })
    .await
}

/// Poll `/metrics` until `series` has the value `want`.
async fn metric_until(ctl: &Controller, series: &str, want: f64) {
    let port = ctl.metrics_port;
    eventually_ok(&format!("{series} becomes {want}"), Duration::from_secs(60), Duration::from_millis(200), move || async move {
        let (_, text) = get(port, "/metrics").await;
        if metric(&text, series) == Some(want) {
            Ok(())
        } else {
            Err(format!("last scrape:\n{}", text.lines().filter(|l| l.contains("unreadable")).collect::<Vec<_>>().join("\n")))
        }
    })
    .await
}

fn start_controller(cp: &ControlPlane, backend: &str, name: &str) -> Controller {
    let mut args = controller_args(cp, backend, &format!("{SLICE_V4},{SLICE_V6}"), name, "default", name, &cp.kubeconfig());
    args.extend(client_auth_args(cp));
    args.extend(["--repair-interval", "0", "--etcd-request-timeout", "2s", "--etcd-dial-timeout", "2s"].map(String::from));
    Controller::start(args)
}

async fn readiness_follows(backend: &str, component: &str, tag: &str, says: &str) {
    let cp = ControlPlane::private(tag);
    let ctl = start_controller(&cp, backend, &unique_name(tag));
    ctl.wait_ready().await;
    cp.stop(component);
    let (_, body) = readyz_until(&ctl, "503 while stopped", Duration::from_secs(60), |code, _| code == 503).await;
    assert!(body.starts_with("allocation store not ready: allocation store unavailable: "), "{body}");
    assert!(body.contains(says), "the reason should name {says:?}: {body}");
    cp.start(component);
    readyz_until(&ctl, "200 once it is back", Duration::from_secs(120), |code, body| code == 200 && body == "ok").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_reports_etcd_down_and_recovers() {
    readiness_follows("etcd", "etcd", "readyz-etcd", "etcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_reports_the_apiserver_down_and_recovers() {
    readiness_follows("ipaddress", "kube-apiserver", "readyz-apiserver", "address block Leases").await;
}

fn etcd_config(cp: &ControlPlane, prefix: &str, pool_size: usize) -> EtcdConfig {
    EtcdConfig { endpoints: cp.etcd_endpoints(), prefix: prefix.to_string(), pool_size, ..Default::default() }
}

async fn etcd(cp: &ControlPlane) -> etcd_client::Client {
    etcd_client::Client::connect(cp.etcd_endpoints(), None).await.expect("connect to etcd")
}

/// (value, version) of a key; (empty, 0) when absent.
async fn read_key(client: &mut etcd_client::Client, key: &str) -> (Vec<u8>, i64) {
    let resp = client.get(key, None).await.expect("etcd get");
    resp.kvs().first().map(|kv| (kv.value().to_vec(), kv.version())).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn recording_the_cluster_at_start_is_batched() {
    let cp = control_plane();
    let prefix = format!("/clusterip-test/{}", unique_name("seed"));
    let cidr = ServiceCidr::parse("198.18.44.0/24").expect("cidr");
    let store = EtcdStore::open(&etcd_config(&cp, &prefix, 0), vec![cidr.clone()]).await.expect("open");
    let key = range_key(&prefix, &cidr);
    let mut client = etcd(&cp).await;
    let ips: Vec<IpAddr> = (1..=200u8).map(|n| IpAddr::from([198, 18, 44, n])).collect();
    // Outside the range: not ours to record.
    let foreign: IpAddr = "198.18.43.7".parse().expect("ip");

    let (recorded, failed) = record_missing(&store, ips.iter().copied().chain([foreign])).await;
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(recorded, 200);
    let (_, version) = read_key(&mut client, &key).await;
    // One write per transaction on the map key: a handful of group commits, not 200.
    assert!((1..=5).contains(&version), "200 addresses took {version} transactions");
    for ip in &ips {
        assert!(store.has(*ip).await.expect("has"), "{ip} not recorded");
    }
    // Everything recorded already: no transaction at all.
    let (recorded, failed) = record_missing(&store, ips.iter().copied()).await;
    assert_eq!((recorded, failed.len()), (0, 0));
    assert_eq!(read_key(&mut client, &key).await.1, version, "recording what is recorded wrote to etcd");
    let _ = client.delete(prefix.as_str(), Some(etcd_client::DeleteOptions::new().with_prefix())).await;
}

/// The addresses the pool keys under `key` list.
async fn pooled(client: &mut etcd_client::Client, key: &str) -> BTreeSet<IpAddr> {
    let resp = client.get(pool_prefix(key), Some(GetOptions::new().with_prefix())).await.expect("etcd get");
    resp.kvs().iter().flat_map(|kv| decode_pool(kv.value())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_claim_does_not_block_a_pooled_address() {
    let cp = control_plane();
    let prefix = format!("/clusterip-test/{}", unique_name("claims"));
    let cidr = ServiceCidr::parse("198.18.45.0/24").expect("cidr");
    let key = range_key(&prefix, &cidr);
    let mut client = etcd(&cp).await;
    // Replica A keeps a pool; B (like `clusterip allocate`) has none.
    let a = EtcdStore::open(&etcd_config(&cp, &prefix, 16), vec![cidr.clone()]).await.expect("open A");
    let (etcd, key_ref, store_a) = (&client, &key, &a);
    let listed = eventually_some("replica A's pool fills", Duration::from_secs(60), Duration::from_millis(100), move || async move {
        let listed = pooled(&mut etcd.clone(), key_ref).await;
        (store_a.pool_ready() && listed.len() >= 2).then_some(listed)
    })
    .await;
    let mut it = listed.iter().copied();
    let (answered, misaddressed) = (it.next().expect("an address"), it.next().expect("another"));
    let member = pool_member(
        client.get(pool_prefix(&key), Some(GetOptions::new().with_prefix())).await.expect("get").kvs()[0]
            .key_str()
            .expect("utf-8 key")
            .strip_prefix(&pool_prefix(&key))
            .expect("under the pool prefix"),
    )
    .to_string();
    // Left behind without a lease, as a claimant that died before deleting would leave
    // them: one answered already, one addressed to a replica that no longer exists.
    let stale = [
        (answered, format!(r#"{{"owner":"{member}","claimant":"gone","answer":"granted"}}"#)),
        (misaddressed, r#"{"owner":"00000000000dead0","claimant":"gone"}"#.to_string()),
    ];
    for (ip, body) in &stale {
        client.put(claim_key(&key, *ip), body.as_bytes(), None).await.expect("put a stale claim");
    }

    let b = EtcdStore::open(&etcd_config(&cp, &prefix, 0), vec![cidr.clone()]).await.expect("open B");
    for (ip, _) in &stale {
        b.allocate(*ip, None).await.unwrap_or_else(|e| panic!("a static request for {ip}, pooled by A, behind a stale claim: {e}"));
        assert!(b.has(*ip).await.expect("has"), "{ip} granted but not recorded");
    }
    // A gave them up: it never hands them out.
    for _ in 0..40 {
        let ip = a.allocate_next(Family::IPv4, None).await.expect("A allocates");
        assert!(stale.iter().all(|(s, _)| *s != ip), "A handed out {ip}, which it granted to B");
    }
    drop((a, b));
    let _ = client.delete(prefix.as_str(), Some(etcd_client::DeleteOptions::new().with_prefix())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupt_allocation_map_fails_closed_until_repair_rebuilds_it() {
    let cp = control_plane();
    let name = unique_name("corrupt");
    let prefix = format!("/clusterip-test/{name}");
    let cidrs = vec![ServiceCidr::parse(SLICE_V4).expect("v4"), ServiceCidr::parse(SLICE_V6).expect("v6")];
    let key = range_key(&prefix, &cidrs[0]);
    let mut client = etcd(&cp).await;
    let ctl = start_controller(&cp, "etcd", &name);
    ctl.wait_ready().await;
    // Records with owners (a Gateway's addresses), beside the controller's address pool.
    let store = EtcdStore::open(&etcd_config(&cp, &prefix, 0), cidrs.clone()).await.expect("open");
    let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: name.clone() };
    let mut owned = BTreeSet::new();
    for _ in 0..5 {
        owned.insert(store.allocate_next(Family::IPv4, Some(&gateway)).await.expect("allocate for the Gateway"));
    }
    let pool_before = pooled(&mut client, &key).await;
    assert!(!pool_before.is_empty(), "the controller pooled nothing in {SLICE_V4}");

    // Garbage where the map is.
    let garbage = b"this is not an allocation map".to_vec();
    client.put(key.as_str(), garbage.clone(), None).await.expect("put garbage");

    // Fails closed: typed errors, for static, dynamic and release alike; nothing written.
    let some_free: IpAddr = "198.19.112.77".parse().expect("ip");
    match store.allocate_next(Family::IPv4, None).await {
        Err(StoreError::Corrupt { record, .. }) => assert!(record.contains(&key), "{record}"),
        other => panic!("allocate_next on a corrupt map: {other:?}"),
    }
    let running = &store;
    eventually_ok("allocate on a corrupt map fails as Corrupt", Duration::from_secs(60), Duration::from_millis(100), move || async move {
        match running.allocate(some_free, None).await {
            Err(StoreError::Corrupt { .. }) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let owned_one = *owned.iter().next().expect("owned");
    assert!(matches!(store.release_owned(owned_one, &gateway).await, Err(StoreError::Corrupt { .. })));
    assert!(matches!(store.allocated().await, Err(StoreError::Corrupt { .. })), "allocated() answered from a stale copy");
    let v6 = store.allocate_next(Family::IPv6, None).await.expect("the readable IPv6 range still allocates");
    assert!(cidrs[1].contains(v6));
    assert_eq!(read_key(&mut client, &key).await.0, garbage, "the corrupt value was overwritten");

    // The controller says so.
    let (_, body) = readyz_until(&ctl, "503 on the corrupt map", Duration::from_secs(60), |code, _| code == 503).await;
    assert!(body.contains(&key) && body.contains("unreadable") && body.contains("clusterip repair --rebuild"), "{body}");
    metric_until(&ctl, "clusterip_allocator_unreadable_records{kind=\"allocation_map\"}", 1.0).await;

    // `clusterip repair` refuses to judge it and names the way back.
    let ranges = format!("{SLICE_V4},{SLICE_V6}");
    let repair = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_clusterip"))
            .args(["repair", "--backend", "etcd", "--etcd-endpoints", &cp.etcd_endpoints().join(","), "--etcd-prefix", &prefix, "--service-cidr", &ranges])
            .arg("--kubeconfig")
            .arg(cp.kubeconfig())
            .args(extra)
            .output()
            .expect("run clusterip repair")
    };
    let dry = repair(&[]);
    let stderr = String::from_utf8_lossy(&dry.stderr);
    assert_eq!(dry.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("unreadable") && stderr.contains("--rebuild"), "{stderr}");

    let rebuilt = repair(&["--rebuild"]);
    let stderr = String::from_utf8_lossy(&rebuilt.stderr);
    assert!(matches!(rebuilt.status.code(), Some(0 | 1)), "repair --rebuild: {:?}\n{stderr}", rebuilt.status);
    assert!(stderr.contains(&format!("rebuild: {key}: wrote a new map")), "{stderr}");

    // Back: ready, gauge 0, every owned and pooled address still allocated, new addresses
    // none of them.
    readyz_until(&ctl, "200 after the rebuild", Duration::from_secs(60), |code, _| code == 200).await;
    metric_until(&ctl, "clusterip_allocator_unreadable_records{kind=\"allocation_map\"}", 0.0).await;
    let fresh = EtcdStore::open(&etcd_config(&cp, &prefix, 0), cidrs.clone()).await.expect("reopen");
    let recorded: BTreeSet<IpAddr> = fresh.allocated().await.expect("allocated").into_iter().collect();
    for ip in &owned {
        assert!(recorded.contains(ip), "owned {ip} lost by the rebuild");
    }
    let pool_after = pooled(&mut client, &key).await;
    let (running, owned_ref, pool_before_ref, pool_after_ref) = (&store, &owned, &pool_before, &pool_after);
    eventually_ok("the running store recovers", Duration::from_secs(60), Duration::from_millis(100), move || async move {
        let ip = running.allocate_next(Family::IPv4, None).await?;
        assert!(!owned_ref.contains(&ip) && !pool_before_ref.contains(&ip) && !pool_after_ref.contains(&ip), "{ip} handed out again");
        Ok::<_, StoreError>(())
    })
    .await;
    for _ in 0..50 {
        let ip = fresh.allocate_next(Family::IPv4, None).await.expect("allocate after the rebuild");
        assert!(!owned.contains(&ip) && !pool_before.contains(&ip) && !pool_after.contains(&ip), "{ip} handed out again");
    }
    fresh.release_owned(owned_one, &gateway).await.expect("the owner releases its address after the rebuild");
    drop(ctl);
    let _ = client.delete(prefix.as_str(), Some(etcd_client::DeleteOptions::new().with_prefix())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupt_owner_record_keeps_its_address_until_it_is_readable() {
    let cp = control_plane();
    let name = unique_name("owner");
    let prefix = format!("/clusterip-test/{name}");
    let cidr = ServiceCidr::parse("198.18.44.0/24").expect("cidr");
    let mut client = etcd(&cp).await;
    let store = EtcdStore::open(&etcd_config(&cp, &prefix, 0), vec![cidr.clone()]).await.expect("open");
    let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name };
    let ip = store.allocate_next(Family::IPv4, Some(&gateway)).await.expect("allocate");
    let okey = owner_key(&range_key(&prefix, &cidr), ip);
    let good = read_key(&mut client, &okey).await.0;
    client.put(okey.as_str(), b"{garbage".to_vec(), None).await.expect("put garbage");

    eventually_ok("the garbled owner record is reported", Duration::from_secs(60), Duration::from_millis(100), || {
        let unreadable = store.unreadable();
        let reported = unreadable.iter().any(|u| u.kind == "owner" && u.record == okey);
        async move { if reported { Ok(()) } else { Err(format!("{unreadable:?}")) } }
    })
    .await;
    // Held: no unowned release, no release by the real owner, no second allocation.
    assert!(matches!(store.release(ip).await, Err(StoreError::Corrupt { .. })));
    assert!(matches!(store.release_owned(ip, &gateway).await, Err(StoreError::Corrupt { .. })));
    assert!(matches!(store.allocate(ip, None).await, Err(StoreError::Alloc(clusterip::alloc::AllocError::Allocated))));
    let fresh = EtcdStore::open(&etcd_config(&cp, &prefix, 0), vec![cidr]).await.expect("reopen");
    assert!(fresh.unreadable().iter().any(|u| u.record == okey), "a fresh open does not report it: {:?}", fresh.unreadable());
    assert!(fresh.has(ip).await.expect("has"), "{ip} not held after the owner record broke");

    // The documented way back: write the owner's parentRef again (or delete the key).
    client.put(okey.as_str(), good, None).await.expect("restore the owner record");
    eventually_ok("the restored owner record is no longer reported", Duration::from_secs(60), Duration::from_millis(100), || {
        let unreadable = store.unreadable();
        async move { if unreadable.is_empty() { Ok(()) } else { Err(format!("still reported: {unreadable:?}")) } }
    })
    .await;
    store.release_owned(ip, &gateway).await.expect("the owner releases it");
    let _ = client.delete(prefix.as_str(), Some(etcd_client::DeleteOptions::new().with_prefix())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn garbled_ipaddress_objects_are_counted_and_hold_their_address() {
    let cp = control_plane();
    let name = unique_name("garbled");
    let mut client = etcd(&cp).await;
    // Written into the apiserver's own etcd, past its validation (as a restore or a bug
    // could leave them): a name that is no address, and an address without a parentRef.
    let bad_name = format!("not-an-ip-{name}");
    let held = "198.18.46.200";
    let object = |n: &str, spec: serde_json::Value| {
        serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
            "metadata": {"name": n, "uid": format!("00000000-0000-4000-8000-{:012}", n.len()), "creationTimestamp": "2030-01-01T00:00:00Z"},
            "spec": spec,
        })
        .to_string()
    };
    let injected = [
        (bad_name.clone(), object(&bad_name, serde_json::json!({"parentRef": {"group": "", "resource": "services", "namespace": "default", "name": name}}))),
        (held.to_string(), object(held, serde_json::json!({}))),
    ];
    for (n, value) in &injected {
        client.put(format!("/registry/ipaddresses/{n}"), value.as_str(), None).await.expect("write an IPAddress into the apiserver's etcd");
    }
    let api: kube::Api<k8s_openapi::api::networking::v1::IPAddress> = kube::Api::all(cp.client().await);
    let (api, bad_name) = (&api, &bad_name);
    eventually_ok("the apiserver serves the injected IPAddresses", Duration::from_secs(120), Duration::from_millis(200), move || async move {
        let listed = api.list_metadata(&Default::default()).await;
        let names: BTreeSet<String> = match &listed {
            Ok(l) => l.items.iter().filter_map(|o| o.metadata.name.clone()).collect(),
            Err(_) => BTreeSet::new(),
        };
        if names.contains(bad_name) && names.contains(held) {
            Ok(())
        } else {
            Err(format!("{:?}", listed.map(|_| names)))
        }
    })
    .await;

    // The controller starts, is ready, and counts the one it cannot read.
    let mut args = controller_args(&cp, "ipaddress", "198.18.46.0/24", &name, "default", &name, &cp.kubeconfig());
    args.extend(client_auth_args(&cp));
    args.extend(["--repair-interval", "0"].map(String::from));
    let ctl = Controller::start(args);
    ctl.wait_ready().await;
    metric_until(&ctl, "clusterip_allocator_unreadable_records{kind=\"ipaddress\"}", 1.0).await;
    assert!(ctl.log().contains(&format!("kubectl delete ipaddress {bad_name}")), "no warning naming the object:\n{}", ctl.log());

    // The address without a parentRef stays taken: a Service asking for it gets
    // Kubernetes' 422.
    let review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "garbled-1", "kind": {"group": "", "version": "v1", "kind": "Service"},
            "resource": {"group": "", "version": "v1", "resource": "services"},
            "name": name, "namespace": "default", "operation": "CREATE",
            "userInfo": {"username": "test"}, "dryRun": false,
            "object": {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
                       "spec": {"clusterIP": held, "clusterIPs": [held], "ports": [{"port": 80}]}}
        }
    });
    let (cert, key) = controller_common::apiserver_client_cert(&cp);
    let out = std::process::Command::new("curl")
        .args(["-s", "--max-time", "30", "--cacert"])
        .arg(cp.dir().join("pki/ca.crt"))
        .arg("--cert")
        .arg(cert)
        .arg("--key")
        .arg(key)
        .args(["-H", "Content-Type: application/json", "--data-binary", &review.to_string()])
        .arg(format!("https://127.0.0.1:{}/mutate", ctl.webhook_port))
        .output()
        .expect("curl");
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(answer["response"]["allowed"], false, "{answer:#}");
    assert_eq!(answer["response"]["status"]["code"], 422, "{answer:#}");
    assert!(answer["response"]["status"]["message"].as_str().unwrap_or("").contains("provided IP is already allocated"), "{answer:#}");

    // The way back: delete them; the gauge returns to 0.
    for (n, _) in &injected {
        client.delete(format!("/registry/ipaddresses/{n}"), None).await.expect("delete the injected IPAddress");
    }
    metric_until(&ctl, "clusterip_allocator_unreadable_records{kind=\"ipaddress\"}", 0.0).await;
}
