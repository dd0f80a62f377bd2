//! An own relay that is ngit-grasp (`Profile::NgitGrasp`, issue 34): GRASP-01 purgatory, the
//! rule that an event must relate to what the relay serves, `duplicate: event stored`
//! answers, and a per-connection write budget that refills only by whole intervals since the
//! previous EVENT. Every test compares id sets on the own relay, never counts, and counts the
//! writes the own relay received.
//!
//! The remote relay speaks NIP-77 and the daily resync runs every few seconds, so the own
//! relay's side is compared with the remote's again and again: whatever the own relay does
//! not serve (what it holds in purgatory, or dropped from it) is found missing each time.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{comment, event, init_logging, repo_ref, repo_state, root, shutdown_clean, url};
use grasp_sync::testing::{
    wait_until, NgitGraspPolicy, Profile, Refill, TestRelay, TestRelayOptions, WriteRate,
};
use grasp_sync::{Config, Status};
use nostr::event::{Event, EventId};
use nostr::key::Keys;

/// Deadline of anything that should happen (2 cores shared with other builds).
const WAIT: Duration = Duration::from_secs(120);

/// A repository announcement ngit-grasp accepts: it lists the own relay's domain as a clone
/// URL and as a relay, and the remote relay; `extra` tags follow.
fn announcement(
    own: &TestRelay,
    remote: &TestRelay,
    keys: &Keys,
    d: &str,
    extra: &[&[&str]],
) -> Event {
    let domain = format!("127.0.0.1:{}", own.port());
    let clone = format!("http://{domain}/npub/{d}.git");
    let (own_url, remote_url) = (own.url(), remote.url());
    let relays = ["relays", own_url.as_str(), remote_url.as_str()];
    let (d_tag, clone_tag) = (["d", d], ["clone", clone.as_str()]);
    let mut tags: Vec<&[&str]> = vec![&d_tag, &clone_tag, &relays];
    tags.extend_from_slice(extra);
    event(keys, 30617, "", &tags)
}

fn config(own: &TestRelay) -> Config {
    let mut c = Config::new(url(own))
        .public_url(url(own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    c.backoff.base = Duration::from_millis(200);
    c.backoff.max = Duration::from_secs(1);
    c.forward.ok_timeout = Duration::from_secs(5);
    // The own relay's side is compared with the remote's every few seconds.
    c.daily_resync = (Duration::from_secs(3), Duration::from_secs(4));
    c
}

/// A remote relay with NIP-77 (strfry's profile: it lists 77 in NIP-11).
fn remote() -> TestRelay {
    TestRelay::start_profile(Profile::Strfry)
}

fn rejected(st: &Status, reason: &str) -> u64 {
    st.rejected_by_reason
        .iter()
        .find(|(r, _)| *r == reason)
        .map_or(0, |(_, n)| *n)
}

/// Waits for `more` daily resyncs (each reconciles the remote's history with the own relay's)
/// after the current count.
fn wait_for_resyncs(handle: &grasp_sync::SyncHandle, more: u64) -> bool {
    let from = handle.status().sync.daily_resyncs;
    wait_until(WAIT, || {
        let st = handle.status();
        st.sync.daily_resyncs >= from + more && st.forward_backlog == 0
    })
}

/// The first sync into ngit-grasp. `alpha` is served; on the remote relay `gamma`, a
/// repository listing the own relay that it has never seen, with its owner's state, an issue,
/// a comment, and the announcement and state of a co-maintainer (carol) whose announcement
/// does not list the own relay. Layer 1 forwards gamma's announcement: held in purgatory
/// (`OK true "purgatory: …"`), counted, not served; the states too (or, if one reached
/// ngit-grasp before the announcement, refused `invalid: no announcement exists …`). Carol's
/// announcement is refused (`invalid:`): ngit-grasp takes it only once a served announcement
/// lists her. Nothing about gamma is offered meanwhile (the engine learns repositories from
/// what the own relay serves), and reconciliation after reconciliation finds gamma's events
/// missing: none is written again. Then gamma's git data arrives (`TestRelay::promote`):
/// ngit-grasp serves what it held, the self-subscription reads gamma, the refused ones are
/// offered again (any announcement or state of gamma's `d`) and taken, gamma's issue and
/// comment are fetched and stored. The own relay ends with exactly the set.
#[test]
fn a_first_sync_into_ngit_grasp_waits_out_purgatory_and_writes_nothing_twice() {
    init_logging();
    let own = TestRelay::start_profile(Profile::NgitGrasp);
    let remote = remote();
    let [alice, bob, carol, dave] = std::array::from_fn(|_| Keys::generate());
    let alpha = announcement(&own, &remote, &alice, "alpha", &[]);
    own.insert(&alpha);
    remote.insert(&alpha);
    let alpha_issue = root(&dave, 1621, &repo_ref(&alice, "alpha"), "alpha issue", &[]);
    let alpha_reply = comment(&alice, &alpha_issue, "alpha reply");
    let carol_hex = carol.public_key().to_hex();
    let gamma = announcement(
        &own,
        &remote,
        &bob,
        "gamma",
        &[&["maintainers", &carol_hex]],
    );
    let gamma_state = repo_state(&bob, "gamma");
    let carol_gamma = event(
        &carol,
        30617,
        "",
        &[&["d", "gamma"], &["relays", &remote.url()]],
    );
    let carol_state = repo_state(&carol, "gamma");
    let gamma_issue = root(&dave, 1621, &repo_ref(&bob, "gamma"), "gamma issue", &[]);
    let gamma_reply = comment(&bob, &gamma_issue, "gamma reply");
    for e in [
        &alpha_issue,
        &alpha_reply,
        &gamma,
        &gamma_state,
        &carol_gamma,
        &carol_state,
        &gamma_issue,
        &gamma_reply,
    ] {
        remote.insert(e);
    }
    let served_first: HashSet<EventId> = [alpha.id, alpha_issue.id, alpha_reply.id].into();
    // What Layer 1 forwards about gamma: each is answered once (held in purgatory, or refused:
    // carol's announcement, and a state that reached ngit-grasp before gamma's announcement).
    let layer1 = [gamma.id, gamma_state.id, carol_state.id, carol_gamma.id];

    let handle = grasp_sync::start(config(&own)).unwrap();
    let first = wait_until(WAIT, || {
        own.event_ids() == served_first
            && own.purgatory_ids().contains(&gamma.id)
            && layer1.iter().all(|id| own.writes_of(id) == 1)
            && handle.status().forward_backlog == 0
    });
    assert!(
        first,
        "served {:?}, held {:?}: {:#?}",
        own.event_ids(),
        own.purgatory_ids(),
        handle.status()
    );
    let held = own.purgatory_ids();
    // Reconciliations find gamma's events missing again and again (ngit-grasp does not serve
    // them): none is written twice, whether it was held or refused.
    let fetched = handle.status().sync.reconcile_ids_fetched;
    assert!(wait_for_resyncs(&handle, 3), "{:#?}", handle.status());
    let st = handle.status();
    assert!(
        st.sync.reconcile_ids_fetched >= fetched + layer1.len() as u64,
        "found missing again: {st:#?}"
    );
    assert_eq!(st.forward_purgatory, held.len() as u64, "{st:#?}");
    for id in layer1 {
        assert_eq!(own.writes_of(&id), 1, "{id} written again: {st:#?}");
    }
    assert_eq!(own.purgatory_ids(), held, "still held");
    // Nothing about gamma was offered: no `restricted:` refusal.
    assert_eq!(own.writes_of(&gamma_issue.id), 0);
    assert_eq!(own.writes_of(&gamma_reply.id), 0);
    assert_eq!(rejected(&st, "restricted"), 0, "{st:#?}");

    // Gamma's git data arrives: what waited for it is served, the rest is sent.
    assert_eq!(own.promote(&repo_ref(&bob, "gamma")), held.len());
    let mut expected = served_first.clone();
    expected.extend(layer1);
    expected.extend([gamma_issue.id, gamma_reply.id]);
    let done = wait_until(WAIT, || own.event_ids() == expected);
    let held_now = own.event_ids();
    let missing: HashSet<_> = expected.difference(&held_now).collect();
    assert!(done, "missing {missing:?}: {:#?}", handle.status());
    assert!(wait_for_resyncs(&handle, 2), "{:#?}", handle.status());
    assert_eq!(own.event_ids(), expected);
    // What was held was written once, never again. The rest at most a few times: once, once
    // more after a refusal, and once more if a reconciliation that compared the own relay's
    // side before the write fetched it anyway (a fetch is forwarded even when an earlier
    // copy was stored: decision 0061).
    for id in &held {
        assert_eq!(own.writes_of(id), 1, "{id} held, then written again");
    }
    for id in &expected {
        assert!(
            own.writes_of(id) <= 3,
            "{id} written {} times",
            own.writes_of(id)
        );
    }
    assert!(
        (2..=3).contains(&own.writes_of(&carol_gamma.id)),
        "carol's announcement: refused, then taken"
    );
    let writes = own.writes_received();
    assert!(writes <= 2 * expected.len() as u64, "{writes} writes");
    shutdown_clean(handle, &[&own, &remote]);
}

/// ngit-grasp drops what waited in purgatory longer than its timeout (30 minutes; 1 s here)
/// without git data. The engine leaves it dropped: reconciliations keep finding the
/// announcement missing, and writing it again would only hold an empty repository in
/// purgatory another 30 minutes, time after time (decision 0101). Git data is ngit-grasp's
/// to fetch; a new version of the announcement is a new event and is sent.
#[test]
fn an_announcement_dropped_from_purgatory_is_not_sent_again() {
    init_logging();
    let own = TestRelay::start_with(TestRelayOptions {
        ngit_grasp: Some(NgitGraspPolicy {
            purgatory_timeout: Duration::from_secs(1),
            ..NgitGraspPolicy::default()
        }),
        ..TestRelayOptions::profile(Profile::NgitGrasp)
    });
    let remote = remote();
    let [alice, bob] = std::array::from_fn(|_| Keys::generate());
    let alpha = announcement(&own, &remote, &alice, "alpha", &[]);
    own.insert(&alpha);
    remote.insert(&alpha);
    let gamma = announcement(&own, &remote, &bob, "gamma", &[]);
    remote.insert(&gamma);

    let handle = grasp_sync::start(config(&own)).unwrap();
    assert!(
        wait_until(WAIT, || own.writes_of(&gamma.id) == 1),
        "{:#?}",
        handle.status()
    );
    assert!(
        wait_until(WAIT, || own.purgatory_ids().is_empty()),
        "dropped"
    );
    assert!(wait_for_resyncs(&handle, 3), "{:#?}", handle.status());
    assert_eq!(own.writes_of(&gamma.id), 1, "sent again after the drop");
    assert!(own.purgatory_ids().is_empty());
    assert_eq!(own.event_ids(), [alpha.id].into());
    assert_eq!(handle.status().forward_purgatory, 1);
    shutdown_clean(handle, &[&own, &remote]);
}

/// ngit-grasp's write budget at 0.15 of its time scale: 60 EVENTs per connection, then each
/// EVENT earns the whole 150 ms intervals since the connection's previous EVENT (refused ones
/// included: one sent sooner earns nothing and starts the count again). 140 events beyond the
/// burst go through one connection, paced, none lost; the forwarder never opens another
/// connection to get a fresh budget (decision 0102), and writes fewer than twice per event.
#[test]
fn ngit_grasps_write_budget_is_paced_on_one_connection_and_loses_nothing() {
    init_logging();
    let own = TestRelay::start_with(TestRelayOptions {
        write_rate: Some(
            WriteRate::new(60, Duration::from_millis(150)).with_refill(Refill::SinceLastAttempt),
        ),
        ..TestRelayOptions::profile(Profile::NgitGrasp)
    });
    let remote = remote();
    let alice = Keys::generate();
    let alpha = announcement(&own, &remote, &alice, "alpha", &[]);
    own.insert(&alpha);
    remote.insert(&alpha);
    let mut expected: HashSet<EventId> = [alpha.id].into();
    let repo = repo_ref(&alice, "alpha");
    for i in 0..100 {
        let issue = root(&alice, 1621, &repo, &format!("issue {i}"), &[]);
        let reply = comment(&alice, &issue, &format!("reply {i}"));
        remote.insert(&issue);
        remote.insert(&reply);
        expected.extend([issue.id, reply.id]);
    }
    let mut c = config(&own);
    c.daily_resync = (Duration::from_secs(3600), Duration::from_secs(3600));
    let handle = grasp_sync::start(c).unwrap();
    let done = wait_until(Duration::from_secs(240), || own.event_ids() == expected);
    let st = handle.status();
    let missing = expected.difference(&own.event_ids()).count();
    assert!(done, "missing {missing}: {st:#?}");
    assert!(st.forward_rate_limited > 0, "the budget was reached");
    assert_eq!(st.rejected, 0, "{st:#?}");
    let writes = own.writes_received();
    let events = expected.len() as u64 - 1;
    eprintln!("{events} events into ngit-grasp's budget: {writes} writes");
    assert!(writes < 2 * events, "{writes} writes for {events} events");
    // The self-subscription and the forwarder: one connection each, never another.
    assert_eq!(own.connections_accepted(), 2);
    shutdown_clean(handle, &[&own, &remote]);
}
