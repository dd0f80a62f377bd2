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

#[cfg(test)]
mod tests {
    use super::*;

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
