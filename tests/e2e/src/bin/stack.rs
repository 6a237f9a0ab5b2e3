//! `stack demo` and `stack up`: the whole kvaffine stack on loopback, run by
//! `cargo xtask demo` and `cargo xtask up`.

use std::time::Instant;

use anyhow::{Context, bail};
use kvaffine_e2e::client::post_json;
use kvaffine_e2e::{Stack, StackConfig};
use serde_json::{Value, json};
use vllm_emu::harness::http;

const USAGE: &str = "usage: stack demo | stack up [--replicas N] [--gateway-port P]";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("demo") => demo(),
        Some("up") => up(&args[1..]),
        _ => bail!("{USAGE}"),
    }
}

/// What the demo prints about one turn.
struct Turn {
    answer: Value,
    endpoint: Option<String>,
    reason: Option<String>,
    ms: f64,
}

fn post(gateway: &str, body: &Value) -> anyhow::Result<Turn> {
    let start = Instant::now();
    let reply = post_json(gateway, "/v1/chat/completions", body);
    if reply.status != 200 {
        bail!("gateway answered {}: {}", reply.status, reply.body);
    }
    Ok(Turn {
        answer: reply.json(),
        endpoint: reply
            .header("x-kvaffine-endpoint")
            .or_else(|| reply.header("x-served-by"))
            .map(str::to_owned),
        reason: reply.header("x-kvaffine-reason").map(str::to_owned),
        ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

fn demo() -> anyhow::Result<()> {
    println!(
        "starting 2 vllm-emu replicas (GPT-OSS-20B timing, 64-token blocks), kvaffined and Envoy with the kvaffine filter..."
    );
    let stack = Stack::start(StackConfig {
        block_size: 64,
        replica_args: vec!["--time-scale".into(), "1".into()],
        ..StackConfig::default()
    })?;
    println!(
        "gateway http://{}  kvaffined http://{}",
        stack.gateway, stack.daemon_addr
    );
    let document: String = (0..4000)
        .map(|i| format!("line{} ", (i * 7919) % 9973))
        .collect();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a careful code reviewer."}),
        json!({"role": "user", "content": format!("Review this file:\n{document}")}),
    ];
    let salt = "demo-tenant";
    let turn = |messages: &[Value], n: usize| -> anyhow::Result<Value> {
        let Turn {
            answer,
            endpoint,
            reason,
            ms,
        } = post(
            &stack.gateway,
            &json!({"model": "emu-model", "messages": messages, "max_tokens": 24, "cache_salt": salt}),
        )?;
        let prompt = answer
            .pointer("/usage/prompt_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let cached = answer
            .pointer("/usage/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        println!(
            "turn {n}: {prompt:>5} prompt tokens -> {} ({}), {cached:>5} served from its KV cache, {ms:.0} ms",
            endpoint.unwrap_or_else(|| "?".into()),
            reason.unwrap_or_else(|| "?".into()),
        );
        Ok(answer)
    };
    let first = turn(&messages, 1)?;
    messages.push(
        first
            .pointer("/choices/0/message")
            .cloned()
            .unwrap_or(Value::Null),
    );
    messages.push(json!({"role": "user", "content": "Now list the three most important fixes."}));
    turn(&messages, 2)?;
    let (_, endpoints) = http(&stack.daemon_addr, "GET", "/v1/endpoints", "");
    let endpoints: Value = serde_json::from_str(&endpoints)?;
    for endpoint in endpoints["endpoints"].as_array().into_iter().flatten() {
        println!(
            "kvaffined sees {}: {} events applied, keys {}",
            endpoint["endpoint"].as_str().unwrap_or("?"),
            endpoint["status"]["events_applied"],
            endpoint["status"]["alignment"].as_str().unwrap_or("?"),
        );
    }
    Ok(())
}

fn up(args: &[String]) -> anyhow::Result<()> {
    let mut config = StackConfig {
        block_size: 64,
        replica_args: vec!["--time-scale".into(), "1".into()],
        gateway_port: 8080,
        ..StackConfig::default()
    };
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest
            .next()
            .with_context(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--replicas" => config.replicas = value.parse().context("--replicas")?,
            "--gateway-port" => config.gateway_port = value.parse().context("--gateway-port")?,
            _ => bail!("unknown flag {flag}\n{USAGE}"),
        }
    }
    if config.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    let stack = Stack::start(config)?;
    let replicas: Vec<&str> = stack.replicas.iter().map(|r| r.http.as_str()).collect();
    println!("kvaffine gateway ready on http://{}", stack.gateway);
    println!("  replicas: {}", replicas.join(", "));
    println!(
        "  kvaffined: http://{}   envoy admin: http://{}",
        stack.daemon_addr, stack.admin
    );
    println!(
        "  try: curl http://{}/v1/chat/completions -H 'content-type: application/json' -d '{{\"model\":\"emu-model\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'",
        stack.gateway
    );
    println!("Ctrl-C stops everything.");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let mut terminate =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                result = tokio::signal::ctrl_c() => result,
                _ = terminate.recv() => Ok(()),
            }
        })?;
    println!("stopping");
    drop(stack);
    Ok(())
}
