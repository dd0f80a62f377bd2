//! Interoperability with ngit-grasp 3.0.10, the GRASP reference server: the real binary,
//! started as a child process by each test on 127.0.0.1 (a free port, a fresh temp dir for
//! its data, killed on drop), as the own relay and as a remote relay.
//!
//! The binary is `$NGIT_GRASP`, else `/opt/ngit-grasp/bin/ngit-grasp`, else `ngit-grasp` on
//! `PATH`. When it is missing the tests print "skipping" and pass, except under CI (`CI`
//! set), where they fail. `.ci/run` installs it (see there: `cargo install` does not work
//! for 3.0.10). It needs `git` on `PATH`.
//!
//! How each instance runs (read from its docs and source; `docs/relays.md` has the details):
//!
//! * `NGIT_DOMAIN` and `NGIT_BIND_ADDRESS` are `127.0.0.1:PORT`; the in-memory event
//!   store (`NGIT_DATABASE_BACKEND=memory`, what ngit-grasp's own tests use); a relay-owner
//!   key per instance (`NGIT_RELAY_OWNER_NSEC`; its NIP-11 `pubkey` tells the instance from
//!   any other listener on the port); the working directory is the temp dir, so no `.env`
//!   of ours is read.
//! * Its own GRASP-02 sync cannot be switched off. It stays out of the tests' way because it
//!   gets no bootstrap relay (`NGIT_SYNC_BOOTSTRAP_RELAY_URL` unset) and
//!   `NGIT_SYNC_ALLOW_NON_GLOBAL_TARGETS` is unset, so it refuses every relay the
//!   announcements name (all are on loopback): whatever reaches it comes from the test or
//!   from grasp-sync. Sync+ and the user-index relays are off (`NGIT_SYNC_PLUS_ENABLED=false`,
//!   empty `NGIT_USER_INDEX_RELAYS` and `NGIT_SYNC_PLUS_FALLBACK_RELAYS`): nothing leaves
//!   the machine.
//! * It serves two events of its own from the start: the relay owner's kind 0 and 10002
//!   (the NIP-11 `pubkey`). The id sets compared here leave out that pubkey's events.
//! * A new announcement is answered `OK true "purgatory: won't be served until git data
//!   arrives"` and is not served; events about it are refused (`restricted: ... must
//!   reference an accepted repository or accepted event`). The tests take a repository out
//!   of purgatory the cheapest way its code allows: the maintainer's state event (30618)
//!   with no refs, which needs no git data (`find_repo_with_git_data` is true for no refs).
//! * Writes: 60 events per websocket connection, then one per whole second between two
//!   writes, refused ones included (`OK false "rate-limited: slow down"`), loopback
//!   included; not configurable. The tests publish at most 60 per connection.
//!
//! Every test compares the complete id sets, never counts.

mod common;

use std::collections::HashSet;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use grasp_sync::core::state::ConnectionStatus;
use grasp_sync::core::sync::Nip77Support;
use grasp_sync::testing::TestRelay;
use grasp_sync::{Config, RelayUrl, Status, SyncHandle};
use nostr::event::{Event, EventId};
use nostr::key::{Keys, PublicKey};
use nostr::nips::nip19::ToBech32;
use serde_json::Value;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::Message;

use common::*;

/// Where `.ci/run` installs ngit-grasp.
const NGIT_DEFAULT: &str = "/opt/ngit-grasp/bin/ngit-grasp";
/// Where `.ci/run` installs nostr-rs-relay.
const NRR_DEFAULT: &str = "/opt/nostr-rs-relay/bin/nostr-rs-relay";
/// Deadline of anything that should happen (generous: 2 cores shared with other builds).
const DEADLINE: Duration = Duration::from_secs(120);
/// How often a relay is read back while waiting.
const POLL: Duration = Duration::from_millis(500);
/// Self-subscription batch window of the engine under test.
const WINDOW: Duration = Duration::from_millis(200);
/// ngit-grasp's fixed write allowance per connection before the one-per-second rate.
const NGIT_BURST: usize = 60;

// ----- child processes -----

/// The binary, or `None` after printing why the test is skipped (outside CI).
fn binary_or_skip(test: &str, var: &str, default: &str, name: &str) -> Option<PathBuf> {
    match find_binary(var, default, name) {
        Ok(bin) => Some(bin),
        Err(why) => {
            let msg = format!("{name} not installed ({why}); .ci/run installs it");
            if in_ci() {
                panic!("{test}: {msg} (CI is set, so this test must not be skipped)");
            }
            eprintln!("{test}: skipping: {msg}");
            None
        }
    }
}

/// A relay run as a child process in its own temp dir; killed, and the dir removed, on drop
/// (the log is kept when the test fails).
struct Proc {
    name: &'static str,
    child: Child,
    port: u16,
    dir: PathBuf,
    /// The NIP-11 document it served when it became ready.
    nip11: Value,
}

impl Proc {
    /// Runs `spawn(port, dir, log)` on free ports until the relay serves a NIP-11 document
    /// that `is_ours` (another listener can take a port between the pick and the bind; then
    /// the relay exits and another port is tried).
    fn start(
        name: &'static str,
        is_ours: impl Fn(&Value) -> bool,
        mut spawn: impl FnMut(u16, &Path, File) -> io::Result<Child>,
    ) -> Proc {
        let dir = unique_temp_dir(name);
        let mut failures = Vec::new();
        for _ in 0..3 {
            let port = free_port();
            let log = File::create(dir.join("relay.log")).expect("create relay.log");
            let child = spawn(port, &dir, log).unwrap_or_else(|e| panic!("cannot run {name}: {e}"));
            let mut p = Proc {
                name,
                child,
                port,
                dir: dir.clone(),
                nip11: Value::Null,
            };
            match p.wait_ready(&is_ours) {
                Ok(took) => {
                    eprintln!(
                        "{name} {} ready on port {port} after {took:?}",
                        p.nip11["version"]
                    );
                    return p;
                }
                Err(why) => {
                    failures.push(format!("port {port}: {why}\n{}", p.log_tail(20)));
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                    // Dropping would remove the dir, which the next try reuses.
                    std::mem::forget(p);
                }
            }
        }
        let _ = fs::remove_dir_all(&dir);
        panic!("{name} did not start:\n{}", failures.join("\n"));
    }

    fn wait_ready(&mut self, is_ours: &impl Fn(&Value) -> bool) -> Result<Duration, String> {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Err(format!("exited with {status}"));
            }
            if let Ok(doc) = fetch_nip11(self.port) {
                if !is_ours(&doc) {
                    return Err(format!("port taken by something else: {doc}"));
                }
                self.nip11 = doc;
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > Duration::from_secs(60) {
                return Err("not ready within 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self) -> String {
        format!("ws://127.0.0.1:{}", self.port)
    }

    fn relay_url(&self) -> RelayUrl {
        RelayUrl::parse(&self.url()).unwrap()
    }

    /// The last `lines` lines of the log, without ANSI colours.
    fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.dir.join("relay.log"), lines)
    }

    /// Whether a line of the log contains `needle`.
    fn log_contains(&self, needle: &str) -> bool {
        fs::read_to_string(self.dir.join("relay.log"))
            .unwrap_or_default()
            .lines()
            .any(|l| l.contains(needle))
    }

    fn connect(&self) -> Ws {
        let (ws, _) = tungstenite::connect(self.url())
            .unwrap_or_else(|e| panic!("websocket connect to {}: {e}", self.name));
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_millis(250)))
                .unwrap();
        }
        ws
    }

    /// Publishes `events`, a new connection for every `per_connection` of them, at most 50
    /// unanswered at a time; returns each event's `OK` (accepted, message) in order.
    fn publish(&self, events: &[Event], per_connection: usize) -> Vec<(bool, String)> {
        let mut answers = Vec::with_capacity(events.len());
        for conn_events in events.chunks(per_connection) {
            let mut ws = self.connect();
            for chunk in conn_events.chunks(50) {
                let mut waiting: Vec<Option<(bool, String)>> = vec![None; chunk.len()];
                for e in chunk {
                    ws.send(Message::text(format!(r#"["EVENT",{}]"#, e.as_json())))
                        .expect("send EVENT");
                }
                let end = Instant::now() + DEADLINE;
                while waiting.iter().any(Option::is_none) {
                    let Some(msg) = read_json(&mut ws, end) else {
                        panic!("{}: no OK within {DEADLINE:?}", self.name);
                    };
                    if msg[0] != "OK" {
                        continue;
                    }
                    let id = msg[1].as_str().unwrap_or_default();
                    if let Some(i) = chunk.iter().position(|e| e.id.to_hex() == id) {
                        waiting[i] = Some((
                            msg[2] == Value::Bool(true),
                            msg[3].as_str().unwrap_or_default().to_string(),
                        ));
                    }
                }
                answers.extend(waiting.into_iter().flatten());
            }
            let _ = ws.close(None);
            let _ = ws.flush();
        }
        answers
    }

    /// The events matching `filter` (a JSON object), read until EOSE; `None` without EOSE
    /// within 10 s.
    fn query(&self, filter: &str) -> Option<Vec<Event>> {
        let mut ws = self.connect();
        ws.send(Message::text(format!(r#"["REQ","q",{filter}]"#)))
            .expect("send REQ");
        let end = Instant::now() + Duration::from_secs(10);
        let mut events = Vec::new();
        let done = loop {
            let Some(msg) = read_json(&mut ws, end) else {
                break false;
            };
            match msg[0].as_str() {
                Some("EVENT") => {
                    let e = Event::from_json(msg[2].to_string()).expect("an event");
                    events.push(e);
                }
                Some("EOSE") => break true,
                _ => eprintln!("{} during a query: {msg}", self.name),
            }
        };
        let _ = ws.close(None);
        let _ = ws.flush();
        done.then_some(events)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let kept = std::env::temp_dir().join(format!("{}-{}-failed.log", self.name, self.port));
            let _ = fs::copy(self.dir.join("relay.log"), &kept);
            eprintln!(
                "--- last lines of {}'s log (port {}; whole log kept in {}) ---\n{}",
                self.name,
                self.port,
                kept.display(),
                self.log_tail(40)
            );
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

// ----- ngit-grasp -----

/// A running ngit-grasp.
struct NgitGrasp {
    proc: Proc,
    /// The relay owner (NIP-11 `pubkey`), author of its own kind 0 and 10002.
    owner: PublicKey,
}

impl NgitGrasp {
    fn start_or_skip(test: &str) -> Option<NgitGrasp> {
        let bin = binary_or_skip(test, "NGIT_GRASP", NGIT_DEFAULT, "ngit-grasp")?;
        Some(NgitGrasp::start(&bin))
    }

    fn start(bin: &Path) -> NgitGrasp {
        // Its relay-owner key, set here so that its NIP-11 `pubkey` tells this instance from
        // any other listener on the port.
        let keys = Keys::generate();
        let nsec = keys.secret_key().to_bech32().expect("nsec");
        let owner = keys.public_key();
        let is_ours = |doc: &Value| {
            doc["software"]
                .as_str()
                .is_some_and(|s| s.contains("ngit-grasp"))
                && doc["pubkey"].as_str() == Some(owner.to_hex().as_str())
        };
        let proc = Proc::start("ngit-grasp", is_ours, |port, dir, log| {
            let addr = format!("127.0.0.1:{port}");
            let mut cmd = Command::new(bin);
            // Nothing of the caller's configuration leaks in (a bootstrap relay, the
            // non-global target switch, ...).
            for (k, _) in std::env::vars_os() {
                if k.to_string_lossy().starts_with("NGIT_") {
                    cmd.env_remove(k);
                }
            }
            for sub in ["git", "relay"] {
                fs::create_dir_all(dir.join(sub))?;
            }
            cmd.arg("serve")
                .current_dir(dir)
                .env("NGIT_DOMAIN", &addr)
                .env("NGIT_BIND_ADDRESS", &addr)
                .env("NGIT_GIT_DATA_PATH", dir.join("git"))
                .env("NGIT_RELAY_DATA_PATH", dir.join("relay"))
                .env("NGIT_DATABASE_BACKEND", "memory")
                .env("NGIT_RELAY_OWNER_NSEC", &nsec)
                // Its own sync: no bootstrap relay, loopback targets refused (the
                // default), no Sync+, no user-index relays.
                .env("NGIT_SYNC_PLUS_ENABLED", "false")
                .env("NGIT_SYNC_PLUS_FALLBACK_RELAYS", "")
                .env("NGIT_USER_INDEX_RELAYS", "")
                .env(
                    "NGIT_LOG_LEVEL",
                    std::env::var("NGIT_GRASP_LOG").unwrap_or_else(|_| "info".into()),
                )
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
        });
        if proc.nip11["version"] != "3.0.10" {
            eprintln!(
                "warning: these tests were written against ngit-grasp 3.0.10, this is {}",
                proc.nip11["version"]
            );
        }
        NgitGrasp { proc, owner }
    }

    fn url(&self) -> String {
        self.proc.url()
    }

    fn relay_url(&self) -> RelayUrl {
        self.proc.relay_url()
    }

    /// `127.0.0.1:PORT`, its `NGIT_DOMAIN`.
    fn domain(&self) -> String {
        format!("127.0.0.1:{}", self.proc.port)
    }

    /// A repository announcement ngit-grasp accepts: its domain in `clone` and its URL in
    /// `relays`, with `other_relays` after it in the same tag.
    fn announcement(&self, keys: &Keys, d: &str, other_relays: &[&str]) -> Event {
        let npub = keys.public_key().to_bech32().expect("npub");
        let clone = format!("http://{}/{npub}/{d}.git", self.domain());
        let url = self.url();
        let mut relays = vec!["relays", url.as_str()];
        relays.extend_from_slice(other_relays);
        event(
            keys,
            30617,
            "",
            &[
                &["d", d],
                &["name", d],
                &["description", "a repository hosted on ngit-grasp"],
                &["clone", &clone],
                &relays,
            ],
        )
    }

    /// Publishes `events` (at most [`NGIT_BURST`] per connection, under its write limit) and
    /// checks each answer: `OK true`, with `purgatory:` only for announcements.
    fn publish(&self, events: &[Event]) {
        let answers = self.proc.publish(events, NGIT_BURST);
        let mut wrong = Vec::new();
        for (e, (ok, msg)) in events.iter().zip(&answers) {
            let purgatory = msg.starts_with("purgatory:");
            if !ok || (purgatory && e.kind.as_u16() != 30617) {
                wrong.push(format!("kind {} {}: {ok} {msg:?}", e.kind.as_u16(), e.id));
            }
        }
        assert!(wrong.is_empty(), "ngit-grasp refused: {wrong:#?}");
    }

    /// Takes the repository `d` of `keys` out of purgatory with the maintainer's state
    /// event without refs (what ngit-grasp accepts without git data), and waits until the
    /// announcement is served. Returns the state event.
    fn promote(&self, keys: &Keys, d: &str) -> Event {
        let state = empty_state(keys, d);
        self.publish(std::slice::from_ref(&state));
        let filter = format!(
            r##"{{"kinds":[30617],"authors":["{}"],"#d":["{d}"]}}"##,
            keys.public_key().to_hex()
        );
        let served = poll_until(Duration::from_secs(30), || {
            self.proc.query(&filter).is_some_and(|v| !v.is_empty())
        });
        assert!(
            served,
            "announcement {d} still not served after its empty state event"
        );
        state
    }

    /// Every event id it serves (`REQ {}` until EOSE), leaving out the relay owner's own.
    fn event_ids(&self) -> HashSet<EventId> {
        for attempt in 1..=3 {
            if let Some(events) = self.proc.query("{}") {
                assert!(
                    events.len() < 500,
                    "ngit-grasp caps a filter at 500 events: the dump may be short"
                );
                return events
                    .iter()
                    .filter(|e| e.pubkey != self.owner)
                    .map(|e| e.id)
                    .collect();
            }
            eprintln!("ngit-grasp: no EOSE for dump {attempt} within 10 s; asking again");
        }
        panic!("ngit-grasp never answered a dump REQ with EOSE");
    }
}

/// A state event (30618) with no refs: only `d`.
fn empty_state(keys: &Keys, d: &str) -> Event {
    event(keys, 30618, "", &[&["d", d]])
}

/// A legacy kind-1 reply tagging only its parent (`e` with the `reply` marker).
fn legacy_reply(keys: &Keys, parent: &Event, text: &str) -> Event {
    event(
        keys,
        1,
        text,
        &[
            &["e", &parent.id.to_hex(), "", "reply"],
            &["p", &parent.pubkey.to_hex()],
        ],
    )
}

/// A NIP-22 reply to `parent` in the thread of `root` (`E`/`K` root, `e`/`k` parent).
fn nip22_reply(keys: &Keys, root: &Event, parent: &Event, text: &str) -> Event {
    let (rid, pid) = (root.id.to_hex(), parent.id.to_hex());
    let (rk, pk) = (
        root.kind.as_u16().to_string(),
        parent.kind.as_u16().to_string(),
    );
    event(
        keys,
        1111,
        text,
        &[&["E", &rid], &["K", &rk], &["e", &pid], &["k", &pk]],
    )
}

// ----- nostr-rs-relay -----

fn start_nrr_or_skip(test: &str) -> Option<Proc> {
    let bin = binary_or_skip(test, "NOSTR_RS_RELAY", NRR_DEFAULT, "nostr-rs-relay")?;
    Some(Proc::start(
        "nostr-rs-relay",
        |doc| {
            doc["software"]
                .as_str()
                .is_some_and(|s| s.contains("nostr-rs-relay"))
        },
        |port, dir, log| {
            let config = dir.join("config.toml");
            fs::write(
            &config,
            format!(
                "[info]\nrelay_url = \"ws://127.0.0.1:{port}/\"\nname = \"grasp-sync ngit interop\"\n\
                 [database]\nengine = \"sqlite\"\ndata_directory = {dir:?}\nin_memory = false\n\
                 [network]\naddress = \"127.0.0.1\"\nport = {port}\n",
                dir = dir.display().to_string(),
            ),
        )?;
            Command::new(&bin)
                .arg("--config")
                .arg(&config)
                .arg("--db")
                .arg(dir)
                .env("RUST_LOG", "info")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
        },
    ))
}

/// Stores `events` on nostr-rs-relay; every one must be accepted.
fn nrr_publish(nrr: &Proc, events: &[Event]) {
    let refused: Vec<String> = events
        .iter()
        .zip(nrr.publish(events, usize::MAX))
        .filter(|(_, (ok, _))| !ok)
        .map(|(e, (_, msg))| format!("{}: {msg}", e.id))
        .collect();
    assert!(refused.is_empty(), "nostr-rs-relay refused: {refused:?}");
}

// ----- waiting -----

/// Polls `cond` every [`POLL`] until it holds or `deadline` passes.
fn poll_until(deadline: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// The engine under test, on `own`, reading loopback relays.
fn engine(own: RelayUrl) -> SyncHandle {
    let config = Config::new(own)
        .allow_private_relays(true)
        .batch_window(WINDOW);
    grasp_sync::start(config).expect("start engine")
}

/// Waits until `actual()` is the expected set and the engine is settled; panics with the
/// difference by name otherwise. Returns the time it took and the last status.
fn converge(
    what: &str,
    handle: &SyncHandle,
    book: &Book,
    mut actual: impl FnMut() -> HashSet<EventId>,
) -> (Duration, Status) {
    let t0 = Instant::now();
    let mut last = HashSet::new();
    let ok = poll_until(DEADLINE * 2, || {
        last = actual();
        last == book.expected && handle.status().is_settled()
    });
    let status = handle.status();
    assert!(
        ok,
        "{what}: no convergence within {:?}\n{}\n{status:#?}",
        DEADLINE * 2,
        book.diff(&last)
    );
    (t0.elapsed(), status)
}

fn stop(handle: SyncHandle) {
    let r = handle.shutdown(Duration::from_secs(10));
    assert!(r.is_ok(), "shutdown failed: {r:?}");
}

/// The own relay's rejections by reason, those that happened.
fn rejections(st: &Status) -> Vec<(&'static str, u64)> {
    st.rejected_by_reason
        .iter()
        .copied()
        .filter(|(_, n)| *n > 0)
        .collect()
}

// ----- the tests -----

/// The value of the first sample of `name` (with its labels, if any) in Prometheus text.
fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The events of one repository hosted on ngit-grasp and discussed everywhere: an issue
/// with a NIP-22 comment, a legacy reply (`e` to the issue), a closing status and a NIP-22
/// thread 4 deep (each reply tags the issue as `E` and its parent as `e`); a patch with a
/// comment and an "applied" status; a NIP-22 comment on the repository (`A`) and a quote of
/// it (`q`). In the order ngit-grasp needs them (what an event refers to first).
fn discussion(repo: &str, owner: &Keys, other: &Keys, tag: &str) -> Vec<(String, Event)> {
    let mut out: Vec<(String, Event)> = Vec::new();
    let issue = root(other, 1621, repo, &format!("{tag}: an issue"), &[]);
    let patch = root(
        other,
        1617,
        repo,
        &format!("From: other\nSubject: [PATCH] {tag}: a fix\n"),
        &[],
    );
    out.push((format!("{tag} issue"), issue.clone()));
    out.push((format!("{tag} patch"), patch.clone()));
    out.push((
        format!("{tag} issue comment"),
        comment(owner, &issue, "thanks"),
    ));
    out.push((
        format!("{tag} issue legacy reply"),
        event(owner, 1, "+1", &[&["e", &issue.id.to_hex(), "", "root"]]),
    ));
    out.push((
        format!("{tag} issue closed"),
        status(owner, 1632, &issue.id),
    ));
    let mut parent = issue.clone();
    for depth in 1..=4 {
        let reply = nip22_reply(
            if depth % 2 == 0 { owner } else { other },
            &issue,
            &parent,
            &format!("{tag}: NIP-22 reply {depth} deep"),
        );
        out.push((format!("{tag} NIP-22 reply depth {depth}"), reply.clone()));
        parent = reply;
    }
    out.push((
        format!("{tag} patch comment"),
        comment(owner, &patch, "looks good"),
    ));
    out.push((
        format!("{tag} patch applied"),
        status(owner, 1631, &patch.id),
    ));
    out.push((
        format!("{tag} repo comment"),
        repo_comment(other, repo, "nice project"),
    ));
    out.push((format!("{tag} repo quote"), quote(other, repo, "see this")));
    out
}

/// ngit-grasp as a REMOTE relay: two repositories hosted on it (announced, out of
/// purgatory through their maintainers' state events without refs), with their whole
/// discussion ([`discussion`]) and more issues. The own relay (a `TestRelay`) holds the
/// announcements and part of the history, so the engine has something to reconcile:
/// ngit-grasp lists NIP-77 in its NIP-11 document and the engine reads its history by
/// reconciliation. The own relay must end with exactly every event ngit-grasp serves (but
/// the relay owner's kind 0 and 10002, unrelated), the relay's NIP-77 must have worked
/// (status, metrics) and nothing fell back to paged REQs.
#[test]
fn ngit_grasp_as_a_remote_relay_is_reconciled_by_nip77() {
    let test = "ngit_grasp_as_a_remote_relay_is_reconciled_by_nip77";
    init_logging();
    let Some(ngit) = NgitGrasp::start_or_skip(test) else {
        return;
    };
    let nips = &ngit.proc.nip11["supported_nips"];
    assert!(
        nips.as_array()
            .is_some_and(|a| a.contains(&Value::from(77))),
        "ngit-grasp's NIP-11 lists NIP-77: {}",
        ngit.proc.nip11
    );
    let own = TestRelay::start();
    let [alice, bob, carol] = std::array::from_fn(|_| Keys::generate());
    let mut book = Book::default();
    let mut missing_on_own = 0;
    for (keys, d) in [(&alice, "alpha"), (&bob, "beta")] {
        let ann = ngit.announcement(keys, d, &[]);
        ngit.publish(std::slice::from_ref(&ann));
        let state = ngit.promote(keys, d);
        book.expect(&format!("{d} announcement (own)"), &ann, &[&own]);
        book.expect(&format!("{d} state"), &state, &[]);
        missing_on_own += 1;
        let repo = repo_ref(keys, d);
        let mut events = discussion(&repo, keys, &carol, d);
        for i in 0..10 {
            let issue = root(&carol, 1621, &repo, &format!("{d}: issue {i}"), &[]);
            let reply = comment(keys, &issue, &format!("{d}: reply to issue {i}"));
            events.push((format!("{d} issue {i}"), issue));
            events.push((format!("{d} issue {i} reply"), reply));
        }
        let plain: Vec<Event> = events.iter().map(|(_, e)| e.clone()).collect();
        ngit.publish(&plain);
        // The own relay holds every other event already (the first and the extra issues
        // with their replies alike).
        for (k, (name, e)) in events.iter().enumerate() {
            if k % 2 == 0 {
                book.expect(&format!("{name} (own)"), e, &[&own]);
            } else {
                book.expect(name, e, &[]);
                missing_on_own += 1;
            }
        }
    }
    assert_eq!(
        ngit.event_ids(),
        book.expected,
        "ngit-grasp serves the whole seed"
    );
    let handle = engine(url(&own));
    let (took, st) = converge(test, &handle, &book, || own.event_ids());
    let r = st.relay(&ngit.relay_url()).expect("ngit-grasp in status");
    eprintln!(
        "{test}: converged in {took:?}; {missing_on_own} events were missing; sync counters {:?}; relay {r:#?}",
        st.sync
    );
    assert_eq!(r.connection_status, ConnectionStatus::Connected, "{r:#?}");
    // Advertised in NIP-11 and used: the state stays `Advertised` (`Works` is what a
    // relay that did not advertise it becomes once a reconciliation completed).
    assert_eq!(r.nip77, Nip77Support::Advertised, "{r:#?}");
    assert_eq!((r.events_invalid, r.events_unmatched), (0, 0), "{r:#?}");
    // It ends every REQ by ids with `CLOSED` after EOSE (rust-nostr's relay does): none of
    // those is a refusal or a rate limit.
    let s = &st.sync;
    assert_eq!((s.closed_refused, s.closed_rate_limited), (0, 0), "{s:?}");
    assert_eq!(other_notices(r), 0, "{r:#?}");
    // Every history query the own relay held something for was reconciled, and the ids
    // it lacked were fetched by id: all that was missing, counted once (the queries the
    // own relay held nothing for were sent as one REQ instead).
    assert!(s.reconciliations > 0, "{s:?}");
    assert!(s.reconcile_ids_fetched > 0, "{s:?}");
    assert_eq!(
        st.sync.reconcile_fallbacks.iter().sum::<u64>(),
        0,
        "a reconciliation fell back to REQs: {:?}",
        st.sync
    );
    assert_eq!(st.rejected, 0, "{st:#?}");
    // The same, as an operator reads it from /metrics.
    let text = grasp_sync::ops::render::prometheus(&st);
    let nip77 = format!("grasp_sync_relay_nip77{{relay=\"{}\"}}", r.url.as_str());
    assert_eq!(metric(&text, &nip77), Some(1), "{nip77} in\n{text}");
    let runs = metric(&text, "grasp_sync_reconciliations_total");
    assert!(
        runs.is_some_and(|n| n > 0),
        "reconciliations_total {runs:?}"
    );
    stop(handle);
}

/// ngit-grasp as the OWN relay, a `TestRelay` as the remote relay. Two repositories hosted
/// on ngit-grasp (out of purgatory) list both relays; their discussion ([`discussion`]) is
/// only on the remote relay, with noise: a note, an issue of a repository nobody announced,
/// a reply to an unknown event, and an announcement (with an issue) of a repository that
/// does not list ngit-grasp, which `--public-url` keeps out. ngit-grasp must end with
/// exactly the related events: its own announcements and states, and everything the
/// engine forwarded, with nothing refused.
#[test]
fn ngit_grasp_as_the_own_relay_gets_every_related_event() {
    let test = "ngit_grasp_as_the_own_relay_gets_every_related_event";
    init_logging();
    let Some(ngit) = NgitGrasp::start_or_skip(test) else {
        return;
    };
    let remote = TestRelay::start();
    let ur = remote.url();
    let [alice, bob, carol, eve] = std::array::from_fn(|_| Keys::generate());
    let mut book = Book::default();
    for (keys, d) in [(&alice, "alpha"), (&bob, "beta")] {
        // The maintainer publishes the announcement and the state to both relays.
        let ann = ngit.announcement(keys, d, &[&ur]);
        ngit.publish(std::slice::from_ref(&ann));
        let state = ngit.promote(keys, d);
        book.expect(
            &format!("{d} announcement (ngit, remote)"),
            &ann,
            &[&remote],
        );
        book.expect(&format!("{d} state (ngit, remote)"), &state, &[&remote]);
        for (name, e) in discussion(&repo_ref(keys, d), keys, &carol, d) {
            book.expect(&format!("{name} (remote)"), &e, &[&remote]);
        }
    }
    // Noise on the remote relay.
    book.noise("note (remote)", &note(&eve, "gm"), &[&remote]);
    let ghost = repo_ref(&eve, "ghost");
    book.noise(
        "issue of an unannounced repository (remote)",
        &root(&eve, 1621, &ghost, "ghost", &[]),
        &[&remote],
    );
    let unknown = note(&eve, "never published").id;
    book.noise(
        "reply to an unknown event (remote)",
        &comment_on_id(&eve, &unknown, "?"),
        &[&remote],
    );
    let elsewhere = announcement(&eve, "elsewhere", &[&[&ur]]);
    book.noise(
        "announcement not listing ngit-grasp (remote)",
        &elsewhere,
        &[&remote],
    );
    book.noise(
        "state of that repository (remote)",
        &repo_state(&eve, "elsewhere"),
        &[&remote],
    );
    book.noise(
        "issue of that repository (remote)",
        &root(&eve, 1621, &repo_ref(&eve, "elsewhere"), "elsewhere", &[]),
        &[&remote],
    );
    let seeded = ngit.event_ids();
    assert_eq!(
        seeded.len(),
        4,
        "ngit-grasp holds the announcements and states"
    );

    // As an operator would run it beside ngit-grasp: its public URL (here the same as the
    // own relay's) scopes the sync to the repositories it hosts.
    let config = Config::new(ngit.relay_url())
        .public_url(ngit.relay_url())
        .allow_private_relays(true)
        .batch_window(WINDOW);
    let handle = grasp_sync::start(config).expect("start engine");
    let (took, st) = converge(test, &handle, &book, || ngit.event_ids());
    eprintln!(
        "{test}: converged in {took:?} to {} events; forwarded {}, duplicates {}, rejected {:?}",
        book.expected.len(),
        st.forwarded,
        st.duplicates,
        rejections(&st)
    );
    assert_eq!(st.own_relay, ConnectionStatus::Connected, "{st:#?}");
    let r = st.relay(&url(&remote)).expect("the remote relay in status");
    assert_eq!((r.events_invalid, r.events_unmatched), (0, 0), "{r:#?}");
    // The engine forwards every announcement and state event its Layer-1 subscription
    // reads, in scope or not; ngit-grasp refuses the two of the repository that does not
    // list it (`invalid: Announcement must list service ...`, `invalid: no announcement
    // exists for this repository`). Nothing else is refused: no event related to a hosted
    // repository was ever sent before what it refers to was stored.
    let refused = rejections(&st);
    assert!(
        st.rejected <= 2 && refused.iter().all(|(why, _)| *why == "invalid"),
        "ngit-grasp refused: {refused:?}\n{st:#?}"
    );
    // Every event new to ngit-grasp was stored. ngit-grasp answers a write it stores
    // `OK true "duplicate: event stored"`, so the engine counts them as duplicates.
    let new = (book.expected.len() - seeded.len()) as u64;
    assert!(
        st.forwarded + st.duplicates >= new,
        "{} stored + {} duplicates < {new}",
        st.forwarded,
        st.duplicates
    );
    stop(handle);
}

/// ngit-grasp as the own relay with more to store than its write allowance: one repository
/// hosted on it, and on nostr-rs-relay (the remote relay) 40 issues with a comment each
/// and a status for every other: 100 events, more than the 60 ngit-grasp takes on
/// one connection before it allows one a second (`OK false "rate-limited: ..."`, loopback
/// included, not configurable). The forwarder paces itself to that rate and ngit-grasp
/// ends with exactly the related events, nothing refused but for the rate (a refused write
/// also uses up a second of the allowance, so a forwarder that did not slow down would
/// never get through). Needs both binaries.
#[test]
fn ngit_grasp_as_a_rate_limited_own_relay_with_nostr_rs_relay_as_remote() {
    let test = "ngit_grasp_as_a_rate_limited_own_relay_with_nostr_rs_relay_as_remote";
    init_logging();
    let Some(ngit) = NgitGrasp::start_or_skip(test) else {
        return;
    };
    let Some(nrr) = start_nrr_or_skip(test) else {
        return;
    };
    let [alice, carol] = std::array::from_fn(|_| Keys::generate());
    let mut book = Book::default();
    let ann = ngit.announcement(&alice, "busy", &[&nrr.url()]);
    ngit.publish(std::slice::from_ref(&ann));
    let state = ngit.promote(&alice, "busy");
    let mut on_nrr = vec![ann.clone(), state.clone()];
    book.expect("announcement (ngit, nrr)", &ann, &[]);
    book.expect("state (ngit, nrr)", &state, &[]);
    let repo = repo_ref(&alice, "busy");
    for i in 0..40 {
        let issue = root(&carol, 1621, &repo, &format!("issue {i}"), &[]);
        let reply = comment(&alice, &issue, &format!("reply to issue {i}"));
        book.expect(&format!("issue {i} (nrr)"), &issue, &[]);
        book.expect(&format!("issue {i} reply (nrr)"), &reply, &[]);
        on_nrr.push(issue.clone());
        on_nrr.push(reply);
        if i % 2 == 0 {
            let closed = status(&alice, 1632, &issue.id);
            book.expect(&format!("issue {i} closed (nrr)"), &closed, &[]);
            on_nrr.push(closed);
        }
    }
    let noise = note(&carol, "unrelated");
    book.noise("note (nrr)", &noise, &[]);
    on_nrr.push(noise);
    nrr_publish(&nrr, &on_nrr);
    let new = book.expected.len() - 2;
    assert!(new > NGIT_BURST + 30, "{new} events to store");

    let config = Config::new(ngit.relay_url())
        .public_url(ngit.relay_url())
        .allow_private_relays(true)
        .batch_window(WINDOW);
    let handle = grasp_sync::start(config).expect("start engine");
    let (took, st) = converge(test, &handle, &book, || ngit.event_ids());
    eprintln!(
        "{test}: {new} events stored in {took:?} (at least {} s at ngit-grasp's rate); \
         rate-limited answers {}, resent {}, pace now {} ms, rejected {:?}",
        new - NGIT_BURST,
        st.forward_rate_limited,
        st.forward_resent,
        st.forward_pace_ms,
        rejections(&st)
    );
    assert!(st.forward_rate_limited > 0, "never rate-limited: {st:#?}");
    assert_eq!(st.rejected, 0, "{:?}\n{st:#?}", rejections(&st));
    let r = st
        .relay(&nrr.relay_url())
        .expect("nostr-rs-relay in status");
    assert_eq!((r.events_invalid, r.events_unmatched), (0, 0), "{r:#?}");
    stop(handle);
}

/// A chain of replies 4 deep below an issue, each reply tagging only its parent (legacy
/// NIP-10 `e` with the `reply` marker; the first tags the issue), on ngit-grasp as the
/// remote relay (it stores each one because its parent is stored). The own relay holds the
/// announcement. Every reply must reach the own relay: the first tags a root event, the
/// others are found only by following the chain down, as ngit-grasp's own sync does (up
/// to 8 generations).
///
/// Before reply chains were followed (decision 0097) the own relay ended without exactly
/// the replies 2, 3 and 4 deep.
#[test]
fn ngit_grasp_remote_reply_chain_four_deep_below_an_issue() {
    let test = "ngit_grasp_remote_reply_chain_four_deep_below_an_issue";
    init_logging();
    let Some(ngit) = NgitGrasp::start_or_skip(test) else {
        return;
    };
    let own = TestRelay::start();
    let [alice, carol] = std::array::from_fn(|_| Keys::generate());
    let mut book = Book::default();
    let ann = ngit.announcement(&alice, "deep", &[]);
    ngit.publish(std::slice::from_ref(&ann));
    let state = ngit.promote(&alice, "deep");
    book.expect("announcement (own, ngit)", &ann, &[&own]);
    book.expect("state (ngit)", &state, &[]);
    let issue = root(&carol, 1621, &repo_ref(&alice, "deep"), "an issue", &[]);
    book.expect("issue (ngit)", &issue, &[]);
    let mut chain = vec![issue.clone()];
    let first = event(
        &alice,
        1,
        "reply 1 deep",
        &[&["e", &issue.id.to_hex(), "", "root"]],
    );
    book.expect("reply 1 deep, tagging the issue (ngit)", &first, &[]);
    chain.push(first.clone());
    let mut parent = first;
    for depth in 2..=4 {
        let keys = if depth % 2 == 0 { &carol } else { &alice };
        let reply = legacy_reply(keys, &parent, &format!("reply {depth} deep"));
        book.expect(
            &format!("reply {depth} deep, tagging only its parent (ngit)"),
            &reply,
            &[],
        );
        chain.push(reply.clone());
        parent = reply;
    }
    ngit.publish(&chain);
    assert_eq!(
        ngit.event_ids(),
        book.expected,
        "ngit-grasp holds the chain"
    );
    let handle = engine(url(&own));
    let (took, _) = converge(test, &handle, &book, || own.event_ids());
    eprintln!("{test}: the chain reached the own relay in {took:?}");
    stop(handle);
}

/// An announcement the engine forwards into ngit-grasp (own relay) is held in purgatory:
/// `OK true "purgatory: ..."` (counted as stored) and not served. The engine learns
/// repositories from what the own relay serves, so it offers nothing about that repository
/// (ngit-grasp would refuse it: `restricted: ... must reference an accepted repository or
/// accepted event`), and grasp-sync fetches no git data. Once the maintainer's state event
/// takes the repository out of purgatory (as git data arriving would), ngit-grasp serves
/// the announcement to the self-subscription and the engine syncs that repository's events.
///
/// Set up: `alpha` is hosted on ngit-grasp and lists the remote relay too; on the remote
/// relay `gamma`, a repository listing both relays that ngit-grasp has never seen, with an
/// issue and a comment.
#[test]
fn ngit_grasp_own_relay_holds_a_forwarded_announcement_in_purgatory() {
    let test = "ngit_grasp_own_relay_holds_a_forwarded_announcement_in_purgatory";
    init_logging();
    let Some(ngit) = NgitGrasp::start_or_skip(test) else {
        return;
    };
    let remote = TestRelay::start();
    let ur = remote.url();
    let [alice, bob, carol] = std::array::from_fn(|_| Keys::generate());
    let mut book = Book::default();
    let alpha = ngit.announcement(&alice, "alpha", &[&ur]);
    ngit.publish(std::slice::from_ref(&alpha));
    let alpha_state = ngit.promote(&alice, "alpha");
    book.expect("alpha announcement (ngit, remote)", &alpha, &[&remote]);
    book.expect("alpha state (ngit)", &alpha_state, &[]);
    let alpha_issue = root(&carol, 1621, &repo_ref(&alice, "alpha"), "alpha issue", &[]);
    book.expect("alpha issue (remote)", &alpha_issue, &[&remote]);
    let gamma = ngit.announcement(&bob, "gamma", &[&ur]);
    remote.insert(&gamma);
    let gamma_issue = root(&carol, 1621, &repo_ref(&bob, "gamma"), "gamma issue", &[]);
    remote.insert(&gamma_issue);
    let gamma_reply = comment(&bob, &gamma_issue, "gamma reply");
    remote.insert(&gamma_reply);

    let config = Config::new(ngit.relay_url())
        .public_url(ngit.relay_url())
        .allow_private_relays(true)
        .batch_window(WINDOW);
    let handle = grasp_sync::start(config).expect("start engine");
    // The engine's Layer-1 subscription on the remote relay reads gamma's announcement and
    // forwards it: ngit-grasp puts it in purgatory.
    assert!(
        poll_until(DEADLINE, || ngit
            .proc
            .log_contains("Added announcement to purgatory identifier=gamma")),
        "gamma's announcement never reached ngit-grasp\n{:#?}",
        handle.status()
    );
    let (took, st) = converge(test, &handle, &book, || ngit.event_ids());
    eprintln!(
        "{test}: alpha complete in {took:?}, gamma in purgatory; forwarded {}, duplicates {}, \
         rejections {:?}",
        st.forwarded,
        st.duplicates,
        rejections(&st)
    );
    // Its `OK true "purgatory: ..."` is taken and counted apart (decision 0101), never
    // written again.
    assert!(st.forward_purgatory >= 1, "{st:#?}");
    assert_eq!(
        (st.repos, st.root_events),
        (1, 1),
        "only alpha is known: {st:#?}"
    );
    assert_eq!(
        st.rejected,
        0,
        "nothing of gamma offered: {:?}",
        rejections(&st)
    );

    // The maintainer takes gamma out of purgatory (on ngit-grasp directly).
    let gamma_state = ngit.promote(&bob, "gamma");
    book.expect("gamma announcement (remote, forwarded)", &gamma, &[]);
    book.expect("gamma state (ngit)", &gamma_state, &[]);
    book.expect("gamma issue (remote)", &gamma_issue, &[]);
    book.expect("gamma reply (remote)", &gamma_reply, &[]);
    let (took, st) = converge(test, &handle, &book, || ngit.event_ids());
    eprintln!("{test}: gamma's events stored {took:?} after it left purgatory");
    assert_eq!((st.repos, st.root_events), (2, 2), "{st:#?}");
    assert_eq!(st.rejected, 0, "{:?}", rejections(&st));
    stop(handle);
}
