//! Unit tests of [`decide_batch`]: one batch's decisions, without etcd.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::*;
use crate::alloc::{AllocError, AllocationMap};
use crate::cidr::ServiceCidr;
use crate::store::{ParentRef, StoreError};

const KEY: &str = "/clusterip/ranges/198.18.0.0/27";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// 198.18.0.0/27: static band .1–.16, dynamic band .17–.30.
fn map_with(held: &[&str]) -> AllocationMap {
    let mut m = AllocationMap::new(ServiceCidr::parse("198.18.0.0/27").unwrap());
    for a in held {
        m.allocate(ip(a)).unwrap();
    }
    m
}

fn gateway(name: &str) -> ParentRef {
    ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("ns".into()), name: name.into() }
}

fn no_owners() -> BTreeMap<IpAddr, ParentRef> {
    BTreeMap::new()
}

fn decide(map: AllocationMap, owners: BTreeMap<IpAddr, ParentRef>, ops: &[Op]) -> Decided {
    decide_batch(map, owners, KEY, false, ops)
}

#[test]
fn static_request_takes_a_free_address_and_refuses_a_held_one() {
    let d = decide(map_with(&["198.18.0.5"]), no_owners(), &[Op::Allocate(ip("198.18.0.4"), None), Op::Allocate(ip("198.18.0.5"), None)]);
    assert_eq!(d.replies[0].as_ref().unwrap(), &vec![ip("198.18.0.4")]);
    assert!(matches!(d.replies[1], Err(StoreError::Alloc(AllocError::Allocated))));
    assert!(d.map_changed);
    assert!(d.map.has(ip("198.18.0.4")));
    assert!(d.owner_guards.is_empty() && d.owner_writes.is_empty());
}

#[test]
fn refused_requests_change_nothing() {
    let d = decide(map_with(&["198.18.0.5"]), no_owners(), &[Op::Allocate(ip("198.18.0.5"), None)]);
    assert!(!d.map_changed);
    assert_eq!(d.map.used(), 1);
}

#[test]
fn dynamic_requests_get_distinct_dynamic_band_addresses() {
    let ops = vec![Op::AllocateNext(None); 3];
    let d = decide(map_with(&[]), no_owners(), &ops);
    let got: Vec<IpAddr> = d.replies.iter().map(|r| r.as_ref().unwrap()[0]).collect();
    let distinct: std::collections::BTreeSet<_> = got.iter().collect();
    assert_eq!(distinct.len(), 3, "{got:?}");
    assert!(got.iter().all(|a| !in_static_band(d.map.cidr(), *a)), "{got:?}");
    assert!(d.map_changed);
    assert_eq!(d.map.used(), 3);
}

#[test]
fn an_owned_allocation_writes_its_owner_key() {
    let g = gateway("g");
    let d = decide(map_with(&[]), no_owners(), &[Op::Allocate(ip("198.18.0.3"), Some(g.clone())), Op::AllocateNext(Some(g.clone()))]);
    let next = d.replies[1].as_ref().unwrap()[0];
    assert_eq!(d.owner_writes, vec![OwnerWrite::Put(ip("198.18.0.3"), g.clone()), OwnerWrite::Put(next, g.clone())]);
    assert_eq!(d.owners.get(&ip("198.18.0.3")), Some(&g));
    assert!(d.owner_guards.is_empty());
}

#[test]
fn a_full_range_answers_full() {
    // Every address but one; the second dynamic request of the batch finds the range full.
    let all: Vec<String> = (1..=29).map(|i| format!("198.18.0.{i}")).collect();
    let held: Vec<&str> = all.iter().map(String::as_str).collect();
    let d = decide(map_with(&held), no_owners(), &[Op::AllocateNext(None), Op::AllocateNext(None)]);
    assert_eq!(d.replies[0].as_ref().unwrap(), &vec![ip("198.18.0.30")]);
    assert!(matches!(d.replies[1], Err(StoreError::Alloc(AllocError::Full))));
    let full = decide(d.map, no_owners(), &[Op::AllocateNext(None)]);
    assert!(matches!(full.replies[0], Err(StoreError::Alloc(AllocError::Full))));
    assert!(!full.map_changed);
}

#[test]
fn duplicates_within_one_batch_get_one_success() {
    let a = ip("198.18.0.7");
    let d = decide(map_with(&[]), no_owners(), &[Op::Allocate(a, None), Op::Allocate(a, None), Op::Release(a, None), Op::Allocate(a, None)]);
    assert!(d.replies[0].is_ok());
    assert!(matches!(d.replies[1], Err(StoreError::Alloc(AllocError::Allocated))));
    // A release later in the batch sees the allocation before it, and the next request its release.
    assert!(d.replies[2].is_ok());
    assert!(d.replies[3].is_ok());
    assert!(d.map.has(a));
    assert!(!d.release_missed);
}

#[test]
fn an_unowned_release_requires_that_no_owner_key_exists() {
    let a = ip("198.18.0.9");
    let d = decide(map_with(&["198.18.0.9"]), no_owners(), &[Op::Release(a, None)]);
    assert!(d.replies[0].is_ok());
    assert_eq!(d.owner_guards, vec![OwnerGuard::Absent(a)]);
    assert!(d.owner_writes.is_empty());
    assert!(d.map_changed && !d.map.has(a));
}

#[test]
fn owner_conditional_releases() {
    let a = ip("198.18.0.9");
    let g = gateway("g");
    let owners: BTreeMap<IpAddr, ParentRef> = [(a, g.clone())].into();
    // Without an owner, or by another owner: refused, nothing changes.
    let d = decide(map_with(&["198.18.0.9"]), owners.clone(), &[Op::Release(a, None), Op::Release(a, Some(gateway("other")))]);
    for r in &d.replies {
        assert!(matches!(r, Err(StoreError::NotOwner { ip, owner }) if *ip == a && *owner == g), "{r:?}");
    }
    assert!(!d.map_changed && d.owner_guards.is_empty() && d.owner_writes.is_empty());
    // By its owner: released, the owner key compared and deleted in the same transaction.
    let d = decide(map_with(&["198.18.0.9"]), owners, &[Op::Release(a, Some(g.clone()))]);
    assert!(d.replies[0].is_ok());
    assert_eq!(d.owner_guards, vec![OwnerGuard::Is(a, g)]);
    assert_eq!(d.owner_writes, vec![OwnerWrite::Delete(a)]);
    assert!(!d.map.has(a) && d.owners.is_empty());
}

#[test]
fn an_owned_release_of_an_address_recorded_without_an_owner_is_refused() {
    let a = ip("198.18.0.9");
    let d = decide(map_with(&["198.18.0.9"]), no_owners(), &[Op::Release(a, Some(gateway("g")))]);
    assert!(matches!(d.replies[0], Err(StoreError::NoOwnerRecorded(x)) if x == a));
    assert!(!d.map_changed);
}

#[test]
fn an_unreadable_owner_key_keeps_its_address() {
    let a = ip("198.18.0.9");
    let unreadable = ParentRef { group: String::new(), resource: UNREADABLE_OWNER.into(), namespace: None, name: "garbage".into() };
    let d = decide(map_with(&["198.18.0.9"]), [(a, unreadable)].into(), &[Op::Release(a, None)]);
    match &d.replies[0] {
        Err(StoreError::Corrupt { record, .. }) => assert!(record.contains(&owner_key(KEY, a)), "{record}"),
        r => panic!("{r:?}"),
    }
    assert!(d.map.has(a) && !d.map_changed);
}

#[test]
fn a_release_of_a_free_address_is_noted_as_missed() {
    let d = decide(map_with(&[]), no_owners(), &[Op::Release(ip("198.18.0.9"), None)]);
    assert!(d.replies[0].is_ok());
    assert!(d.release_missed && !d.map_changed);
}

#[test]
fn own_records_an_owner_only_for_a_held_unowned_address() {
    let g = gateway("g");
    let d = decide(map_with(&["198.18.0.20"]), no_owners(), &[Op::Own(ip("198.18.0.20"), g.clone()), Op::Own(ip("198.18.0.21"), g.clone()), Op::Own(ip("198.18.0.20"), g.clone())]);
    assert!(d.replies[0].is_ok());
    assert!(matches!(d.replies[1], Err(StoreError::Alloc(AllocError::Allocated))));
    assert!(matches!(d.replies[2], Err(StoreError::Alloc(AllocError::Allocated))));
    assert_eq!(d.owner_guards, vec![OwnerGuard::Absent(ip("198.18.0.20"))]);
    assert_eq!(d.owner_writes, vec![OwnerWrite::Put(ip("198.18.0.20"), g)]);
    assert!(!d.map_changed);
}

#[test]
fn fills_take_the_dynamic_band_only_and_only_under_a_lease() {
    let none = decide_batch(map_with(&[]), no_owners(), KEY, false, &[Op::Fill(4)]);
    assert_eq!(none.replies[0].as_ref().unwrap(), &Vec::<IpAddr>::new());
    assert!(!none.map_changed && none.pool == PoolWrite::default());

    let d = decide_batch(map_with(&[]), no_owners(), KEY, true, &[Op::Fill(100)]);
    let got = d.replies[0].as_ref().unwrap();
    assert_eq!(got.len(), 14, "the whole dynamic band, never the static one: {got:?}");
    assert!(got.iter().all(|a| !in_static_band(d.map.cidr(), *a)));
    assert_eq!(&d.pool.filled, got);
    assert!(d.pool.sync && d.map_changed);
}

#[test]
fn a_returned_pool_is_released_and_its_key_deleted() {
    let d = decide(map_with(&["198.18.0.20", "198.18.0.21"]), no_owners(), &[Op::SyncPool, Op::Return(vec![ip("198.18.0.20"), ip("198.18.0.22")])]);
    assert!(d.replies.iter().all(|r| r.is_ok()));
    assert!(d.pool.sync && d.pool.delete);
    assert!(!d.map.has(ip("198.18.0.20")) && d.map.has(ip("198.18.0.21")));
    assert!(d.map_changed);
}

#[test]
fn a_fill_records_at_most_max_fill_keys_worth_of_addresses() {
    // A /20's dynamic band holds 3838: a fill of 4000 records what 16 pool keys list, so the
    // transaction stays within etcd's operation limit (the next pop asks for the rest).
    let map = AllocationMap::new(ServiceCidr::parse("198.18.0.0/20").unwrap());
    let d = decide_batch(map, no_owners(), KEY, true, &[Op::Fill(4000)]);
    assert_eq!(d.pool.filled.len(), MAX_FILL_KEYS * CHUNK);
}

#[test]
fn only_ops_that_name_an_owner_key_count_against_the_batch_limit() {
    assert_eq!(Op::Allocate(ip("198.18.0.4"), None).owner_keys(), 0);
    assert_eq!(Op::AllocateNext(None).owner_keys(), 0);
    assert_eq!(Op::Allocate(ip("198.18.0.4"), Some(gateway("a"))).owner_keys(), 1);
    assert_eq!(Op::AllocateNext(Some(gateway("a"))).owner_keys(), 1);
    assert_eq!(Op::Own(ip("198.18.0.4"), gateway("a")).owner_keys(), 1);
    assert_eq!(Op::Release(ip("198.18.0.4"), None).owner_keys(), 1, "compares the owner key's absence");
    assert_eq!(Op::Fill(10).owner_keys() + Op::SyncPool.owner_keys() + Op::Return(Vec::new()).owner_keys(), 0);
}
