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
//!   (*pending*, until the view shows the IPAddress and the pick is `SETTLE` old, or the
//!   admission gives the address back). Nothing cluster-wide is written per admission.
//! - **Renewal and the margin.** The holder renews each Lease every `renew_every` (an update
//!   with the Lease's resourceVersion as precondition) and picks from a block only while the
//!   last renewal it saw confirmed was *sent* less than `lease_duration − margin` ago, on its
//!   own clock ([`book::usable`]). A renewal refused (409: someone took the block over;
//!   404) drops the block at once.
//! - **Takeover.** Another replica takes a block over only after it has itself observed the
//!   Lease with the same resourceVersion for the whole `lease_duration`, on its own
//!   clock ([`crate::k8s::lease::Observation`], shared with the leader election) — never by
//!   comparing the Lease's timestamps with its clock — and then with an update carrying that resourceVersion as precondition.
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
//! in flight (pending and not yet recorded): a block given back with an answered, unrecorded address could be taken by a
//! replica whose consistent list does not show it yet.

//! Layers: `layout.rs` (block math and the Lease's shape) → `book.rs` (the pure book: every
//! decision, instants of the injected [`Clock`] as inputs) → this shell (reads the clock,
//! calls the kube-apiserver through the thin `client.rs`, reports outcomes to the book).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::Api;
use kube::Client;
use rand::Rng;
use tracing::{debug, info, warn};

use crate::alloc::AllocError;
use crate::cidr::{Family, ServiceCidr};
use crate::clock::{Clock, Moment};
use crate::k8s::lease::holder as holder_of;

use super::apiserver_ips::ApiserverIps;
use crate::store::fold::Change;
use crate::store::{AllocationStore, ParentRef, RangeSet, RangeUsage, StoreError};
use crate::sync::lock;

pub mod book;
pub mod client;
#[cfg(test)]
mod fake;
pub mod layout;
#[cfg(test)]
mod tests;

use book::{Book, GiveBack, Need, Next, LEAD_BLOCKS};
use client::{BlockApi, Bounded, CallError, KubeBlockApi};
pub use layout::*;

/// The lock one range's block acquisitions take turns on.
type Acquiring = Arc<tokio::sync::Mutex<()>>;

/// How long `/readyz` waits for the kube-apiserver (the Deployment's probe gives up after 2 s).
const READY_TIMEOUT: Duration = Duration::from_millis(1500);

/// How often a replica waiting for a hand-over looks at the block Leases again.
const HANDOVER_POLL: Duration = Duration::from_millis(100);
/// Default lease duration of a block: how long an observer watches an unchanged Lease
/// before it takes the block over.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(120);
/// Default margin: a holder stops picking from a block this long before an observer could
/// take it over. Must exceed the longest an answered request can stay unstored (the
/// apiserver's request timeout, 60 s by default).
pub const DEFAULT_MARGIN: Duration = Duration::from_secs(75);

/// Fewer blocks than this in a range: warned about at start (see [`BlockStore::open`]).
const FEW_BLOCKS: u64 = 4;

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

    /// How long one call to the kube-apiserver may take: a quarter of the usable window
    /// (`lease_duration − margin`), at most 10 s — so a holder gets several renewals in
    /// before it must stop answering, and an admission waiting for a block is not held
    /// longer than a webhook timeout or two.
    pub fn call_timeout(&self) -> Duration {
        (self.lease_duration.saturating_sub(self.margin) / 4).clamp(Duration::from_millis(100), Duration::from_secs(10))
    }
}

/// Service addresses from exclusively held blocks; see the module docs.
pub struct BlockStore {
    api: Arc<dyn BlockApi>,
    clock: Arc<dyn Clock>,
    /// The `--service-cidr` ranges: always allocatable, tried first.
    flag_ranges: Vec<ServiceCidr>,
    /// Addresses per block; None: [`auto_block_size`] of each range.
    size: Option<u64>,
    recorded: ApiserverIps,
    /// The book; it also holds the ranges (every one known, by index).
    book: Mutex<Book>,
    /// One acquisition at a time per range (by the book's range index).
    acquiring: Mutex<Vec<Acquiring>>,
    /// One hand-over at a time.
    handing: tokio::sync::Mutex<()>,
    me: Weak<BlockStore>,
    /// The background task (renew, observe, answer hand-over requests); aborted on drop.
    tasks: Mutex<tokio::task::JoinSet<()>>,
    /// The runtime [`BlockStore::open`] ran on: background work goes there.
    runtime: tokio::runtime::Handle,
    /// What the protocol did since start ([`AllocationStore::block_events`]).
    events: Events,
}

/// Counts of the block protocol's events on this replica since it started, by
/// [`EVENTS`]' names (`clusterip_address_block_events_total{event}`).
#[derive(Debug, Default)]
struct Events([AtomicU64; 6]);

/// The events counted: a block taken by creating its Lease; taken over from a holder that
/// stopped renewing; a stopped holder's Lease of another range or size deleted; handed over
/// at another replica's request; given back (idle, retired range, shutdown); lost (taken
/// over or deleted while held).
pub const EVENTS: [&str; 6] = ["created", "taken_over", "deleted_stale", "handed_over", "given_back", "lost"];

impl Events {
    fn count(&self, event: &str) {
        if let Some(i) = EVENTS.iter().position(|e| *e == event) {
            self.0[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    fn read(&self) -> Vec<(&'static str, u64)> {
        EVENTS.iter().zip(&self.0).map(|(e, n)| (*e, n.load(Ordering::Relaxed))).collect()
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

enum Renewal {
    Renewed,
    Lost,
    Failed,
}

impl BlockStore {
    /// Blocks of `ranges` held through Leases in `namespace`, beside the cluster's IPAddress
    /// view `recorded` (already synced). `identity` names the replica in the Leases.
    pub async fn open(client: Client, namespace: &str, ranges: Vec<ServiceCidr>, recorded: ApiserverIps, identity: &str, options: BlockOptions) -> Result<Arc<Self>, StoreError> {
        let api = KubeBlockApi::new(client, namespace);
        let leases = api.leases.clone();
        let me = Self::start(Arc::new(api), crate::clock::system(), ranges, recorded, identity, options.clone()).await?;
        if options.renew_every.is_some() {
            lock(&me.tasks).spawn(answer_requests(Arc::downgrade(&me), leases));
        }
        me.take_lead().await;
        Ok(me)
    }

    /// The store on `api` and `clock`, its book filled from a first look at the block Leases
    /// (no block taken yet).
    async fn start(api: Arc<dyn BlockApi>, clock: Arc<dyn Clock>, ranges: Vec<ServiceCidr>, recorded: ApiserverIps, identity: &str, options: BlockOptions) -> Result<Arc<Self>, StoreError> {
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
        let acquiring = Mutex::new(ranges.iter().map(|_| Acquiring::default()).collect());
        let book = Book::new(holder, ranges.clone(), sizes, options.lease_duration, options.margin);
        let api: Arc<dyn BlockApi> = Arc::new(Bounded::new(api, options.call_timeout()));
        let me = Arc::new_cyclic(|weak| BlockStore {
            api,
            clock,
            flag_ranges: ranges,
            size: options.size,
            recorded,
            book: Mutex::new(book),
            acquiring,
            handing: tokio::sync::Mutex::new(()),
            me: weak.clone(),
            tasks: Mutex::default(),
            runtime: tokio::runtime::Handle::current(),
            events: Events::default(),
        });
        me.observe().await?;
        if let Some(every) = options.renew_every {
            lock(&me.tasks).spawn(tick_forever(Arc::downgrade(&me), every));
        }
        Ok(me)
    }

    /// The lead up front ([`LEAD_BLOCKS`] blocks per range, the ones after the first only
    /// while two are free), so a burst right after start is answered from memory while
    /// the next block is taken. With one block, the first pick started that acquisition
    /// and a 500-create burst could use the block up before it landed: admissions then
    /// waited for it (`scripts/bench-webhook.sh`: mutate p99 122 and 617 ms in two of
    /// four runs).
    async fn take_lead(&self) {
        let ranges = lock(&self.book).allocatable_cidrs().len();
        for range in 0..ranges {
            let one = self.acquiring(range);
            let _one = one.lock().await;
            for k in 0..LEAD_BLOCKS {
                let need = if k == 0 { Need::Now } else { Need::Ahead };
                match self.acquire_locked(range, need).await {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        warn!(range = %self.cidr(range), error = %e, "could not take an address block yet; trying again on the first admission");
                        break;
                    }
                }
            }
        }
    }

    /// The holderIdentity this replica writes.
    pub fn holder(&self) -> String {
        lock(&self.book).holder().to_string()
    }

    /// Names of the blocks this replica holds and may pick from now.
    pub fn held_blocks(&self) -> Vec<String> {
        let now = self.clock.now();
        lock(&self.book).usable_blocks(now)
    }

    fn now(&self) -> Moment {
        self.clock.now()
    }

    /// Pick a free address of range `range` from a usable block, in memory (see
    /// [`Book::pick`]).
    fn pick(&self, range: usize, parent: Option<&ParentRef>) -> (Option<IpAddr>, bool) {
        let now = self.now();
        let mut book = lock(&self.book);
        // One read of the view for the whole pick: the watch writes to it while a burst's
        // IPAddresses arrive, and a pick looks at up to every address of its blocks.
        let recorded = self.recorded.view();
        book.pick(range, parent, &recorded.addresses, &recorded.released, now)
    }

    /// Take one more block of `range` (see [`Book::next_block`]). Ok(false) when every
    /// block is held. The caller holds `acquiring[range]`.
    async fn acquire_locked(&self, range: usize, need: Need) -> Result<bool, StoreError> {
        for _attempt in 0..8 {
            let next = lock(&self.book).next_block(range, need, self.now());
            let got = match next {
                Next::NoneFree => return Ok(false),
                Next::TakeOver { name, lease, span } => self.take_over(range, &name, *lease, span).await?,
                Next::Create { index } => self.create(range, index).await?,
            };
            if got {
                return Ok(true);
            }
            // Someone else was quicker: look again.
            self.observe().await?;
        }
        let cidr = self.cidr(range);
        Err(StoreError::Unavailable(format!("could not take an address block of {cidr}: others took each one tried first").into()))
    }

    /// Every block of `range` is held and this replica's are used up: ask the holder of the
    /// block with the most room (per this replica's view) to hand one over — the
    /// `clusterip.allocator/wanted-by` annotation on that Lease — and take the block it gives
    /// back, looking again every [`HANDOVER_POLL`] for up to [`book::HANDOVER_WAIT`] (not again
    /// within that long of a wait that got nothing). The caller holds `acquiring[range]`.
    /// Ok(false): nothing was handed over in time.
    async fn ask_for_block(&self, range: usize) -> Result<bool, StoreError> {
        let target = {
            let book = lock(&self.book);
            let recorded = self.recorded.view();
            book.hand_over_target(range, &recorded, self.now())
        };
        let Some((name, asked)) = target else { return Ok(false) };
        if !asked {
            let holder = self.holder();
            match self.api.ask_for_block(&name, &holder).await {
                Ok(()) => debug!(block = %name, "asked the holder of an address block to hand one over"),
                // Gone or changed: looked at again below.
                Err(e) if matches!(e.code(), Some(404 | 409)) => {}
                // (E.g. no patch permission: deploy/rbac.yaml before the hand-over.) The
                // range stays as full to this replica as it was without asking.
                Err(e) => {
                    warn!(block = %name, error = %e, "could not ask for an address block to be handed over");
                    lock(&self.book).request_ended(range, false, self.now());
                    return Ok(false);
                }
            }
        }
        let deadline = tokio::time::Instant::now() + book::HANDOVER_WAIT;
        while tokio::time::Instant::now() < deadline {
            tokio::time::sleep(HANDOVER_POLL).await;
            self.observe().await?;
            let next = lock(&self.book).next_block(range, Need::Now, self.now());
            let got = match next {
                Next::NoneFree => false,
                Next::TakeOver { name, lease, span } => self.take_over(range, &name, *lease, span).await?,
                Next::Create { index } => self.create(range, index).await?,
            };
            if got {
                lock(&self.book).request_ended(range, true, self.now());
                return Ok(true);
            }
        }
        lock(&self.book).request_ended(range, false, self.now());
        Ok(false)
    }

    fn block_lease(&self, range: usize, span: BlockSpan) -> Lease {
        let holder = self.holder();
        let d = lock(&self.book).lease_duration();
        block_lease(&self.cidr(range), span, &holder, d, now_micro())
    }

    /// Create the Lease of a free block. Ok(false): someone else created it first.
    async fn create(&self, range: usize, index: u64) -> Result<bool, StoreError> {
        let cidr = self.cidr(range);
        let Some(span) = span(&cidr, lock(&self.book).size(range), index) else { return Ok(false) };
        let name = block_name(&cidr, index);
        let sent = self.now();
        lock(&self.book).claiming(&name, true);
        let r = self.create_claimed(range, span, &name, sent).await;
        lock(&self.book).claiming(&name, false);
        r
    }

    async fn create_claimed(&self, range: usize, span: BlockSpan, name: &str, sent: Moment) -> Result<bool, StoreError> {
        match self.api.create_lease(&self.block_lease(range, span)).await {
            Ok(lease) => {
                if !self.alone(range, span, name, &lease).await? {
                    return Ok(false);
                }
                self.adopt(range, span, lease, sent).await?;
                self.events.count("created");
                Ok(true)
            }
            Err(e) if e.code() == Some(409) => Ok(false),
            Err(e) => Err(e.store(&format!("creating the Lease of address block {name}"))),
        }
    }

    /// Take over a block whose Lease this replica observed unchanged for the lease
    /// duration: an update with the observed resourceVersion as precondition. A Lease that
    /// names other addresses than our block of that name (written by a replica with another
    /// block size) is deleted instead, with the same precondition: its holder is gone and
    /// everything it answered is stored or failed (see the module docs), so its addresses
    /// are free blocks again.
    async fn take_over(&self, range: usize, name: &str, old: Lease, seen: BlockSpan) -> Result<bool, StoreError> {
        let previous = holder_of(&old).unwrap_or_default().to_string();
        let mine = lock(&self.book).own_span(range, name, &seen);
        let Some(span) = mine else {
            match self.api.delete_lease(name, &old).await {
                Ok(()) => {
                    info!(block = %name, %previous, "deleted an address block of another size its holder stopped renewing");
                    self.events.count("deleted_stale");
                }
                Err(e) if matches!(e.code(), Some(404 | 409)) => {}
                Err(e) => return Err(e.store(&format!("deleting address block {name}"))),
            }
            lock(&self.book).forget(name);
            return Ok(false);
        };
        let mut lease = self.block_lease(range, span);
        lease.metadata.resource_version = old.metadata.resource_version.clone();
        let transitions = old.spec.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0);
        if let Some(spec) = lease.spec.as_mut() {
            spec.lease_transitions = Some(transitions.saturating_add(1));
        }
        let sent = self.now();
        lock(&self.book).claiming(name, true);
        let r = self.take_over_claimed(range, span, name, lease, sent, &previous).await;
        lock(&self.book).claiming(name, false);
        r
    }

    async fn take_over_claimed(&self, range: usize, span: BlockSpan, name: &str, lease: Lease, sent: Moment, previous: &str) -> Result<bool, StoreError> {
        match self.api.replace_lease(name, &lease).await {
            Ok(lease) => {
                lock(&self.book).forget(name);
                if !self.alone(range, span, name, &lease).await? {
                    return Ok(false);
                }
                info!(block = %name, %previous, "took over an address block its holder stopped renewing");
                self.adopt(range, span, lease, sent).await?;
                self.events.count("taken_over");
                Ok(true)
            }
            // Changed meanwhile (renewed, or taken by someone else), or gone.
            Err(e) if matches!(e.code(), Some(404 | 409)) => {
                lock(&self.book).forget(name);
                Ok(false)
            }
            Err(e) => Err(e.store(&format!("taking over address block {name}"))),
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
        let other = lock(&self.book).overlapping(range, &span);
        let Some(other) = other else { return Ok(true) };
        info!(block = %name, %other, "another replica's address block shares addresses with the one just taken: giving it back");
        self.give_back_lease(name, lease).await;
        Ok(false)
    }

    /// A block is ours: list the IPAddresses with a consistent read before answering from
    /// it, so that whatever the previous holder answered and the apiserver stored is seen
    /// whatever our watch shows.
    async fn adopt(&self, range: usize, span: BlockSpan, lease: Lease, sent: Moment) -> Result<(), StoreError> {
        let cidr = &self.cidr(range);
        let name = block_name(cidr, span.index);
        let listed = match self.api.list_addresses().await {
            Ok(l) => l,
            Err(e) => {
                // Not usable without a fresh view: hand it back (or let it expire).
                self.give_back_lease(&name, &lease).await;
                return Err(e.store("listing IPAddresses after taking an address block"));
            }
        };
        let listed: HashSet<IpAddr> = listed.into_iter().filter(|ip| span.covers(cidr, *ip)).collect();
        debug!(block = %name, recorded = listed.len(), "address block taken");
        let cursor = span.first + rand::thread_rng().gen_range(0..span.end - span.first);
        let now = self.now();
        lock(&self.book).adopt(range, span, name, lease, sent, listed, cursor, now);
        Ok(())
    }

    /// Delete a block Lease of ours, with its uid and resourceVersion as preconditions. A
    /// conflict whose read still shows this process as the holder (a hand-over request
    /// changed the Lease) is tried once more with the resourceVersion read.
    /// A delete that got no answer (or one that does not say) is [`GiveBack::Unknown`]: it may
    /// have been applied.
    async fn give_back_lease(&self, name: &str, lease: &Lease) -> GiveBack {
        let holder = self.holder();
        let mut lease = lease.clone();
        for _ in 0..2 {
            match self.api.delete_lease(name, &lease).await {
                Ok(()) => return GiveBack::Gone,
                Err(e) if e.code() == Some(404) => return GiveBack::Gone,
                Err(e) if e.code() == Some(409) => match self.api.get_lease(name).await {
                    Ok(Some(cur)) if holder_of(&cur) == Some(holder.as_str()) => lease = cur,
                    Ok(_) => return GiveBack::Gone,
                    Err(e) => {
                        warn!(block = %name, error = %e, "could not read an address block Lease after its give-back conflicted; not answering from it until its state is known");
                        return GiveBack::Unknown;
                    }
                },
                Err(CallError::Unknown(e)) => {
                    warn!(block = %name, error = %e, "giving an address block back got no answer; not answering from it until its state is known");
                    return GiveBack::Unknown;
                }
                Err(e) => {
                    warn!(block = %name, error = %e, "could not give an address block back; it expires instead");
                    return GiveBack::Kept;
                }
            }
        }
        warn!(block = %name, "could not give an address block back (it kept changing); it expires instead");
        GiveBack::Kept
    }

    /// List the block Leases of our ranges and note, on this replica's clock, since when
    /// each one held by another replica has kept its holder's last renewal. Returns the
    /// Leases held here that carry a hand-over request not answered yet.
    async fn observe(&self) -> Result<Vec<Lease>, StoreError> {
        let list = self.api.list_leases().await.map_err(|e| e.store("listing address block Leases"))?;
        let now = self.now();
        let looked = lock(&self.book).looked(list, now);
        for orphan in looked.orphans {
            let Some(name) = orphan.metadata.name.clone() else { continue };
            if self.give_back_lease(&name, &orphan).await == GiveBack::Gone {
                info!(block = %name, "deleted a block Lease of this replica it did not hold (a create or give-back whose answer was lost)");
            }
        }
        for stale in looked.stale {
            let (Some(name), previous) = (stale.metadata.name.clone(), holder_of(&stale).unwrap_or_default().to_string()) else { continue };
            // Only as last seen (uid and resourceVersion): a renewal meanwhile keeps it.
            match self.api.delete_lease(&name, &stale).await {
                Ok(()) => {
                    info!(block = %name, %previous, "deleted an address block Lease of a range that is no longer ours, its holder stopped renewing");
                    self.events.count("deleted_stale");
                }
                Err(e) if matches!(e.code(), Some(404 | 409)) => {}
                Err(e) => warn!(block = %name, error = %e, "could not delete a stale address block Lease of another range; trying again after the lease duration"),
            }
        }
        Ok(looked.requests)
    }

    /// A change the watch of the namespace's Leases brings.
    fn on_lease_change(&self, change: Change<Lease>) {
        let leases = match change {
            Change::Replace(all) => all,
            Change::Apply(lease) => vec![lease],
            Change::Delete(lease) => {
                if let Some(block) = lock(&self.book).lease_deleted(&lease) {
                    warn!(%block, "address block Lease deleted (by hand, or with its namespace?); no longer answering from it");
                }
                return;
            }
        };
        let Some(me) = self.me.upgrade() else { return };
        for lease in leases {
            if lock(&self.book).asks_us(&lease) {
                let me = me.clone();
                tokio::spawn(async move { me.answer_request(lease).await });
            }
        }
    }

    /// Answer another replica's request for a block (`lease`: one of ours carrying it), once
    /// per resourceVersion: give back one block of that range if [`Self::hand_over`] finds
    /// one, and clear the request with a renewal if the block given back is not this one.
    /// Returns the name of the block given back.
    async fn answer_request(&self, lease: Lease) -> Option<String> {
        let _one = self.handing.lock().await;
        let name = lease.metadata.name.clone()?;
        let range = lock(&self.book).take_request(&lease)?;
        let asker = wanted_by(&lease).unwrap_or_default().to_string();
        let given = self.hand_over(range, Some(&name)).await;
        match &given {
            Some(block) => {
                info!(%block, %asker, "handed an address block over to a replica with no room left");
                self.events.count("handed_over");
            }
            None => debug!(block = %name, %asker, "no address block to hand over: each has picks pending, no room, or is the last one in use"),
        }
        if given.as_deref() != Some(name.as_str()) {
            // A renewal writes the Lease without the request.
            self.renew(&name, lease).await;
        }
        given
    }

    /// Give back the block of `range` the book chooses ([`Book::choose_hand_over`]): the one
    /// `asked` for when it can go.
    async fn hand_over(&self, range: usize, asked: Option<&str>) -> Option<String> {
        let now = self.now();
        let (name, lease) = {
            let mut book = lock(&self.book);
            let recorded = self.recorded.view();
            book.choose_hand_over(range, asked, &recorded, now)?
        };
        let outcome = self.give_back_lease(&name, &lease).await;
        lock(&self.book).given_back(&name, outcome);
        (outcome == GiveBack::Gone).then_some(name)
    }

    /// Renew the blocks held, observe the others, settle picks the view shows recorded
    /// ([`Book::settle`]), give idle blocks back. The background task runs it every `renew_every`.
    pub async fn tick(&self) -> TickResult {
        let mut result = TickResult::default();
        {
            let mut book = lock(&self.book);
            let recorded = self.recorded.view();
            book.settle(&recorded, self.now());
        }
        // Give-backs of unknown outcome: tried again until known.
        let unconfirmed = lock(&self.book).unconfirmed();
        for (name, lease) in unconfirmed {
            let outcome = self.give_back_lease(&name, &lease).await;
            lock(&self.book).given_back(&name, outcome);
        }
        let targets = lock(&self.book).to_renew();
        for (name, lease) in targets {
            match self.renew(&name, lease).await {
                Renewal::Renewed => result.renewed += 1,
                Renewal::Lost => {
                    warn!(block = %name, "address block lost (taken over or deleted); no longer answering from it");
                    lock(&self.book).drop_block(&name);
                    self.events.count("lost");
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
        let sent = self.now();
        match self.api.replace_lease(name, &lease).await {
            Ok(new) => {
                lock(&self.book).renewed(name, new, sent);
                Renewal::Renewed
            }
            Err(e) if e.code() == Some(404) => Renewal::Lost,
            Err(e) if e.code() == Some(409) => {
                // Our own earlier write may have been applied without our seeing the answer:
                // still ours if we are the holder (the nonce is this process's); then adopt
                // its resourceVersion, but not a newer confirmation time.
                let holder = self.holder();
                match self.api.get_lease(name).await {
                    Ok(Some(cur)) if holder_of(&cur) == Some(holder.as_str()) => {
                        lock(&self.book).still_ours(name, cur);
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

    /// Give back the idle blocks the book chooses ([`Book::choose_idle`]).
    async fn give_back_idle(&self) -> Vec<String> {
        let now = self.now();
        let chosen = {
            let mut book = lock(&self.book);
            let recorded = self.recorded.view();
            book.choose_idle(&recorded, now)
        };
        let mut done = Vec::new();
        for (name, lease) in chosen {
            let outcome = self.give_back_lease(&name, &lease).await;
            lock(&self.book).given_back(&name, outcome);
            if outcome == GiveBack::Gone {
                self.events.count("given_back");
                done.push(name);
            }
        }
        done
    }

    /// Range `range` (the book's index).
    fn cidr(&self, range: usize) -> ServiceCidr {
        lock(&self.book).cidr(range).clone()
    }

    /// The lock of acquisitions of range `range`.
    fn acquiring(&self, range: usize) -> Acquiring {
        let mut all = lock(&self.acquiring);
        while all.len() <= range {
            all.push(Acquiring::default());
        }
        all[range].clone()
    }

    /// The ranges to allocate from: `--service-cidr` first, then `servicecidrs` (the
    /// ranges of the cluster's ServiceCIDR objects by object name, each with whether it
    /// gives new addresses: Ready and not being deleted). A range of both kinds always gives
    /// addresses. Ranges new to this replica get blocks of their own on first need; a range
    /// that no longer gives addresses refuses new and requested addresses alike, and its
    /// blocks go back once none of their picks is in flight.
    pub fn set_servicecidrs<'a>(&self, servicecidrs: impl IntoIterator<Item = &'a [(ServiceCidr, bool)]>) {
        let wanted = crate::store::wanted_ranges(&self.flag_ranges, servicecidrs);
        let size = self.size;
        let (added, now) = {
            let mut book = lock(&self.book);
            let before = book.allocatable_cidrs();
            let added = book.set_ranges(&wanted, |c| size.unwrap_or_else(|| auto_block_size(c)));
            let now = book.allocatable_cidrs();
            for gone in before.iter().filter(|c| !now.contains(c)) {
                info!(range = %gone, "a service range no longer gives addresses (its ServiceCIDR is gone, not Ready or being deleted); its address blocks go back");
            }
            for back in now.iter().filter(|c| !before.contains(c)) {
                info!(range = %back, "a service range gives addresses (a Ready ServiceCIDR names it)");
            }
            (added, now)
        };
        for range in added {
            let _ = self.acquiring(range);
        }
        debug!(ranges = ?now.iter().map(|c| c.to_string()).collect::<Vec<_>>(), "service ranges");
    }

    /// Follow the cluster's ServiceCIDR objects (see [`Self::set_servicecidrs`]); returns once
    /// the first list is in, or with an error after `within`.
    pub async fn follow_servicecidrs(self: &Arc<Self>, api: Api<ServiceCIDR>, within: Duration) -> Result<(), StoreError> {
        let (synced_tx, mut synced) = tokio::sync::watch::channel(false);
        let weak = Arc::downgrade(self);
        lock(&self.tasks).spawn(crate::store::watch_servicecidrs(api, move |objects| {
            let Some(me) = weak.upgrade() else { return };
            me.set_servicecidrs(objects.values().map(Vec::as_slice));
            synced_tx.send_replace(true);
        }));
        let listed = tokio::time::timeout(within, synced.wait_for(|s| *s)).await.is_ok_and(|r| r.is_ok());
        if listed {
            Ok(())
        } else {
            Err(StoreError::Unavailable(format!("the ServiceCIDR objects could not be listed within {within:?}").into()))
        }
    }
}

/// Answer hand-over requests as soon as the watch of the namespace's Leases shows them (the
/// tick answers them too, at its pace).
async fn answer_requests(weak: Weak<BlockStore>, leases: Api<Lease>) {
    crate::store::fold::fold(leases, "address block Lease", Lease::clone, move |change| {
        if let Some(me) = weak.upgrade() {
            me.on_lease_change(change);
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
    fn block_events(&self) -> Vec<(&'static str, u64)> {
        self.events.read()
    }

    fn backend(&self) -> &'static str {
        crate::store::BackendKind::Ipaddress.as_str()
    }

    fn ranges(&self) -> Vec<ServiceCidr> {
        lock(&self.book).allocatable_cidrs()
    }

    fn families(&self) -> Vec<Family> {
        crate::store::families_of(&self.flag_ranges)
    }

    /// A requested address: refused when the view shows it recorded or this replica has it
    /// pending (the admission then reads the apiserver's record to decide); otherwise held
    /// pending here, so this replica never picks it dynamically ([`Book::settle`]).
    async fn allocate(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<(), StoreError> {
        let mut book = lock(&self.book);
        if book.range_of(ip).is_none() {
            RangeSet::new(book.allocatable_cidrs()).index_of(ip)?;
        }
        let recorded = self.recorded.view();
        if !book.hold_requested(ip, parent, &recorded, self.now()) {
            return Err(StoreError::Alloc(AllocError::Allocated));
        }
        Ok(())
    }

    async fn allocate_next(&self, family: Family, parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        let ranges = lock(&self.book).ranges_of(family);
        if ranges.is_empty() {
            return Err(StoreError::NoRangeForFamily(family));
        }
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
                            let one = me.acquiring(range);
                            let Ok(_one) = one.try_lock() else { return };
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
                let one = self.acquiring(range);
                let _one = one.lock().await;
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
        lock(&self.book).release(ip);
        Ok(())
    }

    /// The admission that answered `ip` for `owner` gives it back (its request failed, or
    /// the apiserver never recorded it within the in-flight limit).
    async fn release_owned(&self, ip: IpAddr, owner: &ParentRef) -> Result<(), StoreError> {
        lock(&self.book).release_owned(ip, owner);
        Ok(())
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        let book = lock(&self.book);
        let recorded = self.recorded.view();
        Ok(book.taken(&recorded, ip))
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        let mut all: Vec<IpAddr> = self.recorded.snapshot();
        all.extend(lock(&self.book).held_addresses());
        let ranges = lock(&self.book).allocatable_cidrs();
        all.retain(|ip| ranges.iter().any(|c| c.contains(*ip)));
        all.sort();
        all.dedup();
        Ok(all)
    }

    fn unreadable(&self) -> Vec<crate::store::Unreadable> {
        self.recorded.unreadable()
    }

    /// One bounded round trip to the kube-apiserver (the kube client has no read timeout):
    /// a one-item list of the block Leases.
    async fn ready(&self) -> Result<(), StoreError> {
        match tokio::time::timeout(READY_TIMEOUT, self.api.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.store("listing address block Leases")),
            Err(_) => Err(StoreError::Unavailable(format!("listing address block Leases: the kube-apiserver did not answer within {READY_TIMEOUT:?}").into())),
        }
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        let all = self.allocated().await?;
        Ok(lock(&self.book)
            .allocatable_cidrs()
            .iter()
            .map(|c| {
                let used = all.iter().filter(|ip| c.contains(**ip)).count() as u64;
                RangeUsage { cidr: c.clone(), used, free: c.size().saturating_sub(used), pooled: 0, map_bytes: None }
            })
            .collect())
    }

    /// Give back every block with no pick pending (the others expire after the lease
    /// duration, once their answers are stored or failed).
    async fn close(&self) -> Result<(), StoreError> {
        lock(&self.tasks).abort_all();
        let chosen = {
            let mut book = lock(&self.book);
            let recorded = self.recorded.view();
            book.choose_close(&recorded)
        };
        for (name, lease) in chosen {
            if self.give_back_lease(&name, &lease).await == GiveBack::Gone {
                lock(&self.book).drop_block(&name);
                self.events.count("given_back");
            }
        }
        Ok(())
    }
}
