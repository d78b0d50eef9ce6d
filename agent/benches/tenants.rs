//! Issue 30's conntrack fork storm as a figure: one UDP Service with 5,000 externalIPs
//! whose endpoint changes every 10 s, beside 1,000 UDP Services with one endpoint change
//! per second, with 100k conntrack entries in the node's namespace. Measured: network
//! programming latency (the agent's own `network_programming_duration_seconds`, from each
//! EndpointSlice's `last-change-trigger-time`, written by this bench just before the
//! slice), `conntrack` processes started per sync (a `conntrack` first on the agent's PATH
//! notes each run, then runs the real one), what the flushes deleted, peak RSS. Run by
//! `scripts/bench-agent-tenants.sh`.
//!
//! The real parts: the dev kube-apiserver (`CLUSTERIP_TEST_CLUSTER`, or one started for
//! the run), the agent binary (`CLUSTERIP_AGENT_BIN`, default this build's) programming a
//! network namespace of its own (`cip<pid>x…`, removed at the end; the agent dies with
//! this process). The 100k entries are made through ctnetlink (no traffic): 5,001 of them
//! flows of the big Service DNATed to its current endpoint (re-made for the new endpoint
//! after each change, so every flush has 5,001 entries to delete), the rest other UDP and
//! TCP flows the flushes must keep.
//!
//! Environment: TENANTS_EXTERNAL_IPS (5000), TENANTS_SERVICES (1000), TENANTS_PREFILL
//! (100000), TENANTS_DURATION_S (60), TENANTS_FIRST_SYNC_TIMEOUT_S (300),
//! TENANTS_MIN_SYNC_PERIOD (1s, the DaemonSet's), TENANTS_AGENT_FLAGS (extra flags, split
//! at spaces; e.g. `--max-service-addresses 0` to let the 5,000 externalIPs through).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant, SystemTime};

use clusterip_agent::conntrack::ctnetlink::{Socket, Tuple, IPPROTO_TCP, IPPROTO_UDP};
use clusterip_agent::model::IpFamily;
use common::*;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn external_ip(i: usize) -> String {
    format!("198.18.{}.{}", 64 + i / 250, i % 250 + 1)
}

/// The big Service's endpoint after `k` changes.
fn big_endpoint(k: usize) -> String {
    format!("198.18.2.{}", 10 + k % 200)
}

/// Small Service `i`'s endpoint after `k` changes.
fn small_endpoint(i: usize, k: usize) -> String {
    let n = i * 7 + k;
    format!("198.18.{}.{}", 4 + (n / 250) % 40, n % 250 + 1)
}

struct Objects {
    svcs: Api<Service>,
    slices: Api<EndpointSlice>,
    proxy: String,
}

impl Objects {
    fn service(&self, name: &str, external_ips: &[String]) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"service.kubernetes.io/service-proxy-name": self.proxy}},
            "spec": {"ports": [{"port": 53, "protocol": "UDP", "targetPort": UDP_PORT}], "externalIPs": external_ips},
        }))
        .expect("service json")
    }

    /// The Service's slice with one endpoint, stamped with the trigger time (now).
    fn slice(&self, svc: &str, ep: &str) -> EndpointSlice {
        let t = humantime::format_rfc3339_nanos(SystemTime::now()).to_string();
        serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{svc}-1"),
                "labels": {"kubernetes.io/service-name": svc, "endpointslice.kubernetes.io/managed-by": "clusterip-bench"},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": t}},
            "addressType": "IPv4",
            "ports": [{"name": "", "port": UDP_PORT, "protocol": "UDP"}],
            "endpoints": [{"addresses": [ep], "conditions": {"ready": true}, "nodeName": "elsewhere"}],
        }))
        .expect("slice json")
    }

    async fn apply_slice(&self, svc: &str, ep: &str) {
        let s = self.slice(svc, ep);
        self.slices.patch(&format!("{svc}-1"), &PatchParams::apply("clusterip-bench").force(), &Patch::Apply(&s)).await.expect("apply endpointslice");
    }
}

/// `conntrack` spy: returns (its directory, the runs file, the agent's PATH).
fn conntrack_spy() -> (std::path::PathBuf, std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(short_name("clusterip-tenants-"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = std::env::var("PATH").unwrap_or_default();
    let real = std::env::split_paths(&path).map(|d| d.join("conntrack")).find(|p| p.is_file());
    let runs = dir.join("conntrack.runs");
    let exec = real.map_or("exit 1".to_string(), |r| format!("exec '{}' \"$@\"", r.display()));
    let script = dir.join("conntrack");
    std::fs::write(&script, format!("#!/bin/sh\necho x >> '{}'\n{exec}\n", runs.display())).expect("write the spy");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let agent_path = format!("{}:{path}", dir.display());
    (dir, runs, agent_path)
}

/// Flows of `vips` (UDP to port 53) DNATed to `ep`, from client source ports `base + i`.
fn dnat_flows(vips: &[IpAddr], ep: &str, base: u32) -> Vec<(u8, Tuple, Tuple)> {
    vips.iter()
        .enumerate()
        .map(|(i, vip)| {
            let n = base + i as u32;
            let client = IpAddr::from(std::net::Ipv4Addr::new(198, 18, 1, 2 + (n / 60000) as u8));
            let sport = 1024 + (n % 60000) as u16;
            (IPPROTO_UDP, Tuple { src: client, dst: *vip, sport, dport: 53 }, Tuple { src: ip(ep), dst: client, sport: UDP_PORT, dport: sport })
        })
        .collect()
}

/// `count` flows nothing flushes: half UDP, half TCP, to 198.18.250.0/24 (no VIP).
fn noise(count: usize) -> Vec<(u8, Tuple, Tuple)> {
    (0..count)
        .map(|i| {
            let client = IpAddr::from(std::net::Ipv4Addr::new(198, 18, 0, 2 + (i / 60000) as u8));
            let dst = IpAddr::from(std::net::Ipv4Addr::new(198, 18, 250, (i % 250) as u8 + 1));
            let orig = Tuple { src: client, dst, sport: 1024 + (i % 60000) as u16, dport: 53 };
            (if i % 2 == 0 { IPPROTO_UDP } else { IPPROTO_TCP }, orig, orig.reversed())
        })
        .collect()
}

/// Histogram `name` from a /metrics text: (upper bound, cumulative count) and the count.
fn histogram(metrics: &str, name: &str) -> (Vec<(f64, f64)>, f64) {
    let prefix = format!("{name}_bucket{{le=\"");
    let mut buckets = Vec::new();
    for l in metrics.lines() {
        if let Some(rest) = l.strip_prefix(&prefix) {
            let (le, v) = rest.split_once("\"} ").unwrap_or(("", ""));
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
            buckets.push((le, v.trim().parse().unwrap_or(0.0)));
        }
    }
    let count = buckets.last().map_or(0.0, |b| b.1);
    (buckets, count)
}

/// Prometheus' histogram_quantile: linear within the bucket.
fn quantile(q: f64, buckets: &[(f64, f64)], count: f64) -> f64 {
    if count == 0.0 {
        return f64::NAN;
    }
    let rank = q * count;
    let mut prev = (0.0, 0.0);
    for &(le, c) in buckets {
        if c >= rank {
            if le.is_infinite() {
                return prev.0;
            }
            return prev.0 + (le - prev.0) * (rank - prev.1) / (c - prev.1).max(f64::MIN_POSITIVE);
        }
        prev = (le, c);
    }
    f64::NAN
}

fn metric(metrics: &str, name: &str) -> f64 {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(f64::NAN)
}

fn vm_hwm_mib(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?.trim().parse::<f64>().ok()).map_or(f64::NAN, |k| k / 1024.0)
}

fn main() {
    let n_ext: usize = env_or("TENANTS_EXTERNAL_IPS", 5000);
    let n_svc: usize = env_or("TENANTS_SERVICES", 1000);
    let prefill: usize = env_or("TENANTS_PREFILL", 100_000);
    let duration = Duration::from_secs(env_or("TENANTS_DURATION_S", 60));
    let first_sync_timeout = Duration::from_secs(env_or("TENANTS_FIRST_SYNC_TIMEOUT_S", 300));
    let min_sync: String = env_or("TENANTS_MIN_SYNC_PERIOD", "1s".to_string());
    let extra: String = env_or("TENANTS_AGENT_FLAGS", String::new());
    let bin = std::env::var("CLUSTERIP_AGENT_BIN").ok().filter(|b| !b.is_empty()).unwrap_or_else(|| env!("CARGO_BIN_EXE_clusterip-agent").to_string());
    eprintln!("tenants: agent {bin}, {n_ext} externalIPs, {n_svc} Services, {prefill} conntrack entries, {duration:?}, flags {extra:?}");

    let rt = runtime();
    let kns = KubeNs::new(rt.clone());
    let topo = Topology::new(0);
    let proxy = short_name("t");
    let o = Objects { svcs: Api::namespaced(kns.client.clone(), &kns.name), slices: Api::namespaced(kns.client.clone(), &kns.name), proxy: proxy.clone() };

    // Objects: the big Service and the small ones, each with its slice.
    let t0 = Instant::now();
    let ext: Vec<String> = (0..n_ext).map(external_ip).collect();
    let big = rt.block_on(o.svcs.create(&PostParams::default(), &o.service("big", &ext))).expect("create the big Service");
    rt.block_on(o.apply_slice("big", &big_endpoint(0)));
    rt.block_on(futures::stream::iter(0..n_svc).for_each_concurrent(16, |i| {
        let o = &o;
        async move {
            o.svcs.create(&PostParams::default(), &o.service(&format!("s{i}"), &[])).await.expect("create Service");
            o.apply_slice(&format!("s{i}"), &small_endpoint(i, 0)).await;
        }
    }));
    eprintln!("tenants: {} objects written in {:.1} s", 2 * (n_svc + 1), t0.elapsed().as_secs_f64());

    // The node's conntrack table, before the agent starts.
    let netns = std::fs::File::open(format!("/run/netns/{}", topo.node.name)).expect("netns");
    let mut ct = Socket::open(Some(&netns)).expect("ctnetlink socket");
    let cip = big.spec.as_ref().and_then(|s| s.cluster_ip.clone()).expect("the big Service's ClusterIP");
    let vips: Vec<IpAddr> = std::iter::once(ip(&cip)).chain(ext.iter().map(|e| ip(e))).collect();
    let t0 = Instant::now();
    let mut made = ct.create(&dnat_flows(&vips, &big_endpoint(0), 0), 3600).expect("create the big Service's entries");
    made += ct.create(&noise(prefill.saturating_sub(vips.len())), 3600).expect("create the other entries");
    eprintln!("tenants: {made} conntrack entries made in {:.1} s", t0.elapsed().as_secs_f64());

    let (spy_dir, runs, path) = conntrack_spy();
    let mut flags = vec!["--metrics-bind-address", "127.0.0.1:0", "--min-sync-period", min_sync.as_str()];
    flags.extend(extra.split_whitespace());
    let start = Instant::now();
    let agent = Agent::start_with_env(&topo.node.name, &KubeNs::kubeconfig(), &proxy, &flags, &[("PATH", path.as_str())]);
    let mut first_sync = None;
    while start.elapsed() < first_sync_timeout {
        if agent.log().contains("sync done") {
            first_sync = Some(start.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let runs_at_first = std::fs::read_to_string(&runs).map_or(0, |s| s.lines().count());
    eprintln!("tenants: first sync {first_sync:?}; conntrack runs so far {runs_at_first}");

    // Churn: one small Service's endpoint per second, the big one's every 10 s, half a
    // second after a small one (arrivals independent of the agent's syncs; then its flows
    // to the new endpoint are made, for the next change to flush).
    let (mut changes, mut big_changes) = (0usize, 0usize);
    let churn = Instant::now();
    let mut k = 0;
    while churn.elapsed() < duration {
        let i = k % n_svc;
        rt.block_on(o.apply_slice(&format!("s{i}"), &small_endpoint(i, k / n_svc + 1)));
        changes += 1;
        if k % 10 == 9 {
            std::thread::sleep((churn + Duration::from_millis(k as u64 * 1000 + 500)).saturating_duration_since(Instant::now()));
            big_changes += 1;
            rt.block_on(o.apply_slice("big", &big_endpoint(big_changes)));
            changes += 1;
            let _ = ct.create(&dnat_flows(&vips, &big_endpoint(big_changes), 10_000 * (big_changes as u32 % 6)), 3600);
        }
        k += 1;
        let next = churn + Duration::from_secs(k as u64);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    // Let the agent program what is queued (bounded), then read its metrics.
    let drain = Instant::now();
    let mut pending_s = f64::NAN;
    while drain.elapsed() < Duration::from_secs(30) {
        let m = agent.metrics();
        let (last, queued) =
            (metric(&m, "clusterip_agent_sync_proxy_rules_last_timestamp_seconds"), metric(&m, "clusterip_agent_sync_proxy_rules_last_queued_timestamp_seconds"));
        if last >= queued {
            pending_s = 0.0;
            break;
        }
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        pending_s = now - last.max(0.0);
        std::thread::sleep(Duration::from_millis(200));
    }
    let m = agent.metrics();
    let (buckets, count) = histogram(&m, "clusterip_agent_network_programming_duration_seconds");
    let within_1s = buckets.iter().find(|(le, _)| *le == 1.0).map_or(f64::NAN, |b| b.1 / count);
    let syncs = metric(&m, "clusterip_agent_sync_proxy_rules_duration_seconds_count");
    let (sync_buckets, sync_count) = histogram(&m, "clusterip_agent_sync_partial_proxy_rules_duration_seconds");
    let conntrack_runs = std::fs::read_to_string(&runs).map_or(0, |s| s.lines().count());
    // Entries still DNATed to an endpoint the big Service no longer has, once the last
    // flush had up to 30 s (the agent's rounds run beside its syncs).
    let current = ip(&big_endpoint(big_changes));
    let vip_set: std::collections::HashSet<IpAddr> = vips.iter().copied().collect();
    let mut stale_count = || {
        let mut stale = 0;
        let _ = ct.dump_all(IpFamily::V4, |e| {
            if e.proto == IPPROTO_UDP && e.orig.dport == 53 && e.reply.src != current && e.reply.src != e.orig.dst && vip_set.contains(&e.orig.dst) {
                stale += 1;
            }
        });
        stale
    };
    let flush_wait = Instant::now();
    let mut stale = stale_count();
    while stale > 0 && flush_wait.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(200));
        stale = stale_count();
    }
    let m = agent.metrics();
    let (flush_buckets, flush_count) = histogram(&m, "clusterip_agent_conntrack_flush_duration_seconds");
    let mut by_le = BTreeMap::new();
    for (le, c) in &buckets {
        if *le <= 5.0 {
            by_le.insert(format!("{le}"), *c);
        }
    }
    println!(
        "RESULT tenants external_ips={n_ext} services={n_svc} prefill={made} duration_s={} min_sync={min_sync} flags={:?} first_sync_s={} changes={changes} big_changes={big_changes} \
         programmed={count} p50_s={:.3} p99_s={:.3} within_1s={:.4} pending_at_end_s={pending_s:.1} syncs={syncs} partial_sync_p99_s={:.3} \
         conntrack_processes={conntrack_runs} conntrack_processes_per_sync={:.2} flushed_entries={} flush_failures={} flush_rounds={flush_count} \
         flush_round_p99_s={:.3} stale_entries_left={stale} vmhwm_mib={:.0}",
        duration.as_secs(),
        extra,
        first_sync.map_or("none".to_string(), |d| format!("{:.1}", d.as_secs_f64())),
        quantile(0.5, &buckets, count),
        quantile(0.99, &buckets, count),
        within_1s,
        quantile(0.99, &sync_buckets, sync_count),
        conntrack_runs as f64 / syncs.max(1.0),
        metric(&m, "clusterip_agent_conntrack_entries_deleted_total"),
        metric(&m, "clusterip_agent_conntrack_flush_failures_total"),
        quantile(0.99, &flush_buckets, flush_count),
        vm_hwm_mib(agent.pid()),
    );
    eprintln!("tenants: programming-latency buckets (cumulative, le ≤ 5 s) {by_le:?}");
    drop(agent);
    let _ = std::fs::remove_dir_all(spy_dir);
}
