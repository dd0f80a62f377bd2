//! NIP-42 authentication of one connection, sans-IO.
//!
//! A relay may send `["AUTH", <challenge>]` at any time and refuse REQs (`CLOSED sub
//! "auth-required: …"`) or EVENTs (`OK id false "auth-required: …"`) until the client has
//! answered with a signed kind-22242 event carrying `["relay", <url>]` and `["challenge",
//! <challenge>]` tags. [`AuthState`] decides, per connection, what to do; the caller signs and
//! sends.
//!
//! * Challenge, key configured → [`OnChallenge::Sign`]; the caller signs, sends and reports the
//!   event id with [`AuthState::auth_sent`]. Without a key challenges are ignored.
//! * `OK` for that id: accepted → authenticated; every subscription held back meanwhile is
//!   handed out for its REQ to be sent again, and refused writes may be sent again. Refused
//!   (or no `OK` in time) → authentication failed for this connection: logged once by the
//!   caller, held subscriptions are released (the caller reports their `CLOSED` as usual) and
//!   later `auth-required:` answers are passed on as they are.
//! * `CLOSED sub "auth-required: …"` with a key, before authentication succeeded or failed →
//!   the subscription is held ([`ClosedAction::Hold`]) instead of reported. Without a
//!   challenge yet it waits for one until [`AuthLimits::challenge_wait`] has passed; then it
//!   is released. After authentication, or without a key, the `CLOSED` is reported.
//! * `OK false "auth-required: …"` for a write → [`WriteAction::Retry`] (re-queue it and pause
//!   writing until authenticated) or [`WriteAction::Reject`] (no key, failed, or refused
//!   although authenticated: a plain rejection).
//!
//! Every collection is bounded ([`AuthLimits::max_held`]); time is passed in. The
//! `auth-required:` prefix is recognised by [`Prefix::parse`], the crate's one reader of
//! NIP-01 prefixes.

use std::collections::VecDeque;
use std::time::Duration;

use nostr::event::EventId;

use crate::core::relay_text::Prefix;
use crate::core::time::Time;

/// Longest challenge answered (a longer one is ignored).
pub(crate) const MAX_CHALLENGE_LEN: usize = 1024;

/// Signs the NIP-42 AUTH event (kind 22242, tags `relay` and `challenge`, dated `now`) for
/// `relay` with `keys` and returns its id and the `["AUTH", event]` frame. Used by every
/// connection that answers challenges (remote relays, the own relay's self-subscription and
/// the forwarder).
pub(crate) fn auth_event(
    keys: &nostr::key::Keys,
    relay: &crate::shared::RelayUrl,
    challenge: &str,
    now: Time,
) -> Result<(EventId, String), String> {
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    use nostr::message::ClientMessage;
    let tag = |name: &str, value: &str| Tag::parse([name, value]).map_err(|e| e.to_string());
    let event = EventBuilder::new(Kind::Authentication, "")
        .tag(tag("relay", relay.as_str())?)
        .tag(tag("challenge", challenge)?)
        .custom_created_at(now.timestamp())
        .finalize(keys)
        .map_err(|e| e.to_string())?;
    Ok((event.id, ClientMessage::auth(event).as_json()))
}

/// Limits and deadlines of `AuthState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthLimits {
    /// Subscriptions held while waiting for authentication, at most (more are reported).
    pub max_held: usize,
    /// How long a subscription or write refused with `auth-required:` waits for a challenge.
    pub challenge_wait: Duration,
    /// How long to wait for the relay's `OK` to our AUTH event.
    pub ok_timeout: Duration,
}

impl Default for AuthLimits {
    fn default() -> Self {
        AuthLimits {
            max_held: 1000,
            challenge_wait: Duration::from_secs(10),
            ok_timeout: Duration::from_secs(10),
        }
    }
}

/// Where authentication of a connection stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AuthPhase {
    /// No AUTH event sent (no challenge yet, or no key).
    Idle,
    /// An AUTH event was sent; waiting for its `OK` until `deadline`.
    Pending {
        /// Id of the AUTH event.
        event_id: EventId,
        /// When to give up waiting.
        deadline: Time,
    },
    /// The relay accepted our AUTH event.
    Authenticated,
    /// Authentication failed on this connection (refused, no `OK` in time, or no challenge
    /// in time); not tried again until the next connection.
    Failed,
}

/// What to do with a challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OnChallenge {
    /// Sign a kind-22242 event for this challenge, send it, then call
    /// [`AuthState::auth_sent`].
    Sign {
        /// The challenge to put into the `challenge` tag.
        challenge: String,
    },
    /// Ignore it.
    Ignore(IgnoreReason),
}

/// Why a challenge is ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IgnoreReason {
    /// No key is configured.
    NoKey,
    /// Authentication already failed on this connection.
    GaveUp,
    /// The challenge is empty or longer than [`MAX_CHALLENGE_LEN`].
    Unusable,
    /// This connection is already authenticated: at most one challenge is answered
    /// successfully per connection, so a relay cannot make us sign events in a loop.
    AlreadyAuthenticated,
    /// Our answer to an earlier challenge is still waiting for its `OK`.
    InProgress,
}

/// A subscription held back until authentication (or released).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    /// Subscription id.
    pub sub_id: String,
    /// The prefix of the relay's `CLOSED` message.
    pub prefix: Prefix,
    /// The relay's `CLOSED` message (reported as it is when the subscription is released).
    pub message: String,
    deadline: Time,
}

/// What an `OK` for our AUTH event meant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AuthOutcome {
    /// Authenticated: send the REQs of these held subscriptions again (and any writes held
    /// back).
    Authenticated {
        /// Subscription ids, in the order they were held.
        resend: Vec<String>,
    },
    /// Refused: authentication failed; report these subscriptions' `CLOSED` as usual.
    Failed {
        /// The relay's reason.
        reason: String,
        /// Subscriptions released.
        release: Vec<Held>,
    },
}

/// What to do with a `CLOSED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClosedAction {
    /// Held until authenticated: do not report it.
    Hold,
    /// Report it to the coordinator as usual.
    Report,
}

/// What to do with a write refused with `auth-required:`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteAction {
    /// Re-queue it; writes pause until authenticated (see [`AuthState::writes_paused`]).
    Retry,
    /// Treat it as an ordinary rejection.
    Reject,
}

/// NIP-42 state of one connection.
#[derive(Debug, Clone)]
pub(crate) struct AuthState {
    has_key: bool,
    limits: AuthLimits,
    phase: AuthPhase,
    challenge: Option<String>,
    held: VecDeque<Held>,
    /// A write was refused with `auth-required:` before a challenge arrived: wait for one
    /// until then (writes pause meanwhile).
    writes_waiting: Option<Time>,
}

impl AuthState {
    /// A fresh connection's state; `has_key` says whether a key is configured.
    pub(crate) fn new(has_key: bool, limits: AuthLimits) -> AuthState {
        AuthState {
            has_key,
            limits,
            phase: AuthPhase::Idle,
            challenge: None,
            held: VecDeque::new(),
            writes_waiting: None,
        }
    }

    /// Whether a key is configured.
    #[cfg(test)]
    pub(crate) fn has_key(&self) -> bool {
        self.has_key
    }

    /// The phase.
    #[cfg(test)]
    pub(crate) fn phase(&self) -> &AuthPhase {
        &self.phase
    }

    /// True once the relay accepted our AUTH event.
    #[cfg(test)]
    pub(crate) fn is_authenticated(&self) -> bool {
        self.phase == AuthPhase::Authenticated
    }

    /// True once authentication failed on this connection.
    pub(crate) fn has_failed(&self) -> bool {
        self.phase == AuthPhase::Failed
    }

    /// The last challenge received.
    #[cfg(test)]
    pub(crate) fn challenge(&self) -> Option<&str> {
        self.challenge.as_deref()
    }

    /// Subscriptions held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.len()
    }

    /// A challenge arrived.
    pub(crate) fn on_challenge(&mut self, challenge: &str, _now: Time) -> OnChallenge {
        if !self.has_key {
            return OnChallenge::Ignore(IgnoreReason::NoKey);
        }
        if self.phase == AuthPhase::Failed {
            return OnChallenge::Ignore(IgnoreReason::GaveUp);
        }
        if self.phase == AuthPhase::Authenticated {
            return OnChallenge::Ignore(IgnoreReason::AlreadyAuthenticated);
        }
        if matches!(self.phase, AuthPhase::Pending { .. }) {
            return OnChallenge::Ignore(IgnoreReason::InProgress);
        }
        if challenge.is_empty() || challenge.len() > MAX_CHALLENGE_LEN {
            return OnChallenge::Ignore(IgnoreReason::Unusable);
        }
        self.challenge = Some(challenge.to_string());
        OnChallenge::Sign {
            challenge: challenge.to_string(),
        }
    }

    /// The caller sent the AUTH event `event_id` for the last challenge.
    pub(crate) fn auth_sent(&mut self, event_id: EventId, now: Time) {
        self.phase = AuthPhase::Pending {
            event_id,
            deadline: now.plus(self.limits.ok_timeout),
        };
        self.writes_waiting = None;
    }

    /// Signing failed (not expected with a local key): give up on this connection.
    pub(crate) fn sign_failed(&mut self) -> Vec<Held> {
        self.fail()
    }

    fn fail(&mut self) -> Vec<Held> {
        self.phase = AuthPhase::Failed;
        self.writes_waiting = None;
        self.held.drain(..).collect()
    }

    /// An `OK` arrived. `None` when it is not about our pending AUTH event (the caller
    /// handles it as usual).
    pub(crate) fn on_ok(
        &mut self,
        event_id: &EventId,
        accepted: bool,
        message: &str,
    ) -> Option<AuthOutcome> {
        match &self.phase {
            AuthPhase::Pending { event_id: id, .. } if id == event_id => {}
            _ => return None,
        }
        if accepted {
            self.phase = AuthPhase::Authenticated;
            self.writes_waiting = None;
            let resend = self.held.drain(..).map(|h| h.sub_id).collect();
            Some(AuthOutcome::Authenticated { resend })
        } else {
            Some(AuthOutcome::Failed {
                reason: message.to_string(),
                release: self.fail(),
            })
        }
    }

    /// A `CLOSED` arrived for `sub_id`, `prefix` read from its `message`.
    pub(crate) fn on_closed(
        &mut self,
        sub_id: &str,
        prefix: Prefix,
        message: &str,
        now: Time,
    ) -> ClosedAction {
        if !self.has_key || prefix != Prefix::AuthRequired {
            return ClosedAction::Report;
        }
        match self.phase {
            AuthPhase::Authenticated | AuthPhase::Failed => return ClosedAction::Report,
            AuthPhase::Idle | AuthPhase::Pending { .. } => {}
        }
        if let Some(h) = self.held.iter_mut().find(|h| h.sub_id == sub_id) {
            h.message = message.to_string();
            return ClosedAction::Hold;
        }
        if self.held.len() >= self.limits.max_held {
            return ClosedAction::Report;
        }
        self.held.push_back(Held {
            sub_id: sub_id.to_string(),
            prefix,
            message: message.to_string(),
            deadline: now.plus(self.limits.challenge_wait),
        });
        ClosedAction::Hold
    }

    /// We closed `sub_id` ourselves: it is no longer held. True if it was.
    pub(crate) fn forget(&mut self, sub_id: &str) -> bool {
        let before = self.held.len();
        self.held.retain(|h| h.sub_id != sub_id);
        self.held.len() != before
    }

    /// A write was answered `OK false "auth-required: …"`.
    pub(crate) fn on_write_auth_required(&mut self, now: Time) -> WriteAction {
        if !self.has_key {
            return WriteAction::Reject;
        }
        match self.phase {
            AuthPhase::Authenticated | AuthPhase::Failed => WriteAction::Reject,
            AuthPhase::Pending { .. } => WriteAction::Retry,
            AuthPhase::Idle => {
                if self.writes_waiting.is_none() {
                    self.writes_waiting = Some(now.plus(self.limits.challenge_wait));
                }
                WriteAction::Retry
            }
        }
    }

    /// True while writes should wait: an AUTH event awaits its `OK`, or a write was refused
    /// and a challenge is awaited.
    pub(crate) fn writes_paused(&self) -> bool {
        match self.phase {
            AuthPhase::Pending { .. } => true,
            AuthPhase::Idle => self.writes_waiting.is_some(),
            AuthPhase::Authenticated | AuthPhase::Failed => false,
        }
    }

    /// The earliest deadline, if any.
    pub(crate) fn poll_timeout(&self) -> Option<Time> {
        match self.phase {
            AuthPhase::Pending { deadline, .. } => Some(deadline),
            AuthPhase::Idle => {
                let held = self.held.iter().map(|h| h.deadline).min();
                match (held, self.writes_waiting) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            }
            AuthPhase::Authenticated | AuthPhase::Failed => None,
        }
    }

    /// Handles passed deadlines. Returns the subscriptions released (report their `CLOSED`).
    ///
    /// No `OK` for our AUTH event in time → failed (everything held is released). Without a
    /// challenge: held subscriptions whose wait is over are released; a write wait that is
    /// over means failed (later refusals are rejections).
    pub(crate) fn handle_timeout(&mut self, now: Time) -> Vec<Held> {
        match self.phase {
            AuthPhase::Pending { deadline, .. } if deadline <= now => self.fail(),
            AuthPhase::Idle => {
                if self.writes_waiting.is_some_and(|t| t <= now) {
                    return self.fail();
                }
                let mut released = Vec::new();
                self.held.retain(|h| {
                    if h.deadline <= now {
                        released.push(h.clone());
                        false
                    } else {
                        true
                    }
                });
                released
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(b: u8) -> EventId {
        EventId::from_byte_array([b; 32])
    }
    fn t(secs: u64) -> Time {
        Time::from_secs(secs)
    }
    fn limits() -> AuthLimits {
        AuthLimits {
            max_held: 3,
            challenge_wait: Duration::from_secs(10),
            ok_timeout: Duration::from_secs(5),
        }
    }
    const AR: &str = "auth-required: please authenticate";

    #[test]
    fn only_auth_required_closes_are_held() {
        for (m, held) in [
            (AR, true),
            ("  auth-required:", true),
            ("AUTH-REQUIRED: case does not matter", true),
            ("restricted: members only", false),
            ("auth required", false),
            ("auth-required : not a prefix", false),
        ] {
            let mut a = AuthState::new(true, limits());
            let want = if held {
                ClosedAction::Hold
            } else {
                ClosedAction::Report
            };
            assert_eq!(a.on_closed("s", Prefix::of(m), m, t(0)), want, "{m:?}");
        }
    }

    #[test]
    fn without_a_key_everything_is_passed_on() {
        let mut a = AuthState::new(false, limits());
        assert!(!a.has_key());
        assert_eq!(
            a.on_challenge("c", t(0)),
            OnChallenge::Ignore(IgnoreReason::NoKey)
        );
        assert_eq!(
            a.on_closed("s", Prefix::of(AR), AR, t(0)),
            ClosedAction::Report
        );
        assert_eq!(a.on_write_auth_required(t(0)), WriteAction::Reject);
        assert!(!a.writes_paused());
        assert_eq!(a.poll_timeout(), None);
        assert_eq!(a.on_ok(&id(1), true, ""), None);
        assert_eq!(a.held(), 0);
    }

    #[test]
    fn challenge_then_ok_authenticates_and_resends_held() {
        let mut a = AuthState::new(true, limits());
        // A REQ refused before the challenge arrived is held.
        assert_eq!(
            a.on_closed("s1", Prefix::of(AR), AR, t(0)),
            ClosedAction::Hold
        );
        assert_eq!(a.poll_timeout(), Some(t(10)));
        assert_eq!(
            a.on_challenge("abc", t(1)),
            OnChallenge::Sign {
                challenge: "abc".into()
            }
        );
        assert_eq!(a.challenge(), Some("abc"));
        a.auth_sent(id(9), t(1));
        assert!(matches!(a.phase(), AuthPhase::Pending { .. }));
        assert_eq!(a.poll_timeout(), Some(t(6)), "the OK deadline");
        // Refused while pending: held too; a repeated CLOSED for the same id is held once.
        assert_eq!(
            a.on_closed("s2", Prefix::of(AR), AR, t(2)),
            ClosedAction::Hold
        );
        assert_eq!(
            a.on_closed("s2", Prefix::of(AR), AR, t(2)),
            ClosedAction::Hold
        );
        assert_eq!(a.held(), 2);
        // Other prefixes are reported.
        assert_eq!(
            a.on_closed("s3", Prefix::of("restricted: no"), "restricted: no", t(2)),
            ClosedAction::Report
        );
        // An OK for another event is not ours.
        assert_eq!(a.on_ok(&id(1), true, ""), None);
        assert_eq!(
            a.on_ok(&id(9), true, ""),
            Some(AuthOutcome::Authenticated {
                resend: vec!["s1".into(), "s2".into()]
            })
        );
        assert!(a.is_authenticated());
        assert_eq!(a.held(), 0);
        assert_eq!(a.poll_timeout(), None);
        // A second OK for the same id is not ours any more.
        assert_eq!(a.on_ok(&id(9), true, ""), None);
        // Refused although authenticated: reported, no loop.
        assert_eq!(
            a.on_closed("s1", Prefix::of(AR), AR, t(3)),
            ClosedAction::Report
        );
        assert_eq!(a.on_write_auth_required(t(3)), WriteAction::Reject);
    }

    #[test]
    fn refused_auth_fails_and_releases() {
        let mut a = AuthState::new(true, limits());
        a.on_challenge("c", t(0));
        a.auth_sent(id(2), t(0));
        assert_eq!(
            a.on_closed("s1", Prefix::of(AR), AR, t(0)),
            ClosedAction::Hold
        );
        match a.on_ok(&id(2), false, "invalid: bad challenge") {
            Some(AuthOutcome::Failed { reason, release }) => {
                assert_eq!(reason, "invalid: bad challenge");
                assert_eq!(release.len(), 1);
                assert_eq!(release[0].sub_id, "s1");
                assert_eq!(release[0].message, AR);
            }
            other => panic!("{other:?}"),
        }
        assert!(a.has_failed());
        assert_eq!(
            a.on_closed("s2", Prefix::of(AR), AR, t(1)),
            ClosedAction::Report
        );
        assert_eq!(
            a.on_challenge("again", t(1)),
            OnChallenge::Ignore(IgnoreReason::GaveUp)
        );
        assert_eq!(a.on_write_auth_required(t(1)), WriteAction::Reject);
        assert!(!a.writes_paused());
    }

    #[test]
    fn no_ok_in_time_fails() {
        let mut a = AuthState::new(true, limits());
        a.on_challenge("c", t(0));
        a.auth_sent(id(2), t(0));
        a.on_closed("s1", Prefix::of(AR), AR, t(1));
        assert!(a.handle_timeout(t(4)).is_empty());
        let released = a.handle_timeout(t(5));
        assert_eq!(released.len(), 1);
        assert!(a.has_failed());
        assert_eq!(a.on_ok(&id(2), true, ""), None, "too late");
    }

    #[test]
    fn held_without_challenge_is_released_after_the_wait() {
        let mut a = AuthState::new(true, limits());
        a.on_closed("s1", Prefix::of(AR), AR, t(0));
        a.on_closed("s2", Prefix::of(AR), AR, t(5));
        assert!(a.handle_timeout(t(9)).is_empty());
        let r = a.handle_timeout(t(10));
        assert_eq!(
            r.iter().map(|h| h.sub_id.as_str()).collect::<Vec<_>>(),
            ["s1"]
        );
        assert_eq!(a.poll_timeout(), Some(t(15)));
        assert_eq!(a.handle_timeout(t(15)).len(), 1);
        assert_eq!(a.poll_timeout(), None);
        // Still idle: a later challenge is answered.
        assert!(matches!(
            a.on_challenge("c", t(16)),
            OnChallenge::Sign { .. }
        ));
    }

    #[test]
    fn held_is_bounded_and_forgettable() {
        let mut a = AuthState::new(true, limits());
        for s in ["a", "b", "c"] {
            assert_eq!(a.on_closed(s, Prefix::of(AR), AR, t(0)), ClosedAction::Hold);
        }
        assert_eq!(
            a.on_closed("d", Prefix::of(AR), AR, t(0)),
            ClosedAction::Report,
            "max_held 3"
        );
        assert!(a.forget("b"));
        assert!(!a.forget("b"));
        assert_eq!(a.held(), 2);
        a.on_challenge("c", t(1));
        a.auth_sent(id(3), t(1));
        assert_eq!(
            a.on_ok(&id(3), true, ""),
            Some(AuthOutcome::Authenticated {
                resend: vec!["a".into(), "c".into()]
            })
        );
    }

    #[test]
    fn at_most_one_challenge_is_answered_per_connection() {
        let mut a = AuthState::new(true, limits());
        assert!(matches!(
            a.on_challenge("c1", t(0)),
            OnChallenge::Sign { .. }
        ));
        a.auth_sent(id(1), t(0));
        assert_eq!(
            a.on_challenge("c2", t(1)),
            OnChallenge::Ignore(IgnoreReason::InProgress)
        );
        assert!(matches!(
            a.on_ok(&id(1), true, ""),
            Some(AuthOutcome::Authenticated { .. })
        ));
        for i in 0..100 {
            assert_eq!(
                a.on_challenge(&format!("again-{i}"), t(2)),
                OnChallenge::Ignore(IgnoreReason::AlreadyAuthenticated)
            );
        }
    }

    #[test]
    fn unusable_challenges_are_ignored() {
        let mut a = AuthState::new(true, limits());
        assert_eq!(
            a.on_challenge("", t(0)),
            OnChallenge::Ignore(IgnoreReason::Unusable)
        );
        let long = "x".repeat(MAX_CHALLENGE_LEN + 1);
        assert_eq!(
            a.on_challenge(&long, t(0)),
            OnChallenge::Ignore(IgnoreReason::Unusable)
        );
        assert_eq!(a.challenge(), None);
    }

    #[test]
    fn sign_failure_gives_up() {
        let mut a = AuthState::new(true, limits());
        a.on_closed("s", Prefix::of(AR), AR, t(0));
        a.on_challenge("c", t(0));
        assert_eq!(a.sign_failed().len(), 1);
        assert!(a.has_failed());
    }

    #[test]
    fn writes_pause_until_authenticated() {
        let mut a = AuthState::new(true, limits());
        assert!(!a.writes_paused());
        // Refused before any challenge: retry, pause, wait for a challenge.
        assert_eq!(a.on_write_auth_required(t(0)), WriteAction::Retry);
        assert!(a.writes_paused());
        assert_eq!(a.poll_timeout(), Some(t(10)));
        a.on_challenge("c", t(1));
        a.auth_sent(id(4), t(1));
        assert!(a.writes_paused(), "until the OK");
        assert_eq!(a.on_write_auth_required(t(1)), WriteAction::Retry);
        assert_eq!(
            a.on_ok(&id(4), true, ""),
            Some(AuthOutcome::Authenticated { resend: vec![] })
        );
        assert!(!a.writes_paused());
    }

    #[test]
    fn write_wait_without_challenge_gives_up() {
        let mut a = AuthState::new(true, limits());
        a.on_write_auth_required(t(0));
        a.on_write_auth_required(t(3));
        assert_eq!(
            a.poll_timeout(),
            Some(t(10)),
            "first refusal sets the deadline"
        );
        a.handle_timeout(t(10));
        assert!(a.has_failed());
        assert!(!a.writes_paused());
        assert_eq!(a.on_write_auth_required(t(11)), WriteAction::Reject);
    }
}
