//! A set of allocated offsets in `[0, size)`, laid out like a roaring bitmap (the space cut
//! into 2^16-offset chunks, each an array, a bitmap or "full") with two additions that make
//! "the next free offset at or after x" cost O(log n) at any fill level:
//!
//! - a chunk whose every offset (inside the range) is allocated is stored as `Full`, taking
//!   no memory and skipped in one step — a full /12 is 16 map entries;
//! - a bitmap chunk keeps a 1024-bit summary of its full words, so the first zero bit after
//!   a position is found with at most 16 + 2 word operations, never a walk over addresses;
//! - an array chunk finds the end of a run of consecutive offsets by binary search
//!   (`value − index` is constant along a run).
//!
//! Offsets reach 2^64 − 2 (an IPv6 /64); chunk keys are `offset >> 16`.

use std::collections::BTreeMap;

const CHUNK_BITS: u32 = 16;
const CHUNK: u64 = 1 << CHUNK_BITS;
const WORDS: usize = (CHUNK / 64) as usize;
const SUMMARY: usize = WORDS / 64;
/// Most offsets an array chunk holds before it becomes a bitmap (as in roaring).
const ARRAY_MAX: usize = 4096;
/// A bitmap chunk shrinking to this many offsets becomes an array again (hysteresis).
const ARRAY_BACK: usize = ARRAY_MAX / 2;

#[derive(Clone, Debug)]
enum Chunk {
    /// Sorted, distinct low 16 bits; at most ARRAY_MAX.
    Array(Vec<u16>),
    Bitmap(Box<Dense>),
    /// Every offset of the chunk that lies inside the range is allocated.
    Full,
}

#[derive(Clone, Debug)]
struct Dense {
    words: [u64; WORDS],
    /// Bit w set ⇔ words[w] == u64::MAX.
    full: [u64; SUMMARY],
    len: u32,
}

impl Dense {
    fn empty() -> Box<Self> {
        Box::new(Dense { words: [0; WORDS], full: [0; SUMMARY], len: 0 })
    }

    /// Offsets 0..n set (n ≤ CHUNK).
    fn first_n(n: u64) -> Box<Self> {
        let mut d = Dense::empty();
        let whole = (n / 64) as usize;
        d.words[..whole].fill(u64::MAX);
        if !n.is_multiple_of(64) {
            d.words[whole] = (1u64 << (n % 64)) - 1;
        }
        for w in 0..whole {
            d.full[w / 64] |= 1u64 << (w % 64);
        }
        d.len = n as u32;
        d
    }

    fn contains(&self, low: u16) -> bool {
        self.words[usize::from(low) / 64] & (1u64 << (low % 64)) != 0
    }

    fn insert(&mut self, low: u16) -> bool {
        let w = usize::from(low) / 64;
        let bit = 1u64 << (low % 64);
        if self.words[w] & bit != 0 {
            return false;
        }
        self.words[w] |= bit;
        if self.words[w] == u64::MAX {
            self.full[w / 64] |= 1u64 << (w % 64);
        }
        self.len += 1;
        true
    }

    fn remove(&mut self, low: u16) -> bool {
        let w = usize::from(low) / 64;
        let bit = 1u64 << (low % 64);
        if self.words[w] & bit == 0 {
            return false;
        }
        self.words[w] &= !bit;
        self.full[w / 64] &= !(1u64 << (w % 64));
        self.len -= 1;
        true
    }

    /// First clear bit ≥ from, if any (not bounded by the range; the caller checks).
    fn next_clear(&self, from: u32) -> Option<u32> {
        let w = (from / 64) as usize;
        let first = !self.words[w] & (u64::MAX << (from % 64));
        if first != 0 {
            return Some(w as u32 * 64 + first.trailing_zeros());
        }
        // The next word that is not full, from the summary.
        let next = w + 1;
        if next >= WORDS {
            return None;
        }
        let mut s = next / 64;
        let mut not_full = !self.full[s] & (u64::MAX << (next % 64));
        loop {
            if not_full != 0 {
                let word = s * 64 + not_full.trailing_zeros() as usize;
                return Some(word as u32 * 64 + (!self.words[word]).trailing_zeros());
            }
            s += 1;
            if s >= SUMMARY {
                return None;
            }
            not_full = !self.full[s];
        }
    }

    fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.words.iter().enumerate().flat_map(|(w, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                Some((w as u32 * 64 + b) as u16)
            })
        })
    }
}

/// The allocated offsets of one range.
#[derive(Clone, Debug)]
pub struct OffsetSet {
    size: u64,
    chunks: BTreeMap<u64, Chunk>,
    len: u64,
}

impl OffsetSet {
    /// An empty set over `[0, size)`.
    pub fn new(size: u64) -> Self {
        Self { size, chunks: BTreeMap::new(), len: 0 }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offsets of chunk `key` that lie inside the range.
    fn capacity(&self, key: u64) -> u64 {
        (self.size - key * CHUNK).min(CHUNK)
    }

    pub fn contains(&self, offset: u64) -> bool {
        let low = (offset & (CHUNK - 1)) as u16;
        match self.chunks.get(&(offset >> CHUNK_BITS)) {
            None => false,
            Some(Chunk::Full) => offset < self.size,
            Some(Chunk::Array(a)) => a.binary_search(&low).is_ok(),
            Some(Chunk::Bitmap(d)) => d.contains(low),
        }
    }

    /// Adds an offset; false when it was present (or outside the range).
    pub fn insert(&mut self, offset: u64) -> bool {
        if offset >= self.size {
            return false;
        }
        let key = offset >> CHUNK_BITS;
        let cap = self.capacity(key);
        let low = (offset & (CHUNK - 1)) as u16;
        let chunk = self.chunks.entry(key).or_insert_with(|| Chunk::Array(Vec::new()));
        let (added, len) = match chunk {
            Chunk::Full => (false, cap),
            Chunk::Array(a) => match a.binary_search(&low) {
                Ok(_) => (false, a.len() as u64),
                Err(pos) => {
                    a.insert(pos, low);
                    (true, a.len() as u64)
                }
            },
            Chunk::Bitmap(d) => (d.insert(low), u64::from(d.len)),
        };
        if !added {
            return false;
        }
        self.len += 1;
        if len == cap {
            *chunk = Chunk::Full;
        } else if let Chunk::Array(a) = chunk {
            if a.len() > ARRAY_MAX {
                let mut d = Dense::empty();
                for &v in a.iter() {
                    d.insert(v);
                }
                *chunk = Chunk::Bitmap(d);
            }
        }
        true
    }

    /// Removes an offset; false when it was absent.
    pub fn remove(&mut self, offset: u64) -> bool {
        if offset >= self.size {
            return false;
        }
        let key = offset >> CHUNK_BITS;
        let cap = self.capacity(key);
        let low = (offset & (CHUNK - 1)) as u16;
        let Some(chunk) = self.chunks.get_mut(&key) else {
            return false;
        };
        let removed = match chunk {
            Chunk::Full => {
                // Expand to the cheaper of the two layouts holding cap − 1 offsets.
                *chunk = if cap - 1 <= ARRAY_MAX as u64 {
                    Chunk::Array((0..cap).map(|v| v as u16).filter(|&v| v != low).collect())
                } else {
                    let mut d = Dense::first_n(cap);
                    d.remove(low);
                    Chunk::Bitmap(d)
                };
                true
            }
            Chunk::Array(a) => match a.binary_search(&low) {
                Ok(pos) => {
                    a.remove(pos);
                    true
                }
                Err(_) => false,
            },
            Chunk::Bitmap(d) => {
                let removed = d.remove(low);
                if removed && (d.len as usize) <= ARRAY_BACK {
                    let a: Vec<u16> = d.iter().collect();
                    *chunk = Chunk::Array(a);
                }
                removed
            }
        };
        if !removed {
            return false;
        }
        self.len -= 1;
        if matches!(chunk, Chunk::Array(a) if a.is_empty()) {
            self.chunks.remove(&key);
        }
        true
    }

    /// The smallest absent offset in `[from, to)` (with `to` clamped to the range size).
    pub fn next_absent(&self, from: u64, to: u64) -> Option<u64> {
        let to = to.min(self.size);
        let mut x = from;
        while x < to {
            let key = x >> CHUNK_BITS;
            let base = key * CHUNK;
            // The first chunk at or after `key` that exists: a gap before it is free.
            let (&k, chunk) = match self.chunks.range(key..).next() {
                None => return Some(x),
                Some(kc) => kc,
            };
            if k != key {
                return Some(x);
            }
            let low = (x - base) as u32;
            let end = (to - base).min(CHUNK) as u32; // exclusive, within the chunk
            let found = match chunk {
                Chunk::Full => None,
                Chunk::Array(a) => next_absent_in_array(a, low),
                Chunk::Bitmap(d) => d.next_clear(low),
            };
            match found {
                Some(l) if l < end => return Some(base + u64::from(l)),
                _ => {}
            }
            match base.checked_add(CHUNK) {
                Some(next) => x = next,
                None => return None,
            }
        }
        None
    }

    /// Every offset, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.chunks.iter().flat_map(move |(&key, chunk)| {
            let base = key * CHUNK;
            let cap = self.capacity(key);
            let it: Box<dyn Iterator<Item = u64> + '_> = match chunk {
                Chunk::Full => Box::new((0..cap).map(move |l| base + l)),
                Chunk::Array(a) => Box::new(a.iter().map(move |&l| base + u64::from(l))),
                Chunk::Bitmap(d) => Box::new(d.iter().map(move |l| base + u64::from(l))),
            };
            it
        })
    }

    /// Heap bytes held (an estimate of the chunk payloads and map entries).
    pub fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<u64>() + std::mem::size_of::<Chunk>();
        self.chunks
            .values()
            .map(|c| {
                entry
                    + match c {
                        Chunk::Full => 0,
                        Chunk::Array(a) => a.capacity() * 2,
                        Chunk::Bitmap(_) => std::mem::size_of::<Dense>(),
                    }
            })
            .sum()
    }
}

impl OffsetSet {
    /// The set as layered roaring bitmaps: one `RoaringBitmap` of the low 32 bits per
    /// distinct `offset >> 32`, ascending. Full and bitmap chunks are copied whole.
    pub fn to_roaring_layers(&self) -> Vec<(u32, roaring::RoaringBitmap)> {
        let mut layers: Vec<(u32, roaring::RoaringBitmap)> = Vec::new();
        for (&key, chunk) in &self.chunks {
            let base = key * CHUNK;
            let hi = (base >> 32) as u32;
            let low_base = (base & 0xffff_ffff) as u32;
            if layers.last().map(|(h, _)| *h) != Some(hi) {
                layers.push((hi, roaring::RoaringBitmap::new()));
            }
            let Some((_, layer)) = layers.last_mut() else { continue };
            match chunk {
                Chunk::Full => {
                    let cap = self.capacity(key) as u32;
                    layer.insert_range(low_base..=low_base + (cap - 1));
                }
                Chunk::Array(a) => {
                    for &l in a {
                        layer.insert(low_base + u32::from(l));
                    }
                }
                Chunk::Bitmap(d) => {
                    let bytes: Vec<u8> = d.words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    *layer |= roaring::RoaringBitmap::from_lsb0_bytes(low_base, &bytes);
                }
            }
        }
        layers
    }

    /// Builds a set from ascending, distinct offsets; an offset out of order, repeated or
    /// outside `[0, size)` is an error naming it.
    pub fn from_sorted(size: u64, offsets: impl IntoIterator<Item = u64>) -> Result<Self, String> {
        let mut set = OffsetSet::new(size);
        let mut prev: Option<u64> = None;
        let mut pending: Vec<u16> = Vec::new();
        let mut pending_key: Option<u64> = None;
        for off in offsets {
            if off >= size {
                return Err(format!("offset {off} is outside the range (size {size})"));
            }
            if prev.is_some_and(|p| off <= p) {
                return Err(format!("offset {off} is repeated or out of order"));
            }
            prev = Some(off);
            let key = off >> CHUNK_BITS;
            if pending_key != Some(key) {
                if let Some(k) = pending_key {
                    set.put_chunk(k, std::mem::take(&mut pending));
                }
                pending_key = Some(key);
            }
            pending.push((off & (CHUNK - 1)) as u16);
        }
        if let Some(k) = pending_key {
            set.put_chunk(k, pending);
        }
        Ok(set)
    }

    fn put_chunk(&mut self, key: u64, lows: Vec<u16>) {
        let n = lows.len() as u64;
        let chunk = if n == self.capacity(key) {
            Chunk::Full
        } else if lows.len() > ARRAY_MAX {
            let mut d = Dense::empty();
            for v in lows {
                d.insert(v);
            }
            Chunk::Bitmap(d)
        } else {
            Chunk::Array(lows)
        };
        self.len += n;
        self.chunks.insert(key, chunk);
    }
}

/// First value ≥ low absent from a sorted array, or None when the answer is ≥ 2^16.
fn next_absent_in_array(a: &[u16], low: u32) -> Option<u32> {
    let i = a.partition_point(|&v| u32::from(v) < low);
    if i == a.len() || u32::from(a[i]) != low {
        return Some(low);
    }
    // a[i] == low. Along a run of consecutive values a[j] − j is constant (= low − i); it
    // grows after the run ends, so the run's end is a binary search away.
    let key = i64::from(low) - i as i64;
    let mut lo = i; // a[lo] − lo == key
    let mut hi = a.len(); // exclusive upper bound of indexes to check
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if i64::from(a[mid]) - mid as i64 == key {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let next = u32::from(a[lo]) + 1;
    (next < CHUNK as u32).then_some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_run_end_found_by_binary_search() {
        let a: Vec<u16> = vec![1, 2, 3, 4, 8, 9, 20];
        assert_eq!(next_absent_in_array(&a, 0), Some(0));
        assert_eq!(next_absent_in_array(&a, 1), Some(5));
        assert_eq!(next_absent_in_array(&a, 3), Some(5));
        assert_eq!(next_absent_in_array(&a, 8), Some(10));
        assert_eq!(next_absent_in_array(&a, 20), Some(21));
        assert_eq!(next_absent_in_array(&a, 21), Some(21));
        let top: Vec<u16> = vec![65534, 65535];
        assert_eq!(next_absent_in_array(&top, 65534), None);
    }

    #[test]
    fn chunks_change_layout_and_back() {
        let size = 3 * CHUNK + 100;
        let mut s = OffsetSet::new(size);
        for o in 0..CHUNK {
            assert!(s.insert(o));
        }
        assert!(matches!(s.chunks.get(&0), Some(Chunk::Full)));
        assert_eq!(s.heap_bytes(), std::mem::size_of::<u64>() + std::mem::size_of::<Chunk>());
        assert!(s.remove(77));
        assert!(matches!(s.chunks.get(&0), Some(Chunk::Bitmap(_))));
        assert_eq!(s.next_absent(0, size), Some(77));
        assert!(!s.contains(77) && s.contains(78));
        for o in 0..CHUNK {
            s.remove(o);
        }
        assert!(s.is_empty());
        assert!(s.chunks.is_empty());
        // The last, partial chunk is full at 100 offsets.
        for o in 3 * CHUNK..size {
            assert!(s.insert(o));
        }
        assert!(matches!(s.chunks.get(&3), Some(Chunk::Full)));
        assert_eq!(s.next_absent(3 * CHUNK, size), None);
        assert!(!s.insert(size), "outside the range");
        assert_eq!(s.iter().count() as u64, 100);
    }

    #[test]
    fn next_absent_skips_full_chunks_and_bitmap_words() {
        let size = 4 * CHUNK;
        let mut s = OffsetSet::new(size);
        for o in 0..(2 * CHUNK + 5000) {
            s.insert(o);
        }
        assert_eq!(s.next_absent(0, size), Some(2 * CHUNK + 5000));
        assert_eq!(s.next_absent(10, 2 * CHUNK), None);
        s.remove(CHUNK + 4321);
        assert_eq!(s.next_absent(0, size), Some(CHUNK + 4321));
        assert_eq!(s.next_absent(CHUNK + 4322, size), Some(2 * CHUNK + 5000));
    }

    #[test]
    fn huge_sparse_range() {
        let mut s = OffsetSet::new(u64::MAX);
        assert!(s.insert(u64::MAX - 1));
        assert!(!s.insert(u64::MAX));
        assert_eq!(s.next_absent(u64::MAX - 1, u64::MAX), None);
        assert_eq!(s.next_absent(u64::MAX - 2, u64::MAX), Some(u64::MAX - 2));
        assert!(s.contains(u64::MAX - 1));
    }
}
