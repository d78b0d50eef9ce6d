//! Durable allocation records behind one interface, [`AllocationStore`].
//!
//! Two backends:
//! - [`etcd::EtcdStore`]: one etcd key per service CIDR holding the roaring-bitmap snapshot;
//!   every change is a transaction that compares the key's mod revision; concurrent callers
//!   in one process are batched into one transaction (group commit).
//! - [`ipaddress`]: `networking.k8s.io/v1` IPAddress objects, one per address; creating the
//!   object named by the address is the lock. Two stores, one a role: the controller's
//!   address blocks ([`ipaddress::blocks::BlockStore`]) and the one-shot commands' object
//!   writer ([`ipaddress::IpAddressStore`]); their module doc says which runs where.
//!
//! Both pick addresses with the same allocation map ([`crate::alloc`]), so the static/dynamic
//! band rules are identical; they differ only in how a choice is made durable.

pub mod etcd;
pub mod fold;
pub mod ipaddress;
pub mod legacy;
#[cfg(any(test, feature = "test-util"))]
pub mod memory;
mod ranges;

use std::net::IpAddr;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::alloc::AllocError;
use crate::cidr::{Family, ServiceCidr};

pub use ranges::{families_of, servicecidr_ranges, wanted_ranges, watch_servicecidrs, RangeSet};

/// Where allocation records live: the backends a controller runs with. `as_str()` is the
/// name logs, metrics and reports give it (and `--backend` takes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum BackendKind {
    /// A roaring-bitmap allocation map per range, one etcd key each.
    Etcd,
    /// networking.k8s.io/v1 IPAddress objects, through the kube-apiserver.
    Ipaddress,
}

impl BackendKind {
    /// "etcd", "ipaddress".
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Etcd => "etcd",
            BackendKind::Ipaddress => "ipaddress",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The object an address is allocated to, as an IPAddress `spec.parentRef` names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParentRef {
    /// API group; "" for the core group (Services).
    pub group: String,
    /// Resource, plural ("services").
    pub resource: String,
    /// Namespace, for namespaced parents.
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
}

impl ParentRef {
    /// The parentRef of a core Service.
    pub fn service(namespace: &str, name: &str) -> Self {
        Self { group: String::new(), resource: "services".into(), namespace: Some(namespace.into()), name: name.into() }
    }

    /// Whether this names a core Service. A Service's addresses are recorded by the
    /// kube-apiserver itself, as IPAddress objects; every other owner's only by us.
    pub fn is_service(&self) -> bool {
        self.group.is_empty() && self.resource == "services"
    }
}

impl From<&k8s_openapi::api::networking::v1::ParentReference> for ParentRef {
    /// The parentRef an IPAddress object carries (an absent group is the core group).
    fn from(p: &k8s_openapi::api::networking::v1::ParentReference) -> Self {
        Self { group: p.group.clone().unwrap_or_default(), resource: p.resource.clone(), namespace: p.namespace.clone(), name: p.name.clone() }
    }
}

impl From<&ParentRef> for k8s_openapi::api::networking::v1::ParentReference {
    /// The parentRef an IPAddress object carries (the core group as no group).
    fn from(p: &ParentRef) -> Self {
        Self { group: Some(p.group.clone()).filter(|g| !g.is_empty()), resource: p.resource.clone(), namespace: p.namespace.clone(), name: p.name.clone() }
    }
}

impl std::fmt::Display for ParentRef {
    /// `services/default/web`, `gateways.gateway.networking.k8s.io/ns/name`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.resource)?;
        if !self.group.is_empty() {
            write!(f, ".{}", self.group)?;
        }
        if let Some(ns) = &self.namespace {
            write!(f, "/{ns}")?;
        }
        write!(f, "/{}", self.name)
    }
}

/// Why a store could not do what was asked.
///
/// `Clone`, so the one error of a batched etcd transaction reaches each of its callers
/// whole: the kind, the text and the underlying error (a shared [`Cause`]).
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The allocation rules said no (not in range, already allocated, full).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// No configured range of the requested family.
    #[error("no service CIDR of family {0} is configured")]
    NoRangeForFamily(Family),
    /// The record could not be read or written; nothing was acknowledged.
    #[error("allocation store unavailable: {0}")]
    Unavailable(#[source] Cause),
    /// The store has not finished its first sync.
    #[error("allocator not ready")]
    NotReady,
    /// A release by someone other than the address's recorded owner: nothing was released.
    #[error("{ip} is held by {owner}; only its owner releases it (pass --parent {owner})")]
    NotOwner { ip: IpAddr, owner: ParentRef },
    /// An owned release of an address recorded without an owner: nothing was released.
    #[error("{0} is recorded without an owner; release it without --parent")]
    NoOwnerRecorded(IpAddr),
    /// A stored record could not be read. The allocator does not guess what it held: it
    /// refuses to allocate from (or release through) that record until it is readable again
    /// (`clusterip repair --rebuild` for an allocation map; docs/operations.md).
    #[error("{record} is unreadable ({reason}); {consequence}")]
    Corrupt { record: String, reason: String, consequence: &'static str },
    /// The store was asked for something its configuration rules out (no range at all, a
    /// range it does not hold).
    #[error("{0}")]
    Config(String),
    /// The backend refused a request for good (not worth retrying unchanged).
    #[error("{0}")]
    Backend(#[source] Cause),
}

/// What a backend call failed on: what was being done, and the error underneath (shared,
/// so a cloned [`StoreError`] keeps it). Displays as `context: source`.
#[derive(Clone, Debug)]
pub struct Cause {
    context: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl Cause {
    /// A cause with nothing underneath (the context says it all).
    pub fn new(context: impl Into<String>) -> Self {
        Self { context: context.into(), source: None }
    }

    /// `context`, caused by `source`.
    pub fn with(context: impl Into<String>, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self { context: context.into(), source: Some(Arc::new(source)) }
    }
}

impl From<String> for Cause {
    fn from(context: String) -> Self {
        Self::new(context)
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.context)?;
        match &self.source {
            Some(s) => write!(f, ": {s}"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|s| s as &(dyn std::error::Error + 'static))
    }
}

/// A stored record the backend cannot read (see [`StoreError::Corrupt`]), as reported by
/// [`AllocationStore::unreadable`] and the `clusterip_allocator_unreadable_records` gauge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreadable {
    /// What kind of record: `allocation_map`, `owner`, `pool`, `ipaddress`.
    pub kind: &'static str,
    /// Where it is (the etcd key, the object's name).
    pub record: String,
    /// What is wrong with it.
    pub reason: String,
}

impl StoreError {
    /// True when the request may succeed if retried unchanged (the backend was unreachable).
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::NotReady)
    }

    /// The one reading of a kube-apiserver error: a 5xx, a 429 or no answer at all is
    /// `Unavailable` (retry), any other refusal `Backend`.
    pub fn from_kube(context: impl Into<String>, e: kube::Error) -> Self {
        let refused = matches!(&e, kube::Error::Api(s) if s.code < 500 && s.code != 429);
        let cause = Cause::with(context, e);
        if refused {
            StoreError::Backend(cause)
        } else {
            StoreError::Unavailable(cause)
        }
    }

    /// The error's kind, as a metric label value.
    pub fn metric_label(&self) -> &'static str {
        match self {
            StoreError::Alloc(AllocError::NotInRange { .. } | AllocError::MismatchedNetwork) => "not_in_range",
            StoreError::Alloc(AllocError::Allocated) => "allocated",
            StoreError::Alloc(AllocError::Full) => "full",
            StoreError::Alloc(AllocError::Snapshot(_)) | StoreError::Corrupt { .. } => "corrupt",
            StoreError::NoRangeForFamily(_) | StoreError::Config(_) => "config",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::NotReady => "not_ready",
            StoreError::NotOwner { .. } | StoreError::NoOwnerRecorded(_) => "not_owner",
            StoreError::Backend(_) => "backend",
        }
    }
}

/// The durable record of allocations over a set of service CIDRs.
///
/// Every successful `allocate`/`allocate_next` is durable when it returns: a new process
/// reading the same backend sees it. Every error means nothing was allocated *for this
/// caller*; after an `Unavailable` error the address may still have been recorded (etcd may
/// have applied a write whose answer was lost) — a leak the repair pass reclaims, never a
/// duplicate.
#[async_trait]
pub trait AllocationStore: Send + Sync {
    /// Backend name for logs and metrics: [`BackendKind::as_str`] of the backend ("memory"
    /// for the unit tests' store).
    fn backend(&self) -> &'static str;

    /// The ranges addresses come from now, in the order they are tried (configuration
    /// order; with ServiceCIDR objects followed, theirs after the configured ones).
    fn ranges(&self) -> Vec<ServiceCidr>;

    /// The cluster's IP families, the default first: those of the configured ranges (a
    /// ServiceCIDR object of another family does not make a cluster dual-stack, as in
    /// Kubernetes, where the kube-apiserver's own ranges decide).
    fn families(&self) -> Vec<Family> {
        families_of(&self.ranges())
    }

    /// Reserve a requested address (static allocation).
    async fn allocate(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<(), StoreError>;

    /// Reserve the next free address of `family` (dynamic allocation: the dynamic band of
    /// each range first, the static band only when it is full).
    async fn allocate_next(&self, family: Family, parent: Option<&ParentRef>) -> Result<IpAddr, StoreError>;

    /// Release an address that no recorded owner holds (a Service's, or one recorded
    /// without a parent); releasing a free or out-of-range address is a no-op. An address
    /// with a recorded owner ([`owner`](Self::owner)) is not released: `NotOwner`.
    async fn release(&self, ip: IpAddr) -> Result<(), StoreError>;

    /// Release an address on behalf of `owner`: only while the records say `owner` holds
    /// it (`NotOwner` otherwise, and nothing changes). Backends without owner records
    /// release as [`release`](Self::release) does.
    async fn release_owned(&self, ip: IpAddr, owner: &ParentRef) -> Result<(), StoreError> {
        let _ = owner;
        self.release(ip).await
    }

    /// The owner recorded for an allocated address, read from the backend's storage (not
    /// from a cache), for owners other than Services (whose addresses the kube-apiserver
    /// records as IPAddress objects). None: free, or held without a recorded owner.
    async fn owner(&self, ip: IpAddr) -> Result<Option<ParentRef>, StoreError> {
        let _ = ip;
        Ok(None)
    }

    /// Every address with a recorded owner, and the owner.
    async fn owners(&self) -> Result<Vec<(IpAddr, ParentRef)>, StoreError> {
        Ok(Vec::new())
    }

    /// Counts of the backend's own coordination events since this process started, by
    /// name (the ipaddress backend's address blocks: `blocks::EVENTS`); empty for
    /// backends without any.
    fn block_events(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }

    /// Whether the address is recorded as allocated.
    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError>;

    /// Every allocated address inside the configured ranges, in address order.
    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError>;

    /// Allocated and free addresses per range.
    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError>;

    /// Whether the store can serve allocations now, checked against the backend itself (one
    /// round trip, not a cache): the controller's `/readyz`. Backends without a better check
    /// answer a usage query.
    async fn ready(&self) -> Result<(), StoreError> {
        self.usage().await.map(|_| ())
    }

    /// Stored records the backend found unreadable (and so refuses to act on).
    fn unreadable(&self) -> Vec<Unreadable> {
        Vec::new()
    }

    /// Hand back anything held ahead of need (the etcd backend's address pool) before the
    /// process exits. Nothing to do for most backends.
    async fn close(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Record every address of `ips` that lies in the store's ranges and is not recorded yet,
/// without an owner (the controller's start: what the cluster already holds). All requests
/// are in flight at once, so the etcd backend's group commit makes them durable in as few
/// transactions as its batch size allows (one per range for up to `--etcd-max-batch`
/// addresses), never one per address; addresses already recorded cost nothing. Returns
/// how many were recorded and the errors of those that could not be (an address recorded
/// meanwhile is not an error).
pub async fn record_missing(store: &dyn AllocationStore, ips: impl IntoIterator<Item = IpAddr>) -> (usize, Vec<(IpAddr, StoreError)>) {
    use futures::StreamExt;
    let ranges = store.ranges();
    let mut missing = Vec::new();
    for ip in ips.into_iter().filter(|ip| ranges.iter().any(|c| c.contains(*ip))) {
        if !matches!(store.has(ip).await, Ok(true)) {
            missing.push(ip);
        }
    }
    let results: Vec<(IpAddr, Result<(), StoreError>)> =
        futures::stream::iter(missing).map(|ip| async move { (ip, store.allocate(ip, None).await) }).buffer_unordered(4096).collect().await;
    let mut recorded = 0;
    let mut failed = Vec::new();
    for (ip, r) in results {
        match r {
            Ok(()) => recorded += 1,
            Err(StoreError::Alloc(AllocError::Allocated)) => {}
            Err(e) => failed.push((ip, e)),
        }
    }
    (recorded, failed)
}

/// How full one range is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeUsage {
    pub cidr: ServiceCidr,
    pub used: u64,
    /// Free addresses, including those held in address pools.
    pub free: u64,
    /// Free addresses held ahead of need in controller replicas' address pools (etcd backend).
    pub pooled: u64,
    /// The size of the range's allocation map as stored (etcd backend: its value, bytes),
    /// which etcd refuses to write past its `--max-request-bytes` (1.5 MiB by default).
    pub map_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::BackendKind;
    use clap::ValueEnum as _;

    #[test]
    fn a_backend_is_named_as_the_backend_flag_spells_it() {
        for kind in BackendKind::value_variants() {
            let flag = kind.to_possible_value().expect("a --backend value");
            assert_eq!(flag.get_name(), kind.as_str());
            assert_eq!(kind.to_string(), kind.as_str());
        }
        assert_eq!([BackendKind::Etcd.as_str(), BackendKind::Ipaddress.as_str()], ["etcd", "ipaddress"]);
    }
}
