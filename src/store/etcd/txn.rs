//! One batch's transaction: `if <the map's mod revision and every owner key are as the
//! decisions assumed> then <write the map, the owner keys, the pool keys> else <read the map
//! and the owner keys>`, and the reading of its `else` branch.

use std::collections::BTreeMap;
use std::net::IpAddr;

use etcd_client::{Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};

use super::pool::{encode_pool, member_pool_prefix, pool_key, LeaseState, PoolPlan};
use crate::store::ParentRef;

use super::decide::{Decided, OwnerGuard, OwnerWrite};
use super::stored::Stored;
use super::keys::{encode_owner, owner_key, owner_prefix, owners_in};

/// The writes to this replica's pool keys the decisions call for: all of them deleted (the
/// pool was returned), or `plan`'s keys written on `lease` (an emptied one deleted).
pub(super) fn pool_ops(key: &str, lease: Option<LeaseState>, d: &Decided, plan: Option<&PoolPlan>) -> Vec<TxnOp> {
    let Some(l) = lease else { return Vec::new() };
    let member = l.member();
    if d.pool.delete {
        return vec![TxnOp::delete(member_pool_prefix(key, &member), Some(DeleteOptions::new().with_prefix()))];
    }
    let Some(plan) = plan.filter(|_| d.pool.sync) else { return Vec::new() };
    plan.rewrites
        .iter()
        .chain(&plan.fills)
        .map(|c| {
            let k = pool_key(key, &member, c.chunk);
            if c.addrs.is_empty() {
                TxnOp::delete(k, None)
            } else {
                TxnOp::put(k, encode_pool(c.addrs.iter().copied()), Some(PutOptions::new().with_lease(l.id)))
            }
        })
        .collect()
}

/// The transaction of decisions made on the copy of `key` at `revision` (0: the key did not
/// exist), whose value holds `stored` beside the decided map.
pub(super) fn build(key: &str, revision: i64, stored: &Stored, d: &Decided, pool_ops: Vec<TxnOp>) -> Txn {
    let mut then = Vec::new();
    let mut guards = Vec::new();
    if d.map_changed {
        guards.push(if revision == 0 {
            Compare::version(key, CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(key, CompareOp::Equal, revision)
        });
        then.push(TxnOp::put(key, stored.encode(&d.map), None));
    }
    then.extend(pool_ops);
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
