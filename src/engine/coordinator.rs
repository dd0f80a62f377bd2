//! The coordinator thread: the only writer of sync state.
//!
//! It feeds reports and timer ticks into [`SyncMachine`] and carries out the commands it
//! returns: spawning relay threads, passing REQ/CLOSE to them, telling the forwarder to retry.
//! It never waits on another thread except with a deadline, and never blocks on a channel
//! only it could drain (commands to relay threads go through unbounded channels).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use log::{debug, error, info, warn};
use parking_lot::{Mutex, RwLock};

use crate::config::Config;
use crate::core::dedup::ForwardGate;
use crate::core::progress::{Progress, ProgressTracker, RelayCounts};
use crate::core::session::Disconnect;
use crate::core::sync::{Route, SyncMachine};
use crate::core::time::Time;
use crate::engine::connection::{self, ConnectionThread, Control, Role};
use crate::engine::forwarder::ForwardItem;
use crate::engine::forwarder::{Forwarder, ForwarderControl};
use crate::engine::metrics::{Metrics, RelayCounters};
use crate::engine::Input;
use crate::net::policy::AddressPolicy;
use crate::net::ws::SocketWaker;
use crate::shared::RelayUrl;

struct RelayThread {
    control: Sender<Control>,
    handle: JoinHandle<()>,
    /// Ends the thread's blocked read when it is told to stop.
    waker: SocketWaker,
    /// The generation of the last `Control::Connect` sent to it.
    generation: u64,
}

/// The longest the coordinator sleeps without an input or a timer of the machine: how late
/// it may notice a relay thread that ended (`watch`) or a stop flag whose message did not
/// fit a full channel, and how coarse the state file's snapshot cadence may get. Each wake costs
/// a `SyncMachine::poll_timeout` lookup and the watch, so with 1,000 idle relays a much
/// shorter wait would show in idle CPU (decision 0067).
const MAX_WAIT: Duration = Duration::from_secs(2);

/// How often the coordinator looks for relay threads that ended: each look visits every
/// thread's handle, which with 1,000 relays was most of an idle coordinator's CPU when done
/// at every wake-up (decision 0067). A relay thread that ended is restarted within
/// this long (plus `MAX_WAIT`); the forwarder is looked at on every turn.
const WATCH_INTERVAL: Duration = Duration::from_secs(5);

/// How long a stop waits for the relay threads after telling them to end: one reading ends
/// within a tick of its wake-up; one blocked in a connect that never answers is left (the
/// process ends without it), so a stop never waits on connections that never answer.
const RELAY_STOP_GRACE: Duration = Duration::from_secs(2);

/// The key for the own relay's challenges: `own_auth_keys` only (issue 20: never the remote
/// relays' key unless the operator gives the same key to both).
pub(super) fn own_keys(config: &Config) -> Option<nostr::key::Keys> {
    config.own_auth_keys.clone()
}

/// Starts the forwarder thread.
pub(super) fn spawn_forwarder(f: &Forwarder) -> std::io::Result<JoinHandle<()>> {
    let f = f.clone();
    std::thread::Builder::new()
        .name("forwarder".into())
        .spawn(move || f.run())
}

/// The coordinator's state besides the machine.
pub(super) struct Coordinator {
    /// The sync machine, shared read-only with status readers.
    pub machine: Arc<RwLock<SyncMachine>>,
    /// Reports in.
    pub inputs: Receiver<Input>,
    /// A sender for new relay threads' reports.
    pub inputs_tx: Sender<Input>,
    /// Checked events out (handed to new remote relay threads).
    pub forward_tx: Sender<ForwardItem>,
    /// Commands to the forwarder.
    pub forwarder: Sender<ForwarderControl>,
    /// What the forwarder thread is started from (again, if it dies).
    pub forwarder_spec: Forwarder,
    /// The running forwarder thread.
    pub forwarder_thread: Option<JoinHandle<()>>,
    /// When the forwarder was last restarted (none: never).
    pub forwarder_restarted: Option<Instant>,
    /// Configuration.
    pub config: Config,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Samples of the progress counters (read by `SyncHandle::status`).
    pub progress: Arc<Mutex<ProgressTracker>>,
    /// Which checked events go to the forwarder (shared with the relay threads).
    pub gate: Arc<ForwardGate>,
    /// Set when the engine stops.
    pub stopping: Arc<AtomicBool>,
    /// The shutdown deadline, set by `SyncHandle::shutdown` before `stopping`.
    pub stop_deadline: Arc<Mutex<Option<Instant>>>,
    /// The address policy handed to every relay thread.
    pub policy: Arc<AddressPolicy>,
    /// Writes the state file (`--state-dir`).
    pub state: Option<crate::engine::state_file::StateWriter>,
}

impl Coordinator {
    /// Runs until an `Input::Shutdown`; then stops every relay thread and joins them until
    /// `deadline`. Returns the names of threads that did not end in time.
    pub(super) fn run(mut self) -> Vec<String> {
        let clock = self.config.clock.clone();
        let mut threads: HashMap<RelayUrl, RelayThread> = HashMap::default();
        let mut retired: Vec<(String, JoinHandle<()>)> = Vec::new();
        self.machine.write().start(clock.now());
        self.execute(&mut threads, &mut retired);
        let mut next_summary = clock.now().plus(self.config.summary_interval);
        let mut next_watch = Instant::now();
        let shutdown_deadline = loop {
            // The flag, not only the message: the message may not fit a full channel.
            if self.stopping.load(Ordering::SeqCst) {
                break self.stop_deadline();
            }
            let now = clock.now();
            let wake = self.machine.read().poll_timeout();
            let mut wait = wake.map_or(MAX_WAIT, |t| t.since(now));
            wait = wait.min(MAX_WAIT);
            // Whether the machine may have changed since `wake` was computed.
            let mut changed = false;
            match self.inputs.recv_timeout(wait) {
                Ok(Input::Shutdown(deadline)) => break deadline,
                #[cfg(feature = "testing")]
                Ok(Input::InjectPanic(target)) => self.inject_panic(&threads, target),
                Ok(Input::Report(r)) => {
                    changed = true;
                    let mut m = self.machine.write();
                    m.handle_report(r, clock.now());
                    // Take what else is waiting in one go (bounded, so timers still run).
                    for _ in 0..1024 {
                        match self.inputs.try_recv() {
                            Ok(Input::Report(r)) => m.handle_report(r, clock.now()),
                            Ok(Input::Shutdown(d)) => {
                                drop(m);
                                self.execute(&mut threads, &mut retired);
                                return self.stop(threads, retired, d);
                            }
                            #[cfg(feature = "testing")]
                            Ok(Input::InjectPanic(target)) => self.inject_panic(&threads, target),
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    break Instant::now() + Duration::from_secs(5);
                }
            }
            let now = clock.now();
            // Without a report the machine is as it was when `wake` was computed: no second
            // walk over every link (idle CPU with many relays; decision 0067).
            let due = if changed {
                self.machine.read().poll_timeout()
            } else {
                wake
            };
            if due.is_some_and(|t| t <= now) {
                self.machine.write().handle_timeout(now);
            }
            self.execute(&mut threads, &mut retired);
            retired.retain(|(_, h)| !h.is_finished());
            if !self.stopping.load(Ordering::SeqCst) {
                // The forwarder (one handle) at every turn: while it is down, copies claimed by
                // it are dropped and relay threads wait for room. The relay threads' 1,000
                // handles every `WATCH_INTERVAL`.
                let relays = Instant::now() >= next_watch;
                if relays {
                    next_watch = Instant::now() + WATCH_INTERVAL;
                }
                self.watch(&mut threads, relays);
                self.execute(&mut threads, &mut retired);
            }
            if let Some(w) = &mut self.state {
                w.tick(&self.machine, now, &self.metrics);
            }
            self.sample_progress(now);
            if now >= next_summary {
                next_summary = now.plus(self.config.summary_interval);
                self.summary(now);
            }
        };
        self.stop(threads, retired, shutdown_deadline)
    }

    fn stop_deadline(&self) -> Instant {
        self.stop_deadline
            .lock()
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(5))
    }

    #[cfg(feature = "testing")]
    fn inject_panic(
        &self,
        threads: &HashMap<RelayUrl, RelayThread>,
        target: crate::engine::PanicTarget,
    ) {
        match target {
            crate::engine::PanicTarget::Relay(url) => self.send(threads, &url, Control::Panic),
            crate::engine::PanicTarget::Forwarder => {
                let _ = self.forwarder.send(ForwarderControl::Panic);
            }
        }
    }

    /// Notices threads that ended although nobody asked them to (a panic: relay threads and
    /// the forwarder only end on shutdown), logs it at error level, counts it
    /// (`Status::thread_restarts`) and starts them again. A relay the machine believes
    /// connected or connecting gets a `Disconnected` report, so the machine reconnects it as
    /// after any lost connection (and its next `Connect` spawns a fresh thread); the
    /// forwarder is restarted at once (events in its queue are lost; the machine is told
    /// with [`crate::core::Report::ForwarderLost`] and reads every relay's history again; the
    /// backlog counter is reset to what waits in its channel).
    fn watch(&mut self, threads: &mut HashMap<RelayUrl, RelayThread>, relays: bool) {
        let dead: Vec<RelayUrl> = if relays {
            threads
                .iter()
                .filter(|(_, t)| t.handle.is_finished())
                .map(|(u, _)| u.clone())
                .collect()
        } else {
            Vec::new()
        };
        for relay in dead {
            let Some(t) = threads.remove(&relay) else {
                continue;
            };
            let panicked = t.handle.join().is_err();
            let how = if panicked { "panicked" } else { "ended" };
            error!("{relay}: relay thread {how}; starting it again");
            self.metrics.thread_restarts.fetch_add(1, Ordering::Relaxed);
            RelayCounters::inc(&self.metrics.relay(&relay).thread_restarts);
            let live = {
                let m = self.machine.read();
                let status = if relay == self.config.own_relay {
                    Some(m.own_status())
                } else {
                    m.relay(&relay).map(|r| r.state().connection_status)
                };
                status.is_some_and(|s| s != crate::core::ConnectionStatus::Disconnected)
            };
            if live {
                self.machine.write().handle_report(
                    crate::core::Report::Disconnected {
                        relay: relay.clone(),
                        generation: t.generation,
                        cause: Disconnect::ThreadLost { panicked },
                    },
                    self.config.clock.now(),
                );
            }
        }
        // A forwarder that dies at once again is restarted at most once a second.
        let too_soon = self
            .forwarder_restarted
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1));
        if !too_soon
            && self
                .forwarder_thread
                .as_ref()
                .is_some_and(|h| h.is_finished())
        {
            self.forwarder_restarted = Some(Instant::now());
            let how = match self.forwarder_thread.take().map(|h| h.join()) {
                Some(Err(_)) => "panicked",
                _ => "ended",
            };
            error!("forwarder thread {how}; starting it again");
            self.metrics.thread_restarts.fetch_add(1, Ordering::Relaxed);
            self.metrics
                .forwarder_restarts
                .fetch_add(1, Ordering::Relaxed);
            // Events claimed for the lost forwarder are handed to the new one again, and
            // every relay's history is read again: what the lost one held (and what relay
            // threads were handing to it) is fetched anew (issue 36).
            self.gate.new_epoch();
            self.machine
                .write()
                .handle_report(crate::core::Report::ForwarderLost, self.config.clock.now());
            let f = &self.metrics.forward;
            f.connected.store(0, Ordering::Relaxed);
            f.unresolved
                .store(self.forward_tx.len() as u64, Ordering::Relaxed);
            if f.full.swap(0, Ordering::Relaxed) == 1 {
                self.machine.write().handle_report(
                    crate::core::Report::ForwardBackPressure { active: false },
                    self.config.clock.now(),
                );
            }
            match spawn_forwarder(&self.forwarder_spec) {
                Ok(h) => self.forwarder_thread = Some(h),
                // Tried again on the next turn.
                Err(e) => error!("cannot start the forwarder thread: {e}"),
            }
        }
    }

    /// Records a sample of the progress counters when one is due
    /// ([`crate::core::progress::SAMPLE_INTERVAL`]): a walk over the known relays, no
    /// allocation but for relays new to the tracker.
    fn sample_progress(&self, now: Time) {
        if !self.progress.lock().due(now) {
            return;
        }
        // The same lock order as `SyncHandle::status`: the machine, then the tracker.
        let m = self.machine.read();
        let mut tracker = self.progress.lock();
        let stored = self.metrics.forward.stored.load(Ordering::Relaxed);
        tracker.sample(
            now,
            stored,
            m.relays().map(|r| {
                let (url, queries) = (r.url(), r.history_queries_completed());
                let events = self
                    .metrics
                    .relay_if_known(url)
                    .map_or(0, |c| RelayCounters::get(&c.events_accepted));
                (
                    url,
                    RelayCounts {
                        queries_completed: queries,
                        events_forwarded: events,
                    },
                )
            }),
        );
    }

    /// The progress in total at `now` for the summary line.
    fn progress(
        &self,
        m: &SyncMachine,
        statuses: &[crate::core::sync::RelaySyncStatus],
        now: Time,
    ) -> Progress {
        crate::engine::progress_at(&self.metrics, &self.progress.lock(), m, statuses, now).0
    }

    fn summary(&self, now: Time) {
        let m = self.machine.read();
        let statuses = m.relay_statuses(now);
        let p = self.progress(&m, &statuses, now);
        info!(
            "progress: repos confirmed {}/{}, root events {}/{} (summed over relays); history queries pending {}; forwarded {}/s over the last minute; relays settled {}/{}; time to settle: {}",
            p.confirmed_repos,
            p.target_repos,
            p.confirmed_root_events,
            p.target_root_events,
            p.history_queries_pending,
            p.events_forwarded_per_second
                .map_or_else(|| "-".to_string(), |r| format!("{r:.1}")),
            p.relays_settled,
            statuses.len(),
            p.eta,
        );
        let connected = statuses
            .iter()
            .filter(|s| s.connection_status == crate::core::ConnectionStatus::Connected)
            .count();
        let f = &self.metrics.forward;
        let own = &self.config.own_relay;
        info!(
            "relays connected {connected}/{} (refused {}); repos {}; root events {}; events forwarded {} (duplicates {}), rejected {}, invalid {}, unmatched {}; thread restarts {}",
            statuses.len(),
            self.metrics.relays_refused.load(Ordering::Relaxed),
            m.repo_index().len(),
            m.root_event_count(),
            f.stored.load(Ordering::Relaxed),
            f.duplicates.load(Ordering::Relaxed),
            f.rejected.load(Ordering::Relaxed),
            self.metrics.sum(own, |c| &c.events_invalid),
            self.metrics.sum(own, |c| &c.events_unmatched),
            self.metrics.thread_restarts.load(Ordering::Relaxed),
        );
        let t = m.target_report();
        let dropped =
            t.relays_over_pubkey_quota + t.relays_over_global_cap + t.relays_over_host_cap;
        if dropped > 0 || t.repos_blocked > 0 {
            warn!(
                "relay quotas: {dropped} of {} named relays dropped ({} over a pubkey's quota of {} from {} pubkeys, {} over max_relays {}, {} over max_urls_per_host {}); {} relays failing their connects; repos out of scope {}, blocked {}",
                t.relays_wanted,
                t.relays_over_pubkey_quota,
                self.config.max_relays_per_pubkey,
                t.pubkeys_over_quota,
                t.relays_over_global_cap,
                self.config.max_relays,
                t.relays_over_host_cap,
                self.config.max_urls_per_host,
                m.relays_failing(),
                t.repos_out_of_scope,
                t.repos_blocked
            );
        } else if t.repos_out_of_scope > 0 {
            info!(
                "repository scope: {} repos in scope, {} out of scope (not listing this service)",
                t.repos_in_scope, t.repos_out_of_scope
            );
        }
    }

    fn execute(
        &self,
        threads: &mut HashMap<RelayUrl, RelayThread>,
        retired: &mut Vec<(String, JoinHandle<()>)>,
    ) {
        loop {
            let Some(cmd) = self.machine.write().poll_command() else {
                break;
            };
            match cmd.route(&self.config.own_relay) {
                Route::Connect { relay, generation } => {
                    if !threads.contains_key(&relay) {
                        match self.spawn_relay(&relay) {
                            Ok(t) => {
                                threads.insert(relay.clone(), t);
                            }
                            Err(e) => {
                                // Fed straight into the machine: the coordinator never
                                // sends into its own input channel (it could be full).
                                error!("{relay}: cannot spawn a thread: {e}");
                                self.machine.write().handle_report(
                                    crate::core::Report::Disconnected {
                                        relay: relay.clone(),
                                        generation,
                                        cause: Disconnect::Spawn(e.to_string()),
                                    },
                                    self.config.clock.now(),
                                );
                                continue;
                            }
                        }
                    }
                    if let Some(t) = threads.get_mut(&relay) {
                        t.generation = generation;
                    }
                    self.send(threads, &relay, Control::Connect { generation });
                }
                Route::Relay(relay, control) => self.send(threads, &relay, control),
                Route::Forget(relay) => {
                    if let Some(t) = threads.remove(&relay) {
                        let _ = t.control.send(Control::Shutdown);
                        t.waker.wake();
                        retired.push((relay.to_string(), t.handle));
                    }
                    self.metrics.forget(&relay);
                }
                Route::RetryRejected { repos, roots } => {
                    if self
                        .forwarder
                        .send(ForwarderControl::RetryRejected { repos, roots })
                        .is_err()
                    {
                        log::warn!("forwarder has stopped; rejected events are not retried");
                    }
                }
            }
        }
    }

    fn send(&self, threads: &HashMap<RelayUrl, RelayThread>, relay: &RelayUrl, c: Control) {
        match threads.get(relay) {
            Some(t) => {
                if t.control.send(c).is_err() {
                    warn!("{relay}: relay thread has ended; command dropped");
                }
            }
            None => debug!("{relay}: no thread for command {c:?}"),
        }
    }

    fn spawn_relay(&self, relay: &RelayUrl) -> std::io::Result<RelayThread> {
        let (tx, rx) = unbounded();
        let role = if *relay == self.config.own_relay {
            Role::Own
        } else {
            Role::Remote(self.forward_tx.clone())
        };
        let counters: Arc<RelayCounters> = self.metrics.relay(relay);
        let waker = SocketWaker::default();
        let handle = connection::spawn(ConnectionThread {
            url: relay.clone(),
            role,
            control: rx,
            reports: self.inputs_tx.clone(),
            ws: self.config.ws,
            tls: self.config.tls.clone(),
            ping_interval: self.config.ping_interval,
            pong_timeout: self.config.pong_timeout,
            counters,
            metrics: self.metrics.clone(),
            gate: self.gate.clone(),
            stopping: self.stopping.clone(),
            clock: self.config.clock.clone(),
            nip11_timeout: self.config.nip11_timeout,
            auth_keys: if *relay == self.config.own_relay {
                own_keys(&self.config)
            } else {
                self.config.auth_keys.clone()
            },
            policy: self.policy.clone(),
            forward_limits: self.config.forward,
            waker: waker.clone(),
        })?;
        Ok(RelayThread {
            control: tx,
            handle,
            waker,
            generation: 0,
        })
    }

    fn stop(
        mut self,
        threads: HashMap<RelayUrl, RelayThread>,
        mut retired: Vec<(String, JoinHandle<()>)>,
        deadline: Instant,
    ) -> Vec<String> {
        info!("stopping {} relay threads", threads.len());
        self.stopping.store(true, Ordering::Relaxed);
        for (url, t) in threads {
            // A thread that already ended has dropped its receiver: nothing to stop. A quiet
            // one blocked in its read (up to the quiet tick) is woken.
            let _ = t.control.send(Control::Shutdown);
            t.waker.wake();
            retired.push((url.to_string(), t.handle));
        }
        // Drain reports so no relay thread waits on a full channel while we join. A thread
        // that reads ends within a tick of its wake-up; one blocked in a connect (a relay
        // that never answers the handshake) ends only when its connect deadline passes, and
        // the stop does not wait for it beyond `RELAY_STOP_GRACE` (issue 36: with 150 silent
        // relays SIGTERM took the whole stop timeout).
        let relays_deadline = deadline.min(Instant::now() + RELAY_STOP_GRACE);
        while Instant::now() < relays_deadline && retired.iter().any(|(_, h)| !h.is_finished()) {
            while self.inputs.try_recv().is_ok() {}
            std::thread::sleep(Duration::from_millis(10));
        }
        // A relay thread still inside a connect attempt holds no sync state and no event: it
        // is left to end at its connect deadline (it sees the shutdown then), not reported as
        // a thread the stop could not end.
        let (connecting, ended): (Vec<_>, Vec<_>) =
            retired.drain(..).partition(|(_, h)| !h.is_finished());
        retired = ended;
        if !connecting.is_empty() {
            info!(
                "{} relay threads are still in a connect attempt; they end at their connect deadline",
                connecting.len()
            );
        }
        // Reading has stopped: the forwarder flushes what it holds, until the deadline.
        if self
            .forwarder
            .send(ForwarderControl::Drain(deadline))
            .is_err()
        {
            warn!("forwarder already stopped; events it held are refetched at the next start");
        }
        if let Some(h) = self.forwarder_thread.take() {
            while Instant::now() < deadline && !h.is_finished() {
                std::thread::sleep(Duration::from_millis(10));
            }
            retired.push(("forwarder".to_string(), h));
        }
        // After the drain: what the machine confirmed is in the own relay now (unless the
        // deadline cut the drain short; then the last saved file stays).
        if let Some(w) = self.state.take() {
            let now = self.config.clock.now();
            if let Some(h) = w.finish(&self.machine, now, &self.metrics, deadline) {
                retired.push(("state-writer".to_string(), h));
            }
        }
        let mut running = Vec::new();
        for (name, h) in retired {
            if h.is_finished() {
                let _ = h.join();
            } else {
                running.push(name);
            }
        }
        running
    }
}
