//! The admission webhook in front of the real kube-apiserver: Services created through the
//! API get addresses from our ranges (198.19.0.0/17 and fd00:10:96::/113, strict subsets of
//! the apiserver's 198.19.0.0/16 and fd00:10:96::/112), and requests we cannot honour are
//! rejected with the error the client sees in Kubernetes' words.
//!
//! Each test runs its own controller process(es) with webhook configurations that select
//! only a namespace of the test's own, so nothing else in the cluster is affected.

use std::collections::BTreeSet;
use std::net::{IpAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
use k8s_openapi::api::core::v1::{Namespace, Service, ServicePort, ServiceSpec};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::Client;
use serde_json::json;

use clusterip_test_support::{control_plane, unique_name, ControlPlane};

const OUR_V4: &str = "198.19.0.0/17";
const OUR_V6: &str = "fd00:10:96::/113";

/// One burst at a time. Each test runs its own controllers with their own records, and they
/// all assign from the same ranges of one apiserver: two bursts side by side are two
/// independent allocators, which a real cluster never has (they could pick the same
/// address in the moment between one's answer and the apiserver's IPAddress record).
static BURST: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// A controller process and its webhook registration, removed on drop.
struct Webhook {
    children: Vec<Child>,
    name: String,
    namespace: String,
    client: Client,
}

impl Webhook {
    async fn start(cp: &ControlPlane, backend: &str) -> Webhook {
        Self::start_replicas(cp, backend, 1).await
    }

    /// `replicas` controller processes (identities replica-0, replica-1, …) sharing one
    /// backend and one leader Lease, behind a round-robin TCP proxy the webhook URL names.
    async fn start_replicas(cp: &ControlPlane, backend: &str, replicas: usize) -> Webhook {
        let client = cp.client().await;
        let name = unique_name("e2e");
        let pki = cp.dir().join("pki");
        let mut children = Vec::new();
        let mut ports = Vec::new();
        for i in 0..replicas {
            let (child, webhook_port, metrics_port) = spawn_controller(cp, backend, &name, i);
            children.push(child);
            ports.push(webhook_port);
            wait_ready(metrics_port).await;
        }
        let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("proxy listener");
        let webhook_port = proxy.local_addr().expect("proxy address").port();
        tokio::spawn(round_robin(proxy, ports));
        let mut wh = Webhook { children, name: name.clone(), namespace: name.clone(), client: client.clone() };

        let ca = std::fs::read(pki.join("ca.crt")).expect("dev CA");
        use base64::Engine as _;
        let ca = base64::engine::general_purpose::STANDARD.encode(ca);
        let selector = json!({"matchLabels": {"clusterip.allocator/e2e": name}});
        let rules = json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["services"], "scope": "Namespaced"}]);
        let mutating: MutatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": name},
            "webhooks": [{"name": "assign.clusterip.allocator", "clientConfig": {"url": format!("https://127.0.0.1:{webhook_port}/mutate"), "caBundle": ca},
                "rules": rules, "namespaceSelector": selector, "failurePolicy": "Fail", "sideEffects": "NoneOnDryRun",
                "admissionReviewVersions": ["v1"], "timeoutSeconds": 10}]
        }))
        .expect("mutating configuration");
        let validating: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": name},
            "webhooks": [{"name": "validate.clusterip.allocator", "clientConfig": {"url": format!("https://127.0.0.1:{webhook_port}/validate"), "caBundle": ca},
                "rules": rules, "namespaceSelector": selector, "failurePolicy": "Fail", "sideEffects": "None",
                "admissionReviewVersions": ["v1"], "timeoutSeconds": 10}]
        }))
        .expect("validating configuration");
        Api::<MutatingWebhookConfiguration>::all(client.clone()).create(&PostParams::default(), &mutating).await.expect("register mutating webhook");
        Api::<ValidatingWebhookConfiguration>::all(client.clone()).create(&PostParams::default(), &validating).await.expect("register validating webhook");
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name, "labels": {"clusterip.allocator/e2e": name}}})).expect("namespace");
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.expect("create namespace");
        wh.wait_registered().await;
        wh
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// The apiserver picks up webhook configurations asynchronously: create a probe Service
    /// until it carries our annotation.
    async fn wait_registered(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let name = unique_name("probe");
            if let Ok(svc) = self.services().create(&PostParams::default(), &service(&name, |_| {})).await {
                let _ = self.services().delete(&name, &DeleteParams::default()).await;
                if svc.metadata.annotations.unwrap_or_default().contains_key("clusterip.allocator/reserved") {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "webhook not called by the apiserver within 30s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Unregister and clean up from a fresh runtime (Drop cannot await).
        let (client, name) = (self.client.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async move {
                let dp = DeleteParams::default();
                let _ = Api::<MutatingWebhookConfiguration>::all(client.clone()).delete(&name, &dp).await;
                let _ = Api::<ValidatingWebhookConfiguration>::all(client.clone()).delete(&name, &dp).await;
                let _ = Api::<Service>::namespaced(client.clone(), &name).delete_collection(&dp, &ListParams::default()).await;
                let _ = Api::<Namespace>::all(client).delete(&name, &dp).await;
            });
        })
        .join();
    }
}

/// Start one controller replica; returns it with its webhook and metrics ports.
fn spawn_controller(cp: &ControlPlane, backend: &str, name: &str, replica: usize) -> (Child, u16, u16) {
    let pki = cp.dir().join("pki");
    let webhook_port = free_port();
    let metrics_port = free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_clusterip"));
    cmd.arg("controller")
        .args(["--backend", backend, "--service-cidr", &format!("{OUR_V4},{OUR_V6}")])
        .args(["--etcd-endpoints", &cp.etcd_endpoints().join(","), "--etcd-prefix", &format!("/clusterip-test/{name}")])
        .arg("--kubeconfig")
        .arg(cp.kubeconfig())
        .args(["--webhook-bind-address", &format!("127.0.0.1:{webhook_port}")])
        .args(["--metrics-bind-address", &format!("127.0.0.1:{metrics_port}")])
        .args(["--leader-elect-namespace", "default", "--leader-elect-lease-name", name])
        .args(["--leader-elect-identity", &format!("replica-{replica}")])
        .arg("--tls-cert-file")
        .arg(pki.join("webhook.crt"))
        .arg("--tls-private-key-file")
        .arg(pki.join("webhook.key"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null());
    (cmd.spawn().expect("start clusterip controller"), webhook_port, metrics_port)
}

/// Forward each connection to the next replica that accepts it (TLS passes through).
async fn round_robin(listener: tokio::net::TcpListener, ports: Vec<u16>) {
    let mut next = 0usize;
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else { continue };
        let mut target = None;
        for i in 0..ports.len() {
            if let Ok(s) = tokio::net::TcpStream::connect(("127.0.0.1", ports[(next + i) % ports.len()])).await {
                target = Some(s);
                break;
            }
        }
        next = next.wrapping_add(1);
        if let Some(mut outbound) = target {
            tokio::spawn(async move {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    }
}

async fn wait_ready(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = s.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
            let mut buf = Vec::new();
            let _ = s.read_to_end(&mut buf).await;
            if buf.starts_with(b"HTTP/1.1 200") {
                return;
            }
        }
        assert!(Instant::now() < deadline, "controller not ready within 60s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn service(name: &str, f: impl FnOnce(&mut ServiceSpec)) -> Service {
    let mut spec = ServiceSpec { ports: Some(vec![ServicePort { port: 80, ..Default::default() }]), ..Default::default() };
    f(&mut spec);
    Service { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, spec: Some(spec), ..Default::default() }
}

fn ips(svc: &Service) -> Vec<IpAddr> {
    svc.spec.as_ref().and_then(|s| s.cluster_ips.clone()).unwrap_or_default().iter().map(|s| s.parse().expect("clusterIP")).collect()
}

fn in_our_dynamic_band(ip: IpAddr) -> bool {
    match ip {
        // 198.19.0.0/17: the static band is the first 256 usable addresses (198.19.0.1–198.19.1.0).
        IpAddr::V4(v4) => {
            let n = u32::from(v4);
            n > u32::from(std::net::Ipv4Addr::new(198, 19, 1, 0)) && n < u32::from(std::net::Ipv4Addr::new(198, 19, 127, 255))
        }
        // fd00:10:96::/113: 32768 addresses, static band = the first 256 usable.
        IpAddr::V6(v6) => {
            let n = u128::from(v6);
            let base = u128::from("fd00:10:96::".parse::<std::net::Ipv6Addr>().unwrap());
            n > base + 256 && n <= base + 0x7fff
        }
    }
}

async fn expect_422(api: &Api<Service>, svc: &Service, contains: &str) {
    match api.create(&PostParams::default(), svc).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422, "status {s:?}");
            assert!(s.message.contains(contains), "message {:?} lacks {contains:?}", s.message);
        }
        other => panic!("expected a 422, got {other:?}"),
    }
}

async fn admission_cases(backend: &str) {
    // Static addresses of our static band, one pair per backend: the two backends' cases run
    // side by side against the same apiserver, where an address is cluster-wide.
    let (st, dry_ip) = if backend == "etcd" { ("198.19.0.77", "198.19.0.88") } else { ("198.19.0.78", "198.19.0.89") };
    let cp = control_plane();
    let wh = Webhook::start(&cp, backend).await;
    let api = wh.services();

    // Dynamic: from our dynamic band, patched in with families and policy.
    let svc = api.create(&PostParams::default(), &service("dynamic", |_| {})).await.expect("dynamic");
    let got = ips(&svc);
    assert_eq!(got.len(), 1);
    assert!(in_our_dynamic_band(got[0]), "{} is not in our dynamic band", got[0]);
    let spec = svc.spec.clone().unwrap_or_default();
    assert_eq!(spec.ip_families, Some(vec!["IPv4".to_string()]));
    assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
    // The address is recorded as the IPAddress named by it, with the Service as parentRef.
    let out = cp.kubectl().args(["get", "ipaddresses", &got[0].to_string(), "-o", "jsonpath={.spec.parentRef.resource}/{.spec.parentRef.namespace}/{.spec.parentRef.name}"]).output().expect("kubectl");
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("services/{}/dynamic", wh.namespace), "{}", String::from_utf8_lossy(&out.stderr));

    // Static: honoured (an address of our static band).
    let svc = api.create(&PostParams::default(), &service("static", |s| s.cluster_ip = Some(st.into()))).await.expect("static");
    assert_eq!(ips(&svc), vec![st.parse::<IpAddr>().unwrap()]);

    // Duplicate: the address the previous Service holds.
    expect_422(&api, &service("dup", |s| s.cluster_ip = Some(st.into())), &format!("failed to allocate IP {st}: provided IP is already allocated")).await;
    // Outside our ranges, though inside the apiserver's.
    expect_422(
        &api,
        &service("out", |s| s.cluster_ip = Some("198.19.200.5".into())),
        "spec.clusterIPs: Invalid value: []string{\"198.19.200.5\"}: failed to allocate IP 198.19.200.5: the provided IP (198.19.200.5) is not in the valid range. The range of valid IPs is 198.19.0.0/17",
    )
    .await;
    // Malformed: named.
    expect_422(&api, &service("bad", |s| s.cluster_ip = Some("198.19.010.5".into())), "198.19.010.5").await;

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
    assert!(in_our_dynamic_band(got[0]), "{} is not in our dynamic band", got[0]);

    // Dual-stack: one address per family, both ours.
    let svc = api
        .create(&PostParams::default(), &service("dual", |s| s.ip_family_policy = Some("RequireDualStack".into())))
        .await
        .expect("dual-stack");
    let got = ips(&svc);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got.iter().all(|ip| in_our_dynamic_band(*ip)), "{got:?}");
    assert!(got[0].is_ipv4() && got[1].is_ipv6());

    // Dry-run reserves nothing: the same static address twice in dry-run both pass.
    let dry = PostParams { dry_run: true, ..Default::default() };
    api.create(&dry, &service("dry1", |s| s.cluster_ip = Some(dry_ip.into()))).await.expect("dry-run 1");
    api.create(&dry, &service("dry2", |s| s.cluster_ip = Some(dry_ip.into()))).await.expect("dry-run 2");
    api.create(&PostParams::default(), &service("real88", |s| s.cluster_ip = Some(dry_ip.into()))).await.expect("after dry-runs the address is free");

    // Delete releases: the address of a deleted Service can be requested again once the
    // leader's Service reconciler has seen the delete.
    api.delete("static", &DeleteParams::default()).await.expect("delete");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match api.create(&PostParams::default(), &service("static-again", |s| s.cluster_ip = Some(st.into()))).await {
            Ok(svc) => {
                assert_eq!(ips(&svc), vec![st.parse::<IpAddr>().unwrap()]);
                break;
            }
            Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains("already allocated") => {
                assert!(Instant::now() < deadline, "{st} not released within 30s of its Service's deletion");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
}

async fn concurrent_creates(backend: &str, n: usize) {
    let _one_at_a_time = BURST.lock().await;
    let cp = control_plane();
    // Two replicas behind a round-robin proxy, as the Deployment runs them.
    let wh = Webhook::start_replicas(&cp, backend, 2).await;
    let api = wh.services();
    let results = futures::future::join_all((0..n).map(|i| {
        let api = api.clone();
        async move { api.create(&PostParams::default(), &service(&format!("burst-{i}"), |_| {})).await }
    }))
    .await;
    let mut seen = BTreeSet::new();
    for r in results {
        let svc = r.expect("every concurrent create succeeds");
        for ip in ips(&svc) {
            assert!(in_our_dynamic_band(ip), "{ip} outside our dynamic band");
            assert!(seen.insert(ip), "{ip} assigned twice");
        }
    }
    assert_eq!(seen.len(), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_admission() {
    admission_cases("etcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_500_concurrent_creates() {
    concurrent_creates("etcd", 500).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_admission() {
    admission_cases("ipaddress").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_500_concurrent_creates() {
    concurrent_creates("ipaddress", 500).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_leader_killed_during_a_burst() {
    leader_killed_during_a_burst("etcd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_leader_killed_during_a_burst() {
    leader_killed_during_a_burst("ipaddress").await;
}

async fn leader_killed_during_a_burst(backend: &str) {
    use k8s_openapi::api::coordination::v1::Lease;
    let _one_at_a_time = BURST.lock().await;
    let cp = control_plane();
    let mut wh = Webhook::start_replicas(&cp, backend, 2).await;
    let leases: Api<Lease> = Api::namespaced(wh.client.clone(), "default");
    let holder = |l: Option<Lease>| l.and_then(|l| l.spec).and_then(|s| s.holder_identity);
    let deadline = Instant::now() + Duration::from_secs(30);
    let leader = loop {
        if let Some(h) = holder(leases.get_opt(&wh.name).await.expect("read lease")) {
            break h;
        }
        assert!(Instant::now() < deadline, "no leader elected within 30s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let leader_index: usize = leader.trim_start_matches("replica-").parse().expect("replica identity");

    // A burst of creates; the leader is killed once a third of them are done.
    let api = wh.services();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ok = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let burst = tokio::spawn({
        let (api, done, ok) = (api.clone(), done.clone(), ok.clone());
        async move {
            futures::future::join_all((0..300).map(|i| {
                let (api, done, ok) = (api.clone(), done.clone(), ok.clone());
                async move {
                    let r = api.create(&PostParams::default(), &service(&format!("burst-{i}"), |_| {})).await;
                    if r.is_ok() {
                        ok.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    r
                }
            }))
            .await
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    while done.load(std::sync::atomic::Ordering::Relaxed) < 100 {
        assert!(Instant::now() < deadline, "burst made no progress");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (ok_before, done_before) = (ok.load(std::sync::atomic::Ordering::SeqCst), done.load(std::sync::atomic::Ordering::SeqCst));
    wh.children[leader_index].kill().expect("SIGKILL the leader");
    let results = burst.await.expect("burst task");

    let mut seen = BTreeSet::new();
    let mut failed = 0;
    for r in &results {
        match r {
            Ok(svc) => {
                for ip in ips(svc) {
                    assert!(seen.insert(ip), "{ip} assigned twice");
                }
            }
            // Requests in flight on the killed replica fail (failurePolicy Fail); never a 422.
            Err(kube::Error::Api(s)) => {
                assert_ne!(s.code, 422, "a collision or bad answer: {s:?}");
                failed += 1;
            }
            Err(e) => panic!("unexpected client error: {e}"),
        }
    }
    // Before the kill both replicas answer; after it, requests in flight on (or on a
    // connection to) the killed replica fail, how many depends on timing — but not a 422.
    assert!(ok_before * 10 >= done_before * 9, "only {ok_before} of the {done_before} creates before the kill succeeded");
    eprintln!("leader kill: {ok_before}/{done_before} succeeded before it; {} of 300 in all, {failed} failed", seen.len());

    // The other replica takes the Lease over and serves.
    let survivor = format!("replica-{}", 1 - leader_index);
    let deadline = Instant::now() + Duration::from_secs(60);
    while holder(leases.get_opt(&wh.name).await.expect("read lease")).as_deref() != Some(survivor.as_str()) {
        assert!(Instant::now() < deadline, "{survivor} did not take the Lease over within 60s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = api.create(&PostParams::default(), &service("after-failover", |_| {})).await.expect("create after failover");
    assert!(!seen.contains(&ips(&after)[0]), "a new Service got an address already in use");

    // No lost record: every address handed out is recorded — by the kube-apiserver as an
    // IPAddress (both backends), and in our etcd map (etcd backend).
    let ipaddresses: Api<k8s_openapi::api::networking::v1::IPAddress> = Api::all(wh.client.clone());
    for ip in &seen {
        assert!(ipaddresses.get_opt(&ip.to_string()).await.expect("read IPAddress").is_some(), "{ip} has no IPAddress");
    }
    if backend != "etcd" {
        return;
    }
    let store = clusterip::store::etcd::EtcdStore::open(
        &clusterip::store::etcd::EtcdConfig { endpoints: cp.etcd_endpoints(), prefix: format!("/clusterip-test/{}", wh.name), ..Default::default() },
        vec![clusterip::cidr::ServiceCidr::parse(OUR_V4).unwrap(), clusterip::cidr::ServiceCidr::parse(OUR_V6).unwrap()],
    )
    .await
    .expect("open the records");
    use clusterip::store::AllocationStore;
    let recorded: BTreeSet<IpAddr> = store.allocated().await.expect("records").into_iter().collect();
    let lost: Vec<_> = seen.difference(&recorded).collect();
    assert!(lost.is_empty(), "addresses of live Services missing from the records: {lost:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn servicecidr_finalizer_ready_and_terminating() {
    use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
    let cp = control_plane();
    let wh = Webhook::start(&cp, "etcd").await;
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
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let got = cidrs.get_opt(&name).await.expect("get ServiceCIDR");
                if f(&got) {
                    return got;
                }
                assert!(Instant::now() < deadline, "ServiceCIDR never became {what}: {got:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
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

    // Once the address is gone, the finalizer goes and so does the ServiceCIDR.
    addrs.delete("198.18.250.10", &DeleteParams::default()).await.expect("delete IPAddress");
    poll("deleted", Box::new(|sc| sc.is_none())).await;
}

/// The Service reconciler (on the leader) records an address in our range that a Service got
/// without our webhook (here: a namespace the webhook does not select), says so with a
/// Warning Event in Kubernetes' words, and releases it when the Service goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn service_reconciler_records_reports_and_releases() {
    use clusterip::store::etcd::{EtcdConfig, EtcdStore};
    use clusterip::store::AllocationStore;
    use k8s_openapi::api::events::v1::Event;
    let cp = control_plane();
    let wh = Webhook::start(&cp, "etcd").await;
    let api: Api<Service> = Api::namespaced(wh.client.clone(), "default");
    let name = unique_name("unrecorded");
    let ip: IpAddr = "198.19.0.123".parse().unwrap();
    api.create(&PostParams::default(), &service(&name, |s| s.cluster_ip = Some(ip.to_string()))).await.expect("create outside the webhook's namespaces");
    let cfg = EtcdConfig { endpoints: cp.etcd_endpoints(), prefix: format!("/clusterip-test/{}", wh.name), ..Default::default() };
    let store = EtcdStore::open(&cfg, vec![clusterip::cidr::ServiceCidr::parse(OUR_V4).unwrap(), clusterip::cidr::ServiceCidr::parse(OUR_V6).unwrap()])
        .await
        .expect("open the controller's records");
    let events: Api<Event> = Api::namespaced(wh.client.clone(), "default");
    let want = format!("Cluster IP [IPv4]: {ip} is not allocated; repairing");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let recorded = store.has(ip).await.unwrap_or(false);
        let listed = events.list(&ListParams::default()).await.expect("list events");
        let reported = listed.items.iter().any(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
                && e.reason.as_deref() == Some("ClusterIPNotAllocated")
                && e.type_.as_deref() == Some("Warning")
                && e.note.as_deref() == Some(want.as_str())
        });
        if recorded && reported {
            break;
        }
        assert!(Instant::now() < deadline, "within 30s: recorded={recorded}, event reported={reported}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    api.delete(&name, &DeleteParams::default()).await.expect("delete");
    let deadline = Instant::now() + Duration::from_secs(30);
    while store.has(ip).await.unwrap_or(true) {
        assert!(Instant::now() < deadline, "{ip} still recorded 30s after its Service was deleted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
