//! The sync loop: kube-proxy's bounded-frequency runner. Changes are coalesced — a sync
//! starts at least `min_sync_period` after the previous one ended — a full resync runs
//! every `sync_period` (re-render everything, and list the kernel tables to catch rules
//! changed behind the agent's back), and a failed sync is retried with backoff as a full
//! one.

#![forbid(unsafe_code)]

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::conntrack::flusher::{self, Flusher};
use crate::conntrack::ConntrackCleaner;
use crate::healthz::ProxyHealth;
use crate::locks;
use crate::metrics::kube_proxy::{family_label, NoLocalEndpoints};
use crate::metrics::{KindLabel, Metrics};
use crate::model::state::{Changes, ProxyState};
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
    /// Shared with the service health-check servers, which ask whether it is healthy.
    pub health: Arc<ProxyHealth>,
    pub metrics: Metrics,
}

impl Shared {
    pub fn new(state: ProxyState, health: ProxyHealth, metrics: Metrics) -> Arc<Self> {
        Arc::new(Shared {
            control: Mutex::new(Control { state, services_synced: false, slices_synced: false, shutdown: false, syncs: 0 }),
            wake: Condvar::new(),
            health: Arc::new(health),
            metrics,
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, Control> {
        locks::lock(&self.control)
    }

    /// Run `f` on the control block; if it reports a change, queue a sync.
    pub fn update(&self, f: impl FnOnce(&mut Control) -> bool) {
        let mut c = self.lock();
        let changed = f(&mut c);
        // Under the lock, which the sync loop takes to start a sync: a change is marked
        // queued before any sync can take it (the loop need not be woken to see it).
        self.metrics.kube_proxy.set_pending(c.state.pending_changes());
        if changed {
            self.health.queued_update();
            let now = unix_now();
            self.metrics.last_queued_timestamp.set(now);
            self.metrics.kube_proxy.queued(now);
        }
        drop(c);
        if changed {
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
pub fn run(
    shared: Arc<Shared>,
    mut proxier: Box<dyn Proxier>,
    exec: Executor,
    cfg: SyncConfig,
    mut service_health: Option<crate::service_health::ServiceHealthServers>,
) {
    let mut conntrack = ConntrackCleaner::default();
    // Off the programming path: a sync hands its flushes over and goes on.
    let flusher = match Flusher::start(flusher::netlink_round(exec.netns_file()), shared.metrics.conntrack()) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::error!(error = %e, "cannot start the conntrack flusher thread; stale UDP conntrack entries will not be flushed");
            None
        }
    };
    let mut last_end: Option<Instant> = None;
    let mut next_full = Instant::now();
    let mut retry_at: Option<Instant> = None;
    let mut backoff = Duration::from_secs(1).min(cfg.sync_period);
    let mut last_verify = Instant::now();
    // The dataplane has something to tidy (chains emptied by a rebuild): one more sync soon.
    let mut cleanup_pending = false;
    let mut no_local = NoLocalEndpoints::default();
    loop {
        // Wait for work.
        let mut c = shared.lock();
        let full_due = loop {
            if c.shutdown {
                return;
            }
            let now = Instant::now();
            let initialized = c.services_synced && c.slices_synced;
            let mut earliest = last_end.map_or(now, |t| t + cfg.min_sync_period);
            if let Some(r) = retry_at {
                // After a failure, wait for the backoff even if changes are pending.
                earliest = earliest.max(r);
            }
            let full_due = now >= next_full || retry_at.is_some_and(|r| now >= r);
            let wanted = initialized && (c.state.has_changes() || full_due || cleanup_pending);
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
            c = locks::wait_timeout(&shared.wake, c, wait);
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
        let (batch, changes, service_ports, limits) = {
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
            shared.metrics.kube_proxy.set_pending(c.state.pending_changes());
            (batch, changes, c.state.service_port_count(), c.state.limit_counts())
        };
        let result = proxier.sync(&batch);
        let elapsed = start.elapsed();
        shared.metrics.sync_duration.observe(elapsed.as_secs_f64());
        shared.metrics.kube_proxy.observe_sync(batch.full, elapsed.as_secs_f64());
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
                cleanup_pending = report.cleanup_pending;
                observe_programming(&shared.metrics, &changes, SystemTime::now());
                let now = unix_now();
                shared.metrics.last_sync_timestamp.set(now);
                shared.metrics.kube_proxy.sync_succeeded(now);
                no_local.update(&batch);
                no_local.publish(&shared.metrics.kube_proxy.no_local_endpoints);
                shared.metrics.service_ports.set(service_ports as i64);
                shared.metrics.services_over_address_limit.set(limits.0 as i64);
                shared.metrics.external_ips_ignored.set(limits.1 as i64);
                for (kind, n) in [("chains", report.chains), ("rules", report.rules), ("elements", report.elements)] {
                    shared.metrics.rules.get_or_create(&KindLabel { kind: kind.into() }).set(n as i64);
                }
                let flushes = conntrack.plan(&batch);
                let conntrack_flushes = flushes.len();
                match &flusher {
                    Some(f) => f.submit(flushes),
                    None => {
                        shared.metrics.conntrack_failures.inc();
                    }
                }
                if let Some(sh) = service_health.as_mut() {
                    let wanted = shared.lock().state.health_check_node_ports();
                    sh.sync(&wanted);
                }
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
                    netlink_transactions = report.netlink_transactions,
                    operations = report.operations,
                    conntrack_flushes,
                    elapsed_ms = elapsed.as_millis() as u64,
                    elapsed_us = elapsed.as_micros() as u64,
                    "sync done"
                );
            }
            Err(e) => {
                shared.metrics.sync_failures.inc();
                shared.metrics.kube_proxy.sync_failed(batch.full);
                tracing::error!(error = %e, retry_in = ?backoff, "sync failed");
                {
                    // The dataplane rebuilds after a failure: the retry must carry every Service.
                    let mut c = shared.lock();
                    c.state.restore_changes(changes);
                    c.state.request_full();
                    shared.metrics.kube_proxy.set_pending(c.state.pending_changes());
                }
                retry_at = Some(Instant::now() + backoff);
                backoff = (backoff * 2).min(cfg.sync_period.max(Duration::from_secs(1)));
            }
        }
        let was_full = batch.full;
        drop(batch);
        if was_full {
            // Hand the memory freed by a full sync (the batch, rendered fragments, the
            // transaction text: many small blocks at 10k Services) back now, after the sync
            // was timed. Otherwise glibc consolidates those blocks at the first allocation
            // of the *next* sync — measured at ~7 ms of a 10 ms first partial sync at 10k
            // Services (`malloc_trim` itself: ~8 ms, here, outside any sync).
            clusterip_component_base::memory::release_freed();
        }
        last_end = Some(Instant::now());
    }
}

/// The network programming latency of each change a sync programmed, from its trigger time
/// to `now`: in the agent's histogram, and in kube-proxy's for the slice's family. A trigger
/// time in the future (the control plane's clock ahead of the node's) is not observed.
fn observe_programming(metrics: &Metrics, changes: &Changes, now: SystemTime) {
    for ((_, family), t) in &changes.trigger_times {
        if let Ok(d) = now.duration_since(*t) {
            metrics.network_programming_duration.observe(d.as_secs_f64());
            metrics.kube_proxy.network_programming_duration.get_or_create(&family_label(*family)).observe(d.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::state::NodeInfo;
    use crate::proxier::{DataplaneError, SyncReport};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Records (full, number of Services, start, end) per sync; fails the first
    /// `fail_first` syncs; while `gate` is closed, a sync blocks (after recording its start).
    struct Fake {
        calls: Calls,
        fail_first: Arc<AtomicUsize>,
        gate: Arc<Gate>,
    }

    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Call {
        full: bool,
        services: usize,
        start: Instant,
        end: Instant,
    }

    /// Blocks syncs while closed.
    #[derive(Default)]
    struct Gate {
        closed: Mutex<bool>,
        cv: Condvar,
    }

    impl Gate {
        fn set(&self, closed: bool) {
            *locks::lock(&self.closed) = closed;
            self.cv.notify_all();
        }
        fn pass(&self) {
            let mut closed = locks::lock(&self.closed);
            while *closed {
                closed = locks::wait(&self.cv, closed);
            }
        }
    }

    impl Proxier for Fake {
        fn sync(&mut self, batch: &SyncBatch) -> Result<SyncReport, DataplaneError> {
            let start = Instant::now();
            let i = {
                let mut calls = locks::lock(&self.calls);
                calls.push(Call { full: batch.full, services: batch.services.len(), start, end: start });
                calls.len() - 1
            };
            self.gate.pass();
            locks::lock(&self.calls)[i].end = Instant::now();
            if self.fail_first.load(Ordering::SeqCst) > 0 {
                self.fail_first.fetch_sub(1, Ordering::SeqCst);
                return Err(DataplaneError::Listing("injected failure".into()));
            }
            Ok(SyncReport::default())
        }
        fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
            Ok(vec![])
        }
        fn cleanup(&mut self) -> Result<(), DataplaneError> {
            Ok(())
        }
        fn mode(&self) -> &'static str {
            "fake"
        }
    }

    fn svc(i: usize) -> k8s_openapi::api::core::v1::Service {
        serde_json::from_value(serde_json::json!({"metadata": {"name": format!("s{i}"), "namespace": "n"},
            "spec": {"clusterIP": format!("198.19.0.{}", i % 250 + 1), "ports": [{"port": 80}]}}))
        .expect("svc")
    }

    type Calls = Arc<Mutex<Vec<Call>>>;

    struct Loop {
        shared: Arc<Shared>,
        calls: Calls,
        gate: Arc<Gate>,
        thread: std::thread::JoinHandle<()>,
    }

    impl Loop {
        fn calls(&self) -> Vec<Call> {
            locks::lock(&self.calls).clone()
        }
        /// Stop the loop; the calls it made.
        fn stop(self) -> Vec<Call> {
            self.gate.set(false);
            self.shared.shutdown();
            let _ = self.thread.join();
            locks::lock(&self.calls).clone()
        }
    }

    fn start(fail_first: usize, min: Duration) -> Loop {
        start_with(fail_first, min, Duration::from_secs(3600))
    }

    /// `start` with a sync period (which also caps the backoff after failures).
    fn start_with(fail_first: usize, min: Duration, sync_period: Duration) -> Loop {
        let shared = Shared::new(ProxyState::new(NodeInfo::default(), None), ProxyHealth::new(Duration::from_secs(60)), Metrics::new());
        let calls: Calls = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(Gate::default());
        let fake = Fake { calls: calls.clone(), fail_first: Arc::new(AtomicUsize::new(fail_first)), gate: gate.clone() };
        let cfg = SyncConfig { min_sync_period: min, sync_period, verify_period: None };
        let s = shared.clone();
        let thread = std::thread::spawn(move || run(s, Box::new(fake), Executor::host(), cfg, None));
        Loop { shared, calls, gate, thread }
    }

    /// Wait for `f`, with a deadline generous enough for a loaded machine (it only bounds
    /// how long a broken loop makes the test hang).
    fn wait(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn nothing_runs_before_both_lists_then_changes_are_coalesced() {
        let min = Duration::from_millis(300);
        let l = start(0, min);
        l.shared.update(|c| {
            c.services_synced = true;
            c.state.apply_service(&svc(0))
        });
        // (A slow machine only makes this check weaker, never wrong.)
        std::thread::sleep(Duration::from_millis(100));
        assert!(l.calls().is_empty(), "no sync before EndpointSlices are listed");
        // Hold the first sync in the dataplane while 50 changes arrive one by one (each
        // wakes the loop): they must all go into one next sync, whatever the scheduling.
        l.gate.set(true);
        l.shared.update(|c| {
            c.slices_synced = true;
            true
        });
        wait("the first (full) sync to start", || !l.calls().is_empty());
        for i in 1..=50 {
            l.shared.update(|c| c.state.apply_service(&svc(i)));
        }
        l.gate.set(false);
        wait("all changes programmed", || l.shared.lock().syncs >= 2 && !l.shared.lock().state.has_changes());
        let c = l.stop();
        let summary: Vec<(bool, usize)> = c.iter().map(|x| (x.full, x.services)).collect();
        assert_eq!(summary, vec![(true, 1), (false, 50)], "the first sync is full with what was listed, then one sync for the 50 changes");
        let gap = c[1].start.duration_since(c[0].end);
        assert!(gap >= min, "the next sync started {gap:?} after the previous one ended, less than the min sync period {min:?}");
    }

    /// A dataplane whose tool hangs (`sleep 3600` for `nft`), run with a short timeout.
    struct HungTool {
        exec: Executor,
        syncs: Arc<AtomicUsize>,
    }

    impl Proxier for HungTool {
        fn sync(&mut self, _batch: &SyncBatch) -> Result<SyncReport, DataplaneError> {
            self.syncs.fetch_add(1, Ordering::SeqCst);
            self.exec.run("sleep", &["3600"], Some(b"add table ip clusterip\n"))?;
            Ok(SyncReport::default())
        }
        fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
            Ok(vec![])
        }
        fn cleanup(&mut self) -> Result<(), DataplaneError> {
            Ok(())
        }
        fn mode(&self) -> &'static str {
            "hung"
        }
    }

    fn slice(svc: usize, generation: usize) -> k8s_openapi::api::discovery::v1::EndpointSlice {
        // A trigger time after the state was made (older ones are not counted).
        let t = humantime::format_rfc3339_seconds(SystemTime::now() + Duration::from_secs(1)).to_string();
        serde_json::from_value(serde_json::json!({"metadata": {"name": format!("s{svc}-1"), "namespace": "n",
            "labels": {"kubernetes.io/service-name": format!("s{svc}")},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": t}},
            "addressType": "IPv4", "ports": [{"port": 8080}],
            "endpoints": [{"addresses": [format!("198.18.{}.{}", 2 + generation / 250, generation % 250 + 1)]}]}))
        .expect("slice")
    }

    /// `slice` with the trigger time `t`.
    fn slice_at(svc: usize, generation: usize, t: SystemTime) -> k8s_openapi::api::discovery::v1::EndpointSlice {
        let mut s = slice(svc, generation);
        s.metadata.annotations = Some([(TRIGGER.to_string(), humantime::format_rfc3339_millis(t).to_string())].into());
        s
    }

    const TRIGGER: &str = "endpoints.kubernetes.io/last-change-trigger-time";

    #[test]
    fn while_syncs_keep_failing_pending_state_stays_bounded() {
        // Backoff capped at 1 s by the sync period: failures come quickly.
        let l = start_with(usize::MAX, Duration::from_millis(1), Duration::from_secs(1));
        let services = 5;
        l.shared.update(|c| {
            c.services_synced = true;
            c.slices_synced = true;
            (0..services).for_each(|i| {
                c.state.apply_service(&svc(i));
            });
            true
        });
        // 2000 endpoint changes, spread over the 5 Services, arrive while every sync fails.
        for g in 0..2000 {
            l.shared.update(|c| c.state.apply_slice(&slice(g % services, g)));
            if g % 500 == 0 {
                let failed = l.shared.metrics.sync_failures.get();
                wait("another failed sync", || l.shared.metrics.sync_failures.get() > failed);
            }
        }
        let (changed, trigger_times) = l.shared.lock().state.pending();
        let shared = l.shared.clone();
        l.stop();
        assert!(shared.metrics.sync_failures.get() >= 4, "syncs kept failing");
        assert!(changed <= services && trigger_times <= services, "pending: {changed} Services, {trigger_times} trigger times (at most one per Service)");
    }

    #[test]
    fn a_hung_tool_fails_the_sync_which_is_retried_with_backoff() {
        let shared = Shared::new(ProxyState::new(NodeInfo::default(), None), ProxyHealth::new(Duration::from_secs(60)), Metrics::new());
        let syncs = Arc::new(AtomicUsize::new(0));
        let dataplane = HungTool { exec: Executor::host().with_timeout(Duration::from_millis(200)), syncs: syncs.clone() };
        let cfg = SyncConfig { min_sync_period: Duration::from_millis(1), sync_period: Duration::from_secs(3600), verify_period: None };
        let s = shared.clone();
        let started = Instant::now();
        let thread = std::thread::spawn(move || run(s, Box::new(dataplane), Executor::host(), cfg, None));
        shared.update(|c| {
            c.services_synced = true;
            c.slices_synced = true;
            c.state.apply_service(&svc(0))
        });
        wait("two failed syncs", || shared.metrics.sync_failures.get() >= 2);
        let elapsed = started.elapsed();
        shared.shutdown();
        let _ = thread.join();
        assert!(syncs.load(Ordering::SeqCst) >= 2, "the failed sync was retried");
        // The retry waits for the backoff (1 s) after the first failure.
        assert!(elapsed >= Duration::from_secs(1), "two attempts took {elapsed:?}, less than the 1 s backoff");
    }

    #[test]
    fn a_failed_sync_is_retried_as_a_full_one() {
        let l = start(1, Duration::from_millis(10));
        l.shared.update(|c| {
            c.services_synced = true;
            c.slices_synced = true;
            c.state.apply_service(&svc(0))
        });
        wait("a successful sync after the failure", || l.shared.lock().syncs >= 1);
        let shared = l.shared.clone();
        let c = l.stop();
        assert_eq!(c.len(), 2, "one failure, one retry: {c:?}");
        assert!(c[1].full, "the retry is a full sync: {c:?}");
        let waited = c[1].start.duration_since(c[0].end);
        assert!(waited >= Duration::from_secs(1), "the retry waited {waited:?}, less than the 1 s backoff");
        assert_eq!(shared.metrics.sync_failures.get(), 1);
    }

    /// The metrics text (what /metrics serves).
    fn text(shared: &Shared) -> String {
        shared.metrics.encode()
    }

    /// The value of the sample `line_prefix` (a name with its labels) in `text`.
    fn sample(text: &str, line_prefix: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(line_prefix).and_then(|v| v.trim().parse().ok()))
    }

    #[test]
    fn kube_proxy_metrics_follow_syncs_changes_and_trigger_times() {
        let l = start(0, Duration::from_millis(10));
        l.shared.update(|c| {
            c.services_synced = true;
            c.slices_synced = true;
            c.state.apply_service(&svc(0))
        });
        wait("the first sync", || l.shared.lock().syncs >= 1);
        let first = text(&l.shared);
        for family in ["IPv4", "IPv6"] {
            let l = format!("{{ip_family=\"{family}\"}}");
            assert_eq!(sample(&first, &format!("kubeproxy_sync_proxy_rules_duration_seconds_count{l}")), Some(1.0), "{first}");
            assert_eq!(sample(&first, &format!("kubeproxy_sync_full_proxy_rules_duration_seconds_count{l}")), Some(1.0), "{first}");
            let last = sample(&first, &format!("kubeproxy_sync_proxy_rules_last_timestamp_seconds{l}")).expect("last sync timestamp");
            assert!(last > 1.7e9, "a Unix time: {last}");
            assert!(sample(&first, &format!("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{l}")).is_some_and(|q| q <= last), "{first}");
        }
        assert_eq!(sample(&first, "kubeproxy_sync_proxy_rules_service_changes_pending "), Some(0.0), "taken by the sync: {first}");
        // A slice changed at a known time, held pending: counted, then programmed.
        l.gate.set(true);
        l.shared.update(|c| c.state.apply_service(&svc(1)));
        wait("the second sync to start", || l.calls().len() >= 2);
        let trigger = SystemTime::now();
        l.shared.update(|c| c.state.apply_slice(&slice_at(0, 1, trigger)));
        let pending = text(&l.shared);
        assert_eq!(sample(&pending, "kubeproxy_sync_proxy_rules_endpoint_changes_pending "), Some(1.0), "{pending}");
        std::thread::sleep(Duration::from_millis(300)); // (the latency to measure)
        l.gate.set(false);
        wait("the slice programmed", || l.shared.lock().syncs >= 3);
        let after = text(&l.shared);
        let _ = l.stop();
        assert_eq!(sample(&after, "kubeproxy_sync_proxy_rules_endpoint_changes_pending "), Some(0.0), "{after}");
        assert_eq!(sample(&after, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}"), Some(2.0), "{after}");
        // One observation, in the slice's family, between 0.25 s and the time since the trigger.
        let p = "kubeproxy_network_programming_duration_seconds";
        assert_eq!(sample(&after, &format!("{p}_count{{ip_family=\"IPv4\"}}")), Some(1.0), "{after}");
        assert!(!after.contains(&format!("{p}_count{{ip_family=\"IPv6\"}}")), "no IPv6 slice changed: {after}");
        let observed = sample(&after, &format!("{p}_sum{{ip_family=\"IPv4\"}}")).expect("sum");
        let bound = trigger.elapsed().expect("clock").as_secs_f64();
        assert!((0.25..=bound).contains(&observed), "observed {observed} s, the trigger was {bound} s ago");
        assert_eq!(sample(&after, &format!("{p}_bucket{{le=\"0.25\",ip_family=\"IPv4\"}}")), Some(0.0), "{after}");
    }

    #[test]
    fn failed_syncs_are_timed_and_counted_as_kube_proxy_does() {
        let l = start(1, Duration::from_millis(10));
        l.shared.update(|c| {
            c.services_synced = true;
            c.slices_synced = true;
            c.state.apply_service(&svc(0))
        });
        wait("the retry", || l.shared.lock().syncs >= 1);
        let t = text(&l.shared);
        let _ = l.stop();
        let v4 = "{ip_family=\"IPv4\"}";
        assert_eq!(sample(&t, &format!("kubeproxy_sync_proxy_rules_nftables_sync_failures_total{v4}")), Some(1.0), "{t}");
        // Both the failed sync and its retry are timed (kube-proxy's deferred observation).
        assert_eq!(sample(&t, &format!("kubeproxy_sync_proxy_rules_duration_seconds_count{v4}")), Some(2.0), "{t}");
        assert_eq!(sample(&t, "clusterip_agent_sync_proxy_rules_duration_seconds_count "), Some(2.0), "{t}");
        assert!(!t.contains("iptables_restore_failures"), "an nftables agent has no iptables counters: {t}");
    }
}
