//! Reply chains below root events: which events below a root are followed (issue 34).
//!
//! GRASP-01 makes "other events that tag, or are tagged by, accepted issues or patches"
//! related, and ngit-grasp 3.0.10 follows the chain down from a root
//! (`src/sync/mod.rs`, `recursive_descendant_frontier_with_limits`): an event that tags (with
//! `e`, `E` or `q`, `core::filters::ID_TAGS`) a root event, or an event already
//! followed below one, is related too. A followed event (a *thread member*) becomes a
//! Layer-3 tag value like its root, so its own replies are fetched from every relay of the
//! root's repositories and stay subscribed live.
//!
//! [`Threads`] decides which events are followed, from what the own relay holds (the
//! self-subscription's thread read, `SyncMachine::process_batch`; the audit reads the own
//! relay through the same [`crate::core::related::apply_batch`]). Each member has a root and
//! a depth: 1 + the smallest depth of the known events it tags (a root is at depth 0). It is
//! bounded three ways ([`ThreadLimits`], decision 0097):
//!
//! * depth: an event at depth `max_depth + 1` is related (it was fetched because it tags a
//!   member) but not followed; nothing deeper is fetched ([`ThreadCounters::beyond_depth`]);
//! * size: at most `max_per_thread` members per root ([`ThreadCounters::thread_full`]);
//! * in total: at most `max_total` members ([`ThreadCounters::cap_reached`]).
//!
//! An event read before the event it tags is known (the own relay answers newest first, so a
//! reply comes before its parent) waits, at most `max_waiting` of them
//! ([`ThreadCounters::waiting_dropped`]; the oldest waiting event is dropped first, and a
//! drop asks for another read of the own relay, [`Threads::take_overflowed`]).
//!
//! Deletions (kind 5) never reach this module: they are synced where they tag a related
//! event, and nothing replies to a deletion (decision 0098). Members are never forgotten,
//! as root events are not.

use std::collections::VecDeque;

use crate::core::hash::HashMap;

use nostr::event::EventId;

use crate::core::nip34::RepoRef;

pub use crate::core::nip34::MAX_REPLY_REFS;

/// Default of [`ThreadLimits::max_depth`] (ngit-grasp's `MAX_DESCENDANT_FRONTIER_DEPTH`).
pub const DEFAULT_MAX_DEPTH: u8 = 8;
/// Default of [`ThreadLimits::max_per_thread`] (ngit-grasp's
/// `NGIT_SYNC_RECURSIVE_DESCENDANT_LIMIT`).
pub const DEFAULT_MAX_PER_THREAD: usize = 500;
/// Default of [`ThreadLimits::max_total`].
pub const DEFAULT_MAX_TOTAL: usize = 100_000;
/// Default of [`ThreadLimits::max_waiting`].
pub const DEFAULT_MAX_WAITING: usize = 20_000;

/// The bounds of reply-chain following (`--reply-depth`, `--thread-size`,
/// `--max-thread-ids`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadLimits {
    /// Generations below a root whose replies are followed (default 8): a member at depth
    /// `max_depth` has its replies fetched, and those (depth `max_depth + 1`) are not
    /// followed further. 0 follows nothing below the roots.
    pub max_depth: u8,
    /// Members per root thread (default 500), every depth counted.
    pub max_per_thread: usize,
    /// Members over all threads (default 100,000): every member is a tag value in the
    /// Layer-3 filters of each relay of its repositories.
    pub max_total: usize,
    /// Events held while the event they tag is not known yet (default 20,000).
    pub max_waiting: usize,
}

impl Default for ThreadLimits {
    fn default() -> Self {
        ThreadLimits {
            max_depth: DEFAULT_MAX_DEPTH,
            max_per_thread: DEFAULT_MAX_PER_THREAD,
            max_total: DEFAULT_MAX_TOTAL,
            max_waiting: DEFAULT_MAX_WAITING,
        }
    }
}

/// Events related through a chain that were not followed, by bound (sightings: an event read
/// again, after a reconnect of the own relay, counts again).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ThreadCounters {
    /// Events one generation below the deepest followed one: synced, their replies not.
    pub beyond_depth: u64,
    /// Events of a root thread that already had `max_per_thread` members.
    pub thread_full: u64,
    /// Events found while `max_total` members were followed.
    pub cap_reached: u64,
    /// Events dropped from the waiting set (it was full): the next read of the own relay
    /// may follow them.
    pub waiting_dropped: u64,
}

/// An event newly followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// The event.
    pub id: EventId,
    /// The root event of its thread.
    pub root: EventId,
    /// Generations below the root (1: it tags the root).
    pub depth: u8,
}

#[derive(Debug, Clone, Copy)]
struct RootEntry {
    /// Its first repository (index into `Threads::repo_names`).
    repo: u32,
    /// Members of its thread.
    members: u32,
    /// Its index in `Threads::root_ids`.
    index: u32,
}

/// A followed event: 8 bytes beside its id (its root by index; with the root's id it took
/// 33, and the member map is one entry per followed event: issue 37).
#[derive(Debug, Clone, Copy)]
struct Member {
    /// Its root (index into `Threads::root_ids`).
    root: u32,
    depth: u8,
}

/// Thread members and what waits for them. See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct Threads {
    limits: ThreadLimits,
    /// Repository coordinates of the roots, interned.
    repo_names: Vec<RepoRef>,
    repo_ids: HashMap<RepoRef, u32>,
    /// Every root event linked to a repository.
    roots: HashMap<EventId, RootEntry>,
    /// The ids of `roots`, in the order they were linked (roots are never forgotten).
    root_ids: Vec<EventId>,
    /// Roots of more than one repository: the others (rare: a root event of a fork).
    more_repos: HashMap<EventId, Vec<u32>>,
    members: HashMap<EventId, Member>,
    /// Events waiting for one of the events they tag, with those.
    waiting: HashMap<EventId, Box<[EventId]>>,
    /// Per tagged event not known yet: the waiting events tagging it (at most
    /// `max_per_thread` each).
    by_parent: HashMap<EventId, Vec<EventId>>,
    /// Waiting events, oldest first (may hold events no longer waiting).
    order: VecDeque<EventId>,
    counters: ThreadCounters,
    overflowed: bool,
}

impl Threads {
    /// Nothing followed yet.
    #[must_use]
    pub fn new(limits: ThreadLimits) -> Threads {
        Threads {
            limits,
            ..Threads::default()
        }
    }

    /// The bounds.
    pub fn limits(&self) -> ThreadLimits {
        self.limits
    }

    /// Root event `id` belongs to `repos` (its `a` tags; the same at every sighting). Events
    /// that waited for it are followed now, into `out`.
    pub fn link_root(&mut self, id: EventId, repos: &[RepoRef], out: &mut Vec<Admitted>) {
        let Some((first, rest)) = repos.split_first() else {
            return;
        };
        let new = !self.roots.contains_key(&id);
        let first = self.intern(first);
        let index = self.root_ids.len() as u32;
        let entry = self.roots.entry(id).or_insert(RootEntry {
            repo: first,
            members: 0,
            index,
        });
        if new {
            self.root_ids.push(id);
        }
        let known_first = entry.repo;
        let mut others: Vec<u32> = Vec::new();
        for r in std::iter::once(first).chain(rest.iter().map(|r| self.intern(r))) {
            if r != known_first && !others.contains(&r) {
                others.push(r);
            }
        }
        if !others.is_empty() {
            let more = self.more_repos.entry(id).or_default();
            for r in others {
                if !more.contains(&r) {
                    more.push(r);
                }
            }
        }
        if new {
            // An event first read as a member (without its `a` tags) is a root now.
            if let Some(m) = self.members.remove(&id) {
                if let Some(e) = self.roots.get_mut(&self.root_ids[m.root as usize]) {
                    e.members = e.members.saturating_sub(1);
                }
            }
            self.resolve(id, out);
        }
    }

    /// An event that tags `parents` (its `e`, `E` and `q` ids, at most [`MAX_REPLY_REFS`]).
    /// Followed when one of them is a root or a member and the bounds allow; waits when none
    /// is known yet. What it makes followed (itself and events that waited for it) goes to
    /// `out`.
    pub fn reply(&mut self, id: EventId, parents: &[EventId], out: &mut Vec<Admitted>) {
        if self.roots.contains_key(&id)
            || self.members.contains_key(&id)
            || self.waiting.contains_key(&id)
        {
            return;
        }
        let parents = &parents[..parents.len().min(MAX_REPLY_REFS)];
        match self.best_parent(parents) {
            Some((depth, root)) => {
                if self.admit(id, depth.saturating_add(1), root, out) {
                    self.resolve(id, out);
                }
            }
            None => self.park(id, parents),
        }
    }

    /// The repositories of root `root` (none for an id that is not a root).
    pub fn repos_of(&self, root: &EventId) -> impl Iterator<Item = &RepoRef> + '_ {
        let first = self.roots.get(root).map(|e| e.repo);
        let more = self
            .more_repos
            .get(root)
            .map(|v| v.as_slice())
            .unwrap_or(&[]);
        first
            .into_iter()
            .chain(more.iter().copied())
            .map(|r| &self.repo_names[r as usize])
    }

    /// True when `id` is followed (a member; roots are not members).
    pub fn is_member(&self, id: &EventId) -> bool {
        self.members.contains_key(id)
    }

    /// The root and depth of member `id`.
    pub fn member(&self, id: &EventId) -> Option<(EventId, u8)> {
        self.members
            .get(id)
            .map(|m| (self.root_ids[m.root as usize], m.depth))
    }

    /// Members followed.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// True when nothing is followed.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Events waiting for an event they tag.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// What the bounds left out so far.
    pub fn counters(&self) -> ThreadCounters {
        self.counters
    }

    /// True (once) when a waiting event was dropped since the last call: another read of the
    /// own relay, with more parents known, may follow it.
    pub fn take_overflowed(&mut self) -> bool {
        std::mem::take(&mut self.overflowed)
    }

    fn intern(&mut self, repo: &RepoRef) -> u32 {
        if let Some(r) = self.repo_ids.get(repo) {
            return *r;
        }
        let r = self.repo_names.len() as u32;
        self.repo_names.push(repo.clone());
        self.repo_ids.insert(repo.clone(), r);
        r
    }

    /// The shallowest known event among `parents`: (its depth, its thread's root); ties go
    /// to the smaller root id, so the choice does not depend on the tags' order.
    fn best_parent(&self, parents: &[EventId]) -> Option<(u8, EventId)> {
        parents
            .iter()
            .filter_map(|p| {
                if self.roots.contains_key(p) {
                    Some((0, *p))
                } else {
                    self.members
                        .get(p)
                        .map(|m| (m.depth, self.root_ids[m.root as usize]))
                }
            })
            .min()
    }

    /// Follows `id` at `depth` in `root`'s thread if the bounds allow.
    fn admit(&mut self, id: EventId, depth: u8, root: EventId, out: &mut Vec<Admitted>) -> bool {
        if depth > self.limits.max_depth {
            self.counters.beyond_depth += 1;
            return false;
        }
        let Some(entry) = self.roots.get_mut(&root) else {
            return false;
        };
        let index = entry.index;
        if entry.members as usize >= self.limits.max_per_thread {
            self.counters.thread_full += 1;
            return false;
        }
        if self.members.len() >= self.limits.max_total {
            self.counters.cap_reached += 1;
            return false;
        }
        entry.members += 1;
        self.members.insert(id, Member { root: index, depth });
        out.push(Admitted { id, root, depth });
        true
    }

    /// `known` became a root or a member: the events waiting for it are followed (and those
    /// waiting for them, and so on).
    fn resolve(&mut self, known: EventId, out: &mut Vec<Admitted>) {
        let mut queue = vec![known];
        while let Some(parent) = queue.pop() {
            let Some(children) = self.by_parent.remove(&parent) else {
                continue;
            };
            for child in children {
                let Some(parents) = self.waiting.remove(&child) else {
                    continue;
                };
                for q in parents.iter().filter(|q| **q != parent) {
                    self.unlist(q, &child);
                }
                let Some((depth, root)) = self.best_parent(&parents) else {
                    continue;
                };
                if self.admit(child, depth.saturating_add(1), root, out) {
                    queue.push(child);
                }
            }
        }
        self.compact_order();
    }

    /// Removes `child` from the waiting list of `parent`.
    fn unlist(&mut self, parent: &EventId, child: &EventId) {
        if let Some(list) = self.by_parent.get_mut(parent) {
            list.retain(|c| c != child);
            if list.is_empty() {
                self.by_parent.remove(parent);
            }
        }
    }

    /// `id` waits for one of `parents` (none known yet).
    fn park(&mut self, id: EventId, parents: &[EventId]) {
        if parents.is_empty() {
            return;
        }
        if self.limits.max_waiting == 0 {
            self.drop_waiting();
            return;
        }
        while self.waiting.len() >= self.limits.max_waiting {
            if !self.evict_oldest() {
                break;
            }
        }
        let mut listed = false;
        for p in parents {
            let list = self.by_parent.entry(*p).or_default();
            if list.len() < self.limits.max_per_thread {
                list.push(id);
                listed = true;
            }
        }
        if !listed {
            // Every event it tags has a full list: it could not be followed anyway.
            self.drop_waiting();
            return;
        }
        self.waiting.insert(id, parents.into());
        self.order.push_back(id);
    }

    fn drop_waiting(&mut self) {
        self.counters.waiting_dropped += 1;
        self.overflowed = true;
    }

    /// Drops the oldest waiting event; false when none waits.
    fn evict_oldest(&mut self) -> bool {
        while let Some(old) = self.order.pop_front() {
            if let Some(parents) = self.waiting.remove(&old) {
                for q in parents.iter() {
                    self.unlist(q, &old);
                }
                self.drop_waiting();
                return true;
            }
        }
        false
    }

    /// Forgets the entries of `order` that no longer wait, once they are most of it.
    fn compact_order(&mut self) {
        if self.order.len() > 2 * self.waiting.len() + 1024 {
            let waiting = &self.waiting;
            self.order.retain(|id| waiting.contains_key(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_takes_8_bytes_beside_its_id() {
        assert!(std::mem::size_of::<Member>() <= 8);
    }

    fn id(n: u32) -> EventId {
        let mut b = [0u8; 32];
        b[..4].copy_from_slice(&n.to_be_bytes());
        b[31] = 1;
        EventId::from_byte_array(b)
    }

    fn repo() -> RepoRef {
        format!("30617:{}:r", "ab".repeat(32))
    }

    fn limits(depth: u8, per_thread: usize, total: usize, waiting: usize) -> ThreadLimits {
        ThreadLimits {
            max_depth: depth,
            max_per_thread: per_thread,
            max_total: total,
            max_waiting: waiting,
        }
    }

    fn ids(out: &[Admitted]) -> Vec<EventId> {
        out.iter().map(|a| a.id).collect()
    }

    #[test]
    fn a_chain_is_followed_to_its_depth_and_the_next_generation_is_counted() {
        let mut t = Threads::new(limits(3, 500, 1000, 100));
        let mut out = Vec::new();
        t.link_root(id(0), &[repo()], &mut out);
        for n in 1..=5 {
            t.reply(id(n), &[id(n - 1)], &mut out);
        }
        assert_eq!(ids(&out), vec![id(1), id(2), id(3)]);
        assert_eq!(t.member(&id(3)), Some((id(0), 3)));
        assert_eq!(t.counters().beyond_depth, 1, "id 4: related, not followed");
        // id 5 tags id 4, which is not followed: it waits (and is never followed).
        assert_eq!(t.waiting(), 1);
    }

    #[test]
    fn replies_read_before_their_parents_wait_and_follow_them() {
        let mut t = Threads::new(limits(8, 500, 1000, 100));
        let mut out = Vec::new();
        // Newest first, as a relay answers: the deepest reply first, the root last.
        for n in (1..=4).rev() {
            t.reply(id(n), &[id(n - 1)], &mut out);
        }
        assert!(out.is_empty());
        assert_eq!(t.waiting(), 4);
        t.link_root(id(0), &[repo()], &mut out);
        assert_eq!(ids(&out), vec![id(1), id(2), id(3), id(4)]);
        assert_eq!(t.waiting(), 0);
        assert_eq!(t.member(&id(4)), Some((id(0), 4)));
        let repos: Vec<&RepoRef> = t.repos_of(&id(0)).collect();
        assert_eq!(repos, vec![&repo()]);
    }

    #[test]
    fn a_thread_and_all_threads_are_bounded_and_counted() {
        let mut t = Threads::new(limits(8, 3, 4, 100));
        let mut out = Vec::new();
        t.link_root(id(0), &[repo()], &mut out);
        t.link_root(id(100), &[repo()], &mut out);
        for n in 1..=5 {
            t.reply(id(n), &[id(0)], &mut out);
        }
        assert_eq!(ids(&out), vec![id(1), id(2), id(3)]);
        assert_eq!(t.counters().thread_full, 2);
        for n in 101..=103 {
            t.reply(id(n), &[id(100)], &mut out);
        }
        assert_eq!(t.len(), 4, "the cap over all threads");
        assert_eq!(t.counters().cap_reached, 2);
        // The same event read again changes nothing.
        let before = t.counters();
        t.reply(id(1), &[id(0)], &mut out);
        assert_eq!(t.counters(), before);
    }

    #[test]
    fn the_waiting_set_is_bounded_and_asks_for_another_read() {
        let mut t = Threads::new(limits(8, 500, 1000, 2));
        let mut out = Vec::new();
        for n in 1..=3 {
            t.reply(id(n), &[id(1000 + n)], &mut out);
        }
        assert_eq!(t.waiting(), 2);
        assert_eq!(t.counters().waiting_dropped, 1);
        assert!(t.take_overflowed());
        assert!(!t.take_overflowed(), "once");
        // The oldest (id 1) was dropped: its parent arriving follows nothing.
        t.link_root(id(1001), &[repo()], &mut out);
        assert!(out.is_empty());
        t.link_root(id(1002), &[repo()], &mut out);
        assert_eq!(ids(&out), vec![id(2)]);
    }

    #[test]
    fn the_shallowest_parent_gives_depth_and_root_whatever_the_tag_order() {
        let mut t = Threads::new(limits(8, 500, 1000, 100));
        let mut out = Vec::new();
        t.link_root(id(0), &[repo()], &mut out);
        t.reply(id(1), &[id(0)], &mut out);
        t.reply(id(2), &[id(1)], &mut out);
        // A NIP-22 reply to id 2: `e` its parent, `E` the root.
        t.reply(id(3), &[id(2), id(0)], &mut out);
        assert_eq!(t.member(&id(3)), Some((id(0), 1)));
        assert_eq!(t.member(&id(2)), Some((id(0), 2)));
    }

    #[test]
    fn a_root_of_two_repositories_gives_both() {
        let mut t = Threads::new(ThreadLimits::default());
        let other = format!("30617:{}:fork", "cd".repeat(32));
        let mut out = Vec::new();
        t.link_root(id(0), &[repo(), other.clone()], &mut out);
        let repos: Vec<&RepoRef> = t.repos_of(&id(0)).collect();
        assert_eq!(repos, vec![&repo(), &other]);
        assert_eq!(t.repos_of(&id(9)).count(), 0);
    }
}
