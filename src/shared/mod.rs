//! The vocabulary every layer shares: a relay's normalised URL, the limits it publishes, and
//! why the engine refuses to contact it.
//!
//! A leaf: it imports nothing from the rest of the crate, so `core` (the sans-IO decisions)
//! and `net` (sockets) can both use it without depending on each other.

mod limits;
mod refusal;
mod url;

pub use limits::RelayLimits;
pub use refusal::{AddressKind, Refusal};
pub use url::{RelayUrl, UrlError};
