//! The repair pass: Services, allocation records and ranges compared, drift found and —
//! when asked — repaired, as Kubernetes' repair controllers do (see docs/repair.md).
//!
//! - [`decide`]: the pure decisions (inputs in, findings out), unit-tested.
//! - this module: the I/O around them — list every Service (paginated), read the
//!   backend's records, confirm each finding against a fresh read, apply the actions,
//!   post Events in Kubernetes' reasons, count metrics — and the controller's loop.
//!
//! Records are read **before** Services are listed: an address allocated between the two
//! reads then looks owned (a Service appears) or merely missing (recreating it finds it
//! recorded), never leaked. Findings that could be a race (a missing record, an orphaned
//! IPAddress) are confirmed by reading that one object again before they are reported.

pub mod decide;
pub mod explain;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Service};
use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
use kube::api::{Api, DeleteParams, ListParams, ObjectList, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::{debug, info, warn};

use crate::cidr::{self, ServiceCidr};
use crate::k8s;
use crate::k8s::ipaddress::{KUBE_APISERVER_MANAGER, LABEL_IP_FAMILY, LABEL_MANAGED_BY};
pub use crate::k8s::service::ServiceSummary;
use crate::metrics::Metrics;
use crate::store::{AllocationStore, BackendKind, ParentRef, StoreError};

pub use decide::{decide, Action, Config, EventTarget, Finding, Kind, LeakCounts, Mode, RecordView, Records, Report, ServiceView, DEFAULT_GRACE, LEAK_PASSES};

/// Page size of every list (Services, IPAddresses).
pub const PAGE: u32 = 500;
/// Findings confirmed one object at a time at most; beyond this the pass trusts its lists.
const MAX_CONFIRM: usize = 1000;

/// Why a pass could not run.
#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    #[error("listing {what}: {source}")]
    List { what: &'static str, source: kube::Error },
    #[error("reading the allocation records: {0}")]
    Records(#[from] StoreError),
}

/// Where the records are and what the pass may change.
#[derive(Clone)]
pub enum Target {
    /// The etcd backend (its allocation maps, through the store).
    Etcd(Arc<dyn AllocationStore>),
    /// IPAddress objects; ours carry managed-by `manager`.
    IpAddress { manager: String, ranges: Vec<ServiceCidr>, use_servicecidrs: bool },
    /// Read-only audit of the kube-apiserver's own allocator (ranges from ServiceCIDRs).
    Audit,
}

impl Target {
    /// The ranges judged — `own` (the backend's), with the cluster's ServiceCIDR ranges
    /// after them when the target follows those (`--use-servicecidrs`), or those alone (the
    /// audit) — and the cluster's ServiceCIDR ranges, None when that API is not served or
    /// not granted (a target that needs them fails instead). One list of the ServiceCIDRs.
    pub async fn ranges(&self, client: &kube::Client, own: Vec<ServiceCidr>) -> Result<(Vec<ServiceCidr>, Option<Vec<ServiceCidr>>), RepairError> {
        let needs = matches!(self, Target::Audit | Target::IpAddress { use_servicecidrs: true, .. });
        let cluster = match servicecidr_ranges(client).await {
            Ok(c) => Some(c),
            Err(RepairError::List { source: kube::Error::Api(s), .. }) if !needs && (s.code == 404 || s.code == 403) => None,
            Err(e) => return Err(e),
        };
        let ranges = match self {
            Target::Audit => cluster.clone().unwrap_or_default(),
            Target::IpAddress { use_servicecidrs: true, .. } => {
                let mut ranges = own;
                for c in cluster.iter().flatten() {
                    if !ranges.contains(c) {
                        ranges.push(c.clone());
                    }
                }
                ranges
            }
            _ => own,
        };
        Ok((ranges, cluster))
    }
}

/// What happened to one finding.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// Dry run, or an action that changes nothing (Event, report only, wait).
    NotApplied,
    /// The action was carried out (the Event was posted, the record changed).
    Applied,
    /// The action failed, and why.
    Failed(ActionError),
}

/// Why one repair action failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ActionError {
    /// The etcd backend refused or could not be reached.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The finding's address does not parse (a garbled record name).
    #[error(transparent)]
    Address(#[from] cidr::CidrError),
    /// The IPAddress object changed since the pass read it.
    #[error("IPAddress {0} changed since it was read; left for the next pass")]
    Changed(String),
    /// The kube-apiserver refused a create or delete of an IPAddress object.
    #[error("{what} IPAddress {name}: {source}")]
    Api { what: &'static str, name: String, source: Arc<kube::Error> },
    /// The finding names no record to act on ("release", "replace").
    #[error("no record to {0}")]
    NoRecord(&'static str),
    /// The finding names no Service to record the address for.
    #[error("no Service to record the address for")]
    NoService,
}

impl ActionError {
    /// The `type` label of `clusterip_repair_ip_errors_total` for a failed action.
    pub fn metric_type(&self) -> &'static str {
        match self {
            ActionError::Store(StoreError::Alloc(crate::alloc::AllocError::Full)) => "full",
            _ => "unknown",
        }
    }
}

/// One pass's findings and what became of each.
#[derive(Clone, Debug, Default)]
pub struct PassResult {
    pub report: Report,
    pub outcomes: Vec<Outcome>,
    pub ranges: Vec<ServiceCidr>,
    pub backend: &'static str,
}

impl PassResult {
    /// Findings still true after the pass: everything on a dry run; with fixes, those whose
    /// record change was not carried out (an Event or a wait does not make drift go away).
    pub fn remaining(&self) -> usize {
        self.report
            .findings
            .iter()
            .zip(&self.outcomes)
            .filter(|(f, o)| !(f.action.changes_records() && matches!(o, Outcome::Applied)))
            .count()
    }

    pub fn failed(&self) -> usize {
        self.outcomes.iter().filter(|o| matches!(o, Outcome::Failed(_))).count()
    }
}

/// Progress callback: (phase, items so far).
pub type Progress<'a> = &'a (dyn Fn(&str, usize) + Send + Sync);

fn no_progress(_: &str, _: usize) {}

/// Runs passes; keeps the etcd backend's leak counters from one pass to the next.
pub struct Repairer {
    client: kube::Client,
    target: Target,
    grace: Duration,
    leaks: LeakCounts,
    recorder: Option<Recorder>,
    metrics: Option<Arc<Metrics>>,
    history: Option<crate::history::Notes>,
}

impl Repairer {
    pub fn new(client: kube::Client, target: Target) -> Self {
        Self { client, target, grace: DEFAULT_GRACE, leaks: LeakCounts::default(), recorder: None, metrics: None, history: None }
    }

    /// IPAddress leak grace period (default 60s).
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Post Events (Kubernetes' reasons) for the findings of passes that apply fixes.
    pub fn with_events(mut self, instance: Option<String>) -> Self {
        self.recorder = Some(Recorder::new(self.client.clone(), Reporter { controller: crate::controller::events::REPORTER.into(), instance }));
        self
    }

    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Note each change a pass makes in the address history (the leader's).
    pub fn with_history(mut self, history: Option<crate::history::Notes>) -> Self {
        self.history = history;
        self
    }

    /// Note an applied finding's change in the address history.
    fn note(&self, f: &Finding) {
        use crate::history::Decision;
        let (Some(history), Ok(ip)) = (&self.history, cidr::parse_ip(&f.address)) else { return };
        let decision = match f.action {
            Action::Release => Decision::RepairReleased,
            Action::Create => Decision::RepairRecorded,
            Action::Replace => Decision::RepairReplaced,
            _ => return,
        };
        // A release names the record it deleted; a record made names its Service.
        let service = f.service.as_ref().map(|(ns, name)| ParentRef::service(ns, name));
        let record = f.record.as_ref().and_then(|r| r.parent.clone());
        let parent = if decision == Decision::RepairReleased { record.or(service) } else { service.or(record) };
        history.note(ip, parent.as_ref(), decision);
    }

    /// Addresses currently counted as leaked (etcd backend), with their counts.
    pub fn leak_counts(&self) -> &LeakCounts {
        &self.leaks
    }

    /// One pass. `fix` applies the actions; `release_leaks_now` releases every leak found.
    pub async fn run_once(&mut self, fix: bool, release_leaks_now: bool, progress: Option<Progress<'_>>) -> Result<PassResult, RepairError> {
        let result = self.pass(fix, release_leaks_now, progress.unwrap_or(&no_progress)).await;
        if let (Err(_), Some(m)) = (&result, &self.metrics) {
            m.repair_reconcile_errors.inc();
        }
        result
    }

    async fn pass(&mut self, fix: bool, release_leaks_now: bool, progress: Progress<'_>) -> Result<PassResult, RepairError> {
        let audit = matches!(self.target, Target::Audit);
        // Records first (see the module docs), then ranges, then Services.
        let (records, ranges, mode, backend) = match &self.target {
            Target::Etcd(store) => {
                let mut all: BTreeSet<IpAddr> = store.allocated().await?.into_iter().collect();
                // Addresses with a recorded owner other than a Service are their owner's to
                // release; never judged as leaks here.
                for (ip, _) in store.owners().await? {
                    all.remove(&ip);
                }
                progress("records", all.len());
                (Records::Map(all), store.ranges(), Mode::Etcd, BackendKind::Etcd.as_str())
            }
            Target::IpAddress { manager, ranges, .. } => {
                let objects = list_ipaddresses(&self.client, progress).await?;
                (Records::Objects(objects), ranges.clone(), Mode::IpAddress { manager: manager.clone() }, BackendKind::Ipaddress.as_str())
            }
            Target::Audit => {
                let objects = list_ipaddresses(&self.client, progress).await?;
                (Records::Objects(objects), Vec::new(), Mode::Audit { manager: KUBE_APISERVER_MANAGER.into() }, "kube-apiserver")
            }
        };
        let (ranges, cluster_ranges) = self.target.ranges(&self.client, ranges).await?;
        let services = list_services(&self.client, progress).await?;
        let cfg = Config { ranges: ranges.clone(), cluster_ranges, mode, grace: self.grace, release_leaks_now };
        let mut report = decide(&cfg, &services, &records, &mut self.leaks);
        drop(services);
        drop(records);
        self.confirm(&mut report).await;
        if let Some(m) = &self.metrics {
            for f in &report.findings {
                m.repair_ip_errors.get_or_create(&crate::metrics::RepairLabels { r#type: f.kind.metric_type() }).inc();
            }
        }
        let mut outcomes = Vec::with_capacity(report.findings.len());
        for (i, f) in report.findings.iter().enumerate() {
            progress("applying", i);
            let outcome = if fix && !audit { self.apply(f).await } else { Outcome::NotApplied };
            if let Outcome::Failed(why) = &outcome {
                warn!(kind = f.kind.as_str(), address = %f.address, error = %why, "repair action failed");
                if let Some(m) = &self.metrics {
                    m.repair_ip_errors.get_or_create(&crate::metrics::RepairLabels { r#type: why.metric_type() }).inc();
                }
            } else if matches!(outcome, Outcome::Applied) {
                let what = if f.action.changes_records() { "repaired" } else { "reported" };
                info!(kind = f.kind.as_str(), address = %f.address, owner = %f.owner, action = %f.action, "{what}");
                if f.action == Action::Release {
                    if let Ok(ip) = cidr::parse_ip(&f.address) {
                        self.leaks.forget(ip);
                    }
                }
            }
            outcomes.push(outcome);
        }
        Ok(PassResult { report, outcomes, ranges, backend })
    }

    /// Drop findings a fresh read of the one object contradicts (a race with a create).
    async fn confirm(&self, report: &mut Report) {
        if report.findings.len() > MAX_CONFIRM {
            return;
        }
        let ipaddrs: Api<IPAddress> = Api::all(self.client.clone());
        let mut keep = Vec::with_capacity(report.findings.len());
        for f in std::mem::take(&mut report.findings) {
            let still = match (f.kind, &self.target) {
                (Kind::MissingRecord, Target::Etcd(store)) => match cidr::parse_ip(&f.address) {
                    Ok(ip) => !store.has(ip).await.unwrap_or(false),
                    Err(_) => true,
                },
                (Kind::MissingRecord, _) => matches!(ipaddrs.get_opt(&f.address).await, Ok(None)),
                (Kind::Leak | Kind::WrongReference, Target::IpAddress { .. } | Target::Audit) if f.service.is_none() => {
                    match f.record.as_ref().and_then(|r| r.parent.clone()) {
                        Some(p) if p.is_service() => {
                            let api: Api<Service> = Api::namespaced(self.client.clone(), p.namespace.as_deref().unwrap_or_default());
                            match api.get_opt(&p.name).await {
                                Ok(Some(svc)) => {
                                    let holds = k8s::service::held_ips(&svc).contains(&f.address);
                                    // Leak: the parent exists now. Wrong reference: it holds it now.
                                    if f.kind == Kind::Leak { false } else { !holds }
                                }
                                Ok(None) => f.kind == Kind::Leak,
                                Err(_) => true,
                            }
                        }
                        _ => true,
                    }
                }
                _ => true,
            };
            if still {
                keep.push(f);
            } else {
                debug!(kind = f.kind.as_str(), address = %f.address, "finding not confirmed by a fresh read; dropped");
            }
        }
        report.findings = keep;
    }

    async fn apply(&self, f: &Finding) -> Outcome {
        let changed = match (&f.action, &self.target) {
            (Action::Release, Target::Etcd(store)) => match cidr::parse_ip(&f.address) {
                Ok(ip) => store.release(ip).await.map_err(ActionError::from),
                Err(e) => Err(e.into()),
            },
            (Action::Create, Target::Etcd(store)) => match cidr::parse_ip(&f.address) {
                Ok(ip) => match store.allocate(ip, None).await {
                    Ok(()) | Err(StoreError::Alloc(crate::alloc::AllocError::Allocated)) => Ok(()),
                    Err(e) => Err(e.into()),
                },
                Err(e) => Err(e.into()),
            },
            (Action::Release, Target::IpAddress { .. }) => match &f.record {
                Some(r) => self.delete_record(r).await,
                None => Err(ActionError::NoRecord("release")),
            },
            (Action::Create, Target::IpAddress { manager, .. }) => self.create_record(&f.address, f.service.as_ref(), manager).await,
            (Action::Replace, Target::IpAddress { manager, .. }) => match &f.record {
                Some(r) => match self.delete_record(r).await {
                    Ok(()) => self.create_record(&f.address, f.service.as_ref(), manager).await,
                    Err(e) => Err(e),
                },
                None => Err(ActionError::NoRecord("replace")),
            },
            (Action::Event, _) => Ok(()),
            _ => return Outcome::NotApplied,
        };
        match changed {
            Ok(()) => {
                self.note(f);
                if let Some(ev) = &f.event {
                    self.post(ev).await;
                }
                Outcome::Applied
            }
            Err(e) => Outcome::Failed(e),
        }
    }

    /// Delete one of our IPAddress objects, only if it is still the object that was read.
    async fn delete_record(&self, r: &RecordView) -> Result<(), ActionError> {
        let api: Api<IPAddress> = Api::all(self.client.clone());
        let dp = DeleteParams { preconditions: Some(Preconditions { uid: r.uid.clone(), resource_version: r.resource_version.clone() }), ..Default::default() };
        match api.delete(&r.name, &dp).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(ActionError::Changed(r.name.clone())),
            Err(e) => Err(ActionError::Api { what: "deleting", name: r.name.clone(), source: Arc::new(e) }),
        }
    }

    async fn create_record(&self, address: &str, service: Option<&(String, String)>, manager: &str) -> Result<(), ActionError> {
        let Some((ns, name)) = service else { return Err(ActionError::NoService) };
        let ip = cidr::parse_ip(address)?;
        let obj = k8s::ipaddress::build(ip, (&ParentRef::service(ns, name)).into(), manager);
        let api: Api<IPAddress> = Api::all(self.client.clone());
        match api.create(&PostParams::default(), &obj).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()), // recorded meanwhile
            Err(e) => Err(ActionError::Api { what: "creating", name: ip.to_string(), source: Arc::new(e) }),
        }
    }

    async fn post(&self, ev: &decide::EventText) {
        let Some(recorder) = &self.recorder else { return };
        let reference = match &ev.target {
            EventTarget::Service { namespace, name, uid } => ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Service".into()),
                namespace: Some(namespace.clone()),
                name: Some(name.clone()),
                uid: uid.clone(),
                ..Default::default()
            },
            EventTarget::IpAddress { name, uid } => ObjectReference {
                api_version: Some("networking.k8s.io/v1".into()),
                kind: Some("IPAddress".into()),
                name: Some(name.clone()),
                uid: uid.clone(),
                ..Default::default()
            },
        };
        let e = Event { type_: EventType::Warning, reason: ev.reason.into(), note: Some(ev.note.clone()), action: ev.action.into(), secondary: None };
        if let Err(err) = recorder.publish(&e, &reference).await {
            debug!(error = %err, reason = ev.reason, "could not publish an Event");
        }
    }
}

/// Every Service of every namespace, [`PAGE`] at a time, each decoded only as far as the
/// pass reads it ([`ServiceSummary`]).
pub async fn list_services(client: &kube::Client, progress: Progress<'_>) -> Result<Vec<ServiceView>, RepairError> {
    list_all("Services", progress, |lp| service_page(client, lp), summary_view).await
}

/// One page of every namespace's Services, as [`ServiceSummary`]s.
async fn service_page(client: &kube::Client, lp: ListParams) -> Result<ObjectList<ServiceSummary>, kube::Error> {
    let req = kube::core::Request::new(<Service as kube::Resource>::url_path(&(), None)).list(&lp).map_err(kube::Error::BuildRequest)?;
    client.request(req).await
}

/// Every IPAddress object, [`PAGE`] at a time.
pub async fn list_ipaddresses(client: &kube::Client, progress: Progress<'_>) -> Result<Vec<RecordView>, RepairError> {
    let api: Api<IPAddress> = Api::all(client.clone());
    let now = k8s_openapi::jiff::Timestamp::now();
    list_all("IPAddresses", progress, |lp| { let api = api.clone(); async move { api.list(&lp).await } }, |a| record_view(a, now)).await
}

/// Every address the cluster holds: the Services' addresses and the names of every
/// IPAddress object (read as metadata only, so an object with a garbled spec still counts).
/// What `clusterip repair --rebuild` rebuilds an unreadable allocation map from.
pub async fn cluster_addresses(client: &kube::Client) -> Result<BTreeSet<IpAddr>, RepairError> {
    let mut all: BTreeSet<IpAddr> = list_all("Services", &|_, _| {}, |lp| service_page(client, lp), |s| s.held_ips())
        .await?
        .into_iter()
        .flatten()
        .filter_map(|t| cidr::parse_ip(&t).ok())
        .collect();
    let ipaddrs: Api<IPAddress> = Api::all(client.clone());
    let mut token: Option<String> = None;
    loop {
        let lp = ListParams { limit: Some(PAGE), continue_token: token.clone(), ..Default::default() };
        let page = ipaddrs.list_metadata(&lp).await.map_err(|source| RepairError::List { what: "IPAddresses", source })?;
        all.extend(page.items.iter().filter_map(|o| k8s::ipaddress::address(o.metadata.name.as_deref()?)));
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            return Ok(all);
        }
    }
}

/// The ranges of the cluster's ServiceCIDR objects (unparsable ones are skipped, logged).
pub async fn servicecidr_ranges(client: &kube::Client) -> Result<Vec<ServiceCidr>, RepairError> {
    let api: Api<ServiceCIDR> = Api::all(client.clone());
    let list = api.list(&ListParams::default()).await.map_err(|source| RepairError::List { what: "ServiceCIDRs", source })?;
    let mut out = Vec::new();
    for c in list.items.iter().flat_map(k8s::servicecidr::ranges) {
        if !out.contains(&c) {
            out.push(c);
        }
    }
    Ok(out)
}

/// Every page `fetch` returns, each item through `convert`.
async fn list_all<K, V, Page>(what: &'static str, progress: Progress<'_>, fetch: impl Fn(ListParams) -> Page, convert: impl Fn(K) -> V) -> Result<Vec<V>, RepairError>
where
    K: Clone,
    Page: std::future::Future<Output = Result<ObjectList<K>, kube::Error>>,
{
    // A continue token can expire (410 Gone) during a long list: start over, a few times.
    let mut restarts = 0;
    'list: loop {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let lp = ListParams { limit: Some(PAGE), continue_token: token.clone(), ..Default::default() };
            let page = match fetch(lp).await {
                Ok(p) => p,
                Err(kube::Error::Api(s)) if s.code == 410 && restarts < 3 => {
                    restarts += 1;
                    debug!(what, "list continue token expired; listing again");
                    continue 'list;
                }
                Err(source) => return Err(RepairError::List { what, source }),
            };
            out.extend(page.items.into_iter().map(&convert));
            progress(what, out.len());
            token = page.metadata.continue_.filter(|t| !t.is_empty());
            if token.is_none() {
                return Ok(out);
            }
        }
    }
}

/// What the pass needs of a Service decoded whole.
pub fn service_view(svc: Service) -> ServiceView {
    summary_view(svc.into())
}

/// What the pass needs of a Service listed as a [`ServiceSummary`].
pub fn summary_view(svc: ServiceSummary) -> ServiceView {
    let cluster_ips = svc.held_ips();
    let meta = svc.metadata;
    ServiceView {
        namespace: meta.namespace.unwrap_or_default(),
        name: meta.name.unwrap_or_default(),
        uid: meta.uid,
        created: meta.creation_timestamp.map(|t| t.0.as_second()),
        cluster_ips,
        reserved: meta.reserved.map(String::into_boxed_str),
    }
}

/// What the pass needs of an IPAddress.
pub fn record_view(obj: IPAddress, now: k8s_openapi::jiff::Timestamp) -> RecordView {
    let label = |key| k8s::ipaddress::label(&obj.metadata, key).map(str::to_string);
    let (managed_by, family_label) = (label(LABEL_MANAGED_BY), label(LABEL_IP_FAMILY));
    let mut parent = ParentRef::from(&obj.spec.parent_ref);
    parent.namespace = parent.namespace.filter(|n| !n.is_empty());
    RecordView {
        name: obj.metadata.name.unwrap_or_default(),
        uid: obj.metadata.uid,
        resource_version: obj.metadata.resource_version,
        managed_by,
        family_label,
        parent: Some(parent),
        age: obj.metadata.creation_timestamp.map(|t| {
            let secs = now.duration_since(t.0).as_secs_f64();
            Duration::from_secs_f64(secs.max(0.0))
        }),
    }
}

/// The controller's loop: a pass at once, then every `interval`, applying fixes and
/// posting Events. Errors are logged and counted; the loop goes on.
pub async fn run_loop(mut repairer: Repairer, interval: Duration) {
    info!(?interval, "repair loop started");
    loop {
        let started = std::time::Instant::now();
        match repairer.run_once(true, false, None).await {
            Ok(r) => {
                let found = r.report.findings.len();
                if found > 0 {
                    info!(found, remaining = r.remaining(), failed = r.failed(), services = r.report.services, records = r.report.records, took = ?started.elapsed(), "repair pass found drift");
                } else {
                    debug!(services = r.report.services, records = r.report.records, took = ?started.elapsed(), "repair pass: consistent");
                }
            }
            Err(e) => warn!(error = %e, "repair pass failed; retrying at the next interval"),
        }
        // The pass listed every Service and record (tens of MB at 50k Services), all freed
        // by now: hand it back rather than keep it resident until the next pass.
        clusterip_component_base::memory::release_freed();
        tokio::time::sleep(interval).await;
    }
}
