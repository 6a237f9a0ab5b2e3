//! Conversations driven through the gateway the way an agent drives them: stream each turn,
//! carry the assistant message (reasoning, tool calls) back, answer tool calls, and record
//! what each turn cost, including what a router with perfect knowledge could have got.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vllm_emu::harness::http;

use crate::scenarios::Ctx;

/// What one turn measured.
#[derive(Clone, Debug)]
pub struct TurnResult {
    /// Success (HTTP 200 and a complete stream).
    pub ok: bool,
    /// Time to the first streamed byte.
    pub ttft: Duration,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Of which served from the chosen replica's cache.
    pub cached_tokens: u64,
    /// The most any replica held for this prompt when it was sent.
    pub oracle_tokens: u64,
    /// The replica that served it.
    pub replica: String,
    /// Why the router sent it there (`x-kvaffine-reason`), empty when it did not say.
    pub reason: String,
    /// The assistant message, as a client carries it back.
    pub message: Value,
}

/// Who says what each replica holds.
#[derive(Clone, Debug)]
pub enum Oracle {
    /// vllm-emu answers `/debug/cached_tokens` itself.
    Emulator,
    /// Real vLLM: `tests/vllm/oracle.py` at `service` (`HOST:PORT`), given the prompt's
    /// token ids as vLLM renders them (`render`: a replica whose
    /// `/v1/chat/completions/render` is asked).
    Vllm {
        /// The oracle process.
        service: String,
        /// A replica's address.
        render: String,
    },
}

/// The most any replica could have served from its cache for `body` right now.
pub fn oracle(oracle: &Oracle, replicas: &[String], body: &Value) -> u64 {
    let json = |(status, text): (u16, String)| {
        (status == 200)
            .then(|| serde_json::from_str::<Value>(&text).ok())
            .flatten()
    };
    match oracle {
        Oracle::Emulator => replicas
            .iter()
            .filter_map(|r| json(http(r, "POST", "/debug/cached_tokens", &body.to_string())))
            .filter_map(|v| v["cached_tokens"].as_u64())
            .max()
            .unwrap_or(0),
        Oracle::Vllm { service, render } => {
            let Some(rendered) = json(http(
                render,
                "POST",
                "/v1/chat/completions/render",
                &body.to_string(),
            )) else {
                return 0;
            };
            let query =
                json!({"token_ids": rendered["token_ids"], "cache_salt": body["cache_salt"]});
            json(http(service, "POST", "/cached", &query.to_string()))
                .and_then(|v| {
                    v["cached_tokens"]
                        .as_object()?
                        .values()
                        .filter_map(Value::as_u64)
                        .max()
                })
                .unwrap_or(0)
        }
    }
}

/// Moves `cache_salt` into the text: the conversation opens with it (Responses: the
/// instructions, or a text input; chat: the first message, as text or as a leading text
/// part). Requests keep distinct prefixes exactly where their salts differed.
///
/// # Panics
/// On a body with a salt and no text to put it in, rather than drop the isolation.
pub fn salt_as_text(body: &mut Value) {
    let Some(salt) = body.as_object_mut().and_then(|b| b.remove("cache_salt")) else {
        return;
    };
    let tag = match &salt {
        Value::String(s) => format!("[{s}] "),
        other => format!("[{other}] "),
    };
    let prefix = |text: &mut Value| match text {
        Value::String(s) => {
            s.insert_str(0, &tag);
            true
        }
        Value::Array(parts) => {
            parts.insert(0, json!({"type": "text", "text": tag}));
            true
        }
        _ => false,
    };
    let done = if let Some(instructions) = body.get_mut("instructions") {
        prefix(instructions)
    } else if let Some(content) = body.pointer_mut("/messages/0/content") {
        prefix(content)
    } else if let Some(input @ Value::String(_)) = body.get_mut("input") {
        prefix(input)
    } else {
        false
    };
    assert!(
        done,
        "cannot move cache_salt {salt} into the text of {body}"
    );
}

/// Sends one streaming chat request through the context's URL and reassembles the
/// answer.
pub async fn turn(ctx: &Ctx, body: &Value) -> TurnResult {
    let (client, url, replicas) = (&ctx.client, ctx.url(), ctx.replicas.as_slice());
    let mut body = body.clone();
    if ctx.salt_as_text {
        salt_as_text(&mut body);
    }
    body["model"] = json!(ctx.model);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let oracle_tokens = {
        let (who, replicas, body) = (ctx.oracle.clone(), replicas.to_vec(), body.clone());
        tokio::task::spawn_blocking(move || oracle(&who, &replicas, &body))
            .await
            .unwrap_or(0)
    };
    let failed = |ttft| TurnResult {
        ok: false,
        ttft,
        prompt_tokens: 0,
        cached_tokens: 0,
        oracle_tokens,
        replica: String::new(),
        reason: String::new(),
        message: Value::Null,
    };
    let start = Instant::now();
    let Ok(mut response) = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
    else {
        return failed(start.elapsed());
    };
    if !response.status().is_success() {
        return failed(start.elapsed());
    }
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let (replica, reason) = (header("x-served-by"), header("x-kvaffine-reason"));
    let mut ttft = None;
    let mut raw = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                ttft.get_or_insert_with(|| start.elapsed());
                raw.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(_) => return failed(start.elapsed()),
        }
    }
    let text = String::from_utf8_lossy(&raw);
    let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    let mut usage = Value::Null;
    let mut done = false;
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
        let delta = &chunk["choices"][0]["delta"];
        if let Some(c) = delta["content"].as_str() {
            content.push_str(c);
        }
        if let Some(r) = delta["reasoning_content"].as_str() {
            reasoning.push_str(r);
        }
        if let Some(tc) = delta["tool_calls"].as_array() {
            calls
                .extend(tc.iter().map(
                    |c| json!({"id": c["id"], "type": "function", "function": c["function"]}),
                ));
        }
    }
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        message["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        message["tool_calls"] = json!(calls);
    }
    TurnResult {
        ok: done && !usage.is_null(),
        ttft: ttft.unwrap_or_else(|| start.elapsed()),
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        oracle_tokens,
        replica,
        reason,
        message,
    }
}

/// A conversation: its messages so far and what every turn measured.
pub struct Session {
    /// Chat messages so far.
    pub messages: Vec<Value>,
    /// Fields every request carries (salt, tools, effort...).
    pub fields: Value,
    /// Every turn's result.
    pub results: Vec<TurnResult>,
}

impl Session {
    /// A session opening with `system` and `first` user message.
    pub fn new(system: &str, first: &str, fields: Value) -> Self {
        Self {
            messages: vec![
                json!({"role": "system", "content": system}),
                json!({"role": "user", "content": first}),
            ],
            fields,
            results: Vec::new(),
        }
    }

    /// The request for the next turn (the model is the context's, set when sent).
    pub fn request(&self, max_tokens: u64) -> Value {
        let mut body = self.fields.clone();
        body["messages"] = json!(self.messages);
        body["max_tokens"] = json!(max_tokens);
        body
    }

    /// Runs one turn and appends the answer (and, for a tool call, its result) or the
    /// `next` user message.
    pub async fn step(&mut self, ctx: &Ctx, next: &str) {
        let result = turn(ctx, &self.request(24)).await;
        if result.ok {
            self.messages.push(result.message.clone());
            if let Some(calls) = result.message["tool_calls"].as_array() {
                for call in calls {
                    self.messages.push(json!({"role": "tool", "tool_call_id": call["id"],
                                              "content": format!("result of {}: {next}", call["function"]["name"])}));
                }
            } else {
                self.messages.push(json!({"role": "user", "content": next}));
            }
        }
        self.results.push(result);
    }
}
