//! Admission of Services: the mutating side assigns ClusterIPs from our ranges and reserves
//! them; the validating side rejects addresses we cannot honour. Answers carry Kubernetes'
//! status codes and words (422 Invalid on `spec.clusterIPs`, 500 when a range is full).
//!
//! A request is judged only by the Service spec it carries and, for an UPDATE, the stored
//! object the kube-apiserver sends with it (`oldObject`): nothing a user can set beyond the
//! spec (labels, annotations) changes the decision. Every address a request adds — on
//! CREATE, and on an UPDATE that turns ExternalName into another type or upgrades to two
//! families — comes from our ranges; addresses the stored object already holds are kept as
//! they are (the apiserver refuses changes to them itself).
//!
//! When an address is held (docs/backends.md, "When a Service address is held"): a Service
//! holds its addresses from the moment it is stored — the kube-apiserver records each as
//! an IPAddress object then, and refuses a second Service the same address with "provided
//! IP is already allocated" — until it no longer holds them. Our records only keep dynamic
//! picks from landing on an address in use. So a requested address that our records hold is
//! refused only when a non-Service owner holds it, or when the apiserver records it right
//! now (read from storage); otherwise it was held for a request that never became a stored
//! Service (a failed or retried create) or for a Service deleted a moment ago, and it is
//! the requester's. Addresses answered here are *in flight* until the apiserver records
//! them for good. A create that fails after our answer holds nothing afterwards, as in stock
//! Kubernetes: the apiserver records the address as the create begins (its IPAddress
//! object, before validation, validating admission, quotas and the write) and deletes that
//! record when the create fails; seeing both, in that order, after our answer, we release
//! the address at once ([`Admission::follow_records`]). One the apiserver never records
//! (a later mutating webhook refused the request, or the watch missed the pair) is
//! released after [`IN_FLIGHT_LIMIT`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::core::response::{StatusCause, StatusDetails, StatusSummary};
use kube::core::Status;
use serde_json::json;
use tokio::sync::broadcast;
use tracing::{debug, info, warn};

use crate::alloc::AllocError;
use crate::cidr::Family;
use crate::history::{Decision as Noted, Notes};
use crate::k8s::service;
use crate::metrics::Metrics;
use crate::store::ipaddress::apiserver_ips::{ApiserverIps, IpChange};
use crate::store::{AllocationStore, ParentRef, StoreError};

use super::clusterips::{self, Decision, FieldError, Plan, Want};
use crate::sync::lock;

/// Dynamic candidates skipped because the cluster already records them, per request.
const MAX_SKIPPED: usize = 64;

/// How many deleted records of answered addresses [`Admission::follow_records`] judges at
/// once (each judgement is one read of a Service from storage).
const DELETIONS_JUDGED_AT_ONCE: usize = 32;

/// How long an address answered here may go unrecorded by the kube-apiserver before it is
/// released: longer than any request can last after our answer (the apiserver's request
/// timeout, `--request-timeout`, 60 s by default), with a margin.
pub const IN_FLIGHT_LIMIT: Duration = Duration::from_secs(90);

/// An address this replica answered that the apiserver has not recorded for good yet.
#[derive(Clone, Debug)]
struct InFlight {
    parent: ParentRef,
    since: Instant,
    /// The apiserver's record of it was seen created after this answer: its deletion now
    /// means the request failed (or the Service was deleted), and frees the address.
    recorded: bool,
}

/// The admission handlers, sharing one allocation store.
pub struct Admission {
    store: Arc<dyn AllocationStore>,
    /// Addresses recorded as IPAddress objects by anyone (the kube-apiserver included).
    recorded: Option<ApiserverIps>,
    /// Addresses answered by this replica and not yet seen recorded.
    in_flight: Mutex<HashMap<IpAddr, InFlight>>,
    /// How long an unrecorded answer is kept before its address is released.
    in_flight_limit: Duration,
    metrics: Option<Arc<Metrics>>,
    /// Where each release of an answer is noted for the address history.
    history: Option<Notes>,
}

/// What one sweep of the in-flight addresses did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepResult {
    /// Recorded by the apiserver: held by a stored Service now.
    pub settled: usize,
    /// Never recorded within the limit: released.
    pub released: Vec<IpAddr>,
    /// Still waiting (young; the check failed and is tried again; or a stored Service holds
    /// it while its record is gone, and it is looked at again after the limit).
    pub waiting: usize,
}

/// A denial with a Kubernetes Status: code, reason, and field causes.
fn deny(req: &AdmissionRequest<Service>, code: u16, reason: &str, message: String, causes: Vec<StatusCause>) -> AdmissionResponse {
    let mut resp = AdmissionResponse::from(req);
    resp.allowed = false;
    resp.result = Status {
        status: Some(StatusSummary::Failure),
        code,
        message,
        metadata: None,
        reason: reason.into(),
        details: Some(StatusDetails {
            name: service_name(req),
            kind: "Service".into(),
            causes,
            group: String::new(),
            uid: String::new(),
            retry_after_seconds: 0,
        }),
    };
    resp
}

/// A dynamic address could not be had. Stock Kubernetes (v1.37) answers a full range with
/// its `NewInternalError`: 500 InternalError, the message `Internal error occurred: failed
/// to allocate a serviceIP for Service "<name>": range is full`, and the inner text as the
/// one cause, with no kind or name in the details. A store that cannot answer now (etcd
/// unreachable, say) is ours alone: 503 ServiceUnavailable with the same inner text, safe
/// to retry.
fn allocation_failed(req: &AdmissionRequest<Service>, err: &StoreError) -> AdmissionResponse {
    let inner = format!("failed to allocate a serviceIP for Service \"{}\": {err}", service_name(req));
    let (code, reason, message) = if err.is_transient() { (503, "ServiceUnavailable", inner.clone()) } else { (500, "InternalError", format!("Internal error occurred: {inner}")) };
    let mut resp = deny(req, code, reason, message, vec![StatusCause { field: String::new(), message: inner, reason: String::new() }]);
    if let Some(details) = resp.result.details.as_mut() {
        details.kind.clear();
        details.name.clear();
    }
    resp
}

fn invalid(req: &AdmissionRequest<Service>, errs: &[FieldError]) -> AdmissionResponse {
    let name = service_name(req);
    let list = errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", ");
    let message = if errs.len() == 1 { format!("Service \"{name}\" is invalid: {list}") } else { format!("Service \"{name}\" is invalid: [{list}]") };
    let causes = errs
        .iter()
        .map(|e| StatusCause { field: e.field.clone(), message: e.message.clone(), reason: e.reason.into() })
        .collect();
    deny(req, 422, "Invalid", message, causes)
}

fn service_name(req: &AdmissionRequest<Service>) -> String {
    req.object
        .as_ref()
        .and_then(|s| s.metadata.name.clone().or_else(|| s.metadata.generate_name.clone()))
        .unwrap_or_else(|| req.name.clone())
}

/// The 422 for a requested address that cannot be had: Kubernetes reports it on
/// `spec.clusterIPs` with the whole slice as the value. An address outside every range is
/// "the provided network does not match the current range" on a real request (Kubernetes'
/// allocator over its ServiceCIDRs) and "not in the valid range" with the range on a dry
/// run (Kubernetes' dry-run allocator checks the family's primary range only).
fn static_failure(req: &AdmissionRequest<Service>, requested: &[String], ip: IpAddr, err: &StoreError) -> AdmissionResponse {
    let mismatched = StoreError::Alloc(AllocError::MismatchedNetwork);
    let err = match err {
        StoreError::Alloc(AllocError::NotInRange { .. }) if !req.dry_run => &mismatched,
        other => other,
    };
    invalid(req, &[FieldError::invalid("spec.clusterIPs", &clusterips::strings_value(requested), format!("failed to allocate IP {ip}: {err}"))])
}

/// The addresses a request's Service asks for, as written.
fn requested_ips(svc: &Service) -> Vec<String> {
    svc.spec.as_ref().map(service::cluster_ips).unwrap_or_default()
}

/// The addresses the stored Service holds (an UPDATE's `oldObject`, which comes from
/// storage, not from the user); none on CREATE or when it was ExternalName or headless.
fn held_before(req: &AdmissionRequest<Service>) -> Vec<IpAddr> {
    if req.operation != Operation::Update {
        return Vec::new();
    }
    let Some(old) = req.old_object.as_ref() else { return Vec::new() };
    if old.spec.as_ref().is_some_and(service::is_external_name) {
        return Vec::new();
    }
    service::held_ips(old).iter().filter_map(|t| crate::cidr::parse_ip(t).ok()).collect()
}

/// Whether an UPDATE's stored object is headless (`clusterIP: None`).
fn was_headless(req: &AdmissionRequest<Service>) -> bool {
    req.old_object.as_ref().and_then(|o| o.spec.as_ref()).is_some_and(service::is_headless)
}

/// What a request asks of us: the plan for its Service, and which of the plan's addresses
/// the stored object already holds (a prefix of it: kept, never reserved again).
struct Work {
    svc: Service,
    plan: Plan,
    held: Vec<IpAddr>,
}

impl Work {
    /// The wants this request adds (after the held prefix).
    fn added(&self) -> &[Want] {
        &self.plan.wants[self.held.len().min(self.plan.wants.len())..]
    }
}

/// Whether the plan keeps every address `held` in place (the same address, or "any" of
/// the same family where the request left the field empty), so that it only adds.
fn keeps(plan: &Plan, held: &[IpAddr]) -> bool {
    held.len() <= plan.wants.len()
        && held.iter().zip(&plan.wants).all(|(h, w)| match *w {
            Want::Static(ip) => ip == *h,
            Want::Dynamic(f) => Family::of(*h) == f,
        })
}

impl Admission {
    pub fn new(store: Arc<dyn AllocationStore>, recorded: Option<ApiserverIps>) -> Self {
        Self { store, recorded, in_flight: Mutex::default(), in_flight_limit: IN_FLIGHT_LIMIT, metrics: None, history: None }
    }

    /// Counting released addresses in `clusterip_webhook_released_addresses_total`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Noting each release of an answer in the address history.
    pub fn with_history(mut self, history: Option<Notes>) -> Self {
        self.history = history;
        self
    }

    fn count_released(&self, reason: &'static str, n: usize) {
        if let Some(m) = &self.metrics {
            m.webhook_released_addresses(reason, n as u64);
        }
    }

    fn note(&self, ip: IpAddr, parent: &ParentRef, decision: Noted) {
        if let Some(h) = &self.history {
            h.note(ip, Some(parent), decision);
        }
    }

    /// With another in-flight limit (tests).
    pub fn with_in_flight_limit(mut self, limit: Duration) -> Self {
        self.in_flight_limit = limit;
        self
    }

    /// Hold `ip` in the store again for `parent`, a stored Service whose record was deleted:
    /// the store may have let it go when the view showed it recorded (the ipaddress backend
    /// settles a pick then), and without the record nothing else keeps it from the next
    /// dynamic pick — until the record is back (the apiserver's repair, or ours).
    async fn hold_for(&self, ip: IpAddr, parent: &ParentRef) {
        match self.store.allocate(ip, Some(parent)).await {
            Ok(()) | Err(StoreError::Alloc(AllocError::Allocated)) => {}
            Err(e) => warn!(%ip, error = %e, "could not hold the address of a Service whose record was deleted"),
        }
    }

    /// Whether a stored Service holds `ip` right now (read from storage; without a view of
    /// the cluster's records: no).
    async fn held_by_service(&self, ip: IpAddr, parent: &ParentRef) -> Result<bool, StoreError> {
        match &self.recorded {
            Some(r) => r.held_by_service(ip, parent).await,
            None => Ok(false),
        }
    }

    fn recorded_elsewhere(&self, ip: IpAddr) -> bool {
        self.recorded.as_ref().map(|r| r.contains(ip)).unwrap_or(false)
    }

    /// Whether the apiserver records `ip` right now, read from storage (without a view of
    /// the cluster's records: assume it does).
    async fn recorded_now(&self, ip: IpAddr) -> Result<bool, StoreError> {
        match &self.recorded {
            Some(r) => r.recorded_now(ip).await,
            None => Ok(true),
        }
    }

    /// A requested address for a Service. Ok(true): newly recorded for this request;
    /// Ok(false): our records already held it for no one who still has it (see the module
    /// docs), and the apiserver's own record decides.
    async fn allocate_static(&self, ip: IpAddr, parent: &ParentRef) -> Result<bool, StoreError> {
        // The view is only a hint: a Service deleted a moment ago may still show.
        if self.recorded_elsewhere(ip) && self.recorded_now(ip).await? {
            return Err(StoreError::Alloc(AllocError::Allocated));
        }
        match self.store.allocate(ip, Some(parent)).await {
            Ok(()) => Ok(true),
            Err(StoreError::Alloc(AllocError::Allocated)) => {
                if let Some(owner) = self.store.owner(ip).await? {
                    debug!(%ip, %owner, "requested address held by a recorded owner");
                    return Err(StoreError::Alloc(AllocError::Allocated));
                }
                if self.recorded_now(ip).await? {
                    return Err(StoreError::Alloc(AllocError::Allocated));
                }
                debug!(%ip, service = %parent, "requested address held in our records for no stored Service; the apiserver's record decides");
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Remember what this replica answered until the apiserver records it.
    fn answered(&self, ips: &[IpAddr], parent: &ParentRef) {
        let now = Instant::now();
        let mut f = lock(&self.in_flight);
        for ip in ips {
            f.insert(*ip, InFlight { parent: parent.clone(), since: now, recorded: false });
        }
    }

    /// Release at once what a failed request held (module docs): an address answered here
    /// whose IPAddress record the apiserver created after our answer and then deleted. A
    /// deletion counts only after such a creation, so an earlier holder's deletion arriving
    /// late never frees an address that a request still in flight was given. Changes the
    /// subscription missed (it lagged, or the watch listed anew) leave their addresses to
    /// [`Self::sweep_in_flight`]. Runs until the view's watch ends.
    pub async fn follow_records(self: Arc<Self>, mut changes: broadcast::Receiver<IpChange>) {
        // Each deletion is judged on a task of its own: the judgement reads the Service
        // from storage, and one at a time a loaded apiserver would let them queue behind
        // creates — while the store keeps each pick until it is given back here.
        let judging = Arc::new(tokio::sync::Semaphore::new(DELETIONS_JUDGED_AT_ONCE));
        loop {
            let ip = match changes.recv().await {
                Ok(IpChange::Added(ip)) => {
                    if let Some(e) = lock(&self.in_flight).get_mut(&ip) {
                        e.recorded = true;
                    }
                    continue;
                }
                Ok(IpChange::Deleted(ip)) => ip,
                Ok(IpChange::Relisted) => continue,
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    debug!(missed, "fell behind the IPAddress watch; answers whose request failed meanwhile are released after the in-flight limit");
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            let Some(entry) = lock(&self.in_flight).get(&ip).filter(|e| e.recorded).cloned() else { continue };
            let Ok(permit) = judging.clone().acquire_owned().await else { return };
            let me = self.clone();
            tokio::spawn(async move {
                me.record_deleted(ip, &entry).await;
                drop(permit);
            });
        }
    }

    /// The record of `ip`, answered here for `entry` and seen recorded, was deleted: release
    /// the address unless a stored Service still holds it.
    async fn record_deleted(&self, ip: IpAddr, entry: &InFlight) {
        // A record deleted under a Service that still holds the address (the
        // kube-apiserver's repair deletes and recreates a record its informers judge
        // wrong; a delete by hand) is no failed create: kept, until the record is back or
        // the in-flight sweep settles it.
        match self.held_by_service(ip, &entry.parent).await {
            Ok(false) => {}
            Ok(true) => {
                info!(%ip, service = %entry.parent, "the IPAddress of an address this replica answered was deleted while its Service still holds it; kept (not released)");
                self.hold_for(ip, &entry.parent).await;
                if let Some(e) = lock(&self.in_flight).get_mut(&ip).filter(|e| e.since == entry.since) {
                    e.recorded = false;
                }
                return;
            }
            Err(e) => {
                warn!(%ip, error = %e, "could not read whether a Service holds an address whose record was deleted; it goes after the in-flight limit");
                return;
            }
        }
        if lock(&self.in_flight).get(&ip).is_none_or(|e| e.since != entry.since) {
            // Answered again meanwhile (a retry of the same Service): that answer's now.
            return;
        }
        match self.store.release_owned(ip, &entry.parent).await {
            Ok(()) => {
                debug!(%ip, service = %entry.parent, "released an address the apiserver recorded after our answer and released again (the create failed, or the Service was deleted)");
                self.count_released("apiserver_released", 1);
                self.note(ip, &entry.parent, Noted::CreateFailed);
            }
            Err(StoreError::NotOwner { .. }) => {}
            Err(e) => {
                warn!(%ip, error = %e, "could not release an address whose create failed; it goes after the in-flight limit");
                return;
            }
        }
        self.forget_if_unchanged(ip, entry);
    }

    /// Drop `ip`'s in-flight entry, unless answered again meanwhile (a retry of the same
    /// Service).
    fn forget_if_unchanged(&self, ip: IpAddr, entry: &InFlight) {
        let mut f = lock(&self.in_flight);
        if f.get(&ip).is_some_and(|e| e.since == entry.since) {
            f.remove(&ip);
        }
    }

    /// Addresses answered and not yet seen recorded (for tests and metrics).
    pub fn in_flight(&self) -> usize {
        lock(&self.in_flight).len()
    }

    /// Past the in-flight limit: settle what the apiserver records (the Service was
    /// stored); release what it does not (the request failed and [`Self::follow_records`]
    /// did not see it), after reading from storage that it still does not. Younger answers
    /// wait: their record may still be created, or deleted by a failing create.
    pub async fn sweep_in_flight(&self) -> SweepResult {
        let now = Instant::now();
        let mut result = SweepResult::default();
        let candidates: Vec<(IpAddr, InFlight)> = {
            let mut f = lock(&self.in_flight);
            let before = f.len();
            let old = |e: &InFlight| now.saturating_duration_since(e.since) >= self.in_flight_limit;
            f.retain(|ip, e| !(old(e) && self.recorded_elsewhere(*ip)));
            result.settled = before - f.len();
            f.iter().filter(|(_, e)| old(e)).map(|(ip, e)| (*ip, e.clone())).collect()
        };
        for (ip, entry) in candidates {
            let done = match self.recorded_now(ip).await {
                Ok(true) => {
                    result.settled += 1;
                    true
                }
                Ok(false) => match self.held_by_service(ip, &entry.parent).await {
                    // Stored, its record deleted meanwhile: the Service holds it (the repair
                    // pass records it again); never released. It stays in flight, anew: the
                    // next sweep past the limit settles it once the record is back, or
                    // releases it if the Service went meanwhile without one (else the hold
                    // would outlive the Service).
                    Ok(true) => {
                        self.hold_for(ip, &entry.parent).await;
                        let mut f = lock(&self.in_flight);
                        if let Some(e) = f.get_mut(&ip).filter(|e| e.since == entry.since) {
                            e.since = Instant::now();
                            e.recorded = false;
                        }
                        false
                    }
                    Err(e) => {
                        warn!(%ip, error = %e, "could not read whether a Service holds an answered address; trying again");
                        false
                    }
                    Ok(false) => match self.store.release_owned(ip, &entry.parent).await {
                    Ok(()) => {
                        debug!(%ip, service = %entry.parent, "released an address the apiserver never recorded (the request failed)");
                        self.note(ip, &entry.parent, Noted::NeverRecorded);
                        result.released.push(ip);
                        true
                    }
                    Err(StoreError::NotOwner { .. }) => true,
                    Err(e) => {
                        warn!(%ip, error = %e, "could not release an address whose request failed; trying again");
                        false
                    }
                    },
                },
                Err(e) => {
                    warn!(%ip, error = %e, "could not check whether an answered address was recorded; trying again");
                    false
                }
            };
            if done {
                self.forget_if_unchanged(ip, &entry);
            }
        }
        result.waiting = self.in_flight();
        self.count_released("in_flight_limit", result.released.len());
        result
    }

    /// Settle every answer of this replica before it exits, its webhook stopped (so nothing
    /// new is answered): an answer whose Service is stored holding it (read from storage) is
    /// settled for good; one whose create failed is released as [`Self::follow_records`]
    /// sees the apiserver drop its record; one never recorded is released once past the
    /// in-flight limit, as [`Self::sweep_in_flight`] does while serving. Returns when none
    /// is left, or after the limit (every answer is older than it then). Left behind, an
    /// answer whose request failed would hold its address until the repair pass — minutes,
    /// three passes, with the etcd backend's map. The periodic sweep must not run meanwhile
    /// (one sweeper at a time releases an address once).
    pub async fn settle_before_exit(&self) -> SweepResult {
        use futures::StreamExt;
        let deadline = Instant::now() + self.in_flight_limit + Duration::from_secs(1);
        let mut total = SweepResult::default();
        loop {
            // Only what the apiserver records can be stored (it records an address before it
            // stores the Service): an answer it does not is left to the sweep, unread.
            let recorded: Vec<(IpAddr, InFlight)> = lock(&self.in_flight).iter().filter(|(ip, e)| e.recorded || self.recorded_elsewhere(**ip)).map(|(ip, e)| (*ip, e.clone())).collect();
            let stored: Vec<(IpAddr, InFlight)> = futures::stream::iter(recorded)
                .map(|(ip, entry)| async move { matches!(self.held_by_service(ip, &entry.parent).await, Ok(true)).then_some((ip, entry)) })
                .buffer_unordered(DELETIONS_JUDGED_AT_ONCE)
                .filter_map(|x| async move { x })
                .collect()
                .await;
            for (ip, entry) in stored {
                self.forget_if_unchanged(ip, &entry);
                total.settled += 1;
            }
            let swept = self.sweep_in_flight().await;
            total.settled += swept.settled;
            total.released.extend(swept.released);
            if self.in_flight() == 0 || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        total.waiting = self.in_flight();
        total
    }

    /// A dynamic address that no IPAddress object holds yet. Candidates the cluster already
    /// records stay reserved in our store (they are taken) and the next one is tried.
    async fn allocate_dynamic(&self, family: Family, parent: &ParentRef) -> Result<IpAddr, StoreError> {
        for _ in 0..MAX_SKIPPED {
            let ip = self.store.allocate_next(family, Some(parent)).await?;
            if !self.recorded_elsewhere(ip) {
                return Ok(ip);
            }
            debug!(%ip, "candidate already recorded as an IPAddress; keeping it reserved and trying the next");
        }
        Err(StoreError::Unavailable(format!("{MAX_SKIPPED} candidates in a row were already recorded as IPAddress objects; run `clusterip repair` to sync the records").into()))
    }

    pub fn store(&self) -> &Arc<dyn AllocationStore> {
        &self.store
    }

    /// What the request asks of us, or None when it adds no address (an UPDATE that keeps
    /// its addresses, or changes them — which the apiserver refuses itself), or the
    /// response that ends the request.
    fn work_for(&self, req: &AdmissionRequest<Service>) -> Result<Option<Work>, Box<AdmissionResponse>> {
        if !matches!(req.operation, Operation::Create | Operation::Update) {
            return Ok(None);
        }
        let Some(svc) = req.object.clone() else {
            return Err(Box::new(deny(req, 400, "BadRequest", "the admission request carries no Service object".into(), Vec::new())));
        };
        let spec = svc.spec.clone().unwrap_or_default();
        let plan = match clusterips::plan(&spec, &self.store.families()) {
            Ok(Decision::NoAddress) => return Ok(None),
            Ok(Decision::Allocate(plan)) => plan,
            // On UPDATE the apiserver validates the whole spec itself; we only speak for
            // what a create asks.
            Err(_) if req.operation == Operation::Update => return Ok(None),
            Err(errs) => return Err(Box::new(invalid(req, &errs))),
        };
        if req.operation == Operation::Update && was_headless(req) {
            // Headless stays headless: the apiserver refuses the change itself.
            return Ok(None);
        }
        let held = held_before(req);
        if !keeps(&plan, &held) || plan.wants.len() == held.len() {
            return Ok(None);
        }
        Ok(Some(Work { svc, plan, held }))
    }

    /// Mutating admission: reserve the addresses the request adds and patch them in.
    pub async fn mutate(&self, req: &AdmissionRequest<Service>) -> AdmissionResponse {
        let work = match self.work_for(req) {
            Ok(Some(w)) => w,
            Ok(None) => return AdmissionResponse::from(req),
            Err(resp) => return *resp,
        };
        let requested = requested_ips(&work.svc);
        if req.dry_run {
            // Reserve nothing; requested addresses are checked against the ranges only, as
            // Kubernetes' dry-run allocator does (whether they are taken is not judged).
            return match self.check_static(req, &work, &requested).await {
                Some(resp) => resp,
                None => AdmissionResponse::from(req),
            };
        }
        let namespace = req.namespace.clone().unwrap_or_else(|| "default".into());
        // A Service created with generateName has no name yet: its parent is named "" (the
        // apiserver chooses the name after admission), which stores match with any name.
        let name = req.object.as_ref().and_then(|s| s.metadata.name.clone()).filter(|n| !n.is_empty()).unwrap_or_else(|| req.name.clone());
        let parent = ParentRef::service(&namespace, &name);
        let mut got: Vec<IpAddr> = Vec::new();
        // What this request newly recorded (and gives back if it fails here).
        let mut recorded_here: Vec<IpAddr> = Vec::new();
        for want in work.added() {
            let result = match *want {
                Want::Static(ip) => self.allocate_static(ip, &parent).await.map(|new| (ip, new)).map_err(|e| (Some(ip), e)),
                Want::Dynamic(family) => self.allocate_dynamic(family, &parent).await.map(|ip| (ip, true)).map_err(|e| (None, e)),
            };
            match result {
                Ok((ip, new)) => {
                    got.push(ip);
                    if new {
                        recorded_here.push(ip);
                    }
                }
                Err((ip, err)) => {
                    self.rollback(&recorded_here, &parent).await;
                    return match ip {
                        Some(ip) => static_failure(req, &requested, ip, &err),
                        None => allocation_failed(req, &err),
                    };
                }
            }
        }
        let plan = &work.plan;
        // A requested address keeps the user's spelling (`fd00:10:96:0::5` stays so, as in
        // stock Kubernetes); a chosen one is written canonically.
        let ips: Vec<String> = work
            .held
            .iter()
            .chain(&got)
            .enumerate()
            .map(|(i, ip)| match (work.plan.wants.get(i), requested.get(i)) {
                (Some(Want::Static(_)), Some(text)) => text.clone(),
                _ => ip.to_string(),
            })
            .collect();
        // The patch must apply to the object as sent: one without a spec gets one first
        // (an `add` below a missing parent fails the whole patch at the apiserver).
        let mut ops = Vec::with_capacity(5);
        if work.svc.spec.is_none() {
            ops.push(json!({"op": "add", "path": "/spec", "value": {}}));
        }
        ops.extend([
            json!({"op": "add", "path": "/spec/clusterIP", "value": ips[0]}),
            json!({"op": "add", "path": "/spec/clusterIPs", "value": ips}),
            json!({"op": "add", "path": "/spec/ipFamilies", "value": clusterips::family_names(&plan.families)}),
            json!({"op": "add", "path": "/spec/ipFamilyPolicy", "value": plan.policy}),
        ]);
        let patch: json_patch::Patch = match serde_json::from_value(serde_json::Value::Array(ops)) {
            Ok(p) => p,
            Err(e) => {
                self.rollback(&recorded_here, &parent).await;
                return deny(req, 500, "InternalError", format!("internal error building the patch: {e}"), Vec::new());
            }
        };
        debug!(service = %parent, ips = %ips.join(","), "assigned ClusterIPs");
        match AdmissionResponse::from(req).with_patch(patch) {
            Ok(resp) => {
                self.answered(&got, &parent);
                resp
            }
            Err(e) => {
                self.rollback(&recorded_here, &parent).await;
                deny(req, 500, "InternalError", format!("internal error serializing the patch: {e}"), Vec::new())
            }
        }
    }

    async fn rollback(&self, got: &[IpAddr], parent: &ParentRef) {
        for ip in got {
            if let Err(e) = self.store.release_owned(*ip, parent).await {
                warn!(%ip, error = %e, "could not release an address after a failed admission; repair will reclaim it");
            }
        }
    }

    /// Validating admission: every address the request adds must lie in our ranges. Whether
    /// it is free is not judged here: our mutating webhook has reserved it for this very
    /// request (so our records hold it), and the kube-apiserver's own IPAddress record refuses
    /// an address another Service holds with the same words.
    pub async fn validate(&self, req: &AdmissionRequest<Service>) -> AdmissionResponse {
        if req.dry_run {
            // Nothing is stored. The mutating side has checked what the user asked for; the
            // addresses here are the apiserver's dry-run placeholders (the network address
            // of its range), which stock Kubernetes returns as they are.
            return AdmissionResponse::from(req);
        }
        let work = match self.work_for(req) {
            Ok(Some(w)) => w,
            Ok(None) => return AdmissionResponse::from(req),
            Err(resp) => return *resp,
        };
        let requested = requested_ips(&work.svc);
        match self.check_static(req, &work, &requested).await {
            Some(resp) => resp,
            None => AdmissionResponse::from(req),
        }
    }

    /// Range checks of the requested addresses the request adds; reserves nothing.
    async fn check_static(&self, req: &AdmissionRequest<Service>, work: &Work, requested: &[String]) -> Option<AdmissionResponse> {
        let ranges = self.store.ranges();
        for want in work.added() {
            let Want::Static(ip) = *want else { continue };
            if !ranges.iter().any(|c| c.contains(ip)) {
                let valid: Vec<String> = ranges.iter().filter(|c| c.family() == Family::of(ip)).map(|c| c.to_string()).collect();
                let err = StoreError::Alloc(AllocError::NotInRange { ip, valid_range: valid.join(", ") });
                return Some(static_failure(req, requested, ip, &err));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::ServiceCidr;
    use crate::store::memory::MemoryStore;
    use serde_json::Value;

    const V4: &str = "198.19.0.0/24";
    const V6: &str = "fd00:10:96::/120";

    fn admission() -> (Admission, Arc<MemoryStore>) {
        let store = Arc::new(MemoryStore::new(vec![ServiceCidr::parse(V4).expect("v4"), ServiceCidr::parse(V6).expect("v6")]));
        (Admission::new(store.clone(), None), store)
    }

    /// An AdmissionRequest as the kube-apiserver sends it.
    fn request(operation: &str, object: Value, old: Option<Value>) -> AdmissionRequest<Service> {
        let review = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Service"},
                "resource": {"group": "", "version": "v1", "resource": "services"},
                "name": "web", "namespace": "default", "operation": operation,
                "userInfo": {"username": "admin"}, "object": object, "oldObject": old, "dryRun": false
            }
        });
        super::super::server::parse_review(review.to_string().as_bytes()).expect("review")
    }

    fn service(spec: Value, annotations: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default", "annotations": annotations}, "spec": spec})
    }

    /// The patch of an allowed answer, as (path, value) pairs.
    fn patched(resp: &AdmissionResponse) -> Vec<(String, Value)> {
        assert!(resp.allowed, "denied: {:?}", resp.result);
        let Some(patch) = resp.patch.as_ref() else { return Vec::new() };
        let ops: Vec<Value> = serde_json::from_slice(patch).expect("JSON patch");
        ops.iter().map(|op| (op["path"].as_str().unwrap_or_default().to_string(), op["value"].clone())).collect()
    }

    fn value<'a>(patch: &'a [(String, Value)], path: &str) -> &'a Value {
        &patch.iter().find(|(p, _)| p == path).unwrap_or_else(|| panic!("no {path} in {patch:?}")).1
    }

    #[tokio::test]
    async fn a_create_gets_an_address_of_ours_and_no_annotation() {
        let (adm, store) = admission();
        let resp = adm.mutate(&request("CREATE", service(json!({"ports": [{"port": 80}]}), json!({})), None)).await;
        let patch = patched(&resp);
        let ip: IpAddr = value(&patch, "/spec/clusterIP").as_str().expect("clusterIP").parse().expect("ip");
        assert!(ServiceCidr::parse(V4).expect("v4").contains(ip));
        assert!(store.has(ip).await.expect("has"), "reserved");
        assert!(patch.iter().all(|(p, _)| !p.starts_with("/metadata")), "{patch:?}");
    }

    #[tokio::test]
    async fn the_patch_applies_to_a_service_sent_without_a_spec() {
        // Found by fuzzing (tests/fuzz/corpus/admission/crash-create-without-spec): the
        // patch added below a /spec the object did not have, so it could not be applied.
        let (adm, _) = admission();
        let object = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"}});
        let resp = adm.mutate(&request("CREATE", object.clone(), None)).await;
        assert!(resp.allowed, "{:?}", resp.result);
        let patch: json_patch::Patch = serde_json::from_slice(resp.patch.as_deref().expect("a patch")).expect("JSON patch");
        let mut doc = object;
        json_patch::patch(&mut doc, &patch).expect("the patch applies");
        let ip: IpAddr = doc["spec"]["clusterIP"].as_str().expect("clusterIP").parse().expect("ip");
        assert!(ServiceCidr::parse(V4).expect("v4").contains(ip));
    }

    #[tokio::test]
    async fn a_create_without_an_object_is_denied_with_a_status_code() {
        // Found by fuzzing (tests/fuzz/corpus/admission/crash-create-without-an-object): the
        // denial carried a message but code 0, which the kube-apiserver turns into a 400
        // "without explanation"; it is ours to say.
        let (adm, _) = admission();
        let resp = adm.mutate(&request("CREATE", Value::Null, None)).await;
        assert!(!resp.allowed);
        assert_eq!((resp.result.code, resp.result.reason.as_str()), (400, "BadRequest"));
        assert_eq!(resp.result.message, "the admission request carries no Service object");
    }

    #[tokio::test]
    async fn an_annotation_set_by_hand_steers_nothing() {
        let (adm, store) = admission();
        let ip: IpAddr = "198.19.0.7".parse().expect("ip");
        // The annotation earlier versions trusted, naming the requested address: the
        // address is still reserved (and so never handed out to anyone else).
        let svc = service(json!({"clusterIP": "198.19.0.7", "ports": [{"port": 80}]}), json!({crate::k8s::annotations::RESERVED: "198.19.0.7"}));
        let resp = adm.mutate(&request("CREATE", svc.clone(), None)).await;
        assert!(resp.allowed, "{:?}", resp.result);
        assert!(store.has(ip).await.expect("has"), "the requested address was not reserved");
        // A second Service asking for it, with the same annotation copied, is refused.
        let resp = adm.mutate(&request("CREATE", svc, None)).await;
        assert!(!resp.allowed);
        assert_eq!(resp.result.code, 422);
        assert!(resp.result.message.contains("provided IP is already allocated"), "{}", resp.result.message);
    }

    #[tokio::test]
    async fn a_family_upgrade_adds_an_address_of_ours_and_keeps_the_first() {
        let (adm, store) = admission();
        let old = service(json!({"clusterIP": "198.19.0.40", "clusterIPs": ["198.19.0.40"], "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "ports": [{"port": 80}]}), json!({}));
        let mut new = old.clone();
        new["spec"]["ipFamilyPolicy"] = json!("RequireDualStack");
        let patch = patched(&adm.mutate(&request("UPDATE", new, Some(old))).await);
        let ips = value(&patch, "/spec/clusterIPs").as_array().expect("clusterIPs").clone();
        assert_eq!(ips[0], "198.19.0.40");
        let v6: IpAddr = ips[1].as_str().expect("v6").parse().expect("ip");
        assert!(ServiceCidr::parse(V6).expect("v6").contains(v6), "{v6}");
        assert_eq!(value(&patch, "/spec/ipFamilies"), &json!(["IPv4", "IPv6"]));
        // Only the new address was reserved: the kept one is the stored object's already.
        assert_eq!(store.allocated().await.expect("allocated"), vec![v6]);
    }

    #[tokio::test]
    async fn updates_that_add_nothing_or_change_held_addresses_are_left_alone() {
        let (adm, store) = admission();
        let old = service(json!({"clusterIP": "198.19.0.40", "clusterIPs": ["198.19.0.40"], "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "ports": [{"port": 80}]}), json!({}));
        // A label change: nothing to add.
        let mut same = old.clone();
        same["metadata"]["labels"] = json!({"a": "b"});
        assert!(patched(&adm.mutate(&request("UPDATE", same, Some(old.clone()))).await).is_empty());
        // A changed primary address: the apiserver refuses it ("field is immutable"); we
        // reserve nothing for a request that will fail.
        let mut moved = old.clone();
        moved["spec"]["clusterIP"] = json!("198.19.0.41");
        moved["spec"]["clusterIPs"] = json!(["198.19.0.41"]);
        assert!(patched(&adm.mutate(&request("UPDATE", moved, Some(old))).await).is_empty());
        // Headless stays headless.
        let headless = service(json!({"clusterIP": "None", "clusterIPs": ["None"], "ports": [{"port": 80}]}), json!({}));
        let mut unheaded = headless.clone();
        unheaded["spec"]["clusterIP"] = json!("");
        unheaded["spec"]["clusterIPs"] = json!([]);
        assert!(patched(&adm.mutate(&request("UPDATE", unheaded, Some(headless))).await).is_empty());
        assert!(store.allocated().await.expect("allocated").is_empty());
    }

    #[tokio::test]
    async fn externalname_to_clusterip_gets_an_address_of_ours() {
        let (adm, _) = admission();
        let old = service(json!({"type": "ExternalName", "externalName": "example.invalid"}), json!({}));
        let new = service(json!({"type": "ClusterIP", "ports": [{"port": 80}]}), json!({}));
        let patch = patched(&adm.mutate(&request("UPDATE", new, Some(old))).await);
        let ip: IpAddr = value(&patch, "/spec/clusterIP").as_str().expect("clusterIP").parse().expect("ip");
        assert!(ServiceCidr::parse(V4).expect("v4").contains(ip));
    }

    /// Admission beside a fixed view of what the apiserver records (the view also answers
    /// the storage reads).
    fn admission_recording(recorded: &[&str]) -> (Admission, Arc<MemoryStore>) {
        let store = Arc::new(MemoryStore::new(vec![ServiceCidr::parse(V4).expect("v4"), ServiceCidr::parse(V6).expect("v6")]));
        let view = ApiserverIps::fixed(recorded.iter().map(|t| t.parse::<IpAddr>().expect("ip")));
        (Admission::new(store.clone(), Some(view)).with_in_flight_limit(std::time::Duration::ZERO), store)
    }

    #[tokio::test]
    async fn a_requested_address_held_for_no_stored_service_is_the_requesters() {
        let (adm, store) = admission_recording(&["198.19.0.8"]);
        // Held in our records for a request that never became a stored Service.
        store.allocate("198.19.0.7".parse().expect("ip"), Some(&ParentRef::service("default", "failed"))).await.expect("leftover");
        let svc = service(json!({"clusterIP": "198.19.0.7", "ports": [{"port": 80}]}), json!({}));
        assert!(adm.mutate(&request("CREATE", svc, None)).await.allowed, "a leftover record refused the address");
        // Recorded by the apiserver: a stored Service holds it.
        store.allocate("198.19.0.8".parse().expect("ip"), None).await.expect("record");
        let svc = service(json!({"clusterIP": "198.19.0.8", "ports": [{"port": 80}]}), json!({}));
        let resp = adm.mutate(&request("CREATE", svc, None)).await;
        assert_eq!(resp.result.code, 422);
        assert!(resp.result.message.contains("provided IP is already allocated"), "{}", resp.result.message);
        // Held by an owner other than a Service.
        let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: "edge".into() };
        store.allocate("198.19.0.9".parse().expect("ip"), Some(&gateway)).await.expect("owned");
        let svc = service(json!({"clusterIP": "198.19.0.9", "ports": [{"port": 80}]}), json!({}));
        assert_eq!(adm.mutate(&request("CREATE", svc, None)).await.result.code, 422);
    }

    #[tokio::test]
    async fn without_a_view_of_the_cluster_a_held_address_is_refused() {
        // Nothing to judge the holder by: the records decide.
        let (adm, store) = admission();
        store.allocate("198.19.0.7".parse().expect("ip"), None).await.expect("held");
        let svc = service(json!({"clusterIP": "198.19.0.7", "ports": [{"port": 80}]}), json!({}));
        assert_eq!(adm.mutate(&request("CREATE", svc, None)).await.result.code, 422);
    }

    #[tokio::test]
    async fn answers_the_apiserver_never_records_are_released_and_recorded_ones_settle() {
        let (adm, store) = admission_recording(&[]);
        let resp = adm.mutate(&request("CREATE", service(json!({"ports": [{"port": 80}]}), json!({})), None)).await;
        let ip: IpAddr = value(&patched(&resp), "/spec/clusterIP").as_str().expect("clusterIP").parse().expect("ip");
        assert_eq!(adm.in_flight(), 1);
        let swept = adm.sweep_in_flight().await;
        assert_eq!(swept.released, vec![ip]);
        assert!(!store.has(ip).await.expect("has"), "never recorded, yet still held");
        // Within the limit, an answer is kept waiting (its request may still be stored).
        let (adm, store) = admission_recording(&[]);
        let adm = adm.with_in_flight_limit(std::time::Duration::from_secs(3600));
        let resp = adm.mutate(&request("CREATE", service(json!({"ports": [{"port": 80}]}), json!({})), None)).await;
        let ip: IpAddr = value(&patched(&resp), "/spec/clusterIP").as_str().expect("clusterIP").parse().expect("ip");
        let swept = adm.sweep_in_flight().await;
        assert_eq!((swept.released.len(), swept.waiting), (0, 1), "{swept:?}");
        assert!(store.has(ip).await.expect("has"));
    }

    #[tokio::test]
    async fn before_exit_an_unrecorded_answer_is_released_once_past_the_limit_and_no_later() {
        let limit = std::time::Duration::from_secs(1);
        let (adm, store) = admission_recording(&[]);
        let notes = crate::history::Notes::new("replica-0");
        let adm = adm.with_in_flight_limit(limit).with_history(Some(notes.clone()));
        let resp = adm.mutate(&request("CREATE", service(json!({"ports": [{"port": 80}]}), json!({})), None)).await;
        let ip: IpAddr = value(&patched(&resp), "/spec/clusterIP").as_str().expect("clusterIP").parse().expect("ip");
        let started = Instant::now();
        let settled = adm.settle_before_exit().await;
        assert!(started.elapsed() >= limit / 2, "released after {:?}, before the limit {limit:?} could pass", started.elapsed());
        assert_eq!((settled.released, settled.waiting), (vec![ip], 0));
        assert!(!store.has(ip).await.expect("has"), "an answer never recorded still held after the exit settle");
        // The release is noted for the address history, with its reason.
        let noted = notes.lines();
        assert!(noted.len() == 1 && noted[0].ends_with(&format!(" ! {ip} services/default/web replica-0 never-recorded")), "{noted:?}");
        // Nothing answered: nothing to wait for.
        let (adm, _) = admission_recording(&[]);
        let started = Instant::now();
        assert_eq!(adm.with_in_flight_limit(std::time::Duration::from_secs(3600)).settle_before_exit().await, SweepResult::default());
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_create_that_fails_after_our_answer_frees_its_address_when_the_apiserver_releases_its_record() {
        let (adm, store) = admission_recording(&[]);
        let adm = Arc::new(adm.with_in_flight_limit(std::time::Duration::from_secs(3600)));
        let (tx, rx) = broadcast::channel(16);
        let follower = tokio::spawn(adm.clone().follow_records(rx));
        let answer = |adm: Arc<Admission>| async move {
            let resp = adm.mutate(&request("CREATE", service(json!({"ports": [{"port": 80}]}), json!({})), None)).await;
            value(&patched(&resp), "/spec/clusterIP").as_str().expect("clusterIP").parse::<IpAddr>().expect("ip")
        };
        let ip = answer(adm.clone()).await;
        // A deletion not preceded by a creation after our answer (an earlier holder's, seen
        // late) frees nothing: the request may still be stored.
        tx.send(IpChange::Deleted(ip)).expect("send");
        // The apiserver records it as the create begins, then the create fails.
        tx.send(IpChange::Added(ip)).expect("send");
        tx.send(IpChange::Deleted(ip)).expect("send");
        clusterip_test_support::eventually("the address released after the apiserver released its record", Duration::from_secs(10), || {
            let store = store.clone();
            async move { !store.has(ip).await.expect("has") }
        })
        .await;
        assert_eq!(adm.in_flight(), 0);
        // A create that succeeds stays held.
        let kept = answer(adm.clone()).await;
        tx.send(IpChange::Added(kept)).expect("send");
        drop(tx);
        follower.await.expect("follower ends with the watch");
        assert!(store.has(kept).await.expect("has"));
        assert_eq!(adm.in_flight(), 1, "settled by the sweep after the limit, not before");
    }

    #[tokio::test]
    async fn an_early_deletion_does_not_free_an_address_answered_after_it() {
        let (adm, store) = admission_recording(&[]);
        let adm = Arc::new(adm.with_in_flight_limit(std::time::Duration::from_secs(3600)));
        let (tx, rx) = broadcast::channel(16);
        let resp = adm.mutate(&request("CREATE", service(json!({"ports": [{"port": 80}]}), json!({})), None)).await;
        let ip: IpAddr = value(&patched(&resp), "/spec/clusterIP").as_str().expect("clusterIP").parse().expect("ip");
        for change in [IpChange::Deleted(ip), IpChange::Relisted, IpChange::Deleted(ip)] {
            tx.send(change).expect("send");
        }
        drop(tx);
        adm.clone().follow_records(rx).await;
        assert!(store.has(ip).await.expect("has"), "freed by deletions not preceded by a creation after the answer");
        assert_eq!(adm.in_flight(), 1);
    }

    fn create(spec: Value) -> AdmissionRequest<Service> {
        request("CREATE", service(spec, json!({})), None)
    }

    #[tokio::test]
    async fn a_full_range_is_kubernetes_internal_error() {
        // 198.19.0.0/30: two usable addresses.
        let store = Arc::new(MemoryStore::new(vec![ServiceCidr::parse("198.19.0.0/30").expect("v4")]));
        let adm = Admission::new(store.clone(), None);
        for _ in 0..2 {
            assert!(adm.mutate(&create(json!({"ports": [{"port": 80}]}))).await.allowed);
        }
        let resp = adm.mutate(&create(json!({"ports": [{"port": 80}]}))).await;
        assert!(!resp.allowed);
        assert_eq!((resp.result.code, resp.result.reason.as_str()), (500, "InternalError"));
        assert_eq!(resp.result.message, "Internal error occurred: failed to allocate a serviceIP for Service \"web\": range is full");
        let details = resp.result.details.as_ref().expect("details");
        assert_eq!((details.kind.as_str(), details.name.as_str()), ("", ""));
        assert_eq!(store.allocated().await.expect("allocated").len(), 2);
    }

    #[tokio::test]
    async fn a_dual_stack_create_gets_one_address_per_family_in_the_order_asked() {
        let (adm, store) = admission();
        let resp = adm.mutate(&create(json!({"ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv6", "IPv4"], "ports": [{"port": 80}]}))).await;
        let patch = patched(&resp);
        let ips: Vec<IpAddr> = value(&patch, "/spec/clusterIPs").as_array().expect("clusterIPs").iter().map(|v| v.as_str().expect("text").parse().expect("ip")).collect();
        assert_eq!(ips.len(), 2);
        assert!(ServiceCidr::parse(V6).expect("v6").contains(ips[0]) && ServiceCidr::parse(V4).expect("v4").contains(ips[1]), "{ips:?}");
        assert_eq!(value(&patch, "/spec/clusterIP"), &json!(ips[0].to_string()));
        assert_eq!(value(&patch, "/spec/ipFamilies"), &json!(["IPv6", "IPv4"]));
        assert_eq!(value(&patch, "/spec/ipFamilyPolicy"), &json!("RequireDualStack"));
        let mut reserved = store.allocated().await.expect("allocated");
        reserved.sort();
        let mut want = ips.clone();
        want.sort();
        assert_eq!(reserved, want);
    }

    #[tokio::test]
    async fn a_refused_second_address_gives_back_the_first() {
        let (adm, store) = admission();
        store.allocate("fd00:10:96::5".parse().expect("ip"), None).await.expect("held");
        let resp = adm.mutate(&create(json!({"ipFamilyPolicy": "RequireDualStack", "clusterIP": "198.19.0.5", "clusterIPs": ["198.19.0.5", "fd00:10:96::5"], "ports": [{"port": 80}]}))).await;
        assert_eq!(resp.result.code, 422);
        assert!(resp.result.message.contains("failed to allocate IP fd00:10:96::5: provided IP is already allocated"), "{}", resp.result.message);
        assert!(!store.has("198.19.0.5".parse().expect("ip")).await.expect("has"), "the first address was kept after the request failed");
        assert_eq!(adm.in_flight(), 0);
    }

    #[tokio::test]
    async fn an_invalid_create_is_refused_in_kubernetes_words_and_reserves_nothing() {
        let (adm, store) = admission();
        let resp = adm.mutate(&create(json!({"ipFamilyPolicy": "RequireDualStack", "clusterIP": "198.19.0.5", "clusterIPs": ["198.19.0.5", "198.19.0.6"], "ports": [{"port": 80}]}))).await;
        assert!(!resp.allowed);
        assert_eq!((resp.result.code, resp.result.reason.as_str()), (422, "Invalid"));
        assert!(resp.result.message.starts_with("Service \"web\" is invalid: spec.clusterIPs: Invalid value: "), "{}", resp.result.message);
        assert!(resp.result.message.contains("may specify no more than one IP for each IP family"), "{}", resp.result.message);
        assert!(store.allocated().await.expect("allocated").is_empty());
    }

    #[tokio::test]
    async fn headless_deletes_and_dry_runs_reserve_nothing() {
        let (adm, store) = admission();
        let headless = service(json!({"clusterIP": "None", "ports": [{"port": 80}]}), json!({}));
        assert!(patched(&adm.mutate(&request("CREATE", headless, None)).await).is_empty());
        let stored = service(json!({"clusterIP": "198.19.0.40", "clusterIPs": ["198.19.0.40"], "ports": [{"port": 80}]}), json!({}));
        assert!(patched(&adm.mutate(&request("DELETE", stored.clone(), Some(stored))).await).is_empty());
        let mut dry = create(json!({"clusterIP": "198.19.0.7", "ports": [{"port": 80}]}));
        dry.dry_run = true;
        assert!(patched(&adm.mutate(&dry).await).is_empty());
        let mut dry = create(json!({"ports": [{"port": 80}]}));
        dry.dry_run = true;
        assert!(patched(&adm.mutate(&dry).await).is_empty());
        assert!(store.allocated().await.expect("allocated").is_empty());
        assert_eq!(adm.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_requested_address_keeps_its_spelling_and_is_reserved_canonically() {
        let (adm, store) = admission();
        let resp = adm.mutate(&create(json!({"clusterIP": "fd00:10:96:0::5", "ports": [{"port": 80}]}))).await;
        let patch = patched(&resp);
        assert_eq!(value(&patch, "/spec/clusterIP"), &json!("fd00:10:96:0::5"));
        assert_eq!(value(&patch, "/spec/ipFamilies"), &json!(["IPv6"]));
        assert_eq!(store.allocated().await.expect("allocated"), vec!["fd00:10:96::5".parse::<IpAddr>().expect("ip")]);
        assert_eq!(adm.in_flight(), 1);
    }

    #[tokio::test]
    async fn validation_judges_the_range_of_added_addresses_only() {
        let (adm, store) = admission();
        // Reserved by our mutating webhook for this very request: allowed.
        store.allocate("198.19.0.9".parse().expect("ip"), None).await.expect("reserve");
        let ours = service(json!({"clusterIP": "198.19.0.9", "ports": [{"port": 80}]}), json!({}));
        assert!(adm.validate(&request("CREATE", ours, None)).await.allowed);
        // Outside our ranges: Kubernetes' words.
        let out = service(json!({"clusterIP": "198.19.200.5", "ports": [{"port": 80}]}), json!({}));
        let resp = adm.validate(&request("CREATE", out.clone(), None)).await;
        assert_eq!(resp.result.code, 422);
        assert_eq!(
            resp.result.message,
            "Service \"web\" is invalid: spec.clusterIPs: Invalid value: [\"198.19.200.5\"]: failed to allocate IP 198.19.200.5: the provided network does not match the current range"
        );
        let details = resp.result.details.as_ref().expect("details");
        assert_eq!((details.kind.as_str(), details.name.as_str()), ("Service", "web"));
        assert_eq!(details.causes[0].reason, "FieldValueInvalid");
        // A dry run (refused by the mutating side, the validating side judges none) says it
        // the way Kubernetes' dry-run allocator does: with the range.
        let mut req = request("CREATE", out, None);
        req.dry_run = true;
        assert!(adm.validate(&req).await.allowed);
        let resp = adm.mutate(&req).await;
        assert!(resp.result.message.contains("the provided IP (198.19.200.5) is not in the valid range. The range of valid IPs is 198.19.0.0/24"), "{}", resp.result.message);
    }
}
