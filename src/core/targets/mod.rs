//! Which relays carry which repositories and root events, and what each relay should start
//! syncing.
//!
//! * [`scope`]: what may become a target at all: the repository scope (GRASP-01,
//!   `--public-url` / `--archive`), the relays never synced from ([`Exclusions`]), one
//!   spelling per host ([`host_port`]) and the quotas ([`TargetPolicy`], [`TargetLimits`]);
//! * [`select`]: which relays each repository is synced from within a policy
//!   ([`select_targets`], [`derive_targets`]): quotas per pubkey, the global cap filled
//!   round-robin by activity tiers, the per-host cap;
//! * [`shard`]: `--shard I/N`, the part of the relays this instance syncs ([`Shard`]);
//! * [`plan`]: the machine's cache of the selection and the per-relay targets, updated in
//!   proportion to a change ([`Plan`]);
//! * here: [`derive_relay_targets`] (the design's inversion of the repository index) and
//!   [`compute_actions`], the single decision point for new Layer-2/3 subscriptions (a
//!   three-way diff: target − pending − confirmed).
//!
//! Every item is re-exported here: `core::targets::Plan` and `core::targets::plan::Plan` are
//! one type.

use crate::core::hash::{HashMap, HashSet};

use nostr::event::EventId;
use nostr::filter::Filter;

use crate::core::filters::build_layer2_and_layer3_filters;
use crate::core::nip34::RepoRef;
use crate::core::state::{
    ConnectionStatus, PendingBatch, PendingSyncIndex, RelayState, RelaySyncIndex, RelaySyncNeeds,
    RepoSyncIndex,
};
use crate::shared::RelayUrl;

pub mod plan;
pub mod scope;
pub mod select;
pub mod shard;
#[cfg(test)]
mod tests;

pub use plan::Plan;
pub use scope::{
    canonical_host, host_port, Exclusions, RepoScope, TargetLimits, TargetPolicy,
    MAX_REFUSALS_PER_HOST, MAX_REFUSALS_PER_PUBKEY, MAX_RELAYS_PER_PUBKEY, MAX_URLS_PER_HOST,
};
pub(crate) use select::repo_pubkey;
pub use select::{activity, derive_targets, select_targets, Selection, TargetReport, Targets};
pub use shard::{fnv1a64, Shard};

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
    let mut targets: HashMap<RelayUrl, RelaySyncNeeds> = HashMap::default();
    for (repo_ref, needs) in repo_index {
        for relay in &needs.relays {
            if excluded.contains(relay) {
                continue;
            }
            let t = targets.entry(relay.clone()).or_default();
            t.repos.insert(repo_ref.clone());
            t.root_events.extend(needs.layer3_ids().copied());
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
    let mut actions: Vec<AddFilters> = targets
        .iter()
        .filter_map(|(relay, target)| {
            let batches = pending.get(relay).map_or(&[][..], Vec::as_slice);
            compute_action(relay, target, confirmed.get(relay), batches)
        })
        .collect();
    actions.sort_by(|a, b| a.relay_url.cmp(&b.relay_url));
    actions
}

/// [`compute_actions`] for one relay: the items of `target` in none of its `pending`
/// batches and not confirmed in its `state` (`None`: a relay not known yet, which gets an
/// action whenever its target is not empty). `None` when nothing is new, or when the relay
/// is known but not [`ConnectionStatus::Connected`].
pub fn compute_action(
    relay: &RelayUrl,
    target: &RelaySyncNeeds,
    state: Option<&RelayState>,
    pending: &[PendingBatch],
) -> Option<AddFilters> {
    if state.is_some_and(|s| s.connection_status != ConnectionStatus::Connected) {
        return None;
    }
    // Most of a target is confirmed: those are left out first, one lookup each. What is
    // left is looked up in the pending batches, directly while that is cheaper than
    // collecting every pending item into a set (a first sync's ticks diff a few new roots
    // against hundreds of pending batches: the sets were a tenth of the coordinator's CPU).
    let mut repos: HashSet<RepoRef> = target
        .repos
        .iter()
        .filter(|r| !state.is_some_and(|s| s.repos.contains(*r)))
        .cloned()
        .collect();
    let mut root_events: HashSet<EventId> = target
        .root_events
        .iter()
        .filter(|e| !state.is_some_and(|s| s.root_events.contains(*e)))
        .copied()
        .collect();
    if repos.is_empty() && root_events.is_empty() {
        return None;
    }
    let pending_items: usize = pending
        .iter()
        .map(|b| b.items.repos.len() + b.items.root_events.len())
        .sum();
    if (repos.len() + root_events.len()).saturating_mul(pending.len()) <= pending_items {
        repos.retain(|r| !pending.iter().any(|b| b.items.repos.contains(r)));
        root_events.retain(|e| !pending.iter().any(|b| b.items.root_events.contains(e)));
    } else {
        let pending_repos: HashSet<&RepoRef> =
            pending.iter().flat_map(|b| b.items.repos.iter()).collect();
        let pending_events: HashSet<&EventId> = pending
            .iter()
            .flat_map(|b| b.items.root_events.iter())
            .collect();
        repos.retain(|r| !pending_repos.contains(r));
        root_events.retain(|e| !pending_events.contains(e));
    }
    if repos.is_empty() && root_events.is_empty() {
        return None;
    }
    let filters = build_layer2_and_layer3_filters(&repos, &root_events, None);
    Some(AddFilters {
        relay_url: relay.clone(),
        repos,
        root_events,
        filters,
    })
}
