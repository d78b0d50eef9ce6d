//! The watch-fed copy of one range: the map, every replica's pool key and the owner keys as
//! of the last revision seen, kept current by a watch of everything under the range key and
//! re-read whole after any interruption. The copy writes nothing: a claim on one of our
//! pooled addresses that it sees is returned as a [`ClaimToAnswer`], which the watch hands
//! to the range's committer (as Kubernetes' allocator cache never calls its writer).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use tokio::sync::mpsc;

use etcd_client::{EventType, GetOptions, WatchOptions};
use futures::StreamExt;
use tracing::{debug, info, warn};

use crate::alloc::AllocationMap;
use super::pool::{decode_pool, pool_member, Claim, OwnPool};
use crate::store::{ParentRef, StoreError};
use crate::sync::lock;

use super::client::read;
use super::keys::{classify, decode_owner, parse_owner, Under, MAP_CONSEQUENCE};
use super::stored::Stored;
use super::RangeCtx;

/// A claim on one of this replica's pooled addresses, seen by the watch and not answered
/// yet: the committer answers it (`pool_lease.rs`).
pub(super) struct ClaimToAnswer {
    /// The claim's key.
    pub key: String,
    pub ip: IpAddr,
    pub claim: Claim,
}

/// The local copy of one range: the map as of `revision` (0 = the key does not exist), and
/// every replica's pool key and pending claim under the range key.
pub(super) struct View {
    /// The part of the stored map inside this replica's range.
    pub(super) map: AllocationMap,
    /// The stored map's range and what it holds outside ours (a range change in progress).
    pub(super) stored: Stored,
    pub(super) revision: i64,
    /// The size of the stored map's value as last read (0: no map key yet).
    pub(super) map_bytes: u64,
    /// Highest etcd revision read (by a get or the watch) under the range key's prefix.
    pub(super) watched: i64,
    /// Pool key (its name below `<range key>/pool/`: `<member>/<chunk>`) → the addresses it
    /// lists.
    pub(super) pools: BTreeMap<String, BTreeSet<IpAddr>>,
    /// Address → its owner key's owner (owners other than Services).
    pub(super) owners: BTreeMap<IpAddr, ParentRef>,
    /// Records under the range key that cannot be read: key → (kind, reason). While the map
    /// itself is unreadable the range allocates and releases nothing (fails closed).
    pub(super) unreadable: BTreeMap<String, (&'static str, String)>,
}

impl View {
    /// The member whose pool key lists `ip`.
    pub(super) fn pool_owner(&self, ip: IpAddr) -> Option<&str> {
        self.pools.iter().find(|(_, s)| s.contains(&ip)).map(|(name, _)| pool_member(name))
    }

    /// Every address other members' pool keys list (`own`: this replica's member).
    pub(super) fn pooled_by_others(&self, own: Option<&str>) -> impl Iterator<Item = (IpAddr, &str)> + '_ {
        let own = own.map(str::to_string);
        self.pools
            .iter()
            .map(|(name, ips)| (pool_member(name), ips))
            .filter(move |(m, _)| Some(*m) != own.as_deref())
            .flat_map(|(m, ips)| ips.iter().map(move |ip| (*ip, m)))
    }

    /// Held in a pool: ours as our memory says (our pool key may still list addresses we
    /// handed out a moment ago), another replica's as its pool key says.
    pub(super) fn pooled(&self, ip: IpAddr, own: &OwnPool, own_member: Option<&str>, range: usize) -> bool {
        own.holds(range, ip) || self.pool_owner(ip).is_some_and(|m| Some(m) != own_member)
    }

    /// The error for any change to this range while its map is unreadable.
    pub(super) fn map_unreadable(&self, key: &str) -> Option<StoreError> {
        let (_, reason) = self.unreadable.get(key)?;
        Some(StoreError::Corrupt { record: format!("the allocation map stored at {key}"), reason: reason.clone(), consequence: MAP_CONSEQUENCE })
    }

    /// Allocated in the map and not held in anyone's pool: a record of some object.
    pub(super) fn records(&self, ip: IpAddr, own: &OwnPool, own_member: Option<&str>, range: usize) -> bool {
        self.map.has(ip) && !self.pooled(ip, own, own_member, range)
    }
}

/// Keep the local copy of one range current from etcd's watch of everything under the range
/// key (the map, pool keys, claims); re-read and re-watch after any interruption (etcd
/// restarted, compaction).
/// Claims on our pooled addresses go to `claims` (the range's committer).
pub(super) async fn watch_range(ctx: RangeCtx, claims: mpsc::UnboundedSender<ClaimToAnswer>) {
    let mut client = ctx.client.clone();
    let key = ctx.key.clone();
    let mut backoff = Duration::from_millis(100);
    loop {
        let from = lock(&ctx.view).watched + 1;
        let started = client.watch(key.clone(), Some(WatchOptions::new().with_prefix().with_start_revision(from))).await;
        let (_watcher, mut stream) = match started {
            Ok(s) => s,
            Err(e) => {
                debug!(%key, error = %e, "watch failed to start; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        while let Some(msg) = stream.next().await {
            let resp = match msg {
                Ok(r) => r,
                Err(e) => {
                    debug!(%key, error = %e, "watch interrupted");
                    break;
                }
            };
            if resp.canceled() || resp.compact_revision() > 0 {
                break;
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let Ok(k) = kv.key_str() else { continue };
                let value = match ev.event_type() {
                    EventType::Put => Some(kv.value()),
                    EventType::Delete => None,
                };
                if let Some(claim) = apply(&ctx, k, value, kv.mod_revision()) {
                    let _ = claims.send(claim);
                }
            }
        }
        // Interrupted: the copy may have missed events; read the keys again before watching.
        match reload(&ctx).await {
            Ok(found) => found.into_iter().for_each(|claim| {
                let _ = claims.send(claim);
            }),
            Err(e) => {
                debug!(%key, error = %e, "reload after watch interruption failed; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Apply one key's new value (None = deleted) at `mod_revision` to the view. A claim: wake
/// our waiter on an answered one; one addressed to our pool is returned, to be answered.
fn apply(ctx: &RangeCtx, key: &str, value: Option<&[u8]>, mod_revision: i64) -> Option<ClaimToAnswer> {
    let mut v = lock(&ctx.view);
    v.watched = v.watched.max(mod_revision);
    match classify(&ctx.key, key) {
        Under::Map => {
            if mod_revision <= v.revision {
                return None;
            }
            v.map_bytes = value.map_or(0, |b| b.len() as u64);
            match value {
                Some(value) => match Stored::decode(&ctx.cidr, value) {
                    Ok((map, stored)) => {
                        v.map = map;
                        v.stored = stored;
                        v.revision = mod_revision;
                        if v.unreadable.remove(&ctx.key).is_some() {
                            info!(key = %ctx.key, "the allocation map is readable again; allocating from it");
                        }
                    }
                    Err(e) => {
                        // Keep the last good copy for reads, but change nothing until the
                        // map is readable again: a write based on the old copy would drop
                        // whatever was allocated since (fail closed).
                        warn!(key = %ctx.key, error = %e, "the allocation map in etcd is unreadable; allocating nothing from this range until `clusterip repair --rebuild`");
                        v.unreadable.insert(ctx.key.clone(), ("allocation_map", e.to_string()));
                    }
                },
                None => {
                    v.map = AllocationMap::new(ctx.cidr.clone());
                    v.stored = Stored::as_configured(&ctx.cidr);
                    v.revision = 0;
                    v.unreadable.remove(&ctx.key);
                }
            }
        }
        Under::Pool(name) => match value {
            Some(value) => {
                v.pools.insert(name.to_string(), decode_pool(value));
            }
            None => {
                v.pools.remove(name);
            }
        },
        Under::Owner(ip) => match value {
            Some(value) => {
                match parse_owner(value) {
                    Ok(_) => v.unreadable.remove(key),
                    Err(e) => {
                        warn!(%key, error = %e, "an owner record in etcd is unreadable; its address stays allocated");
                        v.unreadable.insert(key.to_string(), ("owner", e))
                    }
                };
                v.owners.insert(ip, decode_owner(value));
            }
            None => {
                v.unreadable.remove(key);
                v.owners.remove(&ip);
            }
        },
        Under::Claim(ip) => {
            drop(v);
            let claim = value.and_then(|b| serde_json::from_slice::<Claim>(b).ok())?;
            match claim.answer {
                Some(answer) if claim.claimant == ctx.name => {
                    if let Some(tx) = lock(&ctx.waiters).remove(&ip) {
                        let _ = tx.send(answer);
                    }
                }
                // Addressed to our member, or (by a replica of the version before chunks) to
                // one of our pool keys by its name.
                None if ctx.pool.lease().is_some_and(|l| l.member() == pool_member(&claim.owner)) => {
                    return Some(ClaimToAnswer { key: key.to_string(), ip, claim });
                }
                _ => {}
            }
        }
        Under::Other => {}
    }
    None
}

/// Replace the local copy with what etcd holds now under the range key's prefix; returns
/// the claims on our pooled addresses it found unanswered.
pub(super) async fn reload(ctx: &RangeCtx) -> Result<Vec<ClaimToAnswer>, StoreError> {
    let key = &ctx.key;
    let resp = read(&mut ctx.client.clone(), key, Some(GetOptions::new().with_prefix()), ctx.timeout).await?;
    let mut map = Some((AllocationMap::new(ctx.cidr.clone()), Stored::as_configured(&ctx.cidr)));
    let (mut revision, mut map_bytes) = (0, 0);
    let mut unreadable = BTreeMap::new();
    let mut rest = Vec::new();
    for kv in resp.kvs() {
        let Ok(k) = kv.key_str() else { continue };
        match classify(key, k) {
            Under::Map => {
                map_bytes = kv.value().len() as u64;
                match Stored::decode(&ctx.cidr, kv.value()) {
                    Ok(m) => {
                        map = Some(m);
                        revision = kv.mod_revision();
                    }
                    Err(e) => {
                        warn!(%key, error = %e, "the allocation map in etcd is unreadable; allocating nothing from this range until `clusterip repair --rebuild`");
                        unreadable.insert(key.clone(), ("allocation_map", e.to_string()));
                        map = None;
                    }
                }
            }
            Under::Other => {}
            _ => rest.push((k.to_string(), kv.value().to_vec(), kv.mod_revision())),
        }
    }
    {
        let mut v = lock(&ctx.view);
        // An unreadable map keeps the last good copy (and its revision) for reads.
        if let Some((map, stored)) = map {
            v.map = map;
            v.stored = stored;
            v.revision = revision;
        }
        v.unreadable = unreadable;
        v.map_bytes = map_bytes;
        v.pools.clear();
        v.owners.clear();
        v.watched = resp.header().map(|h| h.revision()).unwrap_or(revision);
    }
    Ok(rest.into_iter().filter_map(|(k, value, rev)| apply(ctx, &k, Some(&value), rev)).collect())
}

