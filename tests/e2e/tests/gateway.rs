//! End to end through a real Envoy 1.40 with the filter, a real kvaffined and vllm-emu
//! replicas, all on loopback. Needs `cargo xtask test` (it builds the filter and installs
//! Envoy first).

use std::time::Duration;

use kvaffine_e2e::client::{Reply, post_json, send, send_raw};
use kvaffine_e2e::{Stack, StackConfig, poll};
use serde_json::{Value, json};

fn chat(stack: &Stack, body: &Value) -> Reply {
    post_json(&stack.gateway, "/v1/chat/completions", body)
}

fn long_history(seed: usize) -> Value {
    let text: String = (0..600)
        .map(|i| format!("w{} ", (i * 7919 + seed) % 4999))
        .collect();
    json!([{"role": "system", "content": "You are an agent."}, {"role": "user", "content": text}])
}

/// kvaffined's count of API calls refused for their token (`/metrics` needs none).
fn unauthorized(stack: &Stack) -> f64 {
    let metrics = send(&stack.daemon_addr, "GET", "/metrics", &[], b"");
    assert_eq!(metrics.status, 200, "/metrics needs no token");
    metrics
        .body
        .lines()
        .find_map(|l| l.strip_prefix("kvaffined_unauthorized_requests_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .expect("kvaffined_unauthorized_requests_total is exported")
}

/// Turn 2 of `body` (`first`'s answer, then one more user turn) is routed to the replica
/// holding turn 1 and served from its cache.
fn continues_warm(stack: &Stack, body: &Value, first: &Reply) {
    let mut continued = body.clone();
    let messages = continued["messages"].as_array_mut().unwrap();
    messages.push(first.json()["choices"][0]["message"].clone());
    messages.push(json!({"role": "user", "content": "go on"}));
    let second = chat(stack, &continued);
    assert_eq!(
        second.header("x-kvaffine-reason"),
        Some("prefix"),
        "{:?}",
        second.headers
    );
    assert!(cached(&second) > 0);
}

fn cached(reply: &Reply) -> u64 {
    reply
        .json()
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// The replica served at least 80% of the reply's prompt from its cache, by its usage.
fn assert_mostly_cached(reply: &Reply) {
    let prompt = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached(reply) * 10 >= prompt * 8,
        "{} of {prompt} cached",
        cached(reply)
    );
}

#[test]
fn a_continuation_is_pinned_to_the_warm_replica() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    for seed in 0..4 {
        let history = long_history(seed);
        let first = chat(
            &stack,
            &json!({"messages": history, "max_tokens": 16, "cache_salt": format!("s{seed}")}),
        );
        assert_eq!(first.status, 200, "{}", first.body);
        let warm = first.header("x-kvaffine-endpoint").map(str::to_owned);
        let mut messages = history.as_array().unwrap().clone();
        messages.push(first.json()["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "continue"}));
        let body = json!({"messages": messages, "max_tokens": 8, "cache_salt": format!("s{seed}")});
        // Events reach the daemon asynchronously; the booking made by the first turn
        // already points the continuation at the same replica.
        let second = chat(&stack, &body);
        assert_eq!(second.status, 200, "{}", second.body);
        assert_eq!(
            second.header("x-kvaffine-reason"),
            Some("prefix"),
            "{:?}",
            second.headers
        );
        assert_eq!(
            second.header("x-kvaffine-endpoint").map(str::to_owned),
            warm
        );
        assert_mostly_cached(&second);
    }
    assert!(stack.stat("wasmcustom.kvaffine.routed.prefix") >= 4.0);
}

/// Tokenizer calls the gateway made.
fn tokenizer_calls(stack: &Stack) -> f64 {
    stack.stat("cluster.tokenizer.upstream_rq_total")
}

/// On a route whose tokenizer calls kvaffined makes (`tokenize_at: index`), the gateway
/// calls no tokenizer: kvaffined does, keys the tokens and looks up in one callout, and a
/// continuation lands warm, predicted exactly as the replica reports serving it from its
/// cache. The same stack's default route still tokenizes in the gateway.
#[test]
fn tokenized_by_the_index_a_continuation_lands_warm_as_predicted() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    let routes = || stack.daemon_metric("kvaffined_route_tokenize_seconds_count");
    for seed in 0..3 {
        let history = long_history(500 + seed);
        let (calls, routed) = (tokenizer_calls(&stack), routes());
        let via_index =
            |body: &Value| post_json(&stack.gateway, "/index-tokenized/v1/chat/completions", body);
        // The salt enters the keys kvaffined makes, as it does the filter's.
        let salt = format!("indexed-{seed}");
        let first = via_index(&json!({"messages": history, "max_tokens": 8, "cache_salt": salt}));
        assert_eq!(first.status, 200, "{}", first.body);
        let warm = first.header("x-served-by").map(str::to_owned);
        assert_eq!(first.header("x-kvaffine-endpoint").map(str::to_owned), warm);
        // Its events in, the prediction is what they confirm rather than a booking.
        stack.wait_salt_held(&salt).unwrap();
        let mut messages = history.as_array().unwrap().clone();
        messages.push(first.json()["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "continue"}));
        let second = via_index(&json!({"messages": messages, "max_tokens": 8, "cache_salt": salt}));
        assert_eq!(second.status, 200, "{}", second.body);
        assert_eq!(
            (
                second.header("x-kvaffine-reason"),
                second.header("x-served-by").map(str::to_owned)
            ),
            (Some("prefix"), warm),
            "{:?}",
            second.headers
        );
        let predicted: u64 = second
            .header("x-kvaffine-matched-blocks")
            .and_then(|m| m.parse().ok())
            .unwrap();
        assert_eq!(predicted * 16, cached(&second), "{:?}", second.headers);
        assert_mostly_cached(&second);
        assert_eq!(
            tokenizer_calls(&stack),
            calls,
            "the gateway tokenized nothing"
        );
        assert_eq!(routes(), routed + 2.0, "kvaffined tokenized both turns");
    }
    let calls = tokenizer_calls(&stack);
    let default_route = chat(
        &stack,
        &json!({"messages": long_history(600), "max_tokens": 8}),
    );
    assert_eq!(default_route.status, 200, "{}", default_route.body);
    assert_eq!(
        tokenizer_calls(&stack),
        calls + 1.0,
        "tokenized in the gateway"
    );
    assert_eq!(
        stack.daemon_metric("kvaffined_route_tokenize_failures_total"),
        0.0
    );
}

/// A route callout kvaffined cannot use is refused with a status the filter acts on and a
/// reason a person can read: a body not of the form, or one that names a path other than
/// a tokenizer's (kvaffined posts only to those), 400; a model no replica serves, 502
/// (the filter then keys the request by its text); a tokenizer that refuses the body, 502
/// with the replica's answer.
#[test]
fn kvaffined_refuses_route_callouts_it_cannot_use_and_says_why() {
    use kvaffine_core::protocol::{KeySettings, RouteRequest};
    let stack = Stack::start(StackConfig::default()).unwrap();
    // The replicas' models are known from their metrics.
    stack.wait_scraped().unwrap();
    let keys = KeySettings {
        block_size: 16,
        hash_algo: "sha256_cbor".into(),
        hash_seed: None,
        vllm_compat: "0.31".into(),
        cache_salt: None,
        lora: None,
    };
    let request = |path: &str, model: Option<&str>| RouteRequest {
        path: path.into(),
        keys: keys.clone(),
        model: model.map(str::to_owned),
        book: None,
        candidates: 1,
        probe: None,
        timeout_ms: Some(1_000),
    };
    let call = br#"{"prompt": "a prompt"}"#;
    let route = |body: Vec<u8>| {
        let (status, text) = vllm_emu::harness::http(
            &stack.daemon_addr,
            "POST",
            "/v2/route",
            std::str::from_utf8(&body).unwrap(),
        );
        let error = serde_json::from_str::<Value>(&text).unwrap_or_default()["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        (status, error)
    };
    let (status, error) = route(request("/v1/chat/completions", None).to_body(call));
    assert_eq!(status, 400);
    assert!(error.contains("not a tokenizer path"), "{error}");
    let (status, error) = route(br#"{"path": "/tokenize"}"#.to_vec());
    assert_eq!(status, 400);
    assert!(error.contains("a JSON line, a newline"), "{error}");
    let (status, error) = route(request("/tokenize", Some("no-such-model")).to_body(call));
    assert_eq!(status, 502);
    assert!(error.contains("no usable replica"), "{error}");
    let (status, error) = route(request("/tokenize", None).to_body(b"not json"));
    assert_eq!(status, 502);
    assert!(error.contains("answered 4"), "{error}");
    let (status, _) = route(request("/tokenize", None).to_body(call));
    assert_eq!(status, 200);
    assert_eq!(
        stack.daemon_metric("kvaffined_route_tokenize_failures_total"),
        2.0
    );
}

#[test]
fn a_new_salt_is_routed_without_tokenizing_and_its_continuation_lands_warm() {
    let stack = Stack::start(StackConfig {
        filter: json!({"salt_probes": true}),
        ..StackConfig::default()
    })
    .unwrap();
    for seed in 0..4 {
        let salt = format!("fresh-{seed}");
        let history = long_history(100 + seed);
        let calls = tokenizer_calls(&stack);
        let first = chat(
            &stack,
            &json!({"messages": history, "max_tokens": 8, "cache_salt": salt}),
        );
        assert_eq!(first.status, 200, "{}", first.body);
        let seen = (
            first.header("x-kvaffine-reason"),
            first.header("x-kvaffine-matched-blocks"),
        );
        assert_eq!(seen, (Some("new-salt"), Some("0")), "{:?}", first.headers);
        let warm = first.header("x-served-by").map(str::to_owned);
        assert_eq!(first.header("x-kvaffine-endpoint").map(str::to_owned), warm);
        assert_eq!(tokenizer_calls(&stack), calls, "turn 1 was not tokenized");
        let mut messages = history.as_array().unwrap().clone();
        messages.push(first.json()["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "continue"}));
        // Turn 2 follows its salt: tokenized and routed by prefix once kvaffined has the
        // replica's events, by the salt's booking before.
        let second = chat(
            &stack,
            &json!({"messages": messages, "max_tokens": 8, "cache_salt": salt}),
        );
        assert_eq!(second.status, 200, "{}", second.body);
        assert!(
            matches!(
                second.header("x-kvaffine-reason"),
                Some("prefix" | "salt-booked")
            ),
            "{:?}",
            second.headers
        );
        assert_eq!(second.header("x-served-by").map(str::to_owned), warm);
        assert_mostly_cached(&second);
    }
    assert!(stack.stat("wasmcustom.kvaffine.routed.new-salt") >= 4.0);
}

/// Before any replica's events show a new salt (held back 60 s here), its next requests
/// are routed by the probe too, and follow its first request only as far as they render
/// alike: its continuation, sent at once, and a sibling with the same template and
/// document go where the first went, the sibling
/// served from its cache (vLLM's usage says so), while one that offers tools (the same
/// text, other tokens from the first block) is not sent after it.
#[test]
fn a_new_salts_siblings_follow_its_first_request_only_where_they_render_alike() {
    let stack = Stack::start(StackConfig {
        filter: json!({"salt_probes": true}),
        replica_args: vec!["--event-lag-ms".into(), "60000".into()],
        ..StackConfig::default()
    })
    .unwrap();
    let calls = tokenizer_calls(&stack);
    let history = long_history(300);
    let sibling_of = |task: &str| {
        let mut messages = history.as_array().unwrap().clone();
        messages.push(json!({"role": "assistant", "content": "Read."}));
        messages.push(json!({"role": "user", "content": task}));
        messages
    };
    let first = chat(
        &stack,
        &json!({"messages": sibling_of("task one"), "max_tokens": 8, "cache_salt": "team"}),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-kvaffine-reason"), Some("new-salt"));
    let warm = first.header("x-served-by").map(str::to_owned);
    // Its continuation, at once: the first's booked prefill, still queued by kvaffined's
    // clock, is one it needs wherever it goes, so it does not push it off.
    let mut continued = sibling_of("task one");
    continued.push(first.json()["choices"][0]["message"].clone());
    continued.push(json!({"role": "user", "content": "continue"}));
    let second = chat(
        &stack,
        &json!({"messages": continued, "max_tokens": 8, "cache_salt": "team"}),
    );
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(
        second.header("x-kvaffine-reason"),
        Some("salt-booked"),
        "{:?}",
        second.headers
    );
    assert_eq!(second.header("x-served-by").map(str::to_owned), warm);
    // Until the first's booked prefill has drained, the queue in front of it costs more
    // than a cold prefill elsewhere for a sibling, which needs only part of it.
    poll(
        "the first's booked prefill drained",
        Duration::from_secs(10),
        || {
            send(
                &stack.daemon_addr,
                "POST",
                "/v1/lookup",
                &[("content-type", "application/json")],
                br#"{"keys": []}"#,
            )
            .json()["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .all(|e| e["pending_prefill_tokens"] == 0)
        },
    )
    .unwrap();
    let sibling = chat(
        &stack,
        &json!({"messages": sibling_of("task two"), "max_tokens": 8, "cache_salt": "team"}),
    );
    assert_eq!(sibling.status, 200, "{}", sibling.body);
    let seen = (
        sibling.header("x-kvaffine-reason"),
        sibling.header("x-kvaffine-matched-blocks"),
    );
    assert_eq!(
        seen,
        (Some("salt-booked"), Some("0")),
        "{:?}",
        sibling.headers
    );
    assert_eq!(sibling.header("x-served-by").map(str::to_owned), warm);
    assert_mostly_cached(&sibling);
    let tools = json!([{"type": "function", "function": {"name": "search",
        "parameters": {"type": "object", "properties": {}}}}]);
    let other = chat(
        &stack,
        &json!({"messages": sibling_of("task one"), "max_tokens": 8, "cache_salt": "team",
                "tools": tools}),
    );
    assert_eq!(other.status, 200, "{}", other.body);
    assert_eq!(
        other.header("x-kvaffine-reason"),
        Some("new-salt"),
        "{:?}",
        other.headers
    );
    assert_eq!(tokenizer_calls(&stack), calls, "none was tokenized");
}

/// Turn 1 sent straight to a replica (around the gateway), then turn 2 through it: the
/// salt is known from the replica's events, so turn 2 is tokenized and lands warm, with
/// two active-active daemons and across a daemon restart (rebuilt by replay).
#[test]
fn a_salt_first_sent_around_the_gateway_is_routed_warm() {
    let mut stack = Stack::start(StackConfig {
        daemons: 2,
        filter: json!({"salt_probes": true}),
        ..StackConfig::default()
    })
    .unwrap();
    for (round, restart) in [(0, false), (1, true)] {
        let salt = format!("around-{round}");
        let history = long_history(200 + round);
        let replica = stack.replica_addresses()[round].clone();
        let first = post_json(
            &replica,
            "/v1/chat/completions",
            &json!({"messages": history, "max_tokens": 8, "cache_salt": salt}),
        );
        assert_eq!(first.status, 200, "{}", first.body);
        stack.wait_salt_held(&salt).unwrap();
        if restart {
            stack.restart_daemon().unwrap();
            stack.wait_salt_held(&salt).unwrap();
        }
        let mut messages = history.as_array().unwrap().clone();
        messages.push(first.json()["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "continue"}));
        let calls = tokenizer_calls(&stack);
        let second = chat(
            &stack,
            &json!({"messages": messages, "max_tokens": 8, "cache_salt": salt}),
        );
        assert_eq!(second.status, 200, "{}", second.body);
        assert_eq!(
            (
                second.header("x-kvaffine-reason"),
                second.header("x-served-by")
            ),
            (Some("prefix"), Some(replica.as_str())),
            "{:?}",
            second.headers
        );
        assert_eq!(tokenizer_calls(&stack), calls + 1.0, "turn 2 was tokenized");
        assert_mostly_cached(&second);
    }
}

/// One of two active-active daemons killed: Envoy takes it out of rotation within a few
/// health-check intervals, and every lookup after that is answered by the other. (Envoy
/// checks a cluster that has carried no routed request only every `no_traffic_interval`,
/// 60 s unless set, and lookups are callouts: the dead daemon had kept every other lookup
/// unanswered for a minute.)
#[test]
fn a_dead_daemon_leaves_rotation_and_the_other_answers_every_lookup() {
    let mut stack = Stack::start(StackConfig {
        daemons: 2,
        ..StackConfig::default()
    })
    .unwrap();
    let body = |seed: usize| json!({"messages": long_history(seed), "max_tokens": 2});
    stack.kill_daemon();
    poll(
        "the dead daemon out of rotation",
        Duration::from_secs(10),
        || !stack.daemon_in_rotation(),
    )
    .unwrap();
    for seed in 0..10 {
        let reply = chat(&stack, &body(500 + seed));
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_ne!(
            reply.header("x-kvaffine-reason"),
            Some("index-unavailable"),
            "lookup {seed} after the daemon left rotation"
        );
    }
}

#[test]
fn gets_pass_through_and_spoofed_destinations_never_leave_the_pool() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    let models = send(&stack.gateway, "GET", "/v1/models", &[], b"");
    assert_eq!(models.status, 200);
    assert_eq!(models.header("x-kvaffine-reason"), Some("passthrough"));
    let spoofed = [
        ("x-gateway-destination-endpoint", "169.254.169.254:80"),
        ("content-type", "application/json"),
    ];
    for path in ["/v1/models", "/v1/chat/completions"] {
        let method = if path == "/v1/models" { "GET" } else { "POST" };
        let body = if method == "POST" {
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string()
        } else {
            String::new()
        };
        let reply = send(&stack.gateway, method, path, &spoofed, body.as_bytes());
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
        let served = reply.header("x-served-by").unwrap_or("");
        assert!(
            stack.replicas.iter().any(|r| r.http == served),
            "{path} served by {served:?}, not a pool member"
        );
    }
    // A spoofed destination that is a pool member is stripped too: were it honoured, every
    // request would land on it; stripped, least-request spreads them.
    let target = stack.replicas[1].http.clone();
    let served: std::collections::HashSet<String> = (0..24)
        .map(|_| {
            let reply = send(
                &stack.gateway,
                "GET",
                "/v1/models",
                &[("x-gateway-destination-endpoint", &target)],
                b"",
            );
            assert_eq!(reply.status, 200);
            reply.header("x-served-by").unwrap_or("").to_owned()
        })
        .collect();
    assert_eq!(served.len(), 2, "{served:?}");
}

#[test]
fn routing_failures_never_fail_requests() {
    let mut stack = Stack::start(StackConfig::default()).unwrap();
    let body = json!({"messages": long_history(7), "max_tokens": 4});
    assert_eq!(chat(&stack, &body).status, 200);
    stack.kill_daemon();
    let reply = chat(&stack, &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-kvaffine-reason"), Some("index-unavailable"));
    // Malformed JSON is forwarded unchanged; the replica answers it.
    let garbage = send(
        &stack.gateway,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        b"{not json",
    );
    assert_eq!(garbage.status, 400);
    assert_eq!(garbage.header("x-kvaffine-reason"), Some("unparsed-body"));
    assert!(
        garbage.body.contains("invalid JSON body"),
        "{}",
        garbage.body
    );
}

#[test]
fn a_dead_tokenizer_falls_back_to_approximate_routing() {
    let stack = Stack::start(StackConfig {
        filter: json!({"tokenizer_cluster": "kvaffined"}),
        ..StackConfig::default()
    })
    .unwrap();
    // "kvaffined" answers /tokenize with 404: the filter falls back, the request succeeds.
    let reply = chat(
        &stack,
        &json!({"messages": long_history(8), "max_tokens": 4}),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-kvaffine-mode"), Some("approximate"));
    assert!(stack.stat("wasmcustom.kvaffine.unpinned.tokenize-failed") >= 1.0);
}

#[test]
fn big_and_chunked_requests_are_routed_and_sse_streams() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    // A 10 MB body: buffered, parsed, forwarded intact.
    let big = "x".repeat(10 * 1024 * 1024);
    let body = json!({"messages": [{"role": "user", "content": big}], "max_tokens": 2});
    let reply = chat(&stack, &body);
    assert_eq!(
        reply.status,
        200,
        "{}",
        &reply.body[..reply.body.len().min(300)]
    );
    assert!(reply.json()["usage"]["prompt_tokens"].as_u64().unwrap() > 5);
    // Chunked upload.
    let payload = json!({"messages": long_history(9), "max_tokens": 2}).to_string();
    let mut request = String::from(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
    );
    for chunk in payload.as_bytes().chunks(1000) {
        request.push_str(&format!(
            "{:x}\r\n{}\r\n",
            chunk.len(),
            String::from_utf8_lossy(chunk)
        ));
    }
    request.push_str("0\r\n\r\n");
    let chunked = send_raw(&stack.gateway, request.as_bytes());
    assert_eq!(chunked.status, 200, "{}", chunked.body);
    assert!(chunked.header("x-kvaffine-endpoint").is_some());
    // SSE streams through.
    let sse = chat(
        &stack,
        &json!({"messages": long_history(10), "max_tokens": 6, "stream": true}),
    );
    assert_eq!(sse.status, 200);
    assert!(
        sse.header("content-type")
            .unwrap_or("")
            .starts_with("text/event-stream")
    );
    assert!(sse.body.contains("data: [DONE]"));
}

#[test]
fn per_route_disable_and_modes() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    let body = json!({"messages": long_history(11), "max_tokens": 2}).to_string();
    let direct = send(
        &stack.gateway,
        "POST",
        "/direct/v1/chat/completions",
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
    assert_eq!(direct.status, 200);
    assert_eq!(
        direct.header("x-kvaffine-reason"),
        None,
        "the filter is off on /direct/"
    );
    let approx = send(
        &stack.gateway,
        "POST",
        "/approximate/v1/chat/completions",
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
    assert_eq!(approx.status, 200);
    assert_eq!(approx.header("x-kvaffine-mode"), Some("approximate"));
    let load = send(
        &stack.gateway,
        "POST",
        "/load-only/v1/chat/completions",
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
    assert_eq!(load.status, 200);
    assert_eq!(load.header("x-kvaffine-mode"), Some("load"));
}

#[test]
fn hot_reloading_the_filter_under_traffic_fails_no_request() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let stack = Stack::start(StackConfig::default()).unwrap();
    let gateway = stack.gateway.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let traffic = {
        let (stop, sent) = (stop.clone(), sent.clone());
        std::thread::spawn(move || {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let n = sent.load(Ordering::Relaxed);
                let body = json!({"messages": long_history(n % 5), "max_tokens": 2}).to_string();
                statuses.push(
                    send(
                        &gateway,
                        "POST",
                        "/v1/chat/completions",
                        &[("content-type", "application/json")],
                        body.as_bytes(),
                    )
                    .status,
                );
                sent.fetch_add(1, Ordering::Relaxed);
            }
            statuses
        })
    };
    poll("traffic before the reload", Duration::from_secs(20), || {
        sent.load(Ordering::Relaxed) >= 10
    })
    .unwrap();
    let reloads_before =
        stack.stat("extension_config_discovery.http_filter.kvaffine.config_reload");
    stack
        .reload_filter(&json!({"mode": "approximate"}))
        .unwrap();
    poll("the reload", Duration::from_secs(20), || {
        stack.stat("extension_config_discovery.http_filter.kvaffine.config_reload") > reloads_before
    })
    .unwrap();
    poll(
        "the new configuration in use",
        Duration::from_secs(20),
        || {
            chat(
                &stack,
                &json!({"messages": long_history(1), "max_tokens": 2}),
            )
            .header("x-kvaffine-mode")
                == Some("approximate")
        },
    )
    .unwrap();
    let after = sent.load(Ordering::Relaxed) + 10;
    poll("traffic after the reload", Duration::from_secs(20), || {
        sent.load(Ordering::Relaxed) >= after
    })
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    let statuses = traffic.join().unwrap();
    assert!(statuses.len() >= 20);
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
}

#[test]
fn http2_requests_are_routed() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (status, reason) = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .http2_prior_knowledge()
            .no_proxy()
            .build()
            .unwrap();
        let response = client
            .post(format!("http://{}/v1/chat/completions", stack.gateway))
            .header("content-type", "application/json")
            .body(json!({"messages": long_history(12), "max_tokens": 2}).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.version(), reqwest::Version::HTTP_2);
        let reason = response
            .headers()
            .get("x-kvaffine-reason")
            .map(|v| v.to_str().unwrap_or("").to_owned());
        (response.status().as_u16(), reason)
    });
    assert_eq!(status, 200);
    assert!(
        matches!(reason.as_deref(), Some("prefix" | "load")),
        "{reason:?}"
    );
}

#[test]
fn responses_are_routed_by_conversion_and_by_render() {
    for mode in ["convert", "render"] {
        let stack = Stack::start(StackConfig {
            filter: json!({"responses_tokenize": mode}),
            ..StackConfig::default()
        })
        .unwrap();
        let text: String = (0..400).map(|i| format!("r{i} ")).collect();
        let body = json!({"instructions": "be brief", "input": text, "max_output_tokens": 8, "cache_salt": "resp"});
        let first = post_json(&stack.gateway, "/v1/responses", &body);
        assert_eq!(first.status, 200, "{mode}: {}", first.body);
        let second = post_json(&stack.gateway, "/v1/responses", &body);
        assert_eq!(
            second.header("x-kvaffine-reason"),
            Some("prefix"),
            "{mode}: {:?}",
            second.headers
        );
        assert_eq!(
            second.header("x-kvaffine-endpoint"),
            first.header("x-kvaffine-endpoint")
        );
        assert!(
            second.json()["usage"]["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                > 300,
            "{mode}: {}",
            second.body
        );
    }
}

#[test]
fn sse_responses_stream_through_unbuffered() {
    // 40 output tokens at 8 ms each: the first event must arrive long before the last.
    let stack = Stack::start(StackConfig {
        replica_args: vec!["--time-scale".into(), "1".into()],
        ..StackConfig::default()
    })
    .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (first, last) = runtime.block_on(async {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let start = std::time::Instant::now();
        let mut response = client
            .post(format!("http://{}/v1/chat/completions", stack.gateway))
            .header("content-type", "application/json")
            .body(json!({"messages": [{"role": "user", "content": "stream please"}], "max_tokens": 40, "stream": true}).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.headers().get("x-kvaffine-reason").and_then(|v| v.to_str().ok()), Some("load"));
        let mut first = None;
        while let Some(chunk) = response.chunk().await.unwrap() {
            if first.is_none() && !chunk.is_empty() {
                first = Some(start.elapsed());
            }
        }
        (first.unwrap(), start.elapsed())
    });
    assert!(
        first * 3 < last,
        "first chunk after {first:?}, stream done after {last:?}"
    );
}

#[test]
fn the_shipped_envoy_configs_pass_envoys_own_validation() {
    use kvaffine_e2e::{ecds_yaml, envoy_binary, root, wasm_path};
    let dir = std::env::temp_dir().join(format!("kvaffine-validate-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("ecds")).unwrap();
    let filter =
        json!({"tokenizer_cluster": "tokenizer", "index_cluster": "kvaffined", "block_size": 64});
    let ecds = dir.join("ecds/kvaffine.yaml");
    std::fs::write(&ecds, ecds_yaml(&filter, &wasm_path()).unwrap()).unwrap();
    let endpoints =
        "[{endpoint: {address: {socket_address: {address: 10.0.0.5, port_value: 8000}}}}]";
    let gateway = std::fs::read_to_string(root().join("envoy/gateway.yaml"))
        .unwrap()
        .replace("{{ADMIN_PORT}}", "9901")
        .replace("{{GATEWAY_PORT}}", "8080")
        .replace("{{ECDS_PATH}}", &ecds.display().to_string())
        .replace("{{ECDS_DIR}}", &dir.join("ecds").display().to_string())
        .replace("{{POOL_ENDPOINTS}}", endpoints)
        .replace(
            "{{DAEMON_ENDPOINTS}}",
            "[{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 9100}}}}]",
        );
    assert!(
        gateway
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .all(|l| !l.contains("{{")),
        "every placeholder is filled"
    );
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, gateway).unwrap();
    let out = std::process::Command::new(envoy_binary().unwrap())
        .args(["--mode", "validate", "--use-dynamic-base-id", "-c"])
        .arg(&config)
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{log}");
    assert!(log.contains("OK"), "{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// kvaffined with `--auth-token-file`: a filter whose `index_token` is not in the file
/// gets 401s (counted) and fails open, every request answered; once the token is added
/// to the file (no restart) the same filter routes by prefix; probes and metrics stay
/// open, and the API refuses a request without a token.
/// The filter's token can come from the gateway's environment (a Kubernetes Secret in
/// the `standalone-auth` overlay): Envoy hands `KVAFFINE_INDEX_TOKEN` to the VM
/// (`vm_config.environment_variables` in envoy/kvaffine-filter.yaml) and the filter
/// sends it, with no token in its configuration.
#[test]
fn the_index_token_can_come_from_the_gateways_environment() {
    let dir = std::env::temp_dir().join(format!("kvaffine-auth-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, "env-token\n").unwrap();
    let stack = Stack::start(StackConfig {
        daemon_args: vec!["--auth-token-file".into(), tokens.display().to_string()],
        gateway_env: vec![("KVAFFINE_INDEX_TOKEN".into(), "env-token".into())],
        ..StackConfig::default()
    })
    .unwrap();
    let body = json!({"messages": long_history(60), "max_tokens": 4, "cache_salt": "auth-env"});
    let first = chat(&stack, &body);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(
        first.header("x-kvaffine-reason"),
        Some("load"),
        "{:?}",
        first.headers
    );
    continues_warm(&stack, &body, &first);
    assert_eq!(unauthorized(&stack), 0.0, "no lookup was refused");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_authenticated_index_routes_only_filters_holding_a_token() {
    let dir = std::env::temp_dir().join(format!("kvaffine-auth-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, "first-token\n").unwrap();
    let stack = Stack::start(StackConfig {
        daemon_args: vec!["--auth-token-file".into(), tokens.display().to_string()],
        filter: json!({"index_token": "second-token"}),
        ..StackConfig::default()
    })
    .unwrap();
    let body = |seed: usize| json!({"messages": long_history(seed), "max_tokens": 4, "cache_salt": format!("auth{seed}")});
    let refused = chat(&stack, &body(40));
    assert_eq!(refused.status, 200, "{}", refused.body);
    assert_eq!(
        refused.header("x-kvaffine-reason"),
        Some("index-unavailable")
    );
    assert!(unauthorized(&stack) >= 1.0);

    // Rotation: the new token joins the file; the filter's lookups pass once it is re-read.
    std::fs::write(&tokens, "first-token\nsecond-token\n").unwrap();
    poll("the token file re-read", Duration::from_secs(10), || {
        chat(&stack, &body(41)).header("x-kvaffine-reason") != Some("index-unavailable")
    })
    .unwrap();
    continues_warm(&stack, &body(42), &chat(&stack, &body(42)));

    let lookup = br#"{"keys": [1, 2, 3]}"#;
    let bare = send(
        &stack.daemon_addr,
        "POST",
        "/v1/lookup",
        &[("content-type", "application/json")],
        lookup,
    );
    assert_eq!(bare.status, 401, "{}", bare.body);
    assert_eq!(bare.header("www-authenticate"), Some("Bearer"));
    let listed = send(
        &stack.daemon_addr,
        "POST",
        "/v1/lookup",
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer first-token"),
        ],
        lookup,
    );
    assert_eq!(listed.status, 200, "{}", listed.body);
    assert_eq!(
        send(&stack.daemon_addr, "GET", "/v1/endpoints", &[], b"").status,
        401
    );
    assert_eq!(
        send(&stack.daemon_addr, "GET", "/healthz", &[], b"").status,
        200
    );
    assert_eq!(
        send(&stack.daemon_addr, "GET", "/readyz", &[], b"").status,
        200
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The filter reports what it holds: its VMs' linear memory and cached digests, summed
/// over the workers; a reload's new VMs start with empty caches, and the old VMs' share
/// leaves the gauges with them.
#[test]
fn the_filters_footprint_gauges_follow_its_vms_across_a_reload() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    let cached = || {
        stack
            .filter_metric("kvaffine.digest_cache_blocks")
            .expect("the digest cache gauge")
    };
    // Each distinct history is tokenized and its blocks cached; the gauge is brought up to
    // date when the next request arrives.
    for n in 0..8 {
        chat(
            &stack,
            &json!({"messages": long_history(n), "max_tokens": 2}),
        );
    }
    chat(
        &stack,
        &json!({"messages": long_history(0), "max_tokens": 2}),
    );
    let before = cached();
    assert!(before > 0.0, "digest cache gauge {before}");
    // The same VMs' memory holds those digests: a 16-byte fingerprint and a 32-byte
    // digest each, at the least.
    let memory = stack
        .filter_metric("kvaffine.vm_memory_bytes")
        .expect("the VM memory gauge");
    assert!(
        memory >= before * 48.0,
        "VM memory {memory} for {before} digests"
    );
    let reloads = stack.stat("extension_config_discovery.http_filter.kvaffine.config_reload");
    stack.reload_filter(&json!({"fallbacks": 1})).unwrap();
    poll("the reload", Duration::from_secs(20), || {
        stack.stat("extension_config_discovery.http_filter.kvaffine.config_reload") > reloads
    })
    .unwrap();
    // Requests without a prompt reach the new VMs (bringing their share up to date)
    // without filling their caches.
    poll("the old VMs' share gone", Duration::from_secs(20), || {
        send(&stack.gateway, "GET", "/v1/models", &[], b"");
        cached() < before
    })
    .unwrap();
}

/// The cached tokens of a streamed reply, from its last usage event.
fn streamed_cached(reply: &Reply) -> u64 {
    reply
        .body
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .filter_map(|event| {
            event
                .pointer("/usage/prompt_tokens_details/cached_tokens")?
                .as_u64()
        })
        .next_back()
        .unwrap_or(0)
}

/// Predicted against actual: every routed answer's cached tokens (non-streamed, and the
/// last usage event of a stream) reach kvaffined as outcomes, each paired with that
/// request's own prediction; the filter's per-replica stats agree, the console's history
/// lists them, and the replicas' own `vllm:prefix_cache_hits_total` shows the same hits.
#[test]
fn predictions_are_compared_with_what_the_replicas_served() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    let block = StackConfig::default().block_size as u64;
    // The replicas' hit counters are followed from kvaffined's first scrape of each.
    stack.wait_scraped().unwrap();
    let mut routed = 0;
    let (mut predicted, mut served, mut error) = (0, 0, 0);
    let mut seen = Vec::new();
    let mut count = |reply: &Reply, cached: u64| {
        assert_eq!(reply.status, 200, "{}", reply.body);
        let matched: u64 = reply
            .header("x-kvaffine-matched-blocks")
            .and_then(|m| m.parse().ok())
            .expect("a routed reply");
        routed += 1;
        predicted += matched * block;
        served += cached;
        error += (matched * block).abs_diff(cached);
        let by = reply.header("x-served-by").unwrap_or("").to_owned();
        seen.push((by, matched * block, cached));
    };
    for seed in 0..3 {
        let body = json!({"messages": long_history(700 + seed), "max_tokens": 4, "cache_salt": format!("outcome{seed}")});
        let first = chat(&stack, &body);
        count(&first, cached(&first));
        let mut next = body.clone();
        let messages = next["messages"].as_array_mut().unwrap();
        messages.push(first.json()["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "go on"}));
        let second = chat(&stack, &next);
        assert_eq!(second.header("x-kvaffine-reason"), Some("prefix"));
        assert!(cached(&second) > 0);
        count(&second, cached(&second));
        next["stream"] = json!(true);
        next["stream_options"] = json!({"include_usage": true});
        let streamed = chat(&stack, &next);
        assert!(streamed_cached(&streamed) > 0, "{}", streamed.body);
        count(&streamed, streamed_cached(&streamed));
    }
    // A stream without usage is routed but unmeasured.
    let quiet = chat(
        &stack,
        &json!({"messages": long_history(799), "max_tokens": 2, "stream": true}),
    );
    assert_eq!(quiet.status, 200);

    stack.wait_outcomes(routed).unwrap();
    assert_eq!(
        stack.daemon_metric("kvaffined_outcome_cached_tokens_total") as u64,
        served
    );
    assert_eq!(
        stack.daemon_metric("kvaffined_outcome_predicted_cached_tokens_total") as u64,
        predicted
    );
    // Each outcome is the reply's own: the error is what the replies show, summed. (It is
    // 0 when every turn's events were applied before the next was looked up; on a busy
    // machine a continuation may be predicted only what the events had confirmed.)
    let recent = send(&stack.daemon_addr, "GET", "/v1/outcomes", &[], b"").body;
    assert_eq!(
        stack.daemon_metric("kvaffined_outcome_prediction_error_tokens_total") as u64,
        error,
        "replies (served by, predicted, cached): {seen:?}; kvaffined: {recent}"
    );
    let envoy_stats = send(&stack.admin, "GET", "/stats?filter=kvaffine", &[], b"").body;
    let envoy_sum = |suffix: &str| -> u64 {
        envoy_stats
            .lines()
            .filter(|l| {
                l.starts_with("wasmcustom.kvaffine.endpoint.")
                    && l.split(':').next().is_some_and(|n| n.ends_with(suffix))
            })
            .filter_map(|l| l.rsplit_once(": ")?.1.trim().parse::<u64>().ok())
            .sum()
    };
    assert_eq!(envoy_sum(".cached_tokens"), served, "{envoy_stats}");
    assert_eq!(envoy_sum(".predicted_cached_tokens"), predicted);
    assert_eq!(envoy_sum(".prediction_error_tokens"), error);
    assert_eq!(envoy_sum(".outcomes"), routed);
    assert_eq!(
        stack.filter_metric("kvaffine.outcomes.unmeasured"),
        Some(1.0)
    );

    let view = send(&stack.daemon_addr, "GET", "/v1/outcomes", &[], b"");
    assert_eq!(view.status, 200);
    let view = view.json();
    assert_eq!(
        view["recent"].as_array().map(Vec::len),
        Some(routed as usize)
    );
    let bucketed: u64 = view["series"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["buckets"].as_array().unwrap())
        .map(|b| b["cached_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(bucketed, served);

    // The replicas' own counters, scraped: the same hits, whatever the answers carried.
    poll(
        "the replicas' hits scraped",
        Duration::from_secs(10),
        || stack.daemon_metric("kvaffined_replica_prefix_cache_hit_tokens_total") as u64 == served,
    )
    .unwrap();
    assert_eq!(
        stack.daemon_metric("kvaffined_booked_predicted_cached_tokens_total") as u64,
        predicted
    );

    // Whatever a sender names, the series stay one per followed replica, and no field is
    // longer than 256 bytes.
    let outcome = |endpoint: &str| {
        json!({"outcomes": [{"endpoint": endpoint, "reason": "prefix", "mode": "precise",
            "predicted_tokens": 1, "cached_tokens": 1, "prompt_tokens": 2}]})
        .to_string()
    };
    let post = |body: String| {
        send(
            &stack.daemon_addr,
            "POST",
            "/v1/outcomes",
            &[("content-type", "application/json")],
            body.as_bytes(),
        )
    };
    assert_eq!(post(outcome(&"x".repeat(300))).status, 400);
    assert_eq!(post(outcome("10.9.9.9:1")).status, 200);
    let metrics = send(&stack.daemon_addr, "GET", "/metrics", &[], b"").body;
    assert!(!metrics.contains("10.9.9.9"));
    assert!(metrics.contains("kvaffined_outcomes_total{endpoint=\"other\",result=\"exact\"} 1"));
}

/// A replica measured slow, then given no request for 30 s (its peer was faster), ranks
/// at the fleet's median again and is measured afresh by the new prompts it then gets:
/// here it was replaced by one as fast as its peer. Its old figures alone would have
/// ranked it 3x slower for good, and an idle fleet sent every new prompt to the peer (a
/// real vLLM replica measured slow while its host was loaded got no new conversation for
/// 120 s).
#[test]
fn a_replica_measured_slow_is_measured_afresh_once_its_figures_are_old() {
    use kvaffine_e2e::Upstream;
    use std::time::Instant;
    use vllm_emu::harness::EmuProcess;
    let mut replicas: Vec<EmuProcess> = ["1.5", "0.5"]
        .iter()
        .map(|scale| EmuProcess::start(&["--block-size", "16", "--time-scale", scale]))
        .collect();
    let upstreams = replicas
        .iter()
        .map(|r| Upstream::with_events(r.endpoint_flag()))
        .collect();
    let stack = Stack::front(StackConfig::default(), upstreams).unwrap();
    let prefill = |endpoint: &str| prefill(&stack, endpoint);
    let samples = |endpoint: &str| prefill(endpoint)["samples"].as_u64().unwrap_or(0);
    // Six new prompts of three lengths straight to each replica, each scraped before the
    // next.
    for sent in 0..6 {
        let words = 200 + (sent % 3) * 900;
        let before: Vec<u64> = replicas.iter().map(|r| samples(&r.http)).collect();
        for replica in &replicas {
            let text: String = (0..words).map(|i| format!("m{sent}w{i} ")).collect();
            let (status, reply) = replica.post(
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
            );
            assert_eq!(status, 200, "{reply}");
        }
        poll(
            "a scrape of every replica's finished request",
            Duration::from_secs(10),
            || {
                replicas
                    .iter()
                    .zip(&before)
                    .all(|(r, &before)| samples(&r.http) > before)
            },
        )
        .unwrap();
    }
    let (slow, fast) = (replicas[0].http.clone(), replicas[1].http.clone());
    let rate = |endpoint: &str, key: &str| prefill(endpoint)[key].as_f64().unwrap_or(0.0);
    let was = prefill(&slow);
    assert_eq!(was["source"], "measured", "{was}");
    assert!(
        rate(&slow, "tokens_per_second") < 0.5 * rate(&fast, "tokens_per_second"),
        "{was} against {}",
        prefill(&fast)
    );
    replicas[0].restart_with(&[("--time-scale", "0.5")]);
    let restarted = Instant::now();
    // New prompts one at a time through the gateway until the replaced replica is measured
    // at its peer's speed (ranked at the fleet's median: within 10% of it).
    let mut served: Vec<(f64, String)> = Vec::new();
    for sent in 0.. {
        let now = prefill(&slow);
        let measured = now["measured_tokens_per_second"].as_f64().unwrap_or(0.0);
        if now["source"] == "fleet" && measured > 0.8 * rate(&fast, "measured_tokens_per_second") {
            break;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(120),
            "not measured afresh in 120 s: {now}; served: {served:?}"
        );
        let text: String = (0..800).map(|w| format!("f{sent}w{w} ")).collect();
        let reply = chat(
            &stack,
            &json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
        );
        assert_eq!(reply.status, 200, "{}", reply.body);
        served.push((
            restarted.elapsed().as_secs_f64(),
            reply.header("x-served-by").unwrap_or("").to_owned(),
        ));
    }
    let first = served
        .iter()
        .find(|(_, by)| *by == slow)
        .map_or(0.0, |(at, _)| *at);
    eprintln!(
        "replaced replica: its first new prompt {first:.1} s after the restart, {} of {} prompts, measured afresh {}, its peer {}",
        served.iter().filter(|(_, by)| *by == slow).count(),
        served.len(),
        prefill(&slow),
        prefill(&fast)
    );
    // While its old figures were current (its last request finished before the restart,
    // and they stand for 30 s), every new prompt went to its peer: they were what kept it
    // from traffic.
    let early: Vec<&(f64, String)> = served.iter().filter(|(at, _)| *at < 25.0).collect();
    assert!(!early.is_empty(), "{served:?}");
    assert!(early.iter().all(|(_, by)| *by == fast), "{served:?}");
    assert!(served.iter().any(|(_, by)| *by == slow), "{served:?}");
}

/// Two emulated replicas at these time scales (the first the fast one) behind kvaffined
/// scraping each once when it starts following it and then once a week, so that only
/// their events tell it anything; with their addresses.
fn fleet_timed_by_events_alone(scales: [f64; 2]) -> (Stack, String, String) {
    let config = StackConfig {
        replica_args: vec!["--time-scale".into(), scales[0].to_string()],
        per_replica_args: vec![
            Vec::new(),
            vec!["--time-scale".into(), scales[1].to_string()],
        ],
        daemon_args: vec!["--scrape-interval-ms".into(), "604800000".into()],
        ..StackConfig::default()
    };
    let stack = Stack::start(config).unwrap();
    stack.wait_scraped().unwrap();
    let (fast, slow) = (
        stack.replicas[0].http.clone(),
        stack.replicas[1].http.clone(),
    );
    (stack, fast, slow)
}

/// A replica's `prefill` in kvaffined's `/v1/endpoints`.
fn prefill(stack: &Stack, endpoint: &str) -> Value {
    stack
        .endpoint(endpoint)
        .map(|e| e["prefill"].clone())
        .unwrap_or_default()
}

/// Before a replica's metrics have measured anything, kvaffined times it by its KV events:
/// the work of the picks whose last block it stored, over the time it was busy with them.
/// A fleet starting cold is ranked by speed from its first prefills on, not as equals
/// until requests have finished.
#[test]
fn kvaffined_times_cold_replicas_by_their_events_before_their_metrics() {
    // One replica three times as slow as the other (the emulator's model prefills
    // 1 / 0.1955 ms = 5,115 uncached tokens/s after a 40 ms fixed cost, both scaled by
    // --time-scale). kvaffined scrapes each replica once when it starts following it and
    // then once a week: its metrics teach it nothing here.
    let scales = [0.5, 1.5];
    let (stack, fast, slow) = fleet_timed_by_events_alone(scales);
    let prefill = |endpoint: &str| prefill(&stack, endpoint);
    for replica in [&fast, &slow] {
        assert_eq!(
            prefill(replica)["source"],
            "default",
            "{}",
            prefill(replica)
        );
    }
    // Two new conversations at once, one to each replica (the second ranked behind the
    // first's booking, or, ranked before it was booked, at the next turn of requests
    // nothing tells apart): about 2,400 tokens each, evidence enough in one busy period.
    let prompt = |pair: usize, i: usize| -> Value {
        let text: String = (0..2400).map(|w| format!("c{pair}x{i}w{w} ")).collect();
        json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1})
    };
    let replies: Vec<Reply> = std::thread::scope(|scope| {
        let sent: Vec<_> = (0..2)
            .map(|i| {
                let (stack, prompt) = (&stack, &prompt);
                scope.spawn(move || chat(stack, &prompt(0, i)))
            })
            .collect();
        sent.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let mut served: Vec<String> = Vec::new();
    for reply in &replies {
        assert_eq!(reply.status, 200, "{}", reply.body);
        let body: Value = serde_json::from_str(&reply.body).unwrap();
        let tokens = body["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        assert!(tokens > 2048, "{tokens} prompt tokens");
        served.push(reply.header("x-served-by").unwrap_or("").to_owned());
    }
    served.sort();
    let mut both = vec![fast.clone(), slow.clone()];
    both.sort();
    assert_eq!(served, both, "one new conversation each");
    poll(
        "both replicas timed by their events",
        Duration::from_secs(10),
        || {
            [&fast, &slow]
                .iter()
                .all(|r| prefill(r)["source"] == "events")
        },
    )
    .unwrap();
    for (replica, scale) in [(&fast, scales[0]), (&slow, scales[1])] {
        let view = prefill(replica);
        eprintln!("{replica} at time scale {scale}: {view}");
        let rate = view["tokens_per_second"].as_f64().unwrap_or(0.0);
        // A lower bound (the hops to the replica and back are in the time), near the
        // model's rate: one 2,400-token prefill and its fixed cost (0.26 s on the fast
        // replica; the bound leaves room for 0.4 s of hops on a loaded host).
        let model = 1e3 / 0.1955 / scale;
        assert!(
            rate > 0.4 * model && rate < 1.2 * model,
            "{replica}: timed at {rate:.0} tokens/s, its model prefills {model:.0}: {view}"
        );
        assert_eq!(view["samples"], 0, "no scrape taught anything: {view}");
        assert!(view["measured_tokens_per_second"].is_null(), "{view}");
    }
    // Idle, a new conversation goes to the faster replica, by load, every time.
    for i in 0..3 {
        new_conversation_goes_to(&stack, &prompt(1, i), &fast, &format!("request {i}"));
    }
}

/// Sends `body`, a new conversation, through the gateway and asserts it was pinned by load
/// to `replica`; `what` names it in the failure, beside every replica's speed as ranked.
fn new_conversation_goes_to(stack: &Stack, body: &Value, replica: &str, what: &str) {
    let reply = chat(stack, body);
    assert_eq!(reply.status, 200, "{what}: {}", reply.body);
    assert_eq!(reply.header("x-kvaffine-reason"), Some("load"), "{what}");
    assert_eq!(
        reply.header("x-served-by"),
        Some(replica),
        "{what}: ranked by {:?}",
        stack
            .endpoints()
            .iter()
            .map(|e| (e["endpoint"].clone(), e["prefill"].clone()))
            .collect::<Vec<_>>()
    );
}

/// A replica whose first prefill is overdue is known to be slow before it ends: new
/// conversations that arrive meanwhile go to the replica that has shown its speed, not
/// half to each as to replicas nothing tells apart.
#[test]
fn a_replica_overdue_with_its_first_prefill_gets_no_new_conversations_meanwhile() {
    // One replica eight times as slow as the other: a 2,400-token prompt prefills in
    // about 0.26 s on the fast one and 2.0 s on the slow one (the emulator's model, 5,115
    // tokens/s after 40 ms, scaled by --time-scale). kvaffined scrapes once a week, so
    // only the replicas' events tell it anything.
    let (stack, fast, slow) = fleet_timed_by_events_alone([0.5, 4.0]);
    let prompt = |pair: usize, i: usize| -> Value {
        let text: String = (0..2400).map(|w| format!("o{pair}x{i}w{w} ")).collect();
        json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1})
    };
    // Each first turn's replica, as it ends.
    let (ended_tx, ended) = std::sync::mpsc::channel::<Option<String>>();
    std::thread::scope(|scope| {
        // Two new conversations at once, one to each replica, as nothing tells them
        // apart yet.
        let pending: Vec<_> = (0..2)
            .map(|i| {
                let (stack, prompt, tx) = (&stack, &prompt, ended_tx.clone());
                scope.spawn(move || {
                    let reply = chat(stack, &prompt(0, i));
                    let _ = tx.send(reply.header("x-served-by").map(str::to_owned));
                    reply
                })
            })
            .collect();
        assert_eq!(
            ended.recv().unwrap(),
            Some(fast.clone()),
            "the fast one ends first"
        );
        // While the slow replica's first prefill goes on, one new conversation after
        // another: each goes to the fast replica.
        for i in 0..3 {
            new_conversation_goes_to(&stack, &prompt(1, i), &fast, &format!("conversation {i}"));
            assert!(
                ended.try_recv().is_err(),
                "the slow replica's first prefill ended before conversation {i} was answered: \
                 the test timed nothing"
            );
        }
        // What did it: nothing has timed the slow replica, and its wait caps it below the
        // fast one, which its events have timed (ranked as the fleet: it is all of it).
        let (fast_view, slow_view) = (prefill(&stack, &fast), prefill(&stack, &slow));
        assert!(
            ended.try_recv().is_err(),
            "read after the slow prefill ended"
        );
        let rate = |view: &Value| view["tokens_per_second"].as_f64().unwrap_or(0.0);
        assert_ne!(slow_view["source"], "events", "{slow_view}");
        assert!(
            rate(&slow_view) < 0.5 * rate(&fast_view),
            "slow {slow_view}, fast {fast_view}"
        );
        for handle in pending {
            let reply = handle.join().unwrap();
            assert_eq!(reply.status, 200, "{}", reply.body);
        }
    });
    assert_eq!(
        ended.try_recv().ok().flatten(),
        Some(slow),
        "the other first turn"
    );
}

/// kvaffined is told nothing of the replicas' speed: it learns each one's from the
/// prefill histograms the replica exports, as vLLM does, and ranks with it.
#[test]
fn kvaffined_learns_each_replicas_prefill_speed_from_its_metrics() {
    use kvaffine_e2e::Upstream;
    use vllm_emu::harness::EmuProcess;
    // The emulator's model prefills 1 / 0.1955 ms = 5,115 uncached tokens/s after a 40 ms
    // fixed cost, both scaled by --time-scale: one replica three times as slow as the other.
    let scales = [0.5, 1.5];
    let replicas: Vec<EmuProcess> = scales
        .iter()
        .map(|scale| EmuProcess::start(&["--block-size", "16", "--time-scale", &scale.to_string()]))
        .collect();
    let upstreams = replicas
        .iter()
        .map(|r| Upstream::with_events(r.endpoint_flag()))
        .collect();
    let mut stack = Stack::front(StackConfig::default(), upstreams).unwrap();
    let prefill = |endpoint: &str| -> Value {
        let (status, text) =
            vllm_emu::harness::http(&stack.daemon_addr, "GET", "/v1/endpoints", "");
        assert_eq!(status, 200, "{text}");
        let all: Value = serde_json::from_str(&text).unwrap();
        all["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == endpoint)
            .map(|e| e["prefill"].clone())
            .unwrap()
    };
    for replica in &replicas {
        assert_eq!(
            prefill(&replica.http)["source"],
            "default",
            "nothing measured yet"
        );
    }
    // New conversations of four lengths (200 to 2,000 words), so the fixed cost and the
    // per-token speed can be told apart: three of each, sent straight to each replica (the
    // daemon learns from the replica's own metrics, whoever sent the request), each scraped
    // (every 500 ms) as a sample of its own before the next. Twelve samples a replica: a
    // request stalled by the loaded host (in one full `cargo xtask test`, a 3.4 k tokens/s
    // replica was fitted at 190 ms fixed cost from the first two samples, 60 ms when
    // unstalled) moves the fit a fraction as much.
    let samples = |endpoint: &str| prefill(endpoint)["samples"].as_u64().unwrap_or(0);
    for sent in 0..12 {
        let words = 200 + (sent % 4) * 600;
        let before: Vec<u64> = replicas.iter().map(|r| samples(&r.http)).collect();
        for replica in &replicas {
            let text: String = (0..words).map(|i| format!("s{sent}w{i} ")).collect();
            let (status, reply) = replica.post(
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
            );
            assert_eq!(status, 200, "{reply}");
        }
        kvaffine_e2e::poll(
            "a scrape of every replica's finished request",
            std::time::Duration::from_secs(10),
            || {
                replicas
                    .iter()
                    .zip(&before)
                    .all(|(r, &before)| samples(&r.http) > before)
            },
        )
        .unwrap();
    }
    for (replica, scale) in replicas.iter().zip(scales) {
        let view = prefill(&replica.http);
        let rate = view["measured_tokens_per_second"].as_f64().unwrap();
        let overhead = view["measured_overhead_ms"].as_f64().unwrap();
        let expected = 1e3 / 0.1955 / scale;
        eprintln!("{} at time scale {scale}: {view}", replica.http);
        assert!(
            (rate / expected - 1.0).abs() < 0.2,
            "{}: measured {rate:.0} tokens/s, its model prefills {expected:.0}: {view}",
            replica.http
        );
        assert!(
            overhead > 20.0 * scale && overhead < 80.0 * scale,
            "{}: measured a {overhead:.1} ms fixed cost, its model has {} ms: {view}",
            replica.http,
            40.0 * scale
        );
        assert_eq!(
            view["source"], "measured",
            "3x apart, neither is the fleet's median"
        );
        assert_eq!(
            view["tokens_per_second"],
            view["measured_tokens_per_second"]
        );
    }
    // Idle, the fast replica finishes a new prompt first: it is ranked first every time,
    // by load (nothing cached anywhere), while the slow one's figures are current (a
    // request finished there less than 30 s ago).
    for i in 0..4 {
        let text: String = (0..800).map(|w| format!("n{i}w{w} ")).collect();
        let reply = chat(
            &stack,
            &json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
        );
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-kvaffine-reason"), Some("load"));
        assert_eq!(
            reply.header("x-served-by"),
            Some(replicas[0].http.as_str()),
            "request {i}"
        );
    }
    // A daemon that starts beside it (a gateway pod joining, or this one restarting, with
    // `--peer`) ranks each replica at what its peer measured before it has measured
    // anything itself, rather than at the default.
    let peer = stack.start_peer_daemon().unwrap();
    let speeds_at = |daemon: &str| -> Vec<Value> {
        let (status, text) = vllm_emu::harness::http(daemon, "GET", "/v1/endpoints", "");
        assert_eq!(status, 200, "{text}");
        let all: Value = serde_json::from_str(&text).unwrap();
        replicas
            .iter()
            .map(|r| {
                all["endpoints"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|e| e["endpoint"] == r.http.as_str())
                    .map(|e| e["prefill"].clone())
                    .unwrap()
            })
            .collect()
    };
    kvaffine_e2e::poll(
        "the peer's speeds at the new daemon",
        std::time::Duration::from_secs(20),
        || speeds_at(&peer).iter().all(|p| p["source"] == "peer"),
    )
    .unwrap();
    // The first daemon may have learned from one more scrape since the new one asked: the
    // figures agree closely, not exactly (the two replicas stand 3x apart, and the
    // default is 5,000 tokens/s).
    for (theirs, ours) in speeds_at(&peer).iter().zip(speeds_at(&stack.daemon_addr)) {
        let near = |key: &str, measured: &str| {
            let taken = theirs[key].as_f64().unwrap();
            let measured = ours[measured].as_f64().unwrap();
            assert!(
                (taken / measured - 1.0).abs() < 0.15,
                "{key}: {theirs} against {ours}"
            );
        };
        near("tokens_per_second", "measured_tokens_per_second");
        near("overhead_ms", "measured_overhead_ms");
        assert!(theirs["measured_tokens_per_second"].is_null(), "{theirs}");
    }
}
