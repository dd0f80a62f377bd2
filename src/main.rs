//! `grasp-sync`: keep a GRASP server's own relay complete (GRASP-02 proactive sync).
//!
//! A thin CLI over the library: parse flags (each also from a `GRASP_SYNC_*` environment
//! variable), start the engine, serve metrics if asked, run until a signal (or, with
//! `--once`, until the historic sync is done). Flag, URL or key errors exit with status 2
//! and a message naming the flag or variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use argh::FromArgs;
use grasp_sync::core::{Clock, SystemClock};
use grasp_sync::net::RelayPattern;
use grasp_sync::ops::once::{once_backoff, OnceTracker};
use grasp_sync::ops::render;
use grasp_sync::{Config, RelayUrl};

/// Keep a GRASP server's own relay complete: watch it for NIP-34 repository announcements and
/// root events, connect to every relay those announcements list, pull all related history,
/// stay subscribed live, and publish every related event into the own relay.
///
/// Every flag can also be set by the environment variable named after it (a flag on the
/// command line wins; repeatable flags take a comma-separated list; switches take 1/true/yes
/// or 0/false/no). Logging: RUST_LOG (e.g. RUST_LOG=info, RUST_LOG=grasp_sync=debug).
/// SIGINT/SIGTERM stop gracefully (the forward queue is flushed within --stop-timeout); a
/// second signal exits at once. Subcommands: `grasp-sync audit` checks that the own relay
/// holds what the listed relays hold (`grasp-sync audit --help`); `grasp-sync status --metrics-addr ADDR` prints
/// the per-relay table of a running instance.
#[derive(FromArgs, Debug)]
struct Args {
    /// websocket URL of the own relay (required), e.g. ws://127.0.0.1:7777; the
    /// self-subscription reads it and the forwarder writes to it [env GRASP_SYNC_OWN_RELAY]
    #[argh(option)]
    own_relay: String,

    /// a public URL of this service (repeatable), e.g. wss://git.example.com; relays equal to
    /// the own relay or a public URL are never synced from, and only repositories whose
    /// announcement lists one of them are synced (GRASP-01; see --archive). Without it every
    /// repository is synced and a warning is logged [env GRASP_SYNC_PUBLIC_URL]
    #[argh(option)]
    public_url: Vec<String>,

    /// sync every repository the own relay holds, also those whose announcement does not
    /// list this service's --public-url [env GRASP_SYNC_ARCHIVE]
    #[argh(switch)]
    archive: bool,

    /// never use NIP-77 reconciliation: read all history with paged REQs, as before NIP-77
    /// [env GRASP_SYNC_NO_NIP77]
    #[argh(switch)]
    no_nip77: bool,

    /// also read the first sync of relays whose NIP-11 does not list NIP-77 by
    /// reconciliation (by default it is found out beside the REQ path; a relay that ignores
    /// unknown messages then delays its history by 30 s)
    /// [env GRASP_SYNC_NIP77_PROBE]
    #[argh(switch)]
    nip77_probe: bool,

    /// the most relays the repositories of one announcing pubkey can make us sync from
    /// (default 64) [env GRASP_SYNC_MAX_RELAYS_PER_PUBKEY]
    #[argh(option, default = "defaults().max_relays_per_pubkey")]
    max_relays_per_pubkey: usize,

    /// the most URLs of one host and port synced from (default 4): URLs that differ only in
    /// path or query reach the same relay [env GRASP_SYNC_MAX_URLS_PER_HOST]
    #[argh(option, default = "defaults().max_urls_per_host")]
    max_urls_per_host: usize,

    /// a pubkey (hex or npub) whose repositories take relay slots before anyone else's
    /// when --max-relays binds (repeatable) [env GRASP_SYNC_PREFER_PUBKEY]
    #[argh(option)]
    prefer_pubkey: Vec<String>,

    /// the most relays read from one announcement (default 32)
    /// [env GRASP_SYNC_MAX_RELAYS_PER_ANNOUNCEMENT]
    #[argh(option, default = "defaults().max_relays_per_announcement")]
    max_relays_per_announcement: usize,

    /// generations of replies below a root event whose own replies are followed (default 8,
    /// as ngit-grasp): a reply tagging only its parent is synced down to one generation
    /// more [env GRASP_SYNC_REPLY_DEPTH]
    #[argh(option, default = "defaults().threads.max_depth")]
    reply_depth: u8,

    /// the most replies followed below one root event, every generation counted (default
    /// 500) [env GRASP_SYNC_THREAD_SIZE]
    #[argh(option, default = "defaults().threads.max_per_thread")]
    thread_size: usize,

    /// the most replies followed below all root events (default 100000); each is a tag value
    /// in the Layer-3 filters of its repository's relays [env GRASP_SYNC_MAX_THREAD_IDS]
    #[argh(option, default = "defaults().threads.max_total")]
    max_thread_ids: usize,

    /// mebibytes of events on their way into the own relay at most (default 64); a remote relay
    /// waits before handing over an event that does not fit [env GRASP_SYNC_FORWARD_MAX_MIB]
    #[argh(option, default = "defaults().forward.max_bytes >> 20")]
    forward_max_mib: usize,

    /// mebibytes of that one remote relay may hold (default 16)
    /// [env GRASP_SYNC_FORWARD_RELAY_MIB]
    #[argh(option, default = "defaults().forward.relay_bytes >> 20")]
    forward_relay_mib: usize,

    /// a relay to connect from the start and never idle-disconnect (repeatable); its
    /// announcements (kinds 30617/30618) are pulled into the own relay
    /// [env GRASP_SYNC_BOOTSTRAP]
    #[argh(option)]
    bootstrap: Vec<String>,

    /// file holding the nsec1… or 64-hex secret key that answers NIP-42 AUTH challenges;
    /// alternatively put the key itself in GRASP_SYNC_NSEC; never pass a key on the command
    /// line [env GRASP_SYNC_NSEC_FILE]
    #[argh(option)]
    nsec_file: Option<PathBuf>,

    /// file holding the secret key for the own relay's NIP-42 challenges (the
    /// self-subscription and the forwarder); alternatively put the key in GRASP_SYNC_OWN_NSEC;
    /// default: none (the own relay's challenges are not answered; the --nsec-file key is
    /// never shown to the own relay unless given here too) [env GRASP_SYNC_OWN_NSEC_FILE]
    #[argh(option)]
    own_nsec_file: Option<PathBuf>,

    /// without --nsec-file, answer no remote relay's AUTH challenge (default: a key
    /// generated for each run answers them) [env GRASP_SYNC_NO_EPHEMERAL_AUTH]
    #[argh(switch)]
    no_ephemeral_auth: bool,

    /// also connect to relays discovered from events that resolve to loopback, private,
    /// link-local, CGNAT, unique-local or other non-public addresses (refused by default;
    /// relays named by --own-relay, --public-url and --bootstrap are always allowed)
    /// [env GRASP_SYNC_ALLOW_PRIVATE_RELAYS]
    #[argh(switch)]
    allow_private_relays: bool,

    /// never connect to relays matching this pattern (repeatable): a ws:// or wss:// URL, a
    /// host, or *.domain (the domain and its subdomains) [env GRASP_SYNC_DENY_RELAY]
    #[argh(option)]
    deny_relay: Vec<String>,

    /// exempt relays matching this pattern from the address check (repeatable; same
    /// patterns as --deny-relay), e.g. a relay on the local network
    /// [env GRASP_SYNC_ALLOW_RELAY]
    #[argh(option)]
    allow_relay: Vec<String>,

    /// a PEM file of CA certificates to trust for wss:// relays and NIP-11 over https://,
    /// besides the built-in webpki roots (repeatable), e.g. a private CA in front of the own
    /// relay [env GRASP_SYNC_CA_FILE]
    #[argh(option)]
    ca_file: Vec<PathBuf>,

    /// also trust the operating system's certificate store for wss:// relays
    /// [env GRASP_SYNC_SYSTEM_ROOTS]
    #[argh(switch)]
    system_roots: bool,

    /// serve Prometheus /metrics, /status (JSON), /healthz and a status page (/) on this
    /// address, e.g. 127.0.0.1:9464 (default: off) [env GRASP_SYNC_METRICS_ADDR]
    #[argh(option)]
    metrics_addr: Option<String>,

    /// keep the sync state in this directory (created if missing) so that a restart within
    /// 15 minutes continues every relay with a catch-up instead of a fresh sync (default:
    /// off) [env GRASP_SYNC_STATE_DIR]
    #[argh(option)]
    state_dir: Option<PathBuf>,

    /// run the historic sync of everything discovered, then exit: 0 when every relay
    /// completed, 1 when any failed or stayed incomplete; a summary table goes to stderr
    /// [env GRASP_SYNC_ONCE]
    #[argh(switch)]
    once: bool,

    /// with --once, the most seconds the whole run may take (default 3600)
    /// [env GRASP_SYNC_DEADLINE]
    #[argh(option, default = "3600")]
    deadline: u64,

    /// seconds a graceful stop may take to flush the forward queue (default 30)
    /// [env GRASP_SYNC_STOP_TIMEOUT]
    #[argh(option, default = "30")]
    stop_timeout: u64,

    /// self-subscription batch window in milliseconds (default 5000): events read from the
    /// own relay are applied together this long after the first of a batch
    /// [env GRASP_SYNC_BATCH_WINDOW]
    #[argh(option, default = "defaults().batch_window.as_millis() as u64")]
    batch_window: u64,

    /// EOSE deadline in seconds (default 120): a batch with no EOSE for this long fails and
    /// is retried after a backoff; any other query without EOSE in time is sent again
    /// [env GRASP_SYNC_EOSE_TIMEOUT]
    #[argh(option, default = "defaults().eose_timeout.as_secs()")]
    eose_timeout: u64,

    /// the most remote relays connected at once (default 1000); when more are named the
    /// slots are shared round-robin across announcing pubkeys [env GRASP_SYNC_MAX_RELAYS]
    #[argh(option, default = "defaults().max_relays")]
    max_relays: usize,

    /// sync only shard I of N (0-based, e.g. 0/2): N instances beside the same own relay
    /// split the remote relays by FNV-1a 64 of the normalised URL, bootstrap relays
    /// included [env GRASP_SYNC_SHARD]
    #[argh(option)]
    shard: Option<String>,

    /// open subscriptions per relay when its NIP-11 document does not say (default 20)
    /// [env GRASP_SYNC_SUBSCRIPTION_BUDGET]
    #[argh(option, default = "defaults().default_subscription_budget")]
    subscription_budget: usize,

    /// events per query assumed for relays that publish no NIP-11 limits (default 20); a
    /// query returning this many is paged [env GRASP_SYNC_PAGE_SIZE]
    #[argh(option, default = "defaults().assumed_page_size")]
    page_size: usize,

    /// seconds between poll rounds of queries that do not fit a relay's budget (default
    /// 60) [env GRASP_SYNC_POLL_INTERVAL]
    #[argh(option, default = "defaults().poll_interval.as_secs()")]
    poll_interval: u64,

    /// open subscriptions per relay above which new items are consolidated (default 70;
    /// lowered to the relay's budget) [env GRASP_SYNC_CONSOLIDATION_THRESHOLD]
    #[argh(option, default = "defaults().consolidation_threshold")]
    consolidation_threshold: usize,

    /// seconds a consolidation waits for loading subscriptions (default 30)
    /// [env GRASP_SYNC_CONSOLIDATION_WAIT]
    #[argh(option, default = "defaults().consolidation_wait.as_secs()")]
    consolidation_wait: u64,

    /// seconds nothing is sent to a relay after it signalled a rate limit (default 65)
    /// [env GRASP_SYNC_RATE_LIMIT_COOLDOWN]
    #[argh(option, default = "defaults().rate_limit_cooldown.as_secs()")]
    rate_limit_cooldown: u64,

    /// seconds before a query a relay refused (restricted:, blocked:, …) is tried again
    /// (default 600) [env GRASP_SYNC_REFUSED_RETRY]
    #[argh(option, default = "defaults().refused_retry.as_secs()")]
    refused_retry: u64,

    /// seconds a websocket connect (TCP, TLS and handshake) may take (default 10)
    /// [env GRASP_SYNC_CONNECT_TIMEOUT]
    #[argh(option, default = "defaults().ws.connect_timeout.as_secs()")]
    connect_timeout: u64,

    /// seconds the NIP-11 request before a relay's first connect may take; 0 disables
    /// NIP-11 (default 5) [env GRASP_SYNC_NIP11_TIMEOUT]
    #[argh(option, default = "defaults().nip11_timeout.as_secs()")]
    nip11_timeout: u64,

    /// seconds of silence after which a relay is pinged (default 30)
    /// [env GRASP_SYNC_PING_INTERVAL]
    #[argh(option, default = "defaults().ping_interval.as_secs()")]
    ping_interval: u64,

    /// seconds a ping may wait for its pong before the connection is dropped (default 20)
    /// [env GRASP_SYNC_PONG_TIMEOUT]
    #[argh(option, default = "defaults().pong_timeout.as_secs()")]
    pong_timeout: u64,

    /// seconds between the info-level summary lines (default 60)
    /// [env GRASP_SYNC_SUMMARY_INTERVAL]
    #[argh(option, default = "defaults().summary_interval.as_secs()")]
    summary_interval: u64,

    /// log format: text or json (one JSON object per line) (default text)
    /// [env GRASP_SYNC_LOG_FORMAT]
    #[argh(option, default = "String::from(\"text\")")]
    log_format: String,

    /// print the version and exit
    #[argh(switch)]
    version: bool,
}

/// Print the per-relay table of a running grasp-sync (from its /status).
#[derive(FromArgs, Debug)]
struct StatusArgs {
    /// the --metrics-addr of the running instance, e.g. 127.0.0.1:9464
    /// [env GRASP_SYNC_METRICS_ADDR]
    #[argh(option)]
    metrics_addr: String,

    /// print the /status JSON document instead of the table
    #[argh(switch)]
    json: bool,
}

/// How a flag is also read from the environment.
#[derive(Debug, Clone, PartialEq)]
struct EnvFlag {
    flag: String,
    env: String,
    kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Value,
    Repeated,
    Switch,
}

/// The library's defaults: each flag with a library setting behind it takes its default from
/// here (`Config::new`), so a default is declared once.
fn defaults() -> &'static Config {
    static DEFAULTS: std::sync::LazyLock<Config> = std::sync::LazyLock::new(|| {
        Config::new(RelayUrl::parse("ws://127.0.0.1:1").expect("a valid placeholder URL"))
    });
    &DEFAULTS
}

/// `T`'s help text (what `--help` prints).
fn help_of<T: FromArgs>(command: &str) -> String {
    match T::from_args(&[command], &["--help"]) {
        Err(exit) => exit.output,
        Ok(_) => String::new(),
    }
}

/// The flags of a command that environment variables can set, derived from its help text so
/// that each setting is declared once (its field and doc comment in the argh struct): a flag
/// whose description ends in `[env NAME]` is read from `NAME`; its kind (switch, value,
/// repeatable) is read off the usage line argh writes (`[--once]`, `--deadline <deadline>`,
/// `[--bootstrap <bootstrap...>]`).
fn env_flags(help: &str) -> Vec<EnvFlag> {
    let usage = help.lines().next().unwrap_or_default();
    let tokens: Vec<&str> = usage
        .split_whitespace()
        .map(|t| t.trim_matches(|c| c == '[' || c == ']'))
        .collect();
    let kind_of = |flag: &str| {
        let at = tokens.iter().position(|t| *t == format!("--{flag}"))?;
        Some(match tokens.get(at + 1) {
            Some(v) if v.starts_with('<') && v.ends_with("...>") => Kind::Repeated,
            Some(v) if v.starts_with('<') => Kind::Value,
            _ => Kind::Switch,
        })
    };
    // Each option's entry starts with `  --flag`; argh wraps its description.
    let mut entries: Vec<(String, String)> = Vec::new();
    for line in help.lines().skip_while(|l| !l.starts_with("Options:")) {
        let trimmed = line.trim_start();
        if line.starts_with("  --") {
            let flag = trimmed.split_whitespace().next().unwrap_or_default();
            entries.push((
                flag.trim_start_matches("--")
                    .trim_end_matches(',')
                    .to_string(),
                trimmed[flag.len()..].to_string(),
            ));
        } else if let Some((_, text)) = entries.last_mut() {
            text.push(' ');
            text.push_str(trimmed);
        }
    }
    entries
        .into_iter()
        .filter_map(|(flag, text)| {
            let env = text.split("[env ").nth(1)?.split(']').next()?.trim();
            Some(EnvFlag {
                kind: kind_of(&flag)?,
                env: env.to_string(),
                flag,
            })
        })
        .collect()
}

/// `args` plus the flags that environment variables set and the command line does not.
fn with_env(
    args: &[String],
    flags: &[EnvFlag],
    env: impl Fn(&str) -> Option<String>,
) -> Result<Vec<String>, String> {
    let mut out = args.to_vec();
    for fl in flags {
        let name = format!("--{}", fl.flag);
        if args.contains(&name) {
            continue;
        }
        let Some(value) = env(&fl.env).filter(|v| !v.trim().is_empty()) else {
            continue;
        };
        match fl.kind {
            Kind::Switch => match value.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => out.push(name),
                "0" | "false" | "no" | "off" => {}
                other => {
                    return Err(format!(
                        "{}={other:?}: expected 1/true/yes or 0/false/no",
                        fl.env
                    ))
                }
            },
            Kind::Repeated => {
                for v in value.split(',').map(str::trim).filter(|v| !v.is_empty()) {
                    out.push(name.clone());
                    out.push(v.to_string());
                }
            }
            Kind::Value => {
                out.push(name);
                out.push(value.trim().to_string());
            }
        }
    }
    Ok(out)
}

fn parse_patterns(setting: &str, values: &[String]) -> Result<Vec<RelayPattern>, String> {
    values
        .iter()
        .map(|v| RelayPattern::parse(v).map_err(|e| format!("--{setting} {e}")))
        .collect()
}

fn parse_url(setting: &str, value: &str) -> Result<RelayUrl, String> {
    RelayUrl::parse(value).map_err(|e| format!("--{setting} {value:?}: {e}"))
}

fn at_least(flag: &str, v: u64, min: u64, unit: &str) -> Result<u64, String> {
    if v < min {
        return Err(format!("--{flag} must be at least {min} {unit}"));
    }
    Ok(v)
}

fn secs(flag: &str, v: u64) -> Result<Duration, String> {
    Ok(Duration::from_secs(at_least(flag, v, 1, "second")?))
}

fn parse_addr(flag: &str, v: &str) -> Result<SocketAddr, String> {
    v.parse().map_err(|_| {
        format!("--{flag} {v:?}: expected an IP address and port, e.g. 127.0.0.1:9464")
    })
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
    at_least("batch-window", args.batch_window, 1, "millisecond")?;
    config.archive = args.archive;
    if args.no_nip77 && args.nip77_probe {
        return Err("--no-nip77 and --nip77-probe contradict each other: give one".into());
    }
    config.nip77.enabled = !args.no_nip77;
    config.nip77.probe_unadvertised = args.nip77_probe;
    config.max_relays_per_pubkey = args.max_relays_per_pubkey;
    config.max_relays_per_announcement = args.max_relays_per_announcement;
    config.threads.max_depth = args.reply_depth;
    config.threads.max_per_thread = args.thread_size;
    config.threads.max_total = args.max_thread_ids;
    config.max_urls_per_host =
        at_least("max-urls-per-host", args.max_urls_per_host as u64, 1, "URL")? as usize;
    config.prefer_pubkeys = args
        .prefer_pubkey
        .iter()
        .map(|k| {
            nostr::key::PublicKey::parse(k.trim())
                .map(|pk| pk.to_hex())
                .map_err(|e| {
                    format!("--prefer-pubkey {k:?}: expected a public key as npub1… or 64 hexadecimal characters ({e})")
                })
        })
        .collect::<Result<_, _>>()?;
    if args.forward_max_mib == 0 || args.forward_relay_mib == 0 {
        return Err("--forward-max-mib and --forward-relay-mib must be at least 1".into());
    }
    config.forward.max_bytes = args.forward_max_mib.saturating_mul(1 << 20);
    config.forward.relay_bytes = args.forward_relay_mib.saturating_mul(1 << 20);
    config = config
        .batch_window(Duration::from_millis(args.batch_window))
        .eose_timeout(secs("eose-timeout", args.eose_timeout)?);
    config.max_relays = at_least("max-relays", args.max_relays as u64, 1, "relay")? as usize;
    config.shard = match &args.shard {
        Some(s) => Some(grasp_sync::core::targets::Shard::parse(s).map_err(|e| format!("--{e}"))?),
        None => None,
    };
    config.default_subscription_budget = at_least(
        "subscription-budget",
        args.subscription_budget as u64,
        2,
        "",
    )? as usize;
    config.assumed_page_size = at_least("page-size", args.page_size as u64, 1, "event")? as usize;
    config.poll_interval = secs("poll-interval", args.poll_interval)?;
    config.consolidation_threshold = at_least(
        "consolidation-threshold",
        args.consolidation_threshold as u64,
        2,
        "subscriptions",
    )? as usize;
    config.consolidation_wait = secs("consolidation-wait", args.consolidation_wait)?;
    config.rate_limit_cooldown = secs("rate-limit-cooldown", args.rate_limit_cooldown)?;
    config.refused_retry = secs("refused-retry", args.refused_retry)?;
    config.ws.connect_timeout = secs("connect-timeout", args.connect_timeout)?;
    config.nip11_timeout = Duration::from_secs(args.nip11_timeout);
    config.ping_interval = secs("ping-interval", args.ping_interval)?;
    config.pong_timeout = secs("pong-timeout", args.pong_timeout)?;
    config.summary_interval = secs("summary-interval", args.summary_interval)?;
    config.state_dir = args.state_dir.clone();
    secs("stop-timeout", args.stop_timeout)?;
    secs("deadline", args.deadline)?;
    if !matches!(args.log_format.as_str(), "text" | "json") {
        return Err(format!(
            "--log-format {:?}: expected text or json",
            args.log_format
        ));
    }
    if let Some(a) = &args.metrics_addr {
        parse_addr("metrics-addr", a)?;
    }
    if args.once {
        config = config.backoff(once_backoff());
    }
    config.auth_keys =
        grasp_sync::config::load_auth_key(args.nsec_file.as_deref()).map_err(|e| e.to_string())?;
    config.own_auth_keys = grasp_sync::config::load_own_auth_key(args.own_nsec_file.as_deref())
        .map_err(|e| e.to_string())?;
    config.ephemeral_auth = !args.no_ephemeral_auth;
    config.allow_private_relays = args.allow_private_relays;
    if !args.ca_file.is_empty() || args.system_roots {
        let trust = grasp_sync::net::TrustOptions {
            ca_files: args.ca_file.clone(),
            system_roots: args.system_roots,
            no_webpki_roots: false,
        };
        config.tls = grasp_sync::net::client_config(&trust).map_err(|e| e.to_string())?;
    }
    config.deny_relays = parse_patterns("deny-relay", &args.deny_relay)?;
    config.allow_relays = parse_patterns("allow-relay", &args.allow_relay)?;
    Ok(config)
}

fn init_logging(format: &str) {
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    if format == "json" {
        use std::io::Write;
        b.format(|buf, record| {
            let line = serde_json::json!({
                "ts": SystemClock.now().wall_millis(),
                "level": record.level().as_str(),
                "target": record.target(),
                "msg": record.args().to_string(),
            });
            writeln!(buf, "{line}")
        });
    } else {
        b.format_timestamp_millis();
    }
    b.init();
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("grasp-sync: {msg}\nRun grasp-sync --help for usage.");
    ExitCode::from(2)
}

/// Parses `T` from `argv` the way argh does, or the exit code to return.
fn parse<T: FromArgs>(cmd: &[&str], rest: &[String]) -> Result<T, ExitCode> {
    let rest: Vec<&str> = rest.iter().map(String::as_str).collect();
    T::from_args(cmd, &rest).map_err(|exit| {
        if exit.status.is_ok() {
            print!("{}", exit.output);
            ExitCode::SUCCESS
        } else {
            eprintln!("{}Run grasp-sync --help for usage.", exit.output);
            ExitCode::from(2)
        }
    })
}

/// glibc gives threads that allocate at once arenas of their own (up to eight per core), and
/// each arena keeps what was freed in it: with a thread per relay, two arenas lowered a
/// first sync's peak RSS by about a tenth, for no measurable CPU (decision 0086). An operator's
/// own `MALLOC_ARENA_MAX` or `GLIBC_TUNABLES` arena setting is left alone.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let operator_set = std::env::var_os("MALLOC_ARENA_MAX").is_some()
            || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("arena_max"));
        if !operator_set {
            // SAFETY: `mallopt` only sets an allocator parameter; it runs before any other
            // thread exists, and a refusal (return value 0) leaves glibc's default.
            let _ = unsafe { libc::mallopt(libc::M_ARENA_MAX, 2) };
        }
    }
}

/// How often [`MallocTrim`] hands freed memory back to the system.
const MALLOC_TRIM_EVERY: Duration = Duration::from_secs(1);

/// glibc keeps what the threads free inside its arenas: during a first sync the peak RSS was
/// about twice the peak heap (decision 0089). Once a second the binary's main loop asks glibc
/// to give the free pages back (`malloc_trim`); the library does not (an embedding program
/// owns its allocator).
struct MallocTrim {
    last: Instant,
}

impl MallocTrim {
    fn new() -> MallocTrim {
        MallocTrim {
            last: Instant::now(),
        }
    }

    /// Trims when [`MALLOC_TRIM_EVERY`] passed since the last time.
    fn tick(&mut self) {
        if self.last.elapsed() < MALLOC_TRIM_EVERY {
            return;
        }
        self.last = Instant::now();
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: `malloc_trim` only returns free memory of glibc's arenas to the system
            // (it takes each arena's lock); it has no preconditions.
            let _ = unsafe { libc::malloc_trim(0) };
        }
    }
}

fn main() -> ExitCode {
    limit_malloc_arenas();
    let argv: Vec<String> = std::env::args().collect();
    let rest: Vec<String> = argv.iter().skip(1).cloned().collect();
    if rest.iter().any(|a| a == "--version") {
        println!("grasp-sync {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    if rest.first().map(String::as_str) == Some("status") {
        let env = env_flags(&help_of::<StatusArgs>("grasp-sync status"));
        let rest = match with_env(&rest[1..], &env, |k| std::env::var(k).ok()) {
            Ok(r) => r,
            Err(e) => return usage_error(&e),
        };
        return match parse::<StatusArgs>(&["grasp-sync status"], &rest) {
            Ok(a) => status_command(&a),
            Err(code) => code,
        };
    }
    if rest.first().map(String::as_str) == Some("audit") {
        return audit_command(&rest[1..]);
    }
    let rest = match with_env(&rest, &env_flags(&help_of::<Args>("grasp-sync")), |k| {
        std::env::var(k).ok()
    }) {
        Ok(r) => r,
        Err(e) => return usage_error(&e),
    };
    let args = match parse::<Args>(&["grasp-sync"], &rest) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if args.version {
        // Also handled before parsing, so that it works without --own-relay.
        println!("grasp-sync {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    let config = match build_config(&args) {
        Ok(c) => c,
        Err(e) => return usage_error(&e),
    };
    init_logging(&args.log_format);
    run(&args, config)
}

/// `grasp-sync audit --help`.
const AUDIT_HELP: &str = "\
Usage: grasp-sync audit --own-relay <url> [daemon flags] [--json] [--fix]

Check from outside that the own relay holds every event related to its repositories that
the relays their announcements list hold. Reads the own relay's repositories the way the
daemon does, asks every listed relay what it holds for each (NIP-77 where the relay takes
part, paged REQ otherwise), within the daemon's address policy and limits, and reports per
repository and relay: events the own relay lacks (MISSING), events it holds that the relay
does not (EXTRA, informational), and relays not reached. Writes nothing without --fix.

Options:
  --json            print the report as one JSON document instead of the table
  --fix             publish the missing events to the own relay (checked as the daemon
                    checks them; rate-limited: and error: answers are retried)
  --concurrency N   relays asked at once (default 8)
  --relay-deadline SECS
                    the most one relay's questions (and the fix) may take (default 600)
  --max-missing N   the most missing events kept for --fix (default 100000, and at most
                    256 MiB of them)
  --deadline SECS   the most the whole audit may take (default 3600): relays not asked
                    by then are reported incomplete
  --help, help      display this usage information

Every daemon flag that picks repositories and relays, or sets limits, addresses and keys,
applies as in the daemon, and so do their GRASP_SYNC_* environment variables: --own-relay,
--public-url, --archive, --max-relays, --max-relays-per-pubkey, --max-urls-per-host,
--max-relays-per-announcement, --prefer-pubkey, --shard, --page-size, --eose-timeout,
--connect-timeout, --nip11-timeout, --no-nip77, --allow-private-relays, --deny-relay,
--allow-relay, --ca-file, --system-roots, --nsec-file, --own-nsec-file,
--no-ephemeral-auth (see grasp-sync --help). Logging: RUST_LOG (default warn).

Exit status: 0 nothing missing (after --fix: nothing still missing), 1 events missing,
2 bad flags or the own relay cannot be read. Relays not reached are reported and do not
change the exit status.
";

/// The audit's own flags, taken out of its arguments before the daemon's flags are parsed.
struct AuditFlags {
    json: bool,
    opts: grasp_sync::ops::audit::AuditOptions,
}

fn audit_flags(args: &[String]) -> Result<(AuditFlags, Vec<String>), String> {
    let mut flags = AuditFlags {
        json: false,
        opts: grasp_sync::ops::audit::AuditOptions::default(),
    };
    let mut rest = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
            v.parse::<u64>()
                .map_err(|_| format!("--{name} {v:?}: expected a whole number"))
        };
        match a.as_str() {
            "--json" => flags.json = true,
            "--fix" => flags.opts.fix = true,
            "--concurrency" => {
                flags.opts.concurrency =
                    at_least("concurrency", value("concurrency")?, 1, "")? as usize
            }
            "--relay-deadline" => {
                flags.opts.relay_deadline = secs("relay-deadline", value("relay-deadline")?)?
            }
            "--deadline" => flags.opts.deadline = secs("deadline", value("deadline")?)?,
            "--max-missing" => {
                flags.opts.max_missing =
                    at_least("max-missing", value("max-missing")?, 1, "event")? as usize
            }
            _ => rest.push(a.clone()),
        }
    }
    Ok((flags, rest))
}

fn audit_command(args: &[String]) -> ExitCode {
    if args.iter().any(|a| a == "--help" || a == "help") {
        print!("{AUDIT_HELP}");
        return ExitCode::SUCCESS;
    }
    let (flags, rest) = match audit_flags(args) {
        Ok(x) => x,
        Err(e) => return usage_error(&e),
    };
    let rest = match with_env(&rest, &env_flags(&help_of::<Args>("grasp-sync")), |k| {
        std::env::var(k).ok()
    }) {
        Ok(r) => r,
        Err(e) => return usage_error(&e),
    };
    let args = match parse::<Args>(&["grasp-sync audit"], &rest) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let config = match build_config(&args) {
        Ok(c) => c,
        Err(e) => return usage_error(&e),
    };
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "warn");
    }
    init_logging(&args.log_format);
    match grasp_sync::ops::audit::run(&config, &flags.opts) {
        Ok(report) => {
            if flags.json {
                println!("{}", report.to_json());
            } else {
                print!("{}", report.table());
            }
            ExitCode::from(report.exit_code())
        }
        Err(e) => {
            eprintln!("grasp-sync audit: {e}");
            ExitCode::from(2)
        }
    }
}

fn status_command(a: &StatusArgs) -> ExitCode {
    let addr = match parse_addr("metrics-addr", &a.metrics_addr) {
        Ok(a) => a,
        Err(e) => return usage_error(&e),
    };
    match grasp_sync::ops::http::get(addr, "/status", Duration::from_secs(10)) {
        Ok((200, body)) => {
            if a.json {
                print!("{body}");
                return ExitCode::SUCCESS;
            }
            match serde_json::from_str::<serde_json::Value>(&body) {
                Ok(doc) => {
                    print!("{}", render::table(&doc));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("grasp-sync status: {addr}/status is not a status document: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Ok((code, _)) => {
            eprintln!("grasp-sync status: {addr}/status answered HTTP {code}");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!(
                "grasp-sync status: cannot read http://{addr}/status: {e} (is grasp-sync running with --metrics-addr {addr}?)"
            );
            ExitCode::from(1)
        }
    }
}

fn run(args: &Args, config: Config) -> ExitCode {
    log::info!(
        "grasp-sync {} syncing into {}{}",
        env!("CARGO_PKG_VERSION"),
        config.own_relay,
        if args.once { " (--once)" } else { "" }
    );
    if config.allow_private_relays {
        log::warn!("--allow-private-relays: relays discovered from events may be on loopback or private networks");
    }
    if let Some(k) = &config.own_auth_keys {
        log::info!(
            "NIP-42 AUTH on the own relay: answering challenges as {}",
            k.public_key().to_hex()
        );
    }
    match &config.auth_keys {
        Some(k) => {
            log::info!(
                "NIP-42 AUTH on remote relays: answering challenges as {}",
                k.public_key().to_hex()
            );
            if config.own_auth_keys.is_none() {
                log::warn!(
                    "NIP-42 AUTH: the --nsec-file key is for remote relays only; the own relay's challenges are not answered (give --own-nsec-file, the same file to share the key knowingly)"
                );
            }
        }
        None if config.ephemeral_auth => {}
        None => log::info!(
            "NIP-42 AUTH on remote relays: no key (--no-ephemeral-auth); relays that require AUTH will refuse us"
        ),
    }
    let signals = match signal_channel() {
        Ok(rx) => rx,
        Err(e) => {
            eprintln!("grasp-sync: cannot install the SIGINT/SIGTERM handler: {e}");
            return ExitCode::from(1);
        }
    };
    let handle = match grasp_sync::start(config) {
        Ok(h) => Arc::new(h),
        Err(e) => {
            eprintln!("grasp-sync: {e}");
            return ExitCode::from(1);
        }
    };
    let _server = match &args.metrics_addr {
        Some(a) => {
            let addr = parse_addr("metrics-addr", a).expect("checked in build_config");
            match grasp_sync::ops::serve(addr, handle.clone()) {
                Ok(s) => Some(s),
                Err(e) => {
                    eprintln!("grasp-sync: cannot listen on --metrics-addr {addr}: {e}");
                    let _ = handle.shutdown(Duration::from_secs(5));
                    return ExitCode::from(1);
                }
            }
        }
        None => None,
    };
    let stop_timeout = Duration::from_secs(args.stop_timeout);
    let started = Instant::now();
    let deadline = Duration::from_secs(args.deadline);
    let settle =
        Duration::from_millis(args.batch_window.saturating_mul(2)).max(Duration::from_secs(2));
    let mut tracker = OnceTracker::new(settle);
    let mut trim = MallocTrim::new();
    loop {
        trim.tick();
        match signals.recv_timeout(Duration::from_millis(200)) {
            Ok(sig) => {
                log::info!("signal {sig}: stopping (flushing the forward queue for at most {stop_timeout:?}; a second signal exits at once)");
                return stop(&handle, stop_timeout, ExitCode::SUCCESS);
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                log::warn!("the signal thread ended; stopping");
                return stop(&handle, stop_timeout, ExitCode::from(1));
            }
        }
        if !args.once {
            continue;
        }
        let status = handle.status();
        let outcome = match tracker.check(&status, SystemClock.now()) {
            Some(o) => o,
            None if started.elapsed() >= deadline => {
                log::warn!("--once: the deadline of {deadline:?} passed before the sync finished");
                let mut o = tracker.outcome(&status);
                if o.failed.is_empty() && o.incomplete.is_empty() {
                    o.failed.push("(the own relay or the forward queue)".into());
                }
                o
            }
            None => continue,
        };
        eprint!("{}", render::table(&render::status_json(&status)));
        for r in &outcome.failed {
            eprintln!("failed: {r}");
        }
        for r in &outcome.incomplete {
            eprintln!("incomplete: {r}");
        }
        let code = outcome.exit_code();
        eprintln!(
            "grasp-sync --once: {} ({} relays, {} events stored)",
            if code == 0 {
                "complete"
            } else {
                "NOT complete"
            },
            status.relays.len(),
            status.forwarded
        );
        return stop(&handle, stop_timeout, ExitCode::from(code));
    }
}

fn stop(handle: &grasp_sync::SyncHandle, timeout: Duration, code: ExitCode) -> ExitCode {
    match handle.shutdown(timeout) {
        Ok(()) => code,
        Err(e) => {
            log::warn!("stop: {e}");
            code
        }
    }
}

/// SIGINT and SIGTERM: the first arrives on the returned channel (graceful stop); a second
/// one exits the process at once.
fn signal_channel() -> std::io::Result<crossbeam_channel::Receiver<i32>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut seen = 0;
            for sig in signals.forever() {
                seen += 1;
                if seen > 1 {
                    eprintln!("grasp-sync: second signal {sig}: exiting now");
                    std::process::exit(130);
                }
                let _ = tx.send(sig);
            }
        })?;
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<Args, argh::EarlyExit> {
        Args::from_args(&["grasp-sync"], v)
    }

    #[test]
    fn every_daemon_flag_the_audit_help_names_exists() {
        let help = match args(&["--help"]) {
            Err(exit) => exit.output,
            Ok(_) => panic!("--help parses to an early exit"),
        };
        let named = AUDIT_HELP.split("Every daemon flag").nth(1).unwrap();
        let named = named.split("Logging:").next().unwrap();
        let flags: Vec<&str> = named
            .split(|c: char| c.is_whitespace() || c == ',' || c == ':' || c == '(')
            .map(|w| w.trim_end_matches([')', '.']))
            .filter(|w| w.starts_with("--") && *w != "--help")
            .collect();
        assert!(flags.len() > 15, "{flags:?}");
        for flag in flags {
            assert!(
                help.contains(&format!("  {flag} ")) || help.contains(&format!("  {flag}\n")),
                "{flag} is not a daemon flag"
            );
        }
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
            "--max-relays",
            "7",
            "--page-size",
            "50",
        ])
        .unwrap();
        let c = build_config(&a).unwrap();
        assert_eq!(c.own_relay.as_str(), "ws://127.0.0.1:7777");
        assert_eq!(c.public_urls.len(), 2);
        assert_eq!(c.bootstrap.len(), 1);
        assert_eq!(c.batch_window, Duration::from_millis(250));
        assert_eq!((c.max_relays, c.assumed_page_size), (7, 50));
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
            "--reply-depth",
            "3",
            "--thread-size",
            "7",
            "--max-thread-ids",
            "9",
        ])
        .unwrap();
        let c = build_config(&a).unwrap();
        assert_eq!(
            (
                c.threads.max_depth,
                c.threads.max_per_thread,
                c.threads.max_total
            ),
            (3, 7, 9)
        );
        assert_eq!(c.sync_config().threads, c.threads);
        assert_eq!(c.repo_scope(), grasp_sync::core::targets::RepoScope::All);
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
        let a = args(&["--own-relay", "ws://x", "--shard", "1/3"]).unwrap();
        assert_eq!(
            build_config(&a).unwrap().shard,
            Some(grasp_sync::core::targets::Shard { index: 1, count: 3 })
        );
        let a = args(&["--own-relay", "ws://x", "--shard", "3/3"]).unwrap();
        assert!(build_config(&a).unwrap_err().contains("--shard"));
        let a = args(&["--own-relay", "ws://x"]).unwrap();
        assert_eq!(build_config(&a).unwrap().shard, None);
        let a = args(&["--own-relay", "ws://x", "--forward-relay-mib", "0"]).unwrap();
        assert!(build_config(&a)
            .unwrap_err()
            .contains("--forward-relay-mib"));
    }

    #[test]
    fn nip77_flags() {
        let a = args(&["--own-relay", "ws://x"]).unwrap();
        let c = build_config(&a).unwrap();
        assert!(c.nip77.enabled && !c.nip77.probe_unadvertised);
        let a = args(&["--own-relay", "ws://x", "--no-nip77"]).unwrap();
        assert!(!build_config(&a).unwrap().nip77.enabled);
        let a = args(&["--own-relay", "ws://x", "--nip77-probe"]).unwrap();
        let c = build_config(&a).unwrap();
        assert!(c.nip77.enabled && c.nip77.probe_unadvertised);
        let a = args(&["--own-relay", "ws://x", "--no-nip77", "--nip77-probe"]).unwrap();
        assert!(build_config(&a).unwrap_err().contains("--nip77-probe"));
        let a = args(&["--own-relay", "ws://x", "--no-nip77"]).unwrap();
        assert!(!build_config(&a).unwrap().sync_config().nip77.enabled);
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
        let a = args(&["--own-relay", "ws://x", "--metrics-addr", "localhost"]).unwrap();
        assert!(build_config(&a).unwrap_err().contains("--metrics-addr"));
        let a = args(&["--own-relay", "ws://x", "--log-format", "xml"]).unwrap();
        assert!(build_config(&a).unwrap_err().contains("--log-format"));
        assert!(args(&[]).is_err(), "--own-relay is required");
        assert!(args(&["--own-relay", "ws://x", "--batch-window", "abc"]).is_err());
    }

    #[test]
    fn environment_variables_set_flags_the_command_line_does_not() {
        let env = |k: &str| match k {
            "GRASP_SYNC_OWN_RELAY" => Some("ws://127.0.0.1:7777".to_string()),
            "GRASP_SYNC_BOOTSTRAP" => Some("wss://a.example, wss://b.example".to_string()),
            "GRASP_SYNC_ONCE" => Some("true".to_string()),
            "GRASP_SYNC_MAX_RELAYS" => Some("9".to_string()),
            "GRASP_SYNC_PAGE_SIZE" => Some("".to_string()),
            _ => None,
        };
        let cli: Vec<String> = ["--max-relays", "3"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let all = with_env(&cli, &env_flags_of_args(), env).unwrap();
        let a = args(&all.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(a.own_relay, "ws://127.0.0.1:7777");
        assert_eq!(a.bootstrap, vec!["wss://a.example", "wss://b.example"]);
        assert!(a.once);
        assert_eq!(a.max_relays, 3, "the command line wins");
        assert_eq!(a.page_size, 20, "an empty variable counts as unset");
        let bad = |k: &str| (k == "GRASP_SYNC_ONCE").then(|| "maybe".to_string());
        let e = with_env(&[], &env_flags_of_args(), bad).unwrap_err();
        assert!(e.contains("GRASP_SYNC_ONCE"), "{e}");
    }

    fn env_flags_of_args() -> Vec<EnvFlag> {
        env_flags(&help_of::<Args>("grasp-sync"))
    }

    #[test]
    fn every_flag_has_its_environment_variable_named_after_it() {
        let help = help_of::<Args>("grasp-sync");
        let flags = env_flags(&help);
        let listed: Vec<&str> = help
            .lines()
            .filter(|l| l.starts_with("  --"))
            .filter_map(|l| l.split_whitespace().next())
            .map(|f| f.trim_start_matches("--").trim_end_matches(','))
            .filter(|f| !["help", "version"].contains(f))
            .collect();
        assert!(listed.len() >= 45, "{listed:?}");
        for flag in listed {
            let fl = flags
                .iter()
                .find(|f| f.flag == flag)
                .unwrap_or_else(|| panic!("--{flag} has no [env …] in its help"));
            assert_eq!(
                fl.env,
                format!("GRASP_SYNC_{}", flag.replace('-', "_").to_uppercase()),
                "--{flag}"
            );
        }
        let kind = |f: &str| flags.iter().find(|x| x.flag == f).map(|x| x.kind);
        assert_eq!(kind("once"), Some(Kind::Switch));
        assert_eq!(kind("bootstrap"), Some(Kind::Repeated));
        assert_eq!(kind("max-relays"), Some(Kind::Value));
        assert_eq!(kind("own-relay"), Some(Kind::Value));
        let status = env_flags(&help_of::<StatusArgs>("grasp-sync status"));
        assert_eq!(
            status,
            vec![EnvFlag {
                flag: "metrics-addr".into(),
                env: "GRASP_SYNC_METRICS_ADDR".into(),
                kind: Kind::Value
            }],
            "--json has no variable"
        );
    }

    #[test]
    fn every_default_the_help_states_is_the_default_in_force() {
        // The help says "(default N)"; the flag's default comes from the library
        // (`defaults()`) or the argh attribute: they must agree, whatever changes.
        let help = help_of::<Args>("grasp-sync");
        let parsed = format!("{:?}", args(&["--own-relay", "ws://x"]).unwrap());
        let mut checked = 0;
        let mut entry = String::new();
        let mut entries = Vec::new();
        for line in help.lines().skip_while(|l| !l.starts_with("Options:")) {
            if line.starts_with("  --") && !entry.is_empty() {
                entries.push(std::mem::take(&mut entry));
            }
            entry.push_str(line.trim());
            entry.push(' ');
        }
        entries.push(entry);
        for e in entries {
            let flag = e
                .split_whitespace()
                .next()
                .unwrap()
                .trim_start_matches("--");
            let Some(stated) = e.split("(default ").nth(1) else {
                continue;
            };
            let stated: String = stated
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            if stated.is_empty() {
                continue;
            }
            let field = format!("{}: ", flag.replace('-', "_"));
            let in_force: String = parsed
                .split(&field)
                .nth(1)
                .unwrap_or_else(|| panic!("{field} in {parsed}"))
                .chars()
                .take_while(|c| *c != ',' && *c != ' ')
                .filter(|c| *c != '"')
                .collect();
            assert_eq!(
                stated, in_force,
                "--{flag}: the help says (default {stated})"
            );
            checked += 1;
        }
        assert!(checked >= 25, "{checked} defaults checked");
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

    #[test]
    fn address_policy_flags() {
        let a = args(&["--own-relay", "ws://127.0.0.1:7777"]).unwrap();
        let c = build_config(&a).unwrap();
        assert!(!c.allow_private_relays, "refused by default");
        assert!(c.deny_relays.is_empty() && c.allow_relays.is_empty());
        let a = args(&[
            "--own-relay",
            "ws://127.0.0.1:7777",
            "--allow-private-relays",
            "--deny-relay",
            "*.spam.example",
            "--deny-relay",
            "wss://bad.example/",
            "--allow-relay",
            "lan-relay",
        ])
        .unwrap();
        let c = build_config(&a).unwrap();
        assert!(c.allow_private_relays);
        assert_eq!(c.deny_relays.len(), 2);
        assert_eq!(
            c.allow_relays,
            vec![RelayPattern::parse("lan-relay").unwrap()]
        );
        let a = args(&["--own-relay", "ws://x", "--deny-relay", "http://x"]).unwrap();
        assert!(build_config(&a).unwrap_err().contains("--deny-relay"));
        let a = args(&["--own-relay", "ws://x", "--allow-relay", "a/b"]).unwrap();
        assert!(build_config(&a).unwrap_err().contains("--allow-relay"));
    }

    #[test]
    fn own_nsec_file_loads_a_separate_key() {
        let hex = "6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e";
        let p = key_file(&format!("{hex}\n\n"));
        let a = args(&[
            "--own-relay",
            "ws://x",
            "--own-nsec-file",
            p.to_str().unwrap(),
        ])
        .unwrap();
        let c = build_config(&a).unwrap();
        assert_eq!(
            c.own_auth_keys.expect("own key loaded").public_key(),
            nostr::key::Keys::parse(hex).unwrap().public_key()
        );
        let bad = key_file("nope-nope-nope");
        let a = args(&[
            "--own-relay",
            "ws://x",
            "--own-nsec-file",
            bad.to_str().unwrap(),
        ])
        .unwrap();
        let e = build_config(&a).unwrap_err();
        assert!(
            e.contains("--own-nsec-file") && !e.contains("nope-nope"),
            "{e}"
        );
    }
}
