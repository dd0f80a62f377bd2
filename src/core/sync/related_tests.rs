//! One definition of "related" for the daemon and the audit (issue 34): after the daemon has
//! synced a world with reply chains, the audit's reading of the same own relay
//! (`ops::audit::OwnIndex`, then the daemon's selection) gives every relay the same
//! repositories and Layer-3 ids as the daemon's targets, and the filters the audit would ask
//! a relay carry exactly the tag values the daemon asked it. If either side stopped
//! following reply chains, counted other tags, or classified the own relay's events
//! differently, these tests fail.

use std::collections::BTreeSet;

use crate::core::hash::{HashMap, HashSet};
use std::time::Duration;

use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::filter::Filter;
use nostr::types::Timestamp;

use super::world::{announcement, issue, keys, reply, repo, World};
use crate::core::state::RelaySyncNeeds;
use crate::ops::audit::{audit_targets as targets_of, relay_filters, OwnIndex};
use crate::shared::RelayUrl;

const OWN: &str = "ws://own.example";
const A: &str = "ws://a.example";
const B: &str = "ws://b.example";

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn event(kind: u16, tags: &[&[&str]], at: u64) -> Event {
    let mut b =
        EventBuilder::new(Kind::Custom(kind), "x").custom_created_at(Timestamp::from_secs(at));
    for t in tags {
        b = b.tag(Tag::parse(t.iter().copied()).unwrap());
    }
    b.finalize(&keys()).unwrap()
}

/// A synced world: two repositories, root events with NIP-22 comments, legacy reply chains,
/// quotes and reactions below them, spread over two relays.
fn synced_world() -> World {
    let mut w = World::new(OWN, |c| c.default_subscription_budget = 1000);
    let t = w.secs();
    // Repository r lists the own relay too: never a target of either.
    let ann_r = announcement("r", &[OWN, A, B], t - 2000);
    let ann_s = announcement("s", &[B], t - 2000);
    let root_r = issue("r", "issue of r", t - 1900);
    let root_s = issue("s", "issue of s", t - 1900);
    let comment = reply(&root_r, "a NIP-22 comment", t - 1800);
    let legacy = event(1, &[&["e", &comment.id.to_hex(), "", "reply"]], t - 1700);
    let deeper = event(1, &[&["e", &legacy.id.to_hex(), "", "reply"]], t - 1600);
    let quote = event(1, &[&["q", &deeper.id.to_hex()]], t - 1500);
    let reaction = event(7, &[&["e", &quote.id.to_hex()]], t - 1400);
    let on_s = event(1, &[&["e", &root_s.id.to_hex(), "", "root"]], t - 1300);
    let on_s2 = event(
        1111,
        &[&["e", &on_s.id.to_hex()], &["E", &on_s.id.to_hex()]],
        t - 1200,
    );
    let repo_note = event(1, &[&["a", &repo("r")]], t - 1100);
    w.own.store = vec![ann_r, ann_s, root_r];
    w.relay(A).store = vec![comment.clone(), deeper.clone(), reaction, repo_note];
    w.relay(B).store = vec![root_s, legacy, quote, on_s, on_s2];
    w.start();
    w.run_for(secs(240), secs(5));
    w
}

/// The own relay's events as a relay answers them: newest first.
fn own_events_newest_first(w: &World) -> Vec<Event> {
    let mut events = w.own.store.clone();
    events.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.id.cmp(&b.id)));
    events
}

/// The audit's targets for the world's own relay, read as `ops::audit::run` reads it.
fn audit_targets(w: &World) -> HashMap<RelayUrl, RelaySyncNeeds> {
    let config = crate::Config::new(RelayUrl::parse(OWN).unwrap());
    let mut own = OwnIndex::new(&config);
    // The self-subscription's history, then the thread read, as the audit's step 1.
    for e in own_events_newest_first(w) {
        if crate::core::filters::self_subscription_filter(None)
            .match_event(&e, nostr::filter::MatchEventOptions::new())
        {
            own.add(&e);
        }
    }
    own.flush();
    for e in own_events_newest_first(w) {
        own.add(&e);
    }
    own.flush();
    targets_of(&config, &own.index).targets
}

/// `(tag letter, value)` of every Layer 2/3 condition of `filters` (state filters, asked by
/// `#d` with authors, and fetches by `ids` are left out).
fn tag_values<'a>(filters: impl Iterator<Item = &'a Filter>) -> BTreeSet<(char, String)> {
    filters
        .filter(|f| f.ids.is_none() && f.authors.is_none())
        .flat_map(|f| {
            f.generic_tags
                .iter()
                .flat_map(|(t, vs)| vs.iter().map(move |v| (t.as_char(), v.clone())))
        })
        .collect()
}

#[test]
fn the_audit_and_the_daemon_relate_the_same_events_to_each_relay() {
    let w = synced_world();
    let daemon = w.m.plan.targets().clone();
    let audit = audit_targets(&w);
    assert_eq!(
        daemon.keys().collect::<BTreeSet<_>>(),
        audit.keys().collect::<BTreeSet<_>>(),
        "the same relays"
    );
    for (relay, d) in &daemon {
        let a = &audit[relay];
        assert_eq!(d.repos, a.repos, "{relay}: repositories");
        assert_eq!(d.root_events, a.root_events, "{relay}: Layer-3 ids");
    }
    // The chain is followed on both sides: the reaction's parent (a quote three
    // generations below a comment) is a Layer-3 id of relay A and B.
    let a = &daemon[&RelayUrl::parse(A).unwrap()];
    let members: HashSet<EventId> = a
        .root_events
        .iter()
        .filter(|id| w.m.threads().is_member(id))
        .copied()
        .collect();
    assert_eq!(members.len(), 5, "comment, legacy, deeper, quote, reaction");
}

#[test]
fn the_audit_asks_each_relay_the_tag_values_the_daemon_asked_it() {
    let w = synced_world();
    let audit = audit_targets(&w);
    for (relay, needs) in &audit {
        let asked = tag_values(relay_filters(needs).iter());
        let fake = &w.relays[relay];
        let daemon = tag_values(fake.reqs.iter());
        assert_eq!(
            asked, daemon,
            "{relay}: the audit's values against the daemon's REQs"
        );
        // Both sides use the same letters: a, A, q for repositories; e, E, q for ids.
        let letters: BTreeSet<char> = daemon.iter().map(|(l, _)| *l).collect();
        assert_eq!(letters, ['A', 'E', 'a', 'e', 'q'].into(), "{relay}");
    }
}
