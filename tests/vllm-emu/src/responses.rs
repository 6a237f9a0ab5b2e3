//! Responses requests to chat messages, as vLLM (0.32) builds them in
//! `construct_input_messages` and `get_function_tools`: the emulator's own rendering of
//! the Responses API, written from vLLM's behaviour and not shared with the filter, so an
//! end-to-end test compares two implementations instead of one with itself. Both are
//! checked against vectors vLLM's own code produced (`tests/vllm/vectors/responses.json`).

use serde_json::{Map, Value, json};

/// An earlier response a `previous_response_id` continues: the messages its request was
/// rendered from, and its output items (vLLM keeps both in memory).
#[derive(Clone, Debug, Default)]
pub struct Previous {
    /// The chat messages of the earlier request.
    pub messages: Vec<Value>,
    /// The earlier response's `output` items.
    pub output: Vec<Value>,
}

/// Why vLLM refuses to render a Responses request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConversionError {
    /// `input` is neither a string nor a list.
    #[error("input must be a string or a list of items")]
    Input,
    /// `instructions` is not a string.
    #[error("instructions must be a string")]
    Instructions,
    /// vLLM cannot read encrypted reasoning.
    #[error("Encrypted content is not supported.")]
    Encrypted,
    /// An item vLLM does not turn into a message.
    #[error("Unsupported input item type: {0}")]
    Unsupported(String),
}

/// The messages vLLM's chat template receives for `body`.
pub fn messages(body: &Value, previous: Option<&Previous>) -> Result<Vec<Value>, ConversionError> {
    let mut out = Vec::new();
    match body.get("instructions") {
        Some(Value::String(text)) if !text.is_empty() => {
            out.push(json!({"role": "system", "content": text}));
        }
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(_) => return Err(ConversionError::Instructions),
    }
    if let Some(previous) = previous {
        // Instructions never carry over from one response to the next.
        out.extend(
            previous
                .messages
                .iter()
                .filter(|m| m.get("role").and_then(Value::as_str) != Some("system"))
                .cloned(),
        );
        // The earlier output's messages, one assistant turn per text part; its reasoning
        // is not carried.
        for item in &previous.output {
            if item.get("type").and_then(Value::as_str) != Some("message") {
                continue;
            }
            let parts = item.get("content").and_then(Value::as_array);
            for part in parts.into_iter().flatten() {
                out.push(json!({"role": "assistant", "content": part.get("text").cloned().unwrap_or(Value::Null)}));
            }
        }
    }
    match body.get("input") {
        Some(Value::String(text)) => out.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for item in items {
                if let Some(message) = from_item(item, out.last_mut())? {
                    out.push(message);
                }
            }
        }
        _ => return Err(ConversionError::Input),
    }
    Ok(out)
}

fn field(item: &Value, key: &str) -> Value {
    item.get(key).cloned().unwrap_or(Value::Null)
}

fn text_field(item: &Value, key: &str) -> String {
    item.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// The previous message, when it is an assistant turn later items may fill in.
fn assistant(previous: Option<&mut Value>) -> Option<&mut Map<String, Value>> {
    previous
        .and_then(Value::as_object_mut)
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
}

/// Sets `key` of the open assistant turn if it has none yet; true if it did.
fn fill(open: Option<&mut Map<String, Value>>, key: &str, value: &Value) -> bool {
    match open {
        Some(open) if open.get(key).is_none_or(Value::is_null) => {
            open.insert(key.to_owned(), value.clone());
            true
        }
        _ => false,
    }
}

/// One input item: a new message, or `None` when it was merged into `previous`.
fn from_item(item: &Value, previous: Option<&mut Value>) -> Result<Option<Value>, ConversionError> {
    let kind = item.get("type").and_then(Value::as_str);
    let call = match kind {
        Some("function_call") => {
            let name = match item.get("namespace").and_then(Value::as_str) {
                Some(ns) if !ns.is_empty() => format!("{ns}__{}", text_field(item, "name")),
                _ => text_field(item, "name"),
            };
            Some((name, field(item, "arguments")))
        }
        Some("custom_tool_call") => {
            let input = serde_json::to_string(&text_field(item, "input")).unwrap_or_default();
            Some((
                text_field(item, "name"),
                json!(format!("{{\"input\": {input}}}")),
            ))
        }
        _ => None,
    };
    if let Some((name, arguments)) = call {
        let call = json!({"id": field(item, "call_id"), "function": {"name": name, "arguments": arguments}, "type": "function"});
        if let Some(open) = assistant(previous) {
            match open.get_mut("tool_calls") {
                Some(Value::Array(calls)) => calls.push(call),
                _ => {
                    open.insert("tool_calls".into(), json!([call]));
                }
            }
            return Ok(None);
        }
        return Ok(Some(json!({"role": "assistant", "tool_calls": [call]})));
    }
    match kind {
        Some("reasoning") => {
            if item.get("encrypted_content").is_some_and(|e| !e.is_null()) {
                return Err(ConversionError::Encrypted);
            }
            let first = |key: &str| {
                item.get(key)
                    .and_then(Value::as_array)
                    .and_then(|parts| parts.first())
                    .map(|part| field(part, "text"))
            };
            let reasoning = first("content")
                .or_else(|| first("summary"))
                .unwrap_or_else(|| json!(""));
            if fill(assistant(previous), "reasoning", &reasoning) {
                return Ok(None);
            }
            Ok(Some(json!({"role": "assistant", "reasoning": reasoning})))
        }
        Some("function_call_output") | Some("custom_tool_call_output") => Ok(Some(
            json!({"role": "tool", "content": field(item, "output"), "tool_call_id": field(item, "call_id")}),
        )),
        _ => {
            let role = item.get("role").and_then(Value::as_str);
            if role == Some("assistant") {
                let text = match item.get("content") {
                    Some(Value::String(text)) => Some(json!(text)),
                    Some(Value::Array(parts)) => parts.first().map(|p| field(p, "text")),
                    _ => None,
                };
                if let Some(text) = text {
                    if fill(assistant(previous), "content", &text) {
                        return Ok(None);
                    }
                    return Ok(Some(json!({"role": "assistant", "content": text})));
                }
            }
            if role.is_some() && matches!(kind, None | Some("message")) {
                return Ok(Some(item.clone()));
            }
            Err(ConversionError::Unsupported(
                kind.unwrap_or("None").to_owned(),
            ))
        }
    }
}

/// The tools the model is shown, in vLLM's chat form (`{"type": "function", "function":
/// {name, description, parameters}}`, absent fields null): function tools, a namespace's
/// functions as `namespace__name`, custom tools as a one-string function.
pub fn tools(body: &Value) -> Option<Vec<Value>> {
    let shown = |name: Value, description: Value, parameters: Value| json!({"type": "function", "function": {"name": name, "description": description, "parameters": parameters}});
    let mut out = Vec::new();
    for tool in body.get("tools")?.as_array()? {
        match tool.get("type").and_then(Value::as_str) {
            Some("function") => out.push(shown(
                field(tool, "name"),
                field(tool, "description"),
                field(tool, "parameters"),
            )),
            Some("namespace") => {
                let namespace = text_field(tool, "name");
                let members = tool.get("tools").and_then(Value::as_array);
                for member in members.into_iter().flatten() {
                    if member.get("type").and_then(Value::as_str) == Some("function") {
                        out.push(shown(
                            json!(format!("{namespace}__{}", text_field(member, "name"))),
                            field(member, "description"),
                            field(member, "parameters"),
                        ));
                    }
                }
            }
            Some("custom") => out.push(shown(
                field(tool, "name"),
                field(tool, "description"),
                json!({
                    "type": "object",
                    "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
                    "required": ["input"],
                    "additionalProperties": false,
                }),
            )),
            _ => {}
        }
    }
    (!out.is_empty()).then_some(out)
}

/// A chat-completions tool as vLLM validates it before the template sees it: `type`
/// and `function` with `name`, `description` and `parameters` in that order, absent ones
/// null (what `/tokenize` and chat completions hand the template).
pub fn validated_tool(tool: &Value) -> Value {
    let function = tool.get("function").unwrap_or(&Value::Null);
    let mut validated = Map::new();
    for key in ["name", "description", "parameters"] {
        validated.insert(key.into(), field(function, key));
    }
    if let Some(extra) = function.as_object() {
        for (key, value) in extra {
            validated
                .entry(key.clone())
                .or_insert_with(|| value.clone());
        }
    }
    json!({"type": field(tool, "type"), "function": validated})
}
