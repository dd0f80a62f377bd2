//! "No event lost" (issue 7): a seeded, randomized fault test over real sockets.
//!
//! Four remote test relays and the own relay (also a `TestRelay`) run on 127.0.0.1; each
//! remote relay has the profile of a real relay, drawn from the seed. A seeded
//! RNG builds a world of repositories (kind 30617 announcements whose `relays` tags name some
//! of the remote relays, sometimes the own relay too), repository states (30618), root
//! events (patches 1617, pull requests 1618, issues 1621), replies (1111 with `E`/`e`, 1622
//! with `e`), status events (1630–1632), repository comments (`A`), quotes (`q`) and noise,
//! spread over the relays, many with old `created_at`. The engine starts, and for a bounded
//! number of steps the same RNG injects faults while new and backdated events are published:
//!
//! * a remote relay restarted (store and port kept, down for up to 300 ms),
//! * the own relay restarted,
//! * connections dropped (remote and own),
//! * a connection dropped *mid-answer*: the next stored answer longer than n events is cut
//!   after n events, no EOSE (`TestRelay::set_drop_mid_answer`), mostly on a capped relay,
//! * `CLOSED` (`error:`, `rate-limited:`, `restricted:`) on one random open subscription,
//! * result caps changed (so history must be paged; `assumed_page_size` is 4),
//! * events published live on remote relays and on the own relay: new ones, and backdated
//!   ones (minutes to weeks old), and noise.
//!
//! Then the faults stop and the test waits until the own relay holds **exactly** the
//! expected set: the closure of what the engine must fetch, computed from the relays' final
//! stores (announcements on the own relay → their relays; Layer 1 kinds 30617/30618/10317 of
//! every such relay; `#a/#A/#q` of the repositories listing it; `#e/#E/#q` of the root events
//! on the own relay and of the replies followed below them; repeated to a fixed point). Missing ids and unexpected ids both fail, and
//! the failure report names the seed, each missing event (kind, `created_at`, where it is
//! stored, when it was published) and how to re-run.
//!
//! Only thread timing is not deterministic: the world and the fault schedule depend on the
//! seed alone.
//!
//! ```text
//! # the three fixed seeds of the normal suite
//! cargo test --all-features --test faults
//! # one seed, with the engine's log
//! GRASP_SYNC_FAULT_SEED=9003 RUST_LOG=grasp_sync=debug \
//!     cargo test --all-features --test faults -- seeds_from_env --nocapture
//! # many seeds: GRASP_SYNC_FAULT_SEEDS of them, starting at GRASP_SYNC_FAULT_BASE (default 0)
//! GRASP_SYNC_FAULT_SEEDS=40 GRASP_SYNC_FAULT_BASE=9000 \
//!     cargo test --release --all-features --test faults -- seeds_from_env --nocapture
//! ```
//!
//! The replicated shape (issue 33; `replicated_seed_a`, `replicated_seed_b`, or
//! `GRASP_SYNC_FAULT_REPLICATED=1` with the seeds from the environment): every repository on
//! two to four relays, each holding everything of it, so copies of every event race in from
//! all of them; three in four relays have LocalRelay's answers (NIP-77 found without NIP-11).
//!
//! `GRASP_SYNC_FAULT_DEADLINE` (seconds) overrides how long convergence may take after the
//! last fault (default 20 s for the fixed seeds, 120 s for seeds from the environment);
//! `GRASP_SYNC_FAULT_STEPS` overrides the number of fault steps (default 24).

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::thread;
use std::time::{Duration, Instant};

use grasp_sync::testing::{wait_until, Profile, TestRelay, TestRelayOptions};
use grasp_sync::Config;
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::filter::MatchEventOptions;
use nostr::key::{Keys, SecretKey};
use nostr::types::Timestamp;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

use common::{init_logging, url};

/// Remote relays.
const REMOTES: usize = 4;
/// Fault steps unless `GRASP_SYNC_FAULT_STEPS` says otherwise.
const DEFAULT_STEPS: usize = 24;
/// Convergence deadline of the fixed seeds.
const FIXED_DEADLINE: Duration = Duration::from_secs(20);
/// Convergence deadline of seeds from the environment.
const ENV_DEADLINE: Duration = Duration::from_secs(120);
/// Events per query the engine assumes for relays without NIP-11 limits (the caps below are
/// at least this, so a capped answer is always recognised as a full page).
const PAGE: usize = 4;
/// Result caps a relay may get.
const CAPS: [Option<usize>; 4] = [None, Some(PAGE), Some(6), Some(9)];
const DAY: u64 = 86_400;

const ROOT_KINDS: [u16; 4] = [1617, 1618, 1619, 1621];

/// Codes of `World::fault_step`, one per kind of step: new events, backdated events, a root
/// on the own relay, noise, remote restart, own restart, remote drop, own drop, mid-answer
/// drop, CLOSED, cap change. Every seed runs each of them once (in a seeded order) before
/// the random steps.
const FORCED_STEPS: [u32; 11] = [0, 4, 7, 8, 9, 11, 12, 13, 14, 16, 18];

// ----- the fixed seeds of the normal suite (together they exercise every fault kind) -----

#[test]
fn seed_a() {
    run_fixed(FIXED_SEEDS[0]);
}

#[test]
fn seed_b() {
    run_fixed(FIXED_SEEDS[1]);
}

#[test]
fn seed_c() {
    run_fixed(FIXED_SEEDS[2]);
}

/// Chosen from a sweep of 9000..9029: each runs every kind of step, a mid-answer drop fires, and
/// on the engine as of this test's introduction they fail in different ways (9002: live
/// `since` drops backdated events, Layer 1 history cut mid-answer, self-subscription misses
/// forwarded roots; 9003: a CLOSED confirmed batch query is never reopened, plus Layer 1 and
/// self-subscription losses; 9024: the own relay's history cut mid-answer).
const FIXED_SEEDS: [u64; 3] = [9002, 9003, 9024];

// ----- the replicated shape (issue 33): fixed seeds of the normal suite -----

#[test]
fn replicated_seed_a() {
    run_fixed_shape(REPLICATED_SEEDS[0], true);
}

#[test]
fn replicated_seed_b() {
    run_fixed_shape(REPLICATED_SEEDS[1], true);
}

/// Seeds of the replicated shape: each puts every repository on two to four relays, most of
/// them LocalRelays.
const REPLICATED_SEEDS: [u64; 2] = [9002, 9013];

fn run_fixed(seed: u64) {
    run_fixed_shape(seed, false);
}

fn run_fixed_shape(seed: u64, replicated: bool) {
    init_logging();
    let deadline = env_secs("GRASP_SYNC_FAULT_DEADLINE").unwrap_or(FIXED_DEADLINE);
    if let Err(report) = run_shape(seed, replicated, steps(), deadline) {
        panic!("{report}");
    }
}

/// Seeds from the environment: `GRASP_SYNC_FAULT_SEED` (one), or `GRASP_SYNC_FAULT_SEEDS`
/// seeds from `GRASP_SYNC_FAULT_BASE`. Without either, returns at once.
#[test]
fn seeds_from_env() {
    let seeds: Vec<u64> = if let Some(one) = env_u64("GRASP_SYNC_FAULT_SEED") {
        vec![one]
    } else if let Some(n) = env_u64("GRASP_SYNC_FAULT_SEEDS") {
        let base = env_u64("GRASP_SYNC_FAULT_BASE").unwrap_or(0);
        (base..base + n).collect()
    } else {
        return;
    };
    init_logging();
    let deadline = env_secs("GRASP_SYNC_FAULT_DEADLINE").unwrap_or(ENV_DEADLINE);
    let replicated = env_u64("GRASP_SYNC_FAULT_REPLICATED").is_some_and(|v| v != 0);
    let mut failed: Vec<u64> = Vec::new();
    for &seed in &seeds {
        let started = Instant::now();
        match run_shape(seed, replicated, steps(), deadline) {
            Ok(summary) => eprintln!(
                "fault seed {seed}: ok in {:.1} s ({summary})",
                started.elapsed().as_secs_f64()
            ),
            Err(report) => {
                eprintln!("{report}");
                failed.push(seed);
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} fault seeds failed: {failed:?}",
        failed.len(),
        seeds.len()
    );
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn env_secs(name: &str) -> Option<Duration> {
    env_u64(name).map(Duration::from_secs)
}

fn steps() -> usize {
    env_u64("GRASP_SYNC_FAULT_STEPS").map_or(DEFAULT_STEPS, |n| n as usize)
}

// ----- the world -----

/// Where an event is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Place {
    Own,
    Remote(usize),
}

impl Place {
    fn label(self) -> String {
        match self {
            Place::Own => "own".to_string(),
            Place::Remote(i) => format!("R{i}"),
        }
    }
}

/// What the test knows about an event it made.
#[derive(Debug, Clone)]
struct Info {
    name: String,
    kind: u16,
    created_at: u64,
    places: Vec<Place>,
    /// The fault step at which it was published (`None`: before the engine started).
    step: Option<usize>,
    /// When it was published.
    at: Instant,
}

struct Repo {
    coord: String,
    relays: Vec<usize>,
}

/// Counts of the faults that actually happened.
#[derive(Debug, Default)]
struct Faults {
    restart_remote: u32,
    restart_own: u32,
    drop_remote: u32,
    drop_own: u32,
    mid_answer_armed: u32,
    mid_answer_fired: u64,
    closed: u32,
    caps: u32,
    new_events: u32,
    backdated_events: u32,
    own_events: u32,
    noise: u32,
}

impl Faults {
    fn summary(&self) -> String {
        format!(
            "restarts remote {} own {}, drops remote {} own {}, mid-answer drops {} (armed {}), \
             CLOSED {}, cap changes {}, published new {} backdated {} on own {} noise {}",
            self.restart_remote,
            self.restart_own,
            self.drop_remote,
            self.drop_own,
            self.mid_answer_fired,
            self.mid_answer_armed,
            self.closed,
            self.caps,
            self.new_events,
            self.backdated_events,
            self.own_events,
            self.noise
        )
    }
}

struct World {
    seed: u64,
    /// The replicated shape (issue 33): every repository on 2–4 relays, each of which holds
    /// everything of it (copies of every event race in from all of them), most relays with
    /// LocalRelay's answers (NIP-77 found without NIP-11).
    replicated: bool,
    rng: StdRng,
    /// The profile of each remote relay (`None`: the plain `TestRelay`).
    profiles: Vec<Option<Profile>>,
    own: Option<TestRelay>,
    remotes: Vec<Option<TestRelay>>,
    remote_urls: Vec<String>,
    own_url: String,
    repos: Vec<Repo>,
    /// Root events, with the index of their repository.
    roots: Vec<(Event, usize)>,
    /// Every event the test made.
    info: HashMap<EventId, Info>,
    /// Events the test stored on the own relay itself.
    on_own: Vec<Event>,
    used_ts: HashSet<u64>,
    base: u64,
    step: Option<usize>,
    counter: u64,
    faults: Faults,
    log: Vec<String>,
    /// Subscriptions the test closed with CLOSED: where, connection, id, filters, message.
    closed: Vec<(Place, u64, String, Vec<nostr::filter::Filter>, &'static str)>,
}

fn keys_from(rng: &mut StdRng) -> Keys {
    loop {
        let bytes: [u8; 32] = rng.random();
        if let Ok(sk) = SecretKey::from_slice(&bytes) {
            return Keys::new(sk);
        }
    }
}

fn signed(keys: &Keys, kind: u16, content: &str, tags: &[Vec<String>], at: u64) -> Event {
    let mut b =
        EventBuilder::new(Kind::Custom(kind), content).custom_created_at(Timestamp::from_secs(at));
    for t in tags {
        b = b.tag(Tag::parse(t.iter().map(String::as_str)).unwrap());
    }
    b.finalize(keys).unwrap()
}

fn tag(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| s.to_string()).collect()
}

/// When an event is dated.
#[derive(Debug, Clone, Copy)]
enum Age {
    /// Before the engine started: 1 hour to 40 days old.
    History,
    /// Now (unique seconds, so possibly a few seconds ahead).
    New,
    /// Backdated: 16 minutes to 40 days old.
    Backdated,
}

impl World {
    fn new(seed: u64, replicated: bool) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        // Each remote relay behaves like a real one, chosen by the seed (issue 19); in the
        // replicated shape three in four are LocalRelays.
        let profiles: Vec<Option<Profile>> = (0..REMOTES)
            .map(|_| match rng.random_range(0..5) {
                _ if replicated && rng.random_bool(0.75) => Some(Profile::LocalRelay),
                0 => None,
                1 => Some(Profile::NostrRsRelay),
                2 => Some(Profile::Strfry),
                3 => Some(Profile::LocalRelay),
                _ => Some(Profile::Nip77Refusing { silent: true }),
            })
            .collect();
        let own = TestRelay::start();
        let remotes: Vec<TestRelay> = profiles
            .iter()
            .map(|p| match p {
                Some(p) => TestRelay::start_with(TestRelayOptions::profile(p.clone())),
                None => TestRelay::start(),
            })
            .collect();
        let log = profiles
            .iter()
            .enumerate()
            .map(|(i, p)| format!("setup: R{i} profile {p:?}"))
            .collect();
        World {
            seed,
            replicated,
            rng,
            profiles,
            own_url: own.url(),
            remote_urls: remotes.iter().map(TestRelay::url).collect(),
            own: Some(own),
            remotes: remotes.into_iter().map(Some).collect(),
            repos: Vec::new(),
            roots: Vec::new(),
            info: HashMap::new(),
            on_own: Vec::new(),
            used_ts: HashSet::new(),
            base: Timestamp::now().as_secs(),
            step: None,
            counter: 0,
            faults: Faults::default(),
            log,
            closed: Vec::new(),
        }
    }

    /// Sets the result cap of `p`, except on a relay with strfry's profile: strfry caps at
    /// the `max_limit` its NIP-11 publishes (500), and a cap below it would be a relay that
    /// lies about its limit.
    fn set_cap(&mut self, p: Place, cap: Option<usize>) -> bool {
        if let Place::Remote(i) = p {
            if self.profiles[i] == Some(Profile::Strfry) {
                return false;
            }
        }
        self.relay(p).set_result_cap(cap);
        true
    }

    fn own(&self) -> &TestRelay {
        self.own.as_ref().expect("own relay running")
    }

    fn remote(&self, i: usize) -> &TestRelay {
        self.remotes[i].as_ref().expect("remote relay running")
    }

    fn relay(&self, p: Place) -> &TestRelay {
        match p {
            Place::Own => self.own(),
            Place::Remote(i) => self.remote(i),
        }
    }

    fn note(&mut self, what: String) {
        let step = self
            .step
            .map_or("setup".to_string(), |s| format!("step {s}"));
        self.log.push(format!("{step}: {what}"));
    }

    /// A `created_at` no other event of the world has (so no second holds more events than
    /// a page: the engine's documented same-second limit is not what this test is about).
    fn ts(&mut self, age: Age) -> u64 {
        let mut t = match age {
            Age::History => self.base - self.rng.random_range(3_600..40 * DAY),
            Age::Backdated => {
                if self.rng.random_bool(0.5) {
                    Timestamp::now().as_secs() - self.rng.random_range(16 * 60..2 * 3_600)
                } else {
                    self.base - self.rng.random_range(DAY..40 * DAY)
                }
            }
            Age::New => Timestamp::now().as_secs(),
        };
        while !self.used_ts.insert(t) {
            t += 1;
        }
        t
    }

    fn uniq(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    /// Stores `e` on `places` (live delivery to open subscriptions) and records it.
    fn put(&mut self, name: String, e: &Event, places: &[Place]) {
        for &p in places {
            self.relay(p).insert(e);
            if p == Place::Own {
                self.on_own.push(e.clone());
            }
        }
        let step = self.step;
        let entry = self.info.entry(e.id).or_insert_with(|| Info {
            name,
            kind: e.kind.as_u16(),
            created_at: e.created_at.as_secs(),
            places: Vec::new(),
            step,
            at: Instant::now(),
        });
        entry.places.extend_from_slice(places);
    }

    /// A random non-empty subset of the relays of repository `r`.
    fn some_relays_of(&mut self, r: usize) -> Vec<Place> {
        let relays = self.repos[r].relays.clone();
        if self.replicated {
            return relays.iter().map(|&i| Place::Remote(i)).collect();
        }
        let mut out: Vec<Place> = relays
            .iter()
            .filter(|_| self.rng.random_bool(0.5))
            .map(|&i| Place::Remote(i))
            .collect();
        if out.is_empty() {
            let i = relays[self.rng.random_range(0..relays.len())];
            out.push(Place::Remote(i));
        }
        out
    }

    fn random_remote(&mut self) -> usize {
        self.rng.random_range(0..REMOTES)
    }

    // ----- setup -----

    fn setup(&mut self) {
        let n_repos = self.rng.random_range(3..=5);
        for r in 0..n_repos {
            let keys = keys_from(&mut self.rng);
            let d = format!("repo{r}");
            let coord = format!("30617:{}:{d}", keys.public_key().to_hex());
            let mut relays: Vec<usize> =
                (0..REMOTES).filter(|_| self.rng.random_bool(0.4)).collect();
            if relays.is_empty() {
                relays.push(self.random_remote());
            }
            if self.replicated {
                // 2–4 relays, each holding everything of the repository.
                relays = (0..REMOTES).collect();
                relays.shuffle(&mut self.rng);
                relays.truncate(self.rng.random_range(2..=REMOTES.min(4)));
                relays.sort_unstable();
            }
            let mut relay_tags: Vec<String> = relays
                .iter()
                .map(|&i| self.remote_urls[i].clone())
                .collect();
            if self.rng.random_bool(0.3) {
                relay_tags.insert(0, self.own_url.clone());
            }
            let mut tags = vec![tag(&["d", &d]), tag(&["name", &d])];
            // Half the time all URLs in one `relays` tag, else one tag per URL.
            if self.rng.random_bool(0.5) {
                let mut t = vec!["relays".to_string()];
                t.extend(relay_tags);
                tags.push(t);
            } else {
                for u in relay_tags {
                    tags.push(vec!["relays".to_string(), u]);
                }
            }
            let at = self.ts(Age::History);
            let ann = signed(&keys, 30617, "", &tags, at);
            self.repos.push(Repo {
                coord: coord.clone(),
                relays: relays.clone(),
            });
            // The first repository is always on the own relay; others may be announced only
            // on a remote relay (found through Layer 1 if some repository names that relay).
            let mut places: Vec<Place> = Vec::new();
            if r == 0 || self.rng.random_bool(0.6) {
                places.push(Place::Own);
            }
            places.extend(self.some_relays_of(r));
            self.put(format!("announcement {d} {relays:?}"), &ann, &places);

            let at = self.ts(Age::History);
            let state = signed(
                &keys,
                30618,
                "",
                &[
                    tag(&["d", &d]),
                    tag(&[
                        "refs/heads/main",
                        "4b825dc642cb6eb9a060e54bf8d69288fbee4904",
                    ]),
                ],
                at,
            );
            let places = self.some_relays_of(r);
            self.put(format!("state {d}"), &state, &places);

            for _ in 0..self.rng.random_range(3..=6) {
                self.publish_root(r, Age::History, false);
            }
        }
        // Threads on the roots.
        for _ in 0..self.rng.random_range(25..=45) {
            self.publish_thread_event(Age::History);
        }
        for _ in 0..self.rng.random_range(4..=8) {
            self.publish_noise(Age::History);
        }
        for i in 0..REMOTES {
            let cap = CAPS[self.rng.random_range(0..CAPS.len())];
            if self.set_cap(Place::Remote(i), cap) {
                self.note(format!("R{i} cap {cap:?}"));
            }
        }
        // The first sync reads whole histories: cut some of them mid-answer (always one
        // remote relay).
        let always = self.random_remote();
        for p in std::iter::once(Place::Own).chain((0..REMOTES).map(Place::Remote)) {
            if p == Place::Remote(always) || self.rng.random_bool(0.3) {
                let after = self.rng.random_range(1..=3);
                self.relay(p).set_drop_mid_answer(Some(after));
                self.faults.mid_answer_armed += 1;
                self.note(format!(
                    "arm mid-answer drop on {} after {after}",
                    p.label()
                ));
            }
        }
    }

    /// A new root event of repository `r`: on the own relay (`on_own`, or sometimes anyway
    /// at setup) or on some of its relays.
    fn publish_root(&mut self, r: usize, age: Age, on_own: bool) {
        let kind = [1617u16, 1618, 1621, 1621][self.rng.random_range(0..4)];
        let n = self.uniq();
        let at = self.ts(age);
        let coord = self.repos[r].coord.clone();
        let author = keys_from(&mut self.rng);
        let e = signed(
            &author,
            kind,
            &format!("root {n}"),
            &[tag(&["a", &coord]), tag(&["subject", &format!("root {n}")])],
            at,
        );
        let places = if on_own || (matches!(age, Age::History) && self.rng.random_bool(0.3)) {
            vec![Place::Own]
        } else {
            self.some_relays_of(r)
        };
        self.put(
            format!("root {n} kind {kind} of repo{r} ({age:?})"),
            &e,
            &places,
        );
        self.roots.push((e, r));
    }

    /// A reply, status, repository comment or quote on the relays of a random repository.
    fn publish_thread_event(&mut self, age: Age) {
        if self.roots.is_empty() {
            return;
        }
        let (root, r) = self.roots[self.rng.random_range(0..self.roots.len())].clone();
        let n = self.uniq();
        let at = self.ts(age);
        let author = keys_from(&mut self.rng);
        let id = root.id.to_hex();
        let k = root.kind.as_u16().to_string();
        let coord = self.repos[r].coord.clone();
        let (kind, tags, what) = match self.rng.random_range(0..6) {
            0 => (
                1111,
                vec![
                    tag(&["E", &id]),
                    tag(&["K", &k]),
                    tag(&["e", &id]),
                    tag(&["k", &k]),
                ],
                "comment E",
            ),
            1 => (1622, vec![tag(&["e", &id, "", "root"])], "reply e"),
            2 => {
                let kind = [1630u16, 1631, 1632][self.rng.random_range(0..3)];
                (kind, vec![tag(&["e", &id, "", "root"])], "status")
            }
            3 => (
                1111,
                vec![tag(&["A", &coord]), tag(&["K", "30617"])],
                "repo comment A",
            ),
            4 => (1, vec![tag(&["q", &id])], "quote q root"),
            _ => (1, vec![tag(&["q", &coord])], "quote q repo"),
        };
        let e = signed(&author, kind, &format!("{what} {n}"), &tags, at);
        let places = self.some_relays_of(r);
        self.put(
            format!("{what} {n} kind {kind} on root of repo{r} ({age:?})"),
            &e,
            &places,
        );
    }

    /// Events no repository relates to, or related ones on a relay not listed for them.
    fn publish_noise(&mut self, age: Age) {
        let n = self.uniq();
        let at = self.ts(age);
        let author = keys_from(&mut self.rng);
        let i = self.random_remote();
        let (kind, tags, what) = match self.rng.random_range(0..4) {
            0 => (1u16, vec![tag(&["t", "nostr"])], "noise note".to_string()),
            1 => {
                let ghost: [u8; 32] = self.rng.random();
                let ghost: String = ghost.iter().map(|b| format!("{b:02x}")).collect();
                (
                    1111,
                    vec![tag(&["E", &ghost]), tag(&["K", "1621"])],
                    "noise comment on an unknown id".to_string(),
                )
            }
            2 => {
                let ghost = format!("30617:{}:ghost", author.public_key().to_hex());
                (
                    1621,
                    vec![tag(&["a", &ghost])],
                    "noise issue of an unannounced repo".to_string(),
                )
            }
            _ => {
                // An issue of a repository on a random relay: expected only if the
                // repository lists that relay (Layer 2 asks a relay only for the
                // repositories that list it); the model decides.
                let r = self.rng.random_range(0..self.repos.len());
                let coord = self.repos[r].coord.clone();
                (
                    1621,
                    vec![tag(&["a", &coord])],
                    format!("issue of repo{r} on a relay it may not list"),
                )
            }
        };
        let e = signed(&author, kind, &format!("{what} {n}"), &tags, at);
        self.put(format!("{what} {n} ({age:?})"), &e, &[Place::Remote(i)]);
    }

    // ----- faults -----

    fn restart(&mut self, p: Place) {
        let slot = match p {
            Place::Own => &mut self.own,
            Place::Remote(i) => &mut self.remotes[i],
        };
        let relay = slot.take().expect("relay running");
        self.faults.mid_answer_fired += relay.mid_answer_drops();
        // Stop first, then copy the store: nothing can be written in between.
        relay.stop();
        let opts = relay.options();
        let store = relay.raw_events();
        let port = relay.port();
        drop(relay);
        let down = Duration::from_millis(self.rng.random_range(0..300));
        thread::sleep(down);
        let relay = TestRelay::start_with_store(port, opts, store).unwrap_or_else(|e| {
            panic!(
                "seed {}: cannot restart {} on port {port}: {e}",
                self.seed,
                p.label()
            )
        });
        *match p {
            Place::Own => &mut self.own,
            Place::Remote(i) => &mut self.remotes[i],
        } = Some(relay);
        self.note(format!("restart {} (down {down:?})", p.label()));
    }

    fn random_place(&mut self, own_weight: f64) -> Place {
        if self.rng.random_bool(own_weight) {
            Place::Own
        } else {
            Place::Remote(self.random_remote())
        }
    }

    /// One step; `what` is a code in 0..20 (random steps draw it uniformly, so the width of
    /// each range is its weight; see [`FORCED_STEPS`]).
    fn fault_step(&mut self, what: u32) {
        match what {
            0..=3 => {
                self.publish_live(Age::New);
                self.faults.new_events += 1;
            }
            4..=6 => {
                self.publish_live(Age::Backdated);
                self.faults.backdated_events += 1;
            }
            7 => {
                let r = self.rng.random_range(0..self.repos.len());
                let age = if self.rng.random_bool(0.5) {
                    Age::New
                } else {
                    Age::Backdated
                };
                self.publish_root(r, age, true);
                self.faults.own_events += 1;
                self.note(format!("root on own ({age:?})"));
            }
            8 => {
                let age = if self.rng.random_bool(0.5) {
                    Age::New
                } else {
                    Age::Backdated
                };
                self.publish_noise(age);
                self.faults.noise += 1;
            }
            9 | 10 => {
                let i = self.random_remote();
                self.restart(Place::Remote(i));
                self.faults.restart_remote += 1;
            }
            11 => {
                self.restart(Place::Own);
                self.faults.restart_own += 1;
            }
            12 | 13 => {
                let p = if what == 13 {
                    Place::Own
                } else {
                    Place::Remote(self.random_remote())
                };
                self.relay(p).drop_connections();
                match p {
                    Place::Own => self.faults.drop_own += 1,
                    Place::Remote(_) => self.faults.drop_remote += 1,
                }
                self.note(format!("drop connections of {}", p.label()));
            }
            14 | 15 => {
                // Mid-answer: make the relay capped if it is not, arm, and usually drop its
                // connections so that the reconnect asks for history at once.
                let p = self.random_place(0.2);
                let cap = self.relay(p).options().result_cap;
                let cap = match cap {
                    Some(c) => c,
                    None => {
                        let c = [PAGE, 6, 9][self.rng.random_range(0..3)];
                        self.relay(p).set_result_cap(Some(c));
                        c
                    }
                };
                let after = self.rng.random_range(1..cap.min(3));
                self.relay(p).set_drop_mid_answer(Some(after));
                let provoke = self.rng.random_bool(0.7);
                if provoke {
                    self.relay(p).drop_connections();
                }
                self.faults.mid_answer_armed += 1;
                self.note(format!(
                    "arm mid-answer drop on {} after {after} of cap {cap}{}",
                    p.label(),
                    if provoke { ", drop connections" } else { "" }
                ));
            }
            16 | 17 => {
                // The same draws whatever is open (the schedule must not depend on timing):
                // the drawn relay, or the next one with an open subscription.
                let mut p = self.random_place(0.2);
                let pick: usize = self.rng.random_range(0..1 << 20);
                let msg = [
                    "error: shutting down idle subscription",
                    "rate-limited: slow down",
                    "restricted: not now",
                ][self.rng.random_range(0..3)];
                let order: Vec<Place> = std::iter::once(Place::Own)
                    .chain((0..REMOTES).map(Place::Remote))
                    .collect();
                let start = order.iter().position(|q| *q == p).unwrap_or(0);
                let mut subs = Vec::new();
                for k in 0..order.len() {
                    p = order[(start + k) % order.len()];
                    subs = self.relay(p).subscription_ids();
                    if !subs.is_empty() {
                        break;
                    }
                }
                if subs.is_empty() {
                    self.note("CLOSED: no subscription open anywhere".to_string());
                } else {
                    let (conn, sub) = subs[pick % subs.len()].clone();
                    let filters = self
                        .relay(p)
                        .reqs()
                        .into_iter()
                        .rev()
                        .find(|r| r.conn == conn && r.sub_id == sub)
                        .map(|r| r.filters)
                        .unwrap_or_default();
                    if self.relay(p).send_closed(conn, &sub, msg) {
                        self.faults.closed += 1;
                        self.closed.push((p, conn, sub.clone(), filters, msg));
                    }
                    self.note(format!("CLOSED {sub} on {} ({msg})", p.label()));
                }
            }
            _ => {
                let p = self.random_place(0.2);
                let cap = CAPS[self.rng.random_range(0..CAPS.len())];
                if self.set_cap(p, cap) {
                    self.faults.caps += 1;
                    self.note(format!("cap {} = {cap:?}", p.label()));
                }
            }
        }
    }

    /// A new root, a thread event, or (rarely) a new repository announced on a remote relay.
    fn publish_live(&mut self, age: Age) {
        match self.rng.random_range(0..10) {
            0..=2 => {
                let r = self.rng.random_range(0..self.repos.len());
                self.publish_root(r, age, false);
                self.note(format!("root on remote ({age:?})"));
            }
            _ => {
                self.publish_thread_event(age);
                self.note(format!("thread event ({age:?})"));
            }
        }
    }

    /// After convergence: a repository comment (`A`) published live on every remote relay
    /// that an announcement on the own relay lists, in the expected set by the same rule as
    /// any other. It reaches the engine behind whatever that relay sent before it, and the own
    /// relay the same way, so once every marker is stored nothing sent earlier is still on
    /// its way.
    fn publish_markers(&mut self) {
        let mut coord_of: BTreeMap<usize, String> = BTreeMap::new();
        for e in self.own().events() {
            if e.kind.as_u16() != 30617 {
                continue;
            }
            let coord = format!(
                "30617:{}:{}",
                e.pubkey.to_hex(),
                first_value(&e, "d").unwrap_or_default()
            );
            for t in e.tags.iter().filter(|t| t.kind() == "relays") {
                for u in t.as_slice().iter().skip(1) {
                    if let Some(i) = self.remote_urls.iter().position(|r| r == u) {
                        coord_of.entry(i).or_insert_with(|| coord.clone());
                    }
                }
            }
        }
        for (i, coord) in coord_of {
            let n = self.uniq();
            let at = self.ts(Age::New);
            let author = keys_from(&mut self.rng);
            let tags = [tag(&["A", &coord]), tag(&["K", "30617"])];
            let e = signed(&author, 1111, &format!("marker {n}"), &tags, at);
            self.put(format!("marker {n} on remote {i}"), &e, &[Place::Remote(i)]);
        }
    }

    // ----- the expected set -----

    /// The closure the engine must copy to the own relay, from the relays' current stores.
    fn expected(&self) -> HashSet<EventId> {
        let stores: Vec<Vec<Event>> = (0..REMOTES).map(|i| self.remote(i).events()).collect();
        let url_index: HashMap<&str, usize> = self
            .remote_urls
            .iter()
            .enumerate()
            .map(|(i, u)| (u.as_str(), i))
            .collect();
        let mut own: HashMap<EventId, Event> =
            self.on_own.iter().map(|e| (e.id, e.clone())).collect();
        loop {
            // Repositories announced on the own relay and their remote relays.
            let mut repo_relays: HashMap<String, HashSet<usize>> = HashMap::new();
            for e in own.values().filter(|e| e.kind.as_u16() == 30617) {
                let d = first_value(e, "d").unwrap_or_default();
                let coord = format!("30617:{}:{d}", e.pubkey.to_hex());
                let relays = repo_relays.entry(coord).or_default();
                for t in e.tags.iter().filter(|t| t.kind() == "relays") {
                    for u in t.as_slice().iter().skip(1) {
                        if let Some(&i) = url_index.get(u.as_str()) {
                            relays.insert(i);
                        }
                    }
                }
            }
            // Root events on the own relay, by repository.
            let mut roots_of: HashMap<String, HashSet<String>> = HashMap::new();
            for e in own
                .values()
                .filter(|e| ROOT_KINDS.contains(&e.kind.as_u16()))
            {
                for t in e.tags.iter().filter(|t| t.kind() == "a") {
                    if let Some(coord) = t.content() {
                        roots_of
                            .entry(coord.to_string())
                            .or_default()
                            .insert(e.id.to_hex());
                    }
                }
            }
            // Replies followed below them (decision 0097): an event on the own relay tagging
            // (`e`/`E`/`q`) a root event or a reply followed, a deletion excepted; the
            // world's threads are far within the bounds.
            loop {
                let mut grew = false;
                for ids in roots_of.values_mut() {
                    for e in own.values().filter(|e| e.kind.as_u16() != 5) {
                        let id = e.id.to_hex();
                        if ids.contains(&id) {
                            continue;
                        }
                        let tags_one = e.tags.iter().any(|t| {
                            matches!(t.as_slice()[0].as_str(), "e" | "E" | "q")
                                && ids.contains(t.content().unwrap_or_default())
                        });
                        if tags_one {
                            ids.insert(id);
                            grew = true;
                        }
                    }
                }
                if !grew {
                    break;
                }
            }
            let mut added = false;
            for (i, store) in stores.iter().enumerate() {
                let repos: HashSet<&str> = repo_relays
                    .iter()
                    .filter(|(_, rs)| rs.contains(&i))
                    .map(|(c, _)| c.as_str())
                    .collect();
                if repos.is_empty() {
                    continue;
                }
                let roots: HashSet<&str> = repos
                    .iter()
                    .filter_map(|c| roots_of.get(*c))
                    .flatten()
                    .map(String::as_str)
                    .collect();
                for e in store {
                    if own.contains_key(&e.id) {
                        continue;
                    }
                    let kind = e.kind.as_u16();
                    let wanted = kind == 30617
                        || kind == 30618
                        || kind == 10317
                        || e.tags.iter().any(|t| {
                            let v = t.content().unwrap_or_default();
                            match t.as_slice()[0].as_str() {
                                "a" | "A" => repos.contains(v),
                                "e" | "E" => roots.contains(v),
                                "q" => repos.contains(v) || roots.contains(v),
                                _ => false,
                            }
                        });
                    if wanted {
                        own.insert(e.id, e.clone());
                        added = true;
                    }
                }
            }
            if !added {
                return own.into_keys().collect();
            }
        }
    }

    fn describe(&self, id: &EventId) -> String {
        match self.info.get(id) {
            Some(i) => {
                let age = self.base as i64 - i.created_at as i64;
                let places: Vec<String> = i.places.iter().map(|p| p.label()).collect();
                format!(
                    "{} [{}] kind {} created_at {} ({}), on {}, published {}",
                    i.name,
                    id.to_hex(),
                    i.kind,
                    i.created_at,
                    if age >= 0 {
                        format!("{age} s before the start")
                    } else {
                        format!("{} s after the start", -age)
                    },
                    places.join(","),
                    i.step
                        .map_or("before the start".to_string(), |s| format!("at step {s}")),
                )
            }
            None => format!("<not made by the test> {}", id.to_hex()),
        }
    }
}

/// What the subscriptions of `relay` say about `event`: the open ones matching it, those
/// matching it but for `since`/`until` (with the filter), and the REQs received at or after
/// `published` that match it.
struct SubEvidence {
    open: usize,
    full: Vec<String>,
    but_time: Vec<String>,
    reqs_after: usize,
    matched_after: Vec<String>,
}

fn sub_evidence(relay: &TestRelay, event: &Event, published: Instant) -> SubEvidence {
    let loose = MatchEventOptions::new().since(false).until(false);
    let reqs = relay.reqs();
    let open = relay.subscription_ids();
    let mut ev = SubEvidence {
        open: open.len(),
        full: Vec::new(),
        but_time: Vec::new(),
        reqs_after: 0,
        matched_after: Vec::new(),
    };
    for (conn, sub) in &open {
        let filters = reqs
            .iter()
            .rev()
            .find(|r| r.conn == *conn && r.sub_id == *sub)
            .map(|r| r.filters.clone())
            .unwrap_or_default();
        if filters
            .iter()
            .any(|f| f.match_event(event, MatchEventOptions::new()))
        {
            ev.full.push(sub.clone());
        } else if let Some(f) = filters.iter().find(|f| f.match_event(event, loose)) {
            ev.but_time.push(format!("{sub} {}", f.as_json()));
        }
    }
    for r in reqs.iter().filter(|r| r.at >= published) {
        ev.reqs_after += 1;
        if r.filters
            .iter()
            .any(|f| f.match_event(event, MatchEventOptions::new()))
        {
            ev.matched_after.push(r.sub_id.clone());
        }
    }
    ev
}

impl SubEvidence {
    fn line(&self, label: &str) -> String {
        format!(
            "      {label}: {} open subscription(s); matching it: {:?}; matching but for \
             since/until: {:?}; REQs since it was published (this run of the relay): {}, \
             matching it: {:?}\n",
            self.open, self.full, self.but_time, self.reqs_after, self.matched_after
        )
    }
}

/// Evidence for a missing event, from the REQs its relays recorded and the engine's
/// repository index, with a hint at the cause.
fn evidence(w: &World, id: &EventId, engine: &EngineView) -> String {
    let Some(info) = w.info.get(id) else {
        return String::new();
    };
    let Some(event) = info
        .places
        .iter()
        .find_map(|&p| w.relay(p).events().into_iter().find(|e| e.id == *id))
    else {
        return "      (not stored anywhere)\n".to_string();
    };
    let mut out = String::new();
    let own_ids = w.own().event_ids();
    let referenced: Vec<EventId> = event
        .tags
        .iter()
        .filter(|t| matches!(t.as_slice()[0].as_str(), "e" | "E" | "q"))
        .filter_map(|t| t.content())
        .filter_map(|v| EventId::from_hex(v).ok())
        .filter(|r| w.info.contains_key(r))
        .collect::<std::collections::BTreeSet<EventId>>()
        .into_iter()
        .collect();
    for r in &referenced {
        let name = w.describe(r);
        if !own_ids.contains(r) {
            let _ = writeln!(
                out,
                "      hint: follows from its missing root event {name:?}"
            );
        } else if !engine.roots.contains(r) {
            let _ = writeln!(
                out,
                "      hint: its root event {name:?} is on the own relay, but the engine never \
                 learned it as a root (the self-subscription did not deliver it)"
            );
            let root_info = &w.info[r];
            if let Some(root) = w.own().events().into_iter().find(|e| e.id == *r) {
                let ev = sub_evidence(w.own(), &root, root_info.at);
                out.push_str(&ev.line("own relay, for the root"));
            }
        }
    }
    let coords: Vec<&str> = event
        .tags
        .iter()
        .filter(|t| matches!(t.as_slice()[0].as_str(), "a" | "A" | "q"))
        .filter_map(|t| t.content())
        .filter(|v| v.starts_with("30617:"))
        .collect();
    for coord in coords {
        if engine.announced.contains(coord) {
            continue;
        }
        let ann = w.info.iter().find(|(_, i)| {
            i.kind == 30617
                && i.name
                    .starts_with(&format!("announcement {} ", repo_d(coord)))
        });
        if let Some((ann_id, _)) = ann.filter(|(a, _)| own_ids.contains(a)) {
            let _ = writeln!(
                out,
                "      hint: its repository's announcement is on the own relay, but the engine \
                 never learned it (the self-subscription did not deliver it): {}",
                w.describe(ann_id)
            );
            if let Some(a) = w.own().events().into_iter().find(|e| e.id == *ann_id) {
                let ev = sub_evidence(w.own(), &a, w.info[ann_id].at);
                out.push_str(&ev.line("own relay, for the announcement"));
            }
        }
    }
    for &p in &info.places {
        if p == Place::Own {
            continue;
        }
        if !engine.relays.contains(&p) {
            let _ = writeln!(
                out,
                "      hint ({}): the engine does not sync this relay at all (no repository it \
                 knows lists it)",
                p.label()
            );
        }
        let ev = sub_evidence(w.relay(p), &event, info.at);
        let hint = if !ev.full.is_empty() {
            "an open subscription matches it, yet it did not arrive"
        } else if !ev.but_time.is_empty() && info.step.is_some() {
            "published live; the only subscriptions that would carry it have a since/until \
             that excludes it"
        } else if info.step.is_none() {
            "stored history that was never read completely"
        } else if ev.matched_after.is_empty() {
            "published live; no open subscription and no later REQ covers it"
        } else {
            "a REQ after its publication matched it, yet it did not arrive"
        };
        let _ = writeln!(out, "      hint ({}): {hint}", p.label());
        out.push_str(&ev.line(&p.label()));
    }
    out
}

/// For each subscription the test closed with CLOSED on a connection that is still open:
/// whether the engine opened a subscription with the same filter again (`since`, `until` and
/// `limit` aside).
fn closed_evidence(w: &World) -> String {
    fn shape(f: &nostr::filter::Filter) -> String {
        let mut v: serde_json::Value = serde_json::from_str(&f.as_json()).unwrap();
        if let Some(o) = v.as_object_mut() {
            o.remove("since");
            o.remove("until");
            o.remove("limit");
        }
        v.to_string()
    }
    let mut out = String::new();
    for (p, conn, sub, filters, msg) in &w.closed {
        let relay = w.relay(*p);
        let open = relay.subscription_ids();
        if !open.iter().any(|(c, _)| c == conn) {
            continue; // that connection is gone; a new one subscribed afresh
        }
        let reqs = relay.reqs();
        let wanted: HashSet<String> = filters.iter().map(shape).collect();
        let reopened = open.iter().any(|(c, s)| {
            c == conn
                && reqs
                    .iter()
                    .rev()
                    .find(|r| r.conn == *c && r.sub_id == *s)
                    .is_some_and(|r| r.filters.iter().any(|f| wanted.contains(&shape(f))))
        });
        if !reopened {
            let json: Vec<String> = filters.iter().map(|f| f.as_json()).collect();
            let _ = writeln!(
                out,
                "  CLOSED {sub} on {} ({msg}) was never replaced on the same connection: {}",
                p.label(),
                json.join(" ")
            );
        }
    }
    if out.is_empty() {
        out
    } else {
        format!("closed subscriptions not reopened:\n{out}")
    }
}

/// What the engine knows, read from its repository index.
struct EngineView {
    roots: HashSet<EventId>,
    /// Repositories whose announcement it applied.
    announced: HashSet<String>,
    /// Remote relays its repositories list.
    relays: HashSet<Place>,
}

/// The `d` of a repository coordinate.
fn repo_d(coord: &str) -> &str {
    coord.splitn(3, ':').nth(2).unwrap_or_default()
}

fn url_eq(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

fn first_value(e: &Event, name: &str) -> Option<String> {
    e.tags
        .iter()
        .find(|t| t.as_slice()[0] == name)
        .and_then(|t| t.content())
        .map(str::to_string)
}

fn engine_config(world: &World) -> Config {
    let mut config = Config::new(url(world.own()))
        .batch_window(Duration::from_millis(100))
        .eose_timeout(Duration::from_secs(3))
        .allow_private_relays(true);
    config.backoff.base = Duration::from_millis(100);
    config.backoff.max = Duration::from_secs(1);
    config.rate_limit_cooldown = Duration::from_secs(1);
    config.refused_retry = Duration::from_secs(1);
    config.consolidation_wait = Duration::from_secs(2);
    config.poll_interval = Duration::from_secs(2);
    config.nip11_timeout = Duration::from_secs(1);
    // Scaled down like the other deadlines: a relay that lists NIP-77 and never answers
    // holds a batch for one round's deadline (30 s by default) until it is known silent, and
    // a batch for replies followed after a reconnect may be the first to find out.
    config.nip77.round_timeout = Duration::from_secs(3);
    config.assumed_page_size = PAGE;
    config.seed = world.seed;
    config
}

/// True when every remote relay is connected and none has a query loading, waiting in its
/// queue, waiting to be reopened after a CLOSED, or polled (a poll reads from its `since`
/// on: seed 9103 lost a backdated quote published while its root's query was polled).
fn live_everywhere(handle: &grasp_sync::SyncHandle) -> bool {
    handle.status().relays.iter().all(|r| {
        r.connection_status == grasp_sync::core::ConnectionStatus::Connected
            && r.loading_queries == 0
            && r.queued_queries == 0
            && r.reopen_pending == 0
            && r.polled_queries == 0
    })
}

/// Runs one seed; `Ok(fault summary)` or `Err(report)`.
fn run_shape(
    seed: u64,
    replicated: bool,
    steps: usize,
    deadline: Duration,
) -> Result<String, String> {
    let started = Instant::now();
    let mut w = World::new(seed, replicated);
    w.setup();
    let handle = grasp_sync::start(engine_config(&w)).unwrap();
    // Every kind of step once, in a seeded order, then random ones.
    let mut forced = FORCED_STEPS.to_vec();
    forced.shuffle(&mut w.rng);
    for s in 0..steps.max(forced.len()) {
        w.step = Some(s);
        let pause = Duration::from_millis(w.rng.random_range(20..300));
        thread::sleep(pause);
        let what = forced
            .get(s)
            .copied()
            .unwrap_or_else(|| w.rng.random_range(0..20));
        if (4..=6).contains(&what) {
            // A backdated event published on a remote relay while the engine is not
            // connected to it (or before its live subscriptions are open, or while its query
            // is polled for want of room) is older than any catch-up's or poll's `since`:
            // only a full re-read (the daily resync) finds it, which is the documented limit
            // (docs/lifecycle.md). The guarantee tested here is that one published while
            // connected arrives live, so it is published once every relay is connected with
            // its subscriptions in place (the random draws do not change).
            wait_until(Duration::from_secs(15), || live_everywhere(&handle));
        }
        w.fault_step(what);
    }
    w.step = None;
    // The faults end: nothing armed any more (caps stay, as on real relays).
    for p in std::iter::once(Place::Own).chain((0..REMOTES).map(Place::Remote)) {
        w.relay(p).set_drop_mid_answer(None);
        w.faults.mid_answer_fired += w.relay(p).mid_answer_drops();
    }
    let faults_done = Instant::now();
    let mut expected = w.expected();
    let mut converged = wait_until(deadline, || {
        w.own().event_ids() == expected && handle.status().is_settled()
    });
    // Nothing unexpected may trickle in afterwards: not a pause, but markers behind whatever
    // the remote relays sent (`World::publish_markers`), then the exact set again.
    if converged {
        w.publish_markers();
        expected = w.expected();
        converged = wait_until(deadline, || {
            w.own().event_ids() == expected && handle.status().is_settled()
        });
    }
    let actual = w.own().event_ids();
    let ok = converged && actual == expected;
    let took = faults_done.elapsed();
    let summary = w.faults.summary();
    eprintln!(
        "fault seed {seed}: {} events expected, {} on the own relay, {} after the faults \
         ({:.1} s in all); {summary}",
        expected.len(),
        actual.len(),
        if ok {
            format!("converged in {:.1} s", took.as_secs_f64())
        } else {
            format!("NOT converged within {:.0} s", deadline.as_secs_f64())
        },
        started.elapsed().as_secs_f64()
    );
    if ok {
        let r = handle.shutdown(Duration::from_secs(5));
        assert!(r.is_ok(), "seed {seed}: shutdown failed: {r:?}");
        return Ok(summary);
    }
    let mut report = String::new();
    let _ = writeln!(
        report,
        "fault seed {seed} FAILED: the own relay is not exactly the expected set"
    );
    let missing: BTreeMap<String, EventId> = expected
        .difference(&actual)
        .map(|id| (w.describe(id), *id))
        .collect();
    let unexpected: BTreeMap<String, EventId> = actual
        .difference(&expected)
        .map(|id| (w.describe(id), *id))
        .collect();
    let engine = handle.with_machine(|m| {
        let index = m.repo_index();
        EngineView {
            roots: index
                .values()
                .flat_map(|n| n.root_events.iter().copied())
                .collect(),
            announced: index
                .iter()
                .filter(|(_, n)| n.announced_at.is_some())
                .map(|(r, _)| r.to_string())
                .collect(),
            relays: index
                .values()
                .flat_map(|n| n.relays.iter())
                .filter_map(|u| {
                    w.remote_urls
                        .iter()
                        .position(|r| url_eq(r, &u.to_string()))
                        .map(Place::Remote)
                })
                .collect(),
        }
    });
    let _ = writeln!(report, "missing ({}):", missing.len());
    for (d, id) in &missing {
        let _ = writeln!(report, "  {d}");
        report.push_str(&evidence(&w, id, &engine));
    }
    report.push_str(&closed_evidence(&w));
    let _ = writeln!(report, "unexpected ({}):", unexpected.len());
    for d in unexpected.keys() {
        let _ = writeln!(report, "  {d}");
    }
    let _ = writeln!(report, "faults: {summary}");
    let _ = writeln!(report, "relays: own {}", w.own_url);
    for (i, u) in w.remote_urls.iter().enumerate() {
        let _ = writeln!(report, "        R{i} {u}");
    }
    let _ = writeln!(report, "schedule:");
    for line in &w.log {
        let _ = writeln!(report, "  {line}");
    }
    let _ = writeln!(report, "status: {:#?}", handle.status());
    let _ = writeln!(
        report,
        "re-run: GRASP_SYNC_FAULT_SEED={seed} RUST_LOG=grasp_sync=debug \
         cargo test --all-features --test faults -- seeds_from_env --nocapture"
    );
    let _ = handle.shutdown(Duration::from_secs(5));
    Err(report)
}

/// Not a fault test: the model of the expected set against a hand-made case.
#[test]
fn expected_set_model_follows_announcements_roots_and_relays() {
    let mut w = World::new(1, false);
    let keys = keys_from(&mut w.rng);
    let coord = format!("30617:{}:x", keys.public_key().to_hex());
    let (u0, u1) = (w.remote_urls[0].clone(), w.remote_urls[1].clone());
    w.repos.push(Repo {
        coord: coord.clone(),
        relays: vec![0],
    });
    let ann = signed(
        &keys,
        30617,
        "",
        &[tag(&["d", "x"]), tag(&["relays", &u0])],
        10,
    );
    w.put("ann".into(), &ann, &[Place::Own]);
    // R0: an issue (Layer 2), a reply to it (Layer 3 through the forwarded issue), an
    // announcement of another repository naming R1 (Layer 1), and noise.
    let issue = signed(&keys, 1621, "i", &[tag(&["a", &coord])], 11);
    let reply = signed(&keys, 1622, "r", &[tag(&["e", &issue.id.to_hex()])], 12);
    let keys2 = keys_from(&mut w.rng);
    let coord2 = format!("30617:{}:y", keys2.public_key().to_hex());
    let ann2 = signed(
        &keys2,
        30617,
        "",
        &[tag(&["d", "y"]), tag(&["relays", &u1])],
        13,
    );
    let noise = signed(&keys, 1, "n", &[], 14);
    for e in [&issue, &reply, &ann2, &noise] {
        w.put("r0".into(), e, &[Place::Remote(0)]);
    }
    // R1: an issue of y (expected), an issue of x (x does not list R1: not expected).
    let issue2 = signed(&keys2, 1621, "i2", &[tag(&["a", &coord2])], 15);
    let stray = signed(&keys, 1621, "stray", &[tag(&["a", &coord])], 16);
    w.put("r1".into(), &issue2, &[Place::Remote(1)]);
    w.put("r1".into(), &stray, &[Place::Remote(1)]);
    // R2 is named by nobody.
    let state = signed(&keys, 30618, "", &[tag(&["d", "x"])], 17);
    w.put("r2".into(), &state, &[Place::Remote(2)]);
    let want: HashSet<EventId> = [ann.id, issue.id, reply.id, ann2.id, issue2.id].into();
    assert_eq!(w.expected(), want);
}
