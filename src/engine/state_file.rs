//! The state file of `--state-dir` (issue 11): the machine's [`SyncSnapshot`] in a
//! versioned JSON envelope, written atomically, read once at start.
//!
//! ```json
//! {"format":"grasp-sync-state","version":1,"own_relay":"ws://127.0.0.1:7777",
//!  "config":"scope=…;shard=all","saved_at_ms":1764620000000,
//!  "relays":{"wss://relay.example/":{"connected":true,"catch_up_since":1764500000,
//!            "repos":["30617:<pubkey>:<d>"],"root_events":["<id>"],
//!            "next_daily_ms":1764700000000,"nip77":null}}}
//! ```
//!
//! A file that cannot be used (unreadable, larger than [`MAX_FILE_BYTES`], not JSON, another
//! format or version, written for another own relay or another configuration) is reported
//! and ignored: the engine starts with a fresh sync, never fails because of it.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender, TrySendError};

use log::{debug, info, warn};
use parking_lot::{Mutex, RwLock};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::core::sync::{
    with_item_budget, RelaySnapshot, SyncMachine, SyncSnapshot, MAX_STATE_ITEMS, MAX_STATE_RELAYS,
};
use crate::core::time::{Clock, Time};
use crate::engine::metrics::Metrics;

/// The `format` field.
pub const FORMAT: &str = "grasp-sync-state";
/// The `version` this build writes and reads.
pub const VERSION: u64 = 1;
/// The file's name inside the state directory.
pub const FILE_NAME: &str = "sync-state.json";
/// A larger file is not read. The snapshot's own caps keep a written file far below it
/// (at most [`crate::core::sync::MAX_STATE_ITEMS`] items of at most
/// [`crate::core::sync::MAX_STORED_REF_LEN`] bytes).
pub const MAX_FILE_BYTES: u64 = 32 << 20;

/// Why a state file was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum IgnoredReason {
    /// No file yet (first start with this directory).
    Missing,
    /// It could not be read (permissions, I/O error).
    Unreadable,
    /// Larger than [`MAX_FILE_BYTES`].
    TooLarge,
    /// Not valid JSON, or fields of the wrong type.
    Corrupt,
    /// Not a grasp-sync state file (`format`).
    ForeignFormat,
    /// Written by an older format version.
    OlderVersion,
    /// Written by a newer format version.
    NewerVersion,
    /// Written for another own relay.
    OtherOwnRelay,
    /// Written with another repository scope or shard.
    OtherConfig,
}

impl IgnoredReason {
    /// Every reason, for the metrics.
    pub const ALL: [IgnoredReason; 9] = [
        IgnoredReason::Missing,
        IgnoredReason::Unreadable,
        IgnoredReason::TooLarge,
        IgnoredReason::Corrupt,
        IgnoredReason::ForeignFormat,
        IgnoredReason::OlderVersion,
        IgnoredReason::NewerVersion,
        IgnoredReason::OtherOwnRelay,
        IgnoredReason::OtherConfig,
    ];

    /// The label used in logs, `/status` and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            IgnoredReason::Missing => "missing",
            IgnoredReason::Unreadable => "unreadable",
            IgnoredReason::TooLarge => "too_large",
            IgnoredReason::Corrupt => "corrupt",
            IgnoredReason::ForeignFormat => "foreign_format",
            IgnoredReason::OlderVersion => "older_version",
            IgnoredReason::NewerVersion => "newer_version",
            IgnoredReason::OtherOwnRelay => "other_own_relay",
            IgnoredReason::OtherConfig => "other_config",
        }
    }
}

/// What [`load`] found.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Loaded {
    /// A usable snapshot.
    Snapshot(SyncSnapshot),
    /// The file was not used, why, and what exactly was wrong (for the log).
    Ignored(IgnoredReason, String),
}

/// The path of the state file in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

/// Reads the state file of `dir`, written for `own_relay` with configuration `config`.
pub fn load(dir: &Path, own_relay: &str, config: &str) -> Loaded {
    let p = path(dir);
    let file = match File::open(&p) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Loaded::Ignored(IgnoredReason::Missing, format!("no {}", p.display()))
        }
        Err(e) => {
            return Loaded::Ignored(
                IgnoredReason::Unreadable,
                format!("cannot open {}: {e}", p.display()),
            )
        }
    };
    if file.metadata().is_ok_and(|m| m.len() > MAX_FILE_BYTES) {
        return Loaded::Ignored(
            IgnoredReason::TooLarge,
            format!("{} is larger than {MAX_FILE_BYTES} bytes", p.display()),
        );
    }
    let mut text = String::new();
    if let Err(e) = file.take(MAX_FILE_BYTES + 1).read_to_string(&mut text) {
        let reason = if e.kind() == std::io::ErrorKind::InvalidData {
            IgnoredReason::Corrupt
        } else {
            IgnoredReason::Unreadable
        };
        return Loaded::Ignored(reason, format!("cannot read {}: {e}", p.display()));
    }
    if text.len() as u64 > MAX_FILE_BYTES {
        return Loaded::Ignored(
            IgnoredReason::TooLarge,
            format!("{} is larger than {MAX_FILE_BYTES} bytes", p.display()),
        );
    }
    parse(&text, own_relay, config)
}

/// The envelope's fields, undecoded (borrowed from the text: no document tree is built, so
/// a file near the size cap is held once).
#[derive(serde::Deserialize)]
struct Envelope<'a> {
    #[serde(borrow)]
    format: Option<&'a RawValue>,
    #[serde(borrow)]
    version: Option<&'a RawValue>,
    #[serde(borrow)]
    own_relay: Option<&'a RawValue>,
    #[serde(borrow)]
    config: Option<&'a RawValue>,
    #[serde(borrow)]
    saved_at_ms: Option<&'a RawValue>,
    #[serde(borrow)]
    relays: Option<&'a RawValue>,
}

/// At most [`MAX_STATE_RELAYS`] relays are decoded; the rest is skipped unread (counted).
struct CappedRelays(BTreeMap<String, RelaySnapshot>, usize);

impl<'de> serde::Deserialize<'de> for CappedRelays {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = CappedRelays;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of relays")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<CappedRelays, A::Error> {
                let mut out = BTreeMap::new();
                let mut skipped = 0;
                while let Some(url) = map.next_key::<String>()? {
                    if out.len() < MAX_STATE_RELAYS {
                        let r = map.next_value::<RelaySnapshot>()?;
                        out.insert(url, r);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                        skipped += 1;
                    }
                }
                Ok(CappedRelays(out, skipped))
            }
        }
        d.deserialize_map(V)
    }
}

/// Checks the envelope of `text` and takes the snapshot out of it.
pub fn parse(text: &str, own_relay: &str, config: &str) -> Loaded {
    let corrupt = |what: String| Loaded::Ignored(IgnoredReason::Corrupt, what);
    let doc: Envelope = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return corrupt(format!("not JSON: {e}")),
    };
    let string =
        |f: Option<&RawValue>| f.and_then(|r| serde_json::from_str::<String>(r.get()).ok());
    let number = |f: Option<&RawValue>| f.and_then(|r| serde_json::from_str::<u64>(r.get()).ok());
    let format = string(doc.format);
    if format.as_deref() != Some(FORMAT) {
        return Loaded::Ignored(
            IgnoredReason::ForeignFormat,
            format!("format is {format:?}, not {FORMAT:?}"),
        );
    }
    let Some(version) = number(doc.version) else {
        return corrupt("no numeric version".into());
    };
    if version < VERSION {
        return Loaded::Ignored(
            IgnoredReason::OlderVersion,
            format!("version {version} is older than {VERSION}"),
        );
    }
    if version > VERSION {
        return Loaded::Ignored(
            IgnoredReason::NewerVersion,
            format!("version {version} is newer than {VERSION} (written by a newer grasp-sync)"),
        );
    }
    let file_own = string(doc.own_relay).unwrap_or_default();
    if file_own != own_relay {
        return Loaded::Ignored(
            IgnoredReason::OtherOwnRelay,
            format!("written for the own relay {file_own:?}, not {own_relay:?}"),
        );
    }
    let file_config = string(doc.config).unwrap_or_default();
    if file_config != config {
        return Loaded::Ignored(
            IgnoredReason::OtherConfig,
            format!("written with {file_config:?}, now {config:?}"),
        );
    }
    let Some(saved_at_ms) = number(doc.saved_at_ms) else {
        return corrupt("no numeric saved_at_ms".into());
    };
    let Some(raw) = doc.relays else {
        return corrupt("no relays".into());
    };
    let (relays, items_skipped) = with_item_budget(MAX_STATE_ITEMS, || {
        serde_json::from_str::<CappedRelays>(raw.get())
    });
    match relays {
        Ok(CappedRelays(relays, relays_skipped)) => {
            if relays_skipped + items_skipped > 0 {
                warn!(
                    "state file beyond its caps: {relays_skipped} relays and {items_skipped} items skipped (synced in full)"
                );
            }
            Loaded::Snapshot(SyncSnapshot {
                taken_at_ms: saved_at_ms,
                relays,
            })
        }
        Err(e) => corrupt(format!("relays: {e}")),
    }
}

/// The envelope of `snapshot` as written.
pub fn render(snapshot: &SyncSnapshot, own_relay: &str, config: &str) -> String {
    let relays: serde_json::Map<String, Value> = snapshot
        .relays
        .iter()
        .map(|(url, r): (&String, &RelaySnapshot)| {
            (url.clone(), serde_json::to_value(r).unwrap_or(Value::Null))
        })
        .collect();
    json!({
        "format": FORMAT,
        "version": VERSION,
        "own_relay": own_relay,
        "config": config,
        "saved_at_ms": snapshot.taken_at_ms,
        "relays": relays,
    })
    .to_string()
}

/// Writes `text` as the state file of `dir` atomically: a temporary file in the same
/// directory, written and fsynced, renamed over the old file, then the directory fsynced.
/// A crash at any point leaves either the old file or the new one, never a mix. Returns the
/// bytes written.
pub fn write_atomically(dir: &Path, text: &str) -> std::io::Result<u64> {
    // A name nobody can guess, created exclusively: `create_new` (O_CREAT | O_EXCL) fails
    // on anything already there, a symbolic link included, and never follows one.
    let tmp = dir.join(format!(
        "{FILE_NAME}.tmp-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    write_via(dir, &tmp, text)
}

/// [`write_atomically`] through the temporary file `tmp` (created exclusively).
fn write_via(dir: &Path, tmp: &Path, text: &str) -> std::io::Result<u64> {
    let result = (|| -> std::io::Result<u64> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        drop(f);
        fs::rename(tmp, path(dir))?;
        // The rename itself is durable only once the directory is.
        File::open(dir)?.sync_all()?;
        Ok(text.len() as u64)
    })();
    if result
        .as_ref()
        .is_err_and(|e: &std::io::Error| e.kind() != std::io::ErrorKind::AlreadyExists)
    {
        let _ = fs::remove_file(tmp);
    }
    result
}

/// The name of the lock file in a state directory.
pub(crate) const LOCK_FILE: &str = "sync-state.lock";

/// Takes the lock of the state directory `dir` for this process (an advisory `flock` on
/// [`LOCK_FILE`], released when the returned file is closed, also when the process dies).
/// Two instances sharing one directory would overwrite each other's state: the second one
/// gets an error that says so.
pub(crate) fn lock_dir(dir: &Path) -> Result<File, String> {
    let p = dir.join(LOCK_FILE);
    // A link planted at the lock's name is never followed (opening it would create or
    // touch the file it points to; issue 36).
    if fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(format!(
            "the lock file {} is a symbolic link; grasp-sync follows no links in its state directory: remove it",
            p.display()
        ));
    }
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .map_err(|e| format!("cannot open the lock file {}: {e}", p.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(fs::TryLockError::WouldBlock) => Err(format!(
            "{} is in use by another grasp-sync (its lock {} is held); give each instance a directory of its own",
            dir.display(),
            p.display()
        )),
        Err(fs::TryLockError::Error(e)) => {
            Err(format!("cannot lock {}: {e}", p.display()))
        }
    }
}

/// Removes temporary files that an earlier process left when it died during a write (they
/// carry its process id, so no later write replaces them).
fn remove_stale_temporaries(dir: &Path) {
    let prefix = format!("{FILE_NAME}.tmp-");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        if name.starts_with(&prefix) && e.file_type().is_ok_and(|t| t.is_file()) {
            match fs::remove_file(e.path()) {
                Ok(()) => info!(
                    "removed {}, left by a write that did not finish",
                    e.path().display()
                ),
                Err(err) => warn!("cannot remove {}: {err}", e.path().display()),
            }
        }
    }
}

/// Counters of the state file, shared with status readers.
#[derive(Debug, Default)]
pub(crate) struct StateCounters {
    /// 1 when `--state-dir` is set.
    pub enabled: AtomicU64,
    /// 1 when the file read at start was used.
    pub loaded: AtomicU64,
    /// Files not used at start, by reason ([`IgnoredReason::ALL`] order).
    pub ignored: [AtomicU64; IgnoredReason::ALL.len()],
    /// What was wrong with the ignored file (for `/status`).
    pub ignored_detail: Mutex<Option<(IgnoredReason, String)>>,
    /// Relays restored for a quick reconnect at start.
    pub relays_restored: AtomicU64,
    /// Files written.
    pub saves: AtomicU64,
    /// Writes that failed.
    pub save_failures: AtomicU64,
    /// Wall clock (Unix ms) of the last successful write; 0: none yet.
    pub last_save_ms: AtomicU64,
    /// Why the last write failed, if the last write failed.
    pub last_error: Mutex<Option<String>>,
}

impl StateCounters {
    /// Records why the file was not used.
    pub(crate) fn ignored(&self, reason: IgnoredReason, detail: String) {
        if let Some(i) = IgnoredReason::ALL.iter().position(|r| *r == reason) {
            self.ignored[i].fetch_add(1, Ordering::Relaxed);
        }
        *self.ignored_detail.lock() = Some((reason, detail));
    }

    /// The plain view for [`crate::Status`].
    pub(crate) fn status(&self) -> StateFileStatus {
        let last = self.last_save_ms.load(Ordering::Relaxed);
        StateFileStatus {
            enabled: self.enabled.load(Ordering::Relaxed) == 1,
            loaded: self.loaded.load(Ordering::Relaxed) == 1,
            ignored: self
                .ignored_detail
                .lock()
                .as_ref()
                .map(|(r, d)| (r.as_str(), d.clone())),
            ignored_by_reason: IgnoredReason::ALL
                .iter()
                .zip(&self.ignored)
                .map(|(r, n)| (r.as_str(), n.load(Ordering::Relaxed)))
                .collect(),
            relays_restored: self.relays_restored.load(Ordering::Relaxed),
            saves: self.saves.load(Ordering::Relaxed),
            save_failures: self.save_failures.load(Ordering::Relaxed),
            last_save_ms: (last > 0).then_some(last),
            last_error: self.last_error.lock().clone(),
        }
    }
}

/// The state file in a [`crate::Status`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StateFileStatus {
    /// `--state-dir` is set.
    pub enabled: bool,
    /// The file read at start was used.
    pub loaded: bool,
    /// Why the file read at start was not used (reason label, details).
    pub ignored: Option<(&'static str, String)>,
    /// Files not used at start, by reason label.
    pub ignored_by_reason: Vec<(&'static str, u64)>,
    /// Relays restored for a quick reconnect at start.
    pub relays_restored: u64,
    /// Files written.
    pub saves: u64,
    /// Writes that failed.
    pub save_failures: u64,
    /// Wall clock (Unix ms) of the last successful write.
    pub last_save_ms: Option<u64>,
    /// Why the last write failed, while it is the latest attempt.
    pub last_error: Option<String>,
}

/// A snapshot is written again after this long even when nothing changed, so that the
/// saved moment stays within the quick-reconnect window of a crash.
pub(crate) const REFRESH: Duration = Duration::from_secs(5 * 60);

/// Reads the state file at start and restores it into `machine`; every outcome is logged
/// and counted.
pub(crate) fn load_into(
    dir: &Path,
    own_relay: &str,
    config: &str,
    machine: &mut SyncMachine,
    now: Time,
    counters: &StateCounters,
) {
    counters.enabled.store(1, Ordering::Relaxed);
    remove_stale_temporaries(dir);
    match load(dir, own_relay, config) {
        Loaded::Snapshot(s) => {
            let report = machine.restore(s, now);
            counters.loaded.store(1, Ordering::Relaxed);
            counters
                .relays_restored
                .store(report.relays_restored as u64, Ordering::Relaxed);
            info!(
                "state file {} loaded: {} relays restored for a quick reconnect",
                path(dir).display(),
                report.relays_restored
            );
        }
        Loaded::Ignored(IgnoredReason::Missing, detail) => {
            info!("no state file yet ({detail}); fresh sync of every relay");
            counters.ignored(IgnoredReason::Missing, detail);
        }
        Loaded::Ignored(reason, detail) => {
            warn!(
                "state file {} ignored ({}): {detail}; fresh sync of every relay (the file is replaced at the next save)",
                path(dir).display(),
                reason.as_str()
            );
            counters.ignored(reason, detail);
        }
    }
}

/// Takes snapshots of the machine and has them written (see the module docs): at most every
/// `interval`, only when they changed (or [`REFRESH`] passed), and only once every event
/// handed to the forwarder before the snapshot was answered by the own relay, so that no
/// saved confirmation is ahead of what the own relay holds. Rendering, writing and fsync run
/// on a thread of their own (`state-writer`): a slow disk never stalls the coordinator.
pub(crate) struct StateWriter {
    interval: Duration,
    next_snapshot: Option<Time>,
    last_written: Option<BTreeMap<String, RelaySnapshot>>,
    last_write: Option<Time>,
    pending: Option<SyncSnapshot>,
    jobs: Option<Sender<SyncSnapshot>>,
    done: Receiver<(BTreeMap<String, RelaySnapshot>, Time)>,
    thread: Option<JoinHandle<()>>,
    /// `Metrics::forwarder_restarts` when this writer last looked.
    forwarder_restarts: u64,
    /// A forwarder thread was lost (with the events in its queue, while confirmations of
    /// their batches stay in the machine): from then on no relay is saved, so that a restart
    /// is a fresh sync, as it would be without `--state-dir`.
    tainted: bool,
}

impl StateWriter {
    /// A writer for `dir`, with its thread started.
    pub(crate) fn new(
        dir: PathBuf,
        own_relay: String,
        config: String,
        interval: Duration,
        counters: Arc<StateCounters>,
        clock: Arc<dyn Clock>,
    ) -> std::io::Result<Self> {
        let (jobs, job_rx) = bounded::<SyncSnapshot>(1);
        let (done_tx, done) = unbounded();
        let thread = std::thread::Builder::new()
            .name("state-writer".into())
            .spawn(move || {
                for snap in job_rx {
                    let now = clock.now();
                    if write(&dir, &own_relay, &config, &snap, now, &counters) {
                        let _ = done_tx.send((snap.relays, now));
                    }
                }
            })?;
        Ok(StateWriter {
            interval: interval.max(Duration::from_millis(100)),
            next_snapshot: None,
            last_written: None,
            last_write: None,
            pending: None,
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            forwarder_restarts: 0,
            tainted: false,
        })
    }

    /// Takes the snapshot to save: without any relay once a forwarder thread was lost.
    fn snapshot(
        &mut self,
        machine: &RwLock<SyncMachine>,
        now: Time,
        metrics: &Metrics,
    ) -> SyncSnapshot {
        let restarts = metrics.forwarder_restarts.load(Ordering::SeqCst);
        if restarts != self.forwarder_restarts {
            self.forwarder_restarts = restarts;
            if !self.tainted {
                warn!(
                    "the forwarder thread was lost with events not yet stored in the own relay; the state file no longer saves any relay (the next start is a fresh sync)"
                );
            }
            self.tainted = true;
        }
        let mut snap = machine.read().snapshot(now);
        if self.tainted {
            snap.relays.clear();
        }
        snap
    }

    /// Called on every coordinator turn.
    pub(crate) fn tick(&mut self, machine: &RwLock<SyncMachine>, now: Time, metrics: &Metrics) {
        while let Ok((relays, at)) = self.done.try_recv() {
            self.last_written = Some(relays);
            self.last_write = Some(at);
        }
        if self.next_snapshot.is_none_or(|t| now >= t) {
            self.next_snapshot = Some(now.plus(self.interval));
            let snap = self.snapshot(machine, now, metrics);
            let refresh = self.last_write.is_none_or(|t| now.since(t) >= REFRESH);
            if refresh || self.last_written.as_ref() != Some(&snap.relays) {
                self.pending = Some(snap);
            }
        }
        // Read after the snapshot: every event of a batch it counts as confirmed was counted
        // here before the batch's EOSE reached the coordinator.
        // A snapshot without relays confirms nothing: it need not wait (a lost forwarder).
        let empty = self.pending.as_ref().is_some_and(|s| s.relays.is_empty());
        if self.pending.is_some()
            && (empty || metrics.forward.unresolved.load(Ordering::SeqCst) == 0)
        {
            if let (Some(snap), Some(jobs)) = (self.pending.take(), &self.jobs) {
                match jobs.try_send(snap) {
                    Ok(()) => {}
                    // A write is still running: the snapshot waits for the next turn.
                    Err(TrySendError::Full(snap)) => self.pending = Some(snap),
                    Err(TrySendError::Disconnected(_)) => {
                        warn!(
                            "the state writer thread has ended; the state file is no longer saved"
                        );
                        self.jobs = None;
                    }
                }
            }
        }
    }

    /// At shutdown, after the forwarder drained: has the machine saved as it is now, unless
    /// events are still unanswered (then the last file stays), and ends the writer thread.
    /// Returns the thread if it is still writing at `deadline`.
    pub(crate) fn finish(
        mut self,
        machine: &RwLock<SyncMachine>,
        now: Time,
        metrics: &Metrics,
        deadline: std::time::Instant,
    ) -> Option<JoinHandle<()>> {
        let snap = self.snapshot(machine, now, metrics);
        let unresolved = metrics.forward.unresolved.load(Ordering::SeqCst);
        if let Some(jobs) = self.jobs.take() {
            if unresolved > 0 && !snap.relays.is_empty() {
                warn!(
                    "state file not saved at shutdown: {unresolved} events are not yet stored in the own relay; the file of the last save stays"
                );
            } else {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if jobs.send_timeout(snap, left).is_err() {
                    warn!("state file not saved at shutdown: the previous write did not finish in time");
                }
            }
        }
        let h = self.thread.take()?;
        while !h.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if h.is_finished() {
            let _ = h.join();
            None
        } else {
            Some(h)
        }
    }
}

/// Renders and writes one snapshot; true on success. Logs and counts the outcome.
fn write(
    dir: &Path,
    own_relay: &str,
    config: &str,
    snap: &SyncSnapshot,
    now: Time,
    counters: &StateCounters,
) -> bool {
    let text = render(snap, own_relay, config);
    match write_atomically(dir, &text) {
        Ok(n) => {
            debug!(
                "state file {} saved ({} relays, {n} bytes)",
                path(dir).display(),
                snap.relays.len()
            );
            counters.saves.fetch_add(1, Ordering::Relaxed);
            counters
                .last_save_ms
                .store(now.wall_millis().max(1), Ordering::Relaxed);
            *counters.last_error.lock() = None;
            true
        }
        Err(e) => {
            let n = counters.save_failures.fetch_add(1, Ordering::Relaxed);
            let line = format!("cannot save the state file {}: {e}", path(dir).display());
            if n == 0 || counters.last_error.lock().is_none() {
                warn!("{line} (tried again at the next save)");
            } else {
                debug!("{line}");
            }
            *counters.last_error.lock() = Some(line);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> SyncSnapshot {
        let mut s = SyncSnapshot {
            taken_at_ms: 1_764_620_000_000,
            ..Default::default()
        };
        s.relays.insert(
            "wss://a.example".into(),
            RelaySnapshot {
                connected: true,
                catch_up_since: 1_764_500_000,
                repos: vec!["30617:ab:r".into()],
                ..Default::default()
            },
        );
        s
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "grasp-sync-state-{name}-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_written_file_reads_back_and_leaves_no_temporary_file() {
        let d = dir("roundtrip");
        let text = render(&snapshot(), "ws://own", "c");
        write_atomically(&d, &text).unwrap();
        write_atomically(&d, &text).unwrap();
        assert_eq!(load(&d, "ws://own", "c"), Loaded::Snapshot(snapshot()));
        let names: Vec<_> = fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![FILE_NAME.to_string()]);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failed_write_keeps_the_old_file() {
        let d = dir("failed");
        let text = render(&snapshot(), "ws://own", "c");
        write_atomically(&d, &text).unwrap();
        // The rename target is a non-empty directory now: the rename fails.
        fs::remove_file(path(&d)).unwrap();
        fs::create_dir(path(&d)).unwrap();
        fs::write(path(&d).join("x"), "x").unwrap();
        assert!(write_atomically(&d, &text).is_err());
        let names: Vec<_> = fs::read_dir(&d).unwrap().collect();
        assert_eq!(names.len(), 1, "temporary file removed");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_planted_symlink_at_the_lock_name_is_refused_not_followed() {
        let d = dir("locklink");
        let victim = d.join("elsewhere");
        std::os::unix::fs::symlink(&victim, d.join(LOCK_FILE)).unwrap();
        let err = lock_dir(&d).unwrap_err();
        assert!(err.contains("symbolic link"), "{err}");
        assert!(!victim.exists(), "nothing created through the link");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_planted_symlink_at_the_temporary_name_is_never_followed() {
        let d = dir("symlink");
        let victim = d.join("victim");
        fs::write(&victim, "keep me").unwrap();
        let tmp = d.join(format!("{FILE_NAME}.tmp-planted"));
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        let text = render(&snapshot(), "ws://own", "c");
        let err = write_via(&d, &tmp, &text).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep me");
        assert!(!path(&d).exists(), "nothing written through the link");
        assert!(
            tmp.symlink_metadata().is_ok(),
            "someone else's file is not removed"
        );
        // The real writer picks a name nobody can guess, and leaves no temporary behind.
        write_atomically(&d, &text).unwrap();
        let left: Vec<String> = fs::read_dir(&d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&format!("{FILE_NAME}.tmp-")) && !n.ends_with("planted"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_second_instance_cannot_take_the_lock_of_a_state_directory() {
        let d = dir("lock");
        let first = lock_dir(&d).unwrap();
        let err = lock_dir(&d).unwrap_err();
        assert!(err.contains("in use by another grasp-sync"), "{err}");
        drop(first);
        assert!(lock_dir(&d).is_ok(), "released when the first closes it");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn unusable_files_are_ignored_with_their_reason() {
        let good = render(&snapshot(), "ws://own", "c");
        let reason = |text: &str| match parse(text, "ws://own", "c") {
            Loaded::Ignored(r, _) => Some(r),
            Loaded::Snapshot(_) => None,
        };
        assert_eq!(reason(&good), None);
        assert_eq!(
            reason(&good[..good.len() / 2]),
            Some(IgnoredReason::Corrupt)
        );
        assert_eq!(
            reason("{\"format\":\"x\"}"),
            Some(IgnoredReason::ForeignFormat)
        );
        let older = good.replace("\"version\":1", "\"version\":0");
        assert_eq!(reason(&older), Some(IgnoredReason::OlderVersion));
        let newer = good.replace("\"version\":1", "\"version\":2");
        assert_eq!(reason(&newer), Some(IgnoredReason::NewerVersion));
        assert_eq!(
            match parse(&good, "ws://other", "c") {
                Loaded::Ignored(r, _) => Some(r),
                _ => None,
            },
            Some(IgnoredReason::OtherOwnRelay)
        );
        assert_eq!(
            match parse(&good, "ws://own", "other") {
                Loaded::Ignored(r, _) => Some(r),
                _ => None,
            },
            Some(IgnoredReason::OtherConfig)
        );
        let wrong_type = good.replace("\"connected\":true", "\"connected\":\"yes\"");
        assert_eq!(reason(&wrong_type), Some(IgnoredReason::Corrupt));
        let unknown = good.replace("\"connected\":true", "\"connected\":true,\"zzz\":1");
        assert_eq!(reason(&unknown), Some(IgnoredReason::Corrupt));
    }

    #[test]
    fn after_a_lost_forwarder_no_relay_is_saved() {
        use crate::core::sync::SyncConfig;
        use crate::core::time::ManualClock;
        use crate::shared::RelayUrl;
        let d = dir("forwarder");
        let now = Time::from_millis(snapshot().taken_at_ms + 60_000);
        let clock = Arc::new(ManualClock::new(now));
        let mut m = SyncMachine::new(SyncConfig::new(RelayUrl::parse("ws://own").unwrap()));
        let report = m.restore(snapshot(), now);
        assert_eq!(report.relays_restored, 1, "{report:?}");
        let machine = RwLock::new(m);
        let metrics = Arc::new(Metrics::default());
        let wait_for_file = |want: usize| {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                if let Loaded::Snapshot(s) = load(&d, "ws://own", "c") {
                    if s.relays.len() == want {
                        return;
                    }
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "no file with {want} relays"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let mut w = StateWriter::new(
            d.clone(),
            "ws://own".into(),
            "c".into(),
            Duration::from_secs(1),
            Arc::default(),
            clock.clone(),
        )
        .unwrap();
        w.tick(&machine, now, &metrics);
        wait_for_file(1);
        // The forwarder thread dies with an event of a confirmed batch in its queue; the
        // coordinator restarts it and resets the unresolved count.
        metrics.forwarder_restarts.fetch_add(1, Ordering::SeqCst);
        metrics.forward.unresolved.store(0, Ordering::SeqCst);
        let later = now.plus(Duration::from_secs(2));
        w.tick(&machine, later, &metrics);
        wait_for_file(0);
        let end = later.plus(Duration::from_secs(2));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        assert!(w.finish(&machine, end, &metrics, deadline).is_none());
        match load(&d, "ws://own", "c") {
            Loaded::Snapshot(s) => assert!(s.relays.is_empty(), "{s:?}"),
            other => panic!("{other:?}"),
        }
        fs::remove_dir_all(&d).unwrap();
    }

    /// A snapshot that confirms something is handed to the writer only once every event the
    /// relay threads handed to the forwarder was answered (decision 0056), however many save
    /// intervals pass meanwhile. In simulated time (`tick` and `finish` take `now`), so the
    /// intervals surely pass; `finish` returns only once the writer thread has ended, so
    /// every write it was given is on disk when the directory is read. Fails when `tick` or
    /// `finish` writes without looking at `unresolved`; the second half shows that the same
    /// machine is written as soon as nothing is unresolved.
    #[test]
    fn a_confirmation_waits_for_its_events_through_any_number_of_save_intervals() {
        use crate::core::sync::SyncConfig;
        use crate::core::time::ManualClock;
        use crate::shared::RelayUrl;
        let now = Time::from_millis(snapshot().taken_at_ms + 60_000);
        let clock = Arc::new(ManualClock::new(now));
        let mut m = SyncMachine::new(SyncConfig::new(RelayUrl::parse("ws://own").unwrap()));
        assert_eq!(m.restore(snapshot(), now).relays_restored, 1);
        let machine = RwLock::new(m);
        let interval = Duration::from_secs(1);
        let end = now.plus(interval * 10);
        let writer = |d: &PathBuf| {
            StateWriter::new(
                d.clone(),
                "ws://own".into(),
                "c".into(),
                interval,
                Arc::default(),
                clock.clone(),
            )
            .unwrap()
        };
        let stopped = || std::time::Instant::now() + Duration::from_secs(30);
        // An event is on its way to the own relay through ten save intervals and the stop.
        let held = dir("unresolved");
        let metrics = Arc::new(Metrics::default());
        metrics.forward.unresolved.store(1, Ordering::SeqCst);
        let mut w = writer(&held);
        for i in 0..10 {
            w.tick(&machine, now.plus(interval * i), &metrics);
            assert!(w.pending.is_some(), "tick {i}: the snapshot waits");
        }
        assert!(w.finish(&machine, end, &metrics, stopped()).is_none());
        assert!(
            matches!(
                load(&held, "ws://own", "c"),
                Loaded::Ignored(IgnoredReason::Missing, _)
            ),
            "{:?}",
            load(&held, "ws://own", "c")
        );
        // Nothing unresolved: the first tick writes it.
        let free = dir("resolved");
        let metrics = Arc::new(Metrics::default());
        let mut w = writer(&free);
        w.tick(&machine, now, &metrics);
        assert!(w.pending.is_none(), "handed to the writer");
        assert!(w.finish(&machine, end, &metrics, stopped()).is_none());
        match load(&free, "ws://own", "c") {
            Loaded::Snapshot(s) => assert_eq!(s.relays.len(), 1, "{s:?}"),
            other => panic!("{other:?}"),
        }
        fs::remove_dir_all(&held).unwrap();
        fs::remove_dir_all(&free).unwrap();
    }

    #[test]
    fn temporary_files_of_an_interrupted_write_are_removed_at_start() {
        let d = dir("stale");
        let stale = d.join(format!("{FILE_NAME}.tmp-999999"));
        fs::write(&stale, "{\"half").unwrap();
        let other = d.join("unrelated");
        fs::write(&other, "x").unwrap();
        let mut m = SyncMachine::new(crate::core::sync::SyncConfig::new(
            crate::shared::RelayUrl::parse("ws://own").unwrap(),
        ));
        let counters = StateCounters::default();
        load_into(&d, "ws://own", "c", &mut m, Time::from_secs(1), &counters);
        assert!(!stale.exists(), "stale temporary file removed");
        assert!(other.exists(), "other files kept");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_file_beyond_the_caps_is_decoded_only_up_to_them() {
        use crate::core::sync::{MAX_RELAY_ITEMS, MAX_STATE_ITEMS, MAX_STATE_RELAYS};
        // Millions of tiny items and thousands of relays fit in a file below the size cap;
        // decoding keeps what the caps allow and skips the rest unstored.
        let mut text = String::from(
            "{\"format\":\"grasp-sync-state\",\"version\":1,\"own_relay\":\"ws://own\",\"config\":\"c\",\"saved_at_ms\":1,\"relays\":{",
        );
        let relays = MAX_STATE_RELAYS + 10;
        let per_relay = 2 * MAX_STATE_ITEMS / relays + MAX_RELAY_ITEMS / 1000;
        for i in 0..relays {
            if i > 0 {
                text.push(',');
            }
            text.push_str(&format!("\"wss://r{i}.example/\":{{\"root_events\":["));
            text.push_str(&vec!["\"\""; per_relay].join(","));
            text.push_str("]}");
        }
        text.push_str("}}");
        assert!((text.len() as u64) < MAX_FILE_BYTES);
        let Loaded::Snapshot(s) = parse(&text, "ws://own", "c") else {
            panic!("usable");
        };
        assert_eq!(s.relays.len(), MAX_STATE_RELAYS);
        let items: usize = s.relays.values().map(|r| r.root_events.len()).sum();
        assert_eq!(items, MAX_STATE_ITEMS);
        // One relay's list alone is capped too.
        let one = format!(
            "{{\"format\":\"grasp-sync-state\",\"version\":1,\"own_relay\":\"ws://own\",\"config\":\"c\",\"saved_at_ms\":1,\"relays\":{{\"wss://a.example/\":{{\"repos\":[{}]}}}}}}",
            vec!["\"\""; MAX_RELAY_ITEMS + 5].join(",")
        );
        let Loaded::Snapshot(s) = parse(&one, "ws://own", "c") else {
            panic!("usable");
        };
        assert_eq!(s.relays["wss://a.example/"].repos.len(), MAX_RELAY_ITEMS);
        // A huge value where a string belongs is not decoded into a tree either.
        let foreign = format!("{{\"format\":[{}]}}", vec!["[]"; 100_000].join(","));
        assert!(matches!(
            parse(&foreign, "ws://own", "c"),
            Loaded::Ignored(IgnoredReason::ForeignFormat, _)
        ));
    }

    #[test]
    fn a_missing_or_oversized_file_is_ignored() {
        let d = dir("size");
        assert!(matches!(
            load(&d, "ws://own", "c"),
            Loaded::Ignored(IgnoredReason::Missing, _)
        ));
        let f = File::create(path(&d)).unwrap();
        f.set_len(MAX_FILE_BYTES + 10).unwrap();
        assert!(matches!(
            load(&d, "ws://own", "c"),
            Loaded::Ignored(IgnoredReason::TooLarge, _)
        ));
        fs::remove_dir_all(&d).unwrap();
    }
}
