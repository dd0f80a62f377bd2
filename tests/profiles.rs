//! The engine against test relays with the profiles of real ones (issue 19):
//! `grasp_sync::testing::Profile`. Each test ends by comparing event sets on the own relay.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{event, init_logging, machine_is_past, url, OneRepo, WAIT};
use grasp_sync::testing::{wait_until, Profile, TestRelay, TestRelayOptions, WriteRate};
use grasp_sync::{Config, RelayUrl};
use nostr::event::EventId;

fn config(own: &TestRelay) -> Config {
    let mut c = Config::new(RelayUrl::parse(&own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    c.backoff.base = Duration::from_millis(200);
    c.backoff.max = Duration::from_secs(1);
    c
}

/// nostr-rs-relay sends no EOSE for `limit: 0`. After a quick reconnect every live event
/// published arrives, and the live subscriptions are not closed and sent again every EOSE
/// deadline (2 s here).
#[test]
fn a_quick_reconnect_to_nostr_rs_relay_loses_no_live_event_and_does_not_churn() {
    init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start_with(TestRelayOptions::profile(Profile::NostrRsRelay));
    let r = OneRepo::new(&remote);
    let mut expected = r.seed(&own, &remote);
    let mut c = config(&own);
    c.eose_timeout = Duration::from_secs(2);
    let clock = c.clock.clone();
    let handle = grasp_sync::start(c).unwrap();
    assert!(wait_until(WAIT, || own.event_ids() == expected
        && handle.status().is_settled()));
    remote.drop_connections();
    assert!(wait_until(WAIT, || handle
        .status()
        .relay(&url(&remote))
        .is_some_and(|s| s.connects >= 2)));
    for i in 0..10 {
        let reply = r.reply(&format!("live {i}"));
        remote.insert(&reply);
        expected.insert(reply.id);
        std::thread::sleep(Duration::from_millis(300));
    }
    let ok = wait_until(WAIT, || own.event_ids() == expected);
    let held = own.event_ids();
    let missing: HashSet<&EventId> = expected.difference(&held).collect();
    assert!(ok, "missing {missing:?}: {:#?}", handle.status());
    // Three EOSE deadlines of steady state: no REQ at all, and the machine did nothing
    // (a resent query counts). Not a fixed sleep: the window ends once the coordinator has
    // handled every deadline that fell in it.
    let reqs = remote.reqs().len();
    let counters = handle.with_machine(|m| m.counters());
    let end = clock.now().plus(Duration::from_secs(6));
    assert!(
        wait_until(WAIT, || machine_is_past(&handle, clock.as_ref(), end)),
        "the engine's deadlines of the window were not handled"
    );
    assert_eq!(handle.with_machine(|m| m.counters()), counters);
    let again: Vec<_> = remote.reqs()[reqs..].to_vec();
    assert!(again.is_empty(), "REQs in steady state: {again:#?}");
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

/// The own relay is ngit-relay: 15 events at once, then (here) one per 50 ms per
/// connection, and only what relates to a stored repository. The sync completes, paced.
#[test]
fn an_ngit_relay_as_own_relay_gets_the_whole_set_paced() {
    init_logging();
    let mut opts = TestRelayOptions::profile(Profile::NgitRelay);
    opts.write_rate = Some(
        WriteRate::new(15, Duration::from_millis(50))
            .with_message("rate-limited: slow down, please"),
    );
    let own = TestRelay::start_with(opts);
    let remote = TestRelay::start();
    let r = OneRepo::new(&remote);
    let mut expected = r.seed(&own, &remote);
    for i in 0..30 {
        let issue = r.another_issue(&format!("issue {i}"));
        remote.insert(&issue);
        expected.insert(issue.id);
        // A reply that names only its issue: stored once the issue is.
        let reply = event(&r.keys, 1111, "a reply", &[&["E", &issue.id.to_hex()]]);
        remote.insert(&reply);
        expected.insert(reply.id);
    }
    let handle = grasp_sync::start(config(&own)).unwrap();
    let ok = wait_until(Duration::from_secs(120), || own.event_ids() == expected);
    let missing = expected.difference(&own.event_ids()).count();
    let status = handle.status();
    assert!(ok, "missing {missing}: {status:#?}");
    assert!(status.forward_rate_limited > 0, "the relay throttled us");
    // The copy of the announcement read back from the remote relay's Layer 1 does not list
    // the own relay's domain: ngit-relay refuses it (before it would find it stored). That
    // is the one rejection; nothing else is refused for good.
    assert!(status.rejected <= 1, "{status:#?}");
    handle.shutdown(Duration::from_secs(10)).unwrap();
}
