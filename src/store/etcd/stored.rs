//! A range's map as stored, beside the range this replica is configured with. They differ
//! while `--service-cidr` changes in a rolling update: a range keeps the key it was first
//! stored under, and its value names the widest range any replica wrote (the snapshot's
//! header carries its CIDR). A replica decides on the part of the stored map inside its own
//! range (so its bands and picks are its own) and writes back the stored map whole: what lies
//! outside its range — another replica's allocations, a removed part's — is kept untouched.
//! A replica of a wider range widens the value; nothing ever narrows it.

use std::net::IpAddr;

use crate::alloc::{AllocError, AllocationMap};
use crate::cidr::ServiceCidr;
use crate::store::StoreError;

/// Decode the value stored at `key` into the map of `cidr` and what the value holds outside it.
pub(super) fn decode(key: &str, cidr: &ServiceCidr, value: &[u8]) -> Result<(AllocationMap, Stored), StoreError> {
    Stored::decode(cidr, value).map_err(|e| StoreError::Corrupt {
        record: format!("the allocation map stored at {key}"),
        reason: e.to_string(),
        consequence: super::keys::MAP_CONSEQUENCE,
    })
}

/// The stored value's range and the addresses it holds outside the configured range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Stored {
    pub(super) cidr: ServiceCidr,
    pub(super) outside: Vec<IpAddr>,
}

impl Stored {
    /// Nothing stored yet, or stored as configured.
    pub(super) fn as_configured(configured: &ServiceCidr) -> Self {
        Self { cidr: configured.clone(), outside: Vec::new() }
    }

    /// A stored value read as the map of `configured` and what lies outside it.
    pub(super) fn decode(configured: &ServiceCidr, value: &[u8]) -> Result<(AllocationMap, Self), AllocError> {
        if let Ok(map) = AllocationMap::restore(configured, value) {
            return Ok((map, Self::as_configured(configured)));
        }
        let stored = AllocationMap::restore_stored(value)?;
        let cidr = stored.cidr().clone();
        if !cidr.overlaps(configured) {
            return Err(AllocError::Snapshot(format!("the map stored here is of {cidr}, which does not overlap {configured}")));
        }
        let mut map = AllocationMap::new(configured.clone());
        // An address of the stored range that is not a usable one of ours (outside it, or our
        // network or broadcast address) is kept as it is.
        let outside = stored.iter().filter(|ip| map.allocate(*ip).is_err()).collect();
        Ok((map, Self { cidr, outside }))
    }

    /// The value to write for `map` (of the configured range): the wider of the two ranges,
    /// with what lies outside the configured one kept.
    pub(super) fn encode(&self, map: &AllocationMap) -> Vec<u8> {
        if self.outside.is_empty() && map.cidr().contains_cidr(&self.cidr) {
            return map.snapshot();
        }
        let mut wide = AllocationMap::new(self.cidr.clone());
        for ip in map.iter().chain(self.outside.iter().copied()) {
            let _ = wide.allocate(ip);
        }
        wide.snapshot()
    }

    /// What is stored after `encode` was written.
    pub(super) fn written(&self, configured: &ServiceCidr) -> Self {
        let cidr = if configured.contains_cidr(&self.cidr) { configured.clone() } else { self.cidr.clone() };
        Self { cidr, outside: self.outside.clone() }
    }
}

/// A range key found under the prefix: its name's range and, when readable, its value's.
pub(super) struct Found {
    pub(super) key: String,
    pub(super) named: ServiceCidr,
    pub(super) holds: Option<ServiceCidr>,
}

impl Found {
    fn overlaps(&self, cidr: &ServiceCidr) -> bool {
        self.named.overlaps(cidr) || self.holds.as_ref().is_some_and(|h| h.overlaps(cidr))
    }
}

/// The key each configured range is stored under: the one stored range it overlaps (a range
/// changed by widening, shrinking or moving inside a stored one keeps that key), else a new
/// key named by the range. Two stored ranges for one configured range, or one stored range
/// for two configured ones, are refused: one range takes over one stored range.
pub(super) fn choose_keys(prefix: &str, configured: &[ServiceCidr], found: &[Found]) -> Result<Vec<String>, String> {
    let mut keys: Vec<String> = Vec::new();
    for cidr in configured {
        let hits: Vec<&Found> = found.iter().filter(|f| f.overlaps(cidr)).collect();
        let key = match hits.as_slice() {
            [] => super::keys::range_key(prefix, cidr),
            [one] => one.key.clone(),
            many => {
                let named: Vec<String> = many.iter().map(|f| format!("{} ({})", f.key, f.holds.as_ref().unwrap_or(&f.named))).collect();
                return Err(format!(
                    "--service-cidr {cidr} overlaps {} stored ranges: {}; a range can take over one stored range only (widen or shrink one range at a time, and keep ranges added beside each other)",
                    many.len(),
                    named.join(", ")
                ));
            }
        };
        if let Some(i) = keys.iter().position(|k| *k == key) {
            return Err(format!("--service-cidr {} and {cidr} both overlap the range stored at {key}; give one range over it", configured[i]));
        }
        keys.push(key);
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> ServiceCidr {
        ServiceCidr::parse(s).expect("cidr")
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn a_narrower_replica_keeps_what_lies_outside_its_range_and_a_wider_one_widens_the_value() {
        let mut wide = AllocationMap::new(cidr("10.0.0.0/25"));
        for a in ["10.0.0.5", "10.0.0.63", "10.0.0.100"] {
            wide.allocate(ip(a)).expect("allocate");
        }
        let (mut map, stored) = Stored::decode(&cidr("10.0.0.0/26"), &wide.snapshot()).expect("decode");
        assert_eq!(map.iter().collect::<Vec<_>>(), vec![ip("10.0.0.5")]);
        // .63 is the /26's broadcast address, .100 lies outside: both kept.
        assert_eq!(stored.outside, vec![ip("10.0.0.63"), ip("10.0.0.100")]);
        map.allocate(ip("10.0.0.9")).expect("allocate");
        let back = AllocationMap::restore(&cidr("10.0.0.0/25"), &stored.encode(&map)).expect("still the /25");
        assert_eq!(back.iter().map(|i| i.to_string()).collect::<Vec<_>>(), ["10.0.0.5", "10.0.0.9", "10.0.0.63", "10.0.0.100"]);

        let mut narrow = AllocationMap::new(cidr("10.0.0.0/26"));
        narrow.allocate(ip("10.0.0.7")).expect("allocate");
        let (mut map, stored) = Stored::decode(&cidr("10.0.0.0/25"), &narrow.snapshot()).expect("decode");
        assert_eq!(stored, Stored { cidr: cidr("10.0.0.0/26"), outside: vec![] });
        map.allocate(ip("10.0.0.90")).expect("allocate");
        let back = AllocationMap::restore(&cidr("10.0.0.0/25"), &stored.encode(&map)).expect("widened to the /25");
        assert_eq!(back.used(), 2);
        assert_eq!(stored.written(&cidr("10.0.0.0/25")).cidr, cidr("10.0.0.0/25"));
        assert!(Stored::decode(&cidr("10.1.0.0/25"), &narrow.snapshot()).is_err(), "a map of a range that does not overlap");
    }

    #[test]
    fn a_changed_range_keeps_the_key_of_the_stored_range_it_overlaps() {
        let found = |k: &str, n: &str, h: Option<&str>| Found { key: k.into(), named: cidr(n), holds: h.map(cidr) };
        let stored = vec![found("/p/10.0.0.0/26", "10.0.0.0/26", Some("10.0.0.0/25")), found("/p/fd00::/120", "fd00::/120", None)];
        let keys = choose_keys("/p", &[cidr("10.0.0.0/24"), cidr("10.9.0.0/24")], &stored).expect("keys");
        assert_eq!(keys, ["/p/10.0.0.0/26", "/p/10.9.0.0/24"]);
        // Inside the value's range but not the name's: the value counts.
        assert_eq!(choose_keys("/p", &[cidr("10.0.0.64/26")], &stored).expect("keys"), ["/p/10.0.0.0/26"]);
        let e = choose_keys("/p", &[cidr("10.0.0.0/26"), cidr("10.0.0.64/26")], &stored).expect_err("two over one");
        assert!(e.contains("both overlap the range stored at /p/10.0.0.0/26"), "{e}");
        let two = vec![found("/p/10.0.0.0/26", "10.0.0.0/26", None), found("/p/10.0.0.64/26", "10.0.0.64/26", None)];
        let e = choose_keys("/p", &[cidr("10.0.0.0/25")], &two).expect_err("one over two");
        assert!(e.starts_with("--service-cidr 10.0.0.0/25 overlaps 2 stored ranges"), "{e}");
    }
}
