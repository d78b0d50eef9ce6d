//! The address history: every allocation and release of a Service address, as the
//! cluster's IPAddress objects show them (created: allocated to its parentRef; deleted:
//! released), kept durably and bounded so that `clusterip explain IP` can say who held an
//! address, from when to when.
//!
//! The leading controller replica records it ([`record`]): it watches IPAddress objects, and
//! its writer ([`write_loop`]) appends one line per change to the newest of a series of
//! ConfigMaps in its namespace,
//! one series per shard of the addresses ([`SHARDS`], so that `explain` of one address
//! reads a sixteenth of the log), `clusterip-address-history-<shard>-<seq>` (labels
//! [`LABEL`], [`SHARD_LABEL`]): at most one write per shard every [`FLUSH`] — never one per
//! admission. A chunk holds at most [`CHUNK_BYTES`]; past that a new one is started and the
//! oldest beyond the retention (`--address-history-chunks`, split over the shards)
//! deleted, so the whole log stays under `chunks × 64 KiB`. A new leader reads the log back, and its first
//! list of IPAddresses fills what happened while no replica recorded: records created
//! meanwhile carry their creationTimestamp, records gone meanwhile are logged as released
//! when the list shows them gone, marked `~` (the moment is approximate).
//!
//! One line per change: `<unix seconds> <+|-|~> <address> <parentRef> <managed-by>`,
//! e.g. `1795000000 + 10.96.0.10 services/kube-system/kube-dns ipallocator.k8s.io`.
//!
//! Beside them, one line per decision of ours that made a change ([`Decision`]: a repair
//! pass's release or record, the Service reconciler's, the webhook's release of an answer
//! whose create failed): `<unix seconds> ! <address> <parent> <replica> <decision>`, e.g.
//! `1795000300 ! 10.96.0.10 services/a/web clusterip-7d9f-1 service-deleted`. Any replica
//! notes its decisions ([`Notes`]) and writes them to the same chunks ([`write_loop`]; a
//! replica that is not leading writes only these, which are rare); `explain` joins each to
//! the holding it began or ended ([`holdings`]).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde::Serialize;
use tracing::{debug, warn};

use crate::k8s;
use crate::store::fold::{fold, Change};
use crate::store::ParentRef;
use crate::sync::lock;

/// A decision of ours that changed who holds an address, as a decision line names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decision {
    /// The webhook released an address it answered: the kube-apiserver recorded it and
    /// released it again while the answer was in flight (the create failed after our answer,
    /// or the Service was deleted at once).
    CreateFailed,
    /// The webhook released an address it answered that the kube-apiserver never recorded
    /// within `--in-flight-limit` (the request failed before it was stored).
    NeverRecorded,
    /// The Service reconciler released an address whose Service was deleted.
    ServiceDeleted,
    /// The Service reconciler released an address its Service no longer holds (changed to
    /// ExternalName, downgraded to one family).
    ServiceChanged,
    /// The Service reconciler recorded an address a live Service held without a record
    /// (Event `ClusterIPNotAllocated`).
    RecordedForService,
    /// The repair pass released a record no live Service owns (a leak).
    RepairReleased,
    /// The repair pass recorded a Service's address that had no record.
    RepairRecorded,
    /// The repair pass replaced a record that named the wrong owner or lacked its labels.
    RepairReplaced,
}

impl Decision {
    const ALL: [Decision; 8] = [
        Decision::CreateFailed,
        Decision::NeverRecorded,
        Decision::ServiceDeleted,
        Decision::ServiceChanged,
        Decision::RecordedForService,
        Decision::RepairReleased,
        Decision::RepairRecorded,
        Decision::RepairReplaced,
    ];

    /// The word a decision line carries.
    pub fn code(self) -> &'static str {
        match self {
            Decision::CreateFailed => "create-failed",
            Decision::NeverRecorded => "never-recorded",
            Decision::ServiceDeleted => "service-deleted",
            Decision::ServiceChanged => "service-changed",
            Decision::RecordedForService => "recorded-for-service",
            Decision::RepairReleased => "repair-released",
            Decision::RepairRecorded => "repair-recorded",
            Decision::RepairReplaced => "repair-replaced",
        }
    }

    fn parse(code: &str) -> Option<Decision> {
        Decision::ALL.into_iter().find(|d| d.code() == code)
    }

    /// A release (it ends a holding), else a record (it begins one).
    pub fn releases(self) -> bool {
        !matches!(self, Decision::RecordedForService | Decision::RepairRecorded | Decision::RepairReplaced)
    }

    /// What it was, in a phrase: "<who> <did what>: <why>".
    pub fn describe(self) -> &'static str {
        match self {
            Decision::CreateFailed => "the webhook released its answer: the create failed after it (the kube-apiserver dropped its record)",
            Decision::NeverRecorded => "the webhook released its answer: the kube-apiserver never recorded it within --in-flight-limit (the request failed)",
            Decision::ServiceDeleted => "the Service reconciler released it: the Service was deleted",
            Decision::ServiceChanged => "the Service reconciler released it: the Service no longer holds it",
            Decision::RecordedForService => "the Service reconciler recorded it: a live Service held it without a record",
            Decision::RepairReleased => "the repair pass released it: no live Service owns the record",
            Decision::RepairRecorded => "the repair pass recorded it: a Service held it without a record",
            Decision::RepairReplaced => "the repair pass replaced its record: it named the wrong owner or lacked its labels",
        }
    }
}

/// Label of the history's ConfigMaps.
pub const LABEL: &str = "clusterip.allocator/address-history";
/// Name prefix of the history's ConfigMaps; the sequence number follows.
pub const PREFIX: &str = "clusterip-address-history-";
/// The data key of a chunk.
const KEY: &str = "log";
/// A chunk is closed once it holds this many bytes.
pub const CHUNK_BYTES: usize = 64 * 1024;
/// How often the recorder writes what it saw.
pub const FLUSH: Duration = Duration::from_secs(5);
/// Default retention: chunks kept (64 × 64 KiB = 4 MiB, some 50,000 changes).
pub const DEFAULT_CHUNKS: usize = 64;
/// A flush of at least this many lines (a first list, a relist) hands the memory it freed
/// back to the operating system afterwards.
const LARGE_BATCH: usize = 10_000;

/// What a line says happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transition {
    /// The address was recorded for its parent.
    Allocated,
    /// The record was deleted.
    Released,
    /// The record was found gone by a list: released at some moment before `at`.
    ReleasedBefore,
    /// A decision of ours about the address (the line's fifth field names the replica).
    Decided(Decision),
}

/// One line of the log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// Unix seconds.
    pub at: i64,
    pub change: Transition,
    pub address: IpAddr,
    /// The parentRef (`services/<ns>/<name>`, `gateways.gateway.networking.k8s.io/<ns>/<name>`).
    pub parent: String,
    /// The record's `ipaddress.kubernetes.io/managed-by` label ("-" when none); for a
    /// decision, the replica that made it.
    pub manager: String,
}

impl Entry {
    pub fn line(&self) -> String {
        let sign = match self.change {
            Transition::Allocated => '+',
            Transition::Released => '-',
            Transition::ReleasedBefore => '~',
            Transition::Decided(d) => return format!("{} ! {} {} {} {}", self.at, self.address, self.parent, self.manager, d.code()),
        };
        format!("{} {sign} {} {} {}", self.at, self.address, self.parent, self.manager)
    }

    /// A line of the log; None for one that does not read (skipped, never fatal).
    pub fn parse(line: &str) -> Option<Entry> {
        let mut f = line.split_whitespace();
        let at = f.next()?.parse().ok()?;
        let sign = f.next()?;
        let address = crate::cidr::parse_ip(f.next()?).ok()?;
        let (parent, manager) = (f.next()?.to_string(), f.next()?.to_string());
        let change = match sign {
            "+" => Transition::Allocated,
            "-" => Transition::Released,
            "~" => Transition::ReleasedBefore,
            // (A decision this version does not know is skipped, as a bad line is.)
            "!" => Transition::Decided(Decision::parse(f.next()?)?),
            _ => return None,
        };
        Some(Entry { at, change, address, parent, manager })
    }
}

/// A decision line of one address, as `explain` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decided {
    /// Unix seconds.
    pub at: i64,
    pub decision: Decision,
    /// The replica that made it.
    pub by: String,
    /// The parent it was made for (`-`: none known, a map address of no owner).
    pub parent: String,
}

/// Who held an address over one stretch of time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Holding {
    pub parent: String,
    pub manager: String,
    /// Unix seconds; None when the log begins after it did.
    pub from: Option<i64>,
    /// Unix seconds; None while it still holds it.
    pub to: Option<i64>,
    /// `to` is when a list found the record gone, not when it went.
    pub to_approximate: bool,
    /// Our decision that recorded it, when one did (else the record's manager did, at the
    /// Service's admission for `ipallocator.k8s.io`).
    pub began_by: Option<Decided>,
    /// Our decision that released it, when one did (else the record was deleted by its
    /// manager or by hand).
    pub ended_by: Option<Decided>,
}

/// A decision is joined to the holding of its parent that began (a record) or ended (a
/// release) within this many seconds of it: the decision is noted when it is made, the
/// change when the watch shows it.
pub const JOIN_SECONDS: i64 = 30;

/// The holdings of `ip` in the log, oldest first, each with the decisions that began and
/// ended it; and the decisions joined to none (an answer the apiserver never recorded, a
/// map address released with no record to show it).
pub fn holdings(log: &[Entry], ip: IpAddr) -> (Vec<Holding>, Vec<Decided>) {
    let mut out: Vec<Holding> = Vec::new();
    let mut decided: Vec<Decided> = Vec::new();
    for e in log.iter().filter(|e| e.address == ip) {
        match e.change {
            Transition::Allocated => {
                // (A line written twice, by a flush tried again, is one holding.)
                if !out.last().is_some_and(|h| h.to.is_none() && h.parent == e.parent) {
                    out.push(Holding { parent: e.parent.clone(), manager: e.manager.clone(), from: Some(e.at), to: None, to_approximate: false, began_by: None, ended_by: None });
                }
            }
            Transition::Released | Transition::ReleasedBefore => {
                let approx = e.change == Transition::ReleasedBefore;
                match out.last_mut().filter(|h| h.parent == e.parent) {
                    Some(h) if h.to.is_none() => {
                        h.to = Some(e.at);
                        h.to_approximate = approx;
                    }
                    // (Written twice: the holding has ended already.)
                    Some(_) => {}
                    None => out.push(Holding { parent: e.parent.clone(), manager: e.manager.clone(), from: None, to: Some(e.at), to_approximate: approx, began_by: None, ended_by: None }),
                }
            }
            Transition::Decided(decision) => {
                let d = Decided { at: e.at, decision, by: e.manager.clone(), parent: e.parent.clone() };
                if !decided.contains(&d) {
                    decided.push(d);
                }
            }
        }
    }
    let mut apart = Vec::new();
    for d in decided {
        let end = |h: &Holding| if d.decision.releases() { h.to } else { h.from };
        let nearest = out
            .iter_mut()
            .filter(|h| h.parent == d.parent && end(h).is_some_and(|t| (t - d.at).abs() <= JOIN_SECONDS))
            .filter(|h| if d.decision.releases() { h.ended_by.is_none() } else { h.began_by.is_none() })
            .min_by_key(|h| end(h).map(|t| (t - d.at).abs()));
        match nearest {
            Some(h) if d.decision.releases() => h.ended_by = Some(d),
            Some(h) => h.began_by = Some(d),
            None => apart.push(d),
        }
    }
    (out, apart)
}

/// What one IPAddress object says, for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub address: IpAddr,
    pub parent: String,
    pub manager: String,
    /// creationTimestamp, Unix seconds.
    pub created: Option<i64>,
}

fn record_of(o: &IPAddress) -> Option<Record> {
    let address = k8s::ipaddress::address(o.metadata.name.as_deref()?)?;
    let manager = k8s::ipaddress::label(&o.metadata, k8s::ipaddress::LABEL_MANAGED_BY).unwrap_or("-").to_string();
    let mut parent = ParentRef::from(&o.spec.parent_ref);
    parent.namespace = parent.namespace.filter(|n| !n.is_empty());
    Some(Record { address, parent: parent.to_string(), manager, created: o.metadata.creation_timestamp.as_ref().map(|t| t.0.as_second()) })
}

/// The log's view of who holds what now, and the entries a change makes.
#[derive(Debug, Default)]
pub struct Holders {
    now: HashMap<IpAddr, (String, String)>,
}

impl Holders {
    /// The holders the log ends with.
    pub fn replay(log: &[Entry]) -> Holders {
        let mut h = Holders::default();
        for e in log {
            match e.change {
                Transition::Allocated => {
                    h.now.insert(e.address, (e.parent.clone(), e.manager.clone()));
                }
                Transition::Released | Transition::ReleasedBefore => {
                    h.now.remove(&e.address);
                }
                Transition::Decided(_) => {}
            }
        }
        h
    }

    /// A record created or changed (seen at `now`): logged when it is new or names another
    /// parent than the log's holder (then the old holding ends first).
    pub fn apply(&mut self, r: &Record, now: i64) -> Vec<Entry> {
        let mut out = Vec::new();
        match self.now.get(&r.address) {
            Some((p, _)) if *p == r.parent => return out,
            Some((p, m)) => out.push(Entry { at: now, change: Transition::Released, address: r.address, parent: p.clone(), manager: m.clone() }),
            None => {}
        }
        out.push(Entry { at: r.created.unwrap_or(now), change: Transition::Allocated, address: r.address, parent: r.parent.clone(), manager: r.manager.clone() });
        self.now.insert(r.address, (r.parent.clone(), r.manager.clone()));
        out
    }

    /// A record deleted (seen at `now`).
    pub fn delete(&mut self, address: IpAddr, now: i64) -> Option<Entry> {
        let (parent, manager) = self.now.remove(&address)?;
        Some(Entry { at: now, change: Transition::Released, address, parent, manager })
    }

    /// A full list (at `now`): what it lacks was released before it; what is new or changed
    /// is logged as [`Self::apply`] does.
    pub fn relisted(&mut self, list: &[Record], now: i64) -> Vec<Entry> {
        let listed: HashMap<IpAddr, &Record> = list.iter().map(|r| (r.address, r)).collect();
        let mut gone: Vec<IpAddr> = self.now.keys().filter(|ip| !listed.contains_key(ip)).copied().collect();
        gone.sort();
        let mut out: Vec<Entry> = gone
            .into_iter()
            .filter_map(|ip| self.now.remove(&ip).map(|(parent, manager)| Entry { at: now, change: Transition::ReleasedBefore, address: ip, parent, manager }))
            .collect();
        let mut list: Vec<&Record> = list.iter().collect();
        list.sort_by_key(|r| (r.created, r.address));
        for r in list {
            out.extend(self.apply(r, now));
        }
        out
    }
}

/// The log is kept in this many shards, by address: `explain` of one address reads one.
pub const SHARDS: u32 = 16;
/// Label naming a chunk's shard.
pub const SHARD_LABEL: &str = "clusterip.allocator/address-history-shard";

/// The shard of `ip`.
pub fn shard_of(ip: IpAddr) -> u32 {
    let low = match ip {
        IpAddr::V4(v) => u32::from(v),
        IpAddr::V6(v) => u128::from(v) as u32,
    };
    low % SHARDS
}

/// Chunks in `namespace` (one shard's, or all), oldest first per shard: (shard, sequence
/// number, ConfigMap).
async fn chunks(api: &Api<ConfigMap>, shard: Option<u32>) -> Result<Vec<(u32, u64, ConfigMap)>, kube::Error> {
    let selector = match shard {
        Some(s) => format!("{LABEL},{SHARD_LABEL}={s}"),
        None => LABEL.to_string(),
    };
    let list = api.list(&ListParams::default().labels(&selector)).await?;
    let mut out: Vec<(u32, u64, ConfigMap)> = list
        .items
        .into_iter()
        .filter_map(|c| {
            let (shard, seq) = c.metadata.name.as_deref()?.strip_prefix(PREFIX)?.split_once('-')?;
            Some((shard.parse().ok()?, seq.parse().ok()?, c))
        })
        .collect();
    out.sort_by_key(|(shard, seq, _)| (*shard, *seq));
    Ok(out)
}

fn text_of(c: &ConfigMap) -> &str {
    c.data.as_ref().and_then(|d| d.get(KEY)).map(String::as_str).unwrap_or_default()
}

/// The lines of `chunks`, shard after shard, each shard in the order it was written: every
/// address's lines are in one shard, in order (a line's time is not its order: an
/// allocation carries its record's creationTimestamp).
fn entries(chunks: &[(u32, u64, ConfigMap)]) -> Vec<Entry> {
    chunks.iter().flat_map(|(_, _, c)| text_of(c).lines().filter_map(Entry::parse).collect::<Vec<_>>()).collect()
}

/// The whole log as stored in `namespace`, shard after shard (each address's lines in order).
pub async fn read(client: &kube::Client, namespace: &str) -> Result<Vec<Entry>, kube::Error> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    Ok(entries(&chunks(&api, None).await?))
}

/// The log of `ip`'s shard (every line of `ip` among others), in order.
pub async fn read_for(client: &kube::Client, namespace: &str, ip: IpAddr) -> Result<Vec<Entry>, kube::Error> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    Ok(entries(&chunks(&api, Some(shard_of(ip))).await?))
}

fn name_of(shard: u32, seq: u64) -> String {
    format!("{PREFIX}{shard:02}-{seq:08}")
}

fn chunk(shard: u32, seq: u64, text: String) -> ConfigMap {
    let mut c = ConfigMap::default();
    c.metadata.name = Some(name_of(shard, seq));
    c.metadata.labels = Some(BTreeMap::from([(LABEL.to_string(), "true".to_string()), (SHARD_LABEL.to_string(), shard.to_string())]));
    c.data = Some(BTreeMap::from([(KEY.to_string(), text)]));
    c
}

/// What the recorder knows of one shard's chunks: their sequence numbers, oldest first,
/// and the newest as last written (its resourceVersion the next write's precondition).
#[derive(Default)]
struct Tail {
    seqs: Vec<u64>,
    newest: Option<ConfigMap>,
}

/// Lines waiting for the history's writer: the leader's recorder puts the changes it sees
/// here, and every part that decides ([`Decision`]) notes its decisions. Cheap to clone.
#[derive(Clone)]
pub struct Notes {
    pending: Arc<Mutex<Vec<Entry>>>,
    /// The replica, named in its decision lines.
    by: Arc<str>,
}

/// Decision lines waiting beyond this many are dropped (with a warning): a writer that
/// cannot write for long must not grow without bound. (The recorder's own lines are not
/// counted against it: a first list at 100k Services waits here whole.)
const MAX_PENDING_DECISIONS: usize = 100_000;

impl Notes {
    /// `by`: the replica's identity (blanks replaced: a line is split on them).
    pub fn new(by: &str) -> Notes {
        let by: String = by.chars().map(|c| if c.is_whitespace() { '_' } else { c }).collect();
        Notes { pending: Arc::default(), by: if by.is_empty() { "-".into() } else { by.into() } }
    }

    /// Note a decision about `address` made for `parent` (None: no owner known).
    pub fn note(&self, address: IpAddr, parent: Option<&ParentRef>, decision: Decision) {
        let entry = Entry { at: unix_now(), change: Transition::Decided(decision), address, parent: parent.map_or_else(|| "-".to_string(), |p| p.to_string()), manager: self.by.to_string() };
        let mut p = lock(&self.pending);
        if p.len() >= MAX_PENDING_DECISIONS {
            warn!(%address, decision = decision.code(), "address history: too many lines waiting to be written; this decision is not recorded");
            return;
        }
        p.push(entry);
    }

    fn extend(&self, lines: Vec<Entry>) {
        lock(&self.pending).extend(lines);
    }

    fn take(&self) -> Vec<Entry> {
        std::mem::take(&mut *lock(&self.pending))
    }

    /// Put back lines a write failed on, ahead of those noted meanwhile.
    fn put_back(&self, lines: Vec<Entry>) {
        let mut p = lock(&self.pending);
        let later = std::mem::take(&mut *p);
        *p = lines;
        p.extend(later);
    }

    /// Lines waiting to be written.
    pub fn waiting(&self) -> usize {
        lock(&self.pending).len()
    }

    /// The lines waiting, as they would be written (tests).
    pub fn lines(&self) -> Vec<String> {
        lock(&self.pending).iter().map(Entry::line).collect()
    }
}

fn unix_now() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_second()
}

/// Record the history until the task is aborted (the replica stops leading): read the log
/// back, watch IPAddress objects, and put each change in `notes` for the replica's
/// [`write_loop`].
pub async fn record(client: kube::Client, namespace: String, notes: Notes) {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let stored = loop {
        match chunks(&cms, None).await {
            Ok(all) => break all,
            Err(e) => {
                warn!(error = %e, "could not read the address history back; trying again");
                tokio::time::sleep(FLUSH).await;
            }
        }
    };
    let holders = Arc::new(Mutex::new(Holders::replay(&entries(&stored))));
    drop(stored);
    fold(Api::<IPAddress>::all(client), "IPAddress (history)", record_of, move |change| {
        let mut h = lock(&holders);
        let new = match change {
            Change::Replace(list) => h.relisted(&list.into_iter().flatten().collect::<Vec<_>>(), unix_now()),
            Change::Apply(Some(r)) => h.apply(&r, unix_now()),
            Change::Delete(Some(r)) => h.delete(r.address, unix_now()).into_iter().collect(),
            Change::Apply(None) | Change::Delete(None) => Vec::new(),
        };
        notes.extend(new);
    })
    .await
}

/// Writes what `notes` holds to the history's chunks in `namespace`, keeping about `keep`
/// chunks in all (`keep / SHARDS` per shard, at least one).
pub struct Writer {
    cms: Api<ConfigMap>,
    /// What is known of each shard's chunks (read when first written, and after a failed
    /// write: another replica may have written meanwhile).
    tails: HashMap<u32, Tail>,
    per_shard: usize,
}

impl Writer {
    pub fn new(client: kube::Client, namespace: &str, keep: usize) -> Writer {
        Writer { cms: Api::namespaced(client, namespace), tails: HashMap::new(), per_shard: (keep / SHARDS as usize).max(1) }
    }

    /// Write what waits in `notes` now; a shard whose write fails is put back for the next
    /// flush. Returns how many lines were written.
    pub async fn flush(&mut self, notes: &Notes) -> usize {
        let batch = notes.take();
        let (large, mut written) = (batch.len() >= LARGE_BATCH, 0);
        let mut by_shard: BTreeMap<u32, Vec<Entry>> = BTreeMap::new();
        for e in batch {
            by_shard.entry(shard_of(e.address)).or_default().push(e);
        }
        for (shard, lines) in by_shard {
            let tail = match self.tails.remove(&shard) {
                Some(t) => Ok(t),
                None => read_tail(&self.cms, shard).await,
            };
            let result = match tail {
                Ok(mut t) => {
                    let r = append(&self.cms, shard, &mut t, &lines, self.per_shard).await;
                    if r.is_ok() {
                        self.tails.insert(shard, t);
                    }
                    r
                }
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => written += lines.len(),
                Err(e) => {
                    // The shard's chunks are read again at its next write (another writer,
                    // or a delete, came between).
                    warn!(error = %e, shard, lines = lines.len(), "could not write the address history; trying again at the next flush");
                    notes.put_back(lines);
                }
            }
        }
        if large {
            // The first list's lines (one per address), the relist and the text built
            // from them are freed by now; without this glibc keeps them resident.
            clusterip_component_base::memory::release_freed();
        }
        written
    }
}

/// Write what `notes` holds every [`FLUSH`], until the task is aborted. Every replica runs
/// one (its decisions); the leader's recorder feeds the same `notes`.
pub async fn write_loop(mut writer: Writer, notes: Notes) {
    let mut every = tokio::time::interval(FLUSH);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if notes.waiting() > 0 {
            writer.flush(&notes).await;
        }
    }
}

async fn read_tail(cms: &Api<ConfigMap>, shard: u32) -> Result<Tail, kube::Error> {
    let list = chunks(cms, Some(shard)).await?;
    Ok(Tail { seqs: list.iter().map(|(_, s, _)| *s).collect(), newest: list.into_iter().last().map(|(_, _, c)| c) })
}

/// Append `batch` to the newest chunk of `shard`, starting new ones as each fills up, then
/// delete the oldest beyond `keep`. An existing chunk is replaced with its resourceVersion
/// as precondition: a write of another replica meanwhile fails this one, and the batch is
/// tried again at the next flush (a line written twice reads as one: [`holdings`]).
async fn append(api: &Api<ConfigMap>, shard: u32, tail: &mut Tail, batch: &[Entry], keep: usize) -> Result<(), kube::Error> {
    let mut seq = tail.seqs.last().copied().unwrap_or(0);
    let mut existing = tail.newest.take();
    let mut text = existing.as_ref().map(|c| text_of(c).to_string()).unwrap_or_default();
    for e in batch {
        let line = e.line() + "\n";
        if !text.is_empty() && text.len() + line.len() > CHUNK_BYTES {
            write(api, shard, seq, std::mem::take(&mut text), existing.take()).await?;
            if tail.seqs.last() != Some(&seq) {
                tail.seqs.push(seq);
            }
            seq += 1;
        }
        text.push_str(&line);
    }
    let written = write(api, shard, seq, text, existing).await?;
    if tail.seqs.last() != Some(&seq) {
        tail.seqs.push(seq);
    }
    tail.newest = Some(written);
    while tail.seqs.len() > keep.max(1) {
        let old = tail.seqs.remove(0);
        match api.delete(&name_of(shard, old), &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Write chunk `seq` of `shard`: replace `existing` (its resourceVersion the precondition),
/// else create. Returns the chunk as stored.
async fn write(api: &Api<ConfigMap>, shard: u32, seq: u64, text: String, existing: Option<ConfigMap>) -> Result<ConfigMap, kube::Error> {
    match existing {
        Some(mut c) => {
            c.data = Some(BTreeMap::from([(KEY.to_string(), text)]));
            api.replace(&name_of(shard, seq), &PostParams::default(), &c).await
        }
        None => {
            debug!(shard, seq, "address history: a new chunk");
            api.create(&PostParams::default(), &chunk(shard, seq, text)).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ip: &str, parent: &str, created: i64) -> Record {
        Record { address: ip.parse().expect("ip"), parent: parent.into(), manager: "ipallocator.k8s.io".into(), created: Some(created) }
    }

    #[test]
    fn lines_read_back_as_written_and_bad_lines_are_skipped() {
        let e = Entry { at: 1795000000, change: Transition::Allocated, address: "10.96.0.10".parse().expect("ip"), parent: "services/kube-system/kube-dns".into(), manager: "ipallocator.k8s.io".into() };
        assert_eq!(e.line(), "1795000000 + 10.96.0.10 services/kube-system/kube-dns ipallocator.k8s.io");
        assert_eq!(Entry::parse(&e.line()), Some(e));
        let d = Entry { at: 1795000300, change: Transition::Decided(Decision::ServiceDeleted), address: "10.96.0.10".parse().expect("ip"), parent: "services/a/web".into(), manager: "clusterip-0".into() };
        assert_eq!(d.line(), "1795000300 ! 10.96.0.10 services/a/web clusterip-0 service-deleted");
        assert_eq!(Entry::parse(&d.line()), Some(d));
        for code in Decision::ALL {
            assert_eq!(Decision::parse(code.code()), Some(code));
        }
        // A decision without its word, or one this version does not know, is skipped.
        for bad in ["", "x + 10.96.0.10 a b", "1 ? 10.96.0.10 a b", "1 + nope a b", "1 + 10.96.0.10 a", "1 ! 10.96.0.10 a b", "1 ! 10.96.0.10 a b some-later-decision"] {
            assert_eq!(Entry::parse(bad), None, "{bad:?}");
        }
    }

    fn decided(at: i64, d: Decision, ip: &str, parent: &str) -> Entry {
        Entry { at, change: Transition::Decided(d), address: ip.parse().expect("ip"), parent: parent.into(), manager: "replica-1".into() }
    }

    /// Each decision joins the holding of its parent that it began (a record) or ended (a
    /// release) within [`JOIN_SECONDS`], whichever side of the change its line was written
    /// (another replica's decision lands in the log after the leader's change line, or
    /// before); a decision written twice joins once; one near no holding of its parent
    /// (an answer never recorded, another parent's holding) stands apart.
    #[test]
    fn decisions_join_the_holdings_they_began_or_ended() {
        let mut h = Holders::default();
        let mut log = Vec::new();
        log.extend(h.apply(&rec("10.96.0.5", "services/a/web", 100), 101));
        log.push(decided(150, Decision::ServiceDeleted, "10.96.0.5", "services/a/web"));
        log.extend(h.delete("10.96.0.5".parse().expect("ip"), 149));
        log.push(decided(150, Decision::ServiceDeleted, "10.96.0.5", "services/a/web"));
        log.push(decided(300, Decision::RepairRecorded, "10.96.0.5", "services/b/api"));
        log.extend(h.apply(&rec("10.96.0.5", "services/b/api", 302), 305));
        log.extend(h.delete("10.96.0.5".parse().expect("ip"), 400));
        log.push(decided(401, Decision::RepairReleased, "10.96.0.5", "services/b/api"));
        log.push(decided(500, Decision::NeverRecorded, "10.96.0.5", "services/c/x"));
        log.push(decided(402, Decision::CreateFailed, "10.96.0.5", "services/b/other"));
        let (got, apart) = holdings(&log, "10.96.0.5".parse().expect("ip"));
        let joined: Vec<(&str, Option<Decision>, Option<Decision>)> = got.iter().map(|h| (h.parent.as_str(), h.began_by.as_ref().map(|d| d.decision), h.ended_by.as_ref().map(|d| d.decision))).collect();
        assert_eq!(
            joined,
            vec![("services/a/web", None, Some(Decision::ServiceDeleted)), ("services/b/api", Some(Decision::RepairRecorded), Some(Decision::RepairReleased))]
        );
        let apart: Vec<(Decision, &str)> = apart.iter().map(|d| (d.decision, d.parent.as_str())).collect();
        assert_eq!(apart, vec![(Decision::NeverRecorded, "services/c/x"), (Decision::CreateFailed, "services/b/other")]);
        // Decisions change no holder: the log replays to the same holders without them.
        let changes: Vec<Entry> = log.iter().filter(|e| !matches!(e.change, Transition::Decided(_))).cloned().collect();
        assert_eq!(Holders::replay(&log).now, Holders::replay(&changes).now);
    }

    /// A replica's identity with blanks still makes one field of a line; notes beyond the
    /// bound are dropped, not kept without end.
    #[test]
    fn notes_name_the_replica_in_one_field_and_are_bounded() {
        let notes = Notes::new("node a 1");
        let ip: IpAddr = "10.96.0.7".parse().expect("ip");
        notes.note(ip, Some(&ParentRef::service("a", "web")), Decision::CreateFailed);
        notes.note(ip, None, Decision::RepairReleased);
        let lines: Vec<Option<Entry>> = notes.take().iter().map(|e| Entry::parse(&e.line())).collect();
        assert_eq!(lines.iter().map(|e| e.as_ref().map(|e| (e.parent.as_str(), e.manager.as_str()))).collect::<Vec<_>>(), vec![Some(("services/a/web", "node_a_1")), Some(("-", "node_a_1"))]);
        for _ in 0..MAX_PENDING_DECISIONS + 10 {
            notes.note(ip, None, Decision::RepairReleased);
        }
        assert_eq!(notes.waiting(), MAX_PENDING_DECISIONS);
    }

    /// Created, deleted, created for another Service; a change of parent ends the old
    /// holding; a list that lacks a record ends it as "released before"; a list of what the
    /// log already holds adds nothing.
    #[test]
    fn changes_become_holdings() {
        let mut h = Holders::default();
        let mut log = Vec::new();
        log.extend(h.apply(&rec("10.96.0.5", "services/a/web", 100), 101));
        log.extend(h.apply(&rec("10.96.0.5", "services/a/web", 100), 150));
        log.extend(h.delete("10.96.0.5".parse().expect("ip"), 200));
        log.extend(h.apply(&rec("10.96.0.5", "services/b/api", 300), 301));
        log.extend(h.apply(&rec("10.96.0.5", "services/b/db", 300), 400));
        log.extend(h.relisted(&[rec("10.96.0.6", "services/b/x", 450)], 500));
        log.extend(h.relisted(&[rec("10.96.0.6", "services/b/x", 450)], 600));
        let ip: IpAddr = "10.96.0.5".parse().expect("ip");
        let got: Vec<(String, Option<i64>, Option<i64>, bool)> = holdings(&log, ip).0.into_iter().map(|h| (h.parent, h.from, h.to, h.to_approximate)).collect();
        assert_eq!(
            got,
            vec![
                ("services/a/web".into(), Some(100), Some(200), false),
                ("services/b/api".into(), Some(300), Some(400), false),
                ("services/b/db".into(), Some(300), Some(500), true),
            ]
        );
        assert_eq!(holdings(&log, "10.96.0.6".parse().expect("ip")).0.len(), 1);
        // Replayed, the log ends where the recorder did.
        assert_eq!(Holders::replay(&log).now, h.now);
        // Lines written twice (a flush tried again after a conflict) read as once.
        let twice: Vec<Entry> = log.iter().flat_map(|e| [e.clone(), e.clone()]).collect();
        assert_eq!(holdings(&twice, ip), holdings(&log, ip));
    }
}
