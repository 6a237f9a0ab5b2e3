//! `cargo xtask up`'s contract, checked from outside through the `stack` binary it runs:
//! the flags, the lines it prints, and `--upstream` in front of replicas it did not start
//! (here emulated; `real_vllm.rs` does the same with real vLLM).

use std::time::Duration;

use kvaffine_e2e::UpProcess;
use kvaffine_e2e::client::post_json;
use serde_json::json;
use vllm_emu::harness::EmuProcess;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

#[test]
fn upstream_refuses_engine_and_replicas_beside_it() {
    for extra in [["--engine", "vllm"], ["--replicas", "3"]] {
        let mut args = vec!["--upstream", "127.0.0.1:9"];
        args.extend(extra);
        let error = UpProcess::start(&args)
            .err()
            .expect("it must refuse")
            .to_string();
        assert!(
            error.contains("--upstream fronts replicas you run"),
            "{error}"
        );
    }
    let error = UpProcess::start(&["--block-size", "64"])
        .err()
        .expect("--block-size alone must be refused")
        .to_string();
    assert!(error.contains("go with --upstream"), "{error}");
}

#[test]
fn upstreams_that_disagree_on_the_block_size_are_named() {
    let (a, b) = (
        EmuProcess::start(&["--block-size", "16"]),
        EmuProcess::start(&["--block-size", "64"]),
    );
    let error = UpProcess::start(&["--upstream", &a.http, "--upstream", &b.http])
        .err()
        .expect("it must refuse")
        .to_string();
    assert!(
        error.contains(&format!("{} 16", a.http)) && error.contains(&format!("{} 64", b.http)),
        "{error}"
    );
}

#[test]
fn upstream_fronts_replicas_it_did_not_start() {
    let replicas = [
        EmuProcess::start(&["--block-size", "16"]),
        EmuProcess::start(&["--block-size", "16"]),
    ];
    let port = free_port().to_string();
    let up = UpProcess::start(&[
        "--upstream",
        &replicas[0].http,
        "--upstream",
        &replicas[1].http,
        "--gateway-port",
        &port,
        // The emulated replicas are instant.
        "--prefill-tokens-per-second",
        "1e12",
    ])
    .unwrap();
    assert_eq!(
        up.field("replicas:"),
        Some(format!("{}, {}", replicas[0].http, replicas[1].http)),
        "{:?}",
        up.lines
    );
    let kvaffined = up.field("kvaffined:").unwrap();
    assert!(kvaffined.starts_with("http://127.0.0.1:"), "{kvaffined}");
    let gateway = up.gateway().unwrap();
    assert_eq!(gateway, format!("127.0.0.1:{port}"));
    // The block size came from the replicas (16): a continuation is served from cache.
    let history: String = (0..400).map(|i| format!("w{} ", i * 31 % 997)).collect();
    let mut messages = vec![json!({"role": "user", "content": history})];
    let first = post_json(
        &gateway,
        "/v1/chat/completions",
        &json!({"model": "emu-model", "messages": messages, "max_tokens": 8}),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    messages.push(first.json()["choices"][0]["message"].clone());
    messages.push(json!({"role": "user", "content": "more"}));
    let second = post_json(
        &gateway,
        "/v1/chat/completions",
        &json!({"model": "emu-model", "messages": messages, "max_tokens": 8}),
    );
    assert_eq!(
        second.header("x-kvaffine-reason"),
        Some("prefix"),
        "{:?}",
        second.headers
    );
    assert_eq!(second.header("x-served-by"), first.header("x-served-by"));
    // The prediction counts only blocks the replica's events confirm, and these instant
    // replicas answer before kvaffined may have applied turn 1's: it is never above what
    // was served, and equal once the events are in. Equal means kvaffine's keys are the
    // replica's, so the block size it read (16) is theirs.
    let outcome = |reply: &kvaffine_e2e::client::Reply| {
        let cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        let matched: u64 = reply
            .header("x-kvaffine-matched-blocks")
            .and_then(|m| m.parse().ok())
            .unwrap_or(u64::MAX);
        (matched, cached)
    };
    let (matched, cached) = outcome(&second);
    assert!(
        cached > 0 && matched * 16 <= cached,
        "{matched} blocks, {cached} cached"
    );
    let again = json!({"model": "emu-model", "messages": messages, "max_tokens": 8});
    kvaffine_e2e::poll(
        "a prediction equal to what was served",
        Duration::from_secs(10),
        || {
            let (matched, cached) = outcome(&post_json(&gateway, "/v1/chat/completions", &again));
            cached > 0 && matched * 16 == cached
        },
    )
    .unwrap();
    assert!(up.stop().unwrap().success());
    // It stopped only what it started: the replicas still answer.
    assert_eq!(replicas[0].get("/health").0, 200);
}
