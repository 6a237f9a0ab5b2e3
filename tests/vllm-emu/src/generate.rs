//! Deterministic generation: the same prompt and seed always give the same output, so a
//! client can carry an assistant turn back and the emulator recognises its own tokens.

use serde_json::{Value, json};

use crate::rng::XorShift64;
use crate::template::{THINK_CLOSE, THINK_OPEN, assistant_body};
use crate::tokenizer;

const WORDS: [&str; 48] = [
    "the", "model", "cache", "prefix", "block", "token", "route", "replica", "answer", "tool",
    "call", "result", "check", "first", "next", "value", "state", "event", "index", "query",
    "search", "file", "line", "code", "test", "build", "error", "fix", "plan", "step", "read",
    "write", "data", "time", "load", "warm", "cold", "turn", "agent", "user", "system", "reply",
    "source", "path", "list", "map", "key", "hash",
];

/// One generation: what the response says and the tokens the engine produced.
#[derive(Debug, Clone)]
pub struct Output {
    /// Reasoning text, when the template opened a think block.
    pub reasoning: Option<String>,
    /// Answer text.
    pub content: String,
    /// `(call id, tool name, JSON arguments)` when the model calls a tool.
    pub tool_call: Option<(String, String, String)>,
    /// Every generated token, end-of-turn included.
    pub tokens: Vec<u32>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
    /// Generated pieces with the response field each belongs to (`None`: markup).
    pub pieces: Vec<(Option<&'static str>, String)>,
}

/// `n` words drawn from [`WORDS`].
fn words(rng: &mut XorShift64, n: usize) -> String {
    (0..n)
        .map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize])
        .collect::<Vec<_>>()
        .join(" ")
}

fn seed_of(prompt: &[u32], seed: u64) -> u64 {
    let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
    (xxhash_rust::xxh3::xxh3_64(&bytes) ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1
}

/// The assistant message JSON of an output, as a client sends it back.
pub fn message(output: &Output) -> Value {
    let mut message = json!({"role": "assistant", "content": output.content});
    if let Some(reasoning) = &output.reasoning {
        message["reasoning_content"] = json!(reasoning);
    }
    if let Some((id, name, arguments)) = &output.tool_call {
        message["tool_calls"] = json!([{
            "id": id, "type": "function", "function": {"name": name, "arguments": arguments}
        }]);
    }
    message
}

/// A chat turn: an optional think block, content or a tool call, then end of turn. A turn
/// longer than `max_tokens` is cut at `max_tokens` tokens, as a real model runs out of
/// budget mid-sentence: `finish_reason` is `length` and the fields hold what was
/// generated up to the cut.
pub fn chat(
    prompt: &[u32],
    seed: u64,
    max_tokens: usize,
    thinking: bool,
    tool: Option<&str>,
) -> Output {
    let reasoning_words = if thinking { max_tokens / 4 } else { 0 };
    let content_words = if tool.is_some() {
        0
    } else {
        (max_tokens / 2).max(1)
    };
    let mut rng = XorShift64::from_state(seed_of(prompt, seed));
    let reasoning = (reasoning_words > 0).then(|| words(&mut rng, reasoning_words));
    let content = words(&mut rng, content_words);
    let tool_call = tool.map(|name| {
        let call = format!("call_{:016x}", rng.state());
        let arguments = json!({"query": words(&mut rng, 2)}).to_string();
        (call, name.to_owned(), arguments)
    });
    let mut output = Output {
        reasoning,
        content,
        tool_call,
        tokens: Vec::new(),
        finish_reason: if tool.is_some() { "tool_calls" } else { "stop" },
        pieces: Vec::new(),
    };
    let text = format!("{}<|im_end|>", assistant_body(&message(&output), true));
    let reasoning_len = output.reasoning.as_ref().map_or(0, String::len);
    // Byte ranges of the reasoning and content inside `text`.
    let reasoning_start = THINK_OPEN.len();
    let reasoning_range = reasoning_start..reasoning_start + reasoning_len;
    let content_start = if output.reasoning.is_some() {
        reasoning_range.end + THINK_CLOSE.len()
    } else {
        0
    };
    let content_range = content_start..content_start + output.content.len();
    let mut at = 0;
    for (id, piece) in tokenizer::tokenize(&text) {
        let field = if output.reasoning.is_some() && reasoning_range.contains(&at) {
            Some("reasoning_content")
        } else if content_range.contains(&at) {
            Some("content")
        } else {
            None
        };
        at += piece.len();
        output.tokens.push(id);
        output.pieces.push((field, piece));
    }
    if output.tokens.len() > max_tokens {
        output.tokens.truncate(max_tokens);
        output.pieces.truncate(max_tokens);
        let joined = |field| {
            output
                .pieces
                .iter()
                .filter(|(f, _)| *f == Some(field))
                .map(|(_, p)| p.as_str())
                .collect::<String>()
        };
        let (reasoning, content) = (joined("reasoning_content"), joined("content"));
        output.reasoning = output.reasoning.is_some().then_some(reasoning);
        output.content = content;
        output.tool_call = None;
        output.finish_reason = "length";
    }
    output
}

/// A completion: `max_tokens` words continuing the prompt.
pub fn completion(prompt: &[u32], seed: u64, max_tokens: usize) -> Output {
    let mut rng = XorShift64::from_state(seed_of(prompt, seed));
    let text = format!(" {}", words(&mut rng, max_tokens));
    let mut pieces = tokenizer::tokenize(&text);
    pieces.truncate(max_tokens);
    Output {
        reasoning: None,
        content: pieces.iter().map(|(_, p)| p.as_str()).collect(),
        tool_call: None,
        tokens: pieces.iter().map(|(id, _)| *id).collect(),
        finish_reason: "length",
        pieces: pieces.into_iter().map(|(_, p)| (Some("text"), p)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::{RenderOptions, render};

    #[test]
    fn output_is_deterministic_and_within_budget() {
        let a = chat(&[1, 2, 3], 0, 40, true, None);
        let b = chat(&[1, 2, 3], 0, 40, true, None);
        assert_eq!(a.tokens, b.tokens);
        assert!(a.tokens.len() <= 40);
        assert_ne!(chat(&[1, 2, 4], 0, 40, true, None).tokens, a.tokens);
        assert_eq!(a.tokens.last(), Some(&151_645));
        let streamed: String = a
            .pieces
            .iter()
            .filter(|(f, _)| *f == Some("content"))
            .map(|(_, p)| p.as_str())
            .collect();
        assert_eq!(streamed, a.content);
    }

    #[test]
    fn a_carried_back_turn_renders_to_the_generated_tokens() {
        let user = json!({"role": "user", "content": "question"});
        let prompt_text = render(
            std::slice::from_ref(&user),
            &RenderOptions {
                add_generation_prompt: true,
                ..RenderOptions::default()
            },
        )
        .unwrap();
        let prompt = tokenizer::token_ids(&prompt_text);
        let out = chat(&prompt, 7, 64, true, Some("search"));
        assert_eq!(out.finish_reason, "tool_calls");
        let history = [user, message(&out)];
        let rendered = tokenizer::token_ids(&render(&history, &RenderOptions::default()).unwrap());
        let mut expected = prompt.clone();
        expected.extend(&out.tokens);
        // The history ends with "<|im_end|>\n"; the generation stopped at "<|im_end|>".
        assert_eq!(&rendered[..expected.len()], expected.as_slice());
    }
}
