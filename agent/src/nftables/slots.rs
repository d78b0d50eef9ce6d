//! Slots of the shared endpoint maps.
//!
//! Instead of one anonymous `numgen … vmap { … }` per Service (what makes kube-proxy's
//! nftables mode super-linear), every Service port with more than one endpoint owns a
//! contiguous range of integer keys `[base, base + capacity)` in two table-wide maps
//! (`endpoint-dnat`, `endpoint-chains`) and picks with `numgen random mod N offset base`.
//! Ranges are sized in powers of two so that an endpoint count change usually fits in
//! the range already owned.

use std::collections::HashMap;

/// A range of slots owned by one Service port chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotRange {
    pub base: u32,
    pub capacity: u32,
}

/// Hands out slot ranges; freed ranges are reused by size class.
#[derive(Debug, Default)]
pub struct SlotAllocator {
    next: u32,
    free: HashMap<u32, Vec<u32>>,
}

/// The slot space (32-bit keys) is exhausted; cannot happen below 2^32 endpoints.
#[derive(Debug, thiserror::Error)]
#[error("endpoint slot space exhausted (asked for {0} slots)")]
pub struct SlotsExhausted(pub u32);

impl SlotAllocator {
    /// A range holding at least `n` slots.
    pub fn allocate(&mut self, n: u32) -> Result<SlotRange, SlotsExhausted> {
        let capacity = n.max(2).checked_next_power_of_two().ok_or(SlotsExhausted(n))?;
        if let Some(base) = self.free.get_mut(&capacity).and_then(Vec::pop) {
            return Ok(SlotRange { base, capacity });
        }
        let base = self.next;
        self.next = self.next.checked_add(capacity).ok_or(SlotsExhausted(n))?;
        Ok(SlotRange { base, capacity })
    }

    /// Return a range for reuse.
    pub fn release(&mut self, r: SlotRange) {
        self.free.entry(r.capacity).or_default().push(r.base);
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
        assert_eq!(r1, SlotRange { base: 0, capacity: 4 });
        assert_eq!(r2, SlotRange { base: 4, capacity: 16 });
        a.release(r1);
        let r3 = a.allocate(4).expect("slots");
        assert_eq!(r3.base, 0, "a freed range of the same class is reused");
        let r4 = a.allocate(2).expect("slots");
        assert_eq!(r4.base, 20);
    }
}
