//! With `salt_probes` on, a salted request asks the index first whether any replica holds
//! its salt: routed at once when none does (no tokenizer call), tokenized and looked up as
//! before when one does (and its salt's next requests skip the question), and tokenized as
//! before against a daemon that does not know the question (404) or its fields (400),
//! remembered.

use kvaffine_wasm_host::vm::{CallRequest, Vm};
use kvaffine_wasm_host::{filter_wasm, kong_target as target, one_call, open_post, reason};

const CONFIG: &[u8] = br#"{"tokenizer_cluster": "127.0.0.1:1", "index_cluster": "127.0.0.1:2",
    "block_size": 16, "host": "kong", "salt_probes": true}"#;

/// A completions request with a string prompt (it needs the tokenizer), run to its first
/// callout.
fn open_salted(vm: &mut Vm, salt: &str) -> (u32, CallRequest) {
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "tiny", "prompt": "a prompt the tokenizer must read", "cache_salt": salt,
    }))
    .unwrap();
    let stream = open_post(vm, "/v1/completions", body);
    (stream, one_call(vm))
}

/// Answers the tokenizer callout, then the lookup that follows with `lookup`.
fn tokenize_and_look_up(vm: &mut Vm, tokenize: &CallRequest, lookup: &[u8]) {
    assert_eq!(
        (tokenize.path().as_str(), tokenize.upstream.as_str()),
        ("/tokenize", "127.0.0.1:1")
    );
    vm.respond(tokenize, "200", TOKENS.to_vec());
    let call = one_call(vm);
    assert_eq!(call.path(), "/v2/lookup");
    vm.respond(&call, "200", lookup.to_vec());
}

const TOKENS: &[u8] = br#"{"count":33,"max_model_len":4096,"tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33]}"#;

#[test]
fn a_salt_no_replica_holds_is_routed_without_tokenizing() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let (stream, probe) = open_salted(&mut vm, "tenant-new");
    assert_eq!(probe.path(), "/v2/salt");
    assert_eq!(probe.upstream, "127.0.0.1:2");
    let asked: serde_json::Value = serde_json::from_slice(&probe.body).unwrap();
    assert_eq!(
        asked["salt"].as_u64(),
        Some(kvaffine_core::salt_tag("tenant-new")),
        "{asked}"
    );
    assert_eq!(
        (&asked["model"], &asked["candidates"]),
        (&"tiny".into(), &2.into())
    );
    // Nothing tokenized yet: a quarter of a token per body byte.
    assert!(asked["tokens"].as_u64().is_some_and(|t| t > 10), "{asked}");
    // Its text keys, for the salt's next requests to follow it as far as they agree (the
    // prompt is shorter than one 256-byte chunk).
    assert_eq!(asked["text"], serde_json::json!([]), "{asked}");
    vm.respond(
        &probe,
        "200",
        br#"{"route":{"candidates":[{"endpoint":"127.0.0.1:8003","matched_blocks":0}],"reason":"new-salt","booked":"127.0.0.1:8003"}}"#.to_vec(),
    );
    assert!(vm.take_calls().is_empty(), "no tokenizer call");
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8003"));
    assert_eq!(reason(&mut vm, stream).as_deref(), Some("new-salt"));
}

#[test]
fn a_held_salt_is_tokenized_and_its_next_requests_skip_the_question() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let (stream, probe) = open_salted(&mut vm, "tenant-a");
    assert_eq!(probe.path(), "/v2/salt");
    vm.respond(
        &probe,
        "200",
        br#"{"tokenize_at":"127.0.0.1:8001"}"#.to_vec(),
    );
    let tokenize = one_call(&mut vm);
    tokenize_and_look_up(
        &mut vm,
        &tokenize,
        br#"{"candidates":[{"endpoint":"127.0.0.1:8001","matched_blocks":2}],"reason":"prefix"}"#,
    );
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8001"));
    assert_eq!(reason(&mut vm, stream).as_deref(), Some("prefix"));
    vm.close_stream(stream);

    // The same salt again: straight to the tokenizer. Another salt is asked about.
    let (stream, first) = open_salted(&mut vm, "tenant-a");
    assert_eq!(first.path(), "/tokenize");
    vm.respond(&first, "500", Vec::new());
    assert_eq!(
        one_call(&mut vm).path(),
        "/v2/lookup",
        "the approximate fallback"
    );
    vm.close_stream(stream);
    let (_, first) = open_salted(&mut vm, "tenant-b");
    assert_eq!(first.path(), "/v2/salt");
    // Sized as the request of the same length that was tokenized: 33 tokens.
    let asked: serde_json::Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(asked["tokens"], 33, "{asked}");
}

/// A daemon before salt probes (404), or before the probe's text keys (400: it refuses
/// fields it does not know).
#[test]
fn a_daemon_without_salt_probes_is_asked_no_more_and_requests_still_route() {
    for status in ["404", "400"] {
        refused_probes_are_remembered(status);
    }
}

fn refused_probes_are_remembered(status: &str) {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let (stream, probe) = open_salted(&mut vm, "tenant-c");
    assert_eq!(probe.path(), "/v2/salt");
    vm.respond(&probe, status, Vec::new());
    let tokenize = one_call(&mut vm);
    tokenize_and_look_up(
        &mut vm,
        &tokenize,
        br#"{"candidates":[{"endpoint":"127.0.0.1:8002","matched_blocks":0}],"reason":"load"}"#,
    );
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8002"));
    vm.close_stream(stream);
    let (_, first) = open_salted(&mut vm, "tenant-d");
    assert_eq!(first.path(), "/tokenize", "the {status} is remembered");
    assert!(vm.logs().any(|l| l.contains("/v2/salt")), "and logged");
}

#[test]
fn without_salt_probes_a_salted_request_is_tokenized_first() {
    let config = br#"{"tokenizer_cluster": "127.0.0.1:1", "index_cluster": "127.0.0.1:2",
        "block_size": 16, "host": "kong"}"#;
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", config).expect("the filter loads");
    let (_, first) = open_salted(&mut vm, "tenant-f");
    assert_eq!(first.path(), "/tokenize");
}

#[test]
fn a_failed_probe_falls_back_to_tokenizing() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    for answer in [&b"not json"[..], br#"{"route":{"reason":"load"}}"#] {
        let (stream, probe) = open_salted(&mut vm, "tenant-e");
        vm.respond(&probe, "200", answer.to_vec());
        assert_eq!(one_call(&mut vm).path(), "/tokenize");
        vm.close_stream(stream);
    }
    let (_, probe) = open_salted(&mut vm, "tenant-e");
    assert_eq!(probe.path(), "/v2/salt", "a failure is not remembered");
}
