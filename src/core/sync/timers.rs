//! The machine's timers as data (issue 18), in the style of quinn-proto's
//! `connection/timer.rs`: every deadline is one entry of a [`TimerTable`] keyed by a
//! [`Timer`], so [`super::SyncMachine::poll_timeout`] is a lookup of the earliest entry and
//! [`super::SyncMachine::handle_timeout`] pops the due entries in deadline order and
//! dispatches each with one `match`.
//!
//! The machine has many remote relays, so most timers carry the relay they belong to; a
//! relay that is forgotten takes all of them with it ([`TimerTable::cancel_relay`]).

use crate::core::hash::{HashMap, HashSet};
use std::collections::BTreeSet;

use crate::core::time::Time;
use crate::shared::RelayUrl;

/// Something the machine does at a deadline.
///
/// The variants are declared in the order in which the machine ran its timers before they
/// were data, so timers due at the same moment still run in that order (the derived `Ord`
/// breaks ties between equal deadlines).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Timer {
    /// A query of the relay, or a batch, waited [`super::SyncConfig::eose_timeout`] for its
    /// EOSE (the earliest such deadline of the relay; derived from its loading queries and
    /// pending batches, absent while the forward queue is full).
    EoseDeadline(RelayUrl),
    /// A query on the own relay (not part of a batch) waited too long for its EOSE.
    OwnEoseDeadline,
    /// A NIP-77 reconciliation (by job id) got no answer in time.
    JobDeadline(u64),
    /// The self-subscription's batch window closed.
    SelfBatch,
    /// Connect the own relay again after its backoff.
    OwnReconnect,
    /// Open again pages of the self-subscription that the own relay closed.
    OwnReopen,
    /// Connect the relay again after its backoff.
    Reconnect(RelayUrl),
    /// Failed batches (or a rate limit) held back new batches of the relay until now.
    RetryBatches(RelayUrl),
    /// Open again subscriptions that the relay closed (the earliest of them).
    Reopen(RelayUrl),
    /// The relay's rate-limit cool-down ended: queued queries may be sent.
    Cooldown(RelayUrl),
    /// The relay's next poll round of queries that do not fit its subscription budget.
    Poll(RelayUrl),
    /// Consolidate (or rebuild the live set of) the relay at the latest now.
    Consolidate(RelayUrl),
    /// The relay's daily full resync (issue 11: per relay, spread over 23–25 h).
    Daily(RelayUrl),
    /// The periodic check for relays no repository needs any more.
    DisconnectCheck,
    /// Run the selection again after refusals or failing connects (issue 20).
    Reselect,
    /// The relay's NIP-77 detection got no answer in time (issue 21).
    Nip77Detection(RelayUrl),
    /// A finished reconciliation's fetch has waited [`super::reconcile::DELIVERY_WAIT`] for
    /// other relays' history REQs of the same values (decision 0121).
    DeliveryWait,
}

impl Timer {
    /// Every timer that can carry `relay`.
    pub(crate) fn of_relay(relay: &RelayUrl) -> [Timer; 9] {
        [
            Timer::EoseDeadline(relay.clone()),
            Timer::Reconnect(relay.clone()),
            Timer::RetryBatches(relay.clone()),
            Timer::Reopen(relay.clone()),
            Timer::Cooldown(relay.clone()),
            Timer::Poll(relay.clone()),
            Timer::Consolidate(relay.clone()),
            Timer::Daily(relay.clone()),
            Timer::Nip77Detection(relay.clone()),
        ]
    }

    /// The remote relay the timer belongs to, if any.
    #[cfg(any(test, debug_assertions))]
    pub(crate) fn relay(&self) -> Option<&RelayUrl> {
        match self {
            Timer::EoseDeadline(r)
            | Timer::Reconnect(r)
            | Timer::RetryBatches(r)
            | Timer::Reopen(r)
            | Timer::Cooldown(r)
            | Timer::Poll(r)
            | Timer::Consolidate(r)
            | Timer::Daily(r)
            | Timer::Nip77Detection(r) => Some(r),
            Timer::OwnEoseDeadline
            | Timer::JobDeadline(_)
            | Timer::SelfBatch
            | Timer::OwnReconnect
            | Timer::OwnReopen
            | Timer::DisconnectCheck
            | Timer::Reselect
            | Timer::DeliveryWait => None,
        }
    }
}

/// At most one deadline per [`Timer`], ordered by deadline.
///
/// `deadlines` is the source of truth (set, cancel, look up in O(1) expected); `by_deadline`
/// holds exactly the same entries ordered by `(deadline, timer)`, so the earliest is a peek
/// and a due entry is popped in O(log n). No entry is ever stale: moving a timer removes its
/// old position.
#[derive(Debug, Default)]
pub(crate) struct TimerTable {
    by_deadline: BTreeSet<(Time, Timer)>,
    deadlines: HashMap<Timer, Time>,
}

impl TimerTable {
    /// Sets (or moves) `timer` to `at`.
    pub(crate) fn set(&mut self, timer: Timer, at: Time) {
        if let Some(old) = self.deadlines.insert(timer.clone(), at) {
            self.by_deadline.remove(&(old, timer.clone()));
        }
        self.by_deadline.insert((at, timer));
    }

    /// Sets `timer` to `at` when it is not set or set later (the earlier one wins).
    pub(crate) fn set_earliest(&mut self, timer: Timer, at: Time) {
        match self.deadlines.get(&timer) {
            Some(old) if *old <= at => {}
            _ => self.set(timer, at),
        }
    }

    /// Sets `timer` to `at` when it is not set or set earlier (the later one wins).
    pub(crate) fn set_latest(&mut self, timer: Timer, at: Time) {
        match self.deadlines.get(&timer) {
            Some(old) if *old >= at => {}
            _ => self.set(timer, at),
        }
    }

    /// Sets `timer` to `at`, or cancels it when `at` is `None`.
    pub(crate) fn set_or_cancel(&mut self, timer: Timer, at: Option<Time>) {
        match at {
            Some(at) => self.set(timer, at),
            None => {
                self.cancel(&timer);
            }
        }
    }

    /// Cancels `timer`; returns its deadline if it was set.
    pub(crate) fn cancel(&mut self, timer: &Timer) -> Option<Time> {
        let at = self.deadlines.remove(timer)?;
        self.by_deadline.remove(&(at, timer.clone()));
        Some(at)
    }

    /// Cancels every timer of `relay`.
    pub(crate) fn cancel_relay(&mut self, relay: &RelayUrl) {
        for t in Timer::of_relay(relay) {
            self.cancel(&t);
        }
    }

    /// The deadline of `timer`, if set.
    pub(crate) fn get(&self, timer: &Timer) -> Option<Time> {
        self.deadlines.get(timer).copied()
    }

    /// True when `timer` is set.
    pub(crate) fn is_set(&self, timer: &Timer) -> bool {
        self.deadlines.contains_key(timer)
    }

    /// The earliest deadline.
    pub(crate) fn next_timeout(&self) -> Option<Time> {
        self.by_deadline.first().map(|(t, _)| *t)
    }

    /// Removes and returns the earliest timer due at `now` that is not in `skip` (timers
    /// already run in this round: one set again to a due deadline waits for the next round).
    pub(crate) fn pop_due(&mut self, now: Time, skip: &HashSet<Timer>) -> Option<Timer> {
        let (at, timer) = self
            .by_deadline
            .iter()
            .take_while(|(at, _)| *at <= now)
            .find(|(_, t)| !skip.contains(t))?
            .clone();
        self.by_deadline.remove(&(at, timer.clone()));
        self.deadlines.remove(&timer);
        Some(timer)
    }

    /// The remote relays named by timers (once per timer).
    #[cfg(debug_assertions)]
    pub(crate) fn relays(&self) -> impl Iterator<Item = &RelayUrl> + '_ {
        self.deadlines.keys().filter_map(Timer::relay)
    }

    /// Timers set.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        debug_assert_eq!(self.deadlines.len(), self.by_deadline.len());
        self.deadlines.len()
    }

    /// Timers set that carry `relay` (a scan; for tests).
    #[cfg(test)]
    pub(crate) fn count_relay(&self, relay: &RelayUrl) -> usize {
        self.deadlines
            .keys()
            .filter(|t| t.relay() == Some(relay))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(s: &str) -> RelayUrl {
        RelayUrl::parse(s).unwrap()
    }

    fn t(s: u64) -> Time {
        Time::from_secs(s)
    }

    fn drain(table: &mut TimerTable, now: Time) -> Vec<Timer> {
        let none = HashSet::default();
        std::iter::from_fn(|| table.pop_due(now, &none)).collect()
    }

    #[test]
    fn timers_pop_in_deadline_order_and_a_moved_or_cancelled_timer_does_not_fire() {
        let mut table = TimerTable::default();
        let (a, b, c) = (
            u("wss://a.example"),
            u("wss://b.example"),
            u("wss://c.example"),
        );
        table.set(Timer::Daily(a.clone()), t(30));
        table.set(Timer::Daily(b.clone()), t(10));
        table.set(Timer::Daily(c.clone()), t(20));
        table.set(Timer::Daily(a.clone()), t(50)); // moved: 30 is gone
        assert_eq!(table.cancel(&Timer::Daily(c.clone())), Some(t(20)));
        assert_eq!(table.next_timeout(), Some(t(10)));
        assert_eq!(drain(&mut table, t(40)), vec![Timer::Daily(b)]);
        assert_eq!(table.get(&Timer::Daily(a.clone())), Some(t(50)));
        assert_eq!(drain(&mut table, t(50)), vec![Timer::Daily(a)]);
        assert_eq!(drain(&mut table, t(1_000)), Vec::<Timer>::new());
        assert_eq!(table.next_timeout(), None);
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn equal_deadlines_run_in_declaration_order() {
        let mut table = TimerTable::default();
        let a = u("wss://a.example");
        table.set(Timer::DisconnectCheck, t(5));
        table.set(Timer::Consolidate(a.clone()), t(5));
        table.set(Timer::EoseDeadline(a.clone()), t(5));
        table.set(Timer::SelfBatch, t(5));
        table.set(Timer::Reconnect(a.clone()), t(4));
        assert_eq!(
            drain(&mut table, t(5)),
            vec![
                Timer::Reconnect(a.clone()),
                Timer::EoseDeadline(a.clone()),
                Timer::SelfBatch,
                Timer::Consolidate(a),
                Timer::DisconnectCheck,
            ]
        );
    }

    #[test]
    fn earliest_and_latest_keep_the_winner() {
        let mut table = TimerTable::default();
        let a = u("wss://a.example");
        let retry = Timer::RetryBatches(a.clone());
        table.set_latest(retry.clone(), t(10));
        table.set_latest(retry.clone(), t(5));
        assert_eq!(table.get(&retry), Some(t(10)));
        table.set_latest(retry.clone(), t(20));
        assert_eq!(table.get(&retry), Some(t(20)));
        let by = Timer::Consolidate(a);
        table.set_earliest(by.clone(), t(10));
        table.set_earliest(by.clone(), t(15));
        assert_eq!(table.get(&by), Some(t(10)));
        table.set_earliest(by.clone(), t(3));
        assert_eq!(table.get(&by), Some(t(3)));
        table.set_or_cancel(by.clone(), None);
        assert!(!table.is_set(&by));
        assert_eq!(table.len(), 1);
    }

    #[test]
    fn skipped_timers_stay_for_the_next_round() {
        let mut table = TimerTable::default();
        table.set(Timer::SelfBatch, t(1));
        table.set(Timer::OwnReopen, t(2));
        let skip: HashSet<Timer> = [Timer::SelfBatch].into_iter().collect();
        assert_eq!(table.pop_due(t(3), &skip), Some(Timer::OwnReopen));
        assert_eq!(table.pop_due(t(3), &skip), None);
        assert_eq!(table.next_timeout(), Some(t(1)));
    }

    #[test]
    fn cancelling_a_relay_removes_every_timer_it_carries_and_nothing_else() {
        let mut table = TimerTable::default();
        let (a, b) = (u("wss://a.example"), u("wss://b.example"));
        for (i, timer) in Timer::of_relay(&a).into_iter().enumerate() {
            table.set(timer, t(i as u64));
        }
        table.set(Timer::Poll(b.clone()), t(3));
        table.set(Timer::JobDeadline(7), t(3));
        assert_eq!(table.count_relay(&a), 9);
        table.cancel_relay(&a);
        assert_eq!(table.count_relay(&a), 0);
        assert_eq!(table.count_relay(&b), 1);
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn rescheduling_often_keeps_one_entry_per_timer() {
        let mut table = TimerTable::default();
        let a = u("wss://a.example");
        for i in 0..10_000 {
            table.set(Timer::Daily(a.clone()), t(i));
        }
        assert_eq!(table.len(), 1);
        assert_eq!(drain(&mut table, t(20_000)), vec![Timer::Daily(a)]);
    }
}
