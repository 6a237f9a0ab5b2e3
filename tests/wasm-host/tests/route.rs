//! With `tokenize_at_index` on, a request's tokenizer call goes to the index in its one
//! callout (`/v2/route`): the call's body verbatim after a JSON line of key settings, the
//! salt probe riding on it; the answer is pinned as a lookup's is. A daemon before route
//! callouts (404) is remembered and the filter tokenizes itself; one that cannot tokenize
//! (502) leaves the request to its text, as a failed tokenizer call does.

use kvaffine_core::protocol::RouteRequest;
use kvaffine_wasm_host::vm::Vm;
use kvaffine_wasm_host::{filter_wasm, kong_target as target, one_call, open_post, reason};

const CONFIG: &[u8] = br#"{"tokenizer_cluster": "127.0.0.1:1", "index_cluster": "127.0.0.1:2",
    "block_size": 16, "host": "kong", "tokenize_at_index": true, "hash_seed": "7"}"#;

const PINNED: &[u8] = br#"{"route":{"candidates":[{"endpoint":"127.0.0.1:8002","matched_blocks":2}],"reason":"prefix"},"tokens":33,"tokenized_at":"127.0.0.1:8001"}"#;

fn completions(salt: Option<&str>) -> Vec<u8> {
    let mut body =
        serde_json::json!({"model": "tiny", "prompt": "a prompt the tokenizer must read"});
    if let Some(salt) = salt {
        body["cache_salt"] = salt.into();
    }
    serde_json::to_vec(&body).unwrap()
}

#[test]
fn a_request_is_tokenized_keyed_and_looked_up_at_the_index_in_one_callout() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let body = completions(Some("tenant-a"));
    let stream = open_post(&mut vm, "/v1/completions", body.clone());
    let call = one_call(&mut vm);
    assert_eq!(
        (call.path().as_str(), call.upstream.as_str()),
        ("/v2/route", "127.0.0.1:2")
    );
    let (asked, tokenizer_body) = RouteRequest::read(&call.body).expect("a route body");
    // The tokenizer's body as the filter would have sent it itself: the completion as it
    // came; the key settings the filter's own, with the request's salt.
    assert_eq!(tokenizer_body, &body[..]);
    assert_eq!(asked.path, "/tokenize");
    assert_eq!(
        (
            asked.keys.block_size,
            asked.keys.hash_seed.as_deref(),
            asked.keys.cache_salt.as_deref()
        ),
        (16, Some("7"), Some("tenant-a"))
    );
    assert_eq!(
        (asked.model.as_deref(), asked.candidates),
        (Some("tiny"), 2)
    );
    assert!(asked.book.is_some() && asked.probe.is_none(), "{asked:?}");
    vm.respond(&call, "200", PINNED.to_vec());
    assert!(vm.take_calls().is_empty(), "no other callout");
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8002"));
    assert_eq!(reason(&mut vm, stream).as_deref(), Some("prefix"));
    let route_time = vm
        .metrics()
        .iter()
        .find(|m| m.name.ends_with("kvaffine.route_us"))
        .map(|m| m.samples);
    assert_eq!(route_time, Some(1));
}

#[test]
fn a_daemon_before_route_callouts_is_asked_no_more_and_the_filter_tokenizes() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let stream = open_post(&mut vm, "/v1/completions", completions(None));
    let route = one_call(&mut vm);
    assert_eq!(route.path(), "/v2/route");
    vm.respond(&route, "404", Vec::new());
    let tokenize = one_call(&mut vm);
    assert_eq!(
        (tokenize.path().as_str(), tokenize.upstream.as_str()),
        ("/tokenize", "127.0.0.1:1")
    );
    vm.respond(
        &tokenize,
        "200",
        br#"{"count":33,"tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33]}"#.to_vec(),
    );
    let lookup = one_call(&mut vm);
    assert_eq!(lookup.path(), "/v2/lookup");
    vm.respond(
        &lookup,
        "200",
        br#"{"candidates":[{"endpoint":"127.0.0.1:8003","matched_blocks":0}],"reason":"load"}"#
            .to_vec(),
    );
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8003"));
    vm.close_stream(stream);
    let _ = open_post(&mut vm, "/v1/completions", completions(None));
    assert_eq!(
        one_call(&mut vm).path(),
        "/tokenize",
        "the 404 is remembered"
    );
    assert!(vm.logs().any(|l| l.contains("/v2/route")), "and logged");
}

#[test]
fn a_route_the_index_cannot_tokenize_goes_by_its_text_and_a_refused_one_the_usual_way() {
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", CONFIG).expect("the filter loads");
    let stream = open_post(&mut vm, "/v1/completions", completions(None));
    let route = one_call(&mut vm);
    vm.respond(&route, "502", Vec::new());
    let text = one_call(&mut vm);
    assert_eq!(text.path(), "/v2/lookup");
    let asked: serde_json::Value = serde_json::from_slice(&text.body).unwrap();
    assert!(asked["text"].is_array(), "{asked}");
    vm.respond(
        &text,
        "200",
        br#"{"candidates":[{"endpoint":"127.0.0.1:8002","matched_blocks":0}],"reason":"load"}"#
            .to_vec(),
    );
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8002"));
    vm.close_stream(stream);
    // Refused for this body (400, 413): tokenized by the filter, and not remembered.
    for status in ["400", "413"] {
        let stream = open_post(&mut vm, "/v1/completions", completions(None));
        let route = one_call(&mut vm);
        assert_eq!(route.path(), "/v2/route", "{status} is not remembered");
        vm.respond(&route, status, Vec::new());
        assert_eq!(one_call(&mut vm).path(), "/tokenize");
        vm.close_stream(stream);
    }
    // An index that does not answer: unpinned, as a failed lookup.
    let stream = open_post(&mut vm, "/v1/completions", completions(None));
    let route = one_call(&mut vm);
    vm.respond(&route, "503", Vec::new());
    assert!(vm.take_calls().is_empty());
    assert_eq!(target(&vm, stream), None);
    assert_eq!(
        reason(&mut vm, stream).as_deref(),
        Some("index-unavailable")
    );
}

#[test]
fn the_salt_probe_rides_on_the_route_callout_until_the_salt_is_held() {
    let config = br#"{"tokenizer_cluster": "127.0.0.1:1", "index_cluster": "127.0.0.1:2",
        "block_size": 16, "host": "kong", "tokenize_at_index": true, "salt_probes": true}"#;
    let mut vm = Vm::load(&filter_wasm(), "kvaffine", config).expect("the filter loads");
    // No replica holds the salt: routed by the probe, untokenized.
    let stream = open_post(&mut vm, "/v1/completions", completions(Some("tenant-b")));
    let call = one_call(&mut vm);
    let (asked, _) = RouteRequest::read(&call.body).expect("a route body");
    let probe = asked.probe.expect("the salt probe rides along");
    assert_eq!(probe.salt, kvaffine_core::salt_tag("tenant-b"));
    vm.respond(
        &call,
        "200",
        br#"{"route":{"candidates":[{"endpoint":"127.0.0.1:8001","matched_blocks":0}],"reason":"new-salt"}}"#.to_vec(),
    );
    assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8001"));
    assert_eq!(reason(&mut vm, stream).as_deref(), Some("new-salt"));
    vm.close_stream(stream);
    // A replica holds it: tokenized at the index; the salt's next request is not probed.
    for probed in [true, false] {
        let stream = open_post(&mut vm, "/v1/completions", completions(Some("tenant-c")));
        let call = one_call(&mut vm);
        let (asked, _) = RouteRequest::read(&call.body).expect("a route body");
        assert_eq!(asked.probe.is_some(), probed);
        vm.respond(&call, "200", PINNED.to_vec());
        assert_eq!(target(&vm, stream).as_deref(), Some("127.0.0.1:8002"));
        vm.close_stream(stream);
    }
}
