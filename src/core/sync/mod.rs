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
#[cfg(test)]
mod loss_tests;
#[cfg(test)]
mod nip77_tests;
mod own;
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
mod standing;
mod subscriptions;
mod timers;
#[cfg(test)]
mod world;

#[cfg(feature = "testing")]
pub(crate) use reconcile::{hex_decode, hex_encode};
pub use reconcile::{FallbackReason, NegClient, Nip77Config, Nip77Support};
pub use standing::{FAILING_TTL, RESELECT_DELAY};

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use log::{info, warn};
use nostr::event::EventId;
use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::health::{BackoffPolicy, Health, HealthState, Jitter};
use crate::core::nip34::SelfEventMeaning;
use crate::core::paging::PageStats;
use crate::core::relay_text::{Prefix, RATE_LIMIT_COOLDOWN};
use crate::core::state::{
    ConnectionStatus, PendingBatch, PendingItems, PendingSyncIndex, RelayState, RelaySyncIndex,
    RepoSyncIndex,
};
use crate::core::targets::{derive_targets, Exclusions, Plan, TargetPolicy, TargetReport, Targets};
use crate::core::time::Time;
use crate::shared::RelayUrl;
use timers::{Timer, TimerTable};

pub use crate::core::wire::{Command, Report, Route};
pub use persist::{
    with_item_budget, RelaySnapshot, RestoreReport, SyncSnapshot, MAX_RELAY_ITEMS, MAX_STATE_ITEMS,
    MAX_STATE_RELAYS, MAX_STORED_REF_LEN,
};

/// Settings of the sync logic.
#[derive(Debug, Clone)]
pub struct SyncConfig {
    /// The own relay's connect URL.
    pub own_relay: RelayUrl,
    /// Other URLs under which the own relay is announced; never sync targets.
    pub own_aliases: Vec<RelayUrl>,
    /// Relays connected from the start and never idle-disconnected.
    pub bootstrap: Vec<RelayUrl>,
    /// Self-subscription batch window (design: 5 s). Starts at the first event of a batch
    /// and does not reset.
    pub batch_window: Duration,
    /// The most self-subscription events held in one batch; a full batch is processed early.
    /// It bounds the coordinator's longest planning tick (default 10,000: the first read of
    /// an own relay with 100k repositories and 1M root events takes at most about 100 ms per
    /// tick on a small host; see docs/performance.md, Planning).
    pub max_batch_events: usize,
    /// Page queries one relay may have waiting for a subscription slot before the splits of
    /// a crowded second are cut (`core::paging::bound_plan`; default
    /// [`crate::core::paging::MAX_QUEUED_PAGES`]). The next page of a query is never cut.
    pub max_queued_pages: usize,
    /// Quick-reconnect window and `since` margin (design: 15 min).
    pub quick_reconnect_window: Duration,
    /// EOSE deadline: a batch with no EOSE for this long (counted from its last EOSE)
    /// fails; any other query without EOSE in time is closed and sent again.
    pub eose_timeout: Duration,
    /// Interval of the idle-relay check (design: 60 s).
    pub disconnect_check_interval: Duration,
    /// Reconnect backoff and health thresholds.
    pub backoff: BackoffPolicy,
    /// Open subscriptions per relay above which `handle_add_filters` consolidates
    /// (design: 70); a relay's smaller subscription budget lowers it.
    pub consolidation_threshold: usize,
    /// How long a consolidation waits for the relay's subscriptions that are still loading
    /// history (design: 30 s, "wait for pending batches").
    pub consolidation_wait: Duration,
    /// Shortest delay of the daily full resync (design: 23 h).
    pub daily_min: Duration,
    /// Longest delay of the daily full resync (design: 25 h).
    pub daily_max: Duration,
    /// The most remote relays connected at once (default 1,000): each costs a thread and a
    /// connection, and relay lists come from announcements anyone can write.
    pub max_relays: usize,
    /// Repository scope, relays per announcing pubkey and per announcement (issue 8).
    pub target_limits: crate::core::targets::TargetLimits,
    /// Open subscriptions per relay when NIP-11 does not publish `max_subscriptions`
    /// (default 20).
    pub default_subscription_budget: usize,
    /// How often queries that do not fit a relay's subscription budget are re-run with
    /// `since` (default 60 s).
    pub poll_interval: Duration,
    /// Cool-down after a `rate-limited:` CLOSED or a rate-limit NOTICE (default 65 s).
    pub rate_limit_cooldown: Duration,
    /// Delay before a query refused by a relay (`restricted:`, `blocked:`, …) is tried again
    /// (default 10 min).
    pub refused_retry: Duration,
    /// Events per query assumed for a relay that publishes no NIP-11 limits: a query that
    /// returns this many is paged. Lower is safer and costs one extra REQ per full query.
    pub assumed_page_size: usize,
    /// Seed of the jitter source.
    pub seed: u64,
    /// Only relays of this shard are synced (`--shard I/N`, bootstrap relays included);
    /// `None` syncs every relay.
    pub shard: Option<crate::core::targets::Shard>,
    /// NIP-77 reconciliation of history queries (issue 11).
    pub nip77: Nip77Config,
    /// Bounds of reply-chain following below root events (issue 34, decision 0097).
    pub threads: crate::core::threads::ThreadLimits,
}

impl SyncConfig {
    /// Defaults from the design document for `own_relay`.
    #[must_use]
    pub fn new(own_relay: RelayUrl) -> SyncConfig {
        SyncConfig {
            own_relay,
            own_aliases: Vec::new(),
            bootstrap: Vec::new(),
            batch_window: Duration::from_secs(5),
            max_batch_events: 10_000,
            max_queued_pages: crate::core::paging::MAX_QUEUED_PAGES,
            quick_reconnect_window: Duration::from_secs(15 * 60),
            eose_timeout: Duration::from_secs(120),
            disconnect_check_interval: Duration::from_secs(60),
            backoff: BackoffPolicy::default(),
            consolidation_threshold: 70,
            consolidation_wait: Duration::from_secs(30),
            daily_min: Duration::from_secs(23 * 3600),
            daily_max: Duration::from_secs(25 * 3600),
            assumed_page_size: 20,
            max_relays: 1000,
            target_limits: crate::core::targets::TargetLimits::default(),
            default_subscription_budget: 20,
            poll_interval: Duration::from_secs(60),
            rate_limit_cooldown: RATE_LIMIT_COOLDOWN,
            refused_retry: Duration::from_secs(600),
            seed: 1,
            shard: None,
            nip77: Nip77Config::default(),
            threads: crate::core::threads::ThreadLimits::default(),
        }
    }
}

/// What a subscription is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// The machine's targets: [`derive_targets`] with the policy of `config` (its scope, its
/// per-pubkey quota, `max_relays`, the bootstrap relays reserved).
pub fn machine_targets(
    repo_index: &RepoSyncIndex,
    excluded: &Exclusions,
    config: &SyncConfig,
) -> Targets {
    derive_targets(repo_index, excluded, &machine_policy(excluded, config))
}

/// The policy of `config` as [`machine_targets`] applies it (the machine adds the relays
/// failing their connects and the pubkeys at their refusal cap).
pub fn machine_policy(excluded: &Exclusions, config: &SyncConfig) -> TargetPolicy {
    TargetPolicy {
        preferred_pubkeys: config.target_limits.preferred_pubkeys.clone(),
        max_urls_per_host: config.target_limits.max_urls_per_host,
        failing: HashSet::new(),
        blocked_pubkeys: HashSet::new(),
        scope: config.target_limits.scope.clone(),
        max_relays_per_pubkey: config.target_limits.max_relays_per_pubkey,
        max_relays: config.max_relays,
        reserved: config
            .bootstrap
            .iter()
            .filter(|b| !excluded.contains(b))
            .cloned()
            .collect(),
        shard: config.shard,
    }
}

/// The most history queries kept to resume after a quick reconnect; beyond it the next
/// connect is a fresh sync.
const MAX_RESUME: usize = 1_000;

/// The most distinct CLOSED prefixes and NOTICE texts remembered per relay for "warn once";
/// beyond it repeats are logged at debug level.
pub(crate) const MAX_WARNED: usize = 64;

/// The filter of a live-only subscription for the same events as `f`: no `since`/`until`,
/// `limit: 0` (no stored events, only new ones).
pub(crate) fn live_only(f: &Filter) -> Filter {
    let mut f = f.clone();
    f.since = None;
    f.until = None;
    f.limit = Some(0);
    f
}

/// The filter of a history query for the same events as `f` from `since` on (no `limit`:
/// the relay's page size applies and paging reads the rest).
pub(crate) fn history_since(f: Filter, since: nostr::types::Timestamp) -> Filter {
    let mut f = f;
    f.since = Some(since);
    f.until = None;
    f.limit = None;
    f
}

impl Link {
    /// Remembers `key` for "warn once"; true the first time. Bounded by [`MAX_WARNED`].
    fn warn_once(&mut self, key: Warned) -> bool {
        if self.warned.contains(&key) {
            return false;
        }
        if self.warned.len() >= MAX_WARNED {
            return false;
        }
        self.warned.insert(key)
    }

    /// Keeps the history queries that were not finished (sent without EOSE, queued, waiting
    /// to be reopened, or waiting for room for their pages) so that a quick reconnect
    /// continues them from where they were; batch queries are not kept (their batch fails
    /// and is sent again whole).
    fn keep_unfinished_history(&mut self) {
        let mut kept: Vec<Filter> = Vec::new();
        for (sub, info) in &self.subs {
            if self.loading.contains_key(sub) && !is_batch_query(info.purpose) {
                if info.filter.limit == Some(0) {
                    continue;
                }
                kept.push(std::sync::Arc::unwrap_or_clone(info.query()));
            }
        }
        for (_, info) in &self.queue {
            if !is_batch_query(info.purpose) && info.filter.limit != Some(0) {
                kept.push(std::sync::Arc::unwrap_or_clone(info.query()));
            }
        }
        for (_, purpose, filter) in &self.reopen {
            // A live purpose (Layer 1) closed before its EOSE waits with its history: only
            // a live-only filter carries none.
            if !purpose.is_live() || filter.limit != Some(0) {
                kept.push(filter.clone());
            }
        }
        // Pages not queued yet for lack of room: the rest of their query.
        for p in self.parked.iter().filter(|p| p.batch.is_none()) {
            kept.push(p.remainder());
        }
        // A poll window not yet read: the reconnect's own catch-up may start later.
        if let Some(ps) = self.poll_since {
            kept.extend(self.polled.iter().map(|f| f.clone().since(ps)));
        }
        for f in kept {
            if self.resume.len() >= MAX_RESUME {
                self.resume_overflow = true;
                break;
            }
            if !self.resume.contains(&f) {
                self.resume.push(f);
            }
        }
    }

    /// History queries not finished (live-only REQs, `limit: 0`, carry no history and are
    /// not counted): sent without EOSE yet, waiting for room in the budget, closed by the
    /// relay and waiting to be opened again, and waiting for room for their pages.
    fn history_queries_pending(&self) -> usize {
        let history = |f: &Filter| f.limit != Some(0);
        let loading = self
            .loading
            .keys()
            .filter(|s| self.subs.get(*s).is_some_and(|i| history(&i.filter)))
            .count();
        let queued = self
            .queue
            .iter()
            .filter(|(_, i)| history(&i.filter))
            .count();
        let reopen = self.reopen.iter().filter(|(_, _, f)| history(f)).count();
        loading + queued + reopen + self.parked.len()
    }

    /// Forgets every subscription and everything waiting to be (re)subscribed: after a lost
    /// connection, or before the daily resync rebuilds them.
    fn forget_subscriptions(&mut self) {
        self.subs.clear();
        self.loading.clear();
        self.queue.clear();
        self.deferred = PendingItems::default();
        self.reopen.clear();
        self.parked.clear();
        self.polled.clear();
        self.poll_since = None;
        self.rebuild_needed = false;
        self.uncovered_since = None;
        self.live_built_at = None;
        self.polled_at_counts = None;
    }
}

/// What a relay said that was logged at warn level once ([`Link::warn_once`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Warned {
    /// A CLOSED with this prefix.
    Closed(Prefix),
    /// A rate-limit NOTICE with this text (escaped, bounded).
    Notice(String),
}

/// Queries that belong to a batch (its own REQs and their pages).
fn is_batch_query(p: SubPurpose) -> bool {
    matches!(
        p,
        SubPurpose::Batch(_) | SubPurpose::Page { batch: Some(_) }
    )
}

/// Loading subscriptions that are not part of a batch (a batch has its own deadline), with
/// the time they were sent.
fn unbatched_loading(link: &Link) -> impl Iterator<Item = (&SubscriptionId, Time)> + '_ {
    link.loading.iter().filter_map(|(sub, t)| {
        let info = link.subs.get(sub)?;
        match info.purpose {
            SubPurpose::Batch(_) | SubPurpose::Page { batch: Some(_) } => None,
            _ => Some((sub, *t)),
        }
    })
}

/// A history query whose follow-up pages did not fit the relay's page queue (a full page
/// split into several queries while [`crate::core::paging::MAX_QUEUED_PAGES`] pages wait):
/// its pages are planned again from what it delivered once the queue has room
/// (`SyncMachine::unpark_pages`). One query and its statistics, however many pages.
#[derive(Debug, Clone)]
struct Parked {
    /// Stands for its pages in its batch's outstanding set until they are queued.
    id: SubscriptionId,
    /// The batch its pages complete, if any.
    batch: Option<u64>,
    /// The query exactly as sent.
    filter: Filter,
    /// What it delivered before its EOSE.
    stats: PageStats,
}

impl Parked {
    /// One query for everything of it not read yet: the query up to the oldest second it
    /// delivered (inclusive).
    fn remainder(&self) -> Filter {
        match self.stats.oldest {
            Some(oldest) => self
                .filter
                .clone()
                .until(nostr::types::Timestamp::from_secs(oldest)),
            None => self.filter.clone(),
        }
    }
}

#[derive(Debug, Clone)]
struct SubInfo {
    purpose: SubPurpose,
    /// The filter exactly as sent (for paging).
    filter: std::sync::Arc<Filter>,
    /// What its events must also match, not sent ([`Command::Subscribe`]'s `scope`).
    scope: Option<std::sync::Arc<Filter>>,
}

impl SubInfo {
    /// A subscription whose events must match `filter` only.
    fn new(purpose: SubPurpose, filter: Filter) -> SubInfo {
        SubInfo {
            purpose,
            filter: filter.into(),
            scope: None,
        }
    }

    /// The query as one filter, to send again (a later page, a reopen, a resume): the filter
    /// as sent with its scope's tag values put back (the rare re-sent fetch is the query's
    /// full filter, which needs no scope).
    fn query(&self) -> std::sync::Arc<Filter> {
        match &self.scope {
            None => self.filter.clone(),
            Some(scope) => {
                let mut f = Filter::clone(&self.filter);
                f.generic_tags = scope.generic_tags.clone();
                f.into()
            }
        }
    }
}

#[derive(Debug, Default)]
struct Link {
    subs: HashMap<SubscriptionId, SubInfo>,
    /// Subscriptions still loading stored history (no EOSE yet); consolidation never
    /// closes these.
    loading: HashMap<SubscriptionId, Time>,
    health: Health,
    /// New items waiting for a consolidation (which waits for pending batches; at the
    /// latest at [`Timer::Consolidate`]).
    deferred: PendingItems,
    /// Subscriptions (not part of a batch) closed by the relay, to open again at a time
    /// (the earliest is [`Timer::Reopen`], or [`Timer::OwnReopen`] on the own relay).
    reopen: Vec<(Time, SubPurpose, Filter)>,
    /// CLOSED prefixes and NOTICE texts already logged at warn level for this relay.
    warned: HashSet<Warned>,
    /// Subscriptions waiting for room in the relay's subscription budget (in order).
    queue: VecDeque<(SubscriptionId, SubInfo)>,
    /// History queries whose follow-up pages wait for room in the queue (in order; at most
    /// [`batches::MAX_PARKED`]).
    parked: VecDeque<Parked>,
    /// Layer 2/3 queries of confirmed items that do not fit the budget as live
    /// subscriptions: re-run every poll interval with `since`, closed at EOSE.
    polled: Vec<Filter>,
    /// `since` of the next poll round (which starts at [`Timer::Poll`]).
    poll_since: Option<nostr::types::Timestamp>,
    /// A batch's subscriptions were closed at EOSE to make room: rebuild the live/polled
    /// sets once the relay is idle.
    rebuild_needed: bool,
    /// The earliest moment at which confirmed items of this relay lost their live
    /// subscription without a catch-up yet (a batch query closed at EOSE for room, a live
    /// subscription dropped from the queue): the next rebuild catches up from there.
    uncovered_since: Option<Time>,
    /// When the live set was last (re)built: live subscriptions of it still queued at the
    /// next rebuild have covered nothing since then.
    live_built_at: Option<Time>,
    /// The confirmed repositories and root events (counts) when a rebuild last left queries
    /// polled: a consolidation is tried again only once they changed (the estimate of
    /// `promote_polled` does not see filters split for the relay's message size).
    polled_at_counts: Option<(usize, usize)>,
    /// History queries interrupted by a disconnect, continued on a quick reconnect.
    resume: Vec<Filter>,
    /// More than [`MAX_RESUME`] queries were interrupted: the next connect is a fresh sync.
    resume_overflow: bool,
    /// Why the last connection failed or was lost.
    last_error: Option<String>,
    /// The `since` of the latest catch-up or poll round.
    catch_up_since: Option<nostr::types::Timestamp>,
    /// Batches failed, queries incomplete.
    failed_batches: u64,
    incomplete_queries: u64,
    /// History queries finished: EOSEs of loading queries and reconciliations done
    /// ([`RelaySyncStatus::history_queries_completed`]).
    history_queries_completed: u64,
    /// Ids the relay listed for a reconciled query and did not deliver when asked twice
    /// ([`RelaySyncStatus::ids_undelivered`]).
    ids_undelivered: u64,
    /// Of those, the ones since its last full sync ([`RelaySyncStatus::history_short`]).
    history_short: u64,
}

#[derive(Debug)]
struct SelfBatch {
    meanings: Vec<SelfEventMeaning>,
    started: Option<Time>,
}

/// Counters kept by the machine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncCounters {
    /// Batches confirmed (every subscription saw EOSE).
    pub batches_confirmed: u64,
    /// Batches failed (EOSE deadline, CLOSED, disconnect).
    pub batches_failed: u64,
    /// Pages of older history requested from capped relays.
    pub pages_requested: u64,
    /// Queries whose history a relay could not deliver completely.
    pub incomplete_queries: u64,
    /// Rate limits signalled by remote relays (CLOSED `rate-limited:` or NOTICE).
    pub rate_limited: u64,
    /// Queries (not part of a batch) sent again because no EOSE came before the deadline.
    pub queries_resent: u64,
    /// Relays not connected because `max_relays` was reached.
    pub relays_refused: u64,
    /// Whole selections the machine ran for a change of standing (refused or failing
    /// relays: at most one per `RESELECT_DELAY`) or a first root event while a cap binds;
    /// not those run inside `Plan::reselect_repos` for new announcements.
    pub selections: u64,
    /// Relays refused by the address policy, excluded for good (issue 20).
    pub relays_excluded: u64,
    /// Hosts (and ports) excluded whole after `MAX_REFUSALS_PER_HOST` refused URLs.
    pub hosts_excluded: u64,
    /// Pubkeys blocked after naming `MAX_REFUSALS_PER_PUBKEY` refused relays.
    pub pubkeys_blocked: u64,
    /// Subscriptions closed by a relay.
    pub closed_by_relay: u64,
    /// Events read by the self-subscription.
    pub self_events: u64,
    /// Self-subscription batches processed.
    pub self_batches: u64,
    /// Connect commands issued.
    pub connect_attempts: u64,
    /// Consolidations and live-set rebuilds run.
    pub consolidations: u64,
    /// Daily full resyncs run (one per relay each time, issue 11).
    pub daily_resyncs: u64,
    /// CLOSED `rate-limited:` from remote relays.
    pub closed_rate_limited: u64,
    /// CLOSED `auth-required:` from remote relays (reported after AUTH could not help).
    pub closed_auth_required: u64,
    /// CLOSED with any other reason (`restricted:`, `blocked:`, `error:`, …).
    pub closed_refused: u64,
    /// Rate-limit NOTICEs from remote relays.
    pub notices_rate_limit: u64,
    /// Other NOTICEs from remote relays.
    pub notices_other: u64,
    /// History queries continued after a quick reconnect.
    pub queries_resumed: u64,
    /// Relays named by announcements beyond the per-announcement cap, ignored.
    pub announcement_relays_dropped: u64,
    /// NIP-77 reconciliations completed.
    pub reconciliations: u64,
    /// Events asked for by `ids` because a reconciliation found the own relay lacks them.
    pub reconcile_ids_fetched: u64,
    /// Reconciliations that gave way to paged REQs, by [`FallbackReason::ALL`] order.
    pub reconcile_fallbacks: [u64; 8],
    /// NEG-MSG/NEG-ERR for no running negentropy session, dropped.
    pub neg_unknown: u64,
    /// NIP-77 detections sent beside the REQ path to relays not known either way.
    pub nip77_detections: u64,
    /// Reconciliations that sent their query as one REQ because the own relay holds
    /// nothing for it (a reconciliation would fetch everything by `ids`).
    pub reconcile_skipped_empty: u64,
    /// Ids a reconciliation's fetch asked for again because its first REQ ended without
    /// them (issue 33).
    pub fetch_ids_retried: u64,
    /// Forwarders lost (each made every relay read its history again; issue 36).
    pub forwarder_losses: u64,
    /// Ids a relay listed for a query and did not deliver when asked by id twice: the own
    /// relay may lack them (warned, and counted in the relay's incomplete queries).
    pub fetch_ids_undelivered: u64,
    /// Probes for a hidden cap: a short page of a relay publishing no limits asked once more
    /// with `until` (decision 0103).
    pub cap_probes: u64,
    /// Caps learnt from probes: relays (the own relay too) caught capping their answers
    /// below the assumed page size without publishing it.
    pub caps_learned: u64,
    /// Replies one generation below the deepest followed (`--reply-depth`): synced, their
    /// own replies not (sightings on the own relay).
    pub replies_beyond_depth: u64,
    /// Replies not followed because their root thread had `--thread-size` members.
    pub replies_thread_full: u64,
    /// Replies not followed because `--max-thread-ids` members were followed.
    pub replies_cap_reached: u64,
    /// Replies dropped from the set waiting for their parent (it was full); the own relay
    /// is read again for them.
    pub replies_waiting_dropped: u64,
    /// Extra reads of the own relay's events for replies whose parents came later.
    pub own_thread_rereads: u64,
}

/// Status of one remote relay, as the machine sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct RelaySyncStatus {
    /// Relay.
    pub url: RelayUrl,
    /// Connection status.
    pub connection_status: ConnectionStatus,
    /// Health.
    pub health: HealthState,
    /// Consecutive failures.
    pub failures: u32,
    /// Bootstrap relay.
    pub is_bootstrap: bool,
    /// Repositories the relay should carry.
    pub target_repos: usize,
    /// Root events the relay should carry.
    pub target_root_events: usize,
    /// Confirmed repositories.
    pub confirmed_repos: usize,
    /// Confirmed root events.
    pub confirmed_root_events: usize,
    /// Pending batches.
    pub pending_batches: usize,
    /// Repositories in pending batches.
    pub pending_repos: usize,
    /// Root events in pending batches.
    pub pending_root_events: usize,
    /// Open subscriptions.
    pub open_subscriptions: usize,
    /// Next reconnect attempt when disconnected.
    pub next_attempt: Option<Time>,
    /// When the current (or last) connection was established.
    pub last_connected: Option<Time>,
    /// Why the last connection failed or was lost (escaped, at most 200 characters).
    pub last_error: Option<String>,
    /// The `since` (seconds) of the relay's latest catch-up or poll round.
    pub catch_up_since: Option<u64>,
    /// Batches of this relay that failed.
    pub failed_batches: u64,
    /// Queries of this relay whose history could not be read completely.
    pub incomplete_queries: u64,
    /// Queries waiting for room in the relay's subscription budget.
    pub queued_queries: usize,
    /// Layer 2/3 queries polled because they do not fit the budget.
    pub polled_queries: usize,
    /// Queries sent and still waiting for their EOSE.
    pub loading_queries: usize,
    /// Queries the relay closed, waiting for their delay to be opened again.
    pub reopen_pending: usize,
    /// NIP-77 support as known (history reconciled unless `Unsupported`).
    pub nip77: Nip77Support,
    /// Reconciliations running or waiting on this relay.
    pub reconciliations_pending: usize,
    /// History queries not finished: sent without EOSE yet, waiting for room in the budget,
    /// closed by the relay and waiting to be opened again, waiting for room for their pages,
    /// and NIP-77 reconciliations (see [`crate::core::progress`]). Live-only REQs
    /// (`limit: 0`) carry no history and are not counted.
    pub history_queries_pending: usize,
    /// History queries finished since the relay became known: an EOSE of a query that was
    /// loading (not live-only), or a NIP-77 reconciliation done (a counter, for the
    /// completion rate).
    pub history_queries_completed: u64,
    /// Ids the relay listed for a reconciled query and did not deliver when asked by id
    /// twice since it became known (issue 33): its history as read is short by them.
    pub ids_undelivered: u64,
    /// Ids listed and not delivered since the relay's last full sync (a fresh sync or the
    /// daily resync clears it): while above 0 its history as read is short, and neither
    /// the relay nor the whole sync counts as settled.
    pub history_short: u64,
    /// When failed batches (or a rate limit) stop holding back the relay's next batches, if
    /// they do: its unconfirmed items wait until then without a query.
    pub batches_retry_at: Option<Time>,
    /// The cap it was caught applying to its answers without publishing it (decision
    /// 0103): pages of this many events are read as full.
    pub learned_cap: Option<usize>,
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
    /// Relays whose actions must be computed at the next planning although their target did
    /// not change (one refused at `max_relays` is tried again).
    replan: HashSet<RelayUrl>,
    /// Relays whose target only grew by these root events since the last planning: only
    /// they are diffed (the rest of the target is pending, confirmed, deferred or waits for
    /// the relay's own trigger).
    replan_roots: HashMap<RelayUrl, HashSet<EventId>>,
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
    /// Confirmed state per remote relay (the design's index; public read API).
    relays: RelaySyncIndex,
    /// In-flight batches per remote relay (the design's index; public read API).
    pending: PendingSyncIndex,
    /// Everything else about each remote relay: one entry per relay in `relays`.
    remotes: HashMap<RelayUrl, remote::RemoteRelay>,
    own: RelayState,
    own_link: Link,
    /// What the own relay's NIP-11 published (page size, subscription budget).
    own_nip11: remote::Nip11,
    /// What paging learnt about the own relay's cap (decision 0103).
    own_caps: crate::core::paging::CapWatch,
    /// NIP-11 limits reported for remote relays not known (yet, or any more: a retired
    /// thread's late report), taken when the relay is discovered; at most `max_relays`.
    unknown_nip11: HashMap<RelayUrl, remote::Nip11>,
    batch: SelfBatch,
    commands: VecDeque<Command>,
    next_sub: u64,
    next_batch: u64,
    /// Every deadline of the machine (issue 18): [`SyncMachine::poll_timeout`] is its
    /// earliest entry.
    timers: TimerTable,
    /// Remote relays whose derived timers ([`Timer::EoseDeadline`], [`Timer::Reopen`]) may
    /// no longer match their state: recomputed before a timer is read again
    /// ([`SyncMachine::refresh_timers`]).
    timers_stale: HashSet<RelayUrl>,
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
            repo_index: RepoSyncIndex::new(),
            plan: Plan::default(),
            replan: HashSet::new(),
            replan_roots: HashMap::new(),
            root_events_known: 0,
            threads: crate::core::threads::Threads::new(config.threads),
            own_rereads: 0,
            own_roots_read: false,
            relays: RelaySyncIndex::new(),
            pending: PendingSyncIndex::new(),
            remotes: HashMap::new(),
            own: RelayState::new(false),
            own_link: Link::default(),
            own_nip11: remote::Nip11::default(),
            own_caps: Default::default(),
            unknown_nip11: HashMap::new(),
            batch: SelfBatch {
                meanings: Vec::new(),
                started: None,
            },
            commands: VecDeque::new(),
            next_sub: 0,
            next_batch: 0,
            timers: TimerTable::default(),
            timers_stale: HashSet::new(),
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
        let mut fired = HashSet::new();
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
        for url in std::mem::take(&mut self.timers_stale) {
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

    /// Debug builds: every relay in `relays` has its [`remote::RemoteRelay`] and no other
    /// does, no timer names a relay not known, and the derived timers equal a fresh
    /// derivation (no change of their inputs went unmarked). Runs after every input.
    fn check_timers(&self) {
        #[cfg(debug_assertions)]
        {
            debug_assert!(self.timers_stale.is_empty(), "timers refreshed");
            debug_assert_eq!(
                self.relays.len(),
                self.remotes.len(),
                "one RemoteRelay each"
            );
            for url in self.remotes.keys() {
                debug_assert!(self.relays.contains_key(url), "{url}: RemoteRelay only");
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
            .pending
            .get(relay)
            .into_iter()
            .flatten()
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

    /// [`SyncMachine::handle_report`] without the timer refresh.
    fn dispatch_report(&mut self, report: Report, now: Time) {
        match report {
            Report::Connected { relay, generation } => {
                if relay == self.config.own_relay {
                    if generation == self.own.generation {
                        self.handle_own_connected(now);
                    }
                } else if self.is_current(&relay, generation) {
                    self.handle_connect_or_reconnect(&relay, now);
                }
            }
            Report::Disconnected {
                relay,
                generation,
                cause,
            } => {
                let reason = cause.to_string();
                if relay == self.config.own_relay {
                    if generation == self.own.generation {
                        self.handle_own_disconnected(&reason, now);
                    }
                } else if self.is_current(&relay, generation) {
                    self.handle_disconnect(&relay, &reason, now);
                }
            }
            Report::Eose {
                relay,
                generation,
                sub_id,
                stats,
            } => {
                if relay == self.config.own_relay {
                    if generation == self.own.generation {
                        self.handle_own_eose(&sub_id, &stats);
                    }
                } else if self.is_current(&relay, generation) {
                    self.handle_eose(&relay, &sub_id, &stats, now);
                }
            }
            Report::Limits { relay, limits } => self.set_limits(&relay, &limits),
            Report::Closed {
                relay,
                generation,
                sub_id,
                prefix,
                message,
            } => {
                if relay == self.config.own_relay {
                    if generation == self.own.generation {
                        self.handle_own_closed(&sub_id, prefix, &message, now);
                    }
                } else if self.is_current(&relay, generation) {
                    self.handle_closed(&relay, &sub_id, prefix, &message, now);
                }
            }
            Report::ForwardBackPressure { active } => self.handle_back_pressure(active, now),
            Report::ForwarderLost => self.handle_forwarder_lost(now),
            Report::RelayStalled {
                relay,
                generation,
                active,
            } => {
                if self.is_current(&relay, generation) {
                    self.handle_relay_stalled(&relay, active, now);
                }
            }
            Report::Notice {
                relay,
                generation,
                message,
            } => {
                if relay != self.config.own_relay && self.is_current(&relay, generation) {
                    self.detection_notice(&relay, &message);
                    self.neg_notice(&relay, &message);
                    self.handle_notice(&relay, &message, now);
                }
            }
            Report::OwnIds {
                generation,
                sub_id,
                stats,
                items,
                truncated,
            } => {
                if generation == self.own.generation {
                    self.handle_own_ids(&sub_id, &stats, items, truncated);
                }
            }
            Report::NegMsg {
                relay,
                generation,
                sub_id,
                message,
            } => {
                if self.is_detection(&relay, generation, &sub_id) {
                    self.detection_answered(&relay, &message);
                } else {
                    self.handle_neg_msg(&relay, generation, &sub_id, &message);
                }
            }
            Report::NegErr {
                relay,
                generation,
                sub_id,
                message,
                closed,
            } => {
                if self.is_detection(&relay, generation, &sub_id) {
                    self.detection_refused(&relay, &message, closed);
                } else {
                    self.handle_neg_err(&relay, generation, &sub_id, &message, closed);
                }
            }
            Report::SelfEvent { generation, event } => {
                if generation == self.own.generation {
                    self.push_self_event(&event, now);
                }
            }
            Report::Refused {
                relay,
                generation,
                reason,
            } => {
                if relay != self.config.own_relay && self.is_current(&relay, generation) {
                    self.on_refused(&relay, &reason.to_string(), now);
                    self.forget_relay(&relay);
                }
            }
        }
    }

    /// True when `generation` is the current connection of remote `relay`.
    fn is_current(&self, relay: &RelayUrl, generation: u64) -> bool {
        self.relays
            .get(relay)
            .is_some_and(|s| s.generation == generation)
    }

    fn new_sub_id(&mut self) -> SubscriptionId {
        self.next_sub += 1;
        SubscriptionId::new(format!("gs{}", self.next_sub))
    }

    // ----- own relay (self-subscription) -----

    // ----- remote relays -----

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
        if let Some(link) = self.link_mut(relay) {
            link.forget_subscriptions();
        }
        self.timers.cancel(&Timer::Consolidate(relay.clone()));
        self.timers.cancel(&Timer::Poll(relay.clone()));
    }

    // ----- read access -----

    /// The repository index (what we want).
    pub fn repo_index(&self) -> &RepoSyncIndex {
        &self.repo_index
    }

    /// Confirmed state per relay.
    pub fn relay_index(&self) -> &RelaySyncIndex {
        &self.relays
    }

    /// In-flight batches per relay.
    pub fn pending_index(&self) -> &PendingSyncIndex {
        &self.pending
    }

    /// Open subscriptions per relay and purpose.
    pub fn subscriptions(&self, relay: &RelayUrl) -> Vec<(SubscriptionId, SubPurpose)> {
        let mut v: Vec<_> = self
            .link_of(relay)
            .map(|l| l.subs.iter().map(|(s, i)| (s.clone(), i.purpose)).collect())
            .unwrap_or_default();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// True while the self-subscription is still reading stored history (or pages of it),
    /// or read events wait in the batch window: the repository index is not final yet.
    pub fn self_sync_pending(&self) -> bool {
        self.batch.started.is_some()
            || !self.own_link.loading.is_empty()
            || !self.own_link.queue.is_empty()
    }

    /// Subscriptions open on the own relay (the self-subscription and its pages).
    pub fn own_open_subscriptions(&self) -> usize {
        self.own_link.subs.len()
    }

    /// Status of the own relay's self-subscription connection.
    pub fn own_status(&self) -> ConnectionStatus {
        self.own.connection_status
    }

    /// Relays whose last connect failed (within `FAILING_TTL`): behind the others for the
    /// global cap.
    #[must_use]
    pub fn relays_failing(&self) -> usize {
        self.standing.failing.len()
    }

    /// Hosts (`host:port`) with more than one selected URL and how many, most first
    /// (issue 20: `max_urls_per_host` bounds them).
    #[must_use]
    pub fn hosts_with_several_urls(&self) -> Vec<(String, usize)> {
        self.plan.hosts_with_several_urls()
    }

    /// What the repository scope and the relay quotas left out at the last planning.
    pub fn target_report(&self) -> TargetReport {
        self.plan.report()
    }

    /// Counters.
    pub fn counters(&self) -> SyncCounters {
        let t = self.threads.counters();
        SyncCounters {
            replies_beyond_depth: t.beyond_depth,
            replies_thread_full: t.thread_full,
            replies_cap_reached: t.cap_reached,
            replies_waiting_dropped: t.waiting_dropped,
            ..self.counters
        }
    }

    /// Events followed below the root events (thread members): each is a Layer-3 id of its
    /// root's repositories.
    pub fn thread_event_count(&self) -> usize {
        self.threads.len()
    }

    /// The reply-chain index (which events are followed below which roots).
    pub fn threads(&self) -> &crate::core::threads::Threads {
        &self.threads
    }

    /// Total root events known (distinct ids). A counter kept as root events are linked:
    /// no walk over the index (status reads hold the machine's lock).
    pub fn root_event_count(&self) -> usize {
        self.root_events_known
    }

    /// Each known relay's history queries completed (a counter; see
    /// [`RelaySyncStatus::history_queries_completed`]), cheaper than [`Self::relay_statuses`].
    pub fn history_queries_completed(&self) -> impl Iterator<Item = (&RelayUrl, u64)> + '_ {
        self.relays.keys().map(|url| {
            (
                url,
                self.link_of(url).map_or(0, |l| l.history_queries_completed),
            )
        })
    }

    /// A status line per remote relay, sorted by URL.
    pub fn relay_statuses(&self, now: Time) -> Vec<RelaySyncStatus> {
        let targets = self.plan.targets();
        let sorted: BTreeMap<&RelayUrl, &RelayState> = self.relays.iter().collect();
        sorted
            .into_iter()
            .map(|(url, s)| {
                let link = self.link_of(url);
                let pending = self.pending.get(url).map(|v| v.as_slice()).unwrap_or(&[]);
                let target = targets.get(url);
                RelaySyncStatus {
                    url: url.clone(),
                    connection_status: s.connection_status,
                    health: link.map_or(HealthState::Healthy, |l| {
                        l.health.state(now, &self.config.backoff)
                    }),
                    failures: link.map_or(0, |l| l.health.failures()),
                    is_bootstrap: s.is_bootstrap,
                    target_repos: target.map_or(0, |t| t.repos.len()),
                    target_root_events: target.map_or(0, |t| t.root_events.len()),
                    confirmed_repos: s.repos.len(),
                    confirmed_root_events: s.root_events.len(),
                    pending_batches: pending.len(),
                    pending_repos: pending.iter().map(|b| b.items.repos.len()).sum(),
                    pending_root_events: pending.iter().map(|b| b.items.root_events.len()).sum(),
                    open_subscriptions: link.map_or(0, |l| l.subs.len()),
                    next_attempt: self.timers.get(&Timer::Reconnect(url.clone())),
                    last_connected: s.last_connected,
                    last_error: link.and_then(|l| l.last_error.clone()),
                    catch_up_since: link.and_then(|l| l.catch_up_since).map(|t| t.as_secs()),
                    failed_batches: link.map_or(0, |l| l.failed_batches),
                    incomplete_queries: link.map_or(0, |l| l.incomplete_queries),
                    queued_queries: link.map_or(0, |l| l.queue.len()),
                    polled_queries: link.map_or(0, |l| l.polled.len()),
                    loading_queries: link.map_or(0, |l| l.loading.len()),
                    reopen_pending: link.map_or(0, |l| l.reopen.len()),
                    nip77: self.nip77_support(url),
                    reconciliations_pending: self.recon.jobs_of(url),
                    history_queries_pending: link.map_or(0, Link::history_queries_pending)
                        + self.recon.jobs_of(url),
                    history_queries_completed: link.map_or(0, |l| l.history_queries_completed),
                    ids_undelivered: link.map_or(0, |l| l.ids_undelivered),
                    history_short: link.map_or(0, |l| l.history_short),
                    batches_retry_at: self.timers.get(&Timer::RetryBatches(url.clone())),
                    learned_cap: self.remotes.get(url).and_then(|r| r.caps.learned_cap),
                }
            })
            .collect()
    }
}
