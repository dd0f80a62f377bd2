//! The forwarder thread over a socket (its decisions are tested in simulated time in
//! `core::forward::session_tests`).

use super::*;
use crate::core::health::BackoffPolicy;
use crate::net::ws::{self, WsOptions};

/// Issue 10: the forwarder used to block in a socket read whose timeout was its tick
/// (`WsOptions::tick`) while it waited for `OK`s, so an event arriving meanwhile waited
/// out the tick. With a tick far longer than the test's deadlines, every event is still
/// stored, one right after the other, and a drain ends the thread: nothing waits for a
/// tick.
#[test]
fn events_and_commands_are_handled_without_waiting_for_a_tick() {
    use crate::core::SystemClock;
    use crate::testing::TestRelay;
    use nostr::event::{EventBuilder, FinalizeEvent, Kind};
    use std::time::Instant;

    let own = TestRelay::start();
    let (events_tx, events) = crossbeam_channel::bounded(16);
    let (control_tx, control) = crossbeam_channel::unbounded();
    let (reports, _reports_rx) = crossbeam_channel::bounded(64);
    let tick = Duration::from_secs(3600);
    let forwarder = Forwarder {
        url: RelayUrl::parse(&own.url()).unwrap(),
        events,
        control,
        limits: ForwardLimits::default(),
        ws: WsOptions {
            tick,
            idle_tick: tick,
            ..WsOptions::default()
        },
        tls: ws::tls_config(),
        backoff: BackoffPolicy::default(),
        ping_interval: tick,
        pong_timeout: tick,
        metrics: Arc::new(Metrics::default()),
        gate: Arc::default(),
        drain: std::cell::Cell::new(None),
        clock: Arc::new(SystemClock),
        seed: 1,
        auth_keys: None,
        reports,
        admissions: Admissions::default(),
    };
    let (ended_tx, ended) = crossbeam_channel::bounded(1);
    let thread = std::thread::spawn(move || {
        forwarder.run();
        let _ = ended_tx.send(());
    });
    let keys = Keys::generate();
    let deadline = Duration::from_secs(60);
    for i in 0..3 {
        let event = EventBuilder::new(Kind::TextNote, format!("note {i}"))
            .finalize(&keys)
            .unwrap();
        events_tx
            .send(ForwardItem {
                id: event.id,
                raw: Arc::from(event.as_json()),
                admission: None,
                missing: false,
            })
            .unwrap();
        let end = Instant::now() + deadline;
        while !own.contains(&event.id) {
            assert!(
                Instant::now() < end,
                "event {i} not stored within {deadline:?} (tick {tick:?})"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    control_tx
        .send(ForwarderControl::Drain(Instant::now() + tick))
        .unwrap();
    assert!(
        ended.recv_timeout(deadline).is_ok(),
        "the drain did not end the forwarder within {deadline:?} (tick {tick:?})"
    );
    thread.join().unwrap();
}
