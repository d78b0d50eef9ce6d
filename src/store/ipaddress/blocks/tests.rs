//! The block store's shell on an in-memory apiserver (`fake.rs`) and a clock moved by hand:
//! each case of the protocol deterministic, in milliseconds. What needs the real
//! kube-apiserver (its preconditions, its watch, a restart) stays in `tests/blocks.rs`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use super::fake::FakeApi;
use super::*;
use crate::clock::testing::ManualClock;

/// Lease duration D and margin M (as tests/blocks.rs): a holder answers for D − M = 20 s
/// after each confirmed renewal; an observer takes over after 30 s unchanged.
const D: Duration = Duration::from_secs(30);
const M: Duration = Duration::from_secs(10);

fn s(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// A /28 without a static band: 14 addresses; one 16-address block, or four of 4, 4, 4, 2.
fn range() -> ServiceCidr {
    ServiceCidr::parse("198.19.0.128/28").expect("range")
}

fn parent(name: &str) -> ParentRef {
    ParentRef::service("ns", name)
}

fn options(size: u64) -> BlockOptions {
    BlockOptions { size: Some(size), lease_duration: D, margin: M, renew_every: None }
}

/// A replica on `api` and `clock`, with its lead of blocks taken (as `BlockStore::open`).
async fn replica(api: &Arc<FakeApi>, clock: Arc<dyn Clock>, name: &str, size: u64, view: ApiserverIps) -> Arc<BlockStore> {
    let me = BlockStore::start(api.clone(), clock, vec![range()], view, name, options(size)).await.expect("start the block store");
    me.take_lead().await;
    me
}

fn is_full<T: std::fmt::Debug>(r: &Result<T, StoreError>) -> bool {
    matches!(r, Err(StoreError::Alloc(AllocError::Full)))
}

/// Everything a replica can still pick, until it reports the range full (at most `most`).
async fn drain_all(r: &BlockStore, who: &str, most: usize) -> Vec<IpAddr> {
    let mut got = Vec::new();
    loop {
        match r.allocate_next(Family::IPv4, Some(&parent(who))).await {
            Ok(ip) => got.push(ip),
            Err(StoreError::Alloc(AllocError::Full)) => return got,
            Err(e) => panic!("picking: {e}"),
        }
        assert!(got.len() <= most, "more picks than addresses: {got:?}");
    }
}

/// Everything a replica can still pick from the /28 of [`range`].
async fn drain(r: &BlockStore, who: &str) -> Vec<IpAddr> {
    drain_all(r, who, 14).await
}

fn addresses_of(name: &str, size: u64) -> Vec<IpAddr> {
    let c = range();
    let index: u64 = name.rsplit_once('-').and_then(|(_, i)| i.parse().ok()).expect("a block Lease name");
    let sp = span(&c, size, index).expect("a block of the range");
    (sp.first..sp.end).filter_map(|off| c.ip_at(off)).collect()
}

#[tokio::test(start_paused = true)]
async fn a_holder_answers_only_while_its_last_confirmed_renewal_is_younger_than_d_minus_m() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    assert_eq!(a.held_blocks(), vec![block_name(&range(), 0)]);
    clock.advance(D - M - Duration::from_millis(1));
    assert!(a.allocate_next(Family::IPv4, Some(&parent("x"))).await.is_ok(), "A answers just before D − M");
    clock.advance(Duration::from_millis(1));
    assert!(a.held_blocks().is_empty(), "A still answers D − M after its last confirmed renewal");
    assert!(is_full(&a.allocate_next(Family::IPv4, Some(&parent("y"))).await));
    // A renewal confirmed: A answers again, for D − M after it was sent.
    assert_eq!(a.tick().await.renewed, 1);
    assert!(a.allocate_next(Family::IPv4, Some(&parent("z"))).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn an_observer_takes_over_only_after_seeing_the_lease_unchanged_for_d_and_skips_what_its_list_shows() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    let b = replica(&api, Arc::new(clock.clone()), "replica-b", 16, ApiserverIps::fixed([])).await;
    assert!(b.held_blocks().is_empty());
    let x = a.allocate_next(Family::IPv4, Some(&parent("first"))).await.expect("A answers");
    api.record_address(x); // the apiserver stored it; B's view never shows it
    drop(a); // a crash: the Lease stays, unrenewed
    clock.advance(D - Duration::from_millis(1));
    b.tick().await;
    assert!(is_full(&b.allocate_next(Family::IPv4, Some(&parent("early"))).await), "B took over before D");
    clock.advance(Duration::from_millis(1));
    b.tick().await;
    let picked = drain(&b, "rest").await;
    assert!(!picked.contains(&x), "B answered {x}, stored before the takeover: {picked:?}");
    assert_eq!(picked.iter().collect::<BTreeSet<_>>().len(), 13, "{picked:?}");
    let lease = api.lease(&block_name(&range(), 0)).expect("the block Lease");
    assert!(crate::k8s::lease::holder(&lease).is_some_and(|h| h.starts_with("replica-b/")));
}

#[tokio::test(start_paused = true)]
async fn a_renewal_seen_by_the_observer_restarts_its_count() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    let b = replica(&api, Arc::new(clock.clone()), "replica-b", 16, ApiserverIps::fixed([])).await;
    clock.advance(s(15));
    a.tick().await;
    b.tick().await;
    clock.advance(s(20));
    a.tick().await; // not seen by B before its own tick below
    b.tick().await;
    assert!(is_full(&b.allocate_next(Family::IPv4, Some(&parent("b"))).await), "B took over a block renewed 20 s ago");
    assert_eq!(a.held_blocks(), vec![block_name(&range(), 0)]);
}

#[tokio::test(start_paused = true)]
async fn a_holder_hands_over_a_block_with_room_and_no_pick_pending() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let view = ApiserverIps::fixed([]);
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 4, view.clone()).await;
    let b = replica(&api, Arc::new(clock.clone()), "replica-b", 4, view.clone()).await;
    assert_eq!((a.held_blocks().len(), b.held_blocks().len()), (2, 1));
    let x = a.allocate_next(Family::IPv4, Some(&parent("a"))).await.expect("A answers");
    let with_x = a.held_blocks().into_iter().find(|n| addresses_of(n, 4).contains(&x)).expect("A's block of x");
    let other = a.held_blocks().into_iter().find(|n| *n != with_x).expect("A's other block");
    // B uses its block and the free one up, then asks.
    let mut got = drain(&b, "b").await;
    let asked = |n: &String| api.lease(n).is_some_and(|l| l.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(WANTED_ANNOTATION)));
    assert!(asked(&other) || asked(&with_x), "B asked A for a block");
    let t = a.tick().await;
    assert_eq!(t.handed_over, vec![other.clone()], "A hands over its block without a pending pick");
    let count = |r: &BlockStore, e: &str| r.block_events().into_iter().find(|(n, _)| *n == e).map(|(_, c)| c);
    assert_eq!((count(&a, "created"), count(&a, "handed_over"), count(&b, "created")), (Some(2), Some(1), Some(2)), "the block events counted (clusterip_address_block_events_total)");
    // (B's next admission finds it once its wait that got nothing is over.)
    clock.advance(book::HANDOVER_WAIT);
    got.extend(drain(&b, "b").await);
    let kept = addresses_of(&with_x, 4);
    assert_eq!(got.len(), 14 - kept.len(), "{got:?}");
    assert!(got.iter().all(|ip| !kept.contains(ip)));
    assert_eq!(got.iter().collect::<BTreeSet<_>>().len(), got.len());
}

/// Fault 1 (issue 32): a frozen VM. The machine is suspended for longer than D − M: its
/// CLOCK_MONOTONIC stands still, its CLOCK_BOOTTIME counts the pause. Resumed, the holder
/// must not answer from a block whose last confirmed renewal is now older than D − M.
#[tokio::test(start_paused = true)]
async fn a_holder_resumed_after_a_frozen_vm_counts_the_suspended_time() {
    use crate::clock::{testing::Machine, SystemClock};
    let (api, machine) = (Arc::new(FakeApi::default()), Machine::default());
    machine.run(s(100));
    let a = replica(&api, Arc::new(SystemClock::with(machine.clone())), "replica-a", 16, ApiserverIps::fixed([])).await;
    assert_eq!(a.held_blocks(), vec![block_name(&range(), 0)]);
    machine.run(s(1));
    machine.suspend(D + s(60));
    assert!(a.held_blocks().is_empty(), "A answers from its block after a {:?} suspension", D + s(60));
    let r = a.allocate_next(Family::IPv4, Some(&parent("after"))).await;
    assert!(is_full(&r), "A answered {r:?} after the pause without a confirmed renewal");
    // A renewal confirmed after the pause (nobody took the block over): A answers again.
    assert_eq!(a.tick().await.renewed, 1);
    assert!(a.allocate_next(Family::IPv4, Some(&parent("renewed"))).await.is_ok());
}

/// Fault 2: a block Lease deleted by hand (or by a namespace clean-up). The holder's watch
/// sees the delete: it stops answering from the block at once, not at its next renewal.
#[tokio::test(start_paused = true)]
async fn a_block_lease_deleted_by_hand_stops_its_holder_answering_at_once() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    let name = block_name(&range(), 0);
    let deleted = api.remove(&name).expect("the block Lease");
    a.on_lease_change(Change::Delete(deleted));
    assert!(a.held_blocks().is_empty(), "A still answers from {name}, whose Lease was deleted");
    // A delete of an earlier Lease of that name (another uid) drops nothing.
    let b = replica(&api, Arc::new(clock.clone()), "replica-b", 16, ApiserverIps::fixed([])).await;
    assert_eq!(b.held_blocks(), vec![name.clone()]);
    let mut old = api.lease(&name).expect("B's Lease");
    old.metadata.uid = Some("an-earlier-uid".into());
    b.on_lease_change(Change::Delete(old));
    assert_eq!(b.held_blocks(), vec![name]);
}

/// Fault 3: a hand-over whose delete was applied but whose answer was lost. The holder
/// must not pick from the block again (the asker may have recreated it) until it knows
/// the Lease is still its own; once a retry finds it gone, the block is dropped.
#[tokio::test(start_paused = true)]
async fn a_hand_over_whose_delete_answer_was_lost_is_not_picked_from_again() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 4, ApiserverIps::fixed([])).await;
    let before = a.held_blocks();
    assert_eq!(before.len(), 2);
    api.lose_answer(fake::Call::DeleteLease);
    assert_eq!(a.hand_over(0, None).await, None, "the outcome is unknown");
    let gone: Vec<String> = before.iter().filter(|n| api.lease(n).is_none()).cloned().collect();
    assert_eq!(gone.len(), 1, "the delete was applied");
    assert!(!a.held_blocks().contains(&gone[0]), "A answers from {}, whose give-back may have been applied", gone[0]);
    let picked = drain(&a, "a").await;
    let theirs = addresses_of(&gone[0], 4);
    assert!(picked.iter().all(|ip| !theirs.contains(ip)), "A picked from {}: {picked:?}", gone[0]);
    api.heal();
    a.tick().await;
    assert!(!a.held_blocks().contains(&gone[0]));
}

/// Fault 5: a half-open connection (a call that never answers) must not freeze the
/// replica's renewals and looks: every call is bounded.
#[tokio::test(start_paused = true)]
async fn a_call_that_never_answers_does_not_stop_the_renewals() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    api.hang(fake::Call::ReplaceLease);
    api.hang(fake::Call::ListLeases);
    let t = tokio::time::timeout(s(60), a.tick()).await;
    assert!(t.is_ok(), "a tick waited 60 s for a renewal that never answers");
    api.heal();
    assert_eq!(a.tick().await.renewed, 1, "the next tick renews");
    // The admission path too: a block to take, and the apiserver never answers.
    let (api2, clock2) = (Arc::new(FakeApi::default()), ManualClock::default());
    api2.hang(fake::Call::CreateLease);
    let started = tokio::time::Instant::now();
    let b = tokio::time::timeout(s(600), replica(&api2, Arc::new(clock2), "replica-b", 16, ApiserverIps::fixed([]))).await;
    assert!(b.is_ok(), "opening waited 600 s for a create that never answers");
    let b = b.expect("opened");
    let r = tokio::time::timeout(s(60), b.allocate_next(Family::IPv4, Some(&parent("b")))).await;
    assert!(r.is_ok_and(|r| r.is_err()), "an admission waited 60 s for the apiserver (opened after {:?})", started.elapsed());
}

/// Fault 6: a Lease of our own that we do not hold (a create whose answer was lost, a
/// give-back that failed) is reclaimed while we run, not left until we restart.
#[tokio::test(start_paused = true)]
async fn an_orphaned_lease_of_our_own_is_reclaimed() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    api.lose_answer(fake::Call::CreateLease);
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    assert!(a.held_blocks().is_empty());
    let name = block_name(&range(), 0);
    assert!(api.lease(&name).is_some_and(|l| crate::k8s::lease::holder(&l) == Some(a.holder().as_str())), "the create was applied");
    api.heal();
    a.tick().await;
    let orphan = api.lease(&name).filter(|l| crate::k8s::lease::holder(l) == Some(a.holder().as_str()));
    assert!(orphan.is_none() || a.held_blocks() == vec![name.clone()], "A's own Lease {name} is neither held nor reclaimed");
    // Taken again (by anyone) it answers.
    assert!(a.allocate_next(Family::IPv4, Some(&parent("a"))).await.is_ok());
}

/// A holder that missed its renewals (paused, cut off) stops answering at D − M, before an
/// observer may take over at D; after the takeover its next renewal is refused and it drops
/// the block for good. (Was `tests/blocks.rs`: `a_holder_that_missed_its_renewals_…`, 60 s
/// of waiting on a real apiserver.)
#[tokio::test(start_paused = true)]
async fn a_holder_that_missed_its_renewals_stops_before_a_takeover_and_drops_the_block_after_it() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    let b = replica(&api, Arc::new(clock.clone()), "replica-b", 16, ApiserverIps::fixed([])).await;
    let x = a.allocate_next(Family::IPv4, Some(&parent("a-0"))).await.expect("A answers");
    api.record_address(x);
    clock.advance(D - M);
    assert!(is_full(&a.allocate_next(Family::IPv4, Some(&parent("a-more"))).await), "A answers D − M after its last renewal");
    b.tick().await;
    assert!(is_full(&b.allocate_next(Family::IPv4, Some(&parent("b-early"))).await), "B took over before D");
    clock.advance(M);
    b.tick().await;
    let picked = drain(&b, "b").await;
    assert!(!picked.is_empty() && !picked.contains(&x), "{picked:?}");
    let t = a.tick().await;
    assert_eq!(t.lost, vec![block_name(&range(), 0)], "A did not notice the takeover: {t:?}");
    assert!(a.held_blocks().is_empty());
    assert!(is_full(&a.allocate_next(Family::IPv4, Some(&parent("after"))).await));
}

fn cidr(text: &str) -> ServiceCidr {
    ServiceCidr::parse(text).expect("cidr")
}

/// ServiceCIDR objects followed: a Ready one's range gives addresses after the
/// `--service-cidr` ones are full, and accepts requested addresses; one no longer Ready
/// refuses both, and its blocks go back once no pick of them is in flight.
#[tokio::test(start_paused = true)]
async fn a_servicecidr_range_is_added_used_after_the_flag_range_and_retired() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    let extra = cidr("198.19.1.0/28");
    let requested: IpAddr = "198.19.1.5".parse().expect("ip");
    assert!(matches!(a.allocate(requested, Some(&parent("s"))).await, Err(StoreError::Alloc(AllocError::NotInRange { .. }))));
    a.set_servicecidrs([[(range(), true)].as_slice(), [(extra.clone(), true)].as_slice()]);
    assert_eq!(a.ranges(), vec![range(), extra.clone()], "--service-cidr first, each CIDR once");
    a.allocate(requested, Some(&parent("s"))).await.expect("a requested address of a Ready ServiceCIDR");
    let picked = drain_all(&a, "a", 28).await;
    let (first, second): (Vec<IpAddr>, Vec<IpAddr>) = picked.iter().partition(|ip| range().contains(**ip));
    assert_eq!(first.len(), 14, "the flag range is used up first: {picked:?}");
    assert!(picked[..14].iter().all(|ip| range().contains(*ip)), "picks left the flag range before it was full: {picked:?}");
    assert_eq!(second.len(), 13, "the ServiceCIDR's range, but for the requested address: {picked:?}");
    assert!(!picked.contains(&requested));
    let theirs = block_name(&extra, 0);
    assert!(a.held_blocks().contains(&theirs));
    // Not Ready any more (being deleted): no new address from it, none requested in it.
    a.set_servicecidrs([[(extra.clone(), false)].as_slice()]);
    assert_eq!(a.ranges(), vec![range()]);
    assert!(matches!(a.allocate("198.19.1.14".parse().expect("ip"), Some(&parent("t"))).await, Err(StoreError::Alloc(AllocError::NotInRange { .. }))));
    // Its block goes back once none of its picks is in flight.
    assert!(!a.tick().await.given_back.contains(&theirs), "given back with picks in flight");
    for ip in second.iter().chain([&requested]) {
        a.release_owned(*ip, &parent(if *ip == requested { "s" } else { "a" })).await.expect("release");
    }
    assert!(a.tick().await.given_back.contains(&theirs), "the block of a range that gives no addresses stayed held");
    assert!(api.lease(&theirs).is_none());
}

/// Ranges that overlap (a ServiceCIDR wider than `--service-cidr`, the documented way to
/// widen a cluster's range): blocks are exclusive by address, across ranges and replicas.
#[tokio::test(start_paused = true)]
async fn overlapping_ranges_never_give_one_address_twice() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let wide = cidr("198.19.0.128/26");
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    let b = replica(&api, Arc::new(clock.clone()), "replica-b", 16, ApiserverIps::fixed([])).await;
    for r in [&a, &b] {
        r.set_servicecidrs([[(wide.clone(), true)].as_slice()]);
    }
    let from_b = drain_all(&b, "b", 62).await;
    let from_a = drain_all(&a, "a", 62).await;
    let mut all: Vec<IpAddr> = from_a.iter().chain(&from_b).copied().collect();
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), n, "an address given twice: A {from_a:?}, B {from_b:?}");
    assert!(all.iter().all(|ip| wide.contains(*ip)));
    assert!(n >= 48, "the wide range's dynamic band (48 addresses) is not used up: {n}");
    assert!(from_b.iter().all(|ip| !range().contains(*ip)), "B picked inside A's block of the narrow range: {from_b:?}");
}

/// A block of one of our ranges whose holder stopped, seen from an overlapping range: its
/// Lease is deleted after the lease duration (never adopted as a block of the other range),
/// and what its holder answered is not answered again.
#[tokio::test(start_paused = true)]
async fn a_stopped_holders_block_of_an_overlapping_range_is_deleted_not_adopted() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let wide = cidr("198.19.0.128/26");
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    let x = a.allocate_next(Family::IPv4, Some(&parent("a-0"))).await.expect("A answers");
    api.record_address(x);
    // B knows the narrow range (no longer allocatable) and allocates from the wide one.
    let b = BlockStore::start(api.clone(), Arc::new(clock.clone()), vec![cidr("198.19.2.0/28")], ApiserverIps::fixed([]), "replica-b", options(16)).await.expect("start");
    b.set_servicecidrs([[(range(), false), (wide.clone(), true)].as_slice()]);
    assert_eq!(b.ranges(), vec![cidr("198.19.2.0/28"), wide.clone()]);
    b.observe().await.expect("observe");
    let early = drain_all(&b, "b-early", 62).await;
    assert!(early.iter().all(|ip| !range().contains(*ip)), "B picked inside A's live block: {early:?}");
    // A stops; after the lease duration B deletes A's Lease rather than adopting it.
    clock.advance(D);
    b.tick().await;
    let late = drain_all(&b, "b-late", 62).await;
    let narrow = block_name(&range(), 0);
    assert!(api.lease(&narrow).is_none_or(|l| crate::k8s::lease::holder(&l) != Some(b.holder().as_str())), "B adopted A's block of another range");
    assert!(late.iter().any(|ip| range().contains(*ip)), "the stopped holder's addresses never came back: {late:?}");
    assert!(!late.contains(&x), "{x}, answered by A and recorded, answered again");
}

/// A dynamic pick takes an address that left the view a moment ago (a Service deleted just
/// now, whose IPAddress the kube-apiserver's repair controller may create again) only when
/// no settled address is free, and then the one that left longest ago.
#[tokio::test(start_paused = true)]
async fn a_just_released_address_is_picked_last_and_the_longest_released_first() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let all = addresses_of("b-0", 16);
    let settled = all[10];
    let view = ApiserverIps::fixed(all.iter().copied().filter(|ip| *ip != settled)).with_clock(Arc::new(clock.clone()));
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, view.clone()).await;
    for ip in [all[3], all[1], all[7]] {
        view.remove(ip);
        clock.advance(s(1));
    }
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(a.allocate_next(Family::IPv4, Some(&parent("web"))).await.expect("a free address"));
    }
    assert_eq!(got, vec![settled, all[3], all[1], all[7]]);
    assert!(is_full(&a.allocate_next(Family::IPv4, Some(&parent("web"))).await));
}

/// Issue 32, the lagging repair controller: a kube-apiserver whose repair controller's
/// informers disagree deletes a just-stored Service's IPAddress and creates it again. In
/// that gap the pick, not the view, keeps the address: a pick is held until the view has
/// shown it recorded and [`SETTLE`] has passed since it was made — not let go when the
/// view first shows the record, as before (the next create got the address 115 ms after
/// the delete, docs/reliability.md).
#[tokio::test(start_paused = true)]
async fn a_pick_is_held_through_its_records_delete_and_recreate_after_the_view_showed_it() {
    use crate::store::ipaddress::apiserver_ips::SETTLE;
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let view = ApiserverIps::fixed([]).with_clock(Arc::new(clock.clone()));
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, view.clone()).await;
    let x = a.allocate_next(Family::IPv4, Some(&parent("first"))).await.expect("a free address");
    // The Service is stored (its record shows), a tick passes, then the repair deletes it.
    view.add(x);
    clock.advance(s(1));
    a.tick().await;
    view.remove(x);
    let rest = drain(&a, "next").await;
    assert!(!rest.contains(&x), "{x} was given again while its Service held it: {rest:?}");
    assert_eq!(rest.len(), 13, "every other address of the /28: {rest:?}");
    for ip in &rest {
        a.release_owned(*ip, &parent("next")).await.expect("give back");
    }
    // The repair's create brings the record back; SETTLE after the pick the view alone keeps it.
    view.add(x);
    clock.advance(SETTLE);
    a.tick().await;
    assert!(!drain(&a, "next").await.contains(&x), "{x} is recorded");
    // The Service is deleted: its address is free again (picked last, as just released).
    view.remove(x);
    for ip in addresses_of("b-0", 16).into_iter().filter(|ip| *ip != x && range().contains(*ip)) {
        a.release_owned(ip, &parent("next")).await.expect("give back");
    }
    assert!(drain(&a, "last").await.contains(&x), "{x} was never free again");
}

/// A rolling widen: a replica of the old, narrower range whose blocks are all taken by a
/// replica of the new range asks for the block it chose (one overlapping its range, with
/// room), and the holder hands over that block — not its block with the most room, which
/// may lie outside the asker's range and help it nothing.
#[tokio::test(start_paused = true)]
async fn a_hand_over_gives_the_asked_block_to_a_replica_of_a_narrower_range() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let (wide, narrow) = (cidr("198.19.0.128/26"), cidr("198.19.0.160/28"));
    let w = BlockStore::start(api.clone(), Arc::new(clock.clone()), vec![wide.clone()], ApiserverIps::fixed([]), "replica-w", options(8)).await.expect("start W");
    while w.acquire_locked(0, Need::Now).await.expect("W takes a block") {}
    let n = BlockStore::start(api.clone(), Arc::new(clock.clone()), vec![narrow.clone()], ApiserverIps::fixed([]), "replica-n", options(4)).await.expect("start N");
    assert!(is_full(&n.allocate_next(Family::IPv4, Some(&parent("n"))).await), "N finds no block before a hand-over");
    let asked: Vec<String> = w.held_blocks().into_iter().filter(|b| api.lease(b).is_some_and(|l| wanted_by(&l) == Some(n.holder().as_str()))).collect();
    assert_eq!(asked.len(), 1, "N asked for one of W's blocks: {asked:?}");
    let t = w.tick().await;
    assert_eq!(t.handed_over, asked, "W hands over the block N asked for");
    clock.advance(book::HANDOVER_WAIT);
    let got = n.allocate_next(Family::IPv4, Some(&parent("n"))).await.expect("N answers from the block handed over");
    assert!(narrow.contains(got), "{got}");
}

/// A shrink or a move: the old range's replicas stopped, and a block Lease of theirs names
/// addresses none of our ranges has. Nothing would ever take it over or delete it as
/// overlapping; it is deleted once seen unchanged for D — and not while its holder renews.
#[tokio::test(start_paused = true)]
async fn a_stopped_holders_block_of_a_range_sharing_nothing_with_ours_is_deleted() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let removed = cidr("198.19.3.0/28");
    let (stopped, live) = (block_name(&removed, 0), block_name(&removed, 1));
    for (name, index) in [(&stopped, 0), (&live, 1)] {
        let sp = span(&removed, 4, index).expect("a block of the removed range");
        let lease = block_lease(&removed, sp, "old-replica/1", D, now_micro());
        api.create_lease(&lease).await.unwrap_or_else(|e| panic!("create {name}: {e:?}"));
    }
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    clock.advance(D - s(1));
    a.observe().await.expect("observe");
    assert!(api.lease(&stopped).is_some(), "deleted before D");
    // The live one's holder renews.
    let mut renewed = api.lease(&live).expect("the live Lease");
    if let Some(spec) = renewed.spec.as_mut() {
        spec.renew_time = Some(now_micro());
    }
    api.replace_lease(&live, &renewed).await.expect("renew");
    clock.advance(s(2));
    a.observe().await.expect("observe");
    assert!(api.lease(&stopped).is_none(), "a stopped holder's Lease of a range sharing nothing with ours is left behind");
    assert!(api.lease(&live).is_some(), "a renewed Lease was deleted");
    let count = a.block_events().into_iter().find(|(n, _)| *n == "deleted_stale").map(|(_, c)| c);
    assert_eq!(count, Some(1));
}

/// A Lease stating a longer lease duration than ours (its holder's `--address-block-lease-
/// duration`) is waited for that long: its holder may answer until its own D − M after its
/// last renewal.
#[tokio::test(start_paused = true)]
async fn a_lease_stating_a_longer_duration_is_waited_for_that_long() {
    let (api, clock) = (Arc::new(FakeApi::default()), ManualClock::default());
    let removed = cidr("198.19.3.0/28");
    let name = block_name(&removed, 0);
    let sp = span(&removed, 4, 0).expect("a block");
    api.create_lease(&block_lease(&removed, sp, "old-replica/1", D * 2, now_micro())).await.expect("create");
    let a = replica(&api, Arc::new(clock.clone()), "replica-a", 16, ApiserverIps::fixed([])).await;
    clock.advance(D + s(1));
    a.observe().await.expect("observe");
    assert!(api.lease(&name).is_some(), "deleted after our D, before the 2 D it states");
    clock.advance(D);
    a.observe().await.expect("observe");
    assert!(api.lease(&name).is_none(), "kept after the 2 D it states");
}
