//! [`SyncMachine`]: the coordinator's brain, sans-IO.
//!
//! It owns the design's three indexes and decides everything: which relays to connect, what
//! to subscribe with which `since`, when a batch is confirmed or failed, when to retry. It
//! takes [`Report`]s from the connection threads plus `now`, and queues [`Command`]s that the
//! engine carries out. It never blocks and never reads a clock, so a test can drive it
//! through hours of simulated time.

mod batches;
#[cfg(test)]
mod chain_tests;
mod closed;
mod config;
mod consolidation;
mod daily;
#[cfg(test)]
mod design_tests;
mod detect;
#[cfg(test)]
mod fairness_tests;
#[cfg(test)]
mod forget_tests;
mod lifecycle;
mod link;
#[cfg(test)]
mod loss_tests;
#[cfg(test)]
mod nip77_tests;
mod own;
mod own_tags;
#[cfg(test)]
mod pack_tests;
mod persist;
#[cfg(test)]
mod persist_tests;
#[cfg(test)]
mod plan_tests;
mod reconcile;
#[cfg(test)]
mod related_tests;
mod remote;
#[cfg(test)]
mod replicated_tests;
mod report;
mod standing;
mod status;
mod subscriptions;
mod timers;
#[cfg(test)]
mod world;

#[cfg(feature = "testing")]
pub(crate) use reconcile::{hex_decode, hex_encode};
pub use reconcile::{FallbackReason, NegClient, Nip77Config, Nip77Support};
pub use standing::{FAILING_TTL, RESELECT_DELAY};
pub use subscriptions::MAX_FILTERS_PER_REQ;

use crate::core::hash::{HashMap, HashSet};
use std::collections::VecDeque;

use log::{info, warn};
use nostr::message::SubscriptionId;

use crate::core::health::Jitter;
use crate::core::nip34::SelfEventMeaning;
use crate::core::state::{ConnectionStatus, PendingBatch, RelayState, RepoSyncIndex};
use crate::core::targets::{Exclusions, Plan};
use crate::core::time::Time;
use crate::shared::RelayUrl;
use timers::{Timer, TimerTable};

pub use crate::core::wire::{Command, Report, Route};
pub use config::{machine_policy, machine_targets, SyncConfig};
pub use link::LinkError;
#[cfg(test)]
use link::MAX_WARNED;
pub(crate) use link::{history_since, live_only};
use link::{is_batch_query, unbatched_loading, Link, Parked, SubInfo, Warned, MAX_RESUME};
pub use persist::{
    with_item_budget, RelaySnapshot, RestoreReport, SyncSnapshot, MAX_RELAY_ITEMS, MAX_STATE_ITEMS,
    MAX_STATE_RELAYS, MAX_STORED_REF_LEN,
};
pub use status::{RelaySyncStatus, RelayView, SyncCounters};

/// What a subscription is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SubPurpose {
    /// Layer 1 (announcements), once per connection.
    Announcements,
    /// Layer 2/3 for a pending batch: history and live in one REQ (no `since`).
    Batch(u64),
    /// Live-only Layer 2/3 of confirmed items (`limit: 0`, never `since`: relays apply
    /// `since` to live events too, so a live subscription with `since` would miss every
    /// backdated event and every old event copied into the relay later).
    Live,
    /// History of confirmed items (Layer 1, 2 or 3) from a moment on (`since`): after a quick
    /// reconnect, a consolidation or a lost live subscription. Closed at EOSE; its pages
    /// are `Page { batch: None }`.
    CatchUp,
    /// The self-subscription on the own relay: every event it holds, history then live
    /// (read after the announcements and root events, `own.rs`).
    SelfSubscription,
    /// A query closed at EOSE: a page of older history (part of a batch when `batch` is
    /// set) or a poll round of queries that do not fit the subscription budget.
    Page {
        /// The batch the page completes, if any.
        batch: Option<u64>,
    },
    /// A query on the own relay reading its side of reconciliation `job` (closed at EOSE).
    OwnSide {
        /// The reconciliation.
        job: u64,
    },
}

impl SubPurpose {
    /// True for queries that stay open after EOSE (live); false for history queries that
    /// are closed at EOSE.
    pub fn is_live(self) -> bool {
        !matches!(
            self,
            SubPurpose::CatchUp | SubPurpose::Page { .. } | SubPurpose::OwnSide { .. }
        )
    }
}

#[derive(Debug)]
struct SelfBatch {
    meanings: Vec<SelfEventMeaning>,
    started: Option<Time>,
}

/// The pure sync state machine. See the module documentation.
#[derive(Debug)]
pub struct SyncMachine {
    config: SyncConfig,
    /// The own relay under every name it was given (its URL and `own_aliases`).
    own_names: Vec<RelayUrl>,
    /// Relays never targets: `own_names`, relays the address policy refused, hosts refused
    /// too often (issue 20).
    excluded: Exclusions,
    /// Failing relays, refusals per host and pubkey, blocked pubkeys (issue 20).
    standing: standing::Standing,
    repo_index: RepoSyncIndex,
    /// The targets derived from `repo_index`, kept current by every change (issue 10).
    plan: Plan,
    /// Distinct root events in `repo_index`, counted as they are linked (status reads must
    /// not walk the index under the machine's lock).
    root_events_known: usize,
    /// Events followed below the root events (their ids are Layer-3 values of the roots'
    /// repositories, `RepoSyncNeeds::thread_events`).
    threads: crate::core::threads::Threads,
    /// Extra reads of the own relay's events on the current connection (waiting replies
    /// were dropped).
    own_rereads: u64,
    /// The announcements and root events are being read, before the self-subscription
    /// opens (`own.rs`).
    own_roots_read: bool,
    /// What the own relay's events tag (decision 0120): a history query none of them can
    /// match is one REQ at once, without reading the own relay's side first.
    own_tags: own_tags::OwnTags,
    /// A read of the own relay's stored events on the current connection ended incomplete
    /// (`own_tags` then stays incomplete until the next connection's read).
    own_read_incomplete: bool,
    /// Every remote relay known, with everything about it (its confirmed state and pending
    /// batches, the design's `RelaySyncIndex` and `PendingSyncIndex`, included); read with
    /// [`SyncMachine::relays`] and [`SyncMachine::relay`].
    remotes: HashMap<RelayUrl, remote::RemoteRelay>,
    /// What is held about remote relays not known (yet, or any more).
    unknown: remote::Unknown,
    own: RelayState,
    own_link: Link,
    /// What [`SyncMachine::link`] hands out for a relay not known (a bug; release builds
    /// only): written, never read.
    detached_link: Link,
    /// What the own relay's NIP-11 published (page size, subscription budget).
    own_nip11: remote::Nip11,
    /// What paging learnt about the own relay's cap (decision 0103).
    own_caps: crate::core::paging::CapWatch,
    batch: SelfBatch,
    commands: VecDeque<Command>,
    next_sub: u64,
    next_batch: u64,
    /// Every deadline of the machine (issue 18): [`SyncMachine::poll_timeout`] is its
    /// earliest entry.
    timers: TimerTable,
    /// The remote relays marked [`remote::RemoteRelay::timers_stale`], in the order marked
    /// (a work list for [`SyncMachine::refresh_timers`]; a relay forgotten meanwhile is
    /// skipped).
    stale: Vec<RelayUrl>,
    /// One counter for every connection generation (own relay and remote relays), so a
    /// relay forgotten and discovered again never reuses a retired thread's generation.
    next_generation: u64,
    /// State restored from a snapshot, and what else is persisted (issue 11).
    persist: persist::Persisted,
    /// The `now` of the latest input (for bookkeeping inside helpers that take no time).
    last_now: Time,
    /// Since when the forward queue has been full (remote EOSE deadlines are suspended).
    forward_paused_since: Option<Time>,
    jitter: Jitter,
    counters: SyncCounters,
    /// NIP-77 reconciliations and what is known per relay.
    recon: reconcile::Reconciler,
    started: bool,
}

impl SyncMachine {
    /// A machine with nothing known yet. Call [`SyncMachine::start`] next.
    #[must_use]
    pub fn new(config: SyncConfig) -> SyncMachine {
        let mut own_names = vec![config.own_relay.clone()];
        for a in &config.own_aliases {
            if !own_names.contains(a) {
                own_names.push(a.clone());
            }
        }
        let excluded = Exclusions::from(own_names.as_slice());
        let jitter = Jitter::new(config.seed);
        SyncMachine {
            own_names,
            excluded,
            standing: standing::Standing::default(),
            repo_index: RepoSyncIndex::default(),
            plan: Plan::default(),
            root_events_known: 0,
            threads: crate::core::threads::Threads::new(config.threads),
            own_rereads: 0,
            own_roots_read: false,
            own_tags: own_tags::OwnTags::default(),
            own_read_incomplete: false,
            remotes: HashMap::default(),
            unknown: remote::Unknown::default(),
            own: RelayState::new(false),
            own_link: Link::default(),
            detached_link: Link::default(),
            own_nip11: remote::Nip11::default(),
            own_caps: Default::default(),
            batch: SelfBatch {
                meanings: Vec::new(),
                started: None,
            },
            commands: VecDeque::new(),
            next_sub: 0,
            next_batch: 0,
            timers: TimerTable::default(),
            stale: Vec::new(),
            next_generation: 0,
            persist: persist::Persisted::default(),
            last_now: Time::default(),
            forward_paused_since: None,
            jitter,
            counters: SyncCounters::default(),
            recon: reconcile::Reconciler::default(),
            config,
            started: false,
        }
    }

    /// Starts: connects the own relay (self-subscription) and every bootstrap relay.
    pub fn start(&mut self, now: Time) {
        if self.started {
            return;
        }
        self.started = true;
        self.connect_own(now);
        for b in self.config.bootstrap.clone() {
            if self.excluded.contains(&b) {
                warn!("bootstrap relay {b} is the own relay; ignoring it as a sync source");
                continue;
            }
            if let Some(shard) = self.config.shard.filter(|s| !s.owns(&b)) {
                info!(
                    "bootstrap relay {b} belongs to another shard than {shard}; not connecting it"
                );
                continue;
            }
            let mut s = RelayState::new(true);
            s.connection_status = ConnectionStatus::Disconnected;
            self.add_remote(&b, s);
            self.connect_remote(&b, now);
        }
        self.timers.set(
            Timer::DisconnectCheck,
            now.plus(self.config.disconnect_check_interval),
        );
        self.refresh_timers();
        self.check_timers();
    }

    /// The next command to carry out.
    #[must_use]
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// The earliest time at which [`SyncMachine::handle_timeout`] has work.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        self.timers.next_timeout()
    }

    /// Runs every timer that is due at `now`, earliest first (timers due at the same
    /// moment in `Timer` order). A timer that is set again to a due deadline while this
    /// runs waits for the next call, so one call always ends.
    pub fn handle_timeout(&mut self, now: Time) {
        self.last_now = self.last_now.max(now);
        let mut fired = HashSet::default();
        loop {
            self.refresh_timers();
            let Some(timer) = self.timers.pop_due(now, &fired) else {
                break;
            };
            fired.insert(timer.clone());
            match timer {
                Timer::EoseDeadline(url) => {
                    self.expire_loading(&url, now);
                    self.expire_batches(&url, now);
                }
                Timer::OwnEoseDeadline => self.expire_own_loading(now),
                Timer::JobDeadline(id) => self.expire_job(id),
                Timer::Nip77Detection(relay) => self.detection_expired(&relay),
                Timer::DeliveryWait => {
                    self.recon.flush_due = true;
                    self.flush_fetches();
                }
                Timer::SelfBatch => self.process_batch(now),
                Timer::OwnReconnect => self.connect_own(now),
                Timer::OwnReopen => self.reopen_own(now),
                Timer::Reconnect(url) => self.connect_remote(&url, now),
                Timer::RetryBatches(url) => self.recompute_actions_for_relay(&url, now),
                Timer::Reopen(url) => self.reopen(&url, now),
                Timer::Cooldown(url) => self.drain_queue(&url),
                Timer::Poll(url) => self.poll_round(&url, now),
                Timer::Consolidate(url) => self.run_deferred(&url, now),
                Timer::Daily(url) => self.daily_resync(&url, now),
                Timer::DisconnectCheck => {
                    let next = now.plus(self.config.disconnect_check_interval);
                    self.timers.set(Timer::DisconnectCheck, next);
                    self.expire_failing(now);
                    self.check_disconnects(now);
                }
                Timer::Reselect => self.deferred_reselect(now),
            }
        }
        self.check_timers();
    }

    /// Opens again the subscriptions of `relay` whose delay after its CLOSED passed (when
    /// it is still connected; else they are dropped, as everything of the lost connection).
    fn reopen(&mut self, relay: &RelayUrl, now: Time) {
        let Some(link) = self.link_mut(relay) else {
            return;
        };
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut link.reopen)
            .into_iter()
            .partition(|r| r.0 <= now);
        link.reopen = later;
        let Some(generation) = self.connected_generation(relay) else {
            return;
        };
        for (_, purpose, filter) in due {
            info!("{relay}: subscribing again to the {purpose:?} query it closed");
            self.open_sub(relay, generation, purpose, filter);
        }
    }

    /// Opens again the pages of the self-subscription whose delay after their CLOSED passed.
    fn reopen_own(&mut self, now: Time) {
        if self.own.connection_status != ConnectionStatus::Connected {
            return;
        }
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.own_link.reopen)
            .into_iter()
            .partition(|r| r.0 <= now);
        self.own_link.reopen = later;
        for (_, purpose, filter) in due {
            self.open_own_sub(purpose, filter);
        }
    }

    /// Recomputes the timers derived from several pieces of state: the EOSE deadline and the
    /// reopen time of every remote relay marked stale, and those of the own relay (a few
    /// subscriptions). Runs before every timer is read or popped.
    fn refresh_timers(&mut self) {
        for url in std::mem::take(&mut self.stale) {
            let Some(r) = self.remotes.get_mut(&url) else {
                continue;
            };
            r.timers_stale = false;
            let eose = self.eose_deadline_of(&url);
            self.timers
                .set_or_cancel(Timer::EoseDeadline(url.clone()), eose);
            let reopen = self
                .link_of(&url)
                .and_then(|l| l.reopen.iter().map(|r| r.0).min());
            self.timers.set_or_cancel(Timer::Reopen(url), reopen);
        }
        let own_eose = unbatched_loading(&self.own_link)
            .map(|(_, t)| t)
            .min()
            .map(|t| t.plus(self.config.eose_timeout));
        self.timers.set_or_cancel(Timer::OwnEoseDeadline, own_eose);
        let own_reopen = (self.own.connection_status == ConnectionStatus::Connected)
            .then(|| self.own_link.reopen.iter().map(|r| r.0).min())
            .flatten();
        self.timers.set_or_cancel(Timer::OwnReopen, own_reopen);
    }

    /// Debug builds: no timer names a relay not known, no relay known is held as not known
    /// ([`remote::Unknown`]), and the derived timers equal a fresh derivation (no change of
    /// their inputs went unmarked). Runs after every input.
    fn check_timers(&self) {
        #[cfg(debug_assertions)]
        {
            debug_assert!(self.stale.is_empty(), "timers refreshed");
            for (url, r) in &self.remotes {
                debug_assert!(!r.timers_stale, "{url}: timers refreshed");
                debug_assert!(
                    !self.unknown.nip11.contains_key(url) && !self.unknown.no_slot.contains(url),
                    "{url}: known and held as not known"
                );
                debug_assert_eq!(
                    self.timers.get(&Timer::EoseDeadline(url.clone())),
                    self.eose_deadline_of(url),
                    "{url}: EOSE deadline"
                );
                debug_assert_eq!(
                    self.timers.get(&Timer::Reopen(url.clone())),
                    self.link_of(url)
                        .and_then(|l| l.reopen.iter().map(|r| r.0).min()),
                    "{url}: reopen time"
                );
            }
            for url in self.timers.relays() {
                debug_assert!(
                    self.remotes.contains_key(url),
                    "{url}: timer of a relay not known"
                );
            }
        }
    }

    /// The EOSE deadline of `relay`: the earliest of its queries outside a batch sent
    /// without EOSE, and of its batches that wait for an EOSE ([`Self::batch_awaits_eose`]),
    /// plus the EOSE timeout. None while the forward queue is full or the relay's thread
    /// waits for the forward pipeline's byte bound (its reading pauses).
    fn eose_deadline_of(&self, relay: &RelayUrl) -> Option<Time> {
        if self.forward_paused_since.is_some() || self.is_stalled(relay) {
            return None;
        }
        let link = self.link_of(relay)?;
        let loading = unbatched_loading(link).map(|(_, t)| t).min();
        let batches = self
            .pending_of(relay)
            .iter()
            .filter(|b| self.batch_awaits_eose(relay, Some(link), b))
            .map(|b| b.started_at)
            .min();
        loading
            .into_iter()
            .chain(batches)
            .min()
            .map(|t| t.plus(self.config.eose_timeout))
    }

    /// True when the EOSE deadline of `batch` counts: no reconciliation of it runs (that
    /// has deadlines of its own) and at least one of its queries was sent (a batch whose
    /// queries all wait in the queue has no EOSE to wait for yet).
    fn batch_awaits_eose(
        &self,
        relay: &RelayUrl,
        link: Option<&Link>,
        batch: &PendingBatch,
    ) -> bool {
        !self.recon.has_batch_job(relay, batch.batch_id)
            && batches::batch_has_sent_query(link, batch)
    }

    /// Feeds one report from a connection thread.
    pub fn handle_report(&mut self, report: Report, now: Time) {
        self.last_now = self.last_now.max(now);
        self.dispatch_report(report, now);
        self.refresh_timers();
        self.check_timers();
    }

    /// True when `generation` is the current connection of remote `relay`.
    fn is_current(&self, relay: &RelayUrl, generation: u64) -> bool {
        self.state_of(relay)
            .is_some_and(|s| s.generation == generation)
    }

    fn new_sub_id(&mut self) -> SubscriptionId {
        self.next_sub += 1;
        SubscriptionId::new(format!("gs{}", self.next_sub))
    }

    /// True while `relay` is in a rate-limit cool-down ([`Timer::Cooldown`] not reached).
    fn cooling(&self, relay: &RelayUrl, now: Time) -> bool {
        self.timers
            .get(&Timer::Cooldown(relay.clone()))
            .is_some_and(|t| t > now)
    }

    /// Forgets every subscription of `relay` and everything waiting to be (re)subscribed,
    /// with their timers ([`Link::forget_subscriptions`]).
    fn forget_subscriptions(&mut self, relay: &RelayUrl) {
        if !self.recon.refetches.is_empty() {
            if let Some(link) = self.link_of(relay) {
                let subs: Vec<SubscriptionId> = link
                    .subs
                    .keys()
                    .chain(link.queue.iter().map(|(s, _)| s))
                    .cloned()
                    .collect();
                for sub in subs {
                    self.recon.refetches.remove(&sub);
                }
            }
        }
        if self.recon.delivering.relay_lost(relay) {
            self.recon.flush_due = true;
        }
        if let Some(link) = self.link_mut(relay) {
            link.forget_subscriptions();
        }
        self.timers.cancel(&Timer::Consolidate(relay.clone()));
        self.timers.cancel(&Timer::Poll(relay.clone()));
    }
}
