//! Profiles of real relays for the [`TestRelay`](crate::testing::TestRelay): the observable
//! behaviour of each, as `../shared/notes/relays.md` and `docs/relays.md` record it, so that
//! socket tests meet what operators meet. The simulated relays of the sans-IO tests have the
//! same profiles (`core::sync::world::SimProfile`).

use std::time::Duration;

use serde_json::json;

use super::nip77::Nip77Mode;
use super::relay::{Reply, TestRelayOptions, WriteRate};

/// A real relay whose behaviour a [`TestRelay`](crate::testing::TestRelay) takes on
/// ([`TestRelayOptions::profile`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Profile {
    /// nostr-rs-relay 0.8.12: no EOSE for a REQ whose filters all have `limit: 0`; 32
    /// subscriptions per connection, then `NOTICE "Subscription error: Maximum concurrent
    /// subscription count reached"` (no CLOSED, no EOSE); a NIP-11 document without limits;
    /// no NIP-77 (`NOTICE "could not parse command"`).
    NostrRsRelay,
    /// strfry 1.1: the newest 500 per filter, silently; 200 subscriptions, then `NOTICE
    /// "ERROR: too many concurrent REQs"`; at most 3 tag keys per filter (`CLOSED "ERROR:
    /// bad req: too many tags in filter"`); NIP-77; its limits in NIP-11.
    Strfry,
    /// rust-nostr's relay builder (`LocalRelay`, ngit-grasp): 60 events a minute per
    /// connection, then `OK false "rate-limited: …"`; 500 results per REQ; 500 subscriptions,
    /// then `CLOSED "rate-limited: too many REQs"`; no NIP-11; NIP-77.
    LocalRelay,
    /// ngit-relay (khatru) as the own relay of a GRASP server for `domain`: 15 events at
    /// once, then one a minute (per connection here; per address there); stores only what
    /// relates to a stored repository ([`TestRelayOptions::relates_to_stored`]); no NIP-77.
    NgitRelay {
        /// The domain its announcements must list in `clone` and `relays`.
        domain: String,
    },
    /// Lists NIP-77 in NIP-11 and never answers a NEG-OPEN (nostr.wine).
    Nip77Silent,
}

impl TestRelayOptions {
    /// The options of `profile` (see [`Profile`]); fields can be changed afterwards, e.g. a
    /// shorter [`WriteRate::every`] to keep a test fast.
    pub fn profile(profile: Profile) -> TestRelayOptions {
        let base = TestRelayOptions::default();
        match profile {
            Profile::NostrRsRelay => TestRelayOptions {
                no_eose_for_live_only: true,
                max_subscriptions: Some(32),
                too_many_subs_reply: Reply::Notice(
                    "Subscription error: Maximum concurrent subscription count reached".into(),
                ),
                nip11: Some(json!({
                    "name": "nostr-rs-relay",
                    "supported_nips": [1, 2, 9, 11, 12, 15, 16, 20, 22, 33, 40],
                    "software": "https://git.sr.ht/~gheartsfield/nostr-rs-relay",
                    "version": "0.8.12"
                })),
                nip77: Nip77Mode::Off,
                ..base
            },
            Profile::Strfry => TestRelayOptions {
                result_cap: Some(500),
                max_subscriptions: Some(200),
                too_many_subs_reply: Reply::Notice("ERROR: too many concurrent REQs".into()),
                max_tag_keys: Some(3),
                nip11: Some(json!({
                    "name": "strfry",
                    "supported_nips": [1, 2, 4, 9, 11, 22, 28, 40, 70, 77],
                    "software": "git+https://github.com/hoytech/strfry.git",
                    "version": "1.1.1",
                    "negentropy": 1,
                    "limitation": {
                        "max_limit": 500,
                        "max_message_length": 131072,
                        "max_subscriptions": 200
                    }
                })),
                nip77: Nip77Mode::On,
                ..base
            },
            Profile::LocalRelay => TestRelayOptions {
                write_rate: Some(WriteRate {
                    burst: 60,
                    every: Duration::from_secs(1),
                }),
                result_cap: Some(500),
                max_subscriptions: Some(500),
                too_many_subs_reply: Reply::Closed("rate-limited: too many REQs".into()),
                nip11: None,
                nip77: Nip77Mode::On,
                ..base
            },
            Profile::NgitRelay { domain } => TestRelayOptions {
                write_rate: Some(WriteRate {
                    burst: 15,
                    every: Duration::from_secs(60),
                }),
                relates_to_stored: Some(domain),
                nip77: Nip77Mode::Off,
                ..base
            },
            Profile::Nip77Silent => TestRelayOptions {
                nip11: Some(json!({
                    "name": "a relay that lists NIP-77 and never answers it",
                    "supported_nips": [1, 11, 77]
                })),
                nip77: Nip77Mode::Silent,
                ..base
            },
        }
    }
}
