//! The production case (issue 37, item 1): the busiest GRASP relay in production held 869
//! repositories and 3,632 root events (2026-08), and public relays publish tight limits
//! (nos.lol, strfry 1.1.0: 20 subscriptions with negentropy sessions counted among them, 500
//! results per filter, 131,072-byte frames).
//!
//! About 900 repositories and 3,600 root events with their replies (the corpus generator of
//! the process section: patches of 400 B to 64 KB, log-uniform, issues, NIP-22 comments,
//! statuses, legacy `e` reply chains up to four deep) on 20 remote relays, each repository
//! on 1 to 3 of them and each event on a non-empty part of its repository's relays. The
//! relays are `TestRelay`s inside the bench process, with the profiles of real relays:
//! strfry with nos.lol's limits, strfry as shipped (200 subscriptions), nostr-rs-relay (no
//! NIP-77, no numeric limits in NIP-11), rust-nostr's `LocalRelay` (no NIP-11, NIP-77) and
//! the plain `TestRelay`. The own relay is a plain `TestRelay` too, holding the
//! announcements and the root events before the sync, as a GRASP server's relay does.
//!
//! Measured: the release `grasp-sync` binary as its own process, from its start until the
//! own relay holds exactly the expected set (compared by id every 250 ms): wall time, the
//! process's CPU seconds (`/proc`, as the process section reads them) and peak RSS
//! (`VmHWM`). Then, once `/status` says settled (or 30 s later), per relay: the REQs and
//! NEG-OPENs it received, the NOTICEs, CLOSEDs and NEG-ERRs it sent and the most
//! subscriptions and negentropy sessions open at once on one connection, against its
//! budget. Budget: no NOTICE and no CLOSED from a strfry-limited relay, never more than 20
//! open there.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grasp_sync::testing::{Profile, TestRelay, TestRelayOptions};
use nostr::event::EventId;
use serde_json::{json, Value};

use super::process::{process_seconds, sample, thread_kind, vm_hwm_kib, Corpus, Daemon, Threads};
use super::{clock_ticks_per_sec, free_port, number, Budget, Figure};

/// nos.lol's published `max_subscriptions` (strfry 1.1.0).
const NOS_LOL_SUBS: usize = 20;
const SYNC_DEADLINE: Duration = Duration::from_secs(1200);
const SETTLE_DEADLINE: Duration = Duration::from_secs(30);
const CHECK_EVERY: Duration = Duration::from_millis(250);
const SAMPLE_EVERY: Duration = Duration::from_millis(200);
const YEAR: u64 = 365 * 24 * 3600;
/// strfry stores events of at most 64 KiB of JSON: the largest patch is just below.
const PATCH_SIZES: (usize, usize) = (400, 60_000);

/// The relay kinds of the section, in the order of the table.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// strfry with nos.lol's limits.
    StrfryLimited,
    Strfry,
    NostrRsRelay,
    LocalRelay,
    Plain,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::StrfryLimited => "strfry, nos.lol limits",
            Kind::Strfry => "strfry",
            Kind::NostrRsRelay => "nostr-rs-relay",
            Kind::LocalRelay => "LocalRelay",
            Kind::Plain => "TestRelay",
        }
    }

    /// The subscriptions one connection may hold (REQs, and NEG sessions where counted).
    fn budget(self) -> usize {
        match self {
            Kind::StrfryLimited => NOS_LOL_SUBS,
            Kind::Strfry => 200,
            Kind::NostrRsRelay => 32,
            Kind::LocalRelay => 500,
            Kind::Plain => usize::MAX,
        }
    }

    fn options(self) -> TestRelayOptions {
        match self {
            Kind::StrfryLimited => {
                let mut opts = TestRelayOptions::profile(Profile::Strfry);
                opts.max_subscriptions = Some(NOS_LOL_SUBS);
                let doc = opts.nip11.as_mut().expect("strfry publishes NIP-11");
                doc["limitation"]["max_subscriptions"] = json!(NOS_LOL_SUBS);
                opts
            }
            Kind::Strfry => TestRelayOptions::profile(Profile::Strfry),
            Kind::NostrRsRelay => TestRelayOptions::profile(Profile::NostrRsRelay),
            Kind::LocalRelay => TestRelayOptions::profile(Profile::LocalRelay),
            Kind::Plain => TestRelayOptions::default(),
        }
    }
}

/// The mix of `n` relays: about a third strfry-limited, then the others in turn.
fn mix(n: usize) -> Vec<Kind> {
    let limited = n.div_ceil(3);
    let others = [
        Kind::LocalRelay,
        Kind::NostrRsRelay,
        Kind::Strfry,
        Kind::Plain,
    ];
    (0..n)
        .map(|i| {
            if i < limited {
                Kind::StrfryLimited
            } else {
                others[(i - limited) % others.len()]
            }
        })
        .collect()
}

/// A small deterministic generator for the placement (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n as u64) as usize
    }
}

/// The corpus with about `roots` root events: the generator's share of roots depends on the
/// events per repository, so the size is corrected twice from the share found.
fn corpus(repos: usize, roots: usize) -> Corpus {
    let mut n = 5 * roots;
    let mut corpus = Corpus::generate_with(repos, n, PATCH_SIZES, 37, YEAR, true);
    for _ in 0..2 {
        let found = corpus
            .events
            .iter()
            .filter(|(_, e)| Corpus::is_root(e))
            .count()
            .max(1);
        if found.abs_diff(roots) * 50 <= roots {
            break;
        }
        n = n * roots / found;
        corpus = Corpus::generate_with(repos, n, PATCH_SIZES, 37, YEAR, true);
    }
    corpus
}

/// What one relay saw.
struct Seen {
    kind: Kind,
    reqs: usize,
    neg_opens: usize,
    notices: u64,
    closed: u64,
    neg_errs: u64,
    peak: usize,
    refusals: Vec<String>,
}

pub fn production_figures(
    repos: usize,
    roots: usize,
    relays: usize,
    notes: &mut Vec<String>,
) -> Vec<Figure> {
    let Some(bin) = super::release_binary() else {
        eprintln!("production: skipped: no target/release/grasp-sync (cargo build --release)");
        return Vec::new();
    };
    let generated = Instant::now();
    let corpus = corpus(repos, roots);
    let kinds = mix(relays);
    let remotes: Vec<TestRelay> = kinds
        .iter()
        .map(|k| TestRelay::start_with(k.options()))
        .collect();
    let own = TestRelay::start();
    let urls: Vec<String> = remotes.iter().map(TestRelay::url).collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Repository r: on 1 to 3 relays, the first one in turn so every relay lists some.
    let listed: Vec<Vec<usize>> = (0..corpus.repos)
        .map(|r| {
            let n = 1 + rng.below(3);
            let mut on = vec![r % relays];
            while on.len() < n.min(relays) {
                let i = rng.below(relays);
                if !on.contains(&i) {
                    on.push(i);
                }
            }
            on
        })
        .collect();
    let mut expected: HashSet<EventId> = HashSet::new();
    for (r, on) in listed.iter().enumerate() {
        let relay_urls: Vec<String> = on.iter().map(|&i| urls[i].clone()).collect();
        let ann = corpus.announcement(r, &relay_urls);
        own.insert(&ann);
        for &i in on {
            remotes[i].insert(&ann);
        }
        expected.insert(ann.id);
    }
    let mut root_count = 0;
    let mut bytes = 0usize;
    for (r, e) in &corpus.events {
        if Corpus::is_root(e) {
            own.insert(e);
            root_count += 1;
        }
        let on = &listed[*r];
        let first = rng.below(on.len());
        for (k, &i) in on.iter().enumerate() {
            if k == first || rng.below(3) == 0 {
                remotes[i].insert(e);
            }
        }
        bytes += e.as_json().len();
        expected.insert(e.id);
    }
    let large = corpus
        .events
        .iter()
        .filter(|(_, e)| e.content.len() >= 20_000)
        .count();
    notes.push(format!(
        "production: {} repositories, {} root events, {} events in all ({} bytes of JSON on \
         average, {} of 20 KB or more), on {relays} relays (each repository on 1–3, each \
         event on a part of them); the own relay holds the announcements and the root events \
         first; generated and seeded in {:.0} s",
        corpus.repos,
        number(root_count as f64),
        number(expected.len() as f64),
        number((bytes / corpus.events.len().max(1)) as f64),
        large,
        generated.elapsed().as_secs_f64()
    ));
    eprint!(
        "{} events, {} roots; ",
        number(expected.len() as f64),
        number(root_count as f64)
    );

    // The measured run.
    let log = std::env::temp_dir().join(format!("grasp-sync-bench-production-{}.log", own.port()));
    let own_url = format!("ws://localhost:{}", own.port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let metrics_addr: std::net::SocketAddr = metrics.parse().expect("address");
    let tick = clock_ticks_per_sec();
    // BENCH_DAEMON_LOG raises the binary's log level (e.g. `grasp_sync=debug`) and keeps its
    // log (JSON lines, for their millisecond timestamps), with the own relay's event count
    // every second beside it (`.progress`).
    let log_level = std::env::var("BENCH_DAEMON_LOG").ok();
    let keep_log = log_level.is_some();
    let mut progress: Vec<(f64, usize)> = Vec::new();
    let started = Instant::now();
    let child = Command::new(&bin)
        .args(["--own-relay", &own_url, "--metrics-addr", &metrics])
        .args(["--allow-private-relays", "--archive"])
        // Millisecond timestamps in a kept log.
        .args(if keep_log {
            &["--log-format", "json"][..]
        } else {
            &[]
        })
        .env("RUST_LOG", log_level.as_deref().unwrap_or("warn"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&log).expect("log file"))
        .spawn()
        .expect("start grasp-sync");
    let mut daemon = Daemon { child };
    let pid = daemon.child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut threads = Threads::new();
            while !stop.load(Ordering::Relaxed) {
                sample(pid, tick, &mut threads);
                std::thread::sleep(SAMPLE_EVERY);
            }
            threads
        })
    };
    let mut complete = false;
    while started.elapsed() < SYNC_DEADLINE {
        let held = own.len();
        let at = started.elapsed().as_secs_f64();
        if keep_log && progress.last().is_none_or(|&(t, _)| at - t >= 1.0) {
            progress.push((at, held));
        }
        if held >= expected.len() && own.event_ids() == expected {
            complete = true;
            break;
        }
        if !matches!(daemon.child.try_wait(), Ok(None)) {
            break;
        }
        std::thread::sleep(CHECK_EVERY);
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu_at_set = process_seconds(pid, tick);
    let hwm_at_set = vm_hwm_kib(pid);
    // Settled: what is provoked after the set is complete (live sets rebuilt, polling) counts.
    let settled = super::wait_until(SETTLE_DEADLINE, || {
        grasp_sync::ops::http::get(metrics_addr, "/status", Duration::from_secs(5))
            .ok()
            .and_then(|(code, body)| {
                (code == 200).then(|| serde_json::from_str::<Value>(&body).ok())?
            })
            .is_some_and(|doc| doc["settled"] == true)
    });
    let settled_after = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut threads = sampler.join().expect("sampler");
    sample(pid, tick, &mut threads);
    let cpu_total = process_seconds(pid, tick);
    let hwm_kib = vm_hwm_kib(pid);
    daemon.stop();
    let held = own.event_ids();
    let missing = expected.difference(&held).count();
    let unexpected = held.difference(&expected).count();
    assert!(
        complete,
        "production: the own relay misses {missing} and holds {unexpected} unexpected of {} \
         events after {seconds:.0} s (log: {})",
        expected.len(),
        log.display()
    );
    assert_eq!(
        held, expected,
        "production: the own relay's set changed after it was exact"
    );
    if keep_log {
        let lines: String = progress
            .iter()
            .map(|(t, n)| format!("{t:.1} {n}\n"))
            .collect();
        let _ = std::fs::write(log.with_extension("progress"), lines);
        notes.push(format!(
            "production: the binary's log kept in {}",
            log.display()
        ));
    } else {
        let _ = std::fs::remove_file(&log);
    }
    if !settled {
        notes.push(format!(
            "production: /status did not say settled within {} s of the exact set",
            SETTLE_DEADLINE.as_secs()
        ));
    }

    let seen: Vec<Seen> = kinds
        .iter()
        .zip(&remotes)
        .map(|(&kind, r)| Seen {
            kind,
            reqs: r.reqs().len(),
            neg_opens: r.neg_opens().len(),
            notices: r.notices_sent(),
            closed: r.closed_sent(),
            neg_errs: r.neg_errs_sent(),
            peak: r.max_subscriptions_and_neg_sessions_per_connection(),
            refusals: r.refusals_sent(),
        })
        .collect();
    for (i, s) in seen.iter().enumerate() {
        notes.push(format!(
            "production: relay {i:>2} {:<22} {:>5} REQs {:>4} NEG-OPENs {:>3} NOTICEs {:>3} \
             CLOSEDs {:>3} NEG-ERRs, peak {:>3} open of {}{}",
            s.kind.label(),
            s.reqs,
            s.neg_opens,
            s.notices,
            s.closed,
            s.neg_errs,
            s.peak,
            match s.kind.budget() {
                usize::MAX => "∞".to_string(),
                b => b.to_string(),
            },
            match s.refusals.first() {
                Some(first) => format!("; first refusal {first}"),
                None => String::new(),
            }
        ));
    }
    let mut by_kind: BTreeMap<&'static str, f64> = BTreeMap::new();
    for (comm, s) in threads.values() {
        *by_kind.entry(thread_kind(comm)).or_default() += s;
    }
    notes.push(format!(
        "production: CPU by thread kind: {}; settled {:.1} s after the start",
        by_kind
            .iter()
            .map(|(k, s)| format!("{k} {s:.2} s"))
            .collect::<Vec<_>>()
            .join(", "),
        settled_after
    ));

    let limited: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.kind == Kind::StrfryLimited)
        .collect();
    let sum = |f: &dyn Fn(&Seen) -> f64, of: &[&Seen]| of.iter().map(|s| f(s)).sum::<f64>();
    let all: Vec<&Seen> = seen.iter().collect();
    let label = format!(
        "production, {} repos, {} roots, {} ev, {relays} relays",
        corpus.repos,
        number(root_count as f64),
        number(expected.len() as f64)
    );
    vec![
        Figure::new(
            format!("{label}: wall time to the exact set"),
            seconds,
            "s",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: process CPU to the exact set"),
            cpu_at_set,
            "s",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: process CPU until settled"),
            cpu_total,
            "s",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: peak RSS at the exact set"),
            hwm_at_set as f64 / 1024.0,
            "MiB",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: peak RSS until settled"),
            hwm_kib as f64 / 1024.0,
            "MiB",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: REQs, all relays"),
            sum(&|s| s.reqs as f64, &all),
            "",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: NEG-OPENs, all relays"),
            sum(&|s| s.neg_opens as f64, &all),
            "",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: NOTICEs + CLOSEDs from strfry-limited relays"),
            sum(&|s| (s.notices + s.closed) as f64, &limited),
            "",
            Budget::AtMost(0.0),
        ),
        Figure::new(
            format!("{label}: most open at once on a strfry-limited relay (REQs + NEG)"),
            limited.iter().map(|s| s.peak).max().unwrap_or(0) as f64,
            "",
            Budget::AtMost(NOS_LOL_SUBS as f64),
        ),
        Figure::new(
            format!("{label}: NOTICEs + CLOSEDs from the other relays"),
            sum(&|s| (s.notices + s.closed) as f64, &all)
                - sum(&|s| (s.notices + s.closed) as f64, &limited),
            "",
            Budget::None,
        ),
    ]
}
