//! A raw NIP-77 (negentropy) client for the tests of NIP-77 servers (`tests/nip77_server.rs`
//! against `TestRelay`, `tests/nip77_interop.rs` against a real relay): a plain tungstenite
//! websocket and the `negentropy` crate as the initiator.

#![allow(dead_code)]

use std::collections::HashSet;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use negentropy::{Id, Negentropy, NegentropyStorageVector};
use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;
use nostr::types::Timestamp;
use serde_json::{json, Value};
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

/// Generous deadline for any answer.
pub const WAIT: Duration = Duration::from_secs(10);

/// What a relay answered to one frame of a negentropy exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// `["NEG-MSG", sub, hex]`, decoded.
    Msg(Vec<u8>),
    /// `["NEG-ERR", sub, reason]`.
    Err(String),
    /// `["CLOSED", sub, reason]`.
    Closed(String),
    /// `["NOTICE", text]`.
    Notice(String),
    /// Nothing within the wait.
    Silence,
    /// The relay closed or dropped the connection.
    Hangup,
}

/// A websocket to a relay.
pub struct Client {
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
}

/// The outcome of a whole reconciliation: what the client has that the relay lacks, and what
/// the relay has that the client lacks, plus the round trips it took.
#[derive(Debug, Default)]
pub struct Outcome {
    pub have: HashSet<EventId>,
    pub need: HashSet<EventId>,
    pub rounds: usize,
}

impl Client {
    pub fn connect(url: &str) -> Client {
        let (ws, _) = tungstenite::connect(url).unwrap_or_else(|e| panic!("connect {url}: {e}"));
        Client { ws }
    }

    pub fn send(&mut self, text: &str) {
        self.ws.send(Message::text(text)).expect("send");
    }

    pub fn send_json(&mut self, value: &Value) {
        self.send(&value.to_string());
    }

    /// The next text frame within `wait`: `Ok(None)` on silence, `Err(())` when the connection
    /// ended.
    pub fn recv_within(&mut self, wait: Duration) -> Result<Option<Value>, ()> {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            if let MaybeTlsStream::Plain(s) = self.ws.get_ref() {
                s.set_read_timeout(Some(left.min(Duration::from_millis(100))))
                    .expect("set_read_timeout");
            }
            match self.ws.read() {
                Ok(Message::Text(t)) => {
                    return Ok(Some(serde_json::from_str(t.as_str()).unwrap_or_else(|e| {
                        panic!("relay sent bad JSON {}: {e}", t.as_str())
                    })));
                }
                Ok(_) => {}
                Err(tungstenite::Error::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return Err(()),
            }
        }
    }

    /// The answer concerning negentropy subscription `sub` (frames for other subscriptions
    /// are skipped), waiting at most `wait`.
    pub fn answer_within(&mut self, sub: &str, wait: Duration) -> Answer {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let frame = match self.recv_within(left) {
                Ok(Some(frame)) => frame,
                Ok(None) => return Answer::Silence,
                Err(()) => return Answer::Hangup,
            };
            let text = |i: usize| frame[i].as_str().unwrap_or_default().to_string();
            match frame[0].as_str() {
                Some("NOTICE") => return Answer::Notice(text(1)),
                Some("NEG-MSG") if frame[1] == sub => {
                    let hex = text(2);
                    return Answer::Msg(hex_decode(&hex).unwrap_or_else(|| {
                        panic!("NEG-MSG is not hex: {frame}");
                    }));
                }
                Some("NEG-ERR") if frame[1] == sub => return Answer::Err(text(2)),
                Some("CLOSED") if frame[1] == sub => return Answer::Closed(text(2)),
                _ => {}
            }
        }
    }

    pub fn answer(&mut self, sub: &str) -> Answer {
        self.answer_within(sub, WAIT)
    }

    pub fn neg_open(&mut self, sub: &str, filter: &Value, msg: &[u8]) {
        self.send_json(&json!(["NEG-OPEN", sub, filter, hex_encode(msg)]));
    }

    pub fn neg_msg(&mut self, sub: &str, msg: &[u8]) {
        self.send_json(&json!(["NEG-MSG", sub, hex_encode(msg)]));
    }

    pub fn neg_close(&mut self, sub: &str) {
        self.send_json(&json!(["NEG-CLOSE", sub]));
    }

    /// Reconciles `records` (the client's `(created_at, id)` set) with the relay's events
    /// matching `filter`, to the end, then sends NEG-CLOSE. `Err` carries the first answer
    /// that was not a NEG-MSG.
    pub fn reconcile(
        &mut self,
        sub: &str,
        filter: &Value,
        records: &[(Timestamp, EventId)],
    ) -> Result<Outcome, Answer> {
        let mut client = initiator(records);
        let initial = client.initiate().expect("initiate");
        self.neg_open(sub, filter, &initial);
        let mut outcome = Outcome::default();
        let (mut have, mut need) = (Vec::new(), Vec::new());
        loop {
            let reply = match self.answer(sub) {
                Answer::Msg(reply) => reply,
                other => return Err(other),
            };
            outcome.rounds += 1;
            let next = client
                .reconcile_with_ids(&reply, &mut have, &mut need)
                .unwrap_or_else(|e| panic!("client reconcile failed: {e}"));
            match next {
                Some(next) => self.neg_msg(sub, &next),
                None => break,
            }
        }
        self.neg_close(sub);
        outcome.have = have.into_iter().map(event_id).collect();
        outcome.need = need.into_iter().map(event_id).collect();
        Ok(outcome)
    }
}

/// A sealed initiator over `records` (no frame size limit).
pub fn initiator(records: &[(Timestamp, EventId)]) -> Negentropy<'static, NegentropyStorageVector> {
    let mut storage = NegentropyStorageVector::with_capacity(records.len());
    for (created_at, id) in records {
        storage
            .insert(created_at.as_secs(), Id::from_byte_array(id.to_bytes()))
            .expect("insert");
    }
    storage.seal().expect("seal");
    Negentropy::owned(storage, 0).expect("negentropy")
}

fn event_id(id: Id) -> EventId {
    EventId::from_byte_array(id.to_bytes())
}

pub fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn hex_decode(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// `n` signed kind-1621 issues of one repository, `created_at` from `base` on, two per
/// second (so equal timestamps are ordered by id), plus `noise` kind-1 notes that no
/// `#a` filter of the repository matches.
pub fn issues(n: usize, noise: usize, base: u64) -> (Vec<Event>, Vec<Event>) {
    let keys = Keys::generate();
    let repo = format!("30617:{}:repo", keys.public_key().to_hex());
    let issues = (0..n)
        .map(|i| {
            EventBuilder::new(Kind::Custom(1621), format!("issue {i}"))
                .tag(Tag::parse(["a", repo.as_str()]).unwrap())
                .custom_created_at(Timestamp::from_secs(base + i as u64 / 2))
                .finalize(&keys)
                .unwrap()
        })
        .collect();
    let notes = (0..noise)
        .map(|i| {
            EventBuilder::new(Kind::TextNote, format!("note {i}"))
                .custom_created_at(Timestamp::from_secs(base + i as u64))
                .finalize(&keys)
                .unwrap()
        })
        .collect();
    (issues, notes)
}

/// The `#a` filter of the repository of events made by [`issues`].
pub fn repo_filter(issue: &Event) -> Value {
    let repo = issue
        .tags
        .iter()
        .find(|t| t.kind() == "a")
        .and_then(|t| t.content())
        .expect("an a tag")
        .to_string();
    json!({"kinds": [1621], "#a": [repo]})
}

/// `(created_at, id)` of `events`.
pub fn records<'a>(events: impl IntoIterator<Item = &'a Event>) -> Vec<(Timestamp, EventId)> {
    events.into_iter().map(|e| (e.created_at, e.id)).collect()
}

/// The `percent` % of `events` a client lacks, spread evenly over old and new ones
/// (`len * percent / 100` of them; 0 → none, 100 → all).
pub fn missing_share(events: &[Event], percent: usize) -> HashSet<EventId> {
    events
        .iter()
        .enumerate()
        .filter(|(i, _)| i * percent / 100 != (i + 1) * percent / 100)
        .map(|(_, e)| e.id)
        .collect()
}
