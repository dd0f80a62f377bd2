//! Hostile at scale (issue 20, items 1, 2 and 4) over real sockets on 127.0.0.1: throw-away
//! keys whose relays accept TCP and never answer cannot keep a repository with activity
//! from syncing; relays that never complete a connect give their slots to others; URLs that
//! differ only in their query reach one relay a few times at most.

mod common;

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{announcement, root, url, OneRepo};
use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::Config;
use nostr::key::Keys;

const DEADLINE: Duration = Duration::from_secs(60);

/// Listeners on 127.0.0.1 that accept TCP and never answer (a connect to them waits out
/// the handshake deadline); the sockets are held until the value is dropped.
struct BlackHoles {
    urls: Vec<String>,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BlackHoles {
    fn start(n: usize) -> BlackHoles {
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut urls = Vec::new();
        let mut threads = Vec::new();
        for _ in 0..n {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            listener.set_nonblocking(true).unwrap();
            urls.push(format!("ws://{}", listener.local_addr().unwrap()));
            let (accepted, stop) = (accepted.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut held: Vec<TcpStream> = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((s, _)) => {
                            accepted.fetch_add(1, Ordering::SeqCst);
                            held.push(s);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            }));
        }
        BlackHoles {
            urls,
            accepted,
            stop,
            threads,
        }
    }
}

impl Drop for BlackHoles {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn config(own: &TestRelay, max_relays: usize) -> Config {
    let mut config = Config::new(url(own))
        .batch_window(Duration::from_millis(100))
        .allow_private_relays(true);
    config.backoff.base = Duration::from_millis(200);
    config.max_relays = max_relays;
    // A black hole holds a connect for this long.
    config.ws.connect_timeout = Duration::from_secs(2);
    // No NIP-11 request (it would wait on the black holes too).
    config.nip11_timeout = Duration::ZERO;
    config
}

/// `flood` throw-away keys, each announcing one repository on its own black hole (with an
/// issue each when `spam_life`), and a repository on `remote` with an issue and a reply.
/// Returns the reply that must arrive.
fn seed(
    own: &TestRelay,
    remote: &TestRelay,
    holes: &BlackHoles,
    spam_life: bool,
) -> nostr::event::Event {
    for hole in &holes.urls {
        let k = Keys::generate();
        own.insert(&announcement(&k, "x", &[&[hole]]));
        if spam_life {
            own.insert(&root(&k, 1621, &common::repo_ref(&k, "x"), "spam", &[]));
        }
    }
    let r = OneRepo::new(remote);
    r.seed(own, remote);
    own.insert(&r.issue);
    let reply = r.reply("legitimate history");
    remote.insert(&reply);
    reply
}

#[test]
fn throwaway_keys_on_black_hole_relays_cannot_starve_a_repository_with_activity() {
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let holes = BlackHoles::start(60);
    let reply = seed(&own, &remote, &holes, false);
    let handle = grasp_sync::start(config(&own, 10)).unwrap();
    assert!(
        wait_until(DEADLINE, || own.contains(&reply.id)),
        "the repository with activity is synced: {:#?}",
        handle.status().targets
    );
    let status = handle.status();
    assert!(status.relays.len() <= 10, "{}", status.relays.len());
    assert!(status.targets.relays_over_global_cap > 0, "the cap binds");
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn black_hole_relays_give_their_slots_to_relays_not_tried_yet() {
    // The throw-away repositories show activity too and name one relay each, so they come
    // before the repository on `remote` in the round-robin: it gets a slot only when
    // black holes that never complete a connect move behind relays not tried yet.
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    let holes = BlackHoles::start(30);
    let reply = seed(&own, &remote, &holes, true);
    let handle = grasp_sync::start(config(&own, 10)).unwrap();
    assert!(
        wait_until(DEADLINE, || own.contains(&reply.id)),
        "the repository is synced after the black holes gave up their slots: {:#?}",
        handle.status().targets
    );
    // The black holes were tried and marked failing (on a loaded host the repository's
    // slot may come while the last of them are still within their connect deadline).
    assert!(
        wait_until(DEADLINE, || handle.status().relays_failing >= 10),
        "failing: {}",
        handle.status().relays_failing
    );
    assert!(
        holes.accepted.load(Ordering::SeqCst) >= 20,
        "black holes tried in turn"
    );
    handle.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn sixty_four_spellings_of_one_relay_open_a_few_connections() {
    common::init_logging();
    let own = TestRelay::start();
    let remote = TestRelay::start();
    // 8 keys announce 8 spellings each of the same relay (one host and port).
    for k in 0..8 {
        let keys = Keys::generate();
        let spellings: Vec<String> = (0..8)
            .map(|i| format!("{}/?{}", remote.url(), k * 8 + i))
            .collect();
        let refs: Vec<&str> = spellings.iter().map(String::as_str).collect();
        own.insert(&announcement(&keys, "x", &[&refs]));
    }
    let handle = grasp_sync::start(config(&own, 1000)).unwrap();
    assert!(wait_until(DEADLINE, || handle.status().is_settled()));
    let status = handle.status();
    assert_eq!(
        remote.connections_accepted(),
        grasp_sync::core::targets::MAX_URLS_PER_HOST as u64,
        "{status:#?}"
    );
    assert_eq!(status.targets.relays_over_host_cap, 60);
    let host = format!("127.0.0.1:{}", remote.port());
    assert_eq!(status.hosts_with_several_urls, vec![(host, 4)]);
    handle.shutdown(Duration::from_secs(10)).unwrap();
}
