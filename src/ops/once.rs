//! `--once`: when is a one-shot run finished, and did it succeed? Pure: it looks at
//! successive [`Status`] snapshots with their time.

use std::time::Duration;

use crate::core::health::BackoffPolicy;
use crate::core::state::ConnectionStatus;
use crate::core::time::Time;
use crate::engine::{RelayStatus, Status};

/// Failed connection attempts after which `--once` counts a relay as failed.
pub const ONCE_MAX_FAILURES: u32 = 4;

/// The reconnect backoff of a one-shot run: a few quick attempts (5 s, 10 s, 20 s; about a
/// minute with connect timeouts), not the daemon's hour-long backoff.
pub fn once_backoff() -> BackoffPolicy {
    BackoffPolicy {
        base: Duration::from_secs(5),
        max: Duration::from_secs(30),
        ..BackoffPolicy::default()
    }
}

/// How a one-shot run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OnceOutcome {
    /// Relays that could not be reached (after [`ONCE_MAX_FAILURES`] attempts).
    pub failed: Vec<String>,
    /// Relays that could not deliver all history (incomplete queries).
    pub incomplete: Vec<String>,
}

impl OnceOutcome {
    /// The process exit code: 0 when every relay completed, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        u8::from(!(self.failed.is_empty() && self.incomplete.is_empty()))
    }
}

/// Watches snapshots until the historic sync of everything discovered is done.
#[derive(Debug, Clone)]
pub struct OnceTracker {
    quiet_since: Option<Time>,
    /// How long everything must stay finished before the run ends: discovery is recursive,
    /// so a relay's history may still name new relays a batch window later.
    pub settle: Duration,
}

fn relay_done(r: &RelayStatus) -> bool {
    r.connection_status == ConnectionStatus::Connected
        && r.pending_batches == 0
        && r.loading_queries == 0
        && r.queued_queries == 0
        && r.reopen_pending == 0
        && r.reconciliations_pending == 0
        && r.confirmed_repos >= r.target_repos
        && r.confirmed_root_events >= r.target_root_events
}

fn relay_failed(r: &RelayStatus) -> bool {
    r.connection_status != ConnectionStatus::Connected && r.failures >= ONCE_MAX_FAILURES
}

impl OnceTracker {
    /// A tracker that wants `settle` of quiet before it ends a run.
    pub fn new(settle: Duration) -> OnceTracker {
        OnceTracker {
            quiet_since: None,
            settle,
        }
    }

    /// The outcome once the run is finished, else `None`.
    pub fn check(&mut self, status: &Status, now: Time) -> Option<OnceOutcome> {
        let quiet = status.own_relay == ConnectionStatus::Connected
            && !status.self_sync_pending
            && status.forward_backlog == 0
            && status
                .relays
                .iter()
                .all(|r| relay_done(r) || relay_failed(r));
        if !quiet {
            self.quiet_since = None;
            return None;
        }
        let since = *self.quiet_since.get_or_insert(now);
        if now.since(since) < self.settle {
            return None;
        }
        Some(self.outcome(status))
    }

    /// The outcome as things stand (for a run cut short by its deadline, everything not
    /// finished counts as failed).
    pub fn outcome(&self, status: &Status) -> OnceOutcome {
        let mut failed = Vec::new();
        let mut incomplete = Vec::new();
        for r in &status.relays {
            if !relay_done(r) {
                failed.push(r.url.to_string());
            } else if r.incomplete_queries > 0 {
                incomplete.push(r.url.to_string());
            }
        }
        OnceOutcome { failed, incomplete }
    }
}
