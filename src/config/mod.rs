//! Configuration: every setting declared once, in [`Settings`] (a flag of `lockbroker serve`, its
//! environment variable and a key of the config file), layered flags → environment → file →
//! defaults into one typed [`Config`] and validated once at start. It also owns the choice of
//! store a Redis URL makes ([`StoreBackend`]) and the URL as a secret ([`RedisUrl`]). Nothing
//! else in the broker reads the environment.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::store::redis::{ParsedUrl, RedisTls, Topology};

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line, for log collectors.
    Json,
}

/// The settings one source gives, all optional: `lockbroker serve`'s flags, or the config file,
/// whose keys are the flags' names. Clap reads a flag from its environment variable when the
/// flag is absent; a flag beats the environment, which beats the file, which beats the default.
/// Unknown keys in the file are an error, so a misspelt key does not silently fall back to its
/// default.
///
/// No `Debug`: it holds the Redis URL as given, password and all.
#[derive(Clone, Default, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// TOML config file (keys are the flags' names with `_`).
    #[arg(long, env = "LOCKBROKER_CONFIG", value_name = "FILE")]
    // A flag only: the file does not name another file.
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:8080].
    #[arg(long, env = "LOCKBROKER_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// Redis to keep locks in (redis://[user:pass@]host:port/db). Without it, the embedded
    /// in-memory store: correct for one broker, not shared between brokers.
    #[arg(long, env = "LOCKBROKER_REDIS_URL", value_name = "URL")]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key the broker writes [default: lockbroker:].
    #[arg(long, env = "LOCKBROKER_KEY_PREFIX", value_name = "PREFIX")]
    pub key_prefix: Option<String>,
    /// Lease length when a request gives no ttl_ms [default: 30000].
    #[arg(long, env = "LOCKBROKER_DEFAULT_TTL_MS", value_name = "MS")]
    pub default_ttl_ms: Option<u64>,
    /// Longest lease a request may ask for [default: 3600000].
    #[arg(long, env = "LOCKBROKER_MAX_TTL_MS", value_name = "MS")]
    pub max_ttl_ms: Option<u64>,
    /// Wait when a request gives no wait_ms [default: 0].
    #[arg(long, env = "LOCKBROKER_DEFAULT_WAIT_MS", value_name = "MS")]
    pub default_wait_ms: Option<u64>,
    /// Longest wait a request may ask for [default: 60000].
    #[arg(long, env = "LOCKBROKER_MAX_WAIT_MS", value_name = "MS")]
    pub max_wait_ms: Option<u64>,
    /// Bound on one store call, connecting included [default: 2000].
    #[arg(long, env = "LOCKBROKER_STORE_TIMEOUT_MS", value_name = "MS")]
    pub store_timeout_ms: Option<u64>,
    /// Most acquires that may wait on this broker at once [default: 10000].
    #[arg(long, env = "LOCKBROKER_MAX_WAITERS", value_name = "N")]
    pub max_waiters: Option<usize>,
    /// Paranoid option: after a detected store loss, hold every grant until this long after it,
    /// so that even leases granted by brokers that died before the loss have ended
    /// [default: 0, off: brokers put their live leases back instead].
    #[arg(long, env = "LOCKBROKER_STORE_LOSS_DELAY_MS", value_name = "MS")]
    pub store_loss_delay_ms: Option<u64>,
    /// How long a new store epoch (a new or emptied Redis, a restart, a failover) holds every
    /// grant, so that every running broker puts its live leases back first [default: 3000].
    #[arg(long, env = "LOCKBROKER_STORE_SETTLE_MS", value_name = "MS")]
    pub store_settle_ms: Option<u64>,
    /// CA certificate (PEM) that Redis's TLS certificate must chain to, for rediss:// URLs
    /// [default: the system's roots].
    #[arg(long, env = "LOCKBROKER_REDIS_TLS_CA", value_name = "FILE")]
    pub redis_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) to present to Redis over TLS; needs --redis-tls-key.
    #[arg(long, env = "LOCKBROKER_REDIS_TLS_CERT", value_name = "FILE")]
    pub redis_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --redis-tls-cert.
    #[arg(long, env = "LOCKBROKER_REDIS_TLS_KEY", value_name = "FILE")]
    pub redis_tls_key: Option<PathBuf>,
    /// Answer a grant or renew only once this many replicas have it (Redis WAIT); if they do
    /// not within store_timeout_ms, the lease is released and the request answers 503
    /// [default: 0].
    #[arg(long, env = "LOCKBROKER_REDIS_REPLICA_ACKS", value_name = "N")]
    pub redis_replica_acks: Option<u32>,
    /// Log format [default: text].
    #[arg(long, env = "LOCKBROKER_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Log filter, as tracing's EnvFilter reads it [default: info].
    #[arg(long, env = "LOCKBROKER_LOG_LEVEL", value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Auth file (TOML: named bearer tokens with key prefixes and permissions). Without it,
    /// every client may do everything. Read again on SIGHUP and when it changes.
    #[arg(long, env = "LOCKBROKER_AUTH_FILE", value_name = "FILE")]
    pub auth_file: Option<PathBuf>,
    /// With an auth file, /metrics and /openapi.json need a token too ("admin", or "read" on
    /// every key) [default: false].
    #[arg(
        long,
        env = "LOCKBROKER_AUTH_METRICS",
        value_name = "BOOL",
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub auth_metrics: Option<bool>,
    /// Without an auth file, allow `DELETE …?force=true` (every lease on a key ended without its
    /// token) from any client; otherwise it is refused with 403. With an auth file, force release
    /// needs an "admin" token whatever this says [default: false].
    #[arg(
        long,
        env = "LOCKBROKER_ALLOW_FORCE_RELEASE",
        value_name = "BOOL",
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub allow_force_release: Option<bool>,
    /// Serve HTTPS with this certificate chain (PEM); needs --tls-key. Read again on SIGHUP and
    /// when it changes.
    #[arg(long, env = "LOCKBROKER_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "LOCKBROKER_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM): mutual TLS.
    #[arg(long, env = "LOCKBROKER_TLS_CLIENT_CA", value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,
    /// A client must send a whole request head within this (and, between requests on a
    /// kept-alive connection, the next one) or be disconnected [default: 10000].
    #[arg(long, env = "LOCKBROKER_HEADER_TIMEOUT_MS", value_name = "MS")]
    pub header_timeout_ms: Option<u64>,
    /// Most connections open at once; later ones wait in the kernel's queue [default: 10000].
    #[arg(long, env = "LOCKBROKER_MAX_CONNECTIONS", value_name = "N")]
    pub max_connections: Option<usize>,
}

impl Settings {
    /// These settings over `lower`: each one given here wins, the rest come from `lower`.
    /// `config` is not carried over; the file it names has been read by then.
    fn or(self, lower: Self) -> Self {
        // Field by field through JSON, so that a new setting needs no line here.
        let fields = |settings: Self| match serde_json::to_value(settings) {
            Ok(serde_json::Value::Object(fields)) => fields,
            _ => unreachable!("a struct of options serializes to a JSON object"),
        };
        let mut merged = fields(lower);
        merged.extend(
            fields(self)
                .into_iter()
                .filter(|(_, value)| !value.is_null()),
        );
        serde_json::from_value(merged.into()).expect("settings read back as they were written")
    }
}

/// The broker's settings, resolved and valid. Each field is the setting of the same name in
/// [`Settings`], which documents it. `Debug` shows no password.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    /// The store, chosen by the scheme of the `redis_url` setting.
    pub redis_url: StoreBackend,
    pub key_prefix: String,
    pub default_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub default_wait_ms: u64,
    pub max_wait_ms: u64,
    pub store_timeout_ms: u64,
    pub max_waiters: usize,
    /// Paranoid option (0: off): after a detected store loss, hold every grant this long.
    pub store_loss_delay_ms: u64,
    /// How long a new store epoch holds every grant, so running brokers put their leases back.
    pub store_settle_ms: u64,
    pub redis_tls_ca: Option<PathBuf>,
    pub redis_tls_cert: Option<PathBuf>,
    pub redis_tls_key: Option<PathBuf>,
    pub redis_replica_acks: u32,
    pub log_format: LogFormat,
    pub log_level: String,
    pub auth_file: Option<PathBuf>,
    pub auth_metrics: bool,
    pub allow_force_release: bool,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub header_timeout_ms: u64,
    pub max_connections: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            redis_url: StoreBackend::Memory,
            key_prefix: "lockbroker:".into(),
            default_ttl_ms: 30_000,
            max_ttl_ms: 3_600_000,
            default_wait_ms: 0,
            max_wait_ms: 60_000,
            store_timeout_ms: 2_000,
            max_waiters: 10_000,
            store_loss_delay_ms: 0,
            store_settle_ms: 3_000,
            redis_tls_ca: None,
            redis_tls_cert: None,
            redis_tls_key: None,
            redis_replica_acks: 0,
            log_format: LogFormat::Text,
            log_level: "info".into(),
            auth_file: None,
            auth_metrics: false,
            allow_force_release: false,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            header_timeout_ms: 10_000,
            max_connections: 10_000,
        }
    }
}

/// Shortest settle time that leaves running brokers time to reconnect and put their leases back
/// (they retry within 100 ms to 1 s); shorter is allowed, with a warning.
const MIN_SAFE_SETTLE_MS: u64 = 1_000;

/// Longest lease a broker may be configured to allow: a day. Longer leases are a sign of a
/// lock used as a flag, and keep a key blocked for that long when a holder dies.
const MAX_TTL_CEILING_MS: u64 = 86_400_000;

impl Config {
    /// Reads the config file named by the flags or the environment, if any, and resolves.
    pub fn load(flags: Settings) -> anyhow::Result<Self> {
        let file = match &flags.config {
            None => Settings::default(),
            Some(path) => read_file(path)?,
        };
        Self::resolve(flags, file)
    }

    /// Layers the (already environment-merged) flags over the file over the defaults.
    pub fn resolve(flags: Settings, file: Settings) -> anyhow::Result<Self> {
        let s = flags.or(file);
        let d = Self::default();
        let max_ttl_ms = s.max_ttl_ms.unwrap_or(d.max_ttl_ms);
        let config = Self {
            listen: match s.listen {
                None => d.listen,
                Some(a) => a.parse().with_context(|| {
                    format!("listen: {a:?} is not an address such as 127.0.0.1:8080")
                })?,
            },
            redis_url: StoreBackend::parse(s.redis_url.as_deref().unwrap_or_default())?,
            key_prefix: s.key_prefix.unwrap_or(d.key_prefix),
            default_ttl_ms: s.default_ttl_ms.unwrap_or(d.default_ttl_ms),
            max_ttl_ms,
            default_wait_ms: s.default_wait_ms.unwrap_or(d.default_wait_ms),
            max_wait_ms: s.max_wait_ms.unwrap_or(d.max_wait_ms),
            store_timeout_ms: s.store_timeout_ms.unwrap_or(d.store_timeout_ms),
            max_waiters: s.max_waiters.unwrap_or(d.max_waiters),
            // Off unless asked for: the brokers put the live leases back after a loss.
            store_loss_delay_ms: s.store_loss_delay_ms.unwrap_or(0),
            store_settle_ms: s.store_settle_ms.unwrap_or(d.store_settle_ms),
            redis_tls_ca: s.redis_tls_ca,
            redis_tls_cert: s.redis_tls_cert,
            redis_tls_key: s.redis_tls_key,
            redis_replica_acks: s.redis_replica_acks.unwrap_or(d.redis_replica_acks),
            log_format: s.log_format.unwrap_or(d.log_format),
            log_level: s.log_level.unwrap_or(d.log_level),
            auth_file: s.auth_file,
            auth_metrics: s.auth_metrics.unwrap_or(d.auth_metrics),
            allow_force_release: s.allow_force_release.unwrap_or(d.allow_force_release),
            tls_cert: s.tls_cert,
            tls_key: s.tls_key,
            tls_client_ca: s.tls_client_ca,
            header_timeout_ms: s.header_timeout_ms.unwrap_or(d.header_timeout_ms),
            max_connections: s.max_connections.unwrap_or(d.max_connections),
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> anyhow::Result<()> {
        if self.max_ttl_ms == 0 || self.max_ttl_ms > MAX_TTL_CEILING_MS {
            bail!("max_ttl_ms must be between 1 and {MAX_TTL_CEILING_MS}");
        }
        if self.default_ttl_ms == 0 || self.default_ttl_ms > self.max_ttl_ms {
            bail!(
                "default_ttl_ms must be between 1 and max_ttl_ms ({})",
                self.max_ttl_ms
            );
        }
        if self.default_wait_ms > self.max_wait_ms {
            bail!(
                "default_wait_ms must not exceed max_wait_ms ({})",
                self.max_wait_ms
            );
        }
        if self.max_wait_ms > 3_600_000 {
            bail!("max_wait_ms must be at most 3600000 (an hour)");
        }
        if !(10..=60_000).contains(&self.store_timeout_ms) {
            bail!("store_timeout_ms must be between 10 and 60000");
        }
        if self.store_settle_ms > 60_000 {
            bail!("store_settle_ms must be at most 60000");
        }
        if self.store_loss_delay_ms > MAX_TTL_CEILING_MS {
            bail!("store_loss_delay_ms must be at most {MAX_TTL_CEILING_MS}");
        }
        if self.max_waiters == 0 {
            bail!("max_waiters must be at least 1");
        }
        if self.redis_tls_cert.is_some() != self.redis_tls_key.is_some() {
            bail!("redis_tls_cert and redis_tls_key go together: give both or neither");
        }
        let tls_files = self.redis_tls_ca.is_some() || self.redis_tls_cert.is_some();
        let tls_url = self
            .redis_url
            .url()
            .is_some_and(|url| url.expose().to_ascii_lowercase().starts_with("rediss"));
        if tls_files && !tls_url {
            bail!(
                "redis_tls_ca, redis_tls_cert and redis_tls_key need a TLS Redis URL (rediss://, \
                 rediss+sentinel:// or rediss+cluster://)"
            );
        }
        if self.redis_replica_acks > 0 && self.redis_url.url().is_none() {
            bail!("redis_replica_acks needs a Redis URL: the embedded store has no replicas");
        }
        if self.redis_replica_acks > 100 {
            bail!("redis_replica_acks must be at most 100");
        }
        if self.key_prefix.contains(['{', '}']) {
            bail!("key_prefix must not contain braces: they would break the per-lock hash tag");
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            bail!("tls_cert and tls_key go together: give both, or neither for plain HTTP");
        }
        if self.tls_client_ca.is_some() && self.tls_cert.is_none() {
            bail!("tls_client_ca needs tls_cert and tls_key: client certificates need HTTPS");
        }
        if self.auth_metrics && self.auth_file.is_none() {
            bail!("auth_metrics needs auth_file: there is no token to ask for without one");
        }
        if !(100..=600_000).contains(&self.header_timeout_ms) {
            bail!("header_timeout_ms must be between 100 and 600000");
        }
        if self.max_connections == 0 {
            bail!("max_connections must be at least 1");
        }
        tracing_subscriber::EnvFilter::try_new(&self.log_level)
            .with_context(|| format!("log_level {:?} is not a valid filter", self.log_level))?;
        Ok(())
    }

    /// Settings that are allowed but give up a guarantee, one sentence each. Returned, not
    /// logged: the configuration is read before logging is set up.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.store_settle_ms < MIN_SAFE_SETTLE_MS && self.redis_url.url().is_some() {
            warnings.push(format!(
                "store_settle_ms ({}) is shorter than {MIN_SAFE_SETTLE_MS}: after Redis restarts \
                 or is flushed, a key may be granted before the broker that holds its live lease \
                 has put it back",
                self.store_settle_ms
            ));
        }
        warnings
    }

    /// `header_timeout_ms` as a `Duration`.
    pub fn header_timeout(&self) -> Duration {
        Duration::from_millis(self.header_timeout_ms)
    }

    /// The TLS files for Redis.
    pub fn redis_tls(&self) -> RedisTls {
        RedisTls {
            ca: self.redis_tls_ca.clone(),
            cert: self.redis_tls_cert.clone(),
            key: self.redis_tls_key.clone(),
        }
    }

    /// `store_timeout_ms` as a `Duration`.
    pub fn store_timeout(&self) -> Duration {
        Duration::from_millis(self.store_timeout_ms)
    }
}

fn read_file(path: &Path) -> anyhow::Result<Settings> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("the config file {} is invalid", path.display()))
}

/// The store a broker keeps its locks in, chosen by the scheme of its Redis URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    /// No URL: the embedded in-memory store, for one broker only.
    Memory,
    /// `redis://`, or `rediss://` over TLS: one Redis server.
    Redis(RedisUrl),
    /// `redis+sentinel://` or `rediss+sentinel://`: the master that sentinels name.
    Sentinel(RedisUrl),
    /// `redis+cluster://` or `rediss+cluster://`: a Redis Cluster, from any of its nodes.
    Cluster(RedisUrl),
}

const ACCEPTED_SCHEMES: &str = "redis://, rediss://, redis+sentinel://, rediss+sentinel://, \
                                redis+cluster:// or rediss+cluster://";

impl StoreBackend {
    /// Picks the store by `url`'s scheme (in any case); empty or blank is the embedded store.
    /// Errors name the accepted schemes and never repeat the URL, which may hold a password.
    pub fn parse(url: &str) -> anyhow::Result<Self> {
        if url.trim().is_empty() {
            return Ok(Self::Memory);
        }
        let scheme = url
            .split_once("://")
            .map(|(scheme, _)| scheme.to_ascii_lowercase())
            .filter(|s| {
                s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
            });
        let secret = RedisUrl(url.to_owned());
        match scheme.as_deref() {
            Some(
                "redis" | "rediss" | "redis+sentinel" | "rediss+sentinel" | "redis+cluster"
                | "rediss+cluster",
            ) => {
                let parsed =
                    ParsedUrl::parse(url).map_err(|e| anyhow::anyhow!("redis_url: {e}"))?;
                Ok(match parsed.topology {
                    Topology::Single => Self::Redis(secret),
                    Topology::Sentinel => Self::Sentinel(secret),
                    Topology::Cluster => Self::Cluster(secret),
                })
            }
            Some(other) => {
                bail!(
                    "redis_url: unknown scheme {other:?}; the accepted ones are {ACCEPTED_SCHEMES}"
                )
            }
            None => bail!("redis_url is not a URL; the accepted schemes are {ACCEPTED_SCHEMES}"),
        }
    }

    /// The URL, unless the store is the embedded one.
    pub fn url(&self) -> Option<&RedisUrl> {
        match self {
            Self::Memory => None,
            Self::Redis(url) | Self::Sentinel(url) | Self::Cluster(url) => Some(url),
        }
    }
}

/// A Redis URL, which may hold a password. `Debug` and `Display` mask it, and the user name with
/// it (`redis://***@host:port/db`), so neither a log line nor a printed [`Config`] shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl(String);

impl RedisUrl {
    /// The URL as configured, password included: for connecting, never for printing.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let url = &self.0;
        // The last `@`: a password may contain `@` itself.
        match (url.find("://"), url.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                write!(f, "{}://***@{}", &url[..scheme], &url[at + 1..])
            }
            _ => f.write_str(url),
        }
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RedisUrl")
            .field(&format_args!("{self}"))
            .finish()
    }
}

#[cfg(test)]
mod tests;
