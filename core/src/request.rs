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

/// What vLLM (0.32) puts between a namespace and the name of one of its tools.
const NAMESPACE_SEPARATOR: &str = "__";

/// The parameters a custom (freeform) tool is shown with: one string, `input`, in the key
/// order vLLM's `custom_tool_parameters` writes (a template may print them).
fn custom_tool_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "input": {"type": "string", "description": "The freeform text payload for this tool."}
        },
        "required": ["input"],
        "additionalProperties": false,
    })
}

/// A chat-completions function tool from a Responses tool's fields.
fn function_tool(name: Value, description: Option<&Value>, parameters: Option<&Value>) -> Value {
    let mut function = Map::new();
    function.insert("name".into(), name);
    if let Some(description) = description {
        function.insert("description".into(), description.clone());
    }
    if let Some(parameters) = parameters {
        function.insert("parameters".into(), parameters.clone());
    }
    json!({"type": "function", "function": function})
}

/// Converts Responses tools to the chat-completions tools the model is shown, as vLLM's
/// `get_function_tools` does: function tools as they are, a namespace's function tools
/// each as `namespace__name`, custom tools as a one-string function; hosted tools
/// (web search and the like) are never shown.
fn chat_tools(tools: &Value) -> Result<Option<Vec<Value>>, RequestError> {
    let Value::Array(tools) = tools else {
        return match tools {
            Value::Null => Ok(None),
            _ => Err(RequestError::WrongType {
                field: "tools",
                expected: "an array",
            }),
        };
    };
    let mut shown = Vec::with_capacity(tools.len());
    for tool in tools {
        match tool.get("type").and_then(Value::as_str) {
            Some("function") => shown.push(function_tool(
                string_field(tool, "name"),
                tool.get("description"),
                tool.get("parameters"),
            )),
            Some("namespace") => {
                let namespace = tool.get("name").and_then(Value::as_str).unwrap_or("");
                let members = tool.get("tools").and_then(Value::as_array);
                for member in members.into_iter().flatten() {
                    if member.get("type").and_then(Value::as_str) == Some("function") {
                        let name = member.get("name").and_then(Value::as_str).unwrap_or("");
                        shown.push(function_tool(
                            json!(format!("{namespace}{NAMESPACE_SEPARATOR}{name}")),
                            member.get("description"),
                            member.get("parameters"),
                        ));
                    }
                }
            }
            Some("custom") => shown.push(function_tool(
                string_field(tool, "name"),
                tool.get("description"),
                Some(&custom_tool_parameters()),
            )),
            _ => {}
        }
    }
    Ok(Some(shown))
}

/// A function call's name as the model saw the tool: namespaced calls carry their
/// namespace in front, as vLLM's `flat_namespace_tool_name` writes it.
fn call_name(item: &Value) -> Value {
    match item.get("namespace").and_then(Value::as_str) {
        Some(namespace) if !namespace.is_empty() => json!(format!(
            "{namespace}{NAMESPACE_SEPARATOR}{}",
            item.get("name").and_then(Value::as_str).unwrap_or("")
        )),
        _ => string_field(item, "name"),
    }
}

/// A custom tool call's input as the arguments of the function it is shown as: Python's
/// `json.dumps({"input": payload}, ensure_ascii=False)`, which vLLM writes (its spacing
/// after the colon, non-ASCII kept; serde_json escapes strings as Python does then).
fn custom_call_arguments(item: &Value) -> Value {
    let payload = item.get("input").and_then(Value::as_str).unwrap_or("");
    let quoted = serde_json::to_string(payload).unwrap_or_else(|_| "\"\"".into());
    json!(format!("{{\"input\": {quoted}}}"))
}

fn string_field(item: &Value, key: &str) -> Value {
    item.get(key).cloned().unwrap_or(Value::Null)
}

/// The last message, if it is an assistant turn a following item may merge into.
fn open_assistant(messages: &mut [Value]) -> Option<&mut Map<String, Value>> {
    messages
        .last_mut()
        .and_then(Value::as_object_mut)
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
}

/// Whether `key` of a message is absent or null (vLLM's `message.get(key) is None`).
fn unset(message: &Map<String, Value>, key: &str) -> bool {
    message.get(key).is_none_or(Value::is_null)
}

/// Responses content in the chat form: `input_text` and `output_text` parts become the
/// `text` parts vLLM's parser turns them into (the chat form of `/tokenize` accepts only
/// those); anything else passes unchanged.
fn chat_parts(content: Value) -> Value {
    match content {
        Value::Array(parts) => Value::Array(
            parts
                .into_iter()
                .map(|part| match part.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text") => {
                        json!({"type": "text", "text": string_field(&part, "text")})
                    }
                    _ => part,
                })
                .collect(),
        ),
        other => other,
    }
}

/// Responses input items as chat messages, as vLLM's
/// `construct_chat_messages_with_tool_call` builds them: a tool call, reasoning or an
/// assistant text following an assistant turn merges into it (a call appends to its
/// `tool_calls`; reasoning and text fill the field only while it is unset); other messages
/// pass with their content untouched, so text parts are joined by the chat template as
/// vLLM's own rendering joins them.
fn input_messages(items: &[Value]) -> Result<Vec<Value>, RequestError> {
    let mut messages: Vec<Value> = Vec::with_capacity(items.len());
    for item in items {
        let kind = item.get("type").and_then(Value::as_str);
        let call = |name: Value, arguments: Value| {
            // vLLM's key order: a template may print the call as JSON.
            json!({
                "id": string_field(item, "call_id"),
                "function": {"name": name, "arguments": arguments},
                "type": "function",
            })
        };
        match kind {
            Some("function_call") | Some("custom_tool_call") => {
                let call = if kind == Some("function_call") {
                    call(call_name(item), string_field(item, "arguments"))
                } else {
                    call(string_field(item, "name"), custom_call_arguments(item))
                };
                match open_assistant(&mut messages) {
                    Some(open) => match open.get_mut("tool_calls") {
                        Some(Value::Array(calls)) => calls.push(call),
                        _ => {
                            open.insert("tool_calls".into(), json!([call]));
                        }
                    },
                    None => messages.push(json!({"role": "assistant", "tool_calls": [call]})),
                }
            }
            Some("function_call_output") | Some("custom_tool_call_output") => {
                messages.push(json!({
                    "role": "tool",
                    "content": string_field(item, "output"),
                    "tool_call_id": string_field(item, "call_id"),
                }));
            }
            Some("reasoning") => {
                if item.get("encrypted_content").is_some_and(|e| !e.is_null()) {
                    return Err(RequestError::EncryptedReasoning);
                }
                // vLLM reads the first content part, else the first summary part.
                let first_text = |key: &str| {
                    item.get(key)
                        .and_then(Value::as_array)
                        .and_then(|parts| parts.first())
                        .and_then(|part| part.get("text"))
                        .cloned()
                };
                let text = first_text("content")
                    .or_else(|| first_text("summary"))
                    .unwrap_or_else(|| json!(""));
                match open_assistant(&mut messages) {
                    Some(open) if unset(open, "reasoning") => {
                        open.insert("reasoning".into(), text);
                    }
                    _ => messages.push(json!({"role": "assistant", "reasoning": text})),
                }
            }
            _ => {
                let Some(role) = item
                    .get("role")
                    .filter(|_| kind.is_none() || kind == Some("message"))
                else {
                    return Err(RequestError::UnsupportedItem(
                        kind.unwrap_or("(no type)").to_owned(),
                    ));
                };
                let content = item.get("content").cloned().unwrap_or(Value::Null);
                // An assistant message's text is its string, or its first part's text.
                let assistant_text = match &content {
                    Value::String(_) => Some(content.clone()),
                    Value::Array(parts) => parts.first().and_then(|p| p.get("text")).cloned(),
                    _ => None,
                };
                match (role.as_str(), assistant_text) {
                    (Some("assistant"), Some(text)) => match open_assistant(&mut messages) {
                        Some(open) if unset(open, "content") => {
                            open.insert("content".into(), text);
                        }
                        _ => messages.push(json!({"role": "assistant", "content": text})),
                    },
                    _ => messages.push(json!({"role": role, "content": chat_parts(content)})),
                }
            }
        }
    }
    Ok(messages)
}

/// A Responses request as vLLM's `construct_input_messages` builds it: `instructions` as a
/// system message, then the input, a string as one user message or a list item by item.
/// (`previous_response_id` requests are never converted: their history is one replica's.)
pub fn responses_chat_input(body: &Value) -> Result<ChatInput, RequestError> {
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
    match body.get("input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => messages.extend(input_messages(items)?),
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
        let input = responses_chat_input(&body).unwrap();
        let roles: Vec<&str> = input
            .messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        // Reasoning and the call merge into one assistant turn, as vLLM merges them.
        assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
        // Text parts stay parts: the template joins them as vLLM's rendering does.
        assert_eq!(
            input.messages[1]["content"],
            json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
        );
        assert_eq!(input.messages[2]["reasoning"], "think");
        assert_eq!(input.messages[2]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(input.messages[3]["content"], "42");
        assert_eq!(input.messages[4]["content"], "done");
        assert_eq!(
            input.tools.unwrap(),
            vec![json!({"type": "function", "function": {"name": "f", "parameters": {}}})]
        );
        assert_eq!(input.chat_template_kwargs["reasoning_effort"], "low");
        assert_eq!(input.chat_template_kwargs["enable_thinking"], true);
    }

    #[test]
    fn items_merge_into_an_open_assistant_turn_as_vllm_merges_them() {
        let body = json!({"input": [
            {"role": "assistant", "content": "let me look"},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "first"}]},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "second"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}, {"type": "output_text", "text": "y"}]},
        ]});
        let messages = responses_chat_input(&body).unwrap().messages;
        assert_eq!(
            messages,
            vec![
                json!({"role": "assistant", "content": "let me look", "reasoning": "first",
                       "tool_calls": [
                           {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                           {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}),
                // Reasoning already set: a new turn, whose unset content takes the text
                // (its first part only).
                json!({"role": "assistant", "reasoning": "second", "content": "x"}),
            ]
        );
    }

    #[test]
    fn what_vllm_rejects_is_an_error() {
        let encrypted = json!({"input": [{"type": "reasoning", "encrypted_content": "x"}]});
        assert_eq!(
            responses_chat_input(&encrypted),
            Err(RequestError::EncryptedReasoning)
        );
        let unknown = json!({"input": [{"type": "image_generation_call"}]});
        assert!(matches!(
            responses_chat_input(&unknown),
            Err(RequestError::UnsupportedItem(_))
        ));
        assert!(responses_chat_input(&json!({"input": 7})).is_err());
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
}
