//! The engine's own parts, reachable here so that tests, benches and probes can drive one of
//! them alone: a relay thread ([`connection`]), the counters ([`Metrics`], [`RelayCounters`]),
//! the forwarder's queue item ([`ForwardItem`]) and the state file ([`state_file`]).
//!
//! They are not the embedding API (that is [`crate::start`], [`crate::Config`] and
//! [`crate::core`]): their shape follows the engine and changes without notice.

pub use crate::engine::connection::{ConnectionThread, Control, Role};
pub use crate::engine::forwarder::ForwardItem;
pub use crate::engine::metrics::{
    ByteAdmission, ForwardCounters, Histogram, Metrics, RelayCounters,
};
pub use crate::engine::Input;
pub use crate::net::ws::SocketWaker;

/// One relay's thread: [`connection::spawn`] starts it.
pub mod connection {
    pub use crate::engine::connection::{spawn, ConnectionThread, Control, Role, RELAY_STACK};
}

/// The state file under `--state-dir`.
pub mod state_file {
    pub use crate::engine::state_file::{
        load, parse, path, render, write_atomically, IgnoredReason, Loaded, FILE_NAME, FORMAT,
        MAX_FILE_BYTES, VERSION,
    };
}
