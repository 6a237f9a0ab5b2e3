//! The filter's Responses-to-chat conversion against vLLM's own (`construct_input_messages`
//! and `construct_tool_dicts`, run by `cargo xtask vectors` into
//! `tests/vllm/vectors/responses.json`). vLLM's messages are compared as its chat parser
//! reads them next: a message item's `type` dropped, `input_text` and `output_text` parts
//! as the `text` parts `/tokenize` takes; tools without the fields vLLM leaves null.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use kvaffine_core::request::responses_chat_input;
use serde_json::{Map, Value, json};

fn vectors() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/vllm/vectors/responses.json");
    serde_json::from_slice(&std::fs::read(&path).expect("the Responses vectors")).unwrap()
}

fn as_parsed(message: &Value) -> Value {
    let mut message = message.as_object().cloned().unwrap();
    if message.get("type") == Some(&json!("message")) {
        message.remove("type");
    }
    if let Some(Value::Array(parts)) = message.get_mut("content") {
        for part in parts {
            if matches!(part["type"].as_str(), Some("input_text" | "output_text")) {
                *part = json!({"type": "text", "text": part["text"]});
            }
        }
    }
    Value::Object(message)
}

fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect::<Map<_, _>>(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

#[test]
fn the_filters_conversion_is_vllms() {
    let vectors = vectors();
    let cases = vectors["cases"].as_array().unwrap();
    let mut compared = 0;
    for case in cases.iter().filter(|c| c["previous"].is_null()) {
        let name = case["name"].as_str().unwrap();
        let input = responses_chat_input(&case["body"])
            .unwrap_or_else(|e| panic!("{name}: vLLM converts it, kvaffine refused: {e}"));
        let expected: Vec<Value> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(as_parsed)
            .collect();
        assert_eq!(input.messages, expected, "{name}");
        let tools = input.tools.filter(|t| !t.is_empty()).map(Value::from);
        let vllm_tools = Some(without_nulls(&case["tools"])).filter(|t| !t.is_null());
        assert_eq!(tools, vllm_tools, "{name}: tools");
        // Key order too: a template that prints tools prints them in this order.
        assert_eq!(
            serde_json::to_string(&tools).unwrap(),
            serde_json::to_string(&vllm_tools).unwrap(),
            "{name}: tool key order"
        );
        compared += 1;
    }
    assert!(compared >= 10, "only {compared} cases compared");
}
