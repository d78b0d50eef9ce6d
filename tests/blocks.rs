//! The IPAddress backend's address blocks (`src/store/blocks.rs`) against a real
//! kube-apiserver: replicas answer dynamic requests from memory, only inside blocks they
//! hold, and no address is answered twice when a holder crashes, pauses, or its watch lags,
//! or when the apiserver restarts.
//!
//! The protocol's cases that need no real apiserver (the D − M stop, a takeover after D, a
//! hand-over's and a renewal's lost answers, deleted and orphaned Leases, a frozen VM, calls
//! that never answer) are unit tests on an in-memory apiserver and a hand-moved clock
//! (`src/store/blocks/tests.rs`, milliseconds); these keep what needs the real one: its
//! preconditions, its consistent lists and watch, a restart.
//!
//! Replicas here run without their background task; the test calls `tick()` (renew,
//! observe) at the points of the interleaving it reproduces. A replica's IPAddress view is
//! held back with `ApiserverIps::fixed` to make a lagging watch deterministic. Each test has
//! a /28 of its own in the apiserver's static band (198.19.0.128/26: its own dynamic
//! allocation never lands there; no other test uses it): a /28 has no static band of its
//! own, so with 16-address blocks it is one block of 14 addresses, which only one replica
//! can hold (with 4-address blocks: four blocks of 4, 4, 4 and 2).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clusterip::alloc::AllocError;
use clusterip::cidr::{Family, ServiceCidr};
use clusterip::store::ipaddress::apiserver_ips::ApiserverIps;
use clusterip::store::ipaddress::blocks::{block_name, span, BlockOptions, BlockStore, BLOCK_LABEL, WANTED_ANNOTATION};
use clusterip::store::{AllocationStore, ParentRef, StoreError};
use clusterip_test_support::{control_plane, eventually_ok, eventually_some, unique_name, within, ControlPlane};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::Client;
use serde_json::json;

/// Namespaces of this file's tests start with this; an earlier run's leftovers are found by it.
const PREFIX: &str = "blk";

/// Lease duration D and margin M of the test replicas: a holder answers from a block for
/// D − M = 20 s after each confirmed renewal (room for a loaded machine), and an observer
/// takes over after watching the Lease unchanged for 30 s.
const D: Duration = Duration::from_secs(30);
const M: Duration = Duration::from_secs(10);

fn options() -> BlockOptions {
    BlockOptions { size: Some(16), lease_duration: D, margin: M, renew_every: None }
}

struct Fixture {
    client: Client,
    ns: String,
    range: ServiceCidr,
}

impl Fixture {
    async fn new(cp: &ControlPlane, range: &str) -> Fixture {
        let client = cp.client().await;
        let ns = unique_name(PREFIX);
        let obj: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}})).expect("namespace");
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &obj).await.expect("create namespace");
        Fixture { client, ns, range: ServiceCidr::parse(range).expect("range") }
    }

    fn parent(&self, name: &str) -> ParentRef {
        ParentRef::service(&self.ns, name)
    }

    async fn replica(&self, name: &str, view: ApiserverIps) -> Arc<BlockStore> {
        self.replica_with(name, view, options()).await
    }

    async fn replica_with(&self, name: &str, view: ApiserverIps, options: BlockOptions) -> Arc<BlockStore> {
        BlockStore::open(self.client.clone(), &self.ns, vec![self.range.clone()], view, name, options).await.expect("open the block store")
    }

    /// The addresses of a block of ours by its Lease name, at block size `size`.
    fn span_of(&self, name: &str, size: u64) -> Vec<IpAddr> {
        let index: u64 = name.rsplit_once('-').and_then(|(_, i)| i.parse().ok()).expect("a block Lease name");
        let s = span(&self.range, size, index).expect("a block of the range");
        (s.first..s.end).filter_map(|off| self.range.ip_at(off)).collect()
    }

    async fn block_leases(&self) -> Vec<Lease> {
        Api::<Lease>::namespaced(self.client.clone(), &self.ns).list(&ListParams::default().labels(BLOCK_LABEL)).await.expect("list block Leases").items
    }

    async fn live_view(&self) -> ApiserverIps {
        let (view, mut synced, _task) = ApiserverIps::start(self.client.clone());
        tokio::time::timeout(Duration::from_secs(60), synced.wait_for(|s| *s)).await.expect("IPAddress list within 60s").expect("watch running");
        view
    }

    fn block(&self) -> String {
        block_name(&self.range, 0)
    }

    async fn holder(&self) -> Option<String> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        leases.get_opt(&self.block()).await.expect("read the block Lease").and_then(|l| l.spec).and_then(|s| s.holder_identity)
    }

    /// The range free in the apiserver: leftovers of an earlier run of this file (Services
    /// in its namespaces) are deleted; anyone else holding an address fails the test.
    async fn free_range(&self) {
        let addresses: Api<IPAddress> = Api::all(self.client.clone());
        for off in 0..self.range.size() {
            let Some(ip) = self.range.ip_at(off) else { continue };
            if let Some(rec) = addresses.get_opt(&ip.to_string()).await.expect("read IPAddress") {
                let p = rec.spec.parent_ref;
                let ns = p.namespace.unwrap_or_default();
                assert!(ns.starts_with(PREFIX), "{ip} is held by {}/{ns}/{}, not by an earlier run of this test", p.resource, p.name);
                let _ = Api::<Service>::namespaced(self.client.clone(), &ns).delete(&p.name, &DeleteParams::default()).await;
            }
        }
        let (addresses, range) = (&addresses, &self.range);
        eventually_ok("the range's leftover records are gone", Duration::from_secs(60), Duration::from_millis(100), move || async move {
            for off in 0..range.size() {
                let Some(ip) = range.ip_at(off) else { continue };
                if addresses.get_opt(&ip.to_string()).await.expect("read IPAddress").is_some() {
                    return Err(format!("{ip} still recorded"));
                }
            }
            Ok(())
        })
        .await
    }

    /// What the apiserver does with an answer: store a Service with that address.
    async fn store_service(&self, name: &str, ip: IpAddr) {
        let svc: Service = serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"clusterIP": ip.to_string(), "ports": [{"port": 80}]}})).expect("service");
        Api::<Service>::namespaced(self.client.clone(), &self.ns).create(&PostParams::default(), &svc).await.expect("the apiserver stores the answered address");
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let (client, ns) = (self.client.clone(), self.ns.clone());
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async move {
                let _ = Api::<Namespace>::all(client).delete(&ns, &DeleteParams::default()).await;
            });
        })
        .join();
    }
}

fn is_full<T: std::fmt::Debug>(r: &Result<T, StoreError>) -> bool {
    matches!(r, Err(StoreError::Alloc(AllocError::Full)))
}

/// Everything a replica can still pick, until it reports the range full.
async fn drain(r: &BlockStore, parent: &ParentRef) -> Vec<IpAddr> {
    let mut got = Vec::new();
    loop {
        match r.allocate_next(Family::IPv4, Some(parent)).await {
            Ok(ip) => got.push(ip),
            Err(StoreError::Alloc(AllocError::Full)) => return got,
            Err(e) => panic!("picking: {e}"),
        }
        assert!(got.len() <= 14, "more picks than addresses: {got:?}");
    }
}

/// B's first answer: it ticks (renew, observe, take over) and asks every 500 ms, for up to
/// 180 s; until it answers, every refusal must be "range is full".
async fn first_answer(b: &BlockStore, parent: &ParentRef, what: &str) -> IpAddr {
    eventually_some(&format!("B can {what}"), Duration::from_secs(180), Duration::from_millis(500), || async move {
        b.tick().await;
        match b.allocate_next(Family::IPv4, Some(parent)).await {
            Ok(ip) => Some(ip),
            Err(e) => {
                assert!(is_full(&Err::<(), _>(e)), "B failed otherwise");
                None
            }
        }
    })
    .await
}

/// Replica A holds the block, answers X, and the apiserver stores X; A then crashes (no
/// renewal, no give-back). Replica B's watch lags: its view never shows X. B answers
/// nothing from A's block until it has watched A's Lease unchanged for the lease duration;
/// then it takes the block over and — reading the IPAddresses from storage before its
/// first answer — never answers X.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holders_block_is_taken_over_late_and_its_answers_are_seen_through_a_lagging_watch() {
    let cp = control_plane();
    let fx = Fixture::new(&cp, "198.19.0.128/28").await;
    fx.free_range().await;
    let a = fx.replica("replica-a", fx.live_view().await).await;
    assert_eq!(a.held_blocks(), vec![fx.block()], "A took the range's only block at start");
    let b_opened = Instant::now();
    let b = fx.replica("replica-b", ApiserverIps::fixed([])).await;
    assert!(b.held_blocks().is_empty());

    let x = a.allocate_next(Family::IPv4, Some(&fx.parent("first"))).await.expect("A answers from memory");
    fx.store_service("first", x).await;
    drop(a); // a crash: the Lease stays, unrenewed

    // B answers nothing from a block another replica may still answer from.
    let r = b.allocate_next(Family::IPv4, Some(&fx.parent("early"))).await;
    assert!(is_full(&r), "B answered {r:?} from A's block before it could know A was gone");
    let first = first_answer(&b, &fx.parent("second"), "take the block over").await;
    assert!(b_opened.elapsed() >= D, "B took the block over {:?} after it first saw A's Lease, before the lease duration {D:?}", b_opened.elapsed());
    assert!(fx.holder().await.is_some_and(|h| h.starts_with("replica-b/")), "the block Lease names B");
    let mut picked = vec![first];
    picked.extend(drain(&b, &fx.parent("rest")).await);
    assert!(!picked.contains(&x), "B answered {x}, which A had answered and the apiserver stored; B's picks: {picked:?}");
    assert_eq!(picked.iter().collect::<BTreeSet<_>>().len(), 13, "B answers every other address of the block once: {picked:?}");
}

/// The kube-apiserver is down for longer than the lease duration (a private control plane:
/// this test stops it). Neither replica can renew or observe meanwhile. After the restart,
/// the observer's old observation of the Lease lets it race the holder's renewal: exactly
/// one of them wins, and only the winner answers from the block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_apiserver_restart_exactly_one_replica_answers_from_a_block() {
    let cp = Arc::new(ControlPlane::private("blocks-restart"));
    let fx = Fixture::new(&cp, "198.19.0.160/28").await;
    let live = fx.live_view().await;
    let a = fx.replica("replica-a", live.clone()).await;
    let b = fx.replica("replica-b", ApiserverIps::fixed([])).await;
    let x = a.allocate_next(Family::IPv4, Some(&fx.parent("first"))).await.expect("A answers");
    fx.store_service("first", x).await;
    b.tick().await; // B has seen A's Lease as it is now

    cp.stop("kube-apiserver");
    let stopped = Instant::now();
    // Both keep trying while it is down: renewals and lists fail, nothing is taken over.
    // (Time is the subject: ticks every 500 ms for D and a margin.)
    while stopped.elapsed() < D + Duration::from_secs(2) {
        let ta = a.tick().await;
        assert!(ta.lost.is_empty(), "A dropped its block while the apiserver was down: {ta:?}");
        b.tick().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(a.allocate_next(Family::IPv4, Some(&fx.parent("down"))).await.is_err(), "A answered from a block it could not renew for D");
    cp.start("kube-apiserver");

    // Both act at once: A renews, B (whose observation is older than D) tries to take over.
    let (ta, tb) = tokio::join!(a.tick(), async {
        let r = b.allocate_next(Family::IPv4, Some(&fx.parent("b"))).await;
        (r, b.tick().await)
    });
    let _ = tb.1;
    let holder = fx.holder().await.expect("the block Lease exists");
    let (winner, loser) = if holder.starts_with("replica-a/") { (&a, &b) } else { (&b, &a) };
    if holder.starts_with("replica-b/") {
        // A's renewal was refused (or is at the next tick).
        a.tick().await;
        assert!(a.held_blocks().is_empty(), "A kept a block B took over: {ta:?}");
    }
    assert!(loser.held_blocks().is_empty(), "both replicas hold the block");
    assert_eq!(winner.held_blocks(), vec![fx.block()]);
    let mut picked: Vec<IpAddr> = tb.0.into_iter().collect();
    picked.extend(drain(winner, &fx.parent("rest")).await);
    picked.extend(drain(loser, &fx.parent("rest")).await);
    let unique: BTreeSet<IpAddr> = picked.iter().copied().collect();
    assert_eq!(unique.len(), picked.len(), "an address was answered twice: {picked:?}");
    assert!(!unique.contains(&x), "{x} (stored before the restart) was answered again: {picked:?}");
}

/// Replica B's blocks are used up while A holds two blocks of the range with room: B asks A
/// for one (the `clusterip.allocator/wanted-by` annotation), A gives back the one with room
/// and no pick pending, and B answers from it. A's block with its pick pending stays A's:
/// B ends with every address but that block's, each once, and the range is full to B only
/// then. The request is cleared by A's next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_blocks_are_used_up_gets_one_handed_over_by_a_holder_with_room() {
    let cp = control_plane();
    let fx = Fixture::new(&cp, "198.19.0.176/28").await;
    fx.free_range().await;
    let live = fx.live_view().await;
    let four = BlockOptions { size: Some(4), ..options() };
    let a = fx.replica_with("replica-a", live.clone(), four.clone()).await;
    let b = fx.replica_with("replica-b", live.clone(), four).await;
    // At start each takes its lead of two blocks, the second only while two are free: A
    // two, B one, one left free.
    assert_eq!((a.held_blocks().len(), b.held_blocks().len()), (2, 1), "A took two blocks at start, B one");
    // A looks at the block Leases (its tick) before it answers, so that the block it takes
    // ahead of need after answering sees B's: with a view that has not seen B's Lease yet
    // (a watch lagging on a loaded machine), A took the last free block too and then had
    // two to hand over (seen under `scripts/test-soak.sh`).
    a.tick().await;
    // A answers once (pending: the test never stores it).
    let x = a.allocate_next(Family::IPv4, Some(&fx.parent("a"))).await.expect("A answers");
    let with_x = a.held_blocks().into_iter().find(|n| fx.span_of(n, 4).contains(&x)).expect("A holds the block of its answer");

    // A answers requests at its ticks while B answers everything it can.
    let stop = Arc::new(AtomicBool::new(false));
    let ticker = tokio::spawn({
        let (a, stop) = (a.clone(), stop.clone());
        async move {
            let mut handed = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                handed.extend(a.tick().await.handed_over);
                // (A's ticks at a rate, as its timer would run them: not a wait.)
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            handed
        }
    });
    let got = drain(&b, &fx.parent("b")).await;
    // (On a busy machine A's tick may answer after B's admission stopped waiting: then B's
    // next admission finds the block given back.)
    let want = 14 - fx.span_of(&with_x, 4).len();
    let drained = std::cell::RefCell::new(got);
    let (drained, b_ref, fx_ref) = (&drained, &b, &fx);
    within(Duration::from_secs(60), Duration::from_millis(500), move || async move {
        if drained.borrow().len() >= want {
            return Some(());
        }
        let more = drain(b_ref, &fx_ref.parent("b")).await;
        drained.borrow_mut().extend(more);
        None
    })
    .await;
    let got = drained.take();
    stop.store(true, Ordering::Relaxed);
    let handed = ticker.await.expect("A's ticks");

    assert_eq!(handed.len(), 1, "A hands over exactly its block without a pending pick: {handed:?}");
    assert_ne!(handed[0], with_x, "A handed over the block of its pending answer {x}");
    assert_eq!(a.held_blocks(), vec![with_x.clone()], "A keeps the block of its pending answer");
    let unique: BTreeSet<IpAddr> = got.iter().copied().collect();
    assert_eq!(unique.len(), got.len(), "B answered an address twice: {got:?}");
    let kept = fx.span_of(&with_x, 4);
    assert!(got.iter().all(|ip| !kept.contains(ip)), "B answered from A's block {with_x}: {got:?}");
    assert_eq!(got.len(), 14 - kept.len(), "B answers every address outside A's remaining block: {got:?}");
    // The request is answered and gone once A has renewed.
    a.tick().await;
    for lease in fx.block_leases().await {
        let wanted = lease.metadata.annotations.as_ref().and_then(|a| a.get(WANTED_ANNOTATION).cloned());
        assert_eq!(wanted, None, "block Lease {:?} still carries a request", lease.metadata.name);
    }
}

/// A replica with 4-address blocks (A) and one with 16-address blocks (B) on the same range:
/// B reads A's block from the addresses its Lease names, not from its name at B's size, and
/// takes nothing that shares an address with it. When A crashes, B — after watching A's
/// Leases unchanged for the lease duration — deletes them (they name other spans than B's
/// block of that name) and takes its own block, whose consistent list shows A's stored
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_different_block_sizes_never_share_an_address() {
    let cp = control_plane();
    let fx = Fixture::new(&cp, "198.19.0.224/28").await;
    fx.free_range().await;
    let live = fx.live_view().await;
    let a = fx.replica_with("replica-a", live.clone(), BlockOptions { size: Some(4), ..options() }).await;
    let b_opened = Instant::now();
    let b = fx.replica_with("replica-b", live.clone(), options()).await;
    assert_eq!(a.held_blocks().len(), 2, "A took two 4-address blocks at start (its lead)");
    assert!(b.held_blocks().is_empty(), "B took a 16-address block sharing addresses with A's: {:?}", b.held_blocks());
    let r = b.allocate_next(Family::IPv4, Some(&fx.parent("b-early"))).await;
    assert!(is_full(&r), "B answered {r:?} while A held part of the range");

    let x = a.allocate_next(Family::IPv4, Some(&fx.parent("a"))).await.expect("A answers");
    fx.store_service("a", x).await;
    drop(a); // a crash: A's Lease stays, unrenewed

    let first = first_answer(&b, &fx.parent("b-0"), "take the range").await;
    assert!(b_opened.elapsed() >= D, "B took addresses of A's block {:?} after it first saw A's Lease, before the lease duration {D:?}", b_opened.elapsed());
    assert_eq!(b.held_blocks(), vec![fx.block()], "B holds its one 16-address block");
    let names: Vec<String> = fx.block_leases().await.into_iter().filter_map(|l| l.metadata.name).collect();
    assert_eq!(names, vec![fx.block()], "A's Lease is gone, B's is the only one");
    let mut picked = vec![first];
    picked.extend(drain(&b, &fx.parent("b-rest")).await);
    assert!(!picked.contains(&x), "B answered {x}, which A had answered and the apiserver stored: {picked:?}");
    assert_eq!(picked.iter().collect::<BTreeSet<_>>().len(), 13, "B answers every other address once: {picked:?}");
}

/// The consistent list a replica makes after taking a block reads every IPAddress, page by
/// page (metadata only, one continue token): with a page of 10, 25 objects of this test come
/// back whole among the cluster's others (a list that stopped at its first page, or that
/// restarted without the token, would miss or repeat some).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ipaddress_list_after_taking_a_block_reads_every_page() {
    use clusterip::store::ipaddress::blocks::client::{BlockApi, KubeBlockApi};
    let cp = control_plane();
    let fx = Fixture::new(&cp, "198.19.0.240/28").await;
    let addresses: Api<IPAddress> = Api::all(fx.client.clone());
    // 198.18.237.0/27: no test's Service range; the objects name a Gateway of the test's.
    let ours: Vec<IpAddr> = (1..=25).map(|i| IpAddr::from([198, 18, 237, i])).collect();
    for ip in &ours {
        let obj: IPAddress = serde_json::from_value(json!({"metadata": {"name": ip.to_string(), "labels": {"ipaddress.kubernetes.io/managed-by": "clusterip.allocator"}},
            "spec": {"parentRef": {"group": "gateway.networking.k8s.io", "resource": "gateways", "namespace": fx.ns, "name": "gw"}}})).expect("IPAddress");
        let _ = addresses.delete(&ip.to_string(), &DeleteParams::default()).await;
        eventually_some("the test's IPAddress is created", Duration::from_secs(30), Duration::from_millis(100), || {
            let (addresses, obj) = (addresses.clone(), obj.clone());
            async move { addresses.create(&PostParams::default(), &obj).await.ok().map(drop) }
        })
        .await;
    }
    let paged = KubeBlockApi::new(fx.client.clone(), &fx.ns).with_address_page(10).list_addresses().await.expect("the paged list");
    let unique: BTreeSet<IpAddr> = paged.iter().copied().collect();
    assert_eq!(unique.len(), paged.len(), "an address listed twice across pages");
    assert!(ours.iter().all(|ip| unique.contains(ip)), "missing from the paged list: {:?}", ours.iter().filter(|ip| !unique.contains(ip)).collect::<Vec<_>>());
    for ip in &ours {
        let _ = addresses.delete(&ip.to_string(), &DeleteParams::default()).await;
    }
}
