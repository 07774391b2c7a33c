//! The client side of the same binary: a small typed HTTP client for the broker's API
//! ([`BrokerClient`]), the `acquire`, `release`, `renew` and `status` commands ([`commands`]),
//! `lockbroker run` ([`run`]), which holds a lock for as long as a command runs, and
//! `lockbroker bench` ([`bench`]), a load generator that measures a running broker.
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
    format_ms, parse_duration, parse_key, parse_owner, parse_request_id, parse_token, parse_ttl,
};
use crate::domain::{LockKey, Owner, RequestId, Token, millis};

/// The exit codes of the client commands. `--help` of each command lists them (see
/// [`EXIT_CODES_HELP`]).
pub mod exit {
    /// Done.
    pub const OK: u8 = 0;
    /// An error: the broker could not be reached, refused the request (400), answered
    /// 5xx, or answered something unexpected.
    pub const ERROR: u8 = 1;
    /// A usage error, from clap: unknown flag, missing argument, or a value that can never be
    /// valid (a bad key, duration, owner or request id).
    pub const USAGE: u8 = 2;
    /// Someone else holds the lock, and the wait ran out (`acquire`, `run`).
    pub const LOCKED: u8 = 3;
    /// Nobody holds the lock with this token: `release` and `renew` of a lease that ended or
    /// was taken over (`not_held`, `not_owner`), `status` of a free lock.
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
  1    error: broker unreachable, request refused (400), 5xx, unexpected answer
  2    usage error (bad flag, key, duration, owner or request id)
  3    locked: someone else holds the lock and the wait ran out
  4    not held: the lock is free, or this token no longer holds it (not_held, not_owner)";

/// The exit-code table at the end of `lockbroker run --help`.
pub const RUN_EXIT_CODES_HELP: &str = "\
Exit codes:
  N      the command ran and exited with status N (0 included)
  128+S  the command died of signal S (143 for SIGTERM)
  1      error before the command started: broker unreachable, request refused, 5xx
  2      usage error (bad flag, key, duration or owner; no command after --)
  3      locked: someone else holds the lock and the wait ran out; the command did not run
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

/// A grant, as acquire (`201`) and renew (`200`) answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub key: String,
    pub token: String,
    pub fence: u64,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
}

/// A lock's state, as `GET /locks/{key}` shows it. Never the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockStatus {
    pub key: String,
    pub fence: u64,
    pub expires_at_ms: u64,
    pub ttl_remaining_ms: u64,
    pub owner: Option<String>,
}

/// What an acquire asks for. `None` leaves a parameter to the broker's default.
#[derive(Debug, Clone, Default)]
pub struct AcquireParams {
    pub ttl: Option<Duration>,
    pub wait: Option<Duration>,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
}

/// Why a call did not give what was asked. The first three are the answers a caller branches
/// on; the others are failures.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// `409 locked`: someone else holds the lock, and the wait ran out.
    #[error("the lock is held by someone else{}", retry_hint(*.retry_after_ms))]
    Locked { retry_after_ms: Option<u64> },
    /// `404 not_held`: nobody holds the lock.
    #[error("nobody holds the lock (it was released, or its lease expired)")]
    NotHeld,
    /// `409 not_owner`: someone else holds the lock; this token's lease has ended.
    #[error("someone else holds the lock now; this token's lease has ended")]
    NotOwner,
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

fn retry_hint(retry_after_ms: Option<u64>) -> String {
    retry_after_ms.map_or_else(String::new, |ms| {
        format!("; its lease ends in {}", format_ms(ms))
    })
}

impl ClientError {
    /// The exit code a command ends with after this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Locked { .. } => exit::LOCKED,
            Self::NotHeld | Self::NotOwner => exit::NOT_HELD,
            Self::Api { .. } | Self::Transport { .. } | Self::BadResponse(_) => exit::ERROR,
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
            Self::NotHeld => "not_held",
            Self::NotOwner => "not_owner",
            Self::Api { code, .. } => code,
            Self::Transport { .. } => "unreachable",
            Self::BadResponse(_) => "bad_response",
        }
    }

    /// The error as one JSON object in the API's format, for `--json`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut body = serde_json::json!({ "error": self.code(), "message": self.to_string() });
        if let Self::Locked {
            retry_after_ms: Some(ms),
        } = self
        {
            body["retry_after_ms"] = (*ms).into();
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

    fn lock_url(&self, key: &LockKey) -> String {
        // The key's alphabet (A-Z a-z 0-9 . _ - :) needs no escaping in a path segment.
        format!("{}/locks/{}", self.base, key.as_str())
    }

    /// `POST /locks/{key}`. Waits up to `params.wait` (the broker's default when `None`) for a
    /// holder to let go.
    pub async fn acquire(
        &self,
        key: &LockKey,
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
        let request = self
            .http
            .post(self.lock_url(key))
            .json(&body)
            .timeout(params.wait.unwrap_or_default() + REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::CREATED).await
    }

    /// `DELETE /locks/{key}`, the token in the `Lock-Token` header.
    pub async fn release(&self, key: &LockKey, token: &Token) -> Result<(), ClientError> {
        let request = self
            .http
            .delete(self.lock_url(key))
            .header("Lock-Token", token.as_str())
            .timeout(REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        if response.status() == StatusCode::NO_CONTENT {
            Ok(())
        } else {
            Err(error_from(response).await)
        }
    }

    /// `POST /locks/{key}/renew`: the lease then ends `ttl` from now (the broker's default TTL
    /// when `None`).
    pub async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Grant, ClientError> {
        let mut request = self
            .http
            .post(format!("{}/renew", self.lock_url(key)))
            .header("Lock-Token", token.as_str())
            .timeout(REQUEST_TIMEOUT);
        if let Some(ttl) = ttl {
            request = request.json(&serde_json::json!({ "ttl_ms": millis(ttl) }));
        }
        let response = self.send(request).await?;
        expect_json(response, StatusCode::OK).await
    }

    /// `GET /locks/{key}`.
    pub async fn status(&self, key: &LockKey) -> Result<LockStatus, ClientError> {
        let request = self.http.get(self.lock_url(key)).timeout(REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::OK).await
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
) -> Result<T, ClientError> {
    if response.status() != expected {
        return Err(error_from(response).await);
    }
    let text = response
        .text()
        .await
        .map_err(|e| ClientError::BadResponse(error_chain(&e)))?;
    serde_json::from_str(&text)
        .map_err(|e| ClientError::BadResponse(format!("{e} in {}", excerpt(&text))))
}

/// Turns an error answer into a [`ClientError`], keeping the API's code and message.
async fn error_from(response: reqwest::Response) -> ClientError {
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    let body: Option<ErrorBody> = serde_json::from_str(&text).ok();
    let code = body.as_ref().and_then(|b| b.error.clone());
    match (status, code.as_deref()) {
        (StatusCode::CONFLICT, Some("locked")) => ClientError::Locked {
            retry_after_ms: body.and_then(|b| b.retry_after_ms),
        },
        (StatusCode::NOT_FOUND, Some("not_held")) => ClientError::NotHeld,
        (StatusCode::CONFLICT, Some("not_owner")) => ClientError::NotOwner,
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
        assert_eq!(
            ClientError::Locked {
                retry_after_ms: None
            }
            .exit_code(),
            exit::LOCKED
        );
        assert_eq!(ClientError::NotHeld.exit_code(), exit::NOT_HELD);
        assert_eq!(ClientError::NotOwner.exit_code(), exit::NOT_HELD);
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
        assert!(!ClientError::NotOwner.is_transient());
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
