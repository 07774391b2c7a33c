//! The error responses the OpenAPI document lists (`super::super::openapi`): each a unit type
//! that a handler names in its `#[utoipa::path(responses(…))]`, written once for every
//! operation that answers it. The bodies they refer to are `super`'s.

use std::borrow::Cow;
use std::collections::BTreeMap;

use utoipa::openapi::{Content, HeaderBuilder, Ref, RefOr, Response, ResponseBuilder, Schema};
use utoipa::{IntoResponses, PartialSchema, ToSchema};

use super::{Body as ErrorBody, LockedError, NotHeldBody, PermitConflictError};

/// Declares error responses: for each, a unit type whose [`IntoResponses`] gives every status it
/// stands for with its description (the doc comment before it, as utoipa reads one), its body's
/// schema by reference, and its headers. Written out rather than derived: utoipa's derive takes
/// the body's schema from a field of that type, which nothing would ever fill or read.
macro_rules! error_responses {
    ($(
        $(#[doc = $type_doc:literal])*
        pub struct $name:ident {$(
            $(#[doc = $doc:literal])*
            $status:literal => $body:ty $(, $header:literal: $header_type:ty = $header_doc:literal)?;
        )+}
    )*) => {$(
        $(#[doc = $type_doc])*
        $($(#[doc = $doc])*)+
        pub(crate) struct $name;

        impl IntoResponses for $name {
            fn responses() -> BTreeMap<String, RefOr<Response>> {
                BTreeMap::from([$((
                    $status.to_string(),
                    error_response(
                        &[$($doc),*],
                        <$body as ToSchema>::name(),
                        [$(($header, <$header_type as PartialSchema>::schema(), $header_doc))?],
                    ),
                )),+])
            }
        }
    )*};
}

/// One error response: `doc` (a doc comment's lines) as its description, a JSON body of the
/// schema named `body`, and `headers` as (name, schema, description).
fn error_response<const N: usize>(
    doc: &[&str],
    body: Cow<'static, str>,
    headers: [(&str, RefOr<Schema>, &str); N],
) -> RefOr<Response> {
    let response = ResponseBuilder::new()
        .description(description(doc))
        .content(
            "application/json",
            Content::new(Some(Ref::from_schema_name(body))),
        );
    headers
        .into_iter()
        .fold(response, |response, (name, schema, text)| {
            response.header(
                name,
                HeaderBuilder::new()
                    .schema(Some(schema))
                    .description(Some(text))
                    .build(),
            )
        })
        .build()
        .into()
}

/// A doc comment's lines as utoipa makes a description of them: each without trailing white
/// space and without the indentation all the non-empty ones share, joined by new lines.
fn description(lines: &[&str]) -> String {
    let indent = lines
        .iter()
        .filter(|l| !l.trim_end().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    lines
        .iter()
        .map(|l| l.trim_end().get(indent..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

error_responses! {
    /// What an operation that reads a key and parameters refuses before it does anything: the
    /// rejections of [`crate::http::params::KeyPath`] and
    /// [`crate::http::params::Params`]. Every lock route
    /// answers these.
    pub struct RequestRefused {
        /// `invalid_request`: a bad key; an unknown parameter, or one that is not valid or out of
        /// its bounds, or given twice with different values; malformed JSON; where the operation
        /// takes a token, none, a malformed one, or one in the body.
        400 => ErrorBody;
        /// `payload_too_large`: the body is over 16 KiB.
        413 => ErrorBody;
        /// `unsupported_media_type`: a non-empty body that is not `application/json`.
        415 => ErrorBody;
    }

    pub struct Unauthorized {
        /// `unauthorized` (only when the broker runs with an auth file): no `Authorization: Bearer`
        /// header, a malformed one, or a token the auth file does not have.
        401 => ErrorBody, "WWW-Authenticate": String = "`Bearer realm=\"lockbroker\"`, with \
            `error=\"invalid_token\"` for an unknown token.";
    }

    pub struct Forbidden {
        /// `forbidden` (only when the broker runs with an auth file): the token is known, but its
        /// prefixes do not cover the key or it lacks the permission.
        403 => ErrorBody;
    }

    pub struct ForceRefused {
        /// `forbidden`: with an auth file, the token is known but its prefixes do not cover the key or
        /// it lacks the permission (`force=true` needs `admin`); without one, `force=true` on a broker
        /// that does not run with `allow_force_release`.
        403 => ErrorBody;
    }

    pub struct PermitRefused {
        /// `locked`: every permit is still taken when `wait_ms` ran out (with `retry_after_ms` and
        /// `Retry-After`: when the first permit ends); or `limit_mismatch`: the semaphore's current
        /// holders took their permits with another `limit` (given in the body).
        409 => PermitConflictError, "Retry-After": u64 = "With `locked`: seconds until the first \
            permit ends, rounded up, at least 1.";
    }

    pub struct NotHeld {
        /// `not_held`: nobody holds the lock (it is free, it was released, or the lease expired).
        404 => ErrorBody;
    }

    pub struct NoSession {
        /// `no_session`: the `session` named does not exist or has ended — also when it ended
        /// while the acquire waited (nothing is left queued or held).
        404 => ErrorBody;
    }

    pub struct SessionEnded {
        /// `not_held`: the session has ended (or never existed): every lease under it is gone.
        404 => ErrorBody;
    }

    pub struct InspectNotHeld {
        /// `not_held`: nobody holds the key (it is free, it was released, or the lease expired).
        /// With `watch`, the body adds `"fence": null` and `changed`.
        404 => NotHeldBody;
    }

    pub struct NotOwner {
        /// `not_owner`: someone else's live lease holds the key (yours expired and was taken over, or
        /// the token is wrong).
        409 => ErrorBody;
    }

    pub struct Locked {
        /// `locked`: still held by someone else when `wait_ms` ran out (a several-keys acquire:
        /// some of its keys, named in `held`; none is held for it afterwards).
        409 => LockedError, "Retry-After": u64 = "Seconds until the current lease ends, rounded \
            up, at least 1.";
    }

    pub struct StoreUnavailable {
        /// `store_unavailable`: the store could not be reached or did not answer in time; or, with
        /// `Retry-After`, a store-wide hold is in force (a store that is new or was emptied settles, or
        /// the brokers put their live leases back after a detected loss) and the message says which.
        503 => ErrorBody, "Retry-After": u64 = "While a store-wide hold is in force: seconds until \
            it ends, rounded up, at least 1.";
    }

    pub struct InspectUnavailable {
        /// `store_unavailable`: the store could not be reached or did not answer in time, or, with
        /// `Retry-After`, a store-wide hold is in force. With `watch` also `too_many_waiters` (with
        /// `Retry-After: 1`: `max_waiters` acquires and watches already wait on this broker) and
        /// `shutting_down` (the broker stopped while the watch waited).
        503 => ErrorBody, "Retry-After": u64 = "With `too_many_waiters` and during a store-wide \
            hold: seconds to wait before trying again.";
    }

    pub struct NotGranted {
        /// Not granted. `store_unavailable`: the store could not be reached or did not answer in time
        /// (`store_timeout_ms`), or, with `Retry-After`, a store-wide hold is in force (a new or emptied
        /// store settling, or the brokers putting their live leases back after a detected loss; a
        /// waiting acquire waits a hold out within its `wait_ms`); `too_many_waiters`, with `Retry-After: 1`: `max_waiters` acquires already wait on
        /// this broker; `shutting_down`: the broker stopped while the request waited. Try again, or
        /// another broker.
        503 => ErrorBody, "Retry-After": u64 = "With `too_many_waiters` and during a store-wide \
            hold: seconds to wait before trying again.";
    }
}

/// Declares the error responses an operation of the lock and of the semaphore routes answers
/// alike: for each, a unit type whose [`IntoResponses`] gives every response of the types it
/// lists.
macro_rules! response_sets {
    ($(
        $(#[doc = $doc:literal])*
        pub struct $name:ident = $($part:ident)|+;
    )*) => {$(
        $(#[doc = $doc])*
        pub(crate) struct $name;

        impl IntoResponses for $name {
            fn responses() -> BTreeMap<String, RefOr<Response>> {
                let mut responses = BTreeMap::new();
                $(responses.extend($part::responses());)+
                responses
            }
        }
    )*};
}

response_sets! {
    /// What an acquire refuses but its conflict (`Locked`, `PermitRefused`).
    pub struct AcquireRefused =
        RequestRefused | Unauthorized | Forbidden | NoSession | NotGranted;
    /// What opening a session refuses.
    pub struct OpenRefused = RequestRefused | Unauthorized | Forbidden | StoreUnavailable;
    /// What a keep-alive, a read or a close of a session refuses.
    pub struct SessionRefused =
        RequestRefused | Unauthorized | Forbidden | SessionEnded | StoreUnavailable;
    /// What a release refuses.
    pub struct ReleaseRefused =
        RequestRefused | Unauthorized | ForceRefused | NotHeld | NotOwner | StoreUnavailable;
    /// What a renewal refuses.
    pub struct RenewRefused =
        RequestRefused | Unauthorized | Forbidden | NotHeld | NotOwner | StoreUnavailable;
    /// What an inspect or a watch refuses.
    pub struct InspectRefused =
        RequestRefused | Unauthorized | Forbidden | InspectNotHeld | InspectUnavailable;
    /// What a several-keys release refuses (each key's own answer is in its body).
    pub struct SeveralReleaseRefused = RequestRefused | Unauthorized | Forbidden;
    /// What a listing refuses.
    pub struct ListRefused = RequestRefused | Unauthorized | Forbidden | StoreUnavailable;
}
