//! Run the leader's work (the reconcilers and the repair loop) exactly while the election
//! says we lead, and never once the election itself is gone.
//!
//! The election task is supervised: if it ends or panics, nobody renews the Lease any more
//! and another replica takes it over after the lease duration — so the work is stopped at
//! once and [`supervise`] returns [`Ended::Election`]. The controller then exits non-zero
//! (the Deployment restarts the pod, and the other replicas keep serving the webhook): a dead
//! election is a bug, and restarting it in-process would hide it.
//!
//! "Stopped" means the work's task was aborted and has finished (awaited) before the
//! transition is reported, so a "stopped leading" report is never ahead of the work.

use std::future::Future;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Why [`supervise`] returned; the work is stopped either way.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// `shutdown` completed.
    Shutdown,
    /// The election task ended or panicked (what it said).
    Election(String),
}

/// Start `start()` when `leading` turns true, stop it when it turns false, and stop it and
/// return when `shutdown` completes or `election` ends. `report(true|false)` is called after
/// each start and each stop.
pub async fn supervise(
    election: &mut JoinHandle<()>,
    mut leading: watch::Receiver<bool>,
    mut start: impl FnMut() -> JoinHandle<()>,
    mut report: impl FnMut(bool),
    shutdown: impl Future<Output = ()>,
) -> Ended {
    tokio::pin!(shutdown);
    let mut running: Option<JoinHandle<()>> = None;
    let mut open = true;
    let ended = loop {
        tokio::select! {
            r = &mut *election => break Ended::Election(match r {
                Ok(()) => "the leader election task ended".to_string(),
                Err(e) if e.is_panic() => format!("the leader election task panicked: {}", panic_text(e.into_panic())),
                Err(e) => format!("the leader election task stopped: {e}"),
            }),
            () = &mut shutdown => break Ended::Shutdown,
            changed = leading.changed(), if open => {
                // A closed channel means the election is ending; its handle says how.
                open = changed.is_ok();
                let lead = open && *leading.borrow_and_update();
                match (lead, running.take()) {
                    (true, None) => {
                        running = Some(start());
                        report(true);
                    }
                    (true, Some(r)) => running = Some(r),
                    (false, Some(r)) => {
                        stop(r).await;
                        report(false);
                    }
                    (false, None) => {}
                }
            }
        }
    };
    if let Some(r) = running.take() {
        stop(r).await;
        report(false);
    }
    ended
}

async fn stop(work: JoinHandle<()>) {
    work.abort();
    // Aborted (or it had ended, or panicked: reported where it happened).
    let _ = work.await;
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "(no message)".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// Sets its flag when dropped: the work's future was dropped (its task aborted).
    struct Dropped(Arc<AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// Work that runs until aborted; `started` counts starts, `stopped` says it was dropped.
    fn work(started: Arc<AtomicUsize>, stopped: Arc<AtomicBool>) -> impl FnMut() -> JoinHandle<()> {
        move || {
            started.fetch_add(1, Ordering::SeqCst);
            let guard = Dropped(stopped.clone());
            tokio::spawn(async move {
                let _guard = guard;
                std::future::pending::<()>().await
            })
        }
    }

    const LIMIT: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn a_panicking_election_stops_the_work_and_is_reported() {
        let (tx, rx) = watch::channel(false);
        let (started, stopped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let mut election = tokio::spawn(async move {
            tx.send_replace(true);
            // Panic only once the work runs, while still "leading" (tx dropped by the unwind).
            let _ = wait.await;
            panic!("boom");
        });
        let reports = Arc::new(Mutex::new(Vec::new()));
        let r = reports.clone();
        let mut go = Some(go);
        let s = started.clone();
        let mut start = work(started.clone(), stopped.clone());
        let start = move || {
            let h = start();
            if let Some(go) = go.take() {
                let _ = go.send(());
            }
            h
        };
        let ended = tokio::time::timeout(LIMIT, supervise(&mut election, rx, start, move |l| r.lock().unwrap().push(l), std::future::pending()))
            .await
            .expect("supervise returns when the election dies");
        assert_eq!(ended, Ended::Election("the leader election task panicked: boom".into()));
        assert_eq!(s.load(Ordering::SeqCst), 1);
        assert!(stopped.load(Ordering::SeqCst), "the work still runs after the election died");
        assert_eq!(*reports.lock().unwrap(), vec![true, false]);
    }

    #[tokio::test]
    async fn an_election_that_returns_stops_the_work_too() {
        let (tx, rx) = watch::channel(false);
        let (started, stopped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let mut election = tokio::spawn(async move {
            tx.send_replace(true);
            let _ = wait.await;
            // Returns with the channel still saying "leading", then drops it.
        });
        let mut go = Some(go);
        let mut inner = work(started.clone(), stopped.clone());
        let start = move || {
            let h = inner();
            if let Some(go) = go.take() {
                let _ = go.send(());
            }
            h
        };
        let ended = tokio::time::timeout(LIMIT, supervise(&mut election, rx, start, |_| {}, std::future::pending())).await.expect("supervise returns");
        assert_eq!(ended, Ended::Election("the leader election task ended".into()));
        assert!(stopped.load(Ordering::SeqCst), "the work still runs after the election ended");
    }

    #[tokio::test]
    async fn the_work_runs_exactly_while_leading_and_stops_on_shutdown() {
        let (tx, rx) = watch::channel(false);
        let (started, stopped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let (end, ended_rx) = tokio::sync::oneshot::channel::<()>();
        let reports = Arc::new(Mutex::new(Vec::new()));
        let r = reports.clone();
        let (s, st) = (started.clone(), stopped.clone());
        let mut election = tokio::spawn(async move {
            let wait_for = |n: usize| {
                let r = r.clone();
                async move {
                    while r.lock().unwrap().len() < n {
                        tokio::task::yield_now().await;
                    }
                }
            };
            tx.send_replace(true);
            wait_for(1).await;
            tx.send_replace(false);
            wait_for(2).await;
            assert!(st.load(Ordering::SeqCst), "stopped before reported");
            tx.send_replace(true);
            wait_for(3).await;
            assert_eq!(s.load(Ordering::SeqCst), 2);
            let _ = end.send(());
            std::future::pending::<()>().await
        });
        let rep = reports.clone();
        let shutdown = async move {
            let _ = ended_rx.await;
        };
        let ended = tokio::time::timeout(LIMIT, supervise(&mut election, rx, work(started.clone(), stopped.clone()), move |l| rep.lock().unwrap().push(l), shutdown))
            .await
            .expect("supervise returns on shutdown");
        assert_eq!(ended, Ended::Shutdown);
        assert_eq!(*reports.lock().unwrap(), vec![true, false, true, false]);
        assert!(!election.is_finished(), "shutdown leaves the election to the caller (it releases the Lease)");
        election.abort();
    }
}
