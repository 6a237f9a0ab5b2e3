//! The emulated model's chat template: ChatML as Qwen3 renders it, deliberately not
//! append-only, like real reasoning models.
//!
//! * Reasoning of assistant turns before the last user message is dropped; the turns after
//!   it (a tool-call loop) keep theirs.
//! * Tools are rendered into the system block at the very start, so changing the tool
//!   list changes every token after it.
//! * `reasoning_effort` is rendered into the system block too; `enable_thinking: false`
//!   pre-fills an empty think block.
//!
//! A router that guesses tokens from message text gets these wrong; one that asks
//! `/tokenize` cannot.

use serde_json::{Map, Value};

/// Why a chat request cannot be rendered (vLLM answers 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// vLLM refuses both flags at once.
    #[error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")]
    BothPromptFlags,
    /// A message without a known role.
    #[error("message {0} has no supported role")]
    Role(usize),
    /// `continue_final_message` needs a final assistant message.
    #[error("continue_final_message requires the last message to be from the assistant")]
    NothingToContinue,
    /// `messages` is missing or empty.
    #[error("messages must be a non-empty array")]
    NoMessages,
}

/// How to render.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions<'a> {
    /// Chat-completions tools.
    pub tools: Option<&'a [Value]>,
    /// Open an assistant turn at the end.
    pub add_generation_prompt: bool,
    /// Leave the final assistant message open.
    pub continue_final_message: bool,
    /// Template arguments (`enable_thinking`, `reasoning_effort`, ...).
    pub kwargs: Option<&'a Map<String, Value>>,
}

fn text(content: Option<&Value>) -> String {
    content
        .and_then(kvaffine_core::request::content_text)
        .unwrap_or_default()
}

fn reasoning(message: &Value) -> Option<&str> {
    message
        .get("reasoning_content")
        .or_else(|| message.get("reasoning"))
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty())
}

/// What opens a kept think block, before the reasoning.
pub const THINK_OPEN: &str = "<think>\n";
/// What closes it, before the content.
pub const THINK_CLOSE: &str = "\n</think>\n\n";

/// An assistant message's body, as rendered and as generated: the think block (when
/// kept), the content, then each tool call.
pub fn assistant_body(message: &Value, keep_reasoning: bool) -> String {
    let mut out = String::new();
    if keep_reasoning {
        if let Some(r) = reasoning(message) {
            out.push_str(THINK_OPEN);
            out.push_str(r);
            out.push_str(THINK_CLOSE);
        }
    }
    out.push_str(&text(message.get("content")));
    for call in message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let function = call.get("function").unwrap_or(&Value::Null);
        let name = function.get("name").and_then(Value::as_str).unwrap_or("");
        let arguments = match function.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => "{}".into(),
        };
        out.push_str(&format!(
            "\n<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {arguments}}}\n</tool_call>"
        ));
    }
    out
}

fn role(message: &Value) -> &str {
    message.get("role").and_then(Value::as_str).unwrap_or("")
}

/// Renders `messages` to the prompt text.
pub fn render(messages: &[Value], options: &RenderOptions<'_>) -> Result<String, TemplateError> {
    if options.add_generation_prompt && options.continue_final_message {
        return Err(TemplateError::BothPromptFlags);
    }
    if messages.is_empty() {
        return Err(TemplateError::NoMessages);
    }
    let kwargs = options.kwargs;
    let effort = kwargs
        .and_then(|k| k.get("reasoning_effort"))
        .and_then(Value::as_str);
    let thinking = kwargs
        .and_then(|k| k.get("enable_thinking"))
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let tools = options.tools.filter(|t| !t.is_empty());
    let (system, rest) = match messages.split_first() {
        Some((first, rest)) if role(first) == "system" => (Some(text(first.get("content"))), rest),
        _ => (None, messages),
    };
    let mut out = String::new();
    if system.is_some() || tools.is_some() || effort.is_some() {
        out.push_str("<|im_start|>system\n");
        out.push_str(system.as_deref().unwrap_or(""));
        if let Some(effort) = effort {
            out.push_str(&format!("\nReasoning: {effort}"));
        }
        if let Some(tools) = tools {
            out.push_str("\n\n# Tools\n\n<tools>");
            for tool in tools {
                out.push('\n');
                out.push_str(&tool.to_string());
            }
            out.push_str("\n</tools>");
        }
        out.push_str("<|im_end|>\n");
    }
    let last_user = rest.iter().rposition(|m| role(m) == "user");
    for (i, message) in rest.iter().enumerate() {
        let is_last = i + 1 == rest.len();
        match role(message) {
            "user" => out.push_str(&format!(
                "<|im_start|>user\n{}<|im_end|>\n",
                text(message.get("content"))
            )),
            "system" => out.push_str(&format!(
                "<|im_start|>system\n{}<|im_end|>\n",
                text(message.get("content"))
            )),
            "tool" => out.push_str(&format!(
                "<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n",
                text(message.get("content"))
            )),
            "assistant" => {
                let keep = last_user.is_none_or(|u| i > u);
                out.push_str("<|im_start|>assistant\n");
                out.push_str(&assistant_body(message, keep));
                if !(is_last && options.continue_final_message) {
                    out.push_str("<|im_end|>\n");
                }
            }
            _ => return Err(TemplateError::Role(i)),
        }
    }
    if options.continue_final_message && rest.last().map(role) != Some("assistant") {
        return Err(TemplateError::NothingToContinue);
    }
    if options.add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
        if !thinking {
            out.push_str("<think>\n\n</think>\n\n");
        }
    }
    Ok(out)
}

/// Whether a generation for this template input opens with a think block.
pub fn thinks(kwargs: Option<&Map<String, Value>>) -> bool {
    kwargs
        .and_then(|k| k.get("enable_thinking"))
        .and_then(Value::as_bool)
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn opts() -> RenderOptions<'static> {
        RenderOptions {
            add_generation_prompt: true,
            ..RenderOptions::default()
        }
    }

    #[test]
    fn earlier_reasoning_is_dropped_and_later_reasoning_kept() {
        let turn = json!({"role": "assistant", "content": "A", "reasoning_content": "R"});
        let one = [json!({"role": "user", "content": "q"}), turn.clone()];
        let two = [
            one[0].clone(),
            turn,
            json!({"role": "user", "content": "q2"}),
        ];
        let rendered_one = render(&one, &RenderOptions::default()).unwrap();
        let rendered_two = render(&two, &opts()).unwrap();
        assert!(rendered_one.contains("<think>\nR\n</think>"));
        assert!(!rendered_two.contains("<think>\nR"));
        assert!(!rendered_two.starts_with(&rendered_one), "not append-only");
    }

    #[test]
    fn tools_and_effort_change_the_very_first_block() {
        let messages = [json!({"role": "user", "content": "q"})];
        let plain = render(&messages, &opts()).unwrap();
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        let with_tools = render(
            &messages,
            &RenderOptions {
                tools: Some(&tools),
                ..opts()
            },
        )
        .unwrap();
        let kwargs: Map<String, Value> = json!({"reasoning_effort": "high"})
            .as_object()
            .unwrap()
            .clone();
        let effort = render(
            &messages,
            &RenderOptions {
                kwargs: Some(&kwargs),
                ..opts()
            },
        )
        .unwrap();
        assert!(plain.starts_with("<|im_start|>user"));
        assert!(with_tools.starts_with("<|im_start|>system\n\n\n# Tools"));
        assert!(effort.starts_with("<|im_start|>system\n\nReasoning: high"));
    }

    #[test]
    fn prompt_flags_behave_as_vllm_requires() {
        let messages = [
            json!({"role": "user", "content": "q"}),
            json!({"role": "assistant", "content": "par"}),
        ];
        let both = RenderOptions {
            continue_final_message: true,
            ..opts()
        };
        assert_eq!(
            render(&messages, &both),
            Err(TemplateError::BothPromptFlags)
        );
        let cont = RenderOptions {
            continue_final_message: true,
            ..RenderOptions::default()
        };
        assert!(
            render(&messages, &cont)
                .unwrap()
                .ends_with("<|im_start|>assistant\npar")
        );
        let kwargs: Map<String, Value> = json!({"enable_thinking": false})
            .as_object()
            .unwrap()
            .clone();
        let off = render(
            &messages[..1],
            &RenderOptions {
                kwargs: Some(&kwargs),
                ..opts()
            },
        )
        .unwrap();
        assert!(off.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    }
}
