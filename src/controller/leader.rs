//! Leader election with a coordination.k8s.io/v1 Lease: the holder renews it every
//! `renew`; another replica takes it once it has not been renewed for `duration`. Every
//! write is conditional on the Lease's resourceVersion, so two replicas never both win.

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tracing::{info, warn};

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub duration: Duration,
    pub renew: Duration,
}

/// Run the election forever; the channel says whether we lead right now.
pub async fn run(client: kube::Client, cfg: LeaseConfig, leading: watch::Sender<bool>) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    loop {
        let lead = match try_acquire_or_renew(&api, &cfg).await {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, lease = %cfg.name, "lease update failed");
                false
            }
        };
        if *leading.borrow() != lead {
            info!(identity = %cfg.identity, leading = lead, "leadership changed");
            leading.send_replace(lead);
        }
        tokio::time::sleep(cfg.renew).await;
    }
}

fn spec(cfg: &LeaseConfig, transitions: i32, acquired: Option<MicroTime>) -> LeaseSpec {
    let now = MicroTime(Timestamp::now());
    LeaseSpec {
        holder_identity: Some(cfg.identity.clone()),
        lease_duration_seconds: Some(cfg.duration.as_secs().try_into().unwrap_or(i32::MAX)),
        acquire_time: Some(acquired.unwrap_or_else(|| now.clone())),
        renew_time: Some(now),
        lease_transitions: Some(transitions),
        ..Default::default()
    }
}

async fn try_acquire_or_renew(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<bool, kube::Error> {
    let current = api.get_opt(&cfg.name).await?;
    let Some(mut lease) = current else {
        let lease = Lease {
            metadata: ObjectMeta { name: Some(cfg.name.clone()), namespace: Some(cfg.namespace.clone()), ..Default::default() },
            spec: Some(spec(cfg, 0, None)),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        };
    };
    let old = lease.spec.clone().unwrap_or_default();
    let ours = old.holder_identity.as_deref() == Some(cfg.identity.as_str());
    let expired = match (&old.renew_time, old.lease_duration_seconds) {
        (Some(renewed), Some(secs)) => Timestamp::now() > renewed.0 + SignedDuration::from_secs(i64::from(secs)),
        _ => true,
    };
    if !ours && !expired {
        return Ok(false);
    }
    let transitions = old.lease_transitions.unwrap_or(0) + if ours { 0 } else { 1 };
    lease.spec = Some(spec(cfg, transitions, if ours { old.acquire_time.clone() } else { None }));
    // replace() carries metadata.resourceVersion: a concurrent writer makes this a 409.
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}
