//! The ServiceCIDR reconciler (Kubernetes' service-cidr-controller, which lives in
//! kube-controller-manager; control planes that run clusterip instead get it here):
//! - a live ServiceCIDR gets the finalizer `networking.k8s.io/service-cidr-finalizer` and
//!   the condition `Ready=True` (no reason, as kube-controller-manager writes it);
//! - a ServiceCIDR being deleted keeps the finalizer, with `Ready=False`, reason
//!   `Terminating` and a message that says why, while an address that only it covers is in
//!   use (an IPAddress object, or a record of ours); otherwise the finalizer is removed once
//!   10 s have passed since the deletion began (Kubernetes' grace period). The Ready
//!   condition keeps Kubernetes' words (kube-controller-manager may write it too, and two
//!   messages would be a write war); which addresses and Services keep the deletion waiting
//!   is told in a condition of our own beside it, [`IN_USE`] (`True`, reason
//!   `AddressesInUse`, written by a field manager of its own, so neither our Ready writes nor
//!   kube-controller-manager's server-side applies of Ready touch it), and in a Warning Event
//!   on the ServiceCIDR, `ServiceCIDRInUse`, whenever that set changes.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::json;
use tracing::{debug, info, warn};

use crate::cidr::ServiceCidr;
use crate::k8s::servicecidr;
use crate::metrics::{ControllerLabels, Metrics};
use crate::store::ipaddress::apiserver_ips::ApiserverIps;
use crate::store::AllocationStore;

pub const FINALIZER: &str = "networking.k8s.io/service-cidr-finalizer";
pub const FIELD_MANAGER: &str = "clusterip-controller";
/// The condition naming what keeps a ServiceCIDR's deletion waiting.
pub const IN_USE: &str = "clusterip.allocator/InUse";
/// The field manager of [`IN_USE`] (apart from [`FIELD_MANAGER`]'s Ready: a server-side
/// apply removes what its manager owned and left out).
const IN_USE_MANAGER: &str = "clusterip-controller-in-use";
const READY_MESSAGE: &str = "Kubernetes Service CIDR is ready";
const TERMINATING_MESSAGE: &str = "There are still IPAddresses referencing the ServiceCIDR, please remove them or create a new ServiceCIDR";
const DELETION_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("allocation records: {0}")]
    Store(#[from] crate::store::StoreError),
}

pub struct Context {
    pub client: kube::Client,
    pub store: Arc<dyn AllocationStore>,
    /// The cluster's IPAddress names (watch-fed).
    pub recorded: ApiserverIps,
    pub metrics: Arc<Metrics>,
    pub events: crate::controller::events::ServiceEvents,
    /// Per terminating ServiceCIDR, the note of the last `ServiceCIDRInUse` Event posted.
    pub told: Mutex<HashMap<String, String>>,
}

/// How many of the addresses that keep a deletion waiting an Event names.
const NAMED: usize = 10;

/// Set the condition `type_` of `sc` as `manager` (a server-side apply of that one
/// condition), unless it says that already.
#[allow(clippy::too_many_arguments)]
async fn set_condition(api: &Api<ServiceCIDR>, sc: &ServiceCIDR, manager: &str, type_: &str, status: &str, reason: &str, message: &str) -> Result<(), kube::Error> {
    if servicecidr::condition(sc, type_).is_some_and(|c| c.status == status && c.reason == reason && c.message == message) {
        return Ok(());
    }
    let name = sc.metadata.name.clone().unwrap_or_default();
    let cond = Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: Time(Timestamp::now()),
        observed_generation: None,
    };
    // Decided on this version of the object: the write carries its resourceVersion as a
    // precondition, so a decision made on a stale copy (the watch behind a write of
    // kube-controller-manager's, which set the same condition) is refused instead of
    // rewriting the object; the watch then brings the current one, which needs nothing.
    let patch = json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"resourceVersion": sc.metadata.resource_version}, "status": {"conditions": [cond]}});
    match api.patch_status(&name, &PatchParams::apply(manager).force(), &Patch::Apply(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            debug!(servicecidr = %name, "ServiceCIDR changed since it was read; judging the current version instead");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

async fn set_ready(api: &Api<ServiceCIDR>, sc: &ServiceCIDR, status: &str, reason: &str, message: &str) -> Result<(), kube::Error> {
    set_condition(api, sc, FIELD_MANAGER, servicecidr::READY, status, reason, message).await
}

/// Set [`IN_USE`] to `True` with `message`, unless it says that already.
async fn set_in_use(api: &Api<ServiceCIDR>, sc: &ServiceCIDR, message: &str) -> Result<(), kube::Error> {
    set_condition(api, sc, IN_USE_MANAGER, IN_USE, "True", "AddressesInUse", message).await
}

/// Addresses in use that only `sc` covers, in order, the first [`NAMED`] with the parentRef
/// of their IPAddress object (None: recorded only by us, or not named). Read from the
/// watch-fed view of IPAddress names and our records, as kube-controller-manager reads its
/// informer (the deletion grace covers a record the view has not shown yet): a list of
/// every IPAddress object each time would move tens of MB at 100k Services, every 5 s for as
/// long as a deletion waits. Only the named ones are read, one GET each.
async fn addresses_only_here(ctx: &Context, sc: &ServiceCIDR, all: &[ServiceCIDR]) -> Result<Vec<(IpAddr, Option<String>)>, Error> {
    let mine = servicecidr::ranges(sc);
    let others: Vec<ServiceCidr> = all
        .iter()
        .filter(|o| o.metadata.name != sc.metadata.name && o.metadata.deletion_timestamp.is_none())
        .flat_map(servicecidr::ranges)
        .collect();
    let only_here = |ip: &IpAddr| mine.iter().any(|c| c.contains(*ip)) && !others.iter().any(|c| c.contains(*ip));
    let mut used: Vec<IpAddr> = ctx.recorded.view().iter().copied().filter(only_here).collect();
    used.extend(ctx.store.allocated().await?.into_iter().filter(only_here));
    used.sort();
    used.dedup();
    let records = Api::<IPAddress>::all(ctx.client.clone());
    let mut named = Vec::with_capacity(used.len());
    for (i, ip) in used.into_iter().enumerate() {
        let parent = match i < NAMED {
            true => records.get_opt(&ip.to_string()).await?.map(|a| crate::store::ParentRef::from(&a.spec.parent_ref).to_string()),
            false => None,
        };
        named.push((ip, parent));
    }
    Ok(named)
}

/// The note of a `ServiceCIDRInUse` Event: how many addresses keep the deletion waiting and
/// the first [`NAMED`] of them with their holders.
fn in_use_note(used: &[(IpAddr, Option<String>)]) -> String {
    let named: Vec<String> = used.iter().take(NAMED).map(|(ip, p)| format!("{ip} ({})", p.as_deref().unwrap_or("recorded by clusterip"))).collect();
    let more = used.len().saturating_sub(NAMED);
    format!(
        "Deletion waits for {} address(es) only this ServiceCIDR covers: {}{}; delete or re-create their Services in another range (clusterip what-if delete-cidr lists them all)",
        used.len(),
        named.join(", "),
        if more > 0 { format!(" and {more} more") } else { String::new() }
    )
}

async fn reconcile(sc: Arc<ServiceCIDR>, ctx: Arc<Context>) -> Result<Action, Error> {
    let api: Api<ServiceCIDR> = Api::all(ctx.client.clone());
    let name = sc.metadata.name.clone().unwrap_or_default();
    let finalizers = sc.metadata.finalizers.clone().unwrap_or_default();
    let has_finalizer = finalizers.iter().any(|f| f == FINALIZER);

    if let Some(deleted) = &sc.metadata.deletion_timestamp {
        if !has_finalizer {
            return Ok(Action::await_change());
        }
        let all = api.list(&ListParams::default()).await?.items;
        let used = addresses_only_here(&ctx, &sc, &all).await?;
        if !used.is_empty() {
            set_ready(&api, &sc, "False", "Terminating", TERMINATING_MESSAGE).await?;
            let note = in_use_note(&used);
            set_in_use(&api, &sc, &note).await?;
            let changed = crate::sync::lock(&ctx.told).insert(name.clone(), note.clone()).as_ref() != Some(&note);
            if changed {
                use kube::Resource as _;
                ctx.events.warn_on(sc.object_ref(&()), "ServiceCIDRInUse", "Delete", note).await;
            }
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
        crate::sync::lock(&ctx.told).remove(&name);
        let since = Timestamp::now().duration_since(deleted.0);
        if since < DELETION_GRACE.try_into().unwrap_or_default() {
            let wait = DELETION_GRACE.saturating_sub(Duration::try_from(since).unwrap_or_default());
            return Ok(Action::requeue(wait.max(Duration::from_millis(100))));
        }
        let rest: Vec<String> = finalizers.into_iter().filter(|f| f != FINALIZER).collect();
        let patch = json!({"metadata": {"finalizers": rest, "resourceVersion": sc.metadata.resource_version}});
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        info!(servicecidr = %name, "no address depends on the ServiceCIDR any more; finalizer removed");
        return Ok(Action::await_change());
    }
    if !has_finalizer {
        let mut with = finalizers;
        with.push(FINALIZER.into());
        let patch = json!({"metadata": {"finalizers": with, "resourceVersion": sc.metadata.resource_version}});
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    }
    // kube-controller-manager's service-cidr-controller writes Ready=True without a reason
    // and compares status, reason and message before writing: the same three here, so that
    // where both run, whichever writes first settles it for the other.
    set_ready(&api, &sc, "True", "", READY_MESSAGE).await?;
    Ok(Action::await_change())
}

fn error_policy(_sc: Arc<ServiceCIDR>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_errors.get_or_create(&ControllerLabels { controller: "servicecidr" }).inc();
    warn!(error = %err, "ServiceCIDR reconcile failed; retrying");
    Action::requeue(Duration::from_secs(2))
}

/// Run until the task is dropped.
pub async fn run(ctx: Arc<Context>) {
    let api: Api<ServiceCIDR> = Api::all(ctx.client.clone());
    Controller::new(api, watcher::Config::default())
        .run(reconcile, error_policy, ctx)
        .for_each(|_| futures::future::ready(()))
        .await;
}
