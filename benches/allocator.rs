//! Allocator core workloads, run side by side with Kubernetes' bitmap allocator by
//! `scripts/bench-allocator.sh` (which reads criterion's estimates from target/criterion):
//!
//! - `allocator/fill_slash12`: allocate_next on a /12 from empty to full, over and over
//!   (ns per allocation, averaged over every fill level);
//! - `allocator/churn_99pct_slash16`: a /16 at 99% fill; release a random held address,
//!   then allocate_next (ns per release+allocate pair);
//! - `allocator/next_slash64_1m`: a /64 holding 1M addresses; allocate_next then release
//!   it (ns per pair). Kubernetes' bitmap cannot hold a /64.

use std::hint::black_box;
use std::time::{Duration, Instant};

use clusterip::alloc::{AllocError, AllocationMap};
use clusterip::cidr::ServiceCidr;
use criterion::{criterion_group, criterion_main, Criterion};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn cidr(s: &str) -> ServiceCidr {
    ServiceCidr::parse(s).expect("bench CIDR")
}

fn fill_slash12(c: &mut Criterion) {
    let range = cidr("10.96.0.0/12");
    let mut rng = SmallRng::seed_from_u64(1);
    let mut map = AllocationMap::new(range.clone());
    c.bench_function("allocator/fill_slash12", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            let mut start = Instant::now();
            for _ in 0..iters {
                match map.allocate_next_with(&mut rng) {
                    Ok(ip) => {
                        black_box(ip);
                    }
                    Err(AllocError::Full) => {
                        spent += start.elapsed();
                        map = AllocationMap::new(range.clone());
                        start = Instant::now();
                        black_box(map.allocate_next_with(&mut rng).ok());
                    }
                    Err(e) => panic!("fill: {e}"),
                }
            }
            spent + start.elapsed()
        })
    });
    // Memory of a full /12, for the report.
    let mut full = AllocationMap::new(range.clone());
    while full.allocate_next_with(&mut rng).is_ok() {}
    eprintln!("INFO full_slash12_heap_bytes={} kubernetes_bitmap_bytes={}", full.heap_bytes(), range.size().div_ceil(8));
}

fn churn_99pct_slash16(c: &mut Criterion) {
    let range = cidr("10.97.0.0/16");
    let mut rng = SmallRng::seed_from_u64(2);
    let mut map = AllocationMap::new(range.clone());
    let target = range.size() * 99 / 100;
    let mut held = Vec::with_capacity(target as usize);
    while (held.len() as u64) < target {
        held.push(map.allocate_next_with(&mut rng).expect("room"));
    }
    c.bench_function("allocator/churn_99pct_slash16", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let k = rng.gen_range(0..held.len());
                map.release(held[k]);
                held[k] = map.allocate_next_with(&mut rng).expect("room after a release");
            }
            start.elapsed()
        })
    });
}

fn next_slash64_1m(c: &mut Criterion) {
    let range = cidr("fd00:1:2:3::/64");
    let mut rng = SmallRng::seed_from_u64(3);
    let mut map = AllocationMap::new(range);
    for _ in 0..1_000_000 {
        map.allocate_next_with(&mut rng).expect("room");
    }
    eprintln!("INFO slash64_1m_heap_bytes={}", map.heap_bytes());
    c.bench_function("allocator/next_slash64_1m", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let ip = map.allocate_next_with(&mut rng).expect("room");
                map.release(ip);
            }
            start.elapsed()
        })
    });
}

criterion_group! {
    name = allocator;
    config = Criterion::default().measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    targets = fill_slash12, churn_99pct_slash16, next_slash64_1m
}
criterion_main!(allocator);
