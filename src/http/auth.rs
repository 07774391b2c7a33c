//! The auth layer: in front of the lock routes (and, with `auth_metrics`, of `/metrics` and
//! `/openapi.json`), it tells the `Action` from the matched route, the method and the key,
//! asks the `Policy` in force, and answers `401 unauthorized` or `403 forbidden` before the
//! handler runs — so before any store work or waiting. Handlers know nothing of it.
//!
//! The token's name (never the token) goes into the request's span, so the access log shows who
//! asked, and into `lockbroker_auth_requests_total`.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, MatchedPath, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::params::{BODY_LIMIT, KeyPath, Params};
use super::requests::Parameters;
use crate::auth::{Action, Client, Policy, bearer_token};
use crate::domain::LockKey;
use crate::metrics::Metrics;
use crate::reload::Reloadable;

/// What the auth layer needs: the policy in force (swapped on reload) and where to count.
#[derive(Clone)]
pub(crate) struct Auth {
    pub policy: Arc<Reloadable<Policy>>,
    pub metrics: Arc<Metrics>,
}

const CHALLENGE: &str = "Bearer realm=\"lockbroker\"";
const CHALLENGE_INVALID: &str = "Bearer realm=\"lockbroker\", error=\"invalid_token\"";

/// The action a request on a lock route is, from its matched route, method and key.
fn lock_action<'k>(parts: &Parts, key: &'k LockKey) -> Action<'k> {
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map(MatchedPath::as_str);
    // A semaphore's key is guarded as a lock's: the same prefixes, the same permissions.
    match (route, &parts.method) {
        (Some("/locks/{key}" | "/semaphores/{key}"), &Method::POST) => Action::Acquire(key),
        (Some("/locks/{key}" | "/semaphores/{key}"), &Method::GET | &Method::HEAD) => {
            Action::Inspect(key)
        }
        (Some("/locks/{key}" | "/semaphores/{key}"), &Method::DELETE) if asks_force(parts) => {
            Action::ForceRelease(key)
        }
        (Some("/locks/{key}" | "/semaphores/{key}"), &Method::DELETE) => Action::Release(key),
        (Some("/locks/{key}/renew" | "/semaphores/{key}/renew"), &Method::POST) => {
            Action::Renew(key)
        }
        _ => Action::Unlisted,
    }
}

/// Whether the matched route is one of the sessions' (`/sessions`, `/sessions/{session}…`).
fn is_session_route(parts: &Parts) -> bool {
    parts
        .extensions
        .get::<MatchedPath>()
        .is_some_and(|route| route.as_str().starts_with("/sessions"))
}

/// Whether the matched route is a listing (`GET /locks`, `GET /semaphores`), which has no key.
fn is_listing(parts: &Parts) -> bool {
    matches!(parts.method, Method::GET | Method::HEAD)
        && parts
            .extensions
            .get::<MatchedPath>()
            .is_some_and(|route| matches!(route.as_str(), "/locks" | "/semaphores"))
}

/// What a several-keys acquire or release (`POST`/`DELETE /locks`) asks: its keys, read as its
/// handler reads them (the body is read here and handed on whole), and whether it acquires.
/// `Ok(Err(body))`: the request is not one.
#[allow(clippy::type_complexity)]
async fn several_keys(
    parts: &Parts,
    body: Body,
) -> Result<Result<(Vec<LockKey>, bool, Body), Body>, Response> {
    let on_collection = parts
        .extensions
        .get::<MatchedPath>()
        .is_some_and(|route| route.as_str() == "/locks");
    let acquire = match parts.method {
        Method::POST => true,
        Method::DELETE => false,
        _ => return Ok(Err(body)),
    };
    if !on_collection {
        return Ok(Err(body));
    }
    let bytes = axum::body::to_bytes(body, BODY_LIMIT)
        .await
        .map_err(|_| ApiError::payload_too_large(BODY_LIMIT).into_response())?;
    let copy = Request::from_parts(parts.clone(), Body::from(bytes.clone()));
    let raw = if acquire {
        Params::<super::several::SeveralBody>::from_request(copy, &())
            .await
            .map(|p| p.values.keys_named())
    } else {
        Params::<super::several::SeveralRelease>::from_request(copy, &())
            .await
            .map(|p| p.values.keys_named())
    }
    .map_err(IntoResponse::into_response)?;
    let keys = super::several::parse_keys(raw).map_err(IntoResponse::into_response)?;
    Ok(Ok((keys, acquire, Body::from(bytes))))
}

/// The prefix a listing asks for, read as its handler reads it (query string or JSON body; the
/// body is read here and handed on whole). Refused as the handler would refuse it.
async fn listing_prefix(parts: &Parts, body: Body) -> Result<(String, Body), Response> {
    let bytes = axum::body::to_bytes(body, BODY_LIMIT)
        .await
        .map_err(|_| ApiError::payload_too_large(BODY_LIMIT).into_response())?;
    let copy = Request::from_parts(parts.clone(), Body::from(bytes.clone()));
    let params = Params::<ListingPrefix>::from_request(copy, &())
        .await
        .map_err(IntoResponse::into_response)?;
    let prefix = params.values.prefix.unwrap_or_default();
    let prefix = LockKey::parse_prefix(&prefix).map_err(|e| ApiError::from(e).into_response())?;
    Ok((prefix, Body::from(bytes)))
}

/// A listing's `prefix`, the one parameter the auth layer reads of it; the others are the
/// handler's to check (after auth, as for every route).
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct ListingPrefix {
    #[serde(
        default,
        deserialize_with = "super::requests::text",
        skip_serializing_if = "Option::is_none"
    )]
    prefix: Option<String>,
}

impl Parameters for ListingPrefix {}

/// Whether a release names `force` at all: whatever its value, only `admin` may send it.
fn asks_force(parts: &Parts) -> bool {
    Query::<Vec<(String, String)>>::try_from_uri(&parts.uri)
        .is_ok_and(|Query(q)| q.iter().any(|(name, _)| name == "force"))
}

/// A `401`: what to say and the challenge to send with it.
struct Unauthorized {
    message: &'static str,
    challenge: &'static str,
}

impl Unauthorized {
    fn into_response(self, auth: &Auth) -> Response {
        auth.metrics.authorized("", "unauthorized");
        let mut response = ApiError::unauthorized(self.message).into_response();
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static(self.challenge),
        );
        response
    }
}

/// Who sent the request, or why it is not known.
fn authenticate<'p>(policy: &'p Policy, parts: &Parts) -> Result<&'p Client, Unauthorized> {
    let presented = parts
        .headers
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes)
        .and_then(bearer_token);
    let Some(bearer) = presented else {
        return Err(Unauthorized {
            message: "This broker needs a token: send it as Authorization: Bearer <token>.",
            challenge: CHALLENGE,
        });
    };
    let client = policy.authenticate(bearer).ok_or(Unauthorized {
        message: "The bearer token is not one this broker knows.",
        challenge: CHALLENGE_INVALID,
    })?;
    tracing::Span::current().record("token", &**client.name());
    Ok(client)
}

fn forbid(auth: &Auth, name: &str, message: String) -> Response {
    auth.metrics.authorized(name, "forbidden");
    ApiError::forbidden(message).into_response()
}

/// The lock routes' guard.
pub(super) async fn guard_lock_route(
    State(auth): State<Auth>,
    request: Request,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let policy = auth.policy.current();
    let client = match authenticate(&policy, &parts) {
        Ok(client) => client,
        Err(refusal) => return refusal.into_response(&auth),
    };
    if is_session_route(&parts) {
        if !client.allows(Action::Session) {
            return forbid(
                &auth,
                client.name(),
                forbidden_message(client, Action::Session),
            );
        }
        auth.metrics.authorized(client.name(), "allowed");
        return next.run(Request::from_parts(parts, body)).await;
    }
    let body = match several_keys(&parts, body).await {
        Err(refusal) => return refusal,
        Ok(Ok((keys, acquire, body))) => {
            for key in &keys {
                let action = if acquire {
                    Action::Acquire(key)
                } else {
                    Action::Release(key)
                };
                if !client.allows(action) {
                    return forbid(&auth, client.name(), forbidden_message(client, action));
                }
            }
            auth.metrics.authorized(client.name(), "allowed");
            return next.run(Request::from_parts(parts, body)).await;
        }
        Ok(Err(body)) => body,
    };
    if is_listing(&parts) {
        let (prefix, body) = match listing_prefix(&parts, body).await {
            Ok(read) => read,
            Err(refusal) => return refusal,
        };
        let action = Action::List(&prefix);
        if !client.allows(action) {
            return forbid(&auth, client.name(), forbidden_message(client, action));
        }
        auth.metrics.authorized(client.name(), "allowed");
        return next.run(Request::from_parts(parts, body)).await;
    }
    // A key that is not valid is refused as the handler would, before any permission on it.
    let key = match KeyPath::from_request_parts(&mut parts, &()).await {
        Ok(KeyPath(key)) => key,
        Err(e) => return e.into_response(),
    };
    let action = lock_action(&parts, &key);
    if !client.allows(action) {
        return forbid(&auth, client.name(), forbidden_message(client, action));
    }
    auth.metrics.authorized(client.name(), "allowed");
    next.run(Request::from_parts(parts, body)).await
}

/// `/metrics` and `/openapi.json` under `auth_metrics`: `admin`, or `read` on every key.
pub(super) async fn guard_operations(
    State(auth): State<Auth>,
    request: Request,
    next: Next,
) -> Response {
    let (parts, body) = request.into_parts();
    let policy = auth.policy.current();
    let client = match authenticate(&policy, &parts) {
        Ok(client) => client,
        Err(refusal) => return refusal.into_response(&auth),
    };
    let name = client.name();
    if !client.allows(Action::Operations) {
        return forbid(
            &auth,
            name,
            format!(
                "The token {name:?} may not read this: it needs \"admin\", or \"read\" on every \
                 key (prefixes [\"\"])."
            ),
        );
    }
    auth.metrics.authorized(name, "allowed");
    next.run(Request::from_parts(parts, body)).await
}

fn forbidden_message(client: &Client, action: Action<'_>) -> String {
    let name = client.name();
    match action {
        Action::Acquire(key) | Action::Release(key) | Action::Renew(key) => format!(
            "The token {name:?} may not take or give back {key}: it needs the \"lock\" \
             permission on a prefix of the key."
        ),
        Action::Inspect(key) => format!(
            "The token {name:?} may not read {key}: it needs \"read\" or \"lock\" on a prefix \
             of the key."
        ),
        Action::ForceRelease(key) => {
            format!("The token {name:?} may not force the release of {key}: that needs \"admin\".")
        }
        Action::List(prefix) => format!(
            "The token {name:?} may not list keys under the prefix {prefix:?}: it needs \"read\" \
             or \"lock\" on a prefix of it (a token for orders: lists with prefix=orders: or \
             longer)."
        ),
        Action::Session => format!(
            "The token {name:?} may not open or keep sessions: it needs the \"lock\" \
             permission on at least one prefix."
        ),
        Action::Operations | Action::Unlisted => {
            format!("The token {name:?} may not do this: it needs \"admin\".")
        }
    }
}
