//! Slots of the shared endpoint maps.
//!
//! Instead of one anonymous `numgen … map { … }` per Service (kube-proxy), a Service port
//! with more than one endpoint owns a contiguous range of integer keys
//! `[base, base + capacity)` in a *shard* map (`endpoint-dnat-<proto>-<shard>`,
//! `endpoint-chains-<shard>`) and picks with `numgen random mod N offset base`.
//!
//! Why shards and not one table-wide map: the kernel validates every new map element against
//! every rule bound to the map, so one map referenced by 10k Service chains makes a cold sync
//! quadratic (measured: 10k Services × 10 endpoints, one map: 15 s in the kernel; 64 ranges
//! per map: 1.7 s; kube-proxy's one anonymous map per Service: 13 s). A shard holds at most
//! [`RANGES_PER_SHARD`] ranges, so a map has at most that many rules bound to it.
//! Ranges are sized in powers of two so that an endpoint count change usually fits in the
//! range already owned.

#![forbid(unsafe_code)]

use std::collections::HashMap;

/// Ranges (so rules bound to one map) per shard.
pub const RANGES_PER_SHARD: u32 = 64;

/// A range of slots owned by one Service port chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotRange {
    pub shard: u32,
    pub base: u32,
    pub capacity: u32,
}

#[derive(Debug, Default, Clone, Copy)]
struct Shard {
    next: u32,
    ranges: u32,
}

/// Hands out slot ranges; freed ranges are reused by size class (keeping their shard).
#[derive(Debug, Default)]
pub struct SlotAllocator {
    shards: Vec<Shard>,
    free: HashMap<u32, Vec<(u32, u32)>>,
}

/// The slot space (32-bit keys) is exhausted; cannot happen below 2^32 endpoints.
#[derive(Debug, thiserror::Error)]
#[error("endpoint slot space exhausted (asked for {0} slots)")]
pub struct SlotsExhausted(pub u32);

impl SlotAllocator {
    /// A range holding at least `n` slots.
    pub fn allocate(&mut self, n: u32) -> Result<SlotRange, SlotsExhausted> {
        let capacity = n.max(2).checked_next_power_of_two().ok_or(SlotsExhausted(n))?;
        if let Some((shard, base)) = self.free.get_mut(&capacity).and_then(Vec::pop) {
            return Ok(SlotRange { shard, base, capacity });
        }
        if self.shards.last().is_none_or(|s| s.ranges >= RANGES_PER_SHARD) {
            self.shards.push(Shard::default());
        }
        let shard = u32::try_from(self.shards.len() - 1).map_err(|_| SlotsExhausted(n))?;
        let s = self.shards.last_mut().ok_or(SlotsExhausted(n))?;
        let base = s.next;
        s.next = s.next.checked_add(capacity).ok_or(SlotsExhausted(n))?;
        s.ranges += 1;
        Ok(SlotRange { shard, base, capacity })
    }

    /// Return a range for reuse.
    pub fn release(&mut self, r: SlotRange) {
        self.free.entry(r.capacity).or_default().push((r.shard, r.base));
    }

    /// Forget everything (the table was rebuilt).
    pub fn reset(&mut self) {
        *self = SlotAllocator::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_do_not_overlap_and_are_reused() {
        let mut a = SlotAllocator::default();
        let r1 = a.allocate(3).expect("slots");
        let r2 = a.allocate(10).expect("slots");
        assert_eq!(r1, SlotRange { shard: 0, base: 0, capacity: 4 });
        assert_eq!(r2, SlotRange { shard: 0, base: 4, capacity: 16 });
        a.release(r1);
        let r3 = a.allocate(4).expect("slots");
        assert_eq!((r3.shard, r3.base), (0, 0), "a freed range of the same class is reused");
        let r4 = a.allocate(2).expect("slots");
        assert_eq!(r4.base, 20);
    }

    #[test]
    fn a_shard_holds_a_bounded_number_of_ranges() {
        let mut a = SlotAllocator::default();
        let ranges: Vec<SlotRange> = (0..RANGES_PER_SHARD * 2 + 1).map(|_| a.allocate(10).expect("slots")).collect();
        assert_eq!(ranges[RANGES_PER_SHARD as usize - 1].shard, 0);
        assert_eq!(ranges[RANGES_PER_SHARD as usize], SlotRange { shard: 1, base: 0, capacity: 16 });
        assert_eq!(ranges.last().map(|r| r.shard), Some(2));
    }
}
