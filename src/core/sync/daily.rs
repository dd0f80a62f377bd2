//! Scenario 5 per relay: each relay's daily full resync has its own time, drawn between
//! `daily_min` and `daily_max` after that relay's own last full sync (issue 11), so the
//! resyncs of many relays spread over the window instead of all firing at once.
//!
//! Each relay's time is its [`Timer::Daily`] entry in the machine's timer table: the next
//! due time is a peek, and a timer that fires costs O(log n); no tick scans every relay.

use log::{debug, info};
use nostr::message::SubscriptionId;

use super::timers::Timer;
use super::{Command, ConnectionStatus, RelayUrl, SyncMachine, Time};

impl SyncMachine {
    /// Draws the next daily resync of `relay`: between `daily_min` and `daily_max` from now
    /// (its full sync starts now).
    pub(super) fn schedule_daily(&mut self, relay: &RelayUrl, now: Time) {
        let (lo, hi) = (
            self.config.daily_min,
            self.config.daily_max.max(self.config.daily_min),
        );
        let delay = lo + (hi - lo).mul_f64(self.jitter.unit());
        self.timers
            .set(Timer::Daily(relay.clone()), now.plus(delay));
        debug!(
            "{relay}: next daily resync in {:.2} h",
            delay.as_secs_f64() / 3600.0
        );
    }

    /// Scenario 5 for one relay: close all, clear pending and confirmed, Layer 1 without
    /// `since`, compute_actions; then its next resync is drawn. A relay that is not
    /// connected only forgets its confirmed state, so that its next connect is a fresh sync
    /// (which draws its next resync).
    /// [`super::Report::ForwarderLost`]: every relay reads its whole history again (a
    /// daily resync of each, now), so what the lost forwarder held is fetched again and
    /// nothing stays confirmed without its events.
    pub(super) fn handle_forwarder_lost(&mut self, now: Time) {
        let relays: Vec<RelayUrl> = self.remotes.keys().cloned().collect();
        log::warn!(
            "the forwarder was lost with what it held; reading the history of {} relays again",
            relays.len()
        );
        self.counters.forwarder_losses += 1;
        for url in relays {
            self.daily_resync(&url, now);
        }
    }

    pub(super) fn daily_resync(&mut self, url: &RelayUrl, now: Time) {
        self.restored_forget(url);
        let Some(state) = self.remotes.get_mut(url).map(|r| &mut r.state) else {
            return;
        };
        self.counters.daily_resyncs += 1;
        state.clear_sync_state();
        let generation = state.generation;
        let connected = state.connection_status == ConnectionStatus::Connected;
        if !connected {
            state.last_connected = None;
            state.disconnected_at = None;
        }
        self.counters.batches_failed += self.take_pending(url).len() as u64;
        if !connected {
            info!("{url}: daily resync: not connected; the next connect is a fresh sync");
            return;
        }
        info!("{url}: daily resync (full history again)");
        let link = self.link(url);
        let mut old: Vec<SubscriptionId> = link.subs.keys().cloned().collect();
        link.resume.clear();
        link.resume_overflow = false;
        self.forget_subscriptions(url);
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
