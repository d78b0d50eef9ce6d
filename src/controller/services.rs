//! Keeps the allocation records and the Services consistent, from a watch on Services:
//! - a Service that holds an address in our ranges the records lack → the address is
//!   recorded, and a Warning `ClusterIPNotAllocated` Event says so;
//! - an address that does not parse → Warning `ClusterIPNotValid`. Stored addresses are read
//!   as Kubernetes' repair reads them ([`cidr::parse_ip_sloppy`]): a Service stored before the
//!   apiserver validated strictly (`010.96.0.1`, `::ffff:10.96.0.1`) holds that address, and
//!   gets no Event stock Kubernetes would not post;
//! - a deleted Service, or one that no longer holds an address (changed to ExternalName,
//!   downgraded to one family) → those addresses in our ranges are released, once the
//!   kube-apiserver no longer records them (read from storage; it deletes a Service's
//!   IPAddress objects just after the Service). One it still records after
//!   [`RELEASE_PATIENCE`] has a new holder (the Service created again, another one) and is
//!   left as it is; one with a recorded non-Service owner is never released here.
//!
//! Leaks left by a Service deleted while no replica was leading are the repair pass's job.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use tracing::{debug, info, warn};

use crate::cidr::{self, Family};
use crate::history::{Decision, Notes};
use crate::k8s::service::held_ips;
use crate::metrics::Metrics;
use crate::store::ipaddress::apiserver_ips::ApiserverIps;
use crate::store::{AllocationStore, ParentRef, StoreError};

use super::events::ServiceEvents;

/// Record what a live Service holds (each address recorded here is noted in `history`).
pub async fn sync_present(store: &dyn AllocationStore, events: &ServiceEvents, svc: &Service, history: Option<&Notes>) -> Result<(), StoreError> {
    let ranges = store.ranges();
    for text in held_ips(svc) {
        let ip = match cidr::parse_ip_sloppy(&text) {
            Ok(ip) => ip,
            Err(_) => {
                events.warn(svc, "ClusterIPNotValid", "ClusterIPValidation", format!("Cluster IP {text} is not a valid IP; please recreate Service")).await;
                continue;
            }
        };
        if !ranges.iter().any(|c| c.contains(ip)) {
            continue;
        }
        if record_if_missing(store, ip).await? {
            if let Some(h) = history {
                h.note(ip, Some(&parent_of(svc)), Decision::RecordedForService);
            }
            events
                .warn(svc, "ClusterIPNotAllocated", "ClusterIPAllocation", format!("Cluster IP [{}]: {ip} is not allocated; repairing", Family::of(ip)))
                .await;
        }
    }
    Ok(())
}

/// Record an address in our ranges a live Service holds, when the records lack it. True
/// when it was recorded here (the records lacked it: an Event says so).
pub async fn record_if_missing(store: &dyn AllocationStore, ip: IpAddr) -> Result<bool, StoreError> {
    if store.has(ip).await? {
        return Ok(false);
    }
    match store.allocate(ip, None).await {
        Ok(()) => Ok(true),
        Err(StoreError::Alloc(crate::alloc::AllocError::Allocated)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// How long an address a Service gave up may still be recorded by the apiserver before it
/// counts as held by someone new (and is not released here).
pub const RELEASE_PATIENCE: Duration = Duration::from_secs(30);
/// How often addresses waiting for release are looked at.
const RELEASE_TICK: Duration = Duration::from_secs(1);

/// The addresses in our ranges a Service holds.
fn held_in(ranges: &[crate::cidr::ServiceCidr], svc: &Service) -> Vec<IpAddr> {
    held_ips(svc).iter().filter_map(|t| cidr::parse_ip_sloppy(t).ok()).filter(|ip| ranges.iter().any(|c| c.contains(*ip))).collect()
}

fn parent_of(svc: &Service) -> ParentRef {
    ParentRef::service(svc.metadata.namespace.as_deref().unwrap_or_default(), svc.metadata.name.as_deref().unwrap_or_default())
}

fn key_of(svc: &Service) -> String {
    svc.metadata.uid.clone().unwrap_or_else(|| format!("{}/{}", svc.metadata.namespace.as_deref().unwrap_or_default(), svc.metadata.name.as_deref().unwrap_or_default()))
}

/// What each Service held at its last event (by uid), and so what it has given up since:
/// the reconciler's decisions, apart from the watch that feeds them.
pub struct Holdings {
    ranges: Vec<crate::cidr::ServiceCidr>,
    held: HashMap<String, Vec<IpAddr>>,
}

impl Holdings {
    pub fn new(ranges: Vec<crate::cidr::ServiceCidr>) -> Self {
        Self { ranges, held: HashMap::new() }
    }

    /// A Service as stored now: the addresses in our ranges it held at its last event and
    /// holds no longer (changed to ExternalName, downgraded to one family).
    pub fn applied(&mut self, svc: &Service) -> Vec<IpAddr> {
        let now = held_in(&self.ranges, svc);
        match self.held.insert(key_of(svc), now.clone()) {
            Some(before) => before.into_iter().filter(|ip| !now.contains(ip)).collect(),
            None => Vec::new(),
        }
    }

    /// A deleted Service: every address in our ranges it held.
    pub fn deleted(&mut self, svc: &Service) -> Vec<IpAddr> {
        self.held.remove(&key_of(svc));
        held_in(&self.ranges, svc)
    }

    /// The store's ranges now (they change while the controller follows ServiceCIDR
    /// objects): a Service's addresses in a range added since are its holdings too.
    pub fn set_ranges(&mut self, ranges: Vec<crate::cidr::ServiceCidr>) {
        self.ranges = ranges;
    }

    /// A relist begins: what Services held before is forgotten (a Service seen again
    /// gives up nothing on its first event).
    pub fn relist(&mut self) {
        self.held.clear();
    }
}

/// Addresses Services gave up, released once the apiserver no longer records them.
pub struct Releases {
    store: Arc<dyn AllocationStore>,
    recorded: ApiserverIps,
    /// Address → when it was given up, by which Service, and why.
    waiting: HashMap<IpAddr, (Instant, ParentRef, Decision)>,
    patience: Duration,
    history: Option<Notes>,
}

impl Releases {
    pub fn new(store: Arc<dyn AllocationStore>, recorded: ApiserverIps) -> Self {
        Self { store, recorded, waiting: HashMap::new(), patience: RELEASE_PATIENCE, history: None }
    }

    /// Noting each release in the address history.
    pub fn with_history(mut self, history: Option<Notes>) -> Self {
        self.history = history;
        self
    }

    /// With another patience (tests).
    pub fn with_patience(mut self, patience: Duration) -> Self {
        self.patience = patience;
        self
    }

    /// An address `svc` no longer holds: `why` it was deleted
    /// ([`Decision::ServiceDeleted`]) or changed ([`Decision::ServiceChanged`]).
    pub fn given_up(&mut self, ip: IpAddr, svc: &Service, why: Decision) {
        self.waiting.entry(ip).or_insert_with(|| (Instant::now(), parent_of(svc), why));
    }

    /// Addresses waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Release what the apiserver no longer records; forget what it has recorded for longer
    /// than the patience (a new holder); keep the rest for the next look. Returns the
    /// addresses released.
    pub async fn process(&mut self) -> Result<Vec<IpAddr>, StoreError> {
        let mut released = Vec::new();
        let mut first_err = None;
        let now = Instant::now();
        let ips: Vec<(IpAddr, Instant)> = self.waiting.iter().map(|(ip, (t, _, _))| (*ip, *t)).collect();
        for (ip, since) in ips {
            match self.recorded.recorded_now(ip).await {
                Ok(false) => match self.store.release(ip).await {
                    Ok(()) => {
                        let given_up = self.waiting.remove(&ip);
                        if let (Some(h), Some((_, parent, why))) = (&self.history, given_up) {
                            h.note(ip, Some(&parent), why);
                        }
                        released.push(ip);
                    }
                    Err(StoreError::NotOwner { owner, .. }) => {
                        debug!(%ip, %owner, "not releasing an address with a recorded owner");
                        self.waiting.remove(&ip);
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                },
                Ok(true) if now.saturating_duration_since(since) >= self.patience => {
                    debug!(%ip, "an address a Service gave up is recorded for someone else now; keeping it");
                    self.waiting.remove(&ip);
                }
                Ok(true) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }
}

/// Watch Services until the task is dropped.
pub async fn run(client: kube::Client, store: Arc<dyn AllocationStore>, recorded: ApiserverIps, events: ServiceEvents, metrics: Arc<Metrics>, history: Option<Notes>) {
    let api: Api<Service> = Api::all(client);
    let mut stream = watcher::watcher(api, watcher::Config::default()).default_backoff().boxed();
    let mut releases = Releases::new(store.clone(), recorded).with_history(history.clone());
    let mut holdings = Holdings::new(store.ranges());
    let mut tick = tokio::time::interval(RELEASE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    info!("Service reconciler started");
    loop {
        let ev = tokio::select! {
            ev = stream.next() => match ev {
                Some(ev) => ev,
                None => break,
            },
            _ = tick.tick() => {
                if releases.waiting() > 0 {
                    match releases.process().await {
                        Ok(released) if !released.is_empty() => debug!(count = released.len(), "released addresses Services gave up"),
                        Ok(_) => {}
                        Err(e) => {
                            metrics.reconcile_errors.get_or_create(&crate::metrics::ControllerLabels { controller: "service" }).inc();
                            warn!(error = %e, "releasing addresses Services gave up failed; trying again");
                        }
                    }
                }
                continue;
            }
        };
        holdings.set_ranges(store.ranges());
        let result = match &ev {
            Ok(Event::Apply(svc)) | Ok(Event::InitApply(svc)) => {
                for ip in holdings.applied(svc) {
                    releases.given_up(ip, svc, Decision::ServiceChanged);
                }
                sync_present(store.as_ref(), &events, svc, history.as_ref()).await
            }
            Ok(Event::Delete(svc)) => {
                for ip in holdings.deleted(svc) {
                    releases.given_up(ip, svc, Decision::ServiceDeleted);
                }
                Ok(())
            }
            Ok(Event::Init) => {
                holdings.relist();
                Ok(())
            }
            Ok(Event::InitDone) => Ok(()),
            Err(e) => {
                warn!(error = %e, "Service watch failed; retrying");
                Ok(())
            }
        };
        if let Err(e) = result {
            metrics.reconcile_errors.get_or_create(&crate::metrics::ControllerLabels { controller: "service" }).inc();
            warn!(error = %e, "Service reconcile failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::ServiceCidr;
    use crate::store::memory::MemoryStore;
    use crate::store::ParentRef;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn range() -> Vec<ServiceCidr> {
        vec![ServiceCidr::parse("198.19.0.0/24").expect("range"), ServiceCidr::parse("fd00:10:96::/120").expect("range")]
    }

    /// A stored Service holding `ips` (its `spec.clusterIPs`).
    fn service(uid: &str, ips: &[&str]) -> Service {
        let mut svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "default", "uid": uid},
            "spec": {"clusterIPs": ips, "clusterIP": ips.first().copied().unwrap_or_default()}
        }))
        .expect("Service");
        if ips.is_empty() {
            svc.spec.as_mut().expect("spec").cluster_ip = None;
        }
        svc
    }

    #[test]
    fn a_service_holds_its_parsed_addresses_in_our_ranges_only() {
        let svc = service("u1", &["198.19.0.5", "fd00:10:96::5"]);
        assert_eq!(held_in(&range(), &svc), vec![ip("198.19.0.5"), ip("fd00:10:96::5")]);
        let elsewhere = service("u2", &["10.0.0.5", "not-an-ip"]);
        assert!(held_in(&range(), &elsewhere).is_empty());
        assert_eq!(held_ips(&service("u3", &["None"])), Vec::<String>::new());
    }

    #[test]
    fn addresses_given_up_by_a_downgrade_an_externalname_change_or_a_delete() {
        let mut holdings = Holdings::new(range());
        // First sight: nothing given up, whatever it holds.
        assert!(holdings.applied(&service("u1", &["198.19.0.5", "fd00:10:96::5"])).is_empty());
        // Downgraded to one family: the second address is given up.
        assert_eq!(holdings.applied(&service("u1", &["198.19.0.5"])), vec![ip("fd00:10:96::5")]);
        // Unchanged: nothing.
        assert!(holdings.applied(&service("u1", &["198.19.0.5"])).is_empty());
        // Changed to ExternalName (no address): the rest.
        assert_eq!(holdings.applied(&service("u1", &[])), vec![ip("198.19.0.5")]);
        // A delete gives up what the deleted object holds, in our ranges only.
        let other = service("u2", &["198.19.0.9", "10.0.0.9"]);
        assert!(holdings.applied(&other).is_empty());
        assert_eq!(holdings.deleted(&other), vec![ip("198.19.0.9")]);
        // Deleted and created again under a new uid: a first sight.
        assert!(holdings.applied(&service("u3", &["198.19.0.9"])).is_empty());
        // After a relist, a Service's first event gives up nothing (what it held before is
        // unknown; the repair pass finds such leaks).
        holdings.relist();
        assert!(holdings.applied(&service("u3", &[])).is_empty());
    }

    #[tokio::test]
    async fn a_held_address_the_records_lack_is_recorded_once() {
        let store = MemoryStore::new(range());
        assert!(record_if_missing(&store, ip("198.19.0.5")).await.expect("record"), "the records lacked it");
        assert!(store.has(ip("198.19.0.5")).await.expect("has"));
        // Recorded already (by us, or by the admission that answered it): nothing to say.
        assert!(!record_if_missing(&store, ip("198.19.0.5")).await.expect("record"));
        // A recorded non-Service owner is left as it is.
        let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: "edge".into() };
        store.allocate(ip("198.19.0.6"), Some(&gateway)).await.expect("a Gateway's");
        assert!(!record_if_missing(&store, ip("198.19.0.6")).await.expect("record"));
        assert_eq!(store.owner(ip("198.19.0.6")).await.expect("owner"), Some(gateway));
    }

    #[tokio::test]
    async fn given_up_addresses_are_released_once_unrecorded_and_kept_for_a_new_holder() {
        let store = Arc::new(MemoryStore::new(vec![ServiceCidr::parse("198.19.0.0/24").expect("range")]));
        let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: "edge".into() };
        store.allocate(ip("198.19.0.5"), None).await.expect("a deleted Service's");
        store.allocate(ip("198.19.0.6"), None).await.expect("recorded for a new holder");
        store.allocate(ip("198.19.0.7"), Some(&gateway)).await.expect("a Gateway's");
        // The apiserver records .6 (a Service created again holds it).
        let view = ApiserverIps::fixed([ip("198.19.0.6")]);
        let notes = Notes::new("replica-0");
        let mut releases = Releases::new(store.clone(), view.clone()).with_history(Some(notes.clone()));
        let gone = service("u1", &["198.19.0.5"]);
        for a in ["198.19.0.5", "198.19.0.6", "198.19.0.7"] {
            releases.given_up(ip(a), &gone, Decision::ServiceDeleted);
        }
        assert_eq!(releases.process().await.expect("process"), vec![ip("198.19.0.5")]);
        // .6 waits (the apiserver may still be deleting it); the Gateway's is never released.
        assert_eq!(releases.waiting(), 1);
        // The release, and only it, is noted for the address history, naming the Service.
        assert_eq!(notes.waiting(), 1);
        assert!(store.has(ip("198.19.0.6")).await.expect("has") && store.has(ip("198.19.0.7")).await.expect("has"));
        // Still recorded after the patience: someone new holds it, and it is kept.
        let mut releases = Releases::new(store.clone(), view).with_patience(Duration::ZERO);
        releases.given_up(ip("198.19.0.6"), &gone, Decision::ServiceDeleted);
        assert!(releases.process().await.expect("process").is_empty());
        assert_eq!(releases.waiting(), 0);
        assert!(store.has(ip("198.19.0.6")).await.expect("has"));
    }
}
