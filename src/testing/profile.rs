//! Relay profiles: [`TestRelayOptions`] that reproduce the observable behaviour of real relay
//! software (limits, refusals and their exact texts), as read from their sources and, for
//! nostr-rs-relay, checked against the running binary. `docs/testing.md` ("Profiles") lists
//! what each one reproduces.

use std::io;
use std::time::Duration;

use serde_json::json;

use super::ngit::NgitGraspPolicy;
use super::nip77::Nip77Mode;
use super::policy::{GraspPolicy, Refill, WriteRate};
use super::relay::{Reply, TestRelay, TestRelayOptions};

/// Real relay software a [`TestRelay`] can behave like
/// ([`TestRelayOptions::profile`], [`TestRelay::start_profile`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Profile {
    /// nostr-rs-relay 0.8.12: 32 subscriptions per connection, then
    /// `NOTICE "Subscription error: Maximum concurrent subscription count reached"` (no
    /// `CLOSED`, no `EOSE`); a REQ whose filters all have `limit: 0` gets no `EOSE`; a REQ
    /// repeating the id *and* filters of an open subscription is ignored; no result cap; a
    /// NIP-11 document without numeric limits; no NIP-77 (`NOTICE "could not parse command"`);
    /// an incoming frame over 262,144 bytes gets `NOTICE "message too large (N > 262144)"` and
    /// the connection is dropped; a duplicate is `OK true "duplicate: "`.
    NostrRsRelay,
    /// strfry 1.1: results cut silently to the newest 500 per filter; 200 subscriptions per
    /// connection with negentropy sessions counted among them, then
    /// `NOTICE "ERROR: too many concurrent REQs"` (no `CLOSED`, no `EOSE`); more than 3 tag keys
    /// in a filter → `CLOSED "ERROR: bad req: too many tags in filter"`; an incoming frame over
    /// 131,072 bytes drops the connection without a close frame; NIP-77 served (over 1,000,000
    /// records → `NEG-ERR "blocked: too many query results"`, unknown session →
    /// `NEG-ERR "closed: unknown subscription handle"`); NIP-11 lists 77 and its `limitation`;
    /// a duplicate is `OK true "duplicate: have this event"`; unknown commands get
    /// `NOTICE "ERROR: bad msg: unknown cmd"`.
    Strfry,
    /// ngit-relay, the own relay of a GRASP server (khatru): writes limited per connection to
    /// 15 at once, then one a minute (`OK false "rate-limited: slow down, please"`), and
    /// accepted only when they relate to what is stored ([`GraspPolicy`], domain: the relay's
    /// own `127.0.0.1:PORT`); no NIP-77: `NEG-OPEN` (like any unknown message) gets
    /// `NOTICE "failed to parse envelope: unknown envelope label"`; a duplicate is `OK true ""`.
    NgitRelay,
    /// rust-nostr's relay builder (`LocalRelay`): 60 writes per minute per connection (burst 60,
    /// then one a second; `OK false "rate-limited: slow down"`); no NIP-11 (404); 500 results
    /// for a filter without `limit`; 500 subscriptions per connection, then
    /// `CLOSED "rate-limited: too many REQs"`; NIP-77 served (not advertised: no NIP-11);
    /// events written with their keys sorted (`content` first, the id third).
    LocalRelay,
    /// ngit-grasp 3.0.10, the GRASP reference server (its relay is rust-nostr's relay builder
    /// behind ngit-grasp's write policy; read from its source, `docs/relays.md`):
    /// [`NgitGraspPolicy`] (a new repository announcement is held in purgatory,
    /// `OK true "purgatory: won't be served until git data arrives"`, until
    /// [`TestRelay::promote`] or a ref-less state event of its owner, and dropped after 30
    /// minutes; an event relating to nothing served is refused `OK false "restricted: Event
    /// event must reference an accepted repository or accepted event"`; what it stores is
    /// answered `OK true "duplicate: event stored"`); 60 writes per connection, then each
    /// EVENT earns the whole seconds since the connection's previous one
    /// ([`Refill::SinceLastAttempt`], `OK false "rate-limited: slow down"`); 500 results per
    /// filter, 500 subscriptions per connection (`CLOSED "rate-limited: too many REQs"`);
    /// NIP-77 served with 10 sessions and 50,000 records per connection; NIP-11 lists 77,
    /// `supported_grasps` and its `limitation`.
    NgitGrasp,
    /// A relay that lists NIP-77 in its NIP-11 document but refuses it: every `NEG-OPEN`,
    /// `NEG-MSG` and `NEG-CLOSE` is answered `NOTICE "ERROR: bad msg: negentropy disabled"`
    /// (nos.lol, nostr.mom), or not at all when `silent` (nostr.wine).
    Nip77Refusing {
        /// Never answer the NIP-77 messages instead of answering them with a NOTICE.
        silent: bool,
    },
}

/// nostr-rs-relay's subscription limit (hard-coded).
const NOSTR_RS_RELAY_SUBS: usize = 32;
/// nostr-rs-relay's `max_ws_message_bytes` and `max_ws_frame_bytes` (`2 << 17`; its comment
/// says 128K).
const NOSTR_RS_RELAY_MESSAGE: usize = 2 << 17;
/// strfry's `maxFilterLimit`.
const STRFRY_MAX_LIMIT: usize = 500;
/// strfry's subscriptions per connection (REQs and negentropy sessions together).
const STRFRY_SUBS: usize = 200;
/// strfry's largest incoming websocket frame.
const STRFRY_FRAME: usize = 131_072;
/// strfry's `maxSyncEvents`.
const STRFRY_SYNC_EVENTS: usize = 1_000_000;
/// rust-nostr's relay builder: default filter limit, subscriptions and writes per minute.
const LOCAL_RELAY_LIMIT: usize = 500;
const LOCAL_RELAY_SUBS: usize = 500;
const LOCAL_RELAY_WRITES: u32 = 60;
/// ngit-grasp (rust-nostr's relay builder as `src/nostr/builder.rs` sets it up): writes per
/// connection (`notes_per_minute: 60`), results per filter (`NGIT_RELAY_FILTER_LIMIT`),
/// subscriptions (`NGIT_RELAY_MAX_SUBSCRIPTIONS`), negentropy sessions and records.
const NGIT_GRASP_WRITES: u32 = 60;
const NGIT_GRASP_LIMIT: usize = 500;
const NGIT_GRASP_SUBS: usize = 500;
const NGIT_GRASP_NEG_SESSIONS: usize = 10;
const NGIT_GRASP_NEG_ITEMS: usize = 50_000;
/// ngit-relay's write burst and the time to earn one more write (khatru's
/// `EventIPRateLimiter(3, 3 min, 15)`, spread evenly).
const NGIT_BURST: u32 = 15;
const NGIT_PER: Duration = Duration::from_secs(60);

impl TestRelayOptions {
    /// Options reproducing `profile` (every other option at its default).
    pub fn profile(profile: Profile) -> TestRelayOptions {
        let base = TestRelayOptions::default();
        match profile {
            Profile::NostrRsRelay => TestRelayOptions {
                nip11: Some(json!({
                    "name": "Unnamed nostr-rs-relay",
                    "supported_nips": [1, 2, 9, 11, 12, 15, 16, 20, 22, 33, 40, 42],
                    "software": "https://git.sr.ht/~gheartsfield/nostr-rs-relay",
                    "version": "0.8.12",
                    "limitation": {"payment_required": false}
                })),
                max_subscriptions: Some(NOSTR_RS_RELAY_SUBS),
                too_many_subs_reply: Reply::Notice(
                    "Subscription error: Maximum concurrent subscription count reached".into(),
                ),
                no_eose_for_limit_zero: true,
                ignore_identical_req: true,
                max_message_size: Some(NOSTR_RS_RELAY_MESSAGE),
                oversize_notice: true,
                duplicate_reply: "duplicate: ".into(),
                nip77: Nip77Mode::Off,
                ..base
            },
            Profile::Strfry => TestRelayOptions {
                nip11: Some(json!({
                    "name": "strfry default",
                    "description": "This is a strfry instance.",
                    "software": "git+https://github.com/hoytech/strfry.git",
                    "version": "1.1.1",
                    "supported_nips": [1, 2, 4, 9, 11, 22, 28, 40, 70, 77],
                    "negentropy": 1,
                    "limitation": {
                        "max_limit": STRFRY_MAX_LIMIT,
                        "max_message_length": STRFRY_FRAME,
                        "max_subscriptions": STRFRY_SUBS
                    }
                })),
                result_cap: Some(STRFRY_MAX_LIMIT),
                max_subscriptions: Some(STRFRY_SUBS),
                too_many_subs_reply: Reply::Notice("ERROR: too many concurrent REQs".into()),
                neg_sessions_count_as_subscriptions: true,
                max_tag_keys: Some(3),
                max_message_size: Some(STRFRY_FRAME),
                nip77: Nip77Mode::On,
                nip77_max_records: Some(STRFRY_SYNC_EVENTS),
                nip77_no_session_reply: "closed: unknown subscription handle".into(),
                duplicate_reply: "duplicate: have this event".into(),
                parse_error_notice: "ERROR: bad msg: unknown cmd".into(),
                ..base
            },
            Profile::NgitRelay => TestRelayOptions {
                nip11: Some(json!({
                    "name": "ngit-relay",
                    "software": "https://github.com/fiatjaf/khatru",
                    "version": "n/a",
                    "supported_nips": [1, 9, 11, 42, 45, 70]
                })),
                write_rate: Some(
                    WriteRate::new(NGIT_BURST, NGIT_PER)
                        .with_message("rate-limited: slow down, please"),
                ),
                grasp_policy: Some(GraspPolicy::default()),
                duplicate_reply: String::new(),
                parse_error_notice: "failed to parse envelope: unknown envelope label".into(),
                nip77: Nip77Mode::Off,
                ..base
            },
            Profile::LocalRelay => TestRelayOptions {
                nip11: None,
                default_limit: Some(LOCAL_RELAY_LIMIT),
                max_subscriptions: Some(LOCAL_RELAY_SUBS),
                too_many_subs_reply: Reply::Closed("rate-limited: too many REQs".into()),
                write_rate: Some(WriteRate::new(
                    LOCAL_RELAY_WRITES,
                    Duration::from_secs(60) / LOCAL_RELAY_WRITES,
                )),
                nip77: Nip77Mode::On,
                sorted_keys: true,
                ..base
            },
            Profile::NgitGrasp => TestRelayOptions {
                nip11: Some(json!({
                    "name": "ngit-grasp grasp relay",
                    "description": "a GRASP server",
                    "supported_nips": [1, 5, 9, 11, 34, 62, 77],
                    "software": "https://gitworkshop.dev/danconwaydev.com/ngit-grasp",
                    "version": "3.0.10",
                    "limitation": {
                        "max_message_length": 5 * 1024 * 1024,
                        "max_subscriptions": NGIT_GRASP_SUBS,
                        "max_limit": NGIT_GRASP_LIMIT,
                        "max_subid_length": 250,
                        "default_limit": NGIT_GRASP_LIMIT,
                        "restricted_writes": true
                    },
                    "supported_grasps": ["GRASP-01", "GRASP-02"],
                    "repo_acceptance_criteria": "None"
                })),
                default_limit: Some(NGIT_GRASP_LIMIT),
                result_cap: Some(NGIT_GRASP_LIMIT),
                max_subscriptions: Some(NGIT_GRASP_SUBS),
                too_many_subs_reply: Reply::Closed("rate-limited: too many REQs".into()),
                write_rate: Some(
                    WriteRate::new(NGIT_GRASP_WRITES, Duration::from_secs(1))
                        .with_refill(Refill::SinceLastAttempt),
                ),
                ngit_grasp: Some(NgitGraspPolicy::default()),
                nip77: Nip77Mode::On,
                nip77_max_sessions: Some(NGIT_GRASP_NEG_SESSIONS),
                nip77_max_items: Some(NGIT_GRASP_NEG_ITEMS),
                ..base
            },
            Profile::Nip77Refusing { silent } => TestRelayOptions {
                nip11: Some(json!({
                    "name": "nip77-refusing relay",
                    "supported_nips": [1, 11, 77]
                })),
                nip77: if silent {
                    Nip77Mode::Silent
                } else {
                    Nip77Mode::Notice("ERROR: bad msg: negentropy disabled".into())
                },
                ..base
            },
        }
    }
}

impl TestRelay {
    /// Starts a relay behaving like `profile` on an ephemeral port of 127.0.0.1.
    ///
    /// # Panics
    /// If no port on 127.0.0.1 can be bound.
    pub fn start_profile(profile: Profile) -> TestRelay {
        TestRelay::start_with(TestRelayOptions::profile(profile))
    }

    /// Starts a relay behaving like `profile` on 127.0.0.1:`port` (`0` picks a free port), as
    /// [`start_on_port`](Self::start_on_port) does.
    pub fn start_profile_on_port(profile: Profile, port: u16) -> io::Result<TestRelay> {
        TestRelay::start_on_port(port, TestRelayOptions::profile(profile))
    }
}
