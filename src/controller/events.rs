//! Events on Services, with Kubernetes' reasons and wording.

use k8s_openapi::api::core::v1::{ObjectReference, Service};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::Resource;
use tracing::warn;

/// Who reports our Events.
pub const REPORTER: &str = "clusterip-controller";

#[derive(Clone)]
pub struct ServiceEvents {
    recorder: Recorder,
}

impl ServiceEvents {
    pub fn new(client: kube::Client, instance: Option<String>) -> Self {
        Self { recorder: Recorder::new(client, Reporter { controller: REPORTER.into(), instance }) }
    }

    /// A Warning Event on the Service. Publishing failures are logged, never fatal.
    pub async fn warn(&self, svc: &Service, reason: &str, action: &str, note: String) {
        let reference: ObjectReference = svc.object_ref(&());
        let ev = Event { type_: EventType::Warning, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            warn!(error = %e, reason, service = ?reference.name, "could not publish an Event");
        }
    }
}
