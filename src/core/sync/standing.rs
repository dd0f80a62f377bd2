//! Fair shares (issue 20): what the machine knows about relays and pubkeys beyond the
//! repository index, and how it feeds the selection.
//!
//! * A relay whose connect failed is *failing* until it connects (or [`FAILING_TTL`]
//!   passes): while the global cap binds it gets only the slots that relays not failing
//!   leave free, so relays that never complete a connect cannot hold every slot.
//! * A relay refused by the address policy is excluded; after [`MAX_REFUSALS_PER_HOST`]
//!   refused URLs of one host and port every URL of it is; a pubkey whose repositories named
//!   [`MAX_REFUSALS_PER_PUBKEY`] refused relays is blocked (none of its repositories is
//!   synced).
//! * These changes run the selection again at most once per [`RESELECT_DELAY`]
//!   ([`Timer::Reselect`]), never once per refusal or failure, and only when they can change
//!   it (a failing relay matters only while a cap binds).

use crate::core::hash::{HashMap, HashSet};
use std::time::Duration;

use log::{debug, info, warn};

use crate::core::state::ConnectionStatus;
use crate::core::targets::{
    host_port, repo_pubkey, TargetPolicy, MAX_REFUSALS_PER_HOST, MAX_REFUSALS_PER_PUBKEY,
};
use crate::core::time::Time;
use crate::shared::RelayUrl;

use super::timers::Timer;
use super::{machine_policy, SyncMachine};

/// How long a relay whose connect failed stays behind the others (unless it connects): then
/// it takes its turn again, so every relay is tried once in a while.
pub const FAILING_TTL: Duration = Duration::from_secs(15 * 60);

/// Changes of standing (refusals, failing relays) within this long share one selection.
pub const RESELECT_DELAY: Duration = Duration::from_secs(1);

/// The most pubkeys and hosts whose refusals are counted; beyond it new ones are not
/// counted (their relays are still excluded one by one).
const MAX_REFUSAL_COUNTERS: usize = 100_000;

/// What the machine knows about relays and pubkeys that the selection uses.
#[derive(Debug, Default)]
pub(super) struct Standing {
    /// Relays whose last connect failed, with when it first failed.
    pub(super) failing: HashMap<RelayUrl, Time>,
    /// Refused URLs per `host:port`.
    pub(super) refusals_by_host: HashMap<String, u32>,
    /// Refused relays per announcing pubkey.
    pub(super) refusals_by_key: HashMap<String, u32>,
    /// Pubkeys at [`MAX_REFUSALS_PER_PUBKEY`].
    pub(super) blocked_keys: HashSet<String>,
}

impl SyncMachine {
    /// The selection's policy: the configuration's, with the relays failing their connects
    /// and the blocked pubkeys.
    pub(super) fn policy(&self) -> TargetPolicy {
        let mut policy = machine_policy(&self.excluded, &self.config);
        policy.failing = self.standing.failing.keys().cloned().collect();
        policy.blocked_pubkeys = self.standing.blocked_keys.clone();
        policy
    }

    /// True when the last selection left a relay out for the global cap or a host cap:
    /// then the order of the round-robins (failing relays, tiers) decides who gets a slot.
    pub(super) fn selection_bound(&self) -> bool {
        self.plan.is_bound()
    }

    /// Runs the selection again within [`RESELECT_DELAY`] (once for every change until
    /// then).
    pub(super) fn schedule_reselect(&mut self, now: Time) {
        if !self.timers.is_set(&Timer::Reselect) {
            self.timers.set(Timer::Reselect, now.plus(RESELECT_DELAY));
        }
    }

    /// [`Timer::Reselect`]: the selection with the current standing, then planning.
    pub(super) fn deferred_reselect(&mut self, now: Time) {
        let mut replan = super::batches::Replan::default();
        self.reselect(&mut replan);
        self.check_plan();
        // A relay that lost its slot while not connected (failing) goes now, so the relay
        // that took the slot can connect (connected ones wait for the idle check).
        let targets = self.plan.targets();
        let gone: Vec<RelayUrl> = self
            .remotes
            .iter()
            .filter(|(url, r)| {
                !r.state.is_bootstrap
                    && r.state.connection_status != ConnectionStatus::Connected
                    && !targets.contains_key(*url)
            })
            .map(|(url, _)| url.clone())
            .collect();
        for url in gone {
            debug!("{url}: lost its slot to a relay not failing its connects");
            self.forget_relay(&url);
        }
        self.run_compute_actions(replan, now);
    }

    /// The address policy refused `relay`: it is excluded for good, its host after
    /// [`MAX_REFUSALS_PER_HOST`] refused URLs, the pubkeys naming it count a refusal each
    /// (blocked at [`MAX_REFUSALS_PER_PUBKEY`]). The selection runs again later.
    pub(super) fn on_refused(&mut self, relay: &RelayUrl, reason: &str, now: Time) {
        if !self.excluded.insert(relay.clone()) {
            return;
        }
        self.counters.relays_excluded += 1;
        if self.counters.relays_excluded == 1 {
            info!("{relay}: refused ({reason}); never a sync target again (further refusals at debug level, counted in relays_excluded)");
        } else {
            debug!("{relay}: refused ({reason}); never a sync target again");
        }
        let host = host_port(relay);
        let counters = &mut self.standing;
        if counters.refusals_by_host.len() < MAX_REFUSAL_COUNTERS
            || counters.refusals_by_host.contains_key(&host)
        {
            let n = counters.refusals_by_host.entry(host.clone()).or_default();
            *n += 1;
            if *n == MAX_REFUSALS_PER_HOST && self.excluded.insert_host(host.clone()) {
                self.counters.hosts_excluded += 1;
                info!(
                    "{host}: {MAX_REFUSALS_PER_HOST} of its URLs refused; every URL of it is excluded"
                );
            }
        }
        // The pubkeys whose repositories had it as a target.
        let keys: HashSet<&str> = self
            .plan
            .targets()
            .get(relay)
            .map(|t| t.repos.iter().map(|r| repo_pubkey(r)).collect())
            .unwrap_or_default();
        for key in keys {
            let counters = &mut self.standing;
            if counters.refusals_by_key.len() >= MAX_REFUSAL_COUNTERS
                && !counters.refusals_by_key.contains_key(key)
            {
                continue;
            }
            let n = counters.refusals_by_key.entry(key.to_string()).or_default();
            *n += 1;
            if *n == MAX_REFUSALS_PER_PUBKEY && counters.blocked_keys.insert(key.to_string()) {
                self.counters.pubkeys_blocked += 1;
                warn!(
                    "pubkey {key}: its repositories named {MAX_REFUSALS_PER_PUBKEY} relays the address policy refused; none of its repositories is synced (counted in pubkeys_blocked; list it with --prefer-pubkey and allow its relays to sync it anyway)"
                );
            }
        }
        self.standing.failing.remove(relay);
        self.plan.drop_relay(relay);
        self.unknown.no_slot.remove(relay);
        self.schedule_reselect(now);
    }

    /// A connect of `relay` failed: it is failing from now (if it was not already); while
    /// a cap binds that can move its slot to another relay.
    pub(super) fn on_connect_failed(&mut self, relay: &RelayUrl, now: Time) {
        if self.standing.failing.contains_key(relay) {
            return;
        }
        self.standing.failing.insert(relay.clone(), now);
        if self.selection_bound() {
            self.schedule_reselect(now);
        }
    }

    /// `relay` connected: it is not failing any more.
    pub(super) fn on_connected(&mut self, relay: &RelayUrl, now: Time) {
        if self.standing.failing.remove(relay).is_some() && self.selection_bound() {
            self.schedule_reselect(now);
        }
    }

    /// Relays failing for [`FAILING_TTL`] take their turn again. A failing relay that lost
    /// its slot stays recorded until then (forgetting it sooner would give it its slot back
    /// at once, to fail again): the map holds at most the relays tried within the TTL.
    pub(super) fn expire_failing(&mut self, now: Time) {
        let before = self.standing.failing.len();
        self.standing
            .failing
            .retain(|_, since| now.since(*since) < FAILING_TTL);
        if self.standing.failing.len() != before && self.selection_bound() {
            self.schedule_reselect(now);
        }
    }

    /// True while a change of standing waits for its selection ([`Timer::Reselect`]): the
    /// plan may differ from a fresh derivation until then.
    #[cfg(debug_assertions)]
    pub(super) fn reselect_due(&self) -> bool {
        self.timers.is_set(&Timer::Reselect)
    }
}
