//! What the machine does with CLOSED and NOTICE from remote relays.

use log::{debug, warn};
use nostr::message::SubscriptionId;

use crate::core::relay_text::{classify_notice, ClosedReason, NoticeKind, Prefix};
use crate::core::time::Time;
use crate::shared::RelayUrl;

use super::timers::Timer;
use super::{history_since, live_only, SubPurpose, SyncMachine, Warned};

impl SyncMachine {
    pub(super) fn handle_closed(
        &mut self,
        relay: &RelayUrl,
        sub_id: &SubscriptionId,
        prefix: Prefix,
        message: &str,
        now: Time,
    ) {
        self.counters.closed_by_relay += 1;
        if self.multi_filter_refused(relay, sub_id, prefix, message) {
            return;
        }
        if self.recon.delivering.ended(sub_id, &[]) {
            self.recon.flush_due = true;
        }
        let Some((info, sent_at)) = self.link_mut(relay).and_then(|l| {
            let sent_at = l.loading.remove(sub_id);
            l.subs.remove(sub_id).map(|i| (i, sent_at))
        }) else {
            return;
        };
        let was_loading = sent_at.is_some();
        self.recon.refetches.remove(sub_id);
        self.drain_queue(relay);
        let reason = ClosedReason::from(prefix);
        let first = self.link(relay).warn_once(Warned::Closed(prefix));
        let what = format!(
            "{relay}: subscription {sub_id} ({:?}) closed by the relay: {message:?}",
            info.purpose
        );
        if first {
            warn!("{what}");
        } else {
            debug!("{what}");
        }
        match reason {
            ClosedReason::RateLimited => self.counters.closed_rate_limited += 1,
            ClosedReason::AuthRequired => self.counters.closed_auth_required += 1,
            ClosedReason::Refused => self.counters.closed_refused += 1,
        }
        let delay = match reason {
            ClosedReason::RateLimited => {
                self.counters.rate_limited += 1;
                // Hold back new batches of this relay for the cool-down, too.
                let until = now.plus(self.config.rate_limit_cooldown);
                self.cool_down(relay, until);
                self.config.rate_limit_cooldown
            }
            ClosedReason::AuthRequired => {
                if first {
                    warn!(
                        "{relay}: requires NIP-42 authentication and did not accept us (no key configured with --nsec-file / GRASP_SYNC_NSEC, or the relay refused it); its {:?} query is retried later",
                        info.purpose
                    );
                }
                self.config.refused_retry
            }
            ClosedReason::Refused => self.config.refused_retry,
        };
        let batch = match info.purpose {
            SubPurpose::Batch(id) | SubPurpose::Page { batch: Some(id) } => Some(id),
            _ => None,
        };
        let pending =
            batch.is_some_and(|id| self.pending_of(relay).iter().any(|b| b.batch_id == id));
        let at = now.plus(delay);
        if pending {
            let id = batch.unwrap_or_default();
            self.fail_batch_for(relay, id, now, "closed by relay", Some(delay));
        } else if info.purpose.is_live() && (!was_loading || info.filter.limit == Some(0)) {
            // A live subscription past its EOSE (Layer 1, the live set, or the REQ of a batch
            // that has confirmed), or a live-only one refused before its EOSE: opened again
            // live after the delay, plus a catch-up of what was published from the moment it
            // was lost (or, refused at once, from when it was asked for).
            let lost = sent_at.map_or(now, |t| t.rebased(now));
            let since = lost.minus(self.config.quick_reconnect_window).timestamp();
            let purpose = match info.purpose {
                SubPurpose::Announcements => SubPurpose::Announcements,
                _ => SubPurpose::Live,
            };
            let l = self.link(relay);
            l.reopen.push((at, purpose, live_only(&info.query())));
            l.reopen.push((
                at,
                SubPurpose::CatchUp,
                history_since(std::sync::Arc::unwrap_or_clone(info.query()), since),
            ));
        } else if matches!(info.purpose, SubPurpose::Page { batch: Some(_) }) {
            // A page of a batch that is no longer pending: nothing waits for it.
            debug!("{relay}: page {sub_id} of a finished batch closed; nothing to do");
        } else {
            // A query closed before its EOSE (history not fully delivered): the same query
            // again after the delay, never silently gone.
            let purpose = match info.purpose {
                SubPurpose::Batch(_) => SubPurpose::Live,
                p => p,
            };
            self.link(relay).reopen.push((
                at,
                purpose,
                std::sync::Arc::unwrap_or_clone(info.query()),
            ));
        }
    }

    /// A CLOSED refusing a REQ of several filters (`unsupported: multi-filter REQs aren't
    /// supported`, rust-nostr relay-builder versions; decision 0110): the relay gets one
    /// filter per REQ from now on, and the member `sub_id` goes back to the front of the
    /// queue under its own id, as it was (its batch, pages and reconciliation keep waiting
    /// for it; nothing of its history was read). True when handled so.
    fn multi_filter_refused(
        &mut self,
        relay: &RelayUrl,
        sub_id: &SubscriptionId,
        prefix: Prefix,
        message: &str,
    ) -> bool {
        let refused = matches!(prefix, Prefix::Unsupported | Prefix::Other)
            && message.to_ascii_lowercase().contains("multi-filter");
        let Some(remote) = self.remotes.get_mut(relay) else {
            return false;
        };
        let link = &mut remote.link;
        if !refused || !link.packed.contains_key(sub_id) {
            return false;
        }
        let Some(info) = link.subs.remove(sub_id) else {
            return false;
        };
        link.loading.remove(sub_id);
        link.packed.remove(sub_id);
        link.queue.push_front((sub_id.clone(), info));
        if !remote.single_filter {
            remote.single_filter = true;
            self.counters.multi_filter_refusals += 1;
            warn!(
                "{relay}: refuses REQs of several filters ({message:?}); one filter per REQ from now on"
            );
        }
        self.drain_queue(relay);
        true
    }

    /// A NOTICE from a remote relay: after a rate-limit text nothing is sent to the relay for
    /// the cool-down (queries wait in its queue) and no new batch starts; every NOTICE is
    /// counted by the relay thread.
    pub(super) fn handle_notice(&mut self, relay: &RelayUrl, message: &str, now: Time) {
        match classify_notice(message) {
            NoticeKind::RateLimit => {
                self.counters.rate_limited += 1;
                self.counters.notices_rate_limit += 1;
                let until = now.plus(self.config.rate_limit_cooldown);
                let first = self
                    .link(relay)
                    .warn_once(Warned::Notice(message.to_string()));
                self.cool_down(relay, until);
                if first {
                    warn!(
                        "{relay}: NOTICE {message:?}: sending nothing to this relay for {:?}",
                        self.config.rate_limit_cooldown
                    );
                } else {
                    debug!("{relay}: NOTICE {message:?} (rate limit, repeated)");
                }
            }
            NoticeKind::Other => {
                self.counters.notices_other += 1;
                debug!("{relay}: NOTICE {message:?}");
            }
        }
    }

    /// A rate limit: nothing is sent to `relay` and no new batch of it starts before
    /// `until` (or a later end already set).
    fn cool_down(&mut self, relay: &RelayUrl, until: Time) {
        self.timers
            .set_latest(Timer::RetryBatches(relay.clone()), until);
        self.timers
            .set_latest(Timer::Cooldown(relay.clone()), until);
    }
}
