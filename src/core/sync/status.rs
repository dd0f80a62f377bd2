//! What the machine shows: its counters ([`SyncCounters`]), each remote relay
//! ([`RelayView`] from [`SyncMachine::relays`] and [`SyncMachine::relay`]) and its status
//! ([`RelaySyncStatus`], [`SyncMachine::relay_statuses`]), and the other read access that
//! the engine's metrics, status page and state file use.

use std::fmt;

use nostr::message::SubscriptionId;

use crate::core::health::HealthState;
use crate::core::state::{ConnectionStatus, PendingBatch, RelayState, RepoSyncIndex};
use crate::core::targets::TargetReport;
use crate::core::time::Time;
use crate::shared::RelayUrl;

use super::remote::RemoteRelay;
use super::timers::Timer;
use super::{LinkError, Nip77Support, SubPurpose, SyncMachine};

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
    /// Remote relays that refused a REQ of several filters and get one filter per REQ
    /// since (decision 0110).
    pub multi_filter_refusals: u64,
    /// Live chunks sent again with the values of newly confirmed items (the incremental
    /// live set, decision 0110), instead of a rebuild of the whole live set.
    pub live_chunks_resent: u64,
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
    /// Reconciliations that gave way to paged REQs, by [`FallbackReason::ALL`](super::FallbackReason::ALL) order.
    pub reconcile_fallbacks: [u64; 8],
    /// NEG-MSG/NEG-ERR for no running negentropy session, dropped.
    pub neg_unknown: u64,
    /// NIP-77 detections sent beside the REQ path to relays not known either way.
    pub nip77_detections: u64,
    /// Reconciliations that sent their query as one REQ because the own relay holds
    /// nothing for it (a reconciliation would fetch everything by `ids`).
    pub reconcile_skipped_empty: u64,
    /// History queries sent as one REQ without reading the own relay's side first: no event
    /// the self-subscription read from it tags any of their values (decision 0120).
    pub own_reads_skipped: u64,
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
    /// Why the last connection failed or was lost (its [`fmt::Display`] is the text: the
    /// cause escaped, at most 200 characters of it).
    pub last_error: Option<LinkError>,
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

impl SyncMachine {
    /// The repository index (what we want).
    pub fn repo_index(&self) -> &RepoSyncIndex {
        &self.repo_index
    }

    /// Every remote relay known, in no particular order ([`Self::relay_statuses`] sorts
    /// them by URL).
    pub fn relays(&self) -> impl ExactSizeIterator<Item = RelayView<'_>> + '_ {
        self.remotes.iter().map(|(url, relay)| RelayView {
            machine: self,
            url,
            relay,
        })
    }

    /// Remote relay `url`, if known.
    pub fn relay(&self, url: &RelayUrl) -> Option<RelayView<'_>> {
        let (url, relay) = self.remotes.get_key_value(url)?;
        Some(RelayView {
            machine: self,
            url,
            relay,
        })
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

    /// A status line per remote relay, sorted by URL.
    pub fn relay_statuses(&self, now: Time) -> Vec<RelaySyncStatus> {
        let mut relays: Vec<RelayView<'_>> = self.relays().collect();
        relays.sort_unstable_by(|a, b| a.url.cmp(b.url));
        relays.into_iter().map(|r| r.status(now)).collect()
    }
}

/// One remote relay as the machine knows it, read-only: the design's confirmed state
/// ([`RelayState`]) and pending batches, and its status. From [`SyncMachine::relays`] and
/// [`SyncMachine::relay`]; it borrows the machine.
#[derive(Clone, Copy)]
pub struct RelayView<'a> {
    machine: &'a SyncMachine,
    url: &'a RelayUrl,
    relay: &'a RemoteRelay,
}

impl fmt::Debug for RelayView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayView")
            .field("url", self.url)
            .field("state", &self.relay.state)
            .field("pending", &self.relay.pending)
            .finish_non_exhaustive()
    }
}

impl<'a> RelayView<'a> {
    /// The relay.
    #[must_use]
    pub fn url(&self) -> &'a RelayUrl {
        self.url
    }

    /// Its confirmed state and connection lifecycle (the design's `RelaySyncIndex` entry).
    #[must_use]
    pub fn state(&self) -> &'a RelayState {
        &self.relay.state
    }

    /// Its batches in flight, oldest first (the design's `PendingSyncIndex` entry; empty
    /// when none).
    #[must_use]
    pub fn pending(&self) -> &'a [PendingBatch] {
        &self.relay.pending
    }

    /// Its history queries completed since it became known (a counter; see
    /// [`RelaySyncStatus::history_queries_completed`]), cheaper than [`Self::status`].
    #[must_use]
    pub fn history_queries_completed(&self) -> u64 {
        self.relay.link.history_queries_completed
    }

    /// Its status line at `now`.
    #[must_use]
    pub fn status(&self, now: Time) -> RelaySyncStatus {
        let m = self.machine;
        let url = self.url;
        let s = &self.relay.state;
        let link = &self.relay.link;
        let pending = &self.relay.pending;
        let target = m.plan.targets().get(url);
        RelaySyncStatus {
            url: url.clone(),
            connection_status: s.connection_status,
            health: link.health.state(now, &m.config.backoff),
            failures: link.health.failures(),
            is_bootstrap: s.is_bootstrap,
            target_repos: target.map_or(0, |t| t.repos.len()),
            target_root_events: target.map_or(0, |t| t.root_events.len()),
            confirmed_repos: s.repos.len(),
            confirmed_root_events: s.root_events.len(),
            pending_batches: pending.len(),
            pending_repos: pending.iter().map(|b| b.items.repos.len()).sum(),
            pending_root_events: pending.iter().map(|b| b.items.root_events.len()).sum(),
            open_subscriptions: link.open_reqs(),
            next_attempt: m.timers.get(&Timer::Reconnect(url.clone())),
            last_connected: s.last_connected,
            last_error: link.last_error.clone(),
            catch_up_since: link.catch_up_since.map(|t| t.as_secs()),
            failed_batches: link.failed_batches,
            incomplete_queries: link.incomplete_queries,
            queued_queries: link.queue.len(),
            polled_queries: link.polled.len(),
            loading_queries: link.loading.len(),
            reopen_pending: link.reopen.len(),
            nip77: m.nip77_support(url),
            reconciliations_pending: m.recon.jobs_of(url),
            history_queries_pending: link.history_queries_pending() + m.recon.jobs_of(url),
            history_queries_completed: link.history_queries_completed,
            ids_undelivered: link.ids_undelivered,
            history_short: link.history_short,
            batches_retry_at: m.timers.get(&Timer::RetryBatches(url.clone())),
            learned_cap: self.relay.caps.learned_cap,
        }
    }
}
