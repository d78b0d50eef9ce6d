//! A hostile tenant against the controller's ports (docs/reliability.md, "Tenants"): with
//! only what a namespace user has — pods that can open connections — no one may crowd out
//! the kubelet's probes, a Prometheus scrape or the kube-apiserver's admission calls.

mod controller_common;

use std::time::{Duration, Instant};

use clusterip_test_support::attack::{self, Attack};
use clusterip_test_support::{control_plane, eventually, sa, unique_name};
use controller_common::admission_client::{allowed, post_raw, review, tls_client};
use controller_common::{client_auth_args, controller_args, metric, Controller};

const RANGE: &str = "198.18.202.0/24";

/// GET with a deadline, as the kubelet probes (`timeoutSeconds: 2`): the status, or None
/// when no answer came in time.
async fn get_within(port: u16, path: &str, limit: Duration) -> Option<u16> {
    match tokio::time::timeout(limit, clusterip_test_support::local_get(port, path)).await {
        Ok(Some((code, _))) => Some(code),
        _ => None,
    }
}

/// Twenty source addresses each hold as many keep-alive connections as they can to the
/// metrics and the health-probe ports, and as many silent ones as they can to the webhook
/// port, making them again whenever they are closed: together more than every port's
/// connection cap. Meanwhile every probe, scrape and admission call of the legitimate
/// clients is answered in time. (Before the probes had a port and per-source limits of
/// their own, 64 held connections on the metrics port made every probe time out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_scrapes_and_admission_are_answered_while_tenants_hold_every_connection_they_can() {
    let cp = control_plane();
    let name = unique_name("tenant");
    let mut args = controller_args(&cp, "etcd", RANGE, &name, "default", &name, &cp.kubeconfig());
    args.extend(client_auth_args(&cp));
    // A smaller webhook cap than the default, so that twenty sources exceed it.
    args.extend(["--webhook-max-connections".to_string(), "128".to_string()]);
    let c = Controller::start(args);
    c.wait_ready().await;

    let mut tenant = Attack::new();
    let sources = attack::sources(1, 20);
    tenant.keep_alive(&sources, 12, sa("127.0.0.1", c.metrics_port), "/metrics", Duration::from_secs(5));
    tenant.keep_alive(&sources, 12, sa("127.0.0.1", c.health_port), "/readyz", Duration::from_secs(5));
    tenant.silent(&sources, 12, sa("127.0.0.1", c.webhook_port));
    // Every port full: 20 × 12 connections each were made (some at once closed again).
    let opened = tenant.opened.clone();
    eventually("the tenant's 720 connections", Duration::from_secs(120), || {
        let n = opened.load(std::sync::atomic::Ordering::Relaxed);
        async move { n >= 720 }
    })
    .await;

    let connector = tls_client(&cp);
    let mut failures = Vec::new();
    for round in 0..15 {
        let started = Instant::now();
        if get_within(c.health_port, "/readyz", Duration::from_secs(2)).await != Some(200) {
            failures.push(format!("round {round}: /readyz on the health port not answered 200 within 2s"));
        }
        if get_within(c.health_port, "/healthz", Duration::from_secs(2)).await != Some(200) {
            failures.push(format!("round {round}: /healthz on the health port not answered 200 within 2s"));
        }
        if get_within(c.metrics_port, "/metrics", Duration::from_secs(2)).await != Some(200) {
            failures.push(format!("round {round}: /metrics not answered 200 within 2s"));
        }
        let body = review(&format!("tenant-{round}"), &format!("svc-{round}"), serde_json::json!({"ports": [{"port": 80}]})).to_string();
        match tokio::time::timeout(Duration::from_secs(5), post_raw(&connector, c.webhook_port, "/mutate", body.as_bytes())).await {
            Ok(Ok(answer)) if allowed(&answer) => {}
            Ok(Ok(answer)) => failures.push(format!("round {round}: admission answered {answer:?}")),
            Ok(Err(e)) => failures.push(format!("round {round}: admission call failed: {e}")),
            Err(_) => failures.push(format!("round {round}: admission not answered within 5s")),
        }
        // (Rounds at a rate, not a wait: one every 500 ms.)
        tokio::time::sleep(Duration::from_millis(500).saturating_sub(started.elapsed())).await;
    }
    assert!(failures.is_empty(), "{} failed calls while the tenant held its connections:\n{}\n{}", failures.len(), failures.join("\n"), c.log());

    // The limits did the work: sources were capped and idle connections made room.
    let text = clusterip_test_support::local_get(c.metrics_port, "/metrics").await.map(|(_, b)| b).unwrap_or_default();
    for server in ["metrics", "health"] {
        for reason in ["source_limit", "evicted"] {
            let series = format!("clusterip_http_refused_connections_total{{server=\"{server}\",reason=\"{reason}\"}}");
            assert!(metric(&text, &series).unwrap_or(0.0) >= 1.0, "{series} not counted:\n{text}");
        }
    }
    assert!(metric(&text, "clusterip_webhook_refused_connections_total{reason=\"evicted\"}").unwrap_or(0.0) >= 1.0, "{text}");
    drop(tenant);
}
