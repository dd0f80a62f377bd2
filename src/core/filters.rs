//! The three subscription layers of the design, plus the self-subscription: what "related"
//! means, once, for the daemon and the audit (`grasp-sync audit`).
//!
//! * Layer 1: announcements, state events and user grasp lists (kinds 30617, 30618, 10317),
//!   subscribed once per connection.
//! * Layer 2: events tagging one of our repositories ([`REPO_TAGS`]: `#a`, `#A`, `#q`), per
//!   ≤100 refs.
//! * Layer 3: events tagging one of our root events or an event followed below one
//!   ([`ID_TAGS`]: `#e`, `#E`, `#q`), per ≤100 ids. The ids are the root events and their
//!   thread members (`core::threads`): replies to replies, quotes, reactions, down to the
//!   reply-depth bound.
//!
//! [`build_related_filters`] is everything related for a set of repositories and Layer-3 ids;
//! the daemon's batches, live sets and catch-ups build the same Layer 2/3 filters from the
//! same tag sets (a test in `core/sync/related_tests.rs` holds the daemon and the audit to one
//! answer).
//!
//! Items are sorted before chunking so the same set always yields the same filters.
//! Each filter is sent as its own REQ (see [`crate::core::SyncMachine`]): some relays refuse
//! multi-filter REQs.

use crate::core::hash::HashSet;

use nostr::event::{EventId, Kind};
use nostr::filter::{Filter, SingleLetterTag};
use nostr::types::Timestamp;

use crate::core::nip34::{
    RepoRef, KIND_ISSUE, KIND_PATCH, KIND_PULL_REQUEST, KIND_PULL_REQUEST_UPDATE,
    KIND_REPO_ANNOUNCEMENT, KIND_REPO_STATE, KIND_USER_GRASP_LIST,
};

/// How many repo refs or root ids go into one Layer-2/3 filter.
pub(crate) const CHUNK_SIZE: usize = 100;

/// The tags that relate an event to a repository (Layer 2): `a`, `A`, `q` holding its
/// coordinate.
pub(crate) const REPO_TAGS: [SingleLetterTag; 3] = [
    SingleLetterTag::LOWERCASE_A,
    SingleLetterTag::UPPERCASE_A,
    SingleLetterTag::LOWERCASE_Q,
];

pub(crate) use crate::core::nip34::ID_TAGS;

/// Layer 1: announcements, maintainer/state events and user grasp lists (decision 0099),
/// optionally since a time.
pub(crate) fn build_announcement_filter(since: Option<Timestamp>) -> Filter {
    let f = Filter::new().kinds([
        Kind::Custom(KIND_REPO_ANNOUNCEMENT),
        Kind::Custom(KIND_REPO_STATE),
        Kind::Custom(KIND_USER_GRASP_LIST),
    ]);
    match since {
        Some(ts) => f.since(ts),
        None => f,
    }
}

fn tag_filters(
    values: Vec<String>,
    tags: [SingleLetterTag; 3],
    since: Option<Timestamp>,
    chunk_size: usize,
) -> Vec<Filter> {
    let mut filters = Vec::new();
    for chunk in values.chunks(chunk_size.max(1)) {
        for tag in tags {
            let mut f = Filter::new().custom_tags(tag, chunk.iter().cloned());
            if let Some(ts) = since {
                f = f.since(ts);
            }
            filters.push(f);
        }
    }
    filters
}

/// Layer 2: events tagging one of `repos` with `a`, `A` or `q`; three filters per 100 refs.
pub(crate) fn tagged_one_of_our_repo_event_filters(
    repos: &HashSet<RepoRef>,
    since: Option<Timestamp>,
) -> Vec<Filter> {
    let mut refs: Vec<String> = repos.iter().cloned().collect();
    refs.sort();
    tag_filters(refs, REPO_TAGS, since, CHUNK_SIZE)
}

/// Layer 3: events tagging one of `root_events` (root events and thread members) with `e`,
/// `E` or `q` (lower-case hex ids); three filters per 100 ids.
pub(crate) fn tagged_one_of_our_root_event_filters(
    root_events: &HashSet<EventId>,
    since: Option<Timestamp>,
) -> Vec<Filter> {
    let mut ids: Vec<String> = root_events.iter().map(|id| id.to_hex()).collect();
    ids.sort();
    tag_filters(ids, ID_TAGS, since, CHUNK_SIZE)
}

/// The state events (kind 30618) of `repos`: per 100 repositories one filter of their
/// owners and `d` values. A relay answers the cross product (any of those authors with any
/// of those `d`), so a caller keeps only events whose `30617:<pubkey>:<d>` is one of
/// `repos` ([`state_coordinate`]). The daemon reads them with Layer 1 (every 30617/30618 of
/// a relay, a superset); the audit asks for exactly these.
pub(crate) fn build_state_filters(repos: &HashSet<RepoRef>) -> Vec<Filter> {
    let mut sorted: Vec<&RepoRef> = repos.iter().collect();
    sorted.sort();
    let mut out = Vec::new();
    for chunk in sorted.chunks(CHUNK_SIZE) {
        let mut authors = Vec::new();
        let mut ds = Vec::new();
        for repo in chunk {
            let mut parts = repo.splitn(3, ':');
            let (Some(_), Some(pk), Some(d)) = (parts.next(), parts.next(), parts.next()) else {
                continue;
            };
            if let Ok(pk) = nostr::key::PublicKey::from_hex(pk) {
                authors.push(pk);
                ds.push(d.to_string());
            }
        }
        if authors.is_empty() {
            continue;
        }
        out.push(
            Filter::new()
                .kind(Kind::Custom(KIND_REPO_STATE))
                .authors(authors)
                .custom_tags(SingleLetterTag::LOWERCASE_D, ds),
        );
    }
    out
}

/// The repository coordinate (`30617:<pubkey>:<d>`) a state event (kind 30618) belongs to;
/// `None` for any other kind or one without a `d` tag.
pub(crate) fn state_coordinate(event: &nostr::event::Event) -> Option<RepoRef> {
    if event.kind != Kind::Custom(KIND_REPO_STATE) {
        return None;
    }
    let d = event.tags.identifier()?;
    Some(format!(
        "{KIND_REPO_ANNOUNCEMENT}:{}:{d}",
        event.pubkey.to_hex()
    ))
}

/// What the own relay must hold for `repos` and `root_events` (root events and thread
/// members), beyond the announcements themselves: Layers 2 and 3, and the repositories'
/// state events ([`build_state_filters`]). The audit asks exactly this; the daemon asks the
/// same Layers 2 and 3 ([`build_layer2_and_layer3_filters`],
/// [`live_layer2_and_layer3_filters`]) and the state events with Layer 1.
pub(crate) fn build_related_filters(
    repos: &HashSet<RepoRef>,
    root_events: &HashSet<EventId>,
) -> Vec<Filter> {
    let mut filters = build_layer2_and_layer3_filters(repos, root_events, None);
    filters.extend(build_state_filters(repos));
    filters
}

/// Layers 2 and 3 together (never Layer 1).
pub(crate) fn build_layer2_and_layer3_filters(
    repos: &HashSet<RepoRef>,
    root_events: &HashSet<EventId>,
    since: Option<Timestamp>,
) -> Vec<Filter> {
    let mut filters = tagged_one_of_our_repo_event_filters(repos, since);
    filters.extend(tagged_one_of_our_root_event_filters(root_events, since));
    filters
}

/// How many Layer 2/3 filters `repos` repositories and `roots` root events take at
/// `chunk_size` values per filter (three tag keys each side).
pub(crate) fn layer2_and_layer3_count(repos: usize, roots: usize, chunk_size: usize) -> usize {
    let chunk_size = chunk_size.max(1);
    3 * (repos.div_ceil(chunk_size) + roots.div_ceil(chunk_size))
}

/// Layers 2 and 3 as live filters in at most `slots` filters where that is possible: the
/// smallest chunk of at least [`CHUNK_SIZE`] and at most `max_chunk` values per filter that
/// fits (consolidation into fewer, larger filters, so that a relay's subscription budget
/// holds the whole live set and nothing is polled); `max_chunk` when nothing fits (the rest
/// is then polled).
pub(crate) fn live_layer2_and_layer3_filters(
    repos: &HashSet<RepoRef>,
    root_events: &HashSet<EventId>,
    slots: usize,
    max_chunk: usize,
) -> Vec<Filter> {
    let max_chunk = max_chunk.max(CHUNK_SIZE);
    let fits = |c: usize| layer2_and_layer3_count(repos.len(), root_events.len(), c) <= slots;
    let chunk = if fits(CHUNK_SIZE) || !fits(max_chunk) {
        if fits(CHUNK_SIZE) {
            CHUNK_SIZE
        } else {
            max_chunk
        }
    } else {
        // The count falls as the chunk grows: the smallest chunk that fits.
        let (mut lo, mut hi) = (CHUNK_SIZE, max_chunk);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi
    };
    let mut refs: Vec<String> = repos.iter().cloned().collect();
    refs.sort();
    let mut ids: Vec<String> = root_events.iter().map(|id| id.to_hex()).collect();
    ids.sort();
    let mut filters = tag_filters(refs, REPO_TAGS, None, chunk);
    filters.extend(tag_filters(ids, ID_TAGS, None, chunk));
    filters
}

/// The self-subscription on the own relay: every event it holds (no kinds), history and
/// live. Announcements and root events build the repository index; an event tagging a root
/// event or a thread member is followed below it (`core::threads`); the rest is ignored.
/// Its history is read after [`self_subscription_filter`]'s, so the root events are known
/// before their replies are read (`SyncMachine::handle_own_connected`).
pub(crate) fn own_events_filter() -> Filter {
    Filter::new()
}

/// The first read of the own relay on every connect (history only, closed at its EOSE):
/// announcements and root events, so that the replies the self-subscription
/// ([`own_events_filter`]) reads next find their root events known (a relay answers newest
/// first: a reply before its root). 30618 is deliberately absent (it is only pulled from
/// remote relays).
pub(crate) fn self_subscription_filter(since: Option<Timestamp>) -> Filter {
    let f = Filter::new().kinds([
        Kind::Custom(KIND_REPO_ANNOUNCEMENT),
        Kind::Custom(KIND_PATCH),
        Kind::Custom(KIND_PULL_REQUEST),
        Kind::Custom(KIND_PULL_REQUEST_UPDATE),
        Kind::Custom(KIND_ISSUE),
    ]);
    match since {
        Some(ts) => f.since(ts),
        None => f,
    }
}

/// Event ids of one tag of a [`PackedFilter`], shared between filters with the same ids.
pub(crate) type PackedIds = std::sync::Arc<[[u8; 32]]>;

/// A [`Filter`] held compactly while it waits to be used: the values of each tag whose values
/// are all 64-character lower-case hex (Layer-3 ids) as 32-byte arrays, the rest as the
/// filter holds it (boxed, and not at all when nothing else is set). [`PackedFilter::unpack`]
/// gives back the same filter.
///
/// A Layer-3 filter of 100 ids held as a [`Filter`] takes about 11 KB (a 64-byte string
/// per value in a B-tree); packed, 3.2 KB, and the three filters of one chunk (`#e`, `#E`,
/// `#q`) packed one after the other share their ids ([`PackedFilter::pack_with`]).
/// Reconciliations waiting for their turn hold their query this way: in a first sync with
/// repositories on three relays thousands of them wait at once, and their queries were a
/// fifth of the peak heap (issue 37, decision 0117).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PackedFilter {
    /// The filter without the tag values packed below; `None` when that is `Filter::new()`.
    rest: Option<Box<Filter>>,
    /// Per packed tag letter, its values as bytes in the filter's (sorted) order.
    ids: Box<[(SingleLetterTag, PackedIds)]>,
}

impl PackedFilter {
    /// `filter`, its hex-id tag values packed.
    #[cfg(test)]
    pub(crate) fn pack(filter: Filter) -> PackedFilter {
        PackedFilter::pack_with(filter, &mut None)
    }

    /// [`PackedFilter::pack`] sharing the packed ids with the filter packed before (`last`:
    /// the ids it packed last, updated) when they are the same.
    pub(crate) fn pack_with(filter: Filter, last: &mut Option<PackedIds>) -> PackedFilter {
        let mut rest = filter;
        let mut ids = Vec::new();
        // Tags whose every value is an event id as `EventId::to_hex` writes it (64 lowercase
        // hex digits), so that unpacking gives the same strings back.
        let packable: Vec<(SingleLetterTag, Vec<[u8; 32]>)> = rest
            .generic_tags
            .iter()
            .filter(|(_, values)| !values.is_empty())
            .filter_map(|(letter, values)| {
                let bytes = values
                    .iter()
                    .map(|v| crate::core::message::hex_id(v.as_bytes()).map(EventId::to_bytes))
                    .collect::<Option<Vec<_>>>()?;
                Some((*letter, bytes))
            })
            .collect();
        for (letter, bytes) in packable {
            if rest.generic_tags.remove(&letter).is_some() {
                let shared = match last {
                    Some(l) if **l == bytes[..] => l.clone(),
                    _ => {
                        let new: PackedIds = bytes.into();
                        *last = Some(new.clone());
                        new
                    }
                };
                ids.push((letter, shared));
            }
        }
        PackedFilter {
            rest: (rest != Filter::new()).then(|| Box::new(rest)),
            ids: ids.into(),
        }
    }

    /// The filter as it was packed.
    pub(crate) fn unpack(&self) -> Filter {
        let mut f = self.rest.as_deref().cloned().unwrap_or_default();
        for (letter, values) in self.ids.iter() {
            // Sorted bytes are sorted hex: the set is built in one pass.
            f.generic_tags.insert(
                *letter,
                values
                    .iter()
                    .map(|b| EventId::from_byte_array(*b).to_hex())
                    .collect(),
            );
        }
        f
    }

    /// The filter's `since`.
    pub(crate) fn since(&self) -> Option<Timestamp> {
        self.rest.as_ref().and_then(|f| f.since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repos(n: usize) -> HashSet<RepoRef> {
        (0..n)
            .map(|i| format!("30617:{}:r{i:04}", "ab".repeat(32)))
            .collect()
    }

    #[test]
    fn layer2_chunks_per_100_refs() {
        assert!(tagged_one_of_our_repo_event_filters(&repos(0), None).is_empty());
        assert_eq!(
            tagged_one_of_our_repo_event_filters(&repos(1), None).len(),
            3
        );
        assert_eq!(
            tagged_one_of_our_repo_event_filters(&repos(100), None).len(),
            3
        );
        assert_eq!(
            tagged_one_of_our_repo_event_filters(&repos(101), None).len(),
            6
        );
        let f = tagged_one_of_our_repo_event_filters(&repos(250), None);
        assert_eq!(f.len(), 9);
        let sizes: Vec<usize> = f
            .iter()
            .map(|f| f.generic_tags.values().next().unwrap().len())
            .collect();
        assert_eq!(sizes, vec![100, 100, 100, 100, 100, 100, 50, 50, 50]);
    }

    #[test]
    fn layer2_uses_a_upper_a_and_q() {
        let f = tagged_one_of_our_repo_event_filters(&repos(2), Some(Timestamp::from_secs(77)));
        let keys: Vec<String> = f
            .iter()
            .map(|f| {
                let j: serde_json::Value = serde_json::from_str(&f.as_json()).unwrap();
                assert_eq!(j["since"], 77);
                let obj = j.as_object().unwrap();
                obj.keys().find(|k| k.starts_with('#')).unwrap().clone()
            })
            .collect();
        assert_eq!(keys, vec!["#a", "#A", "#q"]);
    }

    #[test]
    fn layer3_uses_lowercase_hex_and_e_upper_e_q() {
        let ids: HashSet<EventId> = (0u8..3)
            .map(|i| EventId::from_byte_array([i + 0xA0; 32]))
            .collect();
        let f = tagged_one_of_our_root_event_filters(&ids, None);
        assert_eq!(f.len(), 3);
        let j: serde_json::Value = serde_json::from_str(&f[0].as_json()).unwrap();
        let vals = j["#e"].as_array().unwrap();
        assert_eq!(vals.len(), 3);
        for v in vals {
            let s = v.as_str().unwrap();
            assert_eq!(s, s.to_lowercase());
            assert_eq!(s.len(), 64);
        }
        assert!(j.get("since").is_none());
        let j1: serde_json::Value = serde_json::from_str(&f[1].as_json()).unwrap();
        assert!(j1.get("#E").is_some());
        let j2: serde_json::Value = serde_json::from_str(&f[2].as_json()).unwrap();
        assert!(j2.get("#q").is_some());
    }

    #[test]
    fn layer1_and_self_filters() {
        let j: serde_json::Value =
            serde_json::from_str(&build_announcement_filter(None).as_json()).unwrap();
        assert_eq!(j["kinds"], serde_json::json!([10317, 30617, 30618]));
        assert!(j.get("since").is_none());
        let j: serde_json::Value = serde_json::from_str(
            &build_announcement_filter(Some(Timestamp::from_secs(5))).as_json(),
        )
        .unwrap();
        assert_eq!(j["since"], 5);
        let j: serde_json::Value =
            serde_json::from_str(&self_subscription_filter(None).as_json()).unwrap();
        assert_eq!(
            j["kinds"],
            serde_json::json!([1617, 1618, 1619, 1621, 30617])
        );
    }

    #[test]
    fn combined_layers() {
        let ids: HashSet<EventId> = [EventId::from_byte_array([1; 32])]
            .into_iter()
            .collect::<HashSet<_>>();
        assert_eq!(
            build_layer2_and_layer3_filters(&repos(250), &ids, None).len(),
            12
        );
        assert!(
            build_layer2_and_layer3_filters(&HashSet::default(), &HashSet::default(), None)
                .is_empty()
        );
    }

    #[test]
    fn a_packed_filter_unpacks_to_the_same_filter() {
        let ids: HashSet<EventId> = (0u8..=255)
            .map(|i| EventId::from_byte_array([i.wrapping_mul(37); 32]))
            .collect();
        let mut cases = tagged_one_of_our_root_event_filters(&ids, Some(Timestamp::from(7)));
        cases.extend(tagged_one_of_our_repo_event_filters(&repos(150), None));
        cases.extend(build_state_filters(&repos(3)));
        cases.push(build_announcement_filter(None).limit(0));
        // Mixed: hex ids under one letter, other values under another; upper-case hex and
        // a short value stay as they are.
        let mixed = Filter::new()
            .custom_tags(SingleLetterTag::LOWERCASE_E, ids.iter().map(|i| i.to_hex()))
            .custom_tags(SingleLetterTag::LOWERCASE_A, ["30617:ab:c".to_string()])
            .custom_tags(
                SingleLetterTag::UPPERCASE_E,
                [ids.iter().next().unwrap().to_hex().to_uppercase()],
            )
            .custom_tags(
                SingleLetterTag::LOWERCASE_Q,
                ["ab".to_string(), "a".repeat(64)],
            )
            .until(Timestamp::from(9));
        cases.push(mixed);
        for f in cases {
            let packed = PackedFilter::pack(f.clone());
            assert_eq!(packed.unpack(), f);
            assert_eq!(packed.since(), f.since);
        }
    }

    #[test]
    fn a_packed_layer3_filter_holds_its_ids_as_bytes() {
        let ids: HashSet<EventId> = (0u8..100)
            .map(|i| EventId::from_byte_array([i; 32]))
            .collect();
        let f = tagged_one_of_our_root_event_filters(&ids, None).remove(0);
        let packed = PackedFilter::pack(f);
        assert!(packed.rest.is_none());
        assert_eq!(packed.ids.len(), 1);
        assert_eq!(packed.ids[0].1.len(), 100);
        let mut want: Vec<[u8; 32]> = ids.iter().map(|i| i.to_bytes()).collect();
        want.sort();
        assert_eq!(&*packed.ids[0].1, &want[..]);
        assert!(std::mem::size_of::<PackedFilter>() <= 24);
    }

    #[test]
    fn the_filters_of_one_chunk_packed_in_turn_share_their_ids() {
        let ids: HashSet<EventId> = (0u8..150)
            .map(|i| EventId::from_byte_array([i; 32]))
            .collect();
        // Two chunks, three tags each.
        let filters = tagged_one_of_our_root_event_filters(&ids, None);
        assert_eq!(filters.len(), 6);
        let mut last = None;
        let packed: Vec<PackedFilter> = filters
            .iter()
            .map(|f| PackedFilter::pack_with(f.clone(), &mut last))
            .collect();
        for (p, f) in packed.iter().zip(&filters) {
            assert_eq!(&p.unpack(), f);
        }
        let arc = |p: &PackedFilter| p.ids[0].1.clone();
        assert!(std::sync::Arc::ptr_eq(&arc(&packed[0]), &arc(&packed[1])));
        assert!(std::sync::Arc::ptr_eq(&arc(&packed[0]), &arc(&packed[2])));
        assert!(!std::sync::Arc::ptr_eq(&arc(&packed[2]), &arc(&packed[3])));
        assert!(std::sync::Arc::ptr_eq(&arc(&packed[3]), &arc(&packed[5])));
    }
}
