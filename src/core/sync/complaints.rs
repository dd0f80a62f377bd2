//! What the machine does with CLOSED and NOTICE from remote relays.

use super::*;

impl SyncMachine {
    pub(super) fn handle_closed(
        &mut self,
        relay: &RelayUrl,
        sub_id: &SubscriptionId,
        message: &str,
        now: Time,
    ) {
        self.counters.closed_by_relay += 1;
        let Some(info) = self.links.get_mut(relay).and_then(|l| {
            l.loading.remove(sub_id);
            l.subs.remove(sub_id)
        }) else {
            return;
        };
        self.drain_queue(relay);
        let reason = classify_closed(message);
        let prefix = closed_prefix(message).to_string();
        let first = self.link(relay).warned.insert(format!("CLOSED {prefix}"));
        let what = format!(
            "{relay}: subscription {sub_id} ({:?}) closed by the relay: {message:?}",
            info.purpose
        );
        if first {
            warn!("{what}");
        } else {
            debug!("{what}");
        }
        let delay = match reason {
            ClosedReason::RateLimited => {
                self.counters.rate_limited += 1;
                // Hold back new batches of this relay for the cool-down, too.
                let until = now.plus(self.config.rate_limit_cooldown);
                let l = self.link(relay);
                l.retry_after = Some(l.retry_after.map_or(until, |t| t.max(until)));
                l.cooldown_until = Some(l.cooldown_until.map_or(until, |t| t.max(until)));
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
        match info.purpose {
            SubPurpose::Batch(batch_id)
            | SubPurpose::Page {
                batch: Some(batch_id),
            } => self.fail_batch_for(relay, batch_id, now, "closed by relay", Some(delay)),
            SubPurpose::SelfSubscription => {}
            purpose => {
                // Layer 1, catch-up or a page without a batch: never silently gone; the same
                // query is opened again after the delay.
                let at = now.plus(delay);
                self.link(relay).reopen.push((at, purpose, info.filter));
            }
        }
    }

    /// A NOTICE from a remote relay: after a rate-limit text nothing is sent to the relay for
    /// the cool-down (queries wait in its queue) and no new batch starts; every NOTICE is
    /// counted by the relay thread.
    pub(super) fn handle_notice(&mut self, relay: &RelayUrl, message: &str, now: Time) {
        match classify_notice(message) {
            NoticeKind::RateLimit => {
                self.counters.rate_limited += 1;
                let until = now.plus(self.config.rate_limit_cooldown);
                let first = self.link(relay).warned.insert(format!("NOTICE {message}"));
                let l = self.link(relay);
                l.retry_after = Some(l.retry_after.map_or(until, |t| t.max(until)));
                l.cooldown_until = Some(l.cooldown_until.map_or(until, |t| t.max(until)));
                if first {
                    warn!(
                        "{relay}: NOTICE {message:?}: sending nothing to this relay for {:?}",
                        self.config.rate_limit_cooldown
                    );
                } else {
                    debug!("{relay}: NOTICE {message:?} (rate limit, repeated)");
                }
            }
            NoticeKind::Other => debug!("{relay}: NOTICE {message:?}"),
        }
    }
}
