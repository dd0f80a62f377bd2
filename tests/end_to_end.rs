//! End-to-end over real websockets on 127.0.0.1: own relay + remote test relays.

use std::collections::HashSet;
use std::time::Duration;

use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, RelayUrl};
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;

fn url(r: &TestRelay) -> RelayUrl {
    RelayUrl::parse(&r.url()).unwrap()
}

fn announcement(keys: &Keys, d: &str, relays: &[&str]) -> Event {
    let mut t = vec!["relays".to_string()];
    t.extend(relays.iter().map(|s| s.to_string()));
    EventBuilder::new(Kind::Custom(30617), "")
        .tag(Tag::parse(["d", d]).unwrap())
        .tag(Tag::parse(t).unwrap())
        .finalize(keys)
        .unwrap()
}

fn issue(keys: &Keys, repo: &str, text: &str) -> Event {
    EventBuilder::new(Kind::Custom(1621), text)
        .tag(Tag::parse(["a", repo]).unwrap())
        .finalize(keys)
        .unwrap()
}

fn reply(keys: &Keys, root: &EventId, tag: &str, text: &str) -> Event {
    EventBuilder::new(Kind::Custom(1111), text)
        .tag(Tag::parse([tag, &root.to_hex()]).unwrap())
        .finalize(keys)
        .unwrap()
}

#[test]
fn smoke_one_remote_relay() {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let keys = Keys::generate();
    let ann = announcement(&keys, "repo", &[&remote.url()]);
    let repo = format!("30617:{}:repo", keys.public_key().to_hex());
    let iss = issue(&keys, &repo, "bug");
    own.insert(&ann);
    own.insert(&iss);
    remote.insert(&ann);
    let remote_issue = issue(&keys, &repo, "remote bug");
    let r1 = reply(&keys, &iss.id, "e", "reply e");
    let r2 = reply(&keys, &iss.id, "E", "reply E");
    let noise = EventBuilder::new(Kind::Custom(1), "noise")
        .finalize(&keys)
        .unwrap();
    for e in [&remote_issue, &r1, &r2, &noise] {
        remote.insert(e);
    }
    let config = Config::new(url(&own)).batch_window(Duration::from_millis(100));
    let handle = grasp_sync::start(config).unwrap();
    let expected: HashSet<EventId> = [ann.id, iss.id, remote_issue.id, r1.id, r2.id].into();
    let ok = wait_until(Duration::from_secs(30), || own.event_ids() == expected);
    assert!(
        ok,
        "own relay has {:?}, expected {:?}\n{:#?}",
        own.event_ids(),
        expected,
        handle.status()
    );
    handle.shutdown(Duration::from_secs(10)).unwrap();
}
