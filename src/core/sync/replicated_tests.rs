//! Repositories replicated on several relays (issue 33): every repository announced on three
//! relays that each hold all of its events, copies of every event racing in from all three,
//! the own relay holding the announcements and root events before the sync (a GRASP server
//! that took them in itself), relays with LocalRelay's answers. Each test ends by comparing
//! the *set* of events on the own relay with the expected set.

use std::time::Duration;

use nostr::event::Event;

use super::world::{announcement, issue, reply, SimProfile, World};
use crate::core::sync::Nip77Support;
use crate::shared::RelayUrl;

const OWN: &str = "ws://own.example";
const DAY: u64 = 86_400;

/// `relays` relays, `repos` repositories each announced on `spread` of them (repository `r`
/// on relays `r`, `r+1`, … modulo `relays`), `roots` issues per repository with a reply
/// each. The own relay holds the announcements and the issues; the relays hold everything
/// of the repositories they are listed by. Returns the world (not started) and the expected
/// set.
fn replicated(
    relays: usize,
    repos: usize,
    spread: usize,
    roots: usize,
    relay: impl Fn(usize, &mut super::world::FakeRelay),
) -> (World, Vec<Event>) {
    let mut w = World::new(OWN, |c| c.batch_window = Duration::from_millis(200));
    let t = w.secs();
    let urls: Vec<String> = (0..relays).map(|i| format!("ws://r{i}.example")).collect();
    for (i, u) in urls.iter().enumerate() {
        relay(i, w.relay(u));
    }
    let mut want = Vec::new();
    for r in 0..repos {
        let d = format!("repo-{r}");
        let on: Vec<&str> = (0..spread)
            .map(|k| urls[(r + k) % relays].as_str())
            .collect();
        let ann = announcement(&d, &on, t - 60 * DAY + r as u64);
        let mut events = vec![ann.clone()];
        w.own.store.push(ann);
        for i in 0..roots {
            let at = t - 30 * DAY + (r * roots + i) as u64 * 60;
            let root = issue(&d, &format!("issue {i} of {d}"), at);
            let rep = reply(&root, &format!("reply to {i} of {d}"), at + 1);
            w.own.store.push(root.clone());
            events.push(root);
            events.push(rep);
        }
        for u in &on {
            w.relay(u).store.extend(events.iter().cloned());
        }
        want.extend(events);
    }
    (w, want)
}

/// LocalRelay's answers (no NIP-11, 500 results per REQ, NIP-77) on every relay.
fn local_relay(_: usize, f: &mut super::world::FakeRelay) {
    f.profile(SimProfile::LocalRelay);
}

#[test]
fn replicated_repositories_with_roots_on_the_own_relay_converge_on_local_relays() {
    let (mut w, want) = replicated(4, 40, 3, 30, local_relay);
    w.start();
    w.run_for(Duration::from_secs(1_200), Duration::from_secs(1));
    let want: Vec<&Event> = want.iter().collect();
    w.assert_own_holds(&want);
}

/// The relays' NIP-77 is known before the first batch (a relay listing it in NIP-11, with
/// the default budget of 20 subscriptions): every query of a batch is a reconciliation
/// whose live-only REQ takes a slot, more queries than slots.
#[test]
fn replicated_repositories_converge_when_every_batch_query_is_reconciled_beyond_the_budget() {
    let (mut w, want) = replicated(4, 40, 3, 30, |_, f| {
        f.profile(SimProfile::LocalRelay);
        f.publish_nip11 = true;
        f.advertise_nip77 = true;
        f.max_subs = Some(20);
    });
    w.start();
    w.run_for(Duration::from_secs(1_200), Duration::from_secs(1));
    for i in 0..4 {
        let url = RelayUrl::parse(&format!("ws://r{i}.example")).unwrap();
        assert_ne!(w.m.nip77_support(&url), Nip77Support::Unsupported);
    }
    let want: Vec<&Event> = want.iter().collect();
    w.assert_own_holds(&want);
}
