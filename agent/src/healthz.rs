//! `/healthz` and `/livez` with kube-proxy's semantics (pkg/proxy/healthcheck/proxy_health.go):
//! the proxy is unhealthy only when a change has been queued and not programmed for longer
//! than the health timeout (an idle proxy stays healthy); `/healthz` also requires the node
//! to be eligible (its Node exists, is not being deleted, and is not tainted
//! `ToBeDeletedByClusterAutoscaler`), `/livez` does not.

#![forbid(unsafe_code)]

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use crate::locks::lock;

/// Taint the cluster autoscaler puts on nodes it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

#[derive(Debug)]
struct Inner {
    oldest_pending: Option<Instant>,
    last_updated: Option<SystemTime>,
    node_eligible: bool,
}

/// Health of the proxy, shared by the sync loop and the HTTP server.
#[derive(Debug)]
pub struct ProxyHealth {
    inner: Mutex<Inner>,
    timeout: Duration,
}

/// An answer: HTTP status and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthAnswer {
    pub code: u16,
    pub body: String,
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

impl ProxyHealth {
    /// `timeout` is kube-proxy's healthTimeout (2 × syncPeriod by default).
    pub fn new(timeout: Duration) -> Self {
        ProxyHealth { inner: Mutex::new(Inner { oldest_pending: None, last_updated: None, node_eligible: false }), timeout }
    }

    /// A change was queued for sync.
    pub fn queued_update(&self) {
        let mut i = lock(&self.inner);
        if i.oldest_pending.is_none() {
            i.oldest_pending = Some(Instant::now());
        }
    }

    /// A sync programmed everything queued before it started.
    pub fn updated(&self) {
        let mut i = lock(&self.inner);
        i.oldest_pending = None;
        i.last_updated = Some(SystemTime::now());
    }

    pub fn set_node_eligible(&self, eligible: bool) {
        lock(&self.inner).node_eligible = eligible;
    }

    fn healthy_at(&self, i: &Inner, now: Instant) -> bool {
        i.oldest_pending.is_none_or(|t| now.duration_since(t) < self.timeout)
    }

    /// Whether the proxy is healthy (the `/livez` condition): no change has waited longer
    /// than the timeout.
    pub fn is_healthy(&self) -> bool {
        self.healthy_at(&lock(&self.inner), Instant::now())
    }

    /// The `/healthz` (`check_node = true`) or `/livez` answer.
    pub fn answer(&self, check_node: bool) -> HealthAnswer {
        let i = lock(&self.inner);
        let healthy = self.healthy_at(&i, Instant::now());
        let now = SystemTime::now();
        let ok = healthy && (!check_node || i.node_eligible);
        // kube-proxy reports "now" as lastUpdated while healthy.
        let last = if healthy { now } else { i.last_updated.unwrap_or(SystemTime::UNIX_EPOCH) };
        let mut body = serde_json::json!({
            "lastUpdated": rfc3339(last),
            "currentTime": rfc3339(now),
            "healthy": healthy,
        });
        if check_node {
            body["nodeEligible"] = serde_json::Value::Bool(i.node_eligible);
        }
        HealthAnswer { code: if ok { 200 } else { 503 }, body: body.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_proxy_is_healthy_pending_change_times_out() {
        let h = ProxyHealth::new(Duration::from_millis(0));
        h.set_node_eligible(true);
        assert_eq!(h.answer(true).code, 200, "nothing queued: healthy");
        h.queued_update();
        assert_eq!(h.answer(true).code, 503, "a change older than the timeout");
        assert_eq!(h.answer(false).code, 503);
        assert!(!h.is_healthy(), "is_healthy is the /livez condition");
        h.updated();
        assert_eq!(h.answer(true).code, 200);
    }

    #[test]
    fn healthz_needs_an_eligible_node_livez_does_not() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        let a = h.answer(true);
        assert_eq!(a.code, 503);
        assert!(a.body.contains("\"nodeEligible\":false"), "{}", a.body);
        assert_eq!(h.answer(false).code, 200);
        h.queued_update();
        assert_eq!(h.answer(false).code, 200, "a fresh change is not yet unhealthy");
    }
}
