//! The operations routes: liveness (`/healthz`), readiness (`/readyz`), the metrics
//! (`/metrics`) and the OpenAPI document (`/openapi.json`) — what load balancers, orchestrators
//! and monitoring ask, as opposed to the lock routes clients use.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use utoipa::ToSchema;

use super::error::ApiError;
use super::error::responses::{Forbidden, StoreUnavailable, Unauthorized};
use super::{Auth, SharedState};

/// The operations routes, without their state. `/healthz` and `/readyz` are always open;
/// `/metrics` and `/openapi.json` (which answers `document`, the OpenAPI document as built once
/// for this router) are guarded by `guard` when there is one (`auth_metrics`).
pub(super) fn ops_router(guard: Option<Auth>, document: Bytes) -> Router<SharedState> {
    let readable = Router::new()
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(move || openapi_json(document.clone())));
    let readable = match guard {
        Some(auth) => readable.route_layer(axum::middleware::from_fn_with_state(
            auth,
            super::auth::guard_operations,
        )),
        None => readable,
    };
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(readable)
}

/// The body of `/healthz` and `/readyz`.
#[derive(Serialize, ToSchema)]
#[schema(as = Status)]
pub(super) struct StatusBody {
    /// `ok` (healthz) or `ready` (readyz).
    #[schema(value_type = String, examples("ok", "ready"))]
    status: &'static str,
}

/// Liveness
///
/// `200` while the process serves; it does not ask the store.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "The process serves.", body = StatusBody))
)]
pub(super) async fn healthz() -> Json<StatusBody> {
    Json(StatusBody { status: "ok" })
}

/// Metrics
///
/// Counters and latencies of acquires, releases, renewals and store calls, and the number of
/// waiting acquires, in the OpenMetrics text format (Prometheus).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses(
        (
            status = 200,
            description = "The metrics.",
            body = String,
            content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8"
        ),
        Unauthorized,
        Forbidden,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn metrics(State(state): State<SharedState>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        state.locks.render_metrics(),
    )
        .into_response()
}

/// Readiness
///
/// `200` exactly when this broker would grant a free key now: the store answers and no
/// store-wide hold is in force. `503` otherwise, with `Retry-After` during a hold and a message
/// that says which (store unreachable; settling on a store with no record of earlier grants;
/// holding back after a detected loss): a load balancer takes the broker out of rotation.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "A free key would be granted now.", body = StatusBody),
        StoreUnavailable,
    )
)]
pub(super) async fn readyz(State(state): State<SharedState>) -> Result<Json<StatusBody>, ApiError> {
    // The broker looks at the store again within a second (its epoch check).
    state
        .locks
        .ready()
        .await
        .map_err(|e| ApiError::from(e).or_retry_after(1000))?;
    Ok(Json(StatusBody { status: "ready" }))
}

/// This document
///
/// The OpenAPI document of this API.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses(
        (status = 200, description = "The OpenAPI document.", body = Object),
        Unauthorized,
        Forbidden,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn openapi_json(document: Bytes) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        document,
    )
        .into_response()
}
