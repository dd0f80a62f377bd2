//! What a relay means by `CLOSED` and `NOTICE`.
//!
//! NIP-01 gives `CLOSED` messages a machine-readable prefix (`rate-limited:`,
//! `auth-required:`, `restricted:`, …). Rate limits and "too many subscriptions" also arrive as
//! free-text NOTICEs (strfry: `ERROR: too many concurrent REQs`; nostr-rs-relay:
//! `Subscription error: Maximum concurrent subscription count reached`), so NOTICE texts are
//! matched case-insensitively for "rate" + "limit", "too many", "slow down", "throttl" and
//! "maximum concurrent".

use std::time::Duration;

/// Why a relay closed a subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClosedReason {
    /// `rate-limited:`: wait for the cool-down, then subscribe again.
    RateLimited,
    /// `auth-required:`: NIP-42 authentication needed.
    AuthRequired,
    /// `restricted:`, `blocked:`, `invalid:`, `unsupported:`, `error:` or anything else: the
    /// relay refuses this query.
    Refused,
}

/// Classifies a `CLOSED` message by its NIP-01 prefix.
pub fn classify_closed(message: &str) -> ClosedReason {
    let m = message.trim_start();
    if m.starts_with("rate-limited:") {
        ClosedReason::RateLimited
    } else if m.starts_with("auth-required:") {
        ClosedReason::AuthRequired
    } else {
        ClosedReason::Refused
    }
}

/// The prefix of a `CLOSED` message (`restricted`, `blocked`, …), or `other`.
pub fn closed_prefix(message: &str) -> &str {
    let m = message.trim_start();
    match m.split_once(':') {
        Some((p, _)) if !p.is_empty() && p.len() <= 20 && !p.contains(' ') => p,
        _ => "other",
    }
}

/// What a NOTICE means for us.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NoticeKind {
    /// The relay asks us to slow down (rate limit, too many requests or subscriptions).
    RateLimit,
    /// Anything else: counted and logged.
    Other,
}

/// Classifies a NOTICE text.
pub fn classify_notice(text: &str) -> NoticeKind {
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
pub const RATE_LIMIT_COOLDOWN: Duration = Duration::from_secs(65);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_prefixes() {
        assert_eq!(
            classify_closed("rate-limited: slow"),
            ClosedReason::RateLimited
        );
        assert_eq!(
            classify_closed("auth-required: who"),
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
            assert_eq!(classify_closed(m), ClosedReason::Refused, "{m}");
        }
        assert_eq!(closed_prefix("restricted: members only"), "restricted");
        assert_eq!(closed_prefix("no prefix here"), "other");
        assert_eq!(closed_prefix(""), "other");
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
