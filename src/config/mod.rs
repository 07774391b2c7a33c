//! Configuration: every setting declared once (`settings.rs`: a flag of `lockbroker serve`, its
//! environment variable and a key of the config file), layered flags → environment → file →
//! defaults, validated once at start, and handed to each component as its own settings type:
//! [`ServingSettings`], [`StoreBackend`] (the store a Redis URL chooses, the URL parsed once and
//! kept as a secret), the lock service's `LockSettings`, the request [`Limits`] and
//! [`LogSettings`]. Nothing else in the broker reads the environment.

mod settings;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;

use self::settings::Values;
pub use self::settings::{LogFormat, Settings};
pub use crate::http::Limits;
use crate::lock::LockSettings;
use crate::server::tls::TlsFiles;
use crate::store::redis::{ClientCertificate, RedisSettings, RedisTls, RedisUrl, Topology};

/// `lockbroker serve`'s arguments: the config file, and the settings as flags.
#[derive(Clone, Args)]
pub struct ServeArgs {
    /// TOML config file (keys are the flags' names with `_`).
    // A flag only: the file does not name another file.
    #[arg(long, env = "LOCKBROKER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub settings: Settings,
}

/// The broker's settings, resolved and valid, one part per component. `Debug` shows no
/// password.
#[derive(Debug, Clone)]
pub struct Config {
    /// The listener, the HTTP server and the auth layer.
    pub serving: ServingSettings,
    /// Where locks are kept.
    pub store: StoreBackend,
    /// The lock service.
    pub lock: LockSettings,
    /// The request parameters' defaults and bounds.
    pub limits: Limits,
    /// Logging.
    pub log: LogSettings,
}

/// How the broker serves: where, with which bounds on connections, over HTTPS or not, and
/// whether clients need tokens.
#[derive(Debug, Clone)]
pub struct ServingSettings {
    /// The address to listen on.
    pub listen: SocketAddr,
    /// A client must send a whole request head within this or be disconnected.
    pub header_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// The listen queue's length: connections the kernel holds before the broker takes them.
    pub listen_backlog: u32,
    /// HTTPS from these files; plain HTTP when `None`.
    pub tls: Option<TlsFiles>,
    /// The auth file; without one, every client may do everything.
    pub auth_file: Option<PathBuf>,
    /// Whether `/metrics` and `/openapi.json` need a token too (only with `auth_file`).
    pub auth_metrics: bool,
}

/// The store a broker keeps its locks in, chosen by the scheme of its Redis URL.
#[derive(Debug, Clone)]
pub enum StoreBackend {
    /// No URL: the embedded in-memory store, for one broker only.
    Memory,
    /// Redis: one server, the master that sentinels name, or a cluster, as the URL says.
    // Boxed: many times larger than the embedded store's nothing.
    Redis(Box<RedisSettings>),
}

impl StoreBackend {
    /// The Redis URL, unless the store is the embedded one.
    pub fn redis_url(&self) -> Option<&RedisUrl> {
        match self {
            Self::Memory => None,
            Self::Redis(settings) => Some(&settings.url),
        }
    }
}

/// How logs are written.
#[derive(Debug, Clone)]
pub struct LogSettings {
    pub format: LogFormat,
    /// The filter, as tracing's `EnvFilter` reads it (valid: checked at start).
    pub level: String,
}

/// Shortest settle time that leaves running brokers time to reconnect and put their leases back
/// (they retry within 100 ms to 1 s); shorter is allowed, with a warning.
const MIN_SAFE_SETTLE_MS: u64 = 1_000;

/// Largest listen queue asked for: Linux keeps the backlog in 16 bits and caps it at
/// net.core.somaxconn anyway.
const MAX_LISTEN_BACKLOG: u32 = 65_535;

/// Longest lease a broker may be configured to allow: a day. Longer leases are a sign of a
/// lock used as a flag, and keep a key blocked for that long when a holder dies.
const MAX_TTL_CEILING_MS: u64 = 86_400_000;

impl Default for Config {
    /// Every setting at its default.
    fn default() -> Self {
        Self::resolve(Settings::default(), Settings::default()).expect("the defaults are valid")
    }
}

impl Config {
    /// Reads the config file named by the flags or the environment, if any, and resolves.
    pub fn load(args: ServeArgs) -> anyhow::Result<Self> {
        let file = match &args.config {
            None => Settings::default(),
            Some(path) => read_file(path)?,
        };
        Self::resolve(args.settings, file)
    }

    /// Layers the (already environment-merged) flags over the file over the defaults, checks
    /// the result and hands each component its part.
    pub fn resolve(flags: Settings, file: Settings) -> anyhow::Result<Self> {
        let v = flags.or(file).values();
        let listen = v.listen.parse().with_context(|| {
            format!(
                "listen: {:?} is not an address such as 127.0.0.1:8080",
                v.listen
            )
        })?;
        let redis_url = redis_url(v.redis_url.as_deref().unwrap_or_default())?;
        validate(&v, redis_url.as_ref())?;
        let store_timeout = Duration::from_millis(v.store_timeout_ms);
        Ok(Self {
            serving: ServingSettings {
                listen,
                header_timeout: Duration::from_millis(v.header_timeout_ms),
                max_connections: v.max_connections,
                listen_backlog: v.listen_backlog,
                // Both or neither: checked above.
                tls: v.tls_cert.zip(v.tls_key).map(|(cert, key)| TlsFiles {
                    cert,
                    key,
                    client_ca: v.tls_client_ca,
                }),
                auth_file: v.auth_file.clone(),
                auth_metrics: v.auth_metrics,
            },
            store: match redis_url {
                None => StoreBackend::Memory,
                Some(url) => StoreBackend::Redis(Box::new(RedisSettings {
                    url,
                    key_prefix: v.key_prefix,
                    timeout: store_timeout,
                    store_loss_delay: Duration::from_millis(v.store_loss_delay_ms),
                    store_settle: Duration::from_millis(v.store_settle_ms),
                    tls: RedisTls {
                        ca: v.redis_tls_ca,
                        client: v
                            .redis_tls_cert
                            .zip(v.redis_tls_key)
                            .map(|(cert, key)| ClientCertificate { cert, key }),
                    },
                    replica_acks: v.redis_replica_acks,
                    batch_max: v.redis_batch as usize,
                })),
            },
            lock: LockSettings {
                store_timeout,
                max_waiters: v.max_waiters,
                // With auth, the auth layer lets only admin tokens ask.
                allow_force_release: v.allow_force_release || v.auth_file.is_some(),
            },
            limits: Limits {
                default_ttl_ms: v.default_ttl_ms,
                max_ttl_ms: v.max_ttl_ms,
                default_wait_ms: v.default_wait_ms,
                max_wait_ms: v.max_wait_ms,
            },
            log: LogSettings {
                format: v.log_format,
                level: v.log_level,
            },
        })
    }

    /// Settings that are allowed but give up a guarantee, one sentence each. Returned, not
    /// logged: the configuration is read before logging is set up.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if let StoreBackend::Redis(redis) = &self.store {
            let settle_ms = redis.store_settle.as_millis();
            if settle_ms < u128::from(MIN_SAFE_SETTLE_MS) {
                warnings.push(format!(
                    "store_settle_ms ({settle_ms}) is shorter than {MIN_SAFE_SETTLE_MS}: after \
                     Redis restarts or is flushed, a key may be granted before the broker that \
                     holds its live lease has put it back"
                ));
            }
            let topology = match redis.url.topology() {
                Topology::Sentinel => Some("Redis Sentinel"),
                Topology::Cluster => Some("Redis Cluster"),
                Topology::Single => None,
            };
            if let Some(topology) = topology.filter(|_| redis.replica_acks == 0) {
                warnings.push(format!(
                    "redis_replica_acks is 0 on {topology}: a master cut off from its replicas \
                     by a network partition can keep granting, and after the failover its \
                     replica grants the same locks again (two holders at once). Set \
                     redis_replica_acks to 1 (--redis-replica-acks 1, \
                     LOCKBROKER_REDIS_REPLICA_ACKS=1) and give the Redis servers \
                     min-replicas-to-write 1 and min-replicas-max-lag 2"
                ));
            }
        }
        warnings
    }
}

/// Checks every setting against its bounds and the others; `redis_url` is the `redis_url`
/// setting, parsed.
fn validate(v: &Values, redis_url: Option<&RedisUrl>) -> anyhow::Result<()> {
    if v.max_ttl_ms == 0 || v.max_ttl_ms > MAX_TTL_CEILING_MS {
        bail!("max_ttl_ms must be between 1 and {MAX_TTL_CEILING_MS}");
    }
    if v.default_ttl_ms == 0 || v.default_ttl_ms > v.max_ttl_ms {
        bail!(
            "default_ttl_ms must be between 1 and max_ttl_ms ({})",
            v.max_ttl_ms
        );
    }
    if v.default_wait_ms > v.max_wait_ms {
        bail!(
            "default_wait_ms must not exceed max_wait_ms ({})",
            v.max_wait_ms
        );
    }
    if v.max_wait_ms > 3_600_000 {
        bail!("max_wait_ms must be at most 3600000 (an hour)");
    }
    if !(10..=60_000).contains(&v.store_timeout_ms) {
        bail!("store_timeout_ms must be between 10 and 60000");
    }
    if v.store_settle_ms > 60_000 {
        bail!("store_settle_ms must be at most 60000");
    }
    if v.store_loss_delay_ms > MAX_TTL_CEILING_MS {
        bail!("store_loss_delay_ms must be at most {MAX_TTL_CEILING_MS}");
    }
    if v.max_waiters == 0 {
        bail!("max_waiters must be at least 1");
    }
    // The only checks of the Redis TLS files: the store trusts them.
    if v.redis_tls_cert.is_some() != v.redis_tls_key.is_some() {
        bail!("redis_tls_cert and redis_tls_key go together: give both or neither");
    }
    let tls_files = v.redis_tls_ca.is_some() || v.redis_tls_cert.is_some();
    if tls_files && !redis_url.is_some_and(RedisUrl::tls) {
        bail!(
            "redis_tls_ca, redis_tls_cert and redis_tls_key need a TLS Redis URL (rediss://, \
             rediss+sentinel:// or rediss+cluster://)"
        );
    }
    if v.redis_replica_acks > 0 && redis_url.is_none() {
        bail!("redis_replica_acks needs a Redis URL: the embedded store has no replicas");
    }
    if !(1..=1024).contains(&v.redis_batch) {
        bail!("redis_batch must be 1 to 1024");
    }
    if v.redis_replica_acks > 100 {
        bail!("redis_replica_acks must be at most 100");
    }
    if v.key_prefix.contains(['{', '}']) {
        bail!("key_prefix must not contain braces: they would break the per-lock hash tag");
    }
    if v.tls_cert.is_some() != v.tls_key.is_some() {
        bail!("tls_cert and tls_key go together: give both, or neither for plain HTTP");
    }
    if v.tls_client_ca.is_some() && v.tls_cert.is_none() {
        bail!("tls_client_ca needs tls_cert and tls_key: client certificates need HTTPS");
    }
    if v.auth_metrics && v.auth_file.is_none() {
        bail!("auth_metrics needs auth_file: there is no token to ask for without one");
    }
    if !(100..=600_000).contains(&v.header_timeout_ms) {
        bail!("header_timeout_ms must be between 100 and 600000");
    }
    if v.max_connections == 0 {
        bail!("max_connections must be at least 1");
    }
    if !(1..=MAX_LISTEN_BACKLOG).contains(&v.listen_backlog) {
        bail!("listen_backlog must be between 1 and {MAX_LISTEN_BACKLOG}");
    }
    tracing_subscriber::EnvFilter::try_new(&v.log_level)
        .with_context(|| format!("log_level {:?} is not a valid filter", v.log_level))?;
    Ok(())
}

fn read_file(path: &Path) -> anyhow::Result<Settings> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("the config file {} is invalid", path.display()))
}

const ACCEPTED_SCHEMES: &str = "redis://, rediss://, redis+sentinel://, rediss+sentinel://, \
                                redis+cluster:// or rediss+cluster://";

/// The `redis_url` setting, parsed once: `None` (the embedded store) when empty or blank. Errors
/// name the accepted schemes and never repeat the URL, which may hold a password.
fn redis_url(url: &str) -> anyhow::Result<Option<RedisUrl>> {
    if url.trim().is_empty() {
        return Ok(None);
    }
    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase())
        .filter(|s| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        });
    match scheme.as_deref() {
        Some(
            "redis" | "rediss" | "redis+sentinel" | "rediss+sentinel" | "redis+cluster"
            | "rediss+cluster",
        ) => Ok(Some(
            RedisUrl::parse(url).map_err(|e| anyhow::anyhow!("redis_url: {e}"))?,
        )),
        Some(other) => {
            bail!("redis_url: unknown scheme {other:?}; the accepted ones are {ACCEPTED_SCHEMES}")
        }
        None => bail!("redis_url is not a URL; the accepted schemes are {ACCEPTED_SCHEMES}"),
    }
}

#[cfg(test)]
mod tests;
