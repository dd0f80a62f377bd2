//! `derive_relay_targets` and `compute_actions`: the single decision point for new Layer-2/3
//! subscriptions (a three-way diff: target − pending − confirmed).

use std::collections::{HashMap, HashSet};

use nostr::event::EventId;
use nostr::filter::Filter;

use crate::core::filters::build_layer2_and_layer3_filters;
use crate::core::nip34::RepoRef;
use crate::core::state::{
    ConnectionStatus, PendingSyncIndex, RelaySyncIndex, RelaySyncNeeds, RepoSyncIndex,
};
use crate::net::url::RelayUrl;

/// New Layer-2/3 items one relay should start syncing, with their filters (no `since`).
#[derive(Debug, Clone)]
pub struct AddFilters {
    /// The relay.
    pub relay_url: RelayUrl,
    /// New repositories.
    pub repos: HashSet<RepoRef>,
    /// New root events.
    pub root_events: HashSet<EventId>,
    /// Layer-2 then Layer-3 filters for exactly these items.
    pub filters: Vec<Filter>,
}

/// Inverts the repository index into per-relay targets.
///
/// Relays in `excluded` (the own relay under its connect URL and every public alias) are
/// never targets: we never sync from ourselves.
pub fn derive_relay_targets(
    repo_index: &RepoSyncIndex,
    excluded: &[RelayUrl],
) -> HashMap<RelayUrl, RelaySyncNeeds> {
    let mut targets: HashMap<RelayUrl, RelaySyncNeeds> = HashMap::new();
    for (repo_ref, needs) in repo_index {
        for relay in &needs.relays {
            if excluded.contains(relay) {
                continue;
            }
            let t = targets.entry(relay.clone()).or_default();
            t.repos.insert(repo_ref.clone());
            t.root_events.extend(needs.root_events.iter().copied());
        }
    }
    targets
}

/// For every relay: the items in `targets` that are neither pending nor confirmed.
///
/// Relays known in `confirmed` but not [`ConnectionStatus::Connected`] are skipped: they get
/// their work when they connect (`handle_connect_or_reconnect`). Relays not known at all
/// produce an action too; handling it spawns the connection. The result is sorted by relay.
pub fn compute_actions(
    targets: &HashMap<RelayUrl, RelaySyncNeeds>,
    pending: &PendingSyncIndex,
    confirmed: &RelaySyncIndex,
) -> Vec<AddFilters> {
    let empty_repos = HashSet::new();
    let empty_events = HashSet::new();
    let mut actions = Vec::new();
    for (relay, target) in targets {
        let state = confirmed.get(relay);
        if let Some(s) = state {
            if s.connection_status != ConnectionStatus::Connected {
                continue;
            }
        }
        let batches = pending.get(relay).map(|v| v.as_slice()).unwrap_or(&[]);
        let pending_repos: HashSet<&RepoRef> =
            batches.iter().flat_map(|b| b.items.repos.iter()).collect();
        let pending_events: HashSet<&EventId> = batches
            .iter()
            .flat_map(|b| b.items.root_events.iter())
            .collect();
        let confirmed_repos = state.map(|s| &s.repos).unwrap_or(&empty_repos);
        let confirmed_events = state.map(|s| &s.root_events).unwrap_or(&empty_events);

        let repos: HashSet<RepoRef> = target
            .repos
            .iter()
            .filter(|r| !pending_repos.contains(r) && !confirmed_repos.contains(*r))
            .cloned()
            .collect();
        let root_events: HashSet<EventId> = target
            .root_events
            .iter()
            .filter(|e| !pending_events.contains(e) && !confirmed_events.contains(*e))
            .copied()
            .collect();
        if repos.is_empty() && root_events.is_empty() {
            continue;
        }
        let filters = build_layer2_and_layer3_filters(&repos, &root_events, None);
        actions.push(AddFilters {
            relay_url: relay.clone(),
            repos,
            root_events,
            filters,
        });
    }
    actions.sort_by(|a, b| a.relay_url.cmp(&b.relay_url));
    actions
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::state::{PendingBatch, PendingItems, RelayState, RepoSyncNeeds};
    use crate::core::time::Time;

    fn url(s: &str) -> RelayUrl {
        RelayUrl::parse(s).unwrap()
    }
    fn repo(n: &str) -> RepoRef {
        format!("30617:{}:{n}", "ab".repeat(32))
    }
    fn id(b: u8) -> EventId {
        EventId::from_byte_array([b; 32])
    }
    fn index(entries: &[(&str, &[&str], &[u8])]) -> RepoSyncIndex {
        entries
            .iter()
            .map(|(r, relays, ids)| {
                (
                    repo(r),
                    RepoSyncNeeds {
                        relays: relays.iter().map(|u| url(u)).collect(),
                        root_events: ids.iter().map(|b| id(*b)).collect(),
                        announced_at: Some(1),
                    },
                )
            })
            .collect()
    }
    fn connected() -> RelayState {
        let mut s = RelayState::new(false);
        s.connection_status = ConnectionStatus::Connected;
        s
    }

    #[test]
    fn targets_invert_index_and_exclude_own_relay() {
        let idx = index(&[
            ("r1", &["wss://a", "wss://own"], &[1, 2]),
            ("r2", &["wss://a", "wss://b"], &[3]),
        ]);
        let t = derive_relay_targets(&idx, &[url("wss://own")]);
        assert_eq!(t.len(), 2);
        assert!(!t.contains_key(&url("wss://own")));
        let a = &t[&url("wss://a")];
        assert_eq!(a.repos, [repo("r1"), repo("r2")].into());
        assert_eq!(a.root_events, [id(1), id(2), id(3)].into());
        let b = &t[&url("wss://b")];
        assert_eq!(b.repos, [repo("r2")].into());
        assert_eq!(b.root_events, [id(3)].into());
    }

    #[test]
    fn empty_state_yields_nothing() {
        let t = derive_relay_targets(&RepoSyncIndex::new(), &[]);
        assert!(t.is_empty());
        assert!(compute_actions(&t, &PendingSyncIndex::new(), &RelaySyncIndex::new()).is_empty());
    }

    #[test]
    fn unknown_relay_gets_everything() {
        let t = derive_relay_targets(&index(&[("r1", &["wss://a"], &[1])]), &[]);
        let a = compute_actions(&t, &PendingSyncIndex::new(), &RelaySyncIndex::new());
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].relay_url, url("wss://a"));
        assert_eq!(a[0].repos, [repo("r1")].into());
        assert_eq!(a[0].root_events, [id(1)].into());
        assert_eq!(a[0].filters.len(), 6);
    }

    #[test]
    fn pending_and_confirmed_are_excluded_partial_overlap_remains() {
        let t = derive_relay_targets(
            &index(&[("r1", &["wss://a"], &[1, 2]), ("r2", &["wss://a"], &[3])]),
            &[],
        );
        let mut confirmed = RelaySyncIndex::new();
        let mut s = connected();
        s.repos.insert(repo("r1"));
        s.root_events.insert(id(1));
        confirmed.insert(url("wss://a"), s);
        let mut pending = PendingSyncIndex::new();
        pending.insert(
            url("wss://a"),
            vec![PendingBatch {
                batch_id: 1,
                items: PendingItems {
                    repos: HashSet::new(),
                    root_events: [id(2)].into(),
                },
                outstanding_subs: HashSet::new(),
                started_at: Time::from_secs(0),
                incomplete: false,
                uncovered_from: None,
            }],
        );
        let a = compute_actions(&t, &pending, &confirmed);
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].repos, [repo("r2")].into());
        assert_eq!(a[0].root_events, [id(3)].into());
        assert_eq!(a[0].filters.len(), 6);

        // Everything confirmed or pending: nothing to do.
        confirmed
            .get_mut(&url("wss://a"))
            .unwrap()
            .repos
            .insert(repo("r2"));
        confirmed
            .get_mut(&url("wss://a"))
            .unwrap()
            .root_events
            .insert(id(3));
        assert!(compute_actions(&t, &pending, &confirmed).is_empty());
    }

    #[test]
    fn disconnected_and_connecting_relays_are_skipped() {
        let t = derive_relay_targets(
            &index(&[("r1", &["wss://a", "wss://b", "wss://c"], &[])]),
            &[],
        );
        let mut confirmed = RelaySyncIndex::new();
        confirmed.insert(url("wss://a"), RelayState::new(false));
        let mut connecting = RelayState::new(false);
        connecting.connection_status = ConnectionStatus::Connecting;
        confirmed.insert(url("wss://b"), connecting);
        confirmed.insert(url("wss://c"), connected());
        let a = compute_actions(&t, &PendingSyncIndex::new(), &confirmed);
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].relay_url, url("wss://c"));
        assert_eq!(a[0].filters.len(), 3);
    }

    #[test]
    fn root_events_follow_their_repo_to_each_relay() {
        let t = derive_relay_targets(
            &index(&[("r1", &["wss://a"], &[7]), ("r2", &["wss://b"], &[8])]),
            &[],
        );
        let a = compute_actions(&t, &PendingSyncIndex::new(), &RelaySyncIndex::new());
        assert_eq!(a.len(), 2);
        assert_eq!(a[0].root_events, [id(7)].into());
        assert_eq!(a[1].root_events, [id(8)].into());
    }
}
