//! The nftables dataplane alone (no API server, no kube-proxy): full sync of N synthetic
//! Services × 10 endpoints into a fresh network namespace, then one changed Service.
//! For sizes where loading the API server is too slow for `nft_sync`.
//!
//! `cargo bench -p clusterip-agent --bench synthetic_sync -- 10000,50000`
//! prints `RESULT synthetic_full_sync_<n>x10 ours_s=<>`, `RESULT synthetic_one_change_at_<n> ours_s=<>`
//! (the first partial sync: all 10 endpoints of one Service replaced, the count unchanged —
//! an element-only transaction, written as a netlink batch — then the median of 9 more such
//! changes as `median_s`; `SYNTHETIC_CHANGES=k` makes it k) and `RESULT synthetic_count_change_at_<n> ours_s=<>` (one Service goes
//! from 10 to 11 endpoints and back: its rule changes, so `nft -f` runs; median of 5).
//! With `CLUSTERIP_AGENT_NFT_ONLY=1` every transaction goes through `nft -f`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Instant;

use clusterip_agent::model::service::ServicePort;
use clusterip_agent::model::state::DesiredPort;
use clusterip_agent::model::topology::Categorized;
use clusterip_agent::model::{Endpoint, NamespacedName, Protocol};
use clusterip_agent::netns::Executor;
use clusterip_agent::nftables::render::RenderOptions;
use clusterip_agent::nftables::{NftablesProxier, DEFAULT_MAX_OPS};
use clusterip_agent::proxier::{Proxier, SyncBatch};
use common::ip;

fn service(i: usize, generation: usize) -> (NamespacedName, Vec<DesiredPort>) {
    service_with(i, generation, 10)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn service_with(i: usize, generation: usize, endpoints: usize) -> (NamespacedName, Vec<DesiredPort>) {
    let vip = ip(&format!("198.19.{}.{}", i / 250, i % 250 + 1));
    let sp = ServicePort::cluster_ip("bench", &format!("s{i}"), "http", Protocol::Tcp, vip, 80);
    let eps: Vec<Endpoint> = (0..endpoints)
        .map(|j| {
            let n = 1024 + ((i * 10 + j + generation * 7) % 120_000);
            Endpoint::ready(ip(&format!("198.{}.{}.{}", 18 + (n >> 16), (n >> 8) & 255, n & 255)), 8080)
        })
        .collect();
    (NamespacedName::new("bench", format!("s{i}")), vec![DesiredPort { port: sp, v4: Categorized { cluster: eps, local: vec![], has_any: true }, v6: Categorized::default() }])
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "1000,10000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    for n in sizes {
        let ns = common::Netns::new("syn");
        let exec = Executor::in_netns(&ns.name).expect("netns");
        let mut p = NftablesProxier::new(exec, RenderOptions::default(), DEFAULT_MAX_OPS);
        let services: Vec<_> = (0..n).map(|i| service(i, 0)).collect();
        let t = Instant::now();
        let r = p.sync(&SyncBatch { full: true, services }).expect("full sync");
        println!(
            "RESULT synthetic_full_sync_{n}x10 ours_s={:.3} nft_s={:.3} transactions={} operations={}",
            t.elapsed().as_secs_f64(),
            r.tool_seconds,
            r.transactions,
            r.operations
        );
        // SYNTHETIC_CHANGES=<k> makes it k changes (for profiling the partial sync).
        let changes: usize = std::env::var("SYNTHETIC_CHANGES").ok().and_then(|v| v.parse().ok()).unwrap_or(10).max(2);
        // As the agent's sync loop after a full sync; and its next sync comes at least
        // --min-sync-period (1 s) after the previous one.
        clusterip_component_base::memory::release_freed();
        std::thread::sleep(std::time::Duration::from_secs(1));
        let mut times = Vec::new();
        let mut netlink = 0;
        let mut first_kernel_s = 0.0;
        for g in 1..=changes {
            let t = Instant::now();
            let r = p.sync(&SyncBatch { full: false, services: vec![service(n / 2, g % 2)] }).expect("partial sync");
            times.push(t.elapsed().as_secs_f64());
            netlink += r.netlink_transactions;
            if g == 1 {
                first_kernel_s = r.tool_seconds;
            }
        }
        println!(
            "RESULT synthetic_one_change_at_{n} ours_s={:.4} kernel_s={first_kernel_s:.4} median_s={:.4} netlink_transactions={netlink}/{changes}",
            times[0],
            median(times[1..].to_vec())
        );
        let mut times = Vec::new();
        let mut netlink = 0;
        for k in 0..changes.min(6).max(changes / 10) {
            let t = Instant::now();
            let r = p.sync(&SyncBatch { full: false, services: vec![service_with(n / 2, 0, 10 + (k + 1) % 2)] }).expect("partial sync");
            times.push(t.elapsed().as_secs_f64());
            netlink += r.netlink_transactions;
        }
        let (count, med) = (times.len(), median(times[1..].to_vec()));
        println!("RESULT synthetic_count_change_at_{n} ours_s={med:.4} netlink_transactions={netlink}/{count}");
    }
}
