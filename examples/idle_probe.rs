//! Ad-hoc measurement of what idle connected relays cost (issue 10): CPU of the relay
//! threads and resident memory per connection.
//!
//! ```text
//! cargo run --release --features testing --example idle_probe -- 200 20          # relays, seconds measured
//! cargo run --release --features testing --example idle_probe -- 200 20 fixed    # 50 ms tick always (the old loop)
//! cargo run --release --features testing --example idle_probe -- cost             # checking one event and its copies
//! ```
//!
//! `cost` times, on one thread, what a relay thread does with an EVENT frame of a 1 KB NIP-34
//! event: `Event::verify` alone; a new event (frame, parse, filter, id, signature); a copy
//! whose signature was verified before (frame, parse, filter, id).
//!
//! A child process (this program with `server`) accepts the websockets and answers each REQ
//! with EOSE, blocking without a timeout, so the server costs nothing meanwhile and its memory
//! is not counted. The probe starts one relay thread per connection, opens one subscription on
//! each, waits for every EOSE, lets the connections go quiet, then reads its own VmRSS
//! (against the reading before the threads started) and the CPU time of the `relay …` threads
//! (`/proc/self/task/*/schedstat`) over the measured seconds.

use std::io::{BufRead, Write};
use std::net::TcpListener;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use grasp_sync::core::forward::ForwardLimits;
use grasp_sync::core::sync::Report;
use grasp_sync::core::time::SystemClock;
use grasp_sync::net::WsOptions;
use grasp_sync::testing::internals::Input;
use grasp_sync::testing::internals::Metrics;
use grasp_sync::testing::internals::{connection, ConnectionThread, Control, Role};
use grasp_sync::{Config, RelayUrl};
use nostr::filter::Filter;
use nostr::message::SubscriptionId;
use tungstenite::Message;

fn serve() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("{}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || {
                let Ok(mut ws) = tungstenite::accept(stream) else {
                    return;
                };
                while let Ok(msg) = ws.read() {
                    if let Message::Text(t) = msg {
                        let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
                        if v[0] == "REQ" {
                            let eose = serde_json::json!(["EOSE", v[1]]).to_string();
                            if ws.send(Message::text(eose)).is_err() {
                                return;
                            }
                        }
                    }
                }
            })
            .unwrap();
    }
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Nanoseconds on CPU of the threads named `relay …`.
fn relay_cpu_ns() -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("relay ") {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        total += stat
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
    }
    total
}

fn cost() {
    use grasp_sync::core::dedup::VerifiedSet;
    use grasp_sync::core::message::{
        check_parsed_cached, parse_event, parse_relay_frame, Incoming,
    };
    use nostr::event::{EventBuilder, FinalizeEvent, Kind, Tag};
    let keys = nostr::key::Keys::generate();
    let repo = format!("30617:{}:grasp-sync", keys.public_key().to_hex());
    let events: Vec<nostr::event::Event> = (0..2_000)
        .map(|i| {
            EventBuilder::new(
                Kind::Custom(1621),
                format!("{i} {}", "issue text ".repeat(70)),
            )
            .tag(Tag::parse(["a", repo.as_str()]).unwrap())
            .tag(Tag::parse(["subject", "a subject line"]).unwrap())
            .finalize(&keys)
            .unwrap()
        })
        .collect();
    let frames: Vec<String> = events
        .iter()
        .map(|e| format!(r#"["EVENT","sub-1",{}]"#, e.as_json()))
        .collect();
    let filter = Filter::new().kind(Kind::Custom(1621));
    let check = |frame: &str, set: &VerifiedSet| {
        let Ok(Incoming::Event { raw, .. }) = parse_relay_frame(frame) else {
            panic!()
        };
        let e = parse_event(raw.get()).unwrap();
        check_parsed_cached(&e, raw.get(), &filter, set).unwrap();
        let _: std::sync::Arc<str> = std::sync::Arc::from(raw.get());
    };
    let per = |t: Instant, n: usize| t.elapsed().as_secs_f64() * 1e6 / n as f64;
    // The best of 7 interleaved rounds: the machine is shared, the minimum is the cost.
    let (mut verify, mut new, mut copy) = (f64::MAX, f64::MAX, f64::MAX);
    for _ in 0..7 {
        let t = Instant::now();
        for e in &events {
            e.verify().unwrap();
        }
        verify = verify.min(per(t, events.len()));
        let set = VerifiedSet::default();
        let t = Instant::now();
        for f in &frames {
            check(f, &set);
        }
        new = new.min(per(t, frames.len()));
        let t = Instant::now();
        for f in &frames {
            check(f, &set);
        }
        copy = copy.min(per(t, frames.len()));
    }
    println!(
        "event {} bytes: Event::verify {verify:.1} µs; new event {new:.1} µs; copy {copy:.2} µs; \
         one event from 3 relays + read back = new + 3 copies = {:.1} µs = {:.2} x verify",
        events[0].as_json().len(),
        new + 3.0 * copy,
        (new + 3.0 * copy) / verify
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("server") {
        return serve();
    }
    if args.get(1).map(String::as_str) == Some("cost") {
        return cost();
    }
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let secs: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(20);
    let fixed = args.get(3).map(String::as_str) == Some("fixed");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .arg("server")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut port = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    let port: u16 = port.trim().parse().unwrap();

    let mut ws = WsOptions::default();
    if fixed {
        ws.idle_tick = ws.tick;
    }
    // Overrides to compare settings: IDLE_TICK_MS, QUIET_TICK_MS, READ_BUFFER (bytes).
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    if let Some(ms) = env("IDLE_TICK_MS") {
        ws.idle_tick = Duration::from_millis(ms);
    }
    if let Some(ms) = env("QUIET_TICK_MS") {
        ws.quiet_tick = Duration::from_millis(ms);
    }
    if let Some(b) = env("READ_BUFFER") {
        ws.read_buffer_size = b as usize;
    }
    let metrics = Arc::new(Metrics::default());
    let gate = Arc::new(grasp_sync::core::dedup::ForwardGate::default());
    let (reports, reports_rx) = unbounded::<Input>();
    let (forward, _forward_rx) = unbounded();
    let stopping = Arc::new(AtomicBool::new(false));
    let policy = Arc::new(
        Config::new(RelayUrl::parse("ws://127.0.0.1:1").unwrap())
            .allow_private_relays(true)
            .address_policy(vec![]),
    );
    let tls = grasp_sync::net::tls_config();
    // Warm up what every thread shares (allocator arenas, TLS config) before the baseline.
    std::thread::sleep(Duration::from_millis(200));
    let before = rss_kib();
    let mut controls = Vec::new();
    for i in 0..n {
        let url = RelayUrl::parse(&format!("ws://127.0.0.1:{port}/r{i}")).unwrap();
        let (tx, rx) = unbounded();
        connection::spawn(ConnectionThread {
            counters: metrics.relay(&url),
            url,
            role: Role::Remote(forward.clone()),
            control: rx,
            reports: reports.clone(),
            ws,
            tls: tls.clone(),
            ping_interval: Duration::from_secs(30),
            pong_timeout: Duration::from_secs(30),
            metrics: metrics.clone(),
            gate: gate.clone(),
            stopping: stopping.clone(),
            clock: Arc::new(SystemClock),
            nip11_timeout: Duration::ZERO,
            auth_keys: None,
            policy: policy.clone(),
            forward_limits: ForwardLimits::default(),
            waker: Default::default(),
        })
        .unwrap();
        tx.send(Control::Connect { generation: 1 }).unwrap();
        tx.send(Control::Subscribe {
            generation: 1,
            sub_id: SubscriptionId::new("live"),
            filter: std::sync::Arc::new(Filter::new().kind(nostr::event::Kind::Custom(1621))),
            scope: None,
            fetch_since: None,
        })
        .unwrap();
        controls.push(tx);
    }
    let (mut eose, mut lost) = (0, 0);
    let end = Instant::now() + Duration::from_secs(120);
    while eose + lost < n && Instant::now() < end {
        match reports_rx.recv_timeout(Duration::from_secs(1)) {
            Ok(Input::Report(Report::Eose { .. })) => eose += 1,
            Ok(Input::Report(Report::Disconnected { cause, .. })) => {
                lost += 1;
                eprintln!("disconnected: {cause}");
            }
            _ => {}
        }
    }
    // Quiet for a while: the tick grows after `idle_tick` without a frame.
    std::thread::sleep(ws.idle_tick.max(Duration::from_secs(1)) * 2);
    let after = rss_kib();
    let cpu0 = relay_cpu_ns();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let cpu = relay_cpu_ns() - cpu0;
    let wall = t0.elapsed().as_nanos() as f64;
    println!(
        "relays {n} (EOSE {eose}, lost {lost}), tick {} (idle {:?}, quiet {:?} after {:?}), read buffer {} B: RSS {before} -> {after} KiB = {:.1} KiB per relay; relay threads' CPU {:.3} % of a core over {secs} s = {:.2} % per 1,000 relays",
        if fixed { "fixed 50 ms" } else { "adaptive" },
        ws.idle_tick,
        ws.quiet_tick,
        ws.quiet_after,
        ws.read_buffer_size,
        (after - before) as f64 / n as f64,
        cpu as f64 / wall * 100.0,
        cpu as f64 / wall * 100.0 * 1000.0 / n as f64,
    );
    for c in &controls {
        let _ = c.send(Control::Shutdown);
    }
    std::thread::sleep(Duration::from_millis(1500));
    let _ = child.kill();
    let _ = child.wait();
}
