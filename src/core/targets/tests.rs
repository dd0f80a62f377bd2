//! Tests of target selection, the plan cache and `compute_actions`.

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::core::state::{PendingBatch, PendingItems, RelayState, RepoSyncNeeds};
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
    assert_eq!(
        a.repos,
        [repo("r1"), repo("r2")].into_iter().collect::<HashSet<_>>()
    );
    assert_eq!(
        a.root_events,
        [id(1), id(2), id(3)].into_iter().collect::<HashSet<_>>()
    );
    let b = &t[&url("wss://b")];
    assert_eq!(b.repos, [repo("r2")].into_iter().collect::<HashSet<_>>());
    assert_eq!(b.root_events, [id(3)].into_iter().collect::<HashSet<_>>());
}

#[test]
fn empty_state_yields_nothing() {
    let t = derive_relay_targets(&RepoSyncIndex::default(), &[]);
    assert!(t.is_empty());
    assert!(
        compute_actions(&t, &PendingSyncIndex::default(), &RelaySyncIndex::default()).is_empty()
    );
}

#[test]
fn unknown_relay_gets_everything() {
    let t = derive_relay_targets(&index(&[("r1", &["wss://a"], &[1])]), &[]);
    let a = compute_actions(&t, &PendingSyncIndex::default(), &RelaySyncIndex::default());
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].relay_url, url("wss://a"));
    assert_eq!(a[0].repos, [repo("r1")].into_iter().collect::<HashSet<_>>());
    assert_eq!(
        a[0].root_events,
        [id(1)].into_iter().collect::<HashSet<_>>()
    );
    assert_eq!(a[0].filters.len(), 6);
}

#[test]
fn pending_and_confirmed_are_excluded_partial_overlap_remains() {
    let t = derive_relay_targets(
        &index(&[("r1", &["wss://a"], &[1, 2]), ("r2", &["wss://a"], &[3])]),
        &[],
    );
    let mut confirmed = RelaySyncIndex::default();
    let mut s = connected();
    s.repos.insert(repo("r1"));
    s.root_events.insert(id(1));
    confirmed.insert(url("wss://a"), s);
    let mut pending = PendingSyncIndex::default();
    pending.insert(
        url("wss://a"),
        vec![PendingBatch {
            batch_id: 1,
            items: PendingItems {
                repos: HashSet::default(),
                root_events: [id(2)].into_iter().collect::<HashSet<_>>(),
            },
            outstanding_subs: HashSet::default(),
            started_at: Time::from_secs(0),
            incomplete: false,
            uncovered_from: None,
        }],
    );
    let a = compute_actions(&t, &pending, &confirmed);
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].repos, [repo("r2")].into_iter().collect::<HashSet<_>>());
    assert_eq!(
        a[0].root_events,
        [id(3)].into_iter().collect::<HashSet<_>>()
    );
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
    let mut confirmed = RelaySyncIndex::default();
    confirmed.insert(url("wss://a"), RelayState::new(false));
    let mut connecting = RelayState::new(false);
    connecting.connection_status = ConnectionStatus::Connecting;
    confirmed.insert(url("wss://b"), connecting);
    confirmed.insert(url("wss://c"), connected());
    let a = compute_actions(&t, &PendingSyncIndex::default(), &confirmed);
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
    let a = compute_actions(&t, &PendingSyncIndex::default(), &RelaySyncIndex::default());
    assert_eq!(a.len(), 2);
    assert_eq!(
        a[0].root_events,
        [id(7)].into_iter().collect::<HashSet<_>>()
    );
    assert_eq!(
        a[1].root_events,
        [id(8)].into_iter().collect::<HashSet<_>>()
    );
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
    assert_eq!(
        a.repos,
        [keyed_repo(1, "ours")].into_iter().collect::<HashSet<_>>()
    );
    assert_eq!(
        a.root_events,
        [id(1)].into_iter().collect::<HashSet<_>>(),
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
        [keyed_repo(2, "z")].into_iter().collect::<HashSet<_>>()
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
    let mut union: HashMap<RelayUrl, RelaySyncNeeds> = HashMap::default();
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
    let mut selected: HashSet<&RelayUrl> = HashSet::default();
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
    let mut other_shards: HashSet<&RelayUrl> = HashSet::default();
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
        let mut idx = RepoSyncIndex::default();
        for (n, (key, relays)) in repos.iter().enumerate() {
            idx.insert(
                keyed_repo(*key, &format!("r{n}")),
                RepoSyncNeeds {
                    relays: relays.iter().map(|i| relay(*i)).collect(),
                    root_events: HashSet::default(),
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
        let mut want: HashMap<RepoRef, Vec<RelayUrl>> = HashMap::default();
        let report = reference_select(&idx, &excluded, &p, |repo, mine| {
            if !mine.is_empty() {
                want.insert(repo.clone(), mine.iter().map(|r| (*r).clone()).collect());
            }
        });
        proptest::prop_assert_eq!(got.report, report);
        proptest::prop_assert_eq!(got.repo_relays, want);
    }
}

/// `compute_action` looks unconfirmed items up in the pending batches one by one when there
/// are few of them, or through sets of every pending item: both ways leave out exactly the
/// pending ones.
#[test]
fn pending_items_are_left_out_by_lookup_and_by_set_alike() {
    let relay = url("wss://a");
    let batch = |n: u64, repos: &[&str], roots: &[u8]| PendingBatch {
        batch_id: n,
        items: PendingItems {
            repos: repos.iter().map(|r| repo(r)).collect(),
            root_events: roots.iter().map(|b| id(*b)).collect(),
        },
        outstanding_subs: HashSet::default(),
        started_at: Time::from_secs(0),
        incomplete: false,
        uncovered_from: None,
    };
    let mut state = connected();
    state.root_events.extend((100..120).map(id));
    // Many small batches against few unconfirmed items (3 × 20 > 20 pending items: sets)
    // and one large batch against few (3 × 1 ≤ 40: lookups).
    let many: Vec<PendingBatch> = (0..20).map(|i| batch(i, &[], &[i as u8])).collect();
    let one = vec![batch(1, &["r9"], &(0..39).collect::<Vec<u8>>())];
    for pending in [many, one] {
        let target = RelaySyncNeeds {
            repos: [repo("r9"), repo("r8")].into_iter().collect::<HashSet<_>>(),
            root_events: [id(5), id(60), id(101)].into_iter().collect::<HashSet<_>>(),
        };
        let a = compute_action(&relay, &target, Some(&state), &pending).unwrap();
        let in_batches = |r: &RepoRef| pending.iter().any(|b| b.items.repos.contains(r));
        let expected_repos: HashSet<RepoRef> = target
            .repos
            .iter()
            .filter(|r| !in_batches(r))
            .cloned()
            .collect();
        assert_eq!(a.repos, expected_repos);
        assert_eq!(a.root_events, [id(60)].into_iter().collect::<HashSet<_>>());
    }
}
