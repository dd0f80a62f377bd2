//! Scenario 4 (consolidation, never blocking); Scenario 5 (the daily resync) is in `daily.rs`.

use super::*;

impl SyncMachine {
    pub(super) fn run_deferred_if_idle(&mut self, relay: &RelayUrl, now: Time) {
        let ready = self
            .links
            .get(relay)
            .is_some_and(|l| (!l.deferred.is_empty() || l.rebuild_needed) && l.loading.is_empty());
        if ready {
            self.run_deferred(relay, now);
        }
    }

    /// The design's `consolidate`, without blocking: runs once no subscription of the relay
    /// is loading history, or when the wait deadline passed. Closes every settled
    /// subscription (those still loading and those of pending batches stay open),
    /// re-subscribes Layer 1 (unless one is still loading) and Layers 2+3 of the confirmed
    /// items through [`SyncMachine::open_live_set`]: live without `since`, plus a catch-up
    /// from `now − 15 min`, or from earlier when items lost their live subscription earlier
    /// (what does not fit the budget is polled); then adds the deferred new items as one
    /// batch without `since`.
    pub(super) fn run_deferred(&mut self, relay: &RelayUrl, now: Time) {
        let Some(link) = self.links.get_mut(relay) else {
            return;
        };
        self.counters.consolidations += 1;
        link.consolidate_by = None;
        let mut items = std::mem::take(&mut link.deferred);
        let connected = self
            .relays
            .get(relay)
            .is_some_and(|s| s.connection_status == ConnectionStatus::Connected);
        if !connected {
            return;
        }
        let state = &self.relays[relay];
        let generation = state.generation;
        let (repos, roots) = (state.repos.clone(), state.root_events.clone());
        let before = self.links.get(relay).map_or(0, |l| l.subs.len());
        // Subscriptions still loading history (a first Layer 1) and every subscription of a
        // batch that is still pending stay open: closing them would lose what they have not
        // delivered yet, or leave the batch's items without a live subscription once it
        // confirms.
        let pending_batches: HashSet<u64> = self
            .pending
            .get(relay)
            .map(|bs| bs.iter().map(|b| b.batch_id).collect())
            .unwrap_or_default();
        // A Layer 1 that is (or will be) live stays: one still loading, or one (not live-only)
        // waiting in the queue or to be reopened.
        let waiting_l1 =
            |p: SubPurpose, f: &Filter| p == SubPurpose::Announcements && f.limit != Some(0);
        let mut keep_l1 = self.links.get(relay).is_some_and(|l| {
            l.queue
                .iter()
                .any(|(_, i)| waiting_l1(i.purpose, &i.filter))
                || l.reopen.iter().any(|(_, p, f)| waiting_l1(*p, f))
        });
        let mut old: Vec<SubscriptionId> = Vec::new();
        if let Some(l) = self.links.get_mut(relay) {
            let loading = l.loading.clone();
            l.subs.retain(|sub, info| {
                let purpose = &info.purpose;
                let of_pending_batch = matches!(purpose,
                    SubPurpose::Batch(id) | SubPurpose::Page { batch: Some(id) }
                        if pending_batches.contains(id));
                if loading.contains_key(sub) || of_pending_batch {
                    keep_l1 |= *purpose == SubPurpose::Announcements;
                    true
                } else {
                    old.push(sub.clone());
                    false
                }
            });
        }
        old.sort();
        for sub_id in old {
            self.commands.push_back(Command::Unsubscribe {
                relay: relay.clone(),
                generation,
                sub_id,
            });
        }
        // Catch up from when items lost their live subscription: now for those closed just
        // above, earlier for those whose batch query was closed at EOSE, whose live
        // subscription still waits in the queue, or whose waiting catch-up is merged here.
        // Live-only queries waiting in the queue or to be reopened are rebuilt below; so are
        // catch-ups the rebuild covers (every Layer 2/3 catch-up, and Layer 1's unless a
        // Layer 1 stays). Other history (pages, resumed queries) is kept as it is.
        let margin = self.config.quick_reconnect_window;
        let mut since = now.minus(margin).timestamp();
        if let Some(l) = self.links.get_mut(relay) {
            l.rebuild_needed = false;
            let mut from = l.uncovered_since.take().unwrap_or(now);
            let live_queued = l.queue.iter().any(|(_, i)| i.purpose == SubPurpose::Live);
            if let (true, Some(t)) = (live_queued, l.live_built_at) {
                from = from.min(t);
            }
            since = since.min(from.rebased(now).minus(margin).timestamp());
            let mut merge = |purpose: SubPurpose, f: &Filter| -> bool {
                if f.limit == Some(0) && purpose.is_live() {
                    return true;
                }
                match (purpose, f.since) {
                    (SubPurpose::CatchUp, Some(s)) if !(keep_l1 && is_l1_filter(f)) => {
                        since = since.min(s);
                        true
                    }
                    _ => false,
                }
            };
            l.queue.retain(|(_, i)| !merge(i.purpose, &i.filter));
            l.reopen.retain(|(_, p, f)| !merge(*p, f));
        }
        self.open_live_set(relay, since, !keep_l1, now);
        items.repos.retain(|r| !repos.contains(r));
        items.root_events.retain(|e| !roots.contains(e));
        let filters = build_layer2_and_layer3_filters(&items.repos, &items.root_events, None);
        self.subscribe_batch(relay, items.repos, items.root_events, filters, now);
        self.drain_queue(relay);
        let after = self.links.get(relay).map_or(0, |l| l.subs.len());
        info!("{relay}: consolidated {before} subscriptions (plus the new items) into {after}");
    }
}

/// True for a Layer 1 filter (announcements and repository state).
fn is_l1_filter(f: &Filter) -> bool {
    f.kinds.as_ref().is_some_and(|k| {
        k.contains(&nostr::event::Kind::Custom(
            crate::core::nip34::KIND_REPO_ANNOUNCEMENT,
        ))
    })
}
