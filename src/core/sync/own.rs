//! The self-subscription on the own relay: connect, page its history, batch what it reads.

use crate::core::hash::HashSet;

use log::{debug, info, warn};
use nostr::event::{Event, EventId};
use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::filters::{own_events_filter, self_subscription_filter};
use crate::core::nip34::{classify_self_event_with, SelfEventMeaning};
use crate::core::paging::{bound_plan, plan_pages, PageStats};
use crate::core::relay_text::{ClosedReason, Prefix};
use crate::core::state::ConnectionStatus;
use crate::core::time::Time;
use crate::core::wire::Disconnect;

use super::timers::Timer;
use super::{Command, LinkError, SubInfo, SubPurpose, SyncMachine};

impl SyncMachine {
    pub(super) fn connect_own(&mut self, _now: Time) {
        self.next_generation += 1;
        self.own.generation = self.next_generation;
        self.own.connection_status = ConnectionStatus::Connecting;
        self.counters.connect_attempts += 1;
        self.commands.push_back(Command::Connect {
            relay: self.config.own_relay.clone(),
            generation: self.own.generation,
        });
    }

    /// The own relay is connected: the self-subscription reads its whole history again, also
    /// on a reconnect. A `since` would miss what was stored meanwhile with an older
    /// `created_at` (above all the old root events and announcements that the forwarder
    /// copies in while the self-subscription is down); reading the own relay is local and
    /// re-applying what is already indexed changes nothing.
    ///
    /// The announcements and root events are read first (a history query, closed at its
    /// EOSE); the self-subscription itself (every event, history and live) opens when that
    /// read has ended, so the replies it reads find their root events known (issue 34), and
    /// both are applied in one batch: a remote relay's first batch carries the thread
    /// members too.
    pub(super) fn handle_own_connected(&mut self, now: Time) {
        let again = self.own.last_connected.is_some();
        self.own.connection_status = ConnectionStatus::Connected;
        self.own.last_connected = Some(now);
        self.own.disconnected_at = None;
        self.own_link.health.record_success(now);
        self.own_link.subs.clear();
        self.own_link.queue.clear();
        self.own_link.loading.clear();
        self.own_link.reopen.clear();
        self.own_link.parked.clear();
        self.own_side_lost();
        self.own_rereads = 0;
        self.own_tags.set_complete(false);
        self.own_read_incomplete = false;
        info!(
            "own relay {} connected; self-subscribing (full history{})",
            self.config.own_relay,
            if again {
                ", again after a reconnect"
            } else {
                ""
            }
        );
        self.own_roots_read = true;
        self.open_own_sub(
            SubPurpose::Page { batch: None },
            self_subscription_filter(None),
        );
    }

    /// Opens a subscription on the own relay, within its subscription budget (NIP-11
    /// `max_subscriptions`, else the default): pages wait in a queue for room.
    pub(super) fn open_own_sub(&mut self, purpose: SubPurpose, filter: Filter) {
        let own = self.config.own_relay.clone();
        let mut filter = filter;
        if let (Some(max), None) = (self.page_limits(&own).max_limit, filter.limit) {
            // The own relay's default page may be smaller than the max_limit that paging
            // assumes as page size: ask for the max explicitly.
            filter = filter.limit(max);
        }
        let sub_id = self.new_sub_id();
        let info = SubInfo::new(purpose, filter);
        let budget = self.budget(&self.config.own_relay.clone());
        if self.own_link.subs.len() >= budget || !self.own_link.queue.is_empty() {
            self.own_link.queue.push_back((sub_id, info));
            return;
        }
        self.send_own_sub(sub_id, info);
    }

    fn send_own_sub(&mut self, sub_id: SubscriptionId, info: SubInfo) {
        let filter = info.filter.clone();
        let ids_only = matches!(info.purpose, SubPurpose::OwnSide { .. });
        self.own_link.subs.insert(sub_id.clone(), info);
        self.own_link.loading.insert(sub_id.clone(), self.last_now);
        if ids_only {
            self.commands.push_back(Command::CollectIds {
                generation: self.own.generation,
                sub_id,
                filter: std::sync::Arc::unwrap_or_clone(filter),
            });
            return;
        }
        self.commands.push_back(Command::Subscribe {
            relay: self.config.own_relay.clone(),
            generation: self.own.generation,
            sub_id,
            filter,
            scope: None,
            fetch_since: None,
        });
    }

    pub(super) fn drain_own_queue(&mut self) {
        let budget = self.budget(&self.config.own_relay.clone());
        while self.own_link.subs.len() < budget {
            let Some((sub_id, info)) = self.own_link.queue.pop_front() else {
                break;
            };
            self.send_own_sub(sub_id, info);
        }
        self.unpark_own_pages();
    }

    /// Self-subscription pages waiting for a slot on the own relay.
    fn own_pages_queued(&self) -> usize {
        self.own_link
            .queue
            .iter()
            .filter(|(_, i)| matches!(i.purpose, SubPurpose::Page { .. }))
            .count()
    }

    /// The part of the self-subscription's `plan` to queue now, as on a remote relay
    /// (`admit_pages`): a page split into more queries than the own relay's waiting pages
    /// leave room for is parked whole and planned again when there is room
    /// ([`Self::unpark_own_pages`]), never dropped (issue 36: repositories on the own relay
    /// were never indexed); only beyond [`super::batches::MAX_PARKED`] parked queries are
    /// the splits cut and the query reported incomplete.
    fn admit_own_pages(
        &mut self,
        plan: crate::core::paging::PagePlan,
        filter: &Filter,
        stats: &PageStats,
    ) -> crate::core::paging::PagePlan {
        let max = self.config.max_queued_pages;
        let queued = self.own_pages_queued();
        if plan.next.len() <= 1 || queued == 0 || queued + plan.next.len() <= max {
            return plan;
        }
        if self.own_link.parked.len() >= super::batches::MAX_PARKED {
            return bound_plan(plan, queued, max);
        }
        debug!(
            "own relay: {} pages of a split query wait for room ({queued} pages queued)",
            plan.next.len()
        );
        let id = self.new_sub_id();
        self.own_link.parked.push_back(super::Parked {
            id,
            batch: None,
            filter: filter.clone(),
            stats: stats.clone(),
        });
        crate::core::paging::PagePlan {
            next: Vec::new(),
            ..plan
        }
    }

    /// Queues the pages of parked self-subscription queries, oldest first, while the own
    /// relay's waiting pages leave room.
    fn unpark_own_pages(&mut self) {
        if self.own.connection_status != ConnectionStatus::Connected {
            return;
        }
        let own = self.config.own_relay.clone();
        let limits = self.page_limits(&own);
        let max = self.config.max_queued_pages;
        while let Some(first) = self.own_link.parked.front() {
            let plan = plan_pages(&first.filter, &first.stats, &limits);
            let queued = self.own_pages_queued();
            if queued > 0 && queued + plan.next.len() > max {
                return;
            }
            self.own_link.parked.pop_front();
            if let Some(why) = &plan.incomplete {
                self.counters.incomplete_queries += 1;
                warn!("own relay {own}: self-subscription history incomplete: {why}");
                self.own_read_incomplete = true;
            }
            for f in plan.next {
                self.counters.pages_requested += 1;
                self.open_own_sub(SubPurpose::Page { batch: None }, f);
            }
        }
    }

    /// EOSE of the self-subscription or one of its pages: page back through a capped own
    /// relay exactly like a remote one, so every announcement and root event is read.
    pub(super) fn handle_own_eose(&mut self, sub_id: &SubscriptionId, stats: &PageStats) {
        self.own_link.loading.remove(sub_id);
        let Some(info) = self.own_link.subs.get(sub_id).cloned() else {
            return;
        };
        let own = self.config.own_relay.clone();
        let base = self.published_page_limits(&own);
        let watched = self.own_caps.plan(&info.filter, stats, &base);
        if let Some(cap) = watched.learned {
            self.counters.caps_learned += 1;
            warn!(
                "own relay {own}: returns at most {cap} events per query without publishing a limit (a short page was followed by events it lacked); pages of {cap} are read as full from now on"
            );
        }
        self.counters.cap_probes += u64::from(watched.plan.probe);
        let plan = self.admit_own_pages(watched.plan, &info.filter, stats);
        if let SubPurpose::Page { .. } = info.purpose {
            self.own_link.subs.remove(sub_id);
            self.commands.push_back(Command::Unsubscribe {
                relay: own.clone(),
                generation: self.own.generation,
                sub_id: sub_id.clone(),
            });
            self.drain_own_queue();
        } else {
            info!(
                "self-subscription: stored history read ({} events{})",
                stats.received,
                if plan.next.is_empty() {
                    ""
                } else {
                    "; paging for older ones"
                }
            );
        }
        if plan.partial_split {
            info!("own relay {own}: a burst in one second is split by the kinds/authors seen");
        }
        if let Some(why) = plan.incomplete {
            self.counters.incomplete_queries += 1;
            warn!("own relay {own}: self-subscription history incomplete: {why}");
            self.own_read_incomplete = true;
        }
        for f in plan.next {
            self.counters.pages_requested += 1;
            self.open_own_sub(SubPurpose::Page { batch: None }, f);
        }
        // The stored history is read to its end: what it held is applied now, not when the
        // batch window closes (issue 21: the window only waits for live events, and a first
        // sync would otherwise start seconds later).
        if !self.self_history_loading() {
            if std::mem::take(&mut self.own_roots_read) {
                // The announcements and root events are read: the self-subscription reads
                // the rest (applied with them, once its history is read too).
                self.open_own_sub(SubPurpose::SelfSubscription, own_events_filter());
                return;
            }
            // Every stored event has been through `push_self_event`: the index of their tags
            // answers for the own relay from now on (until the connection ends), already for
            // the queries of the batch applied next.
            self.own_tags.set_complete(!self.own_read_incomplete);
            if self.batch.started.is_some() {
                debug!("self-subscription: stored history read to its end; applying the batch now");
                self.process_batch(self.last_now);
            }
            self.own_history_read();
        }
    }

    /// The own relay's stored history (as far as asked) is read and applied: it is read
    /// again while replies were dropped from the waiting set (read before their parents, more
    /// of them than it holds), at most `--reply-depth` times per connection.
    fn own_history_read(&mut self) {
        if self.own.connection_status != ConnectionStatus::Connected
            || !self.threads.take_overflowed()
        {
            return;
        }
        if self.own_rereads >= u64::from(self.config.threads.max_depth) {
            warn!(
                "own relay: replies waiting for their parents were dropped again after {} extra reads; they are followed from the next connect (counted in replies_not_followed_total{{reason=\"waiting\"}})",
                self.own_rereads
            );
            return;
        }
        self.own_rereads += 1;
        self.counters.own_thread_rereads += 1;
        info!(
            "own relay: {} replies were read before their parents and dropped from the waiting set; reading its events again (pass {})",
            self.threads.counters().waiting_dropped,
            self.own_rereads + 1
        );
        self.open_own_sub(SubPurpose::Page { batch: None }, own_events_filter());
    }

    /// True while pages of the self-subscription's stored history are loading, queued or
    /// waiting to be asked again (a reconciliation's own side is not counted).
    fn self_history_loading(&self) -> bool {
        let history = |p: &SubPurpose| !matches!(p, SubPurpose::OwnSide { .. });
        self.own_link.loading.iter().any(|(s, _)| {
            self.own_link
                .subs
                .get(s)
                .is_some_and(|i| history(&i.purpose))
        }) || self.own_link.queue.iter().any(|(_, i)| history(&i.purpose))
            || self.own_link.reopen.iter().any(|r| history(&r.1))
            || !self.own_link.parked.is_empty()
    }

    /// The own relay's connection failed or ended (`cause`), or the relay closed the
    /// self-subscription (`None`): everything of the connection is dropped and it is
    /// connected again after backoff.
    pub(super) fn handle_own_disconnected(&mut self, cause: Option<&Disconnect>, now: Time) {
        let was_connected = self.own.connection_status == ConnectionStatus::Connected;
        let error = match cause {
            Some(cause) => LinkError::of(cause, was_connected),
            None => LinkError::SelfSubscriptionClosed,
        };
        if was_connected {
            self.own.disconnected_at = Some(now);
        }
        self.own.connection_status = ConnectionStatus::Disconnected;
        self.own_link.subs.clear();
        self.own_link.queue.clear();
        self.own_link.loading.clear();
        self.own_link.reopen.clear();
        self.own_link.parked.clear();
        self.own_side_lost();
        self.own_roots_read = false;
        self.own_tags.set_complete(false);
        self.own_link
            .health
            .record_failure(now, &self.config.backoff);
        let at = self
            .own_link
            .health
            .next_attempt(now, &self.config.backoff, self.jitter.unit());
        let line = format!(
            "own relay {} unavailable ({}); retrying in {:.1}s (failures: {})",
            self.config.own_relay,
            error.reason(),
            at.since(now).as_secs_f64(),
            self.own_link.health.failures()
        );
        // The same failure again (connect attempt or not) is logged at debug level only
        // (counted in failures).
        if self
            .own_link
            .last_error
            .as_ref()
            .is_some_and(|e| e.cause() == error.cause())
        {
            debug!("{line}");
        } else {
            warn!("{line}");
        }
        self.own_link.last_error = Some(error);
        self.timers.set(Timer::OwnReconnect, at);
    }

    /// CLOSED on the own relay: a page of the history is asked again after a short delay
    /// (the relay said why; `rate-limited:` waits the cool-down); a CLOSED self-subscription
    /// means the connection is replaced after backoff (and read again in full).
    pub(super) fn handle_own_closed(
        &mut self,
        sub_id: &SubscriptionId,
        prefix: Prefix,
        message: &str,
        now: Time,
    ) {
        self.own_link.loading.remove(sub_id);
        let Some(info) = self.own_link.subs.remove(sub_id) else {
            return;
        };
        self.drain_own_queue();
        if let SubPurpose::OwnSide { job } = info.purpose {
            self.own_side_closed(job, message);
            return;
        }
        if let SubPurpose::Page { .. } = info.purpose {
            let delay = match ClosedReason::from(prefix) {
                ClosedReason::RateLimited => self.config.rate_limit_cooldown,
                _ => self.config.backoff.base,
            };
            warn!(
                "own relay closed a page of the self-subscription ({message:?}); asking again in {delay:?}"
            );
            self.own_link.reopen.push((
                now.plus(delay),
                info.purpose,
                std::sync::Arc::unwrap_or_clone(info.filter),
            ));
            return;
        }
        warn!("own relay closed the self-subscription ({message:?}); reconnecting after backoff");
        // The next Connect (new generation) replaces the connection.
        self.handle_own_disconnected(None, now);
    }

    pub(super) fn push_self_event(&mut self, event: &Event, now: Time) {
        self.counters.self_events += 1;
        self.own_tags.insert_event(event);
        let meaning = classify_self_event_with(
            event,
            self.config.target_limits.max_relays_per_announcement,
            &self.own_names,
        );
        if meaning == SelfEventMeaning::Other {
            debug!(
                "self-subscription: ignoring event {} of kind {}",
                event.id, event.kind
            );
            return;
        }
        self.batch.meanings.push(meaning);
        if self.batch.started.is_none() {
            self.batch.started = Some(now);
            self.timers
                .set(Timer::SelfBatch, now.plus(self.config.batch_window));
        }
        if self.batch.meanings.len() >= self.config.max_batch_events {
            self.process_batch(now);
        }
    }

    /// Applies the self-subscription batch to the repository index (announcements, root
    /// events, the replies followed below them: `core::related`, the definition the audit
    /// applies too) and runs compute_actions.
    pub(super) fn process_batch(&mut self, now: Time) {
        let meanings = std::mem::take(&mut self.batch.meanings);
        self.batch.started = None;
        self.timers.cancel(&Timer::SelfBatch);
        self.counters.self_batches += 1;
        let mut applied = crate::core::related::Applied::default();
        crate::core::related::apply_batch(
            &mut self.repo_index,
            &mut self.threads,
            meanings,
            &mut applied,
        );
        if applied.relays_dropped > 0 {
            if self.counters.announcement_relays_dropped == 0 {
                warn!(
                    "an announcement names more relays than --max-relays-per-announcement; the rest are ignored (counted in announcement_relays_dropped, further cases at debug level)"
                );
            }
            self.counters.announcement_relays_dropped += applied.relays_dropped;
        }
        self.root_events_known += applied.new_roots;
        let announcements = applied.announcements;
        let roots = applied.root_links.len();
        let followed = applied.members.len();
        // What the forwarder retries rejected events for: repositories whose announcement
        // was applied, root events newly linked, events newly followed, and the Layer-3 ids
        // of those repositories (each once, in the order first seen).
        let mut changed_repos = applied.changed_repos;
        let mut changed_roots: HashSet<EventId> = HashSet::default();
        let mut changed_order: Vec<EventId> = Vec::new();
        for (_, id) in applied.root_links.iter().chain(applied.members.iter()) {
            if changed_roots.insert(*id) {
                changed_order.push(*id);
            }
        }
        // Planning in proportion to the change: relay sets that changed rerun the
        // selection; new root-event links and followed replies only grow their
        // repositories' relay targets. With no repository selected yet (the first read of
        // the own relay) every link comes with its repository through the selection: none
        // is followed alone.
        let relays_changed = applied.relays_changed;
        let new_links: Vec<(crate::core::nip34::RepoRef, EventId)> = if self.plan.is_empty() {
            Vec::new()
        } else {
            let mut links = applied.root_links;
            links.extend(applied.members);
            links
        };
        // A repository's root events reached a power of two: its pubkey's activity (and
        // perhaps its tier) in the selection rose (issue 20), which matters while a cap
        // binds.
        let came_alive = applied.came_alive;
        info!(
            "batch: {announcements} announcements, {roots} new root-event links, {followed} replies followed; {} repositories known",
            self.repo_index.len()
        );
        // Events replying to a root of a newly (re)announced repository may be accepted now.
        changed_repos.sort();
        changed_repos.dedup();
        for repo in &changed_repos {
            if let Some(n) = self.repo_index.get(repo) {
                for id in n.layer3_ids() {
                    if changed_roots.insert(*id) {
                        changed_order.push(*id);
                    }
                }
            }
        }
        if !changed_repos.is_empty() || !changed_order.is_empty() {
            self.commands.push_back(Command::RetryRejected {
                repos: changed_repos,
                roots: changed_order,
            });
        }
        let mut replan = super::batches::Replan::default();
        if !relays_changed.is_empty() {
            self.reselect_repos(&relays_changed, &mut replan);
        }
        if came_alive && self.selection_bound() {
            self.reselect(&mut replan);
        }
        let grown = &mut replan.roots;
        let relays = &self.remotes;
        for (repo, id) in new_links {
            self.plan.add_root_event_with(&repo, id, |relay| {
                // A relay that is not connected diffs its whole target when it connects
                // (`compute_actions` skips it until then): only connected and unknown
                // relays are planned for the new root events.
                if relays
                    .get(relay)
                    .is_some_and(|r| r.state.connection_status != ConnectionStatus::Connected)
                {
                    return;
                }
                match grown.get_mut(relay) {
                    Some(ids) => {
                        ids.insert(id);
                    }
                    None => {
                        grown.insert(relay.clone(), HashSet::from_iter([id]));
                    }
                }
            });
        }
        #[cfg(debug_assertions)]
        {
            let ids: HashSet<&EventId> = self
                .repo_index
                .values()
                .flat_map(|n| n.root_events.iter())
                .collect();
            debug_assert_eq!(ids.len(), self.root_events_known, "root event counter");
        }
        self.check_plan();
        self.run_compute_actions(replan, now);
    }
}
