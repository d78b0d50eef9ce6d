//! The conntrack flusher: a thread of its own that deletes the UDP entries the sync loop
//! planned, so that flushing never delays programming.
//!
//! The sync loop [`Flusher::submit`]s each successful sync's [`FlushSet`] and goes on at
//! once. What arrives while a round runs is merged into one pending set (the queue is one
//! set, not a list: a thousand syncs' flushes of one VIP are one flush), and the next round
//! takes all of it. A round is one ctnetlink dump per family with something to flush,
//! matched in memory against the set, then the deletes of the matches. The pending set is
//! bounded ([`MAX_PENDING`] flushes): a submit that would pass the bound is dropped,
//! logged and counted as a failure (as a failed round is: the rules are right either way,
//! only stale UDP entries may stay, as with kube-proxy when `conntrack` fails).
//!
//! Ordering: a round runs after the sync that planned it committed its rules, so an entry
//! it deletes is re-created by the new rules at the flow's next packet. A round may run
//! after a later sync re-added an endpoint it flushes: entries made to that endpoint in
//! between are deleted too, and their flows pick an endpoint again at their next packet.

use std::fs::File;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use super::ctnetlink::{Deleted, Entry, Socket};
use super::FlushSet;
use crate::locks;

/// Flushes waiting at most (hash-set keys: a VIP:port, or a VIP:port and an endpoint). A
/// Service is capped at `--max-service-addresses` VIP:ports (default 1024), so this holds
/// a hundred such Services' worth of removed endpoints.
pub const MAX_PENDING: usize = 100_000;

/// What the flusher reports.
#[derive(Clone, Debug)]
pub struct FlushMetrics {
    /// Failed rounds and dropped submits.
    pub failures: Counter,
    /// Entries deleted.
    pub deleted: Counter,
    /// Duration of a round (dump, match, deletes).
    pub duration: Histogram,
}

impl FlushMetrics {
    /// Metrics not registered anywhere (tests).
    pub fn detached() -> Self {
        FlushMetrics { failures: Counter::default(), deleted: Counter::default(), duration: Histogram::new([0.01, 0.1, 1.0]) }
    }
}

#[derive(Debug, Default)]
struct Queue {
    pending: FlushSet,
    /// A round is running.
    busy: bool,
    shutdown: bool,
    /// Rounds finished (for tests: `wait_idle`).
    rounds: u64,
}

#[derive(Debug, Default)]
struct Inner {
    queue: Mutex<Queue>,
    wake: Condvar,
}

/// One flush round: delete what `set` matches.
pub type Round = Box<dyn FnMut(&FlushSet) -> Result<Deleted, String> + Send>;

/// Handle of the flusher thread; dropping it stops the thread (after a round in progress).
pub struct Flusher {
    inner: Arc<Inner>,
    metrics: FlushMetrics,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Flusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Flusher")
    }
}

/// A round through ctnetlink in the namespace of `netns`, on a socket opened at the first
/// round and reopened after a failure.
pub fn netlink_round(netns: Option<Arc<File>>) -> Round {
    let mut socket: Option<Socket> = None;
    Box::new(move |set: &FlushSet| {
        let s = match socket.as_mut() {
            Some(s) => s,
            None => socket.insert(Socket::open(netns.as_deref()).map_err(|e| e.to_string())?),
        };
        let result = (|| {
            let mut doomed: Vec<Entry> = Vec::new();
            let mut dumped = 0;
            for family in set.families() {
                dumped += s.dump_udp(family, |e| {
                    if set.matches(e) {
                        doomed.push(*e);
                    }
                })?;
            }
            let d = s.delete(&doomed)?;
            tracing::debug!(flushes = set.len(), dumped, matched = doomed.len(), deleted = d.deleted, "conntrack flush round");
            Ok(d)
        })();
        result.map_err(|e: super::ctnetlink::CtError| {
            socket = None;
            e.to_string()
        })
    })
}

impl Flusher {
    /// Start the thread with `round` doing the work.
    pub fn start(round: Round, metrics: FlushMetrics) -> std::io::Result<Flusher> {
        let inner = Arc::new(Inner::default());
        let (i, m) = (inner.clone(), metrics.clone());
        let thread = std::thread::Builder::new().name("conntrack".into()).spawn(move || work(&i, round, &m))?;
        Ok(Flusher { inner, metrics, thread: Some(thread) })
    }

    /// Queue `set` (merged with what waits); never waits for a round.
    pub fn submit(&self, set: FlushSet) {
        if set.is_empty() {
            return;
        }
        let mut q = locks::lock(&self.inner.queue);
        if q.pending.len() + set.len() > MAX_PENDING {
            drop(q);
            tracing::warn!(flushes = set.len(), bound = MAX_PENDING, "conntrack flush queue full; these flushes are dropped");
            self.metrics.failures.inc();
            return;
        }
        q.pending.merge(set);
        self.inner.wake.notify_all();
    }

    /// Wait until nothing is pending or running, up to `timeout`; whether it got there.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut q = locks::lock(&self.inner.queue);
        while q.busy || !q.pending.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            q = locks::wait_timeout(&self.inner.wake, q, left);
        }
        true
    }
}

fn work(inner: &Inner, mut round: Round, metrics: &FlushMetrics) {
    loop {
        let set = {
            let mut q = locks::lock(&inner.queue);
            while q.pending.is_empty() && !q.shutdown {
                q = locks::wait(&inner.wake, q);
            }
            if q.shutdown {
                return;
            }
            q.busy = true;
            std::mem::take(&mut q.pending)
        };
        let start = Instant::now();
        match round(&set) {
            Ok(d) => {
                metrics.deleted.inc_by(d.deleted as u64);
                if d.deleted > 0 {
                    tracing::info!(flushes = set.len(), deleted = d.deleted, elapsed_ms = start.elapsed().as_millis() as u64, "conntrack entries flushed");
                }
            }
            Err(e) => {
                metrics.failures.inc();
                tracing::warn!(error = %e, flushes = set.len(), "conntrack flush failed");
            }
        }
        metrics.duration.observe(start.elapsed().as_secs_f64());
        let mut q = locks::lock(&inner.queue);
        q.busy = false;
        q.rounds += 1;
        inner.wake.notify_all();
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        locks::lock(&self.inner.queue).shutdown = true;
        self.inner.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conntrack::Flush;
    use std::net::IpAddr;

    fn flush(i: u32) -> FlushSet {
        let mut s = FlushSet::default();
        s.insert(Flush::Service { vip: IpAddr::from(std::net::Ipv4Addr::from(0xc613_0000 + i)), port: 53 });
        s
    }

    /// A round that records each set it gets and blocks while the gate is closed.
    type Gate = Arc<(Mutex<bool>, Condvar)>;

    fn gated() -> (Round, Arc<Mutex<Vec<usize>>>, Gate) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new((Mutex::new(true), Condvar::new()));
        let (s, g) = (seen.clone(), gate.clone());
        let round: Round = Box::new(move |set: &FlushSet| {
            locks::lock(&s).push(set.len());
            let mut closed = locks::lock(&g.0);
            while *closed {
                closed = locks::wait(&g.1, closed);
            }
            Ok(Deleted { deleted: set.len(), gone: 0 })
        });
        (round, seen, gate)
    }

    fn open(gate: &(Mutex<bool>, Condvar)) {
        *locks::lock(&gate.0) = false;
        gate.1.notify_all();
    }

    #[test]
    fn what_arrives_during_a_round_is_merged_into_the_next_and_submit_never_waits() {
        let (round, seen, gate) = gated();
        let metrics = FlushMetrics::detached();
        let f = Flusher::start(round, metrics.clone()).expect("start");
        f.submit(flush(0));
        // The first round is held; 100 submits (one of them a repeat) return at once.
        clusterip_test_support::wait_until("the first round to start", Duration::from_secs(60), || !locks::lock(&seen).is_empty());
        for i in 1..=100 {
            f.submit(flush(i));
        }
        f.submit(flush(7));
        open(&gate);
        assert!(f.wait_idle(Duration::from_secs(60)), "the flusher went idle");
        assert_eq!(*locks::lock(&seen), vec![1, 100], "one round for the first set, one for the 100 merged");
        assert_eq!(metrics.deleted.get(), 101);
        assert_eq!(metrics.failures.get(), 0);
    }

    #[test]
    fn the_pending_set_is_bounded_and_a_dropped_submit_is_counted() {
        let (round, seen, gate) = gated();
        let metrics = FlushMetrics::detached();
        let f = Flusher::start(round, metrics.clone()).expect("start");
        f.submit(flush(0));
        clusterip_test_support::wait_until("the first round to start", Duration::from_secs(60), || !locks::lock(&seen).is_empty());
        // While the first round is held: a set of the bound's size waits, the next is dropped.
        let mut big = FlushSet::default();
        for i in 0..MAX_PENDING as u32 {
            big.insert(Flush::Endpoint { vip: IpAddr::from(std::net::Ipv4Addr::from(0xc612_0000 + i)), port: 53, endpoint: "198.18.2.1".parse().expect("ip"), endpoint_port: 5353 });
        }
        f.submit(big);
        f.submit(flush(1));
        assert_eq!(locks::lock(&f.inner.queue).pending.len(), MAX_PENDING);
        assert_eq!(metrics.failures.get(), 1, "the dropped submit is counted");
        open(&gate);
        assert!(f.wait_idle(Duration::from_secs(60)));
        assert_eq!(*locks::lock(&seen), vec![1, MAX_PENDING]);
    }

    #[test]
    fn a_failed_round_is_counted_and_the_next_one_runs() {
        let mut calls = 0;
        let round: Round = Box::new(move |set: &FlushSet| {
            calls += 1;
            if calls == 1 {
                Err("injected".into())
            } else {
                Ok(Deleted { deleted: set.len(), gone: 0 })
            }
        });
        let metrics = FlushMetrics::detached();
        let f = Flusher::start(round, metrics.clone()).expect("start");
        f.submit(flush(0));
        assert!(f.wait_idle(Duration::from_secs(60)));
        f.submit(flush(1));
        assert!(f.wait_idle(Duration::from_secs(60)));
        assert_eq!((metrics.failures.get(), metrics.deleted.get()), (1, 1));
    }
}
