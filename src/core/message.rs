//! Reading relay frames and checking events, without trusting the sender.
//!
//! [`parse_relay_frame`] keeps an EVENT's JSON as the raw text the relay sent, so the
//! forwarder can publish the original bytes. [`check_event`] verifies id and signature and that
//! the event matches the subscription it arrived on.

use nostr::event::{Event, EventId};
use nostr::filter::{Filter, MatchEventOptions};
use serde_json::value::RawValue;

use crate::core::dedup::{EventSummary, Known, RawDigest, TagPrint, VerifiedSet, PRINTED_TAGS};
use crate::core::relay_text::Prefix;

/// One message from a relay.
#[derive(Debug)]
#[non_exhaustive]
pub enum Incoming<'a> {
    /// `["EVENT", sub_id, {...}]`; `raw` is the event's JSON exactly as received.
    Event {
        /// Subscription id.
        sub_id: String,
        /// The event object's raw JSON.
        raw: &'a RawValue,
    },
    /// `["EOSE", sub_id]`.
    Eose(String),
    /// `["CLOSED", sub_id, message]`.
    Closed {
        /// Subscription id.
        sub_id: String,
        /// The machine-readable prefix of `message` ([`Prefix::parse`], read here once):
        /// every consumer matches on it, none parses the text again.
        prefix: Prefix,
        /// The relay's reason as sent (may start with a NIP-01 prefix such as
        /// `rate-limited:`).
        message: String,
    },
    /// `["NOTICE", message]`.
    Notice(String),
    /// `["OK", event_id, accepted, message]`.
    Ok {
        /// The event the answer is about.
        event_id: EventId,
        /// Whether the relay stored it (or already had it).
        accepted: bool,
        /// The relay's reason.
        message: String,
    },
    /// `["AUTH", challenge]` (NIP-42).
    Auth(String),
    /// `["NEG-MSG", sub_id, hex]` (NIP-77); the hex is checked by the sync machine.
    NegMsg {
        /// Negentropy subscription id.
        sub_id: String,
        /// The message (hex, as received).
        message: String,
    },
    /// `["NEG-ERR", sub_id, reason]` (NIP-77).
    NegErr {
        /// Negentropy subscription id.
        sub_id: String,
        /// The relay's reason.
        message: String,
    },
    /// A well-formed message of a type we do not use (e.g. `COUNT`).
    Other(String),
}

/// Why a frame could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameError {
    /// Not a JSON array whose first element is a string.
    NotAnArray,
    /// A known message type with missing or mistyped elements.
    Malformed(&'static str),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::NotAnArray => write!(f, "not a JSON array starting with a message type"),
            FrameError::Malformed(what) => write!(f, "malformed {what} message"),
        }
    }
}

fn string(raw: Option<&&RawValue>) -> Option<String> {
    raw.and_then(|r| serde_json::from_str::<String>(r.get()).ok())
}

/// Parses one text frame sent by a relay.
pub fn parse_relay_frame(text: &str) -> Result<Incoming<'_>, FrameError> {
    let parts: Vec<&RawValue> = serde_json::from_str(text).map_err(|_| FrameError::NotAnArray)?;
    let kind = string(parts.first()).ok_or(FrameError::NotAnArray)?;
    match kind.as_str() {
        "EVENT" => {
            let sub_id = string(parts.get(1)).ok_or(FrameError::Malformed("EVENT"))?;
            let raw = *parts.get(2).ok_or(FrameError::Malformed("EVENT"))?;
            if !raw.get().trim_start().starts_with('{') {
                return Err(FrameError::Malformed("EVENT"));
            }
            Ok(Incoming::Event { sub_id, raw })
        }
        "EOSE" => Ok(Incoming::Eose(
            string(parts.get(1)).ok_or(FrameError::Malformed("EOSE"))?,
        )),
        "CLOSED" => {
            let sub_id = string(parts.get(1)).ok_or(FrameError::Malformed("CLOSED"))?;
            let message = string(parts.get(2)).unwrap_or_default();
            Ok(Incoming::Closed {
                sub_id,
                prefix: Prefix::of(&message),
                message,
            })
        }
        "NOTICE" => Ok(Incoming::Notice(
            string(parts.get(1)).ok_or(FrameError::Malformed("NOTICE"))?,
        )),
        "OK" => {
            let id = string(parts.get(1)).ok_or(FrameError::Malformed("OK"))?;
            let event_id = EventId::from_hex(&id).map_err(|_| FrameError::Malformed("OK"))?;
            let accepted = parts
                .get(2)
                .and_then(|r| serde_json::from_str::<bool>(r.get()).ok())
                .ok_or(FrameError::Malformed("OK"))?;
            Ok(Incoming::Ok {
                event_id,
                accepted,
                message: string(parts.get(3)).unwrap_or_default(),
            })
        }
        "AUTH" => Ok(Incoming::Auth(
            string(parts.get(1)).ok_or(FrameError::Malformed("AUTH"))?,
        )),
        "NEG-MSG" => Ok(Incoming::NegMsg {
            sub_id: string(parts.get(1)).ok_or(FrameError::Malformed("NEG-MSG"))?,
            message: string(parts.get(2)).ok_or(FrameError::Malformed("NEG-MSG"))?,
        }),
        "NEG-ERR" => Ok(Incoming::NegErr {
            sub_id: string(parts.get(1)).ok_or(FrameError::Malformed("NEG-ERR"))?,
            message: string(parts.get(2)).unwrap_or_default(),
        }),
        _ => Ok(Incoming::Other(kind)),
    }
}

/// The subscription id and the event JSON of an EVENT frame in its compact form,
/// `["EVENT","<sub>",{…}]` (whitespace allowed only before the closing bracket), found
/// without parsing the frame; `None` for any other shape (read it with
/// [`parse_relay_frame`]). The subscription id is returned only when it has neither escapes
/// nor control characters, so it is the string the JSON denotes. The event JSON is only
/// delimited, not checked: the frame is the EVENT message [`parse_relay_frame`] would read,
/// with this subscription id and JSON, exactly when the JSON parses as one object (so a
/// caller parses the event with [`parse_event`] and falls back to [`parse_relay_frame`] when
/// that fails).
pub fn split_event_frame(text: &str) -> Option<(&str, &str)> {
    let rest = text.strip_prefix("[\"EVENT\",\"")?;
    let end = rest.find('"')?;
    let sub_id = &rest[..end];
    if sub_id.bytes().any(|b| b == b'\\' || b < 0x20) {
        return None;
    }
    let raw = rest[end + 1..]
        .strip_prefix(',')?
        .trim_end_matches(JSON_SPACE)
        .strip_suffix(']')?
        .trim_end_matches(JSON_SPACE);
    raw.starts_with('{').then_some((sub_id, raw))
}

/// The id an event's JSON claims, read without parsing it: the value of the object's
/// top-level `"id"` member when that is written `"id":"` and 64 lowercase hex digits and `"`,
/// whatever the order of the members (relays write the id first, such as nostr-rs-relay, or
/// the keys sorted, such as rust-nostr's relay builder, whose `content` comes first). `None`
/// when the text is not an object whose members can be delimited up to that one, when the id
/// is written another way (escapes, upper case, spaces inside) or missing; the caller then
/// parses the event. Only a claim: nothing says the id is the hash of the content, or that
/// the rest is JSON at all; it serves to recognise copies of events already verified and
/// forwarded ([`crate::core::dedup::VerifiedSet::forwarded_copy`]).
///
/// ```
/// use grasp_sync::core::message::claimed_id;
/// let id = "ab".repeat(32);
/// assert_eq!(claimed_id(&format!("{{\"id\":\"{id}\",\"kind\":1}}")).unwrap().to_hex(), id);
/// let sorted = format!("{{\"content\":\"a \\\"quote\\\"\",\"created_at\":1, \"id\" : \"{id}\"}}");
/// assert_eq!(claimed_id(&sorted).unwrap().to_hex(), id);
/// assert!(claimed_id(&format!("{{\"tags\":[[\"e\",\"{id}\"]],\"kind\":1}}")).is_none());
/// assert!(claimed_id(&format!("{{\"id\":\"{}\"}}", id.to_uppercase())).is_none());
/// ```
pub fn claimed_id(raw: &str) -> Option<EventId> {
    const PREFIX: &[u8] = b"{\"id\":\"";
    let bytes = raw.as_bytes();
    if let Some(hex) = bytes.strip_prefix(PREFIX) {
        // The shape most relays write: no scan.
        return id_value(hex);
    }
    let mut at = skip_space(bytes, bytes.strip_prefix(b"{").map(|_| 1)?);
    if bytes.get(at) == Some(&b'}') {
        return None;
    }
    loop {
        // A member: key, colon, value; then a comma or the end of the object.
        if bytes.get(at) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(bytes, at + 1)?;
        let key = &bytes[at + 1..key_end];
        at = skip_space(bytes, key_end + 1);
        if bytes.get(at) != Some(&b':') {
            return None;
        }
        at = skip_space(bytes, at + 1);
        if key == b"id" {
            return id_value(bytes.get(at..)?.strip_prefix(b"\"")?);
        }
        at = skip_space(bytes, value_end(bytes, at)?);
        match bytes.get(at) {
            Some(b',') => at = skip_space(bytes, at + 1),
            _ => return None,
        }
    }
}

/// 64 lowercase hex digits closed by `"` at the start of `text`, as an id.
fn id_value(text: &[u8]) -> Option<EventId> {
    if text.get(64) != Some(&b'"') {
        return None;
    }
    hex_id(&text[..64])
}

/// The first index at or after `at` that is not JSON whitespace.
fn skip_space(bytes: &[u8], mut at: usize) -> usize {
    while matches!(bytes.get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// The index of the quote that closes the JSON string whose content starts at `at`.
fn string_end(bytes: &[u8], mut at: usize) -> Option<usize> {
    loop {
        at += memchr::memchr2(b'"', b'\\', bytes.get(at..)?)?;
        if bytes[at] == b'"' {
            return Some(at);
        }
        // An escape: the next byte is escaped (`\uXXXX` has no quote or backslash after it).
        at += 2;
    }
}

/// The index just after the JSON value starting at `at`: a string, an array or object (its
/// strings skipped, its brackets counted), or a number or literal (up to the next `,`, `}`,
/// `]` or whitespace). Only delimits: what is inside is not checked.
fn value_end(bytes: &[u8], at: usize) -> Option<usize> {
    match *bytes.get(at)? {
        b'"' => Some(string_end(bytes, at + 1)? + 1),
        b'[' | b'{' => {
            let mut depth = 0usize;
            let mut i = at;
            loop {
                match *bytes.get(i)? {
                    b'"' => i = string_end(bytes, i + 1)?,
                    b'[' | b'{' => depth += 1,
                    b']' | b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            let len = bytes[at..]
                .iter()
                .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))?;
            (len > 0).then_some(at + len)
        }
    }
}

/// 64 lowercase hex digits as an id.
pub(crate) fn hex_id(hex: &[u8]) -> Option<EventId> {
    if hex.len() != 64 {
        return None;
    }
    // Branch-free: every frame of a copy passes here, so the digits are looked up in a
    // table and checked once at the end.
    let mut id = [0u8; 32];
    let mut bad = 0u8;
    for (byte, pair) in id.iter_mut().zip(hex.chunks_exact(2)) {
        let (hi, lo) = (
            HEX_DIGIT[usize::from(pair[0])],
            HEX_DIGIT[usize::from(pair[1])],
        );
        bad |= hi | lo;
        *byte = hi << 4 | (lo & 0x0f);
    }
    (bad & 0xf0 == 0).then(|| EventId::from_byte_array(id))
}

/// An `OK` answer in the compact shape relays send,
/// `["OK","<64 lowercase hex>",true|false,"<message>"]` with a message free of escapes and
/// control characters, read without the JSON parser (the forwarder reads one per event it
/// writes). `None` for any other text, which [`parse_relay_frame`] then reads: for every
/// text this accepts, that returns the same id, verdict and message.
///
/// ```
/// use grasp_sync::core::message::parse_ok_frame;
/// let id = "ab".repeat(32);
/// let frame = format!("[\"OK\",\"{id}\",true,\"\"]");
/// let (got, accepted, message) = parse_ok_frame(&frame).unwrap();
/// assert_eq!((got.to_hex(), accepted, message), (id.clone(), true, ""));
/// assert!(parse_ok_frame(&format!("[\"OK\", \"{id}\",true,\"\"]")).is_none());
/// assert!(parse_ok_frame(&format!("[\"OK\",\"{id}\",false,\"a \\\"quote\\\"\"]")).is_none());
/// ```
pub fn parse_ok_frame(text: &str) -> Option<(EventId, bool, &str)> {
    let rest = text.strip_prefix("[\"OK\",\"")?;
    let id = hex_id(rest.as_bytes().get(..64)?)?;
    let rest = rest.get(64..)?.strip_prefix("\",")?;
    let (accepted, rest) = match rest.strip_prefix("true") {
        Some(rest) => (true, rest),
        None => (false, rest.strip_prefix("false")?),
    };
    let message = rest.strip_prefix(",\"")?.strip_suffix("\"]")?;
    if message.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
        return None;
    }
    Some((id, accepted, message))
}

/// The value of each lowercase hex digit; `0xff` for every other byte.
const HEX_DIGIT: [u8; 256] = {
    let mut table = [0xffu8; 256];
    let mut i = 0;
    while i < 10 {
        table[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        table[b'a' as usize + i] = 10 + i as u8;
        i += 1;
    }
    table
};

/// Whether an event with this summary can match `filter`, as far as the summary tells:
/// its `since`/`until` window, kinds and authors (tag conditions are not known from a
/// summary and count as met). For copies recognised by their id
/// ([`crate::core::dedup::VerifiedSet::forwarded_copy`]), so that a relay that ignores the
/// window or the kinds cannot make them count for a page.
pub fn summary_matches(filter: &Filter, summary: &EventSummary) -> bool {
    filter
        .since
        .is_none_or(|s| summary.created_at >= s.as_secs())
        && filter
            .until
            .is_none_or(|u| summary.created_at <= u.as_secs())
        && filter
            .kinds
            .as_ref()
            .is_none_or(|k| k.is_empty() || k.contains(&nostr::event::Kind::from(summary.kind)))
        && filter
            .authors
            .as_ref()
            .is_none_or(|a| a.is_empty() || a.contains(&summary.pubkey))
}

/// A subscription's tag conditions as [`TagPrint`] hashes, built once per subscription, so
/// that a copy recognised by its id is checked against them without being parsed
/// ([`copy_matches`]).
#[derive(Debug, Clone, Default)]
pub struct FilterPrint {
    /// Per tag condition, the hashes of `(letter, value)` for its values. `None`: a
    /// condition on a letter a [`TagPrint`] does not keep (nothing can be told from a
    /// summary).
    conditions: Option<Vec<std::collections::HashSet<u32>>>,
}

impl FilterPrint {
    /// The print of `filter`'s tag conditions.
    pub fn of(filter: &Filter) -> FilterPrint {
        let mut conditions = Vec::new();
        for (tag, values) in filter.generic_tags.iter() {
            let letter = tag.as_byte();
            if !PRINTED_TAGS.contains(&letter) {
                return FilterPrint { conditions: None };
            }
            conditions.push(values.iter().map(|v| TagPrint::hash(letter, v)).collect());
        }
        FilterPrint {
            conditions: Some(conditions),
        }
    }
}

/// Whether an event with this summary matches `filter` (whose tag conditions are `print`,
/// [`FilterPrint::of`]) as [`Filter::match_event`] would on the parsed event: `Some(false)`
/// when its window, kinds, authors or tags rule it out, `Some(true)` when everything
/// matches, `None` when the tags cannot be told (a condition on a letter not printed, or
/// an event with more tags than [`crate::core::dedup::TAG_PRINTS`]): parse the copy.
///
/// Before issue 36 a copy counted for its page whatever its tags, so a relay could fill
/// every page of a tag query with copies of public events it does not match and keep the
/// engine asking for the next page (decision 0066 amended).
pub fn copy_matches(filter: &Filter, print: &FilterPrint, summary: &EventSummary) -> Option<bool> {
    if !summary_matches(filter, summary) {
        return Some(false);
    }
    let conditions = print.conditions.as_ref()?;
    if conditions.is_empty() {
        return Some(true);
    }
    if summary.tags.overflowed() {
        return None;
    }
    let event_tags = summary.tags.hashes();
    // Each hash covers the letter with the value: a value under another letter does not
    // count.
    Some(
        conditions
            .iter()
            .all(|values| event_tags.iter().any(|h| values.contains(h))),
    )
}

/// JSON's whitespace characters.
const JSON_SPACE: [char; 4] = [' ', '\t', '\n', '\r'];

/// Why an event received from a relay is not forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventRejection {
    /// Not a valid event object.
    Malformed(String),
    /// The id is not the hash of the event's content.
    BadId,
    /// The signature does not verify.
    BadSignature,
    /// The event does not match the filter of the subscription it arrived on.
    NotMatching,
}

impl std::fmt::Display for EventRejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EventRejection::Malformed(e) => write!(f, "malformed event: {e}"),
            EventRejection::BadId => write!(f, "event id does not match its content"),
            EventRejection::BadSignature => write!(f, "invalid signature"),
            EventRejection::NotMatching => {
                write!(f, "event does not match the subscription it arrived on")
            }
        }
    }
}

/// Parses and checks an event: valid JSON, id, signature, and `filter` matches it.
pub fn check_event(raw: &str, filter: &Filter) -> Result<Event, EventRejection> {
    let event = parse_event(raw)?;
    check_parsed(&event, filter)?;
    Ok(event)
}

/// Parses an event object without checking it.
pub fn parse_event(raw: &str) -> Result<Event, EventRejection> {
    if !tags_within_bounds(raw) {
        return Err(EventRejection::Malformed(format!(
            "more than {MAX_EVENT_TAGS} tags or {MAX_TAG_STRINGS} tag values (not parsed)"
        )));
    }
    Event::from_json(raw).map_err(|e| EventRejection::Malformed(e.to_string()))
}

/// Most tags an event may carry to be parsed (strfry refuses more than 2,000 too): a frame
/// of a megabyte of empty tags would otherwise cost about 20 MiB to parse (issue 36).
pub const MAX_EVENT_TAGS: usize = 2_000;

/// Most strings all tags of an event may hold together to be parsed.
pub const MAX_TAG_STRINGS: usize = 20_000;

/// True when the event JSON `raw` stays within [`MAX_EVENT_TAGS`] and [`MAX_TAG_STRINGS`],
/// read without parsing it: the elements of every top-level `"tags"` member are counted.
/// When the members cannot be delimited (a shape relays do not write, such as escapes in a
/// key), the whole text is bounded instead: no more `[` than tags allowed, no more `"` than
/// two per string allowed plus the other members'.
///
/// ```
/// use grasp_sync::core::message::{tags_within_bounds, MAX_EVENT_TAGS};
/// assert!(tags_within_bounds(r#"{"kind":1,"tags":[["e","x"],["p","y"]],"content":"[[["}"#));
/// let many = format!(r#"{{"kind":1,"tags":[{}[]]}}"#, "[],".repeat(MAX_EVENT_TAGS));
/// assert!(!tags_within_bounds(&many));
/// ```
pub fn tags_within_bounds(raw: &str) -> bool {
    match tags_shape(raw.as_bytes()) {
        Some((tags, strings)) => tags <= MAX_EVENT_TAGS && strings <= MAX_TAG_STRINGS,
        None => {
            let bytes = raw.as_bytes();
            memchr::memchr_iter(b'[', bytes).count() <= MAX_EVENT_TAGS + 1
                && memchr::memchr_iter(b'"', bytes).count() <= 2 * (MAX_TAG_STRINGS + 64)
        }
    }
}

/// (tags, strings in them) over every top-level `"tags"` member of the object `bytes`;
/// `None` when the members cannot be delimited or a key has an escape.
fn tags_shape(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut at = skip_space(bytes, bytes.strip_prefix(b"{").map(|_| 1)?);
    let (mut tags, mut strings) = (0usize, 0usize);
    if bytes.get(at) == Some(&b'}') {
        return Some((0, 0));
    }
    loop {
        if bytes.get(at) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(bytes, at + 1)?;
        let key = &bytes[at + 1..key_end];
        if key.contains(&b'\\') {
            return None;
        }
        at = skip_space(bytes, key_end + 1);
        if bytes.get(at) != Some(&b':') {
            return None;
        }
        at = skip_space(bytes, at + 1);
        let end = if key == b"tags" {
            let (end, t, s) = tags_array(bytes, at)?;
            tags = tags.saturating_add(t);
            strings = strings.saturating_add(s);
            end
        } else {
            value_end(bytes, at)?
        };
        at = skip_space(bytes, end);
        match bytes.get(at) {
            Some(b',') => at = skip_space(bytes, at + 1),
            Some(b'}') => return Some((tags, strings)),
            _ => return None,
        }
    }
}

/// The end of the array of arrays of strings starting at `at`, its arrays and their
/// strings counted; `None` for any other shape.
fn tags_array(bytes: &[u8], at: usize) -> Option<(usize, usize, usize)> {
    if bytes.get(at) != Some(&b'[') {
        return None;
    }
    let (mut tags, mut strings) = (0usize, 0usize);
    let mut i = skip_space(bytes, at + 1);
    if bytes.get(i) == Some(&b']') {
        return Some((i + 1, 0, 0));
    }
    loop {
        if bytes.get(i) != Some(&b'[') {
            return None;
        }
        tags += 1;
        i = skip_space(bytes, i + 1);
        if bytes.get(i) == Some(&b']') {
            i += 1;
        } else {
            loop {
                if bytes.get(i) != Some(&b'"') {
                    return None;
                }
                strings += 1;
                i = skip_space(bytes, string_end(bytes, i + 1)? + 1);
                match bytes.get(i) {
                    Some(b',') => i = skip_space(bytes, i + 1),
                    Some(b']') => {
                        i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        i = skip_space(bytes, i);
        match bytes.get(i) {
            Some(b',') => i = skip_space(bytes, i + 1),
            Some(b']') => return Some((i + 1, tags, strings)),
            _ => return None,
        }
    }
}

/// Checks a parsed event: `filter` matches it, its id is the hash of its content and its
/// signature verifies (cheap checks first).
pub fn check_parsed(event: &Event, filter: &Filter) -> Result<(), EventRejection> {
    if !filter.match_event(event, MatchEventOptions::new()) {
        return Err(EventRejection::NotMatching);
    }
    if !event.verify_id() {
        return Err(EventRejection::BadId);
    }
    if !event.verify_signature() {
        return Err(EventRejection::BadSignature);
    }
    Ok(())
}

/// How [`check_parsed_cached`] established an event's id and signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SignatureCheck {
    /// The id and the Schnorr signature were verified now (and remembered).
    Verified,
    /// This `(id, signature)` pair was verified before from other JSON bytes; the id (the
    /// hash of the content) was recomputed now, the signature was not checked again.
    Remembered,
    /// Byte for byte the JSON verified before under this id (same SHA-256 of the raw
    /// bytes): neither id nor signature needed checking again.
    Identical,
}

/// [`check_parsed`] that does not check a copy again: `event` was parsed from `raw`, the
/// event's JSON exactly as the relay sent it.
///
/// * `raw` has the SHA-256 of JSON verified before under this id and signature
///   ([`Known::SameBytes`]): the same bytes, so the same event; nothing is recomputed
///   ([`SignatureCheck::Identical`]).
/// * other bytes with a verified `(id, signature)` pair (another serialisation, or a forgery
///   reusing them): the id is recomputed from the content, so a copy that reuses a verified
///   id and signature with other content fails with [`EventRejection::BadId`]; the Schnorr
///   check (≈ 30 µs) is not repeated ([`SignatureCheck::Remembered`]).
/// * otherwise id and signature are verified and remembered with the digest of `raw`.
///
/// The filter is checked for every copy. The rejections are those of [`check_parsed`].
pub fn check_parsed_cached(
    event: &Event,
    raw: &str,
    filter: &Filter,
    verified: &VerifiedSet,
) -> Result<SignatureCheck, EventRejection> {
    if !filter.match_event(event, MatchEventOptions::new()) {
        return Err(EventRejection::NotMatching);
    }
    let digest = RawDigest::of(raw);
    match verified.known(&event.id, &event.sig, &digest) {
        Known::SameBytes => return Ok(SignatureCheck::Identical),
        Known::SameSignature => {
            return if event.verify_id() {
                Ok(SignatureCheck::Remembered)
            } else {
                Err(EventRejection::BadId)
            };
        }
        Known::No => {}
    }
    if !event.verify_id() {
        return Err(EventRejection::BadId);
    }
    if !verified.verify_signature(event) {
        return Err(EventRejection::BadSignature);
    }
    verified.insert(event.id, event.sig, digest, EventSummary::of(event));
    Ok(SignatureCheck::Verified)
}

/// Relay-supplied text made safe for one log line: control characters (newlines, carriage
/// returns, escape sequences, …), Unicode bidirectional and zero-width format characters and
/// backslashes are escaped (`\n`, `\u{1b}`, `\\`), and the text is cut after `max_chars`
/// characters with a note of how many bytes were left out. A hostile relay therefore cannot
/// forge log lines, hide text or fill the log.
///
/// ```
/// use grasp_sync::core::message::escape_for_log;
/// assert_eq!(escape_for_log("a\nb\u{1b}[31m", 100), "a\\nb\\u{1b}[31m");
/// assert_eq!(escape_for_log("abcdef", 3), "abc… (3 more bytes)");
/// ```
pub fn escape_for_log(text: &str, max_chars: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max_chars.saturating_mul(2)));
    for (n, (i, c)) in text.char_indices().enumerate() {
        if n == max_chars {
            out.push_str(&format!("… ({} more bytes)", text.len() - i));
            break;
        }
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control()
                || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{feff}') =>
            {
                out.push_str(&format!("\\u{{{:x}}}", c as u32));
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    use nostr::key::Keys;

    #[test]
    fn events_beyond_the_tag_bounds_are_refused_before_the_parser_sees_them() {
        // Issue 36, item 11: a frame of a megabyte of empty tags cost ~20 MiB to parse.
        let keys = Keys::generate();
        let ok = EventBuilder::new(Kind::Custom(1621), "a [[[ bracketed ]]] \"text\"")
            .tag(Tag::parse(["a", "30617:x:y"]).unwrap())
            .tag(Tag::parse(["e", &"b".repeat(64), "", "root"]).unwrap())
            .finalize(&keys)
            .unwrap();
        let json = ok.as_json();
        assert_eq!(tags_shape(json.as_bytes()), Some((2, 6)));
        assert_eq!(parse_event(&json).unwrap(), ok);
        let base = |tags: &str| format!(r#"{{"kind":1,"tags":[{tags}],"content":""}}"#);
        let empty = |n: usize| vec!["[]"; n].join(",");
        assert!(tags_within_bounds(&base(&empty(MAX_EVENT_TAGS))));
        assert!(!tags_within_bounds(&base(&empty(MAX_EVENT_TAGS + 1))));
        let values = |n: usize| format!("[{}]", vec!["\"\""; n].join(","));
        assert!(tags_within_bounds(&base(&values(MAX_TAG_STRINGS))));
        assert!(!tags_within_bounds(&base(&values(MAX_TAG_STRINGS + 1))));
        // Two `tags` members are counted together.
        let twice = format!(
            r#"{{"tags":[{}],"kind":1,"tags":[{}]}}"#,
            empty(MAX_EVENT_TAGS),
            empty(2)
        );
        assert!(!tags_within_bounds(&twice));
        // A key with an escape cannot be delimited: the whole text is bounded.
        let escaped = format!(r#"{{"t\u0061gs":[{}]}}"#, empty(MAX_EVENT_TAGS + 1));
        assert!(!tags_within_bounds(&escaped));
        assert!(matches!(
            parse_event(&base(&empty(MAX_EVENT_TAGS + 1))),
            Err(EventRejection::Malformed(m)) if m.contains("not parsed")
        ));
    }

    #[test]
    fn a_claimed_id_is_read_from_lowercase_hex_only() {
        let hex: String = (0..64)
            .map(|i| b"0123456789abcdef"[(i * 7) % 16] as char)
            .collect();
        let raw = format!("{{\"id\":\"{hex}\",\"kind\":1}}");
        assert_eq!(claimed_id(&raw), Some(EventId::from_hex(&hex).unwrap()));
        // Any byte that is not a lowercase hex digit, in any position, means no claim.
        for pos in 0..64 {
            for bad in [b'g', b'/', b':', b'`', b'A', b'F', b' ', 0xc3] {
                let mut bytes = raw.clone().into_bytes();
                bytes[7 + pos] = bad;
                let text = String::from_utf8_lossy(&bytes);
                assert_eq!(claimed_id(&text), None, "{text}");
            }
        }
        assert_eq!(claimed_id(&raw[..70]), None, "cut short");
        let mut open = raw.clone().into_bytes();
        open[71] = b'0';
        let open = String::from_utf8(open).unwrap();
        assert_eq!(claimed_id(&open), None, "not closed after 64 digits");
    }

    fn event() -> Event {
        let keys = Keys::parse("6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e")
            .unwrap();
        EventBuilder::new(Kind::Custom(1621), "hello")
            .tag(Tag::parse(["a", "30617:abc:x"]).unwrap())
            .finalize(&keys)
            .unwrap()
    }

    #[test]
    fn escape_for_log_escapes_controls_and_caps_length() {
        assert_eq!(escape_for_log("plain text", 100), "plain text");
        assert_eq!(
            escape_for_log("line\r\nFAKE LOG LINE\t\\", 100),
            "line\\r\\nFAKE LOG LINE\\t\\\\"
        );
        assert_eq!(
            escape_for_log("\u{1b}[2J\u{0}\u{7f}", 100),
            "\\u{1b}[2J\\u{0}\\u{7f}"
        );
        assert_eq!(
            escape_for_log("a\u{202e}b\u{200b}", 100),
            "a\\u{202e}b\\u{200b}"
        );
        assert_eq!(escape_for_log("héllo wörld", 5), "héllo… (7 more bytes)");
        assert_eq!(escape_for_log("", 0), "");
        let long = "x".repeat(10_000);
        assert!(escape_for_log(&long, 300).len() < 330);
        // Every output is one line.
        let all: String = (0u32..0x3000).filter_map(char::from_u32).collect();
        assert!(!escape_for_log(&all, usize::MAX).contains(['\n', '\r']));
    }

    #[test]
    fn parses_every_message_type() {
        let ev = event();
        let text = format!(r#"["EVENT","s1",{}]"#, ev.as_json());
        match parse_relay_frame(&text).unwrap() {
            Incoming::Event { sub_id, raw } => {
                assert_eq!(sub_id, "s1");
                assert_eq!(raw.get(), ev.as_json());
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse_relay_frame(r#"["EOSE","s"]"#), Ok(Incoming::Eose(s)) if s == "s"));
        assert!(matches!(
            parse_relay_frame(r#"["CLOSED","s","rate-limited: slow"]"#),
            Ok(Incoming::Closed { message, prefix: Prefix::RateLimited, .. }) if message == "rate-limited: slow"
        ));
        assert!(matches!(
            parse_relay_frame(r#"["CLOSED","s","\tauth-required: who are you"]"#),
            Ok(Incoming::Closed {
                prefix: Prefix::AuthRequired,
                ..
            })
        ));
        assert!(matches!(
            parse_relay_frame(r#"["NOTICE","hi"]"#),
            Ok(Incoming::Notice(_))
        ));
        assert!(matches!(
            parse_relay_frame(r#"["AUTH","ch"]"#),
            Ok(Incoming::Auth(_))
        ));
        let ok = format!(r#"["OK","{}",false,"blocked: no"]"#, ev.id);
        assert!(matches!(
            parse_relay_frame(&ok),
            Ok(Incoming::Ok {
                accepted: false,
                ..
            })
        ));
        assert!(matches!(
            parse_relay_frame(r#"["COUNT","s",{"count":1}]"#),
            Ok(Incoming::Other(_))
        ));
    }

    #[test]
    fn an_event_frame_split_by_hand_reads_as_the_parser_reads_it() {
        let ev = event().as_json();
        // Compact frames: the same subscription id and event JSON as the parser's.
        for text in [
            format!(r#"["EVENT","s1",{ev}]"#),
            format!("[\"EVENT\",\"sub:2 é\",{ev} \n]\r\n"),
            format!(r#"["EVENT","",{ev}]"#),
        ] {
            let (sub, raw) = split_event_frame(&text).expect(&text);
            let Ok(Incoming::Event {
                sub_id,
                raw: parsed,
            }) = parse_relay_frame(&text)
            else {
                panic!("{text}")
            };
            assert_eq!((sub, raw), (sub_id.as_str(), parsed.get()));
            assert!(parse_event(raw).is_ok());
        }
        // Other shapes are left to the parser.
        for text in [
            format!(r#"["EVENT", "s1",{ev}]"#),
            format!(r#"["EVENT","s1", {ev}]"#),
            format!(r#"["EVENT","s\"1",{ev}]"#),
            format!("[\"EVENT\",\"s{}\",{ev}]", '\u{1}'),
            format!(r#"["EVENT","s1",{ev}"#),
            format!(r#"["EVENT","s1",[{ev}]]"#),
            format!(r#"["EOSE","s1",{ev}]"#),
            r#"["EVENT","s1"]"#.to_string(),
            r#"["EVENT","s1""#.to_string(),
            String::new(),
        ] {
            assert_eq!(split_event_frame(&text), None, "{text}");
        }
        // Delimited but not one object: the event does not parse, and the caller falls back
        // to the parser (which reads the frame its own way, here with an extra element).
        let extra = format!(r#"["EVENT","s1",{ev},5]"#);
        let (_, raw) = split_event_frame(&extra).unwrap();
        assert!(parse_event(raw).is_err());
        assert!(matches!(
            parse_relay_frame(&extra),
            Ok(Incoming::Event { raw, .. }) if raw.get() == ev
        ));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for g in [
            "",
            "null",
            "{}",
            "[]",
            "[1,2]",
            "[\"EVENT\"]",
            "[\"EVENT\",\"s\",5]",
            "[\"EOSE\"]",
            "[\"OK\",\"zz\",true,\"\"]",
            "[\"OK\"]",
            "\u{0}\u{1}",
            "[\"NOTICE\",7]",
        ] {
            assert!(parse_relay_frame(g).is_err(), "{g:?} should fail");
        }
    }

    #[test]
    fn checks_signature_id_and_filter() {
        let ev = event();
        let any = Filter::new().kind(Kind::Custom(1621));
        assert_eq!(check_event(&ev.as_json(), &any).unwrap().id, ev.id);
        let other = Filter::new().kind(Kind::Custom(1));
        assert_eq!(
            check_event(&ev.as_json(), &other).unwrap_err(),
            EventRejection::NotMatching
        );
        // Forge: change the content but keep id and signature.
        let forged = ev.as_json().replace("hello", "HELLO");
        assert_eq!(
            check_event(&forged, &any).unwrap_err(),
            EventRejection::BadId
        );
        // Forge: keep content, swap the signature for another valid-looking one.
        let mut v: serde_json::Value = serde_json::from_str(&ev.as_json()).unwrap();
        v["sig"] = serde_json::Value::String("ab".repeat(64));
        assert_eq!(
            check_event(&v.to_string(), &any).unwrap_err(),
            EventRejection::BadSignature
        );
        assert!(matches!(
            check_event("{\"id\":1}", &any),
            Err(EventRejection::Malformed(_))
        ));
    }

    #[test]
    fn a_remembered_signature_skips_only_the_schnorr_check() {
        let ev = event();
        let any = Filter::new().kind(Kind::Custom(1621));
        let verified = VerifiedSet::new(16);
        let check =
            |raw: &str, f: &Filter| check_parsed_cached(&parse_event(raw)?, raw, f, &verified);
        let json = ev.as_json();
        assert_eq!(check(&json, &any), Ok(SignatureCheck::Verified));
        assert_eq!(check(&json, &any), Ok(SignatureCheck::Identical));
        // Other bytes of the same event (another serialisation): the id is recomputed.
        let spaced = json.replacen(',', ", ", 1);
        assert_ne!(spaced, json);
        assert_eq!(check(&spaced, &any), Ok(SignatureCheck::Remembered));
        // The filter and the id are still checked for a copy.
        let other = Filter::new().kind(Kind::Custom(1));
        assert_eq!(check(&json, &other), Err(EventRejection::NotMatching));
        let forged = json.replace("hello", "HELLO");
        assert_eq!(check(&forged, &any), Err(EventRejection::BadId));
        // Same id, another (invalid) signature: verified, and refused.
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["sig"] = serde_json::Value::String("ab".repeat(64));
        assert_eq!(
            check(&v.to_string(), &any),
            Err(EventRejection::BadSignature)
        );
        assert_eq!(check(&json, &any), Ok(SignatureCheck::Identical));
        assert_eq!(verified.len(), 1);
    }
}
