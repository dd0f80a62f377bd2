//! One thread per relay: a blocking websocket loop that only moves bytes and messages.
//!
//! The thread waits for a `Connect` from the coordinator, connects (with a deadline), reports
//! `Connected` or `Disconnected`, then loops: drain the control channel (REQ/CLOSE to send),
//! read one frame with a read timeout (`WsOptions::tick` while busy, `WsOptions::idle_tick`
//! once quiet, `WsOptions::quiet_tick` once quiet for long:
//! [`crate::core::keepalive::read_timeout`]), ping when due. Every event is checked (id,
//! signature, matches the subscription's filter; a copy of JSON verified before, by any
//! relay thread, is recognised by the SHA-256 of its bytes, a copy with other bytes has only
//! its id checked: [`Metrics::verified`]; a remote relay's copy of an event already handed
//! to the forwarder is recognised by the id it claims and dropped unparsed) and handed on:
//! to the forwarder for a remote relay (one copy per event), to the coordinator for the own
//! relay's self-subscription. After a disconnect the
//! thread goes back to waiting; the coordinator decides when to reconnect.
//!
//! Commands and reports carry the connection *generation*, so a REQ queued for an earlier
//! connection is never sent on a later one.
//!
//! NIP-42: with a key configured, a challenge is answered with a signed AUTH event, and a
//! subscription the relay `CLOSED` with `auth-required:` is held back (not reported) until
//! the relay accepted it, then its REQ is sent again ([`AuthState`] decides).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};
use log::{debug, info, trace, warn};
use nostr::event::{EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::filter::Filter;
use nostr::key::Keys;
use nostr::message::{ClientMessage, SubscriptionId};
use tungstenite::Message;

use crate::core::auth::{AuthLimits, AuthOutcome, AuthState, ClosedAction, Held, OnChallenge};
use crate::core::forward::ForwardLimits;
use crate::core::keepalive::{Keepalive, KeepaliveAction};
use crate::core::message::{
    check_parsed_cached, claimed_id, escape_for_log, parse_event, parse_relay_frame,
    split_event_frame, summary_matches, EventRejection, Incoming, SignatureCheck,
};
use crate::core::paging::PageStats;
use crate::core::sync::Report;
use crate::core::time::Clock;
use crate::engine::metrics::{ByteAdmission, Metrics, RelayCounters};
use crate::engine::Input;
use crate::net::nip11;
use crate::net::policy::{AddressPolicy, UrlVerdict};
use crate::net::pool;
use crate::net::ws::{self, Socket, SocketWaker, WsOptions};
use crate::shared::refusal::Refusal;
use crate::shared::url::RelayUrl;

/// Characters of relay-supplied text (NOTICE, CLOSED reasons) kept for logs and reports.
pub const MAX_RELAY_TEXT: usize = 300;

/// `(created_at, id)` pairs one own-relay query collects at most (`Control::CollectIds`);
/// beyond, the report says `truncated` and the reconciliation falls back.
pub const MAX_COLLECTED_IDS: usize = 200_000;

/// Ids of oversized events one relay thread remembers (so each is counted and logged once).
pub const MAX_OVERSIZED_REMEMBERED: usize = 1_000;

/// Stack of a relay thread. It handles frames and checks events; connects and the NIP-11
/// request run on the connect pool ([`crate::net::pool`]).
pub const RELAY_STACK: usize = 256 * 1024;

/// Commands from the coordinator to a relay thread.
#[derive(Debug, Clone)]
pub enum Control {
    /// Open a connection tagged `generation` (closing any open one first).
    Connect {
        /// Generation.
        generation: u64,
    },
    /// Send a REQ with one filter.
    Subscribe {
        /// Generation the command belongs to.
        generation: u64,
        /// Subscription id.
        sub_id: SubscriptionId,
        /// Filter.
        filter: Box<Filter>,
    },
    /// Send a CLOSE.
    Unsubscribe {
        /// Generation the command belongs to.
        generation: u64,
        /// Subscription id.
        sub_id: SubscriptionId,
    },
    /// Send a REQ whose events are only counted as `(created_at, id)` (the own relay's side
    /// of a NIP-77 reconciliation): reported as `Report::OwnIds` at EOSE.
    CollectIds {
        /// Generation the command belongs to.
        generation: u64,
        /// Subscription id.
        sub_id: SubscriptionId,
        /// Filter.
        filter: Box<Filter>,
    },
    /// Send `NEG-OPEN` (NIP-77).
    NegOpen {
        /// Generation the command belongs to.
        generation: u64,
        /// Negentropy subscription id.
        sub_id: SubscriptionId,
        /// Filter.
        filter: Box<Filter>,
        /// Initial message, hex.
        message: String,
    },
    /// Send `NEG-MSG`.
    NegMsg {
        /// Generation the command belongs to.
        generation: u64,
        /// Negentropy subscription id.
        sub_id: SubscriptionId,
        /// Message, hex.
        message: String,
    },
    /// Send `NEG-CLOSE`.
    NegClose {
        /// Generation the command belongs to.
        generation: u64,
        /// Negentropy subscription id.
        sub_id: SubscriptionId,
    },
    /// Close and end the thread.
    Shutdown,
    /// Test hook: panic in the relay thread (to test that the coordinator restarts it).
    #[cfg(feature = "testing")]
    Panic,
}

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

/// Where a connection's events go.
#[derive(Clone)]
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
    /// Shared counters (the forwarder's unresolved count).
    pub metrics: Arc<Metrics>,
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

struct Sub {
    filter: Filter,
    /// What arrived before EOSE (for paging decisions).
    stats: PageStats,
    eose: bool,
    /// A `CollectIds` query: `(created_at, id)` of its events, and whether the bound cut it.
    ids: Option<(Vec<(u64, EventId)>, bool)>,
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
        let mut next: Option<u64> = None;
        let mut limits_known = false;
        let mut oversized_seen = HashSet::new();
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
                self.refused(generation, reason.clone());
                continue;
            }
            if !limits_known {
                match self.fetch_limits(&verdict) {
                    Ok(known) => limits_known = known,
                    Err(reason) => {
                        self.refused(generation, reason);
                        continue;
                    }
                }
            }
            let end = self.session(generation, &verdict, &mut oversized_seen);
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

    /// Checks a resolved address right before a connect: for every remote relay, that it is
    /// not the own relay's; for relays discovered from events, the whole address policy.
    /// Owned, so it can go to the connect pool with the connect.
    fn addr_check(
        &self,
        verdict: &UrlVerdict,
    ) -> impl Fn(std::net::SocketAddr) -> Result<(), Refusal> + Send + 'static {
        let own = matches!(self.role, Role::Own);
        let verdict = verdict.clone();
        let policy = self.policy.clone();
        move |addr| {
            if own {
                return Ok(());
            }
            match verdict {
                UrlVerdict::CheckAddresses => policy.check_addr(addr),
                _ => policy.check_own(addr),
            }
        }
    }

    /// The address policy refused this relay: counted, logged once (the machine then drops
    /// the relay and never asks for it again), and reported.
    fn refused(&self, generation: u64, reason: Refusal) {
        if self.metrics.refuse(&self.url, &reason) {
            warn!("{}: not connecting: {reason}", self.url);
        } else {
            debug!("{}: not connecting: {reason}", self.url);
        }
        self.report(Report::Refused {
            relay: self.url.clone(),
            generation,
            reason,
        });
    }

    /// Reads the relay's NIP-11 `limitation` and reports it (before `Connected`, so the
    /// first REQs already use it). `Ok(false)` when it should be asked for again; `Err` when
    /// the address policy refused the relay.
    fn fetch_limits(&self, verdict: &UrlVerdict) -> Result<bool, Refusal> {
        if self.nip11_timeout.is_zero() {
            return Ok(true);
        }
        let deadline = Instant::now() + self.nip11_timeout;
        let (url, tls, check) = (self.url.clone(), self.tls.clone(), self.addr_check(verdict));
        let fetched = pool::connect_pool().run(pool_patience(self.nip11_timeout), move || {
            nip11::fetch_checked(&url, pool::remaining(deadline), 64 * 1024, &tls, &check)
        });
        let fetched = match fetched {
            Ok(f) => f,
            Err(e) => {
                debug!("{}: no NIP-11 request ({e}); using defaults", self.url);
                return Ok(false);
            }
        };
        match fetched {
            Ok(limits) => {
                debug!("{}: NIP-11 {limits:?}", self.url);
                self.report(Report::Limits {
                    relay: self.url.clone(),
                    limits,
                });
                Ok(true)
            }
            Err(nip11::Nip11Error::Refused(reason)) => Err(reason),
            Err(e) => {
                debug!("{}: no NIP-11 limits ({e}); using defaults", self.url);
                // Ask again on the next connect only if the relay was not reachable; a relay
                // that answered without a usable document keeps the defaults.
                Ok(!matches!(
                    e,
                    nip11::Nip11Error::Connect(_)
                        | nip11::Nip11Error::Io(_)
                        | nip11::Nip11Error::Timeout
                ))
            }
        }
    }

    /// Opens the websocket on the connect pool ([`crate::net::pool`]) and waits for it. The
    /// TCP, TLS and websocket handshakes touch tens of KiB of stack that the relay thread
    /// would keep resident for the rest of its life (an idle connection needs far less); the
    /// pool's few threads touch theirs once. The deadline runs from this call: time spent
    /// waiting for a pool thread is taken from the handshakes' time. A panic in the connect
    /// is resumed here, so the relay thread fails as it would have.
    fn connect(&self, verdict: &UrlVerdict) -> Result<Socket, ws::ConnectError> {
        let deadline = Instant::now() + self.ws.connect_timeout;
        let (url, tls, check) = (self.url.clone(), self.tls.clone(), self.addr_check(verdict));
        let mut opts = self.ws;
        if matches!(self.role, Role::Own) {
            // The own relay's connection reads the whole own relay at start (and every
            // event it stores): its reads are not cut (`WsOptions::max_read` is for the
            // many idle remote relays).
            opts.max_read = 0;
        }
        pool::connect_pool()
            .run(pool_patience(opts.connect_timeout), move || {
                let left = pool::remaining(deadline);
                if left.is_zero() {
                    return Err(ws::ConnectError::Timeout);
                }
                let opts = WsOptions {
                    connect_timeout: left,
                    ..opts
                };
                ws::connect_checked(&url, &opts, &tls, &check)
            })
            .unwrap_or_else(|e| Err(ws::ConnectError::Tcp(std::io::Error::other(e.to_string()))))
    }

    fn stopping(&self) -> bool {
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

    fn report(&self, r: Report) -> bool {
        // The coordinator never waits on relay threads, so this cannot deadlock; the timeout
        // loop only lets a stopping engine end the thread.
        let mut msg = Input::Report(r);
        loop {
            match self.reports.send_timeout(msg, Duration::from_millis(200)) {
                Ok(()) => return true,
                Err(SendTimeoutError::Timeout(m)) => {
                    if self.stopping() {
                        return false;
                    }
                    msg = m;
                }
                Err(SendTimeoutError::Disconnected(_)) => return false,
            }
        }
    }

    fn disconnected(&self, generation: u64, reason: String) {
        RelayCounters::inc(&self.counters.disconnects);
        self.report(Report::Disconnected {
            relay: self.url.clone(),
            generation,
            reason,
        });
    }

    fn session(
        &self,
        generation: u64,
        verdict: &UrlVerdict,
        oversized_seen: &mut HashSet<EventId>,
    ) -> SessionEnd {
        debug!("{}: connecting (generation {generation})", self.url);
        let mut socket = match self.connect(verdict) {
            Ok(s) => s,
            Err(ws::ConnectError::Refused(reason)) => {
                self.refused(generation, reason);
                return SessionEnd::Lost;
            }
            Err(e) => {
                self.disconnected(generation, e.to_string());
                return SessionEnd::Lost;
            }
        };
        RelayCounters::inc(&self.counters.connects);
        self.waker.set_socket(&socket);
        if !self.report(Report::Connected {
            relay: self.url.clone(),
            generation,
        }) {
            return SessionEnd::Stop;
        }
        let mut subs: HashMap<String, Sub> = HashMap::new();
        // Open NIP-77 sessions (NEG-OPEN sent, no NEG-ERR/CLOSED/NEG-CLOSE yet).
        let mut negs: HashSet<String> = HashSet::new();
        let mut auth = AuthState::new(self.auth_keys.is_some(), AuthLimits::default());
        // The clock is read once per frame: after the read (which may block). It is read
        // again, before the keep-alive and before the next read, wherever time may have
        // passed since (`stale`, cleared only by the reading after a read): a command was
        // sent, a frame other than a copy dropped by its id was handled (handling may wait
        // for the forward pipeline, the coordinator or a write), a ping came (its pong is
        // flushed next turn), a ping was written, held subscriptions were reported, or a
        // flush had bytes left over. A copy dropped by its id (most frames of a historic
        // sync) writes and waits for nothing.
        let mut now = self.clock.now();
        let mut stale = false;
        // An earlier flush timed out with bytes left: the next one may wait too.
        let mut unflushed = false;
        let mut keepalive = Keepalive::new(now, self.ping_interval, self.pong_timeout);
        // The read timeout in force.
        let mut tick = self.ws.tick;
        let end = loop {
            if self.stopping() {
                break SessionEnd::Stop;
            }
            // 1. Commands.
            let mut failed = None;
            // Each command is flushed at once, until a flush times out (a relay that does not
            // read): the rest of this turn's frames stay buffered for the flush below, so a
            // burst of commands never blocks for one write timeout each.
            let mut flush_each = true;
            while let Ok(c) = self.control.try_recv() {
                now = self.clock.now();
                stale = true;
                keepalive.on_work(now);
                // The frame this command sends, if any.
                let text = match c {
                    Control::Connect { generation: g } => {
                        let _ = socket.close(None);
                        let _ = socket.flush();
                        return SessionEnd::Reconnect(g);
                    }
                    Control::Shutdown => {
                        let _ = socket.close(None);
                        let _ = socket.flush();
                        return SessionEnd::Stop;
                    }
                    Control::Subscribe {
                        generation: g,
                        sub_id,
                        filter,
                    } if g == generation => Some(self.open_req(&mut subs, sub_id, *filter, None)),
                    Control::CollectIds {
                        generation: g,
                        sub_id,
                        filter,
                    } if g == generation => {
                        Some(self.open_req(&mut subs, sub_id, *filter, Some((Vec::new(), false))))
                    }
                    Control::NegOpen {
                        generation: g,
                        sub_id,
                        filter,
                        message,
                    } if g == generation => {
                        negs.insert(sub_id.to_string());
                        let text = ClientMessage::neg_open(sub_id, *filter, message).as_json();
                        trace!("{} <- {}", self.url, escape_for_log(&text, 200));
                        Some(text)
                    }
                    Control::NegMsg {
                        generation: g,
                        sub_id,
                        message,
                    } if g == generation => Some(
                        ClientMessage::NegMsg {
                            subscription_id: std::borrow::Cow::Owned(sub_id),
                            message: std::borrow::Cow::Owned(message),
                        }
                        .as_json(),
                    ),
                    Control::NegClose {
                        generation: g,
                        sub_id,
                    } if g == generation => negs.remove(sub_id.as_str()).then(|| {
                        ClientMessage::NegClose {
                            subscription_id: std::borrow::Cow::Owned(sub_id),
                        }
                        .as_json()
                    }),
                    Control::Unsubscribe {
                        generation: g,
                        sub_id,
                    } if g == generation => {
                        subs.remove(sub_id.as_str());
                        auth.forget(sub_id.as_str());
                        Some(ClientMessage::close(sub_id).as_json())
                    }
                    #[cfg(feature = "testing")]
                    Control::Panic => panic!("{}: panic injected by a test", self.url),
                    stale => {
                        trace!("{}: dropping stale {stale:?}", self.url);
                        None
                    }
                };
                if let Some(text) = text {
                    // Each command's frame goes out at once: tungstenite's write buffer keeps
                    // the largest size it ever had, one frame instead of a burst of REQs.
                    let sent = socket.write(Message::text(text)).and_then(|()| {
                        if !flush_each {
                            return Ok(());
                        }
                        match socket.flush() {
                            Err(e) if ws::is_timeout(&e) => {
                                flush_each = false;
                                Ok(())
                            }
                            other => other,
                        }
                    });
                    if let Err(e) = sent {
                        failed = Some(format!("write failed: {e}"));
                        break;
                    }
                }
            }
            if let Some(reason) = failed {
                self.disconnected(generation, reason);
                break SessionEnd::Lost;
            }
            let had_unflushed = unflushed;
            match socket.flush() {
                Ok(()) => unflushed = false,
                Err(e) if ws::is_timeout(&e) => unflushed = true,
                Err(e) => {
                    self.disconnected(generation, format!("flush failed: {e}"));
                    break SessionEnd::Lost;
                }
            }
            if had_unflushed || unflushed {
                stale = true;
            }
            // 2. One frame (or a tick of silence). A quiet connection ticks less often
            // (idle CPU), never past its own deadlines.
            if stale {
                now = self.clock.now();
            }
            let want = keepalive.read_timeout(now, &ticks(&self.ws), auth.poll_timeout());
            if want != tick && ws::set_tick(&socket, want).is_ok() {
                tick = want;
            }
            let read = socket.read();
            // One reading of the clock for everything after the read (it may have blocked).
            now = self.clock.now();
            stale = false;
            match read {
                Ok(msg) => {
                    // Keep-alive traffic (the pong to our own ping) is not work: it keeps a
                    // quiet connection on its long tick (design departure 67).
                    keepalive.on_frame(now, matches!(msg, Message::Ping(_) | Message::Pong(_)));
                    match msg {
                        Message::Text(text) if text.len() > self.ws.max_event_size => {
                            self.oversized(&mut subs, oversized_seen, text.as_str());
                        }
                        Message::Text(text) => {
                            let mut ctx = Session {
                                generation,
                                subs: &mut subs,
                                negs: &mut negs,
                                auth: &mut auth,
                                socket: &mut socket,
                                quick: false,
                            };
                            if !self.handle_text(&mut ctx, text.as_str()) {
                                break SessionEnd::Stop;
                            }
                            // Handling may have waited (for room in the forward pipeline, or
                            // for the coordinator), unless the frame was a dropped copy.
                            stale = !ctx.quick;
                        }
                        Message::Binary(_) | Message::Frame(_) => {
                            RelayCounters::inc(&self.counters.garbage_frames);
                            debug!("{}: ignoring a binary frame", self.url);
                        }
                        // tungstenite queues the pong; flushing it next turn may wait.
                        Message::Ping(_) => stale = true,
                        Message::Pong(_) => {}
                        Message::Close(frame) => {
                            self.disconnected(generation, format!("closed by relay ({frame:?})"));
                            break SessionEnd::Lost;
                        }
                    }
                }
                Err(e) if ws::is_timeout(&e) => {}
                Err(e) => {
                    self.disconnected(generation, e.to_string());
                    break SessionEnd::Lost;
                }
            }
            // 3. Keep-alive.
            // A fresh reading if handling the frame may have waited: a stale `now` would date
            // a ping in the past and give up on its pong too early.
            if stale {
                now = self.clock.now();
            }
            match keepalive.poll(now) {
                KeepaliveAction::Idle => {}
                KeepaliveAction::SendPing => {
                    stale = true;
                    if let Err(e) = socket.write(Message::Ping(Vec::new().into())) {
                        self.disconnected(generation, format!("ping failed: {e}"));
                        break SessionEnd::Lost;
                    }
                }
                KeepaliveAction::Dead => {
                    self.disconnected(generation, "no pong before the deadline".into());
                    break SessionEnd::Lost;
                }
            }
            // 4. NIP-42 deadlines: held subscriptions whose wait is over are reported.
            if auth.poll_timeout().is_some_and(|t| t <= now) {
                let released = auth.handle_timeout(now);
                if !released.is_empty() {
                    info!(
                        "{}: no NIP-42 authentication in time; reporting {} subscription(s) the relay closed",
                        self.url,
                        released.len()
                    );
                }
                if !self.release(generation, &mut subs, released) {
                    break SessionEnd::Stop;
                }
                // Reporting may have waited for the coordinator.
                stale = true;
            }
        };
        if matches!(end, SessionEnd::Stop) {
            let _ = socket.close(None);
            let _ = socket.flush();
        }
        end
    }

    /// A text frame above the soft cap (`WsOptions::max_event_size`) but below the hard cap:
    /// dropped and counted; the connection is kept, so a relay storing one oversized event
    /// does not flap for ever (it would be fetched again on every reconnect). An event is
    /// counted once per relay however often it arrives (several subscriptions, reconnects;
    /// at most [`MAX_OVERSIZED_REMEMBERED`] ids are remembered), and logged at warn level the
    /// first time for this relay, then at debug level. It still counts as received for its
    /// subscription's paging (as an invalid event does: its timestamp is not used).
    fn oversized(&self, subs: &mut HashMap<String, Sub>, seen: &mut HashSet<EventId>, text: &str) {
        let (size, cap) = (text.len(), self.ws.max_event_size);
        let event = match parse_relay_frame(text) {
            Ok(Incoming::Event { sub_id, raw }) => parse_event(raw.get()).ok().map(|e| (sub_id, e)),
            _ => None,
        };
        let what = match &event {
            Some((sub_id, e)) => {
                // Counted like an invalid event: received, but its (unchecked) timestamp
                // does not steer paging.
                if let Some(sub) = subs.get_mut(sub_id) {
                    if !sub.eose {
                        sub.stats.received += 1;
                    }
                }
                if seen.contains(&e.id) {
                    debug!(
                        "{}: dropped event {} again ({size} bytes, above the {cap}-byte cap)",
                        self.url, e.id
                    );
                    return;
                }
                if seen.len() < MAX_OVERSIZED_REMEMBERED {
                    seen.insert(e.id);
                }
                format!("event {} on {}", e.id, escape_for_log(sub_id, 64))
            }
            None => "a frame".to_string(),
        };
        let before = self
            .counters
            .oversized_frames
            .fetch_add(1, Ordering::Relaxed);
        if before == 0 {
            warn!("{}: dropped {what} of {size} bytes (above the {cap}-byte cap); the connection is kept, further ones are logged at debug level", self.url);
        } else {
            debug!(
                "{}: dropped {what} of {size} bytes (above the {cap}-byte cap)",
                self.url
            );
        }
    }

    /// Reports held subscriptions' `CLOSED` (those still open). False when stopping.
    /// Records a subscription (`ids`: a `CollectIds` query keeping `(created_at, id)` pairs)
    /// and returns its `REQ` frame.
    fn open_req(
        &self,
        subs: &mut HashMap<String, Sub>,
        sub_id: SubscriptionId,
        filter: Filter,
        ids: Option<(Vec<(u64, EventId)>, bool)>,
    ) -> String {
        let text = ClientMessage::req(sub_id.clone(), vec![filter.clone()]).as_json();
        trace!("{} <- {text}", self.url);
        subs.insert(
            sub_id.to_string(),
            Sub {
                filter,
                stats: PageStats::default(),
                eose: false,
                ids,
            },
        );
        text
    }

    fn release(&self, generation: u64, subs: &mut HashMap<String, Sub>, held: Vec<Held>) -> bool {
        for h in held {
            if subs.remove(&h.sub_id).is_some()
                && !self.report(Report::Closed {
                    relay: self.url.clone(),
                    generation,
                    sub_id: SubscriptionId::new(h.sub_id),
                    message: h.message,
                })
            {
                return false;
            }
        }
        true
    }

    /// Answers a challenge (NIP-42). False when the engine is stopping.
    fn on_challenge(&self, ctx: &mut Session<'_>, challenge: &str) -> bool {
        let now = self.clock.now();
        match ctx.auth.on_challenge(challenge, now) {
            OnChallenge::Sign { challenge } => {
                let Some(keys) = &self.auth_keys else {
                    return true;
                };
                match auth_message(keys, &self.url, &challenge) {
                    Ok((id, text)) => {
                        debug!("{}: answering the AUTH challenge ({id})", self.url);
                        ctx.auth.auth_sent(id, now);
                        if let Err(e) = ctx.socket.write(Message::text(text)) {
                            debug!("{}: cannot send AUTH: {e}", self.url);
                        }
                    }
                    Err(e) => {
                        warn!("{}: cannot sign the NIP-42 AUTH event: {e}", self.url);
                        let released = ctx.auth.sign_failed();
                        return self.release(ctx.generation, ctx.subs, released);
                    }
                }
            }
            OnChallenge::Ignore(reason) => match reason {
                crate::core::auth::IgnoreReason::NoKey => info!(
                    "{}: AUTH challenge received; no key is configured (see --nsec-file), ignoring it",
                    self.url
                ),
                other => debug!("{}: AUTH challenge ignored ({other:?})", self.url),
            },
        }
        true
    }

    /// Handles the relay's `OK` to our AUTH event. False when the engine is stopping.
    fn on_auth_outcome(&self, ctx: &mut Session<'_>, outcome: AuthOutcome) -> bool {
        match outcome {
            AuthOutcome::Authenticated { resend } => {
                let who = self
                    .auth_keys
                    .as_ref()
                    .map(|k| k.public_key().to_hex())
                    .unwrap_or_default();
                info!(
                    "{}: authenticated (NIP-42) as {who}; sending {} held subscription(s) again",
                    self.url,
                    resend.len()
                );
                for sub_id in resend {
                    let Some(sub) = ctx.subs.get_mut(&sub_id) else {
                        continue;
                    };
                    sub.stats = PageStats::default();
                    sub.eose = false;
                    if let Some(ids) = sub.ids.as_mut() {
                        *ids = (Vec::new(), false);
                    }
                    let text =
                        ClientMessage::req(SubscriptionId::new(sub_id), vec![sub.filter.clone()])
                            .as_json();
                    trace!("{} <- {text}", self.url);
                    if let Err(e) = ctx.socket.write(Message::text(text)) {
                        debug!("{}: cannot send REQ again: {e}", self.url);
                        break;
                    }
                }
                true
            }
            AuthOutcome::Failed { reason, release } => {
                warn!(
                    "{}: the relay refused our NIP-42 AUTH ({reason:?}); not trying again on this connection, {} held subscription(s) reported as closed",
                    self.url,
                    release.len()
                );
                self.release(ctx.generation, ctx.subs, release)
            }
        }
    }

    /// Counts an event that failed its checks; the first from this relay is logged at warn
    /// level, the rest at debug (an invalid event per line would flood the log).
    fn invalid_event(&self, sub_id: &impl std::fmt::Display, e: &impl std::fmt::Display) {
        RelayCounters::inc(&self.counters.events_invalid);
        if RelayCounters::get(&self.counters.events_invalid) == 1 {
            warn!(
                "{}: dropped an invalid event on {sub_id}: {e} (dropped and counted; further ones are logged at debug level)",
                self.url
            );
        } else {
            debug!("{}: dropped an invalid event on {sub_id}: {e}", self.url);
        }
    }

    /// An EVENT frame's event, parsed from `raw` (its JSON as the relay sent it), on
    /// subscription `sub_id`. Returns false when the engine is stopping.
    fn on_event(
        &self,
        ctx: &mut Session<'_>,
        sub_id: &str,
        raw: &str,
        event: nostr::event::Event,
    ) -> bool {
        let generation = ctx.generation;
        let Some(sub) = self.event_subscription(ctx.subs, sub_id) else {
            return true;
        };
        if let Some((items, truncated)) = sub.ids.as_mut() {
            // The own relay's side of a reconciliation: only (created_at, id) of
            // what it holds for the filter; no signature check, nothing forwarded.
            if sub.eose {
                return true;
            }
            if !sub
                .filter
                .match_event(&event, nostr::filter::MatchEventOptions::new())
            {
                sub.stats.record_rejected();
                return true;
            }
            sub.stats.record_event(&event);
            if items.len() < MAX_COLLECTED_IDS {
                items.push((event.created_at.as_secs(), event.id));
            } else {
                *truncated = true;
            }
            return true;
        }
        // A copy (from another relay, another filter, or the own relay reading back
        // what the forwarder stored) has its id checked but not its signature again.
        let checked = check_parsed_cached(&event, raw, &sub.filter, &self.metrics.verified);
        if matches!(
            checked,
            Ok(SignatureCheck::Verified) | Err(EventRejection::BadSignature)
        ) {
            RelayCounters::inc(&self.counters.signature_checks);
        }
        let checked = checked.map(|_| ());
        if !sub.eose {
            // Paging trusts only checked events inside the window.
            match checked {
                Ok(()) => sub.stats.record_event(&event),
                Err(_) => sub.stats.record_rejected(),
            }
        }
        match checked {
            Ok(()) => {
                RelayCounters::inc(&self.counters.events_accepted);
                match &self.role {
                    Role::Remote(forward) => {
                        // Only one copy per forwarder: it would drop the others.
                        let forwarder = self.metrics.forwarder_restarts.load(Ordering::Relaxed);
                        // Only a reconciliation's fetch asks a remote by `ids`: the
                        // own relay was just found without the event, so it goes to
                        // the forwarder whatever an earlier copy's claim says
                        // (departure 61).
                        let missing = sub.filter.ids.is_some();
                        if !self.metrics.verified.claim_forward(&event.id, forwarder) && !missing {
                            RelayCounters::inc(&self.counters.copies_not_forwarded);
                            trace!("{}: {} already handed to the forwarder", self.url, event.id);
                            return true;
                        }
                        let item = ForwardItem {
                            id: event.id,
                            raw: Arc::from(raw),
                            admission: None,
                            missing,
                        };
                        return self.forward(forward, item, ctx.socket);
                    }
                    Role::Own => {
                        return self.report(Report::SelfEvent {
                            generation,
                            event: Box::new(event),
                        });
                    }
                }
            }
            Err(EventRejection::NotMatching) => self.unmatched(sub_id),
            Err(e) => self.invalid_event(&sub_id, &e),
        }
        true
    }

    /// A remote relay's copy of an event already verified and handed to the forwarder,
    /// recognised by the id its JSON claims ([`claimed_id`]) before anything is parsed: it
    /// is counted (received, not forwarded) and, before EOSE, counted for its page with what
    /// paging needs of the verified event; the copy's bytes are not read (departure 66).
    /// False (parse and check the copy as usual) for the own relay, for reconciliation
    /// subscriptions (their copies carry information or must be forwarded), for an unknown
    /// subscription and for any event not verified and forwarded before.
    fn forwarded_copy(&self, ctx: &mut Session<'_>, sub_id: &str, raw: &str) -> bool {
        if !matches!(self.role, Role::Remote(_)) {
            return false;
        }
        let Some(id) = claimed_id(raw) else {
            return false;
        };
        let Some(sub) = ctx.subs.get_mut(sub_id) else {
            return false;
        };
        if sub.ids.is_some() || sub.filter.ids.is_some() {
            return false;
        }
        let forwarder = self.metrics.forwarder_restarts.load(Ordering::Relaxed);
        let Some(summary) = self.metrics.verified.forwarded_copy(&id, forwarder) else {
            return false;
        };
        RelayCounters::inc(&self.counters.events_received);
        // What the summary can tell (window, kinds, authors) is checked as for a parsed copy:
        // a relay that ignores `since`/`until` must not fill a page with copies from
        // outside the window.
        if !summary_matches(&sub.filter, &summary) {
            if !sub.eose {
                sub.stats.record_rejected();
            }
            self.unmatched(sub_id);
            return true;
        }
        RelayCounters::inc(&self.counters.copies_not_forwarded);
        if !sub.eose {
            sub.stats.record_summary(&summary);
        }
        trace!("{}: {id} already handed to the forwarder", self.url);
        true
    }

    /// A valid event that does not match the subscription it arrived on.
    fn unmatched(&self, sub_id: &str) {
        RelayCounters::inc(&self.counters.events_unmatched);
        info!(
            "{}: dropped an event that does not match subscription {}",
            self.url,
            escape_for_log(sub_id, 64)
        );
    }

    /// Counts a received EVENT frame and finds its subscription; one for an unknown
    /// subscription is counted and logged, and `None` is returned.
    fn event_subscription<'s>(
        &self,
        subs: &'s mut HashMap<String, Sub>,
        sub_id: &str,
    ) -> Option<&'s mut Sub> {
        RelayCounters::inc(&self.counters.events_received);
        let sub = subs.get_mut(sub_id);
        if sub.is_none() {
            RelayCounters::inc(&self.counters.events_unknown_subscription);
            debug!(
                "{}: event for unknown subscription {}",
                self.url,
                escape_for_log(sub_id, 64)
            );
        }
        sub
    }

    /// An EVENT frame whose event JSON does not parse: counted for its subscription.
    fn malformed_event(&self, ctx: &mut Session<'_>, sub_id: &str, e: &EventRejection) {
        let Some(sub) = self.event_subscription(ctx.subs, sub_id) else {
            return;
        };
        if !sub.eose {
            sub.stats.record_rejected();
        }
        self.invalid_event(&sub_id, e);
    }

    /// Handles one text frame. Returns false when the engine is stopping.
    fn handle_text(&self, ctx: &mut Session<'_>, text: &str) -> bool {
        let generation = ctx.generation;
        // Most frames are compact EVENT frames: the event is parsed once, without a pass of
        // the JSON parser over the whole frame first. Any other shape, or JSON that is not
        // one event, is read by `parse_relay_frame` as before.
        if let Some((sub_id, raw)) = split_event_frame(text) {
            if self.forwarded_copy(ctx, sub_id, raw) {
                ctx.quick = true;
                return true;
            }
            if let Ok(event) = parse_event(raw) {
                return self.on_event(ctx, sub_id, raw, event);
            }
        }
        let msg = match parse_relay_frame(text) {
            Ok(m) => m,
            Err(e) => {
                RelayCounters::inc(&self.counters.garbage_frames);
                debug!(
                    "{}: unreadable frame ({e}): {}",
                    self.url,
                    escape_for_log(text, 120)
                );
                return true;
            }
        };
        match msg {
            Incoming::Event { sub_id, raw } => {
                let raw = raw.get();
                let event = match parse_event(raw) {
                    Ok(e) => e,
                    Err(e) => {
                        self.malformed_event(ctx, &sub_id, &e);
                        return true;
                    }
                };
                return self.on_event(ctx, &sub_id, raw, event);
            }
            Incoming::Eose(sub_id) => {
                if let Some(sub) = ctx.subs.get_mut(&sub_id) {
                    if sub.eose {
                        debug!("{}: repeated EOSE for {sub_id:?}", self.url);
                        return true;
                    }
                    sub.eose = true;
                    if let Some((items, truncated)) = sub.ids.take() {
                        return self.report(Report::OwnIds {
                            generation,
                            sub_id: SubscriptionId::new(sub_id),
                            stats: sub.stats.clone(),
                            items,
                            truncated,
                        });
                    }
                    return self.report(Report::Eose {
                        relay: self.url.clone(),
                        generation,
                        sub_id: SubscriptionId::new(sub_id),
                        stats: sub.stats.clone(),
                    });
                }
                debug!(
                    "{}: EOSE for unknown subscription {}",
                    self.url,
                    escape_for_log(&sub_id, 64)
                );
            }
            Incoming::Closed { sub_id, message } => {
                RelayCounters::inc(&self.counters.closed);
                // Relay-supplied text: escaped and capped before it reaches any log line.
                let message = escape_for_log(&message, MAX_RELAY_TEXT);
                let sub_id = sub_id.as_str();
                let shown = escape_for_log(sub_id, 64);
                if ctx.negs.remove(sub_id) {
                    return self.report(Report::NegErr {
                        relay: self.url.clone(),
                        generation,
                        sub_id: SubscriptionId::new(sub_id),
                        message,
                        closed: true,
                    });
                }
                if ctx.subs.contains_key(sub_id)
                    && ctx.auth.on_closed(sub_id, &message, self.clock.now()) == ClosedAction::Hold
                {
                    debug!(
                        "{}: subscription {shown} held until authenticated: {message}",
                        self.url
                    );
                    return true;
                }
                if ctx.subs.remove(sub_id).is_some() {
                    return self.report(Report::Closed {
                        relay: self.url.clone(),
                        generation,
                        sub_id: SubscriptionId::new(sub_id),
                        message,
                    });
                }
                debug!(
                    "{}: CLOSED for unknown subscription {shown}: {message}",
                    self.url
                );
            }
            Incoming::Notice(text) => {
                RelayCounters::inc(&self.counters.notices);
                // Escaped and bounded: the core only needs to recognise rate-limit texts, and
                // logs what it gets.
                let message = escape_for_log(&text, MAX_RELAY_TEXT);
                debug!("{}: NOTICE {message}", self.url);
                return self.report(Report::Notice {
                    relay: self.url.clone(),
                    generation,
                    message,
                });
            }
            Incoming::Auth(challenge) => {
                RelayCounters::inc(&self.counters.auth_challenges);
                return self.on_challenge(ctx, &challenge);
            }
            Incoming::Ok {
                event_id,
                accepted,
                message,
            } => match ctx.auth.on_ok(&event_id, accepted, &message) {
                Some(outcome) => return self.on_auth_outcome(ctx, outcome),
                None => debug!("{}: unexpected OK for {event_id}", self.url),
            },
            Incoming::NegMsg { sub_id, message } => {
                if !ctx.negs.contains(&sub_id) {
                    RelayCounters::inc(&self.counters.garbage_frames);
                    debug!(
                        "{}: NEG-MSG for unknown session {}; dropped",
                        self.url,
                        escape_for_log(&sub_id, 64)
                    );
                    return true;
                }
                return self.report(Report::NegMsg {
                    relay: self.url.clone(),
                    generation,
                    sub_id: SubscriptionId::new(sub_id),
                    message,
                });
            }
            Incoming::NegErr { sub_id, message } => {
                if !ctx.negs.remove(&sub_id) {
                    RelayCounters::inc(&self.counters.garbage_frames);
                    debug!(
                        "{}: NEG-ERR for unknown session {}; dropped",
                        self.url,
                        escape_for_log(&sub_id, 64)
                    );
                    return true;
                }
                return self.report(Report::NegErr {
                    relay: self.url.clone(),
                    generation,
                    sub_id: SubscriptionId::new(sub_id),
                    message: escape_for_log(&message, MAX_RELAY_TEXT),
                    closed: false,
                });
            }
            Incoming::Other(kind) => {
                RelayCounters::inc(&self.counters.garbage_frames);
                debug!("{}: ignoring {kind:?} message", self.url);
            }
        }
        true
    }

    /// Hands an event to the forwarder, waiting while its queue is full (back-pressure:
    /// this relay is not read meanwhile). Returns false when the engine is stopping.
    ///
    /// While it waits, the relay still gets a ping every ping interval, so a relay that cuts
    /// idle connections does not drop us during a long own-relay outage.
    fn forward(
        &self,
        forward: &Sender<ForwardItem>,
        mut item: ForwardItem,
        socket: &mut Socket,
    ) -> bool {
        // Read only when the hand-over has to wait (the clock is not read per event).
        let mut last_ping: Option<crate::core::time::Time> = None;
        // The byte bound: wait (pinging) until the event fits the pipeline and our share.
        let len = item.raw.len() as u64;
        let mut waited = false;
        while item.admission.is_none() {
            item.admission =
                ByteAdmission::try_take(&self.metrics, &self.counters, &self.forward_limits, len);
            if item.admission.is_some() {
                break;
            }
            if !waited {
                waited = true;
                RelayCounters::inc(&self.counters.forward_byte_waits);
                debug!("{}: forward pipeline byte bound reached; waiting", self.url);
            }
            if self.stopping() {
                return false;
            }
            self.ping_if_due(socket, &mut last_ping);
            std::thread::sleep(Duration::from_millis(10));
        }
        let unresolved = &self.metrics.forward.unresolved;
        unresolved.fetch_add(1, Ordering::Relaxed);
        loop {
            match forward.send_timeout(item, Duration::from_millis(200)) {
                Ok(()) => return true,
                Err(SendTimeoutError::Timeout(i)) => {
                    if self.stopping() {
                        unresolved.fetch_sub(1, Ordering::Relaxed);
                        return false;
                    }
                    self.ping_if_due(socket, &mut last_ping);
                    item = i;
                }
                Err(SendTimeoutError::Disconnected(_)) => {
                    unresolved.fetch_sub(1, Ordering::Relaxed);
                    return false;
                }
            }
        }
    }
}

impl ConnectionThread {
    /// Pings the relay while this thread waits to hand over an event.
    /// `last_ping` is `None` until the first call, which starts the count (the wait began).
    fn ping_if_due(&self, socket: &mut Socket, last_ping: &mut Option<crate::core::time::Time>) {
        let now = self.clock.now();
        let since = *last_ping.get_or_insert(now);
        if now.since(since) >= self.ping_interval {
            *last_ping = Some(now);
            // A failed write shows up as an error on the next read.
            let _ = socket.write(Message::Ping(Vec::new().into()));
            let _ = socket.flush();
        }
    }
}

/// How long a connect or NIP-11 request with `timeout` waits for a free pool thread before it
/// runs on a thread of its own: a quarter of its time, so every worker stuck in a slow
/// handshake cannot keep it from three quarters of its time.
fn pool_patience(timeout: Duration) -> Duration {
    timeout / 4
}

/// The relay loop's read timeouts from the websocket options.
fn ticks(ws: &WsOptions) -> crate::core::keepalive::Ticks {
    crate::core::keepalive::Ticks {
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

/// What one session's frame handlers work on.
struct Session<'a> {
    generation: u64,
    subs: &'a mut HashMap<String, Sub>,
    negs: &'a mut HashSet<String>,
    auth: &'a mut AuthState,
    socket: &'a mut Socket,
    /// Set when the frame was a copy dropped by its id: nothing waited.
    quick: bool,
}

/// Signs the NIP-42 AUTH event (kind 22242, tags `relay` and `challenge`) for `relay` and
/// returns its id and the `["AUTH", event]` frame.
pub(crate) fn auth_message(
    keys: &Keys,
    relay: &RelayUrl,
    challenge: &str,
) -> Result<(EventId, String), String> {
    let tag = |name: &str, value: &str| Tag::parse([name, value]).map_err(|e| e.to_string());
    let event = EventBuilder::new(Kind::Authentication, "")
        .tag(tag("relay", relay.as_str())?)
        .tag(tag("challenge", challenge)?)
        .finalize(keys)
        .map_err(|e| e.to_string())?;
    Ok((event.id, ClientMessage::auth(event).as_json()))
}

/// Re-export for the forwarder.
pub(crate) fn write_text(socket: &mut Socket, text: String) -> Result<(), tungstenite::Error> {
    socket.write(Message::text(text))
}
