//! Safe on a public host (issue 8): repository scope, relay quotas, a relay that lies about
//! its history, and byte bounds of the forward pipeline. Real sockets on 127.0.0.1 only.
//!
//! Note on the address policy (another branch): the remote relays here are test relays on
//! 127.0.0.1. If discovered relays on loopback addresses are refused by default, `config()`
//! below is the one place to allow them.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{announcement, has_l2_req, repo_ref, root, url, OneRepo};
use grasp_sync::core::targets::RepoScope;
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, RelayUrl};
use nostr::event::EventId;
use nostr::key::Keys;

const DEADLINE: Duration = Duration::from_secs(30);

/// The test configuration: a short batch window and quick reconnects.
fn config(own: &TestRelay) -> Config {
    let mut config = Config::new(url(own))
        .batch_window(Duration::from_millis(100))
        .allow_private_relays(true);
    config.backoff.base = Duration::from_millis(200);
    config
}

/// Two repositories: `ours` lists this service (its public URL), `foreign` does not. With
/// `--public-url` only `ours` is synced, and nothing of `foreign` (not even its root event's
/// thread) is asked for; with `--archive` both are.
#[test]
fn only_repositories_listing_this_service_are_synced_unless_archive() {
    common::init_logging();
    for archive in [false, true] {
        let own = TestRelay::start();
        let ours_remote = TestRelay::start();
        let foreign_remote = TestRelay::start();
        let public = "wss://git.example.com";
        let keys = Keys::generate();
        let ours = announcement(&keys, "ours", &[&[public, &ours_remote.url()]]);
        let foreign = announcement(&keys, "foreign", &[&[&foreign_remote.url()]]);
        let foreign_issue = root(&keys, 1621, &repo_ref(&keys, "foreign"), "issue", &[]);
        let ours_issue = root(&keys, 1621, &repo_ref(&keys, "ours"), "issue", &[]);
        for e in [&ours, &foreign, &foreign_issue, &ours_issue] {
            own.insert(e);
        }
        let reply = common::comment(&keys, &ours_issue, "a reply on our repository");
        ours_remote.insert(&reply);
        let foreign_reply = common::comment(&keys, &foreign_issue, "a reply elsewhere");
        foreign_remote.insert(&foreign_reply);

        let mut c = config(&own).public_url(RelayUrl::parse(public).unwrap());
        c.archive = archive;
        let handle = grasp_sync::start(c).unwrap();
        assert!(wait_until(DEADLINE, || handle.status().repos == 2));
        assert!(
            wait_until(DEADLINE, || own.contains(&reply.id)),
            "the repository listing this service is synced"
        );
        let status = handle.status();
        if archive {
            assert_eq!(status.repo_scope, RepoScope::All);
            assert!(wait_until(DEADLINE, || own.contains(&foreign_reply.id)));
            assert!(has_l2_req(
                &foreign_remote,
                'a',
                &repo_ref(&keys, "foreign")
            ));
        } else {
            assert!(matches!(status.repo_scope, RepoScope::ListingService(_)));
            assert!(wait_until(DEADLINE, || handle.status().is_settled()));
            let status = handle.status();
            assert_eq!(status.targets.repos_out_of_scope, 1, "{status:#?}");
            assert_eq!(status.targets.repos_in_scope, 1);
            assert_eq!(
                foreign_remote.tcp_accepts(),
                0,
                "a repository not listing this service must not make us connect anywhere"
            );
            assert!(status.relay(&url(&foreign_remote)).is_none());
            assert!(!own.contains(&foreign_reply.id));
        }
        handle.shutdown(Duration::from_secs(10)).unwrap();
    }
}

/// One key announces 50 repositories, each naming two relays of its own (unreachable ports
/// on 127.0.0.1 that sort before the legitimate relay's URL, so first come, first served
/// would connect them first). With `max_relays` 20 the legitimate repository's relay still
/// gets a slot and its history arrives; the junk relays over the cap are counted.
#[test]
fn junk_announcements_of_one_key_do_not_starve_a_legitimate_repository() {
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let junk_keys = Keys::generate();
    for i in 0..50u16 {
        let a = format!("ws://127.0.0.1:{}", 1000 + 2 * i);
        let b = format!("ws://127.0.0.1:{}", 1001 + 2 * i);
        own.insert(&announcement(&junk_keys, &format!("junk{i}"), &[&[&a, &b]]));
    }
    let r = OneRepo::new(&remote);
    own.insert(&r.ann);
    own.insert(&r.issue);
    let reply = r.reply("legitimate history");
    remote.insert(&reply);
    let mut c = config(&own);
    c.max_relays = 20;
    let handle = grasp_sync::start(c).unwrap();
    assert!(
        wait_until(DEADLINE, || own.contains(&reply.id)),
        "the legitimate relay must be synced: {:#?}",
        handle.status().targets
    );
    let status = handle.status();
    assert!(status.relays.len() <= 20, "{}", status.relays.len());
    assert!(status.relay(&url(&remote)).is_some());
    assert_eq!(status.targets.repos_in_scope, 51);
    assert_eq!(status.targets.relays_wanted, 101);
    assert_eq!(status.targets.relays_selected, 20);
    assert_eq!(status.targets.relays_over_global_cap, 45);
    // The per-pubkey quota (64) drops 36 of the junk key's 100 relays before the cap.
    assert_eq!(status.targets.pubkeys_over_quota, 1);
    assert_eq!(status.targets.relays_over_pubkey_quota, 36);
    let expected: HashSet<EventId> = [r.issue.id, reply.id].into();
    assert!(expected.iter().all(|id| own.contains(id)));
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

/// A relay that ignores `since`/`until` (every page returns its newest events again) and
/// caps at 5 events per query. Events outside the requested window fail the filter check
/// and do not count as history, so the second page is "full of rejected events": the query
/// is reported incomplete after two REQs instead of asking for the same page for ever.
#[test]
fn a_relay_lying_about_the_window_ends_incomplete_within_a_few_reqs() {
    use grasp_sync::testing::TestRelayOptions;
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    use nostr::types::Timestamp;
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start_with(TestRelayOptions {
        result_cap: Some(5),
        ignore_time_window: true,
        ..TestRelayOptions::default()
    });
    let r = OneRepo::new(&remote);
    own.insert(&r.ann);
    let now = Timestamp::now().as_secs();
    for i in 0..20u64 {
        let e = EventBuilder::new(Kind::Custom(1621), format!("issue {i}"))
            .tag(Tag::parse(["a", r.repo.as_str()]).unwrap())
            .custom_created_at(Timestamp::from_secs(now - 10_000 + i * 10))
            .finalize(&r.keys)
            .unwrap();
        remote.insert(&e);
    }
    let mut c = config(&own);
    c.assumed_page_size = 5;
    let handle = grasp_sync::start(c).unwrap();
    let done = wait_until(DEADLINE, || {
        handle.with_machine(|m| m.counters().incomplete_queries) >= 1
            && handle.status().is_settled()
    });
    assert!(
        done,
        "the lying relay must end incomplete: {:#?} after {} REQs",
        handle.with_machine(|m| m.counters()),
        remote.reqs().len()
    );
    let status = handle.status();
    let relay = status.relay(&url(&remote)).unwrap();
    assert!(relay.events_unmatched >= 4, "{relay:#?}");
    // Layer 1, three Layer-2 queries and one page of the `#a` one.
    let reqs = remote.reqs().len();
    assert!(reqs <= 8, "{reqs} REQs: {:#?}", remote.reqs());
    let relay_state =
        handle.with_machine(|m| m.relay(&url(&remote)).unwrap().state().incomplete_batches);
    assert_eq!(relay_state, 1, "the batch is confirmed INCOMPLETE");
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

/// Twelve events of about 700 KiB from one relay while the own relay is down: the relay's
/// thread waits at its 2 MiB share of the forward pipeline (4 MiB in all) instead of
/// handing over everything (8 MiB would sit in the channel and the queue otherwise). When
/// the own relay is back, every event arrives and the peak stayed within the share.
#[test]
fn big_events_from_one_relay_stay_within_the_pipeline_byte_bound() {
    use grasp_sync::core::forward::ForwardLimits;
    common::init_logging();
    let mut own = TestRelay::start();
    let remote = TestRelay::start();
    let r = OneRepo::new(&remote);
    own.insert(&r.ann);
    let mut c = config(&own);
    c.forward = ForwardLimits {
        max_bytes: 4 << 20,
        relay_bytes: 2 << 20,
        ..ForwardLimits::default()
    };
    let handle = grasp_sync::start(c).unwrap();
    assert!(wait_until(DEADLINE, || has_l2_req(&remote, 'a', &r.repo)
        && handle.status().is_settled()));
    own.stop();
    assert!(wait_until(DEADLINE, || !handle
        .status()
        .forwarder_connected));
    let big: Vec<nostr::event::Event> = (0..12)
        .map(|i| {
            let body = format!("{i}{}", "x".repeat(700 << 10));
            root(&r.keys, 1621, &r.repo, &body, &[])
        })
        .collect();
    for e in &big {
        remote.insert(e);
    }
    let waiting = wait_until(DEADLINE, || {
        handle
            .status()
            .relay(&url(&remote))
            .is_some_and(|s| s.forward_byte_waits >= 1)
    });
    let status = handle.status();
    assert!(waiting, "the relay thread waits at its share: {status:#?}");
    // Back-pressure: the machine knows the relay is not read, its EOSE deadlines wait.
    assert!(wait_until(DEADLINE, || handle
        .with_machine(|m| m.is_stalled(&url(&remote)))));
    assert!(status.forward_bytes >= 1 << 20, "{}", status.forward_bytes);
    assert!(
        status.forward_bytes_peak <= 2 << 20,
        "peak {} over the 2 MiB share",
        status.forward_bytes_peak
    );
    own = own.restart().unwrap();
    let ids: HashSet<EventId> = big.iter().map(|e| e.id).collect();
    assert!(
        wait_until(Duration::from_secs(60), || ids
            .iter()
            .all(|id| own.contains(id))),
        "every big event arrives once the own relay is back: {:#?}",
        handle.status()
    );
    assert!(wait_until(DEADLINE, || !handle
        .with_machine(|m| m.is_stalled(&url(&remote)))));
    let status = handle.status();
    assert!(
        status.forward_bytes_peak <= 2 << 20,
        "{}",
        status.forward_bytes_peak
    );
    assert!(wait_until(DEADLINE, || handle.status().forward_bytes == 0));
    handle.shutdown(Duration::from_secs(10)).unwrap();
}
