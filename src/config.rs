//! Engine configuration.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nostr::key::Keys;

use crate::core::forward::ForwardLimits;
use crate::core::health::BackoffPolicy;
use crate::core::sync::SyncConfig;
use crate::core::targets::{RepoScope, TargetLimits};
use crate::core::time::{Clock, SystemClock};
use crate::error::Error;
use crate::net::policy::{AddressPolicy, RelayPattern};
use crate::net::ws::WsOptions;
use crate::shared::RelayUrl;

/// Everything the engine needs. Build with [`Config::new`] and the setter methods.
#[derive(Clone)]
pub struct Config {
    /// The own relay (read by the self-subscription, written by the forwarder).
    pub own_relay: RelayUrl,
    /// Other URLs the own relay is announced under (never synced from).
    pub public_urls: Vec<RelayUrl>,
    /// Relays to connect from the start and never idle-disconnect.
    pub bootstrap: Vec<RelayUrl>,
    /// Self-subscription batch window (default 5 s).
    pub batch_window: Duration,
    /// EOSE deadline (default 120 s): a batch with no EOSE for this long (counted from its
    /// last EOSE) fails and is retried; any other query without EOSE in time is closed and
    /// sent again.
    pub eose_timeout: Duration,
    /// Reconnect backoff and health thresholds.
    pub backoff: BackoffPolicy,
    /// Websocket limits and deadlines.
    pub ws: WsOptions,
    /// TLS trust for `wss://` relays and NIP-11 over `https://` (default: the webpki roots;
    /// [`crate::net::client_config`] adds CA files and the system store).
    pub tls: std::sync::Arc<rustls::ClientConfig>,
    /// Ping interval (default 30 s).
    pub ping_interval: Duration,
    /// Time to wait for a pong or any frame after a ping (default 20 s).
    pub pong_timeout: Duration,
    /// Forward queue limits.
    pub forward: ForwardLimits,
    /// Capacity of the channel from relay threads to the forwarder.
    pub forward_channel: usize,
    /// Capacity of the coordinator's input channel (reports from every thread; default
    /// 8,192). Relay threads wait while it is full. crossbeam allocates and touches every
    /// slot up front (192 bytes each): 65,536 slots were 12 MiB of the resident set, a third
    /// of the heap's peak in a first sync (issue 21).
    pub input_channel: usize,
    /// Interval of the info-level summary line (default 60 s).
    pub summary_interval: Duration,
    /// Time source (default: the system clock).
    pub clock: Arc<dyn Clock>,
    /// Cool-down after a relay signals a rate limit (CLOSED `rate-limited:` or a rate-limit
    /// NOTICE; default 65 s).
    pub rate_limit_cooldown: Duration,
    /// Delay before a query a relay refused (`restricted:`, `blocked:`, …) is tried again
    /// (default 10 min).
    pub refused_retry: Duration,
    /// Open subscriptions above which new items trigger a consolidation (default 70, the
    /// design's; the relay's subscription budget lowers it).
    pub consolidation_threshold: usize,
    /// How long a consolidation waits for loading subscriptions (default 30 s).
    pub consolidation_wait: Duration,
    /// Shortest and longest delay of the daily full resync (default 23 h and 25 h).
    pub daily_resync: (Duration, Duration),
    /// Interval of the idle-relay check (default 60 s).
    pub disconnect_check_interval: Duration,
    /// The most remote relays connected at once (default 1,000). When more are named, the
    /// slots are shared round-robin across announcing pubkeys.
    pub max_relays: usize,
    /// The most relays the repositories of one announcing pubkey can make us sync from
    /// (default 64).
    pub max_relays_per_pubkey: usize,
    /// The most relays read from one announcement (default 32).
    pub max_relays_per_announcement: usize,
    /// Reply chains below root events (`--reply-depth`, `--thread-size`,
    /// `--max-thread-ids`; defaults 8, 500, 100,000): which replies to replies are followed
    /// (decision 0097).
    pub threads: crate::core::threads::ThreadLimits,
    /// The most URLs of one host and port synced from (default 4): URLs that differ only
    /// in path or query reach the same relay (`--max-urls-per-host`).
    pub max_urls_per_host: usize,
    /// Pubkeys (hex) whose repositories take relay slots before anyone else's
    /// (`--prefer-pubkey`).
    pub prefer_pubkeys: Vec<String>,
    /// Sync only the relays of this shard (`--shard I/N`, 0-based): N instances beside the
    /// same own relay, each with its own I, split the remote relays (bootstrap relays
    /// included) by FNV-1a 64 of the normalised URL, with no overlap and no coordination.
    /// `None` (default): every relay.
    pub shard: Option<crate::core::targets::Shard>,
    /// Sync every repository the own relay holds, also those whose announcement does not
    /// list this service (default false). Without `public_urls` every repository is synced
    /// anyway (see [`Config::repo_scope`]).
    pub archive: bool,
    /// NIP-77 reconciliation of history queries (default: on where a relay's NIP-11 lists
    /// 77; unadvertised relays are not tried). See `docs/nip77.md`.
    pub nip77: crate::core::sync::Nip77Config,
    /// Open subscriptions per relay when its NIP-11 document does not say (default 20).
    pub default_subscription_budget: usize,
    /// How often queries that do not fit a relay's subscription budget are re-run with
    /// `since` (default 60 s).
    pub poll_interval: Duration,
    /// Deadline of the NIP-11 information request made before a relay's first connect
    /// (default 5 s; zero disables NIP-11).
    pub nip11_timeout: Duration,
    /// Events per query assumed for relays that publish no NIP-11 limits (default 20): a
    /// query that returns this many is paged with `until`.
    pub assumed_page_size: usize,
    /// Seed of the core's jitter source (default: random).
    pub seed: u64,
    /// Key used to answer the NIP-42 AUTH challenges of remote relays (`--nsec-file`;
    /// default: none, then [`Config::ephemeral_auth`] decides). Never shown to the own relay.
    /// Load it with [`load_auth_key`].
    pub auth_keys: Option<Keys>,
    /// Without [`Config::auth_keys`], answer remote relays' challenges with a key generated
    /// for this run (default true), so relays that only want some key serve us; false:
    /// answer none (relays that require AUTH then refuse us, logged per relay).
    pub ephemeral_auth: bool,
    /// Key for the own relay's NIP-42 challenges (self-subscription and forwarder,
    /// `--own-nsec-file`); default: none, and the own relay's challenges are not answered.
    /// The own relay and remote relays never share a key unless the operator gives the same
    /// key to both.
    pub own_auth_keys: Option<Keys>,
    /// Connect to relays discovered from events even when they resolve to loopback, private,
    /// link-local or other non-public addresses (default false; see `net/policy.rs`).
    pub allow_private_relays: bool,
    /// Relays never connected to (`--deny-relay`; URL, host or `*.domain` patterns).
    pub deny_relays: Vec<RelayPattern>,
    /// Relays exempt from the address check (`--allow-relay`; same patterns).
    pub allow_relays: Vec<RelayPattern>,
    /// Directory of the persisted sync state (`--state-dir`; default none: nothing is
    /// saved and every start is a fresh sync). A restart within the quick-reconnect window
    /// (15 min) then continues every relay as a quick reconnect; see
    /// `docs/operations.md#persisted-state---state-dir`.
    pub state_dir: Option<std::path::PathBuf>,
    /// The most often the state file is written (default 30 s; only when it changed, at
    /// least every 5 min, and at shutdown).
    pub state_save_interval: Duration,
}

/// Environment variable holding the NIP-42 AUTH key when no `--nsec-file` is given.
pub const NSEC_ENV: &str = "GRASP_SYNC_NSEC";

const KEY_FORMAT: &str = "expected a secret key as nsec1… (bech32) or 64 hexadecimal characters";

/// Loads the NIP-42 AUTH key from `nsec_file` if given, else from the environment variable
/// [`NSEC_ENV`] (`GRASP_SYNC_NSEC`); `Ok(None)` when neither is set (an empty variable counts
/// as unset). The text is trimmed and must be an `nsec1…` bech32 or 64-hex secret key. File
/// permissions are not checked. Errors name the file or variable and the expected format,
/// never the key.
pub fn load_auth_key(nsec_file: Option<&Path>) -> Result<Option<Keys>, Error> {
    let env = std::env::var(NSEC_ENV).ok();
    load_auth_key_from(nsec_file, env.as_deref())
}

/// Environment variable holding the own relay's NIP-42 key when no `--own-nsec-file` is
/// given.
pub const OWN_NSEC_ENV: &str = "GRASP_SYNC_OWN_NSEC";

/// Loads the key for the own relay's NIP-42 challenges from `own_nsec_file` if given, else
/// from [`OWN_NSEC_ENV`] (`GRASP_SYNC_OWN_NSEC`); `Ok(None)` when neither is set. Same
/// format and errors as [`load_auth_key`].
pub fn load_own_auth_key(own_nsec_file: Option<&Path>) -> Result<Option<Keys>, Error> {
    let env = std::env::var(OWN_NSEC_ENV).ok();
    load_key(
        "--own-nsec-file",
        OWN_NSEC_ENV,
        own_nsec_file,
        env.as_deref(),
    )
}

/// [`load_auth_key`] with the environment variable's value passed in.
pub fn load_auth_key_from(
    nsec_file: Option<&Path>,
    env_value: Option<&str>,
) -> Result<Option<Keys>, Error> {
    load_key("--nsec-file", NSEC_ENV, nsec_file, env_value)
}

fn load_key(
    flag: &str,
    env_name: &str,
    nsec_file: Option<&Path>,
    env_value: Option<&str>,
) -> Result<Option<Keys>, Error> {
    let (source, text) = match nsec_file {
        Some(path) => {
            let source = format!("{flag} {}", path.display());
            let text = std::fs::read_to_string(path).map_err(|e| Error::AuthKey {
                source: source.clone(),
                reason: format!("cannot read the key file: {e}"),
            })?;
            (source, text)
        }
        None => match env_value {
            Some(v) if !v.trim().is_empty() => (env_name.to_string(), v.to_string()),
            _ => return Ok(None),
        },
    };
    let key = text.trim();
    if key.is_empty() {
        return Err(Error::AuthKey {
            source,
            reason: format!("empty; {KEY_FORMAT}"),
        });
    }
    let valid_form =
        key.starts_with("nsec1") || (key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()));
    match Keys::parse(key) {
        Ok(keys) if valid_form => Ok(Some(keys)),
        _ => Err(Error::AuthKey {
            source,
            reason: format!("not a usable secret key; {KEY_FORMAT}"),
        }),
    }
}

/// Debug-prints `<redacted>`.
struct Redacted;

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("own_relay", &self.own_relay)
            .field("public_urls", &self.public_urls)
            .field("bootstrap", &self.bootstrap)
            .field("batch_window", &self.batch_window)
            .field("eose_timeout", &self.eose_timeout)
            .field("ws", &self.ws)
            .field("auth_keys", &self.auth_keys.as_ref().map(|_| Redacted))
            .field(
                "own_auth_keys",
                &self.own_auth_keys.as_ref().map(|_| Redacted),
            )
            .field("allow_private_relays", &self.allow_private_relays)
            .field("deny_relays", &self.deny_relays)
            .field("allow_relays", &self.allow_relays)
            .field("state_dir", &self.state_dir)
            .finish_non_exhaustive()
    }
}

impl Config {
    /// Defaults for `own_relay`: the design document's constants where it has them (5 s
    /// batch window, 15 min, 70 subscriptions, 30 s, 23–25 h, 60 s, 5 s × 2ⁿ up to 1 h, 24 h),
    /// and conservative values for what it leaves open (20 subscriptions and 20 events per
    /// query without NIP-11, 65 s rate-limit cool-down, 60 s polling).
    #[must_use]
    pub fn new(own_relay: RelayUrl) -> Config {
        Config {
            own_relay,
            public_urls: Vec::new(),
            bootstrap: Vec::new(),
            batch_window: Duration::from_secs(5),
            eose_timeout: Duration::from_secs(120),
            backoff: BackoffPolicy::default(),
            ws: WsOptions::default(),
            tls: crate::net::ws::tls_config(),
            ping_interval: Duration::from_secs(30),
            pong_timeout: Duration::from_secs(20),
            forward: ForwardLimits::default(),
            forward_channel: 1024,
            input_channel: 8_192,
            summary_interval: Duration::from_secs(60),
            clock: Arc::new(SystemClock),
            assumed_page_size: 20,
            nip11_timeout: Duration::from_secs(5),
            consolidation_threshold: 70,
            consolidation_wait: Duration::from_secs(30),
            daily_resync: (
                Duration::from_secs(23 * 3600),
                Duration::from_secs(25 * 3600),
            ),
            disconnect_check_interval: Duration::from_secs(60),
            max_relays: 1000,
            max_relays_per_pubkey: crate::core::targets::MAX_RELAYS_PER_PUBKEY,
            max_relays_per_announcement: crate::core::nip34::MAX_RELAYS_PER_ANNOUNCEMENT,
            threads: crate::core::threads::ThreadLimits::default(),
            max_urls_per_host: crate::core::targets::MAX_URLS_PER_HOST,
            prefer_pubkeys: Vec::new(),
            shard: None,
            state_dir: None,
            state_save_interval: Duration::from_secs(30),
            archive: false,
            nip77: crate::core::sync::Nip77Config::default(),
            default_subscription_budget: 20,
            poll_interval: Duration::from_secs(60),
            rate_limit_cooldown: Duration::from_secs(65),
            refused_retry: Duration::from_secs(600),
            seed: rand::random::<u64>(),
            auth_keys: None,
            ephemeral_auth: true,
            own_auth_keys: None,
            allow_private_relays: false,
            deny_relays: Vec::new(),
            allow_relays: Vec::new(),
        }
    }

    /// Lifts (or restores) the address check for relays discovered from events
    /// ([`Config::allow_private_relays`]).
    #[must_use = "a builder returns the changed Config; use it"]
    pub fn allow_private_relays(mut self, allow: bool) -> Config {
        self.allow_private_relays = allow;
        self
    }

    /// The address policy of this configuration; `own_addrs` are the own relay's resolved
    /// addresses (a discovered relay resolving to one of them is refused).
    pub fn address_policy(&self, own_addrs: Vec<std::net::SocketAddr>) -> AddressPolicy {
        let mut trusted = vec![self.own_relay.clone()];
        trusted.extend(self.public_urls.iter().cloned());
        trusted.extend(self.bootstrap.iter().cloned());
        AddressPolicy {
            allow_private: self.allow_private_relays,
            deny: self.deny_relays.clone(),
            allow: self.allow_relays.clone(),
            trusted,
            own_addrs,
            local: crate::net::policy::LocalAddresses::new(
                std::iter::once(self.own_relay.clone())
                    .chain(self.public_urls.iter().cloned())
                    .collect(),
            ),
        }
    }

    /// Sets the key used to answer NIP-42 AUTH challenges.
    #[must_use = "a builder returns the changed Config; use it"]
    pub fn auth_keys(mut self, keys: Keys) -> Config {
        self.auth_keys = Some(keys);
        self
    }

    /// Adds a public URL alias of the own relay.
    #[must_use = "a builder returns the changed Config; use it"]
    pub fn public_url(mut self, url: RelayUrl) -> Config {
        self.public_urls.push(url);
        self
    }

    /// Adds a bootstrap relay.
    #[must_use = "a builder returns the changed Config; use it"]
    pub fn bootstrap(mut self, url: RelayUrl) -> Config {
        self.bootstrap.push(url);
        self
    }

    /// Sets the self-subscription batch window.
    #[must_use = "a builder returns the changed Config; use it"]
    pub fn batch_window(mut self, window: Duration) -> Config {
        self.batch_window = window;
        self
    }

    /// Sets the EOSE deadline (see [`Config::eose_timeout`](#structfield.eose_timeout)).
    #[must_use = "a builder returns the changed Config; use it"]
    pub fn eose_timeout(mut self, timeout: Duration) -> Config {
        self.eose_timeout = timeout;
        self
    }

    /// Sets the reconnect backoff policy.
    #[must_use = "a builder returns the changed Config; use it"]
    pub fn backoff(mut self, backoff: BackoffPolicy) -> Config {
        self.backoff = backoff;
        self
    }

    /// Sets the time source.
    #[must_use = "a builder returns the changed Config; use it"]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Config {
        self.clock = clock;
        self
    }

    /// Which repositories are synced: with `public_urls` and without `archive`, only those
    /// whose announcement lists this service (one of `public_urls` or `own_relay`, GRASP-01);
    /// otherwise all.
    pub fn repo_scope(&self) -> RepoScope {
        if self.archive || self.public_urls.is_empty() {
            return RepoScope::All;
        }
        let mut urls = vec![self.own_relay.clone()];
        for u in &self.public_urls {
            if !urls.contains(u) {
                urls.push(u.clone());
            }
        }
        RepoScope::ListingService(urls)
    }

    /// What a state file must have been written with to be used (besides the own relay):
    /// the repository scope and the shard. A file of another configuration is ignored.
    pub fn state_key(&self) -> String {
        let mut urls: Vec<String> = self.public_urls.iter().map(|u| u.to_string()).collect();
        urls.sort();
        urls.dedup();
        format!(
            "public={};archive={};shard={}",
            urls.join(","),
            self.archive,
            self.shard.map_or("all".to_string(), |s| s.to_string())
        )
    }

    /// The pure core's part of this configuration.
    pub fn sync_config(&self) -> SyncConfig {
        let mut c = SyncConfig::new(self.own_relay.clone());
        c.own_aliases = self.public_urls.clone();
        c.bootstrap = self.bootstrap.clone();
        c.batch_window = self.batch_window;
        c.eose_timeout = self.eose_timeout;
        c.backoff = self.backoff;
        c.assumed_page_size = self.assumed_page_size;
        c.consolidation_threshold = self.consolidation_threshold;
        c.consolidation_wait = self.consolidation_wait;
        c.daily_min = self.daily_resync.0;
        c.daily_max = self.daily_resync.1;
        c.disconnect_check_interval = self.disconnect_check_interval;
        c.max_relays = self.max_relays;
        c.shard = self.shard;
        c.target_limits = TargetLimits {
            scope: self.repo_scope(),
            max_relays_per_pubkey: self.max_relays_per_pubkey,
            max_relays_per_announcement: self.max_relays_per_announcement,
            max_urls_per_host: self.max_urls_per_host,
            preferred_pubkeys: self.prefer_pubkeys.iter().cloned().collect(),
        };
        c.default_subscription_budget = self.default_subscription_budget;
        c.poll_interval = self.poll_interval;
        c.rate_limit_cooldown = self.rate_limit_cooldown;
        c.refused_retry = self.refused_retry;
        c.seed = self.seed;
        c.nip77 = self.nip77.clone();
        c.threads = self.threads;
        c
    }
}

#[cfg(test)]
mod auth_key_tests {
    use super::*;

    const HEX: &str = "6b911fd37cdf5c81d4c0adb1ab7fa822ed253ab0ad9aa18d77257c88b29b718e";

    fn temp_file(name: &str, content: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "grasp-sync-key-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        p
    }

    fn nsec() -> String {
        use nostr::nips::nip19::ToBech32;
        Keys::parse(HEX).unwrap().secret_key().to_bech32().unwrap()
    }

    #[test]
    fn reads_nsec_and_hex_files_trimmed() {
        let expected = Keys::parse(HEX).unwrap().public_key();
        let p = temp_file("nsec", &format!("  {}\n", nsec()));
        let k = load_auth_key_from(Some(&p), None).unwrap().unwrap();
        assert_eq!(k.public_key(), expected);
        let p = temp_file("hex", &format!("{HEX}\n"));
        // The file wins over the environment variable.
        let k = load_auth_key_from(Some(&p), Some("garbage"))
            .unwrap()
            .unwrap();
        assert_eq!(k.public_key(), expected);
    }

    #[test]
    fn garbage_is_an_error_that_does_not_echo_the_key() {
        for bad in ["garbage-secret", &HEX[..63], "npub1xyz", "\n\n"] {
            let p = temp_file("bad", bad);
            let e = load_auth_key_from(Some(&p), None).unwrap_err().to_string();
            assert!(e.contains("--nsec-file") && e.contains("nsec1"), "{e}");
            if !bad.trim().is_empty() {
                assert!(!e.contains(bad.trim()), "{e}");
            }
        }
        // A valid public key is not a secret key.
        let npub = {
            use nostr::nips::nip19::ToBech32;
            Keys::parse(HEX).unwrap().public_key().to_bech32().unwrap()
        };
        let e = load_auth_key_from(None, Some(&npub))
            .unwrap_err()
            .to_string();
        assert!(e.contains(NSEC_ENV) && !e.contains(&npub), "{e}");
    }

    #[test]
    fn missing_file_is_an_error_naming_it() {
        let p = std::env::temp_dir().join("grasp-sync-no-such-dir/nsec");
        let e = load_auth_key_from(Some(&p), None).unwrap_err().to_string();
        assert!(
            e.contains("grasp-sync-no-such-dir") && e.contains("cannot read"),
            "{e}"
        );
    }

    #[test]
    fn environment_variable() {
        let k = load_auth_key_from(None, Some(&nsec())).unwrap().unwrap();
        assert_eq!(k.public_key(), Keys::parse(HEX).unwrap().public_key());
        assert!(load_auth_key_from(None, Some(&format!(" {HEX} ")))
            .unwrap()
            .is_some());
        assert!(load_auth_key_from(None, None).unwrap().is_none());
        assert!(load_auth_key_from(None, Some("  ")).unwrap().is_none());
        let e = load_auth_key_from(None, Some("nope"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(NSEC_ENV) && !e.contains("nope"), "{e}");
    }

    #[test]
    fn debug_redacts_the_key() {
        let c = Config::new(crate::shared::RelayUrl::parse("ws://127.0.0.1:1").unwrap())
            .auth_keys(Keys::parse(HEX).unwrap());
        let d = format!("{c:?}");
        assert!(d.contains("auth_keys: Some(<redacted>)"), "{d}");
        assert!(!d.contains(HEX), "{d}");
    }
}

#[cfg(test)]
mod sync_config_tests {
    use super::*;

    #[test]
    fn sync_config_carries_every_setting_and_defaults_match_the_design() {
        let own = RelayUrl::parse("ws://127.0.0.1:7777").unwrap();
        let d = Config::new(own.clone()).sync_config();
        let design = SyncConfig::new(own.clone());
        assert_eq!(d.consolidation_threshold, design.consolidation_threshold);
        assert_eq!(d.consolidation_wait, design.consolidation_wait);
        assert_eq!(
            (d.daily_min, d.daily_max),
            (design.daily_min, design.daily_max)
        );
        assert_eq!(
            d.disconnect_check_interval,
            design.disconnect_check_interval
        );
        assert_eq!(d.batch_window, design.batch_window);
        assert_eq!(d.eose_timeout, design.eose_timeout);
        let mut c = Config::new(own);
        c.consolidation_threshold = 9;
        c.consolidation_wait = Duration::from_secs(3);
        c.daily_resync = (Duration::from_secs(1), Duration::from_secs(2));
        c.disconnect_check_interval = Duration::from_secs(4);
        c.default_subscription_budget = 5;
        c.poll_interval = Duration::from_secs(6);
        c.assumed_page_size = 7;
        c.rate_limit_cooldown = Duration::from_secs(8);
        c.max_relays = 10;
        c.refused_retry = Duration::from_secs(9);
        c.max_relays_per_pubkey = 11;
        c.max_relays_per_announcement = 12;
        let s = c.sync_config();
        assert_eq!(s.target_limits.max_relays_per_pubkey, 11);
        assert_eq!(s.target_limits.max_relays_per_announcement, 12);
        assert_eq!(s.target_limits.scope, RepoScope::All, "no public URL: all");
        assert_eq!(d.target_limits, TargetLimits::default());
        assert_eq!(s.consolidation_threshold, 9);
        assert_eq!(s.consolidation_wait, Duration::from_secs(3));
        assert_eq!(
            (s.daily_min, s.daily_max),
            (Duration::from_secs(1), Duration::from_secs(2))
        );
        assert_eq!(s.disconnect_check_interval, Duration::from_secs(4));
        assert_eq!(s.default_subscription_budget, 5);
        assert_eq!(s.poll_interval, Duration::from_secs(6));
        assert_eq!(s.assumed_page_size, 7);
        assert_eq!(s.rate_limit_cooldown, Duration::from_secs(8));
        assert_eq!(s.max_relays, 10);
        assert_eq!(s.refused_retry, Duration::from_secs(9));
        let public = RelayUrl::parse("wss://git.example").unwrap();
        c.public_urls.push(public.clone());
        assert_eq!(
            c.sync_config().target_limits.scope,
            RepoScope::ListingService(vec![c.own_relay.clone(), public])
        );
        c.archive = true;
        assert_eq!(c.sync_config().target_limits.scope, RepoScope::All);
    }
}
