//! Admission of ServiceCIDRs (`POST /validate-servicecidr`): a range added by a create or
//! an update is refused when it overlaps a Node's pod CIDR or address — a Service address
//! there would also be a pod's or a node's, and traffic to it would go astray. Kubernetes
//! leaves this check to each distribution. Overlaps with other ServiceCIDRs are allowed, as
//! in Kubernetes: a wider ServiceCIDR over an old one is how a range is widened. The same
//! judgement as `clusterip what-if add-cidr` ([`crate::whatif`]).
//!
//! Registered with `failurePolicy: Ignore` (deploy/webhooks.yaml): a check, not a gate —
//! while no replica answers, ServiceCIDRs (the apiserver's own default one among them) are
//! still created. For the same reason, Nodes that cannot be read within [`NODES_WITHIN`]
//! let the request through with a warning.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::api::{Api, ListParams};
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::core::response::{StatusCause, StatusDetails, StatusSummary};
use kube::core::Status;
use tracing::warn;

use crate::cidr::ServiceCidr;
use crate::whatif::{judge, Change, NodeView};

/// How long the Nodes may take to read.
pub const NODES_WITHIN: Duration = Duration::from_secs(3);

fn ranges_of(sc: Option<&ServiceCIDR>) -> Vec<String> {
    sc.and_then(|s| s.spec.as_ref()).and_then(|s| s.cidrs.clone()).unwrap_or_default()
}

/// The ranges a create or an update adds, with their index in `spec.cidrs` (none for other
/// operations; a range that does not parse is the apiserver's validation's to refuse).
fn added_ranges(req: &AdmissionRequest<ServiceCIDR>) -> Vec<(usize, ServiceCidr)> {
    if !matches!(req.operation, Operation::Create | Operation::Update) {
        return Vec::new();
    }
    let old = ranges_of(req.old_object.as_ref());
    ranges_of(req.object.as_ref()).iter().enumerate().filter(|(_, t)| !old.contains(t)).filter_map(|(i, t)| ServiceCidr::parse(t).ok().map(|c| (i, c))).collect()
}

/// The answer to one ServiceCIDR admission, given how the Nodes read.
pub fn decide(req: &AdmissionRequest<ServiceCIDR>, nodes: Result<Vec<NodeView>, String>) -> AdmissionResponse {
    let added = added_ranges(req);
    if added.is_empty() {
        return AdmissionResponse::from(req);
    }
    let nodes = match nodes {
        Ok(n) => n,
        Err(e) => {
            warn!(error = %e, "could not read the Nodes; a ServiceCIDR is admitted without the overlap check");
            let mut resp = AdmissionResponse::from(req);
            resp.warnings = Some(vec![format!("clusterip: the ranges were not checked against the nodes' pod CIDRs and addresses: {e}")]);
            return resp;
        }
    };
    let mut causes = Vec::new();
    for (i, cidr) in &added {
        let Ok(found) = judge(&Change::Add { cidr: cidr.clone() }, &[], &[], &nodes) else { continue };
        for o in found.overlaps.iter().filter(|o| o.with != "servicecidr") {
            let what = if o.with == "pod-cidr" { format!("the pod CIDR {} of Node {}", o.range, o.name) } else { format!("the address {} of Node {}", o.range, o.name) };
            causes.push(StatusCause {
                reason: "FieldValueInvalid".into(),
                field: format!("spec.cidrs[{i}]"),
                message: format!("Invalid value: {:?}: overlaps {what} (a Service address there would also be a pod's or a node's)", cidr.to_string()),
            });
        }
    }
    if causes.is_empty() {
        return AdmissionResponse::from(req);
    }
    let name = req.name.clone();
    let message = format!("ServiceCIDR.networking.k8s.io {name:?} is invalid: {}", causes.iter().map(|c| format!("{}: {}", c.field, c.message)).collect::<Vec<_>>().join(", "));
    let mut resp = AdmissionResponse::from(req);
    resp.allowed = false;
    resp.result = Status {
        status: Some(StatusSummary::Failure),
        code: 422,
        message,
        metadata: None,
        reason: "Invalid".into(),
        details: Some(StatusDetails { name, kind: "ServiceCIDR".into(), group: "networking.k8s.io".into(), causes, uid: String::new(), retry_after_seconds: 0 }),
    };
    resp
}

/// Read the Nodes (bounded) and decide. A request that adds no range (a finalizer or
/// label written, a delete) reads nothing.
pub async fn validate(nodes: Option<&Api<Node>>, req: &AdmissionRequest<ServiceCIDR>) -> AdmissionResponse {
    if added_ranges(req).is_empty() {
        return AdmissionResponse::from(req);
    }
    let read = match nodes {
        None => Ok(Vec::new()),
        Some(api) => match tokio::time::timeout(NODES_WITHIN, api.list(&ListParams::default())).await {
            Ok(Ok(list)) => Ok(list.items.into_iter().map(NodeView::of).collect()),
            Ok(Err(e)) => Err(format!("listing Nodes: {e}")),
            Err(_) => Err(format!("listing Nodes: no answer within {NODES_WITHIN:?}")),
        },
    };
    decide(req, read)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(operation: &str, cidrs: &[&str], old: Option<&[&str]>) -> AdmissionRequest<ServiceCIDR> {
        let object = |c: &[&str]| json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": "extra"}, "spec": {"cidrs": c}});
        let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "u", "kind": {"group": "networking.k8s.io", "version": "v1", "kind": "ServiceCIDR"},
            "resource": {"group": "networking.k8s.io", "version": "v1", "resource": "servicecidrs"},
            "name": "extra", "operation": operation, "userInfo": {}, "object": object(cidrs), "oldObject": old.map(object)}});
        crate::webhook::server::parse_review_of(review.to_string().as_bytes(), "a ServiceCIDR").expect("review")
    }

    fn nodes() -> Vec<NodeView> {
        vec![NodeView { name: "n1".into(), pod_cidrs: vec!["10.244.1.0/24".into()], addresses: vec!["192.168.1.10".into()] }]
    }

    #[test]
    fn a_range_over_a_pod_cidr_or_a_node_address_is_refused_in_kubernetes_words() {
        let r = decide(&request("CREATE", &["10.244.0.0/16"], None), Ok(nodes()));
        assert!(!r.allowed);
        assert_eq!((r.result.code, r.result.reason.as_str()), (422, "Invalid"));
        assert_eq!(
            r.result.message,
            r#"ServiceCIDR.networking.k8s.io "extra" is invalid: spec.cidrs[0]: Invalid value: "10.244.0.0/16": overlaps the pod CIDR 10.244.1.0/24 of Node n1 (a Service address there would also be a pod's or a node's)"#
        );
        assert_eq!(r.result.details.as_ref().map(|d| d.causes[0].field.as_str()), Some("spec.cidrs[0]"));
        let node = decide(&request("CREATE", &["10.96.0.0/16", "192.168.1.0/24"], None), Ok(nodes()));
        assert_eq!(node.result.details.as_ref().map(|d| d.causes[0].field.as_str()), Some("spec.cidrs[1]"), "{}", node.result.message);
    }

    #[test]
    fn elsewhere_unchanged_or_unchecked_ranges_pass() {
        assert!(decide(&request("CREATE", &["10.96.0.0/16"], None), Ok(nodes())).allowed);
        // An update that adds no range is not judged (a range already there stays).
        assert!(decide(&request("UPDATE", &["10.244.0.0/16"], Some(&["10.244.0.0/16"])), Ok(nodes())).allowed);
        // A range the apiserver will refuse itself is left to it.
        assert!(decide(&request("CREATE", &["garbage"], None), Ok(nodes())).allowed);
        let unread = decide(&request("CREATE", &["10.244.0.0/16"], None), Err("listing Nodes: no answer within 3s".into()));
        assert!(unread.allowed && unread.warnings.as_ref().is_some_and(|w| w[0].contains("not checked")), "{:?}", unread.warnings);
    }
}
