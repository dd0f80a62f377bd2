//! Side by side with the reference sync (issue 34, item 4): one data set on N nostr-rs-relay
//! processes, synced (a) by ngit-grasp 3.0.10 into itself (its own GRASP-02 sync), then (b) by
//! the release `grasp-sync` binary into a nostr-rs-relay own relay. Per side: the expected
//! events present by id, wall time to complete, CPU seconds and peak RSS of the syncing
//! process (for (b) the own relay's process separately, as ngit-grasp's figure includes the
//! relay it serves).
//!
//! The data is the process section's corpus with reply chains (one event in eight a legacy
//! kind-1 reply tagging only its parent, up to four generations below the root). Every
//! announcement names ngit-grasp (its domain in `clone`, its URL in `relays`), the own relay
//! of (b) and the remote relays of its repository; ports are picked first, and the two runs
//! follow each other (ngit-grasp is stopped before (b)), so neither side feeds the other.
//! Each side is handed the announcements and the maintainers' empty state events (which take
//! a repository out of ngit-grasp's purgatory), as a GRASP server holds them before it syncs.
//!
//! Expected: every corpus event related to the announced repositories by the project's one
//! definition (`core::related::apply_batch` over the whole corpus, then Layers 2 and 3: an
//! event tagging an indexed repository or a root event or thread member). Progress is read by
//! asking the instance for the ids it still lacks every [`POLL`]; a side is done when it
//! holds them all, or when nothing new arrived for the plateau, or at the deadline.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use grasp_sync::core::nip34::{classify_self_event, parse_repo_coordinate, tagged_ids};
use grasp_sync::core::related::{apply_batch, Applied};
use grasp_sync::core::state::RepoSyncIndex;
use grasp_sync::core::threads::{ThreadLimits, Threads};
use grasp_sync::testing::wait_until;
use nostr::event::{Event, EventId};
use nostr::key::Keys;
use nostr::nips::nip19::ToBech32;

use super::process::{
    copy_counters, process_seconds, sign_event, tag, vm_hwm_kib, Client, Corpus, Daemon, RelayProc,
    NRR_DEFAULT, WAIT, YEAR,
};
use super::{clock_ticks_per_sec, free_port, number, Budget, Figure, REPOS_PER_OWNER};

const NGIT_DEFAULT: &str = "/opt/ngit-grasp/bin/ngit-grasp";
/// ngit-grasp's write allowance per connection before one event a second.
const NGIT_BURST: usize = 60;
/// How often each side is asked for the expected ids it still lacks.
const POLL: Duration = Duration::from_secs(2);

/// The binaries of the section.
pub struct Binaries {
    grasp_sync: PathBuf,
    ngit_grasp: PathBuf,
    nostr_rs_relay: PathBuf,
}

/// `$var`, else `default` when it is a file.
fn binary(var: &str, default: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from(default)))
        .filter(|p| p.is_file())
}

/// The binaries, or why the section cannot run (one line).
pub fn binaries() -> Result<Binaries, String> {
    let grasp_sync = binary("GRASP_SYNC_BIN", "")
        .or_else(super::release_binary)
        .ok_or("no target/release/grasp-sync beside the bench: run `cargo build --release`")?;
    let ngit_grasp = binary("NGIT_GRASP", NGIT_DEFAULT).ok_or(format!(
        "ngit-grasp missing (NGIT_GRASP, {NGIT_DEFAULT}); .ci/run builds it"
    ))?;
    let nostr_rs_relay = binary("NOSTR_RS_RELAY", NRR_DEFAULT).ok_or(format!(
        "nostr-rs-relay missing (NOSTR_RS_RELAY, {NRR_DEFAULT}); .ci/run installs it"
    ))?;
    Ok(Binaries {
        grasp_sync,
        ngit_grasp,
        nostr_rs_relay,
    })
}

/// The size of the run.
pub struct Shape {
    pub events: usize,
    pub relays: usize,
    pub repos: usize,
    /// Remote relays each repository is announced on (and its events stored on).
    pub spread: usize,
    /// A side is done after this long without a new expected event.
    pub plateau: Duration,
    pub deadline: Duration,
}

/// ngit-grasp on `port` (production settings: LMDB store, 5 s batch window, info log), its
/// own sync allowed to reach loopback relays; killed and its directory removed on drop (the
/// log is copied out first).
struct Ngit {
    daemon: Daemon,
    dir: PathBuf,
}

impl Ngit {
    fn start(bin: &Path, port: u16) -> Ngit {
        let dir = std::env::temp_dir().join(format!("grasp-sync-bench-ngit-{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["git", "relay"] {
            std::fs::create_dir_all(dir.join(sub)).expect("ngit-grasp dirs");
        }
        let log = File::create(dir.join("ngit.log")).expect("ngit.log");
        let nsec = Keys::generate().secret_key().to_bech32().expect("nsec");
        let addr = format!("127.0.0.1:{port}");
        let mut cmd = Command::new(bin);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("NGIT_") {
                cmd.env_remove(k);
            }
        }
        let child = cmd
            .arg("serve")
            .current_dir(&dir)
            .envs([
                ("NGIT_DOMAIN", addr.as_str()),
                ("NGIT_BIND_ADDRESS", addr.as_str()),
                ("NGIT_RELAY_OWNER_NSEC", nsec.as_str()),
                ("NGIT_SYNC_ALLOW_NON_GLOBAL_TARGETS", "true"),
                // Nothing leaves the machine.
                ("NGIT_SYNC_PLUS_ENABLED", "false"),
                ("NGIT_SYNC_PLUS_FALLBACK_RELAYS", ""),
                ("NGIT_USER_INDEX_RELAYS", ""),
            ])
            // NGIT_GRASP_LOG=debug raises its log level (as in tests/ngit_grasp.rs).
            .env(
                "NGIT_LOG_LEVEL",
                std::env::var("NGIT_GRASP_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("NGIT_GIT_DATA_PATH", dir.join("git"))
            .env("NGIT_RELAY_DATA_PATH", dir.join("relay"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        let ngit = Ngit {
            daemon: Daemon { child },
            dir,
        };
        let up = wait_until(WAIT, || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
                && tungstenite::connect(format!("ws://{addr}")).is_ok()
        });
        assert!(up, "ngit-grasp did not serve ws://{addr}");
        ngit
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("ngit.log")).unwrap_or_default()
    }
}

impl Drop for Ngit {
    fn drop(&mut self) {
        self.daemon.stop();
        let _ = std::fs::copy(self.dir.join("ngit.log"), self.dir.with_extension("log"));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What one side measured.
struct Side {
    present: HashSet<String>,
    /// Seconds from the start until the last expected event arrived.
    complete_after: f64,
    complete: bool,
    cpu: f64,
    hwm_kib: u64,
    /// The own relay of (b): CPU seconds and peak RSS.
    own: Option<(f64, u64)>,
    /// CPU seconds of the remote relays during the run.
    remotes_cpu: f64,
}

/// utime + stime, and that of waited-for children (ngit-grasp runs `git`), in seconds.
fn cpu_with_children(pid: u32, tick: f64) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let ticks: u64 = rest
        .split_whitespace()
        .skip(11)
        .take(4)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    ticks as f64 / tick
}

/// Asks `url` every [`POLL`] for the expected ids it lacks, until it holds them all, nothing
/// new arrived for `plateau`, `deadline` passed or `alive` says the syncing process ended:
/// the ids held, seconds from `started` to the last one that arrived, and whether all did.
fn watch(
    url: &str,
    expected: &[String],
    shape: &Shape,
    started: Instant,
    mut alive: impl FnMut() -> bool,
) -> (HashSet<String>, f64, bool) {
    let mut client = Client::connect(url);
    let mut present = HashSet::new();
    let mut last_growth = 0.0;
    loop {
        let missing: Vec<String> = expected
            .iter()
            .filter(|id| !present.contains(*id))
            .cloned()
            .collect();
        let got = client.held_ids(&missing);
        if !got.is_empty() {
            last_growth = started.elapsed().as_secs_f64();
            present.extend(got);
        }
        let now = started.elapsed().as_secs_f64();
        if present.len() == expected.len() {
            return (present, last_growth, true);
        }
        if now - last_growth > shape.plateau.as_secs_f64()
            || started.elapsed() > shape.deadline
            || !alive()
        {
            return (present, last_growth, false);
        }
        std::thread::sleep(POLL);
    }
}

/// The expected ids: corpus events related to the announced repositories, by the daemon's
/// definition (announcements and root events indexed, replies followed by
/// `core::related::apply_batch`; then Layer 2: tags an indexed repository with `a`/`A`/`q`,
/// Layer 3: tags an indexed root event or thread member with `e`/`E`/`q`).
fn related(anns: &[Event], events: &[&Event]) -> HashSet<EventId> {
    let mut index = RepoSyncIndex::default();
    let mut threads = Threads::new(ThreadLimits::default());
    let meanings = anns
        .iter()
        .chain(events.iter().copied())
        .map(classify_self_event)
        .collect();
    apply_batch(&mut index, &mut threads, meanings, &mut Applied::default());
    let layer3: HashSet<EventId> = index
        .values()
        .flat_map(|n| n.root_events.iter().chain(&n.thread_events))
        .copied()
        .collect();
    let tags_repo = |e: &Event| {
        e.tags.iter().any(|t| {
            let s = t.as_slice();
            s.len() >= 2
                && matches!(s[0].as_str(), "a" | "A" | "q")
                && parse_repo_coordinate(&s[1]).is_some_and(|r| index.contains_key(&r))
        })
    };
    events
        .iter()
        .filter(|e| tags_repo(e) || tagged_ids(e).iter().any(|id| layer3.contains(id)))
        .map(|e| e.id)
        .collect()
}

/// What an event is, for the table of missing events: its kind, and for a kind-1 reply
/// its depth below the root (a comment is depth 1).
fn categories(events: &[&Event]) -> HashMap<String, String> {
    let mut depth: HashMap<EventId, u8> = HashMap::new();
    let mut out = HashMap::new();
    for e in events {
        let what = match e.kind.as_u16() {
            1111 => {
                depth.insert(e.id, 1);
                "comment".to_string()
            }
            1 => {
                let d = tagged_ids(e)
                    .first()
                    .and_then(|p| depth.get(p))
                    .map_or(0, |d| d + 1);
                depth.insert(e.id, d);
                format!("kind-1 reply, depth {d}")
            }
            1617 => "patch".into(),
            1621 => "issue".into(),
            k => format!("status {k}"),
        };
        out.insert(e.id.to_hex(), what);
    }
    out
}

fn missing_by_category(
    expected: &[String],
    present: &HashSet<String>,
    cats: &HashMap<String, String>,
) -> String {
    let mut by: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for id in expected {
        let c = by.entry(cats[id].as_str()).or_default();
        c.1 += 1;
        if !present.contains(id) {
            c.0 += 1;
        }
    }
    let parts: Vec<String> = by
        .iter()
        .filter(|(_, (m, _))| *m > 0)
        .map(|(k, (m, n))| format!("{k} {m} of {n}"))
        .collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// What ngit-grasp's log says about its sync: its event-pipeline windows summed (copies
/// delivered by the remote relays, saved, duplicates, rejected) and the lines containing a few
/// telling strings.
fn log_summary(log: &str) -> String {
    let mut sums: BTreeMap<&str, u64> = BTreeMap::new();
    for line in log.lines().filter(|l| l.contains("event-pipeline window")) {
        for field in ["delivered", "saved", "duplicate", "rejected", "purgatory"] {
            let key = format!(" {field}=");
            let n = line.split_once(&key).and_then(|(_, rest)| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse::<u64>()
                    .ok()
            });
            *sums.entry(field).or_default() += n.unwrap_or(0);
        }
    }
    let needles = [
        "Transient negentropy failure",
        "hit pagination threshold",
        "Started queued descendant fallback query",
        "Rejected orphan",
        "rate-limited",
        "WARN",
        "ERROR",
    ];
    let mut parts: Vec<String> = sums.iter().map(|(k, v)| format!("{k} {v}")).collect();
    parts.extend(
        needles
            .iter()
            .map(|n| format!("{n:?} {}", log.lines().filter(|l| l.contains(n)).count())),
    );
    parts.join(", ")
}

/// ngit-grasp's own view at the end, from its `/metrics`: how many remote relays are in each
/// sync state (`ngit_sync_relay_connected`: 2 still in historic sync, 3 connected and
/// synced, 4 connected with historic failures) and its transient-REQ watchdog count.
fn ngit_metrics(port: u16, remotes: &[RelayProc]) -> String {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let body = grasp_sync::ops::http::get(addr, "/metrics", WAIT)
        .map(|(_, b)| b)
        .unwrap_or_default();
    let mut states: BTreeMap<String, usize> = BTreeMap::new();
    let mut watchdog = 0.0;
    for line in body.lines() {
        let value = line.rsplit(' ').next().unwrap_or_default();
        if line.starts_with("ngit_sync_relay_connected{")
            && remotes.iter().any(|r| {
                line.contains(&format!("{}\"", r.url)) || line.contains(&format!("{}/\"", r.url))
            })
        {
            *states.entry(value.to_string()).or_default() += 1;
        } else if line.starts_with("ngit_sync_transient_req_watchdog_total") {
            watchdog += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    let states: Vec<String> = states
        .iter()
        .map(|(v, n)| format!("{n} in state {v}"))
        .collect();
    format!(
        "remote relays by ngit_sync_relay_connected: {}; transient REQ watchdog {watchdog}",
        if states.is_empty() {
            "not served".to_string()
        } else {
            states.join(", ")
        }
    )
}

/// Publishes `events` to ngit-grasp, at most [`NGIT_BURST`] per connection (its write
/// allowance), each answered `OK true` (announcements with `purgatory:`).
fn publish_ngit(url: &str, events: &[String]) {
    for chunk in events.chunks(NGIT_BURST) {
        let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        Client::connect(url).publish(&refs);
    }
}

/// Counters of each remote relay from its `/metrics` (nostr-rs-relay): events sent to
/// clients, REQs received, and queries it dropped without an answer
/// (`nostr_query_abort_total`, every reason: `loadshed`, queued over 5 s; `slowclient`,
/// results not taken for 2 s; `checkpoint`).
fn remote_counters(remotes: &[RelayProc]) -> Vec<[u64; 3]> {
    remotes
        .iter()
        .map(|r| {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], r.port()));
            let body = grasp_sync::ops::http::get(addr, "/metrics", WAIT)
                .map(|(_, b)| b)
                .unwrap_or_default();
            let sum = |name: &str| {
                body.lines()
                    .filter(|l| l.starts_with(name))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>() as u64
            };
            [
                sum("nostr_events_sent_total"),
                sum("nostr_cmd_req_total"),
                sum("nostr_query_abort_total"),
            ]
        })
        .collect()
}

/// What the remote relays did between two readings of [`remote_counters`], summed.
fn remote_delta(after: &[[u64; 3]], before: &[[u64; 3]]) -> String {
    let mut d = [0u64; 3];
    for (a, b) in after.iter().zip(before) {
        for k in 0..3 {
            d[k] += a[k].saturating_sub(b[k]);
        }
    }
    let count = |n: u64| {
        if n >= 1000 {
            number(n as f64)
        } else {
            n.to_string()
        }
    };
    format!(
        "{} events sent, {} REQs, {} queries dropped unanswered",
        count(d[0]),
        count(d[1]),
        d[2]
    )
}

/// Expected events absent from `present`, by the remote relays (indices) holding them.
fn missing_by_relays(
    expected: &HashSet<String>,
    present: &HashSet<String>,
    holders: &HashMap<String, String>,
) -> String {
    let mut by: BTreeMap<&str, usize> = BTreeMap::new();
    for id in expected.difference(present) {
        *by.entry(holders[id].as_str()).or_default() += 1;
    }
    let parts: Vec<String> = by.iter().map(|(k, n)| format!("{n} on {k}")).collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

fn remotes_cpu(remotes: &[RelayProc], tick: f64) -> f64 {
    remotes
        .iter()
        .map(|r| process_seconds(r.child.id(), tick))
        .sum()
}

/// The section.
pub fn reference_figures(bins: &Binaries, shape: &Shape, notes: &mut Vec<String>) -> Vec<Figure> {
    let tick = clock_ticks_per_sec();
    let corpus = Corpus::generate_with(shape.repos, shape.events, (400, 16_000), 34, YEAR, true);
    let (port_a, port_b) = loop {
        let (a, b) = (free_port(), free_port());
        if a != b {
            break (a, b);
        }
    };
    let (url_a, url_b) = (
        format!("ws://127.0.0.1:{port_a}"),
        format!("ws://127.0.0.1:{port_b}"),
    );
    let remotes: Vec<RelayProc> = (0..shape.relays)
        .map(|_| RelayProc::nostr_rs_on(&bins.nostr_rs_relay, free_port()))
        .collect();
    let listed =
        |r: usize| (0..shape.spread.min(shape.relays)).map(move |k| (r + k) % shape.relays);
    let mut anns = Vec::new();
    let mut states = Vec::new();
    for r in 0..corpus.repos {
        let owner = &corpus.owners[r / REPOS_PER_OWNER];
        let npub = owner.public_key().to_bech32().expect("npub");
        let clone = format!("http://127.0.0.1:{port_a}/{npub}/repo-{r}.git");
        let mut relays = vec![url_a.clone(), url_b.clone()];
        relays.extend(listed(r).map(|i| remotes[i].url.clone()));
        let ann = corpus.announcement_cloned(r, &clone, &relays);
        let at = ann.created_at.as_secs() + 1;
        states.push(sign_event(
            owner,
            30618,
            "",
            &[tag(&["d", &format!("repo-{r}")])],
            at,
        ));
        anns.push(ann);
    }
    // Seeding the remote relays (not measured): each its repositories' announcements, states
    // and events.
    let mut per_relay: Vec<Vec<String>> = vec![Vec::new(); shape.relays];
    for (r, e) in anns
        .iter()
        .zip(&states)
        .enumerate()
        .flat_map(|(r, (a, s))| [(r, a), (r, s)])
    {
        for i in listed(r) {
            per_relay[i].push(e.as_json());
        }
    }
    for (r, e) in &corpus.events {
        for i in listed(*r) {
            per_relay[i].push(e.as_json());
        }
    }
    std::thread::scope(|s| {
        for (relay, events) in remotes.iter().zip(&per_relay) {
            s.spawn(move || {
                let refs: Vec<&str> = events.iter().map(String::as_str).collect();
                Client::connect(&relay.url).publish(&refs);
            });
        }
    });
    drop(per_relay);
    let events: Vec<&Event> = corpus.events.iter().map(|(_, e)| e).collect();
    let related = related(&anns, &events);
    let expected: Vec<String> = events
        .iter()
        .filter(|e| related.contains(&e.id))
        .map(|e| e.id.to_hex())
        .collect();
    let cats = categories(&events);
    let chain_replies = events.iter().filter(|e| e.kind.as_u16() == 1).count();
    notes.push(format!(
        "reference: {} events ({} kind-1 chain replies, depth 2–4) over {} repositories, each on \
         {} of {} nostr-rs-relay processes; {} expected (related by core::related); \
         plateau {} s, deadline {} s",
        number(events.len() as f64),
        number(chain_replies as f64),
        corpus.repos,
        shape.spread,
        shape.relays,
        number(expected.len() as f64),
        shape.plateau.as_secs(),
        shape.deadline.as_secs(),
    ));
    let holders: HashMap<String, String> = corpus
        .events
        .iter()
        .map(|(r, e)| {
            let on: Vec<String> = listed(*r).map(|i| i.to_string()).collect();
            (e.id.to_hex(), format!("relays {}", on.join("+")))
        })
        .collect();
    let expected_set: HashSet<String> = expected.iter().cloned().collect();
    let counters0 = remote_counters(&remotes);
    let handed: Vec<String> = anns.iter().chain(&states).map(Event::as_json).collect();

    // (a) ngit-grasp syncing into itself.
    eprint!("(a) ngit-grasp… ");
    let mut ngit = Ngit::start(&bins.ngit_grasp, port_a);
    let pid = ngit.daemon.child.id();
    let (cpu0, remotes0) = (cpu_with_children(pid, tick), remotes_cpu(&remotes, tick));
    let started = Instant::now();
    publish_ngit(&url_a, &handed);
    let (present, after, complete) = watch(&url_a, &expected, shape, started, || {
        matches!(ngit.daemon.child.try_wait(), Ok(None))
    });
    let a = Side {
        present,
        complete_after: after,
        complete,
        cpu: cpu_with_children(pid, tick) - cpu0,
        hwm_kib: vm_hwm_kib(pid),
        own: None,
        remotes_cpu: remotes_cpu(&remotes, tick) - remotes0,
    };
    notes.push(format!(
        "reference (a): ngit-grasp at the end: {}",
        ngit_metrics(port_a, &remotes)
    ));
    notes.push(format!(
        "reference (a): ngit-grasp's log (its 30 s pipeline windows as logged, then lines \
         containing): {}; kept in {}",
        log_summary(&ngit.log()),
        ngit.dir.with_extension("log").display()
    ));
    drop(ngit);
    let counters_a = remote_counters(&remotes);
    eprint!(
        "{}/{} in {:.0} s; ",
        a.present.len(),
        expected.len(),
        a.complete_after
    );

    // (b) grasp-sync syncing into a nostr-rs-relay own relay.
    eprint!("(b) grasp-sync… ");
    let own = RelayProc::nostr_rs_on(&bins.nostr_rs_relay, port_b);
    {
        let refs: Vec<&str> = handed.iter().map(String::as_str).collect();
        Client::connect(&own.url).publish(&refs);
    }
    let own_pid = own.child.id();
    let (own_cpu0, remotes0) = (process_seconds(own_pid, tick), remotes_cpu(&remotes, tick));
    let log = std::env::temp_dir().join(format!("grasp-sync-bench-reference-{port_b}.log"));
    let metrics = format!("127.0.0.1:{}", free_port());
    let started = Instant::now();
    let mut daemon = Daemon::spawn(
        &bins.grasp_sync,
        port_b,
        &metrics,
        &["--public-url", &url_b, "--allow-private-relays"],
        "info",
        &log,
    );
    let pid = daemon.child.id();
    let (present, after, complete) = watch(&own.url, &expected, shape, started, || {
        matches!(daemon.child.try_wait(), Ok(None))
    });
    let b = Side {
        present,
        complete_after: after,
        complete,
        cpu: process_seconds(pid, tick),
        hwm_kib: vm_hwm_kib(pid),
        own: Some((
            process_seconds(own_pid, tick) - own_cpu0,
            vm_hwm_kib(own_pid),
        )),
        remotes_cpu: remotes_cpu(&remotes, tick) - remotes0,
    };
    if let Some(line) = copy_counters(metrics.parse().expect("address")) {
        notes.push(format!("reference (b): grasp-sync's remote relays: {line}"));
    }
    daemon.stop();
    let counters_b = remote_counters(&remotes);
    notes.push(format!(
        "reference (b): grasp-sync log in {}",
        log.display()
    ));
    notes.push(format!(
        "reference: the remote relays during (a): {}; during (b): {}",
        remote_delta(&counters_a, &counters0),
        remote_delta(&counters_b, &counters_a)
    ));
    eprint!(
        "{}/{} in {:.0} s; ",
        b.present.len(),
        expected.len(),
        b.complete_after
    );

    // The comparison.
    let only_a: Vec<&String> = a.present.difference(&b.present).collect();
    for (label, side) in [("(a) ngit-grasp", &a), ("(b) grasp-sync", &b)] {
        notes.push(format!(
            "reference {label}: missing {}; by the relays holding them: {}",
            missing_by_category(&expected, &side.present, &cats),
            missing_by_relays(&expected_set, &side.present, &holders)
        ));
    }
    if !only_a.is_empty() {
        notes.push(format!(
            "reference: {} events present on ngit-grasp and not on grasp-sync's own relay: {}",
            only_a.len(),
            missing_by_category(
                &only_a.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                &HashSet::new(),
                &cats
            )
        ));
    }
    let n = expected.len() as f64;
    let mut f = Vec::new();
    for (label, side) in [
        ("(a) ngit-grasp into itself", &a),
        ("(b) grasp-sync into nostr-rs-relay", &b),
    ] {
        let wall = if side.complete {
            "wall time to complete"
        } else {
            "wall time to the last event (plateau)"
        };
        let mut rows = vec![
            ("expected events present", side.present.len() as f64, ""),
            ("share present", side.present.len() as f64 / n, "×"),
            (wall, side.complete_after, "s"),
            ("CPU of the syncing process", side.cpu, "s"),
            (
                "peak RSS of the syncing process",
                side.hwm_kib as f64 / 1024.0,
                "MiB",
            ),
        ];
        if let Some((cpu, hwm)) = side.own {
            rows.push(("own relay process CPU", cpu, "s"));
            rows.push(("own relay process peak RSS", hwm as f64 / 1024.0, "MiB"));
        }
        rows.push(("remote relays' CPU during the run", side.remotes_cpu, "s"));
        f.extend(rows.into_iter().map(|(what, value, unit)| {
            Figure::new(
                format!("reference {label}: {what}"),
                value,
                unit,
                Budget::None,
            )
        }));
    }
    f.push(Figure::new(
        "reference: events ngit-grasp holds and grasp-sync does not",
        only_a.len() as f64,
        "",
        Budget::AtMost(0.0),
    ));
    f
}
