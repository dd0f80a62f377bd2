//! What the own relay's events mean for the repository index: one definition, applied by the
//! daemon (`SyncMachine::process_batch`) and by the audit (`ops::audit`), so the two cannot
//! disagree about which repositories, root events and thread members are related.
//!
//! Each event read from the own relay is classified ([`crate::core::nip34::classify_self_event_with`]) and a
//! batch of them is applied here ([`apply_batch`]):
//!
//! * an announcement (30617) gives its repository's relays; an older one than the repository's
//!   newest is ignored;
//! * a root event (1617/1618/1619/1621) links to each repository its `a` tags name
//!   ([`crate::core::nip34::root_event_repos`]);
//! * any other event tagging ids (`e`, `E`, `q`) is a reply: followed below its root when the
//!   bounds allow ([`Threads`]), and then a Layer-3 id of each of the root's repositories
//!   ([`crate::core::state::RepoSyncNeeds::thread_events`]).
//!
//! Within a batch, announcements and root events apply first (in the order read), then the
//! replies, oldest first: a relay answers newest first, so a batch holds replies before
//! their parents.

use nostr::event::EventId;

use crate::core::nip34::{RepoRef, SelfEventMeaning};
use crate::core::state::RepoSyncIndex;
use crate::core::threads::{Admitted, Threads};

/// What applying one batch changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Announcements applied (new, newer or the same one again).
    pub announcements: usize,
    /// Repositories whose announcement is new or newer, in the order read (may repeat).
    pub changed_repos: Vec<RepoRef>,
    /// Repositories whose relay set changed.
    pub relays_changed: Vec<RepoRef>,
    /// Relays named beyond the per-announcement cap by new or newer announcements, ignored.
    pub relays_dropped: u64,
    /// Root events linked to a repository for the first time: (repository, root).
    pub root_links: Vec<(RepoRef, EventId)>,
    /// Root ids new to the index (a root of two repositories counts once).
    pub new_roots: usize,
    /// Root events that name no repository (ignored).
    pub roots_without_repo: usize,
    /// Some repository's root events reached a power of two (its pubkey's activity rose).
    pub came_alive: bool,
    /// Events newly followed, with each repository of their root: (repository, event).
    pub members: Vec<(RepoRef, EventId)>,
}

/// Applies `meanings` (read from the own relay, in the order read) to `index` and
/// `threads`; what changed is added to `applied`.
pub fn apply_batch(
    index: &mut RepoSyncIndex,
    threads: &mut Threads,
    meanings: Vec<SelfEventMeaning>,
    applied: &mut Applied,
) {
    let mut admitted: Vec<Admitted> = Vec::new();
    let mut replies: Vec<(u64, EventId, Vec<EventId>)> = Vec::new();
    for m in meanings {
        match m {
            SelfEventMeaning::Announcement(a) => {
                let needs = index.entry(a.repo_ref.clone()).or_default();
                if needs.announced_at.is_some_and(|t| t > a.created_at) {
                    log::debug!("ignoring older announcement of {}", a.repo_ref);
                    continue;
                }
                if needs.announced_at.is_none_or(|t| t < a.created_at) {
                    // New or newer (the same one read again changes nothing, and its relays
                    // beyond the cap are not counted again).
                    applied.changed_repos.push(a.repo_ref.clone());
                    applied.relays_dropped += a.dropped_relays as u64;
                }
                needs.announced_at = Some(a.created_at);
                if needs.relays.len() != a.relays.len()
                    || a.relays.iter().any(|r| !needs.relays.contains(r))
                {
                    applied.relays_changed.push(a.repo_ref.clone());
                    needs.relays = a.relays.into_iter().collect();
                }
                applied.announcements += 1;
            }
            SelfEventMeaning::RootEvent { id, repos } => {
                if repos.is_empty() {
                    log::debug!("root event {id} names no repository; ignored");
                    applied.roots_without_repo += 1;
                    continue;
                }
                // An event's repositories come from its own tags, so they are the same at
                // every sighting: the id is new to the index exactly when its first
                // repository did not hold it yet.
                let mut first = true;
                for r in &repos {
                    // Looked up by reference: no copy of the key per link.
                    let linked = match index.get_mut(r) {
                        Some(n) => {
                            let linked = n.root_events.insert(id);
                            applied.came_alive |= linked && n.root_events.len().is_power_of_two();
                            linked
                        }
                        None => index.entry(r.clone()).or_default().root_events.insert(id),
                    };
                    if std::mem::take(&mut first) && linked {
                        applied.new_roots += 1;
                    }
                    if linked {
                        applied.root_links.push((r.clone(), id));
                    }
                }
                threads.link_root(id, &repos, &mut admitted);
            }
            SelfEventMeaning::Reply {
                id,
                created_at,
                parents,
            } => replies.push((created_at, id, parents)),
            SelfEventMeaning::Other => {}
        }
    }
    replies.sort_unstable_by_key(|r| (r.0, r.1));
    for (_, id, parents) in replies {
        threads.reply(id, &parents, &mut admitted);
    }
    for a in admitted {
        // Only a member still followed (a later root of the batch may be the same id).
        if !threads.is_member(&a.id) {
            continue;
        }
        let repos: Vec<RepoRef> = threads.repos_of(&a.root).cloned().collect();
        for repo in repos {
            if index
                .entry(repo.clone())
                .or_default()
                .thread_events
                .insert(a.id)
            {
                applied.members.push((repo, a.id));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::nip34::classify_self_event;
    use crate::core::threads::ThreadLimits;
    use nostr::event::{Event, EventBuilder, FinalizeEvent, Kind, Tag};
    use nostr::key::Keys;

    fn keys() -> Keys {
        Keys::parse("6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e").unwrap()
    }

    fn ev(kind: u16, tags: &[&[&str]], at: u64) -> Event {
        let mut b = EventBuilder::new(Kind::Custom(kind), "x")
            .custom_created_at(nostr::types::Timestamp::from_secs(at));
        for t in tags {
            b = b.tag(Tag::parse(t.iter().copied()).unwrap());
        }
        b.finalize(&keys()).unwrap()
    }

    #[test]
    fn replies_read_before_their_root_follow_it_in_one_batch() {
        let repo = format!("30617:{}:r", keys().public_key().to_hex());
        let ann = ev(30617, &[&["d", "r"], &["relays", "wss://a.example"]], 10);
        let root = ev(1621, &[&["a", &repo]], 20);
        let c1 = ev(1, &[&["e", &root.id.to_hex(), "", "root"]], 30);
        let c2 = ev(1, &[&["e", &c1.id.to_hex(), "", "reply"]], 40);
        let quote = ev(1, &[&["q", &c2.id.to_hex()]], 50);
        let deletion = ev(5, &[&["e", &c2.id.to_hex()]], 60);
        // Newest first, as the own relay answers.
        let meanings = [&deletion, &quote, &c2, &c1, &root, &ann]
            .iter()
            .map(|e| classify_self_event(e))
            .collect();
        let mut index = RepoSyncIndex::default();
        let mut threads = Threads::new(ThreadLimits::default());
        let mut applied = Applied::default();
        apply_batch(&mut index, &mut threads, meanings, &mut applied);
        let needs = &index[&repo];
        assert_eq!(
            needs.root_events,
            [root.id]
                .into_iter()
                .collect::<crate::core::hash::HashSet<_>>()
        );
        assert_eq!(
            needs.thread_events,
            [c1.id, c2.id, quote.id]
                .into_iter()
                .collect::<crate::core::hash::HashSet<_>>()
        );
        assert_eq!(applied.members.len(), 3);
        assert_eq!(applied.root_links, vec![(repo.clone(), root.id)]);
        assert_eq!(threads.member(&quote.id), Some((root.id, 3)));
        assert!(
            !threads.is_member(&deletion.id),
            "a deletion is not followed"
        );
    }
}
