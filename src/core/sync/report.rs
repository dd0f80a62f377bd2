//! What the machine does with each [`Report`] of a connection thread: a report of an
//! earlier connection (another generation) is dropped; the own relay's go to `own.rs`, a
//! remote relay's to the handlers of `lifecycle.rs`, `batches.rs`, `closed.rs`,
//! `reconcile.rs` and `detect.rs`. [`SyncMachine::dispatch_report`] is the table: one line
//! per variant.

use nostr::event::Event;
use nostr::message::SubscriptionId;

use crate::core::paging::PageStats;
use crate::core::relay_text::Prefix;
use crate::core::time::Time;
use crate::core::wire::{Disconnect, Report};
use crate::shared::{Refusal, RelayUrl};

use super::SyncMachine;

/// Whose connection a report belongs to.
enum Side {
    /// The own relay's current connection.
    Own,
    /// A remote relay's current connection.
    Remote,
    /// An earlier connection (or a relay forgotten since): dropped.
    Stale,
}

impl SyncMachine {
    /// [`SyncMachine::handle_report`] without the timer refresh.
    #[rustfmt::skip]
    pub(super) fn dispatch_report(&mut self, report: Report, now: Time) {
        use Report as R;
        match report {
            R::Connected { relay, generation: g } => self.report_connected(&relay, g, now),
            R::Disconnected { relay, generation: g, cause } => self.report_lost(&relay, g, &cause, now),
            R::Eose { relay, generation: g, sub_id, stats } => self.report_eose(&relay, g, &sub_id, &stats, now),
            R::Limits { relay, limits } => self.set_limits(&relay, &limits),
            R::Closed { relay, generation: g, sub_id, prefix, message: m } => self.report_closed(&relay, g, &sub_id, prefix, &m, now),
            R::ForwardBackPressure { active } => self.handle_back_pressure(active, now),
            R::ForwarderLost => self.handle_forwarder_lost(now),
            R::RelayStalled { relay, generation: g, active } => self.report_stalled(&relay, g, active, now),
            R::Notice { relay, generation: g, message } => self.report_notice(&relay, g, &message, now),
            R::OwnIds { generation: g, sub_id, stats, items, truncated, clock } => self.report_own_ids(g, &sub_id, &stats, items, truncated, clock),
            R::NegMsg { relay, generation: g, sub_id, message } => self.report_neg_msg(&relay, g, &sub_id, &message),
            R::NegErr { relay, generation: g, sub_id, message, closed } => self.report_neg_err(&relay, g, &sub_id, &message, closed),
            R::SelfEvent { generation: g, event } => self.report_self_event(g, &event, now),
            R::Refused { relay, generation: g, reason } => self.report_refused(&relay, g, &reason, now),
        }
    }

    /// Whose current connection `generation` of `relay` is.
    fn side(&self, relay: &RelayUrl, generation: u64) -> Side {
        if *relay == self.config.own_relay {
            if generation == self.own.generation {
                Side::Own
            } else {
                Side::Stale
            }
        } else if self.is_current(relay, generation) {
            Side::Remote
        } else {
            Side::Stale
        }
    }

    fn report_connected(&mut self, relay: &RelayUrl, generation: u64, now: Time) {
        match self.side(relay, generation) {
            Side::Own => self.handle_own_connected(now),
            Side::Remote => self.handle_connect_or_reconnect(relay, now),
            Side::Stale => {}
        }
    }

    fn report_lost(&mut self, relay: &RelayUrl, generation: u64, cause: &Disconnect, now: Time) {
        match self.side(relay, generation) {
            Side::Own => self.handle_own_disconnected(Some(cause), now),
            Side::Remote => self.handle_disconnect(relay, cause, now),
            Side::Stale => {}
        }
    }

    fn report_eose(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        sub_id: &SubscriptionId,
        stats: &PageStats,
        now: Time,
    ) {
        match self.side(relay, generation) {
            Side::Own => self.handle_own_eose(sub_id, stats),
            Side::Remote => {
                self.handle_eose(relay, sub_id, stats, now);
                // Fetches that waited for this REQ (decision 0121).
                self.flush_fetches();
            }
            Side::Stale => {}
        }
    }

    fn report_closed(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        sub_id: &SubscriptionId,
        prefix: Prefix,
        message: &str,
        now: Time,
    ) {
        match self.side(relay, generation) {
            Side::Own => self.handle_own_closed(sub_id, prefix, message, now),
            Side::Remote => {
                self.handle_closed(relay, sub_id, prefix, message, now);
                self.flush_fetches();
            }
            Side::Stale => {}
        }
    }

    /// Only a remote relay's thread stalls on the forward pipeline.
    fn report_stalled(&mut self, relay: &RelayUrl, generation: u64, active: bool, now: Time) {
        if self.is_current(relay, generation) {
            self.handle_relay_stalled(relay, active, now);
        }
    }

    /// The own relay's NOTICEs are the relay thread's to count and log.
    fn report_notice(&mut self, relay: &RelayUrl, generation: u64, message: &str, now: Time) {
        if let Side::Remote = self.side(relay, generation) {
            self.detection_notice(relay, message);
            self.neg_notice(relay, message);
            self.handle_notice(relay, message, now);
        }
    }

    fn report_own_ids(
        &mut self,
        generation: u64,
        sub_id: &SubscriptionId,
        stats: &PageStats,
        items: Vec<(u64, nostr::event::EventId)>,
        truncated: bool,
        clock: u32,
    ) {
        if generation == self.own.generation {
            self.handle_own_ids(sub_id, stats, items, truncated, clock);
        }
    }

    /// A NIP-77 message: the answer to a detection probe or a reconciliation's next step
    /// (which checks the generation itself).
    fn report_neg_msg(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        sub_id: &SubscriptionId,
        message: &str,
    ) {
        if self.is_detection(relay, generation, sub_id) {
            self.detection_answered(relay, message);
        } else {
            self.handle_neg_msg(relay, generation, sub_id, message);
        }
    }

    fn report_neg_err(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        sub_id: &SubscriptionId,
        message: &str,
        closed: bool,
    ) {
        if self.is_detection(relay, generation, sub_id) {
            self.detection_refused(relay, message, closed);
        } else {
            self.handle_neg_err(relay, generation, sub_id, message, closed);
        }
    }

    fn report_self_event(&mut self, generation: u64, event: &Event, now: Time) {
        if generation == self.own.generation {
            self.push_self_event(event, now);
        }
    }

    /// The own relay is never refused (the engine never refuses it).
    fn report_refused(&mut self, relay: &RelayUrl, generation: u64, reason: &Refusal, now: Time) {
        if let Side::Remote = self.side(relay, generation) {
            self.on_refused(relay, &reason.to_string(), now);
            self.forget_relay(relay);
        }
    }
}
