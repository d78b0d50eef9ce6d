//! The figures of docs/reliability.md "Tenants": a hostile tenant against a running
//! controller, through the real kube-apiserver. Used by scripts/bench-tenants.sh, which
//! starts the dev cluster and passes its endpoints.
//!
//!   tenants probes  KUBECONFIG HEALTH_PORT METRICS_PORT WEBHOOK_PORT SECONDS
//!   tenants pinning KUBECONFIG METRICS_PORT SECONDS
//!
//! `probes`: for SECONDS, 64 keep-alive connections to each plain-HTTP port (metrics,
//! health) sending a request every 5 s, and 100 new silent TCP connections a second to the
//! webhook port (never a TLS handshake), all from loopback addresses other than 127.0.0.1;
//! meanwhile the kubelet's probes (`/readyz` and `/healthz`, a 2 s deadline) once a second,
//! and one Service create a second through the kube-apiserver (our webhook on its path).
//!
//! `pinning`: for SECONDS, one tenant sends 5 creates a second that the apiserver refuses
//! after our answer (`port: 0`), while another creates one valid Service a second (each
//! deleted 10 s later); counts valid creates refused "range is full".
//!
//! Prints `RESULT <name> …` lines.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clusterip_test_support::attack::{self, Attack};
use clusterip_test_support::{local_get, sa};
use k8s_openapi::api::core::v1::{Namespace, Service, ServicePort, ServiceSpec};
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};

async fn client(kubeconfig: &str) -> anyhow::Result<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    cfg.read_timeout = Some(Duration::from_secs(30));
    Ok(kube::Client::try_from(cfg)?)
}

/// A namespace of the bench's own (created if missing); its Services API.
async fn services(client: &kube::Client, namespace: &str) -> anyhow::Result<Api<Service>> {
    let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": namespace}}))?;
    let _ = Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await;
    Ok(Api::namespaced(client.clone(), namespace))
}

fn service(name: &str, port: i32) -> Service {
    Service {
        metadata: ObjectMeta { name: Some(name.to_string()), ..Default::default() },
        spec: Some(ServiceSpec { ports: Some(vec![ServicePort { port, ..Default::default() }]), ..Default::default() }),
        ..Default::default()
    }
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

async fn probes(kubeconfig: &str, health: u16, metrics: u16, webhook: u16, seconds: u64) -> anyhow::Result<()> {
    let api = services(&client(kubeconfig).await?, "bench-tenants").await?;
    let mut tenant = Attack::new();
    let keepers = attack::sources(1, 8);
    tenant.keep_alive(&keepers, 8, sa("127.0.0.1", metrics), "/metrics", Duration::from_secs(5));
    tenant.keep_alive(&keepers, 8, sa("127.0.0.1", health), "/readyz", Duration::from_secs(5));
    tenant.silent_flood(&attack::sources(2, 20), 100, sa("127.0.0.1", webhook));

    let (mut probes_sent, mut probes_failed, mut creates, mut created) = (0u64, 0u64, 0u64, 0u64);
    let mut create_errors: Vec<String> = Vec::new();
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut i = 0u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        tick.tick().await;
        for path in ["/readyz", "/healthz"] {
            probes_sent += 1;
            let ok = matches!(tokio::time::timeout(Duration::from_secs(2), local_get(health, path)).await, Ok(Some((200, _))));
            if !ok {
                probes_failed += 1;
            }
        }
        creates += 1;
        match api.create(&PostParams::default(), &service(&format!("t-{i}"), 80)).await {
            Ok(_) => created += 1,
            Err(e) => create_errors.push(e.to_string()),
        }
        i += 1;
    }
    let text = local_get(metrics, "/metrics").await.map(|(_, b)| b).unwrap_or_default();
    let count = |s: &str| metric(&text, s);
    println!(
        "RESULT tenant_probes seconds={seconds} probes={probes_sent} probes_failed={probes_failed} creates={creates} created={created} created_pct={:.2} target_failed=0 target_created_pct=99",
        100.0 * created as f64 / creates.max(1) as f64
    );
    println!(
        "RESULT tenant_connections opened={} closed_by_server={} metrics_evicted={} metrics_source_limit={} health_evicted={} health_source_limit={} webhook_evicted={} webhook_handshake_timeout={} webhook_source_limit={}",
        tenant.opened.load(Ordering::Relaxed),
        tenant.closed_by_server.load(Ordering::Relaxed),
        count("clusterip_http_refused_connections_total{server=\"metrics\",reason=\"evicted\"}"),
        count("clusterip_http_refused_connections_total{server=\"metrics\",reason=\"source_limit\"}"),
        count("clusterip_http_refused_connections_total{server=\"health\",reason=\"evicted\"}"),
        count("clusterip_http_refused_connections_total{server=\"health\",reason=\"source_limit\"}"),
        count("clusterip_webhook_refused_connections_total{reason=\"evicted\"}"),
        count("clusterip_webhook_refused_connections_total{reason=\"handshake_timeout\"}"),
        count("clusterip_webhook_refused_connections_total{reason=\"source_limit\"}"),
    );
    for e in create_errors.iter().take(5) {
        println!("# create failed: {e}");
    }
    Ok(())
}

async fn pinning(kubeconfig: &str, metrics: u16, seconds: u64) -> anyhow::Result<()> {
    let client = client(kubeconfig).await?;
    let (bad, good) = (services(&client, "bench-tenant-a").await?, services(&client, "bench-tenant-b").await?);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let invalid_sent = Arc::new(AtomicU64::new(0));
    let attacker = {
        let (bad, sent) = (bad.clone(), invalid_sent.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            let mut i = 0u64;
            while Instant::now() < deadline {
                tick.tick().await;
                let _ = bad.create(&PostParams::default(), &service(&format!("invalid-{i}"), 0)).await;
                sent.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        })
    };
    let (mut valid, mut full, mut other) = (0u64, 0u64, Vec::new());
    let mut live: std::collections::VecDeque<(Instant, String)> = Default::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut i = 0u64;
    while Instant::now() < deadline {
        tick.tick().await;
        while live.front().is_some_and(|(t, _)| t.elapsed() >= Duration::from_secs(10)) {
            if let Some((_, name)) = live.pop_front() {
                let _ = good.delete(&name, &DeleteParams::default()).await;
            }
        }
        let name = format!("valid-{i}");
        i += 1;
        valid += 1;
        match good.create(&PostParams::default(), &service(&name, 80)).await {
            Ok(_) => live.push_back((Instant::now(), name)),
            Err(e) if e.to_string().contains("range is full") => full += 1,
            Err(e) => other.push(e.to_string()),
        }
    }
    attacker.await?;
    for (_, name) in live {
        let _ = good.delete(&name, &DeleteParams::default()).await;
    }
    let text = local_get(metrics, "/metrics").await.map(|(_, b)| b).unwrap_or_default();
    println!(
        "RESULT tenant_pinning seconds={seconds} invalid_creates={} valid_creates={valid} refused_range_full={full} refused_other={} released_apiserver_released={} released_in_flight_limit={} target_refused_range_full=0",
        invalid_sent.load(Ordering::Relaxed),
        other.len(),
        metric(&text, "clusterip_webhook_released_addresses_total{reason=\"apiserver_released\"}"),
        metric(&text, "clusterip_webhook_released_addresses_total{reason=\"in_flight_limit\"}"),
    );
    for e in other.iter().take(5) {
        println!("# valid create failed: {e}");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let port = |s: &str| s.parse::<u16>().map_err(|e| anyhow::anyhow!("port {s:?}: {e}"));
    let secs = |s: &str| s.parse::<u64>().map_err(|e| anyhow::anyhow!("seconds {s:?}: {e}"));
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["probes", kubeconfig, health, metrics, webhook, seconds] => probes(kubeconfig, port(health)?, port(metrics)?, port(webhook)?, secs(seconds)?).await,
        ["pinning", kubeconfig, metrics, seconds] => pinning(kubeconfig, port(metrics)?, secs(seconds)?).await,
        _ => anyhow::bail!("usage: tenants probes KUBECONFIG HEALTH_PORT METRICS_PORT WEBHOOK_PORT SECONDS | tenants pinning KUBECONFIG METRICS_PORT SECONDS"),
    }
}
