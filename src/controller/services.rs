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
use crate::metrics::Metrics;
use crate::store::apiserver_ips::ApiserverIps;
use crate::store::{AllocationStore, StoreError};

use super::events::ServiceEvents;

/// The addresses a Service holds ("None" and empty are no address).
pub fn service_ips(svc: &Service) -> Vec<String> {
    let spec = svc.spec.as_ref();
    let mut ips = spec.and_then(|s| s.cluster_ips.clone()).unwrap_or_default();
    if ips.is_empty() {
        ips.extend(spec.and_then(|s| s.cluster_ip.clone()));
    }
    ips.retain(|s| !s.is_empty() && s != "None");
    ips
}

fn family_word(ip: IpAddr) -> &'static str {
    match Family::of(ip) {
        Family::IPv4 => "IPv4",
        Family::IPv6 => "IPv6",
    }
}

/// Record what a live Service holds.
pub async fn sync_present(store: &dyn AllocationStore, events: &ServiceEvents, svc: &Service) -> Result<(), StoreError> {
    let ranges = store.ranges();
    for text in service_ips(svc) {
        let ip = match cidr::parse_ip_sloppy(&text) {
            Ok(ip) => ip,
            Err(_) => {
                events.warn(svc, "ClusterIPNotValid", "ClusterIPValidation", format!("Cluster IP {text} is not a valid IP; please recreate Service")).await;
                continue;
            }
        };
        if !ranges.iter().any(|c| c.contains(ip)) || store.has(ip).await? {
            continue;
        }
        match store.allocate(ip, None).await {
            Ok(()) => {
                events
                    .warn(svc, "ClusterIPNotAllocated", "ClusterIPAllocation", format!("Cluster IP [{}]: {ip} is not allocated; repairing", family_word(ip)))
                    .await;
            }
            Err(StoreError::Alloc(crate::alloc::AllocError::Allocated)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// How long an address a Service gave up may still be recorded by the apiserver before it
/// counts as held by someone new (and is not released here).
pub const RELEASE_PATIENCE: Duration = Duration::from_secs(30);
/// How often addresses waiting for release are looked at.
const RELEASE_TICK: Duration = Duration::from_secs(1);

/// The addresses in our ranges a Service holds.
fn held_in(ranges: &[crate::cidr::ServiceCidr], svc: &Service) -> Vec<IpAddr> {
    service_ips(svc).iter().filter_map(|t| cidr::parse_ip_sloppy(t).ok()).filter(|ip| ranges.iter().any(|c| c.contains(*ip))).collect()
}

fn key_of(svc: &Service) -> String {
    svc.metadata.uid.clone().unwrap_or_else(|| format!("{}/{}", svc.metadata.namespace.as_deref().unwrap_or_default(), svc.metadata.name.as_deref().unwrap_or_default()))
}

/// Addresses Services gave up, released once the apiserver no longer records them.
pub struct Releases {
    store: Arc<dyn AllocationStore>,
    recorded: ApiserverIps,
    /// Address → when it was given up.
    waiting: HashMap<IpAddr, Instant>,
    patience: Duration,
}

impl Releases {
    pub fn new(store: Arc<dyn AllocationStore>, recorded: ApiserverIps) -> Self {
        Self { store, recorded, waiting: HashMap::new(), patience: RELEASE_PATIENCE }
    }

    /// With another patience (tests).
    pub fn with_patience(mut self, patience: Duration) -> Self {
        self.patience = patience;
        self
    }

    /// An address a Service no longer holds.
    pub fn given_up(&mut self, ip: IpAddr) {
        self.waiting.entry(ip).or_insert_with(Instant::now);
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
        let ips: Vec<(IpAddr, Instant)> = self.waiting.iter().map(|(ip, t)| (*ip, *t)).collect();
        for (ip, since) in ips {
            match self.recorded.recorded_now(ip).await {
                Ok(false) => match self.store.release(ip).await {
                    Ok(()) => {
                        self.waiting.remove(&ip);
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
pub async fn run(client: kube::Client, store: Arc<dyn AllocationStore>, recorded: ApiserverIps, events: ServiceEvents, metrics: Arc<Metrics>) {
    let api: Api<Service> = Api::all(client);
    let mut stream = watcher::watcher(api, watcher::Config::default()).default_backoff().boxed();
    let ranges = store.ranges();
    let mut releases = Releases::new(store.clone(), recorded);
    // What each Service held at its last event (by uid).
    let mut held: HashMap<String, Vec<IpAddr>> = HashMap::new();
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
        let result = match &ev {
            Ok(Event::Apply(svc)) | Ok(Event::InitApply(svc)) => {
                let now = held_in(&ranges, svc);
                if let Some(before) = held.insert(key_of(svc), now.clone()) {
                    for ip in before.into_iter().filter(|ip| !now.contains(ip)) {
                        releases.given_up(ip);
                    }
                }
                sync_present(store.as_ref(), &events, svc).await
            }
            Ok(Event::Delete(svc)) => {
                held.remove(&key_of(svc));
                for ip in held_in(&ranges, svc) {
                    releases.given_up(ip);
                }
                Ok(())
            }
            Ok(Event::Init) => {
                held.clear();
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

    #[tokio::test]
    async fn given_up_addresses_are_released_once_unrecorded_and_kept_for_a_new_holder() {
        let store = Arc::new(MemoryStore::new(vec![ServiceCidr::parse("198.19.0.0/24").expect("range")]));
        let gateway = ParentRef { group: "gateway.networking.k8s.io".into(), resource: "gateways".into(), namespace: Some("infra".into()), name: "edge".into() };
        store.allocate(ip("198.19.0.5"), None).await.expect("a deleted Service's");
        store.allocate(ip("198.19.0.6"), None).await.expect("recorded for a new holder");
        store.allocate(ip("198.19.0.7"), Some(&gateway)).await.expect("a Gateway's");
        // The apiserver records .6 (a Service created again holds it).
        let view = ApiserverIps::fixed([ip("198.19.0.6")]);
        let mut releases = Releases::new(store.clone(), view.clone());
        for a in ["198.19.0.5", "198.19.0.6", "198.19.0.7"] {
            releases.given_up(ip(a));
        }
        assert_eq!(releases.process().await.expect("process"), vec![ip("198.19.0.5")]);
        // .6 waits (the apiserver may still be deleting it); the Gateway's is never released.
        assert_eq!(releases.waiting(), 1);
        assert!(store.has(ip("198.19.0.6")).await.expect("has") && store.has(ip("198.19.0.7")).await.expect("has"));
        // Still recorded after the patience: someone new holds it, and it is kept.
        let mut releases = Releases::new(store.clone(), view).with_patience(Duration::ZERO);
        releases.given_up(ip("198.19.0.6"));
        assert!(releases.process().await.expect("process").is_empty());
        assert_eq!(releases.waiting(), 0);
        assert!(store.has(ip("198.19.0.6")).await.expect("has"));
    }
}
