//! # grasp-sync
//!
//! GRASP-02 proactive sync for git-over-nostr (NIP-34) relays, without an async runtime.
//!
//! A GRASP server's own relay hosts repository announcements (kind 30617) and root events
//! (patches 1617, PRs 1618, PR updates 1619, issues 1621). Their discussions happen on every
//! relay the announcements name. grasp-sync watches the own relay, learns which repositories
//! and root events it hosts, connects to every relay those announcements list, pulls the whole
//! related history, stays subscribed live and publishes every related event into the own relay.
//!
//! The crate is split the way `quinn-proto` splits protocol from sockets:
//!
//! * [`core`] — pure, sans-IO decision logic. [`core::SyncMachine`] takes inputs plus `now` and
//!   returns [`core::Command`]s; no sockets, threads or clock reads.
//! * [`net`] — relay URL normalisation and a blocking websocket connector with deadlines.
//! * [`engine`] — the threads: one coordinator (the only writer of sync state), one thread per
//!   remote relay, the self-subscriber on the own relay and the forwarder into the own relay.
//!
//! ## Embedding
//!
//! ```no_run
//! use std::time::Duration;
//! use grasp_sync::{Config, RelayUrl};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let own = RelayUrl::parse("ws://127.0.0.1:7777")?;
//! let config = Config::new(own).batch_window(Duration::from_secs(5));
//! let handle = grasp_sync::start(config)?;
//! let status = handle.status();
//! for relay in &status.relays {
//!     println!("{} {:?} confirmed repos={}", relay.url, relay.connection_status, relay.confirmed_repos);
//! }
//! handle.shutdown(Duration::from_secs(10))?;
//! # Ok(())
//! # }
//! ```
#![recursion_limit = "256"]
#![warn(missing_docs)]
#![warn(unreachable_pub)]
#![warn(unnameable_types)]
#![forbid(unsafe_code)]

pub mod config;
pub mod core;
pub mod engine;
mod error;
pub mod net;
pub mod ops;
pub mod shared;

/// Scriptable NIP-01 test relay (feature `testing`).
#[cfg(feature = "testing")]
pub mod testing;

pub use config::Config;
pub use engine::{start, RelayStatus, Status, SyncHandle};
pub use error::Error;
pub use shared::RelayUrl;
