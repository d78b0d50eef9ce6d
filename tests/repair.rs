//! The repair pass against the real control plane: drift seeded through the real
//! kube-apiserver (Services) and the real backends (records), `clusterip repair` run as a
//! process, its report rows, exit codes and repairs asserted.
//!
//! Service addresses must be valid for the apiserver (its 198.19.0.0/16 and
//! fd00:10:96::/112), so each test takes a /28 and a /124 from the apiserver's *static* band
//! (198.19.0.1–198.19.1.0, fd00:10:96::1–::100), which its own dynamic allocation never uses
//! while the upper band has room, and which no other test uses (198.19.0.192/28 and
//! 198.19.0.208/28 for the etcd drift tests, .244 and .250 for single addresses; the
//! tests of this file run side by side, so no two share one). Records-only tests use
//! 198.18.160.0/20 and fd00:18:164::/112. Each test has its own namespace and etcd prefix and removes them.

mod controller_common;

use std::collections::BTreeSet;
use std::time::Duration;

use clusterip::cidr::ServiceCidr;
use clusterip::repair::{Action, Repairer, Target};
use clusterip::store::etcd::{EtcdConfig, EtcdStore};
use clusterip::store::ipaddress::{IpAddressConfig, IpAddressStore};
use clusterip::store::{AllocationStore, ParentRef};
use clusterip_test_support::{block_on_drop, control_plane, eventually, free_leftover, ip, local_get, unique_name, within, ControlPlane};
use controller_common::{metric, Controller};
use k8s_openapi::api::core::v1::{Event, Namespace, Service};
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{json, Value};

/// A namespace of the test's own, deleted (with its Services) on drop.
struct Ns {
    name: String,
    client: kube::Client,
}

impl Ns {
    async fn new(cp: &ControlPlane) -> Ns {
        let client = cp.client().await;
        let name = unique_name("repair");
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("namespace");
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.expect("create namespace");
        Ns { name, client }
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// A ClusterIP Service with the given addresses (dual-stack when two are given). An
    /// address still held by a Service of an earlier run's namespace (a run killed before
    /// its clean-up, against a reused cluster) is freed first.
    async fn service(&self, name: &str, ips: &[&str]) -> Service {
        for addr in ips {
            // Held by a Service of this file's namespaces (`repair-…`): an earlier run's.
            free_leftover(&self.client, addr, |p| p.namespace.as_deref().is_some_and(|ns| ns.starts_with("repair-"))).await;
        }
        let mut spec = json!({"ports": [{"port": 80}], "clusterIP": ips[0], "clusterIPs": ips});
        if ips.len() == 2 {
            spec["ipFamilyPolicy"] = json!("RequireDualStack");
            spec["ipFamilies"] = json!(ips.iter().map(|ip| if ip.contains(':') { "IPv6" } else { "IPv4" }).collect::<Vec<_>>());
        }
        let svc: Service = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).expect("service");
        self.services().create(&PostParams::default(), &svc).await.unwrap_or_else(|e| panic!("create Service {name} {ips:?}: {e}"))
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let (client, name) = (self.client.clone(), self.name.clone());
        block_on_drop(async move {
            let dp = DeleteParams::default();
            let _ = Api::<Service>::namespaced(client.clone(), &name).delete_collection(&dp, &ListParams::default()).await;
            let _ = Api::<Namespace>::all(client).delete(&name, &dp).await;
        });
    }
}

struct Run {
    code: i32,
    json: Value,
    stderr: String,
}

impl Run {
    /// (kind, address) of every finding.
    fn rows(&self) -> BTreeSet<(String, String)> {
        self.findings().iter().map(|f| (f["kind"].as_str().unwrap_or("").to_string(), f["address"].as_str().unwrap_or("").to_string())).collect()
    }

    fn findings(&self) -> Vec<Value> {
        self.json["findings"].as_array().cloned().unwrap_or_default()
    }

    fn finding(&self, kind: &str, address: &str) -> Value {
        self.findings()
            .into_iter()
            .find(|f| f["kind"] == kind && f["address"] == address)
            .unwrap_or_else(|| panic!("no {kind} finding for {address} in {:#}", self.json))
    }
}

/// `clusterip <args> -o json`: its exit code, its JSON and its stderr (no panic in it).
async fn clusterip_json(args: &[String]) -> Run {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_clusterip"))
        .args(args)
        .args(["-o", "json"])
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("run clusterip");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("clusterip {args:?} printed no JSON ({e}): {stdout}\nstderr: {stderr}"));
    assert!(!stderr.contains("panicked"), "{stderr}");
    Run { code: out.status.code().unwrap_or(-1), json, stderr }
}

/// `clusterip repair <args> -o json`.
async fn repair(args: &[String]) -> Run {
    clusterip_json(&[strs(&["repair"]), args.to_vec()].concat()).await
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn set(rows: &[(&str, &str)]) -> BTreeSet<(String, String)> {
    rows.iter().map(|(k, a)| (k.to_string(), a.to_string())).collect()
}

async fn warning_reasons(client: &kube::Client, ns: &str, name: &str) -> Vec<(String, String)> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let list = events.list(&ListParams::default()).await.expect("list events");
    list.items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect()
}

struct EtcdFixture {
    cfg: EtcdConfig,
    cidrs: Vec<ServiceCidr>,
    endpoints: Vec<String>,
}

impl EtcdFixture {
    fn new(cp: &ControlPlane, cidrs: &[&str]) -> Self {
        let cfg = EtcdConfig { endpoints: cp.etcd_endpoints(), prefix: format!("/clusterip-test/{}", unique_name("repair")), ..Default::default() };
        Self { cfg, cidrs: cidrs.iter().map(|c| ServiceCidr::parse(c).expect("cidr")).collect(), endpoints: cp.etcd_endpoints() }
    }

    async fn open(&self) -> EtcdStore {
        EtcdStore::open(&self.cfg, self.cidrs.clone()).await.expect("open etcd store")
    }

    fn args(&self, cp: &ControlPlane) -> Vec<String> {
        let mut a = strs(&["--backend", "etcd", "--etcd-endpoints"]);
        a.push(self.endpoints.join(","));
        a.extend(strs(&["--etcd-prefix", &self.cfg.prefix, "--service-cidr"]));
        a.push(self.cidrs.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(","));
        a.push("--kubeconfig".into());
        a.push(cp.kubeconfig().display().to_string());
        a
    }

    async fn cleanup(&self) {
        if let Ok(mut client) = etcd_client::Client::connect(self.endpoints.clone(), None).await {
            let _ = client.delete(self.cfg.prefix.clone(), Some(etcd_client::DeleteOptions::new().with_prefix())).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_drift_is_reported_then_fixed() {
    let cp = control_plane();
    let fx = EtcdFixture::new(&cp, &["198.19.0.192/28", "fd00:10:96::c0/124"]);
    let ns = Ns::new(&cp).await;
    let store = fx.open().await;
    // Consistent: a Service and its record.
    ns.service("held", &["198.19.0.193"]).await;
    store.allocate(ip("198.19.0.193"), None).await.expect("record .193");
    // Missing records: a dual-stack Service the records know nothing of.
    ns.service("unrecorded", &["198.19.0.194", "fd00:10:96::c2"]).await;
    // Leaks: records no Service holds.
    store.allocate(ip("198.19.0.200"), None).await.expect("leak v4");
    store.allocate(ip("fd00:10:96::c9"), None).await.expect("leak v6");

    let args = fx.args(&cp);
    let dry = repair(&args).await;
    assert_eq!(dry.code, 1, "{:#}\n{}", dry.json, dry.stderr);
    assert_eq!(
        dry.rows(),
        set(&[
            ("leak", "198.19.0.200"),
            ("leak", "fd00:10:96::c9"),
            ("missing-record", "198.19.0.194"),
            ("missing-record", "fd00:10:96::c2"),
        ])
    );
    let missing = dry.finding("missing-record", "198.19.0.194");
    assert_eq!(missing["owner"], format!("{}/unrecorded", ns.name));
    assert_eq!(missing["action"], "create");
    assert_eq!(missing["result"], "not-applied");
    assert_eq!(missing["event"]["reason"], "ClusterIPNotAllocated");
    assert_eq!(missing["event"]["message"], "Cluster IP [IPv4]:198.19.0.194 is not allocated; repairing");
    let leak = dry.finding("leak", "198.19.0.200");
    assert_eq!(leak["action"], "release-later");
    assert_eq!(leak["detail"], "release on pass 3 of 3 (seen leaked on 1)");
    // A dry run changes nothing.
    assert!(!store.has(ip("198.19.0.194")).await.expect("has"));

    // --fix recreates the missing records, posts the Events, and leaves the leaks (seen once).
    let fixed = repair(&[args.clone(), strs(&["--fix"])].concat()).await;
    assert_eq!(fixed.code, 1, "leaks are left by --fix alone: {:#}", fixed.json);
    assert_eq!(fixed.finding("missing-record", "fd00:10:96::c2")["result"], "applied");
    assert_eq!(fixed.finding("leak", "198.19.0.200")["result"], "not-applied");
    assert_eq!(fixed.json["remaining"], 2);
    eventually("the missing records recorded", Duration::from_secs(120), || async { store.has(ip("198.19.0.194")).await.unwrap_or(false) && store.has(ip("fd00:10:96::c2")).await.unwrap_or(false) }).await;
    assert!(store.has(ip("198.19.0.200")).await.expect("has"), "a leak seen once must not be released");
    let client = cp.client().await;
    eventually("ClusterIPNotAllocated Event on the Service", Duration::from_secs(120), || async {
        // (kube's Recorder folds repeats of one reason on one object into a series: the
        // first note is the one kept.)
        warning_reasons(&client, &ns.name, "unrecorded").await.iter().any(|(r, m)| {
            r == "ClusterIPNotAllocated"
                && (m == "Cluster IP [IPv4]:198.19.0.194 is not allocated; repairing" || m == "Cluster IP [IPv6]:fd00:10:96::c2 is not allocated; repairing")
        })
    })
    .await;

    // --release-leaks-now releases them; the next dry run is clean.
    let now = repair(&[args.clone(), strs(&["--fix", "--release-leaks-now"])].concat()).await;
    assert_eq!(now.code, 0, "{:#}", now.json);
    assert_eq!(now.rows(), set(&[("leak", "198.19.0.200"), ("leak", "fd00:10:96::c9")]));
    eventually("the leaks released", Duration::from_secs(120), || async { !store.has(ip("198.19.0.200")).await.unwrap_or(true) && !store.has(ip("fd00:10:96::c9")).await.unwrap_or(true) }).await;
    let clean = repair(&args).await;
    assert_eq!(clean.code, 0, "{:#}", clean.json);
    assert!(clean.findings().is_empty());
    assert_eq!(clean.json["consistent"], true);

    drop(store);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_leak_is_released_on_the_third_pass_and_not_before() {
    let cp = control_plane();
    let fx = EtcdFixture::new(&cp, &["198.18.160.0/24"]);
    let store: std::sync::Arc<dyn AllocationStore> = std::sync::Arc::new(fx.open().await);
    store.allocate(ip("198.18.160.77"), None).await.expect("seed leak");
    let mut repairer = Repairer::new(cp.client().await, Target::Etcd(store.clone()));
    for pass in 1..=2u32 {
        let r = repairer.run_once(true, false, None).await.expect("pass");
        let f = &r.report.findings;
        assert_eq!(f.len(), 1, "pass {pass}: {f:#?}");
        assert_eq!(f[0].action, Action::ReleaseLater { seen: pass, of: 3 }, "pass {pass}");
        assert!(store.has(ip("198.18.160.77")).await.expect("has"), "released on pass {pass}, before the 3rd");
    }
    let r = repairer.run_once(true, false, None).await.expect("pass 3");
    assert_eq!(r.report.findings.len(), 1);
    assert_eq!(r.report.findings[0].action, Action::Release);
    assert_eq!(r.remaining(), 0);
    eventually("the leak released on the 3rd pass", Duration::from_secs(120), || async { !store.has(ip("198.18.160.77")).await.unwrap_or(true) }).await;
    let r = repairer.run_once(true, false, None).await.expect("pass 4");
    assert!(r.report.findings.is_empty(), "{:#?}", r.report.findings);
    drop(repairer);
    drop(store);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_drift_is_reported_then_fixed() {
    let cp = control_plane();
    // The records live in ranges no other test's controller judges; web's address (the
    // apiserver's, outside these ranges) is another allocator's and only names the parent.
    let ranges = ["198.18.164.0/24", "fd00:18:164::/112"];
    let cidrs: Vec<ServiceCidr> = ranges.iter().map(|c| ServiceCidr::parse(c).expect("cidr")).collect();
    let ns = Ns::new(&cp).await;
    let client = cp.client().await;
    // The apiserver records this Service's address itself (managed by ipallocator.k8s.io):
    // read as the record, never changed.
    ns.service("web", &["198.19.0.244"]).await;
    let store = IpAddressStore::open(client.clone(), IpAddressConfig { ranges: cidrs.clone(), ..Default::default() }).await.expect("open IPAddress store");
    // A leak: ours, for a Service that does not exist.
    store.allocate(ip("198.18.164.15"), Some(&ParentRef::service(&ns.name, "gone"))).await.expect("seed leak");
    // A wrong reference: ours, naming a live Service that does not hold the address.
    store.allocate(ip("fd00:18:164::da"), Some(&ParentRef::service(&ns.name, "web"))).await.expect("seed wrong reference");
    drop(store);

    let mut args = strs(&["--backend", "ipaddress", "--service-cidr", &ranges.join(","), "--kubeconfig"]);
    args.push(cp.kubeconfig().display().to_string());
    let dry = repair(&args).await;
    assert_eq!(dry.code, 1, "{:#}\n{}", dry.json, dry.stderr);
    assert_eq!(dry.rows(), set(&[("leak", "198.18.164.15"), ("wrong-reference", "fd00:18:164::da")]));
    let leak = dry.finding("leak", "198.18.164.15");
    assert_eq!(leak["owner"], format!("services/{}/gone", ns.name));
    assert_eq!(leak["action"], "release-after-grace");
    let wrong = dry.finding("wrong-reference", "fd00:18:164::da");
    assert_eq!(wrong["action"], "release");
    assert_eq!(wrong["event"]["reason"], "IPAddressWrongReference");
    assert_eq!(wrong["event"]["message"], format!("IPAddress: fd00:18:164::da for Service {}/web has a wrong reference; cleaning up", ns.name));

    // --fix: the wrong reference goes; the young leak waits for its grace period.
    let fixed = repair(&[args.clone(), strs(&["--fix"])].concat()).await;
    assert_eq!(fixed.code, 1, "{:#}", fixed.json);
    assert_eq!(fixed.finding("wrong-reference", "fd00:18:164::da")["result"], "applied");
    assert_eq!(fixed.finding("leak", "198.18.164.15")["result"], "not-applied");
    let ipaddrs: Api<IPAddress> = Api::all(client.clone());
    assert!(ipaddrs.get_opt("fd00:18:164::da").await.expect("get").is_none());
    assert!(ipaddrs.get_opt("198.18.164.15").await.expect("get").is_some(), "a leak inside its grace period must stay");
    // The apiserver's own record of web is untouched.
    let theirs = ipaddrs.get("198.19.0.244").await.expect("the apiserver's record");
    assert_eq!(theirs.metadata.labels.unwrap_or_default().get("ipaddress.kubernetes.io/managed-by").map(String::as_str), Some("ipallocator.k8s.io"));

    // With a 0s grace the (now older) leak is released, and the next dry run is clean.
    let grace0 = [args.clone(), strs(&["--fix", "--grace-period", "0s"])].concat();
    eventually("the leak released once older than the grace period", Duration::from_secs(120), || async {
        let r = repair(&grace0).await;
        r.code == 0
    })
    .await;
    assert!(ipaddrs.get_opt("198.18.164.15").await.expect("get").is_none());
    let clean = repair(&args).await;
    assert_eq!(clean.code, 0, "{:#}", clean.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audit_reports_the_apiservers_orphans_and_changes_nothing() {
    let cp = control_plane();
    let client = cp.client().await;
    let ghost_ns = unique_name("ghost");
    // An IPAddress as the kube-apiserver writes them, for a Service that does not exist.
    let obj: IPAddress = serde_json::from_value(json!({
        "metadata": {"name": "198.19.0.250", "labels": {"ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io", "ipaddress.kubernetes.io/ip-family": "IPv4"}},
        "spec": {"parentRef": {"group": "", "resource": "services", "namespace": ghost_ns, "name": "ghost"}}
    }))
    .expect("ipaddress");
    let api: Api<IPAddress> = Api::all(client.clone());
    let _ = api.delete("198.19.0.250", &DeleteParams::default()).await;
    eventually("a leftover 198.19.0.250 deleted", Duration::from_secs(120), || async { api.get_opt("198.19.0.250").await.ok().flatten().is_none() }).await;
    api.create(&PostParams::default(), &obj).await.expect("seed the apiserver's orphan");

    let audit = repair(&strs(&["--audit-apiserver", "--kubeconfig", &cp.kubeconfig().display().to_string()])).await;
    let _ = api.delete("198.19.0.250", &DeleteParams::default()).await;
    assert_eq!(audit.code, 1, "{:#}\n{}", audit.json, audit.stderr);
    assert_eq!(audit.json["backend"], "kube-apiserver");
    let row = audit.finding("leak", "198.19.0.250");
    assert_eq!(row["owner"], format!("services/{ghost_ns}/ghost"));
    assert_eq!(row["action"], "none");
    assert_eq!(row["result"], "not-applied");
    assert!(audit.json["ranges"].as_array().expect("ranges").iter().any(|r| r == "198.19.0.0/16"), "{:#}", audit.json["ranges"]);
    // --fix is refused with the audit.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_clusterip"))
        .args(["repair", "--audit-apiserver", "--fix"])
        .output()
        .await
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn import_rangeallocation_then_report() {
    let cp = control_plane();
    let fx = EtcdFixture::new(&cp, &["198.18.161.0/24"]);
    // Kubernetes' legacy bitmap, JSON form: offsets 0 and 10 → 198.18.161.1 and .11.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("serviceips.json");
    use base64::Engine as _;
    let legacy = json!({"range": "198.18.161.0/24", "data": base64::engine::general_purpose::STANDARD.encode([0b0000_0100u8, 0b0000_0001])});
    std::fs::write(&file, legacy.to_string()).expect("write");
    let args = [fx.args(&cp), strs(&["--import-rangeallocation", &file.display().to_string()])].concat();
    let run = repair(&args).await;
    assert!(run.stderr.contains("2 addresses, 2 newly recorded"), "{}", run.stderr);
    // No Service holds them: two leaks, reported, not released by a dry run.
    assert_eq!(run.code, 1, "{:#}", run.json);
    assert_eq!(run.rows(), set(&[("leak", "198.18.161.1"), ("leak", "198.18.161.11")]));
    let store = fx.open().await;
    assert!(store.has(ip("198.18.161.11")).await.expect("has"));
    drop(store);
    fx.cleanup().await;
}

#[tokio::test]
async fn errors_exit_2_with_one_line() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_clusterip"))
        .args(["repair", "--backend", "etcd", "--service-cidr", "198.18.162.0/24", "--etcd-endpoints", "http://127.0.0.1:1", "--etcd-dial-timeout", "1s"])
        .args(["--kubeconfig", &control_plane().kubeconfig().display().to_string()])
        .output()
        .await
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.starts_with("error: ") && stderr.contains("etcd"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `/metrics` of a controller, as text ("" while it is not answering).
async fn scrape(port: u16) -> String {
    local_get(port, "/metrics").await.map(|(_, body)| body).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn controller_repair_loop_releases_a_leak_after_three_passes() {
    let cp = control_plane();
    let fx = EtcdFixture::new(&cp, &["198.18.163.0/24"]);
    let store = fx.open().await;
    store.allocate(ip("198.18.163.5"), None).await.expect("seed leak");
    let lease = unique_name("repair-loop");
    let pki = cp.dir().join("pki");
    let (etcd, kubeconfig) = (cp.etcd_endpoints().join(","), cp.kubeconfig().display().to_string());
    let (crt, key) = (pki.join("webhook.crt").display().to_string(), pki.join("webhook.key").display().to_string());
    let auth = controller_common::client_auth_args(&cp);
    let mut child = Controller::start(auth.iter().map(String::as_str).chain([
        "--backend",
        "etcd",
        "--service-cidr",
        "198.18.163.0/24",
        "--etcd-endpoints",
        &etcd,
        "--etcd-prefix",
        &fx.cfg.prefix,
        "--kubeconfig",
        &kubeconfig,
        "--leader-elect-namespace",
        "default",
        "--leader-elect-lease-name",
        &lease,
        "--repair-interval",
        "3s",
        "--tls-cert-file",
        &crt,
        "--tls-private-key-file",
        &key,
    ]));
    let metrics_port = child.metrics_port;
    let leak_series = "clusterip_repair_ip_errors_total{type=\"leak\"}";
    // The first pass (at start) sees the leak and keeps it.
    let held_after_a_pass = std::cell::Cell::new(false);
    let (store_ref, held_seen) = (&store, &held_after_a_pass);
    let released_at = within(Duration::from_secs(180), Duration::from_millis(100), move || async move {
        let held = store_ref.has(ip("198.18.163.5")).await.expect("has");
        let seen = metric(&scrape(metrics_port).await, leak_series).unwrap_or(0.0);
        if held && seen >= 1.0 {
            held_seen.set(true);
        }
        (!held).then_some(seen)
    })
    .await;
    let held_after_a_pass = held_after_a_pass.get();
    let text = scrape(metrics_port).await;
    child.kill();
    assert!(held_after_a_pass, "the leak was released by the first pass");
    let seen = released_at.expect("the controller's repair loop did not release the leak within 180s");
    assert!(seen >= 3.0, "released after {seen} pass(es) saw it leaked; want the 3rd");
    assert_eq!(metric(&text, "clusterip_repair_reconcile_errors_total"), Some(0.0), "{text}");
    let _ = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(cp.client().await, "default").delete(&lease, &DeleteParams::default()).await;
    drop(store);
    fx.cleanup().await;
}

/// Drift a stock kube-apiserver refuses at admission — one address on two Services, an
/// address outside every range, a malformed address — written straight into the
/// apiserver's etcd (as an old cluster, a restore or a buggy client could leave it). The
/// apiserver serves those objects as they are; the pass reports each with Kubernetes'
/// reason and wording and changes nothing, even with --fix. An address in a legacy form
/// (leading zeros), recorded, is the address it spells: no finding, as in Kubernetes' repair.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_reports_drift_the_apiserver_would_refuse() {
    let cp = control_plane();
    let fx = EtcdFixture::new(&cp, &["198.19.0.208/28", "fd00:10:96::d0/124"]);
    let ns = Ns::new(&cp).await;
    let store = fx.open().await;
    ns.service("first", &["198.19.0.209"]).await;
    store.allocate(ip("198.19.0.209"), None).await.expect("record .209");
    store.allocate(ip("198.19.0.210"), None).await.expect("record .210");

    let mut etcd = etcd_client::Client::connect(cp.etcd_endpoints(), None).await.expect("etcd");
    let inject = |name: &str, cluster_ip: &str, uid: u32| {
        let svc = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns.name, "uid": format!("00000000-0000-4000-8000-{uid:012}"), "creationTimestamp": "2030-01-01T00:00:00Z"},
            "spec": {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "type": "ClusterIP",
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}], "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"},
            "status": {"loadBalancer": {}}
        });
        (format!("/registry/services/specs/{}/{name}", ns.name), svc.to_string())
    };
    let injected = [inject("second", "198.19.0.209", 1), inject("outside", "198.18.250.5", 2), inject("malformed", "198.19.0.5x", 3), inject("legacy", "198.19.0.0210", 4)];
    for (key, value) in &injected {
        etcd.put(key.as_str(), value.as_str(), None).await.expect("write a Service into the apiserver's etcd");
    }
    let services = ns.services();
    eventually("the apiserver serves the injected Services", Duration::from_secs(120), || async {
        services.list(&ListParams::default()).await.map(|l| l.items.len() == 5).unwrap_or(false)
    })
    .await;

    let args = fx.args(&cp);
    for extra in [&[][..], &["--fix"][..]] {
        let run = repair(&[args.clone(), strs(extra)].concat()).await;
        assert_eq!(run.code, 1, "{:#}\n{}", run.json, run.stderr);
        assert_eq!(run.rows(), set(&[("duplicate", "198.19.0.209"), ("out-of-range", "198.18.250.5"), ("malformed", "198.19.0.5x")]), "{:#}", run.json);
        let dup = run.finding("duplicate", "198.19.0.209");
        assert_eq!(dup["action"], "event");
        assert_eq!(dup["event"]["reason"], "ClusterIPAlreadyAllocated");
        assert_eq!(dup["event"]["message"], "Cluster IP [IPv4]:198.19.0.209 was assigned to multiple services; please recreate service");
        assert!(dup["owner"].as_str().unwrap_or("").starts_with(&format!("{}/second", ns.name)), "{dup:#}");
        let out = run.finding("out-of-range", "198.18.250.5");
        assert_eq!(out["event"]["reason"], "ClusterIPOutOfRange");
        assert_eq!(out["event"]["message"], "Cluster IP [IPv4]:198.18.250.5 is not within the service CIDR 198.19.0.208/28; please recreate service");
        let bad = run.finding("malformed", "198.19.0.5x");
        assert_eq!(bad["event"]["reason"], "ClusterIPNotValid");
        assert_eq!(bad["event"]["message"], "Cluster IP 198.19.0.5x is not a valid IP; please recreate Service");
    }
    // Nothing was taken from the live Service, and the Events reached the Services.
    assert!(store.has(ip("198.19.0.209")).await.expect("has"));
    let client = cp.client().await;
    for (name, reason) in [("second", "ClusterIPAlreadyAllocated"), ("outside", "ClusterIPOutOfRange"), ("malformed", "ClusterIPNotValid")] {
        eventually(&format!("{reason} Event on {name}"), Duration::from_secs(120), || async { warning_reasons(&client, &ns.name, name).await.iter().any(|(r, _)| r == reason) }).await;
    }
    // (Posted by the same passes as the Events above, so it would be there by now. The
    // apiserver's own IPAddress repair reads the legacy form as 198.19.0.210 too: it may post
    // `ClusterIPNotAllocated` for that address, having no IPAddress for it.)
    let legacy = warning_reasons(&client, &ns.name, "legacy").await;
    assert!(!legacy.iter().any(|(r, _)| r == "ClusterIPNotValid"), "the Service with a legacy-form address reported as not valid: {legacy:?}");
    for (key, _) in &injected {
        let _ = etcd.delete(key.as_str(), None).await;
    }
    drop(store);
    fx.cleanup().await;
}

/// `clusterip explain <ip> <args> -o json`: exit code and the explanation.
async fn explain(ip: &str, args: &[String]) -> (i32, Value) {
    let run = clusterip_json(&[strs(&["explain", ip]), args.to_vec()].concat()).await;
    (run.code, run.json)
}

/// `clusterip explain` on the etcd backend (198.19.0.64/28): a Service and its map record
/// agree; a Service the map lacks, and a map record no Service holds, disagree with what
/// repair does about each; a Gateway's owner record and a free address agree; an address
/// outside our ranges is in none. `clusterip capacity` counts the map's addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explain_tells_who_holds_an_address_and_whether_the_etcd_records_agree() {
    let cp = control_plane();
    let fx = EtcdFixture::new(&cp, &["198.19.0.64/28"]);
    let ns = Ns::new(&cp).await;
    let store = fx.open().await;
    ns.service("held", &["198.19.0.65"]).await;
    store.allocate(ip("198.19.0.65"), None).await.expect("record .65");
    ns.service("unrecorded", &["198.19.0.66"]).await;
    store.allocate(ip("198.19.0.70"), None).await.expect("a leak");
    let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: "edge".into() };
    store.allocate(ip("198.19.0.72"), Some(&gateway)).await.expect("a Gateway's");
    let args = fx.args(&cp);

    let (code, held) = explain("198.19.0.65", &args).await;
    assert_eq!(code, 0, "{held:#}");
    let svc = format!("services/{}/held", ns.name);
    assert_eq!((held["owner"].as_str(), held["agree"].as_bool()), (Some(svc.as_str()), Some(true)), "{held:#}");
    assert_eq!(held["range"]["cidr"], "198.19.0.64/28");
    assert_eq!(held["services"][0]["name"], "held");
    assert_eq!(held["ipaddress"]["parent"], svc.as_str(), "the apiserver's own record names the Service");
    assert_eq!(held["map"]["allocated"], true);

    let (code, missing) = explain("198.19.0.66", &args).await;
    assert_eq!(code, 1, "{missing:#}");
    assert_eq!(missing["findings"][0]["kind"], "missing-record", "{missing:#}");
    assert_eq!(missing["findings"][0]["action"], "create the record");
    assert_eq!(missing["map"]["allocated"], false);

    let (code, leak) = explain("198.19.0.70", &args).await;
    assert_eq!(code, 1, "{leak:#}");
    assert_eq!(leak["owner"], Value::Null);
    assert_eq!(leak["findings"][0]["kind"], "leak", "{leak:#}");
    assert_eq!(leak["findings"][0]["action"], "release on pass 3 of 3 (seen leaked on 1)");

    let (code, gw) = explain("198.19.0.72", &args).await;
    assert_eq!(code, 0, "{gw:#}");
    assert_eq!(gw["owner"], "gateways.gateway.networking.k8s.io/infra/edge");
    assert_eq!(gw["map"]["owner"], "gateways.gateway.networking.k8s.io/infra/edge");

    let (code, free) = explain("198.19.0.75", &args).await;
    assert_eq!((code, free["owner"].clone(), free["agree"].clone()), (0, Value::Null, Value::Bool(true)), "{free:#}");
    let (code, outside) = explain("198.19.0.100", &args).await;
    assert_eq!((code, outside["range"].clone()), (0, Value::Null), "{outside:#}");
    assert_eq!(outside["cluster_ranges"][0], "198.19.0.0/16", "{outside:#}");

    // The text form says the same in a line.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_clusterip")).args(["explain", "198.19.0.70"]).args(&args).output().expect("explain (text)");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("clusterip explain 198.19.0.70 (text):\n{text}");
    assert!(text.contains("verdict    recorded for no owner; the records disagree:") && text.contains("- leak"), "{text}");

    // `clusterip capacity` over the same map: the Service's, the leak's and the Gateway's
    // addresses used (the unrecorded Service's is not in the map); no history in the test's
    // namespace, so no rates and no forecast.
    let run = clusterip_json(&[strs(&["capacity", "--namespace", &ns.name]), args.clone()].concat()).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let r = &run.json["ranges"][0];
    assert_eq!((r["cidr"].as_str(), r["size"].as_u64(), r["used"].as_u64(), r["free"].as_u64()), (Some("198.19.0.64/28"), Some(14), Some(3), Some(11)), "{:#}", run.json);
    assert_eq!((r["dynamic_band"]["used"].as_u64(), r["static_band"]["size"].as_u64()), (Some(3), Some(0)), "a /28 has no static band: {:#}", run.json);
    assert!(run.json["history_from"].is_null() && r["days_to_full"].is_null(), "{:#}", run.json);
    drop(store);
    fx.cleanup().await;
}

/// `clusterip explain` on the ipaddress backend: a Service's address recorded by the
/// apiserver, with the block Lease naming it and its holder, agrees; an IPAddress of ours
/// for a Service that does not exist is a leak in its grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explain_tells_who_holds_an_address_and_whether_the_ipaddress_records_agree() {
    let cp = control_plane();
    let ns = Ns::new(&cp).await;
    let client = cp.client().await;
    let ranges = ["198.19.0.80/28", "198.18.166.0/24"];
    ns.service("web", &["198.19.0.81"]).await;
    let block: k8s_openapi::api::coordination::v1::Lease = serde_json::from_value(json!({
        "metadata": {"name": "clusterip-block-test-0", "labels": {clusterip::store::ipaddress::blocks::BLOCK_LABEL: "true"},
            "annotations": {clusterip::store::ipaddress::blocks::ADDRESSES_ANNOTATION: "198.19.0.81-198.19.0.94"}},
        "spec": {"holderIdentity": "replica-0_abc"}
    }))
    .expect("lease");
    Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &block).await.expect("a block Lease");
    let cidrs: Vec<ServiceCidr> = ranges.iter().map(|c| ServiceCidr::parse(c).expect("cidr")).collect();
    let store = IpAddressStore::open(client.clone(), IpAddressConfig { ranges: cidrs, ..Default::default() }).await.expect("open IPAddress store");
    store.allocate(ip("198.18.166.15"), Some(&ParentRef::service(&ns.name, "gone"))).await.expect("seed a leak");
    drop(store);
    let mut args = strs(&["--backend", "ipaddress", "--service-cidr", &ranges.join(","), "--namespace", &ns.name, "--kubeconfig"]);
    args.push(cp.kubeconfig().display().to_string());

    let (code, web) = explain("198.19.0.81", &args).await;
    assert_eq!(code, 0, "{web:#}");
    assert_eq!(web["owner"], format!("services/{}/web", ns.name));
    assert_eq!(web["ipaddress"]["managed_by"], "ipallocator.k8s.io");
    assert_eq!((web["block"]["lease"].as_str(), web["block"]["holder"].as_str()), (Some("clusterip-block-test-0"), Some("replica-0_abc")), "{web:#}");

    let (code, leak) = explain("198.18.166.15", &args).await;
    assert_eq!(code, 1, "{leak:#}");
    assert_eq!(leak["ipaddress"]["parent"], format!("services/{}/gone", ns.name));
    assert_eq!(leak["findings"][0]["kind"], "leak", "{leak:#}");
    assert!(leak["findings"][0]["action"].as_str().is_some_and(|a| a.starts_with("release once older than 60s")), "{leak:#}");
    assert_eq!(leak["block"], Value::Null);
    let _ = Api::<IPAddress>::all(client).delete("198.18.166.15", &DeleteParams::default()).await;
}

/// The address history through a controller leading in the test's own namespace (where it
/// keeps the history), with its repair loop every 2 s: a Service holds an address, is
/// deleted, another takes the address; `clusterip explain --namespace` tells both holdings,
/// the first ended, the second current; a Service deleted for good ends its holding with the
/// Service reconciler's decision; a leak ends with the repair pass's; `clusterip capacity`
/// counts the address used and finds the history.
async fn explain_tells_who_held_an_address_and_which_decision_ended_it(backend: &str, range: &str, base: u8) {
    let cp = control_plane();
    let ns = Ns::new(&cp).await;
    let at = |i: u8| format!("198.19.0.{}", base + i);
    let name = unique_name("history");
    let mut args = controller_common::client_auth_args(&cp);
    args.extend(controller_common::controller_args(&cp, backend, range, &name, &ns.name, "history-0", &cp.kubeconfig()));
    args.extend(strs(&["--address-history-chunks", "16", "--repair-interval", "2s", "--repair-grace-period", "1s"]));
    if backend == "etcd" {
        // No addresses held ahead of need: the map holds only what Services and the leak hold.
        args.extend(strs(&["--etcd-address-pool", "0"]));
    }
    let mut child = Controller::start(args);
    // The leader records from its first list of IPAddresses on (the shared cluster's, never
    // none: the apiserver's `kubernetes` Service holds one), written as the first chunk.
    let chunks: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(cp.client().await, &ns.name);
    let chunks_ref = &chunks;
    eventually("the leader's first history chunk", Duration::from_secs(60), move || async move {
        chunks_ref.list(&ListParams::default().labels(clusterip::history::LABEL)).await.is_ok_and(|l| !l.items.is_empty())
    })
    .await;
    ns.service("web", &[&at(1)]).await;
    ns.services().delete("web", &DeleteParams::default()).await.expect("delete web");
    // The apiserver releases web's record as the delete returns; api may take it at once.
    ns.service("api", &[&at(1)]).await;
    ns.service("gone", &[&at(2)]).await;
    // Deleted once its address is recorded in our records (the etcd map is the Service
    // reconciler's or the repair pass's to fill here: no webhook of ours answers this range).
    let mut explain_args = match backend {
        "etcd" => strs(&["--backend", "etcd", "--etcd-endpoints", &cp.etcd_endpoints().join(","), "--etcd-prefix", &format!("/clusterip-test/{name}")]),
        _ => strs(&["--backend", "ipaddress"]),
    };
    explain_args.extend(strs(&["--service-cidr", range, "--namespace", &ns.name, "--kubeconfig"]));
    explain_args.push(cp.kubeconfig().display().to_string());
    let explain_args = &explain_args;
    if backend == "etcd" {
        let gone_ip = at(2);
        let gone_ip = &gone_ip;
        eventually("gone's address in the etcd map", Duration::from_secs(60), move || async move { explain(gone_ip, explain_args).await.1["map"]["allocated"] == true }).await;
    }
    ns.services().delete("gone", &DeleteParams::default()).await.expect("delete gone");
    // A leak: an address recorded for no live Service (ipaddress: an IPAddress of ours
    // naming a Service that does not exist; etcd: a map address of no owner).
    let ghost = format!("services/{}/ghost", ns.name);
    match backend {
        "etcd" => {
            let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_clusterip"))
                .args(["allocate", "--ip", &at(3), "--backend", "etcd", "--etcd-endpoints", &cp.etcd_endpoints().join(","), "--etcd-prefix", &format!("/clusterip-test/{name}"), "--service-cidr", range])
                .output()
                .await
                .expect("run clusterip allocate");
            assert!(out.status.success(), "clusterip allocate: {}", String::from_utf8_lossy(&out.stderr));
        }
        _ => {
            let obj = clusterip::k8s::ipaddress::build(ip(&at(3)), (&ParentRef::service(&ns.name, "ghost")).into(), clusterip::store::ipaddress::objects::DEFAULT_MANAGER);
            Api::<IPAddress>::all(cp.client().await).create(&PostParams::default(), &obj).await.expect("an IPAddress of ours for no Service");
        }
    }

    let (web, api, gone) = (format!("services/{}/web", ns.name), format!("services/{}/api", ns.name), format!("services/{}/gone", ns.name));
    let (web_ref, api_ref) = (&web, &api);
    let held = at(1);
    let held_ref = &held;
    let found = clusterip_test_support::eventually_ok("both holdings of the first address in the history", Duration::from_secs(60), Duration::from_millis(500), move || async move {
        let (code, json) = explain(held_ref, explain_args).await;
        let history = json["history"].as_array().cloned().unwrap_or_default();
        let parents: Vec<&str> = history.iter().filter_map(|h| h["parent"].as_str()).collect();
        if code == 0 && parents == [web_ref.as_str(), api_ref.as_str()] {
            Ok(json)
        } else {
            Err(format!("exit {code}: {:#}", json["history"]))
        }
    })
    .await;
    let text = std::process::Command::new(env!("CARGO_BIN_EXE_clusterip")).args(["explain", &held]).args(explain_args).output().expect("explain (text)");
    let text = String::from_utf8_lossy(&text.stdout);
    eprintln!("clusterip explain {held} (text):\n{text}");
    assert!(text.contains(&format!("history    {web} ")) && text.contains(&format!("{api} ")) && text.contains("→ now"), "{text}");
    let history = found["history"].as_array().expect("history");
    assert!(history[0]["from"].is_string() && history[0]["to"].is_string(), "web's holding has both ends: {found:#}");
    assert!(history[1]["from"].is_string() && history[1]["to"].is_null(), "api holds it still: {found:#}");
    assert_eq!(found["owner"], api.as_str());

    // gone's holding ended by the Service reconciler's release, in the leader's words.
    let gone_ip = at(2);
    let (gone_ip_ref, gone_ref) = (&gone_ip, &gone);
    let ended = clusterip_test_support::eventually_ok("gone's holding ended by the Service reconciler", Duration::from_secs(60), Duration::from_millis(500), move || async move {
        let (_, json) = explain(gone_ip_ref, explain_args).await;
        match json["history"].as_array().and_then(|h| h.iter().find(|h| h["parent"] == gone_ref.as_str())) {
            Some(h) if h["ended_by"]["decision"] == "service-deleted" => Ok(json),
            _ => Err(format!("{:#}", json["history"])),
        }
    })
    .await;
    let h = &ended["history"][0];
    assert_eq!((h["ended_by"]["by"].as_str(), h["ended_by"]["parent"].as_str()), (Some("history-0"), Some(gone.as_str())), "{ended:#}");
    if backend == "etcd" {
        // Recorded in the map by the Service reconciler (or, had it not yet, by the repair pass).
        assert!(matches!(h["began_by"]["decision"].as_str(), Some("recorded-for-service" | "repair-recorded")), "{ended:#}");
    }
    let text = std::process::Command::new(env!("CARGO_BIN_EXE_clusterip")).args(["explain", &gone_ip]).args(explain_args).output().expect("explain (text)");
    let text = String::from_utf8_lossy(&text.stdout);
    eprintln!("clusterip explain {gone_ip} (text):\n{text}");
    assert!(text.contains("ended: the Service reconciler released it: the Service was deleted (history-0, "), "{text}");

    // The leak released by the repair pass: on the IPAddress's holding (ipaddress), apart
    // with no owner (etcd: the map address had no record to show it).
    let leak = at(3);
    let (leak_ref, ghost_ref) = (&leak, &ghost);
    let backend_ref = backend;
    let released = clusterip_test_support::eventually_ok("the leak's release by the repair pass", Duration::from_secs(90), Duration::from_millis(500), move || async move {
        let (_, json) = explain(leak_ref, explain_args).await;
        let decision = match backend_ref {
            "etcd" => json["decisions"].as_array().and_then(|d| d.iter().find(|d| d["decision"] == "repair-released").cloned()),
            _ => json["history"].as_array().and_then(|h| h.iter().find(|h| h["parent"] == ghost_ref.as_str()).map(|h| h["ended_by"].clone())).filter(|d| d["decision"] == "repair-released"),
        };
        decision.ok_or_else(|| format!("{json:#}"))
    })
    .await;
    let expected_parent = if backend == "etcd" { "-" } else { ghost.as_str() };
    assert_eq!((released["by"].as_str(), released["parent"].as_str()), (Some("history-0"), Some(expected_parent)), "{released:#}");
    child.kill();

    // `clusterip capacity` over the same range: api's address used, the history found but
    // too young for any rate window, so no forecast.
    let run = clusterip_json(&[strs(&["capacity"]), explain_args.clone()].concat()).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let cap = run.json;
    let r = &cap["ranges"][0];
    assert_eq!((r["cidr"].as_str(), r["size"].as_u64(), r["used"].as_u64(), r["free"].as_u64()), (Some(range), Some(14), Some(1), Some(13)), "{cap:#}");
    assert_eq!((r["dynamic_band"]["used"].as_u64(), r["static_band"]["size"].as_u64()), (Some(1), Some(0)), "a /28 has no static band: {cap:#}");
    assert!(cap["history_from"].is_string() && r["rates"].as_array().is_some_and(|a| a.is_empty()) && r["days_to_full"].is_null(), "{cap:#}");
    if backend == "etcd" {
        let mut client = etcd_client::Client::connect(cp.etcd_endpoints(), None).await.expect("etcd");
        let _ = client.delete(format!("/clusterip-test/{name}"), Some(etcd_client::DeleteOptions::new().with_prefix())).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_explain_tells_who_held_an_address_and_which_decision_ended_it() {
    explain_tells_who_held_an_address_and_which_decision_ended_it("ipaddress", "198.19.0.96/28", 96).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_explain_tells_who_held_an_address_and_which_decision_ended_it() {
    explain_tells_who_held_an_address_and_which_decision_ended_it("etcd", "198.19.0.112/28", 112).await;
}

/// `clusterip what-if` through the real apiserver: a ServiceCIDR of the test's own
/// (198.18.170.0/24) holding one Service; deleting it would strand that Service (exit 1),
/// narrowing it to its upper half too; a wider range over it overlaps it (allowed, exit 0);
/// a range over a Node's pod CIDR is unsafe (exit 1). Changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_if_tells_what_a_servicecidr_change_would_strand_or_overlap() {
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    let cp = control_plane();
    let client = cp.client().await;
    let ns = Ns::new(&cp).await;
    let name = unique_name("whatif");
    let cidrs: Api<ServiceCIDR> = Api::all(client.clone());
    let sc: ServiceCIDR = serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": ["198.18.170.0/24"]}})).expect("ServiceCIDR");
    cidrs.create(&PostParams::default(), &sc).await.expect("create the ServiceCIDR");
    let node_name = unique_name("whatif-node");
    let node: Node = serde_json::from_value(json!({"metadata": {"name": node_name}, "spec": {"podCIDR": "198.18.172.0/24", "podCIDRs": ["198.18.172.0/24"]}})).expect("Node");
    let nodes: Api<Node> = Api::all(client.clone());
    nodes.create(&PostParams::default(), &node).await.expect("create a Node");
    // Removed however the test ends (other tests wait for the cluster's ServiceCIDRs to be
    // the default one only).
    struct Cleanup(kube::Client, String, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let (client, cidr, node) = (self.0.clone(), self.1.clone(), self.2.clone());
            block_on_drop(async move {
                let _ = Api::<ServiceCIDR>::all(client.clone()).delete(&cidr, &DeleteParams::default()).await;
                let _ = Api::<Node>::all(client).delete(&node, &DeleteParams::default()).await;
            });
        }
    }
    let _cleanup = Cleanup(client.clone(), name.clone(), node_name.clone());
    // The apiserver allocates from the ServiceCIDR once it is Ready (kube-controller-manager).
    let (svcs, spec) = (ns.services(), json!({"metadata": {"name": "in-extra"}, "spec": {"clusterIP": "198.18.170.5", "ports": [{"port": 80}]}}));
    let (svcs_ref, spec_ref) = (&svcs, &spec);
    clusterip_test_support::eventually_ok("a Service in the new ServiceCIDR", Duration::from_secs(60), Duration::from_millis(500), move || async move {
        svcs_ref.create(&PostParams::default(), &serde_json::from_value(spec_ref.clone()).expect("svc")).await.map(|_| ()).map_err(|e| e.to_string())
    })
    .await;

    let what_if = |args: Vec<String>| {
        let kubeconfig = cp.kubeconfig().display().to_string();
        async move {
            let run = clusterip_json(&[strs(&["what-if"]), args, strs(&["--kubeconfig", &kubeconfig])].concat()).await;
            (run.code, run.json)
        }
    };
    let (code, del) = what_if(strs(&["delete-cidr", &name])).await;
    assert_eq!(code, 1, "{del:#}");
    assert_eq!(del["stranded"], json!([{"namespace": ns.name, "name": "in-extra", "address": "198.18.170.5"}]), "{del:#}");
    let (code, shrink) = what_if(strs(&["shrink", &name, "198.18.170.128/25"])).await;
    assert_eq!((code, shrink["stranded"][0]["name"].as_str()), (1, Some("in-extra")), "{shrink:#}");
    let (code, wider) = what_if(strs(&["add-cidr", "198.18.170.0/23"])).await;
    assert_eq!(code, 0, "{wider:#}");
    assert!(wider["overlaps"].as_array().is_some_and(|o| o.iter().any(|o| o["with"] == "servicecidr" && o["name"] == name.as_str())), "{wider:#}");
    assert_eq!((wider["new_ranges"][0]["static_band"].as_u64(), wider["new_ranges"][0]["used"].as_u64()), (Some(32), Some(1)), "{wider:#}");
    let (code, pods) = what_if(strs(&["add-cidr", "198.18.172.0/24"])).await;
    assert_eq!(code, 1, "{pods:#}");
    assert!(pods["overlaps"].as_array().is_some_and(|o| o.iter().any(|o| o["with"] == "pod-cidr" && o["name"] == node_name.as_str())), "{pods:#}");

    // Nothing changed.
    assert!(cidrs.get_opt(&name).await.expect("get").is_some());
    let _ = svcs.delete("in-extra", &DeleteParams::default()).await;
}
