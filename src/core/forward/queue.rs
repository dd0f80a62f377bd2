//! The queue of events on their way into the own relay, sans-IO: what is sent next, what an
//! `OK` means for the event, what is kept, re-queued, paced or set aside (the rules are listed
//! in the [module documentation](super)). [`super::ForwardSession`] drives it.

use std::collections::VecDeque;

use crate::core::hash::HashSet;
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
#[non_exhaustive]
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
#[non_exhaustive]
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
    /// The pace of the last refused send, and when it was refused: for [`FLOOR_TIME`] after
    /// it, a stored event shortens the pace towards it, not below it, so the pace does not
    /// dip under the relay's rate again and again. Cleared when pacing ends.
    refused: Option<(Duration, Time)>,
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

/// How long the pace stays above the last pace the own relay refused: then it may try
/// lower again (a relay that throttled for a while, or whose rate rose, is found out).
pub const FLOOR_TIME: Duration = Duration::from_secs(60);

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
            refused: None,
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
            self.speed_up(now);
            return OkOutcome::Purgatory;
        }
        if prefix == Prefix::Duplicate {
            self.stored.insert(id);
            self.counters.duplicates += 1;
            // The relay took the write: a pace must shrink on it as on a stored event
            // (ngit-grasp answers every stored write `OK true "duplicate: event stored"`).
            self.speed_up(now);
            return OkOutcome::Duplicate;
        }
        if accepted {
            self.stored.insert(id);
            self.counters.stored += 1;
            self.speed_up(now);
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
        // Refused again within one interval of the last refusal: the send that asked again
        // soon was refused too (a relay that counts refused sends: rust-nostr's relay
        // builder, ngit-grasp's, starts its second again on each), so the next waits a whole
        // interval.
        let again = self
            .last_slow_down
            .zip(self.pace)
            .is_some_and(|(s, p)| now.since(s) < p);
        self.last_slow_down = Some(now);
        let (pace, pause) = match self.pace {
            None => (MIN_PACE, self.limits.rate_limit_pause.max(MIN_PACE)),
            Some(p) => {
                // The floor: the pace refused, unless this send only asked again too soon.
                if !again || self.refused.is_none() {
                    self.refused = Some((p, now));
                }
                let p = p.mul_f64(1.25).clamp(MIN_PACE, MAX_PACE);
                // Refused just before the relay's next slot: ask again soon, not a whole
                // interval later.
                (p, if again { p } else { (p / 4).max(MIN_PACE) })
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
    fn speed_up(&mut self, now: Time) {
        let Some(pace) = self.pace else {
            return;
        };
        self.successes = self.successes.saturating_add(1);
        if let Some(t) = self.throttle.as_mut() {
            t.stored += 1;
        }
        let floor = match self.refused {
            Some((r, at)) if now.since(at) < FLOOR_TIME => r.mul_f64(1.05),
            Some(_) => {
                // The floor lapses: the pace shrinks from here as after a refusal (by 5 %,
                // then 10 %, …), not at once by the run stored under the floor.
                self.refused = None;
                self.successes = 1;
                MIN_PACE
            }
            None => MIN_PACE,
        };
        let factor = 0.95f64.powi(self.successes.min(20) as i32);
        let next = pace.mul_f64(factor).max(floor).max(MIN_PACE);
        if next == MIN_PACE && self.successes >= FAST_RUN {
            self.pace = None;
            self.throttle = None;
            self.last_slow_down = None;
            self.refused = None;
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
#[path = "queue_tests.rs"]
mod tests;
