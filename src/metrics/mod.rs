//! Prometheus metrics of the controller, named after Kubernetes' own under our prefix
//! `clusterip_` (Kubernetes: `kube_apiserver_clusterip_allocator_*`). The allocator's are
//! recorded by [`MeteredStore`], a decorator over any store; serving them over HTTP is the
//! controller command's (`src/cli/monitoring.rs`).
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `clusterip_allocator_allocated_ips` | gauge | cidr |
//! | `clusterip_allocator_available_ips` | gauge | cidr |
//! | `clusterip_allocator_pooled_ips` | gauge | cidr (etcd backend: free addresses held in replicas' address pools) |
//! | `clusterip_allocator_map_bytes` | gauge | cidr (etcd backend: the range's allocation map as stored, bytes; etcd refuses a write past its `--max-request-bytes`, 1.5 MiB by default) |
//! | `clusterip_allocator_band_allocated_ips` | gauge | cidr, band (static, dynamic) |
//! | `clusterip_allocator_band_available_ips` | gauge | cidr, band (static, dynamic) |
//! | `clusterip_allocator_unreadable_records` | gauge | kind (allocation_map, owner, ipaddress): stored records the allocator cannot read and refuses to act on |
//! | `clusterip_allocator_allocation_total` | counter | cidr, scope (static, dynamic) |
//! | `clusterip_allocator_allocation_errors_total` | counter | cidr, scope |
//! | `clusterip_allocator_allocation_duration_seconds` | histogram | cidr |
//! | `clusterip_webhook_admission_duration_seconds` | histogram | operation (mutate, validate, validate_servicecidr), allowed |
//! | `clusterip_webhook_request_duration_seconds` | histogram | operation (mutate, validate), allowed |
//! | `clusterip_webhook_bad_requests_total` | counter | operation |
//! | `clusterip_webhook_refused_connections_total` | counter | reason (client_certificate, tls_handshake, handshake_timeout, source_limit, evicted) |
//! | `clusterip_webhook_released_addresses_total` | counter | reason (apiserver_released: the apiserver recorded the address after our answer and released it again within the in-flight window — the create failed, or the Service was deleted at once; in_flight_limit: never recorded within --in-flight-limit) |
//! | `clusterip_http_refused_connections_total` | counter | server (metrics, health), reason (source_limit, evicted) |
//! | `clusterip_address_block_events_total` | counter | event (ipaddress backend, this replica since start: created, taken_over, deleted_stale, handed_over, given_back, lost — `store::ipaddress::blocks::EVENTS`) |
//! | `clusterip_reconcile_errors_total` | counter | controller |
//! | `clusterip_repair_ip_errors_total` | counter | type (leak, repair, full, outOfRange, duplicate, unknown, invalid) |
//! | `clusterip_repair_reconcile_errors_total` | counter | |
//! | `leader_election_master_status` | gauge | name (the leader Lease): 1 while this replica leads and runs the reconcilers, else 0 — Kubernetes' own name, unprefixed, as client-go reports it |
//! | `clusterip_build_info` | gauge | version, commit: always 1 (the `--version` of the binary) |
//! | `process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_virtual_memory_bytes`, `process_start_time_seconds`, `process_open_fds`, `process_max_fds` | | the convention's own names, unprefixed ([`clusterip_component_base::metrics`]) |
//!
//! Counters with a fixed set of label values (reasons, types, operations, controllers) are
//! reported at 0 from the start, so that `rate()` and `increase()` — and the alerts of
//! `deploy/monitoring/` — see the first error too, not only the second.

use std::time::Duration;

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

mod metered;

pub use metered::MeteredStore;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CidrLabels {
    pub cidr: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScopeLabels {
    pub cidr: String,
    pub scope: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WebhookLabels {
    pub operation: &'static str,
    pub allowed: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerReasonLabels {
    pub server: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RepairLabels {
    pub r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NameLabels {
    pub name: String,
}

/// The version of this build (Cargo's) and the commit it was built from (build.rs:
/// `CLUSTERIP_COMMIT`, else `git rev-parse --short HEAD`, else "unknown").
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const COMMIT: &str = env!("CLUSTERIP_BUILD_COMMIT");

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BandLabels {
    pub cidr: String,
    pub band: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: &'static str,
}

/// The controller's metrics and their registry.
pub struct Metrics {
    registry: Registry,
    /// Metrics under Kubernetes' own names (no prefix): those client-go libraries report.
    kubernetes: Registry,
    pub leader_election_master_status: Family<NameLabels, Gauge>,
    pub allocated_ips: Family<CidrLabels, Gauge>,
    pub available_ips: Family<CidrLabels, Gauge>,
    pub pooled_ips: Family<CidrLabels, Gauge>,
    pub map_bytes: Family<CidrLabels, Gauge>,
    pub band_allocated_ips: Family<BandLabels, Gauge>,
    pub band_available_ips: Family<BandLabels, Gauge>,
    pub unreadable_records: Family<KindLabels, Gauge>,
    pub allocation_total: Family<ScopeLabels, Counter>,
    pub allocation_errors_total: Family<ScopeLabels, Counter>,
    pub allocation_duration: Family<CidrLabels, Histogram>,
    pub webhook_duration: Family<WebhookLabels, Histogram>,
    pub webhook_request_duration: Family<WebhookLabels, Histogram>,
    pub webhook_bad_requests: Family<OperationLabels, Counter>,
    pub webhook_refused_connections: Family<ReasonLabels, Counter>,
    pub http_refused_connections: Family<ServerReasonLabels, Counter>,
    pub webhook_released_addresses: Family<ReasonLabels, Counter>,
    pub reconcile_errors: Family<ControllerLabels, Counter>,
    pub repair_ip_errors: Family<RepairLabels, Counter>,
    pub repair_reconcile_errors: Counter,
    pub address_block_events: Family<EventLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    pub event: &'static str,
}

/// The label values each labelled counter knows in advance (reported at 0 from the start).
pub const REPAIR_ERROR_TYPES: [&str; 7] = ["leak", "repair", "full", "outOfRange", "duplicate", "unknown", "invalid"];
pub const WEBHOOK_REFUSAL_REASONS: [&str; 5] = ["client_certificate", "tls_handshake", "handshake_timeout", "source_limit", "evicted"];
pub const HTTP_REFUSAL_REASONS: [&str; 2] = ["source_limit", "evicted"];
pub const RELEASE_REASONS: [&str; 2] = ["apiserver_released", "in_flight_limit"];
pub const CONTROLLERS: [&str; 2] = ["service", "servicecidr"];
pub const WEBHOOK_OPERATIONS: [&str; 3] = ["mutate", "validate", "validate_servicecidr"];

fn latency_histogram() -> Histogram {
    // 25 µs … ~7 s in steps of 1.5×: admission answers take well under a millisecond.
    Histogram::new(exponential_buckets(0.000025, 1.5, 32))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("clusterip"),
            kubernetes: Registry::default(),
            leader_election_master_status: Family::default(),
            allocated_ips: Family::default(),
            available_ips: Family::default(),
            pooled_ips: Family::default(),
            map_bytes: Family::default(),
            band_allocated_ips: Family::default(),
            band_available_ips: Family::default(),
            unreadable_records: Family::default(),
            allocation_total: Family::default(),
            allocation_errors_total: Family::default(),
            allocation_duration: Family::new_with_constructor(latency_histogram),
            webhook_duration: Family::new_with_constructor(latency_histogram),
            webhook_request_duration: Family::new_with_constructor(latency_histogram),
            webhook_bad_requests: Family::default(),
            webhook_refused_connections: Family::default(),
            http_refused_connections: Family::default(),
            webhook_released_addresses: Family::default(),
            reconcile_errors: Family::default(),
            repair_ip_errors: Family::default(),
            repair_reconcile_errors: Counter::default(),
            address_block_events: Family::default(),
        };
        let registry = &mut m.registry;
        let alloc = registry.sub_registry_with_prefix("allocator");
        alloc.register("allocated_ips", "Gauge measuring the number of allocated IPs for Services", m.allocated_ips.clone());
        alloc.register("available_ips", "Gauge measuring the number of available IPs for Services", m.available_ips.clone());
        alloc.register(
            "pooled_ips",
            "Gauge measuring the free IPs held ahead of need in the controller replicas' address pools (counted in available_ips)",
            m.pooled_ips.clone(),
        );
        alloc.register(
            "map_bytes",
            "Gauge measuring the size in bytes of the range's allocation map as stored in etcd (etcd backend); etcd refuses writes larger than its --max-request-bytes, 1.5 MiB by default",
            m.map_bytes.clone(),
        );
        alloc.register(
            "band_allocated_ips",
            "Gauge measuring the allocated IPs for Services per band of the range: static (kept for requested addresses) and dynamic",
            m.band_allocated_ips.clone(),
        );
        alloc.register("band_available_ips", "Gauge measuring the available IPs for Services per band of the range: static and dynamic", m.band_available_ips.clone());
        alloc.register(
            "unreadable_records",
            "Gauge measuring the stored allocation records the allocator cannot read (and so refuses to act on), by kind",
            m.unreadable_records.clone(),
        );
        alloc.register("allocation", "Number of Cluster IPs allocations", m.allocation_total.clone());
        alloc.register("allocation_errors", "Number of errors trying to allocate Cluster IPs", m.allocation_errors_total.clone());
        alloc.register_with_unit(
            "allocation_duration",
            "Duration in seconds to allocate a Cluster IP by ServiceCIDR",
            prometheus_client::registry::Unit::Seconds,
            m.allocation_duration.clone(),
        );
        let web = registry.sub_registry_with_prefix("webhook");
        web.register_with_unit(
            "admission_duration",
            "Time to answer one AdmissionReview once its body is in hand (decode, decide, reserve, encode), by operation and whether it was allowed",
            prometheus_client::registry::Unit::Seconds,
            m.webhook_duration.clone(),
        );
        web.register_with_unit(
            "request_duration",
            "Time from an admission request's headers to its answer, receiving the body from the kube-apiserver included",
            prometheus_client::registry::Unit::Seconds,
            m.webhook_request_duration.clone(),
        );
        web.register("bad_requests", "AdmissionReview requests rejected as malformed (HTTP 400) or whose body did not arrive in time (HTTP 408)", m.webhook_bad_requests.clone());
        web.register(
            "refused_connections",
            "Connections to the webhook closed before any request: no valid client certificate, another TLS handshake failure, a handshake not finished in time, a source holding too many unauthenticated connections, or closed idle to make room at the connection limit",
            m.webhook_refused_connections.clone(),
        );
        registry.sub_registry_with_prefix("webhook").register(
            "released_addresses",
            "Addresses the webhook answered and released again: apiserver_released (the kube-apiserver recorded the address and released it again: the create failed, or the Service was deleted at once) or in_flight_limit (not recorded within --in-flight-limit)",
            m.webhook_released_addresses.clone(),
        );
        registry.sub_registry_with_prefix("http").register(
            "refused_connections",
            "Connections to the metrics and health-probe ports closed by their limits: a source holding too many connections, or closed idle to make room at the connection limit",
            m.http_refused_connections.clone(),
        );
        registry.register("reconcile_errors", "Reconciliation failures, by controller", m.reconcile_errors.clone());
        registry.sub_registry_with_prefix("address_block").register(
            "events",
            "The ipaddress backend's address-block protocol on this replica since it started: blocks created, taken over from a holder that stopped renewing, stale Leases of another range or size deleted, handed over at another replica's request, given back, lost while held",
            m.address_block_events.clone(),
        );
        let repair = registry.sub_registry_with_prefix("repair");
        repair.register(
            "ip_errors",
            "Number of errors detected on clusterips by the repair loop broken down by type of error: leak, repair, full, outOfRange, duplicate, unknown, invalid",
            m.repair_ip_errors.clone(),
        );
        repair.register("reconcile_errors", "Number of reconciliation failures on the clusterip repair reconcile loop", m.repair_reconcile_errors.clone());
        m.kubernetes.register(
            "leader_election_master_status",
            "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease. Please make sure to group by name.",
            m.leader_election_master_status.clone(),
        );
        clusterip_component_base::metrics::register_build_info(&mut m.registry, "clusterip", VERSION, COMMIT);
        clusterip_component_base::metrics::register(&mut m.kubernetes);
        m.report_known_labels_at_zero();
        m
    }

    fn report_known_labels_at_zero(&self) {
        for r#type in REPAIR_ERROR_TYPES {
            let _ = self.repair_ip_errors.get_or_create(&RepairLabels { r#type });
        }
        for reason in WEBHOOK_REFUSAL_REASONS {
            let _ = self.webhook_refused_connections.get_or_create(&ReasonLabels { reason });
        }
        for server in ["metrics", "health"] {
            for reason in HTTP_REFUSAL_REASONS {
                let _ = self.http_refused_connections.get_or_create(&ServerReasonLabels { server, reason });
            }
        }
        for reason in RELEASE_REASONS {
            let _ = self.webhook_released_addresses.get_or_create(&ReasonLabels { reason });
        }
        for controller in CONTROLLERS {
            let _ = self.reconcile_errors.get_or_create(&ControllerLabels { controller });
        }
        for operation in WEBHOOK_OPERATIONS {
            let _ = self.webhook_bad_requests.get_or_create(&OperationLabels { operation });
        }
    }

    /// One answered admission request: `answer` from the body in hand, `request` from the
    /// headers.
    pub fn webhook_latency(&self, operation: &'static str, allowed: bool, answer: Duration, request: Duration) {
        let labels = WebhookLabels { operation, allowed: if allowed { "true" } else { "false" } };
        self.webhook_duration.get_or_create(&labels).observe(answer.as_secs_f64());
        self.webhook_request_duration.get_or_create(&labels).observe(request.as_secs_f64());
    }

    pub fn webhook_bad_request(&self, operation: &'static str) {
        self.webhook_bad_requests.get_or_create(&OperationLabels { operation }).inc();
    }

    pub fn webhook_refused_connection(&self, reason: &'static str) {
        self.webhook_refused_connections.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// The store's block events (counts since start): each counter raised to its count.
    pub fn set_block_events(&self, events: &[(&'static str, u64)]) {
        for (event, n) in events {
            let c = self.address_block_events.get_or_create(&EventLabels { event });
            let seen = c.get();
            if *n > seen {
                c.inc_by(n - seen);
            }
        }
    }

    pub fn webhook_released_addresses(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.webhook_released_addresses.get_or_create(&ReasonLabels { reason }).inc_by(n);
        }
    }

    pub fn http_refused_connection(&self, server: &'static str, reason: &'static str) {
        self.http_refused_connections.get_or_create(&ServerReasonLabels { server, reason }).inc();
    }

    pub fn allocation(&self, cidr: &str, scope: &'static str, ok: bool, d: Duration) {
        let labels = ScopeLabels { cidr: cidr.to_string(), scope };
        if ok {
            self.allocation_total.get_or_create(&labels).inc();
        } else {
            self.allocation_errors_total.get_or_create(&labels).inc();
        }
        self.allocation_duration.get_or_create(&CidrLabels { cidr: cidr.to_string() }).observe(d.as_secs_f64());
    }

    /// The allocation counters of a range, at 0 until its first allocation.
    pub fn report_range_at_zero(&self, cidr: &str) {
        for scope in ["static", "dynamic"] {
            let labels = ScopeLabels { cidr: cidr.to_string(), scope };
            let _ = self.allocation_total.get_or_create(&labels);
            let _ = self.allocation_errors_total.get_or_create(&labels);
        }
    }

    /// Whether this replica leads for the Lease `name` (and runs the reconcilers).
    pub fn set_leading(&self, name: &str, leading: bool) {
        self.leader_election_master_status.get_or_create(&NameLabels { name: name.to_string() }).set(i64::from(leading));
    }

    pub fn set_usage(&self, cidr: &str, used: u64, free: u64, pooled: u64, map_bytes: Option<u64>) {
        let l = CidrLabels { cidr: cidr.to_string() };
        if let Some(b) = map_bytes {
            self.map_bytes.get_or_create(&l).set(i64::try_from(b).unwrap_or(i64::MAX));
        }
        self.pooled_ips.get_or_create(&l).set(i64::try_from(pooled).unwrap_or(i64::MAX));
        self.allocated_ips.get_or_create(&l).set(i64::try_from(used).unwrap_or(i64::MAX));
        self.available_ips.get_or_create(&l).set(i64::try_from(free).unwrap_or(i64::MAX));
    }

    /// Per band of each range: allocated and available addresses.
    pub fn set_bands(&self, capacity: &crate::capacity::Capacity) {
        for r in &capacity.ranges {
            for (band, b) in [("static", &r.static_band), ("dynamic", &r.dynamic_band)] {
                let l = BandLabels { cidr: r.cidr.clone(), band };
                self.band_allocated_ips.get_or_create(&l).set(i64::try_from(b.used).unwrap_or(i64::MAX));
                self.band_available_ips.get_or_create(&l).set(i64::try_from(b.free).unwrap_or(i64::MAX));
            }
        }
    }

    /// The records the store cannot read now, counted by kind (every kind always reported,
    /// so the gauge returns to 0 once they are repaired).
    pub fn set_unreadable(&self, records: &[crate::store::Unreadable]) {
        for kind in ["allocation_map", "owner", "ipaddress"] {
            let n = records.iter().filter(|r| r.kind == kind).count();
            self.unreadable_records.get_or_create(&KindLabels { kind }).set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry);
        let _ = encode_registry(&mut out, &self.kubernetes);
        let _ = encode_eof(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leader_gauge_has_kubernetes_name_and_one_eof() {
        let m = Metrics::new();
        m.set_leading("kube-system/clusterip-controller", true);
        let text = m.encode();
        assert!(text.contains("\nleader_election_master_status{name=\"kube-system/clusterip-controller\"} 1\n"), "{text}");
        assert!(text.contains("clusterip_repair_reconcile_errors_total"), "{text}");
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(text.contains(&format!("\nclusterip_build_info{{version=\"{VERSION}\",commit=\"{COMMIT}\"}} 1\n")), "{text}");
        assert!(text.contains("\nprocess_resident_memory_bytes "), "{text}");
        assert!(text.contains("\nclusterip_repair_ip_errors_total{type=\"duplicate\"} 0\n"), "{text}");
        m.set_leading("kube-system/clusterip-controller", false);
        assert!(m.encode().contains("\nleader_election_master_status{name=\"kube-system/clusterip-controller\"} 0\n"));
    }
}
