//! A core/v1 Service read into the ports a node proxies (kube-proxy's `ServicePort` info).

use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Service;

use super::{IpFamily, NamespacedName, Protocol, ServicePortName};

/// Default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT_SECONDS: u32 = 10800;

/// Label that hands a Service to another proxy (kube-proxy ignores labelled Services).
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Label of headless Services' objects; such Services are never proxied.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// One port of a Service, with everything the dataplane needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub name: ServicePortName,
    /// `spec.ports[].port`.
    pub port: u16,
    /// `spec.clusterIPs` (both families).
    pub cluster_ips: Vec<IpAddr>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` whose ipMode is VIP (or unset).
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.ports[].nodePort` for NodePort and LoadBalancer Services.
    pub node_port: Option<u16>,
    /// `spec.loadBalancerSourceRanges`.
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// ClientIP session affinity timeout in seconds; None without affinity.
    pub affinity_timeout: Option<u32>,
    /// `internalTrafficPolicy: Local`.
    pub internal_policy_local: bool,
    /// `externalTrafficPolicy: Local` on an externally reachable Service.
    pub external_policy_local: bool,
    /// `spec.healthCheckNodePort` (eTP Local LoadBalancer Services).
    pub health_check_node_port: Option<u16>,
}

impl ServicePort {
    /// A plain ClusterIP port, for tests and benchmarks.
    pub fn cluster_ip(ns: &str, name: &str, port_name: &str, protocol: Protocol, ip: IpAddr, port: u16) -> Self {
        ServicePort {
            name: ServicePortName { service: NamespacedName::new(ns, name), port_name: port_name.to_string(), protocol },
            port,
            cluster_ips: vec![ip],
            external_ips: vec![],
            load_balancer_ips: vec![],
            node_port: None,
            load_balancer_source_ranges: vec![],
            affinity_timeout: None,
            internal_policy_local: false,
            external_policy_local: false,
            health_check_node_port: None,
        }
    }

    /// Reachable from outside the cluster network: NodePort, externalIPs or LB IPs.
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }

    /// Some traffic to this port uses the cluster-wide endpoint list.
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || (self.externally_accessible() && !self.external_policy_local)
    }

    /// Some traffic to this port uses only this node's endpoints.
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.externally_accessible() && self.external_policy_local)
    }

    /// Whether any address of this port is of `family`.
    pub fn has_family(&self, family: IpFamily) -> bool {
        self.cluster_ips.iter().chain(&self.external_ips).chain(&self.load_balancer_ips).any(|ip| IpFamily::of(ip) == family)
            || (self.node_port.is_some() && self.cluster_ips.iter().any(|ip| IpFamily::of(ip) == family))
    }
}

/// Why a Service is not proxied at all (not an error: such Services are simply skipped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    ExternalName,
    Headless,
    OtherProxy,
    /// A namespace or name the kube-apiserver would not have accepted (what was wrong).
    /// Names become nft chain and set names, so one that is not a DNS label could break
    /// the transaction text — or add commands to it — and is never rendered.
    InvalidName(String),
    /// Even its ClusterIPs alone exceed `--max-service-addresses` (ports × ClusterIPs).
    OverAddressLimit { cost: usize, limit: usize },
}

/// Default of `--max-service-addresses`: the VIP:port pairs one Service may make every
/// node program, ports × (ClusterIPs, externalIPs and load-balancer IPs). Each pair is a
/// map element in every node's kernel, and each removed UDP endpoint one conntrack flush
/// per pair. A Service with 2 ClusterIPs, 8 ports and a few dozen external addresses stays
/// well under it.
pub const DEFAULT_MAX_SERVICE_ADDRESSES: usize = 1024;

/// What one Service may cost a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceLimits {
    /// At most this many VIP:port pairs per Service (0: no limit). Over it, the Service is
    /// programmed with its ClusterIPs only (no externalIPs, no load-balancer IPs); if even
    /// those exceed it, not at all.
    pub max_addresses: usize,
    /// externalIPs outside these CIDRs are ignored (empty: any address is allowed, as
    /// kube-proxy does).
    pub external_ip_cidrs: Vec<IpNet>,
}

impl Default for ServiceLimits {
    fn default() -> Self {
        ServiceLimits { max_addresses: DEFAULT_MAX_SERVICE_ADDRESSES, external_ip_cidrs: vec![] }
    }
}

/// What [`apply_limits`] took away from a Service.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    /// externalIPs outside the allowed CIDRs.
    pub external_ips_ignored: usize,
    /// Over the address limit: programmed with its ClusterIPs only.
    pub over_limit: bool,
}

/// VIP:port pairs the ports make a node program.
pub fn address_cost(ports: &[ServicePort]) -> usize {
    ports.iter().map(|p| p.cluster_ips.len() + p.external_ips.len() + p.load_balancer_ips.len()).sum()
}

/// Bound what one Service costs a node: drop externalIPs outside `limits.external_ip_cidrs`,
/// then, over `limits.max_addresses`, everything but the ClusterIPs (what pods inside the
/// cluster use keeps working; what was dropped is what the Service's author can grow at
/// will). Err when even the ClusterIPs are over the limit.
pub fn apply_limits(ports: &mut [ServicePort], limits: &ServiceLimits) -> Result<Limited, Skip> {
    let mut out = Limited::default();
    if !limits.external_ip_cidrs.is_empty() {
        let allowed = |ip: &IpAddr| limits.external_ip_cidrs.iter().any(|n| n.contains(ip));
        for (i, p) in ports.iter_mut().enumerate() {
            let before = p.external_ips.len();
            p.external_ips.retain(allowed);
            if i == 0 {
                out.external_ips_ignored = before - p.external_ips.len();
            }
        }
    }
    if limits.max_addresses == 0 {
        return Ok(out);
    }
    let cost = address_cost(ports);
    if cost > limits.max_addresses {
        out.over_limit = true;
        for p in ports.iter_mut() {
            p.external_ips.clear();
            p.load_balancer_ips.clear();
            p.external_policy_local &= p.externally_accessible();
        }
        let cost = address_cost(ports);
        if cost > limits.max_addresses {
            return Err(Skip::OverAddressLimit { cost, limit: limits.max_addresses });
        }
    }
    Ok(out)
}

/// Whether `s` is a DNS-1123 label, as Kubernetes requires of namespaces and Service names:
/// 1–63 characters, lowercase letters, digits and '-', starting and ending alphanumeric.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Whether `s` is a Service port name the kube-apiserver accepts: a DNS label (at most 63
/// lowercase letters, digits and '-', a letter or digit at each end), or empty (a single
/// unnamed port). Not an IANA service name: that rule (at most 15) is a *container* port's
/// name, which a named targetPort refers to; the Service's own port name may be longer
/// (Kubernetes' e2e "named targetPorts" test names its port `mutable-named-port`).
pub fn is_port_name(s: &str) -> bool {
    s.is_empty() || is_dns_label(s)
}

/// Read a Service into its ports. `proxy_name` is this agent's
/// `service.kubernetes.io/service-proxy-name` (None: only unlabelled Services).
/// Unparseable addresses and ports are dropped with a warning, never a panic.
pub fn service_ports(svc: &Service, proxy_name: Option<&str>) -> Result<Vec<ServicePort>, Skip> {
    let labels = svc.metadata.labels.as_ref();
    let label_proxy = labels.and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL)).map(String::as_str);
    if label_proxy != proxy_name {
        return Err(Skip::OtherProxy);
    }
    if labels.is_some_and(|l| l.contains_key(HEADLESS_LABEL)) {
        return Err(Skip::Headless);
    }
    let Some(spec) = svc.spec.as_ref() else { return Ok(vec![]) };
    let svc_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    if svc_type == "ExternalName" {
        return Err(Skip::ExternalName);
    }
    let nsn = NamespacedName::new(
        svc.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
        svc.metadata.name.clone().unwrap_or_default(),
    );
    for (what, v) in [("namespace", &nsn.namespace), ("name", &nsn.name)] {
        if !is_dns_label(v) {
            tracing::warn!(service = %nsn, "not proxied: its {what} is not a DNS label");
            return Err(Skip::InvalidName(format!("{what} {v:?} is not a DNS label")));
        }
    }
    let mut ips: Vec<&String> = spec.cluster_ips.iter().flatten().collect();
    if ips.is_empty() {
        ips.extend(spec.cluster_ip.as_ref());
    }
    if ips.is_empty() || ips.iter().any(|ip| ip.as_str() == "None") {
        return Err(Skip::Headless);
    }
    let cluster_ips = parse_ips(&nsn, "spec.clusterIPs", ips.into_iter());
    let external_ips = parse_ips(&nsn, "spec.externalIPs", spec.external_ips.iter().flatten());
    let load_balancer_ips = if svc_type == "LoadBalancer" {
        let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|lb| lb.ingress.as_ref());
        parse_ips(
            &nsn,
            "status.loadBalancer.ingress",
            ingress
                .into_iter()
                .flatten()
                .filter(|i| i.ip_mode.as_deref().unwrap_or("VIP") == "VIP")
                .filter_map(|i| i.ip.as_ref()),
        )
    } else {
        vec![]
    };
    let load_balancer_source_ranges = if svc_type == "LoadBalancer" {
        spec.load_balancer_source_ranges
            .iter()
            .flatten()
            .filter_map(|r| match IpNet::from_str(r.trim()) {
                Ok(n) => Some(n),
                Err(_) => {
                    tracing::warn!(service = %nsn, range = %r, "ignoring malformed loadBalancerSourceRange");
                    None
                }
            })
            .collect()
    } else {
        vec![]
    };
    let affinity_timeout = if spec.session_affinity.as_deref() == Some("ClientIP") {
        let t = spec
            .session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .filter(|t| *t > 0)
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_SECONDS);
        Some(t)
    } else {
        None
    };
    let has_node_ports = svc_type == "NodePort" || svc_type == "LoadBalancer";
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let external_local_requested = spec.external_traffic_policy.as_deref() == Some("Local");
    let health_check_node_port = spec.health_check_node_port.and_then(|p| u16::try_from(p).ok()).filter(|p| *p > 0);
    let mut out = Vec::new();
    for p in spec.ports.iter().flatten() {
        let Some(protocol) = Protocol::from_k8s(p.protocol.as_deref()) else {
            tracing::warn!(service = %nsn, protocol = ?p.protocol, "ignoring port with unknown protocol");
            continue;
        };
        let port_name = p.name.clone().unwrap_or_default();
        if !is_port_name(&port_name) {
            tracing::warn!(service = %nsn, port_name = %port_name, "ignoring port whose name is not a DNS label");
            continue;
        }
        let Ok(port) = u16::try_from(p.port) else {
            tracing::warn!(service = %nsn, port = p.port, "ignoring out-of-range port");
            continue;
        };
        let node_port = if has_node_ports { p.node_port.and_then(|n| u16::try_from(n).ok()).filter(|n| *n > 0) } else { None };
        let mut sp = ServicePort {
            name: ServicePortName { service: nsn.clone(), port_name, protocol },
            port,
            cluster_ips: cluster_ips.clone(),
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            node_port,
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            affinity_timeout,
            internal_policy_local,
            external_policy_local: false,
            health_check_node_port,
        };
        sp.external_policy_local = external_local_requested && sp.externally_accessible();
        // Two ports of one name and protocol (which the kube-apiserver refuses) would render
        // the same chains twice, and each sync would rewrite them: the later one is proxied,
        // as kube-proxy's map of a Service's ports keeps it.
        match out.iter().position(|o: &ServicePort| o.name == sp.name) {
            Some(i) => {
                tracing::warn!(service = %nsn, port_name = %sp.name.port_name, "two ports of the same name and protocol; proxying the later one");
                out[i] = sp;
            }
            None => out.push(sp),
        }
    }
    Ok(out)
}

fn parse_ips<'a>(nsn: &NamespacedName, field: &str, it: impl Iterator<Item = &'a String>) -> Vec<IpAddr> {
    let mut out = Vec::new();
    // A set beside the list: `Vec::contains` made 5,000 externalIPs 12.5M comparisons.
    let mut seen = std::collections::HashSet::new();
    for s in it {
        match IpAddr::from_str(s.trim()) {
            Ok(ip) if seen.insert(ip) => out.push(ip),
            Ok(_) => {}
            Err(_) => tracing::warn!(service = %nsn, field, value = %s, "ignoring malformed IP address"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(v: serde_json::Value) -> Service {
        serde_json::from_value(v).expect("test service")
    }

    #[test]
    fn cluster_ip_service_ports() {
        let s = svc(json!({
            "metadata": {"name": "web", "namespace": "ns1"},
            "spec": {"clusterIP": "198.19.0.10", "clusterIPs": ["198.19.0.10", "fd00:10:96::a"],
                     "ports": [{"name": "http", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}]}
        }));
        let ports = service_ports(&s, None).expect("proxied");
        assert_eq!(ports.len(), 2);
        assert_eq!(ports[0].name.protocol, Protocol::Tcp);
        assert_eq!(ports[0].port, 80);
        assert_eq!(ports[0].cluster_ips.len(), 2);
        assert_eq!(ports[1].name.protocol, Protocol::Udp);
        assert_eq!(ports[1].node_port, None);
        assert!(!ports[0].externally_accessible());
        assert!(ports[0].uses_cluster_endpoints());
        assert!(!ports[0].uses_local_endpoints());
    }

    #[test]
    fn names_that_are_not_dns_labels_are_never_rendered() {
        // Found by fuzzing (tests/fuzz/corpus/nft/crash-name-not-a-dns-label): names become
        // nft chain names, and "we b;x" split the transaction text into other commands.
        for (ns, name) in [("ns", "we b;x"), ("ns", ""), ("n s", "web"), ("ns", "Web"), ("ns", &"a".repeat(64)), ("ns", "-a")] {
            let s = svc(json!({"metadata": {"name": name, "namespace": ns}, "spec": {"clusterIP": "198.19.0.1", "ports": [{"port": 80}]}}));
            assert!(matches!(service_ports(&s, None), Err(Skip::InvalidName(_))), "{ns}/{name}");
        }
        let s = svc(json!({"metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIP": "198.19.0.1", "ports": [{"name": "h;ttp", "port": 80}, {"name": "http", "port": 81}]}}));
        let ports = service_ports(&s, None).expect("proxied");
        assert_eq!(ports.iter().map(|p| p.port).collect::<Vec<_>>(), vec![81], "the port with a bad name is dropped");
        assert!(is_dns_label("a-1") && is_dns_label(&"a".repeat(63)) && !is_dns_label("a."));
    }

    #[test]
    fn port_names_are_dns_labels_not_iana_service_names() {
        // Kubernetes' e2e "should support named targetPorts that resolve to different ports
        // on different endpoints" names its Service port `mutable-named-port` (18 letters):
        // the kube-apiserver accepts any DNS label there, and the port was dropped (its
        // ClusterIP never answered) while names were held to 15.
        let s = svc(json!({"metadata": {"name": "mutable-named-port", "namespace": "ns"},
            "spec": {"clusterIP": "198.19.0.1", "ports": [
                {"name": "mutable-named-port", "port": 8001, "targetPort": "mutable-port"},
                {"name": "a".repeat(63), "port": 8002},
                {"name": "b".repeat(64), "port": 8003},
                {"name": "-x", "port": 8004}]}}));
        let ports = service_ports(&s, None).expect("proxied");
        assert_eq!(ports.iter().map(|p| p.port).collect::<Vec<_>>(), vec![8001, 8002], "a 64-letter or '-x' name is dropped");
        assert_eq!(ports[0].name.port_name, "mutable-named-port");
    }

    #[test]
    fn of_two_ports_with_one_name_and_protocol_the_later_is_proxied() {
        // Found by fuzzing (tests/fuzz/corpus/ruleset/crash-two-ports-of-one-name): both were
        // rendered into the same chains, and every sync deleted and re-added the node port.
        let s = svc(json!({"metadata": {"name": "np", "namespace": "ns"},
            "spec": {"type": "NodePort", "clusterIP": "198.19.0.1",
                     "ports": [{"port": 80}, {"port": 81, "nodePort": 30443}, {"port": 82, "protocol": "UDP"}]}}));
        let ports = service_ports(&s, None).expect("proxied");
        let seen: Vec<(u16, Option<u16>, Protocol)> = ports.iter().map(|p| (p.port, p.node_port, p.name.protocol)).collect();
        assert_eq!(seen, vec![(81, Some(30443), Protocol::Tcp), (82, None, Protocol::Udp)]);
    }

    #[test]
    fn affinity_default_and_explicit_timeout() {
        let s = svc(json!({"metadata": {"name": "a", "namespace": "n"},
            "spec": {"clusterIP": "198.19.0.1", "sessionAffinity": "ClientIP", "ports": [{"port": 80}]}}));
        assert_eq!(service_ports(&s, None).expect("ok")[0].affinity_timeout, Some(DEFAULT_AFFINITY_TIMEOUT_SECONDS));
        let s = svc(json!({"metadata": {"name": "a", "namespace": "n"},
            "spec": {"clusterIP": "198.19.0.1", "sessionAffinity": "ClientIP",
                     "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 5}}, "ports": [{"port": 80}]}}));
        assert_eq!(service_ports(&s, None).expect("ok")[0].affinity_timeout, Some(5));
    }

    #[test]
    fn load_balancer_fields_and_local_policy() {
        let s = svc(json!({"metadata": {"name": "lb", "namespace": "n"},
            "spec": {"type": "LoadBalancer", "clusterIP": "198.19.0.2", "externalTrafficPolicy": "Local",
                     "healthCheckNodePort": 32000,
                     "loadBalancerSourceRanges": ["198.18.5.0/24", "bogus"],
                     "externalIPs": ["198.18.9.9", "not-an-ip"],
                     "ports": [{"port": 443, "nodePort": 30443}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "198.18.8.8"}, {"ip": "198.18.8.9", "ipMode": "Proxy"}]}}}));
        let p = &service_ports(&s, None).expect("ok")[0];
        assert_eq!(p.node_port, Some(30443));
        assert_eq!(p.load_balancer_ips, vec!["198.18.8.8".parse::<IpAddr>().expect("ip")]);
        assert_eq!(p.external_ips.len(), 1);
        assert_eq!(p.load_balancer_source_ranges.len(), 1);
        assert!(p.external_policy_local);
        assert!(p.uses_local_endpoints() && p.uses_cluster_endpoints());
        assert_eq!(p.health_check_node_port, Some(32000));
    }

    #[test]
    fn external_policy_needs_external_access() {
        let s = svc(json!({"metadata": {"name": "a", "namespace": "n"},
            "spec": {"clusterIP": "198.19.0.1", "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
                     "ports": [{"port": 80, "nodePort": 30080}]}}));
        let p = &service_ports(&s, None).expect("ok")[0];
        assert_eq!(p.node_port, None, "a ClusterIP service has no node port even if one is written");
        assert!(!p.external_policy_local);
        assert!(p.internal_policy_local);
        assert!(!p.uses_cluster_endpoints());
    }

    #[test]
    fn skipped_services() {
        let headless = svc(json!({"metadata": {"name": "h", "namespace": "n"}, "spec": {"clusterIP": "None", "ports": [{"port": 80}]}}));
        assert_eq!(service_ports(&headless, None), Err(Skip::Headless));
        let ext = svc(json!({"metadata": {"name": "e", "namespace": "n"}, "spec": {"type": "ExternalName", "externalName": "x.example"}}));
        assert_eq!(service_ports(&ext, None), Err(Skip::ExternalName));
        let other = svc(json!({"metadata": {"name": "o", "namespace": "n", "labels": {SERVICE_PROXY_NAME_LABEL: "other"}},
            "spec": {"clusterIP": "198.19.0.1", "ports": [{"port": 80}]}}));
        assert_eq!(service_ports(&other, None), Err(Skip::OtherProxy));
        assert!(service_ports(&other, Some("other")).is_ok());
        let plain = svc(json!({"metadata": {"name": "p", "namespace": "n"}, "spec": {"clusterIP": "198.19.0.1", "ports": [{"port": 80}]}}));
        assert_eq!(service_ports(&plain, Some("other")), Err(Skip::OtherProxy));
    }

    fn many_addresses(n: usize, ports: usize) -> Service {
        let ext: Vec<String> = (0..n).map(|i| format!("198.18.{}.{}", 100 + i / 250, i % 250 + 1)).collect();
        let ports: Vec<_> = (0..ports).map(|i| json!({"name": format!("p{i}"), "port": 53 + i, "protocol": "UDP"})).collect();
        svc(json!({"metadata": {"name": "big", "namespace": "n"},
            "spec": {"clusterIPs": ["198.19.0.1", "fd00:10:96::1"], "externalIPs": ext, "ports": ports}}))
    }

    #[test]
    fn a_service_over_the_address_limit_keeps_its_cluster_ips_only() {
        let limits = ServiceLimits::default();
        // 2 ports × (2 ClusterIPs + 510 externalIPs) = 1024: at the limit, kept whole.
        let mut ports = service_ports(&many_addresses(510, 2), None).expect("ok");
        assert_eq!(apply_limits(&mut ports, &limits), Ok(Limited::default()));
        assert_eq!(ports[1].external_ips.len(), 510);
        // One more externalIP: 1026 > 1024, the externalIPs go, the ClusterIPs stay.
        let mut ports = service_ports(&many_addresses(511, 2), None).expect("ok");
        assert_eq!(apply_limits(&mut ports, &limits), Ok(Limited { over_limit: true, external_ips_ignored: 0 }));
        assert!(ports.iter().all(|p| p.external_ips.is_empty() && p.cluster_ips.len() == 2));
        assert_eq!(address_cost(&ports), 4);
        // 5,000 externalIPs (issue 30's attack) likewise; 0 turns the limit off.
        let mut ports = service_ports(&many_addresses(5000, 1), None).expect("ok");
        assert!(apply_limits(&mut ports.clone(), &limits).expect("ok").over_limit);
        assert!(!apply_limits(&mut ports, &ServiceLimits { max_addresses: 0, ..limits.clone() }).expect("ok").over_limit);
        assert_eq!(ports[0].external_ips.len(), 5000);
        // 513 ports × 2 ClusterIPs: over the limit with its ClusterIPs alone, not proxied.
        let mut ports = service_ports(&many_addresses(0, 513), None).expect("ok");
        assert_eq!(apply_limits(&mut ports, &limits), Err(Skip::OverAddressLimit { cost: 1026, limit: 1024 }));
    }

    #[test]
    fn external_ips_outside_the_allowed_cidrs_are_ignored() {
        let limits = ServiceLimits { external_ip_cidrs: vec!["198.18.100.0/24".parse().expect("cidr")], ..Default::default() };
        // 198.18.100.1-250 inside, 198.18.101.x outside.
        let mut ports = service_ports(&many_addresses(300, 2), None).expect("ok");
        let l = apply_limits(&mut ports, &limits).expect("ok");
        assert_eq!(l, Limited { external_ips_ignored: 50, over_limit: false });
        assert!(ports.iter().all(|p| p.external_ips.len() == 250));
    }

    #[test]
    fn duplicate_addresses_are_dropped_in_linear_time() {
        let ext: Vec<String> = (0..20_000).map(|i| format!("198.18.{}.{}", 100 + (i % 5000) / 250, i % 250 + 1)).collect();
        let s = svc(json!({"metadata": {"name": "d", "namespace": "n"},
            "spec": {"clusterIP": "198.19.0.1", "externalIPs": ext, "ports": [{"port": 53}]}}));
        assert_eq!(service_ports(&s, None).expect("ok")[0].external_ips.len(), 5000);
    }

    #[test]
    fn unknown_protocol_and_bad_port_are_dropped() {
        let s = svc(json!({"metadata": {"name": "a", "namespace": "n"},
            "spec": {"clusterIP": "198.19.0.1", "ports": [{"port": 80, "protocol": "QUIC"}, {"port": 70000}, {"port": 81}]}}));
        let ports = service_ports(&s, None).expect("ok");
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].port, 81);
    }
}
