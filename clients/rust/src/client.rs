//! [`Client`]: one broker (or a load balancer in front of several), and the API's calls, one
//! request each — what the command line uses. The lease guard built on them is in
//! [`crate::lease`].

use std::fmt;
use std::time::Duration;

use reqwest::StatusCode;
use serde::Serialize;

use crate::error::Error;
use crate::request::{expect_json, expect_no_content};
use crate::types::{
    AcquireParams, Claim, Grant, LockEntry, LockStatus, Page, Resource, SemaphoreEntry,
    SemaphoreStatus, Space, Token, millis,
};

/// Bound on one request that does not wait for a lock: well above the broker's own bound on a
/// store call (2 s by default), so only a broker that is stuck or gone trips it.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Bound on opening a connection to the broker.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The environment variable that names the broker's URL, read by [`Client::from_env`] and by
/// the command line's `--url`.
pub const URL_ENV: &str = "LOCKBROKER_URL";

/// The environment variable that holds the bearer token, read by [`Client::from_env`] and by
/// the command line's `--auth-token`. (`LOCKBROKER_TOKEN`, which `lockbroker run` sets for its
/// command, is the lock's own token, not this.)
pub const AUTH_TOKEN_ENV: &str = "LOCKBROKER_AUTH_TOKEN";

/// The broker's URL when none is given: a broker on this host with its default port.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8080";

/// Why a [`Client`] could not be set up: the URL, the token or the TLS settings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BuildError(pub String);

/// A client for one broker. Cheap to clone (the connection pool is shared); every clone and
/// every lease taken with it talk to the same broker.
#[derive(Clone)]
pub struct Client {
    pub(crate) http: reqwest::Client,
    /// The URL without a trailing `/`.
    pub(crate) base: String,
}

impl fmt::Debug for Client {
    /// The URL only: the HTTP client's headers may carry the bearer token.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client").field("url", &self.base).finish()
    }
}

/// How to reach a broker beyond its URL: a bearer token, extra CA roots, a client certificate,
/// or an HTTP client set up by the caller.
pub struct ClientBuilder {
    base: String,
    http: reqwest::ClientBuilder,
    auth_token: Option<String>,
}

impl fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("url", &self.base)
            .field("auth_token", &self.auth_token.as_ref().map(|_| "***"))
            .finish()
    }
}

impl ClientBuilder {
    /// A bearer token, for a broker with an auth file (sent as `Authorization: Bearer`,
    /// marked sensitive so that no log shows it).
    pub fn auth_token(mut self, token: impl Into<String>) -> Self {
        self.auth_token = Some(token.into());
        self
    }

    /// Trusts `cert` for an `https://` broker, besides the system's roots.
    pub fn add_root_certificate(mut self, cert: reqwest::Certificate) -> Self {
        self.http = self.http.add_root_certificate(cert);
        self
    }

    /// A client certificate, for a broker that requires one (mutual TLS).
    pub fn identity(mut self, identity: reqwest::Identity) -> Self {
        self.http = self.http.identity(identity);
        self
    }

    /// Starts from `http` instead of a default `reqwest::ClientBuilder` (the connect timeout
    /// is still set on it).
    pub fn http(mut self, http: reqwest::ClientBuilder) -> Self {
        self.http = http;
        self
    }

    /// The client.
    pub fn build(self) -> Result<Client, BuildError> {
        let mut http = self.http.connect_timeout(CONNECT_TIMEOUT);
        if let Some(token) = &self.auth_token {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| BuildError("the auth token must be printable ASCII".into()))?;
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            http = http.default_headers(headers);
        }
        let http = http
            .build()
            .map_err(|e| BuildError(format!("cannot set up the HTTP client: {e}")))?;
        Ok(Client {
            http,
            base: self.base,
        })
    }
}

/// An acquire's JSON body; `keys` for several keys at once (`POST /locks`).
#[derive(Serialize)]
pub(crate) struct GrantBody<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) keys: Option<Vec<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ttl_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    wait_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    owner: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<&'a str>,
}

impl<'a> GrantBody<'a> {
    pub(crate) fn new(params: &'a AcquireParams) -> Self {
        Self {
            keys: None,
            ttl_ms: params.ttl.map(millis),
            wait_ms: params.wait.map(millis),
            owner: params.owner.as_deref(),
            request_id: params.request_id.as_deref(),
            session: params.session.as_ref().map(Token::as_str),
        }
    }
}

impl Client {
    /// A client for the broker at `url` (`http://host:port` or `https://…`, optionally with a
    /// path prefix), with no token and the system's CA roots.
    pub fn new(url: &str) -> Result<Self, BuildError> {
        Self::builder(url)?.build()
    }

    /// A client for the broker at `$LOCKBROKER_URL` ([`DEFAULT_URL`] when unset or empty), with
    /// the bearer token `$LOCKBROKER_AUTH_TOKEN` when it is set and not empty.
    pub fn from_env() -> Result<Self, BuildError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Client::from_env`] with the variables read by `var`.
    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, BuildError> {
        let var = |name: &str| var(name).filter(|v| !v.is_empty());
        let url = var(URL_ENV).unwrap_or_else(|| DEFAULT_URL.to_owned());
        let mut builder =
            Self::builder(&url).map_err(|e| BuildError(format!("{URL_ENV}: {}", e.0)))?;
        if let Some(token) = var(AUTH_TOKEN_ENV) {
            builder = builder.auth_token(token);
        }
        builder
            .build()
            .map_err(|e| BuildError(format!("{AUTH_TOKEN_ENV}: {}", e.0)))
    }

    /// A builder for the broker at `url`; the URL is checked now.
    pub fn builder(url: &str) -> Result<ClientBuilder, BuildError> {
        let parsed = reqwest::Url::parse(url).map_err(|e| {
            BuildError(format!(
                "{url:?} is not a URL ({e}); give one like http://127.0.0.1:8080"
            ))
        })?;
        match parsed.scheme() {
            "http" | "https" => {}
            other => {
                return Err(BuildError(format!(
                    "{url}: unsupported scheme {other:?}; use http:// or https://"
                )));
            }
        }
        Ok(ClientBuilder {
            base: url.trim_end_matches('/').to_owned(),
            http: reqwest::Client::builder(),
            auth_token: None,
        })
    }

    /// The broker's URL, as given (without a trailing `/`).
    pub fn url(&self) -> &str {
        &self.base
    }

    /// `POST /locks/{key}` (`?mode=shared` for a shared lease) or
    /// `POST /semaphores/{key}?limit=N`: one request, no retry. Waits up to `params.wait` (the
    /// broker's default when `None`) for a holder to let go. [`Client::acquire`] is the
    /// retrying, renewing acquire. Under a session that has ended (or never was):
    /// [`Error::SessionEnded`].
    pub async fn grant(&self, claim: &Claim, params: &AcquireParams) -> Result<Grant, Error> {
        let body = GrantBody::new(params);
        let resource = claim.resource();
        let request = self
            .http
            .post(self.resource_url(&resource)?)
            .query(&claim.query())
            .json(&body)
            .timeout(params.wait.unwrap_or_default() + REQUEST_TIMEOUT);
        let response = self.send(request).await?;
        expect_json(response, StatusCode::CREATED, resource.space).await
    }

    /// `DELETE /locks/{key}` (or `/semaphores/{key}`), the token in the `Lock-Token` header.
    pub async fn release(&self, resource: &Resource, token: &Token) -> Result<(), Error> {
        let request = self
            .http
            .delete(self.resource_url(resource)?)
            .header("Lock-Token", token.as_str())
            .timeout(REQUEST_TIMEOUT);
        expect_no_content(self.send(request).await?, resource.space).await
    }

    /// `DELETE /locks/{key}?force=true` (or `/semaphores/{key}`): ends every lease on it,
    /// without a token. The broker allows it to an `admin` token, or with auth off only when it
    /// runs with `--allow-force-release`; otherwise `403 forbidden`.
    pub async fn force_release(&self, resource: &Resource) -> Result<(), Error> {
        let request = self
            .http
            .delete(self.resource_url(resource)?)
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
    ) -> Result<Grant, Error> {
        let mut request = self
            .http
            .post(format!("{}/renew", self.resource_url(resource)?))
            .header("Lock-Token", token.as_str())
            .timeout(REQUEST_TIMEOUT);
        if let Some(ttl) = ttl {
            request = request.json(&serde_json::json!({ "ttl_ms": millis(ttl) }));
        }
        let response = self.send(request).await?;
        expect_json(response, StatusCode::OK, resource.space).await
    }

    /// `GET /locks/{key}`; [`Error::NotHeld`] when the lock is free.
    pub async fn status(&self, key: &str) -> Result<LockStatus, Error> {
        self.read(&Resource::lock(key)).await
    }

    /// `GET /semaphores/{key}`; [`Error::NotHeld`] when no permit is taken.
    pub async fn semaphore_status(&self, key: &str) -> Result<SemaphoreStatus, Error> {
        self.read(&Resource::semaphore(key)).await
    }

    /// `GET /locks?prefix=&limit=&cursor=`: one page of the held locks whose key starts with
    /// `prefix`, at most `limit` (1 ..= [`crate::MAX_PAGE`]) of them.
    pub async fn list_locks(
        &self,
        prefix: &str,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<Page<LockEntry>, Error> {
        self.list(Space::Locks, prefix, limit, cursor).await
    }

    /// `GET /semaphores?prefix=&limit=&cursor=`: as [`Self::list_locks`], for semaphores with
    /// holders.
    pub async fn list_semaphores(
        &self,
        prefix: &str,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<Page<SemaphoreEntry>, Error> {
        self.list(Space::Semaphores, prefix, limit, cursor).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{LockMode, Token};

    #[test]
    fn each_claim_goes_to_its_space_with_its_parameters() {
        let exclusive = Claim::Exclusive("jobs".into());
        assert_eq!(exclusive.resource().space, Space::Locks);
        assert!(exclusive.query().is_empty(), "the API's default, unsaid");
        let shared = Claim::Shared("jobs".into());
        assert_eq!(shared.query(), [("mode", "shared".to_owned())]);
        let permit = Claim::Permit {
            semaphore: "jobs".into(),
            limit: 4,
        };
        assert_eq!(permit.query(), [("limit", "4".to_owned())]);
        assert_eq!(permit.resource().to_string(), "semaphore jobs");
        assert_eq!(shared.resource().to_string(), "jobs");
        let client = Client::new("http://h:1/").unwrap();
        assert_eq!(
            client.resource_url(&permit.resource()).unwrap(),
            "http://h:1/semaphores/jobs"
        );
        let prefixed = Client::new("http://h:1/base/").unwrap();
        assert_eq!(
            prefixed.resource_url(&Resource::lock("a:b")).unwrap(),
            "http://h:1/base/locks/a:b"
        );
        assert_eq!(
            client.resource_url(&Resource::lock("a/b c")).unwrap(),
            "http://h:1/locks/a%2Fb%20c",
            "a key never adds a path segment"
        );
        for empty in [Resource::lock(""), Resource::semaphore("")] {
            match client.resource_url(&empty) {
                Err(e @ Error::Invalid(_)) => {
                    assert!(e.to_string().contains("is required"), "{e}");
                    assert_eq!(e.code(), "invalid_request");
                }
                other => panic!("an empty key is refused before sending, got {other:?}"),
            }
        }
    }

    #[test]
    fn http_and_https_urls_are_accepted() {
        assert!(Client::new("http://127.0.0.1:8080/").is_ok());
        assert!(Client::new("https://broker").is_ok());
        assert!(Client::new("ftp://broker").is_err());
        assert!(Client::new("127.0.0.1:8080").is_err());
        assert_eq!(
            Client::new("http://h:1/base/").unwrap().url(),
            "http://h:1/base"
        );
        let bad_token = Client::builder("http://h:1")
            .unwrap()
            .auth_token("é\n")
            .build();
        assert!(bad_token.is_err());
    }

    #[test]
    fn from_env_reads_the_url_and_the_bearer_token_the_command_line_reads() {
        let vars = |url: &'static str, token: &'static str| {
            move |name: &str| match name {
                "LOCKBROKER_URL" => Some(url.to_owned()),
                "LOCKBROKER_AUTH_TOKEN" => Some(token.to_owned()),
                _ => None,
            }
        };
        let client = Client::from_vars(vars("https://broker:9/base/", "s3cret")).unwrap();
        assert_eq!(client.url(), "https://broker:9/base");
        let unset = Client::from_vars(|_| None).unwrap();
        assert_eq!(unset.url(), "http://127.0.0.1:8080");
        assert_eq!(Client::from_vars(vars("", "")).unwrap().url(), DEFAULT_URL);
        let bad_url = Client::from_vars(vars("broker:8080", "")).unwrap_err();
        assert!(bad_url.0.starts_with("LOCKBROKER_URL: "), "{bad_url}");
        let bad_token = Client::from_vars(vars("http://h:1", "é\n")).unwrap_err();
        assert!(
            bad_token.0.starts_with("LOCKBROKER_AUTH_TOKEN: "),
            "{bad_token}"
        );
    }

    #[test]
    fn no_debug_output_shows_a_token() {
        let secret = "s3cr3t-token-value";
        let grant: Grant = serde_json::from_str(&format!(
            r#"{{"key":"a","token":"{secret}","fence":1,"ttl_ms":2,"expires_at_ms":3}}"#
        ))
        .unwrap();
        assert!(!format!("{grant:?}").contains(secret));
        assert!(!format!("{:?}", Token::new(secret)).contains(secret));
        let builder = Client::builder("http://h:1").unwrap().auth_token(secret);
        assert!(!format!("{builder:?}").contains(secret));
        let client = builder.build().unwrap();
        assert!(!format!("{client:?}").contains(secret));
        // Serialized, the grant is the API's body again: `limit` only for a semaphore's.
        let body = serde_json::to_value(&grant).unwrap();
        assert_eq!(body["token"], secret);
        assert!(body.get("limit").is_none());
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
        let page: Page<LockEntry> = serde_json::from_str(
            r#"{"locks":[{"key":"a","mode":"shared","fence":1,"expires_at_ms":2,
                "ttl_remaining_ms":3,"owner":null}],"next_cursor":"c1"}"#,
        )
        .unwrap();
        assert_eq!(page.items[0].mode, LockMode::Shared);
        assert_eq!(page.next_cursor.as_deref(), Some("c1"));
        let page: Page<SemaphoreEntry> = serde_json::from_str(
            r#"{"semaphores":[{"key":"s","limit":4,"holders":2,"fence":9,"expires_at_ms":2,
                "ttl_remaining_ms":3}],"next_cursor":null}"#,
        )
        .unwrap();
        assert_eq!(page.items[0].holders, 2);
        assert_eq!(page.next_cursor, None);
    }
}
