//! vLLM's HTTP surface, as far as a router or its benchmarks touch it.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvaffine_core::request::template_kwargs;
use kvaffine_core::{CacheSalt, KeyExtras, LoraAdapter};
use parking_lot::Mutex;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::engine::Engine;
use crate::generate::{self, Output};
use crate::template::{self, RenderOptions};
use crate::tokenizer;

/// What the server knows besides the engine.
pub struct App {
    /// `--model`: the served model name.
    pub model: String,
    /// The engine.
    pub engine: Engine,
    /// Longest prompt plus output accepted.
    pub max_model_len: usize,
    /// `--num-gpu-blocks`, for `cache_config_info`.
    pub num_gpu_blocks: usize,
    /// `prefix_caching_hash_algo` as `cache_config_info` reports it.
    pub hash_algo_label: String,
    /// The `/kv_event_sources` answer.
    pub kv_event_sources: Value,
    /// Responses kept for `previous_response_id` (`None`: the store is off, as in vLLM by
    /// default).
    pub responses: Option<Mutex<HashMap<String, crate::responses::Previous>>>,
    /// Process start, seconds since the epoch (`process_start_time_seconds`).
    pub started: f64,
    /// Set by `POST /debug/engine_dead`: the engine is gone while the HTTP server stays.
    /// vLLM 0.32.0 answers so only in the moment before its launcher shuts the server
    /// down (by its code); the emulator holds the state as long as a test needs.
    engine_dead: AtomicBool,
    /// Set by `POST /debug/tokenizer_delay`: how long `/tokenize` and the render paths
    /// wait before answering, in milliseconds (a tokenizer slower than a router's deadline).
    tokenizer_delay_ms: AtomicU64,
    next_id: AtomicU64,
}

impl App {
    /// Server state over `engine`.
    pub fn new(
        model: String,
        engine: Engine,
        max_model_len: usize,
        num_gpu_blocks: usize,
        hash_algo_label: String,
        kv_event_sources: Value,
        responses_store: bool,
    ) -> Self {
        Self {
            model,
            engine,
            max_model_len,
            num_gpu_blocks,
            hash_algo_label,
            kv_event_sources,
            responses: responses_store.then(|| Mutex::new(HashMap::new())),
            started: now(),
            engine_dead: AtomicBool::new(false),
            tokenizer_delay_ms: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
        }
    }

    /// Waits out the tokenizer delay a test set, if any.
    async fn tokenizer_delay(&self) {
        let ms = self.tokenizer_delay_ms.load(Ordering::Relaxed);
        if ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
    }

    fn id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{:012x}",
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An error as vLLM answers it.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    /// What generation answers while the engine is dead.
    fn engine_dead() -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: "EngineCore encountered an issue".into(),
            param: None,
        }
    }
}

/// Generation needs a live engine.
fn alive(app: &App) -> Result<(), ApiError> {
    if app.engine_dead.load(Ordering::Relaxed) {
        return Err(ApiError::engine_dead());
    }
    Ok(())
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::INTERNAL_SERVER_ERROR => "InternalServerError",
            _ => "BadRequestError",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

/// The routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/tokenize", post(tokenize))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/responses/render", post(responses_render))
        .route("/v1/chat/completions/render", post(chat_render))
        .route("/v1/completions/render", post(completion_render))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/kv_event_sources", get(|State(app): State<Arc<App>>| async move { axum::Json(app.kv_event_sources.clone()) }))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/debug/cached_tokens", post(debug_cached_tokens))
        .route("/debug/engine_dead", post(debug_engine_dead))
        .route("/debug/tokenizer_delay", post(debug_tokenizer_delay))
        // Unknown paths read the request body before answering 404, so the connection
        // stays usable for the client's next request (as uvicorn keeps it).
        .fallback(|_: Bytes| async { (StatusCode::NOT_FOUND, axum::Json(json!({"detail": "Not Found"}))) })
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024 * 1024))
        .with_state(app)
}

fn parse(body: &Bytes) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    Ok(value)
}

/// The request's model, LoRA and salt, validated as vLLM validates them.
fn extras(app: &App, body: &Value) -> Result<KeyExtras, ApiError> {
    let lora = match body.get("model").and_then(Value::as_str) {
        None => None,
        Some(name) if name == app.model => None,
        Some(name) => match app.engine.loras.get(name) {
            Some(path) => Some(LoraAdapter {
                name: name.to_owned(),
                path: path.clone(),
            }),
            None => {
                return Err(ApiError {
                    status: StatusCode::NOT_FOUND,
                    message: format!("The model `{name}` does not exist."),
                    param: Some("model"),
                });
            }
        },
    };
    let cache_salt = match body.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(salt)) => Some(CacheSalt::parse(salt).map_err(|e| ApiError {
            status: StatusCode::BAD_REQUEST,
            message: e.to_string(),
            param: Some("cache_salt"),
        })?),
        Some(_) => {
            return Err(ApiError {
                status: StatusCode::BAD_REQUEST,
                message: "cache_salt must be a string".into(),
                param: Some("cache_salt"),
            });
        }
    };
    Ok(KeyExtras { lora, cache_salt })
}

fn flag(body: &Value, key: &str, default: bool) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(format!("{key} must be a boolean"))),
    }
}

fn tools_of(body: &Value) -> Result<Option<Vec<Value>>, ApiError> {
    match body.get("tools") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(tools)) => Ok(Some(tools.clone())),
        Some(_) => Err(ApiError::bad("tools must be an array")),
    }
}

fn messages_of(body: &Value) -> Result<&[Value], ApiError> {
    match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => Ok(m),
        _ => Err(ApiError::bad("messages must be a non-empty array")),
    }
}

/// Renders a chat request exactly as `/tokenize` and chat completions both do.
fn render_chat(
    messages: &[Value],
    tools: Option<&[Value]>,
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: &Map<String, Value>,
) -> Result<String, ApiError> {
    // vLLM validates tools before its template sees them, whoever sent them.
    let tools: Option<Vec<Value>> =
        tools.map(|tools| tools.iter().map(crate::responses::validated_tool).collect());
    template::render(
        messages,
        &RenderOptions {
            tools: tools.as_deref(),
            add_generation_prompt,
            continue_final_message,
            kwargs: Some(kwargs),
        },
    )
    .map_err(|e| ApiError::bad(e.to_string()))
}

/// The messages as vLLM's `/tokenize` hands them to the template: its chat completions
/// rename an assistant turn's deprecated `reasoning_content` to `reasoning`, its
/// `/tokenize` does not, and the template reads only `reasoning` (real vLLM 0.32.0).
fn without_reasoning_content(messages: &[Value]) -> Vec<Value> {
    messages
        .iter()
        .map(|message| {
            let mut message = message.clone();
            if let Some(object) = message.as_object_mut() {
                object.remove("reasoning_content");
            }
            message
        })
        .collect()
}

fn check_length(app: &App, tokens: &[u32]) -> Result<(), ApiError> {
    app.engine
        .check_fits(tokens)
        .map_err(|e| ApiError::bad(e.to_string()))?;
    let tokens = tokens.len();
    if tokens > app.max_model_len {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {} tokens. However, your request has {tokens} input tokens.",
            app.max_model_len
        )));
    }
    Ok(())
}

async fn tokenize(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    app.tokenizer_delay().await;
    let body = parse(&body)?;
    extras(&app, &body)?;
    let return_strs = flag(&body, "return_token_strs", false)?;
    let rendered;
    let text: &str = if body.get("messages").is_some() {
        if body.get("chat_template").is_some_and(|t| !t.is_null())
            || body
                .get("chat_template_kwargs")
                .and_then(|k| k.get("chat_template"))
                .is_some()
        {
            return Err(ApiError::bad(
                "Chat template is passed with request, but --trust-request-chat-template is not set. Refused request with untrusted chat template.",
            ));
        }
        let kwargs = match body.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(k)) => k.clone(),
            Some(_) => return Err(ApiError::bad("chat_template_kwargs must be an object")),
        };
        let tools = tools_of(&body)?;
        rendered = render_chat(
            &without_reasoning_content(messages_of(&body)?),
            tools.as_deref(),
            flag(&body, "add_generation_prompt", true)?,
            flag(&body, "continue_final_message", false)?,
            &kwargs,
        )?;
        &rendered
    } else {
        let Some(prompt) = body.get("prompt").and_then(Value::as_str) else {
            return Err(ApiError::bad(
                "either `prompt` (a string) or `messages` is required",
            ));
        };
        prompt
    };
    // Ids alone unless the pieces are asked for, written straight from the vector: a
    // string and a JSON value per token had made the emulator's "instant" tokenizer take
    // 1.1 ms for 10,417 tokens (half of it allocation, 2026-12-06).
    let (tokens, token_strs) = if return_strs {
        let pieces = tokenizer::tokenize(text);
        let ids = pieces.iter().map(|(id, _)| *id).collect();
        (
            ids,
            Some(pieces.into_iter().map(|(_, piece)| piece).collect()),
        )
    } else {
        (tokenizer::token_ids(text), None)
    };
    Ok(axum::Json(Tokenized {
        count: tokens.len(),
        max_model_len: app.max_model_len,
        tokens,
        token_strs,
    })
    .into_response())
}

/// `/tokenize`'s answer, its fields in vLLM's order.
#[derive(serde::Serialize)]
struct Tokenized {
    count: usize,
    max_model_len: usize,
    tokens: Vec<u32>,
    token_strs: Option<Vec<String>>,
}

fn max_tokens(body: &Value, keys: &[&str], default: usize) -> Result<usize, ApiError> {
    for key in keys {
        match body.get(*key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                return v
                    .as_u64()
                    .filter(|n| *n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| ApiError::bad(format!("{key} must be a positive integer")));
            }
        }
    }
    Ok(default)
}

fn usage(prompt: usize, cached: usize, output: &Output) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": output.tokens.len(),
        "total_tokens": prompt + output.tokens.len(),
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Runs a non-streamed request in its own task, so a client that disconnects cannot
/// leave its admission (running count, held blocks) behind: the engine finishes it, as
/// vLLM finishes or aborts a request whatever the HTTP side does.
async fn run_to_end(
    app: &Arc<App>,
    prompt: &[u32],
    extras: &KeyExtras,
    output: &Output,
) -> Result<usize, ApiError> {
    let (app, prompt, extras, output) =
        (app.clone(), prompt.to_vec(), extras.clone(), output.clone());
    tokio::spawn(async move { run(&app, &prompt, &extras, &output, |_| {}, |_| {}).await })
        .await
        .map_err(|e| ApiError::bad(format!("the request's task failed: {e}")))?
}

/// Runs one request through the engine, streaming each generated piece to `on_piece` as
/// its decode step completes. Returns the prompt's cached tokens.
async fn run(
    app: &App,
    prompt: &[u32],
    extras: &KeyExtras,
    output: &Output,
    mut on_first: impl FnMut(usize),
    mut on_piece: impl FnMut(&(Option<&'static str>, String)),
) -> Result<usize, ApiError> {
    let mut admission = app
        .engine
        .admit(prompt, extras)
        .await
        .map_err(|e| ApiError::bad(e.to_string()))?;
    // Known once scheduled: blocks cached while it waited count too.
    app.engine.prefill(prompt, extras, &mut admission).await;
    let cached = admission.cached_tokens;
    on_first(cached);
    for piece in &output.pieces {
        app.engine.decode_step().await;
        on_piece(piece);
    }
    let mut all = prompt.to_vec();
    all.extend(&output.tokens);
    app.engine.finish(&all, extras, admission);
    Ok(cached)
}

fn sse(event: Option<&str>, data: &Value) -> Bytes {
    match event {
        Some(name) => Bytes::from(format!("event: {name}\ndata: {data}\n\n")),
        None => Bytes::from(format!("data: {data}\n\n")),
    }
}

fn stream_response(rx: mpsc::UnboundedReceiver<Bytes>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The tool the emulated model calls: the first one offered, when tools are offered (and
/// not refused with `tool_choice: "none"`) right after a user turn.
fn offered_tool<'a>(
    tools: Option<&'a [Value]>,
    messages: &[Value],
    body: &Value,
) -> Option<&'a str> {
    let after_user = messages
        .last()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        == Some("user");
    let refused = body.get("tool_choice").and_then(Value::as_str) == Some("none");
    tools?
        .first()?
        .pointer("/function/name")
        .and_then(Value::as_str)
        .filter(|_| after_user && !refused)
}

/// What a Responses request is rendered from.
struct ResponsesInput {
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    chat_template_kwargs: Map<String, Value>,
}

/// A Responses request as vLLM renders it: converted to chat messages, then templated.
fn responses_prompt(
    body: &Value,
    previous: Option<&crate::responses::Previous>,
) -> Result<(ResponsesInput, Vec<u32>), ApiError> {
    let bad = |e: String| ApiError::bad(e);
    let input = ResponsesInput {
        messages: crate::responses::messages(body, previous).map_err(|e| bad(e.to_string()))?,
        tools: crate::responses::tools(body),
        chat_template_kwargs: template_kwargs(body).map_err(|e| bad(e.to_string()))?,
    };
    let text = render_chat(
        &input.messages,
        input.tools.as_deref(),
        true,
        false,
        &input.chat_template_kwargs,
    )?;
    let prompt = tokenizer::token_ids(&text);
    Ok((input, prompt))
}

/// The model a response names: the request's, or the served one.
fn model_name(app: &App, body: &Value) -> String {
    body.get("model")
        .and_then(Value::as_str)
        .unwrap_or(&app.model)
        .to_owned()
}

fn seed_of(body: &Value) -> u64 {
    body.get("seed").and_then(Value::as_u64).unwrap_or(0)
}

async fn chat_completions(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    alive(&app)?;
    let body = parse(&body)?;
    let extras = extras(&app, &body)?;
    let messages = messages_of(&body)?;
    let tools = tools_of(&body)?;
    let kwargs = template_kwargs(&body).map_err(|e| ApiError::bad(e.to_string()))?;
    let prompt = chat_prompt(&body)?;
    check_length(&app, &prompt)?;
    let limit = max_tokens(&body, &["max_completion_tokens", "max_tokens"], 32)?;
    let tool_name = offered_tool(tools.as_deref(), messages, &body);
    let output = generate::chat(
        &prompt,
        seed_of(&body),
        limit,
        template::thinks(Some(&kwargs)),
        tool_name,
    );
    let id = app.id("chatcmpl");
    let created = now() as u64;
    let model = model_name(&app, &body);
    if flag(&body, "stream", false)? {
        let include_usage = body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let (tx, rx) = mpsc::unbounded_channel();
        let chunk = {
            let (id, model) = (id.clone(), model.clone());
            move |delta: Value, finish: Option<&str>| {
                json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
            }
        };
        tokio::spawn(async move {
            let send = |b: Bytes| {
                let _ = tx.send(b);
            };
            let result = run(
                &app,
                &prompt,
                &extras,
                &output,
                |_| {
                    send(sse(
                        None,
                        &chunk(json!({"role": "assistant", "content": ""}), None),
                    ))
                },
                |(field, piece)| {
                    if let Some(field) = field {
                        send(sse(None, &chunk(json!({ *field: piece }), None)));
                    }
                },
            )
            .await;
            if let Ok(cached) = result {
                if let Some((call, name, arguments)) = &output.tool_call {
                    let delta = json!({"tool_calls": [{"index": 0, "id": call, "type": "function",
                                        "function": {"name": name, "arguments": arguments}}]});
                    send(sse(None, &chunk(delta, None)));
                }
                send(sse(None, &chunk(json!({}), Some(output.finish_reason))));
                if include_usage {
                    let body = json!({"id": id, "object": "chat.completion.chunk", "created": created,
                                      "model": model, "choices": [], "usage": usage(prompt.len(), cached, &output)});
                    send(sse(None, &body));
                }
            }
            send(Bytes::from_static(b"data: [DONE]\n\n"));
        });
        return Ok(stream_response(rx));
    }
    let cached = run_to_end(&app, &prompt, &extras, &output).await?;
    let mut message = generate::message(&output);
    if output.tool_call.is_some() && output.content.is_empty() {
        message["content"] = Value::Null;
    }
    Ok(axum::Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": output.finish_reason}],
        "usage": usage(prompt.len(), cached, &output),
    }))
    .into_response())
}

async fn completions(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    alive(&app)?;
    let body = parse(&body)?;
    let extras = extras(&app, &body)?;
    let prompt = completion_prompt(&body)?;
    check_length(&app, &prompt)?;
    let limit = max_tokens(&body, &["max_tokens"], 16)?;
    let output = generate::completion(&prompt, seed_of(&body), limit);
    let id = app.id("cmpl");
    let created = now() as u64;
    let model = model_name(&app, &body);
    if flag(&body, "stream", false)? {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let send = |b: Bytes| {
                let _ = tx.send(b);
            };
            let chunk = |text: &str, finish: Option<&str>| {
                json!({"id": id, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]})
            };
            let result = run(
                &app,
                &prompt,
                &extras,
                &output,
                |_| {},
                |(_, piece)| send(sse(None, &chunk(piece, None))),
            )
            .await;
            if result.is_ok() {
                send(sse(None, &chunk("", Some(output.finish_reason))));
            }
            send(Bytes::from_static(b"data: [DONE]\n\n"));
        });
        return Ok(stream_response(rx));
    }
    let cached = run_to_end(&app, &prompt, &extras, &output).await?;
    Ok(axum::Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": output.content, "logprobs": null, "finish_reason": output.finish_reason}],
        "usage": usage(prompt.len(), cached, &output),
    }))
    .into_response())
}

fn response_output(app: &App, output: &Output) -> Vec<Value> {
    let mut items = Vec::new();
    if let Some(reasoning) = &output.reasoning {
        items.push(
            json!({"type": "reasoning", "id": app.id("rs"), "summary": [],
                          "content": [{"type": "reasoning_text", "text": reasoning}]}),
        );
    }
    if let Some((call, name, arguments)) = &output.tool_call {
        items.push(
            json!({"type": "function_call", "id": app.id("fc"), "call_id": call,
                          "name": name, "arguments": arguments, "status": "completed"}),
        );
    } else {
        items.push(json!({"type": "message", "id": app.id("msg"), "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": output.content, "annotations": []}]}));
    }
    items
}

async fn responses(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    alive(&app)?;
    let body = parse(&body)?;
    let extras = extras(&app, &body)?;
    let previous = match body.get("previous_response_id").and_then(Value::as_str) {
        None => None,
        Some(id) => app
            .responses
            .as_ref()
            .and_then(|store| store.lock().get(id).cloned())
            .ok_or_else(|| ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("Response with id '{id}' not found."),
                param: Some("previous_response_id"),
            })
            .map(Some)?,
    };
    let (input, prompt) = responses_prompt(&body, previous.as_ref())?;
    check_length(&app, &prompt)?;
    let limit = max_tokens(&body, &["max_output_tokens"], 32)?;
    let tool_name = offered_tool(input.tools.as_deref(), &input.messages, &body);
    let output = generate::chat(
        &prompt,
        seed_of(&body),
        limit,
        template::thinks(Some(&input.chat_template_kwargs)),
        tool_name,
    );
    let id = app.id("resp");
    let items = response_output(&app, &output);
    let store = flag(&body, "store", true)?;
    let reasoning_tokens = output
        .pieces
        .iter()
        .filter(|(f, _)| *f == Some("reasoning_content"))
        .count();
    let (prompt_len, output_len) = (prompt.len(), output.tokens.len());
    let previous_id = body.get("previous_response_id").cloned();
    let instructions = body.get("instructions").cloned();
    let store_app = app.clone();
    let conversation = input.messages;
    let finish = move |cached: usize| {
        if let (true, Some(responses)) = (store, &store_app.responses) {
            let previous = crate::responses::Previous {
                messages: conversation.clone(),
                output: items.clone(),
            };
            responses.lock().insert(id.clone(), previous);
        }
        json!({
            "id": id, "object": "response", "created_at": now() as u64, "model": store_app.model,
            "status": "completed", "output": items, "store": store && store_app.responses.is_some(),
            "previous_response_id": previous_id,
            "instructions": instructions,
            "usage": {
                "input_tokens": prompt_len,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output_len,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": prompt_len + output_len,
            },
        })
    };
    if flag(&body, "stream", false)? {
        let (tx, rx) = mpsc::unbounded_channel();
        let app = app.clone();
        tokio::spawn(async move {
            let send = |b: Bytes| {
                let _ = tx.send(b);
            };
            let created =
                json!({"type": "response.created", "response": {"status": "in_progress"}});
            let result = run(
                &app,
                &prompt,
                &extras,
                &output,
                |_| send(sse(Some("response.created"), &created)),
                |(field, piece)| {
                    let kind = match field {
                        Some("reasoning_content") => "response.reasoning_text.delta",
                        Some("content") => "response.output_text.delta",
                        _ => return,
                    };
                    send(sse(Some(kind), &json!({"type": kind, "delta": piece})));
                },
            )
            .await;
            if let Ok(cached) = result {
                let done = json!({"type": "response.completed", "response": finish(cached)});
                send(sse(Some("response.completed"), &done));
            }
        });
        return Ok(stream_response(rx));
    }
    let cached = run_to_end(&app, &prompt, &extras, &output).await?;
    Ok(axum::Json(finish(cached)).into_response())
}

/// A chat request's prompt tokens: its messages rendered with the template.
fn chat_prompt(body: &Value) -> Result<Vec<u32>, ApiError> {
    let tools = tools_of(body)?;
    let kwargs = template_kwargs(body).map_err(|e| ApiError::bad(e.to_string()))?;
    let text = render_chat(
        messages_of(body)?,
        tools.as_deref(),
        flag(body, "add_generation_prompt", true)?,
        flag(body, "continue_final_message", false)?,
        &kwargs,
    )?;
    Ok(tokenizer::token_ids(&text))
}

/// A completions request's prompt tokens: the text tokenized, or the ids given.
fn completion_prompt(body: &Value) -> Result<Vec<u32>, ApiError> {
    match body.get("prompt") {
        Some(Value::String(text)) => Ok(tokenizer::token_ids(text)),
        Some(Value::Array(ids)) if !ids.is_empty() && ids.iter().all(Value::is_u64) => ids
            .iter()
            .filter_map(Value::as_u64)
            .map(|t| u32::try_from(t).map_err(|_| ApiError::bad("token ids must fit in 32 bits")))
            .collect(),
        _ => Err(ApiError::bad(
            "prompt must be a string or a non-empty list of token ids",
        )),
    }
}

/// What vLLM's render endpoints answer (a `GenerateRequest`): the tokens a router keys.
fn rendered(app: &App, body: &Value, tokens: Vec<u32>, max_tokens: Option<&Value>) -> Response {
    axum::Json(json!({
        "request_id": app.id("render"),
        "token_ids": tokens,
        "features": null,
        "sampling_params": {"max_tokens": max_tokens},
        "cache_salt": body.get("cache_salt"),
    }))
    .into_response()
}

/// `POST /v1/chat/completions/render` (vLLM with `--enable-scale-out`).
async fn chat_render(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    app.tokenizer_delay().await;
    let body = parse(&body)?;
    extras(&app, &body)?;
    let tokens = chat_prompt(&body)?;
    let limit = body
        .get("max_completion_tokens")
        .filter(|v| !v.is_null())
        .or_else(|| body.get("max_tokens"));
    Ok(rendered(&app, &body, tokens, limit))
}

/// `POST /v1/completions/render` (vLLM with `--enable-scale-out`).
async fn completion_render(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    app.tokenizer_delay().await;
    let body = parse(&body)?;
    extras(&app, &body)?;
    let tokens = completion_prompt(&body)?;
    Ok(rendered(&app, &body, tokens, body.get("max_tokens")))
}

/// `POST /v1/responses/render` (vLLM with `--enable-scale-out`): the token ids a Responses
/// request would be prefilled with, as a `GenerateRequest`.
async fn responses_render(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    app.tokenizer_delay().await;
    let body = parse(&body)?;
    extras(&app, &body)?;
    if body
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(ApiError::bad(
            "previous_response_id is not supported by the render endpoint",
        ));
    }
    let (_, tokens) = responses_prompt(&body, None)?;
    Ok(rendered(&app, &body, tokens, body.get("max_output_tokens")))
}

/// 200 while the engine lives; 503 once it is dead, as vLLM's `/health` answers.
async fn health(State(app): State<Arc<App>>) -> StatusCode {
    if app.engine_dead.load(Ordering::Relaxed) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

/// `{"dead": true}` kills the engine (generation answers 500, `/health` 503) and
/// `{"dead": false}` revives it: a fault for the tests.
async fn debug_engine_dead(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse(&body)?;
    let dead = body
        .get("dead")
        .and_then(Value::as_bool)
        .ok_or_else(|| ApiError::bad("`dead` must be true or false"))?;
    app.engine_dead.store(dead, Ordering::Relaxed);
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `{"ms": N}` makes `/tokenize` and the render paths wait N milliseconds before they
/// answer (0: at once): a fault for the tests.
async fn debug_tokenizer_delay(
    State(app): State<Arc<App>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body = parse(&body)?;
    let ms = body
        .get("ms")
        .and_then(Value::as_u64)
        .ok_or_else(|| ApiError::bad("`ms` must be a whole number of milliseconds"))?;
    app.tokenizer_delay_ms.store(ms, Ordering::Relaxed);
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Emulator only (benchmark oracles): how many prompt tokens of this chat request this
/// replica would serve from its cache now, and the prompt's length.
async fn debug_cached_tokens(
    State(app): State<Arc<App>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body = parse(&body)?;
    let extras = extras(&app, &body)?;
    let prompt = chat_prompt(&body)?;
    let cached = app.engine.cached_tokens(&prompt, &extras);
    Ok(axum::Json(json!({"cached_tokens": cached, "prompt_tokens": prompt.len()})).into_response())
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let created = app.started as u64;
    let mut data = vec![
        json!({"id": app.model, "object": "model", "created": created, "owned_by": "vllm",
                               "root": app.model, "parent": null, "max_model_len": app.max_model_len}),
    ];
    for name in app.engine.loras.keys() {
        data.push(json!({"id": name, "object": "model", "created": created, "owned_by": "vllm",
                         "root": app.engine.loras.get(name), "parent": app.model, "max_model_len": null}));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let stats = app.engine.stats();
    let labels = format!("engine=\"0\",model_name=\"{}\"", app.model);
    let block_size = app.engine.keys().block_size();
    let text = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{{labels}}} {running}\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{{labels}}} {waiting}\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{{labels}}} {usage}\n\
         # HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n\
         # TYPE vllm:prefix_cache_queries_total counter\n\
         vllm:prefix_cache_queries_total{{{labels}}} {queries}\n\
         # HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n\
         # TYPE vllm:prefix_cache_hits_total counter\n\
         vllm:prefix_cache_hits_total{{{labels}}} {hits}\n\
         # HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{block_size}\",enable_prefix_caching=\"True\",{labels},num_gpu_blocks=\"{blocks}\",prefix_caching_hash_algo=\"{algo}\"}} 1.0\n\
         # HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.\n\
         # TYPE vllm:request_prefill_time_seconds histogram\n\
         vllm:request_prefill_time_seconds_bucket{{{labels},le=\"+Inf\"}} {finished}\n\
         vllm:request_prefill_time_seconds_count{{{labels}}} {finished}\n\
         vllm:request_prefill_time_seconds_sum{{{labels}}} {prefill_seconds}\n\
         # HELP vllm:request_prefill_kv_computed_tokens Histogram of new KV tokens computed during prefill (excluding cached tokens).\n\
         # TYPE vllm:request_prefill_kv_computed_tokens histogram\n\
         vllm:request_prefill_kv_computed_tokens_bucket{{{labels},le=\"+Inf\"}} {finished}\n\
         vllm:request_prefill_kv_computed_tokens_count{{{labels}}} {finished}\n\
         vllm:request_prefill_kv_computed_tokens_sum{{{labels}}} {computed_tokens}\n\
         # HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n\
         # TYPE process_start_time_seconds gauge\n\
         process_start_time_seconds {started}\n",
        running = stats.running,
        waiting = stats.waiting,
        usage = stats.kv_cache_usage,
        queries = stats.prefix_queries,
        hits = stats.prefix_hits,
        finished = stats.finished,
        prefill_seconds = stats.prefill_seconds,
        computed_tokens = stats.computed_tokens,
        blocks = app.num_gpu_blocks,
        algo = app.hash_algo_label,
        started = app.started,
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn reset_prefix_cache(State(app): State<Arc<App>>) -> Response {
    if app.engine.reset() {
        StatusCode::OK.into_response()
    } else {
        (
            StatusCode::CONFLICT,
            "requests are running; the prefix cache was not reset\n",
        )
            .into_response()
    }
}
