//! Scenario 5 per relay: each relay's daily full resync has its own time, drawn between
//! `daily_min` and `daily_max` after that relay's own last full sync (issue 11), so the
//! resyncs of many relays spread over the window instead of all firing at once.
//!
//! [`DailyTimers`] keeps the times in a map plus a min-heap with lazy deletion: the next due
//! time is a peek, and a timer that fires costs O(log n); no tick scans every relay.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::*;

/// Per-relay daily resync times.
#[derive(Debug, Default)]
pub(crate) struct DailyTimers {
    /// The current time of each relay (the source of truth).
    due: HashMap<RelayUrl, Time>,
    /// Every time scheduled, earliest first; entries that no longer match `due` are skipped
    /// when they reach the top.
    heap: BinaryHeap<Reverse<(Time, RelayUrl)>>,
}

impl DailyTimers {
    /// Sets (or moves) the resync time of `relay`.
    pub(crate) fn set(&mut self, relay: &RelayUrl, at: Time) {
        self.due.insert(relay.clone(), at);
        self.heap.push(Reverse((at, relay.clone())));
        // Stale entries pile up when relays are rescheduled often: rebuild from the map.
        if self.heap.len() > 2 * self.due.len() + 64 {
            self.heap = self
                .due
                .iter()
                .map(|(u, t)| Reverse((*t, u.clone())))
                .collect();
        }
    }

    /// Forgets the timer of `relay` (its heap entry is skipped later).
    pub(crate) fn remove(&mut self, relay: &RelayUrl) {
        self.due.remove(relay);
    }

    /// The resync time of `relay`.
    pub(crate) fn get(&self, relay: &RelayUrl) -> Option<Time> {
        self.due.get(relay).copied()
    }

    /// The earliest time in the heap (possibly of a stale entry: waking for it only pops it).
    pub(crate) fn next(&self) -> Option<Time> {
        self.heap.peek().map(|Reverse((t, _))| *t)
    }

    /// Removes and returns the relays whose resync is due at `now`, earliest first.
    pub(crate) fn pop_due(&mut self, now: Time) -> Vec<RelayUrl> {
        let mut out = Vec::new();
        while let Some(Reverse((t, _))) = self.heap.peek() {
            if *t > now {
                break;
            }
            let Some(Reverse((t, url))) = self.heap.pop() else {
                break;
            };
            if self.due.get(&url) == Some(&t) {
                self.due.remove(&url);
                out.push(url);
            }
        }
        out
    }

    /// Timers held (for tests of the bound).
    #[cfg(test)]
    pub(crate) fn heap_len(&self) -> usize {
        self.heap.len()
    }
}

impl SyncMachine {
    /// Draws the next daily resync of `relay`: between `daily_min` and `daily_max` from now
    /// (its full sync starts now).
    pub(super) fn schedule_daily(&mut self, relay: &RelayUrl, now: Time) {
        let (lo, hi) = (
            self.config.daily_min,
            self.config.daily_max.max(self.config.daily_min),
        );
        let delay = lo + (hi - lo).mul_f64(self.jitter.unit());
        self.daily.set(relay, now.plus(delay));
        debug!(
            "{relay}: next daily resync in {:.2} h",
            delay.as_secs_f64() / 3600.0
        );
    }

    /// Runs the daily resyncs that are due.
    pub(super) fn run_daily(&mut self, now: Time) {
        for url in self.daily.pop_due(now) {
            self.daily_resync(&url, now);
        }
    }

    /// Scenario 5 for one relay: close all, clear pending and confirmed, Layer 1 without
    /// `since`, compute_actions; then its next resync is drawn. A relay that is not
    /// connected only forgets its confirmed state, so that its next connect is a fresh sync
    /// (which draws its next resync).
    pub(super) fn daily_resync(&mut self, url: &RelayUrl, now: Time) {
        self.restored_forget(url);
        let Some(state) = self.relays.get_mut(url) else {
            return;
        };
        self.counters.daily_resyncs += 1;
        state.clear_sync_state();
        let generation = state.generation;
        let connected = state.connection_status == ConnectionStatus::Connected;
        if let Some(batches) = self.pending.remove(url) {
            self.counters.batches_failed += batches.len() as u64;
        }
        if !connected {
            info!("{url}: daily resync: not connected; the next connect is a fresh sync");
            state.last_connected = None;
            state.disconnected_at = None;
            return;
        }
        info!("{url}: daily resync (full history again)");
        let link = self.links.entry(url.clone()).or_default();
        let mut old: Vec<SubscriptionId> = link.subs.keys().cloned().collect();
        link.forget_subscriptions();
        link.resume.clear();
        link.resume_overflow = false;
        old.sort();
        for sub_id in old {
            self.commands.push_back(Command::Unsubscribe {
                relay: url.clone(),
                generation,
                sub_id,
            });
        }
        self.drop_jobs_of(url, false);
        self.open_announcements(url, generation);
        self.recompute_actions_for_relay(url, now);
        self.schedule_daily(url, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(s: &str) -> RelayUrl {
        RelayUrl::parse(s).unwrap()
    }

    #[test]
    fn timers_fire_in_order_and_a_moved_or_removed_timer_does_not_fire() {
        let mut d = DailyTimers::default();
        let (a, b, c) = (
            u("wss://a.example"),
            u("wss://b.example"),
            u("wss://c.example"),
        );
        d.set(&a, Time::from_secs(30));
        d.set(&b, Time::from_secs(10));
        d.set(&c, Time::from_secs(20));
        d.set(&a, Time::from_secs(50)); // moved: the entry at 30 is stale
        d.remove(&c);
        assert_eq!(d.next(), Some(Time::from_secs(10)));
        assert_eq!(d.pop_due(Time::from_secs(40)), vec![b.clone()]);
        assert_eq!(d.get(&a), Some(Time::from_secs(50)));
        assert_eq!(d.pop_due(Time::from_secs(50)), vec![a]);
        assert_eq!(d.pop_due(Time::from_secs(1_000)), Vec::<RelayUrl>::new());
        assert_eq!(d.next(), None);
    }

    #[test]
    fn rescheduling_often_keeps_the_heap_bounded() {
        let mut d = DailyTimers::default();
        let a = u("wss://a.example");
        for i in 0..10_000 {
            d.set(&a, Time::from_secs(i));
        }
        assert!(d.heap_len() <= 2 + 64 + 1, "{}", d.heap_len());
        assert_eq!(d.pop_due(Time::from_secs(20_000)), vec![a]);
    }
}
