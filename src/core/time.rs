//! Injected time.
//!
//! The core never reads a clock: every input carries `now` as a [`Time`]. The engine feeds it
//! from a [`Clock`]; tests drive a [`ManualClock`] (or pass `Time` values directly) and can
//! live through 15 minutes or 25 hours in microseconds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nostr::types::Timestamp;

/// A point in time: milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(u64);

impl Time {
    /// From milliseconds since the Unix epoch.
    pub const fn from_millis(ms: u64) -> Time {
        Time(ms)
    }

    /// From seconds since the Unix epoch.
    pub const fn from_secs(secs: u64) -> Time {
        Time(secs.saturating_mul(1000))
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// Whole seconds since the Unix epoch.
    pub const fn as_secs(self) -> u64 {
        self.0 / 1000
    }

    /// The nostr timestamp (whole seconds) of this instant.
    pub fn timestamp(self) -> Timestamp {
        Timestamp::from_secs(self.as_secs())
    }

    /// `self + d`, saturating.
    pub fn plus(self, d: Duration) -> Time {
        Time(self.0.saturating_add(d.as_millis() as u64))
    }

    /// `self - d`, saturating at the epoch.
    pub fn minus(self, d: Duration) -> Time {
        Time(self.0.saturating_sub(d.as_millis() as u64))
    }

    /// The time elapsed from `earlier` to `self` (zero if `earlier` is later).
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

/// A source of [`Time`].
pub trait Clock: Send + Sync {
    /// The current time.
    fn now(&self) -> Time;
}

/// The operating system's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Time {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Time(d.as_millis() as u64)
    }
}

/// A clock that only moves when told to; for deterministic tests.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Time) -> ManualClock {
        ManualClock(AtomicU64::new(start.0))
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.0.fetch_add(d.as_millis() as u64, Ordering::SeqCst);
    }

    /// Sets the clock to `t`.
    pub fn set(&self, t: Time) {
        self.0.store(t.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Time {
        Time(self.0.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Time::from_secs(10);
        assert_eq!(t.minus(Duration::from_secs(20)), Time::from_millis(0));
        assert_eq!(t.plus(Duration::from_millis(1500)).as_millis(), 11_500);
        assert_eq!(t.since(Time::from_secs(12)), Duration::ZERO);
        assert_eq!(t.timestamp().as_secs(), 10);
    }

    #[test]
    fn manual_clock_advances() {
        let c = ManualClock::new(Time::from_secs(100));
        c.advance(Duration::from_secs(25 * 3600));
        assert_eq!(c.now().as_secs(), 100 + 25 * 3600);
    }
}
