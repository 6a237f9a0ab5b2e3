//! The operator's console, `GET /ui`: one page and its scripts, built into the binary (no
//! CDN), that reads the daemon's own read-only API. Its "explain a request" tool gets a
//! body's tokens from a replica's tokenizer through `POST /v1/explain`, keys them in the
//! browser with `kvaffine-core` built by wasm-bindgen (`daemon/ui/keys/`, from
//! `cargo xtask npm`), and asks `/v1/lookup` (protocol 1, which books nothing) how many
//! leading blocks each replica holds.
//!
//! The page and its assets carry no data and need no token; every data call carries the
//! token the operator gives the page, when the daemon requires one.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kvaffine_core::config::{Mode, RoutingConfig};
use kvaffine_core::plan::{self, Action};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::ApiError;
use crate::state::Daemon;

const PAGE: &str = include_str!("../ui/index.html");
const SCRIPT: &str = include_str!("../ui/console.js");
const KEYS_SCRIPT: &str = include_str!("../ui/keys/kvaffine_keys.js");
const KEYS_WASM: &[u8] = include_bytes!("../ui/keys/kvaffine_keys_bg.wasm");

/// How long the explain tool waits for a replica's tokenizer.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(10);
/// Explains answered at once; more are refused with 503 rather than queued on the
/// replicas' tokenizers.
const MAX_EXPLAINS: usize = 4;

/// The page's scripts are its own: nothing else may run or be fetched (the keys module
/// needs WebAssembly compilation).
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; style-src 'self' 'unsafe-inline'; img-src 'self' data:";

/// The bound on tokenizer calls, shared by every explain.
fn explain_slots() -> &'static tokio::sync::Semaphore {
    static SLOTS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| tokio::sync::Semaphore::new(MAX_EXPLAINS))
}

/// The page and its assets.
pub fn routes() -> Router<Arc<Daemon>> {
    let asset = |kind: &'static str, body: &'static [u8]| {
        get(move || async move {
            (
                [
                    (header::CONTENT_TYPE, kind),
                    (header::CACHE_CONTROL, "no-cache"),
                    (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
                ],
                body,
            )
        })
    };
    Router::new()
        .route("/ui", asset("text/html; charset=utf-8", PAGE.as_bytes()))
        .route("/ui/", asset("text/html; charset=utf-8", PAGE.as_bytes()))
        .route(
            "/ui/console.js",
            asset("text/javascript; charset=utf-8", SCRIPT.as_bytes()),
        )
        .route(
            "/ui/keys/kvaffine_keys.js",
            asset("text/javascript; charset=utf-8", KEYS_SCRIPT.as_bytes()),
        )
        .route(
            "/ui/keys/kvaffine_keys_bg.wasm",
            asset("application/wasm", KEYS_WASM),
        )
}

/// `POST /v1/explain`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExplainRequest {
    /// The path the body would be sent to (`/v1/chat/completions`, `/v1/responses`,
    /// `/v1/completions`).
    #[serde(default = "default_path")]
    path: String,
    /// The client's request body.
    body: Value,
    /// The route's filter setting of that name (`tokenize` or `render`).
    #[serde(default)]
    chat_tokenize: Option<String>,
}

fn default_path() -> String {
    "/v1/chat/completions".into()
}

/// `POST /v1/explain`: the tokens a replica's tokenizer gives `body`, as the filter would
/// ask for them, with the key options `blockKeys` needs to key them as the daemon does.
pub async fn explain(
    State(daemon): State<Arc<Daemon>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|rejection| ApiError::Body(rejection.body_text()))?;
    let request: ExplainRequest =
        serde_json::from_slice(&body).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let keys = &daemon.settings.keys;
    let mut routing = json!({
        "block_size": keys.block_size(),
        "hash_algo": keys.algo().as_str(),
        "hash_seed": daemon.settings.hash_seed,
        "vllm_compat": keys.compat().as_str(),
        "loras": daemon.settings.lora_paths,
    });
    if let Some(chat_tokenize) = &request.chat_tokenize {
        routing["chat_tokenize"] = json!(chat_tokenize);
    }
    let routing: RoutingConfig =
        serde_json::from_value(routing).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let router = kvaffine_core::config::Router::new(routing)
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let api = router.api(request.path.as_bytes()).ok_or_else(|| {
        ApiError::BadRequest(format!("{} is not an API kvaffine routes", request.path))
    })?;
    let client_body = serde_json::to_vec(&request.body).unwrap_or_default();
    let plan = plan::plan(&router, api, Mode::Precise, &client_body);
    let (path, call) = match plan.action {
        Action::Tokenize { path, body } => (path, body),
        Action::Lookup(_) => {
            return Err(ApiError::BadRequest(
                "the prompt is token ids already: key them directly".into(),
            ));
        }
        Action::Skip(skip) => {
            return Err(ApiError::BadRequest(format!(
                "the filter would not route this body: {}",
                skip.reason()
            )));
        }
        Action::Approximate(_) | Action::LoadOnly => {
            return Err(ApiError::BadRequest(
                "this body is not routed by its tokens".into(),
            ));
        }
    };
    let replica = tokenizer_replica(&daemon, plan.model.as_deref())?;
    let _slot = explain_slots()
        .try_acquire()
        .map_err(|_| ApiError::Overloaded)?;
    let tokens = crate::route::tokenize(&replica, path, call.into(), TOKENIZE_TIMEOUT).await?;
    let extras = plan.extras;
    Ok(axum::Json(json!({
        "tokens": tokens,
        "tokenized_by": replica,
        "model": plan.model,
        "options": {
            "blockSize": keys.block_size(),
            "hashAlgo": keys.algo().as_str(),
            "hashSeed": daemon.settings.hash_seed,
            "vllmCompat": keys.compat().as_str(),
            "cacheSalt": extras.cache_salt.as_ref().map(|s| s.as_str()),
            "loraName": extras.lora.as_ref().map(|l| l.name.as_str()),
            "loraPath": extras.lora.as_ref().map(|l| l.path.as_str()),
        },
    }))
    .into_response())
}

/// A reachable replica to tokenize at: one serving the body's `model`, or any when the
/// body names none or names a LoRA adapter (served on its base model, which the replicas'
/// metrics name). Another model's tokenizer would give other tokens, so a model no
/// reachable replica serves is refused.
fn tokenizer_replica(daemon: &Daemon, model: Option<&str>) -> Result<String, ApiError> {
    let endpoints = daemon.endpoints.read();
    let reachable: Vec<_> = endpoints
        .iter()
        .filter(|e| {
            let status = e.status.lock();
            status.load.is_some() && status.scrape_error.is_none()
        })
        .collect();
    let any = model.is_none_or(|m| daemon.settings.lora_paths.contains_key(m));
    reachable
        .iter()
        .find(|e| any || e.status.lock().model.as_deref() == model)
        .map(|e| e.spec.endpoint.clone())
        .ok_or_else(|| match model {
            Some(model) if !reachable.is_empty() => {
                ApiError::BadRequest(format!("no reachable replica serves the model {model:?}"))
            }
            _ => ApiError::NoReplica,
        })
}
