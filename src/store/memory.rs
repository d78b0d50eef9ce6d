//! An [`AllocationStore`] in memory: the allocation maps and nothing else, durable for the
//! life of the value. For the fast unit tests of the layers above the store (admission, the
//! Service reconciler), as Kubernetes tests its registry on an in-memory allocator; never a
//! backend a controller runs with.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;

use async_trait::async_trait;

use crate::alloc::AllocationMap;
use crate::cidr::{Family, ServiceCidr};

use super::{AllocationStore, ParentRef, RangeSet, RangeUsage, StoreError};
use crate::sync::lock;

/// Allocation maps per range and the owners recorded for non-Service parents, behind one
/// lock.
pub struct MemoryStore {
    ranges: RangeSet,
    maps: Mutex<(Vec<AllocationMap>, BTreeMap<IpAddr, ParentRef>)>,
}

impl MemoryStore {
    pub fn new(cidrs: Vec<ServiceCidr>) -> Self {
        let maps = cidrs.iter().map(|c| AllocationMap::new(c.clone())).collect();
        Self { ranges: RangeSet::new(cidrs), maps: Mutex::new((maps, BTreeMap::new())) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, (Vec<AllocationMap>, BTreeMap<IpAddr, ParentRef>)> {
        lock(&self.maps)
    }

    /// Record `parent` as the owner when it is not a Service (as the etcd backend does).
    fn own(owners: &mut BTreeMap<IpAddr, ParentRef>, ip: IpAddr, parent: Option<&ParentRef>) {
        if let Some(p) = parent.filter(|p| !p.is_service()) {
            owners.insert(ip, p.clone());
        }
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

    async fn allocate(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<(), StoreError> {
        let i = self.ranges.index_of(ip)?;
        let mut st = self.state();
        st.0[i].allocate(ip)?;
        Self::own(&mut st.1, ip, parent);
        Ok(())
    }

    async fn allocate_next(&self, family: Family, parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        let idx = self.ranges.of_family(family)?;
        let mut st = self.state();
        let mut last = None;
        for i in idx {
            match st.0[i].allocate_next() {
                Ok(ip) => {
                    Self::own(&mut st.1, ip, parent);
                    return Ok(ip);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.map(StoreError::Alloc).unwrap_or(StoreError::NoRangeForFamily(family)))
    }

    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        let mut st = self.state();
        if let Some(owner) = st.1.get(&ip) {
            return Err(StoreError::NotOwner { ip, owner: owner.clone() });
        }
        if let Ok(i) = self.ranges.index_of(ip) {
            st.0[i].release(ip);
        }
        Ok(())
    }

    async fn release_owned(&self, ip: IpAddr, owner: &ParentRef) -> Result<(), StoreError> {
        let mut st = self.state();
        match st.1.get(&ip) {
            Some(o) if o == owner => {
                st.1.remove(&ip);
            }
            Some(o) => return Err(StoreError::NotOwner { ip, owner: o.clone() }),
            None => {}
        }
        if let Ok(i) = self.ranges.index_of(ip) {
            st.0[i].release(ip);
        }
        Ok(())
    }

    async fn owner(&self, ip: IpAddr) -> Result<Option<ParentRef>, StoreError> {
        Ok(self.state().1.get(&ip).cloned())
    }

    async fn owners(&self) -> Result<Vec<(IpAddr, ParentRef)>, StoreError> {
        Ok(self.state().1.iter().map(|(ip, p)| (*ip, p.clone())).collect())
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        Ok(self.ranges.index_of(ip).map(|i| self.state().0[i].has(ip)).unwrap_or(false))
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        let mut all: Vec<IpAddr> = self.state().0.iter().flat_map(|m| m.iter().collect::<Vec<_>>()).collect();
        all.sort();
        Ok(all)
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        Ok(self.state().0.iter().map(|m| RangeUsage { cidr: m.cidr().clone(), used: m.used(), free: m.free(), pooled: 0, map_bytes: None }).collect())
    }
}
