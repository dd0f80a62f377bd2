//! Which relays each repository is synced from within a [`TargetPolicy`]
//! ([`select_targets`], [`derive_targets`]): the repository scope, the relays per
//! announcing pubkey, the global cap filled round-robin by activity tiers ([`activity`]),
//! the per-host cap and the shard; and what they left out ([`TargetReport`]).

use crate::core::hash::HashMap;

use crate::core::nip34::RepoRef;
use crate::core::state::{RelaySyncNeeds, RepoSyncIndex};
use crate::shared::RelayUrl;

use super::{host_port, Exclusions, Plan, TargetPolicy};

/// The tier of a pubkey in the global cap's round-robins (lower first): operator-listed
/// pubkeys, then pubkeys by the [`activity`] of their busiest repository (most first), then
/// pubkeys whose repositories show no life (no root event). It orders each round of its
/// [`band`]'s round-robin.
fn tier(policy: &TargetPolicy, key: &str, activity: u8) -> u8 {
    if policy.preferred_pubkeys.contains(key) {
        0
    } else if activity > 0 {
        1 + MAX_ACTIVITY - activity
    } else {
        2 + MAX_ACTIVITY
    }
}

/// The highest [`activity`].
const MAX_ACTIVITY: u8 = 11;

/// The band of a [`tier`]: operator-listed pubkeys (0), pubkeys showing life (1), the rest
/// (2). The global cap's round-robin runs band by band; inside a band each round gives
/// every pubkey one relay, in tier order. A band of strict tiers let activity be bought:
/// 16 throw-away keys with 1,024 cheap issues and 64 silent relays each took every slot
/// above a real repository (issue 36). Now a pubkey showing life gets its k-th relay before
/// any pubkey of its band gets its (k+1)-th.
fn band(tier: u8) -> u8 {
    match tier {
        0 => 0,
        t if t <= MAX_ACTIVITY => 1,
        _ => 2,
    }
}

/// How much life a repository with `root_events` root events shows: 0 for none, else 1 +
/// the power of two below the count (1; 2–3; 4–7; …), at most 11: a pubkey's tier in the
/// selection (`tier`) follows its busiest repository's. It changes only when a
/// repository's count reaches a power of two, when the machine runs the selection again
/// (while a cap binds).
pub fn activity(root_events: usize) -> u8 {
    if root_events == 0 {
        0
    } else {
        (1 + root_events.ilog2()).min(MAX_ACTIVITY as u32) as u8
    }
}

/// What the scope and the quotas left out, at the time of one derivation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TargetReport {
    /// Announced repositories inside the scope.
    pub repos_in_scope: usize,
    /// Announced repositories outside the scope (not listing this service): not synced.
    pub repos_out_of_scope: usize,
    /// Distinct relays named by repositories in scope (own URLs not counted).
    pub relays_wanted: usize,
    /// Relays that are targets.
    pub relays_selected: usize,
    /// Pubkeys whose repositories name more relays than `max_relays_per_pubkey`.
    pub pubkeys_over_quota: usize,
    /// Relays dropped because every pubkey naming them was over its quota.
    pub relays_over_pubkey_quota: usize,
    /// Relays within a pubkey quota but dropped because `max_relays` was reached.
    pub relays_over_global_cap: usize,
    /// Selected relays left to the other instances of a sharded fleet (`--shard`).
    pub relays_other_shards: usize,
    /// Relays within a pubkey quota but dropped because `max_urls_per_host` URLs of their
    /// host and port were selected.
    pub relays_over_host_cap: usize,
    /// Repositories in scope of pubkeys blocked after too many refused relays.
    pub repos_blocked: usize,
}

/// The result of [`derive_targets`].
#[derive(Debug, Clone, Default)]
pub struct Targets {
    /// Per-relay targets, as [`derive_relay_targets`](super::derive_relay_targets) returns them, within the policy.
    pub targets: HashMap<RelayUrl, RelaySyncNeeds>,
    /// What was left out.
    pub report: TargetReport,
}

/// The pubkey part of a `30617:<pubkey>:<d>` reference (the whole reference if malformed).
pub(crate) fn repo_pubkey(repo: &str) -> &str {
    let mut parts = repo.splitn(3, ':');
    match (parts.next(), parts.next()) {
        (Some(_), Some(pk)) => pk,
        _ => repo,
    }
}

/// Which repositories are synced from which relays within a [`TargetPolicy`]: repository
/// scope, relays per announcing pubkey, the global relay cap and the shard. Reads relay sets
/// only (never root events), so its cost does not grow with the number of root events.
///
/// 1. Repositories outside `policy.scope` are skipped (with their root events).
/// 2. Per pubkey, its relays (minus `excluded`) are ranked by how many of its repositories
///    name them (most first), then by URL; the first `max_relays_per_pubkey` are kept.
/// 3. The reserved relays take their slots; the remaining `max_relays` slots are filled
///    round by round, each pubkey (fewest relays first, then by pubkey) taking its next
///    relay that is not selected yet.
/// 4. A repository gets a relay as target when the relay is selected, within its pubkey's
///    quota and (with `policy.shard`) of this shard.
pub fn select_targets(
    repo_index: &RepoSyncIndex,
    excluded: &Exclusions,
    policy: &TargetPolicy,
) -> Selection {
    let mut repo_relays: HashMap<RepoRef, Vec<RelayUrl>> = HashMap::default();
    let report = select_each(repo_index, excluded, policy, |repo, mine| {
        if !mine.is_empty() {
            repo_relays.insert(repo.clone(), mine.iter().map(|r| (*r).clone()).collect());
        }
    });
    Selection {
        report,
        repo_relays,
    }
}

/// One pubkey's repositories in [`select_each`], each with the range of its relays' ids in
/// the pass's flat id list.
type KeyRepos<'a> = Vec<(&'a RepoRef, usize, usize)>;

/// [`select_targets`] without collecting: `visit` gets every repository in scope with its
/// target relays (sorted, possibly none), so [`Plan::reselect`] can compare in place.
pub(super) fn select_each<'a>(
    repo_index: &'a RepoSyncIndex,
    excluded: &Exclusions,
    policy: &TargetPolicy,
    mut visit: impl FnMut(&'a RepoRef, &[&'a RelayUrl]),
) -> TargetReport {
    let mut report = TargetReport::default();
    // Relay URLs are interned to small ids for this pass (one hash per repository relay),
    // so every per-relay set below is a `Vec` indexed by id.
    let mut relay_ids: HashMap<&'a RelayUrl, u32> = HashMap::default();
    let mut urls: Vec<&'a RelayUrl> = Vec::new();
    // 1. Scope; group repositories by pubkey, each with its relays (minus `excluded`) as
    //    ids in one flat list.
    let mut key_ids: HashMap<&'a str, usize> = HashMap::default();
    let mut keys: Vec<(&'a str, KeyRepos<'a>)> = Vec::new();
    // Per key (as `keys`): its activity ([`activity`] of its busiest repository in scope).
    let mut live: Vec<u8> = Vec::new();
    let mut flat: Vec<u32> = Vec::new();
    for (repo, needs) in repo_index {
        if needs.relays.is_empty() {
            continue;
        }
        if !policy.scope.admits(needs.relays.iter()) {
            report.repos_out_of_scope += 1;
            continue;
        }
        report.repos_in_scope += 1;
        let key = repo_pubkey(repo);
        if policy.blocked_pubkeys.contains(key) {
            report.repos_blocked += 1;
            continue;
        }
        let start = flat.len();
        for relay in &needs.relays {
            if excluded.contains(relay) {
                continue;
            }
            let id = *relay_ids.entry(relay).or_insert_with(|| {
                urls.push(relay);
                (urls.len() - 1) as u32
            });
            flat.push(id);
        }
        let k = *key_ids.entry(key).or_insert_with(|| {
            keys.push((key, Vec::new()));
            live.push(0);
            keys.len() - 1
        });
        live[k] = live[k].max(activity(needs.root_events.len()));
        keys[k].1.push((repo, start, flat.len()));
    }
    let n = urls.len();
    // 2. Per-pubkey quota: its relays ranked by how many of its repositories name them,
    //    then by URL.
    let mut count = vec![0u32; n];
    let mut wanted = vec![false; n];
    let mut over_quota = vec![false; n];
    let mut allowed: Vec<(&str, usize, Vec<u32>)> = Vec::with_capacity(keys.len());
    for (k, (key, repos)) in keys.iter().enumerate() {
        let mut touched: Vec<u32> = Vec::new();
        for &(_, start, end) in repos {
            for &id in &flat[start..end] {
                if count[id as usize] == 0 {
                    touched.push(id);
                }
                count[id as usize] += 1;
            }
        }
        touched.sort_by(|a, b| {
            count[*b as usize]
                .cmp(&count[*a as usize])
                .then_with(|| urls[*a as usize].cmp(urls[*b as usize]))
        });
        for &id in &touched {
            count[id as usize] = 0;
            wanted[id as usize] = true;
        }
        if touched.len() > policy.max_relays_per_pubkey {
            report.pubkeys_over_quota += 1;
            for &id in &touched[policy.max_relays_per_pubkey..] {
                over_quota[id as usize] = true;
            }
            touched.truncate(policy.max_relays_per_pubkey);
        }
        allowed.push((key, k, touched));
    }
    // 3. Global cap: reserved relays first, then round-robins across pubkeys, band by band
    //    (operator-listed pubkeys, then pubkeys whose repositories show life, then the
    //    rest: [`band`]); each round in tier order (more activity first), then fewest
    //    relays first, then by pubkey; first over relays that are not failing their
    //    connects, then over those that are. At most `max_urls_per_host` URLs of one host
    //    and port are selected.
    let mut selected = vec![false; n];
    let mut over_host_cap = vec![false; n];
    let mut hosts: HashMap<String, usize> = HashMap::default();
    let mut slots = policy.max_relays.saturating_sub(policy.reserved.len());
    for r in &policy.reserved {
        *hosts.entry(host_port(r)).or_default() += 1;
        if let Some(&id) = relay_ids.get(r) {
            selected[id as usize] = true;
        }
    }
    allowed.sort_by(|a, b| {
        tier(policy, a.0, live[a.1])
            .cmp(&tier(policy, b.0, live[b.1]))
            .then_with(|| a.2.len().cmp(&b.2.len()))
            .then_with(|| a.0.cmp(b.0))
    });
    let failing: Vec<bool> = urls.iter().map(|u| policy.failing.contains(*u)).collect();
    for pass_failing in [false, true] {
        let mut start = 0;
        while start < allowed.len() && slots > 0 {
            let b = band(tier(policy, allowed[start].0, live[allowed[start].1]));
            let mut end = start;
            while end < allowed.len()
                && band(tier(policy, allowed[end].0, live[allowed[end].1])) == b
            {
                end += 1;
            }
            let mut cursors = vec![0usize; end - start];
            let mut progress = true;
            while slots > 0 && progress {
                progress = false;
                for (c, (_, _, relays)) in allowed[start..end].iter().enumerate() {
                    if slots == 0 {
                        break;
                    }
                    while let Some(&id) = relays.get(cursors[c]) {
                        let i = id as usize;
                        cursors[c] += 1;
                        if selected[i] || failing[i] != pass_failing {
                            continue;
                        }
                        let host = hosts.entry(host_port(urls[i])).or_default();
                        if *host >= policy.max_urls_per_host {
                            over_host_cap[i] = true;
                            continue;
                        }
                        *host += 1;
                        selected[i] = true;
                        slots -= 1;
                        progress = true;
                        break;
                    }
                }
            }
            start = end;
        }
    }
    let mut within_quota = vec![false; n];
    for (_, _, relays) in &allowed {
        for &id in relays {
            within_quota[id as usize] = true;
        }
    }
    report.relays_wanted = wanted.iter().filter(|w| **w).count();
    report.relays_over_pubkey_quota = (0..n)
        .filter(|&i| over_quota[i] && !within_quota[i])
        .count();
    report.relays_over_host_cap = (0..n)
        .filter(|&i| within_quota[i] && !selected[i] && over_host_cap[i])
        .count();
    report.relays_over_global_cap = (0..n)
        .filter(|&i| within_quota[i] && !selected[i] && !over_host_cap[i])
        .count();
    // 4. Each repository's target relays: selected, within its pubkey's quota and (when
    //    sharded) of this instance's shard.
    let owned: Vec<bool> = urls
        .iter()
        .map(|u| policy.shard.is_none_or(|s| s.owns(u)))
        .collect();
    let mut other_shards = vec![false; n];
    let mut in_quota = vec![false; n];
    let mut mine: Vec<&'a RelayUrl> = Vec::new();
    for (_, k, relays) in &allowed {
        for &id in relays {
            in_quota[id as usize] = selected[id as usize];
        }
        for &(repo, start, end) in &keys[*k].1 {
            mine.clear();
            for &id in &flat[start..end] {
                let i = id as usize;
                if !in_quota[i] {
                    continue;
                }
                if !owned[i] {
                    other_shards[i] = true;
                    continue;
                }
                mine.push(urls[i]);
            }
            mine.sort();
            visit(repo, &mine);
        }
        for &id in relays {
            in_quota[id as usize] = false;
        }
    }
    report.relays_other_shards = other_shards.iter().filter(|o| **o).count();
    report
}

/// [`derive_relay_targets`](super::derive_relay_targets) within a [`TargetPolicy`]: [`select_targets`], then every
/// repository (with its root events) added to its target relays. Deterministic: the same
/// index and policy always give the same targets, whatever the hash maps' iteration order.
pub fn derive_targets(
    repo_index: &RepoSyncIndex,
    excluded: &Exclusions,
    policy: &TargetPolicy,
) -> Targets {
    Plan::build(repo_index, excluded, policy).into_targets()
}

/// Which relays each repository is synced from, as [`select_targets`] decides.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// What was left out (`relays_selected` is filled in by [`Plan`]).
    pub report: TargetReport,
    /// Per repository with at least one target relay: those relays, sorted.
    pub repo_relays: HashMap<RepoRef, Vec<RelayUrl>>,
}
