//! Several filters per REQ and the incremental live set (decision 0110), in simulated time
//! against fake relays ([`super::world`]); every test compares the *set* of events on the
//! own relay with the expected set.

use std::time::Duration;

use nostr::event::Event;
use nostr::filter::Filter;

use super::world::{announcement, issue, reply, Nip77Mode, SimProfile, World};
use crate::shared::RelayUrl;

const OWN: &str = "ws://own.example";
const A: &str = "ws://a.example";
const DAY: u64 = 86_400;

/// Repository `r` announced on A with `issues` issues on A, and one root issue (on the own
/// relay and A) with `replies` replies on A; every event at its own second.
fn repo_with_history(w: &mut World, issues: usize, replies: usize) -> Vec<Event> {
    let t = w.secs();
    let ann = announcement("r", &[A], t - 10 * DAY);
    let root = issue("r", "the root", t - 5 * DAY);
    w.own.store.push(ann.clone());
    w.own.store.push(root.clone());
    let mut all = vec![ann, root];
    for i in 0..issues {
        all.push(issue("r", &format!("issue {i}"), t - 4 * DAY + i as u64));
    }
    for i in 0..replies {
        all.push(reply(
            &all[1],
            &format!("reply {i}"),
            t - 3 * DAY + i as u64,
        ));
    }
    w.relay(A).store.extend(all.iter().cloned());
    all
}

#[test]
fn each_filter_of_a_packed_req_is_paged_past_its_cap_and_every_event_arrives() {
    let mut w = World::new(OWN, |_| {});
    let all = repo_with_history(&mut w, 12, 12);
    let a = w.relay(A);
    // A REQ-only relay that returns at most 5 events per filter (strfry caps each filter
    // of a REQ on its own).
    a.max_limit = Some(5);
    a.max_subs = Some(20);
    a.publish_nip11 = true;
    a.nip77 = Nip77Mode::Off;
    w.start();
    w.run_for(Duration::from_secs(10 * 60), Duration::from_secs(30));
    let a = &w.relays[&RelayUrl::parse(A).unwrap()];
    assert!(
        a.max_filters_seen >= 2,
        "the batch's filters went out together"
    );
    assert!(
        a.req_messages < a.reqs.len(),
        "{} REQs for {} filters",
        a.req_messages,
        a.reqs.len()
    );
    w.assert_own_holds(&all.iter().collect::<Vec<_>>());
}

#[test]
fn a_relay_refusing_multi_filter_reqs_is_learnt_and_nothing_is_lost() {
    for nip77 in [Nip77Mode::Off, Nip77Mode::On] {
        let mut w = World::new(OWN, |_| {});
        let all = repo_with_history(&mut w, 7, 7);
        let a = w.relay(A);
        a.profile(SimProfile::SingleFilter);
        a.max_limit = Some(5);
        a.publish_nip11 = true;
        a.nip77 = nip77;
        w.start();
        w.run_for(Duration::from_secs(10 * 60), Duration::from_secs(30));
        assert_eq!(w.m.counters().multi_filter_refusals, 1, "{nip77:?}");
        w.assert_own_holds(&all.iter().collect::<Vec<_>>());
        // Learnt: from then on one filter per REQ, live ones included.
        let a = RelayUrl::parse(A).unwrap();
        let before = w.relays[&a].req_messages;
        let late = reply(&all[1], "late", w.secs());
        w.publish(A, &late);
        w.drop(A);
        w.run_for(Duration::from_secs(5 * 60), Duration::from_secs(30));
        let f = &w.relays[&a];
        assert!(
            f.req_messages > before,
            "{nip77:?}: the reconnect subscribed again"
        );
        assert_eq!(
            w.m.counters().multi_filter_refusals,
            1,
            "{nip77:?}: refused once"
        );
        let mut want: Vec<&Event> = all.iter().collect();
        want.push(&late);
        w.assert_own_holds(&want);
    }
}

#[test]
fn packed_reqs_stay_within_the_relays_subscription_budget() {
    let mut w = World::new(OWN, |_| {});
    let t = w.secs();
    let mut all = Vec::new();
    for r in 0..60 {
        let d = format!("r{r}");
        let ann = announcement(&d, &[A], t - 10 * DAY + r);
        w.own.store.push(ann.clone());
        all.push(ann);
        for i in 0..3u64 {
            let root = issue(&d, &format!("{d} root {i}"), t - 5 * DAY + r * 10 + i);
            w.own.store.push(root.clone());
            all.push(reply(&root, "a reply", t - 4 * DAY + r * 10 + i));
            all.push(root);
        }
    }
    let a = w.relay(A);
    a.profile(SimProfile::Strfry);
    // A budget that binds (nos.lol's is 20 for far more data); history read by REQ
    // (reconciled history sends its fetches by `ids`, one per REQ).
    a.max_subs = Some(4);
    // Pages of 3: many pages at once, packed and paced.
    a.max_limit = Some(3);
    a.nip77 = Nip77Mode::Off;
    a.advertise_nip77 = false;
    a.store.extend(all.iter().cloned());
    w.start();
    w.run_for(Duration::from_secs(15 * 60), Duration::from_secs(30));
    let f = &w.relays[&RelayUrl::parse(A).unwrap()];
    assert!(f.max_open_seen <= 4, "{} open", f.max_open_seen);
    assert_eq!(f.too_many_sent, 0);
    assert!(f.max_filters_seen >= 2);
    w.assert_own_holds(&all.iter().collect::<Vec<_>>());
}

/// Values of the tag conditions of `f`.
fn values(f: &Filter) -> Vec<&String> {
    f.generic_tags.values().flatten().collect()
}

#[test]
fn a_new_root_at_the_budget_grows_its_live_chunk_instead_of_rebuilding_the_live_set() {
    // New items past 2 open REQs make the relay build its live set (a small stand-in for a
    // relay at its budget of 20).
    let mut w = World::new(OWN, |c| c.consolidation_threshold = 2);
    let t = w.secs();
    let ann = announcement("r", &[A], t - 10 * DAY);
    w.own.store.push(ann.clone());
    w.relay(A).store.push(ann.clone());
    let mut roots = Vec::new();
    for i in 0..20 {
        let root = issue("r", &format!("root {i}"), t - DAY + i);
        w.own.store.push(root.clone());
        roots.push(root);
    }
    let a = w.relay(A);
    a.max_subs = Some(8);
    a.publish_nip11 = true;
    w.start();
    w.run_for(Duration::from_secs(10 * 60), Duration::from_secs(30));
    // A first new root crosses the budget: the live set is built (one rebuild).
    let first = issue("r", "the first new one", w.secs());
    w.store_on_own(&first);
    w.run_for(Duration::from_secs(5 * 60), Duration::from_secs(30));
    let a = RelayUrl::parse(A).unwrap();
    assert_eq!(w.m.relay_statuses(w.now)[0].polled_queries, 0);
    let consolidations = w.m.counters().consolidations;
    let resent = w.m.counters().live_chunks_resent;
    let reqs = w.relays[&a].reqs.len();
    let new = issue("r", "the new one", w.secs());
    w.store_on_own(&new);
    w.run_for(Duration::from_secs(5 * 60), Duration::from_secs(30));
    assert_eq!(w.m.counters().consolidations, consolidations, "no rebuild");
    assert!(w.m.counters().live_chunks_resent > resent);
    // What went out since: the new root's batch, its catch-up and the chunks that grew
    // (each holding the new root id and the old ones of its chunk); never the old root ids
    // of a chunk that did not change.
    let sent = &w.relays[&a].reqs[reqs..];
    let new_id = new.id.to_hex();
    let grown: Vec<&Filter> = sent
        .iter()
        .filter(|f| f.limit == Some(0) && values(f).contains(&&new_id))
        .collect();
    assert!(!grown.is_empty(), "{sent:?}");
    for f in sent {
        let vs = values(f);
        assert!(
            vs.contains(&&new_id) || vs.iter().all(|v| v.contains(':')),
            "a query without the new root re-sent: {f:?}"
        );
    }
    // The grown chunk is live: a reply to the new root arrives, as one to an old root.
    let r_new = reply(&new, "on the new root", w.secs());
    let r_old = reply(&roots[3], "on an old root", w.secs());
    w.publish(A, &r_new);
    w.publish(A, &r_old);
    w.advance(Duration::from_secs(5));
    let mut want: Vec<&Event> = vec![&ann, &first, &new, &r_new, &r_old];
    want.extend(roots.iter());
    w.assert_own_holds(&want);
    assert!(w.relays[&a].max_open_seen <= 8);
}

/// An event of kind 1111 with the tags `tags` (name, value), created at `created_at`.
fn tagged(tags: &[(&str, &str)], text: &str, created_at: u64) -> Event {
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    let mut b = EventBuilder::new(Kind::Custom(1111), text)
        .custom_created_at(nostr::types::Timestamp::from_secs(created_at));
    for (name, value) in tags {
        b = b.tag(Tag::parse([*name, *value]).expect("tag"));
    }
    b.finalize(&super::world::keys()).expect("signed")
}

#[test]
fn an_older_match_sent_for_another_filter_of_the_req_does_not_move_a_filters_page() {
    // The relay answers `#e` with its newest 4 and `#E` with its one match, older than
    // everything; that one matches `#e` too. Paging `#e` from it would skip the `#e` events
    // between its fourth newest and that one.
    let mut w = World::new(OWN, |_| {});
    let all = repo_with_history(&mut w, 0, 0);
    let root = all[1].id.to_hex();
    let t = w.secs() - 2 * DAY;
    let mut want: Vec<Event> = all.clone();
    for i in 0..6 {
        want.push(tagged(&[("e", &root)], &format!("e {i}"), t + 100 + i));
    }
    want.push(tagged(&[("e", &root)], "between", t + 60));
    want.push(tagged(&[("e", &root), ("E", &root)], "both", t + 50));
    let a = w.relay(A);
    a.store.extend(want[2..].iter().cloned());
    a.max_limit = Some(4);
    a.publish_nip11 = true;
    a.nip77 = Nip77Mode::Off;
    w.start();
    w.run_for(Duration::from_secs(10 * 60), Duration::from_secs(30));
    assert!(w.relays[&RelayUrl::parse(A).unwrap()].max_filters_seen >= 2);
    w.assert_own_holds(&want.iter().collect::<Vec<_>>());
}

#[test]
fn a_live_req_grown_in_place_stays_within_the_relays_max_message_length() {
    // A strfry with a small `max_message_length` (nos.lol publishes 131,072 bytes and holds
    // thousands of roots; the same at a tenth of the size): new roots grow the live chunks
    // in place, and a REQ of several grown chunks is sent again whole. A frame longer than
    // the limit drops the connection (strfry does so without a word), and every drop costs
    // a reconnect with its backoff.
    const MAX: usize = 20_000;
    let mut w = World::new(OWN, |c| c.consolidation_threshold = 2);
    let t = w.secs();
    let ann = announcement("r", &[A], t - 10 * DAY);
    w.own.store.push(ann.clone());
    w.relay(A).store.push(ann.clone());
    let mut all = vec![ann];
    for i in 0..150 {
        let root = issue("r", &format!("root {i}"), t - 2 * DAY + i);
        w.own.store.push(root.clone());
        all.push(root);
    }
    let a = w.relay(A);
    a.profile(SimProfile::Strfry);
    a.max_subs = Some(20);
    a.max_message_length = Some(MAX);
    w.start();
    w.run_for(Duration::from_secs(10 * 60), Duration::from_secs(30));
    let resent = w.m.counters().live_chunks_resent;
    // New roots in three batches, each joining the live set.
    for b in 0..3u64 {
        for i in 0..120u64 {
            let root = issue("r", &format!("new root {b}/{i}"), w.secs() - 1_000 + i);
            w.store_on_own(&root);
            all.push(root);
        }
        w.run_for(Duration::from_secs(2 * 60), Duration::from_secs(10));
    }
    assert!(
        w.m.counters().live_chunks_resent > resent,
        "the live chunks grew in place"
    );
    let url = RelayUrl::parse(A).unwrap();
    let f = &w.relays[&url];
    assert_eq!(
        f.oversized_frames, 0,
        "frames over {MAX} bytes (the longest {})",
        f.max_frame_seen
    );
    // Live on every root, old and new: a reply to each of a few arrives at once.
    let mut replies = Vec::new();
    for k in [0, 100, 200, 300, 400] {
        replies.push(reply(&all[1 + k], &format!("on root {k}"), w.secs()));
    }
    for r in &replies {
        w.publish(A, r);
    }
    w.advance(Duration::from_secs(5));
    all.extend(replies);
    w.assert_own_holds(&all.iter().collect::<Vec<_>>());
}
