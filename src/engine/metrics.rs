//! Counters shared by the threads (lock-free reads for status and the summary line).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::net::url::RelayUrl;

/// Counters of one connection (a remote relay, or the own relay's self-subscription).
#[derive(Debug, Default)]
pub struct RelayCounters {
    /// EVENT messages received.
    pub events_received: AtomicU64,
    /// Events that passed every check (handed on).
    pub events_accepted: AtomicU64,
    /// Events with a bad id or signature, or not an event at all.
    pub events_invalid: AtomicU64,
    /// Valid events that do not match the subscription they arrived on.
    pub events_unmatched: AtomicU64,
    /// Events for a subscription we do not have open.
    pub events_unknown_subscription: AtomicU64,
    /// Frames that are not NIP-01 messages (garbage, binary, unknown types).
    pub garbage_frames: AtomicU64,
    /// NOTICE messages.
    pub notices: AtomicU64,
    /// CLOSED messages.
    pub closed: AtomicU64,
    /// AUTH challenges.
    pub auth_challenges: AtomicU64,
    /// Connections established.
    pub connects: AtomicU64,
    /// Connections lost or failed.
    pub disconnects: AtomicU64,
}

impl RelayCounters {
    /// Adds one to `c`.
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads `c`.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Counters of the forwarder into the own relay.
#[derive(Debug, Default)]
pub struct ForwardCounters {
    /// Stored by the own relay.
    pub stored: AtomicU64,
    /// The own relay already had them.
    pub duplicates: AtomicU64,
    /// Rejected by the own relay.
    pub rejected: AtomicU64,
    /// Sent again (timeout, disconnect, rate limit).
    pub resent: AtomicU64,
    /// Copies dropped before sending (already stored or queued).
    pub deduplicated: AtomicU64,
    /// Events handed to the forwarder and not yet resolved (stored, duplicate, rejected or
    /// dropped as a copy): counted up by the relay thread *before* it hands an event over
    /// and down by the forwarder, so there is no moment an event is counted nowhere.
    pub unresolved: AtomicU64,
    /// 1 while the forwarder's connection is open.
    pub connected: AtomicU64,
    /// 1 while the forward queue is full (relay threads wait).
    pub full: AtomicU64,
}

/// All counters.
#[derive(Debug, Default)]
pub struct Metrics {
    relays: RwLock<HashMap<RelayUrl, Arc<RelayCounters>>>,
    /// Forwarder counters.
    pub forward: ForwardCounters,
}

impl Metrics {
    /// The counters of `relay`, created on first use.
    pub fn relay(&self, relay: &RelayUrl) -> Arc<RelayCounters> {
        if let Some(c) = self.relays.read().get(relay) {
            return c.clone();
        }
        self.relays
            .write()
            .entry(relay.clone())
            .or_default()
            .clone()
    }

    /// The counters of `relay` if it has any.
    pub fn relay_if_known(&self, relay: &RelayUrl) -> Option<Arc<RelayCounters>> {
        self.relays.read().get(relay).cloned()
    }

    /// Forgets a relay's counters (the relay was dropped).
    pub fn forget(&self, relay: &RelayUrl) {
        self.relays.write().remove(relay);
    }

    /// Sum of a counter over all relays except `except`.
    pub fn sum(&self, except: &RelayUrl, f: impl Fn(&RelayCounters) -> &AtomicU64) -> u64 {
        self.relays
            .read()
            .iter()
            .filter(|(u, _)| *u != except)
            .map(|(_, c)| RelayCounters::get(f(c)))
            .sum()
    }
}
