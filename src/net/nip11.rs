//! NIP-11 relay information: the `limitation` object and a small blocking fetch.
//!
//! A relay publishes its limits in the NIP-11 document served on its websocket URL to HTTP
//! requests carrying `Accept: application/nostr+json`. This module has two parts:
//!
//! * a pure part, [`parse_limits`] and [`parse_http_response`], that turns bytes into
//!   [`RelayLimits`] and never panics on anything a peer sends;
//! * [`fetch`], a hand-written HTTP/1.0 `GET` over a plain or rustls socket with one overall
//!   deadline and a byte cap (no HTTP client crate, no async runtime).
//!
//! Parsing is tolerant: a missing `limitation` object gives [`RelayLimits::default`], and a
//! field of the wrong type or with an implausible value (0, negative, above 10⁹) is treated as
//! absent. Only a body that is not a JSON object is an error.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use log::{debug, trace};
use serde_json::Value;

use crate::core::message::escape_for_log;
use crate::net::ws::{connect_tcp_checked, tls_config, AddrCheck, ConnectError};
use crate::shared::Refusal;
use crate::shared::RelayLimits;
use crate::shared::RelayUrl;

/// Largest numeric limit believed; anything above is treated as absent.
const MAX_PLAUSIBLE: u64 = 1_000_000_000;

/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 8 * 1024;

/// Why the NIP-11 document could not be fetched or read.
#[derive(Debug)]
#[non_exhaustive]
pub enum Nip11Error {
    /// The host did not resolve or the TCP connection was refused.
    Connect(String),
    /// A socket or TLS error while sending the request or reading the answer.
    Io(io::Error),
    /// The overall deadline passed (connect, TLS handshake, or waiting for the answer).
    Timeout,
    /// The answer was larger than the byte cap given to [`fetch`].
    TooLarge,
    /// The address policy refused every resolved address (no connection was made).
    Refused(Refusal),
    /// The relay answered with an HTTP status other than 200.
    Status(u16),
    /// The answer was not a well-formed HTTP response or its body not a JSON object.
    Malformed(String),
}

impl fmt::Display for Nip11Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Nip11Error::Connect(e) => write!(f, "cannot connect for NIP-11: {e}"),
            Nip11Error::Io(e) => write!(f, "I/O error while fetching NIP-11: {e}"),
            Nip11Error::Timeout => write!(f, "NIP-11 fetch deadline passed"),
            Nip11Error::TooLarge => write!(f, "NIP-11 answer exceeds the size cap"),
            Nip11Error::Refused(e) => write!(f, "refused by the address policy: {e}"),
            Nip11Error::Status(code) => write!(f, "NIP-11 request answered with HTTP {code}"),
            Nip11Error::Malformed(e) => write!(f, "malformed NIP-11 answer: {e}"),
        }
    }
}

impl std::error::Error for Nip11Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Nip11Error::Io(e) => Some(e),
            _ => None,
        }
    }
}

/// Reads the `limitation` object of a NIP-11 document.
///
/// Tolerant by design: a missing or non-object `limitation` gives all `None`/`false`; a field
/// of the wrong type, or a number that is 0, negative, fractional or above 10⁹, is treated as
/// absent (logged at debug level). A leading UTF-8 byte-order mark is skipped. Only a body that
/// is not a JSON object is an error ([`Nip11Error::Malformed`]).
///
/// ```
/// use grasp_sync::net::nip11::parse_limits;
/// let l = parse_limits(br#"{"limitation":{"max_limit":500,"auth_required":true}}"#).unwrap();
/// assert_eq!(l.max_limit, Some(500));
/// assert!(l.auth_required);
/// assert_eq!(l.page_size(100), 500);
/// assert_eq!(l.subscription_budget(10), 10);
/// ```
pub fn parse_limits(body: &[u8]) -> Result<RelayLimits, Nip11Error> {
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let doc: Value = serde_json::from_slice(body)
        .map_err(|e| Nip11Error::Malformed(format!("body is not JSON: {e}")))?;
    let Value::Object(doc) = doc else {
        return Err(Nip11Error::Malformed(
            "body is JSON but not an object".to_string(),
        ));
    };
    let supports_nip77 = match doc.get("supported_nips") {
        Some(Value::Array(nips)) => Some(
            nips.iter()
                .any(|n| n.as_u64() == Some(77) || n.as_str().is_some_and(|s| s.trim() == "77")),
        ),
        _ => None,
    };
    let nothing = RelayLimits {
        supports_nip77,
        ..RelayLimits::default()
    };
    let limitation = match doc.get("limitation") {
        None | Some(Value::Null) => return Ok(nothing),
        Some(Value::Object(l)) => l,
        Some(other) => {
            debug!(
                "NIP-11: `limitation` is not an object ({}); ignored",
                escape_for_log(&other.to_string(), 120)
            );
            return Ok(nothing);
        }
    };
    Ok(RelayLimits {
        max_subscriptions: count_field(limitation, "max_subscriptions"),
        max_limit: count_field(limitation, "max_limit"),
        default_limit: count_field(limitation, "default_limit"),
        max_message_length: count_field(limitation, "max_message_length"),
        auth_required: bool_field(limitation, "auth_required"),
        restricted_writes: bool_field(limitation, "restricted_writes"),
        supports_nip77,
    })
}

/// A positive integer field in `1..=MAX_PLAUSIBLE`, else `None`.
fn count_field(obj: &serde_json::Map<String, Value>, name: &str) -> Option<usize> {
    let value = obj.get(name)?;
    if value.is_null() {
        return None;
    }
    let n = match value {
        Value::Number(n) => n.as_u64().or_else(|| {
            // Accept integral floats such as `500.0`; reject fractions and negatives.
            n.as_f64()
                .filter(|f| f.is_finite() && f.fract() == 0.0 && *f >= 1.0)
                .filter(|f| *f <= MAX_PLAUSIBLE as f64)
                .map(|f| f as u64)
        }),
        _ => None,
    };
    match n {
        Some(n) if (1..=MAX_PLAUSIBLE).contains(&n) => usize::try_from(n).ok(),
        _ => {
            debug!(
                "NIP-11: limitation.{name} = {} is not a plausible count; ignored",
                escape_for_log(&value.to_string(), 120)
            );
            None
        }
    }
}

/// A boolean field, `false` when absent or of another type.
fn bool_field(obj: &serde_json::Map<String, Value>, name: &str) -> bool {
    match obj.get(name) {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            debug!(
                "NIP-11: limitation.{name} = {} is not a boolean; ignored",
                escape_for_log(&other.to_string(), 120)
            );
            false
        }
    }
}

/// Extracts the body of a complete HTTP/1.x response.
///
/// The status must be 200 (else [`Nip11Error::Status`]); the head ends at the first
/// `\r\n\r\n` (missing → [`Nip11Error::Malformed`]). With `Transfer-Encoding: chunked` the
/// body is de-chunked (tolerantly: a missing final chunk keeps what arrived); otherwise a
/// `Content-Length` truncates the body, and a body shorter than it is malformed. Without
/// either, the body is everything after the head.
pub fn parse_http_response(bytes: &[u8]) -> Result<Vec<u8>, Nip11Error> {
    let head_end = find(bytes, b"\r\n\r\n")
        .ok_or_else(|| Nip11Error::Malformed("no end of HTTP headers".to_string()))?;
    let head = String::from_utf8_lossy(bytes.get(..head_end).unwrap_or_default());
    let body = bytes.get(head_end + 4..).unwrap_or_default();

    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split_ascii_whitespace();
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/") {
        return Err(Nip11Error::Malformed(format!(
            "not an HTTP status line: {:?}",
            truncate_for_log(status_line)
        )));
    }
    let code = parts
        .next()
        .filter(|c| c.len() == 3)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| {
            Nip11Error::Malformed(format!(
                "no status code in {:?}",
                truncate_for_log(status_line)
            ))
        })?;
    if code != 200 {
        return Err(Nip11Error::Status(code));
    }

    let mut content_length: Option<usize> = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            trace!("NIP-11: ignoring header line without colon");
            continue;
        };
        let name = name.trim();
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            match value.parse::<usize>() {
                Ok(n) if content_length.is_none() => content_length = Some(n),
                Ok(_) => {}
                Err(_) => debug!(
                    "NIP-11: ignoring bad Content-Length {}",
                    escape_for_log(value, 60)
                ),
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            && value
                .split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("chunked"))
        {
            chunked = true;
        }
    }

    if chunked {
        return decode_chunked(body);
    }
    match content_length {
        Some(n) => match body.get(..n) {
            Some(b) => Ok(b.to_vec()),
            None => Err(Nip11Error::Malformed(format!(
                "body has {} bytes, Content-Length says {n}",
                body.len()
            ))),
        },
        None => Ok(body.to_vec()),
    }
}

/// Decodes a `Transfer-Encoding: chunked` body.
///
/// Tolerant: chunk-size lines may end in a bare `\n` and carry extensions (`;...`); trailers
/// after the last chunk are ignored; a body cut short (no final `0` chunk, or a chunk shorter
/// than announced) keeps what arrived. A size line that is not hexadecimal is malformed.
fn decode_chunked(mut rest: &[u8]) -> Result<Vec<u8>, Nip11Error> {
    let mut out = Vec::new();
    loop {
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            if !rest.iter().all(u8::is_ascii_whitespace) {
                debug!("NIP-11: chunked body ends inside a size line; keeping what arrived");
            }
            return Ok(out);
        };
        let line = String::from_utf8_lossy(rest.get(..nl).unwrap_or_default());
        rest = rest.get(nl + 1..).unwrap_or_default();
        let size_text = line.split(';').next().unwrap_or_default().trim();
        if size_text.is_empty() {
            // A stray blank line between chunks.
            continue;
        }
        let size = usize::from_str_radix(size_text, 16).map_err(|_| {
            Nip11Error::Malformed(format!("bad chunk size {:?}", truncate_for_log(size_text)))
        })?;
        if size == 0 {
            return Ok(out);
        }
        match rest.get(..size) {
            Some(data) => {
                out.extend_from_slice(data);
                rest = rest.get(size..).unwrap_or_default();
            }
            None => {
                debug!("NIP-11: chunked body cut short; keeping what arrived");
                out.extend_from_slice(rest);
                return Ok(out);
            }
        }
        rest = rest
            .strip_prefix(b"\r\n")
            .or_else(|| rest.strip_prefix(b"\n"))
            .unwrap_or(rest);
    }
}

/// Fetches `url`'s NIP-11 document and returns its limits.
///
/// Connects with `net::ws::connect_tcp_checked`, wraps the socket in rustls for `wss://`, sends an HTTP/1.0
/// `GET` for the URL's path (or `/`) with `Accept: application/nostr+json` and reads the answer
/// until the server closes, the `Content-Length` is complete, or more than `max_bytes` arrived
/// ([`Nip11Error::TooLarge`]). Everything — connect, TLS handshake, request and answer — shares
/// the one `timeout`; running out of it gives [`Nip11Error::Timeout`] (a TCP connect that times
/// out included). The answer is then read by [`parse_http_response`] and [`parse_limits`].
pub fn fetch(
    url: &RelayUrl,
    timeout: Duration,
    max_bytes: usize,
) -> Result<RelayLimits, Nip11Error> {
    fetch_checked(url, timeout, max_bytes, &tls_config(), &|_| Ok(()))
}

/// [`fetch`] with every resolved address checked right before the TCP connect
/// (`net::ws::connect_tcp_checked`); [`Nip11Error::Refused`] when none passes.
pub fn fetch_checked(
    url: &RelayUrl,
    timeout: Duration,
    max_bytes: usize,
    tls: &std::sync::Arc<rustls::ClientConfig>,
    check: AddrCheck<'_>,
) -> Result<RelayLimits, Nip11Error> {
    let started = Instant::now();
    let deadline = started + timeout;
    let tcp = connect_tcp_checked(url, timeout, check).map_err(|e| match e {
        ConnectError::Tcp(io) if is_timeout(&io) => Nip11Error::Timeout,
        ConnectError::Timeout => Nip11Error::Timeout,
        ConnectError::Refused(r) => Nip11Error::Refused(r),
        other => Nip11Error::Connect(other.to_string()),
    })?;
    let _ = tcp.set_nodelay(true);
    set_timeouts(&tcp, deadline)?;

    let mut stream = if url.is_tls() {
        let name = rustls::pki_types::ServerName::try_from(url.host_for_resolve().to_string())
            .map_err(|e| Nip11Error::Connect(format!("invalid TLS server name: {e}")))?;
        let conn = rustls::ClientConnection::new(tls.clone(), name)
            .map_err(|e| Nip11Error::Connect(format!("TLS setup failed: {e}")))?;
        Stream::Tls(Box::new(rustls::StreamOwned::new(conn, tcp)))
    } else {
        Stream::Plain(tcp)
    };

    let request = build_request(url);
    trace!("NIP-11: GET {} from {url}", request_target(url));
    stream
        .write_all(request.as_bytes())
        .and_then(|()| stream.flush())
        .map_err(|e| io_error(e, deadline))?;

    let response = read_response(&mut stream, deadline, max_bytes)?;
    debug!(
        "NIP-11: {url} answered {} bytes in {:?}",
        response.len(),
        started.elapsed()
    );
    let body = parse_http_response(&response)?;
    parse_limits(&body)
}

/// Reads until EOF, a complete `Content-Length` body, the byte cap or the deadline.
fn read_response(
    stream: &mut Stream,
    deadline: Instant,
    max_bytes: usize,
) -> Result<Vec<u8>, Nip11Error> {
    let mut buf: Vec<u8> = Vec::with_capacity(READ_CHUNK.min(max_bytes.saturating_add(1)));
    let mut chunk = vec![0u8; READ_CHUNK];
    loop {
        set_timeouts(stream.tcp(), deadline)?;
        // Read at most one byte past the cap: enough to know it was exceeded.
        let want = READ_CHUNK.min(max_bytes.saturating_add(1).saturating_sub(buf.len()).max(1));
        let Some(into) = chunk.get_mut(..want) else {
            return Err(Nip11Error::TooLarge);
        };
        match stream.read(into) {
            Ok(0) => return Ok(buf),
            Ok(n) => {
                buf.extend_from_slice(into.get(..n).unwrap_or_default());
                if buf.len() > max_bytes {
                    return Err(Nip11Error::TooLarge);
                }
                if response_complete(&buf) {
                    return Ok(buf);
                }
                if Instant::now() >= deadline {
                    return Err(Nip11Error::Timeout);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // TLS peers often close without close_notify: what arrived is the answer.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof && !buf.is_empty() => {
                return Ok(buf)
            }
            Err(e) => return Err(io_error(e, deadline)),
        }
    }
}

/// True once the head is complete and a `Content-Length` body has fully arrived, so a server
/// that ignores `Connection: close` need not be waited for.
fn response_complete(buf: &[u8]) -> bool {
    let Some(head_end) = find(buf, b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(buf.get(..head_end).unwrap_or_default());
    let mut content_length = None;
    for line in head.split("\r\n").skip(1) {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            return false;
        }
        if name.eq_ignore_ascii_case("content-length") && content_length.is_none() {
            content_length = value.trim().parse::<usize>().ok();
        }
    }
    match content_length {
        Some(n) => buf.len().saturating_sub(head_end + 4) >= n,
        None => false,
    }
}

/// The request line's target: the URL's path and query, or `/`.
fn request_target(url: &RelayUrl) -> String {
    let text = url.as_str();
    let after_scheme = text
        .find("://")
        .map_or(text, |i| text.get(i + 3..).unwrap_or(""));
    let path = after_scheme
        .find(['/', '?'])
        .and_then(|i| after_scheme.get(i..))
        .unwrap_or("");
    if path.is_empty() {
        "/".to_string()
    } else if path.starts_with('/') {
        path.to_string()
    } else {
        format!("/{path}")
    }
}

/// The complete HTTP/1.0 request for `url`'s NIP-11 document.
fn build_request(url: &RelayUrl) -> String {
    let default_port = if url.is_tls() { 443 } else { 80 };
    let host = if url.port() == default_port {
        url.host().to_string()
    } else {
        format!("{}:{}", url.host(), url.port())
    };
    format!(
        "GET {} HTTP/1.0\r\n\
         Host: {host}\r\n\
         Accept: application/nostr+json\r\n\
         User-Agent: grasp-sync\r\n\
         Connection: close\r\n\
         \r\n",
        request_target(url)
    )
}

/// A plain or TLS socket.
enum Stream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

/// Sets the socket's read and write timeouts to the time left before `deadline`.
fn set_timeouts(tcp: &TcpStream, deadline: Instant) -> Result<(), Nip11Error> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Nip11Error::Timeout);
    }
    // A zero timeout is refused by the OS API; `left` is non-zero here but may round down.
    let left = left.max(Duration::from_millis(1));
    tcp.set_read_timeout(Some(left)).map_err(Nip11Error::Io)?;
    tcp.set_write_timeout(Some(left)).map_err(Nip11Error::Io)?;
    Ok(())
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Maps a socket error: a timeout (or any error after the deadline) is [`Nip11Error::Timeout`].
fn io_error(e: io::Error, deadline: Instant) -> Nip11Error {
    if is_timeout(&e) || Instant::now() >= deadline {
        Nip11Error::Timeout
    } else {
        Nip11Error::Io(e)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// At most 80 characters of peer-supplied text, for error messages.
fn truncate_for_log(s: &str) -> String {
    s.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(json: &str) -> RelayLimits {
        parse_limits(json.as_bytes()).unwrap()
    }

    #[test]
    fn parses_full_limitation() {
        let l = limits(
            r#"{"name":"r","limitation":{"max_subscriptions":20,"max_limit":500,
                "default_limit":100,"max_message_length":131072,
                "auth_required":true,"restricted_writes":true,"max_filters":10}}"#,
        );
        assert_eq!(
            l,
            RelayLimits {
                max_subscriptions: Some(20),
                max_limit: Some(500),
                default_limit: Some(100),
                max_message_length: Some(131072),
                auth_required: true,
                restricted_writes: true,
                supports_nip77: None,
            }
        );
    }

    #[test]
    fn reads_nip77_from_supported_nips() {
        let yes = limits(r#"{"supported_nips":[1,11,"77"],"limitation":{"max_limit":5}}"#);
        assert_eq!(yes.supports_nip77, Some(true));
        assert_eq!(yes.max_limit, Some(5));
        assert_eq!(
            limits(r#"{"supported_nips":[1,77]}"#).supports_nip77,
            Some(true)
        );
        assert_eq!(
            limits(r#"{"supported_nips":[1,11,42]}"#).supports_nip77,
            Some(false)
        );
        assert_eq!(limits(r#"{"supported_nips":"77"}"#).supports_nip77, None);
        assert_eq!(limits(r#"{"name":"x"}"#).supports_nip77, None);
    }

    #[test]
    fn parses_partial_and_missing() {
        let l = limits(r#"{"limitation":{"max_limit":5000}}"#);
        assert_eq!(l.max_limit, Some(5000));
        assert_eq!(l.max_subscriptions, None);
        assert_eq!(l.default_limit, None);
        assert!(!l.auth_required);
        assert_eq!(limits(r#"{"name":"x"}"#), RelayLimits::default());
        assert_eq!(limits("{}"), RelayLimits::default());
        assert_eq!(limits(r#"{"limitation":null}"#), RelayLimits::default());
        assert_eq!(limits(r#"{"limitation":[1,2]}"#), RelayLimits::default());
        assert_eq!(limits(r#"{"limitation":"none"}"#), RelayLimits::default());
        assert_eq!(limits(r#"{"limitation":{}}"#), RelayLimits::default());
    }

    #[test]
    fn wrong_types_are_absent() {
        let l = limits(
            r#"{"limitation":{"max_subscriptions":"20","max_limit":null,"default_limit":[1],
                "max_message_length":{"a":1},"auth_required":"yes","restricted_writes":1}}"#,
        );
        assert_eq!(l, RelayLimits::default());
        // Other fields survive a bad neighbour.
        let l = limits(r#"{"limitation":{"max_subscriptions":"20","max_limit":300}}"#);
        assert_eq!(l.max_subscriptions, None);
        assert_eq!(l.max_limit, Some(300));
    }

    #[test]
    fn implausible_numbers_are_absent() {
        let l = limits(
            r#"{"limitation":{"max_subscriptions":-1,"max_limit":0,"default_limit":1.5,
                "max_message_length":1000000001}}"#,
        );
        assert_eq!(l, RelayLimits::default());
        let l = limits(
            r#"{"limitation":{"max_subscriptions":1e300,"max_limit":18446744073709551615,
                "default_limit":-0.0,"max_message_length":-99999999999999999999}}"#,
        );
        assert_eq!(l, RelayLimits::default());
        // Boundaries and integral floats are accepted.
        let l = limits(
            r#"{"limitation":{"max_subscriptions":1,"max_limit":1000000000,"default_limit":500.0}}"#,
        );
        assert_eq!(l.max_subscriptions, Some(1));
        assert_eq!(l.max_limit, Some(1_000_000_000));
        assert_eq!(l.default_limit, Some(500));
    }

    #[test]
    fn garbage_is_an_error() {
        for body in [
            &b""[..],
            b"not json",
            b"<html>hi</html>",
            b"{\"limitation\":",
            b"\xff\xfe\x00",
            b"[1,2,3]",
            b"42",
            b"\"str\"",
            b"null",
        ] {
            assert!(
                matches!(parse_limits(body), Err(Nip11Error::Malformed(_))),
                "{body:?}"
            );
        }
        // A byte-order mark is tolerated.
        assert_eq!(
            parse_limits(b"\xEF\xBB\xBF{\"limitation\":{\"max_limit\":7}}")
                .unwrap()
                .max_limit,
            Some(7)
        );
    }

    #[test]
    fn page_size_and_budget_fallbacks() {
        let none = RelayLimits::default();
        assert_eq!(none.page_size(250), 250);
        assert_eq!(none.subscription_budget(10), 10);
        let default_only = RelayLimits {
            default_limit: Some(100),
            ..RelayLimits::default()
        };
        assert_eq!(default_only.page_size(250), 100);
        let both = RelayLimits {
            max_limit: Some(500),
            default_limit: Some(100),
            max_subscriptions: Some(3),
            ..RelayLimits::default()
        };
        assert_eq!(both.page_size(250), 500);
        assert_eq!(both.subscription_budget(10), 3);
    }

    #[test]
    fn chunked_decoder() {
        assert_eq!(
            decode_chunked(b"4\r\nWiki\r\n5\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\n\r\n")
                .unwrap(),
            b"Wikipedia in\r\n\r\nchunks."
        );
        // Extensions, bare LF, upper-case hex, trailers.
        assert_eq!(
            decode_chunked(b"3;ext=1\nabc\nA\r\n0123456789\r\n0\r\nX-Trailer: y\r\n\r\n").unwrap(),
            b"abc0123456789"
        );
        // Missing final chunk, truncated chunk, empty body: keep what arrived.
        assert_eq!(decode_chunked(b"3\r\nabc\r\n").unwrap(), b"abc");
        assert_eq!(decode_chunked(b"3\r\nabc\r\n10\r\nxy").unwrap(), b"abcxy");
        assert_eq!(decode_chunked(b"").unwrap(), b"");
        assert_eq!(decode_chunked(b"3\r\nabc\r\n2").unwrap(), b"abc");
        // Garbage and overflowing sizes are errors, never panics.
        assert!(matches!(
            decode_chunked(b"zz\r\nabc\r\n0\r\n\r\n"),
            Err(Nip11Error::Malformed(_))
        ));
        assert!(matches!(
            decode_chunked(b"ffffffffffffffffffffffff\r\nabc"),
            Err(Nip11Error::Malformed(_))
        ));
        assert_eq!(decode_chunked(b"ffffffffffffffff\r\nabc").unwrap(), b"abc");
    }

    #[test]
    fn http_200_with_content_length() {
        let r = b"HTTP/1.1 200 OK\r\nContent-Type: application/nostr+json\r\ncontent-length: 2\r\n\r\n{}trailing junk";
        assert_eq!(parse_http_response(r).unwrap(), b"{}");
        let r = b"HTTP/1.0 200 OK\r\n\r\n{\"a\":1}";
        assert_eq!(parse_http_response(r).unwrap(), b"{\"a\":1}");
        // Bad Content-Length is ignored; a short body is malformed.
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n{}";
        assert_eq!(parse_http_response(r).unwrap(), b"{}");
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}";
        assert!(matches!(
            parse_http_response(r),
            Err(Nip11Error::Malformed(_))
        ));
        // Header lines without a colon are skipped.
        let r = b"HTTP/1.1 200 OK\r\nweird\r\n\r\n{}";
        assert_eq!(parse_http_response(r).unwrap(), b"{}");
    }

    #[test]
    fn http_status_and_malformed() {
        let r = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
        assert!(matches!(
            parse_http_response(r),
            Err(Nip11Error::Status(404))
        ));
        let r = b"HTTP/1.1 301 Moved\r\nLocation: x\r\n\r\n";
        assert!(matches!(
            parse_http_response(r),
            Err(Nip11Error::Status(301))
        ));
        for r in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n{}"[..],
            b"",
            b"\r\n\r\n",
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"HTTP/1.1\r\n\r\n",
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
        ] {
            assert!(
                matches!(parse_http_response(r), Err(Nip11Error::Malformed(_))),
                "{r:?}"
            );
        }
    }

    #[test]
    fn http_chunked() {
        let r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, Chunked\r\nContent-Length: 3\r\n\r\n\
                  5\r\n{\"lim\r\nF\r\nitation\":{\"max_\r\nA\r\nlimit\":9}}\r\n0\r\n\r\n";
        let body = parse_http_response(r).unwrap();
        assert_eq!(body, br#"{"limitation":{"max_limit":9}}"#);
        assert_eq!(parse_limits(&body).unwrap().max_limit, Some(9));
    }

    #[test]
    fn completeness_detection() {
        assert!(!response_complete(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
        ));
        assert!(!response_complete(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{"
        ));
        assert!(response_complete(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
        ));
        assert!(!response_complete(b"HTTP/1.1 200 OK\r\n\r\n{}"));
        assert!(!response_complete(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n"
        ));
    }

    #[test]
    fn request_format() {
        let u = RelayUrl::parse("wss://relay.example.com/").unwrap();
        assert_eq!(
            build_request(&u),
            "GET / HTTP/1.0\r\nHost: relay.example.com\r\nAccept: application/nostr+json\r\n\
             User-Agent: grasp-sync\r\nConnection: close\r\n\r\n"
        );
        let u = RelayUrl::parse("ws://127.0.0.1:7777/nostr/x?a=1").unwrap();
        let r = build_request(&u);
        assert!(
            r.starts_with("GET /nostr/x?a=1 HTTP/1.0\r\nHost: 127.0.0.1:7777\r\n"),
            "{r}"
        );
        let u = RelayUrl::parse("wss://r.example/?x=1").unwrap();
        assert_eq!(request_target(&u), "/?x=1");
        let u = RelayUrl::parse("ws://[::1]:9").unwrap();
        assert!(build_request(&u).contains("\r\nHost: [::1]:9\r\n"));
        let u = RelayUrl::parse("ws://r.example:443").unwrap();
        assert!(build_request(&u).contains("\r\nHost: r.example:443\r\n"));
    }

    #[test]
    fn errors_display_what_went_wrong() {
        assert!(Nip11Error::Status(503).to_string().contains("503"));
        assert!(Nip11Error::TooLarge.to_string().contains("size"));
        assert!(Nip11Error::Timeout.to_string().contains("deadline"));
        let io = Nip11Error::Io(io::Error::other("boom"));
        assert!(io.to_string().contains("boom"));
        assert!(std::error::Error::source(&io).is_some());
    }
}
