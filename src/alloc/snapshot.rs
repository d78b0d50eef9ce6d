//! Byte formats of an allocation map.
//!
//! **Snapshot, version 1** (what the etcd backend stores; all integers big-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `CIPM` |
//! | 1 | format version (1) |
//! | 1 | family: 4 or 6 |
//! | 1 | prefix length |
//! | 16 | network address (IPv4 in the last 4 bytes) |
//! | 8 | number of allocated addresses |
//! | 4 | number of layers L |
//! | L × | layer: 4 bytes `offset >> 32`, 4 bytes length N, N bytes of a RoaringBitmap of the low 32 bits in the portable roaring format (readable by any Roaring library) |
//!
//! Offset 0 is the first usable address. A reader refuses another magic, a newer version, a
//! snapshot of another range, a count that does not match, offsets outside the range, and
//! trailing bytes — with an error saying which.
//!
//! **Kubernetes' RangeAllocation `data`**: a big-endian big integer whose bit i is offset i
//! (Go's `big.Int.Bytes()`: minimal length, empty when nothing is allocated).

use std::io::Read;

use super::{AllocError, AllocationMap};
use crate::cidr::ServiceCidr;

pub const MAGIC: &[u8; 4] = b"CIPM";
pub const VERSION: u8 = 1;
/// Largest RangeAllocation `data` we write or read (16 MiB: 2^27 offsets, an IPv4 /5).
pub const MAX_RANGE_ALLOCATION_BYTES: usize = 16 << 20;

fn err(msg: impl Into<String>) -> AllocError {
    AllocError::Snapshot(msg.into())
}

fn network_bytes(cidr: &ServiceCidr) -> [u8; 16] {
    match cidr.network() {
        std::net::IpAddr::V4(v4) => {
            let mut b = [0u8; 16];
            b[12..].copy_from_slice(&v4.octets());
            b
        }
        std::net::IpAddr::V6(v6) => v6.octets(),
    }
}

/// Writes the version-1 snapshot.
pub fn encode(map: &AllocationMap) -> Vec<u8> {
    let cidr = map.cidr();
    let layers = map.set.to_roaring_layers();
    let mut out = Vec::with_capacity(40 + layers.iter().map(|(_, b)| b.serialized_size() + 8).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(cidr.family().version());
    out.push(cidr.prefix_len());
    out.extend_from_slice(&network_bytes(cidr));
    out.extend_from_slice(&map.used().to_be_bytes());
    out.extend_from_slice(&(layers.len() as u32).to_be_bytes());
    for (hi, bitmap) in &layers {
        out.extend_from_slice(&hi.to_be_bytes());
        out.extend_from_slice(&(bitmap.serialized_size() as u32).to_be_bytes());
        // Writing into a Vec cannot fail.
        let _ = bitmap.serialize_into(&mut out);
    }
    out
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], AllocError> {
        if self.rest.len() < n {
            return Err(err(format!("snapshot truncated: {what} needs {n} bytes, {} left", self.rest.len())));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u32(&mut self, what: &str) -> Result<u32, AllocError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, AllocError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
}

/// The range a version-1 snapshot is of, from its header.
pub fn stored_cidr(bytes: &[u8]) -> Result<ServiceCidr, AllocError> {
    let mut r = Reader { rest: bytes };
    if r.take(4, "magic")? != MAGIC {
        return Err(err("not a clusterip allocation snapshot (want magic \"CIPM\")"));
    }
    r.take(1, "version")?;
    let head = r.take(2, "family and prefix")?;
    let (family, prefix) = (head[0], head[1]);
    let n = r.take(16, "network")?;
    let network: std::net::IpAddr = match family {
        4 => std::net::Ipv4Addr::new(n[12], n[13], n[14], n[15]).into(),
        6 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(n);
            std::net::Ipv6Addr::from(o).into()
        }
        f => return Err(err(format!("snapshot of unknown family {f}"))),
    };
    ServiceCidr::parse(&format!("{network}/{prefix}")).map_err(|e| err(format!("snapshot header names no range: {e}")))
}

/// Reads a version-1 snapshot of `cidr`.
pub fn decode(cidr: &ServiceCidr, bytes: &[u8]) -> Result<AllocationMap, AllocError> {
    let mut r = Reader { rest: bytes };
    let magic = r.take(4, "magic")?;
    if magic != MAGIC {
        return Err(err(format!("not a clusterip allocation snapshot (magic {magic:02x?}, want \"CIPM\")")));
    }
    let version = r.take(1, "version")?[0];
    if version != VERSION {
        return Err(err(format!("snapshot format version {version} is not supported (this build reads version {VERSION})")));
    }
    let head = r.take(2, "family and prefix")?;
    let (family, prefix) = (head[0], head[1]);
    let network = r.take(16, "network")?;
    let want_family = cidr.family().version();
    if family != want_family || prefix != cidr.prefix_len() || network != network_bytes(cidr) {
        return Err(err(format!("the snapshot is of another range (family {family}, prefix /{prefix}), not {cidr}")));
    }
    let count = r.u64("count")?;
    let nlayers = r.u32("layer count")?;
    let mut layers = Vec::with_capacity(nlayers.min(1024) as usize);
    let mut prev_hi: Option<u32> = None;
    for i in 0..nlayers {
        let hi = r.u32("layer key")?;
        if prev_hi.is_some_and(|p| hi <= p) {
            return Err(err(format!("snapshot layer {i} (key {hi}) is out of order")));
        }
        prev_hi = Some(hi);
        let len = r.u32("layer length")? as usize;
        let mut body = r.take(len, "layer body")?;
        let bitmap = roaring::RoaringBitmap::deserialize_from(&mut body)
            .map_err(|e| err(format!("snapshot layer {i} is not a valid roaring bitmap: {e}")))?;
        let mut tail = [0u8; 1];
        if body.read(&mut tail).unwrap_or(0) != 0 {
            return Err(err(format!("snapshot layer {i} has bytes after its roaring bitmap")));
        }
        layers.push((hi, bitmap));
    }
    if !r.rest.is_empty() {
        return Err(err(format!("snapshot has {} unexpected trailing bytes", r.rest.len())));
    }
    let offsets = layers.iter().flat_map(|(hi, b)| b.iter().map(move |lo| (u64::from(*hi) << 32) | u64::from(lo)));
    let map = AllocationMap::from_offsets(cidr, offsets)?;
    if map.used() != count {
        return Err(err(format!("snapshot says {count} allocated but holds {}", map.used())));
    }
    Ok(map)
}

/// Reads Kubernetes' RangeAllocation `data` for `cidr`.
pub fn from_range_allocation(cidr: &ServiceCidr, data: &[u8]) -> Result<AllocationMap, AllocError> {
    if data.len() > MAX_RANGE_ALLOCATION_BYTES {
        return Err(err(format!(
            "RangeAllocation data of {} bytes is larger than the {MAX_RANGE_ALLOCATION_BYTES} bytes allowed",
            data.len()
        )));
    }
    let n = data.len();
    // Byte n−1 holds offsets 0..8 (least significant bit first), byte 0 the highest.
    let offsets = (0..n).flat_map(move |k| {
        let byte = data[n - 1 - k];
        (0..8u64).filter(move |b| byte & (1 << b) != 0).map(move |b| k as u64 * 8 + b)
    });
    let size = cidr.size();
    let mut checked = Vec::new();
    for off in offsets {
        if off >= size {
            return Err(err(format!(
                "RangeAllocation data marks offset {off}, beyond the {size} usable addresses of {cidr}"
            )));
        }
        checked.push(off);
    }
    AllocationMap::from_offsets(cidr, checked)
}

/// Writes Kubernetes' RangeAllocation `data` (minimal big-endian big integer).
pub fn to_range_allocation(map: &AllocationMap) -> Result<Vec<u8>, AllocError> {
    let Some(max) = map.offsets().last() else {
        return Ok(Vec::new());
    };
    let n = (max / 8 + 1) as usize;
    if n > MAX_RANGE_ALLOCATION_BYTES {
        return Err(err(format!(
            "{} has an address at offset {max}: Kubernetes' RangeAllocation bitmap would need {n} bytes (at most {MAX_RANGE_ALLOCATION_BYTES})",
            map.cidr()
        )));
    }
    let mut out = vec![0u8; n];
    for off in map.offsets() {
        let k = (off / 8) as usize;
        out[n - 1 - k] |= 1 << (off % 8);
    }
    Ok(out)
}
