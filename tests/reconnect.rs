//! Reconnect kinds over real sockets: events published on a remote relay while it was
//! unreachable reach the own relay after it comes back (quick and stale reconnect, and a
//! relay unreachable at start).

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::OneRepo;
use grasp_sync::core::{Clock, ConnectionStatus, ManualClock, SystemClock};
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, RelayUrl, SyncHandle};
use nostr::event::EventId;

const DEADLINE: Duration = Duration::from_secs(30);

fn url(r: &TestRelay) -> RelayUrl {
    RelayUrl::parse(&r.url()).unwrap()
}

struct World {
    own: TestRelay,
    remote: TestRelay,
    /// The repository; its issue is the root event on the own relay.
    r: OneRepo,
    expected: HashSet<EventId>,
    /// A simulated clock moved forward 100 ms at every poll while waiting.
    manual: Option<Arc<ManualClock>>,
}

impl World {
    fn new() -> World {
        let own = TestRelay::start();
        let remote = TestRelay::start();
        let r = OneRepo::new(&remote);
        own.insert(&r.ann);
        own.insert(&r.issue);
        remote.insert(&r.ann);
        World {
            expected: [r.ann.id, r.issue.id].into(),
            own,
            remote,
            r,
            manual: None,
        }
    }

    fn tick(&self) {
        if let Some(c) = &self.manual {
            c.advance(Duration::from_millis(100));
        }
    }

    /// Publishes a reply (Layer 3) and an issue (Layer 2) on the remote relay.
    fn publish_remote(&mut self, label: &str) {
        let reply = self.r.reply(&format!("reply {label}"));
        let issue = self.r.another_issue(&format!("issue {label}"));
        self.remote.insert(&reply);
        self.remote.insert(&issue);
        self.expected.insert(reply.id);
        self.expected.insert(issue.id);
    }

    fn start(&self, clock: Arc<dyn Clock>) -> SyncHandle {
        let mut config = Config::new(url(&self.own))
            .allow_private_relays(true)
            .batch_window(Duration::from_millis(100))
            .clock(clock);
        config.backoff.base = Duration::from_millis(200);
        config.backoff.max = Duration::from_secs(1);
        grasp_sync::start(config).unwrap()
    }

    fn wait_complete(&self, h: &SyncHandle, what: &str) {
        let ok = wait_until(DEADLINE, || {
            self.tick();
            self.own.event_ids().is_superset(&self.expected)
        });
        let missing: Vec<_> = self
            .expected
            .difference(&self.own.event_ids())
            .cloned()
            .collect();
        assert!(
            ok,
            "{what}: own relay misses {missing:?}\n{:#?}",
            h.status()
        );
    }

    fn status_of(&self, h: &SyncHandle) -> Option<ConnectionStatus> {
        h.status()
            .relay(&url(&self.remote))
            .map(|r| r.connection_status)
    }

    fn cut(&self, h: &SyncHandle) {
        self.remote.set_refuse_connections(true);
        self.remote.drop_connections();
        assert!(wait_until(DEADLINE, || {
            self.tick();
            self.status_of(h) != Some(ConnectionStatus::Connected)
        }));
    }
}

#[test]
fn quick_reconnect_fetches_events_published_during_the_gap() {
    let mut w = World::new();
    w.publish_remote("before");
    let h = w.start(Arc::new(SystemClock));
    w.wait_complete(&h, "initial sync");
    w.cut(&h);
    w.publish_remote("during the gap");
    w.remote.set_refuse_connections(false);
    w.wait_complete(&h, "after quick reconnect");
    // It was a quick reconnect: Layers 2/3 re-subscribed with since (catch-up), not fresh.
    let reqs = w.remote.reqs();
    let last_conn = reqs.iter().map(|r| r.conn).max().unwrap();
    // Filters, not REQs: several share a REQ (decision 0110).
    let catch_up: Vec<_> = reqs
        .iter()
        .filter(|r| r.conn == last_conn)
        .flat_map(|r| r.filters.iter())
        .filter(|f| f.since.is_some())
        .collect();
    assert!(
        catch_up.len() >= 7,
        "L1 + L2 + L3 with since on the new connection: {reqs:#?}"
    );
    w.publish_remote("live after reconnect");
    w.wait_complete(&h, "live after reconnect");
    h.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn stale_reconnect_after_16_simulated_minutes_is_a_fresh_sync() {
    let mut w = World::new();
    w.publish_remote("before");
    let clock = Arc::new(ManualClock::new(SystemClock.now()));
    w.manual = Some(clock.clone());
    let h = w.start(clock.clone());
    w.wait_complete(&h, "initial sync");
    w.cut(&h);
    w.publish_remote("during a long gap");
    clock.advance(Duration::from_secs(16 * 60));
    w.remote.set_refuse_connections(false);
    w.wait_complete(&h, "after stale reconnect");
    let reqs = w.remote.reqs();
    let last_conn = reqs.iter().map(|r| r.conn).max().unwrap();
    assert!(
        reqs.iter()
            .filter(|r| r.conn == last_conn)
            .all(|r| r.filters[0].since.is_none()),
        "a stale reconnect re-fetches everything without since"
    );
    h.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn relay_unreachable_at_start_is_synced_once_it_comes_up() {
    let mut w = World::new();
    w.publish_remote("waiting");
    w.remote.set_refuse_connections(true);
    let h = w.start(Arc::new(SystemClock));
    assert!(
        wait_until(DEADLINE, || w.remote.tcp_accepts() >= 2),
        "retried"
    );
    assert!(!w.own.event_ids().is_superset(&w.expected));
    w.remote.set_refuse_connections(false);
    w.wait_complete(&h, "after the relay came up");
    h.shutdown(Duration::from_secs(10)).unwrap();
}
