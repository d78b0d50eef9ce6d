//! One controller replica beside a large cluster: with no Services, then with N Services and
//! their IPAddress objects existing (written straight into the apiserver's etcd,
//! `clusterip_test_support::inject`), on the ipaddress backend — the one whose start-up and
//! block acquisitions read every IPAddress — or the etcd backend (`CLUSTERIP_SCALE_BACKEND`),
//! which records every IPAddress it lacks in its map at start. Measured: the time from start to ready, its
//! memory (VmRSS once ready; VmHWM, the peak, after the answers), the webhook's answer to
//! new creates (AdmissionReviews posted as the apiserver does, one after another), the time
//! until the address history holds the measured address, its CPU over the next 30 s and its
//! VmRSS after them, then the time of `clusterip explain` of that address. A benchmark, not
//! part of the suite:
//!
//!   CLUSTERIP_SCALE_SERVICES=50000 cargo test --test scale -- --ignored --nocapture
//!   CLUSTERIP_SCALE_BACKEND=etcd CLUSTERIP_SCALE_SERVICES=50000 cargo test --test scale -- --ignored --nocapture
//!
//! Prints `RESULT scale …` per size. The Deployment's memory limit is 256 Mi
//! (deploy/deployment.yaml); docs/benchmarks.md has the figures.

#[path = "controller_common/mod.rs"]
mod controller_common;

use std::time::{Duration, Instant};

use clusterip_test_support::ControlPlane;
use controller_common::admission_client::{allowed, post_raw, review, tls_client};
use controller_common::{client_auth_args, controller_args, Controller};

/// The apiserver's and the controller's range: a /15 holds 100k Services and more.
const RANGE_V4: &str = "198.18.0.0/15";
const RANGE_V6: &str = "fd00:10:96::/112";

/// (VmRSS, VmHWM) of `pid`, MiB.
fn memory_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok()).unwrap_or(0.0);
    (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
}

/// CPU time (user + system) of `pid` so far, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let at = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    at(11) + at(12) // utime, stime (fields 14 and 15 of stat)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1000.0
}

/// Start a replica, measure it, stop it.
async fn measure(cp: &ControlPlane, backend: &str, services: u64) {
    let mut args = client_auth_args(cp);
    args.extend(controller_args(cp, backend, &format!("{RANGE_V4},{RANGE_V6}"), "scale", "default", &format!("scale-{services}"), &cp.kubeconfig()));
    // The address history on (tests keep none by default), for `explain` below.
    args.extend(["--address-history-chunks".to_string(), "64".to_string()]);
    let started = Instant::now();
    let c = Controller::start(args);
    c.wait_ready().await;
    let ready = started.elapsed();
    let (rss_ready, _) = memory_mib(c.pid());

    // New creates, one after another, as the kube-apiserver posts them.
    let tls = tls_client(cp);
    let mut took = Vec::new();
    for i in 0..500 {
        let body = serde_json::to_vec(&review(&format!("u-{i}"), &format!("new-{i}"), serde_json::json!({"ports": [{"port": 80}]}))).expect("a review");
        let t = Instant::now();
        let answer = post_raw(&tls, c.webhook_port, "/mutate", &body).await.expect("post a review");
        took.push(t.elapsed());
        assert!(allowed(&answer), "review {i} not allowed: {answer}");
    }
    took.sort();

    // `clusterip explain` of one address (the library call the command makes), once the
    // leader has written the history of every address it found: 20 times, one after another.
    let client = cp.client().await;
    let range = clusterip::cidr::ServiceCidr::parse(RANGE_V4).expect("range");
    let target = match backend {
        // The controllers' map (`controller_args`: prefix /clusterip-test/scale).
        "etcd" => {
            let cfg = clusterip::store::etcd::EtcdConfig { endpoints: cp.etcd_endpoints(), prefix: "/clusterip-test/scale".into(), ..Default::default() };
            clusterip::repair::Target::Etcd(std::sync::Arc::new(clusterip::store::etcd::EtcdStore::open(&cfg, vec![range.clone()]).await.expect("open the map")))
        }
        _ => clusterip::repair::Target::IpAddress { manager: clusterip::store::ipaddress::objects::DEFAULT_MANAGER.into(), ranges: vec![range.clone()], use_servicecidrs: false },
    };
    // With no Services: the `kubernetes` Service's address.
    let ip = range.ip_at(if services == 0 { 0 } else { services / 2 + 2 }).expect("an address");
    let (client_ref, started_history) = (&client, Instant::now());
    let history_written = clusterip_test_support::within(Duration::from_secs(300), Duration::from_millis(500), move || async move {
        let log = clusterip::history::read_for(client_ref, "default", ip).await.unwrap_or_default();
        log.iter().any(|e| e.address == ip).then_some(())
    })
    .await
    .map(|()| started_history.elapsed());
    let cms: kube::Api<k8s_openapi::api::core::v1::ConfigMap> = kube::Api::namespaced(client.clone(), "default");
    let chunks = cms.list(&kube::api::ListParams::default().labels(clusterip::history::LABEL)).await.map(|l| l.items.len()).unwrap_or(0);
    let (rss_after, hwm) = memory_mib(c.pid());

    // Idle: CPU over 30 s (the subject here is time itself).
    let ticks = cpu_ticks(c.pid());
    tokio::time::sleep(Duration::from_secs(30)).await;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let idle_cpu = (cpu_ticks(c.pid()) - ticks) as f64 / hz / 30.0 * 100.0;
    // Memory once the leader's first passes (history, repair) are behind it.
    let (rss_idle, _) = memory_mib(c.pid());

    // `explain`, on the settled cluster (the leader's first history writes and repair pass,
    // which load the apiserver, are behind it): 20 times, one after another.
    let mut explain_took = Vec::new();
    let mut holdings = 0;
    for _ in 0..20 {
        let t = Instant::now();
        let e = clusterip::repair::explain::explain(&client, &target, ip, Some("default")).await.expect("explain");
        explain_took.push(t.elapsed());
        holdings = e.history.map(|h| h.len()).unwrap_or(0);
    }
    explain_took.sort();
    println!(
        "RESULT scale backend={backend} services={services} ready_s={:.1} rss_ready_mib={rss_ready:.1} rss_after_mib={rss_after:.1} rss_idle_mib={rss_idle:.1} hwm_mib={hwm:.1} mutate_p50_ms={:.2} mutate_p99_ms={:.2} idle_cpu_pct={idle_cpu:.1} history_chunks={chunks} history_written_s={} explain_p50_ms={:.1} explain_max_ms={:.1} explain_holdings={holdings}",
        ready.as_secs_f64(),
        percentile(&took, 0.50),
        percentile(&took, 0.99),
        history_written.map(|d| format!("{:.1}", d.as_secs_f64())).unwrap_or_else(|| "none".into()),
        percentile(&explain_took, 0.50),
        percentile(&explain_took, 1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a benchmark: CLUSTERIP_SCALE_SERVICES=50000 cargo test --test scale -- --ignored --nocapture"]
async fn one_replica_beside_many_services() {
    let n: u64 = std::env::var("CLUSTERIP_SCALE_SERVICES").ok().and_then(|v| v.parse().ok()).unwrap_or(50_000);
    let cp = ControlPlane::private_with("scale", &[("CLUSTERIP_APISERVER_SERVICE_CIDRS", &format!("{RANGE_V4},{RANGE_V6}"))]);
    let backend = std::env::var("CLUSTERIP_SCALE_BACKEND").unwrap_or_else(|_| "ipaddress".into());
    measure(&cp, &backend, 0).await;
    let range = clusterip::cidr::ServiceCidr::parse(RANGE_V4).expect("the range");
    // Offsets from 2 (the `kubernetes` Service holds the first).
    let t = Instant::now();
    let written = clusterip_test_support::inject::services(&cp.etcd_endpoints(), (2..2 + n).filter_map(|i| Some((i, range.ip_at(i)?))), true).await.expect("inject Services and IPAddresses");
    assert_eq!(written, n);
    println!("injected services={n} ipaddresses={n} in {:.1} s", t.elapsed().as_secs_f64());
    measure(&cp, &backend, n).await;
}
