//! `--only pool` (issue 37, item 3): the release `grasp-sync` binary beside rust-nostr's
//! nostr-sdk pool (`sdk-pool` of tests/nip77-relay, at nostr-sdk's defaults) on the process
//! section's data and relays: the same remote relay processes (`LocalRelay`), each side into a
//! fresh own relay (`LocalRelay`) holding the announcements, repositories on one and on three
//! relays, the two sides in alternating order.
//!
//! The pool is given what a GRASP sync asks for on a first read, built from what the bench
//! knows: per remote relay, the repositories it lists by `#a`, `#A` and `#q` and their root
//! events by `#e`, `#E` and `#q` (100 values a filter, one filter a REQ, as grasp-sync's
//! Layers 2 and 3), and the announcements' kinds on every relay (Layer 1). It needs no
//! discovery round (grasp-sync learns the root events from what it reads) and no paging
//! (each filter carries a `limit` as large as the data set; grasp-sync pages).
//!
//! A third side, when tests/nip77-relay's `bare-copy` was built beside `sdk-pool`: the least a
//! copier of grasp-sync's shape does (a thread and a blocking websocket per relay, the same
//! filters at once, one `Event::verify` per unique event, the writes into the own relay with
//! 64 `OK`s outstanding; no paging, no reading of the own relay, no planning). Its CPU per
//! unique event ÷ the verify floor is what threads, websockets and parsing cost before any
//! sync logic: a lower bound for grasp-sync's figure.
//!
//! Measured per side as in the process section ([`process::watch`]): wall time until the
//! own relay holds the expected count, the process's CPU (every thread's run time), peak RSS
//! (`VmHWM`), then every expected id fetched back.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nostr::event::Event;
use serde_json::json;

use super::process::{self, Binaries, Client, Corpus, Own, RelayProc, YEAR};
use super::{number, verify_cost, Budget, Figure};

/// Issue 37, item 3: grasp-sync's unique events per CPU-second at least this many times the
/// pool's.
const RATE_RATIO: f64 = 2.0;
/// Issue 37, item 3: grasp-sync's CPU per unique event at most this many times the verify
/// floor.
const FLOOR_RATIO: f64 = 1.5;
/// Values per filter, as grasp-sync's `CHUNK_SIZE`.
const CHUNK: usize = 100;
/// How long the pool may have reported itself done while the own relay's count still misses
/// events before the run is taken as incomplete.
const DONE_GRACE: Duration = Duration::from_secs(3);

/// The `sdk-pool` helper: `$SDK_POOL`, else beside `$NIP77_RELAY` (one crate builds both).
pub fn sdk_pool_binary() -> Result<PathBuf, String> {
    let path = match std::env::var_os("SDK_POOL").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("NIP77_RELAY")
            .filter(|v| !v.is_empty())
            .map(|p| PathBuf::from(p).with_file_name("sdk-pool"))
            .ok_or("neither SDK_POOL nor NIP77_RELAY is set (tests/nip77-relay builds both)")?,
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} does not exist: `cargo build --release --locked --manifest-path tests/nip77-relay/Cargo.toml`",
            path.display()
        ))
    }
}

/// What one side measured.
struct Side {
    seconds: f64,
    cpu: f64,
    hwm_kib: u64,
    /// Expected ids the own relay holds afterwards.
    held: usize,
    /// Events the own relay holds beyond the expected set (its count minus `held`).
    extra: u64,
    /// The verify floor around the run, seconds per event.
    floor: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Who {
    GraspSync,
    Pool,
    /// `bare-copy` of tests/nip77-relay: threads, websockets, one check per unique event and
    /// the writes into the own relay, nothing else (a lower bound for the architecture).
    Bare,
}

impl Who {
    fn name(self) -> &'static str {
        match self {
            Who::GraspSync => "grasp-sync",
            Who::Pool => "nostr-sdk pool",
            Who::Bare => "bare copier",
        }
    }
}

/// The `bare-copy` helper beside `sdk-pool` (one crate builds both), if it was built.
fn bare_copy_binary(sdk_pool: &Path) -> Option<PathBuf> {
    Some(sdk_pool.with_file_name("bare-copy")).filter(|p| p.is_file())
}

/// The plan of `sdk-pool`: one line per filter, `{"relays": [...], "filter": {...}}`.
fn plan_lines(corpus: &Corpus, anns: &[Event], urls: &[String], spread: usize) -> Vec<String> {
    let relays = urls.len();
    let limit = corpus.events.len() + anns.len();
    let mut lines = vec![json!({
        "relays": urls,
        "filter": {"kinds": [30617, 30618, 10317]},
    })
    .to_string()];
    let coordinate = |r: usize| {
        let a = &anns[r];
        format!("30617:{}:repo-{r}", a.pubkey.to_hex())
    };
    let mut roots: Vec<Vec<String>> = vec![Vec::new(); corpus.repos];
    for (r, e) in &corpus.events {
        if Corpus::is_root(e) {
            roots[*r].push(e.id.to_hex());
        }
    }
    for (i, url) in urls.iter().enumerate() {
        let on: Vec<usize> = (0..corpus.repos)
            .filter(|r| process::listed(*r, relays, spread).any(|k| k == i))
            .collect();
        let mut coords: Vec<String> = on.iter().map(|r| coordinate(*r)).collect();
        coords.sort();
        let mut ids: Vec<String> = on.iter().flat_map(|r| roots[*r].clone()).collect();
        ids.sort();
        for (values, tags) in [(&coords, ["#a", "#A", "#q"]), (&ids, ["#e", "#E", "#q"])] {
            for chunk in values.chunks(CHUNK) {
                for tag in tags {
                    lines.push(
                        json!({"relays": [url], "filter": {tag: chunk, "limit": limit}})
                            .to_string(),
                    );
                }
            }
        }
    }
    lines
}

/// The bare copier's plan: every event asked once, by id, of one relay that holds it (100 ids a
/// filter). No sync can know this in advance; it makes the bare copier's figure the cost of
/// receiving, checking and writing each unique event once.
fn oracle_lines(corpus: &Corpus, urls: &[String], spread: usize) -> Vec<String> {
    let mut by_relay: Vec<Vec<String>> = vec![Vec::new(); urls.len()];
    for (r, e) in &corpus.events {
        let k = process::listed(*r, urls.len(), spread)
            .next()
            .expect("every repository is listed somewhere");
        by_relay[k].push(e.id.to_hex());
    }
    let mut lines = Vec::new();
    for (url, ids) in urls.iter().zip(&by_relay) {
        for chunk in ids.chunks(CHUNK) {
            lines.push(json!({"relays": [url], "filter": {"ids": chunk}}).to_string());
        }
    }
    lines
}

/// `sdk-pool` (or `bare-copy`, which takes the same arguments and prints the same line) into
/// `own` with the plan in `plan`, until the own relay holds `expected`.
fn pool_run(
    who: Who,
    sdk_pool: &Path,
    own: &RelayProc,
    plan: &Path,
    expected: &HashSet<String>,
    notes: &mut Vec<String>,
    label: &str,
) -> (f64, f64, u64, usize, u64) {
    let log = plan.with_extension("log");
    let started = Instant::now();
    let mut child: Child = Command::new(sdk_pool)
        .arg(&own.url)
        .arg(plan)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(File::create(&log).expect("log file"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", sdk_pool.display()));
    let pid = child.id();
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut done: Option<(Instant, String)> = None;
    let watched = process::watch(
        pid,
        started,
        &own.url,
        expected.len() as u64,
        &mut || None,
        &mut || {
            if let Ok(line) = rx.try_recv() {
                done = Some((Instant::now(), line));
            }
            matches!(child.try_wait(), Ok(None))
                && done
                    .as_ref()
                    .is_none_or(|(at, _)| at.elapsed() < DONE_GRACE)
        },
    );
    // The pool's own account, when it has finished (it prints it once every OK has come).
    let summary = done
        .map(|(_, l)| l)
        .or_else(|| rx.recv_timeout(Duration::from_secs(30)).ok());
    drop(child.stdin.take());
    let end = Instant::now() + Duration::from_secs(15);
    while Instant::now() < end && matches!(child.try_wait(), Ok(None)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    notes.push(format!(
        "{label}, {}: {}; {status}{}",
        who.name(),
        summary.as_deref().unwrap_or("no summary line"),
        if stderr.trim().is_empty() {
            String::new()
        } else {
            format!(
                "; stderr: {}",
                stderr.lines().take(5).collect::<Vec<_>>().join(" | ")
            )
        }
    ));
    let _ = std::fs::remove_file(&log);
    let mut by_comm: BTreeMap<String, f64> = BTreeMap::new();
    for (comm, s) in watched.threads.values() {
        *by_comm.entry(comm.clone()).or_default() += s;
    }
    let sampled: f64 = by_comm.values().sum();
    let mut comms: Vec<(&String, &f64)> = by_comm.iter().collect();
    comms.sort_by(|a, b| b.1.total_cmp(a.1));
    notes.push(format!(
        "{label}, {}: {} threads seen; CPU by thread name: {}",
        who.name(),
        watched.threads.len(),
        comms
            .iter()
            .take(6)
            .map(|(c, s)| format!("{c:?} {s:.2} s"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let ids: Vec<String> = expected.iter().cloned().collect();
    let held = Client::connect(&own.url).held(&ids);
    (
        watched.seconds,
        watched.total.max(sampled),
        watched.hwm_kib,
        held,
        watched.last.saturating_sub(held as u64),
    )
}

/// One side into a fresh own relay, the verify floor read right before and after it.
#[allow(clippy::too_many_arguments)]
fn side(
    who: Who,
    bins: &Binaries,
    sdk_pool: &Path,
    corpus: &Corpus,
    anns: &[Event],
    plan: &Path,
    all: &[Event],
    label: &str,
    notes: &mut Vec<String>,
) -> Side {
    let expected = process::expected_ids(anns, corpus);
    let before = verify_cost(all);
    let (own, seeded_own) = process::own_relay(bins, Own::Local, anns, corpus, false);
    let (seconds, cpu, hwm_kib, held, extra) = match who {
        Who::GraspSync => {
            // Panics unless the own relay holds exactly the expected set.
            let run = process::grasp_sync_run(
                bins,
                &own,
                Own::Local,
                &expected,
                seeded_own,
                anns.len(),
                notes,
            );
            (run.seconds, run.cpu, run.hwm_kib, expected.len(), 0)
        }
        Who::Pool => pool_run(who, sdk_pool, &own, plan, &expected, notes, label),
        Who::Bare => {
            let bare = bare_copy_binary(sdk_pool).expect("checked by the caller");
            let oracle = plan.with_extension("oracle");
            pool_run(who, &bare, &own, &oracle, &expected, notes, label)
        }
    };
    drop(own);
    let after = verify_cost(all);
    eprint!(
        "{label}, {}: {seconds:.1} s, {cpu:.2} CPU s, {:.0} MiB; ",
        who.name(),
        hwm_kib as f64 / 1024.0
    );
    Side {
        seconds,
        cpu,
        hwm_kib,
        held,
        extra,
        floor: (before + after) / 2.0,
    }
}

/// The section: repositories on one relay, then on three (or on `spread` only), both sides
/// each time, the side that goes first alternating.
pub fn pool_figures(
    bins: &Binaries,
    sdk_pool: &Path,
    events: usize,
    relays: usize,
    spread: Option<usize>,
    repos: Option<usize>,
    notes: &mut Vec<String>,
) -> Vec<Figure> {
    let repos = repos.unwrap_or(30 * relays);
    let corpus = Corpus::generate(repos, events, (400, 16_000), 21, YEAR);
    notes.push(format!(
        "pool: {} events over {repos} repositories, mean {:.0} bytes of JSON",
        number(corpus.events.len() as f64),
        corpus.mean_bytes()
    ));
    let all: Vec<Event> = corpus.events.iter().map(|(_, e)| e.clone()).collect();
    let unique = corpus.events.len();
    let mut figures = Vec::new();
    let spreads = spread.map_or(vec![1, 3], |s| vec![s]);
    for (n, s) in spreads.into_iter().enumerate() {
        let label = format!(
            "pool, {} ev, {relays} relays, repo on {s}",
            number(events as f64)
        );
        let seeded = Instant::now();
        let (remotes, anns) = process::remote_relays(bins, &corpus, relays, s);
        let urls: Vec<String> = remotes.iter().map(|r| r.url.clone()).collect();
        let plan = std::env::temp_dir().join(format!(
            "grasp-sync-bench-pool-{}-{s}.plan",
            std::process::id()
        ));
        let lines = plan_lines(&corpus, &anns, &urls, s);
        let mut f = File::create(&plan).expect("plan file");
        for l in &lines {
            writeln!(f, "{l}").expect("plan file");
        }
        drop(f);
        std::fs::write(
            plan.with_extension("oracle"),
            oracle_lines(&corpus, &urls, s).join("\n"),
        )
        .expect("oracle plan file");
        notes.push(format!(
            "{label}: the pool's plan has {} filters (one REQ each)",
            lines.len()
        ));
        eprint!("seeded in {:.0} s; ", seeded.elapsed().as_secs_f64());
        let mut order = if n % 2 == 0 {
            vec![Who::GraspSync, Who::Pool]
        } else {
            vec![Who::Pool, Who::GraspSync]
        };
        if bare_copy_binary(sdk_pool).is_some() {
            order.push(Who::Bare);
        }
        let mut measured: Vec<(Who, Side)> = Vec::new();
        for who in order.iter().copied() {
            let side = side(
                who, bins, sdk_pool, &corpus, &anns, &plan, &all, &label, notes,
            );
            measured.push((who, side));
        }
        let _ = std::fs::remove_file(&plan);
        let _ = std::fs::remove_file(plan.with_extension("oracle"));
        drop(remotes);
        notes.push(format!(
            "{label}: order {}",
            order
                .iter()
                .map(|w| w.name())
                .collect::<Vec<_>>()
                .join(" then ")
        ));
        let get = |w: Who| {
            &measured
                .iter()
                .find(|(x, _)| *x == w)
                .expect("both sides")
                .1
        };
        let (gs, pool) = (get(Who::GraspSync), get(Who::Pool));
        let expected = anns.len() + unique;
        let bare = measured.iter().find(|(w, _)| *w == Who::Bare).map(|m| &m.1);
        let sides = [(Who::GraspSync, gs), (Who::Pool, pool)]
            .into_iter()
            .chain(bare.map(|b| (Who::Bare, b)));
        for (who, side) in sides {
            let name = who.name();
            // Per event it copied: short of the set, a side is not credited what it missed.
            let got = side.held.saturating_sub(anns.len()).max(1) as f64;
            let per = side.cpu / got;
            figures.push(Figure::new(
                format!("{label}: {name}: wall time"),
                side.seconds,
                "s",
                Budget::None,
            ));
            figures.push(Figure::new(
                format!("{label}: {name}: CPU seconds"),
                side.cpu,
                "s",
                Budget::None,
            ));
            figures.push(Figure::new(
                format!("{label}: {name}: unique events per CPU-second"),
                got / side.cpu,
                "ev/s",
                Budget::None,
            ));
            figures.push(Figure::new(
                format!(
                    "{label}: {name}: CPU per unique event ÷ verify floor ({:.1} µs)",
                    side.floor * 1e6
                ),
                per / side.floor,
                "×",
                if who == Who::GraspSync {
                    Budget::AtMost(FLOOR_RATIO)
                } else {
                    Budget::None
                },
            ));
            figures.push(Figure::new(
                format!("{label}: {name}: peak RSS"),
                side.hwm_kib as f64 / 1024.0,
                "MiB",
                Budget::None,
            ));
            figures.push(Figure::new(
                format!("{label}: {name}: expected events present by id"),
                side.held as f64,
                "",
                Budget::AtLeast(expected as f64),
            ));
            figures.push(Figure::new(
                format!("{label}: {name}: events held beyond the expected set"),
                side.extra as f64,
                "",
                Budget::AtMost(0.0),
            ));
        }
        let rate = |s: &Side| s.held.saturating_sub(anns.len()) as f64 / s.cpu;
        figures.push(Figure::new(
            format!("{label}: grasp-sync ÷ pool: unique events per CPU-second"),
            rate(gs) / rate(pool),
            "×",
            Budget::AtLeast(RATE_RATIO),
        ));
        figures.push(Figure::new(
            format!("{label}: grasp-sync ÷ pool: peak RSS"),
            gs.hwm_kib as f64 / pool.hwm_kib.max(1) as f64,
            "×",
            Budget::AtMost(1.0),
        ));
        figures.push(Figure::new(
            format!("{label}: grasp-sync ÷ pool: wall time"),
            gs.seconds / pool.seconds,
            "×",
            Budget::None,
        ));
        if let Some(bare) = bare {
            figures.push(Figure::new(
                format!("{label}: grasp-sync ÷ bare copier: CPU per unique event"),
                (gs.cpu / gs.held.saturating_sub(anns.len()).max(1) as f64)
                    / (bare.cpu / bare.held.saturating_sub(anns.len()).max(1) as f64),
                "×",
                Budget::None,
            ));
        }
    }
    figures
}
