//! Prometheus metrics, named like kube-proxy's (`kubeproxy_sync_proxy_rules_…`) under the
//! prefix `clusterip_agent_`; besides them `clusterip_agent_build_info{version,commit}` (always
//! 1), the convention's unprefixed `process_*` metrics ([`clusterip_component_base::metrics`]), and
//! kube-proxy's own names with kube-proxy's semantics ([`kube_proxy`], `kubeproxy_…`) and
//! client-go's ([`rest_client`], `rest_client_…`), for what keys on kube-proxy.

#![forbid(unsafe_code)]

pub mod kube_proxy;
pub mod rest_client;

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

pub use kube_proxy::{Dataplane, KubeProxyMetrics};
pub use rest_client::RestClientMetrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: String,
}

/// The version of this build (Cargo's) and the commit it was built from (build.rs:
/// `CLUSTERIP_COMMIT`, else `git rev-parse --short HEAD`, else "unknown").
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const COMMIT: &str = env!("CLUSTERIP_BUILD_COMMIT");

/// All metrics of the agent.
pub struct Metrics {
    registry: Registry,
    /// The unprefixed `process_*` and `rest_client_*` metrics.
    process: Registry,
    /// kube-proxy's names (`kubeproxy_…`).
    kube_proxy_registry: Registry,
    pub kube_proxy: KubeProxyMetrics,
    pub rest_client: RestClientMetrics,
    pub sync_duration: Histogram,
    pub sync_full_duration: Histogram,
    pub sync_partial_duration: Histogram,
    pub network_programming_duration: Histogram,
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    pub last_queued_timestamp: Gauge<f64, AtomicU64>,
    pub sync_failures: Counter,
    pub drift_detected: Counter,
    pub conntrack_failures: Counter,
    pub conntrack_deleted: Counter,
    pub conntrack_flush_duration: Histogram,
    pub services_over_address_limit: Gauge,
    pub external_ips_ignored: Gauge,
    pub rules: Family<KindLabel, Gauge>,
    pub service_ports: Gauge,
    pub healthz: Family<CodeLabel, Counter>,
    pub livez: Family<CodeLabel, Counter>,
}

fn programming_buckets() -> Vec<f64> {
    let mut b = vec![0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((60..=115).step_by(5).map(f64::from));
    b.extend((120..=300).step_by(30).map(f64::from));
    b
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The metrics of an nftables agent.
    pub fn new() -> Self {
        Self::for_dataplane(Dataplane::Nftables)
    }

    /// The metrics of an agent programming `dataplane` (which of kube-proxy's failure
    /// counters it has).
    pub fn for_dataplane(dataplane: Dataplane) -> Self {
        let mut registry = Registry::with_prefix("clusterip_agent");
        let sync_buckets = || exponential_buckets(0.001, 2.0, 15);
        let m = Metrics {
            sync_duration: Histogram::new(sync_buckets()),
            sync_full_duration: Histogram::new(sync_buckets()),
            sync_partial_duration: Histogram::new(sync_buckets()),
            network_programming_duration: Histogram::new(programming_buckets()),
            last_sync_timestamp: Gauge::default(),
            last_queued_timestamp: Gauge::default(),
            sync_failures: Counter::default(),
            drift_detected: Counter::default(),
            conntrack_failures: Counter::default(),
            conntrack_deleted: Counter::default(),
            conntrack_flush_duration: Histogram::new(sync_buckets()),
            services_over_address_limit: Gauge::default(),
            external_ips_ignored: Gauge::default(),
            rules: Family::default(),
            service_ports: Gauge::default(),
            healthz: Family::default(),
            livez: Family::default(),
            registry: Registry::default(),
            process: Registry::default(),
            kube_proxy_registry: Registry::default(),
            kube_proxy: KubeProxyMetrics::new(dataplane),
            rest_client: RestClientMetrics::default(),
        };
        registry.register("sync_proxy_rules_duration_seconds", "Duration of a sync (full or partial)", m.sync_duration.clone());
        registry.register("sync_full_proxy_rules_duration_seconds", "Duration of a full sync", m.sync_full_duration.clone());
        registry.register("sync_partial_proxy_rules_duration_seconds", "Duration of a partial sync", m.sync_partial_duration.clone());
        registry.register(
            "network_programming_duration_seconds",
            "From an EndpointSlice's last-change-trigger-time to its rules being programmed",
            m.network_programming_duration.clone(),
        );
        registry.register("sync_proxy_rules_last_timestamp_seconds", "Unix time of the last successful sync", m.last_sync_timestamp.clone());
        registry.register(
            "sync_proxy_rules_last_queued_timestamp_seconds",
            "Unix time a change was last queued for sync",
            m.last_queued_timestamp.clone(),
        );
        registry.register("sync_proxy_rules_failures", "Failed syncs", m.sync_failures.clone());
        registry.register("sync_proxy_rules_drift_detected", "Full resyncs that found rules changed behind the agent's back", m.drift_detected.clone());
        registry.register(
            "conntrack_flush_failures",
            "Conntrack flush rounds that failed, and flushes dropped because the flush queue was full",
            m.conntrack_failures.clone(),
        );
        registry.register("conntrack_entries_deleted", "UDP conntrack entries deleted by flushes", m.conntrack_deleted.clone());
        registry.register(
            "conntrack_flush_duration_seconds",
            "Duration of a conntrack flush round (one dump per family, the deletes), off the sync loop",
            m.conntrack_flush_duration.clone(),
        );
        registry.register(
            "services_over_address_limit",
            "Services whose ports x addresses exceed --max-service-addresses (programmed with their ClusterIPs only, or not at all)",
            m.services_over_address_limit.clone(),
        );
        registry.register(
            "external_ips_ignored",
            "externalIPs of Services outside --external-ip-cidrs (not programmed)",
            m.external_ips_ignored.clone(),
        );
        registry.register("sync_proxy_rules_programmed", "Chains, rules and shared map/set elements programmed", m.rules.clone());
        registry.register("service_ports", "Service ports known", m.service_ports.clone());
        registry.register("proxy_healthz", "/healthz answers by HTTP code", m.healthz.clone());
        registry.register("proxy_livez", "/livez answers by HTTP code", m.livez.clone());
        clusterip_component_base::metrics::register_build_info(&mut registry, "clusterip-agent", VERSION, COMMIT);
        let mut process = Registry::default();
        clusterip_component_base::metrics::register(&mut process);
        m.rest_client.register(&mut process);
        let mut kube_proxy_registry = Registry::with_prefix("kubeproxy");
        m.kube_proxy.register(&mut kube_proxy_registry);
        Metrics { registry, process, kube_proxy_registry, ..m }
    }

    /// The conntrack flusher's share.
    pub fn conntrack(&self) -> crate::conntrack::flusher::FlushMetrics {
        crate::conntrack::flusher::FlushMetrics {
            failures: self.conntrack_failures.clone(),
            deleted: self.conntrack_deleted.clone(),
            duration: self.conntrack_flush_duration.clone(),
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let mut s = String::new();
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut s, &self.registry);
        let _ = encode_registry(&mut s, &self.kube_proxy_registry);
        let _ = encode_registry(&mut s, &self.process);
        let _ = encode_eof(&mut s);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_exposed_with_prefix() {
        let m = Metrics::new();
        m.sync_failures.inc();
        m.sync_full_duration.observe(0.02);
        m.rules.get_or_create(&KindLabel { kind: "chains".into() }).set(7);
        let text = m.encode();
        assert!(text.contains("clusterip_agent_sync_proxy_rules_failures_total 1"), "{text}");
        assert!(text.contains("clusterip_agent_sync_full_proxy_rules_duration_seconds_count 1"), "{text}");
        assert!(text.contains("clusterip_agent_sync_proxy_rules_programmed{kind=\"chains\"} 7"), "{text}");
        let build_info = format!("\nclusterip_agent_build_info{{version=\"{VERSION}\",commit=\"{COMMIT}\"}} 1\n");
        assert!(text.contains(&build_info), "{text}");
        for name in ["process_resident_memory_bytes ", "process_cpu_seconds_total ", "process_open_fds ", "process_start_time_seconds "] {
            assert!(text.contains(&format!("\n{name}")), "{name}: {text}");
        }
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
