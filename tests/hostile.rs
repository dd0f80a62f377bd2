//! A remote relay that sends garbage: unreadable frames, oversized frames (above the soft
//! cap: dropped; above the hard cap: connection dropped), messages of the
//! wrong type or for subscriptions we never opened, AUTH without a key. Each is counted,
//! nothing crashes, and the relay's real events still reach the own relay.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::OneRepo;
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, RelayUrl};
use nostr::event::EventId;

const DEADLINE: Duration = Duration::from_secs(30);

#[test]
fn garbage_from_a_remote_relay_is_counted_and_survived() {
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = OneRepo::new(&remote);
    let (ann, issue) = (r.ann.clone(), r.issue.clone());
    own.insert(&ann);
    remote.insert(&ann);
    remote.insert(&issue);
    let mut expected: HashSet<EventId> = [ann.id, issue.id].into();
    let mut config = Config::new(RelayUrl::parse(&own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    config.backoff.base = Duration::from_millis(200);
    let handle = grasp_sync::start(config).unwrap();
    assert!(wait_until(DEADLINE, || own.event_ids() == expected));
    let status = |h: &grasp_sync::SyncHandle| h.status().relays[0].clone();

    // Unreadable and unexpected frames: counted, the connection stays.
    for g in [
        "",
        "not json",
        "{}",
        "[]",
        "[1,2,3]",
        "[\"EVENT\"]",
        "[\"EVENT\",\"x\",42]",
        "[\"EOSE\"]",
        "[\"OK\",\"zz\",true,\"\"]",
        "[\"COUNT\",\"x\",{\"count\":1}]",
        "[\"NEG-MSG\",\"x\",\"00\"]",
        "\u{0}\u{1}\u{2}",
    ] {
        remote.send_raw(g);
    }
    assert!(wait_until(DEADLINE, || status(&handle).garbage_frames >= 12));
    assert_eq!(
        status(&handle).disconnects,
        0,
        "garbage does not cost the connection"
    );

    // Messages for subscriptions we never opened.
    let stray = r.another_issue("stray");
    remote.send_raw(&format!("[\"EVENT\",\"never-opened\",{}]", stray.as_json()));
    remote.send_raw("[\"EOSE\",\"never-opened\"]");
    remote.send_raw("[\"CLOSED\",\"never-opened\",\"error: whatever\"]");
    remote.send_raw(&format!("[\"OK\",\"{}\",true,\"\"]", stray.id));
    assert!(wait_until(DEADLINE, || status(&handle)
        .events_unknown_subscription
        >= 1));
    // An AUTH challenge without a configured key: counted, nothing else happens.
    remote.send_auth("challenge-123");
    assert!(wait_until(DEADLINE, || status(&handle).auth_challenges >= 1));
    assert!(
        !own.contains(&stray.id),
        "an event on an unknown subscription is dropped"
    );

    // A frame above the soft cap (1 MiB) and below the hard cap (1 MiB + 64 KiB): dropped
    // and counted, the connection kept.
    remote.send_raw(&format!(
        "[\"NOTICE\",\"{}\"]",
        "x".repeat((1 << 20) + 1024)
    ));
    assert!(wait_until(DEADLINE, || status(&handle).oversized_frames >= 1));
    assert_eq!(status(&handle).disconnects, 0);
    // A frame above the hard cap (2 MiB > 1 MiB + 64 KiB): the connection is dropped and
    // restored, and the relay's next event still arrives.
    remote.send_raw(&format!("[\"NOTICE\",\"{}\"]", "x".repeat(2 << 20)));
    assert!(wait_until(DEADLINE, || status(&handle).disconnects >= 1));
    let later = r.reply("after the oversized frame");
    remote.insert(&later);
    expected.insert(later.id);
    assert!(
        wait_until(DEADLINE, || own.event_ids() == expected),
        "{:#?}",
        handle.status()
    );
    assert!(status(&handle).connects >= 2);
    handle.shutdown(Duration::from_secs(10)).unwrap();
}
