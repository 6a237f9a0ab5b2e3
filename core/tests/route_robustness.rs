//! Request bodies from clients are arbitrary: planning must return for any of them, and
//! what it forwards must be what vLLM would accept or the body unchanged.

// Test code: a failed expectation is a panic.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvaffine_core::api::Api;
use kvaffine_core::config::{Mode, Router};
use kvaffine_core::plan::{self, Action, Skip};
use proptest::prelude::*;
use serde_json::{Value, json};

fn router() -> Router {
    Router::from_json(br#"{"block_size":4}"#).unwrap()
}

const APIS: [Api; 3] = [Api::ChatCompletions, Api::Completions, Api::Responses];
const MODES: [Mode; 3] = [Mode::Precise, Mode::Approximate, Mode::Load];

fn check(body: &[u8]) {
    let router = router();
    for api in APIS {
        for mode in MODES {
            let plan = plan::plan(&router, api, mode, body);
            if let Action::Tokenize { body: call, .. } = &plan.action {
                if call.as_slice() != body {
                    let value: Value = serde_json::from_slice(call).unwrap();
                    assert!(value.get("messages").is_some_and(Value::is_array));
                }
            }
            let again = plan::plan(&router, api, mode, body);
            assert_eq!(again, plan, "planning is deterministic");
        }
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "[ -~é\u{0}-\u{1f}]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("messages".to_owned()),
                    Just("role".to_owned()),
                    Just("content".to_owned()),
                    Just("model".to_owned()),
                    Just("cache_salt".to_owned()),
                    Just("tools".to_owned()),
                    Just("input".to_owned()),
                    Just("prompt".to_owned()),
                    Just("type".to_owned()),
                    Just("reasoning_effort".to_owned()),
                    Just("chat_template_kwargs".to_owned()),
                    Just("previous_response_id".to_owned()),
                    "[a-z_]{1,8}",
                ],
                inner,
                0..8
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_json_shape_is_planned(value in json_value()) {
        check(value.to_string().as_bytes());
    }

    #[test]
    fn any_bytes_are_planned(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        check(&bytes);
    }

    #[test]
    fn wrong_types_in_every_field_are_planned(field in prop::sample::select(vec![
        "messages", "model", "cache_salt", "tools", "input", "prompt", "instructions",
        "reasoning_effort", "chat_template_kwargs", "reasoning", "add_generation_prompt",
    ]), value in json_value()) {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "input": "hi", "prompt": "hi"});
        body[field] = value;
        check(body.to_string().as_bytes());
    }
}

#[test]
fn hostile_bodies_are_planned_or_passed_through() {
    let router = router();
    // Nesting past serde_json's recursion limit: an error, not a stack overflow.
    let deep = format!(
        "{{\"messages\":{}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert_eq!(
        plan::plan(
            &router,
            Api::ChatCompletions,
            Mode::Precise,
            deep.as_bytes()
        )
        .action,
        Action::Skip(Skip::NotJson)
    );
    // Invalid UTF-8 inside a string.
    let mut bad = br#"{"messages":[{"role":"user","content":""#.to_vec();
    bad.extend_from_slice(&[0xff, 0xfe]);
    bad.extend_from_slice(br#""}]}"#);
    assert_eq!(
        plan::plan(&router, Api::ChatCompletions, Mode::Precise, &bad).action,
        Action::Skip(Skip::NotJson)
    );
    // 10k messages and a huge token-id prompt are planned, not refused.
    let many: Vec<Value> = (0..10_000)
        .map(|i| json!({"role": "user", "content": format!("m{i}")}))
        .collect();
    let body = json!({"messages": many}).to_string();
    assert!(matches!(
        plan::plan(
            &router,
            Api::ChatCompletions,
            Mode::Precise,
            body.as_bytes()
        )
        .action,
        Action::Tokenize { .. }
    ));
    let approximate = plan::plan(
        &router,
        Api::ChatCompletions,
        Mode::Approximate,
        body.as_bytes(),
    );
    assert!(matches!(approximate.action, Action::Approximate(ref k) if !k.is_empty()));
    let ids: Vec<u32> = (0..1_000_000).collect();
    let body = json!({"prompt": ids}).to_string();
    assert!(
        matches!(plan::plan(&router, Api::Completions, Mode::Precise, body.as_bytes()).action, Action::Lookup(ref k) if k.keys.len() == 250_000)
    );
}
