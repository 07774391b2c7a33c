//! The declaration of every setting, once: its type, its default and its documentation, from
//! which the flag of `lockbroker serve` (`--default-ttl-ms`), the environment variable
//! (`LOCKBROKER_DEFAULT_TTL_MS`) and the config file's key (`default_ttl_ms`) all follow. The
//! variable's name is written out, as clap wants a literal, and a test holds it to the rule.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

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

/// A setting's value once defaults are applied: the type itself when it has a default,
/// optional when it has none.
macro_rules! value_type {
    ($ty:ident) => { Option<$ty> };
    ($ty:ident, $default:expr) => { $ty };
}

/// A setting's value from its layered option: the default fills a gap, when there is one.
macro_rules! value_of {
    ($given:expr) => {
        $given
    };
    ($given:expr, $default:expr) => {
        $given.unwrap_or_else(|| $default)
    };
}

/// Declares every setting once (`name: Type = default;`, or `name: Type;` for one that may be
/// absent): the options one source gives ([`Settings`]), how a higher source layers over a
/// lower one, and the values with the defaults applied ([`Values`]).
// The type is an identifier (every setting's is), so that clap's derive, which reads the field's
// type to tell an optional value, sees exactly the `Option<T>` it would see written by hand.
macro_rules! settings {
    ($(
        $(#[$attr:meta])*
        $name:ident: $ty:ident $(= $default:expr)?;
    )*) => {
        /// The settings one source gives, all optional: `lockbroker serve`'s flags, or the config
        /// file, whose keys are the flags' names. Clap reads a flag from its environment variable
        /// when the flag is absent; a flag beats the environment, which beats the file, which
        /// beats the default. Unknown keys in the file are an error, so a misspelt key does not
        /// silently fall back to its default.
        ///
        /// No `Debug`: it holds the Redis URL as given, password and all.
        #[derive(Clone, Default, Args, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct Settings {
            $(
                $(#[$attr])*
                pub $name: Option<$ty>,
            )*
        }

        /// Every setting's value, the defaults applied; not yet validated.
        pub(super) struct Values {
            $(pub(super) $name: value_type!($ty $(, $default)?),)*
        }

        impl Settings {
            /// These settings over `lower`: each one given here wins, the rest come from `lower`.
            pub(super) fn or(self, lower: Self) -> Self {
                Self {
                    $($name: self.$name.or(lower.$name),)*
                }
            }

            /// The values, each setting not given taking its default.
            pub(super) fn values(self) -> Values {
                Values {
                    $($name: value_of!(self.$name $(, $default)?),)*
                }
            }
        }
    };
}

settings! {
    /// Address to listen on [default: 127.0.0.1:8080].
    #[arg(long, env = "LOCKBROKER_LISTEN", value_name = "ADDR")]
    listen: String = String::from("127.0.0.1:8080");
    /// Redis to keep locks in (redis://user:pass@host:port/db, user and password optional).
    /// Without it, the embedded in-memory store: correct for one broker, not shared between
    /// brokers.
    #[arg(long, env = "LOCKBROKER_REDIS_URL", value_name = "URL")]
    redis_url: String;
    /// Prefix of every Redis key the broker writes [default: lockbroker:].
    #[arg(long, env = "LOCKBROKER_KEY_PREFIX", value_name = "PREFIX")]
    key_prefix: String = String::from("lockbroker:");
    /// Lease length when a request gives no ttl_ms [default: 30000].
    #[arg(long, env = "LOCKBROKER_DEFAULT_TTL_MS", value_name = "MS")]
    default_ttl_ms: u64 = 30_000;
    /// Longest lease a request may ask for [default: 3600000].
    #[arg(long, env = "LOCKBROKER_MAX_TTL_MS", value_name = "MS")]
    max_ttl_ms: u64 = 3_600_000;
    /// Wait when a request gives no wait_ms [default: 0].
    #[arg(long, env = "LOCKBROKER_DEFAULT_WAIT_MS", value_name = "MS")]
    default_wait_ms: u64 = 0;
    /// Longest wait a request may ask for [default: 60000].
    #[arg(long, env = "LOCKBROKER_MAX_WAIT_MS", value_name = "MS")]
    max_wait_ms: u64 = 60_000;
    /// Bound on one store call, connecting included [default: 2000].
    #[arg(long, env = "LOCKBROKER_STORE_TIMEOUT_MS", value_name = "MS")]
    store_timeout_ms: u64 = 2_000;
    /// Most acquires and watches that may wait on this broker at once [default: 10000].
    #[arg(long, env = "LOCKBROKER_MAX_WAITERS", value_name = "N")]
    max_waiters: usize = 10_000;
    /// Paranoid option: after a detected store loss, hold every grant until this long after it,
    /// so that even leases granted by brokers that died before the loss have ended
    /// [default: 0, off: brokers put their live leases back instead].
    #[arg(long, env = "LOCKBROKER_STORE_LOSS_DELAY_MS", value_name = "MS")]
    store_loss_delay_ms: u64 = 0;
    /// How long a new store epoch (a new or emptied Redis, a restart, a failover) holds every
    /// grant, so that every running broker puts its live leases back first [default: 3000].
    #[arg(long, env = "LOCKBROKER_STORE_SETTLE_MS", value_name = "MS")]
    store_settle_ms: u64 = 3_000;
    /// CA certificate (PEM) that Redis's TLS certificate must chain to, for rediss:// URLs
    /// [default: the system's roots].
    #[arg(long, env = "LOCKBROKER_REDIS_TLS_CA", value_name = "FILE")]
    redis_tls_ca: PathBuf;
    /// Client certificate (PEM) to present to Redis over TLS; needs --redis-tls-key.
    #[arg(long, env = "LOCKBROKER_REDIS_TLS_CERT", value_name = "FILE")]
    redis_tls_cert: PathBuf;
    /// Private key (PEM) of --redis-tls-cert.
    #[arg(long, env = "LOCKBROKER_REDIS_TLS_KEY", value_name = "FILE")]
    redis_tls_key: PathBuf;
    /// Answer a grant or renew only once this many replicas have it (Redis WAIT); if they do
    /// not within store_timeout_ms, the lease is released and the request answers 503
    /// [default: 0].
    #[arg(long, env = "LOCKBROKER_REDIS_REPLICA_ACKS", value_name = "N")]
    redis_replica_acks: u32 = 0;
    /// Group commit: the most claims and releases one Redis script call carries when they come
    /// while another call is in flight (1 to 1024; 1: every call alone) [default: 64].
    #[arg(long, env = "LOCKBROKER_REDIS_BATCH", value_name = "N")]
    redis_batch: u32 = 64;
    /// Log format [default: text].
    #[arg(long, env = "LOCKBROKER_LOG_FORMAT", value_name = "FORMAT")]
    log_format: LogFormat = LogFormat::Text;
    /// Log filter, as tracing's EnvFilter reads it [default: info].
    #[arg(long, env = "LOCKBROKER_LOG_LEVEL", value_name = "FILTER")]
    log_level: String = String::from("info");
    /// Auth file (TOML: named bearer tokens with key prefixes and permissions). Without it,
    /// every client may do everything. Read again on SIGHUP and when it changes.
    #[arg(long, env = "LOCKBROKER_AUTH_FILE", value_name = "FILE")]
    auth_file: PathBuf;
    /// With an auth file, /metrics and /openapi.json need a token too ("admin", or "read" on
    /// every key) [default: false].
    #[arg(
        long,
        env = "LOCKBROKER_AUTH_METRICS",
        value_name = "BOOL",
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    auth_metrics: bool = false;
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
    allow_force_release: bool = false;
    /// Serve HTTPS with this certificate chain (PEM); needs --tls-key. Read again on SIGHUP and
    /// when it changes.
    #[arg(long, env = "LOCKBROKER_TLS_CERT", value_name = "FILE")]
    tls_cert: PathBuf;
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "LOCKBROKER_TLS_KEY", value_name = "FILE")]
    tls_key: PathBuf;
    /// Require client certificates signed by this CA (PEM): mutual TLS.
    #[arg(long, env = "LOCKBROKER_TLS_CLIENT_CA", value_name = "FILE")]
    tls_client_ca: PathBuf;
    /// A client must send a whole request head within this (and, between requests on a
    /// kept-alive connection, the next one) or be disconnected [default: 10000].
    #[arg(long, env = "LOCKBROKER_HEADER_TIMEOUT_MS", value_name = "MS")]
    header_timeout_ms: u64 = 10_000;
    /// Most connections open at once; later ones wait in the kernel's queue [default: 10000].
    #[arg(long, env = "LOCKBROKER_MAX_CONNECTIONS", value_name = "N")]
    max_connections: usize = 10_000;
    /// Connections the kernel may hold queued, not yet taken by the broker (past
    /// max_connections, or in a burst); the kernel caps it at its own maximum
    /// (net.core.somaxconn on Linux) [default: 1024].
    #[arg(long, env = "LOCKBROKER_LISTEN_BACKLOG", value_name = "N")]
    listen_backlog: u32 = 1024;
}
