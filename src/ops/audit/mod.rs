//! `grasp-sync audit`: does the own relay hold every event related to its repositories that
//! the relays their announcements list hold?
//!
//! 1. The own relay's announcements, root events and the replies below them are read as the
//!    daemon reads them (the self-subscription's filter, then the thread read, every page)
//!    and applied by the daemon's own definition (`OwnIndex`, `core::related`); its
//!    targets are derived with the daemon's own selection ([`machine_targets`]: scope,
//!    quotas, `--max-relays`, `--shard`).
//! 2. Everything the own relay holds for those repositories, root events and thread members
//!    (Layers 2 and 3, every page) is read once and kept as ids, times and the tag values
//!    that link each event to a repository: no event bodies.
//! 3. Every target relay is asked, under the daemon's address policy, with its NIP-11 page
//!    limits, what it holds for each of its Layer 2/3 filters: by NIP-77 where it takes part
//!    (the own relay's side comes from step 2; what it lacks is fetched by id), by paged REQ
//!    otherwise. Events are checked as the daemon checks them (filter, id; the signature of
//!    every event the own relay lacks). A few relays are asked at once
//!    ([`AuditOptions::concurrency`]), each within [`AuditOptions::relay_deadline`].
//! 4. The report counts, per repository and relay, the events the own relay lacks and the
//!    ones it holds that the relay does not (informational), and the relays not reached.
//! 5. Missing events that are root events or replies the daemon would follow once it stored
//!    them (a reply three generations down whose parent only the relays hold) make the
//!    relays be asked again with them, one generation a round, at most `--reply-depth` + 2
//!    rounds within the `--deadline`.
//!
//! Nothing is written unless [`AuditOptions::fix`]: then the missing events (checked, at most
//! [`AuditOptions::max_missing`] kept) are published to the own relay with a window of
//! answers outstanding, pausing on `rate-limited:` and `error:` as the forwarder does.
//! Replaceable events are compared by id like every other event.

mod conn;

use std::collections::BTreeMap;

use crate::core::hash::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nostr::event::{Event, EventId};
use nostr::filter::Filter;
use nostr::key::Keys;
use serde_json::{json, Value};

use crate::config::Config;
use crate::core::filters::{
    build_related_filters, own_events_filter, self_subscription_filter, state_coordinate, ID_TAGS,
    REPO_TAGS,
};
use crate::core::nip34::KIND_REPO_ANNOUNCEMENT;
use crate::core::nip34::{classify_self_event_with, RepoRef, SelfEventMeaning};
use crate::core::paging::PageLimits;
use crate::core::related::{apply_batch, Applied};
use crate::core::session::LimitsFetch;
use crate::core::sync::machine_targets;
use crate::core::targets::Exclusions;
use crate::core::threads::Threads;
use crate::core::{RelaySyncNeeds, RepoSyncIndex};
use crate::engine::dial::Dial;
use crate::net::policy::UrlVerdict;
use crate::shared::RelayUrl;

use conn::{Conn, QueryEnd};

/// The most missing ids listed per relay in the report.
pub const MAX_LISTED: usize = 1_000;

/// How an audit runs.
#[derive(Debug, Clone)]
pub struct AuditOptions {
    /// Publish what the own relay lacks (default: write nothing).
    pub fix: bool,
    /// Relays asked at once (default 8).
    pub concurrency: usize,
    /// The most time one relay's questions may take, and the fix's publishing (default
    /// 10 minutes); a relay that needs longer is reported incomplete.
    pub relay_deadline: Duration,
    /// The most missing events kept for the fix over all relays (default 100,000, about
    /// 200 MB of 2 KB events); beyond, they are counted, and the next run fixes them.
    pub max_missing: usize,
    /// Events published to the own relay with no answer yet (default 16).
    pub publish_window: usize,
    /// The most bytes of JSON of missing events kept over all relays (default 256 MiB);
    /// beyond, they are counted as not kept, as beyond [`AuditOptions::max_missing`].
    pub max_missing_bytes: usize,
    /// The most time the whole audit may take (default 1 hour): no relay's questions run
    /// past it, however many relays there are (issue 36: the deadlines per relay
    /// multiplied into hours).
    pub deadline: Duration,
}

impl Default for AuditOptions {
    fn default() -> Self {
        AuditOptions {
            fix: false,
            concurrency: 8,
            relay_deadline: Duration::from_secs(600),
            max_missing: 100_000,
            publish_window: 16,
            max_missing_bytes: 256 << 20,
            deadline: Duration::from_secs(3600),
        }
    }
}

/// Why there is no report: the own relay could not be read.
#[derive(Debug)]
#[non_exhaustive]
pub enum AuditError {
    /// Connecting to or reading the own relay failed.
    OwnRelay(String),
}

impl std::fmt::Display for AuditError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AuditError::OwnRelay(why) => write!(
                f,
                "cannot read the own relay: {why} (check --own-relay, that the relay runs, and --own-nsec-file if it requires AUTH)"
            ),
        }
    }
}

impl std::error::Error for AuditError {}

/// How one relay's audit ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RelayOutcome {
    /// Every query was answered in full.
    Complete,
    /// Some of the relay's history could not be read (the reason); the counts cover the rest.
    Incomplete(String),
    /// Not reached: refused by the address policy, connect failed, or the connection was
    /// lost before the first answer.
    Unreachable(String),
}

/// One repository on one relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoCount {
    /// The repository (`30617:<pubkey>:<d>`).
    pub repo: RepoRef,
    /// Events related to it that the relay holds and the own relay lacks.
    pub missing: usize,
    /// Events related to it that the own relay holds and the relay does not.
    pub extra: usize,
}

/// What one relay holds against the own relay.
#[derive(Debug, Clone)]
pub struct RelayAudit {
    /// The relay.
    pub url: RelayUrl,
    /// How it was asked: `nip77`, `req`, or `nip77+req` when some queries fell back.
    pub method: &'static str,
    /// How its audit ended.
    pub outcome: RelayOutcome,
    /// Distinct events it holds that the own relay lacks (checked, signature included).
    pub missing: usize,
    /// Their ids, sorted, at most [`MAX_LISTED`].
    pub missing_ids: Vec<EventId>,
    /// Of `missing`, those beyond [`AuditOptions::max_missing`]: counted (per delivery, so
    /// an upper bound), not kept, not listed, not fixed in this run.
    pub missing_not_kept: usize,
    /// Distinct related events the own relay holds that it does not.
    pub extra: usize,
    /// Ids a reconciliation named as missing that the relay then did not deliver.
    pub undelivered: usize,
    /// Deliveries of events that failed a check (malformed, outside the filter, wrong id or
    /// signature): an event sent for two queries (a reply tagged with both `e` and `E`)
    /// counts twice.
    pub rejected: u64,
    /// Per repository whose announcement lists it, sorted.
    pub repos: Vec<RepoCount>,
    /// The cap it was caught applying to its answers without publishing it (decision
    /// 0103): its pages of this many events were read as full.
    pub learned_cap: Option<usize>,
}

/// What `--fix` published.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FixOutcome {
    /// Events sent to the own relay.
    pub sent: usize,
    /// Stored by the own relay (`OK true`).
    pub accepted: usize,
    /// Already there (`duplicate:`).
    pub duplicate: usize,
    /// Refused or not answered: the id and the relay's reason.
    pub failed: Vec<(EventId, String)>,
}

/// The result of an audit.
#[derive(Debug, Clone)]
pub struct AuditReport {
    /// The own relay.
    pub own_relay: RelayUrl,
    /// Repositories announced on the own relay.
    pub repositories: usize,
    /// Repositories with at least one relay to audit (after scope, quotas and shard).
    pub repositories_targeted: usize,
    /// Root events linked to them.
    pub root_events: usize,
    /// Events followed below those root events (their replies are asked for too).
    pub thread_events: usize,
    /// Related events the own relay holds (Layers 2 and 3).
    pub own_events: usize,
    /// One entry per target relay, sorted by URL.
    pub relays: Vec<RelayAudit>,
    /// Distinct events missing on the own relay, over all relays.
    pub missing: usize,
    /// Missing events counted but not kept for the fix (beyond `max_missing`).
    pub not_kept: usize,
    /// What `--fix` did.
    pub fix: Option<FixOutcome>,
}

impl AuditReport {
    /// Distinct events still missing after the fix (all of them without one).
    pub fn still_missing(&self) -> usize {
        match &self.fix {
            Some(f) => self.missing - (f.accepted + f.duplicate).min(self.missing),
            None => self.missing,
        }
    }

    /// Relays not reached or read only in part.
    pub fn relays_with_problems(&self) -> usize {
        self.relays
            .iter()
            .filter(|r| r.outcome != RelayOutcome::Complete)
            .count()
    }

    /// The process's exit status: 0 when nothing is (still) missing, 1 otherwise.
    /// Unreachable relays do not change it: they are reported (exit status 2 is for bad
    /// input and an own relay that cannot be read, [`AuditError`]).
    pub fn exit_code(&self) -> u8 {
        u8::from(self.still_missing() > 0)
    }

    /// The report as one JSON document (`--json`).
    pub fn to_json(&self) -> Value {
        let relays: Vec<Value> = self
            .relays
            .iter()
            .map(|r| {
                let (state, reason) = match &r.outcome {
                    RelayOutcome::Complete => ("complete", None),
                    RelayOutcome::Incomplete(w) => ("incomplete", Some(w.clone())),
                    RelayOutcome::Unreachable(w) => ("unreachable", Some(w.clone())),
                };
                json!({
                    "url": r.url.as_str(),
                    "method": r.method,
                    "state": state,
                    "reason": reason,
                    "missing": r.missing,
                    "missing_ids": r.missing_ids.iter().map(|id| id.to_hex()).collect::<Vec<_>>(),
                    "missing_not_kept": r.missing_not_kept,
                    "extra": r.extra,
                    "undelivered": r.undelivered,
                    "rejected": r.rejected,
                    "learned_cap": r.learned_cap,
                    "repositories": r.repos.iter().map(|c| json!({
                        "repo": c.repo,
                        "missing": c.missing,
                        "extra": c.extra,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({
            "own_relay": self.own_relay.as_str(),
            "repositories": self.repositories,
            "repositories_targeted": self.repositories_targeted,
            "root_events": self.root_events,
            "thread_events": self.thread_events,
            "own_events": self.own_events,
            "missing": self.missing,
            "still_missing": self.still_missing(),
            "not_kept": self.not_kept,
            "relays_with_problems": self.relays_with_problems(),
            "relays": relays,
            "fix": self.fix.as_ref().map(|f| json!({
                "sent": f.sent,
                "accepted": f.accepted,
                "duplicate": f.duplicate,
                "failed": f.failed.iter().map(|(id, why)| json!({"id": id.to_hex(), "reason": why})).collect::<Vec<_>>(),
            })),
        })
    }

    /// The report as a table for people: one line per repository and relay, then the
    /// relays with problems and a summary.
    pub fn table(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "own relay {}: {} repositories ({} with relays to audit), {} root events, {} replies followed below them, {} related events\n\n",
            self.own_relay, self.repositories, self.repositories_targeted, self.root_events, self.thread_events, self.own_events
        ));
        let mut rows: Vec<[String; 5]> = Vec::new();
        for r in &self.relays {
            let note = match &r.outcome {
                RelayOutcome::Complete => r.method.to_string(),
                RelayOutcome::Incomplete(_) => format!("{} INCOMPLETE", r.method),
                RelayOutcome::Unreachable(_) => "UNREACHABLE".to_string(),
            };
            for c in &r.repos {
                let reached = !matches!(r.outcome, RelayOutcome::Unreachable(_));
                rows.push([
                    short_repo(&c.repo),
                    r.url.to_string(),
                    if reached {
                        c.missing.to_string()
                    } else {
                        "-".into()
                    },
                    if reached {
                        c.extra.to_string()
                    } else {
                        "-".into()
                    },
                    note.clone(),
                ]);
            }
        }
        rows.sort();
        let head = [
            "REPOSITORY".to_string(),
            "RELAY".into(),
            "MISSING".into(),
            "EXTRA".into(),
            "HOW".into(),
        ];
        let mut widths = [0usize; 5];
        for row in std::iter::once(&head).chain(rows.iter()) {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        for row in std::iter::once(&head).chain(rows.iter()) {
            out.push_str(&format!(
                "{:<w0$}  {:<w1$}  {:>w2$}  {:>w3$}  {}\n",
                row[0],
                row[1],
                row[2],
                row[3],
                row[4],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2],
                w3 = widths[3],
            ));
        }
        let problems: Vec<&RelayAudit> = self
            .relays
            .iter()
            .filter(|r| r.outcome != RelayOutcome::Complete)
            .collect();
        if !problems.is_empty() {
            out.push_str("\nrelays not read in full:\n");
            for r in problems {
                let (what, why) = match &r.outcome {
                    RelayOutcome::Incomplete(w) => ("incomplete", w),
                    RelayOutcome::Unreachable(w) => ("unreachable", w),
                    RelayOutcome::Complete => continue,
                };
                out.push_str(&format!("  {}: {what}: {why}\n", r.url));
            }
        }
        out.push('\n');
        if let Some(f) = &self.fix {
            out.push_str(&format!(
                "fix: {} sent, {} stored, {} already there, {} failed\n",
                f.sent,
                f.accepted,
                f.duplicate,
                f.failed.len()
            ));
            for (id, why) in f.failed.iter().take(20) {
                out.push_str(&format!("  {id}: {why}\n"));
            }
        }
        let missing = self.still_missing();
        if missing == 0 {
            out.push_str("nothing missing");
        } else if self.fix.is_some() {
            out.push_str(&format!("{missing} events still missing"));
        } else {
            out.push_str(&format!(
                "{missing} events missing on the own relay (grasp-sync audit --fix publishes them)"
            ));
        }
        let problems = self.relays_with_problems();
        if problems > 0 {
            out.push_str(&format!(
                " on the relays read; {problems} relays not read in full (listed above)"
            ));
        }
        if self.not_kept > 0 {
            out.push_str(&format!(
                "; {} beyond --max-missing were counted, not kept: run again",
                self.not_kept
            ));
        }
        out.push('\n');
        out
    }
}

/// `30617:<pubkey>:<d>` shortened to `<first 8 of pubkey>…:<d>` for the table.
fn short_repo(repo: &str) -> String {
    // The `d` comes from a stranger's announcement: escaped (no terminal control sequences)
    // and cut for the table (issue 36).
    let mut parts = repo.splitn(3, ':');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(_), Some(pk), Some(d)) if pk.len() > 8 && pk.is_ascii() => {
            format!(
                "{}…:{}",
                &pk[..8],
                crate::core::message::escape_for_log(d, 64)
            )
        }
        _ => crate::core::message::escape_for_log(repo, 140),
    }
}

/// One own event: when, and which of our tag values it carries (`(letter, value index)`).
struct OwnEvent {
    created_at: u64,
    refs: Box<[(u8, u32)]>,
}

/// What the own relay holds for the audited repositories, and how tag values map to them.
struct OwnSide {
    events: HashMap<EventId, OwnEvent>,
    /// Repository coordinates and root ids (hex) of the targets, interned.
    values: HashMap<String, u32>,
    /// Per value: the repositories it links to.
    value_repos: Vec<Vec<u32>>,
    repos: Vec<RepoRef>,
    /// The newest state event (kind 30618) the own relay holds per audited repository
    /// (coordinate value): a relay's older state of it is not missing (addressable events
    /// replace each other).
    states: HashMap<u32, u64>,
}

/// The letter under which a state event links to its repository's coordinate (its own
/// `d`, read with its author: [`state_coordinate`]).
const STATE_LETTER: u8 = b'd';

/// True when `letter` is a tag of Layer 2 or 3 (`filters::REPO_TAGS`, `filters::ID_TAGS`):
/// the tags that relate an event to one of our values.
fn is_link_letter(letter: u8) -> bool {
    REPO_TAGS
        .iter()
        .chain(ID_TAGS.iter())
        .any(|t| t.as_char() as u32 == u32::from(letter))
}

impl OwnSide {
    fn new(index: &RepoSyncIndex, repos: &HashSet<RepoRef>) -> OwnSide {
        let mut side = OwnSide {
            events: HashMap::default(),
            values: HashMap::default(),
            value_repos: Vec::new(),
            repos: Vec::new(),
            states: HashMap::default(),
        };
        let mut sorted: Vec<&RepoRef> = repos.iter().collect();
        sorted.sort();
        for repo in sorted {
            let r = side.repos.len() as u32;
            side.repos.push(repo.clone());
            let v = side.intern(repo.clone());
            side.value_repos[v as usize].push(r);
            if let Some(needs) = index.get(repo) {
                for id in needs.layer3_ids() {
                    let v = side.intern(id.to_hex());
                    side.value_repos[v as usize].push(r);
                }
            }
        }
        side
    }

    fn intern(&mut self, value: String) -> u32 {
        let next = self.value_repos.len() as u32;
        let v = *self.values.entry(value).or_insert(next);
        if v == next {
            self.value_repos.push(Vec::new());
        }
        v
    }

    /// The audited repository (coordinate value) a state event belongs to.
    fn state_of(&self, event: &Event) -> Option<u32> {
        state_coordinate(event).and_then(|c| self.values.get(&c).copied())
    }

    /// True when `event` is a state event (kind 30618) that needs no copy on the own relay:
    /// of no audited repository, or older than (or as old as) the state the own relay holds
    /// for it.
    fn state_not_needed(&self, event: &Event) -> bool {
        if state_coordinate(event).is_none() {
            return false;
        }
        match self.state_of(event) {
            None => true,
            Some(v) => self
                .states
                .get(&v)
                .is_some_and(|t| *t >= event.created_at.as_secs()),
        }
    }

    fn refs(&self, event: &Event) -> Box<[(u8, u32)]> {
        let mut refs = Vec::new();
        if let Some(v) = self.state_of(event) {
            refs.push((STATE_LETTER, v));
        }
        for tag in event.tags.iter() {
            let s = tag.as_slice();
            if s.len() < 2 || s[0].len() != 1 || !is_link_letter(s[0].as_bytes()[0]) {
                continue;
            }
            if let Some(v) = self.values.get(&s[1]) {
                refs.push((s[0].as_bytes()[0], *v));
            }
        }
        refs.into_boxed_slice()
    }

    fn add(&mut self, event: &Event) {
        if let Some(v) = self.state_of(event) {
            let t = self.states.entry(v).or_insert(0);
            *t = (*t).max(event.created_at.as_secs());
        }
        let refs = self.refs(event);
        self.events.insert(
            event.id,
            OwnEvent {
                created_at: event.created_at.as_secs(),
                refs,
            },
        );
    }

    /// The repositories (indices) `refs` link to, among `allowed`.
    fn repos_of(&self, refs: &[(u8, u32)], allowed: &HashSet<u32>) -> Vec<u32> {
        let mut out: Vec<u32> = refs
            .iter()
            .flat_map(|(_, v)| self.value_repos[*v as usize].iter().copied())
            .filter(|r| allowed.contains(r))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// `(created_at, id)` of the own events a Layer 2/3 filter matches.
    fn matching(&self, filter: &Filter) -> Vec<(u64, EventId)> {
        let mut conditions: Vec<(u8, HashSet<u32>)> = Vec::new();
        for (tag, values) in filter.generic_tags.iter() {
            let letter = tag.as_char() as u8;
            let set = if letter == STATE_LETTER {
                // A state filter: its authors × `d` values, as coordinates.
                let authors = filter.authors.iter().flatten();
                authors
                    .flat_map(|pk| {
                        values.iter().filter_map(move |d| {
                            self.values
                                .get(&format!("{KIND_REPO_ANNOUNCEMENT}:{}:{d}", pk.to_hex()))
                                .copied()
                        })
                    })
                    .collect()
            } else {
                values
                    .iter()
                    .filter_map(|v| self.values.get(v).copied())
                    .collect()
            };
            conditions.push((letter, set));
        }
        self.events
            .iter()
            .filter(|(_, e)| {
                conditions
                    .iter()
                    .all(|(letter, set)| e.refs.iter().any(|(l, v)| l == letter && set.contains(v)))
            })
            .map(|(id, e)| (e.created_at, *id))
            .collect()
    }
}

/// The own relay's events applied as the daemon applies them: classified with the daemon's
/// settings and applied in batches by `core::related::apply_batch` (the daemon's own
/// definition of related: announcements, root events, the replies followed below them).
pub(crate) struct OwnIndex {
    /// Repositories, their relays, root events and thread members.
    pub(crate) index: RepoSyncIndex,
    /// Which events are followed below which root events.
    pub(crate) threads: Threads,
    pending: Vec<SelfEventMeaning>,
    max_relays_per_announcement: usize,
    own_names: Vec<RelayUrl>,
}

/// Events applied at once by [`OwnIndex`] (the daemon's default `max_batch_events`).
const INDEX_BATCH: usize = 10_000;

impl OwnIndex {
    /// Nothing read yet, with `config`'s settings (relays per announcement, this service's
    /// URLs, the reply-chain bounds).
    pub(crate) fn new(config: &Config) -> OwnIndex {
        let mut own_names = vec![config.own_relay.clone()];
        own_names.extend(config.public_urls.iter().cloned());
        OwnIndex {
            index: RepoSyncIndex::default(),
            threads: Threads::new(config.sync_config().threads),
            pending: Vec::new(),
            max_relays_per_announcement: config.max_relays_per_announcement,
            own_names,
        }
    }

    /// One event read from the own relay (or about to be stored there).
    pub(crate) fn add(&mut self, event: &Event) -> Applied {
        let meaning =
            classify_self_event_with(event, self.max_relays_per_announcement, &self.own_names);
        if meaning != SelfEventMeaning::Other {
            self.pending.push(meaning);
        }
        if self.pending.len() >= INDEX_BATCH {
            return self.flush();
        }
        Applied::default()
    }

    /// Applies what was added since the last flush.
    pub(crate) fn flush(&mut self) -> Applied {
        let mut applied = Applied::default();
        apply_batch(
            &mut self.index,
            &mut self.threads,
            std::mem::take(&mut self.pending),
            &mut applied,
        );
        applied
    }
}

/// `now + d`, or a year from now when `d` is too large to add (a huge `--relay-deadline`).
pub(crate) fn deadline_in(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

/// Page limits from a NIP-11 answer, as the daemon derives them.
fn page_limits(fetch: &LimitsFetch, assumed: usize) -> (PageLimits, Option<bool>) {
    match fetch {
        LimitsFetch::Fetched(l) => (PageLimits::of(l, assumed), l.supports_nip77),
        _ => (PageLimits::assumed(assumed), None),
    }
}

/// Everything a relay's audit reads and nothing it changes.
struct Ctx<'a> {
    config: &'a Config,
    opts: &'a AuditOptions,
    dial_policy: Arc<crate::net::policy::AddressPolicy>,
    side: &'a OwnSide,
    /// Missing events kept so far over all relays ([`AuditOptions::max_missing`]).
    kept: std::sync::atomic::AtomicUsize,
    /// Their bytes of JSON ([`AuditOptions::max_missing_bytes`]).
    kept_bytes: std::sync::atomic::AtomicUsize,
    /// The end of the whole audit ([`AuditOptions::deadline`]).
    overall: Instant,
}

/// A missing event: its JSON and the repositories it links to on the relay that has it.
type Missing = HashMap<EventId, (Option<String>, Vec<u32>)>;

/// Runs the audit (and the fix, with [`AuditOptions::fix`]).
pub fn run(config: &Config, opts: &AuditOptions) -> Result<AuditReport, AuditError> {
    let started = Instant::now();
    let policy = Arc::new(config.address_policy(Vec::new()));
    let own_url = config.own_relay.clone();
    let (mut own, own_limits) = open_own(config, &policy).map_err(AuditError::OwnRelay)?;
    let overall = deadline_in(opts.deadline);
    let deadline = deadline_in(opts.relay_deadline).min(overall);
    let page_timeout = config.eose_timeout;

    // 1. Repositories, root events and the replies below them, as the daemon reads them:
    //    the self-subscription's history, then the thread read (again while replies read
    //    before their parents were dropped from the waiting set).
    let mut own_index = OwnIndex::new(config);
    let reads = 2 + usize::from(config.sync_config().threads.max_depth);
    for pass in 0..reads {
        let (filter, what) = if pass == 0 {
            (
                self_subscription_filter(None),
                "announcements and root events",
            )
        } else {
            (own_events_filter(), "events")
        };
        let end = own
            .read_history(&filter, &own_limits, page_timeout, deadline, &mut |e| {
                own_index.add(&e);
                true
            })
            .map_err(AuditError::OwnRelay)?;
        if let QueryEnd::Incomplete(why) = end {
            return Err(AuditError::OwnRelay(format!(
                "its {what} cannot be read in full: {why}"
            )));
        }
        own_index.flush();
        if pass > 0 && !own_index.threads.take_overflowed() {
            break;
        }
    }
    let repositories = own_index
        .index
        .values()
        .filter(|n| n.announced_at.is_some())
        .count();
    // 2–4, and again while the relays hold root events or replies that the daemon would
    // follow once it stored them: their replies are related too (one generation a round).
    // Each round reads the own relay on a connection of its own, within a deadline of its own:
    // the first round's remote relays may take their whole deadline meanwhile.
    drop(own);
    let ask = |index: &RepoSyncIndex| {
        let (mut own, own_limits) = open_own(config, &policy).map_err(AuditError::OwnRelay)?;
        let deadline = deadline_in(opts.relay_deadline).min(overall);
        audit_round(
            config,
            opts,
            &policy,
            &mut own,
            &own_limits,
            index,
            (deadline, overall),
        )
    };
    let mut round = ask(&own_index.index)?;
    let rounds = 2 + usize::from(config.sync_config().threads.max_depth);
    for _ in 1..rounds {
        let found = follow_missing(&round.results, &mut own_index);
        if found == 0 {
            break;
        }
        if Instant::now() >= overall {
            log::warn!(
                "audit: {found} root events or replies only the listed relays hold; their replies are not asked for: the audit's --deadline has passed"
            );
            break;
        }
        log::info!(
            "audit: {found} root events or replies only the listed relays hold; asking again for their replies"
        );
        round = ask(&own_index.index)?;
    }
    let Round {
        repos_targeted,
        root_events,
        thread_events,
        own_events,
        results,
    } = round;
    // 5. Totals, and the events to publish (each once).
    let mut missing_all: BTreeMap<EventId, Option<String>> = BTreeMap::new();
    let mut relays = Vec::with_capacity(results.len());
    let mut not_kept = 0;
    for (audit, missing) in results {
        not_kept += audit.missing_not_kept;
        for (id, (raw, _)) in missing {
            let slot = missing_all.entry(id).or_insert(None);
            if slot.is_none() {
                *slot = raw;
            }
        }
        relays.push(audit);
    }
    // `not_kept` so far: counted by the relays beyond their cap, never in `missing_all`.
    let beyond_caps = not_kept;
    let mut kept: Vec<(EventId, String)> = Vec::new();
    for (id, raw) in &missing_all {
        match raw {
            Some(r) if kept.len() < opts.max_missing => kept.push((*id, r.clone())),
            _ => not_kept += 1,
        }
    }
    let fix = if opts.fix && !kept.is_empty() {
        Some(publish(config, &policy, opts, &kept))
    } else if opts.fix {
        Some(FixOutcome::default())
    } else {
        None
    };
    let report = AuditReport {
        own_relay: own_url,
        repositories,
        repositories_targeted: repos_targeted,
        root_events,
        thread_events,
        own_events,
        relays,
        missing: missing_all.len() + beyond_caps,
        not_kept,
        fix,
    };
    log::info!(
        "audit: done in {:.1} s: {} missing, {} relays not read in full",
        started.elapsed().as_secs_f64(),
        report.missing,
        report.relays_with_problems()
    );
    Ok(report)
}

/// What one round of steps 2–4 found.
struct Round {
    repos_targeted: usize,
    root_events: usize,
    thread_events: usize,
    own_events: usize,
    results: Vec<(RelayAudit, Missing)>,
}

/// Steps 2–4 for `index`: the daemon's targets, the own relay's related events, every target
/// relay asked.
fn audit_round(
    config: &Config,
    opts: &AuditOptions,
    policy: &Arc<crate::net::policy::AddressPolicy>,
    own: &mut Conn,
    own_limits: &PageLimits,
    index: &RepoSyncIndex,
    (deadline, overall): (Instant, Instant),
) -> Result<Round, AuditError> {
    let page_timeout = config.eose_timeout;
    // 2. The daemon's targets.
    let targets = audit_targets(config, index);
    let repos: HashSet<RepoRef> = targets
        .targets
        .values()
        .flat_map(|n| n.repos.iter().cloned())
        .collect();
    let roots: HashSet<EventId> = repos
        .iter()
        .filter_map(|r| index.get(r))
        .flat_map(|n| n.root_events.iter().copied())
        .collect();
    // Layer-3 ids: the root events and the events followed below them.
    let ids: HashSet<EventId> = repos
        .iter()
        .filter_map(|r| index.get(r))
        .flat_map(|n| n.layer3_ids().copied())
        .collect();
    log::info!(
        "audit: {} repositories with relays to audit, {} root events, {} replies followed below them, {} relays",
        repos.len(),
        roots.len(),
        ids.len() - roots.len(),
        targets.targets.len()
    );
    // 3. The own relay's related events (ids and links only).
    let mut side = OwnSide::new(index, &repos);
    for f in build_related_filters(&repos, &ids) {
        let end = own
            .read_history(&f, own_limits, page_timeout, deadline, &mut |e| {
                side.add(&e);
                true
            })
            .map_err(AuditError::OwnRelay)?;
        if let QueryEnd::Incomplete(why) = end {
            return Err(AuditError::OwnRelay(format!(
                "its related events cannot be read in full: {why}"
            )));
        }
    }
    log::info!(
        "audit: the own relay holds {} related events; asking {} relays",
        side.events.len(),
        targets.targets.len()
    );
    // 4. Every target relay, a few at once.
    let ctx = Ctx {
        config,
        opts,
        dial_policy: policy.clone(),
        side: &side,
        kept: Default::default(),
        kept_bytes: Default::default(),
        overall,
    };
    let mut jobs: Vec<(&RelayUrl, &RelaySyncNeeds)> = targets.targets.iter().collect();
    jobs.sort_by(|a, b| a.0.cmp(b.0));
    let results = run_jobs(&ctx, &jobs);
    Ok(Round {
        repos_targeted: repos.len(),
        root_events: roots.len(),
        thread_events: ids.len() - roots.len(),
        own_events: side.events.len(),
        results,
    })
}

/// The relays to ask and what each should hold: the daemon's own selection
/// ([`machine_targets`]) over `index`, the own relay under every name never a target.
pub(crate) fn audit_targets(
    config: &Config,
    index: &RepoSyncIndex,
) -> crate::core::targets::Targets {
    let mut own_names = vec![config.own_relay.clone()];
    own_names.extend(config.public_urls.iter().cloned());
    machine_targets(
        index,
        &Exclusions::from(own_names.as_slice()),
        &config.sync_config(),
    )
}

/// What one relay is asked: everything related to its repositories and Layer-3 ids
/// ([`build_related_filters`], the filters the daemon's Layers 2 and 3 are made of, plus the
/// repositories' state events).
pub(crate) fn relay_filters(needs: &RelaySyncNeeds) -> Vec<Filter> {
    build_related_filters(&needs.repos, &needs.root_events)
}

/// Applies the missing events to `own` as the daemon would once it stored them: returns how
/// many root events were linked and replies followed (they widen the next round's filters).
fn follow_missing(results: &[(RelayAudit, Missing)], own: &mut OwnIndex) -> usize {
    let mut seen = HashSet::default();
    let mut found = 0;
    for (_, missing) in results {
        for (id, (raw, _)) in missing {
            let Some(raw) = raw else { continue };
            if !seen.insert(*id) {
                continue;
            }
            let Ok(event) = crate::core::message::parse_event(raw) else {
                continue;
            };
            let a = own.add(&event);
            found += a.root_links.len() + a.members.len();
        }
    }
    let a = own.flush();
    found + a.root_links.len() + a.members.len()
}

fn open_own(
    config: &Config,
    policy: &Arc<crate::net::policy::AddressPolicy>,
) -> Result<(Conn, PageLimits), String> {
    let dial = Dial {
        url: config.own_relay.clone(),
        tls: config.tls.clone(),
        policy: policy.clone(),
        own: true,
    };
    let limits = dial
        .fetch_limits(&UrlVerdict::Trusted, config.nip11_timeout)
        .unwrap_or(LimitsFetch::Unreachable);
    let (limits, _) = page_limits(&limits, config.assumed_page_size);
    let socket = dial
        .connect(&UrlVerdict::Trusted, config.ws)
        .map_err(|e| e.to_string())?;
    Ok((
        Conn::new(
            config.own_relay.clone(),
            socket,
            config.own_auth_keys.clone(),
        ),
        limits,
    ))
}

fn run_jobs(ctx: &Ctx<'_>, jobs: &[(&RelayUrl, &RelaySyncNeeds)]) -> Vec<(RelayAudit, Missing)> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = parking_lot::Mutex::new(Vec::with_capacity(jobs.len()));
    let threads = ctx.opts.concurrency.clamp(1, jobs.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((url, needs)) = jobs.get(i) else {
                    break;
                };
                let r = audit_relay(ctx, url, needs);
                results.lock().push(r);
            });
        }
    });
    let mut results = results.into_inner();
    results.sort_by(|a, b| a.0.url.cmp(&b.0.url));
    results
}

/// Asks one relay what it holds for its filters.
fn audit_relay(ctx: &Ctx<'_>, url: &RelayUrl, needs: &RelaySyncNeeds) -> (RelayAudit, Missing) {
    let side = ctx.side;
    let allowed: HashSet<u32> = side
        .repos
        .iter()
        .enumerate()
        .filter(|(_, r)| needs.repos.contains(*r))
        .map(|(i, _)| i as u32)
        .collect();
    let mut audit = RelayAudit {
        url: url.clone(),
        method: "req",
        outcome: RelayOutcome::Complete,
        missing: 0,
        missing_ids: Vec::new(),
        missing_not_kept: 0,
        extra: 0,
        undelivered: 0,
        rejected: 0,
        repos: Vec::new(),
        learned_cap: None,
    };
    let mut missing: Missing = HashMap::default();
    // Missing events not kept (beyond `max_missing`), counted per delivery.
    let mut beyond = 0usize;
    let mut candidates: HashSet<EventId> = HashSet::default();
    let mut held: HashSet<EventId> = HashSet::default();
    let finish = |mut audit: RelayAudit,
                  missing: Missing,
                  candidates: HashSet<EventId>,
                  held: HashSet<EventId>| {
        let extra: Vec<EventId> = candidates.difference(&held).copied().collect();
        let mut per: BTreeMap<u32, (usize, usize)> = allowed.iter().map(|r| (*r, (0, 0))).collect();
        for (_, repos) in missing.values() {
            for r in repos {
                if let Some(c) = per.get_mut(r) {
                    c.0 += 1;
                }
            }
        }
        for id in &extra {
            if let Some(e) = side.events.get(id) {
                for r in side.repos_of(&e.refs, &allowed) {
                    if let Some(c) = per.get_mut(&r) {
                        c.1 += 1;
                    }
                }
            }
        }
        audit.missing = missing.len() + audit.missing_not_kept;
        let mut ids: Vec<EventId> = missing.keys().copied().collect();
        ids.sort();
        ids.truncate(MAX_LISTED);
        audit.missing_ids = ids;
        audit.extra = extra.len();
        audit.repos = per
            .into_iter()
            .map(|(r, (m, x))| RepoCount {
                repo: side.repos[r as usize].clone(),
                missing: m,
                extra: x,
            })
            .collect();
        audit.repos.sort_by(|a, b| a.repo.cmp(&b.repo));
        (audit, missing)
    };
    let verdict = ctx.dial_policy.check_url(url);
    if let UrlVerdict::Refused(r) = &verdict {
        audit.outcome = RelayOutcome::Unreachable(format!("refused by the address policy: {r}"));
        return finish(audit, missing, candidates, held);
    }
    let dial = Dial {
        url: url.clone(),
        tls: ctx.config.tls.clone(),
        policy: ctx.dial_policy.clone(),
        own: false,
    };
    let fetch = match dial.fetch_limits(&verdict, ctx.config.nip11_timeout) {
        Ok(f) => f,
        Err(r) => {
            audit.outcome =
                RelayOutcome::Unreachable(format!("refused by the address policy: {r}"));
            return finish(audit, missing, candidates, held);
        }
    };
    let (limits, nip77) = page_limits(&fetch, ctx.config.assumed_page_size);
    let socket = match dial.connect(&verdict, ctx.config.ws) {
        Ok(s) => s,
        Err(e) => {
            log::warn!("audit: {url}: not reached: {e}");
            audit.outcome = RelayOutcome::Unreachable(e.to_string());
            return finish(audit, missing, candidates, held);
        }
    };
    let keys = ctx
        .config
        .auth_keys
        .clone()
        .or_else(|| ctx.config.ephemeral_auth.then(Keys::generate));
    let mut conn = Conn::new(url.clone(), socket, keys);
    let deadline = deadline_in(ctx.opts.relay_deadline).min(ctx.overall);
    let page_timeout = ctx.config.eose_timeout;
    let nip77_cfg = &ctx.config.nip77;
    let mut try_nip77 = nip77_cfg.enabled && nip77 != Some(false);
    let (mut used_nip77, mut used_req) = (false, false);
    let mut answered = false;
    for filter in relay_filters(needs) {
        let own_f = side.matching(&filter);
        // Trusted: the own relay holds the id (and the id is the hash of the content), or
        // the signature verifies. Missing events beyond `max_missing` are only counted.
        let keep = |e: Event, missing: &mut Missing, rejected: &mut u64, beyond: &mut usize| {
            if side.events.contains_key(&e.id) || side.state_not_needed(&e) {
                return true;
            }
            if !e.verify_signature() {
                *rejected += 1;
                return false;
            }
            use std::sync::atomic::Ordering::Relaxed;
            let json = e.as_json();
            let room = ctx.kept.load(Relaxed) < ctx.opts.max_missing
                && ctx.kept_bytes.load(Relaxed) + json.len() <= ctx.opts.max_missing_bytes;
            if missing.contains_key(&e.id)
                || (room && ctx.kept.fetch_add(1, Relaxed) < ctx.opts.max_missing && {
                    ctx.kept_bytes.fetch_add(json.len(), Relaxed);
                    true
                })
            {
                let repos = side.repos_of(&side.refs(&e), &allowed);
                missing.insert(e.id, (Some(json), repos));
            } else {
                *beyond += 1;
            }
            true
        };
        let mut bad_sigs = 0u64;
        let result = 'query: {
            if try_nip77 && own_f.len() <= nip77_cfg.max_own_items {
                match conn.reconcile(&filter, &own_f, nip77_cfg, deadline) {
                    Ok((have, need)) => {
                        answered = true;
                        used_nip77 = true;
                        let have_set: HashSet<EventId> = have.iter().copied().collect();
                        held.extend(
                            own_f
                                .iter()
                                .map(|(_, id)| *id)
                                .filter(|id| !have_set.contains(id)),
                        );
                        candidates.extend(have);
                        let mut delivered = 0usize;
                        let r = conn.fetch_ids(
                            &filter,
                            &need,
                            &limits,
                            page_timeout,
                            deadline,
                            &mut |e| {
                                delivered += 1;
                                keep(e, &mut missing, &mut bad_sigs, &mut beyond)
                            },
                        );
                        audit.undelivered += need.len().saturating_sub(delivered);
                        break 'query r;
                    }
                    Err(why) => {
                        if nip77 == Some(true) {
                            log::warn!("audit: {url}: NIP-77 failed ({why}); reading by REQ");
                        } else {
                            log::info!("audit: {url}: no NIP-77 ({why}); reading by REQ");
                        }
                        try_nip77 = false;
                    }
                }
            }
            used_req = true;
            candidates.extend(own_f.iter().map(|(_, id)| *id));
            let r = conn.read_history(&filter, &limits, page_timeout, deadline, &mut |e| {
                let id = e.id;
                let trusted = keep(e, &mut missing, &mut bad_sigs, &mut beyond);
                if trusted {
                    held.insert(id);
                }
                trusted
            });
            if r.is_ok() {
                answered = true;
            }
            r
        };
        audit.rejected += bad_sigs;
        match result {
            Ok(QueryEnd::Complete) => {}
            Ok(QueryEnd::Incomplete(why)) => {
                audit.outcome = RelayOutcome::Incomplete(why);
            }
            Err(why) => {
                log::warn!("audit: {url}: {why}");
                audit.outcome = if answered {
                    RelayOutcome::Incomplete(why)
                } else {
                    RelayOutcome::Unreachable(why)
                };
                // What was asked of this filter is not known in full: no extras from it.
                candidates.retain(|id| held.contains(id));
                break;
            }
        }
    }
    audit.missing_not_kept = beyond;
    audit.rejected += conn.rejected;
    audit.learned_cap = conn.caps.learned_cap;
    audit.method = match (used_nip77, used_req) {
        (true, true) => "nip77+req",
        (true, false) => "nip77",
        _ => "req",
    };
    finish(audit, missing, candidates, held)
}

/// Publishes `events` to the own relay on a connection of their own.
fn publish(
    config: &Config,
    policy: &Arc<crate::net::policy::AddressPolicy>,
    opts: &AuditOptions,
    events: &[(EventId, String)],
) -> FixOutcome {
    let mut outcome = FixOutcome {
        sent: events.len(),
        ..FixOutcome::default()
    };
    let mut conn = match open_own(config, policy) {
        Ok((c, _)) => c,
        Err(why) => {
            outcome.failed = events
                .iter()
                .map(|(id, _)| (*id, format!("own relay not reached: {why}")))
                .collect();
            return outcome;
        }
    };
    let deadline = deadline_in(opts.relay_deadline);
    match conn.publish(events, opts.publish_window.max(1), 6, deadline) {
        Ok(answers) => {
            for (id, answer) in answers {
                match answer {
                    Ok(true) => outcome.duplicate += 1,
                    Ok(false) => outcome.accepted += 1,
                    Err(why) => outcome.failed.push((id, why)),
                }
            }
        }
        Err(why) => {
            outcome.failed = events
                .iter()
                .map(|(id, _)| (*id, format!("connection to the own relay lost: {why}")))
                .collect();
        }
    }
    log::info!(
        "audit --fix: {} stored, {} already there, {} failed",
        outcome.accepted,
        outcome.duplicate,
        outcome.failed.len()
    );
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::filters::build_layer2_and_layer3_filters;
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};

    fn keys() -> Keys {
        Keys::parse("6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e").unwrap()
    }

    fn event(kind: u16, tags: &[[&str; 2]]) -> Event {
        let mut b = EventBuilder::new(Kind::Custom(kind), "x");
        for t in tags {
            b = b.tag(Tag::parse(*t).unwrap());
        }
        b.finalize(&keys()).unwrap()
    }

    #[test]
    fn own_events_link_to_repositories_through_coordinates_and_root_ids() {
        let repo = format!("30617:{}:r", keys().public_key().to_hex());
        let root = event(1621, &[["a", &repo]]);
        let mut index = RepoSyncIndex::default();
        index
            .entry(repo.clone())
            .or_default()
            .root_events
            .insert(root.id);
        let mut side = OwnSide::new(&index, &HashSet::from_iter([repo.clone()]));
        let reply = event(1111, &[["E", &root.id.to_hex()]]);
        let unrelated = event(1111, &[["e", &"ab".repeat(32)]]);
        for e in [&root, &reply, &unrelated] {
            side.add(e);
        }
        let allowed = HashSet::from_iter([0]);
        assert_eq!(
            side.repos_of(&side.events[&reply.id].refs, &allowed),
            vec![0]
        );
        assert!(side
            .repos_of(&side.events[&unrelated.id].refs, &allowed)
            .is_empty());
        let filters = build_layer2_and_layer3_filters(
            &HashSet::from_iter([repo]),
            &HashSet::from_iter([root.id]),
            None,
        );
        let matched: HashSet<EventId> = filters
            .iter()
            .flat_map(|f| side.matching(f))
            .map(|(_, id)| id)
            .collect();
        assert_eq!(matched, HashSet::from_iter([root.id, reply.id]));
    }

    #[test]
    fn the_newest_announcement_gives_the_relays() {
        let config = Config::new(RelayUrl::parse("ws://127.0.0.1:1").unwrap());
        let mut own = OwnIndex::new(&config);
        let ann = |t: u64, relay: &str| {
            EventBuilder::new(Kind::Custom(30617), "")
                .tag(Tag::parse(["d", "r"]).unwrap())
                .tag(Tag::parse(["relays", relay]).unwrap())
                .custom_created_at(nostr::types::Timestamp::from_secs(t))
                .finalize(&keys())
                .unwrap()
        };
        own.add(&ann(10, "wss://new.example"));
        own.flush();
        own.add(&ann(5, "wss://old.example"));
        own.flush();
        let repo = format!("30617:{}:r", keys().public_key().to_hex());
        let relays: Vec<String> = own.index[&repo]
            .relays
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(relays, vec!["wss://new.example"]);
    }

    #[test]
    fn a_repository_name_is_escaped_in_the_table() {
        // Issue 36, item 14: a `d` with terminal control sequences, from a stranger's
        // announcement, reached the operator's terminal unescaped.
        let pk = "a".repeat(64);
        let shown = short_repo(&format!("30617:{pk}:evil\u{1b}[2Jname"));
        assert!(!shown.contains('\u{1b}'), "{shown:?}");
        assert!(shown.starts_with("aaaaaaaa…:evil"), "{shown:?}");
        assert!(
            short_repo(&format!("30617:{pk}:{}", "x".repeat(500)))
                .chars()
                .count()
                < 100
        );
    }

    #[test]
    fn exit_code_follows_what_is_still_missing() {
        let mut report = AuditReport {
            own_relay: RelayUrl::parse("ws://127.0.0.1:1").unwrap(),
            repositories: 1,
            repositories_targeted: 1,
            root_events: 0,
            thread_events: 0,
            own_events: 0,
            relays: Vec::new(),
            missing: 2,
            not_kept: 0,
            fix: None,
        };
        assert_eq!(report.exit_code(), 1);
        report.fix = Some(FixOutcome {
            sent: 2,
            accepted: 1,
            duplicate: 1,
            failed: Vec::new(),
        });
        assert_eq!(report.exit_code(), 0);
        assert!(report.table().contains("nothing missing"));
        report.fix.as_mut().unwrap().duplicate = 0;
        assert_eq!(report.exit_code(), 1);
        assert_eq!(report.to_json()["still_missing"], 1);
    }
}
