//! The own relay's side, sans-IO: the forward queue and the session around it.
//!
//! Events checked by the relay threads are offered to a [`ForwardSession`], which owns the
//! [`ForwardQueue`], the connection's NIP-42 state, its keep-alive, the intake pause and every
//! wait policy (write and `OK` lingers, pacing): frames, offers, commands and timeouts go in;
//! frames to write ([`ForwardTransmit`]), answers ([`ForwardEvent`]) and the next deadline come
//! out. The forwarder thread (`engine/forwarder.rs`) only moves bytes and bumps counters; the
//! simulated world of the sync tests drives the same session against a scriptable own relay.
//!
//! What each answer of the own relay does to an event ([`ForwardQueue`]):
//!
//! * `OK true`, or any answer starting with `duplicate:` → stored; the id is remembered in a
//!   bounded set so the same event arriving from other relays is not sent again.
//! * `OK true "purgatory: …"` (GRASP-01; ngit-grasp) → accepted and *held*: the own relay does
//!   not serve it until its git data arrives and drops it after 30 minutes if none does. Never
//!   a loss and never sent again by this process, not even when a reconciliation finds the
//!   own relay without it ([`ForwardQueue::offer_missing`]): the git data is the own relay's
//!   to fetch, and every copy written would keep an empty repository in purgatory longer
//!   (decision 0101).
//! * `OK false` with `rate-limited:` → re-queued at the front; sending is paced: one event
//!   per interval, a quarter longer per round of `rate-limited:` answers (from [`MIN_PACE`]
//!   to [`MAX_PACE`]) and shorter per event stored, until the relay takes what we send again ([`ForwardQueue::throttle`] tells how long it has throttled us).
//! * Events are sent announcements first, then repository state, then root events, then the
//!   rest ([`send_class`]).
//! * `OK false` with `auth-required:` while NIP-42 authentication is under way → re-queued by
//!   [`ForwardQueue::requeue_auth_required`] (the forwarder pauses sending until
//!   authenticated); otherwise an ordinary rejection.
//! * `OK false` with `error:` (a failure of the relay, not a verdict: nostr-rs-relay says so
//!   while its database is locked) → re-queued at the back, and sending pauses, longer after
//!   each `error:` in a row ([`error_pause`]: the rate-limit pause doubled, at most
//!   [`MAX_ERROR_PAUSE`]) until an answer stores something. Never a rejection, however long
//!   the spell: the event stays in the queue, whose bytes the pipeline bounds.
//! * any other `OK false` → counted as rejected with its reason, kept (bounded) and re-offered
//!   only when [`ForwardQueue::retry_rejected`] is called (the repository index changed, so the
//!   own relay may now accept it); never retried blindly, never remembered as done.
//! * no `OK` within the deadline, or the connection drops → re-queued and sent again.
//!
//! The caller reads the answer's prefix once with [`Prefix::parse`](crate::core::relay_text::Prefix::parse) (leading whitespace
//! skipped, ASCII case ignored) and hands [`ForwardQueue::on_ok`] the
//! [`Prefix`](crate::core::relay_text::Prefix).

mod queue;
mod session;

pub use queue::{
    admits, error_pause, send_class, ForwardCounters, ForwardLimits, ForwardQueue, Offer,
    OkOutcome, Throttle, ASIDE_RETRY, FAST_RUN, FLOOR_TIME, MAX_ERROR_PAUSE, MAX_ERROR_ROUNDS,
    MAX_PACE, MIN_PACE,
};
pub use session::{
    ForwardConfig, ForwardControl, ForwardEvent, ForwardSession, ForwardTransmit, Wait,
    FULL_WINDOW_LINGER, OK_LINGER, THROTTLE_WARNING, WRITE_BATCH, WRITE_LINGER,
};

#[cfg(test)]
mod session_tests;
