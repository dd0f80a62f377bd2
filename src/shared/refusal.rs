//! Why the engine refuses to contact a relay (the address policy of `net::policy`).
//!
//! A leaf type: `net` produces it (policy checks, connects, NIP-11 fetches) and `core`
//! receives it (the sync machine's `Report::Refused`), so it lives here. Its [`Display`]
//! is the text of the log and the status; [`Refusal::label`] is a stable word for metrics.
//!
//! [`Display`]: fmt::Display

use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// Why the engine will not connect to a relay.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The relay matches a `--deny-relay` pattern.
    Denied {
        /// The pattern, as it is shown (`*.example.com`).
        pattern: String,
    },
    /// A resolved address of a relay discovered from events is not public.
    NonPublicAddress {
        /// The address.
        ip: IpAddr,
        /// What kind of address it is.
        kind: AddressKind,
    },
    /// A resolved address is the own relay's (the own relay under another name).
    OwnRelay {
        /// The address.
        addr: SocketAddr,
    },
    /// Every resolved address was refused, for these reasons (in resolution order, two or
    /// more; see [`Refusal::every`]).
    EveryAddress(Vec<Refusal>),
}

impl Refusal {
    /// The refusal of a relay whose resolved addresses were refused for `reasons`: the one
    /// reason itself, or [`Refusal::EveryAddress`] for several. `None` when `reasons` is
    /// empty.
    pub fn every(mut reasons: Vec<Refusal>) -> Option<Refusal> {
        match reasons.len() {
            0 => None,
            1 => reasons.pop(),
            _ => Some(Refusal::EveryAddress(reasons)),
        }
    }

    /// A stable lowercase label for metrics and status: `denied`, `non_public_address` or
    /// `own_relay`. For [`Refusal::EveryAddress`], `own_relay` if any address is the own
    /// relay's, else the first reason's label.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::Denied { .. } => "denied",
            Refusal::NonPublicAddress { .. } => "non_public_address",
            Refusal::OwnRelay { .. } => "own_relay",
            Refusal::EveryAddress(all) => {
                if all.iter().any(|r| r.label() == "own_relay") {
                    "own_relay"
                } else {
                    all.first().map_or("non_public_address", Refusal::label)
                }
            }
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Denied { pattern } => write!(f, "denied by --deny-relay {pattern}"),
            Refusal::NonPublicAddress { ip, kind } => {
                write!(f, "{ip} is a {kind} (see --allow-private-relays)")
            }
            Refusal::OwnRelay { addr } => write!(f, "{addr} is the own relay's address"),
            Refusal::EveryAddress(all) => {
                for (i, r) in all.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{r}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for Refusal {}

/// The kind of a non-public address (see `net::policy::non_public_reason` for the ranges).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AddressKind {
    /// `0.0.0.0`, `::`.
    Unspecified,
    /// 127/8, `::1`.
    Loopback,
    /// 10/8, 172.16/12, 192.168/16.
    Private,
    /// 169.254/16, fe80::/10.
    LinkLocal,
    /// 100.64/10.
    SharedCgnat,
    /// 255.255.255.255.
    Broadcast,
    /// 224/4, ff00::/8.
    Multicast,
    /// 0/8.
    ThisNetwork,
    /// 192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32.
    Documentation,
    /// 198.18/15.
    Benchmarking,
    /// 192.0.0/24.
    IetfProtocol,
    /// 240/4.
    Reserved,
    /// `::a.b.c.d` with a public IPv4 address inside (deprecated form).
    Ipv4Compatible,
    /// fc00::/7.
    UniqueLocal,
    /// fec0::/10.
    SiteLocal,
    /// 100::/64.
    DiscardOnly,
    /// 64:ff9b:1::/48, the NAT64 local-use prefix (RFC 8215): translated inside one network.
    Nat64LocalUse,
    /// An address of one of this host's network interfaces (public or not): a relay there
    /// is a service of this machine (issue 20).
    ThisHost,
}

impl AddressKind {
    /// A stable lowercase label (`loopback`, `link_local`, …).
    pub fn label(self) -> &'static str {
        match self {
            AddressKind::Unspecified => "unspecified",
            AddressKind::Loopback => "loopback",
            AddressKind::Private => "private",
            AddressKind::LinkLocal => "link_local",
            AddressKind::SharedCgnat => "cgnat",
            AddressKind::Broadcast => "broadcast",
            AddressKind::Multicast => "multicast",
            AddressKind::ThisNetwork => "this_network",
            AddressKind::Documentation => "documentation",
            AddressKind::Benchmarking => "benchmarking",
            AddressKind::IetfProtocol => "ietf_protocol",
            AddressKind::Reserved => "reserved",
            AddressKind::Ipv4Compatible => "ipv4_compatible",
            AddressKind::UniqueLocal => "unique_local",
            AddressKind::SiteLocal => "site_local",
            AddressKind::DiscardOnly => "discard_only",
            AddressKind::Nat64LocalUse => "nat64_local_use",
            AddressKind::ThisHost => "this_host",
        }
    }
}

impl fmt::Display for AddressKind {
    /// The words of the log: `loopback address`, `shared (CGNAT) address`, ….
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddressKind::Unspecified => "unspecified address",
            AddressKind::Loopback => "loopback address",
            AddressKind::Private => "private address",
            AddressKind::LinkLocal => "link-local address",
            AddressKind::SharedCgnat => "shared (CGNAT) address",
            AddressKind::Broadcast => "broadcast address",
            AddressKind::Multicast => "multicast address",
            AddressKind::ThisNetwork => "'this network' address",
            AddressKind::Documentation => "documentation address",
            AddressKind::Benchmarking => "benchmarking address",
            AddressKind::IetfProtocol => "IETF protocol address",
            AddressKind::Reserved => "reserved address",
            AddressKind::Ipv4Compatible => "IPv4-compatible address",
            AddressKind::UniqueLocal => "unique-local address",
            AddressKind::SiteLocal => "site-local address",
            AddressKind::DiscardOnly => "discard-only address",
            AddressKind::Nat64LocalUse => "NAT64 local-use address",
            AddressKind::ThisHost => "address of this host",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_keeps_the_log_wording() {
        let loopback = Refusal::NonPublicAddress {
            ip: "127.0.0.1".parse().unwrap(),
            kind: AddressKind::Loopback,
        };
        assert_eq!(
            loopback.to_string(),
            "127.0.0.1 is a loopback address (see --allow-private-relays)"
        );
        assert_eq!(loopback.label(), "non_public_address");
        let own = Refusal::OwnRelay {
            addr: "[::1]:7777".parse().unwrap(),
        };
        assert_eq!(own.to_string(), "[::1]:7777 is the own relay's address");
        assert_eq!(own.label(), "own_relay");
        let denied = Refusal::Denied {
            pattern: "*.bad.example".into(),
        };
        assert_eq!(denied.to_string(), "denied by --deny-relay *.bad.example");
        assert_eq!(denied.label(), "denied");
        assert_eq!(Refusal::every(vec![]), None);
        assert_eq!(Refusal::every(vec![own.clone()]), Some(own.clone()));
        let both = Refusal::every(vec![loopback.clone(), own.clone()]).unwrap();
        assert_eq!(
            both.to_string(),
            "127.0.0.1 is a loopback address (see --allow-private-relays); [::1]:7777 is the own relay's address"
        );
        assert_eq!(both.label(), "own_relay");
        assert_eq!(
            Refusal::every(vec![loopback.clone(), loopback])
                .unwrap()
                .label(),
            "non_public_address"
        );
    }

    #[test]
    fn address_kind_labels_are_distinct() {
        use AddressKind::*;
        let all = [
            Unspecified,
            Loopback,
            Private,
            LinkLocal,
            SharedCgnat,
            Broadcast,
            Multicast,
            ThisNetwork,
            Documentation,
            Benchmarking,
            IetfProtocol,
            Reserved,
            Ipv4Compatible,
            UniqueLocal,
            SiteLocal,
            DiscardOnly,
            Nat64LocalUse,
        ];
        let labels: std::collections::HashSet<_> = all.iter().map(|k| k.label()).collect();
        assert_eq!(labels.len(), all.len());
        assert!(all.iter().all(|k| k.to_string().ends_with(" address")));
    }
}
