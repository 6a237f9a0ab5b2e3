//! `POST /v2/route`: a filter hands the daemon a request's tokenizer call; the daemon makes
//! it at the least busy replica, keys the answer as the filter would, and ranks, in one
//! callout. The gateway then pays its callout machinery once per request instead of twice
//! and never copies the token list into its VM.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use kvaffine_core::protocol::{LookupRequest, Query, RouteAnswer, RouteRequest};
use kvaffine_core::tokens::{self, PromptKeys};

use crate::http::{ApiError, within_max_keys};
use crate::state::Daemon;

/// The largest route body: the filter's own default `max_body_bytes`, which bounds what
/// it buffers and so what it can hand on.
pub const MAX_ROUTE_BODY_BYTES: usize = 16 * 1024 * 1024;

/// The callout's deadline when the filter names none: the filter's default.
const DEFAULT_TOKENIZE_TIMEOUT: Duration = Duration::from_millis(300);

/// One client for every tokenizer call the daemon makes: its pool keeps a connection to
/// each replica.
fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(reqwest::Client::new)
}

/// `POST /v2/route`.
pub async fn route(
    State(daemon): State<Arc<Daemon>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    daemon.restored().await;
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge(format!(
                "a route body is at most {MAX_ROUTE_BODY_BYTES} bytes"
            ))
        } else {
            ApiError::Body(rejection.body_text())
        }
    })?;
    let (request, call) = RouteRequest::read(&body).map_err(ApiError::BadRequest)?;
    let (router, extras) = request.keys.keying().map_err(ApiError::BadRequest)?;
    let mut tokenize_at = None;
    if let Some(probe) = &request.probe {
        within_max_keys(
            &daemon,
            probe.text.as_ref().map_or(0, Vec::len),
            "text keys",
        )?;
        let answer = daemon.probe(probe, Instant::now());
        if let Some(route) = answer.route {
            daemon
                .metrics
                .lookup_seconds
                .observe(started.elapsed().as_secs_f64());
            return Ok(axum::Json(RouteAnswer {
                route,
                tokens: None,
                tokenized_at: None,
            })
            .into_response());
        }
        tokenize_at = answer.tokenize_at;
    }
    let replica = tokenize_at
        .or_else(|| {
            let unbooked = LookupRequest {
                query: Query::Blocks(Vec::new()),
                model: request.model.clone(),
                book: None,
                candidates: 1,
            };
            daemon.rank(&unbooked, Instant::now()).tokenize_at
        })
        .ok_or_else(|| {
            daemon.metrics.route_tokenize_failures.inc();
            ApiError::Upstream("no usable replica serves the request's model".into())
        })?;
    // The filter gives up on the whole callout at its deadline: the tokenizer call gets
    // what is left of it less a tenth, so that a slow tokenizer is answered with a 502
    // (text keys) before the filter's own timeout leaves the request unpinned.
    let deadline = request
        .timeout_ms
        .map_or(DEFAULT_TOKENIZE_TIMEOUT, Duration::from_millis);
    let timeout = (deadline - deadline / 10).saturating_sub(started.elapsed());
    let call = body.slice_ref(call);
    let tokenizing = Instant::now();
    let tokens = tokenize(&replica, &request.path, call, timeout).await;
    let tokenize_time = tokenizing.elapsed();
    daemon
        .metrics
        .route_tokenize_seconds
        .observe(tokenize_time.as_secs_f64());
    let tokens = tokens.inspect_err(|_| {
        daemon.metrics.route_tokenize_failures.inc();
    })?;
    let prompt = PromptKeys::of(&router, &extras, &tokens, None);
    let count = prompt.tokens;
    let lookup = LookupRequest {
        query: Query::Blocks(prompt.into_servable()),
        model: request.model,
        book: request.book,
        candidates: request.candidates,
    };
    within_max_keys(&daemon, lookup.query.len(), "keys")?;
    let (ranking, booked) = daemon.lookup(&lookup, Instant::now());
    let answer = RouteAnswer {
        route: ranking.answer(lookup.candidates, booked),
        tokens: Some(count),
        tokenized_at: Some(replica),
    };
    // The daemon's own share: the tokenizer's time has a histogram of its own.
    daemon.metrics.lookup_seconds.observe(
        started
            .elapsed()
            .saturating_sub(tokenize_time)
            .as_secs_f64(),
    );
    Ok(axum::Json(answer).into_response())
}

/// The token list `replica` gives `call` at `path` (route callouts and the console's
/// explain tool).
pub async fn tokenize(
    replica: &str,
    path: &str,
    call: Bytes,
    timeout: Duration,
) -> Result<Vec<u32>, ApiError> {
    let answer = client()
        .post(format!("http://{replica}{path}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(call)
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| ApiError::Upstream(format!("{replica}: {e}")))?;
    let status = answer.status();
    let answer = answer
        .bytes()
        .await
        .map_err(|e| ApiError::Upstream(format!("{replica}: {e}")))?;
    if !status.is_success() {
        return Err(ApiError::Upstream(format!(
            "{replica} answered {status}: {}",
            String::from_utf8_lossy(&answer[..answer.len().min(512)])
        )));
    }
    tokens::token_list(&answer)
        .ok_or_else(|| ApiError::Upstream(format!("{replica} answered no token list")))
}
