//! Finding out whether a relay that does not advertise NIP-77 speaks it, beside the REQ
//! path (issue 21): its history is never held back for the answer.
//!
//! On a fresh sync of a relay whose NIP-77 support is [`Nip77Support::Unknown`] (no NIP-11
//! document, or one that does not list 77) the machine sends, next to Layer 1's ordinary
//! REQ, one `NEG-OPEN` over an empty set for a filter that matches nothing (one all-zero
//! id). The answer is remembered in memory and, with `--state-dir`, in the state file, so a
//! restart or the daily resync reconciles on relays that speak it:
//!
//! | answer | the relay |
//! |---|---|
//! | a valid `NEG-MSG` | speaks NIP-77 ([`Nip77Support::Works`]) |
//! | `CLOSED`, a `NOTICE`, a malformed `NEG-MSG`, or nothing within `round_timeout` | does not ([`Nip77Support::Unsupported`]) |
//! | `NEG-ERR` | understood it but refused: stays unknown (tried again at the next fresh sync) |
//!
//! One detection per relay and connection; `Nip77Config::detect_unadvertised` (default on)
//! and `Nip77Config::enabled` turn it off. With `probe_unadvertised` the Layer 1 query itself
//! is the try (decision 0051), so no separate detection is sent.

use log::{debug, info};
use negentropy::{Negentropy, NegentropyStorageVector};
use nostr::event::EventId;
use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::message::escape_for_log;
use crate::shared::RelayUrl;

use super::reconcile::{hex_decode, hex_encode};
use super::timers::Timer;
use super::{Command, Nip77Support, SyncMachine};

/// A detection on the wire.
#[derive(Debug)]
pub(super) struct Detection {
    sub_id: SubscriptionId,
    generation: u64,
    neg: Negentropy<'static, NegentropyStorageVector>,
}

/// The filter of a detection: one id that no event has.
fn nothing() -> Filter {
    Filter::new().id(EventId::from_byte_array([0; 32]))
}

impl SyncMachine {
    /// Sends a detection to `relay` (connected as `generation`) if its NIP-77 support is
    /// unknown and nothing else will find out.
    pub(super) fn start_detection(&mut self, relay: &RelayUrl, generation: u64) {
        let cfg = &self.config.nip77;
        if !cfg.enabled || !cfg.detect_unadvertised || cfg.probe_unadvertised {
            return;
        }
        if self.nip77_support(relay) != Nip77Support::Unknown {
            return;
        }
        // The NEG session takes a subscription slot (strfry counts it with the REQs).
        if !self.neg_room(relay) {
            debug!("{relay}: no subscription slot for a NIP-77 detection on this connection");
            return;
        }
        let sub_id = self.new_sub_id();
        let Some(remote) = self.remote_mut(relay) else {
            return;
        };
        if remote
            .detection
            .as_ref()
            .is_some_and(|d| d.generation == generation)
        {
            return;
        }
        let mut storage = NegentropyStorageVector::new();
        let started = storage
            .seal()
            .and_then(|()| Negentropy::owned(storage, 4096))
            .and_then(|mut n| n.initiate().map(|m| (n, m)));
        let (neg, msg) = match started {
            Ok(x) => x,
            Err(e) => {
                debug!("{relay}: cannot build a NIP-77 detection: {e}");
                return;
            }
        };
        remote.detection = Some(Detection {
            sub_id: sub_id.clone(),
            generation,
            neg,
        });
        self.counters.nip77_detections += 1;
        let deadline = self.last_now.plus(self.config.nip77.round_timeout);
        self.timers
            .set(Timer::Nip77Detection(relay.clone()), deadline);
        debug!("{relay}: NEG-OPEN {sub_id} to find out whether it speaks NIP-77");
        self.commands.push_back(Command::NegOpen {
            relay: relay.clone(),
            generation,
            sub_id,
            filter: nothing(),
            message: hex_encode(&msg),
        });
    }

    /// True when `sub_id` is the running detection of `relay` at `generation`.
    pub(super) fn is_detection(
        &self,
        relay: &RelayUrl,
        generation: u64,
        sub_id: &SubscriptionId,
    ) -> bool {
        self.remote_of(relay)
            .and_then(|r| r.detection.as_ref())
            .is_some_and(|d| d.generation == generation && d.sub_id == *sub_id)
    }

    /// Ends the detection of `relay` with what it found (`None`: nothing learnt).
    ///
    /// The session is closed and what was learnt recorded before queued REQs take its slot:
    /// a REQ sent ahead of the `NEG-CLOSE` would find the relay counting one subscription
    /// more than its budget (strfry answers `NOTICE "ERROR: too many concurrent REQs"`;
    /// issue 37's production test saw 21 open on a relay allowing 20).
    ///
    /// `close`: the relay may hold a session for it (it answered with a `NEG-MSG`, or not at
    /// all: a relay that is merely slow would keep the session, and a slot with it, for the
    /// whole connection); after a `NEG-ERR`, `CLOSED` or `NOTICE` it holds none.
    fn end_detection(
        &mut self,
        relay: &RelayUrl,
        found: Option<Nip77Support>,
        close: bool,
        why: &str,
    ) {
        let Some(d) = self.remote_mut(relay).and_then(|r| r.detection.take()) else {
            return;
        };
        self.timers.cancel(&Timer::Nip77Detection(relay.clone()));
        if close {
            self.commands.push_back(Command::NegClose {
                relay: relay.clone(),
                generation: d.generation,
                sub_id: d.sub_id,
            });
        }
        self.learn_detected(relay, found, why);
        // Its slot is free for a queued REQ.
        self.drain_queue(relay);
    }

    /// Records what a detection found (`None`: nothing learnt).
    fn learn_detected(&mut self, relay: &RelayUrl, found: Option<Nip77Support>, why: &str) {
        let Some(found) = found else {
            debug!("{relay}: NIP-77 detection inconclusive ({why})");
            return;
        };
        let now = self.last_now;
        let Some(remote) = self.remote_mut(relay) else {
            return;
        };
        if remote.nip77 != Nip77Support::Unknown {
            return;
        }
        remote.nip77 = found;
        if found == Nip77Support::Unsupported {
            remote.unsupported_at = Some(now);
        }
        if found == Nip77Support::Works {
            info!("{relay}: speaks NIP-77 ({why}); its history is reconciled from the next full sync on");
        } else {
            info!("{relay}: does not speak NIP-77 ({why}); its history is read by REQ");
        }
    }

    /// A `NEG-MSG` answering the detection: the relay speaks NIP-77 if the message is one.
    pub(super) fn detection_answered(&mut self, relay: &RelayUrl, message: &str) {
        let valid = self
            .remote_mut(relay)
            .and_then(|r| r.detection.as_mut())
            .is_some_and(|d| {
                hex_decode(message).is_some_and(|bytes| {
                    let (mut have, mut need) = (Vec::new(), Vec::new());
                    d.neg
                        .reconcile_with_ids(&bytes, &mut have, &mut need)
                        .is_ok()
                })
            });
        if valid {
            self.end_detection(
                relay,
                Some(Nip77Support::Works),
                true,
                "it answered NEG-OPEN",
            );
        } else {
            let shown = escape_for_log(message, 40);
            self.end_detection(
                relay,
                Some(Nip77Support::Unsupported),
                true,
                &format!("malformed NEG-MSG {shown}"),
            );
        }
    }

    /// `NEG-ERR` or `CLOSED` answering the detection.
    pub(super) fn detection_refused(&mut self, relay: &RelayUrl, message: &str, closed: bool) {
        let shown = escape_for_log(message, 120);
        if closed {
            self.end_detection(
                relay,
                Some(Nip77Support::Unsupported),
                false,
                &format!("CLOSED {shown} in answer to NEG-OPEN"),
            );
        } else {
            self.end_detection(relay, None, false, &format!("NEG-ERR {shown}"));
        }
    }

    /// A `NOTICE` while the detection runs: the way relays answer messages they do not know.
    pub(super) fn detection_notice(&mut self, relay: &RelayUrl, message: &str) {
        if self.remote_of(relay).is_some_and(|r| r.detection.is_some()) {
            let shown = escape_for_log(message, 120);
            self.end_detection(
                relay,
                Some(Nip77Support::Unsupported),
                false,
                &format!("NOTICE {shown} in answer to NEG-OPEN"),
            );
        }
    }

    /// The detection's deadline passed ([`Timer::Nip77Detection`]): silence.
    pub(super) fn detection_expired(&mut self, relay: &RelayUrl) {
        if self.reading_paused(relay) {
            // The relay's thread reads nothing (it waits for the forward pipeline), so
            // silence says nothing: the deadline waits too (issue 36).
            let deadline = self.last_now.plus(self.config.nip77.round_timeout);
            self.timers
                .set(Timer::Nip77Detection(relay.clone()), deadline);
            return;
        }
        self.end_detection(
            relay,
            Some(Nip77Support::Unsupported),
            true,
            "no answer to NEG-OPEN in time",
        );
    }

    /// The connection is gone: its detection with it (nothing learnt).
    pub(super) fn drop_detection(&mut self, relay: &RelayUrl) {
        if let Some(r) = self.remote_mut(relay) {
            r.detection = None;
        }
        self.timers.cancel(&Timer::Nip77Detection(relay.clone()));
    }
}
