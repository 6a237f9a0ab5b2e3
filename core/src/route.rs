//! Turning a buffered request into the question kvaffine asks the index, and the index's
//! answer into a pick. The filter is glue around these functions: everything it decides is
//! decided here, natively tested.
//!
//! request body -> [`plan`] -> (tokenize call -> [`keys_from_tokenize`]) -> keys ->
//! [`lookup_body`] -> index -> [`parse_lookup`] -> header values.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::keys::{
    DigestCache, HashAlgo, KeyConfig, KeyConfigError, KeyExtras, LoraAdapter, VllmCompat,
};
use crate::request::{self, ChatInput, RequestError};
use crate::salt::CacheSalt;

/// How the filter finds a replica for a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Exact tokens from `/tokenize`, vLLM's block keys, the KV-event index.
    #[default]
    Precise,
    /// Keys from the request text, matched against where earlier requests were sent (no
    /// tokenizer call; wrong wherever the chat template is not append-only).
    Approximate,
    /// No prefix information: the least loaded replica.
    Load,
    /// Strip routing headers and pass through.
    Off,
}

/// How Responses bodies are tokenized (`/tokenize` does not take them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponsesTokenize {
    /// Convert to the chat form as vLLM's `construct_input_messages` does.
    #[default]
    Convert,
    /// `POST /v1/responses/render` (vLLM with `--enable-scale-out`).
    Render,
}

/// Which gateway the filter runs in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Host {
    /// Callouts by cluster name; pin with the endpoint header; clear the route cache.
    #[default]
    Envoy,
    /// Callouts by `host:port`; pin with the `kong.service.target` property.
    Kong,
}

fn default_paths() -> Vec<String> {
    ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
        .map(str::to_owned)
        .to_vec()
}

/// The filter's configuration, as JSON in the gateway's plugin configuration.
/// (`Serialize` prints the defaults into the generated configuration reference.)
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FilterConfig {
    /// Upstream of `/tokenize` calls: an Envoy cluster, or `host:port` on Kong.
    pub tokenizer_cluster: String,
    /// `:authority` of tokenize calls (default: the cluster name).
    #[serde(default)]
    pub tokenizer_authority: Option<String>,
    /// Upstream of the index daemon.
    pub index_cluster: String,
    /// `:authority` of lookups (default: the cluster name).
    #[serde(default)]
    pub index_authority: Option<String>,
    /// Bearer token sent with every lookup, for a kvaffined started with
    /// `--auth-token-file` (default: none).
    #[serde(default)]
    pub index_token: Option<String>,
    /// vLLM's `--block-size`.
    pub block_size: usize,
    /// vLLM's `--prefix-caching-hash-algo`.
    #[serde(default = "default_algo")]
    pub hash_algo: String,
    /// The replicas' `PYTHONHASHSEED`, if set.
    #[serde(default)]
    pub hash_seed: Option<String>,
    /// `0.31` (tagged extra keys) or `0.30`.
    #[serde(default = "default_compat")]
    pub vllm_compat: String,
    /// Default mode; routes may override it in metadata.
    #[serde(default)]
    pub mode: Mode,
    /// Deadline of each callout, milliseconds.
    #[serde(default = "default_timeout")]
    pub timeout_ms: u64,
    /// Paths routed (POST only); anything else passes through.
    #[serde(default = "default_paths")]
    pub paths: Vec<String>,
    /// Larger bodies are forwarded unrouted.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Ranked fallbacks sent after the pick.
    #[serde(default = "default_fallbacks")]
    pub fallbacks: usize,
    /// Book each pick so siblings that arrive before its events follow it.
    #[serde(default = "default_true")]
    pub book: bool,
    /// How Responses bodies are tokenized.
    #[serde(default)]
    pub responses_tokenize: ResponsesTokenize,
    /// LoRA adapters: model name -> adapter path as the replicas load it.
    #[serde(default)]
    pub loras: HashMap<String, String>,
    /// Bytes of request text per approximate key.
    #[serde(default = "default_chunk")]
    pub approximate_chunk_bytes: usize,
    /// The gateway: `envoy` (callouts to clusters, pin by header) or `kong` (callouts to
    /// `host:port`, pin by the `kong.service.target` property).
    #[serde(default)]
    pub host: Host,
    /// Request header that carries the pick (Envoy's override_host source).
    #[serde(default = "default_endpoint_header")]
    pub endpoint_header: String,
    /// Request header that carries the body's `model`, for model-to-pool routes.
    #[serde(default = "default_model_header")]
    pub model_header: String,
}

fn default_algo() -> String {
    "sha256_cbor".into()
}
fn default_compat() -> String {
    "0.31".into()
}
fn default_timeout() -> u64 {
    300
}
fn default_max_body() -> usize {
    16 * 1024 * 1024
}
fn default_fallbacks() -> usize {
    1
}
fn default_true() -> bool {
    true
}
fn default_chunk() -> usize {
    256
}
fn default_endpoint_header() -> String {
    "x-gateway-destination-endpoint".into()
}
fn default_model_header() -> String {
    "x-kvaffine-model".into()
}

/// Why a filter configuration is refused (the gateway then rejects it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Not JSON of the expected shape.
    #[error("invalid filter configuration: {0}")]
    Json(#[from] serde_json::Error),
    /// Key settings vLLM keys cannot match.
    #[error(transparent)]
    Keys(#[from] KeyConfigError),
    /// A value out of range.
    #[error("invalid filter configuration: {0}")]
    Invalid(&'static str),
}

/// A validated configuration with its key configuration built once.
#[derive(Clone, Debug)]
pub struct Router {
    /// What was configured.
    pub config: FilterConfig,
    /// How replicas key blocks.
    pub keys: KeyConfig,
}

impl Router {
    /// Parses and validates the plugin configuration.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let config: FilterConfig = serde_json::from_slice(bytes)?;
        let algo: HashAlgo = config.hash_algo.parse()?;
        let compat: VllmCompat = config.vllm_compat.parse()?;
        let keys = KeyConfig::new(algo, config.block_size, config.hash_seed.as_deref(), compat)?;
        if config.approximate_chunk_bytes == 0 {
            return Err(ConfigError::Invalid(
                "approximate_chunk_bytes must be at least 1",
            ));
        }
        if config.timeout_ms == 0 {
            return Err(ConfigError::Invalid("timeout_ms must be at least 1"));
        }
        if config.endpoint_header.is_empty() || config.model_header.is_empty() {
            return Err(ConfigError::Invalid("header names must not be empty"));
        }
        Ok(Self { config, keys })
    }

    /// The API a POST to `path` (query string ignored) is, if it is routed. A configured
    /// path also matches under a route prefix the gateway rewrites away
    /// (`/approximate/v1/chat/completions`).
    pub fn api(&self, path: &[u8]) -> Option<Api> {
        let path = path.split(|b| *b == b'?').next().unwrap_or(path);
        if !self
            .config
            .paths
            .iter()
            .any(|p| path.ends_with(p.as_bytes()))
        {
            return None;
        }
        Api::of(path)
    }
}

/// The request APIs kvaffine understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    ChatCompletions,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses`.
    Responses,
}

impl Api {
    fn of(path: &[u8]) -> Option<Self> {
        if path.ends_with(b"/chat/completions") {
            Some(Self::ChatCompletions)
        } else if path.ends_with(b"/completions") {
            Some(Self::Completions)
        } else if path.ends_with(b"/responses") {
            Some(Self::Responses)
        } else {
            None
        }
    }
}

/// Why a request is forwarded without a pick. Every variant is a pass-through with the
/// body unchanged: the replica answers it as it would without kvaffine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// The body is not JSON (the replica answers its own 400).
    NotJson,
    /// The body is JSON but not an object.
    NotAnObject,
    /// vLLM will reject the salt with a 400.
    InvalidCacheSalt,
    /// `previous_response_id` history lives in one replica's memory, unknown to kvaffine.
    PreviousResponse,
    /// The body cannot be rendered (vLLM answers 400 too).
    Unrenderable(String),
    /// No prompt in the body.
    NoPrompt,
}

impl Skip {
    /// The `x-kvaffine-reason` value.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotJson => "unparsed-body",
            Self::NotAnObject => "unparsed-body",
            Self::InvalidCacheSalt => "invalid-cache-salt",
            Self::PreviousResponse => "previous-response",
            Self::Unrenderable(_) => "unrenderable",
            Self::NoPrompt => "no-prompt",
        }
    }
}

/// The next step for a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Call the tokenizer: `POST path` with `body`.
    Tokenize {
        /// `/tokenize` or `/v1/responses/render`.
        path: &'static str,
        /// The JSON body.
        body: Vec<u8>,
    },
    /// Keys are known already (token-id prompts).
    Lookup(PromptKeys),
    /// Approximate keys from the text.
    Approximate(Vec<u64>),
    /// No keys: rank by load.
    LoadOnly,
    /// Forward unpinned.
    Skip(Skip),
}

/// What kvaffine learned from a request body.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The body's `model`, for the model header and the lookup.
    pub model: Option<String>,
    /// Salt and LoRA that enter the keys.
    pub extras: KeyExtras,
    /// The next step.
    pub action: Action,
}

fn skip(model: Option<String>, why: Skip) -> Plan {
    Plan {
        model,
        extras: KeyExtras::default(),
        action: Action::Skip(why),
    }
}

/// The text an approximate key is made from: roles and contents in order.
fn chat_text(messages: &[Value]) -> String {
    let mut text = String::new();
    for message in messages {
        text.push_str(message.get("role").and_then(Value::as_str).unwrap_or(""));
        text.push('\n');
        if let Some(content) = message.get("content").and_then(request::content_text) {
            text.push_str(&content);
        }
        if let Some(calls) = message.get("tool_calls") {
            text.push_str(&calls.to_string());
        }
        text.push('\n');
    }
    text
}

fn tokenize_chat_body(model: Option<&str>, input: &ChatInput, body: &Value) -> Vec<u8> {
    let flag = |key: &str, default: bool| body.get(key).and_then(Value::as_bool).unwrap_or(default);
    let mut call = Map::new();
    if let Some(model) = model {
        call.insert("model".into(), json!(model));
    }
    call.insert("messages".into(), json!(input.messages));
    call.insert(
        "add_generation_prompt".into(),
        json!(flag("add_generation_prompt", true)),
    );
    call.insert(
        "continue_final_message".into(),
        json!(flag("continue_final_message", false)),
    );
    if let Some(tools) = &input.tools {
        call.insert("tools".into(), json!(tools));
    }
    if !input.chat_template_kwargs.is_empty() {
        call.insert(
            "chat_template_kwargs".into(),
            Value::Object(input.chat_template_kwargs.clone()),
        );
    }
    Value::Object(call).to_string().into_bytes()
}

/// Whether a message carries `reasoning_content` without `reasoning`. vLLM's chat
/// completions read the deprecated `reasoning_content` as `reasoning` (and render it), but
/// its `/tokenize` passes only `reasoning` to the template (seen on real vLLM 0.32.0), so
/// such a turn must reach `/tokenize` with `reasoning` set too.
fn reasoning_unnamed(message: &Value) -> bool {
    message
        .get("reasoning_content")
        .is_some_and(|r| !r.is_null())
        && message.get("reasoning").is_none_or(Value::is_null)
}

/// Gives every such message's `reasoning_content` as `reasoning` too (both keys stay, for
/// versions that read either).
fn name_reasoning(messages: &mut [Value]) {
    for message in messages {
        if reasoning_unnamed(message) {
            if let Some(object) = message.as_object_mut() {
                let reasoning = object.get("reasoning_content").cloned().unwrap_or_default();
                object.insert("reasoning".into(), reasoning);
            }
        }
    }
}

/// Reads a buffered request body and decides the next step in `mode` (the configured one,
/// or a route's override).
pub fn plan(router: &Router, api: Api, mode: Mode, body: &[u8]) -> Plan {
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return skip(None, Skip::NotJson);
    };
    if !value.is_object() {
        return skip(None, Skip::NotAnObject);
    }
    let model = value
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let cache_salt = match value.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match CacheSalt::parse(s) {
            Ok(salt) => Some(salt),
            Err(_) => return skip(model, Skip::InvalidCacheSalt),
        },
        Some(_) => return skip(model, Skip::InvalidCacheSalt),
    };
    let lora = model.as_ref().and_then(|name| {
        router.config.loras.get(name).map(|path| LoraAdapter {
            name: name.clone(),
            path: path.clone(),
        })
    });
    let extras = KeyExtras { lora, cache_salt };
    let action = if mode == Mode::Load {
        Action::LoadOnly
    } else {
        match plan_api(router, api, mode, body, &value, model.as_deref(), &extras) {
            Ok(action) => action,
            Err(why) => return skip(model, why),
        }
    };
    Plan {
        model,
        extras,
        action,
    }
}

fn plan_api(
    router: &Router,
    api: Api,
    mode: Mode,
    body: &[u8],
    value: &Value,
    model: Option<&str>,
    extras: &KeyExtras,
) -> Result<Action, Skip> {
    let unrenderable = |e: RequestError| Skip::Unrenderable(e.to_string());
    let approximate =
        |text: &str| Action::Approximate(approximate_keys(router, model, extras, text));
    Ok(match api {
        Api::ChatCompletions => {
            let messages = value
                .get("messages")
                .and_then(Value::as_array)
                .ok_or(Skip::NoPrompt)?;
            let kwargs = request::template_kwargs(value).map_err(unrenderable)?;
            let no_effort = value.get("reasoning_effort").is_none_or(Value::is_null);
            let unnamed = messages.iter().any(reasoning_unnamed);
            match mode {
                Mode::Approximate => approximate(&chat_text(messages)),
                // `/tokenize` accepts and ignores the chat-completions fields it does not
                // know, so the body goes as it came, unless reasoning must be named or
                // `reasoning_effort` folded into the template arguments (`/tokenize`
                // cannot take it).
                _ if no_effort && !unnamed => Action::Tokenize {
                    path: "/tokenize",
                    body: body.to_vec(),
                },
                _ if no_effort => {
                    let mut patched = value.clone();
                    if let Some(messages) =
                        patched.get_mut("messages").and_then(Value::as_array_mut)
                    {
                        name_reasoning(messages);
                    }
                    Action::Tokenize {
                        path: "/tokenize",
                        body: patched.to_string().into_bytes(),
                    }
                }
                _ => {
                    let mut messages = messages.clone();
                    name_reasoning(&mut messages);
                    let input = ChatInput {
                        messages,
                        tools: value.get("tools").and_then(Value::as_array).cloned(),
                        chat_template_kwargs: kwargs,
                    };
                    Action::Tokenize {
                        path: "/tokenize",
                        body: tokenize_chat_body(model, &input, value),
                    }
                }
            }
        }
        Api::Completions => match value.get("prompt") {
            Some(Value::String(prompt)) => match mode {
                Mode::Approximate => approximate(prompt),
                // The completion form of `/tokenize` ignores the other fields too.
                _ => Action::Tokenize {
                    path: "/tokenize",
                    body: body.to_vec(),
                },
            },
            Some(Value::Array(ids)) if !ids.is_empty() => {
                let tokens: Vec<u32> = ids
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<_>>()
                    .ok_or(Skip::NoPrompt)?;
                Action::Lookup(PromptKeys::of(router, extras, &tokens, None))
            }
            _ => return Err(Skip::NoPrompt),
        },
        Api::Responses => {
            if value
                .get("previous_response_id")
                .is_some_and(|v| !v.is_null())
            {
                return Err(Skip::PreviousResponse);
            }
            let input = request::responses_chat_input(value, &[]).map_err(unrenderable)?;
            match (mode, router.config.responses_tokenize) {
                (Mode::Approximate, _) => approximate(&chat_text(&input.messages)),
                (_, ResponsesTokenize::Render) => Action::Tokenize {
                    path: "/v1/responses/render",
                    body: body.to_vec(),
                },
                (_, ResponsesTokenize::Convert) => Action::Tokenize {
                    path: "/tokenize",
                    body: tokenize_chat_body(model, &input, value),
                },
            }
        }
    })
}

/// Approximate keys for a request whose tokenization failed: the same keys approximate
/// mode would have used (parsed again; this is the rare path).
pub fn approximate_fallback(
    router: &Router,
    api: Api,
    body: &[u8],
    plan: &Plan,
) -> Option<Vec<u64>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let text = match api {
        Api::ChatCompletions => chat_text(value.get("messages")?.as_array()?),
        Api::Completions => value.get("prompt")?.as_str()?.to_owned(),
        Api::Responses => chat_text(&request::responses_chat_input(&value, &[]).ok()?.messages),
    };
    Some(approximate_keys(
        router,
        plan.model.as_deref(),
        &plan.extras,
        &text,
    ))
}

/// vLLM's block keys (event form) of `tokens`, reusing digests from `cache` if given.
pub fn block_keys(
    router: &Router,
    extras: &KeyExtras,
    tokens: &[u32],
    cache: Option<&mut DigestCache>,
) -> Vec<u64> {
    let mut chain = router.keys.chain(extras);
    match cache {
        Some(cache) => chain.extend_cached(tokens, cache),
        None => chain.extend(tokens),
    }
    chain.keys().map(|k| k.0).collect()
}

/// Keys from request text, for approximate routing: fixed-size byte chunks, each key
/// chained from the previous one and seeded by the model and salt (so salts never share
/// keys here either). Only full chunks are keyed.
pub fn approximate_keys(
    router: &Router,
    model: Option<&str>,
    extras: &KeyExtras,
    text: &str,
) -> Vec<u64> {
    use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
    let mut seed_material = Vec::new();
    seed_material.extend_from_slice(model.unwrap_or("").as_bytes());
    seed_material.push(0);
    if let Some(salt) = &extras.cache_salt {
        seed_material.extend_from_slice(salt.as_str().as_bytes());
    }
    seed_material.push(0);
    if let Some(lora) = &extras.lora {
        seed_material.extend_from_slice(lora.name.as_bytes());
    }
    let mut key = xxh3_64(&seed_material);
    text.as_bytes()
        .chunks_exact(router.config.approximate_chunk_bytes)
        .map(|chunk| {
            key = xxh3_64_with_seed(chunk, key);
            key
        })
        .collect()
}

/// Why a tokenizer answer is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// Not JSON with a `tokens` (or `token_ids`) array of u32.
    #[error("the tokenizer's answer has no token list")]
    NoTokens,
}

/// The token list of a `/tokenize` (`tokens`) or render (`token_ids`) answer.
///
/// Hot path: natively (release, 200 runs, three repeats) a 7,000-token answer took 109-121
/// us through `serde_json::Value`, 66-67 us through a typed `Vec<u32>`, and 28 us with this
/// one-pass scan; the filter runs it under V8, several times slower. Anything the scan does
/// not recognise falls back to the typed serde parse.
pub fn token_list(answer: &[u8]) -> Option<Vec<u32>> {
    scan_token_list(answer).or_else(|| {
        #[derive(Deserialize)]
        struct Answer {
            #[serde(default)]
            tokens: Option<Vec<u32>>,
            #[serde(default)]
            token_ids: Option<Vec<u32>>,
        }
        let answer: Answer = serde_json::from_slice(answer).ok()?;
        answer.tokens.or(answer.token_ids)
    })
}

/// Finds the top-level `"tokens"` or `"token_ids"` key and reads its array of plain
/// non-negative integers; `None` on anything unexpected.
fn scan_token_list(bytes: &[u8]) -> Option<Vec<u32>> {
    let mut depth = 0u32;
    let mut i = 0usize;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.checked_sub(1)?,
            b'"' => {
                let start = i + 1;
                let mut j = start;
                loop {
                    match bytes.get(j)? {
                        b'\\' => j += 2,
                        b'"' => break,
                        _ => j += 1,
                    }
                }
                let key = bytes.get(start..j)?;
                i = j;
                if depth == 1 && (key == b"tokens" || key == b"token_ids") {
                    let rest = bytes.get(j + 1..)?;
                    let colon = rest.iter().position(|c| !c.is_ascii_whitespace())?;
                    if rest.get(colon) != Some(&b':') {
                        continue;
                    }
                    return scan_int_array(rest.get(colon + 1..)?);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

fn scan_int_array(bytes: &[u8]) -> Option<Vec<u32>> {
    let mut i = bytes.iter().position(|c| !c.is_ascii_whitespace())?;
    if bytes.get(i) != Some(&b'[') {
        return None;
    }
    i += 1;
    let mut out = Vec::with_capacity(bytes.len() / 7);
    loop {
        while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        if bytes.get(i) == Some(&b']') && out.is_empty() {
            return Some(out);
        }
        let mut value: u64 = 0;
        let digits_start = i;
        while let Some(d) = bytes.get(i).filter(|d| d.is_ascii_digit()) {
            value = value * 10 + u64::from(d - b'0');
            if value > u64::from(u32::MAX) {
                return None;
            }
            i += 1;
        }
        if i == digits_start {
            return None;
        }
        out.push(value as u32);
        while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        match bytes.get(i)? {
            b',' => i += 1,
            b']' => return Some(out),
            _ => return None,
        }
    }
}

/// A prompt's block keys, and how many of its blocks vLLM can serve from its cache: it
/// always computes the last prompt token, so a prompt of exactly k full blocks, all
/// cached, is served k - 1 of them. The prediction a response reports is capped by it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptKeys {
    /// One key per full block, in order.
    pub keys: Vec<u64>,
    /// The most blocks a cache hit can cover.
    pub servable_blocks: u64,
}

impl PromptKeys {
    /// The keys of `tokens`, reusing digests from `cache` if given.
    pub fn of(
        router: &Router,
        extras: &KeyExtras,
        tokens: &[u32],
        cache: Option<&mut DigestCache>,
    ) -> Self {
        let block_size = router.keys.block_size().max(1);
        Self {
            keys: block_keys(router, extras, tokens, cache),
            servable_blocks: (tokens.len().saturating_sub(1) / block_size) as u64,
        }
    }
}

/// Keys of a `/tokenize` (or render) answer.
pub fn keys_from_tokenize(
    router: &Router,
    extras: &KeyExtras,
    answer: &[u8],
    cache: Option<&mut DigestCache>,
) -> Result<PromptKeys, TokenizeError> {
    let tokens = token_list(answer).ok_or(TokenizeError::NoTokens)?;
    Ok(PromptKeys::of(router, extras, &tokens, cache))
}

/// The daemon lookup for `keys`.
pub fn lookup_body(
    router: &Router,
    keys: &[u64],
    model: Option<&str>,
    approximate: bool,
) -> Vec<u8> {
    let mut body = Map::new();
    body.insert("keys".into(), json!(keys));
    if let Some(model) = model {
        body.insert("model".into(), json!(model));
    }
    if router.config.book {
        body.insert("book".into(), json!({}));
    }
    if approximate {
        body.insert("approximate".into(), json!(true));
    }
    Value::Object(body).to_string().into_bytes()
}

/// A pick: the endpoints to try in order, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pick {
    /// The pick first, then the ranked fallbacks.
    pub endpoints: Vec<String>,
    /// Blocks the pick's events confirm it holds. A booked prefix counts once its events
    /// arrive: until its prefill is done vLLM cannot serve it, so a sibling sent meanwhile
    /// is still steered to it but predicted no more than its index shows.
    pub matched_blocks: u64,
    /// The daemon's reason.
    pub reason: String,
}

impl Pick {
    /// The endpoint header value: comma-separated, as override_host reads it.
    pub fn header_value(&self) -> String {
        self.endpoints.join(",")
    }
}

/// Why a lookup answer is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// Not the daemon's JSON.
    #[error("the index's answer is not a lookup response")]
    Malformed,
    /// No endpoint to pick.
    #[error("the index knows no endpoint for this request")]
    Empty,
}

fn valid_endpoint(endpoint: &str) -> bool {
    endpoint
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
        && endpoint
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]_".contains(&b))
}

/// Reads the daemon's answer into a pick with at most `1 + fallbacks` endpoints.
pub fn parse_lookup(router: &Router, answer: &[u8]) -> Result<Pick, LookupError> {
    let value: Value = serde_json::from_slice(answer).map_err(|_| LookupError::Malformed)?;
    let ranked = value
        .get("ranked")
        .and_then(Value::as_array)
        .ok_or(LookupError::Malformed)?;
    let endpoints: Vec<String> = ranked
        .iter()
        .filter_map(Value::as_str)
        .filter(|e| valid_endpoint(e))
        .take(1 + router.config.fallbacks)
        .map(str::to_owned)
        .collect();
    let first = endpoints.first().ok_or(LookupError::Empty)?;
    // `indexed_blocks` leaves bookings out; a daemon older than it only says
    // `matched_blocks`.
    let matched_blocks = value
        .get("endpoints")
        .and_then(Value::as_array)
        .and_then(|all| {
            all.iter()
                .find(|e| e.get("endpoint").and_then(Value::as_str) == Some(first))
        })
        .and_then(|e| e.get("indexed_blocks").or_else(|| e.get("matched_blocks")))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let reason = value
        .get("reason")
        .and_then(Value::as_str)
        .unwrap_or("prefix")
        .to_owned();
    Ok(Pick {
        endpoints,
        matched_blocks,
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(extra: &str) -> Router {
        let json =
            format!(r#"{{"tokenizer_cluster":"tok","index_cluster":"idx","block_size":4{extra}}}"#);
        Router::from_json(json.as_bytes()).unwrap()
    }

    #[test]
    fn configs_are_validated() {
        assert!(Router::from_json(b"{}").is_err());
        let bad_algo =
            br#"{"tokenizer_cluster":"t","index_cluster":"i","block_size":4,"hash_algo":"sha256"}"#;
        assert!(matches!(
            Router::from_json(bad_algo),
            Err(ConfigError::Keys(_))
        ));
        let unknown = br#"{"tokenizer_cluster":"t","index_cluster":"i","block_size":4,"nope":1}"#;
        assert!(Router::from_json(unknown).is_err());
        assert_eq!(router("").config.mode, Mode::Precise);
    }

    #[test]
    fn only_configured_post_paths_are_routed() {
        let r = router("");
        assert_eq!(
            r.api(b"/v1/chat/completions?x=1"),
            Some(Api::ChatCompletions)
        );
        assert_eq!(r.api(b"/v1/completions"), Some(Api::Completions));
        assert_eq!(r.api(b"/v1/responses"), Some(Api::Responses));
        assert_eq!(r.api(b"/v1/models"), None);
        assert_eq!(r.api(b"/approximate/v1/responses"), Some(Api::Responses));
        let narrow = router(r#","paths":["/v1/responses"]"#);
        assert_eq!(narrow.api(b"/v1/chat/completions"), None);
    }

    #[test]
    fn chat_requests_without_an_effort_go_to_tokenize_as_they_came() {
        let r = router("");
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}"#;
        let Action::Tokenize { path, body: call } =
            plan(&r, Api::ChatCompletions, Mode::Precise, body).action
        else {
            panic!()
        };
        assert_eq!((path, call.as_slice()), ("/tokenize", &body[..]));
    }

    #[test]
    fn chat_requests_tokenize_with_the_effort_folded_into_template_kwargs() {
        let r = router("");
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"reasoning_effort":"high","tools":[{"type":"function","function":{"name":"f"}}],"cache_salt":"t"}"#;
        let plan = plan(&r, Api::ChatCompletions, r.config.mode, body);
        assert_eq!(plan.model.as_deref(), Some("m"));
        assert_eq!(
            plan.extras.cache_salt.as_ref().map(|s| s.as_str()),
            Some("t")
        );
        let Action::Tokenize { path, body } = plan.action else {
            panic!()
        };
        assert_eq!(path, "/tokenize");
        let call: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            call["chat_template_kwargs"],
            json!({"reasoning_effort": "high", "enable_thinking": true})
        );
        assert_eq!(call["tools"][0]["function"]["name"], "f");
        assert_eq!(call["add_generation_prompt"], true);
        assert!(
            call.get("cache_salt").is_none(),
            "/tokenize ignores it; keys carry it"
        );
    }

    #[test]
    fn bodies_kvaffine_cannot_use_pass_through_with_a_reason() {
        let r = router("");
        assert_eq!(
            plan(&r, Api::ChatCompletions, r.config.mode, b"{not json").action,
            Action::Skip(Skip::NotJson)
        );
        assert_eq!(
            plan(&r, Api::ChatCompletions, r.config.mode, b"[1]").action,
            Action::Skip(Skip::NotAnObject)
        );
        let salt = br#"{"messages":[],"cache_salt":"a/b"}"#;
        assert_eq!(
            plan(&r, Api::ChatCompletions, r.config.mode, salt).action,
            Action::Skip(Skip::InvalidCacheSalt)
        );
        let previous = br#"{"input":"x","previous_response_id":"resp_1"}"#;
        assert_eq!(
            plan(&r, Api::Responses, r.config.mode, previous).action,
            Action::Skip(Skip::PreviousResponse)
        );
        assert_eq!(
            plan(&r, Api::Completions, r.config.mode, br#"{"prompt":7}"#).action,
            Action::Skip(Skip::NoPrompt)
        );
    }

    #[test]
    fn a_model_named_in_loras_keys_with_its_adapter() {
        let r = router(r#","loras":{"sql":"/adapters/sql"}"#);
        let body = br#"{"model":"sql","prompt":[1,2,3,4,5,6,7,8]}"#;
        let with_lora = plan(&r, Api::Completions, Mode::Precise, body);
        let lora = with_lora.extras.lora.clone().unwrap();
        assert_eq!(
            (lora.name.as_str(), lora.path.as_str()),
            ("sql", "/adapters/sql")
        );
        let base = plan(
            &r,
            Api::Completions,
            Mode::Precise,
            br#"{"model":"base","prompt":[1,2,3,4,5,6,7,8]}"#,
        );
        assert_eq!(base.extras.lora, None);
        assert_ne!(
            with_lora.action, base.action,
            "adapters never share keys with the base model"
        );
    }

    #[test]
    fn token_id_prompts_need_no_tokenizer_and_salts_change_their_keys() {
        let r = router("");
        let plain = plan(
            &r,
            Api::Completions,
            r.config.mode,
            br#"{"prompt":[1,2,3,4,5,6,7,8,9]}"#,
        );
        let salted = plan(
            &r,
            Api::Completions,
            r.config.mode,
            br#"{"prompt":[1,2,3,4,5,6,7,8,9],"cache_salt":"s"}"#,
        );
        let (Action::Lookup(a), Action::Lookup(b)) = (plain.action, salted.action) else {
            panic!()
        };
        assert_eq!(a.keys.len(), 2);
        assert!(a.keys.iter().zip(&b.keys).all(|(x, y)| x != y));
    }

    #[test]
    fn responses_convert_or_render() {
        let body = br#"{"model":"m","instructions":"be brief","input":"hello"}"#;
        let Action::Tokenize { path, body: call } =
            plan(&router(""), Api::Responses, Mode::Precise, body).action
        else {
            panic!()
        };
        assert_eq!(path, "/tokenize");
        let call: Value = serde_json::from_slice(&call).unwrap();
        assert_eq!(
            call["messages"][0],
            json!({"role": "system", "content": "be brief"})
        );
        let render = router(r#","responses_tokenize":"render""#);
        let Action::Tokenize { path, body: call } =
            plan(&render, Api::Responses, render.config.mode, body).action
        else {
            panic!()
        };
        assert_eq!((path, call.as_slice()), ("/v1/responses/render", &body[..]));
    }

    #[test]
    fn approximate_keys_follow_text_prefixes_and_salts() {
        let r = router(r#","mode":"approximate","approximate_chunk_bytes":8"#);
        let keys = |text: &str, salt: Option<&str>| {
            let extras = KeyExtras {
                cache_salt: salt.map(|s| CacheSalt::parse(s).unwrap()),
                ..KeyExtras::default()
            };
            approximate_keys(&r, Some("m"), &extras, text)
        };
        let short = keys("0123456789abcdefXYZ", None);
        let long = keys("0123456789abcdefXYZ0123456789", None);
        assert_eq!(short.len(), 2);
        assert_eq!(&long[..2], &short[..]);
        assert_ne!(keys("0123456789abcdef", Some("s")), short);
        let body = br#"{"messages":[{"role":"user","content":"a long enough message"}]}"#;
        assert!(
            matches!(plan(&r, Api::ChatCompletions, r.config.mode, body).action, Action::Approximate(k) if !k.is_empty())
        );
    }

    #[test]
    fn lookups_are_read_into_a_bounded_pick_of_valid_endpoints() {
        let r = router(r#","fallbacks":1"#);
        let answer =
            br#"{"ranked":["10.0.0.2:8000","evil host:80","10.0.0.1:8000","10.0.0.3:8000"],
            "endpoints":[{"endpoint":"10.0.0.2:8000","matched_blocks":7}],"reason":"prefix"}"#;
        let pick = parse_lookup(&r, answer).unwrap();
        assert_eq!(pick.header_value(), "10.0.0.2:8000,10.0.0.1:8000");
        assert_eq!((pick.matched_blocks, pick.reason.as_str()), (7, "prefix"));
        assert_eq!(
            parse_lookup(&r, br#"{"ranked":[]}"#),
            Err(LookupError::Empty)
        );
        assert_eq!(parse_lookup(&r, b"nope"), Err(LookupError::Malformed));
    }

    #[test]
    fn a_booked_prefix_is_predicted_only_as_far_as_its_events_confirm() {
        let r = router("");
        let answer = br#"{"ranked":["10.0.0.2:8000"],"reason":"prefix",
            "endpoints":[{"endpoint":"10.0.0.2:8000","matched_blocks":9,"indexed_blocks":2}]}"#;
        assert_eq!(parse_lookup(&r, answer).unwrap().matched_blocks, 2);
    }

    #[test]
    fn the_token_scan_agrees_with_serde_and_falls_back_on_the_unusual() {
        let cases: &[&[u8]] = &[
            br#"{"count":3,"max_model_len":10,"tokens":[1,22,333],"token_strs":null}"#,
            br#"{ "token_strs" : ["\"tokens\""], "tokens" : [ 4 , 5 ] }"#,
            br#"{"usage":{"tokens":[9]},"tokens":[7]}"#,
            br#"{"sampling_params":{"stop_token_ids":[2]},"token_ids":[8,9]}"#,
            br#"{"tokens":[]}"#,
            br#"{"tokens":[1e3]}"#,
            br#"{"tokens":[-1]}"#,
            br#"{"tokens":[4294967296]}"#,
            br#"{"tokens":"nope"}"#,
            br#"{"tokens":[1,2"#,
        ];
        let expected: [Option<Vec<u32>>; 10] = [
            Some(vec![1, 22, 333]),
            Some(vec![4, 5]),
            Some(vec![7]),
            Some(vec![8, 9]),
            Some(vec![]),
            None,
            None,
            None,
            None,
            None,
        ];
        for (case, want) in cases.iter().zip(expected) {
            assert_eq!(token_list(case), want, "{}", String::from_utf8_lossy(case));
        }
    }

    #[test]
    fn reasoning_content_reaches_tokenize_as_reasoning() {
        let r = router("");
        let body = br#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"","reasoning_content":"think"}],"max_tokens":3}"#;
        let Action::Tokenize { body: call, .. } =
            plan(&r, Api::ChatCompletions, Mode::Precise, body).action
        else {
            panic!()
        };
        let call: Value = serde_json::from_slice(&call).unwrap();
        assert_eq!(call["messages"][1]["reasoning"], "think");
        assert_eq!(call["messages"][1]["reasoning_content"], "think");
        assert_eq!(call["max_tokens"], 3);
        // Without reasoning_content the body goes as it came.
        let plain = br#"{"messages":[{"role":"user","content":"q"}]}"#;
        let Action::Tokenize { body: call, .. } =
            plan(&r, Api::ChatCompletions, Mode::Precise, plain).action
        else {
            panic!()
        };
        assert_eq!(call, plain.to_vec());
    }

    #[test]
    fn tokenize_answers_become_keys() {
        let r = router("");
        let keys = keys_from_tokenize(
            &r,
            &KeyExtras::default(),
            br#"{"count":9,"tokens":[1,2,3,4,5,6,7,8,9]}"#,
            None,
        )
        .unwrap();
        assert_eq!((keys.keys.len(), keys.servable_blocks), (2, 2));
        let render = keys_from_tokenize(
            &r,
            &KeyExtras::default(),
            br#"{"token_ids":[1,2,3,4]}"#,
            None,
        )
        .unwrap();
        assert_eq!(render.keys, keys.keys[..1]);
        // Exactly one full block: vLLM computes its last token, so nothing is servable.
        assert_eq!(render.servable_blocks, 0);
        assert!(
            keys_from_tokenize(&r, &KeyExtras::default(), br#"{"tokens":[-1]}"#, None).is_err()
        );
    }
}
