//! Bounded sets of recently seen events (oldest forgotten first): [`RecentIds`] for one
//! owner, [`VerifiedSet`] shared by every relay thread.

use std::collections::{HashMap, HashSet, VecDeque};

use nostr::event::Signature;
use nostr::event::{Event, EventId};
use nostr::key::PublicKey;
use parking_lot::Mutex;

/// A [`HashMap`] keyed by event ids, hashed with [`IdHash`].
pub type IdMap<V> = HashMap<EventId, V, IdHash>;

/// A [`HashSet`] of event ids, hashed with [`IdHash`].
pub type IdSet = HashSet<EventId, IdHash>;

/// The hasher of the maps keyed by event ids on the per-event paths (the verified set, the
/// forward queue): a multiply-and-fold over the id's 8-byte words with a key drawn for each
/// map, about five multiplications for an id where std's SipHash-1-3 takes a few times
/// longer. The key keeps the hashes unknown outside the process, so that ids ground by a
/// stranger (an id is a SHA-256 the author can vary) cannot be aimed at one bucket; ids
/// received but not yet verified are only looked up, never inserted.
#[derive(Debug, Clone, Copy)]
pub struct IdHash {
    k0: u64,
    k1: u64,
}

impl Default for IdHash {
    /// Keys drawn from std's per-process random hash keys.
    fn default() -> Self {
        use std::hash::BuildHasher as _;
        let seed = std::collections::hash_map::RandomState::new();
        IdHash {
            k0: seed.hash_one(0x5eed_u64),
            // Odd, so that no word is multiplied away.
            k1: seed.hash_one(0xf01d_u64) | 1,
        }
    }
}

impl std::hash::BuildHasher for IdHash {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher {
            state: self.k0,
            k1: self.k1,
        }
    }
}

/// The hasher made by [`IdHash`].
#[derive(Debug, Clone)]
pub struct IdHasher {
    state: u64,
    k1: u64,
}

/// The 128-bit product of `a` and `b`, its halves xor-ed.
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
            self.state = fold(self.state ^ w, self.k1);
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            // The length in the top byte tells a short tail from zero bytes.
            let w = u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59);
            self.state = fold(self.state ^ w, self.k1);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.state = fold(self.state ^ n, self.k1);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        fold(self.state, self.k1.rotate_left(32))
    }
}

/// Remembers at most `capacity` ids; inserting more forgets the oldest.
#[derive(Debug, Clone)]
pub struct RecentIds {
    set: IdSet,
    order: VecDeque<EventId>,
    capacity: usize,
}

impl RecentIds {
    /// An empty set that keeps at most `capacity` ids (at least 1).
    #[must_use]
    pub fn new(capacity: usize) -> RecentIds {
        RecentIds {
            set: IdSet::default(),
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

/// Events remembered by default by [`VerifiedSet::default`] (about 290 bytes each with the
/// hash map's spare room: some 19 MB when full).
pub const VERIFIED_REMEMBERED: usize = 65_536;

/// Shards of a [`VerifiedSet`] (each behind its own lock, chosen by the id's first byte).
pub const VERIFIED_SHARDS: usize = 16;

/// SHA-256 of an event's JSON exactly as a relay sent it: two copies with the same digest
/// are the same bytes (SHA-256 is collision resistant: a relay that writes both texts cannot
/// make two with one digest), so they parse to the same event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawDigest([u8; 32]);

impl RawDigest {
    /// The digest of `raw` (about 1 µs for a 1 KB event with the SHA extensions, far less
    /// than recomputing the id, which serialises the event again before hashing it).
    pub fn of(raw: &str) -> RawDigest {
        use bitcoin_hashes::Hash as _;
        RawDigest(bitcoin_hashes::sha256::Hash::hash(raw.as_bytes()).to_byte_array())
    }
}

/// A verified signature as the [`VerifiedSet`] remembers it: the first 128 bits of its
/// SHA-256. Telling a remembered signature from another one for the same id needs no more:
/// the remembered one is the author's, so a forger must find another signature with its
/// digest, about 2^128 hashes (the first bytes of the signature itself would not do: they are
/// the nonce's point, which a forger chooses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SigDigest([u8; 16]);

impl SigDigest {
    fn of(sig: &Signature) -> SigDigest {
        SigDigest(digest128(sig.as_bytes()))
    }
}

/// The first 16 bytes of the SHA-256 of `bytes`.
fn digest128(bytes: &[u8]) -> [u8; 16] {
    use bitcoin_hashes::Hash as _;
    let full = bitcoin_hashes::sha256::Hash::hash(bytes).to_byte_array();
    let mut cut = [0u8; 16];
    cut.copy_from_slice(&full[..16]);
    cut
}

/// What paging needs to know of a verified event ([`crate::core::paging::PageStats`]): kept
/// with it in a [`VerifiedSet`], so that a copy recognised by its id alone
/// ([`VerifiedSet::forwarded_copy`]) is counted for its page without being parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventSummary {
    /// `created_at`, in seconds.
    pub created_at: u64,
    /// The event's kind.
    pub kind: u16,
    /// The event's author.
    pub pubkey: PublicKey,
    /// Its tags of the letters the engine's filters use ([`TagPrint`]), so that a copy is
    /// counted for a page only when it matches the page's tag conditions.
    pub tags: TagPrint,
}

impl EventSummary {
    /// The summary of `event`.
    pub fn of(event: &Event) -> EventSummary {
        EventSummary {
            created_at: event.created_at.as_secs(),
            kind: event.kind.as_u16(),
            pubkey: event.pubkey,
            tags: TagPrint::of(event),
        }
    }
}

/// The tag letters a [`TagPrint`] keeps: every letter the engine's filters name (`a`, `A`,
/// `q` for repositories, `e`, `E`, `q` for root events and threads, `d` for state events).
pub const PRINTED_TAGS: [u8; 6] = *b"aAdeEq";

/// At most this many tags are printed per event; an event with more is
/// [`TagPrint::overflowed`] (its copies are parsed and checked as before).
pub const TAG_PRINTS: usize = 6;

/// What a copy recognised by its id must match of its subscription's tag conditions
/// (issue 36): a 32-bit keyed hash of `(letter, value)` for each single-letter tag of the
/// event whose letter is one of [`PRINTED_TAGS`], at most [`TAG_PRINTS`] (28 bytes per
/// remembered event, in its map entry: 112 bytes with the key instead of 88).
///
/// Without it a relay could fill every page of a tag query with copies of public events
/// that do not match it (known ids are not parsed, decision 0066), and each page counted
/// as full made the engine ask for the next one. The hash is keyed per process
/// ([`std::hash::RandomState`]), so a relay cannot pick events whose hashes collide with a
/// filter's values; an accidental collision (about `values × tags / 2^32`) counts one
/// copy for a page it does not belong to, as before this check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TagPrint {
    hashes: [u32; TAG_PRINTS],
    /// Hashes in use; `u8::MAX`: more tags than [`TAG_PRINTS`].
    len: u8,
}

impl TagPrint {
    /// The print of `event`'s tags.
    pub fn of(event: &Event) -> TagPrint {
        let mut print = TagPrint::default();
        for tag in event.tags.iter() {
            let (Some(letter), Some(value)) = (tag.single_letter_tag(), tag.content()) else {
                continue;
            };
            let letter = letter.as_byte();
            if !PRINTED_TAGS.contains(&letter) {
                continue;
            }
            let len = usize::from(print.len);
            if len >= TAG_PRINTS {
                print.len = u8::MAX;
                break;
            }
            print.hashes[len] = TagPrint::hash(letter, value);
            print.len += 1;
        }
        print
    }

    /// The keyed hash of one tag.
    pub fn hash(letter: u8, value: &str) -> u32 {
        use std::hash::BuildHasher as _;
        static KEY: std::sync::LazyLock<std::hash::RandomState> =
            std::sync::LazyLock::new(std::hash::RandomState::new);
        KEY.hash_one((letter, value)) as u32
    }

    /// True when the event had more printable tags than [`TAG_PRINTS`]: nothing can be
    /// told of its tags.
    pub fn overflowed(&self) -> bool {
        self.len == u8::MAX
    }

    /// The hashes printed (empty when [`TagPrint::overflowed`]).
    pub fn hashes(&self) -> &[u32] {
        if self.overflowed() {
            &[]
        } else {
            &self.hashes[..usize::from(self.len)]
        }
    }
}

/// What a [`VerifiedSet`] knows about an event that arrived again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Known {
    /// Nothing: its id is not remembered, or with another signature.
    No,
    /// This `(id, signature)` pair was verified, but from other JSON bytes (another
    /// serialisation, or a forgery that reuses them): the id must be recomputed from the
    /// content before the copy is trusted.
    SameSignature,
    /// Byte for byte the JSON whose id and signature were verified (same [`RawDigest`]
    /// under this id): nothing needs checking again.
    SameBytes,
}

/// The events whose id and Schnorr signature were verified recently, shared by every relay
/// thread, so that a copy of an event (the same event from several relays, from overlapping
/// filters, or read back from the own relay) costs a SHA-256 of its bytes instead of a
/// signature check (≈ 30 µs) and an id check (≈ 3 µs).
///
/// Each remembered event keeps a 128-bit digest of its signature and the [`RawDigest`] of
/// the JSON that was verified (80 bytes per event with the id; the signature itself took
/// 64). A copy with the same digest is the same bytes, hence the same verified event.
/// A copy with other bytes and the same `(id, signature)` is trusted only after its id was
/// recomputed from its content: the id commits to the author's key and to everything signed,
/// so such a copy carries exactly the signed event. A copy with another signature for the
/// same id is verified again.
///
/// The set also records which events were handed to the forwarder
/// ([`VerifiedSet::claim_forward`]), so that only one copy of each is.
///
/// Bounded: each of [`VERIFIED_SHARDS`] shards keeps at most `capacity / shards` (rounded
/// up) events and forgets its oldest first. Thread-safe: every call takes one shard's lock for
/// a hash-map operation only (never during a signature check), so two threads that check the
/// same new event at the same moment may both verify it; nothing is ever accepted unverified.
#[derive(Debug)]
pub struct VerifiedSet {
    shards: Box<[Mutex<VerifiedShard>]>,
    per_shard: usize,
    keys: AuthorKeys,
    /// Counts hand-overs and confirmations ([`VerifiedSet::clock`]), wrapping.
    clock: std::sync::atomic::AtomicU32,
}

/// Authors' x-only public keys as parsed for the Schnorr check, at most
/// [`AUTHOR_KEYS`] of them (in 16 shards; a full shard is emptied). Parsing a key takes a
/// field square root, about a tenth of a signature check: the events of a sync come from far
/// fewer authors than events, so each key is parsed about once (issue 21).
#[derive(Debug)]
struct AuthorKeys {
    shards: Box<[Mutex<KeyShard>]>,
}

/// One shard of [`AuthorKeys`]: public key bytes to the parsed key.
type KeyShard = HashMap<[u8; 32], secp256k1::XOnlyPublicKey>;

/// Authors whose parsed keys are kept ([`VerifiedSet::verify_signature`]): 4,096, about
/// 400 KiB.
pub const AUTHOR_KEYS: usize = 4_096;

fn secp() -> &'static secp256k1::Secp256k1<secp256k1::VerifyOnly> {
    static SECP: std::sync::LazyLock<secp256k1::Secp256k1<secp256k1::VerifyOnly>> =
        std::sync::LazyLock::new(secp256k1::Secp256k1::verification_only);
    &SECP
}

impl AuthorKeys {
    fn new() -> AuthorKeys {
        AuthorKeys {
            shards: (0..16).map(|_| Mutex::default()).collect(),
        }
    }

    /// The parsed key of `pubkey` (`None`: not a valid x-only key).
    fn get(&self, pubkey: &nostr::key::PublicKey) -> Option<secp256k1::XOnlyPublicKey> {
        let bytes = pubkey.to_bytes();
        let shard = &self.shards[usize::from(bytes[0]) % self.shards.len()];
        if let Some(k) = shard.lock().get(&bytes) {
            return Some(*k);
        }
        let key = secp256k1::XOnlyPublicKey::from_byte_array(&bytes).ok()?;
        let mut map = shard.lock();
        if map.len() >= AUTHOR_KEYS / self.shards.len() {
            map.clear();
        }
        map.insert(bytes, key);
        Some(key)
    }
}

/// What a copy recognised by its id needs, kept in the hash map itself (112 bytes per entry
/// with its key, 24 of them the tag print of issue 36): a lookup of [`VerifiedSet::forwarded_copy`], made for most copies of a
/// historic sync, touches no other memory. Most of such a lookup's time is the wait for the
/// entry's memory; with entries of 184 bytes (signature and digest inside) a profile of the
/// historic bench put a quarter more time in it.
#[derive(Debug, Clone, Copy)]
struct Hot {
    summary: EventSummary,
    /// The forwarder generation (plus one, [`mark`]) this event was handed to; 0: not
    /// handed over. The [`STORED`] bit is set once the own relay confirmed holding it.
    forwarded: u32,
    /// Its [`Cold`] part in the shard's ring.
    slot: u32,
}

/// What only a copy that must be compared needs, in a ring in insertion order (so the oldest
/// is the next overwritten).
#[derive(Debug, Clone, Copy)]
struct Cold {
    id: EventId,
    sig: SigDigest,
    raw: RawDigest,
    /// [`VerifiedSet::clock`] when it was last handed over or confirmed stored.
    touched: [u8; 4],
}

#[derive(Debug, Default)]
struct VerifiedShard {
    events: IdMap<Hot>,
    ring: Vec<Cold>,
    /// The ring slot the next new event takes once the ring is full (the oldest).
    next: usize,
}

/// The claim mark of forwarder `generation`: its number plus one (0 is "not handed over"),
/// held at `STORED - 1` after two billion forwarder restarts.
fn mark(generation: u64) -> u32 {
    u32::try_from(generation.saturating_add(1))
        .unwrap_or(u32::MAX)
        .min(STORED - 1)
}

/// The bit of [`Hot::forwarded`] saying the own relay answered `OK` for the event (stored it
/// or had it) since it was handed over.
const STORED: u32 = 1 << 31;

impl VerifiedShard {
    fn cold(&self, hot: &Hot) -> &Cold {
        &self.ring[hot.slot as usize]
    }
}

/// What decides whether a checked event goes to the forwarder, shared by every relay thread:
/// the events verified recently ([`VerifiedSet`], which also remembers which were handed to
/// the forwarder) and the forwarder's *epoch*. A new forwarder starts with an empty queue, so
/// a hand-over claim made for an earlier one no longer means the event is on its way; the
/// epoch changes when a forwarder is started again, which voids every earlier claim.
#[derive(Debug, Default)]
pub struct ForwardGate {
    verified: VerifiedSet,
    epoch: std::sync::atomic::AtomicU64,
}

impl ForwardGate {
    /// A gate remembering up to `capacity` verified events.
    #[must_use]
    pub fn new(capacity: usize) -> ForwardGate {
        ForwardGate {
            verified: VerifiedSet::new(capacity),
            epoch: Default::default(),
        }
    }

    /// The verified set.
    pub fn verified(&self) -> &VerifiedSet {
        &self.verified
    }

    /// The current forwarder's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A new forwarder starts: earlier hand-over claims no longer count.
    pub fn new_epoch(&self) {
        self.epoch
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Default for VerifiedSet {
    fn default() -> Self {
        VerifiedSet::new(VERIFIED_REMEMBERED)
    }
}

impl VerifiedSet {
    /// An empty set that keeps about `capacity` events (at least one per shard).
    #[must_use]
    pub fn new(capacity: usize) -> VerifiedSet {
        VerifiedSet::with_shards(capacity, VERIFIED_SHARDS)
    }

    /// An empty set of `shards` shards (at least 1) that keeps at most
    /// `ceil(capacity / shards)` events in each.
    pub fn with_shards(capacity: usize, shards: usize) -> VerifiedSet {
        let shards = shards.max(1);
        VerifiedSet {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            // A ring slot is a `u32`.
            per_shard: capacity.div_ceil(shards).clamp(1, u32::MAX as usize),
            keys: AuthorKeys::new(),
            clock: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// `event`'s Schnorr signature checked against its id, as
    /// [`Event::verify_signature`](nostr::event::Event::verify_signature) does, with the
    /// author's x-only key parsed once per author ([`AUTHOR_KEYS`] kept). The id itself is
    /// not recomputed here.
    pub fn verify_signature(&self, event: &nostr::event::Event) -> bool {
        match self.keys.get(&event.pubkey) {
            Some(key) => secp()
                .verify_schnorr(
                    &secp256k1::schnorr::Signature::from_byte_array(*event.sig.as_bytes()),
                    event.id.as_bytes(),
                    &key,
                )
                .is_ok(),
            None => false,
        }
    }

    fn shard(&self, id: &EventId) -> &Mutex<VerifiedShard> {
        &self.shards[usize::from(id.as_bytes()[0]) % self.shards.len()]
    }

    /// What is known about an event with this id, signature and JSON digest.
    pub fn known(&self, id: &EventId, sig: &Signature, raw: &RawDigest) -> Known {
        let sig = &SigDigest::of(sig);
        let shard = self.shard(id).lock();
        let Some(hot) = shard.events.get(id) else {
            return Known::No;
        };
        match shard.cold(hot) {
            c if c.sig == *sig && c.raw == *raw => Known::SameBytes,
            c if c.sig == *sig => Known::SameSignature,
            _ => Known::No,
        }
    }

    /// True if this exact signature was verified for `id`.
    pub fn contains(&self, id: &EventId, sig: &Signature) -> bool {
        let sig = &SigDigest::of(sig);
        let shard = self.shard(id).lock();
        shard
            .events
            .get(id)
            .is_some_and(|hot| shard.cold(hot).sig == *sig)
    }

    /// Remembers that `sig` verifies for `id`, that the event's JSON had digest `raw` and
    /// what paging needs of it (replacing another signature remembered for it: an author may
    /// sign the same event twice). Returns false if the pair was known (its digest is then
    /// updated to `raw`).
    pub fn insert(
        &self,
        id: EventId,
        sig: Signature,
        raw: RawDigest,
        summary: EventSummary,
    ) -> bool {
        let sig = SigDigest::of(&sig);
        let mut guard = self.shard(&id).lock();
        let shard = &mut *guard;
        if let Some(hot) = shard.events.get_mut(&id) {
            let cold = &mut shard.ring[hot.slot as usize];
            let new = cold.sig != sig;
            if new {
                hot.forwarded = 0;
            }
            hot.summary = summary;
            cold.sig = sig;
            cold.raw = raw;
            return new;
        }
        let cold = Cold {
            id,
            sig,
            raw,
            touched: [0; 4],
        };
        let slot = if shard.ring.len() < self.per_shard {
            if shard.ring.len() == shard.ring.capacity() {
                // A quarter more, never past the bound: doubling left up to half the ring's
                // memory unused at a sync's peak.
                let len = shard.ring.len();
                shard
                    .ring
                    .reserve_exact((len / 4).max(16).min(self.per_shard - len));
            }
            shard.ring.push(cold);
            shard.ring.len() - 1
        } else {
            // Full: the oldest is forgotten and its slot reused.
            let slot = shard.next;
            shard.next = (slot + 1) % shard.ring.len();
            let old = std::mem::replace(&mut shard.ring[slot], cold);
            shard.events.remove(&old.id);
            slot
        };
        shard.events.insert(
            id,
            Hot {
                summary,
                forwarded: 0,
                slot: slot as u32,
            },
        );
        true
    }

    /// Claims the handing over of a remembered event to the forwarder of `generation` (the
    /// number of forwarder restarts so far): true for the first caller, false when it was
    /// already handed to this forwarder (the forwarder would drop the copy). An event that is
    /// not remembered (forgotten meanwhile) is always claimed. A restarted forwarder lost its
    /// queue, so a new generation claims again.
    pub fn claim_forward(&self, id: &EventId, generation: u64) -> bool {
        let mark = mark(generation);
        let mut guard = self.shard(id).lock();
        let shard = &mut *guard;
        match shard.events.get_mut(id) {
            Some(v) if v.forwarded & !STORED == mark => false,
            Some(v) => {
                v.forwarded = mark;
                shard.ring[v.slot as usize].touched = self.tick().to_le_bytes();
                true
            }
            None => true,
        }
    }

    /// The next [`VerifiedSet::clock`] reading.
    fn tick(&self) -> u32 {
        self.clock
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .wrapping_add(1)
    }

    /// A reading of the set's clock, which advances at every hand-over
    /// ([`VerifiedSet::claim_forward`]) and every confirmation ([`VerifiedSet::mark_stored`]):
    /// [`VerifiedSet::handed_over_since`] tells what happened after a reading.
    pub fn clock(&self) -> u32 {
        self.clock.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// True when `id` was handed to the forwarder of `generation` and is still in flight, or
    /// was handed over or confirmed stored after the clock read `since`
    /// ([`VerifiedSet::clock`]; readings less than 2^31 ticks apart compare right): the own
    /// relay's side of a reconciliation read at `since` could not have held it, so a fetch
    /// need not ask for it (decision 0112). False for what the own relay confirmed before
    /// `since` (it may have lost it since: decision 0061), for a released or forgotten
    /// event, and for one claimed by an earlier forwarder.
    pub fn handed_over_since(&self, id: &EventId, generation: u64, since: u32) -> bool {
        let mark = mark(generation);
        let shard = self.shard(id).lock();
        let Some(v) = shard.events.get(id) else {
            return false;
        };
        if v.forwarded & !STORED != mark {
            return false;
        }
        if v.forwarded & STORED == 0 {
            return true;
        }
        let touched = u32::from_le_bytes(shard.cold(v).touched);
        (touched.wrapping_sub(since) as i32) > 0
    }

    /// Records that the own relay answered `OK` for `id` (stored it, or had it): a claimed
    /// event is no longer in flight ([`VerifiedSet::in_flight_copy`]). Nothing for an event
    /// not handed over (or forgotten).
    pub fn mark_stored(&self, id: &EventId) {
        let mut guard = self.shard(id).lock();
        let shard = &mut *guard;
        if let Some(v) = shard.events.get_mut(id) {
            if v.forwarded != 0 && v.forwarded & STORED == 0 {
                v.forwarded |= STORED;
                shard.ring[v.slot as usize].touched = self.tick().to_le_bytes();
            }
        }
    }

    /// [`VerifiedSet::forwarded_copy`] for an event still in flight: handed to the forwarder
    /// of `generation` and not yet confirmed by the own relay's `OK`. A reconciliation's fetch
    /// forwards what it gets even when an earlier copy was stored (decision 0061: the own
    /// relay may have lost it), but a copy of an event the forwarder still holds would be
    /// dropped by it anyway, so the fetch's copy of it is dropped unread.
    pub fn in_flight_copy(&self, id: &EventId, generation: u64) -> Option<EventSummary> {
        let mark = mark(generation);
        match self.shard(id).lock().events.get(id) {
            Some(v) if v.forwarded == mark => Some(v.summary),
            _ => None,
        }
    }

    /// True when `id` was handed to the forwarder of `generation` and is still in flight or
    /// was confirmed by the own relay's `OK` since: a fetch that left it out as in flight
    /// needs nothing more for it. False when it was released (refused), claimed by an
    /// earlier forwarder, or forgotten.
    pub fn in_flight_or_stored(&self, id: &EventId, generation: u64) -> bool {
        let mark = mark(generation);
        self.shard(id)
            .lock()
            .events
            .get(id)
            .is_some_and(|v| v.forwarded & !STORED == mark)
    }

    /// A copy recognised by its id alone: when the event with this id was verified and
    /// already handed to the forwarder of `generation`, returns what paging needs of it, and
    /// the copy can be dropped unread. The copy's bytes are not looked at, so a forgery that
    /// reuses a forwarded id is dropped too, which is harmless: what the own relay stores
    /// under that id is the verified event (an id is the hash of the content), and the copy
    /// would not have been forwarded anyway. `None` (not remembered, not claimed, or claimed
    /// by an earlier forwarder) means: parse and check the copy as usual.
    pub fn forwarded_copy(&self, id: &EventId, generation: u64) -> Option<EventSummary> {
        let mark = mark(generation);
        match self.shard(id).lock().events.get(id) {
            Some(v) if v.forwarded & !STORED == mark => Some(v.summary),
            _ => None,
        }
    }

    /// What paging needs of the verified event `id` (its summary), whether or not it was
    /// forwarded; `None` when the set does not remember it.
    pub fn summary(&self, id: &EventId) -> Option<EventSummary> {
        self.shard(id).lock().events.get(id).map(|v| v.summary)
    }

    /// Releases a claim: the forwarder gave the event up (the own relay rejected it), so the
    /// next copy is handed over again (the forwarder decides whether to retry it).
    pub fn release_forward(&self, id: &EventId) {
        if let Some(v) = self.shard(id).lock().events.get_mut(id) {
            v.forwarded = 0;
        }
    }

    /// Number of remembered events.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().events.len()).sum()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most events the set keeps.
    pub fn capacity(&self) -> usize {
        self.per_shard * self.shards.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_check_as_nostr_checks_them_with_each_key_parsed_once() {
        use nostr::event::{EventBuilder, FinalizeEvent, Kind};
        let keys = nostr::key::Keys::generate();
        let set = VerifiedSet::new(16);
        let events: Vec<Event> = (0..3)
            .map(|i| {
                EventBuilder::new(Kind::TextNote, format!("n{i}"))
                    .finalize(&keys)
                    .unwrap()
            })
            .collect();
        for e in &events {
            assert!(e.verify_signature());
            assert!(set.verify_signature(e));
        }
        let parsed: usize = set.keys.shards.iter().map(|s| s.lock().len()).sum();
        assert_eq!(parsed, 1, "one author, one parsed key");
        // Another event's signature, or another author, fails as in nostr.
        let mut forged = events[0].clone();
        forged.sig = events[1].sig;
        assert!(!forged.verify_signature());
        assert!(!set.verify_signature(&forged));
        let mut other = events[0].clone();
        other.pubkey = nostr::key::Keys::generate().public_key();
        assert!(!set.verify_signature(&other));
        // Bytes that are no point on the curve (x = 5 has no y).
        let mut off_curve = events[0].clone();
        let mut x = [0u8; 32];
        x[31] = 5;
        off_curve.pubkey = PublicKey::from_byte_array(x);
        assert!(!off_curve.verify_signature());
        assert!(!set.verify_signature(&off_curve));
    }

    #[test]
    fn the_author_key_cache_is_bounded() {
        let cache = AuthorKeys::new();
        for _ in 0..(AUTHOR_KEYS * 2) {
            cache
                .get(&nostr::key::Keys::generate().public_key())
                .unwrap();
        }
        let kept: usize = cache.shards.iter().map(|s| s.lock().len()).sum();
        assert!(kept <= AUTHOR_KEYS, "{kept}");
    }

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

    fn raw(b: u8) -> RawDigest {
        RawDigest([b; 32])
    }

    fn summary(created_at: u64) -> EventSummary {
        EventSummary {
            created_at,
            kind: 1111,
            pubkey: nostr::key::Keys::parse(
                "0000000000000000000000000000000000000000000000000000000000000001",
            )
            .expect("key")
            .public_key(),
            tags: TagPrint::default(),
        }
    }

    #[test]
    fn verified_set_matches_id_and_signature() {
        let v = VerifiedSet::new(100);
        let id = EventId::from_byte_array([7; 32]);
        assert!(!v.contains(&id, &sig(1)));
        assert!(v.insert(id, sig(1), raw(0), summary(0)));
        assert!(!v.insert(id, sig(1), raw(0), summary(0)), "known pair");
        assert!(v.contains(&id, &sig(1)));
        assert!(
            !v.contains(&id, &sig(2)),
            "another signature for the same id"
        );
        assert!(!v.contains(&EventId::from_byte_array([8; 32]), &sig(1)));
        // A second valid signature for the id replaces the first without growing the set.
        assert!(v.insert(id, sig(2), raw(0), summary(0)));
        assert!(v.contains(&id, &sig(2)) && !v.contains(&id, &sig(1)));
        assert_eq!(v.len(), 1);
    }

    #[test]
    fn verified_set_tells_identical_bytes_from_a_reused_signature() {
        let v = VerifiedSet::new(100);
        let id = EventId::from_byte_array([7; 32]);
        let digest = RawDigest::of("{\"id\":\"07\"}");
        assert_eq!(digest, RawDigest::of("{\"id\":\"07\"}"));
        assert_ne!(digest, RawDigest::of("{\"id\": \"07\"}"));
        assert_eq!(v.known(&id, &sig(1), &digest), Known::No);
        v.insert(id, sig(1), digest, summary(0));
        assert_eq!(v.known(&id, &sig(1), &digest), Known::SameBytes);
        assert_eq!(v.known(&id, &sig(1), &raw(9)), Known::SameSignature);
        // The digest counts only with the signature it was verified with.
        assert_eq!(v.known(&id, &sig(2), &digest), Known::No);
        let other = EventId::from_byte_array([8; 32]);
        assert_eq!(v.known(&other, &sig(1), &digest), Known::No);
    }

    #[test]
    fn a_verified_event_is_claimed_for_the_forwarder_once_per_forwarder() {
        let v = VerifiedSet::new(100);
        let id = EventId::from_byte_array([7; 32]);
        v.insert(id, sig(1), raw(1), summary(0));
        assert!(v.claim_forward(&id, 0));
        assert!(!v.claim_forward(&id, 0), "a copy for the same forwarder");
        assert!(
            v.claim_forward(&id, 1),
            "a restarted forwarder lost its queue"
        );
        assert!(!v.claim_forward(&id, 1));
        // Given up by the forwarder (rejected): the next copy is handed over again.
        v.release_forward(&id);
        assert!(v.claim_forward(&id, 1));
        // A new signature for the id is a new event for the forwarder too.
        v.insert(id, sig(2), raw(2), summary(0));
        assert!(v.claim_forward(&id, 1));
        // Not remembered (never, or forgotten): always handed over.
        let unknown = EventId::from_byte_array([9; 32]);
        assert!(v.claim_forward(&unknown, 1) && v.claim_forward(&unknown, 1));
    }

    #[test]
    fn an_event_is_in_flight_from_its_claim_until_the_own_relay_confirms_it() {
        let v = VerifiedSet::new(100);
        let id = EventId::from_byte_array([7; 32]);
        v.insert(id, sig(1), raw(1), summary(42));
        v.mark_stored(&id);
        assert_eq!(v.in_flight_copy(&id, 0), None, "not handed over");
        assert!(v.claim_forward(&id, 0));
        assert_eq!(v.in_flight_copy(&id, 0), Some(summary(42)));
        assert_eq!(v.in_flight_copy(&id, 1), None, "another forwarder's claim");
        v.mark_stored(&id);
        assert_eq!(v.in_flight_copy(&id, 0), None, "confirmed by the own relay");
        // Stored is still forwarded: copies on history queries stay recognised, and the
        // same forwarder does not claim it again.
        assert_eq!(v.forwarded_copy(&id, 0), Some(summary(42)));
        assert!(!v.claim_forward(&id, 0));
        // A restarted forwarder claims it again: in flight once more.
        assert!(v.claim_forward(&id, 1));
        assert_eq!(v.in_flight_copy(&id, 1), Some(summary(42)));
        assert_eq!(v.forwarded_copy(&id, 0), None);
        // Given up: neither.
        v.release_forward(&id);
        assert_eq!(v.in_flight_copy(&id, 1), None);
        v.mark_stored(&id);
        assert_eq!(
            v.forwarded_copy(&id, 1),
            None,
            "stored without a claim is no claim"
        );
        // The mark saturates below the stored bit.
        assert!(v.claim_forward(&id, u64::MAX));
        assert_eq!(v.in_flight_copy(&id, u64::MAX), Some(summary(42)));
        v.mark_stored(&id);
        assert_eq!(v.forwarded_copy(&id, u64::MAX), Some(summary(42)));
    }

    #[test]
    fn a_copy_of_a_forwarded_event_is_known_by_its_id_with_what_paging_needs() {
        let v = VerifiedSet::new(100);
        let id = EventId::from_byte_array([7; 32]);
        assert_eq!(v.forwarded_copy(&id, 0), None, "never seen");
        v.insert(id, sig(1), raw(1), summary(42));
        assert_eq!(
            v.forwarded_copy(&id, 0),
            None,
            "verified but not handed over: this copy may be the one to forward"
        );
        assert!(v.claim_forward(&id, 0));
        assert_eq!(v.forwarded_copy(&id, 0), Some(summary(42)));
        assert_eq!(
            v.forwarded_copy(&id, 1),
            None,
            "a restarted forwarder lost its queue"
        );
        v.release_forward(&id);
        assert_eq!(v.forwarded_copy(&id, 0), None, "given up by the forwarder");
        assert!(v.claim_forward(&id, 0));
        v.insert(id, sig(2), raw(2), summary(43));
        assert_eq!(
            v.forwarded_copy(&id, 0),
            None,
            "another signature for the id is another event for the forwarder"
        );
        assert!(v.claim_forward(&id, 0));
        assert_eq!(v.forwarded_copy(&id, 0), Some(summary(43)));
    }

    #[test]
    fn verified_set_is_bounded_and_forgets_the_oldest_first() {
        let v = VerifiedSet::with_shards(3, 1);
        let id = |b: u8| EventId::from_byte_array([b; 32]);
        for b in 1..=5 {
            v.insert(id(b), sig(b), raw(0), summary(0));
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
            v.insert(EventId::from_byte_array(bytes), sig(1), raw(0), summary(0));
        }
        assert_eq!(v.len(), 64);
        assert!(!v.is_empty());
        assert_eq!(VerifiedSet::default().capacity(), VERIFIED_REMEMBERED);
    }

    #[test]
    fn id_hashes_are_keyed_per_map_and_spread_ids_that_differ_in_one_byte() {
        use std::hash::BuildHasher as _;
        let (a, b) = (IdHash::default(), IdHash::default());
        let id = EventId::from_byte_array([7; 32]);
        assert_eq!(a.hash_one(id), a.hash_one(id));
        assert_ne!(a.hash_one(id), b.hash_one(id), "another map, another key");
        // Ids that differ in one byte only, at the start, the middle or the end (as ground
        // ids might), still land in distinct buckets of a 4,096-bucket table (random
        // placement fills about 63 % of them) and in distinct top-7-bit tags.
        for at in [0, 8, 15, 16, 31] {
            let mut low = HashSet::new();
            let mut tags = HashSet::new();
            for n in 0..=255u8 {
                for m in 0..16u8 {
                    let mut bytes = [0u8; 32];
                    bytes[at] = n;
                    bytes[(at + 1) % 32] = m;
                    let h = a.hash_one(EventId::from_byte_array(bytes));
                    low.insert(h & 0xfff);
                    tags.insert(h >> 57);
                }
            }
            assert!(low.len() > 2_400, "byte {at}: {} buckets", low.len());
            assert_eq!(tags.len(), 128, "byte {at}");
        }
        // A short tail is not its zero-padded self.
        let mut h = a.build_hasher();
        std::hash::Hasher::write(&mut h, &[1, 2, 3]);
        let mut g = a.build_hasher();
        std::hash::Hasher::write(&mut g, &[1, 2, 3, 0]);
        assert_ne!(std::hash::Hasher::finish(&h), std::hash::Hasher::finish(&g));
    }

    #[test]
    fn a_lookup_by_id_touches_one_small_map_entry() {
        // `forwarded_copy` reads only the map entry: key and `Hot` within 112 bytes (88
        // before the tag print).
        assert!(std::mem::size_of::<(EventId, Hot)>() <= 112);
        // The ring's part: the id, the signature's 128-bit digest, the JSON's digest and
        // when it was last handed over or confirmed (decision 0112).
        assert_eq!(std::mem::size_of::<Cold>(), 84);
    }

    #[test]
    fn handed_over_since_tells_what_the_own_side_could_not_have_held() {
        // Decision 0112: a fetch leaves out what was handed over, or confirmed, after the own
        // relay's side was read; not what the own relay confirmed before (decision 0061).
        let v = VerifiedSet::with_shards(16, 1);
        let id = |b: u8| EventId::from_byte_array([b; 32]);
        for b in 1..=4 {
            v.insert(id(b), sig(b), raw(b), summary(u64::from(b)));
        }
        assert!(v.claim_forward(&id(1), 0));
        v.mark_stored(&id(1));
        assert!(v.claim_forward(&id(2), 0));
        let read = v.clock();
        assert!(
            !v.handed_over_since(&id(1), 0, read),
            "stored before the read"
        );
        assert!(
            v.handed_over_since(&id(2), 0, read),
            "in flight since before the read"
        );
        v.mark_stored(&id(2));
        assert!(
            v.handed_over_since(&id(2), 0, read),
            "stored after the read"
        );
        assert!(!v.handed_over_since(&id(3), 0, read), "never handed over");
        assert!(v.claim_forward(&id(3), 0));
        assert!(v.handed_over_since(&id(3), 0, read));
        assert!(
            !v.handed_over_since(&id(3), 1, read),
            "another forwarder's claim"
        );
        v.release_forward(&id(3));
        assert!(!v.handed_over_since(&id(3), 0, read), "released");
        assert!(!v.handed_over_since(&id(9), 0, read), "unknown");
        // Readings compare across the counter's wrap.
        v.clock
            .store(u32::MAX - 1, std::sync::atomic::Ordering::Relaxed);
        let read = v.clock();
        assert!(v.claim_forward(&id(4), 0));
        v.mark_stored(&id(4));
        assert!(v.handed_over_since(&id(4), 0, read));
        assert!(!v.handed_over_since(&id(4), 0, v.clock()));
    }

    #[test]
    fn a_full_shard_reuses_the_oldest_slot_and_keeps_every_other_event_whole() {
        let v = VerifiedSet::with_shards(3, 1);
        let id = |b: u8| EventId::from_byte_array([b; 32]);
        for b in 1..=3 {
            v.insert(id(b), sig(b), raw(b), summary(u64::from(b)));
        }
        assert!(v.claim_forward(&id(2), 0));
        // Updating a remembered event takes no slot.
        assert!(v.insert(id(3), sig(30), raw(30), summary(30)));
        assert_eq!(v.len(), 3);
        assert!(v.contains(&id(1), &sig(1)));
        // Two more: 1 and 2 (the oldest) are forgotten, 3 keeps its update.
        v.insert(id(4), sig(4), raw(4), summary(4));
        v.insert(id(5), sig(5), raw(5), summary(5));
        assert_eq!(v.len(), 3);
        assert_eq!(v.known(&id(1), &sig(1), &raw(1)), Known::No);
        assert_eq!(
            v.forwarded_copy(&id(2), 0),
            None,
            "forgotten with its claim"
        );
        assert_eq!(v.known(&id(3), &sig(30), &raw(30)), Known::SameBytes);
        assert_eq!(v.known(&id(4), &sig(4), &raw(4)), Known::SameBytes);
        assert_eq!(v.known(&id(5), &sig(5), &raw(9)), Known::SameSignature);
        assert!(v.claim_forward(&id(5), 0));
        assert_eq!(v.forwarded_copy(&id(5), 0), Some(summary(5)));
        // The ring grows to its bound, not past it.
        let v20 = VerifiedSet::with_shards(20, 1);
        for n in 0..30u8 {
            v20.insert(id(n), sig(n), raw(n), summary(0));
        }
        assert_eq!(v20.len(), 20);
        assert!(v20.shards[0].lock().ring.capacity() <= 20);
        // And round the ring again: 3 is now the oldest.
        v.insert(id(6), sig(6), raw(6), summary(6));
        assert!(!v.contains(&id(3), &sig(30)));
        assert!((4..=6).all(|b| v.contains(&id(b), &sig(b))));
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
                        if v.insert(EventId::from_byte_array(shared), sig(9), raw(0), summary(0)) {
                            fresh += 1;
                        }
                        v.insert(EventId::from_byte_array(own), sig(t), raw(0), summary(0));
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
