//! NIP-77 reconciliation by the engine over real sockets (issue 11): a `TestRelay` serving
//! negentropy (`set_nip77`, NIP-11 listing 77) gives the own relay exactly the expected set,
//! and its history comes by `ids`; one answering NEG-ERR is read by paged REQs.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{announcement, comment, repo_ref, root, WAIT};
use grasp_sync::testing::{wait_until, Nip77Mode, TestRelay};
use grasp_sync::Config;
use nostr::event::EventId;
use nostr::key::Keys;
use serde_json::json;

fn config(own: &TestRelay) -> Config {
    let mut c = Config::new(common::url(own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    c.backoff.base = Duration::from_millis(200);
    c
}

struct Setup {
    own: TestRelay,
    remote: TestRelay,
    expected: HashSet<EventId>,
    missing: HashSet<EventId>,
    /// Every event of the remote relay.
    all: Vec<nostr::event::Event>,
}

/// Repository `r` on `remote` (announced on both relays): 30 issues with a comment each on
/// the remote relay; the own relay already holds every issue and every third comment (so it
/// holds something for every query that matches anything: none is sent as one REQ for
/// having nothing to compare).
fn setup(mode: Nip77Mode) -> Setup {
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    remote.set_nip11(Some(json!({"name": "nip77 test relay"})));
    remote.set_nip77(mode);
    let keys = Keys::generate();
    let ann = announcement(&keys, "r", &[&[&remote.url()]]);
    let repo = repo_ref(&keys, "r");
    own.insert(&ann);
    remote.insert(&ann);
    let mut expected: HashSet<EventId> = [ann.id].into();
    let mut missing = HashSet::new();
    let mut all = vec![ann];
    for i in 0..30 {
        let issue = root(&keys, 1621, &repo, &format!("issue {i}"), &[]);
        let reply = comment(&keys, &issue, "a comment");
        for (held, e) in [(true, issue), (i % 3 == 0, reply)] {
            remote.insert(&e);
            expected.insert(e.id);
            if held {
                own.insert(&e);
            } else {
                missing.insert(e.id);
            }
            all.push(e);
        }
    }
    Setup {
        own,
        remote,
        expected,
        missing,
        all,
    }
}

#[test]
fn the_engine_reconciles_and_fetches_only_the_missing_ids() {
    let s = setup(Nip77Mode::On);
    let handle = grasp_sync::start(config(&s.own)).unwrap();
    let ok = wait_until(WAIT, || {
        s.own.event_ids() == s.expected && handle.status().is_settled()
    });
    assert!(
        ok,
        "own relay: {:?}",
        s.expected.difference(&s.own.event_ids())
    );
    assert!(!s.remote.neg_opens().is_empty(), "no NEG-OPEN");
    // History came by `ids` only: every other REQ is live-only, or reads a query that
    // nothing matches (the own relay held nothing for it, so it was not reconciled).
    let mut fetched = HashSet::new();
    for req in s.remote.reqs() {
        for f in &req.filters {
            match &f.ids {
                Some(ids) => fetched.extend(ids.iter().copied()),
                None if f.limit == Some(0) => {}
                None => assert!(
                    !s.all
                        .iter()
                        .any(|e| f.match_event(e, nostr::filter::MatchEventOptions::new())),
                    "a history REQ without ids: {}",
                    req.raw
                ),
            }
        }
    }
    assert_eq!(fetched, s.missing, "exactly the missing ids were asked for");
    let st = handle.status();
    assert_eq!(st.relays.len(), 1);
    assert!(st.relays[0].nip77.in_use(), "{:?}", st.relays[0].nip77);
    assert!(st.sync.reconciliations >= 2, "{:?}", st.sync);
    common::shutdown_clean(handle, &[&s.own, &s.remote]);
}

#[test]
fn a_relay_answering_neg_err_is_read_by_paged_reqs() {
    let s = setup(Nip77Mode::NegErr("blocked: too many records".into()));
    let handle = grasp_sync::start(config(&s.own)).unwrap();
    let ok = wait_until(WAIT, || {
        s.own.event_ids() == s.expected && handle.status().is_settled()
    });
    assert!(
        ok,
        "own relay: {:?}",
        s.expected.difference(&s.own.event_ids())
    );
    let reqs = s.remote.reqs();
    assert!(
        reqs.iter()
            .flat_map(|r| r.filters.iter())
            .any(|f| f.ids.is_none() && f.limit != Some(0)),
        "no history REQ"
    );
    assert!(
        reqs.iter()
            .flat_map(|r| r.filters.iter())
            .all(|f| f.ids.is_none()),
        "nothing is fetched by ids"
    );
    let st = handle.status();
    assert!(
        st.sync
            .fallbacks(grasp_sync::core::sync::FallbackReason::NegErr)
            > 0,
        "{:?}",
        st.sync
    );
    common::shutdown_clean(handle, &[&s.own, &s.remote]);
}

/// The daily resync is the consistency check: an own relay that lost events after they were
/// stored (a restored database, a wipe) gets them back by reconciliation, although the
/// forwarder remembers their earlier `OK`s and copies of them were held back while they were
/// on their way.
#[test]
fn an_own_relay_that_lost_stored_events_gets_them_back_at_the_daily_resync() {
    let s = setup(Nip77Mode::On);
    let mut c = config(&s.own);
    c.daily_resync = (Duration::from_secs(5), Duration::from_secs(6));
    let handle = grasp_sync::start(c).unwrap();
    let complete = || s.own.event_ids() == s.expected && handle.status().is_settled();
    assert!(wait_until(WAIT, complete), "first sync");
    let before = handle.status().sync;
    // The own relay loses everything but the announcement and the first half of the rest.
    let kept: Vec<_> = s
        .own
        .events()
        .into_iter()
        .enumerate()
        .filter(|(k, e)| e.kind.as_u16() == 30617 || k % 2 == 0)
        .map(|(_, e)| e)
        .collect();
    s.own.clear_events();
    for e in &kept {
        s.own.insert(e);
    }
    let lost = s.expected.len() - kept.len();
    assert!(lost >= 20, "{lost} lost");
    assert!(
        wait_until(WAIT, || {
            handle.status().sync.daily_resyncs > before.daily_resyncs && complete()
        }),
        "own relay lacks {:?}",
        s.expected.difference(&s.own.event_ids())
    );
    let after = handle.status().sync;
    assert!(
        after.reconcile_ids_fetched - before.reconcile_ids_fetched >= lost as u64,
        "{after:?}"
    );
    common::shutdown_clean(handle, &[&s.own, &s.remote]);
}
