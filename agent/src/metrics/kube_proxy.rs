//! kube-proxy's own metric names (`kubeproxy_…`, `pkg/proxy/metrics/metrics.go`), served
//! beside the agent's `clusterip_agent_…` ones so that what keys on kube-proxy — the
//! kubernetes-mixin's "Kubernetes / Proxy" dashboard, monitoring agents' kube-proxy
//! integrations — keeps working when the agent replaces it.
//!
//! Same names, types, help texts, buckets and labels as kube-proxy 1.33+ (which labels the
//! sync metrics with `ip_family`, "IPv4" / "IPv6"), and kube-proxy's semantics where they
//! differ from the agent's own metrics:
//! - the sync durations are observed for every sync, failed ones too (kube-proxy times its
//!   `syncProxyRules` in a `defer`); the agent's own only for successful syncs;
//! - kube-proxy runs one proxier per IP family, each with its own sync; one sync of the
//!   agent programs both families' tables in one transaction, so every sync is observed once
//!   per family, with the one duration;
//! - `network_programming_duration_seconds` has kube-proxy's buckets, which start with a
//!   0 bucket (`MergeBuckets` starts from a zero-filled slice), and is observed per family
//!   from that family's EndpointSlices' trigger times.
//!
//! What kube-proxy has and this does not serve, because the agent has nothing truthful to
//! put there: `sync_proxy_rules_nftables_cleanup_failures_total` (stale chains are deleted
//! in the sync's own transaction, so a failure is a sync failure),
//! `sync_proxy_rules_iptables_total` / `_iptables_last`, the nfacct packet counters, and the
//! `conntrack_reconciler_*` family (the agent flushes conntrack its own way:
//! `clusterip_agent_conntrack_*`).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::CodeLabel;
use crate::model::state::DesiredPort;
use crate::model::{IpFamily, NamespacedName};
use crate::proxier::SyncBatch;

/// kube-proxy's `ip_family` label: `string(v1.IPFamily)`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FamilyLabel {
    pub ip_family: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    pub ip_family: &'static str,
    /// "internal" or "external".
    pub traffic_policy: &'static str,
}

pub fn family_label(family: IpFamily) -> FamilyLabel {
    FamilyLabel { ip_family: family_name(family) }
}

fn family_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "IPv4",
        IpFamily::V6 => "IPv6",
    }
}

/// Which of kube-proxy's failure counters the dataplane has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dataplane {
    /// `sync_proxy_rules_nftables_sync_failures_total`.
    Nftables,
    /// `sync_proxy_rules_iptables_restore_failures_total` and
    /// `sync_proxy_rules_iptables_partial_restore_failures_total`.
    Iptables,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// `prometheus.ExponentialBuckets(0.001, 2, 15)`: 1 ms to 16.384 s.
fn sync_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// kube-proxy's network programming buckets: 0, then 0.25 s and 0.5 s, 1–59 s by 1 s,
/// 60–115 s by 5 s, 120–300 s by 30 s (82 bounds with +Inf).
pub fn network_programming_buckets() -> Vec<f64> {
    let mut b = vec![0.0, 0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((60..=115).step_by(5).map(f64::from));
    b.extend((120..=300).step_by(30).map(f64::from));
    b
}

fn programming_histogram() -> Histogram {
    Histogram::new(network_programming_buckets())
}

/// The `kubeproxy_…` metrics.
#[derive(Debug)]
pub struct KubeProxyMetrics {
    pub sync_duration: HistogramFamily<FamilyLabel>,
    pub sync_full_duration: HistogramFamily<FamilyLabel>,
    pub sync_partial_duration: HistogramFamily<FamilyLabel>,
    pub network_programming_duration: HistogramFamily<FamilyLabel>,
    pub last_timestamp: Family<FamilyLabel, Gauge<f64, AtomicU64>>,
    pub last_queued_timestamp: Family<FamilyLabel, Gauge<f64, AtomicU64>>,
    pub endpoint_changes_pending: Gauge,
    pub endpoint_changes_total: Counter,
    pub service_changes_pending: Gauge,
    pub service_changes_total: Counter,
    pub no_local_endpoints: Family<PolicyLabel, Gauge>,
    /// nftables: sync failures; iptables: restore failures.
    pub sync_failures: Family<FamilyLabel, Counter>,
    /// iptables only: failed partial syncs (the retry is a full one).
    pub partial_restore_failures: Family<FamilyLabel, Counter>,
    pub healthz: Family<CodeLabel, Counter>,
    pub livez: Family<CodeLabel, Counter>,
    dataplane: Dataplane,
}

impl KubeProxyMetrics {
    pub fn new(dataplane: Dataplane) -> Self {
        KubeProxyMetrics {
            sync_duration: Family::new_with_constructor(sync_histogram),
            sync_full_duration: Family::new_with_constructor(sync_histogram),
            sync_partial_duration: Family::new_with_constructor(sync_histogram),
            network_programming_duration: Family::new_with_constructor(programming_histogram),
            last_timestamp: Family::default(),
            last_queued_timestamp: Family::default(),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes_total: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes_total: Counter::default(),
            no_local_endpoints: Family::default(),
            sync_failures: Family::default(),
            partial_restore_failures: Family::default(),
            healthz: Family::default(),
            livez: Family::default(),
            dataplane,
        }
    }

    /// Register under `registry` (made with the prefix `kubeproxy`), with kube-proxy's help texts.
    pub fn register(&self, r: &mut Registry) {
        r.register("sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds", self.sync_duration.clone());
        r.register("sync_full_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for full resyncs", self.sync_full_duration.clone());
        r.register(
            "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            self.sync_partial_duration.clone(),
        );
        r.register("network_programming_duration_seconds", "In Cluster Network Programming Latency in seconds", self.network_programming_duration.clone());
        r.register("sync_proxy_rules_last_timestamp_seconds", "The last time proxy rules were successfully synced", self.last_timestamp.clone());
        r.register(
            "sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            self.last_queued_timestamp.clone(),
        );
        r.register("sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes", self.endpoint_changes_pending.clone());
        // (Counters: the text encoder appends `_total`.)
        r.register("sync_proxy_rules_endpoint_changes", "Cumulative proxy rules Endpoint changes", self.endpoint_changes_total.clone());
        r.register("sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes", self.service_changes_pending.clone());
        r.register("sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes", self.service_changes_total.clone());
        // A gauge whose name ends in _total, as kube-proxy's.
        r.register(
            "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            self.no_local_endpoints.clone(),
        );
        match self.dataplane {
            Dataplane::Nftables => {
                r.register("sync_proxy_rules_nftables_sync_failures", "Cumulative proxy nftables sync failures", self.sync_failures.clone())
            }
            Dataplane::Iptables => {
                r.register("sync_proxy_rules_iptables_restore_failures", "Cumulative proxy iptables restore failures", self.sync_failures.clone());
                r.register(
                    "sync_proxy_rules_iptables_partial_restore_failures",
                    "Cumulative proxy iptables partial restore failures",
                    self.partial_restore_failures.clone(),
                );
            }
        }
        r.register("proxy_healthz", "Cumulative proxy healthz HTTP status", self.healthz.clone());
        r.register("proxy_livez", "Cumulative proxy livez HTTP status", self.livez.clone());
    }

    /// A sync ended (either way) after `seconds`: kube-proxy's deferred observations.
    pub fn observe_sync(&self, full: bool, seconds: f64) {
        for family in IpFamily::ALL {
            let l = family_label(family);
            self.sync_duration.get_or_create(&l).observe(seconds);
            let kind = if full { &self.sync_full_duration } else { &self.sync_partial_duration };
            kind.get_or_create(&l).observe(seconds);
        }
    }

    /// A sync succeeded at `now_unix` (seconds since the epoch).
    pub fn sync_succeeded(&self, now_unix: f64) {
        for family in IpFamily::ALL {
            self.last_timestamp.get_or_create(&family_label(family)).set(now_unix);
        }
    }

    /// A sync failed; `full`: whether it was a full one.
    pub fn sync_failed(&self, full: bool) {
        for family in IpFamily::ALL {
            let l = family_label(family);
            self.sync_failures.get_or_create(&l).inc();
            if self.dataplane == Dataplane::Iptables && !full {
                self.partial_restore_failures.get_or_create(&l).inc();
            }
        }
    }

    /// A change was queued for sync at `now_unix`.
    pub fn queued(&self, now_unix: f64) {
        for family in IpFamily::ALL {
            self.last_queued_timestamp.get_or_create(&family_label(family)).set(now_unix);
        }
    }

    /// The changes not yet taken by a sync.
    pub fn set_pending(&self, pending: crate::model::state::PendingChanges) {
        self.service_changes_pending.set(pending.services as i64);
        self.endpoint_changes_pending.set(pending.endpoint_changes as i64);
    }
}

/// Service ports with a Local traffic policy and no local endpoint (but endpoints
/// elsewhere: their traffic is dropped), per family and policy, kept per Service from the
/// batches of successful syncs so that a partial sync need not look at every Service.
/// kube-proxy counts them at every sync, in its loop over all Service ports.
#[derive(Debug, Default)]
pub struct NoLocalEndpoints {
    per_service: HashMap<NamespacedName, [u32; 4]>,
}

/// Index into the per-Service counts: family × (internal, external).
fn slot(family: IpFamily, external: bool) -> usize {
    (if family == IpFamily::V6 { 2 } else { 0 }) + usize::from(external)
}

fn count_ports(ports: &[DesiredPort]) -> [u32; 4] {
    let mut n = [0u32; 4];
    for p in ports {
        for family in IpFamily::ALL {
            let (internal, external) = p.without_local_endpoints(family);
            n[slot(family, false)] += u32::from(internal);
            n[slot(family, true)] += u32::from(external);
        }
    }
    n
}

impl NoLocalEndpoints {
    /// Fold in a batch that was programmed.
    pub fn update(&mut self, batch: &SyncBatch) {
        if batch.full {
            self.per_service.clear();
        }
        for (nsn, ports) in &batch.services {
            let n = count_ports(ports);
            if n == [0; 4] {
                self.per_service.remove(nsn);
            } else {
                self.per_service.insert(nsn.clone(), n);
            }
        }
    }

    /// Set the gauge: every family and policy, zeros included (kube-proxy sets both
    /// policies at every sync).
    pub fn publish(&self, gauge: &Family<PolicyLabel, Gauge>) {
        let mut total = [0i64; 4];
        for n in self.per_service.values() {
            for (t, v) in total.iter_mut().zip(n) {
                *t += i64::from(*v);
            }
        }
        for family in IpFamily::ALL {
            for (external, policy) in [(false, "internal"), (true, "external")] {
                let l = PolicyLabel { ip_family: family_name(family), traffic_policy: policy };
                gauge.get_or_create(&l).set(total[slot(family, external)]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::state::{NodeInfo, ProxyState};

    fn encode(m: &KubeProxyMetrics) -> String {
        let mut r = Registry::with_prefix("kubeproxy");
        m.register(&mut r);
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &r).expect("encode");
        s
    }

    #[test]
    fn names_types_and_buckets_are_kube_proxys() {
        let m = KubeProxyMetrics::new(Dataplane::Nftables);
        m.observe_sync(true, 0.003);
        m.network_programming_duration.get_or_create(&family_label(IpFamily::V4)).observe(0.1);
        m.sync_failed(true);
        m.service_changes_total.inc();
        NoLocalEndpoints::default().publish(&m.no_local_endpoints);
        let t = encode(&m);
        for line in [
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            // (prometheus-client ends every help text with a period; kube-proxy's has none.)
            "# HELP kubeproxy_sync_proxy_rules_duration_seconds SyncProxyRules latency in seconds.",
            "# TYPE kubeproxy_sync_proxy_rules_endpoint_changes counter",
            "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv6\",traffic_policy=\"external\"} 0",
            "kubeproxy_sync_proxy_rules_service_changes_total 1",
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 1",
            // 1 ms × 2^0..14: 3 ms falls in the 4 ms bucket, and 16.384 s is the last bound.
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.002\",ip_family=\"IPv4\"} 0",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\",ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"16.384\",ip_family=\"IPv4\"} 1",
            // kube-proxy's leading 0 bucket, then 0.25 s.
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.0\",ip_family=\"IPv4\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\",ip_family=\"IPv4\"} 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"300.0\",ip_family=\"IPv4\"} 1",
        ] {
            assert!(t.contains(line), "{line}\n{t}");
        }
        assert!(!t.contains("_total_total"), "{t}");
        assert_eq!(network_programming_buckets().len(), 81);
        assert!(!t.contains("sync_partial_proxy_rules_duration_seconds_count"), "no partial sync yet: {t}");
    }

    #[test]
    fn iptables_counts_restore_and_partial_restore_failures() {
        let m = KubeProxyMetrics::new(Dataplane::Iptables);
        m.sync_failed(false);
        m.sync_failed(true);
        let t = encode(&m);
        assert!(t.contains("kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv6\"} 2"), "{t}");
        assert!(t.contains("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{ip_family=\"IPv4\"} 1"), "{t}");
        assert!(!t.contains("nftables"), "{t}");
    }

    #[test]
    fn no_local_endpoints_follow_full_and_partial_batches() {
        let svc = |name: &str, policy: &str| -> k8s_openapi::api::core::v1::Service {
            serde_json::from_value(serde_json::json!({"metadata": {"name": name, "namespace": "ns"},
                "spec": {"clusterIP": "198.19.0.10", "type": "NodePort", "externalTrafficPolicy": policy,
                    "internalTrafficPolicy": policy, "ports": [{"port": 80, "nodePort": 30080}]}}))
            .expect("svc")
        };
        let slice = |name: &str, node: &str| -> k8s_openapi::api::discovery::v1::EndpointSlice {
            serde_json::from_value(serde_json::json!({"metadata": {"name": format!("{name}-1"), "namespace": "ns",
                "labels": {"kubernetes.io/service-name": name}}, "addressType": "IPv4", "ports": [{"port": 8080}],
                "endpoints": [{"addresses": ["198.18.2.1"], "nodeName": node}]}))
            .expect("slice")
        };
        let mut st = ProxyState::new(NodeInfo { name: "n1".into(), zone: None }, None);
        st.apply_service(&svc("a", "Local"));
        st.apply_service(&svc("b", "Local"));
        st.apply_service(&svc("c", "Cluster"));
        for s in ["a", "b", "c"] {
            st.apply_slice(&slice(s, "n2"));
        }
        let batch = |st: &ProxyState, full: bool, names: &[&str]| SyncBatch {
            full,
            services: names.iter().map(|n| (NamespacedName::new("ns", *n), st.desired(&NamespacedName::new("ns", *n)))).collect(),
        };
        let gauge = Family::<PolicyLabel, Gauge>::default();
        let get = |policy: &'static str, family: &'static str| gauge.get_or_create(&PolicyLabel { ip_family: family, traffic_policy: policy }).get();
        let mut n = NoLocalEndpoints::default();
        n.update(&batch(&st, true, &["a", "b", "c"]));
        n.publish(&gauge);
        assert_eq!((get("internal", "IPv4"), get("external", "IPv4")), (2, 2), "a and b: endpoints on n2 only");
        assert_eq!((get("internal", "IPv6"), get("external", "IPv6")), (0, 0), "set, at zero");
        // b gets a local endpoint: a partial batch with b alone.
        st.apply_slice(&slice("b", "n1"));
        n.update(&batch(&st, false, &["b"]));
        n.publish(&gauge);
        assert_eq!(get("internal", "IPv4"), 1);
        // A full batch without a (deleted) replaces everything.
        st.delete_service(&NamespacedName::new("ns", "a"));
        n.update(&batch(&st, true, &["b", "c"]));
        n.publish(&gauge);
        assert_eq!((get("internal", "IPv4"), get("external", "IPv4")), (0, 0));
    }
}
