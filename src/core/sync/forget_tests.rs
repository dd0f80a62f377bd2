//! Forgetting a remote relay (issue 18): refused by the engine or idle, it goes through
//! [`super::SyncMachine::forget_relay`], and nothing of it stays behind in any structure of
//! the machine, its timers included.

use std::time::Duration;

use super::world::{announcement, World};
use super::{Nip77Support, Report};
use crate::shared::RelayUrl;

const OWN: &str = "ws://own.example";
const A: &str = "ws://a.example";
const B: &str = "ws://b.example";
const DAY: u64 = 86_400;

fn a() -> RelayUrl {
    RelayUrl::parse(A).unwrap()
}

/// Repository `r` is synced from A (which publishes NIP-11 limits, was rate-limited and is
/// known to speak NIP-77), then moves to B: A has no target any more and waits for the
/// idle check (due 60 s after the start, 24 s from the end of this).
fn moved_away() -> World {
    let mut w = World::new(OWN, |_| {});
    let t = w.secs();
    let ann = announcement("r", &[A], t - 10 * DAY);
    w.own.store.push(ann.clone());
    let fake = w.relay(A);
    fake.store.push(ann);
    fake.max_limit = Some(50);
    fake.max_subs = Some(10);
    fake.publish_nip11 = true;
    w.start();
    w.advance(Duration::from_secs(30));
    let generation = w.m.relay(&a()).unwrap().state().generation;
    w.m.handle_report(
        Report::Notice {
            relay: a(),
            generation,
            message: "rate-limited: slow down".into(),
        },
        w.now,
    );
    w.m.remote_mut(&a()).unwrap().nip77 = Nip77Support::Works;
    w.store_on_own(&announcement("r", &[B], t - 5));
    w.relay(B);
    w.advance(Duration::from_secs(6));
    let traces = w.m.traces_of(&a());
    for what in ["remotes", "timers"] {
        assert!(traces.contains_key(what), "{what} before: {traces:?}");
    }
    assert!(w.m.timers.count_relay(&a()) >= 3, "daily, cool-down, retry");
    assert!(!traces.contains_key("targets"), "{traces:?}");
    w
}

#[test]
fn a_refused_and_an_idle_relay_leave_no_trace_and_the_same_state() {
    // The same world twice: A is refused in one, left to the idle check in the other.
    let mut refused = moved_away();
    let mut idle = moved_away();
    let generation = refused.m.relay(&a()).unwrap().state().generation;
    refused.m.handle_report(
        Report::Refused {
            relay: a(),
            generation,
            reason: crate::shared::Refusal::Denied {
                pattern: "test".into(),
            },
        },
        refused.now,
    );
    assert!(
        refused.m.traces_of(&a()).is_empty(),
        "{:?}",
        refused.m.traces_of(&a())
    );
    refused.pump();
    assert!(idle.m.relay(&a()).is_some(), "not idle-checked yet");
    refused.advance(Duration::from_secs(60));
    idle.advance(Duration::from_secs(60));
    assert!(idle.m.relay(&a()).is_none(), "idle check ran");
    for w in [&refused, &idle] {
        assert!(w.m.traces_of(&a()).is_empty(), "{:?}", w.m.traces_of(&a()));
        assert!(
            w.relays[&a()].conn.is_none(),
            "Forget closed the connection"
        );
    }
    // Apart from the refused relay's exclusion, both paths leave the same machine.
    let now = idle.now;
    assert_eq!(refused.m.relay_statuses(now), idle.m.relay_statuses(now));
    assert_eq!(refused.m.snapshot(now), idle.m.snapshot(now));
    let mut counters = refused.m.counters();
    assert_eq!(counters.relays_excluded, 1);
    counters.relays_excluded = 0;
    assert_eq!(counters.selections, 1, "one selection for the refusal");
    counters.selections = 0;
    assert_eq!(counters, idle.m.counters());
    assert_eq!(refused.m.poll_timeout(), idle.m.poll_timeout());
    assert_eq!(refused.m.timers.len(), idle.m.timers.len());
    assert_eq!(refused.m.target_report(), idle.m.target_report());
}

#[test]
fn a_relay_refused_in_the_middle_of_a_sync_leaves_no_timer_behind() {
    // A holds its EOSE: a pending batch with an EOSE deadline, loading queries.
    let mut w = World::new(OWN, |_| {});
    let t = w.secs();
    let ann = announcement("r", &[A], t - 10 * DAY);
    w.own.store.push(ann.clone());
    w.relay(A).store.push(ann);
    w.relay(A).withhold_eose = true;
    w.start();
    w.advance(Duration::from_secs(30));
    assert!(
        w.m.relay(&a()).is_some_and(|r| !r.pending().is_empty()),
        "a batch waits"
    );
    assert!(w.m.timers.count_relay(&a()) >= 2, "EOSE deadline and daily");
    let generation = w.m.relay(&a()).unwrap().state().generation;
    w.m.handle_report(
        Report::Refused {
            relay: a(),
            generation,
            reason: crate::shared::Refusal::Denied {
                pattern: "test".into(),
            },
        },
        w.now,
    );
    assert!(w.m.traces_of(&a()).is_empty(), "{:?}", w.m.traces_of(&a()));
    // Hours later nothing of A has come back (no timer of it fired, no late report of its
    // retired thread revived it).
    w.run_for(Duration::from_secs(3 * 3600), Duration::from_secs(600));
    assert!(w.m.traces_of(&a()).is_empty(), "{:?}", w.m.traces_of(&a()));
}
