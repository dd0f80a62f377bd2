//! `--state-dir` over real sockets (issue 11): a restart within the quick-reconnect window
//! continues with catch-ups (no history REQ without `since`), one after the window is a fresh
//! sync, unusable state files are reported and ignored, and a confirmation is never saved
//! before its events are in the own relay.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{url, OneRepo, WAIT};
use grasp_sync::core::{Clock, ManualClock, SystemClock};
use grasp_sync::testing::internals::state_file;
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, SyncHandle};
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::types::Timestamp;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "grasp-sync-state-test-{name}-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn start(own: &TestRelay, dir: &Path, clock: Arc<dyn Clock>) -> SyncHandle {
    let mut config = Config::new(url(own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100))
        .clock(clock);
    config.backoff.base = Duration::from_millis(200);
    config.backoff.max = Duration::from_secs(1);
    config.state_dir = Some(dir.to_path_buf());
    config.state_save_interval = Duration::from_millis(100);
    grasp_sync::start(config).unwrap()
}

/// An issue of the repository, `days` old.
fn old_issue(r: &OneRepo, text: &str, days: u64) -> Event {
    EventBuilder::new(Kind::Custom(1621), text)
        .tag(Tag::parse(["a", &r.repo]).unwrap())
        .custom_created_at(Timestamp::from_secs(
            Timestamp::now().as_secs() - days * 86_400,
        ))
        .finalize(&r.keys)
        .unwrap()
}

fn wait_for(own: &TestRelay, want: &HashSet<EventId>, h: &SyncHandle, what: &str) {
    wait_ticking(own, want, h, what, None);
}

/// [`wait_for`], moving a manual clock 100 ms forward at every poll.
fn wait_ticking(
    own: &TestRelay,
    want: &HashSet<EventId>,
    h: &SyncHandle,
    what: &str,
    clock: Option<&ManualClock>,
) {
    let ok = wait_until(WAIT, || {
        if let Some(c) = clock {
            c.advance(Duration::from_millis(100));
        }
        own.event_ids().is_superset(want) && h.status().is_settled()
    });
    let missing: Vec<_> = want.difference(&own.event_ids()).cloned().collect();
    assert!(
        ok,
        "{what}: own relay misses {missing:?}\n{:#?}",
        h.status()
    );
}

/// History REQs without `since` (live-only subscriptions carry `limit: 0`).
fn full_history_reqs(relay: &TestRelay) -> Vec<String> {
    relay
        .reqs()
        .into_iter()
        .filter(|r| {
            r.filters
                .iter()
                .any(|f| f.since.is_none() && f.limit != Some(0))
        })
        .map(|r| r.raw)
        .collect()
}

struct Setup {
    own: TestRelay,
    remote: TestRelay,
    r: OneRepo,
    want: HashSet<EventId>,
    dir: PathBuf,
}

/// The own relay announces a repository on `remote`, which holds an issue and a reply; a
/// first run syncs them and stops gracefully (which saves the state).
fn first_run(name: &str, manual: Option<Arc<ManualClock>>) -> Setup {
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = OneRepo::new(&remote);
    let mut want = r.seed(&own, &remote);
    let reply = r.reply("before the restart");
    remote.insert(&reply);
    want.insert(reply.id);
    let dir = temp_dir(name);
    let clock: Arc<dyn Clock> = match &manual {
        Some(c) => c.clone(),
        None => Arc::new(SystemClock),
    };
    let h = start(&own, &dir, clock);
    wait_ticking(&own, &want, &h, "first run", manual.as_deref());
    let st = h.status().state_file;
    assert!(st.enabled && !st.loaded, "{st:?}");
    assert_eq!(st.ignored.as_ref().map(|i| i.0), Some("missing"));
    // Saved while running (a crash now would keep it), not only at the stop.
    let saved = wait_until(WAIT, || {
        if let Some(c) = &manual {
            c.advance(Duration::from_millis(100));
        }
        std::fs::read_to_string(state_file::path(&dir)).is_ok_and(|t| t.contains(&r.repo))
    });
    assert!(saved, "periodic save: {:?}", h.status().state_file);
    assert!(h.status().state_file.saves >= 1);
    h.shutdown(Duration::from_secs(10)).unwrap();
    assert!(state_file::path(&dir).exists(), "saved at shutdown");
    Setup {
        own,
        remote,
        r,
        want,
        dir,
    }
}

#[test]
fn a_restart_within_the_window_sends_no_history_req_without_since() {
    let mut s = first_run("quick", None);
    // While the process is down, the remote relay gets a reply and a repository comment.
    let reply = s.r.reply("while down");
    let comment = common::repo_comment(&s.r.keys, &s.r.repo, "while down");
    for e in [&reply, &comment] {
        s.remote.insert(e);
        s.want.insert(e.id);
    }
    s.remote.clear_reqs();
    let h = start(&s.own, &s.dir, Arc::new(SystemClock));
    wait_for(&s.own, &s.want, &h, "after the restart");
    let st = h.status().state_file;
    assert!(st.loaded && st.ignored.is_none(), "{st:?}");
    assert_eq!(st.relays_restored, 1);
    assert!(!s.remote.reqs().is_empty(), "the relay was asked again");
    // The reply that arrived while down is followed below its issue once stored (decision
    // 0097): a new Layer-3 id, the only one read in full.
    let only_new = format!("[\"{}\"]", reply.id.to_hex());
    let full: Vec<String> = full_history_reqs(&s.remote)
        .into_iter()
        .filter(|raw| !raw.contains(&only_new))
        .collect();
    assert!(full.is_empty(), "history REQs without since: {full:#?}");
    // Live again: something published now arrives.
    let live = s.r.reply("after the restart");
    s.remote.insert(&live);
    s.want.insert(live.id);
    wait_for(&s.own, &s.want, &h, "live after the restart");
    h.shutdown(Duration::from_secs(10)).unwrap();
    std::fs::remove_dir_all(&s.dir).unwrap();
}

#[test]
fn a_restart_after_the_window_is_a_fresh_sync() {
    let clock = Arc::new(ManualClock::new(SystemClock.now()));
    let s = first_run("stale", Some(clock.clone()));
    s.remote.clear_reqs();
    clock.advance(Duration::from_secs(16 * 60));
    let h = start(&s.own, &s.dir, clock.clone());
    let ok = wait_until(WAIT, || {
        clock.advance(Duration::from_millis(100));
        !full_history_reqs(&s.remote).is_empty() && h.status().is_settled()
    });
    assert!(ok, "a fresh sync: {:#?}", s.remote.reqs());
    let st = h.status().state_file;
    assert!(st.loaded, "{st:?}");
    assert_eq!(st.relays_restored, 0, "too old to continue");
    h.shutdown(Duration::from_secs(10)).unwrap();
    std::fs::remove_dir_all(&s.dir).unwrap();
}

#[test]
fn unusable_state_files_are_reported_and_ignored() {
    let s = first_run("unusable", None);
    let good = std::fs::read_to_string(state_file::path(&s.dir)).unwrap();
    let cases: Vec<(&str, String)> = vec![
        ("corrupt", good[..good.len() / 2].to_string()),
        (
            "older_version",
            good.replace("\"version\":1", "\"version\":0"),
        ),
        (
            "other_own_relay",
            good.replace(&s.own.url(), "ws://127.0.0.1:1"),
        ),
        ("other_config", good.replace("shard=all", "shard=1/2")),
    ];
    for (reason, text) in cases {
        assert_ne!(text, good, "{reason}: the case changes the file");
        std::fs::write(state_file::path(&s.dir), &text).unwrap();
        s.remote.clear_reqs();
        let h = start(&s.own, &s.dir, Arc::new(SystemClock));
        wait_for(&s.own, &s.want, &h, reason);
        let st = h.status().state_file;
        assert!(!st.loaded, "{reason}: {st:?}");
        assert_eq!(st.ignored.as_ref().map(|i| i.0), Some(reason), "{st:?}");
        let n = st
            .ignored_by_reason
            .iter()
            .find(|(r, _)| *r == reason)
            .map(|x| x.1);
        assert_eq!(n, Some(1), "{reason} counted");
        assert!(
            !full_history_reqs(&s.remote).is_empty(),
            "{reason}: a fresh sync"
        );
        h.shutdown(Duration::from_secs(10)).unwrap();
        // The next save replaced the file with a usable one.
        let again = std::fs::read_to_string(state_file::path(&s.dir)).unwrap();
        assert!(
            matches!(
                state_file::parse(&again, &s.own.url(), "public=;archive=false;shard=all"),
                state_file::Loaded::Snapshot(_)
            ),
            "{reason}: rewritten"
        );
    }
    std::fs::remove_dir_all(&s.dir).unwrap();
}

#[test]
fn a_confirmation_is_not_saved_before_its_events_are_in_the_own_relay() {
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = OneRepo::new(&remote);
    own.insert(&r.ann);
    remote.insert(&r.ann);
    // Older than any catch-up's since: only a full sync reads it.
    let issue = old_issue(&r, "old issue", 3);
    remote.insert(&issue);
    remote.set_refuse_connections(true);
    let dir = temp_dir("unforwarded");
    let h = start(&own, &dir, Arc::new(SystemClock));
    let target_known = wait_until(WAIT, || {
        h.status()
            .relay(&url(&remote))
            .is_some_and(|s| s.target_repos == 1)
    });
    assert!(target_known);
    // The own relay goes away (forwarder included); then the remote relay answers.
    own.set_refuse_connections(true);
    own.drop_connections();
    assert!(wait_until(WAIT, || !h.status().forwarder_connected));
    remote.set_refuse_connections(false);
    let confirmed = wait_until(WAIT, || {
        h.status()
            .relay(&url(&remote))
            .is_some_and(|s| s.confirmed_repos == 1)
    });
    assert!(confirmed, "{:#?}", h.status());
    // The issue waits in the forwarder. That no snapshot is written meanwhile, however many
    // save intervals pass, is `engine::state_file`
    // `a_confirmation_waits_for_its_events_through_any_number_of_save_intervals` (simulated
    // time, every write on disk before the file is read). Here the whole run ends without
    // writing it: a stop that cannot drain does not save either ("crash" with events in
    // flight), and the next run, reading the file, fetches the issue again.
    assert!(h.status().forward_backlog > 0);
    let _ = h.shutdown(Duration::from_secs(2));
    let saved = std::fs::read_to_string(state_file::path(&dir)).unwrap_or_default();
    assert!(
        !saved.contains(&r.repo),
        "confirmation saved before the own relay stored its events: {saved}"
    );
    // A stop that timed out keeps the state directory locked until the handle goes.
    drop(h);
    // The next run reads the issue again.
    own.set_refuse_connections(false);
    let h = start(&own, &dir, Arc::new(SystemClock));
    let want: HashSet<EventId> = [r.ann.id, issue.id].into();
    wait_for(&own, &want, &h, "after the restart");
    h.shutdown(Duration::from_secs(10)).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 20, item 9: two instances must not share one `--state-dir` (each would overwrite
/// the other's state). The second start fails with an error that says why; once the first
/// stops, the directory is free again.
#[test]
fn a_second_instance_on_the_same_state_dir_is_refused_with_a_clear_error() {
    let own = TestRelay::start();
    let dir = temp_dir("lock");
    let first = start(&own, &dir, Arc::new(grasp_sync::core::SystemClock));
    let mut config = Config::new(url(&own)).allow_private_relays(true);
    config.state_dir = Some(dir.clone());
    let err = grasp_sync::start(config.clone())
        .err()
        .expect("the second start fails")
        .to_string();
    assert!(err.contains("in use by another grasp-sync"), "{err}");
    first.shutdown(Duration::from_secs(10)).unwrap();
    let again = grasp_sync::start(config).expect("free once the first stopped");
    again.shutdown(Duration::from_secs(10)).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
