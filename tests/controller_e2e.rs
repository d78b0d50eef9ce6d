//! The admission webhook in front of the real kube-apiserver: Services created through the
//! API get addresses from our ranges (slices of 198.19.0.0/17 and fd00:10:96::/113, strict
//! subsets of the apiserver's 198.19.0.0/16 and fd00:10:96::/112), and requests we cannot
//! honour are rejected with the error the client sees in Kubernetes' words.
//!
//! Each test runs its own controller process(es) with webhook configurations that select
//! only a namespace of the test's own, so nothing else in the cluster is affected, and with
//! ranges of its own ([`Slice`]): tests run side by side, and two controllers with separate
//! records assigning from one range are two independent allocators, which a real cluster
//! never has.

mod controller_common;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
use k8s_openapi::api::core::v1::{Namespace, Service, ServicePort, ServiceSpec};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::Client;
use serde_json::json;

use clusterip_test_support::{block_on_drop, control_plane, free_leftover, unique_name, ControlPlane};
use controller_common::Controller;

/// The ranges one test's controllers assign from: slice `k` of our ranges, 198.19.8k.0/21
/// and fd00:10:96::(800·k)/117 (2048 addresses each; static band = the first 128). Slice 0
/// holds the fixed addresses other test files use (198.19.0.x, fd00:10:96::x) and is left out.
/// Slices 19 and 20 are the HA tests' (on control planes of their own; 16–18 overlap the
/// fidelity test's 198.19.120.0–198.19.144.63).
#[derive(Clone, Copy, Debug)]
struct Slice(u8);

impl Slice {
    fn v4(self) -> String {
        format!("198.19.{}.0/21", 8 * self.0 as u32)
    }

    fn v6(self) -> String {
        format!("fd00:10:96::{:x}/117", 0x800 * self.0 as u32)
    }

    /// The `n`-th address of the IPv4 slice (n ≤ 128: the static band).
    fn v4_static(self, n: u32) -> IpAddr {
        assert!((1..=128).contains(&n));
        IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 8 * self.0, 0)) + n))
    }

    /// Kubernetes' dynamic band of the slice: above the first 128 usable addresses.
    fn in_dynamic_band(self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(v4) => {
                let base = u32::from(Ipv4Addr::new(198, 19, 8 * self.0, 0));
                let n = u32::from(v4);
                n > base + 128 && n < base + 2047
            }
            IpAddr::V6(v6) => {
                let base = u128::from("fd00:10:96::".parse::<Ipv6Addr>().expect("v6 base")) + 0x800 * self.0 as u128;
                let n = u128::from(v6);
                n > base + 128 && n <= base + 2047
            }
        }
    }
}

/// A controller process and its webhook registration, removed on drop.
struct Webhook {
    children: Vec<Controller>,
    /// The replicas' webhook ports, and those the proxy forwards to now.
    ports: Vec<u16>,
    routes: tokio::sync::watch::Sender<Vec<u16>>,
    name: String,
    namespace: String,
    client: Client,
    slice: Slice,
    /// The ranges the controllers assign from ([`Harness::ranges`]).
    ranges: Vec<String>,
}

/// How a test's webhook is set up: [`Harness::new`] gives the defaults, which a test
/// changes in its tweak closure.
struct Harness {
    backend: String,
    slice: Slice,
    /// The ranges the controllers assign from, IPv4 first: the slice's, unless a test needs
    /// a small range (it must lie in the slice).
    ranges: Vec<String>,
    /// Controller flags besides the common ones ([`controller_common::controller_args`]):
    /// by default the client-certificate flags that accept only the kube-apiserver
    /// ([`controller_common::client_auth_args`]).
    flags: Vec<String>,
    /// One controller replica per kubeconfig, each reaching the apiserver its kubeconfig
    /// names (identities replica-0, replica-1, …); by default one, on the control plane's.
    kubeconfigs: Vec<std::path::PathBuf>,
}

impl Harness {
    fn new(cp: &ControlPlane, backend: &str, slice: Slice, tweak: impl FnOnce(&mut Harness)) -> Harness {
        let mut h = Harness {
            backend: backend.into(),
            slice,
            ranges: vec![slice.v4(), slice.v6()],
            flags: controller_common::client_auth_args(cp),
            kubeconfigs: vec![cp.kubeconfig()],
        };
        tweak(&mut h);
        h
    }

    /// `n` replicas on the first kubeconfig's apiserver.
    fn replicas(&mut self, n: usize) {
        self.kubeconfigs = vec![self.kubeconfigs[0].clone(); n];
    }

    /// Add controller flags.
    fn flags(&mut self, extra: &[&str]) {
        self.flags.extend(extra.iter().map(|s| s.to_string()));
    }
}

impl Webhook {
    async fn start(cp: &ControlPlane, backend: &str, slice: Slice) -> Webhook {
        Self::start_with(cp, backend, slice, |_| {}).await
    }

    /// The controllers' etcd records (etcd backend), opened as a store of their ranges
    /// under the prefix the harness gives them.
    async fn records(&self, cp: &ControlPlane) -> clusterip::store::etcd::EtcdStore {
        let cfg = clusterip::store::etcd::EtcdConfig { endpoints: cp.etcd_endpoints(), prefix: format!("/clusterip-test/{}", self.name), ..Default::default() };
        let cidrs = self.ranges.iter().map(|r| clusterip::cidr::ServiceCidr::parse(r).expect("the harness's range")).collect();
        clusterip::store::etcd::EtcdStore::open(&cfg, cidrs).await.expect("open the controllers' records")
    }

    /// The controllers of the harness `tweak` makes, sharing one backend and one leader
    /// Lease behind a round-robin TCP proxy the webhook URL names, once the apiserver calls
    /// the webhook.
    async fn start_with(cp: &ControlPlane, backend: &str, slice: Slice, tweak: impl FnOnce(&mut Harness)) -> Webhook {
        let mut wh = Self::register(cp, Harness::new(cp, backend, slice, tweak)).await;
        wh.wait_registered().await;
        wh
    }

    /// Forward new connections only to these replicas, and cut the open connections to the
    /// others (the apiserver reconnects, through the proxy, to one of these) — as a Service
    /// whose endpoint went away would, with the cut instead of a timeout.
    ///
    /// Returns once the apiserver calls the webhook through the new routes: a connection it
    /// had pooled and not yet seen closed when the cut came can take one more request, which
    /// fails in transport ("broken pipe"); that is this proxy's doing, not the webhook's.
    /// So rounds of 32 concurrent dry-run creates (the webhook answers them, nothing is
    /// stored) go until one round passes whole.
    async fn route_only(&self, replicas: &[usize]) {
        self.routes.send_replace(replicas.iter().map(|&i| self.ports[i]).collect());
        let api = self.services();
        let dry = PostParams { dry_run: true, ..Default::default() };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let round = futures::future::join_all((0..32).map(|i| {
                let (api, dry) = (api.clone(), dry.clone());
                async move { api.create(&dry, &service(&format!("route-probe-{i}"), |_| {})).await }
            }))
            .await;
            let Some(err) = round.into_iter().find_map(|r| r.err()) else { return };
            assert!(Instant::now() < deadline, "webhook calls through replicas {replicas:?} still fail 60s after re-routing: {err}");
        }
    }

    /// The controllers and the registration, without waiting for the apiserver to call the
    /// webhook.
    async fn register(cp: &ControlPlane, h: Harness) -> Webhook {
        let slice = h.slice;
        let client = cp.client().await;
        let name = unique_name("e2e");
        let pki = cp.dir().join("pki");
        remove_leftover_blocks(&client, slice).await;
        let mut children = Vec::new();
        let mut ports = Vec::new();
        for i in 0..h.kubeconfigs.len() {
            let c = spawn_controller(cp, &h, &name, i);
            c.wait_ready().await;
            ports.push(c.webhook_port);
            children.push(c);
        }
        let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("proxy listener");
        let webhook_port = proxy.local_addr().expect("proxy address").port();
        let (routes, routed) = tokio::sync::watch::channel(ports.clone());
        tokio::spawn(round_robin(proxy, routed));
        let wh = Webhook { children, ports, routes, name: name.clone(), namespace: name.clone(), client: client.clone(), slice, ranges: h.ranges };

        let ca = std::fs::read(pki.join("ca.crt")).expect("dev CA");
        use base64::Engine as _;
        let ca = base64::engine::general_purpose::STANDARD.encode(ca);
        let selector = json!({"matchLabels": {"clusterip.allocator/e2e": name}});
        let rules = json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["services"], "scope": "Namespaced"}]);
        let mutating: MutatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": name},
            "webhooks": [{"name": "assign.clusterip.allocator", "clientConfig": {"url": format!("https://127.0.0.1:{webhook_port}/mutate"), "caBundle": ca},
                "rules": rules, "namespaceSelector": selector, "failurePolicy": "Fail", "sideEffects": "NoneOnDryRun",
                "admissionReviewVersions": ["v1"], "timeoutSeconds": 30}]
        }))
        .expect("mutating configuration");
        let validating: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": name},
            "webhooks": [{"name": "validate.clusterip.allocator", "clientConfig": {"url": format!("https://127.0.0.1:{webhook_port}/validate"), "caBundle": ca},
                "rules": rules, "namespaceSelector": selector, "failurePolicy": "Fail", "sideEffects": "None",
                "admissionReviewVersions": ["v1"], "timeoutSeconds": 30}]
        }))
        .expect("validating configuration");
        Api::<MutatingWebhookConfiguration>::all(client.clone()).create(&PostParams::default(), &mutating).await.expect("register mutating webhook");
        Api::<ValidatingWebhookConfiguration>::all(client.clone()).create(&PostParams::default(), &validating).await.expect("register validating webhook");
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name, "labels": {"clusterip.allocator/e2e": name}}})).expect("namespace");
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.expect("create namespace");
        wh
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// The apiserver picks up webhook configurations asynchronously: probe with a dry-run
    /// create (nothing is allocated by anyone) of an address inside the apiserver's range but
    /// outside ours, which only our webhook refuses, until it does.
    async fn wait_registered(&mut self) {
        self.wait_called_through(&self.services()).await;
    }

    /// [`wait_registered`](Self::wait_registered) through `api` (another apiserver's client).
    async fn wait_called_through(&self, api: &Api<Service>) {
        let dry = PostParams { dry_run: true, ..Default::default() };
        // Outside every range any test's controller allocates from (also the cluster's own
        // 198.19.0.0/16, which a controller following ServiceCIDR objects serves).
        let probe = service("probe", |s| s.cluster_ip = Some("198.18.199.5".into()));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match api.create(&dry, &probe).await {
                Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains(&format!("The range of valid IPs is {}", self.v4_range())) => return,
                Ok(_) => {}
                Err(e) => panic!("probing the webhook registration: {e}"),
            }
            assert!(Instant::now() < deadline, "webhook not called by the apiserver within 60s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn in_dynamic_band(&self, ip: IpAddr) -> bool {
        self.slice.in_dynamic_band(ip)
    }

    /// The IPv4 range the controllers assign from.
    fn v4_range(&self) -> &str {
        self.ranges.iter().find(|r| !r.contains(':')).map(String::as_str).unwrap_or_default()
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        for c in &mut self.children {
            c.kill();
        }
        // Unregister and clean up from a fresh runtime (Drop cannot await).
        let (client, name) = (self.client.clone(), self.name.clone());
        block_on_drop(async move {
            let dp = DeleteParams::default();
            let _ = Api::<MutatingWebhookConfiguration>::all(client.clone()).delete(&name, &dp).await;
            let _ = Api::<ValidatingWebhookConfiguration>::all(client.clone()).delete(&name, &dp).await;
            let _ = Api::<Service>::namespaced(client.clone(), &name).delete_collection(&dp, &ListParams::default()).await;
            let _ = Api::<Namespace>::all(client).delete(&name, &dp).await;
        });
    }
}

/// Start controller replica `replica` of the harness (it picks its own ports).
fn spawn_controller(cp: &ControlPlane, h: &Harness, name: &str, replica: usize) -> Controller {
    let base = controller_common::controller_args(cp, &h.backend, &h.ranges.join(","), name, "default", &format!("replica-{replica}"), &h.kubeconfigs[replica]);
    Controller::start(h.flags.iter().cloned().chain(base))
}

/// Forward each connection to the next routed replica that accepts it (TLS passes
/// through); a connection to a replica taken out of the routes is cut.
async fn round_robin(listener: tokio::net::TcpListener, routes: tokio::sync::watch::Receiver<Vec<u16>>) {
    let mut next = 0usize;
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else { continue };
        let ports = routes.borrow().clone();
        let mut target = None;
        for i in 0..ports.len() {
            let port = ports[(next + i) % ports.len()];
            if let Ok(s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                target = Some((port, s));
                break;
            }
        }
        next = next.wrapping_add(1);
        if let Some((port, mut outbound)) = target {
            let mut routes = routes.clone();
            tokio::spawn(async move {
                let unrouted = async {
                    while routes.changed().await.is_ok() {
                        if !routes.borrow().contains(&port) {
                            return;
                        }
                    }
                    std::future::pending::<()>().await
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    _ = unrouted => {}
                }
            });
        }
    }
}

/// Block Leases (ipaddress backend) of an earlier run's controllers for `slice`, all dead
/// (they die with their test): deleted, so that this run's replicas find free blocks.
async fn remove_leftover_blocks(client: &Client, slice: Slice) {
    use clusterip::cidr::ServiceCidr;
    use k8s_openapi::api::coordination::v1::Lease;
    let ours = [ServiceCidr::parse(&slice.v4()).expect("v4 slice"), ServiceCidr::parse(&slice.v6()).expect("v6 slice")];
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let Ok(list) = leases.list(&ListParams::default().labels(clusterip::store::ipaddress::blocks::BLOCK_LABEL)).await else { return };
    for l in list.items {
        let range = l.metadata.annotations.as_ref().and_then(|a| a.get(clusterip::store::ipaddress::blocks::RANGE_ANNOTATION)).and_then(|r| ServiceCidr::parse(r).ok());
        if range.is_some_and(|r| ours.contains(&r)) {
            if let Some(name) = l.metadata.name.as_deref() {
                let _ = leases.delete(name, &DeleteParams::default()).await;
            }
        }
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

async fn expect_422(api: &Api<Service>, svc: &Service, contains: &str) {
    match api.create(&PostParams::default(), svc).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422, "status {s:?}");
            assert!(s.message.contains(contains), "message {:?} lacks {contains:?}", s.message);
        }
        other => panic!("expected a 422, got {other:?}"),
    }
}

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
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match api.create(&PostParams::default(), &service("static-again", |s| s.cluster_ip = Some(st.into()))).await {
            Ok(svc) => {
                assert_eq!(ips(&svc), vec![st.parse::<IpAddr>().unwrap()]);
                break;
            }
            Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains("already allocated") => {
                assert!(Instant::now() < deadline, "{st} not released within 120s of its Service's deletion");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
}

/// Stock Kubernetes' own race after a delete: the kube-apiserver's IPAddress repair
/// controller reads Services and IPAddresses from two caches, and when the deletion of a
/// just-deleted Service's IPAddress reaches its cache before the Service's own deletion does,
/// it creates the IPAddress again for the Service it still sees (a Warning
/// `ClusterIPNotAllocated` on that Service, reported by `ipallocator-repair-controller`), and
/// deletes it as leaked 60 s later. Meanwhile stock refuses a create of that address as
/// "already allocated", as our webhook does. Whether that is why `ip` is held: such an Event
/// for `service` naming `ip` (looked for up to 10 s: Events are written asynchronously).
async fn stock_repair_holds(client: &Client, namespace: &str, service: &str, ip: IpAddr) -> bool {
    use k8s_openapi::api::events::v1::Event;
    let events: Api<Event> = Api::namespaced(client.clone(), namespace);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = events.list(&ListParams::default()).await.map(|l| {
            l.items.iter().any(|e| {
                e.reason.as_deref() == Some("ClusterIPNotAllocated")
                    && e.reporting_controller.as_deref() == Some("ipallocator-repair-controller")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(service)
                    && e.note.as_deref().is_some_and(|n| n.contains(&ip.to_string()))
            })
        });
        if found.unwrap_or(false) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Wait until no IPAddress records `ip` (read from storage).
async fn wait_unrecorded(client: &Client, ip: IpAddr, limit: Duration) {
    use k8s_openapi::api::networking::v1::IPAddress;
    let addrs: Api<IPAddress> = Api::all(client.clone());
    let deadline = Instant::now() + limit;
    while addrs.get_opt(&ip.to_string()).await.expect("read IPAddress").is_some() {
        assert!(Instant::now() < deadline, "{ip} still recorded after {limit:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// When an address is held, as stock Kubernetes holds it: from the moment a Service holding
/// it is stored until the moment it no longer holds it. Requests that fail after our webhook
/// answered hold nothing a retry trips over; delete, ExternalName and a new request of the
/// same address follow each other at once.
async fn lifecycle_cases(backend: &str, slice: Slice) {
    let cp = control_plane();
    // A short in-flight limit, so an answered address whose request failed comes back
    // within the test. The limit must exceed the kube-apiserver's request timeout, which the
    // controller cannot read: the dev apiserver keeps Kubernetes' 60 s, and the test states
    // the bound its own requests meet (a Service create on a quiet cluster: well under 5 s),
    // as an operator states the cluster's.
    let wh = Webhook::start_with(&cp, backend, slice, |h| {
        h.flags(&["--in-flight-limit", "20s", "--apiserver-request-timeout", "5s"])
    })
    .await;
    let api = wh.services();
    let create = |svc: Service| {
        let api = api.clone();
        async move { api.create(&PostParams::default(), &svc).await }
    };
    let with_ip = |name: &str, ip: IpAddr| service(name, |s| s.cluster_ip = Some(ip.to_string()));
    // A request our webhook admits and the apiserver's validation then refuses (port 0).
    let failing = |name: &str, ip: Option<IpAddr>| {
        service(name, |s| {
            s.cluster_ip = ip.map(|ip| ip.to_string());
            s.ports = Some(vec![ServicePort { port: 0, ..Default::default() }]);
        })
    };
    let expect_invalid_port = |r: Result<Service, kube::Error>| match r {
        Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains("spec.ports[0].port") => {}
        other => panic!("expected the apiserver's 422 on spec.ports[0].port, got {other:?}"),
    };

    // 1. A failed create, retried at once by the same Service and by another one.
    let a = slice.v4_static(11);
    expect_invalid_port(create(failing("retried", Some(a))).await);
    let svc = create(with_ip("retried", a)).await.expect("the same Service, retried with the same address");
    assert_eq!(ips(&svc), vec![a]);
    let b = slice.v4_static(12);
    expect_invalid_port(create(failing("failed-first", Some(b))).await);
    let svc = create(with_ip("another", b)).await.expect("another Service, asking for the address a failed create asked for");
    assert_eq!(ips(&svc), vec![b]);

    // 2. Delete, then create again with the same address: 20 times in a row, at once.
    let c = slice.v4_static(13);
    // A create right after a delete, refused only for the stock race `stock_repair_holds`
    // describes (then stock refuses it too): the test waits that out and creates again.
    let create_after_delete = |name: &'static str, previous: &'static str, what: String| {
        let (create, client, ns) = (create, wh.client.clone(), wh.namespace.clone());
        async move {
            match create(with_ip(name, c)).await {
                Ok(svc) => svc,
                Err(kube::Error::Api(e)) if e.code == 422 && e.message.contains("provided IP is already allocated") => {
                    assert!(stock_repair_holds(&client, &ns, previous, c).await, "{what}: create with {c} refused, and not for the kube-apiserver's own repair race: {e:?}");
                    eprintln!("{what}: the kube-apiserver's repair controller re-created {c} for the deleted {previous}; waiting for it to clean up");
                    wait_unrecorded(&client, c, Duration::from_secs(120)).await;
                    create(with_ip(name, c)).await.unwrap_or_else(|e| panic!("{what}: create with {c} once the apiserver released it: {e}"))
                }
                Err(e) => panic!("{what}: create with {c}: {e}"),
            }
        }
    };
    for round in 0..20 {
        let svc = create_after_delete("again", "again", format!("round {round}")).await;
        assert_eq!(ips(&svc), vec![c]);
        api.delete("again", &DeleteParams::default()).await.unwrap_or_else(|e| panic!("round {round}: delete: {e}"));
    }
    // A deleted Service's address is free for any Service at once.
    let svc = create_after_delete("successor", "again", "another Service, right after the delete".into()).await;
    assert_eq!(ips(&svc), vec![c]);

    // 3. ClusterIP → ExternalName → ClusterIP, with the old address and then with a new one;
    //    the address given up is free for another Service at once.
    let (d, e) = (slice.v4_static(14), slice.v4_static(15));
    create(with_ip("flip", d)).await.expect("ClusterIP Service");
    let to_external = kube::api::Patch::Merge(json!({"spec": {"type": "ExternalName", "externalName": "example.invalid"}}));
    let to_cluster_ip = |ip: IpAddr| kube::api::Patch::Merge(json!({"spec": {"type": "ClusterIP", "externalName": null, "clusterIP": ip.to_string(), "ports": [{"port": 80}]}}));
    let pp = kube::api::PatchParams::default();
    api.patch("flip", &pp, &to_external).await.expect("to ExternalName");
    let svc = api.patch("flip", &pp, &to_cluster_ip(d)).await.expect("back to ClusterIP with the old address");
    assert_eq!(ips(&svc), vec![d]);
    api.patch("flip", &pp, &to_external).await.expect("to ExternalName again");
    let svc = create(with_ip("taker", d)).await.expect("another Service takes the address given up");
    assert_eq!(ips(&svc), vec![d]);
    let svc = api.patch("flip", &pp, &to_cluster_ip(e)).await.expect("back to ClusterIP with a new address");
    assert_eq!(ips(&svc), vec![e]);

    if backend == "etcd" {
        etcd_records_follow_the_services(&cp, &wh, slice, [a, b, c, d, e]).await;
    }
}

/// The etcd backend's records end up as the Services are: the addresses held recorded,
/// what was given up or never stored released (an answered dynamic address included, after
/// the in-flight limit), and an address with a recorded owner other than a Service neither
/// taken by a Service nor released by the repair pass or by anyone but its owner.
async fn etcd_records_follow_the_services(cp: &ControlPlane, wh: &Webhook, slice: Slice, held: [IpAddr; 5]) {
    use clusterip::repair::{Repairer, Target};
    use clusterip::store::{AllocationStore, ParentRef, StoreError};
    use std::sync::Arc;
    let store: Arc<dyn AllocationStore> = Arc::new(wh.records(cp).await);
    let api = wh.services();
    let static_band: BTreeSet<IpAddr> = (1..=128).map(|n| slice.v4_static(n)).collect();
    let recorded_static = || async { store.allocated().await.expect("allocated").into_iter().filter(|ip| static_band.contains(ip)).collect::<BTreeSet<_>>() };
    // Held now: a (retried), b (another), c (successor), d (taker), e (flip).
    let want: BTreeSet<IpAddr> = held.into_iter().collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let got = recorded_static().await;
        if got == want {
            break;
        }
        assert!(Instant::now() < deadline, "the static band's records {got:?} are not the addresses the Services hold {want:?} within 120s");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // A dynamic address answered for a create that then fails is released as soon as the
    // apiserver releases its own record of it, as stock frees it: nothing is left recorded.
    let before: BTreeSet<IpAddr> = store.allocated().await.expect("allocated").into_iter().collect();
    let released_before = released_by_apiserver(&wh.children[0]).await;
    let failed = service("failed-dynamic", |s| s.ports = Some(vec![ServicePort { port: 0, ..Default::default() }]));
    assert!(api.create(&PostParams::default(), &failed).await.is_err(), "a create with port 0 succeeded");
    wait_released(&wh.children[0], released_before + 1, "the failed create's address released").await;
    let now: BTreeSet<IpAddr> = store.allocated().await.expect("allocated").into_iter().collect();
    assert!(now.is_subset(&before), "recorded after the failed create: {:?}", now.difference(&before).collect::<Vec<_>>());
    // The in-flight limit (20 s here) passes — time is the subject, hence the sleep — and the
    // addresses stored Services hold are still recorded.
    tokio::time::sleep(Duration::from_secs(25)).await;
    assert_eq!(recorded_static().await, want, "an address a stored Service holds was released");

    // An owner other than a Service.
    let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: "edge".into() };
    let f = slice.v4_static(16);
    store.allocate(f, Some(&gateway)).await.expect("record an address for a Gateway");
    assert_eq!(store.owner(f).await.expect("owner"), Some(gateway.clone()));
    expect_422(&api, &service("squatter", |s| s.cluster_ip = Some(f.to_string())), &format!("failed to allocate IP {f}: provided IP is already allocated")).await;
    let client = cp.client().await;
    let mut repairer = Repairer::new(client, Target::Etcd(store.clone()));
    for pass in 0..4 {
        repairer.run_once(true, true, None).await.unwrap_or_else(|e| panic!("repair pass {pass}: {e}"));
        assert!(store.has(f).await.expect("has"), "repair pass {pass} released the Gateway's address");
    }
    let other = ParentRef { name: "other".into(), ..gateway.clone() };
    assert!(matches!(store.release(f).await, Err(StoreError::NotOwner { .. })), "an unowned release took the Gateway's address");
    assert!(matches!(store.release_owned(f, &other).await, Err(StoreError::NotOwner { .. })), "another owner released the Gateway's address");
    assert!(store.has(f).await.expect("has"));
    store.release_owned(f, &gateway).await.expect("the owner releases");
    assert!(!store.has(f).await.expect("has"));
    assert_eq!(store.owner(f).await.expect("owner"), None);
    let svc = api.create(&PostParams::default(), &service("after-gateway", |s| s.cluster_ip = Some(f.to_string()))).await.expect("the address, once its owner released it");
    assert_eq!(ips(&svc), vec![f]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_address_lifecycle() {
    lifecycle_cases("etcd", Slice(11)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_address_lifecycle() {
    lifecycle_cases("ipaddress", Slice(12)).await;
}

/// One burst at a time: the bursts' ranges are disjoint, but four 500-create bursts at once
/// would measure the machine, not the webhook.
static BURST: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn concurrent_creates(backend: &str, n: usize, slice: Slice) {
    let _one_at_a_time = BURST.lock().await;
    let cp = control_plane();
    // Two replicas behind a round-robin proxy, as the Deployment runs them.
    let wh = Webhook::start_with(&cp, backend, slice, |h| h.replicas(2)).await;
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
            assert!(wh.in_dynamic_band(ip), "{ip} outside our dynamic band");
            assert!(seen.insert(ip), "{ip} assigned twice");
        }
    }
    assert_eq!(seen.len(), n);
}

/// Addresses `c` released as the kube-apiserver released its own record of them
/// (`clusterip_webhook_released_addresses_total{reason="apiserver_released"}`).
async fn released_by_apiserver(c: &Controller) -> usize {
    let text = clusterip_test_support::local_get(c.metrics_port, "/metrics").await.map(|(_, b)| b).unwrap_or_default();
    controller_common::metric(&text, "clusterip_webhook_released_addresses_total{reason=\"apiserver_released\"}").unwrap_or(0.0) as usize
}

/// Wait (60 s at most) until `c` has released at least `n` addresses that way.
async fn wait_released(c: &Controller, n: usize, what: &str) {
    clusterip_test_support::eventually(what, Duration::from_secs(60), || async move { released_by_apiserver(c).await >= n }).await;
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_admission() {
    admission_cases("etcd", Slice(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_500_concurrent_creates() {
    concurrent_creates("etcd", 500, Slice(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_admission() {
    admission_cases("ipaddress", Slice(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_500_concurrent_creates() {
    concurrent_creates("ipaddress", 500, Slice(4)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_leader_killed_during_a_burst() {
    leader_killed_during_a_burst("etcd", Slice(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_leader_killed_during_a_burst() {
    leader_killed_during_a_burst("ipaddress", Slice(6)).await;
}

/// Replica 0 is paused (SIGSTOP) for longer than its blocks' lease; replica 1 keeps
/// answering, and takes one of replica 0's blocks over once it has seen its Lease unchanged
/// for the lease duration. Replica 0 is resumed and answers again: never from the block it
/// lost (it stopped answering from it a margin before the takeover was possible). Every
/// create succeeds and no address is given twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_paused_replica_never_answers_from_a_block_taken_over() {
    use k8s_openapi::api::coordination::v1::Lease;
    let _one_at_a_time = BURST.lock().await;
    let cp = control_plane();
    let slice = Slice(13);
    // D = 12 s, M = 6 s, as issue 32's figures: M must exceed the apiserver's request
    // timeout, stated here as the 5 s bound this test's requests meet (the dev apiserver
    // keeps 60 s; see lifecycle_cases).
    let flags = [
        "--address-block-size",
        "32",
        "--address-block-lease-duration",
        "12s",
        "--address-block-margin",
        "6s",
        "--apiserver-request-timeout",
        "5s",
    ];
    let wh = Webhook::start_with(&cp, "ipaddress", slice, |h| {
        h.replicas(2);
        h.flags(&flags);
    })
    .await;
    let api = wh.services();
    let leases: Api<Lease> = Api::namespaced(wh.client.clone(), "default");
    let v4 = clusterip::cidr::ServiceCidr::parse(&slice.v4()).expect("v4 slice");
    let holders = || async {
        let mut out = std::collections::BTreeMap::new();
        for l in leases.list(&ListParams::default().labels(clusterip::store::ipaddress::blocks::BLOCK_LABEL)).await.expect("list block Leases").items {
            let name = l.metadata.name.clone().unwrap_or_default();
            if name.starts_with(&clusterip::store::ipaddress::blocks::block_name(&v4, 0).trim_end_matches("-0").to_string()) {
                out.insert(name, l.spec.and_then(|s| s.holder_identity).unwrap_or_default());
            }
        }
        out
    };
    let burst = |prefix: String, n: usize| {
        let api = api.clone();
        async move {
            futures::future::join_all((0..n).map(|i| {
                let (api, name) = (api.clone(), format!("{prefix}-{i}"));
                async move { api.create(&PostParams::default(), &service(&name, |_| {})).await.expect("every create succeeds") }
            }))
            .await
        }
    };
    let mut created = burst("warm".into(), 20).await.len();
    let paused: Vec<String> = holders().await.into_iter().filter(|(_, h)| h.starts_with("replica-0/")).map(|(n, _)| n).collect();
    assert!(!paused.is_empty(), "replica 0 holds no IPv4 block: {:?}", holders().await);

    wh.route_only(&[1]).await;
    wh.children[0].signal(libc::SIGSTOP);
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut round = 0;
    loop {
        created += burst(format!("during-{round}"), 16).await.len();
        round += 1;
        let now = holders().await;
        if paused.iter().any(|n| now.get(n).is_some_and(|h| h.starts_with("replica-1/"))) {
            break;
        }
        assert!(Instant::now() < deadline, "replica 1 took none of {paused:?} over within 300s: {now:?}");
    }
    wh.children[0].signal(libc::SIGCONT);
    wh.route_only(&[0]).await;
    created += burst("after".into(), 64).await.len();
    wh.route_only(&[0, 1]).await;

    let mut seen = BTreeSet::new();
    let all = api.list(&ListParams::default()).await.expect("list Services").items;
    for svc in &all {
        for ip in ips(svc) {
            assert!(seen.insert(ip), "{ip} assigned twice");
        }
    }
    assert_eq!(all.len(), created, "every create succeeded");
}

/// Two replicas share a /25 (126 addresses, 8-address blocks by default) to its last
/// address. Replica 0 answers 100 creates and holds most blocks; then replica 1 alone: its
/// own block and the last free one are soon used up, and it answers on from blocks replica
/// 0 hands over when asked — all but at most one block, the last one replica 0 answered
/// from. Then replica 0 alone fills what it kept. Every address of the range is given once,
/// and "range is full" comes only when the range is.
///
/// Before blocks could be handed over, replica 1 answered "range is full" once its own and
/// the free blocks were used up (`scripts/test-node.sh` on its /25, 2026-11-26).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_two_replicas_share_a_small_range_to_its_last_address() {
    let _one_at_a_time = BURST.lock().await;
    let cp = control_plane();
    let slice = Slice(23);
    let range = clusterip::cidr::ServiceCidr::parse("198.19.184.0/25").expect("range");
    let wh = Webhook::start_with(&cp, "ipaddress", slice, |h| {
        h.replicas(2);
        h.ranges = vec![range.to_string()];
    })
    .await;
    let api = wh.services();
    // Creates one at a time until `limit` succeeded or one failed; the failure's message.
    let fill = |prefix: &'static str, limit: usize| {
        let api = api.clone();
        async move {
            let mut got = Vec::new();
            for i in 0..limit {
                match api.create(&PostParams::default(), &service(&format!("{prefix}-{i}"), |_| {})).await {
                    Ok(svc) => got.extend(ips(&svc)),
                    Err(e) => return (got, Some(e.to_string())),
                }
            }
            (got, None)
        }
    };
    let size = range.size() as usize;
    wh.route_only(&[0]).await;
    let (first, err) = fill("zero", 100).await;
    assert_eq!((first.len(), &err), (100, &None), "replica 0 alone: 100 creates succeed");
    wh.route_only(&[1]).await;
    let (second, err) = fill("one", size).await;
    let err = err.expect("replica 1 alone does not fill the range past what replica 0 keeps");
    assert!(err.contains("range is full"), "replica 1's refusal: {err}");
    assert!(second.len() + 8 >= size - first.len(), "replica 1 answered {} of the {} addresses left: more than one block short (nothing handed over?); refused with {err}", second.len(), size - first.len());
    wh.route_only(&[0]).await;
    let (third, err) = fill("zero-again", size).await;
    let err = err.expect("the range is full at last");
    assert!(err.contains("range is full"), "replica 0's refusal: {err}");

    let all: Vec<IpAddr> = first.iter().chain(&second).chain(&third).copied().collect();
    let unique: BTreeSet<IpAddr> = all.iter().copied().collect();
    assert_eq!(unique.len(), all.len(), "an address was given twice");
    assert!(all.iter().all(|ip| range.contains(*ip)), "an address outside {range}");
    assert_eq!(all.len(), size, "every address of {range} given once ({} + {} + {})", first.len(), second.len(), third.len());
}

/// The etcd backend's address pool under a pause: replica 0 is stopped (SIGSTOP) past its
/// etcd lease, so its pool key expires and the repair pass (on replica 1, the leader by
/// then) releases the addresses it pooled; replica 1 then fills the range — a /26, 62
/// addresses — so those addresses now belong to Services. Replica 0, resumed, must answer
/// "range is full": an address from the pool it lost would be a second owner (the apiserver
/// would refuse it as already allocated, and the test would see that 422).
///
/// Two things stop it, and this test shows their sum, not each: the resumed replica's
/// keep-alive finds the lease gone and drops the pool, and every hand-out checks that the
/// lease has more than the margin left (`live_lease`, unit-tested in etcd_pool.rs). With the
/// second disabled this test still passed (2026-11-26): the first came before any request
/// reached the resumed replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_paused_replica_never_hands_out_a_pooled_address_it_lost() {
    use clusterip::store::etcd::pool::{decode_pool, pool_member};
    use std::collections::BTreeMap;
    let _one_at_a_time = BURST.lock().await;
    let cp = control_plane();
    let slice = Slice(16);
    let range = "198.19.128.0/26";
    let wh = Webhook::start_with(&cp, "etcd", slice, |h| {
        h.replicas(2);
        h.ranges = vec![range.to_string()];
        h.flags(&["--repair-interval", "1s"]);
    })
    .await;
    let api = wh.services();
    let etcd = etcd_client::Client::connect(cp.etcd_endpoints(), None).await.expect("connect to etcd");
    let prefix = format!("/clusterip-test/{}/", wh.name);
    // Each replica's pooled addresses, by its member name (its pool keys are
    // `<range key>/pool/<member>/<chunk>`).
    let pools = || {
        let (mut etcd, prefix) = (etcd.clone(), prefix.clone());
        async move {
            let resp = etcd.get(prefix.as_str(), Some(etcd_client::GetOptions::new().with_prefix())).await.expect("read the controller's keys");
            let mut by_member = BTreeMap::<String, BTreeSet<IpAddr>>::new();
            for kv in resp.kvs() {
                let Some((_, name)) = kv.key_str().ok().and_then(|k| k.split_once("/pool/")) else { continue };
                by_member.entry(pool_member(name).to_string()).or_default().extend(decode_pool(kv.value()));
            }
            by_member
        }
    };
    // Both replicas pool addresses once they run (a /26's dynamic band of 46 gives each 5).
    let deadline = Instant::now() + Duration::from_secs(60);
    let before = loop {
        let p = pools().await;
        if p.len() == 2 && p.values().all(|a| !a.is_empty()) {
            break p;
        }
        assert!(Instant::now() < deadline, "two filled pools never appeared: {p:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    wh.route_only(&[1]).await;
    wh.children[0].signal(libc::SIGSTOP);
    // Replica 0's pool keys go with its lease (30 s): the member that disappears is replica 0.
    let deadline = Instant::now() + Duration::from_secs(180);
    let lost: BTreeSet<IpAddr> = loop {
        let now = pools().await;
        if let Some((_, addrs)) = before.iter().find(|(k, _)| !now.contains_key(*k)) {
            break addrs.clone();
        }
        assert!(Instant::now() < deadline, "no pool key expired within 180s of the pause: {now:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // The repair pass releases them (unowned records, after three passes).
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let store = wh.records(&cp).await;
        use clusterip::store::AllocationStore;
        let mut held = Vec::new();
        for ip in &lost {
            if store.has(*ip).await.expect("read the records") {
                held.push(*ip);
            }
        }
        if held.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the paused replica's pooled addresses {held:?} were not released within 180s");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Replica 1 fills the range.
    let mut filled = 0;
    loop {
        match api.create(&PostParams::default(), &service(&format!("fill-{filled}"), |_| {})).await {
            Ok(_) => filled += 1,
            Err(kube::Error::Api(s)) if s.code == 500 && s.message.contains("range is full") => break,
            Err(e) => panic!("filling the range through replica 1: {e}"),
        }
        assert!(filled <= 62, "more than a /26's 62 addresses given");
    }
    let held: BTreeSet<IpAddr> = api.list(&ListParams::default()).await.expect("list Services").items.iter().flat_map(ips).collect();
    let reused: Vec<_> = lost.iter().filter(|ip| held.contains(ip)).collect();
    assert_eq!(reused.len(), lost.len(), "the paused replica's lost pool {lost:?} was not all given to Services ({filled} created): the test proves nothing");

    wh.children[0].signal(libc::SIGCONT);
    wh.route_only(&[0]).await;
    for i in 0..10 {
        match api.create(&PostParams::default(), &service(&format!("after-{i}"), |_| {})).await {
            Err(kube::Error::Api(s)) if s.code == 500 && s.message.contains("range is full") => {}
            other => panic!("the resumed replica answered something other than 'range is full' in a full range (an address from the pool it lost?): {other:?}"),
        }
    }
    wh.route_only(&[0, 1]).await;
    eprintln!("paused replica: {} pooled addresses lost and given to Services through replica 1; 10 creates through the resumed replica all refused as full", lost.len());
}

async fn leader_killed_during_a_burst(backend: &str, slice: Slice) {
    use k8s_openapi::api::coordination::v1::Lease;
    let _one_at_a_time = BURST.lock().await;
    let cp = control_plane();
    let mut wh = Webhook::start_with(&cp, backend, slice, |h| h.replicas(2)).await;
    let leases: Api<Lease> = Api::namespaced(wh.client.clone(), "default");
    let holder = |l: Option<Lease>| l.and_then(|l| l.spec).and_then(|s| s.holder_identity);
    let deadline = Instant::now() + Duration::from_secs(120);
    let leader = loop {
        if let Some(h) = holder(leases.get_opt(&wh.name).await.expect("read lease")) {
            break h;
        }
        assert!(Instant::now() < deadline, "no leader elected within 120s");
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
    wh.children[leader_index].kill();
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
    let deadline = Instant::now() + Duration::from_secs(180);
    while holder(leases.get_opt(&wh.name).await.expect("read lease")).as_deref() != Some(survivor.as_str()) {
        assert!(Instant::now() < deadline, "{survivor} did not take the Lease over within 180s");
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
    let store = wh.records(&cp).await;
    use clusterip::store::AllocationStore;
    let recorded: BTreeSet<IpAddr> = store.allocated().await.expect("records").into_iter().collect();
    let lost: Vec<_> = seen.difference(&recorded).collect();
    assert!(lost.is_empty(), "addresses of live Services missing from the records: {lost:?}");
}

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

/// Beside kube-controller-manager, as in a real control plane: its service-cidr-controller and
/// our ServiceCIDR reconciler write the same finalizer and the same Ready condition (status,
/// no reason, message), and each compares before it writes, so once a ServiceCIDR has settled
/// neither rewrites it. Checked on one ServiceCIDR that kube-controller-manager settled before
/// our controller started and one created while both run: the resourceVersion of each stays
/// unchanged for `CLUSTERIP_SERVICECIDR_SETTLE_SECONDS` (default 60; docs/fidelity.md records
/// a 10-minute run). Then deleting one ends with its finalizer removed and the object gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn servicecidr_settles_beside_kube_controller_manager() {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    let cp = control_plane();
    if cp.var_opt("CLUSTERIP_KCM_URL").is_none() {
        assert_eq!(std::env::var("CLUSTERIP_KCM").as_deref(), Ok("0"), "the test cluster runs no kube-controller-manager (CLUSTERIP_KCM_URL missing from its env) and CLUSTERIP_KCM=0 does not say so");
        eprintln!("CLUSTERIP_KCM=0: no kube-controller-manager to settle beside");
        return;
    }
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
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let got = cidrs.get(&name).await.expect("get ServiceCIDR");
                if settled(&got) {
                    return got;
                }
                assert!(Instant::now() < deadline, "ServiceCIDR {name} not settled (finalizer, Ready=True with kube-controller-manager's message and no reason) within 60s: {:?} {:?}", got.metadata.finalizers, got.status);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let first = create("198.18.251.0/24").await;
    let _cleanup_first = ServiceCidrOnDrop(cidrs.clone(), first.clone());
    let before = wait_settled(first.clone()).await;
    let managers = |sc: &ServiceCIDR| sc.metadata.managed_fields.iter().flatten().filter_map(|m| m.manager.clone()).collect::<Vec<_>>();
    assert!(managers(&before).iter().any(|m| m == "service-cidr-controller"), "kube-controller-manager did not write the Ready condition: managers {:?}", managers(&before));

    // Our controller, leading (its reconcilers run only on the leader), then one more.
    let wh = Webhook::start(&cp, "etcd", Slice(21)).await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let deadline = Instant::now() + Duration::from_secs(120);
    while leases.get_opt(&wh.name).await.expect("read lease").and_then(|l| l.spec).and_then(|s| s.holder_identity).is_none() {
        assert!(Instant::now() < deadline, "no leader elected within 120s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let second = create("198.18.252.0/24").await;
    let _cleanup_second = ServiceCidrOnDrop(cidrs.clone(), second.clone());
    wait_settled(second.clone()).await;

    // Settled: from here on nobody writes either of them.
    let mut versions = Vec::new();
    for name in [&first, &second] {
        versions.push((name.clone(), cidrs.get(name).await.expect("get ServiceCIDR")));
    }
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
    let deadline = Instant::now() + Duration::from_secs(60);
    for name in [&second, &first] {
        while let Some(sc) = cidrs.get_opt(name).await.expect("get ServiceCIDR") {
            assert!(Instant::now() < deadline, "ServiceCIDR {name} still there 60s after its deletion: {:?} {:?}", sc.metadata.finalizers, sc.status);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
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
    use clusterip_test_support::poll::eventually_some;
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
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let recorded = store.has(ip).await.unwrap_or(false);
        let listed = events.list(&ListParams::default()).await.expect("list events");
        let reported = listed.items.iter().any(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
                && e.reason.as_deref() == Some("ClusterIPNotAllocated")
                && e.type_.as_deref() == Some("Warning")
                && e.note.as_ref().is_some_and(|n| wanted.contains(n))
        });
        if recorded && reported {
            break;
        }
        let about: Vec<String> =
            listed.items.iter().filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())).map(|e| format!("{:?} {:?} {:?} by {:?}", e.type_, e.reason, e.note, e.reporting_controller)).collect();
        assert!(Instant::now() < deadline, "within 120s: recorded={recorded}, event reported={reported}; Events about the Service: {about:?}; the controller's log:\n{}", wh.children[0].log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    api.delete(&name, &DeleteParams::default()).await.expect("delete");
    let deadline = Instant::now() + Duration::from_secs(120);
    while store.has(ip).await.unwrap_or(true) {
        assert!(Instant::now() < deadline, "{ip} still recorded 120s after its Service was deleted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let listed = events.list(&ListParams::default()).await.expect("list events");
        let mine: Vec<String> = listed.items.iter().filter(|e| ours(e)).map(|e| format!("{:?} {:?}", e.reason, e.note)).collect();
        assert!(!mine.iter().any(|e| e.contains("ClusterIPNotValid")), "{legacy} reported as not valid: {mine:?}");
        // Recorded (by the Service reconciler or a repair pass) under the address it spells,
        // and that said so in stock's words.
        if store.has(ip).await.unwrap_or(false) && mine.iter().any(|e| e.contains("ClusterIPNotAllocated") && e.contains(&ip.to_string())) {
            break;
        }
        assert!(Instant::now() < deadline, "{legacy} not recorded as {ip} within 120s; our Events: {mine:?}; the controller's log:\n{}", wh.children[0].log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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


/// The real kube-apiserver presents its client certificate (every other test here passes
/// only because it does); a webhook that does not accept it — the right CA, another name —
/// refuses the apiserver's connection before any request: the create fails with the
/// apiserver's TLS error, nothing admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_that_does_not_accept_the_apiservers_certificate_admits_nothing() {
    let cp = control_plane();
    let auth: Vec<String> = ["--client-ca-file", cp.var("CLUSTERIP_WEBHOOK_CLIENT_CA"), "--allowed-client-names", "someone-else"].iter().map(|s| s.to_string()).collect();
    let wh = Webhook::register(&cp, Harness::new(&cp, "etcd", Slice(9), |h| h.flags = auth)).await;
    let api = wh.services();
    // The apiserver picks the registration up asynchronously: until then creates succeed
    // (dry runs here, so nothing is held); then every create fails at the TLS handshake.
    let dry = PostParams { dry_run: true, ..Default::default() };
    let deadline = Instant::now() + Duration::from_secs(60);
    let message = loop {
        match api.create(&dry, &service("probe", |_| {})).await {
            Err(kube::Error::Api(s)) => break s.message,
            Ok(_) => assert!(Instant::now() < deadline, "webhook not called by the apiserver within 60s"),
            Err(e) => panic!("probing the webhook registration: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // The apiserver's words for the refusal depend on timing: with TLS 1.3 the client
    // certificate is judged after the client considers the handshake done, so the apiserver
    // reads our alert ("remote error: tls: unknown certificate"), or on a busy machine the
    // closed connection first ("unexpected EOF", or "http2: client conn could not be
    // established" when its HTTP/2 preface meets it; all three seen in soaks). What holds
    // every time: the call failed in transport ("failed to call webhook"), not as an answer
    // of ours ("denied the request"), and our log names the refused certificate.
    let refused = |m: &str| m.contains("failed calling webhook \"assign.clusterip.allocator\": failed to call webhook:") && !m.contains("denied the request");
    assert!(refused(&message), "{message}");
    match api.create(&PostParams::default(), &service("refused", |_| {})).await {
        Err(kube::Error::Api(s)) => assert!(s.code == 500 && refused(&s.message), "{s:?}"),
        other => panic!("a create through a webhook refusing the apiserver: {other:?}"),
    }
    let log = wh.children[0].log();
    assert!(log.contains("refused a connection: no valid client certificate") && log.contains("someone-else"), "{log}");
}

// ---------------------------------------------------------------- HA control plane

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
    let total = || acked[0].load(Ordering::SeqCst) + acked[1].load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(120);
    while total() < 100 {
        assert!(Instant::now() < deadline, "the burst made no progress in 120s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The fault: the first apiserver is stopped (SIGTERM, its graceful shutdown) and started
    // again with the same flags, mid-burst.
    let fault_from = Instant::now();
    cp.stop("kube-apiserver");
    cp.start("kube-apiserver");
    let fault_to = Instant::now();
    // Both apiservers serve creates afterwards: 20 more acknowledged through each.
    let after = [acked[0].load(Ordering::SeqCst), acked[1].load(Ordering::SeqCst)];
    let deadline = Instant::now() + Duration::from_secs(180);
    while (0..2).any(|i| acked[i].load(Ordering::SeqCst) < after[i] + 20) {
        let cap_reached = (0..2).any(|i| creators[i].is_finished());
        assert!(!cap_reached, "a creator reached its cap before both apiservers served again; acked {:?} (at the restart {after:?})", acked);
        assert!(Instant::now() < deadline, "creates did not succeed through both apiservers within 180s of the restart: acked {acked:?}, at the restart {after:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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

// ---------------------------------------------------------------- replicas under faults

/// A create of the fault scenario: which one, when it ended, what came back.
struct FaultCreate {
    name: String,
    result: Result<Service, kube::Error>,
}

/// Replica `k` of `wh` answers from its blocks again: a create routed to it alone succeeds.
/// The time from `healed` until it does; all three replicas routed again after.
async fn answers_again(wh: &Webhook, range: &clusterip::cidr::ServiceCidr, k: usize, healed: Instant) -> Duration {
    wh.route_only(&[k]).await;
    let api = wh.services();
    let n = std::sync::atomic::AtomicUsize::new(0);
    let last = std::sync::Mutex::new(String::new());
    let tries = async {
        clusterip_test_support::poll::eventually_some("the replica answers again", Duration::from_secs(60), Duration::from_millis(200), || {
            let api = api.clone();
            let i = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let last = &last;
            async move {
                match api.create(&PostParams::default(), &service(&format!("again-{k}-{i}"), |_| {})).await {
                    Ok(svc) => Some(svc),
                    Err(e) => {
                        *last.lock().expect("lock") = e.to_string();
                        None
                    }
                }
            }
        })
        .await
    };
    let svc = match tokio::time::timeout(Duration::from_secs(59), tries).await {
        Ok(svc) => svc,
        Err(_) => {
            let log = wh.children[k].log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!("replica {k} did not answer within 59 s of the heal; last error: {}\nits log, last lines first:\n{}", last.lock().expect("lock"), tail.join("\n"));
        }
    };
    let took = healed.elapsed();
    wh.route_only(&[0, 1, 2]).await;
    assert!(ips(&svc).iter().all(|ip| range.contains(*ip)), "{svc:?}");
    let _ = api.delete(svc.metadata.name.as_deref().unwrap_or_default(), &DeleteParams::default()).await;
    took
}

/// Issue 32's figures, on three ipaddress-backend replicas (D = 12 s, M = 6 s, 16-address
/// blocks, the apiserver's request timeout T = 5 s < M) on a /24, each reaching the
/// kube-apiserver through a path of its own ([`clusterip_test_support::faulty`]): dynamic
/// creates at 20/s through all replicas, each Service deleted 7.5 s after its create (about
/// 150 of the 254 addresses in use at a time), 50 concurrent creates of one static address
/// at the start, while in turn
/// 1. a block Lease held by replica 0 is deleted (by hand, as a namespace clean-up would);
/// 2. replica 1 is frozen (SIGSTOP) for 1.5 × D, out of the webhook's routes meanwhile (as its
///    failing readiness probe takes it out of the Service's endpoints);
/// 3. replica 2's path to the apiserver is black-holed (bytes held, no RST) for
///    `CLUSTERIP_FAULTS_BLACKHOLE_S` (default 30; the issue's figure: 120), still routed
///    for the first 10 s (until its readiness probe, which reads the apiserver, fails);
/// 4. replica 0's path is delayed by 5 s each way for 30 s (its watch lags by 5 s; every
///    answer is 5 s late).
///
/// Checked: no clusterIP on two Services; no dynamic create refused "provided IP is already
/// allocated"; exactly one of the 50 static creates succeeds; each faulted replica answers
/// from its blocks again within 30 s of the heal; at the end every block Lease is held by
/// a live replica and renewed within D. `CLUSTERIP_FAULTS_CREATES` (default 600; the
/// issue's figure: 3000) dynamic creates in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_three_replicas_under_faults() {
    use clusterip_test_support::faulty::{FaultyProxy, Path};
    use k8s_openapi::api::coordination::v1::Lease;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let _one_at_a_time = BURST.lock().await;
    let env_num = |key: &str, default: u64| std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let (creates, blackhole) = (env_num("CLUSTERIP_FAULTS_CREATES", 600) as usize, Duration::from_secs(env_num("CLUSTERIP_FAULTS_BLACKHOLE_S", 30)));
    let d = Duration::from_secs(12);
    let cp = control_plane();
    let slice = Slice(25);
    let range = clusterip::cidr::ServiceCidr::parse("198.19.200.0/24").expect("range");
    // Each replica's own path to the apiserver.
    let kubeconfig = std::fs::read_to_string(cp.kubeconfig()).expect("the kubeconfig");
    let server = kubeconfig.lines().find_map(|l| l.trim().strip_prefix("server: https://")).expect("the kubeconfig's server").to_string();
    let upstream: std::net::SocketAddr = server.parse().expect("the apiserver's address");
    let dir = clusterip_test_support::owned_temp_dir("faults");
    let mut proxies = Vec::new();
    let mut kubeconfigs = Vec::new();
    for i in 0..3 {
        let p = FaultyProxy::start(upstream).await.expect("a path to the apiserver");
        let path = dir.join(format!("kubeconfig-{i}"));
        std::fs::write(&path, kubeconfig.replace(&format!("https://{server}"), &format!("https://{}", p.addr()))).expect("write a kubeconfig");
        kubeconfigs.push(path);
        proxies.push(p);
    }
    // Block Leases of this range an earlier run's replicas left (they died with it).
    let leases: Api<Lease> = Api::namespaced(cp.client().await, "default");
    for l in leases.list(&ListParams::default().labels(clusterip::store::ipaddress::blocks::BLOCK_LABEL)).await.expect("list block Leases").items {
        let ours = l.metadata.annotations.as_ref().and_then(|a| a.get(clusterip::store::ipaddress::blocks::RANGE_ANNOTATION)).is_some_and(|r| *r == range.to_string());
        if let (true, Some(name)) = (ours, l.metadata.name.as_deref()) {
            let _ = leases.delete(name, &DeleteParams::default()).await;
        }
    }
    let wh = Webhook::start_with(&cp, "ipaddress", slice, |h| {
        h.kubeconfigs = kubeconfigs.clone();
        h.ranges = vec![range.to_string()];
        h.flags(&[
            "--address-block-size", "16", "--address-block-lease-duration", "12s", "--address-block-margin", "6s",
            "--apiserver-request-timeout", "5s", "--in-flight-limit", "20s",
        ]);
    })
    .await;
    let api = wh.services();

    // The load: dynamic creates at 20/s, each as its own task, until `creates`.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (api, stop) = (api.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..creates {
                tick.tick().await;
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let api = api.clone();
                tasks.spawn(async move {
                    let name = format!("dyn-{i}");
                    let result = api.create(&PostParams::default(), &service(&name, |_| {})).await;
                    // Churn: each Service lives 7.5 s, so about 150 exist at a time (the /24
                    // has 254 addresses) and addresses are given up and taken again.
                    if result.is_ok() {
                        tokio::time::sleep(Duration::from_millis(7500)).await; // the Service's lifetime
                        let _ = api.delete(&name, &DeleteParams::default()).await;
                    }
                    FaultCreate { name, result }
                });
            }
            let mut out = Vec::new();
            while let Some(r) = tasks.join_next().await {
                out.extend(r.ok());
            }
            out
        })
    };
    // 50 creates of one static address through all replicas at once.
    let wanted = IpAddr::from([198, 19, 200, 7]);
    let statics = futures::future::join_all((0..50).map(|i| {
        let api = api.clone();
        async move { api.create(&PostParams::default(), &service(&format!("static-{i}"), |s| s.cluster_ip = Some(wanted.to_string()))).await }
    }))
    .await;

    let mut took = Vec::new();

    // 1. A block Lease of replica 0 deleted.
    let held_by = |l: &Lease, who: &str| l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()).is_some_and(|h| h.starts_with(&format!("{who}/")));
    let block_leases = || {
        let leases = leases.clone();
        async move { leases.list(&ListParams::default().labels(clusterip::store::ipaddress::blocks::BLOCK_LABEL)).await.expect("list block Leases").items }
    };
    let victim = clusterip_test_support::poll::eventually_some("replica 0 holds a block", Duration::from_secs(60), Duration::from_millis(200), || {
        let f = block_leases();
        async move { f.await.into_iter().find(|l| held_by(l, "replica-0")).and_then(|l| l.metadata.name) }
    })
    .await;
    leases.delete(&victim, &DeleteParams::default()).await.expect("delete a held block Lease");
    took.push(("Lease deleted (replica 0)", answers_again(&wh, &range, 0, Instant::now()).await));

    // 2. Replica 1 frozen for 1.5 × D.
    wh.route_only(&[0, 2]).await;
    wh.children[1].signal(libc::SIGSTOP);
    tokio::time::sleep(d * 3 / 2).await; // the fault itself: time frozen
    wh.children[1].signal(libc::SIGCONT);
    took.push(("frozen 1.5 × D (replica 1)", answers_again(&wh, &range, 1, Instant::now()).await));

    // 3. Replica 2's path black-holed.
    proxies[2].set(Path::BlackHole);
    tokio::time::sleep(Duration::from_secs(10)).await; // the fault itself: readiness not yet failed
    wh.route_only(&[0, 1]).await;
    tokio::time::sleep(blackhole.saturating_sub(Duration::from_secs(10))).await; // the fault itself
    proxies[2].set(Path::Pass);
    took.push(("black-holed (replica 2)", answers_again(&wh, &range, 2, Instant::now()).await));

    // 4. Replica 0's path delayed by 5 s each way for 30 s.
    proxies[0].set(Path::Delay(Duration::from_secs(5)));
    tokio::time::sleep(Duration::from_secs(30)).await; // the fault itself
    proxies[0].set(Path::Pass);
    took.push(("delayed 5 s for 30 s (replica 0)", answers_again(&wh, &range, 0, Instant::now()).await));

    let done = load.await.expect("the load");
    stop.store(true, Ordering::SeqCst);

    // Invariants.
    let refused_allocated = done.iter().filter(|c| matches!(&c.result, Err(kube::Error::Api(s)) if s.message.contains("already allocated"))).map(|c| c.name.clone()).collect::<Vec<_>>();
    let failed: Vec<String> = done.iter().filter_map(|c| c.result.as_ref().err().map(|e| format!("{}: {e}", c.name))).collect();
    let static_ok = statics.iter().filter(|r| r.is_ok()).count();
    let all = api.list(&ListParams::default()).await.expect("list Services").items;
    let mut seen = std::collections::HashMap::new();
    let mut duplicates = Vec::new();
    for svc in &all {
        for ip in ips(svc) {
            if let Some(other) = seen.insert(ip, svc.metadata.name.clone().unwrap_or_default()) {
                duplicates.push(format!("{ip}: {other} and {}", svc.metadata.name.as_deref().unwrap_or_default()));
            }
        }
    }
    // Every block Lease held by a live replica and renewed within D — once the replicas had
    // D to settle after the last heal (a Lease the delayed replica could not renew is then
    // renewed again, taken over, or given back).
    let stale_now = || {
        let f = block_leases();
        async move {
            let now = k8s_openapi::jiff::Timestamp::now();
            f.await
                .into_iter()
                .filter(|l| {
                    let live = ["replica-0", "replica-1", "replica-2"].iter().any(|r| held_by(l, r));
                    let renewed = l.spec.as_ref().and_then(|s| s.renew_time.as_ref()).is_some_and(|t| now.duration_since(t.0).as_secs_f64() < d.as_secs_f64());
                    !(live && renewed)
                })
                .map(|l| {
                    let spec = l.spec.unwrap_or_default();
                    let age = spec.renew_time.map(|t| format!("{:.1}s", now.duration_since(t.0).as_secs_f64())).unwrap_or_else(|| "never".into());
                    format!("{} (holder {}, renewed {age} ago)", l.metadata.name.unwrap_or_default(), spec.holder_identity.unwrap_or_default())
                })
                .collect::<Vec<String>>()
        }
    };
    let settle = Instant::now() + d;
    let mut stale = stale_now().await;
    while !stale.is_empty() && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(500)).await;
        stale = stale_now().await;
    }
    let kind = |e: &str| if e.contains("range is full") { "range_full" } else if e.contains("failed to call webhook") { "webhook_unreachable" } else { "other" };
    let mut kinds = std::collections::BTreeMap::new();
    for f in &failed {
        *kinds.entry(kind(f)).or_insert(0) += 1;
    }
    println!(
        "RESULT faults creates={} ok={} failed={} ({}) refused_already_allocated={} duplicates={} static_ok={} stale_leases={} answered_again_s={}",
        done.len(),
        done.len() - failed.len(),
        failed.len(),
        kinds.iter().map(|(k, n)| format!("{k}={n}")).collect::<Vec<_>>().join(","),
        refused_allocated.len(),
        duplicates.len(),
        static_ok,
        stale.len(),
        took.iter().map(|(what, t)| format!("{what}:{:.1}", t.as_secs_f64())).collect::<Vec<_>>().join(",")
    );
    for f in failed.iter().filter(|f| kind(f) == "other").take(10) {
        eprintln!("failed create: {f}");
    }
    assert!(duplicates.is_empty(), "addresses on two Services: {duplicates:?}");
    assert!(refused_allocated.is_empty(), "dynamic creates refused as already allocated: {refused_allocated:?}");
    assert_eq!(static_ok, 1, "creates of {wanted} that succeeded: {:?}", statics.iter().map(|r| r.as_ref().map(|_| "ok".to_string()).unwrap_or_else(|e| e.to_string())).collect::<Vec<_>>());
    if !stale.is_empty() {
        for (i, c) in wh.children.iter().enumerate() {
            let log = c.log();
            let lines: Vec<&str> = log.lines().collect();
            for line in &lines[lines.len().saturating_sub(40)..] {
                eprintln!("replica {i}: {line}");
            }
        }
    }
    assert!(stale.is_empty(), "block Leases held by no live replica or not renewed within D: {stale:?}");
    for (what, t) in &took {
        assert!(*t <= Duration::from_secs(30), "{what}: the replica answered from its blocks again {t:?} after the heal");
    }
}
