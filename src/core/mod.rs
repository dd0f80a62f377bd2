//! The pure, sans-IO core: the sync machine ([`SyncMachine`]), one relay connection's
//! decisions ([`session::RelaySession`]), state, targets, filters, NIP-34 parsing, health,
//! forwarding rules.
//!
//! Nothing in here opens a socket, spawns a thread or reads a clock. Every function takes its
//! inputs plus `now` and returns values or queued commands, so all sync decisions are unit
//! tested in simulated time.

pub(crate) mod auth;
pub mod dedup;
pub(crate) mod filter_json;
pub(crate) mod filters;
pub mod forward;
pub mod hash;
pub(crate) mod health;
pub(crate) mod keepalive;
pub(crate) mod log_budget;
pub mod message;
pub mod nip34;
pub mod paging;
pub mod progress;
pub mod related;
pub(crate) mod relay_text;
pub mod session;
pub mod state;
pub mod sync;
pub mod targets;
pub mod threads;
pub mod time;
pub mod wire;

pub use auth::AuthLimits;
pub use health::{BackoffPolicy, HealthState};
pub use keepalive::Ticks;
pub use log_budget::LogBudget;
pub use relay_text::Prefix;
pub use state::{
    ConnectionStatus, PendingBatch, PendingItems, PendingSyncIndex, RelayState, RelaySyncIndex,
    RelaySyncNeeds, RepoSyncIndex, RepoSyncNeeds,
};
pub use sync::{Command, Report, Route, SubPurpose, SyncConfig, SyncMachine};
pub use targets::{compute_actions, derive_relay_targets, AddFilters};
pub use time::{Clock, ManualClock, SystemClock, Time};
