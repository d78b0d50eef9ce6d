//! Waiting in tests: poll a condition every [`POLL`] and fail the test, saying what was
//! awaited, once the limit has passed.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often a condition is polled.
pub const POLL: Duration = Duration::from_millis(50);

/// Poll `f` until it returns `Some`; its value. Panics after `limit`.
pub fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for {what}");
        std::thread::sleep(POLL);
    }
}

/// Poll `cond` until it holds. Panics after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    wait_for(what, limit, || cond().then_some(()))
}

/// Poll the async `cond` until it holds. Panics after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually_some(what, limit, POLL, || {
        let c = cond();
        async move { c.await.then_some(()) }
    })
    .await
}

/// Poll the async `f` every `every` until it returns `Some`; its value. Panics after
/// `limit`. (A slower cadence than [`POLL`] for a poll that itself writes to the cluster.)
pub async fn eventually_some<T, F, Fut>(what: &str, limit: Duration, every: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting until {what}");
        tokio::time::sleep(every).await;
    }
}
