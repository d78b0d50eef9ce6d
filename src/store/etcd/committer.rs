//! The committer of one range: takes every request waiting in the range's queue (up to
//! `max_batch`), decides them together ([`super::decide`]), and makes the decisions durable
//! in one transaction ([`super::txn`]) — retrying on a fresh copy when another writer got
//! there first. It also acts on the claims the watch-fed copy found addressed to this
//! replica's pool ([`super::view::ClaimToAnswer`]): the copy only reports them, the
//! committer answers (`pool_lease.rs`).

use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::alloc::AllocationMap;
use super::pool::{ChunkWrite, MAX_FILL_KEYS, MAX_REWRITES};
use crate::store::{Cause, StoreError};
use crate::sync::lock;

use super::client::call;
use super::decide::{decide_batch, Op, Reply};
use super::stored::decode;
use super::pool_lease::answer_claim;
use super::queue::{enqueue, Request};
use super::view::{reload, ClaimToAnswer};
use super::{txn, RangeCtx};

/// Conflicting transactions retried for one batch before its callers get an error.
const MAX_CONFLICT_RETRIES: usize = 1000;

/// Compares, and writes, etcd takes in one transaction unless started with a higher
/// `--max-txn-ops` (its default); more fail the whole transaction.
const ETCD_MAX_TXN_OPS: usize = 128;
/// Owner keys one batch may touch (an owned allocation or a release compares or writes
/// one): once a batch has this many, the rest of the queue waits for the next batch.
const MAX_OWNER_KEYS: usize = 64;
// A transaction writes the map, the owner keys and the pool keys, and compares the map and
// the owner keys: within etcd's limit whatever the queue holds.
const _: () = assert!(1 + MAX_OWNER_KEYS + MAX_FILL_KEYS + MAX_REWRITES <= ETCD_MAX_TXN_OPS);

pub(super) struct Committer {
    ctx: RangeCtx,
    max_batch: usize,
    /// The local copy may be behind etcd after an error: re-read before deciding.
    stale: bool,
}

impl Committer {
    pub(super) fn new(ctx: RangeCtx, max_batch: usize) -> Self {
        Self { ctx, max_batch: max_batch.max(1), stale: false }
    }

    /// Serve the range's queue until every sender is gone, and answer the claims on our
    /// pooled addresses that the range's watch reports.
    pub(super) async fn run(mut self, mut queue: mpsc::Receiver<Request>, mut claims: mpsc::UnboundedReceiver<ClaimToAnswer>) {
        loop {
            let first = tokio::select! {
                Some(claim) = claims.recv() => {
                    self.answer(vec![claim]);
                    continue;
                }
                first = queue.recv() => match first {
                    Some(first) => first,
                    None => return,
                },
            };
            let mut owner_keys = first.op.owner_keys();
            let mut batch = vec![first];
            while batch.len() < self.max_batch && owner_keys < MAX_OWNER_KEYS {
                match queue.try_recv() {
                    Ok(r) => {
                        owner_keys += r.op.owner_keys();
                        batch.push(r);
                    }
                    Err(_) => break,
                }
            }
            let ops: Vec<Op> = batch.iter().map(|r| r.op.clone()).collect();
            match self.commit(&ops).await {
                Ok(results) => {
                    for (req, res) in batch.into_iter().zip(results) {
                        if let Some(reply) = req.reply {
                            let _ = reply.send(res);
                        }
                    }
                }
                Err(e) => {
                    for req in batch {
                        if let Some(reply) = req.reply {
                            let _ = reply.send(Err(e.clone()));
                        }
                    }
                }
            }
        }
    }

    /// Answer each claim on its own task: an etcd round trip that no batch waits for.
    fn answer(&self, claims: Vec<ClaimToAnswer>) {
        for claim in claims {
            tokio::spawn(answer_claim(self.ctx.clone(), claim));
        }
    }

    /// Decide `ops` against the current map and make the result durable in one transaction.
    async fn commit(&mut self, ops: &[Op]) -> Result<Vec<Reply>, StoreError> {
        let result = self.commit_inner(ops).await;
        if ops.iter().any(|op| matches!(op, Op::Fill(_))) {
            // Tell the pool the fill ended, with nothing on failure (the map is unchanged then).
            // Addresses recorded under a lease that is no longer ours (lost meanwhile) are not
            // pooled: their pool key is gone, so they are records for the repair pass.
            let (filled, under) = match &result {
                Ok((_, filled, under)) => (filled.as_slice(), *under),
                Err(_) => (&[][..], None),
            };
            if !self.ctx.pool.fill_done(self.ctx.index, filled, under) {
                let addresses: usize = filled.iter().map(|c| c.addrs.len()).sum();
                warn!(key = %self.ctx.key, addresses, "a pool fill landed after its lease was lost; its addresses are left to the repair pass");
            }
        }
        result.map(|(results, _, _)| results)
    }

    /// The batch's replies, the pool keys its fills wrote and the lease they were written
    /// under.
    #[allow(clippy::type_complexity)]
    async fn commit_inner(&mut self, ops: &[Op]) -> Result<(Vec<Reply>, Vec<ChunkWrite>, Option<i64>), StoreError> {
        let key = self.ctx.key.clone();
        for attempt in 0..MAX_CONFLICT_RETRIES {
            if self.stale {
                let claims = reload(&self.ctx).await?;
                self.answer(claims);
                self.stale = false;
            }
            let (map, stored, revision, owners) = {
                let v = lock(&self.ctx.view);
                if let Some(e) = v.map_unreadable(&key) {
                    return Err(e);
                }
                (v.map.clone(), v.stored.clone(), v.revision, v.owners.clone())
            };
            let lease = self.ctx.pool.lease();
            let d = decide_batch(map, owners, &key, lease.is_some(), ops);
            let plan = (lease.is_some() && d.pool.sync && !d.pool.delete).then(|| self.ctx.pool.plan(self.ctx.index, &d.pool.filled));
            let pool_ops = txn::pool_ops(&key, lease, &d, plan.as_ref());
            if !d.map_changed && pool_ops.is_empty() && d.owner_writes.is_empty() {
                // A release of an address our copy does not know may be racing the watch
                // (another process allocated it a moment ago): read etcd once and decide again.
                if d.release_missed && attempt == 0 {
                    self.stale = true;
                    continue;
                }
                return Ok((d.replies, Vec::new(), None));
            }
            let resp = match call(self.ctx.timeout, self.ctx.client.clone().txn(txn::build(&key, revision, &stored, &d, pool_ops))).await {
                Ok(r) => r,
                Err(e) if e.lease_not_found() && lease.is_some() => {
                    // Our lease ran out under us: the pool is no longer ours to hand
                    // out. Drop it and decide the batch again without pool writes.
                    self.ctx.pool.set_lease(None);
                    let dropped = self.ctx.pool.drop_all();
                    warn!(key = %key, dropped, "the address pool's etcd lease expired; pooled addresses are left to the repair pass");
                    continue;
                }
                Err(e) => {
                    self.stale = true;
                    return Err(e.unavailable(format!("writing {key} to etcd")));
                }
            };
            if resp.succeeded() {
                if d.map_changed {
                    let new_revision = resp.header().map(|h| h.revision()).unwrap_or(revision + 1);
                    let mut v = lock(&self.ctx.view);
                    if v.revision < new_revision {
                        v.map = d.map;
                        v.stored = stored.written(&self.ctx.cidr);
                        v.revision = new_revision;
                        v.owners = d.owners;
                    }
                }
                let fills = match plan {
                    Some(plan) => {
                        self.ctx.pool.written(self.ctx.index, &plan);
                        if plan.more {
                            enqueue(&self.ctx.queue, Op::SyncPool);
                        }
                        plan.fills
                    }
                    None => Vec::new(),
                };
                return Ok((d.replies, fills, lease.map(|l| l.id)));
            }
            // Lost the race: adopt what etcd holds and decide again.
            debug!(key = %key, attempt, "allocation map changed concurrently; retrying on the new version");
            self.adopt(txn::current(&key, &resp))?;
        }
        Err(StoreError::Unavailable(Cause::new(format!("{key}: gave up after {MAX_CONFLICT_RETRIES} conflicting writes"))))
    }

    /// Take what a failed transaction read as the local copy (unless the watch brought
    /// something newer meanwhile).
    fn adopt(&self, current: txn::Current) -> Result<(), StoreError> {
        let key = &self.ctx.key;
        let (map, stored, revision) = match current.map {
            Some((value, rev)) => match decode(key, &self.ctx.cidr, &value) {
                Ok((map, stored)) => (map, stored, rev),
                Err(e) => {
                    if let StoreError::Corrupt { reason, .. } = &e {
                        lock(&self.ctx.view).unreadable.insert(key.clone(), ("allocation_map", reason.clone()));
                    }
                    return Err(e);
                }
            },
            None => (AllocationMap::new(self.ctx.cidr.clone()), super::stored::Stored::as_configured(&self.ctx.cidr), 0),
        };
        let mut v = lock(&self.ctx.view);
        if v.revision <= revision {
            v.map = map;
            v.stored = stored;
            v.revision = revision;
            // Read in the same transaction as the map, so of the same moment.
            if let Some(owned) = current.owners {
                v.owners = owned;
            }
        }
        Ok(())
    }
}
