//! What an oversized frame is about, read without parsing it.
//!
//! A text frame above the soft cap (`SessionConfig::max_event_size`) is dropped, but the
//! session still wants its subscription id (paging counts it as received) and its event id
//! (each oversized event is counted and logged once per relay). Parsing a frame of many small
//! JSON values costs 10–20 times its size in memory, so [`scan_event_frame`] reads both with
//! a byte scan instead: no allocation, constant state, one pass at most.

use nostr::event::EventId;

/// Bytes of a frame's start within which its subscription id must end.
pub(crate) const SUB_ID_SCAN: usize = 200;

/// JSON whitespace.
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Skips JSON whitespace from `i`.
fn skip_space(bytes: &[u8], mut i: usize) -> usize {
    while bytes.get(i).copied().is_some_and(is_space) {
        i += 1;
    }
    i
}

/// The subscription id and event id of an `EVENT` frame, read without a JSON parser and
/// without allocating. The subscription id is read from the frame's first [`SUB_ID_SCAN`]
/// bytes (`["EVENT","<sub>",`; an id with escapes or control characters is not read); the
/// event id is the value of the key `"id"` of the event object (the frame array's object
/// element), 64 lowercase hex digits. The scan follows JSON strings (with their escapes) and
/// nesting, so an `"id"` inside a string or inside a nested object is not taken. `None` when
/// the frame is not an `EVENT` frame or either id cannot be found (the caller then counts "a
/// frame"). Not a validation: only the ids of a well-formed frame are meaningful.
pub(crate) fn scan_event_frame(text: &str) -> Option<(&str, EventId)> {
    let bytes = text.as_bytes();
    let (sub_id, after) = scan_sub_id(bytes)?;
    let id = scan_event_id(bytes, after)?;
    Some((&text[sub_id.0..sub_id.1], id))
}

/// The byte range of the subscription id of `["EVENT","<sub>",`, and the index after its `,`.
fn scan_sub_id(bytes: &[u8]) -> Option<((usize, usize), usize)> {
    let head = &bytes[..bytes.len().min(SUB_ID_SCAN)];
    let mut i = skip_space(head, 0);
    if head.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_space(head, i + 1);
    if !head.get(i..)?.starts_with(b"\"EVENT\"") {
        return None;
    }
    i = skip_space(head, i + 7);
    if head.get(i) != Some(&b',') {
        return None;
    }
    i = skip_space(head, i + 1);
    if head.get(i) != Some(&b'"') {
        return None;
    }
    let start = i + 1;
    let len = head
        .get(start..)?
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
    let end = start + len;
    if head[end] != b'"' {
        return None;
    }
    let i = skip_space(head, end + 1);
    (head.get(i) == Some(&b',')).then_some(((start, end), i + 1))
}

/// The value of the event object's `"id"` key, scanning from `from` (just after the
/// subscription id's comma): the object starts there, and the key must be one of its own
/// (depth one inside it, outside any string).
fn scan_event_id(bytes: &[u8], from: usize) -> Option<EventId> {
    let mut i = skip_space(bytes, from);
    if bytes.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let mut depth = 1usize;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                let start = i + 1;
                let end = string_end(bytes, start)?;
                if depth == 1 && &bytes[start..end] == b"id" {
                    let colon = skip_space(bytes, end + 1);
                    if bytes.get(colon) == Some(&b':') {
                        // A key (a value is never followed by a colon): its value must be
                        // the id, or the event has none worth reading.
                        let v = skip_space(bytes, colon + 1);
                        return hex_id(bytes.get(v..v + 66)?);
                    }
                }
                i = end + 1;
            }
            b'{' | b'[' => {
                depth += 1;
                i += 1;
            }
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return None;
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    None
}

/// The index of the quote ending the JSON string whose content starts at `start`.
fn string_end(bytes: &[u8], start: usize) -> Option<usize> {
    let mut i = start;
    loop {
        match *bytes.get(i)? {
            b'"' => return Some(i),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

/// `"` + 64 lowercase hex digits + `"` as an id.
fn hex_id(quoted: &[u8]) -> Option<EventId> {
    let (&first, rest) = quoted.split_first()?;
    let (&last, hex) = rest.split_last()?;
    if first != b'"' || last != b'"' || hex.len() != 64 {
        return None;
    }
    let mut id = [0u8; 32];
    for (byte, pair) in id.iter_mut().zip(hex.chunks_exact(2)) {
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(EventId::from_byte_array(id))
}

fn digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(c: char) -> String {
        c.to_string().repeat(64)
    }

    #[test]
    fn the_scanner_reads_the_sub_id_and_the_event_id_without_parsing() {
        let a = id('a');
        let frame = format!(
            "[\"EVENT\",\"sub-1\",{{\"id\":\"{a}\",\"kind\":1,\"content\":\"{}\"}}]",
            "x".repeat(5000)
        );
        let (sub, got) = scan_event_frame(&frame).unwrap();
        assert_eq!((sub, got.to_hex()), ("sub-1", a.clone()));

        // Whitespace, and the id after other keys with nested arrays.
        let frame = format!(
            "[ \"EVENT\" , \"s\" , {{ \"kind\": 1, \"tags\": [[\"e\", \"x\"]], \"id\" : \"{a}\" }} ]"
        );
        assert_eq!(scan_event_frame(&frame).unwrap().1.to_hex(), a);
    }

    #[test]
    fn an_id_inside_a_string_or_a_nested_object_is_not_taken() {
        let (a, b) = (id('a'), id('b'));
        // The id's key and value inside the content (quotes escaped), then the real id.
        let frame = format!(
            "[\"EVENT\",\"s\",{{\"content\":\"\\\"id\\\":\\\"{b}\\\" \\\\\",\"id\":\"{a}\"}}]"
        );
        assert_eq!(scan_event_frame(&frame).unwrap().1.to_hex(), a);
        // A key that ends in an escaped quote and `id`.
        let frame = format!("[\"EVENT\",\"s\",{{\"x\\\"id\":\"{b}\",\"id\":\"{a}\"}}]");
        assert_eq!(scan_event_frame(&frame).unwrap().1.to_hex(), a);
        // A nested object's `id`, and a tag value `id`.
        let frame = format!(
            "[\"EVENT\",\"s\",{{\"x\":{{\"id\":\"{b}\"}},\"tags\":[[\"id\",\"{b}\"]],\"id\":\"{a}\"}}]"
        );
        assert_eq!(scan_event_frame(&frame).unwrap().1.to_hex(), a);
        // Only escaped content: no id at all.
        let frame = format!("[\"EVENT\",\"s\",{{\"content\":\"\\\"id\\\":\\\"{b}\\\"\"}}]");
        assert_eq!(scan_event_frame(&frame), None);
    }

    #[test]
    fn frames_without_an_id_or_not_events_give_nothing() {
        let a = id('a');
        for frame in [
            "[\"EVENT\",\"s\",{\"kind\":1,\"content\":\"x\"}]".to_string(),
            format!("[\"EVENT\",\"s\",{{\"id\":\"{}\"}}]", a.to_uppercase()),
            format!("[\"EVENT\",\"s\",{{\"id\":\"{}\"}}]", &a[..63]),
            format!("[\"EVENT\",\"s\",{{\"id\":1,\"x\":\"{a}\"}}]"),
            format!("[\"EVENT\",\"s\",{{\"id\":\"{a}"),
            format!("[\"NOTICE\",\"{{\\\"id\\\":\\\"{a}\\\"}}\"]"),
            format!("[\"EVENT\",\"s\\\"\",{{\"id\":\"{a}\"}}]"),
            format!(
                "[\"EVENT\",\"{}\",{{\"id\":\"{a}\"}}]",
                "s".repeat(SUB_ID_SCAN)
            ),
            format!("[\"EVENT\",{{\"id\":\"{a}\"}}]"),
            format!("[\"EVENT\",\"s\",{{}},{{\"id\":\"{a}\"}}]"),
            "[\"EVENT\",\"s\",{\"content\":\"\\".to_string(),
            String::new(),
        ] {
            assert_eq!(scan_event_frame(&frame), None, "{frame}");
        }
    }
}
