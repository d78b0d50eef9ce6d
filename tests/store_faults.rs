//! Faults, for both backends: the part the backend talks to (etcd for the etcd backend, the
//! kube-apiserver for the IPAddress backend — it rides out a short etcd outage by itself)
//! stopped and started again in the middle of a concurrent run. Callers get errors while it
//! is down; nothing is handed out twice; every allocation a caller was told about is still
//! recorded afterwards.
//!
//! Each test runs on a control plane of its own (it breaks it), removed at the end.

mod store_common;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clusterip_test_support::ControlPlane;

use store_common::{collect, spawn_allocators, Backend, Fixture};

async fn restart_mid_run(backend: Backend, component: &str, tag: &str, cidr: &str) {
    let cp = Arc::new(ControlPlane::private(tag));
    let fx = Fixture::on(cp.clone(), backend, &[cidr]).await;
    // Short request timeouts so callers see the outage quickly.
    let extra = ["--etcd-request-timeout", "2s", "--etcd-dial-timeout", "2s"];
    let children = spawn_allocators(&fx, 4, 1500, 8, &extra);

    // Let the run get going: wait until the backend holds some records.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let store = fx.open().await;
        if store.allocated().await.map(|a| a.len()).unwrap_or(0) >= 200 {
            break;
        }
        assert!(Instant::now() < deadline, "allocators made no progress in 60s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cp.stop(component);
    // Hold it down long enough for in-flight requests to fail (an outage has a length; this
    // wait is the fault being injected, not synchronisation).
    tokio::time::sleep(Duration::from_secs(3)).await;
    cp.start(component);

    let runs = collect(children);
    let failures: usize = runs.iter().map(|r| r.stderr.matches("error:").count()).sum();
    let mut acknowledged = BTreeSet::new();
    for run in &runs {
        for ip in &run.ips {
            assert!(acknowledged.insert(*ip), "{ip} handed out twice");
        }
    }
    assert!(failures > 0, "no caller saw the outage; the test did not test anything");
    assert!(acknowledged.len() >= 1000, "only {} allocations succeeded", acknowledged.len());

    // Nothing acknowledged was lost. (Addresses whose acknowledgement was lost with the
    // outage may be recorded too: leaks for repair, never duplicates.)
    let deadline = Instant::now() + Duration::from_secs(60);
    let recorded: BTreeSet<IpAddr> = loop {
        match tokio::time::timeout(Duration::from_secs(10), fx.open()).await {
            Ok(store) => break store.allocated().await.expect("read records").into_iter().collect(),
            Err(_) => assert!(Instant::now() < deadline, "backend did not come back within 60s"),
        }
    };
    let lost: Vec<_> = acknowledged.difference(&recorded).collect();
    assert!(lost.is_empty(), "{} acknowledged allocations lost, e.g. {:?}", lost.len(), &lost[..lost.len().min(5)]);
    eprintln!(
        "{backend:?}: {} acknowledged, {failures} errors during the outage, {} recorded ({} leaked)",
        acknowledged.len(),
        recorded.len(),
        recorded.len() - acknowledged.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_survives_an_etcd_restart() {
    restart_mid_run(Backend::Etcd, "etcd", "fault-etcd", "198.18.192.0/19").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipaddress_backend_survives_an_apiserver_restart() {
    restart_mid_run(Backend::IpAddress, "kube-apiserver", "fault-ipaddress", "198.18.224.0/19").await;
}
