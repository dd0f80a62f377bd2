//! Bounded sets of recently seen events (oldest forgotten first): [`RecentIds`] for one
//! owner, [`VerifiedSet`] shared by every relay thread.

use std::collections::{HashMap, HashSet, VecDeque};

use nostr::event::EventId;
use nostr::event::Signature;
use parking_lot::Mutex;

/// Remembers at most `capacity` ids; inserting more forgets the oldest.
#[derive(Debug, Clone)]
pub struct RecentIds {
    set: HashSet<EventId>,
    order: VecDeque<EventId>,
    capacity: usize,
}

impl RecentIds {
    /// An empty set that keeps at most `capacity` ids (at least 1).
    pub fn new(capacity: usize) -> RecentIds {
        RecentIds {
            set: HashSet::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// True if `id` is remembered.
    pub fn contains(&self, id: &EventId) -> bool {
        self.set.contains(id)
    }

    /// Remembers `id`; returns false if it was already there.
    pub fn insert(&mut self, id: EventId) -> bool {
        if !self.set.insert(id) {
            return false;
        }
        self.order.push_back(id);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }

    /// Forgets `id`.
    pub fn remove(&mut self, id: &EventId) {
        if self.set.remove(id) {
            self.order.retain(|x| x != id);
        }
    }

    /// Number of remembered ids.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

/// Signature pairs remembered by default by [`VerifiedSet::default`] (about 150 bytes each:
/// some 10 MB when full).
pub const VERIFIED_REMEMBERED: usize = 65_536;

/// Shards of a [`VerifiedSet`] (each behind its own lock, chosen by the id's first byte).
pub const VERIFIED_SHARDS: usize = 16;

/// The `(id, signature)` pairs whose Schnorr signature was verified recently, shared by every
/// relay thread, so that a copy of an event (the same event from several relays, from
/// overlapping filters, or read back from the own relay) costs an id hash instead of a
/// signature check (≈ 30 µs).
///
/// Skipping the signature check of a copy is sound only after its id was recomputed from its
/// content: the id commits to the author's key and to everything signed, so a copy whose id
/// matches its content and whose `(id, signature)` pair was verified before carries exactly
/// the signed event. A copy with another signature for the same id is verified again.
///
/// Bounded: each of [`VERIFIED_SHARDS`] shards keeps at most `capacity / shards` (rounded
/// up) pairs and forgets its oldest first. Thread-safe: every call takes one shard's lock for
/// a hash-map operation only (never during a signature check), so two threads that check the
/// same new event at the same moment may both verify it; nothing is ever accepted unverified.
#[derive(Debug)]
pub struct VerifiedSet {
    shards: Box<[Mutex<VerifiedShard>]>,
    per_shard: usize,
}

#[derive(Debug, Default)]
struct VerifiedShard {
    sigs: HashMap<EventId, Signature>,
    order: VecDeque<EventId>,
}

impl Default for VerifiedSet {
    fn default() -> Self {
        VerifiedSet::new(VERIFIED_REMEMBERED)
    }
}

impl VerifiedSet {
    /// An empty set that keeps about `capacity` pairs (at least one per shard).
    pub fn new(capacity: usize) -> VerifiedSet {
        VerifiedSet::with_shards(capacity, VERIFIED_SHARDS)
    }

    /// An empty set of `shards` shards (at least 1) that keeps at most
    /// `ceil(capacity / shards)` pairs in each.
    pub fn with_shards(capacity: usize, shards: usize) -> VerifiedSet {
        let shards = shards.max(1);
        VerifiedSet {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            per_shard: capacity.div_ceil(shards).max(1),
        }
    }

    fn shard(&self, id: &EventId) -> &Mutex<VerifiedShard> {
        &self.shards[usize::from(id.as_bytes()[0]) % self.shards.len()]
    }

    /// True if this exact signature was verified for `id`.
    pub fn contains(&self, id: &EventId, sig: &Signature) -> bool {
        self.shard(id).lock().sigs.get(id) == Some(sig)
    }

    /// Remembers that `sig` verifies for `id` (replacing another signature remembered for
    /// it: an author may sign the same event twice). Returns false if the pair was known.
    pub fn insert(&self, id: EventId, sig: Signature) -> bool {
        let mut shard = self.shard(&id).lock();
        match shard.sigs.insert(id, sig) {
            Some(old) => old != sig,
            None => {
                shard.order.push_back(id);
                while shard.order.len() > self.per_shard {
                    if let Some(old) = shard.order.pop_front() {
                        shard.sigs.remove(&old);
                    }
                }
                true
            }
        }
    }

    /// Number of remembered pairs.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().sigs.len()).sum()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most pairs the set keeps.
    pub fn capacity(&self) -> usize {
        self.per_shard * self.shards.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_fifo() {
        let mut r = RecentIds::new(3);
        let id = |b: u8| EventId::from_byte_array([b; 32]);
        assert!(r.insert(id(1)));
        assert!(!r.insert(id(1)));
        r.insert(id(2));
        r.insert(id(3));
        r.insert(id(4));
        assert_eq!(r.len(), 3);
        assert!(!r.contains(&id(1)));
        assert!(r.contains(&id(4)));
        r.remove(&id(3));
        assert!(!r.contains(&id(3)));
        assert_eq!(r.len(), 2);
    }

    fn sig(b: u8) -> Signature {
        Signature::from_byte_array([b; 64])
    }

    #[test]
    fn verified_set_matches_id_and_signature() {
        let v = VerifiedSet::new(100);
        let id = EventId::from_byte_array([7; 32]);
        assert!(!v.contains(&id, &sig(1)));
        assert!(v.insert(id, sig(1)));
        assert!(!v.insert(id, sig(1)), "known pair");
        assert!(v.contains(&id, &sig(1)));
        assert!(
            !v.contains(&id, &sig(2)),
            "another signature for the same id"
        );
        assert!(!v.contains(&EventId::from_byte_array([8; 32]), &sig(1)));
        // A second valid signature for the id replaces the first without growing the set.
        assert!(v.insert(id, sig(2)));
        assert!(v.contains(&id, &sig(2)) && !v.contains(&id, &sig(1)));
        assert_eq!(v.len(), 1);
    }

    #[test]
    fn verified_set_is_bounded_and_forgets_the_oldest_first() {
        let v = VerifiedSet::with_shards(3, 1);
        let id = |b: u8| EventId::from_byte_array([b; 32]);
        for b in 1..=5 {
            v.insert(id(b), sig(b));
        }
        assert_eq!(v.len(), 3);
        assert!(!v.contains(&id(1), &sig(1)) && !v.contains(&id(2), &sig(2)));
        assert!((3..=5).all(|b| v.contains(&id(b), &sig(b))));
        // Sharded: every shard is bounded, so the whole set is.
        let v = VerifiedSet::with_shards(64, 16);
        assert_eq!(v.capacity(), 64);
        for n in 0..=255u8 {
            let mut bytes = [n; 32];
            bytes[1] = 0xee;
            v.insert(EventId::from_byte_array(bytes), sig(1));
        }
        assert_eq!(v.len(), 64);
        assert!(!v.is_empty());
        assert_eq!(VerifiedSet::default().capacity(), VERIFIED_REMEMBERED);
    }

    #[test]
    fn verified_set_is_shared_between_threads() {
        let v = std::sync::Arc::new(VerifiedSet::new(100_000));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let v = v.clone();
                std::thread::spawn(move || {
                    let mut fresh = 0;
                    // Every thread inserts the same 1,000 pairs and 1,000 of its own.
                    for n in 0..1_000u32 {
                        let mut shared = [0u8; 32];
                        shared[..4].copy_from_slice(&n.to_le_bytes());
                        let mut own = shared;
                        own[31] = t + 1;
                        if v.insert(EventId::from_byte_array(shared), sig(9)) {
                            fresh += 1;
                        }
                        v.insert(EventId::from_byte_array(own), sig(t));
                        assert!(v.contains(&EventId::from_byte_array(shared), &sig(9)));
                    }
                    fresh
                })
            })
            .collect();
        let fresh: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(
            fresh, 1_000,
            "each shared pair is new for exactly one thread"
        );
        assert_eq!(v.len(), 5_000);
    }
}
