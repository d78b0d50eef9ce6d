//! Locks that outlive a panic (the agent's counterpart of the controller's `src/sync.rs`).
//! A thread that panics while holding one of these std locks poisons it; every state
//! behind them stays consistent between statements, so the next holder goes on with the
//! value as it is instead of turning one panic into a cascade. The one place the agent
//! says so.

#![forbid(unsafe_code)]

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// `m.lock()`, through a poisoned lock.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `cv.wait(guard)`, through a poisoned lock.
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

/// `cv.wait_timeout(guard, d)` (without the timed-out flag), through a poisoned lock.
pub fn wait_timeout<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>, d: Duration) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, d).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_mutex_and_its_condvar_still_give_the_value() {
        let m = Mutex::new(1);
        let panicked = std::panic::catch_unwind(|| {
            let _held = m.lock();
            panic!("poisons the lock");
        });
        assert!(panicked.is_err() && m.is_poisoned());
        *lock(&m) += 1;
        let cv = Condvar::new();
        assert_eq!(*wait_timeout(&cv, lock(&m), Duration::from_millis(1)), 2);
    }
}
