//! Which endpoints a node uses for a Service port: kube-proxy's `CategorizeEndpoints`
//! (pkg/proxy/topology.go), behaviour re-implemented from its documented rules.

use super::service::ServicePort;
use super::Endpoint;

/// The result of categorising a Service port's endpoints on one node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Categorized {
    /// Endpoints for traffic with Cluster policy (hints applied; terminating fallback).
    pub cluster: Vec<Endpoint>,
    /// This node's endpoints for traffic with Local policy (terminating fallback).
    pub local: Vec<Endpoint>,
    /// Some usable endpoint exists anywhere: with none, traffic is rejected; with some but
    /// none usable under a Local policy, it is dropped.
    pub has_any: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TopologyMode {
    None,
    PreferSameNode,
    PreferSameZone,
}

fn topology_mode(endpoints: &[Endpoint], node_name: &str, zone: Option<&str>) -> TopologyMode {
    let (mut all_node_hints, mut for_node) = (true, false);
    let (mut all_zone_hints, mut for_zone) = (true, false);
    for ep in endpoints.iter().filter(|e| e.ready) {
        match &ep.node_hints {
            Some(h) if !h.is_empty() => for_node |= h.iter().any(|n| n == node_name),
            _ => all_node_hints = false,
        }
        match &ep.zone_hints {
            Some(h) if !h.is_empty() => for_zone |= zone.is_some_and(|z| h.iter().any(|hz| hz == z)),
            _ => all_zone_hints = false,
        }
    }
    if all_node_hints && for_node {
        return TopologyMode::PreferSameNode;
    }
    if all_zone_hints && for_zone {
        return TopologyMode::PreferSameZone;
    }
    TopologyMode::None
}

fn available_for_topology(ep: &Endpoint, mode: TopologyMode, node_name: &str, zone: Option<&str>) -> bool {
    match mode {
        TopologyMode::None => true,
        TopologyMode::PreferSameNode => ep.node_hints.as_ref().is_some_and(|h| h.iter().any(|n| n == node_name)),
        TopologyMode::PreferSameZone => {
            ep.zone_hints.as_ref().is_some_and(|h| zone.is_some_and(|z| h.iter().any(|hz| hz == z)))
        }
    }
}

/// Split `endpoints` of `svc` into the cluster and local lists this node programs.
pub fn categorize_endpoints(endpoints: &[Endpoint], svc: &ServicePort, node_name: &str, zone: Option<&str>) -> Categorized {
    let mut out = Categorized::default();
    if svc.uses_cluster_endpoints() {
        let mode = topology_mode(endpoints, node_name, zone);
        out.cluster = endpoints
            .iter()
            .filter(|e| e.ready && available_for_topology(e, mode, node_name, zone))
            .cloned()
            .collect();
        if out.cluster.is_empty() {
            out.cluster = endpoints.iter().filter(|e| e.serving && e.terminating).cloned().collect();
        }
        out.has_any = !out.cluster.is_empty();
    }
    if !svc.uses_local_endpoints() {
        return out;
    }
    let (mut local_ready, mut local_terminating) = (false, false);
    for e in endpoints {
        if e.ready {
            out.has_any = true;
            local_ready |= e.is_local;
        } else if e.serving && e.terminating {
            out.has_any = true;
            local_terminating |= e.is_local;
        }
    }
    if local_ready {
        out.local = endpoints.iter().filter(|e| e.is_local && e.ready).cloned().collect();
    } else if local_terminating {
        out.local = endpoints.iter().filter(|e| e.is_local && e.serving && e.terminating).cloned().collect();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;
    use std::net::IpAddr;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn svc() -> ServicePort {
        ServicePort::cluster_ip("n", "s", "", Protocol::Tcp, ip("198.19.0.1"), 80)
    }

    fn ep(last: u8) -> Endpoint {
        Endpoint::ready(ip(&format!("198.18.2.{last}")), 8080)
    }

    fn ips(eps: &[Endpoint]) -> Vec<String> {
        eps.iter().map(|e| e.ip.to_string()).collect()
    }

    #[test]
    fn only_ready_endpoints() {
        let mut not_ready = ep(2);
        not_ready.ready = false;
        not_ready.serving = false;
        let c = categorize_endpoints(&[ep(1), not_ready, ep(3)], &svc(), "n1", None);
        assert_eq!(ips(&c.cluster), vec!["198.18.2.1", "198.18.2.3"]);
        assert!(c.has_any);
        assert!(c.local.is_empty());
    }

    #[test]
    fn terminating_fallback_only_without_ready() {
        let mut term = ep(2);
        term.ready = false;
        term.terminating = true;
        let mut not_serving = ep(3);
        not_serving.ready = false;
        not_serving.serving = false;
        not_serving.terminating = true;
        let c = categorize_endpoints(&[term.clone(), not_serving.clone()], &svc(), "n1", None);
        assert_eq!(ips(&c.cluster), vec!["198.18.2.2"]);
        assert!(c.has_any);
        let c = categorize_endpoints(&[term, ep(1)], &svc(), "n1", None);
        assert_eq!(ips(&c.cluster), vec!["198.18.2.1"], "ready endpoints win over terminating ones");
        let c = categorize_endpoints(&[not_serving], &svc(), "n1", None);
        assert!(c.cluster.is_empty());
        assert!(!c.has_any, "no usable endpoint: reject");
    }

    #[test]
    fn zone_hints_only_when_all_have_them() {
        let mut a = ep(1);
        a.zone_hints = Some(vec!["za".into()]);
        let mut b = ep(2);
        b.zone_hints = Some(vec!["zb".into()]);
        let c = categorize_endpoints(&[a.clone(), b.clone()], &svc(), "n1", Some("za"));
        assert_eq!(ips(&c.cluster), vec!["198.18.2.1"]);
        // One endpoint without hints: hints ignored.
        let c = categorize_endpoints(&[a.clone(), b.clone(), ep(3)], &svc(), "n1", Some("za"));
        assert_eq!(c.cluster.len(), 3);
        // No hint for our zone: hints ignored.
        let c = categorize_endpoints(&[a.clone(), b.clone()], &svc(), "n1", Some("zc"));
        assert_eq!(c.cluster.len(), 2);
        // No zone known for the node: hints ignored.
        let c = categorize_endpoints(&[a, b], &svc(), "n1", None);
        assert_eq!(c.cluster.len(), 2);
    }

    #[test]
    fn node_hints_take_precedence() {
        let mut a = ep(1);
        a.node_hints = Some(vec!["n1".into()]);
        a.zone_hints = Some(vec!["za".into()]);
        let mut b = ep(2);
        b.node_hints = Some(vec!["n2".into()]);
        b.zone_hints = Some(vec!["za".into()]);
        let c = categorize_endpoints(&[a, b], &svc(), "n1", Some("za"));
        assert_eq!(ips(&c.cluster), vec!["198.18.2.1"]);
    }

    #[test]
    fn local_policy_uses_only_local_endpoints() {
        let mut s = svc();
        s.internal_policy_local = true;
        let mut local = ep(1);
        local.is_local = true;
        let c = categorize_endpoints(&[local, ep(2)], &s, "n1", None);
        assert!(c.cluster.is_empty(), "no cluster list when nothing uses Cluster policy");
        assert_eq!(ips(&c.local), vec!["198.18.2.1"]);
        let c = categorize_endpoints(&[ep(2)], &s, "n1", None);
        assert!(c.local.is_empty());
        assert!(c.has_any, "endpoints elsewhere: drop, not reject");
    }

    #[test]
    fn local_terminating_fallback_is_independent() {
        let mut s = svc();
        s.internal_policy_local = true;
        let mut local_term = ep(1);
        local_term.is_local = true;
        local_term.ready = false;
        local_term.terminating = true;
        let c = categorize_endpoints(&[local_term, ep(2)], &s, "n1", None);
        assert_eq!(ips(&c.local), vec!["198.18.2.1"], "remote ready endpoints do not block local fallback");
    }

    #[test]
    fn topology_hints_do_not_apply_to_local() {
        let mut s = svc();
        s.internal_policy_local = true;
        let mut a = ep(1);
        a.is_local = true;
        a.zone_hints = Some(vec!["zb".into()]);
        let c = categorize_endpoints(&[a], &s, "n1", Some("za"));
        assert_eq!(c.local.len(), 1);
    }
}
