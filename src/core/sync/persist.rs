//! Persisted sync state (issue 11), sans-IO: [`SyncMachine::snapshot`] turns what saves
//! work across a restart into plain data ([`SyncSnapshot`]), [`SyncMachine::restore`] takes
//! it back before [`SyncMachine::start`]. The engine writes and reads the file
//! (`engine::state_file`).
//!
//! What is kept per remote relay: whether it was connected (or when it was lost), the `since`
//! from which a quick reconnect must catch up, the items whose history it delivered
//! completely, its next daily resync and (a hook for NIP-77) whether it reconciles.
//!
//! Restored state never makes the machine skip anything it would otherwise fetch:
//! * a restored relay is a quick reconnect only when its first connect comes within the
//!   quick-reconnect window of the moment it was last known connected (measured on the wall
//!   clock across the restart; a wall clock that went backwards counts as outside);
//! * its restored confirmations count only for the items that are in its targets at that
//!   connect (the targets come from the own relay's full read, never from the file); every
//!   other target item gets a normal batch with full history;
//! * the `since` is never later than the saved moment minus the window, whatever the file
//!   says, and it covers history queries that were interrupted (a relay with an interrupted
//!   query that has no `since` is not saved: its next connect is a fresh sync).

use crate::core::hash::{HashMap, HashSet};
use std::collections::BTreeMap;
use std::time::Duration;

use log::info;
use nostr::event::EventId;
use nostr::filter::Filter;
use serde::{Deserialize, Serialize};

use crate::core::filters::build_layer2_and_layer3_filters;
use crate::core::state::{ConnectionStatus, PendingItems};
use crate::core::time::Time;
use crate::shared::RelayUrl;

use super::timers::Timer;
use super::{is_batch_query, Link, Nip77Support, SyncMachine};

/// The most relays one snapshot carries (more than `max_relays` by default); the rest get a
/// fresh sync after a restart.
pub const MAX_STATE_RELAYS: usize = 2_000;
/// The most confirmed items (repositories plus root events) one snapshot carries over all
/// relays; items beyond it are left out (they are synced again in full after a restart).
pub const MAX_STATE_ITEMS: usize = 100_000;
/// The most confirmed items one relay contributes to a snapshot.
pub const MAX_RELAY_ITEMS: usize = 20_000;
/// Repository coordinates longer than this (the `d` tag is chosen by whoever announces) are
/// not stored.
pub const MAX_STORED_REF_LEN: usize = 200;

/// What a restart needs from a running machine: plain data, in URL order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncSnapshot {
    /// Wall clock (Unix milliseconds) when the snapshot was taken: a relay saved as connected
    /// was connected until then.
    pub taken_at_ms: u64,
    /// Per remote relay (normalised URL).
    pub relays: BTreeMap<String, RelaySnapshot>,
}

/// The persisted state of one remote relay.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RelaySnapshot {
    /// Connected when the snapshot was taken.
    pub connected: bool,
    /// When the relay was lost (Unix milliseconds), if it was not connected.
    pub disconnected_at_ms: Option<u64>,
    /// Unix seconds from which a quick reconnect reads history (`since`): 15 min before the
    /// last connection was established, or earlier for interrupted history queries.
    pub catch_up_since: u64,
    /// Repositories (`30617:<pubkey>:<d>`) whose history the relay delivered completely.
    #[serde(deserialize_with = "capped_items")]
    pub repos: Vec<String>,
    /// Root event ids (hex) whose history the relay delivered completely.
    #[serde(deserialize_with = "capped_items")]
    pub root_events: Vec<String>,
    /// The relay's next daily resync (Unix milliseconds).
    pub next_daily_ms: Option<u64>,
    /// What a try taught about the relay's NIP-77 support: `true` once a reconciliation
    /// completed on it, `false` once it did not speak NIP-77; `None` when nothing was learnt
    /// (NIP-11 is read again at every connect).
    pub nip77: Option<bool>,
}

/// What [`SyncMachine::restore`] took from a snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Relays that get a quick reconnect at their first connect (if it comes in time).
    pub relays_restored: usize,
    /// Relays saved longer ago than the quick-reconnect window (or whose daily resync is
    /// due): fresh sync.
    pub relays_expired: usize,
    /// Relays saved at a wall-clock time later than now (the clock went backwards): fresh
    /// sync.
    pub relays_from_the_future: usize,
    /// Entries that could not be used (bad URL, the own relay, another shard, over the cap).
    pub relays_invalid: usize,
    /// Items (repositories, root events) dropped as malformed or over the caps.
    pub items_dropped: usize,
}

/// A relay restored from a snapshot, until its first connect.
#[derive(Debug, Clone)]
pub(crate) struct Restored {
    /// The moment it was last known connected (wall reading as saved).
    until: Time,
    since: nostr::types::Timestamp,
    repos: HashSet<crate::core::nip34::RepoRef>,
    root_events: HashSet<EventId>,
    next_daily: Option<Time>,
}

/// Restored confirmations of a relay that were not in its targets at its first connect
/// (the own relay's read was still in progress, as for a bootstrap relay connected at
/// once): an item that joins its targets later on that same connection, within the
/// quick-reconnect window of the moment the relay was last known connected before the
/// restart (as for the first connect itself), is confirmed with a catch-up from the restored
/// `since` instead of a batch with full history.
#[derive(Debug, Clone)]
pub(crate) struct Late {
    generation: u64,
    /// The moment it was last known connected before the restart.
    until: Time,
    since: nostr::types::Timestamp,
    repos: HashSet<crate::core::nip34::RepoRef>,
    root_events: HashSet<EventId>,
}

/// The machine's persistence bookkeeping for relays it may not know yet (a known relay's
/// restored leftovers, [`Late`] and its incomplete items, are in its
/// [`super::remote::RemoteRelay`]).
#[derive(Debug, Default)]
pub(crate) struct Persisted {
    /// Relays restored from a snapshot, until their first connect.
    restored: HashMap<RelayUrl, Restored>,
    /// NIP-77 support learnt before the restart, of relays not known yet: it moves into
    /// the relay's state when the relay is discovered.
    nip77: HashMap<RelayUrl, Nip77Support>,
}

impl Persisted {
    /// Takes the NIP-77 support restored for `relay` (it is known from now on).
    pub(super) fn take_nip77(&mut self, relay: &RelayUrl) -> Option<Nip77Support> {
        self.nip77.remove(relay)
    }

    /// The NIP-77 support restored for `relay`, not known yet.
    pub(super) fn nip77_of(&self, relay: &RelayUrl) -> Option<Nip77Support> {
        self.nip77.get(relay).copied()
    }

    /// Drops everything restored for `relay`.
    pub(super) fn forget(&mut self, relay: &RelayUrl) {
        self.restored.remove(relay);
        self.nip77.remove(relay);
    }

    /// Entries held for `relay` (for tests that a forgotten relay leaves no trace).
    #[cfg(test)]
    pub(super) fn entries_of(&self, relay: &RelayUrl) -> usize {
        usize::from(self.restored.contains_key(relay)) + usize::from(self.nip77.contains_key(relay))
    }
}

/// The wall reading (Unix ms) of `t`, seen from `now` (forwards or backwards).
pub(super) fn wall_of(t: Time, now: Time) -> u64 {
    if t >= now {
        now.wall_millis()
            .saturating_add(t.since(now).as_millis() as u64)
    } else {
        now.wall_millis()
            .saturating_sub(now.since(t).as_millis() as u64)
    }
}

/// The earliest `since` of the history queries that a reconnect would continue (sent
/// without EOSE, queued, waiting to be reopened, waiting for room for their pages,
/// interrupted, or read by a reconciliation outside a batch: `jobs`); `Err` when one has
/// no `since` (a first Layer 1, a page of it): then only a fresh sync is safe.
fn unfinished_history_floor(
    link: &Link,
    jobs: impl Iterator<Item = Option<nostr::types::Timestamp>>,
) -> Result<Option<u64>, ()> {
    if link.resume_overflow {
        return Err(());
    }
    let mut floor: Option<u64> = None;
    let mut since = |s: Option<nostr::types::Timestamp>| -> Result<(), ()> {
        let s = s.ok_or(())?.as_secs();
        floor = Some(floor.map_or(s, |x| x.min(s)));
        Ok(())
    };
    let mut take = |f: &Filter| since(f.since);
    for (sub, info) in &link.subs {
        if link.loading.contains_key(sub)
            && !is_batch_query(info.purpose)
            && info.filter.limit != Some(0)
        {
            take(&info.filter)?;
        }
    }
    for (_, info) in &link.queue {
        if !is_batch_query(info.purpose) && info.filter.limit != Some(0) {
            take(&info.filter)?;
        }
    }
    for (_, purpose, filter) in &link.reopen {
        // A live purpose (Layer 1, a batch's REQ) closed before its EOSE waits to be
        // reopened with its history: only a live-only filter carries none.
        if !purpose.is_live() || filter.limit != Some(0) {
            take(filter)?;
        }
    }
    let parked = link.parked.iter().filter(|p| p.batch.is_none());
    for f in link.resume.iter().chain(parked.map(|p| &p.filter)) {
        take(f)?;
    }
    for s in jobs {
        since(s)?;
    }
    if let (Some(ps), false) = (link.poll_since, link.polled.is_empty()) {
        let s = ps.as_secs();
        floor = Some(floor.map_or(s, |x| x.min(s)));
    }
    Ok(floor)
}

impl SyncMachine {
    /// What a restart needs to continue where this machine is (see the module docs): every
    /// remote relay that is connected, or was lost less than the quick-reconnect window ago,
    /// with the `since` its quick reconnect needs and its confirmed items (capped:
    /// [`MAX_STATE_RELAYS`], [`MAX_STATE_ITEMS`], [`MAX_RELAY_ITEMS`],
    /// [`MAX_STORED_REF_LEN`]); relays restored earlier and not connected since are carried
    /// over. Deterministic: equal machines give equal snapshots.
    pub fn snapshot(&self, now: Time) -> SyncSnapshot {
        let window = self.config.quick_reconnect_window;
        let mut out = SyncSnapshot {
            taken_at_ms: now.wall_millis(),
            relays: BTreeMap::new(),
        };
        let mut urls: Vec<&RelayUrl> = self
            .remotes
            .keys()
            .chain(self.persist.restored.keys())
            .collect();
        urls.sort();
        urls.dedup();
        let mut items_left = MAX_STATE_ITEMS;
        for url in urls {
            if out.relays.len() >= MAX_STATE_RELAYS {
                break;
            }
            let entry = if let Some(r) = self.persist.restored.get(url) {
                if now.since(r.until) > window {
                    continue;
                }
                RelaySnapshot {
                    connected: false,
                    disconnected_at_ms: Some(wall_of(r.until, now)),
                    catch_up_since: r.since.as_secs(),
                    repos: sorted_refs(r.repos.iter()),
                    root_events: sorted_ids(r.root_events.iter()),
                    next_daily_ms: r.next_daily.map(|t| wall_of(t, now)),
                    nip77: None,
                }
            } else {
                let Some(state) = self.state_of(url) else {
                    continue;
                };
                let Some(connected_at) = state.last_connected else {
                    continue;
                };
                let disconnected_at_ms = match (state.connection_status, state.disconnected_at) {
                    (ConnectionStatus::Connected, _) => None,
                    (_, Some(at)) if now.since(at) <= window => Some(wall_of(at, now)),
                    _ => continue,
                };
                let mut since = connected_at
                    .rebased(now)
                    .minus(window)
                    .timestamp()
                    .as_secs();
                let floor = self
                    .link_of(url)
                    .map(|l| unfinished_history_floor(l, self.recon.unbatched_history_of(url)));
                match floor {
                    Some(Err(())) => continue,
                    Some(Ok(Some(floor))) => since = since.min(floor),
                    _ => {}
                }
                // Restored items still waiting to join the targets (`Late`) are not saved
                // again: they have had no live coverage since the restart.
                let incomplete = self.remote_of(url).map(|r| &r.incomplete);
                let repos = state
                    .repos
                    .iter()
                    .filter(|r| !incomplete.is_some_and(|i| i.repos.contains(*r)));
                let roots = state
                    .root_events
                    .iter()
                    .filter(|e| !incomplete.is_some_and(|i| i.root_events.contains(*e)));
                RelaySnapshot {
                    connected: disconnected_at_ms.is_none(),
                    disconnected_at_ms,
                    catch_up_since: since,
                    repos: sorted_refs(repos),
                    root_events: sorted_ids(roots),
                    next_daily_ms: self
                        .timers
                        .get(&Timer::Daily(url.clone()))
                        .map(|t| wall_of(t, now)),
                    nip77: None,
                }
            };
            let mut entry = entry;
            let nip77 = match self.remote_of(url) {
                Some(r) => Some(r.nip77),
                None => self.persist.nip77.get(url).copied(),
            };
            entry.nip77 = match nip77 {
                Some(Nip77Support::Works) => Some(true),
                Some(Nip77Support::Unsupported) => Some(false),
                _ => None,
            };
            let budget = items_left.min(MAX_RELAY_ITEMS);
            entry.repos.truncate(budget);
            entry
                .root_events
                .truncate(budget.saturating_sub(entry.repos.len()));
            items_left -= entry.repos.len() + entry.root_events.len();
            out.relays.insert(url.to_string(), entry);
        }
        out
    }

    /// Takes back a snapshot of an earlier run; call it before [`SyncMachine::start`]. Each
    /// usable relay is remembered until its first connect, which is then a quick reconnect
    /// (see the module docs); everything else is left to a fresh sync. Malformed entries are
    /// skipped and counted, never trusted.
    pub fn restore(&mut self, snapshot: SyncSnapshot, now: Time) -> RestoreReport {
        let window = self.config.quick_reconnect_window;
        let mut report = RestoreReport::default();
        let mut items_left = MAX_STATE_ITEMS;
        for (url, r) in snapshot.relays {
            let Ok(relay) = RelayUrl::parse(&url) else {
                report.relays_invalid += 1;
                continue;
            };
            if self.excluded.contains(&relay)
                || self.config.shard.is_some_and(|s| !s.owns(&relay))
                || self.persist.restored.len() >= MAX_STATE_RELAYS
            {
                report.relays_invalid += 1;
                continue;
            }
            if let Some(works) = r.nip77 {
                let support = if works {
                    Nip77Support::Works
                } else {
                    Nip77Support::Unsupported
                };
                match self.remotes.get_mut(&relay) {
                    Some(known) => known.nip77 = support,
                    None => {
                        self.persist.nip77.insert(relay.clone(), support);
                    }
                }
            }
            let until_ms = if r.connected {
                snapshot.taken_at_ms
            } else {
                match r.disconnected_at_ms {
                    Some(ms) => ms.min(snapshot.taken_at_ms),
                    None => {
                        report.relays_invalid += 1;
                        continue;
                    }
                }
            };
            if until_ms > now.wall_millis() {
                report.relays_from_the_future += 1;
                continue;
            }
            let elapsed = Duration::from_millis(now.wall_millis() - until_ms);
            let daily_due = r.next_daily_ms.is_some_and(|ms| ms <= now.wall_millis());
            if elapsed > window || daily_due {
                report.relays_expired += 1;
                continue;
            }
            let until = Time::from_readings(
                now.as_millis().saturating_sub(elapsed.as_millis() as u64),
                until_ms,
            );
            // Never later than the saved moment minus the window, whatever the file says.
            let latest = until.minus(window).timestamp().as_secs();
            let since = nostr::types::Timestamp::from_secs(r.catch_up_since.min(latest));
            let next_daily = r.next_daily_ms.map(|ms| {
                let ahead = Duration::from_millis(ms - now.wall_millis());
                now.plus(ahead.min(self.config.daily_max))
            });
            let budget = items_left.min(MAX_RELAY_ITEMS);
            let total = r.repos.len() + r.root_events.len();
            let repos: HashSet<String> = r
                .repos
                .into_iter()
                .filter(|s| s.len() <= MAX_STORED_REF_LEN)
                .filter_map(|s| crate::core::nip34::parse_repo_coordinate(&s))
                .take(budget)
                .collect();
            let root_events: HashSet<EventId> = r
                .root_events
                .iter()
                .filter_map(|s| EventId::from_hex(s).ok())
                .take(budget - repos.len())
                .collect();
            items_left -= repos.len() + root_events.len();
            report.items_dropped += total - repos.len() - root_events.len();
            report.relays_restored += 1;
            self.persist.restored.insert(
                relay,
                Restored {
                    until,
                    since,
                    repos,
                    root_events,
                    next_daily,
                },
            );
        }
        if report != RestoreReport::default() {
            info!(
                "restored sync state: {} relays for a quick reconnect, {} too old, {} saved in the future, {} unusable, {} items dropped",
                report.relays_restored,
                report.relays_expired,
                report.relays_from_the_future,
                report.relays_invalid,
                report.items_dropped
            );
        }
        report
    }

    /// Relays restored and not connected since.
    pub fn restored_relays(&self) -> usize {
        self.persist.restored.len()
    }

    /// At the first connect of a restored relay: `Some(since)` for a quick reconnect, with
    /// its restored confirmations applied as far as they are in its targets now; `None`
    /// (fresh sync) when it was not restored or the window has passed.
    pub(super) fn take_restored(
        &mut self,
        relay: &RelayUrl,
        now: Time,
    ) -> Option<nostr::types::Timestamp> {
        let r = self.persist.restored.remove(relay)?;
        let window = self.config.quick_reconnect_window;
        if now.since(r.until) > window {
            info!("{relay}: saved state is older than {window:?} at the first connect; fresh sync");
            return None;
        }
        let target = self.plan.targets().get(relay);
        let repos: HashSet<_> = r
            .repos
            .iter()
            .filter(|x| target.is_some_and(|t| t.repos.contains(*x)))
            .cloned()
            .collect();
        let roots: HashSet<EventId> = r
            .root_events
            .iter()
            .filter(|x| target.is_some_and(|t| t.root_events.contains(*x)))
            .copied()
            .collect();
        let left_out = r.repos.len() + r.root_events.len() - repos.len() - roots.len();
        let generation = self.state_of(relay)?.generation;
        info!(
            "{relay}: restored state: {} repos and {} root events confirmed before the restart ({left_out} saved items not in its targets yet are confirmed with a catch-up if they join them within {window:?})",
            repos.len(),
            roots.len()
        );
        if left_out > 0 {
            let late = Late {
                generation,
                until: r.until,
                since: r.since,
                repos: r.repos.difference(&repos).cloned().collect(),
                root_events: r.root_events.difference(&roots).copied().collect(),
            };
            self.remote_mut(relay)?.late = Some(late);
        } else {
            self.remote_mut(relay)?.late = None;
        }
        let state = self.remotes.get_mut(relay).map(|r| &mut r.state)?;
        state.repos = repos;
        state.root_events = roots;
        state.last_connected = Some(r.until);
        match r.next_daily {
            Some(t) => self.timers.set(Timer::Daily(relay.clone()), t),
            None => self.schedule_daily(relay, now),
        }
        Some(r.since)
    }

    /// Drops the restored state of `relay` and what it confirmed incompletely (its state is
    /// cleared by the daily resync).
    pub(super) fn restored_forget(&mut self, relay: &RelayUrl) {
        self.persist.restored.remove(relay);
        if let Some(r) = self.remotes.get_mut(relay) {
            r.late = None;
            r.incomplete = PendingItems::default();
        }
    }

    /// A batch of `relay` confirmed `items`: remembers whether their history is complete
    /// (only complete ones are saved as confirmed).
    pub(super) fn note_confirmed(
        &mut self,
        relay: &RelayUrl,
        items: &crate::core::state::PendingItems,
        incomplete: bool,
    ) {
        let Some(i) = self.remotes.get_mut(relay).map(|r| &mut r.incomplete) else {
            return;
        };
        if incomplete {
            i.repos.extend(items.repos.iter().cloned());
            i.root_events.extend(items.root_events.iter().copied());
        } else {
            i.repos.retain(|r| !items.repos.contains(r));
            i.root_events.retain(|e| !items.root_events.contains(e));
        }
    }

    /// The restored items of `relay` still waiting to join its targets, if they still count
    /// (same connection, within the quick-reconnect window of the saved moment).
    fn late_for(&self, relay: &RelayUrl, generation: u64, now: Time) -> Option<&Late> {
        self.remote_of(relay)?.late.as_ref().filter(|l| {
            l.generation == generation && now.since(l.until) <= self.config.quick_reconnect_window
        })
    }

    /// Called with the new items of a connected relay before they become a batch: those
    /// that were restored (see [`Late`]) are confirmed at once and caught up from the
    /// restored `since` (their live coverage comes with the next rebuild); the rest is
    /// returned for the batch.
    pub(super) fn take_late_restored(
        &mut self,
        relay: &RelayUrl,
        repos: &mut HashSet<crate::core::nip34::RepoRef>,
        root_events: &mut HashSet<EventId>,
        now: Time,
    ) -> bool {
        if self.remote_of(relay).is_none_or(|r| r.late.is_none()) {
            return false;
        }
        let Some(generation) = self.state_of(relay).map(|s| s.generation) else {
            return false;
        };
        if self.late_for(relay, generation, now).is_none() {
            if let Some(r) = self.remotes.get_mut(relay) {
                r.late = None;
            }
            return false;
        }
        let Some(late) = self.remotes.get_mut(relay).and_then(|r| r.late.as_mut()) else {
            return false;
        };
        let got_repos: HashSet<_> = repos
            .iter()
            .filter(|r| late.repos.remove(*r))
            .cloned()
            .collect();
        let got_roots: HashSet<EventId> = root_events
            .iter()
            .filter(|e| late.root_events.remove(*e))
            .copied()
            .collect();
        let since = late.since;
        if late.repos.is_empty() && late.root_events.is_empty() {
            if let Some(r) = self.remotes.get_mut(relay) {
                r.late = None;
            }
        }
        if got_repos.is_empty() && got_roots.is_empty() {
            return false;
        }
        repos.retain(|r| !got_repos.contains(r));
        root_events.retain(|e| !got_roots.contains(e));
        info!(
            "{relay}: {} repos and {} root events joined its targets and were confirmed before the restart: catch-up since {}",
            got_repos.len(),
            got_roots.len(),
            since.as_secs()
        );
        let filters = build_layer2_and_layer3_filters(&got_repos, &got_roots, None);
        if let Some(state) = self.remotes.get_mut(relay).map(|r| &mut r.state) {
            state.repos.extend(got_repos);
            state.root_events.extend(got_roots);
        }
        let filters = self.fit_filters(relay, filters);
        self.open_catch_ups(relay, generation, filters, since);
        // Live from now on once the live set is rebuilt (its catch-up covers the gap).
        let l = self.link(relay);
        l.uncovered_since = Some(l.uncovered_since.map_or(now, |u| u.min(now)));
        self.need_rebuild(relay, now);
        true
    }
}

thread_local! {
    /// Items the relay lists being decoded on this thread may still keep in all
    /// ([`with_item_budget`]); `None`: only the per-list cap.
    static ITEM_BUDGET: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// Items skipped by [`capped_items`] on this thread (for the log).
    static ITEMS_SKIPPED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Runs `f` (decoding [`RelaySnapshot`]s) with at most `budget` items kept over all their
/// lists: a hostile file of millions of tiny items costs no more memory than one at the
/// caps. Items beyond are skipped while decoding (they are synced in full after a restart).
/// Returns what `f` returned and how many items were skipped.
pub fn with_item_budget<T>(budget: usize, f: impl FnOnce() -> T) -> (T, usize) {
    let before = ITEM_BUDGET.with(|b| b.replace(Some(budget)));
    let skipped_before = ITEMS_SKIPPED.with(|s| s.replace(0));
    let out = f();
    ITEM_BUDGET.with(|b| b.set(before));
    let skipped = ITEMS_SKIPPED.with(|s| s.replace(skipped_before));
    (out, skipped)
}

/// Decodes a list of strings keeping at most [`MAX_RELAY_ITEMS`] (and the thread's
/// [`with_item_budget`]); the rest is skipped without being stored.
fn capped_items<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    struct Capped;
    impl<'de> serde::de::Visitor<'de> for Capped {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of strings")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Vec<String>, A::Error> {
            let mut out = Vec::new();
            loop {
                let room = out.len() < MAX_RELAY_ITEMS
                    && ITEM_BUDGET.with(|b| b.get().is_none_or(|n| n > 0));
                if room {
                    match seq.next_element::<String>()? {
                        Some(s) => {
                            ITEM_BUDGET.with(|b| b.set(b.get().map(|n| n - 1)));
                            out.push(s);
                        }
                        None => return Ok(out),
                    }
                } else if seq.next_element::<serde::de::IgnoredAny>()?.is_none() {
                    return Ok(out);
                } else {
                    ITEMS_SKIPPED.with(|s| s.set(s.get() + 1));
                }
            }
        }
    }
    d.deserialize_seq(Capped)
}

fn sorted_refs<'a>(it: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut v: Vec<String> = it
        .filter(|s| s.len() <= MAX_STORED_REF_LEN)
        .cloned()
        .collect();
    v.sort();
    v
}

fn sorted_ids<'a>(it: impl Iterator<Item = &'a EventId>) -> Vec<String> {
    let mut v: Vec<String> = it.map(|id| id.to_hex()).collect();
    v.sort();
    v
}
