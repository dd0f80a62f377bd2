//! compute_actions → AddFilters → PendingBatch → EOSE (with pages) → confirmed, or failed and retried.

use crate::core::hash::{HashMap, HashSet};
use std::time::Duration;

use log::{debug, info, warn};
use nostr::event::EventId;
use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::filters::build_layer2_and_layer3_filters;
use crate::core::paging::{bound_plan, plan_pages, PagePlan, PageStats};
use crate::core::state::{
    ConnectionStatus, PendingBatch, PendingItems, RelayState, RelaySyncNeeds,
};
use crate::core::targets::{compute_action, AddFilters};
use crate::core::time::Time;
use crate::shared::RelayUrl;

use super::timers::Timer;
use super::{unbatched_loading, Command, Link, Parked, SubPurpose, SyncMachine};

/// What one planning ([`SyncMachine::run_compute_actions`]) diffs: gathered by the input
/// that changed the targets and consumed by the planning at its end, so nothing of it
/// outlives the input.
#[derive(Debug, Default)]
pub(super) struct Replan {
    /// Relays whose target changed: their whole target is diffed.
    pub(super) relays: HashSet<RelayUrl>,
    /// Relays whose target only grew by these root events: only they are diffed (the rest
    /// of the target is pending, confirmed, deferred or waits for the relay's own trigger).
    pub(super) roots: HashMap<RelayUrl, HashSet<EventId>>,
}

impl SyncMachine {
    /// Runs the selection again after a relay set or the excluded relays changed; the
    /// relays whose target changed join `replan`. Root-event links added in the same batch
    /// follow (`Plan::add_root_event`), so the caller checks the plan after both.
    pub(super) fn reselect(&mut self, replan: &mut Replan) {
        self.counters.selections += 1;
        let policy = self.policy();
        let changed = self
            .plan
            .reselect(&self.repo_index, &self.excluded, &policy);
        replan.relays.extend(changed);
    }

    /// [`Self::reselect`] after the relay sets of `repos` changed, in proportion to the
    /// change ([`crate::core::targets::Plan::reselect_repos`]).
    pub(super) fn reselect_repos(
        &mut self,
        repos: &[crate::core::nip34::RepoRef],
        replan: &mut Replan,
    ) {
        let policy = self.policy();
        let changed = self
            .plan
            .reselect_repos(&self.repo_index, &self.excluded, &policy, repos);
        replan.relays.extend(changed);
    }

    /// Debug builds: the cached targets equal a fresh derivation.
    pub(super) fn check_plan(&self) {
        #[cfg(debug_assertions)]
        {
            if self.reselect_due() {
                // A change of standing waits for its selection.
                return;
            }
            let fresh = crate::core::targets::derive_targets(
                &self.repo_index,
                &self.excluded,
                &self.policy(),
            );
            debug_assert!(
                fresh.targets == *self.plan.targets() && fresh.report == self.plan.report(),
                "cached targets differ from a fresh derive_targets"
            );
        }
    }

    /// `compute_actions` for the relays in `replan` (and the targets refused at
    /// `max_relays` before, [`super::remote::Unknown::no_slot`]): every other relay's target
    /// is already pending, confirmed, deferred, or waits for its own trigger (connect, retry
    /// timer).
    pub(super) fn run_compute_actions(&mut self, replan: Replan, now: Time) {
        let Replan {
            relays: mut replan,
            roots: grown,
        } = replan;
        replan.extend(std::mem::take(&mut self.unknown.no_slot));
        let targets = self.plan.targets();
        // A relay not known yet only gets its connection spawned (`handle_add_filters`
        // discards the filters): its target is diffed when it connects, so it is not diffed
        // here (at a full rebuild that would build every relay's filters for nothing).
        let mut unknown: Vec<RelayUrl> = Vec::new();
        let mut actions: Vec<AddFilters> = replan
            .iter()
            .filter_map(|r| {
                let (r, t) = targets.get_key_value(r)?;
                if self.remotes.contains_key(r) {
                    self.action_for(r, t)
                } else {
                    unknown.push(r.clone());
                    None
                }
            })
            .collect();
        // Relays whose target only grew by root events: diff just those.
        let deltas: Vec<(RelayUrl, RelaySyncNeeds)> = grown
            .into_iter()
            .filter(|(r, _)| !replan.contains(r))
            .map(|(r, ids)| {
                (
                    r,
                    RelaySyncNeeds {
                        repos: HashSet::default(),
                        root_events: ids,
                    },
                )
            })
            .collect();
        self.check_deltas(&deltas);
        actions.extend(deltas.iter().filter_map(|(r, n)| self.action_for(r, n)));
        // In relay order, as one sorted list of actions would be handled.
        let mut work: Vec<(RelayUrl, Option<AddFilters>)> = actions
            .into_iter()
            .map(|a| (a.relay_url.clone(), Some(a)))
            .chain(unknown.into_iter().map(|r| (r, None)))
            .collect();
        work.sort_by(|a, b| a.0.cmp(&b.0));
        for (relay, action) in work {
            if self.timers.is_set(&Timer::RetryBatches(relay.clone())) {
                continue;
            }
            match action {
                Some(a) => self.handle_add_filters(a, now),
                None => self.spawn_relay(relay, now),
            }
        }
    }

    /// Debug builds: diffing only the new root events of a relay misses nothing a full diff
    /// of its target would send (what else the full diff finds is deferred already).
    fn check_deltas(&self, deltas: &[(RelayUrl, RelaySyncNeeds)]) {
        #[cfg(debug_assertions)]
        for (relay, delta) in deltas {
            if self.timers.is_set(&Timer::RetryBatches(relay.clone())) {
                continue;
            }
            let Some(a) = self
                .plan
                .targets()
                .get(relay)
                .and_then(|t| self.action_for(relay, t))
            else {
                continue;
            };
            let deferred = self.link_of(relay).map(|l| &l.deferred);
            for r in &a.repos {
                debug_assert!(
                    deferred.is_some_and(|d| d.repos.contains(r)),
                    "{relay}: repo {r} would be missed by a delta diff"
                );
            }
            for id in &a.root_events {
                debug_assert!(
                    delta.root_events.contains(id)
                        || deferred.is_some_and(|d| d.root_events.contains(id)),
                    "{relay}: root {id} would be missed by a delta diff"
                );
            }
        }
        #[cfg(not(debug_assertions))]
        let _ = deltas;
    }

    /// The design's `recompute_actions_for_relay`: `compute_actions` for `relay`'s whole
    /// target, then [`Self::handle_add_filters`].
    pub(super) fn recompute_actions_for_relay(&mut self, relay: &RelayUrl, now: Time) {
        let action = self
            .plan
            .targets()
            .get(relay)
            .and_then(|t| self.action_for(relay, t));
        if let Some(a) = action {
            self.handle_add_filters(a, now);
        }
    }

    /// [`compute_action`] for `relay` against what it has pending and confirmed.
    fn action_for(&self, relay: &RelayUrl, target: &RelaySyncNeeds) -> Option<AddFilters> {
        let r = self.remotes.get(relay);
        compute_action(
            relay,
            target,
            r.map(|r| &r.state),
            r.map_or(&[], |r| &r.pending),
        )
    }

    /// A relay that is a target but not known yet: its connection is spawned (its items are
    /// planned when it connects), unless `max_relays` relays are known already.
    pub(super) fn spawn_relay(&mut self, relay_url: RelayUrl, now: Time) {
        if self.remotes.len() >= self.config.max_relays {
            // Tried again at the next planning, when a slot may have freed up.
            self.unknown.no_slot.insert(relay_url.clone());
            self.counters.relays_refused += 1;
            if self.counters.relays_refused == 1 {
                warn!(
                    "{relay_url}: not connecting: already {} relays (max_relays); further relays are ignored",
                    self.remotes.len()
                );
            } else {
                debug!("{relay_url}: not connecting: max_relays reached");
            }
            return;
        }
        info!("discovered relay {relay_url}");
        self.add_remote(&relay_url, RelayState::new(false));
        self.connect_remote(&relay_url, now);
    }

    /// The design's `handle_add_filters`: spawn unknown relays; subscribe connected ones and
    /// record a [`PendingBatch`].
    pub(super) fn handle_add_filters(&mut self, action: AddFilters, now: Time) {
        let AddFilters {
            relay_url,
            repos,
            root_events,
            filters,
        } = action;
        match self.state_of(&relay_url) {
            None => {
                self.spawn_relay(relay_url, now);
                return;
            }
            Some(s) if s.connection_status != ConnectionStatus::Connected => return,
            Some(_) => {}
        }
        // Items restored from a state file that join the targets only now (issue 11).
        let (mut repos, mut root_events, mut filters) = (repos, root_events, filters);
        if self.take_late_restored(&relay_url, &mut repos, &mut root_events, now) {
            if repos.is_empty() && root_events.is_empty() {
                return;
            }
            filters = build_layer2_and_layer3_filters(&repos, &root_events, None);
        }
        // maybe_consolidate: checked BEFORE the new filters are added.
        let open = self.link_of(&relay_url).map_or(0, |l| l.open_reqs());
        let deferring = self
            .link_of(&relay_url)
            .is_some_and(|l| !l.deferred.is_empty());
        let threshold = self.threshold(&relay_url);
        let over = open > 1 && open + self.reqs_for(&relay_url, filters.len()) > threshold;
        if over
            && !deferring
            && self.can_extend_live_set(&relay_url, repos.len(), root_events.len())
        {
            // The live set stays; the new items get their batch and join it once confirmed
            // (decision 0063): nothing to wait for.
            self.subscribe_batch(&relay_url, repos, root_events, filters, now);
            return;
        }
        if deferring || over {
            let wait = self.config.consolidation_wait;
            let link = self.link(&relay_url);
            link.deferred.repos.extend(repos);
            link.deferred.root_events.extend(root_events);
            let by = Timer::Consolidate(relay_url.clone());
            if !self.timers.is_set(&by) {
                info!(
                    "{relay_url}: {open} open + {} new subscriptions exceed {}; consolidating",
                    filters.len(),
                    threshold
                );
                self.timers.set(by, now.plus(wait));
            }
            self.run_deferred_if_idle(&relay_url, now);
            return;
        }
        self.subscribe_batch(&relay_url, repos, root_events, filters, now);
    }

    /// Subscribes `filters` (one REQ each) as a new [`PendingBatch`] of the given items.
    pub(super) fn subscribe_batch(
        &mut self,
        relay_url: &RelayUrl,
        repos: HashSet<crate::core::nip34::RepoRef>,
        root_events: HashSet<EventId>,
        filters: Vec<Filter>,
        now: Time,
    ) {
        if filters.is_empty() {
            return;
        }
        let relay_url = relay_url.clone();
        let filters = self.fit_filters(&relay_url, filters);
        let generation = self.remotes[&relay_url].state.generation;
        self.next_batch += 1;
        let batch_id = self.next_batch;
        // The PendingBatch exists before its queries open: a reconciliation may need it.
        if let Some(batches) = self.pending_mut(&relay_url) {
            batches.push(PendingBatch {
                batch_id,
                items: PendingItems { repos, root_events },
                outstanding_subs: HashSet::default(),
                started_at: now,
                incomplete: false,
                uncovered_from: None,
            });
        }
        for filter in filters {
            self.open_history(
                &relay_url,
                generation,
                SubPurpose::Batch(batch_id),
                filter,
                Some(batch_id),
            );
        }
        let Some(batch) = self
            .pending_of(&relay_url)
            .iter()
            .find(|b| b.batch_id == batch_id)
        else {
            return;
        };
        debug!(
            "{relay_url}: batch {batch_id} with {} repos, {} root events, {} subscriptions",
            batch.items.repos.len(),
            batch.items.root_events.len(),
            batch.outstanding_subs.len()
        );
    }

    pub(super) fn handle_eose(
        &mut self,
        relay: &RelayUrl,
        sub_id: &SubscriptionId,
        stats: &PageStats,
        now: Time,
    ) {
        // The filter stays where it is (a Layer 2/3 filter holds 100 tag values: cloning it
        // per EOSE was a third of the coordinator's CPU in a first sync, issue 21); it is
        // copied only when a split query is parked.
        let base = self.published_page_limits(relay);
        let Some((purpose, scope, watched, cut)) = self.remote_mut(relay).and_then(|r| {
            let (l, caps) = (&mut r.link, &mut r.caps);
            // A live-only REQ (`limit: 0`) has no history: not counted.
            if l.loading.remove(sub_id).is_some()
                && l.subs
                    .get(sub_id)
                    .is_some_and(|i| i.filter.limit != Some(0))
            {
                l.history_queries_completed += 1;
            }
            l.subs.get(sub_id).map(|info| {
                // Pages planned with what the relay has shown, probes for a hidden cap
                // included (decision 0103).
                // A filter that shared its REQ: only the newest `cap` of its matches are the
                // relay's answer to it (decision 0110).
                let limits = caps.limits(&base);
                let cap = match info.filter.limit {
                    Some(l) => l.min(limits.max_limit.unwrap_or(usize::MAX)),
                    None => limits.page_size,
                };
                let cut = stats.cut_to(cap);
                let watched = caps.plan(&info.filter, cut.as_ref().unwrap_or(stats), &base);
                (info.purpose, info.scope.clone(), watched, cut)
            })
        }) else {
            return;
        };
        let stats = cut.as_ref().unwrap_or(stats);
        let plan = watched.plan;
        if let Some(cap) = watched.learned {
            self.counters.caps_learned += 1;
            warn!(
                "{relay}: returns at most {cap} events per query without publishing a limit (a short page was followed by events it lacked); pages of {cap} are read as full from now on"
            );
        }
        if plan.probe {
            self.counters.cap_probes += 1;
            debug!(
                "{relay}: a short page of {} events may be cut by a cap below the assumed page size; asking once more with until",
                stats.received.saturating_add(stats.rejected)
            );
        }
        let batch_id = match purpose {
            SubPurpose::Batch(id) => Some(id),
            SubPurpose::Page { batch } => batch,
            _ => None,
        };
        // Pages of older history first, so a batch never confirms before its pages.
        let parked = self.link_of(relay).map_or(0, |l| l.parked.len());
        let mut plan = if plan.next.len() > 1 {
            let filter = self
                .link_of(relay)
                .and_then(|l| l.subs.get(sub_id))
                .map(|info| info.query())
                .unwrap_or_default();
            self.admit_pages(relay, plan, batch_id, &filter, stats)
        } else {
            plan
        };
        let generation = self.state_of(relay).map_or(0, |s| s.generation);
        let mut page_subs = Vec::new();
        for f in std::mem::take(&mut plan.next) {
            self.counters.pages_requested += 1;
            // Pages of a fetch keep its scope (a parked query is its full filter).
            page_subs.push(self.open_fetch(
                relay,
                generation,
                SubPurpose::Page { batch: batch_id },
                f,
                scope.clone(),
                None,
            ));
        }
        if stats.undelivered.is_empty() {
            // A second asking that delivered everything: done with it.
            self.recon.refetches.remove(sub_id);
        } else {
            page_subs.extend(self.refetch_undelivered(
                relay,
                sub_id,
                batch_id,
                scope.clone(),
                &stats.undelivered,
            ));
        }
        // A REQ reading a query whole ended: fetches of other relays waiting for it may go,
        // or wait for its pages (decision 0121).
        let mut rest = page_subs.clone();
        if let Some(p) = self
            .link_of(relay)
            .filter(|l| l.parked.len() > parked)
            .and_then(|l| l.parked.back())
        {
            // Its pages wait for room: they deliver the rest once unparked.
            rest.push(p.id.clone());
        }
        if self.recon.delivering.ended(sub_id, &rest) {
            self.recon.flush_due = true;
        }
        // At its budget with a live set built, a batch's query gives its slot back too: its
        // items join the live chunks in place (decision 0110).
        let budget = self.req_budget(relay);
        let incremental = self.config.max_filters_per_req >= 2;
        let constrained = self.link_of(relay).is_some_and(|l| {
            !l.queue.is_empty()
                || !l.polled.is_empty()
                || (incremental && l.live_built_at.is_some() && l.subs.len() >= budget)
        });
        let close = match purpose {
            SubPurpose::Page { .. } | SubPurpose::CatchUp => true,
            // Over budget: a batch's history query gives its slot back at EOSE; its items
            // join the live or polled set once it confirms (decision 0063), or at the next
            // rebuild when no live set was built on this connection yet.
            SubPurpose::Batch(id) if constrained => {
                if self
                    .link_of(relay)
                    .is_none_or(|l| l.live_built_at.is_none())
                {
                    self.need_rebuild(relay, now);
                }
                if let Some(b) = self
                    .pending_mut(relay)
                    .and_then(|bs| bs.iter_mut().find(|b| b.batch_id == id))
                {
                    b.uncovered_from.get_or_insert(now);
                }
                true
            }
            _ => false,
        };
        if close {
            if let Some(l) = self.link_mut(relay) {
                l.subs.remove(sub_id);
            }
            self.commands.push_back(Command::Unsubscribe {
                relay: relay.clone(),
                generation,
                sub_id: sub_id.clone(),
            });
            self.drain_queue(relay);
            self.promote_polled(relay, now);
        } else {
            // A live subscription settled: if queries wait and nothing else is loading, no
            // EOSE will free a slot.
            self.unstick_queue(relay);
        }
        if plan.partial_split {
            info!(
                "{relay}: more events than the relay returns share one second; split by the kinds/authors seen (events of other kinds/authors in that second cannot be asked for)"
            );
        }
        if let Some(why) = &plan.incomplete {
            self.counters.incomplete_queries += 1;
            self.link(relay).incomplete_queries += 1;
            warn!(
                "{relay}: history of {sub_id} ({:?}) is incomplete: {why}",
                purpose
            );
        }
        debug!(
            "{relay}: EOSE for {sub_id} ({:?}, {} events, {} pages)",
            purpose,
            stats.received,
            page_subs.len()
        );
        let Some(batch_id) = batch_id else {
            self.run_deferred_if_idle(relay, now);
            return;
        };
        let Some(batches) = self.pending_mut(relay) else {
            return;
        };
        let Some(pos) = batches.iter().position(|b| b.batch_id == batch_id) else {
            return;
        };
        let batch = &mut batches[pos];
        batch.outstanding_subs.remove(sub_id);
        batch.outstanding_subs.extend(page_subs);
        // Progress: the EOSE deadline counts from the last answer.
        batch.started_at = now;
        if plan.incomplete.is_some() {
            batch.incomplete = true;
        }
        self.confirm_if_done(relay, batch_id, now);
    }

    /// The part of `plan` (the follow-ups of `filter`, which delivered `stats`) to queue
    /// now; what does not fit is parked, never dropped while memory allows:
    /// * one next page replaces the query that ended, so it is always queued (a relay's
    ///   pages never outnumber its history queries plus what splits added);
    /// * a page split into several queries is queued when the relay's waiting pages leave
    ///   room (`SyncConfig::max_queued_pages`); else the query is parked whole (one query and its
    ///   statistics, [`super::Parked`]) and planned again when there is room
    ///   ([`Self::unpark_pages`]); its batch waits for it (its id joins the batch's
    ///   outstanding set at once);
    /// * only when [`MAX_PARKED`] queries are parked already (a relay whose pages multiply
    ///   without end) are the pages dropped and the query reported incomplete.
    fn admit_pages(
        &mut self,
        relay: &RelayUrl,
        plan: PagePlan,
        batch: Option<u64>,
        filter: &Filter,
        stats: &PageStats,
    ) -> PagePlan {
        let max = self.config.max_queued_pages;
        let (queued, parked) = self
            .link_of(relay)
            .map_or((0, 0), |l| (queued_pages(l), l.parked.len()));
        if plan.next.len() <= 1 || queued + plan.next.len() <= max {
            return plan;
        }
        if parked >= MAX_PARKED {
            return bound_plan(plan, queued, max);
        }
        let id = self.new_sub_id();
        debug!(
            "{relay}: {} pages of a split query wait for room ({queued} pages queued)",
            plan.next.len()
        );
        if let Some(b) = batch.and_then(|id| {
            self.pending_mut(relay)
                .and_then(|bs| bs.iter_mut().find(|b| b.batch_id == id))
        }) {
            b.outstanding_subs.insert(id.clone());
        }
        self.link(relay).parked.push_back(Parked {
            id,
            batch,
            filter: filter.clone(),
            stats: stats.clone(),
        });
        PagePlan {
            next: Vec::new(),
            ..plan
        }
    }

    /// Queues the pages of parked queries ([`Self::admit_pages`]), oldest first, while the
    /// relay's waiting pages leave room for them (run whenever pages leave its queue).
    pub(super) fn unpark_pages(&mut self, relay: &RelayUrl) {
        let Some(generation) = self.connected_generation(relay) else {
            return;
        };
        let now = self.last_now;
        let limits = self.page_limits(relay);
        let max = self.config.max_queued_pages;
        loop {
            let Some(link) = self.link_of(relay) else {
                return;
            };
            let Some(first) = link.parked.front() else {
                return;
            };
            let plan = plan_pages(&first.filter, &first.stats, &limits);
            if queued_pages(link) + plan.next.len() > max {
                return;
            }
            let Some(p) = self.link(relay).parked.pop_front() else {
                return;
            };
            let exists = p
                .batch
                .is_none_or(|id| self.pending_of(relay).iter().any(|b| b.batch_id == id));
            if !exists {
                if self.recon.delivering.ended(&p.id, &[]) {
                    self.recon.flush_due = true;
                }
                continue;
            }
            let mut subs = Vec::new();
            for f in plan.next {
                self.counters.pages_requested += 1;
                subs.push(self.open_sub(relay, generation, SubPurpose::Page { batch: p.batch }, f));
            }
            // The pages of a query read whole go on delivering it (decision 0121).
            if self.recon.delivering.ended(&p.id, &subs) {
                self.recon.flush_due = true;
            }
            if let Some(why) = &plan.incomplete {
                self.counters.incomplete_queries += 1;
                self.link(relay).incomplete_queries += 1;
                warn!("{relay}: history of a query is incomplete: {why}");
            }
            let Some(id) = p.batch else {
                continue;
            };
            if let Some(b) = self
                .pending_mut(relay)
                .and_then(|bs| bs.iter_mut().find(|b| b.batch_id == id))
            {
                b.outstanding_subs.remove(&p.id);
                b.outstanding_subs.extend(subs);
                b.incomplete |= plan.incomplete.is_some();
            }
            self.confirm_if_done(relay, id, now);
        }
    }

    /// Confirms the batch when nothing of it is outstanding any more (every query reached
    /// EOSE, every reconciliation fetched what it found missing).
    pub(super) fn confirm_if_done(&mut self, relay: &RelayUrl, batch_id: u64, now: Time) {
        let Some(batches) = self.pending_mut(relay) else {
            return;
        };
        let Some(pos) = batches.iter().position(|b| b.batch_id == batch_id) else {
            return;
        };
        if !batches[pos].outstanding_subs.is_empty() {
            return;
        }
        let batch = batches.remove(pos);
        self.counters.batches_confirmed += 1;
        if batch.incomplete {
            warn!(
                "{relay}: batch {} confirmed INCOMPLETE: the relay could not deliver all history of its {} repos and {} root events",
                batch.batch_id,
                batch.items.repos.len(),
                batch.items.root_events.len()
            );
        }
        self.note_confirmed(relay, &batch.items, batch.incomplete);
        // Some of its queries were closed at EOSE: its items join the live set (with a
        // catch-up from that moment) at once when it can be extended (decision 0063), else
        // at the next rebuild.
        let joins = batch.uncovered_from.is_some()
            && self.link_of(relay).is_some_and(|l| {
                l.live_built_at.is_some() && !l.rebuild_needed && l.uncovered_since.is_none()
            });
        if let (true, Some(t)) = (joins, batch.uncovered_from) {
            self.join_live_set(relay, &batch.items, t, now);
        }
        if let Some(state) = self.remotes.get_mut(relay).map(|r| &mut r.state) {
            debug!(
                "{relay}: batch {} confirmed ({} repos, {} root events)",
                batch.batch_id,
                batch.items.repos.len(),
                batch.items.root_events.len()
            );
            if batch.incomplete {
                state.incomplete_batches += 1;
            }
            state.repos.extend(batch.items.repos);
            state.root_events.extend(batch.items.root_events);
        }
        if let (false, Some(t)) = (joins, batch.uncovered_from) {
            let l = self.link(relay);
            l.uncovered_since = Some(l.uncovered_since.map_or(t, |u| u.min(t)));
            self.need_rebuild(relay, now);
        }
        self.run_deferred_if_idle(relay, now);
    }

    pub(super) fn fail_batch(&mut self, relay: &RelayUrl, batch_id: u64, now: Time, why: &str) {
        self.fail_batch_for(relay, batch_id, now, why, None);
    }

    /// Fails a batch; its items are retried after `min_delay` or the backoff, whichever is
    /// longer.
    pub(super) fn fail_batch_for(
        &mut self,
        relay: &RelayUrl,
        batch_id: u64,
        now: Time,
        why: &str,
        min_delay: Option<Duration>,
    ) {
        let Some(batches) = self.pending_mut(relay) else {
            return;
        };
        let Some(pos) = batches.iter().position(|b| b.batch_id == batch_id) else {
            return;
        };
        let batch = batches.remove(pos);
        self.counters.batches_failed += 1;
        self.link(relay).failed_batches += 1;
        self.drop_batch_jobs(relay, batch_id);
        let generation = self.state_of(relay).map_or(0, |s| s.generation);
        let policy = self.config.backoff;
        let unit = self.jitter.unit();
        let retry = Timer::RetryBatches(relay.clone());
        let link = self.link(relay);
        // Close every subscription of the batch, also those that already saw EOSE: the
        // retry opens the same filters again.
        let mut subs: Vec<SubscriptionId> = link
            .subs
            .iter()
            .filter(|(_, i)| {
                i.purpose == SubPurpose::Batch(batch_id)
                    || i.purpose
                        == SubPurpose::Page {
                            batch: Some(batch_id),
                        }
            })
            .map(|(s, _)| s.clone())
            .collect();
        subs.sort();
        link.queue.retain(|(_, i)| {
            i.purpose != SubPurpose::Batch(batch_id)
                && i.purpose
                    != SubPurpose::Page {
                        batch: Some(batch_id),
                    }
        });
        link.parked.retain(|p| p.batch != Some(batch_id));
        for sub in &subs {
            link.loading.remove(sub);
            link.subs.remove(sub);
        }
        let delay = policy
            .base
            .mul_f64(0.75 + 0.5 * unit)
            .max(Duration::from_secs(1));
        let delay = delay
            .max(link.health.base_delay(now, &policy))
            .max(min_delay.unwrap_or(Duration::ZERO));
        let at = now.plus(delay);
        let deferred_waiting = !link.deferred.is_empty();
        for sub in subs {
            self.commands.push_back(Command::Unsubscribe {
                relay: relay.clone(),
                generation,
                sub_id: sub,
            });
        }
        // Its queries read whole no longer deliver (decision 0121).
        if !self.recon.delivering.is_empty() {
            self.purge_delivering();
        }
        self.timers.set_latest(retry, at);
        warn!(
            "{relay}: batch {batch_id} failed ({why}); its {} repos and {} root events are retried in {:.0}s",
            batch.items.repos.len(),
            batch.items.root_events.len(),
            at.since(now).as_secs_f64()
        );
        self.drain_queue(relay);
        if deferred_waiting {
            self.run_deferred_if_idle(relay, now);
        }
    }

    /// Marks the relay's live/polled sets for a rebuild once it is idle, at the latest after
    /// the consolidation wait (a relay that never stops loading is rebuilt all the same).
    pub(super) fn need_rebuild(&mut self, relay: &RelayUrl, now: Time) {
        let wait = self.config.consolidation_wait;
        self.link(relay).rebuild_needed = true;
        self.timers
            .set_earliest(Timer::Consolidate(relay.clone()), now.plus(wait));
    }

    /// Fails the batches of `relay` whose EOSE deadline passed (see
    /// [`SyncMachine::batch_awaits_eose`]).
    pub(super) fn expire_batches(&mut self, relay: &RelayUrl, now: Time) {
        if self.forward_paused_since.is_some() || self.is_stalled(relay) {
            return;
        }
        let timeout = self.config.eose_timeout;
        let link = self.link_of(relay);
        let expired: Vec<u64> = self
            .pending_of(relay)
            .iter()
            .filter(|b| now.since(b.started_at) >= timeout)
            .filter(|b| self.batch_awaits_eose(relay, link, b))
            .map(|b| b.batch_id)
            .collect();
        for batch_id in expired {
            self.log_outstanding(relay, batch_id);
            self.fail_batch(relay, batch_id, now, "no EOSE before the deadline");
        }
    }

    /// Logs (debug) where the outstanding queries of a batch that timed out stand: open
    /// (and whether still loading), queued, parked, a reconciliation, or nowhere (a query
    /// lost by the machine: the bug class of issue 21's stalled first syncs).
    fn log_outstanding(&self, relay: &RelayUrl, batch_id: u64) {
        if !log::log_enabled!(log::Level::Debug) {
            return;
        }
        let Some(b) = self
            .pending_of(relay)
            .iter()
            .find(|b| b.batch_id == batch_id)
        else {
            return;
        };
        let link = self.link_of(relay);
        let mut place: Vec<String> = b
            .outstanding_subs
            .iter()
            .take(20)
            .map(|s| {
                let at = match link {
                    Some(l) if l.subs.contains_key(s) => {
                        if l.loading.contains_key(s) {
                            "open, loading"
                        } else {
                            "open, settled"
                        }
                    }
                    Some(l) if l.queue.iter().any(|(q, _)| q == s) => "queued",
                    Some(l) if l.parked.iter().any(|p| p.id == *s) => "parked",
                    _ if self.recon.is_job(s) => "a reconciliation",
                    _ => "nowhere (lost)",
                };
                format!("{s}: {at}")
            })
            .collect();
        place.sort();
        debug!(
            "{relay}: batch {batch_id} timed out waiting for {} queries: {}",
            b.outstanding_subs.len(),
            place.join(", ")
        );
    }

    /// Queries of `relay` outside a batch (Layer 1, catch-up, polls, pages) whose EOSE did
    /// not come before the deadline: a relay may drop a query silently (nostr-rs-relay does
    /// under load). They are closed and sent again, never left "loading" for ever.
    pub(super) fn expire_loading(&mut self, url: &RelayUrl, now: Time) {
        if self.forward_paused_since.is_some() || self.is_stalled(url) {
            return;
        }
        let timeout = self.config.eose_timeout;
        let overdue: Vec<SubscriptionId> = self
            .link_of(url)
            .into_iter()
            .flat_map(|link| {
                unbatched_loading(link)
                    .filter(|(_, t)| now.since(*t) >= timeout)
                    .map(|(s, _)| s.clone())
            })
            .collect();
        for sub in overdue {
            let Some(generation) = self.state_of(url).map(|s| s.generation) else {
                continue;
            };
            let Some(info) = self.link_mut(url).and_then(|l| {
                l.loading.remove(&sub);
                l.subs.remove(&sub)
            }) else {
                continue;
            };
            info!(
                "{url}: no EOSE for {sub} ({:?}) within {timeout:?}; asking again",
                info.purpose
            );
            self.counters.queries_resent += 1;
            self.commands.push_back(Command::Unsubscribe {
                relay: url.clone(),
                generation,
                sub_id: sub,
            });
            self.open_fetch(
                url,
                generation,
                info.purpose,
                std::sync::Arc::unwrap_or_clone(info.filter),
                info.scope,
                None,
            );
            self.drain_queue(url);
        }
    }

    /// The same for the own relay (the self-subscription and its pages): not suspended by
    /// a full forward queue.
    pub(super) fn expire_own_loading(&mut self, now: Time) {
        let timeout = self.config.eose_timeout;
        let own_overdue: Vec<SubscriptionId> = unbatched_loading(&self.own_link)
            .filter(|(_, t)| now.since(*t) >= timeout)
            .map(|(s, _)| s.clone())
            .collect();
        for sub in own_overdue {
            self.own_link.loading.remove(&sub);
            let Some(info) = self.own_link.subs.remove(&sub) else {
                continue;
            };
            info!(
                "own relay: no EOSE for {sub} ({:?}) within {timeout:?}; asking again",
                info.purpose
            );
            self.counters.queries_resent += 1;
            self.commands.push_back(Command::Unsubscribe {
                relay: self.config.own_relay.clone(),
                generation: self.own.generation,
                sub_id: sub,
            });
            self.open_own_sub(info.purpose, std::sync::Arc::unwrap_or_clone(info.filter));
        }
    }

    /// The forward queue into the own relay became full or has room again. While it is full,
    /// the relay threads wait with their next event and read nothing, so no EOSE can arrive:
    /// the EOSE deadlines of remote queries stop counting, and restart from where they were
    /// when the queue has room again (instead of failing batches and fetching their history
    /// again and again while the own relay is slow or down).
    pub(super) fn handle_back_pressure(&mut self, active: bool, now: Time) {
        match (active, self.forward_paused_since) {
            (true, None) => {
                info!("forward queue full: remote reading pauses; EOSE deadlines suspended");
                self.forward_paused_since = Some(now);
                // Every remote EOSE deadline is withdrawn (`eose_deadline_of`).
                self.mark_all_stale();
            }
            (false, Some(since)) => {
                let paused = now.since(since);
                info!("forward queue has room again after {paused:?}; EOSE deadlines resume");
                self.forward_paused_since = None;
                for r in self.remotes.values_mut() {
                    for b in &mut r.pending {
                        b.started_at = b.started_at.plus(paused);
                    }
                    for t in r.link.loading.values_mut() {
                        *t = t.plus(paused);
                    }
                }
                let relays: Vec<RelayUrl> = self.remotes.keys().cloned().collect();
                self.resume_nip77_deadlines(relays.iter());
                self.mark_all_stale();
            }
            _ => {}
        }
    }

    /// True while nothing is read from `relay`: the forward queue is full, or its thread
    /// waits for the forward pipeline's byte bound. Deadlines that wait for the relay's
    /// answers (EOSE, NIP-77 rounds and detection) do not count meanwhile.
    pub(super) fn reading_paused(&self, relay: &RelayUrl) -> bool {
        self.forward_paused_since.is_some() || self.is_stalled(relay)
    }

    /// Reading `relays` resumes: their NIP-77 deadlines (rounds and detection), which did
    /// not count while nothing was read, give the answer a whole round from now (issue 36).
    fn resume_nip77_deadlines<'a>(&mut self, relays: impl Iterator<Item = &'a RelayUrl>) {
        let round = self.last_now.plus(self.config.nip77.round_timeout);
        let mut timers: Vec<Timer> = Vec::new();
        for relay in relays {
            timers.push(Timer::Nip77Detection(relay.clone()));
            timers.extend(self.recon.ids_of(relay).map(Timer::JobDeadline));
        }
        for t in timers {
            if self.timers.get(&t).is_some_and(|at| at < round) {
                self.timers.set(t, round);
            }
        }
    }

    /// True while the thread of `relay` waits for the forward pipeline's byte bound
    /// ([`Report::RelayStalled`](super::Report::RelayStalled)): nothing is read from the relay, its EOSE deadlines wait.
    pub fn is_stalled(&self, relay: &RelayUrl) -> bool {
        self.remotes
            .get(relay)
            .is_some_and(|r| r.stalled_since.is_some())
    }

    /// The thread of `relay` began (`active`) or ended a wait for the forward pipeline's byte
    /// bound ([`Report::RelayStalled`]): the relay's EOSE deadlines stop counting meanwhile
    /// and resume from where they were, as [`Self::handle_back_pressure`] does for all.
    pub(super) fn handle_relay_stalled(&mut self, relay: &RelayUrl, active: bool, now: Time) {
        let Some(r) = self.remotes.get_mut(relay) else {
            return;
        };
        match (active, r.stalled_since) {
            (true, None) => {
                debug!("{relay}: waiting for the forward pipeline's byte bound; its EOSE deadlines are suspended");
                r.stalled_since = Some(now);
            }
            (false, Some(since)) => {
                let paused = now.since(since);
                debug!("{relay}: forward pipeline has room again after {paused:?}; its EOSE deadlines resume");
                r.stalled_since = None;
                for t in r.link.loading.values_mut() {
                    *t = t.plus(paused);
                }
                for b in &mut r.pending {
                    b.started_at = b.started_at.plus(paused);
                }
                self.resume_nip77_deadlines(std::iter::once(relay));
            }
            _ => return,
        }
        self.mark_stale(relay);
    }
}

/// True when at least one query of the batch has been sent (is loading): a batch whose
/// queries all wait in the queue behind the subscription budget (or wait for room for their
/// pages there) has no EOSE to wait for yet.
pub(super) fn batch_has_sent_query(link: Option<&Link>, batch: &PendingBatch) -> bool {
    let Some(link) = link else {
        return true;
    };
    batch.outstanding_subs.iter().any(|s| {
        link.loading.contains_key(s)
            || (!link.queue.iter().any(|(q, _)| q == s) && !link.parked.iter().any(|p| p.id == *s))
    })
}

/// Pages waiting in the relay's queue.
pub(super) fn queued_pages(link: &Link) -> usize {
    link.queue
        .iter()
        .filter(|(_, i)| matches!(i.purpose, SubPurpose::Page { .. }))
        .count()
}

/// The most queries of one relay whose split pages wait for room in its queue
/// ([`SyncMachine::admit_pages`]); beyond it such pages are dropped and their query
/// reported incomplete (a relay whose pages multiply without end cannot grow our memory
/// without bound).
pub(super) const MAX_PARKED: usize = 256;
