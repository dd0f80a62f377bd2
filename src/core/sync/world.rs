//! A simulated world for [`SyncMachine`] tests: fake relays that answer every [`Command`] the
//! way real relays do, and a fake own relay fed by a forwarder, all in simulated time.
//!
//! The machine's commands reach the fakes the way they reach real relays: each relay has a
//! [`RelaySession`] (the one the relay threads run), the command goes into it, the frames it
//! writes (`REQ`, `CLOSE`, `NEG-OPEN`, …, JSON as on a socket) are read by the fake relay, and
//! the fake's answers (`EVENT`, `EOSE`, `CLOSED`, `NOTICE`, `NEG-MSG`, `NEG-ERR`, pongs) go
//! back into the session as frames, driven until quiet (as quinn-proto's tests drive a pair
//! of connections). The machine sees only the reports the sessions make, so a simulated hour
//! exercises the same decision code as production. Events a session hands to "the
//! forwarder" are stored on the own relay.
//!
//! What the fakes do, because real relays do it (see `docs/relays.md`):
//! * `since`, `until`, `ids`, `kinds`, `authors` and tags apply to stored **and live** events
//!   (`Filter::match_event`); `limit` caps only the stored answer (`limit: 0`: none).
//! * The stored answer is the newest `min(limit or default_limit, max_limit)` matches.
//! * A subscription budget: a REQ beyond it is answered with CLOSED (or a NOTICE).
//! * Profiles of real relays ([`SimProfile`]): nostr-rs-relay's missing EOSE for `limit: 0`,
//!   strfry's silent 500 cap and tag-key limit, LocalRelay's defaults, a relay that lists
//!   NIP-77 and never answers it.
//! * Faults on demand: connections dropped (also in the middle of a stored answer), CLOSED on
//!   any subscription, EOSE withheld, a relay that is down.
//!
//! * NIP-77 on demand ([`Nip77Mode`]): a negentropy responder (the `negentropy` crate's
//!   server side over the relay's store), or the faults real relays show: NEG-ERR, CLOSED,
//!   silence, a NOTICE as nostr-rs-relay sends for a message it does not know, a
//!   disconnect mid-session, malformed hex, endless rounds.
//!
//! Events a remote relay sends go through the forwarder's [`ForwardSession`] (the one the
//! engine's forwarder thread runs) into the own relay, as `EVENT` frames it answers with `OK`s:
//! stored at once, unless [`World::own_answers`] scripts `rate-limited:`, `error:`,
//! `auth-required:` (with a NIP-42 challenge), `blocked:`, `restricted:` or `purgatory:` for an
//! event ([`OwnAnswer`]). What it stores it delivers as `EVENT` frames to its matching
//! subscriptions (the self-subscription's session then reports [`Report::SelfEvent`]), as the
//! engine does.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use nostr::event::{Event, EventId};
use nostr::filter::{Filter, MatchEventOptions};
use nostr::message::SubscriptionId;

use negentropy::{Id, Negentropy, NegentropyStorageVector};

use crate::core::auth::AuthLimits;
use crate::core::dedup::VerifiedSet;
use crate::core::forward::{
    ForwardConfig, ForwardControl, ForwardEvent, ForwardLimits, ForwardSession, ForwardTransmit,
};
use crate::core::relay_text::Prefix;
use crate::core::session::{
    Disconnect, Frame, FrameOutcome, LimitsFetch, RelaySession, SessionConfig, SessionRole,
    Transmit, Verified,
};
use crate::core::sync::reconcile::{hex_decode, hex_encode};
use crate::core::sync::{Command, Report, Route, SyncConfig, SyncMachine};
use crate::core::time::Time;
use crate::shared::RelayLimits;
use crate::shared::RelayUrl;

/// How a fake relay answers NEG-OPEN / NEG-MSG.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Nip77Mode {
    /// No NIP-77: `NOTICE "could not parse command"`, as nostr-rs-relay answers.
    #[default]
    Off,
    /// A negentropy responder over the store.
    On,
    /// `NEG-ERR "blocked: too many records"` to NEG-OPEN.
    Err,
    /// `CLOSED "error: ..."` to NEG-OPEN.
    Closed,
    /// No answer at all.
    Silent,
    /// Answers this many messages, then drops the connection at the next one.
    DropAfter(usize),
    /// Answers NEG-OPEN with a NEG-MSG that is not hex.
    BadHex,
    /// Answers every message with a fingerprint of the whole range that never matches:
    /// the client always has something more to say (never ends).
    Endless,
}

/// One fake relay.
#[derive(Debug, Default)]
pub(crate) struct FakeRelay {
    /// NIP-77 behaviour.
    pub nip77: Nip77Mode,
    /// Lists 77 in NIP-11 `supported_nips` (with `publish_nip11`).
    pub advertise_nip77: bool,
    /// Ids (of no stored event) added to its negentropy set: a relay claiming events.
    pub neg_phantoms: usize,
    /// Lists every stored event in its negentropy set, matching the filter or not (a
    /// hostile relay claiming events outside the query, which it serves when asked by id).
    pub neg_strangers: bool,
    /// Frame size limit of its negentropy answers (0: none; else ≥ 4096).
    pub neg_frame: u64,
    /// Open negentropy sessions: (generation, id) → responder.
    negs: BTreeMap<(u64, SubscriptionId), NegServer>,
    /// NEG-OPEN filters received, in order.
    pub neg_opens: Vec<Filter>,
    /// NEG-MSG and NEG-OPEN messages answered.
    pub neg_rounds: usize,
    /// Every stored event.
    pub store: Vec<Event>,
    /// Accepts connections.
    pub down: bool,
    /// The generation of the open connection.
    pub conn: Option<u64>,
    /// Open subscriptions of that connection, each with the filters of its REQ.
    pub subs: BTreeMap<SubscriptionId, Vec<Filter>>,
    /// Answers a REQ of several filters with `CLOSED "unsupported: multi-filter REQs aren't
    /// supported"` (some rust-nostr relay-builder versions).
    pub refuse_multi_filter: bool,
    /// REQ messages received (each may carry several filters; those are in `reqs`).
    pub req_messages: usize,
    /// Most filters seen in one REQ.
    pub max_filters_seen: usize,
    /// REQs and NEG-OPENs answered with the too-many answer ([`FakeRelay::too_many`]).
    pub too_many_sent: usize,
    /// NIP-11 `max_limit`: the most stored events one REQ returns.
    pub max_limit: Option<usize>,
    /// NIP-11 `default_limit`: stored events returned for a filter without `limit`.
    pub default_limit: Option<usize>,
    /// Open subscriptions one connection may hold; beyond: CLOSED.
    pub max_subs: Option<usize>,
    /// Publish the limits above in NIP-11 (else the engine has to guess).
    pub publish_nip11: bool,
    /// NIP-11 `max_message_length` (published with `publish_nip11`): a longer frame from the
    /// client drops the connection without an answer, as strfry and the `TestRelay` do.
    pub max_message_length: Option<usize>,
    /// Longest frame a session wrote to it.
    pub max_frame_seen: usize,
    /// Frames longer than `max_message_length` (each dropped the connection).
    pub oversized_frames: usize,
    /// Never send EOSE.
    pub withhold_eose: bool,
    /// Drop the connection after this many more stored events (counted over the stored
    /// answers of every REQ; one-shot): a connection lost in the middle of a page.
    pub drop_after: Option<usize>,
    /// Filters with this kind in `kinds` never get EOSE (a query a relay drops silently).
    pub no_eose_kind: Option<u16>,
    /// EOSE is held back until [`World::release_eose`] (a slow relay).
    pub hold_eose: bool,
    /// EOSE held back: (generation, subscription).
    held: Vec<(u64, SubscriptionId)>,
    /// Every REQ filter received, in order.
    pub reqs: Vec<Filter>,
    /// Largest number of open subscriptions seen at once.
    pub max_open_seen: usize,
    /// No EOSE for a REQ whose filter has `limit: 0` (nostr-rs-relay's
    /// `needs_historical_events`); live events still arrive.
    pub no_eose_for_live_only: bool,
    /// A REQ beyond `max_subs` gets this NOTICE and nothing else (nostr-rs-relay, strfry)
    /// instead of a CLOSED.
    pub too_many_notice: Option<&'static str>,
    /// Most generic tag keys (`#e`, `#a`, …) in one filter; beyond: CLOSED (strfry: 3).
    pub max_tag_keys: Option<usize>,
    /// NEG-MSG answers are held back until [`World::release_neg`] (a relay that answers each
    /// round late).
    pub hold_neg: bool,
    /// NEG-MSG answers held back: (generation, frame).
    held_neg: Vec<(u64, String)>,
    /// NIP-77 sessions count against `max_subs` with the REQs (strfry): a NEG-OPEN or REQ
    /// beyond it gets the too-many answer.
    pub negs_count_as_subs: bool,
    /// Events left out of the first answer to a REQ by `ids` that asks for them (a relay
    /// that lists an event and fails to serve it once: a store still writing, a cut page).
    pub withhold_once: BTreeSet<EventId>,
    /// The next `n` REQs whose filter passes the test are registered but get neither their
    /// stored answer nor EOSE: nostr-rs-relay drops a query's stored answer silently when it
    /// meets the checkpoint mutex, a slow client or load shedding (`docs/relays.md`).
    pub drop_answers: Option<(FilterTest, usize)>,
}

/// Which REQs a [`FakeRelay`] treats in a special way.
pub(crate) type FilterTest = fn(&Filter) -> bool;

/// The observable behaviour of a real relay, for [`FakeRelay::profile`] (`docs/relays.md`;
/// `TestRelay` has the same profiles for socket tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SimProfile {
    /// Whatever the test sets (answers everything, EOSE always, no limits).
    Plain,
    /// nostr-rs-relay 0.8.12: no EOSE for `limit: 0`, 32 subscriptions then a NOTICE, no
    /// limits in NIP-11, no NIP-77 (a NOTICE).
    NostrRsRelay,
    /// strfry 1.1: newest 500 per filter silently, 200 subscriptions then a NOTICE, at most
    /// 3 tag keys per filter, NIP-77 on, its limits in NIP-11.
    Strfry,
    /// rust-nostr's LocalRelay: 500 per REQ without `limit`, 500 subscriptions then
    /// `CLOSED "rate-limited: too many REQs"`, no NIP-11.
    LocalRelay,
    /// Lists NIP-77 in NIP-11 and never answers NEG-OPEN.
    Nip77Refusing,
    /// A rust-nostr relay-builder version that refuses REQs of several filters (`CLOSED
    /// "unsupported: multi-filter REQs aren't supported"`), otherwise as `LocalRelay`.
    SingleFilter,
}

impl SimProfile {
    /// Every profile, for tests that run across them.
    pub(crate) const ALL: [SimProfile; 6] = [
        SimProfile::Plain,
        SimProfile::NostrRsRelay,
        SimProfile::Strfry,
        SimProfile::LocalRelay,
        SimProfile::Nip77Refusing,
        SimProfile::SingleFilter,
    ];
}

impl FakeRelay {
    /// Sets the behaviour of `profile` (fields a test set before may be overwritten).
    pub(crate) fn profile(&mut self, profile: SimProfile) -> &mut FakeRelay {
        match profile {
            SimProfile::Plain => {}
            SimProfile::NostrRsRelay => {
                self.no_eose_for_live_only = true;
                self.max_subs = Some(32);
                self.too_many_notice =
                    Some("Subscription error: Maximum concurrent subscription count reached");
                self.publish_nip11 = false;
                self.nip77 = Nip77Mode::Off;
            }
            SimProfile::Strfry => {
                self.negs_count_as_subs = true;
                self.max_limit = Some(500);
                self.max_subs = Some(200);
                self.too_many_notice = Some("ERROR: too many concurrent REQs");
                self.max_tag_keys = Some(3);
                self.max_message_length = Some(131_072);
                self.publish_nip11 = true;
                self.nip77 = Nip77Mode::On;
                self.advertise_nip77 = true;
            }
            SimProfile::LocalRelay => {
                self.default_limit = Some(500);
                self.max_subs = Some(500);
                self.publish_nip11 = false;
                self.nip77 = Nip77Mode::On;
            }
            SimProfile::Nip77Refusing => {
                self.publish_nip11 = true;
                self.advertise_nip77 = true;
                self.nip77 = Nip77Mode::Silent;
            }
            SimProfile::SingleFilter => {
                self.profile(SimProfile::LocalRelay);
                self.refuse_multi_filter = true;
            }
        }
        self
    }
}

impl FakeRelay {
    fn limits(&self) -> RelayLimits {
        RelayLimits {
            max_subscriptions: self.max_subs,
            max_limit: self.max_limit,
            default_limit: self.default_limit,
            max_message_length: self.max_message_length,
            supports_nip77: Some(self.advertise_nip77),
            ..RelayLimits::default()
        }
    }

    /// A negentropy responder over every stored event matching `filter` (no limit), plus
    /// the phantoms.
    fn neg_server(&self, filter: &Filter) -> NegServer {
        let mut storage = NegentropyStorageVector::new();
        for e in &self.store {
            if self.neg_strangers || filter.match_event(e, MatchEventOptions::new()) {
                storage
                    .insert(e.created_at.as_secs(), Id::from_byte_array(e.id.to_bytes()))
                    .expect("insert");
            }
        }
        for i in 0..self.neg_phantoms {
            let mut id = [0u8; 32];
            id[..8].copy_from_slice(&(i as u64 + 1).to_be_bytes());
            id[31] = 0xee;
            storage
                .insert(1_600_000_000 + i as u64, Id::from_byte_array(id))
                .expect("insert");
        }
        storage.seal().expect("seal");
        Negentropy::owned(storage, self.neg_frame).expect("negentropy")
    }

    /// Subscriptions of connection `generation` held against `max_subs`: REQs, and NEG
    /// sessions where they count.
    /// NIP-77 sessions open on any connection (those the client never closed included).
    pub(super) fn open_negs(&self) -> usize {
        self.negs.len()
    }

    fn open_count(&self, generation: u64) -> usize {
        let negs = if self.negs_count_as_subs {
            self.negs.keys().filter(|(g, _)| *g == generation).count()
        } else {
            0
        };
        self.subs.len() + negs
    }

    /// The answer to a REQ or NEG-OPEN beyond `max_subs`.
    fn too_many(&self, sub_id: &SubscriptionId) -> String {
        match self.too_many_notice {
            Some(text) => serde_json::json!(["NOTICE", text]).to_string(),
            None => frame3("CLOSED", sub_id, "error: too many subscriptions"),
        }
    }

    /// The stored answer to a REQ of `filters`: each filter capped on its own (strfry,
    /// nostr-rs-relay), the union newest first.
    fn stored_answer_all(&self, filters: &[Filter]) -> Vec<Event> {
        let mut seen = BTreeSet::new();
        let mut out: Vec<Event> = Vec::new();
        for f in filters {
            for e in self.stored_answer(f) {
                if seen.insert(e.id) {
                    out.push(e);
                }
            }
        }
        out.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.id.cmp(&b.id)));
        out
    }

    fn stored_answer(&self, filter: &Filter) -> Vec<Event> {
        let mut hits: Vec<&Event> = self
            .store
            .iter()
            .filter(|e| filter.match_event(e, MatchEventOptions::new()))
            .collect();
        hits.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.id.cmp(&b.id)));
        let mut n = filter.limit.or(self.default_limit).unwrap_or(usize::MAX);
        if let Some(max) = self.max_limit {
            n = n.min(max);
        }
        hits.into_iter().take(n).cloned().collect()
    }
}

type NegServer = Negentropy<'static, NegentropyStorageVector>;

/// How the simulated own relay answers a write of one event ([`World::own_answers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OwnAnswer {
    /// This answer to the next write: `OK false <message>` (`rate-limited:`, `error:`,
    /// `blocked:`, …); `purgatory: …` is `OK true` and takes the event without serving it (it
    /// is never stored); `auth-required: …` comes with a NIP-42 challenge and is answered to
    /// every write until the forwarder has authenticated.
    Once(String),
    /// `OK false <message>` to every write until the own relay stores the event `EventId`
    /// (a GRASP relay refusing an issue until its repository's announcement lists it).
    Until(String, EventId),
}

/// The challenge the simulated own relay sends.
const OWN_CHALLENGE: &str = "own-challenge";

/// The machine plus its relays.
pub(crate) struct World {
    pub m: SyncMachine,
    pub now: Time,
    pub own_url: RelayUrl,
    pub own: FakeRelay,
    pub relays: BTreeMap<RelayUrl, FakeRelay>,
    reports: VecDeque<Report>,
    /// The relay sessions, one per relay with a "thread" (the own relay's included).
    sessions: BTreeMap<RelayUrl, RelaySession>,
    /// The verified set the sessions share (one per process).
    verified: VerifiedSet,
    /// Frames the sessions wrote (pings excluded), for tests that look at the wire.
    pub frames_sent: usize,
    /// What the forwarder was asked to retry ([`Command::RetryRejected`]), in order.
    pub retries: Vec<(Vec<crate::core::nip34::RepoRef>, Vec<EventId>)>,
    /// Forwarder restarts so far (the engine's epoch: claims of an earlier one are void).
    forward_epoch: u64,
    /// The forwarder's session, connected to the own relay.
    forward: ForwardSession,
    /// Frames the own relay wrote to the forwarder, not read yet (`None`: a pong).
    forward_inbox: VecDeque<Option<String>>,
    /// Scripted answers of the own relay, per event, in order; a write without one is stored.
    pub own_answers: BTreeMap<EventId, VecDeque<OwnAnswer>>,
    /// The answer to the first write of every event without a script of its own (as
    /// [`OwnAnswer::Once`]): an own relay that refuses everything once.
    pub own_first_answer: Option<&'static str>,
    /// Events the own relay took into purgatory: accepted, never served.
    pub own_purgatory: BTreeSet<EventId>,
    /// `EVENT` frames the own relay read from the forwarder, per event.
    pub own_writes: BTreeMap<EventId, usize>,
    /// The forwarder authenticated (NIP-42) on its connection to the own relay.
    pub own_authed: bool,
    /// The own relay sent its challenge on the forwarder's connection.
    own_challenged: bool,
}

/// The forwarder's session as the engine makes it, writing at once (simulated time does not
/// move while the world settles) and with the world's key for NIP-42.
fn forward_session(own: &RelayUrl, now: Time) -> ForwardSession {
    let mut s = ForwardSession::new(ForwardConfig {
        auth_keys: Some(keys()),
        write_linger: Duration::ZERO,
        ..ForwardConfig::new(own.clone(), ForwardLimits::default())
    });
    s.on_connected(now);
    s
}

/// Ping interval and pong deadline of the simulated sessions (the engine's defaults).
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PONG_TIMEOUT: Duration = Duration::from_secs(20);

/// Events the shared verified set of a simulated process remembers.
const VERIFIED: usize = 200_000;

/// The `["EVENT", sub, event]` frame of `e`.
fn event_frame(sub_id: &SubscriptionId, e: &Event) -> String {
    format!(
        r#"["EVENT",{},{}]"#,
        serde_json::to_string(sub_id.as_str()).expect("json"),
        e.as_json()
    )
}

/// A relay frame `[kind, sub, text]`.
fn frame3(kind: &str, sub_id: &SubscriptionId, text: &str) -> String {
    serde_json::json!([kind, sub_id.as_str(), text]).to_string()
}

impl World {
    /// A world whose own relay is `own`; `cfg` adjusts the machine's settings.
    pub(super) fn new(own: &str, cfg: impl FnOnce(&mut SyncConfig)) -> World {
        // `RUST_LOG=grasp_sync=debug cargo test --lib NAME -- --nocapture` shows the machine.
        let _ = env_logger::builder().is_test(true).try_init();
        let own_url = RelayUrl::parse(own).expect("own url");
        let mut c = SyncConfig::new(own_url.clone());
        c.batch_window = Duration::from_secs(5);
        cfg(&mut c);
        let now = Time::from_secs(1_700_000_000);
        World {
            m: SyncMachine::new(c),
            now,
            forward: forward_session(&own_url, now),
            forward_inbox: VecDeque::new(),
            own_answers: BTreeMap::new(),
            own_first_answer: None,
            own_purgatory: BTreeSet::new(),
            own_writes: BTreeMap::new(),
            own_authed: false,
            own_challenged: false,
            own_url,
            own: FakeRelay::default(),
            relays: BTreeMap::new(),
            reports: VecDeque::new(),
            sessions: BTreeMap::new(),
            verified: VerifiedSet::new(VERIFIED),
            frames_sent: 0,
            retries: Vec::new(),
            forward_epoch: 0,
        }
    }

    /// Adds a remote relay.
    pub(super) fn relay(&mut self, url: &str) -> &mut FakeRelay {
        self.relays
            .entry(RelayUrl::parse(url).expect("relay url"))
            .or_default()
    }

    fn fake(&mut self, url: &RelayUrl) -> Option<&mut FakeRelay> {
        if *url == self.own_url {
            Some(&mut self.own)
        } else {
            self.relays.get_mut(url)
        }
    }

    /// Starts the machine and runs until nothing more happens now.
    pub(super) fn start(&mut self) {
        self.m.start(self.now);
        self.pump();
    }

    /// The wall-clock second of now, for `created_at`.
    pub(super) fn secs(&self) -> u64 {
        self.now.timestamp().as_secs()
    }

    /// Carries out every queued command and feeds back every report until quiet.
    pub(super) fn pump(&mut self) {
        for _ in 0..1_000_000 {
            if let Some(r) = self.reports.pop_front() {
                self.m.handle_report(r, self.now);
                continue;
            }
            match self.m.poll_command() {
                Some(c) => self.execute(c),
                None => {
                    self.check_json_lens();
                    return;
                }
            }
        }
        panic!("the world did not settle: a command/report loop");
    }

    /// Every recorded subscription's `json_len` is its filter's length (a REQ's room is
    /// summed from them).
    fn check_json_lens(&self) {
        let links = self
            .m
            .remotes
            .values()
            .map(|r| &r.link)
            .chain(std::iter::once(&self.m.own_link));
        for link in links {
            for (id, info) in link
                .subs
                .iter()
                .chain(link.queue.iter().map(|(i, s)| (i, s)))
            {
                assert_eq!(
                    info.json_len,
                    crate::core::filter_json::filter_len(&info.filter),
                    "subscription {id}: json_len is stale"
                );
            }
        }
    }

    /// Moves simulated time forward by `d`, firing every timer on the way.
    pub(super) fn advance(&mut self, d: Duration) {
        let end = self.now.plus(d);
        while let Some(t) = self.next_timeout() {
            if t > end {
                break;
            }
            // Move on by the monotonic difference, keeping the current wall-clock offset (a
            // timer's stored wall reading may be from before a wall-clock step).
            if t > self.now {
                self.now = self.now.plus(t.since(self.now));
            }
            self.fire_timers();
        }
        self.now = end;
        self.fire_timers();
    }

    /// The earliest deadline of the machine and of every session.
    fn next_timeout(&self) -> Option<Time> {
        let sessions = self
            .sessions
            .values()
            .filter_map(RelaySession::poll_timeout);
        let forward = self.forward.poll_timeout();
        sessions.chain(forward).chain(self.m.poll_timeout()).min()
    }

    /// Runs the machine's and the sessions' timers due now, then settles.
    fn fire_timers(&mut self) {
        let now = self.now;
        let due: Vec<RelayUrl> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.poll_timeout().is_some_and(|t| t <= now))
            .map(|(u, _)| u.clone())
            .collect();
        for url in due {
            if let Some(s) = self.sessions.get_mut(&url) {
                s.handle_timeout(now);
            }
            self.drive(&url);
        }
        if self.forward.poll_timeout().is_some_and(|t| t <= now) {
            self.drive_forward();
        }
        self.m.handle_timeout(now);
        self.pump();
    }

    /// The process restarts: every connection is gone, `down` passes (on both clocks; then
    /// the wall clock is stepped by `wall_step_ms`), and a new machine with the same settings
    /// starts, restored from `state` when given (issue 11). The relays keep their stores.
    pub(super) fn restart(
        &mut self,
        down: Duration,
        wall_step_ms: i64,
        state: Option<super::SyncSnapshot>,
    ) -> super::RestoreReport {
        let own = std::iter::once(&mut self.own);
        for f in self.relays.values_mut().chain(own) {
            f.conn = None;
            f.subs.clear();
            f.held.clear();
        }
        self.reports.clear();
        self.sessions.clear();
        self.verified = VerifiedSet::new(VERIFIED);
        let now = self.now.plus(down);
        self.new_forwarder(now);
        let wall = (now.wall_millis() as i64)
            .saturating_add(wall_step_ms)
            .max(0) as u64;
        self.now = Time::from_readings(now.as_millis(), wall);
        let mut m = SyncMachine::new(self.m.config.clone());
        let report = state.map(|s| m.restore(s, self.now)).unwrap_or_default();
        self.m = m;
        self.start();
        report
    }

    /// Advances in steps of `step` for `total`, so that periodic work runs as it would.
    pub(super) fn run_for(&mut self, total: Duration, step: Duration) {
        let mut t = Duration::ZERO;
        while t < total {
            self.advance(step);
            t += step;
        }
    }

    /// The session of `relay`, made at its first connect (a relay thread's).
    fn session(&mut self, relay: &RelayUrl) -> &mut RelaySession {
        let role = if *relay == self.own_url {
            SessionRole::Own
        } else {
            SessionRole::Remote
        };
        self.sessions.entry(relay.clone()).or_insert_with(|| {
            RelaySession::new(SessionConfig {
                url: relay.clone(),
                role,
                ping_interval: PING_INTERVAL,
                pong_timeout: PONG_TIMEOUT,
                max_event_size: 1 << 20,
                auth_keys: None,
                auth_limits: AuthLimits::default(),
            })
        })
    }

    fn execute(&mut self, c: Command) {
        // The engine's routing (`Command::route`), as the coordinator runs it.
        let (relay, control) = match c.route(&self.own_url) {
            Route::Connect { relay, generation } => return self.connect(relay, generation),
            Route::Forget(relay) => {
                // The thread ends: its connection and its session are gone.
                self.sessions.remove(&relay);
                if let Some(f) = self.fake(&relay) {
                    f.conn = None;
                    f.subs.clear();
                    f.held.clear();
                    f.negs.clear();
                }
                return;
            }
            Route::RetryRejected { repos, roots } => {
                self.retries.push((repos.clone(), roots.clone()));
                self.forward
                    .handle_control(ForwardControl::RetryRejected { repos, roots });
                self.drive_forward();
                return;
            }
            Route::Relay(relay, control) => (relay, control),
        };
        let now = self.now;
        if let Some(s) = self.sessions.get_mut(&relay) {
            // As the engine's relay thread does: a fetch leaves out ids in flight.
            let verified = Verified {
                set: &self.verified,
                forward_epoch: self.forward_epoch,
            };
            s.handle_command_with(now, control, verified);
        }
        self.drive(&relay);
    }

    /// A `Connect`: NIP-11 while the session wants it, then the connection (or its failure).
    fn connect(&mut self, relay: RelayUrl, generation: u64) {
        let now = self.now;
        let fake = if relay == self.own_url {
            Some(&self.own)
        } else {
            self.relays.get(&relay)
        };
        let fake = fake.map(|f| (f.down, f.publish_nip11.then(|| f.limits())));
        // A Connect while connected closes the old connection first (on both ends).
        if let Some(f) = self.fake(&relay) {
            f.conn = None;
            f.subs.clear();
            f.held.clear();
            f.negs.clear();
        }
        let session = self.session(&relay);
        session.on_closed_locally();
        match fake {
            None => session.on_connect_failed(generation, Disconnect::Tcp("no such relay".into())),
            Some((true, _)) => {
                session.on_connect_failed(generation, Disconnect::Tcp("connection refused".into()))
            }
            Some((false, limits)) => {
                if session.wants_limits() {
                    session.on_limits(limits.map_or(LimitsFetch::NoDocument, LimitsFetch::Fetched));
                }
                session.on_connected(generation, now);
                let f = self.fake(&relay).expect("known");
                f.conn = Some(generation);
                f.subs.clear();
                f.held.clear();
                f.negs.clear();
            }
        }
        self.drive(&relay);
    }

    /// Carries the frames `relay`'s session wrote to the fake relay, and everything that
    /// follows, until the session is quiet; its reports go to the machine.
    fn drive(&mut self, relay: &RelayUrl) {
        while let Some(t) = self
            .sessions
            .get_mut(relay)
            .and_then(RelaySession::poll_transmit)
        {
            match t {
                Transmit::Ping => self.send(relay, Frame::Pong),
                Transmit::Text(text) => {
                    self.frames_sent += 1;
                    self.client_frame(relay, &text);
                }
            }
        }
        self.collect(relay);
    }

    /// Moves `relay`'s session's reports to the machine's queue.
    fn collect(&mut self, relay: &RelayUrl) {
        if let Some(s) = self.sessions.get_mut(relay) {
            while let Some(r) = s.poll_report() {
                self.reports.push_back(r);
            }
        }
    }

    /// The fake relay reads one frame a session wrote.
    fn client_frame(&mut self, relay: &RelayUrl, text: &str) {
        let Some(f) = self.fake(relay) else {
            return;
        };
        let Some(generation) = f.conn else {
            return;
        };
        f.max_frame_seen = f.max_frame_seen.max(text.len());
        if f.max_message_length.is_some_and(|max| text.len() > max) {
            f.oversized_frames += 1;
            self.drop_connection(relay);
            return;
        }
        let msg =
            nostr::message::ClientMessage::from_json(text).expect("the session writes NIP-01");
        use nostr::message::ClientMessage as C;
        match msg {
            C::Req {
                subscription_id,
                filters,
            } => {
                assert!(!filters.is_empty(), "a REQ without filters");
                let filters = filters.into_iter().map(|f| f.into_owned()).collect();
                self.subscribe(
                    relay.clone(),
                    generation,
                    subscription_id.into_owned(),
                    filters,
                );
            }
            C::Close(sub_id) => {
                if let Some(f) = self.fake(relay) {
                    f.subs.remove(&*sub_id);
                }
            }
            C::NegOpen {
                subscription_id,
                filter,
                initial_message,
            } => self.neg_open(
                relay.clone(),
                generation,
                subscription_id.into_owned(),
                filter.into_owned(),
                initial_message.into_owned(),
            ),
            C::NegMsg {
                subscription_id,
                message,
            } => self.neg_msg(
                relay.clone(),
                generation,
                subscription_id.into_owned(),
                message.into_owned(),
            ),
            C::NegClose { subscription_id } => {
                if let Some(f) = self.fake(relay) {
                    f.negs.remove(&(generation, subscription_id.into_owned()));
                }
            }
            other => panic!("a session wrote {other:?}"),
        }
    }

    /// A frame from the fake relay into `relay`'s session; an event it hands to the
    /// forwarder is stored on the own relay.
    fn send(&mut self, relay: &RelayUrl, frame: Frame<'_>) {
        let now = self.now;
        let Some(s) = self.sessions.get_mut(relay) else {
            return;
        };
        let verified = Verified {
            set: &self.verified,
            forward_epoch: self.forward_epoch,
        };
        if let FrameOutcome::Forward(f) = s.handle_frame(now, frame, verified) {
            // As the engine's forwarder takes it from the channel (the world never blocks a
            // relay: the queue may grow past its backlog).
            let _ = self.forward.offer(f.id, f.raw, f.missing, &self.verified);
            self.drive_forward();
        }
        self.collect(relay);
    }

    /// The forwarder's turns against the own relay until neither writes nor answers: each
    /// turn writes what the session hands out, the own relay answers every frame at once.
    fn drive_forward(&mut self) {
        let now = self.now;
        loop {
            self.forward.handle_timeout(now);
            let mut busy = false;
            while let Some(t) = self.forward.poll_transmit(now) {
                busy = true;
                match t {
                    ForwardTransmit::Ping => self.forward_inbox.push_back(None),
                    ForwardTransmit::Text(text) => self.own_reads(&text),
                }
            }
            while let Some(frame) = self.forward_inbox.pop_front() {
                busy = true;
                let frame = frame.as_deref().map_or(Frame::Pong, Frame::Text);
                self.forward.handle_frame(now, frame, &self.verified);
                // An AUTH answering a challenge goes out at once, as the engine writes it.
                while let Some(ForwardTransmit::Text(text)) = self.forward.poll_transmit(now) {
                    self.own_reads(&text);
                }
            }
            while let Some(e) = self.forward.poll_event() {
                if e == ForwardEvent::Dead {
                    self.forward.on_disconnect();
                    self.forward.on_connected(now);
                }
            }
            if !busy {
                return;
            }
        }
    }

    /// A forwarder restart (a new process, or a thread that died): an empty queue on a new
    /// connection.
    fn new_forwarder(&mut self, now: Time) {
        self.forward = forward_session(&self.own_url, now);
        self.forward_inbox.clear();
        self.own_authed = false;
        self.own_challenged = false;
    }

    /// The own relay reads a frame the forwarder wrote and answers it.
    fn own_reads(&mut self, text: &str) {
        let v: serde_json::Value = serde_json::from_str(text).expect("the forwarder writes JSON");
        let answer = |id: &str, accepted: bool, message: &str| {
            Some(serde_json::json!(["OK", id, accepted, message]).to_string())
        };
        if v[0] == "AUTH" {
            let auth = Event::from_json(v[1].to_string()).expect("an AUTH event");
            let challenge = auth
                .tags
                .iter()
                .any(|t| t.as_slice() == ["challenge".to_string(), OWN_CHALLENGE.to_string()]);
            self.own_authed = challenge && auth.verify().is_ok();
            let message = if self.own_authed {
                ""
            } else {
                "invalid: bad AUTH"
            };
            let ok = answer(&auth.id.to_hex(), self.own_authed, message);
            self.forward_inbox.push_back(ok);
            return;
        }
        assert_eq!(v[0], "EVENT", "the forwarder writes EVENT and AUTH only");
        let e = Event::from_json(v[1].to_string()).expect("a checked event");
        *self.own_writes.entry(e.id).or_default() += 1;
        let (accepted, message) = match self.own_answer(&e.id) {
            None if self.own.store.iter().any(|x| x.id == e.id) => {
                (true, "duplicate: already have it".to_string())
            }
            None => {
                self.store_on_own_quietly(&e);
                (true, String::new())
            }
            Some(m) if Prefix::of(&m) == Prefix::Purgatory => {
                self.own_purgatory.insert(e.id);
                (true, m)
            }
            Some(m) => {
                if Prefix::of(&m) == Prefix::AuthRequired && !self.own_challenged {
                    self.own_challenged = true;
                    let challenge = serde_json::json!(["AUTH", OWN_CHALLENGE]).to_string();
                    self.forward_inbox
                        .push_back(answer(&e.id.to_hex(), false, &m));
                    self.forward_inbox.push_back(Some(challenge));
                    return;
                }
                (false, m)
            }
        };
        self.forward_inbox
            .push_back(answer(&e.id.to_hex(), accepted, &message));
    }

    /// The scripted answer to this write of `id`, if any ([`World::own_answers`]).
    fn own_answer(&mut self, id: &EventId) -> Option<String> {
        let stored: BTreeSet<EventId> = self.own.store.iter().map(|e| e.id).collect();
        let authed = self.own_authed;
        if let (Some(m), false) = (self.own_first_answer, self.own_answers.contains_key(id)) {
            let first = OwnAnswer::Once(m.to_string());
            self.own_answers.insert(*id, VecDeque::from([first]));
        }
        let script = self.own_answers.get_mut(id)?;
        loop {
            match script.front()? {
                OwnAnswer::Until(m, until) if !stored.contains(until) => return Some(m.clone()),
                OwnAnswer::Once(m) if Prefix::of(m) == Prefix::AuthRequired && !authed => {
                    return Some(m.clone())
                }
                OwnAnswer::Once(m) if Prefix::of(m) != Prefix::AuthRequired => {
                    let m = m.clone();
                    script.pop_front();
                    return Some(m);
                }
                _ => {
                    script.pop_front();
                }
            }
        }
    }

    /// A text frame from the fake relay.
    fn send_text(&mut self, relay: &RelayUrl, text: &str) {
        self.send(relay, Frame::Text(text));
    }

    fn neg_open(
        &mut self,
        relay: RelayUrl,
        generation: u64,
        sub_id: SubscriptionId,
        filter: Filter,
        message: String,
    ) {
        let Some(f) = self.fake(&relay) else {
            return;
        };
        if f.conn != Some(generation) {
            return;
        }
        f.neg_opens.push(filter.clone());
        if f.negs_count_as_subs
            && f.nip77 != Nip77Mode::Off
            && f.max_subs
                .is_some_and(|max| f.open_count(generation) >= max)
        {
            f.too_many_sent += 1;
            let answer = f.too_many(&sub_id);
            self.send_text(&relay, &answer);
            return;
        }
        let answer = match f.nip77 {
            Nip77Mode::Off => serde_json::json!(["NOTICE", "could not parse command"]).to_string(),
            Nip77Mode::Silent => return,
            Nip77Mode::Err => frame3("NEG-ERR", &sub_id, "blocked: too many records"),
            Nip77Mode::Closed => {
                frame3("CLOSED", &sub_id, "error: shutting down idle subscriptions")
            }
            Nip77Mode::BadHex => frame3("NEG-MSG", &sub_id, "zz-not-hex"),
            _ => {
                let server = f.neg_server(&filter);
                f.negs.insert((generation, sub_id.clone()), server);
                let open = f.open_count(generation);
                f.max_open_seen = f.max_open_seen.max(open);
                return self.neg_msg(relay, generation, sub_id, message);
            }
        };
        self.send_text(&relay, &answer);
    }

    fn neg_msg(&mut self, relay: RelayUrl, generation: u64, sub_id: SubscriptionId, msg: String) {
        let Some(f) = self.fake(&relay) else {
            return;
        };
        if f.conn != Some(generation) {
            return;
        }
        let mode = f.nip77;
        if let Nip77Mode::DropAfter(n) = mode {
            if f.neg_rounds >= n {
                self.drop_connection(&relay);
                return;
            }
        }
        let Some(server) = f.negs.get_mut(&(generation, sub_id.clone())) else {
            return;
        };
        let reply = match mode {
            // Protocol 0x61, upper bound infinity (timestamp 0, no id prefix), mode
            // Fingerprint, 16 bytes that never equal the client's.
            Nip77Mode::Endless => format!("61000001{}", "ab".repeat(16)),
            _ => {
                let query = hex_decode(&msg).expect("the machine sends hex");
                let out = server
                    .reconcile(&query)
                    .expect("a valid negentropy message");
                hex_encode(&out)
            }
        };
        f.neg_rounds += 1;
        let frame = frame3("NEG-MSG", &sub_id, &reply);
        if f.hold_neg {
            f.held_neg.push((generation, frame));
            return;
        }
        self.send_text(&relay, &frame);
    }

    /// Sends the NEG-MSG answers held back so far (those of the open connection).
    pub(super) fn release_neg(&mut self, url: &str) {
        let url = RelayUrl::parse(url).expect("url");
        let Some(f) = self.fake(&url) else {
            return;
        };
        let conn = f.conn;
        let held: Vec<String> = std::mem::take(&mut f.held_neg)
            .into_iter()
            .filter(|(g, _)| conn == Some(*g))
            .map(|(_, frame)| frame)
            .collect();
        for frame in held {
            self.send_text(&url, &frame);
        }
        self.pump();
    }

    /// The machine gets a NEG-MSG for a session it does not run (one that crossed the
    /// NEG-CLOSE the machine sent when it ended the session: the relay thread still knew
    /// it). Reported directly: a relay's NEG-MSG for a session never opened on the
    /// connection is dropped by the session itself (`core::session`'s tests).
    pub(super) fn stray_neg_msg(&mut self, url: &str, sub: &str) {
        let url = RelayUrl::parse(url).expect("url");
        let Some(generation) = self.relays.get(&url).and_then(|f| f.conn) else {
            return;
        };
        self.reports.push_back(Report::NegMsg {
            relay: url,
            generation,
            sub_id: SubscriptionId::new(sub),
            message: "61".into(),
        });
        self.pump();
    }

    fn subscribe(
        &mut self,
        relay: RelayUrl,
        generation: u64,
        sub_id: SubscriptionId,
        filters: Vec<Filter>,
    ) {
        let Some(f) = self.fake(&relay) else {
            return;
        };
        if f.conn != Some(generation) {
            return;
        }
        f.reqs.extend(filters.iter().cloned());
        f.req_messages += 1;
        f.max_filters_seen = f.max_filters_seen.max(filters.len());
        if f.refuse_multi_filter && filters.len() > 1 {
            f.subs.remove(&sub_id);
            let closed = frame3(
                "CLOSED",
                &sub_id,
                "unsupported: multi-filter REQs aren't supported (https://github.com/nostr-protocol/nips/issues/1645)",
            );
            self.send_text(&relay, &closed);
            return;
        }
        if let Some(max) = f.max_subs {
            if !f.subs.contains_key(&sub_id) && f.open_count(generation) >= max {
                f.too_many_sent += 1;
                let answer = f.too_many(&sub_id);
                self.send_text(&relay, &answer);
                return;
            }
        }
        if f.max_tag_keys
            .is_some_and(|max| filters.iter().any(|f| f.generic_tags.len() > max))
        {
            let closed = frame3("CLOSED", &sub_id, "ERROR: bad req: too many tags in filter");
            self.send_text(&relay, &closed);
            return;
        }
        if let Some((drop, n)) = f.drop_answers {
            if filters.iter().any(drop) {
                f.drop_answers = (n > 1).then_some((drop, n - 1));
                f.subs.insert(sub_id, filters);
                return;
            }
        }
        let mut answer = f.stored_answer_all(&filters);
        if filters.iter().any(|f| f.ids.is_some()) && !f.withhold_once.is_empty() {
            // Asked by id: these are left out of this answer, once each.
            let withheld = &mut f.withhold_once;
            answer.retain(|e| !withheld.remove(&e.id));
        }
        let drop_at = match f.drop_after {
            Some(k) if answer.len() > k => {
                f.drop_after = None;
                Some(k)
            }
            Some(k) => {
                f.drop_after = Some(k - answer.len());
                None
            }
            None => None,
        };
        let withhold = f.withhold_eose
            || (f.no_eose_for_live_only && filters.iter().all(|f| f.limit == Some(0)))
            || f.no_eose_kind.is_some_and(|k| {
                filters.iter().any(|f| {
                    f.kinds
                        .as_ref()
                        .is_some_and(|ks| ks.contains(&nostr::event::Kind::from(k)))
                })
            });
        let hold = f.hold_eose;
        // Open before the stored answer: a live event stored meanwhile reaches it too.
        f.subs.insert(sub_id.clone(), filters);
        let open = f.open_count(generation);
        f.max_open_seen = f.max_open_seen.max(open);
        for (i, e) in answer.iter().enumerate() {
            if drop_at == Some(i) {
                self.drop_connection(&relay);
                return;
            }
            self.send_text(&relay, &event_frame(&sub_id, e));
        }
        let Some(f) = self.fake(&relay) else {
            return;
        };
        if f.conn != Some(generation) || !f.subs.contains_key(&sub_id) {
            return;
        }
        if hold && !withhold {
            f.held.push((generation, sub_id));
        } else if !withhold {
            self.send_text(
                &relay,
                &serde_json::json!(["EOSE", sub_id.as_str()]).to_string(),
            );
        }
    }

    /// The own relay stores `e` (once) and delivers it to its matching subscriptions; the
    /// machine sees it at the next [`World::pump`].
    pub(super) fn store_on_own(&mut self, e: &Event) {
        self.store_on_own_quietly(e);
        self.pump();
    }

    /// [`World::store_on_own`] without pumping: used while a command is half carried out.
    fn store_on_own_quietly(&mut self, e: &Event) {
        if self.own.store.iter().any(|x| x.id == e.id) {
            return;
        }
        self.own.store.push(e.clone());
        let own = self.own_url.clone();
        self.deliver_live(&own, e);
    }

    /// Sends `e` to every open subscription of `url` whose filter matches it.
    fn deliver_live(&mut self, url: &RelayUrl, e: &Event) {
        let Some(f) = self.fake(url) else {
            return;
        };
        if f.conn.is_none() {
            return;
        }
        let subs: Vec<SubscriptionId> = f
            .subs
            .iter()
            .filter(|(_, flts)| {
                flts.iter()
                    .any(|flt| flt.match_event(e, MatchEventOptions::new()))
            })
            .map(|(s, _)| s.clone())
            .collect();
        for sub_id in subs {
            self.send_text(url, &event_frame(&sub_id, e));
        }
    }

    /// Publishes `e` on a remote relay: stored, and delivered live to every open subscription
    /// whose filter matches it (`since`/`until` included, as real relays do).
    pub(super) fn publish(&mut self, relay: &str, e: &Event) {
        let url = RelayUrl::parse(relay).expect("relay url");
        let f = self.relays.get_mut(&url).expect("known relay");
        f.store.push(e.clone());
        self.deliver_live(&url, e);
        self.pump();
    }

    fn drop_connection(&mut self, url: &RelayUrl) {
        let Some(f) = self.fake(url) else {
            return;
        };
        if f.conn.take().is_none() {
            return;
        }
        f.subs.clear();
        f.held.clear();
        f.negs.clear();
        if let Some(s) = self.sessions.get_mut(url) {
            s.on_lost(Disconnect::Read("connection reset".into()));
        }
        self.collect(url);
    }

    /// A batch whose queries answer at different times on `url` (its EOSEs held): the first
    /// query ends now, the event `gap(now)` is published on `url` a minute later (while only
    /// the batch's other queries cover its items), and the other queries answer 17 minutes
    /// after that, past the quick-reconnect window; then the world runs for 10 minutes.
    /// Returns the gap event.
    pub(super) fn late_batch_with_a_gap(
        &mut self,
        url: &str,
        gap: impl FnOnce(u64) -> Event,
    ) -> Event {
        self.release_eose(url);
        self.advance(Duration::from_secs(60));
        let gap = gap(self.secs());
        self.publish(url, &gap);
        self.advance(Duration::from_secs(17 * 60));
        self.relay(url).hold_eose = false;
        self.release_eose(url);
        self.run_for(Duration::from_secs(10 * 60), Duration::from_secs(30));
        gap
    }

    /// Sends the EOSEs held back so far (for subscriptions still open on the same connection).
    pub(super) fn release_eose(&mut self, url: &str) {
        let url = RelayUrl::parse(url).expect("url");
        let Some(f) = self.fake(&url) else {
            return;
        };
        let held = std::mem::take(&mut f.held);
        let due: Vec<_> = held
            .into_iter()
            .filter(|(g, sub)| f.conn == Some(*g) && f.subs.contains_key(sub))
            .collect();
        for (_, sub_id) in due {
            self.send_text(
                &url,
                &serde_json::json!(["EOSE", sub_id.as_str()]).to_string(),
            );
        }
        self.pump();
    }

    /// Sends the EOSEs held back so far of the subscriptions whose filter matches `pred`
    /// (still open on the same connection); the others stay held.
    pub(super) fn release_eose_where(&mut self, url: &str, pred: impl Fn(&Filter) -> bool) {
        let url = RelayUrl::parse(url).expect("url");
        let Some(f) = self.fake(&url) else {
            return;
        };
        let held = std::mem::take(&mut f.held);
        let (conn, subs) = (f.conn, &f.subs);
        let (due, kept): (Vec<_>, Vec<_>) = held
            .into_iter()
            .filter(|(g, sub)| conn == Some(*g) && subs.contains_key(sub))
            .partition(|(_, sub)| subs.get(sub).is_some_and(|fs| fs.iter().any(&pred)));
        f.held = kept;
        for (_, sub_id) in due {
            self.send_text(
                &url,
                &serde_json::json!(["EOSE", sub_id.as_str()]).to_string(),
            );
        }
        self.pump();
    }

    /// The relay sends `["NOTICE", message]` on its open connection.
    pub(super) fn notice(&mut self, url: &str, message: &str) {
        let url = RelayUrl::parse(url).expect("url");
        if self.fake(&url).is_none_or(|f| f.conn.is_none()) {
            return;
        }
        self.send_text(&url, &serde_json::json!(["NOTICE", message]).to_string());
        self.pump();
    }

    /// Hands the machine a report no fake relay makes: one from the engine itself
    /// ([`Report::ForwardBackPressure`]), or one of a connection the world cannot
    /// reproduce (a stale generation) to test the machine's own defence against it.
    /// The forwarder dies and is started again, as the engine's coordinator handles it: a new
    /// epoch (earlier hand-over claims are void) and [`Report::ForwarderLost`].
    pub(super) fn lose_forwarder(&mut self) {
        self.forward_epoch += 1;
        self.new_forwarder(self.now);
        self.inject(Report::ForwarderLost);
    }

    pub(super) fn inject(&mut self, report: Report) {
        self.reports.push_back(report);
        self.pump();
    }

    /// Drops the relay's connection (the own relay's too, by its URL).
    pub(super) fn drop(&mut self, url: &str) {
        let url = RelayUrl::parse(url).expect("url");
        self.drop_connection(&url);
        self.pump();
    }

    /// The relay closes subscription `sub` with `message`.
    pub(super) fn close_sub(&mut self, url: &str, sub: &SubscriptionId, message: &str) {
        let url = RelayUrl::parse(url).expect("url");
        let Some(f) = self.fake(&url) else {
            return;
        };
        if f.conn.is_none() || f.subs.remove(sub).is_none() {
            return;
        }
        self.send_text(&url, &frame3("CLOSED", sub, message));
        self.pump();
    }

    /// The relay's open subscriptions whose filter matches `pred`.
    pub(super) fn open_subs(
        &self,
        url: &str,
        pred: impl Fn(&Filter) -> bool,
    ) -> Vec<SubscriptionId> {
        let url = RelayUrl::parse(url).expect("url");
        let f = if url == self.own_url {
            &self.own
        } else {
            &self.relays[&url]
        };
        f.subs
            .iter()
            .filter(|(_, flts)| flts.iter().any(&pred))
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// Ids stored on the own relay.
    pub(super) fn own_ids(&self) -> BTreeSet<EventId> {
        self.own.store.iter().map(|e| e.id).collect()
    }

    /// Asserts that the own relay holds exactly `want` (as a set).
    pub(super) fn assert_own_holds(&self, want: &[&Event]) {
        let want: BTreeSet<EventId> = want.iter().map(|e| e.id).collect();
        let have = self.own_ids();
        let missing: Vec<_> = want.difference(&have).collect();
        let extra: Vec<_> = have.difference(&want).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "own relay: {} missing {missing:?}, {} unexpected {extra:?}",
            missing.len(),
            extra.len()
        );
    }
}

/// The key of every event the simulated tests sign.
pub(crate) fn keys() -> nostr::key::Keys {
    nostr::key::Keys::parse("6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e")
        .expect("test key")
}

/// A repository announcement (kind 30617) of `d` listing `relays`.
pub(crate) fn announcement(d: &str, relays: &[&str], created_at: u64) -> Event {
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    let mut t = vec!["relays".to_string()];
    t.extend(relays.iter().map(|s| s.to_string()));
    EventBuilder::new(Kind::Custom(30617), "")
        .tag(Tag::parse(["d", d]).expect("d tag"))
        .tag(Tag::parse(t).expect("relays tag"))
        .custom_created_at(nostr::types::Timestamp::from_secs(created_at))
        .finalize(&keys())
        .expect("signed")
}

/// The coordinate `30617:<pubkey>:<d>` of the repository `d`.
pub(crate) fn repo(d: &str) -> String {
    format!("30617:{}:{d}", keys().public_key().to_hex())
}

/// An issue (kind 1621) of repository `d`, created at `created_at` (Unix seconds).
pub(crate) fn issue(d: &str, text: &str, created_at: u64) -> Event {
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    EventBuilder::new(Kind::Custom(1621), text)
        .tag(Tag::parse(["a", &repo(d)]).expect("a tag"))
        .custom_created_at(nostr::types::Timestamp::from_secs(created_at))
        .finalize(&keys())
        .expect("signed")
}

/// A NIP-22 comment (kind 1111) on `root`, created at `created_at` (Unix seconds).
pub(crate) fn reply(root: &Event, text: &str, created_at: u64) -> Event {
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    EventBuilder::new(Kind::Custom(1111), text)
        .tag(Tag::parse(["E", &root.id.to_hex()]).expect("E tag"))
        .custom_created_at(nostr::types::Timestamp::from_secs(created_at))
        .finalize(&keys())
        .expect("signed")
}

/// True for a Layer 1 filter (announcements).
pub(crate) fn is_l1(f: &Filter) -> bool {
    f.kinds
        .as_ref()
        .is_some_and(|k| k.contains(&nostr::event::Kind::Custom(30617)))
}
