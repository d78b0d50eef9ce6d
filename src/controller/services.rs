//! Keeps the allocation records and the Services consistent, from a watch on Services:
//! - a Service that holds an address in our ranges the records lack → the address is
//!   recorded, and a Warning `ClusterIPNotAllocated` Event says so;
//! - an address that does not parse → Warning `ClusterIPNotValid`;
//! - a deleted Service → its addresses in our ranges are released.
//!
//! Leaks left by a Service deleted while no replica was leading are the repair pass's job.

use std::net::IpAddr;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use tracing::{info, warn};

use crate::cidr::{self, Family};
use crate::metrics::Metrics;
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
        let ip = match cidr::parse_ip(&text) {
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

/// Release what a deleted Service held in our ranges.
pub async fn sync_deleted(store: &dyn AllocationStore, svc: &Service) -> Result<(), StoreError> {
    let ranges = store.ranges();
    for text in service_ips(svc) {
        if let Ok(ip) = cidr::parse_ip(&text) {
            if ranges.iter().any(|c| c.contains(ip)) {
                store.release(ip).await?;
            }
        }
    }
    Ok(())
}

/// Watch Services until the task is dropped.
pub async fn run(client: kube::Client, store: Arc<dyn AllocationStore>, events: ServiceEvents, metrics: Arc<Metrics>) {
    let api: Api<Service> = Api::all(client);
    let mut stream = watcher::watcher(api, watcher::Config::default()).default_backoff().boxed();
    info!("Service reconciler started");
    while let Some(ev) = stream.next().await {
        let result = match &ev {
            Ok(Event::Apply(svc)) | Ok(Event::InitApply(svc)) => sync_present(store.as_ref(), &events, svc).await,
            Ok(Event::Delete(svc)) => sync_deleted(store.as_ref(), svc).await,
            Ok(Event::Init) | Ok(Event::InitDone) => Ok(()),
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
