//! What may become a sync target: the repository scope, the relays never synced from
//! ([`Exclusions`]), one spelling per host ([`host_port`], [`canonical_host`]), and the
//! scope and quotas of a selection ([`TargetPolicy`], [`TargetLimits`]).

use crate::core::hash::HashSet;

use crate::shared::RelayUrl;

use super::Shard;

/// Which repositories produce sync targets.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
            hosts: HashSet::default(),
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
            preferred_pubkeys: HashSet::default(),
            max_urls_per_host: usize::MAX,
            failing: HashSet::default(),
            blocked_pubkeys: HashSet::default(),
        }
    }
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
            preferred_pubkeys: HashSet::default(),
        }
    }
}
