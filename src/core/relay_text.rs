//! What a relay means by the text of `OK`, `CLOSED` and `NOTICE` messages.
//!
//! NIP-01 gives the text of `OK` and `CLOSED` a machine-readable prefix: a single word, a
//! `:`, then a human-readable message (`"rate-limited: slow down"`). NIP-01 lists
//! `duplicate`, `pow`, `blocked`, `rate-limited`, `invalid`, `restricted`, `mute` and
//! `error`; NIP-42 adds `auth-required`, NIP-01's own `CLOSED` example uses
//! `unsupported`, and GRASP-01 adds `purgatory` (an `OK true` for an event accepted but not
//! served until its git data arrives: ngit-grasp). [`Prefix::parse`] is the one place the crate reads them; every consumer
//! (the sync machine's `CLOSED` handling, NIP-42 authentication, the forward queue, the
//! rejection metrics) matches on the [`Prefix`] it returns.
//!
//! **The parsing rule**, the same everywhere:
//!
//! * leading whitespace (Unicode) is skipped;
//! * the prefix is the text up to the first `:`, taken as it stands: no whitespace is
//!   trimmed between the word and the colon (`"error :"` has no prefix) and a word with a
//!   space in it is no prefix (`"rate limited: x"`);
//! * the word is compared with the known prefixes ASCII-case-insensitively (`"ERROR: x"`
//!   is [`Prefix::Error`]): the prefix is meant for machines, and a relay that capitalises
//!   it still says what it says;
//! * anything else (no colon, an empty or unknown word, non-ASCII) is [`Prefix::Other`];
//! * the rest is the text after the colon with its leading whitespace skipped; for
//!   [`Prefix::Other`] it is the whole message (leading whitespace skipped), so nothing of
//!   an unknown prefix is lost.
//!
//! Only the first [`MAX_PREFIX_LEN`] + 1 bytes are looked at, so a long message costs no
//! more than a short one.
//!
//! Rate limits and "too many subscriptions" also arrive as free-text NOTICEs (strfry:
//! `ERROR: too many concurrent REQs`; nostr-rs-relay: `Subscription error: Maximum
//! concurrent subscription count reached`). NOTICE has no machine-readable prefix, so
//! [`classify_notice`] stays a heuristic: texts are matched case-insensitively for "rate" +
//! "limit", "too many", "slow down", "throttl" and "maximum concurrent".

use std::fmt;
use std::time::Duration;

/// The machine-readable prefix of an `OK` or `CLOSED` message: leading whitespace skipped,
/// the word up to the first `:` as it stands (no space in it or before the colon), compared
/// with the known prefixes ASCII-case-insensitively; anything else is [`Prefix::Other`]
/// ([`Prefix::parse`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Prefix {
    /// `duplicate:`: the relay already has the event (or the subscription id is in use).
    Duplicate,
    /// `pow:`: proof of work (NIP-13) too low.
    Pow,
    /// `blocked:`: the author or the client is blocked, banned or not on a list.
    Blocked,
    /// `rate-limited:`: slow down.
    RateLimited,
    /// `invalid:`: the event or request does not meet the relay's rules.
    Invalid,
    /// `restricted:`: the client is not allowed to do this (NIP-42: even authenticated).
    Restricted,
    /// `mute:`: an ephemeral event nobody listened to.
    Mute,
    /// `error:`: a failure on the relay's side, or none of the others fits.
    Error,
    /// `auth-required:` (NIP-42): authenticate first.
    AuthRequired,
    /// `unsupported:`: the relay does not support what was asked (a filter element, …).
    Unsupported,
    /// `purgatory:` (GRASP-01, with `OK true`): accepted, but not served until the event's
    /// git data arrives, and dropped if it never does (ngit-grasp: `"purgatory: won't be
    /// served until git data arrives"`, after 30 minutes).
    Purgatory,
    /// No prefix, or one not listed here.
    Other,
}

/// Bytes of the longest known prefix word (`auth-required`).
pub(crate) const MAX_PREFIX_LEN: usize = 13;

impl Prefix {
    /// Every prefix, [`Prefix::Other`] last.
    pub const ALL: [Prefix; 12] = [
        Prefix::Duplicate,
        Prefix::Pow,
        Prefix::Blocked,
        Prefix::RateLimited,
        Prefix::Invalid,
        Prefix::Restricted,
        Prefix::Mute,
        Prefix::Error,
        Prefix::AuthRequired,
        Prefix::Unsupported,
        Prefix::Purgatory,
        Prefix::Other,
    ];

    /// Splits `message` into its prefix and the rest (after the colon, leading whitespace
    /// skipped): leading whitespace skipped, the word up to the first `:` as it stands
    /// (no space in it or before the colon), compared with the known prefixes ASCII-case-
    /// insensitively; anything else is [`Prefix::Other`].
    pub fn parse(message: &str) -> (Prefix, &str) {
        let m = message.trim_start();
        let head = &m.as_bytes()[..m.len().min(MAX_PREFIX_LEN + 1)];
        let Some(colon) = head.iter().position(|b| *b == b':') else {
            return (Prefix::Other, m);
        };
        // The colon is ASCII, so `colon` and `colon + 1` are character boundaries.
        let word = &m[..colon];
        match Prefix::ALL
            .into_iter()
            .find(|p| p.word().is_some_and(|w| w.eq_ignore_ascii_case(word)))
        {
            Some(p) => (p, m[colon + 1..].trim_start()),
            None => (Prefix::Other, m),
        }
    }

    /// The prefix of `message` alone ([`Prefix::parse`] without the rest).
    pub fn of(message: &str) -> Prefix {
        Prefix::parse(message).0
    }

    /// The word as NIP-01 spells it, without the colon (`rate-limited`); `None` for
    /// [`Prefix::Other`].
    pub fn word(self) -> Option<&'static str> {
        Some(match self {
            Prefix::Duplicate => "duplicate",
            Prefix::Pow => "pow",
            Prefix::Blocked => "blocked",
            Prefix::RateLimited => "rate-limited",
            Prefix::Invalid => "invalid",
            Prefix::Restricted => "restricted",
            Prefix::Mute => "mute",
            Prefix::Error => "error",
            Prefix::AuthRequired => "auth-required",
            Prefix::Unsupported => "unsupported",
            Prefix::Purgatory => "purgatory",
            Prefix::Other => return None,
        })
    }

    /// A stable lowercase label for metrics and warn-once keys: the word as NIP-01 spells
    /// it (`rate-limited`, `auth-required`), `other` for [`Prefix::Other`]. The values are
    /// label values of `events_rejected_total{reason=…}`: never change them.
    pub fn label(self) -> &'static str {
        self.word().unwrap_or("other")
    }
}

impl fmt::Display for Prefix {
    /// The [`Prefix::label`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// What a `CLOSED` means for the sync logic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub(crate) enum ClosedReason {
    /// `rate-limited:`: wait for the cool-down, then subscribe again.
    RateLimited,
    /// `auth-required:`: NIP-42 authentication needed.
    AuthRequired,
    /// `restricted:`, `blocked:`, `invalid:`, `unsupported:`, `error:` or anything else: the
    /// relay refuses this query.
    Refused,
}

impl From<Prefix> for ClosedReason {
    fn from(p: Prefix) -> ClosedReason {
        match p {
            Prefix::RateLimited => ClosedReason::RateLimited,
            Prefix::AuthRequired => ClosedReason::AuthRequired,
            _ => ClosedReason::Refused,
        }
    }
}

/// What a NOTICE means for us.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub(crate) enum NoticeKind {
    /// The relay asks us to slow down (rate limit, too many requests or subscriptions).
    RateLimit,
    /// Anything else: counted and logged.
    Other,
}

/// Classifies a NOTICE text (a heuristic: NOTICE has no machine-readable prefix).
pub(crate) fn classify_notice(text: &str) -> NoticeKind {
    let t = text.to_ascii_lowercase();
    if (t.contains("rate") && t.contains("limit"))
        || t.contains("too many")
        || t.contains("slow down")
        || t.contains("throttl")
        || t.contains("maximum concurrent")
    {
        NoticeKind::RateLimit
    } else {
        NoticeKind::Other
    }
}

/// The cool-down after a rate limit (default 65 s: longer than the one-minute windows relays
/// count in).
pub(crate) const RATE_LIMIT_COOLDOWN: Duration = Duration::from_secs(65);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn each_prefix_parses() {
        for p in Prefix::ALL {
            let Some(word) = p.word() else {
                assert_eq!(p, Prefix::Other);
                continue;
            };
            assert!(word.len() <= MAX_PREFIX_LEN, "{word}");
            assert_eq!(Prefix::parse(&format!("{word}: why")), (p, "why"));
            assert_eq!(Prefix::parse(&format!("{word}:why")), (p, "why"));
            assert_eq!(Prefix::parse(&format!("{word}:")), (p, ""));
            assert_eq!(p.label(), word);
            assert_eq!(p.to_string(), word);
        }
        assert_eq!(Prefix::Other.label(), "other");
        assert_eq!(
            Prefix::parse("rate-limited: slow: down"),
            (Prefix::RateLimited, "slow: down"),
            "only the first colon"
        );
    }

    #[test]
    fn labels_are_distinct_lowercase() {
        let mut seen = std::collections::HashSet::new();
        for p in Prefix::ALL {
            let l = p.label();
            assert!(seen.insert(l), "{l}");
            assert!(
                l.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'),
                "{l}"
            );
        }
    }

    #[test]
    fn unknown_and_missing_prefixes_are_other_with_the_whole_text() {
        for m in [
            "payment-required: pay",
            "whatever",
            "no prefix here",
            "rate limited: a word with a space",
            "error : space before the colon",
            ":empty word",
            "auth-required-please: longer than any prefix",
            "a very long message without any colon in its first bytes: x",
        ] {
            assert_eq!(Prefix::parse(m), (Prefix::Other, m), "{m:?}");
        }
        assert_eq!(Prefix::parse(""), (Prefix::Other, ""));
        assert_eq!(Prefix::parse("   "), (Prefix::Other, ""));
    }

    #[test]
    fn leading_whitespace_and_case() {
        assert_eq!(
            Prefix::parse("  auth-required: who"),
            (Prefix::AuthRequired, "who")
        );
        assert_eq!(
            Prefix::parse("\t\n duplicate:   have it "),
            (Prefix::Duplicate, "have it ")
        );
        assert_eq!(Prefix::parse("\u{3000}error: x"), (Prefix::Error, "x"));
        assert_eq!(Prefix::parse("ERROR: x"), (Prefix::Error, "x"));
        assert_eq!(
            Prefix::parse("purgatory: won't be served until git data arrives"),
            (Prefix::Purgatory, "won't be served until git data arrives")
        );
        assert_eq!(Prefix::parse("Rate-Limited: x"), (Prefix::RateLimited, "x"));
        assert_eq!(
            Prefix::parse(" unknown: kept"),
            (Prefix::Other, "unknown: kept")
        );
    }

    #[test]
    fn non_ascii() {
        assert_eq!(Prefix::parse("blocké: x"), (Prefix::Other, "blocké: x"));
        assert_eq!(Prefix::parse("éé:"), (Prefix::Other, "éé:"));
        assert_eq!(
            Prefix::parse("invalid: ünïcödé"),
            (Prefix::Invalid, "ünïcödé")
        );
        // A multi-byte character across the inspected head is no problem.
        assert_eq!(Prefix::parse("ééééééé:"), (Prefix::Other, "ééééééé:"));
        // The Kelvin sign is no `k` (ASCII-only case folding).
        assert_eq!(Prefix::of("bloc\u{212a}ed: x"), Prefix::Other);
    }

    #[test]
    fn closed_reasons() {
        assert_eq!(
            ClosedReason::from(Prefix::of("rate-limited: slow")),
            ClosedReason::RateLimited
        );
        assert_eq!(
            ClosedReason::from(Prefix::of(" auth-required: who")),
            ClosedReason::AuthRequired
        );
        for m in [
            "restricted: no",
            "blocked: x",
            "invalid: y",
            "unsupported: multi",
            "error: e",
            "",
            "whatever",
        ] {
            assert_eq!(
                ClosedReason::from(Prefix::of(m)),
                ClosedReason::Refused,
                "{m}"
            );
        }
    }

    proptest! {
        /// Never panics; the rest is a suffix of the message; a known prefix is followed by
        /// a colon in the message; `Other` keeps the whole (left-trimmed) text.
        #[test]
        fn parse_is_total_and_consistent(m in ".{0,40}") {
            let (p, rest) = Prefix::parse(&m);
            prop_assert!(m.ends_with(rest));
            match p.word() {
                None => prop_assert_eq!(rest, m.trim_start()),
                Some(w) => {
                    let t = m.trim_start();
                    prop_assert!(t.len() > w.len());
                    prop_assert!(t[..w.len()].eq_ignore_ascii_case(w));
                    prop_assert_eq!(t.as_bytes()[w.len()], b':');
                }
            }
        }

        /// Any known word, in any ASCII case, after any leading whitespace, parses.
        #[test]
        fn known_words_in_any_case(
            i in 0usize..11,
            upper in proptest::collection::vec(any::<bool>(), 13),
            ws in "[ \t\r\n]{0,3}",
            text in "[^\u{0}]{0,20}",
        ) {
            let p = Prefix::ALL[i];
            let word: String = p
                .word()
                .unwrap()
                .chars()
                .zip(&upper)
                .map(|(c, u)| if *u { c.to_ascii_uppercase() } else { c })
                .collect();
            let message = format!("{ws}{word}:{text}");
            let (got, rest) = Prefix::parse(&message);
            prop_assert_eq!(got, p);
            prop_assert_eq!(rest, text.trim_start());
        }
    }

    #[test]
    fn notice_texts() {
        for t in [
            "ERROR: too many concurrent REQs",
            "Subscription error: Maximum concurrent subscription count reached",
            "rate limit exceeded",
            "You are being RATE-LIMITED",
            "please slow down",
            "throttled",
        ] {
            assert_eq!(classify_notice(t), NoticeKind::RateLimit, "{t}");
        }
        assert_eq!(
            classify_notice("could not parse command"),
            NoticeKind::Other
        );
        assert_eq!(classify_notice("hello"), NoticeKind::Other);
    }
}
