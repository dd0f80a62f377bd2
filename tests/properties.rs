//! Properties (proptest): `compute_actions` never re-sends what is pending or confirmed and
//! covers the whole target for a connected relay; URL normalisation is idempotent.

use grasp_sync::core::hash::{HashMap, HashSet};

use grasp_sync::core::state::{
    ConnectionStatus, PendingBatch, PendingItems, PendingSyncIndex, RelayState, RelaySyncIndex,
    RepoSyncIndex,
};
use grasp_sync::core::targets::{
    compute_actions, derive_relay_targets, derive_targets, Exclusions, Plan, RepoScope, Shard,
    TargetPolicy,
};
use grasp_sync::core::Time;
use grasp_sync::RelayUrl;
use nostr::event::EventId;
use proptest::prelude::*;

const RELAYS: [&str; 4] = [
    "wss://a.example",
    "wss://b.example",
    "wss://c.example",
    "ws://127.0.0.1:7000",
];

fn relay(i: usize) -> RelayUrl {
    RelayUrl::parse(RELAYS[i % RELAYS.len()]).unwrap()
}
fn repo(i: u8) -> String {
    format!("30617:{}:r{i}", "ab".repeat(32))
}
fn id(i: u8) -> EventId {
    EventId::from_byte_array([i; 32])
}

/// One relay of a [`World`]: index, status (0 connected, 1 connecting, 2 disconnected),
/// confirmed repos and ids, pending repos and ids.
type WorldRelay = (usize, u8, Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>);

/// A random world: a repository index, and per relay a connection status with confirmed and
/// pending items drawn from the same small universe (so overlaps are common).
#[derive(Debug, Clone)]
struct World {
    index: Vec<(u8, Vec<usize>, Vec<u8>)>,
    relays: Vec<WorldRelay>,
}

fn world() -> impl Strategy<Value = World> {
    let index = prop::collection::vec(
        (
            0u8..8,
            prop::collection::vec(0usize..4, 0..4),
            prop::collection::vec(0u8..12, 0..5),
        ),
        0..8,
    );
    let relays = prop::collection::vec(
        (
            0usize..4,
            0u8..3,
            prop::collection::vec(0u8..8, 0..5),
            prop::collection::vec(0u8..12, 0..5),
            prop::collection::vec(0u8..8, 0..5),
            prop::collection::vec(0u8..12, 0..5),
        ),
        0..4,
    );
    (index, relays).prop_map(|(index, relays)| World { index, relays })
}

fn build(w: &World) -> (RepoSyncIndex, PendingSyncIndex, RelaySyncIndex) {
    let mut idx = RepoSyncIndex::default();
    for (r, relays, ids) in &w.index {
        let n = idx.entry(repo(*r)).or_default();
        n.relays.extend(relays.iter().map(|i| relay(*i)));
        n.root_events.extend(ids.iter().map(|i| id(*i)));
        n.announced_at = Some(1);
    }
    let mut pending = PendingSyncIndex::default();
    let mut confirmed = RelaySyncIndex::default();
    for (k, (r, status, c_repos, c_ids, p_repos, p_ids)) in w.relays.iter().enumerate() {
        let url = relay(*r);
        let mut s = RelayState::new(false);
        s.connection_status = match status {
            0 => ConnectionStatus::Connected,
            1 => ConnectionStatus::Connecting,
            _ => ConnectionStatus::Disconnected,
        };
        s.repos = c_repos.iter().map(|i| repo(*i)).collect();
        s.root_events = c_ids.iter().map(|i| id(*i)).collect();
        confirmed.insert(url.clone(), s);
        pending.entry(url).or_default().push(PendingBatch {
            batch_id: k as u64,
            items: PendingItems {
                repos: p_repos.iter().map(|i| repo(*i)).collect(),
                root_events: p_ids.iter().map(|i| id(*i)).collect(),
            },
            outstanding_subs: HashSet::default(),
            started_at: Time::from_secs(0),
            incomplete: false,
            uncovered_from: None,
        });
    }
    (idx, pending, confirmed)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn compute_actions_is_the_exact_three_way_diff(w in world()) {
        let (idx, pending, confirmed) = build(&w);
        let targets = derive_relay_targets(&idx, &[]);
        let actions = compute_actions(&targets, &pending, &confirmed);
        let by_relay: HashMap<&RelayUrl, _> = actions.iter().map(|a| (&a.relay_url, a)).collect();
        prop_assert_eq!(by_relay.len(), actions.len(), "one action per relay");
        for a in &actions {
            let state = confirmed.get(&a.relay_url);
            prop_assert!(state.is_none_or(|s| s.connection_status == ConnectionStatus::Connected));
            let batches = pending.get(&a.relay_url).map(|v| v.as_slice()).unwrap_or(&[]);
            for b in batches {
                // new ∩ pending = ∅
                prop_assert!(a.repos.is_disjoint(&b.items.repos));
                prop_assert!(a.root_events.is_disjoint(&b.items.root_events));
            }
            if let Some(s) = state {
                // new ∩ confirmed = ∅
                prop_assert!(a.repos.is_disjoint(&s.repos));
                prop_assert!(a.root_events.is_disjoint(&s.root_events));
            }
            prop_assert!(!a.repos.is_empty() || !a.root_events.is_empty());
            prop_assert!(!a.filters.is_empty());
        }
        // target = confirmed ∪ pending ∪ new, for every connected (or unknown) relay.
        for (url, t) in &targets {
            let state = confirmed.get(url);
            if state.is_some_and(|s| s.connection_status != ConnectionStatus::Connected) {
                prop_assert!(!by_relay.contains_key(url));
                continue;
            }
            let batches = pending.get(url).map(|v| v.as_slice()).unwrap_or(&[]);
            let mut repos: HashSet<String> = state.map(|s| s.repos.clone()).unwrap_or_default();
            let mut ids: HashSet<EventId> = state.map(|s| s.root_events.clone()).unwrap_or_default();
            for b in batches {
                repos.extend(b.items.repos.iter().cloned());
                ids.extend(b.items.root_events.iter().copied());
            }
            if let Some(a) = by_relay.get(url) {
                repos.extend(a.repos.iter().cloned());
                ids.extend(a.root_events.iter().copied());
            }
            prop_assert!(t.repos.is_subset(&repos), "{:?} missing", t.repos.difference(&repos).collect::<Vec<_>>());
            prop_assert!(t.root_events.is_subset(&ids));
            // and nothing beyond the target is added
            if let Some(a) = by_relay.get(url) {
                prop_assert!(a.repos.is_subset(&t.repos));
                prop_assert!(a.root_events.is_subset(&t.root_events));
            }
        }
    }

    #[test]
    fn url_normalisation_is_idempotent(
        scheme in prop::sample::select(vec!["ws", "wss", "WS", "Wss", "http", ""]),
        host in "[a-zA-Z0-9.-]{0,12}|\\[[0-9a-fA-F:]{0,10}\\]",
        port in prop::option::of(0u32..70000),
        path in "(/[a-zA-Z0-9._~%-]{0,6}){0,3}/?",
        query in prop::option::of("[a-z0-9=&]{0,6}"),
        fragment in prop::option::of("[a-z0-9]{0,4}"),
        pad in "[ \t]{0,2}",
    ) {
        let mut s = format!("{pad}{scheme}://{host}");
        if let Some(p) = port { s.push_str(&format!(":{p}")); }
        s.push_str(&path);
        if let Some(q) = query { s.push('?'); s.push_str(&q); }
        if let Some(f) = fragment { s.push('#'); s.push_str(&f); }
        s.push_str(&pad);
        if let Ok(u) = RelayUrl::parse(&s) {
            let again = RelayUrl::parse(u.as_str());
            prop_assert_eq!(again.as_ref(), Ok(&u), "parse(normalise({:?}))", s);
            let again = again.unwrap();
            prop_assert_eq!(again.as_str(), u.as_str());
        }
    }

    #[test]
    fn any_string_parses_or_fails_without_panic_and_normalises_idempotently(s in "\\PC{0,40}") {
        if let Ok(u) = RelayUrl::parse(&s) {
            prop_assert_eq!(RelayUrl::parse(u.as_str()), Ok(u));
        }
    }
    #[test]
    fn targets_respect_scope_and_quotas_and_are_deterministic(
        repos in prop::collection::vec(
            (0u8..4, 0u8..6, prop::collection::vec(0u16..40, 0..10), any::<bool>()),
            0..20,
        ),
        per_key in 0usize..8,
        max in 0usize..30,
        scoped in any::<bool>(),
        per_host in 1usize..4,
        preferred in prop::option::of(0u8..4),
    ) {
        let own = RelayUrl::parse("wss://git.example").unwrap();
        let mut idx = RepoSyncIndex::default();
        for (key, d, relays, lists_us) in &repos {
            let r = format!("30617:{}:{d}", format!("{key:02x}").repeat(32));
            let n = idx.entry(r).or_default();
            // Every fourth relay shares one host (another path): the host cap bites.
            n.relays.extend(relays.iter().map(|i| if i % 4 == 0 {
                RelayUrl::parse(&format!("wss://shared.example/{i}")).unwrap()
            } else {
                RelayUrl::parse(&format!("wss://r{i}.example")).unwrap()
            }));
            if *lists_us { n.relays.insert(own.clone()); }
            n.announced_at = Some(1);
        }
        let policy = TargetPolicy {
            shard: None,
            scope: if scoped { RepoScope::ListingService(vec![own.clone()]) } else { RepoScope::All },
            max_relays_per_pubkey: per_key,
            max_relays: max,
            reserved: Vec::new(),
            preferred_pubkeys: preferred.map(|k| format!("{k:02x}").repeat(32)).into_iter().collect(),
            max_urls_per_host: per_host,
            failing: HashSet::default(),
            blocked_pubkeys: HashSet::default(),
        };
        let own_only = Exclusions::from(std::slice::from_ref(&own));
        let t = derive_targets(&idx, &own_only, &policy);
        prop_assert!(t.targets.len() <= max);
        let shared = t.targets.keys().filter(|u| u.host() == "shared.example").count();
        prop_assert!(shared <= per_host, "{} URLs of one host", shared);
        prop_assert!(!t.targets.contains_key(&own));
        let mut per_pubkey: HashMap<String, HashSet<RelayUrl>> = HashMap::default();
        for (url, needs) in &t.targets {
            for r in &needs.repos {
                let n = &idx[r];
                prop_assert!(n.relays.contains(url));
                prop_assert!(!scoped || n.relays.contains(&own), "out-of-scope repo {} targeted", r);
                per_pubkey.entry(r[6..70].to_string()).or_default().insert(url.clone());
            }
        }
        for relays in per_pubkey.values() {
            prop_assert!(relays.len() <= per_key);
        }
        let shuffled: RepoSyncIndex = idx.clone().into_iter().collect();
        prop_assert_eq!(derive_targets(&shuffled, &own_only, &policy).targets, t.targets.clone());
        // Unlimited and unscoped: the design's derive_relay_targets.
        let all = derive_targets(&idx, &own_only, &TargetPolicy::unlimited());
        prop_assert_eq!(all.targets, derive_relay_targets(&idx, std::slice::from_ref(&own)));
    }
}

/// One change to the repository index: an announcement (repo, relays) or a root event
/// (id, repos).
#[derive(Debug, Clone)]
enum Change {
    Announce(u8, Vec<usize>),
    Root(u8, Vec<u8>),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        (0u8..10, prop::collection::vec(0usize..8, 0..4)).prop_map(|(r, v)| Change::Announce(r, v)),
        (0u8..40, prop::collection::vec(0u8..10, 0..3)).prop_map(|(i, v)| Change::Root(i, v)),
    ]
}

fn many_relay(i: usize) -> RelayUrl {
    // Relays 4 and up share one host (other paths), so the host cap can bind.
    if i >= 4 {
        RelayUrl::parse(&format!("wss://shared.example/{i}")).unwrap()
    } else {
        RelayUrl::parse(&format!("wss://r{i}.example")).unwrap()
    }
}
fn keyed(i: u8) -> String {
    // Three pubkeys, so the per-pubkey quota and the round-robin both bite.
    format!("30617:{}:r{i}", format!("{:02x}", i % 3).repeat(32))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    /// The machine's incremental planning (issue 10): after any sequence of batches, the
    /// cached targets equal a fresh `derive_targets`, under tight quotas, a cap, a shard, a
    /// repository scope and an excluded own relay; with the whole selection run again at
    /// every changed relay set (`reselect`) or only for the pubkeys of the repositories
    /// whose relay set changed (`reselect_repos`, as the machine does).
    #[test]
    fn incremental_plan_equals_a_fresh_derivation(
        batches in prop::collection::vec(prop::collection::vec(change(), 1..6), 1..12),
        per_key in 1usize..4,
        // Up to 9 relays can be within the quotas (three pubkeys): from 9 on the cap never
        // binds, which is when `reselect_repos` works per pubkey.
        max in 1usize..12,
        by_repo in any::<bool>(),
        shard in prop::option::of(0u64..2),
        excluded_own in any::<bool>(),
        listing in prop::option::of(0usize..8),
        per_host in 1usize..4,
        preferred in prop::option::of(0u8..3),
        failing in prop::collection::hash_set(0usize..8, 0..3),
    ) {
        let excluded: Vec<RelayUrl> = if excluded_own { vec![many_relay(0)] } else { Vec::new() };
        let excluded = Exclusions::from(excluded.as_slice());
        // With a scope, an announcement that drops the listed relay takes its repository
        // (and its root events) out of every relay's target.
        let scope = listing.map_or(RepoScope::All, |i| RepoScope::ListingService(vec![many_relay(i)]));
        let policy = TargetPolicy {
            scope,
            max_relays_per_pubkey: per_key,
            max_relays: max,
            reserved: vec![many_relay(7)],
            shard: shard.map(|index| Shard { index, count: 2 }),
            preferred_pubkeys: preferred.map(|k| format!("{k:02x}").repeat(32)).into_iter().collect(),
            max_urls_per_host: per_host,
            failing: failing.into_iter().map(many_relay).collect(),
            blocked_pubkeys: HashSet::default(),
        };
        let mut idx = RepoSyncIndex::default();
        let mut plan = Plan::build(&idx, &excluded, &policy);
        for batch in batches {
            // As process_batch: apply the batch, reselect if a relay set changed, then
            // add the new root-event links.
            let mut relays_changed = false;
            let mut came_alive = false;
            let mut moved: Vec<String> = Vec::new();
            let mut links = Vec::new();
            for c in batch {
                match c {
                    Change::Announce(r, relays) => {
                        let n = idx.entry(keyed(r)).or_default();
                        let set: HashSet<RelayUrl> = relays.into_iter().map(many_relay).collect();
                        if n.relays != set {
                            n.relays = set;
                            relays_changed = true;
                            moved.push(keyed(r));
                        }
                    }
                    Change::Root(i, repos) => {
                        for r in repos {
                            let n = idx.entry(keyed(r)).or_default();
                            if n.root_events.insert(id(i)) {
                                came_alive |= n.root_events.len().is_power_of_two();
                                links.push((keyed(r), id(i)));
                            }
                        }
                    }
                }
            }
            let mut changed: HashSet<RelayUrl> = HashSet::default();
            let before = plan.targets().clone();
            if relays_changed {
                if by_repo {
                    changed.extend(plan.reselect_repos(&idx, &excluded, &policy, &moved));
                } else {
                    changed.extend(plan.reselect(&idx, &excluded, &policy));
                }
            }
            // As process_batch: a first root event can lift its pubkey's tier.
            if came_alive && plan.is_bound() {
                changed.extend(plan.reselect(&idx, &excluded, &policy));
            }
            for (r, i) in links {
                changed.extend(plan.add_root_event(&r, i));
            }
            let fresh = derive_targets(&idx, &excluded, &policy);
            prop_assert_eq!(plan.targets(), &fresh.targets);
            prop_assert_eq!(plan.report(), fresh.report);
            // Every relay whose target changed is reported as changed.
            for (relay, t) in &fresh.targets {
                if before.get(relay) != Some(t) {
                    prop_assert!(changed.contains(relay), "{} changed unreported", relay);
                }
            }
            for relay in before.keys() {
                if !fresh.targets.contains_key(relay) {
                    prop_assert!(changed.contains(relay), "{} dropped unreported", relay);
                }
            }
        }
    }
}

/// One signed event's JSON, for the frame splitter property.
fn signed_event_json() -> String {
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    let keys =
        nostr::key::Keys::parse("6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e")
            .unwrap();
    EventBuilder::new(Kind::Custom(1621), "a \"quoted\" ] , { text")
        .tag(Tag::parse(["a", "30617:abc:x"]).unwrap())
        .finalize(&keys)
        .unwrap()
        .as_json()
}

/// Pieces a hostile relay could put around an event in an EVENT frame.
fn frame_piece() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just(" ".to_string()),
        Just("\n\t\r".to_string()),
        Just(",".to_string()),
        Just(",5".to_string()),
        Just("]".to_string()),
        Just("]]".to_string()),
        Just("[".to_string()),
        Just("\"".to_string()),
        Just("\\\"".to_string()),
        Just("\\".to_string()),
        Just("{}".to_string()),
        Just("{\"a\":1}".to_string()),
        Just("EVENT".to_string()),
        Just("\u{1}".to_string()),
        Just("\u{7f}".to_string()),
        Just("é".to_string()),
        "[a-z0-9:]{0,6}".prop_map(|s| s),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// The relay threads split compact EVENT frames by hand (decision 0064) and parse
    /// only the event; whenever the split and the event parse both succeed, the real frame
    /// parser reads the same subscription id and the same event JSON, so a hostile frame
    /// can never mean one thing to the shortcut and another to the parser. Neither panics.
    #[test]
    fn a_frame_split_by_hand_means_what_the_parser_reads(
        sub in prop::collection::vec(frame_piece(), 0..3),
        // Half the frames are compact around the event, so the split succeeds often.
        before in prop_oneof![Just(Vec::new()), prop::collection::vec(frame_piece(), 0..3)],
        after in prop_oneof![
            Just(vec!["]".to_string()]),
            prop::collection::vec(frame_piece(), 0..4)
        ],
        with_event in any::<bool>(),
        compact_head in any::<bool>(),
    ) {
        use grasp_sync::core::message::{parse_event, parse_relay_frame, split_event_frame, Incoming};
        let event = if with_event { signed_event_json() } else { String::new() };
        let head = if compact_head { "[\"EVENT\",\"" } else { "[\"EVENT\", \"" };
        let text = format!("{head}{}\",{}{event}{}", sub.concat(), before.concat(), after.concat());
        let parsed = parse_relay_frame(&text);
        if let Some((sub_id, raw)) = split_event_frame(&text) {
            if parse_event(raw).is_ok() {
                match parsed {
                    Ok(Incoming::Event { sub_id: s, raw: r }) => {
                        prop_assert_eq!(s.as_str(), sub_id, "{}", text);
                        prop_assert_eq!(r.get(), raw, "{}", text);
                    }
                    other => prop_assert!(false, "split {text:?} but the parser read {other:?}"),
                }
            }
        }
    }

    /// The splitter never panics, whatever the bytes.
    #[test]
    fn the_frame_splitter_takes_any_text(text in "\\PC{0,64}|\\[\"EVENT\",\"\\PC{0,40}") {
        let _ = grasp_sync::core::message::split_event_frame(&text);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// A copy is recognised by the id its JSON claims, read without parsing (decision
    /// 0066). Whenever both the reading and the event parse succeed, they name the same id, so a
    /// relay cannot make the shortcut see one event and the parser another; neither panics.
    #[test]
    fn the_claimed_id_is_the_id_the_parser_reads(
        prefix in prop_oneof![
            Just(String::new()),
            Just("{\"id\":\"".to_string()),
            Just("{\"id\": \"".to_string()),
            Just("{\"id\":\"AB".to_string()),
            "\\PC{0,8}",
        ],
        cut in 0usize..80,
        tail in prop::collection::vec(frame_piece(), 0..3),
    ) {
        use grasp_sync::core::message::{claimed_id, parse_event};
        let event = signed_event_json();
        // The event as written, or its first bytes replaced by `prefix` and cut anywhere,
        // with hostile pieces after it (another "id" field among them).
        let raw = if prefix.is_empty() {
            format!("{event}{}", tail.concat())
        } else {
            let keep = event.get(cut.min(event.len())..).unwrap_or("");
            format!("{prefix}{keep}{}", tail.concat())
        };
        if let (Some(claimed), Ok(parsed)) = (claimed_id(&raw), parse_event(&raw)) {
            prop_assert_eq!(claimed, parsed.id, "{}", raw);
        }
    }

    /// Relays order an event's members differently (nostr-rs-relay writes the id first,
    /// rust-nostr's relay builder sorts the keys, so `content` comes first) and may put
    /// whitespace between tokens: the claimed id is the parsed id in every order, with extra
    /// members (nested objects holding another "id" among them) anywhere.
    #[test]
    fn the_claimed_id_is_read_in_any_member_order(
        order in Just((0usize..8).collect::<Vec<_>>()).prop_shuffle(),
        space in prop_oneof![Just(""), Just(" "), Just("\n\t")],
        decoy in any::<bool>(),
    ) {
        use grasp_sync::core::message::{claimed_id, parse_event};
        use serde_json::Value;
        let event: serde_json::Map<String, Value> =
            serde_json::from_str(&signed_event_json()).unwrap();
        let mut members: Vec<(String, Value)> = event.into_iter().collect();
        if decoy {
            members.push((
                "x".into(),
                serde_json::json!({"id": "ab".repeat(32), "a": [["id", "}"], "\"id\":"]}),
            ));
        } else {
            members.push(("x".into(), Value::from(7)));
        }
        let body: Vec<String> = order
            .iter()
            .map(|&i| {
                let (key, value) = &members[i];
                format!("{space}{}{space}:{space}{value}{space}", Value::from(key.as_str()))
            })
            .collect();
        let raw = format!("{{{}}}", body.join(","));
        let parsed = parse_event(&raw).unwrap();
        prop_assert_eq!(claimed_id(&raw), Some(parsed.id), "{}", raw);
    }

    /// The `OK` fast path reads exactly what the JSON parser reads, whenever it reads at all;
    /// and it reads the compact shape relays send.
    #[test]
    fn the_ok_fast_path_reads_what_the_parser_reads(
        id in prop_oneof![3 => "[0-9a-f]{64}", 1 => "[0-9a-fA-F]{64}", 1 => "[0-9a-f]{63}"],
        gap in prop_oneof![Just(""), Just(" ")],
        accepted in prop_oneof![Just("true"), Just("false"), Just("1"), Just("tru")],
        message in "\\PC{0,12}|[a-z: \\\\\"\\]\\[]{0,12}",
        tail in prop_oneof![Just("]"), Just("]]"), Just(",1]"), Just("] "), Just("")],
    ) {
        use grasp_sync::core::message::{parse_ok_frame, parse_relay_frame, Incoming};
        // The message as a JSON string (escaped as serde_json writes it), or raw.
        for quoted in [serde_json::to_string(&message).unwrap(), format!("\"{message}\"")] {
            let text = format!("[\"OK\",{gap}\"{id}\",{accepted},{quoted}{tail}");
            let fast = parse_ok_frame(&text);
            if let Some((event_id, ok, msg)) = fast {
                match parse_relay_frame(&text) {
                    Ok(Incoming::Ok { event_id: e, accepted: a, message: m }) => {
                        prop_assert_eq!((event_id, ok, msg.to_string()), (e, a, m), "{}", text);
                    }
                    other => prop_assert!(false, "fast path read {} the parser read as {:?}", text, other),
                }
            }
            let compact = gap.is_empty()
                && tail == "]"
                && (accepted == "true" || accepted == "false")
                && id.len() == 64
                && !id.chars().any(|c| c.is_ascii_uppercase())
                && quoted == format!("\"{message}\"")
                && !message.chars().any(|c| c == '"' || c == '\\' || c < ' ');
            prop_assert_eq!(fast.is_some(), compact, "{}", text);
        }
    }

    /// The `OK` fast path takes any text.
    #[test]
    fn the_ok_fast_path_takes_any_text(text in "\\PC{0,90}|\\[\"OK\",\"[0-9a-f\"]{0,70}\\PC{0,12}") {
        let _ = grasp_sync::core::message::parse_ok_frame(&text);
    }

    /// The reading of a claimed id takes any text.
    #[test]
    fn the_claimed_id_reader_takes_any_text(text in "\\PC{0,80}|\\{\"id\":\"[0-9a-f\"]{0,70}\\PC{0,4}") {
        let _ = grasp_sync::core::message::claimed_id(&text);
    }

    /// What a copy's summary tells of a filter with tag conditions ([`copy_matches`]) is
    /// what the filter says of the parsed event, whenever it tells anything; it always does
    /// for conditions on printed letters and events within the print's size (issue 36).
    #[test]
    fn a_copys_summary_matches_tag_conditions_exactly_when_the_event_does(
        tags in prop::collection::vec((0usize..4, 0u8..3), 0..11),
        conditions in prop::collection::btree_map(0usize..4, prop::collection::btree_set(0u8..3, 0..3), 0..3),
    ) {
        use grasp_sync::core::dedup::{EventSummary, TAG_PRINTS};
        use grasp_sync::core::message::{copy_matches, FilterPrint};
        use nostr::event::{Event, Kind, Tag};
        use nostr::filter::{Filter, MatchEventOptions, SingleLetterTag};
        use nostr::key::PublicKey;
        use nostr::types::Timestamp;
        // `p` is not printed; the others are.
        let letters = ['a', 'A', 'e', 'p'];
        let value = |v: u8| format!("value-{v}");
        let event = Event::new(
            EventId::from_byte_array([7; 32]),
            PublicKey::from_byte_array([1; 32]),
            Timestamp::from_secs(1),
            Kind::from(1621),
            tags.iter()
                .map(|(l, v)| Tag::parse([letters[*l].to_string(), value(*v)]).unwrap()),
            "",
            nostr::event::Signature::from_byte_array([1; 64]),
        );
        let mut filter = Filter::new();
        for (l, values) in &conditions {
            filter = filter.custom_tags(
                SingleLetterTag::from_char(letters[*l]).unwrap(),
                values.iter().map(|v| value(*v)),
            );
        }
        let told = copy_matches(&filter, &FilterPrint::of(&filter), &EventSummary::of(&event));
        if let Some(m) = told {
            prop_assert_eq!(m, filter.match_event(&event, MatchEventOptions::new()));
        }
        let printed = tags.iter().filter(|(l, _)| *l != 3).count();
        if !conditions.contains_key(&3) && printed <= TAG_PRINTS {
            prop_assert!(told.is_some());
        }
    }

    /// For a filter without tag conditions, what a copy's summary can tell (window, kinds,
    /// authors) decides a match exactly as the filter does on the parsed event, empty sets
    /// included.
    #[test]
    fn a_summary_matches_a_tagless_filter_exactly_when_the_event_does(
        created_at in 0u64..20,
        kind in 0u16..4,
        author in 0u8..3,
        since in prop::option::of(0u64..20),
        until in prop::option::of(0u64..20),
        kinds in prop::option::of(prop::collection::btree_set(0u16..4, 0..3)),
        authors in prop::option::of(prop::collection::btree_set(0u8..3, 0..3)),
    ) {
        use grasp_sync::core::dedup::EventSummary;
        use grasp_sync::core::message::summary_matches;
        use nostr::event::{Event, Kind};
        use nostr::filter::{Filter, MatchEventOptions};
        use nostr::key::PublicKey;
        use nostr::types::Timestamp;
        let pk = |b: u8| PublicKey::from_byte_array([b + 1; 32]);
        let event = Event::new(
            EventId::from_byte_array([7; 32]),
            pk(author),
            Timestamp::from_secs(created_at),
            Kind::from(kind),
            [],
            "",
            nostr::event::Signature::from_byte_array([1; 64]),
        );
        let mut filter = Filter::new();
        filter.since = since.map(Timestamp::from_secs);
        filter.until = until.map(Timestamp::from_secs);
        filter.kinds = kinds.map(|k| k.into_iter().map(Kind::from).collect());
        filter.authors = authors.map(|a| a.into_iter().map(pk).collect());
        prop_assert_eq!(
            summary_matches(&filter, &EventSummary::of(&event)),
            filter.match_event(&event, MatchEventOptions::new())
        );
    }
}
