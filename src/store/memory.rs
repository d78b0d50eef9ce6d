//! An [`AllocationStore`] in memory: the allocation maps and nothing else, durable for the
//! life of the value. For the fast unit tests of the layers above the store (admission, the
//! Service reconciler), as Kubernetes tests its registry on an in-memory allocator; never a
//! backend a controller runs with.

use std::net::IpAddr;
use std::sync::Mutex;

use async_trait::async_trait;

use crate::alloc::AllocationMap;
use crate::cidr::{Family, ServiceCidr};

use super::{AllocationStore, ParentRef, RangeSet, RangeUsage, StoreError};

/// Allocation maps per range, behind one lock.
pub struct MemoryStore {
    ranges: RangeSet,
    maps: Mutex<Vec<AllocationMap>>,
}

impl MemoryStore {
    pub fn new(cidrs: Vec<ServiceCidr>) -> Self {
        let maps = cidrs.iter().map(|c| AllocationMap::new(c.clone())).collect();
        Self { ranges: RangeSet::new(cidrs), maps: Mutex::new(maps) }
    }

    fn maps(&self) -> std::sync::MutexGuard<'_, Vec<AllocationMap>> {
        self.maps.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl AllocationStore for MemoryStore {
    fn backend(&self) -> &'static str {
        "memory"
    }

    fn ranges(&self) -> Vec<ServiceCidr> {
        self.ranges.cidrs().to_vec()
    }

    async fn allocate(&self, ip: IpAddr, _parent: Option<&ParentRef>) -> Result<(), StoreError> {
        let i = self.ranges.index_of(ip)?;
        Ok(self.maps()[i].allocate(ip)?)
    }

    async fn allocate_next(&self, family: Family, _parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        let idx = self.ranges.of_family(family)?;
        let mut maps = self.maps();
        let mut last = None;
        for i in idx {
            match maps[i].allocate_next() {
                Ok(ip) => return Ok(ip),
                Err(e) => last = Some(e),
            }
        }
        Err(last.map(StoreError::Alloc).unwrap_or(StoreError::NoRangeForFamily(family)))
    }

    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        if let Ok(i) = self.ranges.index_of(ip) {
            self.maps()[i].release(ip);
        }
        Ok(())
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        Ok(self.ranges.index_of(ip).map(|i| self.maps()[i].has(ip)).unwrap_or(false))
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        let mut all: Vec<IpAddr> = self.maps().iter().flat_map(|m| m.iter().collect::<Vec<_>>()).collect();
        all.sort();
        Ok(all)
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        Ok(self.maps().iter().map(|m| RangeUsage { cidr: m.cidr().clone(), used: m.used(), free: m.free(), pooled: 0 }).collect())
    }
}
