//! [`RelaySession`]: every decision about one relay's connection, sans-IO.
//!
//! The relay thread (`engine::connection`) owns the socket, the clock and the blocking
//! hand-overs; it feeds the session what happened and carries out what the session asks for,
//! the way `quinn-proto`'s `Connection` is driven by `quinn`:
//!
//! * **in:** [`RelaySession::on_connected`] and the other connection events, a coordinator
//!   command ([`RelaySession::handle_command`]), a frame read from the socket
//!   ([`RelaySession::handle_frame`]), and [`RelaySession::handle_timeout`] when
//!   [`RelaySession::poll_timeout`] has passed — each with `now`;
//! * **out:** frames to write ([`RelaySession::poll_transmit`]), reports for the coordinator
//!   ([`RelaySession::poll_report`]), an event for the forwarder (returned by
//!   [`RelaySession::handle_frame`] as [`FrameOutcome::Forward`]), whether the connection
//!   ended ([`RelaySession::is_open`]), and counters ([`RelaySession::counters`]) that the
//!   thread publishes.
//!
//! It performs no I/O and reads no clock, so each decision has a unit test in simulated time
//! (below, and the table in `docs/architecture.md`).
//!
//! One session lives as long as its relay thread and spans its connections: what must
//! outlive one connection (whether the NIP-11 limits are known, which oversized events were
//! already logged, the counters) stays; the subscriptions, NIP-77 sessions, NIP-42 state and
//! keep-alive of a connection start fresh at [`RelaySession::on_connected`].
//!
//! Commands and reports carry the connection *generation*, so a REQ queued for an earlier
//! connection is never sent on a later one.

use crate::core::hash::{HashMap, HashSet};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use log::{debug, log, trace, warn, Level};
use nostr::event::{Event, EventId};
use nostr::filter::{Filter, MatchEventOptions};
use nostr::key::Keys;
use nostr::message::{ClientMessage, SubscriptionId};

use crate::core::auth::{
    auth_event, AuthLimits, AuthOutcome, AuthState, ClosedAction, Held, IgnoreReason, OnChallenge,
};
use crate::core::dedup::VerifiedSet;
use crate::core::keepalive::{read_timeout, Keepalive, KeepaliveAction, Ticks};
use crate::core::log_budget::LogBudget;
use crate::core::message::{
    check_parsed_cached, claimed_id, copy_matches, escape_for_log, parse_event, parse_relay_frame,
    split_event_frame, summary_matches, EventRejection, FilterPrint, Incoming, SignatureCheck,
};
use crate::core::paging::PageStats;
use crate::core::relay_text::Prefix;
use crate::core::time::Time;
use crate::core::wire::Report;
use crate::shared::RelayLimits;
use crate::shared::RelayUrl;
use scan::scan_event_frame;

pub use crate::core::wire::{Control, Disconnect, Frame, Transmit};

/// Characters of relay-supplied text (NOTICE, CLOSED reasons) kept for logs and reports.
pub const MAX_RELAY_TEXT: usize = 300;

/// `(created_at, id)` pairs one own-relay query collects at most (`Control::CollectIds`);
/// beyond, the report says `truncated` and the reconciliation falls back.
pub const MAX_COLLECTED_IDS: usize = 200_000;

/// Ids of oversized events one session remembers (so each is counted and logged once).
pub const MAX_OVERSIZED_REMEMBERED: usize = 1_000;

/// What the NIP-11 request before a connect found, as the session needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitsFetch {
    /// The relay published a document: its `limitation`.
    Fetched(RelayLimits),
    /// The relay could not be reached (connect, I/O, deadline): ask again next time.
    Unreachable,
    /// The relay answered without a usable document: keep the defaults, do not ask again.
    NoDocument,
}

/// Where a session's checked events go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionRole {
    /// A remote relay: checked events go to the forwarder ([`FrameOutcome::Forward`]).
    Remote,
    /// The own relay's self-subscription: checked events go to the coordinator
    /// ([`Report::SelfEvent`]).
    Own,
}

/// Settings of one session.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// The relay.
    pub url: RelayUrl,
    /// Where checked events go.
    pub role: SessionRole,
    /// Ping interval.
    pub ping_interval: Duration,
    /// Pong deadline.
    pub pong_timeout: Duration,
    /// Soft cap: a text frame above it is dropped and counted, the connection kept.
    pub max_event_size: usize,
    /// Key answering NIP-42 challenges (none: challenges are ignored).
    pub auth_keys: Option<Keys>,
    /// NIP-42 bounds and deadlines.
    pub auth_limits: AuthLimits,
}

/// What the shared verified set knows, passed to [`RelaySession::handle_frame`]: the set of
/// events verified by any relay thread, and the forwarder's epoch (it changes when the
/// forwarder restarts, which voids every earlier hand-over claim).
#[derive(Debug, Clone, Copy)]
pub struct Verified<'a> {
    /// Events verified recently, by any relay thread.
    pub set: &'a VerifiedSet,
    /// The forwarder's epoch (its restart count).
    pub forward_epoch: u64,
}

/// A checked event of a remote relay on its way to the forwarder.
#[derive(Debug, Clone)]
pub struct Forward {
    /// Event id.
    pub id: EventId,
    /// The event's JSON exactly as the relay sent it.
    pub raw: Arc<str>,
    /// Fetched by `ids` after a NIP-77 reconciliation found the own relay without it: the
    /// forwarder sends it even if it remembers an earlier `OK` for it.
    pub missing: bool,
}

/// What [`RelaySession::handle_frame`] made of a frame.
#[derive(Debug, Clone)]
#[must_use]
#[non_exhaustive]
pub enum FrameOutcome {
    /// A remote relay's copy of an event already handed to the forwarder, recognised by its
    /// id and dropped unparsed: nothing was queued and nothing waited.
    DroppedCopy,
    /// Handled; reports or frames to send may be queued.
    Handled,
    /// A checked event to hand to the forwarder.
    Forward(Forward),
}

/// Counters of one session, kept as plain numbers; the relay thread publishes them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionCounters {
    /// EVENT messages received.
    pub events_received: u64,
    /// Events that passed every check (handed on).
    pub events_accepted: u64,
    /// Events with a bad id or signature, or not an event at all.
    pub events_invalid: u64,
    /// Valid events that do not match the subscription they arrived on.
    pub events_unmatched: u64,
    /// Events for a subscription not open.
    pub events_unknown_subscription: u64,
    /// Frames that are not NIP-01 messages (garbage, binary, unknown types).
    pub garbage_frames: u64,
    /// NOTICE messages.
    pub notices: u64,
    /// CLOSED messages.
    pub closed: u64,
    /// AUTH challenges.
    pub auth_challenges: u64,
    /// Connections established.
    pub connects: u64,
    /// Connections lost or failed.
    pub disconnects: u64,
    /// Frames above the soft size cap (each distinct event counted once).
    pub oversized_frames: u64,
    /// Schnorr signature checks done.
    pub signature_checks: u64,
    /// Events not handed to the forwarder because a copy already was.
    pub copies_not_forwarded: u64,
    /// Ids a reconciliation's fetch did not ask for because a copy of the event was on its
    /// way to the own relay ([`RelaySession::handle_command_with`]).
    pub fetch_ids_in_flight: u64,
}

/// The deadlines of a session, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Timer {
    /// The next ping, or the pong deadline of the last one ([`Keepalive`]).
    Keepalive,
    /// The earliest deadline of a subscription held for NIP-42 ([`AuthState`]).
    AuthHold,
}

impl Timer {
    const ALL: [Timer; 2] = [Timer::Keepalive, Timer::AuthHold];
}

/// One deadline per [`Timer`] kind.
#[derive(Debug, Clone, Copy, Default)]
struct TimerTable {
    data: [Option<Time>; 2],
}

impl TimerTable {
    fn set(&mut self, timer: Timer, at: Option<Time>) {
        self.data[timer as usize] = at;
    }

    fn next_timeout(&self) -> Option<Time> {
        self.data.iter().flatten().min().copied()
    }

    fn is_expired(&self, timer: Timer, now: Time) -> bool {
        self.data[timer as usize].is_some_and(|t| t <= now)
    }
}

/// A subscription open on the connection.
#[derive(Debug)]
struct Sub {
    filter: std::sync::Arc<Filter>,
    /// What its events must also match (not sent).
    scope: Option<std::sync::Arc<Filter>>,
    /// What arrived before EOSE (for paging decisions).
    stats: PageStats,
    eose: bool,
    /// A `CollectIds` query: `(created_at, id)` of its events, and whether the bound cut it.
    ids: Option<(Vec<(u64, EventId)>, bool)>,
    /// A query by `ids` on a remote relay (a reconciliation's fetch): what it has not
    /// delivered yet, and what it left out as in flight ([`FetchTrack`]).
    fetch: Option<Box<FetchTrack>>,
    /// Its filter's tag conditions as hashes, built at its first copy recognised by id.
    print: Option<FilterPrint>,
    /// A `CollectIds` query: the verified set's clock when it was sent (reported with its
    /// ids: [`Report::OwnIds`]).
    clock: u32,
    /// Its REQ was never written (a fetch left with nothing to ask): no CLOSE for it.
    unsent: bool,
    /// A REQ of several filters ([`Control::SubscribeMany`], decision 0110): its members,
    /// each the machine's own subscription (empty for a REQ of one filter). Then `filter` is
    /// the first member's, and `stats` counts what arrived before EOSE that no member can be
    /// credited with (invalid, unmatched, oversized): every member is charged with it.
    pack: Vec<Member>,
}

/// One filter of a REQ of several ([`Sub::pack`]): the machine's subscription it stands for.
#[derive(Debug)]
struct Member {
    id: String,
    filter: Arc<Filter>,
    /// Checked events matching this filter that arrived before its EOSE (a relay caps
    /// each filter of a REQ on its own: strfry, nostr-rs-relay).
    stats: PageStats,
    /// Its EOSE was reported (at the REQ's EOSE, or at once for a live-only filter).
    eose: bool,
    /// Not unsubscribed by the machine yet.
    open: bool,
    print: Option<FilterPrint>,
}

/// What a query by `ids` (a reconciliation's fetch) was asked for and has delivered: at its
/// EOSE, the ids neither delivered nor safely elsewhere are reported
/// ([`PageStats::undelivered`]) so that the machine asks again or says so (issue 33: a
/// fetch never ends short in silence).
#[derive(Debug, Default)]
struct FetchTrack {
    /// Asked for and not delivered yet (delivered: a checked copy, or a copy recognised by
    /// its id while the event is in flight to the own relay).
    asked: HashSet<EventId>,
    /// Left out of the REQ because the event was in flight to the own relay then
    /// ([`VerifiedSet::in_flight_copy`]), or handed to the forwarder by another query of
    /// this connection while the fetch was held; at EOSE each must be in flight still or
    /// stored.
    pruned: Vec<EventId>,
    /// While the fetch is held (not sent yet): the history queries of this connection it
    /// waits for ([`RelaySession::handle_command`]). `None` once sent.
    waits_for: Option<HashSet<String>>,
    /// The verified set's clock when the own relay's side was read (the command's
    /// `fetch_since`): ids handed over since are left out when the held fetch is sent.
    since: Option<u32>,
}

/// The state of one open connection.
#[derive(Debug)]
struct Connection {
    generation: u64,
    subs: HashMap<String, Sub>,
    /// Members of a REQ of several filters, other than its first: member id → the REQ's id
    /// ([`Sub::pack`]).
    packed: HashMap<String, String>,
    /// Open NIP-77 sessions (NEG-OPEN sent, no NEG-ERR/CLOSED/NEG-CLOSE yet).
    negs: HashSet<String>,
    /// Fetches held until the history queries open before them reached EOSE (their sub ids;
    /// [`FetchTrack::waits_for`]).
    held: Vec<String>,
    auth: AuthState,
    keepalive: Keepalive,
}

/// Every decision about one relay's connections. See the module documentation.
#[derive(Debug)]
pub struct RelaySession {
    config: SessionConfig,
    conn: Option<Connection>,
    /// The NIP-11 limits were fetched, or the relay answered without a document.
    limits_known: bool,
    oversized_seen: HashSet<EventId>,
    counters: SessionCounters,
    /// Rate limit of the log lines the relay can provoke at will ([`LogBudget`]).
    log_budget: LogBudget,
    timers: TimerTable,
    transmits: VecDeque<Transmit>,
    reports: VecDeque<Report>,
}

impl RelaySession {
    /// A session with no connection yet.
    #[must_use]
    pub fn new(config: SessionConfig) -> RelaySession {
        RelaySession {
            config,
            conn: None,
            limits_known: false,
            oversized_seen: HashSet::default(),
            counters: SessionCounters::default(),
            log_budget: LogBudget::default(),
            timers: TimerTable::default(),
            transmits: VecDeque::new(),
            reports: VecDeque::new(),
        }
    }

    /// The relay.
    pub fn url(&self) -> &RelayUrl {
        &self.config.url
    }

    /// The counters so far (the thread publishes them).
    pub fn counters(&self) -> &SessionCounters {
        &self.counters
    }

    /// The rate limit of this relay's log lines: how many went out at their level and how
    /// many were demoted to debug level.
    pub fn log_budget(&self) -> &LogBudget {
        &self.log_budget
    }

    /// Logs, at info level, how many lines of each kind were demoted in windows ended by
    /// `now`.
    fn log_summaries(&mut self, now: Time) {
        let url = &self.config.url;
        let window = self.log_budget.window();
        self.log_budget.summaries(now, |kind, n| {
            log::info!(
                "{url}: {n} log line(s) of kind `{kind}` logged at debug level in the last {window:?} (rate limit; the counters count all)"
            );
        });
    }

    /// True while a connection is open (between [`RelaySession::on_connected`] and its end).
    pub fn is_open(&self) -> bool {
        self.conn.is_some()
    }

    /// The generation of the open connection.
    pub fn generation(&self) -> Option<u64> {
        self.conn.as_ref().map(|c| c.generation)
    }

    // ----- NIP-11 -----

    /// Whether the NIP-11 document should be asked for before the next connect: until it
    /// was read, or the relay answered without one.
    pub fn wants_limits(&self) -> bool {
        !self.limits_known
    }

    /// The NIP-11 request's result: limits are reported (before `Connected`, so the first
    /// REQs already use them); an unreachable relay is asked again on the next connect, one
    /// that answered without a usable document keeps the defaults.
    pub fn on_limits(&mut self, fetched: LimitsFetch) {
        match fetched {
            LimitsFetch::Fetched(limits) => {
                debug!("{}: NIP-11 {limits:?}", self.config.url);
                self.limits_known = true;
                self.reports.push_back(Report::Limits {
                    relay: self.config.url.clone(),
                    limits,
                });
            }
            LimitsFetch::NoDocument => self.limits_known = true,
            LimitsFetch::Unreachable => {}
        }
    }

    /// Marks the limits known without asking (NIP-11 requests are off).
    pub fn skip_limits(&mut self) {
        self.limits_known = true;
    }

    // ----- connection events -----

    /// The engine refused to connect (address policy): reported; the coordinator then
    /// forgets the relay.
    pub fn on_refused(&mut self, generation: u64, reason: crate::shared::Refusal) {
        self.reports.push_back(Report::Refused {
            relay: self.config.url.clone(),
            generation,
            reason,
        });
    }

    /// A connect attempt of `generation` failed.
    pub fn on_connect_failed(&mut self, generation: u64, cause: Disconnect) {
        self.counters.disconnects += 1;
        self.reports.push_back(Report::Disconnected {
            relay: self.config.url.clone(),
            generation,
            cause,
        });
    }

    /// The websocket of `generation` is open at `now`: a fresh connection state, reported.
    pub fn on_connected(&mut self, generation: u64, now: Time) {
        self.counters.connects += 1;
        let has_key = self.config.auth_keys.is_some();
        self.conn = Some(Connection {
            generation,
            subs: HashMap::default(),
            packed: HashMap::default(),
            negs: HashSet::default(),
            held: Vec::new(),
            auth: AuthState::new(has_key, self.config.auth_limits),
            keepalive: Keepalive::new(now, self.config.ping_interval, self.config.pong_timeout),
        });
        self.transmits.clear();
        self.update_timers();
        self.reports.push_back(Report::Connected {
            relay: self.config.url.clone(),
            generation,
        });
    }

    /// The open connection was lost (`cause`): reported, and its state forgotten.
    pub fn on_lost(&mut self, cause: Disconnect) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        self.counters.disconnects += 1;
        self.transmits.clear();
        self.timers = TimerTable::default();
        self.reports.push_back(Report::Disconnected {
            relay: self.config.url.clone(),
            generation: conn.generation,
            cause,
        });
    }

    /// The thread closes the connection itself (a new `Connect`, or shutdown): its state is
    /// forgotten without a report.
    pub fn on_closed_locally(&mut self) {
        self.conn = None;
        self.transmits.clear();
        self.timers = TimerTable::default();
    }

    // ----- commands -----

    /// [`RelaySession::handle_command`] for the engine, which knows what is in flight: a
    /// reconciliation's fetch (a [`Control::Subscribe`] naming ids) does not ask for the ids
    /// of events handed to the current forwarder and not yet confirmed by the own relay
    /// ([`VerifiedSet::in_flight_copy`]): the forwarder would drop their copies, and the
    /// events reach the own relay anyway (a first sync reconciles one relay while another
    /// relay's copies are on their way), nor, with `fetch_since`, the ids handed over or
    /// confirmed since the own relay's side was read (decision 0112). At least one id is
    /// kept, so the fetch is still a REQ with its EOSE. A `CollectIds` query notes the
    /// verified set's clock ([`VerifiedSet::clock`]) for its report.
    pub fn handle_command_with(&mut self, now: Time, command: Control, verified: Verified<'_>) {
        let mut left_out = Vec::new();
        let mut clock = None;
        let command = match command {
            Control::Subscribe {
                generation,
                sub_id,
                filter,
                scope,
                fetch_since,
            } => {
                let filter = match without_ids_in_flight(&filter, verified, fetch_since) {
                    Some((pruned, skipped)) => {
                        self.counters.fetch_ids_in_flight += skipped.len() as u64;
                        trace!(
                            "{}: {sub_id} does not ask for {} ids in flight",
                            self.config.url,
                            skipped.len()
                        );
                        left_out = skipped;
                        pruned
                    }
                    None => filter,
                };
                if filter.ids.as_ref().is_some_and(|ids| ids.is_empty()) {
                    // Nothing left to ask for: no REQ (an empty `ids` may read as no
                    // condition at all); its EOSE is reported here, with what is neither in
                    // flight nor stored by now.
                    if self.generation() == Some(generation) {
                        let track = FetchTrack {
                            pruned: left_out,
                            ..FetchTrack::default()
                        };
                        self.reports.push_back(Report::Eose {
                            relay: self.config.url.clone(),
                            generation,
                            sub_id,
                            stats: PageStats {
                                undelivered: undelivered(track, verified),
                                ..PageStats::default()
                            },
                        });
                    }
                    return;
                }
                Control::Subscribe {
                    generation,
                    sub_id,
                    filter,
                    scope,
                    fetch_since,
                }
            }
            c @ Control::CollectIds { .. } => {
                clock = Some(verified.set.clock());
                c
            }
            other => other,
        };
        let sub_id = match &command {
            Control::Subscribe { sub_id, .. } if !left_out.is_empty() => Some(sub_id.clone()),
            Control::CollectIds { sub_id, .. } => Some(sub_id.clone()),
            _ => None,
        };
        self.handle_command(now, command);
        let Some(sub) = sub_id.and_then(|s| self.conn.as_mut()?.subs.get_mut(s.as_str())) else {
            return;
        };
        if let Some(clock) = clock {
            sub.clock = clock;
        }
        if let Some(track) = sub.fetch.as_mut() {
            track.pruned.extend(left_out);
        }
    }

    /// A coordinator command at `now`. Commands of another generation than the open
    /// connection's (or with none open) are dropped; so are the thread's own `Connect`,
    /// `Shutdown` and `Panic`, which the thread handles before.
    pub fn handle_command(&mut self, now: Time, command: Control) {
        let url = &self.config.url;
        let Some(conn) = self.conn.as_mut() else {
            trace!("{url}: dropping {command:?} while disconnected");
            return;
        };
        conn.keepalive.on_work(now);
        let current = conn.generation;
        let text = match command {
            Control::Subscribe {
                generation,
                sub_id,
                filter,
                scope,
                fetch_since,
            } if generation == current => {
                let live_only = filter.limit == Some(0);
                let fetch = self.config.role == SessionRole::Remote && filter.ids.is_some();
                let text = open_req(url, conn, sub_id.clone(), filter, None);
                if let Some(sub) = conn.subs.get_mut(sub_id.as_str()) {
                    sub.scope = scope;
                    if let Some(track) = sub.fetch.as_mut() {
                        track.since = fetch_since;
                    }
                }
                if fetch && hold_fetch(conn, sub_id.as_str()) {
                    trace!("{url}: {sub_id} held until the history queries before it end");
                    self.update_timers();
                    return;
                }
                if live_only {
                    // A REQ for new events only has no history to end: it is live once sent.
                    // Its EOSE is reported now, not awaited: nostr-rs-relay never sends one
                    // for a REQ whose filters all have `limit: 0`, and a relay that does
                    // sends it right away (a late one is dropped as a repeat).
                    if let Some(sub) = conn.subs.get_mut(sub_id.as_str()) {
                        sub.eose = true;
                    }
                    trace!("{url}: {sub_id} is live-only: live once sent");
                    self.reports.push_back(Report::Eose {
                        relay: url.clone(),
                        generation: current,
                        sub_id,
                        stats: PageStats::default(),
                    });
                }
                Some(text)
            }
            Control::SubscribeMany {
                generation,
                members,
            } if generation == current => open_pack(url, conn, members).map(|(text, reports)| {
                self.reports.extend(reports);
                text
            }),
            Control::CollectIds {
                generation,
                sub_id,
                filter,
            } if generation == current => Some(open_req(
                url,
                conn,
                sub_id,
                std::sync::Arc::new(*filter),
                Some((Vec::new(), false)),
            )),
            Control::NegOpen {
                generation,
                sub_id,
                filter,
                message,
            } if generation == current => {
                conn.negs.insert(sub_id.to_string());
                let text = ClientMessage::neg_open(sub_id, *filter, message).as_json();
                trace!("{url} <- {}", escape_for_log(&text, 200));
                Some(text)
            }
            Control::NegMsg {
                generation,
                sub_id,
                message,
            } if generation == current => Some(
                ClientMessage::NegMsg {
                    subscription_id: std::borrow::Cow::Owned(sub_id),
                    message: std::borrow::Cow::Owned(message),
                }
                .as_json(),
            ),
            Control::NegClose { generation, sub_id } if generation == current => {
                conn.negs.remove(sub_id.as_str()).then(|| {
                    ClientMessage::NegClose {
                        subscription_id: std::borrow::Cow::Owned(sub_id),
                    }
                    .as_json()
                })
            }
            Control::Unsubscribe { generation, sub_id } if generation == current => {
                // A fetch held back or with nothing left to ask (never packed, never sent):
                // nothing to close on the wire.
                let unsent = conn.held.iter().any(|h| *h == sub_id.as_str())
                    || conn.subs.get(sub_id.as_str()).is_some_and(|s| s.unsent);
                if unsent {
                    conn.held.retain(|h| *h != sub_id.as_str());
                    conn.subs.remove(sub_id.as_str());
                    conn.auth.forget(sub_id.as_str());
                    self.query_ended(sub_id.as_str(), None);
                    self.update_timers();
                    return;
                }
                // A member of a REQ of several filters: the REQ is closed with its last one.
                let wire = conn
                    .packed
                    .remove(sub_id.as_str())
                    .unwrap_or_else(|| sub_id.to_string());
                let last = match conn.subs.get_mut(&wire) {
                    // Not on the wire (closed by the relay, or a fetch that asked for
                    // nothing and sent no REQ): nothing to close.
                    None => {
                        self.update_timers();
                        return;
                    }
                    Some(sub) if !sub.pack.is_empty() => {
                        for m in sub.pack.iter_mut().filter(|m| m.id == sub_id.as_str()) {
                            m.open = false;
                        }
                        !sub.pack.iter().any(|m| m.open)
                    }
                    _ => true,
                };
                if last {
                    if let Some(sub) = conn.subs.remove(&wire) {
                        for m in &sub.pack {
                            conn.packed.remove(&m.id);
                        }
                    }
                    conn.auth.forget(&wire);
                    let text = ClientMessage::close(SubscriptionId::new(wire.as_str())).as_json();
                    self.query_ended(&wire, None);
                    Some(text)
                } else {
                    None
                }
            }
            other => {
                trace!("{url}: dropping stale {other:?}");
                None
            }
        };
        if let Some(text) = text {
            self.transmits.push_back(Transmit::Text(text));
        }
        self.update_timers();
    }

    // ----- frames -----

    /// A frame read at `now`. `verified` is the shared verified set (copies of events
    /// verified before are not verified again; a remote relay's copy of an event already
    /// handed to the forwarder is dropped by its id).
    pub fn handle_frame(
        &mut self,
        now: Time,
        frame: Frame<'_>,
        verified: Verified<'_>,
    ) -> FrameOutcome {
        self.log_summaries(now);
        let Some(conn) = self.conn.as_mut() else {
            return FrameOutcome::Handled;
        };
        // Keep-alive traffic (the pong to our own ping) is not work: it keeps a quiet
        // connection on its long tick.
        conn.keepalive
            .on_frame(now, matches!(frame, Frame::Ping | Frame::Pong));
        let outcome = match frame {
            Frame::Text(text) if text.len() > self.config.max_event_size => {
                self.oversized(text);
                FrameOutcome::Handled
            }
            Frame::Text(text) => self.handle_text(now, text, verified),
            Frame::Binary => {
                self.counters.garbage_frames += 1;
                debug!("{}: ignoring a binary frame", self.config.url);
                FrameOutcome::Handled
            }
            Frame::Ping | Frame::Pong => FrameOutcome::Handled,
            Frame::Close(close) => {
                let (code, reason) = match close {
                    Some((code, reason)) => (Some(code), escape_for_log(reason, MAX_RELAY_TEXT)),
                    None => (None, String::new()),
                };
                self.on_lost(Disconnect::ClosedByRelay { code, reason });
                FrameOutcome::Handled
            }
        };
        self.update_timers();
        outcome
    }

    fn handle_text(&mut self, now: Time, text: &str, verified: Verified<'_>) -> FrameOutcome {
        // Most frames are compact EVENT frames: the event is parsed once, without a pass of
        // the JSON parser over the whole frame first. Any other shape, or JSON that is not
        // one event, is read by `parse_relay_frame`.
        if let Some((sub_id, raw)) = split_event_frame(text) {
            if self.unknown_subscription(sub_id) {
                return FrameOutcome::Handled;
            }
            if self.forwarded_copy(now, sub_id, raw, verified) {
                return FrameOutcome::DroppedCopy;
            }
            if self.collected_copy(sub_id, raw, verified) {
                return FrameOutcome::Handled;
            }
            if let Ok(event) = parse_event(raw) {
                return self.on_event(now, sub_id, raw, event, verified);
            }
        }
        let msg = match parse_relay_frame(text) {
            Ok(m) => m,
            Err(e) => {
                self.counters.garbage_frames += 1;
                debug!(
                    "{}: unreadable frame ({e}): {}",
                    self.config.url,
                    escape_for_log(text, 120)
                );
                return FrameOutcome::Handled;
            }
        };
        match msg {
            Incoming::Event { sub_id, raw } => {
                let raw = raw.get();
                if self.unknown_subscription(&sub_id) {
                    return FrameOutcome::Handled;
                }
                return match parse_event(raw) {
                    Ok(event) => self.on_event(now, &sub_id, raw, event, verified),
                    Err(e) => {
                        self.malformed_event(&sub_id, &e);
                        FrameOutcome::Handled
                    }
                };
            }
            Incoming::Eose(sub_id) => return self.on_eose(&sub_id, verified),
            Incoming::Closed {
                sub_id,
                prefix,
                message,
            } => return self.on_closed(now, &sub_id, prefix, &message),
            Incoming::Notice(text) => {
                self.counters.notices += 1;
                // Escaped and bounded: the core only needs to recognise rate-limit texts, and
                // logs what it gets.
                let message = escape_for_log(&text, MAX_RELAY_TEXT);
                debug!("{}: NOTICE {message}", self.config.url);
                let generation = self.current_generation();
                self.reports.push_back(Report::Notice {
                    relay: self.config.url.clone(),
                    generation,
                    message,
                });
            }
            Incoming::Auth(challenge) => {
                self.counters.auth_challenges += 1;
                self.on_challenge(now, &challenge);
            }
            Incoming::Ok {
                event_id,
                accepted,
                message,
            } => {
                let outcome = self
                    .conn
                    .as_mut()
                    .and_then(|c| c.auth.on_ok(&event_id, accepted, &message));
                match outcome {
                    Some(outcome) => self.on_auth_outcome(now, outcome),
                    None => debug!("{}: unexpected OK for {event_id}", self.config.url),
                }
            }
            Incoming::NegMsg { sub_id, message } => {
                let known = self.conn.as_ref().is_some_and(|c| c.negs.contains(&sub_id));
                if !known {
                    self.counters.garbage_frames += 1;
                    debug!(
                        "{}: NEG-MSG for unknown session {}; dropped",
                        self.config.url,
                        escape_for_log(&sub_id, 64)
                    );
                    return FrameOutcome::Handled;
                }
                let generation = self.current_generation();
                self.reports.push_back(Report::NegMsg {
                    relay: self.config.url.clone(),
                    generation,
                    sub_id: SubscriptionId::new(sub_id),
                    message,
                });
            }
            Incoming::NegErr { sub_id, message } => {
                let known = self.conn.as_mut().is_some_and(|c| c.negs.remove(&sub_id));
                if !known {
                    self.counters.garbage_frames += 1;
                    debug!(
                        "{}: NEG-ERR for unknown session {}; dropped",
                        self.config.url,
                        escape_for_log(&sub_id, 64)
                    );
                    return FrameOutcome::Handled;
                }
                let generation = self.current_generation();
                self.reports.push_back(Report::NegErr {
                    relay: self.config.url.clone(),
                    generation,
                    sub_id: SubscriptionId::new(sub_id),
                    message: escape_for_log(&message, MAX_RELAY_TEXT),
                    closed: false,
                });
            }
            Incoming::Other(kind) => {
                self.counters.garbage_frames += 1;
                debug!("{}: ignoring {kind:?} message", self.config.url);
            }
        }
        FrameOutcome::Handled
    }

    fn current_generation(&self) -> u64 {
        self.conn.as_ref().map_or(0, |c| c.generation)
    }

    /// EOSE: the subscription's history is complete. A `CollectIds` query reports what it
    /// collected; any other reports what arrived before (for paging). A repeated EOSE, or
    /// one for a subscription not open, is logged and dropped.
    fn on_eose(&mut self, sub_id: &str, verified: Verified<'_>) -> FrameOutcome {
        let url = &self.config.url;
        let Some(conn) = self.conn.as_mut() else {
            return FrameOutcome::Handled;
        };
        let Some(sub) = conn.subs.get_mut(sub_id) else {
            debug!(
                "{url}: EOSE for unknown subscription {}",
                escape_for_log(sub_id, 64)
            );
            return FrameOutcome::Handled;
        };
        if sub.eose {
            debug!("{url}: repeated EOSE for {}", escape_for_log(sub_id, 64));
            return FrameOutcome::Handled;
        }
        if sub.fetch.as_ref().is_some_and(|t| t.waits_for.is_some()) {
            debug!(
                "{url}: EOSE for {}, a fetch not sent yet; dropped",
                escape_for_log(sub_id, 64)
            );
            return FrameOutcome::Handled;
        }
        sub.eose = true;
        let generation = conn.generation;
        if !sub.pack.is_empty() {
            // Each member's history is complete: its own statistics, charged with what no
            // member could be credited with.
            let shared = &sub.stats;
            for m in sub.pack.iter_mut().filter(|m| !m.eose) {
                m.eose = true;
                if !m.open {
                    continue;
                }
                let mut stats = std::mem::take(&mut m.stats);
                stats.rejected = stats
                    .rejected
                    .saturating_add(shared.rejected)
                    .saturating_add(shared.received);
                self.reports.push_back(Report::Eose {
                    relay: url.clone(),
                    generation,
                    sub_id: SubscriptionId::new(m.id.as_str()),
                    stats,
                });
            }
            return FrameOutcome::Handled;
        }
        if let Some(track) = sub.fetch.take() {
            sub.stats.undelivered = undelivered(*track, verified);
            if !sub.stats.undelivered.is_empty() {
                debug!(
                    "{url}: {} ids asked for by {} were not delivered",
                    sub.stats.undelivered.len(),
                    escape_for_log(sub_id, 64)
                );
            }
        }
        // A `CollectIds` query keeps its marker (an empty list): what arrives after its EOSE,
        // until the machine closes it, is not the own relay's history to report.
        let report = match sub.ids.as_mut().map(std::mem::take) {
            Some((items, truncated)) => Report::OwnIds {
                generation,
                sub_id: SubscriptionId::new(sub_id),
                stats: sub.stats.clone(),
                items,
                truncated,
                clock: sub.clock,
            },
            None => Report::Eose {
                relay: url.clone(),
                generation,
                sub_id: SubscriptionId::new(sub_id),
                stats: sub.stats.clone(),
            },
        };
        self.reports.push_back(report);
        self.query_ended(sub_id, Some(verified));
        FrameOutcome::Handled
    }

    /// CLOSED: a NIP-77 session's CLOSED is a NEG-ERR; a subscription closed with
    /// `auth-required:` while NIP-42 may still help is held (not reported) until the relay
    /// accepted us or the wait is over ([`AuthState::on_closed`]); any other is reported.
    fn on_closed(
        &mut self,
        now: Time,
        sub_id: &str,
        prefix: Prefix,
        message: &str,
    ) -> FrameOutcome {
        self.counters.closed += 1;
        let url = &self.config.url;
        let Some(conn) = self.conn.as_mut() else {
            return FrameOutcome::Handled;
        };
        // Relay-supplied text: escaped and capped before it reaches any log line.
        let message = escape_for_log(message, MAX_RELAY_TEXT);
        let shown = escape_for_log(sub_id, 64);
        let generation = conn.generation;
        if conn.negs.remove(sub_id) {
            self.reports.push_back(Report::NegErr {
                relay: url.clone(),
                generation,
                sub_id: SubscriptionId::new(sub_id),
                message,
                closed: true,
            });
            return FrameOutcome::Handled;
        }
        if conn.subs.contains_key(sub_id)
            && conn.auth.on_closed(sub_id, prefix, &message, now) == ClosedAction::Hold
        {
            debug!("{url}: subscription {shown} held until authenticated: {message}");
            return FrameOutcome::Handled;
        }
        if let Some(sub) = conn.subs.remove(sub_id) {
            // Every open member of a REQ of several filters is closed with it.
            for id in closed_members(&mut conn.packed, sub_id.to_string(), sub) {
                self.reports.push_back(Report::Closed {
                    relay: url.clone(),
                    generation,
                    sub_id: SubscriptionId::new(id),
                    prefix,
                    message: message.clone(),
                });
            }
            self.query_ended(sub_id, None);
            return FrameOutcome::Handled;
        }
        debug!("{url}: CLOSED for unknown subscription {shown}: {message}");
        FrameOutcome::Handled
    }

    /// Answers a NIP-42 challenge with a signed AUTH event when a key is configured.
    fn on_challenge(&mut self, now: Time, challenge: &str) {
        let url = &self.config.url;
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        match conn.auth.on_challenge(challenge, now) {
            OnChallenge::Sign { challenge } => {
                let Some(keys) = &self.config.auth_keys else {
                    return;
                };
                match auth_event(keys, url, &challenge, now) {
                    Ok((id, text)) => {
                        debug!("{url}: answering the AUTH challenge ({id})");
                        conn.auth.auth_sent(id, now);
                        self.transmits.push_back(Transmit::Text(text));
                    }
                    Err(e) => {
                        log!(
                            budgeted(&mut self.log_budget, now, "auth-sign", Level::Warn),
                            "{url}: cannot sign the NIP-42 AUTH event: {e}"
                        );
                        let released = conn.auth.sign_failed();
                        self.release(released);
                    }
                }
            }
            OnChallenge::Ignore(IgnoreReason::NoKey) => log!(
                budgeted(&mut self.log_budget, now, "auth-no-key", Level::Info),
                "{url}: AUTH challenge received; no key is configured (see --nsec-file), ignoring it"
            ),
            OnChallenge::Ignore(other) => debug!("{url}: AUTH challenge ignored ({other:?})"),
        }
    }

    /// The relay's `OK` to our AUTH event: held subscriptions are sent again, or released
    /// (reported as closed) when the relay refused us.
    fn on_auth_outcome(&mut self, now: Time, outcome: AuthOutcome) {
        let url = &self.config.url;
        match outcome {
            AuthOutcome::Authenticated { resend } => {
                let who = self
                    .config
                    .auth_keys
                    .as_ref()
                    .map(|k| k.public_key().to_hex())
                    .unwrap_or_default();
                log!(
                    budgeted(&mut self.log_budget, now, "auth-ok", Level::Info),
                    "{url}: authenticated (NIP-42) as {who}; sending {} held subscription(s) again",
                    resend.len()
                );
                let Some(conn) = self.conn.as_mut() else {
                    return;
                };
                for sub_id in resend {
                    let Some(sub) = conn.subs.get_mut(&sub_id) else {
                        continue;
                    };
                    sub.stats = PageStats::default();
                    if let Some(ids) = sub.ids.as_mut() {
                        *ids = (Vec::new(), false);
                    }
                    for m in &mut sub.pack {
                        m.stats = PageStats::default();
                        m.eose = m.eose && m.filter.limit == Some(0);
                    }
                    // A live-only REQ stays live (its EOSE was reported when first sent, and
                    // nostr-rs-relay sends none): a fetch must not wait for it.
                    sub.eose = if sub.pack.is_empty() {
                        sub.eose && sub.filter.limit == Some(0)
                    } else {
                        sub.pack.iter().all(|m| m.eose)
                    };
                    let text = sub_text(sub_id.as_str(), sub);
                    trace!("{url} <- {text}");
                    self.transmits.push_back(Transmit::Text(text));
                }
            }
            AuthOutcome::Failed { reason, release } => {
                log!(
                    budgeted(&mut self.log_budget, now, "auth-refused", Level::Warn),
                    "{url}: the relay refused our NIP-42 AUTH ({reason:?}); not trying again on this connection, {} held subscription(s) reported as closed",
                    release.len()
                );
                self.release(release);
            }
        }
    }

    /// Reports the `CLOSED` of held subscriptions that are still open.
    fn release(&mut self, held: Vec<Held>) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let generation = conn.generation;
        let mut ended = Vec::new();
        for h in held {
            if let Some(sub) = conn.subs.remove(&h.sub_id) {
                ended.push(h.sub_id.clone());
                for id in closed_members(&mut conn.packed, h.sub_id, sub) {
                    self.reports.push_back(Report::Closed {
                        relay: self.config.url.clone(),
                        generation,
                        sub_id: SubscriptionId::new(id),
                        prefix: h.prefix,
                        message: h.message.clone(),
                    });
                }
            }
        }
        for sub_id in ended {
            self.query_ended(&sub_id, None);
        }
    }

    /// Query `sub_id` of the connection ended (EOSE, CLOSED, closed by us): a fetch held for
    /// it and for nothing else now is sent, without the ids another query of the connection
    /// handed to the forwarder meanwhile, nor (with `verified`) those in flight to the own
    /// relay now ([`RelaySession::handle_command`]).
    fn query_ended(&mut self, sub_id: &str, verified: Option<Verified<'_>>) {
        let url = &self.config.url;
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if conn.held.is_empty() {
            return;
        }
        let mut ready = Vec::new();
        for fetch_id in &conn.held {
            let Some(track) = conn.subs.get_mut(fetch_id).and_then(|s| s.fetch.as_mut()) else {
                continue;
            };
            if let Some(waits) = track.waits_for.as_mut() {
                waits.remove(sub_id);
                if waits.is_empty() {
                    ready.push(fetch_id.clone());
                }
            }
        }
        conn.held
            .retain(|h| !ready.contains(h) && conn.subs.contains_key(h));
        for fetch_id in ready {
            let Some(sub) = conn.subs.get_mut(&fetch_id) else {
                continue;
            };
            let Some(track) = sub.fetch.as_mut() else {
                continue;
            };
            track.waits_for = None;
            if let Some(v) = verified {
                let since = track.since;
                let in_flight: Vec<EventId> = track
                    .asked
                    .iter()
                    .filter(|id| handed_over(v, id, since))
                    .copied()
                    .collect();
                for id in in_flight {
                    track.asked.remove(&id);
                    track.pruned.push(id);
                    self.counters.fetch_ids_in_flight += 1;
                }
            }
            let nothing_left = track.asked.is_empty();
            if nothing_left && verified.is_none() {
                // Without the verified set at hand, one id is asked for again.
                if let Some(id) = track.pruned.pop() {
                    track.asked.insert(id);
                    self.counters.fetch_ids_in_flight -= 1;
                }
            }
            if let (true, Some(v)) = (nothing_left, verified) {
                // Nothing left to ask for: no REQ; its EOSE is reported here.
                if let Some(track) = sub.fetch.take() {
                    sub.eose = true;
                    sub.stats.undelivered = undelivered(*track, v);
                }
                sub.unsent = true;
                self.reports.push_back(Report::Eose {
                    relay: url.clone(),
                    generation: conn.generation,
                    sub_id: SubscriptionId::new(fetch_id.as_str()),
                    stats: sub.stats.clone(),
                });
                continue;
            }
            let Some(track) = sub.fetch.as_ref() else {
                continue;
            };
            let mut filter = (*sub.filter).clone();
            filter.ids = Some(track.asked.iter().copied().collect());
            sub.filter = Arc::new(filter);
            let text = req_text(&fetch_id, &sub.filter);
            trace!("{url} <- {text} (held fetch released)");
            self.transmits.push_back(Transmit::Text(text));
        }
    }

    /// An event of a history query of this connection was handed to the forwarder (or is in
    /// flight to the own relay): a held fetch need not ask for it.
    fn strike_from_held(&mut self, id: &EventId) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        for fetch_id in &conn.held {
            let Some(track) = conn.subs.get_mut(fetch_id).and_then(|s| s.fetch.as_mut()) else {
                continue;
            };
            if track.asked.remove(id) {
                track.pruned.push(*id);
                self.counters.fetch_ids_in_flight += 1;
            }
        }
    }

    /// A remote relay's copy of an event already verified and handed to the forwarder,
    /// recognised by the id its JSON claims ([`claimed_id`]) before anything is parsed: it
    /// is counted (received, not forwarded) and, before EOSE, counted for its page with what
    /// paging needs of the verified event; the copy's bytes are not read. False (parse and
    /// check the copy as usual) for the own relay, for the own relay's side of a
    /// reconciliation (its copies carry information), for an unknown subscription and for
    /// any event not verified and forwarded before; on a reconciliation's fetch, for any
    /// event not still in flight ([`VerifiedSet::in_flight_copy`]: what the own relay
    /// confirmed may have been lost since, decision 0061).
    fn forwarded_copy(
        &mut self,
        now: Time,
        sub_id: &str,
        raw: &str,
        verified: Verified<'_>,
    ) -> bool {
        if self.config.role != SessionRole::Remote {
            return false;
        }
        let Some(id) = claimed_id(raw) else {
            return false;
        };
        let Some(sub) = self.conn.as_mut().and_then(|c| c.subs.get_mut(sub_id)) else {
            return false;
        };
        if sub.ids.is_some() {
            return false;
        }
        // A reconciliation's fetch (the only query naming ids) forwards its copies even when
        // an earlier copy was stored (decision 0061), unless that copy is still in flight.
        let summary = if sub.filter.ids.is_some() {
            verified.set.in_flight_copy(&id, verified.forward_epoch)
        } else {
            verified.set.forwarded_copy(&id, verified.forward_epoch)
        };
        let Some(summary) = summary else {
            return false;
        };
        // What the summary can tell (window, kinds, authors, tags) is checked as for a
        // parsed copy: a relay that ignores `since`/`until`, or sends known events its query
        // does not match, must not fill a page with them (issue 36). A copy whose tags the
        // summary cannot tell is parsed.
        if !sub.pack.is_empty() {
            // A REQ of several filters: the copy must match one of them, and counts for
            // every member it matches (each filter is capped on its own).
            let mut hits = Vec::new();
            for (i, m) in sub.pack.iter_mut().enumerate() {
                let print = m.print.get_or_insert_with(|| FilterPrint::of(&m.filter));
                match copy_matches(&m.filter, print, &summary) {
                    None => return false,
                    Some(true) => hits.push(i),
                    Some(false) => {}
                }
            }
            self.counters.events_received += 1;
            if hits.is_empty() {
                if !sub.eose {
                    sub.stats.record_rejected();
                }
                self.unmatched(now, sub_id);
                return true;
            }
            for i in hits {
                let m = &mut sub.pack[i];
                if !m.eose {
                    m.stats.record_summary(&summary);
                    m.stats.member_times.push(summary.created_at);
                }
            }
            self.counters.copies_not_forwarded += 1;
            trace!("{}: {id} already handed to the forwarder", self.config.url);
            return true;
        }
        let print = sub
            .print
            .get_or_insert_with(|| FilterPrint::of(&sub.filter));
        let Some(matches) = copy_matches(&sub.filter, print, &summary) else {
            return false;
        };
        self.counters.events_received += 1;
        if !matches {
            if !sub.eose {
                sub.stats.record_rejected();
            }
            self.unmatched(now, sub_id);
            return true;
        }
        self.counters.copies_not_forwarded += 1;
        let fetch = sub.filter.ids.is_some();
        if let Some(f) = sub.fetch.as_mut() {
            f.asked.remove(&id);
        }
        if !sub.eose {
            sub.stats.record_summary(&summary);
        }
        trace!("{}: {id} already handed to the forwarder", self.config.url);
        let held = self.conn.as_ref().is_some_and(|c| !c.held.is_empty());
        if held
            && !fetch
            && verified
                .set
                .in_flight_copy(&id, verified.forward_epoch)
                .is_some()
        {
            self.strike_from_held(&id);
        }
        true
    }

    /// The own relay's side of a reconciliation (a [`Command::CollectIds`] subscription)
    /// reading an event this process verified before, recognised by the id its JSON claims
    /// ([`claimed_id`]): its `(created_at, id)` is taken from what the [`VerifiedSet`]
    /// remembers, and the JSON is not parsed (in a first sync most of what the own relay
    /// holds came through this process, and each reconciliation reads it again). As for a
    /// parsed event, what the summary can tell (window, kinds, authors) is checked against
    /// the filter; the tags are not (the own relay applies its filters). False (parse the
    /// event as usual) for any other subscription and for an event the set does not know.
    fn collected_copy(&mut self, sub_id: &str, raw: &str, verified: Verified<'_>) -> bool {
        let Some(sub) = self.conn.as_mut().and_then(|c| c.subs.get_mut(sub_id)) else {
            return false;
        };
        let Some((items, truncated)) = sub.ids.as_mut() else {
            return false;
        };
        let Some(id) = claimed_id(raw) else {
            return false;
        };
        let Some(summary) = verified.set.summary(&id) else {
            return false;
        };
        self.counters.events_received += 1;
        if sub.eose {
            return true;
        }
        if !summary_matches(&sub.filter, &summary) {
            sub.stats.record_rejected();
            return true;
        }
        sub.stats.record_summary(&summary);
        if items.len() < MAX_COLLECTED_IDS {
            items.push((summary.created_at, id));
        } else {
            *truncated = true;
        }
        true
    }

    /// An EVENT frame's event, parsed from `raw` (its JSON as the relay sent it), on
    /// subscription `sub_id`: checked (id, signature, filter) and handed on.
    fn on_event(
        &mut self,
        now: Time,
        sub_id: &str,
        raw: &str,
        event: Event,
        verified: Verified<'_>,
    ) -> FrameOutcome {
        self.counters.events_received += 1;
        let url = &self.config.url;
        let Some(conn) = self.conn.as_mut() else {
            return FrameOutcome::Handled;
        };
        let generation = conn.generation;
        let Some(sub) = conn.subs.get_mut(sub_id) else {
            self.counters.events_unknown_subscription += 1;
            debug!(
                "{url}: event for unknown subscription {}",
                escape_for_log(sub_id, 64)
            );
            return FrameOutcome::Handled;
        };
        if let Some((items, truncated)) = sub.ids.as_mut() {
            // The own relay's side of a reconciliation: only (created_at, id) of what it
            // holds for the filter; no signature check, nothing forwarded.
            if sub.eose {
                return FrameOutcome::Handled;
            }
            if !sub.filter.match_event(&event, MatchEventOptions::new()) {
                sub.stats.record_rejected();
                return FrameOutcome::Handled;
            }
            sub.stats.record_event(&event);
            if items.len() < MAX_COLLECTED_IDS {
                items.push((event.created_at.as_secs(), event.id));
            } else {
                *truncated = true;
            }
            return FrameOutcome::Handled;
        }
        // A copy (from another relay, another filter, or the own relay reading back what the
        // forwarder stored) has its id checked but not its signature again.
        let in_scope = sub
            .scope
            .as_ref()
            .is_none_or(|s| s.match_event(&event, MatchEventOptions::new()));
        // A REQ of several filters: the event must match one of them (decision 0016 for the
        // union), and counts for every member it matches.
        let matching: Vec<usize> = sub
            .pack
            .iter()
            .enumerate()
            .filter(|(_, m)| m.filter.match_event(&event, MatchEventOptions::new()))
            .map(|(i, _)| i)
            .collect();
        let filter = match matching.first() {
            Some(&i) => &sub.pack[i].filter,
            None => &sub.filter,
        };
        let checked = if !in_scope || (!sub.pack.is_empty() && matching.is_empty()) {
            Err(EventRejection::NotMatching)
        } else {
            check_parsed_cached(&event, raw, filter, verified.set)
        };
        if matches!(
            checked,
            Ok(SignatureCheck::Verified) | Err(EventRejection::BadSignature)
        ) {
            self.counters.signature_checks += 1;
        }
        let checked = checked.map(|_| ());
        if checked.is_ok() {
            if let Some(f) = sub.fetch.as_mut() {
                f.asked.remove(&event.id);
            }
        }
        if !sub.pack.is_empty() {
            if checked.is_ok() {
                let summary = crate::core::dedup::EventSummary::of(&event);
                for i in matching {
                    let m = &mut sub.pack[i];
                    if !m.eose {
                        m.stats.record_summary(&summary);
                        m.stats.member_times.push(summary.created_at);
                    }
                }
            } else if !sub.eose {
                sub.stats.record_rejected();
            }
        } else if !sub.eose {
            // Paging trusts only checked events inside the window.
            match checked {
                Ok(()) => sub.stats.record_event(&event),
                Err(_) => sub.stats.record_rejected(),
            }
        }
        match checked {
            Ok(()) => {
                self.counters.events_accepted += 1;
                match self.config.role {
                    SessionRole::Remote => {
                        // Only a reconciliation's fetch asks a remote by `ids`: the own relay
                        // was just found without the event, so it goes to the forwarder
                        // whatever an earlier copy's claim says.
                        let missing = sub.filter.ids.is_some();
                        // Only one copy per forwarder epoch: it would drop the others.
                        if !verified
                            .set
                            .claim_forward(&event.id, verified.forward_epoch)
                            && !missing
                        {
                            self.counters.copies_not_forwarded += 1;
                            trace!("{url}: {} already handed to the forwarder", event.id);
                            return FrameOutcome::Handled;
                        }
                        if !missing && !conn.held.is_empty() {
                            self.strike_from_held(&event.id);
                        }
                        FrameOutcome::Forward(Forward {
                            id: event.id,
                            raw: Arc::from(raw),
                            missing,
                        })
                    }
                    SessionRole::Own => {
                        self.reports.push_back(Report::SelfEvent {
                            generation,
                            event: Box::new(event),
                        });
                        FrameOutcome::Handled
                    }
                }
            }
            Err(EventRejection::NotMatching) => {
                self.unmatched(now, sub_id);
                FrameOutcome::Handled
            }
            Err(e) => {
                self.invalid_event(sub_id, &e);
                FrameOutcome::Handled
            }
        }
    }

    /// An EVENT frame for no open subscription of this connection: counted, logged at debug
    /// level and dropped before its event is parsed (what a stranger sends costs no parse;
    /// issue 36). False for a known subscription.
    fn unknown_subscription(&mut self, sub_id: &str) -> bool {
        let Some(conn) = self.conn.as_ref() else {
            return false;
        };
        if conn.subs.contains_key(sub_id) {
            return false;
        }
        self.counters.events_received += 1;
        self.counters.events_unknown_subscription += 1;
        debug!(
            "{}: event for unknown subscription {}",
            self.config.url,
            escape_for_log(sub_id, 64)
        );
        true
    }

    /// An EVENT frame whose event JSON does not parse: counted for its subscription.
    fn malformed_event(&mut self, sub_id: &str, e: &EventRejection) {
        self.counters.events_received += 1;
        let Some(sub) = self.conn.as_mut().and_then(|c| c.subs.get_mut(sub_id)) else {
            self.counters.events_unknown_subscription += 1;
            debug!(
                "{}: event for unknown subscription {}",
                self.config.url,
                escape_for_log(sub_id, 64)
            );
            return;
        };
        if !sub.eose {
            sub.stats.record_rejected();
        }
        self.invalid_event(sub_id, e);
    }

    /// A valid event that does not match the subscription it arrived on: counted, and logged
    /// at info level within the session's [`LogBudget`] (debug beyond it).
    fn unmatched(&mut self, now: Time, sub_id: &str) {
        self.counters.events_unmatched += 1;
        log!(
            budgeted(&mut self.log_budget, now, "unmatched", Level::Info),
            "{}: dropped an event that does not match subscription {}",
            self.config.url,
            escape_for_log(sub_id, 64)
        );
    }

    /// Counts an event that failed its checks; the first from this relay is logged at warn
    /// level, the rest at debug (an invalid event per line would flood the log).
    fn invalid_event(&mut self, sub_id: &str, e: &EventRejection) {
        self.counters.events_invalid += 1;
        let sub_id = escape_for_log(sub_id, 64);
        if self.counters.events_invalid == 1 {
            warn!(
                "{}: dropped an invalid event on {sub_id}: {e} (dropped and counted; further ones are logged at debug level)",
                self.config.url
            );
        } else {
            debug!(
                "{}: dropped an invalid event on {sub_id}: {e}",
                self.config.url
            );
        }
    }

    /// A text frame above the soft cap: dropped and counted; the connection is kept, so a
    /// relay storing one oversized event does not flap for ever (it would be fetched again
    /// on every reconnect). An event is counted once per relay however often it arrives
    /// (several subscriptions, reconnects; at most [`MAX_OVERSIZED_REMEMBERED`] ids are
    /// remembered), and logged at warn level the first time for this relay, then at debug
    /// level. It still counts as received for its subscription's paging (as an invalid event
    /// does: its timestamp is not used).
    ///
    /// The frame is not parsed: its subscription id and event id come from a byte scan
    /// ([`scan_event_frame`]), so a frame of many small JSON values costs nothing beyond its
    /// own bytes.
    fn oversized(&mut self, text: &str) {
        let url = &self.config.url;
        let (size, cap) = (text.len(), self.config.max_event_size);
        let what = match scan_event_frame(text) {
            Some((sub_id, id)) => {
                if let Some(sub) = self.conn.as_mut().and_then(|c| c.subs.get_mut(sub_id)) {
                    if !sub.eose {
                        sub.stats.received += 1;
                    }
                }
                if self.oversized_seen.contains(&id) {
                    debug!(
                        "{url}: dropped event {id} again ({size} bytes, above the {cap}-byte cap)"
                    );
                    return;
                }
                if self.oversized_seen.len() < MAX_OVERSIZED_REMEMBERED {
                    self.oversized_seen.insert(id);
                }
                format!("event {id} on {}", escape_for_log(sub_id, 64))
            }
            None => "a frame".to_string(),
        };
        self.counters.oversized_frames += 1;
        if self.counters.oversized_frames == 1 {
            warn!("{url}: dropped {what} of {size} bytes (above the {cap}-byte cap); the connection is kept, further ones are logged at debug level");
        } else {
            debug!("{url}: dropped {what} of {size} bytes (above the {cap}-byte cap)");
        }
    }

    // ----- time -----

    /// The earliest deadline: the next ping or pong deadline, or a NIP-42 hold's end.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        self.timers.next_timeout()
    }

    /// How long the thread may block in its next read at `now`: its tick by how long the
    /// connection has been quiet (busy, idle or quiet [`Ticks`]), never past [`RelaySession::poll_timeout`].
    #[must_use]
    pub fn read_timeout(&self, now: Time, ticks: &Ticks) -> Duration {
        match &self.conn {
            Some(c) => read_timeout(now, c.keepalive.last_work(), ticks, self.poll_timeout()),
            None => ticks.busy,
        }
    }

    /// Runs every timer due at `now`: a ping to send, a dead connection (no pong in time),
    /// held subscriptions whose wait for NIP-42 is over (reported as closed).
    pub fn handle_timeout(&mut self, now: Time) {
        self.log_summaries(now);
        for timer in Timer::ALL {
            if !self.timers.is_expired(timer, now) {
                continue;
            }
            let Some(conn) = self.conn.as_mut() else {
                return;
            };
            match timer {
                Timer::Keepalive => match conn.keepalive.poll(now) {
                    KeepaliveAction::Idle => {}
                    KeepaliveAction::SendPing => self.transmits.push_back(Transmit::Ping),
                    KeepaliveAction::Dead => {
                        self.on_lost(Disconnect::NoPong);
                        return;
                    }
                },
                Timer::AuthHold => {
                    let released = conn.auth.handle_timeout(now);
                    if !released.is_empty() {
                        log!(
                            budgeted(&mut self.log_budget, now, "auth-hold", Level::Info),
                            "{}: no NIP-42 authentication in time; reporting {} subscription(s) the relay closed",
                            self.config.url,
                            released.len()
                        );
                    }
                    self.release(released);
                }
            }
        }
        self.update_timers();
    }

    /// Sets the timer table from the pieces that own the deadlines.
    fn update_timers(&mut self) {
        match &self.conn {
            Some(c) => {
                self.timers
                    .set(Timer::Keepalive, Some(c.keepalive.poll_timeout()));
                self.timers.set(Timer::AuthHold, c.auth.poll_timeout());
            }
            None => self.timers = TimerTable::default(),
        }
    }

    // ----- output -----

    /// The next frame to write.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next report for the coordinator.
    #[must_use]
    pub fn poll_report(&mut self) -> Option<Report> {
        self.reports.pop_front()
    }

    /// Whether reports wait to be taken.
    pub fn has_reports(&self) -> bool {
        !self.reports.is_empty()
    }
}

/// The level of a line of `kind` the relay provoked at `now`: `level` within the session's
/// budget, debug beyond it.
fn budgeted(budget: &mut LogBudget, now: Time, kind: &'static str, level: Level) -> Level {
    if budget.allow(now, kind) {
        level
    } else {
        Level::Debug
    }
}

/// Records a subscription (`ids`: a `CollectIds` query keeping `(created_at, id)` pairs) and
/// returns its `REQ` frame.
/// `["REQ",<sub_id>,<filter>]`, written directly: building a `ClientMessage` would copy the
/// filter (a Layer 2/3 filter holds 100 tag values) only to serialise it.
fn req_text(sub_id: &str, filter: &Filter) -> String {
    pack_text(sub_id, std::iter::once(filter))
}

/// `filter` without the ids of events in flight ([`VerifiedSet::in_flight_copy`]), and how
/// many were left out; `None` when it names no ids or none is in flight. At least one id
/// stays.
/// True when a fetch need not ask for `id`: its event is in flight to the own relay, or
/// (with `since`) was handed over or confirmed after the own relay's side was read
/// ([`VerifiedSet::handed_over_since`]).
fn handed_over(verified: Verified<'_>, id: &EventId, since: Option<u32>) -> bool {
    match since {
        Some(since) => verified
            .set
            .handed_over_since(id, verified.forward_epoch, since),
        None => verified
            .set
            .in_flight_copy(id, verified.forward_epoch)
            .is_some(),
    }
}

fn without_ids_in_flight(
    filter: &std::sync::Arc<Filter>,
    verified: Verified<'_>,
    since: Option<u32>,
) -> Option<(std::sync::Arc<Filter>, Vec<EventId>)> {
    let ids = filter.ids.as_ref()?;
    let in_flight = |id: &EventId| handed_over(verified, id, since);
    let keep: std::collections::BTreeSet<EventId> =
        ids.iter().filter(|id| !in_flight(id)).copied().collect();
    if keep.len() == ids.len() {
        return None;
    }
    let skipped = (ids.len() - keep.len()) as u64;
    let left_out: Vec<EventId> = ids
        .iter()
        .filter(|id| !keep.contains(id))
        .copied()
        .collect();
    debug_assert_eq!(left_out.len() as u64, skipped);
    let mut pruned = (**filter).clone();
    pruned.ids = Some(keep);
    Some((std::sync::Arc::new(pruned), left_out))
}

/// The ids of a finished fetch that the own relay may still lack: asked for and not
/// delivered, and those left out as in flight that are neither in flight nor stored now (the
/// own relay refused them meanwhile, or the forwarder restarted). Sorted.
fn undelivered(track: FetchTrack, verified: Verified<'_>) -> Vec<EventId> {
    let mut out: Vec<EventId> = track.asked.into_iter().collect();
    out.extend(
        track
            .pruned
            .into_iter()
            .filter(|id| !verified.set.in_flight_or_stored(id, verified.forward_epoch)),
    );
    out.sort_unstable();
    out.dedup();
    out
}

/// Holds the fetch `fetch_id` (just opened, not sent) while history queries opened before
/// it on this connection have not reached EOSE: they may deliver the events it asks for (a
/// batch's tag query streams the comments its reconciled sibling query would fetch by id,
/// decision 0112). True when held.
fn hold_fetch(conn: &mut Connection, fetch_id: &str) -> bool {
    let waits: HashSet<String> = conn
        .subs
        .iter()
        .filter(|(id, s)| {
            id.as_str() != fetch_id
                && !s.eose
                && s.fetch.is_none()
                && s.ids.is_none()
                && s.filter.limit != Some(0)
        })
        .map(|(id, _)| id.clone())
        .collect();
    if waits.is_empty() {
        return false;
    }
    let Some(track) = conn.subs.get_mut(fetch_id).and_then(|s| s.fetch.as_mut()) else {
        return false;
    };
    track.waits_for = Some(waits);
    conn.held.push(fetch_id.to_string());
    true
}

/// The subscriptions a CLOSED of REQ `wire` (removed as `sub`) ends: itself, or every
/// member of a REQ of several filters not unsubscribed yet (forgotten from `packed`).
fn closed_members(packed: &mut HashMap<String, String>, wire: String, sub: Sub) -> Vec<String> {
    if sub.pack.is_empty() {
        return vec![wire];
    }
    let mut out = Vec::new();
    for m in sub.pack {
        packed.remove(&m.id);
        if m.open {
            out.push(m.id);
        }
    }
    out
}

fn open_req(
    url: &RelayUrl,
    conn: &mut Connection,
    sub_id: SubscriptionId,
    filter: std::sync::Arc<Filter>,
    ids: Option<(Vec<(u64, EventId)>, bool)>,
) -> String {
    let text = req_text(sub_id.as_str(), &filter);
    trace!("{url} <- {text}");
    conn.subs.insert(
        sub_id.to_string(),
        Sub {
            fetch: filter.ids.as_ref().filter(|_| ids.is_none()).map(|asked| {
                Box::new(FetchTrack {
                    asked: asked.iter().copied().collect(),
                    pruned: Vec::new(),
                    waits_for: None,
                    since: None,
                })
            }),
            filter,
            scope: None,
            stats: PageStats::default(),
            eose: false,
            ids,
            print: None,
            clock: 0,
            pack: Vec::new(),
            unsent: false,
        },
    );
    text
}

/// Records a REQ of several filters ([`Sub::pack`]) under its first member's id and returns
/// its frame; live-only members (`limit: 0`) are reported at once (nostr-rs-relay sends no
/// EOSE for a REQ whose filters all have `limit: 0`): their reports.
fn open_pack(
    url: &RelayUrl,
    conn: &mut Connection,
    members: Vec<(SubscriptionId, std::sync::Arc<Filter>)>,
) -> Option<(String, Vec<Report>)> {
    let wire = members.first()?.0.to_string();
    let text = pack_text(&wire, members.iter().map(|m| &*m.1));
    trace!("{url} <- {}", escape_for_log(&text, 400));
    let mut reports = Vec::new();
    let pack: Vec<Member> = members
        .into_iter()
        .map(|(id, filter)| {
            let live_only = filter.limit == Some(0);
            if live_only {
                reports.push(Report::Eose {
                    relay: url.clone(),
                    generation: conn.generation,
                    sub_id: id.clone(),
                    stats: PageStats::default(),
                });
            }
            Member {
                id: id.to_string(),
                filter,
                stats: PageStats::default(),
                eose: live_only,
                open: true,
                print: None,
            }
        })
        .collect();
    for m in &pack[1..] {
        conn.packed.insert(m.id.clone(), wire.clone());
    }
    conn.subs.insert(
        wire.clone(),
        Sub {
            filter: pack[0].filter.clone(),
            scope: None,
            stats: PageStats::default(),
            eose: pack.iter().all(|m| m.eose),
            ids: None,
            fetch: None,
            print: None,
            clock: 0,
            pack,
            unsent: false,
        },
    );
    Some((text, reports))
}

/// `["REQ",<sub_id>,<filter>,<filter>,…]`.
fn pack_text<'a>(sub_id: &str, filters: impl Iterator<Item = &'a Filter>) -> String {
    let mut text = format!("[\"REQ\",{}", serde_json::Value::from(sub_id));
    for f in filters {
        text.push(',');
        crate::core::filter_json::write_filter(&mut text, f);
    }
    text.push(']');
    text
}

/// The REQ frame of `sub` (sent again after NIP-42 authentication).
fn sub_text(sub_id: &str, sub: &Sub) -> String {
    if sub.pack.is_empty() {
        req_text(sub_id, &sub.filter)
    } else {
        pack_text(sub_id, sub.pack.iter().map(|m| &*m.filter))
    }
}

mod scan;

#[cfg(test)]
mod tests;
