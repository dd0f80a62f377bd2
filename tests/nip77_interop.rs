//! NIP-77 (negentropy) against a real third-party relay: rust-nostr's `LocalRelay`
//! (nostr-relay-builder 0.45.0-alpha.3), built as the test-only helper binary
//! `tests/nip77-relay` and started as a child process on 127.0.0.1. A raw client (the
//! `negentropy` crate as the initiator) reconciles against it, the same client that
//! `tests/nip77_server.rs` runs against `TestRelay`, so the two servers are held to the same
//! answers.
//!
//! The binary is `$NIP77_RELAY` (`.ci/run` builds it and sets it). When it is unset the tests
//! print "skipping" and pass, except under CI (`CI` set), where they fail. Build it with
//! `cd tests/nip77-relay && cargo build --release --locked`, then
//! `NIP77_RELAY=tests/nip77-relay/target/release/nip77-relay cargo test --all-features --test nip77_interop`.
//!
//! The last test runs the engine itself against it: `LocalRelay` serves no NIP-11 document,
//! so the engine reconciles with it only with `--nip77-probe` (tried once, then remembered).

mod common;
mod negentropy_client;

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;

use negentropy_client::{issues, missing_share, records, repo_filter, Client, WAIT};
use nostr::event::{Event, EventId};

const BUILD: &str = "cd tests/nip77-relay && cargo build --release --locked, then set \
                     NIP77_RELAY=tests/nip77-relay/target/release/nip77-relay";

fn in_ci() -> bool {
    std::env::var("CI")
        .map(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
        .unwrap_or(false)
}

/// A running `nip77-relay`; its stdin is closed and the process killed on drop.
struct LocalRelay {
    child: Child,
    stdin: Option<ChildStdin>,
    url: String,
}

impl LocalRelay {
    /// Starts the relay for `test`, or returns `None` after printing why when `NIP77_RELAY` is
    /// unset outside CI; panics when it is unset under CI or the binary does not start.
    fn start_or_skip(test: &str) -> Option<LocalRelay> {
        LocalRelay::start_limited(test, None)
    }

    /// [`LocalRelay::start_or_skip`] with rust-nostr's write rate limit set to
    /// `notes_per_minute` per connection (`None`: lifted).
    fn start_limited(test: &str, notes_per_minute: Option<u32>) -> Option<LocalRelay> {
        let bin = match std::env::var_os("NIP77_RELAY").filter(|v| !v.is_empty()) {
            Some(bin) => PathBuf::from(bin),
            None => {
                let msg = format!("NIP77_RELAY is not set; build the helper: {BUILD}");
                if in_ci() {
                    panic!("{test}: {msg} (CI is set, so this test must not be skipped)");
                }
                eprintln!("{test}: skipping: {msg}");
                return None;
            }
        };
        assert!(
            bin.is_file(),
            "{test}: NIP77_RELAY={} does not exist; {BUILD}",
            bin.display()
        );
        let mut cmd = Command::new(&bin);
        if let Some(n) = notes_per_minute {
            cmd.env("NIP77_RELAY_NOTES_PER_MINUTE", n.to_string());
        }
        let mut child = cmd
            .arg("0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{test}: cannot run {}: {e}", bin.display()));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        // The first line is the URL; read it on a thread so a silent binary cannot hang us.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut relay = LocalRelay {
            child,
            stdin,
            url: String::new(),
        };
        let line = rx
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("{test}: {} printed no URL", bin.display()));
        relay.url = line.trim().to_string();
        assert!(
            relay.url.starts_with("ws://127.0.0.1:"),
            "{test}: unexpected first line {line:?}"
        );
        Some(relay)
    }

    /// Publishes `events` and waits for each `OK true`.
    fn seed(&self, events: &[Event]) {
        let mut c = Client::connect(&self.url);
        for e in events {
            c.send(&format!(r#"["EVENT",{}]"#, e.as_json()));
        }
        let mut pending: HashSet<String> = events.iter().map(|e| e.id.to_hex()).collect();
        while !pending.is_empty() {
            let frame = c
                .recv_within(WAIT)
                .expect("relay connection")
                .unwrap_or_else(|| panic!("{} OKs missing", pending.len()));
            if frame[0] == "OK" {
                assert_eq!(frame[2], true, "refused: {frame}");
                pending.remove(frame[1].as_str().unwrap_or_default());
            }
        }
    }
}

impl LocalRelay {
    /// The ids of every event it holds (`REQ {}` until EOSE; at most its 500 per REQ).
    fn event_ids(&self) -> HashSet<EventId> {
        let mut c = Client::connect(&self.url);
        c.send(r#"["REQ","dump",{}]"#);
        let mut ids = HashSet::new();
        loop {
            let frame = c
                .recv_within(WAIT)
                .expect("relay connection")
                .expect("an answer to the dump");
            match frame[0].as_str() {
                Some("EVENT") => {
                    ids.insert(EventId::from_hex(frame[2]["id"].as_str().unwrap()).unwrap());
                }
                Some("EOSE") => return ids,
                _ => {}
            }
        }
    }
}

impl Drop for LocalRelay {
    fn drop(&mut self) {
        // Closing stdin asks it to exit; kill in case it does not.
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The relay holds 1,000 issues of one repository and 50 unrelated notes; a client that lacks
/// `percent` % of the issues (and holds two events of its own) learns exactly the ids it lacks
/// and exactly the two the relay lacks.
fn reconcile_with_missing(test: &str, percent: usize) {
    let Some(relay) = LocalRelay::start_or_skip(test) else {
        return;
    };
    let (issues, notes) = issues(1_000, 50, 1_700_000_000);
    let (extra, _) = negentropy_client::issues(2, 0, 1_600_000_000);
    relay.seed(&[issues.clone(), notes].concat());
    let missing = missing_share(&issues, percent);
    assert_eq!(missing.len(), issues.len() * percent / 100);
    let client_has = issues
        .iter()
        .filter(|e| !missing.contains(&e.id))
        .chain(extra.iter());
    let outcome = Client::connect(&relay.url)
        .reconcile("neg1", &repo_filter(&issues[0]), &records(client_has))
        .unwrap_or_else(|a| panic!("{test}: relay answered {a:?}"));
    assert_eq!(outcome.need, missing, "{test}");
    let extra_ids: HashSet<EventId> = extra.iter().map(|e| e.id).collect();
    assert_eq!(outcome.have, extra_ids, "{test}");
}

#[test]
fn local_relay_reconciliation_with_nothing_missing() {
    reconcile_with_missing("local_relay_reconciliation_with_nothing_missing", 0);
}

#[test]
fn local_relay_reconciliation_with_one_percent_missing() {
    reconcile_with_missing("local_relay_reconciliation_with_one_percent_missing", 1);
}

#[test]
fn local_relay_reconciliation_with_half_missing() {
    reconcile_with_missing("local_relay_reconciliation_with_half_missing", 50);
}

#[test]
fn local_relay_reconciliation_with_everything_missing() {
    reconcile_with_missing("local_relay_reconciliation_with_everything_missing", 100);
}

/// The engine against the real relay: `LocalRelay` publishes no NIP-11 document, so with
/// `--nip77-probe` Layer 1 of the first sync is the one try (the first batch's queries are
/// REQs: they are never the try). It completes and the relay is remembered as speaking
/// NIP-77. Then the own relay loses half of the events and the daily resync (a few seconds
/// here) reconciles every history query: the missing ids are fetched by reconciliation and
/// the own relay ends with exactly the expected set again, with no fallback.
#[test]
fn local_relay_engine_reconciles_after_the_probe_and_the_own_relay_ends_complete() {
    use common::{announcement, comment, repo_ref, root};
    use grasp_sync::core::sync::Nip77Support;
    use grasp_sync::testing::{wait_until, TestRelay};
    use std::time::Duration;

    let test = "local_relay_engine_reconciles_after_the_probe_and_the_own_relay_ends_complete";
    let Some(remote) = LocalRelay::start_or_skip(test) else {
        return;
    };
    common::init_logging();
    let own = TestRelay::start();
    let keys = nostr::key::Keys::generate();
    let ann = announcement(&keys, "r", &[&[&remote.url]]);
    let repo = repo_ref(&keys, "r");
    let mut events = vec![ann.clone()];
    own.insert(&ann);
    for i in 0..30 {
        let issue = root(&keys, 1621, &repo, &format!("issue {i}"), &[]);
        let reply = comment(&keys, &issue, "a comment");
        events.push(issue);
        events.push(reply);
    }
    remote.seed(&events);
    let expected: HashSet<EventId> = events.iter().map(|e| e.id).collect();
    let mut config = grasp_sync::Config::new(common::url(&own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    config.nip77.probe_unadvertised = true;
    config.daily_resync = (Duration::from_secs(6), Duration::from_secs(7));
    let handle = grasp_sync::start(config).unwrap();
    let wait = Duration::from_secs(60);
    let complete = || own.event_ids() == expected && handle.status().is_settled();
    assert!(
        wait_until(wait, complete),
        "{test}: first sync: own relay lacks {:?}",
        expected.difference(&own.event_ids())
    );
    let st = handle.status();
    assert_eq!(st.relays.len(), 1, "{test}");
    assert_eq!(st.relays[0].nip77, Nip77Support::Works, "{test}");
    let (runs, fetched) = (st.sync.reconciliations, st.sync.reconcile_ids_fetched);

    // The own relay loses every other issue with its comment (the announcement stays; it
    // keeps something for every query, so none is read as one REQ for lack of anything to
    // compare).
    own.clear_events();
    let mut missing = 0;
    for (k, e) in events.iter().enumerate() {
        if k == 0 || matches!(k % 4, 1 | 2) {
            own.insert(e);
        } else {
            missing += 1;
        }
    }
    assert!(
        wait_until(wait, || {
            let s = handle.status();
            s.sync.daily_resyncs > 0 && s.sync.reconciliations > runs && complete()
        }),
        "{test}: after the daily resync the own relay lacks {:?}; {:?}",
        expected.difference(&own.event_ids()),
        handle.status().sync
    );
    let st = handle.status();
    assert!(
        st.sync.reconcile_ids_fetched - fetched >= missing,
        "{test}: {} ids fetched by reconciliation, {missing} missing",
        st.sync.reconcile_ids_fetched - fetched
    );
    assert_eq!(
        st.sync.reconcile_fallbacks.iter().sum::<u64>(),
        0,
        "{test}: {:?}",
        st.sync
    );
    common::shutdown_clean(handle, &[&own]);
}

/// LocalRelay as the own relay with its default write rate limit (rust-nostr's
/// `notes_per_minute`: 60 a minute per connection, the first 60 at once; ngit-grasp has the
/// same, ngit-relay a stricter one): every
/// `rate-limited:` answer is a refusal for now, not a verdict. The sync completes at the pace
/// the relay accepts, nothing is rejected (issue 19).
#[test]
fn local_relay_as_a_rate_limited_own_relay_gets_the_whole_set() {
    use common::{announcement, comment, repo_ref, root};
    use grasp_sync::testing::{wait_until, TestRelay};
    use std::time::Duration;

    let test = "local_relay_as_a_rate_limited_own_relay_gets_the_whole_set";
    let Some(own) = LocalRelay::start_limited(test, Some(60)) else {
        return;
    };
    common::init_logging();
    let remote = TestRelay::start();
    let keys = nostr::key::Keys::generate();
    let ann = announcement(&keys, "r", &[&[&remote.url()]]);
    let repo = repo_ref(&keys, "r");
    own.seed(std::slice::from_ref(&ann));
    remote.insert(&ann);
    let mut expected: HashSet<EventId> = [ann.id].into();
    for i in 0..40 {
        let issue = root(&keys, 1621, &repo, &format!("issue {i}"), &[]);
        let reply = comment(&keys, &issue, "a comment");
        remote.insert(&issue);
        remote.insert(&reply);
        expected.insert(issue.id);
        expected.insert(reply.id);
    }
    let config = grasp_sync::Config::new(grasp_sync::RelayUrl::parse(&own.url).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    let handle = grasp_sync::start(config).unwrap();
    let ok = wait_until(Duration::from_secs(90), || own.event_ids() == expected);
    let status = handle.status();
    assert!(
        ok,
        "{test}: own relay lacks {:?}\n{status:#?}",
        expected.difference(&own.event_ids())
    );
    assert!(status.forward_rate_limited > 0, "{test}: never throttled");
    assert_eq!(status.rejected, 0, "{test}: {status:#?}");
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

/// With default flags: `LocalRelay` publishes no NIP-11 document, so its first sync is read
/// by REQ while one detection finds out that it speaks NIP-77 (issue 21); the daily resync
/// (a few seconds here) then reconciles, and nothing falls back.
#[test]
fn local_relay_is_found_to_speak_nip77_with_default_flags() {
    use common::{announcement, comment, repo_ref, root};
    use grasp_sync::core::sync::Nip77Support;
    use grasp_sync::testing::{wait_until, TestRelay};
    use std::time::Duration;

    let test = "local_relay_is_found_to_speak_nip77_with_default_flags";
    let Some(remote) = LocalRelay::start_or_skip(test) else {
        return;
    };
    common::init_logging();
    let own = TestRelay::start();
    let keys = nostr::key::Keys::generate();
    let ann = announcement(&keys, "r", &[&[&remote.url]]);
    let repo = repo_ref(&keys, "r");
    let mut events = vec![ann.clone()];
    own.insert(&ann);
    for i in 0..20 {
        let issue = root(&keys, 1621, &repo, &format!("issue {i}"), &[]);
        let reply = comment(&keys, &issue, "a comment");
        events.push(issue);
        events.push(reply);
    }
    remote.seed(&events);
    let expected: HashSet<EventId> = events.iter().map(|e| e.id).collect();
    let mut config = grasp_sync::Config::new(common::url(&own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    config.daily_resync = (Duration::from_secs(8), Duration::from_secs(9));
    let handle = grasp_sync::start(config).unwrap();
    let wait = Duration::from_secs(60);
    let complete = || own.event_ids() == expected && handle.status().is_settled();
    assert!(
        wait_until(wait, || complete()
            && handle.status().relays[0].nip77 == Nip77Support::Works),
        "{test}: first sync: own relay lacks {:?}; {:?}",
        expected.difference(&own.event_ids()),
        handle.status().relays.first().map(|r| r.nip77)
    );
    let st = handle.status();
    assert_eq!(st.sync.nip77_detections, 1, "{test}: {:?}", st.sync);
    // The own relay loses some issues with their comments; the daily resync reconciles.
    own.clear_events();
    for (k, e) in events.iter().enumerate() {
        if k == 0 || matches!(k % 4, 1 | 2) {
            own.insert(e);
        }
    }
    let runs = st.sync.reconciliations;
    assert!(
        wait_until(wait, || {
            let s = handle.status();
            s.sync.daily_resyncs > 0 && s.sync.reconciliations > runs && complete()
        }),
        "{test}: after the daily resync the own relay lacks {:?}; {:?}",
        expected.difference(&own.event_ids()),
        handle.status().sync
    );
    let st = handle.status();
    assert!(st.sync.reconcile_ids_fetched > 0, "{test}: {:?}", st.sync);
    assert_eq!(
        st.sync.reconcile_fallbacks.iter().sum::<u64>(),
        0,
        "{test}: {:?}",
        st.sync
    );
    assert_eq!(st.sync.nip77_detections, 1, "{test}: detected once");
    common::shutdown_clean(handle, &[&own]);
}

/// `grasp-sync audit` with LocalRelay as the own relay and as the remote relay: LocalRelay
/// serves no NIP-11 document, so the audit tries NIP-77 and the remote answers it; the known
/// gap of [`common::audit_gap`] is found by reconciliation, `--fix` stores it, and a second
/// audit finds nothing.
#[test]
fn local_relay_audit_reconciles_a_known_gap_and_fix_closes_it() {
    let test = "local_relay_audit_reconciles_a_known_gap_and_fix_closes_it";
    let (Some(own), Some(remote)) = (
        LocalRelay::start_or_skip(test),
        LocalRelay::start_or_skip(test),
    ) else {
        return;
    };
    let gap = common::audit_gap(&nostr::key::Keys::generate(), &remote.url);
    own.seed(&gap.own);
    remote.seed(&gap.remote);
    common::audit_fix_and_check(&own.url, &gap, "nip77", &|| own.event_ids());
}
