//! The performance benchmark (issue 10): every figure of `docs/performance.md` with its
//! budget, measured on embedded relays over loopback and on the sans-IO sync machine.
//!
//! ```sh
//! cargo run --release --features testing --example bench            # full run
//! cargo run --release --features testing --example bench -- --quick # small sizes, < 60 s
//! cargo run --release --features testing --example bench -- --json  # JSON instead of the table
//! ```
//!
//! Figures (method in `docs/performance.md`):
//! * historic sync into an empty own relay, repositories listed on 1 and on 3 relays: unique
//!   events/s and the engine's own CPU (its threads only) per 1,000 unique events;
//! * the floor: `Event::verify` on one thread over the same events, and engine CPU ÷ verify;
//! * live latency from a publish on a remote relay to the event stored on the own relay;
//! * memory per connected relay and idle CPU (each in a child process of its own);
//! * planning: one batch tick of `SyncMachine` (full rebuild and a one-event batch);
//! * the state file of `--state-dir` at its caps: size, write, read and restore.
//! * NIP-77: the own side of a reconciliation (parse, keep `(created_at, id)`), the
//!   negentropy work, rounds and bytes exchanged against the REQ path's bytes.
//! * only when named, `--only reference`: ngit-grasp's own sync beside the release binary on
//!   one data set with reply chains (`bench/reference.rs`).
//! * only when named, `--only pool`: the release binary beside rust-nostr's nostr-sdk pool on
//!   the process section's data and relays (`bench/pool.rs`).

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::process::Command as Process;
use std::time::{Duration, Instant};

use argh::FromArgs;
use grasp_sync::core::paging::PageStats;
use grasp_sync::core::{Command, Report, SyncConfig, SyncMachine, Time};
use grasp_sync::testing::{wait_until, Nip77Mode, TestRelay};
use grasp_sync::{Config, RelayUrl, SyncHandle};
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Signature, Tag};
use nostr::key::Keys;
use nostr::types::Timestamp;
use serde_json::{json, Value};

#[path = "bench/pool.rs"]
mod pool;
#[path = "bench/process.rs"]
mod process;
#[path = "bench/production.rs"]
mod production;
#[path = "bench/reference.rs"]
mod reference;

/// Repositories announced by one pubkey: at 3 relays each, 30 relays, under the engine's
/// quota of 64 relays per pubkey.
const REPOS_PER_OWNER: usize = 10;
/// The most TestRelay listeners of a memory probe; more relays share them by URL path.
const PROBE_LISTENERS: usize = 20;
/// How often the live-latency check looks at the own relay.
const LATENCY_POLL: Duration = Duration::from_micros(100);
const SHUTDOWN: Duration = Duration::from_secs(10);
const SYNC_DEADLINE: Duration = Duration::from_secs(900);
const SETTLE_DEADLINE: Duration = Duration::from_secs(300);
/// Time for a settled engine's last frames and allocations before memory is read.
const SETTLE_PAUSE: Duration = Duration::from_secs(2);

/// Benchmark of grasp-sync: one table of figures with their budgets.
#[derive(FromArgs)]
struct Args {
    /// small sizes (finishes in under a minute)
    #[argh(switch)]
    quick: bool,
    /// print JSON instead of the table
    #[argh(switch)]
    json: bool,
    /// related events held by the remote relays in the historic sync (default 50,000)
    #[argh(option)]
    events: Option<usize>,
    /// remote relays of the historic sync (default 10)
    #[argh(option)]
    relays: Option<usize>,
    /// seconds of the idle-CPU window with the most relays (default 60, 5 with --quick)
    #[argh(option)]
    idle_secs: Option<u64>,
    /// historic sync only with repositories listed on this many relays (default: 1, then 3)
    #[argh(option)]
    spread: Option<usize>,
    /// run only these sections (comma-separated: historic, live, memory, planning, state,
    /// nip77, resync, process (the release binary against relay processes; needs
    /// `NIP77_RELAY`, skipped without it); `throttled` runs only when named: about 17 minutes of real time;
    /// `hostile` too: issue 20's floods against the release binary, which
    /// `cargo build --release` must have built; `bought` or `tags`: only issue 36's bought
    /// tiers and frames of a megabyte of empty tags, also part of `hostile`; `production`:
    /// issue 37's production case against the release binary, only when named; `reference`:
    /// ngit-grasp's own sync beside grasp-sync's on one data set, only when named; `pool`:
    /// the release binary beside the nostr-sdk pool (`sdk-pool` of tests/nip77-relay) on the
    /// process section's data, only when named)
    #[argh(option)]
    only: Option<String>,
    /// events of the `throttled` section (default 2,000; 200 with --quick)
    #[argh(option)]
    throttled_events: Option<usize>,
    /// related events held by the remote relays in the resync section (default 20,000;
    /// 2,000 with --quick)
    #[argh(option)]
    resync_events: Option<usize>,
    /// remote relays of the resync section (default 5)
    #[argh(option)]
    resync_relays: Option<usize>,
    /// events of the process section's large-patch variant (default 2,000; 200 with --quick)
    #[argh(option)]
    large_events: Option<usize>,
    /// repositories of the process section (default 30 per relay)
    #[argh(option)]
    repos: Option<usize>,
    /// process section: the own relay holds the root events before the sync, not only the
    /// announcements (as a GRASP server that took them in itself)
    #[argh(switch)]
    seed_roots: bool,
    /// process section: seconds the events' created_at spread over, ending now (default a
    /// year; shorter than one second per event puts several in one second)
    #[argh(option)]
    span_secs: Option<u64>,
    /// process section: announcements newer than every event (default: older)
    #[argh(switch)]
    new_announcements: bool,
    /// reference section: seconds without a new expected event after which a side is
    /// taken as done (default 150: over two of ngit-grasp's 60 s descendant refreshes)
    #[argh(option)]
    plateau_secs: Option<u64>,
    /// internal: run one memory probe in this process and print its JSON
    /// (`engine:N` or `clients:N`)
    #[argh(option)]
    probe: Option<String>,
}

/// The sizes of one run.
struct Sizes {
    events: usize,
    spread: Option<usize>,
    relays: usize,
    repos: usize,
    live_relays: usize,
    live_samples: usize,
    memory_relays: [usize; 3],
    idle: Duration,
    plan_repos: [usize; 3],
    plan_relays: usize,
    plan_roots: usize,
    plan_samples: usize,
    resync_events: usize,
    resync_relays: usize,
    nip77_sizes: [usize; 2],
}

impl Sizes {
    fn of(args: &Args) -> Sizes {
        let quick = args.quick;
        let relays = args.relays.unwrap_or(if quick { 5 } else { 10 });
        Sizes {
            spread: args.spread,
            events: args.events.unwrap_or(if quick { 5_000 } else { 50_000 }),
            relays,
            repos: 30 * relays,
            live_relays: 100,
            live_samples: if quick { 100 } else { 500 },
            memory_relays: if quick {
                [0, 100, 200]
            } else {
                [0, 100, 1_000]
            },
            idle: Duration::from_secs(args.idle_secs.unwrap_or(if quick { 5 } else { 60 })),
            plan_repos: [1_000, 10_000, 100_000],
            plan_relays: 1_000,
            plan_roots: if quick { 100_000 } else { 1_000_000 },
            plan_samples: 21,
            resync_events: args
                .resync_events
                .unwrap_or(if quick { 2_000 } else { 20_000 }),
            resync_relays: args.resync_relays.unwrap_or(5),
            nip77_sizes: if quick {
                [1_000, 10_000]
            } else {
                [10_000, 100_000]
            },
        }
    }
}

// ----- the table -----

/// What a figure must stay under (or above).
#[derive(Clone, Copy)]
enum Budget {
    None,
    AtMost(f64),
    AtLeast(f64),
}

struct Figure {
    name: String,
    value: f64,
    unit: &'static str,
    budget: Budget,
}

impl Figure {
    fn new(name: impl Into<String>, value: f64, unit: &'static str, budget: Budget) -> Figure {
        Figure {
            name: name.into(),
            value,
            unit,
            budget,
        }
    }

    fn limit(&self) -> Option<f64> {
        match self.budget {
            Budget::None => None,
            Budget::AtMost(b) | Budget::AtLeast(b) => Some(b),
        }
    }

    fn ratio(&self) -> Option<f64> {
        self.limit().map(|b| match (b == 0.0, self.value == 0.0) {
            // A budget of nothing: met exactly, or missed without measure.
            (true, true) => 0.0,
            (true, false) => f64::INFINITY,
            (false, _) => self.value / b,
        })
    }

    fn ok(&self) -> Option<bool> {
        match self.budget {
            Budget::None => None,
            Budget::AtMost(b) => Some(self.value <= b),
            Budget::AtLeast(b) => Some(self.value >= b),
        }
    }

    fn budget_text(&self) -> String {
        match self.budget {
            Budget::None => "—".into(),
            Budget::AtMost(b) => format!("≤ {}", number(b)),
            Budget::AtLeast(b) => format!("≥ {}", number(b)),
        }
    }

    fn json(&self) -> Value {
        json!({
            "figure": self.name,
            "value": self.value,
            "unit": self.unit,
            "budget": self.limit(),
            "budget_kind": match self.budget {
                Budget::None => "none",
                Budget::AtMost(_) => "at_most",
                Budget::AtLeast(_) => "at_least",
            },
            "ratio": self.ratio(),
            "ok": self.ok(),
        })
    }
}

/// A number with three significant digits (at least), thousands separated.
fn number(v: f64) -> String {
    if v.abs() >= 1000.0 {
        let s = format!("{:.0}", v);
        let (sign, digits) = s.split_at(usize::from(s.starts_with('-')));
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        format!("{sign}{out}")
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn print_table(figures: &[Figure]) {
    let rows: Vec<[String; 5]> = figures
        .iter()
        .map(|f| {
            [
                f.name.clone(),
                format!("{} {}", number(f.value), f.unit),
                f.budget_text(),
                f.ratio().map_or("—".into(), |r| format!("{r:.2}")),
                f.ok()
                    .map_or("—", |ok| if ok { "yes" } else { "NO" })
                    .into(),
            ]
        })
        .collect();
    let header = ["figure", "value", "budget", "ratio", "ok?"];
    let width = |i: usize| {
        rows.iter()
            .map(|r| r[i].chars().count())
            .chain([header[i].len()])
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..5).map(width).collect();
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| {
                let pad = " ".repeat(w - c.chars().count());
                if i == 0 {
                    format!("{c}{pad}")
                } else {
                    format!("{pad}{c}")
                }
            })
            .collect();
        println!("| {} |", padded.join(" | "));
    };
    line(&header.map(String::from));
    let rule: Vec<String> = widths
        .iter()
        .enumerate()
        .map(|(i, w)| {
            if i == 0 {
                "-".repeat(w + 2)
            } else {
                format!("{}:", "-".repeat(w + 1))
            }
        })
        .collect();
    println!("|{}|", rule.join("|"));
    for r in &rows {
        line(r);
    }
}

// ----- /proc -----

fn proc_status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn rss_kib() -> u64 {
    proc_status_kib("VmRSS:")
}

fn clock_ticks_per_sec() -> f64 {
    Process::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Threads the engine names itself (`src/engine`, `src/net`); the comm is cut at 15 bytes,
/// so relay threads ("relay ws://…") show as "relay ws://127.". TestRelay threads are
/// "test-relay-accept-…" / "test-relay-conn-…", the benchmark's own main thread "bench".
fn engine_thread_kind(comm: &str) -> Option<&'static str> {
    match comm {
        "coordinator" => Some("coordinator"),
        "forwarder" | "forwarder-read" => Some("forwarder"),
        "dns" => Some("dns"),
        "connect" => Some("connect"),
        _ if comm.starts_with("relay ") => Some("relay"),
        _ => None,
    }
}

/// CPU seconds (run time: user + system) of the engine's live threads, per thread kind.
struct Cpu {
    /// Seconds per kind: "coordinator", "forwarder", "dns", "connect", "relay".
    by_kind: BTreeMap<&'static str, f64>,
    /// Threads that are neither engine nor TestRelay nor main (to spot one the filter misses).
    unknown: Vec<String>,
}

impl Cpu {
    fn total(&self) -> f64 {
        self.by_kind.values().sum()
    }

    /// The CPU spent per kind since `earlier`.
    fn since(&self, earlier: &Cpu) -> BTreeMap<&'static str, f64> {
        self.by_kind
            .iter()
            .map(|(k, v)| (*k, v - earlier.by_kind.get(k).copied().unwrap_or(0.0)))
            .collect()
    }
}

fn engine_cpu() -> Cpu {
    let tick = clock_ticks_per_sec();
    let mut cpu = Cpu {
        by_kind: BTreeMap::new(),
        unknown: Vec::new(),
    };
    for entry in std::fs::read_dir("/proc/self/task").into_iter().flatten() {
        let Ok(entry) = entry else { continue };
        let dir = entry.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let comm = comm.trim();
        let Some(kind) = engine_thread_kind(comm) else {
            if !comm.starts_with("test-relay-")
                && comm != "bench"
                && !cpu.unknown.iter().any(|u| u == comm)
            {
                cpu.unknown.push(comm.to_string());
            }
            continue;
        };
        // The scheduler's run time in nanoseconds (as for the verify floor); the clock-tick
        // counts of `stat` (10 ms, sampled) only where it cannot be read.
        let seconds = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .map(|ns| ns as f64 / 1e9)
            .unwrap_or_else(|| {
                let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
                stat_cpu_ticks(&stat) as f64 / tick
            });
        *cpu.by_kind.entry(kind).or_default() += seconds;
    }
    cpu
}

// ----- events -----

fn sign(keys: &Keys, kind: u16, content: &str, tags: &[&[&str]]) -> Event {
    sign_at(keys, kind, content, tags, None)
}

/// [`sign`] with `created_at` set (`None`: now).
fn sign_at(
    keys: &Keys,
    kind: u16,
    content: &str,
    tags: &[&[&str]],
    created_at: Option<Timestamp>,
) -> Event {
    let mut b = EventBuilder::new(Kind::Custom(kind), content);
    for t in tags {
        b = b.tag(Tag::parse(t.iter().copied()).expect("tag"));
    }
    if let Some(at) = created_at {
        b = b.custom_created_at(at);
    }
    b.finalize(keys).expect("sign")
}

fn coord(keys: &Keys, d: &str) -> String {
    format!("30617:{}:{d}", keys.public_key().to_hex())
}

/// A repository announcement naming `relays`.
fn announcement(keys: &Keys, d: &str, relays: &[String]) -> Event {
    let mut tag = vec!["relays"];
    tag.extend(relays.iter().map(String::as_str));
    sign(keys, 30617, "", &[&["d", d], &tag])
}

/// A NIP-22 comment on `root` of repository `repo`: matches a Layer 3 (`#E`) and a Layer 2
/// (`#A`) filter.
fn comment(keys: &Keys, root: &Event, repo: &str, i: usize) -> Event {
    comment_at(keys, root, repo, i, None)
}

/// [`comment`] with `created_at` set (`None`: now).
fn comment_at(
    keys: &Keys,
    root: &Event,
    repo: &str,
    i: usize,
    created_at: Option<Timestamp>,
) -> Event {
    let text = format!("comment {i} {}", "x".repeat(200));
    sign_at(
        keys,
        1111,
        &text,
        &[&["E", &root.id.to_hex()], &["A", repo], &["K", "1621"]],
        created_at,
    )
}

/// Repositories (one owner per [`REPOS_PER_OWNER`], so no owner reaches the engine's
/// per-pubkey relay quota), one root issue each, and comments spread over the roots.
struct History {
    owners: Vec<Keys>,
    roots: Vec<Event>,
    comments: Vec<Event>,
}

impl History {
    fn generate(repos: usize, comments: usize) -> History {
        let owners: Vec<Keys> = (0..repos.div_ceil(REPOS_PER_OWNER))
            .map(|_| Keys::generate())
            .collect();
        let roots: Vec<Event> = (0..repos)
            .map(|r| {
                let owner = &owners[r / REPOS_PER_OWNER];
                let repo = coord(owner, &format!("repo-{r}"));
                sign(owner, 1621, &format!("issue {r}"), &[&["a", &repo]])
            })
            .collect();
        let repliers: Vec<Keys> = (0..16).map(|_| Keys::generate()).collect();
        let mut history = History {
            owners,
            roots,
            comments: Vec::new(),
        };
        history.comments = (0..comments)
            .map(|i| history.comment(&repliers[i % repliers.len()], i % repos, i))
            .collect();
        history
    }

    fn owner(&self, repo: usize) -> &Keys {
        &self.owners[repo / REPOS_PER_OWNER]
    }

    fn repo(&self, repo: usize) -> String {
        coord(self.owner(repo), &format!("repo-{repo}"))
    }

    /// Comment number `i` (by `keys`) on the root of repository `repo`.
    fn comment(&self, keys: &Keys, repo: usize, i: usize) -> Event {
        comment(keys, &self.roots[repo], &self.repo(repo), i)
    }

    fn repo_of(&self, event: usize) -> usize {
        event % self.roots.len()
    }
}

/// An own relay holding every announcement and root, and `relays` remote relays where
/// repository `r` is listed on `per_repo` consecutive relays starting at `r % relays`; each
/// comment is stored on every relay of its repository.
///
/// The remote relays are served by `listeners` TestRelays: with fewer listeners than relays,
/// relay `i` is `ws://127.0.0.1:PORT/r{i}` on listener `i % listeners` (a distinct relay for
/// the engine, one store for the listener). 1,000 TestRelays in one process on 2 cores
/// (1,000 acceptors polling every 10 ms) overload the machine before the engine settles.
struct World {
    own: TestRelay,
    listeners: Vec<TestRelay>,
    urls: Vec<String>,
}

impl World {
    fn start(history: &History, relays: usize, per_repo: usize, with_comments: bool) -> World {
        World::start_on(history, relays, relays, per_repo, with_comments)
    }

    fn start_on(
        history: &History,
        relays: usize,
        listeners: usize,
        per_repo: usize,
        with_comments: bool,
    ) -> World {
        let own = TestRelay::start();
        let listeners: Vec<TestRelay> = (0..listeners).map(|_| TestRelay::start()).collect();
        let urls: Vec<String> = (0..relays)
            .map(|i| {
                let base = listeners[i % listeners.len()].url();
                if listeners.len() == relays {
                    base
                } else {
                    format!("{base}/r{i}")
                }
            })
            .collect();
        let world = World {
            own,
            listeners,
            urls,
        };
        let listed = |r: usize| (0..per_repo.min(relays)).map(move |k| (r + k) % relays);
        for (r, root) in history.roots.iter().enumerate() {
            let urls: Vec<String> = listed(r).map(|i| world.urls[i].clone()).collect();
            let ann = announcement(history.owner(r), &format!("repo-{r}"), &urls);
            world.own.insert(&ann);
            world.own.insert(root);
            for i in listed(r) {
                world.relay(i).insert(&ann);
            }
        }
        if with_comments {
            for (i, c) in history.comments.iter().enumerate() {
                for k in listed(history.repo_of(i)) {
                    world.relay(k).insert(c);
                }
            }
        }
        world
    }

    /// The TestRelay serving relay `i`.
    fn relay(&self, i: usize) -> &TestRelay {
        &self.listeners[i % self.listeners.len()]
    }

    fn open_subscriptions(&self) -> usize {
        self.listeners
            .iter()
            .map(TestRelay::open_subscriptions)
            .sum()
    }

    fn engine(&self, configure: impl FnOnce(&mut Config)) -> SyncHandle {
        let mut config = Config::new(RelayUrl::parse(&self.own.url()).expect("url"))
            .allow_private_relays(true)
            .batch_window(Duration::from_millis(200));
        // The embedded relays return everything in one answer; say so (as NIP-11 would).
        config.assumed_page_size = 1_000_000;
        // Every repository of the own relay is meant (no --public-url).
        config.archive = true;
        configure(&mut config);
        grasp_sync::start(config).expect("engine starts")
    }

    /// Waits until the engine is settled on every remote relay.
    fn settle(&self, handle: &SyncHandle) {
        let settled = wait_until(SETTLE_DEADLINE, || {
            let s = handle.status();
            s.relays.len() >= self.urls.len() && s.is_settled()
        });
        assert!(
            settled,
            "the engine did not settle on {} relays",
            self.urls.len()
        );
    }
}

// ----- historic sync and the verify floor -----

struct Historic {
    seconds: f64,
    unique: usize,
    engine_cpu: f64,
    /// Engine CPU seconds per thread kind.
    by_kind: BTreeMap<&'static str, f64>,
    unknown_threads: Vec<String>,
    work: Work,
}

fn historic(history: &History, relays: usize, per_repo: usize) -> Historic {
    let world = World::start(history, relays, per_repo, true);
    let before = world.own.len();
    let expected = before + history.comments.len();
    let started = Instant::now();
    let handle = world.engine(|_| {});
    let complete = wait_until(SYNC_DEADLINE, || world.own.len() >= expected);
    let seconds = started.elapsed().as_secs_f64();
    let cpu = engine_cpu();
    assert!(complete, "historic sync did not complete");
    let status = handle.status();
    let sum = |f: fn(&grasp_sync::RelayStatus) -> u64| status.relays.iter().map(f).sum::<u64>();
    let work = Work {
        received: sum(|r| r.events_received),
        signature_checks: sum(|r| r.signature_checks),
        copies_not_forwarded: sum(|r| r.copies_not_forwarded),
    };
    let want: HashSet<EventId> = history.comments.iter().map(|e| e.id).collect();
    let have = world.own.event_ids();
    assert!(want.is_subset(&have), "the own relay misses events");
    handle.shutdown(SHUTDOWN).expect("engine stops");
    Historic {
        seconds,
        unique: expected - before,
        engine_cpu: cpu.total(),
        by_kind: cpu.by_kind.clone(),
        unknown_threads: cpu.unknown,
        work,
    }
}

/// What the relay threads of a historic sync did, summed over the remote relays.
struct Work {
    /// EVENT messages received.
    received: u64,
    /// Schnorr signature checks.
    signature_checks: u64,
    /// Copies not handed to the forwarder (a copy already was).
    copies_not_forwarded: u64,
}

/// Seconds this thread has run on a CPU (`/proc/thread-self/schedstat`, nanoseconds).
fn thread_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(ns as f64 / 1e9)
}

/// CPU seconds per event of `Event::verify` on this thread (wall seconds where the thread's
/// CPU time cannot be read). CPU time, as the engine's side is: on a loaded machine the wall
/// time includes the time other processes ran, which would flatter the ratio.
fn verify_cost(events: &[Event]) -> f64 {
    let started = Instant::now();
    let cpu = thread_cpu_seconds();
    for e in events {
        e.verify().expect("valid event");
    }
    let spent = match (cpu, thread_cpu_seconds()) {
        (Some(a), Some(b)) => b - a,
        _ => started.elapsed().as_secs_f64(),
    };
    spent / events.len() as f64
}

fn historic_figures(sizes: &Sizes, notes: &mut Vec<String>) -> Vec<Figure> {
    let history = History::generate(sizes.repos, sizes.events);
    let verify = verify_cost(&history.comments);
    let mut figures = vec![
        Figure::new(
            "verify floor: Event::verify, one thread",
            1.0 / verify,
            "ev/s",
            Budget::None,
        ),
        Figure::new(
            "verify floor: CPU per 1k events",
            verify * 1e6,
            "ms",
            Budget::None,
        ),
    ];
    let spreads = sizes.spread.map_or(vec![1, 3], |s| vec![s]);
    for per_repo in spreads {
        // The floor for this run: measured right before and right after it (the host's speed
        // drifts by tens of percent over hours here; a floor read a minute earlier made the
        // ratio swing with it).
        let before = verify_cost(&history.comments);
        let h = historic(&history, sizes.relays, per_repo);
        let after = verify_cost(&history.comments);
        let verify = (before + after) / 2.0;
        let label = format!(
            "historic, {} ev, {} relays, repo on {per_repo}",
            number(h.unique as f64),
            sizes.relays
        );
        figures.push(Figure::new(
            format!("{label}: verify floor around the run, CPU per 1k"),
            verify * 1e6,
            "ms",
            Budget::None,
        ));
        notes.push(format!(
            "{label}: verify floor before and after the run: {:.1} and {:.1} ms per 1k",
            before * 1e6,
            after * 1e6
        ));
        let cpu_per_event = h.engine_cpu / h.unique as f64;
        figures.push(Figure::new(
            format!("{label}: unique ev/s"),
            h.unique as f64 / h.seconds,
            "ev/s",
            // What one core gives at the CPU budget (1.5 × verify per event).
            Budget::AtLeast(1.0 / (1.5 * verify)),
        ));
        figures.push(Figure::new(
            format!("{label}: wall time"),
            h.seconds,
            "s",
            Budget::None,
        ));
        figures.push(Figure::new(
            format!("{label}: engine CPU per 1k unique"),
            cpu_per_event * 1e6,
            "ms",
            Budget::AtMost(1.5 * verify * 1e6),
        ));
        figures.push(Figure::new(
            format!("{label}: engine CPU ÷ verify"),
            cpu_per_event / verify,
            "×",
            Budget::AtMost(1.5),
        ));
        let per_kind: Vec<String> = h
            .by_kind
            .iter()
            .map(|(k, v)| format!("{k} {:.1}", v / h.unique as f64 * 1e6))
            .collect();
        notes.push(format!(
            "{label}: engine CPU per 1k unique by thread kind (ms): {}",
            per_kind.join(", ")
        ));
        let per_unique = |n: u64| n as f64 / h.unique as f64;
        notes.push(format!(
            "{label}: per unique event: {:.2} EVENT messages, {:.2} signature checks, {:.2} copies not forwarded",
            per_unique(h.work.received),
            per_unique(h.work.signature_checks),
            per_unique(h.work.copies_not_forwarded),
        ));
        if !h.unknown_threads.is_empty() {
            notes.push(format!(
                "threads neither engine nor TestRelay (not counted): {:?}",
                h.unknown_threads
            ));
        }
    }
    figures
}

// ----- restarts and resyncs (issue 11) -----

/// Share of the first sync's bytes that a restart or a daily resync may receive from relays
/// that answer NIP-77.
const RESYNC_BYTES_BUDGET: f64 = 0.05;

/// What one run of the resync scenario measured; `[first sync, restart, daily resync]`.
struct Resync {
    bytes: [u64; 3],
    seconds: [f64; 3],
    /// History REQs without `since` the remote relays received during the restart.
    full_history_reqs: usize,
    /// Whether the restart settled before the daily resync was due.
    restart_in_time: bool,
}

/// Bytes the remote relays sent so far (websocket payloads).
fn remote_bytes(world: &World) -> u64 {
    world.listeners.iter().map(TestRelay::bytes_sent).sum()
}

/// Waits until every remote relay holds a subscription of the engine and the remote relays'
/// byte count stopped moving (two readings 500 ms apart, at most [`SETTLE_DEADLINE`]): a
/// settled status can precede the answers to a restart's catch-ups.
fn wait_quiet(world: &World) {
    let subscribed = wait_until(SETTLE_DEADLINE, || {
        world.listeners.iter().all(|l| l.open_subscriptions() > 0)
    });
    assert!(subscribed, "resync: a remote relay has no subscription");
    let end = Instant::now() + SETTLE_DEADLINE;
    let mut last = remote_bytes(world);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(500));
        let now = remote_bytes(world);
        if now == last {
            return;
        }
        last = now;
    }
}

/// History REQs without `since` received by the remote relays (live-only subscriptions carry
/// `limit: 0`; a fresh sync's REQs are history and live at once and count).
fn full_history_reqs(world: &World) -> usize {
    world
        .listeners
        .iter()
        .flat_map(TestRelay::reqs)
        .filter(|r| {
            r.filters
                .iter()
                .any(|f| f.since.is_none() && f.limit != Some(0))
        })
        .count()
}

/// The backdated history of the scenario: comments a day or more old (so that no catch-up
/// `since`, 15 min before the last connect, reaches them), one second apart.
fn backdated_history(repos: usize, comments: usize) -> History {
    let mut history = History::generate(repos, 0);
    let base = Timestamp::now().as_secs() - 2 * 86_400 - comments as u64;
    let repliers: Vec<Keys> = (0..16).map(|_| Keys::generate()).collect();
    history.comments = (0..comments)
        .map(|i| {
            let repo = i % repos;
            let at = Timestamp::from_secs(base + i as u64);
            comment_at(
                &repliers[i % repliers.len()],
                &history.roots[repo],
                &history.repo(repo),
                i,
                Some(at),
            )
        })
        .collect();
    history
}

/// One run: (a) the first sync into an empty own relay, (b) a restart with nothing new (the
/// same own relay, the same `--state-dir`), (c) the daily resync of every relay after 1 % new
/// events were stored on the remote relays without reaching the live subscriptions (an hour
/// old: only a full read or a reconciliation finds them). The daily window is set so that the
/// resync comes after the restart has settled.
fn resync_run(
    history: &History,
    relays: usize,
    nip77: bool,
    state_dir: &std::path::Path,
) -> Resync {
    let world = World::start(history, relays, 1, true);
    let mode = if nip77 { Nip77Mode::On } else { Nip77Mode::Off };
    for l in &world.listeners {
        // A NIP-11 document, so that NIP-77 relays advertise it (the TestRelay adds 77).
        l.set_nip11(Some(json!({"name": "bench", "supported_nips": [1, 11]})));
        l.set_nip77(mode.clone());
    }
    let comments: HashSet<EventId> = history.comments.iter().map(|e| e.id).collect();
    let configure = |daily: Option<Duration>| {
        move |c: &mut Config| {
            c.state_dir = Some(state_dir.to_path_buf());
            if let Some(d) = daily {
                c.daily_resync = (d, d);
            }
        }
    };

    // (a) first sync.
    let bytes0 = remote_bytes(&world);
    let started = Instant::now();
    let handle = world.engine(configure(None));
    let complete = wait_until(SYNC_DEADLINE, || {
        world.own.event_ids().is_superset(&comments)
    });
    assert!(complete, "resync: the first sync did not complete");
    world.settle(&handle);
    let first = started.elapsed().as_secs_f64();
    let first_bytes = remote_bytes(&world) - bytes0;
    handle.shutdown(SHUTDOWN).expect("engine stops");

    // (b) restart; its daily resyncs are due `daily` after the start.
    let daily = Duration::from_secs_f64(2.0 * first + 5.0);
    for l in &world.listeners {
        l.clear_reqs();
    }
    let bytes0 = remote_bytes(&world);
    let started = Instant::now();
    let handle = world.engine(configure(Some(daily)));
    world.settle(&handle);
    let restart = started.elapsed().as_secs_f64();
    wait_quiet(&world);
    let restart_bytes = remote_bytes(&world) - bytes0;
    let restart_in_time = started.elapsed() < daily && handle.status().sync.daily_resyncs == 0;
    let full_reqs = full_history_reqs(&world);

    // (c) 1 % new events, then the daily resync of every relay.
    let keys = Keys::generate();
    let hour_ago = Timestamp::now().as_secs() - 3_600;
    let new: Vec<(usize, Event)> = (0..history.comments.len().div_ceil(100))
        .map(|i| {
            let repo = (i * 7) % history.roots.len();
            let at = Timestamp::from_secs(hour_ago + i as u64);
            let e = comment_at(
                &keys,
                &history.roots[repo],
                &history.repo(repo),
                1_000_000 + i,
                Some(at),
            );
            (repo % relays, e)
        })
        .collect();
    let bytes0 = remote_bytes(&world);
    for (r, e) in &new {
        world.relay(*r).insert_silently(e);
    }
    let due = started + daily;
    let new_ids: HashSet<EventId> = new.iter().map(|(_, e)| e.id).collect();
    let resynced = wait_until(SYNC_DEADLINE, || {
        let s = handle.status();
        s.sync.daily_resyncs >= relays as u64
            && s.is_settled()
            && world.own.event_ids().is_superset(&new_ids)
    });
    assert!(
        resynced,
        "resync: the daily resync did not bring the new events"
    );
    let resync = due.elapsed().as_secs_f64();
    let resync_bytes = remote_bytes(&world) - bytes0;
    handle.shutdown(SHUTDOWN).expect("engine stops");
    Resync {
        bytes: [first_bytes, restart_bytes, resync_bytes],
        seconds: [first, restart, resync],
        full_history_reqs: full_reqs,
        restart_in_time,
    }
}

fn resync_figures(sizes: &Sizes, notes: &mut Vec<String>) -> Vec<Figure> {
    let relays = sizes.resync_relays;
    let history = backdated_history(30 * relays, sizes.resync_events);
    let label = format!(
        "resync, {} ev, {relays} relays",
        number(sizes.resync_events as f64)
    );
    let runs: Vec<(bool, Resync)> = [false, true]
        .into_iter()
        .map(|nip77| {
            let dir = std::env::temp_dir().join(format!(
                "grasp-sync-bench-resync-{}-{nip77}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            let run = resync_run(&history, relays, nip77, &dir);
            let _ = std::fs::remove_dir_all(&dir);
            (nip77, run)
        })
        .collect();
    let phases = [
        "(a) first sync",
        "(b) restart, nothing new",
        "(c) daily resync, 1 % new",
    ];
    let mut figures = Vec::new();
    for (p, phase) in phases.iter().enumerate() {
        for (nip77, run) in &runs {
            let relays_kind = if *nip77 { "NIP-77 relays" } else { "no NIP-77" };
            figures.push(Figure::new(
                format!("{label}, {relays_kind}: {phase}: received"),
                run.bytes[p] as f64 / 1024.0,
                "KiB",
                Budget::None,
            ));
            if p > 0 {
                let share = run.bytes[p] as f64 / run.bytes[0].max(1) as f64;
                let budget = if *nip77 {
                    Budget::AtMost(RESYNC_BYTES_BUDGET * 100.0)
                } else {
                    Budget::None
                };
                figures.push(Figure::new(
                    format!("{label}, {relays_kind}: {phase}: received ÷ (a)"),
                    share * 100.0,
                    "%",
                    budget,
                ));
            }
            figures.push(Figure::new(
                format!("{label}, {relays_kind}: {phase}: wall time"),
                run.seconds[p],
                "s",
                Budget::None,
            ));
        }
    }
    for (nip77, run) in &runs {
        let relays_kind = if *nip77 { "NIP-77 relays" } else { "no NIP-77" };
        figures.push(Figure::new(
            format!("{label}, {relays_kind}: (b) history REQs without since"),
            run.full_history_reqs as f64,
            "REQs",
            Budget::AtMost(0.0),
        ));
        if !run.restart_in_time {
            notes.push(format!(
                "resync ({relays_kind}): the restart had not settled when the daily resync was \
                 due, so (b) and (c) overlap"
            ));
        }
    }
    notes.push(
        "resync: bytes are the websocket payloads the remote TestRelays sent (bytes_sent); \
         (c) counts from the moment the new events were stored, its wall time from the \
         moment the daily resync was due"
            .into(),
    );
    figures
}

// ----- live latency -----

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

/// [`wait_until`] with a 100 µs poll (its 10 ms poll would round every latency up).
fn poll_until(deadline: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    while !cond() {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(LATENCY_POLL);
    }
    true
}

/// A short pause of 0–20 ms between publishes, so that they do not lock onto any periodic
/// wake-up (the TestRelay used to write live events on a 20 ms tick).
fn jitter_pause() {
    std::thread::sleep(Duration::from_micros(rand::random_range(0..20_000)));
}

fn live_latency(sizes: &Sizes) -> Vec<Figure> {
    let history = History::generate(sizes.live_relays, 0);
    let world = World::start(&history, sizes.live_relays, 1, false);
    let handle = world.engine(|_| {});
    world.settle(&handle);
    let keys = Keys::generate();
    let events: Vec<(usize, Event)> = (0..sizes.live_samples)
        .map(|i| {
            let r = (i * 37) % sizes.live_relays;
            (r, history.comment(&keys, r, i))
        })
        .collect();
    let mut samples = Vec::with_capacity(events.len());
    for (r, e) in &events {
        jitter_pause();
        let started = Instant::now();
        world.relay(*r).insert(e);
        let stored = poll_until(Duration::from_secs(10), || world.own.contains(&e.id));
        assert!(stored, "live event not stored within 10 s");
        samples.push(started.elapsed());
    }
    handle.shutdown(SHUTDOWN).expect("engine stops");
    let floor = relay_floor(world.relay(0), &history, sizes.live_samples.min(200));
    samples.sort();
    let label = format!("live latency, {} relays", sizes.live_relays);
    vec![
        Figure::new(
            format!("{label}: p50"),
            percentile(&samples, 0.5),
            "ms",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: p99"),
            percentile(&samples, 0.99),
            "ms",
            Budget::AtMost(20.0),
        ),
        Figure::new(
            format!("{label}: max"),
            percentile(&samples, 1.0),
            "ms",
            Budget::None,
        ),
        Figure::new(
            "TestRelay's own delivery (raw client): p50",
            percentile(&floor, 0.5),
            "ms",
            Budget::None,
        ),
        Figure::new(
            "TestRelay's own delivery (raw client): p99",
            percentile(&floor, 0.99),
            "ms",
            Budget::None,
        ),
    ]
}

/// Publish → arrival at a plain websocket client subscribed on `relay`: what the TestRelay
/// itself adds (its connection thread wakes when an event is published).
fn relay_floor(relay: &TestRelay, history: &History, n: usize) -> Vec<Duration> {
    let (mut ws, _) = tungstenite::connect(relay.url()).expect("client connects");
    let root = history.roots[0].id.to_hex();
    let req = format!(r##"["REQ","floor",{{"#E":["{root}"],"limit":0}}]"##);
    ws.send(tungstenite::Message::text(req)).expect("REQ");
    let mut read_until = |needle: &str| loop {
        let msg = ws.read().expect("read");
        if msg.to_text().is_ok_and(|t| t.contains(needle)) {
            break;
        }
    };
    read_until("EOSE");
    let keys = Keys::generate();
    let events: Vec<Event> = (0..n).map(|i| history.comment(&keys, 0, i)).collect();
    let mut samples = Vec::with_capacity(n);
    for e in &events {
        jitter_pause();
        let started = Instant::now();
        relay.insert(e);
        read_until(&e.id.to_hex());
        samples.push(started.elapsed());
    }
    samples.sort();
    samples
}

// ----- memory and idle CPU (child processes) -----

/// Runs `--probe what` in a fresh process (so earlier figures' heap does not hide growth)
/// and returns its JSON.
fn probe(what: &str, idle: Duration) -> Value {
    let exe = std::env::current_exe().expect("current exe");
    let out = Process::new(exe)
        .args(["--probe", what, "--idle-secs", &idle.as_secs().to_string()])
        .output()
        .expect("probe runs");
    assert!(
        out.status.success(),
        "probe {what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or("{}")).expect("probe JSON")
}

/// In the child: `n` idle relays, each named by one repository announcement with one root,
/// so the engine holds Layer 1, 2 and 3 subscriptions on each. RSS before and after the
/// engine connected; then the engine's CPU over `idle`.
fn probe_engine(n: usize, idle: Duration) -> Value {
    let history = History::generate(n.max(1), 0);
    let world = World::start_on(&history, n, listeners(n), 1, false);
    let relays_only = rss_kib();
    let starting = Instant::now();
    let handle = world.engine(|_| {});
    world.settle(&handle);
    let settle_secs = starting.elapsed().as_secs_f64();
    std::thread::sleep(SETTLE_PAUSE);
    let with_engine = rss_kib();
    let subscriptions = world.open_subscriptions();
    let cpu0 = engine_cpu();
    let started = Instant::now();
    std::thread::sleep(idle);
    let cpu1 = engine_cpu();
    let secs = started.elapsed().as_secs_f64();
    let idle_pct = (cpu1.total() - cpu0.total()) / secs * 100.0;
    let idle_by_kind: BTreeMap<&str, f64> = cpu1
        .since(&cpu0)
        .into_iter()
        .map(|(k, v)| (k, v / secs * 100.0))
        .collect();
    handle.shutdown(SHUTDOWN).expect("engine stops");
    json!({
        "relays_only_kib": relays_only,
        "with_engine_kib": with_engine,
        "subscriptions": subscriptions,
        "settle_secs": settle_secs,
        "idle_cpu_pct": idle_pct,
        "idle_cpu_pct_by_thread": idle_by_kind,
    })
}

/// In the child: what the TestRelays spend on `n` connections with the engine's 7 REQs each
/// (Layer 1; Layer 2 `#a #A #q`; Layer 3 `#e #E #q`), held by plain clients with a 4 KiB read
/// buffer. Subtracted from the engine's figure, it leaves the engine's side.
fn probe_clients(n: usize) -> Value {
    let history = History::generate(n.max(1), 0);
    let world = World::start_on(&history, n, listeners(n), 1, false);
    let relays_only = rss_kib();
    let config = tungstenite::protocol::WebSocketConfig::default().read_buffer_size(4096);
    let mut clients = Vec::with_capacity(n);
    for (r, url) in world.urls.iter().enumerate() {
        let (mut ws, _) = tungstenite::client::connect_with_config(url.as_str(), Some(config), 0)
            .expect("connect");
        let repo = history.repo(r);
        let root = history.roots[r].id.to_hex();
        let mut filters = vec![r#"{"kinds":[30617,30618]}"#.to_string()];
        for (tag, value) in [
            ("a", &repo),
            ("A", &repo),
            ("q", &repo),
            ("e", &root),
            ("E", &root),
            ("q", &root),
        ] {
            filters.push(format!(r##"{{"#{tag}":["{value}"]}}"##));
        }
        for (i, f) in filters.iter().enumerate() {
            ws.send(tungstenite::Message::text(format!(r#"["REQ","s{i}",{f}]"#)))
                .expect("REQ");
        }
        clients.push(ws);
    }
    let opened = wait_until(SETTLE_DEADLINE, || world.open_subscriptions() >= 7 * n);
    assert!(opened, "the clients' subscriptions did not open");
    std::thread::sleep(SETTLE_PAUSE);
    let with_clients = rss_kib();
    drop(clients);
    json!({ "relays_only_kib": relays_only, "with_clients_kib": with_clients })
}

/// TestRelay listeners serving `n` probe relays (see [`World`]).
fn listeners(n: usize) -> usize {
    n.min(PROBE_LISTENERS)
}

fn run_probe(what: &str, idle: Duration) -> Value {
    let (mode, n) = what.split_once(':').expect("probe MODE:N");
    let n: usize = n.parse().expect("probe count");
    match mode {
        "engine" => probe_engine(n, idle),
        "clients" => probe_clients(n),
        other => panic!("unknown probe {other}"),
    }
}

fn kib(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(0.0)
}

fn memory_figures(sizes: &Sizes, notes: &mut Vec<String>) -> Vec<Figure> {
    let mut figures = Vec::new();
    let base = probe("engine:0", Duration::ZERO);
    let engine_delta = |v: &Value| kib(v, "with_engine_kib") - kib(v, "relays_only_kib");
    let base_delta = engine_delta(&base);
    figures.push(Figure::new(
        "memory: RSS, engine with 0 relays",
        kib(&base, "with_engine_kib") / 1024.0,
        "MiB",
        Budget::None,
    ));
    for &n in &sizes.memory_relays[1..] {
        let idle = if n == sizes.memory_relays[2] {
            sizes.idle
        } else {
            Duration::ZERO
        };
        let engine = probe(&format!("engine:{n}"), idle);
        let clients = probe(&format!("clients:{n}"), Duration::ZERO);
        let relay_side = kib(&clients, "with_clients_kib") - kib(&clients, "relays_only_kib");
        let raw = (engine_delta(&engine) - base_delta) / n as f64;
        figures.push(Figure::new(
            format!("memory: RSS, engine with {n} relays"),
            kib(&engine, "with_engine_kib") / 1024.0,
            "MiB",
            Budget::None,
        ));
        figures.push(Figure::new(
            format!("memory: per relay at {n}, relays' connection side included"),
            raw,
            "KiB",
            Budget::None,
        ));
        figures.push(Figure::new(
            format!("memory: per relay at {n}, engine only"),
            raw - relay_side / n as f64,
            "KiB",
            Budget::AtMost(64.0),
        ));
        notes.push(format!(
            "{n} relays: settled {:.2} s after the engine started; {} subscriptions open on the \
             remotes; TestRelay side of one connection ≈ {:.0} KiB",
            kib(&engine, "settle_secs"),
            engine["subscriptions"],
            relay_side / n as f64
        ));
        if idle > Duration::ZERO {
            figures.push(Figure::new(
                format!("idle CPU, {n} relays, {} s, engine threads", idle.as_secs()),
                engine["idle_cpu_pct"].as_f64().unwrap_or(f64::NAN),
                "% core",
                Budget::AtMost(1.0),
            ));
            notes.push(format!(
                "idle CPU at {n} relays by thread kind (% of a core): {}",
                engine["idle_cpu_pct_by_thread"]
            ));
        }
    }
    figures
}

// ----- planning (sans-IO machine) -----

const PLAN_OWN: &str = "ws://own.example";
/// One-event batches: up to `Sizes::plan_samples`, at least this many, sampling stops after
/// [`PLAN_SAMPLING`].
const MIN_PLAN_SAMPLES: usize = 3;
const PLAN_SAMPLING: Duration = Duration::from_secs(10);

/// An unsigned event with a made-up id: the machine never verifies (the relay threads do).
fn fake_event(n: u64, pubkey: nostr::key::PublicKey, kind: u16, tags: Vec<Tag>) -> Event {
    let mut id = [0u8; 32];
    id[..8].copy_from_slice(&n.to_le_bytes());
    id[8] = kind as u8;
    Event::new(
        EventId::from_slice(&id).expect("id"),
        pubkey,
        Timestamp::from_secs(1_700_000_000),
        Kind::Custom(kind),
        tags,
        "",
        Signature::from_byte_array([0u8; 64]),
    )
}

struct Planner {
    m: SyncMachine,
    now: Time,
    own_gen: u64,
    window: Duration,
    owners: Vec<nostr::key::PublicKey>,
    next_id: u64,
    /// Batches applied while events were fed (a full batch is applied at once, inside the
    /// `handle_report` that fills it): the wall time of each, commands drained.
    ticks: Vec<Duration>,
}

impl Planner {
    /// A machine with its own relay connected and read; `max_batch` self-subscription
    /// events at most per batch (`usize::MAX`: everything in one batch).
    fn new(max_batch: usize) -> Planner {
        let mut c = SyncConfig::new(RelayUrl::parse(PLAN_OWN).expect("url"));
        c.max_batch_events = max_batch;
        let window = c.batch_window;
        let mut m = SyncMachine::new(c);
        let now = Time::from_secs(1_700_000_000);
        m.start(now);
        let mut p = Planner {
            m,
            now,
            own_gen: 0,
            window,
            owners: Vec::new(),
            next_id: 0,
            ticks: Vec::new(),
        };
        for cmd in p.drain() {
            if let Command::Connect { relay, generation } = cmd {
                if relay.as_str() == PLAN_OWN {
                    p.own_gen = generation;
                    p.m.handle_report(Report::Connected { relay, generation }, now);
                }
            }
        }
        p.answer_all();
        p
    }

    fn drain(&mut self) -> Vec<Command> {
        std::iter::from_fn(|| self.m.poll_command()).collect()
    }

    /// Connects the relays of `connect` when asked to and answers every query with an empty
    /// EOSE, until the machine asks for nothing more. Other relays stay connecting, to keep
    /// the run short (each `Connected` diffs and subscribes that relay's whole target).
    fn answer(&mut self, mut cmds: Vec<Command>, connect: &[RelayUrl]) {
        while !cmds.is_empty() {
            for cmd in cmds {
                let report = match cmd {
                    Command::Connect { relay, generation } if connect.contains(&relay) => {
                        Report::Connected { relay, generation }
                    }
                    Command::SubscribeMany {
                        relay,
                        generation,
                        members,
                    } => {
                        for (sub_id, _) in members {
                            let report = Report::Eose {
                                relay: relay.clone(),
                                generation,
                                sub_id,
                                stats: PageStats::default(),
                            };
                            self.m.handle_report(report, self.now);
                        }
                        continue;
                    }
                    Command::Subscribe {
                        relay,
                        generation,
                        sub_id,
                        ..
                    } => Report::Eose {
                        relay,
                        generation,
                        sub_id,
                        stats: PageStats::default(),
                    },
                    _ => continue,
                };
                self.m.handle_report(report, self.now);
            }
            cmds = self.drain();
        }
    }

    fn answer_all(&mut self) {
        let cmds = self.drain();
        self.answer(cmds, &[]);
    }

    /// One self-subscription event. When it fills a batch (`max_batch_events`), the batch
    /// is applied inside this report: that report's wall time, with its commands drained,
    /// is recorded in `ticks`.
    fn self_event(&mut self, event: Event) {
        let report = Report::SelfEvent {
            generation: self.own_gen,
            event: Box::new(event),
        };
        let batches = self.m.counters().self_batches;
        let started = Instant::now();
        self.m.handle_report(report, self.now);
        if self.m.counters().self_batches != batches {
            let cmds = self.drain();
            self.ticks.push(started.elapsed());
            self.answer(cmds, &[]);
        }
    }

    fn repo(&self, r: usize) -> String {
        let owner = self.owners[r / REPOS_PER_OWNER];
        format!("30617:{}:repo-{r}", owner.to_hex())
    }

    fn root(&mut self, repo: usize) -> Event {
        self.next_id += 1;
        let tag = Tag::parse(["a", &self.repo(repo)]).expect("tag");
        fake_event(self.next_id, self.owners[0], 1621, vec![tag])
    }

    /// The two relays repository `r` lists.
    fn relays_of(r: usize, relays: usize) -> [RelayUrl; 2] {
        [r % relays, (r * 7 + 3) % relays]
            .map(|i| RelayUrl::parse(&format!("ws://r{i}.example")).expect("url"))
    }

    /// Feeds `repos` announcements (2 relays each, [`REPOS_PER_OWNER`] repositories per
    /// owner) and `roots` root events, interleaved as a relay's answer mixes them (one
    /// announcement after every `roots / repos` root events), as one read of the own relay.
    fn feed_world(&mut self, repos: usize, relays: usize, roots: usize) {
        self.owners = (0..repos.div_ceil(REPOS_PER_OWNER))
            .map(|_| Keys::generate().public_key())
            .collect();
        let every = (roots / repos.max(1)).max(1);
        let mut next_root = 0;
        for r in 0..repos {
            self.next_id += 1;
            let [a, b] = Self::relays_of(r, relays);
            let tags = vec![
                Tag::parse(["d", &format!("repo-{r}")]).expect("tag"),
                Tag::parse(["relays", a.as_str(), b.as_str()]).expect("tag"),
            ];
            let e = fake_event(self.next_id, self.owners[r / REPOS_PER_OWNER], 30617, tags);
            self.self_event(e);
            let until = if r + 1 == repos {
                roots
            } else {
                (next_root + every).min(roots)
            };
            while next_root < until {
                let e = self.root(next_root % repos);
                self.self_event(e);
                next_root += 1;
            }
        }
    }

    /// One batch tick (index update, targets, compute_actions): its wall time. The
    /// connects it asks for are left unanswered, except for `connect` (answered as in
    /// [`Planner::answer`]).
    fn tick(&mut self, connect: &[RelayUrl]) -> Duration {
        self.now = self.now.plus(self.window);
        let started = Instant::now();
        self.m.handle_timeout(self.now);
        let cmds = self.drain();
        let took = started.elapsed();
        self.answer(cmds, connect);
        took
    }

    /// The wall time of the `Connected` report of `relay` (its subscriptions are then
    /// answered, untimed).
    fn connect(&mut self, relay: &RelayUrl) -> Duration {
        let generation = self.m.relay(relay).unwrap().state().generation;
        let report = Report::Connected {
            relay: relay.clone(),
            generation,
        };
        let started = Instant::now();
        self.m.handle_report(report, self.now);
        let cmds = self.drain();
        let took = started.elapsed();
        self.answer(cmds, &[]);
        took
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// CPU time (user + system) of the calling thread so far, in seconds (`/proc/thread-self/stat`,
/// clock-tick resolution: only for figures of many ticks).
fn thread_cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    stat_cpu_ticks(&stat) as f64 / clock_ticks_per_sec()
}

/// utime + stime (clock ticks) of a `/proc/…/stat` line: fields 14 and 15, counted after the
/// ")" that ends the thread's name (a name may hold spaces and parentheses).
fn stat_cpu_ticks(stat: &str) -> u64 {
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    rest.split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum()
}

fn planning_figures(sizes: &Sizes) -> Vec<Figure> {
    let mut figures = Vec::new();
    for &repos in &sizes.plan_repos {
        let label = format!(
            "planning, {} repos, {} relays, {} roots",
            number(repos as f64),
            number(sizes.plan_relays as f64),
            number(sizes.plan_roots as f64)
        );
        // The whole first read as the engine applies it: batches of the default
        // `max_batch_events`, so no tick applies more than that many events.
        let batch = SyncConfig::new(RelayUrl::parse(PLAN_OWN).expect("url")).max_batch_events;
        let mut p = Planner::new(batch);
        let cpu_before = thread_cpu_secs();
        p.feed_world(repos, sizes.plan_relays, sizes.plan_roots);
        let last = p.tick(&[]);
        let read_cpu = thread_cpu_secs() - cpu_before;
        p.ticks.push(last);
        let longest = p.ticks.iter().copied().max().unwrap_or_default();
        let total: Duration = p.ticks.iter().sum();
        let full_budget = if repos == 100_000 {
            Budget::AtMost(200.0)
        } else {
            Budget::None
        };
        figures.push(Figure::new(
            format!(
                "{label}: full rebuild, longest of {} batch ticks (≤ {} events each)",
                p.ticks.len(),
                number(batch as f64)
            ),
            ms(longest),
            "ms",
            full_budget,
        ));
        figures.push(Figure::new(
            format!("{label}: full rebuild, all its batch ticks"),
            ms(total),
            "ms",
            Budget::None,
        ));
        figures.push(Figure::new(
            format!("{label}: full rebuild, CPU of the whole read (events classified too)"),
            read_cpu * 1e3,
            "ms",
            Budget::None,
        ));
        drop(p);
        // For comparison: every event in one batch, which the engine never does
        // (`max_batch_events` unlimited).
        let mut p = Planner::new(usize::MAX);
        p.feed_world(repos, sizes.plan_relays, sizes.plan_roots);
        let one_tick = p.tick(&[]);
        figures.push(Figure::new(
            format!("{label}: everything in one tick (max_batch_events unlimited)"),
            ms(one_tick),
            "ms",
            Budget::None,
        ));
        // Repository 0's relays connect (and get their subscriptions); the others stay
        // connecting, so a new root of repository 0 changes subscriptions on 2 relays.
        let connected = Planner::relays_of(0, sizes.plan_relays);
        let connect: Vec<Duration> = connected.iter().map(|r| p.connect(r)).collect();
        let sampling = Instant::now();
        let mut one: Vec<Duration> = Vec::new();
        while one.len() < sizes.plan_samples
            && (one.len() < MIN_PLAN_SAMPLES || sampling.elapsed() < PLAN_SAMPLING)
        {
            let e = p.root(0);
            p.self_event(e);
            one.push(p.tick(&connected));
        }
        one.sort();
        figures.push(Figure::new(
            format!("{label}: one relay's Connected report"),
            ms(connect.iter().copied().max().unwrap_or_default()),
            "ms",
            Budget::None,
        ));
        figures.push(Figure::new(
            format!("{label}: one-event batch (median of {})", one.len()),
            ms(one[one.len() / 2]),
            "ms",
            Budget::AtMost(1.0),
        ));
    }
    figures
}

// ----- persisted state (issue 11) -----

/// The state file at its caps: 1,000 relays sharing 100,000 confirmed items (coordinates of
/// typical length and root ids), rendered, written atomically, read back and restored.
fn state_figures() -> Vec<Figure> {
    use grasp_sync::core::sync::{RelaySnapshot, SyncSnapshot, MAX_STATE_ITEMS};
    use grasp_sync::testing::internals::state_file;
    let relays = 1_000;
    let per_relay = MAX_STATE_ITEMS / relays;
    let now = Time::from_millis(SystemTimeMs::now());
    let mut snap = SyncSnapshot {
        taken_at_ms: now.wall_millis(),
        ..Default::default()
    };
    let pk = Keys::generate().public_key().to_hex();
    for r in 0..relays {
        let mut e = RelaySnapshot {
            connected: true,
            catch_up_since: now.timestamp().as_secs() - 3_600,
            next_daily_ms: Some(now.wall_millis() + 20 * 3_600_000),
            ..Default::default()
        };
        for i in 0..per_relay {
            if i % 4 == 0 {
                e.repos.push(format!("30617:{pk}:repository-{r}-{i}"));
            } else {
                let mut b = [0u8; 32];
                b[..8].copy_from_slice(&((r * per_relay + i) as u64).to_be_bytes());
                e.root_events.push(EventId::from_byte_array(b).to_hex());
            }
        }
        snap.relays.insert(format!("wss://relay{r}.example.com"), e);
    }
    let dir = std::env::temp_dir().join(format!("grasp-sync-bench-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let t = Instant::now();
    let text = state_file::render(&snap, "ws://127.0.0.1:7777", "k");
    let render = t.elapsed();
    let t = Instant::now();
    let bytes = state_file::write_atomically(&dir, &text).expect("write");
    let write = t.elapsed();
    let t = Instant::now();
    let loaded = state_file::load(&dir, "ws://127.0.0.1:7777", "k");
    let load = t.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    let state_file::Loaded::Snapshot(loaded) = loaded else {
        panic!("the written file did not load: {loaded:?}");
    };
    let mut m = SyncMachine::new(SyncConfig::new(
        RelayUrl::parse("ws://127.0.0.1:7777").unwrap(),
    ));
    let t = Instant::now();
    let report = m.restore(loaded, now.plus(Duration::from_secs(60)));
    let restore = t.elapsed();
    assert_eq!(report.relays_restored, relays, "{report:?}");
    let label = format!(
        "state file, {relays} relays, {} items",
        number(MAX_STATE_ITEMS as f64)
    );
    vec![
        Figure::new(
            format!("{label}: size"),
            bytes as f64 / 1e6,
            "MB",
            Budget::AtMost(32.0),
        ),
        Figure::new(format!("{label}: render"), ms(render), "ms", Budget::None),
        Figure::new(
            format!("{label}: atomic write (fsync)"),
            ms(write),
            "ms",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: read and parse"),
            ms(load),
            "ms",
            Budget::None,
        ),
        Figure::new(format!("{label}: restore"), ms(restore), "ms", Budget::None),
    ]
}

/// Wall clock in Unix milliseconds.
struct SystemTimeMs;

impl SystemTimeMs {
    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }
}

// ----- NIP-77 -----

/// `n` event JSONs like a NIP-34 reply (~1 KB), each with its own id and `created_at`
/// (`Event::from_json` does not check ids or signatures, and the own side checks neither).
fn nip77_events(n: usize) -> (Vec<String>, Vec<(u64, EventId)>) {
    let keys = Keys::generate();
    let template = EventBuilder::new(Kind::Custom(1111), "x".repeat(700))
        .tag(Tag::parse(["E", &"ab".repeat(32)]).expect("tag"))
        .custom_created_at(Timestamp::from_secs(1_700_000_000))
        .finalize(&keys)
        .expect("signed")
        .as_json();
    let id = serde_json::from_str::<Value>(&template).expect("json")["id"]
        .as_str()
        .expect("id")
        .to_string();
    let mut jsons = Vec::with_capacity(n);
    let mut pairs = Vec::with_capacity(n);
    for i in 0..n {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&(i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes());
        bytes[8..16].copy_from_slice(&(i as u64).to_be_bytes());
        let eid = EventId::from_byte_array(bytes);
        let t = 1_600_000_000 + i as u64;
        jsons.push(
            template
                .replace(&id, &eid.to_hex())
                .replace("1700000000", &t.to_string()),
        );
        pairs.push((t, eid));
    }
    (jsons, pairs)
}

fn neg_storage(pairs: &[(u64, EventId)]) -> negentropy::NegentropyStorageVector {
    let mut s = negentropy::NegentropyStorageVector::with_capacity(pairs.len());
    for (t, id) in pairs {
        s.insert(*t, negentropy::Id::from_byte_array(id.to_bytes()))
            .expect("insert");
    }
    s.seal().expect("seal");
    s
}

/// The own side of one reconciliation of `n` events, and reconciliations with 0 %, 1 % and
/// 50 % of them missing on the own relay: client and server work, rounds, bytes.
fn nip77_figures(sizes: &Sizes, notes: &mut Vec<String>) -> Vec<Figure> {
    let mut figures = Vec::new();
    for &n in &sizes.nip77_sizes {
        let (jsons, pairs) = nip77_events(n);
        let req_bytes: usize = jsons.iter().map(|j| j.len() + 20).sum();
        let t = Instant::now();
        let mut own: Vec<(u64, EventId)> = Vec::with_capacity(n);
        for j in &jsons {
            let e = Event::from_json(j).expect("event");
            own.push((e.created_at.as_secs(), e.id));
        }
        let parse = t.elapsed();
        assert_eq!(own.len(), n);
        figures.push(Figure::new(
            format!(
                "nip77: own side of {} events (parse, keep pairs)",
                number(n as f64)
            ),
            parse.as_secs_f64() * 1000.0,
            "ms",
            Budget::None,
        ));
        for missing_pct in [0usize, 1, 50] {
            let own_pairs: Vec<(u64, EventId)> = pairs
                .iter()
                .enumerate()
                .filter(|(i, _)| i % 100 >= missing_pct)
                .map(|(_, p)| *p)
                .collect();
            let k = n - own_pairs.len();
            let t = Instant::now();
            let mut client =
                negentropy::Negentropy::owned(neg_storage(&own_pairs), 60_000).expect("client");
            let mut server = negentropy::Negentropy::owned(neg_storage(&pairs), 0).expect("server");
            let mut msg = client.initiate().expect("initiate");
            let (mut rounds, mut bytes, mut need_total) = (0usize, 0usize, 0usize);
            loop {
                bytes += 2 * msg.len();
                let reply = server.reconcile(&msg).expect("server");
                bytes += 2 * reply.len();
                rounds += 1;
                let (mut have, mut need) = (Vec::new(), Vec::new());
                let next = client
                    .reconcile_with_ids(&reply, &mut have, &mut need)
                    .expect("client");
                need_total += need.len();
                match next {
                    Some(m) => msg = m,
                    None => break,
                }
            }
            let work = t.elapsed();
            assert_eq!(need_total, k, "every missing id found");
            let label = format!(
                "nip77: {} events, {}% missing",
                number(n as f64),
                missing_pct
            );
            figures.push(Figure::new(
                format!("{label}: negentropy CPU (both sides)"),
                work.as_secs_f64() * 1000.0,
                "ms",
                Budget::None,
            ));
            figures.push(Figure::new(
                format!("{label}: rounds"),
                rounds as f64,
                "",
                Budget::None,
            ));
            figures.push(Figure::new(
                format!("{label}: NEG bytes + fetched events"),
                (bytes + k * (req_bytes / n.max(1))) as f64 / 1024.0,
                "KiB",
                Budget::None,
            ));
        }
        notes.push(format!(
            "nip77: the REQ path moves {:.0} KiB for {} events (and checks as many signatures)",
            req_bytes as f64 / 1024.0,
            number(n as f64)
        ));
    }
    figures
}

// ----- main -----

/// A sync of `n` events (issues and replies of one repository on one remote relay) into an
/// own relay that accepts 120 events a minute per connection (15 at once, then one per
/// 500 ms: ngit-relay's limiter at another rate; `TestRelayOptions::write_rate`). The
/// forwarder paces itself (decision 0072): the figure is how long the sync takes against the
/// relay's own minimum, and how many writes were refused per event stored.
fn throttled_figures(n: usize, notes: &mut Vec<String>) -> Vec<Figure> {
    use grasp_sync::testing::{TestRelayOptions, WriteRate};
    let own = TestRelay::start_with(TestRelayOptions {
        write_rate: Some(WriteRate::new(15, Duration::from_millis(500))),
        ..TestRelayOptions::default()
    });
    let remote = TestRelay::start();
    let keys = Keys::generate();
    let ann = EventBuilder::new(Kind::Custom(30617), "")
        .tag(Tag::parse(["d", "r"]).unwrap())
        .tag(Tag::parse(["relays", &remote.url()]).unwrap())
        .finalize(&keys)
        .unwrap();
    own.insert(&ann);
    remote.insert(&ann);
    let coordinate = format!("30617:{}:r", keys.public_key().to_hex());
    let mut expected: HashSet<EventId> = [ann.id].into();
    let mut root: Option<Event> = None;
    // One second each, as a repository's history has: a relay without NIP-11 limits is read
    // in pages of 20, which cannot split more than 20 events of one author in one second.
    let base = Timestamp::now().as_secs() - 86_400;
    for i in 0..n {
        let at = Timestamp::from_secs(base - (n - i) as u64);
        let e = match &root {
            Some(r) if i % 2 == 1 => EventBuilder::new(Kind::Custom(1111), format!("reply {i}"))
                .tag(Tag::parse(["E", &r.id.to_hex()]).unwrap())
                .custom_created_at(at)
                .finalize(&keys)
                .unwrap(),
            _ => EventBuilder::new(Kind::Custom(1621), format!("issue {i}"))
                .tag(Tag::parse(["a", &coordinate]).unwrap())
                .custom_created_at(at)
                .finalize(&keys)
                .unwrap(),
        };
        if e.kind == Kind::Custom(1621) {
            root = Some(e.clone());
        }
        remote.insert_silently(&e);
        expected.insert(e.id);
    }
    let config = Config::new(RelayUrl::parse(&own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    let handle = grasp_sync::start(config).expect("start");
    let t0 = Instant::now();
    let done = wait_until(Duration::from_secs(3 * 3600), || {
        own.event_ids().len() == expected.len()
    });
    let took = t0.elapsed().as_secs_f64();
    let status = handle.status();
    let _ = handle.shutdown(Duration::from_secs(10));
    if !done {
        notes.push(format!(
            "throttled: the own relay holds {} of {} events after 3 h",
            own.len(),
            expected.len()
        ));
    }
    // The relay's own minimum: 15 at once, then two a second.
    let minimum = (n.saturating_sub(15)) as f64 / 2.0;
    let stored = status.forwarded.max(1) as f64;
    notes.push(format!(
        "throttled: {n} events into an own relay taking 120 a minute: {:.1} min (the relay's minimum {:.1} min); {} rate-limited answers",
        took / 60.0,
        minimum / 60.0,
        status.forward_rate_limited
    ));
    vec![
        Figure::new(
            format!("throttled own relay: sync of {n} events at 120 a minute"),
            took / 60.0,
            "min",
            Budget::AtMost(minimum / 60.0 * 1.25),
        ),
        Figure::new(
            "throttled own relay: refused writes per event stored",
            status.forward_rate_limited as f64 / stored,
            "",
            Budget::AtMost(1.0),
        ),
    ]
}

// ----- hostile at scale (issue 20) -----

/// The release binary beside this bench (`cargo build --release` first).
fn release_binary() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    // target/release/examples/bench → target/release/grasp-sync
    let bin = exe.parent()?.parent()?.join("grasp-sync");
    bin.exists().then_some(bin)
}

/// CPU seconds of the threads of process `pid` named `name` (scheduler run time).
fn process_thread_cpu(pid: u32, name: &str) -> f64 {
    let mut total = 0.0;
    let dir = format!("/proc/{pid}/task");
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        if let Some(ns) = std::fs::read_to_string(entry.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        {
            total += ns as f64 / 1e9;
        }
    }
    total
}

/// A free port on 127.0.0.1.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The `grasp-sync` binary as its own process against `own`, with `/status` on a port of
/// its own; killed on drop.
struct Daemon {
    child: std::process::Child,
    status: std::net::SocketAddr,
}

impl Daemon {
    fn start(bin: &std::path::Path, own: &TestRelay, extra: &[&str]) -> Daemon {
        let status: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = Process::new(bin)
            .args([
                "--own-relay",
                &own.url(),
                "--metrics-addr",
                &status.to_string(),
            ])
            .args(["--batch-window", "200"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start grasp-sync");
        let d = Daemon { child, status };
        assert!(
            wait_until(Duration::from_secs(30), || d.get().is_some()),
            "grasp-sync did not serve /status"
        );
        d
    }

    /// `/status`, and how long it took to answer.
    fn get_timed(&self) -> Option<(Value, f64)> {
        let t = Instant::now();
        let (code, body) =
            grasp_sync::ops::http::get(self.status, "/status", Duration::from_secs(30)).ok()?;
        let took = t.elapsed().as_secs_f64();
        (code == 200).then(|| serde_json::from_str(&body).ok().map(|v| (v, took)))?
    }

    fn get(&self) -> Option<Value> {
        self.get_timed().map(|(v, _)| v)
    }

    fn cpu(&self, thread: &str) -> f64 {
        process_thread_cpu(self.child.id(), thread)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads `/status` every 50 ms until `done` says so (or `limit` passes): the last document,
/// the latencies seen (ms) and whether `done` came.
fn watch(d: &Daemon, limit: Duration, done: impl Fn(&Value) -> bool) -> (Value, Vec<f64>, bool) {
    let end = Instant::now() + limit;
    let mut lat = Vec::new();
    let mut last = Value::Null;
    while Instant::now() < end {
        if let Some((doc, took)) = d.get_timed() {
            lat.push(took * 1e3);
            let finished = done(&doc);
            last = doc;
            if finished {
                return (last, lat, true);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (last, lat, false)
}

fn max_of(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// Refused relay URLs: `n_keys` keys announcing `urls_per_key` private addresses each (in
/// announcements of at most 25 relays), every address its own host.
fn refusal_flood(own: &TestRelay, n_keys: usize, urls_per_key: usize) -> usize {
    let mut next = 0u32;
    for _ in 0..n_keys {
        let keys = Keys::generate();
        let mut left = urls_per_key;
        let mut d = 0;
        while left > 0 {
            let take = left.min(25);
            let relays: Vec<String> = (0..take)
                .map(|_| {
                    next += 1;
                    format!(
                        "ws://10.{}.{}.{}:7000",
                        next >> 16 & 255,
                        next >> 8 & 255,
                        next & 255
                    )
                })
                .collect();
            let mut tag = vec!["relays".to_string()];
            tag.extend(relays);
            let ann = EventBuilder::new(Kind::Custom(30617), "")
                .tag(Tag::parse(["d", &format!("r{d}")]).unwrap())
                .tag(Tag::parse(tag).unwrap())
                .finalize(&keys)
                .unwrap();
            own.insert_silently(&ann);
            left -= take;
            d += 1;
        }
    }
    next as usize
}

/// A repository with `issues` issues and `replies` replies on each of `remotes`; returns
/// the ids that must reach the own relay.
fn live_repository(
    own: &TestRelay,
    remotes: &[&TestRelay],
    issues: usize,
    replies: usize,
) -> HashSet<EventId> {
    let keys = Keys::generate();
    let mut tag = vec!["relays".to_string()];
    tag.extend(remotes.iter().map(|r| r.url()));
    let ann = EventBuilder::new(Kind::Custom(30617), "")
        .tag(Tag::parse(["d", "legit"]).unwrap())
        .tag(Tag::parse(tag).unwrap())
        .finalize(&keys)
        .unwrap();
    let coordinate = format!("30617:{}:legit", keys.public_key().to_hex());
    let issue = EventBuilder::new(Kind::Custom(1621), "a bug")
        .tag(Tag::parse(["a", &coordinate]).unwrap())
        .finalize(&keys)
        .unwrap();
    own.insert(&ann);
    own.insert(&issue);
    for i in 1..issues {
        let more = EventBuilder::new(Kind::Custom(1621), format!("bug {i}"))
            .tag(Tag::parse(["a", &coordinate]).unwrap())
            .finalize(&keys)
            .unwrap();
        own.insert(&more);
    }
    let mut want = HashSet::new();
    for (n, r) in remotes.iter().enumerate() {
        r.insert(&ann);
        r.insert(&issue);
        for i in 0..replies {
            let e = EventBuilder::new(Kind::Custom(1111), format!("reply {n}/{i}"))
                .tag(Tag::parse(["E", &issue.id.to_hex()]).unwrap())
                .finalize(&keys)
                .unwrap();
            r.insert(&e);
            want.insert(e.id);
        }
    }
    want
}

/// Listeners on 127.0.0.1 that accept TCP and never answer, served by one thread.
struct BlackHoles {
    urls: Vec<String>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BlackHoles {
    fn start(n: usize) -> BlackHoles {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let listeners: Vec<std::net::TcpListener> = (0..n)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                l.set_nonblocking(true).unwrap();
                l
            })
            .collect();
        let urls = listeners
            .iter()
            .map(|l| format!("ws://{}", l.local_addr().unwrap()))
            .collect();
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stop2.load(Ordering::SeqCst) {
                let mut any = false;
                for l in &listeners {
                    while let Ok((s, _)) = l.accept() {
                        held.push(s);
                        any = true;
                    }
                }
                if !any {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        });
        BlackHoles {
            urls,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for BlackHoles {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Issue 20's tries from outside, with the release binary as its own process.
fn hostile_figures(notes: &mut Vec<String>) -> Vec<Figure> {
    let Some(bin) = release_binary() else {
        notes.push("hostile: no target/release/grasp-sync: run cargo build --release first".into());
        return Vec::new();
    };
    let mut figures = Vec::new();
    // 1. Refused URLs: 10,000 of one key, then one each of 10,000 keys.
    for (keys, per_key) in [(1usize, 10_000usize), (10_000, 1)] {
        let own = TestRelay::start();
        let n = refusal_flood(&own, keys, per_key);
        let legit_remote = TestRelay::start();
        let want = live_repository(&own, &[&legit_remote], 5, 20);
        let d = Daemon::start(&bin, &own, &["--allow-relay", "127.0.0.1"]);
        let t0 = Instant::now();
        let cpu0 = d.cpu("coordinator");
        let expect_excluded = if keys == 1 { 16 } else { n };
        let (doc, lat, done) = watch(&d, Duration::from_secs(600), |doc| {
            doc["sync"]["relays_excluded"].as_u64().unwrap_or(0) as usize >= expect_excluded
                && doc["settled"].as_bool() == Some(true)
        });
        let took = t0.elapsed().as_secs_f64();
        let cpu = d.cpu("coordinator") - cpu0;
        let synced = want.iter().all(|id| own.contains(id));
        let what = if keys == 1 {
            format!("{n} refused URLs of one key")
        } else {
            format!("{n} keys with one refused URL each")
        };
        notes.push(format!(
            "hostile: {what}: settled {done} in {took:.1} s; excluded {}, hosts excluded {}, pubkeys blocked {}, selections {}; coordinator CPU {cpu:.3} s; /status max {:.1} ms over {} reads; the repository with activity synced: {synced}",
            doc["sync"]["relays_excluded"], doc["sync"]["hosts_excluded"], doc["sync"]["pubkeys_blocked"], doc["sync"]["selections"], max_of(&lat), lat.len()
        ));
        figures.push(Figure::new(
            format!("hostile: {what}: coordinator CPU"),
            cpu,
            "s",
            Budget::AtMost(if keys == 1 { 1.0 } else { 10.0 }),
        ));
        figures.push(Figure::new(
            format!("hostile: {what}: slowest /status"),
            max_of(&lat),
            "ms",
            Budget::AtMost(1_000.0),
        ));
    }
    // 2. 1,000 throw-away keys on black holes against a repository with five issues: keys
    //    without activity, keys with an issue each, and (rotation only) a repository with
    //    one issue like theirs, which waits for the black holes to fail in turn.
    for (spam_life, issues) in [(false, 5), (true, 5), (true, 1)] {
        let own = TestRelay::start();
        let holes = BlackHoles::start(1_000);
        for hole in &holes.urls {
            let k = Keys::generate();
            let ann = EventBuilder::new(Kind::Custom(30617), "")
                .tag(Tag::parse(["d", "x"]).unwrap())
                .tag(Tag::parse(["relays", hole]).unwrap())
                .finalize(&k)
                .unwrap();
            own.insert_silently(&ann);
            if spam_life {
                let coordinate = format!("30617:{}:x", k.public_key().to_hex());
                let issue = EventBuilder::new(Kind::Custom(1621), "spam")
                    .tag(Tag::parse(["a", &coordinate]).unwrap())
                    .finalize(&k)
                    .unwrap();
                own.insert_silently(&issue);
            }
        }
        let (a, b) = (TestRelay::start(), TestRelay::start());
        let want = live_repository(&own, &[&a, &b], issues, 20);
        let d = Daemon::start(
            &bin,
            &own,
            &["--allow-private-relays", "--max-relays", "100"],
        );
        let t0 = Instant::now();
        let done = wait_until(Duration::from_secs(600), || {
            want.iter().all(|id| own.contains(id))
        });
        let took = t0.elapsed().as_secs_f64();
        let doc = d.get().unwrap_or(Value::Null);
        let what = match (spam_life, issues) {
            (false, _) => "1,000 throw-away keys on black holes".to_string(),
            (true, 1) => "1,000 keys with an issue each on black holes, repository with one issue"
                .to_string(),
            (true, _) => "1,000 throw-away keys with an issue each on black holes".to_string(),
        };
        notes.push(format!(
            "hostile: {what}, --max-relays 100: the repository with activity synced {done} after {took:.1} s; relays failing {}",
            doc["selection"]["relays_failing"]
        ));
        // With equal activity only the rotation helps: about 1,000 / 100 connect deadlines.
        let budget = if issues > 1 {
            Budget::AtMost(60.0)
        } else {
            Budget::None
        };
        figures.push(Figure::new(
            format!("hostile: {what}: repository synced after"),
            took,
            "s",
            budget,
        ));
    }
    // 3. 64 spellings of one relay.
    {
        let own = TestRelay::start();
        let remote = TestRelay::start();
        for k in 0..8 {
            let keys = Keys::generate();
            let mut tag = vec!["relays".to_string()];
            tag.extend((0..8).map(|i| format!("{}/?{}", remote.url(), k * 8 + i)));
            let ann = EventBuilder::new(Kind::Custom(30617), "")
                .tag(Tag::parse(["d", "x"]).unwrap())
                .tag(Tag::parse(tag).unwrap())
                .finalize(&keys)
                .unwrap();
            own.insert(&ann);
        }
        let d = Daemon::start(&bin, &own, &["--allow-private-relays"]);
        let (doc, _, _) = watch(&d, Duration::from_secs(60), |doc| {
            doc["settled"].as_bool() == Some(true)
        });
        notes.push(format!(
            "hostile: 64 spellings of one relay: {} websocket connections, hosts {}",
            remote.connections_accepted(),
            doc["selection"]["hosts_with_several_urls"]
        ));
        figures.push(Figure::new(
            "hostile: 64 spellings of one relay: connections opened",
            remote.connections_accepted() as f64,
            "",
            Budget::AtMost(4.0),
        ));
    }
    figures.extend(bought_and_tags_figures(notes));
    figures
}

/// Issue 36's two cases from outside (also `--only bought,tags`).
fn bought_and_tags_figures(notes: &mut Vec<String>) -> Vec<Figure> {
    let Some(bin) = release_binary() else {
        notes.push("hostile: no target/release/grasp-sync: run cargo build --release first".into());
        return Vec::new();
    };
    // Bought tiers (issue 36, item 10): 16 throw-away keys with 64 live, silent relays each
    // and 64 issues each (every issue tagging both of the key's repositories), against a
    // real repository with one issue; the cap (1,000) binds.
    let mut figures = vec![bought_tiers(&bin, notes)];
    // Frames of a megabyte of empty tags (issue 36, item 11): dropped before a parse, so the
    // peak RSS grows by about one frame per connection, not by its parse (~20 MiB).
    figures.extend(many_tags_frames(&bin, notes));
    figures
}

/// Issue 36, item 10, against the release binary: how long the real repository waits.
fn bought_tiers(bin: &std::path::Path, notes: &mut Vec<String>) -> Figure {
    let own = TestRelay::start();
    let mut silent = Vec::new();
    for _ in 0..16 {
        let keys = Keys::generate();
        let relays: Vec<TestRelay> = (0..64).map(|_| TestRelay::start()).collect();
        let mut coordinates = Vec::new();
        for (d, half) in relays.chunks(32).enumerate() {
            let mut tag = vec!["relays".to_string()];
            tag.extend(half.iter().map(TestRelay::url));
            let ann = EventBuilder::new(Kind::Custom(30617), "")
                .tag(Tag::parse(["d", &format!("r{d}")]).unwrap())
                .tag(Tag::parse(tag).unwrap())
                .finalize(&keys)
                .unwrap();
            own.insert_silently(&ann);
            coordinates.push(format!("30617:{}:r{d}", keys.public_key().to_hex()));
        }
        for i in 0..64 {
            let mut b = EventBuilder::new(Kind::Custom(1621), format!("bought {i}"));
            for c in &coordinates {
                b = b.tag(Tag::parse(["a", c]).unwrap());
            }
            own.insert_silently(&b.finalize(&keys).unwrap());
        }
        silent.extend(relays);
    }
    let (a, b) = (TestRelay::start(), TestRelay::start());
    let want = live_repository(&own, &[&a, &b], 1, 20);
    let d = Daemon::start(
        bin,
        &own,
        &["--allow-private-relays", "--max-relays", "1000"],
    );
    let t0 = Instant::now();
    let done = wait_until(Duration::from_secs(600), || {
        want.iter().all(|id| own.contains(id))
    });
    let took = t0.elapsed().as_secs_f64();
    let doc = d.get().unwrap_or(Value::Null);
    notes.push(format!(
        "hostile: bought tiers (16 keys × 64 silent relays, 1,024 issues) against a repository with one issue, --max-relays 1000: synced {done} after {took:.1} s; relays in the cap {}",
        doc["selection"]["relays_selected"]
    ));
    drop(silent);
    Figure::new(
        "hostile: bought tiers: the real repository synced after",
        took,
        "s",
        Budget::AtMost(60.0),
    )
}

/// The peak resident set of process `pid` (VmHWM), in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Issue 36, item 11, against the release binary: 32 relays each send 4 frames of a
/// megabyte of empty tags on the daemon's subscriptions.
fn many_tags_frames(bin: &std::path::Path, notes: &mut Vec<String>) -> Vec<Figure> {
    const RELAYS: usize = 32;
    const FRAMES: usize = 4;
    let own = TestRelay::start();
    let remotes: Vec<TestRelay> = (0..RELAYS).map(|_| TestRelay::start()).collect();
    let refs: Vec<&TestRelay> = remotes.iter().collect();
    let want = live_repository(&own, &refs, 1, 1);
    let d = Daemon::start(bin, &own, &["--allow-private-relays"]);
    let (_, _, settled) = watch(&d, Duration::from_secs(300), |doc| {
        doc["settled"].as_bool() == Some(true)
    });
    let synced = want.iter().all(|id| own.contains(id));
    let pid = d.child.id();
    let before = peak_rss_mib(pid);
    let invalid0 = d.get().map_or(0, |v| v["invalid"].as_u64().unwrap_or(0));
    // A megabyte of empty tags: 2,000 tags would be parsed; this has 340,000, just under the 1 MiB frame limit.
    let tags = vec!["[]"; 340_000].join(",");
    let frame = format!(
        r#"{{"id":"{0}","pubkey":"{0}","created_at":1,"kind":1,"tags":[{tags}],"content":"","sig":"{0}{0}"}}"#,
        "0".repeat(64)
    );
    for _ in 0..FRAMES {
        for r in &remotes {
            r.push_to_subscriptions(&frame);
        }
    }
    let expected = (RELAYS * FRAMES) as u64;
    let dropped = wait_until(Duration::from_secs(120), || {
        d.get()
            .is_some_and(|v| v["invalid"].as_u64().unwrap_or(0) >= invalid0 + expected)
    });
    let after = peak_rss_mib(pid);
    let per_connection = (after - before).max(0.0) / RELAYS as f64;
    notes.push(format!(
        "hostile: {RELAYS} relays × {FRAMES} frames of {:.1} MiB of empty tags: settled {settled}, synced {synced}, all dropped {dropped}; peak RSS {before:.1} → {after:.1} MiB ({per_connection:.2} MiB per connection)",
        frame.len() as f64 / (1 << 20) as f64
    ));
    vec![Figure::new(
        "hostile: frames of a megabyte of empty tags: peak RSS per connection",
        per_connection,
        "MiB",
        Budget::AtMost(4.0),
    )]
}

fn main() {
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .try_init();
    let args: Args = argh::from_env();
    if let Some(what) = &args.probe {
        let idle = Duration::from_secs(args.idle_secs.unwrap_or(0));
        println!("{}", run_probe(what, idle));
        return;
    }
    let sizes = Sizes::of(&args);
    let started = Instant::now();
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut notes = Vec::new();
    let mut figures = Vec::new();
    let wanted = |name: &str| {
        args.only
            .as_deref()
            .is_none_or(|only| only.split(',').any(|s| name.starts_with(s.trim())))
    };
    let mut section = |name: &str, f: &mut dyn FnMut(&mut Vec<String>) -> Vec<Figure>| {
        if !wanted(name) {
            return;
        }
        let t = Instant::now();
        eprint!("{name}… ");
        let _ = std::io::stderr().flush();
        figures.extend(f(&mut notes));
        eprintln!("{:.1} s", t.elapsed().as_secs_f64());
    };
    section("historic sync", &mut |n| historic_figures(&sizes, n));
    section("live latency", &mut |_| live_latency(&sizes));
    section("memory and idle CPU", &mut |n| memory_figures(&sizes, n));
    section("planning", &mut |_| planning_figures(&sizes));
    section("state file", &mut |_| state_figures());
    section("resync", &mut |n| resync_figures(&sizes, n));
    section("nip77", &mut |n| nip77_figures(&sizes, n));
    if wanted("process") {
        match process::binaries() {
            Ok(bins) => {
                let large = args
                    .large_events
                    .unwrap_or(if args.quick { 200 } else { 2_000 });
                section("process", &mut |n| {
                    process::process_figures(
                        &bins,
                        sizes.events,
                        sizes.relays,
                        sizes.spread,
                        large,
                        process::Shape {
                            repos: args.repos,
                            seed_roots: args.seed_roots,
                            span: args.span_secs,
                            new_announcements: args.new_announcements,
                        },
                        n,
                    )
                });
            }
            Err(why) => eprintln!("process: skipped: {why}"),
        }
    }
    if args
        .only
        .as_deref()
        .is_some_and(|o| o.contains("throttled"))
    {
        let n = args
            .throttled_events
            .unwrap_or(if args.quick { 200 } else { 2_000 });
        section("throttled own relay", &mut |notes| {
            throttled_figures(n, notes)
        });
    }
    // Issue 37's production case, only when named (`--only production`).
    if args
        .only
        .as_deref()
        .is_some_and(|o| o.contains("production"))
    {
        let (repos, roots, relays) = if args.quick {
            (150, 600, 8)
        } else {
            (900, 3_600, 20)
        };
        section("production", &mut |n| {
            production::production_figures(repos, roots, relays, n)
        });
    }
    if args
        .only
        .as_deref()
        .is_some_and(|o| o.contains("reference"))
    {
        match reference::binaries() {
            Ok(bins) => {
                let q = args.quick;
                let shape = reference::Shape {
                    events: args.events.unwrap_or(if q { 1_000 } else { 20_000 }),
                    relays: args.relays.unwrap_or(if q { 3 } else { 6 }),
                    repos: args.repos.unwrap_or(if q { 10 } else { 200 }),
                    spread: args.spread.unwrap_or(2),
                    plateau: Duration::from_secs(args.plateau_secs.unwrap_or(150)),
                    deadline: Duration::from_secs(1200),
                };
                section("reference", &mut |n| {
                    reference::reference_figures(&bins, &shape, n)
                });
            }
            Err(why) => eprintln!("reference: skipped: {why}"),
        }
    }
    // Issue 37 item 3's yardstick, only when named (`--only pool`).
    if args.only.as_deref().is_some_and(|o| o.contains("pool")) {
        match process::binaries().and_then(|b| Ok((b, pool::sdk_pool_binary()?))) {
            Ok((bins, sdk_pool)) => section("pool", &mut |n| {
                pool::pool_figures(
                    &bins,
                    &sdk_pool,
                    sizes.events,
                    sizes.relays,
                    sizes.spread,
                    args.repos,
                    n,
                )
            }),
            Err(why) => eprintln!("pool: skipped: {why}"),
        }
    }
    if args.only.as_deref().is_some_and(|o| o.contains("hostile")) {
        section("hostile", &mut hostile_figures);
    } else if args
        .only
        .as_deref()
        .is_some_and(|o| o.contains("bought") || o.contains("tags"))
    {
        section("bought tiers and tag frames", &mut bought_and_tags_figures);
    }
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let total = started.elapsed().as_secs_f64();
    notes.push(format!(
        "run took {total:.0} s on {} cores; load average before {}, after {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        load_after
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
    ));
    if args.json {
        let out = json!({
            "quick": args.quick,
            "seconds": total,
            "figures": figures.iter().map(Figure::json).collect::<Vec<_>>(),
            "notes": notes,
        });
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    } else {
        print_table(&figures);
        for n in &notes {
            println!("note: {n}");
        }
    }
}
