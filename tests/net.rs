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
    let mut c = Config::new(common::url(own)).batch_window(Duration::from_millis(100));
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
