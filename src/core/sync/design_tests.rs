//! The design's behaviours of [`SyncMachine`](super::SyncMachine), on the simulated world
//! ([`super::world`]): fake relays with stores and faults talk to real relay sessions in JSON
//! frames, and the machine sees only what the sessions report. Each test checks what the
//! relays received (`reqs`, the subscriptions open on them), what the own relay holds, the
//! machine's read API and the timing.
//!
//! Two tests hand the machine a report directly (`World::inject`), each saying why: a report
//! of a connection generation that is no longer current cannot come out of the world (its
//! connections answer synchronously), but the machine's defence against it is worth keeping.
//! The forwarder's back-pressure report comes from the engine, not from a relay, and is
//! injected as the engine would send it.

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::filter::Filter;
use nostr::message::SubscriptionId;
use nostr::types::Timestamp;

use super::world::{announcement, is_l1, issue, keys, reply, repo, FakeRelay, World};
use crate::core::filters::{
    build_announcement_filter, build_layer2_and_layer3_filters, self_subscription_filter,
};
use crate::core::health::HealthState;
use crate::core::state::ConnectionStatus;
use crate::core::sync::{Report, SubPurpose, SyncConfig};
use crate::shared::url::RelayUrl;

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
    w.m.relay_index()[&url(relay)].connection_status
}

/// Own relay connected (its empty history read), one announcement of repository `r` on A,
/// batch window passed: A is connected and subscribed. `relay` sets up A first.
fn discovered(cfg: impl FnOnce(&mut SyncConfig), relay: impl FnOnce(&mut FakeRelay)) -> World {
    let mut w = world(cfg);
    relay(w.relay(A));
    w.start();
    assert_eq!(
        w.own.reqs,
        vec![self_subscription_filter(None)],
        "the first self-subscription has no since"
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
        assert!(w.now.since(start) < max, "{relay} not connected within {max:?}");
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
    let st = &w.m.relay_index()[&url(A)];
    assert_eq!(st.repos, [repo("r")].into());
    assert_eq!(st.root_events, [root.id].into());
    assert!(!w.m.pending_index().contains_key(&url(A)));
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
    assert!(w.relays.values().all(|f| f.conn.is_none() && f.reqs.is_empty()));
    assert!(w.m.relay_index().is_empty());
    // 5 s after the FIRST event, not the second.
    w.advance(secs(2));
    assert!(w.relays.values().all(|f| f.conn.is_some()));
    let known: BTreeSet<RelayUrl> = w.m.relay_index().keys().cloned().collect();
    assert_eq!(known, [url(A), url(B)].into());
    assert_eq!(w.m.repo_index().len(), 2);
}

#[test]
fn fresh_sync_subscribes_l1_without_since_then_layers_2_3_as_a_batch() {
    let mut w = discovered_slow();
    assert_eq!(status(&w, A), ConnectionStatus::Connected);
    let reqs = reqs_from(&w, A, 0);
    assert_eq!(reqs.len(), 4, "L1 + a/A/q");
    assert_eq!(reqs[0], build_announcement_filter(None), "L1 first, no since");
    let want: HashSet<String> =
        build_layer2_and_layer3_filters(&[repo("r")].into(), &HashSet::new(), None)
            .iter()
            .map(Filter::as_json)
            .collect();
    let got: HashSet<String> = reqs[1..].iter().map(Filter::as_json).collect();
    assert_eq!(got, want, "the batch: full history, no since");
    assert_eq!(w.m.pending_index()[&url(A)].len(), 1);
    w.release_eose_where(A, is_l1);
    // Not confirmed until every batch subscription saw EOSE.
    for (i, tag) in ['a', 'A', 'q'].into_iter().enumerate() {
        assert!(w.m.relay_index()[&url(A)].repos.is_empty(), "after {i} EOSEs");
        assert_eq!(w.m.pending_index()[&url(A)].len(), 1);
        w.release_eose_where(A, |f| has_tag(f, tag));
    }
    let st = &w.m.relay_index()[&url(A)];
    assert_eq!(st.repos, [repo("r")].into());
    assert!(!w.m.pending_index().contains_key(&url(A)));
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
            &[iss.id.to_hex()].into()
        );
        assert!(f.since.is_none() && f.limit.is_none(), "full history");
    }
    // The same event read again (an own-relay reconnect re-reads everything): nothing new.
    let before = req_count(&w, A);
    w.drop(OWN);
    w.run_for(secs(30), secs(5));
    assert_eq!(w.m.own_status(), ConnectionStatus::Connected);
    assert_eq!(w.own.reqs.len(), 2, "read again");
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
    assert_eq!(w.m.repo_index()[&repo("r")].relays, HashSet::from([url(B)]));
    assert!(!fake(&w, B).reqs.is_empty(), "B synced");
    w.store_on_own(&announcement("r", &[c], 150));
    w.advance(secs(5));
    assert_eq!(w.m.repo_index()[&repo("r")].relays, HashSet::from([url(B)]));
    assert!(fake(&w, c).reqs.is_empty() && fake(&w, c).conn.is_none());
    assert!(!w.m.relay_index().contains_key(&url(c)));
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
    let known: Vec<RelayUrl> = w.m.relay_index().keys().cloned().collect();
    assert_eq!(known, vec![url(A)]);
    assert!(fake(&w, alias).conn.is_none() && fake(&w, alias).reqs.is_empty());
    assert_eq!(
        w.own.reqs,
        vec![self_subscription_filter(None)],
        "the own relay is only self-subscribed"
    );
    assert_eq!(req_count(&w, A), 4);
}

#[test]
fn failed_first_connect_is_retried_with_backoff() {
    let mut w = discovered(|_| {}, |a| a.down = true);
    assert_eq!(status(&w, A), ConnectionStatus::Disconnected);
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
    assert_eq!(w.m.relay_index()[&url(A)].repos, [repo("r")].into());
}

/// Injected reports: the world's connections answer at once, so no report of an earlier
/// connection can reach the machine after a newer one started. In the engine it can (a
/// relay's thread ends at `Forget` and a new one is spawned while reports of the old one
/// are still queued), and the machine must ignore it.
#[test]
fn stale_reports_of_an_earlier_connection_are_ignored() {
    let mut w = discovered_slow();
    let old = w.m.relay_index()[&url(A)].generation;
    let l1 = w.open_subs(A, is_l1)[0].clone();
    w.relay(A).down = true;
    w.drop(A);
    w.advance(secs(10)); // a reconnect attempt (failed) → a new generation
    assert!(w.m.relay_index()[&url(A)].generation > old);
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
    assert!(w.m.relay_index()[&url(A)].repos.is_empty());
    assert_eq!(w.m.counters().connect_attempts, attempts);
    assert_eq!(req_count(&w, A), 4, "nothing sent");
}

#[test]
fn quick_reconnect_catches_up_layers_1_2_3_with_since_from_last_connect() {
    let (mut w, _) = synced();
    let connected_at = w.m.relay_index()[&url(A)].last_connected.unwrap();
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
        history.iter().all(|f| since(f) == Some(want) && f.limit.is_none()),
        "since {want}"
    );
    assert!(is_l1(live[0]) && is_l1(history[0]));
    assert!(!w.m.pending_index().contains_key(&url(A)));
    assert_eq!(w.m.relay_index()[&url(A)].repos.len(), 1, "confirmed kept");
    let purposes: Vec<SubPurpose> = w.m.subscriptions(&url(A)).into_iter().map(|x| x.1).collect();
    let count = |want: SubPurpose| purposes.iter().filter(|p| **p == want).count();
    assert_eq!(
        (count(SubPurpose::Live), count(SubPurpose::CatchUp)),
        (6, 7)
    );
    // The catch-ups close at their EOSE; the live set stays.
    w.release_eose(A);
    assert_eq!(w.m.subscriptions(&url(A)).len(), 7);
    let still: Vec<Filter> = fake(&w, A).subs.values().cloned().collect();
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
    assert_eq!(w.m.relay_index()[&url(A)].repos.len(), 1);
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
        w.m.relay_index()[&url(A)].repos.is_empty(),
        "confirmed cleared"
    );
    assert_eq!(w.m.pending_index()[&url(A)].len(), 1);
}

#[test]
fn disconnect_clears_pending_and_items_are_resubscribed() {
    let mut w = discovered_slow();
    assert_eq!(w.m.pending_index()[&url(A)].len(), 1);
    let before = req_count(&w, A);
    w.drop(A);
    assert!(!w.m.pending_index().contains_key(&url(A)));
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
    assert_eq!(w.m.pending_index()[&url(A)].len(), 1);
}
