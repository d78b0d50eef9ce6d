//! The layout of address blocks and the shape of a block's Lease: range math and names,
//! pure (no I/O, no clock). The book (`book.rs`) and the Lease client build on it.

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::ObjectMeta;
use rand::Rng;

use crate::cidr::ServiceCidr;

/// Label on every block Lease (value "true").
pub const BLOCK_LABEL: &str = "clusterip.allocator/block";
/// Annotation naming the block's range (the CIDR text).
pub const RANGE_ANNOTATION: &str = "clusterip.allocator/range";
/// Annotation naming the block's first and last address (informative).
pub const ADDRESSES_ANNOTATION: &str = "clusterip.allocator/addresses";

/// The largest block size [`auto_block_size`] chooses (addresses).
pub const MAX_AUTO_BLOCK_SIZE: u64 = 256;
/// Annotation a replica with no room left writes on another replica's block Lease: its
/// holderIdentity, asking the holder to give one of its blocks of that range back.
pub const WANTED_ANNOTATION: &str = "clusterip.allocator/wanted-by";

/// One block: offsets `[first, end)` of the usable addresses of its range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSpan {
    pub index: u64,
    pub first: u64,
    pub end: u64,
}

impl BlockSpan {
    /// Whether `ip` is one of the span's addresses of range `cidr`.
    pub fn covers(&self, cidr: &ServiceCidr, ip: IpAddr) -> bool {
        cidr.offset_of(ip).is_some_and(|o| o >= self.first && o < self.end)
    }

    /// How many of the span's addresses of range `cidr` are not `taken`.
    pub fn free(&self, cidr: &ServiceCidr, taken: impl Fn(IpAddr) -> bool) -> usize {
        (self.first..self.end).filter(|off| cidr.ip_at(*off).is_some_and(|ip| !taken(ip))).count()
    }
}

/// The block size of a range when `--address-block-size` is not given: a sixteenth of the
/// addresses its CIDR spans (a power of two), from 1 to [`MAX_AUTO_BLOCK_SIZE`] — about 16
/// blocks or more per range, so that up to four replicas each find free blocks (the sizing
/// rule: at most addresses / (4 × replicas)); 256-address blocks from a /20 (4096) up.
pub fn auto_block_size(cidr: &ServiceCidr) -> u64 {
    (cidr.raw_size() / 16).clamp(1, u128::from(MAX_AUTO_BLOCK_SIZE)) as u64
}

/// The blocks of a range: the dynamic band cut into `size`-address blocks (the last one
/// may be shorter), then the static band likewise. Returns (dynamic block count, total).
pub fn layout(cidr: &ServiceCidr, size: u64) -> (u64, u64) {
    let dynamic = (cidr.size() - cidr.band_offset()).div_ceil(size);
    let stat = cidr.band_offset().div_ceil(size);
    (dynamic, dynamic + stat)
}

/// Block `index` of a range (see [`layout`]), or None past the last.
pub fn span(cidr: &ServiceCidr, size: u64, index: u64) -> Option<BlockSpan> {
    let (dynamic, total) = layout(cidr, size);
    if index >= total {
        return None;
    }
    let (first, limit) = if index < dynamic {
        (cidr.band_offset() + index * size, cidr.size())
    } else {
        ((index - dynamic) * size, cidr.band_offset())
    };
    Some(BlockSpan { index, first, end: (first + size).min(limit) })
}

/// The span a block's Lease names in its `clusterip.allocator/addresses` annotation
/// ("first-last"), read against the range: what every replica treats as taken by that
/// Lease, whatever its own block size. None when the annotation is missing or names
/// addresses outside the range.
pub fn lease_span(cidr: &ServiceCidr, index: u64, lease: &Lease) -> Option<BlockSpan> {
    let text = lease.metadata.annotations.as_ref()?.get(ADDRESSES_ANNOTATION)?;
    let (a, b) = text.split_once('-')?;
    let first = cidr.offset_of(crate::cidr::parse_ip(a.trim()).ok()?)?;
    let last = cidr.offset_of(crate::cidr::parse_ip(b.trim()).ok()?)?;
    (first <= last).then_some(BlockSpan { index, first, end: last + 1 })
}

/// The part of `cidr` a block Lease of another range names (a replica of a wider or narrower
/// `--service-cidr`, in a rolling update of the range; or a ServiceCIDR object's range that
/// overlaps ours): its `clusterip.allocator/addresses` clipped to `cidr`'s usable addresses.
/// None when they share none.
pub fn foreign_span(cidr: &ServiceCidr, lease: &Lease) -> Option<BlockSpan> {
    let text = lease.metadata.annotations.as_ref()?.get(ADDRESSES_ANNOTATION)?;
    let (a, b) = text.split_once('-')?;
    clip(cidr, crate::cidr::parse_ip(a.trim()).ok()?, crate::cidr::parse_ip(b.trim()).ok()?)
}

/// `span` of range `from` as a span of range `to` (the addresses both name, by `to`'s
/// offsets; index 0). None when they share none: ranges of one replica may overlap when
/// ServiceCIDR objects name overlapping CIDRs.
pub fn translate(from: &ServiceCidr, span: &BlockSpan, to: &ServiceCidr) -> Option<BlockSpan> {
    if from == to {
        return Some(*span);
    }
    clip(to, from.ip_at(span.first)?, from.ip_at(span.end.checked_sub(1)?)?)
}

/// The addresses from `a` to `b` (inclusive) that are usable addresses of `cidr`, as a span
/// of its offsets (index 0). None when there are none or the families differ.
fn clip(cidr: &ServiceCidr, a: IpAddr, b: IpAddr) -> Option<BlockSpan> {
    let (lo, hi) = (cidr.ip_at(0)?, cidr.ip_at(cidr.size().checked_sub(1)?)?);
    let key = |ip: IpAddr| match ip {
        IpAddr::V4(v) => (4u8, u128::from(u32::from(v))),
        IpAddr::V6(v) => (6u8, u128::from(v)),
    };
    let (first, last) = (key(a).max(key(lo)), key(b).min(key(hi)));
    if first > last || key(a).0 != key(lo).0 {
        return None;
    }
    let first = cidr.offset_of(if first == key(lo) { lo } else { a })?;
    let last = cidr.offset_of(if last == key(hi) { hi } else { b })?;
    (first <= last).then_some(BlockSpan { index: 0, first, end: last + 1 })
}

/// Whether two spans share an address.
pub fn overlap(a: &BlockSpan, b: &BlockSpan) -> bool {
    a.first < b.end && b.first < a.end
}

/// Indices of the blocks of `size` (see [`layout`]) that share an address with `other`.
pub fn blocks_overlapping(cidr: &ServiceCidr, size: u64, other: &BlockSpan) -> Vec<u64> {
    let (dynamic, _) = layout(cidr, size);
    let band = cidr.band_offset();
    let mut out = Vec::new();
    // The dynamic band's blocks, counted from the band's start.
    let (lo, hi) = (other.first.max(band), other.end.min(cidr.size()));
    if lo < hi {
        out.extend((lo - band) / size..=(hi - 1 - band) / size);
    }
    // The static band's, after them.
    let (lo, hi) = (other.first, other.end.min(band));
    if lo < hi {
        out.extend(dynamic + lo / size..=dynamic + (hi - 1) / size);
    }
    out
}

/// The Lease name of a block: `clusterip-block-`, the range's network address in hex, its
/// prefix length, and the block index (always a valid object name).
pub fn block_name(cidr: &ServiceCidr, index: u64) -> String {
    let bytes: Vec<u8> = match cidr.network() {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("clusterip-block-{hex}-{}-{index}", cidr.prefix_len())
}

/// (range, index) of a block Lease name of ours among `cidrs`. The index counts blocks of the
/// size of the replica that named it, which need not be ours.
pub fn block_of(cidrs: &[ServiceCidr], name: &str) -> Option<(usize, u64)> {
    let rest = name.strip_prefix("clusterip-block-")?;
    let (prefix, index) = rest.rsplit_once('-')?;
    let index: u64 = index.parse().ok()?;
    let range = cidrs.iter().position(|c| block_name(c, 0).strip_suffix("-0") == Some(&format!("clusterip-block-{prefix}")))?;
    Some((range, index))
}

/// A free block index: a random dynamic one not in `busy`, else the first free static one.
pub fn free_block(busy: &HashSet<u64>, dynamic: u64, total: u64) -> Option<u64> {
    let pick = |from: u64, to: u64| -> Option<u64> {
        if from >= to {
            return None;
        }
        let n = to - from;
        let start = rand::thread_rng().gen_range(0..n);
        // Bounded probe: a /64's band has more blocks than any list could hold.
        (0..n.min(1 << 20)).map(|k| from + (start + k) % n).find(|i| !busy.contains(i))
    };
    pick(0, dynamic).or_else(|| pick(dynamic, total))
}

/// Who asks for a block through `lease` (see [`WANTED_ANNOTATION`]).
pub fn wanted_by(lease: &Lease) -> Option<&str> {
    lease.metadata.annotations.as_ref()?.get(WANTED_ANNOTATION).map(String::as_str)
}

/// `lease` without a hand-over request (every renewal clears it).
pub fn without_request(lease: &mut Lease) {
    if let Some(a) = lease.metadata.annotations.as_mut() {
        a.remove(WANTED_ANNOTATION);
    }
}

/// The Lease of block `span` of range `cidr`, held by `holder` from `now` (wall time, as
/// written into acquireTime and renewTime; nobody compares it with their clock).
pub fn block_lease(cidr: &ServiceCidr, span: BlockSpan, holder: &str, lease_duration: std::time::Duration, now: MicroTime) -> Lease {
    let mut labels = BTreeMap::new();
    labels.insert(BLOCK_LABEL.to_string(), "true".to_string());
    let mut annotations = BTreeMap::new();
    annotations.insert(RANGE_ANNOTATION.to_string(), cidr.to_string());
    if let (Some(a), Some(b)) = (cidr.ip_at(span.first), cidr.ip_at(span.end - 1)) {
        annotations.insert(ADDRESSES_ANNOTATION.to_string(), format!("{a}-{b}"));
    }
    Lease {
        metadata: ObjectMeta { name: Some(block_name(cidr, span.index)), labels: Some(labels), annotations: Some(annotations), ..Default::default() },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.to_string()),
            lease_duration_seconds: Some(lease_duration.as_secs().max(1).min(i32::MAX as u64) as i32),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            lease_transitions: Some(0),
            ..Default::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_dynamic_band_first_then_the_static_band() {
        // /21: 2046 usable, static band 128.
        let c = ServiceCidr::parse("198.19.104.0/21").expect("cidr");
        assert_eq!(layout(&c, 256), (8, 9));
        assert_eq!(span(&c, 256, 0), Some(BlockSpan { index: 0, first: 128, end: 384 }));
        assert_eq!(span(&c, 256, 7), Some(BlockSpan { index: 7, first: 1920, end: 2046 }));
        assert_eq!(span(&c, 256, 8), Some(BlockSpan { index: 8, first: 0, end: 128 }));
        assert_eq!(span(&c, 256, 9), None);
        // Every usable address is in exactly one block.
        let mut seen = vec![0u8; c.size() as usize];
        for i in 0..layout(&c, 100).1 {
            let s = span(&c, 100, i).expect("span");
            for off in s.first..s.end {
                seen[off as usize] += 1;
            }
        }
        assert!(seen.iter().all(|n| *n == 1));
    }

    #[test]
    fn block_names_are_valid_and_distinct_per_range() {
        let a = ServiceCidr::parse("198.19.104.0/21").expect("cidr");
        let b = ServiceCidr::parse("fd00:10:96::6800/117").expect("cidr");
        assert_eq!(block_name(&a, 3), "clusterip-block-c6136800-21-3");
        assert_eq!(block_name(&b, 0), "clusterip-block-fd000010009600000000000000006800-117-0");
    }

    #[test]
    fn free_blocks_come_from_the_dynamic_band_first() {
        let busy: HashSet<u64> = (0..7).collect();
        assert_eq!(free_block(&busy, 8, 9), Some(7));
        let busy: HashSet<u64> = (0..8).collect();
        assert_eq!(free_block(&busy, 8, 9), Some(8));
        let busy: HashSet<u64> = (0..9).collect();
        assert_eq!(free_block(&busy, 8, 9), None);
    }

    #[test]
    fn the_automatic_block_size_leaves_at_least_sixteen_blocks_up_to_256_addresses_each() {
        for (cidr, size) in [
            ("198.19.0.0/28", 1),
            ("198.19.0.0/25", 8),
            ("198.19.0.0/24", 16),
            ("198.19.0.0/29", 1),
            ("198.19.0.0/21", 128),
            ("198.19.0.0/20", 256),
            ("198.19.0.0/16", 256),
            ("fd00:10:96::/113", 256),
            ("fd00:10:96::/64", 256),
        ] {
            let c = ServiceCidr::parse(cidr).expect("cidr");
            assert_eq!(auto_block_size(&c), size, "{cidr}");
            assert!(layout(&c, size).1 >= c.size().min(14), "{cidr}: {} blocks", layout(&c, size).1);
        }
    }

    #[test]
    fn a_lease_names_its_span_in_addresses_of_the_range() {
        let c = ServiceCidr::parse("198.19.104.0/21").expect("cidr");
        let mut lease = Lease::default();
        let mut a = BTreeMap::new();
        a.insert(ADDRESSES_ANNOTATION.to_string(), "198.19.104.129-198.19.105.128".to_string());
        lease.metadata.annotations = Some(a.clone());
        assert_eq!(lease_span(&c, 0, &lease), span(&c, 256, 0));
        for bad in ["198.19.105.128-198.19.104.129", "10.0.0.1-10.0.0.2", "198.19.104.129", "x-y"] {
            a.insert(ADDRESSES_ANNOTATION.to_string(), bad.to_string());
            lease.metadata.annotations = Some(a.clone());
            assert_eq!(lease_span(&c, 0, &lease), None, "{bad}");
        }
    }

    proptest::proptest! {
        /// The blocks of one size that share an address with a block of another size are
        /// exactly those `blocks_overlapping` names (brute force over every address).
        #[test]
        fn blocks_overlapping_names_exactly_the_blocks_sharing_an_address(prefix in 20u8..=30, mine in 1u64..300, theirs in 1u64..300, pick in 0u64..10_000) {
            let c = ServiceCidr::parse(&format!("198.19.0.0/{prefix}")).expect("cidr");
            let total = layout(&c, theirs).1;
            let other = span(&c, theirs, pick % total).expect("span");
            let got: HashSet<u64> = blocks_overlapping(&c, mine, &other).into_iter().collect();
            let want: HashSet<u64> = (0..layout(&c, mine).1).filter(|i| span(&c, mine, *i).is_some_and(|s| overlap(&s, &other))).collect();
            proptest::prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn a_block_of_another_range_is_read_as_the_addresses_it_shares_with_ours() {
        let with = |addrs: &str| {
            let mut l = Lease::default();
            l.metadata.annotations = Some([(ADDRESSES_ANNOTATION.to_string(), addrs.to_string())].into());
            l
        };
        let c = ServiceCidr::parse("10.0.0.0/25").expect("cidr");
        // A /24's block across our broadcast address and past it: clipped to ours.
        let s = foreign_span(&c, &with("10.0.0.120-10.0.0.140")).expect("shares addresses");
        assert_eq!((c.ip_at(s.first), c.ip_at(s.end - 1)), (Some("10.0.0.120".parse().expect("ip")), Some("10.0.0.126".parse().expect("ip"))));
        // A /26's block inside ours: whole.
        let s = foreign_span(&c, &with("10.0.0.17-10.0.0.20")).expect("inside");
        assert_eq!((s.first, s.end), (16, 20));
        assert_eq!(foreign_span(&c, &with("10.0.1.1-10.0.1.9")), None, "another range's addresses only");
        assert_eq!(foreign_span(&c, &with("fd00::1-fd00::9")), None);
    }
}
