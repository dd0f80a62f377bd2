//! The design's three indexes: what we want ([`RepoSyncIndex`]), what is confirmed per relay
//! ([`RelaySyncIndex`]) and what is in flight ([`PendingSyncIndex`]).
//!
//! In the design these are `Arc<RwLock<HashMap<..>>>` shared by tasks. Here they are owned by
//! [`crate::core::SyncMachine`]: the repository index as a plain map, the other two per remote
//! relay (its [`RelayState`] and [`PendingBatch`]es, read with
//! [`crate::core::SyncMachine::relays`]; decision 0107), so the maps
//! [`RelaySyncIndex`] and [`PendingSyncIndex`] are the input of
//! [`crate::core::targets::compute_actions`] only. The engine keeps the whole machine behind
//! one `parking_lot` lock that only the coordinator thread writes, so the three are always
//! consistent with each other when a status reader looks.

use crate::core::hash::{HashMap, HashSet};

use nostr::event::EventId;
use nostr::message::SubscriptionId;

use crate::core::nip34::RepoRef;
use crate::core::time::Time;
use crate::shared::RelayUrl;

/// What one repository needs: the relays its announcement lists and its root events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepoSyncNeeds {
    /// Relay URLs listed in this repo's 30617 announcement (normalised).
    pub relays: HashSet<RelayUrl>,
    /// Root event ids (1617/1618/1619/1621) that reference this repo.
    pub root_events: HashSet<EventId>,
    /// Events followed below those root events (replies to replies, quotes, reactions:
    /// `core::threads`): Layer-3 ids like the root events, not counted as root events.
    pub thread_events: HashSet<EventId>,
    /// `created_at` of the announcement the relay set came from; a newer one replaces it.
    pub announced_at: Option<u64>,
}

impl RepoSyncNeeds {
    /// The repository's Layer-3 ids: its root events, then its thread members.
    pub fn layer3_ids(&self) -> impl Iterator<Item = &EventId> + '_ {
        self.root_events.iter().chain(self.thread_events.iter())
    }
}

/// What we WANT to sync, keyed by repository reference `30617:<pubkey>:<d>`.
pub type RepoSyncIndex = HashMap<RepoRef, RepoSyncNeeds>;

/// The per-relay view of [`RepoSyncIndex`]: what one relay should carry for us.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelaySyncNeeds {
    /// Repositories whose announcement lists this relay.
    pub repos: HashSet<RepoRef>,
    /// Layer-3 ids of those repositories: their root events and the events followed below
    /// them ([`RepoSyncNeeds::layer3_ids`]).
    pub root_events: HashSet<EventId>,
}

/// Connection status of a relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnectionStatus {
    /// Not connected (never tried, failed, or lost).
    Disconnected,
    /// A connection attempt is in progress.
    Connecting,
    /// Connected; subscriptions can be sent.
    Connected,
}

/// Confirmed state and connection lifecycle of one remote relay.
#[derive(Debug, Clone)]
pub struct RelayState {
    /// Repositories whose Layer-2 history this relay delivered completely (EOSE seen).
    pub repos: HashSet<RepoRef>,
    /// Layer-3 ids (root events and thread members) whose history this relay delivered
    /// completely.
    pub root_events: HashSet<EventId>,
    /// A bootstrap relay is never idle-disconnected.
    pub is_bootstrap: bool,
    /// Current connection status.
    pub connection_status: ConnectionStatus,
    /// When the last connection was established (for the quick-reconnect `since`).
    pub last_connected: Option<Time>,
    /// When the relay was last lost (for the 15-minute rule).
    pub disconnected_at: Option<Time>,
    /// Connection generation: bumped on every connect attempt so that reports and commands
    /// from an earlier connection are recognised and ignored.
    pub generation: u64,
    /// Batches confirmed although the relay could not deliver their whole history (a
    /// same-second burst beyond its cap that no query split could fetch).
    pub incomplete_batches: u64,
}

impl RelayState {
    /// A relay just discovered (no history, not connected).
    pub fn new(is_bootstrap: bool) -> RelayState {
        RelayState {
            repos: HashSet::default(),
            root_events: HashSet::default(),
            is_bootstrap,
            connection_status: ConnectionStatus::Disconnected,
            last_connected: None,
            disconnected_at: None,
            generation: 0,
            incomplete_batches: 0,
        }
    }

    /// True when the relay was disconnected for longer than `window` at `now`
    /// (the design's `should_clear_state`, with time injected).
    pub fn should_clear_state(&self, now: Time, window: std::time::Duration) -> bool {
        match self.disconnected_at {
            Some(at) => now.since(at) > window,
            None => false,
        }
    }

    /// Forgets the confirmed items (stale reconnect, daily resync).
    pub fn clear_sync_state(&mut self) {
        self.repos.clear();
        self.root_events.clear();
    }
}

/// Confirmed state per relay.
pub type RelaySyncIndex = HashMap<RelayUrl, RelayState>;

/// The items one batch of subscriptions syncs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingItems {
    /// Repositories (Layer 2).
    pub repos: HashSet<RepoRef>,
    /// Layer-3 ids: root events and thread members.
    pub root_events: HashSet<EventId>,
}

impl PendingItems {
    /// True when the batch carries nothing.
    pub fn is_empty(&self) -> bool {
        self.repos.is_empty() && self.root_events.is_empty()
    }
}

/// Subscriptions in flight for one AddFilters; confirms when every one got EOSE.
#[derive(Debug, Clone)]
pub struct PendingBatch {
    /// Unique id, for logs.
    pub batch_id: u64,
    /// What the batch syncs.
    pub items: PendingItems,
    /// Subscriptions that must all see EOSE before the items count as confirmed.
    pub outstanding_subs: HashSet<SubscriptionId>,
    /// When a query of the batch was last sent (queries queued behind the subscription
    /// budget count from when they leave the queue), or the batch last made progress (an
    /// EOSE of one of its queries): the EOSE deadline counts from here.
    pub started_at: Time,
    /// Set when a query of the batch could not be paged completely.
    pub incomplete: bool,
    /// The earliest moment a query of the batch was closed at its EOSE to give its slot back
    /// (a constrained relay): from then on its items have no live subscription, so the
    /// rebuild after confirmation catches up from here.
    pub uncovered_from: Option<Time>,
}

/// In-flight batches per relay.
pub type PendingSyncIndex = HashMap<RelayUrl, Vec<PendingBatch>>;
