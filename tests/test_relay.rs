//! Tests for `grasp_sync::testing::TestRelay`, driven by a plain tungstenite client.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use grasp_sync::testing::{
    wait_until, NgitGraspPolicy, Profile, Reply, TestRelay, TestRelayOptions, WriteRate,
};
use negentropy::{Negentropy, NegentropyStorageVector};
use nostr::event::{Event, EventBuilder, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;
use nostr::types::Timestamp;
use serde_json::{json, Value};
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

/// Generous deadline for anything that should happen.
const WAIT: Duration = Duration::from_secs(5);
/// How long we listen to assert that nothing arrives.
const QUIET: Duration = Duration::from_millis(300);

const REPO_A: &str = "30617:0000000000000000000000000000000000000000000000000000000000000001:repo";

struct Client {
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
}

impl Client {
    fn connect(relay: &TestRelay) -> Client {
        let (ws, _) = tungstenite::connect(relay.url()).expect("connect to test relay");
        Client { ws }
    }

    fn set_timeout(&mut self, timeout: Duration) {
        match self.ws.get_ref() {
            MaybeTlsStream::Plain(s) => s.set_read_timeout(Some(timeout)).unwrap(),
            _ => unreachable!("plain ws only"),
        }
    }

    fn send(&mut self, text: &str) {
        self.ws.send(Message::text(text)).expect("send");
    }

    fn send_json(&mut self, value: Value) {
        self.send(&value.to_string());
    }

    /// Next text frame within `timeout`; `None` on timeout. Panics if the
    /// connection breaks.
    fn recv_text_within(&mut self, timeout: Duration) -> Option<String> {
        self.set_timeout(timeout);
        let deadline = Instant::now() + timeout;
        loop {
            match self.ws.read() {
                Ok(Message::Text(t)) => return Some(t.as_str().to_string()),
                Ok(_) => {}
                Err(tungstenite::Error::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if Instant::now() >= deadline {
                        return None;
                    }
                }
                Err(e) => panic!("connection broke: {e}"),
            }
        }
    }

    fn recv_text(&mut self) -> String {
        self.recv_text_within(WAIT)
            .expect("a message within the deadline")
    }

    fn recv(&mut self) -> Value {
        let text = self.recv_text();
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad JSON {text}: {e}"))
    }

    fn assert_quiet(&mut self) {
        if let Some(text) = self.recv_text_within(QUIET) {
            panic!("expected silence, got {text}");
        }
    }

    fn publish(&mut self, event: &Event) -> Value {
        self.send(&format!(r#"["EVENT",{}]"#, event.as_json()));
        let ok = self.recv();
        assert_eq!(ok[0], "OK", "{ok}");
        assert_eq!(ok[1], event.id.to_hex(), "{ok}");
        ok
    }

    /// Sends a REQ and collects the event ids up to EOSE.
    fn req_until_eose(&mut self, sub: &str, filters: &[Value]) -> Vec<String> {
        let mut msg = vec![json!("REQ"), json!(sub)];
        msg.extend(filters.iter().cloned());
        self.send_json(Value::Array(msg));
        let mut ids = Vec::new();
        loop {
            let m = self.recv();
            match m[0].as_str() {
                Some("EVENT") => {
                    assert_eq!(m[1], sub, "{m}");
                    ids.push(m[2]["id"].as_str().unwrap().to_string());
                }
                Some("EOSE") => {
                    assert_eq!(m[1], sub, "{m}");
                    return ids;
                }
                _ => panic!("unexpected {m}"),
            }
        }
    }

    /// Waits until the connection is closed by the relay.
    fn expect_closed(&mut self) {
        self.set_timeout(Duration::from_millis(50));
        let deadline = Instant::now() + WAIT;
        loop {
            match self.ws.read() {
                Ok(_) => {}
                Err(tungstenite::Error::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    assert!(Instant::now() < deadline, "connection still open");
                }
                Err(_) => return,
            }
        }
    }
}

fn issue(keys: &Keys, created_at: u64, content: &str) -> Event {
    EventBuilder::new(Kind::Custom(1621), content)
        .tag(Tag::parse(["a", REPO_A]).unwrap())
        .custom_created_at(Timestamp::from_secs(created_at))
        .finalize(keys)
        .unwrap()
}

fn announcement(keys: &Keys, created_at: u64, d: &str) -> Event {
    EventBuilder::new(Kind::Custom(30617), "")
        .tag(Tag::parse(["d", d]).unwrap())
        .custom_created_at(Timestamp::from_secs(created_at))
        .finalize(keys)
        .unwrap()
}

fn ids(events: &[&Event]) -> Vec<String> {
    events.iter().map(|e| e.id.to_hex()).collect()
}

fn issues_filter() -> Value {
    json!({"kinds": [1621]})
}

#[test]
fn publish_ok_then_duplicate() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let ev = issue(&keys, 1000, "hello");
    let mut c = Client::connect(&relay);

    let ok = c.publish(&ev);
    assert_eq!(ok, json!(["OK", ev.id.to_hex(), true, ""]));
    let ok = c.publish(&ev);
    assert_eq!(ok[2], true);
    assert!(ok[3].as_str().unwrap().starts_with("duplicate:"), "{ok}");

    assert_eq!(relay.len(), 1);
    assert!(relay.contains(&ev.id));
    assert!(relay.event_ids().contains(&ev.id));
    assert_eq!(relay.events(), vec![ev]);
}

#[test]
fn forged_signature_is_rejected() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let a = issue(&keys, 1000, "a");
    let b = issue(&keys, 1000, "b");
    // a's id and content with b's signature.
    let mut forged: Value = serde_json::from_str(&a.as_json()).unwrap();
    forged["sig"] = json!(b.sig.to_string());
    let mut c = Client::connect(&relay);
    c.send_json(json!(["EVENT", forged]));
    assert_eq!(
        c.recv(),
        json!(["OK", a.id.to_hex(), false, "invalid: bad signature"])
    );
    // Tampered content (id no longer matches).
    let mut tampered: Value = serde_json::from_str(&a.as_json()).unwrap();
    tampered["content"] = json!("changed");
    c.send_json(json!(["EVENT", tampered]));
    let ok = c.recv();
    assert_eq!(ok[2], false, "{ok}");
    assert!(ok[3].as_str().unwrap().starts_with("invalid:"), "{ok}");
    assert!(relay.is_empty());
}

#[test]
fn reject_events_hook() {
    let relay = TestRelay::start();
    relay.set_reject_events(Some("blocked: not on my relay".into()));
    let ev = issue(&Keys::generate(), 1000, "x");
    let mut c = Client::connect(&relay);
    let ok = c.publish(&ev);
    assert_eq!(
        ok,
        json!(["OK", ev.id.to_hex(), false, "blocked: not on my relay"])
    );
    assert!(relay.is_empty());
    relay.set_reject_events(None);
    assert_eq!(c.publish(&ev)[2], true);
    assert_eq!(relay.len(), 1);
}

#[test]
fn req_serves_stored_newest_first_then_eose() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let e1 = issue(&keys, 1000, "one");
    let e2 = issue(&keys, 3000, "two");
    let e3 = issue(&keys, 2000, "three");
    let other = EventBuilder::new(Kind::TextNote, "note")
        .finalize(&keys)
        .unwrap();
    for e in [&e1, &e2, &e3, &other] {
        assert!(relay.insert(e));
    }
    let mut c = Client::connect(&relay);
    let got = c.req_until_eose("s1", &[issues_filter()]);
    assert_eq!(got, ids(&[&e2, &e3, &e1]));

    // Several filters: union, deduplicated, still newest first.
    let got = c.req_until_eose(
        "s2",
        &[
            json!({"ids": [e1.id.to_hex()]}),
            json!({"kinds": [1621], "limit": 1}),
            json!({"kinds": [1]}),
        ],
    );
    let mut expected = [
        (other.created_at, other.id),
        (e2.created_at, e2.id),
        (e1.created_at, e1.id),
    ];
    expected.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    assert_eq!(
        got,
        expected
            .iter()
            .map(|(_, id)| id.to_hex())
            .collect::<Vec<_>>()
    );

    // limit 0: no stored events, only EOSE.
    assert!(c
        .req_until_eose("s3", &[json!({"kinds": [1621], "limit": 0})])
        .is_empty());
    assert_eq!(relay.open_subscriptions(), 3);
}

#[test]
fn raw_events_are_served_verbatim() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let ev = issue(&keys, 1000, "verbatim");
    // Same event with odd spacing and a forged signature.
    let mut v: Value = serde_json::from_str(&ev.as_json()).unwrap();
    v["sig"] = json!("00".repeat(64));
    let raw = serde_json::to_string_pretty(&v).unwrap();
    assert!(relay.insert_raw(&raw).unwrap());
    assert!(relay.insert_raw("not json").is_err());
    assert_eq!(relay.raw_events(), vec![raw.clone()]);

    let mut c = Client::connect(&relay);
    c.send(r#"["REQ","v",{"kinds":[1621]}]"#);
    assert_eq!(c.recv_text(), format!(r#"["EVENT","v",{raw}]"#));
    assert_eq!(c.recv(), json!(["EOSE", "v"]));
}

#[test]
fn live_delivery_after_eose() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let mut sub = Client::connect(&relay);
    assert!(sub.req_until_eose("live", &[issues_filter()]).is_empty());

    // Published by another client.
    let mut publisher = Client::connect(&relay);
    let e1 = issue(&keys, 1000, "live one");
    assert_eq!(publisher.publish(&e1)[2], true);
    let m = sub.recv();
    assert_eq!(m[0], "EVENT");
    assert_eq!(m[1], "live");
    assert_eq!(m[2]["id"], e1.id.to_hex());

    // Inserted by the test.
    let e2 = issue(&keys, 900, "older, still live");
    assert!(relay.insert(&e2));
    let m = sub.recv();
    assert_eq!(m[2]["id"], e2.id.to_hex());

    // Non-matching events and duplicates are not delivered.
    let note = EventBuilder::new(Kind::TextNote, "n")
        .finalize(&keys)
        .unwrap();
    assert_eq!(publisher.publish(&note)[2], true);
    assert_eq!(publisher.publish(&e1)[2], true);
    sub.assert_quiet();

    // After CLOSE nothing more arrives.
    sub.send(r#"["CLOSE","live"]"#);
    assert!(wait_until(WAIT, || relay.open_subscriptions() == 0));
    assert!(relay.insert(&issue(&keys, 1100, "after close")));
    sub.assert_quiet();
}

/// Issue 10: a connection thread used to notice a published event only at its next 20 ms read
/// timeout. It now waits for a frame to send, client input, a delayed EOSE and `stop` at
/// once: with an idle wait far longer than the deadlines below, everything still arrives, and
/// `stop` closes each connection with a close frame (a thread that did not wake would be cut
/// off without one after the stop grace period).
#[test]
fn nothing_waits_for_the_idle_wait() {
    let relay = TestRelay::start();
    let idle = Duration::from_secs(3600);
    relay.set_idle_wait(idle);
    let within = Duration::from_secs(60);
    let keys = Keys::generate();
    let mut sub = Client::connect(&relay);
    sub.send_json(json!(["REQ", "live", issues_filter()]));
    assert_eq!(sub.recv_text_within(within).unwrap(), r#"["EOSE","live"]"#);

    // Inserted by the test, then published by another client: both reach the subscriber.
    let e1 = issue(&keys, 1000, "inserted");
    assert!(relay.insert(&e1));
    let m: Value = serde_json::from_str(&sub.recv_text_within(within).unwrap()).unwrap();
    assert_eq!(m[2]["id"], e1.id.to_hex(), "{m}");
    let mut publisher = Client::connect(&relay);
    let e2 = issue(&keys, 1001, "published");
    publisher.send(&format!(r#"["EVENT",{}]"#, e2.as_json()));
    let ok: Value = serde_json::from_str(&publisher.recv_text_within(within).unwrap()).unwrap();
    assert_eq!(ok[2], true, "{ok}");
    let m: Value = serde_json::from_str(&sub.recv_text_within(within).unwrap()).unwrap();
    assert_eq!(m[2]["id"], e2.id.to_hex(), "{m}");

    // A delayed EOSE is sent at its time.
    relay.set_eose_delay(Some(Duration::from_millis(100)));
    sub.send_json(json!(["REQ", "later", {"kinds": [7]}]));
    assert_eq!(sub.recv_text_within(within).unwrap(), r#"["EOSE","later"]"#);

    relay.stop();
    for c in [&mut sub, &mut publisher] {
        c.set_timeout(within);
        loop {
            match c.ws.read() {
                Ok(Message::Close(_)) => break,
                Ok(_) => {}
                Err(e) => panic!("the connection ended without a close frame: {e}"),
            }
        }
    }
}

#[test]
fn result_cap_limits_each_filter() {
    let relay = TestRelay::start_with(TestRelayOptions {
        result_cap: Some(2),
        ..Default::default()
    });
    let keys = Keys::generate();
    let events: Vec<Event> = (0..5).map(|i| issue(&keys, 1000 + i, "e")).collect();
    for e in &events {
        relay.insert(e);
    }
    let mut c = Client::connect(&relay);
    let got = c.req_until_eose("a", &[json!({"kinds": [1621], "limit": 10})]);
    assert_eq!(got, ids(&[&events[4], &events[3]]));
    let got = c.req_until_eose("b", &[json!({"kinds": [1621], "limit": 1})]);
    assert_eq!(got, ids(&[&events[4]]));
    let got = c.req_until_eose("c", &[issues_filter()]);
    assert_eq!(got.len(), 2);

    relay.set_result_cap(None);
    assert_eq!(c.req_until_eose("d", &[issues_filter()]).len(), 5);
}

#[test]
fn withheld_eose_still_delivers_events() {
    let relay = TestRelay::start();
    relay.set_withhold_eose(true);
    let keys = Keys::generate();
    let e1 = issue(&keys, 1000, "a");
    let e2 = issue(&keys, 2000, "b");
    relay.insert(&e1);
    relay.insert(&e2);
    let mut c = Client::connect(&relay);
    c.send_json(json!(["REQ", "w", issues_filter()]));
    assert_eq!(c.recv()[2]["id"], e2.id.to_hex());
    assert_eq!(c.recv()[2]["id"], e1.id.to_hex());
    c.assert_quiet();
    // The subscription is open: live events still arrive.
    let e3 = issue(&keys, 3000, "c");
    relay.insert(&e3);
    let m = c.recv();
    assert_eq!(
        (m[0].as_str(), m[2]["id"].as_str()),
        (Some("EVENT"), Some(&*e3.id.to_hex()))
    );
}

#[test]
fn delayed_eose_does_not_block_the_connection() {
    let relay = TestRelay::start();
    let delay = Duration::from_secs(1);
    relay.set_eose_delay(Some(delay));
    let keys = Keys::generate();
    let e1 = issue(&keys, 1000, "a");
    relay.insert(&e1);
    let mut c = Client::connect(&relay);
    let sent = Instant::now();
    c.send_json(json!(["REQ", "d", issues_filter()]));
    assert_eq!(c.recv()[2]["id"], e1.id.to_hex());
    // The connection keeps answering while EOSE is pending.
    let e2 = issue(&keys, 2000, "b");
    assert_eq!(c.publish(&e2)[2], true);
    assert!(
        sent.elapsed() < delay,
        "publish was answered only after the EOSE delay"
    );
    assert_eq!(c.recv()[2]["id"], e2.id.to_hex(), "live event");
    assert_eq!(c.recv(), json!(["EOSE", "d"]));
    assert!(sent.elapsed() >= delay);

    // A subscription replaced before its delayed EOSE gets only the new EOSE.
    c.send_json(json!(["REQ", "r", {"kinds": [7]}]));
    c.send_json(json!(["REQ", "r", {"kinds": [8]}]));
    assert_eq!(c.recv(), json!(["EOSE", "r"]));
    c.assert_quiet();
}

#[test]
fn closed_on_req() {
    let relay = TestRelay::start();
    relay.set_closed_on_req(Some("blocked: go away".into()));
    let mut c = Client::connect(&relay);
    c.send_json(json!(["REQ", "x", issues_filter()]));
    assert_eq!(c.recv(), json!(["CLOSED", "x", "blocked: go away"]));
    c.assert_quiet();
    assert_eq!(relay.reqs().len(), 1);
    assert_eq!(relay.open_subscriptions(), 0);

    relay.set_closed_on_req(None);
    assert!(c.req_until_eose("x", &[issues_filter()]).is_empty());
    assert_eq!(relay.open_subscriptions(), 1);
}

#[test]
fn max_subscriptions_with_closed_reply() {
    let relay = TestRelay::start_with(TestRelayOptions {
        max_subscriptions: Some(2),
        ..Default::default()
    });
    let mut c = Client::connect(&relay);
    c.req_until_eose("a", &[issues_filter()]);
    c.req_until_eose("b", &[issues_filter()]);
    c.send_json(json!(["REQ", "c", issues_filter()]));
    assert_eq!(
        c.recv(),
        json!(["CLOSED", "c", "error: too many subscriptions"])
    );
    // Replacing an open subscription is allowed.
    c.req_until_eose("a", &[json!({"kinds": [1]})]);
    // The limit is per connection.
    let mut other = Client::connect(&relay);
    other.req_until_eose("c", &[issues_filter()]);
    assert_eq!(relay.open_subscriptions(), 3);
    // Closing one frees a slot.
    c.send(r#"["CLOSE","b"]"#);
    assert!(wait_until(WAIT, || relay.open_subscriptions() == 2));
    c.req_until_eose("c", &[issues_filter()]);
    assert_eq!(relay.max_open_subscriptions_per_connection(), 2);
    assert_eq!(relay.reqs().len(), 6);
}

#[test]
fn max_subscriptions_with_notice_reply() {
    let relay = TestRelay::start();
    relay.set_max_subscriptions(Some(1));
    relay.set_too_many_subs_reply(Reply::Notice("ERROR: too many concurrent REQs".into()));
    let mut c = Client::connect(&relay);
    c.req_until_eose("a", &[issues_filter()]);
    c.send_json(json!(["REQ", "b", issues_filter()]));
    assert_eq!(
        c.recv(),
        json!(["NOTICE", "ERROR: too many concurrent REQs"])
    );
    c.assert_quiet();
    assert_eq!(relay.open_subscriptions(), 1);
    assert_eq!(relay.max_open_subscriptions_per_connection(), 1);
}

#[test]
fn reqs_are_recorded() {
    let relay = TestRelay::start();
    let before = Instant::now();
    let mut c1 = Client::connect(&relay);
    let mut c2 = Client::connect(&relay);
    let raw = r##"["REQ","r1",{"kinds":[1621],"#a":["30617:00:repo"]},{"ids":[]}]"##;
    c1.send(raw);
    assert_eq!(c1.recv(), json!(["EOSE", "r1"]));
    c2.req_until_eose("r2", &[json!({"kinds": [1617], "limit": 5})]);

    let reqs = relay.reqs();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].sub_id, "r1");
    assert_eq!(reqs[0].raw, raw);
    assert_eq!(reqs[0].filters.len(), 2);
    assert!(reqs[0].filters[0]
        .kinds
        .as_ref()
        .unwrap()
        .contains(&Kind::Custom(1621)));
    assert_eq!(reqs[1].sub_id, "r2");
    assert_eq!(reqs[1].filters[0].limit, Some(5));
    assert_ne!(reqs[0].conn, reqs[1].conn);
    assert!(reqs[0].at >= before && reqs[1].at >= reqs[0].at);
    assert_eq!(relay.connections_accepted(), 2);
    assert_eq!(relay.current_connections(), 2);

    relay.clear_reqs();
    assert!(relay.reqs().is_empty());
}

#[test]
fn garbage_gets_a_notice() {
    let relay = TestRelay::start();
    let mut c = Client::connect(&relay);
    for garbage in [
        "hello",
        "{}",
        "[]",
        r#"["FOO","x"]"#,
        r#"["REQ","x"]"#,
        r#"["REQ","x",{"kinds":"nope"}]"#,
        r#"["EVENT",{"id":"zz"}]"#,
    ] {
        c.send(garbage);
        assert_eq!(
            c.recv(),
            json!(["NOTICE", "could not parse command"]),
            "{garbage}"
        );
    }
    // The connection is still usable.
    assert!(c.req_until_eose("ok", &[issues_filter()]).is_empty());
}

#[test]
fn injected_frames() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let mut c = Client::connect(&relay);
    c.req_until_eose("s1", &[issues_filter()]);
    c.req_until_eose("s2", &[json!({"kinds": [1]})]);

    relay.send_notice("hi there");
    assert_eq!(c.recv(), json!(["NOTICE", "hi there"]));
    relay.send_auth("challenge-1");
    assert_eq!(c.recv(), json!(["AUTH", "challenge-1"]));
    relay.send_raw("}{ garbage");
    assert_eq!(c.recv_text(), "}{ garbage");

    // Pushed to every subscription regardless of its filter; not stored.
    let note = EventBuilder::new(Kind::TextNote, "pushed")
        .finalize(&keys)
        .unwrap();
    relay.push_to_subscriptions(&note.as_json());
    let mut subs = vec![
        c.recv()[1].as_str().unwrap().to_string(),
        c.recv()[1].as_str().unwrap().to_string(),
    ];
    subs.sort();
    assert_eq!(subs, ["s1", "s2"]);
    assert!(relay.is_empty());

    relay.send_closed_all("error: shutting down");
    let mut closed = vec![c.recv(), c.recv()];
    closed.sort_by_key(|m| m[1].as_str().unwrap().to_string());
    assert_eq!(
        closed,
        vec![
            json!(["CLOSED", "s1", "error: shutting down"]),
            json!(["CLOSED", "s2", "error: shutting down"]),
        ]
    );
    assert_eq!(relay.open_subscriptions(), 0);
    relay.insert(&issue(&keys, 1000, "no longer delivered"));
    c.assert_quiet();
}

fn http_get(relay: &TestRelay, accept: Option<&str>) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", relay.port())).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n{accept}Connection: close\r\n\r\n",
        relay.port()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn nip11_document() {
    let relay = TestRelay::start();
    let not_configured = http_get(&relay, Some("application/nostr+json"));
    assert!(
        not_configured.starts_with("HTTP/1.1 404"),
        "{not_configured}"
    );

    let doc = json!({"name": "test relay", "supported_nips": [1, 11], "limitation": {"max_subscriptions": 20}});
    relay.set_nip11(Some(doc.clone()));
    let resp = http_get(&relay, Some("application/nostr+json"));
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.lines()
            .any(|l| l.eq_ignore_ascii_case("content-type: application/nostr+json")),
        "{head}"
    );
    assert_eq!(serde_json::from_str::<Value>(body).unwrap(), doc);

    // Without the Accept header: 404, not counted.
    let plain = http_get(&relay, None);
    assert!(plain.starts_with("HTTP/1.1 404"), "{plain}");
    assert_eq!(relay.nip11_requests(), 2);
    assert_eq!(relay.connections_accepted(), 0);
    assert_eq!(relay.tcp_accepts(), 3);

    // Websockets still work on the same port.
    let mut c = Client::connect(&relay);
    assert!(c.req_until_eose("s", &[issues_filter()]).is_empty());
}

#[test]
fn refuse_connections() {
    let relay = TestRelay::start_with(TestRelayOptions {
        refuse_connections: true,
        ..Default::default()
    });
    assert!(tungstenite::connect(relay.url()).is_err());
    assert_eq!(relay.tcp_accepts(), 1);
    assert_eq!(relay.connections_accepted(), 0);
    relay.set_refuse_connections(false);
    let mut c = Client::connect(&relay);
    assert!(c.req_until_eose("s", &[issues_filter()]).is_empty());
    assert_eq!(relay.connections_accepted(), 1);
}

#[test]
fn drop_connections_closes_every_connection() {
    let relay = TestRelay::start();
    let mut c1 = Client::connect(&relay);
    let mut c2 = Client::connect(&relay);
    c1.req_until_eose("a", &[issues_filter()]);
    c2.req_until_eose("b", &[issues_filter()]);
    assert_eq!(relay.current_connections(), 2);

    relay.drop_connections();
    assert_eq!(relay.current_connections(), 0);
    assert_eq!(relay.open_subscriptions(), 0);
    c1.expect_closed();
    c2.expect_closed();

    // The relay still accepts new connections.
    let mut c3 = Client::connect(&relay);
    assert!(c3.req_until_eose("c", &[issues_filter()]).is_empty());
    assert_eq!(relay.connections_accepted(), 3);
    assert_eq!(relay.max_open_subscriptions_per_connection(), 1);
}

#[test]
fn replaceable_and_addressable_replacement() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let mut c = Client::connect(&relay);

    let old = announcement(&keys, 100, "repo");
    let new = announcement(&keys, 200, "repo");
    let other_d = announcement(&keys, 50, "other");
    assert_eq!(c.publish(&old)[2], true);
    assert_eq!(c.publish(&other_d)[2], true);
    assert_eq!(c.publish(&new)[2], true);
    assert!(!relay.contains(&old.id));
    assert!(relay.contains(&new.id));
    assert!(relay.contains(&other_d.id));
    // An older version is refused the way strfry does.
    assert_eq!(
        c.publish(&old),
        json!(["OK", old.id.to_hex(), false, "replaced: have newer event"])
    );
    // Another author's slot is separate.
    let theirs = announcement(&Keys::generate(), 10, "repo");
    assert!(relay.insert(&theirs));
    assert_eq!(relay.len(), 3);

    // Same timestamp: the lowest id wins.
    let t1 = announcement(&keys, 500, "tie");
    let t2 = EventBuilder::new(Kind::Custom(30617), "different content")
        .tag(Tag::parse(["d", "tie"]).unwrap())
        .custom_created_at(Timestamp::from_secs(500))
        .finalize(&keys)
        .unwrap();
    let (low, high) = if t1.id < t2.id { (t1, t2) } else { (t2, t1) };
    assert!(relay.insert(&high));
    assert!(relay.insert(&low));
    assert!(!relay.insert(&high));
    assert!(relay.contains(&low.id) && !relay.contains(&high.id));

    // Replaceable kind: one per (pubkey, kind).
    let list = |t: u64| {
        EventBuilder::new(Kind::Custom(10002), "")
            .custom_created_at(Timestamp::from_secs(t))
            .finalize(&keys)
            .unwrap()
    };
    let (l1, l2) = (list(100), list(200));
    assert_eq!(c.publish(&l1)[2], true);
    assert_eq!(c.publish(&l2)[2], true);
    assert!(!relay.contains(&l1.id) && relay.contains(&l2.id));

    // Regular kinds are never replaced.
    let (i1, i2) = (issue(&keys, 1, "a"), issue(&keys, 2, "b"));
    relay.insert(&i1);
    relay.insert(&i2);
    assert!(relay.contains(&i1.id) && relay.contains(&i2.id));
}

#[test]
fn stop_is_prompt_and_port_can_be_reused() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let ev = issue(&keys, 1000, "persisted");
    relay.insert(&ev);
    let port = relay.port();

    let mut clients: Vec<Client> = (0..3).map(|_| Client::connect(&relay)).collect();
    for (i, c) in clients.iter_mut().enumerate() {
        c.req_until_eose(&format!("s{i}"), &[issues_filter()]);
    }
    // A client that never sends its HTTP request.
    let silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    assert!(wait_until(WAIT, || relay.tcp_accepts() == 4));

    let started = Instant::now();
    let raw = relay.raw_events();
    relay.stop();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "stop took {:?}",
        started.elapsed()
    );
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    for c in &mut clients {
        c.expect_closed();
    }
    drop(silent);
    drop(relay);

    // "Restart": same port, same store.
    let relay = TestRelay::start_with_store(port, TestRelayOptions::default(), raw).unwrap();
    assert_eq!(relay.port(), port);
    let mut c = Client::connect(&relay);
    assert_eq!(c.req_until_eose("again", &[issues_filter()]), ids(&[&ev]));

    // restart() keeps store and options.
    relay.set_result_cap(Some(7));
    let relay = relay.restart().unwrap();
    assert_eq!(relay.port(), port);
    assert_eq!(relay.options().result_cap, Some(7));
    assert!(relay.contains(&ev.id));
    c.expect_closed();
    let mut c = Client::connect(&relay);
    assert_eq!(c.req_until_eose("third", &[issues_filter()]), ids(&[&ev]));

    let started = Instant::now();
    drop(relay);
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[test]
fn start_on_port_and_url() {
    let first = TestRelay::start();
    let port = first.port();
    assert_eq!(first.url(), format!("ws://127.0.0.1:{port}"));
    first.stop();
    let second = TestRelay::start_on_port(port, TestRelayOptions::default()).unwrap();
    assert_eq!(second.url(), format!("ws://127.0.0.1:{port}"));
    // Binding a port in use fails (after the retry window).
    let busy = TestRelay::start_on_port(port, TestRelayOptions::default());
    assert!(busy.is_err());
}

#[test]
fn wait_until_times_out() {
    let started = Instant::now();
    assert!(!wait_until(Duration::from_millis(50), || false));
    assert!(started.elapsed() >= Duration::from_millis(50));
    let mut n = 0;
    assert!(wait_until(WAIT, || {
        n += 1;
        n == 3
    }));
}

// ----- fault injection for tests/faults.rs -----

#[test]
fn live_delivery_applies_since_until_and_limit_zero_serves_only_live() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let stored = issue(&keys, 1500, "stored");
    relay.insert(&stored);
    let mut c = Client::connect(&relay);
    // limit 0: no stored events, but live ones.
    let got = c.req_until_eose("z", &[json!({"kinds": [1621], "limit": 0})]);
    assert!(got.is_empty(), "limit 0 served stored events: {got:?}");
    let got = c.req_until_eose(
        "w",
        &[json!({"kinds": [1621], "since": 1000, "until": 2000})],
    );
    assert_eq!(got, ids(&[&stored]));

    // Live: `since`/`until` filter live events too.
    let too_old = issue(&keys, 900, "older than since");
    let too_new = issue(&keys, 2100, "newer than until");
    let inside = issue(&keys, 1600, "inside");
    for e in [&too_old, &too_new, &inside] {
        relay.insert(e);
    }
    let mut got: Vec<(String, String)> = Vec::new();
    while let Some(text) = c.recv_text_within(QUIET) {
        let m: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(m[0], "EVENT", "{m}");
        got.push((
            m[1].as_str().unwrap().to_string(),
            m[2]["id"].as_str().unwrap().to_string(),
        ));
    }
    let inside_hex = inside.id.to_hex();
    let mut want = vec![
        ("w".to_string(), inside_hex.clone()),
        ("z".to_string(), inside_hex),
        ("z".to_string(), too_old.id.to_hex()),
        ("z".to_string(), too_new.id.to_hex()),
    ];
    want.sort();
    got.sort();
    assert_eq!(got, want);
}

#[test]
fn drop_mid_answer_cuts_one_answer_then_disarms() {
    let relay = TestRelay::start_with(TestRelayOptions {
        result_cap: Some(5),
        ..Default::default()
    });
    let keys = Keys::generate();
    let events: Vec<Event> = (0..8).map(|i| issue(&keys, 1000 + i, "e")).collect();
    for e in &events {
        relay.insert(e);
    }
    relay.set_drop_mid_answer(Some(2));
    // An answer of at most 2 events is not cut.
    let mut c = Client::connect(&relay);
    let got = c.req_until_eose("small", &[json!({"kinds": [1621], "limit": 2})]);
    assert_eq!(got.len(), 2);
    assert_eq!(relay.mid_answer_drops(), 0);

    // The next longer answer: its two newest events, no EOSE, then the connection is gone.
    c.send_json(json!(["REQ", "big", issues_filter()]));
    for want in [&events[7], &events[6]] {
        let m = c.recv();
        assert_eq!(m[0], "EVENT", "{m}");
        assert_eq!(m[2]["id"], want.id.to_hex());
    }
    c.expect_closed();
    assert_eq!(relay.mid_answer_drops(), 1);
    assert!(wait_until(WAIT, || relay.current_connections() == 0));

    // One-shot: the next connection gets whole answers.
    let mut c2 = Client::connect(&relay);
    assert_eq!(c2.req_until_eose("again", &[issues_filter()]).len(), 5);
    assert_eq!(relay.mid_answer_drops(), 1);

    // Disarming before it fires.
    relay.set_drop_mid_answer(Some(1));
    relay.set_drop_mid_answer(None);
    assert_eq!(c2.req_until_eose("again2", &[issues_filter()]).len(), 5);
    assert_eq!(relay.mid_answer_drops(), 1);
}

#[test]
fn send_closed_closes_one_subscription() {
    let relay = TestRelay::start();
    let keys = Keys::generate();
    let mut c = Client::connect(&relay);
    c.req_until_eose("a", &[issues_filter()]);
    c.req_until_eose("b", &[issues_filter()]);
    let subs = relay.subscription_ids();
    assert_eq!(subs.len(), 2);
    assert_eq!(subs[0].1, "a");
    assert_eq!(subs[1].1, "b");
    let conn = subs[1].0;

    assert!(!relay.send_closed(conn, "nope", "error: x"));
    assert!(!relay.send_closed(conn + 100, "b", "error: x"));
    assert!(relay.send_closed(conn, "b", "error: shutting down"));
    assert_eq!(c.recv(), json!(["CLOSED", "b", "error: shutting down"]));
    assert_eq!(relay.subscription_ids(), vec![(conn, "a".to_string())]);
    assert!(!relay.send_closed(conn, "b", "error: again"));

    // "a" still gets live events, "b" not.
    let e = issue(&keys, 1000, "live");
    relay.insert(&e);
    let m = c.recv();
    assert_eq!(m[1], "a");
    assert_eq!(m[2]["id"], e.id.to_hex());
    c.assert_quiet();
}

// ----- relay profiles -----

/// The initial message of a negentropy session over an empty set, hex-encoded.
fn neg_initial() -> String {
    let mut storage = NegentropyStorageVector::new();
    storage.seal().unwrap();
    let mut neg = Negentropy::owned(storage, 0).unwrap();
    neg.initiate()
        .unwrap()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A REQ of exactly `size` bytes (one long `#t` value).
fn req_of_size(sub: &str, size: usize) -> String {
    let prefix = format!(r##"["REQ","{sub}",{{"#t":[""##);
    let suffix = r#""]}]"#;
    let req = format!(
        "{prefix}{}{suffix}",
        "a".repeat(size - prefix.len() - suffix.len())
    );
    assert_eq!(req.len(), size);
    req
}

fn note(keys: &Keys, created_at: u64, tags: &[&[&str]]) -> Event {
    let mut b = EventBuilder::new(Kind::TextNote, "note")
        .custom_created_at(Timestamp::from_secs(created_at));
    for t in tags {
        b = b.tag(Tag::parse(t.iter().copied()).unwrap());
    }
    b.finalize(keys).unwrap()
}

fn event_of_kind(keys: &Keys, kind: u16, created_at: u64, tags: &[&[&str]]) -> Event {
    let mut b = EventBuilder::new(Kind::Custom(kind), "")
        .custom_created_at(Timestamp::from_secs(created_at));
    for t in tags {
        b = b.tag(Tag::parse(t.iter().copied()).unwrap());
    }
    b.finalize(keys).unwrap()
}

impl Client {
    /// Sends `text`, ignoring a failure (the relay may drop the connection while it arrives).
    fn send_lossy(&mut self, text: &str) {
        let _ = self.ws.send(Message::text(text));
    }

    /// Waits until the relay drops the connection; panics if anything arrives first, a close
    /// frame included.
    fn expect_dropped_without_close_frame(&mut self) {
        self.set_timeout(Duration::from_millis(50));
        let deadline = Instant::now() + WAIT;
        loop {
            match self.ws.read() {
                Ok(Message::Close(frame)) => panic!("close frame {frame:?}"),
                Ok(m) => panic!("unexpected {m:?}"),
                Err(tungstenite::Error::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    assert!(Instant::now() < deadline, "connection still open");
                }
                Err(tungstenite::Error::ConnectionClosed) => panic!("closed by a close handshake"),
                Err(_) => return,
            }
        }
    }

    /// Opens `n` subscriptions `{prefix}{i}` matching nothing, each answered EOSE.
    fn open_empty_subs(&mut self, prefix: &str, n: usize) {
        for i in 0..n {
            let sub = format!("{prefix}{i}");
            assert!(self
                .req_until_eose(&sub, &[json!({"kinds": [7], "authors": [REPO_A_AUTHOR]})])
                .is_empty());
        }
    }
}

const REPO_A_AUTHOR: &str = "0000000000000000000000000000000000000000000000000000000000000001";

fn nip11_of(relay: &TestRelay) -> Value {
    let resp = http_get(relay, Some("application/nostr+json"));
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    serde_json::from_str(body).unwrap()
}

fn lists_77(doc: &Value) -> bool {
    doc["supported_nips"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n == 77)
}

#[test]
fn nostr_rs_relay_profile_refuses_the_33rd_subscription_with_a_notice_only() {
    let relay = TestRelay::start_profile(Profile::NostrRsRelay);
    let mut c = Client::connect(&relay);
    c.open_empty_subs("s", 32);
    c.send_json(json!(["REQ", "s32", issues_filter()]));
    assert_eq!(
        c.recv(),
        json!([
            "NOTICE",
            "Subscription error: Maximum concurrent subscription count reached"
        ])
    );
    c.assert_quiet();
    assert_eq!(relay.open_subscriptions(), 32);
    // Replacing an open subscription is allowed; closing one frees a slot.
    assert!(c.req_until_eose("s0", &[issues_filter()]).is_empty());
    c.send(r#"["CLOSE","s1"]"#);
    assert!(c.req_until_eose("s32", &[issues_filter()]).is_empty());
    assert_eq!(relay.max_open_subscriptions_per_connection(), 32);
}

#[test]
fn nostr_rs_relay_profile_sends_no_eose_when_every_filter_has_limit_zero() {
    let relay = TestRelay::start_profile(Profile::NostrRsRelay);
    let keys = Keys::generate();
    relay.insert(&issue(&keys, 1000, "stored"));
    let mut c = Client::connect(&relay);
    c.send_json(json!(["REQ", "z", {"kinds": [1621], "limit": 0}]));
    c.assert_quiet();
    assert_eq!(relay.open_subscriptions(), 1);
    // The subscription still gets live events.
    let live = issue(&keys, 2000, "live");
    relay.insert(&live);
    let m = c.recv();
    assert_eq!(m[0], "EVENT", "{m}");
    assert_eq!(m[1], "z");
    assert_eq!(m[2]["id"], live.id.to_hex());
    // One filter without limit 0 is enough for an EOSE.
    let got = c.req_until_eose(
        "y",
        &[
            json!({"kinds": [1621], "limit": 0}),
            json!({"kinds": [1], "limit": 5}),
        ],
    );
    assert!(got.is_empty());
}

#[test]
fn nostr_rs_relay_profile_ignores_a_repeated_identical_req() {
    let relay = TestRelay::start_profile(Profile::NostrRsRelay);
    let keys = Keys::generate();
    let e = issue(&keys, 1000, "stored");
    relay.insert(&e);
    let mut c = Client::connect(&relay);
    assert_eq!(c.req_until_eose("a", &[issues_filter()]), ids(&[&e]));
    c.send_json(json!(["REQ", "a", issues_filter()]));
    c.assert_quiet();
    // The same id with other filters replaces the subscription and is answered.
    assert!(c.req_until_eose("a", &[json!({"kinds": [1]})]).is_empty());
    // Another id with the same filters is a new subscription.
    assert_eq!(c.req_until_eose("b", &[issues_filter()]), ids(&[&e]));
    assert_eq!(relay.reqs().len(), 4);
    assert_eq!(relay.open_subscriptions(), 2);
}

#[test]
fn nostr_rs_relay_profile_nip11_nip77_and_duplicates() {
    let relay = TestRelay::start_profile(Profile::NostrRsRelay);
    let doc = nip11_of(&relay);
    assert_eq!(
        doc["software"],
        "https://git.sr.ht/~gheartsfield/nostr-rs-relay"
    );
    assert_eq!(doc["limitation"], json!({"payment_required": false}));
    assert!(!lists_77(&doc));

    let mut c = Client::connect(&relay);
    c.send_json(json!(["NEG-OPEN", "n", {"kinds": [1621]}, neg_initial()]));
    assert_eq!(c.recv(), json!(["NOTICE", "could not parse command"]));
    c.send_json(json!(["COUNT", "c", {}]));
    assert_eq!(c.recv(), json!(["NOTICE", "could not parse command"]));

    let e = issue(&Keys::generate(), 1000, "twice");
    assert_eq!(c.publish(&e), json!(["OK", e.id.to_hex(), true, ""]));
    assert_eq!(
        c.publish(&e),
        json!(["OK", e.id.to_hex(), true, "duplicate: "])
    );
}

#[test]
fn nostr_rs_relay_profile_drops_a_frame_over_256_kib_after_a_notice() {
    let relay = TestRelay::start_profile(Profile::NostrRsRelay);
    let mut c = Client::connect(&relay);
    // 256 KiB is accepted.
    c.send(&req_of_size("fits", 262_144));
    assert_eq!(c.recv(), json!(["EOSE", "fits"]));
    // Above it: the reason, then the connection is gone.
    c.send_lossy(&req_of_size("big", 300_000));
    assert_eq!(
        c.recv(),
        json!(["NOTICE", "message too large (300000 > 262144)"])
    );
    c.expect_dropped_without_close_frame();
    assert!(wait_until(WAIT, || relay.current_connections() == 0));
}

#[test]
fn strfry_profile_cuts_results_to_the_newest_500_silently() {
    let relay = TestRelay::start_profile(Profile::Strfry);
    let keys = Keys::generate();
    let events: Vec<Event> = (0..600).map(|i| issue(&keys, 1_000 + i, "e")).collect();
    for e in &events {
        relay.insert(e);
    }
    let newest: Vec<&Event> = events.iter().rev().take(500).collect();
    let mut c = Client::connect(&relay);
    assert_eq!(c.req_until_eose("none", &[issues_filter()]), ids(&newest));
    let got = c.req_until_eose("above", &[json!({"kinds": [1621], "limit": 1000})]);
    assert_eq!(got, ids(&newest));
    let got = c.req_until_eose("below", &[json!({"kinds": [1621], "limit": 10})]);
    assert_eq!(got, ids(&newest[..10]));
}

#[test]
fn strfry_profile_counts_negentropy_sessions_among_its_200_subscriptions() {
    let relay = TestRelay::start_profile(Profile::Strfry);
    let mut c = Client::connect(&relay);
    c.open_empty_subs("s", 199);
    c.send_json(json!(["NEG-OPEN", "neg", {"kinds": [1621]}, neg_initial()]));
    let m = c.recv();
    assert_eq!(m[0], "NEG-MSG", "{m}");
    assert_eq!(m[1], "neg");
    assert_eq!(relay.open_neg_sessions(), 1);

    // The 201st, as a REQ or as a NEG-OPEN.
    let too_many = json!(["NOTICE", "ERROR: too many concurrent REQs"]);
    c.send_json(json!(["REQ", "s199", issues_filter()]));
    assert_eq!(c.recv(), too_many);
    c.send_json(json!(["NEG-OPEN", "neg2", {"kinds": [1621]}, neg_initial()]));
    assert_eq!(c.recv(), too_many);
    c.assert_quiet();
    assert_eq!(relay.open_subscriptions(), 199);
    assert_eq!(relay.open_neg_sessions(), 1);

    // Closing the session frees a slot for a REQ.
    c.send(r#"["NEG-CLOSE","neg"]"#);
    assert!(wait_until(WAIT, || relay.open_neg_sessions() == 0));
    assert!(c.req_until_eose("s199", &[issues_filter()]).is_empty());
    assert_eq!(relay.open_subscriptions(), 200);
}

#[test]
fn strfry_profile_closes_a_filter_with_more_than_three_tag_keys() {
    let relay = TestRelay::start_profile(Profile::Strfry);
    let mut c = Client::connect(&relay);
    c.send_json(json!(["REQ", "four", {"#a": ["x"], "#e": ["y"], "#p": ["z"], "#t": ["w"]}]));
    assert_eq!(
        c.recv(),
        json!(["CLOSED", "four", "ERROR: bad req: too many tags in filter"])
    );
    c.assert_quiet();
    assert_eq!(relay.open_subscriptions(), 0);
    let three = json!({"#a": ["x"], "#e": ["y"], "#p": ["z"]});
    assert!(c.req_until_eose("three", &[three]).is_empty());
}

#[test]
fn strfry_profile_drops_a_frame_over_131072_bytes_without_a_close_frame() {
    let relay = TestRelay::start_profile(Profile::Strfry);
    let mut c = Client::connect(&relay);
    c.send(&req_of_size("fits", 131_072));
    assert_eq!(c.recv(), json!(["EOSE", "fits"]));
    c.send_lossy(&req_of_size("big", 131_073));
    c.expect_dropped_without_close_frame();
    assert!(wait_until(WAIT, || relay.current_connections() == 0));
}

#[test]
fn strfry_profile_nip11_negentropy_errors_and_duplicates() {
    let relay = TestRelay::start_profile(Profile::Strfry);
    let doc = nip11_of(&relay);
    assert!(lists_77(&doc));
    assert_eq!(doc["negentropy"], 1);
    assert_eq!(
        doc["limitation"],
        json!({"max_limit": 500, "max_message_length": 131072, "max_subscriptions": 200})
    );
    assert_eq!(relay.options().nip77_max_records, Some(1_000_000));

    let keys = Keys::generate();
    let mut c = Client::connect(&relay);
    c.send_json(json!(["NEG-MSG", "nobody", neg_initial()]));
    assert_eq!(
        c.recv(),
        json!(["NEG-ERR", "nobody", "closed: unknown subscription handle"])
    );
    // The record cap is strfry's option; a small one shows its text.
    for i in 0..3 {
        relay.insert(&issue(&keys, 1000 + i, "e"));
    }
    relay.set_nip77_max_records(Some(2));
    c.send_json(json!(["NEG-OPEN", "n", {"kinds": [1621]}, neg_initial()]));
    assert_eq!(
        c.recv(),
        json!(["NEG-ERR", "n", "blocked: too many query results"])
    );

    let e = issue(&keys, 5000, "twice");
    assert_eq!(c.publish(&e), json!(["OK", e.id.to_hex(), true, ""]));
    assert_eq!(
        c.publish(&e),
        json!(["OK", e.id.to_hex(), true, "duplicate: have this event"])
    );
    c.send_json(json!(["COUNT", "c", {}]));
    assert_eq!(c.recv(), json!(["NOTICE", "ERROR: bad msg: unknown cmd"]));
}

#[test]
fn ngit_relay_profile_rate_limits_writes_per_connection() {
    let relay = TestRelay::start_profile(Profile::NgitRelay);
    let keys = Keys::generate();
    // Repository states (30618) are always accepted by the relation rule.
    let mut n = 0u64;
    let mut state = || {
        n += 1;
        event_of_kind(&keys, 30618, 1000 + n, &[&["d", &format!("repo{n}")]])
    };
    let mut c = Client::connect(&relay);
    for _ in 0..15 {
        let e = state();
        assert_eq!(c.publish(&e), json!(["OK", e.id.to_hex(), true, ""]));
    }
    let e = state();
    assert_eq!(
        c.publish(&e),
        json!([
            "OK",
            e.id.to_hex(),
            false,
            "rate-limited: slow down, please"
        ])
    );
    assert_eq!(relay.len(), 15);
    // Another connection has its own bucket.
    let mut other = Client::connect(&relay);
    assert_eq!(other.publish(&e)[2], true);

    // A short interval: two at once, then one per 200 ms.
    relay.set_write_rate(Some(
        WriteRate::new(2, Duration::from_millis(200)).with_message("rate-limited: slow down"),
    ));
    for _ in 0..2 {
        assert_eq!(c.publish(&state())[2], true);
    }
    let e = state();
    assert_eq!(
        c.publish(&e),
        json!(["OK", e.id.to_hex(), false, "rate-limited: slow down"])
    );
    assert!(
        wait_until(WAIT, || c.publish(&e)[2] == true),
        "no token earned"
    );
    assert!(relay.contains(&e.id));
}

#[test]
fn ngit_relay_profile_accepts_only_events_relating_to_stored_ones() {
    let relay = TestRelay::start_profile(Profile::NgitRelay);
    relay.set_write_rate(None);
    let keys = Keys::generate();
    let pk = keys.public_key().to_hex();
    let own = format!("127.0.0.1:{}", relay.port());
    let not_related = "blocked: event does not relate to a stored repository";
    let mut c = Client::connect(&relay);
    let refused = |c: &mut Client, e: &Event, why: &str| {
        assert_eq!(c.publish(e), json!(["OK", e.id.to_hex(), false, why]));
        assert!(!relay.contains(&e.id));
    };
    let accepted = |c: &mut Client, e: &Event| {
        assert_eq!(c.publish(e), json!(["OK", e.id.to_hex(), true, ""]));
    };

    // An announcement must list the relay in a `clone` and a `relays` tag.
    let clone = format!("http://{own}/npub/repo.git");
    let relays = format!("ws://{own}");
    let unlisted =
        "blocked: repository announcement doesn't list ngit-relay in tags: clones and relays";
    let only_clone = event_of_kind(&keys, 30617, 1000, &[&["d", "repo"], &["clone", &clone]]);
    refused(&mut c, &only_clone, unlisted);
    let elsewhere = event_of_kind(
        &keys,
        30617,
        1001,
        &[
            &["d", "repo"],
            &["clone", "https://example.com/repo.git"],
            &["relays", "wss://example.com"],
        ],
    );
    refused(&mut c, &elsewhere, unlisted);
    let announcement = event_of_kind(
        &keys,
        30617,
        1002,
        &[
            &["d", "repo"],
            &["clone", "https://example.com/r.git", &clone],
            &["relays", &relays],
        ],
    );
    accepted(&mut c, &announcement);

    // A state of any repository is accepted.
    accepted(
        &mut c,
        &event_of_kind(&keys, 30618, 1003, &[&["d", "unknown"]]),
    );

    // An issue of the stored repository, a comment on that issue, a quote of it.
    let address = format!("30617:{pk}:repo");
    let issue = event_of_kind(&keys, 1621, 1004, &[&["a", &address]]);
    accepted(&mut c, &issue);
    let comment = event_of_kind(&keys, 1111, 1005, &[&["E", &issue.id.to_hex()]]);
    accepted(&mut c, &comment);
    accepted(&mut c, &note(&keys, 1006, &[&["q", &issue.id.to_hex()]]));
    // Issues of an unknown repository, replies to unknown events, plain notes are refused.
    let other_address = format!("30617:{pk}:other");
    refused(
        &mut c,
        &event_of_kind(&keys, 1621, 1007, &[&["a", &other_address]]),
        not_related,
    );
    let unknown = issue_id_of(&keys);
    refused(&mut c, &note(&keys, 1008, &[&["e", &unknown]]), not_related);
    refused(&mut c, &note(&keys, 1009, &[]), not_related);

    // An event a stored event refers to is accepted: a reply stored first (planted), then
    // the event it replies to.
    let root = note(&keys, 1010, &[]);
    refused(&mut c, &root, not_related);
    relay.insert(&note(&keys, 1011, &[&["e", &root.id.to_hex()]]));
    accepted(&mut c, &root);
}

/// The id of an event that is never stored.
fn issue_id_of(keys: &Keys) -> String {
    note(keys, 1, &[&["t", "never stored"]]).id.to_hex()
}

#[test]
fn ngit_relay_profile_answers_neg_open_as_khatru_and_duplicates_quietly() {
    let relay = TestRelay::start_profile(Profile::NgitRelay);
    let doc = nip11_of(&relay);
    assert!(!lists_77(&doc));
    let mut c = Client::connect(&relay);
    c.send_json(json!(["NEG-OPEN", "n", {"kinds": [1621]}, neg_initial()]));
    assert_eq!(
        c.recv(),
        json!(["NOTICE", "failed to parse envelope: unknown envelope label"])
    );
    let state = event_of_kind(&Keys::generate(), 30618, 1000, &[&["d", "repo"]]);
    assert_eq!(
        c.publish(&state),
        json!(["OK", state.id.to_hex(), true, ""])
    );
    assert_eq!(
        c.publish(&state),
        json!(["OK", state.id.to_hex(), true, ""])
    );
}

#[test]
fn local_relay_profile_allows_60_writes_then_one_a_second() {
    let relay = TestRelay::start_profile(Profile::LocalRelay);
    let keys = Keys::generate();
    let mut c = Client::connect(&relay);
    for i in 0..60 {
        let e = issue(&keys, 1000 + i, "e");
        assert_eq!(c.publish(&e), json!(["OK", e.id.to_hex(), true, ""]), "{i}");
    }
    let e = issue(&keys, 2000, "61st");
    assert_eq!(
        c.publish(&e),
        json!(["OK", e.id.to_hex(), false, "rate-limited: slow down"])
    );
    assert_eq!(relay.len(), 60);
    // One token a second.
    assert!(
        wait_until(WAIT, || c.publish(&e)[2] == true),
        "no token earned"
    );
    assert_eq!(relay.len(), 61);
}

#[test]
fn local_relay_profile_limits_unlimited_filters_to_500_and_refuses_the_501st_sub() {
    let relay = TestRelay::start_profile(Profile::LocalRelay);
    let plain = http_get(&relay, Some("application/nostr+json"));
    assert!(plain.starts_with("HTTP/1.1 404"), "{plain}");

    let keys = Keys::generate();
    let events: Vec<Event> = (0..600).map(|i| issue(&keys, 1_000 + i, "e")).collect();
    for e in &events {
        relay.insert(e);
    }
    let mut c = Client::connect(&relay);
    assert_eq!(c.req_until_eose("none", &[issues_filter()]).len(), 500);
    // A default, not a cap.
    let got = c.req_until_eose("many", &[json!({"kinds": [1621], "limit": 550})]);
    assert_eq!(got.len(), 550);

    c.open_empty_subs("s", 498);
    c.send_json(json!(["REQ", "s498", issues_filter()]));
    assert_eq!(
        c.recv(),
        json!(["CLOSED", "s498", "rate-limited: too many REQs"])
    );
    assert_eq!(relay.open_subscriptions(), 500);
}

#[test]
fn nip77_refusing_profile_lists_77_and_answers_with_a_notice() {
    let relay = TestRelay::start_profile(Profile::Nip77Refusing { silent: false });
    assert!(lists_77(&nip11_of(&relay)));
    let mut c = Client::connect(&relay);
    let disabled = json!(["NOTICE", "ERROR: bad msg: negentropy disabled"]);
    c.send_json(json!(["NEG-OPEN", "n", {"kinds": [1621]}, neg_initial()]));
    assert_eq!(c.recv(), disabled);
    c.send_json(json!(["NEG-MSG", "n", neg_initial()]));
    assert_eq!(c.recv(), disabled);
    c.send(r#"["NEG-CLOSE","n"]"#);
    assert_eq!(c.recv(), disabled);
    c.assert_quiet();
    assert_eq!(relay.open_neg_sessions(), 0);
    // REQs are served as usual.
    assert!(c.req_until_eose("r", &[issues_filter()]).is_empty());
}

#[test]
fn nip77_refusing_profile_can_stay_silent() {
    let relay = TestRelay::start_profile(Profile::Nip77Refusing { silent: true });
    assert!(lists_77(&nip11_of(&relay)));
    let mut c = Client::connect(&relay);
    c.send_json(json!(["NEG-OPEN", "n", {"kinds": [1621]}, neg_initial()]));
    c.assert_quiet();
    assert_eq!(relay.neg_opens().len(), 1);
    assert_eq!(relay.open_neg_sessions(), 0);
    assert!(c.req_until_eose("r", &[issues_filter()]).is_empty());
}

/// An announcement ngit-grasp accepts: it lists the relay's domain as a clone URL and a relay.
fn ngit_announcement(relay: &TestRelay, keys: &Keys, created_at: u64, d: &str) -> Event {
    let own = format!("127.0.0.1:{}", relay.port());
    let clone = format!("http://{own}/npub/{d}.git");
    let relays = format!("ws://{own}");
    event_of_kind(
        keys,
        30617,
        created_at,
        &[&["d", d], &["clone", &clone], &["relays", &relays]],
    )
}

fn coordinate(keys: &Keys, d: &str) -> String {
    format!("30617:{}:{d}", keys.public_key().to_hex())
}

const NGIT_PURGATORY: &str = "purgatory: won't be served until git data arrives";
const NGIT_STORED: &str = "duplicate: event stored";
const NGIT_UNRELATED: &str =
    "restricted: Event event must reference an accepted repository or accepted event";

#[test]
fn ngit_grasp_profile_holds_a_new_repository_in_purgatory_until_its_git_data_arrives() {
    let relay = TestRelay::start_profile(Profile::NgitGrasp);
    let keys = Keys::generate();
    let repo = coordinate(&keys, "r");
    let mut c = Client::connect(&relay);
    let answer = |c: &mut Client, e: &Event, ok: bool, why: &str| {
        assert_eq!(c.publish(e), json!(["OK", e.id.to_hex(), ok, why]));
    };

    // Not listing the service: refused with ngit-grasp's text.
    let elsewhere = event_of_kind(&keys, 30617, 900, &[&["d", "r"]]);
    answer(
        &mut c,
        &elsewhere,
        false,
        "invalid: Announcement must list service in both 'clone' and 'relays' tags, or match archive whitelist. Found clone URLs: [], relays: []",
    );
    // Listing it: accepted into purgatory, not served.
    let ann = ngit_announcement(&relay, &keys, 1000, "r");
    answer(&mut c, &ann, true, NGIT_PURGATORY);
    assert!(!relay.contains(&ann.id));
    assert_eq!(relay.purgatory_ids(), [ann.id].into());
    assert!(c
        .req_until_eose("a", &[json!({"kinds": [30617]})])
        .is_empty());
    c.send(r#"["CLOSE","a"]"#);
    // Sent again: held again.
    answer(&mut c, &ann, true, NGIT_PURGATORY);
    // An issue about it, and a reply to that issue: refused, nothing served relates to them.
    let issue = event_of_kind(&keys, 1621, 1001, &[&["a", &repo]]);
    answer(&mut c, &issue, false, NGIT_UNRELATED);
    let reply = event_of_kind(&keys, 1111, 1002, &[&["E", &issue.id.to_hex()]]);
    answer(&mut c, &reply, false, NGIT_UNRELATED);
    // A pull request about it: refused too (`PR event`); one without `c`: invalid.
    let pr_no_c = event_of_kind(&keys, 1618, 1003, &[&["a", &repo]]);
    answer(
        &mut c,
        &pr_no_c,
        false,
        &format!("invalid: PR event {} has no 'c' tag", pr_no_c.id),
    );
    let pr = event_of_kind(&keys, 1618, 1004, &[&["a", &repo], &["c", "abc123"]]);
    answer(
        &mut c,
        &pr,
        false,
        "restricted: PR event must reference an accepted repository or accepted event",
    );
    // A state event with refs waits in purgatory with its repository; one by a stranger or
    // of an unknown repository is refused.
    let state = event_of_kind(
        &keys,
        30618,
        1005,
        &[&["d", "r"], &["refs/heads/main", "abc123"]],
    );
    answer(&mut c, &state, true, NGIT_PURGATORY);
    let stranger = event_of_kind(&Keys::generate(), 30618, 1005, &[&["d", "r"]]);
    answer(
        &mut c,
        &stranger,
        false,
        "restricted: author not authorized for this repository",
    );
    let unknown = event_of_kind(&keys, 30618, 1005, &[&["d", "nothing"]]);
    answer(
        &mut c,
        &unknown,
        false,
        "invalid: no announcement exists for this repository",
    );

    // The git data arrives: the announcement and the state are served, live too.
    let mut live = Client::connect(&relay);
    assert!(live
        .req_until_eose("live", &[json!({"kinds": [30617, 30618]})])
        .is_empty());
    assert_eq!(relay.promote(&repo), 2);
    assert!(relay.contains(&ann.id) && relay.contains(&state.id));
    assert!(relay.purgatory_ids().is_empty());
    let mut seen = vec![live.recv()[2]["id"].clone(), live.recv()[2]["id"].clone()];
    seen.sort_by_key(|v| v.to_string());
    let mut want = vec![json!(ann.id.to_hex()), json!(state.id.to_hex())];
    want.sort_by_key(|v| v.to_string());
    assert_eq!(seen, want);
    // Now the issue, the reply and the pull request relate to what is served.
    answer(&mut c, &issue, true, NGIT_STORED);
    answer(&mut c, &issue, true, NGIT_STORED);
    answer(&mut c, &reply, true, NGIT_STORED);
    answer(
        &mut c,
        &pr,
        true,
        "purgatory: PR event stored, waiting for git push with commit abc123",
    );
    answer(&mut c, &pr, true, "duplicate: in purgatory");
    assert!(!relay.contains(&pr.id));
    assert_eq!(relay.promote(&repo), 1, "the pull request's git data");
    assert!(relay.contains(&pr.id));
    // An older version of the served announcement: superseded.
    let older = ngit_announcement(&relay, &keys, 999, "r");
    answer(
        &mut c,
        &older,
        true,
        "duplicate: superseded by a newer event",
    );
    assert_eq!(relay.writes_of(&issue.id), 3);
}

#[test]
fn ngit_grasp_profile_promotes_with_a_state_event_without_refs_and_drops_what_waits_too_long() {
    let relay = TestRelay::start_profile(Profile::NgitGrasp);
    let keys = Keys::generate();
    let mut c = Client::connect(&relay);
    // A maintainer's state event without refs needs no git data: the repository leaves
    // purgatory (how the interop tests take a repository out of it).
    let ann = ngit_announcement(&relay, &keys, 1000, "r");
    assert_eq!(c.publish(&ann)[3], NGIT_PURGATORY);
    let empty_state = event_of_kind(&keys, 30618, 1001, &[&["d", "r"]]);
    assert_eq!(
        c.publish(&empty_state),
        json!(["OK", empty_state.id.to_hex(), true, NGIT_STORED])
    );
    assert!(relay.contains(&ann.id) && relay.contains(&empty_state.id));

    // Dropped after the purgatory timeout; sent again later, held again.
    relay.set_ngit_grasp(Some(NgitGraspPolicy {
        purgatory_timeout: Duration::from_millis(300),
        ..NgitGraspPolicy::default()
    }));
    let other = ngit_announcement(&relay, &keys, 1000, "other");
    assert_eq!(c.publish(&other)[3], NGIT_PURGATORY);
    assert_eq!(relay.purgatory_ids(), [other.id].into());
    assert!(wait_until(WAIT, || relay.purgatory_ids().is_empty()));
    assert_eq!(relay.promote(&coordinate(&keys, "other")), 0, "dropped");
    assert!(!relay.contains(&other.id));
    assert_eq!(c.publish(&other)[3], NGIT_PURGATORY);
    assert_eq!(relay.purgatory_ids(), [other.id].into());
    assert_eq!(relay.writes_of(&other.id), 2);
}

#[test]
fn ngit_grasp_profile_earns_writes_only_by_whole_seconds_since_the_previous_event() {
    let relay = TestRelay::start_profile(Profile::NgitGrasp);
    let keys = Keys::generate();
    let ann = ngit_announcement(&relay, &keys, 1000, "r");
    relay.insert(&ann);
    let repo = coordinate(&keys, "r");
    let issue = |n: u64| event_of_kind(&keys, 1621, 2000 + n, &[&["a", &repo]]);
    let mut c = Client::connect(&relay);
    for n in 0..60 {
        let e = issue(n);
        assert_eq!(
            c.publish(&e),
            json!(["OK", e.id.to_hex(), true, NGIT_STORED])
        );
    }
    let late = issue(60);
    let limited = json!(["OK", late.id.to_hex(), false, "rate-limited: slow down"]);
    assert_eq!(c.publish(&late), limited);
    // Asking every 0.6 s never earns a token: each refusal starts the second again.
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(600));
        assert_eq!(c.publish(&late), limited);
    }
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(c.publish(&late)[2], true);
    assert_eq!(relay.len(), 62);
    // Another connection starts with 60 again.
    let mut other = Client::connect(&relay);
    assert_eq!(other.publish(&issue(61))[2], true);
}

#[test]
fn ngit_grasp_profile_lists_its_limits_and_bounds_negentropy_sessions_and_items() {
    let relay = TestRelay::start_profile(Profile::NgitGrasp);
    let doc = nip11_of(&relay);
    assert!(lists_77(&doc));
    assert_eq!(doc["supported_grasps"], json!(["GRASP-01", "GRASP-02"]));
    assert_eq!(doc["limitation"]["max_subscriptions"], 500);
    assert_eq!(doc["limitation"]["max_limit"], 500);
    assert_eq!(doc["limitation"]["restricted_writes"], true);
    let keys = Keys::generate();
    for i in 0..6 {
        relay.insert(&issue(&keys, 1000 + i, "e"));
    }
    let mut c = Client::connect(&relay);
    for n in 0..10 {
        c.send_json(json!(["NEG-OPEN", format!("n{n}"), {"kinds": [1621]}, neg_initial()]));
        assert_eq!(c.recv()[0], "NEG-MSG");
    }
    c.send_json(json!(["NEG-OPEN", "n10", {"kinds": [1621]}, neg_initial()]));
    assert_eq!(
        c.recv(),
        json!([
            "NEG-ERR",
            "n10",
            "rate-limited: too many negentropy subscriptions"
        ])
    );
    for n in 0..10 {
        c.send(&format!(r#"["NEG-CLOSE","n{n}"]"#));
    }
    assert!(wait_until(WAIT, || relay.open_neg_sessions() == 0));
    // The records of a connection's sessions together: 6 fit in 11, 6 more do not.
    relay.set_nip77_max_items(Some(11));
    c.send_json(json!(["NEG-OPEN", "a", {"kinds": [1621]}, neg_initial()]));
    assert_eq!(c.recv()[0], "NEG-MSG");
    c.send_json(json!(["NEG-OPEN", "b", {"kinds": [1621]}, neg_initial()]));
    assert_eq!(
        c.recv(),
        json!(["NEG-ERR", "b", "rate-limited: too many negentropy items"])
    );
}
