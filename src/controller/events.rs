//! Events on Services (and ServiceCIDRs), with Kubernetes' reasons and wording.

use k8s_openapi::api::core::v1::{ObjectReference, Service};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::Resource;
use tracing::warn;

/// Who reports our Events.
pub const REPORTER: &str = "clusterip-controller";

/// How long one Event publication may take.
pub const PUBLISH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Clone)]
pub struct ServiceEvents {
    recorder: Recorder,
}

impl ServiceEvents {
    pub fn new(client: kube::Client, instance: Option<String>) -> Self {
        Self { recorder: Recorder::new(client, Reporter { controller: REPORTER.into(), instance }) }
    }

    /// A Warning Event on the Service, published by a task of its own: it is not lost when
    /// the caller is stopped right after the change it reports (leadership lost), and a slow
    /// apiserver does not hold the caller (the kube client has no read timeout; the
    /// publication gets [`PUBLISH_TIMEOUT`]). Failures are logged, never fatal. Returns once
    /// the publication is handed to its task.
    pub async fn warn(&self, svc: &Service, reason: &str, action: &str, note: String) {
        self.warn_on(svc.object_ref(&()), reason, action, note).await
    }

    /// [`Self::warn`] on any object (a ServiceCIDR).
    pub async fn warn_on(&self, reference: ObjectReference, reason: &str, action: &str, note: String) {
        let ev = Event { type_: EventType::Warning, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
        let (recorder, reason) = (self.recorder.clone(), reason.to_string());
        tokio::spawn(async move {
            match tokio::time::timeout(PUBLISH_TIMEOUT, recorder.publish(&ev, &reference)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(error = %e, reason, service = ?reference.name, "could not publish an Event"),
                Err(_) => warn!(reason, service = ?reference.name, timeout = ?PUBLISH_TIMEOUT, "could not publish an Event: no answer in time"),
            }
        });
    }
}
