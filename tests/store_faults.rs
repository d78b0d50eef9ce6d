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

use clusterip::store::etcd::EtcdStore;
use clusterip::store::AllocationStore as _;
use clusterip_test_support::{eventually_ok, eventually_some, ControlPlane};

use store_common::{collect, spawn_allocators, Backend, Fixture};

async fn restart_mid_run(backend: Backend, component: &str, tag: &str, cidr: &str) {
    let cp = Arc::new(ControlPlane::private(tag));
    let fx = Fixture::on(cp.clone(), backend, &[cidr]).await;
    // Short request timeouts so callers see the outage quickly.
    let extra = ["--etcd-request-timeout", "2s", "--etcd-dial-timeout", "2s"];
    let children = spawn_allocators(&fx, 4, 1500, 8, &extra);

    // Let the run get going: wait until the backend holds some records.
    let fixture = &fx;
    eventually_some("the allocators make progress (200 records)", Duration::from_secs(60), Duration::from_millis(50), move || async move {
        let store = fixture.open().await;
        (store.allocated().await.map(|a| a.len()).unwrap_or(0) >= 200).then_some(())
    })
    .await;
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
    // (No pause between attempts: each times out on its own.)
    let store = eventually_some("the backend comes back", Duration::from_secs(60), Duration::ZERO, move || async move {
        tokio::time::timeout(Duration::from_secs(10), fixture.open()).await.ok()
    })
    .await;
    let recorded: BTreeSet<IpAddr> = store.allocated().await.expect("read records").into_iter().collect();
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

// ---------------------------------------------------------------- a three-member etcd

/// The members of a `CLUSTERIP_ETCD_MEMBERS=3` control plane, in the order of its
/// `CLUSTERIP_ETCD_ENDPOINTS`.
const MEMBERS: [&str; 3] = ["etcd", "etcd-2", "etcd-3"];

/// What one member says of itself through etcd's maintenance API (Status).
#[derive(Clone, Copy, Debug)]
struct MemberStatus {
    id: u64,
    leader: u64,
}

/// Each member's status (`None`: no answer within 2 s — stopped, frozen, starting).
async fn statuses(endpoints: &[String]) -> Vec<Option<MemberStatus>> {
    let ask = |ep: String| async move {
        let opts = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_secs(2)).with_timeout(Duration::from_secs(2));
        let status = async {
            let mut c = etcd_client::Client::connect([ep], Some(opts)).await.ok()?;
            let s = c.status().await.ok()?;
            Some(MemberStatus { id: s.header()?.member_id(), leader: s.leader() })
        };
        tokio::time::timeout(Duration::from_secs(3), status).await.ok().flatten()
    };
    futures::future::join_all(endpoints.iter().cloned().map(ask)).await
}

/// The member that leads, by etcd's own account: the leader named by at least two members
/// (a quorum of three), which answers itself and is not `except`. Waits up to 120 s.
async fn wait_for_leader(endpoints: &[String], except: Option<usize>) -> usize {
    eventually_ok(&format!("an agreed etcd leader (except {except:?})"), Duration::from_secs(120), Duration::from_millis(200), move || async move {
        let st = statuses(endpoints).await;
        let answering: Vec<MemberStatus> = st.iter().flatten().copied().collect();
        let agreed = answering.iter().map(|s| s.leader).find(|&l| l != 0 && answering.iter().filter(|s| s.leader == l).count() >= 2);
        if let Some(l) = agreed {
            if let Some(i) = st.iter().position(|s| s.map(|s| s.id) == Some(l)) {
                if Some(i) != except {
                    return Ok(i);
                }
            }
        }
        Err(format!("{st:?}"))
    })
    .await
}

/// One batch of allocator processes: when it ran, what it was told.
struct Batch {
    started: Instant,
    ended: Instant,
    runs: Vec<store_common::Run>,
}

/// Allocator processes, batch after batch until stopped: two with the etcd address pool
/// (64 addresses), two without, 50 dynamic allocations each at concurrency 4, with short
/// etcd timeouts so that callers see a fault quickly.
struct Burst {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Batch>>,
}

impl Burst {
    fn start(fx: Arc<Fixture>) -> Burst {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        // The children are spawned from this thread (die_with_parent: they die with it), and
        // it outlives them: it waits for each batch.
        let thread = std::thread::spawn(move || {
            let timeouts = ["--etcd-request-timeout", "2s", "--etcd-dial-timeout", "2s"];
            let pooled = [&timeouts[..], &["--etcd-address-pool", "64"]].concat();
            let mut batches = Vec::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let started = Instant::now();
                let mut children = spawn_allocators(&fx, 2, 50, 4, &timeouts);
                children.extend(spawn_allocators(&fx, 2, 50, 4, &pooled));
                let runs = collect(children);
                batches.push(Batch { started, ended: Instant::now(), runs });
            }
            batches
        });
        Burst { stop, thread }
    }

    fn finish(self) -> Vec<Batch> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("burst thread")
    }
}

/// One store opened at the start and never reopened, allocating one address every 20 ms
/// (load shaping, not synchronisation) until stopped: what it was told, and when.
#[derive(Default)]
struct ProbeLog {
    acknowledged: Vec<(Instant, IpAddr)>,
    errors: Vec<(Instant, String)>,
}

struct Probe {
    log: Arc<std::sync::Mutex<ProbeLog>>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Box<dyn clusterip::store::AllocationStore>>,
}

impl Probe {
    async fn start(fx: &Fixture, pool_size: usize) -> Probe {
        let cfg = clusterip::store::etcd::EtcdConfig {
            pool_size,
            request_timeout: Duration::from_secs(2),
            dial_timeout: Duration::from_secs(2),
            ..fx.etcd_config()
        };
        let store: Box<dyn clusterip::store::AllocationStore> =
            Box::new(clusterip::store::etcd::EtcdStore::open(&cfg, fx.cidrs.clone()).await.expect("open the probe's store"));
        let log = Arc::new(std::sync::Mutex::new(ProbeLog::default()));
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let shared = log.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stopped.changed() => break,
                    _ = tick.tick() => {}
                }
                let r = store.allocate_next(clusterip::cidr::Family::IPv6, None).await;
                let mut log = shared.lock().expect("probe log");
                match r {
                    Ok(ip) => log.acknowledged.push((Instant::now(), ip)),
                    Err(e) => log.errors.push((Instant::now(), e.to_string())),
                }
            }
            store
        });
        Probe { log, stop, task }
    }

    fn successes_since(&self, t: Instant) -> usize {
        self.log.lock().expect("probe log").acknowledged.iter().filter(|(at, _)| *at > t).count()
    }
}

/// Wait until every probe has been answered `n` times since `t` (the store recovered
/// without being reopened); the time it took.
async fn wait_probes_succeed(probes: &[&Probe], t: Instant, n: usize, what: &str) -> Duration {
    eventually_ok(&format!("{what}: every store recovers"), Duration::from_secs(120), Duration::from_millis(50), || {
        let recovered = !probes.iter().any(|p| p.successes_since(t) < n);
        let state = (!recovered).then(|| {
            format!(
                "successes since: {:?}; last errors: {:?}",
                probes.iter().map(|p| p.successes_since(t)).collect::<Vec<_>>(),
                probes.iter().map(|p| p.log.lock().expect("probe log").errors.last().cloned().map(|e| e.1)).collect::<Vec<_>>()
            )
        });
        async move { state.map_or(Ok(()), Err) }
    })
    .await;
    t.elapsed()
}

/// Reads through a freshly opened store that failed (see `wait_progress`).
static FRESH_READ_FAILURES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Wait until etcd's records hold `n` more allocations than now (progress in the burst),
/// reading through a fresh store each time.
async fn wait_progress(fx: &Fixture, n: usize, what: &str) {
    // (A read that fails — a member down, a connection refused — counts as no progress.)
    let count = || async {
        let read = async { EtcdStore::open(&fx.etcd_config(), fx.cidrs.clone()).await.map_err(|e| e.to_string())?.allocated().await.map_err(|e| e.to_string()) };
        match tokio::time::timeout(Duration::from_secs(10), read).await {
            Ok(Ok(a)) => a.len(),
            Ok(Err(e)) => {
                if FRESH_READ_FAILURES.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 3 {
                    eprintln!("progress read through a fresh store failed: {e}");
                }
                0
            }
            Err(_) => 0,
        }
    };
    let base = count().await;
    let count = &count;
    eventually_some(&format!("{what}: {n} more allocations recorded"), Duration::from_secs(120), Duration::from_millis(100), move || async move {
        (count().await >= base + n).then_some(())
    })
    .await
}

/// A fault injected and the time it lasted, for the figures.
struct Fault {
    name: String,
    from: Instant,
    to: Instant,
    recovered_in: Duration,
}

/// The etcd backend against a three-member etcd, as users run it: the leader SIGKILLed
/// mid-burst and restarted with its data, the (new) leader frozen with SIGSTOP for 30 s, and
/// a follower stopped and restarted with its data — while allocator processes (with the
/// address pool and without) and two long-lived stores keep allocating. Nothing handed out
/// twice, nothing acknowledged lost, and the long-lived stores recover without reopening.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_backend_survives_member_faults_of_a_three_member_etcd() {
    let cp = Arc::new(ControlPlane::private_with("fault-etcd3", &[("CLUSTERIP_ETCD_MEMBERS", "3")]));
    let endpoints = cp.etcd_endpoints();
    assert_eq!(endpoints.len(), 3, "CLUSTERIP_ETCD_ENDPOINTS lists every member: {endpoints:?}");
    // A /110 (262 142 addresses) so that the bursts never fill it; the etcd backend records
    // it in this control plane's own etcd, under the fixture's prefix.
    let fx = Arc::new(Fixture::on(cp.clone(), Backend::Etcd, &["fd00:10:98::/110"]).await);
    let plain = Probe::start(&fx, 0).await;
    let pooled = Probe::start(&fx, 64).await;
    let burst = Burst::start(fx.clone());
    let mut faults = Vec::new();

    // 1. The leader is SIGKILLed mid-burst; it stays down until the two others have elected
    //    a leader and allocations have gone on without it, then starts again with its data.
    wait_progress(&fx, 300, "before the leader is killed").await;
    let leader = wait_for_leader(&endpoints, None).await;
    let from = Instant::now();
    cp.signal(MEMBERS[leader], libc::SIGKILL);
    let successor = wait_for_leader(&endpoints, Some(leader)).await;
    wait_progress(&fx, 300, "with the old leader down").await;
    cp.start(MEMBERS[leader]);
    let to = Instant::now();
    let recovered_in = wait_probes_succeed(&[&plain, &pooled], to, 10, "after the killed leader came back").await;
    eprintln!("fault 1: killed leader {}; {} leads now", MEMBERS[leader], MEMBERS[successor]);
    faults.push(Fault { name: format!("SIGKILL of the leader ({}), restart with its data", MEMBERS[leader]), from, to, recovered_in });

    // 2. The leader is frozen (SIGSTOP) for 30 s, then continued. The 30 s are the fault
    //    itself, not synchronisation: a member that hangs without closing its connections.
    wait_progress(&fx, 300, "before the leader is frozen").await;
    let leader = wait_for_leader(&endpoints, None).await;
    let from = Instant::now();
    cp.signal(MEMBERS[leader], libc::SIGSTOP);
    let frozen = tokio::time::sleep(Duration::from_secs(30));
    tokio::pin!(frozen);
    // While it is frozen, the other two (a quorum) elect a leader and the stores keep
    // allocating through them.
    let successor = tokio::select! {
        l = wait_for_leader(&endpoints, Some(leader)) => Some(l),
        _ = &mut frozen => None,
    };
    let during = Instant::now();
    frozen.await;
    let served_while_frozen = (plain.successes_since(during), pooled.successes_since(during));
    cp.signal(MEMBERS[leader], libc::SIGCONT);
    let to = Instant::now();
    let recovered_in = wait_probes_succeed(&[&plain, &pooled], to, 10, "after the frozen leader was continued").await;
    eprintln!(
        "fault 2: froze leader {} for 30 s; successor {:?}; probe successes after the election while frozen (plain, pooled): {served_while_frozen:?}",
        MEMBERS[leader],
        successor.map(|s| MEMBERS[s])
    );
    faults.push(Fault { name: format!("SIGSTOP of the leader ({}) for 30 s, then SIGCONT", MEMBERS[leader]), from, to, recovered_in });

    // 3. A follower is stopped mid-burst, stays down while allocations go on, and starts
    //    again with its data.
    wait_progress(&fx, 300, "before a follower is restarted").await;
    let leader = wait_for_leader(&endpoints, None).await;
    let follower = (leader + 1) % MEMBERS.len();
    let from = Instant::now();
    cp.stop(MEMBERS[follower]);
    wait_progress(&fx, 300, "with a follower down").await;
    cp.start(MEMBERS[follower]);
    let to = Instant::now();
    let recovered_in = wait_probes_succeed(&[&plain, &pooled], to, 10, "after the follower came back").await;
    wait_progress(&fx, 300, "after the follower came back").await;
    faults.push(Fault { name: format!("restart of a follower ({}) with its data", MEMBERS[follower]), from, to, recovered_in });

    // The end of the run: every caller's answers, then the records.
    let batches = burst.finish();
    let mut stores = Vec::new();
    let mut probe_logs = Vec::new();
    for p in [plain, pooled] {
        p.stop.send_replace(true);
        stores.push(p.task.await.expect("probe task"));
        probe_logs.push(p.log);
    }
    let mut acknowledged = BTreeSet::new();
    let mut process_errors = 0usize;
    let mut pools_not_returned = 0usize;
    for b in &batches {
        for run in &b.runs {
            process_errors += run.stderr.matches("error:").count();
            pools_not_returned += run.stderr.matches("the address pool was not returned").count();
            for ip in &run.ips {
                assert!(acknowledged.insert(*ip), "{ip} handed out twice");
            }
        }
    }
    for log in &probe_logs {
        for (_, ip) in &log.lock().expect("probe log").acknowledged {
            assert!(acknowledged.insert(*ip), "{ip} handed out twice");
        }
    }
    // The stores were never reopened: they still allocate now.
    for s in &stores {
        let ip = s.allocate_next(clusterip::cidr::Family::IPv6, None).await.expect("a long-lived store allocates after all the faults");
        assert!(acknowledged.insert(ip), "{ip} handed out twice");
    }
    for s in &stores {
        s.close().await.expect("return the pool");
    }

    // Nothing acknowledged was lost: every member's copy of the allocation map holds it
    // (read from that member alone, a linearizable read through it).
    let cidr = fx.cidrs[0].clone();
    let key = clusterip::store::etcd::range_key(&fx.prefix, &cidr);
    let mut listed = BTreeSet::new();
    for ep in &endpoints {
        let (key, cidr) = (&key, &cidr);
        // (No pause between attempts: each times out on its own.)
        let (map, pools) = eventually_some(&format!("member {ep} answers"), Duration::from_secs(60), Duration::ZERO, move || async move {
            let read = async {
                let mut c = etcd_client::Client::connect([ep.clone()], None).await.ok()?;
                let value = c.get(key.clone(), None).await.ok()?.kvs().first()?.value().to_vec();
                let pools = c.get(clusterip::store::etcd::pool::pool_prefix(key), Some(etcd_client::GetOptions::new().with_prefix())).await.ok()?;
                let listed: BTreeSet<IpAddr> = pools.kvs().iter().flat_map(|kv| clusterip::store::etcd::pool::decode_pool(kv.value())).collect();
                Some((clusterip::alloc::AllocationMap::restore(cidr, &value).ok()?, listed))
            };
            tokio::time::timeout(Duration::from_secs(10), read).await.ok().flatten()
        })
        .await;
        let lost: Vec<_> = acknowledged.iter().filter(|ip| !map.has(**ip)).collect();
        assert!(lost.is_empty(), "{} acknowledged allocations missing from the map on member {ep}, e.g. {:?}", lost.len(), &lost[..lost.len().min(5)]);
        listed.extend(pools.intersection(&acknowledged).copied());
    }
    // Readers (`allocated`, `has`, the repair pass) see an address listed in a pool key as
    // free, held in reserve. A pool key can still list addresses handed out just before its
    // store lost the lease (it forgets its pool then, and does not rewrite the key): they
    // read as free until the lease expires (30 s TTL). Wait for that, and say how long.
    let readers_from = Instant::now();
    let (fixture, acked) = (&fx, &acknowledged);
    let recorded: BTreeSet<IpAddr> = eventually_ok("every acknowledged allocation reads as allocated after the run", Duration::from_secs(120), Duration::from_millis(500), move || async move {
        let read = async { EtcdStore::open(&fixture.etcd_config(), fixture.cidrs.clone()).await.ok()?.allocated().await.ok() };
        let Ok(Some(a)) = tokio::time::timeout(Duration::from_secs(10), read).await else { return Err("no read through a fresh store".to_string()) };
        let a: BTreeSet<IpAddr> = a.into_iter().collect();
        if acked.is_subset(&a) {
            Ok(a)
        } else {
            Err(format!("{} acknowledged allocations still read as free", acked.difference(&a).count()))
        }
    })
    .await;
    eprintln!(
        "RESULT fresh stores: {} reads through a newly opened store (all endpoints) failed during the run",
        FRESH_READ_FAILURES.load(std::sync::atomic::Ordering::Relaxed)
    );
    eprintln!(
        "RESULT readers: {} acknowledged addresses were still listed in a pool key at the end (read as free); all read as allocated {:.1} s later; {pools_not_returned} pooled processes could not return their pool",
        listed.len(),
        readers_from.elapsed().as_secs_f64()
    );

    // Callers saw the faults.
    let mut fault_errors = 0usize;
    for f in &faults {
        let probe_errors: usize = probe_logs.iter().map(|l| l.lock().expect("probe log").errors.iter().filter(|(at, _)| *at >= f.from && *at <= f.to).count()).sum();
        let proc_errors: usize = batches.iter().filter(|b| b.ended >= f.from && b.started <= f.to).flat_map(|b| &b.runs).map(|r| r.stderr.matches("error:").count()).sum();
        fault_errors += probe_errors + proc_errors;
        eprintln!(
            "RESULT fault: {}: {:.1} s, errors seen by callers: {proc_errors} (processes) + {probe_errors} (long-lived stores); stores answering again {:.1} s after it ended",
            f.name,
            (f.to - f.from).as_secs_f64(),
            f.recovered_in.as_secs_f64()
        );
    }
    assert!(fault_errors > 0, "no caller saw any of the faults; the test did not test anything");
    let probe_acks: usize = probe_logs.iter().map(|l| l.lock().expect("probe log").acknowledged.len()).sum();
    eprintln!(
        "RESULT three-member etcd: {} acknowledged ({} by {} allocator processes in {} batches, {probe_acks} by the two long-lived stores), {process_errors} process errors in all, 0 duplicates, 0 lost, {} recorded ({} leaked)",
        acknowledged.len(),
        acknowledged.len() - probe_acks - stores.len(),
        batches.len() * 4,
        batches.len(),
        recorded.len(),
        recorded.len().saturating_sub(acknowledged.len())
    );
}
