//! An [`AllocationStore`] that records Kubernetes-style allocator metrics around another: a
//! decorator above `store/` (metrics depend on the store, never the reverse).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;

use crate::cidr::{Family, ServiceCidr};
use crate::store::ipaddress::apiserver_ips::ApiserverIps;
use crate::store::{AllocationStore, ParentRef, RangeUsage, StoreError, Unreadable};

use super::Metrics;

pub struct MeteredStore {
    inner: Arc<dyn AllocationStore>,
    metrics: Arc<Metrics>,
    /// The cluster's IPAddress view, when the store does not report its unreadable objects
    /// itself (the etcd backend).
    recorded: Option<ApiserverIps>,
}

impl MeteredStore {
    pub fn new(inner: Arc<dyn AllocationStore>, metrics: Arc<Metrics>) -> Self {
        for cidr in inner.ranges() {
            metrics.report_range_at_zero(&cidr.to_string());
        }
        Self { inner, metrics, recorded: None }
    }

    /// Also report the unreadable IPAddress objects `recorded` sees.
    pub fn with_recorded(mut self, recorded: ApiserverIps) -> Self {
        self.recorded = Some(recorded);
        self
    }

    /// Refresh the allocated/available gauges (per range and per band) from the store.
    pub async fn refresh_gauges(&self) -> Result<(), StoreError> {
        self.metrics.set_unreadable(&self.unreadable());
        self.metrics.set_block_events(&self.inner.block_events());
        for u in self.inner.usage().await? {
            self.metrics.set_usage(&u.cidr.to_string(), u.used, u.free, u.pooled, u.map_bytes);
        }
        let allocated = self.inner.allocated().await?;
        self.metrics.set_bands(&crate::capacity::report(&self.inner.ranges(), &allocated, &[], 0));
        Ok(())
    }

    fn label_for(&self, ip: Option<IpAddr>, family: Option<Family>) -> String {
        let ranges = self.inner.ranges();
        let hit = match (ip, family) {
            (Some(ip), _) => ranges.iter().find(|c| c.contains(ip)),
            (None, Some(f)) => ranges.iter().find(|c| c.family() == f),
            _ => None,
        };
        hit.map(|c| c.to_string()).unwrap_or_else(|| "none".into())
    }
}

#[async_trait]
impl AllocationStore for MeteredStore {
    fn block_events(&self) -> Vec<(&'static str, u64)> {
        self.inner.block_events()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn ranges(&self) -> Vec<ServiceCidr> {
        self.inner.ranges()
    }

    fn families(&self) -> Vec<crate::cidr::Family> {
        self.inner.families()
    }

    async fn allocate(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<(), StoreError> {
        let started = Instant::now();
        let r = self.inner.allocate(ip, parent).await;
        self.metrics.allocation(&self.label_for(Some(ip), None), "static", r.is_ok(), started.elapsed());
        r
    }

    async fn allocate_next(&self, family: Family, parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        let started = Instant::now();
        let r = self.inner.allocate_next(family, parent).await;
        let label = self.label_for(r.as_ref().ok().copied(), Some(family));
        self.metrics.allocation(&label, "dynamic", r.is_ok(), started.elapsed());
        r
    }

    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        self.inner.release(ip).await
    }

    async fn release_owned(&self, ip: IpAddr, owner: &ParentRef) -> Result<(), StoreError> {
        self.inner.release_owned(ip, owner).await
    }

    async fn owner(&self, ip: IpAddr) -> Result<Option<ParentRef>, StoreError> {
        self.inner.owner(ip).await
    }

    async fn owners(&self) -> Result<Vec<(IpAddr, ParentRef)>, StoreError> {
        self.inner.owners().await
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        self.inner.has(ip).await
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        self.inner.allocated().await
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        self.inner.usage().await
    }

    async fn ready(&self) -> Result<(), StoreError> {
        self.inner.ready().await
    }

    fn unreadable(&self) -> Vec<Unreadable> {
        let mut all = self.inner.unreadable();
        all.extend(self.recorded.iter().flat_map(|r| r.unreadable()));
        all
    }

    async fn close(&self) -> Result<(), StoreError> {
        self.inner.close().await
    }
}
