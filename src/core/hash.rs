//! Hash maps and sets with a fast, seeded hasher for the coordinator's and the sessions'
//! indexes (decision 0118).
//!
//! The standard library's SipHash-1-3 took about a quarter of the coordinator's CPU in a
//! first sync: the indexes are keyed by subscription ids, event ids and relay URLs, looked up
//! for every query a drain considers and every event a batch holds. `foldhash`'s fast hasher
//! is several times quicker on such short keys and, seeded at random per map, keeps keys an
//! outsider chooses (event ids, URLs) from aiming at one bucket.

/// A `HashMap` with [`foldhash::fast::RandomState`].
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A `HashSet` with [`foldhash::fast::RandomState`].
pub type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;
