//! The NIP-77 (negentropy) responder of `grasp_sync::testing::TestRelay`, driven by a raw
//! websocket client with the `negentropy` crate as the initiator (`negentropy_client`).

mod negentropy_client;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use grasp_sync::testing::{wait_until, Nip77Mode, TestRelay, TestRelayOptions};
use negentropy_client::{
    initiator, issues, missing_share, records, repo_filter, Answer, Client, WAIT,
};
use nostr::event::{Event, EventId};
use serde_json::{json, Value};

/// How long a test listens to assert that nothing arrives.
const QUIET: Duration = Duration::from_millis(300);

fn relay_with(events: &[Event], mode: Nip77Mode) -> TestRelay {
    let relay = TestRelay::start_with(TestRelayOptions {
        nip77: mode,
        ..TestRelayOptions::default()
    });
    for e in events {
        assert!(relay.insert(e));
    }
    relay
}

/// The relay holds 1,000 issues of one repository and 50 unrelated notes; a client holding the
/// issues but `percent` % of them (and two events of its own) learns exactly the ids it lacks,
/// and exactly the two it has that the relay lacks; the notes never show up.
fn reconcile_with_missing(percent: usize) {
    let (issues, notes) = issues(1_000, 50, 1_700_000_000);
    let (extra, _) = negentropy_client::issues(2, 0, 1_600_000_000);
    let relay = relay_with(&[issues.clone(), notes].concat(), Nip77Mode::On);
    let missing = missing_share(&issues, percent);
    assert_eq!(missing.len(), issues.len() * percent / 100);
    let client_has = issues
        .iter()
        .filter(|e| !missing.contains(&e.id))
        .chain(extra.iter());

    let mut c = Client::connect(&relay.url());
    let outcome = c
        .reconcile("neg1", &repo_filter(&issues[0]), &records(client_has))
        .unwrap_or_else(|a| panic!("{percent} % missing: relay answered {a:?}"));
    assert_eq!(outcome.need, missing, "{percent} % missing");
    let extra_ids: HashSet<EventId> = extra.iter().map(|e| e.id).collect();
    assert_eq!(outcome.have, extra_ids, "{percent} % missing");
    assert!(wait_until(WAIT, || relay.open_neg_sessions() == 0));
    let opens = relay.neg_opens();
    assert_eq!(opens.len(), 1);
    assert_eq!(opens[0].sub_id, "neg1");
}

#[test]
fn reconciliation_with_nothing_missing() {
    reconcile_with_missing(0);
}

#[test]
fn reconciliation_with_one_percent_missing() {
    reconcile_with_missing(1);
}

#[test]
fn reconciliation_with_half_missing() {
    reconcile_with_missing(50);
}

#[test]
fn reconciliation_with_everything_missing() {
    reconcile_with_missing(100);
}

#[test]
fn the_filter_window_and_limit_scope_the_session() {
    let (issues, _) = issues(100, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::On);
    let mut c = Client::connect(&relay.url());
    // `since` = the 61st issue's second: issues 60..99 are in the window.
    let mut filter = repo_filter(&issues[0]);
    filter["since"] = json!(issues[60].created_at.as_secs());
    let outcome = c.reconcile("w", &filter, &[]).unwrap();
    let want: HashSet<EventId> = issues[60..].iter().map(|e| e.id).collect();
    assert_eq!(outcome.need, want);
    // `limit` keeps the newest, as a REQ would.
    let mut filter = repo_filter(&issues[0]);
    filter["limit"] = json!(10);
    let outcome = c.reconcile("l", &filter, &[]).unwrap();
    let want: HashSet<EventId> = issues[90..].iter().map(|e| e.id).collect();
    assert_eq!(outcome.need, want);
}

#[test]
fn off_answers_every_neg_message_with_the_notice_of_nostr_rs_relay() {
    let (issues, _) = issues(10, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::Off);
    let mut c = Client::connect(&relay.url());
    let initial = initiator(&[]).initiate().unwrap();
    c.neg_open("n", &repo_filter(&issues[0]), &initial);
    let notice = Answer::Notice("could not parse command".to_string());
    assert_eq!(c.answer("n"), notice);
    c.neg_msg("n", &initial);
    assert_eq!(c.answer("n"), notice);
    c.neg_close("n");
    assert_eq!(c.answer("n"), notice);
    assert!(relay.neg_opens().is_empty());
    assert_eq!(relay.open_neg_sessions(), 0);
    // The connection still serves REQs.
    c.send(r#"["REQ","r",{"kinds":[1621]}]"#);
    let mut served = HashSet::new();
    loop {
        let frame = c.recv_within(WAIT).unwrap().expect("an answer");
        match frame[0].as_str() {
            Some("EVENT") => {
                served.insert(frame[2]["id"].as_str().unwrap().to_string());
            }
            Some("EOSE") => break,
            _ => panic!("unexpected {frame}"),
        }
    }
    let want: HashSet<String> = issues.iter().map(|e| e.id.to_hex()).collect();
    assert_eq!(served, want);
}

fn nip11_of(relay: &TestRelay) -> Value {
    let mut s = TcpStream::connect(("127.0.0.1", relay.port())).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/nostr+json\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (_, body) = out.split_once("\r\n\r\n").expect("an HTTP answer");
    serde_json::from_str(body).unwrap()
}

#[test]
fn nip11_lists_77_only_when_nip77_is_not_off() {
    let relay = TestRelay::start_with(TestRelayOptions {
        nip11: Some(json!({"name": "t", "supported_nips": [1, 11]})),
        ..TestRelayOptions::default()
    });
    assert_eq!(nip11_of(&relay)["supported_nips"], json!([1, 11]));
    relay.set_nip77(Nip77Mode::On);
    assert_eq!(nip11_of(&relay)["supported_nips"], json!([1, 11, 77]));
    relay.set_nip77(Nip77Mode::Silent);
    assert_eq!(nip11_of(&relay)["supported_nips"], json!([1, 11, 77]));
    relay.set_nip77(Nip77Mode::Off);
    assert_eq!(nip11_of(&relay)["supported_nips"], json!([1, 11]));
}

#[test]
fn neg_err_and_closed_modes_refuse_the_open() {
    let (issues, _) = issues(10, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::NegErr("blocked: no sync here".into()));
    let mut c = Client::connect(&relay.url());
    let filter = repo_filter(&issues[0]);
    assert_eq!(
        c.reconcile("a", &filter, &[]).unwrap_err(),
        Answer::Err("blocked: no sync here".into())
    );
    relay.set_nip77(Nip77Mode::Closed("restricted: members only".into()));
    assert_eq!(
        c.reconcile("b", &filter, &[]).unwrap_err(),
        Answer::Closed("restricted: members only".into())
    );
    assert_eq!(relay.open_neg_sessions(), 0);
    let subs: Vec<String> = relay.neg_opens().into_iter().map(|o| o.sub_id).collect();
    assert_eq!(subs, ["a", "b"]);
    relay.set_nip77(Nip77Mode::On);
    let outcome = c.reconcile("c", &filter, &[]).unwrap();
    assert_eq!(outcome.need, issues.iter().map(|e| e.id).collect());
}

#[test]
fn silent_mode_answers_nothing_and_opens_nothing() {
    let (issues, _) = issues(10, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::Silent);
    let mut c = Client::connect(&relay.url());
    let initial = initiator(&[]).initiate().unwrap();
    c.neg_open("s", &repo_filter(&issues[0]), &initial);
    assert_eq!(c.answer_within("s", QUIET), Answer::Silence);
    c.neg_msg("s", &initial);
    assert_eq!(c.answer_within("s", QUIET), Answer::Silence);
    assert_eq!(relay.open_neg_sessions(), 0);
    assert_eq!(relay.neg_opens().len(), 1);
}

/// 4,000 records on the relay and a client lacking half make a reconciliation of several
/// round trips; `DropAfter(n)` hangs up right after the n-th NEG-MSG on every connection.
#[test]
fn drop_after_hangs_up_after_the_nth_reply_on_every_connection() {
    let (issues, _) = issues(4_000, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::On);
    let filter = repo_filter(&issues[0]);
    let missing = missing_share(&issues, 50);
    let client_has: Vec<_> = records(issues.iter().filter(|e| !missing.contains(&e.id)));
    let full = Client::connect(&relay.url())
        .reconcile("full", &filter, &client_has)
        .unwrap();
    assert_eq!(full.need, missing);
    assert!(full.rounds >= 3, "only {} round trips", full.rounds);

    for n in [0u32, 1, 2] {
        relay.set_nip77(Nip77Mode::DropAfter(n));
        let drops = relay.nip77_drops();
        let mut c = Client::connect(&relay.url());
        let mut client = initiator(&client_has);
        c.neg_open("d", &filter, &client.initiate().unwrap());
        let (mut have, mut need) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let Answer::Msg(reply) = c.answer("d") else {
                panic!("DropAfter({n}): a reply missing");
            };
            let next = client
                .reconcile_with_ids(&reply, &mut have, &mut need)
                .unwrap()
                .expect("more round trips");
            c.neg_msg("d", &next);
        }
        assert_eq!(c.answer("d"), Answer::Hangup, "DropAfter({n})");
        assert_eq!(relay.nip77_drops(), drops + 1);
    }
    // On again: a new connection reconciles completely.
    relay.set_nip77(Nip77Mode::On);
    let again = Client::connect(&relay.url())
        .reconcile("again", &filter, &client_has)
        .unwrap();
    assert_eq!(again.need, missing);
}

#[test]
fn too_many_records_are_blocked_like_strfry() {
    let (issues, _) = issues(20, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::On);
    relay.set_nip77_max_records(Some(19));
    let mut c = Client::connect(&relay.url());
    let filter = repo_filter(&issues[0]);
    assert_eq!(
        c.reconcile("big", &filter, &[]).unwrap_err(),
        Answer::Err("blocked: too many query results".into())
    );
    assert_eq!(relay.open_neg_sessions(), 0);
    relay.set_nip77_max_records(Some(20));
    assert_eq!(c.reconcile("fits", &filter, &[]).unwrap().need.len(), 20);
}

#[test]
fn invalid_messages_get_neg_err_invalid_and_leave_no_session() {
    let (issues, _) = issues(10, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::On);
    let mut c = Client::connect(&relay.url());
    let filter = repo_filter(&issues[0]);
    let is_invalid = |a: Answer| matches!(&a, Answer::Err(m) if m.starts_with("invalid: "));

    c.send_json(&json!(["NEG-OPEN", "x", filter, "not hex"]));
    assert!(is_invalid(c.answer("x")));
    c.send_json(&json!(["NEG-OPEN", "x", filter, 97]));
    assert!(is_invalid(c.answer("x")));
    c.send_json(&json!(["NEG-OPEN", "x", {"kinds": "many"}, "61"]));
    assert!(is_invalid(c.answer("x")));
    // A protocol version byte outside 0x60..=0x6f.
    c.send_json(&json!(["NEG-OPEN", "x", filter, "00"]));
    assert!(is_invalid(c.answer("x")));
    // Empty, and a fingerprint range cut short (bound 0/0, mode 1, 2 of 16 bytes).
    for msg in ["", "61000001abcd"] {
        c.send_json(&json!(["NEG-OPEN", "x", filter, msg]));
        let a = c.answer("x");
        assert!(is_invalid(a.clone()), "{msg:?}: {a:?}");
    }
    assert_eq!(relay.open_neg_sessions(), 0);

    // A garbage NEG-MSG ends a valid session.
    c.neg_open("y", &filter, &initiator(&[]).initiate().unwrap());
    assert!(matches!(c.answer("y"), Answer::Msg(_)));
    assert_eq!(relay.open_neg_sessions(), 1);
    c.send_json(&json!(["NEG-MSG", "y", "zz"]));
    assert!(is_invalid(c.answer("y")));
    assert_eq!(relay.open_neg_sessions(), 0);
    // Malformed frames get the parse NOTICE.
    c.send_json(&json!(["NEG-OPEN", "z"]));
    assert_eq!(
        c.answer("z"),
        Answer::Notice("could not parse command".into())
    );
    c.send_json(&json!(["NEG-MSG", 5, "61"]));
    assert_eq!(
        c.answer("z"),
        Answer::Notice("could not parse command".into())
    );
}

#[test]
fn sessions_are_replaced_closed_and_unknown_ones_reported() {
    let (issues, _) = issues(200, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::On);
    let mut c = Client::connect(&relay.url());
    let filter = repo_filter(&issues[0]);
    let initial = initiator(&[]).initiate().unwrap();

    c.neg_msg("nobody", &initial);
    assert_eq!(
        c.answer("nobody"),
        Answer::Err("closed: no such negentropy session".into())
    );

    c.neg_open("s", &filter, &initial);
    assert!(matches!(c.answer("s"), Answer::Msg(_)));
    assert!(wait_until(WAIT, || relay.open_neg_sessions() == 1));
    // Reusing the id replaces the session: the new one (over a narrower filter) runs to the
    // end as if the first had never been.
    let mut narrow = filter.clone();
    narrow["until"] = json!(issues[9].created_at.as_secs());
    let outcome = c.reconcile("s", &narrow, &[]).unwrap();
    let want: HashSet<EventId> = issues.iter().take(10).map(|e| e.id).collect();
    assert_eq!(outcome.need, want);
    // `reconcile` ended with NEG-CLOSE: the session is gone.
    assert!(wait_until(WAIT, || relay.open_neg_sessions() == 0));
    c.neg_msg("s", &initial);
    assert_eq!(
        c.answer("s"),
        Answer::Err("closed: no such negentropy session".into())
    );
}

#[test]
fn auth_required_refuses_neg_open_until_authenticated() {
    let (issues, _) = issues(10, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::On);
    relay.set_require_auth(true);
    let mut c = Client::connect(&relay.url());
    assert_eq!(
        c.reconcile("a", &repo_filter(&issues[0]), &[]).unwrap_err(),
        Answer::Err("auth-required: please authenticate".into())
    );
    assert_eq!(relay.open_neg_sessions(), 0);
}

#[test]
fn bytes_sent_counts_what_clients_receive() {
    let (issues, _) = issues(300, 0, 1_700_000_000);
    let relay = relay_with(&issues, Nip77Mode::On);
    assert_eq!(relay.bytes_sent(), 0);
    let mut c = Client::connect(&relay.url());
    c.send(r#"["REQ","r",{"kinds":[1621]}]"#);
    let mut received = 0u64;
    loop {
        let frame = c.recv_within(WAIT).unwrap().expect("an answer");
        received += frame.to_string().len() as u64;
        if frame[0] == "EOSE" {
            break;
        }
    }
    // Served verbatim: the frames' JSON re-serialised has the same length.
    assert_eq!(relay.bytes_sent(), received);
    let stored: u64 = issues.iter().map(|e| e.as_json().len() as u64).sum();
    assert!(received > stored);
    // A reconciliation with nothing missing costs a small fraction of that.
    let before = relay.bytes_sent();
    let outcome = c
        .reconcile("n", &repo_filter(&issues[0]), &records(&issues))
        .unwrap();
    assert!(outcome.need.is_empty() && outcome.have.is_empty());
    let neg_bytes = relay.bytes_sent() - before;
    assert!(
        neg_bytes > 0 && neg_bytes * 20 < received,
        "{neg_bytes} of {received}"
    );
}
