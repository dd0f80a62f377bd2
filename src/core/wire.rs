//! The vocabulary between the relay threads, the coordinator and the sync machine: what a
//! connection reports ([`Report`]), what the machine asks the engine to do ([`Command`]), where
//! each command goes ([`Route`], [`Command::route`]), what the coordinator hands a relay thread
//! ([`Control`]), why a connection ended ([`Disconnect`]), and the frames read from and written
//! to a socket ([`Frame`], [`Transmit`]).
//!
//! Both sides of the wire use these types and neither owns them: [`crate::core::session`]
//! produces reports and takes controls, [`crate::core::sync`] takes reports and produces
//! commands. Keeping them here keeps the two modules from importing each other; they are
//! re-exported where they lived before (`core::sync::Report`, `core::session::Control`, …).

use std::fmt;

use nostr::event::{Event, EventId};
use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::paging::PageStats;
use crate::core::relay_text::Prefix;
use crate::shared::{RelayLimits, RelayUrl};

/// What a connection thread reports.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Report {
    /// The websocket is open.
    Connected {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the `Connect` this answers.
        generation: u64,
    },
    /// The connect attempt failed, or an open connection was lost.
    Disconnected {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// What went wrong.
        cause: Disconnect,
    },
    /// End of stored events for a subscription.
    Eose {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// The subscription.
        sub_id: SubscriptionId,
        /// What it delivered before EOSE (accepted or not).
        stats: PageStats,
    },
    /// What a relay publishes about its limits (NIP-11).
    Limits {
        /// Relay (the own relay too).
        relay: RelayUrl,
        /// The `limitation` values it published.
        limits: RelayLimits,
    },
    /// The relay closed a subscription.
    Closed {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// The subscription.
        sub_id: SubscriptionId,
        /// The machine-readable prefix of `message`, read once where the frame was read
        /// ([`crate::core::message::Incoming::Closed`]).
        prefix: Prefix,
        /// The relay's reason (escaped, bounded).
        message: String,
    },
    /// The forward queue into the own relay is full (`active`) or has room again. While it is
    /// full the relay threads wait and read nothing, so EOSE deadlines of remote queries are
    /// suspended for that time.
    ForwardBackPressure {
        /// True when the queue became full.
        active: bool,
    },
    /// The forwarder died and was started again: whatever it held (queued, in flight, and
    /// what relay threads were handing to it) is lost. Every relay's history is read again
    /// in full (as by the daily resync; NIP-77 makes that cheap), so nothing confirmed
    /// before stays confirmed without its events (issue 36).
    ForwarderLost,
    /// The thread of `relay` waits (`active`) to hand an event over to the forwarder, or has
    /// stopped waiting: the forward pipeline's byte bound (its total, or the relay's share)
    /// is reached. While it waits it reads nothing from the relay, so the EOSE deadlines of
    /// that relay's queries are suspended for that time, as for
    /// [`Report::ForwardBackPressure`].
    RelayStalled {
        /// The relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// True when the wait began.
        active: bool,
    },
    /// A NOTICE from a relay.
    Notice {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// The text.
        message: String,
    },
    /// The engine refused to connect to this relay (address policy, deny list, or it is the
    /// own relay under another name). The machine drops it and never targets it again.
    Refused {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the `Connect` this answers.
        generation: u64,
        /// Why (its `Display` is the log text).
        reason: crate::shared::Refusal,
    },
    /// EOSE of a [`Command::CollectIds`] query on the own relay, with the `(created_at, id)`
    /// of the events it returned (their signatures are not checked: see
    /// `docs/decisions/0052-the-own-relay-s-side-is-a-paged.md`).
    OwnIds {
        /// Generation of the own relay connection.
        generation: u64,
        /// The query.
        sub_id: SubscriptionId,
        /// What it delivered (for paging).
        stats: PageStats,
        /// `(created_at, id)` of each event matching the query.
        items: Vec<(u64, EventId)>,
        /// The thread stopped collecting at its bound: the side is not complete.
        truncated: bool,
        /// The verified set's clock ([`crate::core::dedup::VerifiedSet::clock`]) when the
        /// query was sent (0 when the thread did not read it).
        clock: u32,
    },
    /// `["NEG-MSG", sub_id, hex]` from a remote relay (NIP-77).
    NegMsg {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// The negentropy subscription.
        sub_id: SubscriptionId,
        /// The hex message as received (bounded by the frame cap).
        message: String,
    },
    /// `["NEG-ERR", sub_id, reason]`, or CLOSED of a negentropy subscription (`closed`).
    NegErr {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// The negentropy subscription.
        sub_id: SubscriptionId,
        /// The relay's reason (escaped, bounded).
        message: String,
        /// True when the relay sent CLOSED rather than NEG-ERR.
        closed: bool,
    },
    /// A checked event read by the self-subscription on the own relay.
    SelfEvent {
        /// Generation of the own relay connection.
        generation: u64,
        /// The event.
        event: Box<Event>,
    },
}

/// What the engine must do.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Command {
    /// Open a connection (spawning the relay's thread if it has none).
    Connect {
        /// Relay (the own relay for the self-subscription).
        relay: RelayUrl,
        /// Generation to tag every report of this connection with.
        generation: u64,
    },
    /// Send `["REQ", sub_id, filter]` on the connection of this generation.
    Subscribe {
        /// Relay.
        relay: RelayUrl,
        /// Connection generation; a thread drops commands of another generation.
        generation: u64,
        /// Subscription id.
        sub_id: SubscriptionId,
        /// The one filter of this REQ (shared with the machine's record of the
        /// subscription: a Layer 2/3 filter holds 100 tag values).
        filter: std::sync::Arc<Filter>,
        /// A filter every event must match too, checked here and not sent: a
        /// reconciliation's fetch asks by `ids` without its query's tag values, and its
        /// events must still belong to the query (shared by all the fetch's REQs).
        scope: Option<std::sync::Arc<Filter>>,
        /// A reconciliation's fetch: the verified set's clock when the own relay's side was
        /// read ([`Report::OwnIds`]); ids handed to the forwarder since are not asked for
        /// (decision 0112).
        fetch_since: Option<u32>,
    },
    /// Send `["REQ", first id, filter 1, filter 2, …]`: several of the machine's subscriptions
    /// in one REQ (decision 0110). Each member keeps its id towards the machine (its EOSE,
    /// CLOSED and page statistics are reported under it); the REQ goes out under the first
    /// member's id and is closed once every member was unsubscribed.
    SubscribeMany {
        /// Relay.
        relay: RelayUrl,
        /// Connection generation.
        generation: u64,
        /// The members in order, at least two: each subscription id with its filter.
        members: Vec<(SubscriptionId, std::sync::Arc<Filter>)>,
    },
    /// Send `["REQ", sub_id, filter]` to the own relay and keep only `(created_at, id)` of
    /// each matching event (no signature check, nothing forwarded); answered by
    /// [`Report::OwnIds`] at EOSE. The own relay's side of a reconciliation.
    CollectIds {
        /// Connection generation of the own relay.
        generation: u64,
        /// Subscription id.
        sub_id: SubscriptionId,
        /// The filter.
        filter: Filter,
    },
    /// Send `["NEG-OPEN", sub_id, filter, message]` (NIP-77).
    NegOpen {
        /// Relay.
        relay: RelayUrl,
        /// Connection generation.
        generation: u64,
        /// Negentropy subscription id.
        sub_id: SubscriptionId,
        /// The filter whose set is reconciled.
        filter: Filter,
        /// The initial message, hex.
        message: String,
    },
    /// Send `["NEG-MSG", sub_id, message]`.
    NegMsg {
        /// Relay.
        relay: RelayUrl,
        /// Connection generation.
        generation: u64,
        /// Negentropy subscription id.
        sub_id: SubscriptionId,
        /// The message, hex.
        message: String,
    },
    /// Send `["NEG-CLOSE", sub_id]`.
    NegClose {
        /// Relay.
        relay: RelayUrl,
        /// Connection generation.
        generation: u64,
        /// Negentropy subscription id.
        sub_id: SubscriptionId,
    },
    /// Send `["CLOSE", sub_id]`.
    Unsubscribe {
        /// Relay.
        relay: RelayUrl,
        /// Connection generation.
        generation: u64,
        /// Subscription id.
        sub_id: SubscriptionId,
    },
    /// Close the connection and end the relay's thread: the relay is no longer needed.
    Forget {
        /// Relay.
        relay: RelayUrl,
    },
    /// The repository index changed: the forwarder retries the events the own relay rejected
    /// that name one of `repos` or `roots`. Ids, not hex: the hex form is made only by a
    /// forwarder that holds rejected events.
    RetryRejected {
        /// Repository coordinates `30617:<pubkey>:<d>` whose announcement was applied.
        repos: Vec<crate::core::nip34::RepoRef>,
        /// Root events newly linked to a repository, and the root events of `repos`.
        roots: Vec<EventId>,
    },
}

/// Where a [`Command`] goes ([`Command::route`]): the engine's coordinator and the
/// simulation route every command through this one mapping, so the simulation tests the
/// routing the engine runs.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Route {
    /// Open a connection to `relay` tagged `generation`: the engine spawns the relay's
    /// thread first if it has none, then hands it [`Control::Connect`].
    Connect {
        /// Relay (the own relay for the self-subscription).
        relay: RelayUrl,
        /// Generation.
        generation: u64,
    },
    /// A control for the session (thread) of `relay`.
    Relay(RelayUrl, Control),
    /// End the relay's thread and forget its session.
    Forget(RelayUrl),
    /// For the forwarder: retry the rejected events that name one of these.
    RetryRejected {
        /// Repository coordinates.
        repos: Vec<crate::core::nip34::RepoRef>,
        /// Root events.
        roots: Vec<EventId>,
    },
}

impl Command {
    /// Where this command goes; `own` is the own relay (a [`Command::CollectIds`] is for its
    /// session).
    #[must_use]
    pub fn route(self, own: &RelayUrl) -> Route {
        match self {
            Command::Connect { relay, generation } => Route::Connect { relay, generation },
            Command::Forget { relay } => Route::Forget(relay),
            Command::RetryRejected { repos, roots } => Route::RetryRejected { repos, roots },
            Command::Subscribe {
                relay,
                generation,
                sub_id,
                filter,
                scope,
                fetch_since,
            } => Route::Relay(
                relay,
                Control::Subscribe {
                    generation,
                    sub_id,
                    filter,
                    scope,
                    fetch_since,
                },
            ),
            Command::SubscribeMany {
                relay,
                generation,
                members,
            } => Route::Relay(
                relay,
                Control::SubscribeMany {
                    generation,
                    members,
                },
            ),
            Command::Unsubscribe {
                relay,
                generation,
                sub_id,
            } => Route::Relay(relay, Control::Unsubscribe { generation, sub_id }),
            Command::CollectIds {
                generation,
                sub_id,
                filter,
            } => Route::Relay(
                own.clone(),
                Control::CollectIds {
                    generation,
                    sub_id,
                    filter: Box::new(filter),
                },
            ),
            Command::NegOpen {
                relay,
                generation,
                sub_id,
                filter,
                message,
            } => Route::Relay(
                relay,
                Control::NegOpen {
                    generation,
                    sub_id,
                    filter: Box::new(filter),
                    message,
                },
            ),
            Command::NegMsg {
                relay,
                generation,
                sub_id,
                message,
            } => Route::Relay(
                relay,
                Control::NegMsg {
                    generation,
                    sub_id,
                    message,
                },
            ),
            Command::NegClose {
                relay,
                generation,
                sub_id,
            } => Route::Relay(relay, Control::NegClose { generation, sub_id }),
        }
    }
}

/// Commands from the coordinator to a relay thread.
///
/// `Connect`, `Shutdown` and `Panic` are the thread's (they open or end connections); the
/// others are the session's ([`crate::core::session::RelaySession::handle_command`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
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
        filter: std::sync::Arc<Filter>,
        /// A filter its events must also match, not sent (a reconciliation's fetch by
        /// `ids`: the query it belongs to).
        scope: Option<std::sync::Arc<Filter>>,
        /// A reconciliation's fetch: the verified set's clock
        /// ([`crate::core::dedup::VerifiedSet::clock`]) when the own relay's side was read.
        fetch_since: Option<u32>,
    },
    /// Send a REQ with several filters, each a subscription of its own towards the machine
    /// ([`Command::SubscribeMany`]).
    SubscribeMany {
        /// Generation the command belongs to.
        generation: u64,
        /// The members in order (the REQ goes out under the first id).
        members: Vec<(SubscriptionId, std::sync::Arc<Filter>)>,
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

/// Why a connection failed or ended. [`fmt::Display`] gives the log text, [`Disconnect::label`]
/// a stable name for metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disconnect {
    /// The host name did not resolve (the resolver's error).
    Resolve(String),
    /// TCP connect failed or timed out for every address (the socket error).
    Tcp(String),
    /// The TLS or websocket handshake failed (what failed).
    Handshake(String),
    /// The connect deadline passed during the handshakes.
    ConnectTimeout,
    /// Writing a frame failed (the socket error).
    Write(String),
    /// Reading failed: the socket or the websocket protocol (the error).
    Read(String),
    /// The relay sent a websocket close frame.
    ClosedByRelay {
        /// The close code, if the frame had one.
        code: Option<u16>,
        /// The close reason (escaped, bounded).
        reason: String,
    },
    /// No pong (nor any other frame) arrived before the keep-alive deadline.
    NoPong,
    /// The relay's thread ended (`panicked` or returned) while connected; the coordinator
    /// starts it again.
    ThreadLost {
        /// The thread panicked.
        panicked: bool,
    },
    /// The relay's thread could not be started (the system's error).
    Spawn(String),
}

impl Disconnect {
    /// Every label, in a fixed order (for metrics).
    pub const LABELS: [&'static str; 10] = [
        "resolve",
        "tcp",
        "handshake",
        "connect_timeout",
        "write",
        "read",
        "closed_by_relay",
        "no_pong",
        "thread_lost",
        "spawn",
    ];

    /// A stable lowercase name for metrics and status.
    pub fn label(&self) -> &'static str {
        match self {
            Disconnect::Resolve(_) => "resolve",
            Disconnect::Tcp(_) => "tcp",
            Disconnect::Handshake(_) => "handshake",
            Disconnect::ConnectTimeout => "connect_timeout",
            Disconnect::Write(_) => "write",
            Disconnect::Read(_) => "read",
            Disconnect::ClosedByRelay { .. } => "closed_by_relay",
            Disconnect::NoPong => "no_pong",
            Disconnect::ThreadLost { .. } => "thread_lost",
            Disconnect::Spawn(_) => "spawn",
        }
    }
}

impl fmt::Display for Disconnect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Disconnect::Resolve(e) => write!(f, "cannot resolve host: {e}"),
            Disconnect::Tcp(e) => write!(f, "TCP connect failed: {e}"),
            Disconnect::Handshake(e) => write!(f, "handshake failed: {e}"),
            Disconnect::ConnectTimeout => write!(f, "connect deadline passed during the handshake"),
            Disconnect::Write(e) => write!(f, "write failed: {e}"),
            Disconnect::Read(e) => write!(f, "read failed: {e}"),
            Disconnect::ClosedByRelay { code, reason } => match code {
                Some(code) if reason.is_empty() => write!(f, "closed by the relay (code {code})"),
                Some(code) => write!(f, "closed by the relay (code {code}: {reason})"),
                None => write!(f, "closed by the relay"),
            },
            Disconnect::NoPong => write!(f, "no pong before the deadline"),
            Disconnect::ThreadLost { panicked: true } => write!(f, "relay thread panicked"),
            Disconnect::ThreadLost { panicked: false } => write!(f, "relay thread ended"),
            Disconnect::Spawn(e) => write!(f, "cannot spawn thread: {e}"),
        }
    }
}

/// A frame read from the socket.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Frame<'a> {
    /// A text message.
    Text(&'a str),
    /// A binary message (relays send none).
    Binary,
    /// A ping (the websocket library queues its pong).
    Ping,
    /// A pong.
    Pong,
    /// A close frame: code and reason, if any.
    Close(Option<(u16, &'a str)>),
}

/// Something to write to the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transmit {
    /// A text frame.
    Text(String),
    /// A websocket ping.
    Ping,
}
