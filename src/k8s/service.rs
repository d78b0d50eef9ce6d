//! A Service's addresses as Kubernetes writes them: `spec.clusterIPs`, `spec.clusterIP`
//! (the apiserver fills either from the other), `type: ExternalName` and headless
//! (`clusterIP: None`).

use k8s_openapi::api::core::v1::{Service, ServiceSpec};

/// `spec.type` of a Service that gets no address.
pub const EXTERNAL_NAME: &str = "ExternalName";
/// `spec.clusterIP` of a headless Service (Kubernetes' `ClusterIPNone`).
pub const HEADLESS: &str = "None";

/// `spec.type: ExternalName`.
pub fn is_external_name(spec: &ServiceSpec) -> bool {
    spec.type_.as_deref() == Some(EXTERNAL_NAME)
}

/// `spec.clusterIP: None`.
pub fn is_headless(spec: &ServiceSpec) -> bool {
    spec.cluster_ip.as_deref() == Some(HEADLESS)
}

/// The addresses a spec asks for or holds, as written: `spec.clusterIPs`, or
/// `spec.clusterIP` when `clusterIPs` is empty (as the apiserver fills one from the other).
/// "None" is kept (it is the first value of a headless Service).
pub fn cluster_ips(spec: &ServiceSpec) -> Vec<String> {
    match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips.to_vec(),
        _ => spec.cluster_ip.iter().filter(|s| !s.is_empty()).cloned().collect(),
    }
}

/// The addresses a Service holds, as written: [`cluster_ips`] without "None" and empty
/// values. An ExternalName Service stored by the apiserver has none.
pub fn held_ips(svc: &Service) -> Vec<String> {
    let mut ips = svc.spec.as_ref().map(cluster_ips).unwrap_or_default();
    ips.retain(|s| !s.is_empty() && s != HEADLESS);
    ips
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> ServiceSpec {
        serde_json::from_value(json).expect("ServiceSpec")
    }

    fn service(spec_json: serde_json::Value) -> Service {
        Service { spec: Some(spec(spec_json)), ..Default::default() }
    }

    #[test]
    fn cluster_ips_come_from_cluster_ips_or_else_cluster_ip() {
        assert_eq!(cluster_ips(&spec(serde_json::json!({"clusterIP": "198.19.0.1"}))), ["198.19.0.1"]);
        assert_eq!(cluster_ips(&spec(serde_json::json!({"clusterIP": "198.19.0.1", "clusterIPs": ["198.19.0.1", "fd00::1"]}))), ["198.19.0.1", "fd00::1"]);
        assert_eq!(cluster_ips(&spec(serde_json::json!({"clusterIP": "198.19.0.1", "clusterIPs": []}))), ["198.19.0.1"]);
        assert!(cluster_ips(&spec(serde_json::json!({"clusterIP": ""}))).is_empty());
        assert_eq!(cluster_ips(&spec(serde_json::json!({"clusterIP": "None"}))), ["None"]);
    }

    #[test]
    fn a_service_holds_its_addresses_but_none_when_headless() {
        assert_eq!(held_ips(&service(serde_json::json!({"clusterIPs": ["198.19.0.1", "fd00::1"]}))), ["198.19.0.1", "fd00::1"]);
        assert!(held_ips(&service(serde_json::json!({"clusterIP": "None", "clusterIPs": ["None"]}))).is_empty());
        assert!(held_ips(&service(serde_json::json!({"type": "ExternalName", "externalName": "example.invalid"}))).is_empty());
        assert!(held_ips(&Service::default()).is_empty());
    }

    #[test]
    fn external_name_and_headless() {
        assert!(is_external_name(&spec(serde_json::json!({"type": "ExternalName"}))));
        assert!(!is_external_name(&spec(serde_json::json!({"type": "ClusterIP"}))));
        assert!(is_headless(&spec(serde_json::json!({"clusterIP": "None"}))));
        assert!(!is_headless(&spec(serde_json::json!({"clusterIP": "198.19.0.1"}))));
    }
}
