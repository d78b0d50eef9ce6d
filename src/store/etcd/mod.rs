//! The etcd backend: one key per service CIDR holding the allocation map's snapshot.
//!
//! - Key: `<prefix>/<cidr>` (default prefix `/clusterip/ranges`), value: the versioned
//!   snapshot of [`AllocationMap`] (see docs/allocator.md).
//! - Every change is one etcd transaction: `if mod_revision(key) == known then put else get`.
//!   On conflict the map is rebuilt from the value the `else` branch returned and the
//!   requests are decided again — a dynamic request may get a different address, a static
//!   one may now find its address taken.
//! - Group commit: one committer task per range takes every request waiting in its queue
//!   (up to `max_batch`) and makes them durable in one transaction. With `max_batch = 1`
//!   it is one compare-and-swap per allocation, Kubernetes' strategy.
//! - A watch on each key keeps the local copy current, so reads never go to etcd and a
//!   transaction rarely conflicts on a stale copy.
//! - An answer is sent only after etcd acknowledged the write. When etcd is unreachable the
//!   callers get `Unavailable`, the local copy is marked stale and re-read before the next
//!   transaction; an allocation whose acknowledgement was lost is a leak for repair to
//!   reclaim, never a second owner.
//! - With an address pool (`pool_size > 0`, the controller), dynamic requests are answered
//!   from addresses this process recorded ahead of need; see [`pool`] for how
//!   pool keys, the lease and claims keep that race-free.
//! - Owners other than Services (a Gateway, anything `clusterip allocate --parent` names)
//!   are recorded under `<range key>/owner/<address>` (the parentRef as JSON), written in
//!   the same transaction as the allocation and deleted in the same transaction as the
//!   release. A release is conditional on the owner key: an unowned release (a Service's
//!   address, the repair pass) requires that no owner key exists, an owned one that the key
//!   names the releaser — each as a compare in the transaction, so a stale copy can only
//!   cause a retry, never a release of another owner's address. Service addresses carry
//!   no owner key: the kube-apiserver records them itself, as IPAddress objects.
//! - A value that cannot be decoded is never guessed at: an unreadable map stops every
//!   change to its range (and reads of what it holds) with [`StoreError::Corrupt`] and is
//!   never overwritten, until [`EtcdStore::rebuild_unreadable`] (`clusterip repair
//!   --rebuild`) replaces it; an unreadable owner key keeps its address held. Both are
//!   reported by [`AllocationStore::unreadable`].
//!
//! The parts, one file each under `etcd/`: `client` (flags, connection, the one request
//! translator), `keys` (the keys and their values), `stored` (the map's stored form, range
//! changes), `decide` (the pure decisions of one batch), `txn` (the transaction that makes
//! them durable), `queue` (a range's queue), `committer` (the retry loop serving it, and the
//! one that answers claims), `view` (the watch-fed local copy: it only reads, and returns
//! the claims it sees to the committer), `pool` (the address pool's in-memory side and key
//! formats) and `pool_lease` (the pool's etcd side: its lease, claims, hand-outs). Imports
//! point one way: `view` → `pool`; `committer` → `view`, `pool_lease` → `queue`. This file
//! holds the store and its [`AllocationStore`] methods.

mod client;
mod committer;
mod decide;
mod keys;
pub mod pool;
mod pool_lease;
mod queue;
mod stored;
mod txn;
mod view;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp};
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tracing::info;

use crate::alloc::{AllocError, AllocationMap};
use crate::cidr::{Family, ServiceCidr};

use pool::{decode_pool, pool_target, ClaimAnswer, OwnPool};
use super::{AllocationStore, BackendKind, Cause, ParentRef, RangeSet, RangeUsage, StoreError, Unreadable};
use crate::sync::lock;

pub use client::{call, connect, EtcdArgs, EtcdConfig, EtcdError, DEFAULT_MAX_BATCH, DEFAULT_PREFIX};
pub use keys::{owner_key, owner_prefix, range_key, UNREADABLE_OWNER};

use client::{get, read};
use committer::Committer;
use queue::{enqueue, Request};
use decide::{Op, Reply};
use keys::{classify, decode_owner, owners_in, Under};
use pool_lease::keep_lease;
use view::{reload, watch_range, View};

/// How long `/readyz` waits for etcd (the Deployment's probe gives up after 2 s).
const READY_TIMEOUT: Duration = Duration::from_millis(1500);

struct Range {
    key: String,
    view: Arc<Mutex<View>>,
    queue: mpsc::Sender<Request>,
}

/// Claims this process is waiting on: address → where the owner's answer goes.
type Waiters = Arc<Mutex<HashMap<IpAddr, oneshot::Sender<ClaimAnswer>>>>;

/// Allocation records in etcd. Cheap to share (`Arc`); background tasks end when dropped.
pub struct EtcdStore {
    ranges: RangeSet,
    per_range: Vec<Range>,
    client: Client,
    timeout: Duration,
    pool: Arc<OwnPool>,
    /// Our name in claims we make.
    name: String,
    waiters: Waiters,
    /// Each range's committer and watch, the lease keeper: aborted when the store drops.
    _tasks: JoinSet<()>,
}

/// What the parts of one range share: its committer, its watch and the answers to claims
/// on its pooled addresses.
#[derive(Clone)]
struct RangeCtx {
    index: usize,
    key: String,
    cidr: ServiceCidr,
    view: Arc<Mutex<View>>,
    pool: Arc<OwnPool>,
    queue: mpsc::Sender<Request>,
    name: String,
    waiters: Waiters,
    client: Client,
    timeout: Duration,
}

fn unique_name() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
    format!("p{}-{nanos:x}", std::process::id())
}

impl EtcdStore {
    /// Connect, read every range's key (absent = empty) and start the committers and watches.
    /// With `cfg.pool_size > 0` this replica also keeps an address pool per range.
    pub async fn open(cfg: &EtcdConfig, cidrs: Vec<ServiceCidr>) -> Result<Self, StoreError> {
        if cidrs.is_empty() {
            return Err(StoreError::Config("no service CIDR configured".into()));
        }
        let client = connect(cfg).await?;
        let targets: Vec<usize> = cidrs.iter().map(|c| pool_target(cfg.pool_size, c)).collect();
        let pool = Arc::new(OwnPool::new(&targets));
        let name = unique_name();
        let waiters: Waiters = Arc::default();
        let mut per_range = Vec::new();
        let mut tasks = JoinSet::new();
        let keys = stored_keys(&client, &cfg.prefix, &cidrs, cfg.request_timeout).await?;
        for ((index, cidr), key) in cidrs.iter().enumerate().zip(keys) {
            let view = Arc::new(Mutex::new(View {
                map: AllocationMap::new(cidr.clone()),
                stored: stored::Stored::as_configured(cidr),
                revision: 0,
                map_bytes: 0,
                watched: 0,
                pools: BTreeMap::new(),
                owners: BTreeMap::new(),
                unreadable: BTreeMap::new(),
            }));
            let (tx, rx) = mpsc::channel(65536);
            let ctx = RangeCtx {
                index,
                key: key.clone(),
                cidr: cidr.clone(),
                view: view.clone(),
                pool: pool.clone(),
                queue: tx.clone(),
                name: name.clone(),
                waiters: waiters.clone(),
                client: client.clone(),
                timeout: cfg.request_timeout,
            };
            // Claims on our pooled addresses: the watch-fed copy finds them, the committer
            // answers them.
            let (claims, claims_rx) = mpsc::unbounded_channel();
            for claim in reload(&ctx).await? {
                let _ = claims.send(claim);
            }
            refuse_held_outside(&lock(&view), cidr, &key)?;
            let committer = Committer::new(ctx.clone(), cfg.max_batch);
            tasks.spawn(committer.run(rx, claims_rx));
            tasks.spawn(watch_range(ctx, claims));
            per_range.push(Range { key, view, queue: tx });
        }
        let queues: Vec<_> = per_range.iter().map(|r| r.queue.clone()).collect();
        if pool.enabled() {
            tasks.spawn(keep_lease(client.clone(), pool.clone(), queues));
        }
        Ok(Self { ranges: RangeSet::new(cidrs), per_range, client, timeout: cfg.request_timeout, pool, name, waiters, _tasks: tasks })
    }

    /// The etcd key of each range.
    pub fn keys(&self) -> Vec<String> {
        self.per_range.iter().map(|r| r.key.clone()).collect()
    }

    /// Addresses this replica holds in its pool, per range (in configuration order).
    pub fn pooled(&self) -> Vec<usize> {
        (0..self.per_range.len()).map(|i| self.pool.len(i)).collect()
    }

    /// Whether this replica's pool can hand out addresses now (a pool is configured, its
    /// lease is alive and at least one address is pooled).
    pub fn pool_ready(&self) -> bool {
        self.pool.live_lease(Instant::now()).is_some() && self.pool.targets().iter().enumerate().all(|(i, t)| *t == 0 || self.pool.len(i) > 0)
    }

    async fn submit(&self, range: usize, op: Op) -> Reply {
        let (reply, answer) = oneshot::channel();
        self.per_range[range]
            .queue
            .send(Request { op, reply: Some(reply) })
            .await
            .map_err(|_| StoreError::Unavailable(Cause::new("etcd committer stopped")))?;
        answer.await.map_err(|_| StoreError::Unavailable(Cause::new("etcd committer stopped")))?
    }

    /// The raw value of any etcd key (for importing the kube-apiserver's legacy bitmap), or
    /// None when the key does not exist.
    pub async fn read_key(cfg: &EtcdConfig, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut client = connect(cfg).await?;
        Ok(get(&mut client, key, cfg.request_timeout).await?.map(|(value, _)| value))
    }

    /// Merge every address of `legacy` into the stored map of the same CIDR (a union:
    /// nothing stored is dropped). Returns how many addresses were newly recorded.
    pub async fn import(&self, legacy: &AllocationMap) -> Result<usize, StoreError> {
        let cidr = legacy.cidr();
        let range = self
            .ranges
            .cidrs()
            .iter()
            .position(|c| c == cidr)
            .ok_or_else(|| StoreError::Config(format!("cannot import {cidr}: it is not one of the configured ranges ({})", self.describe())))?;
        let mut added = 0;
        // One request per address through the committer keeps one code path for writes;
        // group commit turns them into a handful of transactions.
        let mut pending = futures::stream::FuturesUnordered::new();
        for ip in legacy.iter() {
            pending.push(self.submit(range, Op::Allocate(ip, None)));
            if pending.len() >= 4096 {
                added += drain_import(&mut pending).await?;
            }
        }
        added += drain_import(&mut pending).await?;
        Ok(added)
    }

    fn describe(&self) -> String {
        self.ranges.cidrs().iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ")
    }

}

/// The key of each configured range ([`stored::choose_keys`]) among the range keys stored
/// under `prefix`.
async fn stored_keys(client: &Client, prefix: &str, cidrs: &[ServiceCidr], timeout: Duration) -> Result<Vec<String>, StoreError> {
    let dir = format!("{}/", prefix.trim_end_matches('/'));
    let listed = read(&mut client.clone(), &dir, Some(GetOptions::new().with_prefix().with_keys_only()), timeout).await?;
    let mut found = Vec::new();
    for kv in listed.kvs() {
        let Some((key, named)) = kv.key_str().ok().and_then(|k| Some((k, ServiceCidr::parse(k.strip_prefix(&dir)?).ok()?))) else { continue };
        let holds = get(&mut client.clone(), key, timeout).await?.and_then(|(v, _)| AllocationMap::restore_stored(&v).ok()).map(|m| m.cidr().clone());
        found.push(stored::Found { key: key.to_string(), named, holds });
    }
    stored::choose_keys(prefix, cidrs, &found).map_err(StoreError::Config)
}

/// A shrink is refused while the part it removes still holds an address (as Kubernetes
/// refuses to delete a ServiceCIDR whose addresses are in use): an address of the stored map
/// outside `cidr` that no replica's pool key lists (pooled addresses are free).
fn refuse_held_outside(v: &View, cidr: &ServiceCidr, key: &str) -> Result<(), StoreError> {
    let held: Vec<IpAddr> = v.stored.outside.iter().copied().filter(|ip| v.pool_owner(*ip).is_none()).collect();
    let Some(first) = held.first() else { return Ok(()) };
    let by = v.owners.get(first).map(|o| format!(" (held by {o})")).unwrap_or_else(|| " (a Service's, or leaked)".into());
    Err(StoreError::Config(format!(
        "--service-cidr {cidr} leaves out {} address(es) still held in the range stored at {key} ({}): {first}{by}{}; release them (delete or re-create their Services, release their owners' records) before shrinking, or keep the wider range",
        held.len(),
        v.stored.cidr,
        if held.len() > 1 { ", …" } else { "" }
    )))
}

/// The owner an allocation records: its parent, unless that is a Service (the
/// kube-apiserver records a Service's addresses itself, as IPAddress objects).
fn recorded_owner(parent: Option<&ParentRef>) -> Option<ParentRef> {
    parent.filter(|p| !p.is_service()).cloned()
}

/// What [`EtcdStore::rebuild_unreadable`] wrote for one range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rebuilt {
    pub key: String,
    /// Addresses in the new map.
    pub addresses: usize,
    /// Of those: held by the cluster (Services, IPAddress objects), recorded under an owner
    /// key, listed in a replica's pool key (an address may count in more than one).
    pub from_cluster: usize,
    pub owned: usize,
    pub pooled: usize,
}

impl EtcdStore {
    /// Replace every unreadable allocation map with one rebuilt from what else records an
    /// allocation: `cluster` (the addresses the cluster's Services and IPAddress objects
    /// hold), the range's owner keys, and every replica's pool key (pooled addresses must
    /// stay allocated: their replica may hand them out). Readable maps are left alone. The
    /// write compares the unreadable value's mod revision, so a map someone rewrote
    /// meanwhile is never overwritten. The running controllers' watches pick the new map up.
    pub async fn rebuild_unreadable(&self, cluster: &BTreeSet<IpAddr>) -> Result<Vec<Rebuilt>, StoreError> {
        let mut done = Vec::new();
        for (i, r) in self.per_range.iter().enumerate() {
            let cidr = &self.ranges.cidrs()[i];
            let key = &r.key;
            let resp = read(&mut self.client.clone(), key, Some(GetOptions::new().with_prefix()), self.timeout).await?;
            let Some(stored) = resp.kvs().iter().find(|kv| kv.key() == key.as_bytes()) else { continue };
            if stored::Stored::decode(cidr, stored.value()).is_ok() {
                continue;
            }
            let mut map = AllocationMap::new(cidr.clone());
            let (mut from_cluster, mut owned, mut pooled) = (0, 0, 0);
            for ip in cluster.iter().filter(|ip| cidr.contains(**ip)) {
                from_cluster += usize::from(map.allocate(*ip).is_ok() || map.has(*ip));
            }
            for kv in resp.kvs() {
                let Ok(k) = kv.key_str() else { continue };
                match classify(key, k) {
                    Under::Owner(ip) => owned += usize::from(map.allocate(ip).is_ok() || map.has(ip)),
                    Under::Pool(_) => {
                        for ip in decode_pool(kv.value()) {
                            pooled += usize::from(map.allocate(ip).is_ok() || map.has(ip));
                        }
                    }
                    _ => {}
                }
            }
            let txn = Txn::new()
                .when([Compare::mod_revision(key.clone(), CompareOp::Equal, stored.mod_revision())])
                .and_then([TxnOp::put(key.clone(), map.snapshot(), None)]);
            let resp = call(self.timeout, self.client.clone().txn(txn)).await.map_err(|e| e.unavailable(format!("writing the rebuilt map to {key}")))?;
            if !resp.succeeded() {
                return Err(StoreError::Unavailable(Cause::new(format!("{key} changed while it was being rebuilt; run the rebuild again"))));
            }
            info!(%key, addresses = map.used(), "rebuilt an unreadable allocation map");
            done.push(Rebuilt { key: key.clone(), addresses: map.used() as usize, from_cluster, owned, pooled });
        }
        Ok(done)
    }

    /// Whether range `range` may change: not while its map is unreadable.
    fn usable(&self, range: usize) -> Result<(), StoreError> {
        match lock(&self.per_range[range].view).map_unreadable(&self.per_range[range].key) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// After taking `ip` from a pool (ours, or another replica's by a claim): record its
    /// owner, if it has one to record.
    async fn own(&self, range: usize, ip: IpAddr, owner: Option<ParentRef>) -> Result<(), StoreError> {
        match owner {
            Some(o) => self.submit(range, Op::Own(ip, o)).await.map(|_| ()),
            None => Ok(()),
        }
    }
}

async fn drain_import<F: std::future::Future<Output = Reply>>(
    pending: &mut futures::stream::FuturesUnordered<F>,
) -> Result<usize, StoreError> {
    let mut added = 0;
    while let Some(r) = pending.next().await {
        match r {
            Ok(_) => added += 1,
            Err(StoreError::Alloc(AllocError::Allocated)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(added)
}

#[async_trait]
impl AllocationStore for EtcdStore {
    fn backend(&self) -> &'static str {
        BackendKind::Etcd.as_str()
    }

    fn ranges(&self) -> Vec<ServiceCidr> {
        self.ranges.cidrs().to_vec()
    }

    async fn allocate(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<(), StoreError> {
        let range = self.ranges.index_of(ip)?;
        self.usable(range)?;
        let owner = recorded_owner(parent);
        if self.pool.take(range, ip) {
            // Ours, pooled: it is recorded already; the pool key is rewritten without it.
            enqueue(&self.per_range[range].queue, Op::SyncPool);
            return self.own(range, ip, owner).await;
        }
        let own = self.pool.lease().map(|l| l.member());
        let other_pool = lock(&self.per_range[range].view).pool_owner(ip).map(str::to_string).filter(|m| Some(m) != own.as_ref());
        if let Some(pooled_by) = other_pool {
            self.claim(range, ip, pooled_by).await?;
            return self.own(range, ip, owner).await;
        }
        // (Listed in our own pool key but not in our pool: handed out, and then the map
        // holds it; or released since, and then it is free. The map decides.)
        match self.submit(range, Op::Allocate(ip, owner.clone())).await {
            // A fill may have recorded it a moment before this request was decided. Ours: its
            // addresses reach the pool when its transaction returns, which is before this
            // reply. Another replica's: its pool key, written with the map, is in etcd
            // although our watch may not have listed it yet. Pooled, so free: granted, as any
            // static request for a pooled address.
            Err(StoreError::Alloc(AllocError::Allocated)) => {
                if self.pool.take(range, ip) {
                    enqueue(&self.per_range[range].queue, Op::SyncPool);
                    return self.own(range, ip, owner).await;
                }
                let Some(pooled_by) = self.pooled_elsewhere(range, ip).await? else {
                    return Err(StoreError::Alloc(AllocError::Allocated));
                };
                self.claim(range, ip, pooled_by).await?;
                self.own(range, ip, owner).await
            }
            r => r.map(|_| ()),
        }
    }

    async fn allocate_next(&self, family: Family, parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        if let Some(owner) = recorded_owner(parent) {
            // Pools are for Services; an owned address is chosen in a transaction that also
            // writes its owner key.
            let mut last = None;
            for range in self.ranges.of_family(family)? {
                match self.submit(range, Op::AllocateNext(Some(owner.clone()))).await {
                    Ok(ips) if !ips.is_empty() => return Ok(ips[0]),
                    Ok(_) | Err(StoreError::Alloc(AllocError::Full)) => last = Some(StoreError::Alloc(AllocError::Full)),
                    Err(e) => return Err(e),
                }
            }
            return Err(last.unwrap_or(StoreError::Alloc(AllocError::Full)));
        }
        let mut last = None;
        for range in self.ranges.of_family(family)? {
            // Not even from the pool while the map is unreadable: what it held is unknown.
            if let Err(e) = self.usable(range) {
                last = Some(e);
                continue;
            }
            if let Some(ip) = self.pop_pooled(range) {
                return Ok(ip);
            }
            if let Some(n) = self.pool.start_fill(range, Instant::now()) {
                enqueue(&self.per_range[range].queue, Op::Fill(n));
            }
            match self.submit(range, Op::AllocateNext(None)).await {
                Ok(ips) if !ips.is_empty() => return Ok(self.prefer_dynamic(range, ips[0]).await),
                // Full but for pools: ours (a refill may have landed in the same
                // transaction) or another replica's.
                Ok(_) | Err(StoreError::Alloc(AllocError::Full)) => match self.pop_pooled(range) {
                    Some(ip) => return Ok(ip),
                    None => match self.claim_any(range).await {
                        Some(ip) => return Ok(ip),
                        None => last = Some(StoreError::Alloc(AllocError::Full)),
                    },
                },
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(StoreError::Alloc(AllocError::Full)))
    }

    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        let Ok(range) = self.ranges.index_of(ip) else { return Ok(()) };
        if self.pool.holds(range, ip) {
            return Ok(()); // pooled here: free already
        }
        let own = self.pool.lease().map(|l| l.member());
        let other_pool = lock(&self.per_range[range].view).pool_owner(ip).map(str::to_string).filter(|m| Some(m) != own.as_ref());
        if let Some(owner) = other_pool {
            // Another replica's pool key lists it: still pooled there, or handed out a moment
            // ago (the key is rewritten after hand-outs). Only the owner knows; ask it with a
            // claim. Granted: it left the pool and is ours now; refused: it was handed out,
            // so it is a record. Either way it is released below; the map is never changed
            // while the owner could still hand it out.
            if self.ask_owner(range, ip, &owner).await?.is_none() {
                return Err(StoreError::Unavailable(Cause::new(format!("{ip} is being claimed from the address pool of replica {owner} right now; retry the release"))));
            }
        }
        self.submit(range, Op::Release(ip, None)).await.map(|_| ())
    }

    async fn release_owned(&self, ip: IpAddr, owner: &ParentRef) -> Result<(), StoreError> {
        let Some(owner) = recorded_owner(Some(owner)) else { return self.release(ip).await };
        let Ok(range) = self.ranges.index_of(ip) else { return Ok(()) };
        self.submit(range, Op::Release(ip, Some(owner))).await.map(|_| ())
    }

    async fn owner(&self, ip: IpAddr) -> Result<Option<ParentRef>, StoreError> {
        let Ok(range) = self.ranges.index_of(ip) else { return Ok(None) };
        let mut client = self.client.clone();
        Ok(get(&mut client, &owner_key(&self.per_range[range].key, ip), self.timeout).await?.map(|(v, _)| decode_owner(&v)))
    }

    async fn owners(&self) -> Result<Vec<(IpAddr, ParentRef)>, StoreError> {
        let mut all = Vec::new();
        for r in &self.per_range {
            let prefix = owner_prefix(&r.key);
            let resp = read(&mut self.client.clone(), &prefix, Some(GetOptions::new().with_prefix()), self.timeout).await?;
            all.extend(owners_in(&prefix, resp.kvs()));
        }
        all.sort_by_key(|(ip, _)| *ip);
        Ok(all)
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        let member = self.pool.lease().map(|l| l.member());
        match self.ranges.index_of(ip) {
            Ok(range) => {
                self.usable(range)?;
                Ok(lock(&self.per_range[range].view).records(ip, &self.pool, member.as_deref(), range))
            }
            Err(_) => Ok(false),
        }
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        let member = self.pool.lease().map(|l| l.member());
        let mut all = Vec::new();
        for (i, r) in self.per_range.iter().enumerate() {
            // Not the last good copy of an unreadable map: what it holds now is unknown.
            self.usable(i)?;
            let v = lock(&r.view);
            all.extend(v.map.iter().filter(|ip| v.records(*ip, &self.pool, member.as_deref(), i)));
        }
        all.sort();
        Ok(all)
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        let member = self.pool.lease().map(|l| l.member());
        Ok(self
            .per_range
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let v = lock(&r.view);
                let mut pooled: BTreeSet<IpAddr> = v.pooled_by_others(member.as_deref()).map(|(ip, _)| ip).collect();
                pooled.extend(self.pool.listing(i));
                let pooled = pooled.into_iter().filter(|ip| v.map.has(*ip)).count() as u64;
                RangeUsage { cidr: v.map.cidr().clone(), used: v.map.used() - pooled, free: v.map.free() + pooled, pooled, map_bytes: Some(v.map_bytes) }
            })
            .collect())
    }

    async fn ready(&self) -> Result<(), StoreError> {
        for i in 0..self.per_range.len() {
            self.usable(i)?;
        }
        // One linearizable read: answered only while etcd has a quorum.
        let key = &self.per_range[0].key;
        read(&mut self.client.clone(), key, Some(GetOptions::new().with_count_only()), self.timeout.min(READY_TIMEOUT)).await.map(|_| ())
    }

    fn unreadable(&self) -> Vec<Unreadable> {
        let mut all = Vec::new();
        for r in &self.per_range {
            let v = lock(&r.view);
            all.extend(v.unreadable.iter().map(|(k, (kind, reason))| Unreadable { kind, record: k.clone(), reason: reason.clone() }));
        }
        all
    }

    async fn close(&self) -> Result<(), StoreError> {
        let n = self.return_pool().await?;
        if n > 0 {
            info!(returned = n, "returned the address pool");
        }
        Ok(())
    }
}

