//! Configuration: one typed [`Config`], layered defaults → TOML file → environment → flags, and
//! validated once at start. Nothing else in the broker reads the environment.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde::Deserialize;

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line, for log collectors.
    Json,
}

/// `lockbroker serve`'s flags. Each is also an environment variable and a key of the config
/// file; a flag beats the environment, which beats the file, which beats the default.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// TOML config file (keys are the flags' names with `_`).
    #[arg(long, env = "LOCKBROKER_CONFIG", value_name = "FILE")]
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
    /// After Redis is seen to have lost its data, how long nothing is granted, so that leases it
    /// forgot end first [default: max_ttl_ms].
    #[arg(long, env = "LOCKBROKER_STORE_LOSS_DELAY_MS", value_name = "MS")]
    pub store_loss_delay_ms: Option<u64>,
    /// When a broker finds a Redis with no incarnation marker (new, or it lost its data), how
    /// long nothing is granted, so brokers that knew the old store can flag a loss first
    /// [default: 3000].
    #[arg(long, env = "LOCKBROKER_STORE_SETTLE_MS", value_name = "MS")]
    pub store_settle_ms: Option<u64>,
    /// Log format [default: text].
    #[arg(long, env = "LOCKBROKER_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Log filter, as tracing's EnvFilter reads it [default: info].
    #[arg(long, env = "LOCKBROKER_LOG_LEVEL", value_name = "FILTER")]
    pub log_level: Option<String>,
}

/// The config file: the same keys as the flags, all optional. Unknown keys are an error, so a
/// misspelt key does not silently fall back to its default.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<String>,
    pub redis_url: Option<String>,
    pub key_prefix: Option<String>,
    pub default_ttl_ms: Option<u64>,
    pub max_ttl_ms: Option<u64>,
    pub default_wait_ms: Option<u64>,
    pub max_wait_ms: Option<u64>,
    pub store_timeout_ms: Option<u64>,
    pub max_waiters: Option<usize>,
    pub store_loss_delay_ms: Option<u64>,
    pub store_settle_ms: Option<u64>,
    pub log_format: Option<LogFormat>,
    pub log_level: Option<String>,
}

/// The broker's settings, resolved and valid.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    /// `None`: the embedded in-memory store.
    pub redis_url: Option<String>,
    pub key_prefix: String,
    pub default_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub default_wait_ms: u64,
    pub max_wait_ms: u64,
    pub store_timeout_ms: u64,
    pub max_waiters: usize,
    /// After Redis is seen to have lost its data, how long nothing is granted.
    pub store_loss_delay_ms: u64,
    /// When Redis has no incarnation marker (new, or it lost its data), how long nothing is
    /// granted, so that brokers that knew the old store can flag a loss first.
    pub store_settle_ms: u64,
    pub log_format: LogFormat,
    pub log_level: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            redis_url: None,
            key_prefix: "lockbroker:".into(),
            default_ttl_ms: 30_000,
            max_ttl_ms: 3_600_000,
            default_wait_ms: 0,
            max_wait_ms: 60_000,
            store_timeout_ms: 2_000,
            max_waiters: 10_000,
            store_loss_delay_ms: 0,
            store_settle_ms: 3_000,
            log_format: LogFormat::Text,
            log_level: "info".into(),
        }
    }
}

/// Longest lease a broker may be configured to allow: a day. Longer leases are a sign of a
/// lock used as a flag, and keep a key blocked for that long when a holder dies.
const MAX_TTL_CEILING_MS: u64 = 86_400_000;

impl Config {
    /// Reads the config file named by the flags or the environment, if any, and resolves.
    pub fn load(args: ServeArgs) -> anyhow::Result<Self> {
        let file = match &args.config {
            None => FileConfig::default(),
            Some(path) => read_file(path)?,
        };
        Self::resolve(args, file)
    }

    /// Layers the (already environment-merged) flags over the file over the defaults.
    pub fn resolve(args: ServeArgs, file: FileConfig) -> anyhow::Result<Self> {
        let d = Self::default();
        let listen = match args.listen.or(file.listen) {
            None => d.listen,
            Some(s) => s.parse().with_context(|| {
                format!("listen: {s:?} is not an address such as 127.0.0.1:8080")
            })?,
        };
        let max_ttl_ms = args.max_ttl_ms.or(file.max_ttl_ms).unwrap_or(d.max_ttl_ms);
        let config = Self {
            listen,
            redis_url: args
                .redis_url
                .or(file.redis_url)
                .filter(|u| !u.trim().is_empty()),
            key_prefix: args.key_prefix.or(file.key_prefix).unwrap_or(d.key_prefix),
            default_ttl_ms: args
                .default_ttl_ms
                .or(file.default_ttl_ms)
                .unwrap_or(d.default_ttl_ms),
            max_ttl_ms,
            default_wait_ms: args
                .default_wait_ms
                .or(file.default_wait_ms)
                .unwrap_or(d.default_wait_ms),
            max_wait_ms: args
                .max_wait_ms
                .or(file.max_wait_ms)
                .unwrap_or(d.max_wait_ms),
            store_timeout_ms: args
                .store_timeout_ms
                .or(file.store_timeout_ms)
                .unwrap_or(d.store_timeout_ms),
            max_waiters: args
                .max_waiters
                .or(file.max_waiters)
                .unwrap_or(d.max_waiters),
            store_loss_delay_ms: args
                .store_loss_delay_ms
                .or(file.store_loss_delay_ms)
                .unwrap_or(0),
            store_settle_ms: args
                .store_settle_ms
                .or(file.store_settle_ms)
                .unwrap_or(d.store_settle_ms),
            log_format: args.log_format.or(file.log_format).unwrap_or(d.log_format),
            log_level: args.log_level.or(file.log_level).unwrap_or(d.log_level),
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
        if self.store_loss_delay_ms < self.max_ttl_ms {
            tracing::warn!(
                "store_loss_delay_ms ({}) is shorter than max_ttl_ms ({}): after Redis loses its \
                 data, a lease it forgot may still be live when its key is granted again",
                self.store_loss_delay_ms,
                self.max_ttl_ms
            );
        }
        if self.max_waiters == 0 {
            bail!("max_waiters must be at least 1");
        }
        if self.key_prefix.contains(['{', '}']) {
            bail!("key_prefix must not contain braces: they would break the per-lock hash tag");
        }
        if let Some(url) = &self.redis_url {
            redis::Client::open(url.as_str())
                .with_context(|| "redis_url is not a valid Redis URL")?;
        }
        tracing_subscriber::EnvFilter::try_new(&self.log_level)
            .with_context(|| format!("log_level {:?} is not a valid filter", self.log_level))?;
        Ok(())
    }

    pub fn store_timeout(&self) -> Duration {
        Duration::from_millis(self.store_timeout_ms)
    }

    /// The Redis URL with any password masked, for logs.
    pub fn redis_url_for_logs(&self) -> Option<String> {
        let url = self.redis_url.as_ref()?;
        Some(match (url.find("://"), url.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                format!("{}://***@{}", &url[..scheme], &url[at + 1..])
            }
            _ => url.clone(),
        })
    }
}

fn read_file(path: &Path) -> anyhow::Result<FileConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("the config file {} is invalid", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_the_file_which_beats_the_defaults() {
        let file: FileConfig = toml::from_str(
            "listen = \"127.0.0.1:9000\"\ndefault_ttl_ms = 5000\nmax_wait_ms = 1000\n",
        )
        .unwrap();
        let args = ServeArgs {
            listen: Some("127.0.0.1:9100".into()),
            ..ServeArgs::default()
        };
        let config = Config::resolve(args, file).unwrap();
        assert_eq!(config.listen.port(), 9100);
        assert_eq!(config.default_ttl_ms, 5000);
        assert_eq!(config.max_wait_ms, 1000);
        assert_eq!(config.max_ttl_ms, 3_600_000);
        assert!(config.redis_url.is_none());
    }

    #[test]
    fn unknown_file_keys_and_inconsistent_bounds_are_refused() {
        assert!(toml::from_str::<FileConfig>("default_ttl = 5").is_err());
        let args = ServeArgs {
            default_ttl_ms: Some(10),
            max_ttl_ms: Some(5),
            ..ServeArgs::default()
        };
        assert!(Config::resolve(args, FileConfig::default()).is_err());
        let args = ServeArgs {
            key_prefix: Some("a{b".into()),
            ..ServeArgs::default()
        };
        assert!(Config::resolve(args, FileConfig::default()).is_err());
    }

    #[test]
    fn the_documented_config_file_parses_and_matches_the_defaults() {
        let text = include_str!("../config/lockbroker.toml");
        let file: FileConfig = toml::from_str(text).unwrap();
        let config = Config::resolve(ServeArgs::default(), file).unwrap();
        let d = Config::default();
        assert_eq!(config.listen, d.listen);
        assert_eq!(config.default_ttl_ms, d.default_ttl_ms);
        assert_eq!(config.max_ttl_ms, d.max_ttl_ms);
        assert_eq!(config.max_wait_ms, d.max_wait_ms);
        assert_eq!(config.store_timeout_ms, d.store_timeout_ms);
        assert_eq!(config.max_waiters, d.max_waiters);
    }

    #[test]
    fn passwords_are_masked_in_logged_urls() {
        let config = Config {
            redis_url: Some("redis://user:secret@10.0.0.1:6379/0".into()),
            ..Config::default()
        };
        assert_eq!(
            config.redis_url_for_logs().unwrap(),
            "redis://***@10.0.0.1:6379/0"
        );
    }
}
