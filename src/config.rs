//! Engine configuration.

use std::sync::Arc;
use std::time::Duration;

use crate::core::forward::ForwardLimits;
use crate::core::health::BackoffPolicy;
use crate::core::sync::SyncConfig;
use crate::core::time::{Clock, SystemClock};
use crate::net::url::RelayUrl;
use crate::net::ws::WsOptions;

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
    /// A batch whose EOSEs do not all arrive within this fails and is retried (default 120 s).
    pub eose_timeout: Duration,
    /// Reconnect backoff and health thresholds.
    pub backoff: BackoffPolicy,
    /// Websocket limits and deadlines.
    pub ws: WsOptions,
    /// Ping interval (default 30 s).
    pub ping_interval: Duration,
    /// Time to wait for a pong or any frame after a ping (default 20 s).
    pub pong_timeout: Duration,
    /// Forward queue limits.
    pub forward: ForwardLimits,
    /// Capacity of the channel from relay threads to the forwarder.
    pub forward_channel: usize,
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
            .finish_non_exhaustive()
    }
}

impl Config {
    /// Defaults (those of the design document) for `own_relay`.
    pub fn new(own_relay: RelayUrl) -> Config {
        Config {
            own_relay,
            public_urls: Vec::new(),
            bootstrap: Vec::new(),
            batch_window: Duration::from_secs(5),
            eose_timeout: Duration::from_secs(120),
            backoff: BackoffPolicy::default(),
            ws: WsOptions::default(),
            ping_interval: Duration::from_secs(30),
            pong_timeout: Duration::from_secs(20),
            forward: ForwardLimits::default(),
            forward_channel: 1024,
            summary_interval: Duration::from_secs(60),
            clock: Arc::new(SystemClock),
            assumed_page_size: 20,
            nip11_timeout: Duration::from_secs(5),
            default_subscription_budget: 20,
            poll_interval: Duration::from_secs(60),
            rate_limit_cooldown: Duration::from_secs(65),
            refused_retry: Duration::from_secs(600),
            seed: rand::random::<u64>(),
        }
    }

    /// Adds a public URL alias of the own relay.
    pub fn public_url(mut self, url: RelayUrl) -> Config {
        self.public_urls.push(url);
        self
    }

    /// Adds a bootstrap relay.
    pub fn bootstrap(mut self, url: RelayUrl) -> Config {
        self.bootstrap.push(url);
        self
    }

    /// Sets the self-subscription batch window.
    pub fn batch_window(mut self, window: Duration) -> Config {
        self.batch_window = window;
        self
    }

    /// Sets the EOSE deadline of a batch.
    pub fn eose_timeout(mut self, timeout: Duration) -> Config {
        self.eose_timeout = timeout;
        self
    }

    /// Sets the reconnect backoff policy.
    pub fn backoff(mut self, backoff: BackoffPolicy) -> Config {
        self.backoff = backoff;
        self
    }

    /// Sets the time source.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Config {
        self.clock = clock;
        self
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
        c.default_subscription_budget = self.default_subscription_budget;
        c.poll_interval = self.poll_interval;
        c.rate_limit_cooldown = self.rate_limit_cooldown;
        c.refused_retry = self.refused_retry;
        c.seed = self.seed;
        c
    }
}
