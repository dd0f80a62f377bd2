//! `bare-copy OWN_URL PLAN_FILE`: the least a synchronous copier with grasp-sync's shape does,
//! as the bench's `--only pool` measure of what the transport and the signature checks cost on
//! their own: one OS thread and one blocking websocket per remote relay, every filter of the
//! plan sent with [`OPEN`] subscriptions open at a time, each event parsed, checked once (`Event::verify`: id and signature) the
//! first time any relay delivers it, and written to the own relay over one connection with at
//! most [`IN_FLIGHT`] `OK`s outstanding.
//!
//! It does nothing else a sync must do (no paging, no reading of the own relay, no planning,
//! no retries), so its CPU per unique event is a lower bound for any copier built this way.
//!
//! The plan and the protocol are `sdk-pool`'s: one JSON object per line,
//! `{"relays": [...], "filter": {...}}`; once every relay has sent `EOSE` for every filter and
//! every `OK` has come, one line on stdout, `done unique=N published=N refused=N copies=N
//! errors=N seconds=S`, then it waits until stdin closes and exits (0: complete and clean).

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nostr_sdk::prelude::*;
use serde_json::value::RawValue;
use tungstenite::{Message, WebSocket};

#[path = "../plan/mod.rs"]
mod plan;

/// Events written to the own relay whose `OK` has not come yet (as grasp-sync's forwarder).
const IN_FLIGHT: usize = 64;
/// Subscriptions open at once on one relay (the next filter is sent when one ends).
const OPEN: usize = 8;
/// No relay may stay silent longer than this.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

type Ws = WebSocket<TcpStream>;

fn connect(url: &str) -> Result<Ws, String> {
    let hostport = url
        .strip_prefix("ws://")
        .ok_or_else(|| format!("{url}: only ws:// URLs"))?
        .trim_end_matches('/');
    let stream = TcpStream::connect(hostport).map_err(|e| format!("{url}: {e}"))?;
    stream
        .set_read_timeout(Some(READ_TIMEOUT))
        .map_err(|e| format!("{url}: {e}"))?;
    stream
        .set_nodelay(true)
        .map_err(|e| format!("{url}: {e}"))?;
    let (ws, _) = tungstenite::client(url, stream).map_err(|e| format!("{url}: {e}"))?;
    Ok(ws)
}

/// The plan's filters by relay, as JSON text.
fn read_plan(path: &str) -> Result<HashMap<String, Vec<String>>, String> {
    let mut by_relay: HashMap<String, Vec<String>> = HashMap::new();
    for line in plan::read(path)? {
        for url in line.relays {
            by_relay.entry(url).or_default().push(line.filter.clone());
        }
    }
    Ok(by_relay)
}

/// What one remote relay's thread counted: events received, errors.
struct Tally {
    copies: u64,
    errors: Vec<String>,
}

/// The event id of an `EVENT` frame whose event starts with its `"id"` field (relays write it
/// first); `None` otherwise (the event is then parsed).
fn scan_id(frame: &str) -> Option<EventId> {
    let at = frame.find(r#"{"id":""#)? + 7;
    EventId::from_hex(frame.get(at..at + 64)?).ok()
}

/// One remote relay: its filters, [`OPEN`] at a time, until each has its EOSE.
fn read_relay(
    url: &str,
    filters: &[String],
    seen: &Mutex<HashSet<EventId>>,
    out: &mpsc::SyncSender<String>,
) -> Tally {
    let mut read = Tally {
        copies: 0,
        errors: Vec::new(),
    };
    let mut ws = match connect(url) {
        Ok(ws) => ws,
        Err(e) => {
            read.errors.push(e);
            return read;
        }
    };
    let mut next = 0;
    let mut open = 0;
    let mut ended: HashSet<String> = HashSet::new();
    loop {
        while open < OPEN && next < filters.len() {
            let req = format!(r#"["REQ","s{next}",{}]"#, filters[next]);
            if let Err(e) = ws.send(Message::text(req)) {
                read.errors.push(format!("{url}: REQ: {e}"));
                return read;
            }
            next += 1;
            open += 1;
        }
        if open == 0 {
            break;
        }
        let text = match ws.read() {
            Ok(Message::Text(t)) => t,
            Ok(_) => continue,
            Err(e) => {
                read.errors.push(format!("{url}: {e}"));
                return read;
            }
        };
        if text.as_str().starts_with(r#"["EVENT""#) {
            read.copies += 1;
            // A copy is known by its id before anything is parsed.
            if let Some(id) = scan_id(text.as_str()) {
                if seen.lock().expect("seen lock").contains(&id) {
                    continue;
                }
            }
            let (_, _, raw) = match serde_json::from_str::<(&str, &str, &RawValue)>(text.as_str()) {
                Ok(m) => m,
                Err(e) => {
                    read.errors.push(format!("{url}: event: {e}"));
                    continue;
                }
            };
            let event = match Event::from_json(raw.get()) {
                Ok(e) => e,
                Err(e) => {
                    read.errors.push(format!("{url}: event: {e}"));
                    continue;
                }
            };
            if event.verify().is_err() {
                read.errors
                    .push(format!("{url}: {} does not verify", event.id));
                continue;
            }
            // The checked JSON goes to the own relay as it came (no second serialisation).
            let frame = format!(r#"["EVENT",{}]"#, raw.get());
            if seen.lock().expect("seen lock").insert(event.id) && out.send(frame).is_err() {
                read.errors.push("own writer gone".into());
                return read;
            }
            continue;
        }
        let msg: Vec<serde_json::Value> = match serde_json::from_str(text.as_str()) {
            Ok(m) => m,
            Err(e) => {
                read.errors.push(format!("{url}: {e}"));
                continue;
            }
        };
        match msg.first().and_then(|k| k.as_str()) {
            Some("EOSE") => {
                let sub = msg.get(1).and_then(|s| s.as_str()).unwrap_or_default();
                if ended.insert(sub.to_string()) {
                    open -= 1;
                    let _ = ws.send(Message::text(format!(r#"["CLOSE","{sub}"]"#)));
                }
            }
            // rust-nostr's relay closes an `ids` subscription that found every id, right
            // after its EOSE, with an empty reason.
            Some("CLOSED") => {
                let sub = msg.get(1).and_then(|s| s.as_str()).unwrap_or_default();
                if ended.insert(sub.to_string()) {
                    open -= 1;
                    read.errors.push(format!("{url}: {text}"));
                }
            }
            Some("NOTICE") => read.errors.push(format!("{url}: {text}")),
            _ => {}
        }
    }
    let _ = ws.close(None);
    read
}

/// The own relay: writes every event that comes, at most [`IN_FLIGHT`] unanswered; returns
/// (published, refused).
fn write_own(ws: &mut Ws, events: mpsc::Receiver<String>) -> (u64, u64, Vec<String>) {
    let (mut published, mut refused, mut errors) = (0u64, 0u64, Vec::new());
    let mut in_flight = 0usize;
    let mut open = true;
    while open || in_flight > 0 {
        let next = if open && in_flight < IN_FLIGHT {
            if in_flight == 0 {
                events.recv().ok()
            } else {
                match events.try_recv() {
                    Ok(e) => Some(e),
                    Err(mpsc::TryRecvError::Empty) => None,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        None
                    }
                }
            }
        } else {
            None
        };
        match next {
            Some(frame) => {
                // Written to the buffer; flushed once nothing more is at hand (one send for
                // every frame waiting).
                if let Err(e) = ws.write(Message::text(frame)) {
                    errors.push(format!("own relay: {e}"));
                    return (published, refused, errors);
                }
                in_flight += 1;
                published += 1;
            }
            None if open && in_flight == 0 => open = false,
            None => match ws.flush().and_then(|()| ws.read()) {
                Ok(Message::Text(t)) => {
                    if t.as_str().starts_with(r#"["OK""#) {
                        in_flight -= 1;
                        // `["OK","<64 hex>",true,…`
                        if t.as_str().get(71..77) != Some("\",true") {
                            refused += 1;
                            errors.push(format!("own relay: {t}"));
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    errors.push(format!("own relay: {e}"));
                    return (published, refused, errors);
                }
            },
        }
    }
    (published, refused, errors)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [own, plan_path] = args.as_slice() else {
        eprintln!("usage: bare-copy OWN_URL PLAN_FILE");
        return ExitCode::from(2);
    };
    let plan = match read_plan(plan_path) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("bare-copy: {e}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    let mut own_ws = match connect(own) {
        Ok(ws) => ws,
        Err(e) => {
            eprintln!("bare-copy: own relay {e}");
            return ExitCode::from(2);
        }
    };
    let seen: Arc<Mutex<HashSet<EventId>>> = Arc::default();
    let (tx, rx) = mpsc::sync_channel::<String>(1024);
    let readers: Vec<_> = plan
        .into_iter()
        .map(|(url, filters)| {
            let (seen, tx) = (seen.clone(), tx.clone());
            std::thread::Builder::new()
                .name("relay".into())
                .spawn(move || read_relay(&url, &filters, &seen, &tx))
                .expect("spawn a relay thread")
        })
        .collect();
    drop(tx);
    let (published, refused, mut errors) = write_own(&mut own_ws, rx);
    let mut copies = 0;
    for r in readers {
        let read = r.join().unwrap_or_else(|_| Tally {
            copies: 0,
            errors: vec!["a relay thread panicked".into()],
        });
        copies += read.copies;
        errors.extend(read.errors);
    }
    let unique = seen.lock().expect("seen lock").len();
    for e in errors.iter().take(20) {
        eprintln!("bare-copy: {e}");
    }
    println!(
        "done unique={unique} published={} refused={refused} copies={copies} errors={} seconds={:.3}",
        published - refused,
        errors.len(),
        started.elapsed().as_secs_f64()
    );
    let _ = std::io::stdout().flush();
    let mut buf = [0u8; 256];
    while let Ok(n) = std::io::stdin().read(&mut buf) {
        if n == 0 {
            break;
        }
    }
    if errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
