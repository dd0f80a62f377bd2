//! The sync logic's settings ([`SyncConfig`]) and the target selection they make
//! ([`machine_targets`], [`machine_policy`]).

use crate::core::hash::HashSet;
use std::time::Duration;

use crate::core::health::BackoffPolicy;
use crate::core::relay_text::RATE_LIMIT_COOLDOWN;
use crate::core::state::RepoSyncIndex;
use crate::core::targets::{derive_targets, Exclusions, TargetPolicy, Targets};
use crate::shared::RelayUrl;

use super::Nip77Config;

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
    /// The most filters in one REQ to a remote relay (decision 0110; default
    /// [`super::MAX_FILTERS_PER_REQ`], 10); 1 sends every query as its own REQ and grows no
    /// live chunk in place (the design's behaviour, decision 0008).
    pub max_filters_per_req: usize,
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
            max_filters_per_req: super::MAX_FILTERS_PER_REQ,
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
        failing: HashSet::default(),
        blocked_pubkeys: HashSet::default(),
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
