//! Unit tests of [`ForwardQueue`](super::ForwardQueue).

use super::*;

fn id(b: u8) -> EventId {
    EventId::from_byte_array([b; 32])
}
fn raw(b: u8) -> Arc<str> {
    Arc::from(format!("{{\"n\":{b}}}"))
}
/// An event of `kind` by `pk` with `tags`, as JSON.
fn tagged(b: u8, kind: u16, tags: &[[&str; 2]]) -> Arc<str> {
    let tags: Vec<serde_json::Value> = tags.iter().map(|t| serde_json::json!(t)).collect();
    Arc::from(serde_json::json!({"n": b, "kind": kind, "pubkey": "pk", "tags": tags}).to_string())
}
fn everything() -> HashSet<String> {
    HashSet::from_iter(["30617:pk:r".to_string()])
}
fn limits() -> ForwardLimits {
    ForwardLimits {
        in_flight: 2,
        ok_timeout: Duration::from_secs(10),
        backlog: 3,
        remembered: 100,
        rejected_kept: 2,
        rejected_bytes: 1 << 20,
        rate_limit_pause: Duration::from_secs(2),
        max_bytes: 0,
        relay_bytes: 0,
    }
}

#[test]
fn duplicate_however_spelled() {
    // The prefix as any relay spells it: leading whitespace and case do not matter
    // (before the one parser, " duplicate:" and "Duplicate:" were rejections here).
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    for (n, m) in [" duplicate: have it", "Duplicate: have it"]
        .into_iter()
        .enumerate()
    {
        let e = id(10 + n as u8);
        q.offer(e, raw(10 + n as u8));
        assert_eq!(q.poll_send(t).unwrap().0, e);
        assert_eq!(
            q.on_ok(e, false, Prefix::of(m), t),
            OkOutcome::Duplicate,
            "{m:?}"
        );
    }
    assert_eq!(q.counters().duplicates, 2);
}

#[test]
fn dedups_and_respects_window() {
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    assert_eq!(q.offer(id(1), raw(1)), Offer::Queued);
    assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyQueued);
    q.offer(id(2), raw(2));
    q.offer(id(3), raw(3));
    assert!(q.is_full());
    assert!(q.can_send(t));
    assert_eq!(q.poll_send(t).unwrap().0, id(1));
    assert_eq!(q.poll_send(t).unwrap().0, id(2));
    assert!(!q.can_send(t));
    assert!(q.poll_send(t).is_none(), "window of 2");
    assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
    assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyStored);
    assert_eq!(
        q.on_ok(id(2), false, Prefix::of("duplicate: have it"), t),
        OkOutcome::Duplicate
    );
    assert_eq!(
        q.on_ok(id(2), true, Prefix::Other, t),
        OkOutcome::Unexpected
    );
    assert_eq!(q.poll_send(t).unwrap().0, id(3));
    let c = q.counters();
    assert_eq!((c.stored, c.duplicates, c.deduplicated), (1, 1, 2));
}

#[test]
fn an_event_the_own_relay_lacks_is_sent_again_despite_an_old_ok() {
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    q.offer(id(1), raw(1));
    let _ = q.poll_send(t);
    assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
    assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyStored);
    // A reconciliation found the own relay without it: queued and sent again.
    assert_eq!(q.offer_missing(id(1), raw(1)), Offer::Queued);
    assert_eq!(q.offer_missing(id(1), raw(1)), Offer::AlreadyQueued);
    assert_eq!(q.poll_send(t).unwrap().0, id(1));
    assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
    assert_eq!(q.counters().stored, 2);
}

#[test]
fn an_event_the_own_relay_always_fails_to_store_is_set_aside_and_tried_again_later() {
    // Issue 36, item 2: one event answered `error:` every time was re-queued for ever:
    // the queue never idle (no state save, `--once` to its deadline, every stop waits
    // out the drain) and each answer paused the whole queue.
    let mut t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    q.offer(id(1), raw(1));
    q.offer(id(2), raw(2));
    let err = Prefix::of("error: database is locked");
    let mut outcomes = Vec::new();
    for _ in 0..MAX_ERROR_ROUNDS {
        // Past any pause, as the loop's timers would.
        t = t.plus(MAX_ERROR_PAUSE).plus(Duration::from_secs(1));
        q.handle_timeout(t);
        while let Some((sent, _)) = q.poll_send(t) {
            let ok = if sent == id(1) {
                q.on_ok(sent, false, err, t)
            } else {
                q.on_ok(sent, true, Prefix::Other, t)
            };
            outcomes.push((sent, ok));
        }
    }
    assert!(outcomes.contains(&(id(2), OkOutcome::Stored)));
    assert_eq!(outcomes.last(), Some(&(id(1), OkOutcome::SetAside)));
    assert_eq!(
        outcomes.iter().filter(|o| o.0 == id(1)).count() as u32,
        MAX_ERROR_ROUNDS
    );
    assert!(q.is_idle(), "nothing left holds the queue");
    assert_eq!((q.aside(), q.counters().set_aside), (1, 1));
    // It is sent again after ASIDE_RETRY, once; stored then, it leaves the aside set.
    assert_eq!(q.poll_timeout(), Some(t.plus(ASIDE_RETRY)));
    let later = t.plus(ASIDE_RETRY);
    q.handle_timeout(later);
    assert_eq!(q.aside(), 0);
    assert_eq!(q.take_reopened(), 1, "unresolved again");
    assert_eq!(q.take_reopened(), 0);
    assert_eq!(q.poll_send(later).map(|s| s.0), Some(id(1)));
    // One more `error:`: aside again at once.
    assert_eq!(q.on_ok(id(1), false, err, later), OkOutcome::SetAside);
    let again = later.plus(ASIDE_RETRY);
    q.handle_timeout(again);
    assert_eq!(q.poll_send(again).map(|s| s.0), Some(id(1)));
    assert_eq!(
        q.on_ok(id(1), true, Prefix::Other, again),
        OkOutcome::Stored
    );
    assert!(q.is_idle());
    assert_eq!(q.aside(), 0);
}

/// Answers `error:` to `targets` until each is set aside, storing everything else;
/// returns when the last was set aside.
fn fail_until_aside(q: &mut ForwardQueue, targets: &[EventId], mut t: Time) -> Time {
    let err = Prefix::of("error: database is locked");
    let mut left = targets.len();
    loop {
        t = t.plus(MAX_ERROR_PAUSE).plus(Duration::from_secs(1));
        q.handle_timeout(t);
        while let Some((sent, _)) = q.poll_send(t) {
            let accepted = !targets.contains(&sent);
            let prefix = if accepted { Prefix::Other } else { err };
            if q.on_ok(sent, accepted, prefix, t) == OkOutcome::SetAside {
                left -= 1;
                if left == 0 {
                    return t;
                }
            }
        }
    }
}

#[test]
fn a_copy_of_an_event_set_aside_is_not_sent_twice() {
    // Review of issue 36 item 2: a copy offered while its event was aside was queued and
    // sent; when the aside timer fired the event was queued a second time beside the copy
    // in flight, the second `OK` came back `Unexpected` and the forwarder's unresolved
    // count never returned to 0 (no state save again).
    let mut q = ForwardQueue::new(limits());
    q.offer(id(1), raw(1));
    q.offer(id(2), raw(2));
    let t = fail_until_aside(&mut q, &[id(1)], Time::from_secs(0));
    assert_eq!(q.aside(), 1);
    // Copies from other relays, and a reconciliation that finds the own relay lacks it.
    assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyQueued);
    assert_eq!(q.offer_missing(id(1), raw(1)), Offer::AlreadyQueued);
    assert_eq!(
        q.poll_send(t),
        None,
        "nothing queued besides the event aside"
    );
    let later = t.plus(ASIDE_RETRY);
    q.handle_timeout(later);
    assert_eq!(q.take_reopened(), 1);
    assert_eq!(q.poll_send(later).map(|s| s.0), Some(id(1)));
    assert_eq!(q.poll_send(later), None, "sent once");
    assert_eq!(
        q.on_ok(id(1), true, Prefix::Other, later),
        OkOutcome::Stored
    );
    assert_eq!(
        q.on_ok(id(1), true, Prefix::Other, later),
        OkOutcome::Unexpected
    );
    assert!(q.is_idle());
}

#[test]
fn the_aside_set_is_bounded_like_the_rejected_store() {
    // Review of issue 36 item 2: the aside set grew without bound. It keeps what the
    // rejected store keeps (here 2 events); the oldest move to that store.
    let mut q = ForwardQueue::new(limits());
    for n in 1..=3u8 {
        q.offer(id(n), raw(n));
        q.offer(id(100 + n), raw(100 + n));
    }
    let t = fail_until_aside(&mut q, &[id(1), id(2), id(3)], Time::from_secs(0));
    assert_eq!(q.aside(), 2);
    assert_eq!(q.counters().set_aside, 3);
    assert_eq!(q.counters().aside_overflow, 1);
    assert_eq!(
        q.rejected_kept(),
        1,
        "the oldest went to the rejected store"
    );
    assert!(q.error_rounds.len() <= 2, "no count kept for it");
    // An event already aside and answered `error:` again is aside once.
    let later = t.plus(ASIDE_RETRY);
    q.handle_timeout(later);
    while let Some((sent, _)) = q.poll_send(later) {
        let err = Prefix::of("error: database is locked");
        assert_eq!(q.on_ok(sent, false, err, later), OkOutcome::SetAside);
    }
    assert_eq!(q.aside(), 2);
}

#[test]
fn a_pause_that_is_over_is_no_deadline_even_while_nothing_is_sent() {
    // Issue 36, item 3: during a NIP-42 write pause the forwarder calls no `poll_send`,
    // so a rate-limit pause that ended was never cleared and `poll_timeout` returned a
    // deadline in the past: the forwarder's wait was zero, 100 % CPU.
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    q.offer(id(1), raw(1));
    assert_eq!(q.poll_send(t).map(|s| s.0), Some(id(1)));
    let rl = "rate-limited: slow down";
    assert_eq!(
        q.on_ok(id(1), false, Prefix::of(rl), t),
        OkOutcome::RateLimited
    );
    let pause_end = q.poll_timeout().expect("a pause");
    assert!(pause_end > t);
    let later = pause_end.plus(Duration::from_secs(1));
    // Nothing is sent (writes held back); the timers are handled as the loop does.
    q.handle_timeout(later);
    assert!(
        q.poll_timeout().is_none_or(|d| d > later),
        "{:?} is past",
        q.poll_timeout()
    );
    assert!(q.can_send(later));
}

#[test]
fn the_ok_latency_is_a_moving_average_of_stored_and_duplicate_answers() {
    let t = Time::from_secs(0);
    let ms = |n: u64| t.plus(Duration::from_millis(n));
    let mut q = ForwardQueue::new(ForwardLimits {
        in_flight: 4,
        ..limits()
    });
    assert_eq!(q.recent_ok_latency(), None);
    for n in 1..=4 {
        q.offer(id(n), raw(n));
        assert_eq!(q.poll_send(t).map(|s| s.0), Some(id(n)));
    }
    assert_eq!(
        q.on_ok(id(1), true, Prefix::Other, ms(40)),
        OkOutcome::Stored
    );
    assert_eq!(q.recent_ok_latency(), Some(Duration::from_millis(40)));
    // The latest answer weighs an eighth.
    assert_eq!(
        q.on_ok(id(2), false, Prefix::Duplicate, ms(120)),
        OkOutcome::Duplicate
    );
    assert_eq!(q.recent_ok_latency(), Some(Duration::from_millis(50)));
    // A rejection or a failure says nothing about how long storing takes.
    assert!(matches!(
        q.on_ok(id(3), false, Prefix::Other, ms(900)),
        OkOutcome::Rejected(_)
    ));
    let _ = q.on_ok(id(4), false, Prefix::Error, ms(900));
    assert_eq!(q.recent_ok_latency(), Some(Duration::from_millis(50)));
}

#[test]
fn an_offer_that_queues_nothing_settles_its_claim() {
    // A copy claimed by a relay thread but answered from the queue's memory gets no `OK`:
    // its claim is settled so that a reconciliation's fetch does not take it for an
    // event still in flight (decision 0088).
    use crate::core::dedup::{EventSummary, RawDigest};
    let t = Time::from_secs(0);
    let verified = VerifiedSet::new(16);
    let summary = EventSummary {
        created_at: 1,
        kind: 1621,
        pubkey: nostr::key::Keys::generate().public_key(),
        tags: Default::default(),
    };
    let sig = nostr::event::Signature::from_byte_array([1; 64]);
    let claimed = |n: u8| {
        verified.insert(id(n), sig, RawDigest::of("{}"), summary);
        assert!(verified.claim_forward(&id(n), 0));
        assert!(verified.in_flight_copy(&id(n), 0).is_some());
    };
    let mut q = ForwardQueue::new(limits());
    // Stored earlier (and forgotten by the set since): marked stored, not in flight.
    q.offer(id(1), raw(1));
    let _ = q.poll_send(t);
    assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
    claimed(1);
    let offer = q.offer(id(1), raw(1));
    assert_eq!(offer, Offer::AlreadyStored);
    offer.settle_claim(&id(1), &verified);
    assert!(verified.in_flight_copy(&id(1), 0).is_none());
    assert!(verified.forwarded_copy(&id(1), 0).is_some(), "still a copy");
    // Rejected before: released, so the next copy is handed over and decided again.
    q.offer(id(2), raw(2));
    let _ = q.poll_send(t);
    let _ = q.on_ok(id(2), false, Prefix::of("blocked: no"), t);
    claimed(2);
    let offer = q.offer(id(2), raw(2));
    assert_eq!(offer, Offer::PreviouslyRejected);
    offer.settle_claim(&id(2), &verified);
    assert!(verified.forwarded_copy(&id(2), 0).is_none());
    assert!(verified.claim_forward(&id(2), 0));
    // Queued, or a copy of one queued: in flight until its `OK`.
    claimed(3);
    for expected in [Offer::Queued, Offer::AlreadyQueued] {
        let offer = q.offer(id(3), raw(3));
        assert_eq!(offer, expected);
        offer.settle_claim(&id(3), &verified);
        assert!(verified.in_flight_copy(&id(3), 0).is_some());
    }
}

#[test]
fn rejected_is_kept_and_retried_only_on_request() {
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    q.offer(id(1), tagged(1, 1621, &[["a", "30617:pk:r"]]));
    let _ = q.poll_send(t);
    assert_eq!(
        q.on_ok(id(1), false, Prefix::of("blocked: unknown repo"), t),
        OkOutcome::Rejected(Prefix::Blocked)
    );
    assert_eq!(q.offer(id(1), raw(1)), Offer::PreviouslyRejected);
    assert!(q.poll_send(t).is_none());
    let other = HashSet::from_iter(["30617:pk:other".to_string()]);
    assert_eq!(q.retry_rejected(&other), 0, "another repository changed");
    assert_eq!(q.retry_rejected(&everything()), 1);
    assert_eq!(q.poll_send(t).unwrap().0, id(1));
    assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
    assert_eq!(q.counters().rejected, 1);
}

#[test]
fn retry_chooses_only_affected_events_and_refills_within_the_backlog() {
    let t = Time::from_secs(0);
    let root = "ab".repeat(32);
    let events = [
        tagged(1, 1621, &[["a", "30617:pk:x"]]),
        tagged(2, 1617, &[["a", "30617:pk:x"]]),
        tagged(3, 1111, &[["A", "30617:pk:x"]]),
        tagged(4, 30618, &[["d", "x"]]),
        tagged(5, 1621, &[["a", "30617:pk:y"]]),
        tagged(6, 1111, &[["E", &root.to_uppercase()]]),
    ];
    let mut q = ForwardQueue::new(ForwardLimits {
        rejected_kept: 100,
        ..limits()
    });
    for (i, raw) in events.iter().enumerate() {
        let b = i as u8 + 1;
        q.offer(id(b), raw.clone());
        let _ = q.poll_send(t);
        q.on_ok(id(b), false, Prefix::of("blocked: unknown repository"), t);
    }
    assert_eq!(q.rejected_kept(), 6);
    // Repository x was announced: its three events and its state event, not y's.
    let changed = HashSet::from_iter(["30617:pk:x".to_string()]);
    assert_eq!(q.retry_rejected(&changed), 4);
    assert_eq!(q.rejected_kept(), 2);
    // Only as many as the backlog (3) holds are queued; the fourth waits for room.
    assert_eq!((q.backlog(), q.retrying()), (3, 1));
    assert!(!q.is_idle());
    let (first, _) = q.poll_send(t).unwrap();
    q.on_ok(first, true, Prefix::Other, t);
    let _ = q.poll_send(t);
    assert_eq!(q.retrying(), 0, "refilled as room freed up");
    // A root event linked: the reply to it (upper-case E, any hex case).
    assert_eq!(q.retry_rejected(&HashSet::from_iter([root])), 1);
}

#[test]
fn rejected_store_is_bounded() {
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    for b in 1..=3 {
        q.offer(id(b), raw(b));
        let _ = q.poll_send(t);
        q.on_ok(id(b), false, Prefix::of("blocked:"), t);
    }
    assert_eq!(q.rejected_kept(), 2);
    // The byte bound holds too.
    let mut small = ForwardQueue::new(ForwardLimits {
        rejected_bytes: 20,
        ..limits()
    });
    for b in 1..=3 {
        small.offer(id(b), raw(b));
        let _ = small.poll_send(t);
        small.on_ok(id(b), false, Prefix::of("blocked:"), t);
    }
    assert_eq!(small.rejected_kept(), 2, "each raw is 8 bytes");
    let mut tagged_small = ForwardQueue::new(ForwardLimits {
        rejected_bytes: 2 * tagged(1, 1621, &[["a", "30617:pk:r"]]).len() + 1,
        ..limits()
    });
    for b in 1..=3 {
        tagged_small.offer(id(b), tagged(b, 1621, &[["a", "30617:pk:r"]]));
        let _ = tagged_small.poll_send(t);
        tagged_small.on_ok(id(b), false, Prefix::of("blocked:"), t);
    }
    assert_eq!(tagged_small.retry_rejected(&everything()), 2);
}

#[test]
fn timeout_disconnect_and_rate_limit_resend() {
    let t = Time::from_secs(100);
    let mut q = ForwardQueue::new(limits());
    q.offer(id(1), raw(1));
    q.offer(id(2), raw(2));
    let _ = q.poll_send(t);
    let _ = q.poll_send(t);
    assert_eq!(q.poll_timeout(), Some(t.plus(Duration::from_secs(10))));
    q.handle_timeout(t.plus(Duration::from_secs(10)));
    assert_eq!(q.backlog(), 2);
    let t2 = t.plus(Duration::from_secs(11));
    assert!(q.poll_send(t2).is_some());
    q.on_disconnect();
    assert_eq!(q.counters().resent, 3);
    let (first, _) = q.poll_send(t2).unwrap();
    assert_eq!(
        q.on_ok(first, false, Prefix::of("rate-limited: slow down"), t2),
        OkOutcome::RateLimited
    );
    assert!(q.poll_send(t2).is_none(), "paused");
    assert!(q.poll_send(t2.plus(Duration::from_secs(2))).is_some());
}

#[test]
fn auth_required_requeues_at_the_front() {
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    q.offer(id(1), raw(1));
    q.offer(id(2), raw(2));
    assert_eq!(q.poll_send(t).unwrap().0, id(1));
    assert_eq!(q.requeue_auth_required(id(1)), OkOutcome::AuthRequired);
    assert_eq!(q.requeue_auth_required(id(1)), OkOutcome::Unexpected);
    assert_eq!(q.backlog(), 2);
    assert_eq!(q.counters().resent, 1);
    assert_eq!(q.counters().rejected, 0);
    assert_eq!(q.poll_send(t).unwrap().0, id(1), "sent first again");
    assert_eq!(q.on_ok(id(1), true, Prefix::Other, t), OkOutcome::Stored);
    // Without authentication under way the caller uses on_ok: a rejection.
    let _ = q.poll_send(t);
    assert_eq!(
        q.on_ok(id(2), false, Prefix::of("auth-required: who are you"), t),
        OkOutcome::Rejected(Prefix::AuthRequired)
    );
}

#[test]
fn relay_error_is_never_a_verdict_however_long_it_lasts() {
    // An own relay answering `error:` for ten minutes (a locked database): the event is
    // sent again after growing pauses, never rejected, and stored once the relay recovers.
    let mut t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    q.offer(id(1), raw(1));
    let mut pauses = Vec::new();
    let mut last_sent = t;
    while t.since(Time::from_secs(0)) < Duration::from_secs(600) {
        match q.poll_send(t) {
            Some((sent, _)) => {
                pauses.push(t.since(last_sent));
                last_sent = t;
                assert_eq!(
                    q.on_ok(sent, false, Prefix::of("error: database is locked"), t),
                    OkOutcome::RelayError
                );
            }
            None => t = t.plus(Duration::from_secs(1)),
        }
    }
    assert_eq!(q.counters().rejected, 0);
    assert_eq!(q.rejected_kept(), 0);
    assert_eq!(q.backlog(), 1, "still queued");
    assert!(q.counters().relay_errors >= 10, "{pauses:?}");
    // The pauses grow (2, 4, 8, … s) up to MAX_ERROR_PAUSE.
    assert_eq!(pauses[1], Duration::from_secs(2));
    assert_eq!(pauses[2], Duration::from_secs(4));
    assert_eq!(*pauses.iter().max().unwrap(), MAX_ERROR_PAUSE);
    // A copy from another relay meanwhile is not lost: the queued one carries it.
    assert_eq!(q.offer(id(1), raw(1)), Offer::AlreadyQueued);
    assert_eq!(q.offer_missing(id(1), raw(1)), Offer::AlreadyQueued);
    // The relay recovers: stored, and the next error pauses only briefly again.
    t = t.plus(MAX_ERROR_PAUSE);
    let (sent, _) = q.poll_send(t).unwrap();
    assert_eq!(q.on_ok(sent, true, Prefix::Other, t), OkOutcome::Stored);
    assert_eq!(q.errors_in_a_row(), 0);
    q.offer(id(2), raw(2));
    let (sent, _) = q.poll_send(t).unwrap();
    q.on_ok(sent, false, Prefix::of("error: try again"), t);
    assert!(q.poll_send(t.plus(Duration::from_secs(1))).is_none());
    assert!(q.poll_send(t.plus(Duration::from_secs(2))).is_some());
}

#[test]
fn a_retry_dropped_because_its_event_was_queued_or_stored_meanwhile_is_settled() {
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    let refs = |n: u8| {
        let repo = format!("30617:{}:r", "ab".repeat(32));
        let raw: Arc<str> = format!(
            r#"{{"id":"{}","kind":1621,"tags":[["a","{repo}"]],"n":{n}}}"#,
            id(n).to_hex()
        )
        .into();
        (repo, raw)
    };
    let (repo, raw1) = refs(1);
    let (_, raw2) = refs(2);
    for (n, raw) in [(1, raw1.clone()), (2, raw2.clone())] {
        q.offer(id(n), raw);
        let (sent, _) = q.poll_send(t).unwrap();
        q.on_ok(sent, false, Prefix::of("blocked: not related"), t);
    }
    assert_eq!(q.rejected_kept(), 2);
    // Fill the backlog so the retries wait in `retrying`.
    for n in 10..10 + limits().backlog as u8 {
        q.offer(id(n), raw(n));
    }
    let changed = [repo].into_iter().collect();
    assert_eq!(q.retry_rejected(&changed), 2);
    assert_eq!(q.retrying(), 2);
    assert_eq!(q.take_settled(), 0);
    // The backlog drains: the retries enter the queue as it has room.
    while let Some((sent, _)) = q.poll_send(t) {
        q.on_ok(sent, true, Prefix::Other, t);
    }
    assert_eq!(q.retrying(), 0);
    // The retries entered the queue (they were not stored yet) and were sent above.
    assert_eq!(q.take_settled(), 0);
    // Now the same again, but copies of both arrive (a NIP-77 fetch) while the retries
    // wait for room: the copies are queued, and the retries find them queued.
    for (n, raw) in [(3u8, refs(3).1), (4, refs(4).1)] {
        q.offer(id(n), raw);
        let (sent, _) = q.poll_send(t).unwrap();
        q.on_ok(sent, false, Prefix::of("blocked: not related"), t);
    }
    for n in 10..10 + limits().backlog as u8 {
        q.offer(id(n + 100), raw(n + 100));
    }
    assert_eq!(q.retry_rejected(&[refs(3).0].into_iter().collect()), 2);
    q.offer_missing(id(3), refs(3).1);
    q.offer_missing(id(4), refs(4).1);
    while let Some((sent, _)) = q.poll_send(t) {
        q.on_ok(sent, true, Prefix::Other, t);
    }
    assert_eq!(
        q.take_settled(),
        2,
        "both retries found their events handled"
    );
    assert_eq!(q.take_settled(), 0);
}

#[test]
fn the_kind_is_read_from_the_key_not_from_strings_or_tag_values() {
    assert_eq!(json_kind(r#"{"id":"x","kind":1621,"tags":[]}"#), Some(1621));
    assert_eq!(json_kind(r#"{"kind" : 30617}"#), Some(30617));
    // Inside the content the quotes are escaped; a tag value is followed by `,` or `]`.
    assert_eq!(
        json_kind(r#"{"content":"say \"kind\":1","tags":[["t","kind"],["kind","x"]],"kind":1111}"#),
        Some(1111)
    );
    // A content ending in a backslash closes its string before the key.
    assert_eq!(json_kind(r#"{"content":"a\\","kind":7}"#), Some(7));
    assert_eq!(json_kind(r#"{"kind":"x"}"#), None);
    assert_eq!(json_kind("garbage"), None);
    assert_eq!(send_class(r#"{"kind":30617}"#), 0);
    assert_eq!(send_class(r#"{"kind":30618}"#), 1);
    assert_eq!(send_class(r#"{"kind":1618}"#), 2);
    assert_eq!(send_class(r#"{"kind":1619}"#), 3);
}

#[test]
fn announcements_go_first_then_root_events_then_the_rest() {
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(ForwardLimits {
        backlog: 100,
        in_flight: 100,
        ..limits()
    });
    let ev = |n: u8, kind: u16| -> Arc<str> { format!(r#"{{"n":{n},"kind":{kind}}}"#).into() };
    q.offer(id(1), ev(1, 1111));
    q.offer(id(2), ev(2, 1621));
    q.offer(id(6), ev(6, 30618));
    q.offer(id(3), ev(3, 30617));
    q.offer(id(4), ev(4, 1111));
    q.offer(id(5), ev(5, 1617));
    let order: Vec<EventId> = std::iter::from_fn(|| q.poll_send(t).map(|(i, _)| i)).collect();
    // A state event after the announcements: ngit-grasp refuses one whose repository it
    // has no announcement of (`invalid: no announcement exists for this repository`).
    assert_eq!(order, [3, 6, 2, 5, 1, 4].map(id));
}

#[test]
fn a_relay_answering_duplicate_to_stored_writes_ends_the_pace() {
    // ngit-grasp answers every stored write `OK true "duplicate: event stored"`. The pace
    // shrank only on stored answers, so after one `rate-limited:` spell it only grew
    // (4.4 s per event measured against ngit-grasp).
    let mut t = Time::from_secs(0);
    let mut q = ForwardQueue::new(ForwardLimits {
        backlog: 1000,
        in_flight: 64,
        ..limits()
    });
    for n in 0..250u8 {
        q.offer(id(n), raw(n));
    }
    let (first, _) = q.poll_send(t).unwrap();
    q.on_ok(first, false, Prefix::of("rate-limited: slow down"), t);
    assert!(q.throttle().is_some());
    let dup = Prefix::of("duplicate: event stored");
    while q.throttle().is_some() && t.since(Time::from_secs(0)) < Duration::from_secs(600) {
        match q.poll_send(t) {
            Some((i, _)) => assert_eq!(q.on_ok(i, true, dup, t), OkOutcome::Duplicate),
            None => t = t.plus(Duration::from_millis(100)),
        }
    }
    assert!(q.throttle().is_none(), "still paced after {t:?}");
    assert!(t.since(Time::from_secs(0)) < Duration::from_secs(120));
}

#[test]
fn a_throttling_own_relay_sets_the_pace_and_a_fast_one_ends_it() {
    // An own relay that stores one event per 10 s and answers the rest `rate-limited:`.
    let mut t = Time::from_secs(0);
    let mut q = ForwardQueue::new(ForwardLimits {
        backlog: 1000,
        in_flight: 64,
        ..limits()
    });
    for n in 0..200u8 {
        q.offer(id(n), raw(n));
    }
    let mut next_ok = t;
    let mut sent = 0u64;
    while t.since(Time::from_secs(0)) < Duration::from_secs(1800) {
        while let Some((i, _)) = q.poll_send(t) {
            sent += 1;
            if t >= next_ok {
                next_ok = t.plus(Duration::from_secs(10));
                assert_eq!(q.on_ok(i, true, Prefix::Other, t), OkOutcome::Stored);
            } else {
                q.on_ok(i, false, Prefix::of("rate-limited: slow down"), t);
            }
        }
        t = t.plus(Duration::from_millis(100));
    }
    let stored = q.counters().stored;
    // About one every 10 s for the half hour, nothing lost or rejected...
    assert!((150..=181).contains(&stored), "{stored} stored");
    assert_eq!(q.counters().rejected, 0);
    assert_eq!(q.backlog() as u64 + stored, 200);
    // ...without hammering: a few sends per stored event, not one per 100 ms tick.
    assert!(sent < 4 * stored, "{sent} sends for {stored} stored");
    let throttle = q.throttle().expect("throttled");
    assert_eq!(throttle.since, Time::from_secs(0));
    let rate = throttle.per_minute(t);
    assert!((5.0..=6.1).contains(&rate), "{rate} a minute");
    // The relay recovers: answers are fast, the pace shrinks and ends within minutes (after
    // FAST_RUN events stored in a row at the fastest pace).
    let more = |n: u16| {
        let mut b = [0xee; 32];
        b[..2].copy_from_slice(&n.to_be_bytes());
        EventId::from_byte_array(b)
    };
    for n in 0..2 * FAST_RUN as u16 {
        q.offer(more(n), raw(0));
    }
    let recovered_at = t;
    while q.throttle().is_some() && t.since(recovered_at) < Duration::from_secs(3600) {
        match q.poll_send(t) {
            Some((i, _)) => {
                q.on_ok(i, true, Prefix::Other, t);
            }
            None => t = t.plus(Duration::from_millis(100)),
        }
    }
    let took = t.since(recovered_at);
    assert!(
        took < Duration::from_secs(120),
        "{took:?} to end the pacing"
    );
    assert!(
        q.throttle().is_none(),
        "pacing ends once the relay takes what we send"
    );
    for n in 200..250u8 {
        q.offer(id(n), raw(n));
    }
    t = t.plus(Duration::from_secs(1));
    let waiting = q.backlog() as u64;
    let before = q.counters().stored;
    while let Some((i, _)) = q.poll_send(t) {
        q.on_ok(i, true, Prefix::Other, t);
    }
    assert_eq!(
        q.counters().stored - before,
        waiting,
        "unpaced again: all at once"
    );
}

/// Issue 19's figure: 2,000 events into an own relay that accepts 120 a minute (a token
/// bucket of 15 at once, then two a second, as ngit-relay's limiter with another rate).
/// The pace settles near the relay's rate: the sync takes little more than the 16.7
/// minutes the relay needs, with few refused sends.
#[test]
fn two_thousand_events_into_an_own_relay_taking_120_a_minute() {
    let mut q = ForwardQueue::new(ForwardLimits {
        backlog: 4096,
        ..ForwardLimits::default()
    });
    let id = |n: u16| {
        EventId::from_byte_array({
            let mut b = [0u8; 32];
            b[..2].copy_from_slice(&n.to_be_bytes());
            b
        })
    };
    for n in 0..2000u16 {
        q.offer(id(n), Arc::from(format!("{{\"n\":{n}}}")));
    }
    let start = Time::from_secs(0);
    let mut t = start;
    let (mut tokens, mut last) = (15.0f64, t);
    let mut sends = 0u64;
    while q.counters().stored < 2000 {
        while let Some((i, _)) = q.poll_send(t) {
            sends += 1;
            tokens = (tokens + t.since(last).as_secs_f64() * 2.0).min(15.0);
            last = t;
            if tokens >= 1.0 {
                tokens -= 1.0;
                q.on_ok(i, true, Prefix::Other, t);
            } else {
                q.on_ok(i, false, Prefix::of("rate-limited: slow down"), t);
            }
        }
        t = t.plus(Duration::from_millis(50));
        assert!(t.since(start) < Duration::from_secs(3600), "an hour");
    }
    let took = t.since(start);
    let minutes = took.as_secs_f64() / 60.0;
    eprintln!("2,000 events at 120 a minute: {minutes:.1} min, {sends} sends");
    assert!(minutes < 2000.0 / 120.0 * 1.2, "{minutes:.1} min");
    // 2,860 sends before the pace kept a floor.
    assert!(sends < 2000 * 6 / 5, "{sends} sends");
    assert_eq!(q.counters().rejected, 0);
}

/// ngit-grasp's answer to a new repository announcement (GRASP-01 purgatory).
const PURGATORY: &str = "purgatory: won't be served until git data arrives";
/// ngit-grasp's answer to an event about a repository it does not serve (yet).
const RESTRICTED: &str =
    "restricted: Event event must reference an accepted repository or accepted event";

#[test]
fn a_purgatory_answer_is_taken_counted_and_never_sent_again() {
    // Issue 34: ngit-grasp holds a new announcement unserved until its git data arrives
    // (and drops it after 30 minutes if none does). Every reconciliation finds the own
    // relay without it and offers it as missing: it must not be written again (each
    // write would keep an empty repository in purgatory another 30 minutes, for ever).
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(limits());
    let ann = tagged(1, 30617, &[["d", "r"]]);
    q.offer(id(1), ann.clone());
    assert_eq!(q.poll_send(t).unwrap().0, id(1));
    assert_eq!(
        q.on_ok(id(1), true, Prefix::of(PURGATORY), t),
        OkOutcome::Purgatory
    );
    let c = q.counters();
    assert_eq!((c.purgatory, c.stored, c.rejected), (1, 0, 0));
    assert!(q.is_held(&id(1)));
    assert!(q.is_idle(), "resolved: nothing waits for it");
    // A copy from another relay, and the same event fetched as missing by a
    // reconciliation, a day later and again: never queued.
    for _ in 0..3 {
        assert_eq!(q.offer(id(1), ann.clone()), Offer::AlreadyStored);
        assert_eq!(q.offer_missing(id(1), ann.clone()), Offer::AlreadyStored);
        assert!(q.poll_send(t.plus(Duration::from_secs(86_400))).is_none());
    }
    assert_eq!(q.counters().resent, 0);
    // An event the own relay stored (not held) is still sent again when it went missing.
    q.offer(id(2), raw(2));
    let _ = q.poll_send(t);
    q.on_ok(id(2), true, Prefix::of("duplicate: event stored"), t);
    assert!(!q.is_held(&id(2)));
    assert_eq!(q.offer_missing(id(2), raw(2)), Offer::Queued);
    // `OK false` with the word is no acceptance: an ordinary rejection, kept.
    q.offer(id(3), raw(3));
    let _ = q.poll_send(t);
    let _ = q.poll_send(t);
    assert_eq!(
        q.on_ok(id(3), false, Prefix::of(PURGATORY), t),
        OkOutcome::Rejected(Prefix::Purgatory)
    );
    assert!(!q.is_held(&id(3)));
}

#[test]
fn events_refused_while_their_repository_is_in_purgatory_go_again_once_it_is_served() {
    // The announcement goes into purgatory; the issue about it and a reply to the issue
    // are refused `restricted:`. Once the own relay serves the repository (its git data
    // arrived: the self-subscription applies the announcement), the index change re-offers
    // the issue (it names the repository) and, once the issue is linked, the reply.
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(ForwardLimits {
        backlog: 10,
        in_flight: 10,
        ..limits()
    });
    let repo = "30617:pk:r";
    let issue_hex = "ab".repeat(32);
    q.offer(id(1), tagged(1, 30617, &[["d", "r"]]));
    q.offer(id(2), tagged(2, 1621, &[["a", repo]]));
    q.offer(id(3), tagged(3, 1111, &[["E", &issue_hex]]));
    let mut sent = Vec::new();
    while let Some((i, _)) = q.poll_send(t) {
        sent.push(i);
    }
    assert_eq!(sent, vec![id(1), id(2), id(3)], "announcement first");
    assert_eq!(
        q.on_ok(id(1), true, Prefix::of(PURGATORY), t),
        OkOutcome::Purgatory
    );
    for i in [id(2), id(3)] {
        assert_eq!(
            q.on_ok(i, false, Prefix::of(RESTRICTED), t),
            OkOutcome::Rejected(Prefix::Restricted)
        );
    }
    assert_eq!(q.rejected_kept(), 2);
    // Still in purgatory: nothing changes, nothing is sent.
    assert_eq!(q.offer(id(2), raw(2)), Offer::PreviouslyRejected);
    assert!(q.poll_send(t).is_none());
    // Served: the repository's announcement is applied.
    assert_eq!(q.retry_rejected(&HashSet::from_iter([repo.to_string()])), 1);
    assert_eq!(q.poll_send(t).unwrap().0, id(2));
    assert_eq!(
        q.on_ok(id(2), true, Prefix::of("duplicate: event stored"), t),
        OkOutcome::Duplicate
    );
    // The issue is linked to the repository: the reply goes too.
    assert_eq!(q.retry_rejected(&HashSet::from_iter([issue_hex])), 1);
    assert_eq!(q.poll_send(t).unwrap().0, id(3));
    q.on_ok(id(3), true, Prefix::of("duplicate: event stored"), t);
    assert_eq!(q.rejected_kept(), 0);
    // The announcement itself was never written again.
    assert_eq!(q.counters().resent, 0);
}

#[test]
fn a_maintainers_announcement_and_state_go_again_once_a_repository_of_their_d_is_served() {
    // ngit-grasp takes a maintainer's announcement that does not list it only once a
    // served announcement of the same `d` lists its author, and a state event only once an
    // announcement of its `d` authorizes it. Refused while the owner's announcement was in
    // purgatory, they named nothing a retry looked for (the announcement no tag at all, the
    // state its author's own coordinate): kept for ever, their copies held back.
    let t = Time::from_secs(0);
    let mut q = ForwardQueue::new(ForwardLimits {
        backlog: 10,
        in_flight: 10,
        rejected_kept: 10,
        ..limits()
    });
    let ann = Arc::<str>::from(
        serde_json::json!({"kind": 30617, "pubkey": "maint", "tags": [["d", "r"]]}).to_string(),
    );
    let state = Arc::<str>::from(
        serde_json::json!({"kind": 30618, "pubkey": "maint", "tags": [["d", "r"]]}).to_string(),
    );
    let other = Arc::<str>::from(
        serde_json::json!({"kind": 30617, "pubkey": "x", "tags": [["d", "rr"]]}).to_string(),
    );
    for (n, raw) in [(1, &ann), (2, &state), (3, &other)] {
        q.offer(id(n), raw.clone());
    }
    while let Some((i, _)) = q.poll_send(t) {
        q.on_ok(i, false, Prefix::of("invalid: no"), t);
    }
    assert_eq!(q.rejected_kept(), 3);
    // Another identifier changes nothing.
    assert_eq!(
        q.retry_rejected(&HashSet::from_iter(["30617:owner:r2".to_string()])),
        0
    );
    // The owner's repository `r` is served: both of the maintainer's go again.
    assert_eq!(
        q.retry_rejected(&HashSet::from_iter(["30617:owner:r".to_string()])),
        2
    );
    let mut sent: Vec<EventId> = std::iter::from_fn(|| q.poll_send(t).map(|s| s.0)).collect();
    sent.sort();
    assert_eq!(sent, vec![id(1), id(2)]);
    assert_eq!(q.rejected_kept(), 1);
}

/// ngit-grasp's write budget (rust-nostr's relay builder, `notes_per_minute: 60`): 60
/// tokens per connection; each EVENT adds the whole seconds since the connection's
/// previous EVENT (refused ones included, at most 60), then takes one or is answered
/// `rate-limited: slow down`. A refusal sent less than a second after the previous EVENT
/// earns nothing and starts the second again. 600 events, every accepted one answered
/// `duplicate: event stored` (announcements `purgatory:`): all taken, on one connection,
/// paced, without a write per 100 ms for the 9 minutes the relay needs.
#[test]
fn ngit_grasps_write_budget_paces_one_connection_and_loses_nothing() {
    let mut q = ForwardQueue::new(ForwardLimits {
        backlog: 4096,
        ..ForwardLimits::default()
    });
    let id = |n: u16| {
        EventId::from_byte_array({
            let mut b = [0u8; 32];
            b[..2].copy_from_slice(&n.to_be_bytes());
            b
        })
    };
    let events = 600u16;
    for n in 0..events {
        let kind = if n % 10 == 0 { 30617 } else { 1621 };
        q.offer(id(n), Arc::from(format!("{{\"kind\":{kind},\"n\":{n}}}")));
    }
    let start = Time::from_secs(0);
    let mut t = start;
    let (mut tokens, mut last): (u64, Option<Time>) = (60, None);
    let mut sends = 0u64;
    while !q.is_idle() {
        while let Some((i, raw)) = q.poll_send(t) {
            sends += 1;
            if let Some(l) = last {
                tokens = (tokens + t.since(l).as_secs().min(60)).min(60);
            }
            last = Some(t);
            if tokens == 0 {
                q.on_ok(i, false, Prefix::of("rate-limited: slow down"), t);
                continue;
            }
            tokens -= 1;
            let answer = if raw.contains("30617") {
                PURGATORY
            } else {
                "duplicate: event stored"
            };
            q.on_ok(i, true, Prefix::of(answer), t);
        }
        t = t.plus(Duration::from_millis(10));
        assert!(t.since(start) < Duration::from_secs(3600), "an hour");
    }
    let c = q.counters();
    assert_eq!(c.purgatory + c.duplicates, u64::from(events), "{c:?}");
    assert_eq!((c.purgatory, c.rejected), (60, 0));
    let took = t.since(start).as_secs_f64();
    let ideal = f64::from(events - 60);
    eprintln!("{events} events into ngit-grasp's budget: {took:.0} s (the relay's floor {ideal:.0} s), {sends} writes");
    // Before the pace kept a floor (the last refused pace, for a minute) and waited a whole
    // interval after a second refusal in a row, it took 813 s and 1,043 writes.
    assert!(took < ideal * 1.25, "{took:.0} s");
    assert!(sends < u64::from(events) * 6 / 5, "{sends} writes");
}

#[test]
fn byte_admission_bounds_the_total_and_each_relay_share() {
    let l = ForwardLimits {
        max_bytes: 10,
        relay_bytes: 4,
        ..ForwardLimits::default()
    };
    assert!(
        admits(&l, 0, 0, 100),
        "an empty pipeline takes any one event"
    );
    assert!(
        admits(&l, 5, 0, 4),
        "a relay with nothing held gets in within the total"
    );
    assert!(admits(&l, 5, 3, 1));
    assert!(!admits(&l, 5, 3, 2), "over the relay's share");
    assert!(!admits(&l, 8, 0, 3), "over the total");
    assert!(admits(&l, 6, 0, 4));
    let unbounded = ForwardLimits {
        max_bytes: 0,
        relay_bytes: 0,
        ..ForwardLimits::default()
    };
    assert!(admits(&unbounded, u64::MAX - 1, u64::MAX - 1, 5));
    let d = ForwardLimits::default();
    assert_eq!((d.max_bytes, d.relay_bytes), (64 << 20, 16 << 20));
}
