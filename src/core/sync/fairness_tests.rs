//! Fair shares and bounded work under a flood of throw-away keys (issue 20, items 1, 2
//! and 4), in simulated time: relays that never complete a connect lose their slots,
//! repositories that show life go first, refusals cost one selection per
//! [`super::RESELECT_DELAY`], and one host gets a few URLs at most.

use crate::core::hash::HashSet;
use std::time::Duration;

use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;

use super::world::{announcement, issue, reply, World};
use super::{Command, Report};
use crate::shared::RelayUrl;

const OWN: &str = "ws://own.example";
const A: &str = "ws://a.example";
const B: &str = "ws://b.example";
const DAY: u64 = 86_400;

/// An announcement of `d` by `keys` listing `relays`.
fn announcement_by(keys: &Keys, d: &str, relays: &[String], created_at: u64) -> Event {
    let mut t = vec!["relays".to_string()];
    t.extend(relays.iter().cloned());
    EventBuilder::new(Kind::Custom(30617), "")
        .tag(Tag::parse(["d", d]).expect("d tag"))
        .tag(Tag::parse(t).expect("relays tag"))
        .custom_created_at(nostr::types::Timestamp::from_secs(created_at))
        .finalize(keys)
        .expect("signed")
}

/// An issue of `keys`'s repository `d`.
fn issue_by(keys: &Keys, d: &str, created_at: u64) -> Event {
    let repo = format!("30617:{}:{d}", keys.public_key().to_hex());
    EventBuilder::new(Kind::Custom(1621), "spam")
        .tag(Tag::parse(["a", &repo]).expect("a tag"))
        .custom_created_at(nostr::types::Timestamp::from_secs(created_at))
        .finalize(keys)
        .expect("signed")
}

/// A world with `flood` throw-away keys, each announcing one repository on its own relay
/// that never completes a connect (and, with `spam_life`, an issue of it so it shows life
/// too), beside a legitimate repository on A and B with an issue and replies. At most
/// `max_relays` remote relays.
fn flooded(flood: usize, spam_life: bool, max_relays: usize) -> (World, HashSet<EventId>) {
    flooded_with(flood, spam_life, max_relays, 1)
}

/// [`flooded`] with `issues` issues on the legitimate repository.
fn flooded_with(
    flood: usize,
    spam_life: bool,
    max_relays: usize,
    issues: usize,
) -> (World, HashSet<EventId>) {
    let mut w = World::new(OWN, |c| c.max_relays = max_relays);
    let t = w.secs();
    for i in 0..flood {
        let k = Keys::generate();
        let dead = format!("ws://dead{i}.example");
        w.own.store.push(announcement_by(&k, "x", &[dead], t - DAY));
        if spam_life {
            w.own.store.push(issue_by(&k, "x", t - DAY));
        }
    }
    let ann = announcement("legit", &[A, B], t - 30 * DAY);
    let root = issue("legit", "a bug", t - 20 * DAY);
    w.own.store.push(ann.clone());
    w.own.store.push(root.clone());
    for i in 1..issues {
        w.own
            .store
            .push(issue("legit", &format!("bug {i}"), t - 20 * DAY + i as u64));
    }
    let mut want = HashSet::default();
    for (n, relay) in [A, B].into_iter().enumerate() {
        let fake = w.relay(relay);
        fake.store.push(ann.clone());
        fake.store.push(root.clone());
        for r in 0..20u64 {
            let e = reply(&root, &format!("reply {n}/{r}"), t - 10 * DAY + r);
            want.insert(e.id);
            w.relay(relay).store.push(e);
        }
    }
    (w, want)
}

fn missing(w: &World, want: &HashSet<EventId>) -> usize {
    let have: HashSet<EventId> = w.own.store.iter().map(|e| e.id).collect();
    want.difference(&have).count()
}

#[test]
fn throwaway_keys_on_dead_relays_cannot_starve_a_repository_that_shows_life() {
    // 150 keys without life against 20 slots: the repository with an issue goes first.
    let (mut w, want) = flooded(150, false, 20);
    w.start();
    // Right after the first batch (5 s window), before any failing relay gave up a slot.
    w.advance(Duration::from_secs(6));
    for relay in [A, B] {
        let url = RelayUrl::parse(relay).unwrap();
        assert!(w.m.relay(&url).is_some(), "{relay} has a slot at once");
    }
    w.advance(Duration::from_secs(54));
    assert_eq!(missing(&w, &want), 0, "the legitimate repository is synced");
    assert!(w.m.relays().len() <= 20, "{}", w.m.relays().len());
    assert!(
        w.m.target_report().relays_over_global_cap > 0,
        "the cap binds"
    );
}

#[test]
fn relays_that_never_connect_give_their_slots_to_relays_not_tried_yet() {
    // The throw-away repositories show life too (an issue each) and name one relay each,
    // so they come before the legitimate one (two relays) in the round-robin: only the
    // failing relays moving behind lets it in.
    let (mut w, want) = flooded(150, true, 20);
    w.start();
    w.advance(Duration::from_secs(60));
    assert_eq!(missing(&w, &want), 0, "the legitimate repository is synced");
    assert!(w.m.relays().len() <= 20);
    // Without the rotation it would wait for ever: the same 20 dead relays retrying.
    let dead_tried = w.m.standing.failing.len();
    assert!(dead_tried >= 40, "dead relays tried in turn: {dead_tried}");
}

#[test]
fn refusals_cost_one_selection_per_delay_and_a_key_is_blocked_at_its_cap() {
    // One key names 10,000 relays (over 400 announcements of 25): the engine refuses every
    // one it connects.
    let mut w = World::new(OWN, |_| {});
    let t = w.secs();
    let k = Keys::generate();
    for a in 0..400 {
        let relays: Vec<String> = (0..25)
            .map(|i| format!("ws://refused{}.example", a * 25 + i))
            .collect();
        w.own
            .store
            .push(announcement_by(&k, &format!("r{a}"), &relays, t - DAY));
    }
    let ann = announcement("legit", &[A], t - 30 * DAY);
    w.own.store.push(ann.clone());
    w.relay(A).store.push(ann);
    w.start();
    let selections = w.m.counters().selections;
    let mut refused = 0usize;
    // Refuse every connect of a refusedN relay, as the engine's address policy would.
    for _ in 0..50 {
        let connects: Vec<(RelayUrl, u64)> =
            w.m.relays()
                .filter(|r| r.url().host().starts_with("refused"))
                .map(|r| (r.url().clone(), r.state().generation))
                .collect();
        for (relay, generation) in connects {
            refused += 1;
            w.inject(Report::Refused {
                relay,
                generation,
                reason: crate::shared::Refusal::Denied {
                    pattern: "test".into(),
                },
            });
        }
        w.advance(Duration::from_secs(2));
    }
    let c = w.m.counters();
    assert_eq!(c.pubkeys_blocked, 1, "the key is blocked");
    // The first round connects its 64 relays (the per-pubkey quota); they are refused at
    // once and the key is blocked: nothing more of it is connected.
    assert!(refused <= 64, "refused {refused}");
    assert_eq!(c.relays_excluded as usize, refused);
    // The 64 refusals (one report each) ran the selection a few times, not 64.
    let ran = c.selections - selections;
    assert!(ran <= 3, "selections run for {refused} refusals: {ran}");
    assert!(w.m.relay(&RelayUrl::parse(A).unwrap()).is_some());
    assert!(w.m.relays().all(|r| !r.url().host().starts_with("refused")));
}

#[test]
fn urls_differing_in_query_or_path_reach_one_host_a_few_times_at_most() {
    // 8 keys each announce 8 spellings of one relay: 64 URLs, one host and port.
    let mut w = World::new(OWN, |_| {});
    let t = w.secs();
    let mut all = Vec::new();
    for k in 0..8 {
        let keys = Keys::generate();
        let relays: Vec<String> = (0..8)
            .map(|i| format!("ws://one.example/?{}", k * 8 + i))
            .collect();
        all.extend(relays.clone());
        w.own
            .store
            .push(announcement_by(&keys, "x", &relays, t - DAY));
    }
    for u in &all {
        w.relay(u);
    }
    w.start();
    w.advance(Duration::from_secs(30));
    let one =
        w.m.relays()
            .map(|r| r.url())
            .filter(|u| u.host() == "one.example")
            .count();
    assert_eq!(one, crate::core::targets::MAX_URLS_PER_HOST);
    assert_eq!(
        w.m.target_report().relays_over_host_cap,
        64 - crate::core::targets::MAX_URLS_PER_HOST
    );
    let hosts = w.m.hosts_with_several_urls();
    assert_eq!(hosts, vec![("one.example:80".to_string(), 4)]);
    // No Connect to any other spelling was ever queued.
    assert!(w
        .m
        .poll_command()
        .is_none_or(|c| !matches!(c, Command::Connect { .. })));
}

#[test]
fn the_repository_with_more_activity_comes_first_in_each_round() {
    // The throw-away repositories have one issue each, the legitimate one five: its pubkey
    // is in a higher tier, so it takes the first slot of every round of the round-robin
    // (one relay per pubkey and round: activity orders a round, it does not buy all of
    // them, issue 36), and its second relay once the black holes have failed.
    let (mut w, want) = flooded_with(150, true, 20, 5);
    w.start();
    w.advance(Duration::from_secs(6));
    let (a, b) = (RelayUrl::parse(A).unwrap(), RelayUrl::parse(B).unwrap());
    assert!(
        w.m.relay(&a).is_some() || w.m.relay(&b).is_some(),
        "a slot at once"
    );
    w.advance(Duration::from_secs(60));
    assert_eq!(missing(&w, &want), 0);
    assert_eq!(crate::core::targets::activity(0), 0);
    assert_eq!(crate::core::targets::activity(1), 1);
    assert_eq!(crate::core::targets::activity(5), 3);
    assert_eq!(crate::core::targets::activity(usize::MAX), 11);
}

#[test]
fn bought_activity_does_not_take_every_slot_above_a_real_repository() {
    // Issue 36, item 10, scaled down (the report: 16 keys × 64 silent relays and 1,024
    // issues against 1,000 slots): 16 throw-away keys, each announcing two repositories on
    // 4 relays that accept connections and stay silent, with 4 cheap issues each (a higher
    // tier), against a real repository with one issue on A and B; 100 slots. Tiers used to
    // run to their end one after the other: the 128 bought relays took every slot. Now each
    // round gives every pubkey showing life one relay.
    let mut w = World::new(OWN, |c| c.max_relays = 100);
    let t = w.secs();
    for k in 0..16 {
        let keys = Keys::generate();
        for (d, half) in [("x", 0), ("y", 4)] {
            let relays: Vec<String> = (half..half + 4)
                .map(|i| format!("ws://k{k}r{i}.example"))
                .collect();
            for r in &relays {
                w.relay(r).withhold_eose = true;
            }
            w.own
                .store
                .push(announcement_by(&keys, d, &relays, t - DAY));
            for n in 0..4 {
                w.own.store.push(issue_by(&keys, d, t - DAY + n));
            }
        }
    }
    let ann = announcement("legit", &[A, B], t - 30 * DAY);
    let root = issue("legit", "a bug", t - 20 * DAY);
    w.own.store.push(ann.clone());
    w.own.store.push(root.clone());
    let mut want = HashSet::default();
    for relay in [A, B] {
        w.relay(relay).store.extend([ann.clone(), root.clone()]);
        let e = reply(&root, relay, t - 10 * DAY);
        want.insert(e.id);
        w.relay(relay).store.push(e);
    }
    w.start();
    w.advance(Duration::from_secs(30));
    for relay in [A, B] {
        let url = RelayUrl::parse(relay).unwrap();
        assert!(w.m.relay(&url).is_some(), "{relay} has a slot");
    }
    assert_eq!(missing(&w, &want), 0, "the real repository is synced");
    assert!(w.m.relays().len() <= 100);
}
