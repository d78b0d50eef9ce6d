//! Which configured range an address or family request goes to.

use std::net::IpAddr;

use crate::alloc::AllocError;
use crate::cidr::{Family, ServiceCidr};

use super::StoreError;

/// The configured service CIDRs of a store, in configuration order.
#[derive(Clone, Debug)]
pub struct RangeSet {
    cidrs: Vec<ServiceCidr>,
}

impl RangeSet {
    pub fn new(cidrs: Vec<ServiceCidr>) -> Self {
        Self { cidrs }
    }

    pub fn cidrs(&self) -> &[ServiceCidr] {
        &self.cidrs
    }

    /// Index of the range whose usable addresses contain `ip`, or Kubernetes' out-of-range
    /// error naming every valid range of the address's family.
    pub fn index_of(&self, ip: IpAddr) -> Result<usize, StoreError> {
        if let Some(i) = self.cidrs.iter().position(|c| c.contains(ip)) {
            return Ok(i);
        }
        let family = Family::of(ip);
        let valid: Vec<String> = self.cidrs.iter().filter(|c| c.family() == family).map(|c| c.to_string()).collect();
        let valid_range = if valid.is_empty() {
            self.cidrs.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ")
        } else {
            valid.join(", ")
        };
        Err(StoreError::Alloc(AllocError::NotInRange { ip, valid_range }))
    }

    /// Indexes of the ranges of `family`, in configuration order.
    pub fn of_family(&self, family: Family) -> Result<Vec<usize>, StoreError> {
        let idx: Vec<usize> = (0..self.cidrs.len()).filter(|&i| self.cidrs[i].family() == family).collect();
        if idx.is_empty() {
            Err(StoreError::NoRangeForFamily(family))
        } else {
            Ok(idx)
        }
    }
}
