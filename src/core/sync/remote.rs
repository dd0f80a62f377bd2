//! One remote relay's state in one place (issues 18 and 35): [`RemoteRelay`], the
//! accessors that keep its derived timers current, and [`SyncMachine::forget_relay`], the
//! one way a relay is forgotten.
//!
//! Per remote relay the machine keeps exactly: its [`RemoteRelay`] in `remotes` (the
//! design's [`RelayState`] and pending batches, its [`Link`], what it published and what was
//! learnt about it), its timers ([`super::timers::Timer::of_relay`], in the machine's one
//! timer table) and its reconciliation jobs. Removing its entry from `remotes` forgets all
//! of it but the timers and jobs, which [`SyncMachine::forget_relay`] drops with it. Relays
//! not known (no [`RemoteRelay`]) may be named by [`Unknown`] (NIP-11 reported early, a
//! target refused at `max_relays`) and by a restored snapshot (`persist`). The read API is
//! [`RelayView`](super::RelayView) ([`SyncMachine::relays`], [`SyncMachine::relay`]).

use crate::core::hash::{HashMap, HashSet};

use log::{debug, info};

use crate::core::paging::{CapWatch, PageLimits};
use crate::core::state::{PendingBatch, PendingItems, RelayState};
use crate::shared::RelayLimits;
use crate::shared::RelayUrl;

use super::persist::Late;
use super::{Link, Nip77Support, SyncMachine};

/// Everything the machine keeps about one remote relay (but its timers and reconciliation
/// jobs, kept by the machine's timer table and reconciler).
#[derive(Debug)]
pub(super) struct RemoteRelay {
    /// Confirmed state and connection lifecycle (the design's `RelaySyncIndex` entry).
    pub(super) state: RelayState,
    /// Batches in flight, oldest first (the design's `PendingSyncIndex` entry; empty when
    /// none).
    pub(super) pending: Vec<PendingBatch>,
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
    /// It refused a REQ of several filters (`CLOSED "unsupported: multi-filter REQs aren't
    /// supported"`, some rust-nostr relay-builder versions): one filter per REQ from then on,
    /// across reconnects (decision 0110).
    pub(super) single_filter: bool,
    /// Its derived timers ([`super::timers::Timer::EoseDeadline`],
    /// [`super::timers::Timer::Reopen`]) may no longer match its state: recomputed by
    /// [`SyncMachine::refresh_timers`] before a timer is read again.
    pub(super) timers_stale: bool,
}

impl RemoteRelay {
    /// A relay just known, with `state`.
    fn new(state: RelayState) -> RemoteRelay {
        RemoteRelay {
            state,
            pending: Vec::new(),
            link: Link::default(),
            nip11: Nip11::default(),
            nip77: Nip77Support::default(),
            unsupported_at: None,
            detection: None,
            late: None,
            incomplete: PendingItems::default(),
            stalled_since: None,
            caps: CapWatch::default(),
            single_filter: false,
            timers_stale: false,
        }
    }
}

/// What the machine holds about remote relays it does not know (no [`RemoteRelay`]): taken
/// or dropped when the relay becomes known.
#[derive(Debug, Default)]
pub(super) struct Unknown {
    /// NIP-11 limits reported for relays not known (yet, or any more: a retired thread's
    /// late report), taken when the relay is discovered; at most `max_relays`.
    pub(super) nip11: HashMap<RelayUrl, Nip11>,
    /// Targets refused because `max_relays` relays were known: spawned at the next planning
    /// when a slot freed up (bounded by the targets).
    pub(super) no_slot: HashSet<RelayUrl>,
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
    /// its [`RemoteRelay`] takes what a restored snapshot taught about it and the NIP-11
    /// limits reported before.
    pub(super) fn add_remote(&mut self, relay: &RelayUrl, state: RelayState) {
        let nip77 = self.persist.take_nip77(relay).unwrap_or_default();
        let mut remote = RemoteRelay {
            nip77,
            unsupported_at: (nip77 == Nip77Support::Unsupported).then_some(self.last_now),
            ..RemoteRelay::new(state)
        };
        if let Some(nip11) = self.unknown.nip11.remove(relay) {
            remote.take_nip11(nip11);
        }
        self.unknown.no_slot.remove(relay);
        self.remotes.insert(relay.clone(), remote);
    }

    /// Forgets `relay` entirely: its [`RemoteRelay`], timers, reconciliations and restored
    /// state, and tells the engine to end its connection. The one way a relay is dropped
    /// (refused by the engine, idle, or its slot lost).
    pub(super) fn forget_relay(&mut self, relay: &RelayUrl) {
        self.remotes.remove(relay);
        self.persist.forget(relay);
        // After the state: a negentropy session of the connection about to be closed gets
        // no NEG-CLOSE.
        self.drop_jobs_of(relay, false);
        self.timers.cancel_relay(relay);
        self.commands.push_back(super::Command::Forget {
            relay: relay.clone(),
        });
    }

    /// Marks the derived timers of `relay` for recomputation ([`Self::refresh_timers`]).
    pub(super) fn mark_stale(&mut self, relay: &RelayUrl) {
        if let Some(r) = self.remotes.get_mut(relay) {
            if !r.timers_stale {
                r.timers_stale = true;
                self.stale.push(relay.clone());
            }
        }
    }

    /// Marks the derived timers of every remote relay for recomputation.
    pub(super) fn mark_all_stale(&mut self) {
        for (url, r) in &mut self.remotes {
            if !r.timers_stale {
                r.timers_stale = true;
                self.stale.push(url.clone());
            }
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

    /// The confirmed state and lifecycle of remote `relay`.
    pub(super) fn state_of(&self, relay: &RelayUrl) -> Option<&RelayState> {
        self.remotes.get(relay).map(|r| &r.state)
    }

    /// The working state of `relay`'s connection, for changing it. The relay must be known
    /// (every caller runs for a known relay): debug builds panic otherwise, release builds
    /// hand out [`SyncMachine::detached_link`], which nothing reads, rather than make half a
    /// relay.
    pub(super) fn link(&mut self, relay: &RelayUrl) -> &mut Link {
        debug_assert!(
            self.remotes.contains_key(relay),
            "{relay}: link of a relay not known"
        );
        self.mark_stale(relay);
        match self.remotes.get_mut(relay) {
            Some(r) => &mut r.link,
            None => {
                self.detached_link = Link::default();
                &mut self.detached_link
            }
        }
    }

    /// The working state of `relay`'s connection, for changing it, if the relay is known.
    pub(super) fn link_mut(&mut self, relay: &RelayUrl) -> Option<&mut Link> {
        self.remote_mut(relay).map(|r| &mut r.link)
    }

    /// The working state of `relay`'s connection.
    pub(super) fn link_of(&self, relay: &RelayUrl) -> Option<&Link> {
        self.remotes.get(relay).map(|r| &r.link)
    }

    /// The pending batches of `relay` (empty when it has none or is not known).
    pub(super) fn pending_of(&self, relay: &RelayUrl) -> &[PendingBatch] {
        self.remotes.get(relay).map_or(&[], |r| &r.pending)
    }

    /// The pending batches of `relay`, for changing them.
    pub(super) fn pending_mut(&mut self, relay: &RelayUrl) -> Option<&mut Vec<PendingBatch>> {
        self.remote_mut(relay).map(|r| &mut r.pending)
    }

    /// Removes the pending batches of `relay` (empty when it had none).
    pub(super) fn take_pending(&mut self, relay: &RelayUrl) -> Vec<PendingBatch> {
        self.pending_mut(relay)
            .map(std::mem::take)
            .unwrap_or_default()
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
        } else if let Some(early) = self.unknown.nip11.get_mut(relay) {
            early.update(nip11);
        } else if self.unknown.nip11.len() < self.config.max_relays {
            self.unknown.nip11.insert(relay.clone(), nip11);
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
            None => self.unknown.nip11.get(relay).copied().unwrap_or_default(),
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
        note("remotes", usize::from(self.remotes.contains_key(relay)));
        note("timers", self.timers.count_relay(relay));
        note(
            "unknown.no_slot",
            usize::from(self.unknown.no_slot.contains(relay)),
        );
        note("jobs", self.recon.jobs_of(relay));
        note("persist", self.persist.entries_of(relay));
        note(
            "unknown.nip11",
            usize::from(self.unknown.nip11.contains_key(relay)),
        );
        note(
            "targets",
            usize::from(self.plan.targets().contains_key(relay)),
        );
        t
    }
}
