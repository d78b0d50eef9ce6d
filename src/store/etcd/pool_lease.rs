//! The pool's etcd side (its in-memory side is [`super::pool`]): the lease the
//! pool keys hang on, claims on another replica's pooled addresses and the answers to
//! claims on ours (which the committer starts, for the claims the watch-fed copy reports),
//! and handing pooled addresses out.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::alloc::AllocError;
use super::pool::{claim_key, decode_pool, pool_member, pool_prefix, Claim, ClaimAnswer, LeaseState, OwnPool, CLAIM_LEASE_TTL_S, CLAIM_TIMEOUT, LEASE_MARGIN, LEASE_TTL};
use crate::store::{Cause, StoreError};
use crate::sync::lock;

use super::client::{call, read, EtcdError};
use super::queue::{enqueue, Request};
use super::view::ClaimToAnswer;
use super::decide::{in_static_band, Op};
use super::{EtcdStore, RangeCtx};

impl EtcdStore {
    /// Ask the replica `owner` for `ip`, which its pool key lists (see the module docs of
    /// [`super::pool`]).
    pub(super) async fn claim(&self, range: usize, ip: IpAddr, owner: String) -> Result<(), StoreError> {
        match self.ask_owner(range, ip, &owner).await? {
            Some(ClaimAnswer::Granted) => {
                debug!(%ip, %owner, "took the address from another replica's pool");
                Ok(())
            }
            // Refused (handed out), or another request is claiming it right now.
            Some(ClaimAnswer::Refused) | None => Err(StoreError::Alloc(AllocError::Allocated)),
        }
    }

    /// The replica other than this one whose pool key lists `ip`, read from etcd rather
    /// than from the watched copy, which may not yet have seen a fill that just recorded it.
    pub(super) async fn pooled_elsewhere(&self, range: usize, ip: IpAddr) -> Result<Option<String>, StoreError> {
        let prefix = pool_prefix(&self.per_range[range].key);
        let resp = read(&mut self.client.clone(), &prefix, Some(GetOptions::new().with_prefix()), self.timeout).await?;
        let own = self.pool.lease().map(|l| l.member());
        Ok(resp
            .kvs()
            .iter()
            .filter(|kv| decode_pool(kv.value()).contains(&ip))
            .filter_map(|kv| kv.key_str().ok()?.strip_prefix(prefix.as_str()).map(|name| pool_member(name).to_string()))
            .find(|member| Some(member) != own.as_ref()))
    }

    /// Write a claim on `ip` and wait for `owner`'s answer. None: another request of any
    /// process claims the same address right now (and may get it).
    pub(super) async fn ask_owner(&self, range: usize, ip: IpAddr, owner: &str) -> Result<Option<ClaimAnswer>, StoreError> {
        let owner = owner.to_string();
        let key = claim_key(&self.per_range[range].key, ip);
        let (tx, answer) = oneshot::channel();
        {
            let mut w = lock(&self.waiters);
            if w.contains_key(&ip) {
                // Another request of this process is claiming the same address.
                return Ok(None);
            }
            w.insert(ip, tx);
        }
        let claim = Claim { owner: owner.clone(), claimant: self.name.clone(), answer: None };
        let mut client = self.client.clone();
        let created = match self.write_claim(&mut client, &key, &claim).await {
            Ok(created) => created,
            Err(e) => {
                lock(&self.waiters).remove(&ip);
                return Err(StoreError::Unavailable(Cause::with(format!("claiming {ip} from the pool of {owner}"), e)));
            }
        };
        if !created {
            // Someone else claims it right now: one of us gets it, and it is not us.
            lock(&self.waiters).remove(&ip);
            return Ok(None);
        }
        let answer = tokio::time::timeout(CLAIM_TIMEOUT, answer).await;
        lock(&self.waiters).remove(&ip);
        if let Err(e) = call(self.timeout, client.delete(key.clone(), None)).await {
            debug!(%key, error = %e, "could not delete an answered claim; the next claim replaces it, and its lease ends it");
        }
        match answer {
            Ok(Ok(a)) => {
                // Granted or refused, the owner does not pool it (any more): its pool key may
                // still list it until the owner rewrites it; our copy stops believing it now.
                for (_, listed) in lock(&self.per_range[range].view).pools.iter_mut().filter(|(name, _)| pool_member(name) == owner) {
                    listed.remove(&ip);
                }
                Ok(Some(a))
            }
            _ => Err(StoreError::Unavailable(Cause::new(format!(
                "{ip} is held in the address pool of replica {owner}, which did not answer a claim within {CLAIM_TIMEOUT:?}; retry"
            )))),
        }
    }

    /// Write `claim` at `key` unless a live claim is there: true when ours was written.
    ///
    /// Every claim hangs on a short lease of its own that nobody renews, so a claim left
    /// behind (its claimant died, or its delete failed) is gone within [`CLAIM_LEASE_TTL_S`]
    /// seconds. A claim that is finished already — answered, unreadable, an earlier one of
    /// ours, or addressed to a replica that no longer pools the address — is replaced at
    /// once (compare on its mod revision). So a stale claim never blocks an address.
    async fn write_claim(&self, client: &mut Client, key: &str, claim: &Claim) -> Result<bool, Cause> {
        let body = serde_json::to_vec(claim).map_err(|e| Cause::with("encoding a claim", e))?;
        let lease = call(self.timeout, client.lease_grant(CLAIM_LEASE_TTL_S, None)).await.map_err(|e| Cause::with("granting the claim's lease", e))?.id();
        let put = || TxnOp::put(key, body.clone(), Some(PutOptions::new().with_lease(lease)));
        let txn = Txn::new().when([Compare::version(key, CompareOp::Equal, 0)]).and_then([put()]).or_else([TxnOp::get(key, None)]);
        let resp = call(self.timeout, client.txn(txn)).await.map_err(|e| Cause::with("writing the claim", e))?;
        if resp.succeeded() {
            return Ok(true);
        }
        let existing = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision())),
            _ => None,
        });
        let Some((value, revision)) = existing else { return Ok(false) };
        let finished = match serde_json::from_slice::<Claim>(&value) {
            Ok(c) => c.answer.is_some() || c.claimant == claim.claimant || pool_member(&c.owner) != pool_member(&claim.owner),
            Err(_) => true,
        };
        if !finished {
            return Ok(false);
        }
        debug!(%key, "replacing a finished claim");
        let txn = Txn::new().when([Compare::mod_revision(key, CompareOp::Equal, revision)]).and_then([put()]);
        let resp = call(self.timeout, client.txn(txn)).await.map_err(|e| Cause::with("replacing a finished claim", e))?;
        Ok(resp.succeeded())
    }

    /// An address from this replica's pool, queueing the pool key rewrite and the refill it
    /// calls for.
    pub(super) fn pop_pooled(&self, range: usize) -> Option<IpAddr> {
        let p = self.pool.pop(range, Instant::now())?;
        let queue = &self.per_range[range].queue;
        if p.sync {
            enqueue(queue, Op::SyncPool);
        }
        if let Some(n) = p.refill {
            enqueue(queue, Op::Fill(n));
        }
        Some(p.ip)
    }

    /// Kubernetes' band rule: a dynamic request gets a static-band address only when the
    /// dynamic band is full. Pools hold dynamic addresses in reserve, so when the map's pick
    /// is static while a pool (ours, just refilled, or another replica's) still holds a
    /// dynamic one, take that instead and give the static one back.
    pub(super) async fn prefer_dynamic(&self, range: usize, ip: IpAddr) -> IpAddr {
        if !in_static_band(&self.ranges.cidrs()[range], ip) {
            return ip;
        }
        let better = match self.pop_pooled(range) {
            Some(ip) => Some(ip),
            None => self.claim_any(range).await,
        };
        let Some(better) = better else { return ip };
        if let Err(e) = self.submit(range, Op::Release(ip, None)).await {
            debug!(%ip, error = %e, "could not give back a static-band address; the repair pass reclaims it");
        }
        better
    }

    /// The range is full but for other replicas' pools: claim one of their addresses (a few
    /// candidates, in turn), so pools never make a range look full before it is.
    pub(super) async fn claim_any(&self, range: usize) -> Option<IpAddr> {
        const CANDIDATES: usize = 16;
        let own = self.pool.lease().map(|l| l.member());
        // (Only addresses of our own range: during a range change another replica's pool may
        // list addresses of a wider one.)
        let ours = &self.ranges.cidrs()[range];
        let candidates: Vec<(IpAddr, String)> = lock(&self.per_range[range].view)
            .pooled_by_others(own.as_deref())
            .filter(|(ip, _)| ours.offset_of(*ip).is_some())
            .map(|(ip, m)| (ip, m.to_string()))
            .take(CANDIDATES)
            .collect();
        // An owner that does not answer (dead, its lease not yet expired) is asked once.
        let mut silent: BTreeSet<String> = BTreeSet::new();
        for (ip, owner) in candidates {
            if silent.contains(&owner) {
                continue;
            }
            match self.claim(range, ip, owner.clone()).await {
                Ok(()) => return Some(ip),
                Err(e) => {
                    debug!(%ip, error = %e, "claiming a pooled address failed; trying the next");
                    if e.is_transient() {
                        silent.insert(owner);
                    }
                }
            }
        }
        None
    }

    /// Give this replica's pool back (release its addresses, delete its pool keys) and
    /// revoke its lease. Called on shutdown; a replica that dies without it leaves its pool
    /// to the lease TTL and the repair pass.
    pub async fn return_pool(&self) -> Result<usize, StoreError> {
        self.pool.close();
        let Some(lease) = self.pool.lease() else { return Ok(0) };
        let mut returned = 0;
        for (i, _) in self.per_range.iter().enumerate() {
            let ips = self.pool.take_all(i);
            returned += ips.len();
            self.submit(i, Op::Return(ips)).await?;
        }
        self.pool.set_lease(None);
        let mut client = self.client.clone();
        if let Err(e) = client.lease_revoke(lease.id).await {
            debug!(error = %e, "revoking the pool lease failed; it expires by itself");
        }
        Ok(returned)
    }
}

/// The owner's side of a claim: take the address out of our pool (from then on we never
/// hand it out) and say whether we still had it.
pub(super) async fn answer_claim(ctx: RangeCtx, ClaimToAnswer { key, ip, claim }: ClaimToAnswer) {
    let granted = ctx.pool.take(ctx.index, ip);
    if granted {
        enqueue(&ctx.queue, Op::SyncPool);
    }
    let answer = Claim { answer: Some(if granted { ClaimAnswer::Granted } else { ClaimAnswer::Refused }), ..claim };
    let Ok(body) = serde_json::to_vec(&answer) else { return };
    // Only while the claim exists (the claimant may have given up), keeping its lease.
    let txn = Txn::new()
        .when([Compare::version(key.clone(), CompareOp::Greater, 0)])
        .and_then([TxnOp::put(key.clone(), body, Some(PutOptions::new().with_ignore_lease()))]);
    let mut client = ctx.client.clone();
    match call(ctx.timeout, client.txn(txn)).await {
        Ok(r) if r.succeeded() => debug!(%ip, granted, claimant = %answer.claimant, "answered a claim on a pooled address"),
        Ok(_) => debug!(%ip, "a claim was withdrawn before it was answered; the address is left to repair"),
        Err(e) => warn!(%ip, error = %e, "could not answer a claim on a pooled address"),
    }
}

/// Hold the pool's etcd lease: grant one, renew it every third of its TTL, and when it is
/// lost (expired, or not renewed in time) drop the pool and start over with a new lease.
/// Each new lease starts a fill of every range's pool.
pub(super) async fn keep_lease(mut client: Client, pool: Arc<OwnPool>, queues: Vec<mpsc::Sender<Request>>) {
    let ttl = LEASE_TTL.as_secs() as i64;
    while !pool.is_closed() {
        let asked = Instant::now();
        let id = match client.lease_grant(ttl, None).await {
            Ok(r) => r.id(),
            Err(e) => {
                warn!(error = %e, "could not get an etcd lease for the address pool; admissions use etcd directly until it works");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut state = LeaseState { id, valid_until: asked + LEASE_TTL };
        pool.set_lease(Some(state));
        info!(lease = %state.member(), sizes = ?pool.targets(), "address pool started");
        for (i, q) in queues.iter().enumerate() {
            if let Some(n) = pool.start_fill(i, Instant::now()) {
                enqueue(q, Op::Fill(n));
            }
        }
        loop {
            tokio::time::sleep(LEASE_TTL / 3).await;
            if pool.is_closed() {
                return;
            }
            if pool.lease() != Some(state) {
                break; // dropped by the committer (lease not found)
            }
            let sent = Instant::now();
            match renew(&mut client, id).await {
                Ok(left) if left > 0 => {
                    state.valid_until = sent + Duration::from_secs(left as u64);
                    pool.set_lease(Some(state));
                }
                Ok(_) => break,
                Err(e) if Instant::now() + LEASE_MARGIN >= state.valid_until => {
                    warn!(error = %e, "the address pool's etcd lease could not be renewed in time");
                    break;
                }
                Err(e) => debug!(error = %e, "renewing the address pool's lease failed; retrying"),
            }
        }
        pool.set_lease(None);
        let dropped = pool.drop_all();
        warn!(dropped, "address pool lease lost: pooled addresses are no longer handed out (the repair pass reclaims them)");
    }
}

/// One keep-alive round trip; the TTL etcd reports (0 = the lease is gone).
async fn renew(client: &mut Client, id: i64) -> Result<i64, EtcdError> {
    let round = async {
        let (mut keeper, mut stream) = client.lease_keep_alive(id).await?;
        keeper.keep_alive().await?;
        match stream.message().await? {
            Some(r) => Ok(r.ttl()),
            None => Err(EtcdError::Closed("keep-alive stream closed")),
        }
    };
    let limit = Duration::from_secs(5);
    tokio::time::timeout(limit, round).await.map_err(|_| EtcdError::Timeout(limit))?
}
