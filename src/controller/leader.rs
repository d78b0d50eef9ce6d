//! Leader election with a coordination.k8s.io/v1 Lease, with the guarantees of client-go's
//! `tools/leaderelection` (what kube-controller-manager uses):
//!
//! - **Expiry by local observation** ([`crate::k8s::lease::Observation`], shared with the
//!   address blocks). A replica that does not hold the Lease takes it over
//!   only once it has seen the same record (holder, renewTime, leaseDurationSeconds,
//!   resourceVersion) unchanged for `leaseDurationSeconds` on its own clock
//!   ([`crate::clock`]: suspended time counted). The
//!   timestamps in the Lease were written by another machine's clock and are never compared
//!   with ours: only their *change* says the holder is alive. A Lease with no holder (one
//!   released on shutdown) is free at once.
//! - **Bounded renew.** Every Lease API call runs under a timeout (the kube client has no read
//!   timeout: a request to a black-holed apiserver would otherwise never return). The leader
//!   keeps leading through failed renewals, and stops — the channel turns false — once its
//!   last successful renewal was *sent* more than `renew_deadline` ago, whether or not a call
//!   is still pending. Why this is safe: the successful write reached the apiserver after it
//!   was sent, another replica saw it after that and waits `lease_duration` more, and
//!   `renew_deadline < lease_duration`. What two replicas need is that their clocks run at
//!   about the same *rate* (not that they agree).
//! - **No flapping.** One failed call changes nothing; only the deadline, or a record naming
//!   another holder, ends leadership.
//! - Every write is conditional on the Lease's resourceVersion, so two replicas never both
//!   win one round.
//! - **Release on shutdown** (client-go's `ReleaseOnCancel`): once stopped, a leader clears the
//!   holder (leaseDurationSeconds 1) so another replica takes over at once instead of after
//!   the lease duration. The caller must have stopped everything the Lease guards first.
//!
//! The decisions are in [`Elector`] (pure: records and instants in, decisions out); [`run`]
//! does the I/O, reading the time from the injected clock. Starting and stopping the work the Lease guards is
//! [`super::supervise`]'s job.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::clock::{Clock, Moment};
use crate::k8s::lease::Observation;

/// client-go's `JitterFactor`: a replica that does not lead retries every retry period
/// stretched by up to this factor, and the renew deadline must exceed retry period × this.
pub const JITTER_FACTOR: f64 = 1.2;

/// The Lease and the election's timings (kube-controller-manager's defaults: 15 s, 10 s, 2 s).
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    /// How long a replica that does not lead waits, after the last change it saw to the
    /// Lease, before it takes the Lease over.
    pub lease_duration: Duration,
    /// How long the leader keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// How often the leader renews, and the others look.
    pub retry_period: Duration,
}

impl ElectionConfig {
    /// Kubernetes' rules for the three timings (client-go's `NewLeaderElector`), in the words
    /// of our flags.
    pub fn validate(&self) -> Result<(), String> {
        let (lease, renew, retry) = (self.lease_duration, self.renew_deadline, self.retry_period);
        for (flag, d) in [("lease-duration", lease), ("renew-deadline", renew), ("retry-period", retry)] {
            if d.is_zero() {
                return Err(format!("--leader-elect-{flag} must be greater than zero"));
            }
        }
        if lease <= renew {
            return Err(format!(
                "--leader-elect-lease-duration ({lease:?}) must be greater than --leader-elect-renew-deadline ({renew:?}): \
                 a leader that cannot renew must have stopped before another replica may take over"
            ));
        }
        if renew.as_secs_f64() <= retry.as_secs_f64() * JITTER_FACTOR {
            return Err(format!(
                "--leader-elect-renew-deadline ({renew:?}) must be greater than --leader-elect-retry-period ({retry:?}) × {JITTER_FACTOR}: \
                 the leader needs more than one try to renew before it gives up"
            ));
        }
        if lease.subsec_nanos() != 0 {
            return Err(format!("--leader-elect-lease-duration ({lease:?}) must be whole seconds: the Lease records leaseDurationSeconds"));
        }
        Ok(())
    }

    /// How long one try (a read and at most one write) may take: long enough for a slow
    /// apiserver, short enough that the leader gets a second try before its deadline.
    fn try_timeout(&self) -> Duration {
        self.retry_period.max(self.renew_deadline / 2)
    }
}

/// What a replica needs to know of one read of the Lease. Two reads with equal records mean
/// the holder has not renewed in between.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// None when the Lease names no holder (released).
    pub holder: Option<String>,
    pub renew_time: Option<Timestamp>,
    pub lease_duration_seconds: Option<i32>,
    pub resource_version: Option<String>,
}

impl Record {
    pub fn of(lease: &Lease) -> Record {
        let spec = lease.spec.clone().unwrap_or_default();
        Record {
            holder: spec.holder_identity.filter(|h| !h.is_empty()),
            renew_time: spec.renew_time.map(|t| t.0),
            lease_duration_seconds: spec.lease_duration_seconds,
            resource_version: lease.metadata.resource_version.clone(),
        }
    }
}

/// What to do after reading the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// There is no Lease: create it with us as holder.
    Create,
    /// We hold it: renew it.
    Renew,
    /// It has no holder, or its holder has not renewed for its lease duration by our clock:
    /// take it over.
    TakeOver { from: Option<String> },
    /// Someone else holds it; it expires in `expires_in` unless renewed.
    Wait { holder: String, expires_in: Duration },
}

/// The election's state as one replica sees it: pure, driven with the instants the caller
/// measured.
#[derive(Debug)]
pub struct Elector {
    identity: String,
    /// Used when the Lease does not say its own.
    lease_duration: Duration,
    renew_deadline: Duration,
    /// The last record read, and since when we have seen it (our clock).
    observed: Option<Observation<Record>>,
    /// When our last successful write as holder was sent.
    renewed: Option<Moment>,
}

impl Elector {
    pub fn new(cfg: &ElectionConfig) -> Elector {
        Elector { identity: cfg.identity.clone(), lease_duration: cfg.lease_duration, renew_deadline: cfg.renew_deadline, observed: None, renewed: None }
    }

    /// The Lease as read at `now` (None: it does not exist).
    pub fn observe(&mut self, record: Option<Record>, now: Moment) -> Decision {
        let Some(record) = record else {
            return Decision::Create;
        };
        let seen = Observation::next(self.observed.take(), record.clone(), now);
        let seen_for = seen.unchanged_for(now);
        self.observed = Some(seen);
        match record.holder {
            Some(h) if h == self.identity => Decision::Renew,
            None => {
                self.renewed = None;
                Decision::TakeOver { from: None }
            }
            Some(holder) => {
                // Someone else holds it: whatever we believed, we do not lead.
                self.renewed = None;
                let duration = match record.lease_duration_seconds {
                    Some(s) if s > 0 => Duration::from_secs(s.unsigned_abs().into()),
                    _ => self.lease_duration,
                };
                if seen_for >= duration {
                    Decision::TakeOver { from: Some(holder) }
                } else {
                    Decision::Wait { holder, expires_in: duration - seen_for }
                }
            }
        }
    }

    /// Our write as holder, sent at `sent`, succeeded at `now`; `record` is the Lease it
    /// wrote.
    pub fn held(&mut self, record: Record, sent: Moment, now: Moment) {
        self.renewed = Some(self.renewed.map_or(sent, |r| r.max(sent)));
        self.observed = Some(Observation::new(record, now));
    }

    /// Whether we lead at `now`: our last successful renewal was sent less than the renew
    /// deadline ago.
    pub fn leading(&self, now: Moment) -> bool {
        self.deadline().is_some_and(|d| now < d)
    }

    /// When leadership ends unless renewed (None: we do not hold the Lease).
    pub fn deadline(&self) -> Option<Moment> {
        self.renewed.map(|r| r + self.renew_deadline)
    }

    /// Forget our leadership (we released the Lease).
    pub fn released(&mut self) {
        self.renewed = None;
    }
}

/// Why one try failed.
#[derive(Debug, thiserror::Error)]
enum TryError {
    #[error("no answer from the kube-apiserver within {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Api(#[from] kube::Error),
}

/// Run the election until `stop` turns true, saying on `leading` whether we lead right now;
/// then, if we lead, release the Lease. The caller must have stopped the work the Lease
/// guards before it sets `stop` (the channel turns false first either way).
pub async fn run(api: Api<Lease>, cfg: ElectionConfig, leading: watch::Sender<bool>, stop: watch::Receiver<bool>) {
    run_on(crate::clock::system(), api, cfg, leading, stop).await
}

/// [`run`] on the clock `clock`.
pub async fn run_on(clock: Arc<dyn Clock>, api: Api<Lease>, cfg: ElectionConfig, leading: watch::Sender<bool>, mut stop: watch::Receiver<bool>) {
    let clock = &*clock;
    let mut elector = Elector::new(&cfg);
    let mut lease: Option<Lease> = None;
    let lease_name = format!("{}/{}", cfg.namespace, cfg.name);
    info!(lease = %lease_name, identity = %cfg.identity, "attempting to acquire leader lease");
    while !*stop.borrow() {
        let started = clock.now();
        // A try ends by its timeout, and for the leader by its deadline at the latest.
        let limit = elector.deadline().map_or(cfg.try_timeout(), |d| d.saturating_duration_since(started).min(cfg.try_timeout()));
        let was_leading = elector.leading(started);
        match tokio::time::timeout(limit, try_acquire_or_renew(clock, &api, &cfg, &mut elector, &mut lease)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => report_failure(&cfg, &lease_name, was_leading, &e),
            Err(_) => report_failure(&cfg, &lease_name, was_leading, &TryError::Timeout(limit)),
        }
        publish(clock, &leading, &elector, &lease_name);
        // The leader renews every retry period; the others look with jitter (client-go's).
        let period = if elector.leading(clock.now()) {
            cfg.retry_period
        } else {
            cfg.retry_period.mul_f64(1.0 + rand::random::<f64>() * (JITTER_FACTOR - 1.0))
        };
        // Wake at the deadline, too: leadership ends then, not at the next try.
        let now = clock.now();
        let wait = elector.deadline().filter(|d| *d > now).map_or(period, |d| d.saturating_duration_since(now).min(period));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => {}
        }
        publish(clock, &leading, &elector, &lease_name);
    }
    let was_leading = elector.leading(clock.now());
    elector.released();
    publish(clock, &leading, &elector, &lease_name);
    if was_leading {
        if let Some(held) = lease {
            release(&api, &cfg, held).await;
        }
    }
}

fn report_failure(cfg: &ElectionConfig, lease: &str, was_leading: bool, e: &TryError) {
    if was_leading {
        warn!(error = %e, lease, identity = %cfg.identity, "failed to renew lease; still leading until the renew deadline");
    } else {
        debug!(error = %e, lease, "failed to acquire lease");
    }
}

/// Say on the channel whether we lead now, logging the change.
fn publish(clock: &dyn Clock, leading: &watch::Sender<bool>, elector: &Elector, lease: &str) {
    let now = elector.leading(clock.now());
    leading.send_if_modified(|l| {
        if *l == now {
            return false;
        }
        if now {
            info!(lease, "successfully acquired lease");
        } else {
            warn!(lease, "lost the leader lease: not renewed within the renew deadline, or another replica holds it");
        }
        *l = now;
        true
    });
}

/// One read of the Lease and, if the decision says so, one write.
async fn try_acquire_or_renew(clock: &dyn Clock, api: &Api<Lease>, cfg: &ElectionConfig, elector: &mut Elector, held: &mut Option<Lease>) -> Result<(), TryError> {
    let current = api.get_opt(&cfg.name).await?;
    let decision = elector.observe(current.as_ref().map(Record::of), clock.now());
    let sent = clock.now();
    let written = match (decision, current) {
        (Decision::Wait { holder, expires_in }, _) => {
            debug!(%holder, ?expires_in, "lease is held by another replica and has not yet expired");
            return Ok(());
        }
        (Decision::Create, _) | (_, None) => {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(cfg.name.clone()), namespace: Some(cfg.namespace.clone()), ..Default::default() },
                spec: Some(spec(cfg, 0, None)),
            };
            api.create(&PostParams::default(), &lease).await?
        }
        (decision, Some(mut lease)) => {
            let old = lease.spec.clone().unwrap_or_default();
            let ours = decision == Decision::Renew;
            if let Decision::TakeOver { from } = &decision {
                info!(from = from.as_deref().unwrap_or("nobody"), "taking over the leader lease");
            }
            let transitions = old.lease_transitions.unwrap_or(0) + i32::from(!ours);
            lease.spec = Some(spec(cfg, transitions, if ours { old.acquire_time.clone() } else { None }));
            // replace() carries metadata.resourceVersion: a concurrent writer makes this a 409.
            api.replace(&cfg.name, &PostParams::default(), &lease).await?
        }
    };
    elector.held(Record::of(&written), sent, clock.now());
    *held = Some(written);
    Ok(())
}

fn spec(cfg: &ElectionConfig, transitions: i32, acquired: Option<MicroTime>) -> LeaseSpec {
    let now = MicroTime(Timestamp::now());
    LeaseSpec {
        holder_identity: Some(cfg.identity.clone()),
        lease_duration_seconds: Some(i32::try_from(cfg.lease_duration.as_secs()).unwrap_or(i32::MAX)),
        acquire_time: Some(acquired.unwrap_or_else(|| now.clone())),
        renew_time: Some(now),
        lease_transitions: Some(transitions),
        ..Default::default()
    }
}

/// Clear the holder (client-go's release: leaseDurationSeconds 1, transitions kept), on the
/// resourceVersion we last wrote, so that nobody else's Lease is ever cleared.
async fn release(api: &Api<Lease>, cfg: &ElectionConfig, mut lease: Lease) {
    let now = MicroTime(Timestamp::now());
    let transitions = lease.spec.as_ref().and_then(|s| s.lease_transitions);
    lease.spec = Some(LeaseSpec {
        holder_identity: None,
        lease_duration_seconds: Some(1),
        acquire_time: Some(now.clone()),
        renew_time: Some(now),
        lease_transitions: transitions,
        ..Default::default()
    });
    let lease_name = format!("{}/{}", cfg.namespace, cfg.name);
    match tokio::time::timeout(cfg.try_timeout(), api.replace(&cfg.name, &PostParams::default(), &lease)).await {
        Ok(Ok(_)) => info!(lease = %lease_name, "released the leader lease"),
        Ok(Err(e)) => warn!(lease = %lease_name, error = %e, "could not release the leader lease; another replica takes it over once it expires"),
        Err(_) => warn!(lease = %lease_name, timeout = ?cfg.try_timeout(), "releasing the leader lease timed out; another replica takes it over once it expires"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ElectionConfig {
        ElectionConfig {
            namespace: "ns".into(),
            name: "lease".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    fn rec(holder: Option<&str>, rv: &str, renew: Timestamp) -> Record {
        Record { holder: holder.map(str::to_string), renew_time: Some(renew), lease_duration_seconds: Some(15), resource_version: Some(rv.into()) }
    }

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn another_holder_expires_only_after_a_lease_duration_of_our_own_observation() {
        let t0 = Moment::ZERO;
        let mut e = Elector::new(&cfg());
        // renewTime from a clock far behind ours: the old code compared it with our wall
        // clock and took the Lease over at once. Only our observation counts.
        let stale = rec(Some("other"), "7", Timestamp::UNIX_EPOCH);
        assert_eq!(e.observe(Some(stale.clone()), t0), Decision::Wait { holder: "other".into(), expires_in: s(15) });
        assert_eq!(e.observe(Some(stale.clone()), t0 + s(14)), Decision::Wait { holder: "other".into(), expires_in: s(1) });
        assert_eq!(e.observe(Some(stale), t0 + s(15)), Decision::TakeOver { from: Some("other".into()) });
    }

    #[test]
    fn a_renewal_by_the_holder_starts_the_observation_again() {
        let t0 = Moment::ZERO;
        let mut e = Elector::new(&cfg());
        // renewTime far in our future (a clock ahead): it buys the holder nothing either.
        let far = Timestamp::from_second(4_000_000_000).unwrap_or(Timestamp::MAX);
        e.observe(Some(rec(Some("other"), "7", far)), t0);
        // The holder renewed (new resourceVersion) just before it would have expired.
        assert!(matches!(e.observe(Some(rec(Some("other"), "8", far)), t0 + s(14)), Decision::Wait { .. }));
        assert_eq!(e.observe(Some(rec(Some("other"), "8", far)), t0 + s(28)), Decision::Wait { holder: "other".into(), expires_in: s(1) });
        assert_eq!(e.observe(Some(rec(Some("other"), "8", far)), t0 + s(29)), Decision::TakeOver { from: Some("other".into()) });
    }

    #[test]
    fn the_record_s_own_lease_duration_counts_and_ours_stands_in_when_absent() {
        let t0 = Moment::ZERO;
        let mut e = Elector::new(&cfg());
        let mut r = rec(Some("other"), "7", Timestamp::UNIX_EPOCH);
        r.lease_duration_seconds = Some(40);
        e.observe(Some(r.clone()), t0);
        assert!(matches!(e.observe(Some(r.clone()), t0 + s(39)), Decision::Wait { .. }));
        assert!(matches!(e.observe(Some(r), t0 + s(40)), Decision::TakeOver { .. }));
        let mut e = Elector::new(&cfg());
        let mut r = rec(Some("other"), "7", Timestamp::UNIX_EPOCH);
        r.lease_duration_seconds = None;
        e.observe(Some(r.clone()), t0);
        assert!(matches!(e.observe(Some(r.clone()), t0 + s(14)), Decision::Wait { .. }));
        assert!(matches!(e.observe(Some(r), t0 + s(15)), Decision::TakeOver { .. }));
    }

    #[test]
    fn a_released_lease_is_free_at_once_and_a_missing_one_is_created() {
        let t0 = Moment::ZERO;
        let mut e = Elector::new(&cfg());
        assert_eq!(e.observe(Some(rec(None, "9", Timestamp::now())), t0), Decision::TakeOver { from: None });
        assert_eq!(e.observe(None, t0), Decision::Create);
    }

    #[test]
    fn the_leader_leads_until_the_renew_deadline_after_its_last_successful_renewal_was_sent() {
        let t0 = Moment::ZERO;
        let mut e = Elector::new(&cfg());
        assert!(!e.leading(t0));
        assert_eq!(e.observe(Some(rec(Some("me"), "3", Timestamp::now())), t0), Decision::Renew);
        // Sent at t0, answered 3 s later: the deadline counts from the send.
        e.held(rec(Some("me"), "4", Timestamp::now()), t0, t0 + s(3));
        assert!(e.leading(t0 + s(3)));
        // Failed renewals in between change nothing (no flapping) ...
        assert!(e.leading(t0 + Duration::from_millis(9_999)));
        // ... until the deadline.
        assert!(!e.leading(t0 + s(10)));
        assert_eq!(e.deadline(), Some(t0 + s(10)));
        // A later success moves the deadline; an older one (answered late) never moves it back.
        e.held(rec(Some("me"), "5", Timestamp::now()), t0 + s(8), t0 + s(9));
        e.held(rec(Some("me"), "5", Timestamp::now()), t0 + s(2), t0 + s(9));
        assert!(e.leading(t0 + s(17)));
        assert!(!e.leading(t0 + s(18)));
    }

    #[test]
    fn a_record_naming_another_holder_ends_leadership_at_once() {
        let t0 = Moment::ZERO;
        let mut e = Elector::new(&cfg());
        e.held(rec(Some("me"), "4", Timestamp::now()), t0, t0);
        assert!(matches!(e.observe(Some(rec(Some("other"), "5", Timestamp::now())), t0 + s(1)), Decision::Wait { .. }));
        assert!(!e.leading(t0 + s(1)));
        // And after a release we do not lead either.
        let mut e = Elector::new(&cfg());
        e.held(rec(Some("me"), "4", Timestamp::now()), t0, t0);
        e.released();
        assert!(!e.leading(t0));
    }

    #[test]
    fn the_timings_follow_kubernetes_rules() {
        assert_eq!(cfg().validate(), Ok(()));
        let with = |lease: u64, renew: u64, retry: u64| ElectionConfig { lease_duration: s(lease), renew_deadline: s(renew), retry_period: s(retry), ..cfg() }.validate();
        assert_eq!(with(6, 4, 1), Ok(()));
        let e = with(10, 10, 2).unwrap_err();
        assert!(e.starts_with("--leader-elect-lease-duration (10s) must be greater than --leader-elect-renew-deadline (10s)"), "{e}");
        let e = with(15, 10, 9).unwrap_err();
        assert!(e.starts_with("--leader-elect-renew-deadline (10s) must be greater than --leader-elect-retry-period (9s) × 1.2"), "{e}");
        assert_eq!(with(15, 0, 2).unwrap_err(), "--leader-elect-renew-deadline must be greater than zero");
        let e = ElectionConfig { lease_duration: Duration::from_millis(15_500), ..cfg() }.validate().unwrap_err();
        assert!(e.contains("must be whole seconds"), "{e}");
    }

    #[test]
    fn a_try_gets_a_second_chance_before_the_deadline() {
        assert_eq!(cfg().try_timeout(), s(5));
        let c = ElectionConfig { lease_duration: s(6), renew_deadline: s(4), retry_period: s(1), ..cfg() };
        assert_eq!(c.try_timeout(), s(2));
    }
}
