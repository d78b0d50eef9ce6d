//! The reconcilers a leading controller replica runs: the Service reconciler, the
//! ServiceCIDR reconciler, the repair loop and the address history's recorder, started together and stopped together
//! (`controller::supervise` starts them when the replica leads and aborts them when it
//! stops). Wiring, beside the command: the repair pass sits above the control loops.

use std::sync::Arc;
use std::time::Duration;

use crate::metrics::Metrics;
use crate::repair::{self, Repairer, Target};
use crate::store::ipaddress::apiserver_ips::ApiserverIps;
use crate::store::AllocationStore;

use crate::controller::events::ServiceEvents;
use crate::controller::{servicecidrs, services};

/// What the reconcilers share; [`Reconcilers::start`] starts one set of them.
#[derive(Clone)]
pub struct Reconcilers {
    pub client: kube::Client,
    pub store: Arc<dyn AllocationStore>,
    pub recorded: ApiserverIps,
    pub events: ServiceEvents,
    pub metrics: Arc<Metrics>,
    /// The replica's identity, the source of the repair pass's Events.
    pub identity: String,
    /// What the repair pass judges.
    pub repair_target: Target,
    /// How often the repair pass runs (also once at start); zero: never.
    pub repair_interval: Duration,
    /// An IPAddress of ours without its Service is released once older than this.
    pub repair_grace: Duration,
    /// Where the address history is kept ([`crate::history`]) and the replica's lines
    /// waiting for its writer (None: no history is kept): the leader records every change
    /// of the cluster's IPAddress objects, and its Service reconciler and repair pass note
    /// their decisions.
    pub history_namespace: String,
    pub history: Option<crate::history::Notes>,
}

impl Reconcilers {
    /// Start the reconcilers as one task (abort it to stop them all).
    pub fn start(&self) -> tokio::task::JoinHandle<()> {
        let cidr_ctx = Arc::new(servicecidrs::Context { client: self.client.clone(), store: self.store.clone(), recorded: self.recorded.clone(), metrics: self.metrics.clone(), events: self.events.clone(), told: Default::default() });
        let svc = services::run(self.client.clone(), self.store.clone(), self.recorded.clone(), self.events.clone(), self.metrics.clone(), self.history.clone());
        let repair = (!self.repair_interval.is_zero()).then(|| {
            let repairer = Repairer::new(self.client.clone(), self.repair_target.clone())
                .with_grace(self.repair_grace)
                .with_events(Some(self.identity.clone()))
                .with_metrics(self.metrics.clone())
                .with_history(self.history.clone());
            repair::run_loop(repairer, self.repair_interval)
        });
        let history = self.history.clone().map(|notes| crate::history::record(self.client.clone(), self.history_namespace.clone(), notes));
        tokio::spawn(async move {
            let repair = async move {
                if let Some(r) = repair {
                    r.await
                }
            };
            let history = async move {
                if let Some(h) = history {
                    h.await
                }
            };
            tokio::join!(svc, servicecidrs::run(cidr_ctx), repair, history);
        })
    }
}
