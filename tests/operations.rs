//! The operator's surface over real sockets: the metrics listener (`/metrics`, `/status`,
//! `/`, `/healthz`) and the `grasp-sync` binary (`--once` exit codes, SIGTERM, environment
//! variables, bad values, `status`, the README's CLI table).

mod common;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use grasp_sync::ops::http::get;
use grasp_sync::ops::{HttpLimits, StatusSource};
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, SyncHandle};
use nostr::event::FinalizeEvent;

const BIN: &str = env!("CARGO_BIN_EXE_grasp-sync");
const WAIT: Duration = Duration::from_secs(60);

fn engine_config(own: &TestRelay) -> Config {
    Config::new(url(own))
        .batch_window(Duration::from_millis(100))
        .allow_private_relays(true)
}

/// An own relay holding one repository's announcement, and a remote relay holding the
/// announcement, an issue and a reply; the set the own relay must end with.
fn seeded() -> (
    TestRelay,
    TestRelay,
    OneRepo,
    HashSet<nostr::event::EventId>,
) {
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = OneRepo::new(&remote);
    let mut want = r.seed(&own, &remote);
    let reply = r.reply("a reply");
    remote.insert(&reply);
    want.insert(reply.id);
    (own, remote, r, want)
}

/// An own relay holding one repository announced on `remote`, whose issue and reply are on
/// `remote`; the engine is started and has converged.
fn synced() -> (
    TestRelay,
    TestRelay,
    Arc<SyncHandle>,
    HashSet<nostr::event::EventId>,
) {
    let (own, remote, _, want) = seeded();
    let handle = Arc::new(grasp_sync::start(engine_config(&own)).unwrap());
    assert!(
        wait_until(WAIT, || own.event_ids() == want
            && handle.status().is_settled()),
        "sync did not converge: {:#?}",
        handle.status()
    );
    (own, remote, handle, want)
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

#[test]
fn http_listener_serves_metrics_status_page_and_health_after_a_sync() {
    init_logging();
    let (own, remote, handle, want) = synced();
    let server = grasp_sync::ops::serve("127.0.0.1:0".parse().unwrap(), handle.clone()).unwrap();
    let addr = server.local_addr();

    let (code, text) = get(addr, "/metrics", WAIT).unwrap();
    assert_eq!(code, 200);
    // The events forwarded are those the own relay stored (all but the announcement, which
    // was there before).
    assert_eq!(
        metric(&text, "grasp_sync_events_forwarded_total"),
        Some((want.len() - 1) as f64),
        "{text}"
    );
    assert_eq!(metric(&text, "grasp_sync_repositories"), Some(1.0));
    assert_eq!(metric(&text, "grasp_sync_own_relay_connected"), Some(1.0));
    let relay_label = format!("relay=\"{}\"", remote.url());
    assert!(text
        .lines()
        .any(|l| l.starts_with("grasp_sync_relay_connected{")
            && l.contains(&relay_label)
            && l.ends_with(" 1")));
    assert!(text.contains("# TYPE grasp_sync_ok_latency_seconds histogram"));
    // Every metric family is documented for operators.
    let ops = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    for family in text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE grasp_sync_"))
    {
        let name = family.split_whitespace().next().unwrap();
        assert!(
            ops.contains(&format!("| `{name}` |")),
            "{name} in docs/operations.md"
        );
    }
    let count = metric(&text, "grasp_sync_ok_latency_seconds_count").unwrap();
    assert!(count >= 2.0, "every stored event had its OK timed: {count}");

    // /status, settled and with the per-relay fields.
    assert!(wait_until(WAIT, || {
        let (_, body) = get(addr, "/status", WAIT).unwrap();
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["settled"] == true
    }));
    let (code, body) = get(addr, "/status", WAIT).unwrap();
    assert_eq!(code, 200);
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["schema"], 1);
    assert_eq!(doc["own_relay"], "connected");
    assert_eq!(doc["repositories"], 1);
    assert_eq!(doc["forward"]["stored"], (want.len() - 1) as u64);
    let r = &doc["relays"][0];
    assert_eq!(r["url"], remote.url());
    assert_eq!(r["connection"], "connected");
    assert_eq!(r["confirmed"]["repositories"], 1);
    assert!(r["last_connected"].as_u64().is_some());
    for key in [
        "last_error",
        "catch_up_since",
        "incomplete_queries",
        "failed_batches",
    ] {
        assert!(r.get(key).is_some(), "{key} in {r}");
    }
    // The status page for people: the per-relay table.
    let (code, page) = get(addr, "/", WAIT).unwrap();
    assert_eq!(code, 200);
    assert!(
        page.contains("<table") && page.contains(&remote.url()),
        "{page}"
    );
    assert!(!page.contains("<script"));
    // Healthy now; unhealthy when the own relay goes down.
    assert_eq!(get(addr, "/healthz", WAIT).unwrap().0, 200);
    own.stop();
    assert!(wait_until(WAIT, || get(addr, "/healthz", WAIT).unwrap().0 == 503));
    let (_, why) = get(addr, "/healthz", WAIT).unwrap();
    assert!(why.contains("own relay"), "{why}");
    assert_eq!(get(addr, "/nope", WAIT).unwrap().0, 404);
}

fn status_doc(addr: SocketAddr) -> serde_json::Value {
    let (code, body) = get(addr, "/status", WAIT).unwrap();
    assert_eq!(code, 200);
    serde_json::from_str(&body).unwrap()
}

#[test]
fn status_progress_moves_to_settled_and_says_why_it_has_no_estimate() {
    init_logging();
    let (own, remote, _, want) = seeded();
    let handle = Arc::new(grasp_sync::start(engine_config(&own)).unwrap());
    let server = grasp_sync::ops::serve("127.0.0.1:0".parse().unwrap(), handle.clone()).unwrap();
    let addr = server.local_addr();
    // From the first answer on, the progress fields are there.
    let doc = status_doc(addr);
    let p = &doc["progress"];
    for key in [
        "repositories",
        "root_events",
        "history_queries_pending",
        "events_forwarded_per_second",
        "relays_settled",
        "relays_without_estimate",
        "eta_seconds",
        "eta_unknown",
        "eta",
    ] {
        assert!(p.get(key).is_some(), "{key} in {p}");
    }
    // After the sync: settled, nothing pending, an estimate of 0.
    assert!(
        wait_until(WAIT, || {
            let doc = status_doc(addr);
            own.event_ids() == want && doc["settled"] == true && doc["progress"]["eta_seconds"] == 0
        }),
        "{:#}",
        status_doc(addr)
    );
    let doc = status_doc(addr);
    let p = &doc["progress"];
    assert_eq!(p["history_queries_pending"], 0, "{p}");
    assert_eq!(p["eta_unknown"], serde_json::Value::Null, "{p}");
    assert_eq!(p["eta"], "0s (settled)");
    assert_eq!(p["relays_settled"], 1);
    assert_eq!(p["relays_without_estimate"], 0);
    assert_eq!(p["repositories"]["confirmed"], 1);
    assert_eq!(p["repositories"]["target"], 1);
    assert_eq!(p["root_events"]["confirmed"], p["root_events"]["target"]);
    let r = &doc["relays"][0]["progress"];
    assert_eq!(r["settled"], true, "{r}");
    assert_eq!(r["history_queries_pending"], 0, "{r}");
    assert_eq!(r["eta_seconds"], 0, "{r}");
    assert!(
        r["history_queries_completed"].as_u64().unwrap() >= 1,
        "the history was read by queries that completed: {r}"
    );
    let (_, page) = get(addr, "/", WAIT).unwrap();
    assert!(
        page.contains("time to settle: 0s (settled)")
            && page.contains("history queries pending: 0"),
        "{page}"
    );
    // The remote relay goes away: no estimate, and why.
    remote.stop();
    assert!(
        wait_until(WAIT, || {
            let doc = status_doc(addr);
            let why = doc["relays"][0]["progress"]["eta_unknown"]
                .as_str()
                .map(str::to_string);
            why.is_some_and(|w| w == "relay disconnected" || w == "relay connecting")
                && doc["progress"]["eta_seconds"].is_null()
        }),
        "{:#}",
        status_doc(addr)
    );
    let doc = status_doc(addr);
    let why = doc["progress"]["eta_unknown"].as_str().unwrap();
    assert!(
        why.starts_with(&format!("{}: relay ", remote.url())),
        "{why}"
    );
    assert_eq!(doc["progress"]["relays_without_estimate"], 1);
    let (_, page) = get(addr, "/", WAIT).unwrap();
    assert!(page.contains("time to settle: unknown ("), "{page}");
}

#[test]
fn a_slow_client_does_not_stall_the_listener() {
    let own = TestRelay::start();
    let handle = Arc::new(grasp_sync::start(engine_config(&own)).unwrap());
    // Every client here is 127.0.0.1: give one address more than the default share.
    let limits = HttpLimits {
        max_per_client: 16,
        ..HttpLimits::default()
    };
    let server =
        grasp_sync::ops::serve_with("127.0.0.1:0".parse().unwrap(), handle.clone(), limits)
            .unwrap();
    let addr = server.local_addr();
    // Clients that connect and send nothing, or trickle a request for ever.
    let mut idle: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    idle[0].write_all(b"GET /met").unwrap();
    let started = Instant::now();
    let (code, _) = get(addr, "/metrics", Duration::from_secs(10)).unwrap();
    assert_eq!(code, 200);
    assert!(started.elapsed() < Duration::from_secs(5));
    // An oversized request head is refused, not buffered.
    let mut big = TcpStream::connect(addr).unwrap();
    let _ = big.write_all(&vec![b'a'; 64 * 1024]);
    let mut answer = String::new();
    big.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = big.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
    // The idle ones are cut off after the read deadline.
    let mut buf = [0u8; 16];
    idle[1]
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    assert_eq!(
        idle[1].read(&mut buf).unwrap_or(0),
        0,
        "closed by the server"
    );
}

/// A running engine whose status shows its relays `copies` times: answers of many
/// megabytes, larger than the sockets' buffers.
struct Inflated {
    handle: Arc<SyncHandle>,
    copies: usize,
}

impl StatusSource for Inflated {
    fn status(&self) -> grasp_sync::Status {
        let mut s = self.handle.status();
        let one = s.relays.clone();
        s.relays = (0..self.copies).flat_map(|_| one.iter().cloned()).collect();
        s
    }

    fn health(&self) -> Result<(), String> {
        self.handle.health()
    }
}

/// Sends a request for `path` and reads nothing.
fn request(addr: SocketAddr, path: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    s
}

/// The `Content-Length` of an answer's head at the start of `bytes`.
fn content_length(bytes: &[u8]) -> Option<usize> {
    let text = String::from_utf8_lossy(bytes);
    let head = text.split("\r\n\r\n").next()?;
    head.lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn an_answer_read_slowly_but_steadily_is_cut_at_its_one_deadline() {
    init_logging();
    let (_own, _remote, handle, _) = synced();
    let source = Arc::new(Inflated {
        handle,
        copies: 24_000,
    });
    // Rendering takes about 3 s in a debug build on an idle host; the deadline leaves time
    // to write, and at 80 KB/s the reader cannot take in the 24 MB answer before it (with
    // at most ~10 MB in kernel buffers).
    let limits = HttpLimits {
        answer_deadline: Duration::from_secs(30),
        ..HttpLimits::default()
    };
    let server =
        grasp_sync::ops::serve_with("127.0.0.1:0".parse().unwrap(), source, limits).unwrap();
    let mut client = request(server.local_addr(), "/status");
    client
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    // Read 4 KiB every 50 ms: every write of the server makes progress, so only a deadline
    // for the whole answer ends it.
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    let started = Instant::now();
    let cut = || {
        server
            .counters()
            .cut
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    while cut() == 0 {
        assert!(
            started.elapsed() < WAIT,
            "the answer was never cut off ({} bytes read)",
            got.len()
        );
        let n = client.read(&mut buf).unwrap_or(0);
        if n == 0 {
            // Closed: the cut is counted right before the close.
            assert!(wait_until(WAIT, || cut() > 0), "closed without a cut");
            break;
        }
        got.extend_from_slice(&buf[..n]);
        std::thread::sleep(Duration::from_millis(50));
    }
    // What the kernel still holds arrives, then the end: short of the announced length.
    let mut rest = Vec::new();
    let _ = client.read_to_end(&mut rest);
    got.extend_from_slice(&rest);
    if got.is_empty() {
        // A host so loaded that rendering took the whole deadline: cut before the first
        // byte, which is the deadline working too.
        return;
    }
    let announced = content_length(&got).expect("an answer head");
    assert!(
        announced > 20 << 20,
        "the answer is larger than socket buffers: {announced}"
    );
    assert!(
        got.len() < announced,
        "cut off: {} of {announced} bytes",
        got.len()
    );
}

/// A running engine whose status waits until the gate opens: answers that hold their slot
/// for as long as the test wants, like readers that read nothing of a large answer.
struct Gated {
    handle: Arc<SyncHandle>,
    open: parking_lot::Mutex<bool>,
    opened: parking_lot::Condvar,
    /// Answers waiting at the gate.
    waiting: std::sync::atomic::AtomicUsize,
}

impl StatusSource for Gated {
    fn status(&self) -> grasp_sync::Status {
        self.waiting
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut open = self.open.lock();
        let until = Instant::now() + WAIT;
        while !*open && Instant::now() < until {
            self.opened.wait_until(&mut open, until);
        }
        drop(open);
        self.handle.status()
    }

    fn health(&self) -> Result<(), String> {
        self.handle.health()
    }
}

#[test]
fn answers_holding_every_slot_cannot_starve_healthz() {
    init_logging();
    let (_own, _remote, handle, _) = synced();
    let source = Arc::new(Gated {
        handle,
        open: parking_lot::Mutex::new(false),
        opened: parking_lot::Condvar::new(),
        waiting: std::sync::atomic::AtomicUsize::new(0),
    });
    // Every client here is 127.0.0.1.
    let limits = HttpLimits {
        max_per_client: 64,
        ..HttpLimits::default()
    };
    let server =
        grasp_sync::ops::serve_with("127.0.0.1:0".parse().unwrap(), source.clone(), limits)
            .unwrap();
    let addr = server.local_addr();
    // As many requests for /status as there are answer slots, each held at the gate.
    let held: Vec<TcpStream> = (0..limits.max_answers)
        .map(|_| request(addr, "/status"))
        .collect();
    // Once they hold every answer slot (all wait at the gate), another /status is
    // refused...
    assert!(
        wait_until(WAIT, || source
            .waiting
            .load(std::sync::atomic::Ordering::SeqCst)
            == limits.max_answers),
        "the held answers never reached the gate"
    );
    assert!(
        wait_until(WAIT, || get(addr, "/status", WAIT)
            .map(|(code, _)| code == 503)
            .unwrap_or(false)),
        "the held answers never took every answer slot"
    );
    let busy = || {
        server
            .counters()
            .refused_busy
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert!(busy() >= 1);
    // ...but the health check answers, and says the engine is healthy, again and again.
    for _ in 0..limits.health_reserve + 2 {
        let (code, body) = get(addr, "/healthz", WAIT).unwrap();
        assert_eq!((code, body.as_str()), (200, "ok\n"));
    }
    // The held answers complete once the gate opens.
    *source.open.lock() = true;
    source.opened.notify_all();
    for mut s in held {
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer:.80}");
    }
}

#[test]
fn one_client_address_holds_at_most_its_share_of_connections() {
    init_logging();
    let own = TestRelay::start();
    let handle = Arc::new(grasp_sync::start(engine_config(&own)).unwrap());
    // The default share per address; the idle connections are not cut during the test.
    let limits = HttpLimits {
        read_deadline: Duration::from_secs(600),
        answer_deadline: Duration::from_secs(600),
        ..HttpLimits::default()
    };
    assert_eq!(limits.max_per_client, grasp_sync::ops::http::MAX_PER_CLIENT);
    let server =
        grasp_sync::ops::serve_with("127.0.0.1:0".parse().unwrap(), handle.clone(), limits)
            .unwrap();
    let addr = server.local_addr();
    // Connections that send nothing, from one address, up to its share.
    let idle: Vec<TcpStream> = (0..limits.max_per_client)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    // Wait until the listener holds them all: the next one from 127.0.0.1 is refused.
    let refused = || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer.starts_with("HTTP/1.1 503")
    };
    assert!(wait_until(WAIT, refused), "a fifth connection was served");
    let counters = server.counters();
    assert!(
        counters
            .refused_client
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    assert_eq!(
        counters
            .refused_busy
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "refused for the address, not for the total"
    );
    // Once they are gone the address is served again, and the refusals are in /metrics.
    drop(idle);
    assert!(wait_until(WAIT, || get(addr, "/healthz", WAIT)
        .map(|(code, _)| code == 200)
        .unwrap_or(false)));
    let (_, text) = get(addr, "/metrics", WAIT).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("grasp_sync_http_refused_total{reason=\"client\"}"))
        .expect("the refusal counter in /metrics");
    let n: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(n >= 1, "{line}");
}

// ----- the binary -----

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn(args: &[&str], env: &[(&str, &str)]) -> Child {
    let mut c = Command::new(BIN);
    c.env_remove("RUST_LOG");
    // The test relays are on 127.0.0.1, which discovered relays may not be by default.
    c.args(args)
        .env("GRASP_SYNC_ALLOW_PRIVATE_RELAYS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// Waits for the child to exit within `deadline` (killing it otherwise); exit code and
/// stderr.
fn finish(mut child: Child, deadline: Duration) -> (Option<i32>, String) {
    let end = Instant::now() + deadline;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    (status.and_then(|s| s.code()), err)
}

#[test]
fn once_exits_0_with_the_exact_set_when_every_relay_completes() {
    let (own, remote, r, want) = seeded();
    let noise = note(&r.keys, "unrelated");
    remote.insert(&noise);
    let child = spawn(
        &["--once", "--batch-window", "200", "--deadline", "120"],
        &[("GRASP_SYNC_OWN_RELAY", own.url().as_str())],
    );
    let (code, err) = finish(child, Duration::from_secs(150));
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(own.event_ids(), want, "exactly the related set");
    assert!(
        err.contains("complete") && err.contains(&remote.url()),
        "{err}"
    );
}

#[test]
fn once_exits_1_when_a_relay_is_unreachable() {
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let dead = format!("ws://127.0.0.1:{}", free_port());
    let keys = nostr::key::Keys::generate();
    let ann = announcement(&keys, "r", &[&[&remote.url(), &dead]]);
    own.insert(&ann);
    remote.insert(&ann);
    let child = spawn(
        &[
            "--own-relay",
            &own.url(),
            "--once",
            "--batch-window",
            "200",
            "--connect-timeout",
            "2",
            "--deadline",
            "240",
        ],
        &[],
    );
    let (code, err) = finish(child, Duration::from_secs(270));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("failed: {dead}")), "{err}");
    assert!(err.contains("NOT complete"), "{err}");
}

#[test]
fn sigterm_during_a_sync_stops_within_the_deadline_and_loses_nothing_queued() {
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let r = OneRepo::new(&remote);
    own.insert(&r.ann);
    remote.insert(&r.ann);
    let mut want: HashSet<_> = [r.ann.id].into_iter().collect();
    let mut all = Vec::new();
    let now = nostr::types::Timestamp::now().as_secs();
    for i in 0..400u64 {
        // Distinct seconds, as real history has (a burst in one second beyond the page
        // size cannot be paged: that is a test of its own).
        let e =
            nostr::event::EventBuilder::new(nostr::event::Kind::Custom(1621), format!("issue {i}"))
                .tag(nostr::event::Tag::parse(["a", &r.repo]).unwrap())
                .custom_created_at(nostr::types::Timestamp::from_secs(now - 10 * i))
                .finalize(&r.keys)
                .unwrap();
        remote.insert(&e);
        all.push(e.id);
    }
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let child = spawn(
        &[
            "--own-relay",
            &own.url(),
            "--batch-window",
            "100",
            "--metrics-addr",
            &addr.to_string(),
            "--stop-timeout",
            "10",
        ],
        &[],
    );
    // Mid-sync: some events forwarded, not all.
    assert!(wait_until(WAIT, || own.len() > 1));
    let started = Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let (code, err) = finish(child, Duration::from_secs(30));
    assert_eq!(code, Some(0), "{err}");
    assert!(started.elapsed() < Duration::from_secs(15), "{err}");
    // Whatever was stored stays; nothing stored is lost and the rest is still on the
    // remote relay for the next start, which completes the set.
    let stored = own.event_ids();
    want.extend(all.iter().copied());
    assert!(stored.is_subset(&want));
    let child = spawn(
        &["--own-relay", &own.url(), "--once", "--batch-window", "100"],
        &[],
    );
    let (code, err) = finish(child, Duration::from_secs(120));
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(own.event_ids(), want);
}

#[test]
fn bad_values_exit_2_with_the_reason() {
    for (args, env, needle) in [
        (vec!["--own-relay", "http://x"], vec![], "--own-relay"),
        (
            vec!["--own-relay", "ws://x", "--batch-window", "0"],
            vec![],
            "--batch-window",
        ),
        (
            vec!["--own-relay", "ws://x"],
            vec![("GRASP_SYNC_ONCE", "perhaps")],
            "GRASP_SYNC_ONCE",
        ),
        (
            vec![],
            vec![
                ("GRASP_SYNC_OWN_RELAY", "ws://x"),
                ("GRASP_SYNC_MAX_RELAYS", "many"),
            ],
            "max-relays",
        ),
    ] {
        let child = spawn(&args, &env);
        let (code, err) = finish(child, Duration::from_secs(20));
        assert_eq!(code, Some(2), "{args:?} {env:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn status_command_prints_the_table_of_a_running_instance() {
    let (_own, remote, handle, _) = synced();
    let server = grasp_sync::ops::serve("127.0.0.1:0".parse().unwrap(), handle.clone()).unwrap();
    let addr = server.local_addr().to_string();
    let out = Command::new(BIN)
        .args(["status", "--metrics-addr", &addr])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("RELAY") && table.contains(&remote.url()),
        "{table}"
    );
    assert!(table.contains("connected"), "{table}");
    assert!(
        table.contains("SETTLE IN") && table.contains("time to settle: 0s (settled)"),
        "{table}"
    );
    // Nothing listening: a clear error, exit 1.
    let out = Command::new(BIN)
        .args([
            "status",
            "--metrics-addr",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics-addr"));
}

#[test]
fn readme_cli_table_matches_help() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout).to_string();
    let flags: HashSet<String> = help
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("--"))
        .filter_map(|l| l.split_whitespace().next())
        .map(|f| format!("--{}", f.trim_end_matches(',')))
        .filter(|f| f != "--help")
        .collect();
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let documented: HashSet<String> = readme
        .lines()
        .filter(|l| l.starts_with("| `--"))
        .filter_map(|l| l.trim_start_matches("| `").split(['`', ' ']).next())
        .map(str::to_string)
        .collect();
    let missing: Vec<_> = flags.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&flags).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "README CLI table: missing {missing:?}, not in --help {stale:?}"
    );
}

// ----- TLS -----

#[test]
fn a_full_sync_over_wss_with_a_test_ca_given_by_ca_file() {
    use grasp_sync::testing::tls::{TestCa, TlsProxy};
    let ca = TestCa::new();
    let ca_file = std::env::temp_dir().join(format!("grasp-sync-ca-{}.pem", std::process::id()));
    ca.write_pem(&ca_file).unwrap();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let own_tls = TlsProxy::start(own.port(), ca.server_config());
    let remote_tls = TlsProxy::start(remote.port(), ca.server_config());
    let keys = nostr::key::Keys::generate();
    let ann = announcement(&keys, "r", &[&[&remote_tls.url()]]);
    let repo = repo_ref(&keys, "r");
    let issue = root(&keys, 1621, &repo, "over TLS", &[]);
    own.insert(&ann);
    remote.insert(&ann);
    remote.insert(&issue);
    let child = spawn(
        &[
            "--own-relay",
            &own_tls.url(),
            "--ca-file",
            ca_file.to_str().unwrap(),
            "--once",
            "--batch-window",
            "200",
            "--deadline",
            "120",
        ],
        &[],
    );
    let (code, err) = finish(child, Duration::from_secs(150));
    assert_eq!(code, Some(0), "{err}");
    let want: HashSet<_> = [ann.id, issue.id].into_iter().collect();
    assert_eq!(own.event_ids(), want);
    assert!(
        remote.nip11_requests() >= 1,
        "NIP-11 over https:// through the proxy"
    );
    assert!(err.contains(&remote_tls.url()), "{err}");
}

#[test]
fn a_certificate_that_does_not_verify_is_a_clear_connect_failure() {
    use grasp_sync::testing::tls::{TestCa, TlsProxy};
    let own = TestRelay::start();
    let untrusted = TestCa::new();
    let own_tls = TlsProxy::start(own.port(), untrusted.server_config());
    let child = spawn(
        &["--own-relay", &own_tls.url(), "--once", "--deadline", "5"],
        &[("RUST_LOG", "warn")],
    );
    let (code, err) = finish(child, Duration::from_secs(60));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&own_tls.url()), "names the relay: {err}");
    assert!(
        err.contains("certificate") && err.contains("UnknownIssuer"),
        "names the reason: {err}"
    );
    let bad = spawn(
        &["--own-relay", "ws://x", "--ca-file", "/nonexistent/ca.pem"],
        &[],
    );
    let (code, err) = finish(bad, Duration::from_secs(20));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--ca-file /nonexistent/ca.pem"), "{err}");
}
