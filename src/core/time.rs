//! Injected time.
//!
//! The core never reads a clock: every input carries `now` as a [`Time`]. The engine feeds it
//! from a [`Clock`]; tests drive a [`ManualClock`] (or pass `Time` values directly) and can
//! live through 15 minutes or 25 hours in microseconds.
//!
//! A [`Time`] carries two readings taken together: a monotonic one, which orders times and
//! measures every deadline and backoff, and the wall clock, which only gives nostr
//! timestamps (`since`/`until`). A wall-clock step (NTP, a VM resumed, an operator's `date`)
//! therefore moves the `since` of the next query but never fails a deadline or stalls a
//! reconnect.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nostr::types::Timestamp;

/// A point in time: a monotonic reading (milliseconds, anchored near the Unix epoch so that
/// both readings start equal) plus the wall clock's reading at the same moment.
///
/// Equality, ordering, [`Time::since`] and hashing use the monotonic reading only;
/// [`Time::timestamp`] uses the wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct Time {
    mono: u64,
    wall: u64,
}

impl PartialEq for Time {
    fn eq(&self, other: &Time) -> bool {
        self.mono == other.mono
    }
}

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Time) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Time) -> std::cmp::Ordering {
        self.mono.cmp(&other.mono)
    }
}

impl std::hash::Hash for Time {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.mono.hash(state);
    }
}

impl Time {
    /// From milliseconds since the Unix epoch (both readings equal).
    pub const fn from_millis(ms: u64) -> Time {
        Time { mono: ms, wall: ms }
    }

    /// From seconds since the Unix epoch (both readings equal).
    pub const fn from_secs(secs: u64) -> Time {
        Time::from_millis(secs.saturating_mul(1000))
    }

    /// From separate readings: `mono_ms` orders and measures, `wall_ms` (milliseconds since
    /// the Unix epoch) gives timestamps.
    pub const fn from_readings(mono_ms: u64, wall_ms: u64) -> Time {
        Time {
            mono: mono_ms,
            wall: wall_ms,
        }
    }

    /// The monotonic reading in milliseconds.
    pub const fn as_millis(self) -> u64 {
        self.mono
    }

    /// The monotonic reading in whole seconds.
    pub const fn as_secs(self) -> u64 {
        self.mono / 1000
    }

    /// The wall clock in milliseconds since the Unix epoch.
    pub const fn wall_millis(self) -> u64 {
        self.wall
    }

    /// The nostr timestamp (whole seconds of the wall clock) of this instant.
    pub fn timestamp(self) -> Timestamp {
        Timestamp::from_secs(self.wall / 1000)
    }

    /// `self + d`, saturating (both readings).
    pub fn plus(self, d: Duration) -> Time {
        let d = d.as_millis() as u64;
        Time {
            mono: self.mono.saturating_add(d),
            wall: self.wall.saturating_add(d),
        }
    }

    /// `self - d`, saturating at zero (both readings).
    pub fn minus(self, d: Duration) -> Time {
        let d = d.as_millis() as u64;
        Time {
            mono: self.mono.saturating_sub(d),
            wall: self.wall.saturating_sub(d),
        }
    }

    /// This instant with the wall clock of `now` (the monotonic time elapsed since then taken
    /// from `now`'s wall reading): a stored time's timestamp as the wall clock reads now,
    /// whatever steps the wall clock made in between.
    pub fn rebased(self, now: Time) -> Time {
        now.minus(now.since(self))
    }

    /// The monotonic time elapsed from `earlier` to `self` (zero if `earlier` is later).
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_millis(self.mono.saturating_sub(earlier.mono))
    }
}

/// A source of [`Time`].
pub trait Clock: Send + Sync {
    /// The current time.
    fn now(&self) -> Time;
}

fn wall_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as u64
}

/// The operating system's clocks: `Instant` for the monotonic reading (anchored at the wall
/// clock of the first call in this process), `SystemTime` for the wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Time {
        static ANCHOR: OnceLock<(Instant, u64)> = OnceLock::new();
        let (start, wall0) = *ANCHOR.get_or_init(|| (Instant::now(), wall_now_ms()));
        let mono = wall0.saturating_add(start.elapsed().as_millis() as u64);
        Time::from_readings(mono, wall_now_ms())
    }
}

/// A clock that only moves when told to; for deterministic tests.
#[derive(Debug, Default)]
pub struct ManualClock {
    mono: AtomicU64,
    /// Wall clock minus monotonic reading, in milliseconds.
    wall_offset: AtomicI64,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Time) -> ManualClock {
        let c = ManualClock::default();
        c.set(start);
        c
    }

    /// Moves the clock forward by `d` (both readings).
    pub fn advance(&self, d: Duration) {
        self.mono.fetch_add(d.as_millis() as u64, Ordering::SeqCst);
    }

    /// Sets the clock to `t`.
    pub fn set(&self, t: Time) {
        self.mono.store(t.mono, Ordering::SeqCst);
        self.wall_offset
            .store(t.wall as i64 - t.mono as i64, Ordering::SeqCst);
    }

    /// Steps only the wall clock by `delta_ms` (negative: backwards), as NTP or an operator
    /// might; the monotonic reading does not move.
    pub fn step_wall(&self, delta_ms: i64) {
        self.wall_offset.fetch_add(delta_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Time {
        let mono = self.mono.load(Ordering::SeqCst);
        let wall = (mono as i64).saturating_add(self.wall_offset.load(Ordering::SeqCst));
        Time::from_readings(mono, wall.max(0) as u64)
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
        assert_eq!(c.now().timestamp().as_secs(), 100 + 25 * 3600);
    }

    #[test]
    fn a_wall_step_moves_timestamps_but_not_order_or_durations() {
        let c = ManualClock::new(Time::from_secs(1_000_000));
        let before = c.now();
        c.step_wall(-3_600_000);
        c.advance(Duration::from_secs(1));
        let after = c.now();
        assert!(after > before, "order follows the monotonic reading");
        assert_eq!(after.since(before), Duration::from_secs(1));
        assert_eq!(after.timestamp().as_secs(), 1_000_000 + 1 - 3600);
    }

    #[test]
    fn system_clock_now_is_monotonic_and_near_the_wall_clock() {
        let a = SystemClock.now();
        let b = SystemClock.now();
        assert!(b >= a);
        let wall = wall_now_ms();
        assert!(b.wall_millis().abs_diff(wall) < 5_000);
        // The monotonic reading starts at the wall clock of the first call.
        assert!(b.as_millis().abs_diff(wall) < 24 * 3_600_000);
    }
}
