//! The NIP-77 (negentropy) responder of the test relay: modes, sessions, frames.
//!
//! A session is what strfry keeps per `NEG-OPEN`: the `(created_at, id)` records of the stored
//! events matching the filter, sealed into a [`NegentropyStorageVector`] at open time, and a
//! [`Negentropy`] instance answering the client's messages over that snapshot. Events stored
//! after the open are not part of the session, as on strfry.

use std::time::Instant;

use negentropy::{Id, Negentropy, NegentropyStorageVector};
use nostr::event::EventId;
use nostr::filter::Filter;
use nostr::types::Timestamp;
use serde_json::Value;

/// Largest negentropy message the relay sends, in bytes before hex encoding (rust-nostr's
/// `LocalRelay` uses the same; a larger reconciliation takes more round trips).
pub(crate) const FRAME_SIZE_LIMIT: u64 = 60_000;

/// The most negentropy sessions one connection may hold open at once; a `NEG-OPEN` beyond it
/// is answered `NEG-ERR "blocked: too many open negentropy sessions"`.
pub(crate) const MAX_SESSIONS_PER_CONN: usize = 100;

/// The `NEG-ERR` reason for a query over `nip77_max_records` (strfry's text).
pub(crate) const TOO_MANY_RECORDS: &str = "blocked: too many query results";

/// The `NEG-ERR` reason for a `NEG-MSG` naming no open session.
pub(crate) const NO_SESSION: &str = "closed: no such negentropy session";

/// How a [`TestRelay`](crate::testing::TestRelay) answers NIP-77 (negentropy) messages.
///
/// Every mode but [`Off`](Self::Off) lists 77 in the NIP-11 `supported_nips` (when a NIP-11
/// document is configured), as a relay claiming NIP-77 would.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Nip77Mode {
    /// No NIP-77 (the default): `NEG-OPEN`, `NEG-MSG` and `NEG-CLOSE` are answered
    /// `["NOTICE", "could not parse command"]`, exactly as nostr-rs-relay 0.8.12 answers them.
    #[default]
    Off,
    /// Serve NIP-77 like strfry: `NEG-OPEN` opens (or replaces) a session over the stored
    /// events matching its filter and is answered `NEG-MSG`; `NEG-MSG` continues it;
    /// `NEG-CLOSE` ends it silently.
    On,
    /// Answer every `NEG-OPEN`, `NEG-MSG` and `NEG-CLOSE` with `["NOTICE", msg]` and open no
    /// session: a relay that lists NIP-77 but has it disabled (strfry answers
    /// `"ERROR: bad msg: negentropy disabled"`).
    Notice(String),
    /// Answer every `NEG-OPEN` with `["NEG-ERR", sub_id, msg]` and open no session.
    NegErr(String),
    /// Answer every `NEG-OPEN` with `["CLOSED", sub_id, msg]` and open no session.
    Closed(String),
    /// Never answer `NEG-OPEN` or `NEG-MSG` (no session is opened): a relay that swallows them.
    Silent,
    /// Serve NIP-77 as [`On`](Self::On), but hang up every connection (no close frame) right
    /// after its `n`-th `NEG-MSG` reply; with `0` a `NEG-OPEN` gets no reply, the connection
    /// is dropped at once.
    DropAfter(u32),
}

impl Nip77Mode {
    /// Whether the relay claims NIP-77 (every mode but `Off`).
    pub fn advertised(&self) -> bool {
        !matches!(self, Nip77Mode::Off)
    }
}

/// A `NEG-OPEN` the relay received (recorded in every mode but `Off`, also when refused).
#[derive(Debug, Clone)]
pub struct RecordedNegOpen {
    /// Id of the connection it arrived on.
    pub conn: u64,
    /// The negentropy subscription id.
    pub sub_id: String,
    /// The parsed filter.
    pub filter: Filter,
    /// When it was received.
    pub at: Instant,
}

/// One open negentropy session (the relay is never the initiator).
pub(crate) type Session = Negentropy<'static, NegentropyStorageVector>;

/// Why a `NEG-OPEN` or `NEG-MSG` was refused; the `NEG-ERR` text.
pub(crate) fn invalid(what: &str) -> String {
    format!("invalid: {what}")
}

/// Opens a session over `records` and answers the client's `initial` message.
pub(crate) fn open(
    records: impl Iterator<Item = (Timestamp, EventId)>,
    initial: &[u8],
) -> Result<(Session, Vec<u8>), negentropy::Error> {
    let mut storage = NegentropyStorageVector::new();
    for (created_at, id) in records {
        storage.insert(created_at.as_secs(), Id::from_byte_array(id.to_bytes()))?;
    }
    storage.seal()?;
    let mut session = Negentropy::owned(storage, FRAME_SIZE_LIMIT)?;
    let reply = session.reconcile(initial)?;
    Ok((session, reply))
}

/// Hex as the NIP-77 messages carry it: the engine's own encoder and decoder.
pub(crate) use crate::core::sync::{hex_decode, hex_encode};

/// `doc` with 77 added to its `supported_nips` (created when absent); other documents (not
/// a JSON object, or `supported_nips` not an array) are returned unchanged.
pub(crate) fn advertise(doc: &Value) -> Value {
    let mut doc = doc.clone();
    if let Some(obj) = doc.as_object_mut() {
        let nips = obj
            .entry("supported_nips")
            .or_insert_with(|| Value::Array(Vec::new()));
        if let Some(list) = nips.as_array_mut() {
            if !list.iter().any(|n| n.as_u64() == Some(77)) {
                list.push(Value::from(77));
            }
        }
    }
    doc
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hex_round_trips_and_rejects_odd_or_foreign_digits() {
        let bytes = [0x00, 0x61, 0xff, 0x0a];
        assert_eq!(hex_encode(&bytes), "0061ff0a");
        assert_eq!(hex_decode("0061FF0a"), Some(bytes.to_vec()));
        assert_eq!(hex_decode(""), Some(Vec::new()));
        assert_eq!(hex_decode("abc"), None);
        assert_eq!(hex_decode("zz"), None);
        assert_eq!(hex_decode("é0"), None);
    }

    #[test]
    fn advertise_adds_77_once_and_leaves_odd_documents_alone() {
        assert_eq!(
            advertise(&json!({"supported_nips": [1, 11]})),
            json!({"supported_nips": [1, 11, 77]})
        );
        assert_eq!(
            advertise(&json!({"supported_nips": [77]})),
            json!({"supported_nips": [77]})
        );
        assert_eq!(
            advertise(&json!({"name": "x"})),
            json!({"name": "x", "supported_nips": [77]})
        );
        assert_eq!(
            advertise(&json!({"supported_nips": "all"})),
            json!({"supported_nips": "all"})
        );
        assert_eq!(advertise(&json!([1])), json!([1]));
    }

    #[test]
    fn a_session_answers_what_the_client_lacks() {
        let ids: Vec<EventId> = (0u8..40)
            .map(|i| EventId::from_byte_array([i; 32]))
            .collect();
        let mut client_store = NegentropyStorageVector::new();
        for (i, id) in ids.iter().enumerate().skip(3) {
            client_store
                .insert(i as u64, Id::from_byte_array(id.to_bytes()))
                .unwrap();
        }
        client_store.seal().unwrap();
        let mut client = Negentropy::owned(client_store, 0).unwrap();
        let mut msg = client.initiate().unwrap();
        let records = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (Timestamp::from_secs(i as u64), *id));
        let (mut server, mut reply) = open(records, &msg).unwrap();
        let (mut have, mut need) = (Vec::new(), Vec::new());
        while let Some(next) = client
            .reconcile_with_ids(&reply, &mut have, &mut need)
            .unwrap()
        {
            msg = next;
            reply = server.reconcile(&msg).unwrap();
        }
        assert!(have.is_empty());
        let mut need: Vec<[u8; 32]> = need.into_iter().map(Id::to_bytes).collect();
        need.sort_unstable();
        assert_eq!(need, vec![[0; 32], [1; 32], [2; 32]]);
    }
}
