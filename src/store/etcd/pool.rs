//! The etcd backend's address pool: addresses a controller replica has already recorded in
//! the allocation map, ahead of need, so a dynamic admission is answered from memory instead
//! of waiting for an etcd transaction.
//!
//! How it stays race-free and visible:
//! - A pooled address is allocated in the map (so no other writer can choose it) and listed
//!   under one of the replica's *pool keys* `<range key>/pool/<member>/<chunk>`, written in
//!   the same transaction that allocated it. A fill is split into keys of at most
//!   [`CHUNK`] addresses, so a hand-out rewrites one small key rather than a list of the
//!   whole pool (each rewrite is a revision etcd keeps until compaction). The keys are
//!   attached to the replica's etcd lease, so a replica that dies takes them with it after
//!   the lease TTL.
//! - Every reader (`has`, `allocated`, `usage`, the repair pass) treats an address listed in
//!   any pool key as *free, held in reserve*: not a record of any object, so not a leak, and a
//!   static request for it is honoured.
//! - A replica hands out pooled addresses only while its lease is known to be alive (renewed
//!   within TTL − margin); once the lease is lost its pool is dropped from memory. The
//!   addresses then become unowned records, which the repair pass releases after its usual
//!   three-pass rule — minutes after the last hand-out could have happened.
//! - A static request for an address in *another* replica's pool is a *claim*: the
//!   requester writes `<range key>/claim/<address>`; the owner, watching, removes the address
//!   from its memory under the pool lock (after which it can never hand it out) and answers
//!   `granted`, or `refused` when it has already handed the address out.
//!
//! This module holds the in-memory side (the pool, the lease, the key formats); the etcd
//! transactions, the lease and the claims live in `pool_lease.rs`, and the committer ([`super`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use crate::sync::lock;

/// Lease TTL of the pool keys.
pub const LEASE_TTL: Duration = Duration::from_secs(30);
/// Pooled addresses are handed out only while the lease has at least this long left.
pub const LEASE_MARGIN: Duration = Duration::from_secs(10);
/// How long a claimant waits for the owner's answer.
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(2);
/// TTL of the lease each claim key hangs on (never renewed): a claim left behind by a
/// claimant that died, or whose delete failed, is gone after this many seconds.
pub const CLAIM_LEASE_TTL_S: i64 = 15;

/// The pool a range keeps for a requested size: at most an eighth of its dynamic band, so
/// a small range is not emptied into replicas' reserves (0 when the band is that small).
pub fn pool_target(requested: usize, cidr: &crate::cidr::ServiceCidr) -> usize {
    let band = cidr.dynamic_band().map_or(0, |b| b.size / 8);
    requested.min(usize::try_from(band).unwrap_or(usize::MAX))
}

/// Addresses one pool key lists at most.
pub const CHUNK: usize = 64;
/// Pool keys one transaction writes for a fill at most (a larger fill records this many
/// keys' worth; the next pop below the low water asks for the rest).
pub const MAX_FILL_KEYS: usize = 16;
/// Pool keys one transaction rewrites at most (the rest are rewritten by the next).
pub const MAX_REWRITES: usize = 32;

/// `<range key>/pool/` — the prefix of every replica's pool keys of one range.
pub fn pool_prefix(range_key: &str) -> String {
    format!("{range_key}/pool/")
}

/// `<range key>/pool/<member>/` — the prefix of one replica's pool keys of one range.
pub fn member_pool_prefix(range_key: &str, member: &str) -> String {
    format!("{}{member}/", pool_prefix(range_key))
}

/// The pool key of one chunk of a replica's pool.
pub fn pool_key(range_key: &str, member: &str, chunk: u32) -> String {
    format!("{}{chunk}", member_pool_prefix(range_key, member))
}

/// The replica a pool key belongs to, from the key's name below [`pool_prefix`]:
/// `<member>/<chunk>`, or `<member>` alone as replicas wrote it before pools were split into
/// chunks (read the same way, so replicas of both versions can run side by side). A claim
/// names the owner either way, and an owner answers both.
pub fn pool_member(name: &str) -> &str {
    name.split('/').next().unwrap_or(name)
}

/// `<range key>/claim/` — the prefix of claims on one range's pooled addresses.
pub fn claim_prefix(range_key: &str) -> String {
    format!("{range_key}/claim/")
}

/// The claim key of an address.
pub fn claim_key(range_key: &str, ip: IpAddr) -> String {
    format!("{}{ip}", claim_prefix(range_key))
}

/// A pool key's value: the pooled addresses, one canonical address per line.
pub fn encode_pool(addrs: impl IntoIterator<Item = IpAddr>) -> Vec<u8> {
    let mut out = String::new();
    for ip in addrs {
        out.push_str(&ip.to_string());
        out.push('\n');
    }
    out.into_bytes()
}

/// Decode a pool key's value; lines that are not addresses are skipped (and reported by the
/// caller as unreadable when nothing parses).
pub fn decode_pool(value: &[u8]) -> BTreeSet<IpAddr> {
    String::from_utf8_lossy(value).lines().filter_map(|l| crate::cidr::parse_ip(l.trim()).ok()).collect()
}

/// A claim on a pooled address, as stored under its claim key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// The pool member that holds the address.
    pub owner: String,
    /// Who asks for it (a member name, or a one-off name for processes without a pool).
    pub claimant: String,
    /// The owner's answer; absent until it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<ClaimAnswer>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimAnswer {
    /// The address left the owner's pool; it is the claimant's now.
    Granted,
    /// The owner no longer pools it (handed out already).
    Refused,
}

/// The lease this replica's pool keys hang on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseState {
    pub id: i64,
    /// Renewed until here (as last confirmed by etcd).
    pub valid_until: Instant,
}

impl LeaseState {
    /// The member name under which this lease's pool keys are written.
    pub fn member(&self) -> String {
        format!("{:016x}", self.id)
    }
}

/// One pool key's new listing; empty: delete the key (every address it listed is gone).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkWrite {
    pub chunk: u32,
    pub addrs: Vec<IpAddr>,
}

/// What one transaction writes to this replica's pool keys of one range.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolPlan {
    /// Keys that list addresses no longer pooled (handed out, taken), with what they should.
    pub rewrites: Vec<ChunkWrite>,
    /// New keys for the addresses the transaction's fills record.
    pub fills: Vec<ChunkWrite>,
    /// More keys list addresses no longer pooled than [`MAX_REWRITES`]: another rewrite is
    /// due once this one is written.
    pub more: bool,
}

impl PoolPlan {
    pub fn is_empty(&self) -> bool {
        self.rewrites.is_empty() && self.fills.is_empty()
    }
}

/// This replica's pool of one range.
#[derive(Debug, Default)]
struct RangePool {
    /// Addresses kept (0 = no pool for this range) and the level that triggers a refill.
    target: usize,
    low_water: usize,
    /// Pooled addresses, each with the chunk whose key lists it.
    free: Vec<(IpAddr, u32)>,
    /// A fill is queued or in flight.
    filling: bool,
    /// Chunk → how many addresses its key lists, as last written. A chunk whose addresses
    /// in `free` are fewer lists addresses handed out since.
    written: BTreeMap<u32, usize>,
    /// A rewrite of the pool keys is queued and not yet planned.
    sync_queued: bool,
    /// The number of the next chunk a fill writes.
    next_chunk: u32,
}

impl RangePool {
    fn clear(&mut self) -> Vec<IpAddr> {
        self.written.clear();
        self.sync_queued = false;
        std::mem::take(&mut self.free).into_iter().map(|(ip, _)| ip).collect()
    }
}

/// This replica's pools (one per range) and its lease. Sizes are per range.
#[derive(Debug)]
pub struct OwnPool {
    lease: Mutex<Option<LeaseState>>,
    ranges: Vec<Mutex<RangePool>>,
    /// Returned for good (shutdown): no lease, no fills, nothing handed out.
    closed: AtomicBool,
}


/// What a pop found.
#[derive(Debug, PartialEq, Eq)]
pub struct Popped {
    pub ip: IpAddr,
    /// A fill of this many addresses should be queued (the pool fell below its low water).
    pub refill: Option<usize>,
    /// No rewrite of the pool keys is queued: queue one.
    pub sync: bool,
}

impl OwnPool {
    /// A pool that keeps `targets[i]` addresses of range `i` (0 = no pool for it), refilled
    /// when it falls below three quarters.
    pub fn new(targets: &[usize]) -> Self {
        let range = |target: usize| RangePool { target, low_water: target - target / 4, ..RangePool::default() };
        Self {
            lease: Mutex::new(None),
            ranges: targets.iter().map(|t| Mutex::new(range(*t))).collect(),
            closed: AtomicBool::new(false),
        }
    }

    /// Whether any range keeps a pool.
    pub fn enabled(&self) -> bool {
        self.ranges.iter().any(|r| lock(r).target > 0)
    }

    /// The addresses each range keeps.
    pub fn targets(&self) -> Vec<usize> {
        self.ranges.iter().map(|r| lock(r).target).collect()
    }

    /// The lease, when it is usable for handing out addresses at `now`.
    pub fn live_lease(&self, now: Instant) -> Option<LeaseState> {
        if self.is_closed() {
            return None;
        }
        lock(&self.lease).filter(|l| now + LEASE_MARGIN < l.valid_until)
    }

    /// Stop for good: nothing is handed out or filled from now on.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// The lease as last known (live or not), for writing keys on it.
    pub fn lease(&self) -> Option<LeaseState> {
        *lock(&self.lease)
    }

    pub fn set_lease(&self, lease: Option<LeaseState>) {
        *lock(&self.lease) = lease;
    }

    /// Forget every pooled address (the lease was lost: they are no longer ours to hand
    /// out). Returns how many were dropped.
    pub fn drop_all(&self) -> usize {
        self.ranges.iter().map(|r| lock(r).clear().len()).sum()
    }

    /// Take an address of range `range`, if the pool holds one and the lease is alive.
    pub fn pop(&self, range: usize, now: Instant) -> Option<Popped> {
        self.live_lease(now)?;
        let mut r = lock(&self.ranges[range]);
        let (ip, _) = r.free.pop()?;
        let sync = !std::mem::replace(&mut r.sync_queued, true);
        Some(Popped { ip, refill: Self::refill_wanted(&mut r), sync })
    }

    /// Take a specific address out of the pool (a static request for it, here or from a
    /// claim). True when it was pooled; from then on it is never handed out.
    pub fn take(&self, range: usize, ip: IpAddr) -> bool {
        let mut r = lock(&self.ranges[range]);
        match r.free.iter().position(|(x, _)| *x == ip) {
            Some(i) => {
                r.free.swap_remove(i);
                r.sync_queued = true;
                true
            }
            None => false,
        }
    }

    /// How many addresses a fill should bring now, marking a fill as started; None when the
    /// pool is off, its lease is not alive, it is full enough, or a fill is on its way.
    pub fn start_fill(&self, range: usize, now: Instant) -> Option<usize> {
        self.live_lease(now)?;
        let mut r = lock(&self.ranges[range]);
        Self::refill_wanted(&mut r)
    }

    fn refill_wanted(r: &mut RangePool) -> Option<usize> {
        if r.target == 0 || r.filling || r.free.len() >= r.low_water.max(1) {
            return None;
        }
        r.filling = true;
        Some(r.target - r.free.len())
    }

    /// A fill ended: add what it recorded (may be empty; its keys as [`Self::plan`] cut
    /// them) under lease `under`. False, adding nothing, when that is not the current lease
    /// (lost meanwhile: the addresses' pool keys went with it). Callers clear the lease
    /// before [`Self::drop_all`], so a fill racing a lost lease is either refused here or
    /// dropped there.
    pub fn fill_done(&self, range: usize, got: &[ChunkWrite], under: Option<i64>) -> bool {
        let current = lock(&self.lease).map(|l| l.id);
        let mut r = lock(&self.ranges[range]);
        r.filling = false;
        if got.iter().all(|c| c.addrs.is_empty()) {
            return true;
        }
        if under.is_none() || under != current {
            return false;
        }
        for c in got {
            r.free.extend(c.addrs.iter().map(|ip| (*ip, c.chunk)));
            r.written.insert(c.chunk, c.addrs.len());
        }
        true
    }

    /// What the next transaction writes to the pool keys of a range: every key that lists
    /// an address no longer pooled, rewritten (or deleted), and `filled` cut into new keys of
    /// at most [`CHUNK`] addresses. A rewrite asked for after this is queued anew. Once the
    /// transaction succeeded, [`Self::written`] records the rewrites and
    /// [`Self::fill_done`] the fills.
    pub fn plan(&self, range: usize, filled: &[IpAddr]) -> PoolPlan {
        let mut r = lock(&self.ranges[range]);
        r.sync_queued = false;
        let mut now: BTreeMap<u32, Vec<IpAddr>> = BTreeMap::new();
        for (ip, c) in &r.free {
            now.entry(*c).or_default().push(*ip);
        }
        let mut rewrites: Vec<ChunkWrite> = r
            .written
            .iter()
            .filter_map(|(c, listed)| {
                let mut addrs = now.remove(c).unwrap_or_default();
                (addrs.len() != *listed).then(|| {
                    addrs.sort();
                    ChunkWrite { chunk: *c, addrs }
                })
            })
            .collect();
        let more = rewrites.len() > MAX_REWRITES;
        rewrites.truncate(MAX_REWRITES);
        let fills = filled
            .chunks(CHUNK)
            .map(|addrs| {
                let chunk = r.next_chunk;
                r.next_chunk = r.next_chunk.wrapping_add(1);
                ChunkWrite { chunk, addrs: addrs.to_vec() }
            })
            .collect();
        PoolPlan { rewrites, fills, more }
    }

    /// The rewrites of `plan` are in etcd now.
    pub fn written(&self, range: usize, plan: &PoolPlan) {
        let mut r = lock(&self.ranges[range]);
        for c in &plan.rewrites {
            if c.addrs.is_empty() {
                r.written.remove(&c.chunk);
            } else {
                r.written.insert(c.chunk, c.addrs.len());
            }
        }
    }

    /// The pooled addresses of a range.
    pub fn listing(&self, range: usize) -> Vec<IpAddr> {
        lock(&self.ranges[range]).free.iter().map(|(ip, _)| *ip).collect()
    }

    pub fn holds(&self, range: usize, ip: IpAddr) -> bool {
        lock(&self.ranges[range]).free.iter().any(|(x, _)| *x == ip)
    }

    pub fn len(&self, range: usize) -> usize {
        lock(&self.ranges[range]).free.len()
    }

    /// Empty the pool of a range (returned on shutdown); the addresses taken out.
    pub fn take_all(&self, range: usize) -> Vec<IpAddr> {
        lock(&self.ranges[range]).clear()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    const LIVE: Option<i64> = Some(0x2a);

    /// A fill of `ips` into range `range` planned and landed under `under`.
    fn filled(pool: &OwnPool, range: usize, ips: &[IpAddr], under: Option<i64>) -> bool {
        let plan = pool.plan(range, ips);
        pool.fill_done(range, &plan.fills, under)
    }

    fn live(pool: &OwnPool) -> Instant {
        let now = Instant::now();
        pool.set_lease(Some(LeaseState { id: 0x2a, valid_until: now + LEASE_TTL }));
        now
    }

    #[test]
    fn pool_values_round_trip_and_skip_garbage() {
        let addrs = [ip("198.18.0.9"), ip("fd00::5")];
        let v = encode_pool(addrs);
        assert_eq!(v, b"198.18.0.9\nfd00::5\n");
        let mut with_garbage = v.clone();
        with_garbage.extend_from_slice(b"not-an-ip\n010.0.0.1\n");
        assert_eq!(decode_pool(&with_garbage), addrs.into_iter().collect());
    }

    #[test]
    fn claims_serialize_without_an_answer_until_answered() {
        let c = Claim { owner: "a".into(), claimant: "b".into(), answer: None };
        assert_eq!(serde_json::to_string(&c).expect("json"), r#"{"owner":"a","claimant":"b"}"#);
        let g = Claim { answer: Some(ClaimAnswer::Granted), ..c };
        assert_eq!(serde_json::to_string(&g).expect("json"), r#"{"owner":"a","claimant":"b","answer":"granted"}"#);
        let back: Claim = serde_json::from_str(r#"{"owner":"a","claimant":"b","answer":"refused"}"#).expect("parse");
        assert_eq!(back.answer, Some(ClaimAnswer::Refused));
    }

    #[test]
    fn nothing_is_handed_out_without_a_live_lease() {
        let pool = OwnPool::new(&[8]);
        assert!(!filled(&pool, 0, &[ip("198.18.0.1")], None), "a fill without a lease is not pooled");
        assert_eq!(pool.pop(0, Instant::now()), None, "no lease yet");
        let now = Instant::now();
        pool.set_lease(Some(LeaseState { id: 1, valid_until: now + LEASE_MARGIN }));
        assert!(filled(&pool, 0, &[ip("198.18.0.1")], Some(1)));
        assert_eq!(pool.pop(0, now), None, "a lease about to run out is not live");
        pool.set_lease(Some(LeaseState { id: 1, valid_until: now + LEASE_TTL }));
        assert_eq!(pool.pop(0, now).map(|p| p.ip), Some(ip("198.18.0.1")));
    }

    #[test]
    fn a_fill_that_lands_after_its_lease_was_lost_is_not_pooled() {
        let pool = OwnPool::new(&[8]);
        let now = live(&pool);
        assert_eq!(pool.start_fill(0, now), Some(8));
        // The fill was written under lease 7, which is gone; 0x2a is the lease now.
        assert!(!filled(&pool, 0, &[ip("198.18.0.1")], Some(7)));
        assert_eq!(pool.len(0), 0);
        assert_eq!(pool.start_fill(0, now), Some(8), "the fill is over: the next one may start");
    }

    #[test]
    fn a_pop_below_low_water_asks_for_one_refill_up_to_the_target() {
        let pool = OwnPool::new(&[8]);
        assert_eq!(pool.start_fill(0, Instant::now()), None, "no fill without a lease");
        let now = live(&pool);
        assert_eq!(pool.start_fill(0, now), Some(8));
        assert_eq!(pool.start_fill(0, now), None, "one fill at a time");
        let got: Vec<IpAddr> = (1..=8).map(|i| ip(&format!("198.18.0.{i}"))).collect();
        assert!(filled(&pool, 0, &got, LIVE));
        // Low water is 6: the first two pops need nothing, the third asks for 3. Only the
        // first pop after a rewrite was planned asks for one.
        assert_eq!(pool.pop(0, now).map(|p| (p.refill, p.sync)), Some((None, true)));
        assert_eq!(pool.pop(0, now).map(|p| (p.refill, p.sync)), Some((None, false)));
        assert_eq!(pool.pop(0, now).and_then(|p| p.refill), Some(3));
        assert_eq!(pool.pop(0, now).and_then(|p| p.refill), None, "a fill is on its way");
        assert_eq!(pool.listing(0).len(), 4);
        let plan = pool.plan(0, &[]);
        assert_eq!(plan.rewrites.iter().map(|c| c.addrs.len()).collect::<Vec<_>>(), [4], "one key, rewritten with the four left");
        assert_eq!(pool.pop(0, now).map(|p| p.sync), Some(true), "a pop after the plan asks again");
    }

    #[test]
    fn a_hand_out_rewrites_only_the_key_that_listed_it() {
        let pool = OwnPool::new(&[1024]);
        let now = live(&pool);
        assert_eq!(pool.start_fill(0, now), Some(1024));
        let got: Vec<IpAddr> = (0..200u32).map(|i| IpAddr::from(std::net::Ipv4Addr::from(0xc612_0000 + i))).collect();
        let plan = pool.plan(0, &got);
        assert!(plan.rewrites.is_empty());
        assert_eq!(plan.fills.iter().map(|c| (c.chunk, c.addrs.len())).collect::<Vec<_>>(), [(0, 64), (1, 64), (2, 64), (3, 8)]);
        assert!(pool.fill_done(0, &plan.fills, LIVE));
        assert!(pool.plan(0, &[]).is_empty(), "nothing handed out: nothing to rewrite");
        // Nine hand-outs empty chunk 3 and take one address of chunk 2.
        let out: Vec<IpAddr> = (0..9).filter_map(|_| pool.pop(0, now)).map(|p| p.ip).collect();
        assert_eq!(out.len(), 9);
        let taken = got[0];
        assert!(pool.take(0, taken), "a static request takes one address of chunk 0");
        let plan = pool.plan(0, &[]);
        let rewritten: Vec<(u32, usize)> = plan.rewrites.iter().map(|c| (c.chunk, c.addrs.len())).collect();
        assert_eq!(rewritten, [(0, 63), (2, 63), (3, 0)], "chunk 3 is deleted, 0 and 2 rewritten, 1 untouched");
        for c in &plan.rewrites {
            assert!(out.iter().chain([&taken]).all(|ip| !c.addrs.contains(ip)), "a rewritten key lists an address no longer pooled");
        }
        // Until the rewrite is written, the next plan asks for it again (a failed transaction
        // loses nothing); after, nothing is left to rewrite.
        assert_eq!(pool.plan(0, &[]), PoolPlan { rewrites: plan.rewrites.clone(), fills: Vec::new(), more: false });
        pool.written(0, &plan);
        assert!(pool.plan(0, &[]).is_empty());
        // The next fill's keys are new chunks.
        let more = pool.plan(0, &[IpAddr::from(std::net::Ipv4Addr::new(198, 18, 9, 9))]);
        assert_eq!(more.fills.iter().map(|c| c.chunk).collect::<Vec<_>>(), [4]);
    }

    #[test]
    fn a_plan_rewrites_at_most_max_rewrites_keys_and_says_more_are_due() {
        let pool = OwnPool::new(&[4096]);
        live(&pool);
        let got: Vec<IpAddr> = (0..(CHUNK * (MAX_REWRITES + 8)) as u32).map(|i| IpAddr::from(std::net::Ipv4Addr::from(0xc612_0000 + i))).collect();
        let plan = pool.plan(0, &got);
        assert!(pool.fill_done(0, &plan.fills, LIVE));
        // One address taken out of every key.
        for chunk in got.chunks(CHUNK) {
            assert!(pool.take(0, chunk[0]));
        }
        let first = pool.plan(0, &[]);
        assert_eq!((first.rewrites.len(), first.more), (MAX_REWRITES, true));
        pool.written(0, &first);
        let second = pool.plan(0, &[]);
        assert_eq!((second.rewrites.len(), second.more), (8, false), "the rest in the next");
    }

    #[test]
    fn a_pool_key_belongs_to_the_member_before_its_chunk() {
        assert_eq!(pool_key("/r/198.18.0.0/16", "00000000000000aa", 3), "/r/198.18.0.0/16/pool/00000000000000aa/3");
        let name = pool_key("/r", "00000000000000aa", 3).trim_start_matches(&pool_prefix("/r")).to_string();
        assert_eq!(pool_member(&name), "00000000000000aa");
        assert_eq!(pool_member("00000000000000aa"), "00000000000000aa", "the shape written before chunks");
    }

    #[test]
    fn a_taken_address_is_never_handed_out() {
        let pool = OwnPool::new(&[4]);
        let now = live(&pool);
        assert!(filled(&pool, 0, &[ip("198.18.0.1"), ip("198.18.0.2")], LIVE));
        assert!(pool.take(0, ip("198.18.0.1")));
        assert!(!pool.take(0, ip("198.18.0.1")), "taken once");
        assert_eq!(pool.pop(0, now).map(|p| p.ip), Some(ip("198.18.0.2")));
        assert_eq!(pool.pop(0, now), None);
    }

    #[test]
    fn losing_the_lease_drops_the_pool() {
        let pool = OwnPool::new(&[4, 4]);
        live(&pool);
        assert!(filled(&pool, 0, &[ip("198.18.0.1")], LIVE));
        assert!(filled(&pool, 1, &[ip("fd00::1"), ip("fd00::2")], LIVE));
        assert_eq!(pool.drop_all(), 3);
        assert_eq!(pool.len(0) + pool.len(1), 0);
    }

    #[test]
    fn a_closed_pool_hands_out_nothing() {
        let pool = OwnPool::new(&[4]);
        let now = live(&pool);
        assert!(filled(&pool, 0, &[ip("198.18.0.1")], LIVE));
        pool.close();
        assert_eq!(pool.pop(0, now), None);
        assert_eq!(pool.start_fill(0, now), None);
    }

    #[test]
    fn a_disabled_pool_never_fills() {
        let pool = OwnPool::new(&[0]);
        assert!(!pool.enabled());
        live(&pool);
        assert_eq!(pool.start_fill(0, Instant::now()), None);
    }

    #[test]
    fn a_range_without_a_pool_never_fills_beside_one_with() {
        let pool = OwnPool::new(&[0, 4]);
        assert!(pool.enabled());
        let now = live(&pool);
        assert_eq!(pool.start_fill(0, now), None);
        assert_eq!(pool.start_fill(1, now), Some(4));
    }

    #[test]
    fn the_pool_is_at_most_an_eighth_of_the_dynamic_band() {
        let cidr = |s: &str| crate::cidr::ServiceCidr::parse(s).expect("cidr");
        // /17: 32766 usable, static band 256, dynamic 32510 -> cap 4063.
        assert_eq!(pool_target(1024, &cidr("198.18.0.0/17")), 1024);
        // /24: 254 usable, static band 16, dynamic 238 -> cap 29.
        assert_eq!(pool_target(1024, &cidr("198.18.0.0/24")), 29);
        // /29: 6 usable, no static band (under 16), 6 / 8 = 0: no pool.
        assert_eq!(pool_target(1024, &cidr("198.18.0.0/29")), 0, "no dynamic band to spare");
        assert_eq!(pool_target(0, &cidr("fd00::/64")), 0);
    }
}
