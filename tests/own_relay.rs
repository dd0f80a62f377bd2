//! The own relay under stress: down for a while mid-sync, and rate-limiting writes. Both end
//! with the complete expected set on the own relay.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::OneRepo;
use grasp_sync::testing::{wait_until, TestRelay, TestRelayOptions};
use grasp_sync::{Config, RelayUrl};
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;

/// The repository and its issue on the own relay; `replies` comments on the remote.
fn seed(own: &TestRelay, remote: &TestRelay, replies: usize) -> (HashSet<EventId>, Event) {
    let r = OneRepo::new(remote);
    own.insert(&r.ann);
    own.insert(&r.issue);
    remote.insert(&r.ann);
    let mut expected: HashSet<EventId> = [r.ann.id, r.issue.id].into();
    for i in 0..replies {
        let reply = r.reply(&format!("reply {i}"));
        remote.insert(&reply);
        expected.insert(reply.id);
    }
    (expected, r.issue)
}

fn config(own: &TestRelay) -> Config {
    let mut c = Config::new(RelayUrl::parse(&own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    c.backoff.base = Duration::from_millis(200);
    c.backoff.max = Duration::from_secs(1);
    c.forward.ok_timeout = Duration::from_secs(2);
    c
}

#[test]
fn own_relay_down_mid_sync_loses_nothing() {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let (mut expected, issue) = seed(&own, &remote, 200);
    let handle = grasp_sync::start(config(&own)).unwrap();
    // Let the first events arrive, then take the own relay away.
    assert!(wait_until(Duration::from_secs(30), || own.len() > 2));
    let port = own.port();
    // Stop first, then read the store: everything the relay acknowledged is kept, as a real
    // relay would have persisted it.
    own.stop();
    let stored = own.raw_events();
    drop(own);
    // Published on the remote while the own relay is down.
    let keys = Keys::generate();
    for i in 0..50 {
        let r = EventBuilder::new(Kind::Custom(1111), format!("while down {i}"))
            .tag(Tag::parse(["e", &issue.id.to_hex()]).unwrap())
            .finalize(&keys)
            .unwrap();
        remote.insert(&r);
        expected.insert(r.id);
    }
    assert!(wait_until(Duration::from_secs(30), || !handle
        .status()
        .forwarder_connected));
    // Back, with what it had stored.
    let own = TestRelay::start_with_store(port, TestRelayOptions::default(), stored).unwrap();
    let ok = wait_until(Duration::from_secs(60), || own.event_ids() == expected);
    let missing = expected.difference(&own.event_ids()).count();
    assert!(ok, "missing {missing}: {:#?}", handle.status());
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn own_relay_rate_limiting_writes_loses_nothing() {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let (expected, _) = seed(&own, &remote, 100);
    own.set_reject_events(Some("rate-limited: slow down".into()));
    let handle = grasp_sync::start(config(&own)).unwrap();
    // Refused for a while: the engine keeps the events and tries again.
    assert!(wait_until(Duration::from_secs(30), || handle
        .status()
        .forward_backlog
        >= 100));
    assert_eq!(own.len(), 2, "nothing stored while rate-limited");
    assert_eq!(
        handle.status().rejected,
        0,
        "a rate limit is not a rejection"
    );
    own.set_reject_events(None);
    let ok = wait_until(Duration::from_secs(60), || own.event_ids() == expected);
    assert!(ok, "{:#?}", handle.status());
    assert!(wait_until(Duration::from_secs(30), || handle
        .status()
        .forward_backlog
        == 0));
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

/// Issue 19, item 2: nostr-rs-relay answers `OK false "error: …"` while its database is
/// locked (a backup, say). A spell of many rounds of `error:` answers, longer than any fixed
/// number of retries, loses nothing: every event is sent again until stored, none is
/// rejected, and events published meanwhile arrive too.
#[test]
fn own_relay_answering_error_for_a_while_loses_nothing() {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let (mut expected, issue) = seed(&own, &remote, 56);
    own.set_reject_events(Some("error: database is locked".into()));
    let mut c = config(&own);
    c.forward.rate_limit_pause = Duration::from_millis(50);
    let handle = grasp_sync::start(c).unwrap();
    // At least eight rounds of failures (the old engine gave an event up after five).
    assert!(
        wait_until(Duration::from_secs(60), || handle
            .status()
            .forward_relay_errors
            >= 8 * 56),
        "{:#?}",
        handle.status()
    );
    assert_eq!(own.len(), 2, "nothing stored while the relay fails");
    assert_eq!(handle.status().rejected, 0, "an error: is not a verdict");
    // Published during the spell.
    let keys = Keys::generate();
    for i in 0..5 {
        let r = EventBuilder::new(Kind::Custom(1111), format!("during the spell {i}"))
            .tag(Tag::parse(["e", &issue.id.to_hex()]).unwrap())
            .finalize(&keys)
            .unwrap();
        remote.insert(&r);
        expected.insert(r.id);
    }
    own.set_reject_events(None);
    let ok = wait_until(Duration::from_secs(120), || own.event_ids() == expected);
    let missing = expected.difference(&own.event_ids()).count();
    assert!(ok, "missing {missing}: {:#?}", handle.status());
    assert_eq!(handle.status().rejected, 0);
    assert!(wait_until(Duration::from_secs(30), || handle
        .status()
        .forward_backlog
        == 0));
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn own_relay_rejection_is_counted_and_retried_when_the_index_changes() {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = OneRepo::new(&remote);
    own.insert(&r.ann);
    own.insert(&r.issue);
    remote.insert(&r.ann);
    let mut replies = HashSet::new();
    for i in 0..5 {
        let reply = r.reply(&format!("reply {i}"));
        remote.insert(&reply);
        replies.insert(reply.id);
    }
    let mut expected: HashSet<EventId> = [r.ann.id, r.issue.id].into();
    expected.extend(&replies);
    // One more reply names another repository, announced later.
    let other = Keys::generate();
    let unrelated = EventBuilder::new(Kind::Custom(30617), "")
        .tag(Tag::parse(["d", "new"]).unwrap())
        .finalize(&other)
        .unwrap();
    let naming_it = EventBuilder::new(Kind::Custom(1111), "see the other repository")
        .tag(Tag::parse(["E", &r.issue.id.to_hex()]).unwrap())
        .tag(Tag::parse(["a", &format!("30617:{}:new", other.public_key().to_hex())]).unwrap())
        .finalize(&r.keys)
        .unwrap();
    remote.insert(&naming_it);
    own.set_reject_events(Some("blocked: unknown repository".into()));
    let handle = grasp_sync::start(config(&own)).unwrap();
    assert!(wait_until(Duration::from_secs(30), || handle
        .status()
        .rejected
        >= 6));
    // The own relay now accepts. The other repository's announcement retries only what names
    // it: the reply that does comes in (so the retry ran), the others do not.
    own.set_reject_events(None);
    own.insert(&unrelated);
    assert!(
        wait_until(Duration::from_secs(30), || own.contains(&naming_it.id)),
        "the reply naming the announced repository was not retried: {:#?}",
        handle.status()
    );
    // A later event takes the same way into the own relay: once it is stored, whatever the
    // retry queued before it was answered too.
    let marker = r.reply("after the retry");
    remote.insert(&marker);
    assert!(wait_until(Duration::from_secs(30), || own.contains(&marker.id)));
    let retried: Vec<&EventId> = replies.iter().filter(|id| own.contains(id)).collect();
    assert!(
        retried.is_empty(),
        "replies retried for an unrelated change: {retried:?}"
    );
    expected.extend([naming_it.id, marker.id]);
    // A newer announcement of the replies' repository retries them.
    let newer = EventBuilder::new(Kind::Custom(30617), "")
        .tag(Tag::parse(["d", "r"]).unwrap())
        .tag(Tag::parse(["relays", &remote.url()]).unwrap())
        .custom_created_at(nostr::types::Timestamp::from_secs(
            r.ann.created_at.as_secs() + 1,
        ))
        .finalize(&r.keys)
        .unwrap();
    own.insert(&newer);
    expected.insert(unrelated.id);
    // The newer announcement replaces the older one (kind 30617 is addressable).
    expected.remove(&r.ann.id);
    expected.insert(newer.id);
    let ok = wait_until(Duration::from_secs(30), || {
        own.event_ids().is_superset(&expected)
    });
    assert!(ok, "{:#?}", handle.status());
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn a_remote_blocked_by_back_pressure_still_gets_pings() {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let (_, _) = seed(&own, &remote, 40);
    // The own relay refuses every write for now: the forward queue fills up and the remote
    // relay's thread has to wait with its next event.
    own.set_reject_events(Some("rate-limited: slow down".into()));
    let mut c = config(&own);
    c.forward.backlog = 4;
    c.forward.in_flight = 2;
    c.forward_channel = 1;
    c.ping_interval = Duration::from_millis(300);
    let handle = grasp_sync::start(c).unwrap();
    // Blocked: four in the queue, one in the channel, one waiting in the relay thread.
    assert!(wait_until(Duration::from_secs(30), || handle
        .status()
        .forward_backlog
        >= 6));
    let before = remote.pings_received();
    assert!(
        wait_until(Duration::from_secs(30), || remote.pings_received()
            >= before + 3),
        "the blocked relay thread keeps pinging"
    );
    assert!(handle.status().forward_backlog >= 6, "still blocked");
    assert_eq!(handle.status().relays[0].disconnects, 0);
    own.set_reject_events(None);
    assert!(wait_until(Duration::from_secs(60), || own.len() == 42));
    handle.shutdown(Duration::from_secs(10)).unwrap();
}
