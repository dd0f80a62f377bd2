//! The forwarder: one connection to the own relay that publishes checked events as their
//! original JSON and reads the `OK`s. Every decision lives in [`ForwardSession`] (the queue,
//! NIP-42, keep-alive, pauses, lingers, the intake pause); this thread moves bytes, keeps the
//! clock and bumps the counters from the session's [`ForwardEvent`]s. When the queue is full it
//! stops taking events from the relay threads, which then block: remote reading pauses instead
//! of dropping.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select, Sender, TryRecvError};
use log::{debug, info, warn};
use nostr::event::EventId;
use nostr::key::Keys;
use tungstenite::Message;

use crate::core::dedup::{ForwardGate, IdMap};
use crate::core::forward::{
    ForwardConfig, ForwardControl, ForwardEvent, ForwardLimits, ForwardSession, ForwardTransmit,
    Offer, OkOutcome,
};
use crate::core::health::{BackoffPolicy, Health, Jitter};
use crate::core::session::{Forward, Frame};
use crate::core::sync::Report;
use crate::core::time::Clock;
use crate::core::AuthLimits;
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
pub(crate) const READER_THREAD: &str = "forwarder-read";
/// The longest wait without a deadline: a safety net, not a tick (every input wakes the
/// forwarder at once).
const MAX_WAIT: Duration = Duration::from_secs(1);
/// The wait before retrying a write the own relay did not take in time, or a back-pressure
/// report the coordinator's full channel refused.
const RETRY_WAIT: Duration = Duration::from_millis(50);
/// How long the reader of the own relay connection waits after a read that drained the
/// socket: the own relay answers each event with its own `OK` frame, so a stream of events
/// would otherwise wake the reader and the forwarder once per event (decision 0066).
/// The first frame after a quiet moment is passed on at once.
pub(crate) const READ_LINGER: Duration = Duration::from_millis(1);
/// Frames from the own relay read in one turn before the freed slots are filled.
const READ_BATCH: usize = 256;

/// What a turn of the forwarder's loop leaves to its wait.
#[derive(Debug, Clone, Copy)]
struct Left {
    /// The own relay did not take every byte within the write timeout.
    unflushed: bool,
    /// Writes wait for the batch this long (see [`ForwardSession::hold_writes`]).
    held: Option<Duration>,
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
    /// coordinates or root event ids (see
    /// [`ForwardQueue::retry_rejected`](crate::core::forward::ForwardQueue::retry_rejected)).
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
}

impl Forwarder {
    /// Runs until shut down.
    pub(crate) fn run(self) {
        let mut session = ForwardSession::new(ForwardConfig {
            auth_keys: self.auth_keys.clone(),
            auth_limits: AuthLimits::default(),
            ping_interval: self.ping_interval,
            pong_timeout: self.pong_timeout,
            ..ForwardConfig::new(self.url.clone(), self.limits)
        });
        let mut health = Health::default();
        let mut jitter = Jitter::new(self.seed);
        let mut logged_down = false;
        loop {
            if self.drained(&session) {
                break;
            }
            match ws::connect_checked(&self.url, &self.ws, &self.tls, &|_| Ok(())) {
                Ok(mut socket) => {
                    health.record_success(self.clock.now());
                    info!("forwarder connected to the own relay {}", self.url);
                    logged_down = false;
                    self.metrics.forward.connected.store(1, Ordering::Relaxed);
                    session.on_connected(self.clock.now());
                    let stop = self.connection(&mut socket, &mut session);
                    self.metrics.forward.connected.store(0, Ordering::Relaxed);
                    session.on_disconnect();
                    self.publish_counters(&mut session);
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
            if self.wait(wait, &mut session) {
                break;
            }
        }
        debug!("forwarder ends");
    }

    /// Waits `d` while taking events into the queue (until it is full). True on shutdown.
    fn wait(&self, d: Duration, session: &mut ForwardSession) -> bool {
        let end = Instant::now() + d;
        loop {
            if let Ok(c) = self.control.try_recv() {
                self.control_message(c, session);
            }
            if self.drain.get().is_some_and(|d| Instant::now() >= d) {
                // Draining, and the own relay is unreachable: what is left stays on the
                // remote relays for the next start.
                return true;
            }
            let _ = self.take_events(session);
            self.publish_counters(session);
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }

    fn control_message(&self, c: ForwarderControl, session: &mut ForwardSession) {
        match c {
            ForwarderControl::Drain(deadline) => {
                info!(
                    "forwarder: flushing {} queued events into the own relay before stopping",
                    session.queue().backlog() + self.events.len()
                );
                self.drain.set(Some(deadline));
                session.handle_control(ForwardControl::Drain);
            }
            ForwarderControl::RetryRejected { repos, roots } => {
                session.handle_control(ForwardControl::RetryRejected { repos, roots })
            }
            #[cfg(feature = "testing")]
            ForwarderControl::Panic => panic!("forwarder: panic injected by a test"),
        }
    }

    /// True once draining is finished: everything received was answered, or the deadline
    /// passed.
    fn drained(&self, session: &ForwardSession) -> bool {
        self.drain.get().is_some_and(|d| {
            let done = session.is_idle() && self.events.is_empty();
            if !done && Instant::now() >= d {
                warn!(
                    "forwarder: stop deadline reached with {} events not yet stored; they stay on the remote relays for the next start",
                    session.queue().backlog() + self.events.len()
                );
            }
            done || Instant::now() >= d
        })
    }

    /// Takes events from the channel until it is empty or the session pauses its intake.
    /// False when the channel is closed (every sender is gone) and empty.
    fn take_events(&self, session: &mut ForwardSession) -> bool {
        let mut open = true;
        while !session.intake_paused() {
            match self.events.try_recv() {
                Ok(item) => {
                    let offer =
                        session.offer(item.id, item.raw, item.missing, self.gate.verified());
                    if offer == Offer::Queued {
                        if let Some(a) = item.admission {
                            self.admissions.borrow_mut().insert(item.id, a);
                        }
                    }
                    // A copy that queued nothing: its admission is dropped (released) here.
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        self.report_back_pressure(session.intake_paused());
        open
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

    fn resolved(&self, n: u64) {
        let u = &self.metrics.forward.unresolved;
        let _ = u.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_sub(n))
        });
    }

    /// Applies what the session reports to the counters and the byte admissions. False when
    /// the connection is dead.
    fn events(&self, session: &mut ForwardSession) -> bool {
        let mut alive = true;
        while let Some(e) = session.poll_event() {
            match e {
                ForwardEvent::Answered {
                    id,
                    outcome,
                    latency,
                } => {
                    if let Some(l) = latency {
                        self.metrics.forward.ok_latency.observe(l);
                    }
                    if outcome.leaves_pipeline() {
                        // Its bytes are free again (a kept rejected event counts against the
                        // rejected store's own byte bound).
                        self.admissions.borrow_mut().remove(&id);
                        self.resolved(1);
                    }
                    if let OkOutcome::Rejected(prefix) = outcome {
                        let slot = crate::engine::metrics::reject_reason_slot(prefix);
                        let by_reason = &self.metrics.forward.rejected_by_reason[slot];
                        by_reason.fetch_add(1, Ordering::Relaxed);
                    }
                }
                ForwardEvent::Settled(n) => self.resolved(n),
                ForwardEvent::Reopened(n) => {
                    let u = &self.metrics.forward.unresolved;
                    u.fetch_add(n, Ordering::Relaxed);
                }
                ForwardEvent::Dead => alive = false,
            }
        }
        alive
    }

    fn publish_counters(&self, session: &mut ForwardSession) {
        let _ = self.events(session);
        self.metrics.forward.publish(session.queue());
    }

    /// Writes what the session hands out. False when the connection is lost.
    fn write(&self, socket: &mut ws::Socket, session: &mut ForwardSession) -> bool {
        while let Some(t) = session.poll_transmit(self.clock.now()) {
            let written = match t {
                ForwardTransmit::Text(text) => write_text(socket, text),
                ForwardTransmit::Ping => socket.write(Message::Ping(Vec::new().into())),
            };
            if let Err(e) = written {
                warn!("forwarder: write to the own relay failed: {e}");
                return false;
            }
        }
        true
    }

    /// One connection. Returns true on shutdown, false when the connection was lost.
    ///
    /// The socket's reads run on a helper thread ([`ws::read_on_helper_thread`]), so the loop
    /// waits on the own relay's frames, the event channel and the control channel at once
    /// ([`Forwarder::wait_for_work`]): there is no tick; events and `OK`s are handled when
    /// they arrive, or gathered for at most a few milliseconds where the session's policies
    /// batch them ([`ForwardSession::hold_writes`], [`ForwardSession::wait`]).
    fn connection(&self, socket: &mut ws::Socket, session: &mut ForwardSession) -> bool {
        if let Err(e) = ws::read_on_helper_thread(socket, READER_THREAD.into(), READ_LINGER) {
            warn!("forwarder: cannot start the reader thread of the own relay connection: {e}");
            return false;
        }
        let mut open = Open {
            events: true,
            control: true,
        };
        // When events were last written: the session holds events arriving right after it.
        let mut last_write: Option<Instant> = None;
        loop {
            loop {
                match self.control.try_recv() {
                    Ok(c) => self.control_message(c, session),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open.control = false;
                        break;
                    }
                }
            }
            if self.drained(session) {
                return true;
            }
            if !self.take_events(session) {
                open.events = false;
                if session.is_idle() {
                    // The engine is gone and nothing is left to store.
                    return true;
                }
            }
            let now = self.clock.now();
            session.handle_timeout(now);
            if !self.events(session) {
                return false;
            }
            let held = session.hold_writes(last_write.map(|t| t.elapsed()), open.events);
            if !self.write(socket, session) {
                return false;
            }
            if session.wrote() {
                last_write = Some(Instant::now());
            }
            let Some(mut unflushed) = self.flush(socket) else {
                return false;
            };
            // Read every frame that has arrived (reads never block here), at most
            // `READ_BATCH` per turn; the slots their OKs freed are filled in one write on the
            // next turn (one system call for the batch, not one per OK).
            let mut more = false;
            let mut frames = 0;
            // One reading for the frames of this turn (they are read without blocking).
            let read_at = self.clock.now();
            let verified = self.gate.verified();
            loop {
                if frames == READ_BATCH {
                    more = true;
                    break;
                }
                match socket.read() {
                    Ok(Message::Text(text)) => {
                        frames += 1;
                        session.handle_frame(read_at, Frame::Text(text.as_str()), verified);
                    }
                    Ok(Message::Close(_)) => {
                        warn!("forwarder: the own relay closed the connection");
                        return false;
                    }
                    Ok(_) => session.handle_frame(read_at, Frame::Pong, verified),
                    Err(e) if ws::is_timeout(&e) => break,
                    Err(e) => {
                        warn!("forwarder: own relay connection lost: {e}");
                        return false;
                    }
                }
            }
            // The OKs freed slots: send more now (not while NIP-42 holds writes back: the
            // loop would spin without sending; issue 36).
            if held.is_none() && session.sends_now(self.clock.now()) {
                more = true;
            }
            // An AUTH answer to a challenge read above goes out before the wait.
            if !self.write(socket, session) {
                return false;
            }
            match self.flush(socket) {
                Some(u) => unflushed |= u,
                None => return false,
            }
            self.publish_counters(session);
            if !more {
                let left = Left { unflushed, held };
                self.wait_for_work(socket, session, open, left);
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
    /// an event (when [`ForwardSession::wait`] watches offers), a command, or the session's
    /// next deadline ([`ForwardSession::poll_timeout`]: keepalive, an overdue `OK`, the end of
    /// a pause, NIP-42), or the drain deadline. Nothing is taken here: the loop does that.
    fn wait_for_work(
        &self,
        socket: &ws::Socket,
        session: &mut ForwardSession,
        open: Open,
        left: Left,
    ) {
        let Left { unflushed, held } = left;
        let now = self.clock.now();
        let mut wait = session
            .poll_timeout()
            .map_or(MAX_WAIT, |t| t.since(now))
            .min(MAX_WAIT);
        if let Some(d) = self.drain.get() {
            wait = wait.min(d.saturating_duration_since(Instant::now()));
        }
        let report_pending =
            (self.metrics.forward.full.load(Ordering::Relaxed) == 1) != session.intake_paused();
        if unflushed || report_pending {
            // Retry the write or the back-pressure report soon.
            wait = wait.min(RETRY_WAIT);
        }
        let mut select = Select::new();
        if open.control {
            select.recv(&self.control);
        }
        if let Some(held) = held {
            // Writes wait for the batch: only a command ends the wait early.
            let _ = select.ready_timeout(wait.min(held));
            return;
        }
        let w = session.wait(now, open.events);
        if w.offers {
            select.recv(&self.events);
        }
        if let Some(linger) = w.linger {
            // Only OKs can be due, and nothing needs them at once: they are read after the
            // linger, or on the next event's turn.
            wait = wait.min(linger);
        } else if let Some(inbound) = ws::inbound(socket) {
            inbound.register(&mut select);
        }
        let _ = select.ready_timeout(wait);
    }
}

#[cfg(all(test, feature = "testing"))]
#[path = "forwarder_tests.rs"]
mod tests;
