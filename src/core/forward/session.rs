//! The own relay's side of one forwarder, sans-IO: a [`ForwardSession`] owns the
//! [`ForwardQueue`], the connection's NIP-42 state ([`AuthState`]), its keep-alive, the intake
//! pause and every wait policy, as quinn-proto's `Connection` owns a connection's state:
//!
//! * in: offers ([`ForwardSession::offer`]), the own relay's frames
//!   ([`ForwardSession::handle_frame`]: `OK`, `AUTH`, `NOTICE`, pongs), commands
//!   ([`ForwardSession::handle_control`]) and timeouts ([`ForwardSession::handle_timeout`]);
//! * out: frames to write ([`ForwardSession::poll_transmit`]: events, AUTH, pings), what
//!   happened to each event ([`ForwardSession::poll_event`]) and the next deadline
//!   ([`ForwardSession::poll_timeout`]), plus what the wait wakes on ([`ForwardSession::wait`]).
//!
//! A turn of the forwarder: [`handle_timeout`](ForwardSession::handle_timeout) begins it and
//! opens the send phase; [`poll_transmit`](ForwardSession::poll_transmit) hands out events until
//! the window, a pace, NIP-42 or a batch hold stops it; the first frame read
//! ([`handle_frame`](ForwardSession::handle_frame)) ends the send phase, so the slots its `OK`s
//! free are filled on the next turn, in one write (decision 0064). AUTH and ping frames go out
//! whenever they are polled.
//!
//! Every policy takes `now` as a [`Time`]; only the write linger's sub-millisecond measure
//! comes from the caller ([`ForwardSession::hold_writes`]).

use std::collections::VecDeque;

use crate::core::hash::HashSet;
use std::sync::Arc;
use std::time::Duration;

use log::{debug, info, warn};
use nostr::event::EventId;
use nostr::key::Keys;

use super::queue::{ForwardLimits, ForwardQueue, Offer, OkOutcome, Throttle};
use crate::core::auth::{
    auth_event, AuthLimits, AuthOutcome, AuthState, IgnoreReason, OnChallenge, WriteAction,
};
use crate::core::dedup::VerifiedSet;
use crate::core::keepalive::{Keepalive, KeepaliveAction};
use crate::core::message::{escape_for_log, parse_ok_frame, parse_relay_frame, Incoming};
use crate::core::relay_text::Prefix;
use crate::core::session::{Frame, MAX_RELAY_TEXT};
use crate::core::time::Time;
use crate::shared::RelayUrl;

/// How long the own relay may rate-limit our writes before a warning says so.
pub const THROTTLE_WARNING: Duration = Duration::from_secs(60);
/// How long `OK`s may wait unread while nothing else needs them (events are in flight, none
/// is waiting to be sent, the window has room): the next event's wake-up reads them, so a
/// stream of events costs one wake-up per event instead of two (decision 0064).
pub const OK_LINGER: Duration = Duration::from_millis(5);
/// How long events that arrive right after a write wait to go out together with the next
/// ones: each write to the own relay costs a system call and, on loopback, the own relay's
/// side of the TCP stack, so a stream of events is written in batches (decision 0064).
/// An event that arrives after a quiet moment (longer than this since the last write) is
/// written at once.
pub const WRITE_LINGER: Duration = Duration::from_millis(1);
/// Queued events that end a [`WRITE_LINGER`] early.
pub const WRITE_BATCH: usize = 32;
/// The longest a full window waits for `OK`s to gather before the slots they freed are
/// filled (`full_window_linger`).
pub const FULL_WINDOW_LINGER: Duration = Duration::from_millis(8);

/// Settings of a [`ForwardSession`].
#[derive(Debug, Clone)]
pub struct ForwardConfig {
    /// The own relay (the `relay` tag of AUTH events).
    pub url: RelayUrl,
    /// The queue's limits.
    pub limits: ForwardLimits,
    /// Key answering the own relay's NIP-42 challenges (none: they are ignored, and an
    /// `auth-required:` answer is an ordinary rejection).
    pub auth_keys: Option<Keys>,
    /// NIP-42 deadlines.
    pub auth_limits: AuthLimits,
    /// Ping interval.
    pub ping_interval: Duration,
    /// Pong deadline.
    pub pong_timeout: Duration,
    /// How long events arriving right after a write may wait for more ([`WRITE_LINGER`];
    /// zero: never held, as the simulated world wants).
    pub write_linger: Duration,
}

impl ForwardConfig {
    /// The engine's defaults for `url` and `limits`, without a key.
    pub fn new(url: RelayUrl, limits: ForwardLimits) -> ForwardConfig {
        ForwardConfig {
            url,
            limits,
            auth_keys: None,
            auth_limits: AuthLimits::default(),
            ping_interval: Duration::from_secs(30),
            pong_timeout: Duration::from_secs(20),
            write_linger: WRITE_LINGER,
        }
    }
}

/// Commands to a [`ForwardSession`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForwardControl {
    /// Re-offer the events the own relay rejected earlier that name one of these repository
    /// coordinates or root event ids (see [`ForwardQueue::retry_rejected`]).
    RetryRejected {
        /// Repository coordinates `30617:<pubkey>:<d>`.
        repos: Vec<String>,
        /// Root event ids.
        roots: Vec<EventId>,
    },
    /// Stop taking new work and flush what is queued (the caller keeps the deadline):
    /// nothing is held for a batch and every `OK` is read at once.
    Drain,
}

/// A frame to write to the own relay.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForwardTransmit {
    /// A text frame: `["EVENT",…]` or `["AUTH",…]`.
    Text(String),
    /// A websocket ping.
    Ping,
}

/// What happened, for the caller's counters and byte admissions.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForwardEvent {
    /// The own relay answered a write of `id` (an `OK`, or a set-aside after it).
    Answered {
        /// The event.
        id: EventId,
        /// What the answer meant.
        outcome: OkOutcome,
        /// From the write to the answer, for a final answer
        /// ([`OkOutcome::leaves_pipeline`]).
        latency: Option<Duration>,
    },
    /// Events resolved without an answer of their own: an offer that queued nothing (a copy),
    /// a retry whose event was stored or queued meanwhile.
    Settled(u64),
    /// Events unresolved again: set-aside ones back in the queue, rejected ones chosen for a
    /// retry.
    Reopened(u64),
    /// No pong in time: the connection is dead; reconnect.
    Dead,
}

impl OkOutcome {
    /// True when the event leaves the pipeline with this answer (stored, held, already
    /// there, rejected, set aside): its bytes are free.
    pub fn leaves_pipeline(&self) -> bool {
        matches!(
            self,
            OkOutcome::Stored
                | OkOutcome::Duplicate
                | OkOutcome::Purgatory
                | OkOutcome::Rejected(_)
                | OkOutcome::SetAside
        )
    }
}

/// What the forwarder's wait wakes on, besides commands and
/// [`ForwardSession::poll_timeout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    /// Wake on a new offer (`watches_events`).
    pub offers: bool,
    /// Wake on the own relay's frames; false while `OK`s may linger unread.
    pub frames: bool,
    /// Wait at most this long: the `OK`s read lazily are read then (`lazy_oks`).
    pub linger: Option<Duration>,
}

/// The forwarder's decisions: the queue, NIP-42, keep-alive, pauses and waits.
#[derive(Debug)]
pub struct ForwardSession {
    config: ForwardConfig,
    queue: ForwardQueue,
    auth: AuthState,
    /// The connection's keep-alive; `None` while disconnected.
    keepalive: Option<Keepalive>,
    /// The pong deadline passed as this turn began: dead unless a frame is read before the
    /// next turn (frames that arrived meanwhile are read first, as the loop always did).
    pong_overdue: bool,
    /// AUTH and ping frames to write.
    transmits: VecDeque<ForwardTransmit>,
    events: VecDeque<ForwardEvent>,
    /// True from the moment the queue was full until it regained
    /// [`ForwardQueue::resume_room`]: no offers are taken meanwhile.
    intake_paused: bool,
    draining: bool,
    /// Events may be handed out: from [`ForwardSession::handle_timeout`] to the first frame.
    send_phase: bool,
    /// Writes wait for a batch this turn ([`ForwardSession::hold_writes`]).
    held: bool,
    /// An event was handed out since the last [`ForwardSession::hold_writes`].
    wrote: bool,
    /// The warning of the current spell of `error:` answers was logged (one per spell).
    error_spell_warned: bool,
    /// The warning of the current spell of rate limiting was logged (one per spell).
    throttle_warned: bool,
    /// The first `purgatory:` answer was logged at info level (the rest go to debug).
    purgatory_logged: bool,
    /// Prefixes of rejections logged at info level (the rest of each go to debug).
    rejections_logged: Vec<Prefix>,
}

impl ForwardSession {
    /// A session with an empty queue, not connected.
    pub fn new(config: ForwardConfig) -> ForwardSession {
        ForwardSession {
            queue: ForwardQueue::new(config.limits),
            auth: AuthState::new(config.auth_keys.is_some(), config.auth_limits),
            config,
            keepalive: None,
            pong_overdue: false,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            intake_paused: false,
            draining: false,
            send_phase: false,
            held: false,
            wrote: false,
            error_spell_warned: false,
            throttle_warned: false,
            purgatory_logged: false,
            rejections_logged: Vec::new(),
        }
    }

    /// The queue (counters, backlog, throttle).
    pub fn queue(&self) -> &ForwardQueue {
        &self.queue
    }

    /// A connection to the own relay is open at `now`: fresh NIP-42 state and keep-alive.
    pub fn on_connected(&mut self, now: Time) {
        self.auth = AuthState::new(self.config.auth_keys.is_some(), self.config.auth_limits);
        self.keepalive = Some(Keepalive::new(
            now,
            self.config.ping_interval,
            self.config.pong_timeout,
        ));
        self.transmits.clear();
        self.pong_overdue = false;
        self.send_phase = false;
        self.held = false;
        self.wrote = false;
    }

    /// The connection is gone: everything in flight is sent again on the next one.
    pub fn on_disconnect(&mut self) {
        self.keepalive = None;
        self.transmits.clear();
        self.send_phase = false;
        self.queue.on_disconnect();
    }

    /// True while connected ([`ForwardSession::on_connected`] without a disconnect since).
    pub fn is_connected(&self) -> bool {
        self.keepalive.is_some()
    }

    /// Offers a checked event (its original JSON; `missing`: fetched after a reconciliation
    /// found the own relay without it, [`ForwardQueue::offer_missing`]). An offer that queues
    /// nothing settles the event's claim in `verified` at once ([`Offer::settle_claim`]) and
    /// is reported [`ForwardEvent::Settled`].
    pub fn offer(
        &mut self,
        id: EventId,
        raw: Arc<str>,
        missing: bool,
        verified: &VerifiedSet,
    ) -> Offer {
        let offer = if missing {
            self.queue.offer_missing(id, raw)
        } else {
            self.queue.offer(id, raw)
        };
        offer.settle_claim(&id, verified);
        if offer != Offer::Queued {
            self.events.push_back(ForwardEvent::Settled(1));
        }
        offer
    }

    /// True while no offers are taken: the queue is full, or was and has not regained
    /// [`ForwardQueue::resume_room`] yet. The relay threads then wait on the full channel and
    /// are resumed together once the own relay answered a batch, instead of one wake-up per
    /// `OK` (decision 0064).
    pub fn intake_paused(&mut self) -> bool {
        self.intake_paused = intake_paused(self.intake_paused, &self.queue);
        self.intake_paused
    }

    /// A command.
    pub fn handle_control(&mut self, c: ForwardControl) {
        match c {
            ForwardControl::Drain => self.draining = true,
            ForwardControl::RetryRejected { repos, roots } => {
                if self.queue.rejected_kept() == 0 {
                    // Nothing to retry: the hex set (one string per root id) is not built.
                    return;
                }
                let mut changed: HashSet<String> = repos.into_iter().collect();
                changed.extend(roots.iter().map(|id| id.to_hex()));
                let n = self.queue.retry_rejected(&changed) as u64;
                if n > 0 {
                    self.events.push_back(ForwardEvent::Reopened(n));
                }
            }
        }
    }

    /// True once [`ForwardControl::Drain`] arrived.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// True when nothing is queued, in flight or waiting to be retried.
    pub fn is_idle(&self) -> bool {
        self.queue.is_idle()
    }

    /// Begins a turn at `now`: overdue `OK`s re-queued, pauses that are over ended, events set
    /// aside back in the queue, NIP-42 and keep-alive deadlines handled (the connection is
    /// [`ForwardEvent::Dead`] when the pong deadline has passed at two turns in a row without
    /// a frame read between them), the throttle warning logged; opens the send phase.
    pub fn handle_timeout(&mut self, now: Time) {
        self.queue.handle_timeout(now);
        // Events set aside (resolved then) are back in the queue: unresolved until their
        // next answer, counted before it can arrive.
        let reopened = self.queue.take_reopened();
        if reopened > 0 {
            self.events.push_back(ForwardEvent::Reopened(reopened));
        }
        if self.auth.poll_timeout().is_some_and(|t| t <= now) {
            self.auth.handle_timeout(now);
            if self.auth.has_failed() {
                warn!("forwarder: the own relay asked for NIP-42 AUTH but did not complete it in time; its auth-required answers now count as rejections");
            }
        }
        if let Some(k) = self.keepalive.as_mut() {
            match k.poll(now) {
                KeepaliveAction::Idle => {}
                KeepaliveAction::SendPing => self.transmits.push_back(ForwardTransmit::Ping),
                KeepaliveAction::Dead if self.pong_overdue => {
                    warn!("forwarder: no pong from the own relay; reconnecting");
                    self.events.push_back(ForwardEvent::Dead);
                }
                KeepaliveAction::Dead => self.pong_overdue = true,
            }
        }
        self.warn_if_throttled(now);
        self.send_phase = true;
    }

    /// Whether this turn's writes wait for a batch, given how long ago events were last
    /// written (`since_write`, measured by the caller on a clock finer than [`Time`]; `None`:
    /// never): events were written less than the write linger ago, fewer than
    /// [`WRITE_BATCH`] wait, more can arrive (`offers_open`) and the session is not
    /// draining. Returns how long they may still wait; `None`: write now.
    pub fn hold_writes(
        &mut self,
        since_write: Option<Duration>,
        offers_open: bool,
    ) -> Option<Duration> {
        let waiting = self.queue.backlog() - self.queue.in_flight();
        let left = since_write.and_then(|s| self.config.write_linger.checked_sub(s));
        let held = offers_open
            && !self.draining
            && waiting > 0
            && waiting < WRITE_BATCH
            && left.is_some_and(|l| !l.is_zero());
        self.held = held;
        self.wrote = false;
        held.then(|| left.unwrap_or_default())
    }

    /// True when an event was handed out since the last [`ForwardSession::hold_writes`].
    pub fn wrote(&self) -> bool {
        self.wrote
    }

    /// The next frame to write: AUTH and pings first, then, in the send phase, events while
    /// the window, a pace, NIP-42 and the batch hold allow.
    #[must_use]
    pub fn poll_transmit(&mut self, now: Time) -> Option<ForwardTransmit> {
        if let Some(t) = self.transmits.pop_front() {
            return Some(t);
        }
        if !self.is_connected() || !self.send_phase || self.held || self.auth.writes_paused() {
            return None;
        }
        let (_, raw) = self.queue.poll_send(now)?;
        self.wrote = true;
        Some(ForwardTransmit::Text(event_frame(&raw)))
    }

    /// True when the next turn can send at once, so the caller must not wait: events can be
    /// sent (the window has room, no pause), writes are not held for a batch and NIP-42 does
    /// not hold them back.
    pub fn sends_now(&self, now: Time) -> bool {
        !self.held && !self.auth.writes_paused() && self.queue.can_send(now)
    }

    /// What the caller's wait wakes on at `now`; `offers_open`: the offer channel still has
    /// senders.
    pub fn wait(&mut self, now: Time, offers_open: bool) -> Wait {
        let take = offers_open && !self.intake_paused();
        let linger = lazy_oks(&self.queue, take, &self.auth, self.draining, now);
        Wait {
            offers: watches_events(take, &self.queue),
            frames: linger.is_none(),
            linger,
        }
    }

    /// The earliest deadline: keep-alive, an overdue `OK`, the end of a pause, an event set
    /// aside, NIP-42.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        let keepalive = self.keepalive.as_ref().map(Keepalive::poll_timeout);
        [
            keepalive,
            self.queue.poll_timeout(),
            self.auth.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The next thing that happened.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<ForwardEvent> {
        // Retries that found their event handled meanwhile are resolved like an `OK`.
        let settled = self.queue.take_settled();
        if settled > 0 {
            self.events.push_back(ForwardEvent::Settled(settled));
        }
        self.events.pop_front()
    }

    /// A frame from the own relay at `now`; ends the send phase. `verified` learns what the
    /// own relay holds and what it rejected (the relay threads hand over its next copy).
    pub fn handle_frame(&mut self, now: Time, frame: Frame<'_>, verified: &VerifiedSet) {
        self.send_phase = false;
        self.pong_overdue = false;
        if let Some(k) = self.keepalive.as_mut() {
            k.on_activity();
        }
        let Frame::Text(text) = frame else {
            return;
        };
        // One `OK` per event written: most are read without the JSON parser.
        if let Some((event_id, accepted, message)) = parse_ok_frame(text) {
            self.on_ok(event_id, accepted, message, now, verified);
            return;
        }
        match parse_relay_frame(text) {
            Ok(Incoming::Ok {
                event_id,
                accepted,
                message,
            }) => self.on_ok(event_id, accepted, &message, now, verified),
            Ok(Incoming::Notice(n)) => info!(
                "own relay NOTICE (forwarder): {}",
                escape_for_log(&n, MAX_RELAY_TEXT)
            ),
            Ok(Incoming::Auth(challenge)) => self.on_challenge(&challenge, now),
            Ok(other) => debug!(
                "forwarder: ignoring {}",
                escape_for_log(&format!("{other:?}"), MAX_RELAY_TEXT)
            ),
            Err(e) => debug!("forwarder: unreadable frame from the own relay: {e}"),
        }
    }

    /// Answers the own relay's challenge (NIP-42).
    fn on_challenge(&mut self, challenge: &str, now: Time) {
        match self.auth.on_challenge(challenge, now) {
            OnChallenge::Sign { challenge } => {
                let Some(keys) = &self.config.auth_keys else {
                    return;
                };
                match auth_event(keys, &self.config.url, &challenge, now) {
                    Ok((id, text)) => {
                        debug!("forwarder: answering the own relay's AUTH challenge ({id})");
                        self.auth.auth_sent(id, now);
                        self.transmits.push_back(ForwardTransmit::Text(text));
                    }
                    Err(e) => {
                        warn!("forwarder: cannot sign the NIP-42 AUTH event: {e}");
                        self.auth.sign_failed();
                    }
                }
            }
            OnChallenge::Ignore(IgnoreReason::NoKey) => info!(
                "own relay sent an AUTH challenge to the forwarder; no key is configured (see --nsec-file)"
            ),
            OnChallenge::Ignore(other) => debug!("forwarder: AUTH challenge ignored ({other:?})"),
        }
    }

    /// The own relay's answer to one write.
    fn on_ok(
        &mut self,
        id: EventId,
        accepted: bool,
        message: &str,
        now: Time,
        verified: &VerifiedSet,
    ) {
        match self.auth.on_ok(&id, accepted, message) {
            Some(AuthOutcome::Authenticated { .. }) => {
                let who = self
                    .config
                    .auth_keys
                    .as_ref()
                    .map(|k| k.public_key().to_hex())
                    .unwrap_or_default();
                info!("forwarder: authenticated to the own relay (NIP-42) as {who}");
                return;
            }
            Some(AuthOutcome::Failed { reason, .. }) => {
                warn!("forwarder: the own relay refused our NIP-42 AUTH ({reason:?}); its auth-required answers count as rejections on this connection");
                return;
            }
            None => {}
        }
        let sent = self.queue.sent_at(&id);
        let throttled_before = self.queue.throttle().is_some();
        // The one reading of the answer's NIP-01 prefix.
        let prefix = Prefix::of(message);
        let outcome = if !accepted
            && prefix == Prefix::AuthRequired
            && self.auth.on_write_auth_required(now) == WriteAction::Retry
        {
            self.queue.requeue_auth_required(id)
        } else {
            self.queue.on_ok(id, accepted, prefix, now)
        };
        let latency = match outcome {
            OkOutcome::Stored
            | OkOutcome::Duplicate
            | OkOutcome::Purgatory
            | OkOutcome::Rejected(_) => sent.map(|s| now.since(s)),
            _ => None,
        };
        match outcome {
            // No longer in flight: a reconciliation's fetch forwards its next copy.
            OkOutcome::Stored | OkOutcome::Duplicate | OkOutcome::Purgatory => {
                verified.mark_stored(&id)
            }
            // Given up: the next copy from a remote relay is handed over again.
            OkOutcome::Rejected(_) => verified.release_forward(&id),
            _ => {}
        }
        let throttle_began = !throttled_before && self.queue.throttle().is_some();
        self.log_outcome(id, message, &outcome, throttle_began);
        self.events.push_back(ForwardEvent::Answered {
            id,
            outcome,
            latency,
        });
    }

    fn log_outcome(&mut self, id: EventId, message: &str, outcome: &OkOutcome, began: bool) {
        // Escaped only for the answers that log it (not once per stored event).
        let message = || escape_for_log(message, MAX_RELAY_TEXT);
        match outcome {
            OkOutcome::Stored => {
                self.error_spell_warned = false;
                debug!("own relay stored {id}")
            }
            OkOutcome::Duplicate => debug!("own relay already had {id}"),
            OkOutcome::Purgatory if !std::mem::replace(&mut self.purgatory_logged, true) => info!(
                "own relay took {id} into purgatory ({}): it serves it once its git data arrives, which the own relay fetches, not grasp-sync; not sent again (counted in forward_purgatory_total; further ones at debug level)",
                message()
            ),
            OkOutcome::Purgatory => debug!("own relay took {id} into purgatory ({})", message()),
            OkOutcome::RateLimited if began => info!(
                "own relay rate-limits writes ({}); sending at the pace it accepts (a warning follows if this lasts a minute)",
                message()
            ),
            OkOutcome::RateLimited => debug!("own relay rate-limited {id} ({})", message()),
            OkOutcome::RelayError if !std::mem::replace(&mut self.error_spell_warned, true) => warn!(
                "own relay failed to store {id} ({}); it and whatever else fails is sent again, after pauses that grow while the failures last (never given up; counted in forward_relay_errors_total)",
                message()
            ),
            OkOutcome::RelayError => debug!(
                "own relay failed to store {id} ({}), {} failures in a row",
                message(),
                self.queue.errors_in_a_row()
            ),
            // Resolved for now: it holds back no state save, `--once` or stop; its bytes
            // leave the pipeline.
            OkOutcome::SetAside => warn!(
                "own relay failed to store {id} {} times ({}); set aside, sent again every {} min (counted in forward_set_aside_total)",
                super::MAX_ERROR_ROUNDS,
                message(),
                super::ASIDE_RETRY.as_secs() / 60
            ),
            OkOutcome::AuthRequired => {
                debug!("own relay wants NIP-42 AUTH for {id}; sent again once authenticated")
            }
            // Mirroring foreign announcements into a GRASP relay is rejected a lot: the first
            // of each reason at info level, the rest at debug (all counted).
            OkOutcome::Rejected(prefix) if !self.rejections_logged.contains(prefix) => {
                self.rejections_logged.push(*prefix);
                info!("own relay rejected {id}: {} (further rejections of this kind are logged at debug level and counted)", message())
            }
            OkOutcome::Rejected(_) => debug!("own relay rejected {id}: {}", message()),
            OkOutcome::Unexpected => debug!("unexpected OK for {id}"),
        }
    }

    /// Warns once per spell when the own relay has rate-limited our writes for more than
    /// [`THROTTLE_WARNING`]: which relay, what it accepts, how long the backlog takes at that
    /// rate, and where the fix is documented.
    fn warn_if_throttled(&mut self, now: Time) {
        let Some(t) = self.queue.throttle() else {
            self.throttle_warned = false;
            return;
        };
        if now.since(t.since) < THROTTLE_WARNING
            || std::mem::replace(&mut self.throttle_warned, true)
        {
            return;
        }
        warn!(
            "{}",
            throttle_warning(&self.config.url, &t, self.queue.backlog(), now)
        );
    }
}

/// The warning of an own relay that has rate-limited our writes since `t.since`: which relay,
/// what it stored meanwhile and at what rate, how long `waiting` events take at that rate,
/// and where the fix is documented.
pub(crate) fn throttle_warning(url: &RelayUrl, t: &Throttle, waiting: usize, now: Time) -> String {
    let rate = t.per_minute(now);
    let eta = if rate > 0.0 {
        format!("about {:.0} minutes", waiting as f64 / rate)
    } else {
        "an unknown time".to_string()
    };
    format!(
        "own relay {url} has rate-limited our writes for {} s: it stored {} events in that time ({rate:.1} a minute); {waiting} events wait, {eta} at this rate. Exempt grasp-sync's address from the relay's write rate limit: see docs/operations.md, \"Own relay write limits\"",
        now.since(t.since).as_secs(),
        t.stored
    )
}

/// Whether no offers are taken now, `was` saying whether none were before: the queue is
/// full, or was and has not regained [`ForwardQueue::resume_room`] yet.
pub(crate) fn intake_paused(was: bool, queue: &ForwardQueue) -> bool {
    queue.is_full() || (was && queue.room() < queue.resume_room())
}

/// How long the forwarder may wait without waking on the own relay's bytes, if it may: when
/// events are in flight and their `OK`s are not needed at once, they are read in batches.
///
/// * Nothing waits to be sent and the window has room: the next event's turn reads them, or
///   the end of [`OK_LINGER`].
/// * The window is full and events wait: the own relay has a window's worth of work; the
///   `OK`s that arrive within [`full_window_linger`] are read together and their slots
///   filled in one write, instead of one wake-up and one write per `OK`.
///
/// Never while authenticating, draining, retrying, paused or with an `OK` overdue.
pub(crate) fn lazy_oks(
    queue: &ForwardQueue,
    take_events: bool,
    auth: &AuthState,
    draining: bool,
    now: Time,
) -> Option<Duration> {
    let calm = !draining
        && !auth.writes_paused()
        && auth.poll_timeout().is_none()
        && queue.in_flight() > 0
        && queue.retrying() == 0
        && queue.poll_timeout().is_some_and(|t| t > now);
    if !calm {
        return None;
    }
    let waiting = queue.backlog() - queue.in_flight();
    if waiting == 0 && take_events && queue.window_open(now) {
        Some(OK_LINGER)
    } else if waiting > 0 && queue.window_full() {
        Some(full_window_linger(queue.recent_ok_latency()))
    } else {
        None
    }
}

/// Whether the forwarder's wait wakes on a new event: when it may take events at all
/// (`take_events`), unless the window is full and events wait already. Such a window needs
/// no new event before its `OK`s; new ones stay in the channel until the next turn
/// (decision 0092).
pub(crate) fn watches_events(take_events: bool, queue: &ForwardQueue) -> bool {
    let window_busy = queue.window_full() && queue.backlog() > queue.in_flight();
    take_events && !window_busy
}

/// How long a full window with events waiting lets the own relay's `OK`s gather before the
/// freed slots are filled: a quarter of its recent `OK` latency (`ok_latency`, about the time
/// it takes for a window of events), so three quarters of the window stay with the relay,
/// within [`WRITE_LINGER`]..=[`FULL_WINDOW_LINGER`]. A relay that stores a thousand events a
/// second (nostr-rs-relay) answered one `OK` per wake-up with a fixed millisecond: the
/// forwarder's wake-ups cost more than everything else it did (decision 0092).
pub(crate) fn full_window_linger(ok_latency: Option<Duration>) -> Duration {
    ok_latency.map_or(WRITE_LINGER, |l| {
        (l / 4).clamp(WRITE_LINGER, FULL_WINDOW_LINGER)
    })
}

/// `["EVENT",<raw>]` in one allocation of the exact size.
pub(crate) fn event_frame(raw: &str) -> String {
    let mut frame = String::with_capacity(raw.len() + 10);
    frame.push_str("[\"EVENT\",");
    frame.push_str(raw);
    frame.push(']');
    frame
}
