//! The book of one replica's address blocks: which blocks it holds, which addresses it
//! picked and has not seen recorded yet, which blocks of other replicas it watches — and
//! every decision of the protocol (pick, run low, take a block over or create one, ask for
//! one, hand one over, give one back, drop one lost). Pure: Leases, the IPAddress view and
//! instants of the replica's clock ([`Moment`]) in, decisions out; no I/O, no clock of its
//! own. The shell (`mod.rs`) reads the clock, makes the calls (`client.rs`) and reports
//! their outcomes back here. See the module docs of `mod.rs` for the protocol.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;

use super::layout::{block_of, blocks_overlapping, foreign_span, free_block, lease_span, layout, overlap, span, translate, wanted_by, BlockSpan};
use crate::cidr::{Family, ServiceCidr};
use crate::clock::Moment;
use crate::k8s::lease::{holder, Observation, Renewal};
use crate::store::ipaddress::apiserver_ips::{Released, SETTLE};
use crate::store::ParentRef;

/// A replica takes another block of a range, ahead of need, once its usable blocks of the
/// range have fewer free addresses than this many whole blocks. Taking a block costs a
/// Lease write and two consistent lists, which the kube-apiserver answers slowly while a
/// burst of creates saturates it: with one block's worth of lead a 500-create burst
/// (`scripts/bench-webhook.sh`) used the block up before the next one was taken, and
/// admissions waited for it (mutate p99 3.2 and 257 ms against 0.8 ms); two give the
/// acquisition the time of a whole block's picks more. A replica takes this many at start.
pub const LEAD_BLOCKS: u64 = 2;

/// How long an admission with no room waits for another replica to hand a block over.
/// Below the webhook's timeout (5 s in deploy/webhooks.yaml). After a wait that got
/// nothing, the range's next admissions within this long answer at once.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(3);

/// A holder gives its last usable block of a range away only when nothing was picked from
/// it for this long (else two replicas would pass one block back and forth).
pub const HANDOVER_IDLE: Duration = Duration::from_secs(5);

/// Why a block is being taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// An admission waits for it (or the replica holds none of the range).
    Now,
    /// The replica runs low; its blocks still answer.
    Ahead,
}

/// Which block to try next.
#[derive(Clone, Debug)]
pub enum Next {
    /// Another replica's block, seen unchanged for the lease duration: take it over with
    /// `lease` (as last seen) as precondition.
    TakeOver { name: String, lease: Box<Lease>, span: BlockSpan },
    /// Create the Lease of this free block.
    Create { index: u64 },
    /// No free or expired block (ahead of need: fewer than two free).
    NoneFree,
}

/// How a give-back (the Lease's delete) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GiveBack {
    /// The Lease is gone, or no longer ours.
    Gone,
    /// The Lease is still ours: the delete was refused.
    Kept,
    /// Not known: the delete got no answer (or one that does not say), and may have been
    /// applied — then another replica may already hold a new Lease of that name.
    Unknown,
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
    confirmed: Moment,
    /// Where the next pick starts looking.
    cursor: u64,
    /// Recorded per the consistent list made when the block was taken, until the view shows
    /// them (then the view covers them).
    listed: HashSet<IpAddr>,
    last_pick: Moment,
    /// Being given back: no picks.
    returning: bool,
    /// A give-back of it whose outcome is unknown: no picks, and the give-back is tried
    /// again until it is known.
    unconfirmed: bool,
}

/// An address answered (or requested) here: held until the view has shown it recorded
/// and [`SETTLE`] has passed since it was picked ([`Book::settle`]), or the admission gives
/// it back.
#[derive(Clone, Debug)]
struct Pending {
    parent: Option<ParentRef>,
    at: Moment,
}

/// Another replica's block as this one observes it.
#[derive(Clone, Debug)]
struct Watched {
    range: usize,
    /// The addresses its Lease names ([`lease_span`]; by index at our size if it names none).
    span: BlockSpan,
    /// Since when this replica has seen the holder's last renewal, on its own clock.
    seen: Observation<Renewal>,
    /// The Lease as last seen (its resourceVersion is a takeover's precondition).
    lease: Lease,
}

/// What one look at the block Leases found for this replica to do.
#[derive(Debug, Default)]
pub struct Looked {
    /// Leases held here that carry a hand-over request not answered yet.
    pub requests: Vec<Lease>,
    /// Leases naming this replica as holder that it neither holds nor is taking: a create
    /// or takeover whose answer was lost, a give-back that failed. Nothing was answered from
    /// them since (or ever), so they are deleted (with their uid and resourceVersion).
    pub orphans: Vec<Lease>,
    /// Block Leases of a range that shares no address with any of ours (the removed part of
    /// a shrink, the old range of a move), seen unchanged for the lease duration: their
    /// holders stopped, and nothing of ours will ever take them over or delete them as
    /// overlapping; deleted (with their uid and resourceVersion) so none is left behind.
    pub stale: Vec<Lease>,
}

/// One replica's blocks; see the module docs.
#[derive(Debug)]
pub struct Book {
    holder: String,
    /// Every range this replica has known, in the order it learnt of them: indexes stay
    /// valid for the life of the book (a range gone from the configuration is kept, not
    /// allocatable, until its blocks are given back).
    cidrs: Vec<ServiceCidr>,
    sizes: Vec<u64>,
    /// The ranges new addresses come from, in the order they are tried: `--service-cidr`
    /// first, then the ServiceCIDR objects' (see [`Book::set_ranges`]).
    order: Vec<usize>,
    lease_duration: Duration,
    margin: Duration,
    held: Vec<Held>,
    pending: HashMap<IpAddr, Pending>,
    /// Every listed block Lease of our ranges not held by us, by name.
    observed: HashMap<String, Watched>,
    /// Hand-over requests answered, by Lease name and resourceVersion: each once.
    answered: HashSet<(String, String)>,
    /// Per range, when this replica's last request for a block ended without one.
    unanswered: HashMap<usize, Moment>,
    /// Block Leases this replica is creating or taking over right now (not orphans).
    claiming: HashSet<String>,
    /// Block Leases of ranges sharing no address with ours, by name: since when each kept
    /// its holder's last renewal ([`Looked::stale`]).
    strangers: HashMap<String, Observation<Renewal>>,
}

impl Book {
    /// The book of replica `holder` (its holderIdentity) over `cidrs`, with blocks of
    /// `sizes[i]` addresses in range i.
    pub fn new(holder: String, cidrs: Vec<ServiceCidr>, sizes: Vec<u64>, lease_duration: Duration, margin: Duration) -> Book {
        let order = (0..cidrs.len()).collect();
        Book { holder, cidrs, sizes, order, lease_duration, margin, held: Vec::new(), pending: HashMap::new(), observed: HashMap::new(), answered: HashSet::new(), unanswered: HashMap::new(), claiming: HashSet::new(), strangers: HashMap::new() }
    }

    /// The ranges new addresses come from now, in the order to try them, each with whether
    /// it gives new addresses: a range not known yet is added (blocks of `size(cidr)`
    /// addresses); a known one missing from `wanted`, or not allocatable, no longer gives
    /// addresses — its blocks go back once nothing picked from them is in flight
    /// ([`Self::choose_idle`]). Returns the indexes of the ranges added.
    pub fn set_ranges(&mut self, wanted: &[(ServiceCidr, bool)], size: impl Fn(&ServiceCidr) -> u64) -> Vec<usize> {
        let mut added = Vec::new();
        let mut order = Vec::new();
        for (cidr, allocatable) in wanted {
            let range = match self.cidrs.iter().position(|c| c == cidr) {
                Some(i) => i,
                None => {
                    self.cidrs.push(cidr.clone());
                    self.sizes.push(size(cidr));
                    added.push(self.cidrs.len() - 1);
                    self.cidrs.len() - 1
                }
            };
            if *allocatable && !order.contains(&range) {
                order.push(range);
            }
        }
        self.order = order;
        added
    }

    /// Every range known, by index (allocatable or not).
    pub fn cidrs(&self) -> &[ServiceCidr] {
        &self.cidrs
    }

    /// Whether range `range` gives new addresses.
    pub fn allocatable(&self, range: usize) -> bool {
        self.order.contains(&range)
    }

    /// The allocatable ranges, in the order they are tried.
    pub fn allocatable_cidrs(&self) -> Vec<ServiceCidr> {
        self.order.iter().map(|&i| self.cidrs[i].clone()).collect()
    }

    /// The allocatable ranges of `family`, in the order they are tried.
    pub fn ranges_of(&self, family: Family) -> Vec<usize> {
        self.order.iter().copied().filter(|&i| self.cidrs[i].family() == family).collect()
    }

    /// The first allocatable range (in the order they are tried) whose usable addresses
    /// contain `ip`.
    pub fn range_of(&self, ip: IpAddr) -> Option<usize> {
        self.order.iter().copied().find(|&i| self.cidrs[i].contains(ip))
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    pub fn cidr(&self, range: usize) -> &ServiceCidr {
        &self.cidrs[range]
    }

    pub fn size(&self, range: usize) -> u64 {
        self.sizes[range]
    }

    pub fn lease_duration(&self) -> Duration {
        self.lease_duration
    }

    /// How long another replica's Lease must be seen unchanged before it is taken over or
    /// deleted: our lease duration, or the one the Lease states if longer — its holder
    /// answers until `its D − its M` after its last renewal, whatever ours is (replicas of a
    /// rolling update that changes `--address-block-lease-duration`, or of another range).
    fn expiry(&self, lease: &Lease) -> Duration {
        let stated = lease.spec.as_ref().and_then(|s| s.lease_duration_seconds).and_then(|d| u64::try_from(d).ok()).map(Duration::from_secs);
        stated.map_or(self.lease_duration, |d| d.max(self.lease_duration))
    }

    /// Whether the holder may pick from `h` at `now`: not being given back, and its last
    /// confirmed renewal sent less than `lease_duration − margin` ago.
    fn usable(&self, h: &Held, now: Moment) -> bool {
        !h.returning && usable(h.confirmed, now, self.lease_duration, self.margin)
    }

    /// Names of the blocks held and usable at `now`.
    pub fn usable_blocks(&self, now: Moment) -> Vec<String> {
        self.held.iter().filter(|h| self.usable(h, now)).map(|h| h.name.clone()).collect()
    }

    /// Whether `ip` is taken: recorded (per the view `recorded`), picked here and not yet
    /// seen recorded, or recorded per a held block's consistent list.
    pub fn taken(&self, recorded: &HashSet<IpAddr>, ip: IpAddr) -> bool {
        recorded.contains(&ip) || self.pending.contains_key(&ip) || self.held.iter().any(|h| h.listed.contains(&ip))
    }

    /// A requested address: false when taken; else held pending here from `now`, so that
    /// this replica never picks it (see [`Self::settle`]).
    pub fn hold_requested(&mut self, ip: IpAddr, parent: Option<&ParentRef>, recorded: &HashSet<IpAddr>, now: Moment) -> bool {
        if self.taken(recorded, ip) {
            return false;
        }
        self.pending.insert(ip, Pending { parent: parent.cloned(), at: now });
        true
    }

    /// Pick a free address of range `range` from a usable block: a settled one (none that
    /// left the view within [`SETTLE`]) from each block's cursor on, else the one that left
    /// the view longest ago (`apiserver_ips`: the kube-apiserver's repair controller may
    /// record a just-released address again in the moments after). Returns the address and
    /// whether the replica runs low: less than [`LEAD_BLOCKS`] whole blocks' worth of
    /// settled addresses left in its usable blocks of the range, so the next block is taken
    /// while these still answer.
    pub fn pick(&mut self, range: usize, parent: Option<&ParentRef>, recorded: &HashSet<IpAddr>, released: &Released, now: Moment) -> (Option<IpAddr>, bool) {
        if !self.allocatable(range) {
            return (None, false);
        }
        let cidr = &self.cidrs[range];
        let settled = |ip: &IpAddr| released.settling_since(*ip, now).is_none();
        let mut chosen = None;
        for (i, h) in self.held.iter().enumerate() {
            if h.range != range || !self.usable(h, now) {
                continue;
            }
            let (first, len, cursor) = (h.span.first, h.span.end - h.span.first, h.cursor);
            chosen = (0..len).map(|k| first + (cursor - first + k) % len).find_map(|off| cidr.ip_at(off).filter(|ip| settled(ip) && !self.taken(recorded, *ip)).map(|ip| (i, off, ip)));
            if chosen.is_some() {
                break;
            }
        }
        if chosen.is_none() {
            // Every free address is settling: the one released longest ago.
            chosen = self
                .held
                .iter()
                .enumerate()
                .filter(|(_, h)| h.range == range && self.usable(h, now))
                .flat_map(|(i, h)| (h.span.first..h.span.end).filter_map(move |off| cidr.ip_at(off).map(|ip| (i, off, ip))))
                .filter(|(_, _, ip)| !self.taken(recorded, *ip))
                .min_by_key(|(_, _, ip)| released.settling_since(*ip, now));
        }
        if let Some((i, off, ip)) = chosen {
            let h = &mut self.held[i];
            h.cursor = if off + 1 >= h.span.end { h.span.first } else { off + 1 };
            h.last_pick = now;
            self.pending.insert(ip, Pending { parent: parent.cloned(), at: now });
        }
        let low = !self.has_free(recorded, range, now, None, LEAD_BLOCKS * self.sizes[range], &settled);
        (chosen.map(|c| c.2), low)
    }

    /// Whether the usable blocks of `range` (all but the one named `except`) have at least
    /// `want` free addresses that `count`s. Counting stops at `want`, so an answer looks at
    /// about one block's worth of addresses, not at every address the replica holds.
    fn has_free(&self, recorded: &HashSet<IpAddr>, range: usize, now: Moment, except: Option<&str>, want: u64, count: &dyn Fn(&IpAddr) -> bool) -> bool {
        let cidr = &self.cidrs[range];
        let mut found = 0;
        for h in self.held.iter().filter(|h| h.range == range && self.usable(h, now) && Some(h.name.as_str()) != except) {
            for off in h.span.first..h.span.end {
                if found >= want {
                    return true;
                }
                if cidr.ip_at(off).is_some_and(|ip| count(&ip) && !self.taken(recorded, ip)) {
                    found += 1;
                }
            }
        }
        found >= want
    }

    /// Which block of `range` to try next: one observed unchanged for the lease duration
    /// (its holder gone) first, else a random free dynamic block, else a free static one.
    /// Ahead of need, a free block only while at least two are free: the last one is left
    /// to a replica that has none.
    pub fn next_block(&self, range: usize, need: Need, now: Moment) -> Next {
        let cidr = &self.cidrs[range];
        let size = self.sizes[range];
        let (dynamic, total) = layout(cidr, size);
        let mut busy: HashSet<u64> = self.held.iter().filter(|h| h.range == range).map(|h| h.span.index).collect();
        // Our blocks of overlapping ranges (ServiceCIDR objects may overlap), by address.
        for h in self.held.iter().filter(|h| h.range != range) {
            if let Some(s) = translate(&self.cidrs[h.range], &h.span, cidr) {
                busy.extend(blocks_overlapping(cidr, size, &s));
            }
        }
        // Other replicas' blocks by the addresses their Leases name, whatever their size
        // and whichever of our ranges they were cut from.
        let mut expired: Option<(&String, BlockSpan)> = None;
        for (name, o) in &self.observed {
            let Some(s) = translate(&self.cidrs[o.range], &o.span, cidr) else { continue };
            busy.extend(blocks_overlapping(cidr, size, &s));
            if o.seen.expired(now, self.expiry(&o.lease)) && expired.is_none_or(|(_, e)| s.first < e.first) {
                expired = Some((name, s));
            }
        }
        if let Some((name, s)) = expired {
            // A block of another of our ranges is never taken over as one of this range's
            // (`own_span` is None for it): its Lease is deleted, and the addresses it named
            // become free blocks.
            let o = &self.observed[name];
            let span = if o.range == range { o.span } else { s };
            return Next::TakeOver { name: name.clone(), lease: Box::new(o.lease.clone()), span };
        }
        if need == Need::Ahead && total.saturating_sub(busy.len() as u64) < 2 {
            return Next::NoneFree;
        }
        match free_block(&busy, dynamic, total) {
            Some(index) => Next::Create { index },
            None => Next::NoneFree,
        }
    }

    /// The block `name` of ours at our size, if the Lease `lease` of another replica names
    /// exactly its addresses (else it was written at another block size).
    pub fn own_span(&self, range: usize, name: &str, seen: &BlockSpan) -> Option<BlockSpan> {
        let mine = block_of(&self.cidrs, name).filter(|(r, _)| *r == range).and_then(|(_, index)| span(&self.cidrs[range], self.sizes[range], index));
        mine.filter(|s| s.first == seen.first && s.end == seen.end)
    }

    /// Every block of `range` is held and ours are used up: whose block to ask for one — the
    /// block with the most room per the view, and whether we asked already. None: no one
    /// to ask, or a request of ours ended without a block less than [`HANDOVER_WAIT`] ago.
    pub fn hand_over_target(&self, range: usize, recorded: &HashSet<IpAddr>, now: Moment) -> Option<(String, bool)> {
        if self.unanswered.get(&range).is_some_and(|t| now.saturating_duration_since(*t) < HANDOVER_WAIT) {
            return None;
        }
        let cidr = &self.cidrs[range];
        self.observed
            .iter()
            .filter(|(_, o)| o.range == range && !o.seen.expired(now, self.lease_duration))
            .map(|(name, o)| (o.span.free(cidr, |ip| recorded.contains(&ip)), name, wanted_by(&o.lease) == Some(self.holder.as_str())))
            .filter(|(free, _, _)| *free > 0)
            .max_by_key(|(free, _, _)| *free)
            .map(|(_, name, asked)| (name.clone(), asked))
    }

    /// A request for a block of `range` ended at `now`: without one (`got` false), or with.
    pub fn request_ended(&mut self, range: usize, got: bool, now: Moment) {
        if got {
            self.unanswered.remove(&range);
        } else {
            self.unanswered.insert(range, now);
        }
    }

    /// The block Leases as listed at `now`: note since when each one of another replica has
    /// kept its holder's last renewal.
    pub fn looked(&mut self, leases: Vec<Lease>, now: Moment) -> Looked {
        let mut seen = HashSet::new();
        let mut out = Looked::default();
        for lease in leases {
            let Some(name) = lease.metadata.name.clone() else { continue };
            if lease.metadata.resource_version.is_none() {
                continue;
            }
            let Some((range, index)) = block_of(&self.cidrs, &name) else {
                // A block of another range that shares addresses with one of ours (replicas
                // of a changed --service-cidr side by side): busy while renewed, deleted once
                // its holder stopped (as a block of another size).
                if let Some((range, span)) = self.cidrs.iter().enumerate().find_map(|(i, c)| Some((i, foreign_span(c, &lease)?))) {
                    seen.insert(name.clone());
                    let earlier = self.observed.remove(&name).map(|o| o.seen);
                    let seen_now = Observation::next(earlier, Renewal::of(&lease), now);
                    self.observed.insert(name, Watched { range, span, seen: seen_now, lease });
                } else if holder(&lease) != Some(self.holder.as_str()) {
                    // Of a range sharing no address with ours: deleted once its holder stopped.
                    seen.insert(name.clone());
                    let earlier = self.strangers.remove(&name);
                    let seen_now = Observation::next(earlier, Renewal::of(&lease), now);
                    if seen_now.expired(now, self.expiry(&lease)) {
                        out.stale.push(lease);
                    } else {
                        self.strangers.insert(name, seen_now);
                    }
                }
                continue;
            };
            if holder(&lease) == Some(self.holder.as_str()) {
                if self.asks_us(&lease) {
                    out.requests.push(lease);
                } else if !self.claiming.contains(&name) && !self.held.iter().any(|h| h.name == name) {
                    out.orphans.push(lease);
                }
                continue;
            }
            let cidr = &self.cidrs[range];
            // The addresses its Lease names; by the index at our size only if it names none.
            let Some(span) = lease_span(cidr, index, &lease).or_else(|| span(cidr, self.sizes[range], index)) else { continue };
            seen.insert(name.clone());
            let earlier = self.observed.remove(&name).map(|o| o.seen);
            let seen_now = Observation::next(earlier, Renewal::of(&lease), now);
            self.observed.insert(name, Watched { range, span, seen: seen_now, lease });
        }
        self.observed.retain(|n, _| seen.contains(n));
        self.strangers.retain(|n, _| seen.contains(n));
        let held: HashSet<&String> = self.held.iter().map(|h| &h.name).collect();
        self.answered.retain(|(n, _)| held.contains(n));
        out
    }

    /// Another replica's block Lease whose addresses overlap `span` of `range`.
    pub fn overlapping(&self, range: usize, span: &BlockSpan) -> Option<String> {
        let cidr = &self.cidrs[range];
        self.observed.iter().find(|(_, o)| translate(&self.cidrs[o.range], &o.span, cidr).is_some_and(|s| overlap(&s, span))).map(|(n, _)| n.clone())
    }

    /// This replica starts creating or taking over the Lease `name` (true), or is done (false).
    pub fn claiming(&mut self, name: &str, now_claiming: bool) {
        if now_claiming {
            self.claiming.insert(name.to_string());
        } else {
            self.claiming.remove(name);
        }
    }

    /// The Lease `deleted` is gone (the watch saw its delete: by hand, a namespace clean-up,
    /// another replica): if it is the Lease of a block held here (same name and uid), the
    /// block is dropped at once — another replica may create it anew right away. Returns the
    /// block's name if one was dropped.
    pub fn lease_deleted(&mut self, deleted: &Lease) -> Option<String> {
        let name = deleted.metadata.name.as_deref()?;
        self.observed.remove(name);
        let same = |h: &Held| h.name == name && (deleted.metadata.uid.is_none() || h.lease.metadata.uid.is_none() || h.lease.metadata.uid == deleted.metadata.uid);
        let i = self.held.iter().position(same)?;
        Some(self.held.remove(i).name)
    }

    /// Stop watching another replica's block (its Lease changed, went, or became ours).
    pub fn forget(&mut self, name: &str) {
        self.observed.remove(name);
    }

    /// Block `span` of `range` is ours through `lease`, written at `sent`; `listed` are its
    /// addresses the apiserver recorded per a consistent list made after; picks start at
    /// `cursor`.
    #[allow(clippy::too_many_arguments)]
    pub fn adopt(&mut self, range: usize, span: BlockSpan, name: String, lease: Lease, sent: Moment, listed: HashSet<IpAddr>, cursor: u64, now: Moment) {
        self.observed.remove(&name);
        self.held.push(Held { range, span, name, lease, confirmed: sent, cursor, listed, last_pick: now, returning: false, unconfirmed: false });
    }

    /// The Leases to renew now (held, not being given back), as last written.
    pub fn to_renew(&self) -> Vec<(String, Lease)> {
        self.held.iter().filter(|h| !h.returning).map(|h| (h.name.clone(), h.lease.clone())).collect()
    }

    /// Our write of `name`, sent at `sent`, was confirmed: `lease` as written.
    pub fn renewed(&mut self, name: &str, lease: Lease, sent: Moment) {
        if let Some(h) = self.held.iter_mut().find(|h| h.name == name) {
            h.lease = lease;
            h.confirmed = h.confirmed.max(sent);
        }
    }

    /// A renewal of `name` conflicted and a read shows `lease` still ours (an earlier write
    /// of ours applied, its answer lost): its resourceVersion, not a newer confirmation.
    pub fn still_ours(&mut self, name: &str, lease: Lease) {
        if let Some(h) = self.held.iter_mut().find(|h| h.name == name) {
            h.lease = lease;
        }
    }

    /// Block `name` is no longer ours (taken over, deleted, given back): no more picks.
    pub fn drop_block(&mut self, name: &str) {
        self.held.retain(|h| h.name != name);
    }

    /// Whether `lease` is a block held here that carries another replica's hand-over request
    /// not answered yet.
    pub fn asks_us(&self, lease: &Lease) -> bool {
        let (Some(name), Some(rv)) = (lease.metadata.name.as_ref(), lease.metadata.resource_version.as_ref()) else { return false };
        holder(lease) == Some(self.holder.as_str())
            && wanted_by(lease).is_some_and(|w| w != self.holder)
            && self.held.iter().any(|h| &h.name == name)
            && !self.answered.contains(&(name.clone(), rv.clone()))
    }

    /// Answer the request `lease` carries, once per resourceVersion: the range it asks for.
    pub fn take_request(&mut self, lease: &Lease) -> Option<usize> {
        if !self.asks_us(lease) {
            return None;
        }
        let (name, rv) = (lease.metadata.name.clone()?, lease.metadata.resource_version.clone()?);
        let range = self.held.iter().find(|h| h.name == name)?.range;
        self.answered.insert((name, rv));
        Some(range)
    }

    /// Whether an address of `span` was picked here and is still in flight: pending, and not
    /// yet shown recorded by the view (a recorded one is stored).
    fn in_flight(&self, recorded: &HashSet<IpAddr>, cidr: &ServiceCidr, span: &BlockSpan) -> bool {
        self.pending.keys().any(|ip| !recorded.contains(ip) && span.covers(cidr, *ip))
    }

    /// Choose a block of `range` to hand over: usable, with free addresses and no pick in
    /// flight — the one `asked` for, else the one with the most room — while another usable block of the range keeps
    /// room, or when nothing was picked from it for [`HANDOVER_IDLE`]. No pick is made from
    /// it from now on; returns its name and Lease for the give-back.
    pub fn choose_hand_over(&mut self, range: usize, asked: Option<&str>, recorded: &HashSet<IpAddr>, now: Moment) -> Option<(String, Lease)> {
        let cidr = &self.cidrs[range];
        let with_room: Vec<(usize, usize)> = (0..self.held.len())
            .filter(|&i| self.held[i].range == range && self.usable(&self.held[i], now))
            .map(|i| (i, self.held[i].span.free(cidr, |ip| self.taken(recorded, ip))))
            .filter(|(_, f)| *f > 0)
            .collect();
        let eligible: Vec<(usize, usize)> = with_room
            .iter()
            .filter(|(i, _)| !self.in_flight(recorded, cidr, &self.held[*i].span))
            .filter(|(i, _)| with_room.len() > 1 || now.saturating_duration_since(self.held[*i].last_pick) >= HANDOVER_IDLE)
            .copied()
            .collect();
        // The block asked for, when it can go: the asker chose it for the addresses it shares
        // with the asker's range (a replica of a narrower range in a rolling widen shares only
        // some of ours).
        let chosen = eligible
            .iter()
            .find(|(i, _)| asked == Some(self.held[*i].name.as_str()))
            .or_else(|| eligible.iter().max_by_key(|(_, f)| *f))
            .map(|(i, _)| *i)?;
        let h = &mut self.held[chosen];
        h.returning = true;
        Some((h.name.clone(), h.lease.clone()))
    }

    /// Choose blocks nothing was picked from for a lease duration, with no pick in flight,
    /// while the other usable blocks of the same range still have [`LEAD_BLOCKS`] whole
    /// blocks' worth free (so giving one back never makes the replica run low and take
    /// another at once). At most one per range; no pick is made from them from now on.
    pub fn choose_idle(&mut self, recorded: &HashSet<IpAddr>, now: Moment) -> Vec<(String, Lease)> {
        let mut out = Vec::new();
        // A range that no longer gives addresses: every block of it with nothing in flight.
        let retired: Vec<usize> = (0..self.held.len())
            .filter(|&i| {
                let h = &self.held[i];
                !self.allocatable(h.range) && !h.returning && !self.in_flight(recorded, &self.cidrs[h.range], &h.span)
            })
            .collect();
        for i in retired {
            let h = &mut self.held[i];
            h.returning = true;
            out.push((h.name.clone(), h.lease.clone()));
        }
        for range in self.order.clone() {
            let cidr = &self.cidrs[range];
            let idle = self.held.iter().position(|h| {
                h.range == range
                    && self.usable(h, now)
                    && now.saturating_duration_since(h.last_pick) >= self.lease_duration
                    && !self.in_flight(recorded, cidr, &h.span)
                    && self.has_free(recorded, range, now, Some(&h.name), LEAD_BLOCKS * self.sizes[range], &|_| true)
            });
            if let Some(i) = idle {
                let h = &mut self.held[i];
                h.returning = true;
                out.push((h.name.clone(), h.lease.clone()));
            }
        }
        out
    }

    /// At shutdown: no more picks from any block; the blocks with no pick in flight, to
    /// give back (the others expire).
    pub fn choose_close(&mut self, recorded: &HashSet<IpAddr>) -> Vec<(String, Lease)> {
        let mut out = Vec::new();
        for i in 0..self.held.len() {
            let busy = self.in_flight(recorded, &self.cidrs[self.held[i].range], &self.held[i].span);
            let h = &mut self.held[i];
            h.returning = true;
            if !busy {
                out.push((h.name.clone(), h.lease.clone()));
            }
        }
        out
    }

    /// How the give-back of `name` (chosen by [`Self::choose_hand_over`] or
    /// [`Self::choose_idle`], or tried again) ended: gone — dropped; still ours — picked from
    /// again; unknown — not held until known: no picks, tried again at the next tick
    /// ([`Self::unconfirmed`]).
    pub fn given_back(&mut self, name: &str, outcome: GiveBack) {
        let Some(h) = self.held.iter_mut().find(|h| h.name == name) else { return };
        match outcome {
            GiveBack::Gone => self.drop_block(name),
            GiveBack::Kept => {
                h.returning = false;
                h.unconfirmed = false;
            }
            GiveBack::Unknown => {
                h.returning = true;
                h.unconfirmed = true;
            }
        }
    }

    /// Blocks whose give-back's outcome is unknown, to try again.
    pub fn unconfirmed(&self) -> Vec<(String, Lease)> {
        self.held.iter().filter(|h| h.unconfirmed).map(|h| (h.name.clone(), h.lease.clone())).collect()
    }

    /// Listed addresses the view shows recorded, and picks it shows recorded that were made
    /// at least [`SETTLE`] before `now`: the view covers them from then on. A pick is not let
    /// go when the view first shows its record: a kube-apiserver whose repair controller
    /// lags deletes a just-stored Service's record and creates it again (its informers
    /// disagree: docs/reliability.md, "Fixed: two Services on one address"), and in that
    /// gap nothing but the pick keeps the address from the next dynamic pick. The admission
    /// gives a pick back at once when its create failed ([`Self::release_owned`]).
    pub fn settle(&mut self, recorded: &HashSet<IpAddr>, now: Moment) {
        self.pending.retain(|ip, p| !recorded.contains(ip) || now.saturating_duration_since(p.at) < SETTLE);
        for h in self.held.iter_mut() {
            h.listed.retain(|ip| !recorded.contains(ip));
        }
    }

    /// A Service gave `ip` up: forget it as listed (a pick pending for a newer admission stays).
    pub fn release(&mut self, ip: IpAddr) {
        for h in self.held.iter_mut() {
            h.listed.remove(&ip);
        }
    }

    /// The admission that answered `ip` for `owner` gives it back.
    pub fn release_owned(&mut self, ip: IpAddr, owner: &ParentRef) {
        if self.pending.get(&ip).is_some_and(|p| p.parent.as_ref().is_none_or(|p| p == owner)) {
            self.pending.remove(&ip);
        }
    }

    /// Every address held here: pending or listed (the view's are the caller's to add).
    pub fn held_addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.pending.keys().copied().chain(self.held.iter().flat_map(|h| h.listed.iter().copied()))
    }
}

/// Whether a holder may still pick from a block whose last confirmed renewal was sent at
/// `confirmed`: strictly less than `lease_duration − margin` ago.
pub fn usable(confirmed: Moment, now: Moment, lease_duration: Duration, margin: Duration) -> bool {
    now.saturating_duration_since(confirmed) < lease_duration.saturating_sub(margin)
}
