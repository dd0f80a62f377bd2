//! `--shard I/N`: several instances beside one own relay split the remote relays by a
//! stable hash of the normalised URL ([`Shard`], [`fnv1a64`]).

use crate::shared::RelayUrl;

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
