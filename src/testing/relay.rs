//! [`TestRelay`]: a scriptable NIP-01 websocket relay running on blocking
//! threads inside the test process.
//!
//! Threads: one acceptor (nonblocking listener polled every
//! [`ACCEPT_POLL`]) plus one thread per TCP connection. A connection thread
//! reads the HTTP request head itself, answers NIP-11 or upgrades to a
//! websocket, then loops: drain its outbound channel (live events, injected
//! frames), send due delayed EOSEs, flush, read one message, and, once no
//! message is left, wait for the next frame on its channel *or* input on its
//! socket, whichever comes first (the socket is read by a small reader thread,
//! [`Inbound`]). A published event therefore goes out to its subscribers at
//! once, as from a real relay. [`TestRelay::stop`] wakes every connection
//! thread the same way, so it returns promptly; no wait is longer than
//! [`IDLE_WAIT`].
//!
//! All relay state (options, store, recorded REQs, connections and their
//! subscriptions) lives behind one mutex. A REQ's stored-event query and the
//! registration of its subscription happen under that lock, and live events are
//! queued on the connection's channel under the same lock, so a subscriber sees
//! every event exactly once: either in the stored answer or live afterwards.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select, Sender, TryRecvError};
use log::{debug, trace, warn};
use nostr::event::{Event, EventId};
use nostr::filter::{Filter, MatchEventOptions};
use nostr::key::PublicKey;
use nostr::types::Timestamp;
use parking_lot::Mutex;
use serde_json::value::RawValue;
use serde_json::Value;
use tungstenite::error::CapacityError;
use tungstenite::protocol::{Role, WebSocketConfig};
use tungstenite::{Message, WebSocket};

use super::ngit::{self, NgitGraspPolicy, Purgatory, Verdict};
use super::nip11;
use super::nip77::{self, Nip77Mode, RecordedNegOpen, Session};
use super::policy::{self, Bucket, GraspPolicy, WriteRate};
use crate::net::inbound::Inbound;

/// Largest websocket message (and frame) the relay accepts.
const MAX_MESSAGE_SIZE: usize = 16 << 20;
/// Largest amount of outgoing data buffered for one slow client before the
/// connection is dropped.
const MAX_WRITE_BUFFER: usize = 64 << 20;
/// Read timeout of a connection socket while its HTTP request head is read.
const TICK: Duration = Duration::from_millis(20);
/// The longest a websocket connection loop waits with nothing to do (a safety
/// net: frames to send, input, delayed EOSEs and [`TestRelay::stop`] wake it at
/// once). [`TestRelay::set_idle_wait`] changes it.
const IDLE_WAIT: Duration = Duration::from_secs(1);
/// Write timeout of connection sockets.
const WRITE_TIMEOUT: Duration = Duration::from_millis(200);
/// How often the acceptor polls its nonblocking listener.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// How long a client may take to send its HTTP request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`TestRelay::stop`] lets connection threads close gracefully
/// before shutting their sockets down.
const STOP_GRACE: Duration = Duration::from_secs(1);
/// How long [`TestRelay::start_on_port`] retries a bind that fails with
/// `AddrInUse`.
const REBIND_PATIENCE: Duration = Duration::from_secs(2);

/// Queued on a connection's channel to make its thread hang up once everything queued before
/// it is written (a NUL byte: never a valid JSON frame).
const HANG_UP: &str = "\u{0}hang-up";
/// Queued on every connection's channel by [`TestRelay::stop`] to wake its thread
/// (sends nothing).
const WAKE: &str = "\u{0}wake";

/// A one-shot fault: the next stored answer longer than `after` events is cut off.
#[derive(Debug, Default)]
struct MidAnswerDrop {
    after: Option<usize>,
    fired: u64,
}

/// The NOTICE sent for anything the relay cannot parse, by default (nostr-rs-relay's text).
const PARSE_ERROR: &str = "could not parse command";
/// The answer to a duplicate EVENT, by default.
const DUPLICATE: &str = "duplicate: already have this event";
/// The `CLOSED` reason for a filter with more tag keys than `max_tag_keys` (strfry's text).
const TOO_MANY_TAGS: &str = "ERROR: bad req: too many tags in filter";
/// NOTICE, CLOSED and NEG-ERR frames kept for [`TestRelay::refusals_sent`].
const MAX_RECORDED_REFUSALS: usize = 256;
/// The answer to REQs and EVENTs of a connection that has not authenticated (`require_auth`).
const AUTH_REQUIRED: &str = "auth-required: please authenticate";

/// How a relay answers a REQ that would exceed its subscription limit.
///
/// Real relays differ: some send `["CLOSED", sub_id, msg]`, strfry sends
/// `["NOTICE", "ERROR: too many concurrent REQs"]` and no EOSE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Answer `["CLOSED", sub_id, msg]`.
    Closed(String),
    /// Answer `["NOTICE", msg]` (and nothing else for that REQ).
    Notice(String),
}

/// Behaviour of a [`TestRelay`]; every field can also be changed while the
/// relay runs through the matching `TestRelay::set_*` method.
///
/// Build with struct-update syntax:
/// `TestRelayOptions { result_cap: Some(2), ..Default::default() }`, or start from a relay
/// profile: `TestRelayOptions { result_cap: Some(2), ..TestRelayOptions::profile(Profile::Strfry) }`
/// (see [`Profile`](crate::testing::Profile)).
#[derive(Debug, Clone)]
pub struct TestRelayOptions {
    /// NIP-11 document served to HTTP requests with
    /// `Accept: application/nostr+json`; `None` answers them 404.
    pub nip11: Option<Value>,
    /// Per-filter cap on stored events returned for a REQ, applied on top of
    /// the filter's own `limit`.
    pub result_cap: Option<usize>,
    /// Never send EOSE (stored events are still sent, the subscription stays open).
    pub withhold_eose: bool,
    /// Send EOSE only this long after the stored events (scheduled; the
    /// connection keeps working meanwhile).
    pub eose_delay: Option<Duration>,
    /// Answer every REQ with `["CLOSED", sub_id, msg]` instead of serving it.
    pub closed_on_req: Option<String>,
    /// Answer a REQ of several filters with `["CLOSED", sub_id, "unsupported: multi-filter
    /// REQs aren't supported ..."]`, as some rust-nostr relay-builder versions do.
    pub refuse_multi_filter: bool,
    /// Most open subscriptions allowed per connection.
    pub max_subscriptions: Option<usize>,
    /// The answer to a REQ beyond `max_subscriptions`.
    pub too_many_subs_reply: Reply,
    /// Answer every EVENT with `["OK", id, false, msg]` and store nothing.
    pub reject_events: Option<String>,
    /// Accept TCP connections and close them at once, without any handshake.
    pub refuse_connections: bool,
    /// NIP-42: send `["AUTH", <random challenge>]` on connect and, until the connection has
    /// authenticated (a valid kind-22242 event with the matching `challenge` tag and a `relay`
    /// tag), answer REQs with `["CLOSED", sub, "auth-required: please authenticate"]` and
    /// EVENTs with `["OK", id, false, "auth-required: please authenticate"]`. A connection
    /// opened before this was turned on gets its challenge right after its first refusal.
    pub require_auth: bool,
    /// A relay that lies about its history window: serve stored events as if each filter had
    /// no `since` and `until` (so every page returns the newest events again).
    pub ignore_time_window: bool,
    /// How NIP-77 (negentropy) messages are answered ([`Nip77Mode::Off`] by default: like
    /// nostr-rs-relay, with a NOTICE).
    pub nip77: Nip77Mode,
    /// The most stored events one `NEG-OPEN` may reconcile; a filter matching more is answered
    /// `["NEG-ERR", sub_id, "blocked: too many query results"]` (strfry's `maxSyncEvents`).
    /// `None`: no cap.
    pub nip77_max_records: Option<usize>,
    /// The `NEG-ERR` reason for a `NEG-MSG` naming no open session (by default
    /// `"closed: no such negentropy session"`; strfry says
    /// `"closed: unknown subscription handle"`).
    pub nip77_no_session_reply: String,
    /// Count open negentropy sessions against `max_subscriptions` together with REQs, as
    /// strfry does: a `NEG-OPEN` beyond the limit gets `too_many_subs_reply` (the per-connection
    /// cap of 100 sessions is then not applied).
    pub neg_sessions_count_as_subscriptions: bool,
    /// Negentropy sessions open at once per connection, as rust-nostr's relay builder counts
    /// them (ngit-grasp: 10): one more `NEG-OPEN` is answered
    /// `["NEG-ERR", sub_id, "rate-limited: too many negentropy subscriptions"]`. `None`: 100,
    /// refused `"blocked: too many open negentropy sessions"`.
    pub nip77_max_sessions: Option<usize>,
    /// Records the open negentropy sessions of one connection may hold together, as
    /// rust-nostr's relay builder counts them (ngit-grasp: 50,000): a `NEG-OPEN` whose filter
    /// matches more than what is left gets
    /// `["NEG-ERR", sub_id, "rate-limited: too many negentropy items"]`. `None`: no bound.
    pub nip77_max_items: Option<usize>,
    /// The `limit` applied to a filter that has none (rust-nostr's relay builder: 500), before
    /// `result_cap`. `None`: such a filter gets every match (up to `result_cap`).
    pub default_limit: Option<usize>,
    /// Send no `EOSE` for a REQ whose filters all have `limit: 0` (the subscription is still
    /// open and gets live events), as nostr-rs-relay does.
    pub no_eose_for_limit_zero: bool,
    /// Ignore a REQ repeating both the id and the filters of an open subscription of its
    /// connection (no events, no `EOSE`; it is still recorded), as nostr-rs-relay does. A REQ
    /// reusing an id with other filters replaces the subscription as usual.
    pub ignore_identical_req: bool,
    /// Answer a REQ with a filter holding more than this many tag keys (`#x`) with
    /// `["CLOSED", sub_id, "ERROR: bad req: too many tags in filter"]` (strfry: 3).
    pub max_tag_keys: Option<usize>,
    /// Largest incoming websocket frame and message, in bytes (`None`: 16 MiB). A bigger one
    /// drops the connection without a close frame (after the NOTICE of `oversize_notice`).
    /// Applies to connections opened after it is set.
    pub max_message_size: Option<usize>,
    /// Before dropping a connection for an oversized frame, send
    /// `["NOTICE", "message too large (SIZE > MAX)"]`, as nostr-rs-relay does.
    pub oversize_notice: bool,
    /// The reason of the `["OK", id, true, reason]` answering a duplicate EVENT (by default
    /// `"duplicate: already have this event"`).
    pub duplicate_reply: String,
    /// The NOTICE answering anything the relay cannot parse or does not know (unknown
    /// commands, and the NIP-77 messages under [`Nip77Mode::Off`]); by default
    /// `"could not parse command"`, nostr-rs-relay's text.
    pub parse_error_notice: String,
    /// A per-connection write rate limit (a token bucket, see [`WriteRate`]); `None`: none.
    pub write_rate: Option<WriteRate>,
    /// ngit-relay's rule that a written event must relate to what is stored (see
    /// [`GraspPolicy`]); `None`: every valid event is stored.
    pub grasp_policy: Option<GraspPolicy>,
    /// ngit-grasp's write rules: GRASP-01 purgatory for new repositories and for what waits
    /// for git data, and the rule that an event must relate to what is served (see
    /// [`NgitGraspPolicy`], [`TestRelay::promote`]); `None`: not applied.
    pub ngit_grasp: Option<NgitGraspPolicy>,
    /// Write the events it stores with their members in key order (`content`, `created_at`,
    /// `id`, `kind`, `pubkey`, `sig`, `tags`), as rust-nostr's relay builder does, instead of
    /// as they were received (id first, as nostr-rs-relay writes them). Events stored with
    /// [`TestRelay::insert_raw`] are kept verbatim.
    pub sorted_keys: bool,
}

impl Default for TestRelayOptions {
    fn default() -> Self {
        Self {
            nip11: None,
            result_cap: None,
            withhold_eose: false,
            eose_delay: None,
            closed_on_req: None,
            refuse_multi_filter: false,
            max_subscriptions: None,
            too_many_subs_reply: Reply::Closed("error: too many subscriptions".to_string()),
            reject_events: None,
            refuse_connections: false,
            require_auth: false,
            ignore_time_window: false,
            nip77: Nip77Mode::Off,
            nip77_max_records: None,
            nip77_no_session_reply: nip77::NO_SESSION.to_string(),
            neg_sessions_count_as_subscriptions: false,
            nip77_max_sessions: None,
            nip77_max_items: None,
            default_limit: None,
            no_eose_for_limit_zero: false,
            ignore_identical_req: false,
            max_tag_keys: None,
            max_message_size: None,
            oversize_notice: false,
            duplicate_reply: DUPLICATE.to_string(),
            parse_error_notice: PARSE_ERROR.to_string(),
            write_rate: None,
            grasp_policy: None,
            ngit_grasp: None,
            sorted_keys: false,
        }
    }
}

/// A REQ the relay received (recorded even when it was refused or CLOSED).
#[derive(Debug, Clone)]
pub struct RecordedReq {
    /// Id of the connection it arrived on (ids start at 1, one per TCP accept).
    pub conn: u64,
    /// The subscription id.
    pub sub_id: String,
    /// The parsed filters.
    pub filters: Vec<Filter>,
    /// The whole REQ message as received.
    pub raw: String,
    /// When it was received.
    pub at: Instant,
}

/// A stored event: parsed form plus the JSON served verbatim.
#[derive(Debug, Clone)]
struct Stored {
    event: Event,
    raw: Arc<str>,
}

/// Store order: newest first, then lowest id first.
type OrderKey = (Reverse<Timestamp>, EventId);

/// Identity of a replaceable (`d` = "") or addressable event slot.
type SlotKey = (PublicKey, u16, String);

/// The event store, iterated newest first.
#[derive(Debug, Default)]
struct Store {
    by_order: BTreeMap<OrderKey, Stored>,
    by_id: HashMap<EventId, Timestamp>,
    /// The one event currently held for each replaceable/addressable slot.
    slots: HashMap<SlotKey, EventId>,
}

/// What storing an event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreOutcome {
    Stored,
    Duplicate,
    HaveNewer,
}

impl Store {
    fn len(&self) -> usize {
        self.by_order.len()
    }

    fn contains(&self, id: &EventId) -> bool {
        self.by_id.contains_key(id)
    }

    fn iter(&self) -> impl Iterator<Item = &Stored> {
        self.by_order.values()
    }

    fn remove(&mut self, id: &EventId) {
        if let Some(ts) = self.by_id.remove(id) {
            self.by_order.remove(&(Reverse(ts), *id));
        }
    }

    /// Stores `stored`, applying replaceable/addressable semantics.
    fn put(&mut self, stored: Stored) -> StoreOutcome {
        let event = &stored.event;
        if self.contains(&event.id) {
            return StoreOutcome::Duplicate;
        }
        if let Some(slot) = slot_key(event) {
            if let Some(old_id) = self.slots.get(&slot).copied() {
                if let Some(old_ts) = self.by_id.get(&old_id).copied() {
                    let old_wins = old_ts > event.created_at
                        || (old_ts == event.created_at && old_id < event.id);
                    if old_wins {
                        return StoreOutcome::HaveNewer;
                    }
                }
                self.remove(&old_id);
            }
            self.slots.insert(slot, event.id);
        }
        self.by_id.insert(event.id, event.created_at);
        self.by_order
            .insert((Reverse(event.created_at), event.id), stored);
        StoreOutcome::Stored
    }

    fn clear(&mut self) {
        *self = Store::default();
    }
}

/// The replaceable (kinds 0, 3, 10000–19999) or addressable (30000–39999)
/// slot of `event`, if it has one.
fn slot_key(event: &Event) -> Option<SlotKey> {
    let kind = event.kind.as_u16();
    if kind == 0 || kind == 3 || (10_000..20_000).contains(&kind) {
        Some((event.pubkey, kind, String::new()))
    } else if (30_000..40_000).contains(&kind) {
        let d = event
            .tags
            .iter()
            .find(|t| t.kind() == "d")
            .and_then(|t| t.content())
            .unwrap_or("")
            .to_string();
        Some((event.pubkey, kind, d))
    } else {
        None
    }
}

/// Ephemeral kinds (20000–29999) are relayed live but never stored.
fn is_ephemeral(event: &Event) -> bool {
    (20_000..30_000).contains(&event.kind.as_u16())
}

/// An open subscription.
#[derive(Debug)]
struct Sub {
    filters: Vec<Filter>,
    /// Distinguishes a subscription from an earlier one with the same id.
    generation: u64,
}

impl Sub {
    fn matches(&self, event: &Event) -> bool {
        self.filters
            .iter()
            .any(|f| f.match_event(event, MatchEventOptions::new()))
    }
}

/// A websocket connection as seen from other threads.
#[derive(Debug)]
struct Conn {
    /// Frames for the connection thread to send.
    tx: Sender<String>,
    /// A clone of the socket, to shut it down from outside.
    socket: TcpStream,
    subs: HashMap<String, Sub>,
    /// This connection's NIP-42 challenge.
    challenge: String,
    /// Whether the challenge was sent.
    challenge_sent: bool,
    /// Whether the connection authenticated (NIP-42).
    authed: bool,
    /// Open negentropy sessions by subscription id, with the records each holds.
    neg_sessions: HashMap<String, (Session, usize)>,
    /// `NEG-MSG` replies sent on this connection ([`Nip77Mode::DropAfter`]).
    neg_replies: u64,
    /// This connection's write token bucket (`write_rate`), made at its first EVENT.
    write_bucket: Option<Bucket>,
}

impl Conn {
    /// The open subscriptions counted against `max_subscriptions`: REQs, and negentropy
    /// sessions under `neg_sessions_count_as_subscriptions`.
    fn subscription_count(&self, opts: &TestRelayOptions) -> usize {
        let negs = if opts.neg_sessions_count_as_subscriptions {
            self.neg_sessions.len()
        } else {
            0
        };
        self.subs.len() + negs
    }

    /// Takes a write token (`write_rate`); `false` when the bucket is empty.
    fn take_write_token(&mut self, rate: &WriteRate) -> bool {
        let now = Instant::now();
        let bucket = match &mut self.write_bucket {
            Some(b) if b.is_for(rate) => b,
            slot => slot.insert(Bucket::new(rate, now)),
        };
        bucket.take(now)
    }

    /// `refusal`, followed by the challenge if it was not sent yet.
    fn refused(&mut self, refusal: String) -> Handled {
        let mut frames = vec![refusal];
        if !self.challenge_sent {
            self.challenge_sent = true;
            frames.push(auth_frame(&self.challenge));
        }
        Handled {
            frames,
            delayed_eose: None,
        }
    }
}

/// Everything behind the relay's lock.
#[derive(Debug, Default)]
struct State {
    opts: TestRelayOptions,
    store: Store,
    reqs: Vec<RecordedReq>,
    conns: BTreeMap<u64, Conn>,
    max_subs_per_conn: usize,
    /// The most REQ subscriptions and negentropy sessions open at once on one connection.
    max_slots_per_conn: usize,
    /// The first [`MAX_RECORDED_REFUSALS`] NOTICE, CLOSED and NEG-ERR frames sent.
    refusals_sent: Vec<String>,
    next_generation: u64,
    /// Pubkeys that authenticated (NIP-42), in order, without repeats.
    authenticated: Vec<PublicKey>,
    /// One-shot mid-answer drop ([`TestRelay::set_drop_mid_answer`]).
    mid_answer: MidAnswerDrop,
    /// Every `NEG-OPEN` received (NIP-77 not `Off`).
    neg_opens: Vec<RecordedNegOpen>,
    /// The port the relay listens on (the default domain of `grasp_policy`).
    port: u16,
    /// What `ngit_grasp` holds and does not serve.
    purgatory: Purgatory,
    /// EVENT messages received, per event id (every one that parsed, refused ones too).
    writes: HashMap<EventId, u32>,
}

impl State {
    /// `event` as this relay writes it: `raw` (what it received), or with its keys sorted
    /// ([`TestRelayOptions::sorted_keys`]).
    fn stored(&self, event: Event, raw: &str) -> Stored {
        let raw: Arc<str> = if self.opts.sorted_keys {
            let members: BTreeMap<String, Value> =
                serde_json::from_str(raw).expect("a parsed event is a JSON object");
            serde_json::to_string(&members)
                .expect("a JSON object serialises")
                .into()
        } else {
            raw.into()
        };
        Stored { event, raw }
    }

    /// Queues `["EVENT", sub, raw]` for every open subscription matching `event`.
    fn deliver(&self, event: &Event, raw: &str) {
        for conn in self.conns.values() {
            for (sub_id, sub) in &conn.subs {
                if sub.matches(event) {
                    let _ = conn.tx.send(event_frame(sub_id, raw));
                }
            }
        }
    }

    /// Stores `stored` and, when it was new, delivers it live.
    fn store_and_deliver(&mut self, stored: Stored) -> StoreOutcome {
        let event = stored.event.clone();
        let raw = Arc::clone(&stored.raw);
        let outcome = self.store.put(stored);
        if outcome == StoreOutcome::Stored {
            self.deliver(&event, &raw);
        }
        outcome
    }

    /// Queues `frame` on every connection.
    fn broadcast(&self, frame: &str) {
        for conn in self.conns.values() {
            let _ = conn.tx.send(frame.to_string());
        }
    }
}

/// State shared by the relay handle and its threads.
#[derive(Debug, Default)]
struct Shared {
    stop: AtomicBool,
    state: Mutex<State>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next_conn: AtomicU64,
    tcp_accepts: AtomicU64,
    connections_accepted: AtomicU64,
    nip11_requests: AtomicU64,
    pings_received: AtomicU64,
    /// [`TestRelay::set_idle_wait`] in milliseconds; 0: [`IDLE_WAIT`].
    idle_wait_ms: AtomicU64,
    /// Payload bytes of the websocket messages written to clients.
    bytes_sent: AtomicU64,
    /// Connections hung up by [`Nip77Mode::DropAfter`].
    nip77_drops: AtomicU64,
    /// `AUTH` messages received from clients (all connections).
    auth_messages: AtomicU64,
    /// NOTICE frames written to clients.
    notices_sent: AtomicU64,
    /// CLOSED frames written to clients.
    closed_sent: AtomicU64,
    /// NEG-ERR frames written to clients.
    neg_errs_sent: AtomicU64,
}

impl Shared {
    fn idle_wait(&self) -> Duration {
        match self.idle_wait_ms.load(Ordering::Relaxed) {
            0 => IDLE_WAIT,
            ms => Duration::from_millis(ms),
        }
    }
}

/// An EOSE scheduled by `eose_delay`.
#[derive(Debug)]
struct PendingEose {
    at: Instant,
    sub_id: String,
    generation: u64,
}

/// What the connection thread must do after handling one message.
#[derive(Debug, Default)]
struct Handled {
    frames: Vec<String>,
    delayed_eose: Option<PendingEose>,
}

impl Handled {
    fn frame(frame: String) -> Self {
        Handled {
            frames: vec![frame],
            delayed_eose: None,
        }
    }
}

fn json_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

fn event_frame(sub_id: &str, raw: &str) -> String {
    format!("[\"EVENT\",{},{raw}]", json_str(sub_id))
}

fn eose_frame(sub_id: &str) -> String {
    format!("[\"EOSE\",{}]", json_str(sub_id))
}

fn closed_frame(sub_id: &str, msg: &str) -> String {
    format!("[\"CLOSED\",{},{}]", json_str(sub_id), json_str(msg))
}

fn notice_frame(msg: &str) -> String {
    format!("[\"NOTICE\",{}]", json_str(msg))
}

fn auth_frame(challenge: &str) -> String {
    format!("[\"AUTH\",{}]", json_str(challenge))
}

fn ok_frame(id: &EventId, accepted: bool, msg: &str) -> String {
    format!("[\"OK\",\"{}\",{accepted},{}]", id.to_hex(), json_str(msg))
}

/// A connection's socket: writes go straight to the socket (with its write
/// timeout), reads come from its reader thread and never block.
struct RelayStream {
    tcp: TcpStream,
    inbound: Inbound,
}

impl Read for RelayStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inbound.read(buf)
    }
}

impl Write for RelayStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.tcp.flush()
    }
}

/// Whether a tungstenite error only means "nothing more right now".
fn is_transient(err: &tungstenite::Error) -> bool {
    matches!(err, tungstenite::Error::Io(e) if is_transient_io(e))
}

fn is_transient_io(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// A scriptable NIP-01 relay listening on `ws://127.0.0.1:PORT`.
///
/// Runs on plain threads inside the process. Dropping it (or calling
/// [`stop`](Self::stop)) closes the listener and every connection and joins all
/// threads. All methods take `&self`, so a relay can be shared across threads
/// (e.g. in an `Arc`).
///
/// Stored events keep the exact JSON they arrived with and are served verbatim.
/// EVENTs from clients are verified (id and signature); [`insert`](Self::insert)
/// and [`insert_raw`](Self::insert_raw) bypass verification so tests can plant
/// forged events. Replaceable kinds (0, 3, 10000–19999) keep one event per
/// (pubkey, kind), addressable kinds (30000–39999) one per (pubkey, kind, `d`):
/// the newest, ties going to the lowest id; an older version is answered
/// `["OK", id, false, "replaced: have newer event"]` as strfry does. Ephemeral
/// kinds (20000–29999) published by clients are relayed live and not stored.
pub struct TestRelay {
    shared: Arc<Shared>,
    addr: SocketAddr,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for TestRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestRelay")
            .field("url", &self.url())
            .field("stopped", &self.shared.stop.load(Ordering::SeqCst))
            .finish_non_exhaustive()
    }
}

impl TestRelay {
    /// Starts a relay with default options on an ephemeral port of 127.0.0.1.
    ///
    /// # Panics
    /// If no port on 127.0.0.1 can be bound.
    pub fn start() -> TestRelay {
        Self::start_with(TestRelayOptions::default())
    }

    /// Starts a relay with `opts` on an ephemeral port of 127.0.0.1.
    ///
    /// # Panics
    /// If no port on 127.0.0.1 can be bound.
    pub fn start_with(opts: TestRelayOptions) -> TestRelay {
        match Self::start_with_store(0, opts, Vec::new()) {
            Ok(relay) => relay,
            Err(e) => panic!("test relay: cannot bind 127.0.0.1:0: {e}"),
        }
    }

    /// Starts a relay with `opts` on 127.0.0.1:`port` (`0` picks a free port).
    ///
    /// Use it to simulate a restart: stop a relay, then start another on its
    /// [`port`](Self::port). A bind failing with `AddrInUse` is retried for up
    /// to two seconds.
    pub fn start_on_port(port: u16, opts: TestRelayOptions) -> io::Result<TestRelay> {
        Self::start_with_store(port, opts, Vec::new())
    }

    /// Starts a relay on 127.0.0.1:`port` (`0` picks a free port) whose store
    /// already holds `store` (raw event JSON, as from
    /// [`raw_events`](Self::raw_events); not verified).
    ///
    /// Fails with `InvalidData` if an entry is not an event, or with the bind error.
    pub fn start_with_store(
        port: u16,
        opts: TestRelayOptions,
        store: Vec<String>,
    ) -> io::Result<TestRelay> {
        let mut state = State {
            opts,
            ..State::default()
        };
        for raw in store {
            let event = Event::from_json(&raw).map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidData, format!("bad stored event: {e}"))
            })?;
            state.store.put(Stored {
                event,
                raw: raw.into(),
            });
        }

        let listener = bind_with_retry(port)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        state.port = addr.port();
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            ..Shared::default()
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name(format!("test-relay-accept-{}", addr.port()))
                .spawn(move || accept_loop(&shared, listener))?
        };
        debug!("test relay listening on ws://{addr}");
        Ok(TestRelay {
            shared,
            addr,
            acceptor: Mutex::new(Some(acceptor)),
        })
    }

    /// Stops this relay and starts a new one on the same port with the same
    /// options and stored events (recorded REQs and counters start afresh).
    pub fn restart(self) -> io::Result<TestRelay> {
        self.stop();
        let port = self.port();
        let opts = self.shared.state.lock().opts.clone();
        let store = self.raw_events();
        drop(self);
        Self::start_with_store(port, opts, store)
    }

    /// The relay's URL, `ws://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("ws://127.0.0.1:{}", self.addr.port())
    }

    /// The port the relay listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Closes the listener and every connection (with a websocket close frame
    /// where possible) and joins all threads, within about a second even with
    /// unresponsive clients. Idempotent; also run on drop.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let acceptor = self.acceptor.lock().take();
        let Some(acceptor) = acceptor else {
            return;
        };
        // Joining the acceptor drops the listener, freeing the port; after it
        // no thread handle can be added any more.
        let _ = acceptor.join();
        // Wake every connection thread: it sees the stop flag and closes.
        self.shared.state.lock().broadcast(WAKE);
        let handles = std::mem::take(&mut *self.shared.threads.lock());
        let deadline = Instant::now() + STOP_GRACE;
        while handles.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        {
            let mut state = self.shared.state.lock();
            for conn in state.conns.values() {
                let _ = conn.socket.shutdown(Shutdown::Both);
            }
            state.conns.clear();
        }
        for handle in handles {
            let _ = handle.join();
        }
        debug!("test relay on port {} stopped", self.addr.port());
    }

    // ----- options -----

    /// Serves `doc` as the NIP-11 document (`None`: answer 404).
    pub fn set_nip11(&self, doc: Option<Value>) {
        self.shared.state.lock().opts.nip11 = doc;
    }

    /// Caps every filter of later REQs to at most `cap` stored events.
    pub fn set_result_cap(&self, cap: Option<usize>) {
        self.shared.state.lock().opts.result_cap = cap;
    }

    /// Withholds EOSE for later REQs.
    pub fn set_withhold_eose(&self, withhold: bool) {
        self.shared.state.lock().opts.withhold_eose = withhold;
    }

    /// Delays EOSE of later REQs by `delay`.
    pub fn set_eose_delay(&self, delay: Option<Duration>) {
        self.shared.state.lock().opts.eose_delay = delay;
    }

    /// Answers later REQs with `["CLOSED", sub_id, msg]` (`None`: serve them).
    pub fn set_closed_on_req(&self, msg: Option<String>) {
        self.shared.state.lock().opts.closed_on_req = msg;
    }

    /// Limits open subscriptions per connection (`None`: unlimited).
    pub fn set_max_subscriptions(&self, max: Option<usize>) {
        self.shared.state.lock().opts.max_subscriptions = max;
    }

    /// Sets the answer to a REQ beyond the subscription limit.
    pub fn set_too_many_subs_reply(&self, reply: Reply) {
        self.shared.state.lock().opts.too_many_subs_reply = reply;
    }

    /// Rejects later EVENTs with `["OK", id, false, msg]` (`None`: accept them).
    pub fn set_reject_events(&self, msg: Option<String>) {
        self.shared.state.lock().opts.reject_events = msg;
    }

    /// Closes new TCP connections right after accepting them.
    pub fn set_refuse_connections(&self, refuse: bool) {
        self.shared.state.lock().opts.refuse_connections = refuse;
    }

    /// Requires NIP-42 authentication (see [`TestRelayOptions::require_auth`]). Connections
    /// already open get their challenge right after their first refused REQ or EVENT (after
    /// the `CLOSED` or `OK`), so a client sees the refusal before the challenge.
    pub fn set_require_auth(&self, require: bool) {
        self.shared.state.lock().opts.require_auth = require;
    }

    /// Sets how NIP-77 (negentropy) messages are answered (see [`Nip77Mode`]). Sessions
    /// already open stay open (and are served unless the mode is `Off` or `Silent`).
    pub fn set_nip77(&self, mode: Nip77Mode) {
        self.shared.state.lock().opts.nip77 = mode;
    }

    /// Caps the stored events one later `NEG-OPEN` may reconcile (see
    /// [`TestRelayOptions::nip77_max_records`]).
    pub fn set_nip77_max_records(&self, max: Option<usize>) {
        self.shared.state.lock().opts.nip77_max_records = max;
    }

    /// Sets the `NEG-ERR` reason for a `NEG-MSG` naming no open session (see
    /// [`TestRelayOptions::nip77_no_session_reply`]).
    pub fn set_nip77_no_session_reply(&self, reason: &str) {
        self.shared.state.lock().opts.nip77_no_session_reply = reason.to_string();
    }

    /// Counts negentropy sessions against the subscription limit (see
    /// [`TestRelayOptions::neg_sessions_count_as_subscriptions`]).
    pub fn set_neg_sessions_count_as_subscriptions(&self, count: bool) {
        self.shared
            .state
            .lock()
            .opts
            .neg_sessions_count_as_subscriptions = count;
    }

    /// Sets the `limit` of later filters that have none (see
    /// [`TestRelayOptions::default_limit`]).
    pub fn set_default_limit(&self, limit: Option<usize>) {
        self.shared.state.lock().opts.default_limit = limit;
    }

    /// Withholds the `EOSE` of later REQs whose filters all have `limit: 0` (see
    /// [`TestRelayOptions::no_eose_for_limit_zero`]).
    pub fn set_no_eose_for_limit_zero(&self, no_eose: bool) {
        self.shared.state.lock().opts.no_eose_for_limit_zero = no_eose;
    }

    /// Ignores later REQs repeating an open subscription (see
    /// [`TestRelayOptions::ignore_identical_req`]).
    pub fn set_ignore_identical_req(&self, ignore: bool) {
        self.shared.state.lock().opts.ignore_identical_req = ignore;
    }

    /// Limits the tag keys of a filter (see [`TestRelayOptions::max_tag_keys`]).
    pub fn set_max_tag_keys(&self, max: Option<usize>) {
        self.shared.state.lock().opts.max_tag_keys = max;
    }

    /// Sets the largest incoming frame and message of connections opened from now on (see
    /// [`TestRelayOptions::max_message_size`]).
    pub fn set_max_message_size(&self, max: Option<usize>) {
        self.shared.state.lock().opts.max_message_size = max;
    }

    /// Sends a NOTICE before dropping a connection for an oversized frame (see
    /// [`TestRelayOptions::oversize_notice`]).
    pub fn set_oversize_notice(&self, notice: bool) {
        self.shared.state.lock().opts.oversize_notice = notice;
    }

    /// Sets the reason of the `OK true` answering a duplicate EVENT.
    pub fn set_duplicate_reply(&self, reason: &str) {
        self.shared.state.lock().opts.duplicate_reply = reason.to_string();
    }

    /// Sets the NOTICE answering what the relay cannot parse (see
    /// [`TestRelayOptions::parse_error_notice`]).
    pub fn set_parse_error_notice(&self, notice: &str) {
        self.shared.state.lock().opts.parse_error_notice = notice.to_string();
    }

    /// Limits the write rate of every connection (see [`WriteRate`]; `None`: no limit). Each
    /// connection starts a full bucket at its next EVENT.
    pub fn set_write_rate(&self, rate: Option<WriteRate>) {
        self.shared.state.lock().opts.write_rate = rate;
    }

    /// Applies ngit-relay's rule to later EVENTs (see [`GraspPolicy`]; `None`: store every
    /// valid event).
    pub fn set_grasp_policy(&self, policy: Option<GraspPolicy>) {
        self.shared.state.lock().opts.grasp_policy = policy;
    }

    /// Applies ngit-grasp's write rules to later EVENTs (see [`NgitGraspPolicy`]; `None`:
    /// not applied). What is held in purgatory stays held.
    pub fn set_ngit_grasp(&self, policy: Option<NgitGraspPolicy>) {
        self.shared.state.lock().opts.ngit_grasp = policy;
    }

    /// Limits the negentropy sessions open at once per connection (see
    /// [`TestRelayOptions::nip77_max_sessions`]).
    pub fn set_nip77_max_sessions(&self, max: Option<usize>) {
        self.shared.state.lock().opts.nip77_max_sessions = max;
    }

    /// Limits the records of a connection's open negentropy sessions together (see
    /// [`TestRelayOptions::nip77_max_items`]).
    pub fn set_nip77_max_items(&self, max: Option<usize>) {
        self.shared.state.lock().opts.nip77_max_items = max;
    }

    /// A copy of the current options.
    pub fn options(&self) -> TestRelayOptions {
        self.shared.state.lock().opts.clone()
    }

    // ----- fault injection -----

    /// Shuts down every current connection's socket without a close frame and
    /// forgets its subscriptions (at once: [`current_connections`](Self::current_connections)
    /// is 0 when this returns).
    pub fn drop_connections(&self) {
        let conns = std::mem::take(&mut self.shared.state.lock().conns);
        debug!("test relay: dropping {} connection(s)", conns.len());
        for conn in conns.values() {
            let _ = conn.socket.shutdown(Shutdown::Both);
        }
    }

    /// Sends `["NOTICE", msg]` to every connection.
    pub fn send_notice(&self, msg: &str) {
        self.shared.state.lock().broadcast(&notice_frame(msg));
    }

    /// Sends `["AUTH", challenge]` to every connection.
    pub fn send_auth(&self, challenge: &str) {
        self.shared.state.lock().broadcast(&auth_frame(challenge));
    }

    /// Sends `["CLOSED", sub_id, msg]` for every open subscription on every
    /// connection and removes them.
    pub fn send_closed_all(&self, msg: &str) {
        let mut state = self.shared.state.lock();
        for conn in state.conns.values_mut() {
            for (sub_id, _) in conn.subs.drain() {
                let _ = conn.tx.send(closed_frame(&sub_id, msg));
            }
        }
    }

    /// Sends `text` as a text frame, verbatim, to every connection.
    pub fn send_raw(&self, text: &str) {
        self.shared.state.lock().broadcast(text);
    }

    /// Sends `["EVENT", sub_id, raw_event_json]` to every open subscription
    /// whatever its filters (`raw_event_json` is inserted verbatim and not
    /// stored).
    pub fn push_to_subscriptions(&self, raw_event_json: &str) {
        let state = self.shared.state.lock();
        for conn in state.conns.values() {
            for sub_id in conn.subs.keys() {
                let _ = conn.tx.send(event_frame(sub_id, raw_event_json));
            }
        }
    }

    // ----- store -----

    /// Stores `event` without verifying it and delivers it to matching open
    /// subscriptions. Returns `false` if it was a duplicate or a newer version
    /// of its replaceable/addressable slot is held.
    pub fn insert(&self, event: &Event) -> bool {
        let mut state = self.shared.state.lock();
        let stored = state.stored(event.clone(), &event.as_json());
        state.store_and_deliver(stored) == StoreOutcome::Stored
    }

    /// Stores `event` without verifying it and *without* delivering it to open subscriptions,
    /// as if it had reached the relay while the subscriber's live subscription missed it (only
    /// a later query finds it). Returns whether it was stored, as [`insert`](Self::insert).
    pub fn insert_silently(&self, event: &Event) -> bool {
        let mut state = self.shared.state.lock();
        let stored = state.stored(event.clone(), &event.as_json());
        state.store.put(stored) == StoreOutcome::Stored
    }

    /// Stores the event JSON `raw` verbatim (not verified: forged signatures
    /// are kept and served as they are) and delivers it to matching open
    /// subscriptions. Returns whether it was stored, as [`insert`](Self::insert).
    pub fn insert_raw(&self, raw: &str) -> Result<bool, nostr::error::Error> {
        let event = Event::from_json(raw)?;
        let stored = Stored {
            event,
            raw: raw.into(),
        };
        Ok(self.shared.state.lock().store_and_deliver(stored) == StoreOutcome::Stored)
    }

    /// The stored events, newest first (then lowest id).
    pub fn events(&self) -> Vec<Event> {
        let state = self.shared.state.lock();
        state.store.iter().map(|s| s.event.clone()).collect()
    }

    /// The stored events' JSON as served, newest first (then lowest id).
    pub fn raw_events(&self) -> Vec<String> {
        let state = self.shared.state.lock();
        state.store.iter().map(|s| s.raw.to_string()).collect()
    }

    /// The ids of the stored events.
    pub fn event_ids(&self) -> HashSet<EventId> {
        let state = self.shared.state.lock();
        state.store.by_id.keys().copied().collect()
    }

    /// Whether an event with `id` is stored.
    pub fn contains(&self, id: &EventId) -> bool {
        self.shared.state.lock().store.contains(id)
    }

    /// Number of stored events.
    pub fn len(&self) -> usize {
        self.shared.state.lock().store.len()
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes every stored event.
    pub fn clear_events(&self) {
        self.shared.state.lock().store.clear();
    }

    /// Under [`TestRelayOptions::ngit_grasp`]: the git data of the repository `coordinate`
    /// (`30617:<pubkey hex>:<d>`) arrived (a push, or ngit-grasp's own fetch). Its announcement
    /// held in purgatory, the held state events it authorizes and the held pull requests naming
    /// it are stored and delivered live, as ngit-grasp serves them then. Returns how many
    /// events left purgatory (0 for a coordinate that does not parse).
    pub fn promote(&self, coordinate: &str) -> usize {
        let mut parts = coordinate.splitn(3, ':');
        let (Some("30617"), Some(pk), Some(d)) = (parts.next(), parts.next(), parts.next()) else {
            return 0;
        };
        let Ok(owner) = PublicKey::from_hex(pk) else {
            return 0;
        };
        let mut guard = self.shared.state.lock();
        let state = &mut *guard;
        let served: Vec<&Event> = state.store.iter().map(|s| &s.event).collect();
        let promoted = state.purgatory.promote(&owner, d, &served, Instant::now());
        let n = promoted.len();
        for (event, raw) in promoted {
            let stored = state.stored(event, &raw);
            state.store_and_deliver(stored);
        }
        n
    }

    /// Under [`TestRelayOptions::ngit_grasp`]: the ids of the events held in purgatory now
    /// (accepted, not served, not yet dropped).
    pub fn purgatory_ids(&self) -> HashSet<EventId> {
        self.shared.state.lock().purgatory.ids(Instant::now())
    }

    /// EVENT messages received so far (every one that parsed, refused ones included).
    pub fn writes_received(&self) -> u64 {
        let state = self.shared.state.lock();
        state.writes.values().map(|&n| u64::from(n)).sum()
    }

    /// EVENT messages received so far carrying the event `id`.
    pub fn writes_of(&self, id: &EventId) -> u32 {
        self.shared
            .state
            .lock()
            .writes
            .get(id)
            .copied()
            .unwrap_or(0)
    }

    // ----- observation -----

    /// Every REQ received so far, in arrival order.
    pub fn reqs(&self) -> Vec<RecordedReq> {
        self.shared.state.lock().reqs.clone()
    }

    /// Forgets the recorded REQs.
    pub fn clear_reqs(&self) {
        self.shared.state.lock().reqs.clear();
    }

    /// Test hook: the longest a connection thread waits with nothing to do (default one
    /// second). Published events, client input, delayed EOSEs and [`stop`](Self::stop)
    /// wake it at once whatever this is; a very long wait shows that nothing depends on it.
    pub fn set_idle_wait(&self, wait: Duration) {
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
        self.shared.idle_wait_ms.store(ms, Ordering::Relaxed);
    }

    /// Every `NEG-OPEN` received so far (NIP-77 not `Off`), in arrival order.
    pub fn neg_opens(&self) -> Vec<RecordedNegOpen> {
        self.shared.state.lock().neg_opens.clone()
    }

    /// Number of negentropy sessions open now, over all connections.
    pub fn open_neg_sessions(&self) -> usize {
        let state = self.shared.state.lock();
        state.conns.values().map(|c| c.neg_sessions.len()).sum()
    }

    /// Connections hung up by [`Nip77Mode::DropAfter`] so far.
    pub fn nip77_drops(&self) -> u64 {
        self.shared.nip77_drops.load(Ordering::SeqCst)
    }

    /// Payload bytes of every websocket message sent to clients so far (events, EOSE,
    /// NEG-MSG, NOTICE, …; neither websocket framing nor HTTP answers). Restarts at 0 with
    /// [`restart`](Self::restart).
    pub fn bytes_sent(&self) -> u64 {
        self.shared.bytes_sent.load(Ordering::Relaxed)
    }

    /// Number of subscriptions open now, over all connections.
    pub fn open_subscriptions(&self) -> usize {
        let state = self.shared.state.lock();
        state.conns.values().map(|c| c.subs.len()).sum()
    }

    /// The most subscriptions ever open at once on a single connection.
    pub fn max_open_subscriptions_per_connection(&self) -> usize {
        self.shared.state.lock().max_subs_per_conn
    }

    /// The most REQ subscriptions and negentropy sessions ever open at once on a single
    /// connection, counted together (as strfry counts them against `max_subscriptions`),
    /// whether or not this relay counts sessions
    /// ([`TestRelayOptions::neg_sessions_count_as_subscriptions`]). A REQ or `NEG-OPEN`
    /// refused for the limit is not open and not counted.
    pub fn max_subscriptions_and_neg_sessions_per_connection(&self) -> usize {
        self.shared.state.lock().max_slots_per_conn
    }

    /// `NOTICE` frames sent to clients so far (all connections): refusals, parse errors and
    /// [`send_notice`](Self::send_notice) alike. Texts: [`refusals_sent`](Self::refusals_sent).
    pub fn notices_sent(&self) -> u64 {
        self.shared.notices_sent.load(Ordering::SeqCst)
    }

    /// `CLOSED` frames sent to clients so far (all connections), whatever their reason.
    pub fn closed_sent(&self) -> u64 {
        self.shared.closed_sent.load(Ordering::SeqCst)
    }

    /// `NEG-ERR` frames sent to clients so far (all connections).
    pub fn neg_errs_sent(&self) -> u64 {
        self.shared.neg_errs_sent.load(Ordering::SeqCst)
    }

    /// The first 256 `NOTICE`, `CLOSED` and `NEG-ERR` frames sent, as written, in order.
    pub fn refusals_sent(&self) -> Vec<String> {
        self.shared.state.lock().refusals_sent.clone()
    }

    /// Number of websocket connections established (upgrade completed).
    pub fn connections_accepted(&self) -> u64 {
        self.shared.connections_accepted.load(Ordering::SeqCst)
    }

    /// Number of TCP connections accepted, including refused ones and plain
    /// HTTP (NIP-11) requests.
    pub fn tcp_accepts(&self) -> u64 {
        self.shared.tcp_accepts.load(Ordering::SeqCst)
    }

    /// Number of websocket connections open now.
    pub fn current_connections(&self) -> usize {
        self.shared.state.lock().conns.len()
    }

    /// Pubkeys that authenticated with NIP-42 so far (in order, without repeats).
    pub fn authenticated_pubkeys(&self) -> Vec<PublicKey> {
        self.shared.state.lock().authenticated.clone()
    }

    /// Number of HTTP requests carrying `Accept: application/nostr+json`
    /// (counted whether or not a NIP-11 document is configured).
    pub fn nip11_requests(&self) -> u64 {
        self.shared.nip11_requests.load(Ordering::SeqCst)
    }

    /// `AUTH` messages received from clients (all connections), valid or not.
    pub fn auth_messages_received(&self) -> u64 {
        self.shared.auth_messages.load(Ordering::SeqCst)
    }

    /// Websocket pings received from clients (all connections).
    pub fn pings_received(&self) -> u64 {
        self.shared.pings_received.load(Ordering::SeqCst)
    }
}

/// Fault injection for randomized fault tests (`tests/faults.rs`).
impl TestRelay {
    /// Arms (`Some(n)`) or disarms (`None`) a one-shot mid-answer drop: the next REQ whose
    /// stored answer holds more than `n` events gets only its first `n` events (newest first,
    /// no EOSE), after which the connection is closed without a close frame, as when a real
    /// relay dies while sending a capped page. Fires once, then disarms itself.
    pub fn set_drop_mid_answer(&self, after: Option<usize>) {
        self.shared.state.lock().mid_answer.after = after;
    }

    /// How many answers a mid-answer drop cut off so far.
    pub fn mid_answer_drops(&self) -> u64 {
        self.shared.state.lock().mid_answer.fired
    }

    /// The open subscriptions as `(connection id, subscription id)`, sorted.
    pub fn subscription_ids(&self) -> Vec<(u64, String)> {
        let state = self.shared.state.lock();
        let mut ids: Vec<(u64, String)> = state
            .conns
            .iter()
            .flat_map(|(c, conn)| conn.subs.keys().map(move |s| (*c, s.clone())))
            .collect();
        ids.sort();
        ids
    }

    /// Sends `["CLOSED", sub_id, msg]` for the subscription `sub_id` of connection `conn` and
    /// removes it. Returns whether it was open.
    pub fn send_closed(&self, conn: u64, sub_id: &str, msg: &str) -> bool {
        let mut state = self.shared.state.lock();
        let Some(c) = state.conns.get_mut(&conn) else {
            return false;
        };
        if c.subs.remove(sub_id).is_none() {
            return false;
        }
        let _ = c.tx.send(closed_frame(sub_id, msg));
        true
    }
}

impl Drop for TestRelay {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Binds 127.0.0.1:`port`, retrying `AddrInUse` for [`REBIND_PATIENCE`].
fn bind_with_retry(port: u16) -> io::Result<TcpListener> {
    let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
    let deadline = Instant::now() + REBIND_PATIENCE;
    loop {
        match TcpListener::bind(addr) {
            Ok(listener) => return Ok(listener),
            Err(e)
                if port != 0
                    && e.kind() == io::ErrorKind::AddrInUse
                    && Instant::now() < deadline =>
            {
                thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener) {
    while !shared.stop.load(Ordering::SeqCst) {
        let (stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if is_transient_io(&e) => {
                thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) => {
                debug!("test relay: accept failed: {e}");
                thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        shared.tcp_accepts.fetch_add(1, Ordering::SeqCst);
        if shared.state.lock().opts.refuse_connections {
            trace!("test relay: refusing connection from {peer}");
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let conn_id = shared.next_conn.fetch_add(1, Ordering::SeqCst) + 1;
        trace!("test relay: connection {conn_id} from {peer}");
        let thread_shared = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name(format!("test-relay-conn-{conn_id}"))
            .spawn(move || serve_connection(&thread_shared, stream, conn_id));
        match spawned {
            Ok(handle) => {
                let mut threads = shared.threads.lock();
                threads.retain(|h| !h.is_finished());
                threads.push(handle);
            }
            Err(e) => warn!("test relay: cannot spawn connection thread: {e}"),
        }
    }
    trace!("test relay: acceptor exiting");
}

/// Reads the HTTP request head; returns it and any bytes read past it.
fn read_head(shared: &Shared, stream: &mut TcpStream) -> Option<(Vec<u8>, Vec<u8>)> {
    let deadline = Instant::now() + HEAD_TIMEOUT;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = nip11::find_head_end(&buf) {
            if end > nip11::MAX_HEAD_BYTES {
                let _ = stream.write_all(&nip11::error_response(
                    431,
                    "Request Header Fields Too Large",
                ));
                return None;
            }
            let rest = buf.split_off(end);
            return Some((buf, rest));
        }
        if buf.len() > nip11::MAX_HEAD_BYTES {
            let _ = stream.write_all(&nip11::error_response(
                431,
                "Request Header Fields Too Large",
            ));
            return None;
        }
        if shared.stop.load(Ordering::SeqCst) || Instant::now() > deadline {
            return None;
        }
        match stream.read(&mut chunk) {
            Ok(0) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if is_transient_io(&e) => {}
            Err(_) => return None,
        }
    }
}

fn serve_connection(shared: &Arc<Shared>, mut stream: TcpStream, conn_id: u64) {
    let configured = stream
        .set_read_timeout(Some(TICK))
        .and_then(|()| stream.set_write_timeout(Some(WRITE_TIMEOUT)))
        .and_then(|()| stream.set_nodelay(true));
    if let Err(e) = configured {
        debug!("test relay: connection {conn_id}: cannot configure socket: {e}");
        return;
    }
    let Some((head, rest)) = read_head(shared, &mut stream) else {
        trace!("test relay: connection {conn_id}: no request head");
        return;
    };
    let Some(head) = nip11::parse_head(&head) else {
        let _ = stream.write_all(&nip11::error_response(400, "Bad Request"));
        return;
    };
    if let Some(key) = head.websocket_key() {
        if let Err(e) = stream.write_all(&nip11::switching_protocols(key)) {
            debug!("test relay: connection {conn_id}: cannot answer upgrade: {e}");
            return;
        }
        run_websocket(shared, stream, rest, conn_id);
        return;
    }
    let response = if head.wants_nip11() {
        shared.nip11_requests.fetch_add(1, Ordering::SeqCst);
        let state = shared.state.lock();
        match &state.opts.nip11 {
            Some(doc) if state.opts.nip77.advertised() => {
                nip11::nip11_document(&nip77::advertise(doc))
            }
            Some(doc) => nip11::nip11_document(doc),
            None => nip11::error_response(404, "Not Found"),
        }
    } else {
        nip11::error_response(404, "Not Found")
    };
    trace!(
        "test relay: connection {conn_id}: HTTP {} {}",
        head.method,
        head.target
    );
    let _ = stream.write_all(&response);
    let _ = stream.flush();
    let _ = stream.shutdown(Shutdown::Write);
}

fn run_websocket(shared: &Arc<Shared>, stream: TcpStream, rest: Vec<u8>, conn_id: u64) {
    let socket = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            debug!("test relay: connection {conn_id}: cannot clone socket: {e}");
            return;
        }
    };
    let inbound = match Inbound::start(&stream, format!("test-relay-read-{conn_id}")) {
        Ok(i) => i,
        Err(e) => {
            debug!("test relay: connection {conn_id}: cannot start its reader: {e}");
            return;
        }
    };
    let stream = RelayStream {
        tcp: stream,
        inbound,
    };
    let max_message = shared
        .state
        .lock()
        .opts
        .max_message_size
        .unwrap_or(MAX_MESSAGE_SIZE);
    let config = WebSocketConfig::default()
        .max_message_size(Some(max_message))
        .max_frame_size(Some(max_message))
        .max_write_buffer_size(MAX_WRITE_BUFFER);
    let mut ws = if rest.is_empty() {
        WebSocket::from_raw_socket(stream, Role::Server, Some(config))
    } else {
        WebSocket::from_partially_read(stream, rest, Role::Server, Some(config))
    };
    let (tx, rx) = crossbeam_channel::unbounded();
    {
        let mut state = shared.state.lock();
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let challenge = format!(
            "{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        let challenge_sent = state.opts.require_auth;
        if challenge_sent {
            let _ = tx.send(auth_frame(&challenge));
        }
        state.conns.insert(
            conn_id,
            Conn {
                tx,
                socket,
                subs: HashMap::default(),
                challenge,
                challenge_sent,
                authed: false,
                neg_sessions: HashMap::default(),
                neg_replies: 0,
                write_bucket: None,
            },
        );
    }
    shared.connections_accepted.fetch_add(1, Ordering::SeqCst);
    debug!("test relay: connection {conn_id}: websocket open");
    connection_loop(shared, &mut ws, &rx, conn_id);
    shared.state.lock().conns.remove(&conn_id);
    debug!("test relay: connection {conn_id}: closed");
}

/// Writes `frame` (counted in [`TestRelay::bytes_sent`]); returns `false` if the connection
/// is broken.
fn write_frame(shared: &Shared, ws: &mut WebSocket<RelayStream>, frame: String) -> bool {
    shared
        .bytes_sent
        .fetch_add(frame.len() as u64, Ordering::Relaxed);
    count_refusal(shared, &frame);
    match ws.write(Message::text(frame)) {
        Ok(()) => true,
        // The frame stays buffered and goes out with a later flush.
        Err(e) if is_transient(&e) => true,
        Err(e) => {
            trace!("test relay: write failed: {e}");
            false
        }
    }
}

fn connection_loop(
    shared: &Shared,
    ws: &mut WebSocket<RelayStream>,
    rx: &Receiver<String>,
    conn_id: u64,
) {
    let mut pending: Vec<PendingEose> = Vec::new();
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            let _ = ws.close(None);
            let _ = ws.flush();
            return;
        }
        loop {
            match rx.try_recv() {
                Ok(frame) if frame == HANG_UP => {
                    // Mid-answer drop: what was written goes out, then the socket closes
                    // without a close frame.
                    let _ = ws.flush();
                    debug!("test relay: connection {conn_id}: hung up mid-answer");
                    return;
                }
                Ok(frame) if frame == WAKE => {}
                Ok(frame) => {
                    if !write_frame(shared, ws, frame) {
                        return;
                    }
                }
                Err(TryRecvError::Empty) => break,
                // The connection was dropped from outside.
                Err(TryRecvError::Disconnected) => return,
            }
        }
        if !pending.is_empty() {
            let now = Instant::now();
            let (due, later): (Vec<_>, Vec<_>) = pending.into_iter().partition(|p| p.at <= now);
            pending = later;
            for eose in due {
                let still_open = shared
                    .state
                    .lock()
                    .conns
                    .get(&conn_id)
                    .and_then(|c| c.subs.get(&eose.sub_id))
                    .is_some_and(|s| s.generation == eose.generation);
                if still_open && !write_frame(shared, ws, eose_frame(&eose.sub_id)) {
                    return;
                }
            }
        }
        match ws.flush() {
            Ok(()) => {}
            Err(e) if is_transient(&e) => {}
            Err(e) => {
                trace!("test relay: connection {conn_id}: flush failed: {e}");
                return;
            }
        }
        match ws.read() {
            Ok(Message::Text(text)) => {
                trace!("test relay: connection {conn_id} <- {}", text.as_str());
                let handled = handle_message(shared, conn_id, text.as_str());
                for frame in handled.frames {
                    if !write_frame(shared, ws, frame) {
                        return;
                    }
                }
                pending.extend(handled.delayed_eose);
            }
            Ok(Message::Binary(_)) => {
                if !write_frame(shared, ws, parse_error_frame(shared)) {
                    return;
                }
            }
            // Pings are answered by tungstenite; a close is answered on the
            // next read, which then reports ConnectionClosed.
            Ok(Message::Ping(_)) => {
                shared.pings_received.fetch_add(1, Ordering::SeqCst);
            }
            Ok(_) => {}
            Err(e) if is_transient(&e) => {
                // Nothing complete has arrived: wait for a frame to send, input or the
                // next delayed EOSE, whichever comes first.
                let wait = pending
                    .iter()
                    .map(|p| p.at.saturating_duration_since(Instant::now()))
                    .fold(shared.idle_wait(), Duration::min);
                let mut select = Select::new();
                select.recv(rx);
                ws.get_ref().inbound.register(&mut select);
                let _ = select.ready_timeout(wait);
            }
            Err(tungstenite::Error::Capacity(CapacityError::MessageTooLong { size, max_size })) => {
                // As strfry: drop the connection without a close frame; as nostr-rs-relay: say
                // why first.
                debug!("test relay: connection {conn_id}: frame of {size} bytes > {max_size}");
                if shared.state.lock().opts.oversize_notice {
                    let notice = notice_frame(&format!("message too large ({size} > {max_size})"));
                    if write_frame(shared, ws, notice) {
                        let _ = ws.flush();
                    }
                }
                let _ = ws.get_ref().tcp.shutdown(Shutdown::Both);
                return;
            }
            Err(e) => {
                trace!("test relay: connection {conn_id}: read ended: {e}");
                return;
            }
        }
    }
}

/// Counts `frame` when it is a NOTICE, CLOSED or NEG-ERR, and keeps the first
/// [`MAX_RECORDED_REFUSALS`] of them ([`TestRelay::refusals_sent`]).
fn count_refusal(shared: &Shared, frame: &str) {
    let counter = if frame.starts_with("[\"NOTICE\"") {
        &shared.notices_sent
    } else if frame.starts_with("[\"CLOSED\"") {
        &shared.closed_sent
    } else if frame.starts_with("[\"NEG-ERR\"") {
        &shared.neg_errs_sent
    } else {
        return;
    };
    counter.fetch_add(1, Ordering::SeqCst);
    let mut state = shared.state.lock();
    if state.refusals_sent.len() < MAX_RECORDED_REFUSALS {
        state.refusals_sent.push(frame.to_string());
    }
}

/// The NOTICE answering what the relay cannot parse (`parse_error_notice`).
fn parse_error_frame(shared: &Shared) -> String {
    notice_frame(&shared.state.lock().opts.parse_error_notice)
}

fn handle_message(shared: &Shared, conn_id: u64, text: &str) -> Handled {
    let parse_error = || Handled::frame(parse_error_frame(shared));
    let Ok(parts) = serde_json::from_str::<Vec<&RawValue>>(text) else {
        return parse_error();
    };
    let Some(command) = parts
        .first()
        .and_then(|c| serde_json::from_str::<String>(c.get()).ok())
    else {
        return parse_error();
    };
    match (command.as_str(), parts.len()) {
        ("EVENT", n) if n >= 2 => handle_event(shared, conn_id, parts[1].get()),
        ("REQ", n) if n >= 3 => {
            let Ok(sub_id) = serde_json::from_str::<String>(parts[1].get()) else {
                return parse_error();
            };
            let filters: Result<Vec<Filter>, _> = parts[2..]
                .iter()
                .map(|f| Filter::from_json(f.get()))
                .collect();
            let Ok(filters) = filters else {
                return parse_error();
            };
            handle_req(shared, conn_id, sub_id, filters, text)
        }
        ("CLOSE", n) if n >= 2 => {
            let Ok(sub_id) = serde_json::from_str::<String>(parts[1].get()) else {
                return parse_error();
            };
            if let Some(conn) = shared.state.lock().conns.get_mut(&conn_id) {
                conn.subs.remove(&sub_id);
            }
            Handled::default()
        }
        ("AUTH", n) if n >= 2 => {
            shared.auth_messages.fetch_add(1, Ordering::SeqCst);
            match Event::from_json(parts[1].get()) {
                Ok(event) => handle_auth(shared, conn_id, &event),
                Err(_) => parse_error(),
            }
        }
        ("NEG-OPEN" | "NEG-MSG" | "NEG-CLOSE", _)
            if shared.state.lock().opts.nip77 == Nip77Mode::Off =>
        {
            parse_error()
        }
        ("NEG-MSG" | "NEG-CLOSE", _) => {
            let refusal = match &shared.state.lock().opts.nip77 {
                Nip77Mode::Notice(msg) => Some(notice_frame(msg)),
                _ => None,
            };
            match (refusal, command.as_str(), parts.len()) {
                (Some(frame), _, _) => Handled::frame(frame),
                (None, "NEG-MSG", 3) => {
                    let Ok(sub_id) = serde_json::from_str::<String>(parts[1].get()) else {
                        return parse_error();
                    };
                    handle_neg_msg(shared, conn_id, sub_id, parts[2].get())
                }
                (None, "NEG-CLOSE", 2) => {
                    let Ok(sub_id) = serde_json::from_str::<String>(parts[1].get()) else {
                        return parse_error();
                    };
                    if let Some(conn) = shared.state.lock().conns.get_mut(&conn_id) {
                        conn.neg_sessions.remove(&sub_id);
                    }
                    Handled::default()
                }
                _ => parse_error(),
            }
        }
        ("NEG-OPEN", 4) => {
            let Ok(sub_id) = serde_json::from_str::<String>(parts[1].get()) else {
                return parse_error();
            };
            handle_neg_open(shared, conn_id, sub_id, parts[2].get(), parts[3].get())
        }
        _ => parse_error(),
    }
}

/// The answer to a REQ or `NEG-OPEN` beyond `max_subscriptions`.
fn too_many_subs_frame(opts: &TestRelayOptions, sub_id: &str) -> String {
    match &opts.too_many_subs_reply {
        Reply::Closed(msg) => closed_frame(sub_id, msg),
        Reply::Notice(msg) => notice_frame(msg),
    }
}

fn neg_msg_frame(sub_id: &str, msg: &[u8]) -> String {
    format!(
        "[\"NEG-MSG\",{},\"{}\"]",
        json_str(sub_id),
        nip77::hex_encode(msg)
    )
}

fn neg_err_frame(sub_id: &str, msg: &str) -> String {
    format!("[\"NEG-ERR\",{},{}]", json_str(sub_id), json_str(msg))
}

/// The hex negentropy message of a `NEG-OPEN` or `NEG-MSG` (a JSON string), decoded.
fn neg_payload(raw: &str) -> Result<Vec<u8>, String> {
    let text = serde_json::from_str::<String>(raw)
        .map_err(|_| nip77::invalid("the negentropy message is not a string"))?;
    nip77::hex_decode(&text).ok_or_else(|| nip77::invalid("the negentropy message is not hex"))
}

/// `["NEG-OPEN", sub_id, filter, initial_message]` (NIP-77 not `Off`).
fn handle_neg_open(
    shared: &Shared,
    conn_id: u64,
    sub_id: String,
    raw_filter: &str,
    raw_msg: &str,
) -> Handled {
    let Ok(filter) = Filter::from_json(raw_filter) else {
        return Handled::frame(neg_err_frame(&sub_id, &nip77::invalid("bad filter")));
    };
    let mut guard = shared.state.lock();
    let state = &mut *guard;
    state.neg_opens.push(RecordedNegOpen {
        conn: conn_id,
        sub_id: sub_id.clone(),
        filter: filter.clone(),
        at: Instant::now(),
    });
    let Some(conn) = state.conns.get_mut(&conn_id) else {
        return Handled::default();
    };
    // A NEG-OPEN reusing an id replaces that session, whatever happens next.
    conn.neg_sessions.remove(&sub_id);
    let opts = &state.opts;
    if opts.require_auth && !conn.authed {
        return conn.refused(neg_err_frame(&sub_id, AUTH_REQUIRED));
    }
    match &opts.nip77 {
        Nip77Mode::Off | Nip77Mode::Silent => return Handled::default(),
        Nip77Mode::Notice(msg) => return Handled::frame(notice_frame(msg)),
        Nip77Mode::NegErr(msg) => return Handled::frame(neg_err_frame(&sub_id, msg)),
        Nip77Mode::Closed(msg) => return Handled::frame(closed_frame(&sub_id, msg)),
        Nip77Mode::DropAfter(0) => {
            shared.nip77_drops.fetch_add(1, Ordering::SeqCst);
            let _ = conn.tx.send(HANG_UP.to_string());
            return Handled::default();
        }
        Nip77Mode::On | Nip77Mode::DropAfter(_) => {}
    }
    let initial = match neg_payload(raw_msg) {
        Ok(bytes) => bytes,
        Err(why) => return Handled::frame(neg_err_frame(&sub_id, &why)),
    };
    match opts.max_subscriptions {
        Some(max) if opts.neg_sessions_count_as_subscriptions => {
            if conn.subscription_count(opts) >= max {
                return Handled::frame(too_many_subs_frame(opts, &sub_id));
            }
        }
        _ => match opts.nip77_max_sessions {
            Some(max) if conn.neg_sessions.len() >= max => {
                return Handled::frame(neg_err_frame(
                    &sub_id,
                    "rate-limited: too many negentropy subscriptions",
                ));
            }
            None if conn.neg_sessions.len() >= nip77::MAX_SESSIONS_PER_CONN => {
                return Handled::frame(neg_err_frame(
                    &sub_id,
                    "blocked: too many open negentropy sessions",
                ));
            }
            _ => {}
        },
    }
    let limit = filter.limit.unwrap_or(usize::MAX);
    let records: Vec<(Timestamp, EventId)> = state
        .store
        .iter()
        .filter(|s| filter.match_event(&s.event, MatchEventOptions::new()))
        .take(limit)
        .map(|s| (s.event.created_at, s.event.id))
        .collect();
    if opts
        .nip77_max_records
        .is_some_and(|max| records.len() > max)
    {
        return Handled::frame(neg_err_frame(&sub_id, nip77::TOO_MANY_RECORDS));
    }
    if let Some(max) = opts.nip77_max_items {
        let held: usize = conn.neg_sessions.values().map(|(_, n)| n).sum();
        if records.len() > max.saturating_sub(held) {
            return Handled::frame(neg_err_frame(
                &sub_id,
                "rate-limited: too many negentropy items",
            ));
        }
    }
    let items = records.len();
    match nip77::open(records.into_iter(), &initial) {
        Ok((session, reply)) => {
            conn.neg_sessions.insert(sub_id.clone(), (session, items));
            let slots = conn.subs.len() + conn.neg_sessions.len();
            state.max_slots_per_conn = state.max_slots_per_conn.max(slots);
            neg_reply(shared, opts, conn, &sub_id, &reply)
        }
        Err(e) => Handled::frame(neg_err_frame(&sub_id, &nip77::invalid(&e.to_string()))),
    }
}

/// `["NEG-MSG", sub_id, message]` (NIP-77 not `Off`).
fn handle_neg_msg(shared: &Shared, conn_id: u64, sub_id: String, raw_msg: &str) -> Handled {
    let mut guard = shared.state.lock();
    let state = &mut *guard;
    let Some(conn) = state.conns.get_mut(&conn_id) else {
        return Handled::default();
    };
    if state.opts.nip77 == Nip77Mode::Silent {
        return Handled::default();
    }
    let Some((session, _)) = conn.neg_sessions.get_mut(&sub_id) else {
        return Handled::frame(neg_err_frame(&sub_id, &state.opts.nip77_no_session_reply));
    };
    let reply = neg_payload(raw_msg).and_then(|msg| {
        session
            .reconcile(&msg)
            .map_err(|e| nip77::invalid(&e.to_string()))
    });
    match reply {
        Ok(reply) => neg_reply(shared, &state.opts, conn, &sub_id, &reply),
        Err(why) => {
            // As strfry: a session that failed is gone.
            conn.neg_sessions.remove(&sub_id);
            Handled::frame(neg_err_frame(&sub_id, &why))
        }
    }
}

/// The `NEG-MSG` carrying `reply`; under [`Nip77Mode::DropAfter`] the connection hangs up
/// after its n-th reply.
fn neg_reply(
    shared: &Shared,
    opts: &TestRelayOptions,
    conn: &mut Conn,
    sub_id: &str,
    reply: &[u8],
) -> Handled {
    conn.neg_replies += 1;
    if let Nip77Mode::DropAfter(n) = opts.nip77 {
        if conn.neg_replies >= u64::from(n) {
            shared.nip77_drops.fetch_add(1, Ordering::SeqCst);
            let _ = conn.tx.send(HANG_UP.to_string());
        }
    }
    Handled::frame(neg_msg_frame(sub_id, reply))
}

/// NIP-42: a valid kind-22242 event whose `challenge` tag is this connection's challenge and
/// that has a `relay` tag authenticates the connection. Without `require_auth` any validly
/// signed AUTH event is acknowledged (as before).
fn handle_auth(shared: &Shared, conn_id: u64, event: &Event) -> Handled {
    if event.verify().is_err() {
        return Handled::frame(ok_frame(&event.id, false, "invalid: bad signature"));
    }
    let tag = |name: &str| {
        event
            .tags
            .iter()
            .find(|t| t.kind() == name)
            .and_then(|t| t.content())
            .map(str::to_string)
    };
    let mut guard = shared.state.lock();
    let state = &mut *guard;
    let Some(conn) = state.conns.get_mut(&conn_id) else {
        return Handled::default();
    };
    let valid = event.kind.as_u16() == 22242
        && tag("challenge").as_deref() == Some(conn.challenge.as_str())
        && tag("relay").is_some_and(|r| !r.is_empty());
    if valid {
        conn.authed = true;
        if !state.authenticated.contains(&event.pubkey) {
            state.authenticated.push(event.pubkey);
        }
        return Handled::frame(ok_frame(&event.id, true, ""));
    }
    if state.opts.require_auth {
        return Handled::frame(ok_frame(
            &event.id,
            false,
            "invalid: not an AUTH event for this connection's challenge",
        ));
    }
    Handled::frame(ok_frame(&event.id, true, ""))
}

fn handle_event(shared: &Shared, conn_id: u64, raw: &str) -> Handled {
    let Ok(event) = Event::from_json(raw) else {
        return Handled::frame(parse_error_frame(shared));
    };
    if event.verify().is_err() {
        return Handled::frame(ok_frame(&event.id, false, "invalid: bad signature"));
    }
    let mut guard = shared.state.lock();
    let state = &mut *guard;
    *state.writes.entry(event.id).or_default() += 1;
    if state.opts.require_auth {
        if let Some(conn) = state.conns.get_mut(&conn_id).filter(|c| !c.authed) {
            return conn.refused(ok_frame(&event.id, false, AUTH_REQUIRED));
        }
    }
    if let Some(rate) = &state.opts.write_rate {
        if let Some(conn) = state.conns.get_mut(&conn_id) {
            if !conn.take_write_token(rate) {
                return Handled::frame(ok_frame(&event.id, false, &rate.message));
            }
        }
    }
    if let Some(msg) = &state.opts.reject_events {
        return Handled::frame(ok_frame(&event.id, false, msg));
    }
    if let Some(ngit) = state.opts.ngit_grasp.clone() {
        return ngit_event(state, &ngit, event, raw);
    }
    if let Some(grasp) = &state.opts.grasp_policy {
        let domain = grasp
            .domain
            .clone()
            .unwrap_or_else(|| format!("127.0.0.1:{}", state.port));
        let stored = state.store.iter().map(|s| &s.event);
        if let Some(reason) = policy::grasp_refusal(&event, &domain, stored) {
            return Handled::frame(ok_frame(&event.id, false, reason));
        }
    }
    let id = event.id;
    let stored = state.stored(event, raw);
    if is_ephemeral(&stored.event) {
        state.deliver(&stored.event, &stored.raw);
        return Handled::frame(ok_frame(&id, true, ""));
    }
    let outcome = state.store_and_deliver(stored);
    let frame = match outcome {
        StoreOutcome::Stored => ok_frame(&id, true, ""),
        StoreOutcome::Duplicate => ok_frame(&id, true, &state.opts.duplicate_reply),
        StoreOutcome::HaveNewer => ok_frame(&id, false, "replaced: have newer event"),
    };
    Handled::frame(frame)
}

/// An EVENT under [`TestRelayOptions::ngit_grasp`]: held, refused, or stored and answered as
/// ngit-grasp answers a websocket client (see [`NgitGraspPolicy`]).
fn ngit_event(state: &mut State, ngit: &NgitGraspPolicy, event: Event, raw: &str) -> Handled {
    let domain = ngit
        .domain
        .clone()
        .unwrap_or_else(|| format!("127.0.0.1:{}", state.port));
    let id = event.id;
    let served: Vec<&Event> = state.store.iter().map(|s| &s.event).collect();
    let verdict = ngit::admit(
        ngit,
        &domain,
        &event,
        raw,
        &served,
        &mut state.purgatory,
        Instant::now(),
    );
    match verdict {
        Verdict::Refuse(reason) => Handled::frame(ok_frame(&id, false, &reason)),
        Verdict::Answer(reason) => Handled::frame(ok_frame(&id, true, &reason)),
        Verdict::Store(promoted) => {
            let stored = state.stored(event, raw);
            if is_ephemeral(&stored.event) {
                state.deliver(&stored.event, &stored.raw);
                return Handled::frame(ok_frame(&id, true, ngit::STORED));
            }
            let reason = match state.store_and_deliver(stored) {
                StoreOutcome::Stored | StoreOutcome::Duplicate => ngit::STORED,
                StoreOutcome::HaveNewer => ngit::SUPERSEDED,
            };
            for (event, raw) in promoted {
                let stored = state.stored(event, &raw);
                state.store_and_deliver(stored);
            }
            Handled::frame(ok_frame(&id, true, reason))
        }
    }
}

/// rust-nostr relay-builder's answer to a REQ of several filters in the versions that refuse
/// them.
const MULTI_FILTER_REFUSED: &str =
    "unsupported: multi-filter REQs aren't supported (https://github.com/nostr-protocol/nips/issues/1645)";

fn handle_req(
    shared: &Shared,
    conn_id: u64,
    sub_id: String,
    filters: Vec<Filter>,
    raw: &str,
) -> Handled {
    let mut guard = shared.state.lock();
    let state = &mut *guard;
    state.reqs.push(RecordedReq {
        conn: conn_id,
        sub_id: sub_id.clone(),
        filters: filters.clone(),
        raw: raw.to_string(),
        at: Instant::now(),
    });
    let Some(conn) = state.conns.get_mut(&conn_id) else {
        // Dropped from outside meanwhile; the loop ends on its next tick.
        return Handled::default();
    };
    let opts = &state.opts;
    if opts.require_auth && !conn.authed {
        conn.subs.remove(&sub_id);
        return conn.refused(closed_frame(&sub_id, AUTH_REQUIRED));
    }
    if let Some(msg) = &opts.closed_on_req {
        conn.subs.remove(&sub_id);
        return Handled::frame(closed_frame(&sub_id, msg));
    }
    if opts.refuse_multi_filter && filters.len() > 1 {
        conn.subs.remove(&sub_id);
        return Handled::frame(closed_frame(&sub_id, MULTI_FILTER_REFUSED));
    }
    if let Some(max) = opts.max_tag_keys {
        if filters.iter().any(|f| f.generic_tags.len() > max) {
            return Handled::frame(closed_frame(&sub_id, TOO_MANY_TAGS));
        }
    }
    if opts.ignore_identical_req
        && conn
            .subs
            .get(&sub_id)
            .is_some_and(|open| open.filters == filters)
    {
        return Handled::default();
    }
    if let Some(max) = opts.max_subscriptions {
        if !conn.subs.contains_key(&sub_id) && conn.subscription_count(opts) >= max {
            return Handled::frame(too_many_subs_frame(opts, &sub_id));
        }
    }
    // nostr-rs-relay runs no query, and so sends no EOSE, when every filter has `limit: 0`.
    let only_live = opts.no_eose_for_limit_zero && filters.iter().all(|f| f.limit == Some(0));
    let eose = !opts.withhold_eose && !only_live;

    // Stored answer: each filter contributes its newest min(limit, cap)
    // matches; the union is served newest first.
    let mut seen: HashSet<EventId> = HashSet::default();
    let mut matched: Vec<(OrderKey, Arc<str>)> = Vec::new();
    for filter in &filters {
        let limit = match (filter.limit.or(opts.default_limit), opts.result_cap) {
            (Some(l), Some(c)) => l.min(c),
            (Some(n), None) | (None, Some(n)) => n,
            (None, None) => usize::MAX,
        };
        let window = MatchEventOptions {
            since: !opts.ignore_time_window,
            until: !opts.ignore_time_window,
            ..MatchEventOptions::new()
        };
        let hits = state
            .store
            .iter()
            .filter(|s| filter.match_event(&s.event, window))
            .take(limit);
        for stored in hits {
            if seen.insert(stored.event.id) {
                matched.push((
                    (Reverse(stored.event.created_at), stored.event.id),
                    Arc::clone(&stored.raw),
                ));
            }
        }
    }
    matched.sort_by_key(|a| a.0);
    let mut frames: Vec<String> = matched
        .iter()
        .map(|(_, raw)| event_frame(&sub_id, raw))
        .collect();
    if let Some(after) = state.mid_answer.after.filter(|&n| frames.len() > n) {
        // Send the first `after` events of the answer, then hang up (no EOSE).
        state.mid_answer.after = None;
        state.mid_answer.fired += 1;
        frames.truncate(after);
        let _ = conn.tx.send(HANG_UP.to_string());
        return Handled {
            frames,
            delayed_eose: None,
        };
    }

    state.next_generation += 1;
    let generation = state.next_generation;
    conn.subs.insert(
        sub_id.clone(),
        Sub {
            filters,
            generation,
        },
    );
    state.max_subs_per_conn = state.max_subs_per_conn.max(conn.subs.len());
    state.max_slots_per_conn = state
        .max_slots_per_conn
        .max(conn.subs.len() + conn.neg_sessions.len());

    let mut delayed_eose = None;
    if eose {
        match opts.eose_delay {
            Some(delay) if !delay.is_zero() => {
                delayed_eose = Some(PendingEose {
                    at: Instant::now() + delay,
                    sub_id,
                    generation,
                });
            }
            _ => frames.push(eose_frame(&sub_id)),
        }
    }
    Handled {
        frames,
        delayed_eose,
    }
}
