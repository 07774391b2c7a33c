//! What each request may carry, one type per operation. The same type parses the query string
//! and the JSON body (serde, through [`super::params::Params`]) and documents them in
//! `/openapi.json` (utoipa's `IntoParams` for the query string, `ToSchema` for the body), so the
//! parser and the document cannot list different parameters. The bounds that come from the
//! configuration or from the store (`max_ttl_ms`, `max_wait_ms`, a semaphore's and a listing's
//! most `limit`) are written into the document by `super::openapi::bounds`; the handlers check
//! them when they turn these values into domain values.
//!
//! Every field is optional here, also where the operation requires it (`limit` of a semaphore
//! acquire: its handler refuses a request without one), so that a parameter can be parsed from
//! the query string and the body apart and the two merged (see `Params`). The document says so
//! too: OpenAPI cannot require a parameter in one of two places (`limit`, the token), nor tie a
//! parameter in the query string to the same one in the body; `scripts/schemathesis_hooks.py`
//! states those rules for schemathesis.

use serde::de::{DeserializeOwned, Error as _, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::Limits;
use super::error::ApiError;
use crate::domain::{Kind, LockKey, Owner, RequestId, Space, Token, Ttl, WaitFor};
use crate::lock::AcquireRequest;
use crate::store::{ListQuery, MAX_LIST_LIMIT};

/// A request's parameters, as parsed from the query string and a JSON body alike.
pub(crate) trait Parameters: DeserializeOwned + Serialize + Default {
    /// Names accepted in the query string but never in a body (the token, `force`), each with
    /// the sentence that refuses it there.
    const QUERY_ONLY: &'static [(&'static str, &'static str)] = &[];
}

/// The name of the header a lease token may come in, as the parser reads it; the document's
/// `TokenHeader` spells the same name (a unit test checks).
pub(super) const LOCK_TOKEN_HEADER: &str = "Lock-Token";

/// Why the token may not come in a body (bodies end up in logs and proxies' caches more often
/// than headers).
const TOKEN_NOT_IN_BODY: (&str, &str) = (
    "token",
    "Send the token in the Lock-Token header or the token query parameter, not in the body.",
);

/// Why `force` may not come in a body: the auth layer decides from the query string alone who
/// may send it.
const FORCE_NOT_IN_BODY: (&str, &str) = (
    "force",
    "Send force=true in the query string, not in the body.",
);

/// A lock's mode, as the API writes it: `exclusive` (one holder) or `shared` (any number of
/// shared holders).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub(super) enum ModeName {
    Exclusive,
    Shared,
}

impl ModeName {
    /// The kind of lease a lock acquire with this `mode` asks for (exclusive when not given).
    pub(super) fn lock_kind(mode: Option<Self>) -> Kind {
        match mode {
            None | Some(Self::Exclusive) => Kind::Exclusive,
            Some(Self::Shared) => Kind::Shared,
        }
    }
}

/// Declares request parameter types: each field optional, read by the named deserializer
/// (`int`, `text`, `mode`), left out when serialized if absent (see `Params`), and documented
/// with the same bounds in a body's schema and as a query parameter.
///
/// A struct may begin with a block `{ … }` of fields written out in full, for a field these
/// rules do not fit (a required list, say); they come first.
macro_rules! parameters {
    ($(
        $(#[$attr:meta])*
        pub struct $name:ident {
            $({ $($own:tt)* })?
            $(
            $(#[$field_attr:meta])*
            $field:ident: $type:ty, $read:literal, ($($bounds:tt)*);
        )+}
    )+) => {$(
        $(#[$attr])*
        #[derive(Debug, Default, Serialize, Deserialize, ToSchema, IntoParams)]
        #[into_params(parameter_in = Query)]
        #[serde(deny_unknown_fields)]
        pub(crate) struct $name {
            $($($own)*)?
            $(
            $(#[$field_attr])*
            #[serde(default, deserialize_with = $read, skip_serializing_if = "Option::is_none")]
            #[schema(value_type = $type, required = false, $($bounds)*)]
            #[param(value_type = $type, required = false, $($bounds)*)]
            pub(crate) $field: Option<$type>,
        )+}
    )+};
}

pub(super) use parameters;

parameters! {
    /// The parameters of an acquire. Each may come in the query string or in a JSON object body
    /// (integers as JSON numbers); all are optional.
    pub struct AcquireBody {
        /// Lease length in ms, 1 to the broker's `max_ttl_ms` (default 3600000). Default: the
        /// broker's `default_ttl_ms` (30000).
        ttl_ms: u64, "int", (minimum = 1);
        /// How long to wait, in ms, while someone else holds the lock: 0 to the broker's
        /// `max_wait_ms` (default 60000). Default: the broker's `default_wait_ms` (0). The request
        /// ends by `wait_ms` plus the store timeout; a client that disconnects stops the wait.
        wait_ms: u64, "int", (minimum = 0);
        /// A free label for people, shown by `GET /locks/{key}`: at most 128 characters, no
        /// control characters.
        owner: String, "text", (max_length = 128, pattern = r"^[^\x00-\x1f\x7f-\x9f]*$");
        /// Makes a retried acquire safe: 1 to 64 characters from `A-Z a-z 0-9 _ -`. Repeating an
        /// acquire with the same key and `request_id` while the lease it produced is held answers
        /// `201` with that same grant (same token, same fence) instead of `409`.
        request_id: String, "text",
            (min_length = 1, max_length = 64, pattern = r"^[A-Za-z0-9_-]{1,64}$");
        /// `exclusive` (the default: one holder) or `shared` (any number of shared holders, never
        /// with an exclusive one).
        mode: ModeName, "mode", ();
        /// Takes the lease under this session (the `session` that `POST /sessions` answered):
        /// it lives as long as the session, so `ttl_ms` may not come with it.
        session: String, "text",
            (min_length = 1, max_length = 128, pattern = r"^[A-Za-z0-9._~-]{1,128}$");
    }

    /// The parameters of a semaphore acquire: `limit` is required; the others are as for a lock's
    /// acquire. Each may come in the query string or in a JSON object body.
    pub struct SemaphoreAcquireBody {
        /// How many permits the semaphore has. Required, in the query string or the body. Every
        /// holder uses the same; another limit while permits are held is `409 limit_mismatch`.
        limit: u64, "int", (minimum = 1);
        /// Lease length in ms, as for locks.
        ttl_ms: u64, "int", (minimum = 1);
        /// How long to wait, in ms, while every permit is taken, as for locks.
        wait_ms: u64, "int", (minimum = 0);
        /// A free label for people, shown by `GET /semaphores/{key}`, as for locks.
        owner: String, "text", (max_length = 128, pattern = r"^[^\x00-\x1f\x7f-\x9f]*$");
        /// Makes a retried acquire safe, as for locks.
        request_id: String, "text",
            (min_length = 1, max_length = 64, pattern = r"^[A-Za-z0-9_-]{1,64}$");
        /// Takes the permit under this session, as for locks.
        session: String, "text",
            (min_length = 1, max_length = 128, pattern = r"^[A-Za-z0-9._~-]{1,128}$");
    }

    /// The parameters of `POST /sessions`, in the query string or a JSON object body; all
    /// optional.
    pub struct SessionBody {
        /// The session's length in ms, counted from each keep-alive: as a lease's `ttl_ms`.
        ttl_ms: u64, "int", (minimum = 1);
        /// A label for people, shown for the session and for its leases that have none.
        owner: String, "text", (max_length = 128, pattern = r"^[^\x00-\x1f\x7f-\x9f]*$");
        /// How long, in ms, the keys of a session that ends by expiry stay held after its end
        /// (0 to 60000, default 0). A close or a release has no delay.
        lock_delay_ms: u64, "int", (minimum = 0, maximum = 60000);
        /// Makes a retried open safe: the same `request_id` while the session it opened lives
        /// answers that session again.
        request_id: String, "text",
            (min_length = 1, max_length = 64, pattern = r"^[A-Za-z0-9_-]{1,64}$");
    }

    /// The parameters of a keep-alive, in the query string or a JSON object body.
    pub struct SessionRenewBody {
        /// The session's new length in ms (it stays its length from then on). Default: its own.
        ttl_ms: u64, "int", (minimum = 1);
    }

    /// The parameters of a renewal: `ttl_ms` in the query string or a JSON object body, optional;
    /// the token in the query string (or the `Lock-Token` header), never in the body.
    pub struct RenewBody {
        /// The new lease length in ms, counted from the renewal: 1 to the broker's `max_ttl_ms`
        /// (default 3600000). Default: the broker's `default_ttl_ms` (30000).
        ttl_ms: u64, "int", (minimum = 1);
        /// The token the acquire returned, if not sent in the `Lock-Token` header (if both, they
        /// must be equal). One of the two is required. Never in the body.
        #[schema(ignore)]
        token: String, "text",
            (min_length = 1, max_length = 128, pattern = r"^[A-Za-z0-9._~-]{1,128}$");
    }

    /// A listing's parameters, in the query string (or a JSON object body).
    pub struct ListQueryParams {
        /// Only keys that start with this: 0 to 200 characters from `A-Z a-z 0-9 . _ - :`.
        /// Default: every key.
        prefix: String, "text", (max_length = 200, pattern = r"^[A-Za-z0-9._:-]{0,200}$");
        /// Most entries on the page. Default: 100.
        limit: u64, "int", (minimum = 1);
        /// The `next_cursor` of the page before; leave it out for the first page. A cursor the
        /// broker did not give is `400`.
        cursor: String, "text", (min_length = 1);
    }
}

impl Parameters for AcquireBody {}

impl Parameters for SemaphoreAcquireBody {}

impl Parameters for SessionBody {}

impl Parameters for SessionRenewBody {}

impl Parameters for RenewBody {
    const QUERY_ONLY: &'static [(&'static str, &'static str)] = &[TOKEN_NOT_IN_BODY];
}

impl Parameters for ListQueryParams {}

/// The parameters of a release, in the query string only: the token (or the `Lock-Token`
/// header), or `force=true` without one.
#[derive(Debug, Default, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(super) struct ReleaseQuery {
    /// The token the acquire returned, if not sent in the `Lock-Token` header (if both, they
    /// must be equal). One of the two, or `force=true`, is required.
    #[serde(
        default,
        deserialize_with = "text",
        skip_serializing_if = "Option::is_none"
    )]
    #[param(value_type = String, required = false, min_length = 1, max_length = 128, pattern = r"^[A-Za-z0-9._~-]{1,128}$")]
    pub token: Option<String>,
    /// `true`, with no token: ends every lease on the key (any other value is `400`; never in
    /// the body). With auth it needs `admin`; without, the broker must run with
    /// `allow_force_release`.
    #[serde(
        default,
        deserialize_with = "force",
        skip_serializing_if = "Option::is_none"
    )]
    #[param(value_type = String, required = false, pattern = "^true$")]
    pub force: Option<ForceTrue>,
}

impl Parameters for ReleaseQuery {
    const QUERY_ONLY: &'static [(&'static str, &'static str)] =
        &[TOKEN_NOT_IN_BODY, FORCE_NOT_IN_BODY];
}

/// The parameters of an inspect (`GET /locks/{key}`, `GET /semaphores/{key}`): none for a look
/// now; `watch` (and `wait_ms`) to wait for a change. In the query string (or a JSON object
/// body).
#[derive(Debug, Default, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(super) struct WatchQuery {
    /// Watch the key: the fence you last saw (the highest, for several holders), or 0 for
    /// "free". Answers at once if the key's holders differ from that, otherwise waits up to
    /// `wait_ms` for a change (a grant, a release, an expiry, a takeover, a force release) and
    /// answers the new view, or the unchanged one with `changed: false` when the wait runs out.
    #[serde(
        default,
        deserialize_with = "int",
        skip_serializing_if = "Option::is_none"
    )]
    #[param(value_type = u64, required = false, minimum = 0)]
    pub watch: Option<u64>,
    /// Only with `watch`: how long to wait for a change, in ms: 0 to the broker's
    /// `max_wait_ms` (default 60000). Default: the broker's `default_wait_ms` (0).
    #[serde(
        default,
        deserialize_with = "int",
        skip_serializing_if = "Option::is_none"
    )]
    #[param(value_type = u64, required = false, minimum = 0)]
    pub wait_ms: Option<u64>,
}

impl Parameters for WatchQuery {}

/// A watch as an inspect asks for it: the fence the caller saw and how long to wait.
#[derive(Debug, Clone, Copy)]
pub(super) struct WatchRequest {
    pub seen: u64,
    pub wait: std::time::Duration,
}

/// The highest `watch`: fences are signed 64-bit integers (`format: int64` in the API document),
/// and no fence comes near it.
pub(super) const MAX_WATCH: u64 = i64::MAX as u64;

/// The watch an inspect asks for, if any; `wait_ms` without `watch` is refused (it would wait
/// for nothing).
pub(super) fn watch_request(
    params: WatchQuery,
    limits: &Limits,
) -> Result<Option<WatchRequest>, ApiError> {
    match (params.watch, params.wait_ms) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(ApiError::invalid(
            "wait_ms goes with watch (the fence you last saw, or 0): give watch too, or leave \
             out wait_ms.",
        )),
        (Some(seen), _) if seen > MAX_WATCH => Err(ApiError::invalid(format!(
            "watch is a fence the broker gave (or 0): at most {MAX_WATCH}."
        ))),
        (Some(seen), wait_ms) => Ok(Some(WatchRequest {
            seen,
            wait: WaitFor::parse(
                wait_ms.unwrap_or(limits.default_wait_ms),
                limits.max_wait_ms,
            )?
            .as_duration(),
        })),
    }
}

// From parameters to domain values, with the bounds of the configuration and the store.

/// The lease length a request asks for, or the default; within `max_ttl_ms`.
pub(super) fn ttl_param(ttl_ms: Option<u64>, limits: &Limits) -> Result<Ttl, ApiError> {
    Ok(Ttl::parse(
        ttl_ms.unwrap_or(limits.default_ttl_ms),
        limits.max_ttl_ms,
    )?)
}

/// The parameters every acquire takes: `ttl_ms`, `wait_ms`, `owner`, `request_id`.
pub(super) fn acquire_request(
    kind: Kind,
    ttl_ms: Option<u64>,
    wait_ms: Option<u64>,
    owner: Option<String>,
    request_id: Option<String>,
    session: Option<String>,
    limits: &Limits,
) -> Result<AcquireRequest, ApiError> {
    if session.is_some() && ttl_ms.is_some() {
        return Err(ApiError::invalid(
            "ttl_ms cannot come with session: a lease under a session lives as long as the \
             session.",
        ));
    }
    Ok(AcquireRequest {
        kind,
        ttl: ttl_param(ttl_ms, limits)?,
        session: session.map(|s| session_id(&s)).transpose()?,
        wait: WaitFor::parse(
            wait_ms.unwrap_or(limits.default_wait_ms),
            limits.max_wait_ms,
        )?,
        owner: owner.map(|o| Owner::parse(&o)).transpose()?,
        request_id: request_id.map(|r| RequestId::parse(&r)).transpose()?,
    })
}

/// A session's id as a client sent it (any token-shaped string; the store decides if it is one).
pub(super) fn session_id(raw: &str) -> Result<Token, ApiError> {
    Token::parse(raw).map_err(|_| {
        ApiError::invalid(
            "session is not a session id: 1 to 128 characters of A-Z a-z 0-9 . _ ~ -.",
        )
    })
}

/// A listing's parameters: `prefix` (default ''), `limit` (1 ..= 1000, default 100), `cursor`.
pub(super) fn list_query(space: Space, params: ListQueryParams) -> Result<ListQuery, ApiError> {
    let prefix = LockKey::parse_prefix(&params.prefix.unwrap_or_default())?;
    let limit = match params.limit {
        None => DEFAULT_LIST_LIMIT,
        Some(n) if (1..=MAX_LIST_LIMIT as u64).contains(&n) => n as usize,
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "limit must be between 1 and {MAX_LIST_LIMIT}."
            )));
        }
    };
    Ok(ListQuery {
        space,
        prefix,
        limit,
        cursor: params.cursor,
    })
}

/// How many keys a listing page holds when the request does not say.
const DEFAULT_LIST_LIMIT: usize = 100;

/// A non-negative integer: a JSON number with no fraction (`5000`, `5000.0`), or its decimal
/// digits in the query string.
pub(super) fn int<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    struct Int;
    impl Visitor<'_> for Int {
        type Value = u64;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a non-negative integer")
        }
        fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<u64, E> {
            Ok(n)
        }
        fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<u64, E> {
            u64::try_from(n).map_err(|_| E::custom(""))
        }
        fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<u64, E> {
            // JSON Schema counts 5000.0 as an integer; so does the broker.
            if n.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&n) {
                Ok(n as u64)
            } else {
                Err(E::custom(""))
            }
        }
    }
    deserializer
        .deserialize_u64(Int)
        .map(Some)
        .map_err(|_| D::Error::custom("must be a non-negative integer"))
}

/// A string: a JSON string, or the query string's text.
pub(super) fn text<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    String::deserialize(deserializer)
        .map(Some)
        .map_err(|_| D::Error::custom("must be a string"))
}

pub(super) fn mode<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<ModeName>, D::Error> {
    ModeName::deserialize(deserializer)
        .map(Some)
        .map_err(|_| D::Error::custom("must be exclusive or shared"))
}

/// The one value of `force`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum ForceTrue {
    #[serde(rename = "true")]
    True,
}

/// `force`: only `true` is a value (leave it out otherwise).
fn force<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<ForceTrue>, D::Error> {
    ForceTrue::deserialize(deserializer)
        .map(Some)
        .map_err(|_| D::Error::custom("must be true (or left out for a release by token)"))
}
