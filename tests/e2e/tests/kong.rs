//! The filter in Kong mode, run by `kong-host` (the wasmtime proxy-wasm host that answers
//! as Kong's ngx_wasm_module does), with a real kvaffined and vllm-emu replicas on
//! loopback. No Kong binary installs here; see tests/wasm-host for what the host mirrors.

use std::time::Duration;

use kvaffine_e2e::client::{Reply, post_json, send};
use kvaffine_e2e::{Gateway, Stack, StackConfig, poll};
use serde_json::{Value, json};
use vllm_emu::harness::http;

/// The body buffer deploy/kong raises Kong to.
const RAISED_BUFFER: usize = 16 * 1024 * 1024;

fn kong(client_body_buffer_size: usize) -> Stack {
    Stack::start(StackConfig {
        gateway: Gateway::Kong {
            client_body_buffer_size,
        },
        ..StackConfig::default()
    })
    .unwrap()
}

fn chat(stack: &Stack, body: &Value) -> Reply {
    post_json(&stack.gateway, "/v1/chat/completions", body)
}

/// About six bytes of JSON per word: `words` sets the body size.
fn history(seed: usize, words: usize) -> Value {
    let text: String = (0..words)
        .map(|i| format!("w{} ", (i * 7919 + seed) % 4999))
        .collect();
    json!([{"role": "system", "content": "You are an agent."}, {"role": "user", "content": text}])
}

#[test]
fn kong_mode_pins_continuations_through_the_service_target() {
    let stack = kong(RAISED_BUFFER);
    for seed in 0..4 {
        let salt = format!("k{seed}");
        let first = chat(
            &stack,
            &json!({"messages": history(seed, 600), "max_tokens": 16, "cache_salt": salt}),
        );
        assert_eq!(first.status, 200, "{}", first.body);
        let mut messages = history(seed, 600).as_array().unwrap().clone();
        messages.push(first.json()["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "continue"}));
        let second = chat(
            &stack,
            &json!({"messages": messages, "max_tokens": 8, "cache_salt": salt}),
        );
        assert_eq!(second.status, 200, "{}", second.body);
        assert_eq!(second.header("x-kvaffine-reason"), Some("prefix"));
        // The pick reached Kong's balancer: the replica that served is the one pinned,
        // and the one that served the first turn.
        let pinned = second.header("x-kvaffine-endpoint");
        assert_eq!(pinned, second.header("x-served-by"));
        assert_eq!(pinned, first.header("x-served-by"));
        let usage = &second.json()["usage"];
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(cached * 10 >= prompt * 8, "{cached} of {prompt} cached");
    }
    assert!(stack.filter_metric("kvaffine.routed.prefix") >= Some(4.0));
    assert!(stack.filter_metric("kvaffine.requests") >= Some(8.0));
}

#[test]
fn kongs_default_body_buffer_hides_prompts_from_the_filter() {
    // 8k is Kong's default `nginx_http_client_body_buffer_size`: a longer prompt is
    // spooled to a file the filter cannot read. It is still served, unpinned.
    let stack = kong(8 * 1024);
    let small = chat(
        &stack,
        &json!({"messages": history(1, 100), "max_tokens": 4}),
    );
    assert_eq!(small.status, 200, "{}", small.body);
    assert_ne!(
        small.header("x-kvaffine-endpoint"),
        None,
        "{:?}",
        small.headers
    );
    let large = chat(
        &stack,
        &json!({"messages": history(2, 2_000), "max_tokens": 4}),
    );
    assert_eq!(large.status, 200, "{}", large.body);
    assert_eq!(large.header("x-kvaffine-reason"), Some("body-unreadable"));
    assert_eq!(large.header("x-kvaffine-endpoint"), None);
    assert_eq!(
        stack.filter_metric("kvaffine.unpinned.body-unreadable"),
        Some(1.0)
    );
}

#[test]
fn kong_mode_never_fails_a_request_for_routing() {
    let mut stack = kong(RAISED_BUFFER);
    let models = send(&stack.gateway, "GET", "/v1/models", &[], b"");
    assert_eq!(models.status, 200);
    assert_eq!(models.header("x-kvaffine-reason"), Some("passthrough"));
    // A POST with an empty body has no prompt: it is not held waiting for a body step the
    // host may never run.
    let empty = send(&stack.gateway, "POST", "/v1/chat/completions", &[], b"");
    assert_eq!(empty.status, 400, "{}", empty.body);
    assert_eq!(empty.header("x-kvaffine-reason"), Some("no-prompt"));
    // Malformed JSON reaches the replica unchanged (and gets vLLM's own 400).
    let broken = send(
        &stack.gateway,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        b"{\"messages\": [",
    );
    assert_eq!(broken.status, 400, "{}", broken.body);
    stack.kill_daemon();
    for seed in 0..3 {
        let reply = chat(
            &stack,
            &json!({"messages": history(seed, 200), "max_tokens": 4}),
        );
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-kvaffine-reason"), Some("index-unavailable"));
    }
    assert_eq!(
        stack.filter_metric("kvaffine.unpinned.index-unavailable"),
        Some(3.0)
    );
}

#[test]
fn a_model_no_replica_serves_goes_through_unpinned_as_no_candidates() {
    let stack = kong(RAISED_BUFFER);
    // The daemon ranks only replicas serving the request's model, once their metrics say
    // what they serve.
    poll(
        "both replicas' models scraped",
        Duration::from_secs(10),
        || {
            let (_, text) = http(&stack.daemon_addr, "GET", "/v1/endpoints", "");
            let endpoints: Value = serde_json::from_str(&text).unwrap_or_default();
            let models: Vec<&Value> = endpoints["endpoints"]
                .as_array()
                .map(|all| all.iter().map(|e| &e["status"]["model"]).collect())
                .unwrap_or_default();
            models.len() == 2 && models.iter().all(|m| *m == "emu-model")
        },
    )
    .unwrap();
    let reply = chat(
        &stack,
        &json!({"model": "no-such-model", "messages": history(3, 50), "max_tokens": 2}),
    );
    // vLLM's own answer to an unknown model reaches the client unchanged.
    assert_eq!(reply.status, 404, "{}", reply.body);
    assert_eq!(reply.header("x-kvaffine-reason"), Some("no-candidates"));
    assert_eq!(
        stack.filter_metric("kvaffine.unpinned.no-candidates"),
        Some(1.0)
    );
    assert_eq!(
        stack.filter_metric("kvaffine.unpinned.index-unavailable"),
        Some(0.0)
    );
}

#[test]
fn a_client_that_goes_away_during_a_callout_leaves_nothing_open() {
    use std::io::Write;
    let stack = kong(RAISED_BUFFER);
    stack.freeze_daemon(true).unwrap();
    let body = json!({"messages": history(4, 200), "max_tokens": 2}).to_string();
    let mut client = std::net::TcpStream::connect(&stack.gateway).unwrap();
    write!(
        client,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: kong\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let open = || http(&stack.gateway, "GET", "/_wasm_host/streams", "").1;
    poll(
        "the request paused on its lookup",
        Duration::from_secs(10),
        || open() == "1",
    )
    .unwrap();
    drop(client);
    poll("its stream closed", Duration::from_secs(10), || {
        open() == "0"
    })
    .unwrap();
    stack.freeze_daemon(false).unwrap();
    // The lookup's late answer is dropped with its stream, and the filter still serves.
    let reply = chat(
        &stack,
        &json!({"messages": history(5, 200), "max_tokens": 2}),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
}
