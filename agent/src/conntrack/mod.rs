//! UDP conntrack cleanup (kube-proxy's most reported bug: stale UDP entries keep sending
//! a flow to a dead endpoint). After each successful sync the agent deletes, in the node's
//! namespace:
//! - entries DNATed to an endpoint (address and port) that is no longer used by a Service
//!   port, for each of its VIPs and its NodePort — a changed targetPort makes the old
//!   address:port stale even though the pod stays (Kubernetes' e2e "should be able to
//!   cleanup conntrack entries when UDP service target port changes for a NodePort
//!   service");
//! - entries of a VIP, and of the NodePort, whose Service port went from no endpoints to
//!   some (traffic sent while it had none must not stay pinned to the reject) — only those
//!   that were not DNATed (reply source = the original destination): a flow the new rules
//!   already sent to an endpoint, between the commit and this flush, keeps its endpoint (as
//!   kube-proxy's cleanup keeps entries whose endpoint is serving);
//! - entries of a VIP whose Service port is gone.
//!
//! [`ConntrackCleaner::plan`] (pure) says what, as a [`FlushSet`]: hash sets that decide
//! for one entry in O(1) whether it goes, whatever the number of flushes. The sync loop
//! hands the set to the [`flusher::Flusher`], a thread of its own that coalesces what
//! arrives while it works and runs one round at a time: one ctnetlink dump of each family's
//! UDP entries, filtered in memory against the set, and deletes of the matches
//! ([`ctnetlink`]). No `conntrack` process is started, and the sync loop never waits for a
//! flush.

#![forbid(unsafe_code)]

pub mod ctnetlink;
pub mod flusher;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::IpAddr;

use crate::model::state::DesiredPort;
use crate::model::{IpFamily, NamespacedName, Protocol, ServicePortName};
use crate::proxier::SyncBatch;
use ctnetlink::{Entry, IPPROTO_UDP};

/// One kind of UDP entries to delete.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Flush {
    /// Every UDP entry to `vip:port`.
    Service { vip: IpAddr, port: u16 },
    /// UDP entries to `vip:port` that were not DNATed to an endpoint.
    NotDnatted { vip: IpAddr, port: u16 },
    /// UDP entries to the NodePort `port`, at any address of `family`, that were not DNATed.
    NotDnattedNodePort { family: IpFamily, port: u16 },
    /// UDP entries to `vip:port` DNATed to `endpoint:endpoint_port`.
    Endpoint { vip: IpAddr, port: u16, endpoint: IpAddr, endpoint_port: u16 },
    /// UDP entries to the NodePort `port` DNATed to `endpoint:endpoint_port`.
    NodePortEndpoint { port: u16, endpoint: IpAddr, endpoint_port: u16 },
}

/// Flushes as hash sets, to match a dumped entry in O(1). An entry is "DNATed to X:p" when
/// its reply comes from X, port p, and X is not the original destination (the `conntrack`
/// tool's `--dst-nat X:p`); "not DNATed" when the reply comes from the original destination
/// (`--reply-src VIP`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FlushSet {
    services: HashSet<(IpAddr, u16)>,
    not_dnatted: HashSet<(IpAddr, u16)>,
    not_dnatted_node_ports: HashSet<(IpFamily, u16)>,
    endpoints: HashSet<(IpAddr, u16, IpAddr, u16)>,
    node_port_endpoints: HashSet<(u16, IpAddr, u16)>,
}

impl FlushSet {
    pub fn insert(&mut self, f: Flush) {
        match f {
            Flush::Service { vip, port } => self.services.insert((vip, port)),
            Flush::NotDnatted { vip, port } => self.not_dnatted.insert((vip, port)),
            Flush::NotDnattedNodePort { family, port } => self.not_dnatted_node_ports.insert((family, port)),
            Flush::Endpoint { vip, port, endpoint, endpoint_port } => self.endpoints.insert((vip, port, endpoint, endpoint_port)),
            Flush::NodePortEndpoint { port, endpoint, endpoint_port } => self.node_port_endpoints.insert((port, endpoint, endpoint_port)),
        };
    }

    /// Add every flush of `other`.
    pub fn merge(&mut self, other: FlushSet) {
        self.services.extend(other.services);
        self.not_dnatted.extend(other.not_dnatted);
        self.not_dnatted_node_ports.extend(other.not_dnatted_node_ports);
        self.endpoints.extend(other.endpoints);
        self.node_port_endpoints.extend(other.node_port_endpoints);
    }

    pub fn len(&self) -> usize {
        self.services.len()
            + self.not_dnatted.len()
            + self.not_dnatted_node_ports.len()
            + self.endpoints.len()
            + self.node_port_endpoints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The families with something to flush (one dump each).
    pub fn families(&self) -> Vec<IpFamily> {
        let mut seen = BTreeSet::new();
        seen.extend(self.services.iter().chain(&self.not_dnatted).map(|(ip, _)| IpFamily::of(ip)));
        seen.extend(self.not_dnatted_node_ports.iter().map(|(family, _)| *family));
        seen.extend(self.endpoints.iter().map(|(ip, _, _, _)| IpFamily::of(ip)));
        seen.extend(self.node_port_endpoints.iter().map(|(_, ip, _)| IpFamily::of(ip)));
        seen.into_iter().collect()
    }

    /// Whether `e` is to be deleted.
    pub fn matches(&self, e: &Entry) -> bool {
        if e.proto != IPPROTO_UDP {
            return false;
        }
        let to = (e.orig.dst, e.orig.dport);
        if self.services.contains(&to) {
            return true;
        }
        if e.reply.src == e.orig.dst {
            return self.not_dnatted.contains(&to)
                || self.not_dnatted_node_ports.contains(&(IpFamily::of(&e.orig.dst), e.orig.dport));
        }
        let (endpoint, endpoint_port) = (e.reply.src, e.reply.sport);
        self.endpoints.contains(&(to.0, to.1, endpoint, endpoint_port))
            || self.node_port_endpoints.contains(&(to.1, endpoint, endpoint_port))
    }

    /// The flushes, sorted (for tests and logs).
    pub fn to_vec(&self) -> Vec<Flush> {
        let mut v: Vec<Flush> = self.services.iter().map(|&(vip, port)| Flush::Service { vip, port }).collect();
        v.extend(self.not_dnatted.iter().map(|&(vip, port)| Flush::NotDnatted { vip, port }));
        v.extend(self.not_dnatted_node_ports.iter().map(|&(family, port)| Flush::NotDnattedNodePort { family, port }));
        v.extend(self.endpoints.iter().map(|&(vip, port, endpoint, endpoint_port)| Flush::Endpoint { vip, port, endpoint, endpoint_port }));
        v.extend(
            self.node_port_endpoints
                .iter()
                .map(|&(port, endpoint, endpoint_port)| Flush::NodePortEndpoint { port, endpoint, endpoint_port }),
        );
        v.sort();
        v
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct UdpPort {
    vips: Vec<IpAddr>,
    port: u16,
    node_port: Option<u16>,
    /// Endpoint address and port.
    endpoints: BTreeSet<(IpAddr, u16)>,
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
            let endpoints = c.cluster.iter().chain(&c.local).map(|e| (e.ip, e.port)).collect();
            out.insert((sp.name.clone(), fam), UdpPort { vips, port: sp.port, node_port: sp.node_port, endpoints });
        }
    }
    out
}

impl ConntrackCleaner {
    /// What to flush after `batch` was programmed successfully; remembers the new state.
    pub fn plan(&mut self, batch: &SyncBatch) -> FlushSet {
        let mut out = FlushSet::default();
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
        out
    }
}

fn diff(
    old: &HashMap<(ServicePortName, IpFamily), UdpPort>,
    new: &HashMap<(ServicePortName, IpFamily), UdpPort>,
    out: &mut FlushSet,
) {
    for (key, o) in old {
        match new.get(key) {
            None => {
                for vip in &o.vips {
                    out.insert(Flush::Service { vip: *vip, port: o.port });
                }
                for &(endpoint, endpoint_port) in &o.endpoints {
                    if let Some(np) = o.node_port {
                        out.insert(Flush::NodePortEndpoint { port: np, endpoint, endpoint_port });
                    }
                }
            }
            Some(n) => {
                // Changed VIPs or port: the old ones are gone. (A set: thousands of
                // externalIPs made `Vec::contains` here quadratic.)
                let new_vips: HashSet<&IpAddr> = n.vips.iter().collect();
                for vip in o.vips.iter().filter(|v| n.port != o.port || !new_vips.contains(v)) {
                    out.insert(Flush::Service { vip: *vip, port: o.port });
                }
                for &(endpoint, endpoint_port) in o.endpoints.difference(&n.endpoints) {
                    for vip in &o.vips {
                        out.insert(Flush::Endpoint { vip: *vip, port: o.port, endpoint, endpoint_port });
                    }
                    if let Some(np) = o.node_port {
                        out.insert(Flush::NodePortEndpoint { port: np, endpoint, endpoint_port });
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
            if let Some(np) = n.node_port {
                out.insert(Flush::NotDnattedNodePort { family: key.1, port: np });
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

    fn udp(orig: (&str, u16, &str, u16), reply_src: (&str, u16)) -> Entry {
        let o = ctnetlink::Tuple { src: ip(orig.0), sport: orig.1, dst: ip(orig.2), dport: orig.3 };
        let r = ctnetlink::Tuple { src: ip(reply_src.0), sport: reply_src.1, dst: o.src, dport: o.sport };
        Entry { proto: IPPROTO_UDP, orig: o, reply: r, zone: 0, id: None }
    }

    #[test]
    fn removed_udp_endpoint_is_flushed() {
        let mut c = ConntrackCleaner::default();
        let first = c.plan(&batch(Protocol::Udp, &["198.18.2.1", "198.18.2.2"]));
        assert_eq!(first.to_vec(), vec![Flush::NotDnatted { vip: ip("198.19.0.53"), port: 53 }], "gained endpoints");
        let second = c.plan(&batch(Protocol::Udp, &["198.18.2.2"]));
        assert_eq!(second.to_vec(), vec![Flush::Endpoint { vip: ip("198.19.0.53"), port: 53, endpoint: ip("198.18.2.1"), endpoint_port: 5353 }]);
        assert!(c.plan(&batch(Protocol::Udp, &["198.18.2.2"])).is_empty());
    }

    #[test]
    fn a_changed_target_port_flushes_the_old_endpoint_port_of_the_same_pod() {
        // Kubernetes' e2e "should be able to cleanup conntrack entries when UDP service
        // target port changes for a NodePort service": the pod stays, its port goes from
        // 8080 to 9090; a client keeping its source port stayed pinned to 8080 while the
        // flush looked at endpoint addresses only.
        let port = |endpoint_port: u16| {
            let mut sp = ServicePort::cluster_ip("ns", "svc-udp", "udp", Protocol::Udp, ip("198.19.0.80"), 80);
            sp.node_port = Some(31131);
            let cluster = vec![Endpoint::ready(ip("198.18.241.130"), endpoint_port)];
            let d = DesiredPort { port: sp, v4: Categorized { cluster, local: vec![], has_any: true }, v6: Categorized::default() };
            SyncBatch { full: false, services: vec![(NamespacedName::new("ns", "svc-udp"), vec![d])] }
        };
        let mut c = ConntrackCleaner::default();
        c.plan(&port(8080));
        let set = c.plan(&port(9090));
        assert_eq!(
            set.to_vec(),
            vec![
                Flush::Endpoint { vip: ip("198.19.0.80"), port: 80, endpoint: ip("198.18.241.130"), endpoint_port: 8080 },
                Flush::NodePortEndpoint { port: 31131, endpoint: ip("198.18.241.130"), endpoint_port: 8080 },
            ]
        );
        let client = "198.18.241.5";
        assert!(set.matches(&udp((client, 12345, "198.18.240.3", 31131), ("198.18.241.130", 8080))), "the old NodePort flow");
        assert!(set.matches(&udp((client, 12345, "198.19.0.80", 80), ("198.18.241.130", 8080))), "the old ClusterIP flow");
        assert!(!set.matches(&udp((client, 12345, "198.18.240.3", 31131), ("198.18.241.130", 9090))), "a flow on the new port stays");
    }

    #[test]
    fn a_node_port_that_gains_endpoints_flushes_the_flows_sent_while_it_had_none() {
        // Kubernetes' e2e "should be able to preserve UDP traffic when server pod cycles for
        // a NodePort service": a client probing the NodePort from one source port before
        // the server exists keeps an entry that was never DNATed (refreshed every second);
        // it stayed so after the endpoint came, while only the VIPs' entries were flushed.
        let port = |eps: &[&str]| {
            let mut sp = ServicePort::cluster_ip("ns", "svc-udp", "udp", Protocol::Udp, ip("198.19.0.80"), 80);
            sp.node_port = Some(31637);
            let cluster: Vec<Endpoint> = eps.iter().map(|e| Endpoint::ready(ip(e), 80)).collect();
            let has_any = !cluster.is_empty();
            let d = DesiredPort { port: sp, v4: Categorized { cluster, local: vec![], has_any }, v6: Categorized::default() };
            SyncBatch { full: false, services: vec![(NamespacedName::new("ns", "svc-udp"), vec![d])] }
        };
        let mut c = ConntrackCleaner::default();
        assert!(c.plan(&port(&[])).is_empty(), "no endpoints yet: nothing to flush");
        let set = c.plan(&port(&["198.18.241.130"]));
        assert_eq!(
            set.to_vec(),
            vec![Flush::NotDnatted { vip: ip("198.19.0.80"), port: 80 }, Flush::NotDnattedNodePort { family: IpFamily::V4, port: 31637 }]
        );
        let client = "198.18.241.5";
        assert!(set.matches(&udp((client, 12345, "198.18.240.3", 31637), ("198.18.240.3", 31637))), "sent while it had none");
        assert!(!set.matches(&udp((client, 12345, "198.18.240.3", 31637), ("198.18.241.130", 80))), "already DNATed: kept");
        assert!(!set.matches(&udp(("fd00:1::5", 12345, "fd00:1::3", 31637), ("fd00:1::3", 31637))), "the other family");
        assert_eq!(set.families(), vec![IpFamily::V4]);
    }

    #[test]
    fn tcp_needs_no_flush_and_deleted_service_is_flushed() {
        let mut c = ConntrackCleaner::default();
        assert!(c.plan(&batch(Protocol::Tcp, &["198.18.2.1"])).is_empty());
        c.plan(&batch(Protocol::Udp, &["198.18.2.1"]));
        let gone = c.plan(&SyncBatch { full: true, services: vec![] });
        assert_eq!(gone.to_vec(), vec![Flush::Service { vip: ip("198.19.0.53"), port: 53 }]);
    }

    #[test]
    fn the_filter_picks_exactly_what_the_conntrack_tool_would() {
        let mut set = FlushSet::default();
        set.insert(Flush::Endpoint { vip: ip("198.19.0.53"), port: 53, endpoint: ip("198.18.2.1"), endpoint_port: 5353 });
        set.insert(Flush::NotDnatted { vip: ip("198.19.0.54"), port: 53 });
        set.insert(Flush::Service { vip: ip("198.19.0.55"), port: 53 });
        set.insert(Flush::NodePortEndpoint { port: 30053, endpoint: ip("198.18.2.1"), endpoint_port: 5353 });
        set.insert(Flush::Endpoint { vip: ip("fd00:10:96::35"), port: 53, endpoint: ip("fd00:2::1"), endpoint_port: 5353 });
        let c = "198.18.1.2";
        let cases = [
            // --orig-dst 198.19.0.53 --orig-port-dst 53 --dst-nat 198.18.2.1
            (udp((c, 4000, "198.19.0.53", 53), ("198.18.2.1", 5353)), true),
            (udp((c, 4000, "198.19.0.53", 53), ("198.18.2.1", 5354)), false),
            (udp((c, 4000, "198.19.0.53", 53), ("198.18.2.2", 5353)), false),
            (udp((c, 4000, "198.19.0.53", 54), ("198.18.2.1", 5353)), false),
            (udp((c, 4000, "198.19.0.53", 53), ("198.19.0.53", 53)), false),
            // --orig-dst 198.19.0.54 --orig-port-dst 53 --reply-src 198.19.0.54
            (udp((c, 4000, "198.19.0.54", 53), ("198.19.0.54", 53)), true),
            (udp((c, 4000, "198.19.0.54", 53), ("198.18.2.1", 5353)), false),
            // --orig-dst 198.19.0.55 --orig-port-dst 53: whatever the reply
            (udp((c, 4000, "198.19.0.55", 53), ("198.18.2.7", 5353)), true),
            (udp((c, 4000, "198.19.0.55", 53), ("198.19.0.55", 53)), true),
            (udp((c, 4000, "198.19.0.55", 80), ("198.19.0.55", 80)), false),
            // --orig-port-dst 30053 --dst-nat 198.18.2.1, to any node address
            (udp((c, 4000, "198.18.1.1", 30053), ("198.18.2.1", 5353)), true),
            (udp((c, 4000, "198.18.1.1", 30053), ("198.18.2.1", 9090)), false),
            (udp((c, 4000, "198.18.1.1", 30053), ("198.18.1.1", 30053)), false),
            (udp(("fd00:1::2", 4000, "fd00:10:96::35", 53), ("fd00:2::1", 5353)), true),
            (udp(("fd00:1::2", 4000, "fd00:10:96::35", 53), ("fd00:2::2", 5353)), false),
        ];
        for (e, want) in cases {
            assert_eq!(set.matches(&e), want, "{e:?}");
        }
        let tcp = Entry { proto: ctnetlink::IPPROTO_TCP, ..cases[0].0 };
        assert!(!set.matches(&tcp), "UDP only");
        assert_eq!(set.families(), vec![IpFamily::V4, IpFamily::V6]);
    }

    #[test]
    fn thousands_of_vips_plan_one_flush_per_vip_in_one_set() {
        // The attack of issue 30: a UDP Service with many externalIPs loses an endpoint.
        let vips: Vec<IpAddr> = (0..5000u32).map(|i| IpAddr::from(std::net::Ipv4Addr::from(0xc612_0000 + i))).collect();
        let port = |eps: &[&str]| {
            let mut sp = ServicePort::cluster_ip("ns", "dns", "", Protocol::Udp, ip("198.19.0.53"), 53);
            sp.external_ips = vips.clone();
            let cluster: Vec<Endpoint> = eps.iter().map(|e| Endpoint::ready(ip(e), 5353)).collect();
            let d = DesiredPort { port: sp, v4: Categorized { cluster, local: vec![], has_any: true }, v6: Categorized::default() };
            SyncBatch { full: false, services: vec![(NamespacedName::new("ns", "dns"), vec![d])] }
        };
        let mut c = ConntrackCleaner::default();
        c.plan(&port(&["198.18.2.1", "198.18.2.2"]));
        let set = c.plan(&port(&["198.18.2.2"]));
        assert_eq!(set.len(), 5001, "the ClusterIP and every externalIP");
        assert!(set.matches(&udp(("198.18.1.2", 1, &vips[4999].to_string(), 53), ("198.18.2.1", 5353))));
        assert!(!set.matches(&udp(("198.18.1.2", 1, &vips[4999].to_string(), 53), ("198.18.2.2", 5353))));
    }
}
