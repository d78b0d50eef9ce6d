//! The one-shot commands' IPAddress store: one `networking.k8s.io/v1` IPAddress object per
//! allocated address, created by us.
//!
//! - The object is named by the canonical text of the address; **creating it is the lock**:
//!   `AlreadyExists` means another writer (another replica, the kube-apiserver's own
//!   allocator, anyone) holds the address, so the next candidate is tried, a bounded number
//!   of times. Any other error is returned and the candidate is freed locally.
//! - Candidates come from a watch-fed cache (one allocation map per range, the same map the
//!   etcd backend uses), never from a list per allocation.
//! - Objects we create carry `spec.parentRef` and the labels
//!   `ipaddress.kubernetes.io/ip-family` and `ipaddress.kubernetes.io/managed-by=<manager>`.
//!   Objects managed by anyone else count as allocated and are never changed or deleted.
//! - Ranges come from flags and from ServiceCIDR objects (when enabled). A ServiceCIDR that
//!   is being deleted, or whose Ready condition is not True, gives no new addresses (a
//!   ServiceCIDR with no Ready condition yet counts as ready, as in Kubernetes).

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::Client;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::debug;

use crate::alloc::{AllocError, AllocationMap};
use crate::cidr::{Family, ServiceCidr};
use crate::k8s;

use crate::store::fold::{fold, Change};
use crate::store::{AllocationStore, BackendKind, ParentRef, RangeUsage, StoreError};
use crate::sync::lock;

/// Our value of the managed-by label.
pub const DEFAULT_MANAGER: &str = "clusterip.allocator";

/// How the IPAddress backend finds its ranges and names itself.
#[derive(Clone, Debug)]
pub struct IpAddressConfig {
    /// Ranges given on the command line (always allocatable).
    pub ranges: Vec<ServiceCidr>,
    /// Also allocate from the ServiceCIDR objects of the cluster.
    pub use_servicecidrs: bool,
    /// Value of the managed-by label on objects we create.
    pub manager: String,
    /// parentRef written when a caller names no parent.
    pub default_parent: ParentRef,
    /// How long `open` waits for the first full sync of the caches.
    pub sync_timeout: Duration,
}

impl Default for IpAddressConfig {
    fn default() -> Self {
        Self {
            ranges: Vec::new(),
            use_servicecidrs: false,
            manager: DEFAULT_MANAGER.into(),
            default_parent: ParentRef {
                group: "clusterip.allocator".into(),
                resource: "reservations".into(),
                namespace: None,
                name: "unassigned".into(),
            },
            sync_timeout: Duration::from_secs(120),
        }
    }
}

/// One range and its two maps: what the watch has seen (`observed`) and what may not be
/// handed out (`taken` = observed ∪ our creates in flight).
struct RangeState {
    cidr: ServiceCidr,
    observed: AllocationMap,
    taken: AllocationMap,
    allocatable: bool,
}

#[derive(Default)]
struct State {
    synced_ipaddresses: bool,
    synced_servicecidrs: bool,
    /// Every IPAddress the watch has seen, with whether we manage it.
    objects: BTreeMap<IpAddr, bool>,
    /// Our creates in flight.
    pending: HashSet<IpAddr>,
    /// Ranges from ServiceCIDR objects: cidr → allocatable (ready and not deleting).
    from_servicecidrs: BTreeMap<String, Vec<(ServiceCidr, bool)>>,
    ranges: Vec<RangeState>,
}

impl State {
    fn ready(&self, want_servicecidrs: bool) -> bool {
        self.synced_ipaddresses && (!want_servicecidrs || self.synced_servicecidrs)
    }

    fn observe(&mut self, ip: IpAddr, ours: bool) {
        self.objects.insert(ip, ours);
        for r in self.ranges.iter_mut().filter(|r| r.cidr.contains(ip)) {
            let _ = r.observed.allocate(ip);
            let _ = r.taken.allocate(ip);
        }
    }

    fn forget(&mut self, ip: IpAddr) {
        self.objects.remove(&ip);
        let pending = self.pending.contains(&ip);
        for r in self.ranges.iter_mut().filter(|r| r.cidr.contains(ip)) {
            r.observed.release(ip);
            if !pending {
                r.taken.release(ip);
            }
        }
    }

    /// Recompute the range list from flags + ServiceCIDRs, keeping existing maps.
    fn rebuild_ranges(&mut self, flag_ranges: &[ServiceCidr]) {
        let wanted = crate::store::wanted_ranges(flag_ranges, self.from_servicecidrs.values().map(Vec::as_slice));
        let mut old: Vec<RangeState> = std::mem::take(&mut self.ranges);
        for (cidr, allocatable) in wanted {
            if let Some(pos) = old.iter().position(|r| r.cidr == cidr) {
                let mut r = old.swap_remove(pos);
                r.allocatable = allocatable;
                self.ranges.push(r);
                continue;
            }
            let mut observed = AllocationMap::new(cidr.clone());
            for ip in self.objects.keys().filter(|ip| cidr.contains(**ip)) {
                let _ = observed.allocate(*ip);
            }
            let mut taken = observed.clone();
            for ip in self.pending.iter().filter(|ip| cidr.contains(**ip)) {
                let _ = taken.allocate(*ip);
            }
            self.ranges.push(RangeState { cidr, observed, taken, allocatable });
        }
    }

    fn not_in_range(&self, ip: IpAddr) -> StoreError {
        let family = Family::of(ip);
        let valid: Vec<String> = self
            .ranges
            .iter()
            .filter(|r| r.allocatable && r.cidr.family() == family)
            .map(|r| r.cidr.to_string())
            .collect();
        StoreError::Alloc(AllocError::NotInRange { ip, valid_range: valid.join(", ") })
    }
}

/// Allocation records as IPAddress objects.
pub struct IpAddressStore {
    api: Api<IPAddress>,
    cfg: IpAddressConfig,
    state: Arc<Mutex<State>>,
    /// The IPAddress and ServiceCIDR watches: aborted when the store drops.
    _tasks: JoinSet<()>,
}

impl IpAddressStore {
    /// Start the watches and wait until the caches hold a full list.
    pub async fn open(client: Client, cfg: IpAddressConfig) -> Result<Self, StoreError> {
        if cfg.ranges.is_empty() && !cfg.use_servicecidrs {
            return Err(StoreError::Config("no service CIDR configured: give ranges or enable ServiceCIDR objects".into()));
        }
        let state = Arc::new(Mutex::new(State::default()));
        lock(&state).rebuild_ranges(&cfg.ranges);
        let (changed_tx, mut changed_rx) = watch::channel(());
        let mut tasks = JoinSet::new();
        tasks.spawn(watch_ipaddresses(Api::all(client.clone()), state.clone(), cfg.manager.clone(), changed_tx.clone()));
        if cfg.use_servicecidrs {
            tasks.spawn(watch_servicecidrs(Api::all(client.clone()), state.clone(), cfg.ranges.clone(), changed_tx));
        }
        let store = Self { api: Api::all(client), cfg, state, _tasks: tasks };
        let deadline = tokio::time::Instant::now() + store.cfg.sync_timeout;
        while !lock(&store.state).ready(store.cfg.use_servicecidrs) {
            if tokio::time::timeout_at(deadline, changed_rx.changed()).await.is_err() {
                return Err(StoreError::Unavailable(format!(
                    "IPAddress cache not synced within {:?}: is the kube-apiserver reachable, and does it serve networking.k8s.io/v1?",
                    store.cfg.sync_timeout
                )
                .into()));
            }
        }
        Ok(store)
    }

    fn check_ready(&self) -> Result<(), StoreError> {
        if lock(&self.state).ready(self.cfg.use_servicecidrs) {
            Ok(())
        } else {
            Err(StoreError::NotReady)
        }
    }

    fn object(&self, ip: IpAddr, parent: Option<&ParentRef>) -> IPAddress {
        let parent = parent.unwrap_or(&self.cfg.default_parent);
        k8s::ipaddress::build(ip, parent.into(), &self.cfg.manager)
    }

    /// Create the object for a candidate the caller already marked taken and pending.
    /// Ok(true) = ours now; Ok(false) = somebody else holds it (AlreadyExists).
    async fn create(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<bool, StoreError> {
        let result = self.api.create(&PostParams::default(), &self.object(ip, parent)).await;
        let mut st = lock(&self.state);
        st.pending.remove(&ip);
        match result {
            Ok(_) => {
                // Record it now; the watch will confirm it.
                st.observe(ip, true);
                Ok(true)
            }
            Err(kube::Error::Api(status)) if status.code == 409 && status.reason == "AlreadyExists" => {
                // Taken by someone: keep it out of the candidates until the watch says otherwise.
                if let std::collections::btree_map::Entry::Vacant(e) = st.objects.entry(ip) {
                    e.insert(false);
                    for r in st.ranges.iter_mut().filter(|r| r.cidr.contains(ip)) {
                        let _ = r.observed.allocate(ip);
                    }
                }
                Ok(false)
            }
            Err(e) => {
                if !st.objects.contains_key(&ip) {
                    for r in st.ranges.iter_mut().filter(|r| r.cidr.contains(ip)) {
                        r.taken.release(ip);
                    }
                }
                Err(api_error("creating IPAddress", &ip.to_string(), e))
            }
        }
    }
}

fn api_error(what: &str, name: &str, e: kube::Error) -> StoreError {
    StoreError::from_kube(format!("{what} {name}"), e)
}

#[async_trait]
impl AllocationStore for IpAddressStore {
    fn backend(&self) -> &'static str {
        BackendKind::Ipaddress.as_str()
    }

    fn ranges(&self) -> Vec<ServiceCidr> {
        lock(&self.state).ranges.iter().filter(|r| r.allocatable).map(|r| r.cidr.clone()).collect()
    }

    async fn allocate(&self, ip: IpAddr, parent: Option<&ParentRef>) -> Result<(), StoreError> {
        self.check_ready()?;
        {
            let mut st = lock(&self.state);
            let Some(i) = st.ranges.iter().position(|r| r.allocatable && r.cidr.contains(ip)) else {
                return Err(st.not_in_range(ip));
            };
            st.ranges[i].taken.allocate(ip)?;
            st.pending.insert(ip);
        }
        if self.create(ip, parent).await? {
            Ok(())
        } else {
            Err(StoreError::Alloc(AllocError::Allocated))
        }
    }

    async fn allocate_next(&self, family: Family, parent: Option<&ParentRef>) -> Result<IpAddr, StoreError> {
        self.check_ready()?;
        let mut collisions = 0;
        loop {
            let candidate = {
                let mut st = lock(&self.state);
                let mut any = false;
                let mut found = None;
                for r in st.ranges.iter_mut().filter(|r| r.allocatable && r.cidr.family() == family) {
                    any = true;
                    match r.taken.allocate_next() {
                        Ok(ip) => {
                            found = Some(ip);
                            break;
                        }
                        Err(AllocError::Full) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                match found {
                    Some(ip) => {
                        st.pending.insert(ip);
                        ip
                    }
                    None if any => return Err(StoreError::Alloc(AllocError::Full)),
                    None => return Err(StoreError::NoRangeForFamily(family)),
                }
            };
            if self.create(candidate, parent).await? {
                return Ok(candidate);
            }
            // Taken by another writer our view had not shown yet. The candidate stays marked
            // in our map, so the next one differs; as Kubernetes' allocator does, every
            // address the view shows free is tried before the range counts as full (a fixed
            // cap would refuse allocations only because a busy machine's watch lags).
            collisions += 1;
            debug!(ip = %candidate, collisions, "IPAddress already exists; trying the next candidate");
        }
    }

    async fn release(&self, ip: IpAddr) -> Result<(), StoreError> {
        self.release_if(ip, None).await
    }

    async fn release_owned(&self, ip: IpAddr, owner: &ParentRef) -> Result<(), StoreError> {
        self.release_if(ip, Some(owner)).await
    }

    async fn owner(&self, ip: IpAddr) -> Result<Option<ParentRef>, StoreError> {
        self.check_ready()?;
        let name = ip.to_string();
        match self.api.get_opt(&name).await {
            Ok(obj) => Ok(obj.map(|o| ParentRef::from(&o.spec.parent_ref)).filter(|p| !p.is_service())),
            Err(e) => Err(api_error("reading IPAddress", &name, e)),
        }
    }

    async fn has(&self, ip: IpAddr) -> Result<bool, StoreError> {
        self.check_ready()?;
        Ok(lock(&self.state).objects.contains_key(&ip))
    }

    async fn allocated(&self) -> Result<Vec<IpAddr>, StoreError> {
        self.check_ready()?;
        let st = lock(&self.state);
        Ok(st.objects.keys().filter(|ip| st.ranges.iter().any(|r| r.cidr.contains(**ip))).copied().collect())
    }

    async fn usage(&self) -> Result<Vec<RangeUsage>, StoreError> {
        self.check_ready()?;
        let st = lock(&self.state);
        Ok(st.ranges.iter().map(|r| RangeUsage { cidr: r.cidr.clone(), used: r.observed.used(), free: r.observed.free(), pooled: 0, map_bytes: None }).collect())
    }
}

impl IpAddressStore {
    /// Delete our IPAddress for `ip`, read from storage: with `owner`, only if its parentRef
    /// names that owner; without, only if it names no owner but a Service (or none).
    async fn release_if(&self, ip: IpAddr, owner: Option<&ParentRef>) -> Result<(), StoreError> {
        self.check_ready()?;
        let ours = lock(&self.state).objects.get(&ip).copied();
        match ours {
            None => Ok(()),
            Some(false) => {
                debug!(%ip, "not releasing an IPAddress managed by another controller");
                Ok(())
            }
            Some(true) => {
                // The watch says ours; the delete must not act on that alone (it may lag: our
                // object gone, the address now someone else's). Read the object from storage
                // and delete exactly that one, with its uid and resourceVersion as
                // preconditions.
                let name = ip.to_string();
                let current = match self.api.get_opt(&name).await {
                    Ok(Some(obj)) => obj,
                    Ok(None) => {
                        lock(&self.state).forget(ip);
                        return Ok(());
                    }
                    Err(e) => return Err(api_error("reading IPAddress", &name, e)),
                };
                if !k8s::ipaddress::managed_by(&current, &self.cfg.manager) {
                    debug!(%ip, "not releasing an IPAddress managed by another controller");
                    return Ok(());
                }
                let recorded = Some(ParentRef::from(&current.spec.parent_ref)).filter(|p| !p.is_service());
                match (recorded, owner) {
                    (Some(o), None) => return Err(StoreError::NotOwner { ip, owner: o }),
                    (Some(o), Some(r)) if &o != r => return Err(StoreError::NotOwner { ip, owner: o }),
                    _ => {}
                }
                let preconditions = Preconditions { uid: current.metadata.uid.clone(), resource_version: current.metadata.resource_version.clone() };
                match self.api.delete(&name, &DeleteParams { preconditions: Some(preconditions), ..Default::default() }).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    // Changed since the read (replaced or updated): not the object we judged.
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        return Err(StoreError::Unavailable(format!("IPAddress {name} changed while being released; retry").into()));
                    }
                    Err(e) => return Err(api_error("deleting IPAddress", &name, e)),
                }
                lock(&self.state).forget(ip);
                Ok(())
            }
        }
    }
}

/// Parse an IPAddress name; names that are not canonical addresses are ignored.
fn address_of(obj: &IPAddress) -> Option<IpAddr> {
    k8s::ipaddress::canonical_address(obj.metadata.name.as_deref()?)
}

async fn watch_ipaddresses(api: Api<IPAddress>, state: Arc<Mutex<State>>, manager: String, changed: watch::Sender<()>) {
    let read = |obj: &IPAddress| Some((address_of(obj)?, k8s::ipaddress::managed_by(obj, &manager)));
    fold(api, "IPAddress", read, |change| match change {
        Change::Replace(list) => {
            let list: BTreeMap<IpAddr, bool> = list.into_iter().flatten().collect();
            let mut st = lock(&state);
            let gone: Vec<IpAddr> = st.objects.keys().filter(|ip| !list.contains_key(ip)).copied().collect();
            for ip in gone {
                st.forget(ip);
            }
            for (ip, ours) in list {
                st.observe(ip, ours);
            }
            st.synced_ipaddresses = true;
            drop(st);
            changed.send_replace(());
        }
        Change::Apply(Some((ip, ours))) => lock(&state).observe(ip, ours),
        Change::Delete(Some((ip, _))) => lock(&state).forget(ip),
        Change::Apply(None) | Change::Delete(None) => {}
    })
    .await
}

async fn watch_servicecidrs(api: Api<ServiceCIDR>, state: Arc<Mutex<State>>, flag_ranges: Vec<ServiceCidr>, changed: watch::Sender<()>) {
    crate::store::watch_servicecidrs(api, |objects| {
        let mut st = lock(&state);
        st.from_servicecidrs = objects.clone();
        st.synced_servicecidrs = true;
        st.rebuild_ranges(&flag_ranges);
        drop(st);
        changed.send_replace(());
    })
    .await
}
