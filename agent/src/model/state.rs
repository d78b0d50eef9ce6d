//! The agent's picture of the cluster: the Services and EndpointSlices seen so far, and
//! which Services changed since the last sync (kube-proxy's change trackers, folded).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::endpointslice::SliceInfo;
use super::service::{apply_limits, service_ports, Limited, ServiceLimits, ServicePort, Skip};
use super::topology::{categorize_endpoints, Categorized};
use super::{Endpoint, IpFamily, NamespacedName};

/// Who this node is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `topology.kubernetes.io/zone` of the Node.
    pub zone: Option<String>,
}

/// A Service port with its endpoints categorised for this node, per IP family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredPort {
    pub port: ServicePort,
    pub v4: Categorized,
    pub v6: Categorized,
}

impl DesiredPort {
    pub fn endpoints(&self, family: IpFamily) -> &Categorized {
        match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        }
    }

    /// (internal, external): whether this port's traffic under that Local policy is dropped
    /// in `family` because the Service has endpoints, none of them on this node (kube-proxy's
    /// `serviceNoLocalEndpointsTotal{Internal,External}`; a port without any endpoint is
    /// rejected, and counted in neither).
    pub fn without_local_endpoints(&self, family: IpFamily) -> (bool, bool) {
        let e = self.endpoints(family);
        if !self.port.has_family(family) || !e.has_any || !e.local.is_empty() {
            return (false, false);
        }
        (self.port.internal_policy_local, self.port.external_policy_local)
    }
}

/// What changed since the last sync.
#[derive(Debug, Default)]
pub struct Changes {
    pub services: HashSet<NamespacedName>,
    /// Re-render everything (node labels changed, first sync, after a failure).
    pub full: bool,
    /// The earliest `last-change-trigger-time` of the slices changed, per Service and IP
    /// family (the slice's address type), for the network programming latency. One per
    /// Service and family, not one per slice change: while syncs keep failing the changes
    /// are put back and new ones keep coming, and this must not grow with them (the oldest
    /// unprogrammed change is the one whose latency counts).
    pub trigger_times: HashMap<(NamespacedName, IpFamily), SystemTime>,
    /// Services whose Service object changed (kube-proxy's pending Service changes).
    pub service_objects: HashSet<NamespacedName>,
    /// EndpointSlice additions, updates and deletions that changed something (kube-proxy's
    /// pending Endpoint changes: a count of changes, not of Services).
    pub endpoint_changes: usize,
}

/// How many changes wait for a sync (kube-proxy's `…_changes_pending` gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PendingChanges {
    /// Services whose Service object changed.
    pub services: usize,
    /// EndpointSlice changes.
    pub endpoint_changes: usize,
}

/// Services and EndpointSlices as last seen, with pending changes.
#[derive(Debug)]
pub struct ProxyState {
    node: NodeInfo,
    proxy_name: Option<String>,
    services: HashMap<NamespacedName, Vec<ServicePort>>,
    /// Slices per Service, by slice name.
    slices: HashMap<NamespacedName, BTreeMap<String, SliceInfo>>,
    /// Which Service each slice (namespace, slice name) was filed under.
    slice_owner: HashMap<NamespacedName, NamespacedName>,
    changes: Changes,
    started: SystemTime,
    limits: ServiceLimits,
    /// Services that [`ServiceLimits`] cut (for metrics and to log each change once).
    limited: HashMap<NamespacedName, Limited>,
}

impl ProxyState {
    pub fn new(node: NodeInfo, proxy_name: Option<String>) -> Self {
        ProxyState {
            node,
            proxy_name,
            services: HashMap::new(),
            slices: HashMap::new(),
            slice_owner: HashMap::new(),
            changes: Changes { full: true, ..Default::default() },
            started: SystemTime::now(),
            limits: ServiceLimits::default(),
            limited: HashMap::new(),
        }
    }

    /// Bound what one Service may cost (`--max-service-addresses`, `--external-ip-cidrs`).
    pub fn with_limits(mut self, limits: ServiceLimits) -> Self {
        self.limits = limits;
        self
    }

    /// (Services over the address limit, externalIPs ignored as outside the allowed CIDRs).
    pub fn limit_counts(&self) -> (usize, usize) {
        let over = self.limited.values().filter(|l| l.over_limit).count();
        (over, self.limited.values().map(|l| l.external_ips_ignored).sum())
    }

    /// Remember (and log, when it changed) what the limits took from a Service.
    fn note_limited(&mut self, nsn: &NamespacedName, l: Limited) {
        let before = self.limited.get(nsn).copied().unwrap_or_default();
        if l != before {
            if l.over_limit {
                tracing::warn!(service = %nsn, limit = self.limits.max_addresses,
                    "ports × addresses over --max-service-addresses: only its ClusterIPs are programmed (no externalIPs, no load-balancer IPs)");
            }
            if l.external_ips_ignored > 0 {
                tracing::warn!(service = %nsn, ignored = l.external_ips_ignored, "externalIPs outside --external-ip-cidrs are not programmed");
            }
        }
        if l == Limited::default() {
            self.limited.remove(nsn);
        } else {
            self.limited.insert(nsn.clone(), l);
        }
    }

    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    /// Whether a sync has something to do.
    pub fn has_changes(&self) -> bool {
        self.changes.full || !self.changes.services.is_empty()
    }

    /// Number of Service ports known (for metrics).
    pub fn service_port_count(&self) -> usize {
        self.services.values().map(Vec::len).sum()
    }

    /// Update the node's zone; a change re-renders everything. Returns whether it changed.
    pub fn set_node_zone(&mut self, zone: Option<String>) -> bool {
        if self.node.zone != zone {
            self.node.zone = zone;
            self.changes.full = true;
            true
        } else {
            false
        }
    }

    /// Add or update a Service. Returns whether anything changed.
    pub fn apply_service(&mut self, svc: &Service) -> bool {
        let nsn = NamespacedName::new(
            svc.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            svc.metadata.name.clone().unwrap_or_default(),
        );
        let ports = service_ports(svc, self.proxy_name.as_deref()).and_then(|mut ports| {
            let l = apply_limits(&mut ports, &self.limits)?;
            Ok((ports, l))
        });
        let ports = match ports {
            Ok((ports, l)) => {
                self.note_limited(&nsn, l);
                Ok(ports)
            }
            Err(e @ Skip::OverAddressLimit { .. }) => {
                if !self.limited.get(&nsn).is_some_and(|l| l.over_limit) {
                    tracing::warn!(service = %nsn, reason = ?e, "ports × ClusterIPs over --max-service-addresses: the Service is not programmed");
                }
                self.limited.insert(nsn.clone(), Limited { over_limit: true, external_ips_ignored: 0 });
                Err(e)
            }
            Err(e) => {
                self.limited.remove(&nsn);
                Err(e)
            }
        };
        match ports {
            Ok(ports) if !ports.is_empty() => {
                if self.services.get(&nsn) == Some(&ports) {
                    return false;
                }
                self.services.insert(nsn.clone(), ports);
                self.changes.service_objects.insert(nsn.clone());
                self.changes.services.insert(nsn);
                true
            }
            _ => self.delete_service(&nsn),
        }
    }

    /// Forget a Service. Returns whether it was known.
    pub fn delete_service(&mut self, nsn: &NamespacedName) -> bool {
        if self.services.remove(nsn).is_some() {
            self.limited.remove(nsn);
            self.changes.service_objects.insert(nsn.clone());
            self.changes.services.insert(nsn.clone());
            true
        } else {
            false
        }
    }

    /// Replace all Services with `list` (after a re-list).
    pub fn replace_services(&mut self, list: &[Service]) {
        let mut seen = HashSet::new();
        for svc in list {
            self.apply_service(svc);
            seen.insert(NamespacedName::new(
                svc.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                svc.metadata.name.clone().unwrap_or_default(),
            ));
        }
        let gone: Vec<NamespacedName> = self.services.keys().filter(|k| !seen.contains(*k)).cloned().collect();
        for nsn in gone {
            self.delete_service(&nsn);
        }
    }

    /// Add or update an EndpointSlice. Returns whether anything changed.
    pub fn apply_slice(&mut self, slice: &EndpointSlice) -> bool {
        let key = NamespacedName::new(
            slice.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            slice.metadata.name.clone().unwrap_or_default(),
        );
        let info = match SliceInfo::from_slice(slice) {
            Ok(info) => info,
            Err(_) => return self.delete_slice(&key),
        };
        let mut changed = false;
        if let Some(old_owner) = self.slice_owner.get(&key).cloned() {
            if old_owner != info.service {
                changed |= self.delete_slice(&key);
            }
        }
        let per_service = self.slices.entry(info.service.clone()).or_default();
        if per_service.get(&key.name) == Some(&info) {
            return changed;
        }
        if let Some(t) = info.trigger_time.as_deref().and_then(|t| humantime::parse_rfc3339_weak(t).ok()) {
            if t >= self.started {
                note_trigger(&mut self.changes.trigger_times, (info.service.clone(), info.family), t);
            }
        }
        self.changes.endpoint_changes += 1;
        self.changes.services.insert(info.service.clone());
        self.slice_owner.insert(key.clone(), info.service.clone());
        per_service.insert(key.name, info);
        true
    }

    /// Forget an EndpointSlice by (namespace, name). Returns whether it was known.
    pub fn delete_slice(&mut self, key: &NamespacedName) -> bool {
        let Some(owner) = self.slice_owner.remove(key) else { return false };
        if let Some(per_service) = self.slices.get_mut(&owner) {
            per_service.remove(&key.name);
            if per_service.is_empty() {
                self.slices.remove(&owner);
            }
        }
        self.changes.endpoint_changes += 1;
        self.changes.services.insert(owner);
        true
    }

    /// Replace all EndpointSlices with `list` (after a re-list).
    pub fn replace_slices(&mut self, list: &[EndpointSlice]) {
        let mut seen = HashSet::new();
        for s in list {
            self.apply_slice(s);
            seen.insert(NamespacedName::new(
                s.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                s.metadata.name.clone().unwrap_or_default(),
            ));
        }
        let gone: Vec<NamespacedName> = self.slice_owner.keys().filter(|k| !seen.contains(*k)).cloned().collect();
        for key in gone {
            self.delete_slice(&key);
        }
    }

    /// Take the pending changes (the next sync works on them).
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// Ask for a full re-render at the next sync (after a failure, or periodically).
    pub fn request_full(&mut self) {
        self.changes.full = true;
    }

    /// Put back changes a failed sync could not apply.
    pub fn restore_changes(&mut self, mut changes: Changes) {
        self.changes.services.extend(changes.services.drain());
        self.changes.full |= changes.full;
        for (key, t) in changes.trigger_times.drain() {
            note_trigger(&mut self.changes.trigger_times, key, t);
        }
        self.changes.service_objects.extend(changes.service_objects.drain());
        self.changes.endpoint_changes += changes.endpoint_changes;
    }

    /// The changes no sync has taken yet.
    pub fn pending_changes(&self) -> PendingChanges {
        PendingChanges { services: self.changes.service_objects.len(), endpoint_changes: self.changes.endpoint_changes }
    }

    /// How much is pending for the next sync: (Services changed, trigger times kept).
    /// Both are bounded by the number of Services, however many changes arrive.
    pub fn pending(&self) -> (usize, usize) {
        (self.changes.services.len(), self.changes.trigger_times.len())
    }

    /// All Services currently known.
    pub fn service_names(&self) -> Vec<NamespacedName> {
        self.services.keys().cloned().collect()
    }

    /// The desired ports of a Service, with endpoints categorised for this node.
    /// Empty when the Service is gone (or not proxied).
    pub fn desired(&self, nsn: &NamespacedName) -> Vec<DesiredPort> {
        let Some(ports) = self.services.get(nsn) else { return vec![] };
        let slices = self.slices.get(nsn);
        ports
            .iter()
            .map(|sp| {
                let mut v4 = Dedup::default();
                let mut v6 = Dedup::default();
                for info in slices.into_iter().flat_map(|m| m.values()) {
                    let target = if info.family == IpFamily::V4 { &mut v4 } else { &mut v6 };
                    for ep in info.endpoints_for(&sp.name.port_name, sp.name.protocol, &self.node.name) {
                        target.push(ep);
                    }
                }
                let (v4, v6) = (v4.list, v6.list);
                let zone = self.node.zone.as_deref();
                DesiredPort {
                    v4: categorize_endpoints(&v4, sp, &self.node.name, zone),
                    v6: categorize_endpoints(&v6, sp, &self.node.name, zone),
                    port: sp.clone(),
                }
            })
            .collect()
    }
}

impl ProxyState {
    /// Services with a health-check node port (externalTrafficPolicy Local): the port and
    /// the number of distinct local ready (not terminating) endpoint addresses.
    pub fn health_check_node_ports(&self) -> HashMap<NamespacedName, (u16, usize)> {
        let mut out = HashMap::new();
        for (nsn, ports) in &self.services {
            let Some(port) = ports.iter().find(|p| p.external_policy_local).and_then(|p| p.health_check_node_port) else { continue };
            let local: HashSet<std::net::IpAddr> = self
                .slices
                .get(nsn)
                .into_iter()
                .flat_map(|m| m.values())
                .flat_map(|s| s.endpoints.iter())
                .filter(|e| e.ready && !e.terminating && e.node_name.as_deref() == Some(self.node.name.as_str()))
                .map(|e| e.ip)
                .collect();
            out.insert(nsn.clone(), (port, local.len()));
        }
        out
    }
}

/// Keep the earliest trigger time of a Service in a family.
fn note_trigger(times: &mut HashMap<(NamespacedName, IpFamily), SystemTime>, key: (NamespacedName, IpFamily), t: SystemTime) {
    let e = times.entry(key).or_insert(t);
    if t < *e {
        *e = t;
    }
}

/// Endpoints unique by ip:port, in the order first seen; a local copy wins (kube-proxy does
/// the same). Indexed: a search of the list per endpoint was quadratic.
#[derive(Default)]
struct Dedup {
    list: Vec<Endpoint>,
    index: HashMap<(std::net::IpAddr, u16), usize>,
}

impl Dedup {
    fn push(&mut self, ep: Endpoint) {
        match self.index.get(&(ep.ip, ep.port)) {
            Some(&i) => {
                if ep.is_local && !self.list[i].is_local {
                    self.list[i] = ep;
                }
            }
            None => {
                self.index.insert((ep.ip, ep.port), self.list.len());
                self.list.push(ep);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn state() -> ProxyState {
        ProxyState::new(NodeInfo { name: "n1".into(), zone: None }, None)
    }

    fn svc() -> Service {
        serde_json::from_value(json!({"metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIPs": ["198.19.0.10", "fd00:10:96::a"], "ports": [{"name": "http", "port": 80}]}}))
        .expect("svc")
    }

    fn slice(name: &str, family: &str, addrs: &[&str]) -> EndpointSlice {
        let eps: Vec<_> = addrs.iter().map(|a| json!({"addresses": [a], "nodeName": "n2"})).collect();
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": "ns", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": family, "ports": [{"name": "http", "port": 8080}], "endpoints": eps}))
        .expect("slice")
    }

    #[test]
    fn changes_are_tracked_and_taken() {
        let mut st = state();
        assert!(st.take_changes().full, "first sync is full");
        assert!(st.apply_service(&svc()));
        assert!(!st.apply_service(&svc()), "same service twice is no change");
        assert!(st.apply_slice(&slice("a", "IPv4", &["198.18.2.1", "198.18.2.2"])));
        assert!(st.apply_slice(&slice("b", "IPv6", &["fd00:2::1"])));
        let ch = st.take_changes();
        assert!(!ch.full);
        assert_eq!(ch.services.len(), 1);
        assert!(!st.has_changes());
        let d = st.desired(&NamespacedName::new("ns", "web"));
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].v4.cluster.len(), 2);
        assert_eq!(d[0].v6.cluster.len(), 1);
        assert_eq!(d[0].v4.cluster[0].port, 8080);
    }

    #[test]
    fn pending_changes_count_service_objects_and_slice_changes_until_taken() {
        let mut st = state();
        st.take_changes();
        assert!(st.apply_service(&svc()));
        assert!(!st.apply_service(&svc()), "no change: not pending");
        assert!(st.apply_slice(&slice("a", "IPv4", &["198.18.2.1"])));
        assert!(st.apply_slice(&slice("a", "IPv4", &["198.18.2.2"])));
        assert!(!st.apply_slice(&slice("a", "IPv4", &["198.18.2.2"])), "no change: not pending");
        assert!(st.delete_slice(&NamespacedName::new("ns", "a")));
        assert_eq!(st.pending_changes(), PendingChanges { services: 1, endpoint_changes: 3 });
        let taken = st.take_changes();
        assert_eq!(st.pending_changes(), PendingChanges::default());
        st.restore_changes(taken);
        assert_eq!(st.pending_changes(), PendingChanges { services: 1, endpoint_changes: 3 }, "put back after a failed sync");
    }

    #[test]
    fn trigger_times_are_kept_per_family_earliest_first() {
        let mut st = state();
        st.apply_service(&svc());
        let at = |s: EndpointSlice, t: SystemTime| {
            let mut s = s;
            s.metadata.annotations = Some([("endpoints.kubernetes.io/last-change-trigger-time".to_string(), humantime::format_rfc3339_millis(t).to_string())].into());
            s
        };
        let t0 = SystemTime::now() + std::time::Duration::from_secs(1);
        let t1 = t0 + std::time::Duration::from_secs(5);
        st.apply_slice(&at(slice("a", "IPv4", &["198.18.2.1"]), t1));
        st.apply_slice(&at(slice("a", "IPv4", &["198.18.2.2"]), t0));
        st.apply_slice(&at(slice("b", "IPv6", &["fd00:2::1"]), t1));
        let ch = st.take_changes();
        let web = NamespacedName::new("ns", "web");
        let v4 = ch.trigger_times.get(&(web.clone(), IpFamily::V4)).copied();
        let v6 = ch.trigger_times.get(&(web, IpFamily::V6)).copied();
        // (Millisecond precision in the annotation.)
        let ms = |t: Option<SystemTime>| t.and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok()).map(|d| d.as_millis());
        assert_eq!(ms(v4), ms(Some(t0)), "the earliest IPv4 change");
        assert_eq!(ms(v6), ms(Some(t1)));
    }

    #[test]
    fn a_local_policy_port_without_local_endpoints_is_counted_in_its_family_only() {
        let mut st = state();
        let local: Service = serde_json::from_value(json!({"metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIPs": ["198.19.0.10", "fd00:10:96::a"], "internalTrafficPolicy": "Local", "ports": [{"name": "http", "port": 80}]}}))
        .expect("svc");
        st.apply_service(&local);
        let web = NamespacedName::new("ns", "web");
        assert_eq!(st.desired(&web)[0].without_local_endpoints(IpFamily::V4), (false, false), "no endpoints at all: rejected, not counted");
        st.apply_slice(&slice("a", "IPv4", &["198.18.2.1"]));
        let d = st.desired(&web);
        assert_eq!(d[0].without_local_endpoints(IpFamily::V4), (true, false), "endpoints on n2 only");
        assert_eq!(d[0].without_local_endpoints(IpFamily::V6), (false, false), "no IPv6 endpoints at all");
        assert_eq!(st.desired(&NamespacedName::new("ns", "gone")), vec![]);
    }

    #[test]
    fn endpoints_from_several_slices_are_deduplicated() {
        let mut st = state();
        st.apply_service(&svc());
        st.apply_slice(&slice("a", "IPv4", &["198.18.2.1"]));
        st.apply_slice(&slice("b", "IPv4", &["198.18.2.1", "198.18.2.3"]));
        let d = st.desired(&NamespacedName::new("ns", "web"));
        assert_eq!(d[0].v4.cluster.len(), 2);
    }

    #[test]
    fn relist_removes_missing_objects() {
        let mut st = state();
        st.apply_service(&svc());
        st.apply_slice(&slice("a", "IPv4", &["198.18.2.1"]));
        st.take_changes();
        st.replace_slices(&[]);
        let ch = st.take_changes();
        assert_eq!(ch.services.len(), 1);
        assert!(st.desired(&NamespacedName::new("ns", "web"))[0].v4.cluster.is_empty());
        st.replace_services(&[]);
        assert!(st.desired(&NamespacedName::new("ns", "web")).is_empty());
        assert!(st.has_changes());
    }

    #[test]
    fn limits_are_applied_counted_and_forgotten_with_the_service() {
        let limits = ServiceLimits { max_addresses: 4, external_ip_cidrs: vec!["198.18.9.0/24".parse().expect("cidr")] };
        let mut st = state().with_limits(limits);
        let big: Service = serde_json::from_value(json!({"metadata": {"name": "big", "namespace": "ns"},
            "spec": {"clusterIPs": ["198.19.0.10"], "externalIPs": ["198.18.9.1", "198.18.9.2", "198.18.9.3", "198.18.9.4", "198.18.7.1"],
                     "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}}))
        .expect("svc");
        assert!(st.apply_service(&big));
        let d = st.desired(&NamespacedName::new("ns", "big"));
        assert!(d[0].port.external_ips.is_empty(), "1 + 4 allowed externalIPs > 4: ClusterIP only");
        assert_eq!(d[0].port.cluster_ips.len(), 1);
        assert_eq!(st.limit_counts(), (1, 1));
        assert!(st.delete_service(&NamespacedName::new("ns", "big")));
        assert_eq!(st.limit_counts(), (0, 0));
    }

    #[test]
    fn zone_change_forces_full_sync() {
        let mut st = state();
        st.take_changes();
        assert!(!st.set_node_zone(None));
        assert!(st.set_node_zone(Some("za".into())));
        assert!(st.take_changes().full);
    }
}
