//! One thread per relay: a blocking websocket loop that only moves bytes.
//!
//! Every decision about the connection is the [`RelaySession`]'s (`core::session`): which
//! frames belong to which subscription, when a copy of an event is dropped, when to ping and
//! when a missing pong ends the connection, what a CLOSED means, NIP-42, NIP-11. The thread
//! keeps the socket, the clock, the blocking hand-overs (to the coordinator and to the
//! forwarder) and publishing the session's counters.
//!
//! The blocking hand-overs (reports to the coordinator, events to the forwarder) are in
//! `engine/handover.rs`.
//!
//! The thread waits for a `Connect` from the coordinator, asks for the relay's NIP-11
//! document while the session wants it, connects (with a deadline, on the connect pool), then
//! loops: carry out the coordinator's commands, read one frame with a read timeout (the
//! session's [`RelaySession::read_timeout`]: short while busy, longer once quiet), hand what
//! the session made of it on, and run the session's timers when due. After a disconnect the
//! thread goes back to waiting; the coordinator decides when to reconnect.
//!
//! The clock is read once per frame: after the read (which may block). It is read again,
//! before the timers and before the next read, wherever time may have passed since
//! (`stale`): a command was sent, a frame other than a copy dropped by its id was handled
//! (handling may wait for the forward pipeline, the coordinator or a write), a ping came (its
//! pong is flushed next turn), frames were written, reports were handed over, or a flush had
//! bytes left over. A copy dropped by its id (most frames of a historic sync) writes and
//! waits for nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use log::{debug, trace, warn};
use nostr::key::Keys;
use tungstenite::Message;

use crate::core::auth::AuthLimits;
use crate::core::dedup::ForwardGate;
use crate::core::forward::ForwardLimits;
use crate::core::keepalive::Ticks;
pub use crate::core::session::Control;
use crate::core::session::{
    Disconnect, Frame, FrameOutcome, RelaySession, SessionConfig, SessionCounters, SessionRole,
    Transmit, Verified,
};
use crate::core::time::Clock;
use crate::engine::dial::Dial;
use crate::engine::forwarder::ForwardItem;
use crate::engine::metrics::{Metrics, RelayCounters};
use crate::engine::Input;
use crate::net::policy::{AddressPolicy, UrlVerdict};
use crate::net::ws::{self, Socket, SocketWaker, WsOptions};
use crate::shared::Refusal;
use crate::shared::RelayUrl;

/// Stack of a relay thread. It handles frames and checks events; connects and the NIP-11
/// request run on the connect pool (`net::pool`).
pub const RELAY_STACK: usize = 256 * 1024;

/// Where a connection's events go.
#[derive(Clone)]
#[non_exhaustive]
pub enum Role {
    /// A remote relay: checked events go to the forwarder.
    Remote(Sender<ForwardItem>),
    /// The own relay's self-subscription: checked events go to the coordinator.
    Own,
}

/// Everything a relay thread needs.
pub struct ConnectionThread {
    /// The relay.
    pub url: RelayUrl,
    /// Where events go.
    pub role: Role,
    /// Commands in.
    pub control: Receiver<Control>,
    /// Reports out.
    pub reports: Sender<Input>,
    /// Websocket options.
    pub ws: WsOptions,
    /// TLS trust for `wss://` and NIP-11 over `https://`.
    pub tls: std::sync::Arc<rustls::ClientConfig>,
    /// Ping interval.
    pub ping_interval: Duration,
    /// Pong deadline.
    pub pong_timeout: Duration,
    /// Counters of this relay.
    pub counters: Arc<RelayCounters>,
    /// Shared counters (the forwarder's unresolved count and byte bound).
    pub metrics: Arc<Metrics>,
    /// Which checked events go to the forwarder (shared by every relay thread).
    pub gate: Arc<ForwardGate>,
    /// Set when the engine stops.
    pub stopping: Arc<AtomicBool>,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// Deadline of the NIP-11 information request (fetched before the first connect).
    pub nip11_timeout: Duration,
    /// Key answering NIP-42 AUTH challenges (none: challenges are ignored). For the own
    /// relay this is `Config::own_auth_keys` when set.
    pub auth_keys: Option<Keys>,
    /// Which addresses this relay may be connected to (checked for remote relays only).
    pub policy: Arc<AddressPolicy>,
    /// Byte bounds of the forward pipeline (a remote relay waits for room before handing
    /// over an event).
    pub forward_limits: ForwardLimits,
    /// Lets the coordinator end a blocked read when it stops or forgets this relay.
    pub waker: SocketWaker,
}

enum SessionEnd {
    /// Lost; wait for the next Connect.
    Lost,
    /// A new Connect arrived during the session.
    Reconnect(u64),
    /// Shut down.
    Stop,
}

impl ConnectionThread {
    /// Runs until `Shutdown` (or the engine stops).
    pub fn run(self) {
        let mut session = RelaySession::new(SessionConfig {
            url: self.url.clone(),
            role: match self.role {
                Role::Remote(_) => SessionRole::Remote,
                Role::Own => SessionRole::Own,
            },
            ping_interval: self.ping_interval,
            pong_timeout: self.pong_timeout,
            max_event_size: self.ws.max_event_size,
            auth_keys: self.auth_keys.clone(),
            auth_limits: AuthLimits::default(),
        });
        if self.nip11_timeout.is_zero() {
            session.skip_limits();
        }
        let mut published = SessionCounters::default();
        let mut next: Option<u64> = None;
        let verdict = match self.role {
            Role::Own => UrlVerdict::Trusted,
            Role::Remote(_) => self.policy.check_url(&self.url),
        };
        loop {
            let generation = match next.take() {
                Some(g) => g,
                None => match self.wait_for_connect() {
                    Some(g) => g,
                    None => break,
                },
            };
            if let UrlVerdict::Refused(reason) = &verdict {
                if !self.refused(&mut session, generation, reason.clone()) {
                    break;
                }
                continue;
            }
            if session.wants_limits() {
                match self.dial().fetch_limits(&verdict, self.nip11_timeout) {
                    Ok(fetched) => {
                        // Reported before the connect, so the first REQs already use them.
                        session.on_limits(fetched);
                        if !self.send_reports(&mut session) {
                            break;
                        }
                    }
                    Err(reason) => {
                        if !self.refused(&mut session, generation, reason) {
                            break;
                        }
                        continue;
                    }
                }
            }
            let end = self.session(generation, &verdict, &mut session, &mut published);
            self.counters.publish(session.counters(), &mut published);
            // The session's socket is closed: release the waker's copy of it.
            self.waker.set(None);
            match end {
                SessionEnd::Lost => {}
                SessionEnd::Reconnect(g) => next = Some(g),
                SessionEnd::Stop => break,
            }
        }
        debug!("{}: thread ends", self.url);
    }

    /// The address policy refused this relay: counted, logged once (the machine then drops
    /// the relay and never asks for it again), and reported.
    fn refused(&self, session: &mut RelaySession, generation: u64, reason: Refusal) -> bool {
        if self.metrics.refuse(&self.url, &reason) {
            warn!("{}: not connecting: {reason}", self.url);
        } else {
            debug!("{}: not connecting: {reason}", self.url);
        }
        session.on_refused(generation, reason);
        self.send_reports(session)
    }

    fn dial(&self) -> Dial {
        Dial {
            url: self.url.clone(),
            tls: self.tls.clone(),
            policy: self.policy.clone(),
            own: matches!(self.role, Role::Own),
        }
    }

    pub(super) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    fn wait_for_connect(&self) -> Option<u64> {
        loop {
            if self.stopping() {
                return None;
            }
            // A command wakes the wait at once; the timeout only notices a stopping engine
            // (which also sends `Shutdown`), so it can be long: few wake-ups while idle.
            match self.control.recv_timeout(Duration::from_secs(1)) {
                Ok(Control::Connect { generation }) => return Some(generation),
                Ok(Control::Shutdown) => return None,
                #[cfg(feature = "testing")]
                Ok(Control::Panic) => panic!("{}: panic injected by a test", self.url),
                Ok(other) => trace!("{}: dropping {other:?} while disconnected", self.url),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// One connection of `generation`: connect, then loop until it ends.
    fn session(
        &self,
        generation: u64,
        verdict: &UrlVerdict,
        session: &mut RelaySession,
        published: &mut SessionCounters,
    ) -> SessionEnd {
        debug!("{}: connecting (generation {generation})", self.url);
        let mut socket = match self.dial().connect(verdict, self.ws) {
            Ok(s) => s,
            Err(ws::ConnectError::Refused(reason)) => {
                self.refused(session, generation, reason);
                return SessionEnd::Lost;
            }
            Err(e) => {
                session.on_connect_failed(generation, connect_cause(e));
                self.counters.publish(session.counters(), published);
                self.send_reports(session);
                return SessionEnd::Lost;
            }
        };
        self.waker.set_socket(&socket);
        session.on_connected(generation, self.clock.now());
        self.counters.publish(session.counters(), published);
        if !self.send_reports(session) {
            return SessionEnd::Stop;
        }
        let ticks = ticks(&self.ws);
        let forward_to = match &self.role {
            Role::Remote(tx) => Some(tx),
            Role::Own => None,
        };
        let mut now = self.clock.now();
        let mut stale = false;
        // An earlier flush timed out with bytes left: the next one may wait too.
        let mut unflushed = false;
        // The read timeout in force.
        let mut tick = self.ws.tick;
        let end = 'conn: loop {
            if self.stopping() {
                break SessionEnd::Stop;
            }
            // 1. Commands. Each command's frame is flushed at once, until a flush times out
            // (a relay that does not read): the rest of this turn's frames stay buffered for
            // the flush below, so a burst of commands never blocks for one write timeout each.
            let mut flush_each = true;
            while let Ok(c) = self.control.try_recv() {
                now = self.clock.now();
                stale = true;
                match c {
                    Control::Connect { generation: g } => {
                        close(&mut socket, session);
                        return SessionEnd::Reconnect(g);
                    }
                    Control::Shutdown => {
                        close(&mut socket, session);
                        return SessionEnd::Stop;
                    }
                    #[cfg(feature = "testing")]
                    Control::Panic => panic!("{}: panic injected by a test", self.url),
                    c => {
                        let verified = Verified {
                            set: self.gate.verified(),
                            forward_epoch: self.gate.epoch(),
                        };
                        session.handle_command_with(now, c, verified);
                    }
                }
                if let Err(e) = write_transmits(&mut socket, session, &mut flush_each) {
                    session.on_lost(e);
                    break;
                }
                if !flush_each {
                    unflushed = true;
                }
            }
            if session.is_open() {
                let had_unflushed = unflushed;
                match socket.flush() {
                    Ok(()) => unflushed = false,
                    Err(e) if ws::is_timeout(&e) => unflushed = true,
                    Err(e) => session.on_lost(Disconnect::Write(e.to_string())),
                }
                stale |= had_unflushed || unflushed;
            }
            if !session.is_open() {
                break 'conn self.lost(session, published);
            }
            // 2. One frame (or a tick of silence). A quiet connection ticks less often
            // (idle CPU), never past its own deadlines.
            if stale {
                now = self.clock.now();
            }
            let want = session.read_timeout(now, &ticks);
            if want != tick && ws::set_tick(&socket, want).is_ok() {
                tick = want;
            }
            let read = socket.read();
            // One reading of the clock for everything after the read (it may have blocked).
            now = self.clock.now();
            stale = false;
            let verified = Verified {
                set: self.gate.verified(),
                forward_epoch: self.gate.epoch(),
            };
            let outcome = match &read {
                Ok(msg) => {
                    let frame = match msg {
                        Message::Text(text) => Frame::Text(text.as_str()),
                        Message::Binary(_) | Message::Frame(_) => Frame::Binary,
                        Message::Ping(_) => Frame::Ping,
                        Message::Pong(_) => Frame::Pong,
                        Message::Close(close) => Frame::Close(
                            close
                                .as_ref()
                                .map(|c| (u16::from(c.code), c.reason.as_str())),
                        ),
                    };
                    // Handling may wait (for the forward pipeline, the coordinator, a
                    // write), unless the frame was a copy dropped by its id; a ping's pong
                    // is flushed next turn.
                    stale = matches!(msg, Message::Text(_) | Message::Ping(_));
                    session.handle_frame(now, frame, verified)
                }
                Err(e) if ws::is_timeout(e) => FrameOutcome::Handled,
                Err(e) => {
                    session.on_lost(Disconnect::Read(e.to_string()));
                    FrameOutcome::Handled
                }
            };
            match outcome {
                FrameOutcome::DroppedCopy => stale = false,
                FrameOutcome::Handled => {}
                FrameOutcome::Forward(f) => {
                    self.counters.publish(session.counters(), published);
                    let Some(tx) = forward_to else {
                        unreachable!("the own relay's session forwards nothing");
                    };
                    let generation = session.generation().unwrap_or_default();
                    if !self.forward(tx, f.into(), &mut socket, generation) {
                        break SessionEnd::Stop;
                    }
                }
            }
            if !self.hand_over(&mut socket, session, published, &mut stale) {
                break SessionEnd::Stop;
            }
            if !session.is_open() {
                break SessionEnd::Lost;
            }
            // 3. Timers: keep-alive, NIP-42 holds.
            if stale {
                now = self.clock.now();
            }
            if session.poll_timeout().is_some_and(|t| t <= now) {
                session.handle_timeout(now);
                if !self.hand_over(&mut socket, session, published, &mut stale) {
                    break SessionEnd::Stop;
                }
                if !session.is_open() {
                    break SessionEnd::Lost;
                }
            }
        };
        if matches!(end, SessionEnd::Stop) {
            close(&mut socket, session);
        }
        end
    }

    /// Carries out what the session asks for after an input: its frames are written (not
    /// flushed: the next turn flushes), its counters published and its reports handed to the
    /// coordinator. A failed write ends the connection (reported). False when stopping.
    fn hand_over(
        &self,
        socket: &mut Socket,
        session: &mut RelaySession,
        published: &mut SessionCounters,
        stale: &mut bool,
    ) -> bool {
        let mut flush = false;
        match write_transmits(socket, session, &mut flush) {
            Ok(wrote) => *stale |= wrote,
            Err(e) => session.on_lost(e),
        }
        self.counters.publish(session.counters(), published);
        if session.has_reports() {
            *stale = true;
            return self.send_reports(session);
        }
        true
    }

    /// The connection ended: counters published, the loss reported.
    fn lost(&self, session: &mut RelaySession, published: &mut SessionCounters) -> SessionEnd {
        self.counters.publish(session.counters(), published);
        if self.send_reports(session) {
            SessionEnd::Lost
        } else {
            SessionEnd::Stop
        }
    }
}

/// Writes the session's frames. With `flush_each`, each is flushed at once until a flush
/// times out (then `flush_each` is cleared and the rest stay buffered).
///
/// A write or flush that times out (a relay slow to read) is not an error: tungstenite keeps
/// the frame in its buffer, and the next turn's flush goes on with it. Returns whether
/// anything was written (writing may have waited).
fn write_transmits(
    socket: &mut Socket,
    session: &mut RelaySession,
    flush_each: &mut bool,
) -> Result<bool, Disconnect> {
    let mut wrote = false;
    while let Some(t) = session.poll_transmit() {
        wrote = true;
        let msg = match t {
            Transmit::Text(text) => Message::text(text),
            Transmit::Ping => Message::Ping(Vec::new().into()),
        };
        match socket.write(msg) {
            Ok(()) => {}
            Err(e) if ws::is_timeout(&e) => *flush_each = false,
            Err(e) => return Err(Disconnect::Write(e.to_string())),
        }
        if *flush_each {
            match socket.flush() {
                Ok(()) => {}
                Err(e) if ws::is_timeout(&e) => *flush_each = false,
                Err(e) => return Err(Disconnect::Write(e.to_string())),
            }
        }
    }
    Ok(wrote)
}

/// Closes the socket (best effort) and forgets the connection's state without a report.
fn close(socket: &mut Socket, session: &mut RelaySession) {
    let _ = socket.close(None);
    let _ = socket.flush();
    session.on_closed_locally();
}

/// The cause of a failed connect.
fn connect_cause(e: ws::ConnectError) -> Disconnect {
    match e {
        ws::ConnectError::Resolve(e) => Disconnect::Resolve(e.to_string()),
        ws::ConnectError::Tcp(e) => Disconnect::Tcp(e.to_string()),
        ws::ConnectError::Handshake(e) => Disconnect::Handshake(e),
        ws::ConnectError::Timeout => Disconnect::ConnectTimeout,
        // The caller handles a refusal before (it is reported as `Refused`, not counted as a
        // disconnect); should one arrive here it still ends the attempt.
        ws::ConnectError::Refused(e) => Disconnect::Handshake(format!("refused: {e}")),
    }
}

/// The relay loop's read timeouts from the websocket options.
fn ticks(ws: &WsOptions) -> Ticks {
    Ticks {
        busy: ws.tick,
        idle: ws.idle_tick,
        quiet: ws.quiet_tick,
        quiet_after: ws.quiet_after,
    }
}

/// Spawns a relay thread named after the relay.
pub fn spawn(t: ConnectionThread) -> std::io::Result<std::thread::JoinHandle<()>> {
    let name = format!("relay {}", t.url);
    std::thread::Builder::new()
        .name(name)
        .stack_size(RELAY_STACK)
        .spawn(move || t.run())
}

/// Writes one text frame (the forwarder's writes).
pub(crate) fn write_text(socket: &mut Socket, text: String) -> Result<(), tungstenite::Error> {
    socket.write(Message::text(text))
}
