//! Connecting a relay thread's relay: the NIP-11 request and the websocket handshakes, both on
//! the connect pool ([`crate::net::pool`]) and both checked against the address policy.

use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, warn};

use crate::core::session::LimitsFetch;
use crate::net::nip11;
use crate::net::policy::{AddressPolicy, LocalAddresses, UrlVerdict};
use crate::net::pool;
use crate::net::ws::{self, Socket, WsOptions};
use crate::shared::Refusal;
use crate::shared::RelayUrl;

/// Reads this host's interface addresses and resolves the own relay's names again when a
/// refresh is due ([`LocalAddresses::claim_refresh`], every
/// [`LOCAL_REFRESH`](crate::net::policy::LOCAL_REFRESH)): on the thread about to connect,
/// never the coordinator; one thread at a time. A name that does not resolve (5 s deadline)
/// is skipped; interfaces that cannot be read keep the last list.
pub(crate) fn refresh_local(local: &LocalAddresses) {
    if !local.claim_refresh(Instant::now()) {
        return;
    }
    let interfaces = match if_addrs::get_if_addrs() {
        Ok(list) => list.into_iter().map(|i| i.ip()).collect(),
        Err(e) => {
            warn!("cannot read this host's interface addresses ({e}); keeping the last list");
            local.interfaces()
        }
    };
    let mut own = Vec::new();
    for url in local.names() {
        match ws::resolve(&url, Duration::from_secs(5)) {
            Ok(a) => own.extend(a),
            Err(e) => debug!("{url}: not resolved for the own-address check: {e}"),
        }
    }
    debug!("own relay addresses: {own:?}; this host's interfaces: {interfaces:?}");
    local.set(interfaces, own, Instant::now());
}

/// What a connect needs to know of its relay.
pub(crate) struct Dial {
    /// The relay.
    pub(crate) url: RelayUrl,
    /// TLS trust for `wss://` and NIP-11 over `https://`.
    pub(crate) tls: Arc<rustls::ClientConfig>,
    /// Which addresses may be connected.
    pub(crate) policy: Arc<AddressPolicy>,
    /// The own relay (its addresses are trusted; its reads are not cut).
    pub(crate) own: bool,
}

impl Dial {
    /// Checks a resolved address right before a connect: for every remote relay, that it is
    /// not the own relay's; for relays discovered from events, the whole address policy.
    /// Owned, so it can go to the connect pool with the connect.
    fn addr_check(
        &self,
        verdict: &UrlVerdict,
    ) -> impl Fn(std::net::SocketAddr) -> Result<(), Refusal> + Send + 'static {
        if !self.own {
            refresh_local(&self.policy.local);
        }
        let own = self.own;
        let verdict = verdict.clone();
        let policy = self.policy.clone();
        move |addr| {
            if own {
                return Ok(());
            }
            match verdict {
                UrlVerdict::CheckAddresses => policy.check_addr(addr),
                _ => policy.check_own(addr),
            }
        }
    }

    /// Asks for the relay's NIP-11 document (on the connect pool). `Err` when the address
    /// policy refused the relay; what the answer means is the session's to decide
    /// ([`RelaySession::on_limits`]).
    pub(crate) fn fetch_limits(
        &self,
        verdict: &UrlVerdict,
        timeout: Duration,
    ) -> Result<LimitsFetch, Refusal> {
        let deadline = Instant::now() + timeout;
        let (url, tls, check) = (self.url.clone(), self.tls.clone(), self.addr_check(verdict));
        let fetched = pool::connect_pool().run(pool_patience(timeout), move || {
            nip11::fetch_checked(&url, pool::remaining(deadline), 64 * 1024, &tls, &check)
        });
        let fetched = match fetched {
            Ok(f) => f,
            Err(e) => {
                debug!("{}: no NIP-11 request ({e}); using defaults", self.url);
                return Ok(LimitsFetch::Unreachable);
            }
        };
        match fetched {
            Ok(limits) => Ok(LimitsFetch::Fetched(limits)),
            Err(nip11::Nip11Error::Refused(reason)) => Err(reason),
            Err(e) => {
                debug!("{}: no NIP-11 limits ({e}); using defaults", self.url);
                Ok(unusable(&e))
            }
        }
    }

    /// Opens the websocket on the connect pool ([`crate::net::pool`]) and waits for it. The
    /// TCP, TLS and websocket handshakes touch tens of KiB of stack that the relay thread
    /// would keep resident for the rest of its life (an idle connection needs far less); the
    /// pool's few threads touch theirs once. The deadline runs from this call: time spent
    /// waiting for a pool thread is taken from the handshakes' time. A panic in the connect
    /// is resumed here, so the relay thread fails as it would have.
    pub(crate) fn connect(
        &self,
        verdict: &UrlVerdict,
        ws: WsOptions,
    ) -> Result<Socket, ws::ConnectError> {
        let deadline = Instant::now() + ws.connect_timeout;
        let (url, tls, check) = (self.url.clone(), self.tls.clone(), self.addr_check(verdict));
        let mut opts = ws;
        if self.own {
            // The own relay's connection reads the whole own relay at start (and every
            // event it stores): its reads are not cut (`WsOptions::max_read` is for the
            // many idle remote relays).
            opts.max_read = 0;
        }
        pool::connect_pool()
            .run(pool_patience(opts.connect_timeout), move || {
                let left = pool::remaining(deadline);
                if left.is_zero() {
                    return Err(ws::ConnectError::Timeout);
                }
                let opts = WsOptions {
                    connect_timeout: left,
                    ..opts
                };
                ws::connect_checked(&url, &opts, &tls, &check)
            })
            .unwrap_or_else(|e| Err(ws::ConnectError::Tcp(std::io::Error::other(e.to_string()))))
    }
}

/// How long a connect or NIP-11 request with `timeout` waits for a free pool thread before it
/// runs on a thread of its own: a quarter of its time, so every worker stuck in a slow
/// handshake cannot keep it from three quarters of its time.
fn pool_patience(timeout: Duration) -> Duration {
    timeout / 4
}

/// What a failed NIP-11 request means for the session: a relay not reached is asked again on
/// the next connect; one that answered without a usable document (an HTTP error, a body that
/// is not a JSON object, one above the cap) keeps the defaults.
fn unusable(e: &nip11::Nip11Error) -> LimitsFetch {
    match e {
        nip11::Nip11Error::Connect(_) | nip11::Nip11Error::Io(_) | nip11::Nip11Error::Timeout => {
            LimitsFetch::Unreachable
        }
        _ => LimitsFetch::NoDocument,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nip11::Nip11Error as E;

    #[test]
    fn nip11_is_asked_again_only_when_the_relay_was_not_reached() {
        let io = || std::io::Error::other("reset");
        for e in [E::Connect("refused".into()), E::Io(io()), E::Timeout] {
            assert_eq!(unusable(&e), LimitsFetch::Unreachable, "{e}");
        }
        for e in [E::Status(404), E::Malformed("html".into()), E::TooLarge] {
            assert_eq!(unusable(&e), LimitsFetch::NoDocument, "{e}");
        }
    }
}
