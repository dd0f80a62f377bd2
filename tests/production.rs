//! Issue 37, item 1: the production case at a scale that runs in seconds. 60 repositories
//! with 240 root events and their replies (NIP-22 comments, legacy `e` reply chains up to
//! four deep, statuses, a few large patches) spread over 8 relays of mixed profiles, three
//! of them strfry with nos.lol's limits (20 subscriptions with negentropy sessions counted
//! among them, 500 results per filter, 3 tag keys, 131,072-byte frames). The own relay holds
//! the announcements and the root events, as a GRASP server's relay does before its sync.
//!
//! Asserted: the own relay ends with exactly the expected set (by id); every strfry-limited
//! relay sent no NOTICE and no CLOSED, and never had more than 20 subscriptions (REQs and
//! negentropy sessions together) open on one connection. The data is deterministic (seeded
//! RNG, keys from fixed secrets); only thread timing varies.
//!
//! The bench's `--only production` section runs the full size (about 900 repositories,
//! 3,600 root events, 20 relays) against the release binary (`docs/performance.md`).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use common::init_logging;
use grasp_sync::testing::{wait_until, Profile, TestRelay, TestRelayOptions};
use grasp_sync::{Config, RelayUrl};
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::{Keys, SecretKey};
use nostr::types::Timestamp;
use serde_json::json;

/// nos.lol's published `max_subscriptions` (strfry 1.1.0).
const NOS_LOL_SUBS: usize = 20;
const REPOS: usize = 60;
const ROOTS: usize = 240;
const REPOS_PER_OWNER: usize = 10;
/// Generous: the sync takes a few seconds on 2 cores.
const DEADLINE: Duration = Duration::from_secs(120);

/// xorshift64*: the same data on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Keys from a fixed secret (`n` > 0), so every run signs the same events.
fn keys(n: u32) -> Keys {
    let mut secret = [0x11u8; 32];
    secret[28..].copy_from_slice(&n.to_be_bytes());
    Keys::new(SecretKey::from_slice(&secret).expect("a valid secret"))
}

fn sign(keys: &Keys, kind: u16, content: String, tags: Vec<Vec<String>>, at: u64) -> Event {
    let mut b =
        EventBuilder::new(Kind::Custom(kind), content).custom_created_at(Timestamp::from_secs(at));
    for t in tags {
        b = b.tag(Tag::parse(t).expect("tag"));
    }
    b.finalize(keys).expect("sign")
}

fn t(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| s.to_string()).collect()
}

/// strfry with nos.lol's limits: the `Strfry` profile with 20 subscriptions per connection,
/// in its behaviour and in its NIP-11 document.
fn strfry_nos_lol() -> TestRelayOptions {
    let mut opts = TestRelayOptions::profile(Profile::Strfry);
    opts.max_subscriptions = Some(NOS_LOL_SUBS);
    let doc = opts.nip11.as_mut().expect("strfry publishes NIP-11");
    doc["limitation"]["max_subscriptions"] = json!(NOS_LOL_SUBS);
    opts
}

/// The world: relays, the own relay's seed and the expected set.
struct World {
    own: TestRelay,
    /// (name, relay, strfry-limited).
    relays: Vec<(&'static str, TestRelay, bool)>,
    expected: HashSet<EventId>,
}

fn world() -> World {
    let own = TestRelay::start();
    let relays: Vec<(&'static str, TestRelay, bool)> = vec![
        ("strfry-20 a", TestRelay::start_with(strfry_nos_lol()), true),
        ("strfry-20 b", TestRelay::start_with(strfry_nos_lol()), true),
        ("strfry-20 c", TestRelay::start_with(strfry_nos_lol()), true),
        ("strfry", TestRelay::start_profile(Profile::Strfry), false),
        (
            "nostr-rs-relay",
            TestRelay::start_profile(Profile::NostrRsRelay),
            false,
        ),
        (
            "LocalRelay a",
            TestRelay::start_profile(Profile::LocalRelay),
            false,
        ),
        (
            "LocalRelay b",
            TestRelay::start_profile(Profile::LocalRelay),
            false,
        ),
        ("plain", TestRelay::start(), false),
    ];
    let urls: Vec<String> = relays.iter().map(|(_, r, _)| r.url()).collect();
    let mut rng = Rng(37);
    let owners: Vec<Keys> = (0..REPOS.div_ceil(REPOS_PER_OWNER) as u32)
        .map(|i| keys(1 + i))
        .collect();
    let people: Vec<Keys> = (0..16).map(|i| keys(1_000 + i)).collect();
    let now = Timestamp::now().as_secs();
    let mut at = now - 30 * 24 * 3600;
    let mut next_at = || {
        at += 60;
        at
    };
    let mut expected = HashSet::new();
    // Repository r's relays: 1 to 3 of them, every relay listed by some.
    let listed: Vec<Vec<usize>> = (0..REPOS)
        .map(|r| {
            let n = 1 + rng.below(3);
            let first = r % urls.len();
            let mut on: Vec<usize> = vec![first];
            while on.len() < n {
                let i = rng.below(urls.len());
                if !on.contains(&i) {
                    on.push(i);
                }
            }
            on
        })
        .collect();
    // Each event lands on a non-empty part of its repository's relays.
    let place = |rng: &mut Rng, r: usize, e: &Event, expected: &mut HashSet<EventId>| {
        let on = &listed[r];
        let first = rng.below(on.len());
        for (k, &i) in on.iter().enumerate() {
            if k == first || rng.below(3) == 0 {
                relays[i].1.insert(e);
            }
        }
        expected.insert(e.id);
    };
    let mut roots: Vec<(usize, Event)> = Vec::new();
    for r in 0..REPOS {
        let owner = &owners[r / REPOS_PER_OWNER];
        let d = format!("repo-{r}");
        let mut relay_tag = vec!["relays".to_string()];
        relay_tag.extend(listed[r].iter().map(|&i| urls[i].clone()));
        let ann = sign(
            owner,
            30617,
            String::new(),
            vec![
                t(&["d", &d]),
                t(&["name", &d]),
                t(&["description", "a repository of the production case"]),
                t(&["clone", &format!("https://git.example.org/{d}.git")]),
                relay_tag,
                t(&["maintainers", &owner.public_key().to_hex()]),
            ],
            next_at(),
        );
        own.insert(&ann);
        for &i in &listed[r] {
            relays[i].1.insert(&ann);
        }
        expected.insert(ann.id);
    }
    // Root events: issues and patches (one in twelve a large one, 60–100 KB).
    for n in 0..ROOTS {
        let r = n % REPOS;
        let owner = &owners[r / REPOS_PER_OWNER];
        let repo = format!("30617:{}:repo-{r}", owner.public_key().to_hex());
        let author = &people[rng.below(people.len())];
        let e = if rng.below(2) == 0 {
            let size = if rng.below(12) == 0 {
                60_000 + rng.below(40_000)
            } else {
                400 + rng.below(8_000)
            };
            sign(
                author,
                1617,
                format!(
                    "From {n}\n{}",
                    "+ let x = patch_line();\n".repeat(size / 25)
                ),
                vec![
                    t(&["a", &repo]),
                    t(&["p", &owner.public_key().to_hex()]),
                    t(&["t", "root"]),
                    t(&["alt", "git patch"]),
                ],
                next_at(),
            )
        } else {
            sign(
                author,
                1621,
                format!(
                    "issue {n}: {}",
                    "words of an issue ".repeat(1 + rng.below(100))
                ),
                vec![
                    t(&["a", &repo]),
                    t(&["p", &owner.public_key().to_hex()]),
                    t(&["subject", &format!("issue {n}")]),
                ],
                next_at(),
            )
        };
        own.insert(&e);
        place(&mut rng, r, &e, &mut expected);
        roots.push((r, e));
    }
    // Replies: NIP-22 comments on roots, legacy `e` replies below comments (chains up to 4
    // deep), statuses.
    for (r, root) in &roots {
        let owner = &owners[r / REPOS_PER_OWNER];
        let repo = format!("30617:{}:repo-{r}", owner.public_key().to_hex());
        let root_hex = root.id.to_hex();
        let root_author = root.pubkey.to_hex();
        let k = root.kind.as_u16().to_string();
        for c in 0..rng.below(4) {
            let comment = sign(
                &people[rng.below(people.len())],
                1111,
                format!("comment {c} {}", "looks good ".repeat(1 + rng.below(60))),
                vec![
                    t(&["E", &root_hex, "", &root_author]),
                    t(&["K", &k]),
                    t(&["P", &root_author]),
                    t(&["e", &root_hex, "", &root_author]),
                    t(&["k", &k]),
                    t(&["p", &root_author]),
                ],
                next_at(),
            );
            place(&mut rng, *r, &comment, &mut expected);
            let mut parent = comment;
            for depth in 0..rng.below(4) {
                let reply = sign(
                    &people[rng.below(people.len())],
                    1,
                    format!("reply {depth} below comment {c}"),
                    vec![
                        t(&["e", &parent.id.to_hex(), "", "reply"]),
                        t(&["p", &parent.pubkey.to_hex()]),
                    ],
                    next_at(),
                );
                place(&mut rng, *r, &reply, &mut expected);
                parent = reply;
            }
        }
        if rng.below(3) == 0 {
            let status = sign(
                owner,
                1630 + rng.below(4) as u16,
                String::new(),
                vec![
                    t(&["e", &root_hex, "", "root"]),
                    t(&["p", &root_author]),
                    t(&["a", &repo]),
                ],
                next_at(),
            );
            place(&mut rng, *r, &status, &mut expected);
        }
    }
    World {
        own,
        relays,
        expected,
    }
}

#[test]
fn production_case_exact_set_and_no_refusal_from_strfry_limited_relays() {
    init_logging();
    let w = world();
    let config = Config::new(RelayUrl::parse(&w.own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    let handle = grasp_sync::start(config).unwrap();
    let done = wait_until(DEADLINE, || {
        w.own.event_ids() == w.expected && handle.status().is_settled()
    });
    let held = w.own.event_ids();
    let missing = w.expected.difference(&held).count();
    let unexpected = held.difference(&w.expected).count();
    let table: BTreeMap<&str, String> = w
        .relays
        .iter()
        .map(|(name, r, _)| {
            (
                *name,
                format!(
                    "{}: {} REQs, {} NEG-OPENs, {} NOTICEs, {} CLOSEDs, {} NEG-ERRs, peak {} \
                     subscriptions + sessions per connection, open now {} + {}; refusals: {:?}",
                    r.url(),
                    r.reqs().len(),
                    r.neg_opens().len(),
                    r.notices_sent(),
                    r.closed_sent(),
                    r.neg_errs_sent(),
                    r.max_subscriptions_and_neg_sessions_per_connection(),
                    r.open_subscriptions(),
                    r.open_neg_sessions(),
                    r.refusals_sent().iter().take(5).collect::<Vec<_>>(),
                ),
            )
        })
        .collect();
    eprintln!(
        "{} expected events; per relay: {table:#?}",
        w.expected.len()
    );
    assert!(
        done,
        "the own relay misses {missing} and holds {unexpected} unexpected of {} events \
         (settled: {}): {:#?}",
        w.expected.len(),
        handle.status().is_settled(),
        handle.status()
    );
    assert_eq!(held, w.expected);
    for (name, relay, limited) in &w.relays {
        if !limited {
            continue;
        }
        assert_eq!(
            (relay.notices_sent(), relay.closed_sent()),
            (0, 0),
            "{name} was provoked: {:?}",
            relay.refusals_sent()
        );
        let peak = relay.max_subscriptions_and_neg_sessions_per_connection();
        assert!(
            peak <= NOS_LOL_SUBS,
            "{name} had {peak} subscriptions and sessions open on one connection"
        );
        assert!(
            !relay.reqs().is_empty(),
            "{name} was never asked anything: the test would prove nothing"
        );
    }
    handle.shutdown(Duration::from_secs(10)).unwrap();
}
