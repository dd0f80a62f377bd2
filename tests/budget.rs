//! A relay that allows 5 open subscriptions (and says so in NIP-11) never sees more than 5,
//! while every item still syncs, live updates included.

use std::collections::HashSet;
use std::time::Duration;

use grasp_sync::testing::{wait_until, Reply, TestRelay, TestRelayOptions};
use grasp_sync::{Config, RelayUrl};
use nostr::event::{EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;

#[test]
fn max_subscriptions_5_is_respected_and_everything_syncs() {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start();
    let remote = TestRelay::start_with(TestRelayOptions {
        nip11: Some(serde_json::json!({"limitation": {"max_subscriptions": 5}})),
        max_subscriptions: Some(5),
        too_many_subs_reply: Reply::Notice("ERROR: too many concurrent REQs".into()),
        ..TestRelayOptions::default()
    });
    let keys = Keys::generate();
    let mut expected: HashSet<EventId> = HashSet::new();
    let mut roots = Vec::new();
    // 120 repositories (2 Layer-2 chunks) with one issue each (2 Layer-3 chunks).
    for i in 0..120 {
        let d = format!("repo-{i}");
        let ann = EventBuilder::new(Kind::Custom(30617), "")
            .tag(Tag::parse(["d", &d]).unwrap())
            .tag(Tag::parse(["relays", &remote.url()]).unwrap())
            .finalize(&keys)
            .unwrap();
        let repo = format!("30617:{}:{d}", keys.public_key().to_hex());
        let issue = EventBuilder::new(Kind::Custom(1621), format!("issue {i}"))
            .tag(Tag::parse(["a", &repo]).unwrap())
            .finalize(&keys)
            .unwrap();
        own.insert(&ann);
        own.insert(&issue);
        remote.insert(&ann);
        expected.insert(ann.id);
        expected.insert(issue.id);
        roots.push(issue);
    }
    for (i, root) in roots.iter().enumerate().step_by(7) {
        let reply = EventBuilder::new(Kind::Custom(1111), format!("reply {i}"))
            .tag(Tag::parse(["E", &root.id.to_hex()]).unwrap())
            .finalize(&keys)
            .unwrap();
        remote.insert(&reply);
        expected.insert(reply.id);
    }
    let mut config = Config::new(RelayUrl::parse(&own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    config.poll_interval = Duration::from_millis(500);
    let handle = grasp_sync::start(config).unwrap();
    let ok = wait_until(Duration::from_secs(60), || own.event_ids() == expected);
    assert!(
        ok,
        "own relay has {} of {}: {:#?}",
        own.event_ids().intersection(&expected).count(),
        expected.len(),
        handle.status()
    );
    // A reply published later arrives too (live or by the next poll round).
    let late = EventBuilder::new(Kind::Custom(1111), "late reply")
        .tag(Tag::parse(["e", &roots[100].id.to_hex()]).unwrap())
        .finalize(&keys)
        .unwrap();
    remote.insert(&late);
    assert!(wait_until(Duration::from_secs(30), || own.contains(&late.id)));
    assert!(
        remote.max_open_subscriptions_per_connection() <= 5,
        "the relay saw {} open subscriptions",
        remote.max_open_subscriptions_per_connection()
    );
    // One NOTICE is the answer to the NIP-77 detection (TestRelay speaks no NIP-77).
    let r = &handle.status().relays[0];
    assert_eq!(r.nip77, grasp_sync::core::sync::Nip77Support::Unsupported);
    assert_eq!(r.notices, 1, "never told 'too many'");
    handle.shutdown(Duration::from_secs(10)).unwrap();
}
