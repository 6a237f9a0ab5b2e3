//! Predicted against actual, in the compiled filter: the answer's usage is read as it
//! passes (every chunk continues unchanged), counted per replica, and sent to the index in
//! batches from the root's timer; a daemon of the release before outcomes (404) costs
//! nothing but the outcomes, and routing goes on.

use kvaffine_wasm_host::vm::{Action, Vm};
use kvaffine_wasm_host::{filter_wasm, open_token_prompt};
use serde_json::Value;

const CONFIG: &[u8] = br#"{"tokenizer_cluster": "127.0.0.1:1", "index_cluster": "127.0.0.1:2",
    "block_size": 16, "host": "kong", "report_outcomes": true}"#;

/// A completions request with 33 token ids (two servable blocks), pinned to `endpoint`
/// with `matched` blocks.
fn routed(vm: &mut Vm, endpoint: &str, matched: u32) -> u32 {
    let stream = open_token_prompt(vm);
    let calls = vm.take_calls();
    assert_eq!(calls.len(), 1, "the lookup");
    let answer = format!(
        r#"{{"candidates":[{{"endpoint":"{endpoint}","matched_blocks":{matched}}}],"reason":"prefix","complete":true}}"#
    );
    vm.respond(&calls[0], "200", answer.into_bytes());
    let state = vm.stream_state(stream).expect("the stream");
    assert!(state.resumed);
    stream
}

/// The replica's answer, in `chunks`, each of which must pass on unchanged.
fn answer(vm: &mut Vm, stream: u32, content_type: &str, chunks: &[&[u8]]) {
    vm.on_response_headers(
        stream,
        vec![
            (":status".into(), b"200".to_vec()),
            ("content-type".into(), content_type.as_bytes().to_vec()),
        ],
    )
    .expect("response headers");
    for (n, chunk) in chunks.iter().enumerate() {
        let last = n + 1 == chunks.len();
        assert_eq!(
            vm.on_response_body(stream, chunk, last),
            Some(Action::Continue)
        );
        assert_eq!(
            vm.stream_state(stream).map(|s| s.response_chunk.as_slice()),
            Some(*chunk),
            "the answer passes unchanged"
        );
    }
    vm.close_stream(stream);
}

fn metric(vm: &Vm, name: &str) -> i64 {
    vm.metrics()
        .iter()
        .find(|m| m.name == format!("pw.kvaffine.kvaffine.{name}"))
        .map_or(0, |m| m.value)
}

#[test]
fn outcomes_are_counted_per_replica_and_sent_in_batches() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    assert_eq!(
        vm.tick_period_ms(),
        1000,
        "a one-second timer for the batches"
    );

    // A non-streamed answer, cut anywhere: served what was predicted.
    let stream = routed(&mut vm, "127.0.0.1:8002", 2);
    let body = br#"{"id":"c","choices":[{"text":"x"}],"usage":{"prompt_tokens":33,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":32}}}"#;
    let (a, b) = body.split_at(40);
    answer(&mut vm, stream, "application/json", &[a, b]);

    // A stream whose last usage event says less was served than predicted.
    let stream = routed(&mut vm, "127.0.0.1:8003", 2);
    answer(
        &mut vm,
        stream,
        "text/event-stream",
        &[
            b"data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: {\"choices\":[],\"usa",
            b"ge\":{\"prompt_tokens\":33,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n",
            b"data: [DONE]\n\n",
        ],
    );

    // Without cached tokens in the answer (a replica without
    // --enable-prompt-tokens-details): unmeasured, not a miss.
    let stream = routed(&mut vm, "127.0.0.1:8002", 2);
    answer(
        &mut vm,
        stream,
        "application/json",
        &[br#"{"usage":{"prompt_tokens":33}}"#],
    );

    for (name, value) in [
        ("endpoint.127_0_0_1_8002.outcomes", 1),
        ("endpoint.127_0_0_1_8002.predicted_cached_tokens", 32),
        ("endpoint.127_0_0_1_8002.cached_tokens", 32),
        ("endpoint.127_0_0_1_8002.prediction_error_tokens", 0),
        ("endpoint.127_0_0_1_8003.outcomes", 1),
        ("endpoint.127_0_0_1_8003.cached_tokens", 16),
        ("endpoint.127_0_0_1_8003.prediction_error_tokens", 16),
        ("outcomes.unmeasured", 1),
    ] {
        assert_eq!(metric(&vm, name), value, "{name}");
    }

    // Nothing is sent from the request path; the timer sends one batch.
    assert!(vm.take_calls().is_empty());
    vm.tick();
    let calls = vm.take_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].path(), "/v1/outcomes");
    let batch: Value = serde_json::from_slice(&calls[0].body).unwrap();
    let outcomes = batch["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), 2, "{batch}");
    assert_eq!(outcomes[0]["endpoint"], "127.0.0.1:8002");
    assert_eq!(outcomes[0]["predicted_tokens"], 32);
    assert_eq!(outcomes[0]["cached_tokens"], 32);
    assert_eq!(outcomes[0]["prompt_tokens"], 33);
    assert_eq!(outcomes[0]["reason"], "prefix");
    assert_eq!(outcomes[0]["model"], "tiny");
    assert_eq!(outcomes[1]["cached_tokens"], 16);
    // One batch at a time.
    vm.tick();
    assert!(vm.take_calls().is_empty());
    vm.respond(&calls[0], "200", br#"{"recorded":2}"#.to_vec());
    vm.tick();
    assert!(vm.take_calls().is_empty(), "nothing left to send");
}

#[test]
fn a_daemon_without_outcomes_still_routes_and_the_outcomes_are_dropped_counted() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let body: &[u8] =
        br#"{"usage":{"prompt_tokens":33,"prompt_tokens_details":{"cached_tokens":32}}}"#;
    let stream = routed(&mut vm, "127.0.0.1:8002", 2);
    answer(&mut vm, stream, "application/json", &[body]);
    vm.tick();
    let calls = vm.take_calls();
    assert_eq!(calls.len(), 1);
    vm.respond(&calls[0], "404", Vec::new());
    assert!(
        vm.logs().any(|l| l.contains("/v1/outcomes")),
        "the older daemon is logged"
    );
    assert_eq!(metric(&vm, "outcomes.dropped"), 1);

    // Routing goes on; the next outcomes are not sent for a while, only counted.
    let stream = routed(&mut vm, "127.0.0.1:8002", 2);
    answer(&mut vm, stream, "application/json", &[body]);
    vm.tick();
    assert!(vm.take_calls().is_empty());
    assert_eq!(metric(&vm, "outcomes.dropped"), 2);
    assert_eq!(metric(&vm, "endpoint.127_0_0_1_8002.outcomes"), 2);
}

#[test]
fn off_by_default_nothing_is_read_or_sent() {
    let config = br#"{"tokenizer_cluster": "127.0.0.1:1", "index_cluster": "127.0.0.1:2",
        "block_size": 16, "host": "kong"}"#;
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", config).expect("the filter loads");
    assert_eq!(vm.tick_period_ms(), 0);
    let stream = routed(&mut vm, "127.0.0.1:8002", 2);
    answer(
        &mut vm,
        stream,
        "application/json",
        &[br#"{"usage":{"prompt_tokens":33,"prompt_tokens_details":{"cached_tokens":32}}}"#],
    );
    assert_eq!(metric(&vm, "endpoint.127_0_0_1_8002.outcomes"), 0);
    vm.tick();
    assert!(vm.take_calls().is_empty());
}

#[test]
fn a_failing_index_is_warned_about_once_per_spell_and_its_batches_counted() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let body: &[u8] =
        br#"{"usage":{"prompt_tokens":33,"prompt_tokens_details":{"cached_tokens":32}}}"#;
    let warnings = |vm: &Vm| vm.logs().filter(|l| l.contains("refused")).count();
    for status in ["503", "503", "200", "503"] {
        let stream = routed(&mut vm, "127.0.0.1:8002", 2);
        answer(&mut vm, stream, "application/json", &[body]);
        vm.tick();
        let calls = vm.take_calls();
        assert_eq!(calls.len(), 1, "a batch is sent every tick while it fails");
        vm.respond(&calls[0], status, Vec::new());
    }
    assert_eq!(warnings(&vm), 2, "one warning per failing spell");
    assert!(vm.logs().any(|l| l.contains("takes outcomes again")));
    assert_eq!(metric(&vm, "outcomes.dropped"), 3);
}
