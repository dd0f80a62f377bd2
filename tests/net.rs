//! Network-layer faults over real sockets on 127.0.0.1: relay URLs that must stay reachable
//! after normalisation, oversized stored events, handshake deadlines, threads that die, and
//! shutdown while the coordinator's input channel is full.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{announcement, repo_ref, root, WAIT};
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, RelayUrl};
use nostr::event::EventId;
use nostr::key::Keys;

fn config(own: &TestRelay) -> Config {
    let mut c = Config::new(common::url(own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    c.backoff.base = Duration::from_millis(200);
    c
}

/// Issue 7 item 10: `ws://host:port/?n=1` used to be normalised to `ws://host:port?n=1`,
/// whose request line (`GET ?n=1`) real relays answer with 400. The announced URL with a
/// query must still be synced from.
#[test]
fn a_relay_url_with_a_query_stays_reachable_after_normalisation() {
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let keys = Keys::generate();
    let announced = format!("ws://127.0.0.1:{}/?n=1", remote.port());
    let ann = announcement(&keys, "r", &[&[&announced]]);
    let issue = root(&keys, 1621, &repo_ref(&keys, "r"), "issue", &[]);
    own.insert(&ann);
    remote.insert(&ann);
    remote.insert(&issue);
    let expected: HashSet<EventId> = [ann.id, issue.id].into();
    let handle = grasp_sync::start(config(&own)).unwrap();
    assert!(
        wait_until(WAIT, || own.event_ids() == expected),
        "{:#?}",
        handle.status()
    );
    let status = handle.status();
    let url = RelayUrl::parse(&announced).unwrap();
    assert_eq!(url.as_str(), announced, "the `/` before the query is kept");
    let r = status.relay(&url).expect("the announced relay is known");
    assert_eq!(r.disconnects, 0, "{r:#?}");
    common::shutdown_clean(handle, &[&own, &remote]);
}

/// Issue 7 item 6: a stored event above the 1 MiB frame cap used to end the connection; it
/// was fetched again on every reconnect and the relay flapped for ever. Now it is dropped and
/// counted once, the connection is kept, and everything else on that relay arrives.
#[test]
fn one_oversized_stored_event_does_not_stop_a_relay() {
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = common::OneRepo::new(&remote);
    let mut expected = r.seed(&own, &remote);
    for i in 0..3 {
        let e = r.reply(&format!("normal reply {i}"));
        remote.insert(&e);
        expected.insert(e.id);
    }
    // Above the soft cap (1 MiB), below the hard cap (1 MiB + 64 KiB).
    let huge = r.reply(&"x".repeat((1 << 20) + 1024));
    assert!(huge.as_json().len() > 1 << 20);
    remote.insert(&huge);
    let handle = grasp_sync::start(config(&own)).unwrap();
    let url = common::url(&remote);
    let relay = |h: &grasp_sync::SyncHandle| h.status().relay(&url).cloned();
    assert!(
        wait_until(WAIT, || own.event_ids() == expected
            && handle.status().is_settled()),
        "{:#?}",
        handle.status()
    );
    assert!(wait_until(WAIT, || relay(&handle)
        .is_some_and(|s| s.oversized_frames == 1)));
    // Settled, and the one connection was never lost: no reconnect loop.
    let s = relay(&handle).unwrap();
    assert_eq!((s.connects, s.disconnects), (1, 0), "{s:#?}");
    assert_eq!(remote.connections_accepted(), 1);
    assert!(!own.contains(&huge.id));
    common::shutdown_clean(handle, &[&own, &remote]);
}

/// Issue 7 item 7: a relay thread, the self-subscription or the forwarder that panics is
/// noticed by the coordinator, counted in the status and started again; sync continues.
#[test]
fn a_panicking_thread_is_restarted_and_sync_continues() {
    use grasp_sync::engine::PanicTarget;
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = common::OneRepo::new(&remote);
    let mut expected = r.seed(&own, &remote);
    let handle = grasp_sync::start(config(&own)).unwrap();
    let converged = |expected: &HashSet<EventId>| {
        wait_until(WAIT, || {
            own.event_ids() == *expected && handle.status().is_settled()
        })
    };
    assert!(converged(&expected), "{:#?}", handle.status());
    let remote_url = common::url(&remote);
    let targets = [
        PanicTarget::Relay(remote_url.clone()),
        PanicTarget::Relay(common::url(&own)),
        PanicTarget::Forwarder,
    ];
    for (i, target) in targets.into_iter().enumerate() {
        handle.inject_panic(target.clone());
        assert!(
            wait_until(WAIT, || handle.status().thread_restarts == i as u64 + 1),
            "{target:?} not restarted: {:#?}",
            handle.status()
        );
        let e = r.reply(&format!("after the panic of {target:?}"));
        remote.insert(&e);
        expected.insert(e.id);
        assert!(
            converged(&expected),
            "after {target:?}: {:#?}",
            handle.status()
        );
    }
    let s = handle.status();
    assert_eq!(s.forwarder_restarts, 1);
    assert_eq!(s.relay(&remote_url).unwrap().thread_restarts, 1);
    assert!(s.coordinator_running);
    common::shutdown_clean(handle, &[&own, &remote]);
}

/// Issue 7 item 7: `shutdown` used to `try_send` its message and give up when the
/// coordinator's input channel was full; the coordinator then ran for ever. Here the
/// channel (capacity 1) is full while shutdown is called, and everything still stops.
#[test]
fn shutdown_with_a_full_input_channel_still_stops() {
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = common::OneRepo::new(&remote);
    let expected = r.seed(&own, &remote);
    let mut c = config(&own);
    c.input_channel = 1;
    let handle = grasp_sync::start(c).unwrap();
    assert!(wait_until(WAIT, || own.event_ids() == expected
        && handle.status().is_settled()));
    let (held_tx, held_rx) = crossbeam_channel::bounded::<()>(1);
    let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(1);
    let result = std::thread::scope(|scope| {
        // Holding a read lock on the machine stalls the coordinator at its next report.
        scope.spawn(|| {
            handle.with_machine(|_| {
                held_tx.send(()).unwrap();
                let _ = release_rx.recv();
            })
        });
        held_rx.recv().unwrap();
        for i in 0..4 {
            remote.send_notice(&format!("notice {i}"));
        }
        assert!(
            wait_until(WAIT, || handle.input_backlog() == 1),
            "the input channel did not fill"
        );
        let stopper = scope.spawn(|| handle.shutdown(Duration::from_secs(20)));
        // The relay threads see the stop flag and close their sockets: shutdown has run its
        // send. The forwarder keeps its connection until the coordinator tells it to drain
        // (it flushes what it holds first), so at most that one stays open meanwhile.
        assert!(wait_until(WAIT, || own.current_connections() <= 1
            && remote.current_connections() == 0));
        release_tx.send(()).unwrap();
        stopper.join().unwrap()
    });
    assert!(result.is_ok(), "{result:?}");
    assert!(!handle.status().coordinator_running);
}
