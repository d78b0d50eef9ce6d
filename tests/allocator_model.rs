//! Model-based property test of the allocation map: random operation sequences on random
//! ranges (both families, tiny to /64), checked step by step against a plain `BTreeSet`.
//! Failures are saved to `proptest-regressions/allocator_model.txt` (committed).

use std::collections::BTreeSet;
use std::net::IpAddr;

use clusterip::alloc::{AllocError, AllocationMap};
use clusterip::cidr::ServiceCidr;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

#[derive(Clone, Debug)]
enum Op {
    /// Static allocation of the address at this position (scaled into and around the range).
    Allocate(u64),
    AllocateNext,
    Release(u64),
    /// Snapshot, restore, and continue on the restored map.
    Snapshot,
    /// Export to Kubernetes' RangeAllocation data and import again.
    RangeAllocation,
    /// Static allocation of a run of offsets (up to 70,000: turns chunks into bitmaps and
    /// full chunks), or its release.
    Run { start: u64, len: u32, release: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => any::<u64>().prop_map(Op::Allocate),
        6 => Just(Op::AllocateNext),
        3 => any::<u64>().prop_map(Op::Release),
        1 => Just(Op::Snapshot),
        1 => Just(Op::RangeAllocation),
        1 => (any::<u64>(), 0u32..70_000, any::<bool>()).prop_map(|(start, len, release)| Op::Run { start, len, release }),
    ]
}

fn range() -> impl Strategy<Value = String> {
    prop_oneof![
        (24u8..=32).prop_map(|p| format!("198.18.0.0/{p}")),
        (116u8..=128).prop_map(|p| format!("fd00::/{p}")),
        Just("198.18.0.0/16".to_string()),
        Just("fd00:1:2:3::/64".to_string()),
    ]
}

/// Every IP of the CIDR's span and one past each end, scaled from a random u64; on huge
/// ranges, positions concentrate near the two ends so collisions happen.
fn pick(cidr: &ServiceCidr, x: u64) -> IpAddr {
    let span = cidr.raw_size().min(1 << 20) as u64;
    let pos = x % (span + 2);
    let base: u128 = match cidr.network() {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    };
    // pos 0 = one below the network address (when there is one), then upwards.
    let v = (base + u128::from(pos)).wrapping_sub(1);
    let v = if x & (1 << 63) != 0 && cidr.raw_size() > u128::from(span) { base + cidr.raw_size() - 1 - u128::from(pos % span) } else { v };
    match cidr.network() {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::from(v as u32)),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::from(v)),
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 96,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("proptest-regressions/allocator_model.txt"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn allocation_map_matches_a_reference_set(cidr in range(), ops in prop::collection::vec(op(), 1..300)) {
        let cidr = ServiceCidr::parse(&cidr).expect("generated CIDR");
        let band = cidr.band_offset();
        let size = cidr.size();
        let mut map = AllocationMap::new(cidr.clone());
        let mut model: BTreeSet<u64> = BTreeSet::new();
        for op in ops {
            match op {
                Op::Allocate(x) => {
                    let ip = pick(&cidr, x);
                    let got = map.allocate(ip);
                    match cidr.offset_of(ip) {
                        None => prop_assert!(matches!(got, Err(AllocError::NotInRange { .. })), "{ip}: {got:?}"),
                        Some(off) if model.contains(&off) => prop_assert_eq!(got, Err(AllocError::Allocated)),
                        Some(off) => {
                            prop_assert_eq!(got, Ok(()));
                            model.insert(off);
                        }
                    }
                }
                Op::AllocateNext => {
                    let got = map.allocate_next();
                    let dynamic_free = (size - band) - model.range(band..).count() as u64;
                    if model.len() as u64 == size {
                        prop_assert_eq!(got, Err(AllocError::Full));
                    } else {
                        let ip = got.expect("room left");
                        let off = cidr.offset_of(ip).expect("usable address");
                        prop_assert!(model.insert(off), "{ip} handed out twice");
                        if dynamic_free > 0 {
                            prop_assert!(off >= band, "{ip} from the static band while the dynamic band had {dynamic_free} free");
                        }
                    }
                }
                Op::Release(x) => {
                    let ip = pick(&cidr, x);
                    let was = cidr.offset_of(ip).is_some_and(|off| model.remove(&off));
                    prop_assert_eq!(map.release(ip), was);
                }
                Op::Snapshot => {
                    map = AllocationMap::restore(&cidr, &map.snapshot()).expect("restore own snapshot");
                }
                Op::Run { start, len, release } => {
                    // Runs start near the bottom of the range so they overlap each other.
                    let start = start % size.clamp(1, 1 << 18);
                    for off in (start..start.saturating_add(u64::from(len))).take_while(|&o| o < size) {
                        if release {
                            prop_assert_eq!(map.release_offset(off), model.remove(&off));
                        } else {
                            let fresh = model.insert(off);
                            prop_assert_eq!(map.allocate_offset(off).is_ok(), fresh);
                        }
                    }
                }
                Op::RangeAllocation => {
                    if let Ok(data) = map.to_range_allocation() {
                        map = AllocationMap::from_range_allocation(&cidr, &data).expect("import own export");
                    }
                }
            }
            prop_assert_eq!(map.used(), model.len() as u64);
            prop_assert_eq!(map.free(), size - model.len() as u64);
        }
        let got: Vec<u64> = map.offsets().collect();
        let want: Vec<u64> = model.into_iter().collect();
        prop_assert_eq!(got, want);
    }
}
