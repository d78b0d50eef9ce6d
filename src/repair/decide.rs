//! The repair pass's decisions: what is inconsistent between the Services, the allocation
//! records and the configured ranges, and what to do about each finding. Pure: no I/O, no
//! clock (ages are inputs), so every rule is unit-tested.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::Duration;

use serde::Serialize;

use crate::cidr::{self, Family, ServiceCidr};
use crate::store::ParentRef;

/// A leaked allocation-map address is released on this consecutive detection (Kubernetes'
/// `numRepairsBeforeLeakCleanup`).
pub const LEAK_PASSES: u32 = 3;
/// An orphaned IPAddress object younger than this is left alone (Kubernetes' repairip
/// `gracePeriod`, the kube-apiserver's default request timeout).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(60);

/// What a Service holds, as far as the pass cares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceView {
    pub namespace: String,
    pub name: String,
    pub uid: Option<String>,
    /// creationTimestamp as seconds since the epoch (orders duplicates: the oldest keeps it).
    pub created: Option<i64>,
    /// `spec.clusterIPs` (or `spec.clusterIP`), "None" and empty removed, as written.
    pub cluster_ips: Vec<String>,
    /// The `clusterip.allocator/reserved` annotation as written, which older versions of our
    /// webhook set to the addresses they assigned ([`Self::assigned_by_us`]); kept unsplit, as
    /// the pass reads it only for an address outside every range.
    pub reserved: Option<Box<str>>,
}

impl ServiceView {
    /// The addresses the `clusterip.allocator/reserved` annotation names.
    pub fn assigned_by_us(&self) -> impl Iterator<Item = &str> {
        self.reserved.as_deref().into_iter().flat_map(crate::k8s::annotations::reserved_in)
    }

    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// One IPAddress object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordView {
    pub name: String,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
    pub managed_by: Option<String>,
    pub family_label: Option<String>,
    pub parent: Option<ParentRef>,
    /// now − creationTimestamp; None when unknown (never released on age alone then).
    pub age: Option<Duration>,
}

/// The backend's records.
#[derive(Clone, Debug)]
pub enum Records {
    /// The etcd backend: the allocated addresses of the allocation maps (no owners).
    Map(BTreeSet<IpAddr>),
    /// IPAddress objects (every manager's).
    Objects(Vec<RecordView>),
}

/// Whose records the pass judges and whether it may change anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The etcd backend's allocation maps.
    Etcd,
    /// IPAddress objects; those labelled managed-by `manager` are ours and may be changed.
    IpAddress { manager: String },
    /// Read-only audit of the kube-apiserver's own allocator: IPAddress objects managed by
    /// `manager` (ipallocator.k8s.io) against every Service, ranges from ServiceCIDRs.
    Audit { manager: String },
}

#[derive(Clone, Debug)]
pub struct Config {
    pub ranges: Vec<ServiceCidr>,
    /// The cluster's own ranges (its ServiceCIDR objects), when known. A Service address in
    /// one of them but in none of `ranges` is another allocator's and not judged; an address
    /// in none of either is out of range. Unknown (no ServiceCIDR API): addresses outside
    /// `ranges` are judged only when our webhook assigned them (its annotation says so).
    pub cluster_ranges: Option<Vec<ServiceCidr>>,
    pub mode: Mode,
    /// IPAddress leak grace (from creationTimestamp).
    pub grace: Duration,
    /// Release leaks found on this pass whatever their count or age (`--release-leaks-now`).
    pub release_leaks_now: bool,
}

/// Per-address counts of consecutive passes that saw a leak (the etcd backend's 3-pass rule).
#[derive(Clone, Debug, Default)]
pub struct LeakCounts {
    seen: HashMap<IpAddr, u32>,
}

impl LeakCounts {
    pub fn get(&self, ip: IpAddr) -> u32 {
        self.seen.get(&ip).copied().unwrap_or(0)
    }
    /// Forget an address (released, or seen owned).
    pub fn forget(&mut self, ip: IpAddr) {
        self.seen.remove(&ip);
    }
    pub fn len(&self) -> usize {
        self.seen.len()
    }
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// The kinds of drift.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A record no live Service owns.
    Leak,
    /// A record whose parentRef names the wrong owner.
    WrongReference,
    /// A Service address with no record.
    MissingRecord,
    /// One address on two Services.
    Duplicate,
    /// A Service address outside every configured range of its family.
    OutOfRange,
    /// A Service address of a family no range is configured for.
    FamilyNotConfigured,
    /// A Service address (or IPAddress name) that is not a valid address.
    Malformed,
    /// A record with a wrong or missing ip-family / managed-by label.
    WrongLabels,
}

impl Kind {
    pub fn as_str(&self) -> &'static str {
        match self {
            Kind::Leak => "leak",
            Kind::WrongReference => "wrong-reference",
            Kind::MissingRecord => "missing-record",
            Kind::Duplicate => "duplicate",
            Kind::OutOfRange => "out-of-range",
            Kind::FamilyNotConfigured => "family-not-configured",
            Kind::Malformed => "malformed",
            Kind::WrongLabels => "wrong-labels",
        }
    }

    /// The `type` label of `clusterip_repair_ip_errors_total` (Kubernetes' label values).
    pub fn metric_type(&self) -> &'static str {
        match self {
            Kind::Leak => "leak",
            Kind::WrongReference | Kind::MissingRecord | Kind::WrongLabels => "repair",
            Kind::Duplicate => "duplicate",
            Kind::OutOfRange => "outOfRange",
            Kind::FamilyNotConfigured | Kind::Malformed => "invalid",
        }
    }
}

/// What the pass does (or, dry-run, would do) about a finding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Delete the record now.
    Release,
    /// A leaked map address seen on `seen` consecutive passes; released on pass `of`.
    ReleaseLater { seen: u32, of: u32 },
    /// An orphaned IPAddress inside its grace period; released once older than `grace`.
    ReleaseAfterGrace { age: Option<Duration>, grace: Duration },
    /// Create the missing record for the owning Service.
    Create,
    /// Delete our record and create it again with the right parentRef and labels.
    Replace,
    /// A Warning Event on the Service; nothing is changed (never take a live Service's address).
    Event,
    /// Reported only; the reason says why nothing is done.
    None(String),
}

impl Action {
    /// Short code for machines.
    pub fn code(&self) -> &'static str {
        match self {
            Action::Release => "release",
            Action::ReleaseLater { .. } => "release-later",
            Action::ReleaseAfterGrace { .. } => "release-after-grace",
            Action::Create => "create",
            Action::Replace => "replace",
            Action::Event => "event",
            Action::None(_) => "none",
        }
    }

    /// True when `--fix` changes a record for it.
    pub fn changes_records(&self) -> bool {
        matches!(self, Action::Release | Action::Create | Action::Replace)
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Action::Release => f.write_str("release the record"),
            Action::ReleaseLater { seen, of } => write!(f, "release on pass {of} of {of} (seen leaked on {seen})"),
            Action::ReleaseAfterGrace { age: Some(age), grace } => {
                write!(f, "release once older than {}s (now {}s)", grace.as_secs(), age.as_secs())
            }
            Action::ReleaseAfterGrace { age: None, grace } => write!(f, "release once older than {}s (age unknown)", grace.as_secs()),
            Action::Create => f.write_str("create the record"),
            Action::Replace => f.write_str("replace the record"),
            Action::Event => f.write_str("warning Event on the Service"),
            Action::None(why) => write!(f, "none: {why}"),
        }
    }
}

/// Where an Event goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventTarget {
    Service { namespace: String, name: String, uid: Option<String> },
    IpAddress { name: String, uid: Option<String> },
}

/// A Warning Event in Kubernetes' reason, action and wording.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventText {
    pub target: EventTarget,
    pub reason: &'static str,
    pub action: &'static str,
    pub note: String,
}

/// One inconsistency and what to do about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub kind: Kind,
    /// The address as written (a Service's clusterIP or an IPAddress name).
    pub address: String,
    /// Who holds it: `ns/name` of the Service(s), or the record's parentRef.
    pub owner: String,
    pub action: Action,
    /// The Service a created or replaced record belongs to.
    pub service: Option<(String, String)>,
    /// The record a release or replace deletes (name, uid, resourceVersion) — IPAddress only.
    pub record: Option<RecordView>,
    pub event: Option<EventText>,
}

/// The pass's result.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub services: usize,
    pub records: usize,
    /// Service addresses outside our ranges that we never assigned (another allocator's).
    pub foreign: usize,
}

impl Report {
    pub fn count(&self, kind: Kind) -> usize {
        self.findings.iter().filter(|f| f.kind == kind).count()
    }
}

impl Records {
    fn len(&self) -> usize {
        match self {
            Records::Map(m) => m.len(),
            Records::Objects(list) => list.len(),
        }
    }
}

impl Finding {
    /// A finding with nothing attached: no Service to act for, no record, no Event.
    fn new(kind: Kind, address: impl Into<String>, owner: impl Into<String>, action: Action) -> Self {
        Finding { kind, address: address.into(), owner: owner.into(), action, service: None, record: None, event: None }
    }

    /// The Service a created or replaced record belongs to.
    fn for_service(mut self, svc: &ServiceView) -> Self {
        self.service = Some((svc.namespace.clone(), svc.name.clone()));
        self
    }

    /// The record a release or replace deletes.
    fn with_record(mut self, r: &RecordView) -> Self {
        self.record = Some(r.clone());
        self
    }

    fn with_event(mut self, event: Option<EventText>) -> Self {
        self.event = event;
        self
    }
}

const READ_ONLY_AUDIT: &str = "read-only audit";


/// The address an IPAddress object is named for, when its name is a canonical address.
fn canonical(name: &str) -> Option<IpAddr> {
    cidr::parse_ip(name).ok().filter(|ip| ip.to_string() == name)
}

/// The pass. `leaks` carries the etcd backend's per-address counters from one pass to the
/// next (a fresh value for a one-shot run); it is updated here.
pub fn decide(cfg: &Config, services: &[ServiceView], records: &Records, leaks: &mut LeakCounts) -> Report {
    let pass = Pass::new(cfg, records);
    let mut report = Report { services: services.len(), records: records.len(), ..Default::default() };
    let owners = Owners::of(services, &mut report.findings);
    let mut list = Vec::new();
    for (ip, group) in owners.groups() {
        list.clear();
        list.extend(group.iter().map(|(_, s)| *s));
        pass.judge_address(ip, &list, records, leaks, &mut report);
    }
    match records {
        Records::Map(map) => map_leaks(cfg, map, &owners, leaks, &mut report.findings),
        Records::Objects(list) => pass.orphaned_objects(list, services, &owners, &mut report.findings),
    }
    report.findings.sort_by(|a, b| (a.kind, sort_key(&a.address), &a.owner).cmp(&(b.kind, sort_key(&b.address), &b.owner)));
    report
}

fn sort_key(text: &str) -> (Option<IpAddr>, &str) {
    (cidr::parse_ip(text).ok(), text)
}

/// The Services holding each parsed address, oldest first (the oldest keeps a duplicate):
/// one sorted list of (address, Service) pairs, 32 bytes a pair, rather than a map of lists
/// (a million Services: ~32 MB instead of ~80 MB).
struct Owners<'s> {
    pairs: Vec<(IpAddr, &'s ServiceView)>,
}

impl<'s> Owners<'s> {
    /// Addresses that do not parse are reported on the way. Stored addresses are read as
    /// Kubernetes' repair reads them (leading zeros, IPv4-mapped IPv6: the address they
    /// spell), never as new input.
    fn of(services: &'s [ServiceView], findings: &mut Vec<Finding>) -> Self {
        let mut pairs = Vec::with_capacity(services.len());
        for svc in services {
            for text in &svc.cluster_ips {
                match cidr::parse_ip_sloppy(text) {
                    Ok(ip) => pairs.push((ip, svc)),
                    Err(_) => findings.push(Finding::new(Kind::Malformed, text.clone(), svc.key(), Action::Event).with_event(Some(service_event(
                        svc,
                        "ClusterIPNotValid",
                        "ClusterIPValidation",
                        format!("Cluster IP {text} is not a valid IP; please recreate Service"),
                    )))),
                }
            }
        }
        // By address, then oldest first, then by "namespace/name" (compared without
        // building it); a Service listing an address twice counts once.
        pairs.sort_by(|(a_ip, a), (b_ip, b)| {
            a_ip.cmp(b_ip)
                .then(a.created.unwrap_or(i64::MAX).cmp(&b.created.unwrap_or(i64::MAX)))
                .then_with(|| a.namespace.bytes().chain(*b"/").chain(a.name.bytes()).cmp(b.namespace.bytes().chain(*b"/").chain(b.name.bytes())))
        });
        pairs.dedup_by(|(a_ip, a), (b_ip, b)| a_ip == b_ip && a.namespace == b.namespace && a.name == b.name);
        Owners { pairs }
    }

    /// Each address and its holders, in address order.
    fn groups(&self) -> impl Iterator<Item = (IpAddr, &[(IpAddr, &'s ServiceView)])> {
        self.pairs.chunk_by(|a, b| a.0 == b.0).map(|g| (g[0].0, g))
    }

    fn contains(&self, ip: &IpAddr) -> bool {
        self.pairs.binary_search_by(|(x, _)| x.cmp(ip)).is_ok()
    }
}

/// The etcd backend's leaks: allocated map addresses no Service holds, released on their
/// [`LEAK_PASSES`]th consecutive detection.
fn map_leaks(cfg: &Config, map: &BTreeSet<IpAddr>, owners: &Owners, leaks: &mut LeakCounts, findings: &mut Vec<Finding>) {
    let mut still = HashMap::new();
    for &ip in map {
        if owners.contains(&ip) {
            continue;
        }
        let seen = leaks.get(ip) + 1;
        still.insert(ip, seen);
        let action = if cfg.release_leaks_now || seen >= LEAK_PASSES { Action::Release } else { Action::ReleaseLater { seen, of: LEAK_PASSES } };
        findings.push(Finding::new(Kind::Leak, ip.to_string(), "-", action));
    }
    // Counters are for *consecutive* passes: anything not leaked now starts over.
    leaks.seen = still;
}

/// What every phase of one pass reads.
struct Pass<'a> {
    cfg: &'a Config,
    audit: bool,
    /// The managed-by label of the records the pass judges (none: the etcd backend's map).
    our_manager: Option<&'a str>,
    /// IPAddress objects by canonical name.
    objects: BTreeMap<IpAddr, &'a RecordView>,
}

impl<'a> Pass<'a> {
    fn new(cfg: &'a Config, records: &'a Records) -> Self {
        let our_manager = match &cfg.mode {
            Mode::Etcd => None,
            Mode::IpAddress { manager } | Mode::Audit { manager } => Some(manager.as_str()),
        };
        let objects = match records {
            Records::Map(_) => BTreeMap::new(),
            Records::Objects(list) => list.iter().filter_map(|r| canonical(&r.name).map(|ip| (ip, r))).collect(),
        };
        Pass { cfg, audit: matches!(cfg.mode, Mode::Audit { .. }), our_manager, objects }
    }

    fn ours(&self, r: &RecordView) -> bool {
        self.our_manager.is_some() && r.managed_by.as_deref() == self.our_manager
    }

    /// Why the pass may not change `r`, if it may not.
    fn read_only(&self, r: &RecordView) -> Option<String> {
        if self.audit {
            Some(READ_ONLY_AUDIT.into())
        } else if !self.ours(r) {
            Some(format!("managed by {}", r.managed_by.as_deref().unwrap_or("nobody (no managed-by label)")))
        } else {
            None
        }
    }

    /// `action`, or nothing in a read-only audit.
    fn unless_audit(&self, action: Action) -> Action {
        if self.audit {
            Action::None(READ_ONLY_AUDIT.into())
        } else {
            action
        }
    }

    /// The Service-side checks of one address and the Services holding it.
    fn judge_address(&self, ip: IpAddr, list: &[&ServiceView], records: &Records, leaks: &mut LeakCounts, report: &mut Report) {
        if !self.cfg.ranges.iter().any(|c| c.contains(ip)) {
            if self.claimed(ip, list) {
                self.out_of_range(ip, list, &mut report.findings);
            } else {
                report.foreign += 1;
            }
            return;
        }
        self.duplicates(ip, list, &mut report.findings);
        match records {
            Records::Map(map) => {
                leaks.forget(ip);
                if !map.contains(&ip) {
                    report.findings.push(missing_map_record(ip, list[0]));
                }
            }
            Records::Objects(_) => self.record_checks(ip, list, self.objects.get(&ip).copied(), &mut report.findings),
        }
    }

    /// Whether an address outside our ranges is ours to judge (else another allocator's).
    fn claimed(&self, ip: IpAddr, list: &[&ServiceView]) -> bool {
        self.audit
            || self.objects.get(&ip).is_some_and(|r| self.ours(r))
            || match &self.cfg.cluster_ranges {
                Some(cluster) => !cluster.iter().any(|c| c.contains(ip)),
                None => list.iter().any(|s| s.assigned_by_us().any(|t| cidr::parse_ip_sloppy(t).ok() == Some(ip))),
            }
    }

    /// A claimed address outside every configured range: each holder is told.
    fn out_of_range(&self, ip: IpAddr, list: &[&ServiceView], findings: &mut Vec<Finding>) {
        let cfg = self.cfg;
        let family = Family::of(ip);
        let configured: Vec<String> = cfg.ranges.iter().filter(|c| c.family() == family).map(|c| c.to_string()).collect();
        let family_known = !configured.is_empty() || cfg.cluster_ranges.iter().flatten().any(|c| c.family() == family);
        for svc in list {
            let (kind, reason, action, note) = if !family_known {
                (
                    Kind::FamilyNotConfigured,
                    "ClusterIPNotValid",
                    "ClusterIPValidation",
                    format!("Cluster IP {ip}({}) is of ip family that is no longer configured on cluster; please recreate service", Family::of(ip)),
                )
            } else if cfg.mode == Mode::Etcd && !configured.is_empty() {
                (
                    Kind::OutOfRange,
                    "ClusterIPOutOfRange",
                    "ClusterIPAllocation",
                    format!("Cluster IP [{}]:{ip} is not within the service CIDR {}; please recreate service", Family::of(ip), configured.join(", ")),
                )
            } else {
                (
                    Kind::OutOfRange,
                    "ClusterIPOutOfRange",
                    "ClusterIPAllocation",
                    format!("Cluster IP [{}]: {ip} is not within any configured Service CIDR; please recreate service", Family::of(ip)),
                )
            };
            findings.push(
                Finding::new(kind, ip.to_string(), svc.key(), self.unless_audit(Action::Event))
                    .with_event((!self.audit).then(|| service_event(svc, reason, action, note))),
            );
        }
    }

    /// One address on several Services: the oldest keeps it, the others are told.
    fn duplicates(&self, ip: IpAddr, list: &[&ServiceView], findings: &mut Vec<Finding>) {
        let first = list[0];
        for svc in &list[1..] {
            let event = (!self.audit).then(|| {
                service_event(
                    svc,
                    "ClusterIPAlreadyAllocated",
                    "ClusterIPAllocation",
                    format!("Cluster IP [{}]:{ip} was assigned to multiple services; please recreate service", Family::of(ip)),
                )
            });
            findings.push(
                Finding::new(Kind::Duplicate, ip.to_string(), format!("{} (also {})", svc.key(), first.key()), self.unless_audit(Action::Event)).with_event(event),
            );
        }
    }

    /// The checks of one in-range Service address against its IPAddress object.
    fn record_checks(&self, ip: IpAddr, owners: &[&ServiceView], record: Option<&RecordView>, findings: &mut Vec<Finding>) {
        let first = owners[0];
        let fam = Family::of(ip);
        let Some(r) = record else {
            let event = (!self.audit).then(|| {
                service_event(first, "ClusterIPNotAllocated", "ClusterIPAllocation", format!("Cluster IP [{fam}]: {ip} is not allocated; repairing"))
            });
            findings.push(Finding::new(Kind::MissingRecord, ip.to_string(), first.key(), self.unless_audit(Action::Create)).for_service(first).with_event(event));
            return;
        };
        let points_to_owner = r.parent.as_ref().is_some_and(|p| {
            p.is_service() && owners.iter().any(|s| p.namespace.as_deref().unwrap_or_default() == s.namespace && p.name == s.name)
        });
        let fix = || match self.read_only(r) {
            Some(why) => Action::None(why),
            None => Action::Replace,
        };
        let replace = |kind: Kind, owner: String| {
            let action = fix();
            let event = (action == Action::Replace).then(|| wrong_reference_event(first, fam, ip));
            Finding::new(kind, ip.to_string(), owner, action).for_service(first).with_record(r).with_event(event)
        };
        if !points_to_owner {
            let parent = r.parent.as_ref().map(|p| p.to_string()).unwrap_or_else(|| "no parentRef".into());
            findings.push(replace(Kind::WrongReference, format!("{} (record: {parent})", first.key())));
            return;
        }
        let family_ok = r.family_label.as_deref() == Some(fam.as_str());
        let manager_ok = match &self.cfg.mode {
            Mode::Audit { manager } => r.managed_by.as_deref() == Some(manager.as_str()),
            _ => r.managed_by.as_deref().is_some_and(|m| !m.is_empty()),
        };
        if !family_ok || !manager_ok {
            let mut wrong = Vec::new();
            if !family_ok {
                wrong.push(format!("ip-family={}", r.family_label.as_deref().unwrap_or("<missing>")));
            }
            if !manager_ok {
                wrong.push(format!("managed-by={}", r.managed_by.as_deref().unwrap_or("<missing>")));
            }
            findings.push(replace(Kind::WrongLabels, format!("{} (labels: {})", first.key(), wrong.join(", "))));
        }
    }

    /// Our IPAddress objects no Service holds: leaks, and references to the wrong Service.
    fn orphaned_objects(&self, list: &[RecordView], services: &[ServiceView], owners: &Owners, findings: &mut Vec<Finding>) {
        let by_name: HashMap<(&str, &str), &ServiceView> = services.iter().map(|s| ((s.namespace.as_str(), s.name.as_str()), s)).collect();
        for r in list {
            let judged = match self.our_manager {
                Some(m) => r.managed_by.as_deref() == Some(m),
                None => false,
            };
            if !judged {
                continue;
            }
            let Some(ip) = canonical(&r.name) else {
                let owner = r.parent.as_ref().map(|p| p.to_string()).unwrap_or_else(|| "-".into());
                let action = Action::None("not a canonical address; left for a person to look at".into());
                findings.push(Finding::new(Kind::Malformed, r.name.clone(), owner, action).with_record(r));
                continue;
            };
            if owners.contains(&ip) {
                continue; // judged from the Service side
            }
            if !self.audit && !self.cfg.ranges.iter().any(|c| c.contains(ip)) {
                // Outside our ranges: another configuration's record (one manager label
                // may be shared by instances with different ranges); not ours to release.
                continue;
            }
            let Some(parent) = r.parent.as_ref() else { continue };
            if !parent.is_service() {
                // Our records may belong to parents other than Services; those are not
                // ours to judge here (Kubernetes' own objects must name a Service).
                if self.audit {
                    findings.push(Finding::new(Kind::WrongReference, r.name.clone(), parent.to_string(), Action::None(READ_ONLY_AUDIT.into())).with_record(r));
                }
                continue;
            }
            let parent_held = by_name.contains_key(&(parent.namespace.as_deref().unwrap_or_default(), parent.name.as_str()));
            findings.push(self.orphaned_object(r, parent, parent_held));
        }
    }

    /// An object of ours naming a Service that does not hold its address: a leak once its
    /// Service is gone (after the grace period), else a wrong reference.
    fn orphaned_object(&self, r: &RecordView, parent: &ParentRef, parent_exists: bool) -> Finding {
        let cfg = self.cfg;
        let ns = parent.namespace.clone().unwrap_or_default();
        let (kind, action, note, reason) = if !parent_exists {
            let action = if cfg.release_leaks_now || r.age.is_some_and(|a| a > cfg.grace) {
                Action::Release
            } else {
                Action::ReleaseAfterGrace { age: r.age, grace: cfg.grace }
            };
            (
                Kind::Leak,
                self.unless_audit(action),
                format!("IPAddress: {} for Service {ns}/{} appears to have leaked: cleaning up", r.name, parent.name),
                "IPAddressNotAllocated",
            )
        } else {
            (
                Kind::WrongReference,
                self.unless_audit(Action::Release),
                format!("IPAddress: {} for Service {ns}/{} has a wrong reference; cleaning up", r.name, parent.name),
                "IPAddressWrongReference",
            )
        };
        let event = (action == Action::Release).then(|| EventText {
            target: EventTarget::IpAddress { name: r.name.clone(), uid: r.uid.clone() },
            reason,
            action: "IPAddressAllocation",
            note,
        });
        Finding::new(kind, r.name.clone(), parent.to_string(), action).with_record(r).with_event(event)
    }
}

/// The etcd backend: a held in-range address the allocation map does not record.
fn missing_map_record(ip: IpAddr, first: &ServiceView) -> Finding {
    let event = service_event(first, "ClusterIPNotAllocated", "ClusterIPAllocation", format!("Cluster IP [{}]:{ip} is not allocated; repairing", Family::of(ip)));
    Finding::new(Kind::MissingRecord, ip.to_string(), first.key(), Action::Create).for_service(first).with_event(Some(event))
}

/// Kubernetes' Event for a record that does not point at its Service the way it should.
fn wrong_reference_event(first: &ServiceView, fam: Family, ip: IpAddr) -> EventText {
    service_event(
        first,
        "ClusterIPNotAllocated",
        "ClusterIPAllocation",
        format!("the ClusterIP [{fam}]: {ip} for Service {}/{} has a wrong reference; repairing", first.namespace, first.name),
    )
}

fn service_event(svc: &ServiceView, reason: &'static str, action: &'static str, note: String) -> EventText {
    EventText {
        target: EventTarget::Service { namespace: svc.namespace.clone(), name: svc.name.clone(), uid: svc.uid.clone() },
        reason,
        action,
        note,
    }
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
