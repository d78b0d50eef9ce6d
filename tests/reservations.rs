//! The IPAddress backend's Service address reservations (`src/store/reservations.rs`)
//! against a real kube-apiserver, with one replica's IPAddress view held back
//! (`ApiserverIps::fixed`) to reproduce a lagging watch deterministically: the interleavings
//! of issue 17, where a lagging replica re-reserved an address the apiserver had recorded,
//! or ended a reservation another replica had just made for a new admission.
//!
//! Every replica here runs without its background sweeper; the test calls `refresh()` at the
//! point of the interleaving it reproduces. Addresses come from 198.19.0.224/28, in the
//! apiserver's static band (its own dynamic allocation never lands there) and used by no
//! other test.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clusterip::alloc::AllocError;
use clusterip::cidr::ServiceCidr;
use clusterip::store::apiserver_ips::ApiserverIps;
use clusterip::store::reservations::{lease_name, LeaseReservations, ReservationOptions};
use clusterip::store::{AllocationStore, ParentRef, StoreError};
use clusterip_test_support::{block_on_drop, control_plane, unique_name};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, DeleteParams, PostParams};
use kube::Client;
use serde_json::json;

const RANGE: &str = "198.19.0.224/28";
/// Namespaces of this file's tests start with this; an earlier run's leftovers are found by it.
const PREFIX: &str = "resv";

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn await_until<'a>(what: &'a str, timeout: Duration) -> impl FnMut(bool) + 'a {
    let deadline = Instant::now() + timeout;
    move |done| assert!(done || Instant::now() < deadline, "{what}: not within {timeout:?}")
}

/// A namespace of the test's own (Leases and Services), deleted on drop.
struct Fixture {
    client: Client,
    ns: String,
}

impl Fixture {
    async fn new() -> Fixture {
        let client = control_plane().client().await;
        let ns = unique_name(PREFIX);
        let obj: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}})).expect("namespace");
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &obj).await.expect("create namespace");
        Fixture { client, ns }
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn addresses(&self) -> Api<IPAddress> {
        Api::all(self.client.clone())
    }

    fn parent(&self, name: &str) -> ParentRef {
        ParentRef::service(&self.ns, name)
    }

    /// A replica's reservations, with no background sweeper, over `view`.
    async fn replica(&self, name: &str, view: ApiserverIps, ttl: Duration) -> Arc<LeaseReservations> {
        let options = ReservationOptions { refresh: None, ttl };
        LeaseReservations::open_with(self.client.clone(), &self.ns, vec![ServiceCidr::parse(RANGE).expect("range")], view, name.into(), options)
            .await
            .expect("open reservations")
    }

    /// A live view, once its first list arrived.
    async fn live_view(&self) -> ApiserverIps {
        let (view, mut synced, _task) = ApiserverIps::start(self.client.clone());
        tokio::time::timeout(Duration::from_secs(60), synced.wait_for(|s| *s)).await.expect("IPAddress list within 60s").expect("watch running");
        view
    }

    /// `address` free in the apiserver: a leftover of an earlier run of this file (a Service
    /// in one of its namespaces) is deleted first; anyone else holding it fails the test.
    async fn free(&self, address: IpAddr) {
        if let Some(rec) = self.addresses().get_opt(&address.to_string()).await.expect("read IPAddress") {
            let p = rec.spec.parent_ref;
            let ns = p.namespace.unwrap_or_default();
            assert!(ns.starts_with(PREFIX), "{address} is held by {}/{ns}/{}, not by an earlier run of this test", p.resource, p.name);
            let _ = Api::<Service>::namespaced(self.client.clone(), &ns).delete(&p.name, &DeleteParams::default()).await;
        }
        self.wait_record(address, false).await;
    }

    async fn service_with(&self, name: &str, address: IpAddr) {
        let svc: Service = serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"clusterIP": address.to_string(), "ports": [{"port": 80}]}})).expect("service");
        self.services().create(&PostParams::default(), &svc).await.expect("create Service with a static clusterIP");
    }

    /// Wait until the apiserver's record of `address` exists (or is gone), read from storage.
    async fn wait_record(&self, address: IpAddr, present: bool) {
        let mut check = await_until("the IPAddress record", Duration::from_secs(60));
        loop {
            let found = self.addresses().get_opt(&address.to_string()).await.expect("read IPAddress").is_some();
            check(found == present);
            if found == present {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn view_shows(&self, view: &ApiserverIps, address: IpAddr, present: bool) {
        let mut check = await_until("the live view", Duration::from_secs(60));
        while view.contains(address) != present {
            check(false);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn lease_uid(&self, address: IpAddr) -> Option<String> {
        self.leases().get_opt(&lease_name(address)).await.expect("read Lease").and_then(|l| l.metadata.uid)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let (client, ns) = (self.client.clone(), self.ns.clone());
        block_on_drop(async move {
            let _ = Api::<Namespace>::all(client).delete(&ns, &DeleteParams::default()).await;
        });
    }
}

fn is_allocated<T: std::fmt::Debug>(r: &Result<T, StoreError>) -> bool {
    matches!(r, Err(StoreError::Alloc(AllocError::Allocated)))
}

const TTL: Duration = Duration::from_secs(120);

/// Replica A reserves X, the apiserver records X, A ends its reservation. Replica B's view
/// is held back: it shows neither the Lease nor the IPAddress. B must still refuse X (today's
/// main answered it, and the apiserver refused the Service: "provided IP is already
/// allocated").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_replica_never_reserves_an_address_the_apiserver_recorded() {
    let fx = Fixture::new().await;
    let x = ip("198.19.0.225");
    fx.free(x).await;
    let live = fx.live_view().await;
    let a = fx.replica("replica-a", live.clone(), TTL).await;
    let b = fx.replica("replica-b", ApiserverIps::fixed([]), TTL).await;

    a.allocate(x, Some(&fx.parent("first"))).await.expect("A reserves X");
    fx.service_with("first", x).await;
    fx.view_shows(&live, x, true).await;
    a.refresh().await.expect("A sweeps");
    assert_eq!(fx.lease_uid(x).await, None, "A's reservation ends once the apiserver recorded X for its parent");

    let r = b.allocate(x, Some(&fx.parent("second"))).await;
    assert!(is_allocated(&r), "B, whose view lags, answered {r:?} for an address the apiserver records");
    assert_eq!(fx.lease_uid(x).await, None, "B withdrew its reservation");
    // Dynamic picks too: the /28 has 14 addresses; B must never answer X.
    while let Ok(got) = b.allocate_next(clusterip::cidr::Family::IPv4, Some(&fx.parent("third"))).await {
        assert_ne!(got, x, "B picked X dynamically");
    }
}

/// An old Service held X and is gone; replica B's view still shows its record. Replica A
/// reserves X for a new admission. B's sweep must not end A's reservation (today's main
/// deleted it, and a third replica then answered X a second time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_replica_never_ends_another_replicas_reservation() {
    let fx = Fixture::new().await;
    let x = ip("198.19.0.226");
    fx.free(x).await;
    fx.service_with("old", x).await;
    fx.wait_record(x, true).await;
    let b = fx.replica("replica-b", ApiserverIps::fixed([x]), TTL).await;
    fx.services().delete("old", &DeleteParams::default()).await.expect("delete the old Service");
    fx.wait_record(x, false).await;

    let live = fx.live_view().await;
    fx.view_shows(&live, x, false).await;
    let a = fx.replica("replica-a", live.clone(), TTL).await;
    a.allocate(x, Some(&fx.parent("new"))).await.expect("A reserves X for a new admission");
    let uid = fx.lease_uid(x).await.expect("A's Lease");

    b.refresh().await.expect("B sweeps with its held-back view");
    assert_eq!(fx.lease_uid(x).await.as_deref(), Some(uid.as_str()), "B ended A's reservation");

    let c = fx.replica("replica-c", live.clone(), TTL).await;
    let r = c.allocate(x, Some(&fx.parent("third"))).await;
    assert!(is_allocated(&r), "C answered {r:?} for an address A holds");
    // A's admission completes: the apiserver stores its Service with X.
    fx.service_with("new", x).await;
}

/// A reservation whose Service is never stored ends after the TTL, measured on the clock of
/// the replica that observes it, from its first observation. Only the replica that made a
/// reservation releases it early (a rollback), with the Lease's uid as the precondition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_end_by_their_owner_or_after_the_observers_ttl() {
    let fx = Fixture::new().await;
    let x = ip("198.19.0.227");
    fx.free(x).await;
    let ttl = Duration::from_secs(2);
    let live = fx.live_view().await;
    let a = fx.replica("replica-a", live.clone(), ttl).await;
    let b = fx.replica("replica-b", live.clone(), ttl).await;

    // Release by the owner for the parent it reserved for (rollback) ends it; release by
    // another replica does not, nor a Service reconciler's release (a Service gave the
    // address up: a reservation for it can only be a newer admission's), nor one for
    // another parent.
    a.allocate(x, Some(&fx.parent("rolled-back"))).await.expect("A reserves X");
    b.release_owned(x, &fx.parent("rolled-back")).await.expect("B's release");
    assert!(fx.lease_uid(x).await.is_some(), "B's release ended A's reservation");
    a.release(x).await.expect("A's release for a Service that gave X up");
    assert!(fx.lease_uid(x).await.is_some(), "a release for a Service that gave X up ended a reservation");
    a.release_owned(x, &fx.parent("someone-else")).await.expect("A's release for another parent");
    assert!(fx.lease_uid(x).await.is_some(), "a release for another parent ended the reservation");
    a.release_owned(x, &fx.parent("rolled-back")).await.expect("A's rollback");
    assert_eq!(fx.lease_uid(x).await, None, "A's rollback left its reservation");

    // Never stored: B drops it once B itself has seen it for the TTL.
    a.allocate(x, Some(&fx.parent("never-stored"))).await.expect("A reserves X again");
    let first_seen = Instant::now();
    b.refresh().await.expect("B's first sweep");
    assert!(fx.lease_uid(x).await.is_some(), "a reservation B saw for the first time was dropped");
    let mut check = await_until("the reservation expiring", Duration::from_secs(60));
    loop {
        b.refresh().await.expect("B sweeps");
        let gone = fx.lease_uid(x).await.is_none();
        check(gone);
        if gone {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(first_seen.elapsed() >= ttl, "dropped {:?} after B first saw it, before the TTL of {ttl:?}", first_seen.elapsed());
    let r = b.allocate(x, Some(&fx.parent("next"))).await;
    assert!(r.is_ok(), "X is free again: {r:?}");
}
