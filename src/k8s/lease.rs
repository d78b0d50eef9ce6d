//! How clusterip reads a `coordination.k8s.io/v1` Lease that another replica holds — the
//! one home of "a Lease observed unchanged for D on our own clock", shared by the leader
//! election (`controller::leader`) and the address blocks (`store::ipaddress::blocks`).
//!
//! A holder is alive while its Lease *changes*. The timestamps in a Lease (renewTime) were
//! written by another machine's clock and are never compared with ours: a replica counts, on
//! its own [`Clock`](crate::clock::Clock), how long it has seen the same record, and only a
//! record seen unchanged for the whole lease duration is expired. Each protocol chooses what
//! its record is (what a renewal changes).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;

use crate::clock::Moment;

/// The Lease's holderIdentity (None when it names nobody).
pub fn holder(lease: &Lease) -> Option<&str> {
    lease.spec.as_ref()?.holder_identity.as_deref().filter(|h| !h.is_empty())
}

/// What only the holder's renewals change: holderIdentity and renewTime (an annotation
/// another replica writes changes the resourceVersion, not this).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Renewal {
    pub holder: Option<String>,
    pub renew_time: Option<Timestamp>,
}

impl Renewal {
    pub fn of(lease: &Lease) -> Renewal {
        Renewal { holder: holder(lease).map(str::to_string), renew_time: lease.spec.as_ref().and_then(|s| s.renew_time.as_ref()).map(|t| t.0) }
    }
}

/// A record `R` of a Lease as one replica has seen it: since when, on its own clock, it has
/// been the same.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation<R> {
    record: R,
    since: Moment,
}

impl<R: PartialEq> Observation<R> {
    /// First seen at `now`.
    pub fn new(record: R, now: Moment) -> Self {
        Observation { record, since: now }
    }

    /// The record as read at `now`, after `earlier` (None: not seen before): the count goes
    /// on if it is unchanged, and starts again if not.
    pub fn next(earlier: Option<Observation<R>>, record: R, now: Moment) -> Self {
        match earlier {
            Some(o) if o.record == record => Observation { record, since: o.since },
            _ => Observation::new(record, now),
        }
    }

    pub fn record(&self) -> &R {
        &self.record
    }

    /// How long the record has been seen unchanged at `now`.
    pub fn unchanged_for(&self, now: Moment) -> Duration {
        now.saturating_duration_since(self.since)
    }

    /// Whether the holder let it expire: seen unchanged for `lease_duration` at `now`.
    pub fn expired(&self, now: Moment, lease_duration: Duration) -> bool {
        self.unchanged_for(now) >= lease_duration
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_expires_after_a_lease_duration_unchanged_on_our_clock_and_a_change_restarts_the_count() {
        let s = Duration::from_secs;
        let t0 = Moment::ZERO;
        let o = Observation::next(None, 1, t0);
        let o = Observation::next(Some(o), 1, t0 + s(10));
        assert_eq!(o.unchanged_for(t0 + s(10)), s(10));
        assert!(!o.expired(t0 + s(14), s(15)));
        assert!(o.expired(t0 + s(15), s(15)));
        let o = Observation::next(Some(o), 2, t0 + s(15));
        assert!(!o.expired(t0 + s(29), s(15)));
        // A clock that seems to run backwards expires nothing.
        assert!(!o.expired(t0, s(15)));
    }
}
