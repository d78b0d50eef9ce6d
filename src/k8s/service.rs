//! A Service's addresses as Kubernetes writes them: `spec.clusterIPs`, `spec.clusterIP`
//! (the apiserver fills either from the other), `type: ExternalName` and headless
//! (`clusterIP: None`).

use k8s_openapi::api::core::v1::{Service, ServiceSpec};
use serde::Deserialize;

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
    written_ips(spec.cluster_ip.as_deref(), spec.cluster_ips.as_deref())
}

fn written_ips(cluster_ip: Option<&str>, cluster_ips: Option<&[String]>) -> Vec<String> {
    match cluster_ips {
        Some(ips) if !ips.is_empty() => ips.to_vec(),
        _ => cluster_ip.iter().filter(|s| !s.is_empty()).map(|s| s.to_string()).collect(),
    }
}

/// The addresses held, of those written: "None" and empty values dropped.
fn held(mut written: Vec<String>) -> Vec<String> {
    written.retain(|s| !s.is_empty() && s != HEADLESS);
    written
}

/// Of a Service as a list returns it, only what a pass over every Service reads (the repair
/// pass, `clusterip what-if`, `repair --rebuild`): decoded straight from the list's JSON,
/// everything else (managedFields, ports, selector, status) skipped without being built.
/// At a million Services this is most of the pass's time and memory (docs/benchmarks.md).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ServiceSummary {
    #[serde(default)]
    pub metadata: SummaryMeta,
    #[serde(default)]
    pub spec: SummarySpec,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SummaryMeta {
    pub name: Option<String>,
    pub namespace: Option<String>,
    pub uid: Option<String>,
    pub creation_timestamp: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// The value of the [`RESERVED`](super::annotations::RESERVED) annotation alone.
    #[serde(default, rename = "annotations", deserialize_with = "reserved_only")]
    pub reserved: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct SummarySpec {
    #[serde(rename = "clusterIP")]
    pub cluster_ip: Option<String>,
    #[serde(rename = "clusterIPs")]
    pub cluster_ips: Option<Vec<String>>,
}

impl ServiceSummary {
    /// [`held_ips`] of the Service.
    pub fn held_ips(&self) -> Vec<String> {
        held(written_ips(self.spec.cluster_ip.as_deref(), self.spec.cluster_ips.as_deref()))
    }
}

/// The summary of a Service already decoded whole (a namespace's list in `explain`).
impl From<Service> for ServiceSummary {
    fn from(svc: Service) -> Self {
        let m = svc.metadata;
        let reserved = m.annotations.and_then(|mut a| a.remove(super::annotations::RESERVED));
        ServiceSummary {
            metadata: SummaryMeta { name: m.name, namespace: m.namespace, uid: m.uid, creation_timestamp: m.creation_timestamp, reserved },
            spec: svc.spec.map(|s| SummarySpec { cluster_ip: s.cluster_ip, cluster_ips: s.cluster_ips }).unwrap_or_default(),
        }
    }
}

/// An annotations map, keeping only the value of [`RESERVED`](super::annotations::RESERVED).
fn reserved_only<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct Reserved;
    impl<'de> serde::de::Visitor<'de> for Reserved {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an annotations map")
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut found = None;
            while let Some(IsReserved(wanted)) = map.next_key()? {
                if wanted {
                    found = Some(map.next_value::<String>()?);
                } else {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
            Ok(found)
        }
    }
    d.deserialize_option(Reserved)
}

/// Whether an annotation's key is [`RESERVED`](super::annotations::RESERVED), read without
/// copying the key.
struct IsReserved(bool);

impl<'de> Deserialize<'de> for IsReserved {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Key;
        impl serde::de::Visitor<'_> for Key {
            type Value = IsReserved;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an annotation key")
            }
            fn visit_str<E>(self, key: &str) -> Result<IsReserved, E> {
                Ok(IsReserved(key == super::annotations::RESERVED))
            }
        }
        d.deserialize_str(Key)
    }
}

/// The addresses a Service holds, as written: [`cluster_ips`] without "None" and empty
/// values. An ExternalName Service stored by the apiserver has none.
pub fn held_ips(svc: &Service) -> Vec<String> {
    held(svc.spec.as_ref().map(cluster_ips).unwrap_or_default())
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

    /// The summary a list is decoded into reads what the whole Service would give.
    #[test]
    fn a_summary_reads_what_the_whole_service_gives() {
        let reserved = crate::k8s::annotations::RESERVED;
        let cases = [
            serde_json::json!({"metadata": {"name": "a", "namespace": "n", "uid": "u-1", "creationTimestamp": "2026-11-22T16:00:00Z",
                "annotations": {"x": "1", reserved: "198.19.0.1, fd00::1", "z\"q": "2"},
                "managedFields": [{"manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:ports": {}}}}]},
                "spec": {"clusterIP": "198.19.0.1", "clusterIPs": ["198.19.0.1", "fd00::1"], "ports": [{"port": 80}], "type": "ClusterIP"},
                "status": {"loadBalancer": {}}}),
            serde_json::json!({"metadata": {"name": "headless", "namespace": "n", "annotations": null}, "spec": {"clusterIP": "None", "clusterIPs": ["None"]}}),
            serde_json::json!({"metadata": {"name": "old", "namespace": "n"}, "spec": {"clusterIP": "198.19.0.2"}}),
            serde_json::json!({"metadata": {"name": "ext", "namespace": "n", "annotations": {}}, "spec": {"type": "ExternalName", "externalName": "x.example"}}),
            serde_json::json!({"metadata": {"name": "bare"}}),
        ];
        for case in cases {
            let whole: Service = serde_json::from_value(case.clone()).expect("Service");
            let summary: ServiceSummary = serde_json::from_value(case.clone()).expect("summary");
            assert_eq!(summary.held_ips(), held_ips(&whole), "{case}");
            let from_summary: Vec<String> = summary.metadata.reserved.as_deref().into_iter().flat_map(crate::k8s::annotations::reserved_in).map(str::to_string).collect();
            assert_eq!(from_summary, crate::k8s::annotations::reserved(&whole.metadata), "{case}");
            assert_eq!(summary.metadata.name, whole.metadata.name);
            assert_eq!(summary.metadata.namespace, whole.metadata.namespace);
            assert_eq!(summary.metadata.uid, whole.metadata.uid);
            assert_eq!(summary.metadata.creation_timestamp, whole.metadata.creation_timestamp);
        }
        // A list answer decodes item by item the same way.
        let list: kube::core::ObjectList<ServiceSummary> = serde_json::from_value(serde_json::json!({"apiVersion": "v1", "kind": "ServiceList",
            "metadata": {"resourceVersion": "7", "continue": "abc"}, "items": [{"metadata": {"name": "a"}, "spec": {"clusterIP": "198.19.0.3"}}]})).expect("list");
        assert_eq!(list.items[0].held_ips(), ["198.19.0.3"]);
        assert_eq!(list.metadata.continue_.as_deref(), Some("abc"));
        // A garbled annotations value is an error of the page, as it is for the whole Service.
        assert!(serde_json::from_value::<ServiceSummary>(serde_json::json!({"metadata": {"annotations": ["x"]}})).is_err());
    }
}
