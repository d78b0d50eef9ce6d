//! Waiting in tests, the one way: poll a condition until it holds, and fail the test,
//! saying what was awaited (and what was seen last), once the limit has passed.
//!
//! Each helper has a blocking form (`wait_*`, for plain `#[test]`s and `Drop`) and an async
//! one (`eventually*`, `within`; never block a runtime's thread). Each polls at [`POLL`]
//! unless it takes a cadence (`every`): a slower one for a poll that itself loads the
//! cluster, a faster one where the moment matters, zero where each attempt takes its own
//! time (a round of requests).
//!
//! - [`wait_until`] / [`eventually`]: until a condition holds.
//! - [`wait_for`] / [`eventually_some`]: until a value is there (`Some`); that value.
//! - [`wait_ok`] / [`eventually_ok`]: until `Ok`; that value. The failure names the last
//!   `Err`, the state seen last (the last answer, the list still left, the log so far).
//! - [`wait_within`] / [`within`]: until `Some`, or `None` once the limit has passed, for a
//!   caller to whom "not within the limit" is an answer, not a failure.
//!
//! A fixed sleep stays only where time itself is the subject of a test ("nothing changes for
//! N seconds", a load paced at a rate), with a comment that says so.

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

/// How often a condition is polled.
pub const POLL: Duration = Duration::from_millis(50);

/// Poll `f` every `every` until it returns `Ok`: `Ok` with its value, or, once `limit` has
/// passed, `Err` with the last error. (The core of the blocking helpers.)
fn poll_blocking<T, E>(limit: Duration, every: Duration, mut f: impl FnMut() -> Result<T, E>) -> Result<T, E> {
    let deadline = Instant::now() + limit;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(every),
        }
    }
}

/// Poll the async `f` every `every` until it returns `Ok`: `Ok` with its value, or, once
/// `limit` has passed, `Err` with the last error. (The core of the async helpers.)
async fn poll_async<T, E, F, Fut>(limit: Duration, every: Duration, mut f: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(every).await,
        }
    }
}

/// Poll `f` until it returns `Some`; its value. Panics after `limit`.
pub fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    poll_blocking(limit, POLL, || f().ok_or(())).unwrap_or_else(|()| panic!("timed out after {limit:?} waiting for {what}"))
}

/// Poll `cond` until it holds. Panics after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    wait_for(what, limit, || cond().then_some(()))
}

/// Poll `f` every `every` until it returns `Ok`; its value. Panics after `limit`, with
/// `what` and the last error.
pub fn wait_ok<T, E: Display>(what: &str, limit: Duration, every: Duration, f: impl FnMut() -> Result<T, E>) -> T {
    poll_blocking(limit, every, f).unwrap_or_else(|last| panic!("timed out after {limit:?} waiting for {what}; last seen: {last}"))
}

/// Poll `f` every `every` until it returns `Some`; its value, or `None` after `limit`.
pub fn wait_within<T>(limit: Duration, every: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    poll_blocking(limit, every, || f().ok_or(())).ok()
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
/// `limit`.
pub async fn eventually_some<T, F, Fut>(what: &str, limit: Duration, every: Duration, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    within(limit, every, f).await.unwrap_or_else(|| panic!("timed out after {limit:?} waiting until {what}"))
}

/// Poll the async `f` every `every` until it returns `Ok`; its value. Panics after `limit`,
/// with `what` and the last error.
pub async fn eventually_ok<T, E, F, Fut>(what: &str, limit: Duration, every: Duration, f: F) -> T
where
    E: Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    poll_async(limit, every, f).await.unwrap_or_else(|last| panic!("timed out after {limit:?} waiting until {what}; last seen: {last}"))
}

/// Poll the async `f` every `every` until it returns `Some`; its value, or `None` after
/// `limit`.
pub async fn within<T, F, Fut>(limit: Duration, every: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll_async(limit, every, || {
        let v = f();
        async move { v.await.ok_or(()) }
    })
    .await
    .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_within_gives_the_value_or_none_after_the_limit() {
        let mut n = 0;
        assert_eq!(wait_within(Duration::from_secs(5), Duration::ZERO, || { n += 1; (n == 3).then_some(n) }), Some(3));
        let started = Instant::now();
        assert_eq!(wait_within(Duration::from_millis(30), Duration::from_millis(5), || None::<()>), None);
        assert!(started.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    #[should_panic(expected = "waiting for the answer; last seen: 7 left")]
    fn wait_ok_names_what_was_seen_last() {
        wait_ok("the answer", Duration::from_millis(20), Duration::from_millis(5), || Err::<(), _>("7 left"));
    }

    #[tokio::test]
    async fn within_gives_the_value_or_none_after_the_limit() {
        let n = std::cell::Cell::new(0);
        let got = within(Duration::from_secs(5), Duration::ZERO, || {
            n.set(n.get() + 1);
            let v = n.get();
            async move { (v == 3).then_some(v) }
        })
        .await;
        assert_eq!(got, Some(3));
        assert_eq!(within(Duration::from_millis(30), Duration::from_millis(5), || async { None::<()> }).await, None);
    }

    #[tokio::test]
    #[should_panic(expected = "waiting until the Lease moves; last seen: held by a")]
    async fn eventually_ok_names_what_was_seen_last() {
        eventually_ok("the Lease moves", Duration::from_millis(20), Duration::from_millis(5), || async { Err::<(), _>("held by a") }).await;
    }
}
