//! CLOSED prefixes and NOTICEs from real sockets: every kind ends with the complete expected
//! set on the own relay once the relay stops complaining.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::OneRepo;
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, RelayUrl, SyncHandle};
use nostr::event::{EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;

struct World {
    own: TestRelay,
    remote: TestRelay,
    expected: HashSet<EventId>,
}

fn world() -> World {
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = OneRepo::new(&remote);
    let reply = r.reply("reply");
    own.insert(&r.ann);
    for e in [&r.ann, &r.issue, &reply] {
        remote.insert(e);
    }
    World {
        expected: [r.ann.id, r.issue.id, reply.id].into(),
        own,
        remote,
    }
}

fn start(w: &World) -> SyncHandle {
    let mut c = Config::new(RelayUrl::parse(&w.own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    c.rate_limit_cooldown = Duration::from_millis(500);
    c.refused_retry = Duration::from_millis(800);
    c.backoff.base = Duration::from_millis(200);
    grasp_sync::start(c).unwrap()
}

fn closed_then_recovered(message: &str) {
    let w = world();
    w.remote.set_closed_on_req(Some(message.to_string()));
    let h = start(&w);
    // The engine is refused, waits, and asks again (queries counted: several may share a
    // REQ, decision 0110).
    let asked = || -> usize { w.remote.reqs().iter().map(|r| r.filters.len()).sum() };
    assert!(
        wait_until(Duration::from_secs(30), || asked() >= 8),
        "retried after {message:?}: {} queries in {} REQs",
        asked(),
        w.remote.reqs().len()
    );
    assert!(!w.own.event_ids().is_superset(&w.expected));
    // The relay records a REQ before its CLOSED reaches the engine and the relay thread
    // publishes its counters: wait for those too (a loaded host showed 3 here).
    assert!(
        wait_until(Duration::from_secs(30), || h.status().relays[0].closed >= 4),
        "CLOSEDs counted after {message:?}: {}",
        h.status().relays[0].closed
    );
    w.remote.set_closed_on_req(None);
    let ok = wait_until(Duration::from_secs(30), || w.own.event_ids() == w.expected);
    assert!(ok, "after {message:?}: {:#?}", h.status());
    h.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn rate_limited_closed() {
    closed_then_recovered("rate-limited: too many REQs");
}

#[test]
fn restricted_closed() {
    closed_then_recovered("restricted: members only");
}

#[test]
fn blocked_invalid_unsupported_error_and_unknown_closed() {
    for m in [
        "blocked: go away",
        "invalid: bad filter",
        "unsupported: multi-filter REQs aren't supported",
        "error: internal",
        "something else",
    ] {
        closed_then_recovered(m);
    }
}

#[test]
fn auth_required_without_a_key_is_retried_and_recovers() {
    closed_then_recovered("auth-required: we only serve authenticated users");
}

#[test]
fn rate_limit_notice_and_other_notices_are_counted_and_survived() {
    let w = world();
    let h = start(&w);
    assert!(wait_until(Duration::from_secs(30), || w.own.event_ids() == w.expected));
    for n in [
        "ERROR: too many concurrent REQs",
        "Subscription error: Maximum concurrent subscription count reached",
        "hello there",
    ] {
        w.remote.send_notice(n);
    }
    assert!(wait_until(Duration::from_secs(30), || {
        h.status().relays.first().is_some_and(|r| r.notices >= 3)
    }));
    // The relay thread publishes its counters before the coordinator has read the reports:
    // wait for the machine too.
    assert!(
        wait_until(Duration::from_secs(30), || h
            .with_machine(|m| m.counters().rate_limited)
            >= 2),
        "{:?}",
        h.with_machine(|m| m.counters())
    );
    assert_eq!(h.with_machine(|m| m.counters().rate_limited), 2);
    // Still working: a new event arrives after the cool-down.
    let keys = Keys::generate();
    let late = EventBuilder::new(Kind::Custom(30617), "")
        .tag(Tag::parse(["d", "late"]).unwrap())
        .finalize(&keys)
        .unwrap();
    w.remote.insert(&late);
    assert!(wait_until(Duration::from_secs(30), || w
        .own
        .contains(&late.id)));
    h.shutdown(Duration::from_secs(10)).unwrap();
}
