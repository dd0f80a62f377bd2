//! The vocabulary every layer shares: a relay's normalised URL and the limits it publishes.
//!
//! A leaf: it imports nothing from the rest of the crate, so `core` (the sans-IO decisions)
//! and `net` (sockets) can both use it without depending on each other.

pub mod limits;
pub mod url;

pub use limits::RelayLimits;
pub use url::RelayUrl;
