//! Websocket keep-alive decisions: when to ping, when a peer is dead.
//!
//! Relays cut idle connections after 60–600 s counting what *they* receive, and tungstenite
//! sends no pings of its own, so every connection pings at most every `interval` and gives
//! up when no pong (or any other frame) arrives within `pong_timeout` of a ping.

use std::time::Duration;

use crate::core::time::Time;

/// What the connection loop must do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum KeepaliveAction {
    /// Nothing.
    Idle,
    /// Send a ping.
    SendPing,
    /// No answer to the last ping in time: drop the connection.
    Dead,
}

/// Keep-alive state of one connection.
#[derive(Debug, Clone)]
pub(crate) struct Keepalive {
    interval: Duration,
    pong_timeout: Duration,
    last_ping: Time,
    awaiting_since: Option<Time>,
    /// When work (a frame other than a ping or pong, or a command) last came: the loop's
    /// tick grows after quiet time ([`read_timeout`]).
    last_work: Time,
}

impl Keepalive {
    /// Starts counting at `now` (the connect time).
    #[must_use]
    pub(crate) fn new(now: Time, interval: Duration, pong_timeout: Duration) -> Keepalive {
        Keepalive {
            interval,
            pong_timeout,
            last_ping: now,
            awaiting_since: None,
            last_work: now,
        }
    }

    /// Any frame from the peer proves it is alive.
    pub(crate) fn on_activity(&mut self) {
        self.awaiting_since = None;
    }

    /// A frame from the peer at `now`: it proves the peer alive, and unless it is keep-alive
    /// traffic (`keepalive`: a ping, or the pong to our ping every `interval`) it is work that
    /// keeps the connection on its busy tick. A pong counted as work put every quiet
    /// connection on the busy tick for `idle` after each ping (decision 0067).
    pub(crate) fn on_frame(&mut self, now: Time, keepalive: bool) {
        self.on_activity();
        if !keepalive {
            self.on_work(now);
        }
    }

    /// Work that did not come from the socket (a command to send) at `now`.
    pub(crate) fn on_work(&mut self, now: Time) {
        self.last_work = self.last_work.max(now);
    }

    /// When work (a frame other than keep-alive traffic, or a command) last came.
    pub(crate) fn last_work(&self) -> Time {
        self.last_work
    }

    /// Decides at `now`; call on every tick.
    pub(crate) fn poll(&mut self, now: Time) -> KeepaliveAction {
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
    #[must_use]
    pub(crate) fn poll_timeout(&self) -> Time {
        let ping = self.last_ping.plus(self.interval);
        match self.awaiting_since {
            Some(since) => ping.min(since.plus(self.pong_timeout)),
            None => ping,
        }
    }
}

/// Pings a peer while a connection loop is blocked elsewhere and reads nothing (a relay
/// thread waiting for room in the forward pipeline): a ping every `interval` counted from the
/// first call, so a relay that cuts idle connections keeps us during a long own-relay outage.
/// No pong is awaited meanwhile (nothing is read); the connection's [`Keepalive`] takes over
/// when reading resumes.
#[derive(Debug, Clone)]
pub(crate) struct BlockedPinger {
    interval: Duration,
    last: Option<Time>,
}

impl BlockedPinger {
    /// Starts counting at the first [`BlockedPinger::due`].
    #[must_use]
    pub(crate) fn new(interval: Duration) -> BlockedPinger {
        BlockedPinger {
            interval,
            last: None,
        }
    }

    /// Whether a ping is due at `now` (and counts it as sent).
    pub(crate) fn due(&mut self, now: Time) -> bool {
        let since = *self.last.get_or_insert(now);
        if now.since(since) >= self.interval {
            self.last = Some(now);
            return true;
        }
        false
    }
}

/// The ticks of a connection loop by how long the connection has been quiet (see
/// [`RelaySession::read_timeout`](crate::core::session::RelaySession::read_timeout)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticks {
    /// While busy: a frame or a command within the last `idle`.
    pub busy: Duration,
    /// Once quiet for `idle`.
    pub idle: Duration,
    /// Once quiet for `quiet_after` (when longer than `idle`).
    pub quiet: Duration,
    /// How long a connection is quiet before it ticks every `quiet`.
    pub quiet_after: Duration,
}

/// How long a connection loop may block in one socket read (its tick).
///
/// A frame from the peer ends the read at once whatever the timeout; the timeout only bounds
/// how late the loop notices what does not come from the socket: commands on its control
/// channel, its own deadlines (`deadline`: pings, pong and AUTH deadlines) and the engine
/// stopping. So the loop ticks every `busy` while the connection is busy (work, `last_work`:
/// a frame other than a ping or pong, or a command, within the last `idle`), every `idle` once it has been quiet that long and every
/// `quiet` once it has been quiet for `quiet_after`, never past `deadline` (and never
/// shorter than `busy`).
///
/// (`tests::the_tick_grows_with_quiet_time_and_never_passes_a_deadline`.)
pub(crate) fn read_timeout(
    now: Time,
    last_work: Time,
    ticks: &Ticks,
    deadline: Option<Time>,
) -> Duration {
    let Ticks {
        busy,
        idle,
        quiet,
        quiet_after,
    } = *ticks;
    let quiet_for = now.since(last_work);
    if idle <= busy || quiet_for < idle {
        return busy;
    }
    let tick = if quiet > idle && quiet_for >= quiet_after {
        quiet
    } else {
        idle
    };
    let left = deadline.map_or(tick, |d| d.since(now));
    left.clamp(busy, tick)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tick_grows_with_quiet_time_and_never_passes_a_deadline() {
        let ticks = Ticks {
            busy: Duration::from_millis(50),
            idle: Duration::from_secs(1),
            quiet: Duration::from_secs(6),
            quiet_after: Duration::from_secs(30),
        };
        let t = Time::from_millis;
        assert_eq!(read_timeout(t(1_500), t(1_000), &ticks, None), ticks.busy);
        assert_eq!(read_timeout(t(5_000), t(1_000), &ticks, None), ticks.idle);
        assert_eq!(read_timeout(t(31_000), t(1_000), &ticks, None), ticks.quiet);
        assert_eq!(
            read_timeout(t(5_000), t(1_000), &ticks, Some(t(5_300))),
            Duration::from_millis(300)
        );
        assert_eq!(
            read_timeout(t(5_000), t(1_000), &ticks, Some(t(4_000))),
            ticks.busy
        );
    }

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

    /// Ticks of 50 ms busy, `idle` once quiet, 6 s after 30 s quiet.
    fn ticks(idle: Duration) -> Ticks {
        Ticks {
            busy: Duration::from_millis(50),
            idle,
            quiet: Duration::from_secs(6),
            quiet_after: Duration::from_secs(30),
        }
    }

    #[test]
    fn the_read_timeout_grows_only_while_quiet() {
        let ticks = ticks(Duration::from_secs(1));
        let t = Time::from_millis;
        assert_eq!(read_timeout(t(900), t(0), &ticks, None), ticks.busy);
        assert_eq!(read_timeout(t(1_000), t(0), &ticks, None), ticks.idle);
        assert_eq!(read_timeout(t(29_999), t(0), &ticks, None), ticks.idle);
        assert_eq!(read_timeout(t(30_000), t(0), &ticks, None), ticks.quiet);
        assert_eq!(
            read_timeout(t(1_000), t(0), &ticks, Some(t(1_010))),
            ticks.busy
        );
        assert_eq!(
            read_timeout(t(1_000), t(0), &ticks, Some(t(9_000))),
            ticks.idle
        );
        // Quiet for long: the next deadline still comes first.
        assert_eq!(
            read_timeout(t(40_000), t(0), &ticks, Some(t(42_000))),
            Duration::from_secs(2)
        );
        // An idle tick at or below the busy one disables the growth.
        let flat = Ticks {
            idle: ticks.busy,
            ..ticks
        };
        assert_eq!(read_timeout(t(90_000), t(0), &flat, None), ticks.busy);
        // A quiet tick at or below the idle one stays at the idle one.
        let no_quiet = Ticks {
            quiet: ticks.idle,
            ..ticks
        };
        assert_eq!(read_timeout(t(90_000), t(0), &no_quiet, None), ticks.idle);
    }

    /// A loop's tick as `RelaySession::read_timeout` takes it: from the last work, never past
    /// the connection's deadlines nor `other`.
    fn tick(k: &Keepalive, now: Time, ticks: &Ticks, other: Option<Time>) -> Duration {
        let deadline = other.map_or(k.poll_timeout(), |t| t.min(k.poll_timeout()));
        read_timeout(now, k.last_work(), ticks, Some(deadline))
    }

    #[test]
    fn pongs_keep_a_quiet_connection_on_its_quiet_ticks() {
        let ticks = ticks(Duration::from_secs(2));
        let t = Time::from_secs;
        let mut k = Keepalive::new(t(0), Duration::from_secs(30), Duration::from_secs(20));
        assert_eq!(tick(&k, t(1), &ticks, None), ticks.busy, "just connected");
        assert_eq!(tick(&k, t(5), &ticks, None), ticks.idle);
        // The ping at 30 s and its pong: the connection stays quiet.
        assert_eq!(k.poll(t(30)), KeepaliveAction::SendPing);
        k.on_frame(t(30), true);
        assert_eq!(tick(&k, t(31), &ticks, None), ticks.quiet);
        // An event is work: busy again.
        k.on_frame(t(40), false);
        assert_eq!(tick(&k, t(40), &ticks, None), ticks.busy);
        // So is a command to send.
        assert_eq!(tick(&k, t(43), &ticks, None), ticks.idle);
        k.on_work(t(43));
        assert_eq!(tick(&k, t(43), &ticks, None), ticks.busy);
        // Never past a deadline of the caller's.
        assert_eq!(tick(&k, t(50), &ticks, Some(t(51))), Duration::from_secs(1));
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
