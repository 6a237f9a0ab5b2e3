//! The daemon's HTTP API. One error type maps every failure to its status and a JSON body.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::error_handling::HandleErrorLayer;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use kvaffine_core::protocol::{self, LookupRequest, SaltProbe, v1};

use crate::state::Daemon;

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
    /// No bearer token, or not one of `--auth-token-file`'s.
    #[error("a bearer token of --auth-token-file is required")]
    Unauthorized,
    /// `--max-inflight-lookups` lookups are being answered already.
    #[error("overloaded: --max-inflight-lookups lookups are in flight")]
    Overloaded,
    /// A replica the daemon called (the explain tool's tokenizer) failed.
    #[error("replica: {0}")]
    Upstream(String),
    /// No replica is reachable to call.
    #[error("no replica is reachable")]
    NoReplica,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Body(_) => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Overloaded | Self::NoReplica => StatusCode::SERVICE_UNAVAILABLE,
            Self::Upstream(_) => StatusCode::BAD_GATEWAY,
        };
        let body = axum::Json(json!({ "error": self.to_string() }));
        if status == StatusCode::UNAUTHORIZED {
            return (status, [(header::WWW_AUTHENTICATE, "Bearer")], body).into_response();
        }
        (status, body).into_response()
    }
}

/// The routes, over shared state. Bodies are capped at what `--max-keys` keys can take.
pub fn router(daemon: Arc<Daemon>) -> Router {
    // A u64 in JSON is at most 20 digits and a comma.
    let body_limit = daemon.settings.max_keys.saturating_mul(21) + 64 * 1024;
    // Past the bound a lookup is refused at once: queueing it would only make it miss the
    // filter's deadline later, with memory held meanwhile.
    let shed = {
        let counted = daemon.clone();
        tower::ServiceBuilder::new()
            .layer(HandleErrorLayer::new(move |_: axum::BoxError| {
                let daemon = counted.clone();
                async move {
                    daemon.metrics.shed.inc();
                    ApiError::Overloaded.into_response()
                }
            }))
            .layer(tower::load_shed::LoadShedLayer::new())
            .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                daemon.settings.max_inflight_lookups,
            ))
    };
    let api = Router::new()
        .route(protocol::LOOKUP_PATH, post(lookup))
        .route(v1::LOOKUP_PATH, post(lookup_v1))
        .route(protocol::SALT_PATH, post(salt_probe))
        .route(
            protocol::ROUTE_PATH,
            post(crate::route::route).layer(axum::extract::DefaultBodyLimit::max(
                crate::route::MAX_ROUTE_BODY_BYTES,
            )),
        )
        .route_layer(shed)
        .route("/v1/endpoints", get(endpoints))
        .route(
            kvaffine_core::outcome::OUTCOMES_PATH,
            post(record_outcomes).get(outcomes),
        )
        .route("/v1/explain", post(crate::console::explain))
        .route(
            crate::peers::PEER_BOOKINGS_PATH,
            post(peer_bookings).get(held_bookings),
        )
        // Layers run last-added first: the token is checked before the instance.
        .route_layer(axum::middleware::from_fn_with_state(
            daemon.clone(),
            refuse_itself,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            daemon.clone(),
            authorize,
        ));
    Router::new()
        .merge(api)
        .merge(crate::console::routes())
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .with_state(daemon)
}

/// Lets a `/v1` request through when no tokens are configured or it carries one.
async fn authorize(
    State(daemon): State<Arc<Daemon>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let allowed = daemon.auth.as_ref().is_none_or(|tokens| {
        tokens.allows(
            request
                .headers()
                .get(header::AUTHORIZATION)
                .map(|v| v.as_bytes()),
        )
    });
    if allowed {
        next.run(request).await
    } else {
        daemon.metrics.unauthorized.inc();
        ApiError::Unauthorized.into_response()
    }
}

/// Answers 409, naming itself, a request this daemon sent itself (it is among its own
/// peers): nothing it sends itself is held twice.
async fn refuse_itself(
    State(daemon): State<Arc<Daemon>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let asker = request.headers().get(crate::peers::INSTANCE_HEADER);
    if asker.is_some_and(|name| name.as_bytes() == daemon.instance.as_bytes()) {
        return (
            StatusCode::CONFLICT,
            [(crate::peers::INSTANCE_HEADER, daemon.instance.clone())],
            "this is the daemon that asks\n",
        )
            .into_response();
    }
    next.run(request).await
}

/// A question's body, or why it was refused: too large is 413 (a filter reads 400 to a
/// salt probe as a daemon that does not know its fields, and stops asking).
fn question_body(daemon: &Daemon, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge(format!(
                "request body exceeds the limit for --max-keys {}",
                daemon.settings.max_keys
            ))
        } else {
            ApiError::Body(rejection.body_text())
        }
    })
}

/// Reads a lookup body of either protocol as the current one, within `--max-keys`.
fn read_lookup<T: serde::de::DeserializeOwned>(
    daemon: &Daemon,
    body: Result<Bytes, BytesRejection>,
    current: impl FnOnce(T) -> LookupRequest,
) -> Result<LookupRequest, ApiError> {
    let body = question_body(daemon, body)?;
    let request =
        current(serde_json::from_slice(&body).map_err(|e| ApiError::BadRequest(e.to_string()))?);
    within_max_keys(daemon, request.query.len(), "keys")?;
    Ok(request)
}

/// Refuses `count` keys of a question (`what`: "keys", "text keys") past `--max-keys`.
pub fn within_max_keys(daemon: &Daemon, count: usize, what: &str) -> Result<(), ApiError> {
    if count > daemon.settings.max_keys {
        return Err(ApiError::TooLarge(format!(
            "{count} {what} exceed --max-keys {}",
            daemon.settings.max_keys
        )));
    }
    Ok(())
}

/// Ranks and books `request`, answering in the form `answer` makes of it; timed from
/// `started` (the request's arrival).
fn answer<A: serde::Serialize>(
    daemon: &Daemon,
    started: Instant,
    request: &LookupRequest,
    answer: impl FnOnce(crate::state::Ranking, Option<String>) -> A,
) -> Response {
    let (ranking, booked) = daemon.lookup(request, Instant::now());
    let body = axum::Json(answer(ranking, booked)).into_response();
    daemon
        .metrics
        .lookup_seconds
        .observe(started.elapsed().as_secs_f64());
    body
}

/// `POST /v2/lookup`: the top candidates only.
async fn lookup(
    State(daemon): State<Arc<Daemon>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    daemon.restored().await;
    let request = read_lookup(&daemon, body, |request: LookupRequest| request)?;
    Ok(answer(&daemon, started, &request, |ranking, booked| {
        ranking.answer(request.candidates, booked)
    }))
}

/// `POST /v2/peer/bookings`: bookings another daemon made, held here too.
async fn peer_bookings(
    State(daemon): State<Arc<Daemon>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|rejection| ApiError::Body(rejection.body_text()))?;
    let batch: crate::peers::PeerBookings =
        serde_json::from_slice(&body).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    daemon.hold_peer_bookings(&batch.bookings, Instant::now(), "received");
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /v2/peer/bookings`: the live bookings held here, for a peer that starts.
async fn held_bookings(State(daemon): State<Arc<Daemon>>) -> Response {
    let now = Instant::now();
    let live = daemon.ledger.lock().live(now);
    axum::Json(crate::peers::handed_on(&live, now)).into_response()
}

/// `POST /v2/salt`: whether a salted request can be routed without tokenizing.
async fn salt_probe(
    State(daemon): State<Arc<Daemon>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    daemon.restored().await;
    let body = question_body(&daemon, body)?;
    let probe: SaltProbe =
        serde_json::from_slice(&body).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    within_max_keys(
        &daemon,
        probe.text.as_ref().map_or(0, Vec::len),
        "text keys",
    )?;
    let answer = daemon.probe(&probe, Instant::now());
    daemon
        .metrics
        .lookup_seconds
        .observe(started.elapsed().as_secs_f64());
    Ok(axum::Json(answer).into_response())
}

/// `POST /v1/lookup`: protocol 1, every endpoint's record (older filters, and people).
async fn lookup_v1(
    State(daemon): State<Arc<Daemon>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    daemon.restored().await;
    let request = read_lookup(&daemon, body, v1::Request::into_current)?;
    Ok(answer(&daemon, started, &request, |ranking, booked| {
        ranking.into_v1(booked)
    }))
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
                "index_entries": daemon.index.read().slot_entries(e.slot),
                "prefill": daemon.speeds.read().get(e.slot.index()),
                "status": *e.status.lock(),
            })
        })
        .collect();
    axum::Json(json!({ "endpoints": endpoints })).into_response()
}

/// `POST /v1/outcomes`: a filter's batch of predictions and what replicas served.
async fn record_outcomes(
    State(daemon): State<Arc<Daemon>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|rejection| ApiError::Body(rejection.body_text()))?;
    let batch: kvaffine_core::outcome::Outcomes =
        serde_json::from_slice(&body).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let limit = crate::outcomes::MAX_FIELD_BYTES;
    if batch.outcomes.iter().any(|o| {
        [&o.endpoint, &o.reason, &o.mode]
            .into_iter()
            .chain(o.model.as_ref())
            .any(|field| field.len() > limit)
    }) {
        return Err(ApiError::BadRequest(format!(
            "an outcome's endpoint, model, reason or mode is longer than {limit} bytes"
        )));
    }
    let count = batch.outcomes.len();
    let followed: std::collections::HashSet<String> = daemon
        .endpoints
        .read()
        .iter()
        .map(|e| e.spec.endpoint.clone())
        .collect();
    daemon.outcomes.lock().record(
        batch.outcomes,
        std::time::SystemTime::now(),
        &daemon.metrics,
        |endpoint| followed.contains(endpoint),
    );
    Ok(axum::Json(json!({ "recorded": count })).into_response())
}

/// `GET /v1/outcomes`: the latest decisions and each replica's recent history.
async fn outcomes(State(daemon): State<Arc<Daemon>>) -> Response {
    let view = daemon.outcomes.lock().view(std::time::SystemTime::now());
    axum::Json(view).into_response()
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
    let booked = daemon.bookings.read().booked_keys();
    daemon.metrics.booked_keys.set(booked as i64);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        daemon.metrics.render(),
    )
        .into_response()
}
