//! `nip77-relay [PORT]`: runs rust-nostr's `LocalRelay` (in-memory, NIP-77 on) on
//! 127.0.0.1:PORT (a free port when PORT is 0 or absent), prints its `ws://` URL as the first
//! line of stdout, and exits when stdin closes (so a test that dies takes the relay with it).
//!
//! The write rate limit is lifted (rust-nostr's default is 60 events per minute per
//! connection) so that tests can seed thousands of events, unless
//! `NIP77_RELAY_NOTES_PER_MINUTE` sets it (an own relay that throttles writes); everything
//! else is the default (500 results per REQ without `limit`, 500 subscriptions per
//! connection).

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;

use nostr_relay_builder::prelude::*;
use tokio::io::AsyncReadExt;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let port: u16 = match std::env::args().nth(1).map(|a| a.parse::<u16>()) {
        None => 0,
        Some(Ok(port)) => port,
        Some(Err(e)) => {
            eprintln!("nip77-relay: PORT must be a number 0-65535: {e}");
            return ExitCode::from(2);
        }
    };
    let notes_per_minute = match std::env::var("NIP77_RELAY_NOTES_PER_MINUTE") {
        Err(_) => u32::MAX,
        Ok(v) => match v.parse::<u32>() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("nip77-relay: NIP77_RELAY_NOTES_PER_MINUTE must be a positive number");
                return ExitCode::from(2);
            }
        },
    };
    let mut builder = LocalRelay::builder()
        .addr(IpAddr::V4(Ipv4Addr::LOCALHOST))
        .rate_limit(RateLimit {
            max_reqs: 500,
            notes_per_minute,
        });
    // Without a port the relay picks a free one itself (`.port(0)` would report port 0).
    if port != 0 {
        builder = builder.port(port);
    }
    let relay = builder.build();
    if let Err(e) = relay.run().await {
        eprintln!("nip77-relay: cannot listen on 127.0.0.1:{port}: {e}");
        return ExitCode::FAILURE;
    }
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "{}", relay.url().await);
    let _ = stdout.flush();

    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 256];
    loop {
        match stdin.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    relay.shutdown();
    ExitCode::SUCCESS
}
