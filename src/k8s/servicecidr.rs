//! `networking.k8s.io/v1` ServiceCIDR objects: their ranges and their Ready condition.

use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use tracing::warn;

use crate::cidr::ServiceCidr;

/// The condition type the ServiceCIDR controller sets.
pub const READY: &str = "Ready";

/// The ranges of `spec.cidrs`, parsed strictly; one that does not parse is logged and
/// skipped (the apiserver validates them, so it is one written behind its back).
pub fn ranges(obj: &ServiceCIDR) -> Vec<ServiceCidr> {
    let cidrs = obj.spec.as_ref().and_then(|s| s.cidrs.as_deref()).unwrap_or_default();
    cidrs
        .iter()
        .filter_map(|text| match ServiceCidr::parse(text) {
            Ok(c) => Some(c),
            Err(e) => {
                warn!(servicecidr = ?obj.metadata.name, cidr = %text, error = %e, "ignoring an unusable ServiceCIDR range");
                None
            }
        })
        .collect()
}

/// The Ready condition, if set.
pub fn ready_condition(obj: &ServiceCIDR) -> Option<&Condition> {
    condition(obj, READY)
}

/// Its condition of type `type_`, if any.
pub fn condition<'a>(obj: &'a ServiceCIDR, type_: &str) -> Option<&'a Condition> {
    obj.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == type_)
}

/// Whether it gives new addresses: not being deleted, and Ready unless a Ready condition
/// says otherwise (one with no Ready condition yet counts as ready, as in Kubernetes).
pub fn allocatable(obj: &ServiceCIDR) -> bool {
    obj.metadata.deletion_timestamp.is_none() && ready_condition(obj).map(|c| c.status == "True").unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn servicecidr(json: serde_json::Value) -> ServiceCIDR {
        serde_json::from_value(json).expect("ServiceCIDR")
    }

    #[test]
    fn ranges_that_parse_and_readiness() {
        let sc = servicecidr(serde_json::json!({"metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["198.19.0.0/16", "10.0.0.1/8", "fd00:10:96::/112"]}}));
        assert_eq!(ranges(&sc), [ServiceCidr::parse("198.19.0.0/16").expect("v4"), ServiceCidr::parse("fd00:10:96::/112").expect("v6")]);
        assert!(allocatable(&sc), "no Ready condition yet counts as ready");
        let not_ready = servicecidr(serde_json::json!({"metadata": {"name": "x"}, "spec": {"cidrs": []},
            "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "Terminating", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}));
        assert!(!allocatable(&not_ready));
        assert_eq!(ready_condition(&not_ready).map(|c| c.reason.as_str()), Some("Terminating"));
        let deleting = servicecidr(serde_json::json!({"metadata": {"name": "y", "deletionTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"cidrs": []}}));
        assert!(!allocatable(&deleting));
    }
}
