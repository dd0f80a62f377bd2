//! `grasp-sync`: keep a GRASP server's own relay complete (GRASP-02 proactive sync).
//!
//! A thin CLI over the library: parse flags, start the engine, run until the process is
//! stopped. Flag, URL or key errors exit with status 2 and a message naming the flag or
//! variable.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use argh::FromArgs;
use grasp_sync::{Config, RelayUrl};

/// Keep a GRASP server's own relay complete: watch it for NIP-34 repository announcements and
/// root events, connect to every relay those announcements list, pull all related history,
/// stay subscribed live, and publish every related event into the own relay.
///
/// Logging: set RUST_LOG (e.g. RUST_LOG=info, RUST_LOG=grasp_sync=debug). An info-level
/// summary line is printed once per minute.
#[derive(FromArgs, Debug)]
struct Args {
    /// websocket URL the engine connects to for the own relay (required), e.g.
    /// ws://127.0.0.1:7777; the self-subscription reads it and the forwarder writes to it
    #[argh(option)]
    own_relay: String,

    /// a public URL of this service (repeatable), e.g. wss://git.example.com; relays equal to
    /// the own relay or a public URL are never synced from, and only repositories whose
    /// announcement lists one of them are synced (GRASP-01; see --archive). Without it every
    /// repository is synced and a warning is logged
    #[argh(option)]
    public_url: Vec<String>,

    /// sync every repository the own relay holds, also those whose announcement does not
    /// list this service's --public-url
    #[argh(switch)]
    archive: bool,

    /// the most remote relays connected at once (default 1000); when more are named the
    /// slots are shared round-robin across announcing pubkeys
    #[argh(option, default = "1000")]
    max_relays: usize,

    /// the most relays the repositories of one announcing pubkey can make us sync from
    /// (default 64)
    #[argh(option, default = "64")]
    max_relays_per_pubkey: usize,

    /// the most relays read from one announcement (default 32)
    #[argh(option, default = "32")]
    max_relays_per_announcement: usize,

    /// mebibytes of events on their way into the own relay at most (default 64); a remote relay
    /// waits before handing over an event that does not fit
    #[argh(option, default = "64")]
    forward_max_mib: usize,

    /// mebibytes of that one remote relay may hold (default 16)
    #[argh(option, default = "16")]
    forward_relay_mib: usize,

    /// a relay to connect from the start and never idle-disconnect (repeatable); its
    /// announcements (kinds 30617/30618) are pulled into the own relay
    #[argh(option)]
    bootstrap: Vec<String>,

    /// self-subscription batch window in milliseconds (default 5000): events read from the
    /// own relay are applied together once this long after the first one of a batch
    #[argh(option, default = "5000")]
    batch_window: u64,

    /// EOSE deadline in seconds (default 120): a batch of subscriptions with no EOSE for this
    /// long fails and is retried after a backoff; any other query without EOSE in time is
    /// sent again
    #[argh(option, default = "120")]
    eose_timeout: u64,

    /// file holding the nsec1… or 64-hex secret key used to answer NIP-42 AUTH challenges
    /// from remote relays and the own relay; alternatively set GRASP_SYNC_NSEC; never pass a
    /// key on the command line
    #[argh(option)]
    nsec_file: Option<PathBuf>,
}

fn parse_url(setting: &str, value: &str) -> Result<RelayUrl, String> {
    RelayUrl::parse(value).map_err(|e| format!("--{setting} {value:?}: {e}"))
}

fn build_config(args: &Args) -> Result<Config, String> {
    let own = parse_url("own-relay", &args.own_relay)?;
    let mut config = Config::new(own);
    for u in &args.public_url {
        config = config.public_url(parse_url("public-url", u)?);
    }
    for u in &args.bootstrap {
        config = config.bootstrap(parse_url("bootstrap", u)?);
    }
    if args.batch_window == 0 {
        return Err("--batch-window must be at least 1 millisecond".into());
    }
    if args.eose_timeout == 0 {
        return Err("--eose-timeout must be at least 1 second".into());
    }
    config.archive = args.archive;
    config.max_relays = args.max_relays;
    config.max_relays_per_pubkey = args.max_relays_per_pubkey;
    config.max_relays_per_announcement = args.max_relays_per_announcement;
    if args.forward_max_mib == 0 || args.forward_relay_mib == 0 {
        return Err("--forward-max-mib and --forward-relay-mib must be at least 1".into());
    }
    config.forward.max_bytes = args.forward_max_mib.saturating_mul(1 << 20);
    config.forward.relay_bytes = args.forward_relay_mib.saturating_mul(1 << 20);
    config = config
        .batch_window(Duration::from_millis(args.batch_window))
        .eose_timeout(Duration::from_secs(args.eose_timeout));
    config.auth_keys =
        grasp_sync::config::load_auth_key(args.nsec_file.as_deref()).map_err(|e| e.to_string())?;
    Ok(config)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    let name = argv.first().map(String::as_str).unwrap_or("grasp-sync");
    let rest: Vec<&str> = argv.iter().skip(1).map(String::as_str).collect();
    let args = match Args::from_args(&[name], &rest) {
        Ok(a) => a,
        Err(exit) => {
            return if exit.status.is_ok() {
                print!("{}", exit.output);
                ExitCode::SUCCESS
            } else {
                eprintln!("{}Run grasp-sync --help for usage.", exit.output);
                ExitCode::from(2)
            };
        }
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let config = match build_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("grasp-sync: {e}\nRun grasp-sync --help for usage.");
            return ExitCode::from(2);
        }
    };
    log::info!(
        "grasp-sync {} syncing into {}",
        env!("CARGO_PKG_VERSION"),
        config.own_relay
    );
    match &config.auth_keys {
        Some(k) => log::info!(
            "NIP-42 AUTH: answering challenges as {}",
            k.public_key().to_hex()
        ),
        None => log::info!(
            "NIP-42 AUTH: no key configured (--nsec-file or GRASP_SYNC_NSEC); relays that require AUTH will refuse us"
        ),
    }
    let _handle = match grasp_sync::start(config) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("grasp-sync: {e}");
            return ExitCode::from(1);
        }
    };
    // The engine runs on its own threads until the process is stopped.
    loop {
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<Args, argh::EarlyExit> {
        Args::from_args(&["grasp-sync"], v)
    }

    #[test]
    fn parses_flags() {
        let a = args(&[
            "--own-relay",
            "ws://127.0.0.1:7777",
            "--public-url",
            "wss://git.example.com",
            "--public-url",
            "wss://alias.example.com",
            "--bootstrap",
            "wss://relay.example.org",
            "--batch-window",
            "250",
        ])
        .unwrap();
        let c = build_config(&a).unwrap();
        assert_eq!(c.own_relay.as_str(), "ws://127.0.0.1:7777");
        assert_eq!(c.public_urls.len(), 2);
        assert_eq!(c.bootstrap.len(), 1);
        assert_eq!(c.batch_window, Duration::from_millis(250));
        assert!(matches!(
            c.repo_scope(),
            grasp_sync::core::actions::RepoScope::ListingService(_)
        ));
        assert_eq!(
            (
                c.max_relays,
                c.max_relays_per_pubkey,
                c.max_relays_per_announcement
            ),
            (1000, 64, 32)
        );
    }

    #[test]
    fn scope_and_quota_flags() {
        let a = args(&[
            "--own-relay",
            "ws://127.0.0.1:7777",
            "--public-url",
            "wss://git.example.com",
            "--archive",
            "--max-relays",
            "20",
            "--max-relays-per-pubkey",
            "5",
            "--max-relays-per-announcement",
            "4",
            "--forward-max-mib",
            "8",
            "--forward-relay-mib",
            "2",
        ])
        .unwrap();
        let c = build_config(&a).unwrap();
        assert_eq!(c.repo_scope(), grasp_sync::core::actions::RepoScope::All);
        assert_eq!(
            (
                c.max_relays,
                c.max_relays_per_pubkey,
                c.max_relays_per_announcement
            ),
            (20, 5, 4)
        );
        assert_eq!(
            (c.forward.max_bytes, c.forward.relay_bytes),
            (8 << 20, 2 << 20)
        );
        assert!(args(&["--own-relay", "ws://x", "--max-relays", "-1"]).is_err());
        let a = args(&["--own-relay", "ws://x", "--forward-relay-mib", "0"]).unwrap();
        assert!(build_config(&a)
            .unwrap_err()
            .contains("--forward-relay-mib"));
    }

    #[test]
    fn bad_values_are_clear_errors() {
        let a = args(&["--own-relay", "http://x"]).unwrap();
        let e = build_config(&a).unwrap_err();
        assert!(e.contains("--own-relay") && e.contains("ws://"), "{e}");
        let a = args(&["--own-relay", "ws://x", "--bootstrap", "nope"]).unwrap();
        assert!(build_config(&a).unwrap_err().contains("--bootstrap"));
        let a = args(&["--own-relay", "ws://x", "--batch-window", "0"]).unwrap();
        assert!(build_config(&a).unwrap_err().contains("--batch-window"));
        assert!(args(&[]).is_err(), "--own-relay is required");
        assert!(args(&["--own-relay", "ws://x", "--batch-window", "abc"]).is_err());
    }

    fn key_file(content: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "grasp-sync-main-{}-{}",
            std::process::id(),
            content.len()
        ));
        std::fs::write(&p, content).unwrap();
        p
    }

    #[test]
    fn nsec_file_loads_the_key() {
        let hex = "6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e";
        let p = key_file(&format!("{hex}\n"));
        let a = args(&["--own-relay", "ws://x", "--nsec-file", p.to_str().unwrap()]).unwrap();
        let c = build_config(&a).unwrap();
        let keys = c.auth_keys.expect("key loaded");
        assert_eq!(
            keys.public_key(),
            nostr::key::Keys::parse(hex).unwrap().public_key()
        );
        assert!(!format!("{:?}", build_config(&a).unwrap()).contains(hex));
    }

    #[test]
    fn bad_nsec_file_is_a_clear_error() {
        let p = key_file("not a key");
        let a = args(&["--own-relay", "ws://x", "--nsec-file", p.to_str().unwrap()]).unwrap();
        let e = build_config(&a).unwrap_err();
        assert!(e.contains("--nsec-file") && e.contains("nsec1"), "{e}");
        assert!(!e.contains("not a key"), "{e}");
        let a = args(&[
            "--own-relay",
            "ws://x",
            "--nsec-file",
            "/nonexistent/grasp-nsec",
        ])
        .unwrap();
        let e = build_config(&a).unwrap_err();
        assert!(
            e.contains("/nonexistent/grasp-nsec") && e.contains("cannot read"),
            "{e}"
        );
        // No flag taking the key itself.
        assert!(args(&["--own-relay", "ws://x", "--nsec", "nsec1abc"]).is_err());
    }
}
