//! OpenAI request bodies as vLLM turns them into a chat-template input: the messages,
//! tools and template arguments a `/tokenize` chat request must carry to get exactly the
//! tokens the real request will be prefilled with.

use serde_json::{Map, Value, json};

/// Why a request body cannot be turned into a chat-template input (vLLM answers 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// A field has the wrong JSON type.
    #[error("`{field}` must be {expected}")]
    WrongType {
        /// The offending field.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
    },
    /// A Responses input item vLLM does not accept.
    #[error("unsupported input item: {0}")]
    UnsupportedItem(String),
    /// Reasoning items with `encrypted_content` cannot be rendered.
    #[error("reasoning items with encrypted_content are not supported")]
    EncryptedReasoning,
}

/// The chat-template input of a request: what `/tokenize` (chat form) takes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatInput {
    /// Chat-completions messages.
    pub messages: Vec<Value>,
    /// Chat-completions tools (`{type: "function", function: {...}}`).
    pub tools: Option<Vec<Value>>,
    /// Template arguments, with `reasoning_effort` / `enable_thinking` folded in.
    pub chat_template_kwargs: Map<String, Value>,
}

fn text_of_parts(parts: &[Value]) -> String {
    parts
        .iter()
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A message's content as vLLM's text-only renderer sees it: a string, or text parts
/// joined by newlines.
pub fn content_text(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => Some(text_of_parts(parts)),
        _ => None,
    }
}

/// Template arguments for a chat completions or Responses request: its own
/// `chat_template_kwargs`, plus `reasoning_effort` (chat: top level; Responses:
/// `reasoning.effort`), which also sets `enable_thinking` when the request did not.
pub fn template_kwargs(body: &Value) -> Result<Map<String, Value>, RequestError> {
    let mut kwargs = match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(map)) => map.clone(),
        Some(_) => {
            return Err(RequestError::WrongType {
                field: "chat_template_kwargs",
                expected: "an object",
            });
        }
    };
    let effort = body
        .get("reasoning_effort")
        .or_else(|| body.get("reasoning").and_then(|r| r.get("effort")))
        .filter(|e| !e.is_null());
    if let Some(effort) = effort {
        let Some(name) = effort.as_str() else {
            return Err(RequestError::WrongType {
                field: "reasoning_effort",
                expected: "a string",
            });
        };
        kwargs.insert("reasoning_effort".into(), effort.clone());
        kwargs
            .entry("enable_thinking")
            .or_insert(Value::Bool(name != "none"));
    }
    Ok(kwargs)
}

/// Converts Responses tools to chat-completions tools (function tools only).
fn chat_tools(tools: &Value) -> Result<Option<Vec<Value>>, RequestError> {
    match tools {
        Value::Null => Ok(None),
        Value::Array(tools) => Ok(Some(
            tools
                .iter()
                .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
                .map(|t| {
                    let mut function = Map::new();
                    for key in ["name", "description", "parameters"] {
                        if let Some(v) = t.get(key) {
                            function.insert(key.into(), v.clone());
                        }
                    }
                    json!({"type": "function", "function": function})
                })
                .collect(),
        )),
        _ => Err(RequestError::WrongType {
            field: "tools",
            expected: "an array",
        }),
    }
}

fn string_field(item: &Value, key: &str) -> Value {
    item.get(key).cloned().unwrap_or(Value::Null)
}

/// One Responses input item as chat messages.
fn item_message(item: &Value) -> Result<Value, RequestError> {
    let kind = item.get("type").and_then(Value::as_str);
    if let Some(role) = item.get("role") {
        if kind.is_none() || kind == Some("message") {
            let content = item
                .get("content")
                .and_then(content_text)
                .unwrap_or_default();
            return Ok(json!({"role": role, "content": content}));
        }
    }
    // A call as one assistant turn; custom tools carry their input where functions carry
    // arguments.
    let call = |arguments: &str| {
        json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{
                "id": string_field(item, "call_id"),
                "type": "function",
                "function": {
                    "name": string_field(item, "name"),
                    "arguments": string_field(item, arguments),
                },
            }],
        })
    };
    match kind {
        Some("function_call") => Ok(call("arguments")),
        Some("custom_tool_call") => Ok(call("input")),
        Some("function_call_output") | Some("custom_tool_call_output") => Ok(json!({
            "role": "tool",
            "tool_call_id": string_field(item, "call_id"),
            "content": item.get("output").and_then(content_text).unwrap_or_default(),
        })),
        Some("reasoning") => {
            if item.get("encrypted_content").is_some_and(|e| !e.is_null()) {
                return Err(RequestError::EncryptedReasoning);
            }
            let parts = item
                .get("content")
                .and_then(Value::as_array)
                .filter(|c| !c.is_empty())
                .or_else(|| item.get("summary").and_then(Value::as_array));
            let text = parts.map(|p| text_of_parts(p)).unwrap_or_default();
            Ok(json!({"role": "assistant", "content": null, "reasoning": text}))
        }
        other => Err(RequestError::UnsupportedItem(
            other.unwrap_or("(no type)").to_owned(),
        )),
    }
}

/// A Responses request as vLLM's `construct_input_messages` builds it: `instructions` as a
/// system message, then the previous response's conversation without its system messages
/// (`previous`: its messages followed by its output as assistant turns, reasoning already
/// skipped), then the input, a string as one user message or a list item by item.
pub fn responses_chat_input(body: &Value, previous: &[Value]) -> Result<ChatInput, RequestError> {
    let mut messages = Vec::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => messages.push(json!({"role": "system", "content": text})),
        Some(_) => {
            return Err(RequestError::WrongType {
                field: "instructions",
                expected: "a string",
            });
        }
    }
    messages.extend(
        previous
            .iter()
            .filter(|m| m.get("role").and_then(Value::as_str) != Some("system"))
            .cloned(),
    );
    match body.get("input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for item in items {
                messages.push(item_message(item)?);
            }
        }
        _ => {
            return Err(RequestError::WrongType {
                field: "input",
                expected: "a string or an array of items",
            });
        }
    }
    Ok(ChatInput {
        messages,
        tools: chat_tools(body.get("tools").unwrap_or(&Value::Null))?,
        chat_template_kwargs: template_kwargs(body)?,
    })
}

/// A Responses output list as the assistant turns a later `previous_response_id` request
/// continues from (reasoning skipped, as vLLM does).
pub fn responses_output_messages(output: &[Value]) -> Vec<Value> {
    output
        .iter()
        .filter(|item| item.get("type").and_then(Value::as_str) != Some("reasoning"))
        .filter_map(|item| item_message(item).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_previous_turns_and_items_become_messages_in_order() {
        let body = json!({
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {"type": "reasoning", "id": "r1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "web_search"}],
            "reasoning": {"effort": "low"},
        });
        let previous = [
            json!({"role": "system", "content": "old"}),
            json!({"role": "user", "content": "hi"}),
        ];
        let input = responses_chat_input(&body, &previous).unwrap();
        let roles: Vec<&str> = input
            .messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(
            roles,
            [
                "system",
                "user",
                "user",
                "assistant",
                "assistant",
                "tool",
                "assistant"
            ]
        );
        assert_eq!(input.messages[2]["content"], "a\nb");
        assert_eq!(input.messages[3]["reasoning"], "think");
        assert_eq!(input.messages[4]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(input.messages[5]["content"], "42");
        assert_eq!(
            input.tools.unwrap(),
            vec![json!({"type": "function", "function": {"name": "f", "parameters": {}}})]
        );
        assert_eq!(input.chat_template_kwargs["reasoning_effort"], "low");
        assert_eq!(input.chat_template_kwargs["enable_thinking"], true);
    }

    #[test]
    fn what_vllm_rejects_is_an_error() {
        let encrypted = json!({"input": [{"type": "reasoning", "encrypted_content": "x"}]});
        assert_eq!(
            responses_chat_input(&encrypted, &[]),
            Err(RequestError::EncryptedReasoning)
        );
        let unknown = json!({"input": [{"type": "image_generation_call"}]});
        assert!(matches!(
            responses_chat_input(&unknown, &[]),
            Err(RequestError::UnsupportedItem(_))
        ));
        assert!(responses_chat_input(&json!({"input": 7}), &[]).is_err());
    }

    #[test]
    fn explicit_enable_thinking_wins_over_the_effort() {
        let body =
            json!({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": false}});
        let kwargs = template_kwargs(&body).unwrap();
        assert_eq!(kwargs["enable_thinking"], false);
        assert_eq!(kwargs["reasoning_effort"], "high");
        let none = template_kwargs(&json!({"reasoning_effort": "none"})).unwrap();
        assert_eq!(none["enable_thinking"], false);
    }

    #[test]
    fn previous_output_drops_reasoning() {
        let output = [
            json!({"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}]}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}),
        ];
        assert_eq!(
            responses_output_messages(&output),
            vec![json!({"role": "assistant", "content": "x"})]
        );
    }
}
