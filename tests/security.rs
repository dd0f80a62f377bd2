//! The address policy over real sockets: relays discovered from events that resolve to
//! loopback (however the URL spells it) are never contacted, not even for NIP-11, unless
//! `allow_private_relays` is set; the own relay under another spelling is never a target.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{announcement, repo_ref, root, WAIT};
use grasp_sync::net::RelayPattern;
use grasp_sync::shared::Refusal;
use grasp_sync::testing::{wait_until, TestRelay, TestRelayOptions};
use grasp_sync::{Config, RelayUrl, SyncHandle};
use nostr::event::EventId;
use nostr::key::Keys;

fn ipv6_loopback_available() -> bool {
    std::net::TcpListener::bind("[::1]:0").is_ok()
}

fn relay_with_nip11() -> TestRelay {
    TestRelay::start_with(TestRelayOptions {
        nip11: Some(serde_json::json!({"name": "test"})),
        ..Default::default()
    })
}

/// Four relays announced under loopback spellings; each holds an issue of the repository.
struct Scenario {
    own: TestRelay,
    remotes: Vec<(TestRelay, String)>,
    expected_with_flag: HashSet<EventId>,
    announced: Vec<String>,
}

fn scenario() -> Scenario {
    let own = TestRelay::start();
    let keys = Keys::generate();
    let repo = repo_ref(&keys, "r");
    let mut remotes = Vec::new();
    let spellings: [fn(u16) -> String; 3] = [
        |p| format!("ws://127.0.0.1:{p}"),
        |p| format!("ws://localhost:{p}"),
        // 2130706433 = 127.0.0.1 as one decimal number (the resolver accepts it).
        |p| format!("ws://2130706433:{p}"),
    ];
    for spell in spellings {
        let r = relay_with_nip11();
        let url = spell(r.port());
        remotes.push((r, url));
    }
    let mut announced: Vec<String> = remotes.iter().map(|(_, u)| u.clone()).collect();
    if ipv6_loopback_available() {
        // Nothing listens there; it must be refused without the flag all the same.
        announced.push("ws://[::1]:9".to_string());
    }
    let tags: Vec<Vec<&str>> = announced.iter().map(|u| vec![u.as_str()]).collect();
    let tag_refs: Vec<&[&str]> = tags.iter().map(|t| t.as_slice()).collect();
    let ann = announcement(&keys, "r", &tag_refs);
    own.insert(&ann);
    let mut expected_with_flag: HashSet<EventId> = [ann.id].into();
    for (i, (r, _)) in remotes.iter().enumerate() {
        r.insert(&ann);
        let issue = root(&keys, 1621, &repo, &format!("issue on relay {i}"), &[]);
        r.insert(&issue);
        expected_with_flag.insert(issue.id);
    }
    Scenario {
        own,
        remotes,
        expected_with_flag,
        announced,
    }
}

fn config(own: &TestRelay) -> Config {
    let mut c = Config::new(common::url(own)).batch_window(Duration::from_millis(100));
    c.backoff.base = Duration::from_millis(200);
    c
}

fn refused(handle: &SyncHandle) -> Vec<(RelayUrl, Refusal)> {
    handle.status().refused_relays
}

#[test]
fn discovered_loopback_relays_are_never_contacted_without_the_flag() {
    common::init_logging();
    let s = scenario();
    let handle = grasp_sync::start(config(&s.own)).unwrap();
    let n = s.announced.len();
    assert!(
        wait_until(WAIT, || refused(&handle).len() == n),
        "{:#?}",
        handle.status()
    );
    for (url, reason) in refused(&handle) {
        assert_eq!(reason.label(), "non_public_address", "{url}: {reason}");
        let text = reason.to_string();
        assert!(
            text.contains("loopback") && text.contains("--allow-private-relays"),
            "{url}: {reason}"
        );
    }
    let status = handle.status();
    assert_eq!(status.relays_refused, n as u64);
    assert!(status.relays.is_empty(), "{:#?}", status.relays);
    // The machine dropped them: no connect will ever be tried again.
    assert!(handle.with_machine(|m| m.relays().len() == 0));
    for (r, url) in &s.remotes {
        assert_eq!(r.tcp_accepts(), 0, "{url} was contacted");
        assert_eq!(r.nip11_requests(), 0, "{url} got a NIP-11 request");
    }
    assert_eq!(s.own.len(), 1, "nothing but the announcement");
    common::shutdown_clean(handle, &[&s.own]);
}

#[test]
fn discovered_loopback_relays_are_synced_with_the_flag() {
    common::init_logging();
    let s = scenario();
    let handle = grasp_sync::start(config(&s.own).allow_private_relays(true)).unwrap();
    assert!(
        wait_until(WAIT, || s.own.event_ids() == s.expected_with_flag),
        "{:#?}",
        handle.status()
    );
    for (r, url) in &s.remotes {
        assert!(r.tcp_accepts() > 0, "{url} was not contacted");
        assert!(r.nip11_requests() > 0, "{url} got no NIP-11 request");
    }
    assert!(refused(&handle).is_empty(), "{:#?}", refused(&handle));
    let relays: Vec<&(TestRelay, String)> = s.remotes.iter().collect();
    let mut all: Vec<&TestRelay> = relays.iter().map(|(r, _)| r).collect();
    all.push(&s.own);
    common::shutdown_clean(handle, &all);
}

#[test]
fn the_own_relay_under_another_spelling_is_never_a_target() {
    common::init_logging();
    let own = TestRelay::start();
    let port = own.port();
    let keys = Keys::generate();
    let spellings = [
        format!("ws://localhost:{port}"),
        format!("ws://127.0.0.2:{port}"),
        format!("ws://2130706433:{port}/"),
    ];
    let tags: Vec<Vec<&str>> = spellings.iter().map(|u| vec![u.as_str()]).collect();
    let tag_refs: Vec<&[&str]> = tags.iter().map(|t| t.as_slice()).collect();
    let ann = announcement(&keys, "r", &tag_refs);
    own.insert(&ann);
    // Even with the address check lifted.
    let handle = grasp_sync::start(config(&own).allow_private_relays(true)).unwrap();
    assert!(
        wait_until(WAIT, || refused(&handle).len() == spellings.len()),
        "{:#?}",
        handle.status()
    );
    for (url, reason) in refused(&handle) {
        assert_eq!(reason.label(), "own_relay", "{url}: {reason}");
        assert!(reason.to_string().contains("own relay"), "{url}: {reason}");
    }
    // The refusal is counted before its report reaches the machine: wait for the machine.
    assert!(wait_until(WAIT, || handle.with_machine(|m| m.relays().len() == 0)));
    // Only the self-subscription and the forwarder hold websockets to the own relay.
    assert!(wait_until(WAIT, || handle.status().is_settled()));
    assert_eq!(own.connections_accepted(), 2);
    common::shutdown_clean(handle, &[&own]);
}

/// The own relay is known by every address of this host (issue 20, item 3): an
/// announcement naming this host's interface address with the own relay's port (the own
/// relay listening on all interfaces would answer there) is refused as the own relay before
/// any connect, even with the address check lifted; another port of that address is a
/// service of this host, refused without the flag (as `this_host` when the address is
/// public, by its kind when it is not). Skipped on a host with no interface
/// but loopback. No socket is opened to any address but 127.0.0.1.
#[test]
fn the_own_relay_under_this_hosts_interface_address_is_refused() {
    common::init_logging();
    let Some(ip) = if_addrs::get_if_addrs()
        .unwrap()
        .into_iter()
        .map(|i| i.ip())
        .find(|ip| !ip.is_loopback())
    else {
        eprintln!("no interface address but loopback: skipped");
        return;
    };
    let host = match ip {
        std::net::IpAddr::V4(v4) => v4.to_string(),
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
    };
    for allow_private in [true, false] {
        let own = TestRelay::start();
        let keys = Keys::generate();
        let as_own = format!("ws://{host}:{}", own.port());
        // Another port of this host only without the flag (with it, it would be connected).
        let other_port = format!("ws://{host}:1");
        let named: Vec<&str> = if allow_private {
            vec![&as_own]
        } else {
            vec![&as_own, &other_port]
        };
        own.insert(&announcement(&keys, "r", &[&named]));
        let handle = grasp_sync::start(config(&own).allow_private_relays(allow_private)).unwrap();
        let want = if allow_private { 1 } else { 2 };
        assert!(
            wait_until(WAIT, || refused(&handle).len() == want),
            "{:#?}",
            handle.status()
        );
        for (url, reason) in refused(&handle) {
            if url.port() == own.port() {
                assert_eq!(reason.label(), "own_relay", "{url}: {reason}");
            } else {
                // A public interface address is "this host"; a private one keeps its kind.
                assert_eq!(reason.label(), "non_public_address", "{url}: {reason}");
            }
        }
        common::shutdown_clean(handle, &[&own]);
    }
}

#[test]
fn a_denied_relay_is_refused_even_with_the_flag() {
    common::init_logging();
    let s = scenario();
    let mut c = config(&s.own).allow_private_relays(true);
    c.deny_relays = vec![RelayPattern::parse("localhost").unwrap()];
    let handle = grasp_sync::start(c).unwrap();
    assert!(wait_until(WAIT, || refused(&handle).len() == 1));
    let (url, reason) = refused(&handle).remove(0);
    assert_eq!(url.host(), "localhost");
    assert_eq!(
        reason,
        Refusal::Denied {
            pattern: "localhost".into()
        }
    );
    assert!(
        reason.to_string().contains("--deny-relay localhost"),
        "{reason}"
    );
    let denied = s
        .remotes
        .iter()
        .find(|(_, u)| u.contains("localhost"))
        .unwrap();
    assert_eq!(denied.0.tcp_accepts(), 0);
    common::shutdown_clean(handle, &[&s.own]);
}

/// A bootstrap relay is trusted, but not when it is the own relay under another name.
#[test]
fn a_bootstrap_relay_that_is_the_own_relay_is_refused() {
    common::init_logging();
    let own = TestRelay::start();
    let alias = RelayUrl::parse(&format!("ws://localhost:{}", own.port())).unwrap();
    let handle = grasp_sync::start(config(&own).bootstrap(alias.clone())).unwrap();
    assert!(
        wait_until(WAIT, || refused(&handle).len() == 1),
        "{:#?}",
        handle.status()
    );
    let (url, reason) = refused(&handle).remove(0);
    assert_eq!(url, alias);
    assert_eq!(reason.label(), "own_relay", "{reason}");
    assert!(reason.to_string().contains("own relay"), "{reason}");
    assert!(wait_until(WAIT, || handle.status().is_settled()));
    assert_eq!(own.connections_accepted(), 2);
    common::shutdown_clean(handle, &[&own]);
}

/// `--allow-relay` exempts matching relays from the address check; the others stay refused.
#[test]
fn an_allowed_relay_is_exempt_from_the_address_check() {
    common::init_logging();
    let s = scenario();
    let mut c = config(&s.own);
    c.allow_relays = vec![RelayPattern::parse("localhost").unwrap()];
    let handle = grasp_sync::start(c).unwrap();
    let (allowed, _) = s
        .remotes
        .iter()
        .find(|(_, u)| u.contains("localhost"))
        .unwrap();
    let from_allowed: HashSet<EventId> = allowed.event_ids();
    assert!(
        wait_until(WAIT, || from_allowed.is_subset(&s.own.event_ids())
            && refused(&handle).len() == s.announced.len() - 1),
        "{:#?}",
        handle.status()
    );
    assert!(refused(&handle)
        .iter()
        .all(|(u, _)| u.host() != "localhost"));
    for (r, url) in &s.remotes {
        if !url.contains("localhost") {
            assert_eq!(r.tcp_accepts(), 0, "{url} was contacted");
        }
    }
    common::shutdown_clean(handle, &[&s.own, allowed]);
}
