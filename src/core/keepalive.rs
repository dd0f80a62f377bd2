//! Websocket keep-alive decisions: when to ping, when a peer is dead.
//!
//! Relays cut idle connections after 60–600 s counting what *they* receive, and tungstenite
//! sends no pings of its own, so every connection pings at most every `interval` and gives
//! up when no pong (or any other frame) arrives within `pong_timeout` of a ping.

use std::time::Duration;

use crate::core::time::Time;

/// What the connection loop must do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepaliveAction {
    /// Nothing.
    Idle,
    /// Send a ping.
    SendPing,
    /// No answer to the last ping in time: drop the connection.
    Dead,
}

/// Keep-alive state of one connection.
#[derive(Debug, Clone)]
pub struct Keepalive {
    interval: Duration,
    pong_timeout: Duration,
    last_ping: Time,
    awaiting_since: Option<Time>,
}

impl Keepalive {
    /// Starts counting at `now` (the connect time).
    pub fn new(now: Time, interval: Duration, pong_timeout: Duration) -> Keepalive {
        Keepalive {
            interval,
            pong_timeout,
            last_ping: now,
            awaiting_since: None,
        }
    }

    /// Any frame from the peer proves it is alive.
    pub fn on_activity(&mut self) {
        self.awaiting_since = None;
    }

    /// Decides at `now`; call on every tick.
    pub fn poll(&mut self, now: Time) -> KeepaliveAction {
        if let Some(since) = self.awaiting_since {
            if now.since(since) >= self.pong_timeout {
                return KeepaliveAction::Dead;
            }
        }
        if now.since(self.last_ping) >= self.interval {
            self.last_ping = now;
            if self.awaiting_since.is_none() {
                self.awaiting_since = Some(now);
            }
            return KeepaliveAction::SendPing;
        }
        KeepaliveAction::Idle
    }
}

impl Keepalive {
    /// The earliest time [`Keepalive::poll`] has something to do: the next ping, or the pong
    /// deadline of the last one.
    pub fn poll_timeout(&self) -> Time {
        let ping = self.last_ping.plus(self.interval);
        match self.awaiting_since {
            Some(since) => ping.min(since.plus(self.pong_timeout)),
            None => ping,
        }
    }
}

/// How long a connection loop may block in one socket read (its tick).
///
/// A frame from the peer ends the read at once whatever the timeout; the timeout only bounds
/// how late the loop notices what does not come from the socket: commands on its control
/// channel, its own deadlines (`deadline`: pings, pong and AUTH deadlines) and the engine
/// stopping. So the loop ticks every `busy` while the connection is busy (a frame or a
/// command within the last `idle`) and every `idle` once it has been quiet that long, never
/// past `deadline` (and never shorter than `busy`).
///
/// ```
/// use std::time::Duration;
/// use grasp_sync::core::keepalive::read_timeout;
/// use grasp_sync::core::time::Time;
/// let (busy, idle) = (Duration::from_millis(50), Duration::from_secs(1));
/// let t = |ms| Time::from_millis(ms);
/// assert_eq!(read_timeout(t(1_500), t(1_000), busy, idle, None), busy);
/// assert_eq!(read_timeout(t(5_000), t(1_000), busy, idle, None), idle);
/// assert_eq!(read_timeout(t(5_000), t(1_000), busy, idle, Some(t(5_300))), Duration::from_millis(300));
/// assert_eq!(read_timeout(t(5_000), t(1_000), busy, idle, Some(t(4_000))), busy);
/// ```
pub fn read_timeout(
    now: Time,
    last_busy: Time,
    busy: Duration,
    idle: Duration,
    deadline: Option<Time>,
) -> Duration {
    if idle <= busy || now.since(last_busy) < idle {
        return busy;
    }
    let left = deadline.map_or(idle, |d| d.since(now));
    left.clamp(busy, idle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_timeout_is_the_next_ping_or_the_pong_deadline() {
        let t = Time::from_secs;
        let mut k = Keepalive::new(t(0), Duration::from_secs(30), Duration::from_secs(20));
        assert_eq!(k.poll_timeout(), t(30));
        assert_eq!(k.poll(t(30)), KeepaliveAction::SendPing);
        assert_eq!(k.poll_timeout(), t(50), "the pong deadline comes first");
        k.on_activity();
        assert_eq!(k.poll_timeout(), t(60));
    }

    #[test]
    fn the_read_timeout_grows_only_while_quiet() {
        let (busy, idle) = (Duration::from_millis(50), Duration::from_secs(1));
        let t = Time::from_millis;
        assert_eq!(read_timeout(t(900), t(0), busy, idle, None), busy);
        assert_eq!(read_timeout(t(1_000), t(0), busy, idle, None), idle);
        assert_eq!(
            read_timeout(t(1_000), t(0), busy, idle, Some(t(1_010))),
            busy
        );
        assert_eq!(
            read_timeout(t(1_000), t(0), busy, idle, Some(t(9_000))),
            idle
        );
        // An idle tick at or below the busy one disables the growth.
        assert_eq!(read_timeout(t(9_000), t(0), busy, busy, None), busy);
    }

    #[test]
    fn pings_on_interval_and_detects_silence() {
        use KeepaliveAction::{Dead, Idle, SendPing};
        let t0 = Time::from_secs(0);
        let mut k = Keepalive::new(t0, Duration::from_secs(30), Duration::from_secs(20));
        // (seconds after t0, peer activity just before, expected decision)
        let steps = [
            (29, false, Idle),
            (30, false, SendPing),
            (31, false, Idle),
            (55, true, Idle),
            (60, false, SendPing),
            (79, false, Idle),
            (80, false, Dead),
        ];
        for (secs, activity, want) in steps {
            if activity {
                k.on_activity();
            }
            assert_eq!(
                k.poll(t0.plus(Duration::from_secs(secs))),
                want,
                "at {secs} s"
            );
        }
    }
}
