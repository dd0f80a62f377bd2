//! Relay URL parsing and normalisation.
//!
//! One relay is often written several ways (`wss://Relay.Example.com/`, `wss://relay.example.com:443`).
//! [`RelayUrl::parse`] maps all of them onto one canonical string so that the indexes hold one
//! entry per relay:
//!
//! * only `ws` and `wss` schemes are accepted (case-insensitive, stored lower-case);
//! * the host is lower-cased; IPv6 literals keep their brackets;
//! * the default port (80 for `ws`, 443 for `wss`) is dropped;
//! * a trailing `/` is dropped (`wss://r.example/` and `wss://r.example` are one relay),
//!   except before a query: `wss://r.example?x=1` and `wss://r.example/?x=1` both become
//!   `wss://r.example/?x=1`, because a request target must start with `/` (every accepted URL
//!   stays connectable);
//! * user-info, whitespace inside the URL, and fragments are rejected or dropped as documented
//!   on [`UrlError`].

use std::fmt;

/// A normalised `ws://` or `wss://` relay URL.
///
/// Two `RelayUrl`s are equal exactly when they name the same relay endpoint after
/// normalisation, so the type is used as the key of every per-relay index.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RelayUrl {
    text: String,
    tls: bool,
    host: String,
    port: u16,
}

/// Why a relay URL was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UrlError {
    /// The URL is empty after trimming whitespace.
    Empty,
    /// The scheme is not `ws` or `wss` (for example `https://` or no scheme at all).
    Scheme(String),
    /// There is no host between `//` and the path.
    MissingHost,
    /// The URL contains user-info (`user@host`), which relays never use.
    UserInfo,
    /// The port is not a number between 1 and 65535.
    Port(String),
    /// The URL contains whitespace or control characters.
    InvalidCharacter,
    /// The host is neither a name of letters, digits, `-`, `.` and `_` nor a bracketed IPv6
    /// literal of hex digits, `:` and `.` (found by fuzzing: a `:` in the host made the
    /// normalised text parse differently).
    Host(String),
}

impl fmt::Display for UrlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UrlError::Empty => write!(f, "the relay URL is empty"),
            UrlError::Scheme(s) => write!(
                f,
                "unsupported scheme {s:?}: a relay URL starts with ws:// or wss://"
            ),
            UrlError::MissingHost => write!(f, "the relay URL has no host"),
            UrlError::UserInfo => write!(f, "the relay URL must not contain user@ credentials"),
            UrlError::Port(p) => write!(f, "invalid port {p:?}: expected a number from 1 to 65535"),
            UrlError::InvalidCharacter => {
                write!(f, "the relay URL contains whitespace or control characters")
            }
            UrlError::Host(h) => write!(f, "invalid host {h:?}"),
        }
    }
}

impl std::error::Error for UrlError {}

impl RelayUrl {
    /// Parses and normalises a relay URL.
    ///
    /// ```
    /// use grasp_sync::RelayUrl;
    /// let a = RelayUrl::parse("WSS://Relay.Example.com:443/").unwrap();
    /// let b = RelayUrl::parse("wss://relay.example.com").unwrap();
    /// assert_eq!(a, b);
    /// assert_eq!(a.as_str(), "wss://relay.example.com");
    /// ```
    pub fn parse(input: &str) -> Result<RelayUrl, UrlError> {
        let s = input.trim();
        if s.is_empty() {
            return Err(UrlError::Empty);
        }
        if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(UrlError::InvalidCharacter);
        }
        let (scheme, rest) = match s.find("://") {
            Some(i) => (&s[..i], &s[i + 3..]),
            None => return Err(UrlError::Scheme(String::new())),
        };
        let scheme = scheme.to_ascii_lowercase();
        let tls = match scheme.as_str() {
            "ws" => false,
            "wss" => true,
            _ => return Err(UrlError::Scheme(scheme)),
        };
        // Drop the fragment; it never reaches the server.
        let rest = rest.split('#').next().unwrap_or("");
        let split_at = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, path_and_query) = rest.split_at(split_at);
        if authority.contains('@') {
            return Err(UrlError::UserInfo);
        }
        let (host, port_text) = if let Some(stripped) = authority.strip_prefix('[') {
            let end = stripped.find(']').ok_or(UrlError::MissingHost)?;
            let host = &authority[..end + 2];
            let after = &stripped[end + 1..];
            let port = match after.strip_prefix(':') {
                Some(p) => Some(p),
                None if after.is_empty() => None,
                None => return Err(UrlError::Port(after.to_string())),
            };
            (host.to_ascii_lowercase(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_ascii_lowercase(), Some(p)),
                None => (authority.to_ascii_lowercase(), None),
            }
        };
        if host.is_empty() || host == "[]" {
            return Err(UrlError::MissingHost);
        }
        if !valid_host(&host) {
            return Err(UrlError::Host(host));
        }
        let default_port = if tls { 443 } else { 80 };
        let port = match port_text {
            None | Some("") => default_port,
            Some(p) => match p.parse::<u16>() {
                Ok(n) if n > 0 => n,
                _ => return Err(UrlError::Port(p.to_string())),
            },
        };
        // The path as it goes on the request line. A query needs a path before it: an HTTP
        // request target is `/?k=v`, never `?k=v` (nostr-rs-relay answers that with 400), so
        // an empty path before a query becomes `/`, and a root path `/` is kept there.
        let path = match path_and_query.find('?') {
            Some(q) => {
                let (p, query) = path_and_query.split_at(q);
                let p = p.trim_end_matches('/');
                let p = if p.is_empty() { "/" } else { p };
                format!("{p}{query}")
            }
            None => path_and_query.trim_end_matches('/').to_string(),
        };
        // Non-ASCII in the path or query is percent-encoded (as a request target must be),
        // so a URL carries no bidirectional or zero-width characters into a log line
        // (issue 20, item 7); control characters and whitespace were refused above.
        let path = if path.is_ascii() {
            path
        } else {
            let mut encoded = String::with_capacity(path.len() * 3);
            for b in path.bytes() {
                if b.is_ascii() {
                    encoded.push(b as char);
                } else {
                    encoded.push_str(&format!("%{b:02X}"));
                }
            }
            encoded
        };
        let mut text = format!("{scheme}://{host}");
        if port != default_port {
            text.push_str(&format!(":{port}"));
        }
        text.push_str(&path);
        Ok(RelayUrl {
            text,
            tls,
            host,
            port,
        })
    }

    /// The canonical text of the URL.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// True for `wss://`.
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// The host (lower-case; IPv6 literals with brackets).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The host as it must be resolved: IPv6 literals without brackets.
    pub fn host_for_resolve(&self) -> &str {
        self.host.trim_start_matches('[').trim_end_matches(']')
    }

    /// The port, with the scheme's default filled in.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of the relay's NIP-11 information document (`http(s)://` with the same host,
    /// port and path).
    pub fn http_url(&self) -> String {
        let rest = &self.text[if self.tls { 6 } else { 5 }..];
        format!("{}://{}", if self.tls { "https" } else { "http" }, rest)
    }
}

/// A lower-cased host: a name (letters, digits, `-`, `.`, `_`) or `[IPv6]`.
fn valid_host(host: &str) -> bool {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.'),
        None => host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_')),
    }
}

impl fmt::Display for RelayUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for RelayUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RelayUrl({})", self.text)
    }
}

impl std::str::FromStr for RelayUrl {
    type Err = UrlError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RelayUrl::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_ascii_in_the_path_is_percent_encoded_so_logs_hold_no_format_characters() {
        // U+202E (right-to-left override) and U+200B (zero width space) in path and query.
        let u = RelayUrl::parse("wss://relay.example/p\u{202e}x?q=\u{200b}").unwrap();
        assert!(u.as_str().is_ascii(), "{}", u.as_str());
        assert_eq!(u.as_str(), "wss://relay.example/p%E2%80%AEx?q=%E2%80%8B");
        // Idempotent: the encoded form parses to itself.
        assert_eq!(RelayUrl::parse(u.as_str()).unwrap(), u);
        // A non-ASCII host is refused, not encoded.
        assert!(RelayUrl::parse("wss://re\u{202e}lay.example").is_err());
    }

    fn n(s: &str) -> String {
        RelayUrl::parse(s).unwrap().as_str().to_string()
    }

    #[test]
    fn normalises_case_port_and_slash() {
        assert_eq!(n("WSS://Relay.Example.COM:443/"), "wss://relay.example.com");
        assert_eq!(n("ws://relay.example.com:80"), "ws://relay.example.com");
        assert_eq!(
            n("ws://relay.example.com:443"),
            "ws://relay.example.com:443"
        );
        assert_eq!(
            n("wss://relay.example.com:80/"),
            "wss://relay.example.com:80"
        );
        assert_eq!(n("  wss://r.example/nostr/  "), "wss://r.example/nostr");
        assert_eq!(n("wss://r.example/Path"), "wss://r.example/Path");
        assert_eq!(n("wss://r.example/?x=1"), "wss://r.example/?x=1");
        assert_eq!(n("wss://r.example?x=1"), "wss://r.example/?x=1");
        assert_eq!(n("wss://r.example//?x=1"), "wss://r.example/?x=1");
        assert_eq!(n("wss://r.example/p/?x=1"), "wss://r.example/p?x=1");
        assert_eq!(n("ws://127.0.0.1:7777/?n=1"), "ws://127.0.0.1:7777/?n=1");
        assert_eq!(n("wss://r.example#frag"), "wss://r.example");
        assert_eq!(n("ws://127.0.0.1:7777/"), "ws://127.0.0.1:7777");
        assert_eq!(n("ws://[::1]:7777"), "ws://[::1]:7777");
        assert_eq!(n("ws://[::1]"), "ws://[::1]");
    }

    /// Every accepted URL keeps a request target that starts with `/` (or is empty, which
    /// the websocket client sends as `/`), so normalisation never makes a relay unreachable.
    #[test]
    fn normalised_urls_keep_an_origin_form_request_target() {
        for s in [
            "ws://h:1?n=1",
            "ws://h:1/?n=1",
            "ws://h:1//?n=1",
            "ws://h:1/a/?n=1",
            "ws://[::1]:1?n=1",
            "wss://h?",
            "wss://h/#f?x",
        ] {
            let u = RelayUrl::parse(s).unwrap();
            let rest = &u.as_str()[u.as_str().find("://").unwrap() + 3..];
            let target = &rest[rest.find(['/', '?']).unwrap_or(rest.len())..];
            assert!(
                target.is_empty() || target.starts_with('/'),
                "{s} -> {u} has request target {target:?}"
            );
            // Normalising again changes nothing.
            assert_eq!(RelayUrl::parse(u.as_str()).unwrap(), u);
            let req =
                tungstenite::client::IntoClientRequest::into_client_request(u.as_str()).unwrap();
            let pq = req.uri().path_and_query().map(|p| p.as_str().to_string());
            assert!(
                pq.as_deref().is_none_or(|p| p.starts_with('/')),
                "{s}: {pq:?}"
            );
        }
    }

    #[test]
    fn one_relay_written_two_ways_is_one_key() {
        let a = RelayUrl::parse("wss://Nos.Lol/").unwrap();
        let b = RelayUrl::parse("wss://nos.lol:443").unwrap();
        assert_eq!(a, b);
        let mut set = std::collections::HashSet::new();
        set.insert(a);
        set.insert(b);
        assert_eq!(set.len(), 1);
    }

    #[test]
    fn accessors() {
        let u = RelayUrl::parse("wss://r.example:8443/x").unwrap();
        assert!(u.is_tls());
        assert_eq!(u.host(), "r.example");
        assert_eq!(u.port(), 8443);
        assert_eq!(u.http_url(), "https://r.example:8443/x");
        let v = RelayUrl::parse("ws://[::1]:9").unwrap();
        assert_eq!(v.host_for_resolve(), "::1");
        assert_eq!(v.http_url(), "http://[::1]:9");
    }

    #[test]
    fn rejects_bad_urls() {
        assert_eq!(RelayUrl::parse(""), Err(UrlError::Empty));
        assert!(matches!(
            RelayUrl::parse("https://r.example"),
            Err(UrlError::Scheme(_))
        ));
        assert!(matches!(
            RelayUrl::parse("r.example"),
            Err(UrlError::Scheme(_))
        ));
        assert_eq!(RelayUrl::parse("wss://"), Err(UrlError::MissingHost));
        assert_eq!(RelayUrl::parse("wss:///path"), Err(UrlError::MissingHost));
        assert_eq!(
            RelayUrl::parse("wss://u:p@r.example"),
            Err(UrlError::UserInfo)
        );
        assert!(matches!(
            RelayUrl::parse("wss://r.example:0"),
            Err(UrlError::Port(_))
        ));
        assert!(matches!(
            RelayUrl::parse("wss://r.example:99999"),
            Err(UrlError::Port(_))
        ));
        assert!(matches!(
            RelayUrl::parse("wss://r.example:abc"),
            Err(UrlError::Port(_))
        ));
        assert_eq!(
            RelayUrl::parse("wss://r. example"),
            Err(UrlError::InvalidCharacter)
        );
    }

    #[test]
    fn fuzz_regression_host_with_colon_is_refused_and_normalising_is_idempotent() {
        // Found by `cargo fuzz run relay_url`: the host `wss:'jj…[jwss` with an empty port
        // was accepted, and its normalised text then failed to parse (a port error).
        let crash = "ws://wss:'jjjjjjjjjjjjjjjj[jwss://jjjjMMMMMMjjSSN";
        assert!(matches!(RelayUrl::parse(crash), Err(UrlError::Host(_))));
        for bad in [
            "wss://a:b:",
            "wss://r[x]",
            "wss://ré.example",
            "wss://[::g]",
            "wss://a'b",
        ] {
            assert!(RelayUrl::parse(bad).is_err(), "{bad}");
        }
        for good in [
            "wss://r.example",
            "ws://127.0.0.1:7777",
            "wss://[::1]:8080/x",
            "wss://under_score.example",
            "wss://r.example//a//?q=1",
        ] {
            let u = RelayUrl::parse(good).unwrap();
            assert_eq!(RelayUrl::parse(u.as_str()), Ok(u.clone()), "{good}");
        }
    }
}
