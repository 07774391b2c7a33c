//! The API's nouns as the client sees them: the two key spaces, what an acquire asks for
//! ([`Claim`]), the lease token ([`Token`], never printed by `Debug`), and the bodies the broker
//! answers with (grants, statuses, listings).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The broker's two key spaces: a lock and a semaphore of the same name are unrelated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Space {
    /// `/locks/{key}`: exclusive and shared leases.
    Locks,
    /// `/semaphores/{key}`: permits.
    Semaphores,
}

impl Space {
    /// The first segment of the API's paths for this space.
    pub fn path(self) -> &'static str {
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
    pub key: String,
}

impl Resource {
    /// The lock `key`.
    pub fn lock(key: impl Into<String>) -> Self {
        Self {
            space: Space::Locks,
            key: key.into(),
        }
    }

    /// The semaphore `name`.
    pub fn semaphore(name: impl Into<String>) -> Self {
        Self {
            space: Space::Semaphores,
            key: name.into(),
        }
    }
}

impl fmt::Display for Resource {
    /// A lock as its bare key, a semaphore as `semaphore NAME`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.space {
            Space::Locks => write!(f, "{}", self.key),
            Space::Semaphores => write!(f, "semaphore {}", self.key),
        }
    }
}

/// The most permits a semaphore can have, as the API bounds `limit`.
pub const MAX_SEMAPHORE_LIMIT: u32 = 10_000;

/// The most entries one page of a listing may ask for (the API's bound on `limit`).
pub const MAX_PAGE: u32 = 1000;

/// What an acquire asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// An exclusive lease on a lock: the only holder.
    Exclusive(String),
    /// A shared lease on a lock: held together with other shared leases, never with an
    /// exclusive one.
    Shared(String),
    /// One of `limit` permits of a semaphore (1 ..= [`MAX_SEMAPHORE_LIMIT`]); every holder
    /// must give the same limit.
    Permit { semaphore: String, limit: u32 },
}

impl Claim {
    /// What the lease is on, for renewing and releasing it.
    pub fn resource(&self) -> Resource {
        match self {
            Self::Exclusive(key) | Self::Shared(key) => Resource::lock(key.clone()),
            Self::Permit { semaphore, .. } => Resource::semaphore(semaphore.clone()),
        }
    }

    /// `exclusive`, `shared` or `semaphore`.
    pub fn mode(&self) -> &'static str {
        match self {
            Self::Exclusive(_) => "exclusive",
            Self::Shared(_) => "shared",
            Self::Permit { .. } => "semaphore",
        }
    }

    /// The query parameters that pick the kind of lease. An exclusive lease sends none: it is
    /// the API's default, and so a broker that predates shared leases takes it as before.
    pub(crate) fn query(&self) -> Vec<(&'static str, String)> {
        match self {
            Self::Exclusive(_) => Vec::new(),
            Self::Shared(_) => vec![("mode", "shared".to_owned())],
            Self::Permit { limit, .. } => vec![("limit", limit.to_string())],
        }
    }
}

/// A lease's token: whoever presents it may renew and release the lease. A session's id is one
/// too (whoever presents it keeps the session alive, closes it, and takes leases under it). Its
/// `Debug` shows no token, so a lease or a session logged with `{:?}` gives nothing away.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Token(String);

impl Token {
    /// The token as the broker issued it (or as a caller got it from elsewhere).
    pub fn new(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    /// The token itself, for the `Lock-Token` header or a caller that hands it on.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(…)")
    }
}

/// A new random request id (32 hex digits): an acquire retried with it returns the lease the
/// first attempt got, if it got one, instead of a second lease.
pub fn new_request_id() -> String {
    use rand::Rng;
    let mut bytes = [0u8; 16];
    rand::rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A grant, as acquire (`201`) and renew (`200`) answer it. `Debug` hides the token;
/// serializing it (the API's body again) does not.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub key: String,
    pub token: Token,
    pub fence: u64,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    /// A semaphore's permits; absent for a lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("fence", &self.fence)
            .field("ttl_ms", &self.ttl_ms)
            .field("expires_at_ms", &self.expires_at_ms)
            .field("limit", &self.limit)
            .finish()
    }
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
    /// Under a session (it lives as long as the session); absent, `false`, otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub session: bool,
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
    /// An exclusive lease under a session (shared holders say it each).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub session: bool,
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
    /// An exclusive lease under a session.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub session: bool,
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

/// A session as `POST /sessions` answers it. `Debug` hides its id (a [`Token`]); serializing
/// it (the API's body again) does not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionGrant {
    /// The session's id: the secret that keeps it alive, closes it and takes leases under it.
    pub session: Token,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    pub owner: Option<String>,
    pub lock_delay_ms: u64,
}

/// A session's length, end, label and lock delay, as a keep-alive answers them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionKept {
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    pub owner: Option<String>,
    pub lock_delay_ms: u64,
}

/// A session and its live leases, as `GET /sessions/{id}` shows them. Never its id, never a
/// token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionStatus {
    pub owner: Option<String>,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    pub ttl_remaining_ms: u64,
    pub lock_delay_ms: u64,
    pub leases: Vec<SessionLeaseEntry>,
}

/// One lease under a session: a lock's (`mode` exclusive or shared) or a semaphore's permit
/// (no `mode`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionLeaseEntry {
    pub space: Space,
    pub key: String,
    pub mode: Option<LockMode>,
    pub fence: u64,
}

/// What one `POST /sessions` asks for. `None` leaves a parameter to the broker's default (a
/// lease's default TTL; no lock delay).
#[derive(Debug, Clone, Default)]
pub struct SessionParams {
    pub ttl: Option<Duration>,
    /// How long the keys of the session stay held after it ends by expiry (at most 60 s).
    pub lock_delay: Option<Duration>,
    pub owner: Option<String>,
    /// Makes the open safe to repeat: the same id while the session lives answers it again.
    pub request_id: Option<String>,
}

/// What one acquire request asks for. `None` leaves a parameter to the broker's default.
#[derive(Debug, Clone, Default)]
pub struct AcquireParams {
    pub ttl: Option<Duration>,
    pub wait: Option<Duration>,
    pub owner: Option<String>,
    pub request_id: Option<String>,
    /// Takes the lease under this session (the id [`Client::create_session`] answered): it
    /// lives as long as the session, so `ttl` must be `None` with it.
    ///
    /// [`Client::create_session`]: crate::Client::create_session
    pub session: Option<Token>,
}

/// A duration in whole milliseconds, the API's unit (saturating).
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A duration in milliseconds, the way people write them: `30s`, `1m 30s`, `1s 500ms`.
pub fn format_ms(ms: u64) -> String {
    humantime::format_duration(Duration::from_millis(ms)).to_string()
}
