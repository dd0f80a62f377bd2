//! Progress of a sync and an estimate of the time until it settles, sans-IO.
//!
//! The coordinator records a sample of a few counters every [`SAMPLE_INTERVAL`] into a
//! [`ProgressTracker`] (bounded: at most [`MAX_SAMPLES`] samples per counter, one pair of
//! counters per known relay); a status read turns the samples and the counters' current
//! values into rates over the last [`RATE_WINDOW`] and an [`Eta`]. Every function takes
//! `now`; nothing here reads a clock.
//!
//! # The estimate
//!
//! The unit of work is a **history query**: a REQ (or NIP-77 reconciliation) that reads a
//! relay's stored events up to its EOSE. A relay's pending history queries are those sent
//! without EOSE yet, waiting for room in its subscription budget, closed by the relay and
//! waiting to be opened again, waiting for room for their pages, and its reconciliations
//! (live-only REQs, `limit: 0`, read no history and are not counted).
//!
//! - **Per relay**: `pending ÷ completions per second over the last minute`, rounded up.
//!   Relays read in parallel, so each relay is estimated from its own rate.
//! - **In total**: the largest relay estimate, or the forward backlog ÷ events forwarded per
//!   second over the last minute if that is larger (the own relay must store what was read).
//!
//! The estimate is a floor, not a promise: a query that returns a full page adds a query for
//! the next page, and new announcements add repositories, so the pending count can grow while
//! the sync runs. When no honest figure exists, the estimate is [`Eta::Unknown`] with an
//! [`Unknown`] reason: a relay not connected, work known but no queries for it yet ("not yet
//! sized"), less than [`MIN_SPAN`] measured, or no completion in the last minute.

use std::collections::VecDeque;

use crate::core::hash::HashMap;
use std::fmt;
use std::time::Duration;

use crate::core::state::ConnectionStatus;
use crate::core::sync::RelaySyncStatus;
use crate::core::time::Time;
use crate::shared::RelayUrl;

/// The window of every rate: "over the last minute".
pub const RATE_WINDOW: Duration = Duration::from_secs(60);

/// The shortest interval between two samples of a counter.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(5);

/// The shortest span a rate is computed over; a shorter one gives no rate (an estimate from a
/// second or two after a start would swing wildly).
pub const MIN_SPAN: Duration = Duration::from_secs(10);

/// The most samples one counter keeps: a minute of samples plus one older, to cover the
/// window's start.
pub const MAX_SAMPLES: usize = (RATE_WINDOW.as_secs() / SAMPLE_INTERVAL.as_secs()) as usize + 2;

/// Samples `(time, value)` of one counter that only grows, over the last [`RATE_WINDOW`].
#[derive(Debug, Clone, Default)]
pub struct RateWindow {
    samples: VecDeque<(Time, u64)>,
}

impl RateWindow {
    /// Records the counter's value `total` at `now`: ignored within [`SAMPLE_INTERVAL`] of the
    /// last sample; samples older than the window are dropped but the newest of them (the
    /// window's start). A counter that went down (reset) starts over.
    pub fn record(&mut self, now: Time, total: u64) {
        if let Some(&(t, v)) = self.samples.back() {
            if now < t.plus(SAMPLE_INTERVAL) {
                return;
            }
            if total < v {
                self.samples.clear();
            }
        }
        self.samples.push_back((now, total));
        while self.samples.len() > 1 && now.since(self.samples[1].0) >= RATE_WINDOW {
            self.samples.pop_front();
        }
        while self.samples.len() > MAX_SAMPLES {
            self.samples.pop_front();
        }
    }

    /// Samples held.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// True when no sample is held.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The counter's growth per second from its oldest sample within the last
    /// [`RATE_WINDOW`] to `current` at `now`; `None` when that span is shorter than
    /// [`MIN_SPAN`] (or there is no sample).
    pub fn per_second(&self, now: Time, current: u64) -> Option<f64> {
        let &(t0, v0) = self
            .samples
            .iter()
            .find(|(t, _)| now.since(*t) <= RATE_WINDOW)?;
        let span = now.since(t0);
        if span < MIN_SPAN {
            return None;
        }
        Some(current.saturating_sub(v0) as f64 / span.as_secs_f64())
    }
}

/// The rates' samples of one relay.
#[derive(Debug, Clone, Default)]
struct RelaySamples {
    queries: RateWindow,
    events: RateWindow,
    seen: Time,
}

/// One relay's counters at a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayCounts {
    /// History queries completed (`RelaySyncStatus::history_queries_completed`).
    pub queries_completed: u64,
    /// Events handed to the forwarder (`RelayStatus::events_accepted`).
    pub events_forwarded: u64,
}

/// The samples of every rate: bounded by [`MAX_SAMPLES`] per counter and the relays of the
/// last sample.
#[derive(Debug, Default)]
pub struct ProgressTracker {
    relays: HashMap<RelayUrl, RelaySamples>,
    forwarded: RateWindow,
    last: Option<Time>,
}

impl ProgressTracker {
    /// True when a sample is due at `now` (none yet, or [`SAMPLE_INTERVAL`] since the last).
    pub fn due(&self, now: Time) -> bool {
        self.last.is_none_or(|t| now >= t.plus(SAMPLE_INTERVAL))
    }

    /// Records a sample: the events the own relay stored (`forwarded`) and each known relay's
    /// counters. Relays not in `relays` are forgotten.
    pub fn sample<'a>(
        &mut self,
        now: Time,
        forwarded: u64,
        relays: impl IntoIterator<Item = (&'a RelayUrl, RelayCounts)>,
    ) {
        self.last = Some(now);
        self.forwarded.record(now, forwarded);
        for (url, c) in relays {
            let s = match self.relays.get_mut(url) {
                Some(s) => s,
                None => self.relays.entry(url.clone()).or_default(),
            };
            s.queries.record(now, c.queries_completed);
            s.events.record(now, c.events_forwarded);
            s.seen = now;
        }
        self.relays.retain(|_, s| s.seen == now);
    }

    /// Relays with samples.
    pub fn relays(&self) -> usize {
        self.relays.len()
    }

    /// Events the own relay stored per second over the last minute, `forwarded` being the
    /// counter now.
    pub fn forwarded_per_second(&self, now: Time, forwarded: u64) -> Option<f64> {
        self.forwarded.per_second(now, forwarded)
    }

    /// `(history queries completed, events forwarded)` per second over the last minute of
    /// `relay`, whose counters are `c` now.
    pub fn relay_rates(
        &self,
        relay: &RelayUrl,
        now: Time,
        c: RelayCounts,
    ) -> (Option<f64>, Option<f64>) {
        match self.relays.get(relay) {
            Some(s) => (
                s.queries.per_second(now, c.queries_completed),
                s.events.per_second(now, c.events_forwarded),
            ),
            None => (None, None),
        }
    }
}

/// Why there is no estimate.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unknown {
    /// The relay is not connected (reconnects with a backoff; a dead relay may stay so).
    RelayDisconnected,
    /// The relay is connecting.
    RelayConnecting,
    /// Items wait to be confirmed but no history query for them exists yet (batch window,
    /// consolidation or planning pending): the work is not sized.
    NotYetSized,
    /// Items wait to be confirmed, held back until a failed batch (or a rate limit) lets the
    /// relay's batches be retried, in this many seconds.
    RetryPending {
        /// Seconds until the retry.
        in_secs: u64,
    },
    /// Less than [`MIN_SPAN`] of samples.
    Measuring,
    /// History queries are pending but none completed in the last minute.
    NoQueryCompleted,
    /// Events wait for the own relay but none was stored in the last minute.
    NoEventsForwarded,
    /// The own relay's self-subscription is not connected.
    OwnRelayDisconnected,
    /// The relay listed events for its queries that it did not deliver when asked by id
    /// twice: its history as read is short until its next full sync (issue 33).
    HistoryShort {
        /// Ids listed and not delivered.
        ids: u64,
    },
    /// The own relay's events are still being read or applied: what to sync is not known.
    OwnHistoryPending,
    /// Relays without an estimate: how many, and the first (by URL) with its reason.
    Relays {
        /// Relays without an estimate.
        count: usize,
        /// The first of them and why.
        first: Box<(RelayUrl, Unknown)>,
    },
}

impl fmt::Display for Unknown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unknown::RelayDisconnected => f.write_str("relay disconnected"),
            Unknown::RelayConnecting => f.write_str("relay connecting"),
            Unknown::NotYetSized => f.write_str("history queries not yet sized"),
            Unknown::RetryPending { in_secs } => write!(
                f,
                "failed history queries retried in {}",
                duration_words(*in_secs)
            ),
            Unknown::Measuring => write!(
                f,
                "measuring: less than {} s of samples",
                MIN_SPAN.as_secs()
            ),
            Unknown::NoQueryCompleted => {
                f.write_str("no history query completed in the last minute")
            }
            Unknown::NoEventsForwarded => f.write_str("no events forwarded in the last minute"),
            Unknown::OwnRelayDisconnected => f.write_str("own relay disconnected"),
            Unknown::HistoryShort { ids } => write!(
                f,
                "history short: {ids} events listed and not delivered (until its next full sync)"
            ),
            Unknown::OwnHistoryPending => f.write_str("own relay's events not yet read"),
            Unknown::Relays { count, first } => {
                write!(f, "{}: {}", first.0, first.1)?;
                if *count > 1 {
                    write!(f, " (and {} more relays without an estimate)", count - 1)?;
                }
                Ok(())
            }
        }
    }
}

/// An estimate of the time to settle.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Eta {
    /// Nothing pending: settled (0 s).
    Settled,
    /// About this many seconds (at least 1).
    Seconds(u64),
    /// No honest figure, and why.
    Unknown(Unknown),
}

impl Eta {
    /// The estimate in seconds (0 when settled), `None` when unknown.
    pub fn seconds(&self) -> Option<u64> {
        match self {
            Eta::Settled => Some(0),
            Eta::Seconds(s) => Some(*s),
            Eta::Unknown(_) => None,
        }
    }

    /// Why there is no estimate, if there is none.
    pub fn unknown(&self) -> Option<&Unknown> {
        match self {
            Eta::Unknown(u) => Some(u),
            _ => None,
        }
    }
}

impl fmt::Display for Eta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Eta::Settled => f.write_str("0s (settled)"),
            Eta::Seconds(s) => f.write_str(&duration_words(*s)),
            Eta::Unknown(u) => write!(f, "unknown ({u})"),
        }
    }
}

/// `90` → `1m30s`, `3700` → `1h01m`, `42` → `42s`.
pub fn duration_words(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, (secs % 3600) / 60),
    }
}

/// `amount ÷ rate` rounded up (at least 1 s), or why not.
fn divide(amount: u64, rate: Option<f64>, stalled: Unknown) -> Eta {
    match rate {
        None => Eta::Unknown(Unknown::Measuring),
        Some(r) if r <= 0.0 || !r.is_finite() => Eta::Unknown(stalled),
        Some(r) => Eta::Seconds(((amount as f64 / r).ceil() as u64).max(1)),
    }
}

/// What one relay's estimate is made from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RelayInput {
    /// Connection status.
    pub connection: ConnectionStatus,
    /// Batches awaiting EOSE.
    pub pending_batches: usize,
    /// Repositories and root events it should carry.
    pub target: (usize, usize),
    /// Repositories and root events confirmed.
    pub confirmed: (usize, usize),
    /// History queries pending (reconciliations included).
    pub history_queries_pending: usize,
    /// History queries completed per second over the last minute.
    pub queries_per_second: Option<f64>,
    /// Time until failed batches stop holding back the relay's next batches, if they do.
    pub retry_in: Option<Duration>,
    /// Ids it listed and did not deliver since its last full sync (issue 33).
    pub short: u64,
}

impl RelayInput {
    /// The relay's estimate: [`Eta::Settled`] when it is connected with nothing pending and
    /// everything it should carry confirmed; else `pending ÷ completion rate` (rounded up),
    /// or [`Eta::Unknown`] when the relay is not connected, nothing is queried yet for what
    /// is unconfirmed (waiting for the retry of a failed batch, or not yet sized), less than
    /// [`MIN_SPAN`] was measured or nothing completed in the last minute.
    pub fn eta(&self) -> Eta {
        match self.connection {
            ConnectionStatus::Connected => {}
            ConnectionStatus::Connecting => return Eta::Unknown(Unknown::RelayConnecting),
            ConnectionStatus::Disconnected => return Eta::Unknown(Unknown::RelayDisconnected),
        }
        let confirmed = self.confirmed.0 >= self.target.0 && self.confirmed.1 >= self.target.1;
        if self.history_queries_pending == 0 {
            return if confirmed && self.pending_batches == 0 && self.short > 0 {
                Eta::Unknown(Unknown::HistoryShort { ids: self.short })
            } else if confirmed && self.pending_batches == 0 {
                Eta::Settled
            } else if let Some(wait) = self.retry_in.filter(|_| !confirmed) {
                Eta::Unknown(Unknown::RetryPending {
                    in_secs: wait.as_secs_f64().ceil() as u64,
                })
            } else {
                Eta::Unknown(Unknown::NotYetSized)
            };
        }
        divide(
            self.history_queries_pending as u64,
            self.queries_per_second,
            Unknown::NoQueryCompleted,
        )
    }
}

/// One relay's progress (in `RelayStatus::progress`).
#[derive(Debug, Clone, PartialEq)]
pub struct RelayProgress {
    /// History queries pending (reconciliations included).
    pub history_queries_pending: usize,
    /// History queries completed since the relay became known.
    pub history_queries_completed: u64,
    /// History queries completed per second over the last minute (`None`: less than
    /// [`MIN_SPAN`] measured).
    pub queries_per_second: Option<f64>,
    /// Events of this relay handed to the forwarder per second over the last minute (copies
    /// already forwarded from another relay are not counted).
    pub events_forwarded_per_second: Option<f64>,
    /// The estimate of its time to settle ([`RelayInput::eta`]).
    pub eta: Eta,
}

impl RelayProgress {
    /// The progress of the relay of `s`, `events_forwarded` being its counter of events handed
    /// to the forwarder now.
    pub fn of(
        s: &RelaySyncStatus,
        events_forwarded: u64,
        tracker: &ProgressTracker,
        now: Time,
    ) -> RelayProgress {
        let counts = RelayCounts {
            queries_completed: s.history_queries_completed,
            events_forwarded,
        };
        let (queries_per_second, events_forwarded_per_second) =
            tracker.relay_rates(&s.url, now, counts);
        let eta = RelayInput {
            connection: s.connection_status,
            pending_batches: s.pending_batches,
            target: (s.target_repos, s.target_root_events),
            confirmed: (s.confirmed_repos, s.confirmed_root_events),
            history_queries_pending: s.history_queries_pending,
            queries_per_second,
            retry_in: s.batches_retry_at.map(|t| t.since(now)),
            short: s.history_short,
        }
        .eta();
        RelayProgress {
            history_queries_pending: s.history_queries_pending,
            history_queries_completed: s.history_queries_completed,
            queries_per_second,
            events_forwarded_per_second,
            eta,
        }
    }
}

/// Progress in total (in `Status::progress`).
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Repositories confirmed, summed over relays (a repository on three relays counts three
    /// times).
    pub confirmed_repos: usize,
    /// Repositories the relays should carry, summed over relays.
    pub target_repos: usize,
    /// Root events confirmed, summed over relays.
    pub confirmed_root_events: usize,
    /// Root events the relays should carry, summed over relays.
    pub target_root_events: usize,
    /// History queries pending on every relay.
    pub history_queries_pending: usize,
    /// Events the own relay stored per second over the last minute.
    pub events_forwarded_per_second: Option<f64>,
    /// Relays whose estimate is [`Eta::Settled`].
    pub relays_settled: usize,
    /// Relays whose estimate is [`Eta::Unknown`].
    pub relays_without_estimate: usize,
    /// The estimate of the time until everything is settled ([`total_eta`]).
    pub eta: Eta,
}

impl Progress {
    /// The total of `relays` (each relay's status and progress) and the own relay's side.
    pub fn of<'a>(
        relays: impl IntoIterator<Item = (&'a RelaySyncStatus, &'a RelayProgress)>,
        own: &OwnInput,
    ) -> Progress {
        let relays: Vec<_> = relays.into_iter().collect();
        let sum = |f: fn(&RelaySyncStatus) -> usize| relays.iter().map(|(s, _)| f(s)).sum();
        Progress {
            confirmed_repos: sum(|s| s.confirmed_repos),
            target_repos: sum(|s| s.target_repos),
            confirmed_root_events: sum(|s| s.confirmed_root_events),
            target_root_events: sum(|s| s.target_root_events),
            history_queries_pending: sum(|s| s.history_queries_pending),
            events_forwarded_per_second: own.forwarded_per_second,
            relays_settled: relays.iter().filter(|(_, p)| p.eta == Eta::Settled).count(),
            relays_without_estimate: relays
                .iter()
                .filter(|(_, p)| p.eta.unknown().is_some())
                .count(),
            eta: total_eta(own, relays.iter().map(|(s, p)| (&s.url, &p.eta))),
        }
    }
}

/// What the total estimate is made from besides the relays' estimates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OwnInput {
    /// The self-subscription is connected.
    pub connected: bool,
    /// The own relay's events are still being read or applied.
    pub self_sync_pending: bool,
    /// Events handed to the forwarder and not yet answered by the own relay.
    pub forward_backlog: u64,
    /// Events the own relay stored per second over the last minute.
    pub forwarded_per_second: Option<f64>,
}

/// The total estimate: [`Eta::Settled`] when the own relay is connected, its events applied,
/// the forward backlog empty and every relay settled; else the largest of the relays'
/// estimates and `forward backlog ÷ forwarded per second` (relays read in parallel, the own
/// relay stores behind them). Unknown when the own relay is not connected, when any relay has
/// no estimate (the first by order of `relays` is named), when the backlog has no rate, or
/// when only the own relay's events are left to read.
pub fn total_eta<'a>(
    own: &OwnInput,
    relays: impl IntoIterator<Item = (&'a RelayUrl, &'a Eta)>,
) -> Eta {
    if !own.connected {
        return Eta::Unknown(Unknown::OwnRelayDisconnected);
    }
    let mut worst = 0u64;
    let mut unknown: Option<(RelayUrl, Unknown)> = None;
    let mut count = 0;
    for (url, eta) in relays {
        match eta {
            Eta::Settled => {}
            Eta::Seconds(s) => worst = worst.max(*s),
            Eta::Unknown(u) => {
                count += 1;
                if unknown.is_none() {
                    unknown = Some((url.clone(), u.clone()));
                }
            }
        }
    }
    if let Some(first) = unknown {
        return Eta::Unknown(Unknown::Relays {
            count,
            first: Box::new(first),
        });
    }
    if own.forward_backlog > 0 {
        match divide(
            own.forward_backlog,
            own.forwarded_per_second,
            Unknown::NoEventsForwarded,
        ) {
            Eta::Seconds(s) => worst = worst.max(s),
            other => return other,
        }
    }
    match worst {
        0 if own.self_sync_pending => Eta::Unknown(Unknown::OwnHistoryPending),
        0 => Eta::Settled,
        s => Eta::Seconds(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Time {
        Time::from_secs(1_000_000 + secs)
    }

    fn url(s: &str) -> RelayUrl {
        RelayUrl::parse(s).unwrap()
    }

    #[test]
    fn rate_is_over_the_last_minute_only() {
        let mut w = RateWindow::default();
        // 10 per second for two minutes, then nothing for 30 s.
        for s in (0..=120).step_by(5) {
            w.record(at(s), s * 10);
        }
        assert!(w.len() <= MAX_SAMPLES);
        let r = w.per_second(at(120), 1200).unwrap();
        assert!((r - 10.0).abs() < 1e-9, "{r}");
        for s in (125..=150).step_by(5) {
            w.record(at(s), 1200);
        }
        // From the sample of t=90 (value 900) to now: 300 in 60 s.
        let r = w.per_second(at(150), 1200).unwrap();
        assert!((r - 5.0).abs() < 1e-9, "{r}");
        // A minute without growth: 0, not the old average.
        for s in (155..=185).step_by(5) {
            w.record(at(s), 1200);
        }
        assert_eq!(w.per_second(at(185), 1200), Some(0.0));
        assert!(w.len() <= MAX_SAMPLES, "bounded: {}", w.len());
    }

    #[test]
    fn rate_needs_ten_seconds_and_ignores_samples_too_close() {
        let mut w = RateWindow::default();
        assert_eq!(w.per_second(at(0), 0), None, "no sample");
        w.record(at(0), 0);
        w.record(at(1), 100);
        w.record(at(2), 200);
        assert_eq!(w.len(), 1, "samples within SAMPLE_INTERVAL are ignored");
        assert_eq!(w.per_second(at(9), 90), None, "less than MIN_SPAN");
        assert_eq!(w.per_second(at(10), 100), Some(10.0));
        // Uses the current value, not only the samples.
        assert_eq!(w.per_second(at(20), 400), Some(20.0));
        // Sampling stopped for longer than the window: no rate from stale samples.
        assert_eq!(w.per_second(at(200), 400), None);
    }

    #[test]
    fn a_counter_that_went_down_starts_over() {
        let mut w = RateWindow::default();
        w.record(at(0), 500);
        w.record(at(30), 800);
        w.record(at(35), 3);
        assert_eq!(w.len(), 1);
        assert_eq!(w.per_second(at(45), 53), Some(5.0));
    }

    #[test]
    fn tracker_keeps_only_the_relays_of_the_last_sample() {
        let (a, b) = (url("wss://a.example"), url("wss://b.example"));
        let c = |q, e| RelayCounts {
            queries_completed: q,
            events_forwarded: e,
        };
        let mut t = ProgressTracker::default();
        assert!(t.due(at(0)));
        t.sample(at(0), 0, [(&a, c(0, 0)), (&b, c(0, 0))]);
        assert!(!t.due(at(4)));
        assert!(t.due(at(5)));
        t.sample(at(20), 400, [(&a, c(40, 200))]);
        assert_eq!(t.relays(), 1, "b forgotten");
        assert_eq!(
            t.relay_rates(&a, at(20), c(40, 200)),
            (Some(2.0), Some(10.0))
        );
        assert_eq!(t.relay_rates(&b, at(20), c(40, 200)), (None, None));
        assert_eq!(t.forwarded_per_second(at(20), 400), Some(20.0));
    }

    fn relay(pending: usize, rate: Option<f64>) -> RelayInput {
        RelayInput {
            connection: ConnectionStatus::Connected,
            pending_batches: 1,
            target: (10, 100),
            confirmed: (4, 40),
            history_queries_pending: pending,
            queries_per_second: rate,
            retry_in: None,
            short: 0,
        }
    }

    #[test]
    fn a_relay_whose_history_is_short_is_not_settled() {
        // Issue 33: the progress line must not say "settled" while a relay's history is
        // short (ids it listed and did not deliver when asked twice).
        let mut r = relay(0, None);
        r.pending_batches = 0;
        r.confirmed = r.target;
        assert_eq!(r.eta(), Eta::Settled);
        r.short = 3;
        assert_eq!(r.eta(), Eta::Unknown(Unknown::HistoryShort { ids: 3 }));
        assert!(r.eta().to_string().contains("history short: 3 events"));
    }

    #[test]
    fn relay_eta_is_pending_over_the_completion_rate() {
        assert_eq!(relay(30, Some(0.5)).eta(), Eta::Seconds(60));
        assert_eq!(relay(1, Some(3.0)).eta(), Eta::Seconds(1), "rounded up");
        assert_eq!(relay(7, Some(2.0)).eta(), Eta::Seconds(4), "rounded up");
        let settled = RelayInput {
            pending_batches: 0,
            confirmed: (10, 100),
            ..relay(0, None)
        };
        assert_eq!(settled.eta(), Eta::Settled);
        assert_eq!(settled.eta().seconds(), Some(0));
    }

    #[test]
    fn relay_eta_says_why_it_is_unknown() {
        let u = |i: RelayInput| i.eta().unknown().cloned();
        assert_eq!(u(relay(30, Some(0.0))), Some(Unknown::NoQueryCompleted));
        assert_eq!(u(relay(30, None)), Some(Unknown::Measuring));
        assert_eq!(
            u(relay(0, Some(1.0))),
            Some(Unknown::NotYetSized),
            "unconfirmed items, no query yet"
        );
        let held_back = RelayInput {
            retry_in: Some(Duration::from_millis(89_500)),
            ..relay(0, Some(1.0))
        };
        assert_eq!(u(held_back), Some(Unknown::RetryPending { in_secs: 90 }));
        assert_eq!(
            Unknown::RetryPending { in_secs: 90 }.to_string(),
            "failed history queries retried in 1m30s"
        );
        let down = RelayInput {
            connection: ConnectionStatus::Disconnected,
            ..relay(30, Some(1.0))
        };
        assert_eq!(u(down), Some(Unknown::RelayDisconnected));
        let connecting = RelayInput {
            connection: ConnectionStatus::Connecting,
            ..relay(30, Some(1.0))
        };
        assert_eq!(u(connecting), Some(Unknown::RelayConnecting));
        assert_eq!(
            Eta::Unknown(Unknown::NoQueryCompleted).to_string(),
            "unknown (no history query completed in the last minute)"
        );
    }

    fn own(backlog: u64, rate: Option<f64>) -> OwnInput {
        OwnInput {
            connected: true,
            self_sync_pending: false,
            forward_backlog: backlog,
            forwarded_per_second: rate,
        }
    }

    #[test]
    fn total_eta_is_the_slowest_relay_or_the_backlog() {
        let (a, b) = (url("wss://a.example"), url("wss://b.example"));
        let etas = [(a.clone(), Eta::Seconds(120)), (b.clone(), Eta::Settled)];
        let it = || etas.iter().map(|(u, e)| (u, e));
        assert_eq!(total_eta(&own(0, None), it()), Eta::Seconds(120));
        // 10,000 events at 50/s: 200 s, more than the relays.
        assert_eq!(total_eta(&own(10_000, Some(50.0)), it()), Eta::Seconds(200));
        assert_eq!(total_eta(&own(100, Some(50.0)), it()), Eta::Seconds(120));
        assert_eq!(
            total_eta(&own(100, Some(0.0)), it()),
            Eta::Unknown(Unknown::NoEventsForwarded)
        );
        assert_eq!(
            total_eta(&own(0, None), [(&a, &Eta::Settled), (&b, &Eta::Settled)]),
            Eta::Settled
        );
        assert_eq!(total_eta(&own(0, None), []), Eta::Settled);
    }

    #[test]
    fn total_eta_names_the_first_relay_without_one() {
        let (a, b, c) = (
            url("wss://a.example"),
            url("wss://b.example"),
            url("wss://c.example"),
        );
        let etas = [
            (a, Eta::Seconds(5)),
            (b, Eta::Unknown(Unknown::RelayDisconnected)),
            (c, Eta::Unknown(Unknown::Measuring)),
        ];
        let e = total_eta(&own(0, None), etas.iter().map(|(u, e)| (u, e)));
        assert_eq!(
            e.to_string(),
            "unknown (wss://b.example: relay disconnected (and 1 more relays without an estimate))"
        );
        let mut o = own(0, None);
        o.connected = false;
        assert_eq!(
            total_eta(&o, []),
            Eta::Unknown(Unknown::OwnRelayDisconnected)
        );
        o.connected = true;
        o.self_sync_pending = true;
        assert_eq!(total_eta(&o, []), Eta::Unknown(Unknown::OwnHistoryPending));
    }

    #[test]
    fn a_first_sync_counts_down_in_simulated_time() {
        // A relay with 300 history queries answering one every 2 s: the estimate falls as the
        // clock advances and reaches settled when the last one completes.
        let u = url("wss://a.example");
        let mut t = ProgressTracker::default();
        let mut completed = 0u64;
        let mut seen = Vec::new();
        for s in 0..=600u64 {
            let now = at(s);
            if s % 2 == 0 && s > 0 {
                completed += 1;
            }
            let c = RelayCounts {
                queries_completed: completed,
                events_forwarded: completed * 10,
            };
            if t.due(now) {
                t.sample(now, completed * 10, [(&u, c)]);
            }
            let pending = 300 - completed as usize;
            let (q, _) = t.relay_rates(&u, now, c);
            let eta = RelayInput {
                connection: ConnectionStatus::Connected,
                pending_batches: usize::from(pending > 0),
                target: (300, 0),
                confirmed: (completed as usize, 0),
                history_queries_pending: pending,
                queries_per_second: q,
                retry_in: None,
                short: 0,
            }
            .eta();
            if s % 100 == 0 {
                seen.push(eta);
            }
        }
        assert_eq!(
            seen,
            [
                Eta::Unknown(Unknown::Measuring),
                Eta::Seconds(500),
                Eta::Seconds(400),
                Eta::Seconds(300),
                Eta::Seconds(200),
                Eta::Seconds(100),
                Eta::Settled,
            ]
        );
    }
}
