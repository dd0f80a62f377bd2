//! The design's behaviours of [`SyncMachine`](super::SyncMachine), on the simulated world
//! ([`super::world`]): fake relays with stores and faults talk to real relay sessions in JSON
//! frames, and the machine sees only what the sessions report. Each test checks what the
//! relays received (`reqs`, the subscriptions open on them), what the own relay holds, the
//! machine's read API and the timing.
//!
//! Three tests hand the machine a report directly (`World::inject`), each saying why: two
//! send reports of a connection generation that is no longer current, which cannot come out
//! of the world (its connections answer synchronously) but against which the machine's own
//! defence is worth keeping; one sends the forwarder's back-pressure report, which comes from
//! the engine, not from a relay.

use std::collections::BTreeSet;

use crate::core::hash::HashSet;
use std::time::Duration;

use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::filter::Filter;
use nostr::message::SubscriptionId;
use nostr::types::Timestamp;

use super::world::{announcement, is_l1, issue, keys, reply, repo, FakeRelay, World};
use crate::core::filters::{
    build_announcement_filter, build_layer2_and_layer3_filters, own_events_filter,
    self_subscription_filter,
};
use crate::core::health::HealthState;
use crate::core::state::ConnectionStatus;
use crate::core::sync::{Report, SubPurpose, SyncConfig};
use crate::shared::RelayUrl;

const OWN: &str = "ws://own.example";
const A: &str = "ws://a.example";
const B: &str = "ws://b.example";

fn url(s: &str) -> RelayUrl {
    RelayUrl::parse(s).unwrap()
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// A world with the design's settings; the design's scenarios assume a relay that allows
/// more than 70 subscriptions (the budget tests set their own).
fn world(cfg: impl FnOnce(&mut SyncConfig)) -> World {
    World::new(OWN, |c| {
        c.default_subscription_budget = 1000;
        // The design's scenarios count REQs one filter each (decision 0008); several filters
        // per REQ are `pack_tests`'s.
        c.max_filters_per_req = 1;
        cfg(c);
    })
}

fn fake<'a>(w: &'a World, relay: &str) -> &'a FakeRelay {
    if relay == OWN {
        &w.own
    } else {
        &w.relays[&url(relay)]
    }
}

/// The REQ filters `relay` received from the `from`-th on.
fn reqs_from(w: &World, relay: &str, from: usize) -> Vec<Filter> {
    fake(w, relay).reqs[from..].to_vec()
}

fn req_count(w: &World, relay: &str) -> usize {
    fake(w, relay).reqs.len()
}

/// The subscriptions open on `relay` now.
fn open(w: &World, relay: &str) -> BTreeSet<SubscriptionId> {
    fake(w, relay).subs.keys().cloned().collect()
}

fn since(f: &Filter) -> Option<u64> {
    f.since.map(|t| t.as_secs())
}

fn until(f: &Filter) -> Option<u64> {
    f.until.map(|t| t.as_secs())
}

/// A live-only subscription: `limit: 0`, no `since`/`until` (relays apply `since` to live
/// events too).
fn is_live_only(f: &Filter) -> bool {
    f.limit == Some(0) && f.since.is_none() && f.until.is_none()
}

/// The values of tag condition `#tag` (case-sensitive).
fn tag_values(f: &Filter, tag: char) -> Vec<String> {
    f.generic_tags
        .iter()
        .filter(|(t, _)| t.as_char() == tag)
        .flat_map(|(_, v)| v.iter().cloned())
        .collect()
}

fn has_tag(f: &Filter, tag: char) -> bool {
    f.generic_tags.keys().any(|t| t.as_char() == tag)
}

/// The machine's view of `relay`'s connection.
fn status(w: &World, relay: &str) -> ConnectionStatus {
    w.m.relay(&url(relay)).unwrap().state().connection_status
}

/// Own relay connected (its empty history read), one announcement of repository `r` on A,
/// batch window passed: A is connected and subscribed. `relay` sets up A first.
fn discovered(cfg: impl FnOnce(&mut SyncConfig), relay: impl FnOnce(&mut FakeRelay)) -> World {
    let mut w = world(cfg);
    relay(w.relay(A));
    w.start();
    assert_eq!(
        w.own.reqs,
        vec![self_subscription_filter(None), own_events_filter()],
        "the first self-subscription has no since (after the announcements and root events)"
    );
    let t = w.secs();
    w.store_on_own(&announcement("r", &[A], t));
    w.advance(secs(5));
    w
}

/// [`discovered`] with A's EOSEs held back until released.
fn discovered_slow() -> World {
    discovered(|_| {}, |a| a.hold_eose = true)
}

/// Advances in 1 s steps until the machine sees `relay` connected (at most `max`); returns
/// the time waited.
fn until_connected(w: &mut World, relay: &str, max: Duration) -> Duration {
    let start = w.now;
    while status(w, relay) != ConnectionStatus::Connected {
        assert!(
            w.now.since(start) < max,
            "{relay} not connected within {max:?}"
        );
        w.advance(secs(1));
    }
    w.now.since(start)
}

/// A synced with repository `r` and one root event of it.
fn synced() -> (World, Event) {
    let mut w = discovered(|_| {}, |_| {});
    let root = issue("r", "one", w.secs());
    w.store_on_own(&root);
    w.advance(secs(5));
    let st = w.m.relay(&url(A)).unwrap().state();
    assert_eq!(st.repos, [repo("r")].into_iter().collect::<HashSet<_>>());
    assert_eq!(
        st.root_events,
        [root.id].into_iter().collect::<HashSet<_>>()
    );
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    (w, root)
}

#[test]
fn batch_window_starts_at_first_event_and_does_not_reset() {
    let mut w = world(|_| {});
    w.relay(A);
    w.relay(B);
    w.start();
    let t = w.secs();
    w.store_on_own(&announcement("a", &[A], t));
    w.advance(secs(3));
    w.store_on_own(&announcement("b", &[B], t));
    assert!(w
        .relays
        .values()
        .all(|f| f.conn.is_none() && f.reqs.is_empty()));
    assert!(w.m.relays().len() == 0);
    // 5 s after the FIRST event, not the second.
    w.advance(secs(2));
    assert!(w.relays.values().all(|f| f.conn.is_some()));
    let known: BTreeSet<RelayUrl> = w.m.relays().map(|r| r.url()).cloned().collect();
    assert_eq!(known, [url(A), url(B)].into());
    assert_eq!(w.m.repo_index().len(), 2);
}

#[test]
fn fresh_sync_subscribes_l1_without_since_then_layers_2_3_as_a_batch() {
    let mut w = discovered_slow();
    assert_eq!(status(&w, A), ConnectionStatus::Connected);
    let reqs = reqs_from(&w, A, 0);
    assert_eq!(reqs.len(), 4, "L1 + a/A/q");
    assert_eq!(
        reqs[0],
        build_announcement_filter(None),
        "L1 first, no since"
    );
    let want: HashSet<String> = build_layer2_and_layer3_filters(
        &[repo("r")].into_iter().collect::<HashSet<_>>(),
        &HashSet::default(),
        None,
    )
    .iter()
    .map(Filter::as_json)
    .collect();
    let got: HashSet<String> = reqs[1..].iter().map(Filter::as_json).collect();
    assert_eq!(got, want, "the batch: full history, no since");
    assert_eq!(w.m.relay(&url(A)).unwrap().pending().len(), 1);
    w.release_eose_where(A, is_l1);
    // Not confirmed until every batch subscription saw EOSE.
    for (i, tag) in ['a', 'A', 'q'].into_iter().enumerate() {
        assert!(
            w.m.relay(&url(A)).unwrap().state().repos.is_empty(),
            "after {i} EOSEs"
        );
        assert_eq!(w.m.relay(&url(A)).unwrap().pending().len(), 1);
        w.release_eose_where(A, |f| has_tag(f, tag));
    }
    let st = w.m.relay(&url(A)).unwrap().state();
    assert_eq!(st.repos, [repo("r")].into_iter().collect::<HashSet<_>>());
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    assert_eq!(w.m.counters().batches_confirmed, 1);
    assert_eq!(req_count(&w, A), 4, "nothing more asked");
}

#[test]
fn root_events_add_layer3_batches_only_for_new_items() {
    let mut w = discovered(|_| {}, |_| {});
    let before = req_count(&w, A);
    let iss = issue("r", "bug", w.secs());
    w.store_on_own(&iss);
    w.advance(secs(5));
    let reqs = reqs_from(&w, A, before);
    assert_eq!(
        reqs.len(),
        3,
        "e/E/q for the one new root event, nothing for the confirmed repo"
    );
    let tags: BTreeSet<char> = reqs
        .iter()
        .flat_map(|f| f.generic_tags.keys().map(|t| t.as_char()))
        .collect();
    assert_eq!(tags, ['E', 'e', 'q'].into());
    for f in &reqs {
        assert_eq!(f.generic_tags.len(), 1);
        assert_eq!(
            f.generic_tags.values().next().unwrap(),
            &[iss.id.to_hex()]
                .into_iter()
                .collect::<std::collections::BTreeSet<_>>()
        );
        assert!(f.since.is_none() && f.limit.is_none(), "full history");
    }
    // The same event read again (an own-relay reconnect re-reads everything): nothing new.
    let before = req_count(&w, A);
    w.drop(OWN);
    w.run_for(secs(30), secs(5));
    assert_eq!(w.m.own_status(), ConnectionStatus::Connected);
    assert_eq!(
        w.own.reqs.len(),
        6,
        "read again: the announcements and root events, then every event, each short page probed once for a hidden cap (decision 0103)"
    );
    assert_eq!(req_count(&w, A), before);
}

#[test]
fn newer_announcement_replaces_relay_set_older_is_ignored() {
    let c = "ws://c.example";
    let mut w = world(|_| {});
    for r in [A, B, c] {
        w.relay(r);
    }
    w.start();
    w.store_on_own(&announcement("r", &[A], 100));
    w.advance(secs(5));
    w.store_on_own(&announcement("r", &[B], 200));
    w.advance(secs(5));
    assert_eq!(
        w.m.repo_index()[&repo("r")].relays,
        HashSet::from_iter([url(B)])
    );
    assert!(!fake(&w, B).reqs.is_empty(), "B synced");
    w.store_on_own(&announcement("r", &[c], 150));
    w.advance(secs(5));
    assert_eq!(
        w.m.repo_index()[&repo("r")].relays,
        HashSet::from_iter([url(B)])
    );
    assert!(fake(&w, c).reqs.is_empty() && fake(&w, c).conn.is_none());
    assert!(w.m.relay(&url(c)).is_none());
}

#[test]
fn own_relay_and_aliases_are_never_targets() {
    let alias = "wss://git.example.com";
    let mut w = world(|c| c.own_aliases = vec![url(alias)]);
    w.relay(A);
    w.relay(alias);
    w.start();
    let t = w.secs();
    w.store_on_own(&announcement(
        "r",
        &["ws://OWN.example/", "wss://git.example.com:443", A],
        t,
    ));
    w.advance(secs(5));
    let known: Vec<RelayUrl> = w.m.relays().map(|r| r.url()).cloned().collect();
    assert_eq!(known, vec![url(A)]);
    assert!(fake(&w, alias).conn.is_none() && fake(&w, alias).reqs.is_empty());
    assert_eq!(
        w.own.reqs,
        vec![self_subscription_filter(None), own_events_filter()],
        "the own relay is only read (announcements and root events, then every event)"
    );
    assert_eq!(req_count(&w, A), 4);
}

#[test]
fn failed_first_connect_is_retried_with_backoff() {
    let mut w = discovered(|_| {}, |a| a.down = true);
    assert_eq!(status(&w, A), ConnectionStatus::Disconnected);
    // The cause is kept typed and rendered only for the status and the log.
    let error = w.m.relay(&url(A)).unwrap().status(w.now).last_error;
    assert_eq!(
        error,
        Some(super::LinkError::ConnectFailed(
            crate::core::wire::Disconnect::Tcp("connection refused".into())
        ))
    );
    assert_eq!(
        error.unwrap().to_string(),
        "connect failed: TCP connect failed: connection refused"
    );
    let attempts = |w: &World| w.m.counters().connect_attempts;
    let first = attempts(&w);
    // Backoff 5 s ± 25 %: nothing at 3 s, a retry by 7 s.
    w.advance(secs(3));
    assert_eq!(attempts(&w), first);
    w.advance(secs(4));
    assert_eq!(attempts(&w), first + 1);
    // Unreachable for two simulated hours, then reachable: it still gets synced.
    w.run_for(secs(7200), secs(60));
    assert!(fake(&w, A).reqs.is_empty());
    let tried = attempts(&w);
    w.relay(A).down = false;
    w.run_for(secs(3600), secs(60));
    assert_eq!(attempts(&w), tried + 1, "retried within the 1 h cap");
    assert_eq!(status(&w, A), ConnectionStatus::Connected);
    assert_eq!(req_count(&w, A), 4);
    assert_eq!(
        w.m.relay(&url(A)).unwrap().state().repos,
        [repo("r")].into_iter().collect::<HashSet<_>>()
    );
}

/// Injected reports: the world's connections answer at once, so no report of an earlier
/// connection can reach the machine after a newer one started. In the engine it can (a
/// relay's thread ends at `Forget` and a new one is spawned while reports of the old one
/// are still queued), and the machine must ignore it.
#[test]
fn stale_reports_of_an_earlier_connection_are_ignored() {
    let mut w = discovered_slow();
    let old = w.m.relay(&url(A)).unwrap().state().generation;
    let l1 = w.open_subs(A, is_l1)[0].clone();
    w.relay(A).down = true;
    w.drop(A);
    w.advance(secs(10)); // a reconnect attempt (failed) → a new generation
    assert!(w.m.relay(&url(A)).unwrap().state().generation > old);
    assert_eq!(status(&w, A), ConnectionStatus::Disconnected);
    let attempts = w.m.counters().connect_attempts;
    w.inject(Report::Connected {
        relay: url(A),
        generation: old,
    });
    w.inject(Report::Eose {
        relay: url(A),
        generation: old,
        sub_id: l1,
        stats: Default::default(),
    });
    assert_eq!(status(&w, A), ConnectionStatus::Disconnected);
    assert!(w.m.subscriptions(&url(A)).is_empty());
    assert!(w.m.relay(&url(A)).unwrap().state().repos.is_empty());
    assert_eq!(w.m.counters().connect_attempts, attempts);
    assert_eq!(req_count(&w, A), 4, "nothing sent");
}

#[test]
fn quick_reconnect_catches_up_layers_1_2_3_with_since_from_last_connect() {
    let (mut w, _) = synced();
    let connected_at = w.m.relay(&url(A)).unwrap().state().last_connected.unwrap();
    w.advance(secs(600));
    w.relay(A).hold_eose = true;
    let before = req_count(&w, A);
    w.drop(A);
    w.advance(secs(10));
    assert_eq!(status(&w, A), ConnectionStatus::Connected);
    let reqs = reqs_from(&w, A, before);
    // L1 + L2 (3) + L3 (3) live without since, and the same seven as history catch-ups
    // with since = last_connected − 15 min; none pending.
    assert_eq!(reqs.len(), 14);
    let want = connected_at.minus(secs(900)).as_secs();
    let (live, history): (Vec<_>, Vec<_>) = reqs.iter().partition(|f| is_live_only(f));
    assert_eq!((live.len(), history.len()), (7, 7));
    assert!(
        history
            .iter()
            .all(|f| since(f) == Some(want) && f.limit.is_none()),
        "since {want}"
    );
    assert!(is_l1(live[0]) && is_l1(history[0]));
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    assert_eq!(
        w.m.relay(&url(A)).unwrap().state().repos.len(),
        1,
        "confirmed kept"
    );
    let purposes: Vec<SubPurpose> =
        w.m.subscriptions(&url(A))
            .into_iter()
            .map(|x| x.1)
            .collect();
    let count = |want: SubPurpose| purposes.iter().filter(|p| **p == want).count();
    assert_eq!(
        (count(SubPurpose::Live), count(SubPurpose::CatchUp)),
        (6, 7)
    );
    // The catch-ups close at their EOSE; the live set stays.
    w.release_eose(A);
    assert_eq!(w.m.subscriptions(&url(A)).len(), 7);
    let still: Vec<Filter> = fake(&w, A).subs.values().flatten().cloned().collect();
    assert_eq!(still.len(), 7);
    assert!(still.iter().all(is_live_only));
}

#[test]
fn stale_reconnect_after_16_minutes_is_a_fresh_sync() {
    let (mut w, _) = synced();
    // Unreachable for 16 minutes: every attempt fails.
    w.relay(A).down = true;
    w.drop(A);
    let dropped_at = w.now;
    w.run_for(secs(16 * 60), secs(30));
    let before = req_count(&w, A);
    assert_eq!(w.m.relay(&url(A)).unwrap().state().repos.len(), 1);
    let a = w.relay(A);
    a.down = false;
    a.hold_eose = true;
    let attempts = w.m.counters().connect_attempts;
    until_connected(&mut w, A, secs(3600));
    assert!(w.now.since(dropped_at) > secs(16 * 60));
    assert_eq!(w.m.counters().connect_attempts, attempts + 1);
    let reqs = reqs_from(&w, A, before);
    assert!(reqs.iter().all(|f| f.since.is_none()), "fresh: no since");
    assert_eq!(reqs.len(), 7, "L1 + a pending batch of 6");
    assert!(
        w.m.relay(&url(A)).unwrap().state().repos.is_empty(),
        "confirmed cleared"
    );
    assert_eq!(w.m.relay(&url(A)).unwrap().pending().len(), 1);
}

#[test]
fn disconnect_clears_pending_and_items_are_resubscribed() {
    let mut w = discovered_slow();
    assert_eq!(w.m.relay(&url(A)).unwrap().pending().len(), 1);
    let before = req_count(&w, A);
    w.drop(A);
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    w.advance(secs(10));
    assert_eq!(status(&w, A), ConnectionStatus::Connected);
    // Never confirmed → quick reconnect: the interrupted Layer 1 history again (no since),
    // Layer 1 live and its catch-up, and the batch again.
    let reqs = reqs_from(&w, A, before);
    assert_eq!(reqs.len(), 6);
    assert_eq!(reqs[0], build_announcement_filter(None));
    assert_eq!(reqs.iter().filter(|f| is_l1(f)).count(), 3);
    assert_eq!(reqs.iter().filter(|f| is_live_only(f)).count(), 1);
    let batch: HashSet<String> = reqs
        .iter()
        .filter(|f| !is_l1(f))
        .map(Filter::as_json)
        .collect();
    let first: HashSet<String> = fake(&w, A).reqs[1..4].iter().map(Filter::as_json).collect();
    assert_eq!(batch, first, "the same batch again");
    assert_eq!(w.m.relay(&url(A)).unwrap().pending().len(), 1);
}

/// The batch subscriptions (Layers 2/3) open on A.
fn batch_subs(w: &World) -> Vec<SubscriptionId> {
    w.open_subs(A, |f| !is_l1(f))
}

#[test]
fn withheld_eose_fails_the_batch_and_it_is_retried() {
    let mut w = discovered(|c| c.eose_timeout = secs(60), |a| a.hold_eose = true);
    w.release_eose_where(A, is_l1);
    // One subscription answered, two did not.
    w.release_eose_where(A, |f| has_tag(f, 'a'));
    assert_eq!(batch_subs(&w).len(), 3);
    let before = req_count(&w, A);
    w.advance(secs(61));
    assert!(
        batch_subs(&w).is_empty(),
        "all the failed batch's subscriptions are closed"
    );
    assert_eq!(open(&w, A).len(), 1, "only L1 left");
    assert_eq!(w.m.subscriptions(&url(A)).len(), 1);
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    assert_eq!(w.m.counters().batches_failed, 1);
    assert_eq!(req_count(&w, A), before);
    w.advance(secs(30));
    let again = reqs_from(&w, A, before);
    assert_eq!(again.len(), 3, "retried after backoff");
    assert!(again.iter().all(|f| !is_l1(f) && f.since.is_none()));
    assert_eq!(w.m.relay(&url(A)).unwrap().pending().len(), 1);
}

#[test]
fn closed_subscription_fails_its_batch_instead_of_leaving_it_pending() {
    let mut w = discovered_slow();
    w.release_eose_where(A, is_l1);
    let sub = w.open_subs(A, |f| has_tag(f, 'A'))[0].clone();
    let before = req_count(&w, A);
    w.close_sub(A, &sub, "error: shutting down");
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    assert!(
        batch_subs(&w).is_empty(),
        "the batch's other queries closed"
    );
    assert_eq!(w.m.counters().batches_failed, 1);
    // A refused query is tried again after `refused_retry` (10 min).
    w.advance(secs(590));
    assert_eq!(req_count(&w, A), before);
    w.advance(secs(20));
    assert_eq!(reqs_from(&w, A, before).len(), 3);
}

#[test]
fn idle_relay_is_forgotten_but_bootstrap_and_first_sync_relays_are_not() {
    let boot = "ws://boot.example";
    let mut w = world(|c| c.bootstrap = vec![url(boot)]);
    w.relay(boot);
    // A never finishes its first sync.
    w.relay(A).withhold_eose = true;
    w.relay(B);
    w.start();
    assert!(
        fake(&w, boot).conn.is_some(),
        "bootstrap connected at start"
    );
    w.store_on_own(&announcement("r", &[A], 1));
    w.advance(secs(5));
    assert!(fake(&w, A).conn.is_some());
    // First sync in progress (no EOSE) across several checks: kept.
    w.run_for(secs(200), secs(10));
    assert!(w.m.relay(&url(A)).is_some());
    assert!(fake(&w, A).conn.is_some());
    // The announcement moves the repo elsewhere: A is no longer needed.
    w.store_on_own(&announcement("r", &[B], 2));
    // Its unanswered batch keeps it until the batch fails at the EOSE deadline (120 s).
    w.run_for(secs(60), secs(10));
    assert!(w.m.relay(&url(A)).is_some());
    assert!(fake(&w, A).conn.is_some());
    w.run_for(secs(130), secs(10));
    assert!(w.m.relay(&url(A)).is_none());
    assert!(fake(&w, A).conn.is_none(), "its connection closed");
    assert!(w.m.relay(&url(boot)).is_some());
    assert!(fake(&w, boot).conn.is_some(), "bootstrap kept");
    assert!(fake(&w, B).conn.is_some());
}

#[test]
fn self_subscription_reconnect_reads_the_whole_history_again() {
    let mut w = world(|_| {});
    w.relay(A);
    w.start();
    w.advance(secs(3600));
    w.drop(OWN);
    assert_eq!(w.m.own_status(), ConnectionStatus::Disconnected);
    // Stored while the self-subscription is down, with an old created_at (as the
    // forwarder copies old events in): a since would miss it.
    let t = w.secs();
    let old = announcement("old", &[A], t - 86_400);
    w.own.store.push(old.clone());
    w.advance(secs(10));
    assert_eq!(w.m.own_status(), ConnectionStatus::Connected);
    let once = vec![self_subscription_filter(None), own_events_filter()];
    assert_eq!(
        w.own.reqs,
        once.iter().chain(&once).cloned().collect::<Vec<_>>(),
        "the whole history again, no since"
    );
    w.advance(secs(5));
    assert!(w.m.repo_index().contains_key(&repo("old")));
}

/// An injected report: the world's own relay cannot deliver an event of a connection that
/// is gone (its frames stop with it), but the machine's own check of the generation is the
/// defence if an engine's queue ever does.
#[test]
fn events_from_an_old_self_subscription_generation_are_ignored() {
    let mut w = world(|_| {});
    w.relay(A);
    w.start();
    // The first connection (generation 1) is replaced.
    w.drop(OWN);
    w.advance(secs(10));
    assert_eq!(w.m.own_status(), ConnectionStatus::Connected);
    w.inject(Report::SelfEvent {
        generation: 1,
        event: Box::new(announcement("r", &[A], 1)),
    });
    w.advance(secs(10));
    assert!(w.m.repo_index().is_empty());
    assert!(w.m.relays().len() == 0);
    assert!(fake(&w, A).reqs.is_empty());
}

/// A relay carrying one repo and `n` root events, each added in its own batch (confirmed
/// at once).
fn many_batches(n: usize) -> (World, Vec<EventId>) {
    let mut w = discovered(|_| {}, |_| {});
    let mut ids = vec![];
    for i in 0..n {
        let e = issue("r", &format!("issue {i}"), w.secs());
        ids.push(e.id);
        let open_before = open(&w, A);
        w.store_on_own(&e);
        w.advance(secs(5));
        assert!(
            open_before.is_subset(&open(&w, A)),
            "no consolidation yet at batch {i}"
        );
    }
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    (w, ids)
}

#[test]
fn crossing_the_consolidation_threshold_leaves_fewer_subscriptions_and_loses_nothing() {
    let (mut w, ids) = many_batches(22);
    assert_eq!(w.m.subscriptions(&url(A)).len(), 1 + 3 + 22 * 3);
    let settled = open(&w, A);
    assert_eq!(settled.len(), 70);
    let before = req_count(&w, A);
    w.relay(A).hold_eose = true;
    let e = issue("r", "the 23rd", w.secs());
    w.store_on_own(&e);
    w.advance(secs(5));
    assert!(
        settled.is_disjoint(&open(&w, A)),
        "every settled subscription closed"
    );
    let reqs = reqs_from(&w, A, before);
    // L1 + L2 (3) + L3 for 22 roots (3) live, the same seven as catch-ups with since, and
    // the new root's batch (3).
    assert_eq!(reqs.len(), 17);
    assert_eq!(open(&w, A).len(), 17);
    assert_eq!(w.m.subscriptions(&url(A)).len(), 17);
    let want_since = w.now.minus(secs(900)).as_secs();
    let (live, catchup) = (&reqs[..7], &reqs[7..14]);
    assert!(live.iter().all(is_live_only));
    assert!(catchup.iter().all(|f| since(f) == Some(want_since)));
    assert!(is_l1(&live[0]) && is_l1(&catchup[0]));
    let covered: HashSet<String> = live.iter().flat_map(|f| tag_values(f, 'e')).collect();
    let confirmed: HashSet<String> = ids.iter().map(|i| i.to_hex()).collect();
    assert_eq!(
        covered, confirmed,
        "every confirmed root event is still subscribed"
    );
    let new_batch = &reqs[14..];
    assert!(
        new_batch
            .iter()
            .all(|f| f.since.is_none() && !is_live_only(f)),
        "new items get full history"
    );
    assert_eq!(tag_values(&new_batch[0], 'e'), vec![e.id.to_hex()]);
    w.release_eose(A);
    assert_eq!(w.m.relay(&url(A)).unwrap().state().root_events.len(), 23);
    assert!(w
        .m
        .relay(&url(A))
        .unwrap()
        .state()
        .repos
        .contains(&repo("r")));
    assert_eq!(open(&w, A).len(), 10, "the live set and the new batch");
}

#[test]
fn consolidation_waits_for_pending_batches_without_blocking() {
    let (mut w, _) = many_batches(21);
    assert_eq!(open(&w, A).len(), 67);
    w.relay(A).hold_eose = true;
    // Batch 22 (70 open, not above the threshold) stays pending (no EOSE) ...
    let before = req_count(&w, A);
    w.store_on_own(&issue("r", "pending one", w.secs()));
    w.advance(secs(5));
    assert_eq!(reqs_from(&w, A, before).len(), 3);
    let settled = open(&w, A);
    assert_eq!(settled.len(), 70);
    // ... when batch 23 crosses the threshold: deferred, nothing closed yet.
    let before = req_count(&w, A);
    w.store_on_own(&issue("r", "deferred one", w.secs()));
    w.advance(secs(5));
    assert_eq!(open(&w, A), settled);
    assert_eq!(req_count(&w, A), before);
    // The pending batch completes: consolidation runs at once.
    w.release_eose(A);
    assert!(settled.is_disjoint(&open(&w, A)));
    assert_eq!(reqs_from(&w, A, before).len(), 2 * (1 + 3 + 3) + 3);
    assert_eq!(w.m.subscriptions(&url(A)).len(), 17);
}

#[test]
fn consolidation_deadline_keeps_loading_subscriptions_open() {
    let (mut w, _) = many_batches(21);
    let settled = open(&w, A);
    w.relay(A).hold_eose = true;
    let never = issue("r", "never answered", w.secs());
    w.store_on_own(&never);
    w.advance(secs(5));
    let pending: BTreeSet<SubscriptionId> = open(&w, A).difference(&settled).cloned().collect();
    assert_eq!(pending.len(), 3);
    // One of the pending batch's three subscriptions has seen EOSE: it must stay open too,
    // or the batch's items would have no live subscription once it confirms.
    w.release_eose_where(A, |f| has_tag(f, 'e'));
    w.store_on_own(&issue("r", "deferred", w.secs()));
    w.advance(secs(5));
    assert!(settled.is_subset(&open(&w, A)), "deferred");
    // 30 s later the consolidation runs anyway; the unanswered batch stays open.
    w.advance(secs(30));
    let now_open = open(&w, A);
    assert!(settled.is_disjoint(&now_open), "the 67 settled ones closed");
    assert!(pending.is_subset(&now_open), "loading subscriptions kept");
    let machine: BTreeSet<SubscriptionId> =
        w.m.subscriptions(&url(A))
            .into_iter()
            .map(|x| x.0)
            .collect();
    assert!(pending.is_subset(&machine));
    assert_eq!(w.m.relay(&url(A)).unwrap().pending().len(), 2);
}

#[test]
fn daily_timer_does_a_full_fresh_sync_between_23_and_25_hours() {
    let (mut w, root) = synced();
    let start = w.now;
    let settled = open(&w, A);
    assert_eq!(settled.len(), 7);
    let before = req_count(&w, A);
    w.relay(A).hold_eose = true;
    while w.m.counters().daily_resyncs == 0 {
        assert!(w.now.since(start) < secs(26 * 3600), "daily resync fired");
        w.advance(secs(60));
    }
    let h = w.now.since(start).as_secs_f64() / 3600.0;
    assert!((23.0..=25.1).contains(&h), "fired after {h} h");
    assert!(settled.is_disjoint(&open(&w, A)), "L1 + L2 + L3 closed");
    let reqs = reqs_from(&w, A, before);
    assert_eq!(reqs.len(), 7);
    assert!(
        reqs.iter().all(|f| f.since.is_none() && f.limit.is_none()),
        "full history again"
    );
    assert!(
        w.m.relay(&url(A)).unwrap().state().repos.is_empty(),
        "confirmed cleared"
    );
    assert_eq!(w.m.relay(&url(A)).unwrap().pending().len(), 1);
    w.release_eose(A);
    let st = w.m.relay(&url(A)).unwrap().state();
    assert_eq!((st.repos.len(), st.root_events.len()), (1, 1));
    assert!(st.root_events.contains(&root.id));
}

/// Connect attempts so far.
fn attempts(w: &World) -> u64 {
    w.m.counters().connect_attempts
}

#[test]
fn flapping_relay_backoff_grows() {
    let mut w = discovered(|_| {}, |_| {});
    // Every attempt connects and drops a second later: the failure count is never reset.
    let mut gaps = vec![];
    let mut last = w.now;
    for _ in 0..6 {
        assert_eq!(status(&w, A), ConnectionStatus::Connected);
        w.advance(secs(1));
        w.drop(A);
        let n = attempts(&w);
        while attempts(&w) == n {
            w.advance(secs(1));
        }
        gaps.push(w.now.since(last).as_secs());
        last = w.now;
    }
    // 5 s × 2^(n−1) ± 25 % (+1 s connected each time).
    for (i, g) in gaps.iter().enumerate() {
        let base = 5u64 << i;
        assert!(
            *g as f64 >= base as f64 * 0.75 && *g as f64 <= base as f64 * 1.25 + 3.0,
            "gap {i} = {g} s, base {base} s ({gaps:?})"
        );
    }
    assert!(gaps.windows(2).all(|w| w[1] > w[0]), "{gaps:?}");
}

#[test]
fn dead_after_24_hours_then_one_attempt_a_day() {
    let mut w = discovered(|_| {}, |a| a.down = true);
    let start = w.now;
    let mut gaps = vec![];
    let mut last = w.now;
    while gaps.len() < 40 {
        let n = attempts(&w);
        w.advance(secs(60));
        if attempts(&w) > n {
            gaps.push(w.now.since(last));
            last = w.now;
        }
    }
    let mut at = Duration::ZERO;
    let mut daily = 0;
    for g in &gaps {
        if at < secs(24 * 3600) {
            // Degraded: exponential backoff capped at 1 h (+25 % jitter, 60 s steps).
            assert!(*g <= secs(4500 + 60), "gap {g:?} at {at:?}: {gaps:?}");
        } else {
            // Dead: once a day (+10 % jitter).
            assert!(*g >= secs(24 * 3600), "gap {g:?} at {at:?}");
            assert!(*g <= secs(26 * 3600 + 60), "gap {g:?} at {at:?}");
            daily += 1;
        }
        at += *g;
    }
    assert!(daily >= 3, "{gaps:?}");
    assert_eq!(w.m.relay_statuses(w.now)[0].health, HealthState::Dead);
    assert!(w.now.since(start) > secs(4 * 24 * 3600));
    assert!(fake(&w, A).reqs.is_empty());
    // It comes back: a fresh sync, and healthy again once stable.
    w.relay(A).down = false;
    let n = attempts(&w);
    until_connected(&mut w, A, secs(27 * 3600));
    assert_eq!(attempts(&w), n + 1);
    assert_eq!(req_count(&w, A), 4);
    assert!(fake(&w, A).reqs.iter().all(|f| f.since.is_none()));
    w.advance(secs(120));
    assert_eq!(w.m.relay_statuses(w.now)[0].health, HealthState::Healthy);
    assert_eq!(
        w.m.relay(&url(A)).unwrap().state().repos,
        [repo("r")].into_iter().collect::<HashSet<_>>()
    );
}

/// An event of `kind` tagging repository `r`, created at `created_at`.
fn tagged(kind: u16, text: &str, created_at: u64) -> Event {
    EventBuilder::new(Kind::Custom(kind), text)
        .tag(Tag::parse(["a", &repo("r")]).unwrap())
        .custom_created_at(Timestamp::from_secs(created_at))
        .finalize(&keys())
        .unwrap()
}

#[test]
fn capped_self_subscription_pages_with_until() {
    let mut w = world(|c| c.assumed_page_size = 20);
    w.relay(A);
    // The own relay answers at most 20 events a REQ and does not say so.
    w.own.default_limit = Some(20);
    let mut anns: Vec<Event> = (0..20)
        .map(|i| announcement(&format!("n{i}"), &[A], 1000 + 50 * i))
        .collect();
    anns.extend([900, 950, 999].map(|t| announcement(&format!("o{t}"), &[A], t)));
    w.own.store = anns.clone();
    w.start();
    let page = self_subscription_filter(None).until(Timestamp::from_secs(1000));
    let events_page = own_events_filter().until(Timestamp::from_secs(1000));
    assert_eq!(
        w.own.reqs,
        vec![
            self_subscription_filter(None),
            page,
            own_events_filter(),
            events_page
        ],
        "a full page: the next one ends at its oldest second, same kinds (the announcements \
         and root events first, then the self-subscription's every event, paged alike)"
    );
    // The short page ends it and is closed; the live self-subscription stays.
    let still: Vec<&Filter> = w.own.subs.values().flatten().collect();
    assert_eq!(still, vec![&own_events_filter()]);
    assert_eq!(w.m.own_open_subscriptions(), 1);
    assert_eq!(w.m.counters().pages_requested, 2);
    w.advance(secs(5));
    for a in &anns {
        let d = a.tags.identifier().unwrap();
        assert!(w.m.repo_index().contains_key(&repo(d.as_ref())), "{d} read");
    }
}

#[test]
fn self_subscription_pages_stay_within_the_own_relays_budget() {
    let mut w = world(|c| {
        c.assumed_page_size = 10;
        c.default_subscription_budget = 3;
    });
    w.relay(A);
    w.own.default_limit = Some(10);
    // A full page in one second (two events of each of the filter's five kinds) and two
    // older announcements: split by the five kinds, plus the older seconds.
    let mut events = vec![announcement("x", &[A], 500), announcement("y", &[A], 500)];
    for kind in [1617, 1618, 1619, 1621] {
        for i in 0..2 {
            events.push(tagged(kind, &format!("{kind}/{i}"), 500));
        }
    }
    events.push(announcement("old1", &[A], 400));
    events.push(announcement("old2", &[A], 450));
    w.own.store = events;
    w.start();
    assert_eq!(
        w.own.max_open_seen, 3,
        "self-subscription + 2 pages = budget 3"
    );
    let all = reqs_from(&w, OWN, 1);
    assert_eq!(
        all.len(),
        13,
        "the first read's pages, the self-subscription, and its pages"
    );
    // The self-subscription (every event) opens once the first read's pages are read; it is
    // paged the same way.
    assert_eq!(all[6], own_events_filter());
    for pages in [&all[..6], &all[7..]] {
        assert_eq!(until(&pages[0]), Some(499));
        let kinds: BTreeSet<u16> = pages[1..]
            .iter()
            .inspect(|f| assert_eq!((since(f), until(f)), (Some(500), Some(500))))
            .flat_map(|f| f.kinds.clone().unwrap())
            .map(|k| k.as_u16())
            .collect();
        assert_eq!(kinds, [30617, 1617, 1618, 1619, 1621].into());
    }
    assert_eq!(w.m.own_open_subscriptions(), 1);
    w.advance(secs(5));
    for d in ["x", "y", "old1", "old2"] {
        assert!(w.m.repo_index().contains_key(&repo(d)), "{d} read");
    }
}

#[test]
fn batch_waits_for_its_pages_before_confirming() {
    let mut w = world(|_| {});
    let t = w.secs();
    let issues: Vec<Event> = (0..25)
        .map(|i| issue("r", &format!("old {i}"), t - 100 + i))
        .collect();
    let a = w.relay(A);
    a.store = issues.clone();
    // 20 events a REQ, not published: the engine assumes 20.
    a.default_limit = Some(20);
    a.hold_eose = true;
    w.start();
    let ann = announcement("r", &[A], t);
    w.store_on_own(&ann);
    w.advance(secs(5));
    assert_eq!(req_count(&w, A), 4, "L1 + the batch");
    // L1 and two of the three batch filters answer short; the #a filter is full.
    w.release_eose_where(A, |f| is_l1(f) || has_tag(f, 'A') || has_tag(f, 'q'));
    assert!(w.m.relay(&url(A)).unwrap().state().repos.is_empty());
    let before = req_count(&w, A);
    w.release_eose_where(A, |f| has_tag(f, 'a'));
    let pages = reqs_from(&w, A, before);
    assert_eq!(pages.len(), 1);
    assert_eq!(
        until(&pages[0]),
        Some(t - 95),
        "ends at the page's oldest second"
    );
    assert_eq!(tag_values(&pages[0], 'a'), vec![repo("r")]);
    // Pages finish before the batch may confirm.
    assert!(
        w.m.relay(&url(A)).unwrap().state().repos.is_empty(),
        "not before the page"
    );
    assert_eq!(w.m.relay(&url(A)).unwrap().pending().len(), 1);
    w.release_eose_where(A, |f| f.until.is_some());
    assert_eq!(
        w.m.relay(&url(A)).unwrap().state().repos,
        [repo("r")].into_iter().collect::<HashSet<_>>()
    );
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    let mut want: Vec<&Event> = issues.iter().collect();
    want.push(&ann);
    w.assert_own_holds(&want);
}

#[test]
fn rate_limited_closed_waits_the_cooldown_then_resubscribes() {
    let mut w = discovered_slow();
    let sub = w.open_subs(A, |f| has_tag(f, 'A'))[0].clone();
    let before = req_count(&w, A);
    w.close_sub(A, &sub, "rate-limited: slow down");
    assert_eq!(w.m.counters().rate_limited, 1);
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    // Not before 65 s ...
    w.advance(secs(60));
    assert_eq!(req_count(&w, A), before);
    // ... then the batch's items again.
    w.advance(secs(10));
    let again = reqs_from(&w, A, before);
    assert_eq!(again.len(), 3);
    assert!(again.iter().all(|f| !is_l1(f)));
}

#[test]
fn closed_layer1_is_reopened_not_silently_gone() {
    let mut w = discovered(|_| {}, |_| {});
    let l1 = w.open_subs(A, is_l1);
    assert_eq!(l1.len(), 1, "Layer 1 stays open after its history");
    w.close_sub(A, &l1[0], "error: shutting down idle subscriptions");
    let closed_at = w.now;
    assert!(!w
        .m
        .subscriptions(&url(A))
        .iter()
        .any(|(id, _)| *id == l1[0]));
    let before = req_count(&w, A);
    w.advance(secs(300));
    assert_eq!(req_count(&w, A), before);
    w.advance(secs(301));
    let again = reqs_from(&w, A, before);
    // Live again (no since) plus a catch-up from the moment it was lost.
    assert_eq!(again.len(), 2);
    assert!(again.iter().all(is_l1));
    assert!(is_live_only(&again[0]));
    assert_eq!(since(&again[1]), Some(closed_at.minus(secs(900)).as_secs()));
    assert!(w
        .m
        .subscriptions(&url(A))
        .iter()
        .any(|(_, p)| *p == SubPurpose::Announcements));
    assert_eq!(w.open_subs(A, is_l1).len(), 1, "open on the relay again");
}

#[test]
fn refused_batch_fails_and_is_retried_much_later() {
    for prefix in [
        "restricted:",
        "blocked:",
        "invalid:",
        "unsupported:",
        "error:",
        "auth-required:",
        "weird",
    ] {
        let mut w = discovered_slow();
        w.release_eose_where(A, is_l1);
        let sub = w.open_subs(A, |f| has_tag(f, 'q'))[0].clone();
        let before = req_count(&w, A);
        w.close_sub(A, &sub, &format!("{prefix} no"));
        assert!(
            w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()),
            "{prefix}"
        );
        assert_eq!(w.m.counters().batches_failed, 1, "{prefix}");
        w.advance(secs(590));
        assert_eq!(req_count(&w, A), before, "{prefix}");
        w.advance(secs(20));
        assert_eq!(reqs_from(&w, A, before).len(), 3, "{prefix}");
    }
}

#[test]
fn rate_limit_notice_pauses_new_subscriptions() {
    let mut w = discovered(|_| {}, |_| {});
    w.notice(A, "ERROR: too many concurrent REQs");
    let before = req_count(&w, A);
    w.store_on_own(&issue("r", "new", w.secs()));
    w.advance(secs(5));
    assert_eq!(req_count(&w, A), before, "paused");
    w.advance(secs(65));
    assert_eq!(
        reqs_from(&w, A, before).len(),
        3,
        "resumed after the cool-down"
    );
    // Another kind of NOTICE changes nothing.
    let before = req_count(&w, A);
    w.notice(A, "hello");
    w.store_on_own(&issue("r", "newer", w.secs()));
    w.advance(secs(5));
    assert_eq!(reqs_from(&w, A, before).len(), 3, "not paused");
    assert_eq!(w.m.counters().rate_limited, 1);
}

#[test]
fn subscription_budget_is_never_exceeded_and_every_item_syncs() {
    // The relay closes any REQ beyond five open subscriptions, without saying so in NIP-11;
    // the engine's default budget is five.
    let mut w = discovered(
        |c| c.default_subscription_budget = 5,
        |a| a.max_subs = Some(5),
    );
    let ann = w.own.store[0].clone();
    let mut roots = vec![];
    let mut replies = vec![];
    // 250 root events, in 25 batches of 10: 9 Layer-3 filters at the end. A holds a reply
    // to each.
    for b in 0..25 {
        for i in 0..10 {
            let t = w.secs();
            let e = issue("r", &format!("issue {b}/{i}"), t);
            let r = reply(&e, &format!("reply {b}/{i}"), t);
            w.relay(A).store.push(r.clone());
            w.store_on_own(&e);
            roots.push(e);
            replies.push(r);
        }
        w.advance(secs(5));
    }
    // Let consolidation deadlines and polls run.
    w.run_for(secs(300), secs(30));
    let st = w.m.relay(&url(A)).unwrap().state();
    // Every Layer-3 id: the root events and the replies followed below them.
    let ids: HashSet<EventId> = roots.iter().chain(&replies).map(|e| e.id).collect();
    assert_eq!(st.root_events, ids, "every root event and reply confirmed");
    assert_eq!(st.repos, [repo("r")].into_iter().collect::<HashSet<_>>());
    assert!(w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()));
    assert!(fake(&w, A).max_open_seen <= 5);
    assert_eq!(w.m.counters().closed_by_relay, 0, "no REQ refused");
    // Live: Layer 1 + 3 queries; the other Layer-2/3 queries are polled with since.
    let before = req_count(&w, A);
    w.advance(secs(60));
    let polls = reqs_from(&w, A, before);
    assert!(!polls.is_empty(), "a poll round runs");
    assert!(polls.iter().all(|f| f.since.is_some()));
    assert!(polls.iter().any(|f| !tag_values(f, 'e').is_empty()));
    // A reply published now to the last root arrives (live or by a poll round).
    let late = reply(&roots[249], "late", w.secs());
    w.publish(A, &late);
    w.run_for(secs(120), secs(30));
    let mut want: Vec<&Event> = roots.iter().chain(&replies).collect();
    want.push(&ann);
    want.push(&late);
    w.assert_own_holds(&want);
    assert!(fake(&w, A).max_open_seen <= 5);
}

#[test]
fn nip11_max_subscriptions_sets_the_budget() {
    let mut w = discovered(
        |_| {},
        |a| {
            a.max_subs = Some(3);
            a.publish_nip11 = true;
            a.hold_eose = true;
        },
    );
    assert_eq!(w.m.budget(&url(A)), 3);
    // L1 + the batch's 3 filters, but only 3 at a time.
    assert_eq!(req_count(&w, A), 3);
    for _ in 0..10 {
        w.release_eose(A);
    }
    let reqs = reqs_from(&w, A, 0);
    assert!(is_l1(&reqs[0]));
    assert!(
        reqs[1..4].iter().all(|f| !is_l1(f) && f.since.is_none()),
        "the whole batch sent in the end"
    );
    // Then the live set within the budget (one slot kept for history); the rest polled.
    assert!(fake(&w, A).max_open_seen <= 3);
    assert!(open(&w, A).len() <= 2);
    assert_eq!(w.m.counters().closed_by_relay, 0);
    assert_eq!(
        w.m.relay(&url(A)).unwrap().state().repos,
        [repo("r")].into_iter().collect::<HashSet<_>>()
    );
}

#[test]
fn reqs_are_split_below_nip11_max_message_length() {
    let mut w = world(|_| {});
    let a = w.relay(A);
    a.max_message_length = Some(2000);
    a.publish_nip11 = true;
    w.start();
    // 60 repositories on one relay: one #a filter of 60 refs would be ~5 KB.
    let t = w.secs();
    for i in 0..60 {
        w.store_on_own(&announcement(&format!("r{i}"), &[A], t));
    }
    w.advance(secs(5));
    let reqs = reqs_from(&w, A, 0);
    let mut refs: HashSet<String> = HashSet::default();
    for f in &reqs {
        // The longest subscription id the machine makes: `gs` and ten digits.
        let req = format!("[\"REQ\",\"gs0123456789\",{}]", f.as_json());
        assert!(req.len() <= 2000, "REQ of {} bytes", req.len());
        refs.extend(tag_values(f, 'a'));
    }
    assert_eq!(refs.len(), 60, "every repository still asked for");
    assert!(reqs.len() > 4, "split into more filters");
    assert_eq!(w.m.relay(&url(A)).unwrap().state().repos.len(), 60);
}

#[test]
fn a_query_without_eose_is_sent_again_not_left_loading() {
    // Layer 1 never gets EOSE (a relay dropped it silently); the batch answers.
    let mut w = discovered(|_| {}, |a| a.no_eose_kind = Some(30617));
    let l1 = w.open_subs(A, is_l1);
    assert_eq!(l1.len(), 1);
    assert!(
        w.m.relay(&url(A)).is_none_or(|r| r.pending().is_empty()),
        "the batch answered"
    );
    let before = req_count(&w, A);
    w.advance(secs(100));
    assert_eq!(req_count(&w, A), before);
    // Answered next time.
    w.relay(A).no_eose_kind = None;
    w.advance(secs(30));
    assert!(!open(&w, A).contains(&l1[0]), "the silent one closed");
    let again = reqs_from(&w, A, before);
    assert_eq!(
        again,
        vec![build_announcement_filter(None)],
        "the same query"
    );
    assert_eq!(w.m.counters().queries_resent, 1);
    let before = req_count(&w, A);
    w.advance(secs(300));
    assert_eq!(req_count(&w, A), before, "nothing more");
    assert_eq!(w.m.counters().queries_resent, 1);
}

#[test]
fn during_a_rate_limit_cool_down_nothing_is_sent_to_the_relay() {
    let mut w = world(|_| {});
    let t = w.secs();
    let anns: Vec<Event> = (0..25)
        .map(|i| announcement(&format!("x{i}"), &[A], t - 1000 + 10 * i))
        .collect();
    let a = w.relay(A);
    // 20 events a REQ, not published: the engine assumes 20.
    a.default_limit = Some(20);
    a.hold_eose = true;
    a.store = anns.clone();
    w.start();
    w.store_on_own(&announcement("r", &[A], t));
    w.advance(secs(5));
    let before = req_count(&w, A);
    w.notice(A, "rate limit exceeded");
    // Layer 1 comes back full: its next page must wait for the cool-down (and so must the
    // batches for the repositories it announced).
    w.release_eose_where(A, is_l1);
    w.advance(secs(60));
    assert_eq!(req_count(&w, A), before, "held during the cool-down");
    w.advance(secs(6));
    let sent = reqs_from(&w, A, before);
    let pages: Vec<&Filter> = sent.iter().filter(|f| is_l1(f)).collect();
    assert_eq!(pages.len(), 1, "sent when the cool-down ends");
    // The 20 newest of the 25 announcements: the oldest of them is x5.
    assert_eq!(until(pages[0]), Some(t - 1000 + 50));
}

#[test]
fn no_more_remote_relays_than_max_relays() {
    let mut w = world(|c| c.max_relays = 3);
    let relays: Vec<String> = (0..5).map(|i| format!("ws://r{i}.example")).collect();
    for r in &relays {
        w.relay(r);
    }
    w.start();
    for (i, r) in relays.iter().enumerate() {
        w.store_on_own(&announcement(&format!("r{i}"), &[r.as_str()], 1));
    }
    w.advance(secs(5));
    assert_eq!(w.relays.values().filter(|f| f.conn.is_some()).count(), 3);
    assert_eq!(w.m.relays().len(), 3);
    assert_eq!(w.m.target_report().relays_over_global_cap, 2);
}

/// Injected reports: [`Report::ForwardBackPressure`] comes from the engine's forwarder,
/// not from a relay; the world has no forward queue, so it is handed over as the engine
/// does.
#[test]
fn eose_deadlines_are_suspended_while_the_forward_queue_is_full() {
    let mut w = discovered_slow();
    w.release_eose_where(A, is_l1);
    let batch = batch_subs(&w);
    assert_eq!(batch.len(), 3);
    // The batch has not seen EOSE when the own relay stops taking events.
    w.advance(secs(60));
    w.inject(Report::ForwardBackPressure { active: true });
    w.advance(secs(600));
    assert_eq!(
        batch_subs(&w),
        batch,
        "nothing fails while remote reading is paused"
    );
    assert_eq!(w.m.counters().batches_failed, 0);
    w.inject(Report::ForwardBackPressure { active: false });
    // The deadline resumes where it stopped: 60 s were used, 60 s are left.
    w.advance(secs(55));
    assert_eq!(batch_subs(&w), batch);
    w.advance(secs(10));
    assert!(batch_subs(&w).is_empty(), "then the batch fails as usual");
    assert_eq!(w.m.counters().batches_failed, 1);
}

/// Issue 19, item 5: a relay thread waiting for the forward pipeline's byte bound reads
/// nothing from its relay, like a full queue: that relay's EOSE deadlines are suspended
/// ([`Report::RelayStalled`], from the engine's relay thread).
#[test]
fn eose_deadlines_are_suspended_while_the_relays_thread_waits_for_the_byte_bound() {
    let mut w = discovered_slow();
    w.release_eose_where(A, is_l1);
    let batch = batch_subs(&w);
    assert_eq!(batch.len(), 3);
    let url = RelayUrl::parse(A).unwrap();
    let generation = w.m.relay(&url).unwrap().state().generation;
    w.advance(secs(60));
    w.inject(Report::RelayStalled {
        relay: url.clone(),
        generation,
        active: true,
    });
    w.advance(secs(600));
    assert_eq!(
        batch_subs(&w),
        batch,
        "nothing fails while the relay is not read"
    );
    assert_eq!(w.m.counters().batches_failed, 0);
    w.inject(Report::RelayStalled {
        relay: url.clone(),
        generation,
        active: false,
    });
    // The deadline resumes where it stopped: 60 s were used, 60 s are left.
    w.advance(secs(55));
    assert_eq!(batch_subs(&w), batch);
    w.advance(secs(10));
    assert!(batch_subs(&w).is_empty(), "then the batch fails as usual");
    assert_eq!(w.m.counters().batches_failed, 1);
    // A report of an earlier connection changes nothing.
    w.inject(Report::RelayStalled {
        relay: url,
        generation: generation.wrapping_sub(1),
        active: true,
    });
    assert!(!w.m.is_stalled(&RelayUrl::parse(A).unwrap()));
}

#[test]
fn rejected_events_are_retried_only_for_what_a_batch_changed() {
    let mut w = world(|_| {});
    w.relay(A);
    w.start();
    let t = w.secs();
    w.store_on_own(&announcement("r", &[A], t));
    w.advance(secs(5));
    assert_eq!(w.retries, vec![(vec![repo("r")], vec![])]);
    let root = issue("r", "a root", t);
    w.store_on_own(&root);
    w.advance(secs(5));
    assert_eq!(w.retries[1..], [(vec![], vec![root.id])]);
    // The same events read again (an own-relay reconnect re-reads everything) change
    // nothing: no retry.
    w.drop(OWN);
    w.run_for(secs(30), secs(5));
    assert_eq!(
        w.own.reqs.len(),
        4,
        "read again: the announcements and root events, then every event"
    );
    assert_eq!(w.retries.len(), 2);
}

#[test]
fn relays_beyond_the_announcement_cap_are_counted() {
    let mut w = world(|_| {});
    w.start();
    let many: Vec<String> = (0..40).map(|i| format!("ws://r{i}.example")).collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    w.store_on_own(&announcement("r", &refs, 10));
    w.advance(secs(5));
    assert_eq!(w.m.counters().announcement_relays_dropped, 8);
    assert_eq!(w.m.repo_index()[&repo("r")].relays.len(), 32);
}

#[test]
fn root_events_are_counted_once_whatever_their_repositories_and_rereads() {
    let mut w = world(|_| {});
    w.relay(A);
    w.relay(B);
    w.start();
    let t = w.secs();
    w.store_on_own(&announcement("r", &[A], t));
    w.store_on_own(&announcement("q", &[B], t));
    // One root of both repositories, one of r only, one naming no known repository yet.
    let both = EventBuilder::new(Kind::Custom(1621), "both")
        .tag(Tag::parse(["a", &repo("r")]).unwrap())
        .tag(Tag::parse(["a", &repo("q")]).unwrap())
        .finalize(&keys())
        .unwrap();
    w.store_on_own(&both);
    w.store_on_own(&issue("r", "only r", t));
    w.store_on_own(&issue("later", "before its announcement", t));
    w.advance(secs(5));
    assert_eq!(w.m.root_event_count(), 3);
    // The own relay read again (a reconnect re-reads everything): nothing new.
    w.drop(OWN);
    w.run_for(secs(30), secs(5));
    assert_eq!(
        w.own.reqs.len(),
        6,
        "read again: the announcements and root events, then every event, each short page probed once for a hidden cap (decision 0103)"
    );
    assert_eq!(w.m.root_event_count(), 3);
    w.store_on_own(&issue("q", "a new one", t));
    w.advance(secs(5));
    assert_eq!(w.m.root_event_count(), 4);
}

/// Departure (issue 21): the design applies the self-subscription's events when the batch
/// window (5 s from the first event) closes. Once the stored history is read to its end
/// (every page), it is applied at once: the window only ever waits for live events, and a
/// first sync no longer starts seconds late.
#[test]
fn the_stored_history_is_applied_when_read_to_its_end_not_when_the_window_closes() {
    let mut w = World::new("ws://own.example", |_| {});
    let t = w.secs();
    // 25 repositories; the own relay answers at most 10 events per REQ: three pages.
    for i in 0..25u64 {
        w.own.store.push(announcement(
            &format!("r{i}"),
            &["ws://a.example"],
            t - 1000 - i,
        ));
    }
    w.own.max_limit = Some(10);
    w.own.publish_nip11 = true;
    w.relay("ws://a.example");
    w.start();
    assert_eq!(w.m.repo_index().len(), 25, "every page, applied at once");
    assert_eq!(w.m.counters().self_batches, 1);
    assert!(!w.m.self_sync_pending());
    // Live events still wait for the window.
    let late = announcement("late", &["ws://a.example"], t);
    w.store_on_own(&late);
    w.advance(secs(1));
    assert_eq!(
        w.m.repo_index().len(),
        25,
        "a live event waits for its window"
    );
    w.advance(secs(5));
    assert_eq!(w.m.repo_index().len(), 26);
}

#[test]
fn history_queries_pending_count_down_to_completed_at_their_eose() {
    // Progress (core/progress.rs): a relay's history queries are pending from their REQ to
    // their EOSE, then counted as completed.
    let (mut w, _) = synced();
    let st = |w: &World| w.m.relay_statuses(w.now)[0].clone();
    let done_before = st(&w).history_queries_completed;
    assert!(done_before > 0, "the first sync completed queries");
    assert_eq!(st(&w).history_queries_pending, 0);
    w.relay(A).hold_eose = true;
    w.drop(A);
    w.advance(secs(10));
    assert_eq!(status(&w, A), ConnectionStatus::Connected);
    let pending = st(&w).history_queries_pending;
    // The quick reconnect's seven catch-ups wait for their EOSE; its seven live-only REQs
    // carry no history and are not counted.
    assert_eq!(pending, 7);
    assert_eq!(st(&w).history_queries_completed, done_before);
    assert_eq!(st(&w).batches_retry_at, None);
    w.release_eose(A);
    assert_eq!(st(&w).history_queries_pending, 0);
    assert_eq!(
        st(&w).history_queries_completed,
        done_before + pending as u64
    );
}

#[test]
fn commands_route_to_the_relay_they_name_and_collect_ids_to_the_own_relay() {
    // One mapping for the coordinator and the World (issue 35, item 2).
    use crate::core::session::Control;
    use crate::core::sync::{Command, Route};
    let (own, a) = (url(OWN), url(A));
    let sub = SubscriptionId::new("s");
    let routed = Command::CollectIds {
        generation: 3,
        sub_id: sub.clone(),
        filter: Filter::new(),
    }
    .route(&own);
    assert!(
        matches!(&routed, Route::Relay(r, Control::CollectIds { generation: 3, .. }) if *r == own),
        "{routed:?}"
    );
    let routed = Command::Unsubscribe {
        relay: a.clone(),
        generation: 1,
        sub_id: sub,
    }
    .route(&own);
    assert!(
        matches!(&routed, Route::Relay(r, Control::Unsubscribe { generation: 1, .. }) if *r == a),
        "{routed:?}"
    );
    assert!(matches!(
        Command::Connect {
            relay: a.clone(),
            generation: 2
        }
        .route(&own),
        Route::Connect { generation: 2, .. }
    ));
    assert!(matches!(
        Command::Forget { relay: a }.route(&own),
        Route::Forget(_)
    ));
}
