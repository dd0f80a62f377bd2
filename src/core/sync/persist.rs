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

use serde::{Deserialize, Serialize};

use super::*;

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
    pub repos: Vec<String>,
    /// Root event ids (hex) whose history the relay delivered completely.
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

/// The machine's persistence bookkeeping.
#[derive(Debug, Default)]
pub(crate) struct Persisted {
    restored: HashMap<RelayUrl, Restored>,
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

/// The earliest `since` of the history queries that a reconnect would continue; `Err` when
/// one has no `since` (a first Layer 1, a page of it): then only a fresh sync is safe.
fn unfinished_history_floor(link: &Link) -> Result<Option<u64>, ()> {
    if link.resume_overflow {
        return Err(());
    }
    let mut floor: Option<u64> = None;
    let mut take = |f: &Filter| -> Result<(), ()> {
        let s = f.since.ok_or(())?.as_secs();
        floor = Some(floor.map_or(s, |x| x.min(s)));
        Ok(())
    };
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
        if !purpose.is_live() {
            take(filter)?;
        }
    }
    for f in &link.resume {
        take(f)?;
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
            .relays
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
                let Some(state) = self.relays.get(url) else {
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
                match self.links.get(url).map(unfinished_history_floor) {
                    Some(Err(())) => continue,
                    Some(Ok(Some(floor))) => since = since.min(floor),
                    _ => {}
                }
                RelaySnapshot {
                    connected: disconnected_at_ms.is_none(),
                    disconnected_at_ms,
                    catch_up_since: since,
                    repos: sorted_refs(state.repos.iter()),
                    root_events: sorted_ids(state.root_events.iter()),
                    next_daily_ms: self.daily.get(url).map(|t| wall_of(t, now)),
                    nip77: None,
                }
            };
            let mut entry = entry;
            entry.nip77 = match self.recon.support.get(url) {
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
                self.recon.support.insert(relay.clone(), support);
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
        let state = self.relays.get_mut(relay)?;
        info!(
            "{relay}: restored state: {} repos and {} root events confirmed before the restart ({left_out} saved items not in its targets now are synced in full if they become targets)",
            repos.len(),
            roots.len()
        );
        state.repos = repos;
        state.root_events = roots;
        state.last_connected = Some(r.until);
        match r.next_daily {
            Some(t) => self.daily.set(relay, t),
            None => self.schedule_daily(relay, now),
        }
        Some(r.since)
    }

    /// Drops the restored state of `relay` (it is forgotten, or its state is cleared).
    pub(super) fn restored_forget(&mut self, relay: &RelayUrl) {
        self.persist.restored.remove(relay);
    }
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
