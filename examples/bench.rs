//! Throughput and memory benchmark: how long a full sync of N events from remote relays into
//! the own relay takes, and how much memory the process needs, on embedded relays.
//!
//! ```sh
//! cargo run --release --features testing --example bench
//! ```
//!
//! Prints one row per size: events, remote relays, repositories, seconds to a complete own
//! relay, events/s, peak resident memory (VmHWM) and threads. Numbers depend on the machine;
//! the signature check (~30k events/s per core) bounds ingest.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use grasp_sync::testing::{wait_until, TestRelay};
use grasp_sync::{Config, RelayUrl};
use nostr::event::{EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::key::Keys;

struct Row {
    events: usize,
    relays: usize,
    repos: usize,
    seconds: f64,
    rss_mib: f64,
    threads: usize,
}

fn proc_status(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn run(events: usize, relays: usize, repos: usize) -> Row {
    let own = TestRelay::start();
    let remotes: Vec<TestRelay> = (0..relays).map(|_| TestRelay::start()).collect();
    let keys = Keys::generate();
    let mut expected: HashSet<EventId> = HashSet::new();
    let mut roots = Vec::new();
    for r in 0..repos {
        let relay = &remotes[r % relays];
        let d = format!("repo-{r}");
        let ann = EventBuilder::new(Kind::Custom(30617), "")
            .tag(Tag::parse(["d", &d]).unwrap())
            .tag(Tag::parse(["relays", &relay.url()]).unwrap())
            .finalize(&keys)
            .unwrap();
        let coord = format!("30617:{}:{d}", keys.public_key().to_hex());
        let issue = EventBuilder::new(Kind::Custom(1621), format!("issue of {d}"))
            .tag(Tag::parse(["a", &coord]).unwrap())
            .finalize(&keys)
            .unwrap();
        own.insert(&ann);
        own.insert(&issue);
        relay.insert(&ann);
        expected.insert(ann.id);
        expected.insert(issue.id);
        roots.push((r % relays, issue.id));
    }
    let repliers: Vec<Keys> = (0..16).map(|_| Keys::generate()).collect();
    for i in 0..events {
        let (relay, root) = roots[i % roots.len()];
        let reply = EventBuilder::new(
            Kind::Custom(1111),
            format!("comment {i} {}", "x".repeat(200)),
        )
        .tag(Tag::parse(["E", &root.to_hex()]).unwrap())
        .finalize(&repliers[i % repliers.len()])
        .unwrap();
        remotes[relay].insert(&reply);
        expected.insert(reply.id);
    }
    let mut config = Config::new(RelayUrl::parse(&own.url()).unwrap())
        .allow_private_relays(true)
        .batch_window(Duration::from_millis(200));
    // The embedded relays return everything in one answer; say so (as NIP-11 would).
    config.assumed_page_size = 1_000_000;
    let started = Instant::now();
    let handle = grasp_sync::start(config).expect("engine starts");
    let complete = wait_until(Duration::from_secs(600), || {
        own.len() >= expected.len() && own.event_ids() == expected
    });
    let seconds = started.elapsed().as_secs_f64();
    assert!(complete, "sync of {events} events did not complete");
    let threads = proc_status("Threads:").unwrap_or(0) as usize;
    handle
        .shutdown(Duration::from_secs(10))
        .expect("engine stops");
    Row {
        events,
        relays,
        repos,
        seconds,
        rss_mib: proc_status("VmHWM:").unwrap_or(0) as f64 / 1024.0,
        threads,
    }
}

fn main() {
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .try_init();
    println!(
        "{:>8} {:>7} {:>6} {:>9} {:>10} {:>12} {:>8}",
        "events", "relays", "repos", "seconds", "events/s", "peak RSS MiB", "threads"
    );
    for (events, relays, repos) in [(1_000, 3, 30), (10_000, 5, 100), (30_000, 10, 300)] {
        let r = run(events, relays, repos);
        println!(
            "{:>8} {:>7} {:>6} {:>9.2} {:>10.0} {:>12.1} {:>8}",
            r.events,
            r.relays,
            r.repos,
            r.seconds,
            r.events as f64 / r.seconds,
            r.rss_mib,
            r.threads
        );
    }
    println!("(peak RSS includes the embedded relays and the generated events; it never falls)");
}
