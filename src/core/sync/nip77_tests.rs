//! NIP-77 reconciliation in simulated time (issue 11): fake relays with a negentropy
//! responder ([`super::world::Nip77Mode`]); every test ends by comparing the *set* of events
//! on the own relay with the expected set.

use std::collections::BTreeSet;
use std::time::Duration;

use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::filter::Filter;
use nostr::key::Keys;
use nostr::types::Timestamp;

use super::world::{announcement, keys, repo, FakeRelay, Nip77Mode, World};
use crate::core::sync::{FallbackReason, Nip77Support, SyncConfig};
use crate::shared::RelayUrl;

const OWN: &str = "ws://own.example";
const A: &str = "ws://a.example";
const DAY: u64 = 86_400;

fn issue(n: usize, created_at: u64) -> Event {
    EventBuilder::new(Kind::Custom(1621), format!("issue {n}"))
        .tag(Tag::parse(["a", &repo("r")]).unwrap())
        .custom_created_at(Timestamp::from_secs(created_at))
        .finalize(&keys())
        .unwrap()
}

fn reply(root: &Event, created_at: u64) -> Event {
    EventBuilder::new(Kind::Custom(1111), "a reply")
        .tag(Tag::parse(["E", &root.id.to_hex()]).unwrap())
        .custom_created_at(Timestamp::from_secs(created_at))
        .finalize(&keys())
        .unwrap()
}

/// The ids asked for by `ids` in the REQs a relay received.
fn ids_requested(f: &FakeRelay) -> BTreeSet<EventId> {
    f.reqs
        .iter()
        .filter_map(|r| r.ids.as_ref())
        .flat_map(|ids| ids.iter().copied())
        .collect()
}

/// REQs that read history without `ids` (paged REQs: neither `limit: 0` nor `ids`).
fn history_reqs(f: &FakeRelay) -> Vec<&Filter> {
    f.reqs
        .iter()
        .filter(|r| r.ids.is_none() && r.limit != Some(0))
        .collect()
}

/// True when `f` matches one of `events`.
fn matches_any(f: &Filter, events: &[Event]) -> bool {
    events
        .iter()
        .any(|e| f.match_event(e, nostr::filter::MatchEventOptions::new()))
}

/// Settings that probe relays not advertising NIP-77.
fn probe(c: &mut SyncConfig) {
    c.nip77.probe_unadvertised = true;
}

struct Case {
    w: World,
    /// What the own relay must end up with.
    want: Vec<Event>,
    /// What it lacked at the start.
    missing: BTreeSet<EventId>,
}

/// Repository `r` announced on A (on the own relay and on A); A holds `n` issues with a
/// reply each, every event its own second; the own relay starts with those for which
/// `own_has(i)` holds (`i` counts issues and replies). A caps answers at 20 and publishes
/// NIP-11 (listing NIP-77 when `advertise`); the own relay caps at 30.
fn case(
    n: usize,
    own_has: impl Fn(usize) -> bool,
    advertise: bool,
    mode: Nip77Mode,
    cfg: impl FnOnce(&mut SyncConfig),
    relay: impl FnOnce(&mut FakeRelay),
) -> Case {
    let mut w = World::new(OWN, cfg);
    let t = w.secs();
    let ann = announcement("r", &[A], t - 30 * DAY);
    w.own.store.push(ann.clone());
    w.own.max_limit = Some(30);
    let mut want = vec![ann.clone()];
    let mut missing = BTreeSet::new();
    {
        let a = w.relay(A);
        a.store.push(ann);
        a.max_limit = Some(20);
        a.publish_nip11 = true;
        a.advertise_nip77 = advertise;
        a.nip77 = mode;
        relay(a);
    }
    for i in 0..n {
        let root = issue(i, t - 20 * DAY + 2 * i as u64);
        let rep = reply(&root, t - 20 * DAY + 2 * i as u64 + 1);
        for (k, e) in [(2 * i, root), (2 * i + 1, rep)] {
            w.relay(A).store.push(e.clone());
            if own_has(k) {
                w.own.store.push(e.clone());
            } else {
                missing.insert(e.id);
            }
            want.push(e);
        }
    }
    Case { w, want, missing }
}

impl Case {
    fn run(&mut self, secs: u64) {
        self.w.start();
        self.w
            .run_for(Duration::from_secs(secs), Duration::from_secs(5));
    }

    fn assert_exact(&self) {
        let want: Vec<&Event> = self.want.iter().collect();
        self.w.assert_own_holds(&want);
    }

    fn a(&self) -> &FakeRelay {
        &self.w.relays[&RelayUrl::parse(A).unwrap()]
    }

    fn fallbacks(&self, r: FallbackReason) -> u64 {
        self.w.m.counters().fallbacks(r)
    }
}

#[test]
fn reconciliation_fetches_exactly_the_missing_events_at_0_1_50_100_percent() {
    // 100 issues + 100 replies; the own relay lacks none, 1 in 100, every other, all.
    type OwnHas = fn(usize) -> bool;
    // (At 50 % the own relay holds every other issue with its reply: it holds something for
    // every query. Where it holds nothing for a query, the query is one REQ instead: the
    // 100 % case below.)
    let cases: [(&str, OwnHas); 3] = [
        ("0%", |_| true),
        ("1%", |i| i % 100 != 7),
        ("50%", |i| (i / 2) % 2 == 0),
    ];
    for (name, own_has) in cases {
        let mut c = case(100, own_has, true, Nip77Mode::On, |_| {}, |_| {});
        let own_before = c.w.own.store.clone();
        c.run(120);
        c.assert_exact();
        // History came by reconciliation only: exactly the missing ids were asked for, and
        // the only paged REQs are of queries the own relay held nothing for (here: nothing
        // matches them anywhere).
        for f in history_reqs(c.a()) {
            assert!(
                !matches_any(f, &own_before),
                "{name}: a paged history REQ of a query the own relay held events for: {f:?}"
            );
        }
        // At 50 % the replies of the issues found on A are asked for in a new query (by
        // their roots) that the own relay holds nothing for: one REQ reads them.
        let fetched = ids_requested(c.a());
        if name == "50%" {
            assert!(fetched.is_subset(&c.missing), "{name}: ids fetched");
            assert!(fetched.len() >= c.missing.len() / 2, "{name}: ids fetched");
        } else {
            assert_eq!(fetched, c.missing, "{name}: ids fetched");
        }
        let counters = c.w.m.counters();
        assert!(counters.reconciliations >= 2, "{name}: {counters:?}");
        assert_eq!(
            counters.reconcile_ids_fetched,
            fetched.len() as u64,
            "{name}"
        );
        assert_eq!(counters.reconcile_fallbacks, [0; 8], "{name}");
        assert_eq!(
            c.w.m.nip77_support(&RelayUrl::parse(A).unwrap()),
            Nip77Support::Advertised
        );
        let st = &c.w.m.relay_statuses(c.w.now)[0];
        assert_eq!(st.confirmed_repos, 1, "{name}");
        assert_eq!(st.reconciliations_pending, 0, "{name}");
    }
}

#[test]
fn a_query_the_own_relay_holds_nothing_for_is_one_req_not_a_reconciliation() {
    // A first sync: the own relay holds the announcement only. Layer 1 is reconciled (the
    // own relay holds its announcement); the repository's queries are read by REQ, since a
    // reconciliation would only list every id to fetch by `ids`.
    let mut c = case(100, |_| false, true, Nip77Mode::On, |_| {}, |_| {});
    c.run(120);
    c.assert_exact();
    assert!(
        ids_requested(c.a()).is_empty(),
        "{:?}",
        ids_requested(c.a())
    );
    assert!(!history_reqs(c.a()).is_empty());
    let counters = c.w.m.counters();
    assert!(counters.reconcile_skipped_empty >= 1, "{counters:?}");
    assert!(counters.reconciliations >= 1, "{counters:?}");
    assert_eq!(counters.reconcile_fallbacks, [0; 8]);
    // Still known to speak NIP-77: a later full sync reconciles what the own relay now holds.
    let a = RelayUrl::parse(A).unwrap();
    assert_eq!(c.w.m.nip77_support(&a), Nip77Support::Advertised);
    let before = counters.reconciliations;
    c.w.run_for(Duration::from_secs(26 * 3600), Duration::from_secs(600));
    c.assert_exact();
    let after = c.w.m.counters();
    assert!(after.daily_resyncs >= 1);
    assert!(after.reconciliations >= before + 3, "{after:?}");
    assert_eq!(after.reconcile_fallbacks, [0; 8]);
}

fn falls_back_on(mode: Nip77Mode, reason: FallbackReason) {
    let mut c = case(30, |i| i % 3 == 0, true, mode, |_| {}, |_| {});
    c.run(400);
    c.assert_exact();
    assert!(c.fallbacks(reason) > 0, "{mode:?}: {:?}", c.w.m.counters());
    assert!(!history_reqs(c.a()).is_empty(), "{mode:?}: no paged REQ");
    assert!(ids_requested(c.a()).is_empty(), "{mode:?}");
    assert_eq!(c.w.m.counters().reconciliations, 0, "{mode:?}");
}

#[test]
fn neg_err_falls_back_to_paged_reqs_with_the_exact_set() {
    falls_back_on(Nip77Mode::Err, FallbackReason::NegErr);
}

#[test]
fn closed_falls_back_to_paged_reqs_with_the_exact_set() {
    falls_back_on(Nip77Mode::Closed, FallbackReason::Closed);
}

#[test]
fn silence_falls_back_to_paged_reqs_with_the_exact_set() {
    // Advertised, never answering (nostr.wine): the first silence is the verdict.
    falls_back_on(Nip77Mode::Silent, FallbackReason::Unsupported);
}

#[test]
fn malformed_hex_falls_back_to_paged_reqs_with_the_exact_set() {
    falls_back_on(Nip77Mode::BadHex, FallbackReason::Malformed);
}

#[test]
fn an_advertising_relay_answering_with_a_notice_is_read_by_req() {
    // Advertised, yet answering its first NEG-OPEN with a NOTICE (nos.lol, nostr.mom:
    // "negentropy disabled"): it does not speak NIP-77, and all its jobs give way at once.
    falls_back_on(Nip77Mode::Off, FallbackReason::Unsupported);
}

#[test]
fn endless_rounds_are_cut_at_the_bound_and_fall_back() {
    // The relay answers every message with a fingerprint that never matches.
    let mut c = case(
        20,
        |i| i % 2 == 0,
        true,
        Nip77Mode::Endless,
        |c| c.nip77.max_rounds = 6,
        |_| {},
    );
    c.run(400);
    c.assert_exact();
    assert!(
        c.fallbacks(FallbackReason::TooManyRounds) > 0,
        "{:?}",
        c.w.m.counters()
    );
    assert_eq!(c.w.m.counters().reconciliations, 0);
    // Each reconciliation stopped at its bound: 7 answers read, the 7th over the bound.
    let opens = c.a().neg_opens.len();
    assert!(opens > 0);
    assert_eq!(
        c.a().neg_rounds,
        7 * opens,
        "rounds per session are bounded"
    );
}

#[test]
fn a_relay_claiming_too_many_missing_ids_is_read_by_reqs_instead() {
    let mut c = case(
        20,
        |i| i % 2 == 0,
        true,
        Nip77Mode::On,
        |c| c.nip77.max_need_ids = 100,
        |a| a.neg_phantoms = 500,
    );
    c.run(200);
    c.assert_exact();
    assert!(c.fallbacks(FallbackReason::TooManyIds) > 0);
    assert!(
        ids_requested(c.a()).is_empty(),
        "nothing fetched by the claimed ids"
    );
}

/// Ten issues with a reply each on A, which advertises NIP-77 and behaves as `relay` says;
/// the own relay holds some issues and some replies, so every query is reconciled.
fn reconciled_case(relay: impl FnOnce(&mut FakeRelay)) -> Case {
    case(10, |i| i % 3 != 1, true, Nip77Mode::On, |_| {}, relay)
}

#[test]
fn claimed_ids_of_events_the_relay_does_not_serve_change_nothing() {
    // Within the bound: the phantom ids are asked for (with the query's filter) and never
    // arrive; the set is exact and the batch confirms.
    let mut c = reconciled_case(|a| a.neg_phantoms = 5);
    c.run(200);
    c.assert_exact();
    assert!(ids_requested(c.a()).is_superset(&c.missing));
    assert_eq!(c.w.m.relay_statuses(c.w.now)[0].confirmed_repos, 1);
    assert_eq!(c.w.m.relay_statuses(c.w.now)[0].pending_batches, 0);
}

#[test]
fn events_a_relay_lists_outside_the_query_are_fetched_but_never_forwarded() {
    // The fetch asks by `ids` without the query's tag values (issue 21: they were copied
    // into every fetch REQ); the query still decides what is forwarded. A lists, for every
    // query, all it stores, among them comments on a root nobody announced, and serves
    // them when asked by id: they must not reach the own relay.
    let mut c = reconciled_case(|a| a.neg_strangers = true);
    let t = c.w.secs();
    let strangers: Vec<Event> = (0..5)
        .map(|i| {
            let other = Keys::generate();
            EventBuilder::new(Kind::Custom(1111), format!("stranger {i}"))
                .tag(Tag::parse(["e", &"b".repeat(64)]).unwrap())
                .custom_created_at(Timestamp::from(t - 10 * DAY + i))
                .finalize(&other)
                .unwrap()
        })
        .collect();
    c.w.relay(A).store.extend(strangers.iter().cloned());
    c.run(200);
    c.assert_exact();
    let fetched = ids_requested(c.a());
    assert!(
        strangers.iter().any(|e| fetched.contains(&e.id)),
        "the strangers were asked for (the relay listed them)"
    );
    for e in &strangers {
        assert!(
            !c.w.own.store.iter().any(|o| o.id == e.id),
            "an event outside every query reached the own relay"
        );
    }
    // The fetch REQs carry no tag values: the query's are checked, not sent.
    let fetch_reqs: Vec<&Filter> = c.a().reqs.iter().filter(|f| f.ids.is_some()).collect();
    assert!(!fetch_reqs.is_empty());
    for f in fetch_reqs {
        assert!(f.generic_tags.is_empty(), "{f:?}");
    }
    assert_eq!(c.w.m.relay_statuses(c.w.now)[0].confirmed_repos, 1);
}

#[test]
fn a_session_cut_mid_way_ends_with_the_exact_set_and_confirms_nothing_early() {
    // The relay drops the connection at its second negentropy answer; nothing of the
    // batch it belonged to may be confirmed by then.
    let mut c = case(
        40,
        |i| i % 4 == 0,
        true,
        Nip77Mode::DropAfter(1),
        |_| {},
        |_| {},
    );
    c.w.start();
    let a = RelayUrl::parse(A).unwrap();
    let mut dropped = false;
    for _ in 0..100 {
        c.w.advance(Duration::from_secs(1));
        if c.w.m.counters().connect_attempts > 2 && !dropped {
            dropped = true;
            let st = c.w.m.relay_statuses(c.w.now);
            let st = st.iter().find(|s| s.url == a).unwrap();
            assert_eq!(
                st.confirmed_root_events, 0,
                "confirmed before its ids were fetched"
            );
        }
    }
    // From now on the relay answers in full.
    c.w.relays.get_mut(&a).unwrap().nip77 = Nip77Mode::On;
    c.w.run_for(Duration::from_secs(600), Duration::from_secs(5));
    c.assert_exact();
    assert!(dropped, "the session was never cut");
}

#[test]
fn a_relay_without_nip77_is_tried_once_and_remembered() {
    // No NIP-11 at all, and NEG-OPEN answered with a NOTICE (nostr-rs-relay).
    let mut c = case(
        10,
        |i| i % 2 == 0,
        false,
        Nip77Mode::Off,
        probe,
        |a| a.publish_nip11 = false,
    );
    c.run(120);
    c.assert_exact();
    let a = RelayUrl::parse(A).unwrap();
    assert_eq!(c.w.m.nip77_support(&a), Nip77Support::Unsupported);
    assert_eq!(c.a().neg_opens.len(), 1);
    assert_eq!(c.fallbacks(FallbackReason::Unsupported), 1);
    // A new fresh sync (reconnect after the quick window) does not try again.
    c.w.drop(A);
    c.w.relays.get_mut(&a).unwrap().down = true;
    c.w.run_for(Duration::from_secs(20 * 60), Duration::from_secs(10));
    c.w.relays.get_mut(&a).unwrap().down = false;
    c.w.run_for(Duration::from_secs(600), Duration::from_secs(10));
    c.assert_exact();
    assert_eq!(c.a().neg_opens.len(), 1, "tried again");
    assert_eq!(
        c.w.m.relay_statuses(c.w.now)[0].nip77,
        Nip77Support::Unsupported
    );
}

#[test]
fn a_silent_relay_not_advertising_nip77_is_tried_once() {
    let mut c = case(10, |i| i % 2 == 0, false, Nip77Mode::Silent, probe, |_| {});
    c.run(300);
    c.assert_exact();
    assert_eq!(c.a().neg_opens.len(), 1);
    assert_eq!(c.fallbacks(FallbackReason::Unsupported), 1);
}

#[test]
fn a_relay_not_advertising_nip77_that_speaks_it_is_used_after_the_try() {
    let mut c = case(20, |i| i % 2 == 0, false, Nip77Mode::On, probe, |_| {});
    c.run(120);
    c.assert_exact();
    let a = RelayUrl::parse(A).unwrap();
    assert_eq!(c.w.m.nip77_support(&a), Nip77Support::Works);
    // Layer 1 was the try; the daily resync reconciles every query.
    c.w.run_for(Duration::from_secs(26 * 3600), Duration::from_secs(600));
    c.assert_exact();
    assert!(c.w.m.counters().daily_resyncs >= 1);
    assert!(
        c.w.m.counters().reconciliations >= 3,
        "{:?}",
        c.w.m.counters()
    );
    assert_eq!(c.w.m.counters().reconcile_fallbacks, [0; 8]);
}

/// The detections a relay received: NEG-OPENs for the filter that matches nothing.
fn detections(f: &FakeRelay) -> usize {
    f.neg_opens
        .iter()
        .filter(|flt| {
            flt.ids
                .as_ref()
                .is_some_and(|ids| ids.contains(&EventId::from_byte_array([0; 32])))
        })
        .count()
}

#[test]
fn a_relay_not_advertising_nip77_that_speaks_it_is_found_beside_the_req_path() {
    // No NIP-11 (LocalRelay and servers built on rust-nostr's relay builder), default
    // settings: the first sync reads history by REQ, a detection finds NIP-77 meanwhile.
    let mut c = case(
        20,
        |i| i % 2 == 0,
        false,
        Nip77Mode::On,
        |_| {},
        |a| a.publish_nip11 = false,
    );
    c.run(120);
    c.assert_exact();
    let a = RelayUrl::parse(A).unwrap();
    assert_eq!(c.w.m.nip77_support(&a), Nip77Support::Works);
    assert_eq!(detections(c.a()), 1);
    assert_eq!(c.a().neg_opens.len(), 1, "only the detection");
    assert!(!history_reqs(c.a()).is_empty(), "history by REQ");
    assert_eq!(c.w.m.counters().nip77_detections, 1);
    assert_eq!(c.w.m.counters().reconciliations, 0);
    // A stale reconnect (a fresh sync) reconciles instead of reading history again.
    let paged = history_reqs(c.a()).len();
    c.w.drop(A);
    c.w.relays.get_mut(&a).unwrap().down = true;
    c.w.run_for(Duration::from_secs(20 * 60), Duration::from_secs(10));
    c.w.relays.get_mut(&a).unwrap().down = false;
    c.w.run_for(Duration::from_secs(600), Duration::from_secs(10));
    c.assert_exact();
    assert!(
        c.w.m.counters().reconciliations >= 2,
        "{:?}",
        c.w.m.counters()
    );
    assert_eq!(detections(c.a()), 1, "not detected again");
    assert_eq!(c.w.m.counters().reconcile_fallbacks, [0; 8]);
    // Full history REQs again only of queries nothing matches (the own relay holds all).
    let all = history_reqs(c.a());
    let own_now = c.w.own.store.clone();
    for f in all[paged..].iter().filter(|f| f.since.is_none()) {
        assert!(
            !matches_any(f, &own_now),
            "history read again by REQ: {f:?}"
        );
    }
}

#[test]
fn a_detection_ends_with_its_neg_close_before_a_queued_req_takes_its_slot() {
    // Issue 37's production test: a relay without NIP-11 that counts NEG sessions with REQs
    // saw 21 open at a default budget of 20, because the REQ waiting for the detection's
    // slot went out before its NEG-CLOSE.
    let mut c = case(
        40,
        |i| i % 2 == 0,
        false,
        Nip77Mode::On,
        |cfg| cfg.default_subscription_budget = 4,
        |a| {
            a.publish_nip11 = false;
            a.max_subs = Some(4);
            a.negs_count_as_subs = true;
        },
    );
    c.run(120);
    c.assert_exact();
    let a = RelayUrl::parse(A).unwrap();
    assert_eq!(c.w.m.nip77_support(&a), Nip77Support::Works);
    assert_eq!(detections(c.a()), 1);
    assert!(c.a().max_open_seen <= 4, "{} open", c.a().max_open_seen);
}

#[test]
fn a_detection_without_an_answer_in_time_is_closed() {
    // A relay that speaks NIP-77 but answers after the round deadline (30 s) is taken for one
    // that does not; its session must still be closed, or it holds one of the relay's
    // subscription slots (strfry counts sessions with REQs) for the whole connection.
    let mut c = case(
        10,
        |i| i % 2 == 0,
        false,
        Nip77Mode::On,
        |_| {},
        |a| {
            a.publish_nip11 = false;
            a.hold_neg = true;
            a.negs_count_as_subs = true;
        },
    );
    c.run(60);
    c.assert_exact();
    let a = RelayUrl::parse(A).unwrap();
    assert_eq!(c.w.m.nip77_support(&a), Nip77Support::Unsupported);
    assert_eq!(detections(c.a()), 1);
    assert_eq!(
        c.a().open_negs(),
        0,
        "the detection's session is still open"
    );
}

#[test]
fn the_detection_never_holds_history_back_and_remembers_every_no() {
    // NOTICE (nostr-rs-relay), silence, CLOSED: the history arrives long before the round
    // deadline, and the relay is known not to speak NIP-77 afterwards.
    for mode in [Nip77Mode::Off, Nip77Mode::Silent, Nip77Mode::Closed] {
        let mut c = case(
            10,
            |i| i % 2 == 0,
            false,
            mode,
            |_| {},
            |a| a.publish_nip11 = false,
        );
        c.run(15);
        c.assert_exact();
        c.w.run_for(Duration::from_secs(60), Duration::from_secs(5));
        let a = RelayUrl::parse(A).unwrap();
        assert_eq!(
            c.w.m.nip77_support(&a),
            Nip77Support::Unsupported,
            "{mode:?}"
        );
        assert_eq!(detections(c.a()), 1, "{mode:?}");
        assert_eq!(c.w.m.counters().reconcile_fallbacks, [0; 8], "{mode:?}");
        c.w.drop(A);
        c.w.relays.get_mut(&a).unwrap().down = true;
        c.w.run_for(Duration::from_secs(20 * 60), Duration::from_secs(10));
        c.w.relays.get_mut(&a).unwrap().down = false;
        c.w.run_for(Duration::from_secs(600), Duration::from_secs(10));
        c.assert_exact();
        assert_eq!(c.a().neg_opens.len(), 1, "{mode:?}: tried again");
    }
}

#[test]
fn a_neg_err_to_the_detection_teaches_nothing() {
    let mut c = case(
        10,
        |i| i % 2 == 0,
        false,
        Nip77Mode::Err,
        |_| {},
        |a| a.publish_nip11 = false,
    );
    c.run(60);
    c.assert_exact();
    let a = RelayUrl::parse(A).unwrap();
    assert_eq!(c.w.m.nip77_support(&a), Nip77Support::Unknown);
    assert_eq!(c.w.m.counters().reconcile_fallbacks, [0; 8]);
}

#[test]
fn no_detection_when_nip77_or_detection_is_off() {
    type Cfg = fn(&mut SyncConfig);
    let offs: [Cfg; 2] = [
        |c| c.nip77.enabled = false,
        |c| c.nip77.detect_unadvertised = false,
    ];
    for off in offs {
        let mut c = case(10, |i| i % 2 == 0, false, Nip77Mode::On, off, |_| {});
        c.run(120);
        c.assert_exact();
        assert!(c.a().neg_opens.is_empty());
        assert_eq!(c.w.m.counters().reconciliations, 0);
        assert_eq!(c.w.m.counters().nip77_detections, 0);
    }
}

#[test]
fn an_own_side_above_its_bound_falls_back() {
    let mut c = case(
        30,
        |i| i % 2 == 0,
        true,
        Nip77Mode::On,
        |c| c.nip77.max_own_items = 10,
        |_| {},
    );
    c.run(200);
    c.assert_exact();
    assert!(c.fallbacks(FallbackReason::OwnSide) > 0);
}

#[test]
fn a_neg_msg_for_an_unknown_session_is_dropped_and_counted() {
    let mut c = case(5, |_| true, true, Nip77Mode::On, |_| {}, |_| {});
    c.run(60);
    let before = c.w.m.counters();
    c.w.stray_neg_msg(A, "gs999999");
    let after = c.w.m.counters();
    assert_eq!(after.neg_unknown, before.neg_unknown + 1);
    assert_eq!(after.reconcile_fallbacks, before.reconcile_fallbacks);
    c.assert_exact();
}

#[test]
fn hex_round_trips_and_rejects_garbage() {
    use super::reconcile::{hex_decode, hex_encode};
    assert_eq!(hex_encode(&[0x61, 0x00, 0xff]), "6100ff");
    assert_eq!(hex_decode("6100FF"), Some(vec![0x61, 0x00, 0xff]));
    assert_eq!(hex_decode("610"), None);
    assert_eq!(hex_decode("zz"), None);
    assert_eq!(hex_decode("é1"), None);
}

#[test]
fn a_fetch_that_ends_without_events_it_asked_for_asks_again_and_gets_them() {
    // Issue 33: A lists every missing event and, asked by id, leaves some out once (a
    // store still writing, a cut answer). Before, the batch confirmed at the fetch's EOSE
    // and those events were never asked for again.
    let mut c = reconciled_case(|_| {});
    let withheld: BTreeSet<EventId> = c.missing.iter().take(3).copied().collect();
    c.w.relay(A).withhold_once = withheld.clone();
    c.run(200);
    c.assert_exact();
    let counters = c.w.m.counters();
    assert_eq!(counters.fetch_ids_retried, 3, "{counters:?}");
    assert_eq!(counters.fetch_ids_undelivered, 0, "{counters:?}");
    assert!(c.a().withhold_once.is_empty(), "each was asked for");
    let st = &c.w.m.relay_statuses(c.w.now)[0];
    assert_eq!((st.pending_batches, st.ids_undelivered), (0, 0));
    // A second asking that delivered everything is forgotten (review: each stayed in the
    // set for the life of the process).
    assert!(
        c.w.m.recon.refetches.is_empty(),
        "{:?}",
        c.w.m.recon.refetches
    );
}

#[test]
fn ids_a_relay_lists_and_never_serves_are_asked_twice_then_reported() {
    // Phantom ids (listed, never served): the batch still confirms, but not in silence:
    // asked for a second time, then counted for the relay and as an incomplete query.
    let mut c = reconciled_case(|a| a.neg_phantoms = 5);
    c.run(200);
    c.assert_exact();
    let counters = c.w.m.counters();
    // Five phantoms are listed in every reconciliation.
    let phantoms = 5 * counters.reconciliations;
    assert!(phantoms > 0);
    assert_eq!(counters.fetch_ids_retried, phantoms, "{counters:?}");
    assert_eq!(counters.fetch_ids_undelivered, phantoms, "{counters:?}");
    let st = &c.w.m.relay_statuses(c.w.now)[0];
    assert_eq!(st.ids_undelivered, phantoms);
    assert_eq!(st.history_short, phantoms, "short until the next full sync");
    assert!(st.incomplete_queries >= 1);
    assert_eq!(st.pending_batches, 0);
}

#[test]
fn no_nip77_verdict_while_the_relay_is_not_read_and_a_no_expires_after_a_day() {
    // Issue 36, item 1: while the forward queue is full the relay threads read nothing, so
    // a NEG-OPEN's answer cannot arrive (modelled by a silent relay); the detection's and
    // the rounds' deadlines wait like EOSE deadlines instead of recording "no NIP-77".
    let mut c = case(10, |i| i % 2 == 0, false, Nip77Mode::Silent, probe, |_| {});
    let a = RelayUrl::parse(A).unwrap();
    c.w.start();
    c.w.inject(super::Report::ForwardBackPressure { active: true });
    c.w.run_for(Duration::from_secs(300), Duration::from_secs(5));
    assert_eq!(
        c.w.m.nip77_support(&a),
        Nip77Support::Unknown,
        "no verdict while nothing is read"
    );
    assert_eq!(c.fallbacks(FallbackReason::Unsupported), 0);
    // Reading resumes; the relay stays silent: now the silence is a verdict.
    c.w.inject(super::Report::ForwardBackPressure { active: false });
    c.w.run_for(Duration::from_secs(120), Duration::from_secs(5));
    assert_eq!(c.w.m.nip77_support(&a), Nip77Support::Unsupported);
    c.assert_exact();
    // A day later the relay answers NIP-77: its next fresh sync (the daily resync) tries
    // again and learns it.
    c.w.relay(A).nip77 = Nip77Mode::On;
    c.w.run_for(Duration::from_secs(26 * 3600), Duration::from_secs(600));
    assert!(c.w.m.counters().daily_resyncs >= 1);
    assert_eq!(c.w.m.nip77_support(&a), Nip77Support::Works);
    c.assert_exact();
}

#[test]
fn neg_sessions_count_in_the_subscription_budget_of_a_relay_that_counts_them() {
    // Issue 36, item 4: strfry counts NEG-OPEN sessions with REQs and answers the one over
    // its limit with a NOTICE (no CLOSED, no EOSE). Uncounted, a reconciliation opened with
    // every slot held by REQs got that NOTICE and the relay was taken for one without
    // NIP-77. A holds 10 issues with a reply each, the own relay some of each, so every
    // query is reconciled; A allows 5 subscriptions, NEG sessions included.
    let mut c = case(
        10,
        |i| i % 3 != 1,
        true,
        Nip77Mode::On,
        |_| {},
        |a| {
            a.profile(super::world::SimProfile::Strfry);
            a.max_subs = Some(5);
            a.max_limit = Some(20);
        },
    );
    c.run(600);
    c.assert_exact();
    let a = RelayUrl::parse(A).unwrap();
    assert!(
        c.w.m.nip77_support(&a).in_use(),
        "{:?}",
        c.w.m.nip77_support(&a)
    );
    assert_eq!(c.fallbacks(FallbackReason::Unsupported), 0);
    assert_eq!(c.w.m.counters().notices_other, 0, "{:?}", c.w.m.counters());
    assert!(
        c.w.m.counters().reconciliations >= 2,
        "{:?}",
        c.w.m.counters()
    );
    assert!(
        c.a().max_open_seen <= 5,
        "REQs and NEG sessions at once: {}",
        c.a().max_open_seen
    );
}

#[test]
fn a_relay_allowing_two_or_three_subscriptions_is_reconciled() {
    // Review of issue 36 item 4: with a budget of 2, the slot kept for NIP-77 left one REQ;
    // Layer 1 held it, every reconciliation's live REQ waited behind it, and no job started:
    // 7 events never arrived.
    for max_subs in [2, 3, 4] {
        let mut c = case(
            10,
            |i| i % 3 != 1,
            true,
            Nip77Mode::On,
            |_| {},
            |a| a.max_subs = Some(max_subs),
        );
        c.run(600);
        c.assert_exact();
        assert!(
            c.w.m.counters().reconciliations >= 1,
            "budget {max_subs}: {:?}",
            c.w.m.counters()
        );
    }
}

#[test]
fn a_relay_answering_each_round_just_in_time_holds_a_slot_only_until_the_job_deadline() {
    // Issue 36, item 12: a relay answering every round after 29 s with a mismatch held one
    // of the `max_active` slots for ~32 minutes (64 rounds × 30 s). The job has a deadline
    // of its own (5 min): then its query is read by REQ, with the exact set.
    let mut c = reconciled_case(|a| {
        a.nip77 = Nip77Mode::Endless;
        a.hold_neg = true;
    });
    c.w.start();
    let mut fell_back_at = None;
    for step in 0..80u64 {
        c.w.advance(Duration::from_secs(29));
        c.w.release_neg(A);
        if fell_back_at.is_none() && c.fallbacks(FallbackReason::Timeout) > 0 {
            fell_back_at = Some(29 * (step + 1));
        }
    }
    let at = fell_back_at.expect("the job ended at its deadline");
    assert!(at <= 300 + 60, "fell back after {at} s");
    c.w.run_for(Duration::from_secs(600), Duration::from_secs(5));
    c.assert_exact();
}

#[test]
fn neg_msg_bytes_of_one_reconciliation_are_bounded() {
    // Issue 36, item 12: rounds are bounded in count and in bytes.
    let mut c = case(
        10,
        |i| i % 3 != 1,
        true,
        Nip77Mode::Endless,
        |cfg| {
            cfg.nip77.max_rounds = 10_000;
            cfg.nip77.max_neg_bytes = 200;
        },
        |_| {},
    );
    c.run(300);
    c.assert_exact();
    assert!(c.fallbacks(FallbackReason::TooManyRounds) > 0);
    assert!(c.a().neg_rounds < 40, "{} rounds", c.a().neg_rounds);
}

#[test]
fn an_own_side_query_dropped_without_eose_is_read_again_not_waited_out() {
    // nostr-rs-relay as the own relay drops a query's stored answer now and then, without
    // EOSE (docs/relays.md). The first own-side read of a repository's query gets no answer:
    // it is read again after `own_read_timeout` (15 s) and the reconciliation goes on; before,
    // the job waited out `eose_timeout` (120 s) and then read the query's history by REQ.
    let mut c = case(30, |i| i % 3 == 0, true, Nip77Mode::On, |_| {}, |_| {});
    c.w.own.drop_answers = Some((|f: &Filter| !f.generic_tags.is_empty(), 1));
    c.run(60);
    assert!(
        c.w.own.drop_answers.is_none(),
        "no own-side read was dropped"
    );
    c.assert_exact();
    let counters = c.w.m.counters();
    assert_eq!(counters.reconcile_fallbacks, [0; 8], "{counters:?}");
    assert!(counters.queries_resent >= 1, "{counters:?}");
    assert!(counters.reconciliations >= 2, "{counters:?}");
}

#[test]
fn an_own_side_never_answered_gives_way_after_three_reads() {
    // The own relay drops every answer to the own side of one reconciliation (one runs at a
    // time): it is read three times (15 + 30 + 60 s), then the query's history is read by
    // REQ; nothing is lost.
    let mut c = case(
        30,
        |i| i % 3 == 0,
        true,
        Nip77Mode::On,
        |c| c.nip77.max_active = 1,
        |_| {},
    );
    c.w.own.drop_answers = Some((|f: &Filter| !f.generic_tags.is_empty(), 3));
    c.run(400);
    c.assert_exact();
    let counters = c.w.m.counters();
    assert_eq!(c.fallbacks(FallbackReason::OwnSide), 1, "{counters:?}");
    assert_eq!(counters.queries_resent, 2, "{counters:?}");
}

#[test]
fn a_fetch_does_not_ask_for_what_a_req_of_its_batch_delivers() {
    // Issue 37 (decision 0112): one batch on A carries `#e`, `#E` and `#q` of root issue R.
    // The own relay holds R and a status tagging it with `e`, so `#e` is reconciled and
    // fetches the comments by id; it holds nothing for `#E`, which is sent as one REQ and
    // streams the same comments (they tag R with both `e` and `E`). Before, the fetch went
    // out first and the REQ delivered every comment a second time.
    let mut w = World::new(OWN, |_| {});
    let t = w.secs();
    let ann = announcement("r", &[A], t - 30 * DAY);
    let root = issue(0, t - 20 * DAY);
    let status = EventBuilder::new(Kind::Custom(1630), "open")
        .tag(Tag::parse(["e", &root.id.to_hex()]).unwrap())
        .custom_created_at(Timestamp::from_secs(t - 20 * DAY + 1))
        .finalize(&keys())
        .unwrap();
    let comments: Vec<Event> = (0..40)
        .map(|i| {
            EventBuilder::new(Kind::Custom(1111), format!("comment {i}"))
                .tag(Tag::parse(["E", &root.id.to_hex()]).unwrap())
                .tag(Tag::parse(["e", &root.id.to_hex()]).unwrap())
                .custom_created_at(Timestamp::from_secs(t - 19 * DAY + i))
                .finalize(&keys())
                .unwrap()
        })
        .collect();
    for e in [&ann, &root, &status] {
        w.own.store.push(e.clone());
    }
    {
        let a = w.relay(A);
        a.publish_nip11 = true;
        a.advertise_nip77 = true;
        a.nip77 = Nip77Mode::On;
        a.store.extend([ann.clone(), root.clone(), status.clone()]);
        a.store.extend(comments.iter().cloned());
    }
    w.start();
    w.run_for(Duration::from_secs(120), Duration::from_secs(5));
    let mut want = vec![&ann, &root, &status];
    want.extend(comments.iter());
    w.assert_own_holds(&want);
    let a = &w.relays[&RelayUrl::parse(A).unwrap()];
    // The `#e` query was reconciled and the `#E` query read by REQ, as the case means.
    assert!(a
        .neg_opens
        .iter()
        .any(|f| f.generic_tags.keys().any(|k| k.to_string() == "e")));
    assert!(history_reqs(a)
        .iter()
        .any(|f| f.generic_tags.keys().any(|k| k.to_string() == "E")));
    // No fetch asked by id for a comment the REQ delivered.
    let comment_ids: BTreeSet<EventId> = comments.iter().map(|e| e.id).collect();
    let fetched: BTreeSet<EventId> = ids_requested(a)
        .intersection(&comment_ids)
        .copied()
        .collect();
    assert!(fetched.is_empty(), "fetched again by id: {fetched:?}");
}

#[test]
fn a_query_no_event_on_the_own_relay_tags_is_one_req_without_an_own_read() {
    // A first sync: the own relay holds the announcement only, and the self-subscription
    // has read it. The replies of the issues found on A are asked for by their ids, which
    // no event on the own relay tags: the first query of each chunk is one REQ at once,
    // without reading the own relay's side (decision 0120).
    let mut c = case(100, |_| false, true, Nip77Mode::On, |_| {}, |_| {});
    c.run(120);
    c.assert_exact();
    let counters = c.w.m.counters();
    assert!(counters.own_reads_skipped >= 1, "{counters:?}");
    let id_tags = ['e', 'E', 'q'].map(|l| nostr::filter::SingleLetterTag::from_char(l).unwrap());
    let layer3 = |f: &&Filter| {
        f.generic_tags.keys().any(|t| id_tags.contains(t))
            && f.generic_tags.values().flatten().all(|v| v.len() == 64)
    };
    let asked_own: Vec<&Filter> = c.w.own.reqs.iter().filter(layer3).collect();
    let unread: Vec<&Filter> = history_reqs(c.a())
        .into_iter()
        .filter(layer3)
        .filter(|f| !asked_own.iter().any(|o| o.generic_tags == f.generic_tags))
        .collect();
    assert!(
        !unread.is_empty(),
        "every Layer 3 query was read on the own relay first"
    );
    // The other tags of the same ids went through the own read (by then the REQ's events
    // may be there): one query per chunk of ids, not three (a query's pages share its tags).
    let queries: BTreeSet<String> = unread
        .iter()
        .map(|f| format!("{:?}", f.generic_tags))
        .collect();
    assert!(
        queries.len() as u64 <= counters.own_reads_skipped,
        "{} queries unread, {} skipped",
        queries.len(),
        counters.own_reads_skipped
    );
    // Those ids under the other tags were read on the own relay first (`insert_query`).
    let values =
        |f: &Filter| -> BTreeSet<String> { f.generic_tags.values().flatten().cloned().collect() };
    for f in &unread {
        assert!(
            asked_own.iter().any(|o| values(o) == values(f)),
            "the {} ids of a {:?} query were not read on the own relay under another tag",
            values(f).len(),
            f.generic_tags.keys().collect::<Vec<_>>()
        );
    }
    assert_eq!(counters.reconcile_fallbacks, [0; 8]);
}

#[test]
fn the_own_tag_index_answers_only_once_the_own_relays_stored_events_are_read() {
    // Decision 0120: the index of what the own relay's events tag stands for the own
    // relay only once the self-subscription has read its stored events to their end on
    // the current connection.
    let mut c = case(10, |_| true, true, Nip77Mode::On, |_| {}, |_| {});
    assert!(!c.w.m.own_tags.is_complete());
    c.run(120);
    c.assert_exact();
    assert!(c.w.m.own_tags.is_complete());
    // Every reply the own relay held is in it by its root's id (`E`).
    let e_upper = nostr::filter::SingleLetterTag::from_char('E').unwrap();
    for e in
        c.w.own
            .store
            .iter()
            .filter(|e| e.kind == Kind::Custom(1111))
    {
        let root = e.tags.iter().find_map(|t| t.content()).unwrap().to_string();
        let f = Filter::new().custom_tags(e_upper, [root]);
        assert!(c.w.m.own_tags.may_match(&f));
    }
    // The own relay restarts: the index stops answering until the new connection's read of
    // its stored events has ended.
    c.w.drop(OWN);
    assert!(!c.w.m.own_tags.is_complete());
    c.w.run_for(Duration::from_secs(120), Duration::from_secs(5));
    assert!(c.w.m.own_tags.is_complete());
    c.assert_exact();
}
