//! What a relay publishes about its limits (the NIP-11 `limitation` object), as the sync
//! logic reads it. Fetching and parsing the document is `net::nip11`'s job.

/// The limits a relay announces in the `limitation` object of its NIP-11 document.
///
/// Every numeric field is `None` when the relay did not state it, stated it with the wrong
/// JSON type, or stated an implausible value (0, negative, or above 10⁹).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayLimits {
    /// Most concurrent subscriptions one connection may hold (`max_subscriptions`).
    pub max_subscriptions: Option<usize>,
    /// Largest `limit` the relay honours in a filter; larger values are clamped (`max_limit`).
    pub max_limit: Option<usize>,
    /// Events returned for a filter without `limit` (`default_limit`).
    pub default_limit: Option<usize>,
    /// Largest websocket message the relay accepts, in bytes (`max_message_length`).
    pub max_message_length: Option<usize>,
    /// The relay requires NIP-42 authentication before anything else (`auth_required`).
    /// Parsed for status and logs; the engine authenticates whenever challenged anyway.
    pub auth_required: bool,
    /// The relay accepts writes only from some users (`restricted_writes`). Parsed, not acted
    /// on: the engine only reads from remote relays.
    pub restricted_writes: bool,
    /// `supported_nips` lists 77 (`Some(true)`), is a list without it (`Some(false)`), or is
    /// missing or not a list (`None`). Steers NIP-77 reconciliation (`docs/nip77.md`).
    pub supports_nip77: Option<bool>,
}

impl RelayLimits {
    /// The most events this relay is expected to return for one REQ whose filter carries an
    /// explicit `limit`: this is the page size to plan with.
    ///
    /// * `max_limit` when stated: the relay clamps larger limits to it.
    /// * otherwise `default_limit`: strictly it applies only to filters *without* `limit`, but
    ///   a relay that states only a default often clamps to it as well, so it is the
    ///   conservative guess.
    /// * otherwise `fallback`.
    pub fn page_size(&self, fallback: usize) -> usize {
        self.max_limit.or(self.default_limit).unwrap_or(fallback)
    }

    /// How many concurrent subscriptions one connection may hold: `max_subscriptions` when
    /// stated, otherwise `fallback`.
    pub fn subscription_budget(&self, fallback: usize) -> usize {
        self.max_subscriptions.unwrap_or(fallback)
    }
}
