//! Edge cases of the allocation map, after Kubernetes' own allocator tests.

use std::collections::HashSet;
use std::net::IpAddr;

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::*;

fn cidr(s: &str) -> ServiceCidr {
    ServiceCidr::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}
fn ip(s: &str) -> IpAddr {
    s.parse().expect("test ip")
}

/// Fills a range with allocate_next and checks every address is unique, usable, and that
/// the dynamic band was exhausted before the first static-band address was handed out.
fn fill(c: &str) -> AllocationMap {
    let c = cidr(c);
    let mut m = AllocationMap::new(c.clone());
    let mut rng = StdRng::seed_from_u64(7);
    let mut seen = HashSet::new();
    let band = c.band_offset();
    for i in 0..c.size() {
        let got = m.allocate_next_with(&mut rng).unwrap_or_else(|e| panic!("{c}: allocation {i}: {e}"));
        assert!(seen.insert(got), "{c}: {got} handed out twice");
        let off = c.offset_of(got).expect("usable");
        if i < c.size() - band {
            assert!(off >= band, "{c}: static {got} handed out while the dynamic band had room (i={i})");
        } else {
            assert!(off < band, "{c}: {got} should come from the static band");
        }
    }
    assert_eq!(m.allocate_next_with(&mut rng), Err(AllocError::Full), "{c}");
    assert_eq!((m.used(), m.free()), (c.size(), 0), "{c}");
    m
}

#[test]
fn fill_every_small_and_mid_size_range() {
    for c in ["198.18.0.0/30", "198.18.0.0/28", "198.18.0.0/27", "198.18.0.0/24", "198.18.0.0/22", "fd00::/127", "fd00::/124", "fd00::/122", "fd00::/120", "fd00::/118", "fd00::/112"] {
        fill(c);
    }
}

#[test]
fn fill_a_slash_12_and_a_slash_108_stays_small() {
    let m = fill("10.96.0.0/12");
    assert!(m.heap_bytes() < 4096, "a full /12 holds {} bytes", m.heap_bytes());
    let m = fill("fd00::/108");
    assert!(m.heap_bytes() < 4096, "a full /108 holds {} bytes", m.heap_bytes());
}

#[test]
fn slash_8_and_slash_64_allocate_and_release() {
    for c in ["10.0.0.0/8", "fd00:1:2:3::/64"] {
        let c = cidr(c);
        let mut m = AllocationMap::new(c.clone());
        let first = c.usable().expect("usable").first;
        let last = c.usable().expect("usable").last;
        m.allocate(first).expect("first");
        m.allocate(last).expect("last");
        assert_eq!(m.allocate(last), Err(AllocError::Allocated));
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..1000 {
            let got = m.allocate_next_with(&mut rng).expect("room");
            assert!(c.offset_of(got).expect("usable") >= c.band_offset());
        }
        assert_eq!(m.used(), 1002);
        assert!(m.release(last));
        assert!(!m.has(last));
        assert_eq!(m.used(), 1001);
    }
}

#[test]
fn kubernetes_slash_24_scenario() {
    // Kubernetes' TestAllocate on 192.168.1.0/24, with our test addresses.
    let c = cidr("198.18.1.0/24");
    let mut m = AllocationMap::new(c.clone());
    assert_eq!(m.free(), 254);
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..254 {
        m.allocate_next_with(&mut rng).expect("room");
    }
    assert_eq!(m.allocate_next_with(&mut rng), Err(AllocError::Full));
    assert!(m.release(ip("198.18.1.5")));
    assert_eq!(m.free(), 1);
    assert_eq!(m.allocate_next_with(&mut rng), Ok(ip("198.18.1.5")), "the released address comes back");
    for out in ["198.18.0.1", "198.18.1.0", "198.18.1.255", "198.18.2.2", "fd00::1"] {
        let e = m.allocate(ip(out)).expect_err(out);
        assert_eq!(
            e.to_string(),
            format!("the provided IP ({out}) is not in the valid range. The range of valid IPs is 198.18.1.0/24")
        );
    }
    assert_eq!(m.allocate(ip("198.18.1.1")).map_err(|e| e.to_string()), Err("provided IP is already allocated".into()));
}

#[test]
fn slash_25_dynamic_fill_leaves_the_static_band() {
    // Kubernetes' TestAllocateReserved.
    let c = cidr("198.18.1.0/25");
    let mut m = AllocationMap::new(c.clone());
    let mut rng = StdRng::seed_from_u64(9);
    for _ in 0..(126 - 16) {
        let got = m.allocate_next_with(&mut rng).expect("room");
        let last_octet = match got {
            IpAddr::V4(v4) => v4.octets()[3],
            IpAddr::V6(_) => unreachable!(),
        };
        assert!((17..=126).contains(&last_octet), "{got}");
    }
    assert_eq!(m.free(), 16);
    for i in 1..=16 {
        m.allocate(ip(&format!("198.18.1.{i}"))).expect("static band address");
    }
    assert_eq!(m.free(), 0);
    assert!(m.release(ip("198.18.1.10")));
    assert_eq!(m.allocate_next_with(&mut rng), Ok(ip("198.18.1.10")));
    assert_eq!(m.free(), 0);
}

#[test]
fn static_band_used_only_when_dynamic_band_is_full() {
    // Kubernetes' TestPreAllocateReservedFull_BitmapReserved: upper band full, 15 of 16 low
    // addresses taken statically → the last one is handed out, then Full.
    let c = cidr("198.18.1.0/25");
    let mut m = AllocationMap::new(c.clone());
    for off in 16..126 {
        m.allocate_offset(off).expect("upper band");
    }
    for off in 0..15 {
        m.allocate_offset(off).expect("low band");
    }
    assert_eq!(m.free(), 1);
    assert_eq!(m.allocate_next(), Ok(ip("198.18.1.16")));
    assert_eq!(m.allocate_next(), Err(AllocError::Full));
}

#[test]
fn tiny_ranges() {
    for c in ["198.18.0.1/32", "198.18.0.0/31", "fd00::1/128"] {
        let mut m = AllocationMap::new(cidr(c));
        assert_eq!(m.free(), 0, "{c}");
        assert_eq!(m.allocate_next(), Err(AllocError::Full), "{c}");
    }
    let mut m = AllocationMap::new(cidr("198.18.0.0/30"));
    m.allocate(ip("198.18.0.1")).expect("first");
    m.allocate(ip("198.18.0.2")).expect("second");
    assert_eq!(m.allocate(ip("198.18.0.1")), Err(AllocError::Allocated));
    for _ in 0..100 {
        assert_eq!(m.allocate_next(), Err(AllocError::Full));
    }
}

#[test]
fn release_is_a_no_op_for_free_and_out_of_range_addresses() {
    let mut m = AllocationMap::new(cidr("198.18.0.0/24"));
    assert!(!m.release(ip("198.18.0.7")));
    assert!(!m.release(ip("198.18.0.0")));
    assert!(!m.release(ip("198.18.1.7")));
    assert!(!m.release(ip("fd00::7")));
    assert_eq!(m.used(), 0);
}

#[test]
fn dry_runs_reserve_nothing() {
    let mut m = AllocationMap::new(cidr("198.18.0.0/28"));
    m.allocate(ip("198.18.0.3")).expect("allocate");
    assert_eq!(m.check(ip("198.18.0.3")), Err(AllocError::Allocated));
    assert!(matches!(m.check(ip("198.18.0.0")), Err(AllocError::NotInRange { .. })));
    assert_eq!(m.check(ip("198.18.0.4")), Ok(()));
    let peek = m.peek_next().expect("room");
    assert!(!m.has(peek));
    assert_eq!(m.used(), 1);
}

#[test]
fn iteration_is_ascending() {
    let mut m = AllocationMap::new(cidr("198.18.0.0/24"));
    for s in ["198.18.0.200", "198.18.0.5", "198.18.0.1"] {
        m.allocate(ip(s)).expect("allocate");
    }
    let got: Vec<String> = m.iter().map(|i| i.to_string()).collect();
    assert_eq!(got, ["198.18.0.1", "198.18.0.5", "198.18.0.200"]);
}

#[test]
fn snapshot_round_trips_and_refuses_bad_input() {
    for c in ["198.18.0.0/24", "10.96.0.0/12", "fd00::/112", "fd00:1:2:3::/64"] {
        let c = cidr(c);
        let mut m = AllocationMap::new(c.clone());
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..200 {
            m.allocate_next_with(&mut rng).expect("room");
        }
        m.allocate(c.usable().expect("usable").first).expect("first");
        let bytes = m.snapshot();
        let back = AllocationMap::restore(&c, &bytes).expect("restore");
        assert_eq!(back.iter().collect::<Vec<_>>(), m.iter().collect::<Vec<_>>(), "{c}");
        assert_eq!(back.static_used(), m.static_used(), "{c}");

        let other = cidr("198.19.0.0/24");
        let e = AllocationMap::restore(&other, &bytes).expect_err("other range");
        assert!(e.to_string().contains("another range"), "{e}");
        for cut in [0, 3, 10, 30, bytes.len() - 1] {
            assert!(AllocationMap::restore(&c, &bytes[..cut]).is_err(), "{c}: truncated at {cut}");
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(AllocationMap::restore(&c, &trailing).is_err());
        let mut wrong_count = bytes.clone();
        wrong_count[27] ^= 1;
        assert!(AllocationMap::restore(&c, &wrong_count).unwrap_err().to_string().contains("allocated but holds"));
    }
    let c = cidr("198.18.0.0/24");
    assert!(AllocationMap::restore(&c, b"garbage").is_err());
    let full = fill("198.18.0.0/24");
    let back = AllocationMap::restore(&c, &full.snapshot()).expect("full");
    assert_eq!(back.free(), 0);
}

#[test]
fn kubernetes_range_allocation_data() {
    let c = cidr("198.18.0.0/24");
    let mut m = AllocationMap::new(c.clone());
    // Offsets 0, 2 and 9 = 198.18.0.1, .3, .10.
    for s in ["198.18.0.1", "198.18.0.3", "198.18.0.10"] {
        m.allocate(ip(s)).expect("allocate");
    }
    let data = m.to_range_allocation().expect("export");
    assert_eq!(data, vec![0b0000_0010, 0b0000_0101], "big-endian, bit i = offset i");
    let back = AllocationMap::from_range_allocation(&c, &data).expect("import");
    assert_eq!(back.iter().collect::<Vec<_>>(), m.iter().collect::<Vec<_>>());
    assert_eq!(AllocationMap::new(c.clone()).to_range_allocation().expect("empty"), Vec::<u8>::new());
    assert_eq!(AllocationMap::from_range_allocation(&c, &[]).expect("empty").used(), 0);
    // Offset 254 is past the 254 usable addresses (0..=253).
    let mut beyond = vec![0u8; 32];
    beyond[0] = 0b0100_0000;
    let e = AllocationMap::from_range_allocation(&c, &beyond).expect_err("beyond");
    assert!(e.to_string().contains("offset 254"), "{e}");
}

/// The stored size the docs give for an etcd allocation map (docs/operations.md, "The etcd
/// allocation map's size"): random dynamic picks in a /64 cost ~26 bytes each; a full /112
/// and a /108 with as many picks stay small.
#[test]
fn stored_map_sizes_match_the_docs() {
    let size = |c: &str, n: u64| {
        let mut m = AllocationMap::new(cidr(c));
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..n {
            m.allocate_next_with(&mut rng).expect("room");
        }
        m.snapshot().len()
    };
    let (slash64, slash108, slash112) = (size("fd00:1:2:3::/64", 40_000), size("fd00::/108", 40_000), size("fd00::/112", 65_535));
    eprintln!("40k in a /64: {slash64} B; 40k in a /108: {slash108} B; a full /112: {slash112} B");
    assert!((1_000_000..1_100_000).contains(&slash64), "40,000 random picks in a /64: {slash64} B, the docs say about 1 MiB");
    assert!(slash108 < 128 * 1024, "40,000 random picks in a /108: {slash108} B");
    assert!(slash112 < 16 * 1024, "a full /112: {slash112} B");
}
