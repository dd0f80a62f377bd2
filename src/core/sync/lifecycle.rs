//! Connection lifecycle of remote relays: connect (fresh, quick, stale), disconnect, idle check.

use log::{debug, info, warn};

use crate::core::state::ConnectionStatus;
use crate::core::time::Time;
use crate::core::wire::Disconnect;
use crate::shared::RelayUrl;

use super::timers::Timer;
use super::{Command, LinkError, SubPurpose, SyncMachine};

impl SyncMachine {
    pub(super) fn connect_remote(&mut self, relay: &RelayUrl, _now: Time) {
        let Some(state) = self.remotes.get_mut(relay).map(|r| &mut r.state) else {
            return;
        };
        self.next_generation += 1;
        state.generation = self.next_generation;
        state.connection_status = ConnectionStatus::Connecting;
        self.counters.connect_attempts += 1;
        self.commands.push_back(Command::Connect {
            relay: relay.clone(),
            generation: state.generation,
        });
    }

    /// The design's `handle_connect_or_reconnect`: fresh, quick or stale.
    pub(super) fn handle_connect_or_reconnect(&mut self, relay: &RelayUrl, now: Time) {
        let window = self.config.quick_reconnect_window;
        // The first connect of a relay restored from a snapshot (issue 11) may be a quick
        // reconnect across the restart.
        let restored = self.take_restored(relay, now);
        if !self.remotes.contains_key(relay) {
            return;
        }
        self.on_connected(relay, now);
        let link = self.link(relay);
        let overflow = std::mem::take(&mut link.resume_overflow);
        let resume = std::mem::take(&mut link.resume);
        let Some(state) = self.remotes.get_mut(relay).map(|r| &mut r.state) else {
            return;
        };
        let stale = restored.is_none()
            && state.last_connected.is_some()
            && (overflow || state.should_clear_state(now, window));
        let fresh = restored.is_none() && (state.last_connected.is_none() || stale);
        let since = if let Some(since) = restored {
            Some(since)
        } else if fresh {
            None
        } else {
            state
                .last_connected
                .map(|t| t.rebased(now).minus(window).timestamp())
        };
        if stale {
            if overflow {
                info!("{relay}: reconnected; too many interrupted queries to continue: fresh sync");
            } else {
                info!("{relay}: reconnected after more than {window:?}; fresh sync");
            }
            state.clear_sync_state();
        }
        state.connection_status = ConnectionStatus::Connected;
        state.last_connected = Some(now);
        state.disconnected_at = None;
        let generation = state.generation;
        let failures = self.link(relay).health.failures();
        self.link(relay).health.record_success(now);
        if failures > 1 {
            info!("{relay}: connected again after {failures} failed attempts");
        }
        info!(
            "{relay}: connected ({})",
            match since {
                None => "fresh sync".to_string(),
                Some(s) => format!(
                    "quick reconnect, catch-up since {}, {} interrupted queries continued",
                    s.as_secs(),
                    resume.len()
                ),
            }
        );
        match since {
            Some(since) => {
                // History that was still paging when the connection dropped continues from
                // the page it had reached (its filter carries that page's `until`).
                self.counters.queries_resumed += resume.len() as u64;
                // As pages (not catch-ups): a rebuild never merges them away.
                for f in resume {
                    self.open_sub(relay, generation, SubPurpose::Page { batch: None }, f);
                }
                self.open_live_set(relay, since, true, now);
            }
            None => {
                self.open_announcements(relay, generation);
                // A full sync starts now: the relay's daily resync is due 23–25 h later.
                self.schedule_daily(relay, now);
            }
        }
        self.recompute_actions_for_relay(relay, now);
    }

    /// The design's `handle_disconnect`, plus the reconnect schedule.
    pub(super) fn handle_disconnect(&mut self, relay: &RelayUrl, cause: &Disconnect, now: Time) {
        let Some(state) = self.remotes.get_mut(relay).map(|r| &mut r.state) else {
            return;
        };
        let was_connected = state.connection_status == ConnectionStatus::Connected;
        if was_connected {
            state.disconnected_at = Some(now);
        }
        state.connection_status = ConnectionStatus::Disconnected;
        if let Some(r) = self.remotes.get_mut(relay) {
            // Its deadlines go with its subscriptions; a new connection starts unstalled.
            r.stalled_since = None;
        }
        self.counters.batches_failed += self.take_pending(relay).len() as u64;
        let policy = self.config.backoff;
        let unit = self.jitter.unit();
        if was_connected {
            self.link(relay).keep_unfinished_history();
        } else {
            self.on_connect_failed(relay, now);
        }
        self.drop_jobs_of(relay, was_connected);
        self.drop_detection(relay);
        self.forget_subscriptions(relay);
        let link = self.link(relay);
        link.health.record_failure(now, &policy);
        let at = link.health.next_attempt(now, &policy, unit);
        self.timers.set(Timer::Reconnect(relay.clone()), at);
        let link = self.link(relay);
        let error = LinkError::of(cause, was_connected);
        let line = format!(
            "{relay}: {error}; retry in {:.1}s (failures: {})",
            at.since(now).as_secs_f64(),
            link.health.failures()
        );
        // The same failure again is counted (failures) and logged at debug level only.
        if link.last_error.as_ref() == Some(&error) {
            debug!("{line}");
        } else {
            warn!("{line}");
        }
        link.last_error = Some(error);
    }

    /// The design's `check_disconnects`, corrected: a relay is dropped only when it has no
    /// target items, no pending batch and is not bootstrap. A relay still in its first sync
    /// has targets, so it is never dropped.
    pub(super) fn check_disconnects(&mut self, _now: Time) {
        let targets = self.plan.targets();
        let idle: Vec<RelayUrl> = self
            .remotes
            .iter()
            .filter(|(url, r)| {
                !r.state.is_bootstrap && !targets.contains_key(*url) && r.pending.is_empty()
            })
            .map(|(u, _)| u.clone())
            .collect();
        for url in idle {
            info!("{url}: no repository needs this relay any more; disconnecting");
            self.forget_relay(&url);
        }
    }
}
