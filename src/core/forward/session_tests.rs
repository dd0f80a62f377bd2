//! The forward session in simulated time: every answer of the own relay, NIP-42, keep-alive,
//! the intake pause and the wait policies, with frames in and frames out as on the socket.

use std::sync::Arc;
use std::time::Duration;

use nostr::event::EventId;

use super::session::{event_frame, full_window_linger, throttle_warning};
use super::*;
use crate::core::auth::AuthLimits;
use crate::core::dedup::VerifiedSet;
use crate::core::relay_text::Prefix;
use crate::core::session::Frame;
use crate::core::time::Time;
use crate::shared::RelayUrl;

fn id(n: u32) -> EventId {
    let mut b = [0u8; 32];
    b[..4].copy_from_slice(&n.to_le_bytes());
    EventId::from_byte_array(b)
}

/// An event's JSON: its id, `kind` and tags.
fn json(n: u32, kind: u16, tags: &[[&str; 2]]) -> Arc<str> {
    serde_json::json!({"id": id(n).to_hex(), "kind": kind, "pubkey": "pk", "tags": tags})
        .to_string()
        .into()
}

fn limits() -> ForwardLimits {
    ForwardLimits {
        in_flight: 2,
        ok_timeout: Duration::from_secs(10),
        backlog: 8,
        rejected_kept: 10,
        rate_limit_pause: Duration::from_secs(2),
        ..ForwardLimits::default()
    }
}

/// A session, its verified set and a simulated clock.
struct Sim {
    s: ForwardSession,
    v: VerifiedSet,
    now: Time,
}

impl Sim {
    fn new(limits: ForwardLimits) -> Sim {
        Sim::with(ForwardConfig::new(url(), limits))
    }

    fn with(config: ForwardConfig) -> Sim {
        let now = Time::from_secs(1_000);
        let mut s = ForwardSession::new(config);
        s.on_connected(now);
        Sim {
            s,
            v: VerifiedSet::new(100),
            now,
        }
    }

    fn keyed(limits: ForwardLimits) -> Sim {
        Sim::with(ForwardConfig {
            auth_keys: Some(nostr::key::Keys::generate()),
            ..ForwardConfig::new(url(), limits)
        })
    }

    fn offer(&mut self, n: u32) -> Offer {
        self.offer_raw(n, json(n, 1, &[]))
    }

    fn offer_raw(&mut self, n: u32, raw: Arc<str>) -> Offer {
        self.s.offer(id(n), raw, false, &self.v)
    }

    fn advance(&mut self, d: Duration) {
        self.now = self.now.plus(d);
    }

    /// One turn's send phase: the ids of the events written (AUTH and pings left out).
    fn turn(&mut self) -> Vec<EventId> {
        self.s.handle_timeout(self.now);
        self.written()
    }

    /// Polls every transmit: the ids of the events among them.
    fn written(&mut self) -> Vec<EventId> {
        let mut out = Vec::new();
        while let Some(t) = self.s.poll_transmit(self.now) {
            if let ForwardTransmit::Text(text) = t {
                if let Some(e) = event_id(&text) {
                    out.push(e);
                }
            }
        }
        out
    }

    fn frame(&mut self, text: &str) {
        self.s.handle_frame(self.now, Frame::Text(text), &self.v);
    }

    fn ok(&mut self, n: u32, accepted: bool, message: &str) {
        self.frame(&ok_frame(id(n), accepted, message));
    }

    fn events(&mut self) -> Vec<ForwardEvent> {
        std::iter::from_fn(|| self.s.poll_event()).collect()
    }

    /// The outcomes of the answers among the events.
    fn outcomes(&mut self) -> Vec<(EventId, OkOutcome)> {
        self.events()
            .into_iter()
            .filter_map(|e| match e {
                ForwardEvent::Answered { id, outcome, .. } => Some((id, outcome)),
                _ => None,
            })
            .collect()
    }

    /// The AUTH frame written, if any.
    fn auth_frame(&mut self) -> Option<serde_json::Value> {
        while let Some(t) = self.s.poll_transmit(self.now) {
            if let ForwardTransmit::Text(text) = t {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                if v[0] == "AUTH" {
                    return Some(v);
                }
            }
        }
        None
    }
}

fn url() -> RelayUrl {
    RelayUrl::parse("ws://own.example").unwrap()
}

fn ok_frame(id: EventId, accepted: bool, message: &str) -> String {
    serde_json::json!(["OK", id.to_hex(), accepted, message]).to_string()
}

/// The id of the event in an `["EVENT", …]` frame.
fn event_id(frame: &str) -> Option<EventId> {
    let v: serde_json::Value = serde_json::from_str(frame).ok()?;
    (v[0] == "EVENT").then(|| EventId::from_hex(v[1]["id"].as_str()?).ok())?
}

#[test]
fn an_offered_event_goes_out_as_its_exact_json_and_an_ok_stores_it() {
    let mut sim = Sim::new(limits());
    let raw = json(1, 1, &[]);
    assert_eq!(sim.offer_raw(1, raw.clone()), Offer::Queued);
    sim.s.handle_timeout(sim.now);
    assert_eq!(
        sim.s.poll_transmit(sim.now),
        Some(ForwardTransmit::Text(format!("[\"EVENT\",{raw}]")))
    );
    sim.advance(Duration::from_millis(30));
    sim.ok(1, true, "");
    assert_eq!(
        sim.events(),
        vec![ForwardEvent::Answered {
            id: id(1),
            outcome: OkOutcome::Stored,
            latency: Some(Duration::from_millis(30)),
        }]
    );
    assert!(sim.s.is_idle());
    assert_eq!(sim.offer(1), Offer::AlreadyStored);
    assert_eq!(sim.events(), vec![ForwardEvent::Settled(1)]);
}

#[test]
fn events_go_out_only_in_a_turns_send_phase() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    sim.offer(2);
    sim.offer(3);
    assert_eq!(sim.written(), vec![], "no turn began");
    assert_eq!(sim.turn(), vec![id(1), id(2)], "a window of two");
    sim.ok(1, true, "");
    // The slot the OK freed is filled on the next turn, with whatever else it frees.
    assert_eq!(sim.written(), vec![]);
    assert!(sim.s.sends_now(sim.now));
    assert_eq!(sim.turn(), vec![id(3)]);
    assert!(!sim.s.sends_now(sim.now));
}

#[test]
fn nothing_is_written_while_disconnected_and_what_was_in_flight_goes_again() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    sim.offer(2);
    assert_eq!(sim.turn(), vec![id(1), id(2)]);
    sim.offer(3);
    sim.s.on_disconnect();
    assert!(!sim.s.is_connected());
    assert_eq!(sim.turn(), vec![]);
    assert_eq!(sim.s.queue().counters().resent, 2);
    sim.s.on_connected(sim.now);
    let mut again = sim.turn();
    again.sort();
    assert_eq!(again, vec![id(1), id(2)], "both again, ahead of the rest");
}

#[test]
fn an_ok_overdue_sends_the_event_again() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    assert_eq!(sim.turn(), vec![id(1)]);
    let deadline = sim.now.plus(Duration::from_secs(10));
    assert_eq!(sim.s.poll_timeout(), Some(deadline));
    sim.advance(Duration::from_millis(9_999));
    assert_eq!(sim.turn(), vec![], "not yet");
    sim.advance(Duration::from_millis(1));
    assert_eq!(sim.turn(), vec![id(1)]);
    assert_eq!(sim.s.queue().counters().resent, 1);
    sim.ok(1, true, "");
    assert_eq!(sim.outcomes(), vec![(id(1), OkOutcome::Stored)]);
}

#[test]
fn rate_limited_requeues_at_the_front_and_paces_the_sends() {
    let mut sim = Sim::new(limits());
    for n in 1..=4 {
        sim.offer(n);
    }
    assert_eq!(sim.turn(), vec![id(1), id(2)]);
    sim.ok(1, false, "rate-limited: slow down");
    assert_eq!(sim.outcomes(), vec![(id(1), OkOutcome::RateLimited)]);
    let throttle = sim.s.queue().throttle().expect("throttled");
    assert_eq!(throttle.pace, MIN_PACE);
    // The first of a spell pauses for the rate-limit pause.
    assert_eq!(
        sim.s.poll_timeout(),
        Some(sim.now.plus(Duration::from_secs(2)))
    );
    assert_eq!(sim.turn(), vec![]);
    sim.advance(Duration::from_secs(2));
    assert_eq!(
        sim.turn(),
        vec![id(1)],
        "one event per interval, the refused one first"
    );
    sim.ok(2, true, "");
    sim.ok(1, true, "");
    assert_eq!(sim.turn(), vec![], "paced");
    sim.advance(MIN_PACE);
    assert_eq!(sim.turn(), vec![id(3)]);
}

#[test]
fn rate_limited_answers_to_one_window_are_one_round() {
    let mut sim = Sim::new(limits());
    for n in 1..=3 {
        sim.offer(n);
    }
    assert_eq!(sim.turn(), vec![id(1), id(2)]);
    sim.ok(1, false, "rate-limited: slow down");
    sim.ok(2, false, "rate-limited: slow down");
    assert_eq!(
        sim.s.queue().throttle().unwrap().pace,
        MIN_PACE,
        "one round"
    );
    sim.advance(Duration::from_secs(2));
    assert_eq!(sim.turn(), vec![id(2)]);
    sim.ok(2, false, "rate-limited: still");
    assert!(
        sim.s.queue().throttle().unwrap().pace > MIN_PACE,
        "a new round"
    );
}

#[test]
fn duplicate_answers_end_the_pacing_like_stored_ones() {
    // ngit-grasp answers every stored write `OK true "duplicate: event stored"`.
    let mut sim = Sim::new(ForwardLimits {
        in_flight: 1,
        backlog: 4096,
        ..limits()
    });
    for n in 0..300 {
        sim.offer(n);
    }
    assert_eq!(sim.turn(), vec![id(0)]);
    sim.ok(0, false, "rate-limited: slow down");
    let mut stored = 0;
    for _ in 0..10_000 {
        sim.advance(MIN_PACE);
        for e in sim.turn() {
            sim.frame(&ok_frame(e, true, "duplicate: event stored"));
            stored += 1;
        }
        if sim.s.queue().throttle().is_none() {
            break;
        }
    }
    assert!(sim.s.queue().throttle().is_none(), "pacing ended");
    assert!(stored >= FAST_RUN as usize);
    // Unpaced: an answer lets the next event go at once.
    sim.advance(MIN_PACE);
    let sent = sim.turn();
    assert_eq!(sent.len(), 1);
    sim.frame(&ok_frame(sent[0], true, ""));
    assert_eq!(sim.turn().len(), 1, "no pause after a send");
}

#[test]
fn error_requeues_at_the_back_and_pauses_longer_each_round() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    sim.offer(2);
    sim.offer(3);
    assert_eq!(sim.turn(), vec![id(1), id(2)]);
    sim.ok(1, false, "error: database is locked");
    assert_eq!(sim.outcomes(), vec![(id(1), OkOutcome::RelayError)]);
    assert_eq!(
        sim.s.poll_timeout(),
        Some(sim.now.plus(Duration::from_secs(2)))
    );
    assert_eq!(sim.turn(), vec![], "paused");
    sim.advance(Duration::from_secs(2));
    assert_eq!(sim.turn(), vec![id(3)], "at the back: the next one first");
    sim.ok(3, false, "error: database is locked");
    assert_eq!(
        sim.s.poll_timeout(),
        Some(sim.now.plus(Duration::from_secs(4))),
        "doubled"
    );
    sim.advance(Duration::from_secs(4));
    assert_eq!(sim.turn(), vec![id(1)]);
    sim.ok(2, true, "");
    sim.ok(1, true, "");
    assert_eq!(sim.s.queue().errors_in_a_row(), 0, "a store ends the spell");
    assert_eq!(sim.s.queue().counters().rejected, 0, "never a verdict");
}

#[test]
fn an_event_failing_again_and_again_is_set_aside_and_sent_again_later() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    sim.offer(2);
    let mut aside = false;
    for round in 0..MAX_ERROR_ROUNDS {
        sim.advance(MAX_ERROR_PAUSE);
        for e in sim.turn() {
            if e == id(1) {
                sim.ok(1, false, "error: cannot store");
            } else {
                sim.frame(&ok_frame(e, true, ""));
            }
        }
        for (e, o) in sim.outcomes() {
            if o == OkOutcome::SetAside {
                assert_eq!((e, round), (id(1), MAX_ERROR_ROUNDS - 1));
                assert!(o.leaves_pipeline());
                aside = true;
            }
        }
    }
    assert!(aside);
    assert!(sim.s.is_idle(), "nothing holds the queue");
    let retry = sim.now.plus(ASIDE_RETRY);
    assert_eq!(sim.s.poll_timeout().map(|t| t <= retry), Some(true));
    sim.now = retry;
    assert_eq!(sim.turn(), vec![id(1)]);
    assert!(sim.events().contains(&ForwardEvent::Reopened(1)));
}

#[test]
fn auth_required_without_a_key_is_a_rejection() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    sim.turn();
    sim.ok(1, false, "auth-required: who are you");
    assert_eq!(
        sim.outcomes(),
        vec![(id(1), OkOutcome::Rejected(Prefix::AuthRequired))]
    );
    assert_eq!(sim.s.queue().rejected_kept(), 1);
}

#[test]
fn auth_required_requeues_pauses_writes_and_resumes_once_authenticated() {
    let mut sim = Sim::keyed(limits());
    sim.offer(1);
    sim.offer(2);
    sim.offer(3);
    assert_eq!(sim.turn(), vec![id(1), id(2)]);
    sim.ok(1, false, "auth-required: sign in");
    assert_eq!(sim.outcomes(), vec![(id(1), OkOutcome::AuthRequired)]);
    assert!(!sim.s.sends_now(sim.now));
    assert_eq!(sim.turn(), vec![], "writes wait for the challenge");
    assert!(
        sim.s.wait(sim.now, true).frames,
        "the challenge must wake us"
    );
    sim.frame(r#"["AUTH","challenge-1"]"#);
    let auth = sim.auth_frame().expect("AUTH written at once");
    let tags = auth[1]["tags"].to_string();
    assert!(tags.contains("challenge-1") && tags.contains("ws://own.example"));
    assert_eq!(sim.turn(), vec![], "writes wait for the AUTH's OK");
    let auth_id = EventId::from_hex(auth[1]["id"].as_str().unwrap()).unwrap();
    sim.frame(&ok_frame(auth_id, true, ""));
    assert!(sim.outcomes().is_empty(), "the AUTH's OK is no event's");
    assert_eq!(sim.turn(), vec![id(1)], "the refused event first");
    assert_eq!(sim.s.queue().counters().rejected, 0);
}

#[test]
fn no_challenge_in_time_makes_auth_required_a_rejection() {
    let mut sim = Sim::keyed(limits());
    sim.offer(1);
    sim.turn();
    sim.ok(1, false, "auth-required: sign in");
    assert_eq!(sim.outcomes(), vec![(id(1), OkOutcome::AuthRequired)]);
    let wait = AuthLimits::default().challenge_wait;
    assert_eq!(sim.s.poll_timeout(), Some(sim.now.plus(wait)));
    sim.advance(wait);
    assert_eq!(sim.turn(), vec![id(1)], "writes resume");
    sim.ok(1, false, "auth-required: sign in");
    assert_eq!(
        sim.outcomes(),
        vec![(id(1), OkOutcome::Rejected(Prefix::AuthRequired))]
    );
}

#[test]
fn a_refused_auth_makes_auth_required_a_rejection_on_that_connection_only() {
    let mut sim = Sim::keyed(limits());
    sim.offer(1);
    sim.turn();
    sim.frame(r#"["AUTH","c"]"#);
    let auth = sim.auth_frame().unwrap();
    let auth_id = EventId::from_hex(auth[1]["id"].as_str().unwrap()).unwrap();
    sim.frame(&ok_frame(auth_id, false, "restricted: not you"));
    sim.ok(1, false, "auth-required: sign in");
    assert_eq!(
        sim.outcomes(),
        vec![(id(1), OkOutcome::Rejected(Prefix::AuthRequired))]
    );
    // A new connection tries again.
    sim.s.on_connected(sim.now);
    sim.frame(r#"["AUTH","c2"]"#);
    assert!(sim.auth_frame().is_some());
}

#[test]
fn blocked_is_kept_and_retried_when_its_repository_changes() {
    let mut sim = Sim::new(limits());
    let coord = "30617:pk:repo";
    sim.offer_raw(1, json(1, 1621, &[["a", coord]]));
    sim.turn();
    sim.ok(1, false, "blocked: no such repository");
    assert_eq!(
        sim.outcomes(),
        vec![(id(1), OkOutcome::Rejected(Prefix::Blocked))]
    );
    assert!(sim.s.is_idle());
    assert_eq!(sim.offer(1), Offer::PreviouslyRejected, "not sent blindly");
    assert_eq!(sim.events(), vec![ForwardEvent::Settled(1)]);
    // Another repository changed: nothing.
    sim.s.handle_control(ForwardControl::RetryRejected {
        repos: vec!["30617:pk:other".into()],
        roots: vec![],
    });
    assert!(sim.events().is_empty());
    assert_eq!(sim.turn(), vec![]);
    sim.s.handle_control(ForwardControl::RetryRejected {
        repos: vec![coord.into()],
        roots: vec![],
    });
    assert_eq!(sim.events(), vec![ForwardEvent::Reopened(1)]);
    assert_eq!(sim.turn(), vec![id(1)]);
    sim.ok(1, true, "");
    assert_eq!(sim.outcomes(), vec![(id(1), OkOutcome::Stored)]);
}

#[test]
fn restricted_is_kept_and_retried_when_its_root_is_linked() {
    let mut sim = Sim::new(limits());
    let root = id(99).to_hex();
    sim.offer_raw(1, json(1, 1, &[["e", &root]]));
    sim.turn();
    sim.ok(1, false, "restricted: not related to a repository here");
    assert_eq!(
        sim.outcomes(),
        vec![(id(1), OkOutcome::Rejected(Prefix::Restricted))]
    );
    sim.s.handle_control(ForwardControl::RetryRejected {
        repos: vec![],
        roots: vec![id(99)],
    });
    assert_eq!(sim.events(), vec![ForwardEvent::Reopened(1)]);
    assert_eq!(sim.turn(), vec![id(1)]);
}

#[test]
fn purgatory_is_taken_and_never_sent_again() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    sim.turn();
    sim.ok(1, true, "purgatory: won't be served until git data arrives");
    assert_eq!(sim.outcomes(), vec![(id(1), OkOutcome::Purgatory)]);
    assert!(sim.s.queue().is_held(&id(1)));
    assert_eq!(sim.offer(1), Offer::AlreadyStored);
    // Not even when a reconciliation finds the own relay without it (decision 0101).
    assert_eq!(
        sim.s.offer(id(1), json(1, 1, &[]), true, &sim.v),
        Offer::AlreadyStored
    );
    assert_eq!(
        sim.events(),
        vec![ForwardEvent::Settled(1), ForwardEvent::Settled(1)]
    );
    assert_eq!(sim.turn(), vec![]);
    assert_eq!(sim.s.queue().counters().purgatory, 1);
}

#[test]
fn a_stored_event_the_own_relay_lacks_is_sent_again() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    sim.turn();
    sim.ok(1, true, "");
    assert_eq!(
        sim.s.offer(id(1), json(1, 1, &[]), true, &sim.v),
        Offer::Queued
    );
    assert_eq!(sim.turn(), vec![id(1)]);
}

#[test]
fn duplicate_however_answered_is_stored_and_counted_apart() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    sim.offer(2);
    sim.turn();
    sim.ok(1, false, "duplicate: have it");
    sim.ok(2, true, " Duplicate: already have it");
    assert_eq!(
        sim.outcomes(),
        vec![(id(1), OkOutcome::Duplicate), (id(2), OkOutcome::Duplicate)]
    );
    assert_eq!(sim.s.queue().counters().duplicates, 2);
    assert_eq!(sim.offer(1), Offer::AlreadyStored);
}

#[test]
fn an_unexpected_ok_notice_or_garbage_changes_nothing() {
    let mut sim = Sim::new(limits());
    sim.offer(1);
    sim.turn();
    sim.ok(7, true, "");
    assert_eq!(sim.outcomes(), vec![(id(7), OkOutcome::Unexpected)]);
    sim.frame(r#"["NOTICE","slow down"]"#);
    sim.frame("not json");
    sim.frame(r#"["EOSE","x"]"#);
    assert!(sim.events().is_empty());
    assert_eq!(sim.s.queue().in_flight(), 1);
    assert_eq!(sim.s.queue().counters(), ForwardCounters::default());
}

#[test]
fn announcements_go_first_then_state_then_root_events() {
    let mut sim = Sim::new(ForwardLimits {
        in_flight: 8,
        ..limits()
    });
    sim.offer_raw(1, json(1, 1, &[]));
    sim.offer_raw(2, json(2, 1621, &[]));
    sim.offer_raw(3, json(3, 30618, &[]));
    sim.offer_raw(4, json(4, 30617, &[]));
    assert_eq!(sim.turn(), vec![id(4), id(3), id(2), id(1)]);
}

#[test]
fn a_full_queue_takes_offers_again_once_a_quarter_of_it_is_free() {
    let mut sim = Sim::new(ForwardLimits {
        in_flight: 8,
        backlog: 8,
        ..limits()
    });
    assert!(!sim.s.intake_paused());
    for n in 0..8 {
        sim.offer(n);
    }
    assert!(sim.s.intake_paused(), "full");
    sim.turn();
    sim.ok(0, true, "");
    assert!(sim.s.intake_paused(), "one slot of the two needed");
    sim.ok(1, true, "");
    assert!(!sim.s.intake_paused(), "a quarter free");
    assert!(!sim.s.intake_paused(), "and stays open until full again");
}

#[test]
fn keepalive_pings_and_a_silent_relay_is_dead() {
    let mut sim = Sim::new(limits());
    let ping = Duration::from_secs(30);
    assert_eq!(sim.s.poll_timeout(), Some(sim.now.plus(ping)));
    sim.advance(ping);
    sim.s.handle_timeout(sim.now);
    assert_eq!(sim.s.poll_transmit(sim.now), Some(ForwardTransmit::Ping));
    // A pong proves it alive.
    sim.s.handle_frame(sim.now, Frame::Pong, &sim.v);
    sim.advance(Duration::from_secs(25));
    sim.s.handle_timeout(sim.now);
    assert!(!sim.events().contains(&ForwardEvent::Dead));
    // The next ping goes unanswered.
    sim.advance(Duration::from_secs(5));
    sim.s.handle_timeout(sim.now);
    assert_eq!(sim.s.poll_transmit(sim.now), Some(ForwardTransmit::Ping));
    sim.advance(Duration::from_secs(20));
    // The deadline passed as a turn begins: the frames that arrived meanwhile are read first.
    sim.s.handle_timeout(sim.now);
    assert!(sim.events().is_empty());
    sim.s.handle_frame(sim.now, Frame::Pong, &sim.v);
    sim.s.handle_timeout(sim.now);
    assert!(sim.events().is_empty(), "the pong was there");
    // The next ping goes unanswered too, and nothing is read between two turns.
    sim.advance(Duration::from_secs(30));
    sim.s.handle_timeout(sim.now);
    assert_eq!(sim.s.poll_transmit(sim.now), Some(ForwardTransmit::Ping));
    sim.advance(Duration::from_secs(20));
    sim.s.handle_timeout(sim.now);
    assert!(sim.events().is_empty());
    sim.s.handle_timeout(sim.now);
    assert_eq!(sim.events(), vec![ForwardEvent::Dead]);
}

#[test]
fn events_arriving_right_after_a_write_wait_for_the_batch() {
    let mut sim = Sim::new(ForwardLimits {
        in_flight: 64,
        backlog: 4096,
        ..limits()
    });
    // Nothing waits to be sent: nothing to hold.
    let just = Some(Duration::from_micros(500));
    assert_eq!(sim.s.hold_writes(just, true), None);
    for n in 0..3 {
        sim.offer(n);
    }
    // Written 0.5 ms ago: the three wait the rest of the linger, and nothing goes out.
    assert_eq!(
        sim.s.hold_writes(just, true),
        Some(Duration::from_micros(500))
    );
    assert_eq!(sim.turn(), vec![]);
    assert!(!sim.s.sends_now(sim.now));
    // After a quiet moment, never written, no more events coming: at once.
    assert_eq!(sim.s.hold_writes(Some(WRITE_LINGER), true), None);
    assert_eq!(sim.s.hold_writes(None, true), None);
    assert_eq!(sim.s.hold_writes(just, false), None);
    assert_eq!(sim.turn().len(), 3);
    assert!(sim.s.wrote());
    // A full batch goes out at once.
    for n in 3..3 + WRITE_BATCH as u32 {
        sim.offer(n);
    }
    assert_eq!(sim.s.hold_writes(just, true), None);
    // Draining: never held.
    sim.offer(100);
    sim.turn();
    sim.offer(101);
    assert!(sim.s.hold_writes(just, true).is_some());
    sim.s.handle_control(ForwardControl::Drain);
    assert_eq!(sim.s.hold_writes(just, true), None);
}

#[test]
fn the_simulated_world_never_holds_writes() {
    let mut sim = Sim::with(ForwardConfig {
        write_linger: Duration::ZERO,
        ..ForwardConfig::new(url(), limits())
    });
    sim.offer(1);
    assert_eq!(sim.s.hold_writes(Some(Duration::ZERO), true), None);
}

#[test]
fn oks_are_read_lazily_only_while_nothing_needs_them() {
    let mut sim = Sim::new(ForwardLimits {
        in_flight: 2,
        backlog: 4096,
        ..limits()
    });
    // Nothing in flight: the own relay's bytes wake the forwarder (NOTICE, AUTH, close).
    let w = sim.s.wait(sim.now, true);
    assert_eq!((w.frames, w.linger, w.offers), (true, None, true));
    // One in flight, nothing waiting, room in the window: the next event reads its OK.
    sim.offer(0);
    sim.turn();
    let w = sim.s.wait(sim.now, true);
    assert_eq!((w.frames, w.linger), (false, Some(OK_LINGER)));
    // No event can be taken, or the OK overdue: wake on the OK.
    assert!(sim.s.wait(sim.now, false).frames);
    let late = sim.now.plus(Duration::from_secs(11));
    assert!(sim.s.wait(late, true).frames);
    // The window full and events waiting: the OKs are read in batches, for a quarter of
    // the own relay's recent OK latency, and new offers wait in the channel.
    for n in 1..4 {
        sim.offer(n);
    }
    sim.turn();
    let w = sim.s.wait(sim.now, true);
    assert_eq!((w.offers, w.linger), (false, Some(WRITE_LINGER)));
    sim.advance(Duration::from_millis(20));
    sim.ok(0, true, "");
    sim.turn();
    let w = sim.s.wait(sim.now, true);
    assert_eq!(w.linger, Some(Duration::from_millis(5)));
    // Draining: every OK at once.
    sim.s.handle_control(ForwardControl::Drain);
    assert!(sim.s.is_draining());
    assert!(sim.s.wait(sim.now, true).frames);
}

#[test]
fn a_full_window_with_events_waiting_does_not_wake_on_new_events() {
    let mut sim = Sim::new(ForwardLimits {
        in_flight: 2,
        backlog: 4096,
        ..limits()
    });
    assert!(sim.s.wait(sim.now, true).offers, "empty");
    assert!(
        !sim.s.wait(sim.now, false).offers,
        "the offer channel closed"
    );
    sim.offer(0);
    sim.offer(1);
    sim.turn();
    assert!(
        sim.s.wait(sim.now, true).offers,
        "full, nothing waiting: the next event goes next"
    );
    sim.offer(2);
    assert!(
        !sim.s.wait(sim.now, true).offers,
        "full with an event waiting"
    );
    sim.ok(0, true, "");
    assert!(sim.s.wait(sim.now, true).offers, "a slot free");
}

#[test]
fn oks_are_not_left_unread_while_nip42_waits_for_a_challenge() {
    let mut sim = Sim::keyed(limits());
    sim.offer(0);
    sim.offer(1);
    sim.turn();
    sim.ok(0, false, "auth-required: sign in");
    let w = sim.s.wait(sim.now, true);
    assert!(w.frames && w.linger.is_none());
}

#[test]
fn a_full_window_waits_a_quarter_of_the_ok_latency_within_bounds() {
    // Decision 0092: a relay storing a window in 64 ms gets its freed slots filled every
    // 8 ms, not every millisecond; a fast relay every millisecond as before.
    assert_eq!(full_window_linger(None), WRITE_LINGER);
    assert_eq!(
        full_window_linger(Some(Duration::from_millis(2))),
        WRITE_LINGER
    );
    assert_eq!(
        full_window_linger(Some(Duration::from_millis(20))),
        Duration::from_millis(5)
    );
    assert_eq!(
        full_window_linger(Some(Duration::from_millis(64))),
        FULL_WINDOW_LINGER
    );
    assert_eq!(
        full_window_linger(Some(Duration::from_secs(3))),
        FULL_WINDOW_LINGER
    );
}

#[test]
fn the_deadline_is_the_earliest_of_keepalive_ok_pause_and_nip42() {
    let mut sim = Sim::keyed(ForwardLimits {
        ok_timeout: Duration::from_secs(5),
        ..limits()
    });
    sim.offer(1);
    sim.offer(2);
    sim.turn();
    assert_eq!(
        sim.s.poll_timeout(),
        Some(sim.now.plus(Duration::from_secs(5)))
    );
    sim.ok(1, false, "auth-required: sign in");
    sim.advance(Duration::from_secs(1));
    // The other event's OK (4 s left) before the challenge wait (10 s).
    assert_eq!(
        sim.s.poll_timeout(),
        Some(sim.now.plus(Duration::from_secs(4)))
    );
    sim.ok(2, true, "");
    let challenge = AuthLimits::default().challenge_wait - Duration::from_secs(1);
    assert_eq!(sim.s.poll_timeout(), Some(sim.now.plus(challenge)));
}

#[test]
fn a_turn_does_not_repeat_at_once_while_nip42_holds_writes_back() {
    // Issue 36, item 3: `more` ignored the NIP-42 write pause: with events ready the loop
    // turned again at once without sending anything, for up to 20 s.
    let mut sim = Sim::keyed(limits());
    sim.offer(1);
    sim.offer(2);
    assert!(sim.s.sends_now(sim.now));
    sim.turn();
    sim.ok(1, false, "auth-required: sign in");
    assert!(!sim.s.sends_now(sim.now), "writes held by NIP-42");
}

#[test]
fn retries_found_handled_meanwhile_are_settled() {
    let mut sim = Sim::new(ForwardLimits {
        backlog: 3,
        ..limits()
    });
    let coord = "30617:pk:r";
    let raw = json(1, 1621, &[["a", coord]]);
    sim.offer_raw(1, raw.clone());
    sim.turn();
    sim.ok(1, false, "invalid: no announcement");
    sim.outcomes();
    // A full backlog: the retry waits for room.
    for n in 2..5 {
        sim.offer(n);
    }
    sim.s.handle_control(ForwardControl::RetryRejected {
        repos: vec![coord.into()],
        roots: vec![],
    });
    assert_eq!(sim.events(), vec![ForwardEvent::Reopened(1)]);
    // A copy arrives meanwhile and is queued (an issue: ahead of the rest) and stored: the
    // retry, once it finds room, is resolved without an answer of its own.
    assert_eq!(sim.offer_raw(1, raw), Offer::Queued);
    assert_eq!(sim.turn(), vec![id(1), id(2)]);
    sim.ok(1, true, "");
    sim.ok(2, true, "");
    sim.outcomes();
    assert_eq!(sim.turn(), vec![id(3), id(4)], "the retry not sent");
    assert_eq!(sim.events(), vec![ForwardEvent::Settled(1)]);
    assert_eq!(sim.s.queue().retrying(), 0);
}

#[test]
fn the_throttle_warning_names_the_relay_the_rate_and_the_fix() {
    let since = Time::from_secs(1_000);
    let t = Throttle {
        since,
        stored: 3,
        pace: Duration::from_secs(20),
    };
    let url = RelayUrl::parse("ws://127.0.0.1:7777").unwrap();
    let w = throttle_warning(&url, &t, 120, since.plus(Duration::from_secs(180)));
    assert!(w.contains("ws://127.0.0.1:7777"), "{w}");
    assert!(w.contains("for 180 s"), "{w}");
    assert!(w.contains("stored 3 events"), "{w}");
    assert!(w.contains("(1.0 a minute)"), "{w}");
    assert!(w.contains("120 events wait, about 120 minutes"), "{w}");
    assert!(w.contains("docs/operations.md"), "{w}");
}

#[test]
fn event_frame_wraps_the_raw_json_exactly() {
    let raw = r#"{"id":"ab","content":"x"}"#;
    let frame = event_frame(raw);
    assert_eq!(frame, format!("[\"EVENT\",{raw}]"));
    assert_eq!(frame.capacity(), frame.len());
}
