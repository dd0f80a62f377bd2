//! What the own relay's events tag, approximately (decision 0120): a Bloom filter of the
//! `a`, `A`, `e`, `E` and `q` values of every event the self-subscription delivered.
//!
//! A history query of a relay that speaks NIP-77 is reconciled after the own relay's side
//! of it is read: one REQ to the own relay per query, answered one after another on its
//! one connection. In a first sync nine in ten such reads found nothing (a batch's queries
//! ask for the replies of root events just learned), and they, not the remote relays, set
//! the pace: the pool bench's repositories on one relay took 45 s, of which 35 s were
//! such reads. The self-subscription reads every event the own relay holds (history, then
//! live), so the machine can tell without a read that no event there tags any of a
//! query's values; the query is then the one REQ it would have been after the read.
//!
//! The index may be wrong only in ways that cost bytes, never events: a value it holds by
//! a collision sends the query through the own read as before; an event it has not seen
//! yet (stored while its echo is on the way, or by a self-subscription read that ended
//! incomplete) makes the query a REQ that reads that event again as a copy. It answers
//! only after the self-subscription has read the own relay's stored events to their end
//! on the current connection ([`OwnTags::set_complete`]); before, every query is read.

use nostr::event::Event;
use nostr::filter::Filter;
use std::hash::BuildHasher;

/// The tag letters the index holds: those of the queries a batch reconciles (Layer 2:
/// `a`, `A`, `q` of repositories; Layer 3: `e`, `E`, `q` of root events and members).
const INDEXED: [u8; 5] = [b'a', b'A', b'e', b'E', b'q'];
/// The tags an event id is asked under (Layer 3).
const ID_LETTERS: [u8; 3] = [b'e', b'E', b'q'];
/// The tags a repository coordinate is asked under (Layer 2).
const REPO_LETTERS: [u8; 3] = [b'a', b'A', b'q'];

/// Bits of the filter: 2^23 (1 MiB, allocated zeroed, so pages are resident only once
/// written). With 4 probes, 200,000 values give a false positive in 1 of 12,000 lookups
/// and 2,000,000 values in 1 of 6; past that the index answers "may hold" more and more
/// often, which only brings back the own read of each query.
const BITS: usize = 1 << 23;
/// Bits set per value.
const PROBES: u64 = 4;

/// A Bloom filter of the indexed tag values of the own relay's events.
#[derive(Debug, Default)]
pub(super) struct OwnTags {
    /// Allocated with the first value.
    bits: Option<Box<[u64]>>,
    /// Seeded per process: the values come from strangers' events.
    hasher: foldhash::fast::RandomState,
    /// The self-subscription has read every stored event on the current connection.
    complete: bool,
}

impl OwnTags {
    /// Records the indexed tags of `event`, an event the own relay holds.
    pub(super) fn insert_event(&mut self, event: &Event) {
        for tag in event.tags.iter() {
            let (Some(letter), Some(value)) = (tag.single_letter_tag(), tag.content()) else {
                continue;
            };
            let letter = letter.as_byte();
            if INDEXED.contains(&letter) {
                self.insert(letter, value);
            }
        }
    }

    /// Records the indexed tag values `filter` asks for, under every tag such a value is
    /// asked under (an event id: `e`, `E`, `q`; anything else, a repository coordinate: `a`,
    /// `A`, `q`): a query sent as one REQ because the own relay held nothing for it is about
    /// to bring events that tag them, so the same values asked again (of another relay, or
    /// under another tag: a comment tags its root with both `e` and `E`) go through the own
    /// read and a reconciliation against what has arrived by then, instead of a second REQ
    /// reading every event again.
    pub(super) fn insert_query(&mut self, filter: &Filter) {
        for (tag, values) in &filter.generic_tags {
            if !INDEXED.contains(&tag.as_byte()) {
                continue;
            }
            for v in values {
                let is_id = crate::core::message::hex_id(v.as_bytes()).is_some();
                for letter in if is_id { ID_LETTERS } else { REPO_LETTERS } {
                    self.insert(letter, v);
                }
            }
        }
    }

    fn insert(&mut self, letter: u8, value: &str) {
        let probes = self.probes(letter, value);
        let bits = self
            .bits
            .get_or_insert_with(|| vec![0u64; BITS / 64].into_boxed_slice());
        for bit in probes {
            bits[bit / 64] |= 1 << (bit % 64);
        }
    }

    fn may_hold(&self, letter: u8, value: &str) -> bool {
        let Some(bits) = &self.bits else {
            return false;
        };
        self.probes(letter, value)
            .into_iter()
            .all(|bit| bits[bit / 64] & (1 << (bit % 64)) != 0)
    }

    /// The bits of one value (double hashing from one 64-bit hash).
    fn probes(&self, letter: u8, value: &str) -> [usize; PROBES as usize] {
        let h = self.hasher.hash_one((letter, value));
        let (h1, h2) = (h & 0xffff_ffff, (h >> 32) | 1);
        let mut out = [0usize; PROBES as usize];
        for (i, slot) in (0..PROBES).zip(out.iter_mut()) {
            *slot = (h1.wrapping_add(i.wrapping_mul(h2)) % BITS as u64) as usize;
        }
        out
    }

    /// False when the own relay surely holds no event matching `filter`: one of its
    /// indexed tag conditions names only values no event read from it carries (every
    /// other condition only narrows the answer). True while the index is not complete.
    pub(super) fn may_match(&self, filter: &Filter) -> bool {
        if !self.complete {
            return true;
        }
        for (tag, values) in &filter.generic_tags {
            let letter = tag.as_byte();
            if INDEXED.contains(&letter) && !values.iter().any(|v| self.may_hold(letter, v)) {
                return false;
            }
        }
        true
    }

    /// The self-subscription has read (`true`) the own relay's stored events to their end,
    /// or (`false`) a new connection's read begins.
    pub(super) fn set_complete(&mut self, complete: bool) {
        self.complete = complete;
    }

    /// Whether the index answers for the own relay ([`OwnTags::set_complete`]).
    #[cfg(test)]
    pub(super) fn is_complete(&self) -> bool {
        self.complete
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    use nostr::filter::SingleLetterTag;
    use nostr::key::Keys;

    fn event(tags: &[[&str; 2]]) -> Event {
        let mut b = EventBuilder::new(Kind::Custom(1111), "x");
        for t in tags {
            b = b.tag(Tag::parse(*t).unwrap());
        }
        b.finalize(&Keys::generate()).unwrap()
    }

    fn tagged(letter: char, values: &[&str]) -> Filter {
        Filter::new().custom_tags(
            SingleLetterTag::from_char(letter).unwrap(),
            values.iter().map(|v| v.to_string()),
        )
    }

    const ROOT: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const OTHER: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    #[test]
    fn a_query_of_values_no_event_tags_cannot_match_once_the_index_is_complete() {
        let mut t = OwnTags::default();
        t.insert_event(&event(&[["E", ROOT], ["a", "30617:pk:repo"]]));
        // Not complete: every query may match.
        assert!(t.may_match(&tagged('E', &[OTHER])));
        t.set_complete(true);
        assert!(t.may_match(&tagged('E', &[ROOT])));
        assert!(t.may_match(&tagged('E', &[OTHER, ROOT])));
        assert!(!t.may_match(&tagged('E', &[OTHER])));
        // The letter counts: ROOT is tagged with `E`, not `e` or `q`.
        assert!(!t.may_match(&tagged('e', &[ROOT])));
        assert!(!t.may_match(&tagged('q', &[ROOT])));
        assert!(t.may_match(&tagged('a', &["30617:pk:repo"])));
        assert!(!t.may_match(&tagged('a', &["30617:pk:other"])));
        // Other conditions only narrow: still no match.
        assert!(!t.may_match(
            &tagged('E', &[OTHER])
                .kind(Kind::Custom(1111))
                .since(nostr::types::Timestamp::from_secs(1))
        ));
        // A query without an indexed tag may always match.
        assert!(t.may_match(&Filter::new().kind(Kind::Custom(30617))));
        assert!(t.may_match(&tagged('d', &["repo"])));
        // A new connection's read: every query may match again until it ends.
        t.set_complete(false);
        assert!(t.may_match(&tagged('E', &[OTHER])));
    }

    #[test]
    fn a_query_sent_as_one_req_makes_its_values_count_under_every_tag() {
        let mut t = OwnTags::default();
        t.set_complete(true);
        t.insert_query(&tagged('e', &[ROOT]).since(nostr::types::Timestamp::from_secs(5)));
        // An id counts under the tags ids are asked under, a coordinate under those of
        // coordinates.
        for letter in ['e', 'E', 'q'] {
            assert!(t.may_match(&tagged(letter, &[ROOT])), "{letter}");
        }
        assert!(!t.may_match(&tagged('a', &[ROOT])));
        t.insert_query(&tagged('A', &["30617:pk:repo"]));
        for letter in ['a', 'A', 'q'] {
            assert!(t.may_match(&tagged(letter, &["30617:pk:repo"])), "{letter}");
        }
        assert!(!t.may_match(&tagged('e', &["30617:pk:repo"])));
        assert!(!t.may_match(&tagged('E', &[OTHER])));
        // Tags the index does not hold are not inserted.
        t.insert_query(&tagged('d', &[OTHER]));
        assert!(!t.may_match(&tagged('E', &[OTHER])));
    }

    #[test]
    fn an_empty_index_holds_nothing_and_allocates_nothing() {
        let mut t = OwnTags::default();
        t.set_complete(true);
        assert!(!t.may_match(&tagged('e', &[ROOT])));
        assert!(t.bits.is_none());
        // Tags the index does not hold are not inserted.
        t.insert_event(&event(&[["p", ROOT], ["d", "x"]]));
        assert!(t.bits.is_none());
    }

    #[test]
    fn every_value_inserted_is_found_and_few_others_are() {
        let mut t = OwnTags::default();
        t.set_complete(true);
        let hex = |i: u32| format!("{i:064x}");
        for i in 0..20_000u32 {
            t.insert(b'e', &hex(i));
        }
        for i in 0..20_000u32 {
            assert!(t.may_match(&tagged('e', &[&hex(i)])), "{i}");
        }
        let false_positives = (20_000..120_000u32)
            .filter(|i| t.may_hold(b'e', &hex(*i)))
            .count();
        // Expected about 0.0 at this load (1 in millions); allow a few.
        assert!(false_positives < 10, "{false_positives}");
    }
}
