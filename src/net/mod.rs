//! Networking: the address policy, trust roots, NIP-11 and the blocking websocket connector.
//!
//! The embedding API is [`RelayPattern`] (`--allow-relay`), [`TrustOptions`] and
//! [`client_config`] (`--ca-file`, `--native-roots`), the connector's settings [`WsOptions`] and
//! default trust roots [`tls_config`], and the NIP-11 fetcher in [`nip11`]; the
//! connector and the pool are the engine's own parts.

pub(crate) mod inbound;
pub mod nip11;
pub(crate) mod policy;
pub(crate) mod pool;
pub(crate) mod tls;
pub(crate) mod ws;

pub use policy::{AddressPolicy, LocalAddresses, RelayPattern, UrlVerdict, LOCAL_REFRESH};
pub use tls::{client_config, TlsError, TrustOptions};
pub use ws::{tls_config, WsOptions};
