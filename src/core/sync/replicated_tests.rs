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

/// Ids asked by `ids` on every relay (each time one is asked counts).
fn ids_asked(w: &World) -> usize {
    w.relays
        .values()
        .flat_map(|f| f.reqs.iter())
        .filter_map(|r| r.ids.as_ref())
        .map(|ids| ids.len())
        .sum()
}

/// Three relays speaking NIP-77 that page by 20, each holding three repositories with 60
/// issues and their replies; the own relay holds the announcements and the issues, no reply.
/// The first relay asked for a chunk of issue ids reads its replies by one REQ (no event on
/// the own relay tags them, decision 0120); the others reconcile. `r0` answers its REQs and
/// holds their EOSE back (`r0_eose`: until released, or never).
fn streaming_case(r0_eose: bool) -> (World, Vec<Event>) {
    replicated(3, 3, 3, 60, |i, f| {
        f.profile(SimProfile::LocalRelay);
        f.publish_nip11 = true;
        f.advertise_nip77 = true;
        f.max_limit = Some(20);
        if i == 0 {
            f.hold_eose = r0_eose;
            f.withhold_eose = !r0_eose;
        }
    })
}

/// Layer 3 queries (by `#e`, `#E` or `#q` of issue ids) read whole by REQ (neither `ids`
/// nor `limit: 0`), on every relay.
fn whole_reads(w: &World) -> usize {
    w.relays
        .values()
        .flat_map(|f| f.reqs.iter())
        .filter(|r| r.ids.is_none() && r.limit != Some(0))
        .filter(|r| {
            r.generic_tags.values().flatten().all(|v| v.len() == 64) && !r.generic_tags.is_empty()
        })
        .count()
}

#[test]
fn a_fetch_waits_for_another_relays_req_of_the_same_values() {
    // While r0's REQs and their pages stream the replies, the reconciliations of r1 and r2
    // find those replies missing on the own relay. Their fetches wait for r0's REQs to end
    // and then leave out what r0 handed over (decision 0121): nothing is asked twice. Sent
    // at once (before 0121), they asked r1 and r2 for 140 replies r0 was still streaming.
    // (`hold_eose`: r0 sends each REQ's stored answer, its EOSE only when released.)
    let (mut w, want) = streaming_case(true);
    w.start();
    w.run_for(Duration::from_secs(3), Duration::from_millis(100));
    assert_eq!(
        ids_asked(&w),
        0,
        "a fetch went out while r0 streams the same values"
    );
    assert!(!w.m.recon.delivering.is_empty(), "r0's REQs are tracked");
    w.relay("ws://r0.example").hold_eose = false;
    w.release_eose("ws://r0.example");
    w.run_for(Duration::from_secs(600), Duration::from_secs(1));
    let want: Vec<&Event> = want.iter().collect();
    w.assert_own_holds(&want);
    assert!(w.m.counters().reconciliations > 0);
    assert!(
        ids_asked(&w) < 20,
        "{} ids asked of r1 and r2 that r0 delivered",
        ids_asked(&w)
    );
    assert_eq!(w.m.recon.delivering.len(), 0, "every tracked REQ forgotten");
    // A reconciliation that finds nothing on the own relay for a query r0 is streaming
    // goes on (its fetch waits) instead of reading the query whole a second time: 32 such
    // REQs in all (41 when every empty own side gave way to a REQ).
    assert!(
        whole_reads(&w) <= 36,
        "{} Layer 3 queries read whole",
        whole_reads(&w)
    );
}

#[test]
fn a_fetch_waits_for_a_req_that_never_ends_only_so_long() {
    // r0 never ends its REQs (no EOSE): the fetches of r1 and r2 wait for them
    // `DELIVERY_WAIT` (10 s) and then ask for what r0 has not delivered; the set is complete.
    let (mut w, want) = streaming_case(false);
    w.start();
    w.run_for(Duration::from_secs(5), Duration::from_millis(100));
    assert_eq!(ids_asked(&w), 0, "a fetch went out before its wait ended");
    w.run_for(Duration::from_secs(10), Duration::from_millis(100));
    assert!(ids_asked(&w) > 0, "no fetch went out after its wait");
    w.run_for(Duration::from_secs(600), Duration::from_secs(1));
    let want: Vec<&Event> = want.iter().collect();
    w.assert_own_holds(&want);
}

#[test]
fn a_fetch_past_its_wait_held_by_its_batch_sets_no_timer_in_the_past() {
    // The fetch of a finished job waits for r0; its wait ends while other jobs of its batch
    // still wait on r1 and r2 (their NEG answers held back). The machine's next timeout
    // must stay ahead of the clock (a timer set again to a passed deadline made the
    // coordinator spin until those jobs ended; found in review).
    use super::timers::Timer;
    let (mut w, want) = streaming_case(true);
    w.relay("ws://r1.example").hold_neg = true;
    w.relay("ws://r2.example").hold_neg = true;
    w.start();
    w.run_for(Duration::from_secs(3), Duration::from_millis(100));
    let mut waited = false;
    for _ in 0..200 {
        if w.m.recon.fetches_waiting() > 0 {
            waited = true;
            break;
        }
        w.release_neg("ws://r1.example");
        w.release_neg("ws://r2.example");
        w.run_for(Duration::from_millis(100), Duration::from_millis(100));
    }
    assert!(waited, "no fetch came to wait for r0");
    for _ in 0..30 {
        w.run_for(Duration::from_secs(1), Duration::from_secs(1));
        if let Some(at) = w.m.timers.get(&Timer::DeliveryWait) {
            assert!(at > w.now, "the delivery wait's timer is behind the clock");
        }
        assert!(w.m.poll_timeout().is_none_or(|t| t > w.now));
    }
    for u in ["ws://r1.example", "ws://r2.example"] {
        w.relay(u).hold_neg = false;
        w.release_neg(u);
    }
    w.relay("ws://r0.example").hold_eose = false;
    w.release_eose("ws://r0.example");
    w.run_for(Duration::from_secs(600), Duration::from_secs(1));
    let want: Vec<&Event> = want.iter().collect();
    w.assert_own_holds(&want);
}
