//! The self-subscription on the own relay: connect, page its history, batch what it reads.

use super::*;

impl SyncMachine {
    pub(super) fn connect_own(&mut self, _now: Time) {
        self.own.generation += 1;
        self.own.connection_status = ConnectionStatus::Connecting;
        self.counters.connect_attempts += 1;
        self.commands.push_back(Command::Connect {
            relay: self.config.own_relay.clone(),
            generation: self.own.generation,
        });
    }

    pub(super) fn handle_own_connected(&mut self, now: Time) {
        let since = self
            .own
            .last_connected
            .map(|t| t.minus(self.config.quick_reconnect_window).timestamp());
        self.own.connection_status = ConnectionStatus::Connected;
        self.own.last_connected = Some(now);
        self.own.disconnected_at = None;
        self.own_link.health.record_success(now);
        self.own_link.subs.clear();
        self.own_link.queue.clear();
        self.own_link.loading.clear();
        info!(
            "own relay {} connected; self-subscribing{}",
            self.config.own_relay,
            since.map_or(String::from(" (full history)"), |s| format!(
                " since {}",
                s.as_secs()
            ))
        );
        self.open_own_sub(
            SubPurpose::SelfSubscription,
            self_subscription_filter(since),
        );
    }

    /// Opens a subscription on the own relay, within its subscription budget (NIP-11
    /// `max_subscriptions`, else the default): pages wait in a queue for room.
    pub(super) fn open_own_sub(&mut self, purpose: SubPurpose, filter: Filter) {
        let sub_id = self.new_sub_id();
        let info = SubInfo { purpose, filter };
        let budget = self.budget(&self.config.own_relay.clone());
        if self.own_link.subs.len() >= budget || !self.own_link.queue.is_empty() {
            self.own_link.queue.push_back((sub_id, info));
            return;
        }
        self.send_own_sub(sub_id, info);
    }

    fn send_own_sub(&mut self, sub_id: SubscriptionId, info: SubInfo) {
        let filter = info.filter.clone();
        self.own_link.subs.insert(sub_id.clone(), info);
        self.own_link.loading.insert(sub_id.clone(), self.last_now);
        self.commands.push_back(Command::Subscribe {
            relay: self.config.own_relay.clone(),
            generation: self.own.generation,
            sub_id,
            filter,
        });
    }

    fn drain_own_queue(&mut self) {
        let budget = self.budget(&self.config.own_relay.clone());
        while self.own_link.subs.len() < budget {
            let Some((sub_id, info)) = self.own_link.queue.pop_front() else {
                return;
            };
            self.send_own_sub(sub_id, info);
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
        let plan = bound_plan(
            plan_pages(&info.filter, stats, &self.page_limits(&own)),
            self.own_link
                .queue
                .iter()
                .filter(|(_, i)| matches!(i.purpose, SubPurpose::Page { .. }))
                .count(),
            MAX_QUEUED_PAGES,
        );
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
        }
        for f in plan.next {
            self.counters.pages_requested += 1;
            self.open_own_sub(SubPurpose::Page { batch: None }, f);
        }
    }

    pub(super) fn handle_own_disconnected(&mut self, reason: &str, now: Time) {
        if self.own.connection_status == ConnectionStatus::Connected {
            self.own.disconnected_at = Some(now);
        }
        self.own.connection_status = ConnectionStatus::Disconnected;
        self.own_link.subs.clear();
        self.own_link.queue.clear();
        self.own_link.loading.clear();
        self.own_link
            .health
            .record_failure(now, &self.config.backoff);
        let at = self
            .own_link
            .health
            .next_attempt(now, &self.config.backoff, self.jitter.unit());
        warn!(
            "own relay {} unavailable ({reason}); retrying in {:.1}s",
            self.config.own_relay,
            at.since(now).as_secs_f64()
        );
        self.own_link.next_attempt = Some(at);
    }

    pub(super) fn handle_own_closed(&mut self, message: &str, now: Time) {
        warn!("own relay closed the self-subscription ({message:?}); reconnecting after backoff");
        // The next Connect (new generation) replaces the connection.
        self.handle_own_disconnected(&format!("CLOSED {message:?}"), now);
    }

    pub(super) fn push_self_event(&mut self, event: &Event, now: Time) {
        self.counters.self_events += 1;
        let meaning = classify_self_event_with(
            event,
            self.config.target_limits.max_relays_per_announcement,
            &self.excluded,
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
        }
        if self.batch.meanings.len() >= self.config.max_batch_events {
            self.process_batch(now);
        }
    }

    /// Applies the self-subscription batch to the repository index and runs compute_actions.
    pub(super) fn process_batch(&mut self, now: Time) {
        let meanings = std::mem::take(&mut self.batch.meanings);
        self.batch.started = None;
        self.counters.self_batches += 1;
        let mut announcements = 0usize;
        let mut roots = 0usize;
        for m in meanings {
            match m {
                SelfEventMeaning::Announcement(a) => {
                    let needs = self.repo_index.entry(a.repo_ref.clone()).or_default();
                    if needs.announced_at.is_some_and(|t| t > a.created_at) {
                        debug!("ignoring older announcement of {}", a.repo_ref);
                        continue;
                    }
                    needs.announced_at = Some(a.created_at);
                    needs.relays = a.relays.into_iter().collect();
                    announcements += 1;
                }
                SelfEventMeaning::RootEvent { id, repos } => {
                    if repos.is_empty() {
                        debug!("root event {id} names no repository; ignored");
                    }
                    for r in repos {
                        if self.repo_index.entry(r).or_default().root_events.insert(id) {
                            roots += 1;
                        }
                    }
                }
                SelfEventMeaning::Other => {}
            }
        }
        info!(
            "batch: {announcements} announcements, {roots} new root-event links; {} repositories known",
            self.repo_index.len()
        );
        if announcements > 0 {
            self.commands.push_back(Command::RetryRejected);
        }
        self.run_compute_actions(now);
    }
}
