//! Leader election between real controller replicas against the real kube-apiserver, with
//! faults put between one replica and the apiserver by a TCP proxy this test controls
//! ([`Proxy`]: forward, black-hole, refuse) — nothing touches the machine's network. The
//! replica's kubeconfig names the proxy; the apiserver's serving certificate is for
//! 127.0.0.1, so TLS verifies through it.
//!
//! What is judged is what the replicas say themselves: their "leadership changed" log lines
//! (the reconcilers started / stopped, with timestamps from the one machine clock) and
//! their `leader_election_master_status` gauge. Timings are short (lease 6 s, renew
//! deadline 4 s, retry 1 s) but only orderings and generous bounds are asserted: the tests
//! must hold on a loaded 2-core machine.
//!
//! Ranges: slice 10 of controller_e2e's scheme (`Slice`, tests/controller_e2e/harness.rs: 198.19.80.0/21, fd00:10:96::5000/117),
//! which no other test uses; no webhook is registered, so nothing is ever allocated there.

mod controller_common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use clusterip_test_support::{control_plane, local_get, owned_temp_dir, unique_name, within, ControlPlane};
use controller_common::{metric, Controller};

const RANGES: &str = "198.19.80.0/21,fd00:10:96::5000/117";
const NAMESPACE: &str = "default";
/// Short timings: lease 6 s > renew deadline 4 s > 1.2 × retry 1 s.
const SHORT: [&str; 6] = ["--leader-elect-lease-duration", "6s", "--leader-elect-renew-deadline", "4s", "--leader-elect-retry-period", "1s"];

/// One scenario at a time: each measures orderings on a busy machine, and four controller
/// processes at once would measure the machine.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Pass bytes both ways.
    Forward,
    /// Hold every connection open and forward nothing (new ones too): requests hang.
    BlackHole,
    /// Close every connection, and each new one as soon as it is accepted.
    Refuse,
}

/// A TCP proxy on 127.0.0.1 in front of the kube-apiserver, and a kubeconfig naming it.
struct Proxy {
    mode: watch::Sender<Mode>,
    kubeconfig: PathBuf,
    dir: PathBuf,
}

impl Proxy {
    async fn start(cp: &ControlPlane) -> Proxy {
        let upstream = cp.var("CLUSTERIP_APISERVER").to_string();
        let upstream_port: u16 = upstream.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("apiserver port in CLUSTERIP_APISERVER");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy listener");
        let port = listener.local_addr().expect("proxy address").port();
        let (mode, rx) = watch::channel(Mode::Forward);
        tokio::spawn(serve(listener, upstream_port, rx));
        let text = std::fs::read_to_string(cp.kubeconfig()).expect("read the kubeconfig");
        let line = format!("server: {upstream}");
        assert!(text.contains(&line), "the kubeconfig does not name {upstream}:\n{text}");
        let dir = owned_temp_dir("leader-proxy");
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(&kubeconfig, text.replace(&line, &format!("server: https://127.0.0.1:{port}"))).expect("write the proxy's kubeconfig");
        Proxy { mode, kubeconfig, dir }
    }

    fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn serve(listener: TcpListener, upstream: u16, mode: watch::Receiver<Mode>) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else { continue };
        let mut mode = mode.clone();
        tokio::spawn(async move {
            let now = *mode.borrow_and_update();
            match now {
                Mode::Refuse => return,
                Mode::BlackHole => return hold(mode, (inbound, None)).await,
                Mode::Forward => {}
            }
            let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", upstream)).await else { return };
            let black_holed = tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => false,
                m = async { mode.wait_for(|m| *m != Mode::Forward).await.map(|m| *m) } => m.ok() == Some(Mode::BlackHole),
            };
            if black_holed {
                hold(mode, (inbound, Some(outbound))).await;
            }
        });
    }
}

/// Keep the sockets open, unread, until the proxy refuses (or the test ends).
async fn hold(mut mode: watch::Receiver<Mode>, sockets: (TcpStream, Option<TcpStream>)) {
    let _ = mode.wait_for(|m| *m == Mode::Refuse).await;
    drop(sockets);
}

/// A controller replica (identity `replica-<id>`) of the election `name`.
fn replica(cp: &ControlPlane, name: &str, id: &str, kubeconfig: &Path, timings: &[&str]) -> Controller {
    let mut args = controller_common::client_auth_args(cp);
    args.extend(controller_common::controller_args(cp, "etcd", RANGES, name, NAMESPACE, &format!("replica-{id}"), kubeconfig));
    args.extend(["--etcd-address-pool", "0", "--repair-interval", "0"].iter().chain(timings).map(|s| s.to_string()));
    Controller::start(args)
}

/// The replica's "leadership changed" lines: (when, leading).
fn transitions(c: &Controller) -> Vec<(Timestamp, bool)> {
    c.log()
        .lines()
        .filter(|l| l.contains("leadership changed"))
        .map(|l| {
            let when = l.split_whitespace().next().and_then(|w| w.parse().ok()).unwrap_or_else(|| panic!("no timestamp on {l:?}"));
            (when, l.contains("leading=true"))
        })
        .collect()
}

/// Poll `f` every 100 ms until it holds; fail after `limit` with `what` and the logs.
async fn wait_until(what: &str, limit: Duration, logs: &[&Controller], mut f: impl FnMut() -> bool) {
    let held = within(limit, Duration::from_millis(100), || {
        let held = f();
        async move { held.then_some(()) }
    })
    .await;
    if held.is_none() {
        let logs: Vec<String> = logs.iter().map(|c| c.log()).collect();
        panic!("not within {limit:?}: {what}\n{}", logs.join("\n---\n"));
    }
}

/// The replica's `leader_election_master_status` for the Lease.
async fn master_status(c: &Controller, name: &str) -> Option<f64> {
    let (_, body) = local_get(c.metrics_port, "/metrics").await?;
    metric(&body, &format!("leader_election_master_status{{name=\"{NAMESPACE}/{name}\"}}"))
}

async fn holder(leases: &Api<Lease>, name: &str) -> Option<String> {
    leases.get_opt(name).await.ok().flatten().and_then(|l| l.spec).and_then(|s| s.holder_identity)
}

/// Replica a (through the proxy) leads, replica b (direct) runs as a candidate and sees
/// the Lease held by a.
async fn a_leads_b_waits(cp: &ControlPlane, name: &str, proxy: &Proxy, timings: &[&str]) -> (Controller, Controller, Api<Lease>) {
    let leases: Api<Lease> = Api::namespaced(cp.client().await, NAMESPACE);
    let a = replica(cp, name, "a", &proxy.kubeconfig, timings);
    wait_until("replica-a leads", Duration::from_secs(120), &[&a], || transitions(&a).iter().any(|t| t.1)).await;
    let b = replica(cp, name, "b", &cp.kubeconfig(), timings);
    let (candidate, lease_api) = (&b, &leases);
    let waiting = within(Duration::from_secs(120), Duration::from_millis(100), move || async move {
        (master_status(candidate, name).await == Some(0.0) && holder(lease_api, name).await.as_deref() == Some("replica-a")).then_some(())
    })
    .await;
    assert!(waiting.is_some(), "replica-b not running as a candidate of replica-a's Lease within 120s:\n{}", b.log());
    assert_eq!(master_status(&a, name).await, Some(1.0), "replica-a's gauge");
    (a, b, leases)
}

async fn delete_lease(leases: &Api<Lease>, name: &str) {
    let _ = leases.delete(name, &DeleteParams::default()).await;
}

/// Two leaders never act at once: replica a's apiserver connection is black-holed (its
/// requests hang, nothing errors); a stops its reconcilers before b starts its own, and b
/// takes over within a bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_leader_steps_down_before_another_takes_over() {
    let _one = ONE_AT_A_TIME.lock().await;
    let cp = control_plane();
    let name = unique_name("leader-blackhole");
    let proxy = Proxy::start(&cp).await;
    let (a, b, leases) = a_leads_b_waits(&cp, &name, &proxy, &SHORT).await;

    let cut = Timestamp::now();
    proxy.set(Mode::BlackHole);
    wait_until("replica-b leads after replica-a was black-holed", Duration::from_secs(120), &[&a, &b], || transitions(&b).iter().any(|t| t.1)).await;

    let (ta, tb) = (transitions(&a), transitions(&b));
    let a_stopped = ta.iter().find(|t| !t.1).map(|t| t.0).unwrap_or_else(|| panic!("replica-a never stopped leading: {ta:?}\n{}", a.log()));
    let b_started = tb.iter().find(|t| t.1).map(|t| t.0).unwrap_or_else(|| panic!("{tb:?}"));
    eprintln!("black hole at {cut}; replica-a stopped leading at {a_stopped}; replica-b started at {b_started}");
    assert!(a_stopped > cut, "replica-a stopped leading before the fault ({a_stopped} < {cut}): {ta:?}");
    assert!(a_stopped < b_started, "two leaders at once: replica-b started leading at {b_started}, replica-a stopped only at {a_stopped}");
    // Failover bound: lease 6 s + twice retry × 1.2 ≈ 8.4 s in theory; 60 s on a loaded box.
    let took = b_started.duration_since(cut);
    assert!(took < k8s_openapi::jiff::SignedDuration::from_secs(60), "replica-b took {took:?} to take over");
    // And replica-a, still black-holed, does not come back.
    assert_eq!(ta.len(), 2, "replica-a flapped: {ta:?}");
    assert_eq!(master_status(&a, &name).await, Some(0.0), "replica-a's gauge");
    assert_eq!(master_status(&b, &name).await, Some(1.0), "replica-b's gauge");
    assert_eq!(holder(&leases, &name).await.as_deref(), Some("replica-b"));
    assert!(a.log().contains("failed to renew lease"), "{}", a.log());
    delete_lease(&leases, &name).await;
}

/// One transient error does not flap: replica a's connection is refused until a has seen a
/// renewal fail, then restored; a leads throughout and b never starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_renewal_does_not_change_leadership() {
    let _one = ONE_AT_A_TIME.lock().await;
    let cp = control_plane();
    let name = unique_name("leader-transient");
    let proxy = Proxy::start(&cp).await;
    let (a, b, leases) = a_leads_b_waits(&cp, &name, &proxy, &SHORT).await;
    let transitions_before = leases.get(&name).await.expect("read the Lease").spec.and_then(|s| s.lease_transitions);

    proxy.set(Mode::Refuse);
    wait_until("replica-a sees a renewal fail", Duration::from_secs(30), &[&a], || a.log().contains("failed to renew lease")).await;
    proxy.set(Mode::Forward);
    let restored = Timestamp::now();

    // Replica-a renews again, several times (renewTime 3 s past the restore).
    let (lease_api, lease, ra, rb) = (&leases, &name, &a, &b);
    let renewed = within(Duration::from_secs(60), Duration::from_millis(200), move || async move {
        let spec = lease_api.get(lease).await.expect("read the Lease").spec.unwrap_or_default();
        assert_eq!(spec.holder_identity.as_deref(), Some("replica-a"), "the Lease changed hands:\n{}\n---\n{}", ra.log(), rb.log());
        spec.renew_time.is_some_and(|t| t.0.duration_since(restored) > k8s_openapi::jiff::SignedDuration::from_secs(3)).then_some(spec.lease_transitions)
    })
    .await;
    let renewed = renewed.unwrap_or_else(|| panic!("replica-a did not renew within 60s of the restore:\n{}", a.log()));
    assert_eq!(renewed, transitions_before);
    let (ta, tb) = (transitions(&a), transitions(&b));
    assert!(ta.len() == 1 && ta[0].1, "replica-a's leadership changed on one refused renewal: {ta:?}\n{}", a.log());
    assert!(tb.is_empty(), "replica-b led: {tb:?}");
    assert_eq!(master_status(&a, &name).await, Some(1.0));
    assert_eq!(master_status(&b, &name).await, Some(0.0));
    delete_lease(&leases, &name).await;
}

/// SIGTERM on the leader: it stops its reconcilers, then releases the Lease, and the other
/// replica takes over at once — well before the lease duration (30 s here) a crash costs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_with_sigterm_hands_over_at_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let cp = control_plane();
    let name = unique_name("leader-release");
    let proxy = Proxy::start(&cp).await;
    let long = ["--leader-elect-lease-duration", "30s", "--leader-elect-renew-deadline", "20s", "--leader-elect-retry-period", "2s"];
    let (mut a, b, leases) = a_leads_b_waits(&cp, &name, &proxy, &long).await;

    let term = Timestamp::now();
    a.signal(libc::SIGTERM);
    wait_until("replica-b leads after replica-a's SIGTERM", Duration::from_secs(120), &[&a, &b], || transitions(&b).iter().any(|t| t.1)).await;
    let (ta, tb) = (transitions(&a), transitions(&b));
    let a_stopped = ta.iter().find(|t| !t.1).map(|t| t.0).unwrap_or_else(|| panic!("replica-a never stopped leading: {ta:?}\n{}", a.log()));
    let b_started = tb.iter().find(|t| t.1).map(|t| t.0).unwrap_or_else(|| panic!("{tb:?}"));
    eprintln!("SIGTERM at {term}; replica-a stopped leading at {a_stopped}; replica-b started at {b_started}");
    assert!(a_stopped < b_started, "two leaders at once: replica-b started at {b_started}, replica-a stopped at {a_stopped}");
    // Without the release replica-b waits the 30 s lease duration after its last sighting of
    // a renewal (≥ 27.6 s after the signal); with it, its next look (≤ 2.4 s). 20 s apart.
    let took = b_started.duration_since(term);
    assert!(took < k8s_openapi::jiff::SignedDuration::from_secs(20), "replica-b took {took:?}: the Lease was not released\n{}", a.log());
    assert!(a.log().contains("released the leader lease"), "{}", a.log());
    let status = a.wait_exit(Duration::from_secs(120)).expect("replica-a exits after SIGTERM");
    assert!(status.success(), "replica-a exited with {status}:\n{}", a.log());
    delete_lease(&leases, &name).await;
}
