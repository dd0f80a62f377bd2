//! `--shard I/N` over real sockets: two instances (`0/2` and `1/2`) beside the same own
//! relay end with exactly the events one unsharded instance syncs, and every remote relay
//! is connected by exactly one of them.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{announcement, comment, repo_ref, root, url, WAIT};
use grasp_sync::core::targets::Shard;
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, SyncHandle};
use nostr::event::{Event, EventId};
use nostr::key::Keys;

const REMOTES: usize = 6;

/// The announcements (for the own relay) and the history on the remotes: repository `i`
/// lists remotes `i` and `i + 1`; its issue is on the own relay, replies and a second issue
/// are on its remotes only.
struct Fixture {
    remotes: Vec<TestRelay>,
    own_seed: Vec<Event>,
    expected: HashSet<EventId>,
}

fn fixture() -> Fixture {
    let remotes: Vec<TestRelay> = (0..REMOTES).map(|_| TestRelay::start()).collect();
    let mut own_seed = Vec::new();
    let mut expected = HashSet::new();
    for i in 0..REMOTES {
        let keys = Keys::generate();
        let (a, b) = (&remotes[i], &remotes[(i + 1) % REMOTES]);
        let ann = announcement(&keys, "r", &[&[&a.url(), &b.url()]]);
        let repo = repo_ref(&keys, "r");
        let issue = root(&keys, 1621, &repo, &format!("issue {i}"), &[]);
        let reply_a = comment(&keys, &issue, &format!("reply {i} on a"));
        let reply_b = comment(&keys, &issue, &format!("reply {i} on b"));
        let second = root(&keys, 1621, &repo, &format!("second issue {i}"), &[]);
        for e in [&ann, &issue, &second] {
            a.insert(e);
        }
        a.insert(&reply_a);
        b.insert(&ann);
        b.insert(&reply_b);
        own_seed.push(ann.clone());
        own_seed.push(issue.clone());
        expected.extend([ann.id, issue.id, reply_a.id, reply_b.id, second.id]);
    }
    Fixture {
        remotes,
        own_seed,
        expected,
    }
}

fn start(own: &TestRelay, shard: Option<Shard>) -> SyncHandle {
    let mut config = Config::new(url(own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    config.shard = shard;
    grasp_sync::start(config).unwrap()
}

fn own_with(seed: &[Event]) -> TestRelay {
    let own = TestRelay::start();
    for e in seed {
        own.insert(e);
    }
    own
}

/// The remote relays a handle has as sync sources.
fn sources(h: &SyncHandle) -> HashSet<String> {
    h.status()
        .relays
        .iter()
        .map(|r| r.url.as_str().to_string())
        .collect()
}

#[test]
fn two_shards_sync_what_one_instance_does_each_relay_by_exactly_one() {
    common::init_logging();
    let f = fixture();
    let all_urls: HashSet<String> = f
        .remotes
        .iter()
        .map(|r| url(r).as_str().to_string())
        .collect();

    // One unsharded instance.
    let own_one = own_with(&f.own_seed);
    let one = start(&own_one, None);
    assert!(
        wait_until(WAIT, || own_one.event_ids().is_superset(&f.expected)),
        "one instance: {} of {} events",
        own_one.event_ids().intersection(&f.expected).count(),
        f.expected.len()
    );
    assert!(wait_until(WAIT, || sources(&one) == all_urls));
    common::shutdown_clean(one, &f.remotes.iter().collect::<Vec<_>>());

    // Two shards beside a second own relay with the same stored history.
    let before: Vec<u64> = f.remotes.iter().map(|r| r.connections_accepted()).collect();
    let own_two = own_with(&f.own_seed);
    let shard0 = start(&own_two, Some(Shard { index: 0, count: 2 }));
    let shard1 = start(&own_two, Some(Shard { index: 1, count: 2 }));
    assert!(
        wait_until(WAIT, || own_two.event_ids().is_superset(&f.expected)),
        "two shards: {} of {} events",
        own_two.event_ids().intersection(&f.expected).count(),
        f.expected.len()
    );
    // Each remote relay is a source of exactly the instance whose shard it hashes to.
    let owner = |u: &str| Shard::of(&grasp_sync::RelayUrl::parse(u).unwrap(), 2);
    let want0: HashSet<String> = all_urls.iter().filter(|u| owner(u) == 0).cloned().collect();
    let want1: HashSet<String> = all_urls.iter().filter(|u| owner(u) == 1).cloned().collect();
    assert!(
        wait_until(WAIT, || sources(&shard0) == want0
            && sources(&shard1) == want1),
        "shard 0 {:?} (want {want0:?}), shard 1 {:?} (want {want1:?})",
        sources(&shard0),
        sources(&shard1)
    );
    // Settled: both own relays hold the same events.
    assert!(wait_until(WAIT, || {
        shard0.status().is_settled() && shard1.status().is_settled()
    }));
    assert_eq!(own_two.event_ids(), own_one.event_ids());
    for (i, r) in f.remotes.iter().enumerate() {
        assert!(
            r.connections_accepted() > before[i],
            "{} was not connected by a shard",
            r.url()
        );
    }
    let mut all: Vec<&TestRelay> = f.remotes.iter().collect();
    all.push(&own_two);
    common::shutdown_clean(shard0, &[]);
    common::shutdown_clean(shard1, &all);
}
