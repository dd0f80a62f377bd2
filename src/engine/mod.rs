//! The threads: coordinator, one thread per relay (the own relay's self-subscription
//! included), and the forwarder. [`start`] wires them up and returns a [`SyncHandle`].

// The relay thread, the forwarder, the counters and the state file are the engine's own parts,
// not the embedding API: private, reached by tests and benches through
// `grasp_sync::testing::internals` (feature `testing`), which is why their items stay `pub`.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub, dead_code))]
pub(crate) mod connection;
mod coordinator;
pub(crate) mod dial;
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub, dead_code))]
pub(crate) mod forwarder;
mod handover;
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub, dead_code))]
pub(crate) mod metrics;
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub, dead_code))]
pub(crate) mod state_file;

pub use state_file::StateFileStatus;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Sender};
use parking_lot::{Mutex, RwLock};

use crate::config::Config;
use crate::core::dedup::ForwardGate;
use crate::core::health::HealthState;
use crate::core::progress::{OwnInput, Progress, ProgressTracker, RelayProgress};
use crate::core::state::ConnectionStatus;
use crate::core::sync::{Report, SyncMachine};
use crate::core::targets::{RepoScope, TargetReport};
use crate::engine::coordinator::Coordinator;
use crate::engine::forwarder::Forwarder;
use crate::engine::metrics::{Metrics, RelayCounters};
use crate::error::Error;
use crate::shared::RelayUrl;

/// What the coordinator receives.
#[derive(Debug)]
#[non_exhaustive]
pub enum Input {
    /// A report from a relay thread.
    Report(Report),
    /// Stop everything; join threads until the deadline.
    Shutdown(Instant),
    /// Test hook: make a thread panic (the coordinator must notice and restart it).
    #[cfg(feature = "testing")]
    InjectPanic(PanicTarget),
}

/// Which thread [`SyncHandle::inject_panic`] makes panic.
#[cfg(feature = "testing")]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PanicTarget {
    /// The relay thread of this relay (the own relay's URL: the self-subscription).
    Relay(RelayUrl),
    /// The forwarder.
    Forwarder,
}

/// One remote relay in a [`Status`].
#[derive(Debug, Clone, PartialEq)]
pub struct RelayStatus {
    /// Relay URL.
    pub url: RelayUrl,
    /// Connection status.
    pub connection_status: ConnectionStatus,
    /// Health.
    pub health: HealthState,
    /// Bootstrap relay (never idle-disconnected).
    pub is_bootstrap: bool,
    /// Repositories this relay should carry.
    pub target_repos: usize,
    /// Root events this relay should carry.
    pub target_root_events: usize,
    /// Repositories whose history is confirmed (EOSE).
    pub confirmed_repos: usize,
    /// Root events whose history is confirmed.
    pub confirmed_root_events: usize,
    /// Batches awaiting EOSE.
    pub pending_batches: usize,
    /// Repositories in pending batches.
    pub pending_repos: usize,
    /// Root events in pending batches.
    pub pending_root_events: usize,
    /// Open subscriptions.
    pub open_subscriptions: usize,
    /// Events received.
    pub events_received: u64,
    /// Events that passed the checks and went to the forwarder.
    pub events_accepted: u64,
    /// Events with a bad id/signature or malformed.
    pub events_invalid: u64,
    /// Events that did not match their subscription.
    pub events_unmatched: u64,
    /// NOTICE messages.
    pub notices: u64,
    /// CLOSED messages.
    pub closed: u64,
    /// Frames that are not NIP-01 messages (garbage, binary, unknown types).
    pub garbage_frames: u64,
    /// Events for a subscription we do not have open.
    pub events_unknown_subscription: u64,
    /// NIP-42 AUTH challenges received.
    pub auth_challenges: u64,
    /// Connections established.
    pub connects: u64,
    /// Connections lost or failed.
    pub disconnects: u64,
    /// When the current (or last) connection was established.
    pub last_connected: Option<crate::core::time::Time>,
    /// Why the last connection failed or was lost.
    pub last_error: Option<String>,
    /// The `since` (Unix seconds) of the latest catch-up or poll round.
    pub catch_up_since: Option<u64>,
    /// Batches of this relay that failed.
    pub failed_batches: u64,
    /// Queries whose history this relay could not deliver completely.
    pub incomplete_queries: u64,
    /// Ids it listed for a reconciled query and did not deliver when asked by id twice
    /// (its history as read is short by them; issue 33).
    pub ids_undelivered: u64,
    /// Of those, the ones since its last full sync: its history as read is short by them
    /// (not settled meanwhile).
    pub history_short: u64,
    /// The cap it was caught applying to its answers without publishing it (decision
    /// 0103): its pages of this many events are read as full.
    pub learned_cap: Option<usize>,
    /// Queries waiting for room in its subscription budget.
    pub queued_queries: usize,
    /// Layer 2/3 queries polled because they do not fit its budget.
    pub polled_queries: usize,
    /// Queries sent and still waiting for their EOSE.
    pub loading_queries: usize,
    /// Queries the relay closed, waiting for their delay to be opened again.
    pub reopen_pending: usize,
    /// NIP-77 support as known (`docs/nip77.md`).
    pub nip77: crate::core::sync::Nip77Support,
    /// Reconciliations running or waiting on this relay.
    pub reconciliations_pending: usize,
    /// Consecutive failed connection attempts.
    pub failures: u32,
    /// Times this relay's thread ended unexpectedly (a panic) and was started again.
    pub thread_restarts: u64,
    /// Frames above the soft size cap (`WsOptions::max_event_size`), dropped with the
    /// connection kept; each distinct event is counted once.
    pub oversized_frames: u64,
    /// Schnorr signature checks this relay's thread did (copies of events verified before,
    /// by any relay thread, skip the check).
    pub signature_checks: u64,
    /// Events not handed to the forwarder because a copy already was: checked copies, and
    /// copies recognised by their id before parsing (those count as received, not accepted).
    pub copies_not_forwarded: u64,
    /// Ids a reconciliation's fetch did not ask this relay for because a copy of the event
    /// was on its way to the own relay.
    pub fetch_ids_in_flight: u64,
    /// JSON bytes of this relay's events in the forward pipeline now.
    pub forward_bytes: u64,
    /// Times this relay waited for the forward pipeline's byte bound.
    pub forward_byte_waits: u64,
    /// History queries pending and completed, rates over the last minute and the estimate
    /// of the time to settle ([`crate::core::progress`]).
    pub progress: RelayProgress,
}

/// The own relay's `OK` latency, as a cumulative histogram.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LatencySnapshot {
    /// Upper bounds of the buckets in milliseconds (a last `+Inf` bucket follows).
    pub bounds_ms: Vec<u64>,
    /// Cumulative counts per bucket, `+Inf` last (one more than `bounds_ms`).
    pub cumulative: Vec<u64>,
    /// Sum of all latencies in seconds.
    pub sum_secs: f64,
    /// Number of `OK`s measured.
    pub count: u64,
}

/// A snapshot of the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    /// The self-subscription connection to the own relay.
    pub own_relay: ConnectionStatus,
    /// Whether the forwarder is connected to the own relay.
    pub forwarder_connected: bool,
    /// Repositories known.
    pub repos: usize,
    /// Distinct root events known.
    pub root_events: usize,
    /// Events followed below the root events (replies to replies, quotes, reactions).
    pub thread_events: usize,
    /// Remote relays, sorted by URL.
    pub relays: Vec<RelayStatus>,
    /// Events the own relay stored.
    pub forwarded: u64,
    /// Events the own relay already had.
    pub duplicates: u64,
    /// Events the own relay rejected.
    pub rejected: u64,
    /// Events checked and handed to the forwarder but not yet stored, found duplicate or
    /// rejected by the own relay (including those still in the channel).
    pub forward_backlog: u64,
    /// Invalid events dropped (all relays).
    pub invalid: u64,
    /// Events dropped for not matching their subscription (all relays).
    pub unmatched: u64,
    /// The self-subscription is still reading history or holds a batch not yet applied.
    pub self_sync_pending: bool,
    /// The sync machine's counters (batches, pages, CLOSED and NOTICE by kind, …).
    pub sync: crate::core::sync::SyncCounters,
    /// Events queued or in flight in the forwarder.
    pub forward_queue_depth: u64,
    /// Events the forwarder sent again (OK timeout, disconnect, rate limit, `error:`).
    pub forward_resent: u64,
    /// `error:` answers of the own relay (each event sent again, never given up).
    pub forward_relay_errors: u64,
    /// `rate-limited:` answers of the own relay (each event sent again).
    pub forward_rate_limited: u64,
    /// Events the own relay accepted into purgatory (`OK true "purgatory: …"`, GRASP-01:
    /// served once their git data arrives); never sent again.
    pub forward_purgatory: u64,
    /// Events set aside after repeated `error:` answers (each time; issue 36).
    pub forward_set_aside: u64,
    /// Events set aside now, waiting for their next try (every 10 min).
    pub forward_aside: u64,
    /// Events set aside that moved to the rejected store because the aside set was full.
    pub forward_aside_overflow: u64,
    /// The interval between sends while the own relay rate-limits us, in milliseconds (0:
    /// not paced).
    pub forward_pace_ms: u64,
    /// The own relay's `OK` latency.
    pub ok_latency: LatencySnapshot,
    /// The own relay's rejections by reason prefix (fixed set, `other` last).
    pub rejected_by_reason: Vec<(&'static str, u64)>,
    /// Threads (relay threads, the self-subscription, the forwarder) that ended unexpectedly
    /// (a panic) and were started again by the coordinator.
    pub thread_restarts: u64,
    /// Times the forwarder was among them.
    pub forwarder_restarts: u64,
    /// Relays refused by the address policy (each counted once).
    pub relays_refused: u64,
    /// The refused relays and why (sorted by URL; at most 1,000 shown).
    pub refused_relays: Vec<(RelayUrl, crate::shared::Refusal)>,
    /// False once shutdown has begun or the coordinator thread has ended (a bug); nothing
    /// is synced then.
    pub coordinator_running: bool,
    /// JSON bytes of checked events in the forward pipeline now.
    pub forward_bytes: u64,
    /// The most bytes the forward pipeline ever held.
    pub forward_bytes_peak: u64,
    /// Which repositories are synced (`--public-url` / `--archive`).
    pub repo_scope: RepoScope,
    /// What the repository scope and the relay quotas leave out now.
    pub targets: TargetReport,
    /// Hosts (`host:port`) with more than one selected URL and how many (at most
    /// [`MAX_HOSTS_SHOWN`], most first); `--max-urls-per-host` bounds each.
    pub hosts_with_several_urls: Vec<(String, usize)>,
    /// Relays whose last connect failed, behind the others for the global cap.
    pub relays_failing: usize,
    /// The state file of `--state-dir`.
    pub state_file: state_file::StateFileStatus,
    /// Progress in total and the estimate of the time until everything is settled
    /// ([`crate::core::progress`]).
    pub progress: Progress,
}

impl Status {
    /// The entry of `url`, if known.
    pub fn relay(&self, url: &RelayUrl) -> Option<&RelayStatus> {
        self.relays.iter().find(|r| &r.url == url)
    }

    /// True when the own relay is connected and its history read and applied, every known
    /// relay is connected with nothing pending (no batch, no NIP-77 reconciliation), its
    /// history not short (ids it listed and did not deliver, [`RelayStatus::history_short`])
    /// and everything it should carry confirmed, and the forward queue is empty.
    pub fn is_settled(&self) -> bool {
        self.own_relay == ConnectionStatus::Connected
            && !self.self_sync_pending
            && self.forward_backlog == 0
            && self.relays.iter().all(|r| {
                r.connection_status == ConnectionStatus::Connected
                    && r.pending_batches == 0
                    && r.reconciliations_pending == 0
                    && r.history_short == 0
                    && r.confirmed_repos >= r.target_repos
                    && r.confirmed_root_events >= r.target_root_events
            })
    }
}

/// A running engine. Dropping it without [`SyncHandle::shutdown`] stops it too (with a 5 s
/// deadline).
#[must_use = "dropping the handle stops the engine at once"]
pub struct SyncHandle {
    machine: Arc<RwLock<SyncMachine>>,
    metrics: Arc<Metrics>,
    /// Samples of the progress counters, taken by the coordinator.
    progress: Arc<Mutex<ProgressTracker>>,
    state_counters: Arc<state_file::StateCounters>,
    config: Config,
    inputs: Sender<Input>,
    stopping: Arc<AtomicBool>,
    stop_deadline: Arc<Mutex<Option<Instant>>>,
    coordinator: Mutex<Option<JoinHandle<Vec<String>>>>,
    /// The lock of `--state-dir`: held until a shutdown has stopped every thread (the state
    /// file is written at shutdown), or the handle is dropped.
    state_lock: Mutex<Option<std::fs::File>>,
}

/// Starts the engine: the coordinator, the forwarder and (through the coordinator) the
/// self-subscription and bootstrap relay threads.
pub fn start(mut config: Config) -> Result<SyncHandle, Error> {
    if config.batch_window.is_zero() {
        return Err(Error::Config(
            "batch window must be greater than zero".into(),
        ));
    }
    if config.auth_keys.is_none() && config.ephemeral_auth {
        let keys = nostr::key::Keys::generate();
        log::info!(
            "NIP-42 AUTH on remote relays: answering challenges with a key generated for this run ({})",
            keys.public_key().to_hex()
        );
        config.auth_keys = Some(keys);
    }
    log_scope(&config);
    let mut sync_machine = SyncMachine::new(config.sync_config());
    let metrics = Arc::new(Metrics::default());
    let gate = Arc::new(ForwardGate::default());
    let state_counters = Arc::new(state_file::StateCounters::default());
    let mut state_lock = None;
    let state = match &config.state_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::Config(format!(
                    "--state-dir {}: cannot create the directory: {e}",
                    dir.display()
                ))
            })?;
            state_lock = Some(
                state_file::lock_dir(dir).map_err(|e| Error::Config(format!("--state-dir {e}")))?,
            );
            let (own, key) = (config.own_relay.to_string(), config.state_key());
            state_file::load_into(
                dir,
                &own,
                &key,
                &mut sync_machine,
                config.clock.now(),
                &state_counters,
            );
            Some(
                state_file::StateWriter::new(
                    dir.clone(),
                    own,
                    key,
                    config.state_save_interval,
                    state_counters.clone(),
                    config.clock.clone(),
                )
                .map_err(Error::Spawn)?,
            )
        }
        None => None,
    };
    let machine = Arc::new(RwLock::new(sync_machine));
    let progress = Arc::new(Mutex::new(ProgressTracker::default()));
    let stopping = Arc::new(AtomicBool::new(false));
    let stop_deadline = Arc::new(Mutex::new(None));
    let (inputs_tx, inputs_rx) = bounded(config.input_channel.max(1));
    let (forward_tx, forward_rx) = bounded(config.forward_channel.max(1));
    let (fctl_tx, fctl_rx) = unbounded();

    let forwarder = Forwarder {
        url: config.own_relay.clone(),
        events: forward_rx,
        control: fctl_rx,
        limits: config.forward,
        ws: config.ws,
        tls: config.tls.clone(),
        backoff: config.backoff,
        ping_interval: config.ping_interval,
        pong_timeout: config.pong_timeout,
        metrics: metrics.clone(),
        gate: gate.clone(),
        drain: std::cell::Cell::new(None),
        clock: config.clock.clone(),
        seed: config.seed ^ 0x5555,
        auth_keys: coordinator::own_keys(&config),
        reports: inputs_tx.clone(),
        admissions: Default::default(),
    };
    let forwarder_thread = coordinator::spawn_forwarder(&forwarder).map_err(Error::Spawn)?;

    // This host's addresses and the own relay's, read now and again every few minutes
    // by the relay threads (issue 20).
    let policy = Arc::new(config.address_policy(Vec::new()));
    dial::refresh_local(&policy.local);
    let coordinator = Coordinator {
        machine: machine.clone(),
        inputs: inputs_rx,
        inputs_tx: inputs_tx.clone(),
        forward_tx,
        forwarder: fctl_tx,
        forwarder_spec: forwarder,
        forwarder_thread: Some(forwarder_thread),
        forwarder_restarted: None,
        config: config.clone(),
        metrics: metrics.clone(),
        progress: progress.clone(),
        gate,
        stopping: stopping.clone(),
        stop_deadline: stop_deadline.clone(),
        policy,
        state,
    };
    let coordinator = std::thread::Builder::new()
        .name("coordinator".into())
        .spawn(move || coordinator.run())
        .map_err(Error::Spawn)?;

    Ok(SyncHandle {
        machine,
        metrics,
        progress,
        state_counters,
        config,
        inputs: inputs_tx,
        stopping,
        stop_deadline,
        coordinator: Mutex::new(Some(coordinator)),
        state_lock: Mutex::new(state_lock),
    })
}

/// Hosts shown in [`Status::hosts_with_several_urls`].
pub const MAX_HOSTS_SHOWN: usize = 20;

/// Logs the repository scope and the relay quotas at start-up.
fn log_scope(config: &Config) {
    let scope = config.repo_scope();
    log::info!(
        "repository scope: {}; at most {} relays, {} per announcing pubkey, {} per announcement",
        scope.describe(),
        config.max_relays,
        config.max_relays_per_pubkey,
        config.max_relays_per_announcement
    );
    if config.public_urls.is_empty() && !config.archive {
        log::warn!(
            "no --public-url given: syncing EVERY repository the own relay holds, whichever service it names; set --public-url to sync only repositories that list this service (or --archive to keep syncing all of them knowingly)"
        );
    }
}

/// The progress of every relay and in total at `now`, for `/status` and the summary line.
pub(crate) fn progress_at(
    metrics: &Metrics,
    tracker: &ProgressTracker,
    m: &SyncMachine,
    statuses: &[crate::core::sync::RelaySyncStatus],
    now: crate::core::Time,
) -> (Progress, Vec<RelayProgress>) {
    let relay_progress: Vec<RelayProgress> = statuses
        .iter()
        .map(|s| {
            let accepted = metrics
                .relay_if_known(&s.url)
                .map_or(0, |c| RelayCounters::get(&c.events_accepted));
            RelayProgress::of(s, accepted, tracker, now)
        })
        .collect();
    let f = &metrics.forward;
    let own = OwnInput {
        connected: m.own_status() == ConnectionStatus::Connected,
        self_sync_pending: m.self_sync_pending(),
        forward_backlog: f.unresolved.load(Ordering::Relaxed),
        forwarded_per_second: tracker.forwarded_per_second(now, f.stored.load(Ordering::Relaxed)),
    };
    let total = Progress::of(statuses.iter().zip(&relay_progress), &own);
    (total, relay_progress)
}

impl SyncHandle {
    /// A consistent snapshot of the sync state and counters.
    pub fn status(&self) -> Status {
        let clock_now = self.config.clock.now();
        let m = self.machine.read();
        let statuses = m.relay_statuses(clock_now);
        let f = &self.metrics.forward;
        let (progress, relay_progress) = progress_at(
            &self.metrics,
            &self.progress.lock(),
            &m,
            &statuses,
            clock_now,
        );
        let relays = statuses
            .into_iter()
            .zip(relay_progress)
            .map(|(s, progress)| {
                let c = self.metrics.relay_if_known(&s.url);
                let get = |f: fn(&RelayCounters) -> &std::sync::atomic::AtomicU64| {
                    c.as_ref().map_or(0, |c| RelayCounters::get(f(c)))
                };
                RelayStatus {
                    events_received: get(|c| &c.events_received),
                    events_accepted: get(|c| &c.events_accepted),
                    events_invalid: get(|c| &c.events_invalid),
                    events_unmatched: get(|c| &c.events_unmatched),
                    notices: get(|c| &c.notices),
                    closed: get(|c| &c.closed),
                    garbage_frames: get(|c| &c.garbage_frames),
                    events_unknown_subscription: get(|c| &c.events_unknown_subscription),
                    auth_challenges: get(|c| &c.auth_challenges),
                    connects: get(|c| &c.connects),
                    disconnects: get(|c| &c.disconnects),
                    thread_restarts: get(|c| &c.thread_restarts),
                    oversized_frames: get(|c| &c.oversized_frames),
                    signature_checks: get(|c| &c.signature_checks),
                    copies_not_forwarded: get(|c| &c.copies_not_forwarded),
                    fetch_ids_in_flight: get(|c| &c.fetch_ids_in_flight),
                    forward_bytes: get(|c| &c.forward_bytes),
                    forward_byte_waits: get(|c| &c.forward_byte_waits),
                    progress,
                    url: s.url,
                    connection_status: s.connection_status,
                    health: s.health,
                    is_bootstrap: s.is_bootstrap,
                    target_repos: s.target_repos,
                    target_root_events: s.target_root_events,
                    confirmed_repos: s.confirmed_repos,
                    confirmed_root_events: s.confirmed_root_events,
                    pending_batches: s.pending_batches,
                    pending_repos: s.pending_repos,
                    pending_root_events: s.pending_root_events,
                    open_subscriptions: s.open_subscriptions,
                    last_connected: s.last_connected,
                    last_error: s.last_error.map(|e| e.to_string()),
                    catch_up_since: s.catch_up_since,
                    failed_batches: s.failed_batches,
                    incomplete_queries: s.incomplete_queries,
                    ids_undelivered: s.ids_undelivered,
                    history_short: s.history_short,
                    learned_cap: s.learned_cap,
                    queued_queries: s.queued_queries,
                    polled_queries: s.polled_queries,
                    loading_queries: s.loading_queries,
                    reopen_pending: s.reopen_pending,
                    nip77: s.nip77,
                    reconciliations_pending: s.reconciliations_pending,
                    failures: s.failures,
                }
            })
            .collect();
        let own = &self.config.own_relay;
        Status {
            own_relay: m.own_status(),
            forwarder_connected: f.connected.load(Ordering::Relaxed) == 1,
            repos: m.repo_index().len(),
            root_events: m.root_event_count(),
            thread_events: m.thread_event_count(),
            relays,
            forwarded: f.stored.load(Ordering::Relaxed),
            duplicates: f.duplicates.load(Ordering::Relaxed),
            rejected: f.rejected.load(Ordering::Relaxed),
            forward_backlog: f.unresolved.load(Ordering::Relaxed),
            invalid: self.metrics.sum(own, |c| &c.events_invalid),
            unmatched: self.metrics.sum(own, |c| &c.events_unmatched),
            self_sync_pending: m.self_sync_pending(),
            sync: m.counters(),
            forward_queue_depth: f.queue_depth.load(Ordering::Relaxed),
            forward_resent: f.resent.load(Ordering::Relaxed),
            forward_relay_errors: f.relay_errors.load(Ordering::Relaxed),
            forward_rate_limited: f.rate_limited.load(Ordering::Relaxed),
            forward_purgatory: f.purgatory.load(Ordering::Relaxed),
            forward_set_aside: f.set_aside.load(Ordering::Relaxed),
            forward_aside: f.aside.load(Ordering::Relaxed),
            forward_aside_overflow: f.aside_overflow.load(Ordering::Relaxed),
            forward_pace_ms: f.pace_ms.load(Ordering::Relaxed),
            ok_latency: {
                let (cumulative, sum_secs, count) = f.ok_latency.snapshot();
                LatencySnapshot {
                    bounds_ms: metrics::LATENCY_BUCKETS_MS.to_vec(),
                    cumulative,
                    sum_secs,
                    count,
                }
            },
            rejected_by_reason: metrics::REJECT_REASONS
                .iter()
                .zip(&f.rejected_by_reason)
                .map(|(r, n)| (r.label(), n.load(Ordering::Relaxed)))
                .collect(),
            thread_restarts: self.metrics.thread_restarts.load(Ordering::Relaxed),
            forwarder_restarts: self.metrics.forwarder_restarts.load(Ordering::Relaxed),
            relays_refused: self.metrics.relays_refused.load(Ordering::Relaxed),
            refused_relays: self.metrics.refused(),
            coordinator_running: self
                .coordinator
                .lock()
                .as_ref()
                .is_some_and(|h| !h.is_finished()),
            forward_bytes: f.bytes.load(Ordering::Relaxed),
            forward_bytes_peak: f.bytes_peak.load(Ordering::Relaxed),
            repo_scope: self.config.repo_scope(),
            targets: m.target_report(),
            hosts_with_several_urls: {
                let mut h = m.hosts_with_several_urls();
                h.truncate(MAX_HOSTS_SHOWN);
                h
            },
            relays_failing: m.relays_failing(),
            state_file: self.state_counters.status(),
            progress,
        }
    }

    /// Reports waiting in the coordinator's input channel (read without a lock).
    pub fn input_backlog(&self) -> usize {
        self.inputs.len()
    }

    /// Test hook: makes a relay thread, the self-subscription or the forwarder panic, to
    /// check that the coordinator notices, reports and restarts it.
    #[cfg(feature = "testing")]
    pub fn inject_panic(&self, target: PanicTarget) {
        let _ = self.inputs.send(Input::InjectPanic(target));
    }

    /// `Ok` while the engine can do its work: the coordinator and forwarder threads run and
    /// both connections to the own relay (self-subscription and forwarder) are up; else
    /// what is wrong.
    pub fn health(&self) -> Result<(), String> {
        let finished = |h: &Mutex<Option<JoinHandle<_>>>| {
            h.lock()
                .as_ref()
                .is_none_or(|h: &JoinHandle<_>| h.is_finished())
        };
        if finished(&self.coordinator) {
            return Err("the coordinator thread has stopped".into());
        }
        if self.machine.read().own_status() != ConnectionStatus::Connected {
            return Err(format!(
                "the own relay {} is not connected (self-subscription)",
                self.config.own_relay
            ));
        }
        if self.metrics.forward.connected.load(Ordering::Relaxed) != 1 {
            return Err(format!(
                "the own relay {} is not connected (forwarder)",
                self.config.own_relay
            ));
        }
        Ok(())
    }

    /// Read access to the sync machine (indexes, subscriptions) for inspection.
    pub fn with_machine<R>(&self, f: impl FnOnce(&SyncMachine) -> R) -> R {
        f(&self.machine.read())
    }

    /// Stops every thread and joins them within `deadline`.
    ///
    /// Returns [`Error::ShutdownTimeout`] naming the threads still running at the deadline.
    /// A relay thread still inside a connect attempt after a short grace holds no sync state
    /// and no event: it is left to end at its connect deadline and is not named. The coordinator
    /// stops the forwarder and the relay threads and joins them. The lock of
    /// `Config::state_dir` is released once every thread stopped, or when the handle is
    /// dropped.
    pub fn shutdown(&self, deadline: Duration) -> Result<(), Error> {
        let end = Instant::now() + deadline;
        // The deadline and the flag reach the coordinator even when its input channel is
        // full (the message below is only a wake-up and may not fit).
        *self.stop_deadline.lock() = Some(end);
        self.stopping.store(true, Ordering::SeqCst);
        let _ = self.inputs.try_send(Input::Shutdown(end));
        let mut running = Vec::new();
        // Taken out first: `status` must not wait on this lock while we join.
        let coordinator = self.coordinator.lock().take();
        if let Some(h) = coordinator {
            while !h.is_finished() && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() {
                if let Ok(r) = h.join() {
                    running.extend(r);
                }
            } else {
                running.push("coordinator".to_string());
            }
        }
        if running.is_empty() {
            // Everything stopped, the state file written: another instance may take over.
            self.state_lock.lock().take();
            Ok(())
        } else {
            Err(Error::ShutdownTimeout { running })
        }
    }
}

impl Drop for SyncHandle {
    fn drop(&mut self) {
        if self.coordinator.lock().is_some() {
            if let Err(e) = self.shutdown(Duration::from_secs(5)) {
                log::warn!("engine dropped without shutdown: {e}");
            }
        }
    }
}
