//! [`RelaySession`] in simulated time: one test per decision (the table in
//! `docs/architecture.md`, "Relay sessions").

use std::time::Duration;

use nostr::event::{Event, EventBuilder, FinalizeEvent, Kind};
use nostr::filter::Filter;
use nostr::key::Keys;
use nostr::message::SubscriptionId;
use nostr::types::Timestamp;

use super::*;

const PING: Duration = Duration::from_secs(30);
const PONG: Duration = Duration::from_secs(10);
const CAP: usize = 4_000;
const ISSUE: Kind = Kind::Custom(1621);

fn t(secs: u64) -> Time {
    Time::from_secs(1_700_000_000 + secs)
}

fn url() -> RelayUrl {
    RelayUrl::parse("ws://127.0.0.1:7000").unwrap()
}

fn config(role: SessionRole, keys: Option<Keys>) -> SessionConfig {
    SessionConfig {
        url: url(),
        role,
        ping_interval: PING,
        pong_timeout: PONG,
        max_event_size: CAP,
        auth_keys: keys,
        auth_limits: AuthLimits::default(),
    }
}

fn issue(keys: &Keys, content: &str, created_at: u64) -> Event {
    EventBuilder::new(ISSUE, content)
        .custom_created_at(Timestamp::from(created_at))
        .finalize(keys)
        .unwrap()
}

fn event_frame(sub: &str, event: &Event) -> String {
    format!(r#"["EVENT","{sub}",{}]"#, event.as_json())
}

fn issues() -> Filter {
    Filter::new().kind(ISSUE)
}

/// A session, the verified set it shares with other relays' sessions, and the forwarder's
/// epoch.
struct Harness {
    s: RelaySession,
    set: VerifiedSet,
    epoch: u64,
}

impl Harness {
    fn new(role: SessionRole) -> Harness {
        Harness::with(config(role, None))
    }

    fn with(config: SessionConfig) -> Harness {
        let mut s = RelaySession::new(config);
        s.on_connected(1, t(0));
        let mut h = Harness {
            s,
            set: VerifiedSet::new(1_000),
            epoch: 0,
        };
        assert!(matches!(
            h.reports()[..],
            [Report::Connected { generation: 1, .. }]
        ));
        h
    }

    fn subscribe(&mut self, now: Time, sub: &str, filter: Filter) {
        self.s.handle_command(
            now,
            Control::Subscribe {
                generation: self.s.generation().unwrap(),
                sub_id: SubscriptionId::new(sub),
                filter: std::sync::Arc::new(filter),
                scope: None,
                fetch_since: None,
            },
        );
    }

    fn text(&mut self, now: Time, text: &str) -> FrameOutcome {
        self.text_with(now, text, &VerifiedSet::new(0), false)
    }

    /// A text frame checked against `other` instead of the harness's own set when `shared`
    /// is false (so two harnesses can share one set: pass it explicitly).
    fn text_with(
        &mut self,
        now: Time,
        text: &str,
        other: &VerifiedSet,
        shared: bool,
    ) -> FrameOutcome {
        let set = if shared { other } else { &self.set };
        self.s.handle_frame(
            now,
            Frame::Text(text),
            Verified {
                set,
                forward_epoch: self.epoch,
            },
        )
    }

    fn frame(&mut self, now: Time, frame: Frame<'_>) -> FrameOutcome {
        self.s.handle_frame(
            now,
            frame,
            Verified {
                set: &self.set,
                forward_epoch: self.epoch,
            },
        )
    }

    fn reports(&mut self) -> Vec<Report> {
        std::iter::from_fn(|| self.s.poll_report()).collect()
    }

    fn transmits(&mut self) -> Vec<Transmit> {
        std::iter::from_fn(|| self.s.poll_transmit()).collect()
    }
}

impl Harness {
    /// Asserts that exactly one report came, the loss of the connection with `cause`, and
    /// that the session is closed with no deadline left.
    fn assert_lost_with(&mut self, cause: Disconnect) {
        match &self.reports()[..] {
            [Report::Disconnected { cause: c, .. }] => assert_eq!(c, &cause),
            other => panic!("expected the loss ({cause}), got {other:?}"),
        }
        assert!(!self.s.is_open());
        assert_eq!(self.s.poll_timeout(), None);
    }
}

fn forwarded(outcome: FrameOutcome) -> Forward {
    match outcome {
        FrameOutcome::Forward(f) => f,
        other => panic!("expected a forward, got {other:?}"),
    }
}

fn eose_stats(reports: &[Report], sub: &str) -> PageStats {
    reports
        .iter()
        .find_map(|r| match r {
            Report::Eose { sub_id, stats, .. } if sub_id.as_str() == sub => Some(stats.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no EOSE for {sub} in {reports:?}"))
}

// ----- which frames belong to which subscription -----

#[test]
fn a_subscribe_sends_its_req_and_events_are_checked_against_its_filter() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    match &h.transmits()[..] {
        [Transmit::Text(req)] => assert_eq!(
            *req,
            nostr::message::ClientMessage::req(SubscriptionId::new("s1"), vec![issues()]).as_json(),
            "the REQ is written as nostr writes it"
        ),
        other => panic!("expected one REQ, got {other:?}"),
    }
    let keys = Keys::generate();
    let ev = issue(&keys, "hello", 1_000);
    let f = forwarded(h.text(t(2), &event_frame("s1", &ev)));
    assert_eq!(f.id, ev.id);
    assert_eq!(&*f.raw, ev.as_json());
    assert!(!f.missing);
    // A valid event of another kind does not match the filter: counted, not forwarded.
    let note = EventBuilder::new(Kind::TextNote, "x")
        .finalize(&keys)
        .unwrap();
    assert!(matches!(
        h.text(t(3), &event_frame("s1", &note)),
        FrameOutcome::Handled
    ));
    assert_eq!(h.s.counters().events_unmatched, 1);
    assert_eq!(h.s.counters().events_accepted, 1);
    assert_eq!(h.s.counters().signature_checks, 1);
}

#[test]
fn eose_reports_what_arrived_before_it_once() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    let keys = Keys::generate();
    let _ = h.text(t(2), &event_frame("s1", &issue(&keys, "a", 1_000)));
    let _ = h.text(t(2), &event_frame("s1", &issue(&keys, "b", 2_000)));
    let _ = h.text(t(3), r#"["EOSE","s1"]"#);
    let stats = eose_stats(&h.reports(), "s1");
    assert_eq!(
        (stats.received, stats.oldest, stats.newest),
        (2, Some(1_000), Some(2_000))
    );
    // A live event after EOSE is forwarded but no longer counted for the page; a repeated
    // EOSE reports nothing.
    let _ = forwarded(h.text(t(4), &event_frame("s1", &issue(&keys, "c", 3_000))));
    let _ = h.text(t(5), r#"["EOSE","s1"]"#);
    assert!(h.reports().is_empty());
}

#[test]
fn a_live_only_subscription_is_live_once_sent_without_waiting_for_eose() {
    // nostr-rs-relay sends no EOSE for a REQ whose filters all have `limit: 0`: the session
    // reports the EOSE as the REQ goes out, and a relay's own EOSE later is a repeat.
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "live", issues().limit(0));
    assert!(matches!(&h.transmits()[..], [Transmit::Text(req)] if req.contains(r#""limit":0"#)));
    let stats = eose_stats(&h.reports(), "live");
    assert_eq!(stats.received, 0);
    let keys = Keys::generate();
    let _ = forwarded(h.text(t(2), &event_frame("live", &issue(&keys, "new", 2_000))));
    let _ = h.text(t(3), r#"["EOSE","live"]"#);
    assert!(h.reports().is_empty(), "a late EOSE is not reported again");
    // A history query still waits for the relay's EOSE.
    h.subscribe(t(4), "history", issues().limit(10));
    let _ = h.transmits();
    assert!(h.reports().is_empty());
    let _ = h.text(t(5), r#"["EOSE","history"]"#);
    let _ = eose_stats(&h.reports(), "history");
}

#[test]
fn an_event_for_a_subscription_not_open_is_counted_and_dropped() {
    let mut h = Harness::new(SessionRole::Remote);
    let ev = issue(&Keys::generate(), "x", 1_000);
    assert!(matches!(
        h.text(t(1), &event_frame("nope", &ev)),
        FrameOutcome::Handled
    ));
    let _ = h.text(t(1), r#"["EOSE","nope"]"#);
    let c = h.s.counters();
    assert_eq!((c.events_received, c.events_unknown_subscription), (1, 1));
    assert!(h.reports().is_empty());
}

#[test]
fn an_invalid_event_is_counted_and_counts_as_rejected_for_its_page() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    let ev = issue(&Keys::generate(), "original", 1_000);
    let forged = event_frame("s1", &ev).replace("original", "forged!!");
    assert!(matches!(h.text(t(2), &forged), FrameOutcome::Handled));
    let _ = h.text(t(2), r#"["EVENT","s1",{"id":"zz"}]"#);
    let _ = h.text(t(3), r#"["EOSE","s1"]"#);
    let stats = eose_stats(&h.reports(), "s1");
    assert_eq!((stats.received, stats.rejected, stats.oldest), (0, 2, None));
    assert_eq!(h.s.counters().events_invalid, 2);
    assert_eq!(h.s.counters().events_accepted, 0);
}

#[test]
fn garbage_and_binary_frames_are_counted() {
    let mut h = Harness::new(SessionRole::Remote);
    let _ = h.text(t(1), "not json");
    let _ = h.text(t(1), r#"["WHAT","x"]"#);
    let _ = h.frame(t(1), Frame::Binary);
    assert_eq!(h.s.counters().garbage_frames, 3);
    assert!(h.s.is_open());
}

#[test]
fn the_own_relays_session_reports_events_to_the_coordinator() {
    let mut h = Harness::new(SessionRole::Own);
    h.subscribe(t(1), "self", issues());
    let ev = issue(&Keys::generate(), "x", 1_000);
    assert!(matches!(
        h.text(t(2), &event_frame("self", &ev)),
        FrameOutcome::Handled
    ));
    match &h.reports()[..] {
        [Report::SelfEvent {
            generation: 1,
            event,
        }] => assert_eq!(event.id, ev.id),
        other => panic!("expected the event, got {other:?}"),
    }
}

#[test]
fn collect_ids_reports_created_at_and_id_at_eose_without_checking_signatures() {
    let mut h = Harness::new(SessionRole::Own);
    h.s.handle_command(
        t(1),
        Control::CollectIds {
            generation: 1,
            sub_id: SubscriptionId::new("own"),
            filter: Box::new(issues()),
        },
    );
    let ev = issue(&Keys::generate(), "x", 1_000);
    let _ = h.text(t(2), &event_frame("own", &ev));
    let _ = h.text(t(3), r#"["EOSE","own"]"#);
    match &h.reports()[..] {
        [Report::OwnIds {
            items, truncated, ..
        }] => {
            assert_eq!(items, &vec![(1_000, ev.id)]);
            assert!(!truncated);
        }
        other => panic!("expected OwnIds, got {other:?}"),
    }
    assert_eq!(h.s.counters().signature_checks, 0);
}

/// The own relay's side of a reconciliation reading events this process verified before
/// takes `(created_at, id)` from the verified set without parsing the JSON: a frame whose
/// rest would not parse is collected by its id. Events outside the filter's window are not
/// collected, and an unknown id is parsed as before.
#[test]
fn collect_ids_takes_known_events_from_the_verified_set_without_parsing() {
    let shared = VerifiedSet::new(1_000);
    let mut remote = Harness::new(SessionRole::Remote);
    remote.subscribe(t(1), "s", issues());
    let keys = Keys::generate();
    let (known, old) = (issue(&keys, "x", 1_000), issue(&keys, "y", 10));
    for ev in [&known, &old] {
        let _ = forwarded(remote.text_with(t(2), &event_frame("s", ev), &shared, true));
    }
    let mut own = Harness::new(SessionRole::Own);
    own.s.handle_command(
        t(3),
        Control::CollectIds {
            generation: 1,
            sub_id: SubscriptionId::new("own"),
            filter: Box::new(issues().since(Timestamp::from(500))),
        },
    );
    // Only the claimed id is read: the rest is not an event at all.
    let garbled = format!(r#"["EVENT","own",{{"id":"{}","kind":"x"}}]"#, known.id);
    let _ = own.text_with(t(4), &garbled, &shared, true);
    // A remembered event outside the window is counted as rejected, not collected.
    let _ = own.text_with(t(4), &event_frame("own", &old), &shared, true);
    // An event the set does not know is parsed and checked against the whole filter.
    let fresh = issue(&keys, "z", 2_000);
    let _ = own.text_with(t(4), &event_frame("own", &fresh), &shared, true);
    let _ = own.text_with(t(5), r#"["EOSE","own"]"#, &shared, true);
    match &own.reports()[..] {
        [Report::OwnIds { items, stats, .. }] => {
            assert_eq!(items, &vec![(1_000, known.id), (2_000, fresh.id)]);
            assert_eq!((stats.received, stats.rejected), (2, 1));
        }
        other => panic!("expected OwnIds, got {other:?}"),
    }
    let c = own.s.counters();
    assert_eq!(
        (c.events_received, c.signature_checks, c.garbage_frames),
        (3, 0, 0)
    );
}

// ----- when a copy of an event is dropped -----

#[test]
fn a_copy_of_an_event_already_handed_to_the_forwarder_is_dropped_by_its_id() {
    let shared = VerifiedSet::new(1_000);
    let mut a = Harness::new(SessionRole::Remote);
    let mut b = Harness::new(SessionRole::Remote);
    a.subscribe(t(1), "s", issues());
    b.subscribe(t(1), "s", issues());
    let ev = issue(&Keys::generate(), "x", 1_000);
    let frame = event_frame("s", &ev);
    let _ = forwarded(a.text_with(t(2), &frame, &shared, true));
    assert!(matches!(
        b.text_with(t(2), &frame, &shared, true),
        FrameOutcome::DroppedCopy
    ));
    let _ = b.text(t(3), r#"["EOSE","s"]"#);
    // The dropped copy still counts for its page, with what the verified event says.
    let stats = eose_stats(&b.reports(), "s");
    assert_eq!((stats.received, stats.newest), (1, Some(1_000)));
    let c = b.s.counters();
    assert_eq!((c.copies_not_forwarded, c.signature_checks), (1, 0));
}

#[test]
fn a_dropped_copy_outside_its_subscriptions_window_counts_as_unmatched() {
    let shared = VerifiedSet::new(1_000);
    let mut a = Harness::new(SessionRole::Remote);
    let mut b = Harness::new(SessionRole::Remote);
    a.subscribe(t(1), "s", issues());
    b.subscribe(t(1), "s", issues().since(Timestamp::from(5_000)));
    let ev = issue(&Keys::generate(), "x", 1_000);
    let frame = event_frame("s", &ev);
    let _ = forwarded(a.text_with(t(2), &frame, &shared, true));
    assert!(matches!(
        b.text_with(t(2), &frame, &shared, true),
        FrameOutcome::DroppedCopy
    ));
    assert_eq!(b.s.counters().events_unmatched, 1);
    assert_eq!(b.s.counters().copies_not_forwarded, 0);
}

fn tagged(keys: &Keys, created_at: u64, tags: &[[&str; 2]]) -> Event {
    EventBuilder::new(ISSUE, "x")
        .tags(tags.iter().map(|t| nostr::event::Tag::parse(*t).unwrap()))
        .custom_created_at(Timestamp::from(created_at))
        .finalize(keys)
        .unwrap()
}

fn repo_query(coordinate: &str) -> Filter {
    Filter::new().custom_tag(
        nostr::filter::SingleLetterTag::LOWERCASE_A,
        coordinate.to_string(),
    )
}

/// Relay A's events (already forwarded), then their copies sent by relay B on its
/// subscription `s` with `filter`, then B's EOSE: B's page statistics.
fn copies_on(filter: Filter, events: &[Event]) -> (PageStats, SessionCounters) {
    let shared = VerifiedSet::new(1_000);
    let mut a = Harness::new(SessionRole::Remote);
    let mut b = Harness::new(SessionRole::Remote);
    a.subscribe(t(1), "s", Filter::new());
    b.subscribe(t(1), "s", filter);
    for ev in events {
        let _ = forwarded(a.text_with(t(2), &event_frame("s", ev), &shared, true));
        let _ = b.text_with(t(2), &event_frame("s", ev), &shared, true);
    }
    let _ = b.text(t(3), r#"["EOSE","s"]"#);
    (eose_stats(&b.reports(), "s"), *b.s.counters())
}

#[test]
fn known_events_a_tag_query_does_not_match_do_not_fill_its_page() {
    // Issue 36: a relay answering a repository's query with a page of copies of public
    // events (known ids, not parsed) that tag another repository made the page look full,
    // and the engine asked for the next page, and the next.
    let keys = Keys::generate();
    let other: Vec<Event> = (0..20)
        .map(|i| tagged(&keys, 1_000 + i, &[["a", "30617:k:other"]]))
        .collect();
    let (stats, c) = copies_on(repo_query("30617:k:mine"), &other);
    assert_eq!((stats.received, stats.rejected), (0, 20));
    assert_eq!(c.copies_not_forwarded, 0);
    let plan = crate::core::paging::plan_pages(
        &repo_query("30617:k:mine"),
        &stats,
        &crate::core::paging::PageLimits::assumed(20),
    );
    assert!(plan.next.is_empty(), "{plan:?}");
    assert!(plan.incomplete.is_some(), "{plan:?}");
}

#[test]
fn known_events_a_tag_query_matches_count_for_its_page_unparsed() {
    let keys = Keys::generate();
    let mine: Vec<Event> = (0..20)
        .map(|i| {
            tagged(
                &keys,
                1_000 + i,
                &[["e", "00"], ["a", "30617:k:other"], ["a", "30617:k:mine"]],
            )
        })
        .collect();
    let (stats, c) = copies_on(repo_query("30617:k:mine"), &mine);
    assert_eq!((stats.received, stats.rejected), (20, 0));
    assert_eq!((c.copies_not_forwarded, c.signature_checks), (20, 0));
    // The same value under another letter does not match.
    let (stats, _) = copies_on(
        Filter::new().custom_tag(nostr::filter::SingleLetterTag::LOWERCASE_Q, "30617:k:mine"),
        &mine,
    );
    assert_eq!((stats.received, stats.rejected), (0, 20));
}

#[test]
fn a_copy_whose_tags_the_summary_cannot_tell_is_parsed_and_checked() {
    // More tags than a summary prints, or a condition on a letter it does not print: the
    // copy is parsed (its signature is not checked again) and matched as any event.
    let keys = Keys::generate();
    let many: Vec<[&str; 2]> = std::iter::repeat_n(["e", "00"], crate::core::dedup::TAG_PRINTS)
        .chain([["a", "30617:k:mine"]])
        .collect();
    let crowded = tagged(&keys, 1_000, &many);
    assert!(crate::core::dedup::TagPrint::of(&crowded).overflowed());
    let (stats, c) = copies_on(repo_query("30617:k:mine"), std::slice::from_ref(&crowded));
    assert_eq!((stats.received, stats.rejected), (1, 0));
    assert_eq!((c.copies_not_forwarded, c.signature_checks), (1, 0));
    let (stats, _) = copies_on(repo_query("30617:k:other"), &[crowded]);
    assert_eq!((stats.received, stats.rejected), (0, 1));
    let p_tagged = tagged(&keys, 1_000, &[["p", "ab"]]);
    let (stats, c) = copies_on(
        Filter::new().custom_tag(nostr::filter::SingleLetterTag::LOWERCASE_P, "cd"),
        &[p_tagged],
    );
    assert_eq!(
        (stats.received, stats.rejected, c.copies_not_forwarded),
        (0, 1, 0)
    );
}

#[test]
fn a_fetch_by_ids_forwards_an_event_the_own_relay_confirmed_and_drops_one_in_flight() {
    // Decision 0061: what a fetch gets is forwarded even when an earlier copy was stored
    // (the own relay may have lost it since); a copy the forwarder still holds would be
    // dropped by it, so the fetch's copy is dropped unread.
    let shared = VerifiedSet::new(1_000);
    let mut a = Harness::new(SessionRole::Remote);
    let ev = issue(&Keys::generate(), "x", 1_000);
    a.subscribe(t(1), "live", issues());
    a.subscribe(t(1), "fetch", Filter::new().id(ev.id));
    let first = forwarded(a.text_with(t(2), &event_frame("live", &ev), &shared, true));
    assert!(!first.missing);
    assert!(matches!(
        a.text_with(t(3), &event_frame("fetch", &ev), &shared, true),
        FrameOutcome::DroppedCopy
    ));
    assert_eq!(a.s.counters().copies_not_forwarded, 1);
    shared.mark_stored(&ev.id);
    let again = forwarded(a.text_with(t(4), &event_frame("fetch", &ev), &shared, true));
    assert!(again.missing);
}

#[test]
fn a_fetch_does_not_ask_for_events_on_their_way_to_the_own_relay() {
    // A first sync reconciles one relay while another relay's copies are still on their way
    // to the own relay: the fetch asks only for what is not in flight, and nothing (no REQ,
    // its EOSE reported at once) when everything is.
    let shared = VerifiedSet::new(1_000);
    let keys = Keys::generate();
    let events: Vec<Event> = (0..3)
        .map(|i| issue(&keys, &format!("e{i}"), 1_000 + i))
        .collect();
    let mut other = Harness::new(SessionRole::Remote);
    other.subscribe(t(1), "s", issues());
    let _ = forwarded(other.text_with(t(2), &event_frame("s", &events[0]), &shared, true));
    let _ = forwarded(other.text_with(t(2), &event_frame("s", &events[1]), &shared, true));
    // The second is already confirmed by the own relay: asked for again (decision 0061).
    shared.mark_stored(&events[1].id);
    let mut a = Harness::new(SessionRole::Remote);
    let fetch = |sub: &str, ids: &[&Event]| Control::Subscribe {
        generation: 1,
        sub_id: SubscriptionId::new(sub),
        filter: std::sync::Arc::new(issues().ids(ids.iter().map(|e| e.id))),
        scope: None,
        fetch_since: None,
    };
    let verified = |set| Verified {
        set,
        forward_epoch: 0,
    };
    let all: Vec<&Event> = events.iter().collect();
    a.s.handle_command_with(t(3), fetch("f1", &all), verified(&shared));
    let sent = format!("{:?}", a.transmits());
    assert!(!sent.contains(&events[0].id.to_hex()), "{sent}");
    assert!(sent.contains(&events[1].id.to_hex()) && sent.contains(&events[2].id.to_hex()));
    assert_eq!(a.s.counters().fetch_ids_in_flight, 1);
    // Only events in flight: no REQ (an empty `ids` may read as no condition); its EOSE is
    // reported at once, with nothing undelivered (decision 0112).
    let _ = a.reports();
    a.s.handle_command_with(t(4), fetch("f2", &all[..1]), verified(&shared));
    let sent = format!("{:?}", a.transmits());
    assert!(!sent.contains("f2"), "{sent}");
    assert!(eose_stats(&a.reports(), "f2").undelivered.is_empty());
    assert_eq!(a.s.counters().fetch_ids_in_flight, 2);
    // Another forwarder (restarted) holds nothing: everything is asked for.
    a.s.handle_command_with(
        t(5),
        fetch("f3", &all),
        Verified {
            set: &shared,
            forward_epoch: 1,
        },
    );
    let sent = format!("{:?}", a.transmits());
    assert!(
        events.iter().all(|e| sent.contains(&e.id.to_hex())),
        "{sent}"
    );
    assert_eq!(a.s.counters().fetch_ids_in_flight, 2);
}

#[test]
fn a_fetch_waits_for_the_reqs_before_it_and_asks_only_for_what_they_did_not_deliver() {
    // Decision 0112: a reconciliation's fetch arrives while a REQ of the same batch streams
    // the same events; it is held until that REQ's EOSE and then asks only for the rest.
    // Events the own relay confirmed before its side was read are still asked for (0061).
    // The REQs as the transmits' debug text shows them.
    const REQ_OF_REQ: &str = r#"\"REQ\",\"req\""#;
    const REQ_OF_F: &str = r#"\"REQ\",\"f\""#;
    let shared = VerifiedSet::new(1_000);
    let keys = Keys::generate();
    let events: Vec<Event> = (0..4)
        .map(|i| issue(&keys, &format!("e{i}"), 1_000 + i))
        .collect();
    // events[3] was handed over and confirmed before the own side was read.
    let mut other = Harness::new(SessionRole::Remote);
    other.subscribe(t(0), "s", issues());
    let _ = forwarded(other.text_with(t(0), &event_frame("s", &events[3]), &shared, true));
    shared.mark_stored(&events[3].id);
    let since = shared.clock();
    let verified = Verified {
        set: &shared,
        forward_epoch: 0,
    };
    let mut a = Harness::new(SessionRole::Remote);
    a.s.handle_command_with(
        t(1),
        Control::Subscribe {
            generation: 1,
            sub_id: SubscriptionId::new("req"),
            filter: std::sync::Arc::new(issues()),
            scope: None,
            fetch_since: None,
        },
        verified,
    );
    a.s.handle_command_with(
        t(1),
        Control::Subscribe {
            generation: 1,
            sub_id: SubscriptionId::new("f"),
            filter: std::sync::Arc::new(issues().ids(events.iter().map(|e| e.id))),
            scope: None,
            fetch_since: Some(since),
        },
        verified,
    );
    let sent = format!("{:?}", a.transmits());
    assert!(
        sent.contains(REQ_OF_REQ) && !sent.contains(REQ_OF_F),
        "{sent}"
    );
    // The REQ delivers two of them (one is stored meanwhile), then its EOSE.
    let _ = forwarded(a.text_with(t(2), &event_frame("req", &events[0]), &shared, true));
    let _ = forwarded(a.text_with(t(2), &event_frame("req", &events[1]), &shared, true));
    shared.mark_stored(&events[0].id);
    let _ = a.text_with(t(3), r#"["EOSE","req"]"#, &shared, true);
    let sent = format!("{:?}", a.transmits());
    assert!(sent.contains(REQ_OF_F), "{sent}");
    for (i, e) in events.iter().enumerate() {
        assert_eq!(
            sent.contains(&e.id.to_hex()),
            i >= 2,
            "event {i} asked for: {sent}"
        );
    }
    // The relay delivers both; the fetch ends complete.
    for e in &events[2..] {
        let _ = a.text_with(t(4), &event_frame("f", e), &shared, true);
    }
    let _ = a.text_with(t(5), r#"["EOSE","f"]"#, &shared, true);
    assert!(eose_stats(&a.reports(), "f").undelivered.is_empty());
    // Its own REQ delivering everything, a held fetch sends nothing and ends at once.
    let mut b = Harness::new(SessionRole::Remote);
    let set = VerifiedSet::new(1_000);
    let verified = Verified {
        set: &set,
        forward_epoch: 0,
    };
    for (sub, filter, fetch_since) in [
        ("req", issues(), None),
        (
            "f",
            issues().ids(events[..2].iter().map(|e| e.id)),
            Some(set.clock()),
        ),
    ] {
        b.s.handle_command_with(
            t(1),
            Control::Subscribe {
                generation: 1,
                sub_id: SubscriptionId::new(sub),
                filter: std::sync::Arc::new(filter),
                scope: None,
                fetch_since,
            },
            verified,
        );
    }
    for e in &events[..2] {
        let _ = forwarded(b.text_with(t(2), &event_frame("req", e), &set, true));
    }
    let _ = b.text_with(t(3), r#"["EOSE","req"]"#, &set, true);
    let sent = format!("{:?}", b.transmits());
    assert!(!sent.contains(REQ_OF_F), "{sent}");
    assert!(eose_stats(&b.reports(), "f").undelivered.is_empty());
}

#[test]
fn a_fetch_reports_at_eose_what_it_neither_got_nor_left_safely_in_flight() {
    // Issue 33: a fetch by ids that ends short says so in its EOSE (`undelivered`): ids the
    // relay did not send, and ids left out as in flight whose event is no longer on its way
    // (the own relay refused it meanwhile); an id still in flight is not reported.
    let shared = VerifiedSet::new(1_000);
    let keys = Keys::generate();
    let events: Vec<Event> = (0..4)
        .map(|i| issue(&keys, &format!("e{i}"), 1_000 + i))
        .collect();
    let mut other = Harness::new(SessionRole::Remote);
    other.subscribe(t(1), "s", issues());
    for e in &events[..2] {
        let _ = forwarded(other.text_with(t(2), &event_frame("s", e), &shared, true));
    }
    let mut a = Harness::new(SessionRole::Remote);
    let verified = Verified {
        set: &shared,
        forward_epoch: 0,
    };
    a.s.handle_command_with(
        t(3),
        Control::Subscribe {
            generation: 1,
            sub_id: SubscriptionId::new("f"),
            filter: std::sync::Arc::new(issues().ids(events.iter().map(|e| e.id))),
            scope: None,
            fetch_since: None,
        },
        verified,
    );
    assert_eq!(a.s.counters().fetch_ids_in_flight, 2);
    // events[0] is refused by the own relay meanwhile; events[1] is still on its way.
    shared.release_forward(&events[0].id);
    // The relay sends events[2] only.
    let _ = forwarded(a.text_with(t(4), &event_frame("f", &events[2]), &shared, true));
    let _ = a.text_with(t(5), r#"["EOSE","f"]"#, &shared, true);
    let stats = eose_stats(&a.reports(), "f");
    let mut want = vec![events[0].id, events[3].id];
    want.sort();
    assert_eq!(stats.undelivered, want);
    // Any other query reports nothing undelivered.
    a.subscribe(t(6), "s", issues());
    let _ = a.text(t(7), r#"["EOSE","s"]"#);
    assert!(eose_stats(&a.reports(), "s").undelivered.is_empty());
}

#[test]
fn a_fetch_forwards_only_events_inside_its_scope() {
    // A reconciliation's fetch asks by `ids` without its query's tag values; what the relay
    // sends must still match the query (the scope), whatever ids it listed.
    let shared = VerifiedSet::new(1_000);
    let mut a = Harness::new(SessionRole::Remote);
    let keys = Keys::generate();
    let root = "a".repeat(64);
    let inside = EventBuilder::new(ISSUE, "reply")
        .tag(nostr::event::Tag::parse(["e", root.as_str()]).unwrap())
        .finalize(&keys)
        .unwrap();
    let outside = issue(&keys, "unrelated", 1_000);
    let scope = issues().custom_tags(nostr::filter::SingleLetterTag::LOWERCASE_E, [root.clone()]);
    a.s.handle_command(
        t(1),
        Control::Subscribe {
            generation: a.s.generation().unwrap(),
            sub_id: SubscriptionId::new("fetch"),
            filter: std::sync::Arc::new(issues().ids([inside.id, outside.id])),
            scope: Some(std::sync::Arc::new(scope)),
            fetch_since: None,
        },
    );
    let sent = a.transmits();
    assert_eq!(sent.len(), 1);
    assert!(
        !format!("{sent:?}").contains(&root),
        "the scope is not sent: {sent:?}"
    );
    let got = forwarded(a.text_with(t(2), &event_frame("fetch", &inside), &shared, true));
    assert_eq!(got.id, inside.id);
    assert!(matches!(
        a.text_with(t(3), &event_frame("fetch", &outside), &shared, true),
        FrameOutcome::Handled
    ));
    assert_eq!(a.s.counters().events_unmatched, 1);
    assert_eq!(a.s.counters().events_accepted, 1);
}

#[test]
fn a_new_forwarder_epoch_voids_earlier_claims() {
    let shared = VerifiedSet::new(1_000);
    let mut a = Harness::new(SessionRole::Remote);
    a.subscribe(t(1), "s", issues());
    let ev = issue(&Keys::generate(), "x", 1_000);
    let frame = event_frame("s", &ev);
    let _ = forwarded(a.text_with(t(2), &frame, &shared, true));
    assert!(matches!(
        a.text_with(t(3), &frame, &shared, true),
        FrameOutcome::DroppedCopy
    ));
    // The forwarder restarted: what it held is gone, so the next copy goes to it again.
    a.epoch = 1;
    let _ = forwarded(a.text_with(t(4), &frame, &shared, true));
}

// ----- keep-alive -----

#[test]
fn a_ping_goes_out_every_interval_and_a_missing_pong_ends_the_connection() {
    let mut h = Harness::new(SessionRole::Remote);
    assert_eq!(h.s.poll_timeout(), Some(t(30)));
    h.s.handle_timeout(t(29));
    assert!(h.transmits().is_empty());
    h.s.handle_timeout(t(30));
    assert_eq!(h.transmits(), vec![Transmit::Ping]);
    assert_eq!(h.s.poll_timeout(), Some(t(40)), "the pong deadline");
    h.s.handle_timeout(t(40));
    h.assert_lost_with(Disconnect::NoPong);
    assert_eq!(h.s.counters().disconnects, 1);
}

#[test]
fn any_frame_answers_a_ping() {
    let mut h = Harness::new(SessionRole::Remote);
    h.s.handle_timeout(t(30));
    assert_eq!(h.transmits(), vec![Transmit::Ping]);
    let _ = h.text(t(35), r#"["NOTICE","busy"]"#);
    assert_eq!(h.s.poll_timeout(), Some(t(60)), "no pong deadline any more");
    h.s.handle_timeout(t(40));
    assert!(h.s.is_open());
}

#[test]
fn a_pong_is_not_work_so_a_quiet_connection_keeps_its_long_tick() {
    let ticks = Ticks {
        busy: Duration::from_millis(50),
        idle: Duration::from_secs(2),
        quiet: Duration::from_secs(10),
        quiet_after: Duration::from_secs(10),
    };
    let mut h = Harness::new(SessionRole::Remote);
    assert_eq!(h.s.read_timeout(t(0), &ticks), ticks.busy);
    assert_eq!(h.s.read_timeout(t(15), &ticks), ticks.quiet);
    let _ = h.frame(t(15), Frame::Pong);
    assert_eq!(h.s.read_timeout(t(15), &ticks), ticks.quiet);
    let _ = h.text(t(16), r#"["NOTICE","hi"]"#);
    assert_eq!(h.s.read_timeout(t(16), &ticks), ticks.busy);
    // Never past the next ping (at 30 s); a command is work too.
    assert_eq!(h.s.read_timeout(t(28), &ticks), Duration::from_secs(2));
    h.subscribe(t(28), "s", issues());
    assert_eq!(h.s.read_timeout(t(28), &ticks), ticks.busy);
}

// ----- what a CLOSED means -----

#[test]
fn closed_is_reported_with_its_message_and_the_subscription_is_gone() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    let _ = h.text(t(2), r#"["CLOSED","s1","rate-limited: slow down"]"#);
    match &h.reports()[..] {
        [Report::Closed {
            sub_id, message, ..
        }] => {
            assert_eq!(sub_id.as_str(), "s1");
            assert_eq!(message, "rate-limited: slow down");
        }
        other => panic!("expected CLOSED, got {other:?}"),
    }
    let ev = issue(&Keys::generate(), "x", 1_000);
    let _ = h.text(t(3), &event_frame("s1", &ev));
    assert_eq!(h.s.counters().events_unknown_subscription, 1);
    // A CLOSED for a subscription not open is counted and dropped.
    let _ = h.text(t(4), r#"["CLOSED","zz","error: what"]"#);
    assert!(h.reports().is_empty());
    assert_eq!(h.s.counters().closed, 2);
}

#[test]
fn relay_text_in_closed_and_notice_is_escaped_and_bounded() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    let long = "x".repeat(2 * MAX_RELAY_TEXT);
    let _ = h.text(t(2), &format!(r#"["CLOSED","s1","error: a\nb {long}"]"#));
    let _ = h.text(t(2), &format!(r#"["NOTICE","{long}"]"#));
    let reports = h.reports();
    assert_eq!(reports.len(), 2, "{reports:?}");
    for r in reports {
        let text = match r {
            Report::Closed { message, .. } | Report::Notice { message, .. } => message,
            other => panic!("unexpected {other:?}"),
        };
        assert!(!text.contains('\n'));
        assert!(text.len() < MAX_RELAY_TEXT + 40, "{}", text.len());
    }
}

#[test]
fn closed_of_a_negentropy_session_is_its_neg_err() {
    let mut h = Harness::new(SessionRole::Remote);
    h.s.handle_command(
        t(1),
        Control::NegOpen {
            generation: 1,
            sub_id: SubscriptionId::new("n1"),
            filter: Box::new(issues()),
            message: "6100".into(),
        },
    );
    assert_eq!(h.transmits().len(), 1);
    let _ = h.text(t(2), r#"["NEG-MSG","n1","6100"]"#);
    let _ = h.text(t(3), r#"["CLOSED","n1","blocked: no negentropy"]"#);
    let reports = h.reports();
    assert!(matches!(reports[0], Report::NegMsg { .. }));
    assert!(matches!(reports[1], Report::NegErr { closed: true, .. }));
    // The session is over: later NEG frames for it are garbage.
    let _ = h.text(t(4), r#"["NEG-MSG","n1","6100"]"#);
    let _ = h.text(t(4), r#"["NEG-ERR","n1","closed"]"#);
    assert!(h.reports().is_empty());
    assert_eq!(h.s.counters().garbage_frames, 2);
}

#[test]
fn neg_close_is_sent_only_for_a_session_still_open() {
    let mut h = Harness::new(SessionRole::Remote);
    let open = |sub: &str| Control::NegOpen {
        generation: 1,
        sub_id: SubscriptionId::new(sub),
        filter: Box::new(issues()),
        message: "6100".into(),
    };
    let close = |sub: &str| Control::NegClose {
        generation: 1,
        sub_id: SubscriptionId::new(sub),
    };
    h.s.handle_command(t(1), open("n1"));
    let _ = h.text(t(2), r#"["NEG-ERR","n1","blocked: too big"]"#);
    h.s.handle_command(t(3), close("n1"));
    assert_eq!(h.transmits().len(), 1, "only the NEG-OPEN");
    h.s.handle_command(t(4), open("n2"));
    h.s.handle_command(t(5), close("n2"));
    assert_eq!(h.transmits().len(), 2);
}

// ----- NIP-42: holds and their release -----

fn auth_frame_id(transmit: &Transmit, now: Time) -> EventId {
    let Transmit::Text(text) = transmit else {
        panic!("expected AUTH, got {transmit:?}");
    };
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
    assert_eq!(v[0], "AUTH");
    let event = Event::from_json(v[1].to_string()).unwrap();
    event.verify().unwrap();
    assert_eq!(event.kind, Kind::Authentication);
    assert_eq!(
        event.created_at,
        now.timestamp(),
        "dated by the session's now"
    );
    event.id
}

#[test]
fn closed_auth_required_is_held_and_sent_again_once_authenticated() {
    let mut h = Harness::with(config(SessionRole::Remote, Some(Keys::generate())));
    h.subscribe(t(1), "s1", issues());
    let _ = h.transmits();
    let _ = h.text(t(2), r#"["CLOSED","s1","auth-required: who are you"]"#);
    assert!(h.reports().is_empty(), "held, not reported");
    let _ = h.text(t(3), r#"["AUTH","challenge-1"]"#);
    let sent = h.transmits();
    assert_eq!(sent.len(), 1);
    let id = auth_frame_id(&sent[0], t(3));
    let _ = h.text(t(4), &format!(r#"["OK","{id}",true,""]"#));
    match &h.transmits()[..] {
        [Transmit::Text(req)] => assert!(req.starts_with(r#"["REQ","s1","#), "{req}"),
        other => panic!("expected the REQ again, got {other:?}"),
    }
    assert!(h.reports().is_empty());
    assert_eq!(h.s.counters().auth_challenges, 1);
}

#[test]
fn a_held_subscription_is_reported_closed_when_no_challenge_comes_in_time() {
    let mut h = Harness::with(config(SessionRole::Remote, Some(Keys::generate())));
    h.subscribe(t(1), "s1", issues());
    let _ = h.text(t(2), r#"["CLOSED","s1","auth-required: please"]"#);
    let wait = AuthLimits::default().challenge_wait;
    let deadline = t(2).plus(wait);
    assert_eq!(h.s.poll_timeout(), Some(deadline));
    h.s.handle_timeout(deadline);
    match &h.reports()[..] {
        [Report::Closed {
            sub_id, message, ..
        }] => {
            assert_eq!(sub_id.as_str(), "s1");
            assert_eq!(message, "auth-required: please");
        }
        other => panic!("expected the release, got {other:?}"),
    }
}

#[test]
fn a_refused_authentication_releases_every_held_subscription() {
    let mut h = Harness::with(config(SessionRole::Remote, Some(Keys::generate())));
    h.subscribe(t(1), "s1", issues());
    h.subscribe(t(1), "s2", issues());
    let _ = h.transmits();
    let _ = h.text(t(2), r#"["AUTH","c"]"#);
    let id = auth_frame_id(&h.transmits()[0], t(2));
    let _ = h.text(t(2), r#"["CLOSED","s1","auth-required: a"]"#);
    let _ = h.text(t(2), r#"["CLOSED","s2","auth-required: b"]"#);
    assert!(h.reports().is_empty());
    let _ = h.text(
        t(3),
        &format!(r#"["OK","{id}",false,"restricted: not you"]"#),
    );
    let closed: Vec<String> = h
        .reports()
        .into_iter()
        .map(|r| match r {
            Report::Closed { sub_id, .. } => sub_id.to_string(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(closed, ["s1", "s2"]);
}

#[test]
fn without_a_key_challenges_are_ignored_and_closed_is_reported() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    let _ = h.transmits();
    let _ = h.text(t(2), r#"["AUTH","c"]"#);
    assert!(h.transmits().is_empty());
    let _ = h.text(t(3), r#"["CLOSED","s1","auth-required: a"]"#);
    assert!(matches!(h.reports()[..], [Report::Closed { .. }]));
}

// ----- NIP-11 -----

#[test]
fn nip11_is_asked_again_only_while_the_relay_was_unreachable() {
    let mut s = RelaySession::new(config(SessionRole::Remote, None));
    assert!(s.wants_limits());
    s.on_limits(LimitsFetch::Unreachable);
    assert!(s.wants_limits());
    s.on_limits(LimitsFetch::NoDocument);
    assert!(!s.wants_limits());
    assert!(s.poll_report().is_none());

    let mut s = RelaySession::new(config(SessionRole::Remote, None));
    let limits = RelayLimits {
        max_limit: Some(500),
        ..RelayLimits::default()
    };
    s.on_limits(LimitsFetch::Fetched(limits));
    assert!(!s.wants_limits());
    match s.poll_report() {
        Some(Report::Limits { limits: l, .. }) => assert_eq!(l, limits),
        other => panic!("expected the limits, got {other:?}"),
    }
}

// ----- oversized events -----

#[test]
fn an_oversized_event_is_dropped_and_counted_once_per_relay_across_connections() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    let big = issue(&Keys::generate(), &"x".repeat(CAP), 1_000);
    let frame = event_frame("s1", &big);
    assert!(matches!(h.text(t(2), &frame), FrameOutcome::Handled));
    assert!(matches!(h.text(t(2), &frame), FrameOutcome::Handled));
    let _ = h.text(t(3), r#"["EOSE","s1"]"#);
    // Counted as received for paging (its timestamp unused), kept connected.
    let stats = eose_stats(&h.reports(), "s1");
    assert_eq!((stats.received, stats.oldest), (2, None));
    assert!(h.s.is_open());
    h.s.on_closed_locally();
    h.s.on_connected(2, t(10));
    h.subscribe(t(10), "s1", issues());
    let _ = h.text(t(11), &frame);
    assert_eq!(h.s.counters().oversized_frames, 1);
    // A frame that is no event is counted each time.
    let _ = h.text(t(12), &format!(r#"["NOTICE","{}"]"#, "y".repeat(CAP)));
    assert_eq!(h.s.counters().oversized_frames, 2);
}

// ----- generations and connection lifecycle -----

#[test]
fn commands_of_another_generation_are_dropped() {
    let mut h = Harness::new(SessionRole::Remote);
    h.s.handle_command(
        t(1),
        Control::Subscribe {
            generation: 7,
            sub_id: SubscriptionId::new("old"),
            filter: std::sync::Arc::new(issues()),
            scope: None,
            fetch_since: None,
        },
    );
    assert!(h.transmits().is_empty());
    h.subscribe_gen(t(2), 1);
    assert_eq!(
        h.transmits().len(),
        1,
        "the current generation's command is sent"
    );
    h.s.on_closed_locally();
    h.subscribe_gen(t(3), 1);
    assert!(h.transmits().is_empty(), "no connection: dropped");
}

impl Harness {
    fn subscribe_gen(&mut self, now: Time, generation: u64) {
        self.s.handle_command(
            now,
            Control::Subscribe {
                generation,
                sub_id: SubscriptionId::new("x"),
                filter: std::sync::Arc::new(issues()),
                scope: None,
                fetch_since: None,
            },
        );
    }
}

#[test]
fn a_new_connection_starts_without_the_old_ones_subscriptions() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    let _ = h.frame(t(2), Frame::Close(Some((1001, "going away"))));
    h.assert_lost_with(Disconnect::ClosedByRelay {
        code: Some(1001),
        reason: "going away".into(),
    });
    h.s.on_connected(2, t(3));
    let _ = h.reports();
    let ev = issue(&Keys::generate(), "x", 1_000);
    let _ = h.text(t(4), &event_frame("s1", &ev));
    assert_eq!(h.s.counters().events_unknown_subscription, 1);
    assert_eq!(h.s.counters().connects, 2);
}

#[test]
fn unsubscribe_sends_close_and_forgets_the_subscription() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    h.s.handle_command(
        t(2),
        Control::Unsubscribe {
            generation: 1,
            sub_id: SubscriptionId::new("s1"),
        },
    );
    let sent = h.transmits();
    assert_eq!(
        sent.last(),
        Some(&Transmit::Text(r#"["CLOSE","s1"]"#.into()))
    );
    let _ = h.text(t(3), r#"["CLOSED","s1","error: bye"]"#);
    assert!(
        h.reports().is_empty(),
        "no report for a subscription we closed"
    );
}

#[test]
fn a_failed_connect_is_reported_with_its_cause() {
    let mut s = RelaySession::new(config(SessionRole::Remote, None));
    s.on_connect_failed(3, Disconnect::ConnectTimeout);
    match s.poll_report() {
        Some(Report::Disconnected {
            generation: 3,
            cause,
            ..
        }) => assert_eq!(cause, Disconnect::ConnectTimeout),
        other => panic!("expected the failure, got {other:?}"),
    }
    assert_eq!(s.counters().disconnects, 1);
    assert_eq!(Disconnect::ConnectTimeout.label(), "connect_timeout");
}

#[test]
fn every_disconnect_label_is_listed_once() {
    let all = [
        Disconnect::Resolve(String::new()),
        Disconnect::Tcp(String::new()),
        Disconnect::Handshake(String::new()),
        Disconnect::ConnectTimeout,
        Disconnect::Write(String::new()),
        Disconnect::Read(String::new()),
        Disconnect::ClosedByRelay {
            code: None,
            reason: String::new(),
        },
        Disconnect::NoPong,
        Disconnect::ThreadLost { panicked: true },
        Disconnect::Spawn(String::new()),
    ];
    let labels: Vec<&str> = all.iter().map(Disconnect::label).collect();
    assert_eq!(labels, Disconnect::LABELS);
    let unique: std::collections::HashSet<&str> = labels.iter().copied().collect();
    assert_eq!(unique.len(), labels.len(), "labels are distinct");
    // Every variant is in `all`: this match stops compiling when one is added.
    for d in &all {
        match d {
            Disconnect::Resolve(_)
            | Disconnect::Tcp(_)
            | Disconnect::Handshake(_)
            | Disconnect::ConnectTimeout
            | Disconnect::Write(_)
            | Disconnect::Read(_)
            | Disconnect::ClosedByRelay { .. }
            | Disconnect::NoPong
            | Disconnect::ThreadLost { .. }
            | Disconnect::Spawn(_) => {}
        }
    }
}

#[test]
fn a_refusal_is_reported_and_not_counted_as_a_disconnect() {
    let mut s = RelaySession::new(config(SessionRole::Remote, None));
    s.on_refused(
        4,
        crate::shared::Refusal::Denied {
            pattern: "*.example".into(),
        },
    );
    assert!(matches!(
        s.poll_report(),
        Some(Report::Refused { generation: 4, .. })
    ));
    assert_eq!(s.counters().disconnects, 0);
}

#[test]
fn a_connection_is_lost_once() {
    let mut h = Harness::new(SessionRole::Remote);
    h.s.on_lost(Disconnect::Write("broken pipe".into()));
    h.s.on_lost(Disconnect::Read("reset".into()));
    h.assert_lost_with(Disconnect::Write("broken pipe".into()));
    assert_eq!(h.s.counters().disconnects, 1);
}

#[test]
fn collect_ids_ignores_what_arrives_after_its_eose() {
    let mut h = Harness::new(SessionRole::Own);
    h.s.handle_command(
        t(1),
        Control::CollectIds {
            generation: 1,
            sub_id: SubscriptionId::new("own"),
            filter: Box::new(issues()),
        },
    );
    let _ = h.text(t(2), r#"["EOSE","own"]"#);
    assert!(matches!(h.reports()[..], [Report::OwnIds { .. }]));
    // A live event before the machine's CLOSE: neither collected nor a self-event.
    let ev = issue(&Keys::generate(), "x", 1_000);
    let _ = h.text(t(3), &event_frame("own", &ev));
    assert!(h.reports().is_empty());
    assert_eq!(h.s.counters().signature_checks, 0);
}

// ----- oversized frames are not parsed -----

/// An oversized frame's ids come from a byte scan, not from parsing: an event whose JSON
/// would not parse (a `kind` that is not a number, no signature) is still recognised by its
/// id, counted once and counted as received for its page.
#[test]
fn an_oversized_frame_is_recognised_by_a_byte_scan_without_parsing() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    let id = "cd".repeat(32);
    let frame = format!(
        r#"["EVENT","s1",{{"content":"\"id\":\"{}\"","id":"{id}","kind":"x","pad":"{}"}}]"#,
        "ef".repeat(32),
        "y".repeat(CAP)
    );
    let _ = h.text(t(2), &frame);
    let _ = h.text(t(2), &frame);
    assert_eq!(h.s.counters().oversized_frames, 1);
    assert!(h
        .s
        .oversized_seen
        .contains(&EventId::from_hex(&id).unwrap()));
    let _ = h.text(t(3), r#"["EOSE","s1"]"#);
    assert_eq!(eose_stats(&h.reports(), "s1").received, 2);
}

// ----- log lines a relay can provoke -----

/// 10,000 valid events that do not match their subscription: all counted, at most the
/// budget of each window logged at info level, the rest at debug level.
#[test]
fn ten_thousand_unmatched_events_log_a_bounded_number_of_info_lines() {
    let mut h = Harness::new(SessionRole::Remote);
    h.subscribe(t(1), "s1", issues());
    let note = EventBuilder::new(Kind::TextNote, "x")
        .finalize(&Keys::generate())
        .unwrap();
    let frame = event_frame("s1", &note);
    // Over 100 simulated seconds: two budget windows.
    for i in 0..10_000u64 {
        let _ = h.text(t(2 + i / 100), &frame);
    }
    assert_eq!(h.s.counters().events_unmatched, 10_000);
    let budget = h.s.log_budget();
    let per_window = u64::from(budget.per_window());
    assert!(budget.logged() <= 2 * per_window, "{}", budget.logged());
    assert_eq!(budget.logged() + budget.demoted(), 10_000);
}

/// AUTH challenges in a loop without a key configured: each would log at info level.
#[test]
fn auth_challenges_in_a_loop_log_a_bounded_number_of_info_lines() {
    let mut h = Harness::new(SessionRole::Remote);
    for i in 0..1_000 {
        let _ = h.text(t(2), &format!(r#"["AUTH","c{i}"]"#));
    }
    assert_eq!(h.s.counters().auth_challenges, 1_000);
    let budget = h.s.log_budget();
    assert!(budget.logged() <= u64::from(budget.per_window()));
}

/// Relay URLs go into log lines unescaped: the parser refuses every control character
/// (newlines, escape sequences, C1 controls) and whitespace inside them (it trims them at the
/// ends), so no parsed URL from an announcement can forge a log line or rewrite the terminal.
#[test]
fn relay_urls_in_log_lines_hold_no_control_characters() {
    for bad in [
        "\n",
        "\r",
        "\u{1b}[31m",
        "\u{85}",
        "\u{7f}",
        "\t",
        " ",
        "\u{2028}",
    ] {
        for url in [
            format!("wss://relay{bad}.example.com"),
            format!("wss://relay.example.com/x{bad}y"),
            format!("wss://relay.example.com/?q={bad}"),
            format!("wss://relay.example.com/?q={bad}x"),
            format!("wss://relay.example.com:44{bad}3"),
        ] {
            if let Ok(parsed) = RelayUrl::parse(&url) {
                let shown = parsed.to_string();
                assert!(
                    !shown.chars().any(|c| c.is_control() || c.is_whitespace()),
                    "{url:?} -> {shown:?}"
                );
            }
        }
    }
}

#[test]
fn events_of_strangers_and_events_of_too_many_tags_are_dropped_before_a_parse() {
    // Issue 36, item 11: an EVENT frame for no open subscription is counted and dropped
    // before its event is parsed; one with more tags than `MAX_EVENT_TAGS` is refused as
    // malformed without being parsed (a megabyte of empty tags cost ~20 MiB to parse).
    let mut cfg = config(SessionRole::Remote, None);
    cfg.max_event_size = 1 << 20;
    let mut a = Harness::with(cfg);
    a.subscribe(t(1), "s", issues());
    let tags = vec!["[]"; crate::core::message::MAX_EVENT_TAGS + 1].join(",");
    let raw = format!(
        r#"{{"id":"{}","pubkey":"{}","created_at":1,"kind":1621,"tags":[{tags}],"content":"","sig":"{}"}}"#,
        "a".repeat(64),
        "b".repeat(64),
        "c".repeat(128)
    );
    let stranger = format!(r#"["EVENT","nobody",{raw}]"#);
    assert!(matches!(a.text(t(2), &stranger), FrameOutcome::Handled));
    assert_eq!(a.s.counters().events_unknown_subscription, 1);
    assert_eq!(a.s.counters().events_invalid, 0);
    let known = format!(r#"["EVENT","s",{raw}]"#);
    assert!(matches!(a.text(t(3), &known), FrameOutcome::Handled));
    assert_eq!(a.s.counters().events_invalid, 1);
    assert_eq!(a.s.counters().events_accepted, 0);
}

/// Decision 0110: a REQ of several filters is one subscription on the wire; each filter is
/// the machine's own. An event is checked against the union of the filters, and counted
/// for paging by every filter it matches (a relay caps each filter on its own); EOSE is
/// reported per member; the REQ is closed with its last member; a CLOSED ends every member.
#[test]
fn a_req_of_several_filters_counts_each_filter_and_checks_the_union() {
    let keys = Keys::generate();
    let other = Keys::generate();
    let mut h = Harness::new(SessionRole::Remote);
    let by_keys = Filter::new().kind(ISSUE).author(keys.public_key());
    let by_other = Filter::new().kind(ISSUE).author(other.public_key());
    h.s.handle_command(
        t(1),
        Control::SubscribeMany {
            generation: 1,
            members: vec![
                (SubscriptionId::new("m1"), std::sync::Arc::new(by_keys)),
                (SubscriptionId::new("m2"), std::sync::Arc::new(by_other)),
            ],
        },
    );
    let sent = h.transmits();
    let [Transmit::Text(req)] = &sent[..] else {
        panic!("{sent:?}");
    };
    assert!(req.starts_with(r#"["REQ","m1",{"#), "{req}");
    assert_eq!(req.matches("\"kinds\"").count(), 2, "{req}");
    // Events arrive under the REQ's id (the first member's).
    for i in 0..3 {
        let e = issue(&keys, &format!("k{i}"), 100 + i);
        assert!(matches!(
            h.text(t(2), &event_frame("m1", &e)),
            FrameOutcome::Forward(_)
        ));
    }
    let e = issue(&other, "o", 50);
    assert!(matches!(
        h.text(t(2), &event_frame("m1", &e)),
        FrameOutcome::Forward(_)
    ));
    // Matches neither filter: dropped (the union is the check).
    let stranger = EventBuilder::new(Kind::TextNote, "x")
        .finalize(&keys)
        .unwrap();
    assert!(matches!(
        h.text(t(2), &event_frame("m1", &stranger)),
        FrameOutcome::Handled
    ));
    assert_eq!(h.s.counters().events_unmatched, 1);
    assert!(matches!(
        h.text(t(3), r#"["EOSE","m1"]"#),
        FrameOutcome::Handled
    ));
    let mut stats: Vec<(String, u64, u64, Option<u64>)> = h
        .reports()
        .into_iter()
        .map(|r| match r {
            Report::Eose { sub_id, stats, .. } => (
                sub_id.to_string(),
                stats.received,
                stats.rejected,
                stats.oldest,
            ),
            other => panic!("{other:?}"),
        })
        .collect();
    stats.sort();
    assert_eq!(
        stats,
        vec![
            ("m1".to_string(), 3, 1, Some(100)),
            ("m2".to_string(), 1, 1, Some(50)),
        ]
    );
    // Closed with its last member only.
    h.s.handle_command(
        t(4),
        Control::Unsubscribe {
            generation: 1,
            sub_id: SubscriptionId::new("m1"),
        },
    );
    assert!(h.transmits().is_empty());
    h.s.handle_command(
        t(4),
        Control::Unsubscribe {
            generation: 1,
            sub_id: SubscriptionId::new("m2"),
        },
    );
    assert_eq!(
        h.transmits(),
        vec![Transmit::Text(r#"["CLOSE","m1"]"#.to_string())]
    );
    // A CLOSED of a REQ of several filters ends each member still open.
    h.s.handle_command(
        t(5),
        Control::SubscribeMany {
            generation: 1,
            members: vec![
                (SubscriptionId::new("n1"), std::sync::Arc::new(issues())),
                (
                    SubscriptionId::new("n2"),
                    std::sync::Arc::new(issues().limit(0)),
                ),
            ],
        },
    );
    h.transmits();
    // The live-only member is live once sent.
    let live: Vec<String> = h
        .reports()
        .into_iter()
        .map(|r| match r {
            Report::Eose { sub_id, .. } => sub_id.to_string(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(live, vec!["n2".to_string()]);
    assert!(matches!(
        h.text(
            t(6),
            r#"["CLOSED","n1","unsupported: multi-filter REQs aren't supported"]"#,
        ),
        FrameOutcome::Handled
    ));
    let mut closed: Vec<String> = h
        .reports()
        .into_iter()
        .map(|r| match r {
            Report::Closed { sub_id, .. } => sub_id.to_string(),
            other => panic!("{other:?}"),
        })
        .collect();
    closed.sort();
    assert_eq!(closed, vec!["n1".to_string(), "n2".to_string()]);
}

#[test]
fn a_live_only_req_sent_again_after_auth_does_not_hold_a_fetch() {
    // A live-only REQ is live once sent (nostr-rs-relay never ends one with EOSE). Sent
    // again after NIP-42 AUTH it must stay so: a fetch waiting for its EOSE would be held for
    // the whole connection (review of decision 0112).
    let mut h = Harness::with(config(SessionRole::Remote, Some(Keys::generate())));
    h.subscribe(t(1), "live", issues().limit(0));
    let _ = (h.transmits(), h.reports());
    let _ = h.text(t(2), r#"["CLOSED","live","auth-required: who are you"]"#);
    let _ = h.text(t(3), r#"["AUTH","challenge-1"]"#);
    let id = auth_frame_id(&h.transmits()[0], t(3));
    let _ = h.text(t(4), &format!(r#"["OK","{id}",true,""]"#));
    let _ = h.transmits();
    let e = issue(&Keys::generate(), "x", 1_000);
    h.subscribe(t(5), "f", issues().ids([e.id]));
    let sent = format!("{:?}", h.transmits());
    assert!(
        sent.contains(r#"\"REQ\",\"f\""#),
        "the fetch waits for the EOSE of a live-only REQ: {sent}"
    );
}

#[test]
fn a_fetch_that_sent_no_req_sends_no_close() {
    // Every id of the fetch was delivered before it went out: no REQ, its EOSE at once, and
    // no CLOSE when the machine ends it (review of decision 0112).
    let mut h = Harness::new(SessionRole::Remote);
    let e = issue(&Keys::generate(), "x", 1_000);
    h.subscribe(t(0), "s", issues());
    let _ = forwarded(h.text(t(0), &event_frame("s", &e)));
    let _ = h.text(t(0), r#"["EOSE","s"]"#);
    let _ = (h.transmits(), h.reports());
    h.s.handle_command_with(
        t(1),
        Control::Subscribe {
            generation: 1,
            sub_id: SubscriptionId::new("f"),
            filter: Arc::new(issues().ids([e.id])),
            scope: None,
            fetch_since: None,
        },
        Verified {
            set: &h.set,
            forward_epoch: 0,
        },
    );
    assert!(h.transmits().is_empty());
    let _ = eose_stats(&h.reports(), "f");
    h.s.handle_command(
        t(2),
        Control::Unsubscribe {
            generation: 1,
            sub_id: SubscriptionId::new("f"),
        },
    );
    let sent = h.transmits();
    assert!(sent.is_empty(), "CLOSE for a REQ never sent: {sent:?}");
}
