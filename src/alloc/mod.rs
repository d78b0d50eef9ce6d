//! The allocation map of one service CIDR: pure, no I/O, no Kubernetes types.
//!
//! It follows Kubernetes' ipallocator `Interface` (Allocate, AllocateNext, Release, ForEach,
//! Has, CIDR) with the static/dynamic band rules of KEP-3070:
//!
//! - [`AllocationMap::allocate`] reserves a requested address (static allocation) anywhere in
//!   the range; errors are Kubernetes' texts ("the provided IP (X) is not in the valid
//!   range. The range of valid IPs is …", "provided IP is already allocated").
//! - [`AllocationMap::allocate_next`] picks a random start in the dynamic band and takes the
//!   first free address at or after it, wrapping; only when the dynamic band is full does it
//!   do the same in the static band; "range is full" when both are.
//! - [`AllocationMap::release`] frees an address; a free or out-of-range address is a no-op.
//!
//! Storage is [`offsets::OffsetSet`], a roaring-style layered bitmap that finds the next free
//! offset in O(log n) at any fill level. [`snapshot`] writes it as layered portable roaring
//! bitmaps under a versioned header, and reads and writes Kubernetes' RangeAllocation `data`.

pub mod offsets;
pub mod snapshot;

use std::net::IpAddr;

use rand::Rng;

use crate::cidr::ServiceCidr;
use offsets::OffsetSet;

/// Why an allocation was refused. Texts are Kubernetes' own.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("the provided IP ({ip}) is not in the valid range. The range of valid IPs is {valid_range}")]
    NotInRange { ip: IpAddr, valid_range: String },
    /// An address in none of the configured ranges, as Kubernetes' multi-range allocator
    /// (one per ServiceCIDR) says it; its single-range and dry-run paths say `NotInRange`.
    #[error("the provided network does not match the current range")]
    MismatchedNetwork,
    #[error("provided IP is already allocated")]
    Allocated,
    #[error("range is full")]
    Full,
    /// A snapshot or a RangeAllocation could not be read: what was wrong.
    #[error("{0}")]
    Snapshot(String),
}

/// Allocated addresses of one service CIDR.
#[derive(Clone, Debug)]
pub struct AllocationMap {
    cidr: ServiceCidr,
    set: OffsetSet,
    /// Allocated offsets inside the static band (offset < band_offset).
    static_used: u64,
}

impl AllocationMap {
    /// An empty map over the usable addresses of `cidr`.
    pub fn new(cidr: ServiceCidr) -> Self {
        let set = OffsetSet::new(cidr.size());
        Self { cidr, set, static_used: 0 }
    }

    pub fn cidr(&self) -> &ServiceCidr {
        &self.cidr
    }

    fn not_in_range(&self, ip: IpAddr) -> AllocError {
        AllocError::NotInRange { ip, valid_range: self.cidr.to_string() }
    }

    fn offset(&self, ip: IpAddr) -> Result<u64, AllocError> {
        self.cidr.offset_of(ip).ok_or_else(|| self.not_in_range(ip))
    }

    /// Reserves a requested address (static allocation).
    pub fn allocate(&mut self, ip: IpAddr) -> Result<(), AllocError> {
        let off = self.offset(ip)?;
        self.allocate_offset(off)
    }

    /// Reserves an offset (see [`ServiceCidr::offset_of`]).
    pub fn allocate_offset(&mut self, off: u64) -> Result<(), AllocError> {
        if off >= self.cidr.size() {
            return Err(AllocError::Snapshot(format!("offset {off} is outside {} (size {})", self.cidr, self.cidr.size())));
        }
        if !self.set.insert(off) {
            return Err(AllocError::Allocated);
        }
        if off < self.cidr.band_offset() {
            self.static_used += 1;
        }
        Ok(())
    }

    /// Dry-run of [`allocate`](Self::allocate): the same checks, nothing reserved.
    pub fn check(&self, ip: IpAddr) -> Result<(), AllocError> {
        let off = self.offset(ip)?;
        if self.set.contains(off) {
            return Err(AllocError::Allocated);
        }
        Ok(())
    }

    /// Reserves the next address (dynamic allocation), with the thread's random generator.
    pub fn allocate_next(&mut self) -> Result<IpAddr, AllocError> {
        self.allocate_next_with(&mut rand::thread_rng())
    }

    /// [`allocate_next`](Self::allocate_next) with a caller's random generator.
    pub fn allocate_next_with<R: Rng + ?Sized>(&mut self, rng: &mut R) -> Result<IpAddr, AllocError> {
        let off = self.pick_next(rng)?;
        self.allocate_offset(off)?;
        self.cidr.ip_at(off).ok_or(AllocError::Full)
    }

    /// Dry-run of [`allocate_next`](Self::allocate_next): the address it would hand out now
    /// (a random choice, so a later call may pick another), nothing reserved.
    pub fn peek_next(&self) -> Result<IpAddr, AllocError> {
        let off = self.pick_next(&mut rand::thread_rng())?;
        self.cidr.ip_at(off).ok_or(AllocError::Full)
    }

    fn pick_next<R: Rng + ?Sized>(&self, rng: &mut R) -> Result<u64, AllocError> {
        let size = self.cidr.size();
        let band = self.cidr.band_offset();
        let dynamic_size = size - band;
        let dynamic_used = self.set.len() - self.static_used;
        if dynamic_used < dynamic_size {
            return self.scan_from(rng.gen_range(band..size), band, size);
        }
        if self.static_used < band {
            return self.scan_from(rng.gen_range(0..band), 0, band);
        }
        Err(AllocError::Full)
    }

    /// First free offset at or after `start` in `[lo, hi)`, wrapping to `lo`.
    fn scan_from(&self, start: u64, lo: u64, hi: u64) -> Result<u64, AllocError> {
        self.set
            .next_absent(start, hi)
            .or_else(|| self.set.next_absent(lo, start))
            .ok_or(AllocError::Full)
    }

    /// Frees an address; true when it was allocated. Free or out-of-range: a no-op.
    pub fn release(&mut self, ip: IpAddr) -> bool {
        match self.cidr.offset_of(ip) {
            Some(off) => self.release_offset(off),
            None => false,
        }
    }

    /// Frees an offset; true when it was allocated.
    pub fn release_offset(&mut self, off: u64) -> bool {
        let removed = self.set.remove(off);
        if removed && off < self.cidr.band_offset() {
            self.static_used -= 1;
        }
        removed
    }

    pub fn has(&self, ip: IpAddr) -> bool {
        self.cidr.offset_of(ip).is_some_and(|off| self.set.contains(off))
    }

    /// Allocated addresses.
    pub fn used(&self) -> u64 {
        self.set.len()
    }

    /// Free addresses.
    pub fn free(&self) -> u64 {
        self.cidr.size() - self.set.len()
    }

    /// Allocated addresses in the static band.
    pub fn static_used(&self) -> u64 {
        self.static_used
    }

    /// Allocated addresses, ascending.
    pub fn iter(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.set.iter().filter_map(|off| self.cidr.ip_at(off))
    }

    /// Allocated offsets, ascending.
    pub fn offsets(&self) -> impl Iterator<Item = u64> + '_ {
        self.set.iter()
    }

    /// Heap bytes the map holds (an estimate).
    pub fn heap_bytes(&self) -> usize {
        self.set.heap_bytes()
    }

    /// The versioned snapshot (see docs/allocator.md and [`snapshot`]).
    pub fn snapshot(&self) -> Vec<u8> {
        snapshot::encode(self)
    }

    /// A map from a snapshot of the same range.
    pub fn restore(cidr: &ServiceCidr, bytes: &[u8]) -> Result<Self, AllocError> {
        snapshot::decode(cidr, bytes)
    }

    /// A map from a snapshot of whatever range its header names.
    pub fn restore_stored(bytes: &[u8]) -> Result<Self, AllocError> {
        snapshot::decode(&snapshot::stored_cidr(bytes)?, bytes)
    }

    /// A map from Kubernetes' RangeAllocation `data` (big-endian big integer, bit i = offset i).
    pub fn from_range_allocation(cidr: &ServiceCidr, data: &[u8]) -> Result<Self, AllocError> {
        snapshot::from_range_allocation(cidr, data)
    }

    /// Kubernetes' RangeAllocation `data` for this map.
    pub fn to_range_allocation(&self) -> Result<Vec<u8>, AllocError> {
        snapshot::to_range_allocation(self)
    }

    /// Rebuilds from ascending, distinct, in-range offsets (the snapshot readers).
    fn from_offsets(cidr: &ServiceCidr, offsets: impl IntoIterator<Item = u64>) -> Result<Self, AllocError> {
        let band = cidr.band_offset();
        let mut static_used = 0;
        let counted = offsets.into_iter().inspect(|&off| {
            if off < band {
                static_used += 1;
            }
        });
        let set = OffsetSet::from_sorted(cidr.size(), counted).map_err(|e| AllocError::Snapshot(format!("{cidr}: {e}")))?;
        Ok(Self { cidr: cidr.clone(), set, static_used })
    }
}

#[cfg(test)]
mod tests;
