//! Which configured range an address or family request goes to.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::Api;

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

/// The families of `ranges`, in the order they first appear (the first is the default).
pub fn families_of(ranges: &[ServiceCidr]) -> Vec<Family> {
    let mut fams = Vec::new();
    for c in ranges {
        if !fams.contains(&c.family()) {
            fams.push(c.family());
        }
    }
    fams
}

/// The cidrs of a ServiceCIDR object, each with whether it gives new addresses (Ready and not
/// being deleted; see [`crate::k8s::servicecidr::allocatable`]).
pub fn servicecidr_ranges(obj: &ServiceCIDR) -> Vec<(ServiceCidr, bool)> {
    let allocatable = crate::k8s::servicecidr::allocatable(obj);
    crate::k8s::servicecidr::ranges(obj).into_iter().map(|c| (c, allocatable)).collect()
}

/// The cluster's ServiceCIDR objects by name, each as its ranges ([`servicecidr_ranges`]):
/// watched until the task ends, `on` called with the whole set after every change — the
/// first call once the first list is in.
pub async fn watch_servicecidrs(api: Api<ServiceCIDR>, mut on: impl FnMut(&BTreeMap<String, Vec<(ServiceCidr, bool)>>)) {
    let mut objects = BTreeMap::new();
    let read = |obj: &ServiceCIDR| (obj.metadata.name.clone().unwrap_or_default(), servicecidr_ranges(obj));
    super::fold::fold(api, "ServiceCIDR", read, move |change| {
        match change {
            super::fold::Change::Replace(list) => objects = list.into_iter().collect(),
            super::fold::Change::Apply((name, ranges)) => {
                objects.insert(name, ranges);
            }
            super::fold::Change::Delete((name, _)) => {
                objects.remove(&name);
            }
        }
        on(&objects);
    })
    .await
}

/// The ranges a store allocates from, in the order it tries them, each with whether it
/// gives new addresses: the `--service-cidr` ranges first (always), then those of the
/// ServiceCIDR objects (`servicecidrs`, in the order given), each CIDR once — allocatable if
/// it is a `--service-cidr` range or any object naming it is.
pub fn wanted_ranges<'a>(flag_ranges: &[ServiceCidr], servicecidrs: impl IntoIterator<Item = &'a [(ServiceCidr, bool)]>) -> Vec<(ServiceCidr, bool)> {
    let mut wanted: Vec<(ServiceCidr, bool)> = Vec::new();
    for c in flag_ranges {
        if !wanted.iter().any(|(w, _)| w == c) {
            wanted.push((c.clone(), true));
        }
    }
    for list in servicecidrs {
        for (cidr, ok) in list {
            match wanted.iter_mut().find(|(c, _)| c == cidr) {
                Some(entry) => entry.1 |= *ok,
                None => wanted.push((cidr.clone(), *ok)),
            }
        }
    }
    wanted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> ServiceCidr {
        ServiceCidr::parse(s).expect("cidr")
    }

    #[test]
    fn flags_first_then_servicecidrs_each_cidr_once() {
        let flags = [cidr("198.19.0.0/24")];
        let a = vec![(cidr("198.19.0.0/24"), false), (cidr("fd00:10:96::/112"), true)];
        let b = vec![(cidr("198.18.200.0/24"), false)];
        let c = vec![(cidr("198.18.200.0/24"), true), (cidr("198.18.201.0/24"), false)];
        let wanted = wanted_ranges(&flags, [a.as_slice(), b.as_slice(), c.as_slice()]);
        assert_eq!(
            wanted,
            [(cidr("198.19.0.0/24"), true), (cidr("fd00:10:96::/112"), true), (cidr("198.18.200.0/24"), true), (cidr("198.18.201.0/24"), false)],
            "a flag range stays allocatable whatever its object says; a CIDR two objects name is allocatable if either is"
        );
    }
}
