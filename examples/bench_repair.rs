//! The repair benchmark's helper (scripts/bench-repair.sh), against a private dev control
//! plane:
//!
//!   bench_repair seed <kubeconfig> <etcd endpoints> <etcd prefix> <cidr> <count> [concurrency]
//!     COUNT real Services with static ClusterIPs (offsets 1..=COUNT; offset 0 is the
//!     `kubernetes` Service's) through the kube-apiserver, namespace `bench-repair`, and every
//!     address 0..=COUNT recorded in the etcd backend: a consistent cluster to scan.
//!
//!   bench_repair inject <etcd endpoints> <etcd prefix> <cidr> <count> [first offset, 1]
//!     COUNT Services written straight into the kube-apiserver's etcd (JSON values under
//!     /registry/services/specs/bench-inject/, which the apiserver decodes like its own
//!     protobuf ones), addresses at offsets FIRST.., and every address from offset 0 to the
//!     last recorded in the etcd backend: 50,000 real Services for the apiserver to list, in
//!     seconds.
//!
//!   bench_repair synthetic <etcd endpoints> <etcd prefix> <cidr> <count> [--compare-whole]
//!     COUNT addresses recorded in the real etcd backend, then one pass timed in-process:
//!     open the store and read its records (real etcd), deserialize COUNT synthetic Services
//!     page by page (500 per page, the JSON a list returns) into the pass's inputs, decide.
//!     Prints the pass duration and VmHWM (peak RSS) of this process.

use std::time::Instant;

use clusterip::cidr::ServiceCidr;
use clusterip::repair::{decide, service_view, summary_view, Config, LeakCounts, Mode, Records, ServiceSummary};
use clusterip::store::etcd::{EtcdConfig, EtcdStore};
use clusterip::store::AllocationStore;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::api::{Api, PostParams};
use serde_json::json;

fn vm_hwm_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("VmHWM:").and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())))
        .unwrap_or(0)
}

async fn record(endpoints: &str, prefix: &str, cidr: &ServiceCidr, count: u64) -> anyhow::Result<EtcdStore> {
    let cfg = EtcdConfig { endpoints: endpoints.split(',').map(str::to_string).collect(), prefix: prefix.to_string(), ..Default::default() };
    let store = EtcdStore::open(&cfg, vec![cidr.clone()]).await?;
    let mut allocs = futures::stream::iter(0..=count)
        .map(|i| {
            let store = &store;
            let ip = cidr.ip_at(i);
            async move {
                match ip {
                    Some(ip) => match store.allocate(ip, None).await {
                        Ok(()) | Err(clusterip::store::StoreError::Alloc(clusterip::alloc::AllocError::Allocated)) => Ok(()),
                        Err(e) => Err(e),
                    },
                    None => Ok(()),
                }
            }
        })
        .buffer_unordered(4096);
    while let Some(r) = allocs.next().await {
        r?;
    }
    drop(allocs);
    Ok(store)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("seed") if args.len() >= 6 => seed(&args[1..]).await,
        Some("synthetic") if args.len() >= 5 => synthetic(&args[1..]).await,
        Some("inject") if args.len() >= 5 => inject(&args[1..]).await,
        _ => anyhow::bail!("usage: bench_repair seed <kubeconfig> <etcd endpoints> <etcd prefix> <cidr> <count> [concurrency] | synthetic <etcd endpoints> <etcd prefix> <cidr> <count> [--compare-whole]"),
    }
}

async fn seed(args: &[String]) -> anyhow::Result<()> {
    let kc = kube::config::Kubeconfig::read_from(&args[0])?;
    let client = kube::Client::try_from(kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?)?;
    let cidr = ServiceCidr::parse(&args[3])?;
    let count: u64 = args[4].parse()?;
    let concurrency: usize = args.get(5).map(|s| s.parse()).transpose()?.unwrap_or(32);
    if count >= cidr.size() {
        anyhow::bail!("{count} Services do not fit in {cidr} ({} usable)", cidr.size());
    }
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "bench-repair"}}))?;
    let _ = Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await;
    let api: Api<Service> = Api::namespaced(client.clone(), "bench-repair");
    let started = Instant::now();
    let (mut failed, mut done) = (0u64, 0u64);
    let mut creates = futures::stream::iter(1..=count)
        .map(|i| {
            let api = api.clone();
            let ip = cidr.ip_at(i).map(|ip| ip.to_string());
            async move {
                let Some(ip) = ip else { return Err(anyhow::anyhow!("offset {i} outside the range")) };
                let svc: Service = serde_json::from_value(json!({"metadata": {"name": format!("svc-{i}")}, "spec": {"clusterIP": ip, "ports": [{"port": 80}]}}))?;
                match api.create(&PostParams::default(), &svc).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                    Err(e) => Err(anyhow::anyhow!("svc-{i}: {e}")),
                }
            }
        })
        .buffer_unordered(concurrency);
    while let Some(r) = creates.next().await {
        done += 1;
        if let Err(e) = r {
            failed += 1;
            if failed <= 3 {
                eprintln!("{e}");
            }
        }
        if done % 1000 == 0 {
            eprintln!("seed: {done} Services in {:.1}s", started.elapsed().as_secs_f64());
        }
    }
    let services_s = started.elapsed().as_secs_f64();
    let t = Instant::now();
    drop(record(&args[1], &args[2], &cidr, count).await?);
    println!("seeded services={count} failed={failed} services_s={services_s:.1} records_s={:.1}", t.elapsed().as_secs_f64());
    if failed > 0 {
        anyhow::bail!("{failed} Service creates failed");
    }
    Ok(())
}

async fn inject(args: &[String]) -> anyhow::Result<()> {
    let cidr = ServiceCidr::parse(&args[2])?;
    let count: u64 = args[3].parse()?;
    if count >= cidr.size() {
        anyhow::bail!("{count} Services do not fit in {cidr} ({} usable)", cidr.size());
    }
    let first: u64 = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let last = first + count - 1;
    if last >= cidr.size() {
        anyhow::bail!("offsets {first}..={last} do not fit in {cidr} ({} usable)", cidr.size());
    }
    let endpoints: Vec<String> = args[0].split(',').map(str::to_string).collect();
    let started = Instant::now();
    clusterip_test_support::inject::services(&endpoints, (first..=last).filter_map(|i| Some((i, cidr.ip_at(i)?))), false).await?;
    let services_s = started.elapsed().as_secs_f64();
    let t = Instant::now();
    drop(record(&args[0], &args[1], &cidr, last).await?);
    println!("injected services={count} services_s={services_s:.1} records_s={:.1}", t.elapsed().as_secs_f64());
    Ok(())
}

/// Services `first..end` as one page of a list answer's JSON, each as a kube-apiserver
/// stores a Service made by `kubectl create` (metadata with a managedFields entry, a port, a
/// selector) and admitted by our webhook today (no `clusterip.allocator/reserved`
/// annotation: only Services of older versions carry it).
fn service_page(cidr: &ServiceCidr, first: u64, end: u64) -> anyhow::Result<Vec<u8>> {
    let items: Vec<serde_json::Value> = (first..end)
        .map(|n| {
            let ip = cidr.ip_at(n).map(|ip| ip.to_string()).unwrap_or_default();
            json!({
                "metadata": {"name": format!("svc-{n}"), "namespace": format!("ns-{}", n % 100), "uid": format!("00000000-0000-0000-0000-{n:012}"),
                             "resourceVersion": format!("{}", 1000 + n), "creationTimestamp": "2026-11-22T16:00:00Z",
                             "labels": {"app": format!("app-{n}")},
                             "managedFields": [{"manager": "kubectl-create", "operation": "Update", "apiVersion": "v1", "time": "2026-11-22T16:00:00Z",
                                                "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}}},
                                                "f:spec": {"f:internalTrafficPolicy": {}, "f:ports": {".": {}, "k:{\"port\":80,\"protocol\":\"TCP\"}": {".": {}, "f:name": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {}}},
                                                           "f:selector": {}, "f:sessionAffinity": {}, "f:type": {}}}}]},
                "spec": {"clusterIP": ip, "clusterIPs": [ip], "ipFamilies": [if ip.contains(':') { "IPv6" } else { "IPv4" }], "ipFamilyPolicy": "SingleStack", "type": "ClusterIP",
                         "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}], "selector": {"app": format!("app-{n}")},
                         "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"},
                "status": {"loadBalancer": {}}
            })
        })
        .collect();
    Ok(serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "ServiceList", "metadata": {"resourceVersion": "1"}, "items": items}))?)
}

async fn synthetic(args: &[String]) -> anyhow::Result<()> {
    let cidr = ServiceCidr::parse(&args[2])?;
    let count: u64 = args[3].parse()?;
    let compare_whole = args.get(4).map(String::as_str) == Some("--compare-whole");
    let t = Instant::now();
    drop(record(&args[0], &args[1], &cidr, count.saturating_sub(1)).await?);
    let seed_s = t.elapsed().as_secs_f64();
    let hwm_before = vm_hwm_kb();

    let started = Instant::now();
    // The pass: records from real etcd (a fresh store, as a new process would open it).
    let cfg = EtcdConfig { endpoints: args[0].split(',').map(str::to_string).collect(), prefix: args[1].clone(), ..Default::default() };
    let store = EtcdStore::open(&cfg, vec![cidr.clone()]).await?;
    let records: std::collections::BTreeSet<std::net::IpAddr> = store.allocated().await?.into_iter().collect();
    let records_s = started.elapsed().as_secs_f64();
    // Services: one page of the list's JSON at a time (as the apiserver returns it, with
    // managedFields), decoded as `clusterip repair` decodes a list answer. Only the decoding is
    // timed, not the making of the page. The same pages decoded as whole Services (how the
    // pass read them before) are timed beside, for comparison, and dropped.
    let mut services = Vec::with_capacity(count as usize);
    let (mut list_s, mut whole_s) = (0.0, 0.0);
    let mut i = 0u64;
    while i < count {
        let end = (i + 500).min(count);
        let page = service_page(&cidr, i, end)?;
        let t = Instant::now();
        let list: kube::core::ObjectList<ServiceSummary> = serde_json::from_slice(&page)?;
        services.extend(list.items.into_iter().map(summary_view));
        list_s += t.elapsed().as_secs_f64();
        if compare_whole {
            let t = Instant::now();
            let list: kube::core::ObjectList<Service> = serde_json::from_slice(&page)?;
            let views: Vec<_> = list.items.into_iter().map(service_view).collect();
            std::hint::black_box(views);
            whole_s += t.elapsed().as_secs_f64();
        }
        i = end;
    }
    let cfg = Config {
        ranges: vec![cidr.clone()],
        cluster_ranges: Some(vec![cidr.clone()]),
        mode: Mode::Etcd,
        grace: clusterip::repair::DEFAULT_GRACE,
        release_leaks_now: false,
    };
    let t = Instant::now();
    let report = decide(&cfg, &services, &Records::Map(records), &mut LeakCounts::default());
    let decide_s = t.elapsed().as_secs_f64();
    let total = records_s + list_s + decide_s;
    println!(
        "synthetic services={} records={} findings={} pass_s={total:.3} (records_s={records_s:.3} services_s={list_s:.3} decide_s={decide_s:.3}) vm_hwm_kb={} (before the pass {hwm_before}) seed_s={seed_s:.1}{}",
        report.services,
        report.records,
        report.findings.len(),
        vm_hwm_kb(),
        if compare_whole { format!(" whole_services_s={whole_s:.3}") } else { String::new() },
    );
    if !report.findings.is_empty() {
        anyhow::bail!("the synthetic cluster is not consistent: {} findings", report.findings.len());
    }
    Ok(())
}
