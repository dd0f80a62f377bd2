//! Copies of an event are verified once (issue 10): the same event from three relays, from
//! two overlapping subscriptions and read back from the own relay costs one Schnorr
//! signature check, over real sockets on 127.0.0.1. A remote relay's copy of an event already
//! handed to the forwarder is recognised by its id and dropped unparsed (decision 0066).
//!
//! The relay threads are driven directly (no coordinator), one after the other, so that
//! which thread sees an event first is fixed and every count is exact.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, Sender};
use grasp_sync::core::dedup::ForwardGate;
use grasp_sync::core::forward::ForwardLimits;
use grasp_sync::core::time::SystemClock;
use grasp_sync::net::WsOptions;
use grasp_sync::testing::internals::ForwardItem;
use grasp_sync::testing::internals::Input;
use grasp_sync::testing::internals::{connection, ConnectionThread, Control, Role};
use grasp_sync::testing::internals::{Metrics, RelayCounters};
use grasp_sync::testing::{wait_until, TestRelay, TestRelayOptions};
use grasp_sync::{Config, RelayUrl};
use nostr::event::{Event, FinalizeEvent};
use nostr::filter::Filter;
use nostr::key::Keys;
use nostr::message::SubscriptionId;

use common::WAIT;

struct Thread {
    control: Sender<Control>,
    counters: Arc<RelayCounters>,
    handle: std::thread::JoinHandle<()>,
}

/// What the relay threads of one engine share.
#[derive(Default)]
struct Shared {
    metrics: Arc<Metrics>,
    gate: Arc<ForwardGate>,
}

fn spawn(relay: &TestRelay, role: Role, shared: &Shared, reports: &Sender<Input>) -> Thread {
    let metrics = &shared.metrics;
    let url = RelayUrl::parse(&relay.url()).unwrap();
    let (control, rx) = unbounded();
    let counters = metrics.relay(&url);
    // The relay is a remote relay here: the configuration's own relay is elsewhere (its
    // addresses are refused as the own relay's).
    let policy = Config::new(RelayUrl::parse("ws://127.0.0.1:1").unwrap())
        .allow_private_relays(true)
        .address_policy(vec![]);
    let handle = connection::spawn(ConnectionThread {
        url,
        role,
        control: rx,
        reports: reports.clone(),
        ws: WsOptions::default(),
        tls: grasp_sync::net::tls_config(),
        ping_interval: Duration::from_secs(30),
        pong_timeout: Duration::from_secs(30),
        counters: counters.clone(),
        metrics: metrics.clone(),
        gate: shared.gate.clone(),
        stopping: Arc::new(AtomicBool::new(false)),
        clock: Arc::new(SystemClock),
        nip11_timeout: Duration::ZERO,
        auth_keys: None,
        policy: Arc::new(policy),
        forward_limits: ForwardLimits::default(),
        waker: Default::default(),
    })
    .unwrap();
    control.send(Control::Connect { generation: 1 }).unwrap();
    Thread {
        control,
        counters,
        handle,
    }
}

fn subscribe(t: &Thread, sub: &str, filter: Filter) {
    t.control
        .send(Control::Subscribe {
            generation: 1,
            sub_id: SubscriptionId::new(sub),
            filter: std::sync::Arc::new(filter),
            scope: None,
            fetch_since: None,
        })
        .unwrap();
}

fn accepted(t: &Thread) -> u64 {
    RelayCounters::get(&t.counters.events_accepted)
}

fn received(t: &Thread) -> u64 {
    RelayCounters::get(&t.counters.events_received)
}

fn copies(t: &Thread) -> u64 {
    RelayCounters::get(&t.counters.copies_not_forwarded)
}

fn checks(t: &Thread) -> u64 {
    RelayCounters::get(&t.counters.signature_checks)
}

fn forwarded(rx: &Receiver<ForwardItem>, n: usize) -> Vec<ForwardItem> {
    (0..n)
        .map(|_| rx.recv_timeout(WAIT).expect("a forwarded event"))
        .collect()
}

/// `e`'s JSON as relays write it (the id first) with its content replaced: a forgery that
/// reuses the id and signature.
fn forge_in_place(e: &Event, content: &str) -> String {
    let json = e.as_json();
    let old = format!("\"content\":{}", serde_json::to_string(&e.content).unwrap());
    assert!(json.starts_with("{\"id\":\"") && json.contains(&old));
    json.replacen(
        &old,
        &format!("\"content\":{}", serde_json::to_string(content).unwrap()),
        1,
    )
}

/// [`common::forge_content`] with the id's key written `"i\u0064"`: the same object for a
/// JSON parser, but not read by `claimed_id` (which compares keys byte for byte).
fn forge_escaped_key(e: &Event, content: &str) -> String {
    let forged = common::forge_content(e, content);
    assert!(forged.contains("\"id\":"));
    forged.replacen("\"id\":", "\"i\\u0064\":", 1)
}

#[test]
fn an_event_from_three_relays_and_read_back_is_verified_once() {
    common::init_logging();
    let keys = Keys::generate();
    let issue: Event = common::root(&keys, 1621, &common::repo_ref(&keys, "r"), "issue", &[]);
    // The last two write events with their keys sorted (`content` first), as rust-nostr's
    // relay builder does: their copies are recognised by their id all the same.
    let relays: Vec<TestRelay> = (0..3)
        .map(|i| {
            TestRelay::start_with(TestRelayOptions {
                sorted_keys: i > 0,
                ..TestRelayOptions::default()
            })
        })
        .collect();
    let own = TestRelay::start();
    for r in relays.iter().chain([&own]) {
        r.insert(&issue);
    }
    let metrics = Shared::default();
    let (reports, reports_rx) = unbounded::<Input>();
    let (forward, forward_rx) = unbounded::<ForwardItem>();
    let by_kind = Filter::new().kind(issue.kind);
    let by_author = Filter::new().author(keys.public_key());

    // The first relay, on two overlapping subscriptions: one check.
    let first = spawn(
        &relays[0],
        Role::Remote(forward.clone()),
        &metrics,
        &reports,
    );
    subscribe(&first, "a", by_kind.clone());
    assert!(wait_until(WAIT, || accepted(&first) == 1));
    subscribe(&first, "b", by_author.clone());
    assert!(wait_until(WAIT, || received(&first) == 2));
    assert_eq!(
        (checks(&first), accepted(&first), copies(&first)),
        (1, 1, 1),
        "the copy on the second filter is recognised by its id, not checked again"
    );

    // The other two relays: copies, recognised by their id, no check.
    let mut threads = vec![first];
    for relay in &relays[1..] {
        let t = spawn(relay, Role::Remote(forward.clone()), &metrics, &reports);
        subscribe(&t, "a", by_kind.clone());
        assert!(wait_until(WAIT, || copies(&t) == 1));
        assert_eq!((checks(&t), accepted(&t), received(&t)), (0, 0, 1));
        threads.push(t);
    }
    // One copy is handed on; the other three are counted, not forwarded.
    let items = forwarded(&forward_rx, 1);
    assert!(items.iter().all(|i| i.id == issue.id));
    assert!(items.iter().all(|i| *i.raw == *issue.as_json()));
    assert!(forward_rx.try_recv().is_err());
    let skipped: u64 = threads.iter().map(copies).sum();
    assert_eq!(skipped, 3);

    // The own relay's self-subscription reads it back: a copy too.
    let own_thread = spawn(&own, Role::Own, &metrics, &reports);
    subscribe(&own_thread, "self", by_kind.clone());
    assert!(wait_until(WAIT, || accepted(&own_thread) == 1));
    assert_eq!(checks(&own_thread), 0);
    let self_event = reports_rx.try_iter().find_map(|i| match i {
        Input::Report(grasp_sync::core::sync::Report::SelfEvent { event, .. }) => Some(event),
        _ => None,
    });
    assert_eq!(self_event.map(|e| e.id), Some(issue.id));

    // A forged copy (same id and signature, other content) of the forwarded event on a
    // remote relay, written the way relays write events (the id first): dropped as a copy by
    // its id, never parsed, never forwarded.
    let last = &threads[2];
    relays[2].push_to_subscriptions(&forge_in_place(&issue, "forged"));
    assert!(wait_until(WAIT, || copies(last) == 2));
    assert_eq!(
        (accepted(last), checks(last), received(last)),
        (0, 0, 2),
        "dropped by its id, before any parsing"
    );
    // The same forgery with the keys sorted (as rust-nostr's relay builder writes events,
    // the id after `content`): the id is still found, the copy dropped unparsed.
    let sorted = common::forge_content(&issue, "forged");
    assert!(sorted.starts_with("{\"content\":"), "{sorted}");
    relays[2].push_to_subscriptions(&sorted);
    assert!(wait_until(WAIT, || copies(last) == 3));
    assert_eq!((accepted(last), checks(last), received(last)), (0, 0, 3));
    // With the id's key written with an escape, which the reading without the parser does not
    // follow: parsed, refused by its id, counted.
    relays[2].push_to_subscriptions(&forge_escaped_key(&issue, "forged"));
    assert!(wait_until(WAIT, || RelayCounters::get(
        &last.counters.events_invalid
    ) == 1));
    assert_eq!(
        (accepted(last), checks(last), copies(last)),
        (0, 0, 3),
        "refused by its id, before any signature check"
    );
    threads.push(own_thread);
    let total: u64 = threads.iter().map(checks).sum();
    assert_eq!(total, 1, "one signature check for six copies");
    assert_eq!(metrics.gate.verified().len(), 1);

    for t in threads {
        t.control.send(Control::Shutdown).unwrap();
        t.handle.join().unwrap();
    }
    assert!(
        forward_rx.try_recv().is_err(),
        "the forged copy was not handed on"
    );
}

#[test]
fn an_echo_in_other_bytes_has_its_id_checked_and_a_forgery_with_its_id_is_refused() {
    common::init_logging();
    let keys = Keys::generate();
    let issue: Event = common::root(&keys, 1621, &common::repo_ref(&keys, "r"), "issue", &[]);
    let remote = TestRelay::start();
    let own = TestRelay::start();
    remote.insert(&issue);
    // The own relay serves the stored event in its own serialisation (other bytes).
    let reserialised = issue.as_json().replacen(',', ", ", 1);
    assert_ne!(reserialised, issue.as_json());
    own.insert_raw(&reserialised).unwrap();
    let metrics = Shared::default();
    let (reports, reports_rx) = unbounded::<Input>();
    let (forward, forward_rx) = unbounded::<ForwardItem>();
    let by_kind = Filter::new().kind(issue.kind);

    let first = spawn(&remote, Role::Remote(forward), &metrics, &reports);
    subscribe(&first, "a", by_kind.clone());
    assert!(wait_until(WAIT, || accepted(&first) == 1));
    assert_eq!(checks(&first), 1);
    assert_eq!(forwarded(&forward_rx, 1)[0].id, issue.id);

    // The echo: accepted without a signature check, its id recomputed from its content.
    let own_thread = spawn(&own, Role::Own, &metrics, &reports);
    subscribe(&own_thread, "self", by_kind.clone());
    assert!(wait_until(WAIT, || accepted(&own_thread) == 1));
    assert_eq!(checks(&own_thread), 0);
    assert!(reports_rx.try_iter().any(|i| matches!(
        i,
        Input::Report(grasp_sync::core::sync::Report::SelfEvent { event, .. }) if event.id == issue.id
    )));

    // Same id and signature, other content, on the own relay: refused by its id, counted,
    // not reported.
    own.push_to_subscriptions(&common::forge_content(&issue, "forged"));
    assert!(wait_until(WAIT, || RelayCounters::get(
        &own_thread.counters.events_invalid
    ) == 1));
    // The same forgery on the remote relay, which forwarded the event: refused by its id when
    // parsed (its id's key escaped, so not read without the parser), dropped unparsed as a
    // copy when its id is read; neither is forwarded.
    remote.push_to_subscriptions(&forge_escaped_key(&issue, "forged"));
    assert!(wait_until(WAIT, || RelayCounters::get(
        &first.counters.events_invalid
    ) == 1));
    remote.push_to_subscriptions(&forge_in_place(&issue, "forged"));
    assert!(wait_until(WAIT, || copies(&first) == 1));
    assert_eq!(RelayCounters::get(&first.counters.events_invalid), 1);
    assert_eq!(accepted(&first), 1);
    assert_eq!(accepted(&own_thread), 1);
    assert_eq!(checks(&first) + checks(&own_thread), 1);

    for t in [first, own_thread] {
        t.control.send(Control::Shutdown).unwrap();
        t.handle.join().unwrap();
    }
    assert!(
        forward_rx.try_recv().is_err(),
        "the forgery was not handed on"
    );
    assert!(!reports_rx.try_iter().any(|i| matches!(
        i,
        Input::Report(grasp_sync::core::sync::Report::SelfEvent { .. })
    )));
}

#[test]
fn copies_recognised_by_their_id_still_count_for_their_page() {
    common::init_logging();
    let keys = Keys::generate();
    let other = Keys::generate();
    let events: Vec<Event> = (0..5u64)
        .map(|i| {
            let author = if i == 0 { &other } else { &keys };
            nostr::event::EventBuilder::new(
                nostr::event::Kind::from(1111 + (i == 0) as u16),
                format!("c{i}"),
            )
            .custom_created_at(nostr::types::Timestamp::from(1_000 + i))
            .finalize(author)
            .unwrap()
        })
        .collect();
    let a = TestRelay::start();
    let b = TestRelay::start();
    for r in [&a, &b] {
        for e in &events {
            r.insert(e);
        }
    }
    let metrics = Shared::default();
    let (reports, reports_rx) = unbounded::<Input>();
    let (forward, forward_rx) = unbounded::<ForwardItem>();
    let filter = Filter::new().kinds([
        nostr::event::Kind::from(1111),
        nostr::event::Kind::from(1112),
    ]);
    let first = spawn(&a, Role::Remote(forward.clone()), &metrics, &reports);
    subscribe(&first, "a", filter.clone());
    assert_eq!(forwarded(&forward_rx, 5).len(), 5);
    let second = spawn(&b, Role::Remote(forward), &metrics, &reports);
    subscribe(&second, "a", filter);
    let b_url = RelayUrl::parse(&b.url()).unwrap();
    let stats = reports_rx
        .iter()
        .find_map(|i| match i {
            Input::Report(grasp_sync::core::sync::Report::Eose { relay, stats, .. })
                if relay == b_url =>
            {
                Some(stats)
            }
            _ => None,
        })
        .expect("the second relay's EOSE");
    // Every copy was dropped unparsed, and the page still knows what it held: the paging
    // decision (page further below the oldest) is the same as for parsed events.
    assert_eq!(copies(&second), 5);
    assert_eq!((checks(&second), accepted(&second)), (0, 0));
    assert_eq!(stats.received, 5);
    assert_eq!((stats.oldest, stats.newest), (Some(1_000), Some(1_004)));
    assert_eq!(stats.kinds_at_oldest, [1112u16].into());
    assert_eq!(stats.authors_at_oldest, [other.public_key()].into());
    assert!(forward_rx.try_recv().is_err(), "nothing forwarded twice");
    for t in [first, second] {
        t.control.send(Control::Shutdown).unwrap();
        t.handle.join().unwrap();
    }
}
