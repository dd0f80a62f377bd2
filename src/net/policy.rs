//! Which addresses the engine may connect to (pure: no sockets, no DNS).
//!
//! Relays discovered from events are chosen by whoever wrote the event. Without a check, an
//! announcement could make the engine open connections (websocket and NIP-11 HTTP requests)
//! to loopback, the operator's private network or cloud metadata addresses (SSRF). The
//! engine therefore checks every *resolved* address right before it connects to that same
//! address ([`AddressPolicy::check_addr`]), so a DNS answer that changes between check and
//! connect (rebinding) cannot slip through.
//!
//! * Relays the operator names (`--own-relay`, `--public-url`, `--bootstrap`) are trusted.
//! * `--allow-relay PATTERN` marks more relays as trusted (for example a relay on the LAN).
//! * `--deny-relay PATTERN` refuses relays outright, trusted or not (the own relay excepted).
//! * `--allow-private-relays` lifts the address check for every relay.
//! * A discovered relay whose address is the own relay's is refused (the own relay under
//!   another name is never a sync target).
//!
//! A pattern is a relay URL (`wss://relay.example.com`, compared after normalisation), a host
//! (`relay.example.com`, any scheme and port), or a domain suffix (`*.example.com`, which
//! also matches `example.com`).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::shared::RelayUrl;
use crate::shared::{AddressKind, Refusal};

/// Why an address is not public, or `None` for a public unicast address.
///
/// Covers loopback, private (10/8, 172.16/12, 192.168/16), link-local (169.254/16,
/// fe80::/10), CGNAT (100.64/10), unique-local (fc00::/7), site-local (fec0::/10),
/// multicast, unspecified, broadcast, "this network" (0/8), documentation (192.0.2/24,
/// 198.51.100/24, 203.0.113/24, 2001:db8::/32), benchmarking (198.18/15), IETF protocol
/// assignments (192.0.0/24), reserved (240/4), discard-only (100::/64), and IPv4 addresses
/// embedded in IPv6 (IPv4-mapped `::ffff:a.b.c.d`, IPv4-compatible `::a.b.c.d`, NAT64
/// `64:ff9b::/96`, 6to4 `2002::/16`), which are judged by the IPv4 address inside.
pub(crate) fn non_public_reason(ip: IpAddr) -> Option<AddressKind> {
    match ip {
        IpAddr::V4(v4) => v4_reason(v4),
        IpAddr::V6(v6) => v6_reason(v6),
    }
}

fn v4_reason(ip: Ipv4Addr) -> Option<AddressKind> {
    let [a, b, c, _] = ip.octets();
    if ip.is_unspecified() {
        Some(AddressKind::Unspecified)
    } else if ip.is_loopback() {
        Some(AddressKind::Loopback)
    } else if ip.is_private() {
        Some(AddressKind::Private)
    } else if ip.is_link_local() {
        Some(AddressKind::LinkLocal)
    } else if a == 100 && (64..128).contains(&b) {
        Some(AddressKind::SharedCgnat)
    } else if ip.is_broadcast() {
        Some(AddressKind::Broadcast)
    } else if ip.is_multicast() {
        Some(AddressKind::Multicast)
    } else if a == 0 {
        Some(AddressKind::ThisNetwork)
    } else if (a, b, c) == (192, 0, 2) || (a, b, c) == (198, 51, 100) || (a, b, c) == (203, 0, 113)
    {
        Some(AddressKind::Documentation)
    } else if a == 198 && (b == 18 || b == 19) {
        Some(AddressKind::Benchmarking)
    } else if (a, b, c) == (192, 0, 0) {
        Some(AddressKind::IetfProtocol)
    } else if a >= 240 {
        Some(AddressKind::Reserved)
    } else {
        None
    }
}

fn v6_reason(ip: Ipv6Addr) -> Option<AddressKind> {
    let seg = ip.segments();
    let embedded_v4 =
        |hi: u16, lo: u16| Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8);
    if ip.is_unspecified() {
        return Some(AddressKind::Unspecified);
    }
    if ip.is_loopback() {
        return Some(AddressKind::Loopback);
    }
    // IPv4-mapped ::ffff:a.b.c.d and IPv4-compatible ::a.b.c.d.
    if seg[..5] == [0; 5] && (seg[5] == 0xffff || seg[5] == 0) {
        return v4_reason(embedded_v4(seg[6], seg[7])).or(if seg[5] == 0 {
            Some(AddressKind::Ipv4Compatible)
        } else {
            None
        });
    }
    // NAT64 64:ff9b::/96.
    if seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return v4_reason(embedded_v4(seg[6], seg[7]));
    }
    // The NAT64 local-use prefix 64:ff9b:1::/48 (RFC 8215): whatever it translates to lies
    // inside the operator's network (issue 36).
    if seg[..3] == [0x64, 0xff9b, 1] {
        return Some(AddressKind::Nat64LocalUse);
    }
    // 6to4 2002:aabb:ccdd::/48.
    if seg[0] == 0x2002 {
        return v4_reason(embedded_v4(seg[1], seg[2]));
    }
    if seg[0] & 0xfe00 == 0xfc00 {
        Some(AddressKind::UniqueLocal)
    } else if seg[0] & 0xffc0 == 0xfe80 {
        Some(AddressKind::LinkLocal)
    } else if seg[0] & 0xffc0 == 0xfec0 {
        Some(AddressKind::SiteLocal)
    } else if seg[0] & 0xff00 == 0xff00 {
        Some(AddressKind::Multicast)
    } else if seg[0] == 0x2001 && seg[1] == 0x0db8 {
        Some(AddressKind::Documentation)
    } else if seg[..4] == [0x100, 0, 0, 0] {
        Some(AddressKind::DiscardOnly)
    } else {
        None
    }
}

/// A `--deny-relay` / `--allow-relay` pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RelayPattern {
    /// One relay URL (normalised).
    Url(RelayUrl),
    /// One host, any scheme and port.
    Host(String),
    /// A domain and its subdomains (`*.example.com`).
    Suffix(String),
}

impl RelayPattern {
    /// Parses a pattern: a `ws://`/`wss://` URL, `*.domain`, or a host name or IP literal.
    pub fn parse(text: &str) -> Result<RelayPattern, String> {
        let t = text.trim();
        if t.is_empty() {
            return Err("empty relay pattern".into());
        }
        if t.contains("://") {
            return RelayUrl::parse(t)
                .map(RelayPattern::Url)
                .map_err(|e| format!("{t:?}: {e}"));
        }
        let lower = t.to_ascii_lowercase();
        if let Some(domain) = lower.strip_prefix("*.") {
            if domain.is_empty() || domain.contains(['*', '/', ':']) {
                return Err(format!("{t:?}: expected *.domain"));
            }
            return Ok(RelayPattern::Suffix(domain.to_string()));
        }
        if lower.contains(['*', '/', '?', '#', '@']) || lower.chars().any(char::is_whitespace) {
            return Err(format!(
                "{t:?}: expected a ws:// or wss:// URL, a host, or *.domain"
            ));
        }
        // Hosts compare as `RelayUrl::host` stores them: IPv6 literals with brackets.
        let host = match lower.parse::<Ipv6Addr>() {
            Ok(_) => format!("[{lower}]"),
            Err(_) => lower,
        };
        Ok(RelayPattern::Host(host))
    }

    /// True when `url` matches.
    pub fn matches(&self, url: &RelayUrl) -> bool {
        match self {
            RelayPattern::Url(u) => u == url,
            RelayPattern::Host(h) => url.host() == h,
            RelayPattern::Suffix(d) => {
                let host = url.host();
                host == d
                    || host
                        .strip_suffix(d.as_str())
                        .is_some_and(|rest| rest.ends_with('.'))
            }
        }
    }
}

impl fmt::Display for RelayPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RelayPattern::Url(u) => write!(f, "{u}"),
            RelayPattern::Host(h) => f.write_str(h),
            RelayPattern::Suffix(d) => write!(f, "*.{d}"),
        }
    }
}

/// What the policy says about a relay URL before any address is known.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UrlVerdict {
    /// Named by the operator (or allowed by a pattern): no address check.
    Trusted,
    /// Discovered: every resolved address is checked ([`AddressPolicy::check_addr`]).
    CheckAddresses,
    /// Refused outright (deny list).
    Refused(Refusal),
}

/// The address policy of one engine: built by [`crate::Config::address_policy`], or with
/// struct-update syntax from `AddressPolicy::default()`.
#[derive(Debug, Clone, Default)]
pub struct AddressPolicy {
    /// Lift the address check for every relay (`--allow-private-relays`).
    pub allow_private: bool,
    /// Relays refused outright.
    pub deny: Vec<RelayPattern>,
    /// Relays exempt from the address check.
    pub allow: Vec<RelayPattern>,
    /// Relays the operator named (own relay, aliases, bootstrap): exempt.
    pub trusted: Vec<RelayUrl>,
    /// The own relay's socket addresses (and its aliases'): a discovered relay resolving to
    /// one of them is refused.
    pub own_addrs: Vec<SocketAddr>,
    /// This host's interface addresses and the own relay's names resolved again from time
    /// to time (issue 20): shared by every clone, refreshed by the engine.
    pub local: LocalAddresses,
}

/// This host's interface addresses and the own relay's addresses (its URL and every
/// `--public-url`) as last resolved, shared by every clone of an [`AddressPolicy`]. The
/// engine refreshes it every [`LOCAL_REFRESH`] from a relay thread about to connect, never
/// from the coordinator.
#[derive(Debug, Clone, Default)]
pub struct LocalAddresses(std::sync::Arc<parking_lot::RwLock<Local>>);

/// How often [`LocalAddresses`] is refreshed.
pub const LOCAL_REFRESH: std::time::Duration = std::time::Duration::from_secs(300);

#[derive(Debug, Default)]
struct Local {
    /// The own relay's URL and its `--public-url`s: resolved at every refresh.
    names: Vec<RelayUrl>,
    interfaces: Vec<IpAddr>,
    own: Vec<SocketAddr>,
    refreshed_at: Option<std::time::Instant>,
    refreshing: bool,
}

impl LocalAddresses {
    /// Addresses to be refreshed for the own relay's `names` (its URL, its public URLs);
    /// nothing known until the first [`LocalAddresses::set`].
    pub fn new(names: Vec<RelayUrl>) -> LocalAddresses {
        LocalAddresses(std::sync::Arc::new(parking_lot::RwLock::new(Local {
            names,
            ..Local::default()
        })))
    }

    /// The names resolved at every refresh.
    pub fn names(&self) -> Vec<RelayUrl> {
        self.0.read().names.clone()
    }

    /// This host's interface addresses as last read.
    pub fn interfaces(&self) -> Vec<IpAddr> {
        self.0.read().interfaces.clone()
    }

    /// Replaces the interface addresses and the own relay's resolved addresses.
    pub fn set(&self, interfaces: Vec<IpAddr>, own: Vec<SocketAddr>, now: std::time::Instant) {
        let mut l = self.0.write();
        l.interfaces = interfaces.into_iter().map(canonical).collect();
        l.own = own;
        l.refreshed_at = Some(now);
        l.refreshing = false;
    }

    /// True (once, until [`LocalAddresses::set`] or [`LocalAddresses::refresh_failed`])
    /// when a refresh is due at `now`: the caller then refreshes.
    pub fn claim_refresh(&self, now: std::time::Instant) -> bool {
        let mut l = self.0.write();
        let due = l
            .refreshed_at
            .is_none_or(|t| now.saturating_duration_since(t) >= LOCAL_REFRESH);
        if due && !l.refreshing {
            l.refreshing = true;
            true
        } else {
            false
        }
    }

    /// A claimed refresh could not run: the next caller tries.
    pub fn refresh_failed(&self) {
        self.0.write().refreshing = false;
    }

    /// True for an address of one of this host's interfaces.
    pub fn is_interface(&self, ip: IpAddr) -> bool {
        self.0.read().interfaces.contains(&canonical(ip))
    }

    /// The own relay's addresses as last resolved.
    pub fn own(&self) -> Vec<SocketAddr> {
        self.0.read().own.clone()
    }
}

impl AddressPolicy {
    /// The verdict on `url` before resolution.
    pub fn check_url(&self, url: &RelayUrl) -> UrlVerdict {
        let own = self.trusted.first() == Some(url);
        if !own {
            if let Some(p) = self.deny.iter().find(|p| p.matches(url)) {
                return UrlVerdict::Refused(Refusal::Denied {
                    pattern: p.to_string(),
                });
            }
        }
        if self.trusted.contains(url) || self.allow.iter().any(|p| p.matches(url)) {
            UrlVerdict::Trusted
        } else {
            UrlVerdict::CheckAddresses
        }
    }

    /// Checks one resolved address of a discovered relay, right before connecting to it.
    /// `Err` holds the reason for the log and the status.
    pub fn check_addr(&self, addr: SocketAddr) -> Result<(), Refusal> {
        self.check_own(addr)?;
        if self.allow_private {
            return Ok(());
        }
        // A non-public address is named by its kind; a public one of this host's interfaces
        // is this host.
        let kind = non_public_reason(addr.ip()).or_else(|| {
            self.local
                .is_interface(addr.ip())
                .then_some(AddressKind::ThisHost)
        });
        match kind {
            Some(kind) => Err(Refusal::NonPublicAddress {
                ip: addr.ip(),
                kind,
            }),
            None => Ok(()),
        }
    }
}

impl AddressPolicy {
    /// Refuses an address of the own relay (or an alias). Applies to every remote relay,
    /// trusted ones (bootstrap, `--allow-relay`) included: the engine never syncs from the
    /// own relay, however it is spelled.
    ///
    /// The own relay is known by every name: its URL's and each `--public-url`'s addresses
    /// (resolved again every [`LOCAL_REFRESH`]), and, when it is on this host (a loopback,
    /// unspecified or interface address), every address of this host with its port (a
    /// relay listening on all interfaces answers on each).
    pub fn check_own(&self, addr: SocketAddr) -> Result<(), Refusal> {
        let refreshed = self.local.own();
        let own = || self.own_addrs.iter().chain(refreshed.iter());
        if own().any(|o| same_endpoint(*o, addr)) {
            return Err(Refusal::OwnRelay { addr });
        }
        let on_host = |ip: IpAddr| {
            let ip = canonical(ip);
            ip.is_loopback() || ip.is_unspecified() || self.local.is_interface(ip)
        };
        if on_host(addr.ip()) && own().any(|o| o.port() == addr.port() && on_host(o.ip())) {
            return Err(Refusal::OwnRelay { addr });
        }
        Ok(())
    }
}

/// True when `a` and `b` reach the same listener: equal, or the same port on loopback or
/// unspecified addresses (all of which reach this machine), IPv4-mapped forms included.
pub(crate) fn same_endpoint(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() {
        return false;
    }
    let (ia, ib) = (canonical(a.ip()), canonical(b.ip()));
    let local = |ip: IpAddr| ip.is_loopback() || ip.is_unspecified();
    ia == ib || (local(ia) && local(ib))
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn non_public_ranges_are_recognised() {
        for (a, why) in [
            ("127.0.0.1", "loopback"),
            ("127.255.0.9", "loopback"),
            ("10.1.2.3", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("169.254.169.254", "link-local"),
            ("100.64.0.1", "CGNAT"),
            ("100.127.255.255", "CGNAT"),
            ("0.0.0.0", "unspecified"),
            ("0.1.2.3", "this network"),
            ("255.255.255.255", "broadcast"),
            ("224.0.0.1", "multicast"),
            ("192.0.2.1", "documentation"),
            ("198.51.100.7", "documentation"),
            ("203.0.113.9", "documentation"),
            ("198.18.0.1", "benchmarking"),
            ("192.0.0.8", "IETF"),
            ("240.0.0.1", "reserved"),
            ("::1", "loopback"),
            ("::", "unspecified"),
            ("fc00::1", "unique-local"),
            ("fd12:3456::1", "unique-local"),
            ("fe80::1", "link-local"),
            ("fec0::1", "site-local"),
            ("ff02::1", "multicast"),
            ("2001:db8::1", "documentation"),
            ("100::1", "discard"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.0.0.1", "private"),
            ("::ffff:169.254.169.254", "link-local"),
            ("::127.0.0.1", "loopback"),
            ("::8.8.8.8", "IPv4-compatible"),
            ("64:ff9b::10.0.0.1", "private"),
            ("64:ff9b:1::8.8.8.8", "NAT64 local-use"),
            ("64:ff9b:1:ffff::1", "NAT64 local-use"),
            ("2002:7f00:1::", "loopback"),
            ("2002:c0a8:101::", "private"),
        ] {
            let r = non_public_reason(ip(a));
            assert!(r.is_some_and(|r| r.to_string().contains(why)), "{a}: {r:?}");
        }
        for a in [
            "8.8.8.8",
            "1.1.1.1",
            "100.63.255.255",
            "100.128.0.0",
            "172.32.0.1",
            "192.169.0.1",
            "198.20.0.1",
            "2606:4700::1111",
            "2a01:4f8::1",
            "::ffff:8.8.8.8",
            "64:ff9b::8.8.8.8",
            "2002:0808:0808::",
        ] {
            assert_eq!(non_public_reason(ip(a)), None, "{a}");
        }
    }

    #[test]
    fn patterns() {
        let u = |s: &str| RelayUrl::parse(s).unwrap();
        let p = |s: &str| RelayPattern::parse(s).unwrap();
        assert!(p("wss://Relay.Example.com/").matches(&u("wss://relay.example.com")));
        assert!(!p("wss://relay.example.com").matches(&u("ws://relay.example.com")));
        assert!(p("relay.example.com").matches(&u("ws://relay.example.com:7000/x")));
        assert!(!p("relay.example.com").matches(&u("ws://evil-relay.example.com")));
        assert!(p("*.example.com").matches(&u("wss://a.b.example.com")));
        assert!(p("*.example.com").matches(&u("wss://example.com")));
        assert!(!p("*.example.com").matches(&u("wss://badexample.com")));
        assert!(p("::1").matches(&u("ws://[::1]:7")));
        assert!(p("10.0.0.5").matches(&u("ws://10.0.0.5:7")));
        for bad in ["", "*.", "http://x", "a/b", "*.a/b", "a b", "u@h"] {
            assert!(RelayPattern::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(p("*.Example.com").to_string(), "*.example.com");
    }

    #[test]
    fn policy_verdicts() {
        let u = |s: &str| RelayUrl::parse(s).unwrap();
        let own = u("ws://127.0.0.1:7777");
        let policy = AddressPolicy {
            trusted: vec![own.clone(), u("ws://10.0.0.9:1")],
            deny: vec![RelayPattern::parse("*.bad.example").unwrap()],
            allow: vec![RelayPattern::parse("lan-relay").unwrap()],
            own_addrs: vec!["127.0.0.1:7777".parse().unwrap()],
            ..AddressPolicy::default()
        };
        assert_eq!(policy.check_url(&own), UrlVerdict::Trusted);
        assert_eq!(policy.check_url(&u("ws://10.0.0.9:1")), UrlVerdict::Trusted);
        assert_eq!(
            policy.check_url(&u("ws://lan-relay:1")),
            UrlVerdict::Trusted
        );
        assert!(matches!(
            policy.check_url(&u("wss://x.bad.example")),
            UrlVerdict::Refused(r) if r.to_string().contains("--deny-relay *.bad.example")
        ));
        assert_eq!(
            policy.check_url(&u("wss://relay.example")),
            UrlVerdict::CheckAddresses
        );
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(policy.check_addr(addr("8.8.8.8:443")).is_ok());
        let e = policy.check_addr(addr("127.0.0.1:9")).unwrap_err();
        assert_eq!(
            e,
            Refusal::NonPublicAddress {
                ip: ip("127.0.0.1"),
                kind: AddressKind::Loopback
            }
        );
        assert_eq!(
            e.to_string(),
            "127.0.0.1 is a loopback address (see --allow-private-relays)"
        );
        assert!(policy.check_addr(addr("[::ffff:192.168.0.1]:9")).is_err());
        let open = AddressPolicy {
            allow_private: true,
            ..policy.clone()
        };
        assert!(open.check_addr(addr("127.0.0.1:9")).is_ok());
        // The own relay under another address spelling stays refused.
        for own_again in [
            "127.0.0.1:7777",
            "127.0.0.2:7777",
            "[::1]:7777",
            "[::ffff:127.0.0.1]:7777",
        ] {
            let e = open.check_addr(addr(own_again)).unwrap_err();
            assert_eq!(e.label(), "own_relay", "{own_again}: {e}");
            assert!(e.to_string().contains("own relay"), "{own_again}: {e}");
        }
        assert!(open.check_addr(addr("127.0.0.1:7778")).is_ok());
        assert!(policy.check_own(addr("[::1]:7777")).is_err());
        assert!(policy.check_own(addr("10.0.0.9:7777")).is_ok());
    }

    #[test]
    fn the_own_relay_is_refused_on_every_address_of_this_host() {
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        // The own relay on 127.0.0.1:7777, this host's public address 1.2.3.4 (as
        // read from its interfaces), --public-url resolving to 198.51.100.9:443.
        let local = LocalAddresses::default();
        let policy = AddressPolicy {
            own_addrs: vec![addr("127.0.0.1:7777")],
            local: local.clone(),
            ..AddressPolicy::default()
        };
        // Before the interfaces are known, the public address is not recognised.
        assert!(policy.check_own(addr("1.2.3.4:7777")).is_ok());
        let now = std::time::Instant::now();
        assert!(local.claim_refresh(now));
        assert!(!local.claim_refresh(now), "one refresher at a time");
        local.set(
            vec![
                "1.2.3.4".parse().unwrap(),
                "::ffff:192.0.2.1".parse().unwrap(),
            ],
            vec![addr("198.51.100.9:443")],
            now,
        );
        assert!(!local.claim_refresh(now + LOCAL_REFRESH / 2));
        // The own relay's port on any address of this host: the own relay.
        for own in ["1.2.3.4:7777", "192.0.2.1:7777", "[::ffff:1.2.3.4]:7777"] {
            let e = policy.check_own(addr(own)).unwrap_err();
            assert_eq!(e.label(), "own_relay", "{own}");
        }
        // The public URL's resolved address, and only its port.
        assert!(policy.check_own(addr("198.51.100.9:443")).is_err());
        assert!(policy.check_own(addr("198.51.100.9:444")).is_ok());
        // Another port of this host: refused for discovered relays (a service of this
        // machine), unless the operator allows private relays.
        let e = policy.check_addr(addr("1.2.3.4:22")).unwrap_err();
        assert!(e.to_string().contains("address of this host"), "{e}");
        let open = AddressPolicy {
            allow_private: true,
            ..policy.clone()
        };
        assert!(open.check_addr(addr("1.2.3.4:22")).is_ok());
        assert!(open.check_addr(addr("1.2.3.4:7777")).is_err(), "own relay");
        // Another host's public address is fine.
        assert!(policy.check_addr(addr("8.8.8.8:7777")).is_ok());
        // A refresh is due again after LOCAL_REFRESH.
        assert!(local.claim_refresh(now + LOCAL_REFRESH));
    }

    #[test]
    fn same_endpoint_rules() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(same_endpoint(a("1.2.3.4:5"), a("[::ffff:1.2.3.4]:5")));
        assert!(same_endpoint(a("0.0.0.0:5"), a("127.0.0.1:5")));
        assert!(!same_endpoint(a("1.2.3.4:5"), a("1.2.3.4:6")));
        assert!(!same_endpoint(a("1.2.3.4:5"), a("1.2.3.5:5")));
    }
}
