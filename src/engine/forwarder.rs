//! The forwarder: one connection to the own relay that publishes checked events as their
//! original JSON and reads the `OK`s. All decisions live in [`ForwardQueue`]; this thread
//! moves bytes. When the queue is full it stops taking events from the relay threads, which
//! then block: remote reading pauses instead of dropping.
//!
//! NIP-42: with a key configured, the own relay's challenge is answered; an EVENT refused with
//! `auth-required:` is re-queued (not counted as rejected) and sending pauses until the relay
//! accepted our AUTH event. Without a key, or once authentication failed, such an answer is an
//! ordinary rejection.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Select, Sender, TryRecvError};
use log::{debug, info, warn};
use nostr::event::EventId;
use nostr::key::Keys;
use tungstenite::Message;

use crate::core::auth::auth_event;
use crate::core::auth::{
    AuthLimits, AuthOutcome, AuthState, IgnoreReason, OnChallenge, WriteAction,
};
use crate::core::dedup::ForwardGate;
use crate::core::dedup::IdMap;
use crate::core::forward::{ForwardLimits, ForwardQueue, Offer, OkOutcome, Throttle};
use crate::core::health::{BackoffPolicy, Health, Jitter};
use crate::core::keepalive::{Keepalive, KeepaliveAction};
use crate::core::message::escape_for_log;
use crate::core::message::{parse_ok_frame, parse_relay_frame, Incoming};
use crate::core::relay_text::Prefix;
use crate::core::session::Forward;
use crate::core::session::MAX_RELAY_TEXT;
use crate::core::sync::Report;
use crate::core::time::{Clock, Time};
use crate::engine::connection::write_text;
use crate::engine::metrics::{ByteAdmission, Metrics};
use crate::engine::Input;
use crate::net::ws::{self, WsOptions};
use crate::shared::RelayUrl;

/// A checked event on its way into the own relay.
#[derive(Debug)]
pub struct ForwardItem {
    /// Event id.
    pub id: EventId,
    /// The event's JSON exactly as the remote relay sent it.
    pub raw: Arc<str>,
    /// Its bytes' place in the pipeline's byte bound; released when the event is resolved.
    pub admission: Option<ByteAdmission>,
    /// Fetched by `ids` after a NIP-77 reconciliation found the own relay without it: the
    /// forwarder sends it even if it remembers an earlier `OK` for it
    /// ([`ForwardQueue::offer_missing`](crate::core::forward::ForwardQueue::offer_missing)).
    pub missing: bool,
}

impl From<Forward> for ForwardItem {
    fn from(f: Forward) -> ForwardItem {
        ForwardItem {
            id: f.id,
            raw: f.raw,
            admission: None,
            missing: f.missing,
        }
    }
}

/// Name of the thread reading the own relay connection for the forwarder.
/// The warning of an own relay that has rate-limited our writes since `t.since`: which relay,
/// what it stored meanwhile and at what rate, how long `waiting` events take at that rate,
/// and where the fix is documented.
fn throttle_warning(url: &RelayUrl, t: &Throttle, waiting: usize, now: Time) -> String {
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

/// Where the own relay's current spells of failures stand, for the log lines of an `OK`.
#[derive(Debug, Clone, Copy)]
struct Spell {
    /// Rounds of `error:` answers in a row.
    errors_in_a_row: u32,
    /// This answer began a spell of rate limiting.
    throttle_began: bool,
}

/// How long the own relay may rate-limit our writes before a warning says so.
pub(crate) const THROTTLE_WARNING: Duration = Duration::from_secs(60);

pub(crate) const READER_THREAD: &str = "forwarder-read";
/// The longest wait without a deadline: a safety net, not a tick (every input wakes the
/// forwarder at once).
const MAX_WAIT: Duration = Duration::from_secs(1);
/// The wait before retrying a write the own relay did not take in time, or a back-pressure
/// report the coordinator's full channel refused.
const RETRY_WAIT: Duration = Duration::from_millis(50);
/// How long `OK`s may wait unread while nothing else needs them (events are in flight, none
/// is waiting to be sent, the window has room): the next event's wake-up reads them, so a
/// stream of events costs one wake-up per event instead of two (decision 0064).
pub(crate) const OK_LINGER: Duration = Duration::from_millis(5);
/// How long events that arrive right after a write wait to go out together with the next
/// ones: each write to the own relay costs a system call and, on loopback, the own relay's
/// side of the TCP stack, so a stream of events is written in batches (decision 0064).
/// An event that arrives after a quiet moment (longer than this since the last write) is
/// written at once.
pub(crate) const WRITE_LINGER: Duration = Duration::from_millis(1);
/// How long the reader of the own relay connection waits after a read that drained the
/// socket: the own relay answers each event with its own `OK` frame, so a stream of events
/// would otherwise wake the reader and the forwarder once per event (decision 0066).
/// The first frame after a quiet moment is passed on at once.
pub(crate) const READ_LINGER: Duration = Duration::from_millis(1);
/// Frames from the own relay read in one turn before the freed slots are filled.
const READ_BATCH: usize = 256;
/// Queued events that end a [`WRITE_LINGER`] early.
pub(crate) const WRITE_BATCH: usize = 32;
/// The longest a full window waits for `OK`s to gather before the slots they freed are
/// filled ([`full_window_linger`]).
pub(crate) const FULL_WINDOW_LINGER: Duration = Duration::from_millis(8);

/// What a turn of the forwarder's loop leaves to its wait.
#[derive(Debug, Clone, Copy)]
struct Left {
    /// The own relay did not take every byte within the write timeout.
    unflushed: bool,
    /// Events wait for the batch until then (see [`write_held`]).
    held: Option<std::time::Instant>,
}

/// Which of the forwarder's channels still have senders.
#[derive(Debug, Clone, Copy)]
struct Open {
    events: bool,
    control: bool,
}

/// Commands to the forwarder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ForwarderControl {
    /// Re-offer the events the own relay rejected earlier that name one of these repository
    /// coordinates or root event ids (see [`ForwardQueue::retry_rejected`]).
    RetryRejected {
        /// Repository coordinates `30617:<pubkey>:<d>`.
        repos: Vec<String>,
        /// Root event ids.
        roots: Vec<nostr::event::EventId>,
    },
    /// Stop taking new work and end once everything received is answered by the own relay
    /// (or at the deadline): the relay threads have already stopped, so the channel holds
    /// all that is left.
    Drain(std::time::Instant),
    /// Test hook: panic in the forwarder thread (to test that the coordinator restarts it).
    #[cfg(feature = "testing")]
    Panic,
}

/// The byte admissions a forwarder holds. A clone (a restarted forwarder) starts empty: the
/// old thread's admissions are released when its copy is dropped.
#[derive(Debug, Default)]
pub(crate) struct Admissions(RefCell<IdMap<ByteAdmission>>);

impl Clone for Admissions {
    fn clone(&self) -> Self {
        Admissions::default()
    }
}

impl std::ops::Deref for Admissions {
    type Target = RefCell<IdMap<ByteAdmission>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// Everything the forwarder thread needs (cloned to restart a forwarder that died).
#[derive(Clone)]
pub(crate) struct Forwarder {
    /// The own relay.
    pub url: RelayUrl,
    /// Checked events in.
    pub events: Receiver<ForwardItem>,
    /// Commands in.
    pub control: Receiver<ForwarderControl>,
    /// Limits.
    pub limits: ForwardLimits,
    /// Websocket options.
    pub ws: WsOptions,
    /// TLS trust for `wss://` and NIP-11 over `https://`.
    pub tls: std::sync::Arc<rustls::ClientConfig>,
    /// Reconnect backoff.
    pub backoff: BackoffPolicy,
    /// Ping interval.
    pub ping_interval: Duration,
    /// Pong deadline.
    pub pong_timeout: Duration,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Which checked events the relay threads hand over (a rejected event is released).
    pub gate: Arc<ForwardGate>,
    /// The drain deadline, once [`ForwarderControl::Drain`] arrived.
    pub drain: std::cell::Cell<Option<std::time::Instant>>,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// Jitter seed.
    pub seed: u64,
    /// Key answering the own relay's NIP-42 AUTH challenges (none: they are ignored).
    pub auth_keys: Option<Keys>,
    /// Reports to the coordinator (back-pressure transitions).
    pub reports: Sender<Input>,
    /// Byte admissions of the queued and in-flight events, released when each is resolved.
    pub(crate) admissions: Admissions,
    /// True from the moment the queue was full until it regained
    /// [`ForwardQueue::resume_room`]: no events are taken meanwhile.
    pub(crate) intake_paused: std::cell::Cell<bool>,
    /// The warning of the current spell of `error:` answers was logged (one per spell).
    pub(crate) error_spell_warned: std::cell::Cell<bool>,
    /// The warning of the current spell of rate limiting was logged (one per spell).
    pub(crate) throttle_warned: std::cell::Cell<bool>,
    /// The first `purgatory:` answer was logged at info level (the rest go to debug).
    pub(crate) purgatory_logged: std::cell::Cell<bool>,
}

impl Forwarder {
    /// Runs until shut down.
    pub(crate) fn run(self) {
        let mut queue = ForwardQueue::new(self.limits);
        let mut health = Health::default();
        let mut jitter = Jitter::new(self.seed);
        let mut logged_down = false;
        loop {
            if self.drained(&queue) {
                break;
            }
            match ws::connect_checked(&self.url, &self.ws, &self.tls, &|_| Ok(())) {
                Ok(mut socket) => {
                    health.record_success(self.clock.now());
                    info!("forwarder connected to the own relay {}", self.url);
                    logged_down = false;
                    self.metrics.forward.connected.store(1, Ordering::Relaxed);
                    let stop = self.session(&mut socket, &mut queue);
                    self.metrics.forward.connected.store(0, Ordering::Relaxed);
                    queue.on_disconnect();
                    self.publish_counters(&mut queue);
                    if stop {
                        let _ = socket.close(None);
                        let _ = socket.flush();
                        break;
                    }
                    health.record_failure(self.clock.now(), &self.backoff);
                }
                Err(e) => {
                    health.record_failure(self.clock.now(), &self.backoff);
                    if !logged_down {
                        warn!("forwarder cannot reach the own relay {}: {e}", self.url);
                        logged_down = true;
                    } else {
                        debug!("forwarder: own relay still unreachable: {e}");
                    }
                }
            }
            let now = self.clock.now();
            let wait = health
                .next_attempt(now, &self.backoff, jitter.unit())
                .since(now)
                .min(Duration::from_secs(30));
            if self.wait(wait, &mut queue) {
                break;
            }
        }
        debug!("forwarder ends");
    }

    /// Waits `d` while taking events into the queue (until it is full). True on shutdown.
    fn wait(&self, d: Duration, queue: &mut ForwardQueue) -> bool {
        let end = std::time::Instant::now() + d;
        loop {
            if let Ok(c) = self.control.try_recv() {
                self.control_message(c, queue);
            }
            if self
                .drain
                .get()
                .is_some_and(|d| std::time::Instant::now() >= d)
            {
                // Draining, and the own relay is unreachable: what is left stays on the
                // remote relays for the next start.
                return true;
            }
            let _ = self.take_events(queue);
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }

    fn control_message(&self, c: ForwarderControl, queue: &mut ForwardQueue) {
        match c {
            ForwarderControl::Drain(deadline) => {
                info!(
                    "forwarder: flushing {} queued events into the own relay before stopping",
                    queue.backlog() + self.events.len()
                );
                self.drain.set(Some(deadline));
            }
            ForwarderControl::RetryRejected { repos, roots } => {
                self.retry_rejected(queue, repos, &roots)
            }
            #[cfg(feature = "testing")]
            ForwarderControl::Panic => panic!("forwarder: panic injected by a test"),
        }
    }

    /// True once draining is finished: everything received was answered, or the deadline
    /// passed.
    fn drained(&self, queue: &ForwardQueue) -> bool {
        self.drain.get().is_some_and(|d| {
            let done = queue.is_idle() && self.events.is_empty();
            if !done && std::time::Instant::now() >= d {
                warn!(
                    "forwarder: stop deadline reached with {} events not yet stored; they stay on the remote relays for the next start",
                    queue.backlog() + self.events.len()
                );
            }
            done || std::time::Instant::now() >= d
        })
    }

    /// Takes events from the channel until it is empty or the queue is full. False when the
    /// channel is closed (every sender is gone) and empty.
    fn take_events(&self, queue: &mut ForwardQueue) -> bool {
        let mut open = true;
        while !self.intake_paused(queue) {
            match self.events.try_recv() {
                Ok(item) => self.offer(queue, item),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        self.report_back_pressure(self.intake_paused(queue));
        open
    }

    /// True while no events are taken: the queue is full, or was and has not regained
    /// [`ForwardQueue::resume_room`] yet. The relay threads then wait on the full channel and
    /// are resumed together once the own relay answered a batch, instead of one wake-up per
    /// `OK` (each costs a futex wake here and a wait there; decision 0064).
    fn intake_paused(&self, queue: &ForwardQueue) -> bool {
        let paused = intake_paused(self.intake_paused.get(), queue);
        self.intake_paused.set(paused);
        paused
    }

    /// Tells the coordinator when the queue becomes full or has room again (the relay
    /// threads then wait, and EOSE deadlines must not count meanwhile).
    fn report_back_pressure(&self, full: bool) {
        let flag = &self.metrics.forward.full;
        let was = flag.swap(u64::from(full), Ordering::Relaxed) == 1;
        if was == full {
            return;
        }
        let report = Input::Report(Report::ForwardBackPressure { active: full });
        if self.reports.try_send(report).is_err() {
            // The coordinator's channel is full: try again on the next turn.
            flag.store(u64::from(was), Ordering::Relaxed);
        }
    }

    fn offer(&self, queue: &mut ForwardQueue, item: ForwardItem) {
        let offer = if item.missing {
            queue.offer_missing(item.id, item.raw)
        } else {
            queue.offer(item.id, item.raw)
        };
        offer.settle_claim(&item.id, self.gate.verified());
        if offer != Offer::Queued {
            // A copy: its admission is dropped (released) here.
            self.resolved();
        } else if let Some(a) = item.admission {
            self.admissions.borrow_mut().insert(item.id, a);
        }
    }

    fn retry_rejected(
        &self,
        queue: &mut ForwardQueue,
        repos: Vec<String>,
        roots: &[nostr::event::EventId],
    ) {
        if queue.rejected_kept() == 0 {
            // Nothing to retry: the hex set (one string per root id) is not built.
            return;
        }
        let mut changed: std::collections::HashSet<String> = repos.into_iter().collect();
        changed.extend(roots.iter().map(|id| id.to_hex()));
        let n = queue.retry_rejected(&changed) as u64;
        // Re-queued events are unresolved again until the own relay answers.
        self.metrics
            .forward
            .unresolved
            .fetch_add(n, Ordering::Relaxed);
    }

    /// Warns once per spell when the own relay has rate-limited our writes for more than
    /// [`THROTTLE_WARNING`]: which relay, what it accepts, how long the backlog takes at that
    /// rate, and where the fix is documented.
    fn warn_if_throttled(&self, throttle: Option<Throttle>, waiting: usize, now: Time) {
        let Some(t) = throttle else {
            self.throttle_warned.set(false);
            return;
        };
        if now.since(t.since) < THROTTLE_WARNING || self.throttle_warned.replace(true) {
            return;
        }
        warn!("{}", throttle_warning(&self.url, &t, waiting, now));
    }

    fn resolved(&self) {
        let u = &self.metrics.forward.unresolved;
        let _ = u.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_sub(1))
        });
    }

    fn publish_counters(&self, queue: &mut ForwardQueue) {
        // Retries that found their event handled meanwhile are resolved like an `OK`.
        for _ in 0..queue.take_settled() {
            self.resolved();
        }

        let c = queue.counters();
        let f = &self.metrics.forward;
        f.stored.store(c.stored, Ordering::Relaxed);
        f.duplicates.store(c.duplicates, Ordering::Relaxed);
        f.purgatory.store(c.purgatory, Ordering::Relaxed);
        f.rejected.store(c.rejected, Ordering::Relaxed);
        f.resent.store(c.resent, Ordering::Relaxed);
        f.relay_errors.store(c.relay_errors, Ordering::Relaxed);
        f.rate_limited.store(c.rate_limited, Ordering::Relaxed);
        f.set_aside.store(c.set_aside, Ordering::Relaxed);
        f.aside.store(queue.aside() as u64, Ordering::Relaxed);
        f.aside_overflow.store(c.aside_overflow, Ordering::Relaxed);
        let throttle = queue.throttle();
        let pace = throttle.map_or(0, |t| t.pace.as_millis() as u64);
        f.pace_ms.store(pace, Ordering::Relaxed);
        self.warn_if_throttled(throttle, queue.backlog(), self.clock.now());
        f.deduplicated.store(c.deduplicated, Ordering::Relaxed);
        f.queue_depth
            .store(queue.backlog() as u64, Ordering::Relaxed);
    }

    /// One connection. Returns true on shutdown, false when the connection was lost.
    ///
    /// The socket's reads run on a helper thread ([`ws::read_on_helper_thread`]), so the loop
    /// waits on the own relay's frames, the event channel and the control channel at once
    /// ([`Forwarder::wait_for_work`]): there is no tick; events and `OK`s are handled when
    /// they arrive, or gathered for at most a few milliseconds where batching saves wake-ups
    /// ([`WRITE_LINGER`], [`OK_LINGER`], [`full_window_linger`]).
    fn session(&self, socket: &mut ws::Socket, queue: &mut ForwardQueue) -> bool {
        let mut keepalive = Keepalive::new(self.clock.now(), self.ping_interval, self.pong_timeout);
        let mut auth = AuthState::new(self.auth_keys.is_some(), AuthLimits::default());
        if let Err(e) = ws::read_on_helper_thread(socket, READER_THREAD.into(), READ_LINGER) {
            warn!("forwarder: cannot start the reader thread of the own relay connection: {e}");
            return false;
        }
        let mut open = Open {
            events: true,
            control: true,
        };
        // When events were last written: events arriving within [`WRITE_LINGER`] of it wait
        // to be written together.
        let mut last_write: Option<std::time::Instant> = None;
        loop {
            loop {
                match self.control.try_recv() {
                    Ok(c) => self.control_message(c, queue),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open.control = false;
                        break;
                    }
                }
            }
            if self.drained(queue) {
                return true;
            }
            if !self.take_events(queue) {
                open.events = false;
                if queue.is_idle() {
                    // The engine is gone and nothing is left to store.
                    return true;
                }
            }
            let now = self.clock.now();
            queue.handle_timeout(now);
            // Events set aside (resolved then) are back in the queue: unresolved until their
            // next answer, counted before it can arrive.
            let reopened = queue.take_reopened();
            if reopened > 0 {
                self.metrics
                    .forward
                    .unresolved
                    .fetch_add(reopened, Ordering::Relaxed);
            }
            if auth.poll_timeout().is_some_and(|t| t <= now) {
                auth.handle_timeout(now);
                if auth.has_failed() {
                    warn!("forwarder: the own relay asked for NIP-42 AUTH but did not complete it in time; its auth-required answers now count as rejections");
                }
            }
            let held = write_held(
                queue,
                last_write,
                self.drain.get().is_some(),
                open.events,
                std::time::Instant::now(),
            );
            let mut wrote = false;
            while !auth.writes_paused() && held.is_none() {
                let Some((_, raw)) = queue.poll_send(now) else {
                    break;
                };
                if let Err(e) = write_text(socket, event_frame(&raw)) {
                    warn!("forwarder: write to the own relay failed: {e}");
                    return false;
                }
                wrote = true;
            }
            if wrote {
                last_write = Some(std::time::Instant::now());
            }
            let Some(mut unflushed) = self.flush(socket) else {
                return false;
            };
            // Read every frame that has arrived (reads never block here), at most
            // `READ_BATCH` per turn; the slots their OKs freed are filled in one write below
            // (one system call for the batch, not one per OK).
            let mut more = false;
            let mut frames = 0;
            // One reading for the frames of this turn (they are read without blocking).
            let read_at = self.clock.now();
            loop {
                if frames == READ_BATCH {
                    more = true;
                    break;
                }
                match socket.read() {
                    Ok(Message::Text(text)) => {
                        frames += 1;
                        keepalive.on_activity();
                        self.handle_text(text.as_str(), queue, &mut auth, socket, read_at);
                    }
                    Ok(Message::Close(_)) => {
                        warn!("forwarder: the own relay closed the connection");
                        return false;
                    }
                    Ok(_) => keepalive.on_activity(),
                    Err(e) if ws::is_timeout(&e) => break,
                    Err(e) => {
                        warn!("forwarder: own relay connection lost: {e}");
                        return false;
                    }
                }
            }
            // The OKs freed slots: send more now (not while NIP-42 holds writes back: the
            // loop would spin without sending; issue 36).
            if sends_now(
                held.is_some(),
                auth.writes_paused(),
                queue,
                self.clock.now(),
            ) {
                more = true;
            }
            match keepalive.poll(self.clock.now()) {
                KeepaliveAction::Idle => {}
                KeepaliveAction::SendPing => {
                    if socket.write(Message::Ping(Vec::new().into())).is_err() {
                        return false;
                    }
                }
                KeepaliveAction::Dead => {
                    warn!("forwarder: no pong from the own relay; reconnecting");
                    return false;
                }
            }
            // A ping, pong or AUTH written above goes out before the wait.
            match self.flush(socket) {
                Some(u) => unflushed |= u,
                None => return false,
            }
            self.publish_counters(queue);
            if !more {
                let left = Left { unflushed, held };
                self.wait_for_work(socket, queue, &keepalive, &auth, open, left);
            }
        }
    }

    /// Flushes the socket. `Some(true)` when the own relay did not take everything within the
    /// write timeout (the rest stays buffered), `None` when the connection is lost.
    fn flush(&self, socket: &mut ws::Socket) -> Option<bool> {
        match socket.flush() {
            Ok(()) => Some(false),
            Err(e) if ws::is_timeout(&e) => Some(true),
            Err(e) => {
                warn!("forwarder: own relay connection lost: {e}");
                None
            }
        }
    }

    /// Blocks until there is work: a frame (or the end of the connection) from the own relay,
    /// an event (while the queue has room and the window is not full with events waiting,
    /// [`watches_events`]), a command, or the next deadline (keepalive, an
    /// overdue `OK`, the end of a pause, NIP-42, the drain deadline). Nothing is taken here:
    /// the loop does that.
    fn wait_for_work(
        &self,
        socket: &ws::Socket,
        queue: &ForwardQueue,
        keepalive: &Keepalive,
        auth: &AuthState,
        open: Open,
        left: Left,
    ) {
        let Left { unflushed, held } = left;
        let now = self.clock.now();
        let mut deadline = keepalive.poll_timeout();
        if let Some(t) = queue.poll_timeout() {
            deadline = deadline.min(t);
        }
        if let Some(t) = auth.poll_timeout() {
            deadline = deadline.min(t);
        }
        let mut wait = deadline.since(now).min(MAX_WAIT);
        if let Some(d) = self.drain.get() {
            wait = wait.min(d.saturating_duration_since(std::time::Instant::now()));
        }
        let report_pending =
            (self.metrics.forward.full.load(Ordering::Relaxed) == 1) != self.intake_paused(queue);
        if unflushed || report_pending {
            // Retry the write or the back-pressure report soon.
            wait = wait.min(RETRY_WAIT);
        }
        let mut select = Select::new();
        if open.control {
            select.recv(&self.control);
        }
        if let Some(until) = held {
            // Writes wait for the batch: only a command ends the wait early.
            let left = until.saturating_duration_since(std::time::Instant::now());
            let _ = select.ready_timeout(wait.min(left));
            return;
        }
        let take_events = open.events && !self.intake_paused(queue);
        if watches_events(take_events, queue) {
            select.recv(&self.events);
        }
        if let Some(linger) = lazy_oks(queue, take_events, auth, self.drain.get().is_some(), now) {
            // Only OKs can be due, and nothing needs them at once: they are read after the
            // linger, or on the next event's turn.
            wait = wait.min(linger);
        } else if let Some(inbound) = ws::inbound(socket) {
            inbound.register(&mut select);
        }
        let _ = select.ready_timeout(wait);
    }

    /// Answers the own relay's challenge (NIP-42).
    fn on_challenge(&self, challenge: &str, auth: &mut AuthState, socket: &mut ws::Socket) {
        let now = self.clock.now();
        match auth.on_challenge(challenge, now) {
            OnChallenge::Sign { challenge } => {
                let Some(keys) = &self.auth_keys else {
                    return;
                };
                match auth_event(keys, &self.url, &challenge, now) {
                    Ok((id, text)) => {
                        debug!("forwarder: answering the own relay's AUTH challenge ({id})");
                        auth.auth_sent(id, now);
                        if let Err(e) = write_text(socket, text) {
                            debug!("forwarder: cannot send AUTH: {e}");
                        }
                    }
                    Err(e) => {
                        warn!("forwarder: cannot sign the NIP-42 AUTH event: {e}");
                        auth.sign_failed();
                    }
                }
            }
            OnChallenge::Ignore(IgnoreReason::NoKey) => info!(
                "own relay sent an AUTH challenge to the forwarder; no key is configured (see --nsec-file)"
            ),
            OnChallenge::Ignore(other) => debug!("forwarder: AUTH challenge ignored ({other:?})"),
        }
    }

    /// The own relay's answer to one write. `now` is read once per turn of reads.
    fn on_ok_frame(
        &self,
        event_id: EventId,
        accepted: bool,
        message: &str,
        queue: &mut ForwardQueue,
        auth: &mut AuthState,
        now: Time,
    ) {
        match auth.on_ok(&event_id, accepted, message) {
            Some(AuthOutcome::Authenticated { .. }) => {
                let who = self
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
        let sent = queue.sent_at(&event_id);
        let throttled_before = queue.throttle().is_some();
        // The one reading of the answer's NIP-01 prefix.
        let prefix = Prefix::of(message);
        let outcome = if !accepted
            && prefix == Prefix::AuthRequired
            && auth.on_write_auth_required(now) == WriteAction::Retry
        {
            queue.requeue_auth_required(event_id)
        } else {
            queue.on_ok(event_id, accepted, prefix, now)
        };
        if let (
            Some(sent),
            OkOutcome::Stored
            | OkOutcome::Duplicate
            | OkOutcome::Purgatory
            | OkOutcome::Rejected(_),
        ) = (sent, &outcome)
        {
            self.metrics.forward.ok_latency.observe(now.since(sent));
        }
        let spell = Spell {
            errors_in_a_row: queue.errors_in_a_row(),
            throttle_began: !throttled_before && queue.throttle().is_some(),
        };
        self.ok_outcome(event_id, message, outcome, spell);
    }

    fn handle_text(
        &self,
        text: &str,
        queue: &mut ForwardQueue,
        auth: &mut AuthState,
        socket: &mut ws::Socket,
        now: Time,
    ) {
        // One `OK` per event written: most are read without the JSON parser.
        if let Some((event_id, accepted, message)) = parse_ok_frame(text) {
            self.on_ok_frame(event_id, accepted, message, queue, auth, now);
            return;
        }
        match parse_relay_frame(text) {
            Ok(Incoming::Ok {
                event_id,
                accepted,
                message,
            }) => self.on_ok_frame(event_id, accepted, &message, queue, auth, now),
            Ok(Incoming::Notice(n)) => info!(
                "own relay NOTICE (forwarder): {}",
                escape_for_log(&n, MAX_RELAY_TEXT)
            ),
            Ok(Incoming::Auth(challenge)) => self.on_challenge(&challenge, auth, socket),
            Ok(other) => debug!(
                "forwarder: ignoring {}",
                escape_for_log(&format!("{other:?}"), MAX_RELAY_TEXT)
            ),
            Err(e) => debug!("forwarder: unreadable frame from the own relay: {e}"),
        }
    }

    fn ok_outcome(
        &self,
        event_id: nostr::event::EventId,
        message: &str,
        outcome: OkOutcome,
        spell: Spell,
    ) {
        let Spell {
            errors_in_a_row,
            throttle_began,
        } = spell;
        // Escaped only for the answers that log it (not once per stored event).
        let message = || escape_for_log(message, MAX_RELAY_TEXT);
        if matches!(
            outcome,
            OkOutcome::Stored
                | OkOutcome::Duplicate
                | OkOutcome::Purgatory
                | OkOutcome::Rejected(_)
        ) {
            // Out of the pipeline: its bytes are free again (a kept rejected event counts
            // against the rejected store's own byte bound).
            self.admissions.borrow_mut().remove(&event_id);
        }
        if matches!(
            outcome,
            OkOutcome::Stored | OkOutcome::Duplicate | OkOutcome::Purgatory
        ) {
            // No longer in flight: a reconciliation's fetch forwards its next copy.
            self.gate.verified().mark_stored(&event_id);
        }
        match outcome {
            OkOutcome::Stored => {
                self.error_spell_warned.set(false);
                self.resolved();
                debug!("own relay stored {event_id}")
            }
            OkOutcome::Duplicate => {
                self.resolved();
                debug!("own relay already had {event_id}")
            }
            OkOutcome::Purgatory if !self.purgatory_logged.replace(true) => {
                self.resolved();
                info!(
                    "own relay took {event_id} into purgatory ({}): it serves it once its git data arrives, which the own relay fetches, not grasp-sync; not sent again (counted in forward_purgatory_total; further ones at debug level)",
                    message()
                )
            }
            OkOutcome::Purgatory => {
                self.resolved();
                debug!("own relay took {event_id} into purgatory ({})", message())
            }
            OkOutcome::RateLimited if throttle_began => info!(
                "own relay rate-limits writes ({}); sending at the pace it accepts (a warning follows if this lasts a minute)",
                message()
            ),
            OkOutcome::RateLimited => debug!("own relay rate-limited {event_id} ({})", message()),
            OkOutcome::RelayError if !self.error_spell_warned.replace(true) => {
                warn!(
                    "own relay failed to store {event_id} ({}); it and whatever else fails is sent again, after pauses that grow while the failures last (never given up; counted in forward_relay_errors_total)",
                    message()
                )
            }
            OkOutcome::RelayError => {
                debug!(
                    "own relay failed to store {event_id} ({}), {errors_in_a_row} failures in a row",
                    message()
                )
            }
            OkOutcome::SetAside => {
                // Resolved for now: it holds back no state save, `--once` or stop; its bytes
                // leave the pipeline.
                self.admissions.borrow_mut().remove(&event_id);
                self.resolved();
                warn!(
                    "own relay failed to store {event_id} {} times ({}); set aside, sent again every {} min (counted in forward_set_aside_total)",
                    crate::core::forward::MAX_ERROR_ROUNDS,
                    message(),
                    crate::core::forward::ASIDE_RETRY.as_secs() / 60
                )
            }
            OkOutcome::AuthRequired => {
                debug!("own relay wants NIP-42 AUTH for {event_id}; sent again once authenticated")
            }
            OkOutcome::Rejected(prefix) => {
                self.resolved();
                // Given up: the next copy from a remote relay is handed over again.
                self.gate.verified().release_forward(&event_id);
                let slot = crate::engine::metrics::reject_reason_slot(prefix);
                let n =
                    self.metrics.forward.rejected_by_reason[slot].fetch_add(1, Ordering::Relaxed);
                let reason = message();
                // Mirroring foreign announcements into a GRASP relay is rejected a lot: the
                // first of each reason at info level, the rest at debug (all counted).
                if n == 0 {
                    info!("own relay rejected {event_id}: {reason} (further rejections of this kind are logged at debug level and counted)")
                } else {
                    debug!("own relay rejected {event_id}: {reason}")
                }
            }
            OkOutcome::Unexpected => debug!("unexpected OK for {event_id}"),
        }
    }
}

/// Whether the forwarder takes no events now, `was` saying whether it took none before: the
/// queue is full, or was and has not regained [`ForwardQueue::resume_room`] yet.
fn intake_paused(was: bool, queue: &ForwardQueue) -> bool {
    queue.is_full() || (was && queue.room() < queue.resume_room())
}

/// Until when queued events wait before they are written, if they do: events were written
/// less than [`WRITE_LINGER`] ago, fewer than [`WRITE_BATCH`] wait, more can arrive, and the
/// forwarder is not draining. `None`: write now.
fn write_held(
    queue: &ForwardQueue,
    last_write: Option<std::time::Instant>,
    draining: bool,
    events_open: bool,
    now: std::time::Instant,
) -> Option<std::time::Instant> {
    let until = last_write? + WRITE_LINGER;
    let waiting = queue.backlog() - queue.in_flight();
    (events_open && !draining && waiting > 0 && waiting < WRITE_BATCH && now < until)
        .then_some(until)
}

/// True when the forwarder's next turn can send at once, so it must not wait: events can be
/// sent (the window has room, no pause), writes are not held for a batch and NIP-42 does
/// not hold them back.
fn sends_now(held: bool, auth_paused: bool, queue: &ForwardQueue, now: Time) -> bool {
    !held && !auth_paused && queue.can_send(now)
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
fn lazy_oks(
    queue: &ForwardQueue,
    take_events: bool,
    auth: &AuthState,
    draining: bool,
    now: crate::core::time::Time,
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
fn watches_events(take_events: bool, queue: &ForwardQueue) -> bool {
    let window_busy = queue.window_full() && queue.backlog() > queue.in_flight();
    take_events && !window_busy
}

/// How long a full window with events waiting lets the own relay's `OK`s gather before the
/// freed slots are filled: a quarter of its recent `OK` latency (`ok_latency`, about the time
/// it takes for a window of events), so three quarters of the window stay with the relay,
/// within [`WRITE_LINGER`]..=[`FULL_WINDOW_LINGER`]. A relay that stores a thousand events a
/// second (nostr-rs-relay) answered one `OK` per wake-up with a fixed millisecond: the
/// forwarder's wake-ups cost more than everything else it did (decision 0092).
fn full_window_linger(ok_latency: Option<Duration>) -> Duration {
    ok_latency.map_or(WRITE_LINGER, |l| {
        (l / 4).clamp(WRITE_LINGER, FULL_WINDOW_LINGER)
    })
}

/// `["EVENT",<raw>]` in one allocation of the exact size.
fn event_frame(raw: &str) -> String {
    let mut frame = String::with_capacity(raw.len() + 10);
    frame.push_str("[\"EVENT\",");
    frame.push_str(raw);
    frame.push(']');
    frame
}

#[cfg(test)]
mod tests {
    use super::{
        full_window_linger, intake_paused, lazy_oks, throttle_warning, watches_events, write_held,
        FULL_WINDOW_LINGER, OK_LINGER, WRITE_BATCH, WRITE_LINGER,
    };
    use crate::core::auth::{AuthLimits, AuthState};
    use crate::core::forward::{ForwardLimits, ForwardQueue};
    use crate::core::relay_text::Prefix;
    use crate::core::time::Time;
    use nostr::event::EventId;
    use std::time::{Duration, Instant};

    fn id(n: u32) -> EventId {
        let mut b = [0u8; 32];
        b[..4].copy_from_slice(&n.to_le_bytes());
        EventId::from_byte_array(b)
    }

    fn queue(in_flight: usize, backlog: usize) -> ForwardQueue {
        ForwardQueue::new(ForwardLimits {
            in_flight,
            backlog,
            ok_timeout: Duration::from_secs(10),
            ..ForwardLimits::default()
        })
    }

    /// Offers events `from..to` and sends as many as the window takes at `now`.
    fn offer(q: &mut ForwardQueue, from: u32, to: u32, now: Time) {
        for n in from..to {
            q.offer(id(n), format!("{{\"n\":{n}}}").into());
        }
        while q.poll_send(now).is_some() {}
    }

    #[test]
    fn a_turn_does_not_repeat_at_once_while_nip42_holds_writes_back() {
        // Issue 36, item 3: `more` ignored the NIP-42 write pause: with events ready the
        // loop turned again at once without sending anything, for up to 20 s.
        let t = Time::from_secs(0);
        let mut q = queue(64, 4096);
        q.offer(id(1), "{}".into());
        assert!(super::sends_now(false, false, &q, t));
        assert!(
            !super::sends_now(false, true, &q, t),
            "writes held by NIP-42"
        );
        assert!(
            !super::sends_now(true, false, &q, t),
            "writes held for a batch"
        );
    }

    #[test]
    fn events_arriving_right_after_a_write_wait_for_the_batch() {
        let t = Time::from_secs(0);
        let now = Instant::now();
        let mut q = queue(64, 4096);
        // Nothing waits to be sent: nothing to hold.
        assert_eq!(write_held(&q, Some(now), false, true, now), None);
        for n in 0..3 {
            q.offer(id(n), "{}".into());
        }
        // Written 0.5 ms ago: the three wait until 1 ms after that write.
        let last = now - Duration::from_micros(500);
        assert_eq!(
            write_held(&q, Some(last), false, true, now),
            Some(last + WRITE_LINGER)
        );
        // After a quiet moment, never written, draining, or no more events coming: at once.
        let quiet = now - WRITE_LINGER - Duration::from_micros(1);
        assert_eq!(write_held(&q, Some(quiet), false, true, now), None);
        assert_eq!(write_held(&q, None, false, true, now), None);
        assert_eq!(write_held(&q, Some(last), true, true, now), None);
        assert_eq!(write_held(&q, Some(last), false, false, now), None);
        // A full batch goes out at once.
        offer(&mut q, 3, WRITE_BATCH as u32, t);
        assert_eq!(write_held(&q, Some(last), false, true, now), None);
        let mut full = queue(1, 4096);
        offer(&mut full, 0, WRITE_BATCH as u32 + 1, t);
        assert_eq!(full.backlog() - full.in_flight(), WRITE_BATCH);
        assert_eq!(write_held(&full, Some(last), false, true, now), None);
    }

    #[test]
    fn oks_are_read_lazily_only_while_nothing_needs_them() {
        let t = Time::from_secs(0);
        let auth = AuthState::new(false, AuthLimits::default());
        let mut q = queue(2, 4096);
        // Nothing in flight: the own relay's bytes wake the forwarder (NOTICE, AUTH, close).
        assert_eq!(lazy_oks(&q, true, &auth, false, t), None);
        // One in flight, nothing waiting, room in the window: the next event reads its OK.
        offer(&mut q, 0, 1, t);
        assert_eq!(lazy_oks(&q, true, &auth, false, t), Some(OK_LINGER));
        // No event can be taken, draining, or the OK overdue: wake on the OK.
        assert_eq!(lazy_oks(&q, false, &auth, false, t), None);
        assert_eq!(lazy_oks(&q, true, &auth, true, t), None);
        let late = Time::from_secs(11);
        assert_eq!(lazy_oks(&q, true, &auth, false, late), None);
        // The window full and events waiting: the OKs are read in batches, for a quarter of
        // the own relay's recent OK latency (none known yet: the shortest wait).
        offer(&mut q, 1, 4, t);
        assert!(q.window_full());
        assert_eq!(lazy_oks(&q, false, &auth, false, t), Some(WRITE_LINGER));
        let answered = t.plus(Duration::from_millis(20));
        assert_eq!(
            q.on_ok(id(0), true, Prefix::Other, answered),
            crate::core::forward::OkOutcome::Stored
        );
        assert!(q.poll_send(answered).is_some());
        assert!(q.window_full());
        assert_eq!(
            lazy_oks(&q, false, &auth, false, answered),
            Some(Duration::from_millis(5))
        );
        // The window full and nothing waiting: an OK lets the next event go at once.
        let mut q = queue(1, 4096);
        offer(&mut q, 0, 1, t);
        assert_eq!(lazy_oks(&q, true, &auth, false, t), None);
    }

    #[test]
    fn a_full_window_with_events_waiting_does_not_wake_on_new_events() {
        let t = Time::from_secs(0);
        let mut q = queue(2, 4096);
        assert!(watches_events(true, &q), "empty");
        assert!(
            !watches_events(false, &q),
            "intake paused or channel closed"
        );
        offer(&mut q, 0, 2, t);
        assert!(q.window_full());
        assert!(
            watches_events(true, &q),
            "full, nothing waiting: the next event goes next"
        );
        offer(&mut q, 2, 3, t);
        assert!(!watches_events(true, &q), "full with an event waiting");
        let _ = q.on_ok(id(0), true, Prefix::Other, t);
        assert!(watches_events(true, &q), "a slot free");
    }

    #[test]
    fn a_full_window_waits_a_quarter_of_the_ok_latency_within_bounds() {
        // Decision 0092: a relay storing a window in 64 ms gets its freed slots filled every
        // 8 ms, not every millisecond; a fast relay every millisecond as before.
        assert_eq!(full_window_linger(None), WRITE_LINGER);
        assert_eq!(
            full_window_linger(Some(Duration::from_millis(2))),
            WRITE_LINGER
        );
        assert_eq!(
            full_window_linger(Some(Duration::from_millis(20))),
            Duration::from_millis(5)
        );
        assert_eq!(
            full_window_linger(Some(Duration::from_millis(64))),
            FULL_WINDOW_LINGER
        );
        assert_eq!(
            full_window_linger(Some(Duration::from_secs(3))),
            FULL_WINDOW_LINGER
        );
    }

    #[test]
    fn a_full_queue_takes_events_again_once_a_quarter_of_it_is_free() {
        let t = Time::from_secs(0);
        let mut q = queue(8, 8);
        assert!(!intake_paused(false, &q));
        offer(&mut q, 0, 8, t);
        assert!(intake_paused(false, &q), "full");
        // One OK frees one slot: still paused (2 of 8 needed).
        q.on_ok(id(0), true, Prefix::Other, t);
        assert_eq!(q.room(), 1);
        assert!(intake_paused(true, &q));
        // Not paused before (the queue was never full): takes the free slot.
        assert!(!intake_paused(false, &q));
        q.on_ok(id(1), true, Prefix::Other, t);
        assert_eq!(q.room(), q.resume_room());
        assert!(!intake_paused(true, &q), "a quarter free");
        // A backlog of fewer than four events resumes at one free slot, as before.
        let mut small = queue(3, 3);
        offer(&mut small, 10, 13, t);
        assert!(intake_paused(true, &small));
        small.on_ok(id(10), true, Prefix::Other, t);
        assert!(!intake_paused(true, &small));
    }

    #[test]
    fn event_frame_wraps_the_raw_json_exactly() {
        let raw = r#"{"id":"ab","content":"x"}"#;
        let frame = super::event_frame(raw);
        assert_eq!(frame, format!("[\"EVENT\",{raw}]"));
        assert_eq!(frame.capacity(), frame.len());
    }

    /// Issue 10: the forwarder used to block in a socket read whose timeout was its tick
    /// (`WsOptions::tick`) while it waited for `OK`s, so an event arriving meanwhile waited
    /// out the tick. With a tick far longer than the test's deadlines, every event is still
    /// stored, one right after the other, and a drain ends the thread: nothing waits for a
    /// tick.
    #[cfg(feature = "testing")]
    #[test]
    fn events_and_commands_are_handled_without_waiting_for_a_tick() {
        use super::*;
        use crate::core::SystemClock;
        use crate::testing::TestRelay;
        use nostr::event::{EventBuilder, FinalizeEvent, Kind};
        use std::time::Instant;

        let own = TestRelay::start();
        let (events_tx, events) = crossbeam_channel::bounded(16);
        let (control_tx, control) = crossbeam_channel::unbounded();
        let (reports, _reports_rx) = crossbeam_channel::bounded(64);
        let tick = Duration::from_secs(3600);
        let forwarder = Forwarder {
            url: RelayUrl::parse(&own.url()).unwrap(),
            events,
            control,
            limits: ForwardLimits::default(),
            ws: WsOptions {
                tick,
                idle_tick: tick,
                ..WsOptions::default()
            },
            tls: ws::tls_config(),
            backoff: BackoffPolicy::default(),
            ping_interval: tick,
            pong_timeout: tick,
            metrics: Arc::new(Metrics::default()),
            gate: Arc::default(),
            drain: std::cell::Cell::new(None),
            clock: Arc::new(SystemClock),
            seed: 1,
            auth_keys: None,
            reports,
            admissions: Admissions::default(),
            intake_paused: Default::default(),
            error_spell_warned: Default::default(),
            throttle_warned: Default::default(),
            purgatory_logged: Default::default(),
        };
        let (ended_tx, ended) = crossbeam_channel::bounded(1);
        let thread = std::thread::spawn(move || {
            forwarder.run();
            let _ = ended_tx.send(());
        });
        let keys = Keys::generate();
        let deadline = Duration::from_secs(60);
        for i in 0..3 {
            let event = EventBuilder::new(Kind::TextNote, format!("note {i}"))
                .finalize(&keys)
                .unwrap();
            events_tx
                .send(ForwardItem {
                    id: event.id,
                    raw: Arc::from(event.as_json()),
                    admission: None,
                    missing: false,
                })
                .unwrap();
            let end = Instant::now() + deadline;
            while !own.contains(&event.id) {
                assert!(
                    Instant::now() < end,
                    "event {i} not stored within {deadline:?} (tick {tick:?})"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        control_tx
            .send(ForwarderControl::Drain(Instant::now() + tick))
            .unwrap();
        assert!(
            ended.recv_timeout(deadline).is_ok(),
            "the drain did not end the forwarder within {deadline:?} (tick {tick:?})"
        );
        thread.join().unwrap();
    }

    #[test]
    fn the_throttle_warning_names_the_relay_the_rate_and_the_fix() {
        use crate::core::forward::Throttle;
        let since = Time::from_secs(1_000);
        let t = Throttle {
            since,
            stored: 3,
            pace: Duration::from_secs(20),
        };
        let url = crate::shared::RelayUrl::parse("ws://127.0.0.1:7777").unwrap();
        let w = throttle_warning(&url, &t, 120, since.plus(Duration::from_secs(180)));
        assert!(w.contains("ws://127.0.0.1:7777"), "{w}");
        assert!(w.contains("for 180 s"), "{w}");
        assert!(w.contains("stored 3 events"), "{w}");
        assert!(w.contains("(1.0 a minute)"), "{w}");
        assert!(w.contains("120 events wait, about 120 minutes"), "{w}");
        assert!(w.contains("docs/operations.md"), "{w}");
    }
}
