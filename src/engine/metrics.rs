//! Counters shared by the threads (lock-free reads for status and the summary line).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::core::forward::{admits, ForwardLimits};
use crate::core::relay_text::Prefix;
use crate::core::session::SessionCounters;
use crate::shared::Refusal;
use crate::shared::RelayUrl;

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
    /// Times this relay's thread ended unexpectedly and was restarted.
    pub thread_restarts: AtomicU64,
    /// Frames above the soft size cap, dropped with the connection kept (each distinct event
    /// counted once).
    pub oversized_frames: AtomicU64,
    /// Schnorr signature checks done (events whose `(id, signature)` pair was verified before,
    /// by any relay thread, skip it: see [`crate::core::dedup::VerifiedSet`]).
    pub signature_checks: AtomicU64,
    /// Events not handed to the forwarder because a copy (from this or another relay)
    /// already was: checked copies ([`crate::core::dedup::VerifiedSet::claim_forward`]) and
    /// copies recognised by their id before parsing
    /// ([`crate::core::dedup::VerifiedSet::forwarded_copy`]; these are not counted as
    /// accepted).
    pub copies_not_forwarded: AtomicU64,
    /// Ids a reconciliation's fetch did not ask for: a copy was on its way to the own relay
    /// ([`crate::core::session::RelaySession::handle_command_with`]).
    pub fetch_ids_in_flight: AtomicU64,
    /// Gauge: JSON bytes of this relay's events in the forward pipeline now.
    pub forward_bytes: AtomicU64,
    /// Times this relay's thread had to wait because the forward pipeline's byte bound (or
    /// this relay's share of it) was reached.
    pub forward_byte_waits: AtomicU64,
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

    /// Adds what a relay session counted since the last call (`published`, updated) to these
    /// shared counters.
    pub fn publish(&self, now: &SessionCounters, published: &mut SessionCounters) {
        let now = *now;
        if now == *published {
            return;
        }
        let c = self;
        let pairs: [(&AtomicU64, u64, u64); 15] = [
            (
                &c.events_received,
                now.events_received,
                published.events_received,
            ),
            (
                &c.events_accepted,
                now.events_accepted,
                published.events_accepted,
            ),
            (
                &c.events_invalid,
                now.events_invalid,
                published.events_invalid,
            ),
            (
                &c.events_unmatched,
                now.events_unmatched,
                published.events_unmatched,
            ),
            (
                &c.events_unknown_subscription,
                now.events_unknown_subscription,
                published.events_unknown_subscription,
            ),
            (
                &c.garbage_frames,
                now.garbage_frames,
                published.garbage_frames,
            ),
            (&c.notices, now.notices, published.notices),
            (&c.closed, now.closed, published.closed),
            (
                &c.auth_challenges,
                now.auth_challenges,
                published.auth_challenges,
            ),
            (&c.connects, now.connects, published.connects),
            (&c.disconnects, now.disconnects, published.disconnects),
            (
                &c.oversized_frames,
                now.oversized_frames,
                published.oversized_frames,
            ),
            (
                &c.signature_checks,
                now.signature_checks,
                published.signature_checks,
            ),
            (
                &c.copies_not_forwarded,
                now.copies_not_forwarded,
                published.copies_not_forwarded,
            ),
            (
                &c.fetch_ids_in_flight,
                now.fetch_ids_in_flight,
                published.fetch_ids_in_flight,
            ),
        ];
        for (counter, current, before) in pairs {
            if current > before {
                counter.fetch_add(current - before, Ordering::Relaxed);
            }
        }
        *published = now;
    }

    fn fields(&self) -> [&AtomicU64; 16] {
        [
            &self.events_received,
            &self.events_accepted,
            &self.events_invalid,
            &self.events_unmatched,
            &self.events_unknown_subscription,
            &self.garbage_frames,
            &self.notices,
            &self.closed,
            &self.auth_challenges,
            &self.connects,
            &self.disconnects,
            &self.oversized_frames,
            &self.thread_restarts,
            &self.signature_checks,
            &self.copies_not_forwarded,
            &self.fetch_ids_in_flight,
        ]
    }

    /// Adds every counter of `other` to this one.
    fn absorb(&self, other: &RelayCounters) {
        for (mine, theirs) in self.fields().into_iter().zip(other.fields()) {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }
}

/// Counters of the forwarder into the own relay.
#[derive(Debug, Default)]
pub struct ForwardCounters {
    /// Stored by the own relay.
    pub stored: AtomicU64,
    /// The own relay already had them.
    pub duplicates: AtomicU64,
    /// Accepted into the own relay's purgatory (`OK true "purgatory: …"`): not served until
    /// their git data arrives.
    pub purgatory: AtomicU64,
    /// Rejected by the own relay.
    pub rejected: AtomicU64,
    /// Sent again (timeout, disconnect, rate limit, `error:`).
    pub resent: AtomicU64,
    /// `OK false "error: …"` answers (each event sent again, never given up).
    pub relay_errors: AtomicU64,
    /// `OK false "rate-limited: …"` answers (each event sent again).
    pub rate_limited: AtomicU64,
    /// Events set aside after `MAX_ERROR_ROUNDS` `error:` answers (each time).
    pub set_aside: AtomicU64,
    /// Events set aside now, waiting for their next try.
    pub aside: AtomicU64,
    /// Events set aside that moved to the rejected store because the aside set was full.
    pub aside_overflow: AtomicU64,
    /// The interval between sends while the own relay rate-limits us, in milliseconds (0:
    /// not paced).
    pub pace_ms: AtomicU64,
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
    /// Events queued or in flight in the forwarder (not counting the channel into it).
    pub queue_depth: AtomicU64,
    /// Time from sending an event to the own relay's `OK`.
    pub ok_latency: Histogram,
    /// Rejections by the own relay, by the prefix of its reason (`REJECT_REASONS`; the
    /// last slot counts every other reason).
    pub rejected_by_reason: [AtomicU64; REJECT_REASONS.len()],
    /// Gauge: JSON bytes of checked events in the forward pipeline (channel, queue, in
    /// flight) now.
    pub bytes: AtomicU64,
    /// The most `bytes` ever held.
    pub bytes_peak: AtomicU64,
}

impl ForwardCounters {
    /// Copies the forward queue's counters and gauges.
    pub(crate) fn publish(&self, queue: &crate::core::forward::ForwardQueue) {
        let c = queue.counters();
        self.stored.store(c.stored, Ordering::Relaxed);
        self.duplicates.store(c.duplicates, Ordering::Relaxed);
        self.purgatory.store(c.purgatory, Ordering::Relaxed);
        self.rejected.store(c.rejected, Ordering::Relaxed);
        self.resent.store(c.resent, Ordering::Relaxed);
        self.relay_errors.store(c.relay_errors, Ordering::Relaxed);
        self.rate_limited.store(c.rate_limited, Ordering::Relaxed);
        self.set_aside.store(c.set_aside, Ordering::Relaxed);
        self.aside.store(queue.aside() as u64, Ordering::Relaxed);
        self.aside_overflow
            .store(c.aside_overflow, Ordering::Relaxed);
        let pace = queue.throttle().map_or(0, |t| t.pace.as_millis() as u64);
        self.pace_ms.store(pace, Ordering::Relaxed);
        self.deduplicated.store(c.deduplicated, Ordering::Relaxed);
        self.queue_depth
            .store(queue.backlog() as u64, Ordering::Relaxed);
    }
}

/// The reason prefixes of the own relay's rejections that are counted apart; `other` takes
/// the rest (a free-text reason never becomes a metric label). Their [`Prefix::label`]s are
/// the `reason` label values of `events_rejected_total`.
pub(crate) const REJECT_REASONS: [Prefix; 7] = [
    Prefix::Blocked,
    Prefix::Invalid,
    Prefix::Restricted,
    Prefix::Pow,
    Prefix::AuthRequired,
    Prefix::Error,
    Prefix::Other,
];

/// The slot of `prefix` in [`REJECT_REASONS`] (the last, `other`, for a prefix not counted
/// apart).
pub(crate) fn reject_reason_slot(prefix: Prefix) -> usize {
    REJECT_REASONS
        .iter()
        .position(|r| *r == prefix)
        .unwrap_or(REJECT_REASONS.len() - 1)
}

/// Upper bounds (milliseconds) of the OK latency histogram's buckets; one more bucket
/// takes everything slower.
pub(crate) const LATENCY_BUCKETS_MS: [u64; 12] =
    [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000];

/// A fixed-bucket latency histogram (Prometheus style, cumulative when rendered).
#[derive(Debug, Default)]
pub struct Histogram {
    /// Observations per bucket (not cumulative); the last is `+Inf`.
    pub buckets: [AtomicU64; LATENCY_BUCKETS_MS.len() + 1],
    /// Sum of all observations in microseconds.
    pub sum_us: AtomicU64,
    /// Number of observations.
    pub count: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: std::time::Duration) {
        let ms = d.as_millis() as u64;
        let i = LATENCY_BUCKETS_MS
            .iter()
            .position(|b| ms <= *b)
            .unwrap_or(LATENCY_BUCKETS_MS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Cumulative counts per bucket (the last is `+Inf`), the sum in seconds and the count.
    pub fn snapshot(&self) -> (Vec<u64>, f64, u64) {
        let mut acc = 0;
        let cumulative = self
            .buckets
            .iter()
            .map(|b| {
                acc += b.load(Ordering::Relaxed);
                acc
            })
            .collect();
        (
            cumulative,
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
            self.count.load(Ordering::Relaxed),
        )
    }
}

/// A remote event's place in the forward pipeline's byte bound
/// ([`ForwardLimits::max_bytes`], [`ForwardLimits::relay_bytes`]): taken by the relay thread
/// before it hands the event over, released (dropped) by the forwarder when the own relay
/// stored, already had or rejected it.
#[derive(Debug)]
pub struct ByteAdmission {
    len: u64,
    relay: Arc<RelayCounters>,
    metrics: Arc<Metrics>,
}

impl Drop for ByteAdmission {
    fn drop(&mut self) {
        let sub = |c: &AtomicU64| {
            let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(self.len))
            });
        };
        sub(&self.metrics.forward.bytes);
        sub(&self.relay.forward_bytes);
    }
}

impl ByteAdmission {
    /// Takes `len` bytes of the pipeline for `relay` if [`admits`] allows it now.
    pub fn try_take(
        metrics: &Arc<Metrics>,
        relay: &Arc<RelayCounters>,
        limits: &ForwardLimits,
        len: u64,
    ) -> Option<ByteAdmission> {
        // Only this relay's thread adds to its own gauge, so reading it first is exact; the
        // total is shared, so it is taken with a compare-and-swap.
        let held = relay.forward_bytes.load(Ordering::Relaxed);
        let total = &metrics.forward.bytes;
        total
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                admits(limits, t, held, len).then_some(t.saturating_add(len))
            })
            .ok()?;
        relay.forward_bytes.fetch_add(len, Ordering::Relaxed);
        metrics
            .forward
            .bytes_peak
            .fetch_max(total.load(Ordering::Relaxed), Ordering::Relaxed);
        Some(ByteAdmission {
            len,
            relay: relay.clone(),
            metrics: metrics.clone(),
        })
    }
}

/// All counters.
#[derive(Debug, Default)]
pub struct Metrics {
    relays: RwLock<HashMap<RelayUrl, Arc<RelayCounters>>>,
    /// Counters of relays that were forgotten, so totals never go down.
    retired: RelayCounters,
    /// Forwarder counters.
    pub forward: ForwardCounters,
    /// Threads that ended unexpectedly and were restarted (all kinds).
    pub thread_restarts: AtomicU64,
    /// Forwarder restarts (included in `thread_restarts`).
    pub forwarder_restarts: AtomicU64,
    /// Relays the address policy refused (each counted once).
    pub relays_refused: AtomicU64,
    /// The refused relays and why (at most [`MAX_REFUSED_SHOWN`] kept).
    refused: RwLock<std::collections::BTreeMap<RelayUrl, Refusal>>,
}

/// Refused relays kept for the status (the counter goes on).
pub(crate) const MAX_REFUSED_SHOWN: usize = 1_000;

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

    /// Records that the address policy refused `relay` (counted once per relay). True the
    /// first time for this relay.
    pub fn refuse(&self, relay: &RelayUrl, reason: &Refusal) -> bool {
        let mut m = self.refused.write();
        if m.contains_key(relay) {
            return false;
        }
        self.relays_refused.fetch_add(1, Ordering::Relaxed);
        if m.len() < MAX_REFUSED_SHOWN {
            m.insert(relay.clone(), reason.clone());
        }
        true
    }

    /// The refused relays and why, sorted by URL.
    pub fn refused(&self) -> Vec<(RelayUrl, Refusal)> {
        self.refused
            .read()
            .iter()
            .map(|(u, r)| (u.clone(), r.clone()))
            .collect()
    }

    /// The counters of `relay` if it has any.
    pub fn relay_if_known(&self, relay: &RelayUrl) -> Option<Arc<RelayCounters>> {
        self.relays.read().get(relay).cloned()
    }

    /// Forgets a relay's counters (the relay was dropped); they stay in the totals.
    pub fn forget(&self, relay: &RelayUrl) {
        if let Some(c) = self.relays.write().remove(relay) {
            self.retired.absorb(&c);
        }
    }

    /// Sum of a counter over all relays except `except`.
    pub fn sum(&self, except: &RelayUrl, f: impl Fn(&RelayCounters) -> &AtomicU64) -> u64 {
        self.relays
            .read()
            .iter()
            .filter(|(u, _)| *u != except)
            .map(|(_, c)| RelayCounters::get(f(c)))
            .sum::<u64>()
            + RelayCounters::get(f(&self.retired))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        h.observe(std::time::Duration::from_micros(500));
        h.observe(std::time::Duration::from_millis(30));
        h.observe(std::time::Duration::from_secs(60));
        let (b, sum, n) = h.snapshot();
        assert_eq!((b[0], b[4], b[5], b[11], b[12]), (1, 1, 2, 2, 3));
        assert_eq!(n, 3);
        assert!((sum - 60.0305).abs() < 1e-6);
    }

    #[test]
    fn reject_reasons_keep_their_metric_labels() {
        // Label values of `events_rejected_total{reason=…}`: dashboards depend on them.
        assert_eq!(
            REJECT_REASONS.map(Prefix::label),
            [
                "blocked",
                "invalid",
                "restricted",
                "pow",
                "auth-required",
                "error",
                "other"
            ]
        );
        assert_eq!(
            reject_reason_slot(Prefix::of("blocked: not a GRASP repo")),
            0
        );
        assert_eq!(reject_reason_slot(Prefix::of(" Pow: too low")), 3);
        for m in ["anything else", "mute: nobody listens", "duplicate: x"] {
            assert_eq!(
                reject_reason_slot(Prefix::of(m)),
                REJECT_REASONS.len() - 1,
                "{m}"
            );
        }
    }

    #[test]
    fn totals_keep_forgotten_relays() {
        let m = Metrics::default();
        let a = RelayUrl::parse("wss://a.example").unwrap();
        let b = RelayUrl::parse("wss://b.example").unwrap();
        let own = RelayUrl::parse("wss://own.example").unwrap();
        RelayCounters::inc(&m.relay(&a).events_invalid);
        RelayCounters::inc(&m.relay(&b).events_invalid);
        RelayCounters::inc(&m.relay(&own).events_invalid);
        assert_eq!(m.sum(&own, |c| &c.events_invalid), 2);
        m.forget(&a);
        assert!(m.relay_if_known(&a).is_none());
        assert_eq!(
            m.sum(&own, |c| &c.events_invalid),
            2,
            "a's count stays in the total"
        );
    }

    #[test]
    fn byte_admissions_are_bounded_and_released_on_drop() {
        let m = Arc::new(Metrics::default());
        let a = m.relay(&RelayUrl::parse("wss://a.example").unwrap());
        let b = m.relay(&RelayUrl::parse("wss://b.example").unwrap());
        let limits = ForwardLimits {
            max_bytes: 10,
            relay_bytes: 6,
            ..ForwardLimits::default()
        };
        let a1 = ByteAdmission::try_take(&m, &a, &limits, 4).unwrap();
        assert!(
            ByteAdmission::try_take(&m, &a, &limits, 4).is_none(),
            "a's share"
        );
        let b1 = ByteAdmission::try_take(&m, &b, &limits, 5).unwrap();
        assert!(
            ByteAdmission::try_take(&m, &b, &limits, 1).is_some_and(|x| {
                drop(x);
                true
            })
        );
        assert!(
            ByteAdmission::try_take(&m, &a, &limits, 2).is_none(),
            "total"
        );
        assert_eq!(m.forward.bytes.load(Ordering::Relaxed), 9);
        drop(a1);
        drop(b1);
        assert_eq!(m.forward.bytes.load(Ordering::Relaxed), 0);
        assert_eq!(a.forward_bytes.load(Ordering::Relaxed), 0);
        assert_eq!(m.forward.bytes_peak.load(Ordering::Relaxed), 10);
    }
}
