//! The OpenAPI document of the API, served at `GET /openapi.json`.
//!
//! It is generated (utoipa) from the `#[utoipa::path]` annotations on the handlers in
//! `super::locks`, `super::semaphores` and `super::ops`, and from the types the broker really
//! reads and sends: the request parameters (`super::requests`, `super::params`), the success
//! bodies (`ToSchema` derives beside their handlers) and the error bodies (`super::error`). The
//! error responses below are each written once and listed by every operation that answers
//! them; a handler documents its success response itself. `tests/api/openapi.rs` checks that
//! the document lists exactly [`super::ROUTES`] and, for every operation, exactly the statuses
//! that real requests get.

use axum::body::Bytes;
use serde_json::Value;
use utoipa::openapi::OpenApi as Document;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::Limits;
use super::error::{Body as ErrorBody, ErrorCode, LockedError, NotHeldBody, PermitConflictError};
use super::requests::{
    AcquireBody, MAX_WATCH, RenewBody, SemaphoreAcquireBody, SessionBody, SessionRenewBody,
};
use crate::store::{MAX_LIST_LIMIT, MAX_SEMAPHORE_LIMIT};

/// What the document says about the API as a whole: its conventions.
const DESCRIPTION: &str = "\
A distributed-lock broker: leases on named locks, each with a secret token and a fencing number.

Conventions:

- JSON in, JSON out, UTF-8. Durations are integer milliseconds; times are Unix epoch \
milliseconds on the store's clock, the same for every broker that shares the store.
- Parameters come in the query string or in a JSON object body (`Content-Type: \
application/json`; an empty body is fine). The same parameter in both with different values, \
an unknown parameter, or malformed JSON is `400 invalid_request`.
- Bodies are limited to 16 KiB (`413 payload_too_large`); a non-empty body that is not \
`application/json` is `415 unsupported_media_type`.
- Every error has the body `{\"error\": code, \"message\": sentence}` (schema `Error`), the \
router's own included: `404 not_found` for a path that matches no route (such as `/locks/` or \
`/locks/a/b`) and `405 method_not_allowed`, with an `Allow` header, for a path that exists \
with another method. Every `GET` also answers `HEAD`. A request head over 16 KiB (or with \
more than 100 header fields) is `431 request_header_fields_too_large`.
- A lease that has expired is not held, whatever the store still contains.
- Locks are exclusive (one holder) or shared (`mode=shared`: any number of shared holders, \
never with an exclusive one; an exclusive acquire that waits holds new shared ones back). \
Semaphores (`/semaphores/{key}`, a space of their own) grant up to `limit` permits, each a \
lease with its own token and fence. `DELETE` with `force=true` ends every lease on a key \
without its token: with auth it needs `admin`; without, the broker must run with \
`allow_force_release`, or it is `403 forbidden`.

Auth: off unless the broker runs with an auth file. Then every lock route needs \
`Authorization: Bearer <token>` (security scheme `bearer`): missing, malformed or unknown is \
`401 unauthorized` with `WWW-Authenticate: Bearer`; a known token whose prefixes do not cover \
the key, or that lacks the permission, is `403 forbidden` (`lock`: acquire, renew, release, \
inspect and list; `read`: inspect and list; `admin`: everything on every key, force release \
included). Sessions need `lock` on at least one prefix; each acquire under one is checked \
against its own key. A listing needs `read` or `lock` on a prefix of its `prefix`. Neither grants, waits or changes \
anything. `/healthz` and `/readyz` are always open; `/metrics` and `/openapi.json` are open \
unless the broker runs with `auth_metrics` (then `admin`, or `read` on every key).";

/// The document: every route of [`super::router`].
#[derive(OpenApi)]
#[openapi(
    info(description = DESCRIPTION),
    paths(
        super::locks::acquire_lock,
        super::locks::release_lock,
        super::locks::renew_lock,
        super::locks::inspect_lock,
        super::locks::list_locks,
        super::several::acquire_locks,
        super::several::release_locks,
        super::semaphores::acquire_permit,
        super::semaphores::release_permit,
        super::semaphores::renew_permit,
        super::semaphores::inspect_semaphore,
        super::semaphores::list_semaphores,
        super::sessions::open_session,
        super::sessions::keep_alive,
        super::sessions::close_session,
        super::sessions::read_session,
        super::ops::healthz,
        super::ops::readyz,
        super::ops::metrics,
        super::ops::openapi_json,
    ),
    // The request bodies are referenced by name, so that they stay optional (an `Option`
    // would also let them be `null`, which the broker refuses). The error bodies are listed
    // because the shared responses below refer to them by name, and utoipa collects schemas
    // only from responses written out in the operations themselves.
    components(schemas(
        ErrorCode,
        ErrorBody,
        LockedError,
        PermitConflictError,
        AcquireBody,
        SemaphoreAcquireBody,
        RenewBody,
        SessionBody,
        SessionRenewBody,
        NotHeldBody
    )),
    modifiers(&BearerScheme),
    tags(
        (name = "locks", description = "Acquire, release, renew, inspect and list leases on locks."),
        (name = "semaphores", description = "Take, give back, renew, inspect and list semaphore permits."),
        (name = "sessions", description = "Open, keep alive, read and close sessions: one heartbeat for many leases."),
        (name = "operations", description = "Health, readiness, metrics and this document."),
    )
)]
pub(crate) struct ApiDoc;

/// Adds the `bearer` security scheme the operations refer to.
struct BearerScheme;

impl Modify for BearerScheme {
    fn modify(&self, openapi: &mut Document) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A token of the broker's auth file; needed only when the broker runs \
                         with one.",
                    ))
                    .build(),
            ),
        );
    }
}

/// The document as served by a broker with these limits: the generated one with every bound
/// that comes from the configuration or the store written in (see `bounds`).
pub(crate) fn document(limits: &Limits, cursor_pattern: Option<&str>) -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).expect("the document serializes");
    bounds(&mut doc, limits);
    if let Some(pattern) = cursor_pattern {
        for path in ["/locks", "/semaphores"] {
            let parameters = doc["paths"][path]["get"]["parameters"].as_array_mut();
            for parameter in parameters.into_iter().flatten() {
                if parameter["name"] == "cursor" {
                    parameter["schema"]["pattern"] = pattern.into();
                }
            }
        }
    }
    doc
}

/// The document as [`document`] gives it, serialized as `GET /openapi.json` sends it: built once
/// per router (it depends on the configuration), each request then answers these bytes.
pub(super) fn document_json(limits: &Limits, cursor_pattern: Option<&str>) -> Bytes {
    serde_json::to_vec(&document(limits, cursor_pattern))
        .expect("the document serializes")
        .into()
}

/// Writes the `maximum` of every parameter and property whose bound is not a constant of the
/// code that utoipa's attributes could name: `ttl_ms` and `wait_ms` of a request (the
/// configuration's `max_ttl_ms`, `max_wait_ms`), a semaphore's `limit`
/// ([`MAX_SEMAPHORE_LIMIT`]), a listing's ([`MAX_LIST_LIMIT`]) and an inspect's `watch`
/// ([`MAX_WATCH`], so that a generated document states the bound its `int64` format implies).
fn bounds(doc: &mut Value, limits: &Limits) {
    let request = |name: &str| match name {
        "ttl_ms" => Some(limits.max_ttl_ms),
        "wait_ms" => Some(limits.max_wait_ms),
        "limit" => Some(u64::from(MAX_SEMAPHORE_LIMIT)),
        "watch" => Some(MAX_WATCH),
        _ => None,
    };
    if let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) {
        for (path, item) in paths {
            let listing = path == "/locks" || path == "/semaphores";
            let operations = item
                .as_object_mut()
                .into_iter()
                .flat_map(|o| o.values_mut());
            for parameter in operations
                .filter_map(|op| op.get_mut("parameters").and_then(Value::as_array_mut))
                .flatten()
            {
                let max = match parameter["name"].as_str() {
                    Some("limit") if listing => Some(MAX_LIST_LIMIT as u64),
                    Some(name) => request(name),
                    None => None,
                };
                if let Some(max) = max {
                    parameter["schema"]["maximum"] = max.into();
                }
            }
        }
    }
    let schemas = doc
        .get_mut("components")
        .and_then(|c| c.get_mut("schemas"))
        .and_then(Value::as_object_mut);
    if let Some(schemas) = schemas {
        for (schema, body) in schemas {
            let is_request = matches!(
                schema.as_str(),
                "AcquireBody"
                    | "SemaphoreAcquireBody"
                    | "RenewBody"
                    | "SessionBody"
                    | "SeveralBody"
                    | "SessionRenewBody"
            );
            let Some(properties) = body.get_mut("properties").and_then(Value::as_object_mut) else {
                continue;
            };
            for (name, property) in properties {
                let max = match name.as_str() {
                    // Every semaphore's `limit`, in a request or an answer.
                    "limit" => Some(u64::from(MAX_SEMAPHORE_LIMIT)),
                    name if is_request => request(name),
                    _ => None,
                };
                if let Some(max) = max {
                    property["maximum"] = max.into();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
