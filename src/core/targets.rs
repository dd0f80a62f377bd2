//! Which relays carry which repositories and root events: the repository scope, the quotas
//! per pubkey and per announcement, `--shard`, the plan cache, and `derive_relay_targets` and
//! `compute_actions`, the single decision point for new Layer-2/3 subscriptions (a three-way
//! diff: target − pending − confirmed).

use std::collections::{HashMap, HashSet};

use nostr::event::EventId;
use nostr::filter::Filter;

use crate::core::filters::build_layer2_and_layer3_filters;
use crate::core::nip34::RepoRef;
use crate::core::state::{
    ConnectionStatus, PendingSyncIndex, RelaySyncIndex, RelaySyncNeeds, RepoSyncIndex,
    RepoSyncNeeds,
};
use crate::shared::RelayUrl;

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
            t.root_events.extend(needs.layer3_ids().copied());
        }
    }
    targets
}

/// Which repositories produce sync targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RepoScope {
    /// Every repository the own relay holds (`--archive`, or no `--public-url` given).
    All,
    /// Only repositories whose announcement lists one of these URLs of this service in its
    /// `relays` tag (GRASP-01). Root events of other repositories are not synced either.
    ListingService(Vec<RelayUrl>),
}

impl RepoScope {
    /// True when a repository whose announcement names `relays` is synced.
    pub fn admits<'a>(&self, mut relays: impl Iterator<Item = &'a RelayUrl>) -> bool {
        match self {
            RepoScope::All => true,
            RepoScope::ListingService(urls) => relays.any(|r| urls.contains(r)),
        }
    }

    /// A short name for logs and status: `all repositories` or `repositories listing …`.
    pub fn describe(&self) -> String {
        match self {
            RepoScope::All => "all repositories the own relay holds".to_string(),
            RepoScope::ListingService(urls) => {
                let names: Vec<&str> = urls.iter().map(|u| u.as_str()).collect();
                format!(
                    "repositories whose announcement lists {}",
                    names.join(" or ")
                )
            }
        }
    }
}

/// What may become a sync target: repository scope and the relay quotas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetPolicy {
    /// Which repositories are synced at all.
    pub scope: RepoScope,
    /// The most distinct relays the repositories of one announcing pubkey can make us sync
    /// from (default 64). A pubkey's relays are ranked by how many of its repositories name
    /// them, then by URL; the ones past the quota are dropped for that pubkey.
    pub max_relays_per_pubkey: usize,
    /// The most remote relays in total (default 1,000), `reserved` included. Filled by a
    /// round-robin across pubkeys (pubkeys with fewer relays first), so one key cannot take
    /// every slot.
    pub max_relays: usize,
    /// Relays that always hold a slot (the bootstrap relays): they count against
    /// `max_relays` first and are never dropped.
    pub reserved: Vec<RelayUrl>,
    /// Only relays of this shard become targets (`--shard I/N`). Applied after the
    /// selection, so every instance of a sharded fleet selects the same relays and keeps
    /// its own part of them.
    pub shard: Option<Shard>,
    /// Pubkeys (hex) the operator listed (`--prefer-pubkey`): their relays take the slots
    /// of the global cap before anyone else's.
    pub preferred_pubkeys: HashSet<String>,
    /// The most URLs of one host and port selected (default
    /// [`MAX_URLS_PER_HOST`]): URLs that differ only in path or query reach one relay.
    pub max_urls_per_host: usize,
    /// Relays whose last connect failed (the machine's record): they get the slots that
    /// relays not failing leave free, so one that never answers cannot hold a slot that a
    /// relay that might answer could use.
    pub failing: HashSet<RelayUrl>,
    /// Pubkeys whose repositories named [`MAX_REFUSALS_PER_PUBKEY`] relays that the
    /// address policy refused: none of their repositories is synced.
    pub blocked_pubkeys: HashSet<String>,
}

/// Default of [`TargetPolicy::max_urls_per_host`]: URLs of one host and port selected at
/// most.
pub const MAX_URLS_PER_HOST: usize = 4;

/// Refused relays named by one pubkey's repositories after which the pubkey is blocked
/// ([`TargetPolicy::blocked_pubkeys`]).
pub const MAX_REFUSALS_PER_PUBKEY: u32 = 16;

/// Refused URLs of one host and port after which every URL of it is excluded
/// ([`Exclusions::insert_host`]).
pub const MAX_REFUSALS_PER_HOST: u32 = 4;

/// `host:port` of a relay URL: what [`TargetPolicy::max_urls_per_host`] counts. The host
/// is spelled one way for every spelling that reaches one address without a name lookup
/// ([`canonical_host`]): `0x5db8d822`, `1572395042` and `93.184.216.34.` are one host.
pub fn host_port(url: &RelayUrl) -> String {
    format!("{}:{}", canonical_host(url.host()), url.port())
}

/// One spelling per host that resolves without DNS (issue 36, item 14): trailing dots
/// dropped, IPv4 in every form the system resolver takes (`inet_aton`: one to four parts,
/// each decimal, `0x` hex or `0` octal) as a dotted quad, IPv6 in its canonical form and an
/// IPv4-mapped IPv6 address as its IPv4 address. Names stay names: wildcard DNS can still
/// give one address many names (docs/security.md states the bound).
pub fn canonical_host(host: &str) -> String {
    let host = host.trim_end_matches('.');
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        if let Ok(v6) = inner.parse::<std::net::Ipv6Addr>() {
            return match v6.to_ipv4_mapped() {
                Some(v4) => v4.to_string(),
                None => format!("[{v6}]"),
            };
        }
        return host.to_string();
    }
    inet_aton(host).map_or_else(|| host.to_string(), |v4| v4.to_string())
}

/// `host` as the system resolver reads a numeric IPv4 address (`inet_aton`), if it is one.
fn inet_aton(host: &str) -> Option<std::net::Ipv4Addr> {
    let parts: Vec<&str> = host.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let mut values = Vec::with_capacity(parts.len());
    for p in &parts {
        let (digits, radix) = if let Some(h) = p.strip_prefix("0x").or(p.strip_prefix("0X")) {
            (h, 16)
        } else if p.len() > 1 && p.starts_with('0') {
            (&p[1..], 8)
        } else {
            (*p, 10)
        };
        if digits.is_empty() && radix != 16 {
            return None;
        }
        let v = if digits.is_empty() {
            0
        } else {
            u64::from_str_radix(digits, radix).ok()?
        };
        values.push(v);
    }
    let (last, head) = values.split_last()?;
    if head.iter().any(|&v| v > 255) {
        return None;
    }
    let last_bits = 32 - 8 * head.len() as u32;
    if *last >= 1u64 << last_bits {
        return None;
    }
    let mut n: u64 = 0;
    for (i, v) in head.iter().enumerate() {
        n |= v << (24 - 8 * i as u32);
    }
    Some(std::net::Ipv4Addr::from((n | last) as u32))
}

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
/// selection ([`tier`]) follows its busiest repository's. It changes only when a
/// repository's count reaches a power of two, when the machine runs the selection again
/// (while a cap binds).
pub fn activity(root_events: usize) -> u8 {
    if root_events == 0 {
        0
    } else {
        (1 + root_events.ilog2()).min(MAX_ACTIVITY as u32) as u8
    }
}

/// Relays that are never targets: the own relay under every name it was given, relays the
/// address policy refused, and every URL of a host refused [`MAX_REFUSALS_PER_HOST`]
/// times. A set: looking one up costs the same however many there are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exclusions {
    urls: HashSet<RelayUrl>,
    /// `host:port` ([`host_port`]) of which every URL is excluded.
    hosts: HashSet<String>,
}

impl Exclusions {
    /// No exclusion.
    pub fn new() -> Exclusions {
        Exclusions::default()
    }

    /// True when `url` is excluded (itself, or its host and port).
    pub fn contains(&self, url: &RelayUrl) -> bool {
        self.urls.contains(url) || (!self.hosts.is_empty() && self.hosts.contains(&host_port(url)))
    }

    /// Excludes `url`; false if it was already.
    pub fn insert(&mut self, url: RelayUrl) -> bool {
        self.urls.insert(url)
    }

    /// Excludes every URL of `host_port` (as [`host_port`] spells it); false if it was
    /// already.
    pub fn insert_host(&mut self, host_port: String) -> bool {
        self.hosts.insert(host_port)
    }

    /// Relay URLs excluded one by one.
    pub fn urls(&self) -> usize {
        self.urls.len()
    }

    /// Hosts excluded whole.
    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }
}

impl From<&[RelayUrl]> for Exclusions {
    fn from(urls: &[RelayUrl]) -> Exclusions {
        Exclusions {
            urls: urls.iter().cloned().collect(),
            hosts: HashSet::new(),
        }
    }
}

impl TargetPolicy {
    /// No scope and no quotas: every relay of every repository (the design's behaviour).
    pub fn unlimited() -> TargetPolicy {
        TargetPolicy {
            scope: RepoScope::All,
            max_relays_per_pubkey: usize::MAX,
            max_relays: usize::MAX,
            reserved: Vec::new(),
            shard: None,
            preferred_pubkeys: HashSet::new(),
            max_urls_per_host: usize::MAX,
            failing: HashSet::new(),
            blocked_pubkeys: HashSet::new(),
        }
    }
}

/// One shard of a fleet of instances beside the same own relay (`--shard I/N`): the relays
/// whose normalised URL hashes to `index` (0-based) of `count`, see [`Shard::owns`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This instance's shard, `0..count`.
    pub index: u64,
    /// How many instances split the relays.
    pub count: u64,
}

impl Shard {
    /// Parses `I/N` (0-based `I < N`, `N ≥ 1`).
    pub fn parse(s: &str) -> Result<Shard, String> {
        let (i, n) = s
            .split_once('/')
            .ok_or_else(|| format!("shard {s:?}: expected I/N, e.g. 0/2"))?;
        let index: u64 = i
            .trim()
            .parse()
            .map_err(|_| format!("shard {s:?}: I is not a number"))?;
        let count: u64 = n
            .trim()
            .parse()
            .map_err(|_| format!("shard {s:?}: N is not a number"))?;
        if count == 0 || index >= count {
            return Err(format!(
                "shard {s:?}: need 0 <= I < N (shards are numbered from 0)"
            ));
        }
        Ok(Shard { index, count })
    }

    /// The shard of `relay`: FNV-1a 64 of its normalised URL string, modulo `count`.
    pub fn of(relay: &RelayUrl, count: u64) -> u64 {
        fnv1a64(relay.as_str().as_bytes()) % count.max(1)
    }

    /// True when this shard syncs `relay`.
    pub fn owns(&self, relay: &RelayUrl) -> bool {
        Shard::of(relay, self.count) == self.index
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// FNV-1a, 64 bit (offset basis 0xcbf29ce484222325, prime 0x100000001b3): stable across
/// builds, platforms and versions, unlike the standard library's hasher.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
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
    /// Per-relay targets, as [`derive_relay_targets`] returns them, within the policy.
    pub targets: HashMap<RelayUrl, RelaySyncNeeds>,
    /// What was left out.
    pub report: TargetReport,
}

/// The repository scope and relay quotas of a [`SyncConfig`](crate::core::SyncConfig).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetLimits {
    /// Which repositories are synced (default: all).
    pub scope: RepoScope,
    /// Relays one announcing pubkey's repositories can make us sync from (default 64).
    pub max_relays_per_pubkey: usize,
    /// Relays read from one announcement (default
    /// [`MAX_RELAYS_PER_ANNOUNCEMENT`](crate::core::nip34::MAX_RELAYS_PER_ANNOUNCEMENT), 32).
    pub max_relays_per_announcement: usize,
    /// URLs of one host and port selected at most (default [`MAX_URLS_PER_HOST`]).
    pub max_urls_per_host: usize,
    /// Pubkeys (hex) whose repositories take relay slots first (`--prefer-pubkey`).
    pub preferred_pubkeys: HashSet<String>,
}

/// Default of [`TargetLimits::max_relays_per_pubkey`].
pub const MAX_RELAYS_PER_PUBKEY: usize = 64;

impl Default for TargetLimits {
    fn default() -> Self {
        TargetLimits {
            scope: RepoScope::All,
            max_relays_per_pubkey: MAX_RELAYS_PER_PUBKEY,
            max_relays_per_announcement: crate::core::nip34::MAX_RELAYS_PER_ANNOUNCEMENT,
            max_urls_per_host: MAX_URLS_PER_HOST,
            preferred_pubkeys: HashSet::new(),
        }
    }
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
    let mut repo_relays: HashMap<RepoRef, Vec<RelayUrl>> = HashMap::new();
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
fn select_each<'a>(
    repo_index: &'a RepoSyncIndex,
    excluded: &Exclusions,
    policy: &TargetPolicy,
    mut visit: impl FnMut(&'a RepoRef, &[&'a RelayUrl]),
) -> TargetReport {
    let mut report = TargetReport::default();
    // Relay URLs are interned to small ids for this pass (one hash per repository relay),
    // so every per-relay set below is a `Vec` indexed by id.
    let mut relay_ids: HashMap<&'a RelayUrl, u32> = HashMap::new();
    let mut urls: Vec<&'a RelayUrl> = Vec::new();
    // 1. Scope; group repositories by pubkey, each with its relays (minus `excluded`) as
    //    ids in one flat list.
    let mut key_ids: HashMap<&'a str, usize> = HashMap::new();
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
    let mut hosts: HashMap<String, usize> = HashMap::new();
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

/// [`derive_relay_targets`] within a [`TargetPolicy`]: [`select_targets`], then every
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
/// The result always equals a fresh [`derive_targets`] (checked in debug builds and by
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
        let mut by_key: HashMap<&str, Vec<&RepoRef>> = HashMap::new();
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
            failing: HashSet::new(),
            preferred_pubkeys: HashSet::new(),
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
        let mut count: HashMap<&RelayUrl, u32> = HashMap::new();
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
        let mut hosts: HashMap<String, usize> = HashMap::new();
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
        let mut targets: HashMap<RelayUrl, RelaySyncNeeds> = HashMap::new();
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

    /// The targets and report, as [`derive_targets`] returns them.
    pub fn into_targets(self) -> Targets {
        Targets {
            targets: self.targets,
            report: self.selection.report,
        }
    }

    /// Hosts (`host:port`) with more than one selected URL, most first (then by name): the
    /// per-host count that `max_urls_per_host` bounds.
    pub fn hosts_with_several_urls(&self) -> Vec<(String, usize)> {
        let mut hosts: HashMap<String, usize> = HashMap::new();
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
        let mut by_key: HashMap<&str, Vec<&RepoRef>> = HashMap::new();
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
        let mut changed_relays: HashSet<RelayUrl> = HashSet::new();
        let mut shrunk: HashSet<RelayUrl> = HashSet::new();
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
        let mut changed: HashSet<RelayUrl> = HashSet::new();
        let mut shrunk: HashSet<RelayUrl> = HashSet::new();
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
    compute_actions_for(targets.iter(), pending, confirmed)
}

/// [`compute_actions`] for some relays' targets only (the relays whose target changed).
pub fn compute_actions_for<'a>(
    targets: impl IntoIterator<Item = (&'a RelayUrl, &'a RelaySyncNeeds)>,
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
    #[test]
    fn spellings_of_one_address_are_one_host() {
        // Issue 36, item 14: the per-host cap counted host strings.
        let of = |u: &str| host_port(&RelayUrl::parse(u).unwrap());
        let one = of("ws://93.184.216.34");
        for u in [
            "ws://0x5db8d822",
            "ws://1572395042",
            "ws://93.184.216.34.",
            "ws://0135.0270.0330.042",
            "ws://93.0xb8.0330.34",
            "ws://93.12113954",
            "ws://[::ffff:5db8:d822]",
        ] {
            assert_eq!(of(u), one, "{u}");
        }
        assert_eq!(of("ws://Example.COM."), of("ws://example.com"));
        assert_eq!(of("ws://[0:0::1]"), of("ws://[::1]"));
        // Not addresses: names (no DNS here), and parts beyond what inet_aton takes.
        for u in [
            "ws://093.184.216.034",
            "ws://1.2.3.4.5",
            "ws://1.256.3.4",
            "ws://4294967296",
        ] {
            assert_ne!(of(u), one, "{u}");
        }
        assert_eq!(of("ws://4294967295"), of("ws://255.255.255.255"));
    }

    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use crate::core::state::{PendingBatch, PendingItems, RelayState};
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
                        ..RepoSyncNeeds::default()
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

    fn keyed_repo(key: u8, n: &str) -> RepoRef {
        format!("30617:{}:{n}", format!("{key:02x}").repeat(32))
    }
    fn keyed_index(entries: &[(u8, &str, &[&str], &[u8])]) -> RepoSyncIndex {
        entries
            .iter()
            .map(|(k, r, relays, ids)| {
                (
                    keyed_repo(*k, r),
                    RepoSyncNeeds {
                        relays: relays.iter().map(|u| url(u)).collect(),
                        root_events: ids.iter().map(|b| id(*b)).collect(),
                        announced_at: Some(1),
                        ..RepoSyncNeeds::default()
                    },
                )
            })
            .collect()
    }
    fn policy(scope: RepoScope, per_key: usize, max: usize) -> TargetPolicy {
        TargetPolicy {
            scope,
            max_relays_per_pubkey: per_key,
            max_relays: max,
            reserved: Vec::new(),
            shard: None,
            ..TargetPolicy::unlimited()
        }
    }

    #[test]
    fn scope_keeps_only_repositories_listing_the_service_with_their_root_events() {
        let idx = keyed_index(&[
            (1, "ours", &["wss://git.example", "wss://a"], &[1]),
            (2, "foreign", &["wss://b"], &[2]),
        ]);
        let own = [url("ws://127.0.0.1:1"), url("wss://git.example")];
        let scoped = policy(
            RepoScope::ListingService(own.to_vec()),
            usize::MAX,
            usize::MAX,
        );
        let t = derive_targets(&idx, &Exclusions::from(&own[..]), &scoped);
        assert_eq!(t.targets.len(), 1);
        let a = &t.targets[&url("wss://a")];
        assert_eq!(a.repos, [keyed_repo(1, "ours")].into());
        assert_eq!(
            a.root_events,
            [id(1)].into(),
            "root event 2 belongs to an out-of-scope repo"
        );
        assert_eq!(
            (t.report.repos_in_scope, t.report.repos_out_of_scope),
            (1, 1)
        );
        // --archive (or no --public-url): everything, as derive_relay_targets.
        let all = derive_targets(
            &idx,
            &Exclusions::from(&own[..]),
            &TargetPolicy::unlimited(),
        );
        assert_eq!(all.targets, derive_relay_targets(&idx, &own));
        assert_eq!(all.report.repos_out_of_scope, 0);
    }

    #[test]
    fn per_pubkey_quota_ranks_by_use_then_url() {
        // Key 1 names five relays; wss://e by two of its repos, so it ranks first.
        let idx = keyed_index(&[
            (1, "x", &["wss://a", "wss://b", "wss://e"], &[]),
            (1, "y", &["wss://c", "wss://d", "wss://e"], &[]),
            (2, "z", &["wss://d"], &[]),
        ]);
        let t = derive_targets(
            &idx,
            &Exclusions::new(),
            &policy(RepoScope::All, 2, usize::MAX),
        );
        let mut got: Vec<&str> = t.targets.keys().map(|u| u.as_str()).collect();
        got.sort();
        // Key 1 keeps e (2 uses) and a (first by URL); key 2 keeps d.
        assert_eq!(got, vec!["wss://a", "wss://d", "wss://e"]);
        // d is a target for key 2's repository only: key 1 is over its quota there.
        assert_eq!(
            t.targets[&url("wss://d")].repos,
            [keyed_repo(2, "z")].into()
        );
        assert_eq!(t.report.pubkeys_over_quota, 1);
        // b and c are dropped (d is still wanted by key 2).
        assert_eq!(t.report.relays_over_pubkey_quota, 2);
        assert_eq!(t.report.relays_wanted, 5);
        assert_eq!(t.report.relays_selected, 3);
    }

    #[test]
    fn global_cap_is_shared_round_robin_and_reserved_relays_come_first() {
        // A junk key with 40 relays and two legitimate keys with one and two relays.
        let junk: Vec<String> = (0..40)
            .map(|i| format!("wss://junk{i:02}.example"))
            .collect();
        let junk_refs: Vec<&str> = junk.iter().map(|s| s.as_str()).collect();
        let idx = keyed_index(&[
            (9, "spam", &junk_refs, &[]),
            (1, "a", &["wss://zz-legit.example"], &[]),
            (
                2,
                "b",
                &["wss://zz-two.example", "wss://zz-three.example"],
                &[],
            ),
        ]);
        let mut p = policy(RepoScope::All, 64, 6);
        let t = derive_targets(&idx, &Exclusions::new(), &p);
        assert_eq!(t.targets.len(), 6);
        for legit in [
            "wss://zz-legit.example",
            "wss://zz-two.example",
            "wss://zz-three.example",
        ] {
            assert!(t.targets.contains_key(&url(legit)), "{legit} must be kept");
        }
        assert_eq!(t.report.relays_over_global_cap, 37);
        // A reserved (bootstrap) relay takes a slot first.
        p.reserved = vec![url("wss://boot.example")];
        let t = derive_targets(&idx, &Exclusions::new(), &p);
        assert_eq!(t.targets.len(), 5);
        assert!(t.targets.contains_key(&url("wss://zz-legit.example")));
        // Deterministic: the same input gives the same targets.
        let again = derive_targets(
            &idx.clone().into_iter().collect::<RepoSyncIndex>(),
            &Exclusions::new(),
            &p,
        );
        assert_eq!(again.targets, t.targets);
        // Cap zero: nothing.
        assert!(
            derive_targets(&idx, &Exclusions::new(), &policy(RepoScope::All, 64, 0))
                .targets
                .is_empty()
        );
    }

    #[test]
    fn own_urls_never_count_against_a_quota() {
        let idx = keyed_index(&[(1, "x", &["wss://own", "wss://a"], &[])]);
        let t = derive_targets(
            &idx,
            &Exclusions::from(&[url("wss://own")][..]),
            &policy(RepoScope::All, 1, 1),
        );
        assert_eq!(t.targets.keys().collect::<Vec<_>>(), vec![&url("wss://a")]);
        assert_eq!(t.report.pubkeys_over_quota, 0);
    }

    #[test]
    fn fnv1a64_matches_the_published_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn shard_parse_is_zero_based_and_checked() {
        assert_eq!(Shard::parse("0/2"), Ok(Shard { index: 0, count: 2 }));
        assert_eq!(Shard::parse("2/3"), Ok(Shard { index: 2, count: 3 }));
        assert_eq!(Shard::parse("0/1").unwrap().to_string(), "0/1");
        for bad in ["2/2", "1/0", "x/2", "1", "", "-1/2"] {
            assert!(Shard::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn shards_partition_the_relays_by_the_normalised_url() {
        let relays: Vec<RelayUrl> = (0..300)
            .map(|i| url(&format!("wss://relay{i}.example")))
            .collect();
        for n in 1..=5u64 {
            let shards: Vec<Shard> = (0..n).map(|index| Shard { index, count: n }).collect();
            let mut sizes = vec![0usize; n as usize];
            for r in &relays {
                let owners: Vec<&Shard> = shards.iter().filter(|s| s.owns(r)).collect();
                assert_eq!(
                    owners.len(),
                    1,
                    "{r} must belong to exactly one of {n} shards"
                );
                sizes[owners[0].index as usize] += 1;
            }
            // Roughly even: no shard gets less than half its share.
            for size in sizes {
                assert!(size * 2 * n as usize >= relays.len(), "{n} shards: {size}");
            }
        }
        // The hash is of the normalised URL: spellings of one relay land together.
        let a = url("WSS://Relay7.Example:443/");
        assert_eq!(a, url("wss://relay7.example"));
        assert_eq!(Shard::of(&a, 7), Shard::of(&url("wss://relay7.example"), 7));
        assert_eq!(Shard::of(&a, 7), fnv1a64(a.as_str().as_bytes()) % 7);
    }

    #[test]
    fn sharded_targets_split_the_unsharded_ones_exactly() {
        let relays: Vec<String> = (0..12).map(|i| format!("wss://s{i}.example")).collect();
        let r: Vec<&str> = relays.iter().map(|s| s.as_str()).collect();
        let idx = keyed_index(&[
            (1, "x", &r[0..5], &[1]),
            (2, "y", &r[3..9], &[2]),
            (3, "z", &r[6..12], &[3]),
        ]);
        let base = policy(RepoScope::All, 4, 7);
        let all = derive_targets(&idx, &Exclusions::new(), &base);
        let mut union: HashMap<RelayUrl, RelaySyncNeeds> = HashMap::new();
        for index in 0..3 {
            let mut p = base.clone();
            p.shard = Some(Shard { index, count: 3 });
            let part = derive_targets(&idx, &Exclusions::new(), &p);
            assert_eq!(
                part.report.relays_selected + part.report.relays_other_shards,
                all.report.relays_selected
            );
            for (relay, t) in part.targets {
                assert!(Shard { index, count: 3 }.owns(&relay));
                assert!(union.insert(relay, t).is_none(), "shards overlap");
            }
        }
        assert_eq!(union, all.targets);
    }

    /// The selection as it was written before relay URLs were interned (issue 10): a
    /// reference for [`select_each`], with the same visit order contract ignored (the
    /// results are compared as maps).
    fn reference_select(
        repo_index: &RepoSyncIndex,
        excluded: &Exclusions,
        policy: &TargetPolicy,
        mut visit: impl FnMut(&RepoRef, &[&RelayUrl]),
    ) -> TargetReport {
        let mut report = TargetReport::default();
        // 1. Scope; group repositories by pubkey (sorted for determinism).
        let mut by_key: BTreeMap<&str, Vec<&RepoRef>> = BTreeMap::new();
        for (repo, needs) in repo_index {
            if needs.relays.is_empty() {
                continue;
            }
            if !policy.scope.admits(needs.relays.iter()) {
                report.repos_out_of_scope += 1;
                continue;
            }
            report.repos_in_scope += 1;
            by_key.entry(repo_pubkey(repo)).or_default().push(repo);
        }
        // 2. Per-pubkey quota.
        let mut allowed: Vec<(&str, Vec<&RelayUrl>)> = Vec::new();
        let mut wanted: BTreeSet<&RelayUrl> = BTreeSet::new();
        let mut over_quota: BTreeSet<&RelayUrl> = BTreeSet::new();
        for (key, repos) in &by_key {
            let mut count: BTreeMap<&RelayUrl, usize> = BTreeMap::new();
            for repo in repos {
                for relay in &repo_index[*repo].relays {
                    if !excluded.contains(relay) {
                        *count.entry(relay).or_default() += 1;
                    }
                }
            }
            let mut ranked: Vec<(&RelayUrl, usize)> = count.into_iter().collect();
            ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
            wanted.extend(ranked.iter().map(|(r, _)| *r));
            if ranked.len() > policy.max_relays_per_pubkey {
                report.pubkeys_over_quota += 1;
                over_quota.extend(
                    ranked[policy.max_relays_per_pubkey..]
                        .iter()
                        .map(|(r, _)| *r),
                );
                ranked.truncate(policy.max_relays_per_pubkey);
            }
            allowed.push((key, ranked.into_iter().map(|(r, _)| r).collect()));
        }
        // 3. Global cap: reserved relays first, then a fair round-robin across pubkeys.
        let mut selected: HashSet<&RelayUrl> = HashSet::new();
        let mut slots = policy.max_relays.saturating_sub(policy.reserved.len());
        for r in &policy.reserved {
            if wanted.contains(r) {
                selected.insert(r);
            }
        }
        allowed.sort_by(|a, b| a.1.len().cmp(&b.1.len()).then_with(|| a.0.cmp(b.0)));
        let mut cursors = vec![0usize; allowed.len()];
        let mut progress = true;
        while slots > 0 && progress {
            progress = false;
            for (i, (_, relays)) in allowed.iter().enumerate() {
                if slots == 0 {
                    break;
                }
                while cursors[i] < relays.len() && selected.contains(relays[cursors[i]]) {
                    cursors[i] += 1;
                }
                if let Some(r) = relays.get(cursors[i]) {
                    selected.insert(r);
                    cursors[i] += 1;
                    slots -= 1;
                    progress = true;
                }
            }
        }
        let within_quota: HashSet<&RelayUrl> = allowed
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .collect();
        report.relays_wanted = wanted.len();
        report.relays_over_pubkey_quota = over_quota
            .iter()
            .filter(|r| !within_quota.contains(*r))
            .count();
        report.relays_over_global_cap = within_quota
            .iter()
            .filter(|r| !selected.contains(*r))
            .count();
        // 4. Each repository's target relays: selected, within its pubkey's quota and (when
        //    sharded) of this instance's shard.
        let mut other_shards: HashSet<&RelayUrl> = HashSet::new();
        let mut mine: Vec<&RelayUrl> = Vec::new();
        for (key, relays) in &allowed {
            let quota: HashSet<&RelayUrl> = relays
                .iter()
                .copied()
                .filter(|r| selected.contains(*r))
                .collect();
            for repo in &by_key[key] {
                mine.clear();
                for relay in &repo_index[*repo].relays {
                    if !quota.contains(relay) {
                        continue;
                    }
                    if policy.shard.is_some_and(|s| !s.owns(relay)) {
                        other_shards.insert(relay);
                        continue;
                    }
                    mine.push(relay);
                }
                mine.sort();
                visit(repo, &mine);
            }
        }
        report.relays_other_shards = other_shards.len();
        report
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 300, ..Default::default() })]

        /// `select_targets` (ids, `Vec`-indexed sets) selects exactly what the straightforward
        /// version with `BTreeMap`s of URLs selects, report included, under every quota, cap,
        /// reserved relay, shard, scope and excluded own relay.
        #[test]
        fn interned_selection_equals_the_reference(
            repos in proptest::collection::vec(
                (0u8..4, proptest::collection::vec(0usize..10, 0..5)), 0..14),
            per_key in 0usize..5,
            max in 0usize..9,
            reserved in proptest::option::of(0usize..10),
            shard in proptest::option::of(0u64..3),
            listing in proptest::option::of(0usize..10),
            excluded_own in proptest::bool::ANY,
        ) {
            let relay = |i: usize| url(&format!("wss://p{i}.example"));
            let mut idx = RepoSyncIndex::new();
            for (n, (key, relays)) in repos.iter().enumerate() {
                idx.insert(
                    keyed_repo(*key, &format!("r{n}")),
                    RepoSyncNeeds {
                        relays: relays.iter().map(|i| relay(*i)).collect(),
                        root_events: HashSet::new(),
                        announced_at: Some(1),
                        ..RepoSyncNeeds::default()
                    },
                );
            }
            let excluded: Vec<RelayUrl> = if excluded_own { vec![relay(0)] } else { Vec::new() };
            let p = TargetPolicy {
                scope: listing.map_or(RepoScope::All, |i| RepoScope::ListingService(vec![relay(i)])),
                max_relays_per_pubkey: per_key,
                max_relays: max,
                reserved: reserved.into_iter().map(relay).collect(),
                shard: shard.map(|index| Shard { index, count: 3 }),
                ..TargetPolicy::unlimited()
            };
            let excluded = Exclusions::from(excluded.as_slice());
            let got = select_targets(&idx, &excluded, &p);
            let mut want: HashMap<RepoRef, Vec<RelayUrl>> = HashMap::new();
            let report = reference_select(&idx, &excluded, &p, |repo, mine| {
                if !mine.is_empty() {
                    want.insert(repo.clone(), mine.iter().map(|r| (*r).clone()).collect());
                }
            });
            proptest::prop_assert_eq!(got.report, report);
            proptest::prop_assert_eq!(got.repo_relays, want);
        }
    }
}
