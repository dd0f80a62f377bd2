//! Reply chains below root events (issue 34, decision 0097), on the simulated world: a reply
//! that tags only its parent, its reply, and so on, is synced however it is tagged (a legacy
//! NIP-10 `e`, a NIP-22 comment on the parent, a `q` quote), from history and live, down to
//! the reply-depth bound and within the thread-size bound; deletions, user grasp lists and
//! fork announcements as decisions 0098–0100 say. Every check compares id sets on the own
//! relay, never counts.

use std::collections::BTreeSet;
use std::time::Duration;

use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;
use nostr::types::Timestamp;

use super::world::{announcement, issue, keys, repo, World};
use crate::core::sync::SyncConfig;
use crate::shared::RelayUrl;

const OWN: &str = "ws://own.example";
const A: &str = "ws://a.example";
const B: &str = "ws://b.example";

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn world(cfg: impl FnOnce(&mut SyncConfig)) -> World {
    World::new(OWN, |c| {
        c.default_subscription_budget = 1000;
        cfg(c);
    })
}

/// How a reply names its parent.
#[derive(Debug, Clone, Copy)]
enum Style {
    /// A legacy NIP-10 reply (kind 1): `["e", parent, "", "reply"]` and nothing else.
    Legacy,
    /// A NIP-22 comment (kind 1111) on the parent itself: `E`/`K` and `e`/`k` both name it.
    Nip22,
    /// A quote (kind 1): `["q", parent]` only.
    Quote,
}

const STYLES: [Style; 3] = [Style::Legacy, Style::Nip22, Style::Quote];

/// A reply to `parent` in `style`, tagging nothing else, signed by `by`.
fn reply_to(style: Style, parent: &Event, text: &str, at: u64, by: &Keys) -> Event {
    let p = parent.id.to_hex();
    let k = parent.kind.as_u16().to_string();
    let (kind, tags): (u16, Vec<Vec<&str>>) = match style {
        Style::Legacy => (1, vec![vec!["e", &p, "", "reply"]]),
        Style::Nip22 => (
            1111,
            vec![vec!["E", &p], vec!["K", &k], vec!["e", &p], vec!["k", &k]],
        ),
        Style::Quote => (1, vec![vec!["q", &p]]),
    };
    let mut b =
        EventBuilder::new(Kind::Custom(kind), text).custom_created_at(Timestamp::from_secs(at));
    for t in tags {
        b = b.tag(Tag::parse(t).unwrap());
    }
    b.finalize(by).unwrap()
}

/// A chain of `n` replies below `root`, each tagging only the one before.
fn chain(style: Style, root: &Event, n: usize, at: u64) -> Vec<Event> {
    let mut out: Vec<Event> = Vec::new();
    for i in 0..n {
        let parent = out.last().unwrap_or(root).clone();
        out.push(reply_to(
            style,
            &parent,
            &format!("{style:?} generation {}", i + 1),
            at + i as u64,
            &keys(),
        ));
    }
    out
}

fn ids(events: &[&Event]) -> BTreeSet<EventId> {
    events.iter().map(|e| e.id).collect()
}

/// Noise a relay holds that is not related: a note and a reply chain below it.
fn noise(at: u64) -> Vec<Event> {
    let stranger = Keys::generate();
    let note = EventBuilder::new(Kind::Custom(1), "unrelated")
        .custom_created_at(Timestamp::from_secs(at))
        .finalize(&stranger)
        .unwrap();
    let r = reply_to(Style::Legacy, &note, "unrelated reply", at + 1, &stranger);
    vec![note, r]
}

#[test]
fn a_reply_chain_four_deep_is_synced_from_history_by_id() {
    for style in STYLES {
        let mut w = world(|_| {});
        let t = w.secs();
        let ann = announcement("r", &[A, B], t - 1000);
        let root = issue("r", "the root", t - 900);
        let c = chain(style, &root, 4, t - 800);
        w.own.store = vec![ann.clone(), root.clone()];
        // Generations alternate between the two relays: each is reachable only from its
        // parent, found on the other relay.
        let (mut on_a, mut on_b) = (noise(t - 700), noise(t - 600));
        for (i, e) in c.iter().enumerate() {
            if i % 2 == 0 {
                on_a.push(e.clone());
            } else {
                on_b.push(e.clone());
            }
        }
        w.relay(A).store = on_a;
        w.relay(B).store = on_b;
        w.start();
        w.run_for(secs(120), secs(5));
        let want = ids(&[&ann, &root, &c[0], &c[1], &c[2], &c[3]]);
        assert_eq!(w.own_ids(), want, "{style:?}");
        for e in &c {
            assert!(w.m.threads().is_member(&e.id), "{style:?}: followed");
        }
    }
}

#[test]
fn a_reply_chain_four_deep_is_synced_live_by_id() {
    for style in STYLES {
        let mut w = world(|_| {});
        let t = w.secs();
        let ann = announcement("r", &[A, B], t - 1000);
        let root = issue("r", "the root", t - 900);
        w.own.store = vec![ann.clone(), root.clone()];
        w.relay(A);
        w.relay(B);
        w.start();
        w.run_for(secs(60), secs(5));
        let c = chain(style, &root, 4, w.secs());
        // Generation 1 on A, then 2 on B once 1 is known.
        w.publish(A, &c[0]);
        w.run_for(secs(30), secs(5));
        w.publish(B, &c[1]);
        w.run_for(secs(30), secs(5));
        // Generation 4 reaches B before the machine knows generation 3 (published on A the
        // same moment): it is found by the history of generation 3's query.
        w.publish(A, &c[2]);
        w.publish(B, &c[3]);
        w.publish(B, &noise(w.secs())[1]);
        w.run_for(secs(60), secs(5));
        let want = ids(&[&ann, &root, &c[0], &c[1], &c[2], &c[3]]);
        assert_eq!(w.own_ids(), want, "{style:?}");
        // And the next reply, live on A, arrives through the live set.
        let c5 = reply_to(style, &c[3], "generation 5", w.secs(), &keys());
        w.publish(A, &c5);
        w.run_for(secs(30), secs(5));
        assert!(w.own_ids().contains(&c5.id), "{style:?}: generation 5 live");
    }
}

#[test]
fn a_chain_deeper_than_the_reply_depth_stops_there_and_is_counted() {
    let mut w = world(|c| c.threads.max_depth = 3);
    let t = w.secs();
    let ann = announcement("r", &[A], t - 1000);
    let root = issue("r", "the root", t - 900);
    let c = chain(Style::Legacy, &root, 6, t - 800);
    w.own.store = vec![ann.clone(), root.clone()];
    w.relay(A).store = c.clone();
    w.start();
    w.run_for(secs(180), secs(5));
    // Generations 1–3 are followed; 4 tags a followed reply, so it is synced, and is not
    // followed; 5 and 6 are not related within the bound.
    let want = ids(&[&ann, &root, &c[0], &c[1], &c[2], &c[3]]);
    assert_eq!(w.own_ids(), want);
    assert_eq!(w.m.counters().replies_beyond_depth, 1);
    assert_eq!(w.m.thread_event_count(), 3);
}

#[test]
fn a_thread_larger_than_its_bound_is_bounded_and_counted() {
    let mut w = world(|c| c.threads.max_per_thread = 3);
    let t = w.secs();
    let ann = announcement("r", &[A], t - 1000);
    let root = issue("r", "the root", t - 900);
    // Five replies on the root (oldest first), each with one reply that tags only it.
    let direct: Vec<Event> = (0..5)
        .map(|i| {
            reply_to(
                Style::Legacy,
                &root,
                &format!("reply {i}"),
                t - 800 + i,
                &keys(),
            )
        })
        .collect();
    let below: Vec<Event> = direct
        .iter()
        .enumerate()
        .map(|(i, r)| {
            reply_to(
                Style::Legacy,
                r,
                &format!("below {i}"),
                t - 700 + i as u64,
                &keys(),
            )
        })
        .collect();
    w.own.store = vec![ann.clone(), root.clone()];
    let a = w.relay(A);
    a.store = direct.clone();
    a.store.extend(below.iter().cloned());
    w.start();
    w.run_for(secs(120), secs(5));
    // Every direct reply tags the root (Layer 3); the three oldest are the thread's members,
    // so only their replies are fetched.
    let mut want: Vec<&Event> = vec![&ann, &root];
    want.extend(direct.iter());
    want.extend(below[..3].iter());
    assert_eq!(w.own_ids(), ids(&want));
    assert_eq!(w.m.thread_event_count(), 3);
    // Not followed for the bound: the two younger direct replies, and the three replies
    // below the members (fetched, the thread full).
    assert_eq!(w.m.counters().replies_thread_full, 5);
}

#[test]
fn a_deletion_of_a_followed_reply_is_synced_and_not_followed() {
    let mut w = world(|_| {});
    let t = w.secs();
    let ann = announcement("r", &[A], t - 1000);
    let root = issue("r", "the root", t - 900);
    let c = chain(Style::Legacy, &root, 2, t - 800);
    let deletion = EventBuilder::new(Kind::Custom(5), "")
        .tag(Tag::parse(["e", &c[1].id.to_hex()]).unwrap())
        .tag(Tag::parse(["k", "1"]).unwrap())
        .custom_created_at(Timestamp::from_secs(t - 700))
        .finalize(&keys())
        .unwrap();
    // Something tagging the deletion is not related: a deletion is not followed.
    let on_deletion = reply_to(Style::Legacy, &deletion, "on a deletion", t - 600, &keys());
    w.own.store = vec![ann.clone(), root.clone()];
    w.relay(A).store = vec![c[0].clone(), c[1].clone(), deletion.clone(), on_deletion];
    w.start();
    w.run_for(secs(120), secs(5));
    assert_eq!(w.own_ids(), ids(&[&ann, &root, &c[0], &c[1], &deletion]));
    assert!(!w.m.threads().is_member(&deletion.id));
}

#[test]
fn user_grasp_lists_are_synced_with_the_announcements() {
    let mut w = world(|_| {});
    let t = w.secs();
    let ann = announcement("r", &[A], t - 1000);
    let stranger = Keys::generate();
    let list = EventBuilder::new(Kind::Custom(10317), "")
        .tag(Tag::parse(["g", "wss://git.example.com"]).unwrap())
        .custom_created_at(Timestamp::from_secs(t - 500))
        .finalize(&stranger)
        .unwrap();
    w.own.store = vec![ann.clone()];
    w.relay(A).store = vec![list.clone()];
    w.start();
    w.run_for(secs(60), secs(5));
    assert_eq!(w.own_ids(), ids(&[&ann, &list]));
    // Live too.
    let newer = EventBuilder::new(Kind::Custom(10317), "")
        .tag(Tag::parse(["g", "wss://other.example.com"]).unwrap())
        .custom_created_at(Timestamp::from_secs(w.secs()))
        .finalize(&stranger)
        .unwrap();
    w.publish(A, &newer);
    assert!(w.own_ids().contains(&newer.id));
}

#[test]
fn a_fork_announcement_tagging_its_upstream_with_u_is_an_announcement_like_any_other() {
    const C: &str = "ws://c.example";
    // Only repositories listing this service are synced (GRASP-01).
    let mut w = world(|c| {
        c.target_limits.scope =
            crate::core::targets::RepoScope::ListingService(vec![RelayUrl::parse(OWN).unwrap()]);
    });
    let t = w.secs();
    let ann = announcement("r", &[OWN, A], t - 1000);
    let root = issue("r", "the root", t - 900);
    let forker = Keys::generate();
    let fork_of = |relays: &[&str], d: &str| {
        let mut r = vec!["relays".to_string()];
        r.extend(relays.iter().map(|s| s.to_string()));
        EventBuilder::new(Kind::Custom(30617), "")
            .tag(Tag::parse(["d", d]).unwrap())
            .tag(Tag::parse(r).unwrap())
            .tag(Tag::parse(["u", &repo("r")]).unwrap())
            .custom_created_at(Timestamp::from_secs(t - 800))
            .finalize(&forker)
            .unwrap()
    };
    // A fork that does not list this service, and one that does.
    let elsewhere = fork_of(&[C], "r");
    let here = fork_of(&[OWN, B], "r-here");
    let fork_issue = |d: &str| {
        EventBuilder::new(Kind::Custom(1621), "a fork's issue")
            .tag(Tag::parse(["a", &format!("30617:{}:{d}", forker.public_key().to_hex())]).unwrap())
            .custom_created_at(Timestamp::from_secs(t - 700))
            .finalize(&forker)
            .unwrap()
    };
    let (issue_elsewhere, issue_here) = (fork_issue("r"), fork_issue("r-here"));
    w.own.store = vec![ann.clone(), root.clone(), elsewhere.clone(), here.clone()];
    w.relay(A);
    w.relay(B).store = vec![issue_here.clone()];
    w.relay(C).store = vec![issue_elsewhere.clone()];
    w.start();
    w.run_for(secs(60), secs(5));
    // The `u` tag links nothing: the fork listing this service is synced as its own
    // repository (from its own relays), the other is not, and the upstream's relays carry
    // only the upstream.
    assert_eq!(
        w.own_ids(),
        ids(&[&ann, &root, &elsewhere, &here, &issue_here])
    );
    let relays: Vec<String> =
        w.m.relays()
            .map(|r| r.url())
            .map(|r| r.to_string())
            .collect();
    assert!(!relays.iter().any(|r| r.starts_with(C)), "{relays:?}");
    let on_a = &w.m.plan.targets()[&RelayUrl::parse(A).unwrap()];
    assert_eq!(
        on_a.repos,
        [repo("r")]
            .into_iter()
            .collect::<crate::core::hash::HashSet<_>>()
    );
}

#[test]
fn replies_dropped_from_a_full_waiting_set_are_followed_by_another_read() {
    // Batches of two events and room for one waiting reply: the own relay answers newest
    // first, so generation 3 waits for 2 and is pushed out by 4; when the read ends the
    // own relay is read again, and with generations 1 and 2 known, 3 and 4 are followed.
    let mut w = world(|c| {
        c.max_batch_events = 2;
        c.threads.max_waiting = 1;
    });
    let t = w.secs();
    let ann = announcement("r", &[A], t - 1000);
    let root = issue("r", "the root", t - 900);
    let c = chain(Style::Legacy, &root, 5, t - 800);
    w.own.store = vec![ann.clone(), root.clone()];
    w.own.store.extend(c[..4].iter().cloned());
    // Only generation 4's reply is missing: it is fetched once 4 is followed.
    w.relay(A).store = vec![c[4].clone()];
    w.start();
    w.run_for(secs(60), secs(5));
    assert!(w.m.counters().replies_waiting_dropped >= 1);
    assert!(w.m.counters().own_thread_rereads >= 1);
    let want = ids(&[&ann, &root, &c[0], &c[1], &c[2], &c[3], &c[4]]);
    assert_eq!(w.own_ids(), want);
}
