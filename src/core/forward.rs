//! The forward queue into the own relay, sans-IO.
//!
//! Events checked by the relay threads are offered here; the forwarder thread sends what
//! [`ForwardQueue::poll_send`] hands out and reports the own relay's `OK` answers.
//!
//! * `OK true`, or any answer starting with `duplicate:` → stored; the id is remembered in a
//!   bounded set so the same event arriving from other relays is not sent again.
//! * `OK true "purgatory: …"` (GRASP-01; ngit-grasp) → accepted and *held*: the own relay does
//!   not serve it until its git data arrives and drops it after 30 minutes if none does. Never
//!   a loss and never sent again by this process, not even when a reconciliation finds the
//!   own relay without it ([`ForwardQueue::offer_missing`]): the git data is the own relay's
//!   to fetch, and every copy written would keep an empty repository in purgatory longer
//!   (decision 0101).
//! * `OK false` with `rate-limited:` → re-queued at the front; sending is paced: one event
//!   per interval, a quarter longer per round of `rate-limited:` answers (from [`MIN_PACE`]
//!   to [`MAX_PACE`]) and shorter per event stored, until the relay takes what we send again ([`ForwardQueue::throttle`] tells how long it has throttled us).
//! * Events are sent announcements first, then repository state, then root events, then the
//!   rest ([`send_class`]).
//! * `OK false` with `auth-required:` while NIP-42 authentication is under way → re-queued by
//!   [`ForwardQueue::requeue_auth_required`] (the forwarder pauses sending until
//!   authenticated); otherwise an ordinary rejection.
//! * `OK false` with `error:` (a failure of the relay, not a verdict: nostr-rs-relay says so
//!   while its database is locked) → re-queued at the back, and sending pauses, longer after
//!   each `error:` in a row ([`error_pause`]: the rate-limit pause doubled, at most
//!   [`MAX_ERROR_PAUSE`]) until an answer stores something. Never a rejection, however long
//!   the spell: the event stays in the queue, whose bytes the pipeline bounds.
//! * any other `OK false` → counted as rejected with its reason, kept (bounded) and re-offered
//!   only when [`ForwardQueue::retry_rejected`] is called (the repository index changed, so the
//!   own relay may now accept it); never retried blindly, never remembered as done.
//! * no `OK` within the deadline, or the connection drops → re-queued and sent again.
//!
//! The caller reads the answer's prefix once with [`Prefix::parse`] (leading whitespace
//! skipped, ASCII case ignored) and hands [`ForwardQueue::on_ok`] the [`Prefix`].

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use log::{debug, info};
use nostr::event::EventId;

use crate::core::dedup::{IdMap, IdSet, RecentIds, VerifiedSet};
use crate::core::relay_text::Prefix;
use crate::core::time::Time;

/// Limits of the forward queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardLimits {
    /// Events sent and awaiting `OK` at most.
    pub in_flight: usize,
    /// How long to wait for an `OK`.
    pub ok_timeout: Duration,
    /// Queued plus in-flight events above which the forwarder stops taking new ones (the
    /// relay threads then block, which pauses reading from remote relays).
    pub backlog: usize,
    /// Ids of stored events remembered for de-duplication.
    pub remembered: usize,
    /// Rejected events kept for a retry after the index changes.
    pub rejected_kept: usize,
    /// Total JSON bytes of the kept rejected events.
    pub rejected_bytes: usize,
    /// Pause after a `rate-limited:` answer.
    pub rate_limit_pause: Duration,
    /// JSON bytes of checked events on their way into the own relay (channel, queue and in
    /// flight) at most; a relay thread waits before handing over an event that does not fit
    /// (see [`admits`]). Events re-queued from the rejected store come on top (at most
    /// `rejected_bytes`). Zero: no byte bound.
    pub max_bytes: usize,
    /// The share of `max_bytes` one remote relay may hold, so one flooding relay cannot take
    /// the whole pipeline. Zero: no per-relay bound.
    pub relay_bytes: usize,
}

/// Whether an event of `len` bytes from a relay that has `relay_held` bytes in the forward
/// pipeline may enter it while the pipeline holds `total_held` bytes.
///
/// A relay with nothing in the pipeline may always send one event when the pipeline is
/// empty, so an event larger than a share never blocks for ever (the websocket message cap,
/// 1 MiB, bounds it anyway).
pub fn admits(limits: &ForwardLimits, total_held: u64, relay_held: u64, len: u64) -> bool {
    if total_held == 0 {
        return true;
    }
    let max = limits.max_bytes as u64;
    let share = limits.relay_bytes as u64;
    let total_ok = max == 0 || total_held.saturating_add(len) <= max;
    let relay_ok = share == 0 || relay_held == 0 || relay_held.saturating_add(len) <= share;
    total_ok && relay_ok
}

impl Default for ForwardLimits {
    fn default() -> Self {
        ForwardLimits {
            in_flight: 64,
            ok_timeout: Duration::from_secs(30),
            backlog: 4096,
            remembered: 200_000,
            rejected_kept: 10_000,
            rejected_bytes: 16 << 20,
            rate_limit_pause: Duration::from_secs(2),
            max_bytes: 64 << 20,
            relay_bytes: 16 << 20,
        }
    }
}

/// The longest pause after `error:` answers in a row ([`error_pause`]).
pub const MAX_ERROR_PAUSE: Duration = Duration::from_secs(60);

/// The pause after the `errors`-th round of `error:` answers in a row (1 for the first):
/// `base` (the rate-limit pause), doubled for each further one, at most [`MAX_ERROR_PAUSE`].
pub fn error_pause(base: Duration, errors: u32) -> Duration {
    let doublings = errors.saturating_sub(1).min(16);
    base.saturating_mul(1 << doublings)
        .min(MAX_ERROR_PAUSE.max(base))
}

/// What happened to an offered event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// Queued for sending.
    Queued,
    /// Already stored on the own relay (by an earlier copy), or held in its purgatory
    /// ([`OkOutcome::Purgatory`]).
    AlreadyStored,
    /// Already queued or in flight.
    AlreadyQueued,
    /// Rejected by the own relay before; kept for a retry when the index changes.
    PreviouslyRejected,
}

impl Offer {
    /// What this answer to an offer means for the event's claim in `verified` (the relay
    /// threads' record of what was handed to the forwarder, [`VerifiedSet::claim_forward`]):
    /// an offer that queued nothing gets no `OK` of its own, so an event already stored is
    /// marked stored ([`VerifiedSet::mark_stored`]) and one rejected before is released
    /// ([`VerifiedSet::release_forward`]); left claimed and unconfirmed, a reconciliation's
    /// fetch would leave it out for good (decision 0088). A queued offer, or one whose copy
    /// is queued or in flight, waits for its `OK`.
    pub fn settle_claim(&self, id: &EventId, verified: &VerifiedSet) {
        match self {
            Offer::AlreadyStored => verified.mark_stored(id),
            Offer::PreviouslyRejected => verified.release_forward(id),
            Offer::Queued | Offer::AlreadyQueued => {}
        }
    }
}

/// What an `OK` meant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OkOutcome {
    /// Stored now.
    Stored,
    /// The own relay already had it.
    Duplicate,
    /// `OK true "purgatory: …"`: accepted, not served until its git data arrives (GRASP-01,
    /// ngit-grasp); remembered so that it is never sent again (decision 0101).
    Purgatory,
    /// Rate-limited: re-queued.
    RateLimited,
    /// `auth-required:` while authentication is under way: re-queued.
    AuthRequired,
    /// `error:` (a failure on the relay's side, not a verdict): re-queued; sending pauses
    /// for [`error_pause`] of the `error:` answers in a row.
    RelayError,
    /// `error:` for the [`MAX_ERROR_ROUNDS`]th time for this event while the own relay stores
    /// others: set aside (not queued, not unresolved), sent again every [`ASIDE_RETRY`]
    /// (issue 36).
    SetAside,
    /// Rejected; the prefix of the relay's reason (the caller has the whole text).
    Rejected(Prefix),
    /// An `OK` for an event we did not send (or answered twice): ignored.
    Unexpected,
}

/// Counters of the forward queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForwardCounters {
    /// Events the own relay stored.
    pub stored: u64,
    /// Events the own relay already had.
    pub duplicates: u64,
    /// Events the own relay accepted into purgatory (`OK true "purgatory: …"`): not served
    /// until their git data arrives.
    pub purgatory: u64,
    /// Rejections: `OK false` other than `duplicate:`, `rate-limited:`, `error:`, and
    /// `auth-required:` while authenticating.
    pub rejected: u64,
    /// Re-sends after a timeout, a disconnect, a rate limit or an `error:`.
    pub resent: u64,
    /// `error:` answers (each re-queued the event).
    pub relay_errors: u64,
    /// `rate-limited:` answers (each re-queued the event).
    pub rate_limited: u64,
    /// Copies of an event that was stored or queued already.
    pub deduplicated: u64,
    /// Events set aside after [`MAX_ERROR_ROUNDS`] `error:` answers (each time).
    pub set_aside: u64,
    /// Events set aside that moved to the rejected store because the aside set was full.
    pub aside_overflow: u64,
}

/// `error:` answers to one event after which it is set aside ([`OkOutcome::SetAside`]): one
/// event the own relay always fails to store must not hold the queue, state saves, `--once`
/// or a stop back for ever.
pub const MAX_ERROR_ROUNDS: u32 = 8;

/// How often an event set aside is sent again.
pub const ASIDE_RETRY: Duration = Duration::from_secs(600);

#[derive(Debug)]
struct InFlight {
    raw: Arc<str>,
    deadline: Time,
}

/// The pure forward queue.
#[derive(Debug)]
pub struct ForwardQueue {
    limits: ForwardLimits,
    queue: ClassQueue,
    queued: IdSet,
    in_flight: IdMap<InFlight>,
    stored: RecentIds,
    /// Events the own relay answered `purgatory:`: never sent again, not even when a
    /// reconciliation finds the own relay without them (bounded like `stored`).
    held: RecentIds,
    rejected: IdMap<Rejected>,
    rejected_order: VecDeque<EventId>,
    /// Rejected events chosen for a retry, moved into the queue as the backlog has room.
    retrying: VecDeque<(EventId, Arc<str>)>,
    rejected_bytes: usize,
    /// Rounds of `error:` answers in a row (reset by an answer that stored something).
    errors_in_a_row: u32,
    /// Events that left the pipeline without an `OK` of their own since the last
    /// [`ForwardQueue::take_settled`]: a retry of a rejected event dropped because the event
    /// was stored or queued meanwhile.
    settled: u64,
    paused_until: Option<Time>,
    /// While the own relay rate-limits us: the interval between two sends.
    pace: Option<Duration>,
    /// When the pace last doubled: a `rate-limited:` answer to an event sent before it
    /// belongs to that round.
    last_slow_down: Option<Time>,
    /// Events stored in a row since the last `rate-limited:` answer.
    successes: u32,
    /// When the last round of `error:` answers began (the same rule).
    last_error_round: Option<Time>,
    /// `error:` answers per event, and the own relay's stored and duplicate answers when the
    /// first came (removed when it is stored or rejected).
    error_rounds: IdMap<(u32, u64)>,
    /// Events set aside after [`MAX_ERROR_ROUNDS`] `error:` answers, with when each is sent
    /// again; at most `rejected_kept` events and `rejected_bytes` bytes (the oldest beyond
    /// move to the rejected store).
    aside: VecDeque<(EventId, Arc<str>, Time)>,
    /// The ids in `aside`: a copy offered meanwhile is not queued a second time.
    aside_ids: IdSet,
    /// JSON bytes of the events in `aside`.
    aside_bytes: usize,
    /// Events set aside that went back into the queue since the last
    /// [`ForwardQueue::take_reopened`]: unresolved again until the own relay answers.
    reopened: u64,
    /// Since when the own relay rate-limits us, and what it stored since.
    throttle: Option<Throttle>,
    /// How long the own relay took to answer recently (a moving average over the `OK`s of
    /// stored and duplicate events; [`ForwardQueue::recent_ok_latency`]).
    ok_latency: Option<Duration>,
    counters: ForwardCounters,
}

/// The own relay rate-limits our writes ([`ForwardQueue::throttle`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throttle {
    /// The first `rate-limited:` answer of this spell.
    pub since: Time,
    /// Events stored since.
    pub stored: u64,
    /// The interval between two sends now.
    pub pace: Duration,
}

impl Throttle {
    /// Events the own relay stored per minute since the spell began (at `now`).
    pub fn per_minute(&self, now: Time) -> f64 {
        let secs = now.since(self.since).as_secs_f64().max(1.0);
        self.stored as f64 * 60.0 / secs
    }
}

/// The shortest interval between sends once the own relay rate-limits us; each further
/// round of `rate-limited:` answers lengthens it by a quarter.
pub const MIN_PACE: Duration = Duration::from_millis(100);

/// The longest interval between sends (ngit-relay lets one event a minute through).
pub const MAX_PACE: Duration = Duration::from_secs(60);

/// Events stored in a row at [`MIN_PACE`] after which pacing ends.
pub const FAST_RUN: u32 = 100;

/// The order in which queued events are sent: repository announcements (30617) first, then
/// repository state (30618), then root events (patches, PRs, issues: 1617, 1618, 1621), then
/// the rest. A relay that stores an event only when what it relates to is stored (ngit-relay)
/// or held (ngit-grasp takes a state event only once it has an announcement of its
/// repository) then takes more of a sync at the first try. Read from the JSON without
/// parsing it: a wrong answer only changes the order.
pub fn send_class(raw: &str) -> usize {
    match json_kind(raw) {
        Some(30617) => 0,
        Some(30618) => 1,
        Some(1617 | 1618 | 1621) => 2,
        _ => 3,
    }
}

/// The `kind` of an event's JSON: the number after the `"kind"` key (a `"kind"` inside a
/// string has its quotes escaped; a tag value `"kind"` is not followed by a colon).
fn json_kind(raw: &str) -> Option<u64> {
    let bytes = raw.as_bytes();
    let mut from = 0;
    while let Some(i) = raw[from..].find("\"kind\"").map(|i| i + from) {
        let backslashes = bytes[..i].iter().rev().take_while(|&&b| b == b'\\').count();
        from = i + 6;
        if backslashes % 2 == 1 {
            continue;
        }
        // A tag value "kind" is followed by `,` or `]`; only the key by `:`.
        let Some(rest) = raw[from..].trim_start().strip_prefix(':') else {
            continue;
        };
        let rest = rest.trim_start();
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        return rest[..digits].parse().ok();
    }
    None
}

/// Queued events by [`send_class`], each class in order.
#[derive(Debug, Default)]
struct ClassQueue {
    classes: [VecDeque<(EventId, Arc<str>)>; 4],
}

impl ClassQueue {
    fn push_back(&mut self, item: (EventId, Arc<str>)) {
        self.classes[send_class(&item.1)].push_back(item);
    }

    fn push_front(&mut self, item: (EventId, Arc<str>)) {
        self.classes[send_class(&item.1)].push_front(item);
    }

    fn pop_front(&mut self) -> Option<(EventId, Arc<str>)> {
        self.classes.iter_mut().find_map(VecDeque::pop_front)
    }

    fn len(&self) -> usize {
        self.classes.iter().map(VecDeque::len).sum()
    }

    fn is_empty(&self) -> bool {
        self.classes.iter().all(VecDeque::is_empty)
    }
}

impl ForwardQueue {
    /// An empty queue.
    #[must_use]
    pub fn new(limits: ForwardLimits) -> ForwardQueue {
        ForwardQueue {
            limits,
            queue: ClassQueue::default(),
            queued: IdSet::default(),
            in_flight: IdMap::default(),
            stored: RecentIds::new(limits.remembered),
            held: RecentIds::new(limits.remembered),
            rejected: IdMap::default(),
            rejected_order: VecDeque::new(),
            retrying: VecDeque::new(),
            rejected_bytes: 0,
            errors_in_a_row: 0,
            settled: 0,
            paused_until: None,
            pace: None,
            last_slow_down: None,
            successes: 0,
            last_error_round: None,
            error_rounds: IdMap::default(),
            aside: VecDeque::new(),
            aside_ids: IdSet::default(),
            aside_bytes: 0,
            reopened: 0,
            throttle: None,
            ok_latency: None,
            counters: ForwardCounters::default(),
        }
    }

    /// Offers a checked event (its original JSON).
    pub fn offer(&mut self, id: EventId, raw: Arc<str>) -> Offer {
        if self.stored.contains(&id) {
            self.counters.deduplicated += 1;
            return Offer::AlreadyStored;
        }
        self.offer_missing(id, raw)
    }

    /// Offers a checked event that the own relay is known to lack: a NIP-77 reconciliation
    /// compared the own relay's set and fetched it. The memory of an earlier `OK` does not
    /// hold it back (the own relay may have lost the event since: a restored database, a
    /// wipe); a copy queued or in flight, or a kept rejection, still does. So does an earlier
    /// `purgatory:` answer: the own relay holds the event without serving it (every
    /// reconciliation finds it missing until its git data arrives), or dropped it for want of
    /// git data; sending it again would only keep it there longer (decision 0101).
    pub fn offer_missing(&mut self, id: EventId, raw: Arc<str>) -> Offer {
        if self.held.contains(&id) {
            self.counters.deduplicated += 1;
            return Offer::AlreadyStored;
        }
        // An event set aside is sent again at its time; a copy of it waits for that `OK`.
        if self.queued.contains(&id)
            || self.in_flight.contains_key(&id)
            || self.aside_ids.contains(&id)
        {
            self.counters.deduplicated += 1;
            return Offer::AlreadyQueued;
        }
        if self.rejected.contains_key(&id) {
            return Offer::PreviouslyRejected;
        }
        self.queued.insert(id);
        self.queue.push_back((id, raw));
        Offer::Queued
    }

    /// True while the backlog is full: stop taking offers.
    pub fn is_full(&self) -> bool {
        self.backlog() >= self.limits.backlog
    }

    /// When `id` was sent, while it is in flight.
    pub fn sent_at(&self, id: &EventId) -> Option<Time> {
        self.in_flight.get(id).map(|f| self.sent_time(f))
    }

    /// When an event in flight was sent: its `OK` deadline less the timeout.
    fn sent_time(&self, flight: &InFlight) -> Time {
        flight.deadline.minus(self.limits.ok_timeout)
    }

    /// How long the own relay has recently taken from a write to its `OK` (a moving average
    /// over stored and duplicate events; `None` before the first). With the window full it
    /// is about the time the relay takes for a window of events.
    pub fn recent_ok_latency(&self) -> Option<Duration> {
        self.ok_latency
    }

    /// Events sent whose `OK` has not arrived yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// True when an event offered now could be sent at once: the in-flight window has room
    /// and no rate-limit pause is running.
    pub fn window_open(&self, now: Time) -> bool {
        self.in_flight.len() < self.limits.in_flight && self.paused_until.is_none_or(|t| now >= t)
    }

    /// True when the in-flight window is full: nothing more is sent before an `OK`.
    pub fn window_full(&self) -> bool {
        self.in_flight.len() >= self.limits.in_flight
    }

    /// Events the backlog can still take before it is full.
    pub fn room(&self) -> usize {
        self.limits.backlog.saturating_sub(self.backlog())
    }

    /// The room a full backlog must regain before offers are taken again: a quarter of the
    /// backlog (at least one event), so that the senders waiting on a full backlog are resumed
    /// once per batch rather than once per `OK`.
    pub fn resume_room(&self) -> usize {
        (self.limits.backlog / 4).max(1)
    }

    /// Queued plus in-flight events.
    pub fn backlog(&self) -> usize {
        self.queue.len() + self.in_flight.len()
    }

    /// True when [`ForwardQueue::poll_send`] would hand out an event at `now`.
    pub fn can_send(&self, now: Time) -> bool {
        !self.queue.is_empty()
            && self.in_flight.len() < self.limits.in_flight
            && self.paused_until.is_none_or(|t| now >= t)
    }

    /// The next event to send now, if the in-flight window and any rate-limit pause allow.
    #[must_use]
    pub fn poll_send(&mut self, now: Time) -> Option<(EventId, Arc<str>)> {
        self.refill();
        if let Some(until) = self.paused_until {
            if now < until {
                return None;
            }
            self.paused_until = None;
        }
        if self.in_flight.len() >= self.limits.in_flight {
            return None;
        }
        let (id, raw) = self.queue.pop_front()?;
        self.queued.remove(&id);
        if let Some(pace) = self.pace {
            // Paced while the own relay rate-limits us: one event per interval.
            self.paused_until = Some(now.plus(pace));
        }
        self.in_flight.insert(
            id,
            InFlight {
                raw: raw.clone(),
                deadline: now.plus(self.limits.ok_timeout),
            },
        );
        Some((id, raw))
    }

    /// Handles the own relay's `OK`: `prefix` is its message's ([`Prefix::parse`]).
    pub fn on_ok(&mut self, id: EventId, accepted: bool, prefix: Prefix, now: Time) -> OkOutcome {
        let Some(flight) = self.in_flight.remove(&id) else {
            return OkOutcome::Unexpected;
        };
        if prefix != Prefix::Error {
            self.error_rounds.remove(&id);
        }
        if accepted || prefix == Prefix::Duplicate {
            self.errors_in_a_row = 0;
            let took = now.since(self.sent_time(&flight));
            // A moving average weighing the latest answer by an eighth.
            self.ok_latency = Some(self.ok_latency.map_or(took, |l| (l * 7 + took) / 8));
        }
        if accepted && prefix == Prefix::Purgatory {
            // Taken, not served: no copy of it is sent again, however often it is offered
            // (decision 0101). The relay took the write, so a pace shrinks on it.
            self.stored.insert(id);
            self.held.insert(id);
            self.counters.purgatory += 1;
            self.speed_up();
            return OkOutcome::Purgatory;
        }
        if prefix == Prefix::Duplicate {
            self.stored.insert(id);
            self.counters.duplicates += 1;
            // The relay took the write: a pace must shrink on it as on a stored event
            // (ngit-grasp answers every stored write `OK true "duplicate: event stored"`).
            self.speed_up();
            return OkOutcome::Duplicate;
        }
        if accepted {
            self.stored.insert(id);
            self.counters.stored += 1;
            self.speed_up();
            return OkOutcome::Stored;
        }
        if prefix == Prefix::RateLimited {
            self.counters.resent += 1;
            self.counters.rate_limited += 1;
            let sent = self.sent_time(&flight);
            self.slow_down(sent, now);
            self.queued.insert(id);
            self.queue.push_front((id, flight.raw));
            return OkOutcome::RateLimited;
        }
        if prefix == Prefix::Error {
            // A failure of the relay, not a verdict on the event: sent again after a pause
            // that grows while the failures go on, for as long as they last. The answers to
            // one window of events sent together are one round: only an `error:` after the
            // pause lengthens the next one.
            self.counters.relay_errors += 1;
            let answered = self.counters.stored + self.counters.duplicates;
            let (rounds, since) = self.error_rounds.entry(id).or_insert((0, answered));
            *rounds = rounds.saturating_add(1);
            // Only while the relay stores other events: a relay failing for all (a locked
            // database) is waited for however long it lasts (decision 0070).
            if *rounds >= MAX_ERROR_ROUNDS && answered > *since {
                // This one fails again and again: aside, so the rest goes on.
                self.counters.set_aside += 1;
                self.set_aside(id, flight.raw, now.plus(ASIDE_RETRY));
                return OkOutcome::SetAside;
            }
            self.counters.resent += 1;
            let sent = self.sent_time(&flight);
            if self.last_error_round.is_none_or(|r| sent > r) {
                self.last_error_round = Some(now);
                self.errors_in_a_row = self.errors_in_a_row.saturating_add(1);
                let pause = error_pause(self.limits.rate_limit_pause, self.errors_in_a_row);
                self.paused_until = Some(now.plus(pause));
            }
            self.queued.insert(id);
            self.queue.push_back((id, flight.raw));
            return OkOutcome::RelayError;
        }
        self.counters.rejected += 1;
        self.keep_rejected(id, flight.raw);
        OkOutcome::Rejected(prefix)
    }

    /// Puts `id` aside until `retry`, once; beyond the rejected store's bounds the oldest
    /// events set aside move to that store (retried when what they relate to changes).
    fn set_aside(&mut self, id: EventId, raw: Arc<str>, retry: Time) {
        if !self.aside_ids.insert(id) {
            return;
        }
        self.aside_bytes += raw.len();
        self.aside.push_back((id, raw, retry));
        while self.aside.len() > self.limits.rejected_kept.max(1)
            || (self.aside_bytes > self.limits.rejected_bytes && self.aside.len() > 1)
        {
            let Some((old, raw, _)) = self.aside.pop_front() else {
                break;
            };
            self.aside_ids.remove(&old);
            self.aside_bytes = self.aside_bytes.saturating_sub(raw.len());
            self.error_rounds.remove(&old);
            self.counters.aside_overflow += 1;
            self.keep_rejected(old, raw);
        }
    }

    /// A `rate-limited:` answer to an event sent at `sent`: the first of a round (answers to
    /// events sent before the last slow-down belong to its round) lengthens the interval
    /// between sends by a quarter (from [`MIN_PACE`], at most [`MAX_PACE`]) and pauses for a
    /// quarter of it (the first of a spell for the rate-limit pause). Sending a little too fast costs a
    /// refused send now and then; too slowly, the relay's rate: the pace errs on the fast side.
    fn slow_down(&mut self, sent: Time, now: Time) {
        self.successes = 0;
        if self.last_slow_down.is_some_and(|s| sent <= s) {
            return;
        }
        self.last_slow_down = Some(now);
        let (pace, pause) = match self.pace {
            None => (MIN_PACE, self.limits.rate_limit_pause.max(MIN_PACE)),
            Some(p) => {
                let p = p.mul_f64(1.25).clamp(MIN_PACE, MAX_PACE);
                // Refused just before the relay's next slot: ask again soon, not a whole
                // interval later.
                (p, (p / 4).max(MIN_PACE))
            }
        };
        self.pace = Some(pace);
        self.throttle
            .get_or_insert(Throttle {
                since: now,
                stored: 0,
                pace,
            })
            .pace = pace;
        self.paused_until = Some(now.plus(pause));
    }

    /// An event stored: while paced, the interval shrinks, the faster the more events in a
    /// row were stored (by 5 %, then 10 %, …), down to [`MIN_PACE`]. Pacing ends (the relay
    /// takes what we send again, and the throttle spell is over) only after [`FAST_RUN`]
    /// events in a row were stored at that pace: a relay's burst allowance (15 events for
    /// ngit-relay, 60 for rust-nostr's builder) is not taken for the end of its limit.
    fn speed_up(&mut self) {
        let Some(pace) = self.pace else {
            return;
        };
        self.successes = self.successes.saturating_add(1);
        if let Some(t) = self.throttle.as_mut() {
            t.stored += 1;
        }
        let factor = 0.95f64.powi(self.successes.min(20) as i32);
        let next = pace.mul_f64(factor).max(MIN_PACE);
        if next == MIN_PACE && self.successes >= FAST_RUN {
            self.pace = None;
            self.throttle = None;
            self.last_slow_down = None;
        } else {
            self.pace = Some(next);
            if let Some(t) = self.throttle.as_mut() {
                t.pace = next;
            }
        }
    }

    /// The own relay's throttling of our writes, while it lasts: since when, what it stored
    /// since, the interval between sends now. `None` when it takes what we send.
    pub fn throttle(&self) -> Option<Throttle> {
        self.throttle
    }

    /// Handles an `OK false "auth-required: …"` for `id` when NIP-42 authentication is under
    /// way: the event is re-queued at the front (the caller pauses sending until
    /// authenticated). Returns [`OkOutcome::Unexpected`] if `id` is not in flight.
    pub fn requeue_auth_required(&mut self, id: EventId) -> OkOutcome {
        let Some(flight) = self.in_flight.remove(&id) else {
            return OkOutcome::Unexpected;
        };
        self.counters.resent += 1;
        self.queued.insert(id);
        self.queue.push_front((id, flight.raw));
        OkOutcome::AuthRequired
    }

    fn keep_rejected(&mut self, id: EventId, raw: Arc<str>) {
        let len = raw.len();
        let refs = event_refs(&raw);
        if self.rejected.insert(id, Rejected { raw, refs }).is_none() {
            self.rejected_order.push_back(id);
            self.rejected_bytes += len;
        }
        while self.rejected_order.len() > self.limits.rejected_kept
            || self.rejected_bytes > self.limits.rejected_bytes
        {
            let Some(old) = self.rejected_order.pop_front() else {
                break;
            };
            if let Some(r) = self.rejected.remove(&old) {
                self.rejected_bytes = self.rejected_bytes.saturating_sub(r.raw.len());
            }
        }
    }

    /// Chooses for a retry the kept rejected events that the change can affect: those that
    /// name one of `changed` (repository coordinates `30617:<pubkey>:<d>` whose announcement
    /// was applied, root event ids in hex that were linked to a repository) in an `a`, `A`,
    /// `q`, `e` or `E` tag, state events (30618) of such a repository, and announcements and
    /// state events of any author with the `d` of such a repository: a maintainer's, which a
    /// GRASP relay takes once a repository of that `d` listing its author is served
    /// (ngit-grasp refuses them before: `invalid: Announcement must list service …`, `invalid:
    /// no announcement exists for this repository`, `restricted: author not authorized …`;
    /// decision 0101). They enter the queue as the backlog has room (see
    /// [`ForwardQueue::refill`]), never all at once. Returns how many were chosen.
    pub fn retry_rejected(&mut self, changed: &HashSet<String>) -> usize {
        if changed.is_empty() || self.rejected.is_empty() {
            return 0;
        }
        let identifiers: HashSet<String> = changed
            .iter()
            .filter_map(|k| k.strip_prefix("30617:")?.split_once(':'))
            .map(|(_, d)| identifier_key(d))
            .collect();
        let mut chosen = Vec::new();
        self.rejected_order.retain(|id| {
            let hit = self.rejected.get(id).is_some_and(|r| {
                r.refs
                    .iter()
                    .any(|k| changed.contains(k) || identifiers.contains(k))
            });
            if hit {
                chosen.push(*id);
            }
            !hit
        });
        let n = chosen.len();
        for id in chosen {
            if let Some(r) = self.rejected.remove(&id) {
                self.rejected_bytes = self.rejected_bytes.saturating_sub(r.raw.len());
                self.retrying.push_back((id, r.raw));
            }
        }
        if n > 0 {
            debug!("re-offering {n} events the own relay rejected earlier");
        }
        self.refill();
        n
    }

    /// Moves events chosen for a retry into the queue while the backlog has room.
    pub fn refill(&mut self) {
        while self.backlog() < self.limits.backlog {
            let Some((id, raw)) = self.retrying.pop_front() else {
                return;
            };
            if !self.stored.contains(&id)
                && !self.in_flight.contains_key(&id)
                && self.queued.insert(id)
            {
                self.queue.push_back((id, raw));
            } else {
                // Stored, queued or in flight meanwhile: that copy carries the outcome.
                self.settled += 1;
            }
        }
    }

    /// How many events left the pipeline without an `OK` of their own since the last call
    /// (a retry of a rejected event that was stored, queued or in flight meanwhile). The
    /// forwarder counts them as resolved, as it does an `OK`.
    pub fn take_settled(&mut self) -> u64 {
        std::mem::take(&mut self.settled)
    }

    /// How many events set aside went back into the queue since the last call: the
    /// forwarder counts them as unresolved again (it counted them resolved when they were set
    /// aside), so their next answer resolves each once.
    pub fn take_reopened(&mut self) -> u64 {
        std::mem::take(&mut self.reopened)
    }

    /// Rounds of `error:` answers in a row, each after the pause of the one before (0 once an
    /// answer stored something; 1 during the first pause of a spell).
    pub fn errors_in_a_row(&self) -> u32 {
        self.errors_in_a_row
    }

    /// Rejected events chosen for a retry that still wait for room in the backlog.
    pub fn retrying(&self) -> usize {
        self.retrying.len()
    }

    /// Re-queues in-flight events whose `OK` is overdue, and ends a pause that is over (so
    /// [`ForwardQueue::poll_timeout`] never returns a deadline already past while nothing is
    /// sent, e.g. during a NIP-42 write pause: the forwarder then spun; issue 36).
    pub fn handle_timeout(&mut self, now: Time) {
        if self.paused_until.is_some_and(|t| now >= t) {
            self.paused_until = None;
        }
        // Events set aside are sent again, each once per `ASIDE_RETRY`: one more `error:`
        // puts it aside again.
        while self.aside.front().is_some_and(|a| a.2 <= now) {
            let Some((id, raw, _)) = self.aside.pop_front() else {
                break;
            };
            self.aside_ids.remove(&id);
            self.aside_bytes = self.aside_bytes.saturating_sub(raw.len());
            if self.stored.contains(&id)
                || self.in_flight.contains_key(&id)
                || self.queued.contains(&id)
            {
                // Stored or on its way meanwhile (a copy offered as missing): that answer
                // resolves it.
                self.error_rounds.remove(&id);
                continue;
            }
            let answered = self.counters.stored + self.counters.duplicates;
            self.error_rounds
                .insert(id, (MAX_ERROR_ROUNDS - 1, answered.saturating_sub(1)));
            self.queued.insert(id);
            self.counters.resent += 1;
            self.reopened += 1;
            self.queue.push_back((id, raw));
        }
        let overdue: Vec<EventId> = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in overdue {
            if let Some(f) = self.in_flight.remove(&id) {
                info!("no OK from the own relay for {id} in time; sending it again");
                self.counters.resent += 1;
                self.queued.insert(id);
                self.queue.push_front((id, f.raw));
            }
        }
    }

    /// The own relay connection dropped: everything in flight is sent again later.
    pub fn on_disconnect(&mut self) {
        let ids: Vec<EventId> = self.in_flight.keys().copied().collect();
        for id in ids {
            if let Some(f) = self.in_flight.remove(&id) {
                self.counters.resent += 1;
                self.queued.insert(id);
                self.queue.push_front((id, f.raw));
            }
        }
    }

    /// The earliest deadline (OK timeout or end of a pause).
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        let ok = self.in_flight.values().map(|f| f.deadline).min();
        let aside = self.aside.front().map(|a| a.2);
        [ok, self.paused_until, aside].into_iter().flatten().min()
    }

    /// The counters.
    pub fn counters(&self) -> ForwardCounters {
        self.counters
    }

    /// Events set aside after [`MAX_ERROR_ROUNDS`] `error:` answers, waiting for their next
    /// try (not counted as unresolved: they hold nothing back).
    pub fn aside(&self) -> usize {
        self.aside.len()
    }

    /// Whether the own relay answered `purgatory:` to `id` (and so it is never sent again).
    pub fn is_held(&self, id: &EventId) -> bool {
        self.held.contains(id)
    }

    /// Events kept after a rejection.
    pub fn rejected_kept(&self) -> usize {
        self.rejected.len()
    }

    /// True when nothing is queued, in flight or waiting to be retried.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.in_flight.is_empty() && self.retrying.is_empty()
    }
}

/// A rejected event kept for a retry, with what it refers to.
#[derive(Debug)]
struct Rejected {
    raw: Arc<str>,
    /// Values of its `a`/`A`/`q`/`e`/`E` tags, for a state event (30618) its repository's
    /// coordinate, and for an announcement or a state event its [`identifier_key`]: what must
    /// change before the own relay may accept it.
    refs: Vec<String>,
}

/// The key under which a rejected announcement or state event (30617, 30618) waits for any
/// repository with the identifier `d` ([`ForwardQueue::retry_rejected`]). Never a tag value
/// that means anything: coordinates begin with their kind, ids are hex.
fn identifier_key(d: &str) -> String {
    format!("d:{d}")
}

/// What a rejected event refers to (see [`Rejected::refs`]); empty when its JSON does not
/// parse (it then waits for no change and ages out of the bounded store).
fn event_refs(raw: &str) -> Vec<String> {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(raw) else {
        return Vec::new();
    };
    let mut refs = Vec::new();
    let tags = v["tags"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    for t in tags {
        let (Some(name), Some(value)) = (t[0].as_str(), t[1].as_str()) else {
            continue;
        };
        match (name, v["kind"].as_u64()) {
            ("a" | "A" | "q" | "e" | "E", _) => refs.push(ref_key(value)),
            ("d", Some(30618)) => {
                if let Some(pk) = v["pubkey"].as_str() {
                    refs.push(format!("30617:{pk}:{value}"));
                }
                refs.push(identifier_key(value));
            }
            ("d", Some(30617)) => refs.push(identifier_key(value)),
            _ => {}
        }
        if refs.len() >= 256 {
            break;
        }
    }
    refs
}

/// Event ids compare in lower-case hex; coordinates stay as they are.
fn ref_key(value: &str) -> String {
    if value.len() == 64 && value.bytes().all(|b| b.is_ascii_hexdigit()) {
        value.to_ascii_lowercase()
    } else {
        value.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(b: u8) -> EventId {
        EventId::from_byte_array([b; 32])
    }
    fn raw(b: u8) -> Arc<str> {
        Arc::from(format!("{{\"n\":{b}}}"))
    }
    /// An event of `kind` by `pk` with `tags`, as JSON.
    fn tagged(b: u8, kind: u16, tags: &[[&str; 2]]) -> Arc<str> {
        let tags: Vec<serde_json::Value> = tags.iter().map(|t| serde_json::json!(t)).collect();
        Arc::from(
            serde_json::json!({"n": b, "kind": kind, "pubkey": "pk", "tags": tags}).to_string(),
        )
    }
    fn everything() -> HashSet<String> {
        HashSet::from(["30617:pk:r".to_string()])
    }
    fn limits() -> ForwardLimits {
        ForwardLimits {
            in_flight: 2,
            ok_timeout: Duration::from_secs(10),
            backlog: 3,
            remembered: 100,
            rejected_kept: 2,
            rejected_bytes: 1 << 20,
            rate_limit_pause: Duration::from_secs(2),
            max_bytes: 0,
            relay_bytes: 0,
        }
    }

    #[test]
    fn duplicate_however_spelled() {
        // The prefix as any relay spells it: leading whitespace and case do not matter
        // (before the one parser, " duplicate:" and "Duplicate:" were rejections here).
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        for (n, m) in [" duplicate: have it", "Duplicate: have it"]
            .into_iter()
            .enumerate()
        {
            let e = id(10 + n as u8);
            q.offer(e, raw(10 + n as u8));
            assert_eq!(q.poll_send(t).unwrap().0, e);
            assert_eq!(
                q.on_ok(e, false, Prefix::of(m), t),
                OkOutcome::Duplicate,
                "{m:?}"
            );
        }
        assert_eq!(q.counters().duplicates, 2);
    }

    #[test]
    fn dedups_and_respects_window() {
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        assert_eq!(q.offer(id(1), raw(1)), Offer::Queued);
        assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyQueued);
        q.offer(id(2), raw(2));
        q.offer(id(3), raw(3));
        assert!(q.is_full());
        assert!(q.can_send(t));
        assert_eq!(q.poll_send(t).unwrap().0, id(1));
        assert_eq!(q.poll_send(t).unwrap().0, id(2));
        assert!(!q.can_send(t));
        assert!(q.poll_send(t).is_none(), "window of 2");
        assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
        assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyStored);
        assert_eq!(
            q.on_ok(id(2), false, Prefix::of("duplicate: have it"), t),
            OkOutcome::Duplicate
        );
        assert_eq!(
            q.on_ok(id(2), true, Prefix::Other, t),
            OkOutcome::Unexpected
        );
        assert_eq!(q.poll_send(t).unwrap().0, id(3));
        let c = q.counters();
        assert_eq!((c.stored, c.duplicates, c.deduplicated), (1, 1, 2));
    }

    #[test]
    fn an_event_the_own_relay_lacks_is_sent_again_despite_an_old_ok() {
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        q.offer(id(1), raw(1));
        let _ = q.poll_send(t);
        assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
        assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyStored);
        // A reconciliation found the own relay without it: queued and sent again.
        assert_eq!(q.offer_missing(id(1), raw(1)), Offer::Queued);
        assert_eq!(q.offer_missing(id(1), raw(1)), Offer::AlreadyQueued);
        assert_eq!(q.poll_send(t).unwrap().0, id(1));
        assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
        assert_eq!(q.counters().stored, 2);
    }

    #[test]
    fn an_event_the_own_relay_always_fails_to_store_is_set_aside_and_tried_again_later() {
        // Issue 36, item 2: one event answered `error:` every time was re-queued for ever:
        // the queue never idle (no state save, `--once` to its deadline, every stop waits
        // out the drain) and each answer paused the whole queue.
        let mut t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        q.offer(id(1), raw(1));
        q.offer(id(2), raw(2));
        let err = Prefix::of("error: database is locked");
        let mut outcomes = Vec::new();
        for _ in 0..MAX_ERROR_ROUNDS {
            // Past any pause, as the loop's timers would.
            t = t.plus(MAX_ERROR_PAUSE).plus(Duration::from_secs(1));
            q.handle_timeout(t);
            while let Some((sent, _)) = q.poll_send(t) {
                let ok = if sent == id(1) {
                    q.on_ok(sent, false, err, t)
                } else {
                    q.on_ok(sent, true, Prefix::Other, t)
                };
                outcomes.push((sent, ok));
            }
        }
        assert!(outcomes.contains(&(id(2), OkOutcome::Stored)));
        assert_eq!(outcomes.last(), Some(&(id(1), OkOutcome::SetAside)));
        assert_eq!(
            outcomes.iter().filter(|o| o.0 == id(1)).count() as u32,
            MAX_ERROR_ROUNDS
        );
        assert!(q.is_idle(), "nothing left holds the queue");
        assert_eq!((q.aside(), q.counters().set_aside), (1, 1));
        // It is sent again after ASIDE_RETRY, once; stored then, it leaves the aside set.
        assert_eq!(q.poll_timeout(), Some(t.plus(ASIDE_RETRY)));
        let later = t.plus(ASIDE_RETRY);
        q.handle_timeout(later);
        assert_eq!(q.aside(), 0);
        assert_eq!(q.take_reopened(), 1, "unresolved again");
        assert_eq!(q.take_reopened(), 0);
        assert_eq!(q.poll_send(later).map(|s| s.0), Some(id(1)));
        // One more `error:`: aside again at once.
        assert_eq!(q.on_ok(id(1), false, err, later), OkOutcome::SetAside);
        let again = later.plus(ASIDE_RETRY);
        q.handle_timeout(again);
        assert_eq!(q.poll_send(again).map(|s| s.0), Some(id(1)));
        assert_eq!(
            q.on_ok(id(1), true, Prefix::Other, again),
            OkOutcome::Stored
        );
        assert!(q.is_idle());
        assert_eq!(q.aside(), 0);
    }

    /// Answers `error:` to `targets` until each is set aside, storing everything else;
    /// returns when the last was set aside.
    fn fail_until_aside(q: &mut ForwardQueue, targets: &[EventId], mut t: Time) -> Time {
        let err = Prefix::of("error: database is locked");
        let mut left = targets.len();
        loop {
            t = t.plus(MAX_ERROR_PAUSE).plus(Duration::from_secs(1));
            q.handle_timeout(t);
            while let Some((sent, _)) = q.poll_send(t) {
                let accepted = !targets.contains(&sent);
                let prefix = if accepted { Prefix::Other } else { err };
                if q.on_ok(sent, accepted, prefix, t) == OkOutcome::SetAside {
                    left -= 1;
                    if left == 0 {
                        return t;
                    }
                }
            }
        }
    }

    #[test]
    fn a_copy_of_an_event_set_aside_is_not_sent_twice() {
        // Review of issue 36 item 2: a copy offered while its event was aside was queued and
        // sent; when the aside timer fired the event was queued a second time beside the copy
        // in flight, the second `OK` came back `Unexpected` and the forwarder's unresolved
        // count never returned to 0 (no state save again).
        let mut q = ForwardQueue::new(limits());
        q.offer(id(1), raw(1));
        q.offer(id(2), raw(2));
        let t = fail_until_aside(&mut q, &[id(1)], Time::from_secs(0));
        assert_eq!(q.aside(), 1);
        // Copies from other relays, and a reconciliation that finds the own relay lacks it.
        assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyQueued);
        assert_eq!(q.offer_missing(id(1), raw(1)), Offer::AlreadyQueued);
        assert_eq!(
            q.poll_send(t),
            None,
            "nothing queued besides the event aside"
        );
        let later = t.plus(ASIDE_RETRY);
        q.handle_timeout(later);
        assert_eq!(q.take_reopened(), 1);
        assert_eq!(q.poll_send(later).map(|s| s.0), Some(id(1)));
        assert_eq!(q.poll_send(later), None, "sent once");
        assert_eq!(
            q.on_ok(id(1), true, Prefix::Other, later),
            OkOutcome::Stored
        );
        assert_eq!(
            q.on_ok(id(1), true, Prefix::Other, later),
            OkOutcome::Unexpected
        );
        assert!(q.is_idle());
    }

    #[test]
    fn the_aside_set_is_bounded_like_the_rejected_store() {
        // Review of issue 36 item 2: the aside set grew without bound. It keeps what the
        // rejected store keeps (here 2 events); the oldest move to that store.
        let mut q = ForwardQueue::new(limits());
        for n in 1..=3u8 {
            q.offer(id(n), raw(n));
            q.offer(id(100 + n), raw(100 + n));
        }
        let t = fail_until_aside(&mut q, &[id(1), id(2), id(3)], Time::from_secs(0));
        assert_eq!(q.aside(), 2);
        assert_eq!(q.counters().set_aside, 3);
        assert_eq!(q.counters().aside_overflow, 1);
        assert_eq!(
            q.rejected_kept(),
            1,
            "the oldest went to the rejected store"
        );
        assert!(q.error_rounds.len() <= 2, "no count kept for it");
        // An event already aside and answered `error:` again is aside once.
        let later = t.plus(ASIDE_RETRY);
        q.handle_timeout(later);
        while let Some((sent, _)) = q.poll_send(later) {
            let err = Prefix::of("error: database is locked");
            assert_eq!(q.on_ok(sent, false, err, later), OkOutcome::SetAside);
        }
        assert_eq!(q.aside(), 2);
    }

    #[test]
    fn a_pause_that_is_over_is_no_deadline_even_while_nothing_is_sent() {
        // Issue 36, item 3: during a NIP-42 write pause the forwarder calls no `poll_send`,
        // so a rate-limit pause that ended was never cleared and `poll_timeout` returned a
        // deadline in the past: the forwarder's wait was zero, 100 % CPU.
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        q.offer(id(1), raw(1));
        assert_eq!(q.poll_send(t).map(|s| s.0), Some(id(1)));
        let rl = "rate-limited: slow down";
        assert_eq!(
            q.on_ok(id(1), false, Prefix::of(rl), t),
            OkOutcome::RateLimited
        );
        let pause_end = q.poll_timeout().expect("a pause");
        assert!(pause_end > t);
        let later = pause_end.plus(Duration::from_secs(1));
        // Nothing is sent (writes held back); the timers are handled as the loop does.
        q.handle_timeout(later);
        assert!(
            q.poll_timeout().is_none_or(|d| d > later),
            "{:?} is past",
            q.poll_timeout()
        );
        assert!(q.can_send(later));
    }

    #[test]
    fn the_ok_latency_is_a_moving_average_of_stored_and_duplicate_answers() {
        let t = Time::from_secs(0);
        let ms = |n: u64| t.plus(Duration::from_millis(n));
        let mut q = ForwardQueue::new(ForwardLimits {
            in_flight: 4,
            ..limits()
        });
        assert_eq!(q.recent_ok_latency(), None);
        for n in 1..=4 {
            q.offer(id(n), raw(n));
            assert_eq!(q.poll_send(t).map(|s| s.0), Some(id(n)));
        }
        assert_eq!(
            q.on_ok(id(1), true, Prefix::Other, ms(40)),
            OkOutcome::Stored
        );
        assert_eq!(q.recent_ok_latency(), Some(Duration::from_millis(40)));
        // The latest answer weighs an eighth.
        assert_eq!(
            q.on_ok(id(2), false, Prefix::Duplicate, ms(120)),
            OkOutcome::Duplicate
        );
        assert_eq!(q.recent_ok_latency(), Some(Duration::from_millis(50)));
        // A rejection or a failure says nothing about how long storing takes.
        assert!(matches!(
            q.on_ok(id(3), false, Prefix::Other, ms(900)),
            OkOutcome::Rejected(_)
        ));
        let _ = q.on_ok(id(4), false, Prefix::Error, ms(900));
        assert_eq!(q.recent_ok_latency(), Some(Duration::from_millis(50)));
    }

    #[test]
    fn an_offer_that_queues_nothing_settles_its_claim() {
        // A copy claimed by a relay thread but answered from the queue's memory gets no `OK`:
        // its claim is settled so that a reconciliation's fetch does not take it for an
        // event still in flight (decision 0088).
        use crate::core::dedup::{EventSummary, RawDigest};
        let t = Time::from_secs(0);
        let verified = VerifiedSet::new(16);
        let summary = EventSummary {
            created_at: 1,
            kind: 1621,
            pubkey: nostr::key::Keys::generate().public_key(),
            tags: Default::default(),
        };
        let sig = nostr::event::Signature::from_byte_array([1; 64]);
        let claimed = |n: u8| {
            verified.insert(id(n), sig, RawDigest::of("{}"), summary);
            assert!(verified.claim_forward(&id(n), 0));
            assert!(verified.in_flight_copy(&id(n), 0).is_some());
        };
        let mut q = ForwardQueue::new(limits());
        // Stored earlier (and forgotten by the set since): marked stored, not in flight.
        q.offer(id(1), raw(1));
        let _ = q.poll_send(t);
        assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
        claimed(1);
        let offer = q.offer(id(1), raw(1));
        assert_eq!(offer, Offer::AlreadyStored);
        offer.settle_claim(&id(1), &verified);
        assert!(verified.in_flight_copy(&id(1), 0).is_none());
        assert!(verified.forwarded_copy(&id(1), 0).is_some(), "still a copy");
        // Rejected before: released, so the next copy is handed over and decided again.
        q.offer(id(2), raw(2));
        let _ = q.poll_send(t);
        let _ = q.on_ok(id(2), false, Prefix::of("blocked: no"), t);
        claimed(2);
        let offer = q.offer(id(2), raw(2));
        assert_eq!(offer, Offer::PreviouslyRejected);
        offer.settle_claim(&id(2), &verified);
        assert!(verified.forwarded_copy(&id(2), 0).is_none());
        assert!(verified.claim_forward(&id(2), 0));
        // Queued, or a copy of one queued: in flight until its `OK`.
        claimed(3);
        for expected in [Offer::Queued, Offer::AlreadyQueued] {
            let offer = q.offer(id(3), raw(3));
            assert_eq!(offer, expected);
            offer.settle_claim(&id(3), &verified);
            assert!(verified.in_flight_copy(&id(3), 0).is_some());
        }
    }

    #[test]
    fn rejected_is_kept_and_retried_only_on_request() {
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        q.offer(id(1), tagged(1, 1621, &[["a", "30617:pk:r"]]));
        let _ = q.poll_send(t);
        assert_eq!(
            q.on_ok(id(1), false, Prefix::of("blocked: unknown repo"), t),
            OkOutcome::Rejected(Prefix::Blocked)
        );
        assert_eq!(q.offer(id(1), raw(1)), Offer::PreviouslyRejected);
        assert!(q.poll_send(t).is_none());
        let other = HashSet::from(["30617:pk:other".to_string()]);
        assert_eq!(q.retry_rejected(&other), 0, "another repository changed");
        assert_eq!(q.retry_rejected(&everything()), 1);
        assert_eq!(q.poll_send(t).unwrap().0, id(1));
        assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
        assert_eq!(q.counters().rejected, 1);
    }

    #[test]
    fn retry_chooses_only_affected_events_and_refills_within_the_backlog() {
        let t = Time::from_secs(0);
        let root = "ab".repeat(32);
        let events = [
            tagged(1, 1621, &[["a", "30617:pk:x"]]),
            tagged(2, 1617, &[["a", "30617:pk:x"]]),
            tagged(3, 1111, &[["A", "30617:pk:x"]]),
            tagged(4, 30618, &[["d", "x"]]),
            tagged(5, 1621, &[["a", "30617:pk:y"]]),
            tagged(6, 1111, &[["E", &root.to_uppercase()]]),
        ];
        let mut q = ForwardQueue::new(ForwardLimits {
            rejected_kept: 100,
            ..limits()
        });
        for (i, raw) in events.iter().enumerate() {
            let b = i as u8 + 1;
            q.offer(id(b), raw.clone());
            let _ = q.poll_send(t);
            q.on_ok(id(b), false, Prefix::of("blocked: unknown repository"), t);
        }
        assert_eq!(q.rejected_kept(), 6);
        // Repository x was announced: its three events and its state event, not y's.
        let changed = HashSet::from(["30617:pk:x".to_string()]);
        assert_eq!(q.retry_rejected(&changed), 4);
        assert_eq!(q.rejected_kept(), 2);
        // Only as many as the backlog (3) holds are queued; the fourth waits for room.
        assert_eq!((q.backlog(), q.retrying()), (3, 1));
        assert!(!q.is_idle());
        let (first, _) = q.poll_send(t).unwrap();
        q.on_ok(first, true, Prefix::Other, t);
        let _ = q.poll_send(t);
        assert_eq!(q.retrying(), 0, "refilled as room freed up");
        // A root event linked: the reply to it (upper-case E, any hex case).
        assert_eq!(q.retry_rejected(&HashSet::from([root])), 1);
    }

    #[test]
    fn rejected_store_is_bounded() {
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        for b in 1..=3 {
            q.offer(id(b), raw(b));
            let _ = q.poll_send(t);
            q.on_ok(id(b), false, Prefix::of("blocked:"), t);
        }
        assert_eq!(q.rejected_kept(), 2);
        // The byte bound holds too.
        let mut small = ForwardQueue::new(ForwardLimits {
            rejected_bytes: 20,
            ..limits()
        });
        for b in 1..=3 {
            small.offer(id(b), raw(b));
            let _ = small.poll_send(t);
            small.on_ok(id(b), false, Prefix::of("blocked:"), t);
        }
        assert_eq!(small.rejected_kept(), 2, "each raw is 8 bytes");
        let mut tagged_small = ForwardQueue::new(ForwardLimits {
            rejected_bytes: 2 * tagged(1, 1621, &[["a", "30617:pk:r"]]).len() + 1,
            ..limits()
        });
        for b in 1..=3 {
            tagged_small.offer(id(b), tagged(b, 1621, &[["a", "30617:pk:r"]]));
            let _ = tagged_small.poll_send(t);
            tagged_small.on_ok(id(b), false, Prefix::of("blocked:"), t);
        }
        assert_eq!(tagged_small.retry_rejected(&everything()), 2);
    }

    #[test]
    fn timeout_disconnect_and_rate_limit_resend() {
        let t = Time::from_secs(100);
        let mut q = ForwardQueue::new(limits());
        q.offer(id(1), raw(1));
        q.offer(id(2), raw(2));
        let _ = q.poll_send(t);
        let _ = q.poll_send(t);
        assert_eq!(q.poll_timeout(), Some(t.plus(Duration::from_secs(10))));
        q.handle_timeout(t.plus(Duration::from_secs(10)));
        assert_eq!(q.backlog(), 2);
        let t2 = t.plus(Duration::from_secs(11));
        assert!(q.poll_send(t2).is_some());
        q.on_disconnect();
        assert_eq!(q.counters().resent, 3);
        let (first, _) = q.poll_send(t2).unwrap();
        assert_eq!(
            q.on_ok(first, false, Prefix::of("rate-limited: slow down"), t2),
            OkOutcome::RateLimited
        );
        assert!(q.poll_send(t2).is_none(), "paused");
        assert!(q.poll_send(t2.plus(Duration::from_secs(2))).is_some());
    }

    #[test]
    fn auth_required_requeues_at_the_front() {
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        q.offer(id(1), raw(1));
        q.offer(id(2), raw(2));
        assert_eq!(q.poll_send(t).unwrap().0, id(1));
        assert_eq!(q.requeue_auth_required(id(1)), OkOutcome::AuthRequired);
        assert_eq!(q.requeue_auth_required(id(1)), OkOutcome::Unexpected);
        assert_eq!(q.backlog(), 2);
        assert_eq!(q.counters().resent, 1);
        assert_eq!(q.counters().rejected, 0);
        assert_eq!(q.poll_send(t).unwrap().0, id(1), "sent first again");
        assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
        // Without authentication under way the caller uses on_ok: a rejection.
        let _ = q.poll_send(t);
        assert_eq!(
            q.on_ok(id(2), false, Prefix::of("auth-required: who are you"), t),
            OkOutcome::Rejected(Prefix::AuthRequired)
        );
    }

    #[test]
    fn relay_error_is_never_a_verdict_however_long_it_lasts() {
        // An own relay answering `error:` for ten minutes (a locked database): the event is
        // sent again after growing pauses, never rejected, and stored once the relay recovers.
        let mut t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        q.offer(id(1), raw(1));
        let mut pauses = Vec::new();
        let mut last_sent = t;
        while t.since(Time::from_secs(0)) < Duration::from_secs(600) {
            match q.poll_send(t) {
                Some((sent, _)) => {
                    pauses.push(t.since(last_sent));
                    last_sent = t;
                    assert_eq!(
                        q.on_ok(sent, false, Prefix::of("error: database is locked"), t),
                        OkOutcome::RelayError
                    );
                }
                None => t = t.plus(Duration::from_secs(1)),
            }
        }
        assert_eq!(q.counters().rejected, 0);
        assert_eq!(q.rejected_kept(), 0);
        assert_eq!(q.backlog(), 1, "still queued");
        assert!(q.counters().relay_errors >= 10, "{pauses:?}");
        // The pauses grow (2, 4, 8, … s) up to MAX_ERROR_PAUSE.
        assert_eq!(pauses[1], Duration::from_secs(2));
        assert_eq!(pauses[2], Duration::from_secs(4));
        assert_eq!(*pauses.iter().max().unwrap(), MAX_ERROR_PAUSE);
        // A copy from another relay meanwhile is not lost: the queued one carries it.
        assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyQueued);
        assert_eq!(q.offer_missing(id(1), raw(1)), Offer::AlreadyQueued);
        // The relay recovers: stored, and the next error pauses only briefly again.
        t = t.plus(MAX_ERROR_PAUSE);
        let (sent, _) = q.poll_send(t).unwrap();
        assert_eq!(q.on_ok(sent, true, Prefix::Other, t), OkOutcome::Stored);
        assert_eq!(q.errors_in_a_row(), 0);
        q.offer(id(2), raw(2));
        let (sent, _) = q.poll_send(t).unwrap();
        q.on_ok(sent, false, Prefix::of("error: try again"), t);
        assert!(q.poll_send(t.plus(Duration::from_secs(1))).is_none());
        assert!(q.poll_send(t.plus(Duration::from_secs(2))).is_some());
    }

    #[test]
    fn a_retry_dropped_because_its_event_was_queued_or_stored_meanwhile_is_settled() {
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        let refs = |n: u8| {
            let repo = format!("30617:{}:r", "ab".repeat(32));
            let raw: Arc<str> = format!(
                r#"{{"id":"{}","kind":1621,"tags":[["a","{repo}"]],"n":{n}}}"#,
                id(n).to_hex()
            )
            .into();
            (repo, raw)
        };
        let (repo, raw1) = refs(1);
        let (_, raw2) = refs(2);
        for (n, raw) in [(1, raw1.clone()), (2, raw2.clone())] {
            q.offer(id(n), raw);
            let (sent, _) = q.poll_send(t).unwrap();
            q.on_ok(sent, false, Prefix::of("blocked: not related"), t);
        }
        assert_eq!(q.rejected_kept(), 2);
        // Fill the backlog so the retries wait in `retrying`.
        for n in 10..10 + limits().backlog as u8 {
            q.offer(id(n), raw(n));
        }
        let changed = [repo].into_iter().collect();
        assert_eq!(q.retry_rejected(&changed), 2);
        assert_eq!(q.retrying(), 2);
        assert_eq!(q.take_settled(), 0);
        // The backlog drains: the retries enter the queue as it has room.
        while let Some((sent, _)) = q.poll_send(t) {
            q.on_ok(sent, true, Prefix::Other, t);
        }
        assert_eq!(q.retrying(), 0);
        // The retries entered the queue (they were not stored yet) and were sent above.
        assert_eq!(q.take_settled(), 0);
        // Now the same again, but copies of both arrive (a NIP-77 fetch) while the retries
        // wait for room: the copies are queued, and the retries find them queued.
        for (n, raw) in [(3u8, refs(3).1), (4, refs(4).1)] {
            q.offer(id(n), raw);
            let (sent, _) = q.poll_send(t).unwrap();
            q.on_ok(sent, false, Prefix::of("blocked: not related"), t);
        }
        for n in 10..10 + limits().backlog as u8 {
            q.offer(id(n + 100), raw(n + 100));
        }
        assert_eq!(q.retry_rejected(&[refs(3).0].into_iter().collect()), 2);
        q.offer_missing(id(3), refs(3).1);
        q.offer_missing(id(4), refs(4).1);
        while let Some((sent, _)) = q.poll_send(t) {
            q.on_ok(sent, true, Prefix::Other, t);
        }
        assert_eq!(
            q.take_settled(),
            2,
            "both retries found their events handled"
        );
        assert_eq!(q.take_settled(), 0);
    }

    #[test]
    fn the_kind_is_read_from_the_key_not_from_strings_or_tag_values() {
        assert_eq!(json_kind(r#"{"id":"x","kind":1621,"tags":[]}"#), Some(1621));
        assert_eq!(json_kind(r#"{"kind" : 30617}"#), Some(30617));
        // Inside the content the quotes are escaped; a tag value is followed by `,` or `]`.
        assert_eq!(
            json_kind(
                r#"{"content":"say \"kind\":1","tags":[["t","kind"],["kind","x"]],"kind":1111}"#
            ),
            Some(1111)
        );
        // A content ending in a backslash closes its string before the key.
        assert_eq!(json_kind(r#"{"content":"a\\","kind":7}"#), Some(7));
        assert_eq!(json_kind(r#"{"kind":"x"}"#), None);
        assert_eq!(json_kind("garbage"), None);
        assert_eq!(send_class(r#"{"kind":30617}"#), 0);
        assert_eq!(send_class(r#"{"kind":30618}"#), 1);
        assert_eq!(send_class(r#"{"kind":1618}"#), 2);
        assert_eq!(send_class(r#"{"kind":1619}"#), 3);
    }

    #[test]
    fn announcements_go_first_then_root_events_then_the_rest() {
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(ForwardLimits {
            backlog: 100,
            in_flight: 100,
            ..limits()
        });
        let ev = |n: u8, kind: u16| -> Arc<str> { format!(r#"{{"n":{n},"kind":{kind}}}"#).into() };
        q.offer(id(1), ev(1, 1111));
        q.offer(id(2), ev(2, 1621));
        q.offer(id(6), ev(6, 30618));
        q.offer(id(3), ev(3, 30617));
        q.offer(id(4), ev(4, 1111));
        q.offer(id(5), ev(5, 1617));
        let order: Vec<EventId> = std::iter::from_fn(|| q.poll_send(t).map(|(i, _)| i)).collect();
        // A state event after the announcements: ngit-grasp refuses one whose repository it
        // has no announcement of (`invalid: no announcement exists for this repository`).
        assert_eq!(order, [3, 6, 2, 5, 1, 4].map(id));
    }

    #[test]
    fn a_relay_answering_duplicate_to_stored_writes_ends_the_pace() {
        // ngit-grasp answers every stored write `OK true "duplicate: event stored"`. The pace
        // shrank only on stored answers, so after one `rate-limited:` spell it only grew
        // (4.4 s per event measured against ngit-grasp).
        let mut t = Time::from_secs(0);
        let mut q = ForwardQueue::new(ForwardLimits {
            backlog: 1000,
            in_flight: 64,
            ..limits()
        });
        for n in 0..250u8 {
            q.offer(id(n), raw(n));
        }
        let (first, _) = q.poll_send(t).unwrap();
        q.on_ok(first, false, Prefix::of("rate-limited: slow down"), t);
        assert!(q.throttle().is_some());
        let dup = Prefix::of("duplicate: event stored");
        while q.throttle().is_some() && t.since(Time::from_secs(0)) < Duration::from_secs(600) {
            match q.poll_send(t) {
                Some((i, _)) => assert_eq!(q.on_ok(i, true, dup, t), OkOutcome::Duplicate),
                None => t = t.plus(Duration::from_millis(100)),
            }
        }
        assert!(q.throttle().is_none(), "still paced after {t:?}");
        assert!(t.since(Time::from_secs(0)) < Duration::from_secs(120));
    }

    #[test]
    fn a_throttling_own_relay_sets_the_pace_and_a_fast_one_ends_it() {
        // An own relay that stores one event per 10 s and answers the rest `rate-limited:`.
        let mut t = Time::from_secs(0);
        let mut q = ForwardQueue::new(ForwardLimits {
            backlog: 1000,
            in_flight: 64,
            ..limits()
        });
        for n in 0..200u8 {
            q.offer(id(n), raw(n));
        }
        let mut next_ok = t;
        let mut sent = 0u64;
        while t.since(Time::from_secs(0)) < Duration::from_secs(1800) {
            while let Some((i, _)) = q.poll_send(t) {
                sent += 1;
                if t >= next_ok {
                    next_ok = t.plus(Duration::from_secs(10));
                    assert_eq!(q.on_ok(i, true, Prefix::Other, t), OkOutcome::Stored);
                } else {
                    q.on_ok(i, false, Prefix::of("rate-limited: slow down"), t);
                }
            }
            t = t.plus(Duration::from_millis(100));
        }
        let stored = q.counters().stored;
        // About one every 10 s for the half hour, nothing lost or rejected...
        assert!((150..=181).contains(&stored), "{stored} stored");
        assert_eq!(q.counters().rejected, 0);
        assert_eq!(q.backlog() as u64 + stored, 200);
        // ...without hammering: a few sends per stored event, not one per 100 ms tick.
        assert!(sent < 4 * stored, "{sent} sends for {stored} stored");
        let throttle = q.throttle().expect("throttled");
        assert_eq!(throttle.since, Time::from_secs(0));
        let rate = throttle.per_minute(t);
        assert!((5.0..=6.1).contains(&rate), "{rate} a minute");
        // The relay recovers: answers are fast, the pace shrinks and ends within minutes (after
        // FAST_RUN events stored in a row at the fastest pace).
        let more = |n: u16| {
            let mut b = [0xee; 32];
            b[..2].copy_from_slice(&n.to_be_bytes());
            EventId::from_byte_array(b)
        };
        for n in 0..2 * FAST_RUN as u16 {
            q.offer(more(n), raw(0));
        }
        let recovered_at = t;
        while q.throttle().is_some() && t.since(recovered_at) < Duration::from_secs(3600) {
            match q.poll_send(t) {
                Some((i, _)) => {
                    q.on_ok(i, true, Prefix::Other, t);
                }
                None => t = t.plus(Duration::from_millis(100)),
            }
        }
        let took = t.since(recovered_at);
        assert!(
            took < Duration::from_secs(120),
            "{took:?} to end the pacing"
        );
        assert!(
            q.throttle().is_none(),
            "pacing ends once the relay takes what we send"
        );
        for n in 200..250u8 {
            q.offer(id(n), raw(n));
        }
        t = t.plus(Duration::from_secs(1));
        let waiting = q.backlog() as u64;
        let before = q.counters().stored;
        while let Some((i, _)) = q.poll_send(t) {
            q.on_ok(i, true, Prefix::Other, t);
        }
        assert_eq!(
            q.counters().stored - before,
            waiting,
            "unpaced again: all at once"
        );
    }

    /// Issue 19's figure: 2,000 events into an own relay that accepts 120 a minute (a token
    /// bucket of 15 at once, then two a second, as ngit-relay's limiter with another rate).
    /// The pace settles near the relay's rate: the sync takes little more than the 16.7
    /// minutes the relay needs, with few refused sends.
    #[test]
    fn two_thousand_events_into_an_own_relay_taking_120_a_minute() {
        let mut q = ForwardQueue::new(ForwardLimits {
            backlog: 4096,
            ..ForwardLimits::default()
        });
        let id = |n: u16| {
            EventId::from_byte_array({
                let mut b = [0u8; 32];
                b[..2].copy_from_slice(&n.to_be_bytes());
                b
            })
        };
        for n in 0..2000u16 {
            q.offer(id(n), Arc::from(format!("{{\"n\":{n}}}")));
        }
        let start = Time::from_secs(0);
        let mut t = start;
        let (mut tokens, mut last) = (15.0f64, t);
        let mut sends = 0u64;
        while q.counters().stored < 2000 {
            while let Some((i, _)) = q.poll_send(t) {
                sends += 1;
                tokens = (tokens + t.since(last).as_secs_f64() * 2.0).min(15.0);
                last = t;
                if tokens >= 1.0 {
                    tokens -= 1.0;
                    q.on_ok(i, true, Prefix::Other, t);
                } else {
                    q.on_ok(i, false, Prefix::of("rate-limited: slow down"), t);
                }
            }
            t = t.plus(Duration::from_millis(50));
            assert!(t.since(start) < Duration::from_secs(3600), "an hour");
        }
        let took = t.since(start);
        let minutes = took.as_secs_f64() / 60.0;
        eprintln!("2,000 events at 120 a minute: {minutes:.1} min, {sends} sends");
        assert!(minutes < 2000.0 / 120.0 * 1.2, "{minutes:.1} min");
        assert!(sends < 2000 * 2, "{sends} sends");
        assert_eq!(q.counters().rejected, 0);
    }

    /// ngit-grasp's answer to a new repository announcement (GRASP-01 purgatory).
    const PURGATORY: &str = "purgatory: won't be served until git data arrives";
    /// ngit-grasp's answer to an event about a repository it does not serve (yet).
    const RESTRICTED: &str =
        "restricted: Event event must reference an accepted repository or accepted event";

    #[test]
    fn a_purgatory_answer_is_taken_counted_and_never_sent_again() {
        // Issue 34: ngit-grasp holds a new announcement unserved until its git data arrives
        // (and drops it after 30 minutes if none does). Every reconciliation finds the own
        // relay without it and offers it as missing: it must not be written again (each
        // write would keep an empty repository in purgatory another 30 minutes, for ever).
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(limits());
        let ann = tagged(1, 30617, &[["d", "r"]]);
        q.offer(id(1), ann.clone());
        assert_eq!(q.poll_send(t).unwrap().0, id(1));
        assert_eq!(
            q.on_ok(id(1), true, Prefix::of(PURGATORY), t),
            OkOutcome::Purgatory
        );
        let c = q.counters();
        assert_eq!((c.purgatory, c.stored, c.rejected), (1, 0, 0));
        assert!(q.is_held(&id(1)));
        assert!(q.is_idle(), "resolved: nothing waits for it");
        // A copy from another relay, and the same event fetched as missing by a
        // reconciliation, a day later and again: never queued.
        for _ in 0..3 {
            assert_eq!(q.offer(id(1), ann.clone()), Offer::AlreadyStored);
            assert_eq!(q.offer_missing(id(1), ann.clone()), Offer::AlreadyStored);
            assert!(q.poll_send(t.plus(Duration::from_secs(86_400))).is_none());
        }
        assert_eq!(q.counters().resent, 0);
        // An event the own relay stored (not held) is still sent again when it went missing.
        q.offer(id(2), raw(2));
        let _ = q.poll_send(t);
        q.on_ok(id(2), true, Prefix::of("duplicate: event stored"), t);
        assert!(!q.is_held(&id(2)));
        assert_eq!(q.offer_missing(id(2), raw(2)), Offer::Queued);
        // `OK false` with the word is no acceptance: an ordinary rejection, kept.
        q.offer(id(3), raw(3));
        let _ = q.poll_send(t);
        let _ = q.poll_send(t);
        assert_eq!(
            q.on_ok(id(3), false, Prefix::of(PURGATORY), t),
            OkOutcome::Rejected(Prefix::Purgatory)
        );
        assert!(!q.is_held(&id(3)));
    }

    #[test]
    fn events_refused_while_their_repository_is_in_purgatory_go_again_once_it_is_served() {
        // The announcement goes into purgatory; the issue about it and a reply to the issue
        // are refused `restricted:`. Once the own relay serves the repository (its git data
        // arrived: the self-subscription applies the announcement), the index change re-offers
        // the issue (it names the repository) and, once the issue is linked, the reply.
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(ForwardLimits {
            backlog: 10,
            in_flight: 10,
            ..limits()
        });
        let repo = "30617:pk:r";
        let issue_hex = "ab".repeat(32);
        q.offer(id(1), tagged(1, 30617, &[["d", "r"]]));
        q.offer(id(2), tagged(2, 1621, &[["a", repo]]));
        q.offer(id(3), tagged(3, 1111, &[["E", &issue_hex]]));
        let mut sent = Vec::new();
        while let Some((i, _)) = q.poll_send(t) {
            sent.push(i);
        }
        assert_eq!(sent, vec![id(1), id(2), id(3)], "announcement first");
        assert_eq!(
            q.on_ok(id(1), true, Prefix::of(PURGATORY), t),
            OkOutcome::Purgatory
        );
        for i in [id(2), id(3)] {
            assert_eq!(
                q.on_ok(i, false, Prefix::of(RESTRICTED), t),
                OkOutcome::Rejected(Prefix::Restricted)
            );
        }
        assert_eq!(q.rejected_kept(), 2);
        // Still in purgatory: nothing changes, nothing is sent.
        assert_eq!(q.offer(id(2), raw(2)), Offer::PreviouslyRejected);
        assert!(q.poll_send(t).is_none());
        // Served: the repository's announcement is applied.
        assert_eq!(q.retry_rejected(&HashSet::from([repo.to_string()])), 1);
        assert_eq!(q.poll_send(t).unwrap().0, id(2));
        assert_eq!(
            q.on_ok(id(2), true, Prefix::of("duplicate: event stored"), t),
            OkOutcome::Duplicate
        );
        // The issue is linked to the repository: the reply goes too.
        assert_eq!(q.retry_rejected(&HashSet::from([issue_hex])), 1);
        assert_eq!(q.poll_send(t).unwrap().0, id(3));
        q.on_ok(id(3), true, Prefix::of("duplicate: event stored"), t);
        assert_eq!(q.rejected_kept(), 0);
        // The announcement itself was never written again.
        assert_eq!(q.counters().resent, 0);
    }

    #[test]
    fn a_maintainers_announcement_and_state_go_again_once_a_repository_of_their_d_is_served() {
        // ngit-grasp takes a maintainer's announcement that does not list it only once a
        // served announcement of the same `d` lists its author, and a state event only once an
        // announcement of its `d` authorizes it. Refused while the owner's announcement was in
        // purgatory, they named nothing a retry looked for (the announcement no tag at all, the
        // state its author's own coordinate): kept for ever, their copies held back.
        let t = Time::from_secs(0);
        let mut q = ForwardQueue::new(ForwardLimits {
            backlog: 10,
            in_flight: 10,
            rejected_kept: 10,
            ..limits()
        });
        let ann = Arc::<str>::from(
            serde_json::json!({"kind": 30617, "pubkey": "maint", "tags": [["d", "r"]]}).to_string(),
        );
        let state = Arc::<str>::from(
            serde_json::json!({"kind": 30618, "pubkey": "maint", "tags": [["d", "r"]]}).to_string(),
        );
        let other = Arc::<str>::from(
            serde_json::json!({"kind": 30617, "pubkey": "x", "tags": [["d", "rr"]]}).to_string(),
        );
        for (n, raw) in [(1, &ann), (2, &state), (3, &other)] {
            q.offer(id(n), raw.clone());
        }
        while let Some((i, _)) = q.poll_send(t) {
            q.on_ok(i, false, Prefix::of("invalid: no"), t);
        }
        assert_eq!(q.rejected_kept(), 3);
        // Another identifier changes nothing.
        assert_eq!(
            q.retry_rejected(&HashSet::from(["30617:owner:r2".to_string()])),
            0
        );
        // The owner's repository `r` is served: both of the maintainer's go again.
        assert_eq!(
            q.retry_rejected(&HashSet::from(["30617:owner:r".to_string()])),
            2
        );
        let mut sent: Vec<EventId> = std::iter::from_fn(|| q.poll_send(t).map(|s| s.0)).collect();
        sent.sort();
        assert_eq!(sent, vec![id(1), id(2)]);
        assert_eq!(q.rejected_kept(), 1);
    }

    /// ngit-grasp's write budget (rust-nostr's relay builder, `notes_per_minute: 60`): 60
    /// tokens per connection; each EVENT adds the whole seconds since the connection's
    /// previous EVENT (refused ones included, at most 60), then takes one or is answered
    /// `rate-limited: slow down`. A refusal sent less than a second after the previous EVENT
    /// earns nothing and starts the second again. 600 events, every accepted one answered
    /// `duplicate: event stored` (announcements `purgatory:`): all taken, on one connection,
    /// paced, without a write per 100 ms for the 9 minutes the relay needs.
    #[test]
    fn ngit_grasps_write_budget_paces_one_connection_and_loses_nothing() {
        let mut q = ForwardQueue::new(ForwardLimits {
            backlog: 4096,
            ..ForwardLimits::default()
        });
        let id = |n: u16| {
            EventId::from_byte_array({
                let mut b = [0u8; 32];
                b[..2].copy_from_slice(&n.to_be_bytes());
                b
            })
        };
        let events = 600u16;
        for n in 0..events {
            let kind = if n % 10 == 0 { 30617 } else { 1621 };
            q.offer(id(n), Arc::from(format!("{{\"kind\":{kind},\"n\":{n}}}")));
        }
        let start = Time::from_secs(0);
        let mut t = start;
        let (mut tokens, mut last): (u64, Option<Time>) = (60, None);
        let mut sends = 0u64;
        while !q.is_idle() {
            while let Some((i, raw)) = q.poll_send(t) {
                sends += 1;
                if let Some(l) = last {
                    tokens = (tokens + t.since(l).as_secs().min(60)).min(60);
                }
                last = Some(t);
                if tokens == 0 {
                    q.on_ok(i, false, Prefix::of("rate-limited: slow down"), t);
                    continue;
                }
                tokens -= 1;
                let answer = if raw.contains("30617") {
                    PURGATORY
                } else {
                    "duplicate: event stored"
                };
                q.on_ok(i, true, Prefix::of(answer), t);
            }
            t = t.plus(Duration::from_millis(10));
            assert!(t.since(start) < Duration::from_secs(3600), "an hour");
        }
        let c = q.counters();
        assert_eq!(c.purgatory + c.duplicates, u64::from(events), "{c:?}");
        assert_eq!((c.purgatory, c.rejected), (60, 0));
        let took = t.since(start).as_secs_f64();
        let ideal = f64::from(events - 60);
        eprintln!("{events} events into ngit-grasp's budget: {took:.0} s (the relay's floor {ideal:.0} s), {sends} writes");
        assert!(took < ideal * 1.8, "{took:.0} s");
        assert!(sends < 2 * u64::from(events), "{sends} writes");
    }

    #[test]
    fn byte_admission_bounds_the_total_and_each_relay_share() {
        let l = ForwardLimits {
            max_bytes: 10,
            relay_bytes: 4,
            ..ForwardLimits::default()
        };
        assert!(
            admits(&l, 0, 0, 100),
            "an empty pipeline takes any one event"
        );
        assert!(
            admits(&l, 5, 0, 4),
            "a relay with nothing held gets in within the total"
        );
        assert!(admits(&l, 5, 3, 1));
        assert!(!admits(&l, 5, 3, 2), "over the relay's share");
        assert!(!admits(&l, 8, 0, 3), "over the total");
        assert!(admits(&l, 6, 0, 4));
        let unbounded = ForwardLimits {
            max_bytes: 0,
            relay_bytes: 0,
            ..ForwardLimits::default()
        };
        assert!(admits(&unbounded, u64::MAX - 1, u64::MAX - 1, 5));
        let d = ForwardLimits::default();
        assert_eq!((d.max_bytes, d.relay_bytes), (64 << 20, 16 << 20));
    }
}
