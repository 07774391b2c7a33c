//! The client side of the same binary: a small typed HTTP client for the broker's API
//! ([`BrokerClient`]), the `acquire`, `release`, `renew`, `status` and `list` commands
//! ([`commands`]), `lockbroker run` ([`run`]), which holds a lock (or a shared lease, or a
//! semaphore's permit) for as long as a command runs, and `lockbroker bench` ([`bench`]), a load
//! generator that measures a running broker.
//!
//! Every lock command returns an exit code from [`exit`], so that a shell script can branch on
//! "held by someone else" apart from "something went wrong".

mod args;
pub mod bench;
pub mod commands;
#[cfg(unix)]
pub mod run;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use reqwest::StatusCode;
use serde::{Deserialize, Serialize};

pub use self::args::{
    ClaimArgs, TargetArgs, format_ms, parse_duration, parse_key, parse_limit, parse_owner,
    parse_prefix, parse_request_id, parse_token, parse_ttl,
};
use crate::domain::{LockKey, Owner, RequestId, Token, millis};

/// The exit codes of the client commands. `--help` of each command lists them (see
/// [`EXIT_CODES_HELP`]).
pub mod exit {
    /// Done.
    pub const OK: u8 = 0;
    /// An error: the broker could not be reached, refused the request (400, 403, a semaphore's
    /// `limit_mismatch`), answered 5xx, or answered something unexpected.
    pub const ERROR: u8 = 1;
    /// A usage error, from clap: unknown flag, missing argument, or a value that can never be
    /// valid (a bad key, duration, owner or request id).
    pub const USAGE: u8 = 2;
    /// Someone else holds the lock, or every permit of the semaphore is taken, and the wait ran
    /// out (`acquire`, `run`).
    pub const LOCKED: u8 = 3;
    /// Nobody holds the lock with this token: `release` and `renew` of a lease that ended or
    /// was taken over (`not_held`, `not_owner`), `status` of a free lock or semaphore, and
    /// `release --force` of one.
    pub const NOT_HELD: u8 = 4;
    /// `run` only: the lease was lost while the command ran, and the command was stopped.
    pub const LEASE_LOST: u8 = 5;
    /// `run` only: the command was found but could not be started (as a shell does).
    pub const CANNOT_EXECUTE: u8 = 126;
    /// `run` only: the command was not found (as a shell does).
    pub const NOT_FOUND: u8 = 127;
}

/// The exit-code table shown at the end of each client command's `--help`.
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
  0    done
  1    error: broker unreachable, request refused (400, 403, limit_mismatch), 5xx,
       unexpected answer
  2    usage error (bad flag, key, duration, owner, request id or limit)
  3    locked: someone else holds the lock (every permit of the semaphore is taken) and
       the wait ran out
  4    not held: the lock or semaphore is free, or this token no longer holds it
       (not_held, not_owner)";

/// The exit-code table at the end of `lockbroker run --help`.
pub const RUN_EXIT_CODES_HELP: &str = "\
Exit codes:
  N      the command ran and exited with status N (0 included)
  128+S  the command died of signal S (143 for SIGTERM)
  1      error before the command started: broker unreachable, request refused (400,
         403, limit_mismatch: the semaphore's holders use another --limit), 5xx
  2      usage error (bad flag, key, duration, owner or limit; no command after --)
  3      locked: someone else holds the lock (every permit of the semaphore is taken) and
         the wait ran out; the command did not run
  5      the lease was lost while the command ran (a renewal answered not_held or
         not_owner, or the broker stayed unreachable until the lease ended); the command
         got SIGTERM, then SIGKILL after --grace
  126    the command could not be started
  127    the command was not found
A command's own statuses 1, 3 and 5 look the same as run's; a job that must tell them apart
should not exit with those.";

/// Bound on one request that does not wait for a lock: well above the broker's own bound on a
/// store call (2 s by default), so only a broker that is stuck or gone trips it.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Bound on opening a connection to the broker.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How to reach a broker beyond its URL: a bearer token for a broker with an auth file, and the
/// TLS files for an `https://` one. Shared by every client command and `bench`. `Debug` shows no
/// token.
#[derive(Clone, Default, Args)]
pub struct ConnectArgs {
    /// Bearer token, for a broker with an auth file (sent as `Authorization: Bearer`). The
    /// environment keeps it out of `ps`. (`--token` is the lock's own token.)
    #[arg(
        long,
        env = "LOCKBROKER_AUTH_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub auth_token: Option<String>,
    /// CA certificate (PEM) to trust for an https:// broker, besides the system's roots.
    #[arg(long, env = "LOCKBROKER_CACERT", value_name = "FILE")]
    pub cacert: Option<PathBuf>,
    /// Client certificate (PEM), for a broker that requires one (mutual TLS); with
    /// --client-key.
    #[arg(long, env = "LOCKBROKER_CLIENT_CERT", value_name = "FILE")]
    pub client_cert: Option<PathBuf>,
    /// The private key (PEM) of --client-cert.
    #[arg(long, env = "LOCKBROKER_CLIENT_KEY", value_name = "FILE")]
    pub client_key: Option<PathBuf>,
}

impl fmt::Debug for ConnectArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectArgs")
            .field("auth_token", &self.auth_token.as_ref().map(|_| "***"))
            .field("cacert", &self.cacert)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .finish()
    }
}

impl ConnectArgs {
    /// `builder` with the bearer token as a default header (marked sensitive) and the TLS
    /// files. Errors say which file or value is unusable.
    pub fn apply(&self, builder: reqwest::ClientBuilder) -> Result<reqwest::ClientBuilder, String> {
        let mut builder = builder;
        if let Some(token) = &self.auth_token {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| "--auth-token must be printable ASCII".to_owned())?;
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder = builder.default_headers(headers);
        }
        let read = |path: &PathBuf, what: &str| {
            std::fs::read(path).map_err(|e| format!("cannot read {what} {}: {e}", path.display()))
        };
        if let Some(path) = &self.cacert {
            let pem = read(path, "--cacert")?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("--cacert {}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!(
                    "--cacert {}: no PEM certificate in it",
                    path.display()
                ));
            }
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        match (&self.client_cert, &self.client_key) {
            (None, None) => {}
            (Some(cert), Some(key)) => {
                let mut pem = read(cert, "--client-cert")?;
                pem.push(b'\n');
                pem.extend(read(key, "--client-key")?);
                let identity = reqwest::Identity::from_pem(&pem)
                    .map_err(|e| format!("--client-cert and --client-key: {e}"))?;
                builder = builder.identity(identity);
            }
            _ => return Err("--client-cert and --client-key go together".to_owned()),
        }
        Ok(builder)
    }
}

/// The broker's two key spaces: a lock and a semaphore of the same name are unrelated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// `/locks/{key}`: exclusive and shared leases.
    Locks,
    /// `/semaphores/{key}`: permits.
    Semaphores,
}

impl Space {
    /// The first segment of the API's paths for this space.
    fn path(self) -> &'static str {
        match self {
            Self::Locks => "locks",
            Self::Semaphores => "semaphores",
        }
    }
}

/// A lock or a semaphore, by name: what release, renew, status and force release work on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    pub space: Space,
    pub key: LockKey,
}

impl fmt::Display for Resource {
    /// A lock as its bare key (as the messages always named it), a semaphore as
    /// `semaphore NAME`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.space {
            Space::Locks => write!(f, "{}", self.key),
            Space::Semaphores => write!(f, "semaphore {}", self.key),
        }
    }
}

/// The most permits a semaphore can have, as the API bounds `limit`.
pub const MAX_SEMAPHORE_LIMIT: u32 = 10_000;

/// What an acquire asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// An exclusive lease on a lock: the only holder.
    Exclusive(LockKey),
    /// A shared lease on a lock: held together with other shared leases, never with an
    /// exclusive one.
    Shared(LockKey),
    /// One of `limit` permits of a semaphore (1 ..= [`MAX_SEMAPHORE_LIMIT`]).
    Permit { semaphore: LockKey, limit: u32 },
}

impl Claim {
    /// What the lease is on, for renewing and releasing it.
    pub fn resource(&self) -> Resource {
        match self {
            Self::Exclusive(key) | Self::Shared(key) => Resource {
                space: Space::Locks,
                key: key.clone(),
            },
            Self::Permit { semaphore, .. } => Resource {
                space: Space::Semaphores,
                key: semaphore.clone(),
            },
        }
    }

    /// `exclusive`, `shared` or `semaphore`: the word `bench --mode` and `run`'s
    /// `LOCKBROKER_MODE` use.
    pub fn mode(&self) -> &'static str {
        match self {
            Self::Exclusive(_) => "exclusive",
            Self::Shared(_) => "shared",
            Self::Permit { .. } => "semaphore",
        }
    }

    /// The query parameters that pick the kind of lease. An exclusive lease sends none: it is
    /// the API's default, and so a broker that predates shared leases takes it as before.
    fn query(&self) -> Vec<(&'static str, String)> {
        match self {
            Self::Exclusive(_) => Vec::new(),
            Self::Shared(_) => vec![("mode", "shared".to_owned())],
            Self::Permit { limit, .. } => vec![("limit", limit.to_string())],
        }
    }
}

/// A grant, as acquire (`201`) and renew (`200`) answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub key: String,
    pub token: String,
    pub fence: u64,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    /// A semaphore's permits; absent for a lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// How a lock is held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LockMode {
    /// By one holder; the default, and what a broker that does not say means.
    #[default]
    Exclusive,
    /// By one or more shared holders.
    Shared,
}

impl fmt::Display for LockMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Exclusive => "exclusive",
            Self::Shared => "shared",
        })
    }
}

/// One lease among several: a shared lock's holder, or a semaphore's. Never the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub fence: u64,
    pub expires_at_ms: u64,
    pub ttl_remaining_ms: u64,
    pub owner: Option<String>,
}

/// A lock's state, as `GET /locks/{key}` shows it. Never the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockStatus {
    pub key: String,
    #[serde(default)]
    pub mode: LockMode,
    pub fence: u64,
    pub expires_at_ms: u64,
    pub ttl_remaining_ms: u64,
    pub owner: Option<String>,
    /// Every shared holder; absent for an exclusive lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holders: Option<Vec<Holder>>,
}

/// A semaphore's state, as `GET /semaphores/{key}` shows it. Never a token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SemaphoreStatus {
    pub key: String,
    pub limit: u32,
    pub holders: Vec<Holder>,
}

/// A held lock, as `GET /locks` lists it. Never the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockEntry {
    pub key: String,
    #[serde(default)]
    pub mode: LockMode,
    pub fence: u64,
    pub expires_at_ms: u64,
    pub ttl_remaining_ms: u64,
    pub owner: Option<String>,
}

/// A semaphore with holders, as `GET /semaphores` lists it: how many, the highest fence and the
/// latest end among them. Never a token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SemaphoreEntry {
    pub key: String,
    pub limit: u32,
    pub holders: u64,
    pub fence: u64,
    pub expires_at_ms: u64,
    pub ttl_remaining_ms: u64,
}

/// One page of a listing; `next_cursor` asks for the next one, `None` after the last.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Page<T> {
    /// `locks` or `semaphores` in the API's body.
    #[serde(alias = "locks", alias = "semaphores")]
    pub items: Vec<T>,
    pub next_cursor: Option<String>,
}

/// The most entries one page of a listing may ask for (the API's bound on `limit`).
pub const MAX_PAGE: u32 = 1000;

/// What an acquire asks for. `None` leaves a parameter to the broker's default.
#[derive(Debug, Clone, Default)]
pub struct AcquireParams {
    pub ttl: Option<Duration>,
    pub wait: Option<Duration>,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
}

/// Why a call did not give what was asked. The first four are the answers a caller branches
/// on; the others are failures. `space` says whether a lock or a semaphore answered, for the
/// message.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// `409 locked`: someone else holds the lock, or every permit of the semaphore is taken,
    /// and the wait ran out.
    #[error("{}{}", locked_words(*.space), retry_hint(*.space, *.retry_after_ms))]
    Locked {
        space: Space,
        retry_after_ms: Option<u64>,
    },
    /// `404 not_held`: nobody holds the lock (or this permit).
    #[error("{}", not_held_words(*.space))]
    NotHeld { space: Space },
    /// `409 not_owner`: someone else holds the lock; this token's lease has ended.
    #[error("{}", not_owner_words(*.space))]
    NotOwner { space: Space },
    /// `409 limit_mismatch`: the semaphore's holders took their permits with another limit.
    #[error(
        "its holders use {}; every holder of a semaphore must give the same --limit",
        limit.map_or_else(|| format!("another limit ({message})"), |n| format!("--limit {n}"))
    )]
    LimitMismatch { limit: Option<u32>, message: String },
    /// Any other error answer: `400 invalid_request`, `503 store_unavailable`, a proxy's 502...
    #[error("the broker answered {status} {code}: {message}")]
    Api {
        status: StatusCode,
        code: String,
        message: String,
    },
    /// No answer: the connection was refused or reset, or the request timed out.
    #[error("cannot reach the broker at {url}: {reason}")]
    Transport { url: String, reason: String },
    /// A success status with a body that is not what the API promises.
    #[error("the broker's answer could not be read: {0}")]
    BadResponse(String),
}

fn locked_words(space: Space) -> &'static str {
    match space {
        Space::Locks => "the lock is held by someone else",
        Space::Semaphores => "every permit is taken",
    }
}

fn not_held_words(space: Space) -> &'static str {
    match space {
        Space::Locks => "nobody holds the lock (it was released, or its lease expired)",
        Space::Semaphores => "this permit is not held (it was released, or its lease expired)",
    }
}

fn not_owner_words(space: Space) -> &'static str {
    match space {
        Space::Locks => "someone else holds the lock now; this token's lease has ended",
        Space::Semaphores => "this token holds no permit now; its lease has ended",
    }
}

fn retry_hint(space: Space, retry_after_ms: Option<u64>) -> String {
    retry_after_ms.map_or_else(String::new, |ms| match space {
        Space::Locks => format!("; its lease ends in {}", format_ms(ms)),
        Space::Semaphores => format!("; the next one frees in {}", format_ms(ms)),
    })
}

impl ClientError {
    /// The exit code a command ends with after this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Locked { .. } => exit::LOCKED,
            Self::NotHeld { .. } | Self::NotOwner { .. } => exit::NOT_HELD,
            Self::LimitMismatch { .. }
            | Self::Api { .. }
            | Self::Transport { .. }
            | Self::BadResponse(_) => exit::ERROR,
        }
    }

    /// Whether the same request may succeed later: no answer, or a 5xx (the store was
    /// unavailable, the broker was shutting down, a proxy found no broker).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Transport { .. } => true,
            Self::Api { status, .. } => status.is_server_error(),
            _ => false,
        }
    }

    /// The API's error code for this error; `unreachable` and `bad_response` for the two that
    /// have no answer to take one from.
    pub fn code(&self) -> &str {
        match self {
            Self::Locked { .. } => "locked",
            Self::NotHeld { .. } => "not_held",
            Self::NotOwner { .. } => "not_owner",
            Self::LimitMismatch { .. } => "limit_mismatch",
            Self::Api { code, .. } => code,
            Self::Transport { .. } => "unreachable",
            Self::BadResponse(_) => "bad_response",
        }
    }

    /// The error as one JSON object in the API's format, for `--json`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut body = serde_json::json!({ "error": self.code(), "message": self.to_string() });
        match self {
            Self::Locked {
                retry_after_ms: Some(ms),
                ..
            } => body["retry_after_ms"] = (*ms).into(),
            Self::LimitMismatch {
                limit: Some(limit), ..
            } => body["limit"] = (*limit).into(),
            _ => {}
        }
        body
    }
}

/// The API's error body; every field optional, since a proxy in front may answer otherwise.
#[derive(Deserialize)]
struct ErrorBody {
    error: Option<String>,
    message: Option<String>,
    retry_after_ms: Option<u64>,
    /// `limit_mismatch`: the limit the semaphore's holders use.
    limit: Option<u32>,
}

/// A client for one broker (or one load balancer in front of several).
#[derive(Debug, Clone)]
pub struct BrokerClient {
    http: reqwest::Client,
    /// The URL without a trailing `/`.
    base: String,
}

impl BrokerClient {
    /// A client for the broker at `url` (`http://host:port` or `https://…`, optionally with a
    /// path prefix), with no token and the system's CA roots.
    pub fn new(url: &str) -> Result<Self, String> {
        Self::connect(url, &ConnectArgs::default())
    }

    /// A client for the broker at `url`, with `connect`'s token and TLS files.
    pub fn connect(url: &str, connect: &ConnectArgs) -> Result<Self, String> {
        let parsed = reqwest::Url::parse(url).map_err(|e| {
            format!("{url:?} is not a URL ({e}); give one like http://127.0.0.1:8080")
        })?;
        match parsed.scheme() {
            "http" | "https" => {}
            other => {
                return Err(format!(
                    "{url}: unsupported scheme {other:?}; use http:// or https://"
                ));
            }
        }
        let http = connect
            .apply(reqwest::Client::builder().connect_timeout(CONNECT_TIMEOUT))?
            .build()
            .map_err(|e| format!("cannot set up the HTTP client: {e}"))?;
        Ok(Self {
            http,
            base: url.trim_end_matches('/').to_owned(),
        })
    }

    /// The broker's URL, as given.
    pub fn url(&self) -> &str {
        &self.base
    }

    fn resource_url(&self, resource: &Resource) -> String {
        // The key's alphabet (A-Z a-z 0-9 . _ - :) needs no escaping in a path segment.
        format!(
            "{}/{}/{}",
            self.base,
            resource.space.path(),
            resource.key.as_str()
        )
    }

    /// `POST /locks/{key}` (`?mode=shared` for a shared lease) or
    /// `POST /semaphores/{key}?limit=N`. Waits up to `params.wait` (the broker's default when
    /// `None`) for a holder to let go.
    pub async fn acquire(
        &self,
        claim: &Claim,
        params: &AcquireParams,
    ) -> Result<Grant, ClientError> {
        #[derive(Serialize)]
        struct Body<'a> {
            #[serde(skip_serializing_if = "Option::is_none")]
            ttl_ms: Option<u64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            wait_ms: Option<u64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            owner: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            request_id: Option<&'a str>,
        }
        let body = Body {
            ttl_ms: params.ttl.map(millis),
            wait_ms: params.wait.map(millis),
            owner: params.owner.as_ref().map(Owner::as_str),
            request_id: params.request_id.as_ref().map(RequestId::as_str),
        };
        let resource = claim.resource();
        let request = self
            .http
            .post(self.resource_url(&resource))
            .query(&claim.query())
            .json(&body)
            .timeout(params.wait.unwrap_or_default() + REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::CREATED, resource.space).await
    }

    /// `DELETE /locks/{key}` (or `/semaphores/{key}`), the token in the `Lock-Token` header.
    pub async fn release(&self, resource: &Resource, token: &Token) -> Result<(), ClientError> {
        let request = self
            .http
            .delete(self.resource_url(resource))
            .header("Lock-Token", token.as_str())
            .timeout(REQUEST_TIMEOUT);
        expect_no_content(self.send(request).await?, resource.space).await
    }

    /// `DELETE /locks/{key}?force=true` (or `/semaphores/{key}`): ends every lease on it,
    /// without a token. The broker allows it to an `admin` token, or with auth off only when it
    /// runs with `--allow-force-release`; otherwise `403 forbidden`.
    pub async fn force_release(&self, resource: &Resource) -> Result<(), ClientError> {
        let request = self
            .http
            .delete(self.resource_url(resource))
            .query(&[("force", "true")])
            .timeout(REQUEST_TIMEOUT);
        expect_no_content(self.send(request).await?, resource.space).await
    }

    /// `POST /locks/{key}/renew` (or `/semaphores/{key}/renew`): the lease then ends `ttl` from
    /// now (the broker's default TTL when `None`).
    pub async fn renew(
        &self,
        resource: &Resource,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Grant, ClientError> {
        let mut request = self
            .http
            .post(format!("{}/renew", self.resource_url(resource)))
            .header("Lock-Token", token.as_str())
            .timeout(REQUEST_TIMEOUT);
        if let Some(ttl) = ttl {
            request = request.json(&serde_json::json!({ "ttl_ms": millis(ttl) }));
        }
        let response = self.send(request).await?;
        expect_json(response, StatusCode::OK, resource.space).await
    }

    /// `GET /locks/{key}`.
    pub async fn status(&self, key: &LockKey) -> Result<LockStatus, ClientError> {
        self.read(&Resource {
            space: Space::Locks,
            key: key.clone(),
        })
        .await
    }

    /// `GET /semaphores/{key}`.
    pub async fn semaphore_status(&self, key: &LockKey) -> Result<SemaphoreStatus, ClientError> {
        self.read(&Resource {
            space: Space::Semaphores,
            key: key.clone(),
        })
        .await
    }

    async fn read<T: serde::de::DeserializeOwned>(
        &self,
        resource: &Resource,
    ) -> Result<T, ClientError> {
        let request = self
            .http
            .get(self.resource_url(resource))
            .timeout(REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::OK, resource.space).await
    }

    /// `GET /locks?prefix=&limit=&cursor=`: one page of the held locks whose key starts with
    /// `prefix`, at most `limit` (1 ..= [`MAX_PAGE`]) of them.
    pub async fn list_locks(
        &self,
        prefix: &str,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<Page<LockEntry>, ClientError> {
        self.list(Space::Locks, prefix, limit, cursor).await
    }

    /// `GET /semaphores?prefix=&limit=&cursor=`: as [`Self::list_locks`], for semaphores with
    /// holders.
    pub async fn list_semaphores(
        &self,
        prefix: &str,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<Page<SemaphoreEntry>, ClientError> {
        self.list(Space::Semaphores, prefix, limit, cursor).await
    }

    async fn list<T: serde::de::DeserializeOwned>(
        &self,
        space: Space,
        prefix: &str,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<Page<T>, ClientError> {
        let mut query = vec![("limit", limit.to_string())];
        if !prefix.is_empty() {
            query.push(("prefix", prefix.to_owned()));
        }
        if let Some(cursor) = cursor {
            query.push(("cursor", cursor.to_owned()));
        }
        let request = self
            .http
            .get(format!("{}/{}", self.base, space.path()))
            .query(&query)
            .timeout(REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::OK, space).await
    }

    async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, ClientError> {
        request.send().await.map_err(|e| ClientError::Transport {
            url: self.base.clone(),
            reason: error_chain(&e),
        })
    }
}

/// Reads a success body of type `T` if the status is `expected`, the error otherwise.
async fn expect_json<T: serde::de::DeserializeOwned>(
    response: reqwest::Response,
    expected: StatusCode,
    space: Space,
) -> Result<T, ClientError> {
    if response.status() != expected {
        return Err(error_from(response, space).await);
    }
    let text = response
        .text()
        .await
        .map_err(|e| ClientError::BadResponse(error_chain(&e)))?;
    serde_json::from_str(&text)
        .map_err(|e| ClientError::BadResponse(format!("{e} in {}", excerpt(&text))))
}

/// `Ok` for `204 No Content`, the error otherwise.
async fn expect_no_content(response: reqwest::Response, space: Space) -> Result<(), ClientError> {
    if response.status() == StatusCode::NO_CONTENT {
        Ok(())
    } else {
        Err(error_from(response, space).await)
    }
}

/// Turns an error answer from `space` into a [`ClientError`], keeping the API's code and
/// message.
async fn error_from(response: reqwest::Response, space: Space) -> ClientError {
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    let body: Option<ErrorBody> = serde_json::from_str(&text).ok();
    let code = body.as_ref().and_then(|b| b.error.clone());
    match (status, code.as_deref()) {
        (StatusCode::CONFLICT, Some("locked")) => ClientError::Locked {
            space,
            retry_after_ms: body.and_then(|b| b.retry_after_ms),
        },
        (StatusCode::NOT_FOUND, Some("not_held")) => ClientError::NotHeld { space },
        (StatusCode::CONFLICT, Some("not_owner")) => ClientError::NotOwner { space },
        (StatusCode::CONFLICT, Some("limit_mismatch")) => {
            let body = body.expect("a code came from the body");
            ClientError::LimitMismatch {
                limit: body.limit,
                message: body.message.unwrap_or_else(|| excerpt(&text)),
            }
        }
        _ => ClientError::Api {
            status,
            code: code.unwrap_or_else(|| "unexpected_response".into()),
            message: body
                .and_then(|b| b.message)
                .unwrap_or_else(|| excerpt(&text)),
        },
    }
}

/// An error and its causes on one line: reqwest's own `Display` stops at "error sending
/// request", and the reason (connection refused, timed out) is further down.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The start of a body that was not what was expected, for a message.
fn excerpt(text: &str) -> String {
    let text = text.trim();
    if text.is_empty() {
        return "(empty body)".into();
    }
    let cut: String = text.chars().take(200).collect();
    if cut.len() < text.len() {
        format!("{cut}…")
    } else {
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_has_its_exit_code() {
        for space in [Space::Locks, Space::Semaphores] {
            assert_eq!(
                ClientError::Locked {
                    space,
                    retry_after_ms: None
                }
                .exit_code(),
                exit::LOCKED
            );
            assert_eq!(ClientError::NotHeld { space }.exit_code(), exit::NOT_HELD);
            assert_eq!(ClientError::NotOwner { space }.exit_code(), exit::NOT_HELD);
        }
        let mismatch = ClientError::LimitMismatch {
            limit: Some(3),
            message: "limit 3 in use".into(),
        };
        assert_eq!(mismatch.exit_code(), exit::ERROR);
        assert!(!mismatch.is_transient());
        let unavailable = ClientError::Api {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "store_unavailable".into(),
            message: "down".into(),
        };
        assert_eq!(unavailable.exit_code(), exit::ERROR);
        assert!(unavailable.is_transient());
        let refused = ClientError::Api {
            status: StatusCode::BAD_REQUEST,
            code: "invalid_request".into(),
            message: "bad".into(),
        };
        assert!(!refused.is_transient());
        assert!(
            !ClientError::NotOwner {
                space: Space::Locks
            }
            .is_transient()
        );
    }

    #[test]
    fn messages_name_what_is_taken_locks_as_before_and_permits_for_semaphores() {
        let locked = |space| ClientError::Locked {
            space,
            retry_after_ms: Some(1500),
        };
        assert_eq!(
            locked(Space::Locks).to_string(),
            "the lock is held by someone else; its lease ends in 1s 500ms"
        );
        assert_eq!(
            locked(Space::Semaphores).to_string(),
            "every permit is taken; the next one frees in 1s 500ms"
        );
        assert_eq!(
            ClientError::NotHeld {
                space: Space::Locks
            }
            .to_string(),
            "nobody holds the lock (it was released, or its lease expired)"
        );
        assert_eq!(locked(Space::Semaphores).to_json()["retry_after_ms"], 1500);
    }

    #[test]
    fn a_limit_mismatch_says_which_limit_the_holders_use_when_the_broker_tells() {
        let told = ClientError::LimitMismatch {
            limit: Some(3),
            message: "The semaphore is held with limit 3.".into(),
        };
        assert_eq!(
            told.to_string(),
            "its holders use --limit 3; every holder of a semaphore must give the same --limit"
        );
        assert_eq!(
            told.to_json(),
            serde_json::json!({"error": "limit_mismatch", "message": told.to_string(), "limit": 3})
        );
        let untold = ClientError::LimitMismatch {
            limit: None,
            message: "Another limit is in use.".into(),
        };
        assert!(
            untold
                .to_string()
                .starts_with("its holders use another limit (Another limit is in use.)"),
            "{untold}"
        );
        assert!(untold.to_json().get("limit").is_none());
    }

    #[test]
    fn each_claim_goes_to_its_space_with_its_parameters() {
        let key = LockKey::parse("jobs").unwrap();
        let exclusive = Claim::Exclusive(key.clone());
        assert_eq!(exclusive.resource().space, Space::Locks);
        assert!(exclusive.query().is_empty(), "the API's default, unsaid");
        let shared = Claim::Shared(key.clone());
        assert_eq!(shared.resource().space, Space::Locks);
        assert_eq!(shared.query(), [("mode", "shared".to_owned())]);
        let permit = Claim::Permit {
            semaphore: key.clone(),
            limit: 4,
        };
        assert_eq!(permit.resource().space, Space::Semaphores);
        assert_eq!(permit.query(), [("limit", "4".to_owned())]);
        assert_eq!(permit.resource().to_string(), "semaphore jobs");
        assert_eq!(shared.resource().to_string(), "jobs");
        let client = BrokerClient::new("http://h:1/").unwrap();
        assert_eq!(
            client.resource_url(&permit.resource()),
            "http://h:1/semaphores/jobs"
        );
        assert_eq!(
            client.resource_url(&shared.resource()),
            "http://h:1/locks/jobs"
        );
    }

    #[test]
    fn status_and_list_bodies_read_as_the_api_writes_them() {
        // A broker from before shared leases sends no mode: exclusive.
        let old: LockStatus = serde_json::from_str(
            r#"{"key":"a","fence":1,"expires_at_ms":2,"ttl_remaining_ms":3,"owner":null}"#,
        )
        .unwrap();
        assert_eq!(old.mode, LockMode::Exclusive);
        assert_eq!(old.holders, None);
        let shared: LockStatus = serde_json::from_str(
            r#"{"key":"a","mode":"shared","fence":5,"expires_at_ms":2,"ttl_remaining_ms":3,
                "owner":"x","holders":[{"fence":4,"expires_at_ms":2,"ttl_remaining_ms":3,"owner":null},
                {"fence":5,"expires_at_ms":2,"ttl_remaining_ms":3,"owner":"x"}]}"#,
        )
        .unwrap();
        assert_eq!(shared.mode, LockMode::Shared);
        assert_eq!(shared.holders.as_ref().map(Vec::len), Some(2));
        let page: Page<LockEntry> = serde_json::from_str(
            r#"{"locks":[{"key":"a","mode":"shared","fence":1,"expires_at_ms":2,
                "ttl_remaining_ms":3,"owner":null}],"next_cursor":"c1"}"#,
        )
        .unwrap();
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.next_cursor.as_deref(), Some("c1"));
        let page: Page<SemaphoreEntry> = serde_json::from_str(
            r#"{"semaphores":[{"key":"s","limit":4,"holders":2,"fence":9,"expires_at_ms":2,
                "ttl_remaining_ms":3}],"next_cursor":null}"#,
        )
        .unwrap();
        assert_eq!(page.items[0].holders, 2);
        assert_eq!(page.next_cursor, None);
        // A grant prints as the API gave it: `limit` only for a semaphore's.
        let grant: Grant = serde_json::from_str(
            r#"{"key":"a","token":"t","fence":1,"ttl_ms":2,"expires_at_ms":3}"#,
        )
        .unwrap();
        assert!(serde_json::to_value(&grant).unwrap().get("limit").is_none());
    }

    #[test]
    fn http_and_https_urls_are_accepted() {
        assert!(BrokerClient::new("http://127.0.0.1:8080/").is_ok());
        assert!(BrokerClient::new("https://broker").is_ok());
        assert!(BrokerClient::new("ftp://broker").is_err());
        assert!(BrokerClient::new("127.0.0.1:8080").is_err());
        assert_eq!(
            BrokerClient::new("http://h:1/base/").unwrap().url(),
            "http://h:1/base"
        );
    }
}
