//! The clock of clusterip's protocols with timing rules — the leader election
//! (`controller::leader`) and the address blocks (`store::ipaddress::blocks`) — injected, so that their
//! decisions are tested with instants a test chooses, in milliseconds (as client-go's
//! `LeaderElector` holds a `clock.Clock` "to allow for less flaky testing").
//!
//! Both protocols measure *durations on this replica's own clock* (how long a Lease was seen
//! unchanged, how long ago a renewal was sent); they never compare instants of two machines.
//! The system clock is read from the kernel's `CLOCK_BOOTTIME`, which counts the time the
//! machine was suspended (a frozen VM, a suspend-to-RAM), not `CLOCK_MONOTONIC` (std's
//! `Instant`), which stands still meanwhile: a holder whose machine was frozen for minutes
//! must, when it resumes, count those minutes against its last renewal. Otherwise the two
//! clocks run at the same rate.

use std::fmt;
use std::ops::Add;
use std::sync::Arc;
use std::time::Duration;

/// A point on one replica's clock (time since an arbitrary origin, suspended time counted).
/// Only differences between two moments of the same clock mean anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Moment(Duration);

impl Moment {
    /// The clock's origin (tests count from it).
    pub const ZERO: Moment = Moment(Duration::ZERO);

    /// How long after `earlier` this moment is; zero if it is not after it.
    pub fn saturating_duration_since(self, earlier: Moment) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl Add<Duration> for Moment {
    type Output = Moment;
    fn add(self, d: Duration) -> Moment {
        Moment(self.0.saturating_add(d))
    }
}

/// Where the protocols read the time.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> Moment;
}

/// The kernel's clocks the system clock can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelClock {
    /// `CLOCK_MONOTONIC`: stands still while the machine is suspended.
    Monotonic,
    /// `CLOCK_BOOTTIME`: counts suspended time too.
    Boottime,
}

/// Reads a kernel clock (the seam through which tests freeze and resume a machine).
pub trait KernelClocks: Send + Sync + fmt::Debug {
    fn read(&self, which: KernelClock) -> Duration;
}

/// The kernel's own clocks (`clock_gettime`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Kernel;

impl KernelClocks for Kernel {
    fn read(&self, which: KernelClock) -> Duration {
        let id = match which {
            KernelClock::Monotonic => rustix::time::ClockId::Monotonic,
            KernelClock::Boottime => rustix::time::ClockId::Boottime,
        };
        let t = rustix::time::clock_gettime(id);
        Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
    }
}

/// The clock the protocols run on: the kernel clock that counts suspended time.
#[derive(Clone, Debug, Default)]
pub struct SystemClock<K = Kernel> {
    kernel: K,
}

impl<K: KernelClocks> SystemClock<K> {
    /// A system clock reading `kernel` (tests pass clocks they move by hand).
    pub fn with(kernel: K) -> Self {
        Self { kernel }
    }
}

impl<K: KernelClocks> Clock for SystemClock<K> {
    fn now(&self) -> Moment {
        Moment(self.kernel.read(KernelClock::Boottime))
    }
}

/// The system clock, shared.
pub fn system() -> Arc<dyn Clock> {
    Arc::new(SystemClock::<Kernel>::default())
}

/// Clocks a test moves by hand.
#[cfg(test)]
pub mod testing {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::{Clock, KernelClock, KernelClocks, Moment};
    use crate::sync::lock;

    /// A clock that moves only when told.
    #[derive(Clone, Debug, Default)]
    pub struct ManualClock(Arc<Mutex<Duration>>);

    impl ManualClock {
        pub fn advance(&self, d: Duration) {
            *lock(&self.0) += d;
        }
    }

    impl Clock for ManualClock {
        fn now(&self) -> Moment {
            Moment::ZERO + *lock(&self.0)
        }
    }

    /// A machine's two kernel clocks, moved by hand: [`Self::run`] moves both,
    /// [`Self::suspend`] only `CLOCK_BOOTTIME` (what a frozen VM's clocks show when it resumes).
    #[derive(Clone, Debug, Default)]
    pub struct Machine(Arc<Mutex<(Duration, Duration)>>);

    impl Machine {
        pub fn run(&self, d: Duration) {
            let mut t = lock(&self.0);
            t.0 += d;
            t.1 += d;
        }

        pub fn suspend(&self, d: Duration) {
            lock(&self.0).1 += d;
        }
    }

    impl KernelClocks for Machine {
        fn read(&self, which: KernelClock) -> Duration {
            let t = lock(&self.0);
            match which {
                KernelClock::Monotonic => t.0,
                KernelClock::Boottime => t.1,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_measure_durations_and_never_run_backwards() {
        let t = Moment::ZERO + Duration::from_secs(5);
        assert_eq!(t.saturating_duration_since(Moment::ZERO), Duration::from_secs(5));
        assert_eq!(Moment::ZERO.saturating_duration_since(t), Duration::ZERO);
    }

    #[test]
    fn the_kernel_clocks_read_and_boottime_is_not_behind_monotonic() {
        let (m, b) = (Kernel.read(KernelClock::Monotonic), Kernel.read(KernelClock::Boottime));
        assert!(b + Duration::from_millis(100) >= m, "CLOCK_BOOTTIME {b:?} behind CLOCK_MONOTONIC {m:?}");
        let c = system();
        let (t0, t1) = (c.now(), c.now());
        assert!(t1 >= t0);
    }
}
