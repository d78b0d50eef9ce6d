//! The decisions of one batch: what each request of a range's queue gets, and what the
//! transaction must write and compare for it. Pure: the local copy of the range (its map and
//! its owner keys) and the requests in, the decisions out; no I/O, no etcd types. The
//! committer ([`super::committer`]) turns the decisions into one transaction and retries
//! with fresh inputs when etcd says the copy was stale.

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::alloc::{AllocError, AllocationMap};
use crate::cidr::ServiceCidr;
use crate::store::{ParentRef, StoreError};

use super::pool::{CHUNK, MAX_FILL_KEYS};

use super::keys::{owner_key, OWNER_CONSEQUENCE, UNREADABLE_OWNER};

/// One request to a range's committer.
#[derive(Clone, Debug)]
pub(super) enum Op {
    /// Record the address; with an owner, also its owner key.
    Allocate(IpAddr, Option<ParentRef>),
    AllocateNext(Option<ParentRef>),
    /// Release the address: with no owner, only while no owner key exists; with one, only
    /// while the owner key names it (the key is deleted with it).
    Release(IpAddr, Option<ParentRef>),
    /// Record the owner of an address the map already holds for us (taken from a pool).
    Own(IpAddr, ParentRef),
    /// Record up to this many addresses into this replica's pool (see [`super::pool`]),
    /// at most [`MAX_FILL_KEYS`] keys' worth in one transaction.
    Fill(usize),
    /// Rewrite this replica's pool key to what its pool holds now.
    SyncPool,
    /// Release these addresses (the pool, returned on shutdown) and delete the pool key.
    Return(Vec<IpAddr>),
}

impl Op {
    /// Owner keys the op compares or writes (at most one): what a batch's transaction spends
    /// of etcd's operation limit on it ([`super::committer`] cuts batches by it).
    pub(super) fn owner_keys(&self) -> usize {
        match self {
            Op::Allocate(_, Some(_)) | Op::AllocateNext(Some(_)) | Op::Own(..) | Op::Release(..) => 1,
            _ => 0,
        }
    }
}

/// Per op: the addresses it recorded (none for a release).
pub(super) type Reply = Result<Vec<IpAddr>, StoreError>;

/// What an owner key must be for the transaction to apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum OwnerGuard {
    /// No owner key exists for the address.
    Absent(IpAddr),
    /// The owner key names exactly this owner.
    Is(IpAddr, ParentRef),
}

/// An owner key the transaction writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum OwnerWrite {
    Put(IpAddr, ParentRef),
    Delete(IpAddr),
}

/// What the batch writes to this replica's pool key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct PoolWrite {
    /// Addresses the batch's fills recorded.
    pub filled: Vec<IpAddr>,
    /// Rewrite the pool key.
    pub sync: bool,
    /// Delete the pool key (the pool was returned).
    pub delete: bool,
}

/// The decisions of one batch.
#[derive(Debug)]
pub(super) struct Decided {
    /// The map after every request (write it when `map_changed`).
    pub map: AllocationMap,
    /// The owners after every request.
    pub owners: BTreeMap<IpAddr, ParentRef>,
    /// Per request, in order: its answer once the transaction succeeds.
    pub replies: Vec<Reply>,
    pub map_changed: bool,
    /// A release found its address free in the copy: the copy may lag the watch.
    pub release_missed: bool,
    pub owner_guards: Vec<OwnerGuard>,
    pub owner_writes: Vec<OwnerWrite>,
    pub pool: PoolWrite,
}

/// Decide `ops`, in order, against `map` and `owners` (the local copy of the range stored
/// at `key`; `key` only names records in error texts). `pool_lease`: this replica holds a
/// live pool lease (fills record nothing without one). Each request sees the effects of the
/// ones before it, so two requests for one address in one batch get one success.
pub(super) fn decide_batch(mut map: AllocationMap, mut owners: BTreeMap<IpAddr, ParentRef>, key: &str, pool_lease: bool, ops: &[Op]) -> Decided {
    let mut map_changed = false;
    let mut release_missed = false;
    let mut pool = PoolWrite::default();
    let mut owner_guards = Vec::new();
    let mut owner_writes = Vec::new();
    let replies = ops
        .iter()
        .map(|op| match op {
            Op::Allocate(ip, owner) => {
                map.allocate(*ip)?;
                map_changed = true;
                if let Some(o) = owner {
                    owner_writes.push(OwnerWrite::Put(*ip, o.clone()));
                    owners.insert(*ip, o.clone());
                }
                Ok(vec![*ip])
            }
            Op::AllocateNext(owner) => {
                let ip = map.allocate_next()?;
                map_changed = true;
                if let Some(o) = owner {
                    owner_writes.push(OwnerWrite::Put(ip, o.clone()));
                    owners.insert(ip, o.clone());
                }
                Ok(vec![ip])
            }
            Op::Release(ip, releaser) => {
                match (owners.get(ip), releaser) {
                    (Some(o), _) if o.resource == UNREADABLE_OWNER => {
                        return Err(StoreError::Corrupt {
                            record: format!("the owner record {}", owner_key(key, *ip)),
                            reason: "not a parentRef".into(),
                            consequence: OWNER_CONSEQUENCE,
                        })
                    }
                    (Some(o), None) => return Err(StoreError::NotOwner { ip: *ip, owner: o.clone() }),
                    (Some(o), Some(r)) if o != r => return Err(StoreError::NotOwner { ip: *ip, owner: o.clone() }),
                    (Some(o), Some(_)) => {
                        owner_guards.push(OwnerGuard::Is(*ip, o.clone()));
                        owner_writes.push(OwnerWrite::Delete(*ip));
                        owners.remove(ip);
                    }
                    (None, Some(_)) if map.has(*ip) => return Err(StoreError::NoOwnerRecorded(*ip)),
                    (None, _) => owner_guards.push(OwnerGuard::Absent(*ip)),
                }
                if map.has(*ip) {
                    map.release(*ip);
                    map_changed = true;
                } else {
                    release_missed = true;
                }
                Ok(Vec::new())
            }
            Op::Own(ip, o) => {
                if !map.has(*ip) || owners.contains_key(ip) {
                    return Err(AllocError::Allocated.into());
                }
                owner_guards.push(OwnerGuard::Absent(*ip));
                owner_writes.push(OwnerWrite::Put(*ip, o.clone()));
                owners.insert(*ip, o.clone());
                Ok(vec![*ip])
            }
            Op::Fill(n) => {
                if !pool_lease {
                    return Ok(Vec::new());
                }
                let got = fill(&mut map, (*n).min(MAX_FILL_KEYS * CHUNK));
                map_changed |= !got.is_empty();
                pool.filled.extend_from_slice(&got);
                pool.sync = true;
                Ok(got)
            }
            Op::SyncPool => {
                pool.sync = true;
                Ok(Vec::new())
            }
            Op::Return(ips) => {
                for ip in ips {
                    if map.has(*ip) {
                        map.release(*ip);
                        map_changed = true;
                    }
                }
                pool.delete = true;
                Ok(Vec::new())
            }
        })
        .collect();
    Decided { map, owners, replies, map_changed, release_missed, owner_guards, owner_writes, pool }
}

/// Up to `n` addresses for a pool, from the dynamic band only: the static band is for
/// requested addresses and for dynamic requests once the dynamic band is full, never a
/// reserve.
fn fill(map: &mut AllocationMap, n: usize) -> Vec<IpAddr> {
    let mut got = Vec::new();
    while got.len() < n {
        match map.allocate_next() {
            Ok(ip) if in_static_band(map.cidr(), ip) => {
                map.release(ip);
                break;
            }
            Ok(ip) => got.push(ip),
            Err(_) => break,
        }
    }
    got
}

pub(super) fn in_static_band(cidr: &ServiceCidr, ip: IpAddr) -> bool {
    cidr.static_band().is_some_and(|b| b.first <= ip && ip <= b.last)
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
