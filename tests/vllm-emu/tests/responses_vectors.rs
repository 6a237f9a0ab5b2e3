//! The emulator renders Responses requests from the messages and tools vLLM's own code
//! builds for them (`tests/vllm/vectors/responses.json`, by `cargo xtask vectors`),
//! `previous_response_id` continuations included.

use serde_json::Value;
use vllm_emu::responses::{Previous, messages, tools};

#[test]
fn the_emulators_conversion_is_vllms() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../vllm/vectors/responses.json");
    let vectors: Value =
        serde_json::from_slice(&std::fs::read(&path).expect("the Responses vectors")).unwrap();
    let cases = vectors["cases"].as_array().unwrap();
    assert!(cases.len() >= 10, "{} cases", cases.len());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let previous = case["previous"].as_object().map(|p| Previous {
            messages: p["messages"].as_array().unwrap().clone(),
            output: p["output"].as_array().unwrap().clone(),
        });
        let converted = messages(&case["body"], previous.as_ref())
            .unwrap_or_else(|e| panic!("{name}: vLLM converts it, the emulator refused: {e}"));
        assert_eq!(Value::from(converted), case["messages"], "{name}");
        assert_eq!(
            tools(&case["body"]).map(Value::from).unwrap_or(Value::Null),
            case["tools"],
            "{name}: tools"
        );
    }
}
