//! [`SyncMachine`]: the coordinator's brain, sans-IO.
//!
//! It owns the design's three indexes and decides everything: which relays to connect, what
//! to subscribe with which `since`, when a batch is confirmed or failed, when to retry. It
//! takes [`Report`]s from the connection threads plus `now`, and queues [`Command`]s that the
//! engine carries out. It never blocks and never reads a clock, so a test can drive it
//! through hours of simulated time.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use log::{debug, info, warn};
use nostr::event::{Event, EventId};
use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::actions::{compute_actions, derive_relay_targets, AddFilters};
use crate::core::complaints::{
    classify_closed, classify_notice, closed_prefix, ClosedReason, NoticeKind, RATE_LIMIT_COOLDOWN,
};
use crate::core::filters::{
    build_announcement_filter, build_layer2_and_layer3_filters, self_subscription_filter,
};
use crate::core::health::{BackoffPolicy, Health, HealthState, Jitter};
use crate::core::nip34::{classify_self_event, SelfEventMeaning};
use crate::core::paging::{plan_pages, PageLimits, PageStats};
use crate::core::state::{
    ConnectionStatus, PendingBatch, PendingItems, PendingSyncIndex, RelayState, RelaySyncIndex,
    RelaySyncNeeds, RepoSyncIndex,
};
use crate::core::time::Time;
use crate::net::nip11::RelayLimits;
use crate::net::url::RelayUrl;

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
    pub max_batch_events: usize,
    /// Quick-reconnect window and `since` margin (design: 15 min).
    pub quick_reconnect_window: Duration,
    /// A batch whose subscriptions have not all seen EOSE after this long fails.
    pub eose_timeout: Duration,
    /// Interval of the idle-relay check (design: 60 s).
    pub disconnect_check_interval: Duration,
    /// Reconnect backoff and health thresholds.
    pub backoff: BackoffPolicy,
    /// Open subscriptions per relay above which `handle_add_filters` consolidates
    /// (design: 70).
    pub consolidation_threshold: usize,
    /// How long a consolidation waits for the relay's pending batches (design: 30 s).
    pub consolidation_wait: Duration,
    /// Shortest delay of the daily full resync (design: 23 h).
    pub daily_min: Duration,
    /// Longest delay of the daily full resync (design: 25 h).
    pub daily_max: Duration,
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
}

impl SyncConfig {
    /// Defaults from the design document for `own_relay`.
    pub fn new(own_relay: RelayUrl) -> SyncConfig {
        SyncConfig {
            own_relay,
            own_aliases: Vec::new(),
            bootstrap: Vec::new(),
            batch_window: Duration::from_secs(5),
            max_batch_events: 50_000,
            quick_reconnect_window: Duration::from_secs(15 * 60),
            eose_timeout: Duration::from_secs(120),
            disconnect_check_interval: Duration::from_secs(60),
            backoff: BackoffPolicy::default(),
            consolidation_threshold: 70,
            consolidation_wait: Duration::from_secs(30),
            daily_min: Duration::from_secs(23 * 3600),
            daily_max: Duration::from_secs(25 * 3600),
            assumed_page_size: 20,
            default_subscription_budget: 20,
            poll_interval: Duration::from_secs(60),
            rate_limit_cooldown: RATE_LIMIT_COOLDOWN,
            refused_retry: Duration::from_secs(600),
            seed: 1,
        }
    }
}

/// What a connection thread reports.
#[derive(Debug, Clone)]
pub enum Report {
    /// The websocket is open.
    Connected {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the `Connect` this answers.
        generation: u64,
    },
    /// The connect attempt failed, or an open connection was lost.
    Disconnected {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// What went wrong, for the log.
        reason: String,
    },
    /// End of stored events for a subscription.
    Eose {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// The subscription.
        sub_id: SubscriptionId,
        /// What it delivered before EOSE (accepted or not).
        stats: PageStats,
    },
    /// What a relay publishes about its limits (NIP-11).
    Limits {
        /// Relay (the own relay too).
        relay: RelayUrl,
        /// The `limitation` values it published.
        limits: RelayLimits,
    },
    /// The relay closed a subscription.
    Closed {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// The subscription.
        sub_id: SubscriptionId,
        /// The relay's reason.
        message: String,
    },
    /// A NOTICE from a relay.
    Notice {
        /// Relay.
        relay: RelayUrl,
        /// Generation of the connection.
        generation: u64,
        /// The text.
        message: String,
    },
    /// A checked event read by the self-subscription on the own relay.
    SelfEvent {
        /// Generation of the own relay connection.
        generation: u64,
        /// The event.
        event: Box<Event>,
    },
}

/// What the engine must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Open a connection (spawning the relay's thread if it has none).
    Connect {
        /// Relay (the own relay for the self-subscription).
        relay: RelayUrl,
        /// Generation to tag every report of this connection with.
        generation: u64,
    },
    /// Send `["REQ", sub_id, filter]` on the connection of this generation.
    Subscribe {
        /// Relay.
        relay: RelayUrl,
        /// Connection generation; a thread drops commands of another generation.
        generation: u64,
        /// Subscription id.
        sub_id: SubscriptionId,
        /// The one filter of this REQ.
        filter: Filter,
    },
    /// Send `["CLOSE", sub_id]`.
    Unsubscribe {
        /// Relay.
        relay: RelayUrl,
        /// Connection generation.
        generation: u64,
        /// Subscription id.
        sub_id: SubscriptionId,
    },
    /// Close the connection and end the relay's thread: the relay is no longer needed.
    Forget {
        /// Relay.
        relay: RelayUrl,
    },
    /// The repository index changed: the forwarder may retry events the own relay rejected.
    RetryRejected,
}

/// What a subscription is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubPurpose {
    /// Layer 1 (announcements), once per connection.
    Announcements,
    /// Layer 2/3 for a pending batch.
    Batch(u64),
    /// Layer 2/3 catch-up for confirmed items after a reconnect or consolidation.
    CatchUp,
    /// The self-subscription on the own relay.
    SelfSubscription,
    /// A page of older history, closed at EOSE; part of a batch when `batch` is set.
    Page {
        /// The batch the page completes, if any.
        batch: Option<u64>,
    },
}

#[derive(Debug, Clone)]
struct SubInfo {
    purpose: SubPurpose,
    /// The filter exactly as sent (for paging).
    filter: Filter,
}

#[derive(Debug, Default)]
struct Link {
    subs: HashMap<SubscriptionId, SubInfo>,
    /// Subscriptions still loading stored history (no EOSE yet); consolidation never
    /// closes these.
    loading: HashSet<SubscriptionId>,
    health: Health,
    next_attempt: Option<Time>,
    /// Batches failed: compute_actions leaves the relay alone until then.
    retry_after: Option<Time>,
    /// New items waiting for a consolidation (which waits for pending batches).
    deferred: PendingItems,
    /// Consolidate at this time at the latest, pending batches or not.
    consolidate_by: Option<Time>,
    /// Subscriptions (not part of a batch) closed by the relay, to open again at a time.
    reopen: Vec<(Time, SubPurpose, Filter)>,
    /// CLOSED prefixes and NOTICE texts already logged at warn level for this relay.
    warned: HashSet<String>,
    /// Subscriptions waiting for room in the relay's subscription budget (in order).
    queue: VecDeque<(SubscriptionId, SubInfo)>,
    /// Layer 2/3 queries of confirmed items that do not fit the budget as live
    /// subscriptions: re-run every poll interval with `since`, closed at EOSE.
    polled: Vec<Filter>,
    /// `since` of the next poll round.
    poll_since: Option<nostr::types::Timestamp>,
    /// When the next poll round starts.
    next_poll: Option<Time>,
    /// A batch's subscriptions were closed at EOSE to make room: rebuild the live/polled
    /// sets once the relay is idle.
    rebuild_needed: bool,
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
    /// Subscriptions closed by a relay.
    pub closed_by_relay: u64,
    /// Events read by the self-subscription.
    pub self_events: u64,
    /// Self-subscription batches processed.
    pub self_batches: u64,
    /// Connect commands issued.
    pub connect_attempts: u64,
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
}

/// The pure sync state machine. See the module documentation.
#[derive(Debug)]
pub struct SyncMachine {
    config: SyncConfig,
    excluded: Vec<RelayUrl>,
    repo_index: RepoSyncIndex,
    relays: RelaySyncIndex,
    pending: PendingSyncIndex,
    links: HashMap<RelayUrl, Link>,
    limits: HashMap<RelayUrl, PageLimits>,
    budgets: HashMap<RelayUrl, usize>,
    max_message: HashMap<RelayUrl, usize>,
    own: RelayState,
    own_link: Link,
    batch: SelfBatch,
    commands: VecDeque<Command>,
    next_sub: u64,
    next_batch: u64,
    next_disconnect_check: Option<Time>,
    next_daily: Option<Time>,
    jitter: Jitter,
    counters: SyncCounters,
    started: bool,
}

impl SyncMachine {
    /// A machine with nothing known yet. Call [`SyncMachine::start`] next.
    pub fn new(config: SyncConfig) -> SyncMachine {
        let mut excluded = vec![config.own_relay.clone()];
        for a in &config.own_aliases {
            if !excluded.contains(a) {
                excluded.push(a.clone());
            }
        }
        let jitter = Jitter::new(config.seed);
        SyncMachine {
            excluded,
            repo_index: RepoSyncIndex::new(),
            relays: RelaySyncIndex::new(),
            pending: PendingSyncIndex::new(),
            links: HashMap::new(),
            limits: HashMap::new(),
            budgets: HashMap::new(),
            max_message: HashMap::new(),
            own: RelayState::new(false),
            own_link: Link::default(),
            batch: SelfBatch {
                meanings: Vec::new(),
                started: None,
            },
            commands: VecDeque::new(),
            next_sub: 0,
            next_batch: 0,
            next_disconnect_check: None,
            next_daily: None,
            jitter,
            counters: SyncCounters::default(),
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
            let mut s = RelayState::new(true);
            s.connection_status = ConnectionStatus::Disconnected;
            self.relays.insert(b.clone(), s);
            self.links.insert(b.clone(), Link::default());
            self.connect_remote(&b, now);
        }
        self.next_disconnect_check = Some(now.plus(self.config.disconnect_check_interval));
        self.schedule_daily(now);
    }

    fn schedule_daily(&mut self, now: Time) {
        let (lo, hi) = (
            self.config.daily_min,
            self.config.daily_max.max(self.config.daily_min),
        );
        let delay = lo + (hi - lo).mul_f64(self.jitter.unit());
        self.next_daily = Some(now.plus(delay));
        debug!("next daily resync in {:.1} h", delay.as_secs_f64() / 3600.0);
    }

    /// The next command to carry out.
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// The earliest time at which [`SyncMachine::handle_timeout`] has work.
    pub fn poll_timeout(&self) -> Option<Time> {
        let mut t: Option<Time> = None;
        let mut consider = |x: Option<Time>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        consider(self.batch.started.map(|s| s.plus(self.config.batch_window)));
        consider(self.next_disconnect_check);
        consider(self.next_daily);
        consider(self.own_link.next_attempt);
        for (url, link) in &self.links {
            consider(link.next_attempt);
            consider(link.retry_after);
            consider(link.consolidate_by);
            consider(link.reopen.iter().map(|r| r.0).min());
            consider(link.next_poll);
            if let Some(batches) = self.pending.get(url) {
                consider(
                    batches
                        .iter()
                        .map(|b| b.started_at.plus(self.config.eose_timeout))
                        .min(),
                );
            }
        }
        t
    }

    /// Runs every timer that is due at `now`.
    pub fn handle_timeout(&mut self, now: Time) {
        if let Some(s) = self.batch.started {
            if now >= s.plus(self.config.batch_window) {
                self.process_batch(now);
            }
        }
        if self.own_link.next_attempt.is_some_and(|t| t <= now) {
            self.own_link.next_attempt = None;
            self.connect_own(now);
        }
        let due: Vec<RelayUrl> = self
            .links
            .iter()
            .filter(|(_, l)| l.next_attempt.is_some_and(|t| t <= now))
            .map(|(u, _)| u.clone())
            .collect();
        for url in due {
            if let Some(l) = self.links.get_mut(&url) {
                l.next_attempt = None;
            }
            self.connect_remote(&url, now);
        }
        self.expire_batches(now);
        let retry: Vec<RelayUrl> = self
            .links
            .iter()
            .filter(|(_, l)| l.retry_after.is_some_and(|t| t <= now))
            .map(|(u, _)| u.clone())
            .collect();
        for url in retry {
            if let Some(l) = self.links.get_mut(&url) {
                l.retry_after = None;
            }
            self.recompute_actions_for_relay(&url, now);
        }
        let reopen: Vec<(RelayUrl, SubPurpose, Filter)> = self
            .links
            .iter_mut()
            .flat_map(|(u, l)| {
                let (due, later): (Vec<_>, Vec<_>) = l.reopen.drain(..).partition(|r| r.0 <= now);
                l.reopen = later;
                due.into_iter().map(move |r| (u.clone(), r.1, r.2))
            })
            .collect();
        for (url, purpose, filter) in reopen {
            if let Some(state) = self.relays.get(&url) {
                if state.connection_status == ConnectionStatus::Connected {
                    let generation = state.generation;
                    info!("{url}: subscribing again to the {purpose:?} query it closed");
                    self.open_sub(&url, generation, purpose, filter);
                }
            }
        }
        let polls: Vec<RelayUrl> = self
            .links
            .iter()
            .filter(|(_, l)| l.next_poll.is_some_and(|t| t <= now))
            .map(|(u, _)| u.clone())
            .collect();
        for url in polls {
            self.poll_round(&url, now);
        }
        let consolidate: Vec<RelayUrl> = self
            .links
            .iter()
            .filter(|(_, l)| l.consolidate_by.is_some_and(|t| t <= now))
            .map(|(u, _)| u.clone())
            .collect();
        for url in consolidate {
            self.run_deferred(&url, now);
        }
        if self.next_daily.is_some_and(|t| t <= now) {
            self.daily_resync(now);
            self.schedule_daily(now);
        }
        if self.next_disconnect_check.is_some_and(|t| t <= now) {
            self.next_disconnect_check = Some(now.plus(self.config.disconnect_check_interval));
            self.check_disconnects(now);
        }
    }

    /// Feeds one report from a connection thread.
    pub fn handle_report(&mut self, report: Report, now: Time) {
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
                reason,
            } => {
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
            Report::Limits { relay, limits } => {
                let page = PageLimits {
                    page_size: limits.page_size(self.config.assumed_page_size).max(1),
                    max_limit: limits.max_limit,
                };
                info!(
                    "{relay}: NIP-11 limits: page size {} (max_limit {:?}, default_limit {:?}, max_subscriptions {:?})",
                    page.page_size, limits.max_limit, limits.default_limit, limits.max_subscriptions
                );
                if let Some(max) = limits.max_subscriptions {
                    self.budgets.insert(relay.clone(), max.max(2));
                }
                if let Some(max) = limits.max_message_length {
                    self.max_message.insert(relay.clone(), max);
                }
                self.limits.insert(relay, page);
            }
            Report::Closed {
                relay,
                generation,
                sub_id,
                message,
            } => {
                if relay == self.config.own_relay {
                    if generation == self.own.generation {
                        self.handle_own_closed(&message, now);
                    }
                } else if self.is_current(&relay, generation) {
                    self.handle_closed(&relay, &sub_id, &message, now);
                }
            }
            Report::Notice {
                relay,
                generation,
                message,
            } => {
                if relay != self.config.own_relay && self.is_current(&relay, generation) {
                    self.handle_notice(&relay, &message, now);
                }
            }
            Report::SelfEvent { generation, event } => {
                if generation == self.own.generation {
                    self.push_self_event(&event, now);
                }
            }
        }
    }

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

    fn connect_own(&mut self, _now: Time) {
        self.own.generation += 1;
        self.own.connection_status = ConnectionStatus::Connecting;
        self.counters.connect_attempts += 1;
        self.commands.push_back(Command::Connect {
            relay: self.config.own_relay.clone(),
            generation: self.own.generation,
        });
    }

    fn handle_own_connected(&mut self, now: Time) {
        let since = self
            .own
            .last_connected
            .map(|t| t.minus(self.config.quick_reconnect_window).timestamp());
        self.own.connection_status = ConnectionStatus::Connected;
        self.own.last_connected = Some(now);
        self.own.disconnected_at = None;
        self.own_link.health.record_success(now);
        self.own_link.subs.clear();
        info!(
            "own relay {} connected; self-subscribing{}",
            self.config.own_relay,
            since.map_or(String::from(" (full history)"), |s| format!(
                " since {}",
                s.as_secs()
            ))
        );
        self.open_own_sub(
            SubPurpose::SelfSubscription,
            self_subscription_filter(since),
        );
    }

    fn open_own_sub(&mut self, purpose: SubPurpose, filter: Filter) {
        let sub_id = self.new_sub_id();
        self.own_link.subs.insert(
            sub_id.clone(),
            SubInfo {
                purpose,
                filter: filter.clone(),
            },
        );
        self.commands.push_back(Command::Subscribe {
            relay: self.config.own_relay.clone(),
            generation: self.own.generation,
            sub_id,
            filter,
        });
    }

    fn page_limits(&self, relay: &RelayUrl) -> PageLimits {
        self.limits
            .get(relay)
            .copied()
            .unwrap_or_else(|| PageLimits::assumed(self.config.assumed_page_size))
    }

    /// EOSE of the self-subscription or one of its pages: page back through a capped own
    /// relay exactly like a remote one, so every announcement and root event is read.
    fn handle_own_eose(&mut self, sub_id: &SubscriptionId, stats: &PageStats) {
        let Some(info) = self.own_link.subs.get(sub_id).cloned() else {
            return;
        };
        let own = self.config.own_relay.clone();
        let plan = plan_pages(&info.filter, stats, &self.page_limits(&own));
        if let SubPurpose::Page { .. } = info.purpose {
            self.own_link.subs.remove(sub_id);
            self.commands.push_back(Command::Unsubscribe {
                relay: own.clone(),
                generation: self.own.generation,
                sub_id: sub_id.clone(),
            });
        } else {
            info!(
                "self-subscription: stored history read ({} events{})",
                stats.received,
                if plan.next.is_empty() {
                    ""
                } else {
                    "; paging for older ones"
                }
            );
        }
        if plan.partial_split {
            info!("own relay {own}: a burst in one second is split by the kinds/authors seen");
        }
        if let Some(why) = plan.incomplete {
            self.counters.incomplete_queries += 1;
            warn!("own relay {own}: self-subscription history incomplete: {why}");
        }
        for f in plan.next {
            self.counters.pages_requested += 1;
            self.open_own_sub(SubPurpose::Page { batch: None }, f);
        }
    }

    fn handle_own_disconnected(&mut self, reason: &str, now: Time) {
        if self.own.connection_status == ConnectionStatus::Connected {
            self.own.disconnected_at = Some(now);
        }
        self.own.connection_status = ConnectionStatus::Disconnected;
        self.own_link.subs.clear();
        self.own_link
            .health
            .record_failure(now, &self.config.backoff);
        let at = self
            .own_link
            .health
            .next_attempt(now, &self.config.backoff, self.jitter.unit());
        warn!(
            "own relay {} unavailable ({reason}); retrying in {:.1}s",
            self.config.own_relay,
            at.since(now).as_secs_f64()
        );
        self.own_link.next_attempt = Some(at);
    }

    fn handle_own_closed(&mut self, message: &str, now: Time) {
        warn!("own relay closed the self-subscription ({message:?}); reconnecting after backoff");
        // The next Connect (new generation) replaces the connection.
        self.handle_own_disconnected(&format!("CLOSED {message:?}"), now);
    }

    fn push_self_event(&mut self, event: &Event, now: Time) {
        self.counters.self_events += 1;
        let meaning = classify_self_event(event);
        if meaning == SelfEventMeaning::Other {
            debug!(
                "self-subscription: ignoring event {} of kind {}",
                event.id, event.kind
            );
            return;
        }
        self.batch.meanings.push(meaning);
        if self.batch.started.is_none() {
            self.batch.started = Some(now);
        }
        if self.batch.meanings.len() >= self.config.max_batch_events {
            self.process_batch(now);
        }
    }

    /// Applies the self-subscription batch to the repository index and runs compute_actions.
    fn process_batch(&mut self, now: Time) {
        let meanings = std::mem::take(&mut self.batch.meanings);
        self.batch.started = None;
        self.counters.self_batches += 1;
        let mut announcements = 0usize;
        let mut roots = 0usize;
        for m in meanings {
            match m {
                SelfEventMeaning::Announcement(a) => {
                    let needs = self.repo_index.entry(a.repo_ref.clone()).or_default();
                    if needs.announced_at.is_some_and(|t| t > a.created_at) {
                        debug!("ignoring older announcement of {}", a.repo_ref);
                        continue;
                    }
                    needs.announced_at = Some(a.created_at);
                    needs.relays = a.relays.into_iter().collect();
                    announcements += 1;
                }
                SelfEventMeaning::RootEvent { id, repos } => {
                    if repos.is_empty() {
                        debug!("root event {id} names no repository; ignored");
                    }
                    for r in repos {
                        if self.repo_index.entry(r).or_default().root_events.insert(id) {
                            roots += 1;
                        }
                    }
                }
                SelfEventMeaning::Other => {}
            }
        }
        info!(
            "batch: {announcements} announcements, {roots} new root-event links; {} repositories known",
            self.repo_index.len()
        );
        if announcements > 0 {
            self.commands.push_back(Command::RetryRejected);
        }
        self.run_compute_actions(now);
    }

    // ----- remote relays -----

    fn targets(&self) -> HashMap<RelayUrl, RelaySyncNeeds> {
        derive_relay_targets(&self.repo_index, &self.excluded)
    }

    fn run_compute_actions(&mut self, now: Time) {
        let targets = self.targets();
        let actions = compute_actions(&targets, &self.pending, &self.relays);
        for a in actions {
            if self
                .links
                .get(&a.relay_url)
                .is_some_and(|l| l.retry_after.is_some())
            {
                continue;
            }
            self.handle_add_filters(a, now);
        }
    }

    fn recompute_actions_for_relay(&mut self, relay: &RelayUrl, now: Time) {
        let mut targets = self.targets();
        let Some(target) = targets.remove(relay) else {
            return;
        };
        let single = HashMap::from([(relay.clone(), target)]);
        for a in compute_actions(&single, &self.pending, &self.relays) {
            self.handle_add_filters(a, now);
        }
    }

    /// The design's `handle_add_filters`: spawn unknown relays; subscribe connected ones and
    /// record a [`PendingBatch`].
    fn handle_add_filters(&mut self, action: AddFilters, now: Time) {
        let AddFilters {
            relay_url,
            repos,
            root_events,
            filters,
        } = action;
        match self.relays.get(&relay_url) {
            None => {
                info!("discovered relay {relay_url}");
                self.relays
                    .insert(relay_url.clone(), RelayState::new(false));
                self.links.insert(relay_url.clone(), Link::default());
                self.connect_remote(&relay_url, now);
                return;
            }
            Some(s) if s.connection_status != ConnectionStatus::Connected => return,
            Some(_) => {}
        }
        // maybe_consolidate: checked BEFORE the new filters are added.
        let open = self.links.get(&relay_url).map_or(0, |l| l.subs.len());
        let deferring = self
            .links
            .get(&relay_url)
            .is_some_and(|l| !l.deferred.is_empty());
        let threshold = self.threshold(&relay_url);
        if deferring || (open > 1 && open + filters.len() > threshold) {
            let wait = self.config.consolidation_wait;
            let link = self.link(&relay_url);
            link.deferred.repos.extend(repos);
            link.deferred.root_events.extend(root_events);
            if link.consolidate_by.is_none() {
                info!(
                    "{relay_url}: {open} open + {} new subscriptions exceed {}; consolidating",
                    filters.len(),
                    threshold
                );
                link.consolidate_by = Some(now.plus(wait));
            }
            self.run_deferred_if_idle(&relay_url, now);
            return;
        }
        self.subscribe_batch(&relay_url, repos, root_events, filters, now);
    }

    /// Subscribes `filters` (one REQ each) as a new [`PendingBatch`] of the given items.
    fn subscribe_batch(
        &mut self,
        relay_url: &RelayUrl,
        repos: HashSet<crate::core::nip34::RepoRef>,
        root_events: HashSet<EventId>,
        filters: Vec<Filter>,
        now: Time,
    ) {
        if filters.is_empty() {
            return;
        }
        let relay_url = relay_url.clone();
        let filters = self.fit_filters(&relay_url, filters);
        let generation = self.relays[&relay_url].generation;
        self.next_batch += 1;
        let batch_id = self.next_batch;
        let mut outstanding = HashSet::new();
        for filter in filters {
            let sub_id = self.open_sub(&relay_url, generation, SubPurpose::Batch(batch_id), filter);
            outstanding.insert(sub_id);
        }
        debug!(
            "{relay_url}: batch {batch_id} with {} repos, {} root events, {} subscriptions",
            repos.len(),
            root_events.len(),
            outstanding.len()
        );
        self.pending
            .entry(relay_url)
            .or_default()
            .push(PendingBatch {
                batch_id,
                items: PendingItems { repos, root_events },
                outstanding_subs: outstanding,
                started_at: now,
                incomplete: false,
            });
    }

    /// Opens one subscription (one REQ, one filter) on a remote relay; it counts as loading
    /// history until its EOSE.
    fn open_sub(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        purpose: SubPurpose,
        filter: Filter,
    ) -> SubscriptionId {
        let mut filter = filter;
        if let (Some(max), None) = (self.page_limits(relay).max_limit, filter.limit) {
            // The relay's default page may be smaller than its max_limit: ask for the max.
            filter = filter.limit(max);
        }
        let sub_id = self.new_sub_id();
        let budget = self.budget(relay);
        let link = self.link(relay);
        let info = SubInfo { purpose, filter };
        if link.subs.len() >= budget || !link.queue.is_empty() {
            // Never more open subscriptions than the relay allows: wait for room.
            link.queue.push_back((sub_id.clone(), info));
            return sub_id;
        }
        self.send_sub(relay, generation, sub_id.clone(), info);
        sub_id
    }

    fn send_sub(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        sub_id: SubscriptionId,
        info: SubInfo,
    ) {
        let filter = info.filter.clone();
        let link = self.link(relay);
        link.subs.insert(sub_id.clone(), info);
        link.loading.insert(sub_id.clone());
        self.commands.push_back(Command::Subscribe {
            relay: relay.clone(),
            generation,
            sub_id,
            filter,
        });
    }

    /// Sends queued subscriptions while the budget has room.
    fn drain_queue(&mut self, relay: &RelayUrl) {
        let budget = self.budget(relay);
        let Some(generation) = self
            .relays
            .get(relay)
            .filter(|s| s.connection_status == ConnectionStatus::Connected)
            .map(|s| s.generation)
        else {
            return;
        };
        loop {
            let Some(link) = self.links.get_mut(relay) else {
                return;
            };
            if link.subs.len() >= budget {
                return;
            }
            let Some((sub_id, info)) = link.queue.pop_front() else {
                return;
            };
            self.send_sub(relay, generation, sub_id, info);
        }
    }

    /// Splits (by halving tag values) every filter whose REQ would be longer than the relay's
    /// NIP-11 `max_message_length` (with room for `since`/`until`/`limit` added later).
    fn fit_filters(&self, relay: &RelayUrl, filters: Vec<Filter>) -> Vec<Filter> {
        let Some(max) = self.max_message.get(relay).copied() else {
            return filters;
        };
        let budget = max.saturating_sub(120).max(200);
        let mut out = Vec::new();
        let mut todo: Vec<Filter> = filters.into_iter().rev().collect();
        while let Some(f) = todo.pop() {
            // `["REQ","gsNNNNNNNNNN",` + filter + `]`
            let len = f.as_json().len() + 24;
            let splittable = f.generic_tags.iter().find(|(_, v)| v.len() >= 2);
            match splittable {
                Some((tag, values)) if len > budget => {
                    let tag = *tag;
                    let values: Vec<String> = values.iter().cloned().collect();
                    let (a, b) = values.split_at(values.len() / 2);
                    let mut fb = f.clone();
                    fb.generic_tags.insert(tag, b.iter().cloned().collect());
                    let mut fa = f;
                    fa.generic_tags.insert(tag, a.iter().cloned().collect());
                    todo.push(fb);
                    todo.push(fa);
                }
                _ => out.push(f),
            }
        }
        out
    }

    /// Open subscriptions the relay allows (NIP-11 `max_subscriptions`, else the default).
    pub fn budget(&self, relay: &RelayUrl) -> usize {
        self.budgets
            .get(relay)
            .copied()
            .unwrap_or(self.config.default_subscription_budget)
            .max(2)
    }

    /// Open subscriptions above which new items trigger a consolidation.
    fn threshold(&self, relay: &RelayUrl) -> usize {
        self.config.consolidation_threshold.min(self.budget(relay))
    }

    /// Opens Layer 1 (when `with_l1`) and Layers 2+3 of the confirmed items with `since` as
    /// live subscriptions, as many as the budget allows with one slot left for history
    /// queries; the rest of Layers 2+3 is polled every poll interval instead.
    fn open_live_set(
        &mut self,
        relay: &RelayUrl,
        since: nostr::types::Timestamp,
        with_l1: bool,
        now: Time,
    ) {
        let Some(state) = self.relays.get(relay) else {
            return;
        };
        let generation = state.generation;
        let mut filters = Vec::new();
        if with_l1 {
            filters.push((
                SubPurpose::Announcements,
                build_announcement_filter(Some(since)),
            ));
        }
        let catch_up =
            build_layer2_and_layer3_filters(&state.repos, &state.root_events, Some(since));
        for f in self.fit_filters(relay, catch_up) {
            filters.push((SubPurpose::CatchUp, f));
        }
        let open = self.links.get(relay).map_or(0, |l| l.subs.len());
        let capacity = self
            .budget(relay)
            .saturating_sub(1)
            .saturating_sub(open)
            .max(usize::from(with_l1));
        let polled: Vec<Filter> = if filters.len() > capacity {
            filters
                .split_off(capacity)
                .into_iter()
                .map(|(_, mut f)| {
                    f.since = None;
                    f
                })
                .collect()
        } else {
            Vec::new()
        };
        for (purpose, filter) in filters {
            self.open_sub(relay, generation, purpose, filter);
        }
        let interval = self.config.poll_interval;
        let link = self.link(relay);
        if polled.is_empty() {
            link.polled.clear();
            link.next_poll = None;
            link.poll_since = None;
        } else {
            info!(
                "{relay}: {} queries do not fit the relay's subscription budget; polling them every {interval:?}",
                polled.len()
            );
            link.polled = polled;
            link.poll_since = Some(since);
            link.next_poll = Some(now);
        }
    }

    /// One poll round: every polled query with `since`, closed at EOSE (paged like any
    /// history). A round starts only when the previous one has finished.
    fn poll_round(&mut self, relay: &RelayUrl, now: Time) {
        let interval = self.config.poll_interval;
        let margin = self.config.quick_reconnect_window;
        let Some(link) = self.links.get_mut(relay) else {
            return;
        };
        link.next_poll = Some(now.plus(interval));
        let busy = link
            .subs
            .values()
            .chain(link.queue.iter().map(|q| &q.1))
            .any(|i| i.purpose == SubPurpose::Page { batch: None });
        if busy || link.polled.is_empty() {
            return;
        }
        let since = link
            .poll_since
            .unwrap_or_else(|| now.minus(margin).timestamp());
        link.poll_since = Some(now.minus(margin).timestamp());
        let filters: Vec<Filter> = link.polled.iter().map(|f| f.clone().since(since)).collect();
        let Some(generation) = self
            .relays
            .get(relay)
            .filter(|s| s.connection_status == ConnectionStatus::Connected)
            .map(|s| s.generation)
        else {
            return;
        };
        debug!(
            "{relay}: poll round of {} queries since {}",
            filters.len(),
            since.as_secs()
        );
        for f in filters {
            self.open_sub(relay, generation, SubPurpose::Page { batch: None }, f);
        }
    }

    fn link(&mut self, relay: &RelayUrl) -> &mut Link {
        self.links.entry(relay.clone()).or_default()
    }

    fn connect_remote(&mut self, relay: &RelayUrl, _now: Time) {
        let Some(state) = self.relays.get_mut(relay) else {
            return;
        };
        state.generation += 1;
        state.connection_status = ConnectionStatus::Connecting;
        self.counters.connect_attempts += 1;
        self.commands.push_back(Command::Connect {
            relay: relay.clone(),
            generation: state.generation,
        });
    }

    /// The design's `handle_connect_or_reconnect`: fresh, quick or stale.
    fn handle_connect_or_reconnect(&mut self, relay: &RelayUrl, now: Time) {
        let window = self.config.quick_reconnect_window;
        let Some(state) = self.relays.get_mut(relay) else {
            return;
        };
        let stale = state.last_connected.is_some() && state.should_clear_state(now, window);
        let fresh = state.last_connected.is_none() || stale;
        let since = if fresh {
            None
        } else {
            state.last_connected.map(|t| t.minus(window).timestamp())
        };
        if stale {
            info!("{relay}: reconnected after more than {window:?}; fresh sync");
            state.clear_sync_state();
        }
        state.connection_status = ConnectionStatus::Connected;
        state.last_connected = Some(now);
        state.disconnected_at = None;
        let generation = state.generation;
        let (repos, roots) = (state.repos.clone(), state.root_events.clone());
        self.link(relay).health.record_success(now);
        info!(
            "{relay}: connected ({})",
            match since {
                None => "fresh sync".to_string(),
                Some(s) => format!("quick reconnect, catch-up since {}", s.as_secs()),
            }
        );
        let _ = (&repos, &roots);
        match since {
            Some(since) => self.open_live_set(relay, since, true, now),
            None => {
                self.open_sub(
                    relay,
                    generation,
                    SubPurpose::Announcements,
                    build_announcement_filter(None),
                );
            }
        }
        self.recompute_actions_for_relay(relay, now);
    }

    /// The design's `handle_disconnect`, plus the reconnect schedule.
    fn handle_disconnect(&mut self, relay: &RelayUrl, reason: &str, now: Time) {
        let Some(state) = self.relays.get_mut(relay) else {
            return;
        };
        let was_connected = state.connection_status == ConnectionStatus::Connected;
        if was_connected {
            state.disconnected_at = Some(now);
        }
        state.connection_status = ConnectionStatus::Disconnected;
        if let Some(batches) = self.pending.remove(relay) {
            self.counters.batches_failed += batches.len() as u64;
        }
        let policy = self.config.backoff;
        let unit = self.jitter.unit();
        let link = self.links.entry(relay.clone()).or_default();
        link.subs.clear();
        link.loading.clear();
        link.deferred = PendingItems::default();
        link.consolidate_by = None;
        link.reopen.clear();
        link.queue.clear();
        link.polled.clear();
        link.poll_since = None;
        link.next_poll = None;
        link.rebuild_needed = false;
        link.health.record_failure(now, &policy);
        let at = link.health.next_attempt(now, &policy, unit);
        link.next_attempt = Some(at);
        let verb = if was_connected {
            "lost"
        } else {
            "connect failed"
        };
        warn!(
            "{relay}: {verb} ({reason}); retry in {:.1}s (failures: {})",
            at.since(now).as_secs_f64(),
            link.health.failures()
        );
    }

    fn handle_eose(
        &mut self,
        relay: &RelayUrl,
        sub_id: &SubscriptionId,
        stats: &PageStats,
        now: Time,
    ) {
        let Some(info) = self.links.get_mut(relay).and_then(|l| {
            l.loading.remove(sub_id);
            l.subs.get(sub_id).cloned()
        }) else {
            return;
        };
        let batch_id = match info.purpose {
            SubPurpose::Batch(id) => Some(id),
            SubPurpose::Page { batch } => batch,
            _ => None,
        };
        // Pages of older history first, so a batch never confirms before its pages.
        let plan = plan_pages(&info.filter, stats, &self.page_limits(relay));
        let generation = self.relays.get(relay).map_or(0, |s| s.generation);
        let mut page_subs = Vec::new();
        for f in plan.next {
            self.counters.pages_requested += 1;
            page_subs.push(self.open_sub(
                relay,
                generation,
                SubPurpose::Page { batch: batch_id },
                f,
            ));
        }
        let constrained = self
            .links
            .get(relay)
            .is_some_and(|l| !l.queue.is_empty() || !l.polled.is_empty());
        let close = match info.purpose {
            SubPurpose::Page { .. } => true,
            // Over budget: a batch's history query gives its slot back at EOSE; its items
            // join the live or polled set at the next rebuild.
            SubPurpose::Batch(_) if constrained => {
                self.link(relay).rebuild_needed = true;
                true
            }
            _ => false,
        };
        if close {
            if let Some(l) = self.links.get_mut(relay) {
                l.subs.remove(sub_id);
            }
            self.commands.push_back(Command::Unsubscribe {
                relay: relay.clone(),
                generation,
                sub_id: sub_id.clone(),
            });
            self.drain_queue(relay);
        }
        if plan.partial_split {
            info!(
                "{relay}: more events than the relay returns share one second; split by the kinds/authors seen (events of other kinds/authors in that second cannot be asked for)"
            );
        }
        if let Some(why) = &plan.incomplete {
            self.counters.incomplete_queries += 1;
            warn!(
                "{relay}: history of {sub_id} ({:?}) is incomplete: {why}",
                info.purpose
            );
        }
        debug!(
            "{relay}: EOSE for {sub_id} ({:?}, {} events, {} pages)",
            info.purpose,
            stats.received,
            page_subs.len()
        );
        let Some(batch_id) = batch_id else {
            self.run_deferred_if_idle(relay, now);
            return;
        };
        let Some(batches) = self.pending.get_mut(relay) else {
            return;
        };
        let Some(pos) = batches.iter().position(|b| b.batch_id == batch_id) else {
            return;
        };
        let batch = &mut batches[pos];
        batch.outstanding_subs.remove(sub_id);
        batch.outstanding_subs.extend(page_subs);
        // Progress: the EOSE deadline counts from the last answer.
        batch.started_at = now;
        if plan.incomplete.is_some() {
            batch.incomplete = true;
        }
        if !batch.outstanding_subs.is_empty() {
            return;
        }
        let batch = batches.remove(pos);
        if batches.is_empty() {
            self.pending.remove(relay);
        }
        self.counters.batches_confirmed += 1;
        if batch.incomplete {
            warn!(
                "{relay}: batch {} confirmed INCOMPLETE: the relay could not deliver all history of its {} repos and {} root events",
                batch.batch_id,
                batch.items.repos.len(),
                batch.items.root_events.len()
            );
        }
        if let Some(state) = self.relays.get_mut(relay) {
            debug!(
                "{relay}: batch {} confirmed ({} repos, {} root events)",
                batch.batch_id,
                batch.items.repos.len(),
                batch.items.root_events.len()
            );
            if batch.incomplete {
                state.incomplete_batches += 1;
            }
            state.repos.extend(batch.items.repos);
            state.root_events.extend(batch.items.root_events);
        }
        self.run_deferred_if_idle(relay, now);
    }

    fn handle_closed(
        &mut self,
        relay: &RelayUrl,
        sub_id: &SubscriptionId,
        message: &str,
        now: Time,
    ) {
        self.counters.closed_by_relay += 1;
        let Some(info) = self.links.get_mut(relay).and_then(|l| {
            l.loading.remove(sub_id);
            l.subs.remove(sub_id)
        }) else {
            return;
        };
        self.drain_queue(relay);
        let reason = classify_closed(message);
        let prefix = closed_prefix(message).to_string();
        let first = self.link(relay).warned.insert(format!("CLOSED {prefix}"));
        let what = format!(
            "{relay}: subscription {sub_id} ({:?}) closed by the relay: {message:?}",
            info.purpose
        );
        if first {
            warn!("{what}");
        } else {
            debug!("{what}");
        }
        let delay = match reason {
            ClosedReason::RateLimited => {
                self.counters.rate_limited += 1;
                // Hold back new batches of this relay for the cool-down, too.
                let until = now.plus(self.config.rate_limit_cooldown);
                let l = self.link(relay);
                l.retry_after = Some(l.retry_after.map_or(until, |t| t.max(until)));
                self.config.rate_limit_cooldown
            }
            ClosedReason::AuthRequired => {
                if first {
                    warn!(
                        "{relay}: requires NIP-42 authentication and did not accept us (no key configured with --nsec-file / GRASP_SYNC_NSEC, or the relay refused it); its {:?} query is retried later",
                        info.purpose
                    );
                }
                self.config.refused_retry
            }
            ClosedReason::Refused => self.config.refused_retry,
        };
        match info.purpose {
            SubPurpose::Batch(batch_id)
            | SubPurpose::Page {
                batch: Some(batch_id),
            } => self.fail_batch_for(relay, batch_id, now, "closed by relay", Some(delay)),
            SubPurpose::SelfSubscription => {}
            purpose => {
                // Layer 1, catch-up or a page without a batch: never silently gone; the same
                // query is opened again after the delay.
                let at = now.plus(delay);
                self.link(relay).reopen.push((at, purpose, info.filter));
            }
        }
    }

    /// A NOTICE from a remote relay: rate-limit texts pause new subscriptions for the
    /// cool-down; every NOTICE is counted by the relay thread.
    fn handle_notice(&mut self, relay: &RelayUrl, message: &str, now: Time) {
        match classify_notice(message) {
            NoticeKind::RateLimit => {
                self.counters.rate_limited += 1;
                let until = now.plus(self.config.rate_limit_cooldown);
                let first = self.link(relay).warned.insert(format!("NOTICE {message}"));
                let l = self.link(relay);
                l.retry_after = Some(l.retry_after.map_or(until, |t| t.max(until)));
                if first {
                    warn!(
                        "{relay}: NOTICE {message:?}: pausing new subscriptions for {:?}",
                        self.config.rate_limit_cooldown
                    );
                } else {
                    debug!("{relay}: NOTICE {message:?} (rate limit, repeated)");
                }
            }
            NoticeKind::Other => debug!("{relay}: NOTICE {message:?}"),
        }
    }

    fn fail_batch(&mut self, relay: &RelayUrl, batch_id: u64, now: Time, why: &str) {
        self.fail_batch_for(relay, batch_id, now, why, None);
    }

    /// Fails a batch; its items are retried after `min_delay` or the backoff, whichever is
    /// longer.
    fn fail_batch_for(
        &mut self,
        relay: &RelayUrl,
        batch_id: u64,
        now: Time,
        why: &str,
        min_delay: Option<Duration>,
    ) {
        let Some(batches) = self.pending.get_mut(relay) else {
            return;
        };
        let Some(pos) = batches.iter().position(|b| b.batch_id == batch_id) else {
            return;
        };
        let batch = batches.remove(pos);
        if batches.is_empty() {
            self.pending.remove(relay);
        }
        self.counters.batches_failed += 1;
        let generation = self.relays.get(relay).map_or(0, |s| s.generation);
        let policy = self.config.backoff;
        let unit = self.jitter.unit();
        let link = self.links.entry(relay.clone()).or_default();
        // Close every subscription of the batch, also those that already saw EOSE: the
        // retry opens the same filters again.
        let mut subs: Vec<SubscriptionId> = link
            .subs
            .iter()
            .filter(|(_, i)| {
                i.purpose == SubPurpose::Batch(batch_id)
                    || i.purpose
                        == SubPurpose::Page {
                            batch: Some(batch_id),
                        }
            })
            .map(|(s, _)| s.clone())
            .collect();
        subs.sort();
        link.queue.retain(|(_, i)| {
            i.purpose != SubPurpose::Batch(batch_id)
                && i.purpose
                    != SubPurpose::Page {
                        batch: Some(batch_id),
                    }
        });
        for sub in subs {
            link.loading.remove(&sub);
            link.subs.remove(&sub);
            self.commands.push_back(Command::Unsubscribe {
                relay: relay.clone(),
                generation,
                sub_id: sub,
            });
        }
        let delay = policy
            .base
            .mul_f64(0.75 + 0.5 * unit)
            .max(Duration::from_secs(1));
        let delay = delay
            .max(link.health.base_delay(now, &policy))
            .max(min_delay.unwrap_or(Duration::ZERO));
        let at = now.plus(delay);
        link.retry_after = Some(link.retry_after.map_or(at, |t| t.max(at)));
        let deferred_waiting = !link.deferred.is_empty();
        warn!(
            "{relay}: batch {batch_id} failed ({why}); its {} repos and {} root events are retried in {:.0}s",
            batch.items.repos.len(),
            batch.items.root_events.len(),
            at.since(now).as_secs_f64()
        );
        self.drain_queue(relay);
        if deferred_waiting {
            self.run_deferred_if_idle(relay, now);
        }
    }

    fn run_deferred_if_idle(&mut self, relay: &RelayUrl, now: Time) {
        let ready = self
            .links
            .get(relay)
            .is_some_and(|l| (!l.deferred.is_empty() || l.rebuild_needed) && l.loading.is_empty());
        if ready {
            self.run_deferred(relay, now);
        }
    }

    /// The design's `consolidate`, without blocking: runs once the relay's pending batches
    /// are done or the wait deadline passed (then the still-pending batches are folded into
    /// the new items instead of being waited for). Closes every subscription, re-subscribes
    /// Layer 1 and Layers 2+3 of the confirmed items with `since = now − 15 min`, then adds
    /// the deferred new items as one batch without `since`.
    fn run_deferred(&mut self, relay: &RelayUrl, now: Time) {
        let Some(link) = self.links.get_mut(relay) else {
            return;
        };
        link.consolidate_by = None;
        // The rebuild below re-subscribes Layer 1 and every confirmed item.
        link.reopen
            .retain(|r| !matches!(r.1, SubPurpose::Announcements | SubPurpose::CatchUp));
        let mut items = std::mem::take(&mut link.deferred);
        let connected = self
            .relays
            .get(relay)
            .is_some_and(|s| s.connection_status == ConnectionStatus::Connected);
        if !connected {
            return;
        }
        let state = &self.relays[relay];
        let generation = state.generation;
        let (repos, roots) = (state.repos.clone(), state.root_events.clone());
        let before = self.links.get(relay).map_or(0, |l| l.subs.len());
        // Subscriptions still loading history (a first Layer 1) and every subscription of a
        // batch that is still pending stay open: closing them would lose what they have not
        // delivered yet, or leave the batch's items without a live subscription once it
        // confirms.
        let pending_batches: HashSet<u64> = self
            .pending
            .get(relay)
            .map(|bs| bs.iter().map(|b| b.batch_id).collect())
            .unwrap_or_default();
        let mut keep_l1 = false;
        let mut old: Vec<SubscriptionId> = Vec::new();
        if let Some(l) = self.links.get_mut(relay) {
            let loading = l.loading.clone();
            l.subs.retain(|sub, info| {
                let purpose = &info.purpose;
                let of_pending_batch = matches!(purpose,
                    SubPurpose::Batch(id) | SubPurpose::Page { batch: Some(id) }
                        if pending_batches.contains(id));
                if loading.contains(sub) || of_pending_batch {
                    keep_l1 |= *purpose == SubPurpose::Announcements;
                    true
                } else {
                    old.push(sub.clone());
                    false
                }
            });
        }
        old.sort();
        for sub_id in old {
            self.commands.push_back(Command::Unsubscribe {
                relay: relay.clone(),
                generation,
                sub_id,
            });
        }
        let since = now.minus(self.config.quick_reconnect_window).timestamp();
        if let Some(l) = self.links.get_mut(relay) {
            l.rebuild_needed = false;
        }
        self.open_live_set(relay, since, !keep_l1, now);
        items.repos.retain(|r| !repos.contains(r));
        items.root_events.retain(|e| !roots.contains(e));
        let filters = build_layer2_and_layer3_filters(&items.repos, &items.root_events, None);
        self.subscribe_batch(relay, items.repos, items.root_events, filters, now);
        self.drain_queue(relay);
        let after = self.links.get(relay).map_or(0, |l| l.subs.len());
        info!("{relay}: consolidated {before} subscriptions (plus the new items) into {after}");
    }

    /// Scenario 5: the daily full resync of every relay (close all, clear pending and
    /// confirmed, Layer 1 without since, compute_actions for everything).
    fn daily_resync(&mut self, now: Time) {
        let urls: Vec<RelayUrl> = self.relays.keys().cloned().collect();
        info!("daily resync of {} relays", urls.len());
        for url in urls {
            if let Some(batches) = self.pending.remove(&url) {
                self.counters.batches_failed += batches.len() as u64;
            }
            let Some(state) = self.relays.get_mut(&url) else {
                continue;
            };
            state.clear_sync_state();
            let generation = state.generation;
            let connected = state.connection_status == ConnectionStatus::Connected;
            if !connected {
                // Not connected: the next connect is a fresh sync.
                state.last_connected = None;
                state.disconnected_at = None;
                continue;
            }
            let link = self.links.entry(url.clone()).or_default();
            link.deferred = PendingItems::default();
            link.consolidate_by = None;
            link.reopen.clear();
            link.queue.clear();
            link.polled.clear();
            link.poll_since = None;
            link.next_poll = None;
            link.rebuild_needed = false;
            link.loading.clear();
            let mut old: Vec<SubscriptionId> = link.subs.drain().map(|(s, _)| s).collect();
            old.sort();
            for sub_id in old {
                self.commands.push_back(Command::Unsubscribe {
                    relay: url.clone(),
                    generation,
                    sub_id,
                });
            }
            self.open_sub(
                &url,
                generation,
                SubPurpose::Announcements,
                build_announcement_filter(None),
            );
            self.recompute_actions_for_relay(&url, now);
        }
    }

    fn expire_batches(&mut self, now: Time) {
        let timeout = self.config.eose_timeout;
        let expired: Vec<(RelayUrl, u64)> = self
            .pending
            .iter()
            .flat_map(|(u, bs)| {
                bs.iter()
                    .filter(|b| now.since(b.started_at) >= timeout)
                    .map(|b| (u.clone(), b.batch_id))
            })
            .collect();
        for (relay, batch_id) in expired {
            self.fail_batch(&relay, batch_id, now, "no EOSE before the deadline");
        }
    }

    /// The design's `check_disconnects`, corrected: a relay is dropped only when it has no
    /// target items, no pending batch and is not bootstrap. A relay still in its first sync
    /// has targets, so it is never dropped.
    fn check_disconnects(&mut self, _now: Time) {
        let targets = self.targets();
        let idle: Vec<RelayUrl> = self
            .relays
            .iter()
            .filter(|(url, s)| {
                !s.is_bootstrap
                    && !targets.contains_key(*url)
                    && self.pending.get(*url).is_none_or(|b| b.is_empty())
            })
            .map(|(u, _)| u.clone())
            .collect();
        for url in idle {
            info!("{url}: no repository needs this relay any more; disconnecting");
            self.relays.remove(&url);
            self.pending.remove(&url);
            self.links.remove(&url);
            self.commands.push_back(Command::Forget { relay: url });
        }
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
            .links
            .get(relay)
            .map(|l| l.subs.iter().map(|(s, i)| (s.clone(), i.purpose)).collect())
            .unwrap_or_default();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Status of the own relay's self-subscription connection.
    pub fn own_status(&self) -> ConnectionStatus {
        self.own.connection_status
    }

    /// Counters.
    pub fn counters(&self) -> SyncCounters {
        self.counters
    }

    /// Total root events known (distinct ids).
    pub fn root_event_count(&self) -> usize {
        let ids: HashSet<&EventId> = self
            .repo_index
            .values()
            .flat_map(|n| n.root_events.iter())
            .collect();
        ids.len()
    }

    /// A status line per remote relay, sorted by URL.
    pub fn relay_statuses(&self, now: Time) -> Vec<RelaySyncStatus> {
        let targets = self.targets();
        let sorted: BTreeMap<&RelayUrl, &RelayState> = self.relays.iter().collect();
        sorted
            .into_iter()
            .map(|(url, s)| {
                let link = self.links.get(url);
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
                    next_attempt: link.and_then(|l| l.next_attempt),
                }
            })
            .collect()
    }
}
