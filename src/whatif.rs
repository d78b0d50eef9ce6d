//! What a ServiceCIDR change would do, changing nothing: the Services that would lose
//! coverage (and so keep a deletion waiting: Kubernetes keeps a ServiceCIDR until no
//! IPAddress in it is left uncovered), the new range's band split and capacity, and its
//! overlaps — with the other ServiceCIDRs (allowed: it is how a range is widened) and with
//! the nodes' pod CIDRs and addresses (unsafe: a Service address that is also a pod's or a
//! node's is routed wrongly). Pure: the cluster's ServiceCIDRs, Services and nodes in, the
//! verdict out (`clusterip what-if` reads them and prints it).

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Serialize;

use crate::cidr::{self, ServiceCidr};
use crate::repair::ServiceView;

/// The cluster's ServiceCIDRs: each one's name and ranges.
pub type ServiceCidrs = Vec<(String, Vec<ServiceCidr>)>;

/// One change to judge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Delete the ServiceCIDR of this name.
    Delete { name: String },
    /// Create a ServiceCIDR with this range.
    Add { cidr: ServiceCidr },
    /// Replace the ranges of the ServiceCIDR `name` by `cidr` (of the same family).
    Shrink { name: String, cidr: ServiceCidr },
}

/// What a node holds that Service addresses must never overlap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    pub name: String,
    pub pod_cidrs: Vec<String>,
    pub addresses: Vec<String>,
}

impl NodeView {
    /// What `node` holds: its pod CIDRs (`podCIDRs`, else `podCIDR`) and its addresses.
    pub fn of(node: k8s_openapi::api::core::v1::Node) -> NodeView {
        NodeView {
            name: node.metadata.name.unwrap_or_default(),
            pod_cidrs: node.spec.as_ref().and_then(|s| s.pod_cidrs.clone().or_else(|| s.pod_cidr.clone().map(|c| vec![c]))).unwrap_or_default(),
            addresses: node.status.and_then(|s| s.addresses).unwrap_or_default().into_iter().map(|a| a.address).collect(),
        }
    }
}

/// A range the change adds (or narrows to).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NewRange {
    pub cidr: String,
    pub size: u64,
    pub static_band: u64,
    pub dynamic_band: u64,
    /// Service addresses it covers now.
    pub used: u64,
}

/// A Service that would hold an address no ServiceCIDR covers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Stranded {
    pub namespace: String,
    pub name: String,
    pub address: String,
}

/// An overlap of the new range.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Overlap {
    /// `servicecidr` (allowed), `pod-cidr` or `node-address` (unsafe).
    pub with: &'static str,
    /// The ServiceCIDR's or node's name.
    pub name: String,
    pub range: String,
}

/// The verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WhatIf {
    pub change: String,
    pub new_ranges: Vec<NewRange>,
    pub stranded: Vec<Stranded>,
    pub overlaps: Vec<Overlap>,
    /// No stranded Service and no unsafe overlap.
    pub safe: bool,
    /// One line on why not, or what happens.
    pub verdict: String,
}

/// Judge `change` against the cluster: its ServiceCIDRs (name, ranges), Services and nodes.
/// Errors name what cannot be: an unknown ServiceCIDR, a narrowing of another family.
pub fn judge(change: &Change, servicecidrs: &[(String, Vec<ServiceCidr>)], services: &[ServiceView], nodes: &[NodeView]) -> Result<WhatIf, String> {
    let find = |name: &str| servicecidrs.iter().find(|(n, _)| n == name).ok_or_else(|| format!("no ServiceCIDR named {name:?} (have: {})", names(servicecidrs)));
    let (after, added, text): (ServiceCidrs, Vec<ServiceCidr>, String) = match change {
        Change::Delete { name } => {
            find(name)?;
            (servicecidrs.iter().filter(|(n, _)| n != name).cloned().collect(), Vec::new(), format!("delete ServiceCIDR {name}"))
        }
        Change::Add { cidr } => {
            let mut after = servicecidrs.to_vec();
            after.push(("(new)".into(), vec![cidr.clone()]));
            (after, vec![cidr.clone()], format!("add ServiceCIDR {cidr}"))
        }
        Change::Shrink { name, cidr } => {
            let (_, ranges) = find(name)?;
            let Some(old) = ranges.iter().find(|r| r.family() == cidr.family()) else {
                return Err(format!("ServiceCIDR {name} has no {} range to narrow", cidr.family()));
            };
            if !old.contains_cidr(cidr) {
                return Err(format!("{cidr} is not inside {old}, the {} range of ServiceCIDR {name}: that is a move (add the new range, re-create the Services, delete the old one), not a shrink", cidr.family()));
            }
            let after = servicecidrs.iter().map(|(n, rs)| (n.clone(), if n == name { rs.iter().map(|r| if r == old { cidr.clone() } else { r.clone() }).collect() } else { rs.clone() })).collect();
            (after, vec![cidr.clone()], format!("narrow ServiceCIDR {name} from {old} to {cidr}"))
        }
    };
    let covered = |set: &[(String, Vec<ServiceCidr>)], ip: IpAddr| set.iter().any(|(_, rs)| rs.iter().any(|r| r.contains(ip)));
    let mut stranded = Vec::new();
    for s in services {
        for text in &s.cluster_ips {
            let Ok(ip) = cidr::parse_ip(text) else { continue };
            if covered(servicecidrs, ip) && !covered(&after, ip) {
                stranded.push(Stranded { namespace: s.namespace.clone(), name: s.name.clone(), address: ip.to_string() });
            }
        }
    }
    stranded.sort_by(|a, b| (&a.namespace, &a.name, &a.address).cmp(&(&b.namespace, &b.name, &b.address)));
    let mut overlaps = Vec::new();
    for c in &added {
        for (n, rs) in servicecidrs.iter().filter(|(n, _)| !matches!(change, Change::Shrink { name, .. } if name == n)) {
            for r in rs.iter().filter(|r| r.overlaps(c)) {
                overlaps.push(Overlap { with: "servicecidr", name: n.clone(), range: r.to_string() });
            }
        }
        let net = net_of(c);
        for node in nodes {
            for p in node.pod_cidrs.iter().filter_map(|t| t.parse::<IpNet>().ok()) {
                if p.contains(&net.network()) || net.contains(&p.network()) {
                    overlaps.push(Overlap { with: "pod-cidr", name: node.name.clone(), range: p.to_string() });
                }
            }
            for a in node.addresses.iter().filter_map(|t| cidr::parse_ip(t).ok()) {
                if net.contains(&a) {
                    overlaps.push(Overlap { with: "node-address", name: node.name.clone(), range: a.to_string() });
                }
            }
        }
    }
    let new_ranges = added
        .iter()
        .map(|c| NewRange {
            cidr: c.to_string(),
            size: c.size(),
            static_band: c.band_offset(),
            dynamic_band: c.size() - c.band_offset(),
            used: services.iter().flat_map(|s| &s.cluster_ips).filter(|t| cidr::parse_ip(t).is_ok_and(|ip| c.contains(ip))).count() as u64,
        })
        .collect();
    let unsafe_overlaps = overlaps.iter().filter(|o| o.with != "servicecidr").count();
    let safe = stranded.is_empty() && unsafe_overlaps == 0;
    let verdict = if unsafe_overlaps > 0 {
        format!("unsafe: the range overlaps {unsafe_overlaps} pod CIDR(s) or node address(es); a Service address there is also a pod's or a node's")
    } else if !stranded.is_empty() {
        let what = if matches!(change, Change::Delete { .. }) { "the deletion waits" } else { "the change would leave them uncovered" };
        format!(
            "blocked: {} Service address(es) would be in no ServiceCIDR; {what} until they are re-created elsewhere (Kubernetes keeps a ServiceCIDR while an IPAddress only it covers exists)",
            stranded.len()
        )
    } else {
        "safe: every Service address stays covered".to_string()
    };
    Ok(WhatIf { change: text, new_ranges, stranded, overlaps, safe, verdict })
}

fn names(servicecidrs: &[(String, Vec<ServiceCidr>)]) -> String {
    servicecidrs.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
}

/// The CIDR as an `IpNet` (network address and prefix).
fn net_of(c: &ServiceCidr) -> IpNet {
    let text = c.to_string();
    text.parse().unwrap_or_else(|_| IpNet::from(c.network()))
}

impl std::fmt::Display for WhatIf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "what if: {}", self.change)?;
        for r in &self.new_ranges {
            writeln!(f, "  range      {}: {} usable, static band {}, dynamic band {}; {} Service address(es) in it now", r.cidr, r.size, r.static_band, r.dynamic_band, r.used)?;
        }
        for o in &self.overlaps {
            let note = if o.with == "servicecidr" { "allowed (how a range is widened)" } else { "UNSAFE" };
            writeln!(f, "  overlaps   {} {} ({}): {note}", o.with, o.name, o.range)?;
        }
        for (i, s) in self.stranded.iter().enumerate() {
            if i == 20 {
                writeln!(f, "  stranded   … and {} more (-o json lists all)", self.stranded.len() - 20)?;
                break;
            }
            writeln!(f, "  stranded   {}/{} ({})", s.namespace, s.name, s.address)?;
        }
        write!(f, "  verdict    {}", self.verdict)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> ServiceCidr {
        ServiceCidr::parse(s).expect("cidr")
    }

    fn svc(name: &str, ip: &str) -> ServiceView {
        ServiceView { namespace: "ns".into(), name: name.into(), cluster_ips: vec![ip.into()], ..Default::default() }
    }

    fn cluster() -> (ServiceCidrs, Vec<ServiceView>, Vec<NodeView>) {
        let cidrs = vec![("kubernetes".to_string(), vec![c("10.96.0.0/16")]), ("extra".to_string(), vec![c("10.97.0.0/24")])];
        let services = vec![svc("a", "10.96.0.10"), svc("b", "10.97.0.5"), svc("c", "10.96.200.1")];
        let nodes = vec![NodeView { name: "n1".into(), pod_cidrs: vec!["10.244.0.0/24".into(), "fd00:10:244::/64".into()], addresses: vec!["192.168.1.10".into()] }];
        (cidrs, services, nodes)
    }

    #[test]
    fn deleting_a_servicecidr_strands_the_services_only_it_covers() {
        let (cidrs, services, nodes) = cluster();
        let w = judge(&Change::Delete { name: "extra".into() }, &cidrs, &services, &nodes).expect("judge");
        assert_eq!(w.stranded, vec![Stranded { namespace: "ns".into(), name: "b".into(), address: "10.97.0.5".into() }]);
        assert!(!w.safe && w.verdict.starts_with("blocked: 1 Service address(es)"), "{w}");
        // A wider ServiceCIDR covering it first makes the deletion safe.
        let mut wider = cidrs.clone();
        wider.push(("wide".into(), vec![c("10.96.0.0/15")]));
        assert!(judge(&Change::Delete { name: "extra".into() }, &wider, &services, &nodes).expect("judge").safe);
        assert!(judge(&Change::Delete { name: "nope".into() }, &cidrs, &services, &nodes).is_err());
    }

    #[test]
    fn an_added_range_reports_its_bands_and_overlaps_and_a_pod_cidr_overlap_is_unsafe() {
        let (cidrs, services, nodes) = cluster();
        let w = judge(&Change::Add { cidr: c("10.96.0.0/15") }, &cidrs, &services, &nodes).expect("judge");
        assert_eq!(w.new_ranges[0], NewRange { cidr: "10.96.0.0/15".into(), size: 131070, static_band: 256, dynamic_band: 130814, used: 3 });
        assert_eq!(w.overlaps.iter().map(|o| (o.with, o.name.as_str())).collect::<Vec<_>>(), vec![("servicecidr", "kubernetes"), ("servicecidr", "extra")]);
        assert!(w.safe, "{w}");
        let bad = judge(&Change::Add { cidr: c("10.244.0.0/16") }, &cidrs, &services, &nodes).expect("judge");
        assert_eq!(bad.overlaps, vec![Overlap { with: "pod-cidr", name: "n1".into(), range: "10.244.0.0/24".into() }]);
        assert!(!bad.safe && bad.verdict.starts_with("unsafe"), "{bad}");
        let node = judge(&Change::Add { cidr: c("192.168.1.0/24") }, &cidrs, &services, &nodes).expect("judge");
        assert_eq!(node.overlaps[0].with, "node-address");
    }

    #[test]
    fn a_shrink_strands_what_it_leaves_out_and_refuses_a_range_outside() {
        let (cidrs, services, nodes) = cluster();
        let w = judge(&Change::Shrink { name: "kubernetes".into(), cidr: c("10.96.0.0/17") }, &cidrs, &services, &nodes).expect("judge");
        assert_eq!(w.stranded.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), vec!["c"]);
        assert_eq!(w.new_ranges[0].used, 1);
        assert!(judge(&Change::Shrink { name: "kubernetes".into(), cidr: c("10.98.0.0/24") }, &cidrs, &services, &nodes).unwrap_err().contains("is a move"));
    }
}
