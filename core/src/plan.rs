//! A buffered request body to the next step: which tokenizer call to make, or which keys
//! to look up, or why to pass it through unchanged.

use serde_json::{Map, Value, json};

use crate::api::Api;
use crate::approximate::{TextKey, approximate_keys, templated_keys};
use crate::config::{ChatTokenize, Mode, ResponsesTokenize, Router};
use crate::keys::{KeyExtras, LoraAdapter};
use crate::reason::Reason;
use crate::request::{self, ChatInput, RequestError};
use crate::salt::CacheSalt;
use crate::tokens::PromptKeys;

/// vLLM's tokenizer endpoints, the only paths a tokenizer call goes to.
pub const TOKENIZE_PATH: &str = "/tokenize";
/// The renderer chat completions use (`chat_tokenize: render`).
pub const CHAT_RENDER_PATH: &str = "/v1/chat/completions/render";
/// The renderer Responses use (`responses_tokenize: render`).
pub const RESPONSES_RENDER_PATH: &str = "/v1/responses/render";
/// Every path [`Action::Tokenize`] names: the index makes a filter's tokenizer call only
/// to one of these.
pub const TOKENIZER_PATHS: [&str; 3] = [TOKENIZE_PATH, CHAT_RENDER_PATH, RESPONSES_RENDER_PATH];

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
    /// The reason the response reports and the stats count.
    pub fn reason(&self) -> Reason {
        match self {
            Self::NotJson | Self::NotAnObject => Reason::UnparsedBody,
            Self::InvalidCacheSalt => Reason::InvalidCacheSalt,
            Self::PreviousResponse => Reason::PreviousResponse,
            Self::Unrenderable(_) => Reason::Unrenderable,
            Self::NoPrompt => Reason::NoPrompt,
        }
    }
}

/// The next step for a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Call the tokenizer: `POST path` with `body`.
    Tokenize {
        /// One of [`TOKENIZER_PATHS`].
        path: &'static str,
        /// The JSON body.
        body: Vec<u8>,
    },
    /// Keys are known already (token-id prompts).
    Lookup(PromptKeys),
    /// Approximate keys from the text.
    Approximate(Vec<TextKey>),
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
    /// Whether the client asked for a streamed answer (`"stream": true`): its response
    /// headers come before any token, so a replica that sends none soon is not working.
    pub streamed: bool,
    /// Salt and LoRA that enter the keys.
    pub extras: KeyExtras,
    /// The next step.
    pub action: Action,
}

fn skip(model: Option<String>, streamed: bool, why: Skip) -> Plan {
    Plan {
        model,
        streamed,
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
        return skip(None, false, Skip::NotJson);
    };
    if !value.is_object() {
        return skip(None, false, Skip::NotAnObject);
    }
    let model = value
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let streamed = value.get("stream").and_then(Value::as_bool) == Some(true);
    let cache_salt = match value.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match CacheSalt::parse(s) {
            Ok(salt) => Some(salt),
            Err(_) => return skip(model, streamed, Skip::InvalidCacheSalt),
        },
        Some(_) => return skip(model, streamed, Skip::InvalidCacheSalt),
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
            Err(why) => return skip(model, streamed, why),
        }
    };
    Plan {
        model,
        streamed,
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
                // The renderer chat completions use takes the body as the client sent it.
                _ if router.config.chat_tokenize == ChatTokenize::Render => Action::Tokenize {
                    path: CHAT_RENDER_PATH,
                    body: body.to_vec(),
                },
                // `/tokenize` accepts and ignores the chat-completions fields it does not
                // know, so the body goes as it came, unless reasoning must be named or
                // `reasoning_effort` folded into the template arguments (`/tokenize`
                // cannot take it).
                _ if no_effort && !unnamed => Action::Tokenize {
                    path: TOKENIZE_PATH,
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
                        path: TOKENIZE_PATH,
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
                        path: TOKENIZE_PATH,
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
                    path: TOKENIZE_PATH,
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
            let input = request::responses_chat_input(value).map_err(unrenderable)?;
            match (mode, router.config.responses_tokenize) {
                (Mode::Approximate, _) => approximate(&chat_text(&input.messages)),
                (_, ResponsesTokenize::Render) => Action::Tokenize {
                    path: RESPONSES_RENDER_PATH,
                    body: body.to_vec(),
                },
                (_, ResponsesTokenize::Convert) => Action::Tokenize {
                    path: TOKENIZE_PATH,
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
) -> Option<Vec<TextKey>> {
    keyed_text(router, api, body, plan, |_| Vec::new())
}

/// Text keys for a salt probe (see [`crate::protocol::SaltProbe::text`]): the request's
/// text, seeded also by its other template inputs ([`template_inputs`]), so that the index
/// can tell a sibling of a salt's first request, still in flight, that shares its prompt
/// from one that shares only its text. Load accounting only: no block key comes from
/// text.
pub fn probe_text_keys(
    router: &Router,
    api: Api,
    body: &[u8],
    plan: &Plan,
) -> Option<Vec<TextKey>> {
    keyed_text(router, api, body, plan, template_inputs)
}

/// The body's text keys, seeded by what `template` reads of the body.
fn keyed_text(
    router: &Router,
    api: Api,
    body: &[u8],
    plan: &Plan,
    template: fn(&Value) -> Vec<u8>,
) -> Option<Vec<TextKey>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let text = request_text(api, &value)?;
    Some(templated_keys(
        router,
        plan.model.as_deref(),
        &plan.extras,
        &template(&value),
        &text,
    ))
}

/// The text approximate keys are made of.
fn request_text(api: Api, value: &Value) -> Option<String> {
    Some(match api {
        Api::ChatCompletions => chat_text(value.get("messages")?.as_array()?),
        Api::Completions => value.get("prompt")?.as_str()?.to_owned(),
        Api::Responses => chat_text(&request::responses_chat_input(value).ok()?.messages),
    })
}

/// Body fields that leave the rendered prompt alone (sampling, output, streaming,
/// bookkeeping), or are keyed on their own (the model, the salt, the text itself).
const NOT_RENDERED: &[&str] = &[
    "model",
    "cache_salt",
    "messages",
    "prompt",
    "input",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "user",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "ignore_eos",
    "metadata",
    "store",
    "priority",
    "request_id",
    "response_format",
];

/// Every other top-level field of the body, sorted by name (the body's own order does
/// not render): tools, template arguments, reasoning effort, and any field not known to
/// leave the prompt alone, so that a top-level field kvaffine does not know can only
/// split siblings. Within messages only roles, text and tool calls are keyed: siblings
/// that differ only in an image, or a message's name, share keys (load accounting only).
fn template_inputs(value: &Value) -> Vec<u8> {
    let Some(object) = value.as_object() else {
        return Vec::new();
    };
    let mut fields: Vec<(&String, &Value)> = object
        .iter()
        .filter(|(name, _)| !NOT_RENDERED.contains(&name.as_str()))
        .collect();
    fields.sort_unstable_by_key(|&(name, _)| name);
    let mut bytes = Vec::new();
    for (name, field) in fields {
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(field.to_string().as_bytes());
        bytes.push(0);
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(json: &str) -> Router {
        Router::from_json(json.as_bytes()).unwrap()
    }

    #[test]
    fn chat_requests_without_an_effort_go_to_tokenize_as_they_came() {
        let r = router(r#"{"block_size":4}"#);
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}"#;
        let Action::Tokenize { path, body: call } =
            plan(&r, Api::ChatCompletions, Mode::Precise, body).action
        else {
            panic!()
        };
        assert_eq!((path, call.as_slice()), ("/tokenize", &body[..]));
    }

    #[test]
    fn only_a_true_stream_field_makes_a_request_streamed() {
        let r = router(r#"{"block_size":4}"#);
        let streamed =
            |body: &str| plan(&r, Api::ChatCompletions, Mode::Precise, body.as_bytes()).streamed;
        let chat =
            |extra: &str| format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
        assert!(streamed(&chat(r#","stream":true"#)));
        assert!(!streamed(&chat(r#","stream":false"#)));
        assert!(!streamed(&chat(r#","stream":"yes""#)));
        assert!(!streamed(&chat("")));
        // Known even when routing skips the request.
        assert!(streamed(&chat(r#","stream":true,"cache_salt":7"#)));
        assert!(!streamed("not json"));
    }

    #[test]
    fn chat_requests_tokenize_with_the_effort_folded_into_template_kwargs() {
        let r = router(r#"{"block_size":4}"#);
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
        let r = router(r#"{"block_size":4}"#);
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
        let r = router(r#"{"block_size":4,"loras":{"sql":"/adapters/sql"}}"#);
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
        let r = router(r#"{"block_size":4}"#);
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

    /// The tokenizer call `config` plans for `body` in precise mode.
    fn tokenize_call(config: &str, api: Api, body: &[u8]) -> (&'static str, Vec<u8>) {
        match plan(&router(config), api, Mode::Precise, body).action {
            Action::Tokenize { path, body } => (path, body),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn responses_convert_or_render() {
        let body = br#"{"model":"m","instructions":"be brief","input":"hello"}"#;
        let (path, call) = tokenize_call(r#"{"block_size":4}"#, Api::Responses, body);
        assert_eq!(path, "/tokenize");
        let call: Value = serde_json::from_slice(&call).unwrap();
        assert_eq!(
            call["messages"][0],
            json!({"role": "system", "content": "be brief"})
        );
        let render = r#"{"block_size":4,"responses_tokenize":"render"}"#;
        assert_eq!(
            tokenize_call(render, Api::Responses, body),
            ("/v1/responses/render", body.to_vec())
        );
    }

    #[test]
    fn chat_tokenize_or_render() {
        let body =
            br#"{"model":"m","messages":[{"role":"user","content":"q"}],"reasoning_effort":"low"}"#;
        let render = r#"{"block_size":4,"chat_tokenize":"render"}"#;
        assert_eq!(
            tokenize_call(render, Api::ChatCompletions, body),
            ("/v1/chat/completions/render", body.to_vec()),
            "the body as sent: the renderer reads every chat field"
        );
        let (path, _) = tokenize_call(r#"{"block_size":4}"#, Api::ChatCompletions, body);
        assert_eq!(path, "/tokenize");
        assert!(matches!(
            plan(
                &router(render),
                Api::ChatCompletions,
                Mode::Approximate,
                body
            )
            .action,
            Action::Approximate(_)
        ));
    }

    #[test]
    fn reasoning_content_reaches_tokenize_as_reasoning() {
        let r = router(r#"{"block_size":4}"#);
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
    fn approximate_mode_keys_the_text() {
        let r = router(r#"{"block_size":4,"mode":"approximate","approximate_chunk_bytes":8}"#);
        let body = br#"{"messages":[{"role":"user","content":"a long enough message"}]}"#;
        assert!(
            matches!(plan(&r, Api::ChatCompletions, r.config.mode, body).action, Action::Approximate(k) if !k.is_empty())
        );
    }

    #[test]
    fn probe_keys_agree_on_what_renders_alike_and_only_on_that() {
        let r = router(r#"{"block_size":4,"approximate_chunk_bytes":8}"#);
        let keys = |body: Value| {
            let body = body.to_string().into_bytes();
            let plan = plan(&r, Api::ChatCompletions, Mode::Precise, &body);
            probe_text_keys(&r, Api::ChatCompletions, &body, &plan).unwrap()
        };
        let doc = "a shared document, long enough for several chunks";
        let first = keys(json!({"model": "m", "cache_salt": "team", "max_tokens": 8,
            "messages": [{"role": "user", "content": format!("{doc}: task one")}]}));
        assert!(first.len() > 4);
        // Sampling and streaming fields, and the fields' order, render nothing.
        let same = keys(
            json!({"stream": true, "temperature": 0.5, "cache_salt": "team",
            "messages": [{"role": "user", "content": format!("{doc}: task one")}], "model": "m"}),
        );
        assert_eq!(same, first);
        // A sibling sharing the document shares the keys of its chunks, and no more.
        let sibling = keys(json!({"model": "m", "cache_salt": "team",
            "messages": [{"role": "user", "content": format!("{doc}: task two")}]}));
        let shared = first
            .iter()
            .zip(&sibling)
            .take_while(|(a, b)| a == b)
            .count();
        assert!(
            shared >= 4 && shared < first.len(),
            "{shared} of {}",
            first.len()
        );
        // The same text through another template, an unknown field or another salt
        // shares nothing.
        for other in [
            json!({"reasoning_effort": "high"}),
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
            json!({"a_field_kvaffine_does_not_know": 1}),
            json!({"cache_salt": "other"}),
        ] {
            let mut body = json!({"model": "m", "cache_salt": "team", "max_tokens": 8,
                "messages": [{"role": "user", "content": format!("{doc}: task one")}]});
            for (name, field) in other.as_object().unwrap() {
                body[name] = field.clone();
            }
            assert_ne!(keys(body)[0], first[0], "{other}");
        }
        // Without template inputs they are the approximate keys.
        let body =
            br#"{"model":"m","messages":[{"role":"user","content":"a long enough message"}]}"#;
        let plan = plan(&r, Api::ChatCompletions, Mode::Precise, body);
        assert_eq!(
            probe_text_keys(&r, Api::ChatCompletions, body, &plan),
            approximate_fallback(&r, Api::ChatCompletions, body, &plan)
        );
    }
}
