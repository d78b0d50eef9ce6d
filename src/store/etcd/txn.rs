//! One batch's transaction: `if <the map's mod revision and every owner key are as the
//! decisions assumed> then <write the map, the owner keys, the pool key> else <read the map
//! and the owner keys>`, and the reading of its `else` branch.

use std::collections::BTreeMap;
use std::net::IpAddr;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};

use crate::store::etcd_pool::{encode_pool, pool_prefix, LeaseState};
use crate::store::ParentRef;

use super::decide::{Decided, OwnerGuard, OwnerWrite};
use super::keys::{encode_owner, owner_key, owner_prefix, owners_in};

/// The write of this replica's pool key the decisions call for, if any: deleted (returned),
/// or rewritten to `listing` (what the pool holds, plus the batch's fills) on `lease`.
pub(super) fn pool_op(key: &str, lease: Option<LeaseState>, d: &Decided, listing: impl FnOnce() -> Vec<IpAddr>) -> Option<TxnOp> {
    match lease {
        Some(l) if d.pool.delete => Some(TxnOp::delete(format!("{}{}", pool_prefix(key), l.member()), None)),
        Some(l) if d.pool.sync => {
            let mut listing = listing();
            listing.extend_from_slice(&d.pool.filled);
            Some(TxnOp::put(format!("{}{}", pool_prefix(key), l.member()), encode_pool(listing), Some(PutOptions::new().with_lease(l.id))))
        }
        _ => None,
    }
}

/// The transaction of decisions made on the copy of `key` at `revision` (0: the key did not
/// exist).
pub(super) fn build(key: &str, revision: i64, d: &Decided, pool_op: Option<TxnOp>) -> Txn {
    let mut then = Vec::new();
    let mut guards = Vec::new();
    if d.map_changed {
        guards.push(if revision == 0 {
            Compare::version(key, CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(key, CompareOp::Equal, revision)
        });
        then.push(TxnOp::put(key, d.map.snapshot(), None));
    }
    then.extend(pool_op);
    guards.extend(d.owner_guards.iter().map(|g| match g {
        OwnerGuard::Absent(ip) => Compare::version(owner_key(key, *ip), CompareOp::Equal, 0),
        OwnerGuard::Is(ip, o) => Compare::value(owner_key(key, *ip), CompareOp::Equal, encode_owner(o)),
    }));
    then.extend(d.owner_writes.iter().map(|w| match w {
        OwnerWrite::Put(ip, o) => TxnOp::put(owner_key(key, *ip), encode_owner(o), None),
        OwnerWrite::Delete(ip) => TxnOp::delete(owner_key(key, *ip), None),
    }));
    Txn::new()
        .when(guards)
        .and_then(then)
        .or_else([TxnOp::get(key, None), TxnOp::get(owner_prefix(key), Some(GetOptions::new().with_prefix()))])
}

/// What a failed transaction's `else` branch read: the map's value and mod revision (None:
/// the key does not exist) and the owner keys, both of the same moment.
pub(super) struct Current {
    pub map: Option<(Vec<u8>, i64)>,
    pub owners: Option<BTreeMap<IpAddr, ParentRef>>,
}

pub(super) fn current(key: &str, resp: &TxnResponse) -> Current {
    let mut gets = resp.op_responses().into_iter().filter_map(|r| match r {
        TxnOpResponse::Get(g) => Some(g),
        _ => None,
    });
    let map = gets.next().and_then(|g| g.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision())));
    let prefix = owner_prefix(key);
    let owners = gets.next().map(|g| owners_in(&prefix, g.kvs()).collect());
    Current { map, owners }
}
