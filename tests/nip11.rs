//! `grasp_sync::net::nip11::fetch` against the test relay and against raw misbehaving
//! listeners on 127.0.0.1.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use grasp_sync::net::nip11::{fetch, Nip11Error};
use grasp_sync::shared::RelayLimits;
use grasp_sync::testing::TestRelay;
use grasp_sync::RelayUrl;
use serde_json::json;

/// Generous deadline for a fetch that should succeed.
const WAIT: Duration = Duration::from_secs(5);
/// Byte cap for the fetches.
const CAP: usize = 64 * 1024;

fn relay_url(relay: &TestRelay) -> RelayUrl {
    RelayUrl::parse(&relay.url()).expect("test relay URL")
}

/// Binds 127.0.0.1:0 and returns the listener and a `ws://` URL (with `path`) to it.
fn listener(path: &str) -> (TcpListener, RelayUrl) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let port = l.local_addr().expect("local addr").port();
    let url = RelayUrl::parse(&format!("ws://127.0.0.1:{port}{path}")).expect("url");
    (l, url)
}

/// Reads the request head (up to `\r\n\r\n`, EOF or 5 s) from `stream`.
fn read_request(stream: &mut TcpStream) -> String {
    stream.set_read_timeout(Some(WAIT)).expect("read timeout");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Serves one connection: reads the request, sends it back on the channel, writes `answer`
/// and then keeps the connection open until `hold` is dropped (`None`: close at once).
fn serve_once(
    l: TcpListener,
    answer: Vec<u8>,
    hold: Option<mpsc::Receiver<()>>,
) -> (mpsc::Receiver<String>, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let request = read_request(&mut s);
        let _ = tx.send(request);
        let _ = s.write_all(&answer);
        let _ = s.flush();
        if let Some(hold) = hold {
            let _ = hold.recv();
        }
    });
    (rx, handle)
}

#[test]
fn fetches_limits_from_test_relay() {
    let relay = TestRelay::start();
    relay.set_nip11(Some(json!({
        "name": "test",
        "limitation": {"max_subscriptions": 5, "max_limit": 50, "default_limit": 20}
    })));
    let limits = fetch(&relay_url(&relay), WAIT, CAP).expect("fetch");
    assert_eq!(
        limits,
        RelayLimits {
            max_subscriptions: Some(5),
            max_limit: Some(50),
            default_limit: Some(20),
            max_message_length: None,
            auth_required: false,
            restricted_writes: false,
            supports_nip77: None,
        }
    );
    assert_eq!(limits.page_size(1000), 50);
    assert_eq!(limits.subscription_budget(1000), 5);
    assert_eq!(relay.nip11_requests(), 1);
}

#[test]
fn test_relay_without_document_is_404() {
    let relay = TestRelay::start();
    let err = fetch(&relay_url(&relay), WAIT, CAP).unwrap_err();
    assert!(matches!(err, Nip11Error::Status(404)), "{err}");
    assert_eq!(relay.nip11_requests(), 1);
}

#[test]
fn silent_server_times_out_within_the_deadline() {
    let (l, url) = listener("");
    let (release, hold) = mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let (s, _) = l.accept().expect("accept");
        // Never answer; keep the socket open until the test is done.
        let _ = hold.recv();
        drop(s);
    });
    let started = Instant::now();
    let err = fetch(&url, Duration::from_millis(300), CAP).unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, Nip11Error::Timeout), "{err}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(took >= Duration::from_millis(250), "took {took:?}");
    drop(release);
    server.join().expect("server thread");
}

#[test]
fn endless_body_is_too_large() {
    let (l, url) = listener("");
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let _ = read_request(&mut s);
        s.set_write_timeout(Some(WAIT)).expect("write timeout");
        let _ = s
            .write_all(b"HTTP/1.0 200 OK\r\nContent-Type: application/nostr+json\r\n\r\n{\"x\":\"");
        let block = [b'a'; 8192];
        // Until the client hangs up (or the write timeout fires).
        while s.write_all(&block).is_ok() {}
    });
    let err = fetch(&url, WAIT, CAP).unwrap_err();
    assert!(matches!(err, Nip11Error::TooLarge), "{err}");
    server.join().expect("server thread");
}

#[test]
fn immediate_close_is_an_error() {
    let (l, url) = listener("");
    let server = thread::spawn(move || {
        let (s, _) = l.accept().expect("accept");
        drop(s);
    });
    let err = fetch(&url, WAIT, CAP).unwrap_err();
    assert!(
        matches!(err, Nip11Error::Malformed(_) | Nip11Error::Io(_)),
        "{err}"
    );
    server.join().expect("server thread");
}

#[test]
fn refused_port_is_a_connect_error() {
    let (l, url) = listener("");
    drop(l);
    let err = fetch(&url, WAIT, CAP).unwrap_err();
    assert!(matches!(err, Nip11Error::Connect(_)), "{err}");
}

#[test]
fn sends_path_and_host_and_stops_at_content_length() {
    let (l, url) = listener("/nostr?x=1");
    let body = r#"{"limitation":{"max_limit":77,"auth_required":true}}"#;
    let answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/nostr+json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    // The server keeps the connection open after answering: the fetch must not wait for EOF.
    let (release, hold) = mpsc::channel::<()>();
    let (requests, server) = serve_once(l, answer.into_bytes(), Some(hold));
    let started = Instant::now();
    let limits = fetch(&url, WAIT, CAP).expect("fetch");
    assert!(started.elapsed() < WAIT);
    assert_eq!(limits.max_limit, Some(77));
    assert!(limits.auth_required);
    let request = requests.recv_timeout(WAIT).expect("request");
    let port = url.port();
    assert!(
        request.starts_with(&format!(
            "GET /nostr?x=1 HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n"
        )),
        "{request}"
    );
    assert!(request.contains("\r\nAccept: application/nostr+json\r\n"));
    assert!(request.contains("\r\nConnection: close\r\n"));
    drop(release);
    server.join().expect("server thread");
}

#[test]
fn decodes_chunked_answer() {
    let (l, url) = listener("");
    let answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                   10\r\n{\"limitation\":{\"\r\n13\r\nmax_subscriptions\":\r\n3\r\n9}}\r\n0\r\n\r\n"
        .to_vec();
    let (_requests, server) = serve_once(l, answer, None);
    let limits = fetch(&url, WAIT, CAP).expect("fetch");
    assert_eq!(limits.max_subscriptions, Some(9));
    server.join().expect("server thread");
}

#[test]
fn non_json_body_is_malformed() {
    let (l, url) = listener("");
    let answer = b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n<html>hello</html>".to_vec();
    let (_requests, server) = serve_once(l, answer, None);
    let err = fetch(&url, WAIT, CAP).unwrap_err();
    assert!(matches!(err, Nip11Error::Malformed(_)), "{err}");
    server.join().expect("server thread");
}

#[test]
fn tls_to_a_plain_http_server_is_an_error() {
    let (l, plain) = listener("");
    let url = RelayUrl::parse(&format!("wss://127.0.0.1:{}", plain.port())).expect("url");
    // Answers plain text at once, without waiting for a request head (a ClientHello has none).
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let _ = s.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\nnot TLS");
        let _ = s.flush();
        let mut sink = [0u8; 1024];
        s.set_read_timeout(Some(WAIT)).expect("read timeout");
        // Until the client hangs up.
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    let err = fetch(&url, WAIT, CAP).unwrap_err();
    assert!(matches!(err, Nip11Error::Io(_)), "{err}");
    server.join().expect("server thread");
}

#[test]
fn tls_handshake_to_a_silent_server_times_out() {
    let (l, plain) = listener("");
    let url = RelayUrl::parse(&format!("wss://127.0.0.1:{}", plain.port())).expect("url");
    let (release, hold) = mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let (s, _) = l.accept().expect("accept");
        let _ = hold.recv();
        drop(s);
    });
    let started = Instant::now();
    let err = fetch(&url, Duration::from_millis(300), CAP).unwrap_err();
    assert!(matches!(err, Nip11Error::Timeout), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(release);
    server.join().expect("server thread");
}
