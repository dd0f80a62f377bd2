//! The machine's cached targets ([`Plan`]): a [`Selection`] and the per-relay targets it
//! gives, updated in proportion to a change (decision 0040), always equal to a fresh
//! [`derive_targets`](super::derive_targets)(super::derive_targets).

use crate::core::hash::{HashMap, HashSet};

use nostr::event::EventId;

use crate::core::nip34::RepoRef;
use crate::core::state::{RelaySyncNeeds, RepoSyncIndex, RepoSyncNeeds};
use crate::shared::RelayUrl;

use super::select::{repo_pubkey, select_each};
use super::{
    host_port, select_targets, Exclusions, Selection, TargetPolicy, TargetReport, Targets,
};

/// The machine's cached targets: a [`Selection`] and the per-relay targets it gives, kept
/// up to date in proportion to a change (issue 10).
///
/// * A new root event of a repository is added to the targets of that repository's target
///   relays ([`Plan::add_root_event`]): no selection runs, whatever the index size.
/// * A changed relay set (an announcement, a relay refused) runs [`select_targets`] again
///   (it reads relay sets only, never root events) and moves only the repositories whose
///   target relays changed ([`Plan::reselect`]); a relay that lost a repository has its root
///   events recomputed from its remaining repositories.
///
/// Both return the relays whose target changed, so `compute_actions` runs for those only.
/// The result always equals a fresh [`derive_targets`](super::derive_targets) (checked in debug builds and by
/// `tests/properties.rs`).
#[derive(Debug, Clone, Default)]
pub struct Plan {
    selection: Selection,
    targets: HashMap<RelayUrl, RelaySyncNeeds>,
    /// The selection's inputs per announcing pubkey, kept up to date by
    /// [`Plan::reselect_repos`] so that a change re-ranks only the pubkeys it touches.
    keys: Option<KeyCache>,
}

/// What [`select_each`] computes per announcing pubkey, kept between batches: while the
/// global cap does not bind, a pubkey's repositories depend only on its own ranked relays,
/// so a change to some announcements re-ranks only their pubkeys (issue 10).
#[derive(Debug, Clone, Default)]
struct KeyCache {
    /// The policy and excluded relays the cache was built for; another one rebuilds it.
    policy: Option<TargetPolicy>,
    excluded: Exclusions,
    /// Per pubkey: its repositories in scope and its ranked relays.
    keys: HashMap<String, KeyEntry>,
    /// Per relay: how many pubkeys' repositories name it (in scope, excluded relays not
    /// counted); only relays with a count.
    want: HashMap<RelayUrl, u32>,
    /// Per relay: how many pubkeys keep it within their quota; only relays with a count.
    allow: HashMap<RelayUrl, u32>,
    /// Announced repositories outside the scope.
    out_of_scope: HashSet<RepoRef>,
    /// Announced repositories in scope of blocked pubkeys.
    blocked: HashSet<RepoRef>,
    /// Announced repositories in scope (the sum of the keys' repositories).
    in_scope: usize,
    /// Pubkeys naming more relays than their quota.
    over_quota_keys: usize,
}

/// One pubkey in the [`KeyCache`].
#[derive(Debug, Clone, Default)]
struct KeyEntry {
    /// Its announced repositories in scope.
    repos: HashSet<RepoRef>,
    /// Every relay they name (excluded relays left out), ranked as [`select_each`] ranks.
    ranked: Vec<RelayUrl>,
    /// How many of `ranked` are within the quota.
    allowed: usize,
}

impl KeyEntry {
    fn allowed(&self) -> &[RelayUrl] {
        &self.ranked[..self.allowed]
    }
}

impl KeyCache {
    /// A cache of every repository of `repo_index`.
    fn build(repo_index: &RepoSyncIndex, excluded: &Exclusions, policy: &TargetPolicy) -> KeyCache {
        let mut cache = KeyCache {
            policy: Some(KeyCache::part_of(policy)),
            excluded: excluded.clone(),
            ..KeyCache::default()
        };
        let mut by_key: HashMap<&str, Vec<&RepoRef>> = HashMap::default();
        for repo in repo_index.keys() {
            by_key.entry(repo_pubkey(repo)).or_default().push(repo);
        }
        for (key, repos) in by_key {
            cache.refresh(key, &repos, repo_index, excluded, policy);
        }
        cache
    }

    /// True when the cache was built for this policy and these excluded relays.
    fn fits(&self, excluded: &Exclusions, policy: &TargetPolicy) -> bool {
        self.policy
            .as_ref()
            .is_some_and(|p| KeyCache::same_part(p, policy))
            && self.excluded == *excluded
    }

    /// The part of `policy` the cache depends on: not the failing relays nor the preferred
    /// pubkeys, which only order the global cap's round-robins (the whole selection runs
    /// whenever a cap binds), so relays starting or stopping to fail do not rebuild it.
    fn part_of(policy: &TargetPolicy) -> TargetPolicy {
        TargetPolicy {
            failing: HashSet::default(),
            preferred_pubkeys: HashSet::default(),
            ..policy.clone()
        }
    }

    /// [`KeyCache::part_of`] `policy` equals `cached` (without copying the sets).
    fn same_part(cached: &TargetPolicy, policy: &TargetPolicy) -> bool {
        // Destructured, so a new field must be placed on one side or the other.
        let TargetPolicy {
            scope,
            max_relays_per_pubkey,
            max_relays,
            reserved,
            shard,
            preferred_pubkeys: _,
            max_urls_per_host,
            failing: _,
            blocked_pubkeys,
        } = policy;
        cached.scope == *scope
            && cached.max_relays_per_pubkey == *max_relays_per_pubkey
            && cached.max_relays == *max_relays
            && cached.reserved == *reserved
            && cached.shard == *shard
            && cached.max_urls_per_host == *max_urls_per_host
            && cached.blocked_pubkeys == *blocked_pubkeys
    }

    /// Takes the repositories `changed` of pubkey `key` from the index again (their relay
    /// sets changed) and ranks the pubkey's relays again. Returns the pubkey's repositories
    /// in scope before the change.
    fn refresh(
        &mut self,
        key: &str,
        changed: &[&RepoRef],
        repo_index: &RepoSyncIndex,
        excluded: &Exclusions,
        policy: &TargetPolicy,
    ) -> HashSet<RepoRef> {
        let old = self.keys.remove(key).unwrap_or_default();
        for r in &old.ranked {
            decrement(&mut self.want, r);
        }
        for r in old.allowed() {
            decrement(&mut self.allow, r);
        }
        if old.ranked.len() > policy.max_relays_per_pubkey {
            self.over_quota_keys -= 1;
        }
        self.in_scope -= old.repos.len();
        let mut repos = old.repos.clone();
        let blocked = policy.blocked_pubkeys.contains(key);
        for repo in changed {
            repos.remove(*repo);
            self.out_of_scope.remove(*repo);
            self.blocked.remove(*repo);
            let Some(needs) = repo_index.get(*repo) else {
                continue;
            };
            if needs.relays.is_empty() {
                continue;
            }
            if blocked && policy.scope.admits(needs.relays.iter()) {
                self.blocked.insert((*repo).clone());
            } else if policy.scope.admits(needs.relays.iter()) {
                repos.insert((*repo).clone());
            } else {
                self.out_of_scope.insert((*repo).clone());
            }
        }
        self.in_scope += repos.len();
        // Rank as `select_each` does: by how many of the pubkey's repositories name a
        // relay (most first), then by URL.
        let mut count: HashMap<&RelayUrl, u32> = HashMap::default();
        for repo in &repos {
            if let Some(needs) = repo_index.get(repo) {
                for relay in needs.relays.iter().filter(|r| !excluded.contains(r)) {
                    *count.entry(relay).or_default() += 1;
                }
            }
        }
        let mut ranked: Vec<(&RelayUrl, u32)> = count.into_iter().collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let ranked: Vec<RelayUrl> = ranked.into_iter().map(|(r, _)| r.clone()).collect();
        let allowed = ranked.len().min(policy.max_relays_per_pubkey);
        if ranked.len() > policy.max_relays_per_pubkey {
            self.over_quota_keys += 1;
        }
        for r in &ranked {
            increment(&mut self.want, r);
        }
        for r in &ranked[..allowed] {
            increment(&mut self.allow, r);
        }
        if !repos.is_empty() {
            self.keys.insert(
                key.to_string(),
                KeyEntry {
                    repos,
                    ranked,
                    allowed,
                },
            );
        }
        old.repos
    }

    /// True when the global cap leaves a relay within some pubkey's quota unselected: then
    /// the round-robin couples the pubkeys and only the whole selection is right.
    fn capped(&self, policy: &TargetPolicy) -> bool {
        let slots = policy.max_relays.saturating_sub(policy.reserved.len());
        let reserved_allowed = self
            .allow
            .keys()
            .filter(|r| policy.reserved.contains(r))
            .count();
        if self.allow.len() - reserved_allowed > slots {
            return true;
        }
        // The host cap binds: which URLs of a host are kept depends on the round-robin.
        let mut hosts: HashMap<String, usize> = HashMap::default();
        let reserved = policy.reserved.iter();
        let allowed = self.allow.keys().filter(|r| !policy.reserved.contains(r));
        reserved.chain(allowed).any(|r| {
            let n = hosts.entry(host_port(r)).or_default();
            *n += 1;
            *n > policy.max_urls_per_host
        })
    }

    /// The report of the selection while the cap does not bind (see [`KeyCache::capped`]).
    fn report(&self, policy: &TargetPolicy) -> TargetReport {
        TargetReport {
            repos_in_scope: self.in_scope + self.blocked.len(),
            repos_blocked: self.blocked.len(),
            relays_over_host_cap: 0,
            repos_out_of_scope: self.out_of_scope.len(),
            relays_wanted: self.want.len(),
            relays_selected: 0,
            pubkeys_over_quota: self.over_quota_keys,
            relays_over_pubkey_quota: self
                .want
                .keys()
                .filter(|r| !self.allow.contains_key(*r))
                .count(),
            relays_over_global_cap: 0,
            relays_other_shards: self
                .allow
                .keys()
                .filter(|r| policy.shard.is_some_and(|s| !s.owns(r)))
                .count(),
        }
    }
}

fn increment(counts: &mut HashMap<RelayUrl, u32>, relay: &RelayUrl) {
    match counts.get_mut(relay) {
        Some(c) => *c += 1,
        None => {
            counts.insert(relay.clone(), 1);
        }
    }
}

fn decrement(counts: &mut HashMap<RelayUrl, u32>, relay: &RelayUrl) {
    if let Some(c) = counts.get_mut(relay) {
        *c -= 1;
        if *c == 0 {
            counts.remove(relay);
        }
    }
}

impl Plan {
    /// A plan from scratch.
    pub fn build(repo_index: &RepoSyncIndex, excluded: &Exclusions, policy: &TargetPolicy) -> Plan {
        let selection = select_targets(repo_index, excluded, policy);
        let mut targets: HashMap<RelayUrl, RelaySyncNeeds> = HashMap::default();
        for (repo, relays) in &selection.repo_relays {
            let needs = &repo_index[repo];
            for relay in relays {
                add_repo_to(&mut targets, relay, repo, needs);
            }
        }
        let mut plan = Plan {
            selection,
            targets,
            keys: None,
        };
        plan.selection.report.relays_selected = plan.targets.len();
        plan
    }

    /// True when no repository is selected (a new machine, or nothing in scope).
    pub fn is_empty(&self) -> bool {
        self.selection.repo_relays.is_empty()
    }

    /// Per-relay targets.
    pub fn targets(&self) -> &HashMap<RelayUrl, RelaySyncNeeds> {
        &self.targets
    }

    /// What the policy left out.
    pub fn report(&self) -> TargetReport {
        self.selection.report
    }

    /// True when the last selection left a relay out for the global cap or a host cap:
    /// then the order of the round-robins decides who gets a slot, so a pubkey whose
    /// repository got its first root event (a higher tier) or a relay whose connects start
    /// or stop failing can change the selection ([`Plan::reselect`] then). While it is
    /// false, every relay within a pubkey's quota is selected whatever the order.
    pub fn is_bound(&self) -> bool {
        let r = &self.selection.report;
        r.relays_over_global_cap > 0 || r.relays_over_host_cap > 0
    }

    /// The targets and report, as [`derive_targets`](super::derive_targets) returns them.
    pub fn into_targets(self) -> Targets {
        Targets {
            targets: self.targets,
            report: self.selection.report,
        }
    }

    /// Hosts (`host:port`) with more than one selected URL, most first (then by name): the
    /// per-host count that `max_urls_per_host` bounds.
    pub fn hosts_with_several_urls(&self) -> Vec<(String, usize)> {
        let mut hosts: HashMap<String, usize> = HashMap::default();
        for relay in self.targets.keys() {
            *hosts.entry(host_port(relay)).or_default() += 1;
        }
        let mut several: Vec<(String, usize)> = hosts.into_iter().filter(|h| h.1 > 1).collect();
        several.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        several
    }

    /// Drops `relay` from every repository's targets at once (it was refused), without a
    /// selection: the slot it frees is given at the next [`Plan::reselect`], which must run
    /// with `relay` excluded before the plan is compared with a fresh derivation again.
    /// Costs the repositories it carried.
    pub fn drop_relay(&mut self, relay: &RelayUrl) {
        let Some(target) = self.targets.remove(relay) else {
            return;
        };
        for repo in &target.repos {
            if let Some(relays) = self.selection.repo_relays.get_mut(repo) {
                relays.retain(|r| r != relay);
                if relays.is_empty() {
                    self.selection.repo_relays.remove(repo);
                }
            }
        }
        self.selection.report.relays_selected = self.targets.len();
    }

    /// Root event `id` now references `repo` (already in the index), or `id` is a reply newly
    /// followed below one of its root events (a Layer-3 id like a root): adds it to the
    /// targets of the repository's relays. Returns the relays whose target grew.
    pub fn add_root_event(&mut self, repo: &str, id: EventId) -> Vec<RelayUrl> {
        let mut changed = Vec::new();
        self.add_root_event_with(repo, id, |r| changed.push(r.clone()));
        changed
    }

    /// [`Plan::add_root_event`], calling `grown` with each relay whose target grew (no copy
    /// of the URLs).
    pub fn add_root_event_with(
        &mut self,
        repo: &str,
        id: EventId,
        mut grown: impl FnMut(&RelayUrl),
    ) {
        if let Some(relays) = self.selection.repo_relays.get(repo) {
            for relay in relays {
                if let Some(t) = self.targets.get_mut(relay) {
                    if t.root_events.insert(id) {
                        grown(relay);
                    }
                }
            }
        }
    }

    /// [`Plan::reselect`] after the relay sets of the repositories `changed` changed (new or
    /// newer announcements), in proportion to the change: only the pubkeys of `changed` are
    /// ranked again and only their repositories are compared, while the global cap
    /// (`max_relays`) leaves every relay within a pubkey's quota selected. When the cap
    /// binds, or the policy or the excluded relays differ from the last call, the whole
    /// selection runs ([`Plan::reselect`]). Every repository whose relay set changed since
    /// the last call must be in `changed`. Returns the relays whose target changed.
    pub fn reselect_repos(
        &mut self,
        repo_index: &RepoSyncIndex,
        excluded: &Exclusions,
        policy: &TargetPolicy,
        changed: &[RepoRef],
    ) -> HashSet<RelayUrl> {
        let mut cache = match self.keys.take() {
            Some(c) if c.fits(excluded, policy) => c,
            _ => {
                let cache = KeyCache::build(repo_index, excluded, policy);
                let changed = self.reselect(repo_index, excluded, policy);
                self.keys = Some(cache);
                return changed;
            }
        };
        let mut by_key: HashMap<&str, Vec<&RepoRef>> = HashMap::default();
        for repo in changed {
            by_key.entry(repo_pubkey(repo)).or_default().push(repo);
        }
        let mut touched: Vec<(String, HashSet<RepoRef>)> = Vec::new();
        for (key, repos) in by_key {
            let before = cache.refresh(key, &repos, repo_index, excluded, policy);
            touched.push((key.to_string(), before));
        }
        // The cap binds now, or did at the last selection: the whole selection.
        if cache.capped(policy)
            || self.selection.report.relays_over_global_cap > 0
            || self.selection.report.relays_over_host_cap > 0
        {
            let changed = self.reselect(repo_index, excluded, policy);
            self.keys = Some(cache);
            return changed;
        }
        // Each touched pubkey's repositories, before and after, against their cached relays.
        let mut moves: Vec<(RepoRef, Vec<RelayUrl>)> = Vec::new();
        for (key, before) in &touched {
            let entry = cache.keys.get(key);
            let allowed = entry.map_or(&[][..], |e| e.allowed());
            let now_repos = entry.map(|e| &e.repos);
            let repos = before.iter().chain(
                now_repos
                    .into_iter()
                    .flatten()
                    .filter(|r| !before.contains(*r)),
            );
            for repo in repos {
                let mut mine: Vec<RelayUrl> = Vec::new();
                if now_repos.is_some_and(|rs| rs.contains(repo)) {
                    if let Some(needs) = repo_index.get(repo) {
                        mine = needs
                            .relays
                            .iter()
                            .filter(|r| {
                                !excluded.contains(r)
                                    && allowed.contains(r)
                                    && policy.shard.is_none_or(|s| s.owns(r))
                            })
                            .cloned()
                            .collect();
                        mine.sort();
                    }
                }
                let cached: &[RelayUrl] = self
                    .selection
                    .repo_relays
                    .get(repo)
                    .map_or(&[], |v| v.as_slice());
                if cached != mine.as_slice() {
                    moves.push((repo.clone(), mine));
                }
            }
        }
        let mut changed_relays: HashSet<RelayUrl> = HashSet::default();
        let mut shrunk: HashSet<RelayUrl> = HashSet::default();
        for (repo, now) in moves {
            let before = self.selection.repo_relays.remove(&repo).unwrap_or_default();
            self.move_repo(
                repo_index,
                &repo,
                &before,
                &now,
                &mut changed_relays,
                &mut shrunk,
            );
            if !now.is_empty() {
                self.selection.repo_relays.insert(repo, now);
            }
        }
        self.recompute_shrunk(repo_index, shrunk, &mut changed_relays);
        self.selection.report = cache.report(policy);
        self.selection.report.relays_selected = self.targets.len();
        self.keys = Some(cache);
        changed_relays
    }

    /// Runs the selection again after relay sets changed and moves the repositories whose
    /// target relays changed. Returns the relays whose target changed.
    pub fn reselect(
        &mut self,
        repo_index: &RepoSyncIndex,
        excluded: &Exclusions,
        policy: &TargetPolicy,
    ) -> HashSet<RelayUrl> {
        // Compare each repository's new target relays with the cached ones in place: only
        // the repositories that moved are collected (no copy of the whole selection).
        let mut moves: Vec<(&RepoRef, Vec<RelayUrl>)> = Vec::new();
        let mut selected_repos = 0usize;
        let cached = &self.selection.repo_relays;
        let report = select_each(repo_index, excluded, policy, |repo, mine| {
            if !mine.is_empty() {
                selected_repos += 1;
            }
            let before: &[RelayUrl] = cached.get(repo).map_or(&[], |v| v.as_slice());
            if before.len() != mine.len() || before.iter().zip(mine).any(|(a, b)| a != *b) {
                moves.push((repo, mine.iter().map(|r| (*r).clone()).collect()));
            }
        });
        let mut changed: HashSet<RelayUrl> = HashSet::default();
        let mut shrunk: HashSet<RelayUrl> = HashSet::default();
        for (repo, now) in moves {
            let before = self.selection.repo_relays.remove(repo).unwrap_or_default();
            self.move_repo(repo_index, repo, &before, &now, &mut changed, &mut shrunk);
            if !now.is_empty() {
                self.selection.repo_relays.insert(repo.clone(), now);
            }
        }
        if self.selection.repo_relays.len() != selected_repos {
            // Some cached repositories left the scope (were not visited): drop them.
            let fresh = select_targets(repo_index, excluded, policy);
            let gone: Vec<RepoRef> = self
                .selection
                .repo_relays
                .keys()
                .filter(|r| !fresh.repo_relays.contains_key(*r))
                .cloned()
                .collect();
            for repo in gone {
                let before = self.selection.repo_relays.remove(&repo).unwrap_or_default();
                self.move_repo(repo_index, &repo, &before, &[], &mut changed, &mut shrunk);
            }
        }
        self.selection.report = report;
        self.recompute_shrunk(repo_index, shrunk, &mut changed);
        self.selection.report.relays_selected = self.targets.len();
        changed
    }

    /// A relay that lost a repository may still carry some of its root events through
    /// another repository: recompute its root events from what it keeps.
    fn recompute_shrunk(
        &mut self,
        repo_index: &RepoSyncIndex,
        shrunk: HashSet<RelayUrl>,
        changed: &mut HashSet<RelayUrl>,
    ) {
        for relay in shrunk {
            let Some(t) = self.targets.get_mut(&relay) else {
                continue;
            };
            if t.repos.is_empty() {
                self.targets.remove(&relay);
            } else {
                t.root_events = t
                    .repos
                    .iter()
                    .filter_map(|r| repo_index.get(r))
                    .flat_map(|n| n.layer3_ids().copied())
                    .collect();
            }
            changed.insert(relay);
        }
    }

    /// Moves `repo` from the relays `before` to the relays `now` in the per-relay targets.
    fn move_repo(
        &mut self,
        repo_index: &RepoSyncIndex,
        repo: &RepoRef,
        before: &[RelayUrl],
        now: &[RelayUrl],
        changed: &mut HashSet<RelayUrl>,
        shrunk: &mut HashSet<RelayUrl>,
    ) {
        let needs = &repo_index[repo];
        for relay in now.iter().filter(|r| !before.contains(r)) {
            add_repo_to(&mut self.targets, relay, repo, needs);
            if !changed.contains(relay) {
                changed.insert(relay.clone());
            }
        }
        for relay in before.iter().filter(|r| !now.contains(r)) {
            if let Some(t) = self.targets.get_mut(relay) {
                t.repos.remove(repo);
            }
            if !shrunk.contains(relay) {
                shrunk.insert(relay.clone());
            }
        }
    }
}

/// Adds `repo` with its root events to the target of `relay` (the URL is copied only for a
/// relay that had no target yet).
fn add_repo_to(
    targets: &mut HashMap<RelayUrl, RelaySyncNeeds>,
    relay: &RelayUrl,
    repo: &RepoRef,
    needs: &RepoSyncNeeds,
) {
    if !targets.contains_key(relay) {
        targets.insert(relay.clone(), RelaySyncNeeds::default());
    }
    if let Some(t) = targets.get_mut(relay) {
        t.repos.insert(repo.clone());
        t.root_events.extend(needs.layer3_ids().copied());
    }
}
