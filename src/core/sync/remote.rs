//! One remote relay's state in one place (issue 18): [`RemoteRelay`], the accessors that
//! keep its derived timers current, and [`SyncMachine::forget_relay`], the one way a relay
//! is forgotten.
//!
//! Per remote relay the machine keeps exactly: its [`RemoteRelay`] in `remotes`, its
//! [`RelayState`] in the design's `relays` index and its batches in the `pending` index
//! (both public read API, [`SyncMachine::relay_index`] and
//! [`SyncMachine::pending_index`], and the input of `compute_actions`), its timers
//! ([`super::timers::Timer::of_relay`]) and its reconciliation jobs. A relay is in `remotes` exactly when it
//! is in `relays`. Relays not known yet may also be named by the planning (`replan`,
//! `replan_roots`) and by a restored snapshot (`persist`).

use log::{debug, info};

use crate::core::paging::{CapWatch, PageLimits};
use crate::core::state::{PendingBatch, PendingItems, RelayState};
use crate::shared::RelayLimits;
use crate::shared::RelayUrl;

use super::persist::Late;
use super::{Link, Nip77Support, SyncMachine};

/// Everything the machine keeps about one remote relay besides the design's indexes.
#[derive(Debug, Default)]
pub(super) struct RemoteRelay {
    /// Subscriptions, queues, health and counters of its connection.
    pub(super) link: Link,
    /// What its NIP-11 publishes about its limits.
    pub(super) nip11: Nip11,
    /// What is known about its NIP-77 support.
    pub(super) nip77: Nip77Support,
    /// When it was last found not to speak NIP-77 (or restored so): the verdict is tried
    /// again at the first fresh sync `daily_min` (about a day) later (issue 36).
    pub(super) unsupported_at: Option<crate::core::time::Time>,
    /// The NIP-77 detection on the wire, if any (issue 21).
    pub(super) detection: Option<super::detect::Detection>,
    /// Restored confirmations not in its targets at its first connect (issue 11).
    pub(super) late: Option<Late>,
    /// Items it confirmed with an incomplete batch: confirmed in memory, never saved.
    pub(super) incomplete: PendingItems,
    /// Since when its thread waits for the forward pipeline's byte bound
    /// ([`super::Report::RelayStalled`]); its EOSE deadlines are suspended meanwhile.
    pub(super) stalled_since: Option<crate::core::time::Time>,
    /// Its largest page and a cap learnt from it (decision 0103); kept across reconnects.
    pub(super) caps: CapWatch,
}

/// What a relay's NIP-11 publishes, as the machine uses it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Nip11 {
    /// Page size and `max_limit` (`None`: assumed).
    pub(super) page_limits: Option<PageLimits>,
    /// `max_subscriptions` (at least 2).
    pub(super) budget: Option<usize>,
    /// `max_message_length`.
    pub(super) max_message: Option<usize>,
    /// `supported_nips` lists NIP-77.
    pub(super) nip77: bool,
}

impl Nip11 {
    /// Takes a newer report: the page limits always, the other values when it has them.
    fn update(&mut self, new: Nip11) {
        self.page_limits = new.page_limits.or(self.page_limits);
        self.budget = new.budget.or(self.budget);
        self.max_message = new.max_message.or(self.max_message);
        self.nip77 |= new.nip77;
    }
}

impl RemoteRelay {
    /// Takes a NIP-11 report; an advertised NIP-77 counts while nothing better is known.
    fn take_nip11(&mut self, nip11: Nip11) {
        self.nip11.update(nip11);
        if nip11.nip77 && self.nip77 == Nip77Support::Unknown {
            self.nip77 = Nip77Support::Advertised;
        }
    }
}

impl SyncMachine {
    /// Starts knowing `relay` with `state` (a relay just discovered, or a bootstrap relay):
    /// its [`RemoteRelay`] takes what a restored snapshot taught about it.
    pub(super) fn add_remote(&mut self, relay: &RelayUrl, state: RelayState) {
        let nip77 = self.persist.take_nip77(relay).unwrap_or_default();
        let mut remote = RemoteRelay {
            nip77,
            unsupported_at: (nip77 == Nip77Support::Unsupported).then_some(self.last_now),
            ..RemoteRelay::default()
        };
        if let Some(nip11) = self.unknown_nip11.remove(relay) {
            remote.take_nip11(nip11);
        }
        self.relays.insert(relay.clone(), state);
        self.remotes.insert(relay.clone(), remote);
    }

    /// Forgets `relay` entirely: its state, batches, timers, reconciliations and restored
    /// state, and tells the engine to end its connection. The one way a relay is dropped
    /// (refused by the engine, or idle).
    pub(super) fn forget_relay(&mut self, relay: &RelayUrl) {
        self.relays.remove(relay);
        self.pending.remove(relay);
        self.remotes.remove(relay);
        self.persist.forget(relay);
        self.unknown_nip11.remove(relay);
        self.replan.remove(relay);
        self.replan_roots.remove(relay);
        // After the state: a negentropy session of the connection about to be closed gets
        // no NEG-CLOSE.
        self.drop_jobs_of(relay, false);
        self.timers.cancel_relay(relay);
        self.timers_stale.remove(relay);
        self.commands.push_back(super::Command::Forget {
            relay: relay.clone(),
        });
    }

    /// Marks the derived timers of `relay` for recomputation ([`Self::refresh_timers`]).
    pub(super) fn mark_stale(&mut self, relay: &RelayUrl) {
        if !self.timers_stale.contains(relay) {
            self.timers_stale.insert(relay.clone());
        }
    }

    /// The state of remote `relay`.
    pub(super) fn remote_of(&self, relay: &RelayUrl) -> Option<&RemoteRelay> {
        self.remotes.get(relay)
    }

    /// The state of remote `relay`, for changing it.
    pub(super) fn remote_mut(&mut self, relay: &RelayUrl) -> Option<&mut RemoteRelay> {
        self.mark_stale(relay);
        self.remotes.get_mut(relay)
    }

    /// The working state of `relay`'s connection, for changing it. The relay must be known
    /// (every caller runs for a relay in `relays`; debug builds check it).
    pub(super) fn link(&mut self, relay: &RelayUrl) -> &mut Link {
        debug_assert!(
            self.relays.contains_key(relay),
            "{relay}: link of a relay not known"
        );
        self.mark_stale(relay);
        &mut self.remotes.entry(relay.clone()).or_default().link
    }

    /// The working state of `relay`'s connection, for changing it, if the relay is known.
    pub(super) fn link_mut(&mut self, relay: &RelayUrl) -> Option<&mut Link> {
        self.remote_mut(relay).map(|r| &mut r.link)
    }

    /// The working state of `relay`'s connection.
    pub(super) fn link_of(&self, relay: &RelayUrl) -> Option<&Link> {
        self.remotes.get(relay).map(|r| &r.link)
    }

    /// The pending batches of `relay`, for changing them.
    pub(super) fn pending_mut(&mut self, relay: &RelayUrl) -> Option<&mut Vec<PendingBatch>> {
        self.mark_stale(relay);
        self.pending.get_mut(relay)
    }

    /// Removes the pending batches of `relay`.
    pub(super) fn take_pending(&mut self, relay: &RelayUrl) -> Option<Vec<PendingBatch>> {
        self.mark_stale(relay);
        self.pending.remove(relay)
    }

    /// Takes what a relay (the own relay too) publishes about its limits (NIP-11): page
    /// size, subscription budget, message size and NIP-77 support. The limits of a remote
    /// relay not known yet wait for its discovery (at most `max_relays` relays' worth).
    pub(super) fn set_limits(&mut self, relay: &RelayUrl, limits: &RelayLimits) {
        let page = PageLimits::of(limits, self.config.assumed_page_size);
        info!(
            "{relay}: NIP-11 limits: page size {} (max_limit {:?}, default_limit {:?}, max_subscriptions {:?})",
            page.page_size, limits.max_limit, limits.default_limit, limits.max_subscriptions
        );
        let nip11 = Nip11 {
            page_limits: Some(page),
            budget: limits.max_subscriptions.map(|max| max.max(2)),
            max_message: limits.max_message_length,
            nip77: limits.supports_nip77 == Some(true),
        };
        if *relay == self.config.own_relay {
            self.own_nip11.update(Nip11 {
                nip77: false,
                ..nip11
            });
        } else if let Some(r) = self.remotes.get_mut(relay) {
            r.take_nip11(nip11);
        } else if let Some(early) = self.unknown_nip11.get_mut(relay) {
            early.update(nip11);
        } else if self.unknown_nip11.len() < self.config.max_relays {
            self.unknown_nip11.insert(relay.clone(), nip11);
        } else {
            debug!("{relay}: NIP-11 limits of a relay not known; dropped");
        }
    }

    /// What the NIP-11 of `relay` (the own relay too) published, as far as known.
    pub(super) fn nip11_of(&self, relay: &RelayUrl) -> Nip11 {
        if *relay == self.config.own_relay {
            return self.own_nip11;
        }
        match self.remotes.get(relay) {
            Some(r) => r.nip11,
            None => self.unknown_nip11.get(relay).copied().unwrap_or_default(),
        }
    }

    /// Every entry any structure of the machine holds for `relay`, by structure (for tests
    /// that a forgotten relay leaves no trace).
    #[cfg(test)]
    pub(super) fn traces_of(
        &self,
        relay: &RelayUrl,
    ) -> std::collections::BTreeMap<&'static str, usize> {
        let mut t = std::collections::BTreeMap::new();
        let mut note = |what: &'static str, n: usize| {
            if n > 0 {
                t.insert(what, n);
            }
        };
        note("relays", usize::from(self.relays.contains_key(relay)));
        note("pending", usize::from(self.pending.contains_key(relay)));
        note("remotes", usize::from(self.remotes.contains_key(relay)));
        note("timers", self.timers.count_relay(relay));
        note(
            "timers_stale",
            usize::from(self.timers_stale.contains(relay)),
        );
        note("replan", usize::from(self.replan.contains(relay)));
        note(
            "replan_roots",
            usize::from(self.replan_roots.contains_key(relay)),
        );
        note("jobs", self.recon.jobs_of(relay));
        note("persist", self.persist.entries_of(relay));
        note(
            "unknown_nip11",
            usize::from(self.unknown_nip11.contains_key(relay)),
        );
        note(
            "targets",
            usize::from(self.plan.targets().contains_key(relay)),
        );
        t
    }
}
