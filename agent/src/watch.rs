//! Watches of Services, EndpointSlices and this node's Node (kube-runtime watchers),
//! folded into the shared [`ProxyState`](crate::model::state::ProxyState).

#![forbid(unsafe_code)]

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};

use prometheus_client::metrics::counter::Counter;

use crate::healthz::TO_BE_DELETED_TAINT;
use crate::metrics::Metrics;
use crate::model::service::{HEADLESS_LABEL, SERVICE_PROXY_NAME_LABEL};
use crate::model::NamespacedName;
use crate::sync::Shared;

/// Node label with the node's zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// kube-proxy's Service label selector, for this agent's proxy name.
pub fn service_selector(proxy_name: Option<&str>) -> String {
    match proxy_name {
        Some(n) => format!("{SERVICE_PROXY_NAME_LABEL}={n},!{HEADLESS_LABEL}"),
        None => format!("!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}"),
    }
}

fn nsn<K: ResourceExt>(o: &K) -> NamespacedName {
    NamespacedName::new(o.namespace().unwrap_or_else(|| "default".into()), o.name_any())
}

/// Drop what the agent never reads (managed fields, kubectl's last-applied copy) as objects
/// arrive: a re-list buffers every object until the list is complete.
fn slim<K: ResourceExt>(o: &mut K) {
    o.managed_fields_mut().clear();
    o.annotations_mut().remove("kubectl.kubernetes.io/last-applied-configuration");
}

/// How one watched kind folds into the shared state.
trait Folded: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static {
    const KIND: &'static str;
    fn replace_all(c: &mut crate::sync::Control, list: &[Self]);
    fn apply(c: &mut crate::sync::Control, o: &Self) -> bool;
    fn delete(c: &mut crate::sync::Control, key: &NamespacedName) -> bool;
    /// kube-proxy's counter of this kind's changes (`…_changes_total`: every add, update and
    /// delete it is handed, whether it changes anything or not).
    fn changes_total(m: &Metrics) -> &Counter;
    /// Whether kube-proxy would count this object (it skips FQDN EndpointSlices).
    fn counted(_o: &Self) -> bool {
        true
    }
}

impl Folded for Service {
    const KIND: &'static str = "Service";
    fn replace_all(c: &mut crate::sync::Control, list: &[Self]) {
        c.state.replace_services(list);
        c.services_synced = true;
    }
    fn apply(c: &mut crate::sync::Control, o: &Self) -> bool {
        c.state.apply_service(o)
    }
    fn delete(c: &mut crate::sync::Control, key: &NamespacedName) -> bool {
        c.state.delete_service(key)
    }
    fn changes_total(m: &Metrics) -> &Counter {
        &m.kube_proxy.service_changes_total
    }
}

impl Folded for EndpointSlice {
    const KIND: &'static str = "EndpointSlice";
    fn replace_all(c: &mut crate::sync::Control, list: &[Self]) {
        c.state.replace_slices(list);
        c.slices_synced = true;
    }
    fn apply(c: &mut crate::sync::Control, o: &Self) -> bool {
        c.state.apply_slice(o)
    }
    fn delete(c: &mut crate::sync::Control, key: &NamespacedName) -> bool {
        c.state.delete_slice(key)
    }
    fn changes_total(m: &Metrics) -> &Counter {
        &m.kube_proxy.endpoint_changes_total
    }
    fn counted(o: &Self) -> bool {
        o.address_type != "FQDN"
    }
}

/// Watch one kind until the stream ends (it retries with backoff on errors): a re-list is
/// buffered and replaces the kind's state at once; single changes are applied as they come.
async fn watch<K: Folded>(api: Api<K>, cfg: watcher::Config, shared: Arc<Shared>) {
    let mut stream = watcher::watcher(api, cfg).default_backoff().modify(slim).boxed();
    let mut buffer = Vec::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => buffer.clear(),
            Ok(Event::InitApply(o)) => buffer.push(o),
            Ok(Event::InitDone) => {
                let list = std::mem::take(&mut buffer);
                K::changes_total(&shared.metrics).inc_by(list.iter().filter(|o| K::counted(o)).count() as u64);
                shared.update(|c| {
                    K::replace_all(c, &list);
                    true
                });
            }
            Ok(Event::Apply(o)) => {
                if K::counted(&o) {
                    K::changes_total(&shared.metrics).inc();
                }
                shared.update(|c| K::apply(c, &o))
            }
            Ok(Event::Delete(o)) => {
                if K::counted(&o) {
                    K::changes_total(&shared.metrics).inc();
                }
                shared.update(|c| K::delete(c, &nsn(&o)))
            }
            Err(e) => tracing::warn!(error = %e, kind = K::KIND, "watch error (retrying)"),
        }
    }
}

/// Watch Services until the stream ends (it retries with backoff on errors).
pub async fn services(client: Client, shared: Arc<Shared>, proxy_name: Option<String>) {
    let cfg = watcher::Config::default().labels(&service_selector(proxy_name.as_deref()));
    watch::<Service>(Api::all(client), cfg, shared).await
}

/// Watch EndpointSlices until the stream ends.
pub async fn endpoint_slices(client: Client, shared: Arc<Shared>) {
    let cfg = watcher::Config::default().labels(&format!("!{HEADLESS_LABEL}"));
    watch::<EndpointSlice>(Api::all(client), cfg, shared).await
}

/// Whether a Node may receive load-balancer traffic (kube-proxy's `NodeEligible`).
pub fn node_eligible(node: Option<&Node>) -> bool {
    let Some(node) = node else { return false };
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    !tainted
}

/// Watch this node's Node object: zone (topology) and eligibility (healthz).
pub async fn node(client: Client, shared: Arc<Shared>, node_name: String) {
    let api: Api<Node> = Api::all(client);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
    let mut stream = watcher::watcher(api, cfg).default_backoff().boxed();
    let mut seen = false;
    while let Some(ev) = stream.next().await {
        let node = match ev {
            Ok(Event::Apply(n)) | Ok(Event::InitApply(n)) => {
                seen = true;
                Some(n)
            }
            Ok(Event::Delete(_)) => None,
            Ok(Event::Init) => {
                seen = false;
                continue;
            }
            Ok(Event::InitDone) if seen => continue,
            Ok(Event::InitDone) => None,
            Err(e) => {
                tracing::warn!(error = %e, "Node watch error (retrying)");
                continue;
            }
        };
        shared.health.set_node_eligible(node_eligible(node.as_ref()));
        let zone = node.as_ref().and_then(|n| n.labels().get(ZONE_LABEL).cloned());
        shared.update(|c| c.state.set_node_zone(zone));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_match_kube_proxy() {
        assert_eq!(service_selector(None), "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless");
        assert_eq!(service_selector(Some("x")), "service.kubernetes.io/service-proxy-name=x,!service.kubernetes.io/headless");
    }

    #[test]
    fn eligibility() {
        assert!(!node_eligible(None));
        let n: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": "n1"}})).expect("node");
        assert!(node_eligible(Some(&n)));
        let t: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": "n1"},
            "spec": {"taints": [{"key": TO_BE_DELETED_TAINT, "effect": "NoSchedule"}]}}))
        .expect("node");
        assert!(!node_eligible(Some(&t)));
    }
}
