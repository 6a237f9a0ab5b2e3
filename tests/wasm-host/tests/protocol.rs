//! The filter and a daemon one release apart still route: against a daemon that knows only
//! protocol 1 (it answers `/v2/lookup` with 404), the filter asks again on `/v1/lookup`,
//! pins from that release's own answer, and asks protocol 1 first from then on. The
//! protocol-1 answers are the bytes that release's daemon wrote (`core/tests/wire/v1/`).

use std::path::Path;

use kvaffine_wasm_host::vm::Vm;
use kvaffine_wasm_host::{filter_wasm, kong_target as target, one_call, open_token_prompt};

fn released_answer(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../core/tests/wire/v1")
            .join(name),
    )
    .expect("a recorded protocol-1 answer")
}

const CONFIG: &[u8] = br#"{"tokenizer_cluster": "127.0.0.1:1", "index_cluster": "127.0.0.1:2",
    "block_size": 16, "host": "kong"}"#;

#[test]
fn a_daemon_of_protocol_1_is_asked_again_in_protocol_1_and_routes() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let stream = open_token_prompt(&mut vm);
    let first = one_call(&mut vm);
    assert_eq!(first.path(), "/v2/lookup");
    let asked: serde_json::Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(asked["candidates"], 2, "the pick and one fallback: {asked}");
    assert_eq!(asked["blocks"].as_array().map(Vec::len), Some(2), "{asked}");
    vm.respond(&first, "404", Vec::new());
    let again = one_call(&mut vm);
    assert_eq!(again.path(), "/v1/lookup");
    let v1: serde_json::Value = serde_json::from_slice(&again.body).unwrap();
    assert_eq!(v1["keys"], asked["blocks"], "the same lookup: {v1}");
    assert_eq!(v1["model"], "tiny");
    vm.respond(&again, "200", released_answer("answer-prefix.json"));
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8001"));
    vm.close_stream(stream);

    // Remembered: the next request asks protocol 1 first.
    let stream = open_token_prompt(&mut vm);
    let next = one_call(&mut vm);
    assert_eq!(next.path(), "/v1/lookup");
    vm.respond(&next, "200", released_answer("answer-load.json"));
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8000"));
    assert!(
        vm.logs().any(|l| l.contains("/v1/lookup")),
        "the fallback is logged"
    );
}

#[test]
fn a_current_daemon_is_asked_in_protocol_2_and_its_reason_is_reported() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let stream = open_token_prompt(&mut vm);
    let call = one_call(&mut vm);
    assert_eq!(call.path(), "/v2/lookup");
    let v2 = br#"{"candidates":[{"endpoint":"127.0.0.1:8002","matched_blocks":1}],"reason":"saturated","complete":true}"#;
    vm.respond(&call, "200", v2.to_vec());
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8002"));
    let headers = vm
        .on_response_headers(stream, vec![(":status".into(), b"200".to_vec())])
        .expect("response headers");
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    };
    assert_eq!(header("x-kvaffine-reason").as_deref(), Some("saturated"));
    assert_eq!(header("x-kvaffine-matched-blocks").as_deref(), Some("1"));
    assert_eq!(header("x-kvaffine-mode").as_deref(), Some("precise"));
    assert!(
        vm.metrics()
            .iter()
            .any(|m| m.name == "pw.kvaffine.kvaffine.routed.saturated" && m.value == 1),
        "counted under its reason"
    );
}
