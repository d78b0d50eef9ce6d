//! A discovery.k8s.io/v1 EndpointSlice read into per-port endpoint lists
//! (kube-proxy's `endpointSliceInfo`).

use std::net::IpAddr;
use std::str::FromStr;

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::{Endpoint, IpFamily, NamespacedName, Protocol};

/// Label naming the Service an EndpointSlice belongs to.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Annotation with the time of the change that triggered this slice's update.
pub const LAST_CHANGE_TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// One port of a slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

/// An endpoint address of a slice, before it is paired with a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEndpoint {
    pub ip: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
    pub zone_hints: Option<Vec<String>>,
    pub node_hints: Option<Vec<String>>,
}

/// What the agent keeps of one EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceInfo {
    pub service: NamespacedName,
    pub family: IpFamily,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<SliceEndpoint>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, as text (RFC 3339).
    pub trigger_time: Option<String>,
}

/// Why an EndpointSlice is ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ignore {
    /// No `kubernetes.io/service-name` label.
    NoServiceLabel,
    /// addressType FQDN (or anything but IPv4/IPv6).
    AddressType(String),
}

impl SliceInfo {
    /// Read a slice. Malformed addresses and ports are dropped (logged), never a panic.
    pub fn from_slice(slice: &EndpointSlice) -> Result<SliceInfo, Ignore> {
        let ns = slice.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let Some(svc_name) = slice.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL)) else {
            return Err(Ignore::NoServiceLabel);
        };
        let family = match slice.address_type.as_str() {
            "IPv4" => IpFamily::V4,
            "IPv6" => IpFamily::V6,
            other => return Err(Ignore::AddressType(other.to_string())),
        };
        let service = NamespacedName::new(ns, svc_name.clone());
        let mut ports = Vec::new();
        for p in slice.ports.iter().flatten() {
            let (Some(port), Some(protocol)) = (p.port.and_then(|p| u16::try_from(p).ok()), Protocol::from_k8s(p.protocol.as_deref()))
            else {
                tracing::warn!(service = %service, port = ?p, "ignoring EndpointSlice port");
                continue;
            };
            ports.push(SlicePort { name: p.name.clone().unwrap_or_default(), protocol, port });
        }
        let mut endpoints = Vec::new();
        for ep in slice.endpoints.iter().flatten() {
            // kube-proxy uses the first address of an endpoint.
            let Some(addr) = ep.addresses.first() else { continue };
            let Ok(ip) = IpAddr::from_str(addr.trim()) else {
                tracing::warn!(service = %service, address = %addr, "ignoring malformed endpoint address");
                continue;
            };
            if IpFamily::of(&ip) != family {
                continue;
            }
            let cond = ep.conditions.as_ref();
            let hints = ep.hints.as_ref();
            endpoints.push(SliceEndpoint {
                ip,
                ready: cond.and_then(|c| c.ready).unwrap_or(true),
                serving: cond.and_then(|c| c.serving).unwrap_or(true),
                terminating: cond.and_then(|c| c.terminating).unwrap_or(false),
                node_name: ep.node_name.clone(),
                zone: ep.zone.clone(),
                zone_hints: hints.and_then(|h| h.for_zones.as_ref()).map(|z| z.iter().map(|z| z.name.clone()).collect()),
                node_hints: hints.and_then(|h| h.for_nodes.as_ref()).map(|n| n.iter().map(|n| n.name.clone()).collect()),
            });
        }
        let trigger_time =
            slice.metadata.annotations.as_ref().and_then(|a| a.get(LAST_CHANGE_TRIGGER_TIME_ANNOTATION)).cloned();
        Ok(SliceInfo { service, family, ports, endpoints, trigger_time })
    }

    /// The endpoints of this slice for the Service port named `port_name` with `protocol`.
    pub fn endpoints_for<'a>(
        &'a self,
        port_name: &'a str,
        protocol: Protocol,
        node_name: &'a str,
    ) -> impl Iterator<Item = Endpoint> + 'a {
        self.ports
            .iter()
            .filter(move |p| p.name == port_name && p.protocol == protocol)
            .flat_map(move |p| {
                self.endpoints.iter().map(move |e| Endpoint {
                    ip: e.ip,
                    port: p.port,
                    ready: e.ready,
                    serving: e.serving,
                    terminating: e.terminating,
                    is_local: e.node_name.as_deref() == Some(node_name),
                    zone: e.zone.clone(),
                    zone_hints: e.zone_hints.clone(),
                    node_hints: e.node_hints.clone(),
                })
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(v: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(v).expect("test slice")
    }

    #[test]
    fn conditions_default_like_kube_proxy() {
        let s = slice(json!({
            "metadata": {"name": "web-abc", "namespace": "ns1", "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": ["198.18.2.10"], "nodeName": "n1"},
                {"addresses": ["198.18.2.11"], "conditions": {"ready": false, "serving": true, "terminating": true}},
                {"addresses": ["fd00::1"]},
                {"addresses": ["garbage"]}
            ]
        }));
        let info = SliceInfo::from_slice(&s).expect("slice");
        assert_eq!(info.service, NamespacedName::new("ns1", "web"));
        assert_eq!(info.endpoints.len(), 2, "wrong-family and malformed addresses are dropped");
        assert!(info.endpoints[0].ready && info.endpoints[0].serving && !info.endpoints[0].terminating);
        assert!(!info.endpoints[1].ready && info.endpoints[1].serving && info.endpoints[1].terminating);
        let eps: Vec<Endpoint> = info.endpoints_for("http", Protocol::Tcp, "n1").collect();
        assert_eq!(eps.len(), 2);
        assert_eq!(eps[0].port, 8080);
        assert!(eps[0].is_local && !eps[1].is_local);
        assert_eq!(info.endpoints_for("http", Protocol::Udp, "n1").count(), 0);
        assert_eq!(info.endpoints_for("other", Protocol::Tcp, "n1").count(), 0);
    }

    #[test]
    fn ignored_slices() {
        let fqdn = slice(json!({"metadata": {"name": "x", "namespace": "n", "labels": {SERVICE_NAME_LABEL: "s"}},
            "addressType": "FQDN", "endpoints": []}));
        assert_eq!(SliceInfo::from_slice(&fqdn), Err(Ignore::AddressType("FQDN".into())));
        let unlabelled = slice(json!({"metadata": {"name": "x", "namespace": "n"}, "addressType": "IPv4", "endpoints": []}));
        assert_eq!(SliceInfo::from_slice(&unlabelled), Err(Ignore::NoServiceLabel));
    }

    #[test]
    fn hints_are_read() {
        let s = slice(json!({"metadata": {"name": "x", "namespace": "n", "labels": {SERVICE_NAME_LABEL: "s"}},
            "addressType": "IPv4", "ports": [{"port": 80}],
            "endpoints": [{"addresses": ["198.18.2.1"], "zone": "a", "hints": {"forZones": [{"name": "a"}], "forNodes": [{"name": "n1"}]}}]}));
        let info = SliceInfo::from_slice(&s).expect("slice");
        assert_eq!(info.endpoints[0].zone_hints, Some(vec!["a".to_string()]));
        assert_eq!(info.endpoints[0].node_hints, Some(vec!["n1".to_string()]));
        assert_eq!(info.endpoints[0].zone.as_deref(), Some("a"));
    }
}
