//! Rendering: the table skeleton, and one Service port → its [`Fragment`] (chains, sets and
//! map elements it owns), as typed operations, rules and elements ([`super::ops`]). Pure:
//! no I/O; slot ranges come from the caller's allocator.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::ops::{BaseChain, Expr, Key, Op, Rule, SetName, SetType, TableRef, Value, Verdict};
use super::slots::{SlotAllocator, SlotRange, SlotsExhausted};
use crate::model::state::DesiredPort;
use crate::model::{Endpoint, IpFamily, ServicePortName};

// Table-wide maps and sets.
pub const SERVICE_IPS: &str = "service-ips";
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
pub const FIREWALL_IPS: &str = "firewall-ips";
pub const HAIRPIN: &str = "hairpin";

/// All table-wide maps and sets of the skeleton, in a fixed order.
pub const SHARED_SETS: [&str; 6] = [SERVICE_IPS, SERVICE_NODEPORTS, NO_ENDPOINT_SERVICES, NO_ENDPOINT_NODEPORTS, FIREWALL_IPS, HAIRPIN];

/// Rendering choices that come from flags.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// Masquerade all traffic to ClusterIPs (`--masquerade-all`).
    pub masquerade_all: bool,
    /// Pod CIDRs of the cluster (`--cluster-cidr`): traffic to a ClusterIP from outside
    /// them is masqueraded (kube-proxy's local-traffic detector).
    pub cluster_cidrs: Vec<ipnet::IpNet>,
}

const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";

fn jump(chain: &str) -> Expr {
    Expr::Verdict(Verdict::Jump(chain.to_string()))
}

fn goto(chain: &str) -> Expr {
    Expr::Verdict(Verdict::Goto(chain.to_string()))
}

/// The skeleton: table, base chains, helper chains, shared maps and their rules.
pub fn skeleton(family: IpFamily) -> Vec<Op> {
    let mut v = vec![Op::AddTable { comment: true }];
    for (name, kind, hook, priority) in [
        ("filter-prerouting", "filter", "prerouting", -110),
        ("filter-input", "filter", "input", -110),
        ("filter-forward", "filter", "forward", -110),
        ("filter-output", "filter", "output", -110),
        ("nat-prerouting", "nat", "prerouting", -100),
        ("nat-output", "nat", "output", -100),
        ("nat-postrouting", "nat", "postrouting", 100),
    ] {
        v.push(Op::AddChain { chain: name.to_string(), base: Some(BaseChain { kind, hook, priority }) });
    }
    for name in SKELETON_CHAINS {
        v.push(Op::AddChain { chain: name.to_string(), base: None });
    }
    for (name, ty) in [
        (SERVICE_IPS, SetType::AddrProtoPortVerdict(family)),
        (SERVICE_NODEPORTS, SetType::ProtoPortVerdict),
        (NO_ENDPOINT_SERVICES, SetType::AddrProtoPortVerdict(family)),
        (NO_ENDPOINT_NODEPORTS, SetType::ProtoPortVerdict),
        (FIREWALL_IPS, SetType::AddrProtoPortVerdict(family)),
        (HAIRPIN, SetType::AddrPair(family)),
    ] {
        v.push(Op::AddSet { name: name.to_string(), ty });
    }
    for (chain, rule) in skeleton_rules(family) {
        v.push(Op::AddRule { chain: chain.to_string(), rule });
    }
    v
}

/// Regular (non-base) chains of the skeleton.
pub const SKELETON_CHAINS: [&str; 7] = [
    "services",
    "masquerading",
    MARK_FOR_MASQUERADE,
    "reject-chain",
    "service-endpoints-check",
    "nodeport-endpoints-check",
    "firewall-check",
];

/// Base chains of the skeleton.
pub const BASE_CHAINS: [&str; 7] =
    ["filter-prerouting", "filter-input", "filter-forward", "filter-output", "nat-prerouting", "nat-output", "nat-postrouting"];

/// The skeleton's rules as (chain, rule).
pub fn skeleton_rules(family: IpFamily) -> Vec<(&'static str, Rule)> {
    use crate::model::Protocol::Tcp;
    use Expr::*;
    let new_jump = |c: &str| Rule::new([CtStateNew, jump(c)]);
    let local_ports = |m: &'static str| Rule::new([FibDaddrLocal, NotLoopback(family), VmapProtoPort(SetName::Named(m))]);
    vec![
        ("filter-prerouting", new_jump("firewall-check")),
        ("filter-input", new_jump("nodeport-endpoints-check")),
        ("filter-input", new_jump("service-endpoints-check")),
        ("filter-forward", new_jump("service-endpoints-check")),
        ("filter-output", new_jump("service-endpoints-check")),
        ("filter-output", new_jump("firewall-check")),
        ("nat-prerouting", Rule::new([jump("services")])),
        ("nat-output", Rule::new([jump("services")])),
        ("nat-postrouting", Rule::new([jump("masquerading")])),
        ("services", Rule::new([VmapDaddrProtoPort(family, SetName::Named(SERVICE_IPS))])),
        ("services", local_ports(SERVICE_NODEPORTS)),
        ("masquerading", Rule::new([CtStatusDnat, SaddrDaddrInSet(family, SetName::Named(HAIRPIN)), Masquerade { fully_random: false }])),
        ("masquerading", Rule::new([MasqMarkUnset, Expr::Verdict(super::ops::Verdict::Return)])),
        ("masquerading", Rule::new([MasqMarkToggle])),
        ("masquerading", Rule::new([Masquerade { fully_random: true }])),
        (MARK_FOR_MASQUERADE, Rule::new([MasqMarkSet])),
        ("reject-chain", Rule::new([L4Proto(Tcp), Reject { tcp_reset: true }])),
        ("reject-chain", Rule::new([Reject { tcp_reset: false }])),
        ("service-endpoints-check", Rule::new([VmapDaddrProtoPort(family, SetName::Named(NO_ENDPOINT_SERVICES))])),
        ("nodeport-endpoints-check", local_ports(NO_ENDPOINT_NODEPORTS)),
        ("firewall-check", Rule::new([VmapDaddrProtoPort(family, SetName::Named(FIREWALL_IPS))])),
    ]
}

/// An element of a table-wide map or set.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Element {
    pub set: SetName,
    pub key: Key,
    /// Map value; None for a set element.
    pub value: Option<Value>,
}

/// Everything one Service port owns in one family's table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fragment {
    /// Chain name → rules.
    pub chains: BTreeMap<String, Vec<Rule>>,
    /// Affinity set name → definition.
    pub sets: BTreeMap<String, SetType>,
    pub elements: Vec<Element>,
    /// Slot ranges owned, by chain name.
    pub slots: BTreeMap<String, SlotRange>,
}

impl Fragment {
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.elements.is_empty() && self.sets.is_empty()
    }

    /// Operations to create it from nothing (chains + rules + sets + elements).
    pub fn op_count(&self) -> usize {
        self.chains.len() + self.chains.values().map(Vec::len).sum::<usize>() + self.sets.len() + self.elements.len()
    }
}

/// `namespace/name/proto/port-name-or-number`: the base of this port's object names.
pub fn chain_base(name: &ServicePortName, port: u16) -> String {
    let p = if name.port_name.is_empty() { port.to_string() } else { name.port_name.clone() };
    format!("{}/{}/{}/{}", name.service.namespace, name.service.name, name.protocol, p)
}

fn endpoint_suffix(ep: &Endpoint) -> String {
    format!("{}/{}", ep.ip.to_string().replace(':', "."), ep.port)
}

/// Render one Service port for one family. `prev` is what is programmed now (its slot
/// ranges are reused when big enough); new ranges come from `slots`.
pub fn render_port(
    d: &DesiredPort,
    family: IpFamily,
    opts: &RenderOptions,
    prev: Option<&Fragment>,
    slots: &mut SlotAllocator,
) -> Result<Fragment, SlotsExhausted> {
    let mut frag = Fragment::default();
    let sp = &d.port;
    let in_family = |a: &&IpAddr| IpFamily::of(a) == family;
    let cluster_ips: Vec<&IpAddr> = sp.cluster_ips.iter().filter(in_family).collect();
    if cluster_ips.is_empty() {
        // kube-proxy programs a Service only in the families of its ClusterIPs.
        return Ok(frag);
    }
    let external_vips: Vec<&IpAddr> = sp.external_ips.iter().chain(&sp.load_balancer_ips).filter(in_family).collect();
    let eps = d.endpoints(family);
    let proto = sp.name.protocol;
    let base = chain_base(&sp.name, sp.port);
    let cluster_chain = format!("svc-{base}");
    let local_chain = format!("local-{base}");
    let ext_chain = format!("ext-{base}");
    let fw_chain = format!("fw-{base}");
    let has_cluster = sp.uses_cluster_endpoints() && !eps.cluster.is_empty();
    let has_local = sp.uses_local_endpoints() && !eps.local.is_empty();
    let no_endpoint_verdict = if eps.has_any { Verdict::Drop } else { Verdict::Goto("reject-chain".to_string()) };
    let goto_value = |chain: &str| Some(Value::Verdict(Verdict::Goto(chain.to_string())));

    // Endpoint selection chains.
    let mut ep_chain_names: BTreeMap<(IpAddr, u16), String> = BTreeMap::new();
    for (chain, list, present) in [(&cluster_chain, &eps.cluster, has_cluster), (&local_chain, &eps.local, has_local)] {
        if !present {
            continue;
        }
        let mut rules = Vec::new();
        // Masquerade rules for ClusterIP traffic live in the internal-traffic chain.
        let is_internal = (chain == &cluster_chain) != sp.internal_policy_local;
        if is_internal {
            for cip in &cluster_ips {
                let m = [Expr::Daddr(**cip), Expr::Dport(proto, sp.port)];
                if opts.masquerade_all {
                    rules.push(Rule::new([m[0].clone(), m[1].clone(), jump(MARK_FOR_MASQUERADE)]));
                } else {
                    let cidrs: Vec<ipnet::IpNet> = opts.cluster_cidrs.iter().filter(|n| IpFamily::of(&n.addr()) == family).copied().collect();
                    if !cidrs.is_empty() {
                        let [d, p] = m;
                        rules.push(Rule::new([d, p, Expr::SaddrNotIn(family, cidrs), jump(MARK_FOR_MASQUERADE)]));
                    }
                }
            }
        }
        let n = list.len() as u32;
        if let Some(timeout) = sp.affinity_timeout {
            let mut targets = Vec::new();
            for ep in list {
                let suffix = endpoint_suffix(ep);
                let ep_chain = format!("ep-{base}__{suffix}");
                let set = format!("aff-{timeout}-{base}__{suffix}");
                rules.push(Rule::new([Expr::SaddrInSet(family, set.clone()), goto(&ep_chain)]));
                if let std::collections::btree_map::Entry::Vacant(slot) = ep_chain_names.entry((ep.ip, ep.port)) {
                    slot.insert(ep_chain.clone());
                    frag.sets.insert(set.clone(), SetType::Affinity(family, timeout));
                    frag.chains.insert(
                        ep_chain.clone(),
                        vec![
                            Rule::new([Expr::Saddr(ep.ip), jump(MARK_FOR_MASQUERADE)]),
                            Rule::new([Expr::UpdateSaddr(family, set)]),
                            Rule::new([Expr::L4Proto(proto), Expr::DnatTo(ep.ip, ep.port)]),
                        ],
                    );
                }
                targets.push(ep_chain);
            }
            if n == 1 {
                rules.push(Rule::new([goto(&targets[0])]));
            } else {
                let r = slot_range(chain, n, prev, slots)?;
                frag.slots.insert(chain.clone(), r);
                let map = SetName::EndpointChains(r.shard);
                rules.push(Rule::new([Expr::NumgenVmap { modulus: n, offset: r.base, map }]));
                for (i, t) in targets.iter().enumerate() {
                    frag.elements.push(Element { set: map, key: Key::Slot(r.base + i as u32), value: goto_value(t) });
                }
            }
        } else {
            // Hairpin (a pod reaching itself through a VIP) can only start on the pod's own
            // node, so only local endpoints need an entry.
            for ep in list.iter().filter(|e| e.is_local) {
                frag.elements.push(Element { set: SetName::Named(HAIRPIN), key: Key::AddrPair(ep.ip, ep.ip), value: None });
            }
            if n == 1 {
                rules.push(Rule::new([Expr::L4Proto(proto), Expr::DnatTo(list[0].ip, list[0].port)]));
            } else {
                let r = slot_range(chain, n, prev, slots)?;
                frag.slots.insert(chain.clone(), r);
                let map = SetName::EndpointDnat(proto, r.shard);
                rules.push(Rule::new([Expr::L4Proto(proto), Expr::DnatNumgenMap { modulus: n, offset: r.base, map }]));
                for (i, ep) in list.iter().enumerate() {
                    frag.elements.push(Element { set: map, key: Key::Slot(r.base + i as u32), value: Some(Value::AddrPort(ep.ip, ep.port)) });
                }
            }
        }
        frag.chains.insert(chain.clone(), rules);
    }
    frag.elements.dedup();

    // ClusterIPs.
    let internal = if sp.internal_policy_local { has_local.then_some(&local_chain) } else { has_cluster.then_some(&cluster_chain) };
    for cip in &cluster_ips {
        let key = Key::AddrProtoPort(**cip, proto, sp.port);
        match internal {
            Some(chain) => frag.elements.push(Element { set: SetName::Named(SERVICE_IPS), key, value: goto_value(chain) }),
            None => frag.elements.push(Element {
                set: SetName::Named(NO_ENDPOINT_SERVICES),
                key,
                value: Some(Value::Verdict(no_endpoint_verdict.clone())),
            }),
        }
    }

    // External traffic: externalIPs, LB IPs, NodePort. As kube-proxy: the ext chain exists
    // whenever the port has endpoints, even with eTP=Local and none on this node — its
    // short-circuit sends this node's own connections to the cluster's endpoints (kube-proxy's
    // "short-circuit local traffic"); anything else falls through it undNATed and meets the
    // no-endpoint drop in filter-input.
    if sp.externally_accessible() {
        let external_target = if sp.external_policy_local { has_local.then_some(&local_chain) } else { has_cluster.then_some(&cluster_chain) };
        let short_circuit = sp.external_policy_local && has_cluster;
        let uses_ext_chain = external_target.is_some() || short_circuit;
        if uses_ext_chain {
            let mut rules = Vec::new();
            if short_circuit {
                rules.push(Rule::new([Expr::FibSaddrLocal, jump(MARK_FOR_MASQUERADE)]));
                rules.push(Rule::new([Expr::FibSaddrLocal, goto(&cluster_chain)]));
            } else if !sp.external_policy_local {
                rules.push(Rule::new([jump(MARK_FOR_MASQUERADE)]));
            }
            if let Some(target) = external_target {
                rules.push(Rule::new([goto(target)]));
            }
            frag.chains.insert(ext_chain.clone(), rules);
        }
        let no_endpoint = || Some(Value::Verdict(no_endpoint_verdict.clone()));
        for vip in &external_vips {
            let key = Key::AddrProtoPort(**vip, proto, sp.port);
            if uses_ext_chain {
                frag.elements.push(Element { set: SetName::Named(SERVICE_IPS), key: key.clone(), value: goto_value(&ext_chain) });
            }
            if external_target.is_none() {
                frag.elements.push(Element { set: SetName::Named(NO_ENDPOINT_SERVICES), key, value: no_endpoint() });
            }
        }
        if let Some(np) = sp.node_port {
            let key = Key::ProtoPort(proto, np);
            if uses_ext_chain {
                frag.elements.push(Element { set: SetName::Named(SERVICE_NODEPORTS), key: key.clone(), value: goto_value(&ext_chain) });
            }
            if external_target.is_none() {
                frag.elements.push(Element { set: SetName::Named(NO_ENDPOINT_NODEPORTS), key, value: no_endpoint() });
            }
        }
        // loadBalancerSourceRanges apply to LB IPs only (not NodePorts, as in kube-proxy).
        if !sp.load_balancer_source_ranges.is_empty() {
            let lb_ips: Vec<&IpAddr> = sp.load_balancer_ips.iter().filter(in_family).collect();
            if !lb_ips.is_empty() {
                let ranges: Vec<ipnet::IpNet> =
                    sp.load_balancer_source_ranges.iter().filter(|n| IpFamily::of(&n.addr()) == family).copied().collect();
                let drop = Expr::Verdict(Verdict::Drop);
                let rule = if ranges.is_empty() { Rule::new([drop]) } else { Rule::new([Expr::SaddrNotIn(family, ranges), drop]) };
                frag.chains.insert(fw_chain.clone(), vec![rule]);
                for lb in lb_ips {
                    frag.elements.push(Element {
                        set: SetName::Named(FIREWALL_IPS),
                        key: Key::AddrProtoPort(*lb, proto, sp.port),
                        value: goto_value(&fw_chain),
                    });
                }
            }
        }
    }
    Ok(frag)
}

fn slot_range(chain: &str, n: u32, prev: Option<&Fragment>, slots: &mut SlotAllocator) -> Result<SlotRange, SlotsExhausted> {
    if let Some(r) = prev.and_then(|p| p.slots.get(chain)) {
        if r.capacity >= n {
            return Ok(*r);
        }
    }
    slots.allocate(n)
}

/// Render a Fragment as the nft commands that create it (for tests and debugging).
pub fn fragment_text(family: IpFamily, frag: &Fragment) -> String {
    use std::fmt::Write as _;
    let t = TableRef(family);
    let mut s = String::new();
    for (name, ty) in &frag.sets {
        let _ = writeln!(s, "add set {t} {name} {{ {ty} }}");
    }
    for name in frag.chains.keys() {
        let _ = writeln!(s, "add chain {t} {name}");
    }
    for (name, rules) in &frag.chains {
        for r in rules {
            let _ = writeln!(s, "add rule {t} {name} {r}");
        }
    }
    for e in &frag.elements {
        match &e.value {
            Some(v) => {
                let _ = writeln!(s, "add element {t} {} {{ {} : {v} }}", e.set, e.key);
            }
            None => {
                let _ = writeln!(s, "add element {t} {} {{ {} }}", e.set, e.key);
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::service::ServicePort;
    use crate::model::topology::Categorized;
    use crate::model::Protocol;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn port() -> ServicePort {
        ServicePort::cluster_ip("ns", "web", "http", Protocol::Tcp, ip("198.19.0.10"), 80)
    }

    fn desired(sp: ServicePort, cluster: Vec<Endpoint>, local: Vec<Endpoint>, has_any: bool) -> DesiredPort {
        DesiredPort { port: sp, v4: Categorized { cluster, local, has_any }, v6: Categorized::default() }
    }

    fn eps(n: u8) -> Vec<Endpoint> {
        (1..=n).map(|i| Endpoint::ready(ip(&format!("198.18.2.{i}")), 8080)).collect()
    }

    /// A chain's rules as nft text.
    fn rules(f: &Fragment, chain: &str) -> Vec<String> {
        f.chains.get(chain).expect("chain").iter().map(Rule::to_string).collect()
    }

    /// The elements as (set, key, value) in nft text.
    fn elements(f: &Fragment) -> Vec<(SetName, String, Option<String>)> {
        f.elements.iter().map(|e| (e.set, e.key.to_string(), e.value.as_ref().map(Value::to_string))).collect()
    }

    fn el(set: SetName, key: &str, value: Option<&str>) -> (SetName, String, Option<String>) {
        (set, key.to_string(), value.map(str::to_string))
    }

    fn render(d: &DesiredPort) -> Fragment {
        render_port(d, IpFamily::V4, &RenderOptions::default(), None, &mut SlotAllocator::default()).expect("render")
    }

    #[test]
    fn the_longest_names_kubernetes_allows_make_chain_names_nftables_takes() {
        // Namespace, Service and port name each a 63-letter DNS label, SCTP, an IPv6
        // endpoint with a 5-digit port, session affinity: every chain name stays under
        // nftables' 256 bytes (NFT_CHAIN_MAXNAMELEN, with its NUL).
        let (l63, m63, n63) = ("a".repeat(63), "b".repeat(63), "c".repeat(63));
        let mut sp = ServicePort::cluster_ip(&l63, &m63, &n63, Protocol::Sctp, ip("fd00::10"), 65535);
        sp.affinity_timeout = Some(10800);
        let ep = Endpoint::ready(ip("fd00:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), 65535);
        let d = DesiredPort { port: sp, v4: Categorized::default(), v6: Categorized { cluster: vec![ep], local: vec![], has_any: true } };
        let f = render_port(&d, IpFamily::V6, &RenderOptions::default(), None, &mut SlotAllocator::default()).expect("render");
        assert!(f.chains.keys().any(|c| c.starts_with("ep-")), "an endpoint chain: {:?}", f.chains.keys().collect::<Vec<_>>());
        for chain in f.chains.keys() {
            assert!(chain.len() < 256, "{} bytes: {chain}", chain.len());
        }
    }

    #[test]
    fn cluster_ip_with_endpoints_uses_shared_dnat_map() {
        let mut endpoints = eps(3);
        endpoints[1].is_local = true;
        let f = render(&desired(port(), endpoints, vec![], true));
        assert_eq!(rules(&f, "svc-ns/web/tcp/http"), vec!["meta l4proto tcp dnat to numgen random mod 3 offset 0 map @endpoint-dnat-tcp-0".to_string()]);
        let all = elements(&f);
        let dnat: Vec<_> =
            all.iter().filter(|e| e.0 == SetName::EndpointDnat(Protocol::Tcp, 0)).map(|e| (e.1.as_str(), e.2.as_deref())).collect();
        assert_eq!(dnat, vec![("0", Some("198.18.2.1 . 8080")), ("1", Some("198.18.2.2 . 8080")), ("2", Some("198.18.2.3 . 8080"))]);
        assert!(all.contains(&el(SetName::Named(SERVICE_IPS), "198.19.0.10 . tcp . 80", Some("goto svc-ns/web/tcp/http"))));
        let hairpin: Vec<&str> = all.iter().filter(|e| e.0 == SetName::Named(HAIRPIN)).map(|e| e.1.as_str()).collect();
        assert_eq!(hairpin, vec!["198.18.2.2 . 198.18.2.2"], "hairpin entries for local endpoints only");
        assert_eq!(f.chains.len(), 1, "no per-endpoint chains without affinity");
    }

    #[test]
    fn single_endpoint_needs_no_map() {
        let f = render(&desired(port(), eps(1), vec![], true));
        assert_eq!(rules(&f, "svc-ns/web/tcp/http"), vec!["meta l4proto tcp dnat to 198.18.2.1:8080".to_string()]);
        assert!(f.slots.is_empty());
    }

    #[test]
    fn no_endpoints_rejects_and_local_without_local_endpoints_drops() {
        let f = render(&desired(port(), vec![], vec![], false));
        assert!(f.chains.is_empty());
        assert_eq!(elements(&f), vec![el(SetName::Named(NO_ENDPOINT_SERVICES), "198.19.0.10 . tcp . 80", Some("goto reject-chain"))]);
        let mut sp = port();
        sp.internal_policy_local = true;
        let f = render(&desired(sp, vec![], vec![], true));
        assert_eq!(elements(&f)[0].2.as_deref(), Some("drop"));
    }

    #[test]
    fn affinity_uses_endpoint_chains_and_dynamic_sets() {
        let mut sp = port();
        sp.affinity_timeout = Some(30);
        let f = render(&desired(sp, eps(2), vec![], true));
        let svc = rules(&f, "svc-ns/web/tcp/http");
        assert_eq!(svc[0], "ip saddr @aff-30-ns/web/tcp/http__198.18.2.1/8080 goto ep-ns/web/tcp/http__198.18.2.1/8080");
        assert_eq!(svc[2], "numgen random mod 2 offset 0 vmap @endpoint-chains-0");
        let ep = rules(&f, "ep-ns/web/tcp/http__198.18.2.2/8080");
        assert_eq!(ep[1], "update @aff-30-ns/web/tcp/http__198.18.2.2/8080 { ip saddr }");
        assert_eq!(ep[2], "meta l4proto tcp dnat to 198.18.2.2:8080");
        assert_eq!(f.sets.len(), 2);
        assert!(f.sets.values().map(SetType::to_string).all(|b| b.contains("timeout 30s") && b.contains("dynamic")));
    }

    #[test]
    fn node_port_and_external_ips_mark_for_masquerade() {
        let mut sp = port();
        sp.node_port = Some(30080);
        sp.external_ips = vec![ip("198.18.9.9"), ip("fd00::9")];
        let f = render(&desired(sp, eps(2), vec![], true));
        assert_eq!(rules(&f, "ext-ns/web/tcp/http"), vec!["jump mark-for-masquerade".to_string(), "goto svc-ns/web/tcp/http".to_string()]);
        let all = elements(&f);
        assert!(all.contains(&el(SetName::Named(SERVICE_NODEPORTS), "tcp . 30080", Some("goto ext-ns/web/tcp/http"))));
        assert!(all.contains(&el(SetName::Named(SERVICE_IPS), "198.18.9.9 . tcp . 80", Some("goto ext-ns/web/tcp/http"))));
        assert!(!all.iter().any(|e| e.1.contains("fd00")), "other-family addresses are not in the ip table");
    }

    #[test]
    fn external_local_policy() {
        let mut sp = port();
        sp.node_port = Some(30080);
        sp.external_policy_local = true;
        let mut local = eps(1);
        local[0].is_local = true;
        let f = render(&desired(sp.clone(), eps(2), local, true));
        assert_eq!(rules(&f, "ext-ns/web/tcp/http").last().map(String::as_str), Some("goto local-ns/web/tcp/http"));
        assert!(f.chains.contains_key("local-ns/web/tcp/http"));
        // No local endpoint: the NodePort drops (endpoints exist elsewhere), the ClusterIP still works.
        let f = render(&desired(sp, eps(2), vec![], true));
        let all = elements(&f);
        assert!(all.contains(&el(SetName::Named(NO_ENDPOINT_NODEPORTS), "tcp . 30080", Some("drop"))));
        assert!(all.iter().any(|e| e.0 == SetName::Named(SERVICE_IPS) && e.1.starts_with("198.19.0.10")));
    }

    /// Kubernetes' e2e "should implement NodePort and HealthCheckNodePort correctly when
    /// ExternalTrafficPolicy changes": a host-network client on a node with no endpoint of an
    /// eTP=Local Service connects to its own node's NodePort and must be answered (kube-proxy's
    /// "short-circuit local traffic": masquerade, then the cluster's endpoints); a client
    /// elsewhere is still dropped there (no-endpoint-nodeports, in filter-input, after nat).
    #[test]
    fn external_local_without_local_endpoints_short_circuits_this_nodes_own_traffic() {
        let mut sp = port();
        sp.node_port = Some(30080);
        sp.external_ips = vec![ip("198.18.9.9")];
        sp.external_policy_local = true;
        let f = render(&desired(sp, eps(2), vec![], true));
        assert_eq!(
            rules(&f, "ext-ns/web/tcp/http"),
            vec!["fib saddr type local jump mark-for-masquerade".to_string(), "fib saddr type local goto svc-ns/web/tcp/http".to_string()],
            "only the short-circuit: no goto a local chain there is none of"
        );
        assert!(!f.chains.contains_key("local-ns/web/tcp/http"));
        let all = elements(&f);
        assert!(all.contains(&el(SetName::Named(SERVICE_NODEPORTS), "tcp . 30080", Some("goto ext-ns/web/tcp/http"))));
        assert!(all.contains(&el(SetName::Named(NO_ENDPOINT_NODEPORTS), "tcp . 30080", Some("drop"))));
        assert!(all.contains(&el(SetName::Named(SERVICE_IPS), "198.18.9.9 . tcp . 80", Some("goto ext-ns/web/tcp/http"))));
        assert!(all.contains(&el(SetName::Named(NO_ENDPOINT_SERVICES), "198.18.9.9 . tcp . 80", Some("drop"))));
        // No endpoint anywhere: no ext chain, the NodePort rejects.
        let mut sp = port();
        sp.node_port = Some(30080);
        sp.external_policy_local = true;
        let f = render(&desired(sp, vec![], vec![], false));
        assert!(f.chains.is_empty());
        assert!(elements(&f).contains(&el(SetName::Named(NO_ENDPOINT_NODEPORTS), "tcp . 30080", Some("goto reject-chain"))));
    }

    #[test]
    fn load_balancer_source_ranges_make_a_firewall_chain() {
        let mut sp = port();
        sp.load_balancer_ips = vec![ip("198.18.8.8")];
        sp.load_balancer_source_ranges = vec!["198.18.5.0/24".parse().expect("net")];
        let f = render(&desired(sp, eps(1), vec![], true));
        assert_eq!(rules(&f, "fw-ns/web/tcp/http"), vec!["ip saddr != { 198.18.5.0/24 } drop".to_string()]);
        assert!(elements(&f).contains(&el(SetName::Named(FIREWALL_IPS), "198.18.8.8 . tcp . 80", Some("goto fw-ns/web/tcp/http"))));
    }

    #[test]
    fn cluster_cidr_masquerades_off_cluster_sources() {
        let opts = RenderOptions { masquerade_all: false, cluster_cidrs: vec!["198.18.2.0/24".parse().expect("net")] };
        let f = render_port(&desired(port(), eps(1), vec![], true), IpFamily::V4, &opts, None, &mut SlotAllocator::default()).expect("r");
        assert_eq!(rules(&f, "svc-ns/web/tcp/http")[0], "ip daddr 198.19.0.10 tcp dport 80 ip saddr != { 198.18.2.0/24 } jump mark-for-masquerade");
    }

    #[test]
    fn slot_ranges_are_reused_when_big_enough() {
        let mut slots = SlotAllocator::default();
        let opts = RenderOptions::default();
        let f1 = render_port(&desired(port(), eps(3), vec![], true), IpFamily::V4, &opts, None, &mut slots).expect("r");
        let f2 = render_port(&desired(port(), eps(4), vec![], true), IpFamily::V4, &opts, Some(&f1), &mut slots).expect("r");
        assert_eq!(f1.slots, f2.slots);
        let f3 = render_port(&desired(port(), eps(5), vec![], true), IpFamily::V4, &opts, Some(&f2), &mut slots).expect("r");
        assert_ne!(f3.slots, f2.slots);
    }

    #[test]
    fn ipv6_targets_are_bracketed() {
        let sp = ServicePort::cluster_ip("ns", "web", "", Protocol::Udp, ip("fd00:10:96::a"), 53);
        let d = DesiredPort {
            port: sp,
            v4: Categorized::default(),
            v6: Categorized { cluster: vec![Endpoint::ready(ip("fd00:2::1"), 5353)], local: vec![], has_any: true },
        };
        let f = render_port(&d, IpFamily::V6, &RenderOptions::default(), None, &mut SlotAllocator::default()).expect("r");
        assert_eq!(rules(&f, "svc-ns/web/udp/53"), vec!["meta l4proto udp dnat to [fd00:2::1]:5353".to_string()]);
        let v4 = render_port(&d, IpFamily::V4, &RenderOptions::default(), None, &mut SlotAllocator::default()).expect("r");
        assert!(v4.is_empty());
    }
}
