//! NIP-34 parsing: repository references, announcement relay sets, root-event links.
//!
//! Everything here is tolerant: malformed tags and coordinates are skipped with a `debug!`
//! line, never a panic, because the input comes from anyone who can publish to a relay.

use log::debug;
use nostr::event::{Event, EventId, Kind};
use nostr::filter::SingleLetterTag;

use crate::shared::RelayUrl;

/// Kind of a repository announcement.
pub const KIND_REPO_ANNOUNCEMENT: u16 = 30617;
/// Kind of a repository state / maintainer list event (only pulled from remote relays).
pub const KIND_REPO_STATE: u16 = 30618;
/// Kind of a patch.
pub const KIND_PATCH: u16 = 1617;
/// Kind of a pull request.
pub const KIND_PULL_REQUEST: u16 = 1618;
/// Kind of a pull request update.
pub const KIND_PULL_REQUEST_UPDATE: u16 = 1619;
/// Kind of an issue.
pub const KIND_ISSUE: u16 = 1621;
/// Kind of a user's grasp list (NIP-34 `10317`): synced with Layer 1 (decision 0099).
pub const KIND_USER_GRASP_LIST: u16 = 10317;
/// Kind of a deletion request (NIP-09): synced where it tags a related event, never followed
/// below it (decision 0098).
pub const KIND_DELETION: u16 = 5;

/// Kinds of root events: events that start a thread of their own and are tracked by id.
pub const ROOT_EVENT_KINDS: [u16; 4] = [
    KIND_PATCH,
    KIND_PULL_REQUEST,
    KIND_PULL_REQUEST_UPDATE,
    KIND_ISSUE,
];

/// The most relays one announcement may name; further ones are ignored (with a warning).
/// An announcement is written by anyone, and every relay costs a thread and a connection.
pub const MAX_RELAYS_PER_ANNOUNCEMENT: usize = 32;

/// A repository reference: the addressable coordinate `30617:<pubkey hex>:<d>`.
pub type RepoRef = String;

/// Returns true when `kind` is a root-event kind (1617, 1618, 1619, 1621).
pub fn is_root_kind(kind: Kind) -> bool {
    ROOT_EVENT_KINDS.contains(&kind.as_u16())
}

/// The longest repository `d` identifier taken, in bytes: a longer one (from a stranger) would
/// travel in every REQ that names the repository (issue 36). Real ones are short names; 128
/// keeps every coordinate (`30617:` + 64 hex + `:` + d) within the state file's 200 bytes.
pub const MAX_D_BYTES: usize = 128;

/// The most repositories one root event links to through its `a` tags: a root event belongs
/// to one repository (a few with forks); one with more counted for each of them (issue 36:
/// one event with 16 `a` tags counted for 16 repositories).
pub const MAX_ROOT_REPOS: usize = 8;

/// Parses a `30617:<pubkey>:<d>` coordinate into its canonical form (pubkey lower-case).
///
/// Returns `None` for another kind, a pubkey that is not 64 hex characters, a missing `d`
/// part or one longer than [`MAX_D_BYTES`]. The `d` part may itself contain `:` and may be
/// empty.
pub fn parse_repo_coordinate(value: &str) -> Option<RepoRef> {
    let mut parts = value.splitn(3, ':');
    let kind = parts.next()?;
    let pubkey = parts.next()?;
    let d = parts.next()?;
    if kind != "30617" {
        return None;
    }
    if pubkey.len() != 64 || !pubkey.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    if d.len() > MAX_D_BYTES {
        return None;
    }
    Some(format!("30617:{}:{}", pubkey.to_ascii_lowercase(), d))
}

/// The repository reference an announcement event defines.
pub fn repo_ref_of_announcement(event: &Event) -> RepoRef {
    let d = event
        .tags
        .iter()
        .find(|t| t.kind() == "d")
        .and_then(|t| t.content())
        .unwrap_or("");
    format!("30617:{}:{}", event.pubkey.to_hex(), d)
}

/// A parsed repository announcement (kind 30617).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    /// `30617:<pubkey>:<d>`.
    pub repo_ref: RepoRef,
    /// Every relay named by every value of every `relays` tag, normalised and de-duplicated.
    pub relays: Vec<RelayUrl>,
    /// The announcement's `created_at` (seconds), to keep only the newest one per repository.
    pub created_at: u64,
    /// Relays it names beyond the per-announcement cap, ignored.
    pub dropped_relays: usize,
}

/// Parses a kind-30617 announcement with the default cap of
/// [`MAX_RELAYS_PER_ANNOUNCEMENT`] relays. Returns `None` for any other kind.
///
/// Unlike the design document's sample code, which reads only the first value of the first
/// relay tag, this reads **every value of every `relays` tag** (NIP-34 puts all relays in one
/// multi-valued tag; some clients write one tag per relay). Values that are not ws/wss URLs
/// are skipped with a debug log.
pub fn parse_announcement(event: &Event) -> Option<Announcement> {
    parse_announcement_with(event, MAX_RELAYS_PER_ANNOUNCEMENT, &[])
}

/// [`parse_announcement`] keeping at most `max_relays` relays (in the order the announcement
/// names them; the rest are ignored with a warning). URLs in `own` (this service's URLs) are
/// kept even past the cap: they are never synced from, and they decide whether the
/// repository is in scope (GRASP-01).
pub fn parse_announcement_with(
    event: &Event,
    max_relays: usize,
    own: &[RelayUrl],
) -> Option<Announcement> {
    if event.kind.as_u16() != KIND_REPO_ANNOUNCEMENT {
        return None;
    }
    let repo_ref = repo_ref_of_announcement(event);
    if repo_ref.len() > "30617::".len() + 64 + MAX_D_BYTES {
        debug!(
            "announcement {}: ignored, its `d` is longer than {MAX_D_BYTES} bytes",
            event.id
        );
        return None;
    }
    let mut relays: Vec<RelayUrl> = Vec::new();
    let mut counted = 0usize;
    let mut dropped = 0usize;
    for tag in event.tags.iter() {
        if tag.kind() != "relays" {
            continue;
        }
        for value in tag.as_slice().iter().skip(1) {
            // Some clients pack several URLs into one value separated by commas or spaces.
            for piece in value.split([',', ' ']).filter(|p| !p.is_empty()) {
                match RelayUrl::parse(piece) {
                    Ok(url) => {
                        if relays.contains(&url) {
                            continue;
                        }
                        if own.contains(&url) {
                            relays.push(url);
                        } else if counted >= max_relays {
                            dropped += 1;
                        } else {
                            counted += 1;
                            relays.push(url);
                        }
                    }
                    Err(e) => debug!(
                        "announcement {} ({}): ignoring relay value {:?}: {}",
                        event.id, repo_ref, piece, e
                    ),
                }
            }
        }
    }
    if dropped > 0 {
        // Counted by the machine (SyncCounters::announcement_relays_dropped); junk
        // announcements must not flood the log.
        debug!(
            "announcement {} ({}) names more than {max_relays} relays; using the first {max_relays}",
            event.id, repo_ref
        );
    }
    Some(Announcement {
        repo_ref,
        relays,
        created_at: event.created_at.as_secs(),
        dropped_relays: dropped,
    })
}

/// The repositories a root event (1617/1618/1619/1621) belongs to: every `a` tag value that
/// is a valid 30617 coordinate, the first [`MAX_ROOT_REPOS`] distinct ones (a bounded list,
/// so the de-duplication is cheap). Returns an empty list for other kinds.
pub fn root_event_repos(event: &Event) -> Vec<RepoRef> {
    if !is_root_kind(event.kind) {
        return Vec::new();
    }
    let mut repos = Vec::new();
    for tag in event.tags.iter() {
        if tag.kind() != "a" {
            continue;
        }
        match tag.content() {
            Some(value) => match parse_repo_coordinate(value) {
                Some(r) => {
                    if !repos.contains(&r) {
                        if repos.len() == MAX_ROOT_REPOS {
                            debug!(
                                "root event {}: more than {MAX_ROOT_REPOS} repositories in its `a` tags; the rest ignored",
                                event.id
                            );
                            break;
                        }
                        repos.push(r)
                    }
                }
                None => debug!(
                    "root event {}: ignoring `a` tag {:?} (not a 30617 coordinate)",
                    event.id, value
                ),
            },
            None => debug!("root event {}: ignoring empty `a` tag", event.id),
        }
    }
    repos
}

/// What one event read from the own relay means for the repository index.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SelfEventMeaning {
    /// A repository announcement.
    Announcement(Announcement),
    /// A root event linked to these repositories.
    RootEvent {
        /// The root event's id.
        id: EventId,
        /// The repositories it belongs to (may be empty: then it is ignored).
        repos: Vec<RepoRef>,
    },
    /// An event that tags other events (`e`, `E`, `q`): a reply, a quote, a reaction, a
    /// status. It is followed when it tags a root event or an event followed below one
    /// ([`crate::core::threads::Threads`]).
    Reply {
        /// The event's id.
        id: EventId,
        /// Its `created_at` (seconds): a batch follows the oldest first.
        created_at: u64,
        /// The ids it tags ([`tagged_ids`]).
        parents: Vec<EventId>,
    },
    /// Nothing we track.
    Other,
}

/// Classifies an event read by the self-subscription (default relay cap per announcement).
pub fn classify_self_event(event: &Event) -> SelfEventMeaning {
    classify_self_event_with(event, MAX_RELAYS_PER_ANNOUNCEMENT, &[])
}

/// [`classify_self_event`] with the relay cap per announcement and this service's URLs (see
/// [`parse_announcement_with`]).
pub fn classify_self_event_with(
    event: &Event,
    max_relays_per_announcement: usize,
    own: &[RelayUrl],
) -> SelfEventMeaning {
    if let Some(a) = parse_announcement_with(event, max_relays_per_announcement, own) {
        return SelfEventMeaning::Announcement(a);
    }
    let root_kind = is_root_kind(event.kind);
    let repos = if root_kind {
        root_event_repos(event)
    } else {
        Vec::new()
    };
    if !repos.is_empty() || (root_kind && !event.tags.iter().any(is_id_tag)) {
        return SelfEventMeaning::RootEvent {
            id: event.id,
            repos,
        };
    }
    if event.kind.as_u16() == KIND_DELETION {
        return SelfEventMeaning::Other;
    }
    let parents = tagged_ids(event);
    if parents.is_empty() {
        return SelfEventMeaning::Other;
    }
    SelfEventMeaning::Reply {
        id: event.id,
        created_at: event.created_at.as_secs(),
        parents,
    }
}

/// The tags that relate an event to a root event or a thread member (Layer 3): `e`, `E`, `q`
/// holding its id. The same tags make an event a reply to follow ([`tagged_ids`]); the
/// Layer-3 filters (`filters::ID_TAGS`, re-exported there) ask for them.
pub(crate) const ID_TAGS: [SingleLetterTag; 3] = [
    SingleLetterTag::LOWERCASE_E,
    SingleLetterTag::UPPERCASE_E,
    SingleLetterTag::LOWERCASE_Q,
];

/// The most distinct event ids read from one event's `e`, `E` and `q` tags: a reply names
/// its root and its parent, a quote one event; an event naming more costs no more work
/// (also `threads::MAX_REPLY_REFS`).
pub const MAX_REPLY_REFS: usize = 8;

/// True for a tag whose letter links an event to the event id it holds ([`ID_TAGS`]:
/// `e`, `E`, `q`).
fn is_id_tag(tag: &nostr::event::Tag) -> bool {
    let s = tag.as_slice();
    s.len() >= 2 && s[0].len() == 1 && ID_TAGS.iter().any(|t| s[0].starts_with(t.as_char()))
}

/// The distinct event ids `event` tags with `e`, `E` or `q` (the Layer-3 tags,
/// `filters::ID_TAGS`), in tag order, its own id left out, at most
/// [`MAX_REPLY_REFS`]. A `q` holding a coordinate (`kind:pubkey:d`) or
/// any value that is not 64 hex characters names no event and is skipped.
pub fn tagged_ids(event: &Event) -> Vec<EventId> {
    let mut ids = Vec::new();
    for tag in event.tags.iter() {
        if !is_id_tag(tag) {
            continue;
        }
        let value = tag.as_slice()[1].as_str();
        if value.len() != 64 || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
            continue;
        }
        let Ok(id) = EventId::from_hex(value) else {
            continue;
        };
        if id != event.id && !ids.contains(&id) {
            ids.push(id);
            if ids.len() == MAX_REPLY_REFS {
                break;
            }
        }
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use nostr::event::{EventBuilder, FinalizeEvent, Tag};
    use nostr::key::Keys;

    fn keys() -> Keys {
        Keys::parse("6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e").unwrap()
    }

    fn announcement(tags: Vec<Vec<&str>>) -> Event {
        let mut b = EventBuilder::new(Kind::Custom(30617), "");
        for t in tags {
            b = b.tag(Tag::parse(t).unwrap());
        }
        b.finalize(&keys()).unwrap()
    }

    #[test]
    fn coordinate_parsing() {
        let pk = "A".repeat(64);
        assert_eq!(
            parse_repo_coordinate(&format!("30617:{pk}:my:repo")),
            Some(format!("30617:{}:my:repo", "a".repeat(64)))
        );
        assert_eq!(
            parse_repo_coordinate(&format!("30617:{pk}:")),
            Some(format!("30617:{}:", "a".repeat(64)))
        );
        assert_eq!(parse_repo_coordinate(&format!("30618:{pk}:x")), None);
        assert_eq!(parse_repo_coordinate("30617:abc:x"), None);
        assert_eq!(
            parse_repo_coordinate(&format!("30617:{}:x", "g".repeat(64))),
            None
        );
        assert_eq!(parse_repo_coordinate(&format!("30617:{pk}")), None);
        assert_eq!(parse_repo_coordinate(""), None);
    }

    #[test]
    fn reads_every_value_of_every_relays_tag() {
        let ev = announcement(vec![
            vec!["d", "grasp"],
            vec!["relays", "wss://a.example", "wss://B.example/", "not a url"],
            vec!["relays", "wss://c.example:443", "wss://a.example"],
            vec!["relays"],
            vec!["relays", "wss://d.example,wss://e.example"],
            vec!["r", "wss://ignored.example"],
        ]);
        let a = parse_announcement(&ev).unwrap();
        assert_eq!(
            a.repo_ref,
            format!("30617:{}:grasp", keys().public_key().to_hex())
        );
        let relays: Vec<&str> = a.relays.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            relays,
            vec![
                "wss://a.example",
                "wss://b.example",
                "wss://c.example",
                "wss://d.example",
                "wss://e.example"
            ]
        );
    }

    #[test]
    fn announcement_without_d_tag_has_empty_identifier() {
        let ev = announcement(vec![vec!["relays", "wss://a.example"]]);
        let a = parse_announcement(&ev).unwrap();
        assert!(a.repo_ref.ends_with(':'));
    }

    #[test]
    fn root_events_link_by_a_tags_and_ignore_garbage() {
        let pk = keys().public_key().to_hex();
        let ev = EventBuilder::new(Kind::Custom(1621), "bug")
            .tag(Tag::parse(["a", &format!("30617:{pk}:one")]).unwrap())
            .tag(Tag::parse(["a", &format!("30617:{pk}:two"), "wss://x"]).unwrap())
            .tag(Tag::parse(["a", "30617:short:three"]).unwrap())
            .tag(Tag::parse(["a", &format!("30023:{pk}:article")]).unwrap())
            .tag(Tag::parse(["a"]).unwrap())
            .tag(Tag::parse(["A", &format!("30617:{pk}:upper")]).unwrap())
            .finalize(&keys())
            .unwrap();
        assert_eq!(
            root_event_repos(&ev),
            vec![format!("30617:{pk}:one"), format!("30617:{pk}:two")]
        );
        match classify_self_event(&ev) {
            SelfEventMeaning::RootEvent { id, repos } => {
                assert_eq!(id, ev.id);
                assert_eq!(repos.len(), 2);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_tags_and_d_values_are_bounded() {
        // Issue 36, item 14: one root event with many `a` tags counted for every repository
        // they named; a `d` of any length travelled in every REQ naming the repository.
        let pk = keys().public_key().to_hex();
        let mut b = EventBuilder::new(Kind::Custom(1621), "bug");
        for i in 0..(MAX_ROOT_REPOS + 10) {
            b = b.tag(Tag::parse(["a", &format!("30617:{pk}:r{i}")]).unwrap());
            // Repeats do not count twice.
            b = b.tag(Tag::parse(["a", &format!("30617:{pk}:r{i}")]).unwrap());
        }
        let ev = b.finalize(&keys()).unwrap();
        let repos = root_event_repos(&ev);
        assert_eq!(repos.len(), MAX_ROOT_REPOS);
        assert_eq!(repos[0], format!("30617:{pk}:r0"));
        let long = "x".repeat(MAX_D_BYTES + 1);
        assert_eq!(parse_repo_coordinate(&format!("30617:{pk}:{long}")), None);
        let ok = "x".repeat(MAX_D_BYTES);
        assert!(parse_repo_coordinate(&format!("30617:{pk}:{ok}")).is_some());
        let ann = EventBuilder::new(Kind::Custom(KIND_REPO_ANNOUNCEMENT), "")
            .tag(Tag::parse(["d", &long]).unwrap())
            .tag(Tag::parse(["relays", "wss://relay.example.com"]).unwrap())
            .finalize(&keys())
            .unwrap();
        assert_eq!(parse_announcement_with(&ann, 32, &[]), None);
    }

    #[test]
    fn other_kinds_are_other() {
        let ev = EventBuilder::new(Kind::Custom(1), "hi")
            .finalize(&keys())
            .unwrap();
        assert_eq!(classify_self_event(&ev), SelfEventMeaning::Other);
        assert!(root_event_repos(&ev).is_empty());
        assert!(parse_announcement(&ev).is_none());
    }

    #[test]
    fn events_tagging_ids_are_replies_and_deletions_are_not() {
        let parent = "ab".repeat(32);
        let quoted = "cd".repeat(32);
        let pk = keys().public_key().to_hex();
        let ev = EventBuilder::new(Kind::Custom(1), "re")
            .tag(Tag::parse(["e", &parent, "", "reply"]).unwrap())
            .tag(Tag::parse(["E", &parent]).unwrap())
            .tag(Tag::parse(["q", &quoted]).unwrap())
            .tag(Tag::parse(["q", &format!("30617:{pk}:r")]).unwrap())
            .tag(Tag::parse(["e", "not hex"]).unwrap())
            .tag(Tag::parse(["p", &pk]).unwrap())
            .finalize(&keys())
            .unwrap();
        let want = vec![
            EventId::from_hex(&parent).unwrap(),
            EventId::from_hex(&quoted).unwrap(),
        ];
        assert_eq!(tagged_ids(&ev), want);
        match classify_self_event(&ev) {
            SelfEventMeaning::Reply { id, parents, .. } => {
                assert_eq!((id, parents), (ev.id, want.clone()));
            }
            other => panic!("unexpected {other:?}"),
        }
        let deletion = EventBuilder::new(Kind::Custom(KIND_DELETION), "")
            .tag(Tag::parse(["e", &parent]).unwrap())
            .finalize(&keys())
            .unwrap();
        assert_eq!(classify_self_event(&deletion), SelfEventMeaning::Other);
        // A PR update (1619) without a repository but tagging its PR is a reply.
        let update = EventBuilder::new(Kind::Custom(KIND_PULL_REQUEST_UPDATE), "")
            .tag(Tag::parse(["E", &parent]).unwrap())
            .finalize(&keys())
            .unwrap();
        assert!(matches!(
            classify_self_event(&update),
            SelfEventMeaning::Reply { .. }
        ));
        let many = (0..20).fold(EventBuilder::new(Kind::Custom(7), "+"), |b, i| {
            b.tag(Tag::parse(["e", &format!("{i:064x}")]).unwrap())
        });
        let many = many.finalize(&keys()).unwrap();
        assert_eq!(tagged_ids(&many).len(), MAX_REPLY_REFS);
    }

    #[test]
    fn relays_per_announcement_are_capped() {
        let many: Vec<String> = (0..100).map(|i| format!("wss://r{i}.example")).collect();
        let mut tag = vec!["relays"];
        tag.extend(many.iter().map(|s| s.as_str()));
        let ev = announcement(vec![vec!["d", "x"], tag]);
        let a = parse_announcement(&ev).unwrap();
        assert_eq!(a.relays.len(), MAX_RELAYS_PER_ANNOUNCEMENT);
        assert_eq!(a.relays[0].as_str(), "wss://r0.example");
        assert_eq!(
            a.dropped_relays,
            100 - MAX_RELAYS_PER_ANNOUNCEMENT,
            "counted"
        );
    }

    #[test]
    fn own_urls_survive_the_cap_and_the_cap_is_configurable() {
        let many: Vec<String> = (0..40).map(|i| format!("wss://r{i}.example")).collect();
        let mut tag = vec!["relays"];
        tag.extend(many.iter().map(|s| s.as_str()));
        tag.push("wss://git.example");
        let ev = announcement(vec![vec!["d", "x"], tag]);
        let own = [RelayUrl::parse("wss://git.example").unwrap()];
        let a = parse_announcement_with(&ev, 3, &own).unwrap();
        let got: Vec<&str> = a.relays.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            got,
            vec![
                "wss://r0.example",
                "wss://r1.example",
                "wss://r2.example",
                "wss://git.example"
            ]
        );
        assert_eq!(
            parse_announcement_with(&ev, 0, &[]).unwrap().relays.len(),
            0
        );
        match classify_self_event_with(&ev, 3, &own) {
            SelfEventMeaning::Announcement(b) => assert_eq!(b, a),
            other => panic!("unexpected {other:?}"),
        }
    }
}
