//! `sdk-pool OWN_URL PLAN_FILE`: rust-nostr's nostr-sdk pool (`Client`, at its defaults) doing
//! what a GRASP sync does on a first read, as the yardstick of the bench's `--only pool`
//! section: read every stored event the plan's filters select from the remote relays and
//! publish each unique event into the own relay.
//!
//! `PLAN_FILE` holds one JSON object per line, `{"relays": ["ws://…", …], "filter": {…}}`: one
//! filter, sent as a REQ of its own to each of those relays (the bench writes grasp-sync's
//! filters: per relay, the repositories listed there by `#a`/`#A`/`#q` and their root events by
//! `#e`/`#E`/`#q`, 100 values a filter, and the announcements' kinds).
//!
//! Every filter is one `Client::stream_events` (exit on EOSE), all of them at once on a
//! multi-threaded tokio runtime (one worker per core). nostr-sdk checks each event's signature
//! the first time one of its relays delivers it (its tracker of seen ids keeps the newest
//! 35,000); the helper keeps the ids it has published and sends every new event to the own
//! relay with `send_event(..).to([own])` (waits for its OK), at most [`IN_FLIGHT`] at once.
//!
//! When every stream has ended and every OK has come, it prints one line to stdout,
//! `done unique=N published=N refused=N copies=N errors=N seconds=S`, then waits until stdin
//! closes (so the bench can read its CPU time and peak RSS) and exits: 0 when every stream
//! ended without error and the own relay accepted every event, 1 otherwise (the reasons on
//! stderr).

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nostr_sdk::prelude::*;

#[path = "../plan/mod.rs"]
mod plan;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, Semaphore};

/// Events published into the own relay whose OK has not come yet (grasp-sync's forwarder keeps
/// 64 in flight too).
const IN_FLIGHT: usize = 64;
/// How long the pool waits for its relays to connect before it sends its REQs.
const CONNECT_WAIT: Duration = Duration::from_secs(30);

/// One line of the plan.
struct Planned {
    relays: Vec<RelayUrl>,
    filter: Filter,
}

fn read_plan(path: &str) -> Result<Vec<Planned>, String> {
    let mut plan = Vec::new();
    for (n, line) in plan::read(path)?.into_iter().enumerate() {
        let bad = |what: String| format!("{path}: line {} of the plan: {what}", n + 1);
        let relays = line
            .relays
            .iter()
            .map(|u| RelayUrl::parse(u).map_err(|e| bad(format!("relay {u:?}: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        let filter = Filter::from_json(&line.filter).map_err(|e| bad(format!("filter: {e}")))?;
        plan.push(Planned { relays, filter });
    }
    Ok(plan)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [own, plan_path] = args.as_slice() else {
        eprintln!("usage: sdk-pool OWN_URL PLAN_FILE");
        return ExitCode::from(2);
    };
    let own = match RelayUrl::parse(own) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("sdk-pool: own relay {own}: {e}");
            return ExitCode::from(2);
        }
    };
    let plan = match read_plan(plan_path) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("sdk-pool: {e}");
            return ExitCode::from(2);
        }
    };
    let ok = run(own, plan).await;

    // Stay until stdin closes: the bench reads the process's CPU time and peak RSS first.
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 256];
    while let Ok(n) = stdin.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The whole copy; whether it was complete and clean.
async fn run(own: RelayUrl, plan: Vec<Planned>) -> bool {
    let started = Instant::now();
    let client = Client::default();
    let remotes: HashSet<RelayUrl> = plan.iter().flat_map(|p| p.relays.clone()).collect();
    for url in &remotes {
        if let Err(e) = client
            .add_relay(url)
            .capabilities(RelayCapabilities::READ)
            .await
        {
            eprintln!("sdk-pool: add relay {url}: {e}");
            return false;
        }
    }
    if let Err(e) = client
        .add_relay(&own)
        .capabilities(RelayCapabilities::WRITE)
        .await
    {
        eprintln!("sdk-pool: add own relay {own}: {e}");
        return false;
    }
    client.connect().and_wait(CONNECT_WAIT).await;

    // Every filter's stream forwards its events here; the publisher dedups and sends.
    let (tx, mut rx) = mpsc::channel::<Event>(1024);
    let mut streams = Vec::with_capacity(plan.len());
    for p in plan {
        let client = client.clone();
        let tx = tx.clone();
        streams.push(tokio::spawn(async move {
            let target: Vec<(RelayUrl, Vec<Filter>)> = p
                .relays
                .into_iter()
                .map(|u| (u, vec![p.filter.clone()]))
                .collect();
            let mut stream = match client.stream_events(target).await {
                Ok(s) => s,
                Err(e) => return vec![format!("REQ not sent: {e}")],
            };
            let mut errors = Vec::new();
            while let Some((url, item)) = stream.next().await {
                match item {
                    Ok(event) => {
                        if tx.send(event).await.is_err() {
                            errors.push("publisher gone".to_string());
                            break;
                        }
                    }
                    Err(e) => errors.push(format!("{url}: {e}")),
                }
            }
            errors
        }));
    }
    drop(tx);

    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut published: HashSet<EventId> = HashSet::new();
    let mut copies = 0u64;
    let mut sends = Vec::new();
    while let Some(event) = rx.recv().await {
        copies += 1;
        if !published.insert(event.id) {
            continue;
        }
        let permit = match slots.clone().acquire_owned().await {
            Ok(p) => p,
            Err(e) => {
                eprintln!("sdk-pool: {e}");
                return false;
            }
        };
        let client = client.clone();
        let own = own.clone();
        sends.push(tokio::spawn(async move {
            let out = client.send_event(&event).to([&own]).await;
            drop(permit);
            match out {
                Ok(out) if out.failed.is_empty() && !out.success.is_empty() => None,
                Ok(out) => Some(format!("{}: {:?}", event.id, out.failed)),
                Err(e) => Some(format!("{}: {e}", event.id)),
            }
        }));
    }

    let mut errors: HashMap<String, usize> = HashMap::new();
    let mut stream_errors = 0usize;
    for s in streams {
        for e in s
            .await
            .unwrap_or_else(|e| vec![format!("stream task: {e}")])
        {
            stream_errors += 1;
            *errors.entry(e).or_default() += 1;
        }
    }
    let mut refused = 0usize;
    for s in sends {
        if let Some(e) = s.await.unwrap_or_else(|e| Some(format!("send task: {e}"))) {
            refused += 1;
            *errors.entry(e).or_default() += 1;
        }
    }
    let mut shown: Vec<(&String, &usize)> = errors.iter().collect();
    shown.sort();
    for (e, n) in shown.iter().take(20) {
        eprintln!("sdk-pool: {n} × {e}");
    }
    let mut stdout = std::io::stdout();
    let _ = writeln!(
        stdout,
        "done unique={} published={} refused={refused} copies={copies} errors={stream_errors} seconds={:.3}",
        published.len(),
        published.len() - refused,
        started.elapsed().as_secs_f64()
    );
    let _ = stdout.flush();
    refused == 0 && stream_errors == 0
}
