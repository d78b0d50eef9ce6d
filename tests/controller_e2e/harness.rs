//! The harness every subject shares: a test's ranges ([`Slice`]), its controllers and
//! their webhook registration ([`Webhook`], set up through [`Harness`]), and Services.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
use k8s_openapi::api::core::v1::{Namespace, Service, ServicePort, ServiceSpec};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::Client;
use serde_json::json;

use clusterip_test_support::{block_on_drop, eventually, eventually_ok, eventually_some, unique_name, ControlPlane};

use crate::controller_common::{self, Controller};

/// The ranges one test's controllers assign from: slice `k` of our ranges, 198.19.8k.0/21
/// and fd00:10:96::(800·k)/117 (2048 addresses each; static band = the first 128). Slice 0
/// holds the fixed addresses other test files use (198.19.0.x, fd00:10:96::x) and is left out.
/// Slices 19 and 20 are the HA tests' (on control planes of their own; 16–18 overlap the
/// fidelity test's 198.19.120.0–198.19.144.63).
#[derive(Clone, Copy, Debug)]
pub struct Slice(pub u8);

impl Slice {
    pub fn v4(self) -> String {
        format!("198.19.{}.0/21", 8 * self.0 as u32)
    }

    pub fn v6(self) -> String {
        format!("fd00:10:96::{:x}/117", 0x800 * self.0 as u32)
    }

    /// The `n`-th address of the IPv4 slice (n ≤ 128: the static band).
    pub fn v4_static(self, n: u32) -> IpAddr {
        assert!((1..=128).contains(&n));
        IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 8 * self.0, 0)) + n))
    }

    /// Kubernetes' dynamic band of the slice: above the first 128 usable addresses.
    pub fn in_dynamic_band(self, ip: IpAddr) -> bool {
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
pub struct Webhook {
    pub children: Vec<Controller>,
    /// The replicas' webhook ports, and those the proxy forwards to now.
    ports: Vec<u16>,
    routes: tokio::sync::watch::Sender<Vec<u16>>,
    pub name: String,
    pub namespace: String,
    pub client: Client,
    slice: Slice,
    /// The ranges the controllers assign from ([`Harness::ranges`]).
    pub ranges: Vec<String>,
    /// How the replicas were started (for [`Self::add_replica`]).
    harness: Harness,
}

/// How a test's webhook is set up: [`Harness::new`] gives the defaults, which a test
/// changes in its tweak closure.
#[derive(Clone)]
pub struct Harness {
    backend: String,
    slice: Slice,
    /// The ranges the controllers assign from, IPv4 first: the slice's, unless a test needs
    /// a small range (it must lie in the slice).
    pub ranges: Vec<String>,
    /// Controller flags besides the common ones ([`controller_common::controller_args`]):
    /// by default the client-certificate flags that accept only the kube-apiserver
    /// ([`controller_common::client_auth_args`]).
    pub flags: Vec<String>,
    /// One controller replica per kubeconfig, each reaching the apiserver its kubeconfig
    /// names (identities replica-0, replica-1, …); by default one, on the control plane's.
    pub kubeconfigs: Vec<std::path::PathBuf>,
}

impl Harness {
    pub fn new(cp: &ControlPlane, backend: &str, slice: Slice, tweak: impl FnOnce(&mut Harness)) -> Harness {
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
    pub fn replicas(&mut self, n: usize) {
        self.kubeconfigs = vec![self.kubeconfigs[0].clone(); n];
    }

    /// Add controller flags.
    pub fn flags(&mut self, extra: &[&str]) {
        self.flags.extend(extra.iter().map(|s| s.to_string()));
    }
}

impl Webhook {
    pub async fn start(cp: &ControlPlane, backend: &str, slice: Slice) -> Webhook {
        Self::start_with(cp, backend, slice, |_| {}).await
    }

    /// The controllers' etcd records (etcd backend), opened as a store of their ranges
    /// under the prefix the harness gives them.
    pub async fn records(&self, cp: &ControlPlane) -> clusterip::store::etcd::EtcdStore {
        let cidrs = self.ranges.iter().map(|r| clusterip::cidr::ServiceCidr::parse(r).expect("the harness's range")).collect();
        self.records_of(cp, cidrs).await.expect("open the controllers' records")
    }

    /// The controllers' etcd records opened as a store of `cidrs` (another range than the
    /// controllers': a range change's new one).
    pub async fn records_of(&self, cp: &ControlPlane, cidrs: Vec<clusterip::cidr::ServiceCidr>) -> Result<clusterip::store::etcd::EtcdStore, clusterip::store::StoreError> {
        let cfg = clusterip::store::etcd::EtcdConfig { endpoints: cp.etcd_endpoints(), prefix: self.etcd_prefix(), ..Default::default() };
        clusterip::store::etcd::EtcdStore::open(&cfg, cidrs).await
    }

    /// The etcd prefix of the controllers' records (`controller_common::controller_args`).
    pub fn etcd_prefix(&self) -> String {
        format!("/clusterip-test/{}", self.name)
    }

    /// Each replica's `clusterip_address_block_events_total`, summed by event.
    pub async fn block_events(&self) -> std::collections::BTreeMap<&'static str, f64> {
        let mut events = std::collections::BTreeMap::new();
        for c in &self.children {
            let text = clusterip_test_support::local_get(c.metrics_port, "/metrics").await.map(|(_, b)| b).unwrap_or_default();
            for e in clusterip::store::ipaddress::blocks::EVENTS {
                *events.entry(e).or_insert(0.0) += controller_common::metric(&text, &format!("clusterip_address_block_events_total{{event=\"{e}\"}}")).unwrap_or(0.0);
            }
        }
        events
    }

    /// The controllers of the harness `tweak` makes, sharing one backend and one leader
    /// Lease behind a round-robin TCP proxy the webhook URL names, once the apiserver calls
    /// the webhook.
    pub async fn start_with(cp: &ControlPlane, backend: &str, slice: Slice, tweak: impl FnOnce(&mut Harness)) -> Webhook {
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
    pub async fn route_only(&self, replicas: &[usize]) {
        self.routes.send_replace(replicas.iter().map(|&i| self.ports[i]).collect());
        let api = self.services();
        let dry = PostParams { dry_run: true, ..Default::default() };
        let (api, dry) = (&api, &dry);
        // (No pause between rounds: each takes its own time.)
        eventually_ok(&format!("webhook calls through replicas {replicas:?} pass after re-routing"), Duration::from_secs(60), Duration::ZERO, move || async move {
            let round = futures::future::join_all((0..32).map(|i| async move { api.create(dry, &service(&format!("route-probe-{i}"), |_| {})).await })).await;
            match round.into_iter().find_map(|r| r.err()) {
                Some(err) => Err(err),
                None => Ok(()),
            }
        })
        .await
    }

    /// The controllers and the registration, without waiting for the apiserver to call the
    /// webhook.
    pub async fn register(cp: &ControlPlane, h: Harness) -> Webhook {
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
        let wh = Webhook { children, ports, routes, name: name.clone(), namespace: name.clone(), client: client.clone(), slice, ranges: h.ranges.clone(), harness: h };

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

    /// One more replica, configured as the others but with `ranges` (a rolling update's new
    /// `--service-cidr`): identity replica-`i`, on the first replica's apiserver, ready but
    /// routed only once [`Self::route_only`] names it. Returns its index `i`.
    pub async fn add_replica(&mut self, cp: &ControlPlane, ranges: &[String]) -> usize {
        let i = self.children.len();
        let mut h = self.harness.clone();
        h.ranges = ranges.to_vec();
        h.kubeconfigs = vec![self.harness.kubeconfigs[0].clone(); i + 1];
        let c = spawn_controller(cp, &h, &self.name, i);
        c.wait_ready().await;
        self.ports.push(c.webhook_port);
        self.children.push(c);
        i
    }

    pub fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// The apiserver picks up webhook configurations asynchronously: probe with a dry-run
    /// create (nothing is allocated by anyone) of an address inside the apiserver's range but
    /// outside ours, which only our webhook refuses, until it does.
    pub async fn wait_registered(&mut self) {
        self.wait_called_through(&self.services()).await;
    }

    /// [`wait_registered`](Self::wait_registered) through `api` (another apiserver's client).
    pub async fn wait_called_through(&self, api: &Api<Service>) {
        let dry = PostParams { dry_run: true, ..Default::default() };
        // Outside every range any test's controller allocates from (also the cluster's own
        // 198.19.0.0/16, which a controller following ServiceCIDR objects serves).
        let probe = service("probe", |s| s.cluster_ip = Some("198.18.199.5".into()));
        let (dry, probe, ours) = (&dry, &probe, &format!("The range of valid IPs is {}", self.v4_range()));
        eventually_some("the apiserver calls the webhook", Duration::from_secs(60), Duration::from_millis(200), move || async move {
            match api.create(dry, probe).await {
                Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains(ours.as_str()) => Some(()),
                Ok(_) => None,
                Err(e) => panic!("probing the webhook registration: {e}"),
            }
        })
        .await
    }

    /// The holder of the controllers' leader Lease, once one holds it (120 s at most).
    pub async fn leader(&self) -> String {
        use k8s_openapi::api::coordination::v1::Lease;
        let (leases, name) = (&Api::<Lease>::namespaced(self.client.clone(), "default"), &self.name);
        eventually_some("a leader is elected", Duration::from_secs(120), Duration::from_millis(100), move || async move {
            leases.get_opt(name).await.expect("read lease").and_then(|l| l.spec).and_then(|s| s.holder_identity)
        })
        .await
    }

    pub fn in_dynamic_band(&self, ip: IpAddr) -> bool {
        self.slice.in_dynamic_band(ip)
    }

    /// The IPv4 range the controllers assign from.
    pub fn v4_range(&self) -> &str {
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

/// Forward each connection to a routed replica that accepts it — of those, the one with the
/// fewest connections open through this front, the next in turn among equals (TLS passes
/// through); a connection to a replica taken out of the routes is cut. Connections, not
/// requests, are spread: a kube-apiserver calls a webhook on a loopback URL over one HTTP/2
/// connection (it forces HTTP/1.1 only for other hosts), so each apiserver's calls go to one
/// replica until that connection is cut, and its new one goes where the fewest are.
async fn round_robin(listener: tokio::net::TcpListener, routes: tokio::sync::watch::Receiver<Vec<u16>>) {
    let open: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<u16, usize>>> = Default::default();
    let mut next = 0usize;
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else { continue };
        let ports = routes.borrow().clone();
        let mut order: Vec<u16> = (0..ports.len()).map(|i| ports[(next + i) % ports.len()]).collect();
        {
            // (A stable sort: among equals, the turn order stays.)
            let open = open.lock().expect("lock");
            order.sort_by_key(|p| open.get(p).copied().unwrap_or(0));
        }
        let mut target = None;
        for port in order {
            if let Ok(s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                target = Some((port, s));
                break;
            }
        }
        next = next.wrapping_add(1);
        if let Some((port, mut outbound)) = target {
            *open.lock().expect("lock").entry(port).or_default() += 1;
            let (mut routes, open) = (routes.clone(), open.clone());
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
                if let Some(n) = open.lock().expect("lock").get_mut(&port) {
                    *n -= 1;
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

/// Block Leases in `default` naming `range` (ipaddress backend), by name.
pub async fn block_leases(leases: &Api<k8s_openapi::api::coordination::v1::Lease>, range: &clusterip::cidr::ServiceCidr) -> Vec<String> {
    use clusterip::store::ipaddress::blocks::{BLOCK_LABEL, RANGE_ANNOTATION};
    let list = leases.list(&ListParams::default().labels(BLOCK_LABEL)).await.expect("list block Leases");
    list.items
        .into_iter()
        .filter(|l| l.metadata.annotations.as_ref().and_then(|a| a.get(RANGE_ANNOTATION)).is_some_and(|r| *r == range.to_string()))
        .filter_map(|l| l.metadata.name)
        .collect()
}

pub fn service(name: &str, f: impl FnOnce(&mut ServiceSpec)) -> Service {
    let mut spec = ServiceSpec { ports: Some(vec![ServicePort { port: 80, ..Default::default() }]), ..Default::default() };
    f(&mut spec);
    Service { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, spec: Some(spec), ..Default::default() }
}

pub fn ips(svc: &Service) -> Vec<IpAddr> {
    svc.spec.as_ref().and_then(|s| s.cluster_ips.clone()).unwrap_or_default().iter().map(|s| s.parse().expect("clusterIP")).collect()
}

pub async fn expect_422(api: &Api<Service>, svc: &Service, contains: &str) {
    match api.create(&PostParams::default(), svc).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422, "status {s:?}");
            assert!(s.message.contains(contains), "message {:?} lacks {contains:?}", s.message);
        }
        other => panic!("expected a 422, got {other:?}"),
    }
}

/// One burst at a time: the bursts' ranges are disjoint, but four 500-create bursts at once
/// would measure the machine, not the webhook.
pub static BURST: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Addresses `c` released as the kube-apiserver released its own record of them
/// (`clusterip_webhook_released_addresses_total{reason="apiserver_released"}`).
pub async fn released_by_apiserver(c: &Controller) -> usize {
    let text = clusterip_test_support::local_get(c.metrics_port, "/metrics").await.map(|(_, b)| b).unwrap_or_default();
    controller_common::metric(&text, "clusterip_webhook_released_addresses_total{reason=\"apiserver_released\"}").unwrap_or(0.0) as usize
}

/// Wait (60 s at most) until `c` has released at least `n` addresses that way.
pub async fn wait_released(c: &Controller, n: usize, what: &str) {
    eventually(what, Duration::from_secs(60), || async move { released_by_apiserver(c).await >= n }).await;
}

/// Who records `ip` right now, for a failure message: the IPAddress object's parentRef,
/// labels, creation time and writers, and the Events that name the address (the
/// kube-apiserver's repair controller and ours post them when they create or delete one).
pub async fn who_holds(client: &Client, ip: IpAddr) -> String {
    use k8s_openapi::api::events::v1::Event;
    use k8s_openapi::api::networking::v1::IPAddress;
    let name = ip.to_string();
    let object = match Api::<IPAddress>::all(client.clone()).get_opt(&name).await {
        Ok(Some(o)) => {
            let p = &o.spec.parent_ref;
            let parent = format!("{}/{}/{}", p.resource, p.namespace.clone().unwrap_or_default(), p.name);
            let writers: Vec<String> = o.metadata.managed_fields.iter().flatten().map(|m| format!("{} at {:?}", m.manager.clone().unwrap_or_default(), m.time.as_ref().map(|t| t.0))).collect();
            format!("IPAddress {name}: parentRef {parent}, labels {:?}, created {:?}, writers {writers:?}", o.metadata.labels.unwrap_or_default(), o.metadata.creation_timestamp.map(|t| t.0))
        }
        Ok(None) => format!("IPAddress {name}: none now"),
        Err(e) => format!("IPAddress {name}: unreadable ({e})"),
    };
    let names_it = |note: &str| note.split(|c: char| !(c.is_ascii_hexdigit() || c == '.' || c == ':')).any(|w| w == name);
    let events = match Api::<Event>::all(client.clone()).list(&ListParams::default()).await {
        Ok(list) => list
            .items
            .into_iter()
            .filter(|e| e.note.as_deref().is_some_and(names_it))
            .map(|e| format!("{:?} {} {}: {}", e.event_time.map(|t| t.0), e.reporting_controller.unwrap_or_default(), e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect::<Vec<_>>(),
        Err(e) => vec![format!("(events unreadable: {e})")],
    };
    format!("{object}; Events naming it: {events:?}")
}

/// Which kind of refusal a failed create's error is, for a RESULT line's counts.
pub fn failure_kind(error: &str) -> &'static str {
    if error.contains("already allocated") {
        "already_allocated"
    } else if error.contains("range is full") {
        "range_full"
    } else if error.contains("failed to call webhook") {
        "webhook_unreachable"
    } else {
        "other"
    }
}
