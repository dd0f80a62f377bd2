//! End-to-end over real websockets on 127.0.0.1: own relay + remote test relays.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use grasp_sync::core::state::ConnectionStatus;
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, RelayUrl};
use nostr::event::{EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;

use common::*;

#[test]
fn smoke_one_remote_relay() {
    init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let keys = Keys::generate();
    let ann = announcement(&keys, "repo", &[&[&remote.url()]]);
    let repo = format!("30617:{}:repo", keys.public_key().to_hex());
    let iss = root(&keys, 1621, &repo, "bug", &[]);
    own.insert(&ann);
    own.insert(&iss);
    remote.insert(&ann);
    let remote_issue = root(&keys, 1621, &repo, "remote bug", &[]);
    let r1 = event(&keys, 1111, "reply e", &[&["e", &iss.id.to_hex()]]);
    let r2 = event(&keys, 1111, "reply E", &[&["E", &iss.id.to_hex()]]);
    let noise = EventBuilder::new(Kind::Custom(1), "noise")
        .tag(Tag::parse(["t", "nostr"]).unwrap())
        .finalize(&keys)
        .unwrap();
    for e in [&remote_issue, &r1, &r2, &noise] {
        remote.insert(e);
    }
    let config = Config::new(url(&own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    let handle = grasp_sync::start(config).unwrap();
    let expected: HashSet<EventId> = [ann.id, iss.id, remote_issue.id, r1.id, r2.id].into();
    let ok = wait_until(WAIT, || own.event_ids() == expected);
    assert!(
        ok,
        "own relay has {:?}, expected {:?}\n{:#?}",
        own.event_ids(),
        expected,
        handle.status()
    );
    shutdown_clean(handle, &[&own, &remote]);
}

// ----- the three-relay network -----

/// Own relay O and remote relays A, B, C with overlapping relay sets, transitive discoveries
/// and noise.
struct Net {
    own: TestRelay,
    a: TestRelay,
    b: TestRelay,
    c: TestRelay,
    book: Book,
    /// Repositories each remote relay must be asked for (Layer 2).
    repos_on: HashMap<RelayUrl, HashSet<String>>,
    /// Layer-3 ids each remote relay must be asked for: the root events of its repositories
    /// and the replies followed below them (comments, statuses, quotes).
    roots_on: HashMap<RelayUrl, HashSet<EventId>>,
}

impl Net {
    fn remotes(&self) -> [&TestRelay; 3] {
        [&self.a, &self.b, &self.c]
    }

    fn all(&self) -> [&TestRelay; 4] {
        [&self.own, &self.a, &self.b, &self.c]
    }
}

fn network() -> Net {
    let (own, a, b, c) = (
        TestRelay::start(),
        TestRelay::start(),
        TestRelay::start(),
        TestRelay::start(),
    );
    let (uo, ua, ub, uc) = (own.url(), a.url(), b.url(), c.url());
    // B as a human might write it: upper-case scheme and a trailing slash.
    let ub_variant = format!("WS://127.0.0.1:{}/", b.port());
    let [alice, bob, carol, dave, eve] = std::array::from_fn(|_| Keys::generate());
    let mut book = Book::default();

    // Announcements.
    let r1 = announcement(&alice, "alpha", &[&[&ua, &ub]]);
    book.expect("R1 alpha [A,B]", &r1, &[&own, &a]);
    let r2 = announcement(&bob, "beta", &[&[&ub, &uc]]);
    book.expect("R2 beta [B,C]", &r2, &[&own]);
    let r3 = announcement(&carol, "gamma", &[&[&ua], &[&uc]]);
    book.expect("R3 gamma [A][C] (two relays tags)", &r3, &[&own]);
    let r4 = announcement(&alice, "delta", &[&[&ub_variant]]);
    book.expect("R4 delta [B written differently]", &r4, &[&own]);
    let r5 = announcement(&bob, "epsilon", &[&[&uo, &uc]]);
    book.expect("R5 epsilon [own,C]", &r5, &[&own]);
    let r6 = announcement(&carol, "zeta", &[&[&uc]]);
    book.expect("R6 zeta [C], announced on C only", &r6, &[&c]);
    let [rr1, rr2, rr3, rr4, rr5, rr6] = [
        repo_ref(&alice, "alpha"),
        repo_ref(&bob, "beta"),
        repo_ref(&carol, "gamma"),
        repo_ref(&alice, "delta"),
        repo_ref(&bob, "epsilon"),
        repo_ref(&carol, "zeta"),
    ];
    let ghost = repo_ref(&eve, "ghost");

    // State events: Layer 1 pulls every 30618 of a synced relay, even an unknown repo's.
    book.expect("state alpha on A", &repo_state(&alice, "alpha"), &[&a]);
    book.expect("state beta on C", &repo_state(&bob, "beta"), &[&c]);
    book.expect("state ghost on B", &repo_state(&eve, "ghost"), &[&b]);

    // Root events on the own relay.
    let alice_hex = alice.public_key().to_hex();
    let p1 = root(
        &dave,
        1617,
        &rr1,
        "From 1f0e Mon Sep 17 00:00:00 2001\nSubject: [PATCH] fix the parser\n",
        &[&["p", &alice_hex], &["t", "root"]],
    );
    book.expect("P1 patch alpha (own)", &p1, &[&own]);
    let i1 = root(
        &dave,
        1621,
        &rr2,
        "crash on start",
        &[&["subject", "crash"]],
    );
    book.expect("I1 issue beta (own)", &i1, &[&own]);
    let i5 = root(&dave, 1621, &rr5, "docs are wrong", &[]);
    book.expect("I5 issue epsilon (own)", &i5, &[&own]);
    let n7 = root(&eve, 1621, &ghost, "issue of an unannounced repo", &[]);
    book.expect("N7 ghost issue (own)", &n7, &[&own]);

    // Root events only on remote relays (found by Layer 2, then tracked themselves).
    let pr1 = root(&dave, 1618, &rr3, "add feature", &[&["subject", "feature"]]);
    book.expect("PR1 gamma (C)", &pr1, &[&c]);
    let pru1 = root(&dave, 1619, &rr3, "", &[&["E", &pr1.id.to_hex()]]);
    book.expect("PRU1 gamma (C)", &pru1, &[&c]);
    let i2 = root(&eve, 1621, &rr1, "remote issue alpha", &[]);
    book.expect("I2 issue alpha (B)", &i2, &[&b]);
    let i3 = root(&dave, 1621, &rr6, "issue of zeta", &[]);
    book.expect("I3 issue zeta (C)", &i3, &[&c]);
    let i4 = root(&dave, 1621, &rr4, "issue of delta", &[]);
    book.expect("I4 issue delta (B)", &i4, &[&b]);

    // Replies, statuses, quotes.
    let c1 = book.expect("C1 comment P1 (B)", &comment(&bob, &p1, "lgtm"), &[&b]);
    let c2 = book.expect("C2 comment I1 (C)", &comment(&alice, &i1, "repro?"), &[&c]);
    let c3 = book.expect("C3 comment I2 (A)", &comment(&alice, &i2, "on it"), &[&a]);
    let c4 = book.expect("C4 comment I3 (C)", &comment(&carol, &i3, "dup"), &[&c]);
    book.expect(
        "C5 comment repo beta (B)",
        &repo_comment(&dave, &rr2, "hi"),
        &[&b],
    );
    let ru = book.expect("RU comment I5 (C)", &comment(&bob, &i5, "fixed"), &[&c]);
    let s1 = book.expect("S1 applied P1 (A)", &status(&alice, 1631, &p1.id), &[&a]);
    let s2 = book.expect("S2 closed I1 (B)", &status(&bob, 1632, &i1.id), &[&b]);
    let s3 = book.expect("S3 open PR1 (A)", &status(&carol, 1630, &pr1.id), &[&a]);
    book.expect(
        "Q1 quote repo gamma (A)",
        &quote(&dave, &rr3, "see gamma"),
        &[&a],
    );
    let q2 = book.expect(
        "Q2 quote I5 (C)",
        &quote(&dave, &i5.id.to_hex(), "this"),
        &[&c],
    );

    // Noise: nothing subscribed matches these.
    book.noise("note A", &note(&eve, "gm A"), &[&a]);
    book.noise("note B", &note(&eve, "gm B"), &[&b]);
    book.noise("note C", &note(&eve, "gm C"), &[&c]);
    book.noise(
        "issue of unannounced repo (B)",
        &root(&eve, 1621, &ghost, "ghost bug", &[]),
        &[&b],
    );
    let unknown = note(&eve, "never published").id;
    book.noise(
        "reply to unknown id (A)",
        &comment_on_id(&eve, &unknown, "?"),
        &[&a],
    );
    book.noise(
        "status of unknown id (C)",
        &status(&eve, 1630, &unknown),
        &[&c],
    );
    book.noise("quote of ghost repo (C)", &quote(&eve, &ghost, "q"), &[&c]);
    book.noise(
        "reply to ghost issue N7 (B)",
        &comment(&eve, &n7, "no relays"),
        &[&b],
    );

    let set = |v: &[&String]| v.iter().map(|s| s.to_string()).collect::<HashSet<_>>();
    let repos_on = HashMap::from([
        (url(&a), set(&[&rr1, &rr3])),
        (url(&b), set(&[&rr1, &rr2, &rr4])),
        (url(&c), set(&[&rr2, &rr3, &rr5, &rr6])),
    ]);
    // Root events, then the replies below them, each followed (a Layer-3 id of the root's
    // repositories' relays).
    let roots_on = HashMap::from([
        (
            url(&a),
            HashSet::from([p1.id, i2.id, pr1.id, pru1.id, c1, c3, s1, s3]),
        ),
        (
            url(&b),
            HashSet::from([p1.id, i2.id, i1.id, i4.id, c1, c3, s1, c2, s2]),
        ),
        (
            url(&c),
            HashSet::from([i1.id, pr1.id, pru1.id, i3.id, i5.id, c2, s2, s3, c4, ru, q2]),
        ),
    ]);
    Net {
        own,
        a,
        b,
        c,
        book,
        repos_on,
        roots_on,
    }
}

fn start(own: &TestRelay, window_ms: u64) -> grasp_sync::SyncHandle {
    let config = Config::new(url(own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(window_ms));
    grasp_sync::start(config).unwrap()
}

#[test]
fn three_relays_converge_to_exactly_the_expected_set() {
    init_logging();
    let net = network();
    let seeded = net.own.len() as u64;
    let t0 = Instant::now();
    let handle = start(&net.own, 150);
    assert_converges(&net.own, &net.book, &handle);
    eprintln!(
        "converged in {:?}: {} events",
        t0.elapsed(),
        net.book.expected.len()
    );

    let status = handle.status();
    let mut urls: Vec<RelayUrl> = status.relays.iter().map(|r| r.url.clone()).collect();
    urls.sort();
    let mut want: Vec<RelayUrl> = net.remotes().iter().map(|r| url(r)).collect();
    want.sort();
    assert_eq!(urls, want, "remote relays (own relay excluded, B merged)");
    for r in &status.relays {
        assert_eq!(r.connection_status, ConnectionStatus::Connected, "{r:#?}");
        assert_eq!(r.target_repos, net.repos_on[&r.url].len(), "{r:#?}");
        assert_eq!(r.confirmed_repos, net.repos_on[&r.url].len(), "{r:#?}");
        assert_eq!(r.target_root_events, net.roots_on[&r.url].len(), "{r:#?}");
        assert_eq!(
            r.confirmed_root_events,
            net.roots_on[&r.url].len(),
            "{r:#?}"
        );
        assert_eq!(r.pending_batches, 0, "{r:#?}");
        assert_eq!(r.events_invalid, 0, "{r:#?}");
        assert_eq!(r.events_unmatched, 0, "{r:#?}");
    }
    assert_eq!(status.rejected, 0);
    // Every event new to the own relay was stored by the forwarder exactly once. (The
    // forwarder publishes its counters once per loop turn, so they may trail the relay.)
    let forwarded_new = net.book.expected.len() as u64 - seeded;
    let counted = wait_until(WAIT, || {
        let s = handle.status();
        s.forwarded == forwarded_new && s.forward_backlog == 0
    });
    let status = handle.status();
    assert!(counted, "forwarded {forwarded_new} expected\n{status:#?}");
    assert_eq!(status.rejected, 0);
    shutdown_clean(handle, &net.all());
}

#[test]
fn reqs_follow_the_layer_design() {
    init_logging();
    let net = network();
    let handle = start(&net.own, 150);
    assert_converges(&net.own, &net.book, &handle);

    for relay in net.remotes() {
        let u = url(relay);
        let by_conn = reqs_by_conn(relay);
        assert!(!by_conn.is_empty(), "{u}: no REQ");
        let first_conn = *by_conn.keys().next().unwrap();
        let mut l2: BTreeMap<char, HashSet<String>> = BTreeMap::new();
        let mut l3: BTreeMap<char, HashSet<String>> = BTreeMap::new();
        for (conn, reqs) in &by_conn {
            let mut l1 = 0;
            for r in reqs {
                // Several filters of one lifetime per REQ, at most 10 (decision 0110).
                assert!(r.filters.len() <= 10, "{u}: {}", r.raw);
                for f in &r.filters {
                    match classify(f) {
                        Layer::L1 { since } => {
                            l1 += 1;
                            if *conn == first_conn {
                                assert_eq!(since, None, "{u}: L1 with since on first connect");
                            }
                        }
                        Layer::L2 { tag, values, since } => {
                            assert!(values.len() <= 100, "{u}: {}", r.raw);
                            if *conn == first_conn {
                                assert_eq!(since, None, "{u}: {}", r.raw);
                            }
                            for v in values {
                                assert!(
                                    l2.entry(tag).or_default().insert(v.clone()),
                                    "{u}: repo {v} requested twice with #{tag}"
                                );
                            }
                        }
                        Layer::L3 { tag, values, since } => {
                            assert!(values.len() <= 100, "{u}: {}", r.raw);
                            if *conn == first_conn {
                                assert_eq!(since, None, "{u}: {}", r.raw);
                            }
                            for v in values {
                                assert!(
                                    l3.entry(tag).or_default().insert(v.clone()),
                                    "{u}: root {v} requested twice with #{tag}"
                                );
                            }
                        }
                        other => panic!("{u}: REQ outside the layer design: {other:?} ({})", r.raw),
                    }
                }
            }
            assert_eq!(l1, 1, "{u}: connection {conn} has {l1} Layer-1 REQs");
        }
        let repos = &net.repos_on[&u];
        let roots: HashSet<String> = net.roots_on[&u].iter().map(|i| i.to_hex()).collect();
        assert_eq!(l2.keys().copied().collect::<Vec<_>>(), vec!['A', 'a', 'q']);
        for (tag, values) in &l2 {
            assert_eq!(values, repos, "{u}: Layer-2 #{tag} repos");
        }
        assert_eq!(l3.keys().copied().collect::<Vec<_>>(), vec!['E', 'e', 'q']);
        for (tag, values) in &l3 {
            assert_eq!(
                values, &roots,
                "{u}: Layer-3 #{tag} ids (roots and replies)"
            );
        }
    }
    // The own relay only ever sees the self-subscription.
    for r in net.own.reqs() {
        assert_eq!(r.filters.len(), 1, "{}", r.raw);
        assert!(
            matches!(classify(&r.filters[0]), Layer::SelfSub { since: None }),
            "own relay got {}",
            r.raw
        );
    }
    shutdown_clean(handle, &net.all());
}

#[test]
fn layer2_chunks_250_repos_into_nine_filters() {
    init_logging();
    let own = TestRelay::start();
    let x = TestRelay::start();
    let keys: Vec<Keys> = (0..5).map(|_| Keys::generate()).collect();
    let mut book = Book::default();
    let mut repos = HashSet::new();
    for i in 0..250 {
        let k = &keys[i % 5];
        let d = format!("repo-{i:03}");
        book.expect(&d, &announcement(k, &d, &[&[&x.url()]]), &[&own]);
        repos.insert(repo_ref(k, &d));
    }
    let first = repo_ref(&keys[0], "repo-000");
    let i1 = root(&keys[1], 1621, &first, "one", &[]);
    let i2 = root(&keys[2], 1617, &first, "two", &[]);
    book.expect("issue", &i1, &[&own]);
    book.expect("patch", &i2, &[&own]);
    let reply = comment(&keys[3], &i1, "reply");
    book.expect("reply", &reply, &[&x]);

    let handle = start(&own, 200);
    assert_converges(&own, &book, &handle);

    let reqs = x.reqs();
    let mut l1 = 0;
    let mut l2: BTreeMap<char, Vec<usize>> = BTreeMap::new();
    let mut l2_values: BTreeMap<char, HashSet<String>> = BTreeMap::new();
    let mut l3: Vec<(char, Vec<String>)> = Vec::new();
    for r in &reqs {
        // Several filters of one lifetime per REQ, at most 10 (decision 0110).
        assert!(r.filters.len() <= 10, "{}", r.raw);
        for f in &r.filters {
            match classify(f) {
                Layer::L1 { since: None } => l1 += 1,
                Layer::L2 {
                    tag,
                    values,
                    since: None,
                } => {
                    l2.entry(tag).or_default().push(values.len());
                    l2_values.entry(tag).or_default().extend(values);
                }
                Layer::L3 {
                    tag,
                    values,
                    since: None,
                } => l3.push((tag, values)),
                other => panic!("unexpected REQ {other:?}: {}", r.raw),
            }
        }
    }
    assert_eq!(l1, 1);
    assert_eq!(l2.values().map(Vec::len).sum::<usize>(), 9, "{l2:?}");
    for (tag, sizes) in &mut l2 {
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(sizes, &vec![100, 100, 50], "#{tag} chunk sizes");
        assert_eq!(l2_values[tag], repos, "#{tag} repos");
    }
    assert_eq!(l2.keys().copied().collect::<Vec<_>>(), vec!['A', 'a', 'q']);
    // The two root events first; the reply, once stored, is followed below its root: a
    // second Layer-3 batch for it alone.
    let roots: BTreeSet<String> = [i1.id.to_hex(), i2.id.to_hex()].into();
    let mut by_tag: BTreeMap<char, Vec<BTreeSet<String>>> = BTreeMap::new();
    for (tag, values) in l3 {
        by_tag
            .entry(tag)
            .or_default()
            .push(values.into_iter().collect());
    }
    assert_eq!(
        by_tag.keys().copied().collect::<Vec<_>>(),
        vec!['E', 'e', 'q']
    );
    for (tag, batches) in by_tag {
        let replies: BTreeSet<String> = [reply.id.to_hex()].into();
        assert_eq!(batches, vec![roots.clone(), replies], "#{tag}");
    }
    shutdown_clean(handle, &[&own, &x]);
}

#[test]
fn announcement_published_while_running_is_picked_up() {
    init_logging();
    let window = Duration::from_millis(150);
    let own = TestRelay::start();
    let a = TestRelay::start();
    let d = TestRelay::start();
    let alice = Keys::generate();
    let bob = Keys::generate();
    let mut book = Book::default();
    let r1 = announcement(&alice, "one", &[&[&a.url()]]);
    book.expect("R1 [A]", &r1, &[&own]);
    let ra = repo_ref(&alice, "one");
    book.expect("I1 on A", &root(&bob, 1621, &ra, "i1", &[]), &[&a]);
    // D: not named by anything yet.
    let rn = repo_ref(&bob, "new");
    let i_new = root(&alice, 1621, &rn, "issue on D", &[]);
    let c_new = comment(&alice, &i_new, "reply on D");
    let st_new = repo_state(&bob, "new");
    book.noise("note on D", &note(&bob, "gm"), &[&d]);
    for e in [&i_new, &c_new, &st_new] {
        d.insert(e);
    }

    let handle = grasp_sync::start(
        Config::new(url(&own))
            .allow_private_relays(true)
            .batch_window(window),
    )
    .unwrap();
    assert_converges(&own, &book, &handle);
    assert!(d.reqs().is_empty(), "D contacted before it was announced");
    assert_eq!(d.connections_accepted(), 0);

    let ann = announcement(&bob, "new", &[&[&d.url()]]);
    let t0 = Instant::now();
    book.expect("R-new [D] (live)", &ann, &[&own]);
    let picked = wait_until(window * 15, || has_l2_req(&d, 'a', &rn));
    let took = t0.elapsed();
    assert!(
        picked,
        "no #a REQ for {rn} on D after {took:?}; D REQs: {:?}\n{:#?}",
        d.reqs().iter().map(|r| r.raw.clone()).collect::<Vec<_>>(),
        handle.status()
    );
    eprintln!("live announcement: D subscribed after {took:?}");
    book.expected.extend([i_new.id, c_new.id, st_new.id]);
    assert_converges(&own, &book, &handle);
    assert!(has_l3_req(&d, 'E', &i_new.id));
    let status = handle.status();
    let dst = status.relay(&url(&d)).expect("D in status");
    assert_eq!(dst.connection_status, ConnectionStatus::Connected);
    // The issue and the reply followed below it.
    assert_eq!((dst.confirmed_repos, dst.confirmed_root_events), (1, 2));
    shutdown_clean(handle, &[&own, &a, &d]);
}

#[test]
fn forged_and_unmatched_events_are_dropped_and_counted() {
    init_logging();
    let own = TestRelay::start();
    let x = TestRelay::start();
    let alice = Keys::generate();
    let eve = Keys::generate();
    let mut book = Book::default();
    let r = repo_ref(&alice, "repo");
    book.expect(
        "R [X]",
        &announcement(&alice, "repo", &[&[&x.url()]]),
        &[&own],
    );
    let iss = root(&alice, 1621, &r, "genuine", &[]);
    book.expect("issue (X)", &iss, &[&x]);

    // Planted before start: served in the stored answer of the #a subscription.
    let bad_sig = root(&eve, 1621, &r, "forged signature", &[]);
    let bad_id = root(&eve, 1621, &r, "original content", &[]);
    assert!(x.insert_raw(&forge_signature(&bad_sig)).unwrap());
    assert!(x
        .insert_raw(&forge_content(&bad_id, "tampered content"))
        .unwrap());
    book.names.insert(bad_sig.id, "forged sig (stored)".into());
    book.names.insert(bad_id.id, "forged id (stored)".into());

    let handle = start(&own, 100);
    assert_converges(&own, &book, &handle);
    let s = handle.status();
    assert_eq!(s.invalid, 2, "two forged events served by X\n{s:#?}");
    assert_eq!(s.unmatched, 0, "{s:#?}");

    let conns = reqs_by_conn(&x);
    assert_eq!(conns.len(), 1, "X reconnected");
    let conn = *conns.keys().next().unwrap();
    let open = x.open_subscriptions();
    assert_eq!(open, conns[&conn].len(), "engine closed subscriptions on X");

    // Planted while running: delivered live to the matching subscription(s) only.
    let live_forged = root(&eve, 1621, &r, "live forged", &[]);
    book.names
        .insert(live_forged.id, "forged sig (live insert)".into());
    let m_live = matching_reqs(&x, conn, &live_forged);
    assert!(m_live >= 1);
    x.insert_raw(&forge_signature(&live_forged)).unwrap();
    // Pushed to every open subscription: the matching ones count it invalid, the rest
    // unmatched.
    let pushed_forged = root(&eve, 1621, &r, "pushed forged", &[]);
    book.names
        .insert(pushed_forged.id, "forged sig (pushed)".into());
    let m_pushed = matching_reqs(&x, conn, &pushed_forged);
    x.push_to_subscriptions(&forge_signature(&pushed_forged));
    let pushed_id = root(&eve, 1621, &r, "pushed", &[]);
    book.names.insert(pushed_id.id, "forged id (pushed)".into());
    x.push_to_subscriptions(&forge_content(&pushed_id, "tampered"));
    // A valid note that matches no subscription.
    let stray = note(&eve, "valid but unrelated");
    book.names
        .insert(stray.id, "valid unmatched note (pushed)".into());
    assert_eq!(matching_reqs(&x, conn, &stray), 0);
    x.push_to_subscriptions(&stray.as_json());

    let want_invalid = 2 + (m_live + 2 * m_pushed) as u64;
    let want_unmatched = (2 * (open - m_pushed) + open) as u64;
    let counted = wait_until(WAIT, || {
        let s = handle.status();
        s.invalid == want_invalid && s.unmatched == want_unmatched
    });
    let s = handle.status();
    assert!(
        counted,
        "invalid {} (want {want_invalid}), unmatched {} (want {want_unmatched})\n{s:#?}",
        s.invalid, s.unmatched
    );
    // A genuine event afterwards still flows (and proves the queue before it drained).
    let after = comment(&alice, &iss, "genuine reply");
    book.expect("reply (X, live)", &after, &[&x]);
    assert_converges(&own, &book, &handle);
    let s = handle.status();
    assert_eq!(
        s.rejected, 0,
        "forwarder sent something the own relay refused"
    );
    assert_eq!((s.invalid, s.unmatched), (want_invalid, want_unmatched));
    for id in [
        bad_sig.id,
        bad_id.id,
        live_forged.id,
        pushed_forged.id,
        pushed_id.id,
        stray.id,
    ] {
        assert!(!own.contains(&id), "{} forwarded", book.name(&id));
    }
    shutdown_clean(handle, &[&own, &x]);
}

#[test]
fn own_relay_and_its_aliases_are_never_synced_from() {
    init_logging();
    let own = TestRelay::start();
    let a = TestRelay::start();
    let own_slash = format!("{}/", own.url());
    let own_upper = format!("WS://127.0.0.1:{}", own.port());
    // Another path on the own relay's port: a distinct URL that reaches the own relay.
    let alias = format!("{}/public", own.url());
    let [alice, bob, carol, dave] = std::array::from_fn(|_| Keys::generate());
    let mut book = Book::default();
    let ua = a.url();
    let r1 = repo_ref(&alice, "one");
    let r2 = repo_ref(&bob, "two");
    let r3 = repo_ref(&carol, "three");
    book.expect(
        "R1 [own/, A]",
        &announcement(&alice, "one", &[&[&own_slash, &ua]]),
        &[&own],
    );
    book.expect(
        "R2 [alias][A]",
        &announcement(&bob, "two", &[&[&alias], &[&ua]]),
        &[&own],
    );
    book.expect(
        "R3 [WS://own]",
        &announcement(&carol, "three", &[&[&own_upper]]),
        &[&own],
    );
    book.expect("I3 (own)", &root(&dave, 1621, &r3, "x", &[]), &[&own]);
    book.expect(
        "R4 on A [alias, own/]",
        &announcement(&dave, "four", &[&[&alias, &own_slash]]),
        &[&a],
    );
    book.expect("I1 (A)", &root(&dave, 1621, &r1, "i1", &[]), &[&a]);
    book.expect("I2 (A)", &root(&dave, 1621, &r2, "i2", &[]), &[&a]);

    let config = Config::new(url(&own))
        .allow_private_relays(true)
        .public_url(RelayUrl::parse(&alias).unwrap())
        .batch_window(Duration::from_millis(100));
    let handle = grasp_sync::start(config).unwrap();
    assert_converges(&own, &book, &handle);
    assert!(has_l2_req(&a, 'a', &r1) && has_l2_req(&a, 'a', &r2));

    let status = handle.status();
    let urls: Vec<String> = status.relays.iter().map(|r| r.url.to_string()).collect();
    assert_eq!(urls, vec![url(&a).to_string()], "{status:#?}");
    let own_reqs = own.reqs();
    assert!(!own_reqs.is_empty());
    for r in &own_reqs {
        assert_eq!(r.filters.len(), 1, "{}", r.raw);
        let layer = classify(&r.filters[0]);
        assert!(
            matches!(layer, Layer::SelfSub { .. }),
            "own relay was synced from: {}",
            r.raw
        );
    }
    shutdown_clean(handle, &[&own, &a]);
}

#[test]
fn shutdown_closes_every_connection() {
    init_logging();
    let own = TestRelay::start();
    let a = TestRelay::start();
    let b = TestRelay::start();
    let alice = Keys::generate();
    let r = repo_ref(&alice, "repo");
    let ann = announcement(&alice, "repo", &[&[&a.url(), &b.url()]]);
    own.insert(&ann);
    let iss = root(&alice, 1621, &r, "issue", &[]);
    a.insert(&iss);
    // B never finishes its stored answers: a batch stays pending during shutdown.
    b.set_withhold_eose(true);

    let handle = start(&own, 100);
    assert!(wait_until(WAIT, || own.contains(&iss.id)
        && has_l2_req(&b, 'a', &r)
        && has_l3_req(&b, 'e', &iss.id)));
    assert!(own.current_connections() >= 1);
    assert!(a.current_connections() == 1 && b.current_connections() == 1);
    let status = handle.status();
    assert!(
        !status.is_settled(),
        "B's batch should be pending\n{status:#?}"
    );
    let t0 = Instant::now();
    shutdown_clean(handle, &[&own, &a, &b]);
    eprintln!("shutdown + connections closed in {:?}", t0.elapsed());
}

/// A relay thread blocked in a long quiet-tick read is woken when the engine stops
/// (decision 0067): with a quiet tick of 10 minutes, shutdown still ends within its
/// 30 s deadline, and every connection is closed. Without the wake-up the threads would
/// notice `Shutdown` only at their next tick and the deadline would pass.
#[test]
fn quiet_connections_stop_at_once_whatever_their_tick() {
    init_logging();
    let own = TestRelay::start();
    let a = TestRelay::start();
    let alice = Keys::generate();
    let r = repo_ref(&alice, "repo");
    own.insert(&announcement(&alice, "repo", &[&[&a.url()]]));
    let iss = root(&alice, 1621, &r, "issue", &[]);
    a.insert(&iss);
    let mut config = Config::new(url(&own))
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(100));
    config.ws.idle_tick = Duration::from_millis(200);
    config.ws.quiet_after = Duration::from_millis(300);
    config.ws.quiet_tick = Duration::from_secs(600);
    // No ping deadline within the test either (a ping due would end the read too).
    config.ping_interval = Duration::from_secs(600);
    let handle = grasp_sync::start(config).unwrap();
    assert!(wait_until(WAIT, || own.contains(&iss.id)
        && handle.status().is_settled()));
    // Past the busy tick and `quiet_after`: both threads now block in 10-minute reads.
    std::thread::sleep(Duration::from_secs(2));
    let t0 = Instant::now();
    handle
        .shutdown(Duration::from_secs(30))
        .expect("every thread stops within the deadline");
    assert!(wait_until(WAIT, || own.current_connections() == 0
        && a.current_connections() == 0));
    eprintln!("quiet engine stopped in {:?}", t0.elapsed());
}

/// Regression: `Status::is_settled()` once reported "settled" while events were still in the
/// relay-to-forwarder channel or awaiting the own relay's OK. `forward_backlog` now counts every
/// event from the moment a relay thread hands it over until the own relay answers.
#[test]
fn settled_status_agrees_with_the_own_relay() {
    init_logging();
    let own = TestRelay::start();
    let x = TestRelay::start();
    let alice = Keys::generate();
    let r = repo_ref(&alice, "repo");
    let ann = announcement(&alice, "repo", &[&[&x.url()]]);
    own.insert(&ann);
    let mut want: HashSet<EventId> = [ann.id].into();
    for i in 0..300 {
        let e = repo_comment(&alice, &r, &format!("comment {i}"));
        x.insert(&e);
        want.insert(e.id);
    }
    let handle = start(&own, 100);
    // The first moment the engine calls itself settled with x confirmed.
    let settled = wait_until(WAIT, || {
        let s = handle.status();
        s.is_settled() && s.relays.iter().any(|r| r.confirmed_repos == 1)
    });
    assert!(settled);
    let s = handle.status();
    let held = own.len();
    assert_eq!(
        (s.forwarded as usize, held),
        (300, 301),
        "settled but forwarded={} and own relay holds {held} of 301\n{s:#?}",
        s.forwarded
    );
    shutdown_clean(handle, &[&own, &x]);
}
