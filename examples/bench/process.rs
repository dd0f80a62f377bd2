//! The process-level section (issue 21, item 1): the release `grasp-sync` binary as its own
//! process against remote relays that are processes of their own (rust-nostr's `LocalRelay`
//! through the `nip77-relay` helper, `$NIP77_RELAY`), on generated NIP-34 data with the size
//! mix of real repositories, into an own relay that is a process too (`LocalRelay`, and
//! nostr-rs-relay for one row when `$NOSTR_RS_RELAY` or its default install path is there).
//!
//! Measured per run, from the binary's start until the own relay holds exactly the expected
//! set (COUNT polled every 250 ms, the set checked by id at the end): wall time, the whole
//! process's CPU (every thread's run time, sampled every 200 ms, the last value per thread
//! kept so threads that exit still count) grouped by thread kind, and peak RSS (`VmHWM`,
//! read right before SIGTERM). Seeding is not measured.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nostr::event::{Event, EventBuilder, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;
use serde_json::Value;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

use super::{
    clock_ticks_per_sec, free_port, number, stat_cpu_ticks, verify_cost, Budget, Figure,
    REPOS_PER_OWNER,
};

/// Budget of issue 21: the process's CPU per unique event at most this many times the
/// one-thread `Event::verify` floor.
const CPU_BUDGET: f64 = 1.30;
const SAMPLE_EVERY: Duration = Duration::from_millis(200);
const COUNT_EVERY: Duration = Duration::from_millis(250);
const SYNC_DEADLINE: Duration = Duration::from_secs(1200);
pub(super) const WAIT: Duration = Duration::from_secs(60);
/// Events in flight per seeding connection before their OKs are read.
const SEED_WINDOW: usize = 256;
/// Ids per REQ of the final set check.
const CHECK_CHUNK: usize = 400;
pub(super) const YEAR: u64 = 365 * 24 * 3600;
pub(super) const NRR_DEFAULT: &str = "/opt/nostr-rs-relay/bin/nostr-rs-relay";

/// The relay binaries of the section.
pub struct Binaries {
    pub(super) grasp_sync: PathBuf,
    pub(super) local_relay: PathBuf,
    pub(super) nostr_rs_relay: Option<PathBuf>,
}

/// The binaries, or why the section cannot run (one line).
pub fn binaries() -> Result<Binaries, String> {
    let grasp_sync = match std::env::var_os("GRASP_SYNC_BIN").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => super::release_binary().ok_or(
            "no target/release/grasp-sync beside the bench: run `cargo build --release` first",
        )?,
    };
    if !grasp_sync.is_file() {
        return Err(format!(
            "GRASP_SYNC_BIN={} does not exist: run `cargo build --release` first",
            grasp_sync.display()
        ));
    }
    let local_relay = std::env::var_os("NIP77_RELAY")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .ok_or("NIP77_RELAY is not set (the nip77-relay helper of tests/nip77-relay)")?;
    if !local_relay.is_file() {
        return Err(format!(
            "NIP77_RELAY={} does not exist",
            local_relay.display()
        ));
    }
    let nostr_rs_relay = std::env::var_os("NOSTR_RS_RELAY")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from(NRR_DEFAULT)))
        .filter(|p| p.is_file());
    Ok(Binaries {
        grasp_sync,
        local_relay,
        nostr_rs_relay,
    })
}

// ----- relay processes -----

/// A relay process on 127.0.0.1; killed (and its temp dir removed) on drop.
pub(super) struct RelayProc {
    pub(super) child: Child,
    stdin: Option<ChildStdin>,
    pub(super) url: String,
    dir: Option<PathBuf>,
}

impl RelayProc {
    /// rust-nostr's `LocalRelay` (in-memory, write rate limit lifted by the helper).
    pub(super) fn local(bin: &Path) -> RelayProc {
        let mut child = Command::new(bin)
            .arg("0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut relay = RelayProc {
            child,
            stdin,
            url: String::new(),
            dir: None,
        };
        let line = rx.recv_timeout(WAIT).expect("nip77-relay prints its URL");
        relay.url = line.trim().trim_end_matches('/').to_string();
        assert!(
            relay.url.starts_with("ws://127.0.0.1:"),
            "nip77-relay printed {line:?}"
        );
        relay
    }

    /// nostr-rs-relay with its SQLite database on disk in a temp dir (its in-memory mode locks
    /// writers out while a query runs; see tests/interop.rs).
    fn nostr_rs(bin: &Path) -> RelayProc {
        RelayProc::nostr_rs_on(bin, free_port())
    }

    /// [`RelayProc::nostr_rs`] on `port`, picked beforehand (its URL goes into announcements).
    pub(super) fn nostr_rs_on(bin: &Path, port: u16) -> RelayProc {
        let dir = std::env::temp_dir().join(format!(
            "grasp-sync-bench-nrr-{}-{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::write(
            dir.join("config.toml"),
            format!(
                "[info]\nrelay_url = \"ws://127.0.0.1:{port}/\"\nname = \"bench\"\n\n\
                 [database]\nengine = \"sqlite\"\ndata_directory = {:?}\nin_memory = false\n\n\
                 [network]\naddress = \"127.0.0.1\"\nport = {port}\n",
                dir.display().to_string()
            ),
        )
        .expect("config.toml");
        let log = File::create(dir.join("relay.log")).expect("relay.log");
        let child = Command::new(bin)
            .arg("--config")
            .arg(dir.join("config.toml"))
            .arg("--db")
            .arg(&dir)
            // NOSTR_RS_RELAY_LOG=debug shows every query (the log is then kept on drop).
            .env(
                "RUST_LOG",
                std::env::var("NOSTR_RS_RELAY_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        let relay = RelayProc {
            child,
            stdin: None,
            url: format!("ws://127.0.0.1:{port}"),
            dir: Some(dir),
        };
        let ready = super::wait_until(WAIT, || TcpStream::connect(("127.0.0.1", port)).is_ok());
        assert!(ready, "nostr-rs-relay did not listen on {port}");
        relay
    }

    pub(super) fn port(&self) -> u16 {
        self.url
            .rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .expect("port in url")
    }
}

impl Drop for RelayProc {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.dir {
            if std::env::var_os("NOSTR_RS_RELAY_LOG").is_some() {
                let _ = std::fs::copy(dir.join("relay.log"), dir.with_extension("log"));
            }
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

// ----- a small blocking client -----

type Ws = WebSocket<MaybeTlsStream<TcpStream>>;

pub(super) struct Client {
    ws: Ws,
}

impl Client {
    pub(super) fn connect(url: &str) -> Client {
        let (ws, _) = tungstenite::connect(url).unwrap_or_else(|e| panic!("connect {url}: {e}"));
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            let _ = s.set_read_timeout(Some(WAIT));
            let _ = s.set_nodelay(true);
        }
        Client { ws }
    }

    fn write(&mut self, text: String) {
        self.ws.write(Message::text(text)).expect("write");
    }

    fn flush(&mut self) {
        self.ws.flush().expect("flush");
    }

    fn recv(&mut self) -> Value {
        loop {
            match self.ws.read().expect("relay answers") {
                Message::Text(t) => return serde_json::from_str(t.as_str()).expect("JSON"),
                Message::Close(_) => panic!("relay closed the connection"),
                _ => {}
            }
        }
    }

    /// Publishes `events` (JSON) and waits for every OK (true, or a duplicate).
    pub(super) fn publish(&mut self, events: &[&str]) {
        self.publish_window(events, SEED_WINDOW);
    }

    /// [`Client::publish`] with `window` events sent before their OKs are read.
    fn publish_window(&mut self, events: &[&str], window: usize) {
        // A sliding window: each OK lets the next event go, so the relay never waits for
        // the client (a window sent whole and awaited whole left it idle between windows).
        let (mut next, mut in_flight) = (0, 0);
        while next < events.len() || in_flight > 0 {
            while in_flight < window && next < events.len() {
                self.write(format!(r#"["EVENT",{}]"#, events[next]));
                next += 1;
                in_flight += 1;
            }
            self.flush();
            let v = self.recv();
            if v[0] == "OK" {
                let msg = v[3].as_str().unwrap_or_default();
                assert!(
                    v[2] == true || msg.starts_with("duplicate"),
                    "seeding refused: {v}"
                );
                in_flight -= 1;
            }
        }
    }

    /// NIP-45 COUNT of every event (None when the relay does not answer COUNT).
    pub(super) fn count_all(&mut self) -> Option<u64> {
        self.write(r#"["COUNT","n",{}]"#.into());
        self.flush();
        loop {
            let v = self.recv();
            match v[0].as_str() {
                Some("COUNT") => return v[2]["count"].as_u64(),
                Some("NOTICE") | Some("CLOSED") => return None,
                _ => {}
            }
        }
    }

    /// How many of `ids` the relay holds.
    pub(super) fn held(&mut self, ids: &[String]) -> usize {
        self.held_ids(ids).len()
    }

    /// Which of `ids` the relay holds (REQs of at most [`CHECK_CHUNK`] ids, each a
    /// subscription id of its own, so a late answer to an earlier call is never counted).
    pub(super) fn held_ids(&mut self, ids: &[String]) -> HashSet<String> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut held = HashSet::new();
        for chunk in ids.chunks(CHECK_CHUNK) {
            let sub = format!("v{}", NEXT.fetch_add(1, Ordering::Relaxed));
            let req = serde_json::json!(["REQ", sub, {"ids": chunk, "limit": chunk.len()}]);
            self.write(req.to_string());
            self.flush();
            loop {
                let v = self.recv();
                if v[1] != sub.as_str() {
                    continue;
                }
                match v[0].as_str() {
                    Some("EVENT") => {
                        held.insert(v[2]["id"].as_str().unwrap_or_default().to_string());
                    }
                    Some("EOSE") => break,
                    Some("CLOSED") => break,
                    _ => {}
                }
            }
            self.write(format!(r#"["CLOSE","{sub}"]"#));
        }
        self.flush();
        held
    }
}

// ----- NIP-34 data with the size mix of real repositories -----

/// A small deterministic generator (xorshift64*): the same data on every run.
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

    /// A size between `lo` and `hi`, log-uniform (many small, a few large, as real patches
    /// and comments are).
    fn log_size(&mut self, lo: usize, hi: usize) -> usize {
        let f = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((lo as f64).ln() + f * ((hi as f64).ln() - (lo as f64).ln())).exp() as usize
    }

    fn hex(&mut self, len: usize) -> String {
        let mut s = String::with_capacity(len);
        while s.len() < len {
            s.push_str(&format!("{:016x}", self.next()));
        }
        s.truncate(len);
        s
    }
}

const WORDS: &[&str] = &[
    "the", "fn", "let", "self", "config", "relay", "event", "error", "return", "match", "Some",
    "None", "impl", "struct", "value", "into", "test", "when", "this", "should", "because",
    "merge", "branch", "commit", "fix", "patch", "review", "thanks", "looks", "good", "to",
];

fn words(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        s.push_str(WORDS[rng.below(WORDS.len())]);
        s.push(if rng.below(12) == 0 { '\n' } else { ' ' });
    }
    s
}

/// A `git format-patch` text with a diff of about `bytes` bytes.
fn patch_text(rng: &mut Rng, bytes: usize) -> String {
    let commit = rng.hex(40);
    let mut s = format!(
        "From {commit} Mon Sep 17 00:00:00 2001\nFrom: Dev <dev@example.org>\n\
         Date: Tue, 2 Dec 2025 10:00:00 +0100\nSubject: [PATCH] {}\n\n{}\n---\n \
         src/lib.rs | 12 ++++++------\n 1 file changed\n\n\
         diff --git a/src/lib.rs b/src/lib.rs\nindex {}..{} 100644\n--- a/src/lib.rs\n+++ b/src/lib.rs\n",
        words(rng, 40).replace('\n', " "),
        words(rng, 200),
        rng.hex(7),
        rng.hex(7)
    );
    while s.len() < bytes {
        if rng.below(20) == 0 {
            s.push_str(&format!(
                "@@ -{},7 +{},8 @@ impl Relay {{\n",
                rng.below(900),
                rng.below(900)
            ));
        }
        let sign = ["+", "-", " ", " "][rng.below(4)];
        s.push_str(sign);
        s.push_str("        ");
        let len = 20 + rng.below(50);
        s.push_str(&words(rng, len).replace('\n', " "));
        s.push_str(";\n");
    }
    s.push_str("-- \n2.47.0\n");
    s
}

pub(super) fn sign_event(
    keys: &Keys,
    kind: u16,
    content: &str,
    tags: &[Vec<String>],
    at: u64,
) -> Event {
    let mut b = EventBuilder::new(Kind::Custom(kind), content)
        .custom_created_at(nostr::types::Timestamp::from_secs(at));
    for t in tags {
        b = b.tag(Tag::parse(t.iter().map(String::as_str)).expect("tag"));
    }
    b.finalize(keys).expect("sign")
}

pub(super) fn tag(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| s.to_string()).collect()
}

/// Repositories (10 per owner), and `n` events of them: patches (kind 1617, with diffs of
/// `patch` bytes, log-uniform), issues (1621), NIP-22 comments (1111) on those roots and
/// status events (1630–1633).
pub(super) struct Corpus {
    pub(super) owners: Vec<Keys>,
    pub(super) repos: usize,
    /// (repository, event).
    pub(super) events: Vec<(usize, Event)>,
    /// Seconds the events' `created_at` spread over, ending now.
    span: u64,
    /// Announcements newer than every event (else older).
    new_announcements: bool,
}

impl Corpus {
    pub(super) fn generate(
        repos: usize,
        n: usize,
        patch: (usize, usize),
        seed: u64,
        span: u64,
    ) -> Corpus {
        Corpus::generate_with(repos, n, patch, seed, span, false)
    }

    /// [`Corpus::generate`]; with `chains`, one event in eight is a reply below a comment
    /// that tags only its parent (a legacy kind-1 reply, `["e", parent, "", "reply"]`), up
    /// to four generations below the root: reachable only by following the chain.
    pub(super) fn generate_with(
        repos: usize,
        n: usize,
        patch: (usize, usize),
        seed: u64,
        span: u64,
        chains: bool,
    ) -> Corpus {
        let mut rng = Rng(seed | 1);
        // Comments and chain replies per repository, with their depth below the root.
        let mut thread: Vec<Vec<(String, String, u8)>> = vec![Vec::new(); repos];
        let owners: Vec<Keys> = (0..repos.div_ceil(REPOS_PER_OWNER))
            .map(|_| Keys::generate())
            .collect();
        let people: Vec<Keys> = (0..64).map(|_| Keys::generate()).collect();
        let mut roots: Vec<Vec<(String, u16, String)>> = vec![Vec::new(); repos];
        let mut events = Vec::with_capacity(n);
        // Spread over the last year in order (real histories do not share one second; a
        // relay without NIP-77 is paged by created_at).
        let now = nostr::types::Timestamp::now().as_secs();
        // `span` seconds in all; shorter than one second per event, several share a second
        // (a busy day, or data published by a script).
        let span = span.max(1);
        let step = (span / n.max(1) as u64).max(1);
        let start = now - span;
        for i in 0..n {
            let at = if span >= n as u64 {
                start + i as u64 * step + rng.below(step as usize) as u64
            } else {
                start + i as u64 * span / n as u64
            };
            let r = i % repos;
            let owner = &owners[r / REPOS_PER_OWNER];
            let repo = format!("30617:{}:repo-{r}", owner.public_key().to_hex());
            let owner_hex = owner.public_key().to_hex();
            let author = &people[rng.below(people.len())];
            let roll = rng.below(100);
            let parent = (chains && rng.below(8) == 0 && !thread[r].is_empty())
                .then(|| thread[r][rng.below(thread[r].len())].clone())
                .filter(|(_, _, depth)| *depth < 4);
            let e = if let Some((parent, parent_author, depth)) = parent {
                let len = rng.log_size(40, 800);
                let text = words(&mut rng, len);
                let tags = vec![
                    tag(&["e", &parent, "", "reply"]),
                    tag(&["p", &parent_author]),
                ];
                let e = sign_event(author, 1, &text, &tags, at);
                thread[r].push((e.id.to_hex(), e.pubkey.to_hex(), depth + 1));
                e
            } else if roll < 14 || (roots[r].is_empty() && roll < 60) {
                // A patch; the first of a series is a root, the rest reply to it.
                let len = rng.log_size(patch.0, patch.1);
                let text = patch_text(&mut rng, len);
                let mut tags = vec![
                    tag(&["a", &repo]),
                    tag(&["r", &rng.hex(40)]),
                    tag(&["p", &owner_hex]),
                    tag(&["commit", &rng.hex(40)]),
                    tag(&["parent-commit", &rng.hex(40)]),
                    tag(&["alt", "git patch"]),
                ];
                let series = roots[r].iter().rev().find(|(_, k, _)| *k == 1617).cloned();
                match series {
                    Some((root, _, _)) if rng.below(2) == 0 => {
                        tags.push(tag(&["e", &root, "", "reply"]));
                    }
                    _ => tags.push(tag(&["t", "root"])),
                }
                let e = sign_event(author, 1617, &text, &tags, at);
                if tags.iter().any(|t| t[0] == "t") {
                    roots[r].push((e.id.to_hex(), 1617, e.pubkey.to_hex()));
                }
                e
            } else if roll < 24 || roots[r].is_empty() {
                let subject = words(&mut rng, 40).replace('\n', " ");
                let len = rng.log_size(150, 3_000);
                let text = words(&mut rng, len);
                let tags = vec![
                    tag(&["a", &repo]),
                    tag(&["p", &owner_hex]),
                    tag(&["subject", subject.trim()]),
                    tag(&["alt", "git issue"]),
                ];
                let e = sign_event(author, 1621, &text, &tags, at);
                roots[r].push((e.id.to_hex(), 1621, e.pubkey.to_hex()));
                e
            } else if roll < 86 {
                let (root, kind, root_author) = roots[r][rng.below(roots[r].len())].clone();
                let k = kind.to_string();
                let len = rng.log_size(40, 1_500);
                let text = words(&mut rng, len);
                let tags = vec![
                    tag(&["E", &root, "", &root_author]),
                    tag(&["K", &k]),
                    tag(&["P", &root_author]),
                    tag(&["e", &root, "", &root_author]),
                    tag(&["k", &k]),
                    tag(&["p", &root_author]),
                ];
                let e = sign_event(author, 1111, &text, &tags, at);
                thread[r].push((e.id.to_hex(), e.pubkey.to_hex(), 1));
                e
            } else {
                let (root, _, root_author) = roots[r][rng.below(roots[r].len())].clone();
                let kind = 1630 + rng.below(4) as u16;
                let tags = vec![
                    tag(&["e", &root, "", "root"]),
                    tag(&["p", &root_author]),
                    tag(&["p", &owner_hex]),
                    tag(&["a", &repo]),
                    tag(&["alt", "git status"]),
                ];
                sign_event(owner, kind, "", &tags, at)
            };
            events.push((r, e));
        }
        Corpus {
            owners,
            repos,
            events,
            span,
            new_announcements: false,
        }
    }

    /// The announcement of repository `r` listing `relays`, as ngit writes them.
    pub(super) fn announcement(&self, r: usize, relays: &[String]) -> Event {
        let owner = &self.owners[r / REPOS_PER_OWNER];
        let clone = format!(
            "https://git.example.org/{}/repo-{r}.git",
            owner.public_key()
        );
        self.announcement_cloned(r, &clone, relays)
    }

    /// [`Corpus::announcement`] with the `clone` URL given (a GRASP server accepts only an
    /// announcement whose `clone` names its domain).
    pub(super) fn announcement_cloned(&self, r: usize, clone: &str, relays: &[String]) -> Event {
        let owner = &self.owners[r / REPOS_PER_OWNER];
        let d = format!("repo-{r}");
        let mut relay_tag = vec!["relays".to_string()];
        relay_tag.extend(relays.iter().cloned());
        let tags = vec![
            tag(&["d", &d]),
            tag(&["name", &d]),
            tag(&[
                "description",
                "A tool that does one thing well, with a longer description of what it is for.",
            ]),
            tag(&["clone", clone]),
            tag(&["web", &format!("https://gitworkshop.dev/repo/{d}")]),
            relay_tag,
            tag(&["r", &format!("{:040x}", r), "euc"]),
            tag(&["maintainers", &owner.public_key().to_hex()]),
            tag(&["alt", &format!("git repository: {d}")]),
        ];
        sign_event(
            owner,
            30617,
            "",
            &tags,
            // Each its own minute before the events (more than a page in one second cannot
            // be paged by created_at on a relay without NIP-77).
            if self.new_announcements {
                // Announced (or updated) after their events, as a repository's latest
                // announcement usually is.
                nostr::types::Timestamp::now().as_secs() - (self.repos - r) as u64
            } else {
                nostr::types::Timestamp::now().as_secs()
                    - self.span
                    - 60
                    - 60 * (self.repos - r) as u64
            },
        )
    }

    /// Whether `e` is a root event (an issue, or a patch that starts a series): what a GRASP
    /// server's own relay holds before its sync when `--seed-roots` is given.
    pub(super) fn is_root(e: &Event) -> bool {
        e.kind.as_u16() == 1621
            || (e.kind.as_u16() == 1617
                && e.tags
                    .iter()
                    .any(|t| t.as_slice().first().map(String::as_str) == Some("t")))
    }

    pub(super) fn mean_bytes(&self) -> f64 {
        let total: usize = self.events.iter().map(|(_, e)| e.as_json().len()).sum();
        total as f64 / self.events.len().max(1) as f64
    }
}

// ----- the measured process -----

/// Which threads of the binary a CPU second belongs to (comm is cut at 15 bytes: remote
/// relays "relay ws://127.", the own relay's self-subscription "relay ws://loca" because the
/// binary is given the own relay as ws://localhost:PORT).
pub(super) fn thread_kind(comm: &str) -> &'static str {
    match comm {
        "coordinator" => "coordinator",
        "forwarder" | "forwarder-read" => "forwarder",
        _ if comm.starts_with("relay ws://loca") => "own relay",
        _ if comm.starts_with("relay ") => "relays",
        _ => "other",
    }
}

/// Run time in seconds of one thread (`schedstat`, ns; `stat` ticks where it is missing).
fn task_seconds(dir: &Path, tick: f64) -> Option<f64> {
    std::fs::read_to_string(dir.join("schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map(|ns| ns as f64 / 1e9)
        .or_else(|| {
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            Some(stat_cpu_ticks(&stat) as f64 / tick)
        })
}

/// tid → (comm, seconds): the last value seen of every thread of `pid`.
pub(super) type Threads = HashMap<u32, (String, f64)>;

pub(super) fn sample(pid: u32, tick: f64, into: &mut Threads) {
    let dir = format!("/proc/{pid}/task");
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if let Some(s) = task_seconds(&entry.path(), tick) {
            into.insert(tid, (comm.trim().to_string(), s));
        }
    }
}

/// utime + stime of the whole process (threads that exited included), seconds.
pub(super) fn process_seconds(pid: u32, tick: f64) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat_cpu_ticks(&stat) as f64 / tick
}

pub(super) fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// The binary; SIGTERM then kill on drop.
pub(super) struct Daemon {
    pub(super) child: Child,
}

impl Daemon {
    /// `bin` syncing into the own relay on `port`, named `ws://localhost:PORT` (so its
    /// self-subscription thread, "relay ws://loca…", is told from the remote relays' on
    /// 127.0.0.1), `/status` on `metrics`, `RUST_LOG` `log_level`, stderr into `log`.
    pub(super) fn spawn(
        bin: &Path,
        port: u16,
        metrics: &str,
        args: &[&str],
        log_level: &str,
        log: &Path,
    ) -> Daemon {
        let child = Command::new(bin)
            .args(["--own-relay", &format!("ws://localhost:{port}")])
            .args(["--metrics-addr", metrics])
            .args(args)
            .env("RUST_LOG", log_level)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(log).expect("log file"))
            .spawn()
            .expect("start grasp-sync");
        Daemon { child }
    }

    pub(super) fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let end = Instant::now() + Duration::from_secs(15);
            while Instant::now() < end && matches!(self.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What one run measured.
pub(super) struct Run {
    own: Own,
    pub(super) unique: usize,
    pub(super) seconds: f64,
    pub(super) cpu: f64,
    by_kind: BTreeMap<&'static str, f64>,
    by_comm: BTreeMap<String, f64>,
    pub(super) hwm_kib: u64,
    threads_seen: usize,
}

/// The kind of the own relay.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Own {
    Local,
    NostrRs,
}

/// Events in flight when the write ceiling is measured on nostr-rs-relay: it drops `OK`s
/// beyond 128 queued for a connection.
const NRR_CEILING_WINDOW: usize = 100;

/// The own relay's write ceiling: the variant's whole set of `events` (a relay that slows
/// as its store grows is measured over the same growth as the sync) published into a fresh
/// relay process of the kind `own` by one client, as many in flight as the relay takes
/// ([`NRR_CEILING_WINDOW`] on nostr-rs-relay, [`SEED_WINDOW`] on LocalRelay), a sliding
/// window; events per second.
fn write_ceiling(bins: &Binaries, own: Own, events: &[&str]) -> (f64, usize, usize) {
    let (relay, window) = match own {
        Own::Local => (RelayProc::local(&bins.local_relay), SEED_WINDOW),
        Own::NostrRs => (
            RelayProc::nostr_rs(bins.nostr_rs_relay.as_ref().expect("checked")),
            NRR_CEILING_WINDOW,
        ),
    };
    let mut client = Client::connect(&relay.url);
    let started = Instant::now();
    client.publish_window(events, window);
    (
        events.len() as f64 / started.elapsed().as_secs_f64(),
        events.len(),
        window,
    )
}

/// `relays` remote relay processes, each repository on `spread` of them, seeded in parallel
/// with their announcements and events (not measured); the announcements.
pub(super) fn remote_relays(
    bins: &Binaries,
    corpus: &Corpus,
    relays: usize,
    spread: usize,
) -> (Vec<RelayProc>, Vec<Event>) {
    let remotes: Vec<RelayProc> = (0..relays)
        .map(|_| RelayProc::local(&bins.local_relay))
        .collect();
    let urls: Vec<String> = remotes.iter().map(|r| r.url.clone()).collect();
    let anns: Vec<Event> = (0..corpus.repos)
        .map(|r| {
            let on: Vec<String> = listed(r, relays, spread).map(|i| urls[i].clone()).collect();
            corpus.announcement(r, &on)
        })
        .collect();
    let mut per_relay: Vec<Vec<String>> = vec![Vec::new(); relays];
    for (r, a) in anns.iter().enumerate() {
        for i in listed(r, relays, spread) {
            per_relay[i].push(a.as_json());
        }
    }
    for (r, e) in &corpus.events {
        let json = e.as_json();
        for i in listed(*r, relays, spread) {
            per_relay[i].push(json.clone());
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
    (remotes, anns)
}

/// The remote relays (indices) that list repository `r`.
pub(super) fn listed(r: usize, relays: usize, spread: usize) -> impl Iterator<Item = usize> {
    (0..spread.min(relays)).map(move |k| (r + k) % relays)
}

/// A fresh own relay of the kind `own` holding the announcements, and with `seed_roots` the
/// root events too (a GRASP server that took them in by itself before its sync ran); how
/// many events it holds.
pub(super) fn own_relay(
    bins: &Binaries,
    own: Own,
    anns: &[Event],
    corpus: &Corpus,
    seed_roots: bool,
) -> (RelayProc, usize) {
    let relay = match own {
        Own::Local => RelayProc::local(&bins.local_relay),
        Own::NostrRs => RelayProc::nostr_rs(bins.nostr_rs_relay.as_ref().expect("checked")),
    };
    let roots = corpus
        .events
        .iter()
        .filter(|(_, e)| seed_roots && Corpus::is_root(e))
        .map(|(_, e)| e);
    let json: Vec<String> = anns.iter().chain(roots).map(Event::as_json).collect();
    let refs: Vec<&str> = json.iter().map(String::as_str).collect();
    Client::connect(&relay.url).publish(&refs);
    (relay, json.len())
}

/// Every id the own relay must hold after the sync: the announcements and every event.
pub(super) fn expected_ids(anns: &[Event], corpus: &Corpus) -> HashSet<String> {
    anns.iter()
        .map(|e| e.id.to_hex())
        .chain(corpus.events.iter().map(|(_, e)| e.id.to_hex()))
        .collect()
}

/// What [`watch`] saw of a process copying events into an own relay.
pub(super) struct Watched {
    /// From `started` until the own relay held the target (or the watch gave up).
    pub(super) seconds: f64,
    pub(super) complete: bool,
    /// The own relay's last count.
    pub(super) last: u64,
    /// The last run time of every thread seen.
    pub(super) threads: Threads,
    /// utime + stime of the whole process at the end.
    pub(super) total: f64,
    pub(super) hwm_kib: u64,
    /// Whether the own relay answered COUNT (else `fallback` counted).
    pub(super) use_count: bool,
}

/// Samples every thread of `pid` every [`SAMPLE_EVERY`] and polls the own relay's COUNT every
/// [`COUNT_EVERY`] (where COUNT is not answered, `fallback`) until it reaches `target`, the
/// process is no longer `alive`, or [`SYNC_DEADLINE`] passes since `started`; then reads the
/// process's CPU time and peak RSS (the process must still run).
pub(super) fn watch(
    pid: u32,
    started: Instant,
    own_url: &str,
    target: u64,
    fallback: &mut dyn FnMut() -> Option<u64>,
    alive: &mut dyn FnMut() -> bool,
) -> Watched {
    let tick = clock_ticks_per_sec();
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
    let mut counter = Client::connect(own_url);
    let mut last = 0;
    let mut complete = false;
    let mut use_count = true;
    while started.elapsed() < SYNC_DEADLINE {
        let n = if use_count { counter.count_all() } else { None };
        let n = n.or_else(|| {
            use_count = false;
            fallback()
        });
        if let Some(n) = n {
            last = n;
            if n >= target {
                complete = true;
                break;
            }
        }
        if !alive() {
            break;
        }
        std::thread::sleep(COUNT_EVERY);
    }
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut threads = sampler.join().expect("sampler");
    sample(pid, tick, &mut threads);
    Watched {
        seconds,
        complete,
        last,
        threads,
        total: process_seconds(pid, tick),
        hwm_kib: vm_hwm_kib(pid),
        use_count,
    }
}

/// One variant: `relays` remote relay processes, each repository on `spread` of them.
fn run(
    bins: &Binaries,
    corpus: &Corpus,
    relays: usize,
    spread: usize,
    own_kind: Own,
    seed_roots: bool,
    notes: &mut Vec<String>,
) -> Run {
    let seeded = Instant::now();
    let (_remotes, anns) = remote_relays(bins, corpus, relays, spread);
    let (own, seeded_own) = own_relay(bins, own_kind, &anns, corpus, seed_roots);
    let expected = expected_ids(&anns, corpus);
    eprint!("seeded in {:.0} s; ", seeded.elapsed().as_secs_f64());
    grasp_sync_run(
        bins,
        &own,
        own_kind,
        &expected,
        seeded_own,
        anns.len(),
        notes,
    )
}

/// The release binary syncing into `own` (holding `seeded_own` events, `anns` of them the
/// announcements) until it holds exactly `expected`; panics where it does not.
pub(super) fn grasp_sync_run(
    bins: &Binaries,
    own: &RelayProc,
    own_kind: Own,
    expected: &HashSet<String>,
    seeded_own: usize,
    anns: usize,
    notes: &mut Vec<String>,
) -> Run {
    let unique = expected.len() - anns;
    let log = std::env::temp_dir().join(format!("grasp-sync-bench-process-{}.log", own.port()));
    let metrics = format!("127.0.0.1:{}", free_port());
    let started = Instant::now();
    let mut daemon = Daemon::spawn(
        &bins.grasp_sync,
        own.port(),
        &metrics,
        &[
            "--allow-private-relays",
            "--archive",
            "--batch-window",
            "200",
        ],
        // BENCH_DAEMON_LOG raises the daemon's log level (e.g. `grasp_sync=debug`).
        &std::env::var("BENCH_DAEMON_LOG").unwrap_or_else(|_| "warn".into()),
        &log,
    );
    let pid = daemon.child.id();
    let target = expected.len() as u64;
    let metrics_addr: std::net::SocketAddr = metrics.parse().expect("address");
    // COUNT on the own relay; where it is not answered, the binary's own count of events
    // the own relay stored (`/status`), the set being checked by id at the end either way.
    let watched = watch(
        pid,
        started,
        &own.url,
        target,
        &mut || {
            let (code, body) = grasp_sync::ops::http::get(metrics_addr, "/status", WAIT).ok()?;
            let doc: Value = serde_json::from_str(&body).ok().filter(|_| code == 200)?;
            Some(doc["forward"]["stored"].as_u64()? + seeded_own as u64)
        },
        &mut || matches!(daemon.child.try_wait(), Ok(None)),
    );
    let Watched {
        seconds,
        complete,
        last,
        threads,
        total,
        hwm_kib,
        use_count,
    } = watched;
    if let Some(line) = copy_counters(metrics_addr) {
        notes.push(format!("process: remote relays' events: {line}"));
    }
    daemon.stop();
    assert!(
        complete,
        "the own relay holds {last} of {target} events after {seconds:.0} s (log: {})",
        log.display()
    );
    // Exactly the expected set: all of it held, and nothing else (COUNT equals its size).
    let ids: Vec<String> = expected.iter().cloned().collect();
    let held = Client::connect(&own.url).held(&ids);
    assert_eq!(held, ids.len(), "the own relay misses expected events");
    assert_eq!(last, target, "the own relay holds events not expected");
    if !use_count {
        notes.push("process: the own relay answers no COUNT: progress read from /status".into());
    }
    if seconds > 60.0 {
        // A slow run: keep its log beside the usual name.
        let _ = std::fs::copy(
            &log,
            log.with_extension(format!("slow-{}.log", std::process::id())),
        );
    }
    if std::env::var_os("BENCH_DAEMON_LOG").is_some() {
        notes.push(format!(
            "process: the binary's log kept at {}",
            log.display()
        ));
    } else {
        let _ = std::fs::remove_file(&log);
    }

    let mut by_kind: BTreeMap<&'static str, f64> = BTreeMap::new();
    let mut by_comm: BTreeMap<String, f64> = BTreeMap::new();
    for (comm, s) in threads.values() {
        *by_kind.entry(thread_kind(comm)).or_default() += s;
        *by_comm.entry(comm.clone()).or_default() += s;
    }
    let sampled: f64 = by_kind.values().sum();
    // Threads that lived less than a sample: in the process total, not in any sample.
    if total > sampled {
        *by_kind.entry("other").or_default() += total - sampled;
    }
    if (total - sampled).abs() > 0.05 * total.max(sampled) {
        notes.push(format!(
            "process: per-thread samples {sampled:.2} s vs. the process's utime+stime {total:.2} s"
        ));
    }
    Run {
        own: own_kind,
        unique,
        seconds,
        cpu: total.max(sampled),
        by_kind,
        by_comm,
        hwm_kib,
        threads_seen: threads.len(),
    }
}

/// The remote relays' event counters summed from `/status`: copies received, parsed and
/// checked, Schnorr checks, and copies not forwarded (where the per-copy CPU goes).
pub(super) fn copy_counters(addr: std::net::SocketAddr) -> Option<String> {
    let (code, body) = grasp_sync::ops::http::get(addr, "/status", WAIT).ok()?;
    let doc: Value = serde_json::from_str(&body).ok().filter(|_| code == 200)?;
    let mut sums = [0u64; 5];
    for relay in doc["relays"].as_array()? {
        let events = &relay["events"];
        for (sum, key) in sums.iter_mut().zip([
            "received",
            "accepted",
            "signature_checks",
            "copies_not_forwarded",
            "fetch_ids_in_flight",
        ]) {
            *sum += events[key].as_u64().unwrap_or(0);
        }
    }
    let [received, accepted, checks, not_forwarded, in_flight] = sums;
    let sync = &doc["sync"];
    let counter = |key: &str| sync[key].as_u64().unwrap_or(0);
    Some(format!(
        "{received} received, {accepted} parsed and accepted, {checks} signature checks, \
         {not_forwarded} copies not forwarded, {} received but not accepted (copies \
         recognised by id unparsed, and any dropped); {} reconciliations ({} skipped: own \
         relay empty), {} ids fetched ({in_flight} more not asked for: in flight); {} batches \
         confirmed, {} pages requested, {} consolidations; fetch ids asked again {}, \
         listed and not delivered {}; batches failed {}, queries resent {}, reconciliation \
         fallbacks {}; forwarder: resent {}, relay errors {}",
        received.saturating_sub(accepted),
        counter("reconciliations"),
        counter("reconcile_skipped_empty"),
        counter("reconcile_ids_fetched"),
        counter("batches_confirmed"),
        counter("pages_requested"),
        counter("consolidations"),
        counter("fetch_ids_retried"),
        counter("fetch_ids_undelivered"),
        counter("batches_failed"),
        counter("queries_resent"),
        // By reason, only those that happened (a stall's cause, e.g. `own_side` after the
        // EOSE deadline, shows here even when the daemon's log is gone).
        sync["reconcile_fallbacks"]
            .as_object()
            .map(|m| {
                let named: Vec<String> = m
                    .iter()
                    .filter(|(_, v)| v.as_u64().unwrap_or(0) > 0)
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                if named.is_empty() {
                    "0".to_string()
                } else {
                    named.join(", ")
                }
            })
            .unwrap_or_default(),
        doc["forward"]["resent"].as_u64().unwrap_or(0),
        doc["forward"]["relay_errors"].as_u64().unwrap_or(0),
    ))
}

/// Figures of one variant.
fn figures_of(
    label: &str,
    run: &Run,
    floor: f64,
    ceiling: (f64, usize, usize),
    notes: &mut Vec<String>,
) -> Vec<Figure> {
    let per = run.cpu / run.unique as f64;
    let mut f = vec![
        Figure::new(
            format!("{label}: unique events"),
            run.unique as f64,
            "",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: wall time"),
            run.seconds,
            "s",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: unique ev/s into the own relay"),
            run.unique as f64 / run.seconds,
            "ev/s",
            Budget::None,
        ),
        Figure::new(
            format!(
                "{label}: own relay's write ceiling (one client, {} events, {} in flight)",
                number(ceiling.1 as f64),
                ceiling.2
            ),
            ceiling.0,
            "ev/s",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: into the own relay ÷ its write ceiling"),
            run.unique as f64 / run.seconds / ceiling.0,
            "×",
            // Only where the own relay is the bottleneck does the ratio measure the
            // forwarder (issue 21, item 5); on LocalRelay the CPU of the sync bounds it.
            if run.own == Own::NostrRs {
                Budget::AtLeast(0.80)
            } else {
                Budget::None
            },
        ),
        Figure::new(
            format!("{label}: verify floor per event"),
            floor * 1e6,
            "µs",
            Budget::None,
        ),
        Figure::new(
            format!("{label}: process CPU per unique event"),
            per * 1e6,
            "µs",
            Budget::AtMost(CPU_BUDGET * floor * 1e6),
        ),
        Figure::new(
            format!("{label}: process CPU ÷ verify"),
            per / floor,
            "×",
            Budget::AtMost(CPU_BUDGET),
        ),
    ];
    for kind in ["relays", "own relay", "coordinator", "forwarder", "other"] {
        let s = run.by_kind.get(kind).copied().unwrap_or(0.0);
        f.push(Figure::new(
            format!("{label}: CPU per unique, {kind} threads"),
            s / run.unique as f64 * 1e6,
            "µs",
            Budget::None,
        ));
    }
    f.push(Figure::new(
        format!("{label}: peak RSS"),
        run.hwm_kib as f64 / 1024.0,
        "MiB",
        Budget::None,
    ));
    let mut comms: Vec<(&String, &f64)> = run.by_comm.iter().collect();
    comms.sort_by(|a, b| b.1.total_cmp(a.1));
    let top: Vec<String> = comms
        .iter()
        .take(8)
        .map(|(c, s)| format!("{c:?} {s:.2} s"))
        .collect();
    notes.push(format!(
        "{label}: {} threads seen; CPU by thread name: {}",
        run.threads_seen,
        top.join(", ")
    ));
    f
}

/// The data's shape beyond its size.
#[derive(Clone, Copy, Default)]
pub struct Shape {
    /// Repositories (default 30 per relay).
    pub repos: Option<usize>,
    /// The own relay holds the root events before the sync, not only the announcements.
    pub seed_roots: bool,
    /// Seconds the events' `created_at` spread over (default a year).
    pub span: Option<u64>,
    /// Announcements newer than every event (default: older).
    pub new_announcements: bool,
}

/// The section: variant A (repositories on 1 relay), B (on 3), large patches, and one row
/// with nostr-rs-relay as the own relay.
pub fn process_figures(
    bins: &Binaries,
    events: usize,
    relays: usize,
    spread: Option<usize>,
    large_events: usize,
    shape: Shape,
    notes: &mut Vec<String>,
) -> Vec<Figure> {
    let mut figures = Vec::new();
    let repos = shape.repos.unwrap_or(30 * relays);
    let seed_roots = shape.seed_roots;
    if seed_roots {
        notes.push(
            "process: the own relay holds the announcements and the root events before the sync"
                .into(),
        );
    }
    let span = shape.span.unwrap_or(YEAR);
    let mut corpus = Corpus::generate(repos, events, (400, 16_000), 21, span);
    corpus.new_announcements = shape.new_announcements;
    if span != YEAR {
        notes.push(format!("process: created_at spread over the last {span} s"));
    }
    notes.push(format!(
        "process: {} events over {repos} repositories, mean {:.0} bytes of JSON",
        number(corpus.events.len() as f64),
        corpus.mean_bytes()
    ));
    let all: Vec<Event> = corpus.events.iter().map(|(_, e)| e.clone()).collect();
    let spreads = spread.map_or(vec![1, 3], |s| vec![s]);
    let mut variant = |corpus: &Corpus,
                       all: &[Event],
                       label: String,
                       spread: usize,
                       own: Own,
                       notes: &mut Vec<String>| {
        let before = verify_cost(all);
        let run = run(bins, corpus, relays, spread, own, seed_roots, notes);
        let after = verify_cost(all);
        let json: Vec<String> = corpus.events.iter().map(|(_, e)| e.as_json()).collect();
        let refs: Vec<&str> = json.iter().map(String::as_str).collect();
        let ceiling = write_ceiling(bins, own, &refs);
        notes.push(format!(
            "{label}: verify floor before and after: {:.1} and {:.1} µs",
            before * 1e6,
            after * 1e6
        ));
        let floor = (before + after) / 2.0;
        eprint!(
            "{label}: {:.1} s, {:.0} µs CPU per event ({:.2} × verify), peak RSS {:.0} MiB; ",
            run.seconds,
            run.cpu / run.unique as f64 * 1e6,
            run.cpu / run.unique as f64 / floor,
            run.hwm_kib as f64 / 1024.0
        );
        figures.extend(figures_of(&label, &run, floor, ceiling, notes));
    };
    for s in spreads {
        let label = format!(
            "process, {} ev, {relays} relays, repo on {s}",
            number(events as f64)
        );
        variant(&corpus, &all, label, s, Own::Local, notes);
    }
    if large_events > 0 {
        let large = Corpus::generate(repos, large_events, (20_000, 100_000), 34, span);
        notes.push(format!(
            "process, large patches: {} events, mean {:.0} bytes of JSON",
            number(large.events.len() as f64),
            large.mean_bytes()
        ));
        let all: Vec<Event> = large.events.iter().map(|(_, e)| e.clone()).collect();
        let label = format!(
            "process, {} ev with 20–100 KB patches, {relays} relays, repo on 1",
            number(large_events as f64)
        );
        variant(&large, &all, label, 1, Own::Local, notes);
    }
    if bins.nostr_rs_relay.is_some() {
        let label = format!(
            "process, {} ev, {relays} relays, repo on 1, own nostr-rs-relay",
            number(events as f64)
        );
        variant(&corpus, &all, label, 1, Own::NostrRs, notes);
    } else {
        eprintln!("process: nostr-rs-relay row skipped: NOSTR_RS_RELAY names no file and {NRR_DEFAULT} is missing");
    }
    figures
}
