//! Shared helpers of the end-to-end tests: NIP-34 event builders, a book of named events
//! (expected vs. noise) for readable set diffs, REQ classification by layer, and shutdown
//! checks.
#![allow(dead_code)]

pub mod process;
#[allow(unused_imports)]
pub use process::*;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use grasp_sync::testing::{wait_until, RecordedReq, TestRelay};
use grasp_sync::{RelayUrl, SyncHandle};
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::filter::{Filter, MatchEventOptions};
use nostr::key::Keys;
use serde_json::Value;

/// Deadline for anything that should happen.
pub const WAIT: Duration = Duration::from_secs(30);

/// Kinds of the first read of the own relay (announcements and root events); the
/// self-subscription itself reads every event (no kinds).
pub const SELF_KINDS: [u64; 5] = [1617, 1618, 1619, 1621, 30617];
/// Kinds of the Layer-1 subscription on remote relays (user grasp lists, announcements,
/// state events).
pub const L1_KINDS: [u64; 3] = [10317, 30617, 30618];

pub fn init_logging() {
    let _ = env_logger::builder().is_test(true).try_init();
}

pub fn url(r: &TestRelay) -> RelayUrl {
    RelayUrl::parse(&r.url()).unwrap()
}

// ----- event builders -----

/// Any event: `tags` are full tag arrays (`["a", "30617:..:d"]`).
pub fn event(keys: &Keys, kind: u16, content: &str, tags: &[&[&str]]) -> Event {
    let mut b = EventBuilder::new(Kind::Custom(kind), content);
    for t in tags {
        b = b.tag(Tag::parse(t.iter().copied()).unwrap());
    }
    b.finalize(keys).unwrap()
}

/// `30617:<pubkey>:<d>`.
pub fn repo_ref(keys: &Keys, d: &str) -> String {
    format!("30617:{}:{d}", keys.public_key().to_hex())
}

/// A repository announcement; each entry of `relay_tags` becomes one `relays` tag.
pub fn announcement(keys: &Keys, d: &str, relay_tags: &[&[&str]]) -> Event {
    let mut tags: Vec<Vec<&str>> = vec![
        vec!["d", d],
        vec!["name", d],
        vec!["description", "a repository"],
    ];
    for r in relay_tags {
        let mut t = vec!["relays"];
        t.extend_from_slice(r);
        tags.push(t);
    }
    let refs: Vec<&[&str]> = tags.iter().map(|t| t.as_slice()).collect();
    event(keys, 30617, "", &refs)
}

/// A repository state event (kind 30618).
pub fn repo_state(keys: &Keys, d: &str) -> Event {
    event(
        keys,
        30618,
        "",
        &[
            &["d", d],
            &[
                "refs/heads/main",
                "4b825dc642cb6eb9a060e54bf8d69288fbee4904",
            ],
            &["HEAD", "ref: refs/heads/main"],
        ],
    )
}

/// A root event (1617/1618/1619/1621) of `repo`, with extra tags.
pub fn root(keys: &Keys, kind: u16, repo: &str, content: &str, extra: &[&[&str]]) -> Event {
    let a = ["a", repo];
    let mut tags: Vec<&[&str]> = vec![&a];
    tags.extend_from_slice(extra);
    event(keys, kind, content, &tags)
}

/// A NIP-22 comment (kind 1111) on the root event `root` using `E` (plus `K` and `e`).
pub fn comment(keys: &Keys, root: &Event, text: &str) -> Event {
    let id = root.id.to_hex();
    let k = root.kind.as_u16().to_string();
    event(
        keys,
        1111,
        text,
        &[&["E", &id], &["K", &k], &["e", &id], &["k", &k]],
    )
}

/// A NIP-22 comment on an event id only (for replies to unknown roots).
pub fn comment_on_id(keys: &Keys, id: &EventId, text: &str) -> Event {
    event(keys, 1111, text, &[&["E", &id.to_hex()], &["K", "1621"]])
}

/// A NIP-22 comment on a repository (`A` = repo coordinate).
pub fn repo_comment(keys: &Keys, repo: &str, text: &str) -> Event {
    event(keys, 1111, text, &[&["A", repo], &["K", "30617"]])
}

/// A status event (1630 open, 1631 applied, 1632 closed, 1633 draft) of `root_id` via `e`.
pub fn status(keys: &Keys, kind: u16, root_id: &EventId) -> Event {
    event(keys, kind, "", &[&["e", &root_id.to_hex(), "", "root"]])
}

/// A kind-1 note quoting `value` (a repo coordinate or an event id) with `q`.
pub fn quote(keys: &Keys, value: &str, text: &str) -> Event {
    event(keys, 1, text, &[&["q", value]])
}

/// A plain kind-1 note.
pub fn note(keys: &Keys, text: &str) -> Event {
    event(keys, 1, text, &[])
}

/// The JSON of `e` with its signature altered (the id still matches the content).
pub fn forge_signature(e: &Event) -> String {
    let mut v: Value = serde_json::from_str(&e.as_json()).unwrap();
    let sig = v["sig"].as_str().unwrap().to_string();
    let last = if sig.ends_with('0') { '1' } else { '0' };
    let forged = format!("{}{}", &sig[..sig.len() - 1], last);
    v["sig"] = Value::String(forged);
    v.to_string()
}

/// The JSON of `e` with its content altered (id and signature kept: the id is wrong).
pub fn forge_content(e: &Event, content: &str) -> String {
    let mut v: Value = serde_json::from_str(&e.as_json()).unwrap();
    v["content"] = Value::String(content.to_string());
    v.to_string()
}

// ----- named events -----

/// Names every event of a scenario and whether it must reach the own relay.
#[derive(Default)]
pub struct Book {
    pub names: HashMap<EventId, String>,
    pub expected: HashSet<EventId>,
    pub noise: HashSet<EventId>,
}

impl Book {
    /// Stores `e` on `relays` and records it as expected on the own relay.
    pub fn expect(&mut self, name: &str, e: &Event, relays: &[&TestRelay]) -> EventId {
        for r in relays {
            r.insert(e);
        }
        self.names.insert(e.id, name.to_string());
        self.expected.insert(e.id);
        e.id
    }

    /// Stores `e` on `relays` and records it as noise (must never reach the own relay).
    pub fn noise(&mut self, name: &str, e: &Event, relays: &[&TestRelay]) -> EventId {
        for r in relays {
            r.insert(e);
        }
        self.names.insert(e.id, name.to_string());
        self.noise.insert(e.id);
        e.id
    }

    pub fn name(&self, id: &EventId) -> String {
        self.names
            .get(id)
            .cloned()
            .unwrap_or_else(|| format!("<unnamed {}>", id.to_hex()))
    }

    /// Missing and unexpected ids of `actual` against the expected set, by name.
    pub fn diff(&self, actual: &HashSet<EventId>) -> String {
        let mut missing: Vec<String> = self
            .expected
            .difference(actual)
            .map(|i| self.name(i))
            .collect();
        let mut unexpected: Vec<String> = actual
            .difference(&self.expected)
            .map(|i| self.name(i))
            .collect();
        missing.sort();
        unexpected.sort();
        format!("missing: {missing:?}\nunexpected: {unexpected:?}")
    }
}

/// Waits until the own relay holds exactly the expected set and the engine reports itself
/// settled, then checks that no noise got in. (`is_settled` alone is not trusted: it can be
/// true while events are still on their way, see `settled_status_agrees_with_the_own_relay`.)
pub fn assert_converges(own: &TestRelay, book: &Book, handle: &SyncHandle) {
    let ok = wait_until(WAIT, || {
        own.event_ids() == book.expected && handle.status().is_settled()
    });
    let actual = own.event_ids();
    assert!(
        ok && actual == book.expected,
        "own relay did not converge to the expected set\n{}\n{:#?}",
        book.diff(&actual),
        handle.status()
    );
    let noise: Vec<String> = book
        .noise
        .intersection(&actual)
        .map(|i| book.name(i))
        .collect();
    assert!(noise.is_empty(), "noise forwarded: {noise:?}");
}

/// Shuts the engine down and checks that every relay sees its connections close.
pub fn shutdown_clean(handle: SyncHandle, relays: &[&TestRelay]) {
    let started = Instant::now();
    let r = handle.shutdown(Duration::from_secs(10));
    assert!(r.is_ok(), "shutdown failed: {r:?}");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "shutdown took {took:?}");
    for relay in relays {
        let closed = wait_until(Duration::from_secs(10), || relay.current_connections() == 0);
        assert!(
            closed,
            "{} still has {} connection(s) after shutdown",
            relay.url(),
            relay.current_connections()
        );
    }
}

/// True once `end` has passed on `clock` (the engine's) and the sync machine has no timer due at
/// or before it: every deadline up to `end` (an EOSE deadline, a retry, a poll round) has been
/// handled by the coordinator. A test that asserts "nothing happens until `end`" waits for
/// this, a positive signal, instead of sleeping: on a slow host it waits longer rather than
/// looking before the deadlines it is about ran.
pub fn machine_is_past(
    handle: &SyncHandle,
    clock: &dyn grasp_sync::core::Clock,
    end: grasp_sync::core::Time,
) -> bool {
    clock.now() >= end && handle.with_machine(|m| m.poll_timeout().is_none_or(|t| t > end))
}

// ----- REQ classification -----

/// What a recorded filter is, by the layer design.
#[derive(Debug, Clone, PartialEq)]
pub enum Layer {
    /// The self-subscription (own relay only).
    SelfSub { since: Option<u64> },
    /// Layer 1: kinds 30617 + 30618.
    L1 { since: Option<u64> },
    /// Layer 2: one of `#a`/`#A`/`#q` with repository coordinates.
    L2 {
        tag: char,
        values: Vec<String>,
        since: Option<u64>,
    },
    /// Layer 3: one of `#e`/`#E`/`#q` with lower-case hex ids.
    L3 {
        tag: char,
        values: Vec<String>,
        since: Option<u64>,
    },
    /// Anything else (a design violation), as JSON.
    Other(String),
}

fn is_repo_coordinate(v: &str) -> bool {
    let mut p = v.splitn(3, ':');
    matches!(
        (p.next(), p.next(), p.next()),
        (Some("30617"), Some(pk), Some(_))
            if pk.len() == 64 && pk.bytes().all(|b| b.is_ascii_hexdigit())
    )
}

fn is_lower_hex_id(v: &str) -> bool {
    v.len() == 64
        && v.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

pub fn classify(filter: &Filter) -> Layer {
    let json = filter.as_json();
    let v: Value = serde_json::from_str(&json).unwrap();
    let obj = v.as_object().unwrap();
    let since = obj.get("since").and_then(|s| s.as_u64());
    let mut tags: Vec<(&String, &Value)> = obj.iter().filter(|(k, _)| k.starts_with('#')).collect();
    let others: Vec<&String> = obj
        .keys()
        .filter(|k| !k.starts_with('#') && *k != "since" && *k != "kinds")
        .collect();
    // The self-subscription: every event of the own relay (a `limit` where the own relay
    // publishes its `max_limit`).
    if tags.is_empty() && obj.get("kinds").is_none() && others.iter().all(|k| *k == "limit") {
        return Layer::SelfSub { since };
    }
    if !others.is_empty() {
        return Layer::Other(json);
    }
    if let Some(kinds) = obj.get("kinds") {
        if !tags.is_empty() {
            return Layer::Other(json);
        }
        let mut k: Vec<u64> = kinds
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|x| x.as_u64())
            .collect();
        k.sort();
        return if k == L1_KINDS {
            Layer::L1 { since }
        } else if k == SELF_KINDS {
            Layer::SelfSub { since }
        } else {
            Layer::Other(json)
        };
    }
    if tags.len() != 1 {
        return Layer::Other(json);
    }
    let (key, values) = tags.pop().unwrap();
    let tag = key.chars().nth(1).unwrap();
    if key.len() != 2 {
        return Layer::Other(json);
    }
    let values: Vec<String> = values
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap_or_default().to_string())
        .collect();
    if values.is_empty() {
        return Layer::Other(json);
    }
    if matches!(tag, 'a' | 'A' | 'q') && values.iter().all(|x| is_repo_coordinate(x)) {
        return Layer::L2 { tag, values, since };
    }
    if matches!(tag, 'e' | 'E' | 'q') && values.iter().all(|x| is_lower_hex_id(x)) {
        return Layer::L3 { tag, values, since };
    }
    Layer::Other(json)
}

/// The recorded REQs of `relay` grouped by connection id.
pub fn reqs_by_conn(relay: &TestRelay) -> BTreeMap<u64, Vec<RecordedReq>> {
    let mut m: BTreeMap<u64, Vec<RecordedReq>> = BTreeMap::new();
    for r in relay.reqs() {
        m.entry(r.conn).or_default().push(r);
    }
    m
}

/// Whether any REQ recorded by `relay` has an L2 filter with `tag` holding `repo`.
pub fn has_l2_req(relay: &TestRelay, tag: char, repo: &str) -> bool {
    relay.reqs().iter().any(|r| {
        r.filters.iter().any(|f| {
            matches!(classify(f), Layer::L2 { tag: t, values, .. } if t == tag && values.iter().any(|v| v == repo))
        })
    })
}

/// Whether any REQ recorded by `relay` has an L3 filter with `tag` holding `id`.
pub fn has_l3_req(relay: &TestRelay, tag: char, id: &EventId) -> bool {
    let hex = id.to_hex();
    relay.reqs().iter().any(|r| {
        r.filters.iter().any(|f| {
            matches!(classify(f), Layer::L3 { tag: t, values, .. } if t == tag && values.contains(&hex))
        })
    })
}

/// Number of recorded REQs of connection `conn` whose filters match `e`.
pub fn matching_reqs(relay: &TestRelay, conn: u64, e: &Event) -> usize {
    relay
        .reqs()
        .iter()
        .filter(|r| r.conn == conn)
        .filter(|r| {
            r.filters
                .iter()
                .any(|f| f.match_event(e, MatchEventOptions::new()))
        })
        .count()
}

/// One repository announced with `remote` as its relay, and one issue of it: the fixture of
/// the lifecycle and fault tests. Nothing is stored anywhere until the test inserts it.
pub struct OneRepo {
    /// The maintainer.
    pub keys: Keys,
    /// The announcement (kind 30617) listing `remote`.
    pub ann: Event,
    /// `30617:<pubkey>:r`.
    pub repo: String,
    /// An issue (kind 1621) of the repository.
    pub issue: Event,
}

impl OneRepo {
    /// Builds the events for a repository on `remote`.
    pub fn new(remote: &TestRelay) -> OneRepo {
        let keys = Keys::generate();
        let ann = announcement(&keys, "r", &[&[&remote.url()]]);
        let repo = repo_ref(&keys, "r");
        let issue = root(&keys, 1621, &repo, "issue", &[]);
        OneRepo {
            keys,
            ann,
            repo,
            issue,
        }
    }

    /// Stores the announcement on `own` and `remote` and the issue on `remote`, the start of
    /// most socket tests; returns their ids (what the own relay must end with so far).
    pub fn seed(&self, own: &TestRelay, remote: &TestRelay) -> HashSet<EventId> {
        own.insert(&self.ann);
        remote.insert(&self.ann);
        remote.insert(&self.issue);
        [self.ann.id, self.issue.id].into()
    }

    /// A NIP-22 comment on the issue (`E`, `K`, `e` tags).
    pub fn reply(&self, text: &str) -> Event {
        comment(&self.keys, &self.issue, text)
    }

    /// Another issue of the repository.
    pub fn another_issue(&self, text: &str) -> Event {
        root(&self.keys, 1621, &self.repo, text, &[])
    }
}

/// NOTICEs `r` sent besides its answer to the NIP-77 detection: a relay without NIP-77
/// answers the one `NEG-OPEN` of its first fresh sync with a NOTICE, which is how the engine
/// learns it (`Nip77Support::Unsupported`).
pub fn other_notices(r: &grasp_sync::RelayStatus) -> u64 {
    let detection = grasp_sync::core::sync::Nip77Support::Unsupported;
    r.notices.saturating_sub(u64::from(r.nip77 == detection))
}

// ----- `grasp-sync audit` -----

/// One repository on the own relay whose announcement lists one remote relay, with a known
/// gap: the remote holds four related events the own relay lacks (a reply, a patch, a reply
/// to that patch, found only once the patch counts as a root event, and a comment on the
/// repository), the own relay one the remote lacks, and the remote an unrelated note that is
/// not missing.
pub struct AuditGap {
    /// The repository's coordinate.
    pub repo: String,
    /// What the own relay holds.
    pub own: Vec<Event>,
    /// What the remote relay holds.
    pub remote: Vec<Event>,
    /// Related events only the remote holds.
    pub missing: HashSet<EventId>,
    /// Related events only the own relay holds.
    pub extra: HashSet<EventId>,
}

pub fn audit_gap(keys: &Keys, remote: &str) -> AuditGap {
    let ann = announcement(keys, "audited", &[&[remote]]);
    let repo = repo_ref(keys, "audited");
    let issue = root(keys, 1621, &repo, "an issue", &[]);
    let both = comment(keys, &issue, "on both relays");
    let reply = comment(keys, &issue, "only on the remote");
    let patch = root(keys, 1617, &repo, "a patch only on the remote", &[]);
    let patch_reply = comment(keys, &patch, "a reply to the patch, only on the remote");
    let on_repo = repo_comment(
        keys,
        &repo,
        "a comment on the repository, only on the remote",
    );
    let own_only = comment(keys, &issue, "only on the own relay");
    let unrelated = note(keys, "unrelated");
    // The repository's state, only on the remote (issue 34: the audit skipped state events),
    // and a state event of the same `d` by someone else, which is not the repository's.
    let state = repo_state(keys, "audited");
    let foreign_state = repo_state(&Keys::generate(), "audited");
    AuditGap {
        missing: [reply.id, patch.id, patch_reply.id, on_repo.id, state.id].into(),
        extra: [own_only.id].into(),
        own: vec![ann.clone(), issue.clone(), both.clone(), own_only],
        remote: vec![
            ann,
            issue,
            both,
            reply,
            patch,
            patch_reply,
            on_repo,
            unrelated,
            state,
            foreign_state,
        ],
        repo,
    }
}

/// Runs `grasp-sync audit --json --allow-private-relays` (plus `extra`) against the own relay
/// `own`: its exit status and its report.
pub fn run_audit(own: &str, extra: &[&str]) -> (i32, Value) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_grasp-sync"))
        .args([
            "audit",
            "--own-relay",
            own,
            "--allow-private-relays",
            "--json",
        ])
        .args(extra)
        .env("RUST_LOG", "info")
        .output()
        .expect("run grasp-sync audit");
    let code = out.status.code().unwrap_or(-1);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let doc = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "grasp-sync audit (exit {code}) printed no JSON report ({e}):\n{}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    eprintln!("grasp-sync audit {extra:?}: exit {code}\n{stderr}");
    (code, doc)
}

/// Every missing id the report lists, over all relays.
pub fn audit_missing_ids(doc: &Value) -> HashSet<EventId> {
    doc["relays"]
        .as_array()
        .expect("relays")
        .iter()
        .flat_map(|r| r["missing_ids"].as_array().expect("missing_ids").iter())
        .map(|id| EventId::from_hex(id.as_str().expect("hex id")).expect("event id"))
        .collect()
}

/// Checks an audit of [`audit_gap`] (`method`: how the remote was asked), runs `--fix`, and
/// checks that a second audit finds nothing; returns the own relay's ids before and after
/// through `own_ids`.
pub fn audit_fix_and_check(
    own: &str,
    gap: &AuditGap,
    method: &str,
    own_ids: &dyn Fn() -> HashSet<EventId>,
) {
    let before = own_ids();
    let (code, doc) = run_audit(own, &[]);
    assert_eq!(code, 1, "something is missing: {doc:#}");
    assert_eq!(audit_missing_ids(&doc), gap.missing, "{doc:#}");
    let relay = &doc["relays"][0];
    assert_eq!(relay["state"], "complete", "{doc:#}");
    assert_eq!(relay["method"], method, "{doc:#}");
    assert_eq!(relay["extra"], gap.extra.len(), "{doc:#}");
    let line = &relay["repositories"][0];
    assert_eq!(line["repo"], gap.repo.as_str());
    assert_eq!(line["missing"], gap.missing.len());
    assert_eq!(own_ids(), before, "an audit without --fix writes nothing");

    let (code, doc) = run_audit(own, &["--fix"]);
    assert_eq!(code, 0, "--fix stored what was missing: {doc:#}");
    assert_eq!(doc["fix"]["accepted"], gap.missing.len(), "{doc:#}");
    let expected: HashSet<EventId> = before.union(&gap.missing).copied().collect();
    assert_eq!(own_ids(), expected, "the own relay after --fix");

    let (code, doc) = run_audit(own, &[]);
    assert_eq!(code, 0, "nothing missing after --fix: {doc:#}");
    assert_eq!(doc["missing"], 0);
    assert!(audit_missing_ids(&doc).is_empty());
}
