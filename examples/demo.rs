//! A self-contained demonstration of GRASP-02 proactive sync over loopback websockets.
//!
//! Starts an own relay and three remote relays (in-process `TestRelay`s), seeds them with
//! realistic NIP-34 data plus unrelated noise, runs the engine and waits until the own relay
//! holds exactly the events it should: everything related to its repositories, nothing else.
//!
//! ```text
//! cargo run --release --features testing --example demo
//! RUST_LOG=grasp_sync=info cargo run --release --features testing --example demo
//! ```
//!
//! Exits 0 when the own relay ends up with exactly the expected event set, 1 otherwise.
//!
//! For a look at the status page (`docs/check-status-page.sh`):
//! `GRASP_SYNC_DEMO_METRICS_ADDR=127.0.0.1:9464` serves `/`, `/status` and `/metrics` there;
//! `GRASP_SYNC_DEMO_HOLD_SECS=N` keeps the engine and the listener running N s after the own
//! relay is complete; `GRASP_SYNC_DEMO_EOSE_DELAY_MS=N` makes relay C send each EOSE N ms
//! late and publish a budget of 2 subscriptions (a slower sync whose progress can be watched).

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use grasp_sync::core::state::ConnectionStatus;
use grasp_sync::testing::TestRelay;
use grasp_sync::{Config, RelayUrl, Status};
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;

const BATCH_WINDOW: Duration = Duration::from_millis(500);
const DEADLINE: Duration = Duration::from_secs(300);
const PROGRESS_EVERY: Duration = Duration::from_millis(500);
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

// ----- event builders -----

fn event(keys: &Keys, kind: u16, content: &str, tags: &[&[&str]]) -> Event {
    let mut b = EventBuilder::new(Kind::Custom(kind), content);
    for t in tags {
        b = b.tag(Tag::parse(t.iter().copied()).expect("tag"));
    }
    b.finalize(keys).expect("sign")
}

fn hex(keys: &Keys) -> String {
    keys.public_key().to_hex()
}

fn repo_ref(keys: &Keys, d: &str) -> String {
    format!("30617:{}:{d}", hex(keys))
}

/// A kind-30617 announcement; every entry of `relay_tags` is one `relays` tag.
fn announcement(keys: &Keys, d: &str, description: &str, relay_tags: &[&[&str]]) -> Event {
    let clone = format!("https://git.example.com/{}/{d}.git", &hex(keys)[..8]);
    let mut tags: Vec<Vec<&str>> = vec![
        vec!["d", d],
        vec!["name", d],
        vec!["description", description],
        vec!["clone", &clone],
        vec!["t", "nostr"],
    ];
    for r in relay_tags {
        let mut t = vec!["relays"];
        t.extend_from_slice(r);
        tags.push(t);
    }
    let refs: Vec<&[&str]> = tags.iter().map(|t| t.as_slice()).collect();
    event(keys, 30617, "", &refs)
}

/// A kind-30618 repository state event.
fn repo_state(keys: &Keys, d: &str, head: &str) -> Event {
    event(
        keys,
        30618,
        "",
        &[
            &["d", d],
            &["refs/heads/main", head],
            &["HEAD", "ref: refs/heads/main"],
        ],
    )
}

fn patch(
    keys: &Keys,
    repo: &str,
    maintainer: &Keys,
    subject: &str,
    reply_to: Option<&Event>,
) -> Event {
    let content = format!(
        "From 8d1c3b0a Mon Sep 17 00:00:00 2001\nFrom: contributor\nSubject: [PATCH] {subject}\n\n---\n src/lib.rs | 2 +-\n"
    );
    let m = hex(maintainer);
    let mut tags: Vec<Vec<String>> = vec![
        vec!["a".into(), repo.into()],
        vec!["p".into(), m],
        vec![
            "r".into(),
            "4b825dc642cb6eb9a060e54bf8d69288fbee4904".into(),
        ],
    ];
    match reply_to {
        None => tags.push(vec!["t".into(), "root".into()]),
        Some(root) => tags.push(vec![
            "e".into(),
            root.id.to_hex(),
            String::new(),
            "reply".into(),
        ]),
    }
    let refs: Vec<Vec<&str>> = tags
        .iter()
        .map(|t| t.iter().map(String::as_str).collect())
        .collect();
    let refs: Vec<&[&str]> = refs.iter().map(|t| t.as_slice()).collect();
    event(keys, 1617, &content, &refs)
}

fn pull_request(keys: &Keys, repo: &str, subject: &str) -> Event {
    event(
        keys,
        1618,
        "Adds the feature discussed in the issue.",
        &[
            &["a", repo],
            &["subject", subject],
            &["c", "a3f2b1c4d5e6f708192a3b4c5d6e7f8091a2b3c4"],
            &["clone", "https://git.example.com/fork.git"],
        ],
    )
}

fn pr_update(keys: &Keys, repo: &str, pr: &Event) -> Event {
    event(
        keys,
        1619,
        "",
        &[
            &["a", repo],
            &["E", &pr.id.to_hex()],
            &["P", &pr.pubkey.to_hex()],
            &["c", "b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7"],
        ],
    )
}

fn issue(keys: &Keys, repo: &str, subject: &str, body: &str) -> Event {
    event(keys, 1621, body, &[&["a", repo], &["subject", subject]])
}

/// A NIP-22 comment (kind 1111) on a root event.
fn comment(keys: &Keys, root: &Event, text: &str) -> Event {
    let id = root.id.to_hex();
    let kind = root.kind.as_u16().to_string();
    let pk = root.pubkey.to_hex();
    event(
        keys,
        1111,
        text,
        &[
            &["E", &id],
            &["K", &kind],
            &["P", &pk],
            &["e", &id],
            &["k", &kind],
            &["p", &pk],
        ],
    )
}

/// A NIP-22 comment on a repository itself (`A` = the repository coordinate).
fn repo_comment(keys: &Keys, repo: &str, text: &str) -> Event {
    event(
        keys,
        1111,
        text,
        &[&["A", repo], &["K", "30617"], &["a", repo], &["k", "30617"]],
    )
}

/// A status event: 1630 open, 1631 applied/merged, 1632 closed, 1633 draft.
fn status(keys: &Keys, kind: u16, root: &Event) -> Event {
    let content = match kind {
        1630 => "reopened",
        1631 => "applied in 8d1c3b0",
        1632 => "closed: cannot reproduce",
        _ => "marked as draft",
    };
    event(
        keys,
        kind,
        content,
        &[
            &["e", &root.id.to_hex(), "", "root"],
            &["p", &root.pubkey.to_hex()],
        ],
    )
}

/// A kind-1 note quoting `value` (a repository coordinate or an event id).
fn quote(keys: &Keys, value: &str, text: &str) -> Event {
    event(keys, 1, text, &[&["q", value]])
}

// ----- the scenario -----

struct Relays {
    own: TestRelay,
    a: TestRelay,
    b: TestRelay,
    c: TestRelay,
}

#[derive(Default)]
struct Seed {
    names: HashMap<EventId, String>,
    expected: HashSet<EventId>,
    noise: HashSet<EventId>,
}

impl Seed {
    fn expect(&mut self, name: &str, e: &Event, on: &[&TestRelay]) {
        for r in on {
            r.insert(e);
        }
        self.names.insert(e.id, name.to_string());
        self.expected.insert(e.id);
    }

    fn noise(&mut self, name: &str, e: &Event, on: &[&TestRelay]) {
        for r in on {
            r.insert(e);
        }
        self.names.insert(e.id, name.to_string());
        self.noise.insert(e.id);
    }

    fn name(&self, id: &EventId) -> String {
        self.names
            .get(id)
            .cloned()
            .unwrap_or_else(|| format!("<unknown {}>", id.to_hex()))
    }
}

fn seed(r: &Relays) -> Seed {
    let (own, a, b, c) = (&r.own, &r.a, &r.b, &r.c);
    let (uo, ua, ub, uc) = (own.url(), a.url(), b.url(), c.url());
    // Relay B as someone typed it: upper-case scheme, trailing slash.
    let ub_variant = format!("WS://127.0.0.1:{}/", b.port());
    let [alice, bob, carol, dave, erin, mallory] = std::array::from_fn(|_| Keys::generate());
    let mut s = Seed::default();

    // Repository announcements.
    let workshop = repo_ref(&alice, "gitworkshop");
    let workshop_bob = repo_ref(&bob, "gitworkshop");
    let tools = repo_ref(&bob, "relay-tools");
    let sdk = repo_ref(&carol, "sdk-mirror");
    let dotfiles = repo_ref(&alice, "dotfiles");
    let grasp = repo_ref(&bob, "grasp-server");
    let docs = repo_ref(&carol, "docs");
    let ghost = repo_ref(&mallory, "ghost");
    s.expect(
        "ann gitworkshop (alice) [A,B]",
        &announcement(
            &alice,
            "gitworkshop",
            "web UI for git over nostr",
            &[&[&ua, &ub]],
        ),
        &[own, a],
    );
    s.expect(
        "ann gitworkshop (bob, co-maintainer) [A]",
        &announcement(&bob, "gitworkshop", "web UI for git over nostr", &[&[&ua]]),
        &[own],
    );
    s.expect(
        "ann relay-tools (bob) [B,C]",
        &announcement(&bob, "relay-tools", "relay admin tools", &[&[&ub, &uc]]),
        &[own],
    );
    s.expect(
        "ann sdk-mirror (carol) [A][C] two relays tags",
        &announcement(&carol, "sdk-mirror", "mirror of the SDK", &[&[&ua], &[&uc]]),
        &[own],
    );
    s.expect(
        "ann dotfiles (alice) [WS://B/]",
        &announcement(&alice, "dotfiles", "my dotfiles", &[&[&ub_variant]]),
        &[own],
    );
    s.expect(
        "ann grasp-server (bob) [own,C]",
        &announcement(&bob, "grasp-server", "GRASP server", &[&[&uo, &uc]]),
        &[own],
    );
    s.expect(
        "ann docs (carol) [C], only on C",
        &announcement(&carol, "docs", "documentation site", &[&[&uc]]),
        &[c],
    );

    // State events (Layer 1 pulls every 30618 on a synced relay).
    s.expect(
        "state gitworkshop (alice) on A",
        &repo_state(
            &alice,
            "gitworkshop",
            "1111111111111111111111111111111111111111",
        ),
        &[a],
    );
    s.expect(
        "state relay-tools (bob) on C",
        &repo_state(
            &bob,
            "relay-tools",
            "2222222222222222222222222222222222222222",
        ),
        &[c],
    );
    s.expect(
        "state sdk-mirror (carol) on A and C",
        &repo_state(
            &carol,
            "sdk-mirror",
            "3333333333333333333333333333333333333333",
        ),
        &[a, c],
    );

    // Root events held by the own relay.
    let p1 = patch(&dave, &workshop, &alice, "fix the diff viewer", None);
    s.expect("patch 1/2 gitworkshop (own)", &p1, &[own]);
    let i1 = issue(
        &erin,
        &tools,
        "crash on start",
        "segfault when the config is empty",
    );
    s.expect("issue relay-tools (own)", &i1, &[own]);
    let i5 = issue(&dave, &grasp, "docs are wrong", "the README says port 80");
    s.expect("issue grasp-server (own)", &i5, &[own]);
    let orphan = issue(&mallory, &ghost, "free coins", "click here");
    s.expect("issue of an unannounced repo (own)", &orphan, &[own]);

    // Root events only on remote relays: found by Layer 2, then tracked themselves.
    let p2 = patch(
        &dave,
        &workshop,
        &alice,
        "add tests for the viewer",
        Some(&p1),
    );
    s.expect("patch 2/2 gitworkshop (A)", &p2, &[a]);
    let pr1 = pull_request(&erin, &sdk, "bump the SDK");
    s.expect("PR sdk-mirror (C)", &pr1, &[c]);
    let pru1 = pr_update(&erin, &sdk, &pr1);
    s.expect("PR update sdk-mirror (C)", &pru1, &[c]);
    let i2 = issue(&erin, &workshop, "dark mode", "please add a dark mode");
    s.expect("issue gitworkshop (B)", &i2, &[b]);
    let i3 = issue(&dave, &docs, "broken link", "the install page 404s");
    s.expect("issue docs (C)", &i3, &[c]);
    let i4 = issue(&erin, &dotfiles, "vimrc", "which plugin manager?");
    s.expect("issue dotfiles (B)", &i4, &[b]);
    let i6 = issue(&dave, &workshop_bob, "fork sync", "bob's fork is behind");
    s.expect("issue gitworkshop (bob) (A)", &i6, &[a]);

    // Discussion: comments, statuses, quotes.
    s.expect("comment on patch 1 (B)", &comment(&bob, &p1, "LGTM"), &[b]);
    s.expect(
        "comment on relay-tools issue (C)",
        &comment(&bob, &i1, "repro steps?"),
        &[c],
    );
    s.expect(
        "comment on dark mode issue (A)",
        &comment(&alice, &i2, "on it"),
        &[a],
    );
    s.expect(
        "comment on docs issue (C)",
        &comment(&carol, &i3, "fixed"),
        &[c],
    );
    s.expect(
        "comment on grasp issue (C)",
        &comment(&bob, &i5, "thanks"),
        &[c],
    );
    s.expect(
        "comment on PR (A)",
        &comment(&carol, &pr1, "needs rebase"),
        &[a],
    );
    s.expect(
        "comment on repo relay-tools (B)",
        &repo_comment(&dave, &tools, "love it"),
        &[b],
    );
    s.expect(
        "status applied patch 1 (A)",
        &status(&alice, 1631, &p1),
        &[a],
    );
    s.expect(
        "status closed relay-tools issue (B)",
        &status(&bob, 1632, &i1),
        &[b],
    );
    s.expect("status open PR (A)", &status(&carol, 1630, &pr1), &[a]);
    s.expect(
        "status draft PR update (C)",
        &status(&erin, 1633, &pru1),
        &[c],
    );
    s.expect(
        "quote of repo sdk-mirror (A)",
        &quote(&dave, &sdk, "check this repo"),
        &[a],
    );
    s.expect(
        "quote of grasp issue (C)",
        &quote(&dave, &i5.id.to_hex(), "same here"),
        &[c],
    );

    // Noise: nothing the engine subscribes to matches these.
    s.noise("note on A", &event(&mallory, 1, "gm", &[]), &[a]);
    s.noise(
        "note on B",
        &event(&mallory, 1, "gm gm", &[&["t", "gm"]]),
        &[b],
    );
    s.noise("note on C", &event(&erin, 1, "nostr is neat", &[]), &[c]);
    s.noise(
        "issue of unannounced repo (B)",
        &issue(&mallory, &ghost, "spam", "spam"),
        &[b],
    );
    let unknown = event(&mallory, 1, "never published", &[]);
    s.noise(
        "reply to an unknown id (A)",
        &event(
            &mallory,
            1111,
            "?",
            &[&["E", &unknown.id.to_hex()], &["K", "1621"]],
        ),
        &[a],
    );
    s.noise(
        "status of an unknown id (C)",
        &status(&mallory, 1632, &unknown),
        &[c],
    );
    s.noise(
        "reaction to an unknown id (B)",
        &event(&mallory, 7, "+", &[&["e", &unknown.id.to_hex()]]),
        &[b],
    );
    s.noise(
        "quote of unannounced repo (C)",
        &quote(&mallory, &ghost, "look"),
        &[c],
    );
    s.noise(
        "reply to the unannounced repo's issue (B)",
        &comment(&mallory, &orphan, "bump"),
        &[b],
    );
    s
}

// ----- output -----

fn connected(st: &Status) -> usize {
    st.relays
        .iter()
        .filter(|r| r.connection_status == ConnectionStatus::Connected)
        .count()
}

fn progress(t: Duration, st: &Status, held: usize, expected: usize) {
    println!(
        "[{:>5.1}s] relays {}/{} connected | repos {} | root events {} | forwarded {} (dup {}) | own relay {}/{} expected events | history queries pending {} | time to settle {}{}",
        t.as_secs_f64(),
        connected(st),
        st.relays.len(),
        st.repos,
        st.root_events,
        st.forwarded,
        st.duplicates,
        held,
        expected,
        st.progress.history_queries_pending,
        st.progress.eta,
        if !st.relays.is_empty() && st.is_settled() {
            " | settled"
        } else {
            ""
        },
    );
}

fn table(st: &Status, names: &HashMap<RelayUrl, &str>) {
    println!();
    println!(
        "{:<4} {:<24} {:<12} {:>7} {:>7} {:>9} {:>9} {:>5}",
        "", "relay", "status", "repos", "roots", "received", "accepted", "subs"
    );
    for r in &st.relays {
        println!(
            "{:<4} {:<24} {:<12} {:>7} {:>7} {:>9} {:>9} {:>5}",
            names.get(&r.url).copied().unwrap_or("?"),
            r.url.to_string(),
            format!("{:?}", r.connection_status),
            format!("{}/{}", r.confirmed_repos, r.target_repos),
            format!("{}/{}", r.confirmed_root_events, r.target_root_events),
            r.events_received,
            r.events_accepted,
            r.open_subscriptions,
        );
    }
    let received: u64 = st.relays.iter().map(|r| r.events_received).sum();
    let accepted: u64 = st.relays.iter().map(|r| r.events_accepted).sum();
    println!(
        "{:<4} {:<24} {:<12} {:>7} {:>7} {:>9} {:>9} {:>5}",
        "",
        "total",
        format!("{} relays", st.relays.len()),
        st.repos,
        st.root_events,
        received,
        accepted,
        st.relays
            .iter()
            .map(|r| r.open_subscriptions)
            .sum::<usize>(),
    );
    println!(
        "forwarded {} new, {} duplicates, {} rejected, backlog {}; dropped {} invalid, {} unmatched",
        st.forwarded, st.duplicates, st.rejected, st.forward_backlog, st.invalid, st.unmatched
    );
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();

    let relays = Relays {
        own: TestRelay::start(),
        a: TestRelay::start(),
        b: TestRelay::start(),
        c: TestRelay::start(),
    };
    let seed = seed(&relays);
    let names: HashMap<RelayUrl, &str> = [
        (&relays.own, "own"),
        (&relays.a, "A"),
        (&relays.b, "B"),
        (&relays.c, "C"),
    ]
    .into_iter()
    .map(|(r, n)| (RelayUrl::parse(&r.url()).expect("url"), n))
    .collect();
    println!("own relay {}", relays.own.url());
    for (n, r) in [("A", &relays.a), ("B", &relays.b), ("C", &relays.c)] {
        println!("relay {n}     {} ({} events seeded)", r.url(), r.len());
    }
    let seeded_own = relays.own.len();
    println!(
        "own relay starts with {} events; {} events are expected after sync, {} noise events must stay out",
        seeded_own,
        seed.expected.len(),
        seed.noise.len()
    );
    println!();

    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if let Some(ms) = env("GRASP_SYNC_DEMO_EOSE_DELAY_MS").and_then(|v| v.parse().ok()) {
        relays.c.set_eose_delay(Some(Duration::from_millis(ms)));
        // Published, not enforced: the engine keeps within it by itself.
        relays.c.set_nip11(Some(
            serde_json::json!({"limitation": {"max_subscriptions": 2}}),
        ));
        println!("relay C sends each EOSE {ms} ms late and allows 2 subscriptions");
    }
    let own_url = RelayUrl::parse(&relays.own.url()).expect("own url");
    let handle = match grasp_sync::start(
        Config::new(own_url)
            .allow_private_relays(true)
            .batch_window(BATCH_WINDOW),
    ) {
        Ok(h) => Arc::new(h),
        Err(e) => {
            eprintln!("cannot start the engine: {e}");
            return ExitCode::FAILURE;
        }
    };
    let _server = match env("GRASP_SYNC_DEMO_METRICS_ADDR").map(|a| a.parse()) {
        None => None,
        Some(Ok(addr)) => match grasp_sync::ops::serve(addr, handle.clone()) {
            Ok(s) => {
                println!("status page on http://{}/", s.local_addr());
                Some(s)
            }
            Err(e) => {
                eprintln!("cannot serve the status page on {addr}: {e}");
                return ExitCode::FAILURE;
            }
        },
        Some(Err(e)) => {
            eprintln!("GRASP_SYNC_DEMO_METRICS_ADDR: {e}");
            return ExitCode::FAILURE;
        }
    };

    let started = Instant::now();
    let mut next_print = started;
    let converged = loop {
        let ids = relays.own.event_ids();
        let st = handle.status();
        let done = ids == seed.expected && st.is_settled();
        let now = Instant::now();
        if done || now >= next_print {
            progress(
                started.elapsed(),
                &st,
                ids.intersection(&seed.expected).count(),
                seed.expected.len(),
            );
            next_print += PROGRESS_EVERY;
        }
        if done {
            break true;
        }
        if started.elapsed() >= DEADLINE {
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = started.elapsed();
    if converged {
        println!("\nown relay complete after {:.2}s", elapsed.as_secs_f64());
    } else {
        println!("\ndeadline of {DEADLINE:?} passed before the own relay was complete");
    }

    // The forwarder publishes its counters once per loop turn, so they can trail the own
    // relay a little: give them a moment to account for every newly stored event.
    let new_events = relays.own.len().saturating_sub(seeded_own) as u64;
    let settle = Instant::now();
    while handle.status().forwarded < new_events && settle.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(20));
    }
    table(&handle.status(), &names);
    if let Some(secs) = env("GRASP_SYNC_DEMO_HOLD_SECS").and_then(|v| v.parse().ok()) {
        println!("holding for {secs} s");
        std::thread::sleep(Duration::from_secs(secs));
    }

    let t = Instant::now();
    match handle.shutdown(SHUTDOWN_DEADLINE) {
        Ok(()) => println!("shutdown in {:.0} ms", t.elapsed().as_secs_f64() * 1000.0),
        Err(e) => println!("shutdown: {e}"),
    }

    let held = relays.own.event_ids();
    let mut missing: Vec<String> = seed
        .expected
        .difference(&held)
        .map(|i| seed.name(i))
        .collect();
    let mut unexpected: Vec<String> = held
        .difference(&seed.expected)
        .map(|i| seed.name(i))
        .collect();
    missing.sort();
    unexpected.sort();
    let noise_in = held.intersection(&seed.noise).count();
    println!(
        "own relay holds {} events: {} expected, {} missing, {} unexpected ({} of {} noise events)",
        held.len(),
        seed.expected.len(),
        missing.len(),
        unexpected.len(),
        noise_in,
        seed.noise.len()
    );
    if missing.is_empty() && unexpected.is_empty() {
        println!("OK");
        ExitCode::SUCCESS
    } else {
        for m in &missing {
            println!("  missing:    {m}");
        }
        for u in &unexpected {
            println!("  unexpected: {u}");
        }
        println!("FAILED");
        ExitCode::FAILURE
    }
}
