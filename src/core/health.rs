//! Relay health: Healthy / Degraded / Dead, and the reconnect backoff.
//!
//! * backoff = `base × 2^(failures−1)`, capped at `max`, with ±25 % jitter;
//! * a connection that drops before it stayed up for `stability` does not reset the failure
//!   count, so a relay that connects and drops at once keeps backing off;
//! * after `dead_after` of continuous failure the relay is Dead and tried once per `dead_retry`;
//! * a failed *first* connect is a failure like any other and is retried.

use std::time::Duration;

use crate::core::time::Time;

/// Backoff and health thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// First retry delay (design: 5 s).
    pub base: Duration,
    /// Largest retry delay while not Dead.
    pub max: Duration,
    /// Continuous failure time after which a relay is Dead (design: 24 h).
    pub dead_after: Duration,
    /// Retry interval for a Dead relay (design: once a day).
    pub dead_retry: Duration,
    /// How long a connection must stay up to count as a recovery.
    pub stability: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(3600),
            dead_after: Duration::from_secs(24 * 3600),
            dead_retry: Duration::from_secs(24 * 3600),
            stability: Duration::from_secs(60),
        }
    }
}

/// Health of one relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HealthState {
    /// No failure since the last stable connection.
    Healthy,
    /// Failing, retried with exponential backoff.
    Degraded,
    /// Failing for longer than `dead_after`; retried once per `dead_retry`.
    Dead,
}

/// Failure history of one relay.
#[derive(Debug, Clone, Default)]
pub(crate) struct Health {
    failures: u32,
    failing_since: Option<Time>,
    connected_at: Option<Time>,
}

impl Health {
    /// Records a successful connect at `now`.
    pub(crate) fn record_success(&mut self, now: Time) {
        self.connected_at = Some(now);
    }

    /// Records a failed connect attempt or a lost connection at `now`.
    pub(crate) fn record_failure(&mut self, now: Time, policy: &BackoffPolicy) {
        if let Some(up) = self.connected_at.take() {
            if now.since(up) >= policy.stability {
                // The connection was stable: this is a new failure streak.
                self.failures = 0;
                self.failing_since = None;
            }
        }
        self.failures = self.failures.saturating_add(1);
        if self.failing_since.is_none() {
            self.failing_since = Some(now);
        }
    }

    /// Consecutive failures since the last stable connection.
    pub(crate) fn failures(&self) -> u32 {
        self.failures
    }

    /// The health state at `now`.
    pub(crate) fn state(&self, now: Time, policy: &BackoffPolicy) -> HealthState {
        if let Some(up) = self.connected_at {
            if now.since(up) >= policy.stability || self.failures == 0 {
                return HealthState::Healthy;
            }
        }
        match self.failing_since {
            None => HealthState::Healthy,
            Some(since) if now.since(since) >= policy.dead_after => HealthState::Dead,
            Some(_) => HealthState::Degraded,
        }
    }

    /// The delay before the next attempt, before jitter.
    pub(crate) fn base_delay(&self, now: Time, policy: &BackoffPolicy) -> Duration {
        if self.state(now, policy) == HealthState::Dead {
            return policy.dead_retry;
        }
        if self.failures == 0 {
            return Duration::ZERO;
        }
        let exp = (self.failures - 1).min(30);
        let d = policy.base.saturating_mul(1u32 << exp);
        d.min(policy.max)
    }

    /// The time of the next attempt: `now + base_delay ± 25 %` (`unit` in [0,1) from the
    /// caller's random source). A Dead relay gets no jitter shorter than `dead_retry`.
    pub(crate) fn next_attempt(&self, now: Time, policy: &BackoffPolicy, unit: f64) -> Time {
        let d = self.base_delay(now, policy);
        if self.state(now, policy) == HealthState::Dead {
            return now.plus(d.mul_f64(1.0 + 0.1 * unit));
        }
        now.plus(d.mul_f64(0.75 + 0.5 * unit))
    }
}

/// A small deterministic random source (xorshift64*), seeded by the engine, so the pure core
/// has jitter and random daily delays without reading any global state.
#[derive(Debug, Clone)]
pub(crate) struct Jitter(u64);

impl Jitter {
    /// A source seeded with `seed` (0 is replaced by a fixed non-zero constant).
    pub(crate) fn new(seed: u64) -> Jitter {
        Jitter(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// A number in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: BackoffPolicy = BackoffPolicy {
        base: Duration::from_secs(5),
        max: Duration::from_secs(3600),
        dead_after: Duration::from_secs(24 * 3600),
        dead_retry: Duration::from_secs(24 * 3600),
        stability: Duration::from_secs(60),
    };

    #[test]
    fn exponential_backoff_capped() {
        let mut h = Health::default();
        let t = Time::from_secs(1000);
        let mut delays = vec![];
        for _ in 0..12 {
            h.record_failure(t, &P);
            delays.push(h.base_delay(t, &P).as_secs());
        }
        assert_eq!(&delays[..5], &[5, 10, 20, 40, 80]);
        assert_eq!(*delays.last().unwrap(), 3600);
        assert_eq!(h.state(t, &P), HealthState::Degraded);
    }

    #[test]
    fn flapping_connection_keeps_backing_off_stable_one_resets() {
        let mut h = Health::default();
        let mut t = Time::from_secs(0);
        for _ in 0..3 {
            h.record_failure(t, &P);
        }
        assert_eq!(h.failures(), 3);
        // Connects and drops after 2 s: not stable.
        h.record_success(t);
        t = t.plus(Duration::from_secs(2));
        h.record_failure(t, &P);
        assert_eq!(h.failures(), 4);
        assert_eq!(h.base_delay(t, &P).as_secs(), 40);
        // Connects and stays 5 minutes: recovery.
        h.record_success(t);
        t = t.plus(Duration::from_secs(300));
        assert_eq!(h.state(t, &P), HealthState::Healthy);
        h.record_failure(t, &P);
        assert_eq!(h.failures(), 1);
        assert_eq!(h.base_delay(t, &P).as_secs(), 5);
    }

    #[test]
    fn dead_after_a_day_then_daily() {
        let mut h = Health::default();
        let start = Time::from_secs(0);
        h.record_failure(start, &P);
        let later = start.plus(Duration::from_secs(24 * 3600));
        h.record_failure(later, &P);
        assert_eq!(h.state(later, &P), HealthState::Dead);
        assert_eq!(h.base_delay(later, &P), Duration::from_secs(24 * 3600));
        assert!(h.next_attempt(later, &P, 0.0) >= later.plus(Duration::from_secs(24 * 3600)));
    }

    #[test]
    fn jitter_is_within_bounds_and_deterministic() {
        let mut a = Jitter::new(42);
        let mut b = Jitter::new(42);
        for _ in 0..1000 {
            let x = a.unit();
            assert!((0.0..1.0).contains(&x));
            assert_eq!(x, b.unit());
        }
        let mut h = Health::default();
        let t = Time::from_secs(100);
        h.record_failure(t, &P);
        let lo = h.next_attempt(t, &P, 0.0);
        let hi = h.next_attempt(t, &P, 0.999);
        assert_eq!(lo, t.plus(Duration::from_millis(3750)));
        assert!(hi < t.plus(Duration::from_millis(6250)));
    }
}
