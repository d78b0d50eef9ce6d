//! Service address reservations for the IPAddress backend, in front of a stock
//! kube-apiserver (≥ 1.33).
//!
//! The apiserver records every Service address itself, as the IPAddress object named by the
//! address (managed by `ipallocator.k8s.io`), when it stores the Service — *after* our
//! mutating webhook answered. So for Services our reservation must not be that IPAddress
//! (the apiserver's create would fail with "provided IP is already allocated"); it only has
//! to stop two admissions, on any replica, from picking the same address in the moment
//! between the webhook's answer and the apiserver's own record.
//!
//! The reservation is a `coordination.k8s.io/v1` Lease in the controller's namespace, named
//! `clusterip-<hex of the address>`. Candidates come from a local allocation map per range,
//! rebuilt from the watch-fed IPAddress set and the listed Leases, never a list per
//! admission. The protocol, and why it holds whatever any replica's watch lags:
//!
//! 1. **Reserve**: create the Lease (AlreadyExists = another admission holds the address).
//! 2. **Confirm**: read the IPAddress named by the address from the apiserver — a GET
//!    without a resourceVersion, served from storage, never from a cache. If it exists the
//!    address is taken: drop the Lease (uid precondition) and try another. Only when it does
//!    not exist is the address answered. So *while a reservation is live, no IPAddress for
//!    its address existed at its confirmation*, whatever the replica's watch showed.
//! 3. **Settle** (only the replica that reserved, which remembers the Lease's uid and the
//!    parent it reserved for): once its watch hints that the IPAddress exists, it reads it
//!    from storage again; if it exists with the reservation's parentRef, the apiserver holds
//!    the address (that IPAddress was created after the confirmation, so it is this
//!    admission's record or a later one) and the Lease is deleted with a uid precondition.
//!    Any later reservation of the address is refused at its own confirmation for as long
//!    as the IPAddress exists.
//! 4. **Expire**: any replica deletes a Lease (uid precondition) that it has itself
//!    observed for [`RESERVATION_TTL`] — measured on its own monotonic clock from the first
//!    time it listed that uid, never by comparing another machine's timestamp with ours.
//!    The TTL outlasts any admission: the webhook answers within the apiserver's webhook
//!    timeout (≤ 30 s) and the request ends within the apiserver's request timeout (60 s
//!    by default), after which the Service is stored (and its IPAddress exists) or never
//!    will be.
//!
//! No replica deletes another's live reservation because of what its own watch shows, and a
//! release for a deleted Service never deletes a Lease (a reservation made for a new
//! admission of the same address would be lost); only step 3 or 4 ends one.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::networking::v1::IPAddress;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams, Preconditions};
use kube::Client;
use tracing::{debug, warn};

use crate::alloc::{AllocError, AllocationMap};
use crate::cidr::{Family, ServiceCidr};

use super::apiserver_ips::ApiserverIps;
use super::{AllocationStore, ParentRef, RangeSet, RangeUsage, StoreError};

/// Label on every reservation Lease (value "true"; label values cannot hold IPv6 text).
pub const RESERVATION_LABEL: &str = "clusterip.allocator/reservation";
/// Annotation naming the reserved address.
pub const ADDRESS_ANNOTATION: &str = "clusterip.allocator/address";
/// Annotation naming the object the address was reserved for (informative).
pub const PARENT_ANNOTATION: &str = "clusterip.allocator/parent";
/// A reservation is dropped once a replica has observed it this long (see the module docs).
pub const RESERVATION_TTL: Duration = Duration::from_secs(120);
/// How often reservations are swept and the local candidate maps rebuilt.
const REFRESH: Duration = Duration::from_secs(5);

/// The Lease name of an address: `clusterip-` and the address bytes in hex (always a valid
/// object name, whatever the family).
pub fn lease_name(ip: IpAddr) -> String {
    let bytes: Vec<u8> = match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    format!("clusterip-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// Tunables of [`LeaseReservations`]; the defaults are what the controller runs with.
#[derive(Clone, Debug)]
pub struct ReservationOptions {
    /// How often a background task sweeps reservations and rebuilds the candidate maps (it
    /// also settles this replica's reservations as soon as the IPAddress watch moves).
    /// `None`: no background task; only explicit [`LeaseReservations::refresh`] calls.
    pub refresh: Option<Duration>,
    /// How long a replica observes a reservation before it drops it.
    pub ttl: Duration,
}

impl Default for ReservationOptions {
    fn default() -> Self {
        Self { refresh: Some(REFRESH), ttl: RESERVATION_TTL }
    }
}

/// A reservation this replica made and confirmed.
#[derive(Clone, Debug)]
struct Held {
    /// The Lease's uid: every delete carries it as a precondition.
    uid: String,
    /// What the address was reserved for; `None` matches any parent.
    parent: Option<ParentRef>,
    /// When the Lease was created, on this replica's clock.
    since: Instant,
}

/// What a sweep does with one listed reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Leave it.
    Keep,
    /// Ours, and the watch hints that the apiserver recorded the address: read the
    /// IPAddress from storage and drop the Lease if it is the reservation's record.
    Settle,
    /// Observed for the whole TTL: drop it.
    Expire,
}

/// The sweep's decision for one reservation, from what this replica itself knows: whether
/// it made it (`mine`), when it first listed it, and the watch's hint.
fn judge(mine: Option<&Held>, first_seen: Instant, now: Instant, ttl: Duration, recorded_hint: bool) -> Verdict {
    match mine {
        Some(h) if now.saturating_duration_since(h.since) >= ttl => Verdict::Expire,
        Some(_) if recorded_hint => Verdict::Settle,
        Some(_) => Verdict::Keep,
        None if now.saturating_duration_since(first_seen) >= ttl => Verdict::Expire,
        None => Verdict::Keep,
    }
}

/// Reservations of Service addresses as Leases; see the module docs.
pub struct LeaseReservations {
    api: Api<Lease>,
    addresses: Api<IPAddress>,
    ranges: RangeSet,
    recorded: ApiserverIps,
    identity: String,
    ttl: Duration,
    /// Per range: recorded ∪ reserved, as last rebuilt, plus our picks since.
    taken: Mutex<Vec<AllocationMap>>,
    /// Reservations this replica made and confirmed, by address.
    mine: Mutex<HashMap<IpAddr, Held>>,
    /// Every listed reservation's uid and when this replica first listed it.
    first_seen: Mutex<HashMap<String, Instant>>,
    sweeper: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for LeaseReservations {
    fn drop(&mut self) {
        if let Some(s) = &self.sweeper {
            s.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long `/readyz` waits for the kube-apiserver (the Deployment's probe gives up after 2 s).
const READY_TIMEOUT: Duration = Duration::from_millis(1500);

fn api_err(what: &str, e: kube::Error) -> StoreError {
    match e {
        kube::Error::Api(s) => StoreError::Backend(format!("{what}: {} ({})", s.message, s.code)),
        other => StoreError::Unavailable(format!("{what}: {other}")),
    }
}

impl LeaseReservations {
    /// Reservations in `namespace`, beside the cluster's IPAddress set `recorded` (already
    /// synced). `identity` is written as each Lease's holder.
    pub async fn open(client: Client, namespace: &str, ranges: Vec<ServiceCidr>, recorded: ApiserverIps, identity: String) -> Result<Arc<Self>, StoreError> {
        Self::open_with(client, namespace, ranges, recorded, identity, ReservationOptions::default()).await
    }

    /// [`open`](Self::open) with explicit [`ReservationOptions`].
    pub async fn open_with(client: Client, namespace: &str, ranges: Vec<ServiceCidr>, recorded: ApiserverIps, identity: String, options: ReservationOptions) -> Result<Arc<Self>, StoreError> {
        if ranges.is_empty() {
            return Err(StoreError::Backend("no service CIDR configured".into()));
        }
        let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
        let addresses: Api<IPAddress> = Api::all(client);
        let taken = Mutex::new(ranges.iter().map(|c| AllocationMap::new(c.clone())).collect());
        let me = Arc::new_cyclic(|weak: &std::sync::Weak<LeaseReservations>| {
            let sweeper = options.refresh.map(|every| tokio::spawn(sweep_forever(weak.clone(), recorded.clone(), every)));
            LeaseReservations {
                api,
                addresses,
                ranges: RangeSet::new(ranges),
                recorded,
                identity,
                ttl: options.ttl,
                taken,
                mine: Mutex::default(),
                first_seen: Mutex::default(),
                sweeper,
            }
        });
        me.refresh().await?;
        Ok(me)
    }

    async fn ours(&self) -> Result<Vec<(IpAddr, Lease)>, StoreError> {
        let list = self.api.list(&ListParams::default().labels(RESERVATION_LABEL)).await.map_err(|e| api_err("listing reservation Leases", e))?;
        Ok(list
            .items
            .into_iter()
            .filter_map(|l| {
                let ip = crate::cidr::parse_ip(l.metadata.annotations.as_ref()?.get(ADDRESS_ANNOTATION)?).ok()?;
                Some((ip, l))
            })
            .collect())
    }

    /// Sweep the reservations (settle ours that the apiserver took over, expire those
    /// observed for the TTL) and rebuild the candidate maps from the recorded set and the
    /// reservations that remain.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        let listed = self.ours().await?;
        let now = Instant::now();
        let uids: HashSet<String> = listed.iter().filter_map(|(_, l)| l.metadata.uid.clone()).collect();
        lock(&self.first_seen).retain(|uid, _| uids.contains(uid));
        // A reservation of ours that is no longer listed ended (expired by another replica).
        lock(&self.mine).retain(|_, h| uids.contains(&h.uid));
        let mut reserved = Vec::new();
        for (ip, lease) in listed {
            let Some(uid) = lease.metadata.uid.clone() else { continue };
            let mine = lock(&self.mine).get(&ip).filter(|h| h.uid == uid).cloned();
            let first_seen = *lock(&self.first_seen).entry(uid.clone()).or_insert(now);
            let ended = match judge(mine.as_ref(), first_seen, now, self.ttl, self.recorded.contains(ip)) {
                Verdict::Keep => false,
                Verdict::Settle => self.settle(ip, mine.as_ref()).await,
                Verdict::Expire => {
                    debug!(%ip, "reservation observed for its whole TTL; dropping it");
                    self.drop_lease(ip, &uid).await
                }
            };
            if !ended {
                reserved.push(ip);
            }
        }
        let recorded = self.recorded.snapshot();
        let mut maps: Vec<AllocationMap> = self.ranges.cidrs().iter().map(|c| AllocationMap::new(c.clone())).collect();
        for ip in recorded.into_iter().chain(reserved) {
            if let Ok(i) = self.ranges.index_of(ip) {
                let _ = maps[i].allocate(ip);
            }
        }
        *lock(&self.taken) = maps;
        Ok(())
    }

    /// Settle each of our reservations whose address the watch now shows recorded.
    async fn settle_recorded(&self) {
        let candidates: Vec<(IpAddr, Held)> = lock(&self.mine).iter().filter(|(ip, _)| self.recorded.contains(**ip)).map(|(ip, h)| (*ip, h.clone())).collect();
        for (ip, held) in candidates {
            self.settle(ip, Some(&held)).await;
        }
    }

    /// Step 3 of the protocol: true when the reservation ended because the apiserver's own
    /// record of the address (read from storage) names the reservation's parent.
    async fn settle(&self, ip: IpAddr, held: Option<&Held>) -> bool {
        let Some(held) = held else { return false };
        match self.addresses.get_opt(&ip.to_string()).await {
            Ok(Some(record)) => {
                let parent = Some(ParentRef::from(&record.spec.parent_ref));
                if held.parent.is_none() || held.parent == parent {
                    debug!(%ip, "the apiserver recorded the address; reservation released");
                    self.drop_lease(ip, &held.uid).await
                } else {
                    // Someone else's record: the address is held either way; the
                    // reservation ends with its TTL.
                    false
                }
            }
            Ok(None) => false,
            Err(e) => {
                warn!(%ip, error = %e, "could not read the IPAddress of a reservation; retrying at the next sweep");
                false
            }
        }
    }

    /// Delete the reservation Lease of `ip` if it is still the one with `uid`. True when it
    /// is gone (deleted now, or already gone or replaced).
    async fn drop_lease(&self, ip: IpAddr, uid: &str) -> bool {
        let dp = DeleteParams { preconditions: Some(Preconditions { uid: Some(uid.to_string()), resource_version: None }), ..Default::default() };
        let gone = match self.api.delete(&lease_name(ip), &dp).await {
            Ok(_) => true,
            // 404: already gone; 409: the name now belongs to a newer reservation.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => true,
            Err(e) => {
                warn!(%ip, error = %e, "could not delete a reservation Lease; retrying at the next sweep");
                false
            }
        };
        if gone {
            let mut mine = lock(&self.mine);
            if mine.get(&ip).is_some_and(|h| h.uid == uid) {
                mine.remove(&ip);
            }
            lock(&self.first_seen).remove(uid);
        }
        gone
    }

    /// Steps 1 and 2 of the protocol: Ok(true) = the address is ours now, Ok(false) = it is
    /// taken (another reservation, or the apiserver's record).
    async fn reserve(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<bool, StoreError> {
        let mut labels = std::collections::BTreeMap::new();
        labels.insert(RESERVATION_LABEL.to_string(), "true".to_string());
        let mut annotations = std::collections::BTreeMap::new();
        annotations.insert(ADDRESS_ANNOTATION.to_string(), ip.to_string());
        if let Some(p) = parent {
            annotations.insert(PARENT_ANNOTATION.to_string(), p.to_string());
        }
        let lease = Lease {
            metadata: ObjectMeta { name: Some(lease_name(ip)), labels: Some(labels), annotations: Some(annotations), ..Default::default() },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.identity.clone()),
                lease_duration_seconds: Some(self.ttl.as_secs() as i32),
                acquire_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
                ..Default::default()
            }),
        };
        let since = Instant::now();
        let created = match self.api.create(&PostParams::default(), &lease).await {
            Ok(l) => l,
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(false),
            Err(e) => return Err(api_err(&format!("creating the reservation for {ip}"), e)),
        };
        let Some(uid) = created.metadata.uid else {
            return Err(StoreError::Backend(format!("the apiserver returned the reservation Lease for {ip} without a uid")));
        };
        // Confirm with a read from storage: the watch-fed view may lag behind a record.
        match self.addresses.get_opt(&ip.to_string()).await {
            Ok(None) => {
                // A parent without a name (a Service created with generateName, its name not
                // yet chosen at admission) matches any.
                lock(&self.mine).insert(ip, Held { uid, parent: parent.filter(|p| !p.name.is_empty()).cloned(), since });
                Ok(true)
            }
            Ok(Some(_)) => {
                debug!(%ip, "the apiserver already records the address; reservation withdrawn");
                self.drop_lease(ip, &uid).await;
                Ok(false)
            }
            Err(e) => {
                self.drop_lease(ip, &uid).await;
                Err(api_err(&format!("confirming the reservation for {ip}"), e))
            }
        }
    }

    fn mark(&self, range: usize, ip: IpAddr) {
        let _ = lock(&self.taken)[range].allocate(ip);
    }
}

/// The background sweeper: a full sweep every `every`, and our own reservations settled as
/// soon as the IPAddress watch moves.
async fn sweep_forever(weak: std::sync::Weak<LeaseReservations>, recorded: ApiserverIps, every: Duration) {
    let mut next_full = tokio::time::Instant::now() + every;
    let mut additions = recorded.additions();
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next_full) => {
                next_full = tokio::time::Instant::now() + every;
                let Some(me) = weak.upgrade() else { return };
                if let Err(e) = me.refresh().await {
                    warn!(error = %e, "refreshing Service address reservations failed; retrying");
                }
            }
            // (The view lives as long as the store: an error here cannot happen while we run.)
            Ok(()) = additions.changed() => {
                let Some(me) = weak.upgrade() else { return };
                me.settle_recorded().await;
            }
        }
    }
}

#[async_trait]
impl AllocationStore for LeaseReservations {
    fn backend(&self) -> &'static str {
        "ipaddress"
    }

    fn ranges(&self) -> Vec<ServiceCidr> {
        self.ranges.cidrs().to_vec()
    }

    async fn allocate(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<(), StoreError> {
        let range = self.ranges.index_of(ip)?;
        if self.recorded.contains(ip) {
            return Err(StoreError::Alloc(AllocError::Allocated));
        }
        if self.reserve(ip, parent).await? {
            self.mark(range, ip);
            Ok(())
        } else {
            Err(StoreError::Alloc(AllocError::Allocated))
        }
    }

    async fn allocate_next(&self, family: Family, parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        let ranges = self.ranges.of_family(family)?;
        // Every candidate stays marked in our map once tried, so this ends: with an address,
        // or Full once every address the view shows free was taken by someone else.
        loop {
            // The first range of the family with room, as Kubernetes' MetaAllocator does.
            let candidate = {
                let mut maps = lock(&self.taken);
                ranges.iter().find_map(|&i| maps[i].allocate_next().ok().map(|ip| (i, ip)))
            };
            let Some((_, ip)) = candidate else {
                return Err(StoreError::Alloc(AllocError::Full));
            };
            if self.recorded.contains(ip) {
                continue;
            }
            if self.reserve(ip, parent).await? {
                return Ok(ip);
            }
            debug!(%ip, "address reserved by another admission; trying the next");
        }
    }

    /// Ends this replica's own reservation of `ip` (an admission rolling back). A release
    /// for a deleted Service leaves Leases alone: the apiserver drops its own record, and a
    /// Lease for the address can only be a newer admission's (see the module docs).
    /// A Service gave the address up (the Service reconciler): no Lease is deleted — a
    /// reservation for that address can only be a newer admission's — only the local
    /// candidate map forgets it, unless the view shows it recorded.
    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        let Ok(range) = self.ranges.index_of(ip) else { return Ok(()) };
        if !self.recorded.contains(ip) && !lock(&self.mine).contains_key(&ip) {
            lock(&self.taken)[range].release(ip);
        }
        Ok(())
    }

    /// The admission that reserved the address for `owner` gives it back (its request
    /// failed, here or after our answer): our Lease for it is deleted, by uid, if it was
    /// reserved for that owner.
    async fn release_owned(&self, ip: IpAddr, owner: &ParentRef) -> Result<(), StoreError> {
        let Ok(range) = self.ranges.index_of(ip) else { return Ok(()) };
        let held = lock(&self.mine).get(&ip).cloned();
        match held {
            Some(held) if held.parent.as_ref().is_none_or(|p| p == owner) && !self.drop_lease(ip, &held.uid).await => {
                return Err(StoreError::Unavailable(format!("releasing the reservation for {ip}: the Lease could not be deleted")));
            }
            Some(held) if held.parent.as_ref().is_some_and(|p| p != owner) => return Ok(()),
            _ => {}
        }
        if !self.recorded.contains(ip) {
            lock(&self.taken)[range].release(ip);
        }
        Ok(())
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        if self.recorded.contains(ip) {
            return Ok(true);
        }
        match self.api.get_opt(&lease_name(ip)).await {
            Ok(found) => Ok(found.is_some()),
            Err(e) => Err(api_err(&format!("reading the reservation for {ip}"), e)),
        }
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        let mut all: Vec<IpAddr> = self.recorded.snapshot().into_iter().filter(|ip| self.ranges.index_of(*ip).is_ok()).collect();
        all.extend(self.ours().await?.into_iter().map(|(ip, _)| ip));
        all.sort();
        all.dedup();
        Ok(all)
    }

    fn unreadable(&self) -> Vec<super::Unreadable> {
        self.recorded.unreadable()
    }

    async fn ready(&self) -> Result<(), StoreError> {
        // One round trip to the kube-apiserver, bounded: the kube client has no read timeout.
        let one = ListParams::default().labels(RESERVATION_LABEL).limit(1);
        match tokio::time::timeout(READY_TIMEOUT, self.api.list_metadata(&one)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(api_err("listing reservation Leases", e)),
            Err(_) => Err(StoreError::Unavailable(format!("listing reservation Leases: the kube-apiserver did not answer within {READY_TIMEOUT:?}"))),
        }
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        let maps = lock(&self.taken);
        Ok(maps.iter().map(|m| RangeUsage { cidr: m.cidr().clone(), used: m.used(), free: m.free(), pooled: 0 }).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_are_valid_object_names() {
        assert_eq!(lease_name("198.19.0.5".parse().expect("ip")), "clusterip-c6130005");
        assert_eq!(lease_name("fd00:10:96::5".parse().expect("ip")), "clusterip-fd000010009600000000000000000005");
        assert_eq!(lease_name("::1".parse().expect("ip")), "clusterip-00000000000000000000000000000001");
    }

    fn held(since: Instant) -> Held {
        Held { uid: "u".into(), parent: None, since }
    }

    #[test]
    fn others_reservations_end_only_after_a_ttl_of_our_own_observation() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(120);
        // Whatever the watch says, another replica's reservation is kept until we have seen
        // it for the whole TTL (its creation timestamp is never consulted).
        assert_eq!(judge(None, t0, t0, ttl, true), Verdict::Keep);
        assert_eq!(judge(None, t0, t0 + ttl - Duration::from_millis(1), ttl, true), Verdict::Keep);
        assert_eq!(judge(None, t0, t0 + ttl, ttl, false), Verdict::Expire);
    }

    #[test]
    fn our_reservations_settle_on_the_hint_and_expire_after_the_ttl() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(120);
        let h = held(t0);
        assert_eq!(judge(Some(&h), t0, t0 + Duration::from_secs(1), ttl, false), Verdict::Keep);
        assert_eq!(judge(Some(&h), t0, t0 + Duration::from_secs(1), ttl, true), Verdict::Settle);
        assert_eq!(judge(Some(&h), t0, t0 + ttl, ttl, true), Verdict::Expire);
        // A clock that seems to go backwards (first_seen after now) never expires anything.
        assert_eq!(judge(None, t0 + ttl, t0, ttl, false), Verdict::Keep);
    }
}
