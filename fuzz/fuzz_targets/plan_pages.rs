//! `plan_pages` with arbitrary page statistics and queries, and the same through a relay's
//! `CapWatch` (a probe for a hidden cap included): never panics, fans out at most
//! `1 + MAX_FANOUT` queries, and every follow-up either ends strictly before the query's
//! `until` (or its oldest second) or lies inside one second.
#![no_main]

use std::collections::BTreeSet;

use arbitrary::Arbitrary;
use grasp_sync::core::paging::{plan_pages, CapWatch, PageLimits, PageStats, MAX_FANOUT};
use libfuzzer_sys::fuzz_target;
use nostr::event::Kind;
use nostr::filter::{Filter, SingleLetterTag};
use nostr::key::PublicKey;
use nostr::types::Timestamp;

#[derive(Debug, Arbitrary)]
struct Input {
    received: u64,
    rejected: u64,
    oldest: Option<u64>,
    newest: Option<u64>,
    kinds_seen: Vec<u16>,
    authors_seen: Vec<[u8; 32]>,
    since: Option<u64>,
    until: Option<u64>,
    limit: Option<u16>,
    kinds: Option<Vec<u16>>,
    authors: Option<Vec<[u8; 32]>>,
    tag_values: Vec<String>,
    page_size: u16,
    max_limit: Option<u16>,
    assumed: bool,
    largest_page: u64,
    at_oldest: u64,
    /// What the probe of the page (if one is asked) answers: received, oldest, newest,
    /// events in its oldest second.
    probe_answer: (u64, Option<u64>, Option<u64>, u64),
}

fn pk(b: &[u8; 32]) -> Option<PublicKey> {
    PublicKey::from_slice(b).ok()
}

fuzz_target!(|i: Input| {
    let mut q = Filter::new();
    if let Some(s) = i.since {
        q = q.since(Timestamp::from_secs(s));
    }
    if let Some(u) = i.until {
        q = q.until(Timestamp::from_secs(u));
    }
    if let Some(l) = i.limit {
        q = q.limit(l as usize);
    }
    if let Some(k) = &i.kinds {
        q = q.kinds(k.iter().take(64).map(|k| Kind::from(*k)));
    }
    if let Some(a) = &i.authors {
        q = q.authors(a.iter().take(64).filter_map(pk));
    }
    if !i.tag_values.is_empty() {
        q = q.custom_tags(
            SingleLetterTag::LOWERCASE_A,
            i.tag_values.iter().take(256).cloned(),
        );
    }
    let stats = PageStats {
        received: i.received,
        rejected: i.rejected,
        oldest: i.oldest,
        newest: i.newest,
        kinds_at_oldest: i.kinds_seen.iter().take(64).copied().collect(),
        authors_at_oldest: i
            .authors_seen
            .iter()
            .take(64)
            .filter_map(pk)
            .collect::<BTreeSet<_>>(),
        at_oldest: i.at_oldest,
        ..PageStats::default()
    };
    let limits = PageLimits {
        page_size: (i.page_size as usize).max(1),
        max_limit: i.max_limit.map(|m| m as usize),
        assumed: i.assumed,
        largest_page: i.largest_page,
    };
    check(&q, &plan_pages(&q, &stats, &limits));
    let mut watch = CapWatch::default();
    watch.largest_page = i.largest_page;
    let watched = watch.plan(&q, &stats, &limits);
    check(&q, &watched.plan);
    if watched.plan.probe {
        assert_eq!(watched.plan.next.len(), 1, "a probe is one query");
        // Its answer, whatever it holds, is judged and paged on within the same bounds.
        let probe = &watched.plan.next[0];
        let (received, oldest, newest, at_oldest) = i.probe_answer;
        let answer = PageStats {
            received,
            oldest,
            newest,
            at_oldest,
            ..PageStats::default()
        };
        let next = watch.plan(probe, &answer, &limits);
        check(probe, &next.plan);
        if let Some(cap) = next.learned {
            assert!(cap >= 1 && watch.limits(&limits).page_size == cap);
        }
    }
});

/// The bounds every plan of `q` keeps.
fn check(q: &Filter, plan: &grasp_sync::core::paging::PagePlan) {
    assert!(
        plan.next.len() <= 1 + MAX_FANOUT,
        "{} follow-ups",
        plan.next.len()
    );
    if plan.incomplete.is_some() && plan.next.is_empty() {
        return;
    }
    let until = q.until.map(|u| u.as_secs());
    let bound = until.unwrap_or(u64::MAX);
    for f in &plan.next {
        let u = f.until.expect("every follow-up has an until").as_secs();
        let one_second = f.since.map(|s| s.as_secs()) == Some(u);
        assert!(u <= bound, "until {u} after the query's {bound}");
        assert!(
            u < bound || one_second || until.is_none(),
            "until must strictly decrease: {f:?} after {q:?}"
        );
        if one_second {
            // Strictly narrower than the query, or a larger explicit limit.
            assert!(f != q, "a split must change the query: {f:?}");
        }
    }
}
