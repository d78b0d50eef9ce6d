//! UDP conntrack cleanup (kube-proxy's most reported bug: stale UDP entries keep sending
//! a flow to a dead endpoint). After each successful sync the agent deletes, with
//! `conntrack -D` in the node's namespace:
//! - entries DNATed to an endpoint that is no longer used by a Service port, for each of
//!   its VIPs and its NodePort;
//! - entries of a VIP whose Service port went from no endpoints to some (traffic sent
//!   while it had none must not stay pinned to the reject) — only those that were not
//!   DNATed (reply source = the VIP itself): a flow the new rules already sent to an
//!   endpoint, between the commit and this flush, keeps its endpoint (as kube-proxy's
//!   cleanup keeps entries whose endpoint is serving);
//! - entries of a VIP whose Service port is gone.

#![forbid(unsafe_code)]

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use crate::model::state::DesiredPort;
use crate::model::{IpFamily, NamespacedName, Protocol, ServicePortName};
use crate::netns::{ExecError, Executor};
use crate::proxier::SyncBatch;

/// One `conntrack -D` to run.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Flush {
    /// Every UDP entry to `vip:port`.
    Service { vip: IpAddr, port: u16 },
    /// UDP entries to `vip:port` that were not DNATed to an endpoint.
    NotDnatted { vip: IpAddr, port: u16 },
    /// UDP entries to `vip:port` DNATed to `endpoint`.
    Endpoint { vip: IpAddr, port: u16, endpoint: IpAddr },
    /// UDP entries to the NodePort `port` DNATed to `endpoint`.
    NodePortEndpoint { port: u16, endpoint: IpAddr },
}

impl Flush {
    /// The `conntrack` arguments.
    pub fn args(&self) -> Vec<String> {
        let fam = |ip: &IpAddr| if IpFamily::of(ip) == IpFamily::V6 { "ipv6" } else { "ipv4" };
        let s = |x: &str| x.to_string();
        match self {
            Flush::Service { vip, port } => {
                vec![s("-D"), s("-f"), s(fam(vip)), s("-p"), s("udp"), s("--orig-dst"), vip.to_string(), s("--orig-port-dst"), port.to_string()]
            }
            Flush::NotDnatted { vip, port } => vec![
                s("-D"),
                s("-f"),
                s(fam(vip)),
                s("-p"),
                s("udp"),
                s("--orig-dst"),
                vip.to_string(),
                s("--orig-port-dst"),
                port.to_string(),
                s("--reply-src"),
                vip.to_string(),
            ],
            Flush::Endpoint { vip, port, endpoint } => vec![
                s("-D"),
                s("-f"),
                s(fam(vip)),
                s("-p"),
                s("udp"),
                s("--orig-dst"),
                vip.to_string(),
                s("--orig-port-dst"),
                port.to_string(),
                s("--dst-nat"),
                endpoint.to_string(),
            ],
            Flush::NodePortEndpoint { port, endpoint } => vec![
                s("-D"),
                s("-f"),
                s(fam(endpoint)),
                s("-p"),
                s("udp"),
                s("--orig-port-dst"),
                port.to_string(),
                s("--dst-nat"),
                endpoint.to_string(),
            ],
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct UdpPort {
    vips: Vec<IpAddr>,
    port: u16,
    node_port: Option<u16>,
    endpoints: BTreeSet<IpAddr>,
}

/// Remembers the UDP Service ports as last programmed, to know what became stale.
#[derive(Debug, Default)]
pub struct ConntrackCleaner {
    ports: HashMap<NamespacedName, HashMap<(ServicePortName, IpFamily), UdpPort>>,
}

fn udp_ports(ports: &[DesiredPort]) -> HashMap<(ServicePortName, IpFamily), UdpPort> {
    let mut out = HashMap::new();
    for d in ports.iter().filter(|d| d.port.name.protocol == Protocol::Udp) {
        for fam in IpFamily::ALL {
            let sp = &d.port;
            if !sp.cluster_ips.iter().any(|ip| IpFamily::of(ip) == fam) {
                continue;
            }
            let vips: Vec<IpAddr> = sp
                .cluster_ips
                .iter()
                .chain(&sp.external_ips)
                .chain(&sp.load_balancer_ips)
                .filter(|ip| IpFamily::of(ip) == fam)
                .copied()
                .collect();
            let c = d.endpoints(fam);
            let endpoints = c.cluster.iter().chain(&c.local).map(|e| e.ip).collect();
            out.insert((sp.name.clone(), fam), UdpPort { vips, port: sp.port, node_port: sp.node_port, endpoints });
        }
    }
    out
}

impl ConntrackCleaner {
    /// What to flush after `batch` was programmed successfully; remembers the new state.
    pub fn plan(&mut self, batch: &SyncBatch) -> Vec<Flush> {
        let mut out = BTreeSet::new();
        let mut seen = BTreeSet::new();
        for (nsn, ports) in &batch.services {
            seen.insert(nsn.clone());
            let new = udp_ports(ports);
            let old = self.ports.remove(nsn).unwrap_or_default();
            diff(&old, &new, &mut out);
            if !new.is_empty() {
                self.ports.insert(nsn.clone(), new);
            }
        }
        if batch.full {
            let gone: Vec<NamespacedName> = self.ports.keys().filter(|k| !seen.contains(*k)).cloned().collect();
            for nsn in gone {
                if let Some(old) = self.ports.remove(&nsn) {
                    diff(&old, &HashMap::new(), &mut out);
                }
            }
        }
        out.into_iter().collect()
    }

    /// Run the flushes; failures are logged and returned (they do not fail the sync, and
    /// are not retried: the rules are right, only some stale UDP entries may remain, as
    /// with kube-proxy). After a `conntrack` that timed out (killed), the remaining flushes
    /// of this sync are not tried — each would likely hang as long — and count as failed.
    pub fn execute(exec: &Executor, flushes: &[Flush]) -> Vec<ExecError> {
        let mut errors = Vec::new();
        for (i, f) in flushes.iter().enumerate() {
            let args = f.args();
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            match exec.run("conntrack", &argv, None) {
                Ok(_) => tracing::debug!(?f, "conntrack entries flushed"),
                // conntrack exits 1 when nothing matched.
                Err(ExecError::Failed { stderr, .. }) if stderr.contains("0 flow entries") => {}
                Err(e @ ExecError::Timeout { .. }) => {
                    let skipped = flushes.len() - i - 1;
                    tracing::warn!(error = %e, ?f, skipped, "conntrack hung; the remaining flushes of this sync are skipped");
                    errors.push(e);
                    errors.extend(flushes[i + 1..].iter().map(|_| ExecError::Skipped { program: "conntrack".into() }));
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?f, "conntrack flush failed");
                    errors.push(e);
                }
            }
        }
        errors
    }
}

fn diff(
    old: &HashMap<(ServicePortName, IpFamily), UdpPort>,
    new: &HashMap<(ServicePortName, IpFamily), UdpPort>,
    out: &mut BTreeSet<Flush>,
) {
    for (key, o) in old {
        match new.get(key) {
            None => {
                for vip in &o.vips {
                    out.insert(Flush::Service { vip: *vip, port: o.port });
                }
                for ep in &o.endpoints {
                    if let Some(np) = o.node_port {
                        out.insert(Flush::NodePortEndpoint { port: np, endpoint: *ep });
                    }
                }
            }
            Some(n) => {
                // Changed VIPs or port: the old ones are gone.
                for vip in o.vips.iter().filter(|v| n.port != o.port || !n.vips.contains(v)) {
                    out.insert(Flush::Service { vip: *vip, port: o.port });
                }
                for ep in o.endpoints.difference(&n.endpoints) {
                    for vip in &o.vips {
                        out.insert(Flush::Endpoint { vip: *vip, port: o.port, endpoint: *ep });
                    }
                    if let Some(np) = o.node_port {
                        out.insert(Flush::NodePortEndpoint { port: np, endpoint: *ep });
                    }
                }
            }
        }
    }
    for (key, n) in new {
        let had_none = old.get(key).is_none_or(|o| o.endpoints.is_empty());
        if had_none && !n.endpoints.is_empty() {
            for vip in &n.vips {
                out.insert(Flush::NotDnatted { vip: *vip, port: n.port });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::service::ServicePort;
    use crate::model::topology::Categorized;
    use crate::model::Endpoint;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn batch(proto: Protocol, eps: &[&str]) -> SyncBatch {
        let sp = ServicePort::cluster_ip("ns", "dns", "", proto, ip("198.19.0.53"), 53);
        let cluster: Vec<Endpoint> = eps.iter().map(|e| Endpoint::ready(ip(e), 5353)).collect();
        let has_any = !cluster.is_empty();
        let d = DesiredPort { port: sp, v4: Categorized { cluster, local: vec![], has_any }, v6: Categorized::default() };
        SyncBatch { full: false, services: vec![(NamespacedName::new("ns", "dns"), vec![d])] }
    }

    #[test]
    fn removed_udp_endpoint_is_flushed() {
        let mut c = ConntrackCleaner::default();
        let first = c.plan(&batch(Protocol::Udp, &["198.18.2.1", "198.18.2.2"]));
        assert_eq!(first, vec![Flush::NotDnatted { vip: ip("198.19.0.53"), port: 53 }], "gained endpoints");
        assert_eq!(
            first[0].args().join(" "),
            "-D -f ipv4 -p udp --orig-dst 198.19.0.53 --orig-port-dst 53 --reply-src 198.19.0.53",
            "only entries that were not DNATed"
        );
        let second = c.plan(&batch(Protocol::Udp, &["198.18.2.2"]));
        assert_eq!(second, vec![Flush::Endpoint { vip: ip("198.19.0.53"), port: 53, endpoint: ip("198.18.2.1") }]);
        assert!(c.plan(&batch(Protocol::Udp, &["198.18.2.2"])).is_empty());
        assert_eq!(
            second[0].args().join(" "),
            "-D -f ipv4 -p udp --orig-dst 198.19.0.53 --orig-port-dst 53 --dst-nat 198.18.2.1"
        );
    }

    #[test]
    fn tcp_needs_no_flush_and_deleted_service_is_flushed() {
        let mut c = ConntrackCleaner::default();
        assert!(c.plan(&batch(Protocol::Tcp, &["198.18.2.1"])).is_empty());
        c.plan(&batch(Protocol::Udp, &["198.18.2.1"]));
        let gone = c.plan(&SyncBatch { full: true, services: vec![] });
        assert_eq!(gone, vec![Flush::Service { vip: ip("198.19.0.53"), port: 53 }]);
    }
}
