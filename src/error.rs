//! Errors of the public API.

use std::fmt;

use crate::shared::UrlError;

/// An error starting or stopping the engine.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A relay URL in the configuration is not usable.
    InvalidUrl {
        /// Which setting held it.
        setting: &'static str,
        /// The text given.
        value: String,
        /// Why it was refused.
        reason: UrlError,
    },
    /// A thread could not be spawned.
    Spawn(std::io::Error),
    /// `shutdown` reached its deadline with threads still running.
    ShutdownTimeout {
        /// Names of the threads still running.
        running: Vec<String>,
    },
    /// The configuration is inconsistent.
    Config(String),
    /// The NIP-42 AUTH key could not be loaded (the key itself is never part of the message).
    AuthKey {
        /// Where it came from: `--nsec-file <path>` or the environment variable's name.
        source: String,
        /// What is wrong and what is expected.
        reason: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidUrl {
                setting,
                value,
                reason,
            } => write!(f, "{setting}: {value:?} is not a relay URL: {reason}"),
            Error::Spawn(e) => write!(f, "cannot spawn a thread: {e}"),
            Error::ShutdownTimeout { running } => write!(
                f,
                "shutdown deadline passed with {} thread(s) still running: {}; they end at their next deadline (connect timeout)",
                running.len(),
                running.join(", ")
            ),
            Error::Config(m) => write!(f, "invalid configuration: {m}"),
            Error::AuthKey { source, reason } => write!(f, "{source}: {reason}"),
        }
    }
}

impl std::error::Error for Error {}
