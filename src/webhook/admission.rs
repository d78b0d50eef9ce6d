//! Admission of Services: the mutating side assigns ClusterIPs from our ranges and reserves
//! them; the validating side rejects addresses we cannot honour. Answers carry Kubernetes'
//! status codes and words (422 Invalid on `spec.clusterIPs`, 500 when a range is full).

use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::core::response::{StatusCause, StatusDetails, StatusSummary};
use kube::core::Status;
use serde_json::json;
use tracing::{debug, warn};

use crate::cidr::Family;
use crate::store::apiserver_ips::ApiserverIps;
use crate::store::{AllocationStore, ParentRef, StoreError};

use super::clusterips::{self, Decision, FieldError, Plan, Want};

/// Annotation our mutating webhook puts on a Service whose addresses it reserved, so the
/// validating webhook can tell our reservation from another owner's.
pub const RESERVED_ANNOTATION: &str = "clusterip.allocator/reserved";

/// Dynamic candidates skipped because the cluster already records them, per request.
const MAX_SKIPPED: usize = 64;

/// The admission handlers, sharing one allocation store.
pub struct Admission {
    store: Arc<dyn AllocationStore>,
    /// Addresses recorded as IPAddress objects by anyone (the kube-apiserver included).
    recorded: Option<ApiserverIps>,
}

fn families_of(store: &dyn AllocationStore) -> Vec<Family> {
    let mut fams = Vec::new();
    for c in store.ranges() {
        if !fams.contains(&c.family()) {
            fams.push(c.family());
        }
    }
    fams
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
            kind: "services".into(),
            causes,
            group: String::new(),
            uid: String::new(),
            retry_after_seconds: 0,
        }),
    };
    resp
}

fn invalid(req: &AdmissionRequest<Service>, errs: &[FieldError]) -> AdmissionResponse {
    let name = service_name(req);
    let list = errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", ");
    let message = if errs.len() == 1 { format!("Service \"{name}\" is invalid: {list}") } else { format!("Service \"{name}\" is invalid: [{list}]") };
    let causes = errs
        .iter()
        .map(|e| StatusCause { field: e.field.clone(), message: e.message.clone(), reason: "FieldValueInvalid".into() })
        .collect();
    deny(req, 422, "Invalid", message, causes)
}

fn service_name(req: &AdmissionRequest<Service>) -> String {
    req.object
        .as_ref()
        .and_then(|s| s.metadata.name.clone().or_else(|| s.metadata.generate_name.clone()))
        .unwrap_or_else(|| req.name.clone())
}

/// Kubernetes' rendering of a string slice in an Invalid value: `[]string{"a", "b"}`.
fn go_slice(ips: &[String]) -> String {
    format!("[]string{{{}}}", ips.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", "))
}

/// The 422 for a requested address that cannot be had: Kubernetes reports it on
/// `spec.clusterIPs` with the whole slice as the value.
fn static_failure(req: &AdmissionRequest<Service>, requested: &[String], ip: IpAddr, err: &StoreError) -> AdmissionResponse {
    let msg = format!("Invalid value: {}: failed to allocate IP {ip}: {err}", go_slice(requested));
    invalid(req, &[FieldError { field: "spec.clusterIPs".into(), message: msg }])
}

fn requested_ips(svc: &Service) -> Vec<String> {
    let spec = svc.spec.as_ref();
    let ips = spec.and_then(|s| s.cluster_ips.clone()).unwrap_or_default();
    if ips.is_empty() {
        spec.and_then(|s| s.cluster_ip.clone()).filter(|s| !s.is_empty()).into_iter().collect()
    } else {
        ips
    }
}

fn needs_addresses(req: &AdmissionRequest<Service>) -> bool {
    match req.operation {
        Operation::Create => true,
        // An ExternalName Service turned into one that needs an address.
        Operation::Update => {
            let was_external = req.old_object.as_ref().and_then(|o| o.spec.as_ref()).and_then(|s| s.type_.as_deref()) == Some("ExternalName");
            let is_external = req.object.as_ref().and_then(|o| o.spec.as_ref()).and_then(|s| s.type_.as_deref()) == Some("ExternalName");
            was_external && !is_external
        }
        _ => false,
    }
}

fn reserved_by_us(svc: &Service) -> Option<Vec<String>> {
    let ann = svc.metadata.annotations.as_ref()?.get(RESERVED_ANNOTATION)?;
    Some(ann.split(',').map(str::to_string).collect())
}

impl Admission {
    pub fn new(store: Arc<dyn AllocationStore>, recorded: Option<ApiserverIps>) -> Self {
        Self { store, recorded }
    }

    fn recorded_elsewhere(&self, ip: IpAddr) -> bool {
        self.recorded.as_ref().map(|r| r.contains(ip)).unwrap_or(false)
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
        Err(StoreError::Unavailable(format!("{MAX_SKIPPED} candidates in a row were already recorded as IPAddress objects; run `clusterip repair` to sync the records")))
    }

    pub fn store(&self) -> &Arc<dyn AllocationStore> {
        &self.store
    }

    /// The plan for the request's Service, or the response that ends the request.
    fn plan_for(&self, req: &AdmissionRequest<Service>) -> Result<Option<(Service, Plan)>, Box<AdmissionResponse>> {
        if !needs_addresses(req) {
            return Ok(None);
        }
        let Some(svc) = req.object.clone() else {
            return Err(Box::new(AdmissionResponse::from(req).deny("the admission request carries no Service object")));
        };
        let spec = svc.spec.clone().unwrap_or_default();
        match clusterips::plan(&spec, &families_of(self.store.as_ref())) {
            Ok(Decision::NoAddress) => Ok(None),
            Ok(Decision::Allocate(plan)) => Ok(Some((svc, plan))),
            Err(errs) => Err(Box::new(invalid(req, &errs))),
        }
    }

    /// Mutating admission: reserve the Service's addresses and patch them in.
    pub async fn mutate(&self, req: &AdmissionRequest<Service>) -> AdmissionResponse {
        let (svc, plan) = match self.plan_for(req) {
            Ok(Some(p)) => p,
            Ok(None) => return AdmissionResponse::from(req),
            Err(resp) => return *resp,
        };
        if reserved_by_us(&svc).is_some() && !requested_ips(&svc).is_empty() {
            // Re-invocation of an already mutated object: nothing more to do.
            return AdmissionResponse::from(req);
        }
        let requested = requested_ips(&svc);
        if req.dry_run {
            // Reserve nothing; requested addresses are still checked.
            return match self.check_static(req, &plan, &requested, None).await {
                Some(resp) => resp,
                None => AdmissionResponse::from(req),
            };
        }
        let namespace = req.namespace.clone().unwrap_or_else(|| "default".into());
        let parent = ParentRef::service(&namespace, &service_name(req));
        let mut got: Vec<IpAddr> = Vec::new();
        for want in &plan.wants {
            let result = match *want {
                Want::Static(ip) if self.recorded_elsewhere(ip) => Err((Some(ip), StoreError::Alloc(crate::alloc::AllocError::Allocated))),
                Want::Static(ip) => self.store.allocate(ip, Some(&parent)).await.map(|()| ip).map_err(|e| (Some(ip), e)),
                Want::Dynamic(family) => self.allocate_dynamic(family, &parent).await.map_err(|e| (None, e)),
            };
            match result {
                Ok(ip) => got.push(ip),
                Err((ip, err)) => {
                    self.rollback(&got).await;
                    return match ip {
                        Some(ip) => static_failure(req, &requested, ip, &err),
                        None => {
                            let code = if err.is_transient() { 503 } else { 500 };
                            let reason = if err.is_transient() { "ServiceUnavailable" } else { "InternalError" };
                            deny(req, code, reason, format!("Internal error occurred: failed to allocate a serviceIP: {err}"), vec![])
                        }
                    };
                }
            }
        }
        let ips: Vec<String> = got.iter().map(|ip| ip.to_string()).collect();
        let mut ops = vec![
            json!({"op": "add", "path": "/spec/clusterIP", "value": ips[0]}),
            json!({"op": "add", "path": "/spec/clusterIPs", "value": ips}),
            json!({"op": "add", "path": "/spec/ipFamilies", "value": clusterips::family_names(&plan.families)}),
            json!({"op": "add", "path": "/spec/ipFamilyPolicy", "value": plan.policy}),
        ];
        if svc.metadata.annotations.is_none() {
            ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {}}));
        }
        ops.push(json!({"op": "add", "path": "/metadata/annotations/clusterip.allocator~1reserved", "value": ips.join(",")}));
        let patch: json_patch::Patch = match serde_json::from_value(serde_json::Value::Array(ops)) {
            Ok(p) => p,
            Err(e) => {
                self.rollback(&got).await;
                return AdmissionResponse::from(req).deny(format!("internal error building the patch: {e}"));
            }
        };
        debug!(service = %parent, ips = %ips.join(","), "assigned ClusterIPs");
        match AdmissionResponse::from(req).with_patch(patch) {
            Ok(resp) => resp,
            Err(e) => {
                self.rollback(&got).await;
                AdmissionResponse::from(req).deny(format!("internal error serializing the patch: {e}"))
            }
        }
    }

    async fn rollback(&self, got: &[IpAddr]) {
        for ip in got {
            if let Err(e) = self.store.release(*ip).await {
                warn!(%ip, error = %e, "could not release an address after a failed admission; repair will reclaim it");
            }
        }
    }

    /// Validating admission: requested addresses must be in our ranges and free (or
    /// reserved for this Service by our mutating webhook).
    pub async fn validate(&self, req: &AdmissionRequest<Service>) -> AdmissionResponse {
        let (svc, plan) = match self.plan_for(req) {
            Ok(Some(p)) => p,
            Ok(None) => return AdmissionResponse::from(req),
            Err(resp) => return *resp,
        };
        let requested = requested_ips(&svc);
        let ours = reserved_by_us(&svc);
        match self.check_static(req, &plan, &requested, ours.as_deref()).await {
            Some(resp) => resp,
            None => AdmissionResponse::from(req),
        }
    }

    /// Range and ownership checks of the requested addresses, reserving nothing.
    async fn check_static(&self, req: &AdmissionRequest<Service>, plan: &Plan, requested: &[String], reserved: Option<&[String]>) -> Option<AdmissionResponse> {
        let ranges = self.store.ranges();
        for want in &plan.wants {
            let Want::Static(ip) = *want else { continue };
            let text = ip.to_string();
            if reserved.map(|r| r.contains(&text)).unwrap_or(false) {
                continue;
            }
            if !ranges.iter().any(|c| c.contains(ip)) {
                let valid: Vec<String> = ranges.iter().filter(|c| c.family() == Family::of(ip)).map(|c| c.to_string()).collect();
                let err = StoreError::Alloc(crate::alloc::AllocError::NotInRange { ip, valid_range: valid.join(", ") });
                return Some(static_failure(req, requested, ip, &err));
            }
            match self.store.has(ip).await.map(|has| has || self.recorded_elsewhere(ip)) {
                Ok(true) => return Some(static_failure(req, requested, ip, &StoreError::Alloc(crate::alloc::AllocError::Allocated))),
                Ok(false) => {}
                Err(e) => return Some(deny(req, 503, "ServiceUnavailable", format!("cannot check IP {ip}: {e}"), vec![])),
            }
        }
        None
    }
}
