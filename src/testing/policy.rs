//! Write policies of the test relay that real relays apply to EVENTs: a per-connection write
//! rate limit ([`WriteRate`], a token bucket) and ngit-relay's rule that an event must relate
//! to what is stored ([`GraspPolicy`]).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use nostr::event::{Event, EventId};
use nostr::key::PublicKey;

/// The `OK false` reason for an event that relates to nothing stored (ngit-relay's text with
/// the `blocked:` prefix khatru adds).
pub(crate) const NOT_RELATED: &str = "blocked: event does not relate to a stored repository";

/// The `OK false` reason for a repository announcement (kind 30617) that does not list the
/// relay's domain in both a `clone` and a `relays` tag (ngit-relay's text, prefixed by khatru).
pub(crate) const ANNOUNCEMENT_NOT_LISTING: &str =
    "blocked: repository announcement doesn't list ngit-relay in tags: clones and relays";

/// A per-connection write rate limit: a token bucket holding at most `burst` tokens, starting
/// full and earning one token every `per` (how, [`Refill`] says). Each EVENT that gets this
/// far takes a token (also one that is then refused for another reason or is a duplicate, as
/// on khatru and rust-nostr's relay builder); with no token left it is answered
/// `["OK", id, false, message]`.
///
/// A `per` of zero never refills: exactly `burst` events are accepted per connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteRate {
    /// Tokens the bucket holds at most (and starts with).
    pub burst: u32,
    /// The time it takes to earn one token.
    pub per: Duration,
    /// The `OK false` reason once the bucket is empty.
    pub message: String,
    /// How the bucket earns its tokens back.
    pub refill: Refill,
}

/// How a [`WriteRate`]'s bucket earns tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Refill {
    /// One token per `per`, whenever the EVENTs come; the part of a `per` not yet earned is
    /// kept (khatru's limiter).
    #[default]
    Steady,
    /// Each EVENT earns the whole `per`s since the connection's previous EVENT, refused ones
    /// included, and the rest of that time is lost: an EVENT sent less than one `per` after
    /// the previous one earns nothing and starts the count again. rust-nostr's relay builder
    /// (nostr-sdk 0.45.4 `local_relay/local/session.rs` `take_token`: the whole seconds since
    /// `last`, `last` set at every EVENT), the limiter of ngit-grasp.
    SinceLastAttempt,
}

impl WriteRate {
    /// `burst` events at once, then one every `per`, refused with
    /// `"rate-limited: slow down"` (rust-nostr's relay builder's text).
    pub fn new(burst: u32, per: Duration) -> WriteRate {
        WriteRate {
            burst,
            per,
            message: "rate-limited: slow down".to_string(),
            refill: Refill::Steady,
        }
    }

    /// The same limit earning its tokens as `refill` says.
    pub fn with_refill(mut self, refill: Refill) -> WriteRate {
        self.refill = refill;
        self
    }

    /// The same limit refused with `message`.
    pub fn with_message(mut self, message: &str) -> WriteRate {
        self.message = message.to_string();
        self
    }
}

/// One connection's token bucket for a [`WriteRate`].
#[derive(Debug)]
pub(crate) struct Bucket {
    rate: WriteRate,
    tokens: u32,
    /// When the tokens were last counted (the start of the current, unfinished `per`; under
    /// [`Refill::SinceLastAttempt`] the previous EVENT).
    last: Instant,
    /// An EVENT came already ([`Refill::SinceLastAttempt`]).
    attempted: bool,
}

impl Bucket {
    pub(crate) fn new(rate: &WriteRate, now: Instant) -> Bucket {
        Bucket {
            rate: rate.clone(),
            tokens: rate.burst,
            last: now,
            attempted: false,
        }
    }

    /// Whether this bucket was made for `rate` (a changed rate starts a new bucket).
    pub(crate) fn is_for(&self, rate: &WriteRate) -> bool {
        self.rate == *rate
    }

    /// Takes a token if there is one.
    pub(crate) fn take(&mut self, now: Instant) -> bool {
        if self.rate.refill == Refill::SinceLastAttempt {
            return self.take_since_last_attempt(now);
        }
        let per = self.rate.per.as_nanos();
        if per > 0 && self.tokens < self.rate.burst {
            let earned = now.saturating_duration_since(self.last).as_nanos() / per;
            let missing = u128::from(self.rate.burst - self.tokens);
            if earned >= missing {
                self.tokens = self.rate.burst;
                self.last = now;
            } else if earned > 0 {
                // earned < missing <= u32::MAX
                let earned = earned as u32;
                self.tokens += earned;
                self.last += self.rate.per * earned;
            }
        }
        if self.tokens == self.rate.burst {
            // A full bucket earns nothing: its next token is due one `per` after it is spent.
            self.last = now;
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }

    /// [`Refill::SinceLastAttempt`]: whole `per`s since the previous EVENT (the first EVENT of
    /// a connection earns nothing), at most `burst`.
    fn take_since_last_attempt(&mut self, now: Instant) -> bool {
        let per = self.rate.per.as_nanos();
        if per > 0 && self.attempted {
            let earned = now.saturating_duration_since(self.last).as_nanos() / per;
            let earned = u32::try_from(earned).unwrap_or(u32::MAX);
            self.tokens = self.tokens.saturating_add(earned).min(self.rate.burst);
        }
        self.last = now;
        self.attempted = true;
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

/// ngit-relay's acceptance rule (the own relay of a GRASP server, built on khatru): kind 30618
/// is always accepted; kind 30617 only when a `clone` tag and a `relays` tag both have a value
/// containing `://<domain>`; any other event only when it refers (`e`, `E`, `a`, `A` or `q`) to
/// a stored event or address, or a stored event refers to it. Refusals are
/// `OK false "blocked: event does not relate to a stored repository"` and, for an
/// announcement, `OK false "blocked: repository announcement doesn't list ngit-relay in tags:
/// clones and relays"`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraspPolicy {
    /// The domain announcements must name (`host[:port]`); `None`: the relay's own
    /// `127.0.0.1:PORT`.
    pub domain: Option<String>,
}

/// An address pointer `kind:pubkey[:d]` as ngit-relay turns it into a filter.
#[derive(Debug)]
struct Pointer {
    kinds: Vec<u16>,
    author: Option<PublicKey>,
    d: Option<String>,
}

impl Pointer {
    /// `kind:pubkey:d` or `kind:pubkey`; other shapes are skipped, as ngit-relay skips them.
    /// A kind that does not parse is 0, as Go's `strconv.Atoi` leaves it.
    fn parse(pointer: &str) -> Option<Pointer> {
        let parts: Vec<&str> = pointer.split(':').collect();
        if parts.len() != 2 && parts.len() != 3 {
            return None;
        }
        let kind = parts[0].parse::<u16>().unwrap_or(0);
        // A state pointer also matches the announcement of the same address.
        let kinds = if kind == 30618 {
            vec![30618, 30617]
        } else {
            vec![kind]
        };
        Some(Pointer {
            kinds,
            author: PublicKey::from_hex(parts[1]).ok(),
            d: parts.get(2).map(|d| d.to_string()),
        })
    }

    fn matches(&self, stored: &Event) -> bool {
        self.author == Some(stored.pubkey)
            && self.kinds.contains(&stored.kind.as_u16())
            && self.d.as_ref().is_none_or(|d| {
                stored.tags.iter().any(|t| {
                    let t = t.as_slice();
                    t.len() > 1 && t[0] == "d" && t[1] == *d
                })
            })
    }
}

/// What an incoming event refers to, and how it can be referred to.
#[derive(Debug, Default)]
struct References {
    /// Ids it refers to, and its own id (regular events).
    ids: HashSet<String>,
    /// Address pointers it refers to, and its own address (addressable events).
    pointers: HashSet<String>,
}

impl References {
    fn of(event: &Event) -> References {
        let mut refs = References::default();
        for tag in event.tags.iter() {
            let tag = tag.as_slice();
            if tag.len() < 2 {
                continue;
            }
            let (key, value) = (tag[0].as_str(), tag[1].clone());
            match key {
                "a" | "A" => {
                    refs.pointers.insert(value);
                }
                "q" if value.contains(':') => {
                    refs.pointers.insert(value);
                }
                "e" | "E" | "q" => {
                    refs.ids.insert(value);
                }
                _ => {}
            }
        }
        let kind = event.kind.as_u16();
        if (30_000..40_000).contains(&kind) {
            let mut own = format!("{kind}:{}", event.pubkey.to_hex());
            let d = event.tags.iter().find_map(|t| {
                let t = t.as_slice();
                (t.len() > 1 && t[0] == "d").then(|| t[1].clone())
            });
            if let Some(d) = d {
                own.push(':');
                own.push_str(&d);
            }
            refs.pointers.insert(own);
        } else {
            refs.ids.insert(event.id.to_hex());
        }
        refs
    }
}

/// Why ngit-relay's rule refuses `event` (the `OK false` reason), or `None` when it accepts it.
/// `stored` is every stored event.
pub(crate) fn grasp_refusal<'a>(
    event: &Event,
    domain: &str,
    mut stored: impl Iterator<Item = &'a Event>,
) -> Option<&'static str> {
    match event.kind.as_u16() {
        30618 => return None,
        30617 => {
            let needle = format!("://{domain}");
            let listed = |name: &str| {
                event.tags.iter().any(|t| {
                    let t = t.as_slice();
                    t.len() > 1 && t[0] == name && t[1..].iter().any(|v| v.contains(&needle))
                })
            };
            return if listed("clone") && listed("relays") {
                None
            } else {
                Some(ANNOUNCEMENT_NOT_LISTING)
            };
        }
        _ => {}
    }
    let refs = References::of(event);
    let ids: HashSet<EventId> = refs
        .ids
        .iter()
        .filter_map(|id| EventId::from_hex(id).ok())
        .collect();
    let pointers: Vec<Pointer> = refs
        .pointers
        .iter()
        .filter_map(|p| Pointer::parse(p))
        .collect();
    let related = stored.any(|s| {
        ids.contains(&s.id)
            || pointers.iter().any(|p| p.matches(s))
            || s.tags.iter().any(|t| {
                let t = t.as_slice();
                if t.len() < 2 {
                    return false;
                }
                let value = &t[1];
                match t[0].as_str() {
                    "e" | "E" => refs.ids.contains(value),
                    "a" | "A" => refs.pointers.contains(value),
                    "q" => refs.ids.contains(value) || refs.pointers.contains(value),
                    _ => false,
                }
            })
    });
    if related {
        None
    } else {
        Some(NOT_RELATED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_gives_its_burst_then_one_token_per_interval() {
        let t0 = Instant::now();
        let per = Duration::from_secs(10);
        let mut b = Bucket::new(&WriteRate::new(2, per), t0);
        assert!(b.take(t0));
        assert!(b.take(t0));
        assert!(!b.take(t0));
        assert!(!b.take(t0 + Duration::from_secs(9)));
        assert!(b.take(t0 + Duration::from_secs(10)));
        assert!(!b.take(t0 + Duration::from_secs(11)));
        // 35 s later: two tokens earned (the bucket holds 2), the remainder is lost.
        assert!(b.take(t0 + Duration::from_secs(45)));
        assert!(b.take(t0 + Duration::from_secs(45)));
        assert!(!b.take(t0 + Duration::from_secs(45)));
    }

    #[test]
    fn a_rust_nostr_bucket_earns_only_whole_intervals_since_the_previous_event() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let rate = WriteRate::new(2, s).with_refill(Refill::SinceLastAttempt);
        let mut b = Bucket::new(&rate, t0);
        assert!(b.take(t0));
        assert!(b.take(t0 + s / 2));
        // Refused at 0.9 s after the previous EVENT: nothing earned, and the count restarts.
        assert!(!b.take(t0 + s / 2 + s * 9 / 10));
        assert!(
            !b.take(t0 + s * 2),
            "0.6 s after the refusal: still nothing"
        );
        assert!(
            b.take(t0 + s * 3 + s / 2),
            "1.5 s after: one token, half a second lost"
        );
        assert!(!b.take(t0 + s * 4 + s / 5));
        // A long pause earns at most the burst.
        assert!(b.take(t0 + s * 100));
        assert!(b.take(t0 + s * 100));
        assert!(!b.take(t0 + s * 100));
    }

    #[test]
    fn a_bucket_without_interval_never_refills() {
        let t0 = Instant::now();
        let mut b = Bucket::new(&WriteRate::new(1, Duration::ZERO), t0);
        assert!(b.take(t0));
        assert!(!b.take(t0 + Duration::from_secs(3600)));
    }

    #[test]
    fn pointers_parse_as_ngit_relay_filters() {
        let pk = "0000000000000000000000000000000000000000000000000000000000000001";
        let p = Pointer::parse(&format!("30618:{pk}:repo")).unwrap();
        assert_eq!(p.kinds, vec![30618, 30617]);
        assert_eq!(p.d.as_deref(), Some("repo"));
        let p = Pointer::parse(&format!("x:{pk}")).unwrap();
        assert_eq!(p.kinds, vec![0]);
        assert!(p.d.is_none());
        assert!(Pointer::parse("1").is_none());
        assert!(Pointer::parse(&format!("30617:{pk}:a:b")).is_none());
    }
}
