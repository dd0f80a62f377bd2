//! The pure, sans-IO core: state, plan, filters, NIP-34 parsing, health, forwarding rules.
//!
//! Nothing in here opens a socket, spawns a thread or reads a clock. Every function takes its
//! inputs plus `now` and returns values or queued commands, so all sync decisions are unit
//! tested in simulated time.

pub mod actions;
pub mod auth;
pub mod dedup;
pub mod filters;
pub mod forward;
pub mod health;
pub mod keepalive;
pub mod message;
pub mod nip34;
pub mod paging;
pub mod relay_text;
pub mod session;
pub mod state;
pub mod sync;
pub mod time;

pub use actions::{compute_actions, derive_relay_targets, AddFilters};
pub use state::{
    ConnectionStatus, PendingBatch, PendingItems, PendingSyncIndex, RelayState, RelaySyncIndex,
    RelaySyncNeeds, RepoSyncIndex, RepoSyncNeeds,
};
pub use sync::{Command, Report, SubPurpose, SyncConfig, SyncMachine};
pub use time::{Clock, ManualClock, SystemClock, Time};
