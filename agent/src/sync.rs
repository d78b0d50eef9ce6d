//! The sync loop: kube-proxy's bounded-frequency runner. Changes are coalesced — a sync
//! starts at least `min_sync_period` after the previous one ended — a full resync runs
//! every `sync_period` (re-render everything, and list the kernel tables to catch rules
//! changed behind the agent's back), and a failed sync is retried with backoff as a full
//! one.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::conntrack::ConntrackCleaner;
use crate::healthz::ProxyHealth;
use crate::metrics::{KindLabel, Metrics};
use crate::model::state::ProxyState;
use crate::netns::Executor;
use crate::proxier::{Proxier, SyncBatch};

/// Timing of the loop.
#[derive(Debug, Clone)]
pub struct SyncConfig {
    pub min_sync_period: Duration,
    pub sync_period: Duration,
    /// List the tables to detect drift, at the first full resync after this period
    /// (None: never). Listing a big table is slow (seconds at 10k Services), so it is
    /// decoupled from `sync_period`.
    pub verify_period: Option<Duration>,
}

/// What the watchers and the sync loop share.
#[derive(Debug)]
pub struct Control {
    pub state: ProxyState,
    pub services_synced: bool,
    pub slices_synced: bool,
    pub shutdown: bool,
    /// Number of successful syncs (for tests and logs).
    pub syncs: u64,
}

/// Shared handle: state under a mutex, a condition variable to wake the loop.
#[derive(Debug)]
pub struct Shared {
    control: Mutex<Control>,
    wake: Condvar,
    pub health: ProxyHealth,
    pub metrics: Metrics,
}

impl Shared {
    pub fn new(state: ProxyState, health: ProxyHealth, metrics: Metrics) -> Arc<Self> {
        Arc::new(Shared {
            control: Mutex::new(Control { state, services_synced: false, slices_synced: false, shutdown: false, syncs: 0 }),
            wake: Condvar::new(),
            health,
            metrics,
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run `f` on the control block; if it reports a change, queue a sync.
    pub fn update(&self, f: impl FnOnce(&mut Control) -> bool) {
        let changed = {
            let mut c = self.lock();
            f(&mut c)
        };
        if changed {
            self.health.queued_update();
            self.metrics.last_queued_timestamp.set(unix_now());
            self.wake.notify_all();
        }
    }

    pub fn shutdown(&self) {
        self.lock().shutdown = true;
        self.wake.notify_all();
    }
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Run the loop until shutdown (blocking; run it on its own thread).
pub fn run(shared: Arc<Shared>, mut proxier: Box<dyn Proxier>, exec: Executor, cfg: SyncConfig) {
    let mut conntrack = ConntrackCleaner::default();
    let mut last_end: Option<Instant> = None;
    let mut next_full = Instant::now();
    let mut retry_at: Option<Instant> = None;
    let mut backoff = Duration::from_secs(1).min(cfg.sync_period);
    let mut last_verify = Instant::now();
    loop {
        // Wait for work.
        let mut c = shared.lock();
        let full_due = loop {
            if c.shutdown {
                return;
            }
            let now = Instant::now();
            let initialized = c.services_synced && c.slices_synced;
            let earliest = last_end.map_or(now, |t| t + cfg.min_sync_period);
            let full_due = now >= next_full || retry_at.is_some_and(|r| now >= r);
            let wanted = initialized && (c.state.has_changes() || full_due);
            if wanted && now >= earliest {
                break full_due;
            }
            let mut wake_at = if initialized { Some(next_full) } else { None };
            if let Some(r) = retry_at {
                wake_at = Some(wake_at.map_or(r, |w| w.min(r)));
            }
            if wanted {
                wake_at = Some(earliest);
            }
            let wait = wake_at.map_or(Duration::from_secs(3600), |w| w.saturating_duration_since(now)).max(Duration::from_millis(1));
            c = shared.wake.wait_timeout(c, wait).unwrap_or_else(|p| p.into_inner()).0;
        };
        drop(c);

        let start = Instant::now();
        if full_due && cfg.verify_period.is_some_and(|p| last_verify.elapsed() >= p) {
            last_verify = Instant::now();
            match proxier.verify() {
                Ok(diffs) if !diffs.is_empty() => {
                    shared.metrics.drift_detected.inc();
                    tracing::warn!(differences = diffs.len(), first = %diffs[0], "rules changed behind our back; rebuilding");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot verify the programmed rules"),
            }
        }
        // Take the changes and build the batch under the lock (pure, fast).
        let (batch, changes, service_ports) = {
            let mut c = shared.lock();
            if full_due {
                c.state.request_full();
            }
            let changes = c.state.take_changes();
            let names = if changes.full { c.state.service_names() } else { changes.services.iter().cloned().collect() };
            let services = names.into_iter().map(|n| {
                let d = c.state.desired(&n);
                (n, d)
            });
            let batch = SyncBatch { full: changes.full, services: services.collect() };
            (batch, changes, c.state.service_port_count())
        };
        let result = proxier.sync(&batch);
        let elapsed = start.elapsed();
        shared.metrics.sync_duration.observe(elapsed.as_secs_f64());
        match result {
            Ok(report) => {
                if batch.full {
                    shared.metrics.sync_full_duration.observe(elapsed.as_secs_f64());
                    next_full = Instant::now() + cfg.sync_period;
                } else {
                    shared.metrics.sync_partial_duration.observe(elapsed.as_secs_f64());
                }
                retry_at = None;
                backoff = Duration::from_secs(1).min(cfg.sync_period);
                let now = SystemTime::now();
                for t in &changes.trigger_times {
                    if let Ok(d) = now.duration_since(*t) {
                        shared.metrics.network_programming_duration.observe(d.as_secs_f64());
                    }
                }
                shared.metrics.last_sync_timestamp.set(unix_now());
                shared.metrics.service_ports.set(service_ports as i64);
                for (kind, n) in [("chains", report.chains), ("rules", report.rules), ("elements", report.elements)] {
                    shared.metrics.rules.get_or_create(&KindLabel { kind: kind.into() }).set(n as i64);
                }
                let flushes = conntrack.plan(&batch);
                let failures = ConntrackCleaner::execute(&exec, &flushes);
                shared.metrics.conntrack_failures.inc_by(failures.len() as u64);
                {
                    let mut c = shared.lock();
                    c.syncs += 1;
                    // Health: only clear the pending mark if nothing new arrived meanwhile.
                    if !c.state.has_changes() {
                        shared.health.updated();
                    }
                }
                tracing::info!(
                    mode = proxier.mode(),
                    full = batch.full,
                    services = batch.services.len(),
                    transactions = report.transactions,
                    operations = report.operations,
                    conntrack_flushes = flushes.len(),
                    elapsed_ms = elapsed.as_millis() as u64,
                    "sync done"
                );
            }
            Err(e) => {
                shared.metrics.sync_failures.inc();
                tracing::error!(error = %e, retry_in = ?backoff, "sync failed");
                shared.lock().state.restore_changes(changes);
                retry_at = Some(Instant::now() + backoff);
                backoff = (backoff * 2).min(cfg.sync_period.max(Duration::from_secs(1)));
            }
        }
        last_end = Some(Instant::now());
    }
}
