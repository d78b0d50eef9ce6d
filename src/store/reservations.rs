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
//! `clusterip-<hex of the address>`: creating it is the cluster-wide lock (AlreadyExists =
//! someone else is admitting a Service with that address). Candidates come from a local
//! allocation map per range, rebuilt from the watch-fed IPAddress set and our Leases, never
//! a list per admission. A sweeper deletes a reservation once the address is recorded as an
//! IPAddress (the apiserver took over) or after [`RESERVATION_TTL`] (the Service was never
//! stored).

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::Client;
use tracing::{debug, warn};

use crate::alloc::{AllocError, AllocationMap};
use crate::cidr::{Family, ServiceCidr};
use crate::webhook::apiserver_ips::ApiserverIps;

use super::{AllocationStore, ParentRef, RangeSet, RangeUsage, StoreError};

/// Label on every reservation Lease (value "true"; label values cannot hold IPv6 text).
pub const RESERVATION_LABEL: &str = "clusterip.allocator/reservation";
/// Annotation naming the reserved address.
pub const ADDRESS_ANNOTATION: &str = "clusterip.allocator/address";
/// A reservation whose Service never reached storage is dropped after this long.
pub const RESERVATION_TTL: Duration = Duration::from_secs(120);
/// How often the local candidate maps are rebuilt and stale reservations swept.
const REFRESH: Duration = Duration::from_secs(5);
/// Candidates tried per request before giving up.
const MAX_ATTEMPTS: usize = 64;

/// The Lease name of an address: `clusterip-` and the address bytes in hex (always a valid
/// object name, whatever the family).
pub fn lease_name(ip: IpAddr) -> String {
    let bytes: Vec<u8> = match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    format!("clusterip-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// Reservations of Service addresses as Leases; see the module docs.
pub struct LeaseReservations {
    api: Api<Lease>,
    ranges: RangeSet,
    recorded: ApiserverIps,
    identity: String,
    /// Per range: recorded ∪ reserved, as last rebuilt, plus our picks since.
    taken: Mutex<Vec<AllocationMap>>,
    sweeper: tokio::task::JoinHandle<()>,
}

impl Drop for LeaseReservations {
    fn drop(&mut self) {
        self.sweeper.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

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
        if ranges.is_empty() {
            return Err(StoreError::Backend("no service CIDR configured".into()));
        }
        let api: Api<Lease> = Api::namespaced(client, namespace);
        let taken = Mutex::new(ranges.iter().map(|c| AllocationMap::new(c.clone())).collect());
        let me = Arc::new_cyclic(|weak: &std::sync::Weak<LeaseReservations>| {
            let weak = weak.clone();
            let sweeper = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(REFRESH).await;
                    let Some(me) = weak.upgrade() else { return };
                    if let Err(e) = me.refresh().await {
                        warn!(error = %e, "refreshing Service address reservations failed; retrying");
                    }
                }
            });
            LeaseReservations { api, ranges: RangeSet::new(ranges), recorded, identity, taken, sweeper }
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

    /// Sweep reservations the apiserver has taken over or that expired, and rebuild the
    /// candidate maps from the recorded set and the reservations that remain.
    async fn refresh(&self) -> Result<(), StoreError> {
        let mut reserved = Vec::new();
        for (ip, lease) in self.ours().await? {
            let age = lease
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| age(&t.0))
                .unwrap_or_default();
            if self.recorded.contains(ip) || age > RESERVATION_TTL {
                let name = lease_name(ip);
                match self.api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => debug!(%ip, "reservation released: the address is recorded or the reservation expired"),
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => warn!(%ip, error = %e, "could not delete a reservation Lease"),
                }
                if !self.recorded.contains(ip) {
                    continue;
                }
            }
            reserved.push(ip);
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

    /// Create the reservation Lease: Ok(true) = ours now, Ok(false) = someone holds it.
    async fn reserve(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<bool, StoreError> {
        let mut labels = std::collections::BTreeMap::new();
        labels.insert(RESERVATION_LABEL.to_string(), "true".to_string());
        let mut annotations = std::collections::BTreeMap::new();
        annotations.insert(ADDRESS_ANNOTATION.to_string(), ip.to_string());
        if let Some(p) = parent {
            annotations.insert("clusterip.allocator/parent".to_string(), p.to_string());
        }
        let lease = Lease {
            metadata: ObjectMeta { name: Some(lease_name(ip)), labels: Some(labels), annotations: Some(annotations), ..Default::default() },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.identity.clone()),
                lease_duration_seconds: Some(RESERVATION_TTL.as_secs() as i32),
                acquire_time: Some(MicroTime(now())),
                ..Default::default()
            }),
        };
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(api_err(&format!("creating the reservation for {ip}"), e)),
        }
    }

    fn mark(&self, range: usize, ip: IpAddr) {
        let _ = lock(&self.taken)[range].allocate(ip);
    }
}

fn now() -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::now()
}

fn age(t: &k8s_openapi::jiff::Timestamp) -> Duration {
    let secs = now().duration_since(*t).as_secs_f64();
    Duration::from_secs_f64(secs.max(0.0))
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
        for _ in 0..MAX_ATTEMPTS {
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
        Err(StoreError::Unavailable(format!("{MAX_ATTEMPTS} candidates in a row were taken; retry")))
    }

    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        let Ok(range) = self.ranges.index_of(ip) else { return Ok(()) };
        match self.api.delete(&lease_name(ip), &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(api_err(&format!("releasing the reservation for {ip}"), e)),
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
}
