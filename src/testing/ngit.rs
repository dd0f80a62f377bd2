//! ngit-grasp 3.0.10's write rules, for the test relay's [`Profile::NgitGrasp`]
//! (`TestRelayOptions::ngit_grasp`): GRASP-01 purgatory and the rule that an event must relate
//! to what the relay serves. Read from ngit-grasp's source (`/opt/ngit-grasp/src`); each rule
//! names the file it comes from.
//!
//! * A repository announcement (30617) must list the relay's domain in a `clone` URL
//!   (`http(s)://<domain>/…`) and a `relays` URL (`ws(s)://<domain>`), else
//!   `OK false "invalid: Announcement must list service in both 'clone' and 'relays' tags, …"`
//!   (`src/nostr/events.rs` `validate_announcement`), unless a served announcement of the same
//!   `d` lists its author as a maintainer: then it is stored at once (`AcceptMaintainer`,
//!   `src/nostr/policy/announcement.rs`). A new one is held in purgatory and answered
//!   `OK true "purgatory: won't be served until git data arrives"` (`src/nostr/builder.rs`
//!   `handle_announcement`, `src/nostr/policy/result.rs` `accepted_purgatory`); sent again
//!   while held, it is held again and its expiry starts over (`replace_purgatory_announcement`).
//!   A replacement of a served one is stored at once, unless it changes the maintainers
//!   (then it is held). Held announcements are dropped after [`NgitGraspPolicy::purgatory_timeout`]
//!   (30 min; ngit-grasp keeps the event a further 24 h for a state event to revive it, not
//!   modelled here); a later copy enters purgatory again (announcements are not checked
//!   against `expired_events`).
//! * A state event (30618) needs an announcement of its `d`, served or held
//!   (`OK false "invalid: no announcement exists for this repository"`), by its author or
//!   listing it as a maintainer (`OK false "restricted: author not authorized for this
//!   repository"`), and extends the expiry of such an announcement in purgatory
//!   (`src/nostr/policy/state.rs` `process_state_event`). Without refs its git data is there
//!   (`find_repo_with_git_data` is true for no refs): it is stored and takes the repositories
//!   it authorizes out of purgatory (`process_repos_populated_by_state_copy`). With refs it is
//!   stored when its repository is served (its git data taken as fetched) and held
//!   (`purgatory: won't be served until git data arrives`) while the repository is not.
//! * A pull request or its update (1618, 1619) needs a `c` tag (`OK false "invalid: PR event
//!   <id> has no 'c' tag"`), must relate to what is served (below, with `PR`), and is held until
//!   its git data arrives (`OK true "purgatory: PR event stored, waiting for git push with
//!   commit <c>"`; sent again meanwhile: `OK true "duplicate: in purgatory"`;
//!   `src/nostr/builder.rs` `handle_pr_event`).
//! * User grasp lists (10317) are always accepted.
//! * Any other event must relate to what the relay *serves* (not to what it holds): an
//!   `a`/`A`/`q` address `kind:pubkey:d` of a served event, an `e`/`E`/`q` id of a served
//!   event, or a served event naming it; else `OK false "restricted: Event event must reference
//!   an accepted repository or accepted event"` (`src/nostr/policy/related.rs`
//!   `check_references`, `handle_related_event`).
//! * Everything accepted from a websocket client is answered `OK true "duplicate: event
//!   stored"` (an older replaceable version: `"duplicate: superseded by a newer event"`):
//!   ngit-grasp stores the event itself and stops the relay builder there
//!   (`Nip34WritePolicy::admit_event`).
//!
//! [`TestRelay::promote`](super::TestRelay::promote) stands for "the repository's git data
//! arrived" (a push, or ngit-grasp's own fetch): the held announcement, the state events and
//! the pull requests waiting for it are served.
//!
//! Not reproduced: the relay owner's own events (accepted whatever they are), blacklists,
//! whitelists and archive mode (GRASP-05), deletions (kind 5) and vanish requests (62),
//! kinds 0 and 10002 (ngit-grasp's proactive identity policy: here the relation rule),
//! GRASP-06 pull-request relaxation, ngit-grasp's own sync and its git data checks beyond
//! "refs or none".

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nostr::event::{Event, EventId};
use nostr::key::PublicKey;

/// ngit-grasp's answer to an event it holds in purgatory (announcements, state events).
pub(crate) const PURGATORY: &str = "purgatory: won't be served until git data arrives";
/// ngit-grasp's answer to every event it stored for a websocket client.
pub(crate) const STORED: &str = "duplicate: event stored";
/// ngit-grasp's answer to an older version of a replaceable event it serves a newer one of.
pub(crate) const SUPERSEDED: &str = "duplicate: superseded by a newer event";
/// The answer to a pull request sent again while it is held.
const PR_IN_PURGATORY: &str = "duplicate: in purgatory";
/// The answer to a state event or pull request it serves already.
const ALREADY_HAVE: &str = "duplicate: already have this event";
/// A state event of a repository without announcement.
const NO_ANNOUNCEMENT: &str = "invalid: no announcement exists for this repository";
/// A state event by someone neither owner nor maintainer.
const NOT_AUTHORIZED: &str = "restricted: author not authorized for this repository";

/// ngit-grasp 3.0.10's write rules, set with `TestRelayOptions::ngit_grasp`
/// ([`Profile::NgitGrasp`](super::Profile::NgitGrasp) sets it; `docs/testing.md`, "Profiles",
/// lists them):
///
/// * a repository announcement (30617) must list the relay's domain in an `http(s)` `clone`
///   URL and a `ws(s)` `relays` URL; a new one is held in purgatory (`OK true "purgatory: won't
///   be served until git data arrives"`), not served, and dropped after `purgatory_timeout`;
/// * a state event (30618) needs an announcement of its `d` authorizing its author; without
///   refs it is stored and takes that repository out of purgatory, with refs it is held while
///   the repository is;
/// * a pull request (1618, 1619) needs a `c` tag and is held until its git data arrives;
/// * any other event must name something served, or be named by it, else `OK false
///   "restricted: Event event must reference an accepted repository or accepted event"`;
/// * what is stored is answered `OK true "duplicate: event stored"`.
///
/// [`TestRelay::promote`](super::TestRelay::promote) stands for a repository's git data
/// arriving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NgitGraspPolicy {
    /// The domain announcements must name (`host[:port]`, ngit-grasp's `NGIT_DOMAIN`); `None`:
    /// the relay's own `127.0.0.1:PORT`.
    pub domain: Option<String>,
    /// How long an announcement, state event or pull request waits in purgatory for its git
    /// data before it is dropped (ngit-grasp: 30 minutes, `DEFAULT_EXPIRY` in
    /// `src/purgatory/mod.rs`).
    pub purgatory_timeout: Duration,
}

impl Default for NgitGraspPolicy {
    fn default() -> Self {
        NgitGraspPolicy {
            domain: None,
            purgatory_timeout: Duration::from_secs(30 * 60),
        }
    }
}

/// An event waiting in purgatory.
#[derive(Debug, Clone)]
struct Held {
    event: Event,
    raw: Arc<str>,
    expires: Instant,
}

/// What ngit-grasp holds and does not serve.
#[derive(Debug, Default)]
pub(crate) struct Purgatory {
    /// Announcements by (owner, `d`).
    announcements: HashMap<(PublicKey, String), Held>,
    /// State events by id.
    states: HashMap<EventId, Held>,
    /// Pull requests and their updates by id.
    prs: HashMap<EventId, Held>,
}

/// What to do with an EVENT.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// `OK false` with this reason.
    Refuse(String),
    /// `OK true` with this reason, nothing stored (held now, or held already).
    Answer(String),
    /// Store and serve it (`OK true` [`STORED`], or [`SUPERSEDED`]), then these events it
    /// took out of purgatory.
    Store(Vec<(Event, Arc<str>)>),
}

impl Purgatory {
    /// Drops what waited longer than its timeout.
    fn expire(&mut self, now: Instant) {
        self.announcements.retain(|_, h| h.expires > now);
        self.states.retain(|_, h| h.expires > now);
        self.prs.retain(|_, h| h.expires > now);
    }

    /// The ids of every event held now.
    pub(crate) fn ids(&mut self, now: Instant) -> HashSet<EventId> {
        self.expire(now);
        self.announcements
            .values()
            .chain(self.states.values())
            .chain(self.prs.values())
            .map(|h| h.event.id)
            .collect()
    }

    /// The repository `owner`/`d`'s git data arrived: its held announcement, the held state
    /// events it authorizes and the held pull requests naming it leave purgatory (to be
    /// stored and served by the caller, in that order).
    pub(crate) fn promote(
        &mut self,
        owner: &PublicKey,
        d: &str,
        served: &[&Event],
        now: Instant,
    ) -> Vec<(Event, Arc<str>)> {
        self.expire(now);
        let mut out = Vec::new();
        let ann = self.announcements.remove(&(*owner, d.to_string()));
        let authorizing: Vec<&Event> = served
            .iter()
            .copied()
            .filter(|e| e.kind.as_u16() == 30617 && e.pubkey == *owner && d_tag(e) == Some(d))
            .chain(ann.as_ref().map(|h| &h.event))
            .collect();
        let states: Vec<EventId> = self
            .states
            .values()
            .filter(|h| {
                d_tag(&h.event) == Some(d)
                    && authorizing.iter().any(|a| authorizes(a, &h.event.pubkey))
            })
            .map(|h| h.event.id)
            .collect();
        let coordinate = format!("30617:{}:{d}", owner.to_hex());
        let prs: Vec<EventId> = self
            .prs
            .values()
            .filter(|h| tag_values(&h.event, &["a"]).any(|v| v == coordinate))
            .map(|h| h.event.id)
            .collect();
        out.extend(ann.map(|h| (h.event, h.raw)));
        for id in states {
            out.extend(self.states.remove(&id).map(|h| (h.event, h.raw)));
        }
        for id in prs {
            out.extend(self.prs.remove(&id).map(|h| (h.event, h.raw)));
        }
        out
    }
}

/// ngit-grasp's verdict on `event` (JSON `raw`) written by a websocket client, `served` being
/// every event the relay serves. Holds the event in `purgatory` when that is the verdict.
pub(crate) fn admit(
    policy: &NgitGraspPolicy,
    domain: &str,
    event: &Event,
    raw: &str,
    served: &[&Event],
    purgatory: &mut Purgatory,
    now: Instant,
) -> Verdict {
    purgatory.expire(now);
    let hold = |event: &Event| Held {
        event: event.clone(),
        raw: raw.into(),
        expires: now + policy.purgatory_timeout,
    };
    match event.kind.as_u16() {
        30617 => announcement(domain, event, served, purgatory, hold(event)),
        30618 => state(event, served, purgatory, hold(event), policy, now),
        1618 | 1619 => {
            let Some(commit) = tag_values(event, &["c"]).next().map(str::to_string) else {
                return Verdict::Refuse(format!("invalid: PR event {} has no 'c' tag", event.id));
            };
            if purgatory.prs.contains_key(&event.id) {
                return Verdict::Answer(PR_IN_PURGATORY.into());
            }
            if served.iter().any(|e| e.id == event.id) {
                return Verdict::Answer(ALREADY_HAVE.into());
            }
            if !relates_to_served(event, served) {
                return Verdict::Refuse(restricted("PR"));
            }
            purgatory.prs.insert(event.id, hold(event));
            Verdict::Answer(format!(
                "purgatory: PR event stored, waiting for git push with commit {commit}"
            ))
        }
        10317 => Verdict::Store(Vec::new()),
        _ if relates_to_served(event, served) => Verdict::Store(Vec::new()),
        _ => Verdict::Refuse(restricted("Event")),
    }
}

/// `handle_related_event`'s refusal for `what` (`Event`, `PR`).
fn restricted(what: &str) -> String {
    format!("restricted: {what} event must reference an accepted repository or accepted event")
}

fn announcement(
    domain: &str,
    event: &Event,
    served: &[&Event],
    purgatory: &mut Purgatory,
    held: Held,
) -> Verdict {
    let Some(d) = d_tag(event).map(str::to_string) else {
        return Verdict::Refuse("invalid: Missing required 'd' tag (identifier)".into());
    };
    let same_d: Vec<&Event> = served
        .iter()
        .copied()
        .filter(|e| e.kind.as_u16() == 30617 && d_tag(e) == Some(d.as_str()))
        .collect();
    if !lists_service(event, domain) {
        // A maintainer's announcement not listing the service is stored once a served one
        // lists its author (`AcceptMaintainer`).
        if same_d
            .iter()
            .any(|a| a.pubkey != event.pubkey && authorizes(a, &event.pubkey))
        {
            return Verdict::Store(Vec::new());
        }
        let clones: Vec<&str> = all_tag_values(event, "clone").collect();
        let relays: Vec<&str> = all_tag_values(event, "relays").collect();
        return Verdict::Refuse(format!(
            "invalid: Announcement must list service in both 'clone' and 'relays' tags, or match archive whitelist. Found clone URLs: {clones:?}, relays: {relays:?}"
        ));
    }
    let key = (event.pubkey, d);
    if let Some(current) = same_d.iter().find(|a| a.pubkey == event.pubkey) {
        // A replacement of a served repository is stored at once, unless it changes the
        // maintainers.
        if maintainers(current) == maintainers(event) {
            return Verdict::Store(Vec::new());
        }
    }
    match purgatory.announcements.get_mut(&key) {
        // Held already: the newer of the two stays, its 30 minutes start over.
        Some(h) => {
            let expires = held.expires;
            if (event.created_at, event.id) >= (h.event.created_at, h.event.id) {
                *h = held;
            }
            h.expires = expires;
        }
        None => {
            purgatory.announcements.insert(key, held);
        }
    }
    Verdict::Answer(PURGATORY.into())
}

fn state(
    event: &Event,
    served: &[&Event],
    purgatory: &mut Purgatory,
    held: Held,
    policy: &NgitGraspPolicy,
    now: Instant,
) -> Verdict {
    let Some(d) = d_tag(event).map(str::to_string) else {
        return Verdict::Refuse("invalid: missing 'd' tag".into());
    };
    let served_anns: Vec<&Event> = served
        .iter()
        .copied()
        .filter(|e| e.kind.as_u16() == 30617 && d_tag(e) == Some(d.as_str()))
        .collect();
    let held_owners: Vec<PublicKey> = purgatory
        .announcements
        .iter()
        .filter(|((_, hd), h)| *hd == d && authorizes(&h.event, &event.pubkey))
        .map(|((owner, _), _)| *owner)
        .collect();
    let any_held = purgatory.announcements.keys().any(|(_, hd)| *hd == d);
    if served_anns.is_empty() && !any_held {
        return Verdict::Refuse(NO_ANNOUNCEMENT.into());
    }
    let served_ok = served_anns.iter().any(|a| authorizes(a, &event.pubkey));
    if !served_ok && held_owners.is_empty() {
        return Verdict::Refuse(NOT_AUTHORIZED.into());
    }
    // Its arrival gives the repositories it authorizes another 30 minutes in purgatory.
    for owner in &held_owners {
        if let Some(h) = purgatory.announcements.get_mut(&(*owner, d.clone())) {
            h.expires = now + policy.purgatory_timeout;
        }
    }
    let stored = served.iter().any(|e| e.id == event.id);
    if stored && held_owners.is_empty() {
        return Verdict::Answer(ALREADY_HAVE.into());
    }
    let has_refs = event.tags.iter().any(|t| {
        let t = t.as_slice();
        t.len() > 1 && t[0].starts_with("refs/")
    });
    if !has_refs {
        // Nothing to fetch: its git data is there, and the repositories it authorizes are
        // populated (out of purgatory).
        let mut promoted = Vec::new();
        for owner in held_owners {
            promoted.extend(purgatory.promote(&owner, &d, served, now));
        }
        return Verdict::Store(promoted);
    }
    if served_ok {
        return Verdict::Store(Vec::new());
    }
    purgatory.states.insert(event.id, held);
    Verdict::Answer(PURGATORY.into())
}

/// Whether `event` relates to what is served (`RelatedEventPolicy::check_references`): it
/// names a served address (`a`/`A`/`q` `kind:pubkey:d`, the `d` cut at its first `:` as
/// ngit-grasp splits it) or a served id (`e`/`E`/`q`), or a served event names it.
fn relates_to_served(event: &Event, served: &[&Event]) -> bool {
    let addresses: Vec<(u16, PublicKey, &str)> = tag_values(event, &["a", "A", "q"])
        .filter(|v| v.contains(':'))
        .filter_map(|v| {
            let parts: Vec<&str> = v.split(':').collect();
            if parts.len() < 3 {
                return None;
            }
            Some((
                parts[0].parse().ok()?,
                PublicKey::from_hex(parts[1]).ok()?,
                parts[2],
            ))
        })
        .collect();
    let ids: HashSet<EventId> = tag_values(event, &["e", "E", "q"])
        .filter(|v| !v.contains(':'))
        .filter_map(|v| EventId::from_hex(v).ok())
        .collect();
    let kind = event.kind.as_u16();
    let own_name = if (30_000..40_000).contains(&kind) {
        Some(format!(
            "{kind}:{}:{}",
            event.pubkey.to_hex(),
            d_tag(event).unwrap_or("")
        ))
    } else if (10_000..20_000).contains(&kind) {
        Some(format!("{kind}:{}", event.pubkey.to_hex()))
    } else {
        None
    };
    let id_hex = event.id.to_hex();
    served.iter().any(|s| {
        ids.contains(&s.id)
            || addresses
                .iter()
                .any(|(k, pk, d)| s.kind.as_u16() == *k && s.pubkey == *pk && d_tag(s) == Some(*d))
            || match &own_name {
                Some(name) => tag_values(s, &["a", "A", "q"]).any(|v| v == name),
                None => tag_values(s, &["e", "E", "q"]).any(|v| v == id_hex),
            }
    })
}

/// Whether the announcement `ann` lets `who` act for its repository: its author, or listed in
/// its `maintainers` tag.
fn authorizes(ann: &Event, who: &PublicKey) -> bool {
    ann.pubkey == *who || maintainers(ann).contains(&who.to_hex())
}

/// The `maintainers` tag's values (lower-case hex).
fn maintainers(ann: &Event) -> HashSet<String> {
    all_tag_values(ann, "maintainers")
        .map(str::to_ascii_lowercase)
        .collect()
}

/// Whether the announcement lists `domain` in an `http(s)` `clone` URL and a `ws(s)` `relays`
/// URL (host and port compared exactly).
fn lists_service(ann: &Event, domain: &str) -> bool {
    let names = |value: &str, schemes: [&str; 2]| {
        schemes.iter().any(|s| {
            value
                .strip_prefix(s)
                .and_then(|rest| rest.strip_prefix("://"))
                .map(|rest| rest.split(['/', '?', '#']).next().unwrap_or(""))
                .is_some_and(|authority| authority.eq_ignore_ascii_case(domain))
        })
    };
    all_tag_values(ann, "clone").any(|v| names(v, ["http", "https"]))
        && all_tag_values(ann, "relays").any(|v| names(v, ["ws", "wss"]))
}

/// The first `d` tag's value.
fn d_tag(event: &Event) -> Option<&str> {
    event
        .tags
        .iter()
        .find(|t| t.kind() == "d")
        .and_then(|t| t.content())
}

/// The first value of each tag named one of `names` (what a relay indexes and ngit-grasp
/// reads as a reference).
fn tag_values<'a>(event: &'a Event, names: &'a [&str]) -> impl Iterator<Item = &'a str> + 'a {
    event
        .tags
        .iter()
        .map(|t| t.as_slice())
        .filter(move |t| t.len() > 1 && names.contains(&t[0].as_str()))
        .map(|t| t[1].as_str())
}

/// Every value (after the name) of the tags named `name` (`clone`, `relays`: one tag may
/// list several URLs).
fn all_tag_values<'a>(event: &'a Event, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    event
        .tags
        .iter()
        .map(|t| t.as_slice())
        .filter(move |t| t.len() > 1 && t[0] == name)
        .flat_map(|t| t[1..].iter().map(String::as_str))
}
