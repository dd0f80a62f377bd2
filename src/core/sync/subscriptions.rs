//! Opening subscriptions within a relay's budget: the queue, REQ size, the live set and polling.

use log::{debug, info};
use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::filters::{
    build_announcement_filter, layer2_and_layer3_count, live_layer2_and_layer3_filters,
};
use crate::core::paging::PageLimits;
use crate::core::state::ConnectionStatus;
use crate::core::time::Time;
use crate::shared::RelayUrl;

use super::timers::Timer;
use super::{history_since, live_only, Command, SubInfo, SubPurpose, SyncMachine};

/// The most tag values in one live filter of a relay that publishes no
/// `max_message_length` (see `SyncMachine::max_live_chunk`).
pub(crate) const MAX_LIVE_CHUNK: usize = 1_000;

/// The most filters in one REQ (decision 0110): what ngit-grasp puts in its own (it accepts
/// 20; strfry and nostr-rs-relay set no lower bound).
pub const MAX_FILTERS_PER_REQ: usize = 10;

/// The most bytes of a REQ of several filters to a relay that publishes no
/// `max_message_length` (nostr-rs-relay and strfry take 128 KiB, khatru 512 KB).
pub(crate) const DEFAULT_REQ_BYTES: usize = 65_536;

impl SyncMachine {
    /// Opens one subscription (one REQ, one filter) on a remote relay; it counts as loading
    /// history until its EOSE.
    pub(super) fn open_sub(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        purpose: SubPurpose,
        filter: Filter,
    ) -> SubscriptionId {
        self.open_fetch(relay, generation, purpose, filter, None, None)
    }

    /// Opens a catch-up of each of `filters` on a remote relay: its history since `since`, no
    /// live part (the live subscription of the same filter is opened beside it).
    pub(super) fn open_catch_ups(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        filters: impl IntoIterator<Item = Filter>,
        since: nostr::types::Timestamp,
    ) {
        for f in filters {
            self.open_sub(
                relay,
                generation,
                SubPurpose::CatchUp,
                history_since(f, since),
            );
        }
    }

    /// [`Self::open_sub`] whose events must also match `scope` (not sent; see
    /// [`Command::Subscribe`]); for a reconciliation's fetch, `fetch_since` is the verified
    /// set's clock when its own side was read ([`Command::Subscribe`]).
    pub(super) fn open_fetch(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        purpose: SubPurpose,
        filter: Filter,
        scope: Option<std::sync::Arc<Filter>>,
        fetch_since: Option<u32>,
    ) -> SubscriptionId {
        let mut filter = filter;
        if let (Some(max), None) = (self.page_limits(relay).max_limit, filter.limit) {
            // The relay's default page may be smaller than its max_limit: ask for the max.
            filter = filter.limit(max);
        }
        let sub_id = self.new_sub_id();
        let budget = self.req_budget(relay);
        let cooling = self.cooling(relay, self.last_now);
        let link = self.link(relay);
        let info = SubInfo {
            scope,
            fetch_since,
            ..SubInfo::new(purpose, filter)
        };
        let full = link.open_reqs() >= budget;
        let wait = cooling || !link.queue.is_empty();
        if wait || (full && !self.pack_room(relay, generation, &info)) {
            // Never more open subscriptions than the relay allows: wait for room (a query
            // joining the REQ about to be sent takes none).
            self.link(relay).queue.push_back((sub_id.clone(), info));
            self.unstick_queue(relay);
            return sub_id;
        }
        self.send_sub(relay, generation, sub_id.clone(), info);
        sub_id
    }

    pub(super) fn send_sub(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        sub_id: SubscriptionId,
        info: SubInfo,
    ) {
        let filter = info.filter.clone();
        let scope = info.scope.clone();
        let fetch_since = info.fetch_since;
        let now = self.last_now;
        if let SubPurpose::Batch(id) | SubPurpose::Page { batch: Some(id) } = info.purpose {
            // The batch's EOSE deadline counts from when its REQs are sent, not queued.
            if let Some(b) = self
                .pending_mut(relay)
                .and_then(|bs| bs.iter_mut().find(|b| b.batch_id == id))
            {
                b.started_at = b.started_at.max(now);
            }
        }
        let packs = self.pack_room(relay, generation, &info);
        let link = self.link(relay);
        link.subs.insert(sub_id.clone(), info);
        link.loading.insert(sub_id.clone(), now);
        link.forget_closed_members();
        if packs {
            self.pack_into_last(relay, sub_id, filter);
            return;
        }
        self.commands.push_back(Command::Subscribe {
            relay: relay.clone(),
            generation,
            sub_id,
            filter,
            scope,
            fetch_since,
        });
    }

    /// Whether `info` may go out in the REQ of several filters the machine is about to send
    /// to `relay` (the last command, not handed out yet; decision 0110): both are plain
    /// queries of a remote relay that takes several filters per REQ (no fetch by `ids`, no
    /// scope), the REQ has fewer than [`MAX_FILTERS_PER_REQ`] filters and stays within the
    /// relay's `max_message_length` (else [`DEFAULT_REQ_BYTES`]).
    fn pack_room(&self, relay: &RelayUrl, generation: u64, info: &SubInfo) -> bool {
        let Some(remote) = self.remotes.get(relay) else {
            return false;
        };
        let Some(key) = pack_key(info) else {
            return false;
        };
        if remote.single_filter || self.config.max_filters_per_req < 2 {
            return false;
        }
        let max = self.max_req_bytes(relay);
        let link = &remote.link;
        let member_ok =
            |id: &SubscriptionId| link.subs.get(id).is_some_and(|i| pack_key(i) == Some(key));
        let ids: Vec<&SubscriptionId> = match self.commands.back() {
            Some(Command::Subscribe {
                relay: r,
                generation: g,
                sub_id,
                scope: None,
                fetch_since: None,
                ..
            }) if r == relay && *g == generation => vec![sub_id],
            Some(Command::SubscribeMany {
                relay: r,
                generation: g,
                members,
            }) if r == relay
                && *g == generation
                && members.len() < self.config.max_filters_per_req =>
            {
                members.iter().map(|(id, _)| id).collect()
            }
            _ => return false,
        };
        if !ids.iter().all(|id| member_ok(id)) {
            return false;
        }
        // Each member was recorded as it was sent (`open_sub`), its length with it.
        let lens = ids
            .iter()
            .filter_map(|id| link.subs.get(*id))
            .map(|i| i.json_len);
        req_bytes(lens.chain(std::iter::once(info.json_len))) <= max
    }

    /// The longest REQ the machine sends `relay` with several filters, or grows in place
    /// (decision 0110): its NIP-11 `max_message_length` (else [`DEFAULT_REQ_BYTES`]) less
    /// 200 bytes of margin.
    pub(super) fn max_req_bytes(&self, relay: &RelayUrl) -> usize {
        self.nip11_of(relay)
            .max_message
            .unwrap_or(DEFAULT_REQ_BYTES)
            .saturating_sub(200)
    }

    /// Adds `sub_id` to the REQ the machine is about to send to `relay` (checked by
    /// [`Self::pack_room`]).
    fn pack_into_last(
        &mut self,
        relay: &RelayUrl,
        sub_id: SubscriptionId,
        filter: std::sync::Arc<Filter>,
    ) {
        let Some(last) = self.commands.back_mut() else {
            return;
        };
        let (wire, first) = match last {
            Command::Subscribe {
                relay: r,
                generation,
                sub_id: first,
                filter: f,
                ..
            } => {
                let wire = first.clone();
                *last = Command::SubscribeMany {
                    relay: r.clone(),
                    generation: *generation,
                    members: vec![(first.clone(), f.clone()), (sub_id.clone(), filter)],
                };
                (wire, true)
            }
            Command::SubscribeMany { members, .. } => {
                let wire = members[0].0.clone();
                members.push((sub_id.clone(), filter));
                (wire, false)
            }
            _ => return,
        };
        let link = self.link(relay);
        if first {
            link.packed.insert(wire.clone(), wire.clone());
        }
        link.packed.insert(sub_id, wire);
    }

    /// REQs that `n` queries of `relay` take when sent together (decision 0110).
    pub(super) fn reqs_for(&self, relay: &RelayUrl, n: usize) -> usize {
        if self.remotes.get(relay).is_some_and(|r| r.single_filter) {
            n
        } else {
            n.div_ceil(self.config.max_filters_per_req.max(1))
        }
    }

    /// The connection generation of `relay` when it is connected.
    pub(super) fn connected_generation(&self, relay: &RelayUrl) -> Option<u64> {
        self.state_of(relay)
            .filter(|s| s.connection_status == ConnectionStatus::Connected)
            .map(|s| s.generation)
    }

    /// Sends queued subscriptions while the budget has room.
    pub(super) fn drain_queue(&mut self, relay: &RelayUrl) {
        let budget = self.req_budget(relay);
        let last_now = self.last_now;
        let Some(generation) = self.connected_generation(relay) else {
            return;
        };
        let cooling = self.cooling(relay, last_now);
        loop {
            let Some(link) = self.link_of(relay) else {
                return;
            };
            let Some((_, front)) = link.queue.front() else {
                break;
            };
            if cooling || (link.open_reqs() >= budget && !self.pack_room(relay, generation, front))
            {
                break;
            }
            let Some((sub_id, info)) = self.link(relay).queue.pop_front() else {
                break;
            };
            self.send_sub(relay, generation, sub_id, info);
        }
        // Pages that waited for room in the queue may have it now.
        self.unpark_pages(relay);
        self.unstick_queue(relay);
        // A reconciliation may have waited for its live REQ to leave the queue.
        self.pump_jobs();
    }

    /// Queries are polled because the live set did not fit, but the relay is idle now with
    /// room for more live subscriptions (the history queries that held slots have finished):
    /// rebuild, so that they become live again.
    pub(super) fn promote_polled(&mut self, relay: &RelayUrl, now: Time) {
        let budget = self.req_budget(relay);
        let max_chunk = self.max_live_chunk(relay);
        let Some(link) = self.link_of(relay) else {
            return;
        };
        // Live queries, not REQs: the live set is laid out one query per slot, and several
        // may then share a REQ (decision 0110).
        let live = link.subs.values().filter(|i| i.purpose.is_live()).count();
        // Or the whole live set fits the budget in fewer, larger filters (Layer 1, Layers
        // 2+3, one slot kept for history): a rebuild consolidates it and polling ends.
        // (Not while a batch is pending: its subscriptions stay open through a rebuild.)
        let no_batch = self.pending_of(relay).is_empty();
        let consolidated_fits = no_batch
            && self.state_of(relay).is_some_and(|s| {
                let counts = (s.repos.len(), s.root_events.len());
                link.polled_at_counts != Some(counts)
                    && 1 + layer2_and_layer3_count(counts.0, counts.1, max_chunk) < budget
            });
        if !link.polled.is_empty()
            && link.queue.is_empty()
            && link.loading.is_empty()
            && !link.rebuild_needed
            && (live + 1 < budget || consolidated_fits)
        {
            debug!(
                "{relay}: {} polled queries and {} free slots; rebuilding the live set",
                link.polled.len(),
                budget - 1 - live
            );
            self.need_rebuild(relay, now);
        }
    }

    /// Queries wait in the queue while every slot holds a settled (live) subscription: no
    /// EOSE will ever free a slot, so the live set is rebuilt at once (settled
    /// subscriptions closed and consolidated within the budget, one slot kept for history).
    pub(super) fn unstick_queue(&mut self, relay: &RelayUrl) {
        let budget = self.req_budget(relay);
        let now = self.last_now;
        let cooling = self.cooling(relay, now);
        let Some(link) = self.link_of(relay) else {
            return;
        };
        // Only settled live subscriptions never free their slot; a history query about to be
        // closed at its EOSE, or one still loading, will.
        let all_settled_live = link
            .subs
            .iter()
            .all(|(id, i)| i.purpose.is_live() && !link.loading.contains_key(id));
        // A rebuild keeps the subscriptions of pending batches and opens the live set again
        // in what is left, one slot kept for history: it frees a slot only when more than
        // one subscription can be closed beyond the budget. (With every slot but one held by
        // a pending batch, a rebuild would close Layer 1 and open it again, at once, for
        // ever: seen with a relay that advertises NIP-77 and never answers it.)
        let pending = self.pending_of(relay);
        let closable_n = link
            .subs
            .values()
            .filter(|i| match i.purpose {
                SubPurpose::Batch(id) => !pending.iter().any(|b| b.batch_id == id),
                _ => true,
            })
            .count();
        let open = link.open_reqs();
        let closable = closable_n > open.saturating_sub(budget) + 1;
        // A rebuild already needed (a batch query gave its slot back before the live set
        // was built) waits for the relay to be idle, at the latest for the consolidation
        // wait: here it is idle, and nothing else will start it, so it runs now too (a
        // first sync waited up to 30 s per relay, issue 37).
        let due = self
            .timers
            .get(&Timer::Consolidate(relay.clone()))
            .is_some_and(|t| t <= now);
        if !link.queue.is_empty()
            && open >= budget
            && all_settled_live
            && closable
            && !cooling
            && !due
        {
            info!(
                "{relay}: {} queries wait behind {} settled subscriptions; rebuilding the live set{}",
                link.queue.len(),
                open,
                if link.rebuild_needed { " now, not at the consolidation wait" } else { "" }
            );
            self.link(relay).rebuild_needed = true;
            self.timers.set(Timer::Consolidate(relay.clone()), now);
        }
    }

    /// NIP-77 sessions open on `relay` (a running reconciliation, a detection): relays such
    /// as strfry count them against the same budget as REQs (issue 36).
    pub(super) fn negs_open(&self, relay: &RelayUrl) -> usize {
        let detection = self.remote_of(relay).is_some_and(|r| r.detection.is_some());
        self.recon.running_of(relay) + usize::from(detection)
    }

    /// Slots of `relay`'s budget kept from REQs for NIP-77 sessions: those open, and at
    /// least one while its history may be reconciled, so a reconciliation can always start
    /// (its batch's REQs could otherwise fill every slot and wait for it for ever).
    pub(super) fn neg_slots(&self, relay: &RelayUrl) -> usize {
        if !self.negs_take_slots(relay) {
            return 0;
        }
        let support = self.nip77_support(relay);
        let cfg = &self.config.nip77;
        let may = cfg.enabled
            && *relay != self.config.own_relay
            && (support.in_use()
                || (cfg.probe_unadvertised && support == super::Nip77Support::Unknown));
        self.negs_open(relay).max(usize::from(may))
    }

    /// Whether NEG sessions are counted in `relay`'s budget: only with room for one beside
    /// Layer 1 and a reconciliation's live REQ (a budget of 3 or more). With less, a slot kept
    /// for NIP-77 leaves one REQ: Layer 1 holds it, every job's live REQ waits behind it
    /// and no job ever starts; so sessions run outside the count there, as before decision
    /// 0094 (a relay that small that counts them refuses the session, and its history is
    /// read by REQ).
    pub(super) fn negs_take_slots(&self, relay: &RelayUrl) -> bool {
        self.budget(relay) >= 3
    }

    /// Whether a NEG session may open on `relay` now: a slot is free beside its REQs and
    /// sessions (always when sessions are not counted, [`Self::negs_take_slots`]).
    pub(super) fn neg_room(&self, relay: &RelayUrl) -> bool {
        !self.negs_take_slots(relay)
            || self
                .link_of(relay)
                .is_none_or(|l| l.open_reqs() + self.negs_open(relay) < self.budget(relay))
    }

    /// Open REQs `relay` is given: its budget less [`Self::neg_slots`], at least one.
    pub(super) fn req_budget(&self, relay: &RelayUrl) -> usize {
        self.budget(relay)
            .saturating_sub(self.neg_slots(relay))
            .max(1)
    }

    /// Open subscriptions the relay allows (NIP-11 `max_subscriptions`, else the default);
    /// the own relay's too.
    pub fn budget(&self, relay: &RelayUrl) -> usize {
        self.nip11_of(relay)
            .budget
            .unwrap_or(self.config.default_subscription_budget)
            .max(2)
    }

    /// Open subscriptions above which new items trigger a consolidation.
    pub(super) fn threshold(&self, relay: &RelayUrl) -> usize {
        self.config.consolidation_threshold.min(self.budget(relay))
    }

    /// Splits (by halving tag values) every filter whose REQ would be longer than the relay's
    /// NIP-11 `max_message_length` (with room for `since`/`until`/`limit` added later).
    pub(super) fn fit_filters(&self, relay: &RelayUrl, filters: Vec<Filter>) -> Vec<Filter> {
        let Some(max) = self.nip11_of(relay).max_message else {
            return filters;
        };
        let budget = max.saturating_sub(120).max(200);
        let mut out = Vec::new();
        let mut todo: Vec<Filter> = filters.into_iter().rev().collect();
        while let Some(f) = todo.pop() {
            // `["REQ","gsNNNNNNNNNN",` + filter + `]`
            let len = crate::core::filter_json::filter_len(&f) + 24;
            let splittable = f.generic_tags.iter().find(|(_, v)| v.len() >= 2);
            match splittable {
                Some((tag, values)) if len > budget => {
                    let tag = *tag;
                    let values: Vec<String> = values.iter().cloned().collect();
                    let (a, b) = values.split_at(values.len() / 2);
                    let mut fb = f.clone();
                    fb.generic_tags.insert(tag, b.iter().cloned().collect());
                    let mut fa = f;
                    fa.generic_tags.insert(tag, a.iter().cloned().collect());
                    todo.push(fb);
                    todo.push(fa);
                }
                _ => out.push(f),
            }
        }
        out
    }

    /// The most tag values one live filter of `relay` takes: what fits its NIP-11
    /// `max_message_length` (a value is 64 hex characters or a coordinate, about 70 bytes
    /// quoted), else [`MAX_LIVE_CHUNK`] (a REQ of about 70 KB, below the 128 KiB that
    /// nostr-rs-relay and strfry accept).
    pub(super) fn max_live_chunk(&self, relay: &RelayUrl) -> usize {
        match self.nip11_of(relay).max_message {
            Some(max) => (max.saturating_sub(400) / 80).clamp(1, MAX_LIVE_CHUNK),
            None => MAX_LIVE_CHUNK,
        }
    }

    /// Opens Layer 1 (when `with_l1`) and Layers 2+3 of the confirmed items as live-only
    /// subscriptions (`limit: 0`, no `since`), as many as the budget allows with one slot
    /// left for history queries, each with a history catch-up from `since` that is closed
    /// at EOSE; the rest of Layers 2+3 is polled every poll interval instead (the first
    /// round from `since`).
    pub(super) fn open_live_set(
        &mut self,
        relay: &RelayUrl,
        since: nostr::types::Timestamp,
        with_l1: bool,
        now: Time,
    ) {
        let Some(state) = self.state_of(relay) else {
            return;
        };
        let generation = state.generation;
        // Transient history queries (catch-ups, pages, resumed queries) give their slot back at
        // EOSE: only live subscriptions take capacity from the live set.
        let open = self.link_of(relay).map_or(0, |l| {
            l.subs.values().filter(|i| i.purpose.is_live()).count()
        });
        let capacity = self
            .req_budget(relay)
            .saturating_sub(1)
            .saturating_sub(open)
            .max(usize::from(with_l1));
        let mut queries = Vec::new();
        if with_l1 {
            queries.push((SubPurpose::Announcements, build_announcement_filter(None)));
        }
        // As few, larger filters as the budget needs, within the relay's message size.
        let slots = capacity.saturating_sub(usize::from(with_l1));
        let l23 = live_layer2_and_layer3_filters(
            &state.repos,
            &state.root_events,
            slots,
            self.max_live_chunk(relay),
        );
        for f in self.fit_filters(relay, l23) {
            queries.push((SubPurpose::Live, f));
        }
        let polled: Vec<Filter> = if queries.len() > capacity {
            queries
                .split_off(capacity)
                .into_iter()
                .map(|(_, f)| f)
                .collect()
        } else {
            Vec::new()
        };
        for (purpose, filter) in &queries {
            self.open_sub(relay, generation, *purpose, live_only(filter));
        }
        if !queries.is_empty() {
            self.link(relay).catch_up_since = Some(since);
        }
        // The catch-ups take the queries' filters (a live set's Layer 3 filters hold every
        // root event id of the relay three times: copying them again was a third of the peak
        // heap of a first sync, issue 21).
        self.open_catch_ups(
            relay,
            generation,
            queries.into_iter().map(|(_, f)| f),
            since,
        );
        let interval = self.config.poll_interval;
        let counts = self
            .state_of(relay)
            .map(|s| (s.repos.len(), s.root_events.len()));
        let link = self.link(relay);
        link.live_built_at = Some(now);
        link.polled_at_counts = if polled.is_empty() { None } else { counts };
        if polled.is_empty() {
            link.polled.clear();
            link.poll_since = None;
            self.timers.cancel(&Timer::Poll(relay.clone()));
        } else {
            info!(
                "{relay}: {} queries do not fit the relay's subscription budget; polling them every {interval:?}",
                polled.len()
            );
            link.polled = polled;
            link.poll_since = Some(link.poll_since.map_or(since, |p| p.min(since)));
            self.timers.set(Timer::Poll(relay.clone()), now);
        }
    }

    /// One poll round: every polled query with `since`, closed at EOSE (paged like any
    /// history). A round starts only when the previous one has finished.
    pub(super) fn poll_round(&mut self, relay: &RelayUrl, now: Time) {
        let interval = self.config.poll_interval;
        let margin = self.config.quick_reconnect_window;
        if !self.remotes.contains_key(relay) {
            return;
        }
        self.timers
            .set(Timer::Poll(relay.clone()), now.plus(interval));
        let Some(link) = self.link_mut(relay) else {
            return;
        };
        let busy = link
            .subs
            .values()
            .chain(link.queue.iter().map(|q| &q.1))
            .any(|i| i.purpose == SubPurpose::Page { batch: None });
        if busy || link.polled.is_empty() {
            return;
        }
        let since = link
            .poll_since
            .unwrap_or_else(|| now.minus(margin).timestamp());
        link.poll_since = Some(now.minus(margin).timestamp());
        link.catch_up_since = Some(since);
        let filters: Vec<Filter> = link.polled.iter().map(|f| f.clone().since(since)).collect();
        let Some(generation) = self.connected_generation(relay) else {
            return;
        };
        debug!(
            "{relay}: poll round of {} queries since {}",
            filters.len(),
            since.as_secs()
        );
        for f in filters {
            self.open_sub(relay, generation, SubPurpose::Page { batch: None }, f);
        }
    }

    /// Page size and `max_limit` of `relay` (the own relay too): published, else a cap
    /// learnt from it, else assumed; with the largest page it returned (decision 0103).
    pub(super) fn page_limits(&self, relay: &RelayUrl) -> PageLimits {
        let base = self.published_page_limits(relay);
        self.caps_of(relay).map_or(base, |c| c.limits(&base))
    }

    /// Page size and `max_limit` of `relay` (the own relay too) as published, else assumed
    /// (what [`crate::core::paging::CapWatch::plan`] starts from).
    pub(super) fn published_page_limits(&self, relay: &RelayUrl) -> PageLimits {
        self.nip11_of(relay)
            .page_limits
            .unwrap_or_else(|| PageLimits::assumed(self.config.assumed_page_size))
    }

    /// What paging learnt about the cap of `relay` (the own relay too), if it is known.
    fn caps_of(&self, relay: &RelayUrl) -> Option<&crate::core::paging::CapWatch> {
        if *relay == self.config.own_relay {
            return Some(&self.own_caps);
        }
        self.remotes.get(relay).map(|r| &r.caps)
    }
}

/// The length of a REQ of filters whose JSON is `lens` bytes long: `["REQ","gsNNNNNNNNNN",`
/// + the filters joined by `,` + `]` (one byte over for the last filter).
pub(super) fn req_bytes(lens: impl IntoIterator<Item = usize>) -> usize {
    24 + lens.into_iter().map(|len| len + 1).sum::<usize>()
}

/// Queries that may share a REQ (decision 0110) have the same key: queries that end
/// together, since a REQ gives its slot back only when its last query is closed. History
/// closed at EOSE (catch-ups, pages, poll rounds); the live set (Layer 1 and live chunks);
/// the history-and-live queries of one batch. Never a query by `ids` (a reconciliation's
/// fetch tracks what it asked for), a scoped one, nor a batch's live-only query (the live
/// part of one reconciliation, which ends with its job).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PackKey {
    History,
    Live,
    Batch(u64),
}

fn pack_key(info: &SubInfo) -> Option<PackKey> {
    if info.scope.is_some() || info.filter.ids.is_some() {
        return None;
    }
    match info.purpose {
        SubPurpose::CatchUp | SubPurpose::Page { .. } => Some(PackKey::History),
        SubPurpose::Announcements | SubPurpose::Live => Some(PackKey::Live),
        SubPurpose::Batch(id) if info.filter.limit != Some(0) => Some(PackKey::Batch(id)),
        _ => None,
    }
}
