//! Service addresses for the IPAddress backend, answered from memory: every controller
//! replica picks dynamic addresses only inside *address blocks* it holds exclusively.
//!
//! The kube-apiserver (≥ 1.33) records every Service address itself, as the IPAddress named
//! by the address, when it stores the Service — after our mutating webhook answered. So the
//! webhook's only job is that no two answers, on any replica, name the same address before
//! the apiserver has recorded the first. Blocks do that without a write per admission:
//!
//! - **Blocks.** Each range is cut into blocks of `size` consecutive addresses, the dynamic
//!   band's first, then the static band's ([`layout`]). A block is held through a
//!   `coordination.k8s.io/v1` Lease `clusterip-block-<range>-<n>` in the controller's
//!   namespace (label `clusterip.allocator/block`), `holderIdentity` = the replica's identity
//!   and a per-process nonce. Creating the Lease takes a free block; `AlreadyExists` means
//!   someone else holds it.
//! - **Picks in memory.** A replica answers a dynamic request with an address of a block it
//!   holds, skipping what the watch-fed IPAddress set ([`ApiserverIps`]) shows, what the
//!   consistent list made when it took the block showed, and its own picks not yet recorded
//!   (*pending*, until the view shows the IPAddress or the admission gives the address back
//!   after its in-flight limit). Nothing cluster-wide is written per admission.
//! - **Renewal and the margin.** The holder renews each Lease every `renew_every` (an update
//!   with the Lease's resourceVersion as precondition) and picks from a block only while the
//!   last renewal it saw confirmed was *sent* less than `lease_duration − margin` ago, on its
//!   own monotonic clock ([`usable`]). A renewal refused (409: someone took the block over;
//!   404) drops the block at once.
//! - **Takeover.** Another replica takes a block over only after it has itself observed the
//!   Lease with the same resourceVersion for the whole `lease_duration`, on its own
//!   monotonic clock ([`expired`]) — never by comparing the Lease's timestamps with its
//!   clock — and then with an update carrying that resourceVersion as precondition.
//! - **Fresh view before answering.** After creating or taking over a block, the replica
//!   lists the IPAddresses from the apiserver without a resourceVersion (a consistent read)
//!   before answering from it, so every address the previous holder had answered and the
//!   apiserver stored is seen, however far its own watch lags.
//! - **Spans, not names.** The block size is per range (`--address-block-size`, else
//!   [`auto_block_size`]) and may differ between replicas during a rolling update, so a
//!   replica reads another's block from the addresses its Lease names ([`lease_span`]) and
//!   takes no block sharing one with it. Two replicas of different sizes can still create
//!   overlapping blocks at the same moment (different names); the consistent list of the
//!   block Leases each makes after creating shows the earlier Lease to the later one, which
//!   gives its block back before answering from it.
//! - **Hand-over.** A replica whose blocks are used up while every block is held asks a
//!   holder for one ([`WANTED_ANNOTATION`]); the holder gives back a block with room and no
//!   pick pending, if it keeps room elsewhere or the block is idle, and the asker takes it
//!   like any free block.
//!
//! Why no address gets two owners (docs/backends.md, "Address blocks"): the holder's last
//! pick from a block happens before `s + D − M` (s: send time of its last confirmed
//! renewal, D the lease duration, M the margin); an observer first sees that renewal at
//! `o ≥ s` and takes over at `o + D` at the earliest; the request carrying the last pick
//! is stored or has failed within the apiserver's request timeout T (60 s by default) after
//! it began, i.e. before `s + D − M + T`. With `M > T` that is before the takeover, whose
//! consistent list then sees it. The defaults are D = 120 s, M = 75 s (> T = 60 s), renewal
//! every 11.25 s: a holder answers from a block for 45 s after each confirmed renewal.
//!
//! Blocks go back (Lease deleted, resourceVersion precondition) at shutdown
//! ([`AllocationStore::close`]) and when idle, but only when none of their picks is still
//! pending: a block given back with an answered, unrecorded address could be taken by a
//! replica whose consistent list does not show it yet.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::networking::v1::IPAddress;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::Client;
use rand::Rng;
use tracing::{debug, info, warn};

use crate::alloc::AllocError;
use crate::cidr::{Family, ServiceCidr};

use super::apiserver_ips::ApiserverIps;
use super::fold::Change;
use super::{AllocationStore, ParentRef, RangeSet, RangeUsage, StoreError};
use crate::sync::lock;

/// Label on every block Lease (value "true").
pub const BLOCK_LABEL: &str = "clusterip.allocator/block";
/// Annotation naming the block's range (the CIDR text).
pub const RANGE_ANNOTATION: &str = "clusterip.allocator/range";
/// Annotation naming the block's first and last address (informative).
pub const ADDRESSES_ANNOTATION: &str = "clusterip.allocator/addresses";

/// How long `/readyz` waits for the kube-apiserver (the Deployment's probe gives up after 2 s).
const READY_TIMEOUT: Duration = Duration::from_millis(1500);

/// The largest block size [`auto_block_size`] chooses (addresses).
pub const MAX_AUTO_BLOCK_SIZE: u64 = 256;
/// Annotation a replica with no room left writes on another replica's block Lease: its
/// holderIdentity, asking the holder to give one of its blocks of that range back.
pub const WANTED_ANNOTATION: &str = "clusterip.allocator/wanted-by";
/// How long an admission with no room waits for another replica to hand a block over.
/// Below the webhook's timeout (5 s in deploy/webhooks.yaml). After a wait that got
/// nothing, the range's next admissions within this long answer at once.
const HANDOVER_WAIT: Duration = Duration::from_secs(3);
/// How often a replica waiting for a hand-over looks at the block Leases again.
const HANDOVER_POLL: Duration = Duration::from_millis(100);
/// A holder gives its last usable block of a range away only when nothing was picked from
/// it for this long (else two replicas would pass one block back and forth).
const HANDOVER_IDLE: Duration = Duration::from_secs(5);
/// Default lease duration of a block: how long an observer watches an unchanged Lease
/// before it takes the block over.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(120);
/// Default margin: a holder stops picking from a block this long before an observer could
/// take it over. Must exceed the longest an answered request can stay unstored (the
/// apiserver's request timeout, 60 s by default).
pub const DEFAULT_MARGIN: Duration = Duration::from_secs(75);

/// Tunables of [`BlockStore`]; the defaults are what the controller runs with.
#[derive(Clone, Debug)]
pub struct BlockOptions {
    /// Addresses per block; None: [`auto_block_size`] of each range.
    pub size: Option<u64>,
    /// See [`DEFAULT_LEASE_DURATION`].
    pub lease_duration: Duration,
    /// See [`DEFAULT_MARGIN`].
    pub margin: Duration,
    /// How often the background task renews, observes and gives back; `None`: no task,
    /// only explicit [`BlockStore::tick`] calls (tests).
    pub renew_every: Option<Duration>,
}

impl Default for BlockOptions {
    fn default() -> Self {
        Self::new(None, DEFAULT_LEASE_DURATION, DEFAULT_MARGIN).unwrap_or(Self {
            size: None,
            lease_duration: DEFAULT_LEASE_DURATION,
            margin: DEFAULT_MARGIN,
            renew_every: Some(Duration::from_secs(10)),
        })
    }
}

impl BlockOptions {
    /// Options with a background task renewing four times per usable window
    /// (`lease_duration − margin`). Errors say what is allowed.
    pub fn new(size: Option<u64>, lease_duration: Duration, margin: Duration) -> Result<Self, String> {
        if let Some(size) = size.filter(|s| !(1..=65536).contains(s)) {
            return Err(format!("invalid address block size {size}: must be from 1 to 65536"));
        }
        if margin >= lease_duration || margin.is_zero() {
            return Err(format!("invalid address block margin {margin:?}: must be longer than 0 and shorter than the block lease duration ({lease_duration:?})"));
        }
        let window = lease_duration - margin;
        Ok(Self { size, lease_duration, margin, renew_every: Some((window / 4).max(Duration::from_millis(100))) })
    }
}

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
    fn free(&self, cidr: &ServiceCidr, taken: impl Fn(IpAddr) -> bool) -> usize {
        (self.first..self.end).filter(|off| cidr.ip_at(*off).is_some_and(|ip| !taken(ip))).count()
    }
}

/// A replica takes another block of a range, ahead of need, once its usable blocks of the
/// range have fewer free addresses than this many whole blocks. Taking a block costs a
/// Lease write and two consistent lists, which the kube-apiserver answers slowly while a
/// burst of creates saturates it: with one block's worth of lead a 500-create burst
/// (`scripts/bench-webhook.sh`) used the block up before the next one was taken, and
/// admissions waited for it (mutate p99 3.2 and 257 ms against 0.8 ms); two give the
/// acquisition the time of a whole block's picks more. A replica takes this many at start.
const LEAD_BLOCKS: u64 = 2;

/// Fewer blocks than this in a range: warned about at start (see [`BlockStore::open`]).
const FEW_BLOCKS: u64 = 4;

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

/// Whether a holder may still pick from a block whose last confirmed renewal was sent at
/// `confirmed`: strictly less than `lease_duration − margin` ago.
pub fn usable(confirmed: Instant, now: Instant, lease_duration: Duration, margin: Duration) -> bool {
    now.saturating_duration_since(confirmed) < lease_duration.saturating_sub(margin)
}

/// Whether an observer that first saw a Lease's current resourceVersion at `first_seen` may
/// take it over at `now`: after the whole lease duration on its own clock.
pub fn expired(first_seen: Instant, now: Instant, lease_duration: Duration) -> bool {
    now.saturating_duration_since(first_seen) >= lease_duration
}

/// A block this replica holds.
#[derive(Debug)]
struct Held {
    range: usize,
    span: BlockSpan,
    name: String,
    /// The Lease as last written (its resourceVersion is the next update's precondition).
    lease: Lease,
    /// Send time of the last write of the Lease that the apiserver confirmed.
    confirmed: Instant,
    /// Where the next pick starts looking.
    cursor: u64,
    /// Recorded per the consistent list made when the block was taken, until the view shows
    /// them (then the view covers them).
    listed: HashSet<IpAddr>,
    last_pick: Instant,
    /// Being given back: no picks.
    returning: bool,
}

/// An address answered (or requested) here and not yet seen recorded.
#[derive(Clone, Debug)]
struct Pending {
    parent: Option<ParentRef>,
}

/// Another replica's block as this one observes it.
#[derive(Clone, Debug)]
struct Observed {
    range: usize,
    /// The addresses its Lease names ([`lease_span`]; by index at our size if it names none).
    span: BlockSpan,
    /// When this replica first saw the Lease's current renewal ([`renewal_of`]), on its own
    /// monotonic clock.
    since: Instant,
    /// The Lease as last seen (its resourceVersion is a takeover's precondition).
    lease: Lease,
}

#[derive(Default)]
struct State {
    held: Vec<Held>,
    pending: HashMap<IpAddr, Pending>,
    /// Every listed block Lease of our ranges not held by us, by name.
    observed: HashMap<String, Observed>,
    /// Hand-over requests answered, by Lease name and resourceVersion: each once.
    answered: HashSet<(String, String)>,
    /// Per range, when this replica's last request for a block ended without one.
    unanswered: HashMap<usize, Instant>,
}

/// Service addresses from exclusively held blocks; see the module docs.
pub struct BlockStore {
    leases: Api<Lease>,
    addresses: Api<IPAddress>,
    ranges: RangeSet,
    recorded: ApiserverIps,
    /// The holderIdentity written: the replica's identity and a per-process nonce.
    holder: String,
    options: BlockOptions,
    /// Block size per range (the option, or [`auto_block_size`]).
    sizes: Vec<u64>,
    state: Mutex<State>,
    /// One acquisition at a time per range.
    acquiring: Vec<tokio::sync::Mutex<()>>,
    /// One hand-over at a time.
    handing: tokio::sync::Mutex<()>,
    me: Weak<BlockStore>,
    /// The background task (renew, observe, answer hand-over requests); aborted on drop.
    tasks: Mutex<tokio::task::JoinSet<()>>,
    /// The runtime [`BlockStore::open`] ran on: background work goes there.
    runtime: tokio::runtime::Handle,
}

fn api_err(what: &str, e: kube::Error) -> StoreError {
    match e {
        kube::Error::Api(s) if s.code < 500 && s.code != 429 => StoreError::Backend(format!("{what}: {} ({})", s.message, s.code).into()),
        other => StoreError::Unavailable(format!("{what}: {other}").into()),
    }
}

fn now_micro() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// What one [`BlockStore::tick`] did (for tests and logs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TickResult {
    pub renewed: usize,
    /// Blocks dropped because someone else holds them now (or their Lease is gone).
    pub lost: Vec<String>,
    pub given_back: Vec<String>,
    /// Blocks given back because another replica asked for one.
    pub handed_over: Vec<String>,
}

impl BlockStore {
    /// Blocks of `ranges` held through Leases in `namespace`, beside the cluster's IPAddress
    /// view `recorded` (already synced). `identity` names the replica in the Leases.
    pub async fn open(client: Client, namespace: &str, ranges: Vec<ServiceCidr>, recorded: ApiserverIps, identity: &str, options: BlockOptions) -> Result<Arc<Self>, StoreError> {
        if ranges.is_empty() {
            return Err(StoreError::Config("no service CIDR configured".into()));
        }
        let sizes: Vec<u64> = ranges.iter().map(|c| options.size.unwrap_or_else(|| auto_block_size(c))).collect();
        for (cidr, &size) in ranges.iter().zip(&sizes) {
            let (_, blocks) = layout(cidr, size);
            if blocks < FEW_BLOCKS {
                warn!(
                    range = %cidr, blocks, block_size = size,
                    "few address blocks: with every block held by other replicas, a replica whose own blocks are used up waits for one to be handed over and otherwise answers \"range is full\"; with R replicas, set --address-block-size to at most a quarter of the range's addresses divided by R, or leave it unset"
                );
            }
        }
        let nonce: u32 = rand::thread_rng().gen();
        let holder = format!("{identity}/{nonce:08x}");
        let acquiring = ranges.iter().map(|_| tokio::sync::Mutex::new(())).collect();
        let me = Arc::new_cyclic(|weak| BlockStore {
            leases: Api::namespaced(client.clone(), namespace),
            addresses: Api::all(client),
            ranges: RangeSet::new(ranges),
            recorded,
            holder,
            options: options.clone(),
            sizes,
            state: Mutex::default(),
            acquiring,
            handing: tokio::sync::Mutex::new(()),
            me: weak.clone(),
            tasks: Mutex::default(),
            runtime: tokio::runtime::Handle::current(),
        });
        me.observe().await?;
        if let Some(every) = options.renew_every {
            let (weak, leases) = (Arc::downgrade(&me), me.leases.clone());
            let mut tasks = lock(&me.tasks);
            tasks.spawn(tick_forever(weak.clone(), every));
            tasks.spawn(answer_requests(weak, leases));
        }
        // The lead up front ([`LEAD_BLOCKS`] blocks per range, the ones after the first only
        // while two are free), so a burst right after start is answered from memory while
        // the next block is taken. With one block, the first pick started that acquisition
        // and a 500-create burst could use the block up before it landed: admissions then
        // waited for it (`scripts/bench-webhook.sh`: mutate p99 122 and 617 ms in two of
        // four runs).
        for range in 0..me.ranges.cidrs().len() {
            let _one = me.acquiring[range].lock().await;
            for k in 0..LEAD_BLOCKS {
                let need = if k == 0 { Need::Now } else { Need::Ahead };
                match me.acquire_locked(range, need).await {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        warn!(range = %me.ranges.cidrs()[range], error = %e, "could not take an address block yet; trying again on the first admission");
                        break;
                    }
                }
            }
        }
        Ok(me)
    }

    /// The holderIdentity this replica writes.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Names of the blocks this replica holds and may pick from now.
    pub fn held_blocks(&self) -> Vec<String> {
        let now = Instant::now();
        lock(&self.state).held.iter().filter(|h| self.usable(h, now)).map(|h| h.name.clone()).collect()
    }

    fn usable(&self, h: &Held, now: Instant) -> bool {
        !h.returning && usable(h.confirmed, now, self.options.lease_duration, self.options.margin)
    }

    fn taken(&self, st: &State, ip: IpAddr) -> bool {
        taken(&self.recorded.view(), st, ip)
    }

    /// Pick a free address of range `range` from a usable block, in memory. Returns the
    /// address and whether the replica runs low: less than [`LEAD_BLOCKS`] whole blocks' worth
    /// left in its usable blocks of the range, so the next block is taken while these still
    /// answer (a burst never waits for a Lease and two consistent lists).
    fn pick(&self, range: usize, parent: Option<&ParentRef>) -> (Option<IpAddr>, bool) {
        let now = Instant::now();
        let cidr = &self.ranges.cidrs()[range];
        let mut st = lock(&self.state);
        // One read of the view for the whole pick: the watch writes to it while a burst's
        // IPAddresses arrive, and a pick looks at up to every address of its blocks.
        let recorded = self.recorded.view();
        let mut chosen = None;
        for i in 0..st.held.len() {
            let h = &st.held[i];
            if h.range != range || !self.usable(h, now) {
                continue;
            }
            let (first, len, cursor) = (h.span.first, h.span.end - h.span.first, h.cursor);
            for k in 0..len {
                let off = first + (cursor - first + k) % len;
                let Some(ip) = cidr.ip_at(off) else { continue };
                if !taken(&recorded, &st, ip) {
                    chosen = Some((i, off, ip));
                    break;
                }
            }
            if chosen.is_some() {
                break;
            }
        }
        if let Some((i, off, ip)) = chosen {
            let h = &mut st.held[i];
            h.cursor = if off + 1 >= h.span.end { h.span.first } else { off + 1 };
            h.last_pick = now;
            st.pending.insert(ip, Pending { parent: parent.cloned() });
        }
        let low = !self.has_free(&recorded, &st, range, now, None, LEAD_BLOCKS * self.sizes[range]);
        (chosen.map(|c| c.2), low)
    }

    /// Whether the usable blocks of `range` (all but the one named `except`) have at least
    /// `want` free addresses. Counting stops at `want`, so an answer looks at about one
    /// block's worth of addresses, not at every address the replica holds.
    fn has_free(&self, recorded: &HashSet<IpAddr>, st: &State, range: usize, now: Instant, except: Option<&str>, want: u64) -> bool {
        let cidr = &self.ranges.cidrs()[range];
        let mut found = 0;
        for h in st.held.iter().filter(|h| h.range == range && self.usable(h, now) && Some(h.name.as_str()) != except) {
            for off in h.span.first..h.span.end {
                if found >= want {
                    return true;
                }
                if cidr.ip_at(off).is_some_and(|ip| !taken(recorded, st, ip)) {
                    found += 1;
                }
            }
        }
        found >= want
    }

    /// Take one more block of `range`: a block observed unchanged for the lease duration
    /// (its holder gone) first, else a free dynamic block, else a free static one. Ok(false)
    /// when every block is held. The caller holds `acquiring[range]`. Ahead of need, a free
    /// block is taken only while at least two are free: the last one is left to a replica
    /// that has none.
    async fn acquire_locked(&self, range: usize, need: Need) -> Result<bool, StoreError> {
        for _attempt in 0..8 {
            match self.try_acquire(range, need).await? {
                Attempt::Got => return Ok(true),
                Attempt::NoneFree => return Ok(false),
                // Someone else was quicker: look again.
                Attempt::Raced => self.observe().await.map(drop)?,
            }
        }
        let cidr = &self.ranges.cidrs()[range];
        Err(StoreError::Unavailable(format!("could not take an address block of {cidr}: others took each one tried first").into()))
    }

    /// One try at a block of `range`, on the block Leases as last observed.
    async fn try_acquire(&self, range: usize, need: Need) -> Result<Attempt, StoreError> {
        let cidr = &self.ranges.cidrs()[range];
        let size = self.sizes[range];
        let (dynamic, total) = layout(cidr, size);
        let now = Instant::now();
        let (expired_one, busy): (Option<(String, Observed)>, HashSet<u64>) = {
            let st = lock(&self.state);
            let mut busy: HashSet<u64> = st.held.iter().filter(|h| h.range == range).map(|h| h.span.index).collect();
            // Other replicas' blocks by the addresses their Leases name, whatever their size.
            for o in st.observed.values().filter(|o| o.range == range) {
                busy.extend(blocks_overlapping(cidr, size, &o.span));
            }
            let exp = st.observed.iter().filter(|(_, o)| o.range == range && expired(o.since, now, self.options.lease_duration)).min_by_key(|(_, o)| o.span.first).map(|(n, o)| (n.clone(), o.clone()));
            (exp, busy)
        };
        let got = if let Some((name, old)) = expired_one {
            self.take_over(range, &name, old).await?
        } else {
            // A random free block, the dynamic band's first (fewer replicas meet on one).
            if need == Need::Ahead && total.saturating_sub(busy.len() as u64) < 2 {
                return Ok(Attempt::NoneFree);
            }
            let Some(index) = free_block(&busy, dynamic, total) else { return Ok(Attempt::NoneFree) };
            self.create(range, index).await?
        };
        Ok(if got { Attempt::Got } else { Attempt::Raced })
    }

    /// Every block of `range` is held and this replica's are used up: ask the holder of the
    /// block with the most room (per this replica's view) to hand one over — the
    /// `clusterip.allocator/wanted-by` annotation on that Lease — and take the block it gives
    /// back, looking again every [`HANDOVER_POLL`] for up to [`HANDOVER_WAIT`] (not again
    /// within [`HANDOVER_WAIT`] of a wait that got nothing). The caller
    /// holds `acquiring[range]`. Ok(false): nothing was handed over in time.
    async fn ask_for_block(&self, range: usize) -> Result<bool, StoreError> {
        let target: Option<(String, bool)> = {
            let st = lock(&self.state);
            // Admissions queued behind one that waited in vain do not each wait again.
            if st.unanswered.get(&range).is_some_and(|t| t.elapsed() < HANDOVER_WAIT) {
                return Ok(false);
            }
            let recorded = self.recorded.view();
            let cidr = &self.ranges.cidrs()[range];
            let now = Instant::now();
            st.observed
                .iter()
                .filter(|(_, o)| o.range == range && !expired(o.since, now, self.options.lease_duration))
                .map(|(name, o)| (o.span.free(cidr, |ip| recorded.contains(&ip)), name, wanted_by(&o.lease) == Some(self.holder.as_str())))
                .filter(|(free, _, _)| *free > 0)
                .max_by_key(|(free, _, _)| *free)
                .map(|(_, name, asked)| (name.clone(), asked))
        };
        let Some((name, asked)) = target else { return Ok(false) };
        if !asked {
            let patch = serde_json::json!({"metadata": {"annotations": {WANTED_ANNOTATION: self.holder}}});
            match self.leases.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => debug!(block = %name, "asked the holder of an address block to hand one over"),
                // Gone or changed: looked at again below.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                // (E.g. no patch permission: deploy/rbac.yaml before the hand-over.) The
                // range stays as full to this replica as it was without asking.
                Err(e) => {
                    warn!(block = %name, error = %e, "could not ask for an address block to be handed over");
                    lock(&self.state).unanswered.insert(range, Instant::now());
                    return Ok(false);
                }
            }
        }
        let deadline = Instant::now() + HANDOVER_WAIT;
        while Instant::now() < deadline {
            tokio::time::sleep(HANDOVER_POLL).await;
            self.observe().await?;
            if let Attempt::Got = self.try_acquire(range, Need::Now).await? {
                lock(&self.state).unanswered.remove(&range);
                return Ok(true);
            }
        }
        lock(&self.state).unanswered.insert(range, Instant::now());
        Ok(false)
    }

    fn block_lease(&self, cidr: &ServiceCidr, span: BlockSpan) -> Lease {
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
                holder_identity: Some(self.holder.clone()),
                lease_duration_seconds: Some(self.options.lease_duration.as_secs().max(1).min(i32::MAX as u64) as i32),
                acquire_time: Some(now_micro()),
                renew_time: Some(now_micro()),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        }
    }

    /// Create the Lease of a free block. Ok(false): someone else created it first.
    async fn create(&self, range: usize, index: u64) -> Result<bool, StoreError> {
        let cidr = &self.ranges.cidrs()[range];
        let Some(span) = span(cidr, self.sizes[range], index) else { return Ok(false) };
        let sent = Instant::now();
        match self.leases.create(&PostParams::default(), &self.block_lease(cidr, span)).await {
            Ok(lease) => {
                if !self.alone(range, span, &block_name(cidr, index), &lease).await? {
                    return Ok(false);
                }
                self.adopt(range, span, lease, sent).await?;
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(api_err(&format!("creating the Lease of address block {}", block_name(cidr, index)), e)),
        }
    }

    /// Take over a block whose Lease this replica observed unchanged for the lease
    /// duration: an update with the observed resourceVersion as precondition. A Lease that
    /// names other addresses than our block of that name (written by a replica with another
    /// block size) is deleted instead, with the same precondition: its holder is gone and
    /// everything it answered is stored or failed (see the module docs), so its addresses
    /// are free blocks again.
    async fn take_over(&self, range: usize, name: &str, old: Observed) -> Result<bool, StoreError> {
        let cidr = &self.ranges.cidrs()[range];
        let mine = self.block_of(name).and_then(|(_, index)| span(cidr, self.sizes[range], index));
        let previous = holder_of(&old.lease).unwrap_or_default().to_string();
        let Some(span) = mine.filter(|s| s.first == old.span.first && s.end == old.span.end) else {
            match self.leases.delete(name, &unchanged(&old.lease)).await {
                Ok(_) => info!(block = %name, %previous, "deleted an address block of another size its holder stopped renewing"),
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => return Err(api_err(&format!("deleting address block {name}"), e)),
            }
            lock(&self.state).observed.remove(name);
            return Ok(false);
        };
        let mut lease = self.block_lease(cidr, span);
        lease.metadata.resource_version = old.lease.metadata.resource_version.clone();
        let transitions = old.lease.spec.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0);
        if let Some(spec) = lease.spec.as_mut() {
            spec.lease_transitions = Some(transitions.saturating_add(1));
        }
        let sent = Instant::now();
        match self.leases.replace(name, &PostParams::default(), &lease).await {
            Ok(lease) => {
                lock(&self.state).observed.remove(name);
                if !self.alone(range, span, name, &lease).await? {
                    return Ok(false);
                }
                info!(block = %name, %previous, "took over an address block its holder stopped renewing");
                self.adopt(range, span, lease, sent).await?;
                Ok(true)
            }
            // Changed meanwhile (renewed, or taken by someone else), or gone.
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
                lock(&self.state).observed.remove(name);
                Ok(false)
            }
            Err(e) => Err(api_err(&format!("taking over address block {name}"), e)),
        }
    }

    /// After creating or taking over the Lease of `span`: whether no other block Lease of the
    /// range names any of its addresses, per a consistent list. Replicas with different block
    /// sizes (a rolling update that changes `--address-block-size`) name overlapping blocks
    /// by different Lease names, which creating a Lease does not refuse; of two such Leases
    /// the later one's list shows the earlier one, so at most one is kept. When another is
    /// seen, ours is given back at once (nothing was answered from it) and Ok(false).
    async fn alone(&self, range: usize, span: BlockSpan, name: &str, lease: &Lease) -> Result<bool, StoreError> {
        if let Err(e) = self.observe().await {
            self.give_back_lease(name, lease).await;
            return Err(e);
        }
        let other = lock(&self.state).observed.iter().find(|(_, o)| o.range == range && overlap(&o.span, &span)).map(|(n, _)| n.clone());
        let Some(other) = other else { return Ok(true) };
        info!(block = %name, %other, "another replica's address block shares addresses with the one just taken: giving it back");
        self.give_back_lease(name, lease).await;
        Ok(false)
    }

    /// A block is ours: list the IPAddresses with a consistent read before answering from
    /// it, so that whatever the previous holder answered and the apiserver stored is seen
    /// whatever our watch shows.
    async fn adopt(&self, range: usize, span: BlockSpan, lease: Lease, sent: Instant) -> Result<(), StoreError> {
        let cidr = &self.ranges.cidrs()[range];
        let name = block_name(cidr, span.index);
        let listed = match self.addresses.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(e) => {
                // Not usable without a fresh view: hand it back (or let it expire).
                self.give_back_lease(&name, &lease).await;
                return Err(api_err("listing IPAddresses after taking an address block", e));
            }
        };
        let listed: HashSet<IpAddr> = listed
            .items
            .iter()
            .filter_map(|o| crate::k8s::ipaddress::address(o.metadata.name.as_deref()?))
            .filter(|ip| span.covers(cidr, *ip))
            .collect();
        debug!(block = %name, recorded = listed.len(), "address block taken");
        let cursor = span.first + rand::thread_rng().gen_range(0..span.end - span.first);
        lock(&self.state).held.push(Held { range, span, name, lease, confirmed: sent, cursor, listed, last_pick: Instant::now(), returning: false });
        Ok(())
    }

    /// Delete a block Lease of ours, with its uid and resourceVersion as preconditions. A
    /// conflict whose read still shows this process as the holder (a hand-over request
    /// changed the Lease) is tried once more with the resourceVersion read. true: the Lease
    /// is gone or no longer ours.
    async fn give_back_lease(&self, name: &str, lease: &Lease) -> bool {
        let mut lease = lease.clone();
        for _ in 0..2 {
            match self.leases.delete(name, &unchanged(&lease)).await {
                Ok(_) => return true,
                Err(kube::Error::Api(s)) if s.code == 404 => return true,
                Err(kube::Error::Api(s)) if s.code == 409 => match self.leases.get_opt(name).await {
                    Ok(Some(cur)) if holder_of(&cur) == Some(self.holder.as_str()) => lease = cur,
                    Ok(_) => return true,
                    Err(e) => {
                        warn!(block = %name, error = %e, "could not give an address block back; it expires instead");
                        return false;
                    }
                },
                Err(e) => {
                    warn!(block = %name, error = %e, "could not give an address block back; it expires instead");
                    return false;
                }
            }
        }
        warn!(block = %name, "could not give an address block back (it kept changing); it expires instead");
        false
    }

    /// List the block Leases of our ranges and note, on this replica's clock, since when
    /// each one held by another replica has kept its holder's last renewal. Returns the
    /// Leases held here that carry a hand-over request not answered yet.
    async fn observe(&self) -> Result<Vec<Lease>, StoreError> {
        let list = self.leases.list(&ListParams::default().labels(BLOCK_LABEL)).await.map_err(|e| api_err("listing address block Leases", e))?;
        let now = Instant::now();
        let mut st = lock(&self.state);
        let mut seen = HashSet::new();
        let mut requests = Vec::new();
        for lease in list.items {
            let Some(name) = lease.metadata.name.clone() else { continue };
            if lease.metadata.resource_version.is_none() {
                continue;
            }
            let Some((range, index)) = self.block_of(&name) else { continue };
            if holder_of(&lease) == Some(self.holder.as_str()) {
                if self.asks_us(&st, &lease) {
                    requests.push(lease);
                }
                continue;
            }
            let cidr = &self.ranges.cidrs()[range];
            // The addresses its Lease names; by the index at our size only if it names none.
            let Some(span) = lease_span(cidr, index, &lease).or_else(|| span(cidr, self.sizes[range], index)) else {
                debug!(block = %name, "a block Lease that names no addresses of its range; ignored");
                continue;
            };
            seen.insert(name.clone());
            match st.observed.get_mut(&name) {
                Some(o) if renewal_of(&o.lease) == renewal_of(&lease) => {
                    o.span = span;
                    o.lease = lease;
                }
                _ => {
                    st.observed.insert(name, Observed { range, span, since: now, lease });
                }
            }
        }
        st.observed.retain(|n, _| seen.contains(n));
        let held: HashSet<String> = st.held.iter().map(|h| h.name.clone()).collect();
        st.answered.retain(|(n, _)| held.contains(n));
        Ok(requests)
    }

    /// Whether `lease` is a block held here that carries another replica's hand-over request
    /// not answered yet.
    fn asks_us(&self, st: &State, lease: &Lease) -> bool {
        let (Some(name), Some(rv)) = (lease.metadata.name.as_ref(), lease.metadata.resource_version.as_ref()) else { return false };
        holder_of(lease) == Some(self.holder.as_str())
            && wanted_by(lease).is_some_and(|w| w != self.holder)
            && st.held.iter().any(|h| &h.name == name)
            && !st.answered.contains(&(name.clone(), rv.clone()))
    }

    /// (range, index) of a block Lease name of ours. The index counts blocks of the size of
    /// the replica that named it, which need not be ours.
    fn block_of(&self, name: &str) -> Option<(usize, u64)> {
        let rest = name.strip_prefix("clusterip-block-")?;
        let (prefix, index) = rest.rsplit_once('-')?;
        let index: u64 = index.parse().ok()?;
        let range = self.ranges.cidrs().iter().position(|c| block_name(c, 0).strip_suffix("-0") == Some(&format!("clusterip-block-{prefix}")))?;
        Some((range, index))
    }

    /// Answer another replica's request for a block (`lease`: one of ours carrying it), once
    /// per resourceVersion: give back one block of that range if [`Self::hand_over`] finds
    /// one, and clear the request with a renewal if the block given back is not this one.
    /// Returns the name of the block given back.
    async fn answer_request(&self, lease: Lease) -> Option<String> {
        let _one = self.handing.lock().await;
        let (name, rv) = (lease.metadata.name.clone()?, lease.metadata.resource_version.clone()?);
        let range = {
            let mut st = lock(&self.state);
            if !self.asks_us(&st, &lease) {
                return None;
            }
            st.answered.insert((name.clone(), rv));
            st.held.iter().find(|h| h.name == name)?.range
        };
        let asker = wanted_by(&lease).unwrap_or_default().to_string();
        let given = self.hand_over(range).await;
        match &given {
            Some(block) => info!(%block, %asker, "handed an address block over to a replica with no room left"),
            None => debug!(block = %name, %asker, "no address block to hand over: each has picks pending, no room, or is the last one in use"),
        }
        if given.as_deref() != Some(name.as_str()) {
            // A renewal writes the Lease without the request.
            self.renew(&name, lease).await;
        }
        given
    }

    /// Give back one usable block of `range` that has free addresses and no pick pending:
    /// the one with the most room, and only while another usable block of the range keeps
    /// room, or when nothing was picked from it for [`HANDOVER_IDLE`]. No pick is made from
    /// it from the moment it is chosen; with no pick pending, everything answered from it is
    /// stored (or failed) and the next holder's consistent list shows it.
    async fn hand_over(&self, range: usize) -> Option<String> {
        let now = Instant::now();
        let (name, lease) = {
            let mut st = lock(&self.state);
            let cidr = &self.ranges.cidrs()[range];
            let chosen = {
                let recorded = self.recorded.view();
                let st = &*st;
                let with_room: Vec<(usize, usize)> = (0..st.held.len())
                    .filter(|&i| st.held[i].range == range && self.usable(&st.held[i], now))
                    .map(|i| (i, st.held[i].span.free(cidr, |ip| taken(&recorded, st, ip))))
                    .filter(|(_, f)| *f > 0)
                    .collect();
                with_room
                    .iter()
                    .filter(|(i, _)| !in_flight(&recorded, st, cidr, &st.held[*i].span))
                    .filter(|(i, _)| with_room.len() > 1 || now.saturating_duration_since(st.held[*i].last_pick) >= HANDOVER_IDLE)
                    .max_by_key(|(_, f)| *f)
                    .map(|(i, _)| *i)
            };
            let h = &mut st.held[chosen?];
            h.returning = true;
            (h.name.clone(), h.lease.clone())
        };
        if self.give_back_lease(&name, &lease).await {
            lock(&self.state).held.retain(|h| h.name != name);
            Some(name)
        } else {
            if let Some(h) = lock(&self.state).held.iter_mut().find(|h| h.name == name) {
                h.returning = false;
            }
            None
        }
    }

    /// Renew the blocks held, observe the others, settle picks the view shows recorded,
    /// give idle blocks back. The background task runs it every `renew_every`.
    pub async fn tick(&self) -> TickResult {
        let mut result = TickResult::default();
        // Picks and listed addresses the view shows recorded: the view covers them now.
        {
            let mut st = lock(&self.state);
            let recorded = &self.recorded;
            st.pending.retain(|ip, _| !recorded.contains(*ip));
            for h in st.held.iter_mut() {
                h.listed.retain(|ip| !recorded.contains(*ip));
            }
        }
        let targets: Vec<(String, Lease)> = lock(&self.state).held.iter().filter(|h| !h.returning).map(|h| (h.name.clone(), h.lease.clone())).collect();
        for (name, lease) in targets {
            match self.renew(&name, lease).await {
                Renewal::Renewed => result.renewed += 1,
                Renewal::Lost => {
                    warn!(block = %name, "address block lost (taken over or deleted); no longer answering from it");
                    lock(&self.state).held.retain(|h| h.name != name);
                    result.lost.push(name);
                }
                Renewal::Failed => {}
            }
        }
        match self.observe().await {
            Ok(requests) => {
                for lease in requests {
                    result.handed_over.extend(self.answer_request(lease).await);
                }
            }
            Err(e) => warn!(error = %e, "could not list address block Leases; trying again"),
        }
        result.given_back = self.give_back_idle().await;
        result
    }

    /// Renew a block from `lease` (ours as last written or read). A hand-over request on it
    /// is not written back: every renewal clears it.
    async fn renew(&self, name: &str, mut lease: Lease) -> Renewal {
        without_request(&mut lease);
        if let Some(spec) = lease.spec.as_mut() {
            spec.renew_time = Some(now_micro());
        }
        let sent = Instant::now();
        match self.leases.replace(name, &PostParams::default(), &lease).await {
            Ok(new) => {
                let mut st = lock(&self.state);
                if let Some(h) = st.held.iter_mut().find(|h| h.name == name) {
                    h.lease = new;
                    h.confirmed = sent;
                }
                Renewal::Renewed
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Renewal::Lost,
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // Our own earlier write may have been applied without our seeing the answer:
                // still ours if we are the holder (the nonce is this process's); then adopt
                // its resourceVersion, but not a newer confirmation time.
                match self.leases.get_opt(name).await {
                    Ok(Some(cur)) if cur.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some(self.holder.as_str()) => {
                        let mut st = lock(&self.state);
                        if let Some(h) = st.held.iter_mut().find(|h| h.name == name) {
                            h.lease = cur;
                        }
                        Renewal::Failed
                    }
                    Ok(_) => Renewal::Lost,
                    Err(e) => {
                        warn!(block = %name, error = %e, "could not read an address block Lease after a conflict; trying again");
                        Renewal::Failed
                    }
                }
            }
            Err(e) => {
                warn!(block = %name, error = %e, "could not renew an address block; trying again");
                Renewal::Failed
            }
        }
    }

    /// Give back blocks nothing was picked from for a lease duration, with no pick pending,
    /// while the other usable blocks of the same range still have [`LEAD_BLOCKS`] whole
    /// blocks' worth free (so giving one back never makes the replica run low and take
    /// another at once).
    async fn give_back_idle(&self) -> Vec<String> {
        let now = Instant::now();
        let chosen: Vec<(String, Lease)> = {
            let mut st = lock(&self.state);
            let mut out = Vec::new();
            for range in 0..self.ranges.cidrs().len() {
                let cidr = &self.ranges.cidrs()[range];
                let recorded = self.recorded.view();
                let idle = st.held.iter().position(|h| {
                    h.range == range
                        && self.usable(h, now)
                        && now.saturating_duration_since(h.last_pick) >= self.options.lease_duration
                        && !in_flight(&recorded, &st, cidr, &h.span)
                        && self.has_free(&recorded, &st, range, now, Some(&h.name), LEAD_BLOCKS * self.sizes[range])
                });
                drop(recorded);
                if let Some(i) = idle {
                    let h = &mut st.held[i];
                    h.returning = true;
                    out.push((h.name.clone(), h.lease.clone()));
                }
            }
            out
        };
        let mut done = Vec::new();
        for (name, lease) in chosen {
            self.give_back_lease(&name, &lease).await;
            lock(&self.state).held.retain(|h| h.name != name);
            done.push(name);
        }
        done
    }

    fn range_of_block(&self, ip: IpAddr) -> Option<usize> {
        self.ranges.cidrs().iter().position(|c| c.contains(ip))
    }
}

/// The holderIdentity of a Lease.
fn holder_of(lease: &Lease) -> Option<&str> {
    lease.spec.as_ref()?.holder_identity.as_deref()
}

/// A delete of `lease` only as it is: its uid and resourceVersion as preconditions.
fn unchanged(lease: &Lease) -> DeleteParams {
    DeleteParams { preconditions: Some(Preconditions { uid: lease.metadata.uid.clone(), resource_version: lease.metadata.resource_version.clone() }), ..Default::default() }
}

/// What only the holder's renewals change: its identity and the renewTime it writes (a
/// hand-over request written by another replica changes neither).
fn renewal_of(lease: &Lease) -> (Option<&str>, Option<&MicroTime>) {
    (holder_of(lease), lease.spec.as_ref().and_then(|s| s.renew_time.as_ref()))
}

/// Whether an address of `span` was picked here and is still in flight: pending, and not
/// yet shown recorded by the view (a recorded one is stored, whether or not the next tick
/// has settled it yet).
fn in_flight(recorded: &HashSet<IpAddr>, st: &State, cidr: &ServiceCidr, span: &BlockSpan) -> bool {
    st.pending.keys().any(|ip| !recorded.contains(ip) && span.covers(cidr, *ip))
}

/// Who asks for a block through `lease` (see [`WANTED_ANNOTATION`]).
fn wanted_by(lease: &Lease) -> Option<&str> {
    lease.metadata.annotations.as_ref()?.get(WANTED_ANNOTATION).map(String::as_str)
}

fn without_request(lease: &mut Lease) {
    if let Some(a) = lease.metadata.annotations.as_mut() {
        a.remove(WANTED_ANNOTATION);
    }
}

/// How one try at a block went.
enum Attempt {
    Got,
    /// Another replica changed the block Leases meanwhile: look again.
    Raced,
    /// No free or expired block.
    NoneFree,
}

enum Renewal {
    Renewed,
    Lost,
    Failed,
}

/// Why a block is being taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    /// An admission waits for it (or the replica holds none of the range).
    Now,
    /// The replica runs low; its blocks still answer.
    Ahead,
}

/// Whether `ip` is taken: recorded (per the view `recorded`), picked here and not yet
/// seen recorded, or recorded per a held block's consistent list.
fn taken(recorded: &HashSet<IpAddr>, st: &State, ip: IpAddr) -> bool {
    recorded.contains(&ip) || st.pending.contains_key(&ip) || st.held.iter().any(|h| h.listed.contains(&ip))
}

/// A free block index: a random dynamic one not in `busy`, else the first free static one.
fn free_block(busy: &HashSet<u64>, dynamic: u64, total: u64) -> Option<u64> {
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

/// Answer hand-over requests as soon as the watch of the namespace's Leases shows them (the
/// tick answers them too, at its pace).
async fn answer_requests(weak: Weak<BlockStore>, leases: Api<Lease>) {
    super::fold::fold(leases, "address block Lease", Lease::clone, move |change| {
        let leases = match change {
            Change::Replace(all) => all,
            Change::Apply(lease) => vec![lease],
            Change::Delete(_) => return,
        };
        let Some(me) = weak.upgrade() else { return };
        for lease in leases {
            if me.asks_us(&lock(&me.state), &lease) {
                let me = me.clone();
                tokio::spawn(async move { me.answer_request(lease).await });
            }
        }
    })
    .await
}

async fn tick_forever(weak: Weak<BlockStore>, every: Duration) {
    let mut interval = tokio::time::interval(every);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await;
    loop {
        interval.tick().await;
        let Some(me) = weak.upgrade() else { return };
        let r = me.tick().await;
        if !r.given_back.is_empty() {
            debug!(blocks = ?r.given_back, "gave idle address blocks back");
        }
    }
}

#[async_trait]
impl AllocationStore for BlockStore {
    fn backend(&self) -> &'static str {
        super::BackendKind::Ipaddress.as_str()
    }

    fn ranges(&self) -> Vec<ServiceCidr> {
        self.ranges.cidrs().to_vec()
    }

    /// A requested address: refused when the view shows it recorded or this replica has it
    /// pending (the admission then reads the apiserver's record to decide); otherwise held
    /// pending here, so this replica never picks it dynamically, until the view shows it.
    async fn allocate(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<(), StoreError> {
        self.ranges.index_of(ip)?;
        let mut st = lock(&self.state);
        if self.taken(&st, ip) {
            return Err(StoreError::Alloc(AllocError::Allocated));
        }
        st.pending.insert(ip, Pending { parent: parent.cloned() });
        Ok(())
    }

    async fn allocate_next(&self, family: Family, parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        let ranges = self.ranges.of_family(family)?;
        for range in ranges {
            loop {
                let (ip, low) = self.pick(range, parent);
                if low {
                    // Take the next block ahead of need, unless one is being taken already —
                    // on the runtime the store was opened on: the answer's own runtime (the
                    // webhook's thread) is not held by a Lease write and a list of every
                    // IPAddress.
                    if let Some(me) = self.me.upgrade() {
                        self.runtime.spawn(async move {
                            let Ok(_one) = me.acquiring[range].try_lock() else { return };
                            if let Err(e) = me.acquire_locked(range, Need::Ahead).await {
                                warn!(error = %e, "could not take another address block ahead of need");
                            }
                        });
                    }
                }
                if let Some(ip) = ip {
                    return Ok(ip);
                }
                // Nothing free in our blocks: wait for a block (ours, or one another request
                // is taking right now), then look again.
                let _one = self.acquiring[range].lock().await;
                let (ip, _) = self.pick(range, parent);
                if let Some(ip) = ip {
                    return Ok(ip);
                }
                if !self.acquire_locked(range, Need::Now).await? && !self.ask_for_block(range).await? {
                    break;
                }
            }
        }
        Err(StoreError::Alloc(AllocError::Full))
    }

    /// A Service gave the address up (the Service reconciler, after reading that the
    /// apiserver no longer records it): forget it as listed. A pick pending for a newer
    /// admission stays.
    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        let mut st = lock(&self.state);
        for h in st.held.iter_mut() {
            h.listed.remove(&ip);
        }
        Ok(())
    }

    /// The admission that answered `ip` for `owner` gives it back (its request failed, or
    /// the apiserver never recorded it within the in-flight limit).
    async fn release_owned(&self, ip: IpAddr, owner: &ParentRef) -> Result<(), StoreError> {
        let mut st = lock(&self.state);
        if st.pending.get(&ip).is_some_and(|p| p.parent.as_ref().is_none_or(|p| p == owner)) {
            st.pending.remove(&ip);
        }
        Ok(())
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        Ok(self.taken(&lock(&self.state), ip))
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        let st = lock(&self.state);
        let mut all: Vec<IpAddr> = self.recorded.snapshot();
        all.extend(st.pending.keys().copied());
        all.extend(st.held.iter().flat_map(|h| h.listed.iter().copied()));
        all.retain(|ip| self.range_of_block(*ip).is_some());
        all.sort();
        all.dedup();
        Ok(all)
    }

    fn unreadable(&self) -> Vec<super::Unreadable> {
        self.recorded.unreadable()
    }

    /// One bounded round trip to the kube-apiserver (the kube client has no read timeout):
    /// a one-item list of the block Leases.
    async fn ready(&self) -> Result<(), StoreError> {
        let one = ListParams::default().labels(BLOCK_LABEL).limit(1);
        match tokio::time::timeout(READY_TIMEOUT, self.leases.list_metadata(&one)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(api_err("listing address block Leases", e)),
            Err(_) => Err(StoreError::Unavailable(format!("listing address block Leases: the kube-apiserver did not answer within {READY_TIMEOUT:?}").into())),
        }
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        let all = self.allocated().await?;
        Ok(self
            .ranges
            .cidrs()
            .iter()
            .map(|c| {
                let used = all.iter().filter(|ip| c.contains(**ip)).count() as u64;
                RangeUsage { cidr: c.clone(), used, free: c.size().saturating_sub(used), pooled: 0 }
            })
            .collect())
    }

    /// Give back every block with no pick pending (the others expire after the lease
    /// duration, once their answers are stored or failed).
    async fn close(&self) -> Result<(), StoreError> {
        lock(&self.tasks).abort_all();
        let chosen: Vec<(String, Lease)> = {
            let mut st = lock(&self.state);
            let pending: Vec<IpAddr> = st.pending.keys().copied().collect();
            let cidrs = self.ranges.cidrs();
            let mut out = Vec::new();
            for h in st.held.iter_mut() {
                h.returning = true;
                let busy = pending.iter().any(|ip| h.span.covers(&cidrs[h.range], *ip));
                if !busy {
                    out.push((h.name.clone(), h.lease.clone()));
                }
            }
            out
        };
        for (name, lease) in chosen {
            if self.give_back_lease(&name, &lease).await {
                lock(&self.state).held.retain(|h| h.name != name);
            }
        }
        Ok(())
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
    fn a_holder_stops_picking_a_margin_before_anyone_may_take_over() {
        let t0 = Instant::now();
        let (d, m) = (Duration::from_secs(120), Duration::from_secs(75));
        assert!(usable(t0, t0 + Duration::from_secs(44), d, m));
        assert!(!usable(t0, t0 + Duration::from_secs(45), d, m));
        // An observer that saw the renewal at or after it was sent takes over no earlier
        // than 120 s later: 75 s after the holder's last possible pick.
        assert!(!expired(t0, t0 + Duration::from_secs(119), d));
        assert!(expired(t0, t0 + d, d));
        // A clock that seems to run backwards never expires anything.
        assert!(!expired(t0 + d, t0, d));
    }

    #[test]
    fn options_refuse_a_margin_that_leaves_no_window() {
        assert!(BlockOptions::new(Some(256), Duration::from_secs(120), Duration::from_secs(120)).is_err());
        assert!(BlockOptions::new(Some(0), Duration::from_secs(120), Duration::from_secs(75)).is_err());
        assert!(BlockOptions::new(Some(65537), Duration::from_secs(120), Duration::from_secs(75)).is_err());
        let o = BlockOptions::new(None, Duration::from_secs(120), Duration::from_secs(75)).expect("defaults");
        assert_eq!(o.renew_every, Some(Duration::from_millis(11_250)));
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
}
