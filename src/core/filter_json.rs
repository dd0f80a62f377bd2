//! A filter's JSON, written directly, and its length counted without writing it.
//!
//! A live chunk holds up to a thousand event ids (64 hex digits each) under one tag, and a
//! grown chunk's REQ is sent again whole (decision 0110): serialising it through serde
//! formats every value byte by byte through its escape table, and sizing a REQ against the
//! relay's frame limit serialised it once more only to take its length. Tag values, ids and
//! keys are nearly always plain ASCII with nothing to escape; they are copied as they are
//! here, and only a value that needs escaping goes through `serde_json`. The output is the
//! same bytes as `Filter::as_json` (nostr 0.45: the fields in declaration order, then the
//! `#x` tags in key order), which the tests check.

use nostr::filter::Filter;

/// True when `s` is written as it is inside JSON quotes: no `"`, `\` or control character.
fn plain(s: &str) -> bool {
    s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\')
}

/// Appends `s` as a JSON string.
fn push_str(out: &mut String, s: &str) {
    if plain(s) {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        // Serialising a `&str` cannot fail.
        out.push_str(&serde_json::to_string(s).unwrap_or_default());
    }
}

/// The length of `s` as a JSON string, quotes and escapes included.
pub(crate) fn str_len(s: &str) -> usize {
    if plain(s) {
        s.len() + 2
    } else {
        serde_json::to_string(s).map_or(s.len() + 2, |j| j.len())
    }
}

/// The number of decimal digits of `n`.
fn digits(mut n: u64) -> usize {
    let mut d = 1;
    while n >= 10 {
        n /= 10;
        d += 1;
    }
    d
}

/// Appends 32 bytes as 64 lowercase hex digits in quotes.
fn push_hex(out: &mut String, bytes: &[u8; 32]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [0u8; 66];
    buf[0] = b'"';
    buf[65] = b'"';
    for (i, b) in bytes.iter().enumerate() {
        buf[1 + 2 * i] = HEX[usize::from(b >> 4)];
        buf[2 + 2 * i] = HEX[usize::from(b & 0xf)];
    }
    // ASCII by construction.
    out.push_str(std::str::from_utf8(&buf).unwrap_or_default());
}

/// Appends a field of hex values: `,` when needed, `key` (the name and `[`), the values, `]`.
fn push_hex_list<'a>(out: &mut String, key: &str, values: impl Iterator<Item = &'a [u8; 32]>) {
    comma(out);
    out.push_str(key);
    for (i, bytes) in values.enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_hex(out, bytes);
    }
    out.push(']');
}

/// Appends `,` unless `out` ends with `{`.
fn comma(out: &mut String) {
    if !out.ends_with('{') {
        out.push(',');
    }
}

/// Appends `f`'s JSON object to `out` (the bytes `f.as_json()` returns).
pub(crate) fn write_filter(out: &mut String, f: &Filter) {
    use std::fmt::Write;
    // Room for the tag values at 67 bytes each (an event id), without a pass over them.
    out.reserve(64 + 67 * f.generic_tags.values().map(|v| v.len()).sum::<usize>());
    out.push('{');
    if let Some(ids) = &f.ids {
        push_hex_list(out, "\"ids\":[", ids.iter().map(|id| id.as_bytes()));
    }
    if let Some(authors) = &f.authors {
        push_hex_list(out, "\"authors\":[", authors.iter().map(|pk| pk.as_bytes()));
    }
    if let Some(kinds) = &f.kinds {
        comma(out);
        out.push_str("\"kinds\":[");
        for (i, k) in kinds.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{}", k.as_u16());
        }
        out.push(']');
    }
    if let Some(search) = &f.search {
        comma(out);
        out.push_str("\"search\":");
        push_str(out, search);
    }
    for (key, value) in [
        ("since", f.since.map(|t| t.as_secs())),
        ("until", f.until.map(|t| t.as_secs())),
        ("limit", f.limit.map(|l| l as u64)),
    ] {
        if let Some(v) = value {
            comma(out);
            let _ = write!(out, "\"{key}\":{v}");
        }
    }
    for (tag, values) in &f.generic_tags {
        comma(out);
        push_str(out, &format!("#{tag}"));
        out.push_str(":[");
        for (i, v) in values.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            push_str(out, v);
        }
        out.push(']');
    }
    out.push('}');
}

/// `f`'s JSON object as a string (the bytes `f.as_json()` returns).
#[cfg(test)]
fn filter_json(f: &Filter) -> String {
    let mut out = String::new();
    write_filter(&mut out, f);
    out
}

/// The length of `f`'s JSON object in bytes, counted without writing it.
pub(crate) fn filter_len(f: &Filter) -> usize {
    // A list of `n` items of `each` bytes: brackets plus `n − 1` commas.
    let list = |n: usize, items: usize| 2 + items + n.saturating_sub(1);
    let mut fields: Vec<usize> = Vec::new();
    if let Some(ids) = &f.ids {
        fields.push(6 + list(ids.len(), ids.len() * 66));
    }
    if let Some(authors) = &f.authors {
        fields.push(10 + list(authors.len(), authors.len() * 66));
    }
    if let Some(kinds) = &f.kinds {
        let items: usize = kinds.iter().map(|k| digits(u64::from(k.as_u16()))).sum();
        fields.push(8 + list(kinds.len(), items));
    }
    if let Some(search) = &f.search {
        fields.push(9 + str_len(search));
    }
    if let Some(t) = f.since {
        fields.push(8 + digits(t.as_secs()));
    }
    if let Some(t) = f.until {
        fields.push(8 + digits(t.as_secs()));
    }
    if let Some(l) = f.limit {
        fields.push(8 + digits(l as u64));
    }
    for (tag, values) in &f.generic_tags {
        let key = str_len(&format!("#{tag}"));
        let items: usize = values.iter().map(|v| str_len(v)).sum();
        fields.push(key + 1 + list(values.len(), items));
    }
    2 + fields.iter().sum::<usize>() + fields.len().saturating_sub(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nostr::event::{EventId, Kind};
    use nostr::filter::SingleLetterTag;
    use nostr::key::Keys;
    use nostr::types::Timestamp;
    use proptest::prelude::*;

    fn check(f: &Filter) {
        let expected = f.as_json();
        assert_eq!(filter_json(f), expected);
        assert_eq!(filter_len(f), expected.len(), "{expected}");
    }

    #[test]
    fn the_filters_the_sync_sends_are_written_as_nostr_writes_them() {
        let id = |i: u8| EventId::from_byte_array([i; 32]);
        check(&Filter::new());
        check(&Filter::new().limit(0));
        check(
            &Filter::new()
                .ids([id(1), id(2)])
                .kinds([Kind::Custom(1617), Kind::Custom(30617), Kind::TextNote])
                .since(Timestamp::from_secs(1_700_000_000))
                .until(Timestamp::from_secs(9))
                .limit(500),
        );
        check(
            &Filter::new()
                .author(Keys::generate().public_key())
                .custom_tags(
                    SingleLetterTag::LOWERCASE_E,
                    [id(3).to_hex(), id(4).to_hex()],
                )
                .custom_tags(SingleLetterTag::UPPERCASE_E, [id(5).to_hex()])
                .custom_tags(SingleLetterTag::LOWERCASE_A, ["30617:ab:repo".to_string()]),
        );
    }

    #[test]
    fn values_that_need_escaping_are_escaped_as_serde_json_does() {
        check(
            &Filter::new()
                .search("a \"quoted\" \\ word\n\u{1}é")
                .custom_tags(
                    SingleLetterTag::LOWERCASE_D,
                    ["x\"y".to_string(), "tab\there".to_string(), "ü".into()],
                ),
        );
    }

    proptest! {
        #[test]
        fn any_filter_is_written_and_counted_as_nostr_writes_it(
            ids in proptest::collection::btree_set(any::<[u8; 32]>(), 0..4),
            has_ids in any::<bool>(),
            kinds in proptest::collection::btree_set(any::<u16>(), 0..4),
            has_kinds in any::<bool>(),
            search in proptest::option::of(".{0,12}"),
            since in proptest::option::of(any::<u32>()),
            until in proptest::option::of(any::<u32>()),
            limit in proptest::option::of(any::<u32>()),
            tags in proptest::collection::btree_map(
                proptest::sample::select(vec!['a', 'd', 'e', 'E', 'p', 'q']),
                proptest::collection::btree_set(".{0,8}", 1..4),
                0..3,
            ),
        ) {
            let mut f = Filter::new();
            if has_ids {
                f = f.ids(ids.into_iter().map(EventId::from_byte_array));
            }
            if has_kinds {
                f = f.kinds(kinds.into_iter().map(Kind::from));
            }
            if let Some(s) = search {
                f = f.search(s);
            }
            if let Some(s) = since {
                f = f.since(Timestamp::from_secs(u64::from(s)));
            }
            if let Some(u) = until {
                f = f.until(Timestamp::from_secs(u64::from(u)));
            }
            if let Some(l) = limit {
                f = f.limit(l as usize);
            }
            for (c, values) in tags {
                let tag = SingleLetterTag::from_char(c).expect("a letter");
                f = f.custom_tags(tag, values);
            }
            let expected = f.as_json();
            prop_assert_eq!(filter_json(&f), expected.clone());
            prop_assert_eq!(filter_len(&f), expected.len());
        }
    }
}
