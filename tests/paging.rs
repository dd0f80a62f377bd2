//! Complete history from relays that cap their results (10, 50 and 500 events per query),
//! including a same-second burst larger than the cap, over real sockets.

use std::collections::HashSet;
use std::time::Duration;

use grasp_sync::testing::{wait_until, TestRelay, TestRelayOptions};
use grasp_sync::{Config, RelayUrl};
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;
use nostr::types::Timestamp;

fn signed(keys: &Keys, kind: u16, text: String, tags: Vec<Vec<String>>, at: u64) -> Event {
    let mut b =
        EventBuilder::new(Kind::Custom(kind), text).custom_created_at(Timestamp::from_secs(at));
    for t in tags {
        b = b.tag(Tag::parse(t).unwrap());
    }
    b.finalize(keys).unwrap()
}

/// Announces repository `r` of `keys` (listing `remote`) on both relays, created at `at`.
/// Returns its coordinate and the expected set so far (the announcement).
fn announce(
    keys: &Keys,
    own: &TestRelay,
    remote: &TestRelay,
    at: u64,
) -> (String, HashSet<EventId>) {
    let ann = signed(
        keys,
        30617,
        String::new(),
        vec![
            vec!["d".into(), "r".into()],
            vec!["relays".into(), remote.url()],
        ],
        at,
    );
    own.insert(&ann);
    remote.insert(&ann);
    (
        format!("30617:{}:r", keys.public_key().to_hex()),
        [ann.id].into(),
    )
}

/// One repository on a remote relay that returns at most `cap` events per query: 30 root
/// issues at distinct seconds, `2 × cap` replies spread over older seconds and a burst of
/// `3 × cap + 7` replies all created in the same second.
fn capped_history(cap: usize) {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start();
    let remote = TestRelay::start_with(TestRelayOptions {
        result_cap: Some(cap),
        ..TestRelayOptions::default()
    });
    let keys = Keys::generate();
    let now = Timestamp::now().as_secs();
    let (repo, mut expected) = announce(&keys, &own, &remote, now - 100_000);
    let roots: Vec<Event> = (0..30)
        .map(|i| {
            signed(
                &keys,
                1621,
                format!("issue {i}"),
                vec![vec!["a".into(), repo.clone()]],
                now - 90_000 + i,
            )
        })
        .collect();
    let replier = Keys::generate();
    let mut all: Vec<Event> = roots.clone();
    for i in 0..2 * cap {
        let root = &roots[i % roots.len()];
        all.push(signed(
            &replier,
            1111,
            format!("older reply {i}"),
            vec![
                vec!["E".into(), root.id.to_hex()],
                vec!["e".into(), root.id.to_hex()],
            ],
            now - 50_000 + i as u64,
        ));
    }
    let burst_second = now - 1_000;
    for i in 0..3 * cap + 7 {
        let root = &roots[i % roots.len()];
        all.push(signed(
            &replier,
            1111,
            format!("burst reply {i}"),
            vec![vec!["e".into(), root.id.to_hex()]],
            burst_second,
        ));
    }
    for e in &all {
        remote.insert(e);
        expected.insert(e.id);
    }
    let mut config = Config::new(RelayUrl::parse(&own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    // The relay's cap is known (as from NIP-11 `default_limit`), so every split is exact.
    config.assumed_page_size = cap;
    let handle = grasp_sync::start(config).unwrap();
    let ok = wait_until(Duration::from_secs(120), || own.event_ids() == expected);
    let have = own.event_ids();
    let missing = expected.difference(&have).count();
    let extra = have.difference(&expected).count();
    assert!(
        ok,
        "cap {cap}: own relay misses {missing} and has {extra} unexpected of {} events\n{:#?}",
        expected.len(),
        handle.status()
    );
    let pages = handle.with_machine(|m| m.counters());
    assert!(pages.pages_requested > 0, "paging happened");
    assert_eq!(pages.incomplete_queries, 0, "every split was exact");
    // A REQ carries at most 10 filters (decision 0110).
    assert!(remote.reqs().iter().all(|r| r.filters.len() <= 10));
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn relay_capping_at_10() {
    capped_history(10);
}

#[test]
fn relay_capping_at_50() {
    capped_history(50);
}

#[test]
fn relay_capping_at_500() {
    capped_history(500);
}

/// The relay caps at 10 and says so in NIP-11 (`max_limit`); the engine is left at its
/// default assumption (20) and still gets everything because it believes the relay.
#[test]
fn nip11_max_limit_is_believed() {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start();
    let remote = TestRelay::start_with(TestRelayOptions {
        result_cap: Some(10),
        nip11: Some(serde_json::json!({"limitation": {"max_limit": 10}})),
        ..TestRelayOptions::default()
    });
    let keys = Keys::generate();
    let now = Timestamp::now().as_secs();
    let (repo, mut expected) = announce(&keys, &own, &remote, now - 100_000);
    for i in 0..35 {
        let e = signed(
            &keys,
            1621,
            format!("issue {i}"),
            vec![vec!["a".into(), repo.clone()]],
            now - 5_000 + i,
        );
        remote.insert(&e);
        expected.insert(e.id);
    }
    let config = Config::new(RelayUrl::parse(&own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    let handle = grasp_sync::start(config).unwrap();
    let ok = wait_until(Duration::from_secs(60), || own.event_ids() == expected);
    assert!(
        ok,
        "own relay has {} of {}",
        own.event_ids().len(),
        expected.len()
    );
    assert!(remote.nip11_requests() >= 1);
    // REQs carry the explicit limit the relay published.
    assert!(remote.reqs().iter().all(|r| r.filters[0].limit == Some(10)));
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

/// The own relay caps results at 50 while holding 1,000 announcements and 2,000 root events
/// (many sharing a second): the self-subscription pages through all of it, so every
/// repository and root event reaches the index.
#[test]
fn capped_own_relay_is_read_completely() {
    let _ = env_logger::builder().is_test(true).try_init();
    let own = TestRelay::start_with(TestRelayOptions {
        result_cap: Some(50),
        nip11: Some(serde_json::json!({"limitation": {"max_limit": 50}})),
        ..TestRelayOptions::default()
    });
    let remote = TestRelay::start();
    let now = Timestamp::now().as_secs();
    let maintainers: Vec<Keys> = (0..10).map(|_| Keys::generate()).collect();
    let mut repos = HashSet::new();
    let mut roots = HashSet::new();
    for i in 0..1000u64 {
        let keys = &maintainers[(i % 10) as usize];
        let d = format!("repo-{i}");
        let ann = signed(
            keys,
            30617,
            String::new(),
            vec![
                vec!["d".into(), d.clone()],
                vec!["relays".into(), remote.url()],
            ],
            // Ten announcements per second: bursts larger than nothing, smaller than the cap.
            now - 100_000 + i / 10,
        );
        own.insert(&ann);
        let repo = format!("30617:{}:{d}", keys.public_key().to_hex());
        for j in 0..2u64 {
            let root = signed(
                keys,
                if j == 0 { 1621 } else { 1617 },
                format!("root {i}/{j}"),
                vec![vec!["a".into(), repo.clone()]],
                // 60 root events share each second: more than the cap of 50.
                now - 50_000 + (i * 2 + j) / 60,
            );
            own.insert(&root);
            roots.insert(root.id);
        }
        repos.insert(repo);
    }
    let config = Config::new(RelayUrl::parse(&own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(200));
    let handle = grasp_sync::start(config).unwrap();
    let ok = wait_until(Duration::from_secs(120), || {
        let s = handle.status();
        s.repos == 1000 && s.root_events == 2000
    });
    let (indexed_repos, indexed_roots) = handle.with_machine(|m| {
        let r: HashSet<String> = m.repo_index().keys().cloned().collect();
        let e: HashSet<EventId> = m
            .repo_index()
            .values()
            .flat_map(|n| n.root_events.iter().copied())
            .collect();
        (r, e)
    });
    assert!(
        ok,
        "index holds {} repos and {} root events",
        indexed_repos.len(),
        indexed_roots.len()
    );
    assert_eq!(indexed_repos, repos);
    assert_eq!(indexed_roots, roots);
    assert_eq!(handle.with_machine(|m| m.counters().incomplete_queries), 0);
    handle.shutdown(Duration::from_secs(10)).unwrap();
}
