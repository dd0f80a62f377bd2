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

/// Issue 22, item 3: three shard *processes* of the `grasp-sync` binary (as a service
/// manager runs them: `--shard I/3`, each with its own metrics listener) beside one own
/// relay. Together they store exactly the expected set, and no remote relay is a source of
/// two shards (each process's `/status`), every one of some shard.
#[test]
fn three_shard_processes_sync_the_union_and_share_no_relay() {
    use std::process::{Child, Command, Stdio};

    struct Kill(Vec<Child>);
    impl Drop for Kill {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }
    /// The remote relays one process's `/status` lists, and whether each is connected.
    fn status_relays(addr: std::net::SocketAddr) -> Option<Vec<(String, bool)>> {
        let (code, body) =
            grasp_sync::ops::http::get(addr, "/status", Duration::from_secs(5)).ok()?;
        if code != 200 {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        v["relays"].as_array().map(|rs| {
            rs.iter()
                .map(|r| {
                    (
                        r["url"].as_str().unwrap_or("").to_string(),
                        r["connection"].as_str() == Some("connected"),
                    )
                })
                .collect()
        })
    }

    common::init_logging();
    let f = fixture();
    let all_urls: HashSet<String> = f
        .remotes
        .iter()
        .map(|r| url(r).as_str().to_string())
        .collect();
    let own = own_with(&f.own_seed);
    let addrs: Vec<std::net::SocketAddr> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()).parse().unwrap())
        .collect();
    let children = Kill(
        (0..3)
            .map(|i| {
                Command::new(env!("CARGO_BIN_EXE_grasp-sync"))
                    .env_remove("RUST_LOG")
                    .env("GRASP_SYNC_ALLOW_PRIVATE_RELAYS", "1")
                    .args([
                        "--own-relay",
                        url(&own).as_str(),
                        "--shard",
                        &format!("{i}/3"),
                        "--metrics-addr",
                        &addrs[i].to_string(),
                        "--batch-window",
                        "100",
                    ])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start grasp-sync")
            })
            .collect(),
    );
    assert!(
        wait_until(WAIT, || own.event_ids().is_superset(&f.expected)),
        "three shards: {} of {} events",
        own.event_ids().intersection(&f.expected).count(),
        f.expected.len()
    );
    // Each relay is a source of the shard it hashes to, and of that shard only.
    let owner = |u: &str| Shard::of(&grasp_sync::RelayUrl::parse(u).unwrap(), 3);
    let mut seen: Vec<HashSet<String>> = vec![HashSet::new(); 3];
    let agreed = wait_until(WAIT, || {
        for (i, addr) in addrs.iter().enumerate() {
            let Some(rs) = status_relays(*addr) else {
                return false;
            };
            if rs.iter().any(|(_, connected)| !connected) {
                return false;
            }
            seen[i] = rs.into_iter().map(|(u, _)| u).collect();
        }
        (0..3).all(|i| {
            seen[i]
                == all_urls
                    .iter()
                    .filter(|u| owner(u) == i as u64)
                    .cloned()
                    .collect::<HashSet<_>>()
        })
    });
    assert!(agreed, "sources per shard: {seen:?}");
    for i in 0..3 {
        for j in i + 1..3 {
            assert!(
                seen[i].is_disjoint(&seen[j]),
                "shards {i} and {j} share a relay"
            );
        }
    }
    let union: HashSet<String> = seen.iter().flatten().cloned().collect();
    assert_eq!(union, all_urls, "every remote relay is synced by a shard");
    assert_eq!(
        own.event_ids(),
        f.expected
            .union(&f.own_seed.iter().map(|e| e.id).collect())
            .copied()
            .collect::<HashSet<_>>(),
        "exactly the expected set"
    );
    drop(children);
}
