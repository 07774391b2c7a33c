//! Several keys at once on the lock collection: `POST /locks` takes every key or none,
//! `DELETE /locks?keys=…` releases the listed keys with one token (see
//! `core/src/lock/several.rs` for how the keys are taken without deadlock).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::{Deserializer, Error as _};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::SharedState;
use super::error::ApiError;
use super::error::responses::{AcquireRefused, Locked, SeveralReleaseRefused};
use super::params::{Params, TokenHeader, token};
use super::requests::{ModeName, Parameters, acquire_request, int, mode, parameters, text};
use crate::domain::{LockKey, Space};
use crate::lock::{LockError, MAX_KEYS};

/// The keys: a JSON array of strings, or in the query string a comma-separated list.
fn keys<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Vec<String>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Keys {
        List(Vec<String>),
        Joined(String),
    }
    match Keys::deserialize(deserializer) {
        Ok(Keys::List(keys)) => Ok(Some(keys)),
        Ok(Keys::Joined(joined)) => Ok(Some(joined.split(',').map(str::to_owned).collect())),
        Err(_) => Err(D::Error::custom("must be a list of keys")),
    }
}

/// A lock's key, as a several-keys request names it.
#[derive(ToSchema)]
#[schema(value_type = String, min_length = 1, max_length = 200, pattern = r"^[A-Za-z0-9._:-]{1,200}$")]
#[allow(dead_code)] // documents the keys' items; never built
pub(crate) struct KeyName(String);

parameters! {
    /// The parameters of `POST /locks`: the keys, and those of a single acquire (`ttl_ms`,
    /// `wait_ms`, `owner`, `request_id`, `mode`, `session`), each as for one key.
    pub struct SeveralBody {
        {
            /// 1 to 64 distinct keys; each key's lease has its own fence, all share one token.
            #[serde(default, deserialize_with = "keys", skip_serializing_if = "Option::is_none")]
            #[schema(value_type = Vec<KeyName>, required = true, min_items = 1, max_items = 64)]
            #[param(value_type = String, required = false)]
            pub(crate) keys: Option<Vec<String>>,
        }
        ttl_ms: u64, "int", (minimum = 1);
        wait_ms: u64, "int", (minimum = 0);
        owner: String, "text", (max_length = 128, pattern = r"^[^\x00-\x1f\x7f-\x9f]*$");
        request_id: String, "text", (pattern = r"^[A-Za-z0-9_-]{1,64}$");
        mode: ModeName, "mode", ();
        session: String, "text",
            (min_length = 1, max_length = 128, pattern = r"^[A-Za-z0-9._~-]{1,128}$");
    }
}

impl Parameters for SeveralBody {}

impl SeveralBody {
    /// The keys as given (for the auth layer, which checks each).
    pub(super) fn keys_named(self) -> Option<Vec<String>> {
        self.keys
    }
}

impl SeveralRelease {
    /// The keys as given (for the auth layer, which checks each).
    pub(super) fn keys_named(self) -> Option<Vec<String>> {
        self.keys
    }
}

/// The parameters of `DELETE /locks`: the keys, and the token (header or query string).
#[derive(Debug, Default, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct SeveralRelease {
    /// The keys to release, comma-separated (1 to 64, distinct).
    #[serde(
        default,
        deserialize_with = "keys",
        skip_serializing_if = "Option::is_none"
    )]
    #[param(
        value_type = String,
        required = true,
        pattern = r"^[A-Za-z0-9._:-]{1,200}(,[A-Za-z0-9._:-]{1,200}){0,63}$"
    )]
    keys: Option<Vec<String>>,
    /// The token, if not in the `Lock-Token` header.
    #[serde(
        default,
        deserialize_with = "text",
        skip_serializing_if = "Option::is_none"
    )]
    #[param(
        value_type = String,
        required = false,
        min_length = 1,
        max_length = 128,
        pattern = r"^[A-Za-z0-9._~-]{1,128}$"
    )]
    token: Option<String>,
}

impl Parameters for SeveralRelease {
    const QUERY_ONLY: &'static [(&'static str, &'static str)] = &[(
        "token",
        "Send the token in the Lock-Token header or the token query parameter, not in the body.",
    )];
}

/// The keys a request names: 1 to [`MAX_KEYS`], each valid, none twice.
pub(super) fn parse_keys(raw: Option<Vec<String>>) -> Result<Vec<LockKey>, ApiError> {
    let raw = raw.ok_or_else(|| ApiError::invalid("keys is required: the keys to lock."))?;
    if raw.is_empty() || raw.len() > MAX_KEYS {
        return Err(ApiError::invalid(format!(
            "keys must name 1 to {MAX_KEYS} keys; it names {}.",
            raw.len()
        )));
    }
    let mut keys = Vec::with_capacity(raw.len());
    for key in &raw {
        let key = LockKey::parse(key)?;
        if keys.contains(&key) {
            return Err(ApiError::invalid(format!("keys names {key} twice.")));
        }
        keys.push(key);
    }
    Ok(keys)
}

/// One key's lease in a several-keys grant.
#[derive(Serialize, ToSchema)]
struct KeyFence<'a> {
    key: &'a str,
    #[schema(minimum = 1)]
    fence: u64,
}

/// A several-keys grant: one token for every key, a fence per key.
#[derive(Serialize, ToSchema)]
#[schema(as = SeveralGrant)]
pub(super) struct SeveralGrantBody<'a> {
    /// The token of every key's lease (release, renew each key with it).
    token: &'a str,
    ttl_ms: u64,
    /// When the first of the leases ends (the keys were granted one after another).
    expires_at_ms: u64,
    /// Each key's lease, in the order of `keys`.
    leases: Vec<KeyFence<'a>>,
}

/// Acquire several locks
///
/// Every key or none, within `wait_ms`: the keys are taken in one global order (sorted), each
/// through its own queue, so two requests for `{a, b}` and `{b, a}` never deadlock. `409 locked`
/// names the keys that were busy, and none is held afterwards.
#[utoipa::path(
    post,
    path = "/locks",
    operation_id = "acquire_several",
    tag = "locks",
    request_body(content = SeveralBody, content_type = "application/json"),
    responses(
        (status = 201, description = "Granted: every key is held.", body = SeveralGrantBody),
        Locked,
        AcquireRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn acquire_locks(
    State(state): State<SharedState>,
    params: Params<SeveralBody>,
) -> Result<Response, ApiError> {
    let values = params.values;
    let keys = parse_keys(values.keys)?;
    let request = acquire_request(
        ModeName::lock_kind(values.mode),
        values.ttl_ms,
        values.wait_ms,
        values.owner,
        values.request_id,
        values.session,
        &state.limits,
    )?;
    let got = state.locks.acquire_all(&keys, request).await?;
    let first = got
        .leases
        .iter()
        .map(|(_, l)| l)
        .min_by_key(|l| l.expires_at_ms);
    let body = SeveralGrantBody {
        token: got.token.as_str(),
        ttl_ms: first.map_or(0, |l| l.ttl_ms),
        expires_at_ms: first.map_or(0, |l| l.expires_at_ms),
        leases: got
            .leases
            .iter()
            .map(|(key, lease)| KeyFence {
                key: key.as_str(),
                fence: lease.fence,
            })
            .collect(),
    };
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// A several-keys release's answer: each key's status, in the order of `keys`.
#[derive(Serialize, ToSchema)]
#[schema(as = SeveralReleased)]
pub(super) struct SeveralReleasedBody<'a> {
    results: Vec<KeyStatus<'a>>,
}

/// One key's answer to a several-keys release.
#[derive(Serialize, ToSchema)]
struct KeyStatus<'a> {
    key: &'a str,
    /// The status a release of that key alone would answer: 204, 404, 409 or 503.
    status: u16,
}

/// Release several locks
///
/// Releases each listed key's lease held by the token (`Lock-Token` header or `token`), each as a
/// release of that key alone would; `200` with each key's status.
#[utoipa::path(
    delete,
    path = "/locks",
    operation_id = "release_several",
    tag = "locks",
    params(TokenHeader, SeveralRelease),
    responses(
        (status = 200, description = "Each key's status.", body = SeveralReleasedBody),
        SeveralReleaseRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn release_locks(
    State(state): State<SharedState>,
    params: Params<SeveralRelease>,
) -> Result<Response, ApiError> {
    let keys = parse_keys(params.values.keys)?;
    let token = token(params.token_header, params.values.token)?;
    let releases = keys
        .iter()
        .map(|key| state.locks.release(Space::Locks, key, &token));
    let answers = futures_util::future::join_all(releases).await;
    let results: Vec<KeyStatus<'_>> = keys
        .iter()
        .zip(answers)
        .map(|(key, answer)| KeyStatus {
            key: key.as_str(),
            status: match answer {
                Ok(()) => 204,
                Err(LockError::NotHeld) => 404,
                Err(LockError::NotOwner) => 409,
                Err(_) => 503,
            },
        })
        .collect();
    Ok(Json(SeveralReleasedBody { results }).into_response())
}
