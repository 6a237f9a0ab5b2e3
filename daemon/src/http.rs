//! The daemon's HTTP API. One error type maps every failure to its status and a JSON body.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use crate::state::{Daemon, LookupRequest};

/// Why an API call failed; the one place that picks status codes.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not a lookup request.
    #[error("invalid request: {0}")]
    BadRequest(String),
    /// The body or its key list is larger than configured.
    #[error("{0}")]
    TooLarge(String),
    /// The body could not be read.
    #[error("cannot read the request body: {0}")]
    Body(String),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Body(_) => StatusCode::BAD_REQUEST,
        };
        (status, axum::Json(json!({ "error": self.to_string() }))).into_response()
    }
}

/// The routes, over shared state. Bodies are capped at what `--max-keys` keys can take.
pub fn router(daemon: Arc<Daemon>) -> Router {
    // A u64 in JSON is at most 20 digits and a comma.
    let body_limit = daemon.settings.max_keys.saturating_mul(21) + 64 * 1024;
    Router::new()
        .route("/v1/lookup", post(lookup))
        .route("/v1/endpoints", get(endpoints))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .with_state(daemon)
}

async fn lookup(
    State(daemon): State<Arc<Daemon>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge(format!(
                "request body exceeds the limit for --max-keys {}",
                daemon.settings.max_keys
            ))
        } else {
            ApiError::Body(rejection.body_text())
        }
    })?;
    let request: LookupRequest =
        serde_json::from_slice(&body).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    if request.keys.len() > daemon.settings.max_keys {
        return Err(ApiError::TooLarge(format!(
            "{} keys exceed --max-keys {}",
            request.keys.len(),
            daemon.settings.max_keys
        )));
    }
    let answer = daemon.lookup(&request, Instant::now());
    daemon
        .metrics
        .lookup_seconds
        .observe(started.elapsed().as_secs_f64());
    Ok(axum::Json(answer).into_response())
}

async fn endpoints(State(daemon): State<Arc<Daemon>>) -> Response {
    let endpoints: Vec<_> = daemon
        .endpoints
        .read()
        .iter()
        .map(|e| {
            json!({
                "endpoint": e.spec.endpoint,
                "events": e.spec.events,
                "replay": e.spec.replay,
                "rank": e.spec.rank,
                "slot": e.slot.index(),
                "status": *e.status.lock(),
            })
        })
        .collect();
    axum::Json(json!({ "endpoints": endpoints })).into_response()
}

async fn ready(State(daemon): State<Arc<Daemon>>) -> Response {
    if daemon.ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "syncing\n").into_response()
    }
}

async fn metrics(State(daemon): State<Arc<Daemon>>) -> Response {
    {
        let index = daemon.index.read();
        daemon.metrics.index_entries.set(index.entries() as i64);
        daemon.metrics.index_bytes.set(index.table_bytes() as i64);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        daemon.metrics.render(),
    )
        .into_response()
}
