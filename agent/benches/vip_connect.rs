//! Per-connection cost through a VIP with 1 and with 10k Services programmed: the first
//! packet of a connection does one `service-ips` map lookup whatever the Service count, so
//! connection setup should not slow down with more Services. Uses the test topology (node,
//! client and backend namespaces) and the nftables dataplane directly (no cluster).
//!
//! Prints `RESULT vip_connect_<n>_services median_us=<> p90_us=<> ratio_to_1=<>`: per-connection
//! time (connect + read the backend's name + close), median and p90, best of two rounds;
//! rounds alternate 1 and 10k Services so both share the machine's noise.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use clusterip_agent::model::service::ServicePort;
use clusterip_agent::model::state::DesiredPort;
use clusterip_agent::model::topology::Categorized;
use clusterip_agent::model::{Endpoint, NamespacedName, Protocol};
use clusterip_agent::netns::Executor;
use clusterip_agent::nftables::render::RenderOptions;
use clusterip_agent::nftables::NftablesProxier;
use clusterip_agent::proxier::{Proxier, SyncBatch};
use common::{ip, sa, Topology, TCP_PORT};

fn service(i: usize, eps: Vec<Endpoint>) -> (NamespacedName, Vec<DesiredPort>) {
    let vip = ip(&format!("198.19.{}.{}", i / 250, i % 250 + 1));
    let sp = ServicePort::cluster_ip("bench", &format!("s{i}"), "", Protocol::Tcp, vip, 80);
    let has_any = !eps.is_empty();
    (NamespacedName::new("bench", format!("s{i}")), vec![DesiredPort { port: sp, v4: Categorized { cluster: eps, local: vec![], has_any }, v6: Categorized::default() }])
}

fn measure(topo: &Topology, vip: &str, n: usize) -> (f64, f64) {
    let addr = sa(vip, 80);
    // One thread in the client namespace does all the connections (no per-connection setns).
    common::in_netns(&topo.client.name, || {
        let connect = || {
            use std::io::Read;
            let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect");
            let mut out = String::new();
            s.read_to_string(&mut out).expect("read");
        };
        for _ in 0..50 {
            connect();
        }
        let mut t: Vec<f64> = (0..n)
            .map(|_| {
                let start = Instant::now();
                connect();
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        t.sort_by(|a, b| a.total_cmp(b));
        (t[n / 2], t[n * 9 / 10])
    })
}

fn main() {
    let topo = Topology::new(2);
    let exec = Executor::in_netns(&topo.node.name).expect("netns");
    let mut p = NftablesProxier::new(exec, RenderOptions::default(), 50_000);
    let backends = vec![Endpoint::ready(ip(&Topology::backend_ip(0)), TCP_PORT), Endpoint::ready(ip(&Topology::backend_ip(1)), TCP_PORT)];
    // The measured Service is the last one in the map order; the others point at dummy endpoints.
    let dummy = |i: usize| (0..10).map(|j| Endpoint::ready(ip(&format!("198.18.{}.{}", 100 + (i * 10 + j) / 250 % 100, (i * 10 + j) % 250 + 1)), 8080)).collect();
    let conns = 2000;
    let mut medians: std::collections::BTreeMap<usize, Vec<(f64, f64)>> = Default::default();
    for round in 0..4 {
        let total = if round % 2 == 0 { 1usize } else { 10_000 };
        let mut services: Vec<_> = (1..total).map(|i| service(i, dummy(i))).collect();
        services.push(service(0, backends.clone()));
        p.sync(&SyncBatch { full: true, services }).expect("sync");
        medians.entry(total).or_default().push(measure(&topo, "198.19.0.1", conns));
    }
    let med = |v: &Vec<(f64, f64)>| {
        let mut m: Vec<f64> = v.iter().map(|x| x.0).collect();
        m.sort_by(|a, b| a.total_cmp(b));
        let p90 = v.iter().map(|x| x.1).fold(f64::MAX, f64::min);
        (m[0], p90)
    };
    let (base, _) = med(&medians[&1]);
    for (total, v) in &medians {
        let (m, p90) = med(v);
        println!("RESULT vip_connect_{total}_services median_us={m:.1} p90_us={p90:.1} ratio_to_1={:.2}", m / base);
    }
}
