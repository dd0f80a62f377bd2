//! Scenario 4 (consolidation, never blocking); Scenario 5 (the daily resync) is in `daily.rs`.

use crate::core::hash::{HashMap, HashSet};

use log::{debug, info};
use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::filters::{build_layer2_and_layer3_filters, CHUNK_SIZE, ID_TAGS, REPO_TAGS};
use crate::core::state::{ConnectionStatus, PendingItems};
use crate::core::time::Time;
use crate::shared::RelayUrl;
use nostr::filter::SingleLetterTag;

use super::subscriptions::req_bytes;
use super::timers::Timer;
use super::{live_only, Command, SubPurpose, SyncMachine};

/// A live Layer 2/3 chunk that may grow in place ([`SyncMachine::growable_live_chunks`]).
struct LiveChunk {
    id: SubscriptionId,
    /// The REQ it was sent in (its own id, or its first member's, decision 0110).
    wire: SubscriptionId,
    tag: SingleLetterTag,
    /// Its values are repository coordinates (else event ids).
    coordinate: bool,
    /// Its number of values.
    len: usize,
}

/// What one tag value is taken to add to a REQ when only the number of values is known: an
/// event id takes 67 bytes (64 hex digits, quotes, a comma), a repository coordinate about
/// 80 (as [`SyncMachine::max_live_chunk`] assumes).
const LIVE_VALUE_BYTES: usize = 80;

impl SyncMachine {
    pub(super) fn run_deferred_if_idle(&mut self, relay: &RelayUrl, now: Time) {
        let ready = self
            .link_of(relay)
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
    ///
    /// When the live set can be extended instead ([`SyncMachine::can_extend_live_set`]),
    /// nothing is closed or rebuilt: the deferred items only get their batch (decision 0063).
    pub(super) fn run_deferred(&mut self, relay: &RelayUrl, now: Time) {
        let Some(link) = self.link_mut(relay) else {
            return;
        };
        let items = std::mem::take(&mut link.deferred);
        self.timers.cancel(&Timer::Consolidate(relay.clone()));
        let connected = self
            .state_of(relay)
            .is_some_and(|s| s.connection_status == ConnectionStatus::Connected);
        if !connected {
            self.counters.consolidations += 1;
            return;
        }
        if self.can_extend_live_set(relay, items.repos.len(), items.root_events.len()) {
            self.subscribe_new_items(relay, items, now);
            self.drain_queue(relay);
            return;
        }
        self.counters.consolidations += 1;
        let generation = self.remotes[relay].state.generation;
        let before = self.link_of(relay).map_or(0, |l| l.subs.len());
        // Subscriptions still loading history (a first Layer 1) and every subscription of a
        // batch that is still pending stay open: closing them would lose what they have not
        // delivered yet, or leave the batch's items without a live subscription once it
        // confirms.
        let pending_batches: HashSet<u64> =
            self.pending_of(relay).iter().map(|b| b.batch_id).collect();
        // A Layer 1 that is (or will be) live stays: one still loading, or one (not live-only)
        // waiting in the queue or to be reopened.
        let waiting_l1 =
            |p: SubPurpose, f: &Filter| p == SubPurpose::Announcements && f.limit != Some(0);
        let mut keep_l1 = self.link_of(relay).is_some_and(|l| {
            l.queue
                .iter()
                .any(|(_, i)| waiting_l1(i.purpose, &i.filter))
                || l.reopen.iter().any(|(_, p, f)| waiting_l1(*p, f))
        });
        let mut old: Vec<SubscriptionId> = Vec::new();
        if let Some(l) = self.link_mut(relay) {
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
        if let Some(l) = self.link_mut(relay) {
            l.rebuild_needed = false;
            let mut from = l.uncovered_since.take().unwrap_or(now);
            let live_queued = l.queue.iter().any(|(_, i)| i.purpose == SubPurpose::Live);
            if let (true, Some(t)) = (live_queued, l.live_built_at) {
                from = from.min(t);
            }
            since = since.min(from.rebased(now).minus(margin).timestamp());
            // Items that joined the polled queries (`join_live_set`) are covered from
            // `poll_since` on; the rebuild may make them live, so its catch-up starts there
            // too, or the gap before the next poll round would never be read.
            if let (false, Some(p)) = (l.polled.is_empty(), l.poll_since) {
                since = since.min(p);
            }
            let mut merge = |purpose: SubPurpose, f: &Filter| -> bool {
                // A pending batch's live-only query (the live part of a reconciled history
                // query) is not rebuilt below: its items are not confirmed, and its batch
                // waits for its EOSE. Dropping it left the batch to fail at its deadline.
                let batch = matches!(purpose, SubPurpose::Batch(_));
                if f.limit == Some(0) && purpose.is_live() && !batch {
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
        self.subscribe_new_items(relay, items, now);
        self.drain_queue(relay);
        let after = self.link_of(relay).map_or(0, |l| l.subs.len());
        info!("{relay}: consolidated {before} subscriptions (plus the new items) into {after}");
    }
}

impl SyncMachine {
    /// Subscribes the items not confirmed yet as one batch (history without `since`).
    fn subscribe_new_items(&mut self, relay: &RelayUrl, mut items: PendingItems, now: Time) {
        if let Some(state) = self.state_of(relay) {
            items.repos.retain(|r| !state.repos.contains(r));
            items.root_events.retain(|e| !state.root_events.contains(e));
        }
        let filters = build_layer2_and_layer3_filters(&items.repos, &items.root_events, None);
        self.subscribe_batch(relay, items.repos, items.root_events, filters, now);
    }

    /// True when new items of `relay` can join its live/polled set without a rebuild
    /// (decision 0063): the relay is connected, its live set was built on this connection
    /// and does not fit the budget (queries are polled, so new items would be polled
    /// anyway), and nothing waits for a rebuild: no item lost its coverage, no live query
    /// waits for a slot or to be reopened, and the polled queries are not fragmented (at
    /// most [`FRAGMENTS`] more than the confirmed items need in chunks of
    /// [`CHUNK_SIZE`]). Or nothing is polled and the live chunks have room for `repos`
    /// repositories and `roots` root events: they grow in place (decision 0110).
    pub(super) fn can_extend_live_set(&self, relay: &RelayUrl, repos: usize, roots: usize) -> bool {
        let (Some(l), Some(state)) = (self.link_of(relay), self.state_of(relay)) else {
            return false;
        };
        let needed = 3
            * (state.repos.len().div_ceil(CHUNK_SIZE)
                + state.root_events.len().div_ceil(CHUNK_SIZE));
        state.connection_status == ConnectionStatus::Connected
            && l.live_built_at.is_some()
            && !l.rebuild_needed
            && l.uncovered_since.is_none()
            && l.reopen.is_empty()
            && ((!l.polled.is_empty() && l.polled.len() <= needed + FRAGMENTS)
                || (l.polled.is_empty() && self.live_chunks_have_room(relay, repos, roots)))
            && !l
                .queue
                .iter()
                .any(|(_, i)| matches!(i.purpose, SubPurpose::Live | SubPurpose::Announcements))
    }

    /// The items of a confirmed batch whose queries were closed at EOSE (from `from` on)
    /// join the live set without a rebuild (decision 0063): as live subscriptions (with a
    /// catch-up from `from − 15 min`) while the budget has room and nothing is polled, else
    /// merged into the polled queries (into chunks with room first), whose next round reads
    /// from `from − 15 min` at the latest.
    pub(super) fn join_live_set(
        &mut self,
        relay: &RelayUrl,
        items: &PendingItems,
        from: Time,
        now: Time,
    ) {
        let Some(generation) = self.connected_generation(relay) else {
            return;
        };
        let margin = self.config.quick_reconnect_window;
        let since = from.rebased(now).minus(margin).timestamp();
        let filters = self.fit_filters(
            relay,
            build_layer2_and_layer3_filters(&items.repos, &items.root_events, None),
        );
        // First into the live chunks with room (their REQs sent again, decision 0110), then
        // as new live subscriptions, then polled.
        let nothing_polled = self.config.max_filters_per_req >= 2
            && self.link_of(relay).is_none_or(|l| l.polled.is_empty());
        let (filters, extended) = if nothing_polled {
            self.extend_live_chunks(relay, generation, filters)
        } else {
            (filters, Vec::new())
        };
        if !extended.is_empty() {
            self.open_catch_ups(relay, generation, extended, since);
            let l = self.link(relay);
            l.catch_up_since = Some(l.catch_up_since.map_or(since, |c| c.min(since)));
        }
        let budget = self.req_budget(relay);
        let link = self.link(relay);
        let open = link.subs.values().filter(|i| i.purpose.is_live()).count();
        let capacity = if link.polled.is_empty() {
            budget.saturating_sub(1).saturating_sub(open)
        } else {
            0
        };
        let mut live = filters;
        let polled = live.split_off(capacity.min(live.len()));
        for f in &live {
            self.open_sub(relay, generation, SubPurpose::Live, live_only(f));
        }
        let opened = !live.is_empty();
        self.open_catch_ups(relay, generation, live, since);
        if opened {
            let l = self.link(relay);
            l.catch_up_since = Some(l.catch_up_since.map_or(since, |c| c.min(since)));
        }
        if polled.is_empty() {
            return;
        }
        let mut merged = std::mem::take(&mut self.link(relay).polled);
        let touched = merge_polled(&mut merged, polled);
        if self.nip11_of(relay).max_message.is_some() {
            // A chunk that grew may no longer fit the relay's REQ size.
            let mut fitted = Vec::with_capacity(merged.len());
            for (i, f) in merged.into_iter().enumerate() {
                if touched.contains(&i) {
                    fitted.extend(self.fit_filters(relay, vec![f]));
                } else {
                    fitted.push(f);
                }
            }
            merged = fitted;
        }
        let interval = self.config.poll_interval;
        let link = self.link(relay);
        debug!(
            "{relay}: {} root events and {} repositories join the {} polled queries",
            items.root_events.len(),
            items.repos.len(),
            merged.len()
        );
        link.polled = merged;
        link.poll_since = Some(link.poll_since.map_or(since, |p| p.min(since)));
        let poll = Timer::Poll(relay.clone());
        if !self.timers.is_set(&poll) {
            self.timers.set(poll, now.plus(interval));
        }
    }
}

impl SyncMachine {
    /// The live Layer 2/3 chunks of `relay` that may grow in place: live-only one-tag
    /// queries whose REQ holds only live-only queries still open (the REQ is sent again
    /// whole, under its id), sorted by id.
    fn growable_live_chunks(&self, relay: &RelayUrl) -> Vec<LiveChunk> {
        let Some(link) = self.link_of(relay) else {
            return Vec::new();
        };
        let req_of = |id: &SubscriptionId| link.packed.get(id).unwrap_or(id).clone();
        // REQs holding a query that is not live-only, or whose first member is closed (its
        // id names the REQ): not sent again.
        let mut fixed: HashSet<SubscriptionId> = link
            .subs
            .iter()
            .filter(|(_, i)| i.filter.limit != Some(0))
            .map(|(id, _)| req_of(id))
            .collect();
        fixed.extend(
            link.packed
                .iter()
                .filter(|(id, wire)| link.subs.contains_key(*id) && !link.subs.contains_key(*wire))
                .map(|(_, wire)| wire.clone()),
        );
        let mut out: Vec<_> = link
            .subs
            .iter()
            .filter(|(id, i)| {
                i.purpose == SubPurpose::Live
                    && i.scope.is_none()
                    && !fixed.contains(&req_of(id))
                    && is_live_chunk(&i.filter)
            })
            .filter_map(|(id, i)| {
                let (tag, values) = i.filter.generic_tags.iter().next()?;
                Some(LiveChunk {
                    id: id.clone(),
                    wire: req_of(id),
                    tag: *tag,
                    coordinate: values.iter().next().is_some_and(|v| v.contains(':')),
                    len: values.len(),
                })
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Bytes each REQ holding one of `chunks` may still grow by: [`Self::max_req_bytes`]
    /// less the length of the REQ as it stands (every member's filter, decision 0110).
    fn req_room(&self, relay: &RelayUrl, chunks: &[LiveChunk]) -> HashMap<SubscriptionId, usize> {
        let max = self.max_req_bytes(relay);
        let Some(link) = self.link_of(relay) else {
            return HashMap::default();
        };
        let mut room = HashMap::default();
        for c in chunks {
            if room.contains_key(&c.wire) {
                continue;
            }
            let members = link
                .packed
                .iter()
                .filter(|(id, w)| **w == c.wire && **id != c.wire)
                .map(|(id, _)| id)
                .chain(std::iter::once(&c.wire))
                .filter_map(|id| link.subs.get(id))
                .map(|i| i.json_len);
            room.insert(c.wire.clone(), max.saturating_sub(req_bytes(members)));
        }
        room
    }

    /// Whether the live chunks of `relay` have room for `repos` repositories and `roots`
    /// root events under every tag their Layers 2 and 3 use (decision 0110): within the
    /// relay's live chunk size, and within its REQ length for the REQs they are sent in
    /// (a value taken as [`LIVE_VALUE_BYTES`]).
    pub(super) fn live_chunks_have_room(
        &self,
        relay: &RelayUrl,
        repos: usize,
        roots: usize,
    ) -> bool {
        if self.config.max_filters_per_req < 2 {
            return false;
        }
        let max = self.max_live_chunk(relay);
        let mut chunks = self.growable_live_chunks(relay);
        let mut bytes = self.req_room(relay, &chunks);
        // Values of each tag placed in turn, the REQs' room shared by the tags they hold.
        let mut place = |tag: SingleLetterTag, coordinate: bool, mut n: usize| -> bool {
            for c in chunks
                .iter_mut()
                .filter(|c| c.tag == tag && c.coordinate == coordinate)
            {
                let left = bytes.entry(c.wire.clone()).or_default();
                let take = n
                    .min(max.saturating_sub(c.len))
                    .min(*left / LIVE_VALUE_BYTES);
                c.len += take;
                *left -= take * LIVE_VALUE_BYTES;
                n -= take;
                if n == 0 {
                    break;
                }
            }
            n == 0
        };
        (repos == 0 || REPO_TAGS.iter().all(|t| place(*t, true, repos)))
            && (roots == 0 || ID_TAGS.iter().all(|t| place(*t, false, roots)))
    }

    /// Puts the values of `new` (Layer 2/3 filters of newly confirmed items) into the live
    /// chunks of `relay` with room (decision 0110: the incremental live set) and sends each
    /// chunk that grew again as one REQ under its own id, which replaces the relay's
    /// subscription. A chunk grows within the relay's live chunk size and its REQ within
    /// [`Self::max_req_bytes`] (a longer frame makes strfry drop the connection). Returns
    /// the filters that found no room, and the ones placed (for their catch-up).
    fn extend_live_chunks(
        &mut self,
        relay: &RelayUrl,
        generation: u64,
        new: Vec<Filter>,
    ) -> (Vec<Filter>, Vec<Filter>) {
        let max = self.max_live_chunk(relay);
        let mut chunks = self.growable_live_chunks(relay);
        if chunks.is_empty() {
            return (new, Vec::new());
        }
        let mut bytes = self.req_room(relay, &chunks);
        let mut grown: std::collections::BTreeMap<SubscriptionId, Vec<String>> =
            std::collections::BTreeMap::new();
        let (mut rest, mut placed) = (Vec::new(), Vec::new());
        for f in new {
            let plain = f.ids.is_none()
                && f.authors.is_none()
                && f.kinds.is_none()
                && f.since.is_none()
                && f.until.is_none()
                && f.limit.is_none()
                && f.generic_tags.len() == 1;
            let Some((tag, values)) = f.generic_tags.iter().next().filter(|_| plain) else {
                rest.push(f);
                continue;
            };
            let coordinate = values.iter().next().is_some_and(|v| v.contains(':'));
            let n = values.len();
            // Each value adds itself quoted (escaped) and a comma to its REQ.
            let cost: usize = values
                .iter()
                .map(|v| crate::core::filter_json::str_len(v) + 1)
                .sum();
            match chunks.iter_mut().find(|c| {
                c.tag == *tag
                    && c.coordinate == coordinate
                    && c.len + n <= max
                    && bytes.get(&c.wire).is_some_and(|b| *b >= cost)
            }) {
                Some(c) => {
                    c.len += n;
                    if let Some(b) = bytes.get_mut(&c.wire) {
                        *b -= cost;
                    }
                    grown
                        .entry(c.id.clone())
                        .or_default()
                        .extend(values.iter().cloned());
                    placed.push(f);
                }
                None => rest.push(f),
            }
        }
        let mut reqs: std::collections::BTreeSet<SubscriptionId> =
            std::collections::BTreeSet::new();
        for (sub_id, values) in grown {
            let link = self.link(relay);
            reqs.insert(link.packed.get(&sub_id).unwrap_or(&sub_id).clone());
            let Some(info) = link.subs.get_mut(&sub_id) else {
                continue;
            };
            let mut filter = Filter::clone(&info.filter);
            if let Some((_, set)) = filter.generic_tags.iter_mut().next() {
                set.extend(values);
            }
            info.json_len = crate::core::filter_json::filter_len(&filter);
            info.filter = std::sync::Arc::new(filter);
            self.counters.live_chunks_resent += 1;
        }
        // Each REQ that holds a grown chunk goes out again under its id, whole: it replaces
        // the relay's subscription (NIP-01).
        for wire in reqs {
            let link = self.link(relay);
            let Some(head) = link.subs.get(&wire).map(|i| i.filter.clone()) else {
                continue;
            };
            let mut others: Vec<(SubscriptionId, std::sync::Arc<Filter>)> = link
                .packed
                .iter()
                .filter(|(id, w)| **w == wire && **id != wire)
                .filter_map(|(id, _)| Some((id.clone(), link.subs.get(id)?.filter.clone())))
                .collect();
            others.sort_by(|a, b| a.0.cmp(&b.0));
            debug!(
                "{relay}: live REQ {wire} sent again with new values ({} filters)",
                others.len() + 1
            );
            let command = if others.is_empty() {
                Command::Subscribe {
                    relay: relay.clone(),
                    generation,
                    sub_id: wire,
                    filter: head,
                    scope: None,
                    fetch_since: None,
                }
            } else {
                let mut members = vec![(wire, head)];
                members.extend(others);
                Command::SubscribeMany {
                    relay: relay.clone(),
                    generation,
                    members,
                }
            };
            self.commands.push_back(command);
        }
        (rest, placed)
    }
}

/// A live-only Layer 2/3 chunk: one tag condition and nothing else but `limit: 0`.
fn is_live_chunk(f: &Filter) -> bool {
    f.ids.is_none()
        && f.authors.is_none()
        && f.kinds.is_none()
        && f.search.is_none()
        && f.since.is_none()
        && f.until.is_none()
        && f.limit == Some(0)
        && f.generic_tags.len() == 1
}

/// Polled queries may exceed what the confirmed items need in full chunks by this many
/// before new items make the relay rebuild its live set instead of joining it.
const FRAGMENTS: usize = 6;

/// Merges one-tag filters into `polled`: each value goes into a polled query of the same
/// shape (the same tag, no other condition, the same kind of value: repository coordinate
/// or event id) with fewer than [`CHUNK_SIZE`] values, else into new queries appended at
/// the end. Returns the indexes of the queries that changed or were added.
fn merge_polled(polled: &mut Vec<Filter>, new: Vec<Filter>) -> Vec<usize> {
    let mut touched = Vec::new();
    for f in new {
        let plain = |g: &Filter| {
            g.ids.is_none()
                && g.authors.is_none()
                && g.kinds.is_none()
                && g.search.is_none()
                && g.since.is_none()
                && g.until.is_none()
                && g.limit.is_none()
                && g.generic_tags.len() == 1
        };
        if !plain(&f) {
            touched.push(polled.len());
            polled.push(f);
            continue;
        }
        let Some((tag, values)) = f.generic_tags.into_iter().next() else {
            continue;
        };
        let is_coordinate = |v: &String| v.contains(':');
        let mut values: Vec<String> = values.into_iter().collect();
        for (i, g) in polled.iter_mut().enumerate() {
            let Some(first) = values.last() else {
                break;
            };
            if !plain(g) {
                continue;
            }
            let Some(have) = g.generic_tags.get_mut(&tag) else {
                continue;
            };
            if have.len() >= CHUNK_SIZE
                || have.iter().next().map(is_coordinate) != Some(is_coordinate(first))
            {
                continue;
            }
            let before = have.len();
            while have.len() < CHUNK_SIZE {
                let Some(v) = values.pop() else {
                    break;
                };
                have.insert(v);
            }
            if have.len() != before {
                touched.push(i);
            }
        }
        for chunk in values.chunks(CHUNK_SIZE) {
            touched.push(polled.len());
            polled.push(Filter::new().custom_tags(tag, chunk.iter().cloned()));
        }
    }
    touched
}

/// True for a Layer 1 filter (announcements and repository state).
fn is_l1_filter(f: &Filter) -> bool {
    f.kinds.as_ref().is_some_and(|k| {
        k.contains(&nostr::event::Kind::Custom(
            crate::core::nip34::KIND_REPO_ANNOUNCEMENT,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nostr::filter::SingleLetterTag;

    fn chunk(tag: SingleLetterTag, values: impl IntoIterator<Item = String>) -> Filter {
        Filter::new().custom_tags(tag, values)
    }

    fn id(i: usize) -> String {
        format!("{i:064x}")
    }

    fn len(f: &Filter) -> usize {
        f.generic_tags.values().map(|v| v.len()).sum()
    }

    #[test]
    fn merged_values_fill_chunks_with_room_of_the_same_tag_and_kind_then_new_ones() {
        let e = SingleLetterTag::LOWERCASE_E;
        let q = SingleLetterTag::LOWERCASE_Q;
        let coordinate = format!("30617:{}:r", "ab".repeat(32));
        let mut polled = vec![
            chunk(e, (0..100).map(id)),
            chunk(e, (100..198).map(id)),
            // Repository coordinates under `#q`: ids never join them.
            chunk(q, [coordinate.clone()]),
            chunk(q, (300..399).map(id)),
        ];
        let new = vec![chunk(e, (500..505).map(id)), chunk(q, (500..505).map(id))];
        let touched = merge_polled(&mut polled, new);
        // `#e`: two values fill the second chunk, three make a new one; `#q`: one value
        // fills the id chunk, four make a new one.
        let sizes: Vec<usize> = polled.iter().map(len).collect();
        assert_eq!(sizes, vec![100, 100, 1, 100, 3, 4]);
        assert_eq!(touched, vec![1, 4, 3, 5]);
        assert!(polled[2].generic_tags[&q].contains(&coordinate));
        let all: HashSet<String> = polled
            .iter()
            .flat_map(|f| f.generic_tags.values().flatten().cloned())
            .collect();
        assert!((500..505).map(id).all(|v| all.contains(&v)));
        assert!(polled[4].generic_tags.contains_key(&e));
        assert!(polled[5].generic_tags.contains_key(&q));
    }

    #[test]
    fn a_filter_with_other_conditions_is_appended_as_it_is() {
        let e = SingleLetterTag::LOWERCASE_E;
        let mut polled = vec![chunk(e, [id(1)])];
        let odd = chunk(e, [id(2)]).limit(5);
        let touched = merge_polled(&mut polled, vec![odd.clone()]);
        assert_eq!(polled, vec![chunk(e, [id(1)]), odd]);
        assert_eq!(touched, vec![1]);
    }
}
