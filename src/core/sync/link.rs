//! The machine's record of one relay connection's subscriptions ([`Link`]): what is open,
//! loading, queued for room in the relay's budget, parked, polled, to be reopened and to be
//! resumed after a quick reconnect, its health and its last error. Remote relays have one
//! each (in [`RemoteRelay`](super::remote::RemoteRelay)), the own relay one of its own.
//! Also the two filter rewrites every query path uses ([`live_only`], [`history_since`]).

use crate::core::hash::{HashMap, HashSet};
use std::collections::VecDeque;
use std::fmt;

use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::health::Health;
use crate::core::paging::PageStats;
use crate::core::relay_text::Prefix;
use crate::core::state::PendingItems;
use crate::core::time::Time;
use crate::core::wire::Disconnect;

use super::SubPurpose;

/// Why a relay's last connection failed or ended ([`super::RelaySyncStatus::last_error`]),
/// kept typed: [`fmt::Display`] renders it for the status and the log (the cause escaped, at
/// most 200 characters of it).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LinkError {
    /// A connect attempt failed.
    ConnectFailed(Disconnect),
    /// An open connection was lost.
    Lost(Disconnect),
    /// The own relay closed the self-subscription: the connection is replaced.
    SelfSubscriptionClosed,
}

impl LinkError {
    /// The failure of a connection that was up (`was_connected`), else of a connect attempt.
    #[must_use]
    pub fn of(cause: &Disconnect, was_connected: bool) -> LinkError {
        if was_connected {
            LinkError::Lost(cause.clone())
        } else {
            LinkError::ConnectFailed(cause.clone())
        }
    }

    /// What failed at the connection, if it was the connection (not a CLOSED).
    #[must_use]
    pub fn cause(&self) -> Option<&Disconnect> {
        match self {
            LinkError::ConnectFailed(d) | LinkError::Lost(d) => Some(d),
            LinkError::SelfSubscriptionClosed => None,
        }
    }

    /// What went wrong, without whether a connection was up: the log text of the cause,
    /// escaped and bounded.
    #[must_use]
    pub fn reason(&self) -> String {
        match self.cause() {
            Some(d) => crate::core::message::escape_for_log(&d.to_string(), 200),
            None => "CLOSED by the relay".to_string(),
        }
    }
}

impl fmt::Display for LinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkError::ConnectFailed(_) => write!(f, "connect failed: {}", self.reason()),
            LinkError::Lost(_) => write!(f, "lost: {}", self.reason()),
            LinkError::SelfSubscriptionClosed => {
                write!(f, "self-subscription {}", self.reason())
            }
        }
    }
}

/// The most history queries kept to resume after a quick reconnect; beyond it the next
/// connect is a fresh sync.
pub(super) const MAX_RESUME: usize = 1_000;

/// The most distinct CLOSED prefixes and NOTICE texts remembered per relay for "warn once";
/// beyond it repeats are logged at debug level.
pub(crate) const MAX_WARNED: usize = 64;

/// The filter of a live-only subscription for the same events as `f`: no `since`/`until`,
/// `limit: 0` (no stored events, only new ones).
pub(crate) fn live_only(f: &Filter) -> Filter {
    let mut f = f.clone();
    f.since = None;
    f.until = None;
    f.limit = Some(0);
    f
}

/// The filter of a history query for the same events as `f` from `since` on (no `limit`:
/// the relay's page size applies and paging reads the rest).
pub(crate) fn history_since(f: Filter, since: nostr::types::Timestamp) -> Filter {
    let mut f = f;
    f.since = Some(since);
    f.until = None;
    f.limit = None;
    f
}

impl Link {
    /// REQs open on the relay (what its subscription budget counts): the open
    /// subscriptions, those sent together in one REQ counted once (decision 0110).
    pub(super) fn open_reqs(&self) -> usize {
        if self.packed.is_empty() {
            return self.subs.len();
        }
        // A REQ's id is its first member's: a subscription that is a REQ's id (or not packed)
        // counts once; members whose REQ's first member is closed count once per REQ. (It
        // runs for every query a drain looks at: a set of every open id was 8 % of a first
        // sync's coordinator CPU.)
        let mut reqs = 0;
        let mut headless: Vec<&SubscriptionId> = Vec::new();
        for id in self.subs.keys() {
            match self.packed.get(id) {
                Some(wire) if wire != id => {
                    if !self.subs.contains_key(wire) {
                        headless.push(wire);
                    }
                }
                _ => reqs += 1,
            }
        }
        headless.sort_unstable();
        headless.dedup();
        reqs + headless.len()
    }

    /// Drops the entries of [`Link::packed`] whose subscription is closed, once they
    /// outnumber the open ones.
    pub(super) fn forget_closed_members(&mut self) {
        if self.packed.len() > 2 * self.subs.len() + 32 {
            let subs = &self.subs;
            self.packed.retain(|id, _| subs.contains_key(id));
        }
    }

    /// Remembers `key` for "warn once"; true the first time. Bounded by [`MAX_WARNED`].
    pub(super) fn warn_once(&mut self, key: Warned) -> bool {
        if self.warned.contains(&key) {
            return false;
        }
        if self.warned.len() >= MAX_WARNED {
            return false;
        }
        self.warned.insert(key)
    }

    /// Keeps the history queries that were not finished (sent without EOSE, queued, waiting
    /// to be reopened, or waiting for room for their pages) so that a quick reconnect
    /// continues them from where they were; batch queries are not kept (their batch fails
    /// and is sent again whole).
    pub(super) fn keep_unfinished_history(&mut self) {
        let mut kept: Vec<Filter> = Vec::new();
        for (sub, info) in &self.subs {
            if self.loading.contains_key(sub) && !is_batch_query(info.purpose) {
                if info.filter.limit == Some(0) {
                    continue;
                }
                kept.push(std::sync::Arc::unwrap_or_clone(info.query()));
            }
        }
        for (_, info) in &self.queue {
            if !is_batch_query(info.purpose) && info.filter.limit != Some(0) {
                kept.push(std::sync::Arc::unwrap_or_clone(info.query()));
            }
        }
        for (_, purpose, filter) in &self.reopen {
            // A live purpose (Layer 1) closed before its EOSE waits with its history: only
            // a live-only filter carries none.
            if !purpose.is_live() || filter.limit != Some(0) {
                kept.push(filter.clone());
            }
        }
        // Pages not queued yet for lack of room: the rest of their query.
        for p in self.parked.iter().filter(|p| p.batch.is_none()) {
            kept.push(p.remainder());
        }
        // A poll window not yet read: the reconnect's own catch-up may start later.
        if let Some(ps) = self.poll_since {
            kept.extend(self.polled.iter().map(|f| f.clone().since(ps)));
        }
        for f in kept {
            if self.resume.len() >= MAX_RESUME {
                self.resume_overflow = true;
                break;
            }
            if !self.resume.contains(&f) {
                self.resume.push(f);
            }
        }
    }

    /// History queries not finished (live-only REQs, `limit: 0`, carry no history and are
    /// not counted): sent without EOSE yet, waiting for room in the budget, closed by the
    /// relay and waiting to be opened again, and waiting for room for their pages.
    pub(super) fn history_queries_pending(&self) -> usize {
        let history = |f: &Filter| f.limit != Some(0);
        let loading = self
            .loading
            .keys()
            .filter(|s| self.subs.get(*s).is_some_and(|i| history(&i.filter)))
            .count();
        let queued = self
            .queue
            .iter()
            .filter(|(_, i)| history(&i.filter))
            .count();
        let reopen = self.reopen.iter().filter(|(_, _, f)| history(f)).count();
        loading + queued + reopen + self.parked.len()
    }

    /// Forgets every subscription and everything waiting to be (re)subscribed: after a lost
    /// connection, or before the daily resync rebuilds them.
    pub(super) fn forget_subscriptions(&mut self) {
        self.subs.clear();
        self.packed.clear();
        self.loading.clear();
        self.queue.clear();
        self.deferred = PendingItems::default();
        self.reopen.clear();
        self.parked.clear();
        self.polled.clear();
        self.poll_since = None;
        self.rebuild_needed = false;
        self.uncovered_since = None;
        self.live_built_at = None;
        self.polled_at_counts = None;
    }
}

/// What a relay said that was logged at warn level once ([`Link::warn_once`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Warned {
    /// A CLOSED with this prefix.
    Closed(Prefix),
    /// A rate-limit NOTICE with this text (escaped, bounded).
    Notice(String),
}

/// Queries that belong to a batch (its own REQs and their pages).
pub(super) fn is_batch_query(p: SubPurpose) -> bool {
    matches!(
        p,
        SubPurpose::Batch(_) | SubPurpose::Page { batch: Some(_) }
    )
}

/// Loading subscriptions that are not part of a batch (a batch has its own deadline), with
/// the time they were sent.
pub(super) fn unbatched_loading(link: &Link) -> impl Iterator<Item = (&SubscriptionId, Time)> + '_ {
    link.loading.iter().filter_map(|(sub, t)| {
        let info = link.subs.get(sub)?;
        match info.purpose {
            SubPurpose::Batch(_) | SubPurpose::Page { batch: Some(_) } => None,
            _ => Some((sub, *t)),
        }
    })
}

/// A history query whose follow-up pages did not fit the relay's page queue (a full page
/// split into several queries while [`crate::core::paging::MAX_QUEUED_PAGES`] pages wait):
/// its pages are planned again from what it delivered once the queue has room
/// (`SyncMachine::unpark_pages`). One query and its statistics, however many pages.
#[derive(Debug, Clone)]
pub(super) struct Parked {
    /// Stands for its pages in its batch's outstanding set until they are queued.
    pub(super) id: SubscriptionId,
    /// The batch its pages complete, if any.
    pub(super) batch: Option<u64>,
    /// The query exactly as sent.
    pub(super) filter: Filter,
    /// What it delivered before its EOSE.
    pub(super) stats: PageStats,
}

impl Parked {
    /// One query for everything of it not read yet: the query up to the oldest second it
    /// delivered (inclusive).
    pub(super) fn remainder(&self) -> Filter {
        match self.stats.oldest {
            Some(oldest) => self
                .filter
                .clone()
                .until(nostr::types::Timestamp::from_secs(oldest)),
            None => self.filter.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct SubInfo {
    pub(super) purpose: SubPurpose,
    /// The filter exactly as sent (for paging).
    pub(super) filter: std::sync::Arc<Filter>,
    /// The length of `filter`'s JSON, counted once when it is set: a REQ's room is summed
    /// over its members at every confirmation (decision 0110), and a live chunk's filter
    /// holds up to a thousand values. Whoever replaces `filter` sets it again.
    pub(super) json_len: usize,
    /// What its events must also match, not sent ([`Command::Subscribe`]'s `scope`).
    pub(super) scope: Option<std::sync::Arc<Filter>>,
    /// A reconciliation's fetch: the verified set's clock when the own relay's side was read
    /// ([`Command::Subscribe`]'s `fetch_since`).
    pub(super) fetch_since: Option<u32>,
}

impl SubInfo {
    /// A subscription whose events must match `filter` only.
    pub(super) fn new(purpose: SubPurpose, filter: Filter) -> SubInfo {
        SubInfo {
            purpose,
            json_len: crate::core::filter_json::filter_len(&filter),
            filter: filter.into(),
            scope: None,
            fetch_since: None,
        }
    }

    /// The query as one filter, to send again (a later page, a reopen, a resume): the filter
    /// as sent with its scope's tag values put back (the rare re-sent fetch is the query's
    /// full filter, which needs no scope).
    pub(super) fn query(&self) -> std::sync::Arc<Filter> {
        match &self.scope {
            None => self.filter.clone(),
            Some(scope) => {
                let mut f = Filter::clone(&self.filter);
                f.generic_tags = scope.generic_tags.clone();
                f.into()
            }
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Link {
    pub(super) subs: HashMap<SubscriptionId, SubInfo>,
    /// Subscriptions still loading stored history (no EOSE yet); consolidation never
    /// closes these.
    pub(super) loading: HashMap<SubscriptionId, Time>,
    pub(super) health: Health,
    /// New items waiting for a consolidation (which waits for pending batches; at the
    /// latest at [`Timer::Consolidate`]).
    pub(super) deferred: PendingItems,
    /// Subscriptions (not part of a batch) closed by the relay, to open again at a time
    /// (the earliest is [`Timer::Reopen`], or [`Timer::OwnReopen`] on the own relay).
    pub(super) reopen: Vec<(Time, SubPurpose, Filter)>,
    /// CLOSED prefixes and NOTICE texts already logged at warn level for this relay.
    pub(super) warned: HashSet<Warned>,
    /// Subscriptions waiting for room in the relay's subscription budget (in order).
    pub(super) queue: VecDeque<(SubscriptionId, SubInfo)>,
    /// History queries whose follow-up pages wait for room in the queue (in order; at most
    /// [`batches::MAX_PARKED`]).
    pub(super) parked: VecDeque<Parked>,
    /// Layer 2/3 queries of confirmed items that do not fit the budget as live
    /// subscriptions: re-run every poll interval with `since`, closed at EOSE.
    pub(super) polled: Vec<Filter>,
    /// `since` of the next poll round (which starts at [`Timer::Poll`]).
    pub(super) poll_since: Option<nostr::types::Timestamp>,
    /// A batch's subscriptions were closed at EOSE to make room: rebuild the live/polled
    /// sets once the relay is idle.
    pub(super) rebuild_needed: bool,
    /// The earliest moment at which confirmed items of this relay lost their live
    /// subscription without a catch-up yet (a batch query closed at EOSE for room, a live
    /// subscription dropped from the queue): the next rebuild catches up from there.
    pub(super) uncovered_since: Option<Time>,
    /// When the live set was last (re)built: live subscriptions of it still queued at the
    /// next rebuild have covered nothing since then.
    pub(super) live_built_at: Option<Time>,
    /// The confirmed repositories and root events (counts) when a rebuild last left queries
    /// polled: a consolidation is tried again only once they changed (the estimate of
    /// `promote_polled` does not see filters split for the relay's message size).
    pub(super) polled_at_counts: Option<(usize, usize)>,
    /// History queries interrupted by a disconnect, continued on a quick reconnect.
    pub(super) resume: Vec<Filter>,
    /// More than [`MAX_RESUME`] queries were interrupted: the next connect is a fresh sync.
    pub(super) resume_overflow: bool,
    /// Why the last connection failed or was lost.
    pub(super) last_error: Option<LinkError>,
    /// The `since` of the latest catch-up or poll round.
    pub(super) catch_up_since: Option<nostr::types::Timestamp>,
    /// Batches failed, queries incomplete.
    pub(super) failed_batches: u64,
    pub(super) incomplete_queries: u64,
    /// History queries finished: EOSEs of loading queries and reconciliations done
    /// ([`RelaySyncStatus::history_queries_completed`]).
    pub(super) history_queries_completed: u64,
    /// Ids the relay listed for a reconciled query and did not deliver when asked twice
    /// ([`RelaySyncStatus::ids_undelivered`]).
    pub(super) ids_undelivered: u64,
    /// Of those, the ones since its last full sync ([`RelaySyncStatus::history_short`]).
    pub(super) history_short: u64,
    /// Subscriptions sent as members of a REQ of several filters (decision 0110): member id
    /// → the REQ's id (its first member's). Entries of closed subscriptions are dropped
    /// lazily ([`Link::forget_closed_members`]).
    pub(super) packed: HashMap<SubscriptionId, SubscriptionId>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_error_renders_its_cause_escaped_and_bounded_with_what_failed() {
        let read = Disconnect::Read("bad\nframe".into());
        assert_eq!(
            LinkError::of(&read, true).to_string(),
            "lost: read failed: bad\\nframe"
        );
        let long = Disconnect::Tcp("x".repeat(300));
        let shown = LinkError::of(&long, false).to_string();
        assert!(shown.starts_with("connect failed: TCP connect failed: xxx"));
        assert!(shown.ends_with("(120 more bytes)"), "{shown}");
        assert_eq!(
            LinkError::SelfSubscriptionClosed.reason(),
            "CLOSED by the relay"
        );
        assert_eq!(
            LinkError::of(&read, false).cause(),
            LinkError::of(&read, true).cause()
        );
    }

    /// REQs are counted once however many queries share them, also when the query whose id
    /// the REQ carries is closed and its other members are still open.
    #[test]
    fn open_reqs_counts_each_req_once() {
        let id = |s: &str| SubscriptionId::new(s);
        let mut link = Link::default();
        for s in ["a", "b", "c", "d", "e", "f"] {
            link.subs
                .insert(id(s), SubInfo::new(SubPurpose::Live, Filter::new()));
        }
        // REQ "a" holds a, b, c; REQ "d" holds d, e; f is alone.
        for (m, w) in [("a", "a"), ("b", "a"), ("c", "a"), ("d", "d"), ("e", "d")] {
            link.packed.insert(id(m), id(w));
        }
        assert_eq!(link.open_reqs(), 3);
        // a closed: REQ "a" is still open for b and c.
        link.subs.remove(&id("a"));
        assert_eq!(link.open_reqs(), 3);
        link.subs.remove(&id("b"));
        link.subs.remove(&id("c"));
        assert_eq!(link.open_reqs(), 2);
        link.subs.remove(&id("d"));
        assert_eq!(link.open_reqs(), 2);
        link.subs.remove(&id("e"));
        assert_eq!(link.open_reqs(), 1);
    }
}
