//! Minimal HTTP/1.1 handling for the test relay: request-head parsing, the
//! websocket upgrade answer and NIP-11 relay information documents.
//!
//! Only what a relay needs on its websocket port is implemented: a single
//! request per TCP connection, no bodies, no chunked encoding.

/// Largest accepted request head (request line plus headers), in bytes.
pub(crate) const MAX_HEAD_BYTES: usize = 16 * 1024;

/// Media type of a NIP-11 relay information document.
pub(crate) const NOSTR_JSON: &str = "application/nostr+json";

/// A parsed HTTP request head.
#[derive(Debug, Clone)]
pub(crate) struct RequestHead {
    /// Request method, e.g. `GET`.
    pub(crate) method: String,
    /// Request target, e.g. `/`.
    pub(crate) target: String,
    /// Headers in arrival order; names keep their original case.
    headers: Vec<(String, String)>,
}

impl RequestHead {
    /// First value of header `name` (case-insensitive).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether any value of header `name` contains the comma-separated token
    /// `token` (both compared case-insensitively).
    fn header_has_token(&self, name: &str, token: &str) -> bool {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .flat_map(|(_, v)| v.split(','))
            .any(|t| {
                let t = t.trim();
                // `Accept` values may carry parameters: `application/nostr+json; q=1`.
                let t = t.split(';').next().unwrap_or("").trim();
                t.eq_ignore_ascii_case(token)
            })
    }

    /// The `Sec-WebSocket-Key` of a websocket upgrade request, if this is one.
    pub(crate) fn websocket_key(&self) -> Option<&str> {
        if !self.method.eq_ignore_ascii_case("GET")
            || !self.header_has_token("Upgrade", "websocket")
        {
            return None;
        }
        self.header("Sec-WebSocket-Key")
            .map(str::trim)
            .filter(|k| !k.is_empty())
    }

    /// Whether the request asks for a NIP-11 document (`Accept: application/nostr+json`).
    pub(crate) fn wants_nip11(&self) -> bool {
        self.header_has_token("Accept", NOSTR_JSON)
    }
}

/// Position just past the `\r\n\r\n` that ends the request head in `buf`.
pub(crate) fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

/// Parses a request head (everything up to and including `\r\n\r\n`).
///
/// Returns `None` for anything that is not a plausible HTTP/1.x request.
pub(crate) fn parse_head(head: &[u8]) -> Option<RequestHead> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let request_line = lines.next()?;
    let mut parts = request_line.split_ascii_whitespace();
    let method = parts.next()?.to_string();
    let target = parts.next()?.to_string();
    let version = parts.next()?;
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return None;
    }
    // Like real servers (nostr-rs-relay answers 400): a request target must be origin-form.
    if !target.starts_with('/') {
        return None;
    }
    let mut headers = Vec::new();
    for line in lines {
        if line.is_empty() {
            continue;
        }
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_string(), value.trim().to_string()));
    }
    Some(RequestHead {
        method,
        target,
        headers,
    })
}

/// The `101 Switching Protocols` answer to a websocket upgrade with key `key`.
pub(crate) fn switching_protocols(key: &str) -> Vec<u8> {
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    format!(
        "HTTP/1.1 101 Switching Protocols\r\n\
         Connection: Upgrade\r\n\
         Upgrade: websocket\r\n\
         Sec-WebSocket-Accept: {accept}\r\n\
         \r\n"
    )
    .into_bytes()
}

/// A `200 OK` carrying the NIP-11 document `doc`.
pub(crate) fn nip11_document(doc: &serde_json::Value) -> Vec<u8> {
    let body = doc.to_string();
    format!(
        "HTTP/1.1 200 OK\r\n\
         Content-Type: {NOSTR_JSON}\r\n\
         Access-Control-Allow-Origin: *\r\n\
         Access-Control-Allow-Headers: *\r\n\
         Access-Control-Allow-Methods: GET\r\n\
         Content-Length: {}\r\n\
         Connection: close\r\n\
         \r\n\
         {body}",
        body.len()
    )
    .into_bytes()
}

/// A plain-text error answer with status `code` and reason `reason`.
pub(crate) fn error_response(code: u16, reason: &str) -> Vec<u8> {
    let body = format!("{code} {reason}\n");
    format!(
        "HTTP/1.1 {code} {reason}\r\n\
         Content-Type: text/plain\r\n\
         Content-Length: {}\r\n\
         Connection: close\r\n\
         \r\n\
         {body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_upgrade() {
        let raw = b"GET / HTTP/1.1\r\nHost: x\r\nupgrade: WebSocket\r\nConnection: Upgrade\r\n\
                    Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";
        let end = find_head_end(raw).unwrap();
        assert_eq!(end, raw.len());
        let head = parse_head(&raw[..end]).unwrap();
        assert_eq!(head.websocket_key(), Some("dGhlIHNhbXBsZSBub25jZQ=="));
        assert!(!head.wants_nip11());
        let resp = String::from_utf8(switching_protocols("dGhlIHNhbXBsZSBub25jZQ==")).unwrap();
        assert!(resp.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="));
    }

    #[test]
    fn parses_nip11_accept() {
        let raw = b"GET / HTTP/1.1\r\nAccept: text/html, application/nostr+json;q=0.9\r\n\r\n";
        let head = parse_head(raw).unwrap();
        assert!(head.wants_nip11());
        assert_eq!(head.websocket_key(), None);
        assert_eq!(head.target, "/");
    }

    #[test]
    fn rejects_garbage() {
        assert!(parse_head(b"hello\r\n\r\n").is_none());
        assert!(parse_head(b"GET / SMTP\r\n\r\n").is_none());
        assert!(parse_head(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n").is_none());
    }
}
